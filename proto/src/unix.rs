//! gRPC channels over unix sockets, the transport of every kubelet API:
//! how gpumem dials kubelet and how the test kit's kubelet dials gpumem.

use std::path::Path;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

/// A gRPC channel to the unix socket at `path`, connected now so a missing
/// socket is reported at once. The URI is a placeholder: nothing on a unix
/// socket reads `:authority`.
pub async fn connect(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path = path.to_owned();
    Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
}
