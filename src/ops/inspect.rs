//! `gpumem inspect`: the node's GPUs and who holds them, read from the
//! running plugin's status socket, or straight from kubelet's
//! pod-resources API when no plugin answers.

use crate::error_text::one_line;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tracing::warn;

use crate::isolation::inject::Isolation;
use crate::kubelet::podresources::PodResources;
use crate::node::gpu::GpuError;
use crate::node::hardware::Hardware;
use crate::node::inventory::{Inventory, InventoryError};
use crate::node::resource::ResourceName;
use crate::node::units::MemoryUnit;
use crate::ops::status::NodeStatus;

const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("no gpumem plugin answers at {} (--status-socket): {message}", socket.display())]
    Unreachable { socket: PathBuf, message: String },
    #[error(
        "the plugin's status socket {} is not open to this user (only to the plugin's, root \
         in the DaemonSet): run inspect as root on the node, or through `kubectl exec \
         ds/gpumem -- gpumem inspect`",
        socket.display()
    )]
    Denied { socket: PathBuf },
    #[error("the plugin at {} answered {status}", socket.display())]
    Status { socket: PathBuf, status: u16 },
    #[error("the plugin at {} sent a status this gpumem cannot read: {message}", socket.display())]
    Decode { socket: PathBuf, message: String },
    #[error(
        "{direct}: --state-dir {} does not exist (the plugin's --state-dir, where each \
         container's accounting is; or --isolation none)",
        path.display()
    )]
    NoStateDir { direct: Direct, path: PathBuf },
}

/// Reading the node itself, and why: no plugin answered where `inspect`
/// asked (`None`: it was told not to ask). Says so in front of whatever
/// then fails, as that error would otherwise point elsewhere.
#[derive(Debug)]
pub struct Direct {
    unanswered: Option<Box<InspectError>>,
}

impl Direct {
    pub fn after(unanswered: Option<InspectError>) -> Direct {
        Direct {
            unanswered: unanswered.map(Box::new),
        }
    }

    /// Once the GPUs are read: checks what reading the containers needs of
    /// `isolation`, and warns that no plugin answered.
    pub fn check(self, isolation: &Isolation) -> Result<(), InspectError> {
        if let Isolation::Shim(shim) = isolation {
            // Missing, every container would look gone, with no word why.
            if !shim.state_dir.is_dir() {
                return Err(InspectError::NoStateDir {
                    path: shim.state_dir.clone(),
                    direct: self,
                });
            }
        }
        if self.unanswered.is_some() {
            warn!("{self}");
        }
        Ok(())
    }
}

impl fmt::Display for Direct {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.unanswered {
            Some(err) => write!(f, "{err}; reading the node directly"),
            None => f.write_str("reading the node directly"),
        }
    }
}

/// What keeps `inspect` from reading the node directly, after why it read
/// the node at all.
#[derive(Debug, thiserror::Error)]
pub enum NodeReadError {
    #[error("{direct}")]
    Gpu {
        direct: Direct,
        #[source]
        source: GpuError,
    },
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    #[error(transparent)]
    List(#[from] crate::deviceplugin::list::TooLarge),
    #[error(transparent)]
    Check(#[from] InspectError),
}

/// What the node looks like, read directly where it is not asked of the
/// running plugin.
pub struct DirectRead<'a> {
    pub hardware: &'a dyn Hardware,
    pub unit: MemoryUnit,
    pub resource_name: &'a ResourceName,
    pub pod_resources_socket: &'a std::path::Path,
    pub isolation: &'a Isolation,
}

/// The node's status: from the running plugin at `plugin` (its
/// `--status-socket`) where it answers, otherwise read directly (GPUs,
/// pod-resources, accounting files).
pub async fn status(
    plugin: Option<&Path>,
    node: DirectRead<'_>,
) -> Result<NodeStatus, NodeReadError> {
    let from_plugin = match plugin {
        Some(socket) => Some(fetch(socket).await),
        None => None,
    };
    match from_plugin {
        Some(Ok(status)) => Ok(status),
        fallback => {
            let direct = Direct::after(fallback.and_then(Result::err));
            let gpus = match node.hardware.discover() {
                Ok(gpus) => gpus,
                Err(source) => return Err(NodeReadError::Gpu { direct, source }),
            };
            let inventory = Inventory::new(gpus, node.unit)?;
            crate::deviceplugin::list::check(&inventory)?;
            direct.check(node.isolation)?;
            let resource = node.resource_name.to_string();
            let holdings = PodResources::new(node.pod_resources_socket, &resource)
                .holdings()
                .await;
            let mut status =
                NodeStatus::build(&inventory, &resource, false, holdings, node.isolation);
            status.read_directly = true;
            Ok(status)
        }
    }
}

/// GET /status from a running plugin's status socket.
pub async fn fetch(socket: &Path) -> Result<NodeStatus, InspectError> {
    let unreachable = |message: String| InspectError::Unreachable {
        socket: socket.to_owned(),
        message,
    };
    let call = async {
        let stream = UnixStream::connect(socket).await.map_err(|e| {
            if e.kind() == std::io::ErrorKind::PermissionDenied {
                InspectError::Denied {
                    socket: socket.to_owned(),
                }
            } else {
                unreachable(one_line(&e))
            }
        })?;
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| unreachable(one_line(&e)))?;
        let driver = tokio::spawn(connection);
        let request = Request::get("/status")
            .header(hyper::header::HOST, "localhost")
            .body(http_body_util::Empty::<hyper::body::Bytes>::new())
            .map_err(|e| unreachable(one_line(&e)))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| unreachable(one_line(&e)))?;
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| unreachable(one_line(&e)))?
            .to_bytes();
        driver.abort();
        if !status.is_success() {
            return Err(InspectError::Status {
                socket: socket.to_owned(),
                status: status.as_u16(),
            });
        }
        serde_json::from_slice(&body).map_err(|e| InspectError::Decode {
            socket: socket.to_owned(),
            message: one_line(&e),
        })
    };
    tokio::time::timeout(TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(unreachable(format!("no answer within {TIMEOUT:?}"))))
}
