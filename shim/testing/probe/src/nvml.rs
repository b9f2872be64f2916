//! NVML as a node daemon or nvidia-smi reads it: device memory, and the
//! processes each device lists. Needs no CUDA.

use std::ffi::{c_uint, c_ulonglong, c_void};

use crate::cuda::{cast, open, sym};
use crate::fail;

const INSUFFICIENT_SIZE: c_uint = 7;

#[repr(C)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
struct NvmlMemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used: c_ulonglong,
    gpu_instance: c_uint,
    compute_instance: c_uint,
}

fn library() -> *mut c_void {
    let lib = open("libnvidia-ml.so.1");
    // SAFETY: nvmlInit_v2's signature.
    unsafe {
        let init: unsafe extern "C" fn() -> c_uint = cast(sym(lib, "nvmlInit_v2"));
        init();
    }
    lib
}

/// A device's memory through both `nvmlDeviceGetMemoryInfo` versions, as
/// `nvml[:INDEX] R …` and `nvml2[:INDEX] R …` (no index for device 0).
pub fn memory(index: c_uint) {
    let suffix = if index == 0 {
        String::new()
    } else {
        format!(":{index}")
    };
    let lib = library();
    // SAFETY: documented NVML signatures.
    unsafe {
        let by_index: unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetHandleByIndex_v2"));
        let v1: unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetMemoryInfo"));
        let v2: unsafe extern "C" fn(*mut c_void, *mut NvmlMemoryV2) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetMemoryInfo_v2"));
        let mut dev = std::ptr::null_mut();
        by_index(index, &mut dev);
        let mut m = NvmlMemory {
            total: 0,
            free: 0,
            used: 0,
        };
        let r = v1(dev, &mut m);
        println!(
            "nvml{suffix} {r} total={} used={} free={}",
            m.total, m.used, m.free
        );
        let mut m = NvmlMemoryV2 {
            version: (std::mem::size_of::<NvmlMemoryV2>() | 2 << 24) as c_uint,
            total: 0,
            reserved: 0,
            free: 0,
            used: 0,
        };
        let r = v2(dev, &mut m);
        println!(
            "nvml2{suffix} {r} total={} reserved={} used={} free={}",
            m.total, m.reserved, m.used, m.free
        );
    }
}

/// Every device's process list: `procs dev=D count=N sum=BYTES list=PID:BYTES,...`.
pub fn processes() {
    let lib = library();
    // SAFETY: documented NVML signatures; `infos` has room for `room` entries.
    unsafe {
        let count: unsafe extern "C" fn(*mut c_uint) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetCount_v2"));
        let by_index: unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetHandleByIndex_v2"));
        let running: unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut ProcessInfo) -> c_uint =
            cast(sym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
        let mut devices = 0;
        let r = count(&mut devices);
        if r != 0 {
            fail(&format!("nvmlDeviceGetCount_v2: {r}"));
        }
        for d in 0..devices {
            let mut dev = std::ptr::null_mut();
            let r = by_index(d, &mut dev);
            if r != 0 {
                fail(&format!("nvmlDeviceGetHandleByIndex_v2 {d}: {r}"));
            }
            // Ask with the room the last answer said was needed, until it fits.
            let mut infos: Vec<ProcessInfo> = Vec::new();
            loop {
                let mut room = infos.len() as c_uint;
                match running(dev, &mut room, infos.as_mut_ptr()) {
                    0 => {
                        infos.truncate(room as usize);
                        break;
                    }
                    INSUFFICIENT_SIZE => {
                        let room = (room as usize).max(infos.len() + 1);
                        infos.resize(room, ProcessInfo::default());
                    }
                    r => fail(&format!("nvmlDeviceGetComputeRunningProcesses_v3 {d}: {r}")),
                }
            }
            let sum: u64 = infos.iter().map(|p| p.used).sum();
            let list: Vec<String> = infos
                .iter()
                .map(|p| format!("{}:{}", p.pid, p.used))
                .collect();
            println!(
                "procs dev={d} count={} sum={sum} list={}",
                infos.len(),
                list.join(",")
            );
        }
    }
}
