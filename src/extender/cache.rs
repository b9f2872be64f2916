//! The extender's books: each node's GPUs as its plugin published them, and
//! the units each pod holds on them, from the watches and from binds the
//! watches have not shown yet (assumptions).
//!
//! Pure: no I/O, and time is passed in, so the tests and the benchmark
//! drive it directly. A pod holds units on a GPU while it is bound to a
//! node, names the GPU in gpushare's `…_IDX` annotation (or, placed over
//! several, in its per-container allocation), and has not
//! finished (Succeeded or Failed); a terminating pod still holds them until
//! it is gone, as its processes may still hold the memory.

use crate::error_text::one_line;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};

use crate::cluster::gpushare::{allocation, annotation, requested_units, sole_container};
use crate::cluster::node::{PublishedGpu, GPUS_ANNOTATION};

/// Why a node's GPUs are not known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeProblem {
    /// No `gpumem.io/gpus` annotation: no gpumem plugin with `--node-name`
    /// has run there (or it is not a GPU node).
    NotPublished,
    /// The annotation is not a GPU list.
    Invalid(String),
}

/// Counts of what the books hold.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Census {
    /// Nodes with a readable published GPU list.
    pub gpu_nodes: usize,
    /// Nodes no gpumem plugin has published GPUs on.
    pub unpublished_nodes: usize,
    /// Nodes whose published GPU list cannot be read.
    pub invalid_nodes: usize,
    pub healthy_gpus: usize,
    pub unhealthy_gpus: usize,
    /// Binds waiting for the pod watch to show them.
    pub bookings: usize,
}

/// What the pods on one node hold.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Usage {
    /// Units held per GPU index, by bound pods and by assumptions.
    per_gpu: BTreeMap<u32, u64>,
    /// Units held by bound pods that name no GPU: they may be on any.
    unplaced: u64,
}

impl Usage {
    /// Units held on the GPU with this NVML index.
    pub fn used(&self, gpu: u32) -> u64 {
        self.per_gpu.get(&gpu).copied().unwrap_or(0)
    }

    /// Units held by bound pods without a GPU index.
    pub fn unplaced(&self) -> u64 {
        self.unplaced
    }

    fn add(&mut self, gpu: Option<u32>, units: u64) {
        match gpu {
            Some(gpu) => *self.per_gpu.entry(gpu).or_default() += units,
            None => self.unplaced += units,
        }
    }

    fn sub(&mut self, gpu: Option<u32>, units: u64) {
        match gpu {
            Some(gpu) => {
                if let Some(used) = self.per_gpu.get_mut(&gpu) {
                    *used = used.saturating_sub(units);
                    if *used == 0 {
                        self.per_gpu.remove(&gpu);
                    }
                }
            }
            None => self.unplaced = self.unplaced.saturating_sub(units),
        }
    }

    fn is_empty(&self) -> bool {
        self.per_gpu.is_empty() && self.unplaced == 0
    }
}

/// A pod asking for units of the resource, as last seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRecord {
    pub namespace: String,
    pub name: String,
    /// Units over all its containers.
    pub units: u64,
    /// The node it is bound to.
    pub node: Option<String>,
    /// The GPU gpushare's `…_IDX` annotation names.
    pub gpu: Option<u32>,
    /// Succeeded or Failed: it holds nothing.
    pub finished: bool,
    /// Where its one container asking for units is in `spec.containers`.
    pub container: Option<usize>,
    /// Units per GPU from gpushare's per-container allocation, for a pod
    /// placed over several GPUs (without the extender); empty when the pod
    /// carries none, or one that claims more units than the pod asks for.
    pub split: BTreeMap<u32, u64>,
}

impl PodRecord {
    /// The record of a pod that asks for units of `resource`.
    pub fn of(pod: &Pod, resource: &str) -> Option<PodRecord> {
        let units = requested_units(pod, resource);
        if units == 0 {
            return None;
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        Some(PodRecord {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            units,
            node: pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.clone())
                .filter(|n| !n.is_empty()),
            gpu: pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(annotation::IDX))
                .and_then(|idx| idx.trim().parse().ok()),
            finished: matches!(phase, Some("Succeeded" | "Failed")),
            container: sole_container(pod, resource),
            split: split(pod, units),
        })
    }

    /// Where it holds units: its node, and each GPU with its units (`None`:
    /// unknown GPU). Units the per-container allocation does not place
    /// (an init container's) count on the `…_IDX` GPU.
    fn holds(&self) -> Option<(&str, Vec<Held>)> {
        if self.finished {
            return None;
        }
        let node = self.node.as_deref()?;
        let placed: u64 = self.split.values().sum();
        let mut held: Vec<Held> = self
            .split
            .iter()
            .map(|(&gpu, &units)| (Some(gpu), units))
            .collect();
        if placed < self.units {
            held.push((self.gpu, self.units - placed));
        }
        Some((node, held))
    }
}

/// Units on one GPU (`None`: unknown GPU).
type Held = (Option<u32>, u64);

/// Units per GPU that the pod's per-container allocation names, if it
/// names no more than the pod's `units` in all.
fn split(pod: &Pod, units: u64) -> BTreeMap<u32, u64> {
    let mut per_gpu = BTreeMap::<u32, u64>::new();
    for (&gpu, &held) in allocation(pod).iter().flat_map(|a| a.values()).flatten() {
        *per_gpu.entry(gpu).or_default() += held;
    }
    if per_gpu.values().sum::<u64>() > units {
        return BTreeMap::new();
    }
    per_gpu
}

/// A bind the watch has not shown yet: its units count on its GPU until
/// the watch shows the pod bound, the bind fails, or `deadline` passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assumption {
    /// Tells a retried bind's assumption from the one it replaced.
    pub id: u64,
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub node: String,
    pub gpu: u32,
    pub units: u64,
    pub deadline: Instant,
}

impl std::fmt::Display for Assumption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}/{} ({} units on GPU {} of {})",
            self.namespace, self.name, self.units, self.gpu, self.node
        )
    }
}

/// The pod to assume, and where.
#[derive(Debug, Clone)]
pub struct Assume<'a> {
    pub uid: &'a str,
    pub namespace: &'a str,
    pub name: &'a str,
    pub node: &'a str,
    pub gpu: u32,
    pub units: u64,
}

pub struct Cache {
    resource: String,
    nodes: HashMap<String, Result<Vec<PublishedGpu>, NodeProblem>>,
    usage: HashMap<String, Usage>,
    /// By UID; only pods that ask for units of the resource.
    pods: HashMap<String, PodRecord>,
    /// By pod UID.
    assumed: HashMap<String, Assumption>,
    next_id: u64,
    pods_listed: bool,
    nodes_listed: bool,
    /// Watches whose errors have come with nothing delivered since, by
    /// what they watch.
    failing: BTreeMap<&'static str, Failing>,
}

/// A watch's errors since it last delivered anything.
#[derive(Debug, Clone)]
struct Failing {
    first: Instant,
    last: Instant,
    errors: u32,
    error: String,
}

/// Errors in a row after which the books count as stale. The watcher
/// retries at 0.8, 1.6, 3.2 s… (kube-runtime's default backoff, jittered),
/// so three take about 2.5–5 s: longer than a blip (an API server replica
/// restarting costs one or two), short next to the readiness probe's
/// period × threshold.
pub const STALE_AFTER_ERRORS: u32 = 3;

/// How long after its last error a silent watch counts as recovered: the
/// watcher's backoff retries at least every 30 s (kube-runtime's default),
/// so a failure that lasts shows an error within this; a watch that got
/// through shows nothing until the cluster changes.
pub const RECOVERED_AFTER: Duration = Duration::from_secs(60);

static NO_USAGE: std::sync::LazyLock<Usage> = std::sync::LazyLock::new(Usage::default);

impl Cache {
    /// Empty books for pods asking for `resource`.
    pub fn new(resource: &str) -> Cache {
        Cache {
            resource: resource.to_owned(),
            nodes: HashMap::new(),
            usage: HashMap::new(),
            pods: HashMap::new(),
            assumed: HashMap::new(),
            next_id: 0,
            pods_listed: false,
            nodes_listed: false,
            failing: BTreeMap::new(),
        }
    }

    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// Whether both watches have delivered their first full list.
    pub fn synced(&self) -> bool {
        self.pods_listed && self.nodes_listed
    }

    /// The watch of `what` failed at `now` with `error`.
    pub fn watch_failed(&mut self, what: &'static str, error: String, now: Instant) {
        let failing = self.failing.entry(what).or_insert_with(|| Failing {
            first: now,
            last: now,
            errors: 0,
            error: String::new(),
        });
        if now.saturating_duration_since(failing.last) >= RECOVERED_AFTER {
            // It got through in between: a new failure.
            failing.first = now;
            failing.errors = 0;
        }
        failing.last = now;
        failing.errors += 1;
        failing.error = error;
    }

    /// The watch of `what` delivered a change or a list: it works.
    pub fn watch_delivered(&mut self, what: &'static str) {
        self.failing.remove(what);
    }

    /// Why the books may be stale at `now`: a watch that failed
    /// [`STALE_AFTER_ERRORS`] times in a row, the last less than
    /// [`RECOVERED_AFTER`] ago.
    pub fn stale(&self, now: Instant) -> Option<String> {
        self.failing.iter().find_map(|(what, f)| {
            let recent = now.saturating_duration_since(f.last) < RECOVERED_AFTER;
            (f.errors >= STALE_AFTER_ERRORS && recent).then(|| {
                format!(
                    "the {what} watch has failed {} times in a row over {} s (last error: {}); \
                     the extender's view of GPU usage may be stale",
                    f.errors,
                    now.saturating_duration_since(f.first).as_secs(),
                    f.error
                )
            })
        })
    }

    /// A node's GPUs as published; `None`: no such node seen.
    pub fn gpus(&self, node: &str) -> Option<&Result<Vec<PublishedGpu>, NodeProblem>> {
        self.nodes.get(node)
    }

    /// What the pods on `node` hold, assumptions included.
    pub fn usage(&self, node: &str) -> &Usage {
        self.usage.get(node).unwrap_or(&NO_USAGE)
    }

    /// A pod that asks for units, by UID.
    pub fn pod(&self, uid: &str) -> Option<&PodRecord> {
        self.pods.get(uid)
    }

    /// The assumption made for a pod, by UID.
    pub fn assumption(&self, uid: &str) -> Option<&Assumption> {
        self.assumed.get(uid)
    }

    pub fn assumptions(&self) -> impl Iterator<Item = &Assumption> {
        self.assumed.values()
    }

    /// What the books hold, for the metrics.
    pub fn census(&self) -> Census {
        let mut census = Census {
            bookings: self.assumed.len(),
            ..Census::default()
        };
        for gpus in self.nodes.values() {
            match gpus {
                Ok(gpus) => {
                    census.gpu_nodes += 1;
                    let healthy = gpus.iter().filter(|g| g.healthy).count();
                    census.healthy_gpus += healthy;
                    census.unhealthy_gpus += gpus.len() - healthy;
                }
                Err(NodeProblem::NotPublished) => census.unpublished_nodes += 1,
                Err(NodeProblem::Invalid(_)) => census.invalid_nodes += 1,
            }
        }
        census
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn pod_count(&self) -> usize {
        self.pods.len()
    }

    /// A node added or changed.
    pub fn apply_node(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.clone() else {
            return;
        };
        let gpus = match node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(GPUS_ANNOTATION))
        {
            None => Err(NodeProblem::NotPublished),
            Some(text) => serde_json::from_str::<Vec<PublishedGpu>>(text)
                .map_err(|err| NodeProblem::Invalid(one_line(&err))),
        };
        self.nodes.insert(name, gpus);
    }

    pub fn remove_node(&mut self, name: &str) {
        self.nodes.remove(name);
    }

    /// Every node, from a full list (at start and after the watch relists).
    pub fn replace_nodes<'a>(&mut self, nodes: impl IntoIterator<Item = &'a Node>) {
        self.nodes.clear();
        for node in nodes {
            self.apply_node(node);
        }
        self.nodes_listed = true;
    }

    /// A pod added or changed. Seen bound (or finished), it confirms the
    /// assumption made for it, which then stops counting: the pod's own
    /// record counts instead. Returns the assumption so confirmed.
    pub fn apply_pod(&mut self, pod: &Pod) -> Option<Assumption> {
        let uid = pod.metadata.uid.as_deref()?;
        let record = PodRecord::of(pod, &self.resource);
        if let Some(old) = self.pods.remove(uid) {
            self.release(&old);
        }
        let record = record?;
        let mut confirmed = None;
        if record.node.is_some() || record.finished {
            if let Some(assumed) = self.assumed.remove(uid) {
                self.release_assumed(&assumed);
                confirmed = Some(assumed);
            }
        }
        self.hold(&record);
        self.pods.insert(uid.to_owned(), record);
        confirmed
    }

    /// A pod deleted: what it held and any assumption for it go.
    pub fn remove_pod(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        if let Some(old) = self.pods.remove(uid) {
            self.release(&old);
        }
        if let Some(assumed) = self.assumed.remove(uid) {
            self.release_assumed(&assumed);
        }
    }

    /// Every pod, from a full list (at start and after the watch relists):
    /// usage is rebuilt from the pods' annotations and the assumptions the
    /// list does not confirm.
    pub fn replace_pods<'a>(&mut self, pods: impl IntoIterator<Item = &'a Pod>) {
        self.pods.clear();
        self.usage.clear();
        let assumed: Vec<Assumption> = self.assumed.values().cloned().collect();
        for a in &assumed {
            self.usage_mut(&a.node).add(Some(a.gpu), a.units);
        }
        for pod in pods {
            self.apply_pod(pod);
        }
        self.pods_listed = true;
    }

    /// Books `units` on a GPU for a pod being bound, until `deadline`.
    /// Replaces an earlier assumption for the same pod (a retried bind).
    pub fn assume(&mut self, pod: Assume<'_>, deadline: Instant) -> Assumption {
        if let Some(old) = self.assumed.remove(pod.uid) {
            self.release_assumed(&old);
        }
        self.next_id += 1;
        let assumption = Assumption {
            id: self.next_id,
            uid: pod.uid.to_owned(),
            namespace: pod.namespace.to_owned(),
            name: pod.name.to_owned(),
            node: pod.node.to_owned(),
            gpu: pod.gpu,
            units: pod.units,
            deadline,
        };
        self.usage_mut(pod.node).add(Some(pod.gpu), pod.units);
        self.assumed
            .insert(assumption.uid.clone(), assumption.clone());
        assumption
    }

    /// Drops an assumption whose bind failed; `false` when it is no longer
    /// there (confirmed, expired, or replaced by a newer bind).
    pub fn forget(&mut self, assumption: &Assumption) -> bool {
        match self.assumed.get(&assumption.uid) {
            Some(current) if current.id == assumption.id => {
                self.assumed.remove(&assumption.uid);
                self.release_assumed(assumption);
                true
            }
            _ => false,
        }
    }

    /// Drops the assumptions whose deadline has passed at `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Assumption> {
        if self.assumed.values().all(|a| a.deadline > now) {
            return Vec::new();
        }
        let expired: Vec<Assumption> = self
            .assumed
            .values()
            .filter(|a| a.deadline <= now)
            .cloned()
            .collect();
        for a in &expired {
            self.assumed.remove(&a.uid);
            self.release_assumed(a);
        }
        expired
    }

    fn usage_mut(&mut self, node: &str) -> &mut Usage {
        self.usage.entry(node.to_owned()).or_default()
    }

    fn hold(&mut self, record: &PodRecord) {
        if let Some((node, held)) = record.holds() {
            let usage = self.usage_mut(node);
            for (gpu, units) in held {
                usage.add(gpu, units);
            }
        }
    }

    fn release(&mut self, record: &PodRecord) {
        if let Some((node, held)) = record.holds() {
            for (gpu, units) in held {
                self.take_back(node, gpu, units);
            }
        }
    }

    fn release_assumed(&mut self, a: &Assumption) {
        self.take_back(&a.node, Some(a.gpu), a.units);
    }

    fn take_back(&mut self, node: &str, gpu: Option<u32>, units: u64) {
        if let Some(usage) = self.usage.get_mut(node) {
            usage.sub(gpu, units);
            if usage.is_empty() {
                self.usage.remove(node);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    pub const R: &str = "aliyun.com/gpu-mem";

    pub fn node(name: &str, gpus: &[(u32, bool)]) -> Node {
        let gpus: Vec<PublishedGpu> = gpus
            .iter()
            .enumerate()
            .map(|(i, &(units, healthy))| PublishedGpu {
                index: i as u32,
                uuid: format!("GPU-{name}-{i}"),
                model: "Tesla V100-SXM2-16GB".into(),
                memory_mib: u64::from(units) * 1024,
                units,
                healthy,
            })
            .collect();
        serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {
                GPUS_ANNOTATION: serde_json::to_string(&gpus).unwrap(),
            }},
        }))
        .unwrap()
    }

    pub fn pod(uid: &str, units: u64, node: Option<&str>, gpu: Option<u32>, phase: &str) -> Pod {
        let mut annotations = serde_json::Map::new();
        if let Some(gpu) = gpu {
            annotations.insert(annotation::IDX.into(), json!(gpu.to_string()));
        }
        serde_json::from_value(json!({
            "metadata": {"name": uid, "namespace": "default", "uid": uid, "annotations": annotations},
            "spec": {
                "nodeName": node,
                "containers": [{"name": "c", "resources": {"limits": {R: units.to_string()}}}],
            },
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn assume<'a>(uid: &'a str, node: &'a str, gpu: u32, units: u64) -> Assume<'a> {
        Assume {
            uid,
            namespace: "default",
            name: uid,
            node,
            gpu,
            units,
        }
    }

    #[test]
    fn bound_pods_hold_units_on_their_gpu_until_they_finish_or_go() {
        let mut cache = Cache::new(R);
        let running = pod("a", 4, Some("n"), Some(1), "Running");
        cache.replace_pods([
            &running,
            &pod("b", 3, Some("n"), Some(1), "Pending"),
            &pod("no-idx", 2, Some("n"), None, "Running"),
            &pod("done", 5, Some("n"), Some(1), "Succeeded"),
            &pod("unbound", 6, None, None, "Pending"),
            &pod("other-resource", 0, Some("n"), Some(1), "Running"),
        ]);
        let usage = cache.usage("n");
        assert_eq!((usage.used(0), usage.used(1), usage.unplaced()), (0, 7, 2));
        assert_eq!(
            cache.pod_count(),
            5,
            "pods asking for no units are not kept"
        );
        cache.apply_pod(&pod("a", 4, Some("n"), Some(1), "Failed"));
        assert_eq!(cache.usage("n").used(1), 3);
        cache.remove_pod(&pod("b", 3, Some("n"), Some(1), "Pending"));
        assert_eq!(cache.usage("n").used(1), 0);
    }

    #[test]
    fn a_pod_split_over_gpus_holds_units_on_each_as_its_allocation_says() {
        let mut cache = Cache::new(R);
        let with_allocation = |uid: &str, units: u64, allocation: &str| {
            let mut p = pod(uid, units, Some("n"), Some(1), "Running");
            p.metadata
                .annotations
                .get_or_insert_default()
                .insert(annotation::ALLOCATION.into(), allocation.into());
            p
        };
        let split = with_allocation("split", 7, r#"{"0":{"0":1},"1":{"1":6}}"#);
        let bogus = with_allocation("bogus", 2, r#"{"0":{"0":9}}"#);
        let partial = with_allocation("partial", 5, r#"{"0":{"0":3}}"#);
        cache.replace_pods([&split, &bogus, &partial]);
        let usage = cache.usage("n");
        assert_eq!(
            (usage.used(0), usage.used(1)),
            (1 + 3, 6 + 2 + 2),
            "split per its allocation; an allocation claiming more than the pod \
             asks is ignored; units it leaves out count on `…_IDX`"
        );
        cache.remove_pod(&split);
        cache.remove_pod(&bogus);
        cache.remove_pod(&partial);
        assert_eq!(cache.usage("n"), &Usage::default());
    }

    #[test]
    fn an_assumption_counts_until_the_watch_shows_the_pod_bound() {
        let mut cache = Cache::new(R);
        let start = Instant::now();
        cache.replace_pods([&pod("p", 4, None, None, "Pending")]);
        cache.assume(assume("p", "n", 0, 4), start + Duration::from_secs(60));
        assert_eq!(cache.usage("n").used(0), 4);
        // The bind shows in the watch: counted once, by the pod.
        let confirmed = cache.apply_pod(&pod("p", 4, Some("n"), Some(0), "Pending"));
        assert_eq!(confirmed.map(|a| a.uid), Some("p".to_owned()));
        assert_eq!(cache.usage("n").used(0), 4);
        assert!(cache.assumption("p").is_none());
        assert!(cache.expire(start + Duration::from_secs(120)).is_empty());
        assert_eq!(cache.usage("n").used(0), 4);
    }

    #[test]
    fn an_assumption_not_confirmed_in_time_expires() {
        let mut cache = Cache::new(R);
        let start = Instant::now();
        let a = cache.assume(assume("p", "n", 1, 6), start + Duration::from_secs(60));
        assert!(cache.expire(start + Duration::from_secs(59)).is_empty());
        assert_eq!(cache.usage("n").used(1), 6);
        assert_eq!(cache.expire(start + Duration::from_secs(60)), [a]);
        assert_eq!(cache.usage("n").used(1), 0);
    }

    #[test]
    fn a_failed_bind_forgets_only_its_own_assumption() {
        let mut cache = Cache::new(R);
        let deadline = Instant::now() + Duration::from_secs(60);
        let first = cache.assume(assume("p", "n", 0, 2), deadline);
        let retry = cache.assume(assume("p", "n", 1, 2), deadline);
        assert_eq!((cache.usage("n").used(0), cache.usage("n").used(1)), (0, 2));
        assert!(!cache.forget(&first), "replaced by the retry");
        assert_eq!(cache.usage("n").used(1), 2);
        assert!(cache.forget(&retry));
        assert_eq!(cache.usage("n").used(1), 0);
    }

    #[test]
    fn a_relist_rebuilds_usage_and_keeps_unconfirmed_assumptions() {
        let mut cache = Cache::new(R);
        let deadline = Instant::now() + Duration::from_secs(60);
        cache.replace_pods([&pod("old", 3, Some("n"), Some(0), "Running")]);
        cache.assume(assume("new", "n", 0, 2), deadline);
        cache.assume(assume("seen", "n", 1, 5), deadline);
        // The relist no longer has "old", and shows "seen" bound.
        cache.replace_pods([&pod("seen", 5, Some("n"), Some(1), "Pending")]);
        let usage = cache.usage("n");
        assert_eq!((usage.used(0), usage.used(1)), (2, 5));
        assert!(cache.assumption("new").is_some());
        assert!(cache.assumption("seen").is_none());
        assert!(!cache.synced(), "nodes not listed yet");
        cache.replace_nodes([&node("n", &[(15, true)])]);
        assert!(cache.synced());
    }

    #[test]
    fn a_watch_that_keeps_failing_makes_the_books_stale_until_it_delivers() {
        let mut cache = Cache::new(R);
        let t = Instant::now();
        let at = |secs: f64| t + Duration::from_secs_f64(secs);
        for secs in [0.0, 0.8] {
            cache.watch_failed("pods", "connection refused".into(), at(secs));
        }
        assert_eq!(cache.stale(at(2.0)), None, "two errors are a blip");
        cache.watch_failed("pods", "403".into(), at(2.4));
        let why = cache.stale(at(3.0)).expect("three errors in a row");
        assert!(
            why.contains("pods watch has failed 3 times in a row over 3 s (last error: 403)"),
            "{why}"
        );
        assert!(cache.stale(at(62.3)).is_some(), "an error 59.9 s ago");
        assert_eq!(cache.stale(at(62.4)), None, "silent since: it got through");
        cache.watch_failed("pods", "again".into(), at(80.0));
        assert_eq!(cache.stale(at(80.0)), None, "a new blip");
        for secs in [81.0, 83.0] {
            cache.watch_failed("pods", "and again".into(), at(secs));
        }
        assert!(cache.stale(at(83.0)).is_some(), "failing again");
        cache.watch_delivered("pods");
        assert_eq!(cache.stale(at(83.0)), None);
    }

    #[test]
    fn a_node_annotation_is_parsed_or_its_problem_kept() {
        let mut cache = Cache::new(R);
        let bare: Node = serde_json::from_value(json!({"metadata": {"name": "bare"}})).unwrap();
        let bad: Node = serde_json::from_value(
            json!({"metadata": {"name": "bad", "annotations": {GPUS_ANNOTATION: "[{"}}}),
        )
        .unwrap();
        cache.replace_nodes([&node("n", &[(15, true), (15, false)]), &bare, &bad]);
        assert_eq!(cache.gpus("n").unwrap().as_ref().unwrap().len(), 2);
        assert_eq!(cache.gpus("bare"), Some(&Err(NodeProblem::NotPublished)));
        assert!(matches!(
            cache.gpus("bad"),
            Some(Err(NodeProblem::Invalid(_)))
        ));
        assert_eq!(cache.gpus("gone"), None);
    }
}
