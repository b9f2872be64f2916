//! The node model: the GPUs (all hardware through one door, `hardware`), how
//! their memory becomes units, where a container's units come from, whether a
//! GPU is healthy and which processes hold its memory. Knows nothing of
//! kubelet, the shim or the cluster.

pub mod fake;
pub mod gpu;
pub mod hardware;
pub mod health;
pub mod inventory;
pub mod nvml;
pub mod placement;
pub mod processes;
pub mod quantity;
pub mod resource;
pub mod sensors;
pub mod units;
