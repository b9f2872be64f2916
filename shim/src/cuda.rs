//! CUDA driver hooks: allocations are charged before the driver is asked,
//! frees give back after it succeeds, and memory queries report the cap.

#![allow(non_snake_case)]

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};

use crate::devices::{self, Site};
use crate::hook::{answered, guarded, real};
use crate::ops::{self, Refusal, Shim};
use crate::pool;
use crate::track::{self, Allocation, Allocations};

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

/// The head of `CUmemAllocationProp` and `CUmemPoolProps` (cuda.h): only
/// the location is read.
#[repr(C)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requested_handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
}

impl CUmemAllocationProp {
    /// The device ordinal of a device location, read from the caller's
    /// properties (null checked); `None` for host locations.
    pub fn device(prop: *const Self) -> Option<CUdevice> {
        // SAFETY: the caller's properties; the leading fields are present
        // in every CUDA version.
        let (kind, id) =
            (!prop.is_null()).then(|| unsafe { ((*prop).location_type, (*prop).location_id) })?;
        (kind == CU_MEM_LOCATION_TYPE_DEVICE).then_some(id)
    }
}

/// The one place a refusal becomes a driver result.
pub fn refused(refusal: Refusal) -> CUresult {
    match refusal {
        Refusal::OutOfMemory => CUDA_ERROR_OUT_OF_MEMORY,
    }
}

/// Every device allocation of this process (cuMemAlloc family and pools).
static ALLOCATIONS: Allocations = Allocations::new();

/// Reads an out-parameter the driver just wrote.
pub fn written<T: Copy>(ptr: *const T) -> Option<T> {
    // SAFETY: only called after the driver returned success for a call
    // that writes through `ptr`; null is checked.
    (!ptr.is_null()).then(|| unsafe { *ptr })
}

/// Charges an allocation before the driver makes it (every 2 MiB chunk an
/// `estimate`-byte allocation can take), then settles the charge to the
/// chunks it really took once the driver says where it went: a chunk it
/// shares with earlier allocations costs nothing more. If it took more than
/// charged and that does not fit, it is freed with `undo` and refused.
fn allocate(
    site: Site,
    estimate: u64,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<(u64, u64)>,
    undo: impl FnOnce(u64) -> CUresult,
) -> CUresult {
    let Site { shim, dev, ctx } = site;
    let upfront = track::upper_bound(estimate);
    if let Err(refusal) = shim.charge(dev, upfront) {
        return refused(refusal);
    }
    let result = call();
    let Some((ptr, size)) = (result == CUDA_SUCCESS).then(made).flatten() else {
        shim.uncharge(dev, upfront);
        return result;
    };
    let allocation = Allocation {
        dev,
        ctx,
        ptr,
        size,
    };
    let taken = ALLOCATIONS.insert(allocation);
    match shim.settle(dev, upfront, taken) {
        Ok(()) => result,
        Err(refusal) => {
            ALLOCATIONS.take(ptr);
            shim.uncharge(dev, upfront);
            undo(ptr);
            refused(refusal)
        }
    }
}

/// An allocation of `bytesize` at `site` (none: not capped), written to
/// `dptr` by the driver.
fn sized(
    site: Option<Site>,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    call: impl FnOnce() -> CUresult,
    undo: impl FnOnce(u64) -> CUresult,
) -> CUresult {
    match site {
        Some(site) => allocate(
            site,
            bytesize as u64,
            call,
            || Some((written(dptr)?, bytesize as u64)),
            undo,
        ),
        None => call(),
    }
}

/// A free: forget the record first (so an address reused by a racing
/// allocation is not dropped), give back what the driver got back only on
/// success.
fn free(ptr: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    let Some((allocation, back)) = ALLOCATIONS.take(ptr) else {
        // Not ours (allocated before the shim saw it): just forward.
        return call();
    };
    let result = call();
    if result != CUDA_SUCCESS {
        ALLOCATIONS.untake(allocation);
        return result;
    }
    if let Some(shim) = ops::shim() {
        shim.uncharge(allocation.dev, back);
    }
    result
}

/// Gives back what a destroyed context's allocations held: the driver
/// freed them with it.
pub fn drop_allocations(shim: &Shim, ctx: usize) {
    ALLOCATIONS.drain_context(ctx, |allocation, back| shim.uncharge(allocation.dev, back));
}

/// Frees `ptr` with the real `cuMemFree_v2` (undoing an allocation).
fn free_now(ptr: u64) -> CUresult {
    real!(let call = cuMemFree_v2(ptr) else CUDA_ERROR_NOT_INITIALIZED);
    call()
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    real!(let call = cuMemAlloc_v2(dptr, bytesize) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, || {
        sized(devices::current(), dptr, bytesize, call, free_now)
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    real!(let call = cuMemAllocManaged(dptr, bytesize, flags) else CUDA_ERROR_NOT_INITIALIZED);
    // Charged in full, though managed memory may live on the host: a
    // container must not be able to page its neighbours out.
    guarded(call, || {
        sized(devices::current(), dptr, bytesize, call, free_now)
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
    real!(let call = cuMemAllocPitch_v2(dptr, pitch, width, height, element_size)
        else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, || {
        let Some(site) = devices::current() else {
            return call();
        };
        // The pitch is only known afterwards: estimate the usual 512-byte
        // alignment now and settle once the driver answers.
        let estimate = (width as u64)
            .next_multiple_of(512)
            .saturating_mul(height as u64);
        allocate(
            site,
            estimate,
            call,
            || {
                let size = (written(pitch)? as u64).saturating_mul(height as u64);
                Some((written(dptr)?, size))
            },
            free_now,
        )
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    real!(let call = cuMemFree_v2(dptr) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, || free(dptr, call))
}

/// Stream-ordered allocations from the current device's pool: charged like
/// cuMemAlloc, keyed by pointer.
macro_rules! alloc_async {
    ($name:ident, $free:expr) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytesize: usize,
            stream: CUstream,
        ) -> CUresult {
            real!(let call = $name(dptr, bytesize, stream) else CUDA_ERROR_NOT_INITIALIZED);
            // SAFETY: frees the allocation just made, on its stream.
            let undo = |ptr| unsafe { $free(ptr, stream) };
            guarded(call, || {
                sized(devices::current(), dptr, bytesize, call, undo)
            })
        }
    };
}
alloc_async!(cuMemAllocAsync, cuMemFreeAsync);
alloc_async!(cuMemAllocAsync_ptsz, cuMemFreeAsync_ptsz);

/// Allocations from an explicit pool: charged on the pool's device, which
/// need not be the current context's.
macro_rules! alloc_from_pool {
    ($name:ident, $free:expr) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytesize: usize,
            pool: CUmemoryPool,
            stream: CUstream,
        ) -> CUresult {
            real!(let call = $name(dptr, bytesize, pool, stream) else CUDA_ERROR_NOT_INITIALIZED);
            // SAFETY: frees the allocation just made, on its stream.
            let undo = |ptr| unsafe { $free(ptr, stream) };
            guarded(call, || sized(pool::site(pool), dptr, bytesize, call, undo))
        }
    };
}
alloc_from_pool!(cuMemAllocFromPoolAsync, cuMemFreeAsync);
alloc_from_pool!(cuMemAllocFromPoolAsync_ptsz, cuMemFreeAsync_ptsz);

macro_rules! free_async {
    ($name:ident) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
            real!(let call = $name(dptr, stream) else CUDA_ERROR_NOT_INITIALIZED);
            guarded(call, || free(dptr, call))
        }
    };
}
free_async!(cuMemFreeAsync);
free_async!(cuMemFreeAsync_ptsz);

/// The current device's (free, total) as the container sees it, in place
/// of what the driver just wrote. Inlined into the hook: frameworks ask
/// before large allocations, and out of line it cost the query a call and
/// moved code on the allocation path (callgrind, `cargo bench --bench shim`).
#[inline]
fn report_info(free: *mut usize, total: *mut usize) {
    let (Some(real_free), Some(real_total)) = (written(free), written(total)) else {
        return;
    };
    let Some(Site { shim, dev, .. }) = devices::current() else {
        return;
    };
    let (f, t) = shim.cuda_info(dev, real_free as u64, real_total as u64);
    // SAFETY: both pointers were just written by the driver.
    unsafe {
        *free = f as usize;
        *total = t as usize;
    }
}

/// The cap as device `dev`'s total, in place of what the driver just wrote.
fn report_total(bytes: *mut usize, dev: CUdevice) {
    let Some(real_total) = written(bytes) else {
        return;
    };
    let Some((shim, d)) = devices::at(dev) else {
        return;
    };
    // SAFETY: the driver just wrote through `bytes`.
    unsafe { *bytes = shim.cap(d).min(real_total as u64) as usize };
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    real!(let call = cuMemGetInfo_v2(free, total) else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || report_info(free, total))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    real!(let call = cuDeviceTotalMem_v2(bytes, dev) else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || report_total(bytes, dev))
}
