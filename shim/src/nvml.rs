//! NVML: nvidia-smi and pynvml see the cap as the card's total and the
//! container's own usage as used; and the shim asks NVML what the driver
//! holds for this process, to charge a context what it really took.

#![allow(non_snake_case, non_camel_case_types)]

use std::ffi::{c_char, c_uint, c_void, CStr};
use std::sync::OnceLock;

use crate::devices::HandleCache;
use crate::dlsym::LIBNVML;
use crate::hook::{self, answered, real};
use crate::ops::{self, Shim};

pub type nvmlReturn_t = c_uint;
pub type nvmlDevice_t = *mut c_void;

const NVML_SUCCESS: nvmlReturn_t = 0;
const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;

#[repr(C)]
pub struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

#[repr(C)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

type GetUuidFn = unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;

/// Device handles seen so far. Handles are stable for the life of NVML, so
/// each is resolved once.
static SEEN: HandleCache<64> = HandleCache::new();

fn device_of(shim: &Shim, handle: nvmlDevice_t) -> Option<usize> {
    let key = handle as usize;
    if let Some(dev) = SEEN.get(key) {
        return dev;
    }
    let get_uuid = LIBNVML.symbol(c"nvmlDeviceGetUUID") as usize;
    if get_uuid == 0 {
        return None;
    }
    let mut text = [0 as c_char; 96];
    // SAFETY: nvmlDeviceGetUUID(handle, buffer, length) writes a C string
    // of at most `length` bytes.
    if unsafe { hook::as_fn::<GetUuidFn>(get_uuid)(handle, text.as_mut_ptr(), 96) } != NVML_SUCCESS
    {
        return None;
    }
    // SAFETY: NVML NUL-terminates on success; the buffer ends in zeroes anyway.
    let text = unsafe { CStr::from_ptr(text.as_ptr()) }.to_str().ok()?;
    let dev = gpumem_layout::parse_uuid(text).and_then(|uuid| shim.device_of(&uuid));
    SEEN.put(key, dev);
    dev
}

/// The container's (total, used, free) for a handle, if it is capped.
fn capped(handle: nvmlDevice_t, real_total: u64) -> Option<(u64, u64, u64)> {
    let shim = ops::shim()?;
    let dev = device_of(shim, handle)?;
    Some(shim.nvml_info(dev, real_total))
}

/// An answer of `nvmlDeviceGetMemoryInfo[_v2]`, whichever version.
trait MemoryAnswer {
    fn total(&self) -> u64;
    /// Writes the container's figures over the device's.
    fn report(&mut self, total: u64, used: u64, free: u64);
}

impl MemoryAnswer for nvmlMemory_t {
    fn total(&self) -> u64 {
        self.total
    }

    fn report(&mut self, total: u64, used: u64, free: u64) {
        (self.total, self.used, self.free) = (total, used, free);
    }
}

impl MemoryAnswer for nvmlMemory_v2_t {
    fn total(&self) -> u64 {
        self.total
    }

    /// Reserved memory belongs to the driver, not to the slice: report 0
    /// so reserved + used + free = total.
    fn report(&mut self, total: u64, used: u64, free: u64) {
        (self.total, self.reserved, self.used, self.free) = (total, 0, used, free);
    }
}

/// After NVML answered for `device`, rewrites its answer with the
/// container's figures when the device is capped.
fn report<M: MemoryAnswer>(device: nvmlDevice_t, memory: *mut M) {
    if memory.is_null() {
        return;
    }
    // SAFETY: NVML just filled `memory`, which is not null.
    let m = unsafe { &mut *memory };
    if let Some((total, used, free)) = capped(device, m.total()) {
        m.report(total, used, free);
    }
}

/// `nvmlDeviceGetMemoryInfo` and its `_v2`: the same query, each with its
/// own structure.
macro_rules! memory_info {
    ($name:ident, $memory:ty) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, memory: *mut $memory) -> nvmlReturn_t {
            real!(let call = $name(device, memory) else NVML_ERROR_UNINITIALIZED);
            answered(call, NVML_SUCCESS, || report(device, memory))
        }
    };
}
memory_info!(nvmlDeviceGetMemoryInfo, nvmlMemory_t);
memory_info!(nvmlDeviceGetMemoryInfo_v2, nvmlMemory_v2_t);

const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
/// `usedGpuMemory` when the driver cannot say (NVML_VALUE_NOT_AVAILABLE).
const NOT_AVAILABLE: u64 = u64::MAX;

/// `nvmlProcessInfo_t` as the `_v2` and `_v3` process queries fill it.
#[repr(C)]
#[derive(Clone, Copy)]
struct nvmlProcessInfo_t {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

type InitFn = unsafe extern "C" fn() -> nvmlReturn_t;
type HandleByUuidFn = unsafe extern "C" fn(*const c_char, *mut nvmlDevice_t) -> nvmlReturn_t;
type ProcessesFn =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;

/// The NVML functions the shim calls itself, once NVML is initialised.
struct Queries {
    by_uuid: HandleByUuidFn,
    processes: ProcessesFn,
}

/// Loads and initialises NVML for the shim's own questions (once: about
/// 12 ms on an H100 (docs/GPU_VERIFICATION.md), next to the ~110 ms a context takes to create).
fn queries() -> Option<&'static Queries> {
    static QUERIES: OnceLock<Option<Queries>> = OnceLock::new();
    QUERIES
        .get_or_init(|| {
            let init = LIBNVML.load(c"nvmlInit_v2")?;
            let by_uuid = LIBNVML.load(c"nvmlDeviceGetHandleByUUID")?;
            let processes = LIBNVML
                .load(c"nvmlDeviceGetComputeRunningProcesses_v3")
                .or_else(|| LIBNVML.load(c"nvmlDeviceGetComputeRunningProcesses_v2"))?;
            // SAFETY: each address is NVML's function of that name, whose
            // ABI the types spell (the _v2 and _v3 queries fill the same
            // structure).
            unsafe {
                if hook::as_fn::<InitFn>(init)() != NVML_SUCCESS {
                    return None;
                }
                Some(Queries {
                    by_uuid: hook::as_fn(by_uuid),
                    processes: hook::as_fn(processes),
                })
            }
        })
        .as_ref()
}

/// Loads NVML for `own_usage` now, before a caller takes a lock under which
/// it will ask: loading takes the dynamic loader's lock, which a thread
/// already inside `dlopen` (a library constructor that makes a context)
/// holds while it waits for ours.
pub fn prepare() {
    let _ = queries();
}

/// What the driver holds for this process on the GPU with `uuid`: NVML's
/// per-process figure, found by our own PID (NVML gives PIDs as the
/// caller's PID namespace sees them, so this works in a container too).
/// `Some(0)` when NVML does not list us; `None` when NVML cannot answer.
pub fn own_usage(uuid: &[u8; 16]) -> Option<u64> {
    let queries = queries()?;
    let text = std::ffi::CString::new(gpumem_layout::format_uuid(uuid)).ok()?;
    let mut device: nvmlDevice_t = std::ptr::null_mut();
    // SAFETY: a NUL-terminated UUID and a valid out-pointer.
    if unsafe { (queries.by_uuid)(text.as_ptr(), &mut device) } != NVML_SUCCESS {
        return None;
    }
    let empty = nvmlProcessInfo_t {
        pid: 0,
        used_gpu_memory: 0,
        gpu_instance_id: 0,
        compute_instance_id: 0,
    };
    let mut infos = vec![empty; 64];
    loop {
        let mut count = infos.len() as c_uint;
        // SAFETY: `infos` has room for `count` entries.
        let result = unsafe { (queries.processes)(device, &mut count, infos.as_mut_ptr()) };
        match result {
            NVML_SUCCESS => {
                infos.truncate(count as usize);
                break;
            }
            // More processes than room: NVML said how many.
            NVML_ERROR_INSUFFICIENT_SIZE if count as usize > infos.len() => {
                infos = vec![empty; count as usize + 8];
            }
            _ => return None,
        }
    }
    let me = std::process::id();
    match infos.iter().find(|p| p.pid == me) {
        Some(p) if p.used_gpu_memory == NOT_AVAILABLE => None,
        Some(p) => Some(p.used_gpu_memory),
        None => Some(0),
    }
}
