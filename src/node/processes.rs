//! Per-process GPU memory: who holds how much of each GPU, as NVML lists it
//! (or the fake GPU file says), and what `/proc` says of those processes.

use crate::error_text::{chain, one_line};
use std::path::{Path, PathBuf};

use tracing::{debug, warn};

use crate::node::gpu::{FakeGpus, GpuError, ProcessMemory};
use crate::node::hardware::Hardware;

/// The text of `<proc_root>/<pid>/<name>` (`/proc` on a node); `None` once
/// the process is gone.
pub fn proc_file(proc_root: &Path, pid: u32, name: &str) -> Option<String> {
    std::fs::read_to_string(proc_root.join(pid.to_string()).join(name)).ok()
}

/// The seam where per-process GPU memory enters: NVML on a node, the fake
/// GPU file in tests and the demo.
pub trait ProcessUsage: Send + 'static {
    /// Device memory per process on each GPU, by UUID and host PID.
    fn usage(&mut self) -> Result<ProcessMemory, GpuError>;

    /// What `/proc/<pid>/<name>` says of a listed process (`cgroup`,
    /// `mountinfo`): where attribution reads who it belongs to.
    fn proc_file(&self, pid: u32, name: &str) -> Option<String> {
        proc_file(Path::new("/proc"), pid, name)
    }
}

/// NVML's running compute processes (about 26 µs per GPU on an H100).
pub struct NvmlProcesses {
    nvml: &'static nvml_wrapper::Nvml,
}

impl NvmlProcesses {
    /// Reads through the process's NVML ([`Hardware`](crate::node::hardware::Hardware)'s).
    pub fn new(nvml: &'static nvml_wrapper::Nvml) -> Self {
        NvmlProcesses { nvml }
    }
}

impl ProcessUsage for NvmlProcesses {
    fn usage(&mut self) -> Result<ProcessMemory, GpuError> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let nvml_err = |e: nvml_wrapper::error::NvmlError| GpuError::Nvml(one_line(&e));
        let mut memory = ProcessMemory::new();
        for index in 0..self.nvml.device_count().map_err(nvml_err)? {
            // A GPU that does not answer is left out: its containers keep
            // what was published for them (health reports the GPU itself).
            let answer = self
                .nvml
                .device_by_index(index)
                .and_then(|device| Ok((device.uuid()?, device.running_compute_processes()?)));
            let (uuid, processes) = match answer {
                Ok(answer) => answer,
                Err(err) => {
                    debug!(gpu = index, err = %chain(&err), "no per-process memory for this GPU");
                    continue;
                }
            };
            let per_pid = memory.entry(uuid).or_default();
            for process in processes {
                // Unavailable (some virtualised setups): nothing to compare.
                if let UsedGpuMemory::Used(bytes) = process.used_gpu_memory {
                    let total = per_pid.entry(process.pid).or_default();
                    *total = total.saturating_add(bytes);
                }
            }
        }
        Ok(memory)
    }
}

/// The `[[gpu.process]]` tables of a fake GPU file, re-read on every call
/// so tests can change them while the daemon runs; a process's `cgroup`
/// and `mountinfo` there stand in for its files under `/proc/<pid>/`.
pub struct FakeProcesses {
    path: PathBuf,
    last: Option<FakeGpus>,
}

impl FakeProcesses {
    pub fn new(path: &Path) -> Self {
        FakeProcesses {
            path: path.to_owned(),
            last: None,
        }
    }
}

impl ProcessUsage for FakeProcesses {
    fn usage(&mut self) -> Result<ProcessMemory, GpuError> {
        let fake = FakeGpus::from_file(&self.path)?;
        let memory = fake.processes().clone();
        self.last = Some(fake);
        Ok(memory)
    }

    fn proc_file(&self, pid: u32, name: &str) -> Option<String> {
        match self
            .last
            .as_ref()
            .and_then(|fake| fake.proc_file(pid, name))
        {
            Some(text) => Some(text.to_owned()),
            None => proc_file(Path::new("/proc"), pid, name),
        }
    }
}

/// The per-process usage source for the hardware: the fake file, or NVML.
pub fn source_for(hardware: &Hardware) -> Option<Box<dyn ProcessUsage>> {
    match hardware {
        Hardware::Fake(path) => Some(Box::new(FakeProcesses::new(path))),
        Hardware::Nvml(nvml) => match nvml.usable() {
            Ok(nvml) => Some(Box::new(NvmlProcesses::new(nvml))),
            Err(err) => {
                warn!(err = %chain(&err), "untracked GPU memory is not reconciled");
                None
            }
        },
    }
}
