//! Contexts: a CUDA context takes device memory the moment it is made
//! (518 MiB on an H100, docs/GPU_VERIFICATION.md), before any allocation. The shim charges each new
//! context what the driver took for it, read from NVML's figure for this
//! very process just before and after the real call, so other processes'
//! activity meanwhile cannot skew it; and gives it back, with the
//! allocations and arrays that die with it, when the context is destroyed.
//! Where NVML cannot answer, the plugin's per-GPU hint is charged instead.

#![allow(non_snake_case)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Mutex, MutexGuard};

use crate::cuda::{
    refused, written, CUcontext, CUdevice, CUresult, CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS,
};
use crate::dlsym::LIBCUDA;
use crate::hook::{as_fn, guarded, real, Real};
use crate::ops::Shim;
use crate::table::Hooked;
use crate::{array, cuda, devices, log, nvml};

/// A context this process made on a capped device, and what it was charged.
#[derive(Debug, Clone, Copy)]
struct Made {
    handle: usize,
    ordinal: CUdevice,
    dev: usize,
    bytes: u64,
    primary: bool,
}

static MADE: Mutex<Vec<Made>> = Mutex::new(Vec::new());

/// One context creation at a time per process: two measured at once would
/// each see the other's memory.
static CREATING: Mutex<()> = Mutex::new(());

fn made() -> MutexGuard<'static, Vec<Made>> {
    crate::fork::lock(&MADE)
}

type PrimaryGetStateFn = unsafe extern "C" fn(CUdevice, *mut c_uint, *mut c_int) -> CUresult;

/// The driver's `cuDevicePrimaryCtxGetState`, looked up once.
fn get_state() -> usize {
    static GET_STATE: Real = Real::new();
    LIBCUDA.cached(&GET_STATE, c"cuDevicePrimaryCtxGetState")
}

/// Looks up, before `CREATING` is taken, what is asked under it: a lookup
/// takes the dynamic loader's lock, which a thread inside `dlopen` (a
/// library constructor that makes a context) holds while it waits for
/// `CREATING`.
fn prepare() {
    get_state();
    nvml::prepare();
    // What undoing a refused context calls.
    Hooked::cuDevicePrimaryCtxRelease_v2.address();
    Hooked::cuCtxDestroy_v2.address();
}

/// Whether the device's primary context exists; `None` if the driver
/// cannot say.
fn primary_active(ordinal: CUdevice) -> Option<bool> {
    let address = get_state();
    if address == 0 {
        return None;
    }
    let (mut flags, mut active) = (0, 0);
    // SAFETY: cuDevicePrimaryCtxGetState(CUdevice, unsigned*, int*).
    let result = unsafe { as_fn::<PrimaryGetStateFn>(address)(ordinal, &mut flags, &mut active) };
    (result == CUDA_SUCCESS).then_some(active != 0)
}

/// Makes a context with `call`, charging what it took. A context that does
/// not fit under the cap is destroyed with `undo` and refused, as the
/// driver itself would refuse one on a full GPU.
fn create(
    shim: &Shim,
    dev: usize,
    ordinal: CUdevice,
    primary: bool,
    call: impl FnOnce() -> CUresult,
    handle: impl FnOnce() -> Option<usize>,
    undo: impl FnOnce() -> CUresult,
) -> CUresult {
    prepare();
    let _one_at_a_time = crate::fork::lock(&CREATING);
    // A slot from the first context on, even with nothing charged: its
    // record lock is how the node daemon finds this process in NVML.
    shim.claim_slot(dev);
    if primary && primary_active(ordinal) == Some(true) {
        // Retaining a live primary context takes no memory.
        return call();
    }
    let uuid = shim.uuid(dev);
    // Refuse up front if even the plugin's estimate does not fit.
    let hint = shim.context_hint(dev);
    if let Err(refusal) = shim.charge(dev, hint) {
        return refused(refusal);
    }
    // Until it is charged what it took.
    let _making = shim.making_context(dev);
    let before = nvml::own_usage(&uuid);
    let charged_before = shim.own_charges(dev);
    let result = call();
    if result != CUDA_SUCCESS {
        shim.uncharge(dev, hint);
        return result;
    }
    let after = nvml::own_usage(&uuid);
    // This process's other threads may have allocated or freed meanwhile
    // (on other contexts of the device): that is in their charges already.
    // Signed: a free makes both differences negative.
    let meanwhile = i128::from(shim.own_charges(dev)) - i128::from(charged_before);
    let measured = match (before, after) {
        (Some(before), Some(after)) if after > 0 => {
            let took = i128::from(after) - i128::from(before) - meanwhile;
            Some(u64::try_from(took.max(0)).unwrap_or(u64::MAX))
        }
        _ => None,
    };
    let bytes = measured.unwrap_or(hint);
    log::debug(|| {
        format!(
            "context on device {ordinal}: {} MiB ({})",
            bytes >> 20,
            if measured.is_some() {
                "measured"
            } else {
                "plugin's estimate: NVML did not answer for this process"
            }
        )
    });
    if let Err(refusal) = shim.settle(dev, hint, bytes) {
        shim.uncharge(dev, hint);
        undo();
        return refused(refusal);
    }
    if let Some(handle) = handle() {
        made().push(Made {
            handle,
            ordinal,
            dev,
            bytes,
            primary,
        });
    }
    result
}

/// Context `handle` is gone: give back its own memory if this process made
/// and charged it, and what died with it in any case.
fn destroyed(shim: &Shim, handle: usize, made: Option<Made>) {
    if let Some(made) = made {
        shim.uncharge(made.dev, made.bytes);
    }
    cuda::drop_allocations(shim, handle);
    array::drop_arrays(shim, handle);
    devices::forget_context(handle);
}

/// Releases the primary context just retained (undoing a refused one).
fn release_primary(ordinal: CUdevice) -> CUresult {
    real!(let call = cuDevicePrimaryCtxRelease_v2(ordinal) else CUDA_ERROR_NOT_INITIALIZED);
    call()
}

/// Destroys a context just created (undoing a refused one).
fn destroy_now(ctx: CUcontext) -> CUresult {
    real!(let call = cuCtxDestroy_v2(ctx) else CUDA_ERROR_NOT_INITIALIZED);
    call()
}

/// A context creation on `ordinal`, measured when the device is capped.
fn creation(
    ordinal: CUdevice,
    primary: bool,
    pctx: *mut CUcontext,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some((shim, dev)) = devices::at(ordinal) else {
        return call();
    };
    let handle = || written(pctx).map(|c| c as usize);
    if primary {
        create(shim, dev, ordinal, true, call, handle, || {
            let result = release_primary(ordinal);
            cuda::cleared(pctx, std::ptr::null_mut());
            result
        })
    } else {
        create(shim, dev, ordinal, false, call, handle, || {
            let made = written(pctx).filter(|ctx| !ctx.is_null());
            let result = made.map_or(CUDA_SUCCESS, destroy_now);
            cuda::cleared(pctx, std::ptr::null_mut());
            result
        })
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    real!(let call = cuDevicePrimaryCtxRetain(pctx, dev) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| creation(dev, true, pctx, call))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    real!(let call = cuCtxCreate_v2(pctx, flags, dev) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| creation(dev, false, pctx, call))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    params: *mut c_void,
    num_params: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    real!(let call = cuCtxCreate_v3(pctx, params, num_params, flags, dev)
        else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| creation(dev, false, pctx, call))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    params: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    real!(let call = cuCtxCreate_v4(pctx, params, flags, dev) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| creation(dev, false, pctx, call))
}

/// After a primary context release or reset: if the device's primary
/// context is gone, so is what it held.
fn primary_gone(ordinal: CUdevice) {
    if primary_active(ordinal) != Some(false) {
        return;
    }
    let Some((shim, _)) = devices::at(ordinal) else {
        return;
    };
    let gone: Vec<Made> = {
        let mut made = made();
        let gone = made
            .iter()
            .filter(|c| c.primary && c.ordinal == ordinal)
            .copied()
            .collect();
        made.retain(|c| !(c.primary && c.ordinal == ordinal));
        gone
    };
    for context in gone {
        destroyed(shim, context.handle, Some(context));
    }
}

/// Runs `call`, an end of a context, and `gone` after it succeeded, with
/// creations held off: a retain that found the primary context live must
/// not see it destroyed before its own call (it would make a new one
/// uncharged), and a context made in between could get the handle of the
/// one gone and be taken for it.
fn ending(call: &dyn Fn() -> CUresult, gone: impl FnOnce()) -> CUresult {
    // What `gone` looks up, before the lock (see `prepare`).
    get_state();
    let _no_creations = crate::fork::lock(&CREATING);
    let result = call();
    if result == CUDA_SUCCESS {
        gone();
    }
    result
}

macro_rules! primary_end {
    ($name:ident) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(dev: CUdevice) -> CUresult {
            real!(let call = $name(dev) else CUDA_ERROR_NOT_INITIALIZED);
            guarded(call, |call| {
                // Looked up before the lock (see `prepare`).
                devices::at(dev);
                ending(call, || primary_gone(dev))
            })
        }
    };
}
primary_end!(cuDevicePrimaryCtxRelease_v2);
primary_end!(cuDevicePrimaryCtxReset_v2);

/// After the driver destroyed `ctx`: forget it, and give back what it held.
fn context_gone(ctx: CUcontext) {
    let gone = {
        let mut made = made();
        let at = made.iter().position(|c| c.handle == ctx as usize);
        at.map(|i| made.remove(i))
    };
    if let Some(shim) = crate::ops::cuda_shim() {
        destroyed(shim, ctx as usize, gone);
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    real!(let call = cuCtxDestroy_v2(ctx) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| ending(call, || context_gone(ctx)))
}
