//! The Events posted on pods for what reconciliation noticed: over-cap
//! actions, processes without gpumem's mounts and in no gpumem container.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::cluster::events::{self, PodEvents};
use crate::cluster::pods::NodePods;
use crate::dra::prepare::PreparedClaims;
use crate::isolation::containers::ContainerName;
use crate::isolation::enforce::{Notice, Noticed, WINDOW_GRACES};
use crate::kubelet::podresources::{Holding, PodResources};

/// How long a notice waits for the first list of the node's pods.
const POD_LIST_WAIT: Duration = Duration::from_secs(10);

/// The containers a notice about an accounting directory is about, from
/// kubelet's pod-resources list: the device plugin's one container, or
/// every container referencing a DRA claim.
pub(super) type Users = Box<dyn Fn(&ContainerName, &[Holding]) -> Vec<User> + Send>;

/// A container an Event is posted for: its pod, and how the note names it.
pub(super) struct User {
    namespace: String,
    pod: String,
    subject: String,
}

/// The device plugin's container behind a directory, by its devices.
pub(super) fn device_plugin_users() -> Users {
    Box::new(move |name, holdings| {
        holdings
            .iter()
            .find(|h| ContainerName::of_devices_any_unit(&h.device_ids).contains(name))
            .map(|h| User {
                namespace: h.namespace.clone(),
                pod: h.pod.clone(),
                subject: format!("container {}", h.container),
            })
            .into_iter()
            .collect()
    })
}

/// The containers referencing the DRA claim behind a directory.
pub(super) fn claim_users(claims: PreparedClaims) -> Users {
    Box::new(move |name, holdings| {
        let Some(claim) = claims.claim_of(name) else {
            return Vec::new();
        };
        let key = (claim.namespace.clone(), claim.name.clone());
        // One Event per pod, naming all its containers that use the claim:
        // one per container would count one action several times.
        let mut by_pod = std::collections::BTreeMap::<(String, String), Vec<String>>::new();
        for h in holdings.iter().filter(|h| h.claims.contains(&key)) {
            by_pod
                .entry((h.namespace.clone(), h.pod.clone()))
                .or_default()
                .push(h.container.clone());
        }
        by_pod
            .into_iter()
            .map(|((namespace, pod), containers)| User {
                namespace,
                pod,
                subject: format!(
                    "ResourceClaim {}/{} (used by container{} {})",
                    claim.namespace,
                    claim.name,
                    if containers.len() == 1 { "" } else { "s" },
                    containers.join(", ")
                ),
            })
            .collect()
    })
}

/// Posts an Event on the pod of each over-cap action and each process
/// outside every gpumem container, until `stop`.
pub(super) async fn post_events(
    mut notices: UnboundedReceiver<Notice>,
    events: PodEvents,
    pods: NodePods,
    users: Users,
    pod_resources: PodResources,
    stop: CancellationToken,
) {
    loop {
        let notice = tokio::select! {
            () = stop.cancelled() => return,
            notice = notices.recv() => match notice {
                Some(notice) => notice,
                None => return,
            },
        };
        // A notice is reported once: wait for the first list of the node's
        // pods rather than drop one that comes before it.
        if !pods.ready(POD_LIST_WAIT).await {
            warn!("the node's pods are not listed yet; an Event is not posted");
        }
        // The pods: a gpumem directory's by pod-resources, a stranger's by
        // the pod UID in its cgroup.
        let targets: Vec<(Option<Arc<Pod>>, String)> = match &notice.what {
            Noticed::Killed { file, .. }
            | Noticed::OverCap { file, .. }
            | Noticed::NotIsolated { file, .. } => {
                let Some(name) = file.parent().and_then(ContainerName::of_dir) else {
                    continue;
                };
                let Ok(holdings) = pod_resources.holdings().await else {
                    continue;
                };
                users(&name, &holdings)
                    .into_iter()
                    .map(|u| (pods.by_name(&u.namespace, &u.pod), u.subject))
                    .collect()
            }
            Noticed::Unmanaged {
                pod_uid: Some(uid), ..
            } => vec![(pods.by_uid(uid), String::new())],
            Noticed::Unmanaged { pod_uid: None, .. } => continue,
        };
        for (pod, subject) in targets {
            let Some(pod) = pod else { continue };
            post_event(&events, &pod, &notice, &subject).await;
        }
    }
}

/// One notice's Event on `pod`, naming `subject` (the container or claim).
async fn post_event(events: &PodEvents, pod: &Pod, notice: &Notice, subject: &str) {
    let gpu = &notice.gpu;
    let (reason, action, note) = match notice.what {
        Noticed::Killed {
            pid,
            used_mib,
            cap_mib,
            ..
        } => (
            events::OVER_CAP,
            "Kill",
            format!(
                "Killed process {pid} of {subject} (it held {used_mib} MiB on GPU {gpu}): the GPU \
                 memory of all its processes, as NVML counts it, was above the cap of {cap_mib} \
                 MiB for the grace period in total within the last {WINDOW_GRACES} grace periods"
            ),
        ),
        Noticed::OverCap {
            used_mib, cap_mib, ..
        } => (
            events::OVER_CAP,
            "Report",
            format!(
                "{} holds {used_mib} MiB on GPU {gpu}, above its cap of {cap_mib} MiB, and was over \
                 it for the grace period in total within the last {WINDOW_GRACES} grace periods \
                 (--over-cap-action report: nothing was killed)",
                capitalized(subject)
            ),
        ),
        Noticed::NotIsolated { pid, used_mib, .. } => (
            events::NOT_ISOLATED,
            "Report",
            format!(
                "Process {pid} of {subject} holds {used_mib} MiB on GPU {gpu} without gpumem's \
                 mounts (no /var/run/gpumem, no shim), so only the node daemon holds it to its \
                 cap. Either the container runtime did not apply the device plugin's answer \
                 (--device-list-strategy cdi needs CDI on in the runtime: containerd 1.7 or later \
                 with enable_cdi, CRI-O 1.23 or later; docs/OPERATIONS.md), the process left its \
                 container's mount namespace (docs/SECURITY.md), or it runs in a container nested \
                 in it"
            ),
        ),
        Noticed::Unmanaged { pid, used_mib, .. } => (
            events::UNMANAGED,
            "Report",
            format!(
                "Process {pid} holds {used_mib} MiB on GPU {gpu} and is in no container gpumem \
                 holds to a cap (the pod did not ask gpumem for GPU memory, or the process left \
                 its container's mounts: docs/SECURITY.md); it is not capped"
            ),
        ),
    };
    if let Err(err) = events.warn(pod, reason, action, note).await {
        warn!(err = %crate::error_text::chain(&err), reason, "cannot post an Event");
    }
}

fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_begins_with_its_subject_capitalized() {
        assert_eq!(capitalized("container main"), "Container main");
        assert_eq!(
            capitalized("ResourceClaim default/gpu (used by container main)"),
            "ResourceClaim default/gpu (used by container main)"
        );
        assert_eq!(capitalized("élan"), "Élan");
        assert_eq!(capitalized(""), "");
    }
}
