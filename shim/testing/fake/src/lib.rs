//! A fake NVIDIA driver for tests without a GPU: copied to `libcuda.so.1`
//! and `libnvidia-ml.so.1`, it exports the CUDA driver and NVML entry points
//! gpumem's shim touches and models what a real H100 (driver 580) was
//! measured to do, so the shim's accounting can be checked against it:
//!
//! - contexts (primary and created) take `FAKEGPU_CONTEXT_MIB` each at once;
//!   destroying one frees it and every allocation and array made in it;
//! - allocations of 2 MiB or more take whole 2 MiB pages; smaller ones are
//!   sub-allocated from 2 MiB chunks (one open chunk per thread and device)
//!   that are given back when their last allocation is freed; the
//!   32-bit-era `cuMemAlloc`/`cuMemAllocPitch` (before CUDA 3.2, by name or
//!   through `cuGetProcAddress`) take whole pages below 4 GiB, so their
//!   `unsigned int` pointer is the whole address (a model: what a real
//!   driver does with them in a 64-bit process was never measured);
//! - VMM handles hold their memory until released AND unmapped; arrays take
//!   what `array::bytes` says; pools allocate on their own device (host
//!   pools on none, managed pools that prefer nothing on the stream's);
//!   stream-ordered memory comes from the stream's device;
//! - a larger per-thread stack (`cuCtxSetLimit`, or a launch of a fake
//!   kernel, whose handle is the stack it needs) is reserved for 65536
//!   threads at once;
//! - memory runs out at the device's size, counting every process that shares
//!   `FAKEGPU_NODE_FILE`, and NVML lists those processes by PID (the NVML
//!   copy asks the `libcuda.so.1` copy for this process's usage through
//!   `fakegpu_process_usage`, the one export no driver has);
//! - in a child forked after `cuInit`, every CUDA call returns NOT_INITIALIZED;
//! - `cuGetProcAddress[_v2]` hands out distinct per-variant pointers
//!   (including `_ptsz` ones) for the version the caller asks for.
//!
//! Configuration (env): `FAKEGPU_UUIDS` (comma-separated, default one T4, at
//! most 16 used), `FAKEGPU_MEMORY_MIB` (per device, default 15079),
//! `FAKEGPU_CONTEXT_MIB` (per context, default 300), `FAKEGPU_NVML_USED_MIB`
//! (what NVML reports as used by others, default 300),
//! `FAKEGPU_NVML_RESERVED_MIB` (default 200), `FAKEGPU_PROCESSES_FILE`
//! (`PID USED_MIB [UUID]` lines that `nvmlDeviceGetComputeRunningProcesses_v3`
//! adds, or puts in place of its own entry for that PID), `FAKEGPU_NODE_FILE`
//! (a file the fake drivers of one test share as the node-wide view; without
//! it the node is this process alone), `FAKEGPU_HEALTH_FILE` (XID events, row
//! remapping, page retirement and failing devices as NVML reports them; see
//! `health`), `FAKEGPU_MEMORY_REPAIR` (`retirement`: pre-Ampere devices that
//! retire pages; default: devices that remap rows, as A100 and H100) and
//! `FAKEGPU_NO_STREAM_GET_DEVICE` (a driver before CUDA 12.8). Test-only
//! knobs for timing windows: `FAKEGPU_PITCH_VIA_EXPORT`,
//! `FAKEGPU_GET_STATE_DELAY_MS`, `FAKEGPU_CONTEXT_DELAY_MS` (see `Config`).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_int, c_ulonglong, c_void};
use std::sync::OnceLock;

/// Every CUDA entry point starts with this (see `fork`).
macro_rules! refuse_after_fork {
    () => {
        if crate::fork::poisoned() {
            return crate::NOT_INITIALIZED;
        }
    };
}

mod array;
mod context;
mod device;
mod fork;
mod health;
mod memory;
mod node;
mod nvml;
mod pool;
mod proc_address;
mod stream;
mod vmm;

type CUresult = c_int;
type CUdevice = c_int;
type CUdeviceptr = c_ulonglong;
type CUcontext = *mut c_void;

const SUCCESS: CUresult = 0;
const INVALID_VALUE: CUresult = 1;
const OUT_OF_MEMORY: CUresult = 2;
const NOT_INITIALIZED: CUresult = 3;
const INVALID_DEVICE: CUresult = 101;
const INVALID_CONTEXT: CUresult = 201;
const UNSUPPORTED_LIMIT: CUresult = 215;
const INVALID_HANDLE: CUresult = 400;
const NOT_FOUND: CUresult = 500;
const NOT_SUPPORTED: CUresult = 801;

const MIB: u64 = 1 << 20;
/// The real driver's page and sub-allocation chunk size, and the VMM granularity.
const PAGE: u64 = 2 * MIB;
const T4_UUID: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";

struct Config {
    uuids: Vec<String>,
    memory: u64,
    context: u64,
    nvml_used: u64,
    nvml_reserved: u64,
    /// `FAKEGPU_PITCH_VIA_EXPORT`: `cuMemAllocPitch_v2` allocates through
    /// the process's `cuMemAlloc_v2` symbol (memory.rs).
    pitch_via_export: bool,
    /// `FAKEGPU_GET_STATE_DELAY_MS`: `cuDevicePrimaryCtxGetState` answers
    /// this late, to open the window between a retain's look at the
    /// primary context and its real call.
    get_state_delay: std::time::Duration,
    /// `FAKEGPU_CONTEXT_DELAY_MS`: a context takes its memory this long
    /// before the call that makes it returns (~110 ms on an H100).
    context_delay: std::time::Duration,
    /// `FAKEGPU_NO_STREAM_GET_DEVICE`: `cuStreamGetDevice` answers as a
    /// driver before CUDA 12.8 would, by not being there (stream.rs).
    no_stream_get_device: bool,
}

fn env_mib(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
        * MIB
}

fn env_ms(name: &str) -> std::time::Duration {
    std::time::Duration::from_millis(
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    )
}

fn config() -> &'static Config {
    static CONFIG: OnceLock<Config> = OnceLock::new();
    CONFIG.get_or_init(|| Config {
        uuids: std::env::var("FAKEGPU_UUIDS")
            .unwrap_or_else(|_| T4_UUID.to_owned())
            .split(',')
            .take(node::MAX_DEVICES)
            .map(str::to_owned)
            .collect(),
        memory: env_mib("FAKEGPU_MEMORY_MIB", 15079),
        context: env_mib("FAKEGPU_CONTEXT_MIB", 300),
        nvml_used: env_mib("FAKEGPU_NVML_USED_MIB", 300),
        nvml_reserved: env_mib("FAKEGPU_NVML_RESERVED_MIB", 200),
        pitch_via_export: std::env::var_os("FAKEGPU_PITCH_VIA_EXPORT").is_some(),
        get_state_delay: env_ms("FAKEGPU_GET_STATE_DELAY_MS"),
        context_delay: env_ms("FAKEGPU_CONTEXT_DELAY_MS"),
        no_stream_get_device: std::env::var_os("FAKEGPU_NO_STREAM_GET_DEVICE").is_some(),
    })
}

/// The device index for a CUDA ordinal, if there is such a device.
fn device(ordinal: CUdevice) -> Option<usize> {
    usize::try_from(ordinal)
        .ok()
        .filter(|&d| d < config().uuids.len())
}

unsafe fn out<T>(ptr: *mut T, value: T) -> CUresult {
    if ptr.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: callers pass an out-parameter, which the driver API requires
    // to be valid for writes of a `T` unless it is null, refused above.
    unsafe { *ptr = value };
    SUCCESS
}
