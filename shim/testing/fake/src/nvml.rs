//! NVML: devices by index or UUID, memory as a node daemon sees it (the
//! configured others plus every fake-driver process on the node), and the
//! per-process list. It keeps working in a forked child, as the real one does.
//! Health (events, row remapping, lost devices) is `health`'s.

use std::ffi::{c_char, c_uint, c_ulonglong, c_void, CStr};

use crate::{config, health, node, MIB};

pub(crate) type NvmlReturn = c_uint;
pub(crate) const NVML_SUCCESS: NvmlReturn = 0;
pub(crate) const NVML_INVALID_ARGUMENT: NvmlReturn = 2;
pub(crate) const NVML_NOT_SUPPORTED: NvmlReturn = 3;
const NVML_NOT_FOUND: NvmlReturn = 6;
const NVML_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub(crate) const NVML_TIMEOUT: NvmlReturn = 10;
pub(crate) const NVML_GPU_IS_LOST: NvmlReturn = 15;
pub(crate) const NVML_RESET_REQUIRED: NvmlReturn = 16;
pub(crate) const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

pub(crate) fn nvml_device(handle: *mut c_void) -> Option<usize> {
    (handle as usize)
        .checked_sub(1)
        .filter(|&d| d < config().uuids.len())
}

pub(crate) fn handle_of(dev: usize) -> *mut c_void {
    (dev + 1) as *mut c_void
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
    // SAFETY: checked non-null; an out-parameter, valid for writes (NVML's contract).
    unsafe { *count = config().uuids.len() as c_uint };
    NVML_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    handle: *mut *mut c_void,
) -> NvmlReturn {
    if handle.is_null() || index as usize >= config().uuids.len() {
        return NVML_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; an out-parameter, valid for writes (NVML's contract).
    unsafe { *handle = handle_of(index as usize) };
    NVML_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    handle: *mut *mut c_void,
) -> NvmlReturn {
    if uuid.is_null() || handle.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null; NVML takes a NUL-terminated UUID string.
    let uuid = unsafe { CStr::from_ptr(uuid) }.to_bytes();
    match config().uuids.iter().position(|u| u.as_bytes() == uuid) {
        Some(dev) => {
            // SAFETY: checked non-null; an out-parameter, valid for writes (NVML's contract).
            unsafe { *handle = handle_of(dev) };
            NVML_SUCCESS
        }
        None => NVML_NOT_FOUND,
    }
}

unsafe fn copy_string(text: &str, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    if buf.is_null() {
        return NVML_INVALID_ARGUMENT;
    }
    if text.len() + 1 > len as usize {
        return NVML_INSUFFICIENT_SIZE;
    }
    // SAFETY: `buf` is non-null and, by the caller's promise, `len` bytes,
    // which hold the text and its NUL (checked above).
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
        Some(d) if health::lost(d) => NVML_GPU_IS_LOST,
        // SAFETY: the caller's buffer of `len` bytes, as NVML's contract has it.
        Some(d) => unsafe { copy_string(&config().uuids[d], buf, len) },
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
        // SAFETY: the caller's buffer of `len` bytes, as NVML's contract has it.
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

/// The device a query is about, or the answer NVML gives instead: a bad
/// handle or out-pointer, or the device's health failure.
pub(crate) fn device_query<T>(handle: *mut c_void, out: *mut T) -> Result<usize, NvmlReturn> {
    let dev = nvml_device(handle).ok_or(NVML_INVALID_ARGUMENT)?;
    if out.is_null() {
        return Err(NVML_INVALID_ARGUMENT);
    }
    match health::query_error(dev) {
        Some(error) => Err(error),
        None => Ok(dev),
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    handle: *mut c_void,
    memory: *mut NvmlMemory,
) -> NvmlReturn {
    let dev = match device_query(handle, memory) {
        Ok(dev) => dev,
        Err(error) => return error,
    };
    let c = config();
    let used = c.nvml_used + c.nvml_reserved + node::used_by_processes(dev);
    // SAFETY: checked non-null; an out-parameter, valid for writes (NVML's contract).
    unsafe {
        *memory = NvmlMemory {
            total: c.memory,
            free: c.memory.saturating_sub(used),
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
    let dev = match device_query(handle, memory) {
        Ok(dev) => dev,
        Err(error) => return error,
    };
    let c = config();
    let used = c.nvml_used + node::used_by_processes(dev);
    // SAFETY: checked non-null; the caller's versioned struct, read and written.
    unsafe {
        let version = (*memory).version;
        *memory = NvmlMemoryV2 {
            version,
            total: c.memory,
            reserved: c.nvml_reserved,
            free: c.memory.saturating_sub(used + c.nvml_reserved),
            used,
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

/// `FAKEGPU_PROCESSES_FILE`'s processes on device `dev`: one
/// `PID USED_MIB [UUID]` per line (no UUID: the first device), read on every
/// call so a test can change it while a daemon polls.
fn listed_on(dev: usize) -> Vec<(u32, u64)> {
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
                Some(uuid) => config().uuids.iter().position(|u| u == uuid)?,
                None => 0,
            };
            (on == dev).then_some((pid, used * MIB))
        })
        .collect()
}

/// The node's processes, then the file's lines: a line for a PID already
/// listed says what the driver shows for it instead.
fn running_on(dev: usize) -> Vec<(u32, u64)> {
    let mut processes = node::processes(dev);
    for (pid, used) in listed_on(dev) {
        match processes.iter_mut().find(|p| p.0 == pid) {
            Some(p) => p.1 = used,
            None => processes.push((pid, used)),
        }
    }
    processes
}

/// The processes NVML lists on the device (see [`running_on`]).
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
    let processes = running_on(dev);
    // As the real one: the needed count comes back with INSUFFICIENT_SIZE.
    // SAFETY: checked non-null; an in/out parameter (NVML's contract).
    let room = unsafe { *count } as usize;
    // SAFETY: checked non-null; an out-parameter, valid for writes (NVML's contract).
    unsafe { *count = processes.len() as c_uint };
    if processes.len() > room || (infos.is_null() && !processes.is_empty()) {
        return NVML_INSUFFICIENT_SIZE;
    }
    for (i, (pid, used)) in processes.into_iter().enumerate() {
        // SAFETY: `infos` holds `room` entries (NVML's contract) and `i` is
        // below `processes.len() <= room`; null only with no processes.
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

/// A sensor reading from the environment (`FAKEGPU_UTILIZATION_PERCENT`,
/// `FAKEGPU_TEMPERATURE_C`, `FAKEGPU_POWER_MW`,
/// `FAKEGPU_PROCESS_SM_PERCENT`): unset, the board does not support it, as
/// some do not.
fn reading(name: &str) -> Result<c_uint, NvmlReturn> {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or(NVML_NOT_SUPPORTED)
}

/// Writes `value` through a checked out-parameter.
unsafe fn answer<T>(out: *mut T, value: Result<T, NvmlReturn>) -> NvmlReturn {
    match value {
        // SAFETY: the caller checked `out` non-null (device_query); an
        // out-parameter, valid for writes (NVML's contract).
        Ok(value) => unsafe {
            out.write(value);
            NVML_SUCCESS
        },
        Err(error) => error,
    }
}

#[repr(C)]
pub struct NvmlUtilization {
    gpu: c_uint,
    memory: c_uint,
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    handle: *mut c_void,
    utilization: *mut NvmlUtilization,
) -> NvmlReturn {
    if let Err(error) = device_query(handle, utilization) {
        return error;
    }
    let value =
        reading("FAKEGPU_UTILIZATION_PERCENT").map(|gpu| NvmlUtilization { gpu, memory: 0 });
    // SAFETY: `utilization` checked non-null by device_query.
    unsafe { answer(utilization, value) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    handle: *mut c_void,
    _sensor: c_uint,
    celsius: *mut c_uint,
) -> NvmlReturn {
    if let Err(error) = device_query(handle, celsius) {
        return error;
    }
    // SAFETY: `celsius` checked non-null by device_query.
    unsafe { answer(celsius, reading("FAKEGPU_TEMPERATURE_C")) }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    handle: *mut c_void,
    milliwatts: *mut c_uint,
) -> NvmlReturn {
    if let Err(error) = device_query(handle, milliwatts) {
        return error;
    }
    // SAFETY: `milliwatts` checked non-null by device_query.
    unsafe { answer(milliwatts, reading("FAKEGPU_POWER_MW")) }
}

#[repr(C)]
pub struct NvmlProcessUtilizationSample {
    pid: c_uint,
    time_stamp: c_ulonglong,
    sm_util: c_uint,
    mem_util: c_uint,
    enc_util: c_uint,
    dec_util: c_uint,
}

/// One sample per process NVML lists on the device, each at
/// `FAKEGPU_PROCESS_SM_PERCENT` of the SMs; NOT_FOUND with none, as the
/// real one answers an idle GPU.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    handle: *mut c_void,
    samples: *mut NvmlProcessUtilizationSample,
    count: *mut c_uint,
    _last_seen: c_ulonglong,
) -> NvmlReturn {
    let dev = match device_query(handle, count) {
        Ok(dev) => dev,
        Err(error) => return error,
    };
    let sm = match reading("FAKEGPU_PROCESS_SM_PERCENT") {
        Ok(sm) => sm,
        Err(error) => return error,
    };
    let processes = running_on(dev);
    if processes.is_empty() {
        return NVML_NOT_FOUND;
    }
    // As the real one: the needed count comes back with INSUFFICIENT_SIZE.
    // SAFETY: checked non-null by device_query; an in/out parameter.
    let room = unsafe { *count } as usize;
    // SAFETY: as above.
    unsafe { *count = processes.len() as c_uint };
    if samples.is_null() || processes.len() > room {
        return NVML_INSUFFICIENT_SIZE;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64);
    for (i, (pid, _)) in processes.into_iter().enumerate() {
        // SAFETY: `samples` holds `room` entries (NVML's contract) and `i`
        // is below `processes.len() <= room`.
        unsafe {
            samples.add(i).write(NvmlProcessUtilizationSample {
                pid,
                time_stamp: now,
                sm_util: sm,
                mem_util: 0,
                enc_util: 0,
                dec_util: 0,
            })
        };
    }
    NVML_SUCCESS
}
