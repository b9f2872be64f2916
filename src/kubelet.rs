//! What both kubelet front ends (the device plugin and the DRA driver)
//! share: the `:authority` fix for the gRPC servers kubelet dials, the
//! pod-resources client, and gRPC channels over unix sockets.

pub mod api;
pub mod authority;
pub mod podresources;
/// gRPC channels over unix sockets, from the `gpumem-kubelet-api` crate (the
/// test kit's kubelet dials with the same).
pub use gpumem_kubelet_api::unix;
