//! Device memory: the cuMemAlloc family, stream-ordered allocations and the
//! table of live allocations (arrays included) that a destroyed context sweeps.
//!
//! Costs follow an H100 (driver 580): 2 MiB or more takes whole 2 MiB pages;
//! less is carved (512-byte steps) from 2 MiB chunks, each charged once when
//! opened and given back when its last allocation is freed.

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ffi::{c_uint, c_void};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use crate::context::{self, Context};
use crate::node::{self, MAX_DEVICES};
use crate::{
    config, out, pool, stream, CUdeviceptr, CUresult, INVALID_CONTEXT, INVALID_VALUE, NOT_FOUND,
    OUT_OF_MEMORY, PAGE, SUCCESS,
};

/// Small allocations are rounded up to this.
const SMALL_STEP: u64 = 512;
/// Shards of the allocation table, so threads allocating at once do not
/// queue on one lock (the shim benchmark measures the shim, not this).
const SHARDS: usize = 64;
/// A chunk's live count once it has been given back.
const DEAD: u64 = u64::MAX;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Memory,
    Array,
    Mipmap,
}

enum Cost {
    Pages(u64),
    Chunk(Arc<Chunk>),
    /// Whole pages below 4 GiB, for the 32-bit-era entry points (`low`).
    Low(u64),
    /// From a host pool: no device memory.
    Host,
}

struct Allocation {
    kind: Kind,
    dev: usize,
    /// Serial of the context it was made in.
    ctx: u64,
    cost: Cost,
}

impl Allocation {
    /// Frees it; `address` is where it was.
    fn give_back(self, address: u64) {
        match self.cost {
            Cost::Pages(bytes) => node::uncharge(self.dev, bytes),
            Cost::Chunk(chunk) => chunk.leave(),
            Cost::Low(bytes) => {
                low::give(address, bytes);
                node::uncharge(self.dev, bytes);
            }
            Cost::Host => {}
        }
    }
}

/// The address space below 4 GiB, where the 32-bit-era entry points
/// (`cuMemAlloc` and `cuMemAllocPitch` before CUDA 3.2) put what they
/// allocate: their `unsigned int` pointer holds every address there. Whole
/// pages, first fit, reused once freed; page 0 is never handed out (0 is
/// no allocation).
mod low {
    use std::sync::Mutex;

    use crate::PAGE;

    const PAGES: usize = (1 << 32) / PAGE as usize;

    static TAKEN: Mutex<[bool; PAGES]> = Mutex::new([false; PAGES]);

    fn taken() -> std::sync::MutexGuard<'static, [bool; PAGES]> {
        TAKEN.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The address of `bytes` (whole pages) of free space, if there is a run.
    pub(super) fn take(bytes: u64) -> Option<u64> {
        let pages = usize::try_from(bytes / PAGE).ok()?;
        let mut taken = taken();
        let first = (1..PAGES.checked_sub(pages)? + 1)
            .find(|&first| taken[first..first + pages].iter().all(|t| !t))?;
        taken[first..first + pages].fill(true);
        Some(first as u64 * PAGE)
    }

    pub(super) fn give(address: u64, bytes: u64) {
        let (first, pages) = ((address / PAGE) as usize, (bytes / PAGE) as usize);
        taken()[first..first + pages].fill(false);
    }
}

/// A 2 MiB chunk small allocations are carved from. Only the thread that
/// opened it carves from it; any thread may free into it.
struct Chunk {
    base: u64,
    dev: usize,
    /// Serial of the context it belongs to.
    ctx: AtomicU64,
    /// Allocations in it, or `DEAD` once the last one left (never 0).
    live: AtomicU64,
}

impl Chunk {
    fn enter(&self) -> bool {
        self.live
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| {
                (n != DEAD).then(|| n + 1)
            })
            .is_ok()
    }

    /// The last allocation out turns the chunk `DEAD` in the same step, so
    /// the owner can never slip a new one into a chunk being given back.
    fn leave(&self) {
        let last = self
            .live
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                Some(if n == 1 { DEAD } else { n - 1 })
            })
            == Ok(1);
        if last {
            node::uncharge(self.dev, PAGE);
        }
    }
}

struct Open {
    chunk: Arc<Chunk>,
    used: u64,
}

thread_local! {
    /// The calling thread's open chunk per device.
    static OPEN: RefCell<[Option<Open>; MAX_DEVICES]> =
        const { RefCell::new([const { None }; MAX_DEVICES]) };
}

/// Keys are distinct addresses: one multiply spreads them well enough, at a
/// fraction of SipHash's cost.
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        bytes.iter().for_each(|&b| self.write_u64(u64::from(b)));
    }

    fn write_u64(&mut self, n: u64) {
        let h = (self.0 ^ n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = h ^ (h >> 32);
    }
}

type Table = HashMap<u64, Allocation, BuildHasherDefault<AddressHasher>>;

/// A shard on cache lines of its own: each thread keeps hitting the shard
/// of its open chunk, and neighbours must not slow each other down.
#[repr(align(128))]
struct Shard(Mutex<Table>);

fn shards() -> &'static [Shard; SHARDS] {
    static SHARDED: OnceLock<[Shard; SHARDS]> = OnceLock::new();
    SHARDED.get_or_init(|| std::array::from_fn(|_| Shard(Mutex::new(Table::default()))))
}

fn lock(shard: &Shard) -> MutexGuard<'_, Table> {
    shard.0.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shard holding `address`: a chunk's allocations share one.
fn shard_of(address: u64) -> MutexGuard<'static, Table> {
    lock(&shards()[(address >> 21) as usize % SHARDS])
}

/// Fresh addresses for `bytes` (VA ranges, allocations, array and VMM
/// handles alike, so no two ever collide), aligned to `align` and 2 MiB.
pub(crate) fn address_space(bytes: u64, align: u64) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0x7f00_0000_0000);
    let align = align.max(PAGE).next_power_of_two();
    let span = bytes.max(1).next_multiple_of(PAGE) + (align - PAGE);
    NEXT.fetch_add(span, Ordering::Relaxed)
        .next_multiple_of(align)
}

/// Carves `bytes` (< 2 MiB) from the thread's open chunk on `dev`, opening
/// one (and charging its 2 MiB) when that is full, dead or of another context.
fn carve(dev: usize, ctx: u64, bytes: u64) -> Result<(u64, Arc<Chunk>), CUresult> {
    let size = bytes.next_multiple_of(SMALL_STEP);
    OPEN.with_borrow_mut(|open| {
        let slot = &mut open[dev];
        if let Some(o) = slot {
            let same = o.chunk.ctx.load(Ordering::Relaxed) == ctx;
            if same && o.used + size <= PAGE && o.chunk.enter() {
                let address = o.chunk.base + o.used;
                o.used += size;
                return Ok((address, Arc::clone(&o.chunk)));
            }
        }
        node::charge(dev, PAGE)?;
        let chunk = reopen(slot.take().map(|o| o.chunk), dev, ctx);
        *slot = Some(Open {
            chunk: Arc::clone(&chunk),
            used: size,
        });
        Ok((chunk.base, chunk))
    })
}

/// A chunk nothing but this thread holds any more is dead (no allocation
/// holds it, and only holders can clone it): it is reused, address and
/// all, sparing the allocator and the shared address counter.
fn reopen(old: Option<Arc<Chunk>>, dev: usize, ctx: u64) -> Arc<Chunk> {
    match old {
        Some(chunk) if Arc::strong_count(&chunk) == 1 => {
            chunk.ctx.store(ctx, Ordering::Relaxed);
            chunk.live.store(1, Ordering::Relaxed);
            chunk
        }
        _ => Arc::new(Chunk {
            base: address_space(PAGE, PAGE),
            dev,
            ctx: AtomicU64::new(ctx),
            live: AtomicU64::new(1),
        }),
    }
}

/// Whether destroying the context an allocation was made in frees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Owned {
    ByContext,
    /// Stream-ordered memory: no context owns it (cuCtxDestroy "will not
    /// destroy memory allocations by cuMemCreate(), cuMemAllocAsync() and
    /// cuMemAllocFromPoolAsync()"); it lives until freed.
    Not,
}

/// Takes `bytes` on `dev` in context `ctx` (with its serial).
pub(crate) fn allocate(
    kind: Kind,
    dev: usize,
    (ctx, serial): (&Context, u64),
    bytes: u64,
    owned: Owned,
) -> Result<u64, CUresult> {
    // Serial 0 is no context's: never swept.
    let serial = match owned {
        Owned::ByContext => serial,
        Owned::Not => 0,
    };
    if bytes == 0 {
        return Err(INVALID_VALUE);
    }
    let (address, cost) = if kind == Kind::Memory && bytes < PAGE {
        let (address, chunk) = carve(dev, serial, bytes)?;
        (address, Cost::Chunk(chunk))
    } else {
        let pages = bytes.next_multiple_of(PAGE);
        node::charge(dev, pages)?;
        (address_space(pages, PAGE), Cost::Pages(pages))
    };
    let allocation = Allocation {
        kind,
        dev,
        ctx: serial,
        cost,
    };
    enter(address, allocation, ctx, owned)
}

/// Takes `bytes` in whole pages below 4 GiB, in the current context: the
/// 32-bit-era entry points' allocations.
fn allocate_low(bytes: u64) -> Result<u32, CUresult> {
    let (ctx, serial) = context::current()?;
    if bytes == 0 {
        return Err(INVALID_VALUE);
    }
    let pages = bytes.next_multiple_of(PAGE);
    node::charge(ctx.dev, pages)?;
    let Some(address) = low::take(pages) else {
        node::uncharge(ctx.dev, pages);
        return Err(OUT_OF_MEMORY);
    };
    let allocation = Allocation {
        kind: Kind::Memory,
        dev: ctx.dev,
        ctx: serial,
        cost: Cost::Low(pages),
    };
    // Below 4 GiB (`low::take`): the whole address.
    enter(address, allocation, ctx, Owned::ByContext).map(|address| address as u32)
}

/// Records `allocation`, made at `address` in `ctx`; undone if that
/// context was destroyed meanwhile (its sweep may have passed this shard
/// already).
fn enter(
    address: u64,
    allocation: Allocation,
    ctx: &Context,
    owned: Owned,
) -> Result<u64, CUresult> {
    let serial = allocation.ctx;
    shard_of(address).insert(address, allocation);
    if owned == Owned::ByContext && ctx.serial() != serial {
        let swept = shard_of(address).remove(&address);
        if let Some(allocation) = swept {
            allocation.give_back(address);
        }
        return Err(INVALID_CONTEXT);
    }
    Ok(address)
}

/// Frees what `allocate` made at `address`, if it was of `kind`.
pub(crate) fn release(address: u64, kind: Kind) -> CUresult {
    let mut shard = shard_of(address);
    let allocation = match shard.entry(address) {
        Entry::Occupied(e) if e.get().kind == kind => e.remove(),
        _ => return INVALID_VALUE,
    };
    drop(shard);
    allocation.give_back(address);
    SUCCESS
}

/// Frees everything made in the context spell `serial`.
pub(crate) fn sweep(serial: u64) {
    for shard in shards() {
        let swept: Vec<(u64, Allocation)> =
            lock(shard).extract_if(|_, a| a.ctx == serial).collect();
        swept.into_iter().for_each(|(at, a)| a.give_back(at));
    }
}

/// In the current context, which sweeps it when destroyed.
fn alloc_current(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    refuse_after_fork!();
    alloc_in(context::current(), dptr, size, Owned::ByContext)
}

/// From the pool of the stream's device, whatever the current context's is.
fn alloc_on_stream(dptr: *mut CUdeviceptr, size: usize, stream: *mut c_void) -> CUresult {
    refuse_after_fork!();
    alloc_in(stream::context_of(stream), dptr, size, Owned::Not)
}

/// On the device of context `ctx`, as found for the call.
fn alloc_in(
    ctx: Result<(&'static Context, u64), CUresult>,
    dptr: *mut CUdeviceptr,
    size: usize,
    owned: Owned,
) -> CUresult {
    let ctx = match ctx {
        Ok(ctx) => ctx,
        Err(code) => return code,
    };
    if dptr.is_null() {
        return INVALID_VALUE;
    }
    match allocate(Kind::Memory, ctx.0.dev, ctx, size as u64, owned) {
        // SAFETY: `dptr` is the caller's out-parameter, valid for writes under the driver API's
        // contract, and not null (checked above).
        Ok(address) => unsafe { out(dptr, address) },
        Err(code) => code,
    }
}

/// Where the pool puts its memory, whatever the current context's device
/// is; managed memory that prefers no device goes to the stream's.
fn alloc_from_pool(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> CUresult {
    refuse_after_fork!();
    let Some(place) = pool::place_of(pool) else {
        return INVALID_VALUE;
    };
    let ctx = match context::current() {
        Ok(ctx) => ctx,
        Err(code) => return code,
    };
    if dptr.is_null() {
        return INVALID_VALUE;
    }
    let made = match place {
        pool::Place::Device(dev) => allocate(Kind::Memory, dev, ctx, size as u64, Owned::Not),
        pool::Place::Current => match stream::context_of(stream) {
            Ok(on) => allocate(Kind::Memory, on.0.dev, ctx, size as u64, Owned::Not),
            Err(code) => Err(code),
        },
        pool::Place::Host => allocate_host(size as u64),
    };
    match made {
        // SAFETY: `dptr` is the caller's out-parameter, valid for writes under the driver API's
        // contract, and not null (checked above).
        Ok(address) => unsafe { out(dptr, address) },
        Err(code) => code,
    }
}

/// Host memory handed out by a host pool: an address to free, no device's.
fn allocate_host(bytes: u64) -> Result<u64, CUresult> {
    if bytes == 0 {
        return Err(INVALID_VALUE);
    }
    let address = address_space(bytes.next_multiple_of(PAGE), PAGE);
    let allocation = Allocation {
        kind: Kind::Memory,
        dev: 0,
        ctx: 0,
        cost: Cost::Host,
    };
    shard_of(address).insert(address, allocation);
    Ok(address)
}

fn free(dptr: CUdeviceptr) -> CUresult {
    refuse_after_fork!();
    release(dptr, Kind::Memory)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    alloc_current(dptr, size)
}

/// A variant the shim does not know, as a future driver might add one with
/// another signature (here a flags argument), handed out for CUDA 14 and
/// later: a shim that took it for `cuMemAlloc_v2` would call it wrongly.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v3(
    dptr: *mut CUdeviceptr,
    size: usize,
    _flags: c_uint,
) -> CUresult {
    alloc_current(dptr, size)
}

/// The 32-bit-era `cuMemAlloc` (CUDA 2.0's ABI, `PFN_cuMemAlloc_v2000`:
/// an `unsigned int` pointer and size), exported as the real driver does
/// and handed out by `cuGetProcAddress` for versions before 3.2: in the
/// current context, below 4 GiB, so the pointer is the whole address (any
/// free of it, of either ABI, finds it).
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut c_uint, size: c_uint) -> CUresult {
    refuse_after_fork!();
    if dptr.is_null() {
        return INVALID_VALUE;
    }
    match allocate_low(u64::from(size)) {
        // SAFETY: `dptr` is the caller's out-parameter, valid for writes under the driver API's
        // contract, and not null (checked above).
        Ok(address) => unsafe { out(dptr, address) },
        Err(code) => code,
    }
}

/// The 32-bit-era `cuMemAllocPitch` (`PFN_cuMemAllocPitch_v2000`): as the
/// v2 function pitches, below 4 GiB as `cuMemAlloc` allocates.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch(
    dptr: *mut c_uint,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    _element: c_uint,
) -> CUresult {
    refuse_after_fork!();
    if dptr.is_null() || pitch.is_null() {
        return INVALID_VALUE;
    }
    let Ok(p) = c_uint::try_from(u64::from(width).next_multiple_of(512)) else {
        return INVALID_VALUE;
    };
    match allocate_low(u64::from(p) * u64::from(height)) {
        // SAFETY: both are the caller's out-parameters, valid for writes under the driver API's
        // contract, and not null (checked above).
        Ok(address) => unsafe {
            *pitch = p;
            out(dptr, address)
        },
        Err(code) => code,
    }
}

/// The 32-bit-era `cuMemFree` (`PFN_cuMemFree_v2000`).
#[no_mangle]
pub extern "C" fn cuMemFree(dptr: c_uint) -> CUresult {
    free(u64::from(dptr))
}

/// An allocation made through whatever the process's `cuMemAlloc_v2`
/// symbol resolves to (the shim's hook when it is preloaded), as a driver
/// whose exports call one another through the dynamic symbol table would:
/// the shim, already inside a hook, must not charge it a second time.
fn alloc_via_export(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    type AllocFn = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
    // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the global scope.
    let found = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cuMemAlloc_v2".as_ptr()) };
    if found.is_null() {
        return NOT_FOUND;
    }
    // SAFETY: every `cuMemAlloc_v2` (ours, or a hook of it) has this ABI.
    let alloc: AllocFn = unsafe { std::mem::transmute::<*mut c_void, AllocFn>(found) };
    // SAFETY: the caller's out-parameter, passed on.
    unsafe { alloc(dptr, size) }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    _element: c_uint,
) -> CUresult {
    let p = width.next_multiple_of(512);
    let r = if config().pitch_via_export {
        alloc_via_export(dptr, p * height)
    } else {
        alloc_current(dptr, p * height)
    };
    if r == SUCCESS {
        // SAFETY: `pitch` is the caller's out-parameter, which `cuMemAllocPitch` requires valid for
        // writes.
        unsafe { *pitch = p };
    }
    r
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    size: usize,
    _flags: c_uint,
) -> CUresult {
    alloc_current(dptr, size)
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    free(dptr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: *mut c_void,
) -> CUresult {
    alloc_on_stream(dptr, size, stream)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: *mut c_void,
) -> CUresult {
    alloc_on_stream(dptr, size, stream)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> CUresult {
    alloc_from_pool(dptr, size, pool, stream)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> CUresult {
    alloc_from_pool(dptr, size, pool, stream)
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, _s: *mut c_void) -> CUresult {
    free(dptr)
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, _s: *mut c_void) -> CUresult {
    free(dptr)
}

/// Free is what every process on the node leaves of the current device.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    refuse_after_fork!();
    let (ctx, _) = match context::current() {
        Ok(ctx) => ctx,
        Err(code) => return code,
    };
    if free.is_null() || total.is_null() {
        return INVALID_VALUE;
    }
    let memory = config().memory;
    // SAFETY: `free` and `total` are the caller's out-parameters, valid for writes under the driver
    // API's contract, and not null (checked above).
    unsafe {
        *total = memory as usize;
        *free = memory.saturating_sub(node::used(ctx.dev)) as usize;
    }
    SUCCESS
}
