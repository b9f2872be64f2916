//! CUDA driver hooks: allocations are charged before the driver is asked,
//! frees give back after it succeeds, and memory queries report the cap.

#![allow(non_snake_case)]

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};
use std::sync::atomic::{AtomicU8, Ordering};

use crate::dlsym::LIBCUDA;
use crate::hook::{self, as_fn, guarded, Real};
use crate::ops::{self, charge_size, Refusal, Shim};
use crate::table::Hooked;
use crate::track::{Charge, Tracker};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = c_ulonglong;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUmemGenericAllocationHandle = c_ulonglong;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;

const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;

/// The head of `CUmemAllocationProp` (cuda.h): only `location` is read.
#[repr(C)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requested_handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
}

/// The one place a refusal becomes a driver result.
fn refused(refusal: Refusal) -> CUresult {
    match refusal {
        Refusal::OutOfMemory => CUDA_ERROR_OUT_OF_MEMORY,
    }
}

static POINTERS: Tracker = Tracker::new();
static HANDLES: Tracker = Tracker::new();

/// CUDA ordinal → device position in the accounting file: 0 unknown,
/// 1 not capped, 2 + position otherwise. Filled once per ordinal.
static ORDINALS: [AtomicU8; 64] = [const { AtomicU8::new(0) }; 64];
const UNKNOWN: u8 = 0;
const NOT_CAPPED: u8 = 1;

type CtxGetDeviceFn = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
type DeviceGetUuidFn = unsafe extern "C" fn(*mut [u8; 16], CUdevice) -> CUresult;

/// The capped device an ordinal stands for, found by UUID.
fn device_at(shim: &Shim, ordinal: CUdevice) -> Option<usize> {
    let cache = usize::try_from(ordinal).ok().and_then(|o| ORDINALS.get(o));
    let cached = cache.map_or(UNKNOWN, |c| c.load(Ordering::Relaxed));
    if cached != UNKNOWN {
        return (cached >= 2).then(|| usize::from(cached - 2));
    }
    let mut uuid = [0u8; 16];
    // Once per ordinal: no need to cache the function.
    let address = [c"cuDeviceGetUuid_v2", c"cuDeviceGetUuid"]
        .into_iter()
        .map(|name| LIBCUDA.symbol(name) as usize)
        .find(|&a| a != 0)?;
    // SAFETY: both variants take (CUuuid*, CUdevice) and fill 16 bytes.
    if unsafe { as_fn::<DeviceGetUuidFn>(address)(&mut uuid, ordinal) } != CUDA_SUCCESS {
        return None;
    }
    let dev = shim.device_of(&uuid);
    if let Some(c) = cache {
        c.store(dev.map_or(NOT_CAPPED, |d| d as u8 + 2), Ordering::Relaxed);
    }
    dev
}

/// The capped device of the calling thread's current context.
fn current_device(shim: &Shim) -> Option<usize> {
    static CTX_GET_DEVICE: Real = Real::new();
    let address = LIBCUDA.cached(&CTX_GET_DEVICE, c"cuCtxGetDevice");
    if address == 0 {
        return None;
    }
    let mut ordinal: CUdevice = -1;
    // SAFETY: cuCtxGetDevice(CUdevice*) from the loaded driver.
    if unsafe { as_fn::<CtxGetDeviceFn>(address)(&mut ordinal) } != CUDA_SUCCESS {
        return None;
    }
    device_at(shim, ordinal)
}

/// The shim's state and the capped device of the current context, if any.
fn capped_current() -> Option<(&'static Shim, usize)> {
    let shim = ops::shim()?;
    Some((shim, current_device(shim)?))
}

/// The shim's state and the capped device behind a CUDA ordinal, if any.
fn capped_ordinal(ordinal: CUdevice) -> Option<(&'static Shim, usize)> {
    let shim = ops::shim()?;
    Some((shim, device_at(shim, ordinal)?))
}

/// Charges `bytes` on `dev`, runs the driver call, and records the
/// allocation under the key it produced, or gives the charge back.
fn charged(
    shim: &Shim,
    dev: usize,
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    key: impl FnOnce() -> Option<u64>,
    tracker: &Tracker,
) -> CUresult {
    if let Err(refusal) = shim
        .charge_context(dev)
        .and_then(|()| shim.charge(dev, bytes))
    {
        return refused(refusal);
    }
    let result = call();
    match (result, key()) {
        (CUDA_SUCCESS, Some(key)) => tracker.insert(key, Charge { dev, bytes }),
        _ => shim.uncharge(dev, bytes),
    }
    result
}

/// An allocation on the current context's device.
fn alloc_current(
    requested: u64,
    call: impl FnOnce() -> CUresult,
    key: impl FnOnce() -> Option<u64>,
) -> CUresult {
    match capped_current() {
        Some((shim, dev)) => charged(shim, dev, charge_size(requested), call, key, &POINTERS),
        None => call(),
    }
}

/// A free: forget the record first (so an address reused by a racing
/// allocation is not dropped), give the charge back only on success.
fn release(key: u64, tracker: &Tracker, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some(charge) = tracker.remove(key) else {
        // Not ours (allocated before the shim saw it, or imported): forward.
        return call();
    };
    let result = call();
    match (result, ops::shim()) {
        (CUDA_SUCCESS, Some(shim)) => shim.uncharge(charge.dev, charge.bytes),
        (CUDA_SUCCESS, None) => {}
        _ => tracker.insert(key, charge),
    }
    result
}

/// The real function of a hooked variant, or return `CUDA_ERROR_NOT_INITIALIZED`.
macro_rules! real {
    ($hooked:expr, $ty:ty) => {{
        let address = $hooked.real().get_or_next($hooked.name());
        if address == 0 {
            return CUDA_ERROR_NOT_INITIALIZED;
        }
        // SAFETY: the slot only ever holds the driver's function of this
        // exact variant (matched by name or identity), whose ABI is $ty.
        unsafe { hook::as_fn::<$ty>(address) }
    }};
}

/// Reads an out-parameter the driver just wrote.
fn written<T: Copy>(ptr: *const T) -> Option<T> {
    // SAFETY: only called after the driver returned success for a call
    // that writes through `ptr`; null is checked.
    (!ptr.is_null()).then(|| unsafe { *ptr })
}

type MemAllocFn = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
type MemAllocPitchFn =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> CUresult;
type MemAllocManagedFn = unsafe extern "C" fn(*mut CUdeviceptr, usize, c_uint) -> CUresult;
type MemFreeFn = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
type MemAllocAsyncFn = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
type MemAllocFromPoolAsyncFn =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> CUresult;
type MemFreeAsyncFn = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
type MemCreateFn = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    c_ulonglong,
) -> CUresult;
type MemReleaseFn = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
type PrimaryCtxRetainFn = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
type CtxCreateV2Fn = unsafe extern "C" fn(*mut CUcontext, c_uint, CUdevice) -> CUresult;
type CtxCreateV3Fn =
    unsafe extern "C" fn(*mut CUcontext, *mut c_void, c_int, c_uint, CUdevice) -> CUresult;
type CtxCreateV4Fn =
    unsafe extern "C" fn(*mut CUcontext, *mut c_void, c_uint, CUdevice) -> CUresult;
type MemGetInfoFn = unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult;
type DeviceTotalMemFn = unsafe extern "C" fn(*mut usize, CUdevice) -> CUresult;

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    let real = real!(Hooked::MemAlloc, MemAllocFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(dptr, bytesize) };
    guarded(call, || {
        alloc_current(bytesize as u64, call, || written(dptr))
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    let real = real!(Hooked::MemAllocManaged, MemAllocManagedFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(dptr, bytesize, flags) };
    // Charged in full, though managed memory may live on the host: a
    // container must not be able to page its neighbours out.
    guarded(call, || {
        alloc_current(bytesize as u64, call, || written(dptr))
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CUresult {
    let real = real!(Hooked::MemAllocPitch, MemAllocPitchFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(dptr, pitch, width, height, element_size) };
    guarded(call, || {
        let Some((shim, dev)) = capped_current() else {
            return call();
        };
        // The pitch is only known afterwards: charge the usual 512-byte
        // alignment now and settle the difference once the driver answers.
        let estimate = (width as u64)
            .next_multiple_of(512)
            .saturating_mul(height as u64);
        let result = charged(
            shim,
            dev,
            charge_size(estimate),
            call,
            || written(dptr),
            &POINTERS,
        );
        if result != CUDA_SUCCESS {
            return result;
        }
        let (Some(ptr), Some(pitch)) = (written(dptr), written(pitch)) else {
            return result;
        };
        let actual = charge_size((pitch as u64).saturating_mul(height as u64));
        let Some(mut record) = POINTERS.get(ptr) else {
            return result;
        };
        if actual > record.bytes {
            if let Err(refusal) = shim.charge(dev, actual - record.bytes) {
                POINTERS.remove(ptr);
                shim.uncharge(dev, record.bytes);
                let free = Hooked::MemFree.real().get_or_next(Hooked::MemFree.name());
                if free != 0 {
                    // SAFETY: frees the allocation just made, with cuMemFree_v2.
                    unsafe { as_fn::<MemFreeFn>(free)(ptr) };
                }
                return refused(refusal);
            }
            record.bytes = actual;
            POINTERS.insert(ptr, record);
        }
        result
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    let real = real!(Hooked::MemFree, MemFreeFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(dptr) };
    guarded(call, || release(dptr, &POINTERS, call))
}

/// Stream-ordered allocations: charged like cuMemAlloc, keyed by pointer.
macro_rules! alloc_async {
    ($name:ident, $hooked:expr) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytesize: usize,
            stream: CUstream,
        ) -> CUresult {
            let real = real!($hooked, MemAllocAsyncFn);
            // SAFETY: forwards the caller's arguments unchanged.
            let call = || unsafe { real(dptr, bytesize, stream) };
            guarded(call, || {
                alloc_current(bytesize as u64, call, || written(dptr))
            })
        }
    };
}
alloc_async!(cuMemAllocAsync, Hooked::MemAllocAsync);
alloc_async!(cuMemAllocAsync_ptsz, Hooked::MemAllocAsyncPtsz);

macro_rules! alloc_from_pool {
    ($name:ident, $hooked:expr) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytesize: usize,
            pool: CUmemoryPool,
            stream: CUstream,
        ) -> CUresult {
            let real = real!($hooked, MemAllocFromPoolAsyncFn);
            // SAFETY: forwards the caller's arguments unchanged.
            let call = || unsafe { real(dptr, bytesize, pool, stream) };
            guarded(call, || {
                alloc_current(bytesize as u64, call, || written(dptr))
            })
        }
    };
}
alloc_from_pool!(cuMemAllocFromPoolAsync, Hooked::MemAllocFromPoolAsync);
alloc_from_pool!(
    cuMemAllocFromPoolAsync_ptsz,
    Hooked::MemAllocFromPoolAsyncPtsz
);

macro_rules! free_async {
    ($name:ident, $hooked:expr) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
            let real = real!($hooked, MemFreeAsyncFn);
            // SAFETY: forwards the caller's arguments unchanged.
            let call = || unsafe { real(dptr, stream) };
            guarded(call, || release(dptr, &POINTERS, call))
        }
    };
}
free_async!(cuMemFreeAsync, Hooked::MemFreeAsync);
free_async!(cuMemFreeAsync_ptsz, Hooked::MemFreeAsyncPtsz);

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    let real = real!(Hooked::MemCreate, MemCreateFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(handle, size, prop, flags) };
    guarded(call, || {
        // SAFETY: `prop` is the caller's allocation properties (null checked);
        // only its leading fields, present in every CUDA version, are read.
        let location =
            (!prop.is_null()).then(|| unsafe { ((*prop).location_type, (*prop).location_id) });
        // Host and host-NUMA locations (NCCL, ggml) are not device memory.
        let Some((CU_MEM_LOCATION_TYPE_DEVICE, ordinal)) = location else {
            return call();
        };
        match capped_ordinal(ordinal) {
            // Sizes are already granularity-aligned: charge exactly.
            Some((shim, dev)) => {
                charged(shim, dev, size as u64, call, || written(handle), &HANDLES)
            }
            None => call(),
        }
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    let real = real!(Hooked::MemRelease, MemReleaseFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(handle) };
    guarded(call, || release(handle, &HANDLES, call))
}

/// Context creation on `ordinal`: charge the per-process context cost first.
fn with_context(ordinal: CUdevice, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some((shim, dev)) = capped_ordinal(ordinal) else {
        return call();
    };
    match shim.charge_context(dev) {
        Ok(()) => call(),
        Err(refusal) => refused(refusal),
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let real = real!(Hooked::PrimaryCtxRetain, PrimaryCtxRetainFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pctx, dev) };
    guarded(call, || with_context(dev, call))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let real = real!(Hooked::CtxCreateV2, CtxCreateV2Fn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pctx, flags, dev) };
    guarded(call, || with_context(dev, call))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    params: *mut c_void,
    num_params: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let real = real!(Hooked::CtxCreateV3, CtxCreateV3Fn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pctx, params, num_params, flags, dev) };
    guarded(call, || with_context(dev, call))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    let real = real!(Hooked::CtxCreateV4, CtxCreateV4Fn);
    // SAFETY: forwards the caller's arguments unchanged.
    let call = || unsafe { real(pctx, params, flags, dev) };
    guarded(call, || with_context(dev, call))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let real = real!(Hooked::MemGetInfo, MemGetInfoFn);
    // The real call first keeps the driver's NULL and error semantics.
    // SAFETY: forwards the caller's arguments unchanged.
    let result = unsafe { real(free, total) };
    if result != CUDA_SUCCESS {
        return result;
    }
    guarded(
        || (),
        || {
            let (Some(real_free), Some(real_total)) = (written(free), written(total)) else {
                return;
            };
            let Some((shim, dev)) = capped_current() else {
                return;
            };
            let (f, t) = shim.cuda_info(dev, real_free as u64, real_total as u64);
            // SAFETY: both pointers were just written by the driver.
            unsafe {
                *free = f as usize;
                *total = t as usize;
            }
        },
    );
    result
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    let real = real!(Hooked::DeviceTotalMem, DeviceTotalMemFn);
    // SAFETY: forwards the caller's arguments unchanged.
    let result = unsafe { real(bytes, dev) };
    if result != CUDA_SUCCESS {
        return result;
    }
    guarded(
        || (),
        || {
            let Some(real_total) = written(bytes) else {
                return;
            };
            let Some((shim, d)) = capped_ordinal(dev) else {
                return;
            };
            // SAFETY: the driver just wrote through `bytes`.
            unsafe { *bytes = shim.cap(d).min(real_total as u64) as usize };
        },
    );
    result
}
