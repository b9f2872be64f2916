//! gpumem shares NVIDIA GPUs between Kubernetes pods by memory: a device
//! plugin or a DRA driver for kubelet, a scheduler extender for
//! kube-scheduler, and the isolation that holds each container to its cap
//! (the shim itself is the `gpumem-shim` crate).
//!
//! Each GPU's memory is offered as units (device plugin) or consumable
//! capacity (DRA); each container gets its memory on one GPU, a cap from a
//! file mounted into it, and reconciliation from outside. docs/ARCHITECTURE.md
//! draws the whole.

#![forbid(unsafe_code)]

// The layers, bottom up: node, isolation, cluster (the API server), kubelet
// (what both kubelet front ends share: the `:authority` fix, the
// pod-resources client, unix-socket gRPC), the front ends (deviceplugin and
// dra for kubelet, extender for kube-scheduler; none uses another), ops.
// Each uses only those before it. Isolation answers with a front-end-neutral
// grant that each front end puts into its own wire format; clean-up learns
// who holds what through a seam (`cleanup::Holders`) each front end fills.
// `atomic_file`, `error_text`, `sync` (locks) and `version` (what build
// this is) are below them all.
pub mod atomic_file;
pub mod error_text;
pub mod sync;
pub mod version;

pub mod node;

pub mod isolation;

pub mod cluster;

pub mod kubelet;

pub mod deviceplugin;
pub mod dra;
pub mod extender;

pub mod ops;
