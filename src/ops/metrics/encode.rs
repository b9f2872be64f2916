//! Metrics encoded from one reading of the node: the registry built once,
//! and the collector that turns each scrape's reading into its families.

use crate::error_text::chain;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::Registry;
use tracing::debug;

use super::arena;
use crate::deviceplugin::service::Counters;
use crate::isolation::reconcile::attribution::Snapshot;
use crate::kubelet::podresources::{Holding, PodResourcesError};
use crate::node::sensors::{Readings, Sensors};
use crate::ops::observed::Observed;
use crate::ops::status::{ClaimStatus, ContainerStatus, GpuStatus, NodeStatus};
use crate::sync::LockExt;

const MIB: u64 = 1 << 20;

/// The registry, built once when the endpoint starts: the Allocate counters
/// themselves, and what each scrape reads, through `NodeCollector`.
pub(super) struct Metrics {
    registry: Registry,
    node: Arc<NodeCollector>,
    /// The series arena reads, unprefixed, where they are on.
    arena: Option<Registry>,
    /// One scrape encodes at a time, each its own reading.
    encoding: Mutex<()>,
}

impl Metrics {
    pub(super) fn new(counters: &Counters, arena_series: bool) -> Metrics {
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
        register_build(&mut registry);
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

    pub(super) fn encode(&self, reading: Reading) -> Result<String, std::fmt::Error> {
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

/// `gpumem_build_info{version, commit} 1`, which joins any series to its
/// build, in a registry prefixed `gpumem`.
pub(crate) fn register_build(registry: &mut Registry) {
    registry.register(
        "build",
        "The gpumem build: its version and the commit it was built from",
        Info::new(vec![
            ("version", crate::version::VERSION.to_owned()),
            ("commit", crate::version::COMMIT.to_owned()),
        ]),
    );
}

/// What one scrape read: the node's status and the plugin's state.
#[derive(Debug)]
pub(super) struct Reading {
    pub(super) status: NodeStatus,
    /// Per-GPU process overhead by UUID, where it is reconciled.
    pub(super) overheads: HashMap<String, u64>,
    pub(super) registrations: u64,
    /// Over-cap kills, reports and checks so far, where the action is on.
    pub(super) over_cap: Option<(u64, u64, u64)>,
    pub(super) sensors: Readings,
    /// Whose each GPU process is, where reconciled.
    pub(super) whose: Option<Snapshot>,
    pub(super) hostname: String,
}

impl Reading {
    /// Reads the node for one scrape: blocking.
    pub(super) fn read(
        observed: &Observed,
        holdings: Result<Vec<Holding>, PodResourcesError>,
    ) -> Reading {
        let overheads = observed
            .overheads
            .as_ref()
            .map(|o| o.lock_unpoisoned().clone())
            .unwrap_or_default();
        let over_cap = observed.over_cap.as_ref().map(|a| {
            (
                a.kills.load(std::sync::atomic::Ordering::Relaxed),
                a.reports.load(std::sync::atomic::Ordering::Relaxed),
                a.checks.load(std::sync::atomic::Ordering::Acquire),
            )
        });
        let sensors = match observed.sensors.as_deref().map(Sensors::read) {
            Some(Ok(readings)) => readings,
            Some(Err(err)) => {
                debug!(err = %chain(&err), "no GPU readings for this scrape");
                Readings::default()
            }
            None => Readings::default(),
        };
        let whose = observed
            .attribution
            .as_ref()
            .map(|w| w.lock_unpoisoned().clone());
        Reading {
            status: observed.build(holdings),
            overheads,
            registrations: observed.front_end.registrations(),
            over_cap,
            sensors,
            whose,
            hostname: observed.hostname.clone(),
        }
    }
}

/// Reports the latest reading: GPUs and containers come and go, and their
/// figures (refusals included) are read from files, not counted here.
#[derive(Debug, Default)]
pub(super) struct NodeCollector {
    pub(super) reading: Mutex<Option<Reading>>,
}

pub(crate) type Labels = Vec<(&'static str, String)>;

/// One metric and its samples. Help ends with a full stop, as
/// `Registry::register` ends it.
pub(crate) fn family<M: EncodeMetric + TypedMetric>(
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
pub(super) fn bytes(mib: u64) -> u64 {
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
        let e = &mut encoder;
        gpu_families(e, r)?;
        container_families(e, r)?;
        unmanaged_families(e, r)?;
        claim_families(e, r)?;
        front_end_families(e, r)
    }
}

/// Per GPU: its units, memory, sensors, health and what reconciliation found on it.
fn gpu_families(e: &mut DescriptorEncoder, r: &Reading) -> std::fmt::Result {
    let Reading {
        sensors, overheads, ..
    } = r;
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
    // Both front ends' allocations, in one unit: the device plugin's
    // containers' caps, the DRA driver's claims'.
    per_gpu(
        e,
        "gpu_allocated_bytes",
        "GPU memory of the GPU allocated: the caps of the containers (device plugin) or \
         claims (DRA driver) on it",
        r,
        |g| Some(ConstGauge::new(bytes(g.allocated_mib))),
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
    )
}

/// Per container: its cap, its use, and the allocations its cap refused.
fn container_families(e: &mut DescriptorEncoder, r: &Reading) -> std::fmt::Result {
    let Reading {
        status,
        sensors,
        whose,
        ..
    } = r;
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
    )
}

/// Per GPU and owner, what processes in no gpumem container hold and use.
fn unmanaged_families(e: &mut DescriptorEncoder, r: &Reading) -> std::fmt::Result {
    let Reading {
        status,
        sensors,
        whose,
        hostname,
        ..
    } = r;
    // What processes outside every gpumem container hold, per GPU and
    // per the pod and container their cgroup names (host processes
    // together, without those labels): who to ask about unmanaged
    // memory. Not per PID: a tenant cycling GPU processes would make a
    // series of each. The log line and the `GPUMemoryUnmanaged` Event
    // name each process.
    let mut groups: Vec<(
        &str,
        Option<&crate::isolation::identity::Owner>,
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
    )
}

/// A DRA claim's labels: the claim, then its GPU's.
fn claim_labels(c: &ClaimStatus, reading: &Reading) -> Labels {
    let mut labels: Labels = vec![
        ("namespace", c.namespace.clone()),
        ("claim", c.name.clone()),
    ];
    match reading.status.gpus.iter().find(|g| g.index == c.gpu) {
        Some(gpu) => labels.extend(gpu_labels(gpu, &reading.hostname)),
        None => labels.push(("gpu", c.gpu.to_string())),
    }
    labels
}

/// A metric per DRA claim, where its value is known.
fn per_claim<'a, M: EncodeMetric + TypedMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    reading: &'a Reading,
    value: impl Fn(&'a ClaimStatus) -> Option<M>,
) -> std::fmt::Result {
    let samples = reading
        .status
        .claims
        .iter()
        .filter_map(|c| Some((claim_labels(c, reading), value(c)?)));
    family(encoder, name, help, samples)
}

/// The DRA driver's claims (their cap, use and refusals, as the device
/// plugin's containers have them), and whether the API server kept
/// consumable capacity.
fn claim_families(e: &mut DescriptorEncoder, r: &Reading) -> std::fmt::Result {
    let Some(dra) = &r.status.dra else {
        return Ok(());
    };
    let gauge = |mib: Option<u64>| mib.map(|mib| ConstGauge::new(bytes(mib)));
    per_claim(
        e,
        "claim_cap_bytes",
        "The DRA claim's GPU memory cap, shared by the containers referencing it",
        r,
        |c| gauge(Some(c.cap_mib)),
    )?;
    per_claim(
        e,
        "claim_used_bytes",
        "GPU memory the processes of the DRA claim's containers hold",
        r,
        |c| gauge(c.used_mib),
    )?;
    per_claim(
        e,
        "claim_peak_bytes",
        "Highest GPU memory use an allocation of the DRA claim's containers reached",
        r,
        |c| gauge(c.peak_mib),
    )?;
    // Counted by the shims in the claim's accounting file since it was made.
    per_claim(
        e,
        "claim_refused_allocations",
        "Allocations refused for the DRA claim's cap (its containers wanted more than it \
         holds)",
        r,
        |c| c.refused_allocations.map(ConstCounter::new),
    )?;
    if let Some(kept) = dra.consumable_capacity {
        single(
            e,
            "dra_consumable_capacity",
            "1 if the API server kept the ResourceSlice's consumable-capacity fields; 0: \
             DRAConsumableCapacity is off and each GPU goes whole to one claim",
            ConstGauge::new(u64::from(kept)),
        )?;
    }
    Ok(())
}

/// The over-cap action's counts, registration with kubelet, and pod-resources.
fn front_end_families(e: &mut DescriptorEncoder, r: &Reading) -> std::fmt::Result {
    let Reading {
        status,
        registrations,
        over_cap,
        ..
    } = r;
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
        use crate::isolation::identity::Owner;
        use crate::isolation::reconcile::attribution::Stranger;
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
        r.whose = Some(Snapshot {
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
}
