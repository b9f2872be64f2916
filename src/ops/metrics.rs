//! The plugin's HTTP endpoint on the network: Prometheus metrics and a
//! liveness probe that fails while the plugin is not registered. The node
//! status as JSON is built here but served on the status socket alone.

use crate::error_text::chain;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinError;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error};

use crate::cluster::client::ApiHealth;
use crate::deviceplugin::plugin::PluginStatus;
use crate::deviceplugin::service::Counters;
use crate::dra::prepare::PreparedClaims;
use crate::dra::registration::Registration;
use crate::dra::slice::SliceStatus;
use crate::isolation::enforce::Actions;
use crate::isolation::inject::Isolation;
use crate::isolation::reconcile::{Attribution, Overheads, Reconciler, Unmanaged, Whose};
use crate::kubelet::podresources::{Holding, PodResources, PodResourcesError};
use crate::node::inventory::Inventory;
use crate::node::sensors::{Readings, Sensors};
use crate::ops::status::{
    ClaimShare, ClaimStatus, ContainerStatus, DraStatus, GpuStatus, NodeStatus,
};
use crate::sync::LockExt;

mod arena;

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
    /// Whose each GPU process is, where reconciled.
    pub attribution: Option<Attribution>,
    /// The GPUs' sensors, where they can be read.
    pub sensors: Option<Sensors>,
    /// The node's name (`Hostname` on every GPU's series, as dcgm-exporter
    /// labels its own, so the two join).
    pub hostname: String,
    /// Also serve the series arena reads (`--arena-metrics`, [`arena`]).
    pub arena_series: bool,
}

impl Observed {
    /// What the endpoints report on; `reconciler` where usage is reconciled.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        resource: String,
        inventory: watch::Receiver<Arc<Inventory>>,
        front_end: FrontEnd,
        counters: Arc<Counters>,
        pod_resources: PodResources,
        isolation: Arc<Isolation>,
        reconciler: Option<&Reconciler>,
        sensors: Option<Sensors>,
        hostname: String,
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
            attribution: reconciler.map(Reconciler::attribution),
            sensors,
            hostname,
            arena_series: false,
        }
    }

    /// Serves the series arena reads too (`--arena-metrics`).
    pub fn with_arena_series(mut self, on: bool) -> Self {
        self.arena_series = on;
        self
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
            let unmanaged = unmanaged.lock_unpoisoned();
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
            .map(|o| o.lock_unpoisoned().clone())
            .unwrap_or_default();
        let over_cap = self.over_cap.as_ref().map(|a| {
            (
                a.kills.load(std::sync::atomic::Ordering::Relaxed),
                a.reports.load(std::sync::atomic::Ordering::Relaxed),
                a.checks.load(std::sync::atomic::Ordering::Acquire),
            )
        });
        let sensors = match self.sensors.as_ref().map(Sensors::read) {
            Some(Ok(readings)) => readings,
            Some(Err(err)) => {
                debug!(err = %chain(&err), "no GPU readings for this scrape");
                Readings::default()
            }
            None => Readings::default(),
        };
        let whose = self
            .attribution
            .as_ref()
            .map(|w| w.lock_unpoisoned().clone());
        Reading {
            status: self.build(holdings),
            overheads,
            registrations: self.front_end.registrations(),
            over_cap,
            sensors,
            whose,
            hostname: self.hostname.clone(),
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
    let metrics = Arc::new(Metrics::new(&observed.counters, observed.arena_series));
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
        error!(err = %chain(&err), "metrics endpoint failed");
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
            error!(err = %chain(&err), "cannot read the node status");
            Err(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

/// OpenMetrics for a scraper that accepts it (Prometheus asks for it
/// first); else Prometheus' classic text format (`text/plain;
/// version=0.0.4`), which scrapers that predate OpenMetrics ask for.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CLASSIC_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn scrape(State(endpoint): State<Endpoint>, headers: HeaderMap) -> impl IntoResponse {
    let openmetrics = accepts_openmetrics(&headers);
    let holdings = endpoint.observed.pod_resources.holdings().await;
    let plain = |code| (code, [(header::CONTENT_TYPE, "text/plain")], String::new());
    // The accounting files are read, and the text encoded, off the async workers.
    let body = tokio::task::spawn_blocking(move || {
        let reading = endpoint.observed.reading(holdings);
        endpoint.metrics.encode(reading)
    })
    .await;
    match body {
        Ok(Ok(body)) if openmetrics => {
            (StatusCode::OK, [(header::CONTENT_TYPE, OPENMETRICS)], body)
        }
        Ok(Ok(body)) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, CLASSIC_TEXT)],
            classic_text(&body),
        ),
        Ok(Err(std::fmt::Error)) => plain(StatusCode::INTERNAL_SERVER_ERROR),
        Err(err) => {
            error!(err = %chain(&err), "cannot read the node for metrics");
            plain(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

/// Whether the scraper takes OpenMetrics: it sent no Accept header (curl,
/// a browser: what gpumem always answered), or one listing OpenMetrics or
/// any type (`*/*`, `application/*`) without refusing it (`q=0`). One that
/// lists only `text/plain` gets the classic format.
fn accepts_openmetrics(headers: &HeaderMap) -> bool {
    let mut accepted = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter(|media| !media.trim().is_empty())
        .peekable();
    if accepted.peek().is_none() {
        return true;
    }
    accepted.any(|media| {
        let mut parts = media.split(';').map(str::trim);
        let kind = parts.next().unwrap_or_default().to_ascii_lowercase();
        matches!(
            kind.as_str(),
            "application/openmetrics-text" | "application/*" | "*/*"
        ) && !parts.any(|p| {
            p.strip_prefix("q=")
                .and_then(|q| q.parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
        })
    })
}

/// OpenMetrics text as Prometheus' classic text format (0.0.4): the same
/// samples; a counter's and an info's metadata under their samples' names
/// (`_total`, `_info`, the latter a gauge), no `# UNIT`, no `# EOF`.
fn classic_text(openmetrics: &str) -> String {
    let kinds: HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' '))
        .collect();
    let renamed = |name: &str| match kinds.get(name).copied() {
        Some("counter") => format!("{name}_total"),
        Some("info") => format!("{name}_info"),
        _ => name.to_owned(),
    };
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some((name, kind)) = line.strip_prefix("# TYPE ").and_then(|r| r.split_once(' ')) {
            let kind = match kind {
                "info" => "gauge",
                "unknown" => "untyped",
                kind => kind,
            };
            out.push_str(&format!("# TYPE {} {kind}\n", renamed(name)));
        } else if let Some((name, help)) =
            line.strip_prefix("# HELP ").and_then(|r| r.split_once(' '))
        {
            out.push_str(&format!("# HELP {} {help}\n", renamed(name)));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The registry, built once when the endpoint starts: the Allocate counters
/// themselves, and what each scrape reads, through `NodeCollector`.
struct Metrics {
    registry: Registry,
    node: Arc<NodeCollector>,
    /// The series arena reads, unprefixed, where they are on.
    arena: Option<Registry>,
    /// One scrape encodes at a time, each its own reading.
    encoding: Mutex<()>,
}

impl Metrics {
    fn new(counters: &Counters, arena_series: bool) -> Metrics {
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
        let arena = arena_series.then(|| {
            let mut arena = Registry::default();
            arena.register_collector(Box::new(arena::ArenaCollector(node.clone())));
            arena
        });
        Metrics {
            registry,
            node,
            arena,
            encoding: Mutex::new(()),
        }
    }

    fn encode(&self, reading: Reading) -> Result<String, std::fmt::Error> {
        let _turn = self.encoding.lock_unpoisoned();
        *self.node.reading.lock_unpoisoned() = Some(reading);
        let mut body = String::new();
        let encoded = encode_registry(&mut body, &self.registry)
            .and_then(|()| match &self.arena {
                Some(arena) => encode_registry(&mut body, arena),
                None => Ok(()),
            })
            .and_then(|()| encode_eof(&mut body));
        self.node.reading.lock_unpoisoned().take();
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
    /// Over-cap kills, reports and checks so far, where the action is on.
    over_cap: Option<(u64, u64, u64)>,
    sensors: Readings,
    /// Whose each GPU process is, where reconciled.
    whose: Option<Whose>,
    hostname: String,
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

/// The labels of a GPU's series, named as dcgm-exporter names its own
/// (`gpu`, `UUID`, `modelName`, `Hostname`), so the two join on them.
fn gpu_labels(gpu: &GpuStatus, hostname: &str) -> Labels {
    vec![
        ("gpu", gpu.index.to_string()),
        ("UUID", gpu.uuid.clone()),
        ("modelName", gpu.name.clone()),
        ("Hostname", hostname.to_owned()),
    ]
}

/// A gauge per GPU.
fn per_gpu<'a, M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    reading: &'a Reading,
    value: impl Fn(&'a GpuStatus) -> Option<M>,
) -> std::fmt::Result {
    let samples = reading
        .status
        .gpus
        .iter()
        .filter_map(|g| Some((gpu_labels(g, &reading.hostname), value(g)?)));
    family(encoder, name, help, samples)
}

/// A metric per container, where its value is known.
fn per_container<'a, M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    reading: &'a Reading,
    value: impl Fn(&'a ContainerStatus) -> Option<M>,
) -> std::fmt::Result {
    let samples = reading
        .status
        .containers
        .iter()
        .filter_map(|c| Some((container_labels(c, reading), value(c)?)));
    family(encoder, name, help, samples)
}

/// Who holds the container, or where no one knows (pod-resources
/// unreadable), its accounting directory: two such containers on one GPU
/// must not share a series. Then its GPU's labels.
fn container_labels(c: &ContainerStatus, reading: &Reading) -> Labels {
    let mut labels = Vec::with_capacity(7);
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
    match reading.status.gpus.iter().find(|g| g.index == c.gpu) {
        Some(gpu) => labels.extend(gpu_labels(gpu, &reading.hostname)),
        None => labels.push(("gpu", c.gpu.to_string())),
    }
    labels
}

/// The SMs a set of processes on GPU `uuid` keeps busy, as a ratio of the
/// GPU's (NVML samples each process in percent of the whole GPU).
fn sm_ratio(sensors: &Readings, uuid: &str, pids: &[u32]) -> f64 {
    let per_pid = sensors.process_sm.get(uuid);
    let percent: u32 = pids
        .iter()
        .filter_map(|pid| per_pid?.get(pid))
        .fold(0, |a, &b| a.saturating_add(b));
    f64::from(percent.min(100)) / 100.0
}

/// GPU memory in bytes, from MiB.
fn bytes(mib: u64) -> u64 {
    mib.saturating_mul(MIB)
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
        let reading = self.reading.lock_unpoisoned();
        let Some(r) = reading.as_ref() else {
            return Ok(());
        };
        let Reading {
            status,
            overheads,
            registrations,
            over_cap,
            sensors,
            whose,
            hostname,
        } = r;
        let e = &mut encoder;
        let sensor = |g: &GpuStatus| sensors.gpus.get(&g.uuid);
        per_gpu(e, "gpu_units", "Units the GPU is advertised as", r, |g| {
            Some(ConstGauge::new(u64::from(g.units)))
        })?;
        per_gpu(
            e,
            "gpu_allocated_units",
            "Units of the GPU held by containers",
            r,
            |g| Some(ConstGauge::new(u64::from(g.allocated_units))),
        )?;
        per_gpu(
            e,
            "gpu_memory_total_bytes",
            "GPU memory as NVML reports it",
            r,
            |g| Some(ConstGauge::new(bytes(g.memory_mib))),
        )?;
        per_gpu(
            e,
            "gpu_memory_used_bytes",
            "GPU memory allocated on the GPU by anyone (NVML's used: every process, \
             gpumem's or not, and the driver's own reserve)",
            r,
            |g| Some(ConstGauge::new(sensor(g)?.memory_used_bytes?)),
        )?;
        per_gpu(
            e,
            "gpu_utilization_ratio",
            "Share of NVML's last sample period (1/6 s to 1 s) in which a kernel ran on the GPU",
            r,
            |g| {
                let percent = sensor(g)?.utilization_percent?;
                Some(ConstGauge::new(f64::from(percent) / 100.0))
            },
        )?;
        per_gpu(
            e,
            "gpu_temperature_celsius",
            "The GPU's core temperature",
            r,
            |g| Some(ConstGauge::new(u64::from(sensor(g)?.temperature_celsius?))),
        )?;
        per_gpu(
            e,
            "gpu_power_watts",
            "The GPU's power draw (the board's, where NVML reports it)",
            r,
            |g| {
                let milliwatts = sensor(g)?.power_milliwatts?;
                Some(ConstGauge::new(f64::from(milliwatts) / 1000.0))
            },
        )?;
        per_gpu(
            e,
            "gpu_healthy",
            "1 if the GPU's units are Healthy",
            r,
            |g| Some(ConstGauge::new(u64::from(g.healthy))),
        )?;
        per_gpu(
            e,
            "gpu_process_overhead_bytes",
            "Median GPU memory a recent process held beyond what the shim charged it (modules \
             loaded lazily, library workspaces, pool reserves): what reconciliation catches",
            r,
            |g| overheads.get(&g.uuid).copied().map(ConstGauge::new),
        )?;
        per_gpu(
            e,
            "gpu_unmanaged_bytes",
            "GPU memory held by processes in no gpumem container (host daemons, pods that \
             reached the GPU without asking for it), where reconciled",
            r,
            |g| g.unmanaged_mib.map(|mib| ConstGauge::new(bytes(mib))),
        )?;

        let gauge = |mib: Option<u64>| mib.map(|mib| ConstGauge::new(bytes(mib)));
        per_container(
            e,
            "container_cap_bytes",
            "The container's GPU memory cap",
            r,
            |c| gauge(Some(c.cap_mib)),
        )?;
        per_container(
            e,
            "container_used_bytes",
            "GPU memory the container's processes hold",
            r,
            |c| gauge(c.used_mib),
        )?;
        per_container(
            e,
            "container_untracked_bytes",
            "Part of container_used_bytes held beyond charged allocations (CUDA contexts, \
             libraries)",
            r,
            |c| gauge(c.untracked_mib),
        )?;
        per_container(
            e,
            "container_peak_bytes",
            "Highest GPU memory use an allocation of the container reached",
            r,
            |c| gauge(c.peak_mib),
        )?;
        // From NVML's per-process samples of the processes attributed to
        // the container from outside (shim or not): where reconciled.
        per_container(
            e,
            "container_sm_utilization_ratio",
            "Share of the GPU's SMs the container's processes kept busy over NVML's last \
             sample period",
            r,
            |c| {
                let whose = whose.as_ref()?;
                let uuid = &status.gpus.iter().find(|g| g.index == c.gpu)?.uuid;
                let pids = whose
                    .containers
                    .get(c.accounting_dir.as_ref()?)
                    .and_then(|per_gpu| per_gpu.get(uuid))
                    .map_or(&[][..], Vec::as_slice);
                Some(ConstGauge::new(sm_ratio(sensors, uuid, pids)))
            },
        )?;
        // Counted by the shims in the accounting file since it was made.
        per_container(
            e,
            "container_refused_allocations",
            "Allocations refused for the container's cap (it wanted more than its slice)",
            r,
            |c| c.refused_allocations.map(ConstCounter::new),
        )?;

        // What processes outside every gpumem container hold, per GPU and
        // per the pod and container their cgroup names (host processes
        // together, without those labels): who to ask about unmanaged
        // memory. Not per PID: a tenant cycling GPU processes would make a
        // series of each. The log line and the `GPUMemoryUnmanaged` Event
        // name each process.
        let mut groups: Vec<(
            &str,
            Option<&crate::isolation::attribution::Owner>,
            u64,
            Vec<u32>,
        )> = Vec::new();
        for s in whose.iter().flat_map(|w| &w.strangers) {
            let key = (s.gpu_uuid.as_str(), s.owner.as_ref());
            match groups.iter_mut().find(|g| (g.0, g.1) == key) {
                Some(group) => {
                    group.2 = group.2.saturating_add(s.bytes);
                    group.3.push(s.pid);
                }
                None => groups.push((key.0, key.1, s.bytes, vec![s.pid])),
            }
        }
        let strangers: Vec<_> = groups
            .into_iter()
            .filter_map(|(uuid, owner, bytes, pids)| {
                let gpu = status.gpus.iter().find(|g| g.uuid == uuid)?;
                let mut labels = gpu_labels(gpu, hostname);
                if let Some(owner) = owner {
                    labels.push(("pod_uid", owner.pod_uid.clone()));
                    if let Some(id) = &owner.container_id {
                        labels.push(("container_id", id.clone()));
                    }
                }
                Some((labels, uuid, bytes, pids))
            })
            .collect();
        family(
            e,
            "unmanaged_process_memory_bytes",
            "GPU memory processes in no gpumem container hold, per pod and container their \
             cgroup names",
            strangers
                .iter()
                .map(|(labels, _, bytes, _)| (labels.clone(), ConstGauge::new(*bytes))),
        )?;
        family(
            e,
            "unmanaged_process_sm_utilization_ratio",
            "Share of the GPU's SMs processes in no gpumem container kept busy over NVML's \
             last sample period, per pod and container their cgroup names",
            strangers.iter().map(|(labels, uuid, _, pids)| {
                let ratio = sm_ratio(sensors, uuid, pids);
                (labels.clone(), ConstGauge::new(ratio))
            }),
        )?;

        let claims = &status.claims;
        let per_claim = |e: &mut DescriptorEncoder,
                         name: &str,
                         help: &str,
                         value: &dyn Fn(&ClaimStatus) -> Option<u64>|
         -> std::fmt::Result {
            let samples = claims.iter().filter_map(|c| {
                let mut labels: Labels = vec![
                    ("namespace", c.namespace.clone()),
                    ("claim", c.name.clone()),
                ];
                match status.gpus.iter().find(|g| g.index == c.gpu) {
                    Some(gpu) => labels.extend(gpu_labels(gpu, hostname)),
                    None => labels.push(("gpu", c.gpu.to_string())),
                }
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

        if let Some((kills, reports, checks)) = over_cap {
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
            single(
                e,
                "over_cap_checks",
                "Reconcile samples the over-cap action has checked: once it has moved on, what \
                 a sample showed has been acted on or found within the cap",
                ConstCounter::new(*checks),
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

    #[test]
    fn only_a_scraper_that_lists_only_text_plain_gets_the_classic_format() {
        let accept = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for v in values {
                headers.append(header::ACCEPT, v.parse().unwrap());
            }
            accepts_openmetrics(&headers)
        };
        assert!(accept(&[]));
        assert!(accept(&["*/*"]));
        assert!(accept(&[
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        ]));
        assert!(!accept(&["text/plain;version=0.0.4"]));
        assert!(!accept(&["text/plain", "application/openmetrics-text;q=0"]));
    }

    #[test]
    fn the_classic_format_names_counters_and_infos_by_their_samples() {
        let openmetrics = "# HELP gpumem_kills Kills.\n# TYPE gpumem_kills counter\n\
                           gpumem_kills_total 3\n# HELP gpumem_build The build.\n\
                           # TYPE gpumem_build info\ngpumem_build_info{version=\"0.1.0\"} 1\n\
                           # HELP gpumem_up Up.\n# TYPE gpumem_up gauge\n# UNIT gpumem_up x\n\
                           gpumem_up 1\n# EOF\n";
        assert_eq!(
            classic_text(openmetrics),
            "# HELP gpumem_kills_total Kills.\n# TYPE gpumem_kills_total counter\n\
             gpumem_kills_total 3\n# HELP gpumem_build_info The build.\n\
             # TYPE gpumem_build_info gauge\ngpumem_build_info{version=\"0.1.0\"} 1\n\
             # HELP gpumem_up Up.\n# TYPE gpumem_up gauge\ngpumem_up 1\n"
        );
    }

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
            status: crate::ops::status::tests::node_status(containers),
            overheads: HashMap::new(),
            over_cap: None,
            registrations: 2,
            sensors: Readings::default(),
            whose: None,
            hostname: "node-1".into(),
        }
    }

    const T4: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";

    #[test]
    fn gpus_and_their_processes_carry_dcgm_exporters_labels() {
        use crate::isolation::attribution::Owner;
        use crate::isolation::reconcile::Stranger;
        use crate::node::sensors::GpuReading;

        let mut r = reading(vec![container(Some("nb"), "a-4u-1", 0)]);
        r.status.gpus = vec![GpuStatus {
            index: 0,
            name: "Tesla T4".into(),
            uuid: T4.into(),
            healthy: true,
            memory_mib: 15079,
            units: 14,
            allocated_units: 4,
            allocated_mib: 4308,
            unmanaged_mib: Some(200),
        }];
        r.sensors.gpus.insert(
            T4.into(),
            GpuReading {
                memory_used_bytes: Some(1500 * MIB),
                utilization_percent: Some(87),
                temperature_celsius: Some(64),
                power_milliwatts: Some(61_250),
            },
        );
        // Two processes of the container (one without the shim), two
        // strangers in a container of another pod, and a host process.
        r.sensors.process_sm =
            [(T4.into(), [(10, 30), (11, 25), (12, 20), (13, 10)].into())].into();
        let stranger = |pid, mib, owner: Option<Owner>| Stranger {
            gpu_uuid: T4.into(),
            pid,
            bytes: mib * MIB,
            owner,
        };
        let pod = Owner {
            pod_uid: "0a1b".into(),
            container_id: Some("c0ffee".into()),
        };
        r.whose = Some(Whose {
            containers: [("a-4u-1".into(), [(T4.into(), vec![10, 11])].into())].into(),
            strangers: vec![
                stranger(12, 200, Some(pod.clone())),
                stranger(13, 100, Some(pod)),
                stranger(14, 50, None),
            ],
        });
        let text = Metrics::new(&Counters::default(), false).encode(r).unwrap();
        let gpu = format!("gpu=\"0\",UUID=\"{T4}\",modelName=\"Tesla T4\",Hostname=\"node-1\"");
        let pod = "namespace=\"default\",pod=\"nb\",container=\"main\"";
        for expected in [
            format!("gpumem_gpu_memory_total_bytes{{{gpu}}} 15811477504"),
            format!("gpumem_gpu_memory_used_bytes{{{gpu}}} 1572864000"),
            format!("gpumem_gpu_utilization_ratio{{{gpu}}} 0.87"),
            format!("gpumem_gpu_temperature_celsius{{{gpu}}} 64"),
            format!("gpumem_gpu_power_watts{{{gpu}}} 61.25"),
            format!("gpumem_gpu_unmanaged_bytes{{{gpu}}} 209715200"),
            format!("gpumem_container_used_bytes{{{pod},{gpu}}} 1363148800"),
            format!("gpumem_container_sm_utilization_ratio{{{pod},{gpu}}} 0.55"),
            // Per pod and container, not per process: no PID.
            format!(
                "gpumem_unmanaged_process_memory_bytes{{{gpu},pod_uid=\"0a1b\",\
                 container_id=\"c0ffee\"}} 314572800"
            ),
            format!(
                "gpumem_unmanaged_process_sm_utilization_ratio{{{gpu},\
                 pod_uid=\"0a1b\",container_id=\"c0ffee\"}} 0.3"
            ),
            format!("gpumem_unmanaged_process_memory_bytes{{{gpu}}} 52428800"),
        ] {
            assert!(text.contains(&expected), "missing {expected}:\n{text}");
        }
        assert!(!text.contains("pid="), "{text}");
        assert!(!text.contains("_mib"), "{text}");
    }

    #[test]
    fn one_registry_reports_each_scrapes_reading() {
        let counters = Counters::default();
        let metrics = Metrics::new(&counters, false);
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
