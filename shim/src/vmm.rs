//! Virtual memory management: physical memory made by `cuMemCreate` lives
//! while any handle reference or any mapping of it does. `cuMemRelease` of a
//! mapped handle frees nothing until the last `cuMemUnmap` (the CUDA guide's
//! create-map-release pattern; seen on an H100, docs/GPU_VERIFICATION.md), so the charge follows the
//! memory, not the handle. Handles imported from another process are that
//! process's memory and never charged here.

#![allow(non_snake_case)]

use std::collections::BTreeMap;
use std::ffi::{c_int, c_ulonglong, c_void};
use std::sync::{Mutex, MutexGuard};

use crate::cuda::{
    refused, written, CUdeviceptr, CUmemAllocationProp, CUmemGenericAllocationHandle, CUresult,
    Placed, CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS,
};
use crate::devices;
use crate::hook::{answered, guarded, real};
use crate::ops;

/// One `cuMemCreate` allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Physical {
    dev: usize,
    bytes: u64,
    /// Handle references: the creation, retains and imports, less releases.
    refs: u32,
    mappings: u32,
}

impl Physical {
    fn gone(&self) -> bool {
        self.refs == 0 && self.mappings == 0
    }
}

#[derive(Default)]
struct Vmm {
    handles: BTreeMap<u64, Physical>,
    /// Mapped ranges by start address: (length, handle).
    mappings: BTreeMap<u64, (u64, u64)>,
}

static VMM: Mutex<Vmm> = Mutex::new(Vmm {
    handles: BTreeMap::new(),
    mappings: BTreeMap::new(),
});

fn vmm() -> MutexGuard<'static, Vmm> {
    crate::fork::lock(&VMM)
}

/// Gives back memory that is gone from the device.
fn uncharge(physical: &Physical) {
    if let Some(shim) = ops::shim() {
        shim.uncharge(physical.dev, physical.bytes);
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: c_ulonglong,
) -> CUresult {
    real!(let call = cuMemCreate(handle, size, prop, flags) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        // Host and host-NUMA locations (NCCL, ggml) are not device memory.
        let place = match CUmemAllocationProp::read(prop) {
            Some((_, Placed::Device(ordinal))) => devices::at(ordinal),
            Some((_, Placed::Elsewhere)) => devices::current().map(|site| (site.shim, site.dev)),
            // No location: the driver refuses it.
            Some((_, Placed::Host | Placed::Unset)) | None => None,
        };
        let Some((shim, dev)) = place else {
            return call();
        };
        // Sizes are granularity multiples already: the charge is exact.
        let bytes = size as u64;
        if let Err(refusal) = shim.charge(dev, bytes) {
            return refused(refusal);
        }
        let result = call();
        match (result, written(handle)) {
            (CUDA_SUCCESS, Some(made)) => {
                let physical = Physical {
                    dev,
                    bytes,
                    refs: 1,
                    mappings: 0,
                };
                vmm().handles.insert(made, physical);
            }
            _ => shim.uncharge(dev, bytes),
        }
        result
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult {
    real!(let call = cuMemRelease(handle) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        let mut table = vmm();
        let Some(physical) = table.handles.get_mut(&handle) else {
            // Not ours (imported, or made before the shim saw it).
            drop(table);
            return call();
        };
        if physical.refs > 1 || physical.mappings > 0 {
            // Nothing is freed: the memory stays, and so does its charge.
            let result = call();
            if result == CUDA_SUCCESS {
                physical.refs = physical.refs.saturating_sub(1);
            }
            return result;
        }
        // The last reference of unmapped memory: forget it before the
        // driver can hand the handle out again.
        let Some(last) = table.handles.remove(&handle) else {
            return call();
        };
        drop(table);
        let result = call();
        if result == CUDA_SUCCESS {
            uncharge(&last);
        } else {
            vmm().handles.insert(handle, last);
        }
        result
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: c_ulonglong,
) -> CUresult {
    real!(let call = cuMemMap(ptr, size, offset, handle, flags) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        let result = call();
        if result == CUDA_SUCCESS {
            let mut table = vmm();
            if let Some(physical) = table.handles.get_mut(&handle) {
                physical.mappings += 1;
                table.mappings.insert(ptr, (size as u64, handle));
            }
        }
        result
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    real!(let call = cuMemUnmap(ptr, size) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        // One range may cover several whole mappings; a range that cuts one
        // is refused by the driver and changes nothing.
        let end = ptr.saturating_add(size as u64);
        let mut table = vmm();
        let unmapped: Vec<(u64, (u64, u64))> = table
            .mappings
            .range(ptr..end)
            .map(|(&at, &mapping)| (at, mapping))
            .collect();
        if unmapped.is_empty() {
            drop(table);
            return call();
        }
        for (at, _) in &unmapped {
            table.mappings.remove(at);
        }
        // Memory whose last mapping goes, with no reference left, goes
        // with it: forget it before the driver can reuse the handle.
        let mut freed = Vec::new();
        for (_, (_, handle)) in &unmapped {
            if let Some(physical) = table.handles.get_mut(handle) {
                physical.mappings = physical.mappings.saturating_sub(1);
                if physical.gone() {
                    freed.extend(table.handles.remove(handle).map(|p| (*handle, p)));
                }
            }
        }
        drop(table);
        let result = call();
        if result == CUDA_SUCCESS {
            for (_, physical) in &freed {
                uncharge(physical);
            }
            return result;
        }
        let mut table = vmm();
        for (handle, physical) in freed {
            table.handles.insert(handle, physical);
        }
        for (at, (length, handle)) in unmapped {
            if let Some(physical) = table.handles.get_mut(&handle) {
                physical.mappings += 1;
            }
            table.mappings.insert(at, (length, handle));
        }
        result
    })
}

/// A new reference to memory we track (the driver returns the same handle
/// value, as seen on the H100): its release must not free the charge.
fn referenced(handle: *mut CUmemGenericAllocationHandle) {
    let Some(handle) = written(handle) else {
        return;
    };
    if let Some(physical) = vmm().handles.get_mut(&handle) {
        physical.refs += 1;
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(
    handle: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> CUresult {
    real!(let call = cuMemRetainAllocationHandle(handle, addr) else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || referenced(handle))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut CUmemGenericAllocationHandle,
    os_handle: *mut c_void,
    kind: c_int,
) -> CUresult {
    real!(let call = cuMemImportFromShareableHandle(handle, os_handle, kind)
        else CUDA_ERROR_NOT_INITIALIZED);
    // Another process's memory is not ours to charge; our own, imported
    // back, is one more reference to it.
    answered(call, CUDA_SUCCESS, || referenced(handle))
}
