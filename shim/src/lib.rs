//! libgpumem_shim.so: preloaded into every process of a capped container,
//! it holds all of them together to the container's GPU memory cap.
//!
//! Entry points: `dlsym` (how nvidia-smi, pynvml and the CUDA runtime find
//! NVML and the driver), `cuGetProcAddress[_v2]` (how the runtime finds each
//! driver function), and the hooked functions themselves for programs linked
//! directly. Hooks charge a shared per-container accounting file
//! (`gpumem-layout`) and refuse with `CUDA_ERROR_OUT_OF_MEMORY` past the cap.
//! At load time the shim only registers its fork handler: a process that
//! never touches CUDA or NVML pays nothing more. All of the project's
//! `unsafe` lives in this crate.

// Unit tests do not export the entry points, so nothing calls most of
// the hook modules there.
#[cfg_attr(test, allow(dead_code))]
mod array;
#[cfg_attr(test, allow(dead_code))]
mod context;
mod cuda;
#[cfg_attr(test, allow(dead_code))]
mod devices;
#[cfg_attr(test, allow(dead_code))]
mod dlsym;
mod fork;
mod hook;
mod log;
mod nvml;
mod ops;
#[cfg_attr(test, allow(dead_code))]
mod pool;
mod procaddr;
mod ptrmap;
mod region;
mod sigbus;
mod spin;
mod table;
mod track;
#[cfg_attr(test, allow(dead_code))]
mod vmm;

/// Marks this library as gpumem's shim: `gpumem exec`, `install-shim` and
/// the plugin look for this export before anything preloads a file, since
/// the loader skips a wrong one with at most a warning and the process then
/// runs uncapped. Returns the version, NUL-terminated.
#[cfg_attr(not(test), no_mangle)]
pub extern "C" fn gpumem_shim_version() -> *const std::ffi::c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
