//! The node: this process's usage per device and, through `FAKEGPU_NODE_FILE`,
//! every other fake-driver process's, standing in for the kernel driver's view.
//!
//! The file holds `ENTRIES` fixed slots. A process claims one at its first
//! charge and keeps its usage there as atomics, so the others (their
//! `cuMemGetInfo`, their out-of-memory checks, NVML's process list) read it
//! live; a slot whose process is gone counts for nothing and may be reclaimed.
//! Each slot names its process in every PID namespace it could see, so a
//! reader finds the PID its own namespace knows it by, as NVML does.

use std::ffi::{c_int, CString, OsString};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::{config, fork, CUresult, OUT_OF_MEMORY};

/// Devices the fake models (the layout's limit too).
pub(crate) const MAX_DEVICES: usize = 16;
const ENTRIES: usize = 128;
/// PID namespaces a slot names its process in, innermost first.
const LEVELS: usize = 4;
/// A slot's owner while it is being (re)claimed.
const CLAIMING: u32 = u32::MAX;
/// `_IO(0xb7, 2)`: the parent of a namespace, from its descriptor.
const NS_GET_PARENT: u64 = 0xb702;

type Usage = [AtomicU64; MAX_DEVICES];

#[repr(C, align(64))]
struct Slot {
    /// The claimant's `getpid()`; 0 when free.
    owner: AtomicU32,
    pids: [AtomicU32; LEVELS],
    /// Inode of the PID namespace each of `pids` belongs to.
    namespaces: [AtomicU64; LEVELS],
    usage: Usage,
}

struct Own {
    usage: &'static Usage,
    /// This process's slot in the node file, if it has one.
    slot: Option<usize>,
}

static OWN: OnceLock<Own> = OnceLock::new();

fn slots() -> &'static [Slot] {
    static FILE: OnceLock<&'static [Slot]> = OnceLock::new();
    FILE.get_or_init(|| {
        std::env::var_os("FAKEGPU_NODE_FILE")
            .and_then(map)
            .unwrap_or_default()
    })
}

/// Maps the node file, creating it at its fixed size if missing.
fn map(path: OsString) -> Option<&'static [Slot]> {
    let path = CString::new(path.into_vec()).ok()?;
    let len = ENTRIES * size_of::<Slot>();
    // SAFETY: system calls on a valid C string and a descriptor closed once mapped. The mapping
    // is page-aligned (enough for `Slot`), `ENTRIES` slots long and never unmapped, so the slice
    // is valid for the process's life; `ftruncate` zero-fills the file, zero is a valid `Slot`
    // (atomics only), and every process changes it only through those atomics.
    unsafe {
        let fd = libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
            0o666,
        );
        if fd < 0 {
            return None;
        }
        let mapped = if libc::ftruncate(fd, len as libc::off_t) == 0 {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        } else {
            libc::MAP_FAILED
        };
        libc::close(fd);
        (mapped != libc::MAP_FAILED)
            .then(|| std::slice::from_raw_parts(mapped.cast::<Slot>(), ENTRIES))
    }
}

fn my_namespace() -> u64 {
    static NAMESPACE: OnceLock<u64> = OnceLock::new();
    *NAMESPACE.get_or_init(|| std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino()))
}

/// This process's (namespace inode, PID) pairs, innermost first: `NSpid`
/// lists the PIDs outermost first, and `NS_GET_PARENT` walks the namespaces.
fn identity() -> Vec<(u64, u32)> {
    let nspids: Vec<u32> = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
            Some(
                line.split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect(),
            )
        })
        .unwrap_or_default();
    let mut levels = Vec::new();
    // SAFETY: system calls on descriptors this function opens and closes; `stat` is plain data, so
    // zeroed is a valid one for `fstat` to fill.
    unsafe {
        let mut fd = libc::open(
            c"/proc/self/ns/pid".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        );
        for &pid in nspids.iter().rev().take(LEVELS) {
            let mut st: libc::stat = std::mem::zeroed();
            if fd < 0 || libc::fstat(fd, &mut st) != 0 {
                break;
            }
            levels.push((st.st_ino, pid));
            let parent = libc::ioctl(fd, NS_GET_PARENT as _);
            libc::close(fd);
            fd = parent;
        }
        if fd >= 0 {
            libc::close(fd);
        }
        if levels.is_empty() {
            levels.push((my_namespace(), libc::getpid() as u32));
        }
    }
    levels
}

/// The PID the caller's namespace knows the slot's process by.
fn pid_here(slot: &Slot) -> Option<u32> {
    let ns = my_namespace();
    (0..LEVELS).find_map(|l| {
        let pid = slot.pids[l].load(Ordering::Acquire);
        (pid != 0 && slot.namespaces[l].load(Ordering::Acquire) == ns).then_some(pid)
    })
}

/// A claimed slot whose process may still run (one out of sight is assumed to).
fn live(slot: &Slot) -> bool {
    let owner = slot.owner.load(Ordering::Acquire);
    owner != 0
        && owner != CLAIMING
        && pid_here(slot).is_none_or(|pid| {
            // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
            let signalled = unsafe { libc::kill(pid as libc::pid_t, 0) };
            signalled == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
        })
}

fn claim(slots: &'static [Slot]) -> Option<usize> {
    let me = identity();
    let index = slots.iter().position(|s| {
        let owner = s.owner.load(Ordering::Acquire);
        (owner == 0 || (owner != CLAIMING && !live(s)))
            && s.owner
                .compare_exchange(owner, CLAIMING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    })?;
    let slot = &slots[index];
    slot.usage
        .iter()
        .for_each(|u| u.store(0, Ordering::Relaxed));
    for level in 0..LEVELS {
        let (ns, pid) = me.get(level).copied().unwrap_or_default();
        slot.namespaces[level].store(ns, Ordering::Relaxed);
        slot.pids[level].store(pid, Ordering::Relaxed);
    }
    slot.owner
        // SAFETY: `getpid` has no preconditions.
        .store(unsafe { libc::getpid() } as u32, Ordering::Release);
    Some(index)
}

fn own() -> &'static Own {
    OWN.get_or_init(|| match claim(slots()) {
        Some(slot) => Own {
            usage: &slots()[slot].usage,
            slot: Some(slot),
        },
        // No node file, or a full one: this process alone.
        None => Own {
            usage: Box::leak(Box::new(std::array::from_fn(|_| AtomicU64::new(0)))),
            slot: None,
        },
    })
}

/// What the live slots other than `skip` hold on `dev`.
fn others(skip: Option<usize>, dev: usize) -> u64 {
    slots()
        .iter()
        .enumerate()
        .filter(|&(i, s)| Some(i) != skip && live(s))
        .map(|(_, s)| s.usage[dev].load(Ordering::SeqCst))
        .sum()
}

/// Takes `bytes` on `dev` for this process, unless the node's processes
/// together would then use more than the device has.
pub(crate) fn charge(dev: usize, bytes: u64) -> Result<(), CUresult> {
    let own = own();
    let mine = own.usage[dev].fetch_add(bytes, Ordering::SeqCst) + bytes;
    if mine + others(own.slot, dev) > config().memory {
        own.usage[dev].fetch_sub(bytes, Ordering::SeqCst);
        return Err(OUT_OF_MEMORY);
    }
    Ok(())
}

pub(crate) fn uncharge(dev: usize, bytes: u64) {
    own().usage[dev].fetch_sub(bytes, Ordering::SeqCst);
}

/// This copy's own usage on `dev` and its slot. A child forked after
/// `cuInit` has none: what it inherited is its parent's (as is the slot).
fn local(dev: usize) -> (u64, Option<usize>) {
    match OWN.get() {
        Some(own) if !fork::poisoned() => (own.usage[dev].load(Ordering::SeqCst), own.slot),
        _ => (0, None),
    }
}

/// What every process on the node uses on `dev`, from the CUDA side.
pub(crate) fn used(dev: usize) -> u64 {
    let (mine, slot) = local(dev);
    mine + others(slot, dev)
}

/// This process's usage on `dev` and its slot, for NVML: the process holds
/// two copies of this library, and only the one loaded as `libcuda.so.1`
/// has CUDA state (or was forked after its `cuInit`).
#[no_mangle]
pub unsafe extern "C" fn fakegpu_process_usage(dev: c_int, slot: *mut c_int) -> u64 {
    let (mine, own) = usize::try_from(dev)
        .ok()
        .filter(|&d| d < MAX_DEVICES)
        .map_or((0, None), local);
    if !slot.is_null() {
        // SAFETY: `slot` is the caller's optional out-parameter (our NVML copy passes a local),
        // valid for writes when not null (checked).
        unsafe { *slot = own.map_or(-1, |s| s as c_int) };
    }
    mine
}

fn process(dev: usize) -> (u64, Option<usize>) {
    type ProcessUsage = unsafe extern "C" fn(c_int, *mut c_int) -> u64;
    // SAFETY: `dlopen` with RTLD_NOLOAD only finds an already-loaded object, closed again below;
    // `fakegpu_process_usage` is this library's own export, whose signature `ProcessUsage` spells,
    // called with a valid out-pointer.
    unsafe {
        let cuda = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if cuda.is_null() {
            return (0, None);
        }
        let f = libc::dlsym(cuda, c"fakegpu_process_usage".as_ptr());
        let mut slot = -1;
        let mine = if f.is_null() {
            0
        } else {
            std::mem::transmute::<*mut libc::c_void, ProcessUsage>(f)(dev as c_int, &mut slot)
        };
        libc::dlclose(cuda);
        (mine, usize::try_from(slot).ok())
    }
}

/// What every process on the node uses on `dev`, as NVML sees it.
pub(crate) fn used_by_processes(dev: usize) -> u64 {
    let (mine, slot) = process(dev);
    mine + others(slot, dev)
}

/// The node's processes with memory on `dev`, by the PIDs the caller's
/// namespace knows them by (this process first, as `getpid()`).
pub(crate) fn processes(dev: usize) -> Vec<(u32, u64)> {
    // SAFETY: `getpid` has no preconditions.
    let me = unsafe { libc::getpid() } as u32;
    let (mine, _) = process(dev);
    let others = slots().iter().filter(|s| live(s)).filter_map(|s| {
        let pid = pid_here(s).filter(|&pid| pid != me)?;
        let used = s.usage[dev].load(Ordering::SeqCst);
        (used > 0).then_some((pid, used))
    });
    (mine > 0)
        .then_some((me, mine))
        .into_iter()
        .chain(others)
        .collect()
}
