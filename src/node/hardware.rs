//! The one door hardware enters through: the `Hardware` seam, NVML or the
//! fake GPU file, chosen once in main and asked every question about GPUs.

use std::sync::Arc;
use std::time::Duration;

use crate::node::gpu::{Gpu, GpuError, NodeFacts};
use crate::node::health::HealthWatch;
use crate::node::processes::ProcessUsage;
use crate::node::sensors::Sensors;

/// Where the node's GPUs, their driver facts, sensor readings, health and
/// processes are read: NVML on a node ([`NvmlHardware`]), a TOML file for
/// the demo, tests and GPU-less development ([`FakeHardware`]). Everything
/// above it runs without a GPU; another kind of hardware is another
/// implementation of this trait.
///
/// [`NvmlHardware`]: crate::node::nvml::NvmlHardware
/// [`FakeHardware`]: crate::node::fake::FakeHardware
pub trait Hardware: Send + Sync {
    /// The node's GPUs, ordered by index.
    fn discover(&self) -> Result<Vec<Gpu>, GpuError>;

    /// What else the node says about its GPUs, for selectors (a DRA
    /// ResourceSlice's attributes). Best effort: a fact the hardware cannot
    /// tell is left out; fails only where the fake file cannot be read.
    fn facts(&self) -> Result<NodeFacts, GpuError>;

    /// Where the GPUs' sensor readings are read, for the metrics endpoint;
    /// `None` where they cannot be (discovery has said why).
    fn sensors(&self) -> Option<Arc<dyn Sensors>>;

    /// The GPUs' health watch, passing over the `ignored` XIDs and calling
    /// a GPU healthy again once quiet for `recovery`; `None`, warned of,
    /// where health cannot be watched.
    fn health(&self, ignored: &[u64], recovery: Duration) -> Option<Box<dyn HealthWatch>>;

    /// Where per-process GPU memory is read; `None`, warned of, where it
    /// cannot be.
    fn processes(&self) -> Option<Box<dyn ProcessUsage>>;
}
