//! What gpumem publishes on its Node: gpushare's GPU count in the node's
//! capacity (its tools divide the node's units by it), and each GPU's own
//! size, health and UUID in an annotation, for a scheduler extender that
//! must not assume equal GPUs. The agent puts both back whenever its Node
//! loses them (kubelet zeroes unknown extended resources when it restarts;
//! an uninstall hook or a person may remove them). `unpublish` takes both
//! away again, when gpumem is uninstalled. And the startup taint: the
//! node's GPUs take no pods until gpumem says they can, by removing it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cluster::backoff::{backed_off, relisting};
use crate::cluster::client::{describe, describe_watch};
use crate::cluster::gpushare::GPU_COUNT;
use crate::node::inventory::Inventory;

/// The node annotation listing its GPUs (JSON: `[PublishedGpu, …]`).
pub const GPUS_ANNOTATION: &str = "gpumem.io/gpus";

const RETRY: Duration = Duration::from_secs(10);

/// One GPU as published on the Node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishedGpu {
    /// NVML index (gpushare's `ALIYUN_COM_GPU_MEM_IDX`).
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    /// Units of the advertised resource this GPU has.
    pub units: u32,
    pub healthy: bool,
}

/// The node's GPUs as published.
pub fn published(inv: &Inventory) -> Vec<PublishedGpu> {
    inv.gpus()
        .iter()
        .map(|g| PublishedGpu {
            index: g.gpu.index,
            uuid: g.gpu.uuid.clone(),
            model: g.gpu.name.clone(),
            memory_mib: g.gpu.memory_mib,
            units: g.units,
            healthy: g.gpu.healthy,
        })
        .collect()
}

/// Publishes once.
pub async fn publish(client: &Client, node: &str, inv: &Inventory) -> Result<(), kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    // The annotation first: it is what changes with GPU health, and the
    // Node between the two patches then already shows it (the count rarely
    // changes), so `run`'s watch does not take that moment for a loss.
    let gpus = serde_json::to_string(&published(inv)).unwrap_or_default();
    let meta = json!({"metadata": {"annotations": {GPUS_ANNOTATION: gpus}}});
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&meta))
        .await?;
    let count = inv.gpus().len().to_string();
    // Capacity goes through the status subresource (a status sent to the
    // node itself is ignored); allocatable too, which gpushare's tools read.
    let status = json!({"status": {
        "capacity": {GPU_COUNT: count},
        "allocatable": {GPU_COUNT: count},
    }});
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&status))
        .await?;
    Ok(())
}

/// Whether `node` still shows what `publish` writes for `inv`.
fn shows(node: &Node, inv: &Inventory) -> bool {
    let count = inv.gpus().len().to_string();
    let gpus = serde_json::to_string(&published(inv)).unwrap_or_default();
    let annotated = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(GPUS_ANNOTATION))
        .is_some_and(|a| *a == gpus);
    let counted = |resources: Option<&BTreeMap<String, Quantity>>| {
        resources
            .and_then(|r| r.get(GPU_COUNT))
            .is_some_and(|q| q.0 == count)
    };
    let status = node.status.as_ref();
    annotated
        && counted(status.and_then(|s| s.capacity.as_ref()))
        && counted(status.and_then(|s| s.allocatable.as_ref()))
}

/// Removes what `publish` wrote from each Node named in `only` (every Node,
/// if empty) that matches the label selector `labels` (all, if empty) and
/// carries gpumem's annotation; the names of those changed. A node without
/// the annotation keeps its GPU count: gpushare's own device plugin writes
/// it too.
pub async fn unpublish(
    client: &Client,
    only: &[String],
    labels: &str,
) -> Result<Vec<String>, UnpublishError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let listed = nodes
        .list(&ListParams::default().labels(labels))
        .await
        .map_err(UnpublishError::List)?;
    let mut changed = Vec::new();
    for node in listed.items {
        let Some(name) = node.metadata.name else {
            continue;
        };
        let ours = node
            .metadata
            .annotations
            .is_some_and(|a| a.contains_key(GPUS_ANNOTATION));
        if !ours || !(only.is_empty() || only.contains(&name)) {
            continue;
        }
        // Merge patches: null removes the key (RFC 7386).
        let status = json!({"status": {
            "capacity": {GPU_COUNT: null},
            "allocatable": {GPU_COUNT: null},
        }});
        let meta = json!({"metadata": {"annotations": {GPUS_ANNOTATION: null}}});
        let params = PatchParams::default();
        let patched = match nodes
            .patch_status(&name, &params, &Patch::Merge(&status))
            .await
        {
            Ok(_) => nodes.patch(&name, &params, &Patch::Merge(&meta)).await,
            Err(err) => Err(err),
        };
        if let Err(source) = patched {
            return Err(UnpublishError::Patch { node: name, source });
        }
        changed.push(name);
    }
    if let Some(missing) = only.iter().find(|n| !changed.contains(n)) {
        return Err(UnpublishError::NotOurs {
            node: missing.clone(),
            done: changed,
        });
    }
    Ok(changed)
}

#[derive(Debug, thiserror::Error)]
pub enum UnpublishError {
    #[error("cannot list Nodes")]
    List(#[source] kube::Error),
    #[error("cannot remove gpumem's GPU count and annotation from Node {node}")]
    Patch {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("Node {node} does not exist or carries no {GPUS_ANNOTATION} annotation (cleaned: {})", if done.is_empty() { "none".to_owned() } else { done.join(", ") })]
    NotOurs { node: String, done: Vec<String> },
}

/// Publishes now, after every inventory change (GPU health) and whenever
/// its Node, as watched, no longer shows what was published; retries
/// failures, until `stop`.
pub async fn run(
    client: Client,
    node: String,
    mut inventory: watch::Receiver<Arc<Inventory>>,
    stop: CancellationToken,
) {
    let nodes: Api<Node> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let mut seen = std::pin::pin!(backed_off(relisting(nodes, config)));
    // `stale`: the Node may not show the inventory; `due`: try now (a
    // failure waits RETRY).
    let (mut stale, mut due) = (true, true);
    loop {
        let inv = inventory.borrow_and_update().clone();
        if stale && due {
            match publish(&client, &node, &inv).await {
                Ok(()) => {
                    info!(node, gpus = inv.gpus().len(), "published GPUs on the Node");
                    stale = false;
                }
                Err(err) => {
                    warn!(node, err = %describe(&err), "cannot publish GPUs on the Node; retrying");
                    due = false;
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            changed = inventory.changed() => {
                if changed.is_err() {
                    return;
                }
                (stale, due) = (true, true);
            }
            item = seen.next() => match item {
                Some((Ok(Event::Apply(n) | Event::InitApply(n)), _)) if !stale && !shows(&n, &inv) => {
                    info!(node, "the Node lost the GPUs gpumem published; publishing them again");
                    (stale, due) = (true, true);
                }
                Some((Err(err), _)) => {
                    // The watcher relists and rewatches by itself.
                    warn!(node, err = %describe_watch(&err), "watching this Node");
                }
                Some(_) => {}
                None => return,
            },
            () = tokio::time::sleep(RETRY), if stale && !due => due = true,
        }
    }
}

/// The startup taint gpumem removes by default: a node group (Karpenter's
/// `startupTaints`, kubelet's `--register-with-taints`) that starts nodes
/// with it keeps GPU pods off them until their GPUs are allocatable.
pub const DEFAULT_STARTUP_TAINT: &str = "gpumem.io/not-ready:NoSchedule";

/// How often the Node is read while gpumem waits to remove its startup
/// taint (a GET of one object: RBAC grants `get` on nodes, not `watch`).
const STARTUP_POLL: Duration = Duration::from_secs(2);

/// The taint Karpenter's nodes register with. When Karpenter removes it (the
/// node's registration) it puts the NodePool's `startupTaints` on the Node,
/// again where the node registered with them, so a startup taint removed
/// before then, or not there yet, comes back for good.
const KARPENTER_UNREGISTERED: &str = "karpenter.sh/unregistered";

/// A taint `KEY[=VALUE]:EFFECT` (`--startup-taint`); without a value it
/// matches the key and effect whatever the value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartupTaint {
    pub key: String,
    pub value: Option<String>,
    pub effect: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid taint {0:?}: expected KEY[=VALUE]:EFFECT, EFFECT one of NoSchedule, PreferNoSchedule, NoExecute")]
pub struct BadTaint(String);

impl std::str::FromStr for StartupTaint {
    type Err = BadTaint;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadTaint(s.to_owned());
        let (taint, effect) = s.trim().rsplit_once(':').ok_or_else(bad)?;
        if !matches!(effect, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
            return Err(bad());
        }
        let (key, value) = match taint.split_once('=') {
            Some((key, value)) => (key, Some(value.to_owned())),
            None => (taint, None),
        };
        if key.is_empty() || key.contains(char::is_whitespace) {
            return Err(bad());
        }
        Ok(StartupTaint {
            key: key.to_owned(),
            value,
            effect: effect.to_owned(),
        })
    }
}

impl std::fmt::Display for StartupTaint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.value {
            Some(value) => write!(f, "{}={value}:{}", self.key, self.effect),
            None => write!(f, "{}:{}", self.key, self.effect),
        }
    }
}

impl StartupTaint {
    fn matches(&self, taint: &Taint) -> bool {
        taint.key == self.key
            && taint.effect == self.effect
            && self
                .value
                .as_deref()
                .is_none_or(|v| taint.value.as_deref().unwrap_or("") == v)
    }
}

/// Whether kubelet shows `resource` allocatable on `node`: the device
/// plugin registered and at least one unit is healthy.
pub fn allocatable(node: &Node, resource: &str) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(resource))
        .and_then(|q| crate::node::quantity::bytes(&q.0))
        .is_some_and(|n| n > 0)
}

/// Removes `taint` from the Node once `ready` says its GPUs can take pods
/// (the device plugin: [`allocatable`]) and Karpenter, where it launched the
/// node, has registered it, then returns; also returns at once where a
/// registered Node does not carry it (gpumem restarted on a node it already
/// freed).
/// Read and write go to the API server until then, retried.
pub async fn clear_startup_taint(
    client: Client,
    node: String,
    taint: StartupTaint,
    ready: impl Fn(&Node) -> bool,
    stop: CancellationToken,
) {
    let nodes: Api<Node> = Api::all(client);
    let mut said_waiting = false;
    let mut said_unregistered = false;
    loop {
        let pause = match nodes.get(&node).await {
            Ok(current) => {
                let taints = current
                    .spec
                    .as_ref()
                    .and_then(|s| s.taints.clone())
                    .unwrap_or_default();
                // Before "no startup taint, freed already": Karpenter may
                // put it on only when it registers the node.
                if taints.iter().any(|t| t.key == KARPENTER_UNREGISTERED) {
                    if !said_unregistered {
                        info!(node, %taint, "keeping the startup taint until Karpenter has registered the node: it puts the NodePool's startup taints on when it does");
                        said_unregistered = true;
                    }
                    Some(STARTUP_POLL)
                } else if !taints.iter().any(|t| taint.matches(t)) {
                    if said_waiting {
                        info!(node, %taint, "the startup taint is gone already");
                    }
                    return;
                } else if !ready(&current) {
                    if !said_waiting {
                        info!(node, %taint, "keeping the startup taint until the node's GPUs are allocatable");
                        said_waiting = true;
                    }
                    Some(STARTUP_POLL)
                } else {
                    let kept: Vec<&Taint> = taints.iter().filter(|t| !taint.matches(t)).collect();
                    // The resourceVersion makes this a compare-and-swap: a
                    // taint another controller added meanwhile is not lost
                    // (409, read again).
                    let patch = json!({
                        "metadata": {"resourceVersion": current.metadata.resource_version},
                        "spec": {"taints": kept},
                    });
                    match nodes
                        .patch(&node, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => {
                            info!(node, %taint, "removed the startup taint: the node's GPUs are allocatable");
                            return;
                        }
                        Err(kube::Error::Api(status)) if status.code == 409 => None,
                        Err(err) => {
                            warn!(node, %taint, err = %describe(&err), "cannot remove the startup taint; retrying");
                            Some(RETRY)
                        }
                    }
                }
            }
            Err(err) => {
                warn!(node, err = %describe(&err), "cannot read the Node for its startup taint; retrying");
                Some(RETRY)
            }
        };
        if let Some(pause) = pause {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taints_parse_as_kubectl_writes_them() {
        let t: StartupTaint = "gpumem.io/not-ready:NoSchedule".parse().unwrap();
        assert_eq!(t.key, "gpumem.io/not-ready");
        assert_eq!(t.value, None);
        assert_eq!(t.to_string(), DEFAULT_STARTUP_TAINT);
        let t: StartupTaint = "a=b:NoExecute".parse().unwrap();
        assert_eq!(t.value.as_deref(), Some("b"));
        for bad in [
            "a",
            "a:Sometimes",
            ":NoSchedule",
            "=b:NoSchedule",
            "a b:NoSchedule",
        ] {
            assert!(bad.parse::<StartupTaint>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_taint_without_a_value_matches_any_value() {
        let taint = |key: &str, value: Option<&str>, effect: &str| Taint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            time_added: None,
        };
        let any: StartupTaint = "k:NoSchedule".parse().unwrap();
        assert!(any.matches(&taint("k", Some("x"), "NoSchedule")));
        assert!(any.matches(&taint("k", None, "NoSchedule")));
        assert!(!any.matches(&taint("k", None, "NoExecute")));
        let exact: StartupTaint = "k=v:NoSchedule".parse().unwrap();
        assert!(!exact.matches(&taint("k", Some("x"), "NoSchedule")));
        assert!(exact.matches(&taint("k", Some("v"), "NoSchedule")));
    }
}
