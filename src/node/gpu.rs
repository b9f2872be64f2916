//! What a GPU is to the node model (identity, memory, the driver's facts,
//! processes' memory) and why GPUs cannot be read, whatever the hardware.

use std::collections::HashMap;
use std::path::PathBuf;

/// The most memory one GPU may have, in MiB: 16 TiB. The largest GPUs
/// today hold 288 GB (B300, MI355X) and those announced about 1 TB, so a
/// size past 16 times that is a typo or a driver gone wrong, not a GPU.
/// Believing one would ask for billions of device IDs (each unit is one):
/// the bound keeps a GPU at 16,384 GiB units.
pub const MAX_GPU_MEMORY_MIB: u64 = 16 << 20;

/// The largest fake GPU file read: hundreds of thousands of `[[gpu]]`
/// entries, far beyond any node, yet a bounded amount of memory.
pub const MAX_FAKE_FILE_BYTES: u64 = 16 << 20;

/// What a size over [`MAX_GPU_MEMORY_MIB`] is told.
pub(crate) fn over_bound(mib: u64) -> String {
    format!("{mib} MiB is larger than any GPU: at most {MAX_GPU_MEMORY_MIB} MiB (16 TiB)")
}

/// One physical GPU as the plugin sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// NVML index: what `nvidia-smi` and gpushare's `ALIYUN_COM_GPU_MEM_IDX` show.
    pub index: u32,
    /// `GPU-…` UUID: the stable identity, and what `NVIDIA_VISIBLE_DEVICES` takes.
    pub uuid: String,
    pub name: String,
    /// Total memory as NVML reports it.
    pub memory_mib: u64,
    pub healthy: bool,
}

/// A healthy GPU, for the unit tests of what is built on GPUs.
#[cfg(test)]
pub(crate) fn test_gpu(index: u32, uuid: &str, memory_mib: u64) -> Gpu {
    Gpu {
        index,
        uuid: uuid.into(),
        name: "test".into(),
        memory_mib,
        healthy: true,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("cannot read fake GPU file {path}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("fake GPU file {path}: {kind}, not a regular file; give a TOML file")]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error(
        "fake GPU file {path}: {bytes} bytes; a fake GPU file may hold at most \
         {MAX_FAKE_FILE_BYTES} bytes"
    )]
    TooBig { path: PathBuf, bytes: u64 },
    #[error("fake GPU file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("fake GPU file {path}: gpu[{position}].{field}: {message}")]
    Field {
        path: PathBuf,
        position: usize,
        field: String,
        message: String,
    },
    // In a pod NVML comes from the NVIDIA runtime, which mounts the host
    // driver's libraries: a missing runtime or driver looks exactly like a
    // machine without GPUs, so the error names both causes.
    #[error(
        "NVML is not usable ({0}); in a pod, check that it runs with the NVIDIA runtime \
         (runtimeClassName: nvidia, the chart's `runtimeClassName`, or the NVIDIA Container \
         Toolkit as the node's default runtime) and that the node has the NVIDIA driver \
         (`nvidia-smi` on the host); on a machine without NVIDIA GPUs, pass --fake-gpus FILE \
         to describe GPUs in a TOML file"
    )]
    Nvml(String),
    #[error(
        "NVML found no GPU on this node; in a pod, check that its container has \
         NVIDIA_VISIBLE_DEVICES=all (the manifests and the chart set it); on a machine \
         without NVIDIA GPUs, pass --fake-gpus FILE to describe GPUs in a TOML file"
    )]
    NoGpus,
    #[error("GPU {index} ({uuid}): NVML reports {}; is the driver healthy?", over_bound(*.memory_mib))]
    Oversized {
        index: u32,
        uuid: String,
        memory_mib: u64,
    },
}

/// Facts about the node's GPUs beyond what [`Gpu`] holds (which many callers
/// construct, so it stays as it is). Every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The NVIDIA kernel driver's version as NVML prints it, e.g.
    /// `580.65.06` (not necessarily semver).
    pub driver_version: Option<String>,
    /// The newest CUDA version the driver supports, `(major, minor)`.
    pub cuda_driver_version: Option<(u32, u32)>,
    /// Each GPU's CUDA compute capability `(major, minor)`, by GPU UUID.
    pub compute_capability: HashMap<String, (u32, u32)>,
}

/// Device memory per process on each GPU: GPU UUID → PID → bytes, as
/// NVML's running-process list reports it.
pub type ProcessMemory = HashMap<String, HashMap<u32, u64>>;
