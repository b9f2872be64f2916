//! Contexts: each device's primary context (retain-counted), created ones,
//! and every thread's context stack.
//!
//! A context takes `FAKEGPU_CONTEXT_MIB` when it becomes active and gives it
//! back, with every allocation made in it, when it is destroyed. Each active
//! spell has its own serial, recorded by the allocations made in it, so the
//! primary context's handle can stay `(dev + 1)` across resets.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::{
    config, device, memory, node, out, CUcontext, CUdevice, CUresult, INVALID_CONTEXT,
    INVALID_DEVICE, INVALID_VALUE, SUCCESS, UNSUPPORTED_LIMIT,
};

pub(crate) struct Context {
    handle: usize,
    pub(crate) dev: usize,
    /// The active spell's serial; 0 while inactive or destroyed.
    serial: AtomicU64,
    /// This spell's limits (`CUlimit`), the per-thread stack first.
    limits: [AtomicU64; LIMITS],
}

/// `CU_LIMIT_STACK_SIZE` … `CU_LIMIT_CIG_SHMEM_FALLBACK_ENABLED`, and
/// their defaults. Only the stack costs memory here.
const LIMITS: usize = 10;
const DEFAULT_LIMITS: [u64; LIMITS] = [1024, 1 << 20, 8 << 20, 2, 2048, 0, 0, 0, 0, 0];
const LIMIT_STACK_SIZE: usize = 0;
/// Threads a stack is reserved for: every thread the device can hold at
/// once (smaller than an H100's 132 SMs × 2048, to keep tests' numbers
/// small).
const RESIDENT_THREADS: u64 = 65536;

/// What a per-thread stack of `stack` bytes holds beyond the default one,
/// which the context's own cost includes.
fn stack_cost(stack: u64) -> u64 {
    stack
        .saturating_sub(DEFAULT_LIMITS[LIMIT_STACK_SIZE])
        .saturating_mul(RESIDENT_THREADS)
        .next_multiple_of(crate::PAGE)
}

impl Context {
    fn new(handle: usize, dev: usize) -> Context {
        Context {
            handle,
            dev,
            serial: AtomicU64::new(0),
            limits: DEFAULT_LIMITS.map(AtomicU64::new),
        }
    }

    /// Sets the per-thread stack, taking or giving back what it holds; a
    /// stack the device has no room for is refused. Serialised with other
    /// changes and with destruction by the registry's lock.
    fn set_stack(&self, stack: u64) -> CUresult {
        let _registry = registry();
        if self.serial() == 0 {
            return INVALID_CONTEXT;
        }
        let stacks = &self.limits[LIMIT_STACK_SIZE];
        let (was, will) = (
            stack_cost(stacks.load(Ordering::Acquire)),
            stack_cost(stack),
        );
        if will > was {
            if let Err(code) = node::charge(self.dev, will - was) {
                return code;
            }
        } else {
            node::uncharge(self.dev, was - will);
        }
        stacks.store(stack, Ordering::Release);
        SUCCESS
    }

    pub(crate) fn serial(&self) -> u64 {
        self.serial.load(Ordering::Acquire)
    }

    pub(crate) fn handle(&self) -> CUcontext {
        self.handle as CUcontext
    }

    fn activate(&self) -> Result<(), CUresult> {
        static SERIALS: AtomicU64 = AtomicU64::new(1);
        node::charge(self.dev, config().context)?;
        // The memory is taken first, and shows in NVML, as on a GPU.
        std::thread::sleep(config().context_delay);
        self.serial
            .store(SERIALS.fetch_add(1, Ordering::Relaxed), Ordering::Release);
        Ok(())
    }

    fn destroy(&self) {
        let serial = self.serial.swap(0, Ordering::AcqRel);
        if serial != 0 {
            let stack = self.limits[LIMIT_STACK_SIZE].load(Ordering::Acquire);
            for (limit, default) in self.limits.iter().zip(DEFAULT_LIMITS) {
                limit.store(default, Ordering::Release);
            }
            node::uncharge(self.dev, config().context + stack_cost(stack));
            memory::sweep(serial);
        }
    }
}

struct Registry {
    /// Per device: the primary context and its retain count.
    primary: Vec<(&'static Context, u32)>,
    /// Live created contexts by handle; leaked, since a thread may still
    /// hold one as current after it is destroyed.
    created: HashMap<usize, &'static Context>,
    next_handle: usize,
}

impl Registry {
    fn find(&self, handle: CUcontext) -> Option<&'static Context> {
        let h = handle as usize;
        match h.checked_sub(1).and_then(|d| self.primary.get(d)) {
            Some(&(ctx, _)) => Some(ctx),
            None => self.created.get(&h).copied(),
        }
    }
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY
        .get_or_init(|| {
            let primary = (0..config().uuids.len())
                .map(|dev| {
                    let ctx: &'static Context = Box::leak(Box::new(Context::new(dev + 1, dev)));
                    (ctx, 0)
                })
                .collect();
            Mutex::new(Registry {
                primary,
                created: HashMap::new(),
                next_handle: 0x00c7_0000,
            })
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// The top of the calling thread's context stack.
    static CURRENT: Cell<Option<&'static Context>> = const { Cell::new(None) };
    /// The rest of the stack, below `CURRENT`.
    static BELOW: RefCell<Vec<&'static Context>> = const { RefCell::new(Vec::new()) };
}

/// The calling thread's context and its serial, if it has a live one.
pub(crate) fn current() -> Result<(&'static Context, u64), CUresult> {
    let ctx = CURRENT.get().ok_or(INVALID_CONTEXT)?;
    match ctx.serial() {
        0 => Err(INVALID_CONTEXT),
        serial => Ok((ctx, serial)),
    }
}

fn handle_of(ctx: Option<&'static Context>) -> CUcontext {
    ctx.map_or(std::ptr::null_mut(), |c| c.handle as CUcontext)
}

fn push(ctx: &'static Context) {
    if let Some(below) = CURRENT.replace(Some(ctx)) {
        BELOW.with_borrow_mut(|b| b.push(below));
    }
}

fn pop() -> Option<&'static Context> {
    CURRENT.replace(BELOW.with_borrow_mut(Vec::pop))
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    refuse_after_fork!();
    let Some(d) = device(dev) else {
        return INVALID_DEVICE;
    };
    if pctx.is_null() {
        return INVALID_VALUE;
    }
    let mut registry = registry();
    let (ctx, retains) = &mut registry.primary[d];
    if *retains == 0 {
        if let Err(code) = ctx.activate() {
            return code;
        }
    }
    *retains += 1;
    // SAFETY: `pctx` is the caller's out-parameter, valid for writes under the driver API's
    // contract, and not null (checked above).
    unsafe { out(pctx, ctx.handle as CUcontext) }
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    refuse_after_fork!();
    let Some(d) = device(dev) else {
        return INVALID_DEVICE;
    };
    let mut registry = registry();
    let (ctx, retains) = &mut registry.primary[d];
    if *retains == 0 {
        return INVALID_CONTEXT;
    }
    *retains -= 1;
    if *retains == 0 {
        ctx.destroy();
    }
    SUCCESS
}

/// Destroys the primary context whatever its retain count; the next retain
/// creates it afresh.
#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult {
    refuse_after_fork!();
    let Some(d) = device(dev) else {
        return INVALID_DEVICE;
    };
    let mut registry = registry();
    let (ctx, retains) = &mut registry.primary[d];
    ctx.destroy();
    *retains = 0;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    refuse_after_fork!();
    let Some(d) = device(dev) else {
        return INVALID_DEVICE;
    };
    if flags.is_null() || active.is_null() {
        return INVALID_VALUE;
    }
    let retained = registry().primary[d].1 > 0;
    // The answer is as of the read: whatever happens while it is late is
    // not in it.
    std::thread::sleep(config().get_state_delay);
    // SAFETY: `flags` and `active` are the caller's out-parameters, valid for writes under the
    // driver API's contract, and not null (checked above).
    unsafe {
        *flags = 0;
        *active = c_int::from(retained);
    }
    SUCCESS
}

fn create(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    refuse_after_fork!();
    let Some(d) = device(dev) else {
        return INVALID_DEVICE;
    };
    if pctx.is_null() {
        return INVALID_VALUE;
    }
    let mut registry = registry();
    let handle = registry.next_handle;
    let ctx = Box::new(Context::new(handle, d));
    if let Err(code) = ctx.activate() {
        return code;
    }
    let ctx: &'static Context = Box::leak(ctx);
    registry.next_handle += 0x100;
    registry.created.insert(handle, ctx);
    push(ctx);
    // SAFETY: `pctx` is the out-parameter the `cuCtxCreate` entry points were given, valid for
    // writes under the driver API's contract, and not null (checked above).
    unsafe { out(pctx, handle as CUcontext) }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    create(pctx, dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    _params: *mut c_void,
    _n: c_int,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    create(pctx, dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    _params: *mut c_void,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    create(pctx, dev)
}

/// A primary context handed here is reset, as `cuDevicePrimaryCtxReset` would.
#[no_mangle]
pub extern "C" fn cuCtxDestroy_v2(handle: CUcontext) -> CUresult {
    refuse_after_fork!();
    let mut registry = registry();
    let Some(ctx) = registry.find(handle) else {
        return INVALID_CONTEXT;
    };
    ctx.destroy();
    if ctx.handle <= registry.primary.len() {
        registry.primary[ctx.dev].1 = 0;
    } else {
        registry.created.remove(&ctx.handle);
    }
    if CURRENT.get().is_some_and(|c| std::ptr::eq(c, ctx)) {
        pop();
    }
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(handle: CUcontext) -> CUresult {
    refuse_after_fork!();
    if handle.is_null() {
        pop();
        return SUCCESS;
    }
    match registry().find(handle) {
        Some(ctx) => {
            CURRENT.set(Some(ctx));
            SUCCESS
        }
        None => INVALID_CONTEXT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut CUcontext) -> CUresult {
    refuse_after_fork!();
    // SAFETY: `pctx` is the caller's out-parameter: null, which `out` refuses, or valid for writes,
    // as the driver API requires.
    unsafe { out(pctx, handle_of(CURRENT.get())) }
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(handle: CUcontext) -> CUresult {
    refuse_after_fork!();
    match registry().find(handle) {
        Some(ctx) => {
            push(ctx);
            SUCCESS
        }
        None => INVALID_CONTEXT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) -> CUresult {
    refuse_after_fork!();
    let Some(ctx) = pop() else {
        return INVALID_CONTEXT;
    };
    if !pctx.is_null() {
        // SAFETY: `pctx` is the caller's optional out-parameter, valid for writes when not null
        // (checked).
        unsafe { *pctx = handle_of(Some(ctx)) };
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    refuse_after_fork!();
    match current() {
        // SAFETY: `dev` is the caller's out-parameter: null, which `out` refuses, or valid for
        // writes, as the driver API requires.
        Ok((ctx, _)) => unsafe { out(dev, ctx.dev as CUdevice) },
        Err(code) => code,
    }
}

// Nothing runs on a fake device, so there is never anything to wait for.

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    refuse_after_fork!();
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(_stream: *mut c_void) -> CUresult {
    refuse_after_fork!();
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize_ptsz(_stream: *mut c_void) -> CUresult {
    refuse_after_fork!();
    SUCCESS
}

/// The stack is reserved for every resident thread the moment it is set,
/// as the driver documents ("will take effect immediately").
#[no_mangle]
pub extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> CUresult {
    refuse_after_fork!();
    let (ctx, _) = match current() {
        Ok(current) => current,
        Err(code) => return code,
    };
    match usize::try_from(limit).ok().filter(|&l| l < LIMITS) {
        Some(LIMIT_STACK_SIZE) => ctx.set_stack(value as u64),
        Some(other) => {
            ctx.limits[other].store(value as u64, Ordering::Release);
            SUCCESS
        }
        None => UNSUPPORTED_LIMIT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetLimit(value: *mut usize, limit: c_int) -> CUresult {
    refuse_after_fork!();
    let (ctx, _) = match current() {
        Ok(current) => current,
        Err(code) => return code,
    };
    match usize::try_from(limit).ok().and_then(|l| ctx.limits.get(l)) {
        // SAFETY: `value` is the caller's out-parameter: null, which `out` refuses, or valid for
        // writes, as the driver API requires.
        Some(limit) => unsafe { out(value, limit.load(Ordering::Acquire) as usize) },
        None => UNSUPPORTED_LIMIT,
    }
}

/// Fake kernels: a function handle stands for a kernel that needs that
/// many bytes of stack per thread. As the driver documents, a launch grows
/// the stack as needed, and it stays grown ("isn't reset back to the
/// original value after each launch").
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    _grid_x: c_uint,
    _grid_y: c_uint,
    _grid_z: c_uint,
    _block_x: c_uint,
    _block_y: c_uint,
    _block_z: c_uint,
    _shared: c_uint,
    _stream: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    refuse_after_fork!();
    let (ctx, _) = match current() {
        Ok(current) => current,
        Err(code) => return code,
    };
    let needed = f as u64;
    if ctx.limits[LIMIT_STACK_SIZE].load(Ordering::Acquire) < needed {
        ctx.set_stack(needed)
    } else {
        SUCCESS
    }
}
