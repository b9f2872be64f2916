//! What gpumem tells an autoscaler: `gpumem node-template`'s capacity checked
//! against what the plugin itself advertises for the same GPUs, and the
//! startup taint the plugin removes once kubelet shows its GPUs
//! allocatable. The real binary, the in-process kubelet and API server.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};

use serde_json::{json, Value};

use common::wait::{eventually, POLL};
use common::{fixture, gpumem_cmd, RESOURCE, WAIT};
use gpumem_testkit::fake_apiserver::{FakeApiServer, Kind};
use gpumem_testkit::simulator::KubeletSim;

const NODE: &str = "gpu-node-1";

/// `gpumem node-template ARGS -o json`, parsed.
fn template(args: &[&str]) -> Value {
    let out = gpumem_cmd()
        .arg("node-template")
        .args(args)
        .args(["-o", "json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "node-template {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `gpumem node-template ARGS`: (success, stdout, stderr).
fn template_text(args: &[&str]) -> (bool, String, String) {
    let out = gpumem_cmd()
        .arg("node-template")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A Node as kubelet registers it, with `taints` and `units` of the
/// resource allocatable (none: kubelet has not heard of the plugin yet).
fn node(taints: Value, units: Option<u64>) -> Value {
    let mut resources = json!({"cpu": "8"});
    if let Some(units) = units {
        resources[RESOURCE] = json!(units.to_string());
    }
    json!({
        "kind": "Node",
        "metadata": {"name": NODE, "labels": {"gpushare": "true"}},
        "spec": {"taints": taints},
        "status": {"capacity": resources, "allocatable": resources},
    })
}

/// `gpumem plugin` with the API server, on `gpus`, for kubelet in `dir`.
struct Plugin {
    child: Child,
    log: std::path::PathBuf,
}

impl Plugin {
    fn start(dir: &Path, api: &FakeApiServer, kubelet: &KubeletSim, args: &[&str]) -> Plugin {
        let kubeconfig = dir.join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let log = dir.join("plugin.log");
        let child = common::bare_plugin(dir)
            .arg("--pod-resources-socket")
            .arg(kubelet.pod_resources_socket())
            .args(["--node-name", NODE, "--kubeconfig"])
            .arg(&kubeconfig)
            .args(args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Plugin { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn wait_for<T>(plugin: &Plugin, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    eventually(what, WAIT, POLL, async || {
        check().ok_or_else(|| format!("plugin log:\n{}", plugin.log()))
    })
    .await
}

/// What the plugin advertises on `fixture_name`'s GPUs with `unit`: the
/// devices kubelet counts as the resource's capacity, and the GPU count it
/// publishes on the Node.
async fn advertised(fixture_name: &str, unit: &str) -> (u64, String) {
    let dir = tempfile::tempdir().unwrap();
    let api = FakeApiServer::start().await.unwrap();
    api.put(node(json!([]), None));
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let gpus = fixture(fixture_name);
    let plugin = Plugin::start(
        dir.path(),
        &api,
        &kubelet,
        &["--fake-gpus", gpus.to_str().unwrap(), "--memory-unit", unit],
    );
    let devices = kubelet.wait_for_devices(RESOURCE, 1, WAIT).await;
    let devices = devices.unwrap_or_else(|| panic!("no devices; log:\n{}", plugin.log()));
    let count = wait_for(&plugin, "the node's GPU count", || {
        let node = api.get(Kind::Node, "", NODE)?;
        let count = node.pointer("/status/capacity/aliyun.com~1gpu-count")?;
        count.as_str().map(str::to_owned)
    })
    .await;
    (devices.len() as u64, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_template_says_what_the_plugin_advertises_for_the_same_gpus() {
    for (fixture_name, unit, model, count) in [
        ("v100x2", "GiB", "v100-16gb", "2"),
        ("t4", "MiB", "Tesla T4", "1"),
        ("h100", "GiB", "h100-80gb", "1"),
    ] {
        let (units, gpu_count) = advertised(fixture_name, unit).await;
        let from_file = template(&[
            "--fake-gpus",
            fixture(fixture_name).to_str().unwrap(),
            "--memory-unit",
            unit,
        ]);
        let by_model = template(&["--gpu", model, "--count", count, "--memory-unit", unit]);
        for t in [&from_file, &by_model] {
            assert_eq!(
                t["capacity"][RESOURCE],
                json!(units.to_string()),
                "{fixture_name} in {unit}: {t}"
            );
            assert_eq!(t["capacity"]["aliyun.com/gpu-count"], json!(gpu_count));
            assert_eq!(
                t["aws"][format!("k8s.io/cluster-autoscaler/node-template/resources/{RESOURCE}")],
                json!(units.to_string())
            );
            assert_eq!(
                t["azure"]["k8s.io_cluster-autoscaler_node-template_resources_aliyun.com_gpu-mem"],
                json!(units.to_string())
            );
            assert_eq!(
                t["clusterApi"]["capacity.cluster-autoscaler.kubernetes.io/gpu-count"],
                json!(units.to_string())
            );
        }
    }
}

#[test]
fn each_format_names_the_keys_its_autoscaler_reads() {
    let two_v100s = ["--gpu", "v100-16gb", "--count", "2"];
    let cases: [(&[&str], &[&str]); 4] = [
        (
            &[],
            &[
                r#"k8s.io/cluster-autoscaler/node-template/resources/aliyun.com/gpu-mem: "30""#,
                r#"k8s.io/cluster-autoscaler/node-template/resources/aliyun.com/gpu-count: "2""#,
                r#"k8s.io/cluster-autoscaler/node-template/label/gpushare: "true""#,
            ],
        ),
        (
            &["-o", "azure", "--label", "gpushare=dra"],
            &[
                r#"k8s.io_cluster-autoscaler_node-template_resources_aliyun.com_gpu-mem: "30""#,
                r#"k8s.io_cluster-autoscaler_node-template_label_gpushare: "dra""#,
            ],
        ),
        (
            &["-o", "cluster-api"],
            &[
                r#"capacity.cluster-autoscaler.kubernetes.io/gpu-type: "aliyun.com/gpu-mem""#,
                r#"capacity.cluster-autoscaler.kubernetes.io/gpu-count: "30""#,
                r#"capacity.cluster-autoscaler.kubernetes.io/labels: "gpushare=true""#,
            ],
        ),
        (
            &["-o", "karpenter", "--instance-type", "p3.8xlarge"],
            &[
                r#"apiVersion: "karpenter.sh/v1alpha1""#,
                r#"kind: "NodeOverlay""#,
                r#"    aliyun.com/gpu-mem: "30""#,
                r#"  - key: "node.kubernetes.io/instance-type""#,
                r#"    - "p3.8xlarge""#,
            ],
        ),
    ];
    for (format, lines) in cases {
        let (ok, out, err) = template_text(&[&two_v100s[..], format].concat());
        assert!(ok, "{format:?}: {err}");
        for line in lines {
            assert!(out.lines().any(|l| l == *line), "{line:?} in:\n{out}");
        }
    }
}

#[test]
fn bad_input_is_refused_by_name() {
    let (ok, _, err) = template_text(&["--gpu", "a100"]);
    assert!(!ok);
    assert!(
        err.contains("unknown --gpu \"a100\"") && err.contains("--gpu-mib"),
        "{err}"
    );
    let (ok, _, err) = template_text(&["--gpu", "t4", "--count", "0"]);
    assert!(!ok && err.contains("--count"), "{err}");
    let (ok, _, err) = template_text(&["--gpu-mib", "800"]);
    assert!(!ok && err.contains("--memory-unit MiB"), "{err}");
    let (ok, _, err) = template_text(&["--gpu", "t4", "-o", "karpenter"]);
    assert!(!ok && err.contains("--instance-type"), "{err}");
    let (ok, _, err) = template_text(&["--gpu", "t4", "--label", "gpushare"]);
    assert!(!ok && err.contains("KEY=VALUE"), "{err}");
    let (ok, _, err) = template_text(&[]);
    assert!(!ok && err.contains("--gpu"), "{err}");
    let missing = fixture("no-such-gpus");
    let (ok, _, err) = template_text(&["--fake-gpus", missing.to_str().unwrap()]);
    assert!(!ok && err.contains("no-such-gpus.toml"), "{err}");
}

fn taints(api: &FakeApiServer) -> Value {
    api.get(Kind::Node, "", NODE)
        .and_then(|n| n.pointer("/spec/taints").cloned())
        .unwrap_or(Value::Null)
}

fn node_reads(api: &FakeApiServer) -> usize {
    let path = format!("GET /api/v1/nodes/{NODE}");
    api.requests().iter().filter(|r| **r == path).count()
}

/// A node started with gpumem's startup taint (and another taint that must
/// stay): the plugin registers, yet while kubelet shows nothing allocatable
/// the taint stays; once kubelet shows units, the plugin removes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_taint_goes_once_kubelet_shows_the_gpus_allocatable() {
    let dir = tempfile::tempdir().unwrap();
    let api = FakeApiServer::start().await.unwrap();
    let dedicated = json!({"key": "dedicated", "value": "gpu", "effect": "NoSchedule"});
    api.put(node(
        json!([{"key": "gpumem.io/not-ready", "effect": "NoSchedule"}, dedicated]),
        None,
    ));
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let gpus = fixture("v100x2");
    let plugin = Plugin::start(
        dir.path(),
        &api,
        &kubelet,
        &["--fake-gpus", gpus.to_str().unwrap()],
    );
    let devices = kubelet.wait_for_devices(RESOURCE, 1, WAIT).await;
    let devices = devices.unwrap_or_else(|| panic!("no devices; log:\n{}", plugin.log()));

    // kubelet has the plugin's devices but has not yet reported them, then
    // reports 0 allocatable (every GPU unhealthy): the taint stays through
    // several reads of the Node.
    let reads = node_reads(&api);
    wait_for(&plugin, "reads of the Node", || {
        (node_reads(&api) >= reads + 2).then_some(())
    })
    .await;
    api.put(node(taints(&api), Some(0)));
    let reads = node_reads(&api);
    wait_for(&plugin, "reads of the Node", || {
        (node_reads(&api) >= reads + 2).then_some(())
    })
    .await;
    assert_eq!(
        taints(&api).as_array().map(Vec::len),
        Some(2),
        "{}",
        plugin.log()
    );

    // kubelet reports the devices allocatable, as its node status does.
    api.put(node(taints(&api), Some(devices.len() as u64)));
    // The plugin says so once the API server has answered its write, a
    // moment after the write shows.
    wait_for(&plugin, "the startup taint to go", || {
        (taints(&api) == json!([dedicated]) && plugin.log().contains("removed the startup taint"))
            .then_some(())
    })
    .await;
    assert!(
        plugin.log().contains("removed the startup taint"),
        "{}",
        plugin.log()
    );
}

/// `--startup-taint` names another taint; a malformed one stops the plugin
/// naming the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_taint_can_be_named_and_a_bad_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let api = FakeApiServer::start().await.unwrap();
    api.put(node(
        json!([
            {"key": "example.com/gpu-init", "value": "wait", "effect": "NoExecute"},
            {"key": "gpumem.io/not-ready", "effect": "NoSchedule"},
        ]),
        Some(30),
    ));
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let gpus = fixture("v100x2");
    let plugin = Plugin::start(
        dir.path(),
        &api,
        &kubelet,
        &[
            "--fake-gpus",
            gpus.to_str().unwrap(),
            "--startup-taint",
            "example.com/gpu-init=wait:NoExecute",
        ],
    );
    wait_for(&plugin, "the named taint to go", || {
        (taints(&api) == json!([{"key": "gpumem.io/not-ready", "effect": "NoSchedule"}]))
            .then_some(())
    })
    .await;
    drop(plugin);

    let out = common::bare_plugin(dir.path())
        .args(["--fake-gpus", gpus.to_str().unwrap(), "--node-name", NODE])
        .args(["--startup-taint", "gpumem.io/not-ready:Sometimes"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--startup-taint") && err.contains("Sometimes"),
        "{err}"
    );
}

/// The plugin on the V100 pair, its Node carrying `taints` and 30 units
/// allocatable from the start, as on a node Karpenter launched (which
/// registers with `karpenter.sh/unregistered`).
fn plugin_on_karpenters_node(
    dir: &tempfile::TempDir,
    api: &FakeApiServer,
    taints: Value,
) -> (KubeletSim, Plugin) {
    api.put(node(taints, Some(30)));
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let gpus = fixture("v100x2");
    let plugin = Plugin::start(
        dir.path(),
        api,
        &kubelet,
        &["--fake-gpus", gpus.to_str().unwrap()],
    );
    (kubelet, plugin)
}

/// Karpenter registers the node: its own taint goes and the NodePool's
/// startup taint is on; the plugin then removes the startup taint.
async fn karpenter_registers(api: &FakeApiServer, plugin: &Plugin, startup: &Value) {
    api.put(node(json!([startup]), Some(30)));
    wait_for(plugin, "the startup taint to go", || {
        (taints(api) == json!([]) && plugin.log().contains("removed the startup taint"))
            .then_some(())
    })
    .await;
}

const KARPENTER_UNREGISTERED: &str = "karpenter.sh/unregistered";

/// A node Karpenter launched registers with `karpenter.sh/unregistered`
/// beside the startup taint; when Karpenter registers it, it puts the
/// NodePool's startup taints back. gpumem, ready before then (a DaemonSet
/// that tolerates every taint), keeps its taint until Karpenter's is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_taint_stays_until_karpenter_has_registered_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let api = FakeApiServer::start().await.unwrap();
    let startup = json!({"key": "gpumem.io/not-ready", "effect": "NoSchedule"});
    let unregistered = json!({"key": KARPENTER_UNREGISTERED, "effect": "NoExecute"});
    let (_kubelet, plugin) = plugin_on_karpenters_node(&dir, &api, json!([unregistered, startup]));
    // The GPUs are allocatable from the start: only Karpenter's taint holds
    // the startup taint, through several reads of the Node.
    wait_for(&plugin, "reads of the Node", || {
        let removed = taints(&api).as_array().map(Vec::len) != Some(2);
        (node_reads(&api) >= 3 || removed).then_some(())
    })
    .await;
    assert_eq!(
        taints(&api).as_array().map(Vec::len),
        Some(2),
        "{}",
        plugin.log()
    );
    assert!(
        plugin
            .log()
            .contains("until Karpenter has registered the node"),
        "{}",
        plugin.log()
    );

    // Karpenter registers the node: its taint goes, the startup taint stays.
    karpenter_registers(&api, &plugin, &startup).await;
}

/// A node Karpenter launched whose cloud registered it with Karpenter's
/// taint alone (user data without the NodePool's startup taints): gpumem
/// must not take "no startup taint" for "freed already" while Karpenter's
/// taint is there, since Karpenter puts the startup taints on when it
/// registers the node; gpumem then removes them once the GPUs are
/// allocatable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_startup_taint_karpenter_adds_at_registration_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let api = FakeApiServer::start().await.unwrap();
    let unregistered = json!({"key": KARPENTER_UNREGISTERED, "effect": "NoExecute"});
    let (_kubelet, plugin) = plugin_on_karpenters_node(&dir, &api, json!([unregistered]));
    wait_for(&plugin, "reads of the Node", || {
        (node_reads(&api) >= 3).then_some(())
    })
    .await;
    let startup = json!({"key": "gpumem.io/not-ready", "effect": "NoSchedule"});
    karpenter_registers(&api, &plugin, &startup).await;
}
