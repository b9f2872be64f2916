//! One HTTP/1.1 exchange on a fresh connection, as kube-scheduler's
//! extender client makes each call after idling: for the extender's tests
//! and benchmark.

use std::net::SocketAddr;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::Request;
use hyper_util::rt::TokioIo;

/// `method path` to `addr` with `body` as JSON; the status and the body
/// answered, or what failed.
pub async fn exchange(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Bytes,
) -> Result<(u16, Bytes), String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake with {addr}: {e}"))?;
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, addr.to_string())
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(body))
        .map_err(|e| format!("{method} {path}: {e}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("{method} {path}: {e}"))?;
    let status = response.status().as_u16();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("{method} {path}: reading the answer: {e}"))?
        .to_bytes();
    Ok((status, bytes))
}
