//! Untracked usage: what the driver holds for a container's processes
//! beyond what the shim charged — modules loaded lazily at the first kernel
//! launch (about 90 MiB for PyTorch on an H100), library workspaces,
//! memory-pool reserves, and contexts where the shim could not measure them. Every few seconds the daemon compares NVML's per-process usage
//! with each process's charges and publishes the excess in the container's
//! accounting file; the shim adds it to every check and to what nvidia-smi
//! shows, so a container is held to its whole footprint, not only to its
//! allocations.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::isolation::accounting::{self, Processes};
use crate::isolation::identity::{self, Owner};
use crate::isolation::enforce::{
    self, Actions, Enforcer, Footprint, Notice, Noticed, Notices, OverCapAction,
};
use crate::node::gpu::ProcessMemory;
use crate::node::processes::ProcessUsage;
use crate::sync::LockExt;

/// The live processes of a file that NVML lists on its device `dev`, as
/// (pid, what NVML shows, what the process charged), less those in
/// `elsewhere` (the shim charges their use of that GPU to another file);
/// `None` when NVML had no answer for that GPU this time.
fn listed<'a>(
    processes: &'a Processes,
    memory: &'a ProcessMemory,
    dev: usize,
    elsewhere: &'a HashSet<u32>,
) -> Option<impl Iterator<Item = (u32, u64, u64)> + 'a> {
    let on_gpu = memory.get(&processes.devices.get(dev)?.uuid)?;
    // A process is listed once, with what all its slots charged: one that
    // took two slots (not through the shim, which takes one) is still one
    // process of the container, and NVML's figure is its whole.
    let mut slots: BTreeMap<u32, (u64, bool)> = BTreeMap::new();
    for p in &processes.live {
        let Some(pid) = p.pid.filter(|pid| !elsewhere.contains(pid)) else {
            continue;
        };
        let slot = slots.entry(pid).or_default();
        slot.0 = slot.0.saturating_add(p.used.get(dev).copied().unwrap_or(0));
        slot.1 |= p.creating & (1 << dev) != 0;
    }
    Some(
        slots
            .into_iter()
            .filter_map(move |(pid, (charged, making))| {
                let actual = *on_gpu.get(&pid)?;
                // Making a context, which the driver took and the shim is about to
                // charge: nothing of it is untracked.
                Some((
                    pid,
                    actual,
                    if making { charged.max(actual) } else { charged },
                ))
            }),
    )
}

/// Untracked bytes per device of one accounting file: for every live
/// process the GPU lists, what it uses beyond what it charged. Per process,
/// so one process charging more than it uses (managed memory not yet on
/// the device) cannot hide another's context. `None` for a GPU with no
/// answer this time. `elsewhere`: per device, the processes whose use of
/// it another file is charged (see [`charged_elsewhere`]).
fn untracked(
    processes: &Processes,
    memory: &ProcessMemory,
    elsewhere: &[HashSet<u32>],
) -> Vec<Option<u64>> {
    (0..processes.devices.len())
        .map(|dev| {
            let excess = listed(processes, memory, dev, &elsewhere[dev])?
                .map(|(_, actual, charged)| actual.saturating_sub(charged))
                .fold(0, u64::saturating_add);
            Some(excess)
        })
        .collect()
}

/// GPU memory held by processes in no gpumem container (host daemons, pods
/// that reached a GPU without asking for it), per GPU UUID. Shared with the
/// metrics endpoint.
pub type Unmanaged = Arc<Mutex<HashMap<String, u64>>>;

/// Whose each process NVML listed at the last tick is. Shared with the
/// metrics endpoint, which pairs it with NVML's per-process SM samples:
/// only attribution from outside can give each pod its share of a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Whose {
    /// By accounting directory name, then GPU UUID: the container's
    /// processes there, slot holders and processes without the shim alike.
    pub containers: HashMap<String, HashMap<String, Vec<u32>>>,
    /// Processes in no gpumem container.
    pub strangers: Vec<Stranger>,
}

/// A process holding GPU memory outside every gpumem container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stranger {
    pub gpu_uuid: String,
    pub pid: u32,
    pub bytes: u64,
    /// Its pod and container, where its cgroup names them.
    pub owner: Option<Owner>,
}

/// [`Whose`], kept current by [`Reconciler::tick`].
pub type Attribution = Arc<Mutex<Whose>>;

/// Slot holders of the last tick by PID and start time, with since when
/// each one that let go of its slot has been exiting.
type LastHolders = HashMap<(u32, u64), Option<std::time::Instant>>;

/// How long a slot holder on its way out is passed over: the driver's part
/// of an exit takes seconds at most, and a process that stays in its exit
/// (a thread stuck in the driver) must not hide longer.
const LEAVING_AT_MOST: Duration = Duration::from_secs(10);

/// Where the processes NVML lists belong, beyond the slot holders.
#[derive(Debug, Default, PartialEq, Eq)]
struct Attributed {
    /// Per file and device: the processes of that container that hold no
    /// slot (they did not load the shim), with what they use there.
    unslotted: Vec<Vec<Vec<(u32, u64)>>>,
    /// Per GPU UUID: what processes in no gpumem container use.
    unmanaged: HashMap<String, u64>,
    /// Those processes: GPU UUID, PID, bytes, and their pod if any.
    strangers: Vec<(String, u32, u64, Option<Owner>)>,
    /// Slot holders on their way out, by PID and start time: passed over,
    /// and again at the next sample while they still are.
    leaving: Vec<(u32, u64)>,
    /// Processes found by their cgroup whose mount table, read, lacks
    /// their container's directory: file index, GPU UUID, PID, bytes.
    unmounted: Vec<(usize, String, u32, u64)>,
}

/// Which pods the accounting directories now granted on the node belong
/// to, as a record no container can write says: kubelet's device
/// checkpoint, or the DRA driver's. A directory it does not name was
/// granted to no pod now (its pod ended): it vouches for no process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodGrants {
    /// By pod UID, the names of its gpumem containers' directories.
    pub by_pod: HashMap<String, Vec<String>>,
    /// Directories granted to pods the record does not name (a claim
    /// prepared by a version that did not record them): any pod's.
    pub any_pod: HashSet<String>,
}

impl PodGrants {
    /// Whether directory `name` is granted to pod `pod` (a DRA claim may
    /// be several pods').
    fn vouches(&self, name: &str, pod: &str) -> bool {
        let has = |dirs: &Vec<String>| dirs.iter().any(|d| d == name);
        self.by_pod.get(pod).is_some_and(has) || self.any_pod.contains(name)
    }
}

/// The [`PodGrants`] of the node now; `None` where they cannot be read.
pub type PodDirs = Box<dyn Fn() -> Option<PodGrants> + Send>;

/// [`PodDirs`], read at most once per tick and only where a process needs
/// it: most ticks find every process in a slot.
struct Pods<'a> {
    read: Option<&'a PodDirs>,
    grants: Option<Option<PodGrants>>,
}

impl<'a> Pods<'a> {
    fn new(read: Option<&'a PodDirs>) -> Self {
        Pods { read, grants: None }
    }

    fn get(&mut self) -> Option<&PodGrants> {
        let read = self.read;
        self.grants
            .get_or_insert_with(|| read.and_then(|read| read()))
            .as_ref()
    }

    /// Whether directory `name` is known not to be `pod`'s: another pod's,
    /// or no pod's now.
    fn not_pods(&mut self, name: &str, pod: &str) -> bool {
        self.get().is_some_and(|grants| !grants.vouches(name, pod))
    }
}

/// Attributes every process NVML lists on a GPU: a slot holder in a file
/// that caps the GPU is that file's already; another process whose mount
/// table has a container's state directory, or that shares a slot holder's
/// container ID (cgroup), counts against the first of that container's
/// files that caps the GPU (the shim's own choice for a GPU two of them
/// cap); one whose cgroup names a pod with one gpumem container that caps
/// the GPU (`pods`) is that container's, whatever its mounts say: a process
/// that made its own mount namespace sheds the mounts, never the cgroup.
/// Anything else is unmanaged. `who` reads what `/proc` says of them.
fn attribute(
    loaded: &[(PathBuf, Processes)],
    held: &HashMap<u32, Vec<usize>>,
    last_holders: &LastHolders,
    memory: &ProcessMemory,
    who: &mut identity::Sweep<'_>,
    pods: &mut Pods<'_>,
) -> Attributed {
    let by_dir: HashMap<&std::ffi::OsStr, usize> = loaded
        .iter()
        .enumerate()
        .filter_map(|(index, (file, _))| Some((file.parent()?.file_name()?, index)))
        .collect();
    let dir_name = |index: usize| loaded[index].0.parent()?.file_name()?.to_str();
    // The slot holders' cgroups are read only once a process's mounts did
    // not name its container.
    let mut containers: Option<HashMap<String, Vec<usize>>> = None;
    let mut attributed = Attributed {
        unslotted: loaded
            .iter()
            .map(|(_, p)| vec![Vec::new(); p.devices.len()])
            .collect(),
        ..Attributed::default()
    };
    for (uuid, per_pid) in memory {
        // The file `index` with its position of this GPU, if it caps it.
        let capping = |index: usize| Some((index, position(&loaded[index].1, uuid)?));
        let unmanaged = attributed.unmanaged.entry(uuid.clone()).or_default();
        for (&pid, &bytes) in per_pid {
            let files = held.get(&pid).map_or(&[][..], Vec::as_slice);
            if files.iter().any(|&index| capping(index).is_some()) {
                continue;
            }
            // A slot holder of the last tick on its way out, its memory
            // about to go: neither its container's whole (its unreaped
            // slot still counts it) nor a stranger. Only one that held a
            // slot, all of whose threads are exiting (a leader that exited
            // alone is a zombie while the rest runs on), for at most
            // `LEAVING_AT_MOST`.
            if let Some(start) = who
                .exiting(pid)
                .filter(|&start| last_holders.contains_key(&(pid, start)))
            {
                attributed.leaving.push((pid, start));
                continue;
            }
            let mounted: Vec<usize> = who
                .mounted(pid)
                .iter()
                .filter_map(|name| by_dir.get(std::ffi::OsStr::new(name)).copied())
                .collect();
            // The cgroup is read where the mounts did not say, and where
            // the pods' containers are known to check what they say: a
            // mount's name is the container's word, and a tenant in a user
            // namespace of its own can mount a neighbour's name.
            let owner =
                if mounted.iter().any(|&index| capping(index).is_some()) && pods.get().is_none() {
                    None
                } else {
                    who.owner(pid)
                };
            let mut home = None;
            for &index in &mounted {
                let mut foreign = || {
                    owner.as_ref().is_some_and(|owner| {
                        dir_name(index).is_some_and(|name| pods.not_pods(name, &owner.pod_uid))
                    })
                };
                home = capping(index).filter(|_| !foreign());
                if home.is_some() {
                    break;
                }
            }
            // Mounted elsewhere (an image whose `/var/run` links elsewhere):
            // the container's where kubelet gave the directory to its pod.
            let elsewhere = home.is_none().then(|| {
                let owner = owner.as_ref()?;
                let grants = pods.get()?;
                who.mounted_elsewhere(pid)
                    .iter()
                    .filter(|name| grants.vouches(name, &owner.pod_uid))
                    .filter_map(|name| by_dir.get(std::ffi::OsStr::new(name)).copied())
                    .find_map(capping)
            });
            let elsewhere = elsewhere.flatten();
            let home = home
                .or(elsewhere)
                .or_else(|| {
                    let id = owner.as_ref()?.container_id.as_ref()?;
                    containers
                        .get_or_insert_with(|| holder_containers(loaded, who))
                        .get(id)?
                        .iter()
                        .find_map(|&index| capping(index))
                })
                .or_else(|| {
                    // The pod's one container that caps this GPU, less
                    // those whose slot holders run in another container.
                    let owner = owner.as_ref()?;
                    let dirs = pods.get()?.by_pod.get(&owner.pod_uid)?;
                    let holders = containers.get_or_insert_with(|| holder_containers(loaded, who));
                    let others = |index: usize| {
                        holders.iter().any(|(id, files)| {
                            files.contains(&index) && owner.container_id.as_ref() != Some(id)
                        })
                    };
                    let mut candidates = dirs
                        .iter()
                        .filter_map(|name| by_dir.get(std::ffi::OsStr::new(name)).copied())
                        .filter(|&index| !others(index))
                        .filter_map(capping);
                    let only = candidates.next()?;
                    candidates.next().is_none().then_some(only)
                });
            match home {
                Some((index, dev)) => {
                    attributed.unslotted[index][dev].push((pid, bytes));
                    let found_mounted = mounted.contains(&index) || elsewhere.is_some();
                    if !found_mounted && who.mounts_read(pid) {
                        let unmounted = (index, uuid.clone(), pid, bytes);
                        attributed.unmounted.push(unmounted);
                    }
                }
                None => {
                    *unmanaged = unmanaged.saturating_add(bytes);
                    let owner = owner.or_else(|| who.owner(pid));
                    attributed.strangers.push((uuid.clone(), pid, bytes, owner));
                }
            }
        }
    }
    attributed
}

/// Where file `processes` records GPU `uuid`, if it caps it.
fn position(processes: &Processes, uuid: &str) -> Option<usize> {
    processes.devices.iter().position(|d| d.uuid == uuid)
}

/// The files each live slot holder has a slot in, each once: a process
/// holding two slots of one file is in that file, not in another one.
fn holders(loaded: &[(PathBuf, Processes)]) -> HashMap<u32, Vec<usize>> {
    let mut held: HashMap<u32, Vec<usize>> = HashMap::new();
    for (index, (_, processes)) in loaded.iter().enumerate() {
        for pid in processes.live.iter().filter_map(|p| p.pid) {
            let files = held.entry(pid).or_default();
            if files.last() != Some(&index) {
                files.push(index);
            }
        }
    }
    held
}

/// Where an accounting file comes in the shim's order within a container:
/// the state directory's own (Allocate's) first, then claims' by name.
fn shim_order(file: &Path) -> (bool, Option<&std::ffi::OsStr>) {
    let name = file.parent().and_then(Path::file_name);
    let claim = name
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with(gpumem_layout::CLAIM_DIR_PREFIX));
    (claim, name)
}

/// Per file and device: the slot holders whose use of that GPU the shim
/// charges to another of their files, the first in its order that caps it
/// (a GPU two of a container's claims cap). Their usage there is that
/// file's, not this one's: counting it here too would count it twice, and
/// hold it to the wrong cap. The order is the process's mount table's
/// where it names the files (a claim mounted before claims had their own
/// place is at the state path itself, and comes first), else the names'.
fn charged_elsewhere(
    loaded: &[(PathBuf, Processes)],
    held: &HashMap<u32, Vec<usize>>,
    who: &mut identity::Sweep<'_>,
) -> Vec<Vec<HashSet<u32>>> {
    let mut elsewhere: Vec<Vec<HashSet<u32>>> = loaded
        .iter()
        .map(|(_, p)| vec![HashSet::new(); p.devices.len()])
        .collect();
    // Whether a file before the `k`th of `files` caps GPU `uuid`.
    let before = |files: &[usize], k: usize, uuid: &str| {
        files[..k]
            .iter()
            .any(|&e| position(&loaded[e].1, uuid).is_some())
    };
    for (&pid, files) in held {
        let shared = files.iter().enumerate().any(|(k, &index)| {
            let devices = &loaded[index].1.devices;
            devices.iter().any(|d| before(files, k, &d.uuid))
        });
        // Mounts are read only for the rare process this concerns.
        if !shared {
            continue;
        }
        let mounted = who.mounted(pid).to_vec();
        let rank = |index: usize| {
            let file = &loaded[index].0;
            let name = file.parent().and_then(Path::file_name);
            let at = mounted
                .iter()
                .position(|m| Some(std::ffi::OsStr::new(m)) == name);
            (at.is_none(), at, shim_order(file))
        };
        let mut files = files.clone();
        files.sort_by_key(|&index| rank(index));
        for (k, &index) in files.iter().enumerate() {
            for (dev, device) in loaded[index].1.devices.iter().enumerate() {
                if before(&files, k, &device.uuid) {
                    elsewhere[index][dev].insert(pid);
                }
            }
        }
    }
    elsewhere
}

/// The files of each slot holder's container ID, in the shim's order.
fn holder_containers(
    loaded: &[(PathBuf, Processes)],
    who: &mut identity::Sweep<'_>,
) -> HashMap<String, Vec<usize>> {
    let mut containers: HashMap<String, Vec<usize>> = HashMap::new();
    for (index, (file, processes)) in loaded.iter().enumerate() {
        for p in &processes.live {
            let Some(pid) = p.pid else { continue };
            let owner = who.holder_owner(file, pid, p.start_time);
            if let Some(id) = owner.and_then(|o| o.container_id) {
                let files = containers.entry(id).or_default();
                if files.last() != Some(&index) {
                    files.push(index);
                }
            }
        }
    }
    for files in containers.values_mut() {
        files.sort_by_key(|&index| shim_order(&loaded[index].0));
    }
    containers
}

/// Processes remembered per GPU for the overhead estimate.
const FOOTPRINT_PROCESSES: usize = 64;

/// Per GPU UUID, the median memory a recent process held beyond what the
/// shim charged it (its allocations and its measured context): modules
/// loaded lazily, library workspaces, pool reserves, the part only
/// reconciliation catches. Shared with the metrics endpoint.
pub type Overheads = Arc<Mutex<HashMap<String, u64>>>;

/// Each recent process's largest overhead per GPU, oldest first.
#[derive(Default)]
struct Footprints {
    per_gpu: HashMap<String, VecDeque<(u32, u64)>>,
}

impl Footprints {
    fn note(&mut self, uuid: &str, pid: u32, overhead: u64) {
        let recent = self.per_gpu.entry(uuid.to_owned()).or_default();
        // Its largest sample: one taken between a charge and the driver's
        // allocation reads low.
        match recent.iter_mut().find(|(p, _)| *p == pid) {
            Some((_, most)) => *most = (*most).max(overhead),
            None => {
                if recent.len() == FOOTPRINT_PROCESSES {
                    recent.pop_front();
                }
                recent.push_back((pid, overhead));
            }
        }
    }

    fn medians(&self) -> HashMap<String, u64> {
        self.per_gpu
            .iter()
            .filter(|(_, recent)| !recent.is_empty())
            .map(|(uuid, recent)| {
                let mut values: Vec<u64> = recent.iter().map(|&(_, v)| v).collect();
                values.sort_unstable();
                (uuid.clone(), values[values.len() / 2])
            })
            .collect()
    }
}

/// One daemon's reconciliation state.
pub struct Reconciler {
    source: Box<dyn ProcessUsage>,
    /// The previous sample per file and device. An increase is published at
    /// once; a decrease only when two samples in a row agree, because a
    /// sample taken between a charge and the driver's allocation reads low.
    previous: HashMap<(PathBuf, usize), u64>,
    warned_hidden: bool,
    last_error: Option<String>,
    footprints: Footprints,
    overheads: Overheads,
    unmanaged: Unmanaged,
    whose: Attribution,
    /// Unmanaged processes already logged, so each is said once.
    reported: HashSet<(String, u32)>,
    /// Files stood in for by their grant (see `load`) already logged.
    stood_in: HashSet<PathBuf>,
    /// Files and devices whose publish failed, already logged.
    publish_failing: HashSet<(PathBuf, usize)>,
    /// The slot holders of the last tick, by PID and start time, and since
    /// when each that has let go of its slot has been on its way out.
    last_holders: LastHolders,
    /// The over-cap action, where it is on.
    enforcer: Option<Enforcer>,
    /// The cap Allocate gave a container (accounting file, GPU UUID) in
    /// bytes, where the daemon knows it; else the file's cap is used.
    granted: Option<GrantedCap>,
    /// What `/proc` says of the processes NVML lists, kept while they live.
    identities: identity::Identities,
    /// Where over-cap actions and unmanaged processes are told.
    notices: Option<Notices>,
    /// Each pod's containers, where known: attribution by cgroup.
    pods: Option<PodDirs>,
    /// Files whose container had a process without its mounts, already
    /// told: once per container.
    told_unmounted: HashSet<PathBuf>,
}

/// Where the over-cap action learns a container's cap without trusting the
/// file the container can write.
pub type GrantedCap = Box<dyn Fn(&Path, &str) -> Option<u64> + Send>;

impl Reconciler {
    pub fn new(source: Box<dyn ProcessUsage>) -> Self {
        Reconciler {
            source,
            previous: HashMap::new(),
            warned_hidden: false,
            last_error: None,
            footprints: Footprints::default(),
            overheads: Overheads::default(),
            unmanaged: Unmanaged::default(),
            whose: Attribution::default(),
            reported: HashSet::new(),
            stood_in: HashSet::new(),
            publish_failing: HashSet::new(),
            last_holders: LastHolders::new(),
            enforcer: None,
            granted: None,
            identities: identity::Identities::default(),
            notices: None,
            pods: None,
            told_unmounted: HashSet::new(),
        }
    }

    /// Attributes a process to its pod's gpumem container by its cgroup,
    /// and checks what its mounts say against it, with `pods` telling each
    /// pod's containers.
    pub fn with_pod_dirs(mut self, pods: PodDirs) -> Self {
        self.pods = Some(pods);
        self
    }

    /// Takes the over-cap action's caps from `granted`.
    pub fn with_granted_caps(mut self, granted: GrantedCap) -> Self {
        self.granted = Some(granted);
        self
    }

    /// Acts on containers over their cap for `grace` in total within
    /// `enforce::window(grace)`.
    pub fn with_over_cap(mut self, action: OverCapAction, grace: Duration) -> Self {
        self.enforcer = Some(Enforcer::new(action, grace));
        self
    }

    /// Tells `notices` of each over-cap action and each newly seen process
    /// outside every gpumem container.
    pub fn with_notices(mut self, notices: Notices) -> Self {
        self.notices = Some(notices);
        self
    }

    /// Over-cap actions taken, where the action is on.
    pub fn actions(&self) -> Option<Arc<Actions>> {
        self.enforcer.as_ref().map(Enforcer::actions)
    }

    /// Memory per GPU held outside every gpumem container, kept current by
    /// `tick`.
    pub fn unmanaged(&self) -> Unmanaged {
        self.unmanaged.clone()
    }

    /// Whose each GPU process is, kept current by `tick`.
    pub fn attribution(&self) -> Attribution {
        self.whose.clone()
    }

    /// The per-GPU overhead estimate, kept current by `tick`.
    pub fn overheads(&self) -> Overheads {
        self.overheads.clone()
    }

    /// Reconciles every file once. NVML failing leaves the published values
    /// as they are: stale is safer than zero.
    pub fn tick(&mut self, files: &[PathBuf]) {
        // Processes that start after this instant are not the ones NVML
        // lists next: the over-cap action never kills them. Read before
        // asking NVML, so that one started while the files are read is not
        // taken for the process NVML listed under its PID.
        let sampled_at = enforce::uptime_ticks(Path::new("/proc"));
        let memory = match self.source.usage() {
            Ok(memory) => {
                self.last_error = None;
                memory
            }
            Err(err) => {
                let text = crate::error_text::one_line(&err);
                if self.last_error.as_ref() != Some(&text) {
                    warn!(err = %text, "cannot read per-process GPU memory; untracked usage not updated");
                    self.last_error = Some(text);
                }
                return;
            }
        };
        // The files after NVML: a process that claims its slot between
        // the two is a slot holder, not a process without the shim.
        let read = files
            .iter()
            .map(|file| (file, accounting::processes(file)))
            .collect();
        let (loaded, stood_in) = self.load(read, &memory);
        let (attributed, elsewhere) = {
            let mut who = self.identities.sweep(&*self.source);
            let held = holders(&loaded);
            let mut pods = Pods::new(self.pods.as_ref());
            let attributed = attribute(
                &loaded,
                &held,
                &self.last_holders,
                &memory,
                &mut who,
                &mut pods,
            );
            (attributed, charged_elsewhere(&loaded, &held, &mut who))
        };
        let mut holders: LastHolders = loaded
            .iter()
            .flat_map(|(_, processes)| &processes.live)
            .filter_map(|p| Some(((p.pid?, p.start_time), None)))
            .collect();
        for &key in &attributed.leaving {
            let since = self.last_holders.get(&key).copied().flatten();
            let since = since.unwrap_or_else(std::time::Instant::now);
            if since.elapsed() < LEAVING_AT_MOST {
                holders.insert(key, Some(since));
            }
        }
        self.last_holders = holders;
        self.report_unmanaged(&attributed);
        self.report_unmounted(&loaded, &attributed);
        self.publish_whose(&loaded, &memory, &attributed, &elsewhere);
        self.warn_of_stand_ins(&loaded, &stood_in, &attributed);
        self.enforce(&loaded, &memory, &attributed, &elsewhere, sampled_at);
        let mut seen = HashSet::new();
        for ((((file, processes), unslotted), elsewhere), stood_in) in loaded
            .iter()
            .zip(&attributed.unslotted)
            .zip(&elsewhere)
            .zip(&stood_in)
        {
            if stood_in.is_some() {
                // Nothing to publish into, or nothing the shims read right.
                continue;
            }
            self.warn_if_hidden(file, processes);
            self.note_footprints(processes, &memory, elsewhere);
            let samples = untracked(processes, &memory, elsewhere);
            for (dev, sample) in samples.into_iter().enumerate() {
                // Processes of the container that did not load the shim
                // count whole: nothing charged them.
                let shimless = unslotted[dev].iter().map(|&(_, b)| b);
                let Some(sample) = sample.map(|s| shimless.fold(s, u64::saturating_add)) else {
                    continue;
                };
                let key = (file.clone(), dev);
                // After a restart, what is published stands in for the
                // sample before.
                let previous = self
                    .previous
                    .insert(key.clone(), sample)
                    .unwrap_or(processes.devices[dev].untracked_bytes);
                seen.insert(key.clone());
                let publish = sample.max(previous);
                if publish == processes.devices[dev].untracked_bytes {
                    continue;
                }
                match accounting::publish_untracked(file, dev, publish) {
                    Ok(()) => {
                        self.publish_failing.remove(&key);
                        debug!(
                            file = %file.display(),
                            device = %processes.devices[dev].uuid,
                            untracked_mib = publish >> 20,
                            "untracked usage"
                        )
                    }
                    // Said once until it works again: a container process
                    // holding the publishers' lock would say it every tick.
                    Err(err) => {
                        if self.publish_failing.insert(key) {
                            warn!(file = %file.display(), err = %crate::error_text::chain(&err), "cannot publish untracked usage")
                        }
                    }
                }
            }
        }
        self.previous.retain(|key, _| seen.contains(key));
        self.publish_failing.retain(|key| seen.contains(key));
        self.publish_overheads();
    }

    /// Takes each file as read. One that cannot be read, or that does not
    /// cap the GPUs its directory was granted, is replaced by the grant
    /// with no slot holders: the file is mounted writable, and a container
    /// process that removed or rewrote it must not leave its container
    /// unseen. Its processes are then found by their mounts, counted whole
    /// and held to the granted cap. Beside each file, why it was stood in
    /// for.
    fn load(
        &self,
        read: Vec<(&PathBuf, std::io::Result<Processes>)>,
        memory: &ProcessMemory,
    ) -> (Vec<(PathBuf, Processes)>, Vec<Option<String>>) {
        let mut loaded = Vec::new();
        let mut stood_in = Vec::new();
        for (file, read) in read {
            let (processes, why) = match read {
                Ok(processes) => {
                    let replaced = self
                        .ungranted(file, &processes, memory)
                        .and_then(|why| Some((self.grant(file, memory)?, Some(why))));
                    replaced.unwrap_or((processes, None))
                }
                Err(err) => match self.grant(file, memory) {
                    Some(grant) => (grant, Some(crate::error_text::one_line(&err))),
                    // No grant known (a directory being removed, a file of
                    // `gpumem exec`): removed meanwhile, or being replaced.
                    None => {
                        debug!(file = %file.display(), err = %crate::error_text::chain(&err), "skipping accounting file");
                        continue;
                    }
                },
            };
            loaded.push((file.clone(), processes));
            stood_in.push(why);
        }
        (loaded, stood_in)
    }

    /// How the GPUs the file caps differ from those its directory was
    /// granted, among those this sample lists: one it caps but was not
    /// granted, or one it was granted but leaves out (a container process
    /// can rewrite the device count in place). `None` where they agree, or
    /// where no grant is known.
    fn ungranted(
        &self,
        file: &Path,
        processes: &Processes,
        memory: &ProcessMemory,
    ) -> Option<String> {
        let granted = self.granted.as_ref()?;
        let granted_here: Vec<&String> = memory
            .keys()
            .filter(|uuid| granted(file, uuid).is_some())
            .collect();
        if granted_here.is_empty() {
            return None;
        }
        if let Some(stray) = processes
            .devices
            .iter()
            .find(|d| granted(file, &d.uuid).is_none())
        {
            return Some(format!(
                "it caps {}, which its directory was not granted",
                stray.uuid
            ));
        }
        granted_here
            .into_iter()
            .find(|uuid| position(processes, uuid).is_none())
            .map(|uuid| format!("it leaves out {uuid}, which its directory was granted"))
    }

    /// The GPUs and caps `file`'s directory was granted, among those this
    /// sample lists, with no slot holders.
    fn grant(&self, file: &Path, memory: &ProcessMemory) -> Option<Processes> {
        let granted = self.granted.as_ref()?;
        let mut devices: Vec<accounting::Usage> = memory
            .keys()
            .filter_map(|uuid| {
                Some(accounting::Usage {
                    uuid: uuid.clone(),
                    cap_bytes: granted(file, uuid)?,
                    context_charge_bytes: 0,
                    used_bytes: 0,
                    untracked_bytes: 0,
                    peak_bytes: 0,
                    refusals: 0,
                })
            })
            .collect();
        devices.sort_by(|a, b| a.uuid.cmp(&b.uuid));
        (!devices.is_empty()).then_some(Processes {
            devices,
            live: Vec::new(),
        })
    }

    /// Says once, per file, that a container runs without a file the shim
    /// can use: only where processes of it were found, so a directory made
    /// a moment before its file, or one being removed, is not mistaken.
    fn warn_of_stand_ins(
        &mut self,
        loaded: &[(PathBuf, Processes)],
        stood_in: &[Option<String>],
        attributed: &Attributed,
    ) {
        // Said once for as long as the file is stood in for.
        let still: HashSet<&PathBuf> = loaded
            .iter()
            .zip(stood_in)
            .filter(|(_, why)| why.is_some())
            .map(|((file, _), _)| file)
            .collect();
        self.stood_in.retain(|file| still.contains(file));
        for (((file, _), why), unslotted) in loaded.iter().zip(stood_in).zip(&attributed.unslotted)
        {
            let (Some(why), true) = (why, unslotted.iter().any(|dev| !dev.is_empty())) else {
                continue;
            };
            if self.stood_in.insert(file.clone()) {
                warn!(
                    file = %file.display(),
                    reason = %why,
                    "a container runs without a usable accounting file (a process of it may have \
                     removed or rewritten it): its shims do not cap it; its processes are counted \
                     whole against the cap its directory was granted"
                );
            }
        }
    }

    /// Each container's footprint on each GPU as NVML counts it: its slot
    /// holders and its processes without the shim.
    fn enforce(
        &mut self,
        loaded: &[(PathBuf, Processes)],
        memory: &ProcessMemory,
        attributed: &Attributed,
        elsewhere: &[Vec<HashSet<u32>>],
        sampled_at: Option<u64>,
    ) {
        let Some(enforcer) = self.enforcer.as_mut() else {
            return;
        };
        let mut footprints = Vec::new();
        let files = loaded.iter().zip(&attributed.unslotted).zip(elsewhere);
        for (((file, processes), unslotted), elsewhere) in files {
            for (dev, device) in processes.devices.iter().enumerate() {
                let Some(listed) = listed(processes, memory, dev, &elsewhere[dev]) else {
                    continue;
                };
                let mut members: Vec<(u32, u64)> =
                    listed.map(|(pid, actual, _)| (pid, actual)).collect();
                members.extend(&unslotted[dev]);
                let granted = self.granted.as_ref().and_then(|g| g(file, &device.uuid));
                footprints.push(Footprint {
                    file,
                    gpu: &device.uuid,
                    cap: granted.unwrap_or(device.cap_bytes),
                    processes: members,
                });
            }
        }
        enforcer.check(&footprints, sampled_at, self.notices.as_ref());
    }

    /// Keeps the per-GPU unmanaged figures current and logs each process
    /// that holds GPU memory outside every gpumem container, once.
    fn report_unmanaged(&mut self, attributed: &Attributed) {
        let mut present = HashSet::new();
        for (uuid, pid, bytes, owner) in &attributed.strangers {
            let key = (uuid.clone(), *pid);
            if !self.reported.contains(&key) {
                let (pod_uid, container_id) = owner.as_ref().map_or(("", ""), |o| {
                    (o.pod_uid.as_str(), o.container_id.as_deref().unwrap_or(""))
                });
                warn!(
                    gpu = %uuid,
                    pid,
                    used_mib = bytes >> 20,
                    pod_uid,
                    container_id,
                    "GPU memory held outside every gpumem container (a host process, or a pod \
                     that reached the GPU without asking for it)"
                );
                if let Some(notices) = &self.notices {
                    let _ = notices.send(Notice {
                        gpu: uuid.clone(),
                        what: Noticed::Unmanaged {
                            pid: *pid,
                            used_mib: bytes >> 20,
                            pod_uid: owner.as_ref().map(|o| o.pod_uid.clone()),
                        },
                    });
                }
            }
            present.insert(key);
        }
        self.reported = present;
        *self.unmanaged.lock_unpoisoned() = attributed.unmanaged.clone();
    }

    /// Logs, and tells `notices`, once per container, that one of its
    /// processes is on a GPU without the container's mounts: the runtime
    /// did not apply Allocate's answer (a `cdi` strategy on a runtime
    /// without CDI), or the process left them. Either way no shim caps it.
    fn report_unmounted(&mut self, loaded: &[(PathBuf, Processes)], attributed: &Attributed) {
        self.told_unmounted
            .retain(|file| loaded.iter().any(|(f, _)| f == file));
        for (index, uuid, pid, bytes) in &attributed.unmounted {
            let file = &loaded[*index].0;
            if !self.told_unmounted.insert(file.clone()) {
                continue;
            }
            warn!(
                file = %file.display(),
                gpu = %uuid,
                pid,
                used_mib = bytes >> 20,
                "a gpumem container's process is on the GPU without the container's mounts, so \
                 without the shim: held to its cap from outside only (the runtime did not apply \
                 Allocate's answer, the process left its mount namespace, or it runs in a \
                 container nested in the container)"
            );
            if let Some(notices) = &self.notices {
                let _ = notices.send(Notice {
                    gpu: uuid.clone(),
                    what: Noticed::NotIsolated {
                        file: file.clone(),
                        pid: *pid,
                        used_mib: bytes >> 20,
                    },
                });
            }
        }
    }

    /// Publishes whose each listed process is, for the metrics endpoint.
    fn publish_whose(
        &self,
        loaded: &[(PathBuf, Processes)],
        memory: &ProcessMemory,
        attributed: &Attributed,
        elsewhere: &[Vec<HashSet<u32>>],
    ) {
        let mut whose = Whose {
            strangers: attributed
                .strangers
                .iter()
                .map(|(uuid, pid, bytes, owner)| Stranger {
                    gpu_uuid: uuid.clone(),
                    pid: *pid,
                    bytes: *bytes,
                    owner: owner.clone(),
                })
                .collect(),
            ..Whose::default()
        };
        for (((file, processes), unslotted), elsewhere) in
            loaded.iter().zip(&attributed.unslotted).zip(elsewhere)
        {
            let Some(name) = file.parent().and_then(Path::file_name) else {
                continue;
            };
            let per_gpu = whose
                .containers
                .entry(name.to_string_lossy().into_owned())
                .or_default();
            for (dev, device) in processes.devices.iter().enumerate() {
                let pids = per_gpu.entry(device.uuid.clone()).or_default();
                let holders = listed(processes, memory, dev, &elsewhere[dev]);
                pids.extend(holders.into_iter().flatten().map(|(pid, _, _)| pid));
                pids.extend(unslotted[dev].iter().map(|&(pid, _)| pid));
            }
        }
        *self.whose.lock_unpoisoned() = whose;
    }

    /// Remembers what each live process holds beyond what it was charged.
    fn note_footprints(
        &mut self,
        processes: &Processes,
        memory: &ProcessMemory,
        elsewhere: &[HashSet<u32>],
    ) {
        for (dev, device) in processes.devices.iter().enumerate() {
            let Some(listed) = listed(processes, memory, dev, &elsewhere[dev]) else {
                continue;
            };
            for (pid, actual, charged) in listed {
                self.footprints
                    .note(&device.uuid, pid, actual.saturating_sub(charged));
            }
        }
    }

    fn publish_overheads(&mut self) {
        let medians = self.footprints.medians();
        let mut shared = self.overheads.lock_unpoisoned();
        for (uuid, &median) in &medians {
            let before = shared.get(uuid).copied().unwrap_or(0);
            // Said when first known and when it moves by a tenth.
            if median != before && (before == 0 || median.abs_diff(before) * 10 > before) {
                info!(
                    gpu = %uuid,
                    overhead_mib = median >> 20,
                    "processes on this GPU hold this much beyond what the shim charged \
                     them (median; modules loaded lazily, library workspaces, pool \
                     reserves): reconciliation counts it against their caps"
                );
            }
        }
        *shared = medians;
    }

    fn warn_if_hidden(&mut self, file: &Path, processes: &Processes) {
        let hidden = processes.live.iter().filter(|p| p.pid.is_none()).count();
        if hidden > 0 && !self.warned_hidden {
            self.warned_hidden = true;
            warn!(
                file = %file.display(),
                hidden,
                "container processes are not visible from this PID namespace, so their \
                 untracked GPU memory (contexts, libraries) is not counted: run the plugin \
                 with hostPID: true"
            );
        }
    }
}

/// Reconciles `files()` every `every` until `shutdown`.
pub async fn run(
    mut reconciler: Reconciler,
    files: impl Fn() -> Vec<PathBuf> + Send + Sync + 'static,
    every: Duration,
    shutdown: CancellationToken,
) {
    info!(
        every_ms = every.as_millis() as u64,
        "reconciling untracked GPU memory"
    );
    let files = Arc::new(files);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        // NVML and file I/O block: off the async workers.
        let files = files.clone();
        match tokio::task::spawn_blocking(move || {
            reconciler.tick(&files());
            reconciler
        })
        .await
        {
            Ok(r) => reconciler = r,
            Err(err) => {
                warn!(%err, "untracked-usage reconciliation stopped");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::accounting::{LiveProcess, Usage};
    use crate::node::fake::FakeProcesses;
    use crate::node::gpu::GpuError;

    const MIB: u64 = 1 << 20;
    const T4: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";

    /// A source that is never asked: `load` is given its sample.
    struct NoSource;

    impl crate::node::processes::ProcFiles for NoSource {}

    impl ProcessUsage for NoSource {
        fn usage(&mut self) -> Result<ProcessMemory, GpuError> {
            unreachable!("load takes the sample it is given")
        }
    }

    /// A file rewritten by its container, in place or anew, to cap fewer
    /// GPUs than its directory was granted, or others: the grant stands
    /// in for it; one that agrees with the grant, or with no grant known,
    /// is taken as it reads.
    #[test]
    fn a_file_that_differs_from_its_grant_is_stood_in_for() {
        const A: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";
        const B: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000401";
        const C: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000402";
        let cap = |uuid: &str| accounting::Cap {
            uuid: uuid.into(),
            cap_mib: 1000,
            context_charge_mib: 0,
        };
        let dir = tempfile::tempdir().unwrap();
        let memory: ProcessMemory = [A, B, C]
            .map(|uuid| (uuid.to_owned(), HashMap::new()))
            .into();
        let reconciler = Reconciler::new(Box::new(NoSource)).with_granted_caps(Box::new(
            |_: &Path, uuid: &str| [A, B].contains(&uuid).then_some(1000 * MIB),
        ));
        let read = |caps: &[accounting::Cap]| {
            let file = accounting::prepare(dir.path(), caps).unwrap();
            let read = accounting::processes(&file);
            let (loaded, why) = reconciler.load(vec![(&file, read)], &memory);
            let uuids: Vec<String> = loaded[0].1.devices.iter().map(|d| d.uuid.clone()).collect();
            (uuids, why[0].clone())
        };
        assert_eq!(
            read(&[cap(A), cap(B)]),
            (vec![A.to_owned(), B.to_owned()], None)
        );
        let (uuids, why) = read(&[cap(A)]);
        assert_eq!(uuids, [A, B]);
        assert!(why.unwrap().contains(&format!("leaves out {B}")));
        let (uuids, why) = read(&[cap(A), cap(C)]);
        assert_eq!(uuids, [A, B]);
        assert!(why.unwrap().contains(&format!("caps {C}")));
        // Without a grant, the file as it reads.
        let ungranted = Reconciler::new(Box::new(NoSource));
        let file = accounting::prepare(dir.path(), &[cap(C)]).unwrap();
        let (loaded, why) = ungranted.load(vec![(&file, accounting::processes(&file))], &memory);
        assert_eq!(
            (loaded[0].1.devices[0].uuid.as_str(), why[0].as_deref()),
            (C, None)
        );
    }

    fn live(pid: Option<u32>, used_mib: u64) -> LiveProcess {
        LiveProcess {
            pid,
            start_time: pid.map_or(0, u64::from),
            used: vec![used_mib * MIB],
            creating: 0,
        }
    }

    /// `attribute` with nothing remembered from earlier sweeps (no last
    /// holders, no identities) and no pod directories to read.
    fn attribute_afresh(
        loaded: &[(PathBuf, Processes)],
        memory: &ProcessMemory,
        read: impl Fn(u32, &str) -> Option<String>,
    ) -> Attributed {
        attribute(
            loaded,
            &holders(loaded),
            &LastHolders::new(),
            memory,
            &mut identity::Identities::default().sweep(&read),
            &mut Pods::new(None),
        )
    }

    /// A device of an accounting file: its cap and what its slots charged.
    fn usage(uuid: &str, cap_mib: u64, used_mib: u64) -> Usage {
        Usage {
            uuid: uuid.into(),
            cap_bytes: cap_mib * MIB,
            context_charge_bytes: 0,
            used_bytes: used_mib * MIB,
            untracked_bytes: 0,
            peak_bytes: 0,
            refusals: 0,
        }
    }

    #[test]
    fn overhead_is_the_median_of_recent_processes_largest_samples() {
        let mut f = Footprints::default();
        // Process 1 read low once (mid-allocation), then its real 600 MiB.
        f.note(T4, 1, 100 * MIB);
        f.note(T4, 1, 600 * MIB);
        f.note(T4, 1, 500 * MIB);
        f.note(T4, 2, 520 * MIB);
        f.note(T4, 3, 700 * MIB);
        assert_eq!(f.medians()[T4], 600 * MIB);
        // Only the most recent processes count.
        for pid in 10..10 + FOOTPRINT_PROCESSES as u32 {
            f.note(T4, pid, 530 * MIB);
        }
        assert_eq!(f.per_gpu[T4].len(), FOOTPRINT_PROCESSES);
        assert_eq!(f.medians()[T4], 530 * MIB);
    }

    #[test]
    fn untracked_is_per_process_excess_on_the_files_gpu() {
        let processes = Processes {
            devices: vec![usage(T4, 4308, 1500)],
            live: vec![
                // A context of 300 MiB beside 1000 MiB charged.
                live(Some(10), 1000),
                // Charged more than the GPU shows (managed memory): no credit.
                live(Some(11), 500),
                // Not visible from here, or not on the GPU yet.
                live(None, 0),
                live(Some(12), 0),
            ],
        };
        let memory: ProcessMemory = [
            (
                T4.to_owned(),
                [(10, 1300 * MIB), (11, 200 * MIB), (99, 5000 * MIB)].into(),
            ),
            ("GPU-other".to_owned(), [(12, 700 * MIB)].into()),
        ]
        .into();
        let none = [HashSet::new()];
        assert_eq!(untracked(&processes, &memory, &none), [Some(300 * MIB)]);
        assert_eq!(
            untracked(&processes, &ProcessMemory::new(), &none),
            [None],
            "no answer for the GPU: no sample"
        );
        let idle: ProcessMemory = [(T4.to_owned(), HashMap::new())].into();
        assert_eq!(
            untracked(&processes, &idle, &none),
            [Some(0)],
            "an idle GPU: zero"
        );
    }

    /// A process holding two slots of one file is one process: NVML's
    /// figure once, less what both slots charged.
    #[test]
    fn a_process_in_two_slots_counts_once() {
        let processes = Processes {
            devices: vec![usage(T4, 4308, 1500)],
            live: vec![live(Some(10), 1000), live(Some(10), 500)],
        };
        let memory: ProcessMemory = [(T4.to_owned(), [(10, 2000 * MIB)].into())].into();
        let none = [HashSet::new()];
        assert_eq!(untracked(&processes, &memory, &none), [Some(500 * MIB)]);
        let listed: Vec<_> = listed(&processes, &memory, 0, &none[0]).unwrap().collect();
        assert_eq!(listed, [(10, 2000 * MIB, 1500 * MIB)]);
        let loaded = [(PathBuf::from("/s/containers/a/accounting"), processes)];
        assert_eq!(holders(&loaded)[&10], [0], "in this file, once");
    }

    /// Attribution across sweeps whose `/proc` reads are kept: the same
    /// answers as reading everything every sweep, for a process listed on
    /// two GPUs, a PID taken by a new process, and one that is gone.
    #[test]
    fn attribution_keeps_what_proc_said_only_while_it_still_holds() {
        use std::cell::RefCell;
        const OTHER: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000401";
        let file = |name: &str, holder: u32| {
            let processes = Processes {
                devices: vec![usage(T4, 4308, 1000)],
                live: vec![live(Some(holder), 1000)],
            };
            let path = PathBuf::from(format!("/s/containers/{name}/accounting"));
            (path, processes)
        };
        let loaded = [file("a", 10), file("b", 20)];
        let cgroup = |id: char| {
            format!(
                "0::/kubepods/pod0a1b2c3d-4e5f-4678-9abc-def012345678/{}\n",
                id.to_string().repeat(64)
            )
        };
        let files: RefCell<HashMap<(u32, &str), String>> = RefCell::default();
        let reads: RefCell<Vec<(u32, String)>> = RefCell::default();
        let set = |pid, name, text: String| files.borrow_mut().insert((pid, name), text);
        let stat = |pid: u32, start: u64| {
            let fields: Vec<String> = (3..22).map(|f| f.to_string()).collect();
            format!("{pid} (p) {} {start}\n", fields.join(" "))
        };
        let mounts =
            "1 0 8:1 / / rw - ext4 a rw\n2 1 8:1 /s/containers/a /var/run/gpumem rw - ext4 a rw\n";
        // Holders 10 (container A) and 20 (B); 30 has a's mounts; 40 runs
        // nested in B; 50, a host process, is on both GPUs.
        set(10, "cgroup", cgroup('a'));
        set(20, "cgroup", cgroup('b'));
        for (pid, start) in [(30, 1), (40, 2), (50, 3)] {
            set(pid, "stat", stat(pid, start));
            set(pid, "mountinfo", "1 0 8:1 / / rw - ext4 a rw\n".into());
        }
        set(30, "mountinfo", mounts.into());
        set(40, "cgroup", cgroup('b').replace('\n', "/docker/x\n"));
        set(50, "cgroup", "0::/system.slice/x.service\n".into());
        let memory: ProcessMemory = [
            (
                T4.to_owned(),
                [
                    (10, MIB),
                    (20, MIB),
                    (30, 3 * MIB),
                    (40, 4 * MIB),
                    (50, 5 * MIB),
                ]
                .into(),
            ),
            (OTHER.to_owned(), [(50, 6 * MIB)].into()),
        ]
        .into();
        let mut identities = identity::Identities::default();
        let mut sweep = |loaded: &[(PathBuf, Processes)], memory: &ProcessMemory| {
            let read = |pid, name: &str| {
                reads.borrow_mut().push((pid, name.to_owned()));
                files.borrow().get(&(pid, name)).cloned()
            };
            let mut attributed = attribute(
                loaded,
                &holders(loaded),
                &LastHolders::new(),
                memory,
                &mut identities.sweep(&read),
                &mut Pods::new(None),
            );
            attributed
                .strangers
                .sort_unstable_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
            let mut taken = std::mem::take(&mut *reads.borrow_mut());
            taken.sort_unstable();
            (attributed, taken)
        };
        let expected = |thirty: Option<u64>| {
            let mut attributed = Attributed {
                unslotted: vec![
                    vec![thirty.map(|b| (30, b)).into_iter().collect()],
                    vec![vec![(40, 4 * MIB)]],
                ],
                unmanaged: [(T4.to_owned(), 5 * MIB), (OTHER.to_owned(), 6 * MIB)].into(),
                strangers: vec![
                    (T4.to_owned(), 50, 5 * MIB, None),
                    (OTHER.to_owned(), 50, 6 * MIB, None),
                ],
                leaving: Vec::new(),
                // 40, nested, has none of B's mounts.
                unmounted: vec![(1, T4.to_owned(), 40, 4 * MIB)],
            };
            if thirty.is_none() {
                *attributed.unmanaged.get_mut(T4).unwrap() += 3 * MIB;
                attributed
                    .strangers
                    .insert(0, (T4.to_owned(), 30, 3 * MIB, None));
            }
            attributed
        };
        let names = |list: &[(u32, &str)]| -> Vec<(u32, String)> {
            let mut list: Vec<_> = list.iter().map(|&(p, n)| (p, n.to_owned())).collect();
            list.sort_unstable();
            list
        };

        // First sweep: everything once (50's files once for both GPUs).
        let (attributed, taken) = sweep(&loaded, &memory);
        assert_eq!(attributed, expected(Some(3 * MIB)));
        let mut first = vec![
            (10, "cgroup"),
            (20, "cgroup"),
            (30, "stat"),
            (30, "mountinfo"),
        ];
        first.extend([(40, "stat"), (40, "mountinfo"), (40, "cgroup")]);
        first.extend([(50, "stat"), (50, "mountinfo"), (50, "cgroup")]);
        assert_eq!(taken, names(&first));
        // Then: the same answers from start times, the holders' from the
        // start times their slots name.
        let (attributed, taken) = sweep(&loaded, &memory);
        assert_eq!(attributed, expected(Some(3 * MIB)));
        assert_eq!(taken, names(&[(30, "stat"), (40, "stat"), (50, "stat")]));
        // 30's PID is taken by a host process: read again, and unmanaged.
        set(30, "stat", stat(30, 9));
        set(30, "mountinfo", "1 0 8:1 / / rw - ext4 a rw\n".into());
        set(30, "cgroup", "0::/\n".into());
        let (attributed, _) = sweep(&loaded, &memory);
        assert_eq!(attributed, expected(None));
        // B's holder exits and its PID goes to a process of the container
        // that replaced B (same units, same file): its slot names a new
        // start time, its cgroup is read again, and 40 is B's no more.
        let mut replaced = loaded.clone();
        replaced[1].1.live[0].start_time = 21;
        set(20, "cgroup", cgroup('c'));
        let (attributed, taken) = sweep(&replaced, &memory);
        assert!(taken.contains(&(20, "cgroup".into())), "{taken:?}");
        assert_eq!(attributed.unslotted[1], [vec![]]);
        assert!(attributed.strangers.iter().any(|s| s.1 == 40));
        // Only processes whose mounts name their container: the holders'
        // cgroups are not read.
        let mounted: ProcessMemory = [(T4.to_owned(), [(10, MIB), (31, MIB)].into())].into();
        set(31, "mountinfo", mounts.into());
        let (attributed, taken) = sweep(&loaded, &mounted);
        assert_eq!(attributed.unslotted[0], [vec![(31, MIB)]]);
        assert_eq!(taken, names(&[(31, "stat"), (31, "mountinfo")]));
    }

    /// A container with two claims, one per GPU, has both directories
    /// mounted: each GPU's usage counts against the claim that caps it,
    /// a slot holder's too where its file does not cap that GPU.
    #[test]
    fn a_process_of_two_claims_counts_against_each_gpus_own() {
        const OTHER: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000401";
        let file = |name: &str, uuid: &str, holders: Vec<LiveProcess>| {
            let processes = Processes {
                devices: vec![usage(uuid, 4308, 0)],
                live: holders,
            };
            let path = PathBuf::from(format!("/s/containers/{name}/accounting"));
            (path, processes)
        };
        let loaded = [
            file("claim-a", T4, vec![live(Some(10), 1)]),
            file("claim-b", OTHER, Vec::new()),
        ];
        let mounts = "1 0 8:1 / / rw - ext4 a rw\n\
             2 1 8:1 /s/containers/claim-b /run/gpumem/claim-b rw - ext4 a rw\n\
             3 1 8:1 /s/containers/claim-a /run/gpumem/claim-a rw - ext4 a rw\n";
        let read = |pid: u32, name: &str| match name {
            "stat" => Some(format!(
                "{pid} (p) 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 1\n"
            )),
            "mountinfo" => Some(mounts.to_owned()),
            _ => None,
        };
        // 10 holds a slot of claim-a and is on both GPUs; 30 loaded no shim.
        let memory: ProcessMemory = [
            (T4.to_owned(), [(10, MIB), (30, 3 * MIB)].into()),
            (OTHER.to_owned(), [(10, 2 * MIB), (30, 6 * MIB)].into()),
        ]
        .into();
        let mut attributed = attribute_afresh(&loaded, &memory, read);
        for per_file in &mut attributed.unslotted {
            per_file.iter_mut().for_each(|list| list.sort_unstable());
        }
        assert_eq!(
            attributed.unslotted,
            [
                vec![vec![(30, 3 * MIB)]],
                vec![vec![(10, 2 * MIB), (30, 6 * MIB)]]
            ]
        );
        assert!(attributed.strangers.is_empty(), "{attributed:?}");
    }

    /// Two claims of one container cap the same GPU, and a process of that
    /// container without the shim, whose mounts cannot be read, is on it:
    /// it counts against the claim the shim would charge, the first by
    /// name, whichever order the files come in.
    #[test]
    fn a_shimless_process_counts_against_the_first_of_its_containers_files() {
        let file = |name: &str, holder: u32| {
            let processes = Processes {
                devices: vec![usage(T4, 2000, 0)],
                live: vec![live(Some(holder), 0)],
            };
            (
                PathBuf::from(format!("/s/containers/{name}/accounting")),
                processes,
            )
        };
        let loaded = [file("claim-b", 10), file("claim-a", 20)];
        let cgroup = format!(
            "0::/kubepods/pod0a1b2c3d-4e5f-4678-9abc-def012345678/{}\n",
            "c".repeat(64)
        );
        let read = |pid: u32, name: &str| match name {
            "stat" => Some(format!("{pid} (p) {} 7\n", "1 ".repeat(19))),
            "cgroup" => Some(cgroup.clone()),
            _ => None,
        };
        let memory: ProcessMemory = [(T4.to_owned(), [(30, 700 * MIB)].into())].into();
        let attributed = attribute_afresh(&loaded, &memory, read);
        assert_eq!(
            attributed.unslotted,
            [vec![vec![]], vec![vec![(30, 700 * MIB)]]],
            "claim-a's, not claim-b's"
        );
    }

    /// A pod with two gpumem containers on one GPU, and a process of the
    /// pod in neither's mounts nor beside a slot holder: which container
    /// it is in cannot be told, so it is a stranger, never a guess that
    /// would hold one container to the other's use. Once one container's
    /// slot holder runs in another container than the process, the
    /// process is the other's.
    #[test]
    fn a_pods_process_is_its_only_possible_container() {
        const POD: &str = "0a1b2c3d-4e5f-4678-9abc-def012345678";
        let file = |name: &str, holder: Option<u32>| {
            let processes = Processes {
                devices: vec![usage(T4, 2000, 0)],
                live: holder.map(|pid| live(Some(pid), 0)).into_iter().collect(),
            };
            (
                PathBuf::from(format!("/s/containers/{name}/accounting")),
                processes,
            )
        };
        let cgroup = |id: char| format!("0::/kubepods/pod{POD}/{}\n", id.to_string().repeat(64));
        let read = |pid: u32, name: &str| match (pid, name) {
            (_, "stat") => Some(format!("{pid} (p) {} 7\n", "1 ".repeat(19))),
            (10, "cgroup") => Some(cgroup('c')),
            (30, "cgroup") => Some(cgroup('e')),
            _ => None,
        };
        let pod_dirs: PodDirs = Box::new(|| {
            Some(PodGrants {
                by_pod: [(POD.to_owned(), vec!["aa".to_owned(), "bb".to_owned()])].into(),
                ..PodGrants::default()
            })
        });
        let memory: ProcessMemory = [(T4.to_owned(), [(30, 700 * MIB)].into())].into();
        let attribute_with = |loaded: &[(PathBuf, Processes)]| {
            attribute(
                loaded,
                &holders(loaded),
                &LastHolders::new(),
                &memory,
                &mut identity::Identities::default().sweep(&read),
                &mut Pods::new(Some(&pod_dirs)),
            )
        };

        let attributed = attribute_with(&[file("aa", None), file("bb", None)]);
        assert_eq!(attributed.unslotted, [vec![vec![]], vec![vec![]]]);
        assert_eq!(attributed.strangers.len(), 1, "{attributed:?}");

        let attributed = attribute_with(&[file("aa", Some(10)), file("bb", None)]);
        assert_eq!(
            attributed.unslotted,
            [vec![vec![]], vec![vec![(30, 700 * MIB)]]],
            "bb's: aa's holder runs in another container"
        );
        assert!(attributed.strangers.is_empty(), "{attributed:?}");
    }

    /// Claim A caps GPU X; claim B caps X and Y; a process of both holds a
    /// slot in each. The shim charges its use of X to A (the first file
    /// that caps X), so that use is A's alone: B neither counts it as
    /// untracked nor holds it to B's cap.
    #[test]
    fn a_gpu_two_claims_cap_is_counted_in_the_first_only() {
        const Y: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000401";
        let device = |uuid: &str| usage(uuid, 1000, 0);
        let holder = LiveProcess {
            pid: Some(10),
            start_time: 10,
            used: vec![2000 * MIB, 0],
            creating: 0,
        };
        let a = Processes {
            devices: vec![device(T4)],
            live: vec![LiveProcess {
                used: vec![2000 * MIB],
                ..holder.clone()
            }],
        };
        let b = Processes {
            devices: vec![device(T4), device(Y)],
            live: vec![LiveProcess {
                used: vec![0, 500 * MIB],
                ..holder
            }],
        };
        // Listed B first: the order that counts is the shim's (by name).
        let loaded = [
            (PathBuf::from("/s/containers/claim-b/accounting"), b),
            (PathBuf::from("/s/containers/claim-a/accounting"), a),
        ];
        let memory: ProcessMemory = [
            (T4.to_owned(), [(10, 2300 * MIB)].into()),
            (Y.to_owned(), [(10, 800 * MIB)].into()),
        ]
        .into();
        let stat = |pid: u32| format!("{pid} (p) {} 7\n", "1 ".repeat(19));
        let mut identities = identity::Identities::default();
        // Mounts that cannot be read: the order is the names'.
        let read = |pid: u32, name: &str| (name == "stat").then(|| stat(pid));
        let elsewhere = charged_elsewhere(&loaded, &holders(&loaded), &mut identities.sweep(&read));
        assert_eq!(elsewhere[0], [[10].into(), HashSet::new()]);
        assert_eq!(elsewhere[1], [HashSet::new()]);
        assert_eq!(
            untracked(&loaded[0].1, &memory, &elsewhere[0]),
            [Some(0), Some(300 * MIB)],
            "B: nothing of X, Y's context"
        );
        assert_eq!(
            untracked(&loaded[1].1, &memory, &elsewhere[1]),
            [Some(300 * MIB)],
            "A: X's context"
        );
        // The overhead estimate takes X's figure from A alone: B charged
        // nothing there, and would make the whole 2300 MiB look like overhead.
        let mut reconciler = Reconciler::new(Box::new(FakeProcesses::new(Path::new("/none"))));
        for ((_, processes), elsewhere) in loaded.iter().zip(&elsewhere) {
            reconciler.note_footprints(processes, &memory, elsewhere);
        }
        let overheads = reconciler.footprints.medians();
        assert_eq!(overheads[T4], 300 * MIB);
        assert_eq!(overheads[Y], 300 * MIB);

        // B was prepared before claims had their own place: its spec
        // mounts it at the state path itself, where the shim reads first.
        let mounts = "2 1 8:1 /s/containers/claim-b /run/gpumem rw - ext4 a rw\n\
             3 1 8:1 /s/containers/claim-a /run/gpumem/claim-a rw - ext4 a rw\n";
        let read = |pid: u32, name: &str| match name {
            "stat" => Some(stat(pid)),
            "mountinfo" => Some(mounts.to_owned()),
            _ => None,
        };
        let mut identities = identity::Identities::default();
        let elsewhere = charged_elsewhere(&loaded, &holders(&loaded), &mut identities.sweep(&read));
        assert_eq!(elsewhere[0], [HashSet::new(), HashSet::new()]);
        assert_eq!(elsewhere[1], [[10].into()]);
    }
}
