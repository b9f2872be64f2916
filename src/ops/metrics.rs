//! The plugin's HTTP endpoint on the network: Prometheus metrics and a
//! liveness probe that fails while the plugin is not registered.

mod arena;
mod encode;
mod http;

pub use http::{parse_address, router, serve, serve_logged, BadAddress};
