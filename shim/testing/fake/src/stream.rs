//! Streams: each belongs to the context current when it was made, and dies
//! with that context's spell; stream-ordered memory asked for on one comes
//! from its device, whatever context is current.

use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::context::{self, Context};
use crate::{
    out, CUcontext, CUdevice, CUresult, INVALID_HANDLE, INVALID_VALUE, NOT_FOUND, SUCCESS,
};

type CUstream = *mut c_void;

/// Null, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`: the current
/// context's default streams.
const LAST_DEFAULT_STREAM: usize = 0x2;

struct Streams {
    /// Live streams by handle: their context and its serial when made.
    live: HashMap<usize, (&'static Context, u64)>,
    next: usize,
}

fn streams() -> MutexGuard<'static, Streams> {
    static STREAMS: OnceLock<Mutex<Streams>> = OnceLock::new();
    STREAMS
        .get_or_init(|| {
            Mutex::new(Streams {
                live: HashMap::new(),
                next: 0x5700_0000,
            })
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The live context `stream` belongs to, with its serial.
pub(crate) fn context_of(stream: CUstream) -> Result<(&'static Context, u64), CUresult> {
    if stream as usize <= LAST_DEFAULT_STREAM {
        return context::current();
    }
    match streams().live.get(&(stream as usize)) {
        Some(&(ctx, serial)) if ctx.serial() == serial => Ok((ctx, serial)),
        _ => Err(INVALID_HANDLE),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut CUstream, _flags: c_uint) -> CUresult {
    refuse_after_fork!();
    let (ctx, serial) = match context::current() {
        Ok(current) => current,
        Err(code) => return code,
    };
    if stream.is_null() {
        return INVALID_VALUE;
    }
    let mut streams = streams();
    let handle = streams.next;
    streams.next += 0x10;
    streams.live.insert(handle, (ctx, serial));
    // SAFETY: `stream` is the caller's out-parameter, valid for writes under the driver API's
    // contract, and not null (checked above).
    unsafe { out(stream, handle as CUstream) }
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    refuse_after_fork!();
    match streams().live.remove(&(stream as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_HANDLE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamGetCtx(stream: CUstream, pctx: *mut CUcontext) -> CUresult {
    refuse_after_fork!();
    match context_of(stream) {
        // SAFETY: `pctx` is the caller's out-parameter: null, which `out` refuses, or valid for
        // writes, as the driver API requires.
        Ok((ctx, _)) => unsafe { out(pctx, ctx.handle()) },
        Err(code) => code,
    }
}

/// Drivers before CUDA 12.8 have no `cuStreamGetDevice`; with
/// `FAKEGPU_NO_STREAM_GET_DEVICE` set, this one answers as if it were not
/// there.
#[no_mangle]
pub unsafe extern "C" fn cuStreamGetDevice(stream: CUstream, dev: *mut CUdevice) -> CUresult {
    refuse_after_fork!();
    if crate::config().no_stream_get_device {
        return NOT_FOUND;
    }
    match context_of(stream) {
        // SAFETY: `dev` is the caller's out-parameter: null, which `out` refuses, or valid for
        // writes, as the driver API requires.
        Ok((ctx, _)) => unsafe { out(dev, ctx.dev as CUdevice) },
        Err(code) => code,
    }
}
