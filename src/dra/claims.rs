//! The seam between kubelet's DRA gRPC API and what prepares claims: the
//! service translates both API versions into these types.

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
    /// (`DRAConsumableCapacity`); sent to kubelets that speak v1 with it.
    pub share_id: Option<String>,
}

/// Per claim UID: the devices prepared, or why not (kubelet retries).
pub type Prepared = BTreeMap<String, Result<Vec<PreparedDevice>, String>>;
/// Per claim UID: done, or why not (kubelet retries).
pub type Unprepared = BTreeMap<String, Result<(), String>>;

/// Prepares and unprepares claims. Every claim asked about gets an entry.
#[tonic::async_trait]
pub trait Claims: Send + Sync + 'static {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> Prepared;
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Unprepared;
}
