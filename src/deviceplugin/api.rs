//! kubelet's device plugin API (v1beta1), from the `gpumem-kubelet-api`
//! crate.

pub use gpumem_kubelet_api::deviceplugin;
