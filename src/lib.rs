//! gpumem: a Kubernetes device plugin that shares NVIDIA GPUs by memory.
//!
//! Each GPU's memory is advertised to kubelet as countable units; each
//! container gets all its units on one GPU and env that tells it its cap.

#![forbid(unsafe_code)]

// The layers, bottom up: node, isolation, cluster (the API server), the
// front ends (deviceplugin and dra for kubelet, extender for kube-scheduler;
// none uses another, except that dra serves its sockets through the device
// plugin's authority fix), ops. Each uses only those before it, except where
// the device plugin's wire format still reaches down: the inventory builds
// ListAndWatch's device list (and checks kubelet's message limit at start)
// and inject builds the Allocate response. Clean-up learns who holds what
// through a seam (`cleanup::Holders`) each front end fills. `atomic_file`
// and `version` (what build this is) are below them all.
pub mod atomic_file;
pub mod cluster;
pub mod deviceplugin;
pub mod dra;
pub mod extender;
pub mod isolation;
pub mod node;
pub mod ops;
pub mod version;
