//! kubelet's gRPC APIs for the DRA front end, from the `gpumem-kubelet-api`
//! crate: the DRA plugin API (v1 and v1beta1) and plugin registration.

pub use gpumem_kubelet_api::dra::{v1, v1beta1};
pub use gpumem_kubelet_api::pluginregistration;
