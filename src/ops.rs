//! Operations, on top of the layers: the daemon's wiring, the HTTP endpoint
//! (metrics, health), the status socket, `inspect`, `exec`, the demo, and
//! node-group templates for autoscalers.

pub mod daemon;
#[cfg(feature = "demo")]
pub mod demo;
pub mod exec;
pub mod inspect;
pub mod metrics;
pub mod observed;
pub mod status;
pub mod status_socket;
pub mod template;
