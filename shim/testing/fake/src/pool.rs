//! Stream-ordered memory pools: each device's default pool, CUDA 13's
//! default host and managed pools, and created ones, known by where they
//! put their memory. Pool reserve slack is not modelled: a pool allocation
//! costs what `cuMemAlloc` of the same size would.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::{device, out, CUdevice, CUresult, INVALID_DEVICE, INVALID_VALUE, SUCCESS};

type CUmemoryPool = *mut c_void;

/// Default device pools are `DEFAULT + dev`; created ones come after them.
const DEFAULT: usize = 0x00d0_0000;
/// The default pinned host pool.
const HOST: usize = DEFAULT + 0x800;
/// The default managed pool with no preferred location; those preferring
/// a device come after it.
const MANAGED: usize = DEFAULT + 0x900;
const FIRST_CREATED: usize = DEFAULT + 0x1000;

const ALLOCATION_PINNED: c_int = 1;
const ALLOCATION_MANAGED: c_int = 2;
const LOCATION_NONE: c_int = 0;
const LOCATION_DEVICE: c_int = 1;
const LOCATION_HOST: c_int = 2;
const LOCATION_HOST_NUMA: c_int = 3;

/// Where a pool's allocations go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    Device(usize),
    /// Pinned host memory.
    Host,
    /// Managed memory with no device preferred: the current context's
    /// device, as `cuMemAllocManaged` here.
    Current,
}

impl Place {
    /// Where a pool of `alloc_type` at `(location_type, id)` puts its
    /// memory, for the combinations the driver accepts.
    fn of(alloc_type: c_int, location_type: c_int, id: c_int) -> Result<Place, CUresult> {
        match (alloc_type, location_type) {
            (ALLOCATION_PINNED | ALLOCATION_MANAGED, LOCATION_DEVICE) => {
                device(id).map(Place::Device).ok_or(INVALID_DEVICE)
            }
            (ALLOCATION_PINNED, LOCATION_HOST | LOCATION_HOST_NUMA) => Ok(Place::Host),
            (ALLOCATION_MANAGED, LOCATION_NONE | LOCATION_HOST) => Ok(Place::Current),
            _ => Err(INVALID_VALUE),
        }
    }
}

struct Pools {
    /// Created pools by handle.
    created: HashMap<usize, Place>,
    next: usize,
}

fn pools() -> MutexGuard<'static, Pools> {
    static POOLS: OnceLock<Mutex<Pools>> = OnceLock::new();
    POOLS
        .get_or_init(|| {
            Mutex::new(Pools {
                created: HashMap::new(),
                next: FIRST_CREATED,
            })
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Where `pool` puts its memory; `None` for null or unknown pools.
pub(crate) fn place_of(pool: CUmemoryPool) -> Option<Place> {
    let handle = pool as usize;
    match handle {
        HOST => Some(Place::Host),
        MANAGED => Some(Place::Current),
        _ if handle > MANAGED && handle <= MANAGED + crate::config().uuids.len() => {
            Some(Place::Device(handle - MANAGED - 1))
        }
        _ => match handle.checked_sub(DEFAULT) {
            Some(dev) if dev < crate::config().uuids.len() => Some(Place::Device(dev)),
            _ => pools().created.get(&handle).copied(),
        },
    }
}

/// The default pool of an allocation type at a place.
fn default_of(alloc_type: c_int, place: Place) -> CUmemoryPool {
    (match (alloc_type, place) {
        (ALLOCATION_MANAGED, Place::Device(dev)) => MANAGED + 1 + dev,
        (_, Place::Device(dev)) => DEFAULT + dev,
        (_, Place::Host) => HOST,
        (_, Place::Current) => MANAGED,
    }) as CUmemoryPool
}

unsafe fn default_pool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    refuse_after_fork!();
    match device(dev) {
        // SAFETY: `pool` is the out-parameter our callers were given, null or valid for writes;
        // `out` checks for null.
        Some(d) => unsafe { out(pool, default_of(ALLOCATION_PINNED, Place::Device(d))) },
        None => INVALID_DEVICE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetDefaultMemPool(
    pool: *mut CUmemoryPool,
    dev: CUdevice,
) -> CUresult {
    // SAFETY: `default_pool` needs `pool` null or valid for writes, as `cuDeviceGetDefaultMemPool`
    // requires of its caller.
    unsafe { default_pool(pool, dev) }
}

/// No `cuDeviceSetMemPool` here, so the current pool is the default one.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    // SAFETY: `default_pool` needs `pool` null or valid for writes, as `cuDeviceGetMemPool`
    // requires of its caller.
    unsafe { default_pool(pool, dev) }
}

/// `CUmemLocation`.
#[repr(C)]
pub struct CUmemLocation {
    location_type: c_int,
    id: c_int,
}

/// CUDA 13's default pool of a location and allocation type.
unsafe fn location_pool(
    pool: *mut CUmemoryPool,
    location: *const CUmemLocation,
    alloc_type: c_int,
) -> CUresult {
    refuse_after_fork!();
    if location.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's location, not null (checked above) and valid for reads under the
    // driver API's contract.
    let location = unsafe { &*location };
    match Place::of(alloc_type, location.location_type, location.id) {
        // SAFETY: `pool` is the caller's out-parameter: null, which `out` refuses, or valid for
        // writes.
        Ok(place) => unsafe { out(pool, default_of(alloc_type, place)) },
        Err(code) => code,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetDefaultMemPool(
    pool: *mut CUmemoryPool,
    location: *const CUmemLocation,
    alloc_type: c_int,
) -> CUresult {
    // SAFETY: as `cuMemGetDefaultMemPool` requires of its caller.
    unsafe { location_pool(pool, location, alloc_type) }
}

/// No `cuMemSetMemPool` here, so the current pool is the default one.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetMemPool(
    pool: *mut CUmemoryPool,
    location: *const CUmemLocation,
    alloc_type: c_int,
) -> CUresult {
    // SAFETY: as `cuMemGetMemPool` requires of its caller.
    unsafe { location_pool(pool, location, alloc_type) }
}

/// The head of `CUmemPoolProps`, all the fake reads.
#[repr(C)]
pub struct CUmemPoolPropsHead {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
}

#[no_mangle]
pub unsafe extern "C" fn cuMemPoolCreate(
    pool: *mut CUmemoryPool,
    props: *const CUmemPoolPropsHead,
) -> CUresult {
    refuse_after_fork!();
    if pool.is_null() || props.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's properties, not null (checked above) and valid for reads under the
    // contract of `cuMemPoolCreate`; only their leading fields, present in every CUDA version, are
    // declared.
    let props = unsafe { &*props };
    let place = match Place::of(props.alloc_type, props.location_type, props.location_id) {
        Ok(place) => place,
        Err(code) => return code,
    };
    let mut pools = pools();
    let handle = pools.next;
    pools.next += 0x10;
    pools.created.insert(handle, place);
    // SAFETY: `pool` is the caller's out-parameter, valid for writes under the driver API's
    // contract, and not null (checked above).
    unsafe { out(pool, handle as CUmemoryPool) }
}

#[no_mangle]
pub extern "C" fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult {
    refuse_after_fork!();
    match pools().created.remove(&(pool as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_VALUE,
    }
}
