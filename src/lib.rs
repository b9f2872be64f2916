//! gpumem: a Kubernetes device plugin that shares NVIDIA GPUs by memory.
//!
//! Each GPU's memory is advertised to kubelet as countable units; each
//! container gets all its units on one GPU and env that tells it its cap.

#![forbid(unsafe_code)]

// The layers, bottom up: node, isolation, cluster (the API server), the
// front ends (deviceplugin for kubelet, extender for kube-scheduler; neither
// uses the other), ops. Each uses only those before it, except where the
// device plugin's wire format still reaches down: the inventory builds
// ListAndWatch's device list (and checks kubelet's message limit at start),
// inject builds the Allocate response, and cleanup asks pod-resources who
// holds what. A front-end-neutral grant and holder seam remove these.
pub mod cluster;
pub mod deviceplugin;
pub mod extender;
pub mod isolation;
pub mod node;
pub mod ops;

/// An in-process kubelet for `gpumem demo` and the tests. Not part of what
/// ships (the image is built without the `demo` feature).
#[cfg(feature = "demo")]
pub mod simulator;

/// An in-process API server for `gpumem demo` and the tests. Not part of
/// what ships.
#[cfg(feature = "demo")]
pub mod fake_apiserver;
