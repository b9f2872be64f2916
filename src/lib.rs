//! gpumem: a Kubernetes device plugin that shares NVIDIA GPUs by memory.
//!
//! Each GPU's memory is advertised to kubelet as countable units; each
//! container gets all its units on one GPU and env that tells it its cap.

#![forbid(unsafe_code)]

pub mod accounting;
pub mod api;
pub mod demo;
pub mod exec;
pub mod gpu;
pub mod inject;
pub mod inventory;
pub mod kubelet;
pub mod placement;
pub mod plugin;
pub mod resource;
pub mod service;
pub mod simulator;
pub mod units;
