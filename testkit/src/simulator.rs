//! An in-process kubelet for `gpumem demo` and the tests: a real Registration
//! server on a real unix socket, driving plugins the way kubelet does.
//!
//! It follows the real kubelet (pkg/kubelet/cm/devicemanager) where a plugin
//! can tell the difference: Register is synchronous (dial back, then
//! GetDevicePluginOptions), one ListAndWatch per connection, devices picked
//! from `healthy − allocated` with GetPreferredAllocation, one Allocate per
//! container, 4 MiB receive limit, and a restart that deletes every socket.
//! It writes kubelet's device checkpoint as kubelet does: at every allocation
//! and every device list, not when a pod ends. An ended pod's devices are
//! freed at the next pod-resources List or allocation (kubelet's
//! UpdateAllocatedDevices); List never shows regular init containers, and
//! shows ended pods (without devices) only in the mode of kubelets before
//! 1.34.

pub mod dra;

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use gpumem_kubelet_api::deviceplugin::device_plugin_client::DevicePluginClient;
use gpumem_kubelet_api::deviceplugin::registration_server::{Registration, RegistrationServer};
use gpumem_kubelet_api::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerAllocateResponse,
    ContainerPreferredAllocationRequest, Device, DevicePluginOptions, Empty,
    PreferredAllocationRequest, RegisterRequest, HEALTHY, VERSION,
};
use gpumem_kubelet_api::podresources::pod_resources_lister_server::{
    PodResourcesLister, PodResourcesListerServer,
};
use gpumem_kubelet_api::podresources::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ClaimResource, ContainerDevices,
    ContainerResources, DynamicResource, GetPodResourcesRequest, GetPodResourcesResponse,
    ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use gpumem_kubelet_api::unix;

/// kubelet's registration socket, in the device plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// kubelet's device checkpoint, in the device plugin directory.
pub const CHECKPOINT: &str = "kubelet_internal_checkpoint";
/// kubelet dials a registering plugin with this timeout.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// The pod-resources socket, relative to the simulator's directory (on a
/// node: /var/lib/kubelet/pod-resources/kubelet.sock, beside device-plugins/).
pub const POD_RESOURCES_SOCKET: &str = "pod-resources/kubelet.sock";
/// kubelet's pod-resources rate limit: 100 calls per second, burst 10.
const POD_RESOURCES_QPS: f64 = 100.0;
const POD_RESOURCES_BURST: f64 = 10.0;
/// Pods admitted by the simulator live in this namespace.
pub const NAMESPACE: &str = "default";

/// Why a container was not admitted.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    #[error("no device plugin is registered and connected for {0}")]
    NotRegistered(String),
    #[error("Insufficient {resource}: requested {requested}, {available} available on this node")]
    Insufficient {
        resource: String,
        requested: usize,
        available: usize,
    },
    #[error("GetPreferredAllocation failed: {}", .0.message())]
    Preferred(Status),
    #[error("Allocate failed: {}", .0.message())]
    Allocate(Status),
    #[error("plugin answered Allocate with no container response")]
    EmptyResponse,
}

/// What the simulated kubelet granted one container.
#[derive(Debug, Clone)]
pub struct Allocation {
    pub pod: String,
    pub container: String,
    pub resource: String,
    pub device_ids: Vec<String>,
    pub response: ContainerAllocateResponse,
    /// A regular init container: in the checkpoint, never in pod-resources.
    pub init: bool,
}

impl Allocation {
    /// The pod's UID as the checkpoint records it: a UUID, as kubelet's
    /// are and as the pod's cgroup names it, the same for the same name.
    pub fn pod_uid(&self) -> String {
        // FNV-1a, twice over, for 128 bits.
        let hash = |seed: u64| {
            self.pod.bytes().fold(seed, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
        };
        let (high, low) = (hash(0xcbf2_9ce4_8422_2325), hash(0x8422_2325_cbf2_9ce4));
        format!(
            "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
            high >> 32,
            (high >> 16) & 0xffff,
            high & 0xfff,
            low >> 52,
            low & 0xffff_ffff_ffff
        )
    }
}

struct Endpoint {
    client: DevicePluginClient<Channel>,
    options: DevicePluginOptions,
    /// The last ListAndWatch list; emptied when the stream ends.
    devices: Vec<Device>,
    /// The stream's first list: what kubelet could admit pods on first.
    first: Option<Vec<Device>>,
    connected: bool,
    /// Tells this endpoint's stream reader from a later registration's.
    serial: u64,
    /// Ends its ListAndWatch stream, as a failed read does in kubelet.
    hang_up: CancellationToken,
}

#[derive(Default)]
struct State {
    registrations: Vec<RegisterRequest>,
    endpoints: HashMap<String, Endpoint>,
    allocations: Vec<Allocation>,
    /// Containers running with DRA claims: (pod, container, claim).
    claim_uses: Vec<(String, String, ClaimUse)>,
    /// Regular init containers: (pod, container).
    init_containers: BTreeSet<(String, String)>,
    /// Pods that ended; their devices are freed at the next List or
    /// allocation.
    ended: BTreeSet<String>,
    /// List shows ended pods, as kubelets before 1.34 do
    /// (`KubeletPodResourcesListUseActivePods` off).
    lists_ended_pods: bool,
    next_serial: u64,
    /// Pod-resources calls answered and refused by the rate limit.
    pod_resources_calls: u64,
    pod_resources_refused: u64,
    /// Token bucket for the rate limit: tokens and when they were counted.
    bucket: Option<(f64, tokio::time::Instant)>,
}

impl State {
    /// kubelet's unary rate limiter on the pod-resources API.
    fn admit_pod_resources_call(&mut self) -> Result<(), Status> {
        let now = tokio::time::Instant::now();
        let (tokens, then) = self.bucket.unwrap_or((POD_RESOURCES_BURST, now));
        let tokens = (tokens + now.duration_since(then).as_secs_f64() * POD_RESOURCES_QPS)
            .min(POD_RESOURCES_BURST);
        if tokens < 1.0 {
            self.bucket = Some((tokens, now));
            self.pod_resources_refused += 1;
            return Err(Status::resource_exhausted("rejected by rate limit"));
        }
        self.bucket = Some((tokens - 1.0, now));
        self.pod_resources_calls += 1;
        Ok(())
    }

    /// kubelet's UpdateAllocatedDevices: frees the devices of ended pods,
    /// in memory only (the checkpoint keeps them until its next write).
    fn update_allocated_devices(&mut self) {
        let ended = &self.ended;
        self.allocations.retain(|a| !ended.contains(&a.pod));
    }

    fn pod(&self, name: &str) -> Option<PodResources> {
        let ended = self.ended.contains(name);
        let mut containers: Vec<ContainerResources> = Vec::new();
        for (_, container, claim) in self.claim_uses.iter().filter(|(pod, ..)| pod == name) {
            let dynamic = DynamicResource {
                claim_name: claim.name.clone(),
                claim_namespace: claim.namespace.clone(),
                claim_resources: vec![ClaimResource {
                    cdi_devices: Vec::new(),
                    driver_name: claim.driver.clone(),
                    pool_name: claim.pool.clone(),
                    device_name: claim.device.clone(),
                }],
            };
            match containers.iter_mut().find(|c| &c.name == container) {
                Some(c) => c.dynamic_resources.push(dynamic),
                None => containers.push(ContainerResources {
                    name: container.clone(),
                    dynamic_resources: vec![dynamic],
                    ..Default::default()
                }),
            }
        }
        let admitted = self.allocations.iter().any(|a| a.pod == name);
        if ended {
            // No devices any more; listed only by older kubelets.
            return self.lists_ended_pods.then(|| PodResources {
                name: name.to_owned(),
                namespace: NAMESPACE.to_owned(),
                containers: Vec::new(),
            });
        }
        for a in self.allocations.iter().filter(|a| a.pod == name && !a.init) {
            let devices = ContainerDevices {
                resource_name: a.resource.clone(),
                device_ids: a.device_ids.clone(),
                topology: None,
            };
            match containers.iter_mut().find(|c| c.name == a.container) {
                Some(c) => c.devices.push(devices),
                None => containers.push(ContainerResources {
                    name: a.container.clone(),
                    devices: vec![devices],
                    ..Default::default()
                }),
            }
        }
        // A pod is listed while active, with its app containers, holding
        // devices or not (this simulator knows only those that do).
        (admitted || !containers.is_empty()).then(|| PodResources {
            name: name.to_owned(),
            namespace: NAMESPACE.to_owned(),
            containers,
        })
    }
}

struct Shared {
    dir: PathBuf,
    state: Mutex<State>,
    /// Bumped on every state change so waiters can re-check.
    version: watch::Sender<u64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave State half-updated in a
        // way later readers would misread, so recover from poisoning.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn changed(&self) {
        self.version.send_modify(|v| *v += 1);
    }

    /// Writes kubelet's device checkpoint (`kubelet_internal_checkpoint`)
    /// from the allocations kubelet still has, whole and renamed into
    /// place, as kubelet's checkpoint manager does. `Checksum` is 0 (kubelet
    /// hashes Go's rendering of the data) and `AllocResp` left out: readers
    /// of the file must not depend on either.
    fn write_checkpoint(&self) {
        let state = self.lock();
        let entries: Vec<serde_json::Value> = state
            .allocations
            .iter()
            .map(|a| {
                serde_json::json!({
                    "PodUID": a.pod_uid(),
                    "ContainerName": a.container,
                    "ResourceName": a.resource,
                    "DeviceIDs": {"-1": a.device_ids},
                })
            })
            .collect();
        let registered: serde_json::Map<String, serde_json::Value> = state
            .endpoints
            .iter()
            .map(|(resource, ep)| {
                let healthy: Vec<&str> = ep
                    .devices
                    .iter()
                    .filter(|d| d.health == HEALTHY)
                    .map(|d| d.id.as_str())
                    .collect();
                (resource.clone(), serde_json::json!(healthy))
            })
            .collect();
        drop(state);
        let file = serde_json::json!({
            "Data": {"PodDeviceEntries": entries, "RegisteredDevices": registered},
            "Checksum": 0,
        });
        let path = self.dir.join(CHECKPOINT);
        let staging = self.dir.join(".kubelet_internal_checkpoint.tmp");
        // A simulator's write that fails shows as a test failure elsewhere.
        if std::fs::write(&staging, file.to_string()).is_ok() {
            let _ = std::fs::rename(&staging, &path);
        }
    }
}

/// A DRA claim a container uses, as pod-resources lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimUse {
    pub namespace: String,
    pub name: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
}

/// A running simulated kubelet. Dropping it stops it.
pub struct KubeletSim {
    shared: Arc<Shared>,
    /// Serializes admissions, as kubelet's device manager does.
    admission: tokio::sync::Mutex<()>,
    life: CancellationToken,
    servers: Vec<JoinHandle<()>>,
}

#[derive(Clone)]
struct PodResourcesService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl PodResourcesLister for PodResourcesService {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        let mut state = self.shared.lock();
        state.admit_pod_resources_call()?;
        state.update_allocated_devices();
        let mut names: Vec<&str> = state
            .allocations
            .iter()
            .map(|a| a.pod.as_str())
            .chain(state.claim_uses.iter().map(|(pod, ..)| pod.as_str()))
            .chain(state.ended.iter().map(String::as_str))
            .collect();
        names.sort_unstable();
        names.dedup();
        let pod_resources = names.iter().filter_map(|n| state.pod(n)).collect();
        Ok(Response::new(ListPodResourcesResponse { pod_resources }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        let mut state = self.shared.lock();
        state.admit_pod_resources_call()?;
        let devices = state
            .endpoints
            .iter()
            .filter(|(_, ep)| ep.connected)
            .map(|(resource, ep)| ContainerDevices {
                resource_name: resource.clone(),
                device_ids: ep
                    .devices
                    .iter()
                    .filter(|d| d.health == HEALTHY)
                    .map(|d| d.id.clone())
                    .collect(),
                topology: None,
            })
            .collect();
        Ok(Response::new(AllocatableResourcesResponse {
            devices,
            ..Default::default()
        }))
    }

    async fn get(
        &self,
        request: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        let request = request.into_inner();
        let mut state = self.shared.lock();
        state.admit_pod_resources_call()?;
        match state
            .pod(&request.pod_name)
            .filter(|_| request.pod_namespace == NAMESPACE)
        {
            Some(pod) => Ok(Response::new(GetPodResourcesResponse {
                pod_resources: Some(pod),
            })),
            None => Err(Status::not_found(format!(
                "pod {} in namespace {} not found",
                request.pod_name, request.pod_namespace
            ))),
        }
    }
}

#[derive(Clone)]
struct RegistrationService {
    shared: Arc<Shared>,
    life: CancellationToken,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let request = request.into_inner();
        if request.version != VERSION {
            return Err(Status::unknown(format!(
                "requested API version {:?} is not supported by kubelet",
                request.version
            )));
        }
        if !is_extended_resource_name(&request.resource_name) {
            return Err(Status::unknown(format!(
                "invalid extended resource name: {:?}",
                request.resource_name
            )));
        }
        // Go's filepath.Join: an absolute endpoint is appended, not used as is.
        let socket = self
            .shared
            .dir
            .join(request.endpoint.trim_start_matches('/'));
        let channel = tokio::time::timeout(DIAL_TIMEOUT, unix::connect(&socket))
            .await
            .map_err(|_| Status::unknown(format!("dial {}: timed out", socket.display())))?
            .map_err(|e| Status::unknown(format!("dial {}: {e}", socket.display())))?;
        let mut client = DevicePluginClient::new(channel);
        let options = client
            .get_device_plugin_options(Empty {})
            .await
            .map_err(|s| Status::unknown(format!("GetDevicePluginOptions: {}", s.message())))?
            .into_inner();
        let resource = request.resource_name.clone();
        let hang_up = CancellationToken::new();
        let serial = {
            let mut state = self.shared.lock();
            state.next_serial += 1;
            let serial = state.next_serial;
            state.registrations.push(request);
            state.endpoints.insert(
                resource.clone(),
                Endpoint {
                    client: client.clone(),
                    options,
                    devices: Vec::new(),
                    first: None,
                    connected: true,
                    serial,
                    hang_up: hang_up.clone(),
                },
            );
            serial
        };
        self.shared.changed();
        tokio::spawn(read_devices(
            self.shared.clone(),
            self.life.clone(),
            hang_up,
            client,
            resource,
            serial,
        ));
        Ok(Response::new(Empty {}))
    }
}

/// kubelet's one ListAndWatch per connection: every message replaces the
/// device list; the end of the stream disconnects the endpoint for good.
async fn read_devices(
    shared: Arc<Shared>,
    life: CancellationToken,
    hang_up: CancellationToken,
    mut client: DevicePluginClient<Channel>,
    resource: String,
    serial: u64,
) {
    let mut stream = match client.list_and_watch(Empty {}).await {
        Ok(response) => Some(response.into_inner()),
        Err(_) => None,
    };
    while let Some(s) = stream.as_mut() {
        let message = tokio::select! {
            () = life.cancelled() => break,
            () = hang_up.cancelled() => break,
            message = s.message() => message,
        };
        let Ok(Some(list)) = message else { break };
        if let Some(ep) = shared.lock().endpoints.get_mut(&resource) {
            if ep.serial == serial {
                ep.first.get_or_insert_with(|| list.devices.clone());
                ep.devices = list.devices;
            }
        }
        // kubelet's genericDeviceUpdateCallback writes it at every list.
        shared.write_checkpoint();
        shared.changed();
    }
    if let Some(ep) = shared.lock().endpoints.get_mut(&resource) {
        if ep.serial == serial {
            ep.connected = false;
            ep.devices.clear();
        }
    }
    shared.changed();
}

impl KubeletSim {
    /// Starts serving `<dir>/kubelet.sock`.
    pub fn start(dir: &Path) -> io::Result<KubeletSim> {
        let shared = Arc::new(Shared {
            dir: dir.to_owned(),
            state: Mutex::new(State::default()),
            version: watch::Sender::new(0),
        });
        let mut sim = KubeletSim {
            shared,
            admission: tokio::sync::Mutex::new(()),
            life: CancellationToken::new(),
            servers: Vec::new(),
        };
        sim.serve()?;
        Ok(sim)
    }

    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Path of the simulated pod-resources socket.
    pub fn pod_resources_socket(&self) -> PathBuf {
        self.shared.dir.join(POD_RESOURCES_SOCKET)
    }

    fn serve(&mut self) -> io::Result<()> {
        let registration = RegistrationServer::new(RegistrationService {
            shared: self.shared.clone(),
            life: self.life.clone(),
        });
        let path = self.shared.dir.join(KUBELET_SOCKET);
        self.spawn_server(
            &path,
            tonic::transport::Server::builder().add_service(registration),
        )?;

        let pod_resources = PodResourcesListerServer::new(PodResourcesService {
            shared: self.shared.clone(),
        });
        let path = self.pod_resources_socket();
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        self.spawn_server(
            &path,
            tonic::transport::Server::builder().add_service(pod_resources),
        )
    }

    fn spawn_server(
        &mut self,
        path: &Path,
        router: tonic::transport::server::Router,
    ) -> io::Result<()> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        let server = router.serve_with_incoming_shutdown(
            UnixListenerStream::new(listener),
            self.life.clone().cancelled_owned(),
        );
        self.servers.push(tokio::spawn(async move {
            let _ = server.await;
        }));
        Ok(())
    }

    async fn stop_serving(&mut self) {
        self.life.cancel();
        for server in self.servers.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
        }
        // Connections die with the process; the checkpoint keeps allocations.
        self.shared.lock().endpoints.clear();
        self.shared.changed();
    }

    /// A kubelet restart: stop, delete every socket in the directory (as
    /// kubelet's CleanupPluginDirectory does), serve a new kubelet.sock.
    pub async fn restart(&mut self) -> io::Result<()> {
        self.stop_serving().await;
        for entry in std::fs::read_dir(&self.shared.dir)? {
            let entry = entry?;
            if entry.file_type()?.is_socket() {
                std::fs::remove_file(entry.path())?;
            }
        }
        self.life = CancellationToken::new();
        self.serve()
    }

    /// Stops serving and removes kubelet.sock, as a stopped kubelet leaves it.
    pub async fn stop(mut self) {
        self.stop_serving().await;
        let _ = std::fs::remove_file(self.shared.dir.join(KUBELET_SOCKET));
        let _ = std::fs::remove_file(self.pod_resources_socket());
    }

    /// Every Register call accepted so far.
    pub fn registrations(&self) -> Vec<RegisterRequest> {
        self.shared.lock().registrations.clone()
    }

    /// The current device list of `resource`, if its plugin is connected.
    pub fn devices(&self, resource: &str) -> Option<Vec<Device>> {
        let state = self.shared.lock();
        let ep = state.endpoints.get(resource)?;
        ep.connected.then(|| ep.devices.clone())
    }

    /// The first list the latest registration of `resource` sent.
    pub fn first_devices(&self, resource: &str) -> Option<Vec<Device>> {
        self.shared.lock().endpoints.get(resource)?.first.clone()
    }

    /// Pod-resources calls (answered, refused by the rate limit).
    pub fn pod_resources_calls(&self) -> (u64, u64) {
        let state = self.shared.lock();
        (state.pod_resources_calls, state.pod_resources_refused)
    }

    pub fn allocations(&self) -> Vec<Allocation> {
        self.shared.lock().allocations.clone()
    }

    /// Waits until `resource` has had `registrations` accepted Register calls
    /// in all and its plugin has sent a device list; returns that list.
    pub async fn wait_for_devices(
        &self,
        resource: &str,
        registrations: usize,
        timeout: Duration,
    ) -> Option<Vec<Device>> {
        self.wait(timeout, |state| {
            let count = state
                .registrations
                .iter()
                .filter(|r| r.resource_name == resource)
                .count();
            let ep = state.endpoints.get(resource)?;
            (count >= registrations && ep.connected && !ep.devices.is_empty())
                .then(|| ep.devices.clone())
        })
        .await
    }

    /// Waits until the connected plugin of `resource` sends a list `accept`s.
    pub async fn wait_for_list(
        &self,
        resource: &str,
        timeout: Duration,
        accept: impl Fn(&[Device]) -> bool,
    ) -> Option<Vec<Device>> {
        self.wait(timeout, |state| {
            let ep = state.endpoints.get(resource).filter(|ep| ep.connected)?;
            accept(&ep.devices).then(|| ep.devices.clone())
        })
        .await
    }

    /// Ends the ListAndWatch stream of `resource`'s plugin, as kubelet does
    /// when reading it fails (a message over 4 MiB, say); like kubelet, it
    /// never calls ListAndWatch again on that registration.
    pub fn hang_up(&self, resource: &str) {
        if let Some(ep) = self.shared.lock().endpoints.get(resource) {
            ep.hang_up.cancel();
        }
    }

    /// Waits until no plugin of `resource` is connected (its stream ended).
    pub async fn wait_for_disconnect(&self, resource: &str, timeout: Duration) -> bool {
        self.wait(timeout, |state| {
            let connected = state.endpoints.get(resource).is_some_and(|ep| ep.connected);
            (!connected).then_some(())
        })
        .await
        .is_some()
    }

    /// Waits until `check` returns `Some`, re-checking on every change.
    async fn wait<T>(&self, timeout: Duration, check: impl Fn(&State) -> Option<T>) -> Option<T> {
        let mut version = self.shared.version.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(found) = check(&self.shared.lock()) {
                return Some(found);
            }
            match tokio::time::timeout_at(deadline, version.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    /// Admits one container asking for `count` devices of `resource`, the
    /// way kubelet's device manager does at pod admission.
    pub async fn admit(
        &self,
        pod: &str,
        container: &str,
        resource: &str,
        count: usize,
    ) -> Result<Allocation, AdmissionError> {
        let _serial = self.admission.lock().await;
        let (mut client, options, available, init) = {
            let mut state = self.shared.lock();
            state.update_allocated_devices();
            state.ended.remove(pod);
            let init = state
                .init_containers
                .contains(&(pod.to_owned(), container.to_owned()));
            let ep = state
                .endpoints
                .get(resource)
                .filter(|ep| ep.connected)
                .ok_or_else(|| AdmissionError::NotRegistered(resource.to_owned()))?;
            let allocated: BTreeSet<&String> = state
                .allocations
                .iter()
                .filter(|a| a.resource == resource)
                .flat_map(|a| &a.device_ids)
                .collect();
            let available: Vec<String> = ep
                .devices
                .iter()
                .filter(|d| d.health == HEALTHY && !allocated.contains(&d.id))
                .map(|d| d.id.clone())
                .collect();
            (ep.client.clone(), ep.options, available, init)
        };
        if available.len() < count {
            return Err(AdmissionError::Insufficient {
                resource: resource.to_owned(),
                requested: count,
                available: available.len(),
            });
        }

        let mut chosen: Vec<String> = Vec::with_capacity(count);
        if options.get_preferred_allocation_available {
            let request = PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_i_ds: available.clone(),
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: i32::try_from(count).unwrap_or(i32::MAX),
                }],
            };
            let response = client
                .get_preferred_allocation(request)
                .await
                .map_err(AdmissionError::Preferred)?
                .into_inner();
            // kubelet keeps only preferred ∩ available, and reads only the
            // first container response.
            for id in response
                .container_responses
                .into_iter()
                .next()
                .map(|r| r.device_i_ds)
                .unwrap_or_default()
            {
                if chosen.len() < count && available.contains(&id) && !chosen.contains(&id) {
                    chosen.push(id);
                }
            }
        }
        // kubelet fills any shortfall from what is left.
        for id in &available {
            if chosen.len() == count {
                break;
            }
            if !chosen.contains(id) {
                chosen.push(id.clone());
            }
        }

        let response = client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest {
                    devices_ids: chosen.clone(),
                }],
            })
            .await
            .map_err(AdmissionError::Allocate)?
            .into_inner();
        let response = response
            .container_responses
            .into_iter()
            .next()
            .ok_or(AdmissionError::EmptyResponse)?;
        let allocation = Allocation {
            pod: pod.to_owned(),
            container: container.to_owned(),
            resource: resource.to_owned(),
            device_ids: chosen,
            response,
            init,
        };
        self.shared.lock().allocations.push(allocation.clone());
        self.shared.write_checkpoint();
        self.shared.changed();
        Ok(allocation)
    }

    /// Lists ended pods (without devices) until the end, as kubelets before
    /// 1.34 do.
    pub fn list_ended_pods(&self) {
        self.shared.lock().lists_ended_pods = true;
    }

    /// Says that `pod`'s `container` is a regular init container (as its
    /// pod's spec would): admitted like any other and kept in the
    /// checkpoint, it is never listed by pod-resources.
    pub fn declare_init_container(&self, pod: &str, container: &str) {
        let mut state = self.shared.lock();
        state.ended.remove(pod);
        state
            .init_containers
            .insert((pod.to_owned(), container.to_owned()));
    }

    /// Ends a pod: kubelet frees its devices at the next List or
    /// allocation, and leaves the checkpoint until its next write.
    pub fn remove_pod(&self, pod: &str) {
        let mut state = self.shared.lock();
        state.ended.insert(pod.to_owned());
        state.claim_uses.retain(|(p, ..)| p != pod);
        state.init_containers.retain(|(p, _)| p != pod);
        drop(state);
        self.shared.changed();
    }

    /// Lists `pod`'s `container` in pod-resources as using a DRA claim, as
    /// kubelet does once the claim is prepared and the container runs.
    pub fn run_with_claim(&self, pod: &str, container: &str, claim: ClaimUse) {
        let mut state = self.shared.lock();
        state.ended.remove(pod);
        state
            .claim_uses
            .push((pod.to_owned(), container.to_owned(), claim));
        drop(state);
        self.shared.changed();
    }
}

impl Drop for KubeletSim {
    fn drop(&mut self) {
        self.life.cancel();
    }
}

/// kubelet's `IsExtendedResourceName`: not a native resource (no domain, or
/// a `kubernetes.io` one), not a `requests.` quota name, and `requests.` +
/// the name a qualified name (DNS-subdomain prefix, `/`, 1-63 characters of
/// `[A-Za-z0-9._-]` starting and ending alphanumeric).
fn is_extended_resource_name(name: &str) -> bool {
    let Some((prefix, local)) = name.split_once('/') else {
        return false;
    };
    if name.contains("kubernetes.io/") || name.starts_with("requests.") {
        return false;
    }
    let prefix = format!("requests.{prefix}");
    let label = |l: &str| {
        let b = l.as_bytes();
        !b.is_empty()
            && b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-'
    };
    let local_ok = {
        let b = local.as_bytes();
        !b.is_empty()
            && b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric()
    };
    prefix.len() <= 253 && prefix.split('.').all(label) && local_ok
}
