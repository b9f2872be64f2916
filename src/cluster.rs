//! The API server, for what only it knows: which pod a container is, what
//! gpushare's scheduler extender chose for it, and where the tools that read
//! gpushare's annotations and node capacity look.
//!
//! Optional: without `--node-name` the plugin runs on kubelet alone, as
//! before.

pub mod backoff;
pub mod client;
pub mod events;
pub mod gpushare;
pub mod node;
pub mod pods;
