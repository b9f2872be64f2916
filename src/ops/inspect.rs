//! `gpumem inspect`: the node's GPUs and who holds them, read from the
//! running plugin's status endpoint, or straight from kubelet's
//! pod-resources API when no plugin answers.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::ops::status::NodeStatus;

const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("no gpumem plugin answers at {addr}: {message}")]
    Unreachable { addr: SocketAddr, message: String },
    #[error("the plugin at {addr} answered {status}")]
    Status { addr: SocketAddr, status: u16 },
    #[error("the plugin at {addr} sent a status this gpumem cannot read: {message}")]
    Decode { addr: SocketAddr, message: String },
}

/// The address to ask: a wildcard listen address means this host.
pub fn local(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port())
    } else {
        addr
    }
}

/// GET /status from a running plugin.
pub async fn fetch(addr: SocketAddr) -> Result<NodeStatus, InspectError> {
    let unreachable = |message: String| InspectError::Unreachable { addr, message };
    let call = async {
        let stream = TcpStream::connect(addr)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let driver = tokio::spawn(connection);
        let request = Request::get("/status")
            .header(hyper::header::HOST, addr.to_string())
            .body(http_body_util::Empty::<hyper::body::Bytes>::new())
            .map_err(|e| unreachable(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| unreachable(e.to_string()))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| unreachable(e.to_string()))?
            .to_bytes();
        driver.abort();
        if !status.is_success() {
            return Err(InspectError::Status {
                addr,
                status: status.as_u16(),
            });
        }
        serde_json::from_slice(&body).map_err(|e| InspectError::Decode {
            addr,
            message: e.to_string(),
        })
    };
    tokio::time::timeout(TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(unreachable(format!("no answer within {TIMEOUT:?}"))))
}
