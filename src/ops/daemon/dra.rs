//! `gpumem dra`'s wiring: the DRA driver with its claims taken up from the
//! checkpoint, its ResourceSlice, shared claims, Events and clean-up.

use std::path::PathBuf;
use std::sync::Arc;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::cluster::client::ApiHealth;
use crate::cluster::events::PodEvents;
use crate::cluster::node::StartupTaint;
use crate::cluster::pods::NodePods;
use crate::dra::health::HealthFeed;
use crate::dra::prepare::DriverConfig;
use crate::dra::recovery;
use crate::dra::registration::Registration;
use crate::dra::service::{self, DraSockets};
use crate::dra::slice::{self, SliceStatus};
use crate::isolation::cleanup;
use crate::isolation::inject::Isolation;
use crate::kubelet::podresources::PodResources;
use crate::node::gpu::NodeFacts;
use crate::node::health::{self, HealthWatch};
use crate::node::inventory::Inventory;
use crate::ops::observed::{FrontEnd, Observed};

use super::notices::{claim_users, post_events};
use super::{
    bound_state_dirs, lock_front_end, reconciler, serve_endpoints, spawn_reconcile, Common,
    DaemonError,
};

/// `gpumem dra`: the DRA driver's configuration.
pub struct DraDaemonConfig {
    /// Whether the API server answers, for /healthz.
    pub api: ApiHealth,
    pub driver: DriverConfig,
    pub sockets: DraSockets,
    pub client: kube::Client,
    /// Driver version and compute capabilities, for the slice's attributes.
    pub facts: NodeFacts,
    /// This boot's ID: the checkpoint's entries of another boot are stale.
    pub boot_id: String,
    /// For `/status`: which pods and containers reference which claims.
    pub pod_resources_socket: PathBuf,
    /// The taint to remove from the Node once the ResourceSlice offers its
    /// GPUs (`--startup-taint`).
    pub startup_taint: Option<StartupTaint>,
    pub common: Common,
}

/// Runs the DRA driver until `shutdown` (or until it fails to start).
pub async fn run_dra(
    mut config: DraDaemonConfig,
    inventory: Inventory,
    mut health: Option<Box<dyn HealthWatch>>,
    shutdown: CancellationToken,
) -> Result<(), DaemonError> {
    crate::version::log_start();
    let mut common = config.common;
    let _lock = lock_front_end(&common.state_dir)?;
    bound_state_dirs(&mut config.driver.isolation, common.bound_state_dirs)?;
    let isolation = Arc::new(config.driver.isolation.clone());
    let inventory = health::first_look(health.as_deref_mut(), inventory);
    let (inventory_tx, inventory_rx) = watch::channel(Arc::new(inventory));
    let claims = recovery::recover(
        &common.state_dir,
        &config.boot_id,
        &config.driver,
        config.client.clone(),
        inventory_rx.clone(),
    )?;

    let stop = shutdown.child_token();
    let mut tasks = tokio::task::JoinSet::new();
    // Caps from the checkpoint, never from the file the claim's containers
    // can write.
    let granted = claims.clone();
    let (reconciler, notices) = reconciler(&isolation, &mut common, true, move |name, uuid| {
        granted.granted_mib(name, uuid)
    });
    // The pods each claim was reserved for: a claim's process is its pod's
    // claim's whatever mount namespace it made for itself.
    let reserved = claims.clone();
    let reconciler = reconciler.map(|(r, every)| {
        (
            r.with_pod_dirs(Box::new(move || Some(reserved.pod_dirs()))),
            every,
        )
    });
    let (slice_tx, slice_rx) = watch::channel(SliceStatus::default());
    let mut slice_ready = slice_rx.clone();
    let (registration_tx, registration_rx) = watch::channel(Registration::default());
    let observed = Observed::new(
        config.sockets.driver_name.clone(),
        inventory_rx.clone(),
        FrontEnd::Dra {
            registration: registration_rx,
            slice: slice_rx,
            claims: claims.clone(),
        },
        Arc::default(),
        PodResources::new(&config.pod_resources_socket, &config.sockets.driver_name),
        isolation.clone(),
        reconciler.as_ref().map(|(r, _)| r),
        common.sensors.take(),
        common.hostname.clone(),
    )
    .with_api(config.api.clone());
    serve_endpoints(&mut tasks, &mut common, observed, &stop);
    if let Some(taint) = config.startup_taint.clone() {
        // Pods can be scheduled here once the slice the scheduler reads
        // offers devices.
        let (client, node, stop) = (
            config.client.clone(),
            config.driver.node.clone(),
            stop.clone(),
        );
        tasks.spawn(async move {
            let published = slice_ready.wait_for(|s| s.in_sync && s.devices > 0);
            tokio::select! {
                () = stop.cancelled() => return,
                done = published => if done.is_err() { return },
            }
            crate::cluster::node::clear_startup_taint(client, node, taint, |_| true, stop).await;
        });
    }
    tasks.spawn(slice::run(
        config.client.clone(),
        config.driver.node.clone(),
        config.driver.driver.clone(),
        inventory_rx.clone(),
        config.facts,
        slice_tx,
        stop.clone(),
    ));
    let node_pods = NodePods::watch(config.client.clone(), &config.driver.node, stop.clone());
    // A pod that comes to share a prepared claim is not prepared for again.
    tasks.spawn(crate::dra::sharing::follow(
        claims.clone(),
        node_pods.clone(),
        stop.clone(),
    ));
    if let Some(notices) = notices {
        tasks.spawn(post_events(
            notices,
            PodEvents::new(config.client.clone(), &config.driver.node),
            node_pods,
            claim_users(claims.clone()),
            PodResources::new(&config.pod_resources_socket, &config.sockets.driver_name),
            stop.clone(),
        ));
    }
    // kubelet hears each device's health from the same watcher that
    // withdraws a sick GPU from the slice.
    let health_feed = HealthFeed {
        pool: config.driver.node.clone(),
        inventory: inventory_rx.clone(),
        checked: health.is_some(),
    };
    if let Some(watch) = health {
        tasks.spawn(health::run(watch, inventory_tx, stop.clone()));
    }
    if let Isolation::Shim(shim) = &*isolation {
        spawn_reconcile(&mut tasks, shim, reconciler, &stop);
        tasks.spawn(cleanup::run(
            shim.clone(),
            None,
            inventory_rx.clone(),
            claims.clone(),
            common.state_grace,
            stop.clone(),
        ));
    }

    let result = service::serve(
        &config.sockets,
        Arc::new(claims),
        health_feed,
        registration_tx,
        stop.clone(),
    )
    .await;
    stop.cancel();
    while tasks.join_next().await.is_some() {}
    Ok(result?)
}
