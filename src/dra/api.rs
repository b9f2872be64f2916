//! kubelet's gRPC APIs for the DRA front end, from the `gpumem-kubelet-api`
//! crate: the DRA plugin API (v1 and v1beta1), DRA resource health and
//! plugin registration.

pub use gpumem_kubelet_api::dra::{health, v1, v1beta1};
pub use gpumem_kubelet_api::pluginregistration;
