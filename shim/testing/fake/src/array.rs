//! CUDA arrays (plain, 3D, layered, cubemap, mipmapped): device memory by
//! `bytes`, made in and swept with the current context.

use std::ffi::{c_int, c_uint, c_void};

use crate::memory::{self, Kind};
use crate::{context, out, CUresult, INVALID_VALUE, PAGE};

const LAYERED: c_uint = 0x01;
const CUBEMAP: c_uint = 0x04;

#[repr(C)]
pub struct CUDA_ARRAY_DESCRIPTOR {
    width: usize,
    height: usize,
    format: c_int,
    channels: c_uint,
}

#[repr(C)]
pub struct CUDA_ARRAY3D_DESCRIPTOR {
    width: usize,
    height: usize,
    depth: usize,
    format: c_int,
    channels: c_uint,
    flags: c_uint,
}

/// What an array takes on the device, by the model fitted to an H100
/// (driver 580): 1024×1024 FLOAT×4 = 16 MiB, 8192² FLOAT×4 = 1024 MiB,
/// 1000² UINT8 = 2 MiB, 100×1 UINT8 = 2 MiB, 3D 256³ FLOAT = 64 MiB,
/// 3D 1024×1024×6 FLOAT (SURFACE_LDST) = 32 MiB (depth padded to 8),
/// LAYERED 512×512×4 FLOAT = 4 MiB, mipmapped 4096² FLOAT×4 with 13 levels
/// = 342 MiB. Rows are padded to 64 bytes, heights above 1 to 8 rows, plain
/// 3D depths to a power of two below 32 and to 32s from there (layers and
/// cubemap faces are exact), levels halve every dimension but the layers,
/// and the whole array takes 2 MiB pages.
pub(crate) fn bytes(desc: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> u64 {
    let element: u64 = match desc.format {
        0x01 | 0x08 => 1,
        0x02 | 0x09 | 0x10 => 2,
        _ => 4,
    } * u64::from(desc.channels);
    let plain_3d = desc.flags & (LAYERED | CUBEMAP) == 0;
    let (mut width, mut height, mut depth) = (
        desc.width as u64,
        (desc.height as u64).max(1),
        (desc.depth as u64).max(1),
    );
    // Clamped as the driver does: past a 1×1×1 level there are none.
    let largest = width.max(height).max(if plain_3d { depth } else { 1 });
    let levels = levels.clamp(1, 1 + largest.max(1).ilog2());
    let mut total = 0;
    for _ in 0..levels {
        let rows = if height > 1 {
            height.next_multiple_of(8)
        } else {
            1
        };
        let slices = match depth {
            d if !plain_3d => d,
            d if d < 32 => d.next_power_of_two(),
            d => d.next_multiple_of(32),
        };
        total += (width * element).next_multiple_of(64) * rows * slices;
        width = (width / 2).max(1);
        height = (height / 2).max(1);
        if plain_3d {
            depth = (depth / 2).max(1);
        }
    }
    total.next_multiple_of(PAGE)
}

fn create(
    handle: *mut *mut c_void,
    desc: &CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
    kind: Kind,
) -> CUresult {
    refuse_after_fork!();
    let ctx = match context::current() {
        Ok(ctx) => ctx,
        Err(code) => return code,
    };
    if handle.is_null() || desc.width == 0 || desc.channels == 0 || levels == 0 {
        return INVALID_VALUE;
    }
    match memory::allocate(
        kind,
        ctx.0.dev,
        ctx,
        bytes(desc, levels),
        memory::Owned::ByContext,
    ) {
        // SAFETY: `handle` is the caller's out-parameter, valid for writes under the driver API's
        // contract, and not null (checked above).
        Ok(address) => unsafe { out(handle, address as *mut c_void) },
        Err(code) => code,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuArrayCreate_v2(
    handle: *mut *mut c_void,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> CUresult {
    // SAFETY: the caller's descriptor: null (refused below) or valid for reads, as `cuArrayCreate`
    // requires.
    let Some(desc) = (unsafe { desc.as_ref() }) else {
        return INVALID_VALUE;
    };
    let desc = CUDA_ARRAY3D_DESCRIPTOR {
        width: desc.width,
        height: desc.height,
        depth: 0,
        format: desc.format,
        channels: desc.channels,
        flags: 0,
    };
    create(handle, &desc, 1, Kind::Array)
}

#[no_mangle]
pub unsafe extern "C" fn cuArray3DCreate_v2(
    handle: *mut *mut c_void,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> CUresult {
    // SAFETY: the caller's descriptor: null (refused below) or valid for reads, as
    // `cuArray3DCreate` requires.
    match unsafe { desc.as_ref() } {
        Some(desc) => create(handle, desc, 1, Kind::Array),
        None => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMipmappedArrayCreate(
    handle: *mut *mut c_void,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: c_uint,
) -> CUresult {
    // SAFETY: the caller's descriptor: null (refused below) or valid for reads, as
    // `cuMipmappedArrayCreate` requires.
    match unsafe { desc.as_ref() } {
        Some(desc) => create(handle, desc, levels, Kind::Mipmap),
        None => INVALID_VALUE,
    }
}

#[no_mangle]
pub extern "C" fn cuArrayDestroy(handle: *mut c_void) -> CUresult {
    refuse_after_fork!();
    memory::release(handle as u64, Kind::Array)
}

#[no_mangle]
pub extern "C" fn cuMipmappedArrayDestroy(handle: *mut c_void) -> CUresult {
    refuse_after_fork!();
    memory::release(handle as u64, Kind::Mipmap)
}
