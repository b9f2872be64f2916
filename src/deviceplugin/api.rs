//! Generated kubelet gRPC APIs: the device plugin API (v1beta1) and the
//! pod-resources API (v1). Code is generated into `OUT_DIR` by `build.rs`.

#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// `k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1`.
pub mod deviceplugin {
    tonic::include_proto!("v1beta1");

    /// The only API version kubelet accepts in `RegisterRequest.version`.
    pub const VERSION: &str = "v1beta1";
    /// Health string kubelet counts as allocatable; anything else is unhealthy.
    pub const HEALTHY: &str = "Healthy";
    /// Health string for a device that must not receive new pods.
    pub const UNHEALTHY: &str = "Unhealthy";
}

/// `k8s.io/kubelet/pkg/apis/podresources/v1`.
pub mod podresources {
    tonic::include_proto!("v1");
}
