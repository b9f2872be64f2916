//! `gpumem plugin` and `gpumem dra` as a whole: the front end kubelet talks
//! to, GPU health, the HTTP endpoint, reconciliation and state clean-up, all
//! owned here and stopped by one token.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::cluster::client::{ApiHealth, ADMISSION_CALL_BOUND};
use crate::cluster::events::{self, PodEvents};
use crate::cluster::gpushare::{self, Extender, PlacedContainer, PlacedPod};
use crate::cluster::node::StartupTaint;
use crate::cluster::pods::NodePods;
use crate::deviceplugin::holders::KubeletHolders;
use crate::deviceplugin::plugin::{Plugin, PluginConfig, PluginError};
use crate::dra::checkpoint::{self, Checkpoint};
use crate::dra::health::HealthFeed;
use crate::dra::prepare::{DriverConfig, PreparedClaims};
use crate::dra::registration::Registration;
use crate::dra::service::{self, DraSockets};
use crate::dra::slice::{self, SliceStatus};
use crate::isolation::cleanup;
use crate::isolation::containers::ContainerName;
use crate::isolation::enforce::{Notice, Noticed, OverCapAction, WINDOW_GRACES};
use crate::isolation::inject::{Isolation, ShimConfig};
use crate::isolation::reconcile::{self, Reconciler};
use crate::isolation::statefs::{Bounding, Unbounded};
use crate::kubelet::podresources::{Holding, PodResources};
use crate::node::gpu::NodeFacts;
use crate::node::hardware::Hardware;
use crate::node::health::{self, HealthWatch};
use crate::node::inventory::Inventory;
use crate::node::placement;
use crate::node::processes::{self, ProcessUsage};
use crate::node::sensors::Sensors;
use crate::node::units::MemoryUnit;
use crate::ops::metrics;
use crate::ops::observed::{FrontEnd, Observed};
use crate::ops::status_socket;

pub struct DaemonConfig {
    pub plugin: PluginConfig,
    pub pod_resources_socket: PathBuf,
    pub common: Common,
    /// The API server, where the plugin may use it.
    pub cluster: Option<Cluster>,
}

/// What both front ends run the same way.
pub struct Common {
    /// The state dir (`--state-dir`), where the front end's lock is.
    pub state_dir: PathBuf,
    /// Already bound, so a bad `--metrics-addr` fails before anything starts.
    pub metrics: Option<tokio::net::TcpListener>,
    /// Where `/status` is served (`--status-socket`); `None`: nowhere. Bound
    /// once the front end holds the node, so a second one cannot take it.
    pub status_socket: Option<PathBuf>,
    /// How long a finished container's accounting directory is kept.
    pub state_grace: Duration,
    /// Whether each container's accounting directory is a bounded tmpfs
    /// (`--bound-state-dirs`).
    pub bound_state_dirs: Bounding,
    /// Per-process GPU memory and how often to compare it with the
    /// containers' charges (shim isolation only).
    pub reconcile: Option<(Box<dyn ProcessUsage>, Duration)>,
    /// The GPUs' sensors, for the metrics endpoint.
    pub sensors: Option<Sensors>,
    /// The node's name, as the metrics label each GPU's series.
    pub hostname: String,
    /// Also serve the series arena reads (`--arena-metrics`).
    pub arena_series: bool,
    /// What to do with a container over its cap for the grace period in total
    /// within the window (`enforce::window`), and that grace period, seen
    /// from outside by reconciliation; `None`: nothing.
    pub over_cap: Option<(OverCapAction, Duration)>,
}

impl Common {
    /// Settings that serve nothing beside kubelet's API (no metrics, no
    /// status socket, no reconciliation or over-cap action, unbounded state
    /// dirs, the default five-minute grace), for embedded front ends: the
    /// demo, the benches and the tests, which turn on what they need.
    pub fn quiet(state_dir: PathBuf, hostname: &str) -> Common {
        Common {
            state_dir,
            metrics: None,
            status_socket: None,
            state_grace: Duration::from_secs(300),
            bound_state_dirs: Bounding::Off,
            reconcile: None,
            over_cap: None,
            sensors: None,
            hostname: hostname.to_owned(),
            arena_series: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error(transparent)]
    Dra(#[from] crate::dra::service::DraError),
    #[error(transparent)]
    Checkpoint(#[from] crate::dra::checkpoint::CheckpointError),
    #[error("cannot lock {path}")]
    Lock {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--state-dir {} is not a directory", path.display())]
    StateDirNotADirectory { path: PathBuf },
    #[error("cannot create --state-dir {}", path.display())]
    StateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "another gpumem front end (the device plugin or the DRA driver) runs on this node with \
         --state-dir {state_dir}: a node runs one, so no GPU is handed out by both; remove the \
         other DaemonSet from this node (or give this one a node selector that excludes it)"
    )]
    OtherFrontEnd { state_dir: PathBuf },
    #[error(transparent)]
    Unbounded(#[from] Unbounded),
}

/// Holds the node's front-end lock, `<state-dir>/front-end.lock`, until
/// dropped (or the process ends, however it ends).
fn lock_front_end(
    state_dir: &std::path::Path,
) -> Result<nix::fcntl::Flock<std::fs::File>, DaemonError> {
    let path = state_dir.join("front-end.lock");
    let err = |source| DaemonError::Lock {
        path: path.clone(),
        source,
    };
    // A file there (or above it) fails below with the OS's word for a path
    // under it, "File exists" or "Not a directory", naming neither flag nor
    // what is wrong.
    if state_dir.exists() && !state_dir.is_dir() {
        return Err(DaemonError::StateDirNotADirectory {
            path: state_dir.to_owned(),
        });
    }
    std::fs::create_dir_all(state_dir).map_err(|source| DaemonError::StateDir {
        path: state_dir.to_owned(),
        source,
    })?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(err)?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(
        |(_, errno)| match errno {
            nix::errno::Errno::EWOULDBLOCK => DaemonError::OtherFrontEnd {
                state_dir: state_dir.to_owned(),
            },
            errno => err(errno.into()),
        },
    )
}

/// What both front ends start the same way, from the flags they share.
pub struct NodeConfig<'a> {
    pub hardware: &'a Hardware,
    pub unit: MemoryUnit,
    /// `--metrics-addr`, not yet parsed.
    pub metrics_addr: &'a str,
    /// `--metrics-hostname`, where given: what metrics call the node.
    pub metrics_hostname: Option<&'a str>,
    /// `--status-socket`, resolved; `None`: off.
    pub status_socket: Option<PathBuf>,
    /// XIDs that do not make a GPU unhealthy.
    pub ignore_xids: &'a [u64],
    pub health_recovery: Duration,
    /// How often to reconcile per-process usage; `None`: off.
    pub reconcile: Option<Duration>,
    pub state_dir: PathBuf,
    pub state_grace: Duration,
    pub bound_state_dirs: Bounding,
    pub over_cap: (OverCapAction, Duration),
    /// `--node-name`, where given: what metrics call the node without
    /// `--metrics-hostname` (see [`hostname`]).
    pub node_name: Option<&'a str>,
    /// Also serve the series arena reads (`--arena-metrics`).
    pub arena_series: bool,
}

/// A front end's daemon, ready to run: what [`start`] gave.
pub struct Started {
    pub inventory: Inventory,
    pub health: Option<Box<dyn HealthWatch>>,
    pub common: Common,
    pub shutdown: CancellationToken,
}

/// What keeps a front end's daemon from starting.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Gpu(#[from] crate::node::gpu::GpuError),
    #[error(transparent)]
    Inventory(#[from] crate::node::inventory::InventoryError),
    #[error(transparent)]
    List(#[from] crate::deviceplugin::list::TooLarge),
    #[error(transparent)]
    Address(#[from] metrics::BadAddress),
    #[error("--metrics-addr {addr}: cannot listen")]
    Listen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Discovers the GPUs, binds the HTTP endpoint (so a bad address fails
/// before anything starts) and installs the signal handlers.
pub async fn start(config: NodeConfig<'_>) -> Result<Started, StartError> {
    let hardware = config.hardware;
    let inventory = Inventory::new(hardware.discover()?, config.unit)?;
    crate::deviceplugin::list::check(&inventory)?;
    for g in inventory.gpus() {
        tracing::info!(
            index = g.gpu.index,
            name = %g.gpu.name,
            uuid = %g.gpu.uuid,
            memory_mib = g.gpu.memory_mib,
            units = g.units,
            id_prefix = %g.key,
            "GPU"
        );
    }
    let metrics = match metrics::parse_address(config.metrics_addr)? {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Listen { addr, source })?,
        ),
        None => None,
    };
    let health = health::watch_for(hardware, config.ignore_xids, config.health_recovery);
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let reconcile = config
        .reconcile
        .and_then(|every| processes::source_for(hardware).map(|source| (source, every)));
    Ok(Started {
        inventory,
        health,
        common: Common {
            state_dir: config.state_dir,
            metrics,
            status_socket: config.status_socket,
            state_grace: config.state_grace,
            bound_state_dirs: config.bound_state_dirs,
            reconcile,
            over_cap: Some(config.over_cap),
            sensors: hardware.sensors(),
            hostname: hostname(config.metrics_hostname, config.node_name),
            arena_series: config.arena_series,
        },
        shutdown,
    })
}

/// The node's name for metrics: `--metrics-hostname`, else `--node-name`,
/// else the kernel's host name: what dcgm-exporter labels `Hostname` (its
/// NODE_NAME, else the host name), so that the two join on a node where both
/// run. The chart sets `--metrics-hostname` from the pod's node: a pod's own
/// host name is its name. Read from gpumem's own settings only, never from
/// a `NODE_NAME` the pod may set for something else.
pub fn hostname(metrics_hostname: Option<&str>, node_name: Option<&str>) -> String {
    let named = [metrics_hostname, node_name]
        .into_iter()
        .flatten()
        .map(str::trim)
        .find(|n| !n.is_empty());
    match named {
        Some(name) => name.to_owned(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|name| name.trim().to_owned())
            .unwrap_or_default(),
    }
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

/// How long a notice waits for the first list of the node's pods.
const POD_LIST_WAIT: Duration = Duration::from_secs(10);

/// Decides, once, what the containers' state directories are on, and says
/// so: a tmpfs of each one's own where this process can mount one the
/// runtime sees, else the state dir's file system, which a container can
/// then fill (docs/SECURITY.md, "The state directory").
fn bound_state_dirs(isolation: &mut Isolation, bounding: Bounding) -> Result<(), DaemonError> {
    let Isolation::Shim(shim) = isolation else {
        return Ok(());
    };
    let containers = shim.containers_dir();
    let (fs, refused) = bounding.resolve(&containers)?;
    const UNBOUNDED: &str = "containers' state directories are NOT bounded: a container can fill the file system they are on (docs/SECURITY.md, \"The state directory\")";
    match refused {
        None => {
            info!(dir = %containers.display(), "each container's state directory is a tmpfs of its own: what a container writes there is bounded")
        }
        // Asked for: said, not warned of.
        Some(reason) if bounding == Bounding::Off => {
            info!(%reason, dir = %containers.display(), "{UNBOUNDED}")
        }
        Some(reason) => warn!(%reason, dir = %containers.display(), "{UNBOUNDED}"),
    }
    shim.state_fs = fs;
    Ok(())
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

/// Serves metrics and health on the network port, and who holds what on
/// the status socket. A socket that cannot be bound is logged, not fatal:
/// kubelet's GPUs matter more, and `inspect` then reads the node itself.
fn serve_endpoints(
    tasks: &mut tokio::task::JoinSet<()>,
    common: &mut Common,
    observed: Observed,
    stop: &CancellationToken,
) {
    if let Some(path) = common.status_socket.take() {
        match status_socket::bind(&path) {
            Ok(listener) => {
                tasks.spawn(status_socket::serve_logged(
                    listener,
                    path,
                    observed.clone(),
                    stop.clone(),
                ));
            }
            Err(err) => {
                error!(err = %crate::error_text::chain(&err), "cannot serve /status: `gpumem inspect` will read the node directly")
            }
        }
    }
    if let Some(listener) = common.metrics.take() {
        let observed = observed.with_arena_series(common.arena_series);
        tasks.spawn(metrics::serve_logged(listener, observed, stop.clone()));
    }
}

/// Compares NVML's per-process memory with the shim's charges (shim
/// isolation, where `--reconcile-secs` is on), the over-cap action's caps
/// from `granted` (by a directory's name and a GPU's UUID, in MiB); with
/// `notices`, what it does is also sent for Events.
fn reconciler(
    isolation: &Isolation,
    common: &mut Common,
    notices: bool,
    granted: impl Fn(&ContainerName, &str) -> Option<u64> + Send + Sync + 'static,
) -> (
    Option<(Reconciler, Duration)>,
    Option<UnboundedReceiver<Notice>>,
) {
    let (Isolation::Shim(_), Some((source, every))) = (isolation, common.reconcile.take()) else {
        return (None, None);
    };
    let mut reconciler = Reconciler::new(source).with_granted_caps(Box::new(move |file, uuid| {
        let name = ContainerName::of_dir(file.parent()?)?;
        Some(granted(&name, uuid)?.saturating_mul(1 << 20))
    }));
    if let Some((action, grace)) = common.over_cap {
        reconciler = reconciler.with_over_cap(action, grace);
    }
    let mut receiver = None;
    if notices {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        reconciler = reconciler.with_notices(tx);
        receiver = Some(rx);
    }
    (Some((reconciler, every)), receiver)
}

/// Reconciles every accounting directory under the shim's state dir.
fn spawn_reconcile(
    tasks: &mut tokio::task::JoinSet<()>,
    shim: &ShimConfig,
    reconciler: Option<(Reconciler, Duration)>,
    stop: &CancellationToken,
) {
    if let Some((reconciler, every)) = reconciler {
        let containers = shim.containers();
        tasks.spawn(reconcile::run(
            reconciler,
            move || containers.accounting_files(),
            every,
            stop.clone(),
        ));
    }
}

/// The containers a notice about an accounting directory is about, from
/// kubelet's pod-resources list: the device plugin's one container, or
/// every container referencing a DRA claim.
type Users = Box<dyn Fn(&ContainerName, &[Holding]) -> Vec<User> + Send>;

/// A container an Event is posted for: its pod, and how the note names it.
struct User {
    namespace: String,
    pod: String,
    subject: String,
}

/// The device plugin's container behind a directory, by its devices.
fn device_plugin_users() -> Users {
    Box::new(move |name, holdings| {
        holdings
            .iter()
            .find(|h| ContainerName::of_devices_any_unit(&h.device_ids).contains(name))
            .map(|h| User {
                namespace: h.namespace.clone(),
                pod: h.pod.clone(),
                subject: format!("container {}", h.container),
            })
            .into_iter()
            .collect()
    })
}

/// The containers referencing the DRA claim behind a directory.
fn claim_users(claims: PreparedClaims) -> Users {
    Box::new(move |name, holdings| {
        let Some(claim) = claims.claim_of(name) else {
            return Vec::new();
        };
        let key = (claim.namespace.clone(), claim.name.clone());
        // One Event per pod, naming all its containers that use the claim:
        // one per container would count one action several times.
        let mut by_pod = std::collections::BTreeMap::<(String, String), Vec<String>>::new();
        for h in holdings.iter().filter(|h| h.claims.contains(&key)) {
            by_pod
                .entry((h.namespace.clone(), h.pod.clone()))
                .or_default()
                .push(h.container.clone());
        }
        by_pod
            .into_iter()
            .map(|((namespace, pod), containers)| User {
                namespace,
                pod,
                subject: format!(
                    "ResourceClaim {}/{} (used by container{} {})",
                    claim.namespace,
                    claim.name,
                    if containers.len() == 1 { "" } else { "s" },
                    containers.join(", ")
                ),
            })
            .collect()
    })
}

/// Posts an Event on the pod of each over-cap action and each process
/// outside every gpumem container, until `stop`.
async fn post_events(
    mut notices: UnboundedReceiver<Notice>,
    events: PodEvents,
    pods: NodePods,
    users: Users,
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
        // A notice is reported once: wait for the first list of the node's
        // pods rather than drop one that comes before it.
        if !pods.ready(POD_LIST_WAIT).await {
            warn!("the node's pods are not listed yet; an Event is not posted");
        }
        // The pods: a gpumem directory's by pod-resources, a stranger's by
        // the pod UID in its cgroup.
        let targets: Vec<(Option<Arc<Pod>>, String)> = match &notice.what {
            Noticed::Killed { file, .. }
            | Noticed::OverCap { file, .. }
            | Noticed::NotIsolated { file, .. } => {
                let Some(name) = file.parent().and_then(ContainerName::of_dir) else {
                    continue;
                };
                let Ok(holdings) = pod_resources.holdings().await else {
                    continue;
                };
                users(&name, &holdings)
                    .into_iter()
                    .map(|u| (pods.by_name(&u.namespace, &u.pod), u.subject))
                    .collect()
            }
            Noticed::Unmanaged {
                pod_uid: Some(uid), ..
            } => vec![(pods.by_uid(uid), String::new())],
            Noticed::Unmanaged { pod_uid: None, .. } => continue,
        };
        for (pod, subject) in targets {
            let Some(pod) = pod else { continue };
            post_event(&events, &pod, &notice, &subject).await;
        }
    }
}

/// One notice's Event on `pod`, naming `subject` (the container or claim).
async fn post_event(events: &PodEvents, pod: &Pod, notice: &Notice, subject: &str) {
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
                "Killed process {pid} of {subject} (it held {used_mib} MiB on GPU {gpu}): the GPU \
                 memory of all its processes, as NVML counts it, was above the cap of {cap_mib} \
                 MiB for the grace period in total within the last {WINDOW_GRACES} grace periods"
            ),
        ),
        Noticed::OverCap {
            used_mib, cap_mib, ..
        } => (
            events::OVER_CAP,
            "Report",
            format!(
                "{} holds {used_mib} MiB on GPU {gpu}, above its cap of {cap_mib} MiB, and was over \
                 it for the grace period in total within the last {WINDOW_GRACES} grace periods \
                 (--over-cap-action report: nothing was killed)",
                capitalized(subject)
            ),
        ),
        Noticed::NotIsolated { pid, used_mib, .. } => (
            events::NOT_ISOLATED,
            "Report",
            format!(
                "Process {pid} of {subject} holds {used_mib} MiB on GPU {gpu} without gpumem's \
                 mounts (no /var/run/gpumem, no shim), so only the node daemon holds it to its \
                 cap. Either the container runtime did not apply the device plugin's answer \
                 (--device-list-strategy cdi needs CDI on in the runtime: containerd 1.7 or later \
                 with enable_cdi, CRI-O 1.23 or later; docs/OPERATIONS.md), the process left its \
                 container's mount namespace (docs/SECURITY.md), or it runs in a container nested \
                 in it"
            ),
        ),
        Noticed::Unmanaged { pid, used_mib, .. } => (
            events::UNMANAGED,
            "Report",
            format!(
                "Process {pid} holds {used_mib} MiB on GPU {gpu} and is in no container gpumem \
                 holds to a cap (the pod did not ask gpumem for GPU memory, or the process left \
                 its container's mounts: docs/SECURITY.md); it is not capped"
            ),
        ),
    };
    if let Err(err) = events.warn(pod, reason, action, note).await {
        warn!(err = %crate::error_text::chain(&err), reason, "cannot post an Event");
    }
}

fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
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

/// Under the state dir, the DRA driver's record of prepared claims.
pub const CHECKPOINT: &str = "dra/checkpoint.json";

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
    let opened = Checkpoint::open(&common.state_dir.join(CHECKPOINT), &config.boot_id)?;
    if let Some(err) = &opened.corrupt {
        error!(%err, "started a new DRA checkpoint: claims prepared before keep their CDI specs until kubelet unprepares them");
    }
    let checkpoint = opened.checkpoint.path().to_owned();
    for entry in &opened.unreadable {
        if entry.stale {
            warn!(uid = %entry.uid, error = %entry.error, checkpoint = %checkpoint.display(), "dropped an unreadable entry of the DRA checkpoint, prepared before the node rebooted");
        } else {
            error!(uid = %entry.uid, error = %entry.error, checkpoint = %checkpoint.display(), "an entry of the DRA checkpoint does not read: kept as it is; its claim keeps its CDI spec and accounting directory until kubelet unprepares it, its share of the GPU is missing from /status and metrics, and only the shim holds it to its cap");
        }
    }
    let claims = PreparedClaims::new(
        config.driver.clone(),
        config.client.clone(),
        inventory_rx.clone(),
        opened.checkpoint,
    );
    claims.recover(opened.interrupted, "interrupted while being prepared");
    claims.recover(opened.stale, "prepared before the node rebooted");
    // A checkpoint that did not parse, or is not there while specs are,
    // named claims whose pods may still run: kubelet reuses their CDI IDs
    // at every container restart without preparing them again, so their
    // specs stay, at this start and the next (and their directories, see
    // `live_dirs`); kubelet's Unprepare of each removes it (see `forget`).
    match checkpoint::boot_time() {
        Some(booted) => claims.remove_unrecorded_specs(booted),
        None => warn!("cannot read when the node booted (btime in /proc/stat): CDI specs of claims no longer prepared are left in place"),
    }
    if !opened.found {
        let kept = config.driver.specs.list();
        if !kept.is_empty() {
            warn!(checkpoint = %checkpoint.display(), specs = kept.len(), dir = %config.driver.specs.dir().display(), "no DRA checkpoint, but CDI specs of claims are there (was --state-dir changed or wiped?): kept until kubelet unprepares their claims");
        }
    }
    if let Err(err) = std::fs::create_dir_all(config.driver.specs.dir()) {
        warn!(dir = %config.driver.specs.dir().display(), %err, "--cdi-spec-dir is not usable; claims are refused until it is");
    }
    claims.refresh_specs();

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

/// SIGTERM (kubelet stopping the pod) or SIGINT fans out to one token.
pub async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; SIGTERM will not stop gpumem cleanly");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = int.recv() => tracing::info!("SIGINT: stopping"),
    }
    shutdown.cancel();
}
