//! Stream-ordered memory pools: an allocation from a pool is on the pool's
//! device, whatever the current context is. The driver cannot be asked a
//! pool's location, so it is remembered where pools are created or handed
//! out. What a pool reserves beyond its live allocations (it grows in 32 MiB
//! steps on an H100 (docs/GPU_VERIFICATION.md), and keeps freed memory up to its release threshold)
//! is left to reconciliation.

#![allow(non_snake_case)]

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::cuda::{
    CUdevice, CUmemAllocationProp, CUmemoryPool, CUresult, CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS,
};
use crate::devices::{self, Site};
use crate::hook::{answered, real};

/// Where a pool's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Location {
    Device(CUdevice),
    Host,
}

static POOLS: Mutex<BTreeMap<usize, Location>> = Mutex::new(BTreeMap::new());

fn pools() -> MutexGuard<'static, BTreeMap<usize, Location>> {
    crate::fork::lock(&POOLS)
}

fn remember(pool: CUmemoryPool, location: Location) {
    pools().insert(pool as usize, location);
}

/// Where an allocation from `pool` is charged: the pool's device; the
/// current context's for a pool the shim never saw made; nowhere for a
/// host pool.
pub fn site(pool: CUmemoryPool) -> Option<Site> {
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
        None => devices::current().map(Site::unowned),
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
        if let Some(made) = made(pool) {
            // CUmemPoolProps starts like CUmemAllocationProp.
            let location =
                CUmemAllocationProp::device(props).map_or(Location::Host, Location::Device);
            remember(made, location);
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

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    real!(let call = cuMemPoolDestroy(pool) else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || {
        // Its handle may come back for another pool.
        pools().remove(&(pool as usize));
    })
}
