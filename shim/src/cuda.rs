//! CUDA driver hooks: allocations are charged before the driver is asked,
//! frees give back after it succeeds, and memory queries report the cap.

#![allow(non_snake_case)]

use std::ffi::{c_int, c_uint, c_ulonglong, c_void};

use crate::devices::{self, Site};
use crate::hook::{answered, guarded, real};
use crate::ops::{self, Refusal, Shim};
use crate::pool;
use crate::track::{self, Allocation, Allocations, Inserted};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = c_ulonglong;
/// The device pointer of the 32-bit-era entry points (CUDA before 3.2,
/// `CUdeviceptr_v1` in cuda.h).
#[allow(non_camel_case_types)]
pub type CUdeviceptr_v1 = c_uint;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUmemoryPool = *mut c_void;
pub type CUmemGenericAllocationHandle = c_ulonglong;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;

const CU_MEM_LOCATION_TYPE_NONE: c_int = 0;
const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const CU_MEM_LOCATION_TYPE_HOST: c_int = 2;
const CU_MEM_LOCATION_TYPE_HOST_NUMA: c_int = 3;
const CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT: c_int = 4;

/// Where memory at a `CUmemLocation` lives, as far as caps go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placed {
    Device(CUdevice),
    /// Host memory, host NUMA nodes included: no device's.
    Host,
    /// No location (`CU_MEM_LOCATION_TYPE_NONE`, also the invalid one):
    /// for managed memory, no preferred one.
    Unset,
    /// A location this shim does not know (CUDA 13.4's locality domains of
    /// a device, anything newer): charged to the device of the current
    /// context (or stream) rather than let through.
    Elsewhere,
}

impl Placed {
    pub fn of(location_type: c_int, id: c_int) -> Placed {
        match location_type {
            CU_MEM_LOCATION_TYPE_NONE => Placed::Unset,
            CU_MEM_LOCATION_TYPE_DEVICE => Placed::Device(id),
            CU_MEM_LOCATION_TYPE_HOST
            | CU_MEM_LOCATION_TYPE_HOST_NUMA
            | CU_MEM_LOCATION_TYPE_HOST_NUMA_CURRENT => Placed::Host,
            _ => Placed::Elsewhere,
        }
    }
}

/// The head of `CUmemAllocationProp` and `CUmemPoolProps` (cuda.h): only
/// the allocation type and the location are read.
#[repr(C)]
pub struct CUmemAllocationProp {
    pub type_: c_int,
    pub requested_handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
}

impl CUmemAllocationProp {
    /// The allocation type and where the caller's properties (null
    /// checked) place the memory.
    pub fn read(prop: *const Self) -> Option<(c_int, Placed)> {
        // SAFETY: the caller's properties, not null (checked); the leading
        // fields are present in every CUDA version.
        let prop = (!prop.is_null()).then(|| unsafe { &*prop })?;
        Some((prop.type_, Placed::of(prop.location_type, prop.location_id)))
    }
}

/// The one place a refusal becomes a driver result.
pub fn refused(refusal: Refusal) -> CUresult {
    match refusal {
        Refusal::OutOfMemory => CUDA_ERROR_OUT_OF_MEMORY,
    }
}

/// Every device allocation of this process (cuMemAlloc family and pools).
static ALLOCATIONS: Allocations = Allocations::new();

/// Reads an out-parameter the driver just wrote.
pub fn written<T: Copy>(ptr: *const T) -> Option<T> {
    // SAFETY: only called after the driver returned success for a call
    // that writes through `ptr`; null is checked.
    (!ptr.is_null()).then(|| unsafe { *ptr })
}

/// Clears an out-parameter whose object was just undone: a caller that
/// cleans up whatever it got back on failure must not free it again (the
/// driver may have handed its address out anew).
pub fn cleared<T>(ptr: *mut T, empty: T) {
    if !ptr.is_null() {
        // SAFETY: the caller's out-parameter, which the driver wrote through
        // just before (so valid for writes); null checked.
        unsafe { ptr.write(empty) };
    }
}

/// Charges an allocation before the driver makes it (every 2 MiB chunk an
/// `estimate`-byte allocation can take), then settles the charge to the
/// chunks it really took once the driver says where it went: a chunk it
/// shares with earlier allocations costs nothing more. If it took more than
/// charged and that does not fit, it is freed with `undo` and refused.
fn allocate(
    table: &Allocations,
    site: Site,
    estimate: u64,
    call: impl FnOnce() -> CUresult,
    made: impl FnOnce() -> Option<(u64, u64)>,
    undo: impl FnOnce(u64) -> CUresult,
) -> CUresult {
    let Site { shim, dev, ctx } = site;
    let upfront = track::upper_bound(estimate);
    if let Err(refusal) = shim.charge(dev, upfront) {
        return refused(refusal);
    }
    let result = call();
    let Some((ptr, size)) = (result == CUDA_SUCCESS).then(made).flatten() else {
        shim.uncharge(dev, upfront);
        return result;
    };
    let allocation = Allocation {
        dev,
        ctx,
        ptr,
        size,
    };
    let taken = record(table, shim, allocation);
    match shim.settle(dev, upfront, taken) {
        Ok(()) => result,
        Err(refusal) => {
            // Out again before the driver gets it back. A chunk it shared
            // that another allocation entered meanwhile stays taken, and
            // charged: this allocation's charge moves from what it holds
            // (`upfront`) to what it took less what it gives back.
            let back = table.take(ptr).map_or(0, |(_, back)| back);
            shim.settle_held(dev, upfront + back, taken);
            undo(ptr);
            refused(refusal)
        }
    }
}

/// Records an allocation; returns the bytes it took. A record already at
/// its address is of memory the driver freed without the shim seeing it
/// (with its context, before the shim dropped the context's records): it
/// goes, and what it held is given back.
fn record(table: &Allocations, shim: &Shim, allocation: Allocation) -> u64 {
    let Inserted { taken, stale } = table.insert(allocation);
    if let Some((old, back)) = stale {
        shim.uncharge(old.dev, back);
    }
    taken
}

/// A device pointer the driver writes: 64-bit, or 32-bit for the entry
/// points before CUDA 3.2. Recorded widened; the address is the same.
trait DevicePtr: Copy + Default + Into<u64> {}
impl DevicePtr for CUdeviceptr {}
impl DevicePtr for CUdeviceptr_v1 {}

/// An allocation of `bytesize` at `site` (none: not capped), written to
/// `dptr` by the driver.
fn sized<P: DevicePtr>(
    site: Option<Site>,
    dptr: *mut P,
    bytesize: u64,
    call: impl FnOnce() -> CUresult,
    undo: impl FnOnce(u64) -> CUresult,
) -> CUresult {
    match site {
        Some(site) => allocate(
            &ALLOCATIONS,
            site,
            bytesize,
            call,
            || Some((written(dptr)?.into(), bytesize)),
            |ptr| {
                let result = undo(ptr);
                cleared(dptr, P::default());
                result
            },
        ),
        None => call(),
    }
}

/// A pitched allocation of `height` rows of `width` bytes, written to
/// `dptr` by the driver, with the pitch it chose (read by `pitch`). The
/// pitch is only known afterwards: the usual 512-byte alignment is charged
/// now and settled once the driver answers.
fn pitched<P: DevicePtr>(
    dptr: *mut P,
    pitch: impl FnOnce() -> Option<u64>,
    (width, height): (u64, u64),
    call: impl FnOnce() -> CUresult,
    undo: impl FnOnce(u64) -> CUresult,
) -> CUresult {
    let Some(site) = devices::current() else {
        return call();
    };
    let estimate = width.next_multiple_of(512).saturating_mul(height);
    allocate(
        &ALLOCATIONS,
        site,
        estimate,
        call,
        || {
            let size = pitch()?.saturating_mul(height);
            Some((written(dptr)?.into(), size))
        },
        |ptr| {
            let result = undo(ptr);
            cleared(dptr, P::default());
            result
        },
    )
}

/// A free: forget the record first (so an address reused by a racing
/// allocation is not dropped), give back what the driver got back only on
/// success. A failed free puts the record back and keeps the charge, moved
/// to what the record takes now: another allocation may have entered, and
/// been charged for, a chunk this one was giving up.
fn free(
    table: &Allocations,
    shim: impl FnOnce() -> Option<&'static Shim>,
    ptr: u64,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let Some((allocation, back)) = table.take(ptr) else {
        // Not ours (allocated before the shim saw it): just forward.
        return call();
    };
    let result = call();
    let Some(shim) = shim() else {
        return result;
    };
    if result == CUDA_SUCCESS {
        shim.uncharge(allocation.dev, back);
    } else {
        let taken = record(table, shim, allocation);
        shim.settle_held(allocation.dev, back, taken);
    }
    result
}

/// Gives back what a destroyed context's allocations held: the driver
/// freed them with it.
pub fn drop_allocations(shim: &Shim, ctx: usize) {
    ALLOCATIONS.drain_context(ctx, |allocation, back| shim.uncharge(allocation.dev, back));
}

/// Frees `ptr` with the real `cuMemFree_v2` (undoing an allocation).
fn free_now(ptr: u64) -> CUresult {
    real!(let call = cuMemFree_v2(ptr) else CUDA_ERROR_NOT_INITIALIZED);
    call()
}

/// Frees `ptr`, made through a 32-bit-era entry point, with the real
/// `cuMemFree` of that ABI, or `cuMemFree_v2` where there is none.
fn free_now_v1(ptr: u64) -> CUresult {
    let Ok(dptr) = CUdeviceptr_v1::try_from(ptr) else {
        return free_now(ptr);
    };
    real!(let call = cuMemFree(dptr) else free_now(ptr));
    call()
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    real!(let call = cuMemAlloc_v2(dptr, bytesize) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        sized(devices::current(), dptr, bytesize as u64, call, free_now)
    })
}

/// The 32-bit-era `cuMemAlloc` (CUDA 2.0's ABI, `PFN_cuMemAlloc_v2000` in
/// cudaTypedefs.h). cuda.h maps the name to `cuMemAlloc_v2` for code built
/// against it, but the driver still exports it, and `cuGetProcAddress`
/// hands it to a caller asking as CUDA before 3.2: a ctypes program that
/// names `cuMemAlloc` reaches it. Charged exactly as `cuMemAlloc_v2`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut CUdeviceptr_v1, bytesize: c_uint) -> CUresult {
    real!(let call = cuMemAlloc(dptr, bytesize) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        sized(devices::current(), dptr, bytesize.into(), call, free_now_v1)
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    real!(let call = cuMemAllocManaged(dptr, bytesize, flags) else CUDA_ERROR_NOT_INITIALIZED);
    // Charged in full, though managed memory may live on the host: a
    // container must not be able to page its neighbours out.
    guarded(call, |call| {
        sized(devices::current(), dptr, bytesize as u64, call, free_now)
    })
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CUresult {
    real!(let call = cuMemAllocPitch_v2(dptr, pitch, width, height, element_size)
        else CUDA_ERROR_NOT_INITIALIZED);
    let size = (width as u64, height as u64);
    let chosen = || written(pitch).map(|p| p as u64);
    guarded(call, |call| pitched(dptr, chosen, size, call, free_now))
}

/// The 32-bit-era `cuMemAllocPitch` (`PFN_cuMemAllocPitch_v2000`), reached
/// as `cuMemAlloc` is; charged as `cuMemAllocPitch_v2`.
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch(
    dptr: *mut CUdeviceptr_v1,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    element_size: c_uint,
) -> CUresult {
    real!(let call = cuMemAllocPitch(dptr, pitch, width, height, element_size)
        else CUDA_ERROR_NOT_INITIALIZED);
    let size = (width.into(), height.into());
    let chosen = || written(pitch).map(u64::from);
    guarded(call, |call| pitched(dptr, chosen, size, call, free_now_v1))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    real!(let call = cuMemFree_v2(dptr) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| free(&ALLOCATIONS, ops::shim, dptr, call))
}

/// The 32-bit-era `cuMemFree` (`PFN_cuMemFree_v2000`): gives back what a
/// 32-bit-era allocation was charged (either ABI's free finds it: the
/// record is by address).
#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemFree(dptr: CUdeviceptr_v1) -> CUresult {
    real!(let call = cuMemFree(dptr) else CUDA_ERROR_NOT_INITIALIZED);
    guarded(call, |call| {
        free(&ALLOCATIONS, ops::shim, dptr.into(), call)
    })
}

/// Stream-ordered allocations from the stream's device's pool: charged
/// like cuMemAlloc, keyed by pointer, but no context's (they outlive its
/// teardown).
macro_rules! alloc_async {
    ($name:ident, $free:expr) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytesize: usize,
            stream: CUstream,
        ) -> CUresult {
            real!(let call = $name(dptr, bytesize, stream) else CUDA_ERROR_NOT_INITIALIZED);
            // SAFETY: frees the allocation just made, on its stream.
            let undo = |ptr| unsafe { $free(ptr, stream) };
            guarded(call, |call| {
                sized(devices::of_stream(stream), dptr, bytesize as u64, call, undo)
            })
        }
    };
}
alloc_async!(cuMemAllocAsync, cuMemFreeAsync);
alloc_async!(cuMemAllocAsync_ptsz, cuMemFreeAsync_ptsz);

/// Allocations from an explicit pool: charged on the pool's device, which
/// need not be the current context's.
macro_rules! alloc_from_pool {
    ($name:ident, $free:expr) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(
            dptr: *mut CUdeviceptr,
            bytesize: usize,
            pool: CUmemoryPool,
            stream: CUstream,
        ) -> CUresult {
            real!(let call = $name(dptr, bytesize, pool, stream) else CUDA_ERROR_NOT_INITIALIZED);
            // SAFETY: frees the allocation just made, on its stream.
            let undo = |ptr| unsafe { $free(ptr, stream) };
            guarded(call, |call| {
                sized(pool::site(pool, stream), dptr, bytesize as u64, call, undo)
            })
        }
    };
}
alloc_from_pool!(cuMemAllocFromPoolAsync, cuMemFreeAsync);
alloc_from_pool!(cuMemAllocFromPoolAsync_ptsz, cuMemFreeAsync_ptsz);

macro_rules! free_async {
    ($name:ident) => {
        #[cfg_attr(not(test), no_mangle)]
        pub unsafe extern "C" fn $name(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
            real!(let call = $name(dptr, stream) else CUDA_ERROR_NOT_INITIALIZED);
            guarded(call, |call| free(&ALLOCATIONS, ops::shim, dptr, call))
        }
    };
}
free_async!(cuMemFreeAsync);
free_async!(cuMemFreeAsync_ptsz);

/// The current device's (free, total) as the container sees it, in place
/// of what the driver just wrote. Inlined into the hook: frameworks ask
/// before large allocations, and out of line it cost the query a call and
/// moved code on the allocation path (callgrind, `cargo bench --bench shim`).
#[inline]
fn report_info(free: *mut usize, total: *mut usize) {
    let (Some(real_free), Some(real_total)) = (written(free), written(total)) else {
        return;
    };
    let Some(Site { shim, dev, .. }) = devices::current() else {
        return;
    };
    let (f, t) = shim.cuda_info(dev, real_free as u64, real_total as u64);
    // SAFETY: both pointers were just written by the driver.
    unsafe {
        *free = f as usize;
        *total = t as usize;
    }
}

/// The cap as device `dev`'s total, in place of what the driver just wrote.
fn report_total(bytes: *mut usize, dev: CUdevice) {
    let Some(real_total) = written(bytes) else {
        return;
    };
    let Some((shim, d)) = devices::at(dev) else {
        return;
    };
    // SAFETY: the driver just wrote through `bytes`.
    unsafe { *bytes = shim.cap(d).min(real_total as u64) as usize };
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    real!(let call = cuMemGetInfo_v2(free, total) else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || report_info(free, total))
}

#[cfg_attr(not(test), no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    real!(let call = cuDeviceTotalMem_v2(bytes, dev) else CUDA_ERROR_NOT_INITIALIZED);
    answered(call, CUDA_SUCCESS, || report_total(bytes, dev))
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    const MIB: u64 = 1 << 20;
    const BASE: u64 = 0x7f00_0000_0000;
    const MADE: fn() -> CUresult = || CUDA_SUCCESS;
    const UNDONE: fn(u64) -> CUresult = |_| CUDA_SUCCESS;

    /// What the allocation path does with the driver's answer `placed`.
    fn allocate_at(
        table: &Allocations,
        shim: &'static Shim,
        estimate: u64,
        placed: (u64, u64),
    ) -> CUresult {
        let site = Site {
            shim,
            dev: 0,
            ctx: 1,
        };
        allocate(table, site, estimate, MADE, || Some(placed), UNDONE)
    }

    /// An 8 MiB allocation placed 1 MiB into a chunk covers five, more than
    /// the four it was charged for up front, and does not fit: it is refused
    /// after ~5 ms of retries. A 4 KiB allocation lands in its last chunk
    /// meanwhile, finds the chunk in use and is charged nothing for it. The
    /// refused one must leave that chunk charged.
    #[test]
    fn a_refused_allocation_leaves_charged_the_chunk_another_entered() {
        let (table, shim) = (Allocations::new(), Shim::for_test(9 * MIB));
        shim.charge(0, 2 * MIB).unwrap(); // what the process holds already
        let (placed, wait) = mpsc::channel();
        std::thread::scope(|s| {
            let big = s.spawn(|| {
                let site = Site {
                    shim,
                    dev: 0,
                    ctx: 1,
                };
                let made = || {
                    placed.send(()).unwrap();
                    Some((BASE + MIB, 8 * MIB))
                };
                allocate(&table, site, MIB, MADE, made, UNDONE)
            });
            wait.recv().unwrap();
            std::thread::sleep(Duration::from_millis(1));
            let small = allocate_at(&table, shim, 4096, (BASE + 9 * MIB, 4096));
            assert_eq!(small, CUDA_SUCCESS);
            assert_eq!(big.join().unwrap(), CUDA_ERROR_OUT_OF_MEMORY);
        });
        assert_eq!(
            shim.own_charges(0),
            4 * MIB,
            "2 held and the small one's chunk"
        );
        assert_eq!(
            free(&table, || Some(shim), BASE + 9 * MIB, MADE),
            CUDA_SUCCESS
        );
        assert_eq!(shim.own_charges(0), 2 * MIB);
    }

    /// A free fails while another thread allocates in a chunk the freed
    /// allocation was the last in: the chunk is then charged to the other
    /// allocation, and the failed free's record, put back, must not be
    /// charged for it a second time.
    #[test]
    fn a_failed_free_does_not_charge_twice_a_chunk_another_entered() {
        let (table, shim) = (Allocations::new(), Shim::for_test(1 << 30));
        // 2 MiB at 1 MiB: the chunks at 0 and 2 MiB, shared.
        assert_eq!(
            allocate_at(&table, shim, 2 * MIB, (BASE + MIB, 2 * MIB)),
            CUDA_SUCCESS
        );
        assert_eq!(shim.own_charges(0), 4 * MIB);
        let failed = free(
            &table,
            || Some(shim),
            BASE + MIB,
            || {
                // Meanwhile, 4 KiB in the chunk at 2 MiB.
                assert_eq!(
                    allocate_at(&table, shim, 4096, (BASE + 3 * MIB, 4096)),
                    CUDA_SUCCESS
                );
                700 // CUDA_ERROR_ILLEGAL_ADDRESS: sticky, every free fails
            },
        );
        assert_eq!(failed, 700);
        assert_eq!(shim.own_charges(0), 4 * MIB, "both live, in two chunks");
        assert_eq!(
            free(&table, || Some(shim), BASE + 3 * MIB, MADE),
            CUDA_SUCCESS
        );
        assert_eq!(free(&table, || Some(shim), BASE + MIB, MADE), CUDA_SUCCESS);
        assert_eq!(shim.own_charges(0), 0);
    }

    /// An allocation at the address of one freed unseen (with its context)
    /// gives back what the old one held.
    #[test]
    fn an_allocation_at_a_reused_address_gives_back_the_stale_charge() {
        let (table, shim) = (Allocations::new(), Shim::for_test(1 << 30));
        assert_eq!(
            allocate_at(&table, shim, 64 * MIB, (BASE, 64 * MIB)),
            CUDA_SUCCESS
        );
        assert_eq!(
            allocate_at(&table, shim, 2 * MIB, (BASE, 2 * MIB)),
            CUDA_SUCCESS
        );
        assert_eq!(shim.own_charges(0), 2 * MIB);
    }

    /// A 32-bit-era allocation (`cuMemAlloc` before CUDA 3.2) is recorded
    /// at the address its 32-bit pointer holds, so either ABI's free gives
    /// it back; one undone is undone at that address, and only its 4 bytes
    /// are cleared.
    #[test]
    fn a_32_bit_era_allocation_is_charged_at_its_address_and_undone_in_its_width() {
        let shim = Shim::for_test(7 * MIB);
        let site = || {
            Some(Site {
                shim,
                dev: 0,
                ctx: 1,
            })
        };
        let write = |out: *mut CUdeviceptr_v1, at: u32| {
            move || {
                // SAFETY: a valid out-pointer on the test's stack.
                unsafe { *out = at };
                CUDA_SUCCESS
            }
        };
        let mut out: [CUdeviceptr_v1; 2] = [0, 0xdead];
        let dptr = out.as_mut_ptr();
        let made = sized(site(), dptr, 2 * MIB, write(dptr, 0x40_0000), UNDONE);
        assert_eq!((made, out[0]), (CUDA_SUCCESS, 0x40_0000));
        assert_eq!(shim.own_charges(0), 2 * MIB);
        // 4 MiB at 1 MiB covers three chunks: 8 MiB with the first, past
        // the 7 MiB cap.
        let undone = std::cell::Cell::new(0);
        let refused = sized(site(), dptr, 4 * MIB, write(dptr, 0x10_0000), |ptr| {
            undone.set(ptr);
            CUDA_SUCCESS
        });
        assert_eq!(refused, CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(undone.get(), 0x10_0000);
        assert_eq!(out, [0, 0xdead], "cleared in its own width");
        assert_eq!(shim.own_charges(0), 2 * MIB);
        let freed = free(&ALLOCATIONS, || Some(shim), 0x40_0000, MADE);
        assert_eq!((freed, shim.own_charges(0)), (CUDA_SUCCESS, 0));
    }

    /// A child forked while another thread of a process without an
    /// accounting file holds a shard lock in cuMemFree's logic passes its
    /// calls through instead of waiting for that lock forever. Run in a
    /// process of its own: any other test engages the shim's fork guard.
    #[test]
    fn a_child_forked_while_a_free_holds_a_shard_lock_passes_through() {
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args(["--exact", "--include-ignored", "--nocapture"])
            .arg("cuda::tests::forks_while_a_free_holds_a_shard_lock")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("1 passed"), "{text}");
    }

    #[test]
    #[ignore = "run in a process of its own by a_child_forked_while_a_free_holds_a_shard_lock_passes_through"]
    fn forks_while_a_free_holds_a_shard_lock() {
        let table = Allocations::new();
        let stop = std::sync::atomic::AtomicBool::new(false);
        let free_unseen = || guarded(MADE, |call| free(&table, || None, BASE, call));
        let hung = std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    free_unseen();
                }
            });
            std::thread::sleep(Duration::from_millis(5));
            let hung = (0..100)
                .filter(|_| {
                    // SAFETY: the child runs the hook's logic under an
                    // alarm and leaves with _exit.
                    let child = unsafe { libc::fork() };
                    if child == 0 {
                        // SAFETY: as above.
                        unsafe { libc::alarm(2) };
                        free_unseen();
                        // SAFETY: as above.
                        unsafe { libc::_exit(0) };
                    }
                    let mut status = 0;
                    // SAFETY: waits for our own child.
                    unsafe { libc::waitpid(child, &mut status, 0) };
                    libc::WIFSIGNALED(status)
                })
                .count();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            hung
        });
        assert_eq!(hung, 0, "children stuck on a lock the parent held at fork");
    }
}
