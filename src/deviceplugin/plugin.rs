//! The plugin's life with kubelet: serve our socket, then Register; notice a
//! kubelet restart, or kubelet ending ListAndWatch, and do both again; on
//! shutdown, stop and remove the socket.

use crate::error_text::chain;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::cluster::gpushare::Extender;
use crate::deviceplugin::api::deviceplugin::device_plugin_server::DevicePluginServer;
use crate::deviceplugin::api::deviceplugin::{RegisterRequest, VERSION};
use crate::deviceplugin::holders::Granted;
use crate::deviceplugin::kubelet::{self, SocketId, KUBELET_SOCKET};
use crate::deviceplugin::service::{plugin_options, Counters, DevicePluginService, Streams};
use crate::isolation::inject::{DeviceListStrategy, Isolation};
use crate::node::inventory::Inventory;
use crate::node::placement::Policy;
use crate::node::resource::{ResourceName, DEFAULT_RESOURCE_NAME};

/// Our socket's file name in the kubelet directory.
pub const SOCKET_NAME: &str = "gpumem.sock";

/// How often socket files are checked: a kubelet restart is noticed well
/// within a second.
const POLL: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long a stopping server may take to drain before it is dropped. Its
/// only client is kubelet, which must re-dial anyway; after unary calls
/// kubelet's HTTP/2 connection can keep a graceful shutdown waiting.
const DRAIN: Duration = Duration::from_secs(1);
/// After kubelet ends ListAndWatch, the wait before registering again:
/// kubelet disconnects the old client once the old stream's reader returns,
/// looking it up by resource name (and, since PR #135437, socket path,
/// which every generation here shares), and must not find the new one
/// instead. Should it, that stream ends too and the plugin registers once
/// more. Doubled while registrations keep ending within [`STEADY`].
const HANG_UP_WAIT: Duration = Duration::from_secs(1);
const MAX_HANG_UP_WAIT: Duration = Duration::from_secs(30);
const STEADY: Duration = Duration::from_secs(60);
/// Requests larger than tonic's 4 MiB default are legal from kubelet (an
/// `available_deviceIDs` list in MiB mode); accept them.
const MAX_REQUEST: usize = 64 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct PluginConfig {
    /// Where kubelet.sock lives and our socket is created.
    pub kubelet_dir: PathBuf,
    pub resource_name: ResourceName,
    pub policy: Policy,
    pub isolation: Isolation,
    /// How Allocate names the GPU to the container runtime.
    pub device_list: DeviceListStrategy,
}

/// What the plugin is doing now, for probes and for callers that wait.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PluginStatus {
    /// Registered with the kubelet that is running now.
    pub registered: bool,
    /// Successful Register calls since start.
    pub registrations: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("--kubelet-dir {path} is not a usable directory")]
    KubeletDir { path: PathBuf, source: io::Error },
    #[error("another process is serving {path}; stop it before starting a second gpumem here")]
    SocketInUse { path: PathBuf },
    #[error("--state-dir {path} is not usable")]
    StateDir { path: PathBuf, source: io::Error },
    #[error("cannot create plugin socket {path}")]
    Bind { path: PathBuf, source: io::Error },
}

pub struct Plugin {
    config: PluginConfig,
    isolation: Arc<Isolation>,
    counters: Arc<Counters>,
    status: watch::Sender<PluginStatus>,
    extender: Option<Arc<Extender>>,
    resend: watch::Sender<u64>,
    granted: Granted,
}

enum Registration {
    Done(Option<SocketId>),
    SocketGone,
    Shutdown,
}

/// Why a registration ended.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// Our socket went or kubelet.sock was replaced: kubelet restarted.
    Restart,
    /// kubelet ended ListAndWatch and will not call it again.
    HungUp,
    Shutdown,
}

impl Plugin {
    pub fn new(config: PluginConfig) -> Self {
        Plugin {
            isolation: Arc::new(config.isolation.clone()),
            counters: Arc::default(),
            config,
            status: watch::Sender::new(PluginStatus::default()),
            extender: None,
            resend: watch::Sender::new(0),
            granted: Granted::default(),
        }
    }

    /// Bumping it sends the device list to kubelet again, unchanged.
    pub fn resend(&self) -> watch::Sender<u64> {
        self.resend.clone()
    }

    /// The accounting directories Allocate takes, for clean-up.
    pub fn granted(&self) -> Granted {
        self.granted.clone()
    }

    /// Places containers where gpushare's scheduler extender chose.
    pub fn with_extender(mut self, extender: Extender) -> Self {
        self.extender = Some(Arc::new(extender));
        self
    }

    pub fn status(&self) -> watch::Receiver<PluginStatus> {
        self.status.subscribe()
    }

    pub fn counters(&self) -> Arc<Counters> {
        self.counters.clone()
    }

    /// Path of our socket.
    pub fn socket_path(&self) -> PathBuf {
        self.config.kubelet_dir.join(SOCKET_NAME)
    }

    /// Serves and registers until `shutdown`, re-registering after every
    /// kubelet restart. Returns only on shutdown or a start-up error.
    pub async fn run(
        self,
        inventory: watch::Receiver<Arc<Inventory>>,
        shutdown: CancellationToken,
    ) -> Result<(), PluginError> {
        if self.config.resource_name.is_nvidias() {
            warn!(
                "--resource-name {} is the name NVIDIA's device plugin registers: kubelet keeps \
                 one plugin per name, so on a node running both, each registration replaces the \
                 other and pods asking for whole GPUs get gpumem's memory units; give gpumem \
                 its own name (the default is {DEFAULT_RESOURCE_NAME}) unless NVIDIA's plugin \
                 never runs on this node",
                self.config.resource_name,
            );
        }
        let dir = &self.config.kubelet_dir;
        std::fs::read_dir(dir).map_err(|source| PluginError::KubeletDir {
            path: dir.clone(),
            source,
        })?;
        if let Isolation::Shim(shim) = &*self.isolation {
            prepare_state_dir(&shim.containers_dir())?;
            if !shim.library().is_file() || !shim.preload_list().is_file() {
                warn!(
                    dir = %shim.host_dir.display(),
                    "shim library or preload list missing; Allocate will refuse containers until they are installed"
                );
            }
        }
        let socket = self.socket_path();
        if UnixStream::connect(&socket).await.is_ok() {
            return Err(PluginError::SocketInUse { path: socket });
        }
        let mut hang_up_wait = HANG_UP_WAIT;
        let mut bind_backoff = None;
        loop {
            let generation = shutdown.child_token();
            let hung_up = CancellationToken::new();
            let (ours, server) = match self.serve(&socket, &inventory, &generation, &hung_up) {
                Ok(served) => served,
                // The first socket fails the start, with the reason; a new
                // one after kubelet restarted is tried again: the node's
                // containers keep running, and kubelet waits for us.
                Err(err) => {
                    let Some(backoff) = bind_backoff else {
                        return Err(err);
                    };
                    warn!(err = %chain(&err), retry_in = ?backoff, "cannot serve a new plugin socket; retrying");
                    tokio::select! {
                        () = shutdown.cancelled() => return Ok(()),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    bind_backoff = Some((backoff * 2).min(MAX_BACKOFF));
                    continue;
                }
            };
            bind_backoff = Some(POLL);
            let mut ended = Ended::Restart;
            if let Registration::Done(kubelet_id) = self.register(&socket, ours, &shutdown).await {
                self.status.send_modify(|s| {
                    s.registered = true;
                    s.registrations += 1;
                });
                info!(resource = %self.config.resource_name, socket = %socket.display(), "registered with kubelet");
                let since = tokio::time::Instant::now();
                let watched = Watched {
                    socket: &socket,
                    ours,
                    kubelet_sock: dir.join(KUBELET_SOCKET),
                    kubelet_id,
                };
                // kubelet dropped us at the hang-up, not after the wait.
                let unregistered = || self.status.send_modify(|s| s.registered = false);
                ended = watched
                    .until_ended(&hung_up, hang_up_wait, &shutdown, unregistered)
                    .await;
                self.status.send_modify(|s| s.registered = false);
                if since.elapsed() >= STEADY {
                    hang_up_wait = HANG_UP_WAIT;
                }
            }
            generation.cancel();
            if tokio::time::timeout(DRAIN, server).await.is_err() {
                warn!("plugin server did not drain within {DRAIN:?}; dropping it");
            }
            if shutdown.is_cancelled() {
                if SocketId::of(&socket) == Some(ours) {
                    remove_socket(&socket);
                }
                info!("stopped");
                return Ok(());
            }
            if ended == Ended::HungUp {
                warn!(waited = ?hang_up_wait, "kubelet ended ListAndWatch and will not call it again; serving a new socket and registering again");
                hang_up_wait = (hang_up_wait * 2).min(MAX_HANG_UP_WAIT);
                continue;
            }
            info!("kubelet restarted or removed our socket; serving a new socket and registering again");
        }
    }

    /// Binds a fresh socket and serves the DevicePlugin service on it until
    /// `generation` is cancelled.
    fn serve(
        &self,
        socket: &Path,
        inventory: &watch::Receiver<Arc<Inventory>>,
        generation: &CancellationToken,
        hung_up: &CancellationToken,
    ) -> Result<(SocketId, tokio::task::JoinHandle<()>), PluginError> {
        remove_socket(socket);
        let bind_err = |source| PluginError::Bind {
            path: socket.to_owned(),
            source,
        };
        let listener = UnixListener::bind(socket).map_err(bind_err)?;
        let ours = SocketId::of(socket)
            .ok_or_else(|| bind_err(io::Error::other("socket vanished right after bind")))?;
        let service = DevicePluginService::new(
            inventory.clone(),
            self.config.policy,
            self.isolation.clone(),
            self.config.device_list.clone(),
            self.counters.clone(),
            Streams {
                stop: generation.clone(),
                hung_up: hung_up.clone(),
                resend: self.resend.subscribe(),
            },
        )
        .with_extender(self.extender.clone())
        .with_granted(self.granted.clone());
        let server = tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(service).max_decoding_message_size(MAX_REQUEST))
            .serve_with_incoming_shutdown(
                // kubelet <= 1.25 sends our socket path as :authority.
                crate::kubelet::authority::lenient(UnixListenerStream::new(listener)),
                generation.clone().cancelled_owned(),
            );
        let generation = generation.clone();
        let task = tokio::spawn(async move {
            if let Err(err) = server.await {
                error!(err = %chain(&err), "plugin server failed");
                // Drop this generation; the run loop serves a fresh socket.
                generation.cancel();
            }
        });
        Ok((ours, task))
    }

    /// Calls Register until kubelet accepts, retrying with backoff while
    /// kubelet.sock is missing or refuses. Never gives up on its own.
    async fn register(
        &self,
        socket: &Path,
        ours: SocketId,
        shutdown: &CancellationToken,
    ) -> Registration {
        let kubelet_sock = self.config.kubelet_dir.join(KUBELET_SOCKET);
        let request = RegisterRequest {
            version: VERSION.to_owned(),
            endpoint: SOCKET_NAME.to_owned(),
            resource_name: self.config.resource_name.to_string(),
            options: Some(plugin_options()),
        };
        let mut backoff = POLL;
        let mut attempt = 0u32;
        loop {
            if shutdown.is_cancelled() {
                return Registration::Shutdown;
            }
            if SocketId::of(socket) != Some(ours) {
                return Registration::SocketGone;
            }
            let kubelet_id = SocketId::of(&kubelet_sock);
            attempt += 1;
            let outcome = match kubelet_id {
                Some(_) => kubelet::register(&kubelet_sock, request.clone()).await,
                None => Err(kubelet::KubeletError::Missing {
                    path: kubelet_sock.clone(),
                }),
            };
            match outcome {
                Ok(()) => return Registration::Done(kubelet_id),
                Err(err) => {
                    warn!(attempt, retry_in = ?backoff, err = %chain(&err), "registration with kubelet failed; retrying")
                }
            }
            // Wait out the backoff, but retry at once when kubelet.sock changes.
            let deadline = tokio::time::Instant::now() + backoff;
            while tokio::time::Instant::now() < deadline {
                tokio::select! {
                    () = shutdown.cancelled() => return Registration::Shutdown,
                    () = tokio::time::sleep(POLL) => {}
                }
                if SocketId::of(&kubelet_sock) != kubelet_id {
                    backoff = POLL;
                    break;
                }
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
}

/// The sockets of one registration.
struct Watched<'a> {
    socket: &'a Path,
    ours: SocketId,
    kubelet_sock: PathBuf,
    kubelet_id: Option<SocketId>,
}

impl Watched<'_> {
    /// Our socket gone or replaced, or kubelet.sock replaced.
    fn restarted(&self) -> bool {
        SocketId::of(self.socket) != Some(self.ours)
            || SocketId::of(&self.kubelet_sock) != self.kubelet_id
    }

    /// Returns when kubelet restarts, on shutdown, or `wait` after kubelet
    /// ended ListAndWatch: a restart ends the stream too, and the sockets
    /// changing meanwhile tell that it was one.
    async fn until_ended(
        &self,
        hung_up: &CancellationToken,
        wait: Duration,
        shutdown: &CancellationToken,
        on_hang_up: impl FnOnce(),
    ) -> Ended {
        let mut deadline = None;
        let mut on_hang_up = Some(on_hang_up);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return Ended::Shutdown,
                () = hung_up.cancelled(), if deadline.is_none() => {}
                () = tokio::time::sleep(POLL) => {}
            }
            if self.restarted() {
                return Ended::Restart;
            }
            if hung_up.is_cancelled() {
                if let Some(tell) = on_hang_up.take() {
                    tell();
                }
                let deadline = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + wait);
                if tokio::time::Instant::now() >= deadline {
                    return Ended::HungUp;
                }
            }
        }
    }
}

/// The parent of per-container accounting directories: private to root on
/// the host (containers see only their own directory, through a bind mount).
fn prepare_state_dir(path: &Path) -> Result<(), PluginError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| PluginError::StateDir {
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).map_err(err)
}

fn remove_socket(path: &Path) {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => warn!(path = %path.display(), err = %chain(&err), "cannot remove socket"),
    }
}
