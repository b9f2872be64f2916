//! Stream-ordered memory pools: an allocation from a pool is on the pool's
//! device, whatever the current context is. The driver cannot be asked a
//! pool's location, so it is remembered where pools are created or handed
//! out. What a pool reserves beyond its live allocations (it grows in 32 MiB
//! steps on an H100 (docs/GPU_VERIFICATION.md), and keeps freed memory up to its release threshold)
//! is left to reconciliation.

#![allow(non_snake_case)]

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard};

use crate::cuda::{
    CUdevice, CUmemAllocationProp, CUmemoryPool, CUresult, CUstream, Placed,
    CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS,
};
use crate::devices::{self, Site};
use crate::hook::{answered, real};

const CU_MEM_ALLOCATION_TYPE_MANAGED: c_int = 2;

/// Where a pool's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Location {
    Device(CUdevice),
    Host,
    /// Managed memory that prefers no device, or memory at a location the
    /// shim does not know: charged in full to the device it is asked for
    /// on, as `cuMemAllocManaged` is.
    Current,
}

impl Location {
    /// Where a pool of allocation type `kind` at `placed` puts its
    /// memory. A managed pool that prefers the host is charged like one
    /// that prefers nothing: a preference does not keep managed memory off
    /// the GPU.
    fn of(kind: c_int, placed: Placed) -> Location {
        match (kind, placed) {
            (_, Placed::Device(ordinal)) => Location::Device(ordinal),
            (CU_MEM_ALLOCATION_TYPE_MANAGED, _) | (_, Placed::Elsewhere | Placed::Unset) => {
                Location::Current
            }
            (_, Placed::Host) => Location::Host,
        }
    }
}

/// `CUmemLocation` (cuda.h).
#[repr(C)]
pub struct CUmemLocation {
    pub type_: c_int,
    pub id: c_int,
}

static POOLS: Mutex<BTreeMap<usize, Location>> = Mutex::new(BTreeMap::new());

fn pools() -> MutexGuard<'static, BTreeMap<usize, Location>> {
    crate::fork::lock(&POOLS)
}

fn remember(pool: CUmemoryPool, location: Location) {
    pools().insert(pool as usize, location);
}

/// Where an allocation from `pool` on `stream` is charged: the pool's
/// device; the stream's for a managed pool that prefers no device and for
/// a pool the shim never saw made; nowhere for a host pool.
pub fn site(pool: CUmemoryPool, stream: CUstream) -> Option<Site> {
    let location = pools().get(&(pool as usize)).copied();
    match location {
        Some(Location::Host) => None,
        Some(Location::Device(ordinal)) => {
            let (shim, dev) = devices::at(ordinal)?;
            Some(Site {
                shim,
                dev,
                ctx: devices::NO_CONTEXT,
            })
        }
        Some(Location::Current) | None => devices::of_stream(stream),
    }
}

/// Reads the pool the driver just wrote.
fn made(pool: *mut CUmemoryPool) -> Option<CUmemoryPool> {
    crate::cuda::written(pool).filter(|p| !p.is_null())
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    props: *const CUmemAllocationProp,
) -> CUresult {
    real!(let call = cuMemPoolCreate(pool, props) else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || {
        // CUmemPoolProps starts like CUmemAllocationProp.
        if let (Some(made), Some((kind, placed))) = (made(pool), CUmemAllocationProp::read(props)) {
            remember(made, Location::of(kind, placed));
        }
    })
}

macro_rules! device_pool {
    ($name:ident) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
            real!(let call = $name(pool, dev) else CUDA_ERROR_NOT_INITIALIZED);
            answered(call, CUDA_SUCCESS, || {
                if let Some(made) = made(pool) {
                    remember(made, Location::Device(dev));
                }
            })
        }
    };
}
device_pool!(cuDeviceGetDefaultMemPool);
device_pool!(cuDeviceGetMemPool);

/// CUDA 13's pools by location and allocation type (device, host,
/// host NUMA; managed ones may prefer no location).
macro_rules! location_pool {
    ($name:ident) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(
            pool: *mut CUmemoryPool,
            location: *const CUmemLocation,
            kind: c_int,
        ) -> CUresult {
            real!(let call = $name(pool, location, kind) else CUDA_ERROR_NOT_INITIALIZED);
            answered(call, CUDA_SUCCESS, || {
                if let (Some(made), false) = (made(pool), location.is_null()) {
                    // SAFETY: the caller's location, not null (checked),
                    // which the driver just read.
                    let location = unsafe { &*location };
                    remember(made, Location::of(kind, Placed::of(location.type_, location.id)));
                }
            })
        }
    };
}
location_pool!(cuMemGetDefaultMemPool);
location_pool!(cuMemGetMemPool);

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    real!(let call = cuMemPoolDestroy(pool) else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || {
        // Its handle may come back for another pool.
        pools().remove(&(pool as usize));
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_placed_by_allocation_type_and_location() {
        const PINNED: c_int = 1;
        const MANAGED: c_int = CU_MEM_ALLOCATION_TYPE_MANAGED;
        let at = |kind, location_type, id| Location::of(kind, Placed::of(location_type, id));
        // (allocation type, location type, id) → where it is charged.
        for (kind, location_type, id, expected) in [
            (PINNED, 1, 1, Location::Device(1)),
            (PINNED, 2, 0, Location::Host),
            (PINNED, 3, 0, Location::Host),
            (PINNED, 4, 0, Location::Host),
            // No location, or one newer than the shim: never uncapped.
            (PINNED, 0, 0, Location::Current),
            (PINNED, 6, 0x0100, Location::Current),
            (MANAGED, 1, 0, Location::Device(0)),
            (MANAGED, 0, 0, Location::Current),
            (MANAGED, 2, 0, Location::Current),
        ] {
            assert_eq!(
                at(kind, location_type, id),
                expected,
                "{kind} {location_type} {id}"
            );
        }
    }
}
