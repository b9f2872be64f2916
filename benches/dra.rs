//! DRA driver benchmarks (not tests): `cargo bench --bench dra`.
//!
//! `gpumem dra`'s daemon in process (`daemon::run_dra`, shim isolation with a
//! fake installed shim, an 8 × H100 node), an in-process API server, and a
//! fake kubelet calling NodePrepareResources over the unix socket: start to
//! ResourceSlice published; Prepare of one new claim (with 0 and 100 claims
//! already prepared), of 16 in one request and of 16 concurrent requests; a
//! repeated Prepare. Then the parts alone: the API read, and the driver's
//! file work (checkpoint, accounting file, CDI spec) replayed step by step on
//! the same file system. Results go to docs/BENCHMARKS.md.
//!
//! The state dir (checkpoint, accounting files) lives under the system temp
//! dir, or `GPUMEM_BENCH_DIR` (to compare file systems); the CDI specs under
//! /dev/shm where it exists, as `/var/run/cdi` is a tmpfs on a node, or
//! `GPUMEM_BENCH_CDI_DIR`. `GPUMEM_BENCH_N` sets the iterations (default 500).
mod common;

use common::{cpu_model, percentile};

use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use serde_json::json;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use gpumem::dra::checkpoint::{Checkpoint, ClaimEntry, DeviceEntry};
use gpumem::dra::claims::{ClaimRef, Prepared};
use gpumem::dra::prepare::DriverConfig;
use gpumem::dra::service::DraSockets;
use gpumem::dra::slice;
use gpumem::dra::DEFAULT_DRIVER_NAME as DRIVER;
use gpumem::isolation::accounting::{self, Cap, Durability};
use gpumem::isolation::cdi::{self, SpecDir};
use gpumem::isolation::containers::ContainerName;
use gpumem::isolation::inject::{self, ClaimGpu, Isolation, ShimConfig};
use gpumem::isolation::install::preload_line;
use gpumem::isolation::statefs::StateFs;
use gpumem::node::gpu::{Gpu, NodeFacts};
use gpumem::node::inventory::Inventory;
use gpumem::node::units::MemoryUnit;
use gpumem::ops::daemon::{self, Common, DaemonError, DraDaemonConfig, CHECKPOINT};
use gpumem_testkit::fake_apiserver::{allocated_claim, Allocated, FakeApiServer, Kind};
use gpumem_testkit::simulator::dra::{FakeDraKubelet, FakeKubeletError, KUBELET_1_34};

const NODE: &str = "h100-node";
const NODE_UID: &str = "7d0c6e1a-0000-4000-8000-00000000b0a7";
const BOOT_ID: &str = "3f0c1d7e-2b4a-4c1e-9a51-6d2f00c0ffee";
const GPUS: u32 = 8;
/// An H100 80GB HBM3 as NVML reports it.
const H100_MIB: u64 = 81559;
/// Each claim's `capacity.requests.memory`.
const CLAIM_MIB: u64 = 4096;
/// Claims already prepared in the "busy node" rows: 12–13 of 4 GiB per GPU.
const BUSY: usize = 100;
const WAIT: Duration = Duration::from_secs(20);
/// How often the start-up watcher looks at the socket and the API server.
const POLL: Duration = Duration::from_micros(100);

fn main() {
    // `cargo test --benches` runs this with --bench absent: keep that quick.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let n: usize = std::env::var("GPUMEM_BENCH_N")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(500);
    let base = base_dir();
    println!(
        "# DRA driver, in process; {} ({} CPUs); load average {}; state dir under {} ({}), \
         CDI specs under {} ({})",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        load_average(),
        base.display(),
        fs_type(&base),
        cdi_base_dir().display(),
        fs_type(&cdi_base_dir())
    );
    let inventory = Inventory::new(gpus(), MemoryUnit::GiB).unwrap();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            startup(&inventory, 20).await;
            prepare(&inventory, n).await;
        });
    file_work(&inventory, n);
    println!("\nload average at the end: {}", load_average());
}

fn gpus() -> Vec<Gpu> {
    (0..GPUS)
        .map(|i| Gpu {
            index: i,
            uuid: format!("GPU-{:08x}-5e1c-4a7d-9b2f-00000000{i:04x}", 0x6b1c_2d30 + i),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_mib: H100_MIB,
            healthy: true,
        })
        .collect()
}

// ---------------------------------------------------------------- the driver

/// A node's host directories: kubelet's, the shim's, the state dir, CDI.
struct Host {
    root: tempfile::TempDir,
    /// Where the CDI specs go: a tmpfs where there is one.
    cdi: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let root = tempfile::Builder::new()
            .prefix("gpumem-bench-dra-")
            .tempdir_in(base_dir())
            .unwrap();
        // Prepare checks only that the shim and its preload list are there.
        let shim = root.path().join("shim");
        std::fs::create_dir_all(&shim).unwrap();
        std::fs::write(shim.join(inject::SHIM_LIBRARY), b"").unwrap();
        std::fs::write(shim.join(inject::PRELOAD_LIST), preload_line()).unwrap();
        std::fs::create_dir_all(root.path().join("registry")).unwrap();
        let cdi = tempfile::Builder::new()
            .prefix("gpumem-bench-dra-cdi-")
            .tempdir_in(cdi_base_dir())
            .unwrap();
        Host { root, cdi }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.path().join(name)
    }

    fn shim(&self) -> ShimConfig {
        ShimConfig {
            host_dir: self.path("shim"),
            state_dir: self.path("state"),
            context_charge_mib: 0,
            state_fs: StateFs::Shared,
        }
    }

    fn specs(&self) -> SpecDir {
        SpecDir::of_class(self.cdi.path(), cdi::CLAIM_CLASS)
    }

    fn sockets(&self) -> DraSockets {
        DraSockets {
            driver_name: DRIVER.to_owned(),
            plugins_dir: self.path("plugins"),
            registry_dir: self.path("registry"),
        }
    }

    fn checkpoint_bytes(&self) -> u64 {
        std::fs::metadata(self.path("state").join(CHECKPOINT)).map_or(0, |m| m.len())
    }
}

/// `gpumem dra` running, registered with a fake kubelet.
struct Driver {
    host: Host,
    api: Arc<FakeApiServer>,
    kubeconfig: PathBuf,
    kubelet: FakeDraKubelet,
    inventory: Inventory,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), DaemonError>>,
    /// Claims made so far, for fresh names and UIDs.
    made: u64,
}

/// Since `run_dra` was spawned.
struct Started {
    socket: Duration,
    registered: Duration,
    slice: Duration,
}

impl Driver {
    async fn start(inventory: &Inventory) -> (Driver, Started) {
        let host = Host::new();
        let api = Arc::new(FakeApiServer::start().await.unwrap());
        api.put(json!({"kind": "Node", "metadata": {"name": NODE, "uid": NODE_UID}}));
        let kubeconfig = host.path("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let (client, api_health) = gpumem::cluster::client::connect_watched(Some(&kubeconfig))
            .await
            .unwrap();
        let sockets = host.sockets();
        let config = DraDaemonConfig {
            driver: DriverConfig {
                driver: DRIVER.to_owned(),
                node: NODE.to_owned(),
                isolation: Isolation::Shim(host.shim()),
                specs: host.specs(),
                nvidia_spec_dirs: Vec::new(),
            },
            sockets: sockets.clone(),
            client,
            api: api_health,
            facts: NodeFacts::default(),
            boot_id: BOOT_ID.to_owned(),
            pod_resources_socket: host.path("no-pod-resources.sock"),
            startup_taint: None,
            common: Common::quiet(host.path("state"), "bench-node"),
        };
        let socket = sockets.registration_socket();
        let shutdown = CancellationToken::new();
        let (socket_tx, socket_rx) = oneshot::channel();
        let started = Instant::now();
        let task = tokio::spawn(daemon::run_dra(
            config,
            inventory.clone(),
            None,
            shutdown.clone(),
        ));
        let watcher = {
            let api = api.clone();
            tokio::task::spawn_blocking(move || watch_start(started, &api, &socket, socket_tx))
        };
        let Ok(at_socket) = socket_rx.await else {
            panic!("no registration socket: {:?}", watcher.await);
        };
        let kubelet = register(&sockets.registration_socket()).await;
        let registered = started.elapsed();
        let slice = watcher.await.unwrap();
        assert!(!task.is_finished(), "the driver stopped: {:?}", task.await);
        let driver = Driver {
            host,
            api,
            kubeconfig,
            kubelet,
            inventory: inventory.clone(),
            shutdown,
            task,
            made: 0,
        };
        let started = Started {
            socket: at_socket,
            registered,
            slice,
        };
        (driver, started)
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.task.await.unwrap().unwrap();
    }

    /// `n` new claims, each allocated 4 GiB of a GPU (in turn) and put into
    /// the API server.
    fn new_claims(&mut self, n: usize) -> Vec<ClaimRef> {
        (0..n)
            .map(|_| {
                self.made += 1;
                let i = self.made;
                let claim = claim_ref(i);
                let gpu = &self.inventory.gpus()[i as usize % GPUS as usize].gpu;
                self.api.put(allocated_claim(
                    &claim.namespace,
                    &claim.name,
                    &claim.uid,
                    DRIVER,
                    NODE,
                    &[Allocated {
                        request: "gpu".to_owned(),
                        device: slice::device_name(gpu),
                        memory: Some(format!("{CLAIM_MIB}Mi")),
                        share_id: Some(format!("9a3e5c71-0000-4000-8000-{i:012x}")),
                    }],
                ));
                claim
            })
            .collect()
    }

    /// One NodePrepareResources call, timed; every claim must be prepared.
    async fn prepare(&self, claims: &[ClaimRef]) -> Duration {
        let started = Instant::now();
        let answer = self.kubelet.prepare(claims).await.unwrap();
        let took = started.elapsed();
        check_prepared(claims, &answer);
        took
    }

    /// Unprepares `claims`, removes their accounting directories (clean-up's
    /// job, 300 s later on a node) and deletes them from the API server, so
    /// the state dir stays as small as the rows say.
    async fn release(&self, claims: &[ClaimRef]) {
        let answer = self.kubelet.unprepare(claims).await.unwrap();
        let containers = self.host.shim().containers();
        for claim in claims {
            assert!(
                matches!(answer.get(&claim.uid), Some(Ok(()))),
                "{}: {:?}",
                claim.uid,
                answer.get(&claim.uid)
            );
            let dir = containers.get(ContainerName::of_claim(&claim.uid).unwrap());
            dir.remove().unwrap();
            self.api
                .delete(Kind::ResourceClaim, &claim.namespace, &claim.name)
                .unwrap();
        }
    }
}

/// Registers as kubelet does once it sees the socket. The file exists from
/// `bind(2)`, a moment before `listen(2)`: a connection refused then is
/// tried again at once.
async fn register(socket: &Path) -> FakeDraKubelet {
    let deadline = Instant::now() + WAIT;
    loop {
        match FakeDraKubelet::register(socket, KUBELET_1_34).await {
            Ok(kubelet) => return kubelet,
            Err(FakeKubeletError::Connect { source, .. })
                if source.kind() == std::io::ErrorKind::ConnectionRefused
                    && Instant::now() < deadline =>
            {
                tokio::task::yield_now().await;
            }
            Err(err) => panic!("registration: {err}"),
        }
    }
}

fn claim_ref(i: u64) -> ClaimRef {
    ClaimRef {
        namespace: "default".to_owned(),
        uid: format!("5d2f8c1e-0000-4000-8000-{i:012x}"),
        name: format!("claim-{i}"),
    }
}

fn check_prepared(claims: &[ClaimRef], answer: &Prepared) {
    assert_eq!(answer.len(), claims.len());
    for claim in claims {
        match answer.get(&claim.uid) {
            Some(Ok(devices)) => assert!(
                devices.len() == 1 && devices[0].cdi_device_ids.len() == 1,
                "{devices:?}"
            ),
            other => panic!("{}: {other:?}", claim.uid),
        }
    }
}

/// On a thread of its own: when the registration socket appears (told at
/// once through `socket_tx`) and when the node's slice is listed.
fn watch_start(
    started: Instant,
    api: &FakeApiServer,
    socket: &Path,
    socket_tx: oneshot::Sender<Duration>,
) -> Duration {
    let mut socket_tx = Some(socket_tx);
    loop {
        let now = started.elapsed();
        if socket_tx.is_some()
            && std::fs::symlink_metadata(socket).is_ok_and(|m| m.file_type().is_socket())
        {
            let _ = socket_tx.take().map(|tx| tx.send(now));
        }
        if socket_tx.is_none()
            && api
                .list(Kind::ResourceSlice)
                .iter()
                .any(|s| s["spec"]["nodeName"] == NODE)
        {
            return now;
        }
        assert!(
            now < WAIT,
            "no registration socket or slice within {WAIT:?}"
        );
        std::thread::sleep(POLL);
    }
}

// ---------------------------------------------------------------- the rows

async fn startup(inventory: &Inventory, runs: usize) {
    println!(
        "\n# Start (spawning run_dra) to: registration socket, registered with kubelet, \
         ResourceSlice listed in the API server; {runs} starts, each on fresh directories"
    );
    let (mut socket, mut registered, mut slice) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..runs {
        let (driver, started) = Driver::start(inventory).await;
        socket.push(started.socket);
        registered.push(started.registered);
        slice.push(started.slice);
        driver.stop().await;
    }
    report("start to registration socket", socket);
    report(
        "start to registered (GetInfo, NotifyRegistrationStatus)",
        registered,
    );
    report("start to ResourceSlice listed", slice);
}

async fn prepare(inventory: &Inventory, n: usize) {
    let (mut driver, _) = Driver::start(inventory).await;
    let warm = (n / 10).max(10);
    println!(
        "\n# NodePrepareResources over the unix socket (fake kubelet, v1), shim isolation: \
         each call on new claims, unprepared after (outside the timing); {warm} calls first, \
         not counted"
    );

    // The API read alone, through a client made the way the driver's is.
    let client = gpumem::cluster::client::connect(Some(&driver.kubeconfig))
        .await
        .unwrap();
    let api: Api<ResourceClaim> = Api::namespaced(client, "default");
    let claim = driver.new_claims(1).remove(0);
    let mut samples = Vec::new();
    for i in 0..warm + n {
        let started = Instant::now();
        let got = api.get_opt(&claim.name).await.unwrap();
        let took = started.elapsed();
        assert!(got.is_some());
        if i >= warm {
            samples.push(took);
        }
    }
    report("API read alone (Api::<ResourceClaim>::get_opt)", samples);

    // A prepared claim asked again: answered from the checkpoint.
    driver.prepare(std::slice::from_ref(&claim)).await;
    let mut samples = Vec::new();
    for i in 0..warm + n {
        let took = driver.prepare(std::slice::from_ref(&claim)).await;
        if i >= warm {
            samples.push(took);
        }
    }
    report("repeated Prepare, 1 claim (idempotent)", samples);
    driver.release(&[claim]).await;

    let empty = driver.host.checkpoint_bytes();
    let (calls, _) = prepare_new(&mut driver, warm, n, 1, 1).await;
    report(
        &format!("1 new claim, 0 others prepared (checkpoint {empty} B)"),
        calls,
    );
    let (calls, rounds) = prepare_new(&mut driver, warm / 4, n / 4, 1, 16).await;
    report("16 new claims in one request", calls);
    per_claim("  the same, per claim", &rounds, 16);
    let (calls, rounds) = prepare_new(&mut driver, warm / 4, n / 4, 16, 1).await;
    report("16 concurrent requests of 1 new claim: each call", calls);
    report("16 concurrent requests of 1 new claim: all 16", rounds);

    // A busy node: the checkpoint, rewritten whole at every step, holds
    // BUSY claims besides the one being prepared.
    let busy = driver.new_claims(BUSY);
    for claim in &busy {
        driver.prepare(std::slice::from_ref(claim)).await;
    }
    let full = driver.host.checkpoint_bytes();
    let (calls, _) = prepare_new(&mut driver, warm, n, 1, 1).await;
    report(
        &format!("1 new claim, {BUSY} others prepared (checkpoint {full} B)"),
        calls,
    );
    let (calls, rounds) = prepare_new(&mut driver, warm / 4, n / 4, 1, 16).await;
    report(
        &format!("16 new claims in one request, {BUSY} others"),
        calls,
    );
    per_claim("  the same, per claim", &rounds, 16);
    driver.release(&busy).await;

    println!(
        "\n# Where one new claim's time goes, by the driver's own log events (a tracing \
         layer that notes when the handler's debug event and commit's `prepared` event fire)"
    );
    marks::install();
    for others in [0, BUSY] {
        let busy = driver.new_claims(others);
        for claim in &busy {
            driver.prepare(std::slice::from_ref(claim)).await;
        }
        let cpu = process_cpu();
        let mut steps: [(&str, Vec<Duration>); 4] = [
            ("kubelet's call → the handler (gRPC request)", vec![]),
            ("handler → `prepared` (API read, plan, file work)", vec![]),
            ("`prepared` → kubelet has the answer (gRPC answer)", vec![]),
            ("the whole call", vec![]),
        ];
        for i in 0..warm + n {
            let claims = driver.new_claims(1);
            marks::clear();
            let started = Instant::now();
            let took = driver.prepare(&claims).await;
            let (Some(entry), Some(prepared)) = marks::get() else {
                panic!("no log events from the driver");
            };
            if i >= warm {
                let parts = [
                    entry - started,
                    prepared - entry,
                    (started + took).saturating_duration_since(prepared),
                    took,
                ];
                for (step, took) in steps.iter_mut().zip(parts) {
                    step.1.push(took);
                }
            }
            driver.release(&claims).await;
        }
        let cpu = (process_cpu() - cpu) / (warm + n) as u32;
        println!(
            "with {others} other claims prepared; CPU of the whole process (driver, fake kubelet, \
             fake API server) per Prepare + Unprepare: {cpu:.1?}"
        );
        for (name, samples) in steps {
            report(&format!("  {name}"), samples);
        }
        driver.release(&busy).await;
    }
    driver.stop().await;
}

/// User and system CPU time of this process, its ended threads included.
fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // After the command name, which may hold spaces: state is field 3,
    // utime 14 and stime 15, in clock ticks (100 per second).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// When the driver's handler took the request, and when `commit` logged the
/// claim prepared: from its own tracing events, so src/ stays as it is.
mod marks {
    use std::fmt;
    use std::sync::Mutex;
    use std::time::Instant;

    use tracing::field::{Field, Visit};
    use tracing::subscriber::Interest;
    use tracing::{Event, Metadata, Subscriber};
    use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

    static ENTRY: Mutex<Option<Instant>> = Mutex::new(None);
    static PREPARED: Mutex<Option<Instant>> = Mutex::new(None);

    const SERVICE: &str = "gpumem::dra::service";
    const PREPARE: &str = "gpumem::dra::prepare";

    pub fn install() {
        let subscriber = tracing_subscriber::registry().with(Marks);
        tracing::subscriber::set_global_default(subscriber).unwrap();
    }

    pub fn clear() {
        *ENTRY.lock().unwrap() = None;
        *PREPARED.lock().unwrap() = None;
    }

    pub fn get() -> (Option<Instant>, Option<Instant>) {
        (*ENTRY.lock().unwrap(), *PREPARED.lock().unwrap())
    }

    struct Marks;

    impl<S: Subscriber> Layer<S> for Marks {
        // Every other event (h2's, hyper's, kube's) stays disabled.
        fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
            if metadata.is_event() && [SERVICE, PREPARE].contains(&metadata.target()) {
                Interest::always()
            } else {
                Interest::never()
            }
        }

        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let now = Instant::now();
            let mut message = Message(String::new());
            event.record(&mut message);
            let slot = match (event.metadata().target(), message.0.as_str()) {
                (SERVICE, "NodePrepareResources") => &ENTRY,
                (PREPARE, "prepared") => &PREPARED,
                _ => return,
            };
            *slot.lock().unwrap() = Some(now);
        }
    }

    struct Message(String);

    impl Visit for Message {
        fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }
}

/// `warm` + `rounds` rounds of `requests` concurrent NodePrepareResources
/// calls of `per_request` new claims each: each counted call's latency, and
/// each counted round's.
async fn prepare_new(
    driver: &mut Driver,
    warm: usize,
    rounds: usize,
    requests: usize,
    per_request: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut calls, mut whole) = (Vec::new(), Vec::new());
    for round in 0..warm + rounds {
        let batches: Vec<Vec<ClaimRef>> = (0..requests)
            .map(|_| driver.new_claims(per_request))
            .collect();
        let started = Instant::now();
        let took = join_all(batches.iter().map(|b| driver.prepare(b))).await;
        let all = started.elapsed();
        if round >= warm {
            calls.extend(took);
            whole.push(all);
        }
        driver.release(&batches.concat()).await;
    }
    (calls, whole)
}

// ---------------------------------------------------------------- the parts

/// The driver's file work for one claim, step by step as `commit` does it,
/// with 0 and BUSY other claims in the checkpoint; then what one fsynced
/// small file costs on this file system.
fn file_work(inventory: &Inventory, n: usize) {
    let warm = (n / 10).max(10);
    println!(
        "\n# The file work of one Prepare alone, replayed with the driver's own functions \
         on the same file system (no gRPC, no API, no lock contention)"
    );
    for others in [0, BUSY] {
        let host = Host::new();
        let shim = host.shim();
        let specs = host.specs();
        let containers = shim.containers();
        let mut checkpoint = Checkpoint::open(&host.path("state").join(CHECKPOINT), BOOT_ID)
            .unwrap()
            .checkpoint;
        // The others with their files, as on the node.
        for i in 0..others as u64 {
            let (uid, entry) = entry(inventory, &specs, 1_000_000 + i);
            checkpoint.start(&uid, entry.clone()).unwrap();
            make_files(inventory, &shim, &specs, &uid, &entry);
            checkpoint.complete(&uid, entry.devices).unwrap();
        }
        let mut steps: [(&str, Vec<Duration>); 6] = [
            ("checkpoint: Started (write, rename)", vec![]),
            ("shim check + accounting file (write, rename)", vec![]),
            (
                "CDI spec (build, write, fsync, rename; on the CDI dir)",
                vec![],
            ),
            ("checkpoint: Completed (write, rename)", vec![]),
            ("all four", vec![]),
            (
                "  serialising the checkpoint's claims (JSON, compact)",
                vec![],
            ),
        ];
        for i in 0..(warm + n) as u64 {
            let (uid, entry) = entry(inventory, &specs, i);
            let dir = containers.get(ContainerName::of_claim(&uid).unwrap());
            let mut lap = Lap::new();
            checkpoint.start(&uid, entry.clone()).unwrap();
            let started = lap.next();
            let (accounting, spec) = make_files(inventory, &shim, &specs, &uid, &entry);
            lap.next();
            checkpoint.complete(&uid, entry.devices.clone()).unwrap();
            let completed = lap.next();
            let claims: BTreeMap<&str, &ClaimEntry> = checkpoint.claims().collect();
            let at = Instant::now();
            std::hint::black_box(serde_json::to_vec(&claims).unwrap());
            let serialise = at.elapsed();
            specs.remove(&uid).unwrap();
            checkpoint.remove(&uid).unwrap();
            dir.remove().unwrap();
            if i as usize >= warm {
                let total = started + accounting + spec + completed;
                for (step, took) in steps
                    .iter_mut()
                    .zip([started, accounting, spec, completed, total, serialise])
                {
                    step.1.push(took);
                }
            }
        }
        println!(
            "with {others} other claims in the checkpoint ({} B):",
            host.checkpoint_bytes()
        );
        for (name, samples) in steps {
            report(&format!("  {name}"), samples);
        }
    }

    let host = Host::new();
    let dir = host.path("fsync");
    std::fs::create_dir_all(&dir).unwrap();
    let text = vec![b'x'; 2048];
    for (name, sync) in [
        ("2 KiB file: write, fsync, rename, dir fsync", true),
        ("2 KiB file: write, rename (no fsync)", false),
    ] {
        let mut samples = Vec::new();
        for i in 0..warm + n {
            let started = Instant::now();
            let mut staging = tempfile::Builder::new().tempfile_in(&dir).unwrap();
            staging.write_all(&text).unwrap();
            if sync {
                staging.as_file().sync_all().unwrap();
            }
            staging.persist(dir.join("file")).unwrap();
            if sync {
                std::fs::File::open(&dir).unwrap().sync_all().unwrap();
            }
            if i >= warm {
                samples.push(started.elapsed());
            }
        }
        report(name, samples);
    }
}

/// A claim's accounting file and CDI spec, as `make_files` makes them:
/// how long each took.
fn make_files(
    inventory: &Inventory,
    shim: &ShimConfig,
    specs: &SpecDir,
    uid: &str,
    entry: &ClaimEntry,
) -> (Duration, Duration) {
    let uuid = &entry.devices[0].gpu_uuid;
    let gpu = inventory
        .gpus()
        .iter()
        .position(|g| &g.gpu.uuid == uuid)
        .unwrap();
    let mut lap = Lap::new();
    inject::check_shim(shim).unwrap();
    let dir = shim.containers().get(ContainerName::of_claim(uid).unwrap());
    accounting::prepare_with(
        &dir.path,
        &[Cap {
            uuid: uuid.clone(),
            cap_mib: CLAIM_MIB,
            context_charge_mib: 0,
        }],
        Durability::Unsynced,
        StateFs::Shared,
    )
    .unwrap();
    let accounting = lap.next();
    let gpus = [ClaimGpu {
        gpu,
        cap_mib: CLAIM_MIB,
    }];
    let edits = inject::claim_edits(inventory, &gpus, Some((shim, &dir)), uuid.clone());
    specs
        .write(&cdi::spec(cdi::CLAIM_CLASS, uid, edits).unwrap())
        .unwrap();
    (accounting, lap.next())
}

/// Claim `i`'s checkpoint entry as `plan` and `commit` make it.
fn entry(inventory: &Inventory, specs: &SpecDir, i: u64) -> (String, ClaimEntry) {
    let claim = claim_ref(i);
    let gpu = &inventory.gpus()[i as usize % GPUS as usize].gpu;
    let device = DeviceEntry {
        request_names: vec!["gpu".to_owned()],
        pool: NODE.to_owned(),
        device: slice::device_name(gpu),
        share_id: Some(format!("9a3e5c71-0000-4000-8000-{i:012x}")),
        gpu_uuid: gpu.uuid.clone(),
        cap_mib: CLAIM_MIB,
        cdi_device_ids: vec![cdi::qualified_name(&specs.kind(), &claim.uid)],
        ..Default::default()
    };
    let entry = ClaimEntry {
        devices: vec![device],
        ..ClaimEntry::started(
            &claim.namespace,
            &claim.name,
            ContainerName::of_claim(&claim.uid).unwrap().as_str(),
            &claim.uid,
        )
    };
    (claim.uid, entry)
}

/// Time since the last lap.
struct Lap(Instant);

impl Lap {
    fn new() -> Lap {
        Lap(Instant::now())
    }

    fn next(&mut self) -> Duration {
        let now = Instant::now();
        let took = now - self.0;
        self.0 = now;
        took
    }
}

// ---------------------------------------------------------------- reporting

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    println!(
        "{name:<64} n={:<5} p50={:>8.1?} p90={:>8.1?} p99={:>8.1?} max={:>8.1?}",
        samples.len(),
        percentile(&samples, 0.50),
        percentile(&samples, 0.90),
        percentile(&samples, 0.99),
        samples[samples.len() - 1]
    );
}

/// A round's time divided among its `claims`.
fn per_claim(name: &str, rounds: &[Duration], claims: u32) {
    report(name, rounds.iter().map(|d| *d / claims).collect());
}

fn base_dir() -> PathBuf {
    std::env::var_os("GPUMEM_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from)
}

fn cdi_base_dir() -> PathBuf {
    match std::env::var_os("GPUMEM_BENCH_CDI_DIR") {
        Some(dir) => PathBuf::from(dir),
        None if Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
        None => base_dir(),
    }
}

/// `stat -f -c %T`: the file system's type as coreutils names it.
fn fs_type(path: &Path) -> String {
    std::process::Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(path)
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .map_or_else(|| "unknown".into(), |s| s.trim().to_owned())
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
