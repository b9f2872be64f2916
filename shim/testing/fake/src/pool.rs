//! Stream-ordered memory pools: each device's default pool and created ones,
//! known by the device they allocate on. Pool reserve slack is not modelled:
//! a pool allocation costs what `cuMemAlloc` of the same size would.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::{device, out, CUdevice, CUresult, INVALID_DEVICE, INVALID_VALUE, SUCCESS};

type CUmemoryPool = *mut c_void;

/// Default pools are `DEFAULT + dev`; created ones come after them.
const DEFAULT: usize = 0x00d0_0000;
const LOCATION_DEVICE: c_int = 1;

struct Pools {
    /// Created pools' devices by handle.
    created: HashMap<usize, usize>,
    next: usize,
}

fn pools() -> MutexGuard<'static, Pools> {
    static POOLS: OnceLock<Mutex<Pools>> = OnceLock::new();
    POOLS
        .get_or_init(|| {
            Mutex::new(Pools {
                created: HashMap::new(),
                next: DEFAULT + 0x1000,
            })
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The device `pool` allocates on; `None` for null or unknown pools.
pub(crate) fn device_of(pool: CUmemoryPool) -> Option<usize> {
    let handle = pool as usize;
    match handle.checked_sub(DEFAULT) {
        Some(dev) if dev < crate::config().uuids.len() => Some(dev),
        _ => pools().created.get(&handle).copied(),
    }
}

unsafe fn default_pool(pool: *mut CUmemoryPool, dev: CUdevice) -> CUresult {
    refuse_after_fork!();
    match device(dev) {
        // SAFETY: `pool` is the out-parameter our callers were given, null or valid for writes;
        // `out` checks for null.
        Some(d) => unsafe { out(pool, (DEFAULT + d) as CUmemoryPool) },
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
    // SAFETY: the caller's properties, not null (checked above) and valid for reads under
    // `cuMemPoolCreate`'s contract; only their leading fields, present in every CUDA version, are
    // declared.
    let props = unsafe { &*props };
    if props.location_type != LOCATION_DEVICE {
        return INVALID_VALUE;
    }
    let Some(dev) = device(props.location_id) else {
        return INVALID_DEVICE;
    };
    let mut pools = pools();
    let handle = pools.next;
    pools.next += 0x10;
    pools.created.insert(handle, dev);
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
