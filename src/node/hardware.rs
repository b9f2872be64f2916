//! The one door hardware enters through: NVML, initialised at most once per
//! process, or a fake GPU file standing in for it; chosen once, in main.

use crate::error_text::one_line;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use nvml_wrapper::Nvml;

use crate::node::gpu::{FakeGpus, Gpu, GpuError, GpuSource, NodeFacts, NvmlGpus};
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

/// NVML, initialised at the first question and kept for the life of the
/// process (the health watch's event set borrows it); never initialised
/// where nothing asks (`gpumem inspect` answered by the running plugin).
#[derive(Default)]
pub struct LazyNvml(OnceLock<Result<&'static Nvml, String>>);

impl LazyNvml {
    /// The process's NVML, or why it is not usable (NVML's own words).
    pub fn get(&self) -> Result<&'static Nvml, &str> {
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
    pub fn usable(&self) -> Result<&'static Nvml, GpuError> {
        self.get().map_err(|err| GpuError::Nvml(err.to_owned()))
    }
}
