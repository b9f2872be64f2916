//! The accounting logic, in safe code: charge before the driver is asked,
//! give back after a free succeeds, and report memory as the cap allows.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock};

use gpumem_layout::{self as layout, DeviceSpec, MAX_DEVICES};

use crate::log;
use crate::region::{self, Reaper, Region};

/// Why a call is refused without asking the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    OutOfMemory,
}

const NO_SLOT: usize = usize::MAX;
/// The file was full: count this process in its devices' `overflow` instead.
const PRIVATE_SLOT: usize = usize::MAX - 1;

/// Threads opening the file or waiting for it to open: a child forked then
/// must not wait for an opening that will never finish there.
static OPENING: AtomicUsize = AtomicUsize::new(0);

/// Pauses between the retries of a charge that lost a race near the cap:
/// together (about 50 ms, the charge lock's own patience) long enough for
/// a racer that will back out to do so even if a busy node left it waiting
/// for a CPU in between, short next to what an out-of-memory error costs a
/// program anyway. Only a charge that stays refused waits them all.
const RETRY_PAUSES_US: [u64; 13] = [
    0, 0, 20, 50, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25000,
];

/// A process's view of its container's accounting files: the one in the
/// state directory (Allocate's, or a claim's mounted there before claims
/// had their own place) and one in each `claim-*` directory inside it.
/// Devices are numbered across the files.
pub struct Shim {
    /// Never freed, like the shim itself: each device points at its own.
    files: Vec<&'static File>,
    devices: Vec<Device>,
}

/// One accounting file and this process's place in it.
struct File {
    path: PathBuf,
    region: Region,
    /// This process's slot; reset in a forked child, which must claim its own.
    slot: AtomicUsize,
    /// One claim at a time.
    claim: Mutex<()>,
    /// Whether it was found with every slot taken (said once).
    full: AtomicBool,
}

/// A capped device: its record, and where it is in which file.
struct Device {
    spec: DeviceSpec,
    file: &'static File,
    /// Its position in its file's records.
    record: usize,
    /// This process's charges on it when every slot of its file was taken.
    overflow: AtomicU64,
}

static SHIM: OnceLock<Option<Shim>> = OnceLock::new();

/// The shim's state, opened on first use. `None` means pass-through: the
/// reason was written to stderr once.
pub fn shim() -> Option<&'static Shim> {
    if crate::sigbus::broken() {
        return None;
    }
    if let Some(opened) = SHIM.get() {
        return opened.as_ref();
    }
    // Counted from before the first thread starts the opening until after
    // the last waiter sees it done: a child forked in between finds the
    // opening unfinished, forever, and passes calls through.
    struct Opening;
    impl Drop for Opening {
        fn drop(&mut self) {
            OPENING.fetch_sub(1, SeqCst);
        }
    }
    OPENING.fetch_add(1, SeqCst);
    let _counted = Opening;
    SHIM.get_or_init(open).as_ref()
}

/// The shim's state for a CUDA call, which may take the shim's locks.
pub fn cuda_shim() -> Option<&'static Shim> {
    let shim = shim()?;
    crate::fork::engage();
    Some(shim)
}

/// Whether a thread is opening the file right now.
pub fn opening() -> bool {
    OPENING.load(SeqCst) > 0
}

fn open() -> Option<Shim> {
    let dir = std::env::var_os("GPUMEM_STATE_DIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(layout::CONTAINER_DIR), PathBuf::from);
    let own = dir.join(layout::FILE_NAME);
    // A claim's directory is mounted under its own name: sorted, so every
    // process of the container numbers and prefers them alike.
    let mut claims: Vec<PathBuf> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let name = entry.file_name();
            let claim = name.to_str()?.starts_with(layout::CLAIM_DIR_PREFIX);
            claim.then(|| entry.path().join(layout::FILE_NAME))
        })
        .filter(|path| path.is_file())
        .collect();
    claims.sort();
    let mut paths: Vec<PathBuf> = if claims.is_empty() || own.exists() {
        std::iter::once(own).chain(claims).collect()
    } else {
        claims
    };
    // Each file caps a device at least.
    for path in paths.drain(MAX_DEVICES.min(paths.len())..) {
        log::warn(&format!(
            "accounting file {} is past the {MAX_DEVICES} a process can be capped by; GPU \
             memory is NOT capped in this process on its devices",
            path.display()
        ));
    }
    // With several files, a broken one costs only its own devices their cap.
    let whose = if paths.len() > 1 {
        " on its devices"
    } else {
        ""
    };
    let mut regions = Vec::new();
    for path in paths {
        match Region::open(&path) {
            Ok(region) => {
                log::info(&format!(
                    "capping {} device(s) from {}",
                    region.devices().len(),
                    path.display()
                ));
                // No thread of this image has a slot yet: one with this
                // PID is an image's before an exec. Freed here, in every
                // file, not only in those this image will claim in.
                region.reap(Reaper::Claiming, None);
                regions.push((path, region));
            }
            Err(err) => log::warn(&format!(
                "accounting file {} unusable ({err}); GPU memory is NOT capped in this \
                 process{whose}",
                path.display()
            )),
        }
    }
    (!regions.is_empty()).then(|| Shim::over(regions))
}

/// Forgets this process's slot and charges: called in a forked child, whose
/// record locks were not inherited and whose CUDA state is unusable.
pub fn forget_after_fork() {
    if let Some(Some(shim)) = SHIM.get() {
        for file in &shim.files {
            file.slot.store(NO_SLOT, SeqCst);
            file.region.forget_turn();
        }
        for device in &shim.devices {
            device.overflow.store(0, SeqCst);
        }
    }
}

impl Shim {
    /// The shim over the files opened, in order: a device in two files is
    /// capped by the first.
    fn over(regions: Vec<(PathBuf, Region)>) -> Shim {
        let mut devices: Vec<Device> = Vec::new();
        let mut files: Vec<&'static File> = Vec::new();
        for (path, region) in regions {
            let file: &'static File = Box::leak(Box::new(File {
                path,
                region,
                slot: AtomicUsize::new(NO_SLOT),
                claim: Mutex::new(()),
                full: AtomicBool::new(false),
            }));
            for (record, spec) in file.region.devices().iter().enumerate() {
                let uuid = layout::format_uuid(&spec.uuid);
                if let Some(first) = devices.iter().find(|d| d.spec.uuid == spec.uuid) {
                    log::warn(&format!(
                        "{uuid} is capped by {}; its cap in {} is not used",
                        first.file.path.display(),
                        file.path.display()
                    ));
                } else if devices.len() == MAX_DEVICES {
                    log::warn(&format!(
                        "{uuid} in {} is past the {MAX_DEVICES} devices a process can be \
                         capped on; GPU memory is NOT capped on it",
                        file.path.display()
                    ));
                } else {
                    devices.push(Device {
                        spec: *spec,
                        file,
                        record,
                        overflow: AtomicU64::new(0),
                    });
                }
            }
            files.push(file);
        }
        Shim { files, devices }
    }

    /// A shim over a new accounting file of one device capped at `cap`,
    /// apart from the process's own: for tests of the accounting logic.
    #[cfg(test)]
    pub fn for_test(cap: u64) -> &'static Shim {
        let region = Region::for_test(cap);
        Box::leak(Box::new(Shim::over(vec![(PathBuf::new(), region)])))
    }

    /// Position of a device among the capped ones, by its 16-byte UUID.
    pub fn device_of(&self, uuid: &[u8; 16]) -> Option<usize> {
        self.devices.iter().position(|d| &d.spec.uuid == uuid)
    }

    /// The file that caps `dev`, and the device's record in it.
    #[inline]
    fn file_of(&self, dev: usize) -> (&File, usize) {
        let device = &self.devices[dev];
        (device.file, device.record)
    }

    pub fn uuid(&self, dev: usize) -> [u8; 16] {
        self.devices[dev].spec.uuid
    }

    pub fn cap(&self, dev: usize) -> u64 {
        self.devices[dev].spec.cap_bytes
    }

    /// What the plugin says a context costs, for when it cannot be measured.
    pub fn context_hint(&self, dev: usize) -> u64 {
        self.devices[dev].spec.context_charge_bytes
    }

    /// This process's counter for `dev`, if it has a slot in its file.
    #[inline]
    fn own_counter(&self, dev: usize) -> Option<&AtomicU64> {
        let (file, record) = self.file_of(dev);
        match file.slot.load(SeqCst) {
            NO_SLOT => None,
            PRIVATE_SLOT => Some(&self.devices[dev].overflow),
            index => Some(file.region.file().used_counter(index, record)),
        }
    }

    /// Says in this process's slot that it is making a context on `dev`
    /// (or changing what one reserves), until the guard drops: the driver
    /// takes the context's memory before the shim can measure and charge
    /// it, and the node daemon, seeing it in NVML meanwhile, would publish
    /// it as untracked on top of the charge to come.
    pub fn making_context(&self, dev: usize) -> MakingContext<'_> {
        let (file, record) = self.file_of(dev);
        let flag = match file.slot.load(SeqCst) {
            NO_SLOT | PRIVATE_SLOT => None,
            index => Some(file.region.file().creating(index)),
        };
        let bit = 1u64 << record;
        if let Some(flag) = flag {
            flag.fetch_or(bit, SeqCst);
        }
        MakingContext { flag, bit }
    }

    /// What this process is charged on `dev`.
    pub fn own_charges(&self, dev: usize) -> u64 {
        self.own_counter(dev).map_or(0, |c| c.load(SeqCst))
    }

    /// This process's counter for `dev`, claiming a slot on first use.
    #[inline]
    fn counter(&self, dev: usize) -> &AtomicU64 {
        self.own_counter(dev).unwrap_or_else(|| self.register(dev))
    }

    /// Claims this process's slot in `dev`'s file if it has none: from its
    /// first context on, even with nothing charged, its record lock is how
    /// the node daemon finds its untracked usage in NVML.
    pub fn claim_slot(&self, dev: usize) {
        self.counter(dev);
    }

    #[cold]
    fn register(&self, dev: usize) -> &AtomicU64 {
        let (file, record) = self.file_of(dev);
        let _one_at_a_time = crate::fork::lock(&file.claim);
        let mut slot = file.slot.load(SeqCst);
        if slot == NO_SLOT {
            let pid = std::process::id();
            let start = region::start_time_of(pid).unwrap_or(0);
            // Slots an earlier image of this process left before an exec
            // go first: they carry this pid and start time.
            file.region.reap(Reaper::Claiming, None);
            slot = file.region.claim(pid, start).unwrap_or_else(|| {
                log::warn_once(
                    &file.full,
                    &format!(
                        "all {} slots of {} are in use; this process is capped on its own \
                         on its devices",
                        file.region.file().slot_count(),
                        file.path.display()
                    ),
                );
                PRIVATE_SLOT
            });
            file.slot.store(slot, SeqCst);
        }
        match slot {
            PRIVATE_SLOT => &self.devices[dev].overflow,
            index => file.region.file().used_counter(index, record),
        }
    }

    /// Bytes in use on `dev` by the whole container.
    #[inline]
    pub fn used(&self, dev: usize) -> u64 {
        let (file, record) = self.file_of(dev);
        let private = if file.slot.load(SeqCst) == PRIVATE_SLOT {
            self.devices[dev].overflow.load(SeqCst)
        } else {
            0
        };
        file.region.file().used(record).saturating_add(private)
    }

    /// Adds `bytes` to this process's charge unless the container would go
    /// over its cap. Increment-then-validate: of two processes racing for
    /// the last bytes, at most one keeps them, never both; and the loser
    /// retries in turn with the others that lost, so that never both are
    /// refused when one of them fits.
    pub fn charge(&self, dev: usize, bytes: u64) -> Result<(), Refusal> {
        if bytes == 0 {
            return Ok(());
        }
        let cap = self.cap(dev);
        if bytes > cap {
            // Never add a sum that could wrap the shared counter.
            self.note_oom(dev);
            return Err(Refusal::OutOfMemory);
        }
        let counter = self.counter(dev);
        if self.try_add(counter, dev, bytes, cap) {
            return Ok(());
        }
        self.charge_contended(counter, dev, bytes, cap)
    }

    #[inline]
    fn try_add(&self, counter: &AtomicU64, dev: usize, bytes: u64, cap: u64) -> bool {
        counter.fetch_add(bytes, SeqCst);
        let total = self.used(dev);
        if total <= cap {
            let (file, record) = self.file_of(dev);
            file.region.file().note_peak(record, total);
            return true;
        }
        counter.fetch_sub(bytes, SeqCst);
        false
    }

    fn note_oom(&self, dev: usize) {
        let (file, record) = self.file_of(dev);
        file.region.file().note_oom(record);
    }

    /// The slow path: over the cap on the first try. Racers that failed
    /// alike take turns under the container's charge lock, so a transient
    /// charge of another loser (added, about to be backed out) cannot
    /// refuse this one; a dead process's budget is reaped first.
    #[cold]
    fn charge_contended(
        &self,
        counter: &AtomicU64,
        dev: usize,
        bytes: u64,
        cap: u64,
    ) -> Result<(), Refusal> {
        let _turn = self.file_of(dev).0.region.lock_charges();
        self.reap(dev);
        for pause in RETRY_PAUSES_US {
            match pause {
                0 => std::thread::yield_now(),
                us => std::thread::sleep(std::time::Duration::from_micros(us)),
            }
            if self.try_add(counter, dev, bytes, cap) {
                return Ok(());
            }
        }
        self.note_oom(dev);
        log::debug(|| format!("refused {bytes} bytes on device {dev}: cap {cap}"));
        Err(Refusal::OutOfMemory)
    }

    /// Frees the slots of dead processes in `dev`'s file (not on the
    /// allocation fast path: at registration, on a refusal, and before
    /// reporting usage).
    fn reap(&self, dev: usize) {
        let (file, _) = self.file_of(dev);
        let own = Some(file.slot.load(SeqCst)).filter(|&s| s < file.region.file().slot_count());
        file.region.reap(Reaper::Running, own);
    }

    /// Gives back bytes charged earlier; never wraps below zero.
    pub fn uncharge(&self, dev: usize, bytes: u64) {
        // No slot: nothing of ours to give back, and no reason to claim one.
        if let Some(counter) = self.own_counter(dev) {
            let _ = counter.fetch_update(SeqCst, SeqCst, |v| Some(v.saturating_sub(bytes)));
        }
    }

    /// Moves a charge of `charged` bytes to `actual`: more is charged
    /// against the cap, less is given back.
    #[inline]
    pub fn settle(&self, dev: usize, charged: u64, actual: u64) -> Result<(), Refusal> {
        match actual.cmp(&charged) {
            std::cmp::Ordering::Greater => self.charge(dev, actual - charged),
            std::cmp::Ordering::Less => {
                self.uncharge(dev, charged - actual);
                Ok(())
            }
            std::cmp::Ordering::Equal => Ok(()),
        }
    }

    /// Moves a charge of `charged` bytes to `actual` without asking the
    /// cap: for memory the driver holds already, which a refusal would not
    /// give back.
    pub fn settle_held(&self, dev: usize, charged: u64, actual: u64) {
        match actual.cmp(&charged) {
            std::cmp::Ordering::Greater => {
                self.counter(dev).fetch_add(actual - charged, SeqCst);
            }
            std::cmp::Ordering::Less => self.uncharge(dev, charged - actual),
            std::cmp::Ordering::Equal => {}
        }
    }

    /// `cuMemGetInfo` as the container should see it: total is the cap,
    /// free is what is left of it (never more than the device really has).
    pub fn cuda_info(&self, dev: usize, free: u64, total: u64) -> (u64, u64) {
        self.reap(dev);
        let cap = self.cap(dev).min(total);
        let left = cap.saturating_sub(self.used(dev));
        (left.min(free), cap)
    }

    /// NVML's (total, used, free) for the container: total is the cap and
    /// used is the container's own usage, so used + free = total.
    pub fn nvml_info(&self, dev: usize, real_total: u64) -> (u64, u64, u64) {
        self.reap(dev);
        let cap = self.cap(dev).min(real_total);
        let used = self.used(dev).min(cap);
        (cap, used, cap - used)
    }
}

/// A context being made (see `Shim::making_context`); cleared on drop.
pub struct MakingContext<'a> {
    flag: Option<&'a AtomicU64>,
    bit: u64,
}

impl Drop for MakingContext<'_> {
    fn drop(&mut self) {
        if let Some(flag) = self.flag {
            flag.fetch_and(!self.bit, SeqCst);
        }
    }
}
