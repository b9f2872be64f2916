//! Who holds which of our devices, from kubelet's pod-resources API. Device
//! IDs encode the GPU, so this is all the plugin needs to know per-GPU usage,
//! even right after a restart. Answers are cached to stay far below
//! kubelet's rate limit (100 calls/s, burst 10).

use crate::error_text::one_line;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::kubelet::api::podresources::pod_resources_lister_client::PodResourcesListerClient;
use crate::kubelet::api::podresources::ListPodResourcesRequest;
use crate::kubelet::unix;

/// kubelet's default pod-resources socket.
pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
/// How long one List answer is reused: at most one call per second.
const FRESH: Duration = Duration::from_secs(1);
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Node-wide lists can be large; kubelet's own client raises the limit too.
const MAX_MESSAGE: usize = 16 * 1024 * 1024;

/// One container's devices of our resource, or (DRA) claims of our driver.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Holding {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub device_ids: Vec<String>,
    /// The ResourceClaims (namespace, name) the container references that
    /// have a device of the driver named like our resource.
    pub claims: Vec<(String, String)>,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum PodResourcesError {
    #[error("cannot reach kubelet's pod-resources API at {path}: {message}")]
    Unreachable { path: PathBuf, message: String },
    #[error("pod-resources List at {path} failed: {message}")]
    List { path: PathBuf, message: String },
}

/// One List answer: the containers holding our devices, and every pod
/// listed (with devices or not), sorted, as (namespace, name).
#[derive(Debug, Clone, Default)]
pub struct Listed {
    pub holdings: Vec<Holding>,
    pub pods: Vec<(String, String)>,
}

/// The last List answer and when it was read.
type Cache = Arc<Mutex<Option<(Instant, Listed)>>>;

/// A cached reader of the pod-resources API for one resource name (the DRA
/// driver: its driver name).
#[derive(Clone)]
pub struct PodResources {
    path: PathBuf,
    resource: String,
    cache: Cache,
}

impl PodResources {
    pub fn new(path: &Path, resource: &str) -> Self {
        PodResources {
            path: path.to_owned(),
            resource: resource.to_owned(),
            cache: Arc::new(Mutex::new(None)),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Containers holding our devices, at most a second old. Concurrent
    /// callers share one call.
    pub async fn holdings(&self) -> Result<Vec<Holding>, PodResourcesError> {
        Ok(self.listed().await?.holdings)
    }

    /// The whole answer of [`holdings`](Self::holdings).
    pub async fn listed(&self) -> Result<Listed, PodResourcesError> {
        let mut cache = self.cache.lock().await;
        if let Some((at, listed)) = cache.as_ref() {
            if at.elapsed() < FRESH {
                return Ok(listed.clone());
            }
        }
        let listed = tokio::time::timeout(CALL_TIMEOUT, self.list())
            .await
            .map_err(|_| PodResourcesError::List {
                path: self.path.clone(),
                message: format!("no answer within {CALL_TIMEOUT:?}"),
            })??;
        *cache = Some((Instant::now(), listed.clone()));
        Ok(listed)
    }

    async fn list(&self) -> Result<Listed, PodResourcesError> {
        let channel =
            unix::connect(&self.path)
                .await
                .map_err(|e| PodResourcesError::Unreachable {
                    path: self.path.clone(),
                    message: one_line(&e),
                })?;
        let response = PodResourcesListerClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE)
            .list(ListPodResourcesRequest {})
            .await
            .map_err(|status| PodResourcesError::List {
                path: self.path.clone(),
                message: status.message().to_owned(),
            })?
            .into_inner();
        let mut holdings = Vec::new();
        let mut pods: Vec<(String, String)> = Vec::new();
        for pod in response.pod_resources {
            pods.push((pod.namespace.clone(), pod.name.clone()));
            for container in pod.containers {
                let device_ids: Vec<String> = container
                    .devices
                    .into_iter()
                    .filter(|d| d.resource_name == self.resource)
                    .flat_map(|d| d.device_ids)
                    .collect();
                let claims: Vec<(String, String)> = container
                    .dynamic_resources
                    .into_iter()
                    .filter(|c| {
                        c.claim_resources
                            .iter()
                            .any(|r| r.driver_name == self.resource)
                    })
                    .map(|c| (c.claim_namespace, c.claim_name))
                    .collect();
                if !device_ids.is_empty() || !claims.is_empty() {
                    holdings.push(Holding {
                        namespace: pod.namespace.clone(),
                        pod: pod.name.clone(),
                        container: container.name,
                        device_ids,
                        claims,
                    });
                }
            }
        }
        pods.sort_unstable();
        Ok(Listed { holdings, pods })
    }
}
