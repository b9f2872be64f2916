//! `gpumem inspect`: the node's GPUs and who holds them, read from the
//! running plugin's status endpoint, or straight from kubelet's
//! pod-resources API when no plugin answers.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::deviceplugin::podresources::PodResources;
use crate::isolation::inject::Isolation;
use crate::node::gpu::GpuError;
use crate::node::hardware::Hardware;
use crate::node::inventory::{Inventory, InventoryError};
use crate::node::resource::ResourceName;
use crate::node::units::MemoryUnit;
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

/// What keeps `inspect` from reading the node directly.
#[derive(Debug, thiserror::Error)]
pub enum NodeReadError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Inventory(#[from] InventoryError),
}

/// What the node looks like, read directly where it is not asked of the
/// running plugin.
pub struct DirectRead<'a> {
    pub hardware: &'a Hardware,
    pub unit: MemoryUnit,
    pub resource_name: &'a ResourceName,
    pub pod_resources_socket: &'a std::path::Path,
    pub isolation: &'a Isolation,
}

/// The node's status: from the running plugin at `plugin` (its
/// `--metrics-addr`) where it answers, otherwise read directly (GPUs,
/// pod-resources, accounting files).
pub async fn status(
    plugin: Option<SocketAddr>,
    node: DirectRead<'_>,
) -> Result<NodeStatus, NodeReadError> {
    let from_plugin = match plugin {
        Some(addr) => Some(fetch(local(addr)).await),
        None => None,
    };
    match from_plugin {
        Some(Ok(status)) => Ok(status),
        fallback => {
            if let Some(Err(err)) = fallback {
                tracing::info!(%err, "reading the node directly");
            }
            let inventory = Inventory::new(node.hardware.discover()?, node.unit)?;
            let resource = node.resource_name.to_string();
            let holdings = PodResources::new(node.pod_resources_socket, &resource)
                .holdings()
                .await;
            Ok(NodeStatus::build(
                &inventory,
                &resource,
                false,
                holdings,
                node.isolation,
            ))
        }
    }
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
