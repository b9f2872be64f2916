//! The attribution sweep's cost (not a test): `cargo bench --bench attribution`.
//!
//! One reconcile tick as `gpumem plugin` runs it every `--reconcile-secs`
//! (list the state dir, then `Reconciler::tick` with the daemon's granted
//! caps and an over-cap action) on a node of 8 GPUs × 64 processes, built
//! from real files: accounting files made by `ContainerDir::prepare`, whose
//! slots are held by live helper processes (this binary, run again), and a
//! proc root with each process's `cgroup`, `mountinfo` and `stat` as a
//! containerd node shows them. NVML's answer is a map (on an H100 it costs 26 µs per
//! GPU). Results go to docs/BENCHMARKS.md.
mod common;

use common::cpu_model;

use std::collections::HashMap;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpumem::isolation::accounting::{self, Cap};
use gpumem::isolation::containers::{ContainerName, Containers};
use gpumem::isolation::enforce::{self, OverCapAction};
use gpumem::isolation::reconcile::Reconciler;
use gpumem::isolation::statefs::StateFs;
use gpumem::node::gpu::{Gpu, GpuError, ProcessMemory};
use gpumem::node::inventory::Inventory;
use gpumem::node::placement::Assignment;
use gpumem::node::processes::{self, ProcFiles, ProcessUsage};
use gpumem::node::units::MemoryUnit;
use gpumem_layout::protocol::StateWord;
use nix::fcntl::{fcntl, FcntlArg};
use nix::libc;

const MIB: u64 = 1 << 20;
const GPUS: usize = 8;
/// An H100 80GB HBM3 as NVML reports it: 79 units of 1 GiB.
const H100_MIB: u64 = 81559;
/// What an H100 context takes (docs/ISOLATION.md).
const CONTEXT_MIB: u64 = 518;
/// Set in a helper: `<accounting file>:<offset>` of the slot lock it holds.
const HOLD: &str = "GPUMEM_BENCH_HOLD";

/// Containers of one kind, on every GPU: how many, their units, and their
/// GPU processes: under the shim (each holds a slot), without it but with
/// the container's mounts (a static binary), and without it in a container
/// nested in theirs (docker in docker: only the cgroup says whose).
struct Kind {
    count: usize,
    units: u32,
    shim: usize,
    by_mount: usize,
    by_cgroup: usize,
}

/// 15 containers and 79 units per GPU; 60 processes.
const KINDS: [Kind; 5] = [
    // count, units; processes: under the shim, found by mounts, by cgroup.
    Kind::new(6, 2, [1, 0, 0]),  // notebooks
    Kind::new(4, 5, [4, 0, 0]),  // inference servers, a process per worker
    Kind::new(2, 8, [8, 0, 0]),  // training with CUDA data-loader workers
    Kind::new(2, 8, [8, 1, 0]),  // ... and a static binary beside it
    Kind::new(1, 15, [2, 0, 2]), // docker in docker
];

impl Kind {
    const fn new(count: usize, units: u32, [shim, by_mount, by_cgroup]: [usize; 3]) -> Kind {
        Kind {
            count,
            units,
            shim,
            by_mount,
            by_cgroup,
        }
    }
}

/// And per GPU, in no gpumem container: a rank of an 8-GPU job of another
/// device plugin, two processes of a pod that reached the GPU without
/// asking, and one host process listed on every GPU.
const STRANGERS: usize = 4;

fn main() {
    if let Ok(spec) = std::env::var(HOLD) {
        hold(&spec);
        return;
    }
    let sweeps: usize = std::env::var("GPUMEM_BENCH_SWEEPS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(400);
    let node = Node::build();
    println!(
        "# attribution sweep: state dir listing + Reconciler::tick (granted caps, over-cap action \
         report); {} ({} CPUs); thread CPU from CLOCK_THREAD_CPUTIME_ID",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("{}", node.summary());

    let stats = Arc::new(Stats::default());
    let source = Sampled {
        memory: node.memory.clone(),
        proc_root: node.proc_root(),
        sweep: 0,
        stats: stats.clone(),
    };
    let inventory = node.inventory.clone();
    // As src/ops/daemon.rs sets them: the over-cap action's caps come from
    // the directory's name and the inventory.
    let mut reconciler = Reconciler::new(Box::new(source))
        .with_granted_caps(Box::new(move |file, uuid| {
            let name = ContainerName::of_dir(file.parent()?)?;
            let mib = name.granted_mib(&inventory, uuid)?;
            Some(mib.saturating_mul(1 << 20))
        }))
        .with_over_cap(OverCapAction::Report, Duration::from_secs(10));
    let containers = node.containers();
    let mut sweep = || {
        let files = containers.accounting_files();
        reconciler.tick(&files);
        files.len()
    };
    for _ in 0..20 {
        sweep();
    }
    let (mut cpu, mut wall) = (Vec::new(), Vec::new());
    for _ in 0..sweeps {
        let (c, w) = (thread_cpu(), Instant::now());
        assert_eq!(sweep(), node.files.len());
        wall.push(w.elapsed());
        cpu.push(thread_cpu() - c);
    }
    report("sweep, thread CPU", cpu);
    report("sweep, wall", wall);

    // Where the time goes: the same sweeps with the /proc reads timed, then
    // each part alone. (Left out for instruction counts under callgrind.)
    if std::env::var_os("GPUMEM_BENCH_NO_SPLIT").is_some() {
        return;
    }
    stats.timing.store(true, Relaxed);
    let (mut proc_share, mut reads, mut bytes) = (Vec::new(), 0, 0);
    for _ in 0..sweeps / 2 {
        stats.reset();
        let w = Instant::now();
        sweep();
        let total = w.elapsed().as_nanos() as f64;
        proc_share.push(stats.read_ns.load(Relaxed) as f64 / total);
        reads = stats.reads.load(Relaxed);
        bytes = stats.bytes.load(Relaxed);
    }
    stats.timing.store(false, Relaxed);
    proc_share.sort_unstable_by(f64::total_cmp);
    println!(
        "per sweep: {reads} /proc reads ({} KiB), {:.0} % of the sweep's wall time (median)",
        bytes >> 10,
        proc_share[proc_share.len() / 2] * 100.0
    );
    let requested = stats.requested.lock().unwrap().clone();
    let parts: [(&str, &dyn Fn()); 3] = [
        ("listing the state dir", &|| {
            containers.accounting_files();
        }),
        (
            "reading the accounting files (F_GETLK per live slot)",
            &|| {
                for file in &node.files {
                    accounting::processes(file).unwrap();
                }
            },
        ),
        ("the sweep's /proc reads, replayed", &|| {
            for (pid, name) in &requested {
                let root = node.proc_root();
                if name == "stat" {
                    processes::proc_stat(&root, *pid);
                } else {
                    let lines = &mut |_: &str| std::ops::ControlFlow::Continue(());
                    processes::proc_lines(&root, *pid, *pid, name, lines);
                }
            }
        }),
    ];
    for (name, part) in parts {
        let mut samples: Vec<Duration> = (0..sweeps / 2)
            .map(|_| {
                let c = thread_cpu();
                part();
                thread_cpu() - c
            })
            .collect();
        samples.sort_unstable();
        println!(
            "  {name:<56} thread CPU p50 {:>8.1?}",
            samples[samples.len() / 2]
        );
    }
    calibrate_procfs();
}

/// Sweep figures: median, 99th percentile, largest.
fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
    println!(
        "{name:<24} n={:<5} p50={:>8.1?} p99={:>8.1?} max={:>8.1?}",
        samples.len(),
        at(0.5),
        at(0.99),
        samples[samples.len() - 1]
    );
}

/// What the same files cost when the kernel writes them: this process's
/// own, read back to back (the proc root above is a plain file system).
fn calibrate_procfs() {
    for name in ["cgroup", "stat", "mountinfo"] {
        let path = Path::new("/proc/self").join(name);
        let text = fs::read_to_string(&path).unwrap_or_default();
        let c = thread_cpu();
        const N: u32 = 2000;
        for _ in 0..N {
            fs::read_to_string(&path).ok();
        }
        println!(
            "procfs: /proc/self/{name} ({} lines, {} bytes): {:.1?} thread CPU per read",
            text.lines().count(),
            text.len(),
            (thread_cpu() - c) / N
        );
    }
}

/// This thread's CPU time, from `CLOCK_THREAD_CPUTIME_ID`.
/// (`/proc/thread-self/schedstat` brings that figure up to date only at
/// scheduler ticks, and a sweep lasts about one.)
fn thread_cpu() -> Duration {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .expect("CLOCK_THREAD_CPUTIME_ID");
    Duration::from(now)
}

/// What the sweeps asked of the proc root.
#[derive(Default)]
struct Stats {
    timing: AtomicBool,
    read_ns: AtomicU64,
    reads: AtomicU64,
    bytes: AtomicU64,
    requested: Mutex<Vec<(u32, String)>>,
}

impl Stats {
    fn reset(&self) {
        self.read_ns.store(0, Relaxed);
        self.reads.store(0, Relaxed);
        self.bytes.store(0, Relaxed);
        self.requested.lock().unwrap().clear();
    }
}

/// NVML's answer and the node's /proc, as the daemon's source gives them.
struct Sampled {
    memory: ProcessMemory,
    proc_root: PathBuf,
    sweep: u64,
    stats: Arc<Stats>,
}

impl ProcessUsage for Sampled {
    fn usage(&mut self) -> Result<ProcessMemory, GpuError> {
        // Every sweep one process in 64, in turn, holds one more 2 MiB chunk
        // than the sweep before, and the one before gives it back: some
        // untracked figures are published.
        self.sweep += 1;
        let mut memory = self.memory.clone();
        for per_pid in memory.values_mut() {
            for (pid, bytes) in per_pid.iter_mut() {
                if (u64::from(*pid) + self.sweep).is_multiple_of(64) {
                    *bytes += 2 * MIB;
                }
            }
        }
        Ok(memory)
    }
}

impl ProcFiles for Sampled {
    fn proc_stat(&self, pid: u32) -> Option<processes::ProcStat> {
        self.timed(pid, "stat", || processes::proc_stat(&self.proc_root, pid))
    }

    fn proc_lines(
        &self,
        pid: u32,
        thread: u32,
        name: &str,
        each: &mut dyn FnMut(&str) -> std::ops::ControlFlow<()>,
    ) -> Option<processes::Read> {
        self.timed(pid, name, || {
            processes::proc_lines(&self.proc_root, pid, thread, name, &mut |line| {
                self.stats.bytes.fetch_add(line.len() as u64 + 1, Relaxed);
                each(line)
            })
        })
    }
}

impl Sampled {
    /// `read`'s answer, timed and counted where the bench times reads.
    fn timed<T>(&self, pid: u32, name: &str, read: impl FnOnce() -> T) -> T {
        if !self.stats.timing.load(Relaxed) {
            return read();
        }
        let started = Instant::now();
        let answer = read();
        let stats = &self.stats;
        stats
            .read_ns
            .fetch_add(started.elapsed().as_nanos() as u64, Relaxed);
        stats.reads.fetch_add(1, Relaxed);
        stats.requested.lock().unwrap().push((pid, name.to_owned()));
        answer
    }
}

/// A helper process: holds the record lock of one slot, as a shim does for
/// as long as its process lives, until its stdin closes.
fn hold(spec: &str) {
    let (path, offset) = spec.rsplit_once(':').expect("FILE:OFFSET");
    let file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("accounting file");
    let lock = libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: offset.parse().expect("offset"),
        l_len: 1,
        l_pid: 0,
    };
    fcntl(file.as_fd(), FcntlArg::F_SETLK(&lock)).expect("slot lock");
    println!("locked {}", std::process::id());
    std::io::stdout().flush().ok();
    std::io::stdin().read_to_end(&mut Vec::new()).ok();
}

/// One GPU process: where NVML lists it and what `/proc/<pid>/` says.
struct Process {
    gpu: usize,
    used: u64,
    cgroup: String,
    mountinfo: String,
    /// The slot it holds (accounting file, index) and what it charged.
    slot: Option<(usize, usize, u64)>,
}

/// The node: its state dir, proc root, GPUs and the helpers holding slots.
struct Node {
    root: tempfile::TempDir,
    inventory: Inventory,
    files: Vec<PathBuf>,
    memory: ProcessMemory,
    /// PIDs and what each process's files hold.
    processes: Vec<(u32, Process)>,
    helpers: Vec<Child>,
    /// Closed on drop: the helpers' stdin.
    _release: std::io::PipeWriter,
    mountinfo_lines: usize,
    host_mountinfo_lines: usize,
}

impl Node {
    fn build() -> Node {
        let root = tempfile::Builder::new()
            .prefix("gpumem-attribution-")
            .tempdir()
            .expect("temp dir");
        let gpus: Vec<Gpu> = (0..GPUS as u32)
            .map(|i| Gpu {
                index: i,
                uuid: format!(
                    "GPU-{:08x}-5e1c-4a7d-9b2f-{:012x}",
                    0x6b1c_2d30 + i,
                    hex(i.into()) >> 16
                ),
                name: "NVIDIA H100 80GB HBM3".into(),
                memory_mib: H100_MIB,
                healthy: true,
            })
            .collect();
        let inventory = Inventory::new(gpus, MemoryUnit::GiB).expect("inventory");
        let containers = Containers::in_state_dir(&root.path().join("state"));
        let mut ids = Ids(0);
        let mut files = Vec::new();
        let mut processes: Vec<Process> = Vec::new();
        let mut pods = 0;
        for (gpu, held) in inventory.gpus().iter().enumerate() {
            let mut next_unit = 0;
            for kind in &KINDS {
                for _ in 0..kind.count {
                    let unit_ids: Vec<String> = (next_unit..next_unit + kind.units)
                        .map(|u| format!("{}-{u}", held.key))
                        .collect();
                    next_unit += kind.units;
                    let assignment = Assignment {
                        gpu,
                        units: kind.units,
                    };
                    let dir = containers.get(ContainerName::of(&inventory, assignment, &unit_ids));
                    let cap_mib = held.cap_mib(kind.units);
                    dir.prepare_afresh(
                        &[Cap {
                            uuid: held.gpu.uuid.clone(),
                            cap_mib,
                            context_charge_mib: 0,
                        }],
                        StateFs::Shared,
                    )
                    .expect("accounting file");
                    let file = files.len();
                    files.push(dir.accounting_file());
                    let pod = ids.pod();
                    pods += 1;
                    let cgroup = cgroup(&pod, &ids.container(), files.len() % 4 == 0);
                    let mountinfo = container_mountinfo(&mut ids, &pod, Some(&dir.path));
                    // Each process under the shim charged its share of 70 %
                    // of the cap (at least its context), and holds ~140 MiB
                    // more on the GPU (modules, library workspaces): no
                    // container is over its cap.
                    let share = cap_mib * 7 / 10 / kind.shim as u64;
                    for index in 0..kind.shim {
                        let charged = share.max(CONTEXT_MIB) * MIB;
                        processes.push(Process {
                            gpu,
                            used: charged + (140 + 2 * index as u64) * MIB,
                            cgroup: cgroup.clone(),
                            mountinfo: mountinfo.clone(),
                            slot: Some((file, index, charged)),
                        });
                    }
                    for _ in 0..kind.by_mount {
                        processes.push(Process {
                            gpu,
                            used: 300 * MIB,
                            cgroup: cgroup.clone(),
                            mountinfo: mountinfo.clone(),
                            slot: None,
                        });
                    }
                    for _ in 0..kind.by_cgroup {
                        processes.push(Process {
                            gpu,
                            used: 900 * MIB,
                            cgroup: nested(&cgroup, &ids.container()),
                            mountinfo: docker_mountinfo(&mut ids),
                            slot: None,
                        });
                    }
                }
            }
            assert_eq!(next_unit, held.units, "every unit of GPU {gpu} held");
        }
        // Strangers: a rank of an 8-GPU job, two processes of a pod that
        // did not ask, per GPU; one host process on every GPU.
        let job = ids.pod();
        let job_mountinfo = container_mountinfo(&mut ids, &job, None);
        let job_cgroup = cgroup(&job, &ids.container(), false);
        for gpu in 0..GPUS {
            processes.push(Process {
                gpu,
                used: 30_000 * MIB,
                cgroup: job_cgroup.clone(),
                mountinfo: job_mountinfo.clone(),
                slot: None,
            });
            let pod = ids.pod();
            let mountinfo = container_mountinfo(&mut ids, &pod, None);
            let pod_cgroup = cgroup(&pod, &ids.container(), false);
            for _ in 0..STRANGERS - 2 {
                processes.push(Process {
                    gpu,
                    used: 1_000 * MIB,
                    cgroup: pod_cgroup.clone(),
                    mountinfo: mountinfo.clone(),
                    slot: None,
                });
            }
        }
        pods += 1 + GPUS;
        let host_mountinfo = host_mountinfo(&mut ids, pods);
        let host = Process {
            gpu: 0,
            used: 600 * MIB,
            cgroup: "0::/system.slice/model-cache.service\n".into(),
            mountinfo: host_mountinfo,
            slot: None,
        };
        let mountinfo_lines = processes[0].mountinfo.lines().count();
        let host_mountinfo_lines = host.mountinfo.lines().count();

        // The shim's processes: one helper per slot, each holding its lock.
        let (release_rx, release) = std::io::pipe().expect("pipe");
        let (locked_rx, locked_tx) = std::io::pipe().expect("pipe");
        let exe = std::env::current_exe().expect("this binary");
        let mut helpers = Vec::new();
        for p in &processes {
            let Some((file, index, _)) = p.slot else {
                continue;
            };
            let offset = gpumem_layout::slot_offset(1, index);
            let child = Command::new(&exe)
                .env(HOLD, format!("{}:{offset}", files[file].display()))
                .stdin(release_rx.try_clone().expect("pipe"))
                .stdout(locked_tx.try_clone().expect("pipe"))
                .spawn()
                .expect("helper");
            helpers.push(child);
        }
        drop((release_rx, locked_tx));
        let mut locked = BufReader::new(locked_rx).lines();
        for _ in 0..helpers.len() {
            locked
                .next()
                .expect("a helper locked its slot")
                .expect("pipe");
        }
        // Their slots, as the shim's claim leaves them; two more slots of
        // each file were freed by processes that exited.
        let mut pids = helpers.iter().map(Child::id);
        let mut next_fake = 1_000_000;
        let mut high_water: HashMap<usize, u32> = HashMap::new();
        let mut listed = Vec::new();
        for p in processes {
            let pid = match p.slot {
                Some((file, index, charged)) => {
                    let pid = pids.next().expect("a helper per slot");
                    let start = enforce::start_time(Path::new("/proc"), pid).unwrap_or(0);
                    let at = gpumem_layout::slot_offset(1, index);
                    let f = fs::OpenOptions::new()
                        .write(true)
                        .open(&files[file])
                        .expect("accounting file");
                    for (field, value) in [
                        (gpumem_layout::slot::USED, charged),
                        (gpumem_layout::slot::PID, u64::from(pid)),
                        (gpumem_layout::slot::START_TIME, start),
                        (gpumem_layout::slot::STATE, StateWord(0).claimed().0),
                    ] {
                        f.write_all_at(&value.to_le_bytes(), (at + field) as u64)
                            .expect("slot");
                    }
                    let hwm = high_water.entry(file).or_default();
                    *hwm = (*hwm).max(index as u32 + 3);
                    pid
                }
                None => {
                    next_fake += 1;
                    next_fake
                }
            };
            listed.push((pid, p));
        }
        for (file, hwm) in &high_water {
            let f = fs::OpenOptions::new()
                .write(true)
                .open(&files[*file])
                .expect("file");
            for index in (*hwm - 2)..*hwm {
                let at = gpumem_layout::slot_offset(1, index as usize);
                f.write_all_at(&StateWord(0).claimed().freed().0.to_le_bytes(), at as u64)
                    .expect("slot");
            }
            f.write_all_at(&hwm.to_le_bytes(), gpumem_layout::header::SLOT_HWM as u64)
                .expect("high water");
        }
        let host_pid = next_fake + 1;
        let mut memory = ProcessMemory::new();
        for held in inventory.gpus() {
            memory.entry(held.gpu.uuid.clone()).or_default();
        }
        for (pid, p) in &listed {
            let uuid = &inventory.gpus()[p.gpu].gpu.uuid;
            memory.get_mut(uuid).expect("GPU").insert(*pid, p.used);
        }
        for per_pid in memory.values_mut() {
            per_pid.insert(host_pid, host.used);
        }
        listed.push((host_pid, host));
        let node = Node {
            root,
            inventory,
            files,
            memory,
            processes: listed,
            helpers,
            _release: release,
            mountinfo_lines,
            host_mountinfo_lines,
        };
        for (n, (pid, p)) in node.processes.iter().enumerate() {
            let dir = node.proc_root().join(pid.to_string());
            fs::create_dir_all(&dir).expect("proc dir");
            fs::write(dir.join("cgroup"), &p.cgroup).expect("cgroup");
            fs::write(dir.join("mountinfo"), &p.mountinfo).expect("mountinfo");
            fs::write(dir.join("stat"), stat(*pid, 4_000_000 + n as u64)).expect("stat");
        }
        node
    }

    fn proc_root(&self) -> PathBuf {
        self.root.path().join("proc")
    }

    fn containers(&self) -> Containers {
        Containers::in_state_dir(&self.root.path().join("state"))
    }

    fn summary(&self) -> String {
        let listed: usize = self.memory.values().map(HashMap::len).sum();
        let per_gpu = |count: fn(&Kind) -> usize| {
            GPUS * KINDS.iter().map(|k| k.count * count(k)).sum::<usize>()
        };
        format!(
            "node: {GPUS} GPUs, {} containers (accounting files), {listed} GPU processes as NVML \
             lists them: {} holding slots, {} without the shim in gpumem containers ({} found by \
             mounts, {} by cgroup), {} in no gpumem container (one host process on every GPU); \
             mountinfo {} lines per container process, {} for the host process",
            self.files.len(),
            self.helpers.len(),
            per_gpu(|k| k.by_mount + k.by_cgroup),
            per_gpu(|k| k.by_mount),
            per_gpu(|k| k.by_cgroup),
            GPUS * STRANGERS,
            self.mountinfo_lines,
            self.host_mountinfo_lines,
        )
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Their stdin closes with `_release`, after this; kill rather than wait.
        for helper in &mut self.helpers {
            helper.kill().ok();
            helper.wait().ok();
        }
    }
}

/// Deterministic hex identifiers.
struct Ids(u64);

impl Ids {
    fn next(&mut self) -> u64 {
        self.0 += 1;
        hex(self.0)
    }

    /// A pod UID, 8-4-4-4-12.
    fn pod(&mut self) -> String {
        let (a, b) = (self.next(), self.next());
        format!(
            "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
            a >> 32,
            (a >> 16) & 0xffff,
            a & 0xfff,
            b >> 48,
            b & 0xffff_ffff_ffff
        )
    }

    /// A container or sandbox ID, 64 hex digits.
    fn container(&mut self) -> String {
        (0..4).map(|_| format!("{:016x}", self.next())).collect()
    }
}

/// splitmix64.
fn hex(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A container's `/proc/<pid>/cgroup`: cgroup v2 with the systemd driver,
/// or (`v1`) cgroup v1 with the cgroupfs driver, a line per hierarchy.
fn cgroup(pod: &str, id: &str, v1: bool) -> String {
    if v1 {
        let path = format!("/kubepods/burstable/pod{pod}/{id}");
        let hierarchies = [
            "hugetlb",
            "cpu,cpuacct",
            "devices",
            "freezer",
            "memory",
            "net_cls,net_prio",
            "perf_event",
            "blkio",
            "cpuset",
            "pids",
            "misc",
        ];
        let mut text = String::new();
        for (n, h) in hierarchies.iter().enumerate() {
            text += &format!("{}:{h}:{path}\n", 12 - n);
        }
        text += &format!("1:name=systemd:{path}\n0::/\n");
        return text;
    }
    let underscored = pod.replace('-', "_");
    format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{underscored}.slice/\
         cri-containerd-{id}.scope\n"
    )
}

/// The cgroup of a container docker runs inside the container in `outer`.
fn nested(outer: &str, id: &str) -> String {
    outer
        .lines()
        .map(|line| match line.strip_suffix(":/") {
            Some(_) => format!("{line}\n"),
            None => format!("{line}/docker/{id}\n"),
        })
        .collect()
}

/// A containerd container's mount table on a GPU node with the NVIDIA
/// runtime; with `state`, the mounts gpumem's Allocate adds.
fn container_mountinfo(ids: &mut Ids, pod: &str, state: Option<&Path>) -> String {
    let snapshots = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots";
    let layers: Vec<String> = (0..9)
        .map(|_| format!("{snapshots}/{}/fs", ids.next() % 90_000))
        .collect();
    let upper = ids.next() % 90_000;
    let sandbox = ids.container();
    let cri = "/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes";
    let ext4 = "ext4 /dev/nvme0n1p1 rw,discard,errors=remount-ro";
    let driver = "580.95.05";
    let mut lines = vec![
        format!("/ / rw,relatime master:412 - overlay overlay rw,lowerdir={},upperdir={snapshots}/{upper}/fs,workdir={snapshots}/{upper}/work", layers.join(":")),
        "/ /proc rw,nosuid,nodev,noexec,relatime - proc proc rw".into(),
        "/ /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755,inode64".into(),
        "/ /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666".into(),
        "/ /dev/mqueue rw,nosuid,nodev,noexec,relatime - mqueue mqueue rw".into(),
        "/ /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro".into(),
        "/ /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw,nsdelegate,memory_recursiveprot".into(),
        format!("/var/lib/kubelet/pods/{pod}/etc-hosts /etc/hosts rw,relatime - {ext4}"),
        format!("/var/lib/kubelet/pods/{pod}/containers/main/{:08x} /dev/termination-log rw,relatime - {ext4}", ids.next() >> 32),
        format!("{cri}/{sandbox}/hostname /etc/hostname rw,relatime - {ext4}"),
        format!("{cri}/{sandbox}/resolv.conf /etc/resolv.conf rw,relatime - {ext4}"),
        format!("/ /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k,inode64"),
    ];
    if let Some(state) = state {
        lines.push(format!(
            "{} /var/run/gpumem rw,relatime - {ext4}",
            state.display()
        ));
        lines.push(format!(
            "/usr/local/gpumem/ld.so.preload /etc/ld.so.preload ro,relatime - {ext4}"
        ));
        lines.push(format!("/usr/local/gpumem/libgpumem_shim.so /usr/local/gpumem/libgpumem_shim.so ro,relatime - {ext4}"));
    }
    lines.push("/ /var/run/secrets/kubernetes.io/serviceaccount ro,relatime - tmpfs tmpfs rw,size=1048576k,inode64".into());
    for bin in [
        "nvidia-smi",
        "nvidia-debugdump",
        "nvidia-persistenced",
        "nvidia-cuda-mps-control",
        "nvidia-cuda-mps-server",
    ] {
        lines.push(format!(
            "/usr/bin/{bin} /usr/bin/{bin} ro,nosuid,nodev,relatime - {ext4}"
        ));
    }
    for lib in [
        "libnvidia-ml",
        "libcuda",
        "libcudadebugger",
        "libnvidia-ptxjitcompiler",
        "libnvidia-nvvm",
    ] {
        let path = format!("/usr/lib/x86_64-linux-gnu/{lib}.so.{driver}");
        lines.push(format!("{path} {path} ro,nosuid,nodev,relatime - {ext4}"));
    }
    lines.push("/nvidia-persistenced/socket /run/nvidia-persistenced/socket rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,size=52828996k,mode=755,inode64".into());
    for dev in ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0"] {
        lines.push(format!("/{dev} /dev/{dev} ro,nosuid,noexec,relatime - devtmpfs udev rw,size=264116388k,nr_inodes=66029097,mode=755,inode64"));
    }
    lines.push("/driver/nvidia/gpus/0000:18:00.0 /proc/driver/nvidia/gpus/0000:18:00.0 ro,nosuid,nodev,noexec,relatime - proc proc rw".into());
    for masked in ["bus", "fs", "irq", "sys", "sysrq-trigger"] {
        lines.push(format!(
            "/{masked} /proc/{masked} ro,nosuid,nodev,noexec,relatime - proc proc rw"
        ));
    }
    for masked in ["acpi", "kcore", "keys", "timer_list", "scsi"] {
        lines.push(format!(
            "/ /proc/{masked} ro,relatime - tmpfs tmpfs ro,inode64"
        ));
    }
    lines.push("/ /sys/firmware ro,relatime - tmpfs tmpfs ro,inode64".into());
    number(lines, ids)
}

/// A container run by docker inside a pod's container.
fn docker_mountinfo(ids: &mut Ids) -> String {
    let overlay = format!("/var/lib/docker/overlay2/{}", ids.container());
    let id = ids.container();
    let lines = vec![
        format!("/ / rw,relatime - overlay overlay rw,lowerdir={overlay}-init/diff:{overlay}/diff,upperdir={overlay}/diff,workdir={overlay}/work"),
        "/ /proc rw,nosuid,nodev,noexec,relatime - proc proc rw".into(),
        "/ /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755,inode64".into(),
        "/ /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666".into(),
        "/ /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro".into(),
        "/ /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw".into(),
        "/ /dev/mqueue rw,nosuid,nodev,noexec,relatime - mqueue mqueue rw".into(),
        "/ /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k,inode64".into(),
        format!("/var/lib/docker/containers/{id}/resolv.conf /etc/resolv.conf rw,relatime - overlay overlay rw"),
        format!("/var/lib/docker/containers/{id}/hostname /etc/hostname rw,relatime - overlay overlay rw"),
        format!("/var/lib/docker/containers/{id}/hosts /etc/hosts rw,relatime - overlay overlay rw"),
        "/nvidia0 /dev/nvidia0 ro,nosuid,noexec,relatime - devtmpfs udev rw,mode=755".into(),
        "/nvidiactl /dev/nvidiactl ro,nosuid,noexec,relatime - devtmpfs udev rw,mode=755".into(),
        "/nvidia-uvm /dev/nvidia-uvm ro,nosuid,noexec,relatime - devtmpfs udev rw,mode=755".into(),
    ];
    number(lines, ids)
}

/// The host's mount table: the system's mounts, then for each pod its
/// sandbox and container root file systems, its shm and its token volume.
fn host_mountinfo(ids: &mut Ids, pods: usize) -> String {
    let mut lines: Vec<String> = [
        "/ / rw,relatime - ext4 /dev/nvme0n1p1 rw,discard,errors=remount-ro",
        "/ /dev rw,nosuid,relatime - devtmpfs udev rw,size=264116388k,nr_inodes=66029097,mode=755,inode64",
        "/ /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=000",
        "/ /run rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,size=52828996k,mode=755,inode64",
        "/ /sys rw,nosuid,nodev,noexec,relatime - sysfs sysfs rw",
        "/ /proc rw,nosuid,nodev,noexec,relatime - proc proc rw",
        "/ /sys/kernel/security rw,nosuid,nodev,noexec,relatime - securityfs securityfs rw",
        "/ /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,inode64",
        "/ /run/lock rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,size=5120k,inode64",
        "/ /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot",
        "/ /sys/fs/pstore rw,nosuid,nodev,noexec,relatime - pstore pstore rw",
        "/ /sys/firmware/efi/efivars rw,nosuid,nodev,noexec,relatime - efivarfs efivarfs rw",
        "/ /sys/fs/bpf rw,nosuid,nodev,noexec,relatime - bpf bpf rw,mode=700",
        "/ /proc/sys/fs/binfmt_misc rw,relatime - autofs systemd-1 rw,fd=29,pgrp=1,timeout=0,minproto=5,maxproto=5,direct",
        "/ /dev/hugepages rw,relatime - hugetlbfs hugetlbfs rw,pagesize=2M",
        "/ /dev/mqueue rw,nosuid,nodev,noexec,relatime - mqueue mqueue rw",
        "/ /sys/kernel/debug rw,nosuid,nodev,noexec,relatime - debugfs debugfs rw",
        "/ /sys/kernel/tracing rw,nosuid,nodev,noexec,relatime - tracefs tracefs rw",
        "/ /sys/fs/fuse/connections rw,nosuid,nodev,noexec,relatime - fusectl fusectl rw",
        "/ /sys/kernel/config rw,nosuid,nodev,noexec,relatime - configfs configfs rw",
        "/ /boot/efi rw,relatime - vfat /dev/nvme0n1p15 rw,fmask=0077,dmask=0077",
        "/ /run/user/0 rw,nosuid,nodev,relatime - tmpfs tmpfs rw,size=52828992k,mode=700,inode64",
        "/ /var/lib/containerd rw,relatime - xfs /dev/md0 rw,attr2,inode64,logbufs=8,logbsize=32k,noquota",
        "/ /var/lib/kubelet rw,relatime - xfs /dev/md0 rw,attr2,inode64,logbufs=8,logbsize=32k,noquota",
        "/ /run/nvidia-persistenced rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,inode64",
    ]
    .map(str::to_owned)
    .to_vec();
    let run = "/run/containerd/io.containerd.runtime.v2.task/k8s.io";
    let snapshots = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots";
    for _ in 0..pods {
        let (sandbox, container, pod) = (ids.container(), ids.container(), ids.pod());
        for id in [&sandbox, &container] {
            let n = ids.next() % 90_000;
            lines.push(format!("/ {run}/{id}/rootfs rw,relatime - overlay overlay rw,lowerdir={snapshots}/{}/fs,upperdir={snapshots}/{n}/fs,workdir={snapshots}/{n}/work", n - 1));
        }
        lines.push(format!("/ /run/containerd/io.containerd.grpc.v1.cri/sandboxes/{sandbox}/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k,inode64"));
        lines.push(format!("/ /var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~projected/kube-api-access-{:05x} rw,relatime - tmpfs tmpfs rw,size=1048576k,inode64", ids.next() >> 44));
    }
    number(lines, ids)
}

/// A `/proc/<pid>/stat` line of a process started `start` ticks after boot.
fn stat(pid: u32, start: u64) -> String {
    format!(
        "{pid} (python3) S 1 {pid} {pid} 0 -1 4194560 183424 0 12 0 5120 1733 0 0 20 0 42 0 \
         {start} 24120889344 1302528 18446744073709551615 94557102436352 94557102440481 \
         140727594101184 0 0 0 0 16781312 16386 0 0 0 17 7 0 0 0 0 0\n"
    )
}

/// Mount IDs, parent IDs and device numbers in front of each line.
fn number(lines: Vec<String>, ids: &mut Ids) -> String {
    let first = 1000 + ids.next() % 5000;
    let mut text = String::new();
    for (n, line) in lines.iter().enumerate() {
        let id = first + n as u64;
        let parent = if n == 0 { first - 37 } else { first };
        text += &format!("{id} {parent} 0:{} {line}\n", 100 + n);
    }
    text
}
