//! The pods bound to this node, kept current by one watch (field selector
//! `spec.nodeName`), as kubelet itself sees them.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Writes that lose a race with another writer are tried this often.
const CONFLICT_RETRIES: usize = 5;

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
    #[error("API server: {0}")]
    Api(#[from] kube::Error),
    #[error("pod {namespace}/{name} was changed by others {CONFLICT_RETRIES} times while gpumem updated it")]
    Conflicts { namespace: String, name: String },
}

impl NodePods {
    /// Starts watching the pods bound to `node` until `stop`.
    pub fn watch(client: Client, node: &str, stop: CancellationToken) -> NodePods {
        let api: Api<Pod> = Api::all(client.clone());
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let stream = reflector::reflector(writer, watcher(api.clone(), config))
            .default_backoff()
            .applied_objects();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                let next = tokio::select! {
                    () = stop.cancelled() => return,
                    next = stream.next() => next,
                };
                match next {
                    None => return,
                    Some(Ok(pod)) => {
                        debug!(
                            pod = pod.metadata.name.as_deref().unwrap_or(""),
                            "pod changed"
                        )
                    }
                    // The watcher relists and rewatches (410 Gone included);
                    // the backoff spaces its attempts.
                    Some(Err(err)) => warn!(%err, "watching this node's pods"),
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

    /// The pods as last seen by the watch.
    pub fn cached(&self) -> Vec<Arc<Pod>> {
        self.store.state()
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
    /// `Ok(None)` when `still` no longer holds.
    pub async fn annotate_if(
        &self,
        namespace: &str,
        name: &str,
        annotations: &serde_json::Map<String, serde_json::Value>,
        still: impl Fn(&Pod) -> bool,
        bound: Duration,
    ) -> Result<Option<Pod>, PodsError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let attempt = async {
            for _ in 0..CONFLICT_RETRIES {
                let pod = api.get(name).await?;
                if !still(&pod) {
                    return Ok(None);
                }
                let patch = json!({
                    "metadata": {
                        "resourceVersion": pod.metadata.resource_version,
                        "annotations": annotations,
                    }
                });
                match api
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(pod) => return Ok(Some(pod)),
                    Err(kube::Error::Api(status)) if status.code == 409 => {
                        debug!(
                            namespace,
                            name, "pod changed while annotating it; reading it again"
                        )
                    }
                    Err(err) => return Err(err.into()),
                }
            }
            Err(PodsError::Conflicts {
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            })
        };
        tokio::time::timeout(bound, attempt)
            .await
            .map_err(|_| PodsError::Timeout(bound))?
    }
}
