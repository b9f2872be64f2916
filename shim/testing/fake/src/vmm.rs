//! Virtual memory management: physical handles, reserved address ranges and
//! the mappings between them, with the real driver's lifetimes: a handle's
//! memory goes when its last reference is released AND its last mapping is
//! unmapped. Handles outlive contexts (`cuCtxDestroy` does not free them).

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_ulonglong, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::memory::address_space;
use crate::{
    device, node, out, CUdeviceptr, CUresult, INVALID_DEVICE, INVALID_VALUE, NOT_SUPPORTED, PAGE,
    SUCCESS,
};

type Handle = c_ulonglong;

const LOCATION_DEVICE: c_int = 1;
const POSIX_FD: c_int = 1;

#[repr(C)]
pub struct CUmemAllocationProp {
    type_: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}

struct Physical {
    dev: usize,
    /// Device memory it holds (0 when host-located).
    cost: u64,
    size: u64,
    handle_types: c_int,
    refs: u32,
    mappings: u32,
}

#[derive(Default)]
struct Vmm {
    handles: HashMap<Handle, Physical>,
    /// Reserved ranges: start → length.
    reserved: BTreeMap<u64, u64>,
    /// Mappings: start → (length, handle).
    mapped: BTreeMap<u64, (u64, Handle)>,
    /// Exported "file descriptors" → handle.
    exported: HashMap<c_int, Handle>,
    next_token: c_int,
}

impl Vmm {
    /// Frees `handle`'s memory once nothing references or maps it.
    fn settle(&mut self, handle: Handle) {
        if let Some(p) = self.handles.get(&handle) {
            if p.refs == 0 && p.mappings == 0 {
                node::uncharge(p.dev, p.cost);
                self.handles.remove(&handle);
                self.exported.retain(|_, h| *h != handle);
            }
        }
    }

    /// Takes one more reference to `handle`.
    fn retain(&mut self, handle: Handle) -> Option<Handle> {
        self.handles.get_mut(&handle)?.refs += 1;
        Some(handle)
    }
}

fn vmm() -> MutexGuard<'static, Vmm> {
    static VMM: OnceLock<Mutex<Vmm>> = OnceLock::new();
    VMM.get_or_init(|| {
        Mutex::new(Vmm {
            next_token: 1000,
            ..Vmm::default()
        })
    })
    .lock()
    .unwrap_or_else(|e| e.into_inner())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut Handle,
    size: usize,
    prop: *const CUmemAllocationProp,
    _flags: c_ulonglong,
) -> CUresult {
    refuse_after_fork!();
    let size = size as u64;
    if prop.is_null() || handle.is_null() || size == 0 || !size.is_multiple_of(PAGE) {
        return INVALID_VALUE;
    }
    // SAFETY: the caller's properties, not null (checked above) and valid for reads under
    // `cuMemCreate`'s contract; only their leading fields are declared.
    let prop = unsafe { &*prop };
    let (dev, cost) = if prop.location_type == LOCATION_DEVICE {
        match device(prop.location_id) {
            Some(d) => (d, size),
            None => return INVALID_DEVICE,
        }
    } else {
        (0, 0)
    };
    if let Err(code) = node::charge(dev, cost) {
        return code;
    }
    let h = address_space(PAGE, PAGE);
    let physical = Physical {
        dev,
        cost,
        size,
        handle_types: prop.handle_types,
        refs: 1,
        mappings: 0,
    };
    vmm().handles.insert(h, physical);
    // SAFETY: `handle` is the caller's out-parameter, valid for writes under the driver API's
    // contract, and not null (checked above).
    unsafe { out(handle, h) }
}

#[no_mangle]
pub extern "C" fn cuMemRelease(handle: Handle) -> CUresult {
    refuse_after_fork!();
    let mut vmm = vmm();
    match vmm.handles.get_mut(&handle) {
        Some(p) if p.refs > 0 => p.refs -= 1,
        _ => return INVALID_VALUE,
    }
    vmm.settle(handle);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    alignment: usize,
    _addr: CUdeviceptr,
    _flags: c_ulonglong,
) -> CUresult {
    refuse_after_fork!();
    let size = size as u64;
    if ptr.is_null() || size == 0 || !size.is_multiple_of(PAGE) {
        return INVALID_VALUE;
    }
    let start = address_space(size, alignment as u64);
    vmm().reserved.insert(start, size);
    // SAFETY: `ptr` is the caller's out-parameter, valid for writes under the driver API's
    // contract, and not null (checked above).
    unsafe { out(ptr, start) }
}

/// Refuses a range that still has mappings in it.
#[no_mangle]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    refuse_after_fork!();
    let mut vmm = vmm();
    let end = ptr.saturating_add(size as u64);
    let in_use = vmm.mapped.range(ptr..end).next().is_some();
    if vmm.reserved.get(&ptr) != Some(&(size as u64)) || in_use {
        return INVALID_VALUE;
    }
    vmm.reserved.remove(&ptr);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: Handle,
    _flags: c_ulonglong,
) -> CUresult {
    refuse_after_fork!();
    if offset != 0 {
        return NOT_SUPPORTED;
    }
    let mut vmm = vmm();
    let (size, end) = (size as u64, ptr.saturating_add(size as u64));
    let fits = vmm
        .handles
        .get(&handle)
        .is_some_and(|p| size > 0 && size <= p.size);
    let reserved = vmm
        .reserved
        .range(..=ptr)
        .next_back()
        .is_some_and(|(&start, &len)| end <= start + len);
    let overlaps = vmm
        .mapped
        .range(..end)
        .next_back()
        .is_some_and(|(&start, &(len, _))| start + len > ptr);
    if !fits || !reserved || overlaps || !size.is_multiple_of(PAGE) {
        return INVALID_VALUE;
    }
    vmm.mapped.insert(ptr, (size, handle));
    if let Some(p) = vmm.handles.get_mut(&handle) {
        p.mappings += 1;
    }
    SUCCESS
}

/// Unmaps every mapping in the range, which must not cut any of them.
#[no_mangle]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    refuse_after_fork!();
    let mut vmm = vmm();
    let end = ptr.saturating_add(size as u64);
    // Mappings are disjoint, so their ends rise with their starts.
    let hit: Vec<(u64, u64)> = vmm
        .mapped
        .range(..end)
        .rev()
        .take_while(|&(&start, &(len, _))| start + len > ptr)
        .map(|(&start, &(len, _))| (start, len))
        .collect();
    if hit.is_empty()
        || hit
            .iter()
            .any(|&(start, len)| start < ptr || start + len > end)
    {
        return INVALID_VALUE;
    }
    for (start, _) in hit {
        if let Some((_, handle)) = vmm.mapped.remove(&start) {
            if let Some(p) = vmm.handles.get_mut(&handle) {
                p.mappings -= 1;
            }
            vmm.settle(handle);
        }
    }
    SUCCESS
}

/// Access is not modelled: everything mapped is accessible.
#[no_mangle]
pub extern "C" fn cuMemSetAccess(
    _ptr: CUdeviceptr,
    _size: usize,
    _desc: *const c_void,
    _count: usize,
) -> CUresult {
    refuse_after_fork!();
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    _prop: *const CUmemAllocationProp,
    _option: c_int,
) -> CUresult {
    refuse_after_fork!();
    // SAFETY: `granularity` is the caller's out-parameter: null, which `out` refuses, or valid for
    // writes, as the driver API requires.
    unsafe { out(granularity, PAGE as usize) }
}

/// The handle mapped at `addr` (the same value `cuMemCreate` gave), with one
/// more reference for the caller to release.
#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut Handle,
    addr: *mut c_void,
) -> CUresult {
    refuse_after_fork!();
    if handle.is_null() {
        return INVALID_VALUE;
    }
    let addr = addr as u64;
    let mut vmm = vmm();
    let mapped = vmm
        .mapped
        .range(..=addr)
        .next_back()
        .filter(|&(&start, &(len, _))| addr < start + len)
        .map(|(_, &(_, h))| h);
    match mapped.and_then(|h| vmm.retain(h)) {
        // SAFETY: `handle` is the caller's out-parameter: null, which `out` refuses, or valid for
        // writes, as the driver API requires.
        Some(h) => unsafe { out(handle, h) },
        None => INVALID_VALUE,
    }
}

/// Writes an `int` token standing for a file descriptor; only this
/// process's `cuMemImportFromShareableHandle` understands it.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: Handle,
    kind: c_int,
    _flags: c_ulonglong,
) -> CUresult {
    refuse_after_fork!();
    if kind != POSIX_FD {
        return NOT_SUPPORTED;
    }
    let mut vmm = vmm();
    let requested = vmm
        .handles
        .get(&handle)
        .is_some_and(|p| p.handle_types & POSIX_FD != 0);
    if shareable.is_null() || !requested {
        return INVALID_VALUE;
    }
    let token = vmm.next_token;
    vmm.next_token += 1;
    vmm.exported.insert(token, handle);
    // SAFETY: for a POSIX file descriptor handle (the only type exported here) `shareable` points
    // to an `int`, valid for writes under `cuMemExportToShareableHandle`'s contract, and not null
    // (checked above).
    unsafe { out(shareable.cast::<c_int>(), token) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut Handle,
    os_handle: *mut c_void,
    kind: c_int,
) -> CUresult {
    refuse_after_fork!();
    if kind != POSIX_FD {
        return NOT_SUPPORTED;
    }
    if handle.is_null() {
        return INVALID_VALUE;
    }
    let mut vmm = vmm();
    let exported = vmm.exported.get(&(os_handle as usize as c_int)).copied();
    match exported.and_then(|h| vmm.retain(h)) {
        // SAFETY: `handle` is the caller's out-parameter, valid for writes under the driver API's
        // contract, and not null (checked above).
        Some(h) => unsafe { out(handle, h) },
        None => INVALID_VALUE,
    }
}
