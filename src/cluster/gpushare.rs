//! gpushare's pod annotation protocol, so its scheduler extender, `kubectl
//! inspect gpushare` and `arena top node -s` work with gpumem.
//!
//! The extender's bind writes on the pod the GPU it chose (`…_IDX`), the
//! pod's units (`…_POD`) and the GPU's (`…_DEV`), `…_ASSIGNED=false` and
//! when it assumed the pod (`…_ASSUME_TIME`, Unix nanoseconds). The node's
//! plugin then finds the pod at admission, the oldest assumed pending pod
//! whose units equal the request, puts the container on that GPU and sets
//! `…_ASSIGNED=true`. gpumem does the matching in GetPreferredAllocation,
//! so kubelet picks device IDs on the chosen GPU and the IDs keep meaning
//! what they say; Allocate marks assigned the oldest pod of that size the
//! extender put on the GPU of those IDs. Both calls match against the
//! node's pods listed afresh; a pod assumed earlier but bound between them
//! changes the oldest, not whether kubelet's IDs are right.

use crate::error_text::chain;
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Container, Pod};
use serde_json::{json, Map, Value};
use tracing::{info, warn};

use crate::cluster::pods::{NodePods, PodsError};
use crate::node::inventory::Inventory;
use crate::node::placement::{self, Assignment, Policy};

/// The annotations, named as gpushare names them.
pub mod annotation {
    /// The chosen GPU's NVML index.
    pub const IDX: &str = "ALIYUN_COM_GPU_MEM_IDX";
    /// Units the whole pod asks for.
    pub const POD: &str = "ALIYUN_COM_GPU_MEM_POD";
    /// Units the chosen GPU has.
    pub const DEV: &str = "ALIYUN_COM_GPU_MEM_DEV";
    /// `false` once assumed by the extender, `true` once the node placed it.
    pub const ASSIGNED: &str = "ALIYUN_COM_GPU_MEM_ASSIGNED";
    /// When the pod was assumed (or assigned), Unix nanoseconds.
    pub const ASSUME_TIME: &str = "ALIYUN_COM_GPU_MEM_ASSUME_TIME";
    /// Per container, the units on each GPU: JSON `{"<container>":
    /// {"<gpu>": units}}`, the container by its index in `spec.containers`
    /// (init containers have none), the GPU by NVML index. `kubectl inspect
    /// gpushare` reads it before `…_IDX`, so a pod split over GPUs counts
    /// right.
    pub const ALLOCATION: &str = "scheduler.framework.gpushare.allocation";
}

/// Node capacity gpushare's tools read for the GPU count.
pub const GPU_COUNT: &str = "aliyun.com/gpu-count";

/// A pod the extender bound here and the node has not placed yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Awaiting {
    pub namespace: String,
    pub name: String,
    /// The GPU the extender chose, by NVML index.
    pub gpu_index: u32,
    /// Units the pod asks for, over all its containers.
    pub units: u64,
    pub assume_time: u128,
    /// Where the pod's one asking container is in `spec.containers`.
    pub container: Option<usize>,
}

impl std::fmt::Display for Awaiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} ({} units on GPU {})",
            self.namespace, self.name, self.units, self.gpu_index
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GpushareError {
    #[error(
        "no pending pod on node {node} carries gpushare's extender annotations for {units} \
         units ({ASSIGNED}=false and {ASSUME_TIME} set){seen}; is the pod scheduled by the \
         gpushare extender (--scheduler gpushare-extender expects it)?",
        ASSIGNED = annotation::ASSIGNED,
        ASSUME_TIME = annotation::ASSUME_TIME,
        seen = awaiting_list(.awaiting)
    )]
    NoCandidate {
        node: String,
        units: u64,
        awaiting: Vec<Awaiting>,
    },
    #[error("the extender chose GPU {index} for {pod}, which this node does not have (or it is unhealthy)")]
    UnknownGpu { pod: String, index: u32 },
    #[error("the extender chose GPU {index} for {pod}, but kubelet offered {offered} of the {units} units needed there")]
    GpuFull {
        pod: String,
        index: u32,
        units: u64,
        offered: usize,
    },
    #[error("kubelet allocated GPU {allocated} to a container of {pod}, but the extender chose GPU {chosen}")]
    Mismatch {
        pod: String,
        chosen: u32,
        allocated: u32,
    },
    #[error("{pod} is no longer waiting to be placed (assigned or deleted meanwhile)")]
    Gone { pod: String },
    #[error("cannot read or annotate pods")]
    Pods(#[from] PodsError),
    #[error(transparent)]
    Placement(#[from] placement::PlacementError),
}

fn awaiting_list(awaiting: &[Awaiting]) -> String {
    if awaiting.is_empty() {
        return String::new();
    }
    let pods: Vec<String> = awaiting.iter().map(ToString::to_string).collect();
    format!("; pods awaiting placement: {}", pods.join(", "))
}

/// Units of `resource` the pod's containers ask for (their limits, which
/// kubelet requires equal to requests for extended resources), init
/// containers' too: kubelet calls Allocate for each of them as well.
pub fn requested_units(pod: &Pod, resource: &str) -> u64 {
    containers(pod)
        .map(|c| requested_units_of(c, resource))
        .sum()
}

/// Units of `resource` one container asks for.
fn requested_units_of(container: &Container, resource: &str) -> u64 {
    let Some(resources) = container.resources.as_ref() else {
        return 0;
    };
    resources
        .limits
        .as_ref()
        .and_then(|l| l.get(resource))
        .or_else(|| resources.requests.as_ref()?.get(resource))
        .and_then(|quantity| quantity.0.parse::<u64>().ok())
        .unwrap_or(0)
}

/// The pod's init containers, then its containers.
pub fn containers(pod: &Pod) -> impl Iterator<Item = &Container> {
    let spec = pod.spec.as_ref();
    let init = spec
        .and_then(|s| s.init_containers.as_deref())
        .unwrap_or_default();
    let main = spec.map_or(&[][..], |s| &s.containers[..]);
    init.iter().chain(main)
}

/// The pod, if the extender assumed it and the node has not placed it.
pub fn awaiting(pod: &Pod, resource: &str) -> Option<Awaiting> {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if !matches!(phase, None | Some("Pending")) || pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let annotations = pod.metadata.annotations.as_ref()?;
    if annotations.get(annotation::ASSIGNED)?.as_str() != "false" {
        return None;
    }
    let units = requested_units(pod, resource);
    (units > 0).then_some(())?;
    Some(Awaiting {
        namespace: pod.metadata.namespace.clone().unwrap_or_default(),
        name: pod.metadata.name.clone().unwrap_or_default(),
        gpu_index: annotations.get(annotation::IDX)?.trim().parse().ok()?,
        units,
        assume_time: annotations
            .get(annotation::ASSUME_TIME)?
            .trim()
            .parse()
            .ok()?,
        container: sole_container(pod, resource),
    })
}

/// The pods awaiting placement, assumed first first.
fn awaiting_by_age<'a>(pods: impl IntoIterator<Item = &'a Pod>, resource: &str) -> Vec<Awaiting> {
    let mut awaiting: Vec<Awaiting> = pods
        .into_iter()
        .filter_map(|pod| awaiting(pod, resource))
        .collect();
    awaiting.sort_by(|a, b| {
        (a.assume_time, &a.namespace, &a.name).cmp(&(b.assume_time, &b.namespace, &b.name))
    });
    awaiting
}

/// gpushare's rule: of the pods awaiting placement, the one assumed first
/// whose units equal the request. `Err` lists those awaiting, for the error.
pub fn next_for<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    resource: &str,
    units: u64,
) -> Result<Awaiting, Vec<Awaiting>> {
    let mut awaiting = awaiting_by_age(pods, resource);
    match awaiting.iter().position(|a| a.units == units) {
        Some(at) => Ok(awaiting.swap_remove(at)),
        None => Err(awaiting),
    }
}

/// Allocate's rule: of the pods awaiting `units`, the one assumed first
/// that the extender put on GPU `gpu_index`. kubelet's IDs follow
/// GetPreferredAllocation's answer for the oldest such pod then; a pod
/// assumed earlier but bound since (its bind was slow) does not make them
/// wrong, and refusing them would lose the pod for good. `Err` is what
/// [`next_for`] answers: the pod that should have had them, or the list.
pub fn next_on<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    resource: &str,
    units: u64,
    gpu_index: u32,
) -> Result<Awaiting, Result<Awaiting, Vec<Awaiting>>> {
    let mut awaiting = awaiting_by_age(pods, resource);
    let on = |a: &Awaiting| a.units == units && a.gpu_index == gpu_index;
    match awaiting.iter().position(on) {
        Some(at) => Ok(awaiting.swap_remove(at)),
        None => match awaiting.iter().position(|a| a.units == units) {
            Some(at) => Err(Ok(awaiting.swap_remove(at))),
            None => Err(Err(awaiting)),
        },
    }
}

/// gpushare's per-container allocation: container index (see
/// [`container_index`]) → GPU index → units. Serialised, the integer keys
/// become the strings gpushare's tools parse.
pub type Allocation = BTreeMap<usize, BTreeMap<u32, u64>>;

/// The per-container allocation the pod carries, if it is readable.
pub fn allocation(pod: &Pod) -> Option<Allocation> {
    let text = pod
        .metadata
        .annotations
        .as_ref()?
        .get(annotation::ALLOCATION)?;
    serde_json::from_str(text).ok()
}

/// The allocation's key for the container named `name`: its index in
/// `spec.containers`; for a sidecar (an init container with `restartPolicy:
/// Always`, which holds its units beside the app containers for the pod's
/// life) the number of app containers plus its index in
/// `spec.initContainers`, past every app container's key. gpushare's tools
/// sum a GPU's units over every key, so a sidecar's count. A regular init
/// container has none (`None`): kubelet hands its units on to the app
/// containers, which are counted.
pub fn container_index(pod: &Pod, name: &str) -> Option<usize> {
    let spec = pod.spec.as_ref()?;
    if let Some(index) = spec.containers.iter().position(|c| c.name == name) {
        return Some(index);
    }
    let init = spec.init_containers.as_deref().unwrap_or_default();
    init.iter()
        .position(|c| c.name == name && c.restart_policy.as_deref() == Some("Always"))
        .map(|index| spec.containers.len() + index)
}

/// The allocation's key (see [`container_index`]) of the pod's one
/// container asking for `resource`, where exactly one (init containers
/// included) does.
pub fn sole_container(pod: &Pod, resource: &str) -> Option<usize> {
    let asks = |c: &Container| requested_units_of(c, resource) > 0;
    let mut asking = containers(pod).filter(|c| asks(c));
    let only = asking.next()?;
    if asking.next().is_some() {
        return None;
    }
    container_index(pod, &only.name)
}

/// What the pod's allocation becomes once each of `placed` (container
/// name, GPU index, units) replaces its container's entry; entries of
/// containers not placed here are kept. `None` when it names no container.
pub fn merged_allocation<'a>(
    pod: &Pod,
    placed: impl IntoIterator<Item = (&'a str, u32, u64)>,
) -> Option<Allocation> {
    let mut merged = allocation(pod).unwrap_or_default();
    for (name, gpu, units) in placed {
        if let Some(index) = container_index(pod, name) {
            merged.insert(index, BTreeMap::from([(gpu, units)]));
        }
    }
    (!merged.is_empty()).then_some(merged)
}

/// The annotation's value for `allocation`, e.g. `{"0":{"1":6}}`.
pub fn allocation_value(allocation: &Allocation) -> Value {
    // Maps with integer keys always serialise.
    Value::String(serde_json::to_string(allocation).unwrap_or_default())
}

pub fn unix_nanos(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos())
}

/// The annotations of a pod placed on GPU `gpu_index` (of `dev_units`),
/// `pod_units` in all: what the extender and the plugin write together.
pub fn placed(
    gpu_index: u32,
    pod_units: u64,
    dev_units: u32,
    now: SystemTime,
) -> Map<String, Value> {
    let mut map = Map::new();
    map.insert(annotation::IDX.into(), json!(gpu_index.to_string()));
    map.insert(annotation::POD.into(), json!(pod_units.to_string()));
    map.insert(annotation::DEV.into(), json!(dev_units.to_string()));
    map.insert(annotation::ASSIGNED.into(), json!("true"));
    map.insert(
        annotation::ASSUME_TIME.into(),
        json!(unix_nanos(now).to_string()),
    );
    map
}

/// Placement at admission by gpushare's extender: matches kubelet's
/// requests to the pods the extender bound here.
pub struct Extender {
    pods: NodePods,
    resource: String,
    policy: Policy,
    /// Bound on the API calls made while kubelet waits.
    bound: Duration,
}

impl Extender {
    pub fn new(pods: NodePods, resource: &str, policy: Policy, bound: Duration) -> Self {
        Extender {
            pods,
            resource: resource.to_owned(),
            policy,
            bound,
        }
    }

    /// The pod a request for `units` is for, from a list made now, as
    /// gpushare's plugin does on every call. Not from the watch: it may
    /// lag one bind and not another, and then GetPreferredAllocation and
    /// Allocate, asking at different moments, would pick different pods
    /// (and the older pod's container would land on the newer one's GPU).
    async fn candidate(&self, units: u64) -> Result<Awaiting, GpushareError> {
        let listed = self.pods.list_now(self.bound).await?;
        next_for(&listed, &self.resource, units).map_err(|awaiting| GpushareError::NoCandidate {
            node: self.pods.node().to_owned(),
            units,
            awaiting,
        })
    }

    /// GetPreferredAllocation for one container: `size` of the `available`
    /// IDs, all on the GPU the extender chose for the oldest pod awaiting
    /// this many units.
    pub async fn prefer(
        &self,
        inv: &Inventory,
        available: &[String],
        must_include: &[String],
        size: i64,
    ) -> Result<Vec<String>, GpushareError> {
        let units = u64::try_from(size).unwrap_or(0);
        let pod = self.candidate(units).await?;
        let position = inv
            .gpus()
            .iter()
            .position(|g| g.gpu.index == pod.gpu_index && g.gpu.healthy)
            .ok_or_else(|| GpushareError::UnknownGpu {
                pod: pod.to_string(),
                index: pod.gpu_index,
            })?;
        let on_gpu: Vec<String> = available
            .iter()
            .filter(|id| inv.resolve(id).is_some_and(|(_, gpu)| gpu == position))
            .cloned()
            .collect();
        if (on_gpu.len() as u64) < units {
            return Err(GpushareError::GpuFull {
                pod: pod.to_string(),
                index: pod.gpu_index,
                units,
                offered: on_gpu.len(),
            });
        }
        let picked = placement::prefer(inv, self.policy, &on_gpu, must_include, size)?;
        info!(pod = %pod, "placed on the GPU gpushare's extender chose");
        Ok(picked)
    }

    /// Allocate for one container placed as `assignment`: finds the pod
    /// of its size the extender put on that GPU (see [`next_on`]) and
    /// marks it assigned.
    pub async fn confirm(
        &self,
        inv: &Inventory,
        assignment: Assignment,
    ) -> Result<(), GpushareError> {
        let gpu = &inv.gpus()[assignment.gpu];
        let units = u64::from(assignment.units);
        let listed = self.pods.list_now(self.bound).await?;
        let pod = match next_on(&listed, &self.resource, units, gpu.gpu.index) {
            Ok(pod) => pod,
            Err(Ok(other)) => {
                return Err(GpushareError::Mismatch {
                    pod: other.to_string(),
                    chosen: other.gpu_index,
                    allocated: gpu.gpu.index,
                })
            }
            Err(Err(awaiting)) => {
                return Err(GpushareError::NoCandidate {
                    node: self.pods.node().to_owned(),
                    units,
                    awaiting,
                })
            }
        };
        let resource = self.resource.clone();
        let assume_time = pod.assume_time;
        let still =
            move |p: &Pod| awaiting(p, &resource).is_some_and(|a| a.assume_time == assume_time);
        let mut annotations = placed(pod.gpu_index, pod.units, gpu.units, SystemTime::now());
        if let Some(container) = pod.container {
            let allocation = BTreeMap::from([(
                container,
                BTreeMap::from([(pod.gpu_index, u64::from(assignment.units))]),
            )]);
            annotations.insert(annotation::ALLOCATION.into(), allocation_value(&allocation));
        }
        match self
            .pods
            .annotate_if(&pod.namespace, &pod.name, &annotations, still, self.bound)
            .await?
        {
            Some(_) => Ok(()),
            None => Err(GpushareError::Gone {
                pod: pod.to_string(),
            }),
        }
    }
}

/// One pod's containers as kubelet's pod-resources lists them.
#[derive(Debug, Default)]
pub struct PlacedPod {
    pub containers: Vec<PlacedContainer>,
}

/// One container: its name, the GPU it is on (by NVML index) and its units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedContainer {
    pub name: String,
    pub gpu: u32,
    pub units: u32,
}

/// Writes gpushare's annotations on every pod placed here whose
/// annotations do not say so yet, so `kubectl inspect gpushare` and `arena
/// top node` show per-GPU use without gpushare's extender: per container
/// (`scheduler.framework.gpushare.allocation`, merged as containers are
/// placed), and per pod for tools that read only `…_IDX`, there the GPU
/// holding most of its units.
pub async fn annotate_placed(
    pods: &NodePods,
    inv: &Inventory,
    placed_pods: &BTreeMap<(String, String), PlacedPod>,
    bound: Duration,
) {
    for ((namespace, name), placed_pod) in placed_pods {
        let Some(most) = placed_pod.containers.iter().max_by_key(|c| c.units) else {
            continue;
        };
        let index = most.gpu;
        let units: u64 = placed_pod
            .containers
            .iter()
            .map(|c| u64::from(c.units))
            .sum();
        let merged = |pod: &Pod| {
            merged_allocation(
                pod,
                placed_pod
                    .containers
                    .iter()
                    .map(|c| (c.name.as_str(), c.gpu, u64::from(c.units))),
            )
        };
        let done = |pod: &Pod| {
            pod.metadata.annotations.as_ref().is_some_and(|a| {
                a.get(annotation::IDX).map(String::as_str) == Some(&index.to_string())
                    && a.get(annotation::ASSIGNED).map(String::as_str) == Some("true")
            }) && allocation(pod) == merged(pod)
        };
        let pod = match pods.by_name(namespace, name) {
            // Not seen yet, or already annotated.
            None => continue,
            Some(pod) if done(&pod) => continue,
            Some(pod) => pod,
        };
        let Some(dev_units) = inv
            .gpus()
            .iter()
            .find(|g| g.gpu.index == index)
            .map(|g| g.units)
        else {
            continue;
        };
        let mut annotations = placed(index, units, dev_units, SystemTime::now());
        if let Some(allocation) = merged(&pod) {
            annotations.insert(annotation::ALLOCATION.into(), allocation_value(&allocation));
        }
        match pods
            .annotate_if(namespace, name, &annotations, |pod| !done(pod), bound)
            .await
        {
            Ok(_) => {
                info!(pod = %format!("{namespace}/{name}"), gpu = index, units, "annotated for gpushare's tools")
            }
            Err(err) => {
                warn!(pod = %format!("{namespace}/{name}"), err = %chain(&err), "cannot annotate pod for gpushare's tools")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, units: u64, annotations: &[(&str, &str)], phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": name,
                "namespace": "default",
                "annotations": annotations.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<Map<_, _>>(),
            },
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": units.to_string()}}}]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn assumed(name: &str, units: u64, idx: &str, time: &str) -> Pod {
        pod(
            name,
            units,
            &[
                (annotation::IDX, idx),
                (annotation::ASSIGNED, "false"),
                (annotation::ASSUME_TIME, time),
            ],
            "Pending",
        )
    }

    const R: &str = "aliyun.com/gpu-mem";

    #[test]
    fn the_oldest_awaiting_pod_with_equal_units_is_chosen() {
        let pods = [
            assumed("late", 4, "1", "300"),
            assumed("early", 4, "0", "100"),
            assumed("other-size", 6, "1", "50"),
        ];
        let found = next_for(&pods, R, 4).unwrap();
        assert_eq!((found.name.as_str(), found.gpu_index), ("early", 0));
        assert_eq!(next_for(&pods, R, 6).unwrap().name, "other-size");
        let none = next_for(&pods, R, 5).unwrap_err();
        assert_eq!(none.len(), 3, "all three are listed in the error");
    }

    #[test]
    fn allocate_takes_the_oldest_awaiting_pod_on_the_allocated_gpu() {
        let pods = [
            assumed("late", 4, "1", "300"),
            assumed("early", 4, "0", "100"),
            assumed("other-size", 6, "1", "50"),
        ];
        assert_eq!(next_on(&pods, R, 4, 1).unwrap().name, "late");
        assert_eq!(next_on(&pods, R, 4, 0).unwrap().name, "early");
        let elsewhere = next_on(&pods, R, 6, 0).unwrap_err().unwrap();
        assert_eq!(
            (elsewhere.name.as_str(), elsewhere.gpu_index),
            ("other-size", 1)
        );
        let none = next_on(&pods, R, 5, 0).unwrap_err().unwrap_err();
        assert_eq!(none.len(), 3, "all three are listed in the error");
    }

    #[test]
    fn assigned_running_and_unannotated_pods_are_not_candidates() {
        let mut assigned = assumed("a", 4, "0", "1");
        assigned
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(annotation::ASSIGNED.into(), "true".into());
        let running = pod(
            "r",
            4,
            &[
                (annotation::IDX, "0"),
                (annotation::ASSIGNED, "false"),
                (annotation::ASSUME_TIME, "1"),
            ],
            "Running",
        );
        let plain = pod("p", 4, &[], "Pending");
        let bad_time = assumed("t", 4, "0", "soon");
        for p in [assigned, running, plain, bad_time] {
            assert_eq!(awaiting(&p, R), None, "{:?}", p.metadata.name);
        }
    }

    #[test]
    fn units_sum_over_containers_and_init_containers() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "two"},
            "spec": {
                "initContainers": [{"name": "i", "resources": {"limits": {R: "4"}}}],
                "containers": [
                    {"name": "a", "resources": {"limits": {R: "3"}}},
                    {"name": "b", "resources": {"requests": {R: "2"}}},
                    {"name": "c"},
                ],
            },
        }))
        .unwrap();
        assert_eq!(requested_units(&p, R), 9);
    }

    #[test]
    fn the_allocation_is_keyed_by_app_container_index_and_merged_per_container() {
        let mut p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "split", "annotations": {
                annotation::ALLOCATION: r#"{"0":{"0":1},"2":{"0":3}}"#,
            }},
            "spec": {
                "initContainers": [{"name": "setup", "resources": {"limits": {R: "2"}}}],
                "containers": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
            },
        }))
        .unwrap();
        let merged = merged_allocation(&p, [("b", 1, 6), ("c", 1, 3), ("setup", 0, 2)]).unwrap();
        assert_eq!(
            allocation_value(&merged),
            r#"{"0":{"0":1},"1":{"1":6},"2":{"1":3}}"#,
            "a kept, b added, c moved; the init container has no index"
        );
        p.metadata.annotations = None;
        assert_eq!(merged_allocation(&p, [("setup", 0, 2)]), None);
        let text = allocation_value(&merged);
        p.metadata.annotations =
            Some([(annotation::ALLOCATION.into(), text.as_str().unwrap().into())].into());
        assert_eq!(allocation(&p), Some(merged));
    }

    #[test]
    fn only_a_pod_with_one_asking_app_container_has_a_sole_container() {
        let with = |init: Value, containers: Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": "p"},
                "spec": {"initContainers": init, "containers": containers},
            }))
            .unwrap()
        };
        let asks = |name: &str| json!({"name": name, "resources": {"limits": {R: "4"}}});
        let plain = |name: &str| json!({"name": name});
        let one = with(json!([plain("i")]), json!([plain("a"), asks("b")]));
        assert_eq!(sole_container(&one, R), Some(1));
        let two = with(json!([]), json!([asks("a"), asks("b")]));
        assert_eq!(sole_container(&two, R), None);
        let init = with(json!([asks("i")]), json!([plain("a")]));
        assert_eq!(
            sole_container(&init, R),
            None,
            "init containers have no index"
        );
    }

    /// A sidecar holds its units beside the app containers for the pod's
    /// life: its entry is keyed past theirs, so gpushare's tools, which sum
    /// every entry per GPU, count them. A regular init container's units
    /// pass on to an app container and stay out.
    #[test]
    fn a_sidecar_has_its_own_entry_past_the_app_containers() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "with-sidecar"},
            "spec": {
                "initContainers": [
                    {"name": "setup", "resources": {"limits": {R: "1"}}},
                    {"name": "proxy", "restartPolicy": "Always", "resources": {"limits": {R: "3"}}},
                ],
                "containers": [{"name": "a"}, {"name": "b"}],
            },
        }))
        .unwrap();
        assert_eq!(container_index(&p, "proxy"), Some(3));
        assert_eq!(container_index(&p, "setup"), None);
        let merged = merged_allocation(&p, [("a", 0, 2), ("proxy", 1, 3), ("setup", 0, 1)]);
        assert_eq!(
            allocation_value(&merged.unwrap()),
            r#"{"0":{"0":2},"3":{"1":3}}"#
        );
        // The sidecar alone asks: the extender's one entry is its own.
        assert_eq!(sole_container(&p, R), None, "setup asks too");
        let mut only: Pod = p.clone();
        if let Some(init) = only.spec.as_mut().and_then(|s| s.init_containers.as_mut()) {
            init.remove(0);
        }
        assert_eq!(sole_container(&only, R), Some(2));
    }

    #[test]
    fn placed_annotations_are_what_gpushare_tools_read() {
        let at = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let map = placed(1, 4, 15, at);
        assert_eq!(map[annotation::IDX], "1");
        assert_eq!(map[annotation::POD], "4");
        assert_eq!(map[annotation::DEV], "15");
        assert_eq!(map[annotation::ASSIGNED], "true");
        assert_eq!(map[annotation::ASSUME_TIME], "1700000000123456789");
    }
}
