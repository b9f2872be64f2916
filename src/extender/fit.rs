//! Which nodes and GPUs can take a pod, and how well: pure functions over
//! the cache, shared by filter, prioritize and bind.
//!
//! A pod's units all go on one GPU (gpushare's protocol names one GPU per
//! pod), so a node fits when one healthy GPU has them free; the node's
//! total does not matter.

use k8s_openapi::api::core::v1::{Container, Pod};

use crate::cluster::gpushare::{containers, requested_units};
use crate::cluster::node::GPUS_ANNOTATION;
use crate::extender::api::{
    node_name, ExtenderArgs, ExtenderFilterResult, FailedNodes, HostPriority, HostPriorityList,
    NodeList, MAX_PRIORITY,
};
use crate::extender::cache::{Cache, NodeProblem};
use crate::node::placement::Policy;

/// A GPU that can take the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuFit {
    /// NVML index (gpushare's `…_IDX`).
    pub index: u32,
    /// Units the GPU has (gpushare's `…_DEV`).
    pub size: u32,
    /// Units free on it before the pod.
    pub free: u64,
}

/// Why a node cannot take the pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unfit {
    pub reason: String,
    /// Whether preempting pods there could make room.
    pub resolvable: bool,
}

impl Unfit {
    fn unresolvable(reason: String) -> Unfit {
        Unfit {
            reason,
            resolvable: false,
        }
    }
}

impl std::fmt::Display for Unfit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Units of `resource` the pod asks for (0: none, the extender lets it
/// be). `Err` for a pod the node plugin cannot place: it follows gpushare's
/// protocol, which matches one GPU container per pod.
pub fn request(pod: &Pod, resource: &str) -> Result<u64, String> {
    let asks = |c: &Container| {
        c.resources.as_ref().is_some_and(|r| {
            [&r.limits, &r.requests].into_iter().any(|m| {
                m.as_ref()
                    .and_then(|m| m.get(resource))
                    .is_some_and(|q| q.0.trim() != "0")
            })
        })
    };
    // Init containers get their own Allocate from kubelet too.
    let asking = containers(pod).filter(|c| asks(c)).count();
    if asking > 1 {
        let init = pod
            .spec
            .as_ref()
            .and_then(|s| s.init_containers.as_ref())
            .map_or(0, |init| init.iter().filter(|c| asks(c)).count());
        let of_them = match init {
            0 => String::new(),
            1 => " (one of them an init container)".to_owned(),
            n => format!(" ({n} of them init containers)"),
        };
        return Err(format!(
            "the pod asks for {resource} in {asking} containers{of_them}; the node plugin places \
             a pod's units on one GPU and matches them to one container (gpushare's protocol), \
             so put them in one container"
        ));
    }
    Ok(requested_units(pod, resource))
}

/// The GPU on `node` that takes `units` by `policy`: binpack takes the one
/// with the fewest free units that still fit, spread the one with the most;
/// ties go to the lower index.
pub fn choose(cache: &Cache, node: &str, units: u64, policy: Policy) -> Result<GpuFit, Unfit> {
    let gpus = match cache.gpus(node) {
        Some(Ok(gpus)) => gpus,
        Some(Err(NodeProblem::NotPublished)) => {
            return Err(Unfit::unresolvable(format!(
                "the gpumem plugin has not published node {node}'s GPUs (no {GPUS_ANNOTATION} \
                 annotation): is `gpumem plugin --node-name` running there?"
            )))
        }
        Some(Err(NodeProblem::Invalid(err))) => {
            return Err(Unfit::unresolvable(format!(
                "node {node}'s {GPUS_ANNOTATION} annotation is not a GPU list: {err}"
            )))
        }
        None => {
            return Err(Unfit::unresolvable(format!(
                "node {node} is not in the extender's node cache (yet)"
            )))
        }
    };
    let usage = cache.usage(node);
    let unplaced = usage.unplaced();
    let mut best: Option<GpuFit> = None;
    for gpu in gpus.iter().filter(|g| g.healthy) {
        let free = u64::from(gpu.units).saturating_sub(usage.used(gpu.index));
        if free.saturating_sub(unplaced) < units {
            continue;
        }
        let fit = GpuFit {
            index: gpu.index,
            size: gpu.units,
            free: free - unplaced,
        };
        let better = match (best, policy) {
            (None, _) => true,
            (Some(b), Policy::Binpack) => fit.free < b.free,
            (Some(b), Policy::Spread) => fit.free > b.free,
        };
        if better {
            best = Some(fit);
        }
    }
    if let Some(fit) = best {
        return Ok(fit);
    }
    if gpus.is_empty() {
        return Err(Unfit::unresolvable(format!(
            "node {node} has no GPUs (its {GPUS_ANNOTATION} annotation is an empty list)"
        )));
    }
    let per_gpu: Vec<String> = gpus
        .iter()
        .map(|g| {
            if g.healthy {
                let free = u64::from(g.units).saturating_sub(usage.used(g.index));
                format!("GPU{} {free}", g.index)
            } else {
                format!("GPU{} unhealthy", g.index)
            }
        })
        .collect();
    let mut reason = format!(
        "no single healthy GPU has {units} free units (free per GPU: {})",
        per_gpu.join(", ")
    );
    if unplaced > 0 {
        reason.push_str(&format!(
            "; {unplaced} units of pods bound without a GPU index may be on any of them"
        ));
    }
    let resolvable = gpus
        .iter()
        .any(|g| g.healthy && u64::from(g.units) >= units);
    if !resolvable {
        reason.push_str(&format!("; no healthy GPU here has {units} units at all"));
    }
    Err(Unfit { reason, resolvable })
}

/// 0..=10: how well placing `units` on `gpu` serves `policy`: binpack
/// scores how full the GPU is after, spread how empty.
pub fn score(gpu: &GpuFit, units: u64, policy: Policy) -> i64 {
    let size = u64::from(gpu.size);
    if size == 0 {
        return 0;
    }
    let free_after = gpu.free.saturating_sub(units).min(size);
    let part = match policy {
        Policy::Binpack => size - free_after,
        Policy::Spread => free_after,
    };
    // Rounded to the nearest step.
    let max = MAX_PRIORITY as u64;
    ((max * part * 2 + size) / (size * 2)) as i64
}

/// The filter verb: the candidates where one healthy GPU has the pod's
/// units free, each other one with its reason. Answers in the form asked
/// (names for a `nodeCacheCapable` extender, whole nodes otherwise); a pod
/// that asks for no units passes every node unchanged.
pub fn filter(cache: &Cache, args: ExtenderArgs) -> ExtenderFilterResult {
    let Some(pod) = &args.pod else {
        return ExtenderFilterResult {
            error: "the filter request has no Pod".into(),
            ..ExtenderFilterResult::default()
        };
    };
    let request = request(pod, cache.resource());
    if request == Ok(0) {
        return ExtenderFilterResult {
            nodes: args.nodes,
            node_names: args.node_names,
            ..ExtenderFilterResult::default()
        };
    }
    let mut failed = FailedNodes::new();
    let mut unresolvable = FailedNodes::new();
    let mut passes = |node: &str| {
        let outcome = match &request {
            Ok(units) => choose(cache, node, *units, Policy::Binpack).map(|_| ()),
            Err(reason) => Err(Unfit::unresolvable(reason.clone())),
        };
        match outcome {
            Ok(()) => true,
            Err(unfit) if unfit.resolvable => {
                failed.insert(node.to_owned(), unfit.reason);
                false
            }
            Err(unfit) => {
                unresolvable.insert(node.to_owned(), unfit.reason);
                false
            }
        }
    };
    let mut result = ExtenderFilterResult::default();
    match (args.node_names, args.nodes) {
        (Some(names), _) => {
            result.node_names = Some(names.into_iter().filter(|n| passes(n)).collect());
        }
        (None, Some(list)) => {
            let items = list
                .items
                .into_iter()
                .filter(|n| node_name(n).is_some_and(|name| passes(&name)))
                .collect();
            result.nodes = Some(NodeList {
                metadata: list.metadata,
                items,
            });
        }
        (None, None) => {}
    }
    result.failed_nodes = failed;
    result.failed_and_unresolvable_nodes = unresolvable;
    result
}

/// The prioritize verb: each candidate's score for `policy`, 0 where the
/// pod does not fit or asks for no units.
pub fn prioritize(cache: &Cache, args: &ExtenderArgs, policy: Policy) -> HostPriorityList {
    let units = args
        .pod
        .as_ref()
        .and_then(|pod| request(pod, cache.resource()).ok())
        .unwrap_or(0);
    args.candidates()
        .into_iter()
        .map(|host| HostPriority {
            score: match units {
                0 => 0,
                units => {
                    choose(cache, &host, units, policy).map_or(0, |gpu| score(&gpu, units, policy))
                }
            },
            host,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extender::cache::tests::{node, pod, R};
    use k8s_openapi::api::core::v1::Node;
    use serde_json::json;
    use serde_json::value::RawValue;

    /// v100: two 15-unit GPUs, 5 used on each; a10: one 22-unit GPU, 6
    /// used; sick: a free 22-unit GPU that is unhealthy and a 15-unit one.
    fn cache() -> Cache {
        let mut cache = Cache::new(R);
        let bare: Node = serde_json::from_value(json!({"metadata": {"name": "bare"}})).unwrap();
        cache.replace_nodes([
            &node("v100", &[(15, true), (15, true)]),
            &node("a10", &[(22, true)]),
            &node("sick", &[(22, false), (15, true)]),
            &bare,
        ]);
        cache.replace_pods([
            &pod("v0", 5, Some("v100"), Some(0), "Running"),
            &pod("v1", 5, Some("v100"), Some(1), "Running"),
            &pod("a", 6, Some("a10"), Some(0), "Running"),
        ]);
        cache
    }

    fn asking(units: u64) -> Pod {
        pod("new", units, None, None, "Pending")
    }

    fn args(units: u64, nodes: &[&str]) -> ExtenderArgs {
        ExtenderArgs {
            pod: Some(asking(units)),
            nodes: None,
            node_names: Some(nodes.iter().map(|n| n.to_string()).collect()),
        }
    }

    #[test]
    fn a_node_fits_only_where_one_gpu_has_the_units_free() {
        let result = filter(&cache(), args(15, &["v100", "a10", "bare"]));
        assert_eq!(result.node_names, Some(vec!["a10".to_owned()]));
        assert_eq!(
            result.failed_nodes["v100"],
            "no single healthy GPU has 15 free units (free per GPU: GPU0 10, GPU1 10)"
        );
        assert!(result.failed_and_unresolvable_nodes["bare"].contains("has not published"));
        assert_eq!(result.error, "");
    }

    #[test]
    fn a_request_no_gpu_could_ever_hold_is_unresolvable() {
        let result = filter(&cache(), args(16, &["v100"]));
        assert!(result.failed_nodes.is_empty());
        assert!(result.failed_and_unresolvable_nodes["v100"].ends_with("has 16 units at all"));
    }

    #[test]
    fn pods_asking_for_no_units_pass_every_node_unchanged() {
        let list = NodeList {
            metadata: Some(json!({})),
            items: vec![RawValue::from_string(
                r#"{"metadata": {"name": "bare"}, "spec": {}}"#.into(),
            )
            .unwrap()],
        };
        let request = ExtenderArgs {
            pod: Some(asking(0)),
            nodes: Some(list.clone()),
            node_names: None,
        };
        let result = filter(&cache(), request);
        assert_eq!(
            serde_json::to_value(result.nodes).unwrap(),
            serde_json::to_value(Some(list)).unwrap()
        );
        assert!(result.failed_and_unresolvable_nodes.is_empty());
    }

    #[test]
    fn unhealthy_gpus_are_never_chosen() {
        let cache = cache();
        let fit = choose(&cache, "sick", 4, Policy::Spread).unwrap();
        assert_eq!(fit.index, 1, "the emptier GPU is unhealthy");
        let unfit = choose(&cache, "sick", 16, Policy::Binpack).unwrap_err();
        assert_eq!(
            unfit.reason,
            "no single healthy GPU has 16 free units (free per GPU: GPU0 unhealthy, GPU1 15); \
             no healthy GPU here has 16 units at all"
        );
    }

    #[test]
    fn binpack_and_spread_choose_opposite_gpus_and_nodes() {
        let mut cache = cache();
        cache.apply_pod(&pod("more", 3, Some("v100"), Some(1), "Running"));
        assert_eq!(choose(&cache, "v100", 2, Policy::Binpack).unwrap().index, 1);
        assert_eq!(choose(&cache, "v100", 2, Policy::Spread).unwrap().index, 0);
        let request = args(4, &["v100", "a10"]);
        let binpack = prioritize(&cache, &request, Policy::Binpack);
        let spread = prioritize(&cache, &request, Policy::Spread);
        // v100's GPU1 ends 12/15 full; a10's GPU ends 10/22 full.
        assert_eq!((binpack[0].score, binpack[1].score), (8, 5));
        // v100's GPU0 ends 6/15 free; a10's 12/22.
        assert_eq!((spread[0].score, spread[1].score), (4, 5));
    }

    #[test]
    fn units_held_on_no_known_gpu_count_against_every_gpu() {
        let mut cache = cache();
        cache.apply_pod(&pod("legacy", 2, Some("a10"), None, "Running"));
        let unfit = choose(&cache, "a10", 15, Policy::Binpack).unwrap_err();
        assert!(
            unfit
                .reason
                .contains("2 units of pods bound without a GPU index"),
            "{unfit}"
        );
        assert_eq!(choose(&cache, "a10", 14, Policy::Binpack).unwrap().free, 14);
    }

    #[test]
    fn several_gpu_containers_are_refused_on_every_node() {
        let mut two = asking(2);
        let container = two.spec.as_ref().unwrap().containers[0].clone();
        two.spec.as_mut().unwrap().containers.push(container);
        let request = ExtenderArgs {
            pod: Some(two),
            ..args(0, &["v100", "a10"])
        };
        let result = filter(&cache(), request);
        assert_eq!(result.node_names, Some(vec![]));
        assert_eq!(result.failed_and_unresolvable_nodes.len(), 2);
        assert!(result.failed_and_unresolvable_nodes["a10"].contains("in 2 containers"));

        // An init container's units are a container's too: kubelet asks
        // the node plugin to place them on their own.
        let mut init = asking(2);
        let spec = init.spec.as_mut().unwrap();
        spec.init_containers = Some(vec![spec.containers[0].clone()]);
        let request = ExtenderArgs {
            pod: Some(init),
            ..args(0, &["v100", "a10"])
        };
        let result = filter(&cache(), request);
        assert_eq!(result.node_names, Some(vec![]));
        let reason = &result.failed_and_unresolvable_nodes["a10"];
        assert!(
            reason.contains("in 2 containers (one of them an init container)"),
            "{reason}"
        );
    }

    #[test]
    fn scores_span_zero_to_ten() {
        let full = GpuFit {
            index: 0,
            size: 16,
            free: 16,
        };
        assert_eq!(score(&full, 16, Policy::Binpack), 10);
        assert_eq!(score(&full, 16, Policy::Spread), 0);
        assert_eq!(score(&full, 1, Policy::Binpack), 1);
        assert_eq!(score(&full, 1, Policy::Spread), 9);
    }
}
