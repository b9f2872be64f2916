//! The accounting logic, in safe code: charge before the driver is asked,
//! give back after a free succeeds, and report memory as the cap allows.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Mutex, OnceLock};

use gpumem_layout::{self as layout, MAX_DEVICES};

use crate::log;
use crate::region::{self, Region};

/// Why a call is refused without asking the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    OutOfMemory,
}

/// Bytes the driver really takes for a request of `requested` bytes: large
/// allocations are rounded up to 2 MiB pages (measured on the H100: 2 MiB+1
/// costs 4 MiB, 64 MiB+1 costs 66 MiB); smaller ones share pages and are
/// charged in 64 KiB steps (1 MiB costs 1 MiB).
pub fn charge_size(requested: u64) -> u64 {
    const PAGE: u64 = 2 << 20;
    const SMALL: u64 = 64 << 10;
    let step = if requested > PAGE { PAGE } else { SMALL };
    requested.div_ceil(step).saturating_mul(step)
}

const NO_SLOT: usize = usize::MAX;
/// The file was full: count this process in `OVERFLOW` instead.
const PRIVATE_SLOT: usize = usize::MAX - 1;

/// This process's slot; reset in a forked child, which must claim its own.
static SLOT: AtomicUsize = AtomicUsize::new(NO_SLOT);
static CLAIM: Mutex<()> = Mutex::new(());
static OVERFLOW: [AtomicU64; MAX_DEVICES] = [const { AtomicU64::new(0) }; MAX_DEVICES];
static CONTEXT_CHARGED: [AtomicBool; MAX_DEVICES] = [const { AtomicBool::new(false) }; MAX_DEVICES];
static FULL: AtomicBool = AtomicBool::new(false);
static MISSING: AtomicBool = AtomicBool::new(false);

/// A process's view of its container's accounting file.
pub struct Shim {
    region: Region,
}

static SHIM: OnceLock<Option<Shim>> = OnceLock::new();

/// The shim's state, opened on first use. `None` means pass-through: the
/// reason was written to stderr once.
pub fn shim() -> Option<&'static Shim> {
    SHIM.get_or_init(open).as_ref()
}

fn open() -> Option<Shim> {
    let dir = std::env::var_os("GPUMEM_STATE_DIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(layout::CONTAINER_DIR), PathBuf::from);
    let path = dir.join(layout::FILE_NAME);
    match Region::open(&path) {
        Ok(region) => {
            log::info(&format!(
                "capping {} device(s) from {}",
                region.devices().len(),
                path.display()
            ));
            Some(Shim { region })
        }
        Err(err) => {
            log::warn_once(
                &MISSING,
                &format!(
                    "accounting file {} unusable ({err}); GPU memory is NOT capped in this process",
                    path.display()
                ),
            );
            None
        }
    }
}

/// Forgets this process's slot and charges: called in a forked child, whose
/// record locks were not inherited and whose CUDA state is unusable.
pub fn forget_after_fork() {
    SLOT.store(NO_SLOT, SeqCst);
    for counter in &OVERFLOW {
        counter.store(0, SeqCst);
    }
    for flag in &CONTEXT_CHARGED {
        flag.store(false, SeqCst);
    }
}

impl Shim {
    /// Position of a device in the file, by its 16-byte UUID.
    pub fn device_of(&self, uuid: &[u8; 16]) -> Option<usize> {
        self.region.devices().iter().position(|d| &d.uuid == uuid)
    }

    pub fn cap(&self, dev: usize) -> u64 {
        self.region.devices()[dev].cap_bytes
    }

    /// This process's counter for `dev`, if it has a slot.
    fn own_counter(&self, dev: usize) -> Option<&AtomicU64> {
        match SLOT.load(SeqCst) {
            NO_SLOT => None,
            PRIVATE_SLOT => Some(&OVERFLOW[dev]),
            index => Some(self.region.used_counter(index, dev)),
        }
    }

    /// This process's counter for `dev`, claiming a slot on first use.
    fn counter(&self, dev: usize) -> &AtomicU64 {
        self.own_counter(dev).unwrap_or_else(|| self.register(dev))
    }

    #[cold]
    fn register(&self, dev: usize) -> &AtomicU64 {
        let _one_at_a_time = CLAIM.lock().unwrap_or_else(|e| e.into_inner());
        let mut slot = SLOT.load(SeqCst);
        if slot == NO_SLOT {
            crate::fork::watch();
            let pid = std::process::id();
            let start = region::start_time_of(pid).unwrap_or(0);
            slot = match self.region.claim(pid, start) {
                Some(index) => index,
                None => {
                    self.region.reap(None);
                    self.region.claim(pid, start).unwrap_or_else(|| {
                        log::warn_once(
                            &FULL,
                            &format!(
                                "all {} accounting slots are in use; this process is capped on its own",
                                self.region.slot_count()
                            ),
                        );
                        PRIVATE_SLOT
                    })
                }
            };
            SLOT.store(slot, SeqCst);
        }
        match slot {
            PRIVATE_SLOT => &OVERFLOW[dev],
            index => self.region.used_counter(index, dev),
        }
    }

    /// Bytes in use on `dev` by the whole container.
    pub fn used(&self, dev: usize) -> u64 {
        let private = if SLOT.load(SeqCst) == PRIVATE_SLOT {
            OVERFLOW[dev].load(SeqCst)
        } else {
            0
        };
        self.region.used(dev).saturating_add(private)
    }

    /// Adds `bytes` to this process's charge unless the container would go
    /// over its cap. Increment-then-validate: of two processes racing for
    /// the last bytes, at most one keeps them, never both.
    pub fn charge(&self, dev: usize, bytes: u64) -> Result<(), Refusal> {
        if bytes == 0 {
            return Ok(());
        }
        let cap = self.cap(dev);
        if bytes > cap {
            // Never add a sum that could wrap the shared counter.
            self.region.note_oom(dev);
            return Err(Refusal::OutOfMemory);
        }
        let counter = self.counter(dev);
        for attempt in 0..2 {
            counter.fetch_add(bytes, SeqCst);
            let total = self.used(dev);
            if total <= cap {
                self.region.note_peak(dev, total);
                return Ok(());
            }
            counter.fetch_sub(bytes, SeqCst);
            if attempt == 0 {
                // A dead process may still hold budget; a racing one may
                // have backed out already.
                self.reap();
            }
        }
        self.region.note_oom(dev);
        log::debug(|| format!("refused {bytes} bytes on device {dev}: cap {cap}"));
        Err(Refusal::OutOfMemory)
    }

    /// Frees the slots of dead processes (not on the allocation fast path:
    /// at registration, on a refusal, and before reporting usage).
    fn reap(&self) {
        let own = Some(SLOT.load(SeqCst)).filter(|&s| s < self.region.slot_count());
        self.region.reap(own);
    }

    /// Gives back bytes charged earlier; never wraps below zero.
    pub fn uncharge(&self, dev: usize, bytes: u64) {
        // No slot (a forked child freeing its parent's memory): nothing of
        // ours to give back, and no reason to claim a slot for it.
        if let Some(counter) = self.own_counter(dev) {
            let _ = counter.fetch_update(SeqCst, SeqCst, |v| Some(v.saturating_sub(bytes)));
        }
    }

    /// Charges the per-process context cost once per device.
    pub fn charge_context(&self, dev: usize) -> Result<(), Refusal> {
        // A plain load first: this runs on every allocation.
        if CONTEXT_CHARGED[dev].load(SeqCst) || CONTEXT_CHARGED[dev].swap(true, SeqCst) {
            return Ok(());
        }
        // A slot from the first context on, even with nothing to charge:
        // its record lock is how the node daemon finds this process's
        // untracked usage (the context itself, libraries) in NVML.
        self.counter(dev);
        let bytes = self.region.devices()[dev].context_charge_bytes;
        self.charge(dev, bytes)
            .inspect_err(|_| CONTEXT_CHARGED[dev].store(false, SeqCst))
    }

    /// `cuMemGetInfo` as the container should see it: total is the cap,
    /// free is what is left of it (never more than the device really has).
    pub fn cuda_info(&self, dev: usize, free: u64, total: u64) -> (u64, u64) {
        self.reap();
        let cap = self.cap(dev).min(total);
        let left = cap.saturating_sub(self.used(dev));
        (left.min(free), cap)
    }

    /// NVML's (total, used, free) for the container: total is the cap and
    /// used is the container's own usage, so used + free = total.
    pub fn nvml_info(&self, dev: usize, real_total: u64) -> (u64, u64, u64) {
        self.reap();
        let cap = self.cap(dev).min(real_total);
        let used = self.used(dev).min(cap);
        (cap, used, cap - used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn charges_follow_the_drivers_rounding() {
        assert_eq!(charge_size(0), 0);
        assert_eq!(charge_size(1), 64 << 10);
        assert_eq!(charge_size(MIB), MIB);
        assert_eq!(charge_size(2 * MIB), 2 * MIB);
        assert_eq!(charge_size(2 * MIB + 1), 4 * MIB);
        assert_eq!(charge_size(3 * MIB), 4 * MIB);
        assert_eq!(charge_size(64 * MIB + 1), 66 * MIB);
        assert_eq!(charge_size(u64::MAX), u64::MAX);
    }
}
