//! `cuGetProcAddress[_v2]`: like the real driver, base names map to the
//! variant the caller's CUDA version expects, and the per-thread-stream flag
//! selects `_ptsz` variants, so each variant has its own pointer.

use std::ffi::{c_char, c_int, c_ulonglong, c_void, CStr};

use crate::array::*;
use crate::context::*;
use crate::device::*;
use crate::memory::*;
use crate::pool::*;
use crate::stream::*;
use crate::vmm::*;
use crate::{out, CUresult, INVALID_VALUE, NOT_FOUND, SUCCESS};

fn lookup(symbol: &[u8], version: c_int, flags: c_ulonglong) -> Option<*mut c_void> {
    let ptsz = flags & 2 != 0;
    let f: *const () = match symbol {
        b"cuInit" => cuInit as *const (),
        b"cuDriverGetVersion" => cuDriverGetVersion as *const (),
        b"cuDeviceGet" => cuDeviceGet as *const (),
        b"cuDeviceGetCount" => cuDeviceGetCount as *const (),
        b"cuDeviceGetUuid" if version >= 11040 => cuDeviceGetUuid_v2 as *const (),
        b"cuDeviceGetUuid" => cuDeviceGetUuid as *const (),
        b"cuDeviceTotalMem" if version >= 3020 => cuDeviceTotalMem_v2 as *const (),
        b"cuDevicePrimaryCtxRetain" => cuDevicePrimaryCtxRetain as *const (),
        b"cuDevicePrimaryCtxRelease" => cuDevicePrimaryCtxRelease_v2 as *const (),
        b"cuDevicePrimaryCtxReset" => cuDevicePrimaryCtxReset_v2 as *const (),
        b"cuDevicePrimaryCtxGetState" => cuDevicePrimaryCtxGetState as *const (),
        b"cuCtxCreate" if version >= 12050 => cuCtxCreate_v4 as *const (),
        b"cuCtxCreate" if version >= 11040 => cuCtxCreate_v3 as *const (),
        b"cuCtxCreate" => cuCtxCreate_v2 as *const (),
        b"cuCtxDestroy" => cuCtxDestroy_v2 as *const (),
        b"cuCtxSetCurrent" => cuCtxSetCurrent as *const (),
        b"cuCtxGetCurrent" => cuCtxGetCurrent as *const (),
        b"cuCtxPushCurrent" => cuCtxPushCurrent_v2 as *const (),
        b"cuCtxPopCurrent" => cuCtxPopCurrent_v2 as *const (),
        b"cuCtxGetDevice" => cuCtxGetDevice as *const (),
        b"cuCtxSynchronize" => cuCtxSynchronize as *const (),
        b"cuStreamSynchronize" if ptsz => cuStreamSynchronize_ptsz as *const (),
        b"cuStreamSynchronize" => cuStreamSynchronize as *const (),
        b"cuStreamCreate" => cuStreamCreate as *const (),
        b"cuCtxSetLimit" => cuCtxSetLimit as *const (),
        b"cuCtxGetLimit" => cuCtxGetLimit as *const (),
        b"cuLaunchKernel" => cuLaunchKernel as *const (),
        b"cuStreamDestroy" => cuStreamDestroy_v2 as *const (),
        b"cuStreamGetCtx" => cuStreamGetCtx as *const (),
        b"cuStreamGetDevice" if version >= 12080 => cuStreamGetDevice as *const (),
        b"cuMemAlloc" if version >= 14000 => cuMemAlloc_v3 as *const (),
        b"cuMemAlloc" if version >= 3020 => cuMemAlloc_v2 as *const (),
        b"cuMemAlloc" => cuMemAlloc as *const (),
        b"cuMemAllocPitch" if version >= 3020 => cuMemAllocPitch_v2 as *const (),
        b"cuMemAllocPitch" => cuMemAllocPitch as *const (),
        b"cuMemAllocManaged" => cuMemAllocManaged as *const (),
        b"cuMemFree" if version >= 3020 => cuMemFree_v2 as *const (),
        b"cuMemFree" => cuMemFree as *const (),
        b"cuMemAllocAsync" if ptsz => cuMemAllocAsync_ptsz as *const (),
        b"cuMemAllocAsync" => cuMemAllocAsync as *const (),
        b"cuMemAllocFromPoolAsync" if ptsz => cuMemAllocFromPoolAsync_ptsz as *const (),
        b"cuMemAllocFromPoolAsync" => cuMemAllocFromPoolAsync as *const (),
        b"cuMemFreeAsync" if ptsz => cuMemFreeAsync_ptsz as *const (),
        b"cuMemFreeAsync" => cuMemFreeAsync as *const (),
        b"cuMemGetInfo" => cuMemGetInfo_v2 as *const (),
        b"cuDeviceGetDefaultMemPool" => cuDeviceGetDefaultMemPool as *const (),
        b"cuDeviceGetMemPool" => cuDeviceGetMemPool as *const (),
        b"cuMemGetDefaultMemPool" if version >= 13000 => cuMemGetDefaultMemPool as *const (),
        b"cuMemGetMemPool" if version >= 13000 => cuMemGetMemPool as *const (),
        b"cuMemPoolCreate" => cuMemPoolCreate as *const (),
        b"cuMemPoolDestroy" => cuMemPoolDestroy as *const (),
        b"cuMemCreate" => cuMemCreate as *const (),
        b"cuMemRelease" => cuMemRelease as *const (),
        b"cuMemAddressReserve" => cuMemAddressReserve as *const (),
        b"cuMemAddressFree" => cuMemAddressFree as *const (),
        b"cuMemMap" => cuMemMap as *const (),
        b"cuMemUnmap" => cuMemUnmap as *const (),
        b"cuMemSetAccess" => cuMemSetAccess as *const (),
        b"cuMemGetAllocationGranularity" => cuMemGetAllocationGranularity as *const (),
        b"cuMemRetainAllocationHandle" => cuMemRetainAllocationHandle as *const (),
        b"cuMemExportToShareableHandle" => cuMemExportToShareableHandle as *const (),
        b"cuMemImportFromShareableHandle" => cuMemImportFromShareableHandle as *const (),
        b"cuArrayCreate" if version >= 3020 => cuArrayCreate_v2 as *const (),
        b"cuArray3DCreate" if version >= 3020 => cuArray3DCreate_v2 as *const (),
        b"cuMipmappedArrayCreate" => cuMipmappedArrayCreate as *const (),
        b"cuArrayDestroy" => cuArrayDestroy as *const (),
        b"cuMipmappedArrayDestroy" => cuMipmappedArrayDestroy as *const (),
        b"cuGetProcAddress" if version >= 12000 => cuGetProcAddress_v2 as *const (),
        b"cuGetProcAddress" => cuGetProcAddress as *const (),
        _ => return None,
    };
    Some(f as *mut c_void)
}

/// Answers in a forked child too: a lookup touches no driver state.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
) -> CUresult {
    if symbol.is_null() || pfn.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: `symbol` is the caller's NUL-terminated name, not null (checked above).
    match lookup(unsafe { CStr::from_ptr(symbol) }.to_bytes(), version, flags) {
        // SAFETY: `pfn` is the caller's out-parameter, valid for writes under the driver API's
        // contract, and not null (checked above).
        Some(f) => unsafe { out(pfn, f) },
        None => {
            // SAFETY: `pfn` is the caller's out-parameter, valid for writes under the driver API's
            // contract, and not null (checked above).
            unsafe { *pfn = std::ptr::null_mut() };
            NOT_FOUND
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
    status: *mut c_int,
) -> CUresult {
    // SAFETY: passes the caller's arguments on to the same lookup, which checks them as the real
    // driver does.
    let r = unsafe { cuGetProcAddress(symbol, pfn, version, flags) };
    if !status.is_null() {
        // CU_GET_PROC_ADDRESS_SUCCESS = 0, SYMBOL_NOT_FOUND = 1.
        // SAFETY: `status` is the caller's optional out-parameter, valid for writes when not null
        // (checked).
        unsafe { *status = if r == SUCCESS { 0 } else { 1 } };
    }
    r
}
