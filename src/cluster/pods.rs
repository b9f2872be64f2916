//! The pods bound to this node, kept current by one watch (field selector
//! `spec.nodeName`), as kubelet itself sees them.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::core::Status;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::cluster::backoff::{backed_off, relisting};
use crate::cluster::client::describe_watch;

/// Writes that lose a race with another writer are tried this often.
const CONFLICT_RETRIES: usize = 5;

/// The first wait after the API server fails a write (500); each next
/// wait doubles, up to the most below, until the call's bound is spent.
const SERVER_ERROR_BACKOFF: Duration = Duration::from_millis(100);
const SERVER_ERROR_BACKOFF_MAX: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct NodePods {
    client: Client,
    api: Api<Pod>,
    node: String,
    store: Store<Pod>,
}

#[derive(Debug, thiserror::Error)]
pub enum PodsError {
    #[error("the API server did not answer within {0:?}")]
    Timeout(Duration),
    #[error("API server")]
    Api(#[from] kube::Error),
    #[error("pod {namespace}/{name} was changed by others {CONFLICT_RETRIES} times while gpumem updated it")]
    Conflicts { namespace: String, name: String },
    #[error(
        "the API server failed {failures} tries to update pod {namespace}/{name} within {bound:?}, \
         the last with {} {}: {}",
        .last.code, .last.reason, .last.message
    )]
    ServerErrors {
        namespace: String,
        name: String,
        failures: usize,
        bound: Duration,
        last: Box<Status>,
    },
}

impl NodePods {
    /// Starts watching the pods bound to `node` until `stop`.
    pub fn watch(client: Client, node: &str, stop: CancellationToken) -> NodePods {
        let api: Api<Pod> = Api::all(client.clone());
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let stream = backed_off(reflector::reflector(writer, relisting(api.clone(), config)));
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                let next = tokio::select! {
                    () = stop.cancelled() => return,
                    next = stream.next() => next,
                };
                let Some((next, wait)) = next else { return };
                match next {
                    Ok(Event::Apply(pod) | Event::InitApply(pod)) => {
                        debug!(
                            pod = pod.metadata.name.as_deref().unwrap_or(""),
                            "pod changed"
                        )
                    }
                    Ok(_) => {}
                    // The watcher relists and rewatches (410 Gone included)
                    // when polled again, after the wait.
                    Err(err) => warn!(
                        err = %describe_watch(&err),
                        retry_in = ?wait.unwrap_or_default(),
                        "watching this node's pods"
                    ),
                }
            }
        });
        NodePods {
            client,
            api,
            node: node.to_owned(),
            store,
        }
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Whether the first list has arrived within `within`.
    pub async fn ready(&self, within: Duration) -> bool {
        matches!(
            tokio::time::timeout(within, self.store.wait_until_ready()).await,
            Ok(Ok(()))
        )
    }

    /// The pod with this UID, as last seen.
    pub fn by_uid(&self, uid: &str) -> Option<Arc<Pod>> {
        self.store
            .find(|pod| pod.metadata.uid.as_deref() == Some(uid))
    }

    /// The pod `namespace/name`, as last seen.
    pub fn by_name(&self, namespace: &str, name: &str) -> Option<Arc<Pod>> {
        self.store.find(|pod| {
            pod.metadata.namespace.as_deref() == Some(namespace)
                && pod.metadata.name.as_deref() == Some(name)
        })
    }

    /// Every pod bound to the node, as last seen.
    pub fn all(&self) -> Vec<Arc<Pod>> {
        self.store.state()
    }

    /// The pods bound to the node, listed now (the watch may lag a bind by
    /// a moment), within `bound`.
    pub async fn list_now(&self, bound: Duration) -> Result<Vec<Pod>, PodsError> {
        let params = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let list = tokio::time::timeout(bound, self.api.list(&params))
            .await
            .map_err(|_| PodsError::Timeout(bound))??;
        Ok(list.items)
    }

    /// Merges `annotations` into the pod, but only while `still` holds for
    /// the pod as stored: each try names the resourceVersion it read, so a
    /// write by someone else in between is a conflict, read again. Returns
    /// `Ok(None)` when `still` no longer holds, and the pod when it already
    /// carries `annotations` (a write whose answer was lost may have landed).
    ///
    /// The client retries 429, 503 and 504 itself; a 500 (etcd timed out,
    /// an admission webhook failed) is retried here with backoff, as the API
    /// conventions ask, all within `bound`.
    pub async fn annotate_if(
        &self,
        namespace: &str,
        name: &str,
        annotations: &serde_json::Map<String, serde_json::Value>,
        still: impl Fn(&Pod) -> bool,
        bound: Duration,
    ) -> Result<Option<Pod>, PodsError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let deadline = Instant::now() + bound;
        let mut conflicts = 0;
        let mut failures = 0;
        let mut backoff = SERVER_ERROR_BACKOFF;
        let mut last_failure: Option<Box<Status>> = None;
        loop {
            let tried =
                tokio::time::timeout_at(deadline, annotate_once(&api, name, annotations, &still))
                    .await;
            let err = match tried {
                Ok(Ok(done)) => return Ok(done),
                Ok(Err(err)) => err,
                Err(_) => {
                    return Err(match last_failure {
                        Some(last) => PodsError::ServerErrors {
                            namespace: namespace.to_owned(),
                            name: name.to_owned(),
                            failures,
                            bound,
                            last,
                        },
                        None => PodsError::Timeout(bound),
                    })
                }
            };
            match err {
                kube::Error::Api(status) if status.code == 409 => {
                    conflicts += 1;
                    if conflicts == CONFLICT_RETRIES {
                        return Err(PodsError::Conflicts {
                            namespace: namespace.to_owned(),
                            name: name.to_owned(),
                        });
                    }
                    debug!(
                        namespace,
                        name, "pod changed while annotating it; reading it again"
                    )
                }
                kube::Error::Api(status) if status.code == 500 => {
                    failures += 1;
                    let wait = backoff;
                    backoff = (backoff * 2).min(SERVER_ERROR_BACKOFF_MAX);
                    if Instant::now() + wait >= deadline {
                        return Err(PodsError::ServerErrors {
                            namespace: namespace.to_owned(),
                            name: name.to_owned(),
                            failures,
                            bound,
                            last: status,
                        });
                    }
                    warn!(
                        namespace,
                        name,
                        code = status.code,
                        reason = %status.reason,
                        server = %status.message,
                        failures,
                        retry_in = ?wait,
                        "the API server failed while gpumem annotated the pod; retrying"
                    );
                    last_failure = Some(status);
                    tokio::time::sleep(wait).await;
                }
                err => return Err(err.into()),
            }
        }
    }
}

/// One read and conditional write of [`NodePods::annotate_if`].
async fn annotate_once(
    api: &Api<Pod>,
    name: &str,
    annotations: &serde_json::Map<String, serde_json::Value>,
    still: &impl Fn(&Pod) -> bool,
) -> Result<Option<Pod>, kube::Error> {
    let pod = api.get(name).await?;
    if carries(&pod, annotations) {
        return Ok(Some(pod));
    }
    if !still(&pod) {
        return Ok(None);
    }
    let patch = json!({
        "metadata": {
            "resourceVersion": pod.metadata.resource_version,
            "annotations": annotations,
        }
    });
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(Some)
}

/// Whether the pod's annotations already say what a merge of
/// `annotations` would (a null removes a key).
fn carries(pod: &Pod, annotations: &serde_json::Map<String, serde_json::Value>) -> bool {
    let have = pod.metadata.annotations.as_ref();
    annotations.iter().all(|(key, value)| {
        let current = have.and_then(|a| a.get(key));
        match value {
            serde_json::Value::String(want) => current == Some(want),
            serde_json::Value::Null => current.is_none(),
            _ => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "annotations": annotations}}))
            .unwrap()
    }

    #[test]
    fn a_pod_carries_a_merge_only_where_every_key_already_says_so() {
        let ours = json!({"a": "1", "gone": null});
        let ours = ours.as_object().unwrap();
        assert!(carries(&pod(json!({"a": "1", "other": "x"})), ours));
        assert!(!carries(&pod(json!({"a": "2"})), ours), "another value");
        assert!(
            !carries(&pod(json!({"a": "1", "gone": "x"})), ours),
            "a key to remove"
        );
        assert!(!carries(&pod(json!({})), ours));
    }
}
