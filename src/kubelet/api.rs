//! kubelet's pod-resources API (v1), from the `gpumem-kubelet-api` crate.

pub use gpumem_kubelet_api::podresources;
