//! Generated kubelet gRPC APIs for the DRA front end: the DRA plugin API (v1
//! and v1beta1) and kubelet's plugin registration. `build.rs` generates them.

#![allow(missing_docs, clippy::all, clippy::pedantic)]

/// `k8s.io/kubelet/pkg/apis/dra/v1`: kubelets 1.34 and later.
pub mod v1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");

    /// This version's name in `PluginInfo.supported_versions`: the gRPC
    /// service without the `k8s.io.kubelet.pkg.apis.dra.` prefix, as kubelet
    /// spells it.
    pub const SERVICE: &str = "v1.DRAPlugin";
}

/// `k8s.io/kubelet/pkg/apis/dra/v1beta1`: kubelets 1.32 and later; no
/// `share_id`.
pub mod v1beta1 {
    tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");

    /// This version's name in `PluginInfo.supported_versions`.
    pub const SERVICE: &str = "v1beta1.DRAPlugin";
}

/// `k8s.io/kubelet/pkg/apis/pluginregistration/v1` (package
/// `pluginregistration`).
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");

    /// `PluginInfo.type` of a DRA driver's plugin.
    pub const DRA_PLUGIN: &str = "DRAPlugin";
}
