//! CUDA arrays (textures, surfaces) take device memory outside the
//! allocation calls. The driver cannot say how much for an ordinary array
//! (`cuArrayGetMemoryRequirements` answers only for deferred-mapping ones),
//! so the charge is the array's size as the driver lays it out, which
//! matches what an H100 took for every shape measured (docs/GPU_VERIFICATION.md).

#![allow(non_snake_case)]

use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Mutex, MutexGuard};

use crate::cuda::{refused, written, CUresult, CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS};
use crate::devices::{self, Site};
use crate::hook::{guarded, real};
use crate::ops::{self, Shim};
use crate::track::CHUNK;

pub type CUarray = *mut c_void;
pub type CUmipmappedArray = *mut c_void;

#[repr(C)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub format: c_int,
    pub channels: c_uint,
}

#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: c_int,
    pub channels: c_uint,
    pub flags: c_uint,
}

const LAYERED: c_uint = 0x01;
const CUBEMAP: c_uint = 0x04;
/// Arrays without backing of their own: a sparse array's tiles, and a
/// deferred-mapping array's memory, are mapped in from `cuMemCreate`
/// handles (`cuMemMapArrayAsync`), which are charged already.
const SPARSE: c_uint = 0x40;
const DEFERRED_MAPPING: c_uint = 0x80;

/// Bytes per element of one channel (cuda.h `CUarray_format`).
fn element_bytes(format: c_int) -> u64 {
    match format {
        0x01 | 0x08 | 0xc0 | 0xc6 => 1, // 8-bit, UNORM/SNORM_INT8X1
        0x02 | 0x09 | 0x10 | 0xc1 | 0xc3 | 0xc7 | 0xc9 => 2, // 16-bit, half, 8X2, 16X1
        0x03 | 0x0a | 0x20 | 0xc2 | 0xc4 | 0xc8 | 0xca => 4, // 32-bit, float, 8X4, 16X2
        0xc5 | 0xcb => 8,               // UNORM/SNORM_INT16X4
        _ => 4,
    }
}

/// The bytes of one level: rows padded to 64 bytes, heights above one to
/// 8 rows, the depth of a plain 3D array to a power of two (to a multiple
/// of 32 from 32 on); layers and cube faces are exact.
fn level_bytes(width: u64, height: u64, depth: u64, element: u64, flags: c_uint) -> u64 {
    let row = width.max(1).saturating_mul(element).next_multiple_of(64);
    let rows = match height {
        0 | 1 => 1,
        h => h.next_multiple_of(8),
    };
    let depth = match depth {
        0 | 1 => 1,
        d if flags & (LAYERED | CUBEMAP) != 0 => d,
        d if d < 32 => d.next_power_of_two(),
        d => d.next_multiple_of(32),
    };
    row.saturating_mul(rows).saturating_mul(depth)
}

/// Device memory an array (or a mipmapped array of `levels` levels) takes,
/// in whole 2 MiB chunks.
pub fn array_bytes(desc: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> u64 {
    if desc.flags & (SPARSE | DEFERRED_MAPPING) != 0 {
        return 0;
    }
    let element = element_bytes(desc.format).saturating_mul(u64::from(desc.channels.max(1)));
    let layered = desc.flags & (LAYERED | CUBEMAP) != 0;
    let (mut w, mut h, mut d) = (desc.width as u64, desc.height as u64, desc.depth as u64);
    // The driver clamps the level count to [1, 1 + floor(log2(largest
    // dimension))]: past that every level would be 1×1×1.
    let largest = w.max(h).max(if layered { 0 } else { d }).max(1);
    let levels = levels.clamp(1, 1 + largest.ilog2());
    let mut total = 0u64;
    for _ in 0..levels {
        total = total.saturating_add(level_bytes(w, h, d, element, desc.flags));
        w = (w / 2).max(1);
        h = if h > 1 { h / 2 } else { h };
        if !layered && d > 1 {
            d /= 2;
        }
    }
    total.div_ceil(CHUNK).saturating_mul(CHUNK)
}

/// One live array: its device, context and charge.
#[derive(Debug, Clone, Copy)]
struct Held {
    dev: usize,
    ctx: usize,
    bytes: u64,
}

static ARRAYS: Mutex<BTreeMap<usize, Held>> = Mutex::new(BTreeMap::new());

fn arrays() -> MutexGuard<'static, BTreeMap<usize, Held>> {
    crate::fork::lock(&ARRAYS)
}

/// Charges `bytes` on the current device, creates, and remembers the array.
fn create(
    bytes: u64,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<usize>,
) -> CUresult {
    let Some(Site { shim, dev, ctx }) = devices::current() else {
        return call();
    };
    if let Err(refusal) = shim.charge(dev, bytes) {
        return refused(refusal);
    }
    let result = call();
    match (result, made()) {
        (CUDA_SUCCESS, Some(array)) => {
            // A record under the same handle is of an array the driver
            // destroyed unseen, with its context: what it held goes back.
            if let Some(stale) = arrays().insert(array, Held { dev, ctx, bytes }) {
                shim.uncharge(stale.dev, stale.bytes);
            }
        }
        _ => shim.uncharge(dev, bytes),
    }
    result
}

/// Destroys an array: forget it first (its handle may be reused at once),
/// give back its memory once the driver did.
fn destroy(array: usize, call: impl FnOnce() -> CUresult) -> CUresult {
    let held = arrays().remove(&array);
    let result = call();
    match (result, held) {
        (CUDA_SUCCESS, Some(held)) => {
            if let Some(shim) = ops::shim() {
                shim.uncharge(held.dev, held.bytes);
            }
        }
        (_, Some(held)) => {
            arrays().insert(array, held);
        }
        _ => {}
    }
    result
}

/// Gives back what a destroyed context's arrays held.
pub fn drop_arrays(shim: &Shim, ctx: usize) {
    let mut arrays = arrays();
    arrays.retain(|_, held| {
        if held.ctx == ctx {
            shim.uncharge(held.dev, held.bytes);
        }
        held.ctx != ctx
    });
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuArrayCreate_v2(
    array: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    real!(let call = cuArrayCreate_v2(array, desc) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        if desc.is_null() {
            return call();
        }
        // SAFETY: the caller's descriptor, null checked.
        let d = unsafe { &*desc };
        let as_3d = CUDA_ARRAY3D_DESCRIPTOR {
            width: d.width,
            height: d.height,
            depth: 0,
            format: d.format,
            channels: d.channels,
            flags: 0,
        };
        create(array_bytes(&as_3d, 1), call, || {
            written(array).map(|a| a as usize)
        })
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    array: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    real!(let call = cuArray3DCreate_v2(array, desc) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        if desc.is_null() {
            return call();
        }
        // SAFETY: the caller's descriptor, null checked.
        let bytes = array_bytes(unsafe { &*desc }, 1);
        create(bytes, call, || written(array).map(|a| a as usize))
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    array: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: c_uint,
) -> CUresult {
    real!(let call = cuMipmappedArrayCreate(array, desc, levels) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        if desc.is_null() {
            return call();
        }
        // SAFETY: the caller's descriptor, null checked.
        let bytes = array_bytes(unsafe { &*desc }, levels);
        create(bytes, call, || written(array).map(|a| a as usize))
    })
}

macro_rules! destroy_hook {
    ($name:ident) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(array: *mut c_void) -> CUresult {
            real!(let call = $name(array) else CUDA_ERROR_NOT_INITIALIZED);
            guarded(call, |call| destroy(array as usize, call))
        }
    };
}
destroy_hook!(cuArrayDestroy);
destroy_hook!(cuMipmappedArrayDestroy);

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn desc(
        width: usize,
        height: usize,
        depth: usize,
        format: c_int,
        channels: c_uint,
        flags: c_uint,
    ) -> CUDA_ARRAY3D_DESCRIPTOR {
        CUDA_ARRAY3D_DESCRIPTOR {
            width,
            height,
            depth,
            format,
            channels,
            flags,
        }
    }

    /// Levels past a 1×1 level are clamped away, as the driver does: a
    /// count of 2³² - 1 costs what the full chain does, at once.
    #[test]
    fn mipmap_levels_are_clamped_to_the_chain() {
        const FLOAT: c_int = 0x20;
        let chain = array_bytes(&desc(4096, 4096, 0, FLOAT, 4, 0), 13);
        assert_eq!(
            array_bytes(&desc(4096, 4096, 0, FLOAT, 4, 0), u32::MAX),
            chain
        );
        assert_eq!(array_bytes(&desc(1, 1, 0, 0x01, 1, 0), u32::MAX), 2 * MIB);
        assert_eq!(array_bytes(&desc(1, 1, 0, 0x01, 1, 0), 0), 2 * MIB);
    }

    /// Sparse and deferred-mapping arrays have no memory of their own:
    /// what is mapped into them is `cuMemCreate` memory, charged there.
    #[test]
    fn arrays_without_backing_take_nothing() {
        const FLOAT: c_int = 0x20;
        for flags in [SPARSE, DEFERRED_MAPPING, SPARSE | LAYERED] {
            assert_eq!(array_bytes(&desc(8192, 8192, 4, FLOAT, 4, flags), 1), 0);
        }
    }

    /// Free-memory drops measured on the H100 (driver 580) for each shape.
    #[test]
    fn sizes_match_what_the_h100_took() {
        const FLOAT: c_int = 0x20;
        let cases = [
            (desc(1024, 1024, 0, FLOAT, 4, 0), 1, 16),
            (desc(8192, 8192, 0, FLOAT, 4, 0), 1, 1024),
            (desc(1000, 1000, 0, 0x01, 1, 0), 1, 2),
            (desc(100, 1, 0, 0x01, 1, 0), 1, 2),
            (desc(3000, 7, 0, 0x10, 2, 0), 1, 2),
            (desc(256, 256, 256, FLOAT, 1, 0), 1, 64),
            (desc(1024, 1024, 6, FLOAT, 1, 2), 1, 32),
            (desc(512, 512, 4, FLOAT, 1, LAYERED), 1, 4),
            (desc(4096, 4096, 0, FLOAT, 4, 0), 13, 342),
        ];
        for (d, levels, mib) in cases {
            assert_eq!(
                array_bytes(&d, levels),
                mib * MIB,
                "{}x{}x{} format {:#x}×{} flags {} levels {levels}",
                d.width,
                d.height,
                d.depth,
                d.format,
                d.channels,
                d.flags
            );
        }
    }
}
