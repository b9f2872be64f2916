//! Which capped device a CUDA call is about: devices are matched by UUID,
//! never by ordinal, and the current context's device is cached per context
//! handle so the allocation path makes one cheap driver call.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use crate::cuda::{CUcontext, CUdevice, CUresult, CUstream, CUDA_SUCCESS};
use crate::dlsym::LIBCUDA;
use crate::hook::{as_fn, Real};
use crate::ops::{self, Shim};

/// Cache codes: 0 unknown, 1 not capped, 2 + position in the file.
const UNKNOWN: u8 = 0;
const NOT_CAPPED: u8 = 1;

/// CUDA ordinal → code. Filled once per ordinal.
static ORDINALS: [AtomicU8; 64] = [const { AtomicU8::new(UNKNOWN) }; 64];

/// A handle (context, NVML device) → the capped device it stands for:
/// a few entries, read without a lock on every call that needs them. A full
/// cache only means the driver is asked again.
pub struct HandleCache<const N: usize> {
    entries: [(AtomicUsize, AtomicU8); N],
}

impl<const N: usize> HandleCache<N> {
    pub const fn new() -> Self {
        HandleCache {
            entries: [const { (AtomicUsize::new(0), AtomicU8::new(UNKNOWN)) }; N],
        }
    }

    /// What `handle` stands for: `None` if not known yet, else the capped
    /// device or `Some(None)` for a device that is not capped.
    pub fn get(&self, handle: usize) -> Option<Option<usize>> {
        self.entries
            .iter()
            .find(|(h, code)| {
                h.load(Ordering::Acquire) == handle && code.load(Ordering::Acquire) != UNKNOWN
            })
            .map(|(_, code)| decode(code.load(Ordering::Acquire)))
    }

    pub fn put(&self, handle: usize, dev: Option<usize>) {
        for (h, code) in &self.entries {
            if h.compare_exchange(0, handle, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                code.store(encode(dev), Ordering::Release);
                return;
            }
        }
    }

    /// Forgets a handle that may come back for another device.
    pub fn forget(&self, handle: usize) {
        for (h, code) in &self.entries {
            if h.load(Ordering::Acquire) == handle {
                code.store(UNKNOWN, Ordering::Release);
                let _ = h.compare_exchange(handle, 0, Ordering::AcqRel, Ordering::Acquire);
            }
        }
    }
}

/// The contexts this process uses. A context is forgotten when it is
/// destroyed (its handle may come back for another).
static CONTEXTS: HandleCache<32> = HandleCache::new();

type CtxGetCurrentFn = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
type CtxGetDeviceFn = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
type CtxPushFn = unsafe extern "C" fn(CUcontext) -> CUresult;
type CtxPopFn = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
type StreamGetCtxFn = unsafe extern "C" fn(CUstream, *mut CUcontext) -> CUresult;
type StreamGetDeviceFn = unsafe extern "C" fn(CUstream, *mut CUdevice) -> CUresult;
type DeviceGetUuidFn = unsafe extern "C" fn(*mut [u8; 16], CUdevice) -> CUresult;

fn decode(code: u8) -> Option<usize> {
    (code >= 2).then(|| usize::from(code - 2))
}

fn encode(dev: Option<usize>) -> u8 {
    dev.map_or(NOT_CAPPED, |d| d as u8 + 2)
}

/// The UUID the driver reports for an ordinal.
pub fn uuid_of(ordinal: CUdevice) -> Option<[u8; 16]> {
    let mut uuid = [0u8; 16];
    // Once per ordinal: no need to cache the function.
    let address = [c"cuDeviceGetUuid_v2", c"cuDeviceGetUuid"]
        .into_iter()
        .map(|name| LIBCUDA.symbol(name) as usize)
        .find(|&a| a != 0)?;
    // SAFETY: both variants take (CUuuid*, CUdevice) and fill 16 bytes.
    let result = unsafe { as_fn::<DeviceGetUuidFn>(address)(&mut uuid, ordinal) };
    (result == CUDA_SUCCESS).then_some(uuid)
}

/// The capped device an ordinal stands for.
pub fn at_ordinal(shim: &Shim, ordinal: CUdevice) -> Option<usize> {
    let cache = usize::try_from(ordinal).ok().and_then(|o| ORDINALS.get(o));
    let cached = cache.map_or(UNKNOWN, |c| c.load(Ordering::Relaxed));
    if cached != UNKNOWN {
        return decode(cached);
    }
    let dev = shim.device_of(&uuid_of(ordinal)?);
    if let Some(c) = cache {
        c.store(encode(dev), Ordering::Relaxed);
    }
    dev
}

/// The calling thread's current context, or null.
pub fn current_context() -> CUcontext {
    static GET_CURRENT: Real = Real::new();
    let address = LIBCUDA.cached(&GET_CURRENT, c"cuCtxGetCurrent");
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: cuCtxGetCurrent(CUcontext*) from the loaded driver.
    if address == 0 || unsafe { as_fn::<CtxGetCurrentFn>(address)(&mut ctx) } != CUDA_SUCCESS {
        return std::ptr::null_mut();
    }
    ctx
}

/// The calling thread's current context's device ordinal.
fn current_ordinal() -> Option<CUdevice> {
    static GET_DEVICE: Real = Real::new();
    let address = LIBCUDA.cached(&GET_DEVICE, c"cuCtxGetDevice");
    let mut ordinal: CUdevice = -1;
    // SAFETY: cuCtxGetDevice(CUdevice*) from the loaded driver.
    if address == 0 || unsafe { as_fn::<CtxGetDeviceFn>(address)(&mut ordinal) } != CUDA_SUCCESS {
        return None;
    }
    Some(ordinal)
}

/// The capped device of context `ctx`, which must be current.
fn of_current_context(shim: &Shim, ctx: usize) -> Option<usize> {
    if let Some(dev) = CONTEXTS.get(ctx) {
        return dev;
    }
    let dev = at_ordinal(shim, current_ordinal()?);
    CONTEXTS.put(ctx, dev);
    dev
}

/// The capped device of any live context: asked with it pushed for a
/// moment (`cuCtxGetDevice` only answers for the current one), once per
/// context. `None` if the driver cannot say.
fn of_context(shim: &Shim, ctx: CUcontext) -> Option<Option<usize>> {
    if let Some(dev) = CONTEXTS.get(ctx as usize) {
        return Some(dev);
    }
    static PUSH: Real = Real::new();
    static POP: Real = Real::new();
    let push = LIBCUDA.cached(&PUSH, c"cuCtxPushCurrent_v2");
    let pop = LIBCUDA.cached(&POP, c"cuCtxPopCurrent_v2");
    // SAFETY: cuCtxPushCurrent_v2(CUcontext) from the loaded driver, with a
    // context it just named.
    if push == 0 || pop == 0 || unsafe { as_fn::<CtxPushFn>(push)(ctx) } != CUDA_SUCCESS {
        return None;
    }
    let ordinal = current_ordinal();
    let mut popped: CUcontext = std::ptr::null_mut();
    // SAFETY: cuCtxPopCurrent_v2(CUcontext*), undoing the push above.
    unsafe { as_fn::<CtxPopFn>(pop)(&mut popped) };
    let dev = at_ordinal(shim, ordinal?);
    CONTEXTS.put(ctx as usize, dev);
    Some(dev)
}

/// Forgets a destroyed context's device.
pub fn forget_context(ctx: usize) {
    CONTEXTS.forget(ctx);
}

/// A capped device and the context a call runs in.
#[derive(Clone, Copy)]
pub struct Site {
    pub shim: &'static Shim,
    pub dev: usize,
    /// The context whose teardown frees what is made here; `NO_CONTEXT`
    /// where none does.
    pub ctx: usize,
}

/// No context's: what is recorded with it outlives every context.
pub const NO_CONTEXT: usize = 0;

impl Site {
    /// For stream-ordered memory, which no context owns: cuCtxDestroy
    /// "will not destroy memory allocations by cuMemCreate(),
    /// cuMemAllocAsync() and cuMemAllocFromPoolAsync()"; it stays charged
    /// until it is freed.
    pub fn unowned(self) -> Site {
        Site {
            ctx: NO_CONTEXT,
            ..self
        }
    }
}

/// The shim and the capped device of the current context, if any.
pub fn current() -> Option<Site> {
    let shim = ops::cuda_shim()?;
    let ctx = current_context() as usize;
    if ctx == 0 {
        return None;
    }
    Some(Site {
        shim,
        dev: of_current_context(shim, ctx)?,
        ctx,
    })
}

/// Stream handles that stand for the current context's default streams:
/// null, `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`.
const LAST_DEFAULT_STREAM: usize = 0x2;

/// Where stream-ordered memory asked for on `stream` is taken: from "the
/// memory pool of the device associated with the stream", which need not
/// be the current context's. No context's (`Site::unowned`). Asked of the
/// driver with `cuStreamGetDevice` (CUDA 12.8 on); before that, the
/// device of the stream's context (`cuStreamGetCtx`); where neither
/// answers, the current context's device.
pub fn of_stream(stream: CUstream) -> Option<Site> {
    let here = || current().map(Site::unowned);
    if stream as usize <= LAST_DEFAULT_STREAM {
        return here();
    }
    static GET_DEVICE: Real = Real::new();
    let address = LIBCUDA.cached(&GET_DEVICE, c"cuStreamGetDevice");
    let mut ordinal: CUdevice = -1;
    let answered = address != 0
        // SAFETY: cuStreamGetDevice(CUstream, CUdevice*) from the loaded
        // driver, with the stream the caller is about to allocate on.
        && unsafe { as_fn::<StreamGetDeviceFn>(address)(stream, &mut ordinal) } == CUDA_SUCCESS;
    if answered {
        let (shim, dev) = at(ordinal)?;
        return Some(Site {
            shim,
            dev,
            ctx: NO_CONTEXT,
        });
    }
    static GET_CTX: Real = Real::new();
    let address = LIBCUDA.cached(&GET_CTX, c"cuStreamGetCtx");
    let mut ctx: CUcontext = std::ptr::null_mut();
    let asked = address != 0
        // SAFETY: cuStreamGetCtx(CUstream, CUcontext*) from the loaded
        // driver, with the stream the caller is about to allocate on.
        && unsafe { as_fn::<StreamGetCtxFn>(address)(stream, &mut ctx) } == CUDA_SUCCESS;
    if !asked || ctx.is_null() {
        return here();
    }
    let shim = ops::cuda_shim()?;
    match of_context(shim, ctx) {
        Some(dev) => Some(Site {
            shim,
            dev: dev?,
            ctx: NO_CONTEXT,
        }),
        None => here(),
    }
}

/// The shim and the capped device behind a CUDA ordinal, if any.
pub fn at(ordinal: CUdevice) -> Option<(&'static Shim, usize)> {
    let shim = ops::cuda_shim()?;
    Some((shim, at_ordinal(shim, ordinal)?))
}
