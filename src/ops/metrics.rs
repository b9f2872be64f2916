//! The plugin's HTTP endpoint on the network: Prometheus metrics and a
//! liveness probe that fails while the plugin is not registered.

mod arena;
mod encode;
mod http;

pub(crate) use encode::{family, register_build, Labels};
pub use http::{exposition, parse_address, router, serve, serve_logged, BadAddress};
