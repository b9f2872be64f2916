//! The container's accounting file, mapped shared: the mapping, its
//! descriptor and record locks, and what /proc says about a slot's owner.
//! The protocol's rules on it are `gpumem_layout::protocol`'s.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpumem_layout::protocol::{self, AccountingFile, Owner, Words};
use gpumem_layout::{self as layout, DeviceSpec};

#[derive(Debug)]
pub enum RegionError {
    Open(std::io::Error),
    Map(std::io::Error),
    Layout(layout::LayoutError),
}

impl std::fmt::Display for RegionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegionError::Open(e) => write!(f, "cannot open: {e}"),
            RegionError::Map(e) => write!(f, "cannot map: {e}"),
            RegionError::Layout(e) => write!(f, "{e}"),
        }
    }
}

/// Who reaps, which decides whether a slot with this process's pid may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reaper {
    /// A thread of an image none of whose threads can hold a slot in the
    /// file yet (at the shim's opening), or the thread claiming its slot
    /// under the claim lock: a slot with this pid is an earlier image's,
    /// left before an exec.
    Claiming,
    /// Anyone else: a slot with this pid is this image's, the one it holds
    /// or the one another of its threads has just claimed and not yet
    /// recorded, and must not be freed under it.
    Running,
}

/// A mapping that lives until the process exits: the file descriptor is
/// never closed, because closing any descriptor of the file would drop this
/// process's record locks and make its slot look dead.
pub struct Region {
    file: AccountingFile<Mapping>,
    fd: libc::c_int,
    devices: Vec<DeviceSpec>,
    /// The file's device and inode, to find it in other processes' maps.
    ident: (u64, u64),
    /// Held by the thread claiming or freeing a slot. Record locks are the
    /// process's, not a thread's: another thread's lock of the same slot
    /// byte would succeed, and its unlock drop ours. A flag, not a mutex,
    /// so that a forked child can let go of one its parent's other thread
    /// held (see `forget_turn`).
    slot_turn: AtomicBool,
}

/// The file's words in the shared mapping, which is never unmapped.
pub struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics (the
// mutable fields) or read-only after validation (the device records).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Words for Mapping {
    #[inline]
    fn u64_at(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset.is_multiple_of(8) && offset + 8 <= self.len);
        // SAFETY: only `Region::file`, made for the geometry validated
        // against this mapping, reaches the mapping; it asks for fields of
        // slots below the slot count (its own loops, or a slot its claim
        // returned) and of devices below the device count (the shim looks
        // them up in the file's own records): 8-aligned (records are
        // 64-aligned, fields 8-aligned) and inside the mapping, which is
        // never unmapped.
        unsafe { &*self.base.add(offset).cast::<AtomicU64>() }
    }

    #[inline]
    fn u32_at(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset.is_multiple_of(4) && offset + 4 <= self.len);
        // SAFETY: as for u64_at, with 4-byte alignment.
        unsafe { &*self.base.add(offset).cast::<AtomicU32>() }
    }
}

/// Whether another process holds the lock of a slot.
enum Holder {
    Alive,
    Gone,
    Unknown,
}

impl Region {
    pub fn open(path: &Path) -> Result<Region, RegionError> {
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|e| RegionError::Open(std::io::Error::other(e)))?;
        // SAFETY: c_path is a valid NUL-terminated string.
        let fd = unsafe { libc::open(c_path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(RegionError::Open(std::io::Error::last_os_error()));
        }
        match Self::map(fd, path) {
            Ok(region) => Ok(region),
            Err(err) => {
                // SAFETY: fd is ours and not yet shared with any mapping.
                unsafe { libc::close(fd) };
                Err(err)
            }
        }
    }

    fn map(fd: libc::c_int, path: &Path) -> Result<Region, RegionError> {
        // SAFETY: a zeroed stat is a valid out-buffer for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out-pointer.
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(RegionError::Open(std::io::Error::last_os_error()));
        }
        let len = usize::try_from(st.st_size).unwrap_or(0);
        if len < layout::HEADER_LEN {
            return Err(RegionError::Layout(layout::LayoutError::TooShort {
                len,
                need: layout::HEADER_LEN,
            }));
        }
        // SAFETY: maps `len` bytes of an open file shared; checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(RegionError::Map(std::io::Error::last_os_error()));
        }
        // From here on, a file shrunk by someone else reads as zeroes
        // instead of killing the process.
        crate::sigbus::protect(base, len, path);
        // Validated on a copy: other processes write the slots (and the
        // device records' counters) while this one reads, so the mapping
        // is read only through atomics, never as plain bytes.
        let bytes: Vec<u8> = (0..len / 8)
            .flat_map(|word| {
                // SAFETY: word * 8 + 8 <= len: inside the mapping, and
                // 8-aligned (mmap returns a page-aligned address).
                let at = unsafe { &*base.cast::<u8>().add(word * 8).cast::<AtomicU64>() };
                at.load(Ordering::Relaxed).to_ne_bytes()
            })
            .collect();
        let checked = layout::validate(&bytes).map(|g| (g, layout::devices(&bytes, g)));
        match checked {
            Ok((geometry, devices)) => Ok(Region {
                file: AccountingFile::new(
                    Mapping {
                        base: base.cast(),
                        len,
                    },
                    geometry,
                ),
                fd,
                devices,
                ident: (st.st_dev, st.st_ino),
                slot_turn: AtomicBool::new(false),
            }),
            Err(err) => {
                crate::sigbus::forget(base);
                // SAFETY: unmaps exactly what was mapped above.
                unsafe { libc::munmap(base, len) };
                Err(RegionError::Layout(err))
            }
        }
    }

    /// A region over a new accounting file of one device capped at `cap`
    /// and 8 slots, for tests; the file's name is gone, its mapping stays.
    #[cfg(test)]
    pub fn for_test(cap: u64) -> Region {
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "gpumem-shim-test-{}-{}",
            std::process::id(),
            FILES.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
        ));
        let device = DeviceSpec {
            uuid: [7; 16],
            cap_bytes: cap,
            context_charge_bytes: 0,
        };
        std::fs::write(&path, layout::encode(&[device], 8)).expect("a temporary file");
        let region = Region::open(&path).expect("the file just written");
        let _ = std::fs::remove_file(&path);
        region
    }

    pub fn devices(&self) -> &[DeviceSpec] {
        &self.devices
    }

    /// The file's shared words, with the protocol's rules on them.
    #[inline]
    pub fn file(&self) -> &AccountingFile<Mapping> {
        &self.file
    }

    /// Claims a free slot for this process, under the slot's record lock
    /// (which it then keeps for as long as it lives).
    pub fn claim(&self, pid: u32, start_time: u64) -> Option<usize> {
        let owner = Owner {
            pid: u64::from(pid),
            start_time,
        };
        let _turn = self.slot_turn(true)?;
        self.file
            .claim(owner, |index| self.lock(index), |index| self.unlock(index))
    }

    /// Frees the slots of processes that died without cleaning up (SIGKILL,
    /// OOM kill) or exec'd (the descriptor is close-on-exec, so the lock
    /// went, but the pid lives on). Returns how many were reaped.
    /// `own` is the slot this process holds, skipped without a look. The
    /// turn at the slots' locks is taken only to free a slot, so the scan
    /// (every memory query makes one) writes nothing shared; a running
    /// process leaves a slot to another of its threads that has the turn.
    pub fn reap(&self, by: Reaper, own: Option<usize>) -> usize {
        let turn = std::cell::Cell::new(None);
        self.file.reap(
            own,
            |index| {
                let Some(held) = self.slot_turn(by == Reaper::Claiming) else {
                    return false;
                };
                let locked = self.lock(index);
                if locked {
                    turn.set(Some(held));
                }
                locked
            },
            |index| {
                self.unlock(index);
                turn.take();
            },
            |index, owner| matches!(self.holder(index), Holder::Gone) && self.abandoned(owner, by),
        )
    }

    /// This thread's turn at the slots' record locks; `None` where another
    /// thread has it and `wait` is false.
    fn slot_turn(&self, wait: bool) -> Option<SlotTurn<'_>> {
        // A turn lasts a few fcntl calls and /proc reads per slot.
        const PAUSE: Duration = Duration::from_micros(50);
        while self
            .slot_turn
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            if !wait {
                return None;
            }
            std::thread::sleep(PAUSE);
        }
        Some(SlotTurn(&self.slot_turn))
    }

    /// In a forked child: the only thread, so a turn its parent's other
    /// thread held at the fork is nobody's. Its record locks were not
    /// inherited either.
    pub fn forget_turn(&self) {
        self.slot_turn.store(false, Ordering::Release);
    }

    /// Whether the process of a slot whose lock is gone left it behind: it
    /// died, or it exec'd (the new image has not mapped the file). One that
    /// closed our descriptor by accident still has the file mapped: its
    /// usage is real and it keeps its slot. If its maps cannot be read, the
    /// slot is kept too.
    fn abandoned(&self, owner: Owner, by: Reaper) -> bool {
        let Ok(pid) = u32::try_from(owner.pid) else {
            return true;
        };
        let mine = pid == std::process::id();
        // Another start time: the pid was reused (soon, in a container's
        // small pid namespace). None known (a shim that could not read
        // /proc wrote 0): another pid's slot is taken for dead, but this
        // process's own must not be (a slot another of its threads has
        // just claimed with start time 0 too).
        let reused = match owner.start_time {
            0 => !mine,
            start => start_time_of(pid) != Some(start),
        };
        if reused {
            return true;
        }
        // This very process. F_GETLK never reports the caller's own locks,
        // so only a claimer, which has no slot yet, can tell the slot is an
        // image's before an exec and not its own.
        if mine {
            return by == Reaper::Claiming;
        }
        maps_file(pid, self.ident) == Some(false)
    }

    /// Serialises charges that lost a race near the cap, across the
    /// container's processes. A holder that is stopped does not stop the
    /// others for long: past a short wait they go on without the lock.
    pub fn lock_charges(&self) -> ChargeLock<'_> {
        static LOCAL: Mutex<()> = Mutex::new(());
        const PATIENCE: Duration = Duration::from_millis(50);
        let local = crate::fork::lock(&LOCAL);
        let offset = protocol::charge_lock_offset(self.file.geometry());
        let deadline = Instant::now() + PATIENCE;
        let locked = loop {
            if self.lock_byte(offset) {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::thread::sleep(Duration::from_micros(100));
        };
        ChargeLock {
            region: self,
            offset,
            locked,
            _local: local,
        }
    }

    fn lock_request(offset: usize, kind: libc::c_short) -> libc::flock {
        // SAFETY: flock is plain data; zero is a valid starting value.
        let mut request: libc::flock = unsafe { std::mem::zeroed() };
        request.l_type = kind;
        request.l_whence = libc::SEEK_SET as libc::c_short;
        request.l_start = offset as libc::off_t;
        request.l_len = 1;
        request
    }

    fn lock_byte(&self, offset: usize) -> bool {
        let request = Self::lock_request(offset, libc::F_WRLCK as libc::c_short);
        // SAFETY: fd is open for writing; request is a valid flock.
        unsafe { libc::fcntl(self.fd, libc::F_SETLK, &request) == 0 }
    }

    /// Releases only this byte: POSIX locks are per byte range.
    fn unlock_byte(&self, offset: usize) {
        let request = Self::lock_request(offset, libc::F_UNLCK as libc::c_short);
        // SAFETY: fd is open; request is a valid flock.
        unsafe { libc::fcntl(self.fd, libc::F_SETLK, &request) };
    }

    fn slot_lock(&self, index: usize) -> usize {
        protocol::slot_lock_offset(self.file.geometry(), index)
    }

    fn lock(&self, index: usize) -> bool {
        self.lock_byte(self.slot_lock(index))
    }

    fn unlock(&self, index: usize) {
        self.unlock_byte(self.slot_lock(index))
    }

    fn holder(&self, index: usize) -> Holder {
        let mut request = Self::lock_request(self.slot_lock(index), libc::F_WRLCK as libc::c_short);
        // SAFETY: fd is open; request is a valid in/out flock.
        if unsafe { libc::fcntl(self.fd, libc::F_GETLK, &mut request) } != 0 {
            return Holder::Unknown;
        }
        if request.l_type == libc::F_UNLCK as libc::c_short {
            Holder::Gone
        } else {
            Holder::Alive
        }
    }
}

/// A thread's turn at the slots' record locks; given back on drop.
struct SlotTurn<'a>(&'a AtomicBool);

impl Drop for SlotTurn<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Held while a charge retries near the cap; released on drop.
pub struct ChargeLock<'a> {
    region: &'a Region,
    offset: usize,
    locked: bool,
    _local: MutexGuard<'static, ()>,
}

impl Drop for ChargeLock<'_> {
    fn drop(&mut self) {
        if self.locked {
            self.region.unlock_byte(self.offset);
        }
    }
}

/// Whether `pid` has the file `(device, inode)` mapped; `None` if its maps
/// cannot be read (another user's process, or gone).
fn maps_file(pid: u32, (device, inode): (u64, u64)) -> Option<bool> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let wanted = (
        u64::from(libc::major(device)),
        u64::from(libc::minor(device)),
    );
    Some(maps.lines().any(|line| {
        // address perms offset major:minor inode [path]
        let mut fields = line.split_whitespace().skip(3);
        let (Some(dev), Some(ino)) = (fields.next(), fields.next()) else {
            return false;
        };
        let Some((major, minor)) = dev.split_once(':') else {
            return false;
        };
        let parsed = (
            u64::from_str_radix(major, 16).ok(),
            u64::from_str_radix(minor, 16).ok(),
        );
        ino.parse::<u64>().ok() == Some(inode) && parsed == (Some(wanted.0), Some(wanted.1))
    }))
}

/// Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22).
pub fn start_time_of(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    layout::protocol::start_time_in_stat(&stat)
}

#[cfg(test)]
mod tests {
    use gpumem_layout::state;

    use super::*;

    impl Region {
        /// Stores `value` at `offset` of the file, as another process
        /// would: through the file, not the mapping.
        fn write_for_test(&self, offset: usize, value: u64) {
            use std::os::fd::FromRawFd;
            use std::os::unix::fs::FileExt;
            // SAFETY: the descriptor is open for the region's life; the
            // File is never dropped, so it is not closed here.
            let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(self.fd) });
            file.write_all_at(&value.to_le_bytes(), offset as u64)
                .unwrap();
        }
    }

    /// A slot this process has claimed but not yet recorded as its own
    /// looks dead to it (F_GETLK never reports the caller's own locks): a
    /// running process's reap must leave it, only a claimer may free it.
    /// A slot of an earlier process with the same pid is anyone's to free.
    #[test]
    fn only_the_claimer_reaps_a_slot_of_this_pid() {
        let region = Region::for_test(1 << 30);
        let me = std::process::id();
        let slot = region.claim(me, start_time_of(me).unwrap()).unwrap();
        region
            .file()
            .used_counter(slot, 0)
            .store(1 << 20, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(region.reap(Reaper::Running, None), 0);
        assert_eq!(region.file().state(slot).state(), state::ALIVE);
        // An image before an exec left it: the next claimer frees it.
        assert_eq!(region.reap(Reaper::Claiming, None), 1);
        assert_eq!(region.file().state(slot).state(), state::FREE);
        // A dead process's slot whose pid is now ours: anyone frees it.
        let dead = region.claim(me, start_time_of(me).unwrap() - 1).unwrap();
        assert_eq!(region.reap(Reaper::Running, None), 1);
        assert_eq!(region.file().state(dead).state(), state::FREE);
        // Claimed where /proc could not tell this process's start time:
        // still this process's, for everyone but a claimer.
        let unknown = region.claim(me, 0).unwrap();
        assert_eq!(region.reap(Reaper::Running, None), 0);
        assert_eq!(region.file().state(unknown).state(), state::ALIVE);
        assert_eq!(region.reap(Reaper::Claiming, None), 1);
    }

    /// Record locks are the process's: while one thread claims or frees a
    /// slot in a file, another's reap there leaves the slots alone (its
    /// locks and unlocks of the same bytes would undo the first's); a claim
    /// waits its turn. A forked child lets go of a turn its parent's other
    /// thread held.
    #[test]
    fn one_thread_at_a_time_locks_slots() {
        let region = Region::for_test(1 << 30);
        let me = std::process::id();
        let slot = region.claim(me, start_time_of(me).unwrap()).unwrap();
        let file = region.file();
        file.used_counter(slot, 0)
            .store(1 << 20, std::sync::atomic::Ordering::SeqCst);
        // Left half-reaped by a reaper that died.
        let reaping = file.state(slot).reaping();
        region.write_for_test(
            layout::slot_offset(1, slot) + layout::slot::STATE,
            reaping.0,
        );

        let turn = region.slot_turn(true).unwrap();
        assert_eq!(region.reap(Reaper::Running, None), 0);
        std::thread::scope(|s| {
            let claiming = s.spawn(|| region.claim(me, start_time_of(me).unwrap()));
            std::thread::sleep(Duration::from_millis(20));
            assert!(!claiming.is_finished(), "a claim waits for the turn");
            drop(turn);
            assert!(claiming.join().unwrap().is_some());
        });
        assert_eq!(file.state(slot), reaping);

        std::mem::forget(region.slot_turn(true).unwrap());
        assert_eq!(region.reap(Reaper::Running, None), 0);
        region.forget_turn();
        assert_eq!(region.reap(Reaper::Running, None), 1);
        assert_eq!(file.state(slot), reaping.freed());
        assert_eq!(file.used(0), 0);
    }
}
