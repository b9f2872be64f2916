//! Untracked usage: what the driver holds for a container's processes
//! beyond what the shim charged — modules loaded lazily at the first kernel
//! launch (about 90 MiB for PyTorch on an H100), library workspaces,
//! memory-pool reserves, and contexts where the shim could not measure them. Every few seconds the daemon compares NVML's per-process usage
//! with each process's charges and publishes the excess in the container's
//! accounting file; the shim adds it to every check and to what nvidia-smi
//! shows, so a container is held to its whole footprint, not only to its
//! allocations.

pub mod attribution;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::isolation::accounting::{self, Processes};
use crate::isolation::enforce::{
    self, Actions, Enforcer, Footprint, Notice, Noticed, Notices, OverCapAction,
};
use crate::node::gpu::ProcessMemory;
use crate::node::processes::ProcessUsage;
use crate::sync::LockExt;

use attribution::{
    position, Attribution, Attributor, PodDirs, SharedSnapshot, Snapshot, Stranger, Unmounted,
};

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
/// it another file is charged (see [`attribution::charged_elsewhere`]).
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

/// An accounting file as a tick reads it.
#[derive(Debug, Clone)]
struct Loaded {
    path: PathBuf,
    processes: Processes,
    /// Why its directory's grant stands in for it, where it does (see
    /// [`Reconciler::load`]): nothing is published into it then.
    stood_in: Option<String>,
}

/// An accounting file in a tick, with what attribution found of it.
struct Tally<'a> {
    file: &'a Loaded,
    /// Per device: the processes of its container that hold no slot, with
    /// what each uses there (see [`Attribution::unslotted`]).
    unslotted: &'a [Vec<(u32, u64)>],
    /// Per device: its slot holders whose use of that GPU another file is
    /// charged (see [`attribution::charged_elsewhere`]).
    charged_elsewhere: &'a [HashSet<u32>],
}

impl<'a> Tally<'a> {
    /// Each of `files` with what attribution found of it.
    fn each(
        files: &'a [Loaded],
        attribution: &'a Attribution,
        charged_elsewhere: &'a [Vec<HashSet<u32>>],
    ) -> Vec<Tally<'a>> {
        files
            .iter()
            .zip(&attribution.unslotted)
            .zip(charged_elsewhere)
            .map(|((file, unslotted), charged_elsewhere)| Tally {
                file,
                unslotted,
                charged_elsewhere,
            })
            .collect()
    }

    /// [`listed`] on its device `dev`.
    fn listed(
        &self,
        memory: &'a ProcessMemory,
        dev: usize,
    ) -> Option<impl Iterator<Item = (u32, u64, u64)> + 'a> {
        listed(
            &self.file.processes,
            memory,
            dev,
            &self.charged_elsewhere[dev],
        )
    }
}

/// One daemon's reconciliation state.
pub struct Reconciler {
    source: Box<dyn ProcessUsage>,
    /// The cap Allocate gave a container (accounting file, GPU UUID) in
    /// bytes, where the daemon knows it; else the file's cap is used.
    granted: Option<GrantedCap>,
    /// The over-cap action, where it is on.
    enforcer: Option<Enforcer>,
    /// Whose each process is, and what that keeps from tick to tick.
    attributor: Attributor,
    footprints: Footprints,
    published: Published,
    shared: Shared,
    told: Told,
}

/// The untracked usage published into the files.
#[derive(Default)]
struct Published {
    /// The previous sample per file and device. An increase is published at
    /// once; a decrease only when two samples in a row agree, because a
    /// sample taken between a charge and the driver's allocation reads low.
    previous: HashMap<(PathBuf, usize), u64>,
    /// Files and devices whose publish failed, already logged.
    failing: HashSet<(PathBuf, usize)>,
}

impl Published {
    /// Publishes a file's untracked usage, each device's key put in `seen`.
    fn publish(
        &mut self,
        tally: &Tally<'_>,
        memory: &ProcessMemory,
        seen: &mut HashSet<(PathBuf, usize)>,
    ) {
        let (file, processes) = (&tally.file.path, &tally.file.processes);
        let samples = untracked(processes, memory, tally.charged_elsewhere);
        for (dev, sample) in samples.into_iter().enumerate() {
            // Processes of the container that did not load the shim
            // count whole: nothing charged them.
            let shimless = tally.unslotted[dev].iter().map(|&(_, b)| b);
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
                    self.failing.remove(&key);
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
                    if self.failing.insert(key) {
                        warn!(file = %file.display(), err = %crate::error_text::chain(&err), "cannot publish untracked usage")
                    }
                }
            }
        }
    }

    /// Forgets the files and devices not in `seen`.
    fn keep_only(&mut self, seen: &HashSet<(PathBuf, usize)>) {
        self.previous.retain(|key, _| seen.contains(key));
        self.failing.retain(|key| seen.contains(key));
    }
}

/// What the metrics endpoint reads, kept current by `tick`.
#[derive(Default)]
struct Shared {
    overheads: Overheads,
    unmanaged: Unmanaged,
    snapshot: SharedSnapshot,
}

/// Where notices go, and what was said already, so that each is said once.
#[derive(Default)]
struct Told {
    /// Where over-cap actions and unmanaged processes are told.
    notices: Option<Notices>,
    /// NVML's last error.
    usage_error: Option<String>,
    /// Whether processes hidden from this PID namespace were warned of.
    hidden: bool,
    /// Unmanaged processes, by GPU UUID and PID.
    unmanaged: HashSet<(String, u32)>,
    /// Files stood in for by their grant (see `load`).
    stood_in: HashSet<PathBuf>,
    /// Files whose container had a process without its mounts: once per
    /// container.
    unmounted: HashSet<PathBuf>,
}

/// Where the over-cap action learns a container's cap without trusting the
/// file the container can write.
pub type GrantedCap = Box<dyn Fn(&Path, &str) -> Option<u64> + Send>;

impl Reconciler {
    pub fn new(source: Box<dyn ProcessUsage>) -> Self {
        Reconciler {
            source,
            granted: None,
            enforcer: None,
            attributor: Attributor::default(),
            footprints: Footprints::default(),
            published: Published::default(),
            shared: Shared::default(),
            told: Told::default(),
        }
    }

    /// Attributes a process to its pod's gpumem container by its cgroup,
    /// and checks what its mounts say against it, with `pods` telling each
    /// pod's containers.
    pub fn with_pod_dirs(mut self, pods: PodDirs) -> Self {
        self.attributor.pods = Some(pods);
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
        self.told.notices = Some(notices);
        self
    }

    /// Over-cap actions taken, where the action is on.
    pub fn actions(&self) -> Option<Arc<Actions>> {
        self.enforcer.as_ref().map(Enforcer::actions)
    }

    /// Memory per GPU held outside every gpumem container, kept current by
    /// `tick`.
    pub fn unmanaged(&self) -> Unmanaged {
        self.shared.unmanaged.clone()
    }

    /// Whose each GPU process is, kept current by `tick`.
    pub fn attribution(&self) -> SharedSnapshot {
        self.shared.snapshot.clone()
    }

    /// The per-GPU overhead estimate, kept current by `tick`.
    pub fn overheads(&self) -> Overheads {
        self.shared.overheads.clone()
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
                self.told.usage_error = None;
                memory
            }
            Err(err) => {
                let text = crate::error_text::one_line(&err);
                if self.told.usage_error.as_ref() != Some(&text) {
                    warn!(err = %text, "cannot read per-process GPU memory; untracked usage not updated");
                    self.told.usage_error = Some(text);
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
        let loaded = self.load(read, &memory);
        let (attribution, elsewhere) = self.attributor.attribute(&loaded, &memory, &*self.source);
        self.report_unmanaged(&attribution);
        self.report_unmounted(&loaded, &attribution);
        let tallies = Tally::each(&loaded, &attribution, &elsewhere);
        self.publish_snapshot(&tallies, &memory, &attribution);
        self.warn_of_stand_ins(&tallies);
        self.enforce(&tallies, &memory, sampled_at);
        let mut seen = HashSet::new();
        for tally in &tallies {
            if tally.file.stood_in.is_some() {
                // Nothing to publish into, or nothing the shims read right.
                continue;
            }
            let (file, processes) = (&tally.file.path, &tally.file.processes);
            self.warn_if_hidden(file, processes);
            self.note_footprints(processes, &memory, tally.charged_elsewhere);
            self.published.publish(tally, &memory, &mut seen);
        }
        self.published.keep_only(&seen);
        self.publish_overheads();
    }

    /// Takes each file as read. One that cannot be read, or that does not
    /// cap the GPUs its directory was granted, is replaced by the grant
    /// with no slot holders: the file is mounted writable, and a container
    /// process that removed or rewrote it must not leave its container
    /// unseen. Its processes are then found by their mounts, counted whole
    /// and held to the granted cap.
    fn load(
        &self,
        read: Vec<(&PathBuf, std::io::Result<Processes>)>,
        memory: &ProcessMemory,
    ) -> Vec<Loaded> {
        let mut loaded = Vec::new();
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
            loaded.push(Loaded {
                path: file.clone(),
                processes,
                stood_in: why,
            });
        }
        loaded
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
    fn warn_of_stand_ins(&mut self, tallies: &[Tally<'_>]) {
        // Said once for as long as the file is stood in for.
        let still: HashSet<&PathBuf> = tallies
            .iter()
            .filter(|tally| tally.file.stood_in.is_some())
            .map(|tally| &tally.file.path)
            .collect();
        self.told.stood_in.retain(|file| still.contains(file));
        for tally in tallies {
            let (file, why, unslotted) = (&tally.file.path, &tally.file.stood_in, tally.unslotted);
            let (Some(why), true) = (why, unslotted.iter().any(|dev| !dev.is_empty())) else {
                continue;
            };
            if self.told.stood_in.insert(file.clone()) {
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
    fn enforce(&mut self, tallies: &[Tally<'_>], memory: &ProcessMemory, sampled_at: Option<u64>) {
        let Some(enforcer) = self.enforcer.as_mut() else {
            return;
        };
        let mut footprints = Vec::new();
        for tally in tallies {
            let (file, unslotted) = (&tally.file.path, tally.unslotted);
            for (dev, device) in tally.file.processes.devices.iter().enumerate() {
                let Some(listed) = tally.listed(memory, dev) else {
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
        enforcer.check(&footprints, sampled_at, self.told.notices.as_ref());
    }

    /// Keeps the per-GPU unmanaged figures current and logs each process
    /// that holds GPU memory outside every gpumem container, once.
    fn report_unmanaged(&mut self, attribution: &Attribution) {
        let mut present = HashSet::new();
        for stranger in &attribution.strangers {
            let Stranger {
                gpu_uuid: uuid,
                pid,
                bytes,
                owner,
            } = stranger;
            let key = (uuid.clone(), *pid);
            if !self.told.unmanaged.contains(&key) {
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
                if let Some(notices) = &self.told.notices {
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
        self.told.unmanaged = present;
        *self.shared.unmanaged.lock_unpoisoned() = attribution.unmanaged.clone();
    }

    /// Logs, and tells `notices`, once per container, that one of its
    /// processes is on a GPU without the container's mounts: the runtime
    /// did not apply Allocate's answer (a `cdi` strategy on a runtime
    /// without CDI), or the process left them. Either way no shim caps it.
    fn report_unmounted(&mut self, loaded: &[Loaded], attribution: &Attribution) {
        self.told
            .unmounted
            .retain(|file| loaded.iter().any(|f| &f.path == file));
        for unmounted in &attribution.unmounted {
            let Unmounted {
                file: index,
                gpu_uuid: uuid,
                pid,
                bytes,
            } = unmounted;
            let file = &loaded[*index].path;
            if !self.told.unmounted.insert(file.clone()) {
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
            if let Some(notices) = &self.told.notices {
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
    fn publish_snapshot(
        &self,
        tallies: &[Tally<'_>],
        memory: &ProcessMemory,
        attribution: &Attribution,
    ) {
        let mut snapshot = Snapshot {
            strangers: attribution.strangers.clone(),
            ..Snapshot::default()
        };
        for tally in tallies {
            let Some(name) = tally.file.path.parent().and_then(Path::file_name) else {
                continue;
            };
            let per_gpu = snapshot
                .containers
                .entry(name.to_string_lossy().into_owned())
                .or_default();
            for (dev, device) in tally.file.processes.devices.iter().enumerate() {
                let pids = per_gpu.entry(device.uuid.clone()).or_default();
                let holders = tally.listed(memory, dev);
                pids.extend(holders.into_iter().flatten().map(|(pid, _, _)| pid));
                pids.extend(tally.unslotted[dev].iter().map(|&(pid, _)| pid));
            }
        }
        *self.shared.snapshot.lock_unpoisoned() = snapshot;
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
        let mut shared = self.shared.overheads.lock_unpoisoned();
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
        if hidden > 0 && !self.told.hidden {
            self.told.hidden = true;
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
    use crate::isolation::accounting::LiveProcess;
    use crate::isolation::identity;
    use crate::isolation::reconcile::attribution::tests::{as_read, live, usage, MIB, T4};
    use crate::isolation::reconcile::attribution::{charged_elsewhere, holders};
    use crate::node::fake::FakeProcesses;
    use crate::node::gpu::GpuError;

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
            let loaded = reconciler.load(vec![(&file, read)], &memory);
            let devices = &loaded[0].processes.devices;
            let uuids: Vec<String> = devices.iter().map(|d| d.uuid.clone()).collect();
            (uuids, loaded[0].stood_in.clone())
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
        let loaded = ungranted.load(vec![(&file, accounting::processes(&file))], &memory);
        assert_eq!(
            (
                loaded[0].processes.devices[0].uuid.as_str(),
                loaded[0].stood_in.as_deref()
            ),
            (C, None)
        );
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
        let loaded = [as_read("/s/containers/a/accounting", processes)];
        assert_eq!(holders(&loaded)[&10], [0], "in this file, once");
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
            as_read("/s/containers/claim-b/accounting", b),
            as_read("/s/containers/claim-a/accounting", a),
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
            untracked(&loaded[0].processes, &memory, &elsewhere[0]),
            [Some(0), Some(300 * MIB)],
            "B: nothing of X, Y's context"
        );
        assert_eq!(
            untracked(&loaded[1].processes, &memory, &elsewhere[1]),
            [Some(300 * MIB)],
            "A: X's context"
        );
        // The overhead estimate takes X's figure from A alone: B charged
        // nothing there, and would make the whole 2300 MiB look like overhead.
        let mut reconciler = Reconciler::new(Box::new(FakeProcesses::new(Path::new("/none"))));
        for (file, elsewhere) in loaded.iter().zip(&elsewhere) {
            reconciler.note_footprints(&file.processes, &memory, elsewhere);
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
