//! The one door hardware enters through: NVML, initialised at most once per
//! process, or a fake GPU file standing in for it; chosen once, in main.

use std::path::{Path, PathBuf};

use crate::node::fake::FakeGpus;
use crate::node::gpu::{Gpu, GpuError, GpuSource, NodeFacts};
use crate::node::nvml::{LazyNvml, NvmlGpus};
use crate::node::sensors::Sensors;

/// Where the node's GPUs, their health and their processes are read.
/// Discovery, driver facts, the health watch and process usage are all
/// asked of this one value.
pub enum Hardware {
    /// The node's GPUs, through NVML.
    Nvml(LazyNvml),
    /// A TOML file describing the GPUs (`--fake-gpus`), read again by each
    /// question, so tests can change it while the daemon runs.
    Fake(PathBuf),
}

impl Hardware {
    /// The fake file where one is given (`--fake-gpus`), NVML otherwise.
    pub fn new(fake_gpus: Option<&Path>) -> Self {
        match fake_gpus {
            Some(path) => Hardware::Fake(path.to_owned()),
            None => Hardware::Nvml(LazyNvml::default()),
        }
    }

    /// The node's GPUs, ordered by index.
    pub fn discover(&self) -> Result<Vec<Gpu>, GpuError> {
        match self {
            Hardware::Fake(path) => FakeGpus::from_file(path)?.discover(),
            Hardware::Nvml(nvml) => NvmlGpus::new(nvml.get()).discover(),
        }
    }

    /// Where the GPUs' sensor readings are read, for the metrics endpoint;
    /// `None` where NVML is not usable (discovery has said why).
    pub fn sensors(&self) -> Option<Sensors> {
        match self {
            Hardware::Fake(path) => Some(Sensors::Fake(path.clone())),
            Hardware::Nvml(nvml) => nvml.get().ok().map(Sensors::Nvml),
        }
    }

    /// What else the node says about its GPUs (see [`GpuSource::facts`]).
    /// Fails only where the fake file cannot be read.
    pub fn facts(&self) -> Result<NodeFacts, GpuError> {
        match self {
            Hardware::Fake(path) => Ok(FakeGpus::from_file(path)?.facts()),
            Hardware::Nvml(nvml) => Ok(NvmlGpus::new(nvml.get()).facts()),
        }
    }
}
