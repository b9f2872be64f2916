//! A fake NVIDIA driver for tests without a GPU: copied to `libcuda.so.1`
//! and `libnvidia-ml.so.1`, it exports the CUDA driver and NVML entry points
//! gpumem's shim touches, behaving like the real ones where the shim can
//! tell: `cuGetProcAddress[_v2]` hands out distinct per-variant pointers
//! (including `_ptsz` ones), allocations are rounded to 2 MiB pages, and
//! memory runs out at the device's size.
//!
//! Configuration (env): `FAKEGPU_UUIDS` (comma-separated, default one T4),
//! `FAKEGPU_MEMORY_MIB` (default 15079), `FAKEGPU_NVML_USED_MIB` (what NVML
//! reports as used by others, default 300), `FAKEGPU_NVML_RESERVED_MIB`
//! (default 200), `FAKEGPU_PROCESSES_FILE` (per-process usage for
//! `nvmlDeviceGetComputeRunningProcesses_v3`: `PID USED_MIB [UUID]` lines).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

type CUresult = c_int;
type CUdevice = c_int;
type CUdeviceptr = c_ulonglong;
type CUcontext = *mut c_void;

const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const NOT_FOUND: CUresult = 500;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 2 * MIB;
const T4_UUID: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";

struct Node {
    uuids: Vec<String>,
    memory: u64,
    nvml_used: u64,
    nvml_reserved: u64,
    used: Vec<AtomicU64>,
    /// Live allocations, sharded by address so that threads allocating at
    /// once contend in the shim (what the benchmarks measure), not here.
    allocations: [Mutex<HashMap<u64, (usize, u64)>>; SHARDS],
    next: AtomicU64,
}

fn env_mib(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        * MIB
}

fn node() -> &'static Node {
    static NODE: OnceLock<Node> = OnceLock::new();
    NODE.get_or_init(|| {
        let uuids: Vec<String> = std::env::var("FAKEGPU_UUIDS")
            .unwrap_or_else(|_| T4_UUID.to_owned())
            .split(',')
            .map(str::to_owned)
            .collect();
        Node {
            used: uuids.iter().map(|_| AtomicU64::new(0)).collect(),
            uuids,
            memory: env_mib("FAKEGPU_MEMORY_MIB", 15079),
            nvml_used: env_mib("FAKEGPU_NVML_USED_MIB", 300),
            nvml_reserved: env_mib("FAKEGPU_NVML_RESERVED_MIB", 200),
            allocations: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            next: AtomicU64::new(0x7f00_0000_0000),
        }
    })
}

thread_local! {
    /// The calling thread's current context: device ordinal + 1, 0 for none.
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn current() -> Option<usize> {
    CURRENT.with(|c| c.get().checked_sub(1))
}

fn device(ordinal: CUdevice) -> Option<usize> {
    usize::try_from(ordinal)
        .ok()
        .filter(|&d| d < node().uuids.len())
}

/// What the real driver takes for `size` bytes (see SHIM_NOTES §8).
fn physical(size: u64) -> u64 {
    if size > PAGE {
        size.div_ceil(PAGE) * PAGE
    } else {
        size.div_ceil(64 << 10) * (64 << 10)
    }
}

const SHARDS: usize = 64;

/// The shard of live allocations that holds `address` (addresses are 2 MiB apart).
fn allocations_at(address: u64) -> std::sync::MutexGuard<'static, HashMap<u64, (usize, u64)>> {
    let shard = &node().allocations[(address >> 21) as usize % SHARDS];
    shard.lock().unwrap_or_else(|e| e.into_inner())
}

fn allocate(dev: usize, size: u64, on_device: bool) -> Result<u64, CUresult> {
    let n = node();
    if size == 0 {
        return Err(INVALID_VALUE);
    }
    let cost = if on_device { physical(size) } else { 0 };
    let used = &n.used[dev];
    if used.fetch_add(cost, Ordering::SeqCst) + cost > n.memory {
        used.fetch_sub(cost, Ordering::SeqCst);
        return Err(OUT_OF_MEMORY);
    }
    let address = n.next.fetch_add(physical(size).max(PAGE), Ordering::SeqCst);
    allocations_at(address).insert(address, (dev, cost));
    Ok(address)
}

fn release(address: u64) -> CUresult {
    match allocations_at(address).remove(&address) {
        Some((dev, cost)) => {
            node().used[dev].fetch_sub(cost, Ordering::SeqCst);
            SUCCESS
        }
        None => INVALID_VALUE,
    }
}

unsafe fn out<T>(ptr: *mut T, value: T) -> CUresult {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    unsafe { *ptr = value };
    SUCCESS
}

fn alloc_current(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    let Some(dev) = current() else {
        return INVALID_CONTEXT;
    };
    if dptr.is_null() {
        return INVALID_VALUE;
    }
    match allocate(dev, size as u64, true) {
        Ok(address) => unsafe { out(dptr, address) },
        Err(code) => code,
    }
}

// ---- CUDA driver API ----

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    unsafe { out(version, 13000) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    unsafe { out(count, node().uuids.len() as c_int) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut CUdevice, ordinal: c_int) -> CUresult {
    match device(ordinal) {
        Some(d) => unsafe { out(dev, d as CUdevice) },
        None => INVALID_DEVICE,
    }
}

unsafe fn uuid_of(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    let Some(d) = device(dev) else {
        return INVALID_DEVICE;
    };
    match gpumem_layout::parse_uuid(&node().uuids[d]) {
        Some(raw) => unsafe { out(uuid, raw) },
        None => INVALID_VALUE,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    unsafe { uuid_of(uuid, dev) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) -> CUresult {
    unsafe { uuid_of(uuid, dev) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    match device(dev) {
        Some(_) => unsafe { out(bytes, node().memory as usize) },
        None => INVALID_DEVICE,
    }
}

fn make_current(pctx: *mut CUcontext, dev: CUdevice, set: bool) -> CUresult {
    let Some(d) = device(dev) else {
        return INVALID_DEVICE;
    };
    if set {
        CURRENT.with(|c| c.set(d + 1));
    }
    unsafe { out(pctx, (d + 1) as CUcontext) }
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    make_current(pctx, dev, false)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(
    pctx: *mut CUcontext,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    make_current(pctx, dev, true)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut CUcontext,
    _params: *mut c_void,
    _n: c_int,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    make_current(pctx, dev, true)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut CUcontext,
    _params: *mut c_void,
    _flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    make_current(pctx, dev, true)
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    let d = ctx as usize;
    if d > node().uuids.len() {
        return INVALID_CONTEXT;
    }
    CURRENT.with(|c| c.set(d));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    match current() {
        Some(d) => unsafe { out(dev, d as CUdevice) },
        None => INVALID_CONTEXT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) -> CUresult {
    alloc_current(dptr, size)
}

/// The 32-bit-era `cuMemAlloc` (v1 ABI): exported as the real driver does;
/// the shim must never treat it as the v2 function.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut c_uint, size: c_uint) -> CUresult {
    let mut wide: CUdeviceptr = 0;
    let r = alloc_current(&mut wide, size as usize);
    if r == SUCCESS {
        unsafe { *dptr = wide as c_uint };
    }
    r
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
    let r = alloc_current(dptr, p * height);
    if r == SUCCESS {
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
    release(dptr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    _s: *mut c_void,
) -> CUresult {
    alloc_current(dptr, size)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    _s: *mut c_void,
) -> CUresult {
    alloc_current(dptr, size)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync(
    dptr: *mut CUdeviceptr,
    size: usize,
    _pool: *mut c_void,
    _s: *mut c_void,
) -> CUresult {
    alloc_current(dptr, size)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocFromPoolAsync_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    _pool: *mut c_void,
    _s: *mut c_void,
) -> CUresult {
    alloc_current(dptr, size)
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, _s: *mut c_void) -> CUresult {
    release(dptr)
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, _s: *mut c_void) -> CUresult {
    release(dptr)
}

#[repr(C)]
pub struct CUmemAllocationProp {
    type_: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}

#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut c_ulonglong,
    size: usize,
    prop: *const CUmemAllocationProp,
    _flags: c_ulonglong,
) -> CUresult {
    if prop.is_null() || handle.is_null() || !(size as u64).is_multiple_of(PAGE) {
        return INVALID_VALUE;
    }
    let prop = unsafe { &*prop };
    let on_device = prop.location_type == 1;
    let dev = if on_device {
        match device(prop.location_id) {
            Some(d) => d,
            None => return INVALID_DEVICE,
        }
    } else {
        0
    };
    match allocate(dev, size as u64, on_device) {
        Ok(h) => unsafe { out(handle, h) },
        Err(code) => code,
    }
}

#[no_mangle]
pub extern "C" fn cuMemRelease(handle: c_ulonglong) -> CUresult {
    release(handle)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let Some(dev) = current() else {
        return INVALID_CONTEXT;
    };
    if free.is_null() || total.is_null() {
        return INVALID_VALUE;
    }
    let n = node();
    unsafe {
        *total = n.memory as usize;
        *free = (n.memory - n.used[dev].load(Ordering::SeqCst)) as usize;
    }
    SUCCESS
}

/// Like the real driver: base names map to the variant the caller's CUDA
/// version expects; the per-thread-stream flag selects `_ptsz` variants.
fn lookup(symbol: &[u8], version: c_int, flags: c_ulonglong) -> Option<*mut c_void> {
    let ptsz = flags & 2 != 0;
    let f: *const () = match symbol {
        b"cuInit" => cuInit as *const (),
        b"cuDriverGetVersion" => cuDriverGetVersion as *const (),
        b"cuDeviceGet" => cuDeviceGet as *const (),
        b"cuDeviceGetCount" => cuDeviceGetCount as *const (),
        b"cuDeviceGetUuid" if version >= 11040 => cuDeviceGetUuid_v2 as *const (),
        b"cuDeviceGetUuid" => cuDeviceGetUuid as *const (),
        b"cuDeviceTotalMem" if version >= 3020 => cuDeviceTotalMem_v2 as *const (),
        b"cuDevicePrimaryCtxRetain" => cuDevicePrimaryCtxRetain as *const (),
        b"cuCtxCreate" if version >= 13000 => cuCtxCreate_v4 as *const (),
        b"cuCtxCreate" => cuCtxCreate_v2 as *const (),
        b"cuCtxSetCurrent" => cuCtxSetCurrent as *const (),
        b"cuCtxGetDevice" => cuCtxGetDevice as *const (),
        b"cuMemAlloc" if version >= 3020 => cuMemAlloc_v2 as *const (),
        b"cuMemAlloc" => cuMemAlloc as *const (),
        b"cuMemAllocPitch" => cuMemAllocPitch_v2 as *const (),
        b"cuMemAllocManaged" => cuMemAllocManaged as *const (),
        b"cuMemFree" => cuMemFree_v2 as *const (),
        b"cuMemAllocAsync" if ptsz => cuMemAllocAsync_ptsz as *const (),
        b"cuMemAllocAsync" => cuMemAllocAsync as *const (),
        b"cuMemAllocFromPoolAsync" if ptsz => cuMemAllocFromPoolAsync_ptsz as *const (),
        b"cuMemAllocFromPoolAsync" => cuMemAllocFromPoolAsync as *const (),
        b"cuMemFreeAsync" if ptsz => cuMemFreeAsync_ptsz as *const (),
        b"cuMemFreeAsync" => cuMemFreeAsync as *const (),
        b"cuMemCreate" => cuMemCreate as *const (),
        b"cuMemRelease" => cuMemRelease as *const (),
        b"cuMemGetInfo" => cuMemGetInfo_v2 as *const (),
        b"cuGetProcAddress" if version >= 12000 => cuGetProcAddress_v2 as *const (),
        b"cuGetProcAddress" => cuGetProcAddress as *const (),
        _ => return None,
    };
    Some(f as *mut c_void)
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
) -> CUresult {
    if symbol.is_null() || pfn.is_null() {
        return INVALID_VALUE;
    }
    match lookup(unsafe { CStr::from_ptr(symbol) }.to_bytes(), version, flags) {
        Some(f) => unsafe { out(pfn, f) },
        None => {
            unsafe { *pfn = std::ptr::null_mut() };
            NOT_FOUND
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: c_ulonglong,
    status: *mut c_int,
) -> CUresult {
    let r = unsafe { cuGetProcAddress(symbol, pfn, version, flags) };
    if !status.is_null() {
        // CU_GET_PROC_ADDRESS_SUCCESS = 0, SYMBOL_NOT_FOUND = 1.
        unsafe { *status = if r == SUCCESS { 0 } else { 1 } };
    }
    r
}

// ---- NVML ----

type NvmlReturn = c_uint;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_INVALID_ARGUMENT: NvmlReturn = 2;
const NVML_INSUFFICIENT_SIZE: NvmlReturn = 7;

fn nvml_device(handle: *mut c_void) -> Option<usize> {
    (handle as usize)
        .checked_sub(1)
        .filter(|&d| d < node().uuids.len())
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    NVML_SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    NVML_SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    NVML_SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlErrorString(_result: NvmlReturn) -> *const c_char {
    c"fake NVML error".as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    if count.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    unsafe { *count = node().uuids.len() as c_uint };
    NVML_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    handle: *mut *mut c_void,
) -> NvmlReturn {
    if handle.is_null() || index as usize >= node().uuids.len() {
        return NVML_INVALID_ARGUMENT;
    }
    unsafe { *handle = (index as usize + 1) as *mut c_void };
    NVML_SUCCESS
}

unsafe fn copy_string(text: &str, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    if buf.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    if text.len() + 1 > len as usize {
        return NVML_INSUFFICIENT_SIZE;
    }
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast(), text.len());
        *buf.add(text.len()) = 0;
    }
    NVML_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    handle: *mut c_void,
    buf: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    match nvml_device(handle) {
        Some(d) => unsafe { copy_string(&node().uuids[d], buf, len) },
        None => NVML_INVALID_ARGUMENT,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    handle: *mut c_void,
    buf: *mut c_char,
    len: c_uint,
) -> NvmlReturn {
    match nvml_device(handle) {
        Some(_) => unsafe { copy_string("Tesla T4", buf, len) },
        None => NVML_INVALID_ARGUMENT,
    }
}

#[repr(C)]
pub struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct NvmlMemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    handle: *mut c_void,
    memory: *mut NvmlMemory,
) -> NvmlReturn {
    if nvml_device(handle).is_none() || memory.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    let n = node();
    let used = n.nvml_used + n.nvml_reserved;
    unsafe {
        *memory = NvmlMemory {
            total: n.memory,
            free: n.memory - used,
            used,
        }
    };
    NVML_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    handle: *mut c_void,
    memory: *mut NvmlMemoryV2,
) -> NvmlReturn {
    if nvml_device(handle).is_none() || memory.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    let n = node();
    unsafe {
        let version = (*memory).version;
        *memory = NvmlMemoryV2 {
            version,
            total: n.memory,
            reserved: n.nvml_reserved,
            free: n.memory - n.nvml_used - n.nvml_reserved,
            used: n.nvml_used,
        }
    };
    NVML_SUCCESS
}

#[repr(C)]
pub struct NvmlProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// The processes `FAKEGPU_PROCESSES_FILE` lists on device `dev`: one
/// `PID USED_MIB [UUID]` per line (no UUID: the first device), read on every
/// call so a test can change it while a daemon polls.
fn processes_on(dev: usize) -> Vec<(u32, u64)> {
    let Some(path) = std::env::var_os("FAKEGPU_PROCESSES_FILE") else {
        return Vec::new();
    };
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let pid = words.next()?.parse().ok()?;
            let used = words.next()?.parse::<u64>().ok()?;
            let on = match words.next() {
                Some(uuid) => node().uuids.iter().position(|u| u == uuid)?,
                None => 0,
            };
            (on == dev).then_some((pid, used * MIB))
        })
        .collect()
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    handle: *mut c_void,
    count: *mut c_uint,
    infos: *mut NvmlProcessInfo,
) -> NvmlReturn {
    let Some(dev) = nvml_device(handle) else {
        return NVML_INVALID_ARGUMENT;
    };
    if count.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    let processes = processes_on(dev);
    // As the real one: the needed count comes back with INSUFFICIENT_SIZE.
    let room = unsafe { *count } as usize;
    unsafe { *count = processes.len() as c_uint };
    if processes.len() > room || (infos.is_null() && !processes.is_empty()) {
        return NVML_INSUFFICIENT_SIZE;
    }
    for (i, (pid, used)) in processes.into_iter().enumerate() {
        unsafe {
            infos.add(i).write(NvmlProcessInfo {
                pid,
                used_gpu_memory: used,
                gpu_instance_id: u32::MAX,
                compute_instance_id: u32::MAX,
            })
        };
    }
    NVML_SUCCESS
}
