//! kubelet's gRPC APIs, generated into `OUT_DIR` from the `.proto` files
//! beside this crate (restated from kubernetes' own `api.proto`s).
//!
//! A crate of its own so that gpumem and its test kit (the kubelet
//! simulator) speak the same types without depending on each other.

#![allow(missing_docs, clippy::all, clippy::pedantic)]

pub mod unix;

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

/// `k8s.io/kubelet/pkg/apis/dra`: the DRA plugin API, and the
/// version-neutral form of its prepare and unprepare calls.
pub mod dra {
    use std::collections::BTreeMap;

    /// A claim as kubelet names it in NodePrepareResources and
    /// NodeUnprepareResources.
    #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
    pub struct ClaimRef {
        pub namespace: String,
        pub uid: String,
        pub name: String,
    }

    /// One device prepared for a claim: what kubelet hands the runtime.
    #[derive(Debug, Clone, PartialEq, Eq, Default)]
    pub struct PreparedDevice {
        /// The claim's requests this device serves; empty: all.
        pub request_names: Vec<String>,
        pub pool_name: String,
        pub device_name: String,
        pub cdi_device_ids: Vec<String>,
        /// The allocation's share of a device allocated many times
        /// (`DRAConsumableCapacity`); only v1 carries it.
        pub share_id: Option<String>,
    }

    /// Per claim UID: the devices prepared, or why not (kubelet retries).
    pub type Prepared = BTreeMap<String, Result<Vec<PreparedDevice>, String>>;
    /// Per claim UID: done, or why not (kubelet retries).
    pub type Unprepared = BTreeMap<String, Result<(), String>>;

    /// `k8s.io/kubelet/pkg/apis/dra/v1`: kubelets 1.34 and later.
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");

        /// This version's name in `PluginInfo.supported_versions`: the gRPC
        /// service without the `k8s.io.kubelet.pkg.apis.dra.` prefix, as
        /// kubelet spells it.
        pub const SERVICE: &str = "v1.DRAPlugin";
    }

    /// `k8s.io/kubelet/pkg/apis/dra/v1beta1`: kubelets 1.32 and later; no
    /// `share_id`.
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");

        /// This version's name in `PluginInfo.supported_versions`.
        pub const SERVICE: &str = "v1beta1.DRAPlugin";
    }

    /// `k8s.io/kubelet/pkg/apis/dra-health`: device health a DRA driver
    /// streams to kubelet, which puts it in the status of the pods whose
    /// claims hold the device (KEP-4680, `ResourceHealthStatus`: alpha
    /// from 1.31, on by default from 1.36). Served on the DRA socket
    /// whatever DRAPlugin version kubelet chose.
    pub mod health {
        /// `k8s.io/kubelet/pkg/apis/dra-health/v1`: kubelets 1.37 and later,
        /// which call a driver's health service only if its registration
        /// lists it, and prefer this version.
        pub mod v1 {
            include!(concat!(env!("OUT_DIR"), "/dra-health/v1.rs"));

            /// This version's name in `PluginInfo.supported_versions`.
            pub const SERVICE: &str = "v1.DRAResourceHealth";
        }

        /// `k8s.io/kubelet/pkg/apis/dra-health/v1alpha1`: called on every
        /// DRA driver by kubelets 1.31 to 1.36 with the gate on; kubelets
        /// 1.37 to 1.39 still take it when registration lists it.
        pub mod v1alpha1 {
            tonic::include_proto!("v1alpha1");

            /// This version's name in `PluginInfo.supported_versions`, and
            /// the gRPC service's full name.
            pub const SERVICE: &str = "v1alpha1.DRAResourceHealth";
        }
    }
}

/// `k8s.io/kubelet/pkg/apis/pluginregistration/v1` (package
/// `pluginregistration`).
pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");

    /// `PluginInfo.type` of a DRA driver's plugin.
    pub const DRA_PLUGIN: &str = "DRAPlugin";
}
