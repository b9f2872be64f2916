//! Stand-ins for what gpumem talks to on a node and in a cluster, for
//! `gpumem demo`, the tests and the benchmarks: an in-process kubelet
//! (device plugin registration, pod resources, DRA) on real unix sockets,
//! an in-process Kubernetes API server over loopback HTTP, and an HTTP/1.1
//! client for gpumem's own HTTP endpoints.
//!
//! Test scaffolding only: gpumem's library never depends on it, and the
//! image is built without it (the `demo` feature is off there).

pub mod fake_apiserver;
pub mod h2c;
pub mod http1;
pub mod simulator;
