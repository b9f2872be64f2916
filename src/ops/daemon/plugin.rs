//! `gpumem plugin`'s wiring: the device plugin, the cluster's side of it
//! (the Node, gpushare's annotations, Events) and its state clean-up.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::cluster::client::{ApiHealth, ADMISSION_CALL_BOUND};
use crate::cluster::events::PodEvents;
use crate::cluster::gpushare::{self, Extender, PlacedContainer, PlacedPod};
use crate::cluster::node::StartupTaint;
use crate::cluster::pods::NodePods;
use crate::deviceplugin::holders::KubeletHolders;
use crate::deviceplugin::plugin::{Plugin, PluginConfig};
use crate::isolation::cleanup;
use crate::isolation::inject::Isolation;
use crate::kubelet::podresources::{Holding, PodResources};
use crate::node::health::{self, HealthWatch};
use crate::node::inventory::Inventory;
use crate::node::placement;
use crate::ops::observed::{FrontEnd, Observed};

use super::notices::{device_plugin_users, post_events};
use super::{
    bound_state_dirs, lock_front_end, reconciler, serve_endpoints, spawn_reconcile, Common,
    DaemonError,
};

pub struct DaemonConfig {
    pub plugin: PluginConfig,
    pub pod_resources_socket: PathBuf,
    pub common: Common,
    /// The API server, where the plugin may use it.
    pub cluster: Option<Cluster>,
}

/// The API server and what gpumem does with it.
pub struct Cluster {
    pub client: kube::Client,
    /// Whether the API server answers, for /healthz.
    pub api: ApiHealth,
    /// This node's name.
    pub node: String,
    /// Place containers where gpushare's scheduler extender chose.
    pub gpushare_extender: bool,
    /// The taint to remove from the Node once kubelet shows its GPUs
    /// allocatable (`--startup-taint`).
    pub startup_taint: Option<StartupTaint>,
}

/// How often placed pods are checked for gpushare's annotations.
const ANNOTATE_EVERY: Duration = Duration::from_secs(2);

/// Runs until `shutdown` (or until the plugin fails to start).
pub async fn run(
    mut config: DaemonConfig,
    inventory: Inventory,
    mut health: Option<Box<dyn HealthWatch>>,
    shutdown: CancellationToken,
) -> Result<(), DaemonError> {
    crate::version::log_start();
    // The device plugin sends kubelet the whole device list in one message:
    // refuse an inventory whose list kubelet could not receive.
    crate::deviceplugin::list::check(&inventory)?;
    // With the shim, the state dir is ours: no other front end may hand out
    // these GPUs. Without it nothing of ours stays on the node.
    let _lock = match &config.plugin.isolation {
        Isolation::Shim(_) => Some(lock_front_end(&config.common.state_dir)?),
        Isolation::None => None,
    };
    bound_state_dirs(&mut config.plugin.isolation, config.common.bound_state_dirs)?;
    let mut common = config.common;
    let inventory = health::first_look(health.as_deref_mut(), inventory);
    let (inventory_tx, inventory_rx) = watch::channel(Arc::new(inventory));
    let isolation = Arc::new(config.plugin.isolation.clone());
    let cdi_specs = config.plugin.device_list.cdi_specs().cloned();
    let resource = config.plugin.resource_name.to_string();
    let pod_resources = PodResources::new(&config.pod_resources_socket, &resource);
    let policy = config.plugin.policy;
    let kubelet_dir = config.plugin.kubelet_dir.clone();
    let mut plugin = Plugin::new(config.plugin);
    // Everything below stops with the plugin, whichever way it ends.
    let stop = shutdown.child_token();
    let mut tasks = tokio::task::JoinSet::new();

    // The over-cap action's caps come from the directory's name and the
    // inventory, never from the file the container can write.
    let inventory = inventory_rx.clone();
    let (reconciler, notices) = reconciler(
        &isolation,
        &mut common,
        config.cluster.is_some(),
        move |name, uuid| name.granted_mib(&inventory.borrow(), uuid),
    );
    // kubelet's checkpoint names each container's pod: a process is its
    // pod's whatever mount namespace it made for itself.
    let reconciler = reconciler.map(|(r, every)| {
        let pods = crate::deviceplugin::holders::pod_dirs(&kubelet_dir, &resource);
        (r.with_pod_dirs(pods), every)
    });
    let observed = Observed::new(
        resource.clone(),
        inventory_rx.clone(),
        FrontEnd::DevicePlugin(plugin.status()),
        plugin.counters(),
        pod_resources.clone(),
        isolation.clone(),
        reconciler.as_ref().map(|(r, _)| r),
        common.sensors.take(),
        common.hostname.clone(),
    );
    let observed = match &config.cluster {
        Some(cluster) => observed.with_api(cluster.api.clone()),
        None => observed,
    };
    serve_endpoints(&mut tasks, &mut common, observed, &stop);
    if let Some(cluster) = config.cluster {
        let pods = NodePods::watch(cluster.client.clone(), &cluster.node, stop.clone());
        tasks.spawn(crate::cluster::node::run(
            cluster.client.clone(),
            cluster.node.clone(),
            inventory_rx.clone(),
            stop.clone(),
        ));
        if let Some(taint) = cluster.startup_taint.clone() {
            let resource = resource.clone();
            tasks.spawn(crate::cluster::node::clear_startup_taint(
                cluster.client.clone(),
                cluster.node.clone(),
                taint,
                move |node| crate::cluster::node::allocatable(node, &resource),
                stop.clone(),
            ));
        }
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
                device_plugin_users(),
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
    if let Isolation::Shim(shim) = &*isolation {
        spawn_reconcile(&mut tasks, shim, reconciler, &stop);
        if let Some(specs) = &cdi_specs {
            // Allocate refuses containers while it cannot write their specs.
            if let Err(err) = std::fs::create_dir_all(specs.dir()) {
                warn!(dir = %specs.dir().display(), %err, "--cdi-spec-dir is not usable; Allocate will refuse containers until it is");
            }
        }
        let holders = KubeletHolders::new(
            pod_resources,
            &kubelet_dir,
            &resource,
            plugin.resend(),
            common.state_grace,
            plugin.granted(),
        );
        tasks.spawn(cleanup::run(
            shim.clone(),
            cdi_specs,
            inventory_rx.clone(),
            holders,
            common.state_grace,
            stop.clone(),
        ));
    }

    let result = plugin.run(inventory_rx, stop.clone()).await;
    stop.cancel();
    while tasks.join_next().await.is_some() {}
    Ok(result?)
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
            .containers
            .push(PlacedContainer {
                name: holding.container.clone(),
                gpu: inv.gpus()[assignment.gpu].gpu.index,
                units: assignment.units,
            });
    }
    pods
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::gpu::test_gpu as gpu;
    use crate::node::placement::Policy;
    use crate::node::units::MemoryUnit;

    #[tokio::test]
    async fn the_device_plugin_refuses_a_list_kubelet_could_not_receive_before_serving() {
        // One H200 in MiB units: its device list with the GPU Unhealthy is
        // past kubelet's message limit (the DRA driver sends no such list).
        let dir = tempfile::tempdir().unwrap();
        let inventory = Inventory::new(vec![gpu(0, "GPU-h200", 143_771)], MemoryUnit::MiB).unwrap();
        let config = DaemonConfig {
            plugin: PluginConfig {
                kubelet_dir: dir.path().to_owned(),
                resource_name: Default::default(),
                policy: Policy::Binpack,
                isolation: Isolation::None,
                device_list: Default::default(),
            },
            pod_resources_socket: dir.path().join("no-pod-resources.sock"),
            common: Common::quiet(dir.path().join("state"), "node-1"),
            cluster: None,
        };
        let shutdown = CancellationToken::new();
        let ran = tokio::time::timeout(
            Duration::from_secs(30),
            run(config, inventory, None, shutdown.clone()),
        )
        .await;
        shutdown.cancel();
        let err = ran.expect("run returns at once").unwrap_err();
        assert!(matches!(err, DaemonError::List(_)), "{err}");
        assert!(err.to_string().contains("--memory-unit GiB"), "{err}");
        // Refused before serving kubelet: no socket in its directory.
        let socket = dir.path().join(crate::deviceplugin::plugin::SOCKET_NAME);
        assert!(!socket.exists(), "{}", socket.display());
    }
}
