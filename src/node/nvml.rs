//! The node's hardware through NVML, initialised at most once per process:
//! its GPUs and driver, and the sensors, health and processes read through it.

use crate::error_text::{chain, one_line};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use nvml_wrapper::Nvml;
use tracing::warn;

use crate::node::gpu::{Gpu, GpuError, NodeFacts, MAX_GPU_MEMORY_MIB};
use crate::node::hardware::Hardware;
use crate::node::health::{HealthWatch, NvmlHealth};
use crate::node::processes::{NvmlProcesses, ProcessUsage};
use crate::node::sensors::{NvmlSensors, Sensors};

/// The real node, through NVML: initialised at the first question and kept
/// for the life of the process (the health watch's event set borrows it);
/// never initialised where nothing asks (`gpumem inspect` answered by the
/// running plugin). libnvidia-ml is loaded at run time, so the binary
/// starts on machines without it and can say what to do instead.
#[derive(Default)]
pub struct NvmlHardware(OnceLock<Result<&'static Nvml, String>>);

impl NvmlHardware {
    /// The process's NVML, or why it is not usable (NVML's own words).
    fn get(&self) -> Result<&'static Nvml, &str> {
        self.0
            .get_or_init(|| {
                Nvml::init()
                    .map(|nvml| &*Box::leak(Box::new(nvml)))
                    .map_err(|err| one_line(&err))
            })
            .as_ref()
            .copied()
            .map_err(String::as_str)
    }

    /// [`get`](Self::get), as the error discovery gives.
    fn usable(&self) -> Result<&'static Nvml, GpuError> {
        self.get().map_err(|err| GpuError::Nvml(err.to_owned()))
    }
}

impl Hardware for NvmlHardware {
    fn discover(&self) -> Result<Vec<Gpu>, GpuError> {
        let nvml = self.usable()?;
        let count = nvml
            .device_count()
            .map_err(|e| GpuError::Nvml(one_line(&e)))?;
        if count == 0 {
            return Err(GpuError::NoGpus);
        }
        let mut gpus = Vec::with_capacity(count.min(64) as usize);
        let mut failed = None;
        for index in 0..count {
            let read = || -> Result<Gpu, nvml_wrapper::error::NvmlError> {
                let device = nvml.device_by_index(index)?;
                Ok(Gpu {
                    index,
                    uuid: device.uuid()?,
                    name: device.name()?,
                    memory_mib: device.memory_info()?.total / (1024 * 1024),
                    healthy: true,
                })
            };
            // A GPU that fell off the bus, or reports a size no GPU has, must
            // not keep the node's others from kubelet across a restart.
            match read() {
                Ok(gpu) if gpu.memory_mib > MAX_GPU_MEMORY_MIB => {
                    let err = GpuError::Oversized {
                        index,
                        uuid: gpu.uuid,
                        memory_mib: gpu.memory_mib,
                    };
                    tracing::error!(gpu = index, err = %chain(&err), "this GPU is not advertised until gpumem restarts; the node's other GPUs are");
                    failed.get_or_insert(err);
                }
                Ok(gpu) => gpus.push(gpu),
                Err(err) => {
                    tracing::error!(gpu = index, err = %chain(&err), "cannot read this GPU (lost, or needing a reset?): it is not advertised until gpumem restarts; the node's other GPUs are");
                    failed.get_or_insert(GpuError::Nvml(format!("GPU {index}: {}", chain(&err))));
                }
            }
        }
        match failed {
            Some(err) if gpus.is_empty() => Err(err),
            _ => Ok(gpus),
        }
    }

    fn facts(&self) -> Result<NodeFacts, GpuError> {
        use nvml_wrapper::{cuda_driver_version_major, cuda_driver_version_minor};
        let nvml = match self.get() {
            Ok(nvml) => nvml,
            Err(err) => {
                warn!(%err, "NVML is not usable; publishing GPUs without driver facts");
                return Ok(NodeFacts::default());
            }
        };
        let mut facts = NodeFacts {
            driver_version: nvml.sys_driver_version().ok(),
            cuda_driver_version: nvml.sys_cuda_driver_version().ok().and_then(|v| {
                let major = u32::try_from(cuda_driver_version_major(v)).ok()?;
                let minor = u32::try_from(cuda_driver_version_minor(v)).ok()?;
                Some((major, minor))
            }),
            compute_capability: HashMap::new(),
        };
        let count = nvml.device_count().unwrap_or(0);
        for index in 0..count {
            let Ok(device) = nvml.device_by_index(index) else {
                continue;
            };
            let (Ok(uuid), Ok(cc)) = (device.uuid(), device.cuda_compute_capability()) else {
                continue;
            };
            if let (Ok(major), Ok(minor)) = (u32::try_from(cc.major), u32::try_from(cc.minor)) {
                facts.compute_capability.insert(uuid, (major, minor));
            }
        }
        Ok(facts)
    }

    fn sensors(&self) -> Option<Arc<dyn Sensors>> {
        let nvml = self.get().ok()?;
        Some(Arc::new(NvmlSensors::new(nvml)))
    }

    fn health(&self, ignored: &[u64], recovery: Duration) -> Option<Box<dyn HealthWatch>> {
        match self
            .usable()
            .and_then(|nvml| NvmlHealth::new(nvml, ignored, recovery))
        {
            Ok(watch) => Some(Box::new(watch)),
            Err(err) => {
                warn!(err = %chain(&err), "GPU health checks disabled");
                None
            }
        }
    }

    fn processes(&self) -> Option<Box<dyn ProcessUsage>> {
        match self.usable() {
            Ok(nvml) => Some(Box::new(NvmlProcesses::new(nvml))),
            Err(err) => {
                warn!(err = %chain(&err), "untracked GPU memory is not reconciled");
                None
            }
        }
    }
}
