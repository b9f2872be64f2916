//! Attribution: whose each process NVML lists on a GPU is, told from
//! outside at every tick, whether or not the process loaded the shim.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::isolation::accounting::Processes;
use crate::isolation::identity::{self, Owner};
use crate::node::gpu::ProcessMemory;
use crate::node::processes::ProcFiles;

use super::Loaded;

/// Whose each process NVML listed at the last tick is. Shared with the
/// metrics endpoint, which pairs it with NVML's per-process SM samples:
/// only attribution from outside can give each pod its share of a GPU.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
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

/// The [`Snapshot`], kept current by [`Reconciler::tick`](super::Reconciler::tick).
pub type SharedSnapshot = Arc<Mutex<Snapshot>>;

/// Attribution's memory from one tick to the next, and what it asks.
#[derive(Default)]
pub(super) struct Attributor {
    /// What `/proc` says of the processes NVML lists, kept while they live.
    identities: identity::Identities,
    /// The slot holders of the last tick, by PID and start time, and since
    /// when each that has let go of its slot has been on its way out.
    last_holders: LastHolders,
    /// Each pod's containers, where known: attribution by cgroup.
    pub(super) pods: Option<PodDirs>,
}

impl Attributor {
    /// Attributes every process `memory` lists (see [`attribute`]), reading
    /// `/proc` through `source`; beside it, per file and device, the slot
    /// holders whose use another file is charged (see [`charged_elsewhere`]).
    pub(super) fn attribute(
        &mut self,
        loaded: &[Loaded],
        memory: &ProcessMemory,
        source: &dyn ProcFiles,
    ) -> (Attribution, Vec<Vec<HashSet<u32>>>) {
        let (attribution, elsewhere) = {
            let mut who = self.identities.sweep(source);
            let held = holders(loaded);
            let mut pods = Pods::new(self.pods.as_ref());
            let attribution = attribute(
                loaded,
                &held,
                &self.last_holders,
                memory,
                &mut who,
                &mut pods,
            );
            (attribution, charged_elsewhere(loaded, &held, &mut who))
        };
        let mut holders: LastHolders = loaded
            .iter()
            .flat_map(|file| &file.processes.live)
            .filter_map(|p| Some(((p.pid?, p.start_time), None)))
            .collect();
        for &key in &attribution.leaving {
            let since = self.last_holders.get(&key).copied().flatten();
            let since = since.unwrap_or_else(std::time::Instant::now);
            if since.elapsed() < LEAVING_AT_MOST {
                holders.insert(key, Some(since));
            }
        }
        self.last_holders = holders;
        (attribution, elsewhere)
    }
}

/// How long a slot holder on its way out is passed over: the driver's part
/// of an exit takes seconds at most, and a process that stays in its exit
/// (a thread stuck in the driver) must not hide longer.
const LEAVING_AT_MOST: Duration = Duration::from_secs(10);

/// Slot holders of the last tick by PID and start time, with since when
/// each one that let go of its slot has been exiting.
type LastHolders = HashMap<(u32, u64), Option<std::time::Instant>>;

/// Where the processes NVML lists belong, beyond the slot holders.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Attribution {
    /// Per file and device: the processes of that container that hold no
    /// slot (they did not load the shim), with what they use there.
    pub(super) unslotted: Vec<Vec<Vec<(u32, u64)>>>,
    /// Per GPU UUID: what processes in no gpumem container use.
    pub(super) unmanaged: HashMap<String, u64>,
    /// Those processes.
    pub(super) strangers: Vec<Stranger>,
    /// Slot holders on their way out, by PID and start time: passed over,
    /// and again at the next sample while they still are.
    leaving: Vec<(u32, u64)>,
    /// Processes found by their cgroup whose mount table, read, lacks
    /// their container's directory.
    pub(super) unmounted: Vec<Unmounted>,
}

/// A gpumem container's process on a GPU without the container's mounts.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Unmounted {
    /// Its container's accounting file, by index.
    pub(super) file: usize,
    pub(super) gpu_uuid: String,
    pub(super) pid: u32,
    pub(super) bytes: u64,
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
    loaded: &[Loaded],
    held: &HashMap<u32, Vec<usize>>,
    last_holders: &LastHolders,
    memory: &ProcessMemory,
    who: &mut identity::Sweep<'_>,
    pods: &mut Pods<'_>,
) -> Attribution {
    let by_dir: HashMap<&std::ffi::OsStr, usize> = loaded
        .iter()
        .enumerate()
        .filter_map(|(index, file)| Some((file.path.parent()?.file_name()?, index)))
        .collect();
    let dir_name = |index: usize| loaded[index].path.parent()?.file_name()?.to_str();
    // The slot holders' cgroups are read only once a process's mounts did
    // not name its container.
    let mut containers: Option<HashMap<String, Vec<usize>>> = None;
    let mut attribution = Attribution {
        unslotted: loaded
            .iter()
            .map(|file| vec![Vec::new(); file.processes.devices.len()])
            .collect(),
        ..Attribution::default()
    };
    for (uuid, per_pid) in memory {
        // The file `index` with its position of this GPU, if it caps it.
        let capping = |index: usize| Some((index, position(&loaded[index].processes, uuid)?));
        let unmanaged = attribution.unmanaged.entry(uuid.clone()).or_default();
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
                attribution.leaving.push((pid, start));
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
                    attribution.unslotted[index][dev].push((pid, bytes));
                    let found_mounted = mounted.contains(&index) || elsewhere.is_some();
                    if !found_mounted && who.mounts_read(pid) {
                        attribution.unmounted.push(Unmounted {
                            file: index,
                            gpu_uuid: uuid.clone(),
                            pid,
                            bytes,
                        });
                    }
                }
                None => {
                    *unmanaged = unmanaged.saturating_add(bytes);
                    let owner = owner.or_else(|| who.owner(pid));
                    attribution.strangers.push(Stranger {
                        gpu_uuid: uuid.clone(),
                        pid,
                        bytes,
                        owner,
                    });
                }
            }
        }
    }
    attribution
}

/// Where file `processes` records GPU `uuid`, if it caps it.
pub(super) fn position(processes: &Processes, uuid: &str) -> Option<usize> {
    processes.devices.iter().position(|d| d.uuid == uuid)
}

/// The files each live slot holder has a slot in, each once: a process
/// holding two slots of one file is in that file, not in another one.
pub(super) fn holders(loaded: &[Loaded]) -> HashMap<u32, Vec<usize>> {
    let mut held: HashMap<u32, Vec<usize>> = HashMap::new();
    for (index, file) in loaded.iter().enumerate() {
        for pid in file.processes.live.iter().filter_map(|p| p.pid) {
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
pub(super) fn charged_elsewhere(
    loaded: &[Loaded],
    held: &HashMap<u32, Vec<usize>>,
    who: &mut identity::Sweep<'_>,
) -> Vec<Vec<HashSet<u32>>> {
    let mut elsewhere: Vec<Vec<HashSet<u32>>> = loaded
        .iter()
        .map(|file| vec![HashSet::new(); file.processes.devices.len()])
        .collect();
    // Whether a file before the `k`th of `files` caps GPU `uuid`.
    let before = |files: &[usize], k: usize, uuid: &str| {
        files[..k]
            .iter()
            .any(|&e| position(&loaded[e].processes, uuid).is_some())
    };
    for (&pid, files) in held {
        let shared = files.iter().enumerate().any(|(k, &index)| {
            let devices = &loaded[index].processes.devices;
            devices.iter().any(|d| before(files, k, &d.uuid))
        });
        // Mounts are read only for the rare process this concerns.
        if !shared {
            continue;
        }
        let mounted = who.mounted(pid).to_vec();
        let rank = |index: usize| {
            let file = &loaded[index].path;
            let name = file.parent().and_then(Path::file_name);
            let at = mounted
                .iter()
                .position(|m| Some(std::ffi::OsStr::new(m)) == name);
            (at.is_none(), at, shim_order(file))
        };
        let mut files = files.clone();
        files.sort_by_key(|&index| rank(index));
        for (k, &index) in files.iter().enumerate() {
            for (dev, device) in loaded[index].processes.devices.iter().enumerate() {
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
    loaded: &[Loaded],
    who: &mut identity::Sweep<'_>,
) -> HashMap<String, Vec<usize>> {
    let mut containers: HashMap<String, Vec<usize>> = HashMap::new();
    for (
        index,
        Loaded {
            path: file,
            processes,
            ..
        },
    ) in loaded.iter().enumerate()
    {
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
        files.sort_by_key(|&index| shim_order(&loaded[index].path));
    }
    containers
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::isolation::accounting::{LiveProcess, Usage};

    pub(crate) const MIB: u64 = 1 << 20;
    pub(crate) const T4: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";

    pub(crate) fn live(pid: Option<u32>, used_mib: u64) -> LiveProcess {
        LiveProcess {
            pid,
            start_time: pid.map_or(0, u64::from),
            used: vec![used_mib * MIB],
            creating: 0,
        }
    }

    /// A file as read, stood in for by no grant.
    pub(in crate::isolation::reconcile) fn as_read(
        path: impl Into<std::path::PathBuf>,
        processes: Processes,
    ) -> Loaded {
        Loaded {
            path: path.into(),
            processes,
            stood_in: None,
        }
    }

    /// `attribute` with nothing remembered from earlier sweeps (no last
    /// holders, no identities) and no pod directories to read.
    fn attribute_afresh(
        loaded: &[Loaded],
        memory: &ProcessMemory,
        read: impl Fn(u32, &str) -> Option<String>,
    ) -> Attribution {
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
    pub(crate) fn usage(uuid: &str, cap_mib: u64, used_mib: u64) -> Usage {
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
            as_read(format!("/s/containers/{name}/accounting"), processes)
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
        let mut sweep = |loaded: &[Loaded], memory: &ProcessMemory| {
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
                .sort_unstable_by(|a, b| (&a.gpu_uuid, a.pid).cmp(&(&b.gpu_uuid, b.pid)));
            let mut taken = std::mem::take(&mut *reads.borrow_mut());
            taken.sort_unstable();
            (attributed, taken)
        };
        let stranger = |uuid: &str, pid, bytes| Stranger {
            gpu_uuid: uuid.to_owned(),
            pid,
            bytes,
            owner: None,
        };
        let expected = |thirty: Option<u64>| {
            let mut attributed = Attribution {
                unslotted: vec![
                    vec![thirty.map(|b| (30, b)).into_iter().collect()],
                    vec![vec![(40, 4 * MIB)]],
                ],
                unmanaged: [(T4.to_owned(), 5 * MIB), (OTHER.to_owned(), 6 * MIB)].into(),
                strangers: vec![stranger(T4, 50, 5 * MIB), stranger(OTHER, 50, 6 * MIB)],
                leaving: Vec::new(),
                // 40, nested, has none of B's mounts.
                unmounted: vec![Unmounted {
                    file: 1,
                    gpu_uuid: T4.to_owned(),
                    pid: 40,
                    bytes: 4 * MIB,
                }],
            };
            if thirty.is_none() {
                *attributed.unmanaged.get_mut(T4).unwrap() += 3 * MIB;
                attributed.strangers.insert(0, stranger(T4, 30, 3 * MIB));
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
        replaced[1].processes.live[0].start_time = 21;
        set(20, "cgroup", cgroup('c'));
        let (attributed, taken) = sweep(&replaced, &memory);
        assert!(taken.contains(&(20, "cgroup".into())), "{taken:?}");
        assert_eq!(attributed.unslotted[1], [vec![]]);
        assert!(attributed.strangers.iter().any(|s| s.pid == 40));
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
            as_read(format!("/s/containers/{name}/accounting"), processes)
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
            as_read(format!("/s/containers/{name}/accounting"), processes)
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
            as_read(format!("/s/containers/{name}/accounting"), processes)
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
        let attribute_with = |loaded: &[Loaded]| {
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
}
