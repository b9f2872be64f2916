//! The plugin with the API server: gpushare's annotation protocol, with and
//! without gpushare's scheduler extender, and what it publishes on its
//! Node. The real binary, the in-process kubelet and the in-process fake
//! API server, which serves the REST paths and JSON kube-rs uses.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tonic::transport::Channel;

use common::fixture;
use common::wait::{eventually, POLL};
use gpumem::cluster::gpushare::annotation;
use gpumem::deviceplugin::api::deviceplugin::device_plugin_client::DevicePluginClient;
use gpumem::deviceplugin::api::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest,
    ContainerPreferredAllocationRequest, PreferredAllocationRequest,
};
use gpumem::isolation::inject::env;
use gpumem::kubelet::unix;
use gpumem_testkit::fake_apiserver::{FakeApiServer, Kind};
use gpumem_testkit::simulator::{AdmissionError, KubeletSim};

const RESOURCE: &str = "aliyun.com/gpu-mem";
const NODE: &str = "gpu-node-1";
const WAIT: Duration = Duration::from_secs(20);

/// `gpumem plugin` on a two-V100 node (15 units each), talking to a fake
/// API server and a simulated kubelet.
struct Cluster {
    api: FakeApiServer,
    kubelet: KubeletSim,
    plugin: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Cluster {
    async fn start(extra: &[&str]) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let api = FakeApiServer::start().await.unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        api.put(json!({
            "kind": "Node",
            "metadata": {"name": NODE},
            "status": {"capacity": {"cpu": "8"}, "allocatable": {"cpu": "8"}},
        }));
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        let log = dir.path().join("plugin.log");
        let plugin = common::bare_plugin(dir.path())
            .arg("--fake-gpus")
            .arg(fixture("v100x2"))
            .arg("--pod-resources-socket")
            .arg(kubelet.pod_resources_socket())
            .args(["--node-name", NODE, "--kubeconfig"])
            .arg(&kubeconfig)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let cluster = Cluster {
            api,
            kubelet,
            plugin,
            log,
            _dir: dir,
        };
        if cluster
            .kubelet
            .wait_for_devices(RESOURCE, 1, WAIT)
            .await
            .is_none()
        {
            panic!("plugin did not register; its log:\n{}", cluster.log());
        }
        cluster
    }

    /// kubelet's GetPreferredAllocation for one container of `size` units,
    /// from every device the plugin lists.
    async fn preferred(&self, client: &mut DevicePluginClient<Channel>, size: i32) -> Vec<String> {
        let available = self
            .kubelet
            .devices(RESOURCE)
            .unwrap()
            .into_iter()
            .map(|d| d.id)
            .collect();
        client
            .get_preferred_allocation(PreferredAllocationRequest {
                container_requests: vec![ContainerPreferredAllocationRequest {
                    available_device_i_ds: available,
                    must_include_device_i_ds: Vec::new(),
                    allocation_size: size,
                }],
            })
            .await
            .unwrap_or_else(|err| panic!("{err}; log:\n{}", self.log()))
            .into_inner()
            .container_responses
            .remove(0)
            .device_i_ds
    }

    /// kubelet's Allocate of `ids` for one container, which must succeed.
    async fn allocate(
        &self,
        client: &mut DevicePluginClient<Channel>,
        ids: Vec<String>,
    ) -> AllocateResponse {
        client
            .allocate(AllocateRequest {
                container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
            })
            .await
            .unwrap_or_else(|err| {
                panic!(
                    "Allocate refused the preferred IDs: {err}; log:\n{}",
                    self.log()
                )
            })
            .into_inner()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A pod bound to this node asking for `units`, with `annotations`.
    fn pod(&self, name: &str, units: u32, annotations: Value) {
        self.api.put(json!({
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations},
            "spec": {
                "nodeName": NODE,
                "containers": [{"name": "main", "image": "cuda", "resources": {
                    "limits": {RESOURCE: units.to_string()},
                    "requests": {RESOURCE: units.to_string()},
                }}],
            },
            "status": {"phase": "Pending"},
        }));
    }

    /// What gpushare's extender writes at bind.
    fn assumed_by_extender(&self, name: &str, units: u32, gpu: u32, assume_time: u64) {
        self.pod(
            name,
            units,
            json!({
                annotation::IDX: gpu.to_string(),
                annotation::POD: units.to_string(),
                annotation::DEV: "15",
                annotation::ASSIGNED: "false",
                annotation::ASSUME_TIME: assume_time.to_string(),
            }),
        );
    }

    fn annotations(&self, name: &str) -> Value {
        self.api
            .get(Kind::Pod, "default", name)
            .and_then(|p| p.pointer("/metadata/annotations").cloned())
            .unwrap_or(Value::Null)
    }

    async fn wait_for<T>(&self, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
        eventually(what, WAIT, POLL, async || {
            check().ok_or_else(|| format!("plugin log:\n{}", self.log()))
        })
        .await
    }

    fn socket(&self) -> PathBuf {
        self.kubelet.dir().join("gpumem.sock")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.plugin.kill();
        let _ = self.plugin.wait();
    }
}

fn gpu_of(allocation: &gpumem_testkit::simulator::Allocation) -> &str {
    allocation.response.envs[env::ALIYUN_IDX].as_str()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_container_goes_to_the_gpu_the_gpushare_extender_chose() {
    let c = Cluster::start(&["--scheduler", "gpushare-extender"]).await;
    // Binpack alone would put the first container on GPU 0.
    c.assumed_by_extender("second-gpu", 4, 1, 200);
    c.assumed_by_extender("first-gpu", 4, 0, 300);
    let placed = c
        .kubelet
        .admit("second-gpu", "main", RESOURCE, 4)
        .await
        .unwrap_or_else(|err| panic!("{err}; log:\n{}", c.log()));
    assert_eq!(
        gpu_of(&placed),
        "1",
        "the oldest assumed pod asking 4 units is placed first"
    );
    let annotations = c.annotations("second-gpu");
    assert_eq!(annotations[annotation::ASSIGNED], "true", "{annotations}");
    assert_eq!(annotations[annotation::IDX], "1");
    assert_eq!(
        annotations[annotation::ALLOCATION],
        r#"{"0":{"1":4}}"#,
        "gpushare's extender writes no per-container allocation; the plugin does"
    );
    assert_ne!(
        annotations[annotation::ASSUME_TIME],
        "200",
        "a fresh assume time"
    );
    assert_eq!(c.annotations("first-gpu")[annotation::ASSIGNED], "false");

    let next = c
        .kubelet
        .admit("first-gpu", "main", RESOURCE, 4)
        .await
        .unwrap();
    assert_eq!(gpu_of(&next), "0");
    assert_eq!(c.annotations("first-gpu")[annotation::ASSIGNED], "true");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_matching_pod_admission_fails_with_a_clear_error() {
    let c = Cluster::start(&["--scheduler", "gpushare-extender"]).await;
    c.assumed_by_extender("six", 6, 1, 100);
    let err = c
        .kubelet
        .admit("four", "main", RESOURCE, 4)
        .await
        .unwrap_err();
    let AdmissionError::Preferred(status) = err else {
        panic!("expected GetPreferredAllocation to fail, got {err}");
    };
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert!(
        status
            .message()
            .contains("no pending pod on node gpu-node-1")
            && status.message().contains("default/six (6 units on GPU 1)"),
        "{}",
        status.message()
    );
    assert_eq!(c.annotations("six")[annotation::ASSIGNED], "false");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_refuses_devices_on_another_gpu_than_the_extenders() {
    let c = Cluster::start(&["--scheduler", "gpushare-extender"]).await;
    c.assumed_by_extender("on-one", 2, 1, 100);
    let devices = c.kubelet.devices(RESOURCE).unwrap();
    // Two units of the first GPU listed (GPU 0's IDs come first).
    let gpu0: Vec<String> = devices.iter().take(2).map(|d| d.id.clone()).collect();
    let mut client = DevicePluginClient::new(unix::connect(&c.socket()).await.unwrap());
    let err = client
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: gpu0 }],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err}");
    assert!(
        err.message().contains("kubelet allocated GPU 0")
            && err.message().contains("the extender chose GPU 1"),
        "{}",
        err.message()
    );
    assert_eq!(c.annotations("on-one")[annotation::ASSIGNED], "false");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preferred_allocation_and_allocate_agree_while_the_watch_lags_a_bind() {
    let c = Cluster::start(&["--scheduler", "gpushare-extender"]).await;
    // The plugin's watch has shown pod B, assumed second...
    c.assumed_by_extender("b-second", 4, 1, 200);
    let version: u64 = c.api.get(Kind::Pod, "default", "b-second").unwrap()["metadata"]
        ["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    c.wait_for("the watch to show pod B", || {
        (c.api.watch_delivered(Kind::Pod) >= version).then_some(())
    })
    .await;
    // ...but not A, assumed first: its bind lags in the watch.
    c.api.hold_watch_events(Kind::Pod, true);
    c.assumed_by_extender("a-first", 4, 0, 100);

    // kubelet admits A's container: GetPreferredAllocation, then the watch
    // catches up, then Allocate with the IDs kubelet took from the answer.
    let mut client = DevicePluginClient::new(unix::connect(&c.socket()).await.unwrap());
    let preferred = c.preferred(&mut client, 4).await;
    c.api.hold_watch_events(Kind::Pod, false);
    let a_version: u64 = c.api.get(Kind::Pod, "default", "a-first").unwrap()["metadata"]
        ["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    c.wait_for("the watch to show pod A", || {
        (c.api.watch_delivered(Kind::Pod) >= a_version).then_some(())
    })
    .await;
    let allocated = c.allocate(&mut client, preferred).await;
    assert_eq!(
        allocated.container_responses[0].envs[env::ALIYUN_IDX],
        "0",
        "the oldest assumed pod's GPU"
    );
    assert_eq!(c.annotations("a-first")[annotation::ASSIGNED], "true");
    assert_eq!(c.annotations("b-second")[annotation::ASSIGNED], "false");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_assumed_earlier_but_bound_late_does_not_turn_away_kubelets_ids() {
    let c = Cluster::start(&["--scheduler", "gpushare-extender"]).await;
    c.assumed_by_extender("b-second", 4, 1, 200);
    let mut client = DevicePluginClient::new(unix::connect(&c.socket()).await.unwrap());
    let preferred = c.preferred(&mut client, 4).await;
    // Pod A was assumed first, on GPU 0, but its bind reaches the API
    // server only now, between the two calls for B's container.
    c.assumed_by_extender("a-first", 4, 0, 100);
    let allocated = c.allocate(&mut client, preferred).await;
    assert_eq!(allocated.container_responses[0].envs[env::ALIYUN_IDX], "1");
    assert_eq!(c.annotations("b-second")[annotation::ASSIGNED], "true");
    assert_eq!(c.annotations("a-first")[annotation::ASSIGNED], "false");

    // A is still placed where the extender put it.
    let placed = c
        .kubelet
        .admit("a-first", "main", RESOURCE, 4)
        .await
        .unwrap_or_else(|err| panic!("{err}; log:\n{}", c.log()));
    assert_eq!(gpu_of(&placed), "0");
    assert_eq!(c.annotations("a-first")[annotation::ASSIGNED], "true");
}

/// PATCHes of pod `name` the fake API server has seen.
fn pod_patches(c: &Cluster, name: &str) -> usize {
    let path = format!("PATCH /api/v1/namespaces/default/pods/{name}");
    c.api
        .requests()
        .iter()
        .filter(|r| r.starts_with(&path))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_on_the_assigned_write_is_retried_and_allocate_succeeds() {
    let c = Cluster::start(&["--scheduler", "gpushare-extender"]).await;
    c.assumed_by_extender("lost", 4, 1, 100);
    c.assumed_by_extender("landed", 4, 0, 200);
    // The first write is lost: answered 500, not stored.
    c.api.fail_next_writes(Kind::Pod, 1, false);
    let placed = c
        .kubelet
        .admit("lost", "main", RESOURCE, 4)
        .await
        .unwrap_or_else(|err| panic!("{err}; log:\n{}", c.log()));
    assert_eq!(gpu_of(&placed), "1");
    let annotations = c.annotations("lost");
    assert_eq!(annotations[annotation::ASSIGNED], "true", "{annotations}");
    assert_eq!(annotations[annotation::IDX], "1");
    assert_eq!(pod_patches(&c, "lost"), 2, "{:?}", c.api.requests());
    let log = c.log();
    assert!(
        log.contains("retrying") && log.contains("etcdserver: request timed out (injected)"),
        "each retry is logged with the server's message:\n{log}"
    );

    // The write is stored but its answer is a 500: reading the pod again
    // shows gpumem's own write, which is success, not a pod gone.
    c.api.fail_next_writes(Kind::Pod, 1, true);
    let placed = c
        .kubelet
        .admit("landed", "main", RESOURCE, 4)
        .await
        .unwrap_or_else(|err| panic!("{err}; log:\n{}", c.log()));
    assert_eq!(gpu_of(&placed), "0");
    assert_eq!(c.annotations("landed")[annotation::ASSIGNED], "true");
    assert_eq!(pod_patches(&c, "landed"), 1, "{:?}", c.api.requests());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_keeps_failing_fails_allocate_within_the_bound_saying_why() {
    let c = Cluster::start(&["--scheduler", "gpushare-extender"]).await;
    c.assumed_by_extender("doomed", 4, 1, 100);
    c.api.fail_next_writes(Kind::Pod, u32::MAX, false);
    let started = Instant::now();
    let err = c
        .kubelet
        .admit("doomed", "main", RESOURCE, 4)
        .await
        .unwrap_err();
    let took = started.elapsed();
    let AdmissionError::Allocate(status) = err else {
        panic!("expected Allocate to fail, got {err}; log:\n{}", c.log());
    };
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    let message = status.message();
    assert!(
        message.contains("default/doomed")
            && message.contains("500")
            && message.contains("etcdserver: request timed out (injected)")
            && message.contains("5s"),
        "{message}"
    );
    // The 5 s bound, plus the candidate lookup and a slow machine's slack.
    assert!(took < Duration::from_secs(9), "took {took:?}");
    assert!(
        pod_patches(&c, "doomed") > 2,
        "retried with backoff: {:?}",
        c.api.requests()
    );
    assert_eq!(c.annotations("doomed")[annotation::ASSIGNED], "false");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_extender_placed_pods_get_gpushares_annotations() {
    let c = Cluster::start(&[]).await;
    c.pod("notebook", 4, json!({}));
    // The node's own writes first, so the conflicts below go to the pod's.
    c.wait_for("the Node published", || {
        let node = c.api.get(Kind::Node, "", NODE)?;
        node["metadata"]["annotations"]
            .get(gpumem::cluster::node::GPUS_ANNOTATION)
            .map(drop)
    })
    .await;
    // Two writers race the plugin: it reads the pod again and retries.
    c.api.conflict_next_writes(2);
    let placed = c
        .kubelet
        .admit("notebook", "main", RESOURCE, 4)
        .await
        .unwrap();
    let gpu = gpu_of(&placed).to_owned();
    let annotations = c
        .wait_for("gpushare's annotations", || {
            let a = c.annotations("notebook");
            (a[annotation::ASSIGNED] == "true").then_some(a)
        })
        .await;
    assert_eq!(annotations[annotation::IDX], gpu.as_str());
    assert_eq!(annotations[annotation::POD], "4");
    assert_eq!(annotations[annotation::DEV], "15");
    let time: u128 = annotations[annotation::ASSUME_TIME]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(time > 1_700_000_000_000_000_000, "Unix nanoseconds: {time}");
    // Written once: a later sweep finds it done. The one that annotates a
    // pod placed after it has looked at it (pods go in name order).
    c.pod("trainer", 4, json!({}));
    c.kubelet
        .admit("trainer", "main", RESOURCE, 4)
        .await
        .unwrap();
    c.wait_for("a later sweep", || {
        (c.annotations("trainer")[annotation::ASSIGNED] == "true").then_some(())
    })
    .await;
    let patches = c
        .api
        .requests()
        .iter()
        .filter(|r| r.starts_with("PATCH /api/v1/namespaces/default/pods/notebook"))
        .count();
    assert_eq!(
        patches,
        3,
        "two conflicts, then one write: {:?}",
        c.api.requests()
    );
}

/// gpushare's per-container annotation, parsed: container index (in
/// `spec.containers`) → GPU index → units, as `kubectl inspect gpushare`
/// reads it before `…_IDX`.
fn allocation_of(annotations: &Value) -> Option<Value> {
    serde_json::from_str(annotations[annotation::ALLOCATION].as_str()?).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_split_over_two_gpus_is_annotated_per_container() {
    let c = Cluster::start(&[]).await;
    c.pod("filler", 10, json!({}));
    let limits = |units: u32| json!({"limits": {RESOURCE: units.to_string()}, "requests": {RESOURCE: units.to_string()}});
    c.api.put(json!({
        "kind": "Pod",
        "metadata": {"name": "split", "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "containers": [
                {"name": "small", "image": "cuda", "resources": limits(1)},
                {"name": "sidecar", "image": "busybox"},
                {"name": "big", "image": "cuda", "resources": limits(6)},
            ],
        },
        "status": {"phase": "Pending"},
    }));
    // Binpack: 10 units fill one GPU to 5 free, the small container joins
    // them, and the big one no longer fits there.
    let filler = c
        .kubelet
        .admit("filler", "main", RESOURCE, 10)
        .await
        .unwrap();
    let small = c
        .kubelet
        .admit("split", "small", RESOURCE, 1)
        .await
        .unwrap();
    let big = c.kubelet.admit("split", "big", RESOURCE, 6).await.unwrap();
    let (small, big) = (gpu_of(&small).to_owned(), gpu_of(&big).to_owned());
    assert_eq!(small, gpu_of(&filler));
    assert_ne!(small, big, "the pod is split over both GPUs");

    let annotations = c
        .wait_for("the split pod's per-container allocation", || {
            let a = c.annotations("split");
            allocation_of(&a).map(|_| a)
        })
        .await;
    assert_eq!(
        allocation_of(&annotations),
        Some(json!({"0": {small.as_str(): 1}, "2": {big.as_str(): 6}})),
        "{annotations}"
    );
    assert_eq!(
        annotations[annotation::IDX],
        big.as_str(),
        "most of its units"
    );
    assert_eq!(annotations[annotation::POD], "7");
    let filler = c
        .wait_for("the filler's allocation", || {
            allocation_of(&c.annotations("filler"))
        })
        .await;
    assert_eq!(filler, json!({"0": {small.as_str(): 10}}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_shows_its_gpu_count_and_each_gpus_units() {
    let c = Cluster::start(&[]).await;
    let node = c
        .wait_for("the node's GPU count", || {
            // The annotation is published first, then the count.
            let node = c.api.get(Kind::Node, "", NODE)?;
            node.pointer("/metadata/annotations/gpumem.io~1gpus")?;
            node.pointer("/status/capacity/aliyun.com~1gpu-count")?;
            Some(node)
        })
        .await;
    assert_eq!(
        node.pointer("/status/capacity/aliyun.com~1gpu-count"),
        Some(&json!("2"))
    );
    assert_eq!(
        node.pointer("/status/allocatable/aliyun.com~1gpu-count"),
        Some(&json!("2"))
    );
    assert_eq!(
        node.pointer("/status/capacity/cpu"),
        Some(&json!("8")),
        "the rest of the status is kept"
    );
    let gpus: Value = serde_json::from_str(
        node.pointer("/metadata/annotations/gpumem.io~1gpus")
            .unwrap()
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(gpus.as_array().unwrap().len(), 2);
    assert_eq!(gpus[1]["index"], 1);
    assert_eq!(gpus[1]["units"], 15);
    assert_eq!(gpus[1]["memoryMib"], 16160);
    assert_eq!(gpus[1]["healthy"], true);
    assert_eq!(gpus[0]["uuid"], "GPU-1a2b3c4d-0000-4000-8000-000000010000");
    // Capacity went through the status subresource.
    assert!(c
        .api
        .requests()
        .iter()
        .any(|r| r == &format!("PATCH /api/v1/nodes/{NODE}/status")));
}

/// The chart's uninstall hook: what the plugin published goes, on its Node
/// only; a GPU count gpushare's own plugin wrote elsewhere stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_removes_what_the_plugin_wrote_on_its_node_only() {
    let mut c = Cluster::start(&[]).await;
    c.wait_for("the node's annotation", || {
        c.api
            .get(Kind::Node, "", NODE)?
            .pointer("/metadata/annotations/gpumem.io~1gpus")
            .map(|_| ())
    })
    .await;
    c.plugin.kill().unwrap();
    c.plugin.wait().unwrap();
    let gpushares = json!({
        "kind": "Node",
        "metadata": {"name": "gpushare-node", "annotations": {"other": "kept"}},
        "status": {"capacity": {"aliyun.com/gpu-count": "1"}},
    });
    c.api.put(gpushares);
    let kubeconfig = c._dir.path().join("kubeconfig");
    let unpublish = |extra: &[&str]| run_unpublish(&kubeconfig, extra);

    let (ok, out, err) = unpublish(&[]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        format!("removed gpumem's GPU count and annotation from Node {NODE}\n")
    );
    let node = c.api.get(Kind::Node, "", NODE).unwrap();
    assert_eq!(node.pointer("/metadata/annotations/gpumem.io~1gpus"), None);
    assert_eq!(node.pointer("/status/capacity/aliyun.com~1gpu-count"), None);
    assert_eq!(
        node.pointer("/status/allocatable/aliyun.com~1gpu-count"),
        None
    );
    assert_eq!(node.pointer("/status/capacity/cpu"), Some(&json!("8")));
    let other = c.api.get(Kind::Node, "", "gpushare-node").unwrap();
    assert_eq!(
        other.pointer("/status/capacity/aliyun.com~1gpu-count"),
        Some(&json!("1"))
    );

    // Again: nothing left to do, and a named Node that is not ours is an error.
    let (ok, out, err) = unpublish(&[]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        "no Node carries gpumem's annotation: nothing to remove\n"
    );
    let (ok, _, err) = unpublish(&["--node", "gpushare-node"]);
    assert!(!ok);
    assert!(
        err.contains("Node gpushare-node does not exist or carries no gpumem.io/gpus annotation"),
        "{err}"
    );
}

/// `gpumem unpublish` with `extra`, against the fake API server: success,
/// stdout, stderr.
fn run_unpublish(kubeconfig: &Path, extra: &[&str]) -> (bool, String, String) {
    let output = common::gpumem_cmd()
        .arg("unpublish")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(extra)
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Whether the Node shows the plugin's two V100s: annotation, capacity and
/// allocatable.
fn shows_two_gpus(api: &FakeApiServer) -> bool {
    let Some(node) = api.get(Kind::Node, "", NODE) else {
        return false;
    };
    let gpus = node
        .pointer("/metadata/annotations/gpumem.io~1gpus")
        .and_then(Value::as_str)
        .and_then(|a| serde_json::from_str::<Value>(a).ok());
    gpus.is_some_and(|g| g.as_array().map(Vec::len) == Some(2))
        && node.pointer("/status/capacity/aliyun.com~1gpu-count") == Some(&json!("2"))
        && node.pointer("/status/allocatable/aliyun.com~1gpu-count") == Some(&json!("2"))
}

/// Another release's uninstall hook (or anyone) takes the plugin's GPUs
/// off its Node, and kubelet zeroes unknown extended resources when it
/// restarts: the running plugin puts them back, or the extender filters
/// the node out and `kubectl inspect gpushare` loses its GPU count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_publishes_again_what_its_node_lost() {
    let c = Cluster::start(&[]).await;
    c.wait_for("the node's GPUs", || shows_two_gpus(&c.api).then_some(()))
        .await;
    let kubeconfig = c._dir.path().join("kubeconfig");
    let (ok, out, err) = run_unpublish(&kubeconfig, &[]);
    assert!(ok, "{err}");
    assert!(out.contains(NODE), "{out}");
    c.wait_for("the GPUs back after unpublish", || {
        shows_two_gpus(&c.api).then_some(())
    })
    .await;

    // As kubelet leaves the Node after a restart: its count at 0.
    let mut node = c.api.get(Kind::Node, "", NODE).unwrap();
    node["status"]["capacity"]["aliyun.com/gpu-count"] = json!("0");
    node["status"]["allocatable"]["aliyun.com/gpu-count"] = json!("0");
    c.api.put(node);
    c.wait_for("the GPU count back after a kubelet restart", || {
        shows_two_gpus(&c.api).then_some(())
    })
    .await;
}

/// The chart's hook passes its release's nodeSelector: Nodes another
/// release serves keep what their agents published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublish_with_a_selector_leaves_other_nodes_alone() {
    let dir = tempfile::tempdir().unwrap();
    let api = FakeApiServer::start().await.unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    for (name, label) in [("ours", "true"), ("theirs", "team-b")] {
        api.put(json!({
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {"gpushare": label},
                "annotations": {"gpumem.io/gpus": "[]"},
            },
            "status": {
                "capacity": {"aliyun.com/gpu-count": "1"},
                "allocatable": {"aliyun.com/gpu-count": "1"},
            },
        }));
    }
    let (ok, out, err) = run_unpublish(&kubeconfig, &["--selector", "gpushare=true"]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        "removed gpumem's GPU count and annotation from Node ours\n"
    );
    let ours = api.get(Kind::Node, "", "ours").unwrap();
    assert_eq!(ours.pointer("/metadata/annotations/gpumem.io~1gpus"), None);
    assert_eq!(ours.pointer("/status/capacity/aliyun.com~1gpu-count"), None);
    let theirs = api.get(Kind::Node, "", "theirs").unwrap();
    assert_eq!(
        theirs.pointer("/metadata/annotations/gpumem.io~1gpus"),
        Some(&json!("[]"))
    );
    assert_eq!(
        theirs.pointer("/status/capacity/aliyun.com~1gpu-count"),
        Some(&json!("1"))
    );
    let (ok, out, err) = run_unpublish(&kubeconfig, &["--selector", "gpushare=true"]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        "no Node labelled gpushare=true carries gpumem's annotation: nothing to remove\n"
    );
}

fn plugin_error(args: &[&str], kubeconfig: Option<&Path>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut command = common::bare_plugin(dir.path());
    command
        .arg("--fake-gpus")
        .arg(fixture("v100x2"))
        .args(args)
        .env_remove("KUBECONFIG")
        .env_remove("KUBERNETES_SERVICE_HOST");
    if let Some(path) = kubeconfig {
        command.arg("--kubeconfig").arg(path);
    }
    let output = command.output().unwrap();
    assert!(!output.status.success());
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn the_extender_mode_without_a_node_name_or_kubeconfig_is_refused_by_name() {
    let err = plugin_error(&["--scheduler", "gpushare-extender"], None);
    assert!(
        err.contains("--scheduler gpushare-extender needs --node-name"),
        "{err}"
    );
    let missing = Path::new("/nonexistent/kubeconfig");
    let err = plugin_error(&["--node-name", NODE], Some(missing));
    assert!(
        err.contains("cannot read the kubeconfig /nonexistent/kubeconfig (--kubeconfig)"),
        "{err}"
    );
}

/// A kubeconfig found through KUBECONFIG or ~/.kube/config that does not
/// parse is named with why, not reported as no kubeconfig at all.
#[test]
fn a_malformed_kubeconfig_is_named_not_called_missing() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("kubeconfig");
    std::fs::write(&bad, "apiVersion: v1\nclusters: [oops\n").unwrap();
    let home = dir.path().join("home");
    std::fs::create_dir_all(home.join(".kube")).unwrap();
    std::fs::copy(&bad, home.join(".kube/config")).unwrap();
    let unpublish = |env: (&str, &Path)| {
        let output = common::gpumem_cmd()
            .arg("unpublish")
            .env_remove("KUBECONFIG")
            .env_remove("GPUMEM_KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env(env.0, env.1)
            .output()
            .unwrap();
        assert!(!output.status.success());
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    for (env, path, via) in [
        ("KUBECONFIG", bad.clone(), "KUBECONFIG"),
        ("HOME", home.clone(), "~/.kube/config"),
    ] {
        let err = unpublish((env, &path));
        let named = match env {
            "HOME" => home.join(".kube/config"),
            _ => bad.clone(),
        };
        assert!(
            err.contains(&format!(
                "cannot read the kubeconfig {} ({via})",
                named.display()
            )),
            "{err}"
        );
        assert!(err.contains("unclosed bracket"), "{err}");
        assert!(!err.contains("no kubeconfig"), "{err}");
    }
}
