//! `cuGetProcAddress` wrapping: the CUDA runtime asks the driver for its
//! entry points by name, so each answer for a hooked function is swapped
//! for our hook, after recording the exact pointer the driver returned.

#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_void, CStr};

use crate::cuda::{CUresult, CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS};
use crate::dlsym::LIBCUDA;
use crate::hook::{answered, real};
use crate::log;
use crate::table::Hooked;

/// How a driver answer was matched to a hooked variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Matched {
    /// The pointer is the driver's exported entry point of that name.
    Export,
    /// No export matched: the documented (name, version, flags) mapping.
    Documented,
}

/// Which variant the driver returned for `symbol`: the exported entry point
/// it is identical to, or failing that the documented one. An export we do
/// not hook (a variant newer than the shim, with an ABI of its own) is
/// none of ours: taken for the documented one, its callers would get a
/// hook that calls it with the wrong arguments.
fn identify(
    symbol: &[u8],
    returned: usize,
    cuda_version: c_int,
    flags: u64,
) -> Option<(Hooked, Matched)> {
    let mut candidates = Hooked::candidates(symbol).peekable();
    candidates.peek()?;
    if let Some(hooked) = candidates.find(|c| LIBCUDA.symbol(c.name()) as usize == returned) {
        return Some((hooked, Matched::Export));
    }
    if is_export(returned) {
        return None;
    }
    Hooked::documented(symbol, cuda_version, flags).map(|h| (h, Matched::Documented))
}

/// Whether `address` is exactly an exported symbol of the object it lies in.
fn is_export(address: usize) -> bool {
    crate::dlsym::loaded_at(address as *const c_void)
        .is_some_and(|info| !info.dli_sname.is_null() && info.dli_saddr as usize == address)
}

/// Replaces the driver's answer in `*pfn` with our hook when it is one of ours.
fn wrap_answer(symbol: *const c_char, pfn: *mut *mut c_void, cuda_version: c_int, flags: u64) {
    if symbol.is_null() || pfn.is_null() {
        return;
    }
    // SAFETY: the driver succeeded, so `pfn` holds its answer and `symbol`
    // is the caller's C string.
    let (returned, name) = unsafe { (*pfn as usize, CStr::from_ptr(symbol).to_bytes()) };
    if returned == 0 {
        return;
    }
    let Some((hooked, matched)) = identify(name, returned, cuda_version, flags) else {
        return;
    };
    if returned == hooked.hook() {
        return;
    }
    // Once per lookup, not per call: what the GPU check reads to see how
    // the real driver's answers are matched.
    log::debug(|| {
        format!(
            "cuGetProcAddress({}, {cuda_version}, {flags}) -> {} ({matched:?})",
            String::from_utf8_lossy(name),
            String::from_utf8_lossy(hooked.name().to_bytes())
        )
    });
    hooked.real().store(returned as *mut c_void);
    // SAFETY: `pfn` is the caller's valid out-pointer.
    unsafe { *pfn = hooked.hook() as *mut c_void };
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
) -> CUresult {
    real!(let call = cuGetProcAddress(symbol, pfn, cuda_version, flags)
        else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || {
        wrap_answer(symbol, pfn, cuda_version, flags)
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: c_int,
    flags: u64,
    symbol_status: *mut c_int,
) -> CUresult {
    // `symbol_status` is the driver's to fill.
    real!(let call = cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, symbol_status)
        else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || {
        wrap_answer(symbol, pfn, cuda_version, flags)
    })
}
