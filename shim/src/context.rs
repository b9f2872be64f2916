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
use crate::ops::{Refusal, Shim};
use crate::table::Hooked;
use crate::{array, cuda, devices, log, nvml};

/// A context this process made on a capped device, and what it was charged.
#[derive(Debug, Clone, Copy)]
struct Made {
    handle: usize,
    ordinal: CUdevice,
    dev: usize,
    /// What making it took.
    bytes: u64,
    /// What its limits took since (`cuCtxSetLimit`): all a shrink may give
    /// back, since the driver also grows them by itself, uncharged.
    limits: u64,
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

/// What the driver took for this process on `dev` since NVML said
/// `before` and its charges were `charged_before`, beyond what it charged
/// meanwhile; `None` where NVML cannot answer or does not list it.
fn took_since(
    shim: &Shim,
    dev: usize,
    uuid: &[u8; 16],
    before: Option<u64>,
    charged_before: u64,
) -> Option<i128> {
    let after = nvml::own_usage(uuid).filter(|&after| after > 0)?;
    // This process's other threads may have allocated or freed meanwhile
    // (on other contexts of the device): that is in their charges already.
    // Signed: a free makes both differences negative.
    let meanwhile = i128::from(shim.own_charges(dev)) - i128::from(charged_before);
    Some(i128::from(after) - i128::from(before?) - meanwhile)
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
    let measured = took_since(shim, dev, &uuid, before, charged_before)
        .map(|took| u64::try_from(took.max(0)).unwrap_or(u64::MAX));
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
            limits: 0,
            primary,
        });
    }
    result
}

/// Context `handle` is gone: give back its own memory if this process made
/// and charged it, and what died with it in any case.
fn destroyed(shim: &Shim, handle: usize, made: Option<Made>) {
    if let Some(made) = made {
        shim.uncharge(made.dev, made.bytes.saturating_add(made.limits));
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

type CtxGetLimitFn = unsafe extern "C" fn(*mut usize, c_int) -> CUresult;

/// The driver's `cuCtxGetLimit`, looked up once.
fn get_limit() -> usize {
    static GET_LIMIT: Real = Real::new();
    LIBCUDA.cached(&GET_LIMIT, c"cuCtxGetLimit")
}

/// The current context's `limit`, if the driver says.
fn limit_now(limit: c_int) -> Option<usize> {
    let address = get_limit();
    let mut value = 0;
    // SAFETY: cuCtxGetLimit(size_t*, CUlimit) from the loaded driver.
    (address != 0 && unsafe { as_fn::<CtxGetLimitFn>(address)(&mut value, limit) } == CUDA_SUCCESS)
        .then_some(value)
}

/// Sets `limit` back to `value` (undoing a refused change).
fn set_limit_now(limit: c_int, value: usize) -> CUresult {
    real!(let call = cuCtxSetLimit(limit, value) else CUDA_ERROR_NOT_INITIALIZED);
    call()
}

/// Adds `bytes` (signed) to what the limits of context `handle` are
/// charged, never below nothing; returns what was added (less than a
/// shrink asked where the driver freed what it had grown by itself).
fn grow(handle: usize, bytes: i128) -> i128 {
    let mut made = made();
    let Some(context) = made.iter_mut().find(|c| c.handle == handle) else {
        return 0;
    };
    let now = (i128::from(context.limits) + bytes).max(0);
    let added = now - i128::from(context.limits);
    context.limits = u64::try_from(now).unwrap_or(u64::MAX);
    added
}

/// The limits that reserve device memory: the per-thread stack, the
/// `printf` FIFO, the device `malloc` heap, and the device runtime's sync
/// depth and pending launches (`CU_LIMIT_STACK_SIZE` … `CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT`,
/// 0 to 4). The others (L2 and shared memory settings) are passed through
/// unmeasured: a measurement window only adds noise to the context's charge.
const MEMORY_LIMITS: std::ops::RangeInclusive<c_int> = 0..=4;

/// A limit of the current context changes (`cuCtxSetLimit`). The stack
/// size is memory the context holds for every thread the device can run,
/// reserved when it is set ("will take effect immediately"); the other
/// memory limits may reserve theirs then or at the first launch that uses
/// them. Measured like a context: what NVML says this process holds
/// before and after. Growth is added to the context's charge, given back
/// with it; growth past the cap is undone (the old limit set again) and
/// refused with `CUDA_ERROR_OUT_OF_MEMORY`, as the driver refuses a limit
/// it has no memory for, or where it cannot be undone stands, charged
/// past the cap; a shrink gives back at most what growth was charged.
/// Only contexts the shim charged carry such changes.
fn limit_change(
    site: devices::Site,
    limit: c_int,
    value: usize,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let devices::Site { shim, dev, ctx } = site;
    if !MEMORY_LIMITS.contains(&limit) {
        return call();
    }
    // Looked up before the lock (see `prepare`): what reading the old
    // limit and setting it back call.
    prepare();
    get_limit();
    Hooked::cuCtxSetLimit.address();
    let _one_at_a_time = crate::fork::lock(&CREATING);
    let old = limit_now(limit);
    if old == Some(value) || !made().iter().any(|c| c.handle == ctx) {
        return call();
    }
    let uuid = shim.uuid(dev);
    let _making = shim.making_context(dev);
    let before = nvml::own_usage(&uuid);
    let charged_before = shim.own_charges(dev);
    let result = call();
    if result != CUDA_SUCCESS {
        return result;
    }
    // Without NVML, what the change took is left to reconciliation.
    let Some(took) = took_since(shim, dev, &uuid, before, charged_before) else {
        return result;
    };
    log::debug(|| format!("limit {limit} set: the context took {} MiB", took >> 20));
    if took <= 0 {
        let given_back = -grow(ctx, took);
        shim.uncharge(dev, u64::try_from(given_back).unwrap_or(0));
        return result;
    }
    if shim
        .charge(dev, u64::try_from(took).unwrap_or(u64::MAX))
        .is_ok()
    {
        grow(ctx, took);
        return result;
    }
    let set_back = old.is_some_and(|old| set_limit_now(limit, old) == CUDA_SUCCESS);
    // Whatever the driver still holds is held: charged past the cap, since
    // refusing it would not give it back.
    let kept = if set_back {
        took_since(shim, dev, &uuid, before, charged_before).unwrap_or(took)
    } else {
        took
    };
    let kept = grow(ctx, kept.max(0));
    shim.settle_held(dev, 0, u64::try_from(kept).unwrap_or(0));
    if set_back {
        refused(Refusal::OutOfMemory)
    } else {
        // The new limit stands: say so, charged past the cap, so that the
        // next allocation is refused instead.
        result
    }
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> CUresult {
    real!(let call = cuCtxSetLimit(limit, value) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| match devices::current() {
        Some(site) => limit_change(site, limit, value, call),
        None => call(),
    })
}
