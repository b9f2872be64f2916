//! The DRA driver's kubelet-facing gRPC: the DRAPlugin service in both API
//! versions over the [`Claims`] seam and device health beside it, served
//! with kubelet's registration.

use crate::error_text::chain;
use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Router;
use tonic::{Request, Response, Status};
use tracing::{debug, error, info, warn};

use crate::dra::api::health;
use crate::dra::api::pluginregistration::registration_server::RegistrationServer;
use crate::dra::api::{v1, v1beta1};
use crate::dra::claims::{ClaimRef, Claims, Prepared, PreparedDevice, Unprepared};
use crate::dra::health::{HealthFeed, HealthService};
use crate::dra::registration::{Registration, RegistrationService};
use crate::kubelet::authority;

/// Where DRA drivers put their plugin sockets, one directory per driver.
pub const DEFAULT_PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
/// The directory kubelet's plugin watcher watches for registration sockets.
pub const DEFAULT_REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
/// The DRA socket's name in the driver's directory under the plugins dir.
pub const DRA_SOCKET_NAME: &str = "dra.sock";

/// How long a stopping server may take to drain before it is dropped: its
/// only client is kubelet, which re-dials anyway.
const DRAIN: Duration = Duration::from_secs(1);

/// Where the driver's two sockets go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraSockets {
    pub driver_name: String,
    pub plugins_dir: PathBuf,
    pub registry_dir: PathBuf,
}

impl DraSockets {
    /// `driver_name`'s sockets in kubelet's default directories.
    pub fn new(driver_name: &str) -> Self {
        DraSockets {
            driver_name: driver_name.to_owned(),
            plugins_dir: PathBuf::from(DEFAULT_PLUGINS_DIR),
            registry_dir: PathBuf::from(DEFAULT_REGISTRY_DIR),
        }
    }

    /// `<plugins_dir>/<driver>/dra.sock`: kubelet calls DRAPlugin here.
    pub fn dra_socket(&self) -> PathBuf {
        self.plugins_dir
            .join(&self.driver_name)
            .join(DRA_SOCKET_NAME)
    }

    /// `<registry_dir>/<driver>-reg.sock`: kubelet's plugin watcher finds us
    /// here.
    pub fn registration_socket(&self) -> PathBuf {
        self.registry_dir
            .join(format!("{}-reg.sock", self.driver_name))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DraError {
    #[error("driver name {name:?} cannot name a socket: it must be non-empty, without '/', and not start with '.' (kubelet ignores such sockets)")]
    DriverName { name: String },
    // These two tell their cause mid-sentence, before the fix: it is not
    // chained, so it is said once.
    #[error("kubelet's plugin registry {path} is not a usable directory: {error}; mount the host's {DEFAULT_REGISTRY_DIR} there (kubelet creates it and watches it for registration sockets)")]
    RegistryDir { path: PathBuf, error: io::Error },
    #[error("cannot create the DRA socket directory {path}: {error}; mount the host's {DEFAULT_PLUGINS_DIR} writable")]
    SocketDir { path: PathBuf, error: io::Error },
    #[error("socket path {path} is not UTF-8, which kubelet needs to be told the endpoint")]
    NotUtf8 { path: PathBuf },
    #[error("another process is serving {path}; stop it before starting a second gpumem here")]
    SocketInUse { path: PathBuf },
    #[error("cannot create socket {path}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("the gRPC server on {path} failed")]
    Serve {
        path: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("the gRPC server on {path} stopped abnormally")]
    Task {
        path: PathBuf,
        source: tokio::task::JoinError,
    },
}

/// The DRAPlugin service, both versions: translates between kubelet's
/// messages and the [`Claims`] seam.
#[derive(Clone)]
pub struct DraService {
    claims: Arc<dyn Claims>,
}

impl DraService {
    pub fn new(claims: Arc<dyn Claims>) -> Self {
        DraService { claims }
    }

    async fn prepare(&self, asked: Vec<ClaimRef>) -> Prepared {
        if asked.is_empty() {
            return Prepared::new();
        }
        debug!(claims = asked.len(), "NodePrepareResources");
        let answered = self.claims.prepare(asked.clone()).await;
        answer_every_claim(&asked, answered, "prepare")
    }

    async fn unprepare(&self, asked: Vec<ClaimRef>) -> Unprepared {
        if asked.is_empty() {
            return Unprepared::new();
        }
        debug!(claims = asked.len(), "NodeUnprepareResources");
        let answered = self.claims.unprepare(asked.clone()).await;
        answer_every_claim(&asked, answered, "unprepare")
    }
}

/// One entry per claim asked about, whatever the seam answered: kubelet
/// asks again for a claim without one, and refuses a whole response that
/// names a claim it did not ask about.
fn answer_every_claim<T>(
    asked: &[ClaimRef],
    mut answered: BTreeMap<String, Result<T, String>>,
    what: &str,
) -> BTreeMap<String, Result<T, String>> {
    let mut complete = BTreeMap::new();
    for claim in asked {
        if complete.contains_key(&claim.uid) {
            continue;
        }
        let result = match answered.remove(&claim.uid) {
            // An empty error reads as success to kubelet.
            Some(Err(reason)) if reason.is_empty() => Err(format!(
                "could not {what} claim {}/{} (no reason given)",
                claim.namespace, claim.name
            )),
            Some(result) => result,
            None => {
                error!(namespace = %claim.namespace, name = %claim.name, uid = %claim.uid, "no {what} result for a claim; answering an error so kubelet retries");
                Err(format!(
                    "gpumem gave no {what} result for claim {}/{} ({}); kubelet retries",
                    claim.namespace, claim.name, claim.uid
                ))
            }
        };
        complete.insert(claim.uid.clone(), result);
    }
    if !answered.is_empty() {
        warn!(uids = ?answered.keys().collect::<Vec<_>>(), "dropping {what} results for claims kubelet did not ask about");
    }
    complete
}

/// The seam's claims, from either version's (namespace, UID, name).
fn claim_refs(
    claims: impl Iterator<Item = (String, String, String)>,
) -> Result<Vec<ClaimRef>, Status> {
    claims
        .map(|(namespace, uid, name)| {
            if uid.is_empty() {
                return Err(Status::invalid_argument(format!(
                    "claim {namespace}/{name} has no UID"
                )));
            }
            Ok(ClaimRef {
                namespace,
                uid,
                name,
            })
        })
        .collect()
}

fn v1_device(d: PreparedDevice) -> v1::Device {
    v1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
        share_id: d.share_id,
    }
}

/// v1beta1 has no share ID. Only kubelets before 1.34 choose v1beta1 over
/// v1, and those cannot allocate a device many times, so none is lost.
fn v1beta1_device(d: PreparedDevice) -> v1beta1::Device {
    v1beta1::Device {
        request_names: d.request_names,
        pool_name: d.pool_name,
        device_name: d.device_name,
        cdi_device_ids: d.cdi_device_ids,
    }
}

/// The DRAPlugin service of one API version (`v1`, `v1beta1`): the
/// versions' messages have the same fields, but their own types; `device`
/// converts a prepared device into the version's.
macro_rules! dra_plugin {
    ($version:ident, $device:ident) => {
        #[tonic::async_trait]
        impl $version::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                request: Request<$version::NodePrepareResourcesRequest>,
            ) -> Result<Response<$version::NodePrepareResourcesResponse>, Status> {
                let asked = claim_refs(
                    request
                        .into_inner()
                        .claims
                        .into_iter()
                        .map(|c| (c.namespace, c.uid, c.name)),
                )?;
                let claims = self
                    .prepare(asked)
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let (devices, error) = match result {
                            Ok(devices) => {
                                (devices.into_iter().map($device).collect(), String::new())
                            }
                            Err(error) => (Vec::new(), error),
                        };
                        (
                            uid,
                            $version::NodePrepareResourceResponse { devices, error },
                        )
                    })
                    .collect();
                Ok(Response::new($version::NodePrepareResourcesResponse {
                    claims,
                }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<$version::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$version::NodeUnprepareResourcesResponse>, Status> {
                let asked = claim_refs(
                    request
                        .into_inner()
                        .claims
                        .into_iter()
                        .map(|c| (c.namespace, c.uid, c.name)),
                )?;
                let claims = self
                    .unprepare(asked)
                    .await
                    .into_iter()
                    .map(|(uid, result)| {
                        let error = result.err().unwrap_or_default();
                        (uid, $version::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($version::NodeUnprepareResourcesResponse {
                    claims,
                }))
            }
        }
    };
}

dra_plugin!(v1, v1_device);
dra_plugin!(v1beta1, v1beta1_device);

/// Serves the DRA socket, then the registration socket (kubelet dials the
/// DRA socket as soon as it has registered us), until `shutdown`; then
/// removes both, so kubelet deregisters the driver. The DRA socket serves
/// both DRAPlugin versions and, for kubelets with `ResourceHealthStatus`
/// (whichever version they chose), the devices' health from `health` in
/// both DRAResourceHealth versions.
/// kubelet's answers go to `registration`. Returns early with an error if
/// either server fails: kubelet needs both.
pub async fn serve(
    sockets: &DraSockets,
    claims: Arc<dyn Claims>,
    health: HealthFeed,
    registration: watch::Sender<Registration>,
    shutdown: CancellationToken,
) -> Result<(), DraError> {
    let name = &sockets.driver_name;
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(DraError::DriverName { name: name.clone() });
    }
    let registry = &sockets.registry_dir;
    // kubelet creates the registry and watches it; one we created would not
    // be watched, so it must already be there.
    match std::fs::metadata(registry) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(DraError::RegistryDir {
                path: registry.clone(),
                error: io::Error::other("not a directory"),
            })
        }
        Err(error) => {
            return Err(DraError::RegistryDir {
                path: registry.clone(),
                error,
            })
        }
    }
    let dra_socket = sockets.dra_socket();
    if let Some(dir) = dra_socket.parent() {
        std::fs::create_dir_all(dir).map_err(|error| DraError::SocketDir {
            path: dir.to_owned(),
            error,
        })?;
    }
    let endpoint = dra_socket.to_str().ok_or_else(|| DraError::NotUtf8 {
        path: dra_socket.clone(),
    })?;
    let registration_socket = sockets.registration_socket();

    let stop = shutdown.child_token();
    let service = DraService::new(claims);
    // Its streams end on `stop`, so the server drains at shutdown.
    let health = HealthService::new(health, stop.clone());
    let dra = tonic::transport::Server::builder()
        .add_service(v1::dra_plugin_server::DraPluginServer::new(service.clone()))
        .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(service))
        .add_service(
            health::v1::dra_resource_health_server::DraResourceHealthServer::new(health.clone()),
        )
        .add_service(
            health::v1alpha1::dra_resource_health_server::DraResourceHealthServer::new(health),
        );
    registration.send_replace(Registration::Waiting);
    let register = tonic::transport::Server::builder().add_service(RegistrationServer::new(
        RegistrationService::new(name, endpoint, registration),
    ));

    let mut served = Vec::new();
    let started = async {
        served.push(Served::start(&dra_socket, dra, &stop).await?);
        served.push(Served::start(&registration_socket, register, &stop).await?);
        Ok(())
    }
    .await;
    if started.is_ok() {
        info!(
            driver = %name,
            dra = %dra_socket.display(),
            registration = %registration_socket.display(),
            "serving the DRA plugin; kubelet registers it once it sees the registration socket"
        );
        // Shutdown, or a server failed.
        stop.cancelled().await;
    }
    let failed = teardown(served, &stop).await;
    started?;
    if let Some(err) = failed {
        return Err(err);
    }
    info!(driver = %name, "DRA plugin stopped");
    Ok(())
}

/// A server on one of our sockets.
struct Served {
    path: PathBuf,
    id: SocketId,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Served {
    /// Binds `path` and serves `router` there until `stop`, which a failure
    /// of this server cancels too.
    async fn start(
        path: &Path,
        router: Router,
        stop: &CancellationToken,
    ) -> Result<Self, DraError> {
        let (listener, id) = bind(path).await?;
        let server = router.serve_with_incoming_shutdown(
            // kubelet's plugin watcher sends the registration socket's path
            // as :authority (grpc-go's default), which h2 refuses.
            authority::lenient(UnixListenerStream::new(listener)),
            stop.clone().cancelled_owned(),
        );
        let stop = stop.clone();
        let task = tokio::spawn(async move {
            let result = server.await;
            if result.is_err() {
                stop.cancel();
            }
            result
        });
        Ok(Served {
            path: path.to_owned(),
            id,
            task,
        })
    }
}

/// Removes our sockets (registration first, so kubelet deregisters us before
/// the DRA socket goes), stops the servers, and says why one failed.
async fn teardown(served: Vec<Served>, stop: &CancellationToken) -> Option<DraError> {
    for s in served.iter().rev() {
        // Another instance may have replaced it since: leave theirs.
        if SocketId::of(&s.path) == Some(s.id) {
            if let Err(err) = std::fs::remove_file(&s.path) {
                warn!(socket = %s.path.display(), err = %chain(&err), "cannot remove our socket");
            }
        }
    }
    stop.cancel();
    let deadline = tokio::time::Instant::now() + DRAIN;
    let mut failed = None;
    for Served { path, mut task, .. } in served {
        let err = match tokio::time::timeout_at(deadline, &mut task).await {
            Ok(Ok(Ok(()))) => continue,
            Ok(Ok(Err(source))) => DraError::Serve { path, source },
            Ok(Err(source)) => DraError::Task { path, source },
            Err(_) => {
                warn!(socket = %path.display(), "server did not drain within {DRAIN:?}; dropping it");
                task.abort();
                continue;
            }
        };
        error!(err = %chain(&err), "DRA plugin server failed");
        failed.get_or_insert(err);
    }
    failed
}

/// Binds a fresh socket at `path`, replacing a stale one (a socket nobody
/// serves, left by a process that died), under its final name at once.
///
/// kubelet's plugin watcher stats every entry that appears in its registry,
/// and in any directory below it, before it looks at the name: a temporary
/// name there, even a hidden one, is renamed away first and kubelet logs
/// `stat file … failed`. Nor can the socket be bound outside the registry
/// and renamed in: the DaemonSet mounts the registry on its own (hostPath),
/// and rename(2) does not cross mounts, even of one filesystem (`EXDEV`).
/// Binding in place is what the watcher's README asks and what
/// k8s.io/dynamic-resource-allocation's kubeletplugin does; the listener
/// listens as it binds, and kubelet dials from a reconciler that tries
/// again a second later should it ever come between the two.
async fn bind(path: &Path) -> Result<(UnixListener, SocketId), DraError> {
    if UnixStream::connect(path).await.is_ok() {
        return Err(DraError::SocketInUse {
            path: path.to_owned(),
        });
    }
    let bind_err = |source| DraError::Bind {
        path: path.to_owned(),
        source,
    };
    remove_staging_sockets(path);
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(err) if err.kind() == io::ErrorKind::NotFound => {}
        Err(err) => return Err(bind_err(err)),
    }
    let listener = UnixListener::bind(path).map_err(bind_err)?;
    let id = SocketId::of(path)
        .ok_or_else(|| bind_err(io::Error::other("socket vanished right after bind")))?;
    Ok((listener, id))
}

/// Removes the hidden staging sockets (`.gpumem-<pid>.sock`) that earlier
/// versions, which bound under such a name and renamed it into place, left
/// beside `path` when a start was cut off between the two. Only one front
/// end runs per node (its lock is held by now), so none is another's.
fn remove_staging_sockets(path: &Path) {
    let Some(dir) = path.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".gpumem-") && name.ends_with(".sock") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Identity of a socket file, to remove only our own at shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SocketId {
    dev: u64,
    ino: u64,
}

impl SocketId {
    fn of(path: &Path) -> Option<SocketId> {
        let meta = std::fs::symlink_metadata(path).ok()?;
        Some(SocketId {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::node::gpu::Gpu;
    use crate::node::inventory::Inventory;
    use crate::node::units::MemoryUnit;
    use gpumem_testkit::simulator::dra::{
        health_of, wait_for_socket, DraVersion, FakeDraKubelet, FakeKubeletError, HealthStatus,
        HealthVersion, KUBELET_1_33, KUBELET_1_34, KUBELET_1_37,
    };

    const WAIT: Duration = Duration::from_secs(10);

    /// Prepares every claim with two devices derived from it, except by
    /// name: "forgotten" gets no entry, "unexplained" an empty error,
    /// "full" a real one. Always adds a claim nobody asked about.
    #[derive(Default)]
    struct FakeClaims {
        unprepared: Mutex<Vec<ClaimRef>>,
    }

    fn devices_of(claim: &ClaimRef) -> Vec<PreparedDevice> {
        vec![
            PreparedDevice {
                request_names: vec!["gpu".into(), "also".into()],
                pool_name: "node-a".into(),
                device_name: "gpu-0".into(),
                cdi_device_ids: vec![
                    format!("gpumem.io/gpu=gpu-0-{}", claim.uid),
                    "gpumem.io/gpu=common".into(),
                ],
                share_id: Some(format!("share-{}", claim.uid)),
            },
            PreparedDevice {
                request_names: vec![],
                pool_name: "node-a".into(),
                device_name: "gpu-1".into(),
                cdi_device_ids: vec![],
                share_id: None,
            },
        ]
    }

    #[tonic::async_trait]
    impl Claims for FakeClaims {
        async fn prepare(&self, claims: Vec<ClaimRef>) -> Prepared {
            let mut prepared = Prepared::new();
            for claim in claims {
                let result = match claim.name.as_str() {
                    "forgotten" => continue,
                    "unexplained" => Err(String::new()),
                    "full" => Err("GPU gpu-0 has 2 GiB free; the claim asks 4 GiB".into()),
                    _ => Ok(devices_of(&claim)),
                };
                prepared.insert(claim.uid, result);
            }
            prepared.insert("stranger".into(), Ok(vec![]));
            prepared
        }

        async fn unprepare(&self, claims: Vec<ClaimRef>) -> Unprepared {
            let mut unprepared = Unprepared::new();
            for claim in claims {
                self.unprepared.lock().unwrap().push(claim.clone());
                if claim.name != "forgotten" {
                    unprepared.insert(claim.uid, Ok(()));
                }
            }
            unprepared.insert("stranger".into(), Ok(()));
            unprepared
        }
    }

    fn claim(name: &str) -> ClaimRef {
        ClaimRef {
            namespace: "team-a".into(),
            uid: format!("uid-{name}"),
            name: name.into(),
        }
    }

    struct Driver {
        sockets: DraSockets,
        claims: Arc<FakeClaims>,
        /// What the health watcher would keep current.
        gpus: watch::Sender<Arc<Inventory>>,
        state: watch::Receiver<Registration>,
        shutdown: CancellationToken,
        task: JoinHandle<Result<(), DraError>>,
        _dir: tempfile::TempDir,
    }

    /// Two healthy T4s in pool `node-a`, watched.
    fn feed() -> (watch::Sender<Arc<Inventory>>, HealthFeed) {
        let gpus = (0..2)
            .map(|index| Gpu {
                index,
                uuid: format!("GPU-{index}"),
                name: "Tesla T4".into(),
                memory_mib: 15079,
                healthy: true,
            })
            .collect();
        let inventory = Inventory::new(gpus, MemoryUnit::GiB).unwrap();
        let (tx, rx) = watch::channel(Arc::new(inventory));
        let feed = HealthFeed {
            pool: "node-a".into(),
            inventory: rx,
            checked: true,
        };
        (tx, feed)
    }

    fn sockets_in(dir: &Path) -> DraSockets {
        DraSockets {
            driver_name: crate::dra::DEFAULT_DRIVER_NAME.into(),
            plugins_dir: dir.join("plugins"),
            registry_dir: dir.join("plugins_registry"),
        }
    }

    impl Driver {
        /// Serves in a fresh directory whose registry kubelet has created.
        async fn start() -> Driver {
            let dir = tempfile::tempdir().unwrap();
            let sockets = sockets_in(dir.path());
            std::fs::create_dir(&sockets.registry_dir).unwrap();
            Driver::start_in(dir, sockets).await
        }

        async fn start_in(dir: tempfile::TempDir, sockets: DraSockets) -> Driver {
            let claims = Arc::new(FakeClaims::default());
            let (gpus, health) = feed();
            let (registration, state) = watch::channel(Registration::Waiting);
            let shutdown = CancellationToken::new();
            let task = tokio::spawn({
                let sockets = sockets.clone();
                let claims: Arc<dyn Claims> = claims.clone();
                let shutdown = shutdown.clone();
                let health = health.clone();
                async move { serve(&sockets, claims, health, registration, shutdown).await }
            });
            wait_for_socket(&sockets.registration_socket(), WAIT)
                .await
                .unwrap();
            // A stale socket is there before ours: wait until it is served.
            let deadline = tokio::time::Instant::now() + WAIT;
            while UnixStream::connect(sockets.registration_socket())
                .await
                .is_err()
            {
                assert!(tokio::time::Instant::now() < deadline, "never served");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Driver {
                sockets,
                claims,
                gpus,
                state,
                shutdown,
                task,
                _dir: dir,
            }
        }

        async fn registration(&mut self, want: impl Fn(&Registration) -> bool) -> Registration {
            tokio::time::timeout(WAIT, self.state.wait_for(want))
                .await
                .expect("registration state reached in time")
                .unwrap()
                .clone()
        }

        async fn stop(self) -> (DraSockets, Result<(), DraError>) {
            self.shutdown.cancel();
            let result = tokio::time::timeout(WAIT, self.task)
                .await
                .unwrap()
                .unwrap();
            (self.sockets, result)
        }
    }

    #[tokio::test]
    async fn a_kubelet_knowing_both_versions_registers_us_through_v1() {
        let mut driver = Driver::start().await;
        let kubelet = FakeDraKubelet::register(&driver.sockets.registration_socket(), KUBELET_1_34)
            .await
            .unwrap();
        assert_eq!(kubelet.version(), DraVersion::V1);
        let info = kubelet.info();
        assert_eq!(info.r#type, "DRAPlugin");
        assert_eq!(info.name, "gpumem.io");
        assert_eq!(
            Path::new(&info.endpoint),
            driver.sockets.dra_socket(),
            "the endpoint is the DRA socket's absolute path"
        );
        assert_eq!(
            driver.registration(|r| *r != Registration::Waiting).await,
            Registration::Registered
        );
        drop(kubelet);
        driver.stop().await.1.unwrap();
    }

    #[tokio::test]
    async fn a_1_33_kubelet_registers_us_through_v1beta1() {
        let mut driver = Driver::start().await;
        let kubelet = FakeDraKubelet::register(&driver.sockets.registration_socket(), KUBELET_1_33)
            .await
            .unwrap();
        assert_eq!(kubelet.version(), DraVersion::V1beta1);
        assert_eq!(
            driver.registration(|r| *r != Registration::Waiting).await,
            Registration::Registered
        );
        drop(kubelet);
        driver.stop().await.1.unwrap();
    }

    /// kubelet calls NodeWatchResources on the DRA socket whichever
    /// DRAPlugin version it chose: 1.37 the v1 service registration lists,
    /// older ones v1alpha1 unasked. The stream ends cleanly at shutdown.
    #[tokio::test]
    async fn device_health_is_served_beside_both_versions_until_shutdown() {
        let driver = Driver::start().await;
        let mut streams = Vec::new();
        for (known, health) in [
            (KUBELET_1_37, HealthVersion::V1),
            (KUBELET_1_34, HealthVersion::V1alpha1),
            (KUBELET_1_33, HealthVersion::V1alpha1),
        ] {
            let kubelet = FakeDraKubelet::register(&driver.sockets.registration_socket(), known)
                .await
                .unwrap();
            assert_eq!(kubelet.health_version(), Some(health), "{known:?}");
            let mut stream = kubelet.watch_resources().await.unwrap();
            let first = stream.next(WAIT).await.unwrap().unwrap();
            assert_eq!(
                health_of(&first),
                BTreeMap::from([
                    ("node-a/gpu-0".into(), HealthStatus::Healthy),
                    ("node-a/gpu-1".into(), HealthStatus::Healthy),
                ]),
                "{:?}",
                kubelet.version()
            );
            streams.push(stream);
        }
        let sick = driver.gpus.borrow().with_health("GPU-0", false).unwrap();
        driver.gpus.send_replace(Arc::new(sick));
        for stream in &mut streams {
            let changed = stream.next_health(WAIT).await.unwrap().unwrap();
            assert_eq!(changed["node-a/gpu-0"], HealthStatus::Unhealthy);
        }
        let (_, stopped) = driver.stop().await;
        stopped.unwrap();
        for stream in &mut streams {
            assert!(stream.next(WAIT).await.unwrap().is_none());
        }
    }

    #[tokio::test]
    async fn refusals_reach_the_registration_state() {
        let mut driver = Driver::start().await;
        let socket = driver.sockets.registration_socket();
        FakeDraKubelet::refuse(&socket, "endpoint already registered for DRA driver plugin")
            .await
            .unwrap();
        assert_eq!(
            driver.registration(|r| *r != Registration::Waiting).await,
            Registration::Refused("endpoint already registered for DRA driver plugin".into())
        );

        // A kubelet that knows neither version (1.31 knew v1alpha4 only).
        let err = match FakeDraKubelet::register(&socket, &["v1alpha4.DRAPlugin"]).await {
            Ok(_) => panic!("registered with a kubelet that knows none of our versions"),
            Err(err) => err,
        };
        assert!(matches!(err, FakeKubeletError::Refused(_)), "{err}");
        let state = driver
            .registration(
                |r| matches!(r, Registration::Refused(why) if why.contains("none of services")),
            )
            .await;
        let Registration::Refused(why) = state else {
            unreachable!()
        };
        assert!(
            why.contains("v1.DRAPlugin") && why.contains("v1alpha4"),
            "{why}"
        );

        // kubelet restarts and takes us.
        let _kubelet = FakeDraKubelet::register(&socket, KUBELET_1_34)
            .await
            .unwrap();
        driver
            .registration(|r| *r == Registration::Registered)
            .await;
        driver.stop().await.1.unwrap();
    }

    #[tokio::test]
    async fn prepare_and_unprepare_carry_every_field_through_both_versions() {
        let driver = Driver::start().await;
        let socket = driver.sockets.registration_socket();
        let new = FakeDraKubelet::register(&socket, KUBELET_1_34)
            .await
            .unwrap();
        let old = FakeDraKubelet::register(&socket, KUBELET_1_33)
            .await
            .unwrap();
        let claims = [claim("train"), claim("infer")];
        let expected: Prepared = claims
            .iter()
            .map(|c| (c.uid.clone(), Ok(devices_of(c))))
            .collect();

        assert_eq!(new.prepare(&claims).await.unwrap(), expected);
        let without_share_ids: Prepared = expected
            .iter()
            .map(|(uid, devices)| {
                let mut devices = devices.clone().unwrap();
                for d in &mut devices {
                    d.share_id = None;
                }
                (uid.clone(), Ok(devices))
            })
            .collect();
        assert_eq!(old.prepare(&claims).await.unwrap(), without_share_ids);

        let done: Unprepared = claims.iter().map(|c| (c.uid.clone(), Ok(()))).collect();
        assert_eq!(new.unprepare(&claims).await.unwrap(), done);
        assert_eq!(old.unprepare(&claims[..1]).await.unwrap(), {
            let mut first = done.clone();
            first.remove("uid-infer");
            first
        });
        // Namespace, UID and name all reach the seam, through both versions.
        assert_eq!(
            *driver.claims.unprepared.lock().unwrap(),
            [claims[0].clone(), claims[1].clone(), claims[0].clone()]
        );
        drop((new, old));
        driver.stop().await.1.unwrap();
    }

    #[tokio::test]
    async fn every_claim_asked_about_gets_an_entry_and_no_other() {
        let driver = Driver::start().await;
        let socket = driver.sockets.registration_socket();
        let claims = [
            claim("ok"),
            claim("forgotten"),
            claim("unexplained"),
            claim("full"),
        ];
        for versions in [KUBELET_1_34, KUBELET_1_33] {
            let kubelet = FakeDraKubelet::register(&socket, versions).await.unwrap();
            let prepared = kubelet.prepare(&claims).await.unwrap();
            assert_eq!(
                prepared.keys().collect::<Vec<_>>(),
                ["uid-forgotten", "uid-full", "uid-ok", "uid-unexplained"],
                "{:?}",
                kubelet.version()
            );
            assert!(prepared["uid-ok"].is_ok());
            let error = |uid: &str| prepared[uid].clone().unwrap_err();
            assert!(error("uid-forgotten").contains("no prepare result for claim team-a/forgotten"));
            assert!(error("uid-unexplained").contains("team-a/unexplained"));
            assert_eq!(
                error("uid-full"),
                "GPU gpu-0 has 2 GiB free; the claim asks 4 GiB"
            );

            let unprepared = kubelet.unprepare(&claims).await.unwrap();
            assert_eq!(unprepared.len(), 4);
            assert!(unprepared["uid-forgotten"]
                .clone()
                .unwrap_err()
                .contains("no unprepare result"));
            assert!(unprepared["uid-ok"].is_ok());
        }
        driver.stop().await.1.unwrap();
    }

    #[tokio::test]
    async fn sockets_are_removed_at_shutdown() {
        let driver = Driver::start().await;
        let kubelet = FakeDraKubelet::register(&driver.sockets.registration_socket(), KUBELET_1_34)
            .await
            .unwrap();
        assert!(driver.sockets.dra_socket().exists());
        // A connection kubelet keeps open does not hold shutdown up.
        kubelet.prepare(&[claim("ok")]).await.unwrap();
        let (sockets, result) = driver.stop().await;
        result.unwrap();
        assert!(!sockets.registration_socket().exists());
        assert!(!sockets.dra_socket().exists());
        drop(kubelet);
    }

    #[tokio::test]
    async fn stale_sockets_are_replaced_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let sockets = sockets_in(dir.path());
        std::fs::create_dir(&sockets.registry_dir).unwrap();
        std::fs::create_dir_all(sockets.dra_socket().parent().unwrap()).unwrap();
        // Left by a process that died: files nobody listens on, and an
        // earlier version's staging socket.
        for path in [sockets.dra_socket(), sockets.registration_socket()] {
            drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
            assert!(path.exists());
        }
        let staging = sockets.registry_dir.join(".gpumem-1.sock");
        drop(std::os::unix::net::UnixListener::bind(&staging).unwrap());
        let driver = Driver::start_in(dir, sockets).await;
        // No hidden socket is made, and none is left behind.
        for dir in [
            &driver.sockets.registry_dir,
            driver.sockets.dra_socket().parent().unwrap(),
        ] {
            let hidden: Vec<_> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .filter(|name| name.to_string_lossy().starts_with('.'))
                .collect();
            assert!(hidden.is_empty(), "{hidden:?}");
        }
        let kubelet = FakeDraKubelet::register(&driver.sockets.registration_socket(), KUBELET_1_34)
            .await
            .unwrap();
        assert!(kubelet.prepare(&[claim("ok")]).await.unwrap()["uid-ok"].is_ok());
        drop(kubelet);
        driver.stop().await.1.unwrap();
    }

    #[tokio::test]
    async fn a_socket_another_process_serves_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let sockets = sockets_in(dir.path());
        std::fs::create_dir(&sockets.registry_dir).unwrap();
        std::fs::create_dir_all(sockets.dra_socket().parent().unwrap()).unwrap();
        let _theirs = UnixListener::bind(sockets.dra_socket()).unwrap();
        let claims: Arc<dyn Claims> = Arc::new(FakeClaims::default());
        let (registration, _) = watch::channel(Registration::Waiting);
        let err = serve(
            &sockets,
            claims,
            feed().1,
            registration,
            CancellationToken::new(),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(&err, DraError::SocketInUse { path } if *path == sockets.dra_socket()),
            "{err}"
        );
        assert!(sockets.dra_socket().exists(), "theirs is still there");
        assert!(!sockets.registration_socket().exists());
    }

    #[tokio::test]
    async fn start_up_errors_name_what_to_fix() {
        let dir = tempfile::tempdir().unwrap();
        let serve_with = |sockets: DraSockets| async move {
            let claims: Arc<dyn Claims> = Arc::new(FakeClaims::default());
            let (registration, _) = watch::channel(Registration::Waiting);
            serve(
                &sockets,
                claims,
                feed().1,
                registration,
                CancellationToken::new(),
            )
            .await
            .unwrap_err()
            .to_string()
        };
        let sockets = sockets_in(dir.path());
        let err = serve_with(sockets.clone()).await;
        assert!(
            err.contains(&sockets.registry_dir.display().to_string())
                && err.contains("/var/lib/kubelet/plugins_registry"),
            "{err}"
        );
        for name in ["", "../gpumem.io", ".gpumem.io"] {
            let err = serve_with(DraSockets {
                driver_name: name.into(),
                ..sockets.clone()
            })
            .await;
            assert!(err.contains("driver name"), "{err}");
        }
    }

    #[test]
    fn default_sockets_are_where_kubelet_looks() {
        let sockets = DraSockets::new("gpumem.io");
        assert_eq!(
            sockets.dra_socket(),
            Path::new("/var/lib/kubelet/plugins/gpumem.io/dra.sock")
        );
        assert_eq!(
            sockets.registration_socket(),
            Path::new("/var/lib/kubelet/plugins_registry/gpumem.io-reg.sock")
        );
    }
}
