//! `gpumem plugin` as a whole: the kubelet plugin, GPU health, the HTTP
//! endpoint and state clean-up, all owned here and stopped by one token.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::cluster::client::ADMISSION_CALL_BOUND;
use crate::cluster::events::{self, PodEvents};
use crate::cluster::gpushare::{self, Extender, PlacedPod};
use crate::cluster::pods::NodePods;
use crate::deviceplugin::plugin::{Plugin, PluginConfig, PluginError};
use crate::deviceplugin::podresources::{Holding, PodResources};
use crate::isolation::cleanup;
use crate::isolation::containers::ContainerName;
use crate::isolation::enforce::{Notice, Noticed, OverCapAction};
use crate::isolation::inject::Isolation;
use crate::isolation::reconcile::{self, ProcessUsage, Reconciler};
use crate::node::health::{self, HealthWatch};
use crate::node::inventory::Inventory;
use crate::node::placement;
use crate::ops::metrics::{self, Observed};

pub struct DaemonConfig {
    pub plugin: PluginConfig,
    pub pod_resources_socket: PathBuf,
    /// Already bound, so a bad `--metrics-addr` fails before anything starts.
    pub metrics: Option<tokio::net::TcpListener>,
    /// How long a finished container's accounting directory is kept.
    pub state_grace: Duration,
    /// Per-process GPU memory and how often to compare it with the
    /// containers' charges (shim isolation only).
    pub reconcile: Option<(Box<dyn ProcessUsage>, Duration)>,
    /// What to do with a container over its cap for longer than the grace
    /// period, seen from outside by reconciliation; `None`: nothing.
    pub over_cap: Option<(OverCapAction, Duration)>,
    /// The API server, where the plugin may use it.
    pub cluster: Option<Cluster>,
}

/// The API server and what gpumem does with it.
pub struct Cluster {
    pub client: kube::Client,
    /// This node's name.
    pub node: String,
    /// Place containers where gpushare's scheduler extender chose.
    pub gpushare_extender: bool,
}

/// How often placed pods are checked for gpushare's annotations.
const ANNOTATE_EVERY: Duration = Duration::from_secs(2);

/// Runs until `shutdown` (or until the plugin fails to start).
pub async fn run(
    config: DaemonConfig,
    inventory: Inventory,
    health: Option<Box<dyn HealthWatch>>,
    shutdown: CancellationToken,
) -> Result<(), PluginError> {
    let (inventory_tx, inventory_rx) = watch::channel(Arc::new(inventory));
    let isolation = Arc::new(config.plugin.isolation.clone());
    let cdi_specs = config.plugin.device_list.cdi_specs().cloned();
    let resource = config.plugin.resource_name.to_string();
    let pod_resources = PodResources::new(&config.pod_resources_socket, &resource);
    let policy = config.plugin.policy;
    let mut plugin = Plugin::new(config.plugin);
    // Everything below stops with the plugin, whichever way it ends.
    let stop = shutdown.child_token();
    let mut tasks = tokio::task::JoinSet::new();

    let mut notices = None;
    let reconciler = match (&*isolation, config.reconcile) {
        (Isolation::Shim(_), Some((source, every))) => {
            // The over-cap action's caps come from the directory's name and
            // the inventory, never from the file the container can write.
            let inventory = inventory_rx.clone();
            let reconciler =
                Reconciler::new(source).with_granted_caps(Box::new(move |file, uuid| {
                    let name = ContainerName::of_dir(file.parent()?)?;
                    let mib = name.granted_mib(&inventory.borrow(), uuid)?;
                    Some(mib.saturating_mul(1 << 20))
                }));
            let mut reconciler = match config.over_cap {
                Some((action, grace)) => reconciler.with_over_cap(action, grace),
                None => reconciler,
            };
            if config.cluster.is_some() {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                reconciler = reconciler.with_notices(tx);
                notices = Some(rx);
            }
            Some((reconciler, every))
        }
        _ => None,
    };
    if let Some(listener) = config.metrics {
        let observed = Observed {
            resource: resource.clone(),
            inventory: inventory_rx.clone(),
            plugin: plugin.status(),
            counters: plugin.counters(),
            pod_resources: pod_resources.clone(),
            isolation: isolation.clone(),
            overheads: reconciler.as_ref().map(|(r, _)| r.overheads()),
            unmanaged: reconciler.as_ref().map(|(r, _)| r.unmanaged()),
            over_cap: reconciler.as_ref().and_then(|(r, _)| r.actions()),
        };
        let stop = stop.clone();
        tasks.spawn(async move {
            if let Err(err) = metrics::serve(listener, observed, stop).await {
                error!(%err, "metrics endpoint failed");
            }
        });
    }
    if let Some(cluster) = config.cluster {
        let pods = NodePods::watch(cluster.client.clone(), &cluster.node, stop.clone());
        tasks.spawn(crate::cluster::node::run(
            cluster.client.clone(),
            cluster.node.clone(),
            inventory_rx.clone(),
            stop.clone(),
        ));
        tasks.spawn(annotate_placed(
            pods.clone(),
            inventory_rx.clone(),
            pod_resources.clone(),
            stop.clone(),
        ));
        if let Some(notices) = notices {
            tasks.spawn(post_events(
                notices,
                PodEvents::new(cluster.client.clone(), &cluster.node),
                pods.clone(),
                inventory_rx.clone(),
                pod_resources.clone(),
                stop.clone(),
            ));
        }
        if cluster.gpushare_extender {
            plugin =
                plugin.with_extender(Extender::new(pods, &resource, policy, ADMISSION_CALL_BOUND));
        }
    }
    if let Some(watch) = health {
        tasks.spawn(health::run(watch, inventory_tx, stop.clone()));
    }
    if let (Isolation::Shim(shim), Some((reconciler, every))) = (&*isolation, reconciler) {
        let containers = shim.containers();
        tasks.spawn(reconcile::run(
            reconciler,
            move || containers.accounting_files(),
            every,
            stop.clone(),
        ));
    }
    if let Isolation::Shim(shim) = &*isolation {
        if let Some(specs) = &cdi_specs {
            // Allocate refuses containers while it cannot write their specs.
            if let Err(err) = std::fs::create_dir_all(specs.dir()) {
                warn!(dir = %specs.dir().display(), %err, "--cdi-spec-dir is not usable; Allocate will refuse containers until it is");
            }
        }
        tasks.spawn(cleanup::run(
            shim.clone(),
            cdi_specs,
            inventory_rx.clone(),
            pod_resources,
            config.state_grace,
            stop.clone(),
        ));
    }

    let result = plugin.run(inventory_rx, stop.clone()).await;
    stop.cancel();
    while tasks.join_next().await.is_some() {}
    result
}

/// Posts an Event on the pod of each over-cap action and each process
/// outside every gpumem container, until `stop`.
async fn post_events(
    mut notices: UnboundedReceiver<Notice>,
    events: PodEvents,
    pods: NodePods,
    inventory: watch::Receiver<Arc<Inventory>>,
    pod_resources: PodResources,
    stop: CancellationToken,
) {
    loop {
        let notice = tokio::select! {
            () = stop.cancelled() => return,
            notice = notices.recv() => match notice {
                Some(notice) => notice,
                None => return,
            },
        };
        // The pod: a gpumem container's by the devices kubelet gave it,
        // a stranger's by the pod UID in its cgroup.
        let (pod, container) = match &notice.what {
            Noticed::Killed { file, .. } | Noticed::OverCap { file, .. } => {
                let Some(name) = file.parent().and_then(ContainerName::of_dir) else {
                    continue;
                };
                let Ok(holdings) = pod_resources.holdings().await else {
                    continue;
                };
                let inv = inventory.borrow().clone();
                let Some(holding) = holdings.into_iter().find(|h| {
                    ContainerName::of_devices(&inv, &h.device_ids).as_ref() == Some(&name)
                }) else {
                    continue;
                };
                (
                    pods.by_name(&holding.namespace, &holding.pod),
                    holding.container,
                )
            }
            Noticed::Unmanaged {
                pod_uid: Some(uid), ..
            } => (pods.by_uid(uid), String::new()),
            Noticed::Unmanaged { pod_uid: None, .. } => continue,
        };
        let Some(pod) = pod else { continue };
        let gpu = &notice.gpu;
        let (reason, action, note) = match notice.what {
            Noticed::Killed {
                pid,
                used_mib,
                cap_mib,
                ..
            } => (
                events::OVER_CAP,
                "Kill",
                format!(
                    "Killed process {pid} of container {container} (it held {used_mib} MiB on GPU \
                     {gpu}): the container's GPU memory, as NVML counts it, stayed above its cap \
                     of {cap_mib} MiB for longer than the grace period"
                ),
            ),
            Noticed::OverCap {
                used_mib, cap_mib, ..
            } => (
                events::OVER_CAP,
                "Report",
                format!(
                    "Container {container} holds {used_mib} MiB on GPU {gpu}, above its cap of \
                     {cap_mib} MiB, for longer than the grace period (--over-cap-action report: \
                     nothing was killed)"
                ),
            ),
            Noticed::Unmanaged { pid, used_mib, .. } => (
                events::UNMANAGED,
                "Report",
                format!(
                    "Process {pid} holds {used_mib} MiB on GPU {gpu} without the pod having asked \
                     for GPU memory from gpumem; it is not capped"
                ),
            ),
        };
        if let Err(err) = events.warn(&pod, reason, action, note).await {
            warn!(%err, reason, "cannot post an Event");
        }
    }
}

/// Keeps gpushare's annotations on the pods placed here, as kubelet's
/// pod-resources API lists them, until `stop`.
async fn annotate_placed(
    pods: NodePods,
    inventory: watch::Receiver<Arc<Inventory>>,
    pod_resources: PodResources,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(ANNOTATE_EVERY) => {}
        }
        let Ok(holdings) = pod_resources.holdings().await else {
            continue;
        };
        let inv = inventory.borrow().clone();
        let placed = placed_pods(&inv, &holdings);
        gpushare::annotate_placed(&pods, &inv, &placed, ADMISSION_CALL_BOUND).await;
    }
}

/// Each pod's containers, by the GPU (NVML index) and units each holds.
fn placed_pods(
    inv: &Inventory,
    holdings: &[Holding],
) -> std::collections::BTreeMap<(String, String), PlacedPod> {
    let mut pods = std::collections::BTreeMap::<_, PlacedPod>::new();
    for holding in holdings {
        let Ok(assignment) = placement::assign(inv, &holding.device_ids) else {
            continue;
        };
        pods.entry((holding.namespace.clone(), holding.pod.clone()))
            .or_default()
            .gpus
            .push((inv.gpus()[assignment.gpu].gpu.index, assignment.units));
    }
    pods
}
