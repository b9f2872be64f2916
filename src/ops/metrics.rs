//! The plugin's HTTP endpoint on the network: Prometheus metrics and a
//! liveness probe that fails while the plugin is not registered. The node
//! status as JSON is built here but served on the status socket alone.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinError;
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::cluster::client::ApiHealth;
use crate::deviceplugin::plugin::PluginStatus;
use crate::deviceplugin::service::Counters;
use crate::dra::prepare::PreparedClaims;
use crate::dra::registration::Registration;
use crate::dra::slice::SliceStatus;
use crate::isolation::enforce::Actions;
use crate::isolation::inject::Isolation;
use crate::isolation::reconcile::{Overheads, Reconciler, Unmanaged};
use crate::kubelet::podresources::{Holding, PodResources, PodResourcesError};
use crate::node::inventory::Inventory;
use crate::ops::status::{
    ClaimShare, ClaimStatus, ContainerStatus, DraStatus, GpuStatus, NodeStatus,
};

const MIB: u64 = 1 << 20;

/// The front end kubelet talks to, and what it knows.
#[derive(Clone)]
pub enum FrontEnd {
    DevicePlugin(watch::Receiver<PluginStatus>),
    Dra {
        registration: watch::Receiver<Registration>,
        slice: watch::Receiver<SliceStatus>,
        claims: PreparedClaims,
    },
}

impl FrontEnd {
    /// Registered with the running kubelet.
    pub fn registered(&self) -> bool {
        match self {
            FrontEnd::DevicePlugin(plugin) => plugin.borrow().registered,
            FrontEnd::Dra { registration, .. } => {
                matches!(*registration.borrow(), Registration::Registered)
            }
        }
    }

    /// Registrations with kubelet so far (the device plugin re-registers
    /// at every kubelet restart; the DRA driver is registered by kubelet).
    fn registrations(&self) -> u64 {
        match self {
            FrontEnd::DevicePlugin(plugin) => plugin.borrow().registrations,
            FrontEnd::Dra { .. } => u64::from(self.registered()),
        }
    }
}

/// Everything the endpoints report on.
#[derive(Clone)]
pub struct Observed {
    pub resource: String,
    pub inventory: watch::Receiver<Arc<Inventory>>,
    pub front_end: FrontEnd,
    pub counters: Arc<Counters>,
    pub pod_resources: PodResources,
    pub isolation: Arc<Isolation>,
    /// Per-GPU process overhead, where untracked usage is reconciled.
    pub overheads: Option<Overheads>,
    /// Per-GPU memory outside every gpumem container, where reconciled.
    pub unmanaged: Option<Unmanaged>,
    /// Over-cap actions taken, where the action is on.
    pub over_cap: Option<Arc<Actions>>,
    /// Whether the API server answers, where gpumem uses one.
    pub api: Option<ApiHealth>,
}

impl Observed {
    /// What the endpoints report on; `reconciler` where usage is reconciled.
    pub fn new(
        resource: String,
        inventory: watch::Receiver<Arc<Inventory>>,
        front_end: FrontEnd,
        counters: Arc<Counters>,
        pod_resources: PodResources,
        isolation: Arc<Isolation>,
        reconciler: Option<&Reconciler>,
    ) -> Self {
        Observed {
            resource,
            inventory,
            front_end,
            counters,
            pod_resources,
            isolation,
            overheads: reconciler.map(Reconciler::overheads),
            unmanaged: reconciler.map(Reconciler::unmanaged),
            over_cap: reconciler.and_then(Reconciler::actions),
            api: None,
        }
    }

    /// Reports the API server's reachability too.
    pub fn with_api(mut self, api: ApiHealth) -> Self {
        self.api = Some(api);
        self
    }

    /// Asks pod-resources, then reads the accounting files off the async
    /// workers.
    pub async fn status(&self) -> Result<NodeStatus, JoinError> {
        let holdings = self.pod_resources.holdings().await;
        let observed = self.clone();
        tokio::task::spawn_blocking(move || observed.build(holdings)).await
    }

    /// Reads the accounting files: blocking.
    fn build(&self, holdings: Result<Vec<Holding>, PodResourcesError>) -> NodeStatus {
        let inventory = self.inventory.borrow().clone();
        let claim_holders = holdings.as_ref().ok().cloned().unwrap_or_default();
        let mut status = NodeStatus::build(
            &inventory,
            &self.resource,
            self.front_end.registered(),
            holdings,
            &self.isolation,
        );
        status.api_server_error = self.api.as_ref().and_then(ApiHealth::unreachable);
        if let FrontEnd::Dra {
            registration,
            slice,
            claims,
        } = &self.front_end
        {
            let shares = claims
                .shares()
                .into_iter()
                .map(|s| ClaimShare {
                    namespace: s.claim.namespace,
                    name: s.claim.name,
                    uid: s.claim.uid,
                    gpu_uuid: s.gpu_uuid,
                    cap_mib: s.cap_mib,
                    dir: s.dir,
                })
                .collect();
            status.add_claims(&inventory, shares, &claim_holders, &self.isolation);
            let slice = slice.borrow().clone();
            status.dra = Some(DraStatus {
                driver: self.resource.clone(),
                registration: match &*registration.borrow() {
                    Registration::Waiting => "waiting for kubelet".to_owned(),
                    Registration::Registered => "registered with kubelet".to_owned(),
                    Registration::Refused(reason) => format!("REFUSED by kubelet: {reason}"),
                },
                slice: Some(slice.name).filter(|n| !n.is_empty() && slice.generation > 0),
                slice_devices: slice.devices,
                consumable_capacity: slice.consumable_capacity,
                slice_error: slice.last_error,
            });
        }
        if let Some(unmanaged) = &self.unmanaged {
            let unmanaged = unmanaged.lock().unwrap_or_else(|e| e.into_inner());
            for gpu in &mut status.gpus {
                gpu.unmanaged_mib = Some(unmanaged.get(&gpu.uuid).map_or(0, |b| b / MIB));
            }
        }
        status
    }

    /// Reads the node for one scrape: blocking.
    fn reading(&self, holdings: Result<Vec<Holding>, PodResourcesError>) -> Reading {
        let overheads = self
            .overheads
            .as_ref()
            .map(|o| o.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .unwrap_or_default();
        let over_cap = self.over_cap.as_ref().map(|a| {
            (
                a.kills.load(std::sync::atomic::Ordering::Relaxed),
                a.reports.load(std::sync::atomic::Ordering::Relaxed),
            )
        });
        Reading {
            status: self.build(holdings),
            overheads,
            registrations: self.front_end.registrations(),
            over_cap,
        }
    }
}

/// The endpoints' state: what they report on, and the metrics registry.
#[derive(Clone)]
struct Endpoint {
    observed: Observed,
    metrics: Arc<Metrics>,
}

#[derive(Debug, thiserror::Error)]
#[error("invalid --metrics-addr {0:?}: expected HOST:PORT or :PORT, or empty to turn it off")]
pub struct BadAddress(pub String);

/// Parses `--metrics-addr`: `:9400` listens on every interface; empty is off.
pub fn parse_address(text: &str) -> Result<Option<SocketAddr>, BadAddress> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let full = match text.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => text.to_owned(),
    };
    full.parse()
        .map(Some)
        .map_err(|_| BadAddress(text.to_owned()))
}

pub fn router(observed: Observed) -> Router {
    let metrics = Arc::new(Metrics::new(&observed.counters));
    Router::new()
        .route("/metrics", get(scrape))
        .route("/healthz", get(healthz))
        .with_state(Endpoint { observed, metrics })
}

/// Serves the endpoints until `shutdown`, logging a failure.
pub async fn serve_logged(
    listener: tokio::net::TcpListener,
    observed: Observed,
    shutdown: CancellationToken,
) {
    if let Err(err) = serve(listener, observed, shutdown).await {
        error!(%err, "metrics endpoint failed");
    }
}

/// Serves the endpoints on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    observed: Observed,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(observed))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// Live while registered with kubelet. An API server that cannot be
/// reached is said, but does not fail the probe: a restart would not bring
/// it back, and kubelet would restart every node's gpumem at once.
async fn healthz(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    let (code, mut text) = if endpoint.observed.front_end.registered() {
        (StatusCode::OK, "ok\n".to_owned())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not registered with kubelet\n".to_owned(),
        )
    };
    if let Some(why) = endpoint
        .observed
        .api
        .as_ref()
        .and_then(ApiHealth::unreachable)
    {
        text.push_str(&why);
        text.push('\n');
    }
    (code, text)
}

/// `/status`: who holds what, with their pods' names, for the status
/// socket (`ops::status_socket`), never the network port.
pub(crate) async fn status(
    State(observed): State<Observed>,
) -> Result<Json<NodeStatus>, StatusCode> {
    match observed.status().await {
        Ok(status) => Ok(Json(status)),
        Err(err) => {
            error!(%err, "cannot read the node status");
            Err(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

async fn scrape(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    let holdings = endpoint.observed.pod_resources.holdings().await;
    let plain = |code| (code, [(header::CONTENT_TYPE, "text/plain")], String::new());
    // The accounting files are read, and the text encoded, off the async workers.
    let body = tokio::task::spawn_blocking(move || {
        let reading = endpoint.observed.reading(holdings);
        endpoint.metrics.encode(reading)
    })
    .await;
    match body {
        Ok(Ok(body)) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        ),
        Ok(Err(std::fmt::Error)) => plain(StatusCode::INTERNAL_SERVER_ERROR),
        Err(err) => {
            error!(%err, "cannot read the node for metrics");
            plain(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

/// The registry, built once when the endpoint starts: the Allocate counters
/// themselves, and what each scrape reads, through `NodeCollector`.
struct Metrics {
    registry: Registry,
    node: Arc<NodeCollector>,
    /// One scrape encodes at a time, each its own reading.
    encoding: Mutex<()>,
}

impl Metrics {
    fn new(counters: &Counters) -> Metrics {
        let mut registry = Registry::with_prefix("gpumem");
        registry.register(
            "allocate_calls",
            "Allocate calls from kubelet",
            counters.allocations.clone(),
        );
        registry.register(
            "allocate_errors",
            "Allocate calls refused",
            counters.allocation_errors.clone(),
        );
        // gpumem_build_info{version, commit} 1: joins any series to its build.
        registry.register(
            "build",
            "The gpumem build: its version and the commit it was built from",
            Info::new(vec![
                ("version", crate::version::VERSION.to_owned()),
                ("commit", crate::version::COMMIT.to_owned()),
            ]),
        );
        let node = Arc::new(NodeCollector::default());
        registry.register_collector(Box::new(node.clone()));
        Metrics {
            registry,
            node,
            encoding: Mutex::new(()),
        }
    }

    fn encode(&self, reading: Reading) -> Result<String, std::fmt::Error> {
        let _turn = self.encoding.lock().unwrap_or_else(|e| e.into_inner());
        *self.node.reading.lock().unwrap_or_else(|e| e.into_inner()) = Some(reading);
        let mut body = String::new();
        let encoded = encode(&mut body, &self.registry);
        self.node
            .reading
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        encoded.map(|()| body)
    }
}

/// What one scrape read: the node's status and the plugin's state.
#[derive(Debug)]
struct Reading {
    status: NodeStatus,
    /// Per-GPU process overhead by UUID, where it is reconciled.
    overheads: HashMap<String, u64>,
    registrations: u64,
    /// Over-cap kills and reports so far, where the action is on.
    over_cap: Option<(u64, u64)>,
}

/// Reports the latest reading: GPUs and containers come and go, and their
/// figures (refusals included) are read from files, not counted here.
#[derive(Debug, Default)]
struct NodeCollector {
    reading: Mutex<Option<Reading>>,
}

type Labels = Vec<(&'static str, String)>;

/// One metric and its samples. Help ends with a full stop, as
/// `Registry::register` ends it.
fn family<M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Labels, M)>,
) -> std::fmt::Result {
    let help = format!("{help}.");
    let mut metric = encoder.encode_descriptor(name, &help, None, M::TYPE)?;
    for (labels, value) in samples {
        value.encode(metric.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A gauge per GPU.
fn per_gpu<'a>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    gpus: &'a [GpuStatus],
    value: impl Fn(&'a GpuStatus) -> Option<u64>,
) -> std::fmt::Result {
    let samples = gpus.iter().filter_map(|g| {
        let labels = vec![("gpu", g.index.to_string()), ("uuid", g.uuid.clone())];
        Some((labels, ConstGauge::new(value(g)?)))
    });
    family(encoder, name, help, samples)
}

/// A metric per container, where its value is known.
fn per_container<'a, M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    containers: &'a [ContainerStatus],
    value: impl Fn(&'a ContainerStatus) -> Option<M>,
) -> std::fmt::Result {
    let samples = containers
        .iter()
        .filter_map(|c| Some((container_labels(c), value(c)?)));
    family(encoder, name, help, samples)
}

/// Who holds the container, or where no one knows (pod-resources
/// unreadable), its accounting directory: two such containers on one GPU
/// must not share a series.
fn container_labels(c: &ContainerStatus) -> Labels {
    let mut labels = Vec::with_capacity(4);
    match (&c.namespace, &c.pod, &c.container) {
        (Some(namespace), Some(pod), Some(container)) => labels.extend([
            ("namespace", namespace.clone()),
            ("pod", pod.clone()),
            ("container", container.clone()),
        ]),
        _ => labels.extend(
            c.accounting_dir
                .iter()
                .map(|dir| ("accounting_dir", dir.clone())),
        ),
    }
    labels.push(("gpu", c.gpu.to_string()));
    labels
}

/// One metric without labels.
fn single<M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: M,
) -> std::fmt::Result {
    let help = format!("{help}.");
    value.encode(encoder.encode_descriptor(name, &help, None, M::TYPE)?)
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let reading = self.reading.lock().unwrap_or_else(|e| e.into_inner());
        let Some(Reading {
            status,
            overheads,
            registrations,
            over_cap,
        }) = reading.as_ref()
        else {
            return Ok(());
        };
        let e = &mut encoder;
        let gpus = &status.gpus;
        per_gpu(
            e,
            "gpu_units",
            "Units the GPU is advertised as",
            gpus,
            |g| Some(g.units.into()),
        )?;
        per_gpu(
            e,
            "gpu_allocated_units",
            "Units of the GPU held by containers",
            gpus,
            |g| Some(g.allocated_units.into()),
        )?;
        per_gpu(
            e,
            "gpu_memory_mib",
            "GPU memory as NVML reports it, MiB",
            gpus,
            |g| Some(g.memory_mib),
        )?;
        per_gpu(
            e,
            "gpu_healthy",
            "1 if the GPU's units are Healthy",
            gpus,
            |g| Some(g.healthy.into()),
        )?;
        per_gpu(
            e,
            "gpu_process_overhead_bytes",
            "Median GPU memory a recent process held beyond what the shim charged it (modules \
             loaded lazily, library workspaces, pool reserves): what reconciliation catches",
            gpus,
            |g| overheads.get(&g.uuid).copied(),
        )?;
        per_gpu(
            e,
            "gpu_unmanaged_bytes",
            "GPU memory held by processes in no gpumem container (host daemons, pods that \
             reached the GPU without asking for it), where reconciled",
            gpus,
            |g| g.unmanaged_mib.map(|mib| mib.saturating_mul(MIB)),
        )?;

        let containers = &status.containers;
        let bytes = |mib: Option<u64>| mib.map(|mib| ConstGauge::new(mib.saturating_mul(MIB)));
        per_container(
            e,
            "container_cap_bytes",
            "The container's GPU memory cap",
            containers,
            |c| bytes(Some(c.cap_mib)),
        )?;
        per_container(
            e,
            "container_used_bytes",
            "GPU memory the container's processes hold",
            containers,
            |c| bytes(c.used_mib),
        )?;
        per_container(
            e,
            "container_untracked_bytes",
            "Part of container_used_bytes held beyond charged allocations (CUDA contexts, \
             libraries)",
            containers,
            |c| bytes(c.untracked_mib),
        )?;
        per_container(
            e,
            "container_peak_bytes",
            "Highest GPU memory use an allocation of the container reached",
            containers,
            |c| bytes(c.peak_mib),
        )?;
        // Counted by the shims in the accounting file since it was made.
        per_container(
            e,
            "container_refused_allocations",
            "Allocations refused for the container's cap (it wanted more than its slice)",
            containers,
            |c| c.refused_allocations.map(ConstCounter::new),
        )?;

        let claims = &status.claims;
        let per_claim = |e: &mut DescriptorEncoder,
                         name: &str,
                         help: &str,
                         value: &dyn Fn(&ClaimStatus) -> Option<u64>|
         -> std::fmt::Result {
            let samples = claims.iter().filter_map(|c| {
                let labels: Labels = vec![
                    ("namespace", c.namespace.clone()),
                    ("claim", c.name.clone()),
                    ("gpu", c.gpu.to_string()),
                ];
                Some((labels, ConstGauge::new(value(c)?.saturating_mul(MIB))))
            });
            family(e, name, help, samples)
        };
        if status.dra.is_some() {
            per_claim(
                e,
                "claim_cap_bytes",
                "The DRA claim's GPU memory cap, shared by the containers referencing it",
                &|c| Some(c.cap_mib),
            )?;
            per_claim(
                e,
                "claim_used_bytes",
                "GPU memory the processes of the DRA claim's containers hold",
                &|c| c.used_mib,
            )?;
        }
        if let Some(dra) = &status.dra {
            if let Some(kept) = dra.consumable_capacity {
                single(
                    e,
                    "dra_consumable_capacity",
                    "1 if the API server kept the ResourceSlice's consumable-capacity fields; 0: \
                     DRAConsumableCapacity is off and each GPU goes whole to one claim",
                    ConstGauge::new(u64::from(kept)),
                )?;
            }
        }

        if let Some((kills, reports)) = over_cap {
            single(
                e,
                "over_cap_kills",
                "GPU processes killed because their container was over its cap (as NVML \
                 counts it) for the grace period in total within the window",
                ConstCounter::new(*kills),
            )?;
            single(
                e,
                "over_cap_reports",
                "Times a container was over its cap for the grace period in total within the \
                 window with --over-cap-action report",
                ConstCounter::new(*reports),
            )?;
        }
        single(
            e,
            "registrations",
            "Successful Register calls (one per kubelet start)",
            ConstCounter::new(*registrations),
        )?;
        single(
            e,
            "registered",
            "1 while registered with the running kubelet",
            ConstGauge::new(u64::from(status.registered)),
        )?;
        single(
            e,
            "pod_resources_up",
            "1 if kubelet's pod-resources API answered",
            ConstGauge::new(u64::from(status.pod_resources_error.is_none())),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn container(pod: Option<&str>, dir: &str, refused: u64) -> ContainerStatus {
        ContainerStatus {
            namespace: pod.map(|_| "default".into()),
            pod: pod.map(Into::into),
            container: pod.map(|_| "main".into()),
            gpu: 0,
            units: 4,
            cap_mib: 4308,
            accounting_dir: Some(dir.into()),
            used_mib: Some(1300),
            untracked_mib: Some(0),
            peak_mib: Some(1300),
            refused_allocations: Some(refused),
        }
    }

    fn reading(containers: Vec<ContainerStatus>) -> Reading {
        Reading {
            status: NodeStatus {
                version: "0.1.0".into(),
                commit: "1a2b3c4d5e6f".into(),
                resource: "aliyun.com/gpu-mem".into(),
                unit: "GiB".into(),
                registered: true,
                gpus: vec![],
                containers,
                pod_resources_error: None,
                claims: vec![],
                dra: None,
                api_server_error: None,
            },
            overheads: HashMap::new(),
            over_cap: None,
            registrations: 2,
        }
    }

    #[test]
    fn one_registry_reports_each_scrapes_reading() {
        let counters = Counters::default();
        let metrics = Metrics::new(&counters);
        counters.allocations.inc();
        let first = metrics
            .encode(reading(vec![
                container(Some("nb"), "a-4u-1", 3),
                // Pods unknown: told apart by their directories.
                container(None, "a-4u-2", 0),
                container(None, "a-4u-3", 1),
            ]))
            .unwrap();
        for expected in [
            "# TYPE gpumem_container_refused_allocations counter",
            "gpumem_container_refused_allocations_total{namespace=\"default\",pod=\"nb\",container=\"main\",gpu=\"0\"} 3",
            "gpumem_container_refused_allocations_total{accounting_dir=\"a-4u-3\",gpu=\"0\"} 1",
            "gpumem_container_cap_bytes{accounting_dir=\"a-4u-2\",gpu=\"0\"} 4517265408",
            "# TYPE gpumem_container_used_bytes gauge",
            "gpumem_allocate_calls_total 1",
            "gpumem_registrations_total 2",
            "gpumem_registered 1",
            "# TYPE gpumem_build info",
            &format!(
                "gpumem_build_info{{version=\"{}\",commit=\"{}\"}} 1",
                crate::version::VERSION,
                crate::version::COMMIT
            ),
        ] {
            assert!(first.contains(expected), "missing {expected}:\n{first}");
        }
        // The next scrape: a container gone, an Allocate later.
        counters.allocations.inc();
        let second = metrics.encode(reading(vec![])).unwrap();
        assert!(second.contains("gpumem_allocate_calls_total 2"), "{second}");
        assert!(!second.contains("a-4u-"), "{second}");
        assert_eq!(second.matches("# EOF").count(), 1, "{second}");
    }

    #[test]
    fn addresses() {
        assert_eq!(parse_address("").unwrap(), None);
        assert_eq!(
            parse_address(":9400").unwrap(),
            Some("0.0.0.0:9400".parse().unwrap())
        );
        assert_eq!(
            parse_address("127.0.0.1:0").unwrap(),
            Some("127.0.0.1:0".parse().unwrap())
        );
        assert!(parse_address("localhost")
            .unwrap_err()
            .to_string()
            .contains("--metrics-addr"));
    }
}
