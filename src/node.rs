//! The node model: the GPUs, how their memory becomes units, where a
//! container's units come from, and whether a GPU is healthy. Knows nothing
//! of kubelet, the shim or the cluster.

pub mod gpu;
pub mod health;
pub mod inventory;
pub mod placement;
pub mod resource;
pub mod units;
