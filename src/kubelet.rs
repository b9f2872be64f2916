//! What both kubelet front ends (the device plugin and the DRA driver)
//! share: the `:authority` fix for the gRPC servers kubelet dials, the
//! pod-resources client, and gRPC channels over unix sockets.

pub mod api;
pub mod authority;
pub mod podresources;
pub mod unix;
