//! Isolation: turns a placement into what holds a container to its cap (the
//! env, the shim and its mounts, the per-container accounting file, and how
//! the runtime is told which GPU: env, mounts or CDI), keeps that state, and
//! reconciles it with what the driver really holds.

pub mod accounting;
pub mod cdi;
pub mod cleanup;
pub mod containers;
pub mod enforce;
pub mod identity;
pub mod inject;
pub mod install;
pub mod reconcile;
pub mod statefs;
