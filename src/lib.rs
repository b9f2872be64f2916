//! gpumem: a Kubernetes device plugin that shares NVIDIA GPUs by memory.
//!
//! Each GPU's memory is advertised to kubelet as countable units; each
//! container gets all its units on one GPU and env that tells it its cap.

#![forbid(unsafe_code)]

pub mod accounting;
pub mod api;
pub mod cleanup;
pub mod containers;
pub mod daemon;
pub mod demo;
pub mod exec;
pub mod gpu;
pub mod health;
pub mod inject;
pub mod inspect;
pub mod install;
pub mod inventory;
pub mod kubelet;
pub mod metrics;
pub mod placement;
pub mod plugin;
pub mod podresources;
pub mod reconcile;
pub mod resource;
pub mod service;
pub mod simulator;
pub mod status;
pub mod units;
