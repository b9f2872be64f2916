//! Pods that come to share a claim already prepared here: kubelet prepares
//! a claim once, so the driver learns them from the claim's `reservedFor`
//! when they appear on the node, and records them for attribution.

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use crate::cluster::pods::NodePods;
use crate::dra::prepare::PreparedClaims;
use crate::error_text::chain;

/// How often the node's pods are looked at: a pod's containers start after
/// it is bound, and a process of one the record does not name yet is held
/// by its slot and its mounts only until the next reconciliation after.
const EVERY: Duration = Duration::from_secs(1);

/// How long a claim is not read again for a pod its `reservedFor` did not
/// name (a pod that references it but was not given it never runs).
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// The names of the claims `pod` references: by name in its spec, and as
/// made from a template, in its status.
fn claim_names(pod: &Pod) -> Vec<String> {
    let spec = pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten());
    let status = pod
        .status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten());
    spec.filter_map(|c| c.resource_claim_name.clone())
        .chain(status.filter_map(|c| c.resource_claim_name.clone()))
        .collect()
}

/// Records, until `stop`, each pod on the node that references a claim
/// prepared here under a record that does not name it.
pub async fn follow(claims: PreparedClaims, pods: NodePods, stop: CancellationToken) {
    // (claim UID, pod UID): when its claim was last read for it.
    let mut read: HashMap<(String, String), Instant> = HashMap::new();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(EVERY) => {}
        }
        read.retain(|_, at| at.elapsed() < RETRY_AFTER);
        for pod in pods.all() {
            let names = claim_names(&pod);
            let (Some(namespace), Some(pod_uid)) = (&pod.metadata.namespace, &pod.metadata.uid)
            else {
                continue;
            };
            if names.is_empty() {
                continue;
            }
            for claim in claims.unrecorded(namespace, &names, pod_uid) {
                let key = (claim.uid.clone(), pod_uid.clone());
                if read.contains_key(&key) {
                    continue;
                }
                read.insert(key, Instant::now());
                match claims.record_reserved(&claim).await {
                    Ok(Some(recorded)) => info!(
                        claim = %format!("{}/{}", claim.namespace, claim.name),
                        pods = recorded.len(),
                        "a pod came to share a prepared claim: recorded the pods it is reserved for"
                    ),
                    Ok(None) => {}
                    Err(err) => debug!(
                        claim = %format!("{}/{}", claim.namespace, claim.name),
                        err = %chain(&err),
                        "cannot read the pods a shared claim is reserved for; trying again"
                    ),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_names_its_claims_in_its_spec_and_status() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "default", "uid": "u"},
            "spec": {
                "containers": [],
                "resourceClaims": [
                    {"name": "shared", "resourceClaimName": "notebook"},
                    {"name": "own", "resourceClaimTemplateName": "t"},
                ],
            },
            "status": {"resourceClaimStatuses": [
                {"name": "own", "resourceClaimName": "p-own-x7k2"},
            ]},
        }))
        .unwrap();
        assert_eq!(claim_names(&pod), ["notebook", "p-own-x7k2"]);
    }
}
