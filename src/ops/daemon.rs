//! `gpumem plugin` as a whole: the kubelet plugin, GPU health, the HTTP
//! endpoint and state clean-up, all owned here and stopped by one token.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::deviceplugin::plugin::{Plugin, PluginConfig, PluginError};
use crate::deviceplugin::podresources::PodResources;
use crate::isolation::cleanup;
use crate::isolation::containers::ContainerName;
use crate::isolation::enforce::OverCapAction;
use crate::isolation::inject::Isolation;
use crate::isolation::reconcile::{self, ProcessUsage, Reconciler};
use crate::node::health::{self, HealthWatch};
use crate::node::inventory::Inventory;
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
}

/// Runs until `shutdown` (or until the plugin fails to start).
pub async fn run(
    config: DaemonConfig,
    inventory: Inventory,
    health: Option<Box<dyn HealthWatch>>,
    shutdown: CancellationToken,
) -> Result<(), PluginError> {
    let (inventory_tx, inventory_rx) = watch::channel(Arc::new(inventory));
    let isolation = Arc::new(config.plugin.isolation.clone());
    let resource = config.plugin.resource_name.to_string();
    let pod_resources = PodResources::new(&config.pod_resources_socket, &resource);
    let plugin = Plugin::new(config.plugin);
    // Everything below stops with the plugin, whichever way it ends.
    let stop = shutdown.child_token();
    let mut tasks = tokio::task::JoinSet::new();

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
            let reconciler = match config.over_cap {
                Some((action, grace)) => reconciler.with_over_cap(action, grace),
                None => reconciler,
            };
            Some((reconciler, every))
        }
        _ => None,
    };
    if let Some(listener) = config.metrics {
        let observed = Observed {
            resource,
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
        tasks.spawn(cleanup::run(
            shim.clone(),
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
