//! `gpumem plugin` and `gpumem dra` as a whole: what both front ends start
//! and run the same way (GPUs, the HTTP endpoint and status socket, the
//! front-end lock, reconciliation, signals); each front end's wiring is in
//! its own file, all stopped by one token.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::deviceplugin::plugin::PluginError;
use crate::isolation::containers::ContainerName;
use crate::isolation::enforce::{Notice, OverCapAction};
use crate::isolation::inject::{Isolation, ShimConfig};
use crate::isolation::reconcile::{self, Reconciler};
use crate::isolation::statefs::{Bounding, Unbounded};
use crate::node::hardware::Hardware;
use crate::node::health::HealthWatch;
use crate::node::inventory::Inventory;
use crate::node::processes::ProcessUsage;
use crate::node::sensors::Sensors;
use crate::node::units::MemoryUnit;
use crate::ops::metrics;
use crate::ops::observed::Observed;
use crate::ops::status_socket;

mod dra;
mod notices;
mod plugin;

pub use crate::dra::recovery::CHECKPOINT;
pub use dra::{run_dra, DraDaemonConfig};
pub use plugin::{run, Cluster, DaemonConfig};

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
    pub sensors: Option<Arc<dyn Sensors>>,
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
    List(#[from] crate::deviceplugin::list::TooLarge),
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
    pub hardware: &'a dyn Hardware,
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
    let health = hardware.health(config.ignore_xids, config.health_recovery);
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let reconcile = config
        .reconcile
        .and_then(|every| hardware.processes().map(|source| (source, every)));
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
