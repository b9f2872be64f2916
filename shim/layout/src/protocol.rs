//! The rules every process that touches an accounting file follows, written
//! once over its words: slot claims and reaping, the container's sum, the
//! peak and refusal counters, and the daemon's published untracked figure.
//!
//! The shim runs these over its shared mapping; the daemon over a
//! [`Snapshot`] it read from the file, and it publishes with the writes
//! [`publish_writes`] lists. One state machine, on each slot's state word
//! (`generation << 8 | state`):
//!
//! ```text
//!   FREE ──claim──▶ ALIVE ──reap──▶ REAPING ──finish──▶ FREE
//!    ▲                                  (under the slot's lock: counters
//!    │                                   := 0, same generation)
//!    └─ a claimer that dies before its CAS leaves the slot FREE: the kernel
//!       drops its lock, and nothing else was published
//! ```
//!
//! - claim (the process itself): its record lock on the slot's first byte
//!   first, then counters, pid and start time, then the header's high-water
//!   mark raised past the slot, then CAS FREE → ALIVE one generation on. A
//!   live slot therefore always shows a lock, and a slot whose state word
//!   ever left its first value (zero) lies below the mark.
//! - reap (any shim of the container): an ALIVE slot whose lock is gone and
//!   whose process the caller finds dead, reused or exec'd; CAS ALIVE →
//!   REAPING, then finish it: take the slot's record lock, and if the state
//!   word is still that REAPING one, counters := 0, store FREE, unlock. A
//!   REAPING slot whose lock can be taken is finished alike by whoever finds
//!   it: its reaper died between the CAS and the store (or has not locked
//!   it yet, and then finds it FREE and leaves it).
//! - `used[dev]` of a slot: written only by its owner, zeroed under the
//!   slot's lock by a claimer or a reaper. Peak and refusals: atomic max / add by any shim.
//! - observed extra: the daemon only, with file writes under the device's
//!   sequence word (odd, value, even), publishers taking turns on the lock
//!   byte past the end of the file; read as a seqlock.
//! - the charge lock byte (one further): shims that lost a race near the cap
//!   retry under it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::sync::OnceLock;

use crate::{device, device_offset, get_u32, get_u64, header, slot, slot_offset, state};
use crate::{validate, Geometry, LayoutError, HEADER_LEN};

/// The file's mutable words as atomics: the shim's shared mapping, or the
/// daemon's [`Snapshot`]. [`AccountingFile`] asks only for offsets of fields
/// of its geometry, for slots below its slot count and the devices callers
/// name (which they take from the file's own device records): 8- or
/// 4-aligned and inside the file.
pub trait Words {
    fn u64_at(&self, offset: usize) -> &AtomicU64;
    fn u32_at(&self, offset: usize) -> &AtomicU32;
}

/// Reads of a changing `OBSERVED_EXTRA` before giving up on a stable one:
/// a few microseconds, longer than the daemon's update takes.
pub const OBSERVED_SPINS: u32 = 256;

/// The byte whose record lock a slot's owner holds for as long as it has
/// the file open: the slot's first. The kernel drops it when the process
/// dies or execs, and `F_GETLK` names the holder.
#[inline]
pub fn slot_lock_offset(geometry: Geometry, index: usize) -> usize {
    slot_offset(geometry.devices, index)
}

/// The byte a node daemon locks while it rewrites `OBSERVED_EXTRA`, so two
/// publishers (two `gpumem exec` sharing a directory) take turns: just past
/// the end of the file, where no slot lock can be.
pub fn publisher_lock_offset(geometry: Geometry) -> usize {
    geometry.file_len()
}

/// The byte a shim locks while it retries a charge that lost a race near
/// the cap, so that of several processes racing for the last bytes one
/// wins instead of all backing out together.
pub fn charge_lock_offset(geometry: Geometry) -> usize {
    geometry.file_len() + 1
}

/// Where device `dev`'s `OBSERVED_SEQ` is: a publisher reads it under the
/// publisher lock and hands it to [`publish_writes`].
pub fn observed_seq_offset(dev: usize) -> usize {
    device_offset(dev) + device::OBSERVED_SEQ
}

/// The writes, in order, that publish `value` as device `dev`'s observed
/// extra, given its sequence word `seq` now: the sequence to odd (the next
/// odd one, also after a publisher that died mid-update left it odd), the
/// value, the sequence to even. A publisher without atomics on the page
/// applies them as file writes, under the publisher lock.
pub fn publish_writes(dev: usize, seq: u64, value: u64) -> [(usize, u64); 3] {
    let odd = seq.wrapping_add(1) | 1;
    let seq_at = observed_seq_offset(dev);
    [
        (seq_at, odd),
        (device_offset(dev) + device::OBSERVED_EXTRA, value),
        (seq_at, odd.wrapping_add(1)),
    ]
}

/// A slot's state word: `generation << 8 | state`. The generation, one more
/// at each claim, keeps a compare-and-swap from mistaking a slot reaped and
/// claimed again for the one it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateWord(pub u64);

impl StateWord {
    /// The low byte: one of [`state`]'s values.
    #[inline]
    pub fn state(self) -> u64 {
        self.0 & 0xff
    }

    #[inline]
    pub fn generation(self) -> u64 {
        self.0 >> 8
    }

    /// What a claim of this FREE slot publishes: ALIVE, one generation on.
    #[inline]
    pub fn claimed(self) -> StateWord {
        StateWord((self.generation().wrapping_add(1) << 8) | state::ALIVE)
    }

    /// What a reaper of this ALIVE slot publishes first, before it takes
    /// the slot's lock: same generation.
    #[inline]
    pub fn reaping(self) -> StateWord {
        StateWord((self.0 & !0xff) | state::REAPING)
    }

    /// What a reaper publishes once the counters are zero: same generation.
    #[inline]
    pub fn freed(self) -> StateWord {
        StateWord((self.0 & !0xff) | state::FREE)
    }
}

/// Who a slot says it belongs to: pid (in the owner's PID namespace) and
/// start time in clock ticks since boot, so a reused pid is told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub pid: u64,
    pub start_time: u64,
}

/// A process's start time in clock ticks since boot, from the text of its
/// `/proc/<pid>/stat` (field 22): what tells a reused pid apart, for the
/// shim's reaping and the daemon's over-cap action alike.
pub fn start_time_in_stat(stat: &str) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses; fields
    // after the last ')' are plain. Field 22 is the 20th after it.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(19)?.parse().ok()
}

/// A slot's state, owner pid and usage per device, as read at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotView {
    pub index: usize,
    /// The state word's low byte (see [`state`]).
    pub state: u64,
    pub pid: u64,
    pub used: Vec<u64>,
    /// The devices (bit per device of the file) it is making a context on.
    pub creating: u64,
}

/// An accounting file seen through its words, with the protocol on them.
pub struct AccountingFile<W> {
    words: W,
    geometry: Geometry,
}

impl<W: Words> AccountingFile<W> {
    /// `words` must cover a file of `geometry` (as `validate` found it).
    pub fn new(words: W, geometry: Geometry) -> Self {
        AccountingFile { words, geometry }
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    pub fn slot_count(&self) -> usize {
        self.geometry.slots
    }

    #[inline]
    fn slot_field(&self, index: usize, field: usize) -> &AtomicU64 {
        debug_assert!(index < self.geometry.slots);
        self.words
            .u64_at(slot_offset(self.geometry.devices, index) + field)
    }

    #[inline]
    fn device_field(&self, dev: usize, field: usize) -> &AtomicU64 {
        debug_assert!(dev < self.geometry.devices);
        self.words.u64_at(device_offset(dev) + field)
    }

    fn state_word(&self, index: usize) -> &AtomicU64 {
        self.slot_field(index, slot::STATE)
    }

    pub fn state(&self, index: usize) -> StateWord {
        StateWord(self.state_word(index).load(SeqCst))
    }

    /// The counter slot `index` keeps for device `dev`.
    #[inline]
    pub fn used_counter(&self, index: usize, dev: usize) -> &AtomicU64 {
        debug_assert!(dev < self.geometry.devices);
        self.slot_field(index, slot::USED + 8 * dev)
    }

    /// The bits of the devices slot `index`'s owner is making a context on
    /// (see `slot::CREATING`): set and cleared by the owner, zeroed with
    /// its counters by a claimer or a reaper.
    pub fn creating(&self, index: usize) -> &AtomicU64 {
        self.slot_field(index, slot::CREATING)
    }

    pub fn owner(&self, index: usize) -> Owner {
        Owner {
            pid: self.slot_field(index, slot::PID).load(SeqCst),
            start_time: self.slot_field(index, slot::START_TIME).load(SeqCst),
        }
    }

    /// One past the highest slot ever claimed: no slot beyond holds anything.
    #[inline]
    pub fn high_water(&self) -> usize {
        (self.words.u32_at(header::SLOT_HWM).load(SeqCst) as usize).min(self.geometry.slots)
    }

    /// Bytes charged on `dev` by every slot, plus what the node daemon
    /// observed beyond that; saturating, never wrapping.
    #[inline]
    pub fn used(&self, dev: usize) -> u64 {
        let slots = (0..self.high_water())
            .map(|i| self.used_counter(i, dev).load(SeqCst))
            .fold(0u64, u64::saturating_add);
        slots.saturating_add(self.observed_extra(dev))
    }

    /// The daemon's last complete `OBSERVED_EXTRA` for `dev`. The daemon
    /// writes it with plain file writes between two writes of the sequence
    /// word (odd in between); a value read while the sequence is odd or
    /// changes may be half-written, so it is read again. A daemon that died
    /// mid-update leaves the sequence odd but the value whole: after a
    /// short spin (an update takes microseconds) the value is taken as is.
    #[inline]
    pub fn observed_extra(&self, dev: usize) -> u64 {
        let seq = self.device_field(dev, device::OBSERVED_SEQ);
        let value = self.device_field(dev, device::OBSERVED_EXTRA);
        let mut read = 0;
        for _ in 0..OBSERVED_SPINS {
            let before = seq.load(SeqCst);
            read = value.load(SeqCst);
            if before & 1 == 0 && seq.load(SeqCst) == before {
                return read;
            }
            std::hint::spin_loop();
        }
        read
    }

    /// The highest total a successful charge saw on `dev`.
    pub fn peak(&self, dev: usize) -> u64 {
        self.device_field(dev, device::PEAK).load(SeqCst)
    }

    /// Allocations refused for the cap on `dev`.
    pub fn refusals(&self, dev: usize) -> u64 {
        self.device_field(dev, device::OOM_COUNT).load(SeqCst)
    }

    /// Notes the total a successful charge saw.
    #[inline]
    pub fn note_peak(&self, dev: usize, total: u64) {
        let peak = self.device_field(dev, device::PEAK);
        // A read first: once the peak is reached, charges stop writing the
        // device record's cache line, which every check reads.
        if total > peak.load(SeqCst) {
            peak.fetch_max(total, SeqCst);
        }
    }

    /// Counts an allocation refused for the cap.
    pub fn note_oom(&self, dev: usize) {
        self.device_field(dev, device::OOM_COUNT)
            .fetch_add(1, SeqCst);
    }

    /// Claims a free slot for `owner`. `lock` takes a slot's record lock
    /// without waiting (false if another holds it), `unlock` gives it back.
    /// Lock first, so a claimer killed at any step leaves either a FREE slot
    /// (the kernel drops the lock) or an ALIVE slot without a lock, which
    /// reaping frees. Only the lock holder writes a FREE slot (a reaper
    /// stores FREE under the lock too), so pid, start time and counters are
    /// set before ALIVE is published. On success the caller keeps the lock.
    ///
    /// Record locks belong to the process, not the thread: the caller keeps
    /// its other threads from claiming or reaping in the same file at once.
    pub fn claim(
        &self,
        owner: Owner,
        mut lock: impl FnMut(usize) -> bool,
        mut unlock: impl FnMut(usize),
    ) -> Option<usize> {
        for index in 0..self.geometry.slots {
            if self.state(index).state() != state::FREE || !lock(index) {
                continue;
            }
            // Reaped and reclaimed meanwhile? Only FREE under our lock is ours.
            let current = self.state(index);
            if current.state() != state::FREE {
                unlock(index);
                continue;
            }
            for dev in 0..self.geometry.devices {
                self.used_counter(index, dev).store(0, SeqCst);
            }
            self.creating(index).store(0, SeqCst);
            self.slot_field(index, slot::PID).store(owner.pid, SeqCst);
            self.slot_field(index, slot::START_TIME)
                .store(owner.start_time, SeqCst);
            self.words
                .u32_at(header::SLOT_HWM)
                .fetch_max(index as u32 + 1, SeqCst);
            if self
                .state_word(index)
                .compare_exchange(current.0, current.claimed().0, SeqCst, SeqCst)
                .is_err()
            {
                unlock(index);
                continue;
            }
            return Some(index);
        }
        None
    }

    /// Frees the ALIVE slots (but `own`) that `abandoned` says their owner
    /// left behind: the caller's verdict, from the slot's lock being gone
    /// and the owner being dead, reused or exec'd. Also finishes the
    /// REAPING slots whose lock is free: a reaper killed midway left them,
    /// with counters still counted. `lock` and `unlock` as for a claim.
    /// Returns how many slots it freed.
    pub fn reap(
        &self,
        own: Option<usize>,
        mut lock: impl FnMut(usize) -> bool,
        mut unlock: impl FnMut(usize),
        mut abandoned: impl FnMut(usize, Owner) -> bool,
    ) -> usize {
        let mut reaped = 0;
        for index in 0..self.high_water() {
            if Some(index) == own {
                continue;
            }
            let current = self.state(index);
            let reaping = match current.state() {
                state::ALIVE if abandoned(index, self.owner(index)) => {
                    // A reclaimed slot has a new generation: the CAS fails.
                    let reaping = current.reaping();
                    if self
                        .state_word(index)
                        .compare_exchange(current.0, reaping.0, SeqCst, SeqCst)
                        .is_err()
                    {
                        continue;
                    }
                    reaping
                }
                state::REAPING => current,
                _ => continue,
            };
            if self.finish_reaping(index, reaping, &mut lock, &mut unlock) {
                reaped += 1;
            }
        }
        reaped
    }

    /// Zeroes a REAPING slot's counters and frees it, under its lock: a
    /// reaper that holds the lock is alive and finishing it, and once the
    /// lock is ours the state word can only change under it. The CAS came
    /// before the lock, so the daemon, which takes a locked ALIVE slot for
    /// its owner's, can tell a reaper's lock from the owner's: with the lock
    /// held the state word is no longer that ALIVE one.
    fn finish_reaping(
        &self,
        index: usize,
        reaping: StateWord,
        lock: &mut impl FnMut(usize) -> bool,
        unlock: &mut impl FnMut(usize),
    ) -> bool {
        if !lock(index) {
            return false;
        }
        // Finished by another meanwhile (and perhaps claimed again): a
        // different word, and nothing of ours to do.
        let ours = self.state(index) == reaping;
        if ours {
            for dev in 0..self.geometry.devices {
                self.used_counter(index, dev).store(0, SeqCst);
            }
            self.creating(index).store(0, SeqCst);
            self.state_word(index).store(reaping.freed().0, SeqCst);
        }
        unlock(index);
        ours
    }

    /// The slots ever claimed (up to the high-water mark), as they read now.
    pub fn slots(&self) -> Vec<SlotView> {
        (0..self.high_water())
            .map(|index| SlotView {
                index,
                state: self.state(index).state(),
                pid: self.owner(index).pid,
                used: (0..self.geometry.devices)
                    .map(|dev| self.used_counter(index, dev).load(SeqCst))
                    .collect(),
                creating: self.creating(index).load(SeqCst),
            })
            .collect()
    }
}

/// A copy of an accounting file in memory, for a reader that does not map
/// it (the daemon): read by the same rules as the shim's mapping. What is
/// stored to it stays in the copy.
///
/// Only the header, the device records and the slots ever claimed are
/// copied: a node daemon reads every container's file every few seconds,
/// and most of a file is slots no process has taken (256, of which a
/// container uses a few). The slots past them read as they were, FREE and
/// empty; they are made, zero, for a caller that writes there (a claim on
/// the copy).
pub struct Snapshot {
    /// The header's words as u32 (all of the file's u32 fields are there).
    header: [AtomicU32; HEADER_LEN / 4],
    /// The file up to the end of the last slot copied.
    copied: Box<[AtomicU64]>,
    /// The slots past it, made on first use.
    rest: OnceLock<Box<[AtomicU64]>>,
    /// Their length in words.
    rest_words: usize,
}

impl Words for Snapshot {
    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8));
        let word = offset / 8;
        match word.checked_sub(self.copied.len()) {
            None => &self.copied[word],
            Some(past) => {
                let rest = self
                    .rest
                    .get_or_init(|| (0..self.rest_words).map(|_| AtomicU64::new(0)).collect());
                &rest[past]
            }
        }
    }

    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(4));
        &self.header[offset / 4]
    }
}

impl AccountingFile<Snapshot> {
    /// Validates the bytes of a file and copies its words.
    ///
    /// The bytes of a file a shim has mapped are not read at one instant
    /// (`read(2)` copies them while claims go on), so the header's
    /// high-water mark may predate a slot's claim the bytes show: the copy
    /// raises its mark past every slot whose state word is not the first
    /// one, as the claim did before publishing it. A slot the bytes show
    /// FREE and never claimed holds nothing at the instant it was read,
    /// whatever else was read of it.
    pub fn snapshot(bytes: &[u8]) -> Result<Self, LayoutError> {
        let geometry = validate(bytes)?;
        let marked = (get_u32(bytes, header::SLOT_HWM) as usize).min(geometry.slots);
        let state_at = |index| get_u64(bytes, slot_offset(geometry.devices, index) + slot::STATE);
        let claimed = (marked..geometry.slots)
            .rev()
            .find(|&index| state_at(index) != 0)
            .map_or(marked, |index| index + 1);
        let copied_len = slot_offset(geometry.devices, claimed);
        let words = Snapshot {
            header: std::array::from_fn(|i| AtomicU32::new(get_u32(bytes, 4 * i))),
            copied: (0..copied_len)
                .step_by(8)
                .map(|at| AtomicU64::new(get_u64(bytes, at)))
                .collect(),
            rest: OnceLock::new(),
            rest_words: (geometry.file_len() - copied_len) / 8,
        };
        words.header[header::SLOT_HWM / 4].store(claimed as u32, SeqCst);
        Ok(AccountingFile::new(words, geometry))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{encode, put_u32, put_u64, DeviceSpec};

    fn file(devices: usize, slots: u32) -> AccountingFile<Snapshot> {
        let spec = DeviceSpec {
            uuid: [7; 16],
            cap_bytes: 1 << 30,
            context_charge_bytes: 0,
        };
        AccountingFile::snapshot(&encode(&vec![spec; devices], slots)).unwrap()
    }

    fn owner(pid: u64) -> Owner {
        Owner {
            pid,
            start_time: 1000 + pid,
        }
    }

    /// Applies a publisher's writes as a shim would see them land.
    fn publish(file: &AccountingFile<Snapshot>, dev: usize, value: u64) {
        let seq = file.words.u64_at(observed_seq_offset(dev)).load(SeqCst);
        for (at, v) in publish_writes(dev, seq, value) {
            file.words.u64_at(at).store(v, SeqCst);
        }
    }

    /// The bytes a reader of the file gets when `f` is the shim's mapping.
    fn bytes_of(f: &AccountingFile<Snapshot>) -> Vec<u8> {
        let mut bytes: Vec<u8> = (0..f.geometry().file_len())
            .step_by(8)
            .flat_map(|at| f.words.u64_at(at).load(SeqCst).to_le_bytes())
            .collect();
        for at in (0..HEADER_LEN).step_by(4) {
            put_u32(&mut bytes, at, f.words.u32_at(at).load(SeqCst));
        }
        bytes
    }

    #[test]
    fn state_words_move_through_the_machine() {
        let free = StateWord(5 << 8 | state::FREE);
        let alive = free.claimed();
        assert_eq!((alive.state(), alive.generation()), (state::ALIVE, 6));
        assert_eq!(alive.reaping(), StateWord(6 << 8 | state::REAPING));
        assert_eq!(alive.reaping().freed(), StateWord(6 << 8 | state::FREE));
        // The generation wraps instead of spilling into nothing.
        let last = StateWord(!0xff);
        assert_eq!(last.claimed(), StateWord(state::ALIVE));
    }

    #[test]
    fn a_claim_takes_the_first_free_slot_it_can_lock() {
        let f = file(2, 4);
        let mut unlocked = Vec::new();
        // Slot 0 is locked by someone else (claiming it right now).
        let got = f.claim(owner(10), |i| i != 0, |i| unlocked.push(i));
        assert_eq!(got, Some(1));
        assert!(unlocked.is_empty());
        assert_eq!(f.state(1), StateWord(1 << 8 | state::ALIVE));
        assert_eq!(f.owner(1), owner(10));
        assert_eq!(f.high_water(), 2);
        let views = f.slots();
        assert_eq!(views.len(), 2);
        assert_eq!((views[1].state, views[1].pid), (state::ALIVE, 10));
        assert_eq!(views[0].state, state::FREE);

        // A slot found FREE but no longer FREE once locked is let go.
        let mut calls = 0;
        let got = f.claim(
            owner(11),
            |i| {
                calls += 1;
                if i == 0 {
                    f.state_word(0).store(state::REAPING, SeqCst);
                }
                true
            },
            |i| unlocked.push(i),
        );
        assert_eq!(got, Some(2));
        assert_eq!(unlocked, [0]);
        assert_eq!(calls, 2);

        // Nothing to lock: no slot.
        assert_eq!(f.claim(owner(12), |_| false, |_| {}), None);
    }

    #[test]
    fn reaping_frees_only_abandoned_alive_slots() {
        let f = file(2, 4);
        for pid in [10, 11, 12] {
            let i = f.claim(owner(pid), |_| true, |_| {}).unwrap();
            f.used_counter(i, 0).store(pid << 20, SeqCst);
            f.used_counter(i, 1).store(1, SeqCst);
        }
        assert_eq!(f.used(0), (10 + 11 + 12) << 20);
        let mut asked = Vec::new();
        let reaped = f.reap(
            Some(0),
            |_| true,
            |_| {},
            |i, o| {
                asked.push((i, o));
                o.pid == 11 || o.pid == 10
            },
        );
        assert_eq!(reaped, 1, "own slot 0 is never reaped");
        assert_eq!(asked, [(1, owner(11)), (2, owner(12))]);
        assert_eq!(f.state(1), StateWord(1 << 8 | state::FREE));
        assert_eq!((f.used_counter(1, 0).load(SeqCst), f.used(1)), (0, 2));
        assert_eq!(f.used(0), (10 + 12) << 20);
        // Freed slots are not asked about again; claiming one moves on a
        // generation.
        assert_eq!(f.reap(None, |_| true, |_| {}, |i, _| i == 1), 0);
        assert_eq!(f.claim(owner(13), |_| true, |_| {}), Some(1));
        assert_eq!(f.state(1), StateWord(2 << 8 | state::ALIVE));
    }

    /// A reaper killed between its CAS and its store left a slot REAPING
    /// with counters still counted: the next reaper that can take the
    /// slot's lock finishes it; while a live reaper holds the lock, or once
    /// the slot moved on, it is left alone.
    #[test]
    fn a_half_reaped_slot_is_finished_under_its_lock() {
        let f = file(1, 4);
        for pid in [10, 11] {
            let i = f.claim(owner(pid), |_| true, |_| {}).unwrap();
            f.used_counter(i, 0).store(pid << 20, SeqCst);
        }
        let dead = f.state(1).reaping();
        f.state_word(1).store(dead.0, SeqCst);
        let never_abandoned = |_: usize, _: Owner| false;

        // Its reaper lives (holds the lock): left, still counted.
        let mut unlocked = Vec::new();
        assert_eq!(
            f.reap(None, |i| i != 1, |i| unlocked.push(i), never_abandoned),
            0
        );
        assert_eq!((f.state(1), f.used(0)), (dead, 21 << 20));
        assert!(unlocked.is_empty());

        // Finished by another under the lock just taken: nothing to do.
        let finished = dead.freed();
        let reaped = f.reap(
            None,
            |i| {
                f.state_word(i).store(finished.0, SeqCst);
                true
            },
            |i| unlocked.push(i),
            never_abandoned,
        );
        assert_eq!((reaped, f.state(1)), (0, finished));
        assert_eq!(unlocked, [1], "the lock is given back");
        assert_eq!(f.used(0), 21 << 20, "the finisher zeroes, not this one");

        // Its reaper died: finished, counters zero, lock given back.
        f.state_word(1).store(dead.0, SeqCst);
        unlocked.clear();
        let mut locked = Vec::new();
        let reaped = f.reap(
            None,
            |i| {
                locked.push(i);
                true
            },
            |i| unlocked.push(i),
            never_abandoned,
        );
        assert_eq!(reaped, 1);
        assert_eq!((locked, unlocked), (vec![1], vec![1]));
        assert_eq!((f.state(1), f.used(0)), (finished, 10 << 20));
    }

    /// An ALIVE slot is taken for reaping before its lock is: a reaper
    /// that then cannot lock it leaves it REAPING for the next one.
    #[test]
    fn a_reaper_that_cannot_lock_leaves_the_slot_reaping() {
        let f = file(1, 4);
        let i = f.claim(owner(10), |_| true, |_| {}).unwrap();
        f.used_counter(i, 0).store(5, SeqCst);
        let alive = f.state(i);
        let mut states = Vec::new();
        let reaped = f.reap(
            None,
            |index| {
                states.push(f.state(index));
                false
            },
            |_| panic!("nothing was locked"),
            |_, _| true,
        );
        assert_eq!(reaped, 0);
        assert_eq!(states, [alive.reaping()], "the CAS came first");
        assert_eq!((f.state(i), f.used(0)), (alive.reaping(), 5));
        assert_eq!(f.reap(None, |_| true, |_| {}, |_, _| false), 1);
        assert_eq!((f.state(i), f.used(0)), (alive.reaping().freed(), 0));
    }

    #[test]
    fn the_sum_saturates_and_counts_the_observed_extra() {
        let f = file(1, 4);
        for _ in 0..2 {
            let i = f.claim(owner(1), |_| true, |_| {}).unwrap();
            f.used_counter(i, 0).store(u64::MAX - 1, SeqCst);
        }
        assert_eq!(f.used(0), u64::MAX);
        let f = file(1, 4);
        publish(&f, 0, 300);
        assert_eq!(f.used(0), 300);
        // Slots past the high-water mark are not read.
        f.used_counter(3, 0).store(5, SeqCst);
        assert_eq!(f.used(0), 300);
    }

    #[test]
    fn the_observed_extra_is_published_as_a_seqlock() {
        let f = file(2, 1);
        assert_eq!(publish_writes(1, 0, 9)[0], (observed_seq_offset(1), 1));
        publish(&f, 1, 600);
        publish(&f, 1, 700);
        assert_eq!(f.words.u64_at(observed_seq_offset(1)).load(SeqCst), 4);
        assert_eq!((f.observed_extra(0), f.observed_extra(1)), (0, 700));
        // A publisher died between its writes: the value is taken after
        // the spin, and the next publisher ends even.
        f.words.u64_at(observed_seq_offset(1)).store(5, SeqCst);
        assert_eq!(f.observed_extra(1), 700);
        assert_eq!(
            publish_writes(1, 5, 800),
            [
                (observed_seq_offset(1), 7),
                (device_offset(1) + device::OBSERVED_EXTRA, 800),
                (observed_seq_offset(1), 8),
            ]
        );
    }

    #[test]
    fn peak_and_refusals_only_grow() {
        let f = file(1, 1);
        f.note_peak(0, 10);
        f.note_peak(0, 5);
        f.note_oom(0);
        f.note_oom(0);
        assert_eq!((f.peak(0), f.refusals(0)), (10, 2));
    }

    /// `read(2)` copies the header, then the slots, while shims claim: the
    /// bytes can show a slot claimed past the high-water mark they show.
    #[test]
    fn a_slot_claimed_while_the_file_is_read_is_seen() {
        let mapped = file(1, 8);
        assert_eq!(mapped.claim(owner(10), |_| true, |_| {}), Some(0));
        let header_then = bytes_of(&mapped)[..HEADER_LEN].to_vec();
        // Then: a claimer holds slot 1's lock, midway; another claims slot
        // 2 and charges; a third claims slot 3, exits and is reaped.
        assert_eq!(mapped.claim(owner(12), |i| i != 1, |_| {}), Some(2));
        mapped.used_counter(2, 0).store(7 << 20, SeqCst);
        assert_eq!(mapped.claim(owner(13), |i| i >= 3, |_| {}), Some(3));
        assert_eq!(mapped.reap(Some(2), |_| true, |_| {}, |i, _| i == 3), 1);
        let mut torn = bytes_of(&mapped);
        torn[..HEADER_LEN].copy_from_slice(&header_then);
        assert_eq!(get_u32(&torn, header::SLOT_HWM), 1);

        let read = AccountingFile::snapshot(&torn).unwrap();
        assert_eq!(read.high_water(), 4, "past every slot ever claimed");
        let views: Vec<_> = read.slots().iter().map(|v| (v.state, v.pid)).collect();
        assert_eq!(
            views,
            [
                (state::ALIVE, 10),
                (state::FREE, 0),
                (state::ALIVE, 12),
                (state::FREE, 13)
            ]
        );
        assert_eq!(read.owner(2), owner(12));
        assert_eq!(read.used(0), 7 << 20);
        assert_eq!(read.state(3), StateWord(1 << 8 | state::FREE));
    }

    /// A claimer that died before raising the mark left its pid in a slot
    /// still FREE; the copy does not carry it, nor any slot past the mark.
    #[test]
    fn slots_never_claimed_are_not_copied() {
        let spec = DeviceSpec {
            uuid: [7; 16],
            cap_bytes: 1 << 30,
            context_charge_bytes: 0,
        };
        let mut bytes = encode(&[spec], 8);
        put_u32(&mut bytes, header::SLOT_HWM, 1);
        put_u64(&mut bytes, slot_offset(1, 0), StateWord(0).claimed().0);
        put_u64(&mut bytes, slot_offset(1, 0) + slot::PID, 10);
        put_u64(&mut bytes, slot_offset(1, 1) + slot::PID, 99);
        let (a, b) = (
            AccountingFile::snapshot(&bytes).unwrap(),
            AccountingFile::snapshot(&bytes).unwrap(),
        );
        assert_eq!((a.high_water(), a.owner(0).pid), (1, 10));
        assert_eq!((a.state(1), a.owner(1).pid), (StateWord(0), 0));
        assert_eq!(a.used(0), 0);
        // What is stored past the copied slots stays in that copy.
        a.used_counter(7, 0).store(5, SeqCst);
        assert_eq!(a.claim(owner(20), |_| true, |_| {}), Some(1));
        assert_eq!((a.owner(1), a.high_water()), (owner(20), 2));
        assert_eq!(b.used_counter(7, 0).load(SeqCst), 0);
        assert_eq!((b.state(1), b.high_water()), (StateWord(0), 1));
    }

    #[test]
    fn lock_bytes_lie_past_the_slots() {
        let f = file(1, 2);
        let g = f.geometry();
        assert_eq!(slot_lock_offset(g, 1), slot_offset(1, 1));
        assert_eq!(publisher_lock_offset(g), g.file_len());
        assert_eq!(charge_lock_offset(g), g.file_len() + 1);
    }
}
