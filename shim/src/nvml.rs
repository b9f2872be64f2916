//! NVML hooks: nvidia-smi and pynvml see the cap as the card's total and the
//! container's own usage as used.

#![allow(non_snake_case, non_camel_case_types)]

use std::ffi::{c_char, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use crate::dlsym::LIBNVML;
use crate::hook::{self, guarded};
use crate::ops::{self, Shim};
use crate::table::Hooked;

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

type MemoryInfoFn = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_t) -> nvmlReturn_t;
type MemoryInfoV2Fn = unsafe extern "C" fn(nvmlDevice_t, *mut nvmlMemory_v2_t) -> nvmlReturn_t;
type GetUuidFn = unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;

/// Device handles seen so far and their position in the accounting file
/// (0 unknown, 1 not capped, 2 + position). Handles are stable for the
/// life of NVML, so each is resolved once.
const HANDLES: usize = 64;
static SEEN: [(AtomicUsize, AtomicU8); HANDLES] =
    [const { (AtomicUsize::new(0), AtomicU8::new(0)) }; HANDLES];

fn device_of(shim: &Shim, handle: nvmlDevice_t) -> Option<usize> {
    let key = handle as usize;
    for (h, dev) in &SEEN {
        if h.load(Ordering::Acquire) == key {
            let d = dev.load(Ordering::Acquire);
            if d != 0 {
                return (d >= 2).then(|| usize::from(d - 2));
            }
        }
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
    let code = dev.map_or(1, |d| d as u8 + 2);
    for (h, d) in &SEEN {
        if h.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            d.store(code, Ordering::Release);
            break;
        }
    }
    dev
}

/// The container's (total, used, free) for a handle, if it is capped.
fn capped(handle: nvmlDevice_t, real_total: u64) -> Option<(u64, u64, u64)> {
    let shim = ops::shim()?;
    let dev = device_of(shim, handle)?;
    Some(shim.nvml_info(dev, real_total))
}

macro_rules! real {
    ($hooked:expr, $ty:ty) => {{
        let address = $hooked.real().get_or_next($hooked.name());
        if address == 0 {
            return NVML_ERROR_UNINITIALIZED;
        }
        // SAFETY: the slot only holds NVML's function of this exact name.
        unsafe { hook::as_fn::<$ty>(address) }
    }};
}

/// After NVML answered for `device`, rewrites its answer with the
/// container's figures via `apply(answer, (total, used, free))`.
fn adjust<M>(
    device: nvmlDevice_t,
    memory: *mut M,
    total: impl Fn(&M) -> u64,
    apply: impl Fn(&mut M, (u64, u64, u64)),
) {
    guarded(
        || (),
        || {
            // SAFETY: NVML just filled `memory`, which the caller checked is non-null.
            let m = unsafe { &mut *memory };
            if let Some(figures) = capped(device, total(m)) {
                apply(m, figures);
            }
        },
    );
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    let real = real!(Hooked::NvmlMemoryInfo, MemoryInfoFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let result = unsafe { real(device, memory) };
    if result == NVML_SUCCESS && !memory.is_null() {
        adjust(
            device,
            memory,
            |m| m.total,
            |m, (total, used, free)| {
                (m.total, m.used, m.free) = (total, used, free);
            },
        );
    }
    result
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    let real = real!(Hooked::NvmlMemoryInfoV2, MemoryInfoV2Fn);
    // SAFETY: forwards the caller's arguments unchanged.
    let result = unsafe { real(device, memory) };
    if result == NVML_SUCCESS && !memory.is_null() {
        // Reserved memory belongs to the driver, not to the slice: report 0
        // so reserved + used + free = total.
        adjust(
            device,
            memory,
            |m| m.total,
            |m, (total, used, free)| {
                (m.total, m.reserved, m.used, m.free) = (total, 0, used, free);
            },
        );
    }
    result
}
