//! Kubernetes Events on pods (`events.k8s.io/v1`), so what gpumem did to a
//! pod shows in `kubectl describe pod` and `kubectl get events`.

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};

/// Reason of the Event for a container over its GPU memory cap.
pub const OVER_CAP: &str = "GPUMemoryOverCap";
/// Reason of the Event for a pod holding GPU memory it did not ask for.
pub const UNMANAGED: &str = "GPUMemoryUnmanaged";
/// Reason of the Event for a gpumem container's process on a GPU without
/// gpumem's mounts (no state directory, so no shim).
pub const NOT_ISOLATED: &str = "GPUMemoryNotIsolated";

pub struct PodEvents {
    recorder: Recorder,
}

impl PodEvents {
    /// Events reported as `gpumem` on `node` (kubectl shows both).
    pub fn new(client: Client, node: &str) -> Self {
        let reporter = Reporter {
            controller: "gpumem".into(),
            instance: Some(node.to_owned()),
        };
        PodEvents {
            recorder: Recorder::new(client, reporter),
        }
    }

    /// A Warning on `pod`; repeats of the same reason become one Event
    /// with a count, as kubelet's own do.
    pub async fn warn(
        &self,
        pod: &Pod,
        reason: &str,
        action: &str,
        note: String,
    ) -> Result<(), kube::Error> {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            // The API server refuses a note over 1 kB.
            note: Some(truncate(note, 1024)),
            action: action.to_owned(),
            secondary: None,
        };
        self.recorder.publish(&event, &pod.object_ref(&())).await
    }
}

fn truncate(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut at = max;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
    }
    text
}
