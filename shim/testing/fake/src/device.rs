//! Devices: the driver's version, count, UUIDs and sizes, and `cuInit`.
//! They are fixed by the configuration for the process's lifetime.

use std::ffi::{c_int, c_uint};

use crate::{config, device, out, CUdevice, CUresult, INVALID_DEVICE, INVALID_VALUE, SUCCESS};

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    refuse_after_fork!();
    crate::fork::arm();
    SUCCESS
}

/// Answers in a forked child too: it reads nothing the fork could break,
/// and the real one is documented to work before `cuInit`.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    // SAFETY: `version` is the caller's out-parameter: null, which `out` refuses, or valid for
    // writes, as the driver API requires.
    unsafe { out(version, 13000) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    refuse_after_fork!();
    // SAFETY: `count` is the caller's out-parameter: null, which `out` refuses, or valid for
    // writes, as the driver API requires.
    unsafe { out(count, config().uuids.len() as c_int) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    refuse_after_fork!();
    match device(ordinal) {
        // SAFETY: `dev` is the caller's out-parameter: null, which `out` refuses, or valid for
        // writes, as the driver API requires.
        Some(d) => unsafe { out(dev, d as CUdevice) },
        None => INVALID_DEVICE,
    }
}

unsafe fn uuid_of(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    refuse_after_fork!();
    let Some(d) = device(dev) else {
        return INVALID_DEVICE;
    };
    match gpumem_layout::parse_uuid(&config().uuids[d]) {
        // SAFETY: `uuid` is the out-parameter our callers were given, null or valid for writes of
        // 16 bytes; `out` checks for null.
        Some(raw) => unsafe { out(uuid, raw) },
        None => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    // SAFETY: `uuid_of` needs `uuid` null or valid for writes, as `cuDeviceGetUuid` requires of its
    // caller.
    unsafe { uuid_of(uuid, dev) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    // SAFETY: `uuid_of` needs `uuid` null or valid for writes, as `cuDeviceGetUuid_v2` requires of
    // its caller.
    unsafe { uuid_of(uuid, dev) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    refuse_after_fork!();
    match device(dev) {
        // SAFETY: `bytes` is the caller's out-parameter: null, which `out` refuses, or valid for
        // writes, as the driver API requires.
        Some(_) => unsafe { out(bytes, config().memory as usize) },
        None => INVALID_DEVICE,
    }
}
