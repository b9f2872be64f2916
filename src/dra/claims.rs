//! The seam between kubelet's DRA gRPC API and what prepares claims: the
//! service translates both API versions into these types.

pub use gpumem_kubelet_api::dra::{ClaimRef, Prepared, PreparedDevice, Unprepared};

/// Prepares and unprepares claims. Every claim asked about gets an entry.
#[tonic::async_trait]
pub trait Claims: Send + Sync + 'static {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> Prepared;
    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Unprepared;
}
