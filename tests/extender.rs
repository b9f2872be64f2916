//! `gpumem extender`, the real binary, against the in-process fake API
//! server, fed the JSON kube-scheduler sends (tests/fixtures/extender/:
//! a `nodeCacheCapable` filter with NodeNames, one with whole Nodes, a
//! prioritize and a bind, as kube-scheduler 1.3x writes them).

mod common;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde_json::{json, Value};

use common::wait::{eventually, POLL};
use gpumem::cluster::gpushare::annotation;
use gpumem::cluster::node::GPUS_ANNOTATION;
use gpumem_testkit::fake_apiserver::{FakeApiServer, Kind};
use gpumem_testkit::http1;

const RESOURCE: &str = "aliyun.com/gpu-mem";
/// Generous: bounds waits for events, times nothing.
const WAIT: Duration = Duration::from_secs(20);
const INFER_UID: &str = "a7b8c9d0-e1f2-4a3b-8c4d-5e6f7a8b9c0d";

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/extender")
        .join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// A fake API server holding the fixtures' nodes (v100-node: two 15-unit
/// V100s; a10-node: one 22-unit A10; bare-node: no gpumem plugin), pods
/// using 5 units on each V100 and 6 on the A10, and the fixtures' pending
/// pods trainer-15 and infer-4.
struct Cluster {
    api: FakeApiServer,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

impl Cluster {
    async fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let api = FakeApiServer::start().await.unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let nodes = fixture("filter-node-list.json")["Nodes"]["items"].clone();
        for node in nodes.as_array().unwrap() {
            let mut node = node.clone();
            node["kind"] = json!("Node");
            api.put(node);
        }
        let cluster = Cluster {
            api,
            kubeconfig,
            _dir: dir,
        };
        cluster.bound("v100-a", 5, "v100-node", 0);
        cluster.bound("v100-b", 5, "v100-node", 1);
        cluster.bound("a10-a", 6, "a10-node", 0);
        for file in ["filter-node-names.json", "prioritize-node-names.json"] {
            let mut pod = fixture(file)["Pod"].clone();
            pod["kind"] = json!("Pod");
            cluster.api.put(pod);
        }
        cluster
    }

    fn pod_json(name: &str, units: u64, node: Option<&str>, gpu: Option<u32>) -> Value {
        let mut annotations = serde_json::Map::new();
        if let Some(gpu) = gpu {
            for (key, value) in [
                (annotation::IDX, gpu.to_string()),
                (annotation::POD, units.to_string()),
                (annotation::ASSIGNED, "true".to_owned()),
            ] {
                annotations.insert(key.into(), json!(value));
            }
        }
        json!({
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                         "annotations": annotations},
            "spec": {
                "nodeName": node,
                "containers": [{"name": "main", "image": "cuda", "resources": {
                    "limits": {RESOURCE: units.to_string()},
                    "requests": {RESOURCE: units.to_string()},
                }}],
            },
            "status": {"phase": if node.is_some() { "Running" } else { "Pending" }},
        })
    }

    /// A pod running on `node`, placed on GPU `gpu` (annotated as gpumem's
    /// plugin annotates what it places).
    fn bound(&self, name: &str, units: u64, node: &str, gpu: u32) {
        self.api
            .put(Self::pod_json(name, units, Some(node), Some(gpu)));
    }

    /// A pod waiting to be scheduled (UID `uid-<name>`).
    fn pending(&self, name: &str, units: u64) -> Value {
        self.api.put(Self::pod_json(name, units, None, None))
    }

    fn pod(&self, name: &str) -> Value {
        self.api.get(Kind::Pod, "default", name).unwrap()
    }

    /// A node with GPUs of these sizes and health.
    fn node(&self, name: &str, gpus: &[(u32, bool)]) {
        let gpus: Vec<Value> = gpus
            .iter()
            .enumerate()
            .map(|(i, (units, healthy))| {
                json!({"index": i, "uuid": format!("GPU-{name}-{i}"), "model": "NVIDIA A10",
                       "memoryMib": units * 1024, "units": units, "healthy": healthy})
            })
            .collect();
        self.api.put(json!({
            "kind": "Node",
            "metadata": {"name": name, "annotations": {GPUS_ANNOTATION: Value::Array(gpus).to_string()}},
        }));
    }
}

/// The extender binary, serving on an ephemeral loopback port.
struct Extender {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
}

impl Extender {
    async fn start(cluster: &Cluster, extra: &[&str]) -> Extender {
        let mut command = Command::new(env!("CARGO_BIN_EXE_gpumem"));
        for (key, _) in std::env::vars() {
            if key.starts_with("GPUMEM_") {
                command.env_remove(key);
            }
        }
        let mut child = command
            .args(["--log-format", "json", "extender"])
            .env("GPUMEM_EXTENDER_LISTEN_ADDR", "127.0.0.1:0")
            .env("GPUMEM_KUBECONFIG", &cluster.kubeconfig)
            .env("RUST_LOG", "info,gpumem::extender=debug")
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Drain stderr for the whole run (a full pipe would block the
        // extender's logging); pass on the address it serves on.
        let log = Arc::new(Mutex::new(String::new()));
        let (found, address) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if let Ok(entry) = serde_json::from_str::<Value>(&line) {
                    if let Some(addr) = entry.pointer("/fields/addr").and_then(Value::as_str) {
                        let _ = found.send(addr.to_owned());
                    }
                }
                let mut log = kept.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let addr = match address.recv_timeout(WAIT) {
            Ok(addr) => addr.parse().unwrap(),
            Err(_) => panic!(
                "the extender did not say where it serves; its log:\n{}",
                log.lock().unwrap()
            ),
        };
        let extender = Extender { child, addr, log };
        extender
            .wait_for("/healthz to answer 200", || async {
                (extender.get("/healthz").await.0 == 200).then_some(())
            })
            .await;
        extender
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    async fn request(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, String) {
        let body = body.map_or_else(Bytes::new, |b| Bytes::from(serde_json::to_vec(b).unwrap()));
        let (status, bytes) = http1::exchange(self.addr, method, path, body)
            .await
            .unwrap();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }

    async fn get(&self, path: &str) -> (u16, String) {
        self.request("GET", path, None).await
    }

    /// A verb, which must answer 200 with JSON.
    async fn call(&self, verb: &str, body: &Value) -> Value {
        let (status, text) = self.request("POST", verb, Some(body)).await;
        assert_eq!(status, 200, "{verb}: {text}\nlog:\n{}", self.log());
        serde_json::from_str(&text).unwrap()
    }

    async fn bind(&self, pod: &str, uid: &str, node: &str) -> String {
        let args = json!({"PodName": pod, "PodNamespace": "default", "PodUID": uid, "Node": node});
        let result = self.call("/bind", &args).await;
        assert_eq!(keys(&result), ["Error"]);
        result["Error"].as_str().unwrap().to_owned()
    }

    /// Filters `nodes` for a pod asking `units`, as a cache-capable
    /// scheduler asks.
    async fn filter(&self, units: u64, nodes: &[&str]) -> Value {
        let mut args = fixture("filter-node-names.json");
        args["Pod"]["spec"]["containers"][0]["resources"] = json!({
            "limits": {RESOURCE: units.to_string()}, "requests": {RESOURCE: units.to_string()},
        });
        args["NodeNames"] = json!(nodes);
        self.call("/filter", &args).await
    }

    async fn wait_for<T, F: std::future::Future<Output = Option<T>>>(
        &self,
        what: &str,
        mut check: impl FnMut() -> F,
    ) -> T {
        eventually(what, WAIT, POLL, async || {
            check()
                .await
                .ok_or_else(|| format!("extender log:\n{}", self.log()))
        })
        .await
    }
}

impl Extender {
    /// Where it serves /metrics, as it logged (started with --metrics-addr).
    fn metrics_addr(&self) -> SocketAddr {
        self.log()
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .find_map(|entry| {
                entry
                    .pointer("/fields/metrics_addr")
                    .and_then(Value::as_str)
                    .map(|a| a.parse().unwrap())
            })
            .unwrap_or_else(|| panic!("no metrics_addr in the log:\n{}", self.log()))
    }

    /// GET /metrics, asking for `accept` where given: the Content-Type and
    /// the body.
    fn scrape(&self, accept: Option<&str>) -> (String, String) {
        use std::io::Write;
        let mut stream = std::net::TcpStream::connect(self.metrics_addr()).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let accept = accept.map_or_else(String::new, |a| format!("Accept: {a}\r\n"));
        write!(
            stream,
            "GET /metrics HTTP/1.1\r\nHost: gpumem\r\n{accept}Connection: close\r\n\r\n"
        )
        .unwrap();
        let (text, _) = answer(&mut stream);
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let content_type = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-type: ")
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        (content_type, body.to_owned())
    }

    /// A sample's value in an OpenMetrics scrape; `None`: no such sample.
    fn sample(&self, series: &str) -> Option<f64> {
        sample(&self.scrape(None).1, series)
    }
}

fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series).then(|| value.parse().unwrap())
    })
}

impl Extender {
    /// The extender's peak resident memory so far (`VmHWM`), in bytes.
    fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().strip_suffix("kB"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no VmHWM in {status}"));
        kib << 10
    }

    /// Sends `request` as it is on a new connection: what the extender
    /// answers before it closes the connection (or `WAIT` passes).
    async fn raw(&self, request: &[u8]) -> String {
        use std::io::Write;
        let mut stream = self.connect();
        stream.write_all(request).unwrap();
        tokio::task::spawn_blocking(move || answer(&mut stream).0)
            .await
            .unwrap()
    }

    /// A raw connection to the extender, reads bounded by `WAIT`.
    fn connect(&self) -> std::net::TcpStream {
        let stream = std::net::TcpStream::connect(self.addr).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        stream
    }
}

/// Reads what the server answers until it closes the connection (or
/// resets it, or `WAIT` passes): the text, and whether it closed.
fn answer(stream: &mut std::net::TcpStream) -> (String, bool) {
    use std::io::Read;
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&answer).into_owned(), true),
            Ok(n) => answer.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (String::from_utf8_lossy(&answer).into_owned(), true)
            }
            Err(_) => return (String::from_utf8_lossy(&answer).into_owned(), false),
        }
    }
}

impl Drop for Extender {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keys(value: &Value) -> Vec<String> {
    let mut keys: Vec<String> = value.as_object().unwrap().keys().cloned().collect();
    keys.sort();
    keys
}

fn passed(result: &Value) -> Vec<String> {
    serde_json::from_value(result["NodeNames"].clone()).unwrap()
}

fn annotations(pod: &Value) -> Value {
    pod.pointer("/metadata/annotations")
        .cloned()
        .unwrap_or(Value::Null)
}

const V100_FULL: &str = "no single healthy GPU has 15 free units (free per GPU: GPU0 10, GPU1 10)";

#[tokio::test]
async fn filter_drops_the_v100_node_with_its_reason_in_both_request_shapes() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;

    // nodeCacheCapable: NodeNames in, NodeNames out.
    let result = extender
        .call("/filter", &fixture("filter-node-names.json"))
        .await;
    assert_eq!(
        keys(&result),
        [
            "Error",
            "FailedAndUnresolvableNodes",
            "FailedNodes",
            "NodeNames",
            "Nodes"
        ],
        "Go's field names"
    );
    assert_eq!(passed(&result), ["a10-node"]);
    assert_eq!(result["Nodes"], Value::Null);
    assert_eq!(result["FailedNodes"], json!({"v100-node": V100_FULL}));
    let bare = result["FailedAndUnresolvableNodes"]["bare-node"]
        .as_str()
        .unwrap();
    assert!(
        bare.contains("has not published node bare-node's GPUs"),
        "{bare}"
    );
    assert_eq!(result["Error"], "");

    // Not cache-capable: whole Nodes in, the passing ones out as they came.
    let request = fixture("filter-node-list.json");
    let result = extender.call("/filter", &request).await;
    assert_eq!(result["NodeNames"], Value::Null);
    assert_eq!(
        result["Nodes"]["items"],
        json!([request["Nodes"]["items"][1].clone()]),
        "a10-node, unchanged"
    );
    assert_eq!(result["FailedNodes"], json!({"v100-node": V100_FULL}));
    assert!(result["FailedAndUnresolvableNodes"]["bare-node"].is_string());

    // A pod that asks for no GPU memory passes every node, bare-node too.
    let mut plain = fixture("filter-node-names.json");
    plain["Pod"]["spec"]["containers"][0]["resources"] = json!({});
    let result = extender.call("/filter", &plain).await;
    assert_eq!(passed(&result), ["v100-node", "a10-node", "bare-node"]);
    assert_eq!(result["FailedAndUnresolvableNodes"], json!({}));
}

#[tokio::test]
async fn prioritize_orders_nodes_by_binpack_or_spread() {
    let cluster = Cluster::start().await;
    let request = fixture("prioritize-node-names.json");
    let scores = |result: Value| -> Vec<(String, i64)> {
        result
            .as_array()
            .unwrap()
            .iter()
            .map(|h| {
                assert_eq!(keys(h), ["Host", "Score"]);
                (
                    h["Host"].as_str().unwrap().to_owned(),
                    h["Score"].as_i64().unwrap(),
                )
            })
            .collect()
    };
    // 4 units: a V100 ends 9/15 full, the A10 10/22.
    let binpack = Extender::start(&cluster, &[]).await;
    assert_eq!(
        scores(binpack.call("/prioritize", &request).await),
        [("v100-node".to_owned(), 6), ("a10-node".to_owned(), 5)]
    );
    drop(binpack);
    let spread = Extender::start(&cluster, &["--placement", "spread"]).await;
    assert_eq!(
        scores(spread.call("/prioritize", &request).await),
        [("v100-node".to_owned(), 4), ("a10-node".to_owned(), 5)]
    );
}

#[tokio::test]
async fn bind_writes_gpushare_annotations_and_the_binding() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let result = extender.call("/bind", &fixture("bind.json")).await;
    let after = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    assert_eq!(result, json!({"Error": ""}), "{}", extender.log());

    let pod = cluster.pod("infer-4");
    assert_eq!(pod["spec"]["nodeName"], "v100-node");
    let annotations = annotations(&pod);
    assert_eq!(
        annotations[annotation::IDX],
        "0",
        "binpack, tie: lower index"
    );
    assert_eq!(annotations[annotation::POD], "4");
    assert_eq!(annotations[annotation::DEV], "15");
    assert_eq!(annotations[annotation::ASSIGNED], "false");
    assert_eq!(
        annotations[annotation::ALLOCATION],
        r#"{"0":{"0":4}}"#,
        "per container, for kubectl inspect gpushare"
    );
    let assumed: u128 = annotations[annotation::ASSUME_TIME]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((before..=after).contains(&assumed));
    assert!(cluster
        .api
        .requests()
        .contains(&"POST /api/v1/namespaces/default/pods/infer-4/binding".to_owned()));
    // Once the watch shows it, the pod counts once: GPU0 has 6 left.
    extender
        .wait_for("the pod watch to confirm the bind", || async {
            extender
                .log()
                .contains("the pod watch shows the bind; booking confirmed")
                .then_some(())
        })
        .await;
    let result = extender.filter(11, &["v100-node"]).await;
    assert_eq!(
        result["FailedNodes"]["v100-node"],
        "no single healthy GPU has 11 free units (free per GPU: GPU0 6, GPU1 10)"
    );

    // Refused by the extender once its watch shows the bind, else by the
    // API server; either way it says where the pod is.
    let again = extender.bind("infer-4", INFER_UID, "a10-node").await;
    assert!(
        again.contains("already") && again.contains("v100-node"),
        "{again}"
    );
}

#[tokio::test]
async fn two_binds_at_once_never_overfill_a_gpu() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    for name in ["pair-a", "pair-b", "one-a", "one-b"] {
        cluster.pending(name, 10);
    }
    // v100-node: 10 free on each GPU, so one pod each.
    let (a, b) = tokio::join!(
        extender.bind("pair-a", "uid-pair-a", "v100-node"),
        extender.bind("pair-b", "uid-pair-b", "v100-node"),
    );
    assert_eq!((a.as_str(), b.as_str()), ("", ""));
    let mut gpus = [
        annotations(&cluster.pod("pair-a"))[annotation::IDX].clone(),
        annotations(&cluster.pod("pair-b"))[annotation::IDX].clone(),
    ];
    gpus.sort_by_key(ToString::to_string);
    assert_eq!(gpus, [json!("0"), json!("1")]);

    // a10-node: one GPU with 16 free, so one pod and a clear refusal.
    let (a, b) = tokio::join!(
        extender.bind("one-a", "uid-one-a", "a10-node"),
        extender.bind("one-b", "uid-one-b", "a10-node"),
    );
    let (won, lost) = if a.is_empty() {
        ("one-a", b)
    } else {
        ("one-b", a)
    };
    assert!(
        lost.contains("no single healthy GPU has 10 free units (free per GPU: GPU0 6)"),
        "{lost}"
    );
    let bound: Vec<bool> = ["one-a", "one-b"]
        .iter()
        .map(|p| cluster.pod(p)["spec"]["nodeName"] == "a10-node")
        .collect();
    assert_eq!(bound.iter().filter(|b| **b).count(), 1);
    assert_eq!(cluster.pod(won)["spec"]["nodeName"], "a10-node");
}

#[tokio::test]
async fn an_unhealthy_gpu_is_never_chosen() {
    let cluster = Cluster::start().await;
    cluster.node("sick-node", &[(22, false), (15, true)]);
    cluster.pending("small", 4);
    // Spread would take the emptier GPU0, were it healthy.
    let extender = Extender::start(&cluster, &["--placement", "spread"]).await;
    let result = extender.filter(16, &["sick-node"]).await;
    let reason = result["FailedAndUnresolvableNodes"]["sick-node"]
        .as_str()
        .unwrap();
    assert!(
        reason.contains("(free per GPU: GPU0 unhealthy, GPU1 15)"),
        "{reason}"
    );
    assert_eq!(extender.bind("small", "uid-small", "sick-node").await, "");
    assert_eq!(annotations(&cluster.pod("small"))[annotation::IDX], "1");
}

#[tokio::test]
async fn a_restarted_extender_rebuilds_usage_from_the_annotations() {
    let cluster = Cluster::start().await;
    let first = Extender::start(&cluster, &[]).await;
    for name in ["pair-a", "pair-b"] {
        cluster.pending(name, 10);
        assert_eq!(
            first.bind(name, &format!("uid-{name}"), "v100-node").await,
            ""
        );
    }
    drop(first);

    let second = Extender::start(&cluster, &[]).await;
    let result = second.filter(1, &["v100-node"]).await;
    assert_eq!(
        result["FailedNodes"]["v100-node"],
        "no single healthy GPU has 1 free units (free per GPU: GPU0 0, GPU1 0)"
    );
    // A pod that finished holds nothing.
    let mut done = cluster.pod("pair-a");
    done["status"] = json!({"phase": "Succeeded"});
    cluster.api.put(done);
    second
        .wait_for("the finished pod's units to be free", || async {
            (passed(&second.filter(10, &["v100-node"]).await) == ["v100-node"]).then_some(())
        })
        .await;
}

#[tokio::test]
async fn a_booking_expires_when_the_bind_never_shows_in_the_watch() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &["--assume-timeout-secs", "7"]).await;
    cluster.pending("slow", 10);
    cluster.api.hang_next_bindings(1);
    let started = Instant::now();
    let error = extender.bind("slow", "uid-slow", "a10-node").await;
    assert!(
        error.contains("no answer from the API server")
            && error.contains("GPU 0's 10 units stay booked"),
        "{error}"
    );
    assert_eq!(cluster.pod("slow")["spec"]["nodeName"], Value::Null);
    // Booked: the A10's 16 free units are 6 for now.
    let result = extender.filter(10, &["a10-node"]).await;
    assert_eq!(
        result["FailedNodes"]["a10-node"],
        "no single healthy GPU has 10 free units (free per GPU: GPU0 6)"
    );
    extender
        .wait_for("the booking to expire", || async {
            (passed(&extender.filter(10, &["a10-node"]).await) == ["a10-node"]).then_some(())
        })
        .await;
    assert!(started.elapsed() >= Duration::from_millis(6900));
    // Logged before the filter answered, but read from the extender's
    // stderr by another thread: wait for it rather than race that thread.
    extender
        .wait_for("the expiry to be logged", || async {
            extender.log().contains("its booking expired").then_some(())
        })
        .await;
}

#[tokio::test]
async fn healthz_fails_while_the_pod_watch_keeps_failing_and_recovers_with_it() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    // The ClusterRole loses pods' list and watch, and the open watch ends.
    cluster.api.forbid(Kind::Pod, true);
    cluster.api.end_watches();
    let started = Instant::now();
    assert_eq!(
        extender.get("/healthz").await.0,
        200,
        "a blip is not a failure"
    );
    let why = extender
        .wait_for("/healthz to answer 503", || async {
            let (code, body) = extender.get("/healthz").await;
            (code == 503).then_some(body)
        })
        .await;
    assert!(started.elapsed() >= Duration::from_secs(2), "{why}");
    assert!(
        why.contains("the pods watch has failed 3 times in a row")
            && why.contains("pods is forbidden"),
        "{why}"
    );

    // Restored: the next change it delivers shows it works again.
    cluster.api.forbid(Kind::Pod, false);
    cluster.pending("after", 1);
    extender
        .wait_for("/healthz to answer 200 again", || async {
            (extender.get("/healthz").await.0 == 200).then_some(())
        })
        .await;
}

/// A watch whose history is gone lists afresh; lists that keep failing
/// must count as failures too, not be forgiven at each new try.
#[tokio::test]
async fn healthz_fails_while_relists_keep_failing() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    cluster.api.forbid(Kind::Pod, true);
    cluster.api.expire_watches(Kind::Pod, true);
    cluster.api.end_watches();
    let why = extender
        .wait_for("/healthz to answer 503", || async {
            let (code, body) = extender.get("/healthz").await;
            (code == 503).then_some(body)
        })
        .await;
    assert!(
        why.contains("the pods watch has failed 3 times in a row")
            && why.contains("listing: 403 Forbidden")
            && why.contains("pods is forbidden"),
        "{why}"
    );
    // Spaced: 0.8 s, 1.6 s, 3.2 s ... between lists, not one a second.
    let log = extender.log();
    assert!(log.contains(r#""retry_in":"1.6s""#), "{log}");
}

/// A watch whose resourceVersion is too old may be refused at its start
/// with a plain HTTP 410, not an ERROR event: kube-runtime's watcher retried
/// that same resourceVersion forever, and pods created since went unseen.
#[tokio::test]
async fn a_watch_refused_410_at_its_start_lists_afresh() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    cluster.api.compact(Kind::Pod);
    cluster.api.end_watches();
    extender
        .wait_for("the refused watch to be logged", || async {
            extender
                .log()
                .contains("starting the watch: 410 Expired")
                .then_some(())
        })
        .await;
    // Placed on the A10 since: its 16 free units are 6.
    cluster.bound("late", 10, "a10-node", 0);
    extender
        .wait_for("the late pod's units to count", || async {
            let result = extender.filter(10, &["a10-node"]).await;
            (result["FailedNodes"]["a10-node"]
                == "no single healthy GPU has 10 free units (free per GPU: GPU0 6)")
                .then_some(())
        })
        .await;
}

#[tokio::test]
async fn a_refused_bind_says_why_and_frees_its_booking() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    for name in ["first", "second"] {
        cluster.pending(name, 10);
    }
    cluster.api.conflict_next_writes(1);
    let error = extender.bind("first", "uid-first", "a10-node").await;
    assert!(
        error.starts_with("the API server refused binding default/first to node a10-node")
            && error.contains("modified"),
        "{error}"
    );
    // Its booking is gone: the A10 still takes a 10-unit pod.
    assert_eq!(extender.bind("second", "uid-second", "a10-node").await, "");

    let error = extender.bind("first", "uid-first", "bare-node").await;
    assert!(
        error.contains("has not published node bare-node's GPUs"),
        "{error}"
    );
    let error = extender.bind("first", "uid-other", "v100-node").await;
    assert!(error.contains("deleted and created again"), "{error}");
    let error = extender.bind("nobody", "uid-nobody", "v100-node").await;
    assert!(error.contains("cannot read pod default/nobody"), "{error}");
    let (status, text) = extender.request("POST", "/bind", Some(&json!([1]))).await;
    assert_eq!(status, 200);
    assert!(text.contains("cannot decode the bind request"), "{text}");
}

/// 90 MiB of node names, sent chunked so that no declared length refuses
/// it up front, OOM-killed the extender at its 256 MiB limit: it read the
/// whole body, then decoded it into several times that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_filter_body_is_refused_without_the_extender_holding_it() {
    use std::io::Write;
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    let before = extender.peak_rss();
    let mut args = fixture("filter-node-names.json");
    let names: Vec<String> = (0..400_000).map(|i| format!("{i:0>240}")).collect();
    args["NodeNames"] = json!(names);
    let body = serde_json::to_vec(&args).unwrap();
    assert!(body.len() > 90 << 20);
    let mut stream = extender.connect();
    let mut writer = stream.try_clone().unwrap();
    let sent = std::thread::spawn(move || {
        let head = "POST /filter HTTP/1.1\r\nHost: gpumem\r\nContent-Type: application/json\r\n\
                    Transfer-Encoding: chunked\r\n\r\n";
        let mut result = writer.write_all(head.as_bytes());
        for chunk in body.chunks(1 << 20) {
            result = result
                .and_then(|()| write!(writer, "{:x}\r\n", chunk.len()))
                .and_then(|()| writer.write_all(chunk))
                .and_then(|()| writer.write_all(b"\r\n"));
            if result.is_err() {
                // Refused: the extender stopped reading.
                return;
            }
        }
        let _ = writer.write_all(b"0\r\n\r\n");
    });
    let (text, _) = tokio::task::spawn_blocking(move || answer(&mut stream))
        .await
        .unwrap();
    sent.join().unwrap();
    assert!(
        text.starts_with("HTTP/1.1 413"),
        "{}\nlog:\n{}",
        &text[..text.len().min(300)],
        extender.log()
    );
    let grown = extender.peak_rss().saturating_sub(before);
    assert!(
        grown < 40 << 20,
        "the extender's peak RSS grew {} MiB",
        grown >> 20
    );
    // Still serving.
    assert_eq!(extender.get("/healthz").await.0, 200);
}

/// kube-scheduler sends its headers at once; 2000 requests that stopped
/// halfway through theirs all stayed open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_request_is_closed_after_the_header_timeout() {
    use gpumem::extender::server::HEADER_TIMEOUT;
    use std::io::Write;
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    let mut stream = extender.connect();
    stream
        .write_all(b"POST /filter HTTP/1.1\r\nHost: gpumem\r\nContent-")
        .unwrap();
    let started = Instant::now();
    let (_, closed) = tokio::task::spawn_blocking(move || answer(&mut stream))
        .await
        .unwrap();
    assert!(closed, "still open after {:?}", started.elapsed());
    assert!(started.elapsed() >= HEADER_TIMEOUT - Duration::from_millis(100));
    assert_eq!(extender.get("/healthz").await.0, 200);
}

/// A body that stops coming is refused, not waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_coming_is_refused_with_408() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &[]).await;
    let text = extender
        .raw(b"POST /filter HTTP/1.1\r\nHost: gpumem\r\nContent-Length: 100\r\n\r\n{\"Pod\":")
        .await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
}

/// An operator sees each verb's requests by outcome, their durations,
/// each bind's result and what the books hold, on a listener of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_each_verb_by_outcome_and_each_bind_by_result() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &["--metrics-addr", "127.0.0.1:0"]).await;
    assert_ne!(extender.metrics_addr(), extender.addr);
    let (_, scrape) = extender.scrape(None);
    for (series, value) in [
        ("gpumem_extender_synced", 1.0),
        ("gpumem_extender_stale", 0.0),
        (r#"gpumem_extender_nodes{state="published"}"#, 2.0),
        (r#"gpumem_extender_nodes{state="unpublished"}"#, 1.0),
        (r#"gpumem_extender_gpus{healthy="true"}"#, 3.0),
        (r#"gpumem_extender_gpus{healthy="false"}"#, 0.0),
    ] {
        assert_eq!(sample(&scrape, series), Some(value), "{series}\n{scrape}");
    }
    assert!(scrape.contains("gpumem_build_info{"), "{scrape}");

    let filtered = extender.filter(4, &["v100-node", "a10-node"]).await;
    assert_eq!(passed(&filtered), ["v100-node", "a10-node"]);
    assert_eq!(
        extender.call("/bind", &fixture("bind.json")).await["Error"],
        ""
    );
    cluster.pending("elsewhere", 1);
    let error = extender
        .bind("elsewhere", "uid-elsewhere", "bare-node")
        .await;
    assert!(error.contains("has not published"), "{error}");
    let (status, _) = extender
        .request("POST", "/prioritize", Some(&json!([1])))
        .await;
    assert_eq!(status, 400);
    // A declared length past the limit is refused before any of it is read.
    let text = extender
        .raw(b"POST /filter HTTP/1.1\r\nHost: gpumem\r\nContent-Length: 104857600\r\n\r\n")
        .await;
    assert!(text.starts_with("HTTP/1.1 413"), "{text}");

    let (content_type, scrape) = extender.scrape(None);
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    assert!(scrape.ends_with("# EOF\n"), "{scrape}");
    for (series, value) in [
        (
            r#"gpumem_extender_requests_total{verb="filter",code="200",outcome="ok"}"#,
            1.0,
        ),
        (
            r#"gpumem_extender_requests_total{verb="filter",code="413",outcome="refused"}"#,
            1.0,
        ),
        (
            r#"gpumem_extender_requests_total{verb="bind",code="200",outcome="ok"}"#,
            1.0,
        ),
        (
            r#"gpumem_extender_requests_total{verb="bind",code="200",outcome="error"}"#,
            1.0,
        ),
        (
            r#"gpumem_extender_requests_total{verb="prioritize",code="400",outcome="refused"}"#,
            1.0,
        ),
        (r#"gpumem_extender_binds_total{result="ok"}"#, 1.0),
        (r#"gpumem_extender_binds_total{result="no_fit"}"#, 1.0),
        (
            r#"gpumem_extender_request_duration_seconds_count{verb="bind"}"#,
            2.0,
        ),
        (
            r#"gpumem_extender_request_duration_seconds_count{verb="filter"}"#,
            2.0,
        ),
        (
            r#"gpumem_extender_request_duration_seconds_bucket{le="+Inf",verb="bind"}"#,
            2.0,
        ),
    ] {
        assert_eq!(sample(&scrape, series), Some(value), "{series}\n{scrape}");
    }
    assert!(
        sample(
            &scrape,
            r#"gpumem_extender_request_duration_seconds_sum{verb="bind"}"#
        )
        .is_some_and(|s| s > 0.0),
        "{scrape}"
    );

    // A scraper that asks only for the classic text format gets it.
    let (content_type, classic) = extender.scrape(Some("text/plain;version=0.0.4"));
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    assert!(
        classic.contains("# TYPE gpumem_extender_requests_total counter\n"),
        "{classic}"
    );
    assert!(!classic.contains("# EOF"), "{classic}");
}

/// A real Prometheus reads what the extender serves (it asks for
/// OpenMetrics first): counters, the histogram and the books' gauges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_reads_the_extenders_metrics() {
    use common::prometheus::{static_scrape, Prometheus};
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &["--metrics-addr", "127.0.0.1:0"]).await;
    extender.filter(4, &["v100-node"]).await;
    assert_eq!(
        extender.call("/bind", &fixture("bind.json")).await["Error"],
        ""
    );
    let dir = tempfile::tempdir().unwrap();
    let prometheus = Prometheus::start(dir.path(), &static_scrape(extender.metrics_addr().port()));
    let started = Instant::now();
    for (expr, value) in [
        (
            r#"gpumem_extender_requests_total{verb="bind",code="200",outcome="ok"}"#,
            "1",
        ),
        (r#"gpumem_extender_binds_total{result="ok"}"#, "1"),
        (
            r#"gpumem_extender_request_duration_seconds_count{verb="filter"}"#,
            "1",
        ),
        (
            r#"gpumem_extender_request_duration_seconds_bucket{verb="filter",le="+Inf"}"#,
            "1",
        ),
        (r#"gpumem_extender_nodes{state="published"}"#, "2"),
        ("gpumem_extender_synced", "1"),
    ] {
        let series = prometheus
            .query_until(expr, started, |s| s.len() == 1)
            .await;
        assert_eq!(
            series.first().map(|s| s["@value"].as_str()),
            Some(value),
            "{expr}: {series:?}\n{}",
            prometheus.log()
        );
    }
}

/// The books going stale shows in the metrics as in /healthz.
#[tokio::test]
async fn metrics_show_the_books_stale_while_a_watch_keeps_failing() {
    let cluster = Cluster::start().await;
    let extender = Extender::start(&cluster, &["--metrics-addr", "127.0.0.1:0"]).await;
    assert_eq!(extender.sample("gpumem_extender_stale"), Some(0.0));
    cluster.api.forbid(Kind::Pod, true);
    cluster.api.end_watches();
    extender
        .wait_for("gpumem_extender_stale 1", || async {
            (extender.sample("gpumem_extender_stale") == Some(1.0)).then_some(())
        })
        .await;
    assert_eq!(extender.get("/healthz").await.0, 503);
    assert_eq!(extender.sample("gpumem_extender_synced"), Some(1.0));
}

#[test]
fn a_bad_metrics_address_is_refused_naming_the_flag() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args([
            "extender",
            "--listen-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "nowhere",
        ])
        .env_remove("GPUMEM_EXTENDER_METRICS_ADDR")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid --metrics-addr \"nowhere\""),
        "{stderr}"
    );
}

#[test]
fn every_extender_flag_has_an_env_var() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["extender", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for (flag, env) in [
        ("--listen-addr", "GPUMEM_EXTENDER_LISTEN_ADDR"),
        ("--kubeconfig", "GPUMEM_KUBECONFIG"),
        ("--resource-name", "GPUMEM_RESOURCE_NAME"),
        ("--placement", "GPUMEM_PLACEMENT"),
        ("--assume-timeout-secs", "GPUMEM_ASSUME_TIMEOUT_SECS"),
        ("--metrics-addr", "GPUMEM_EXTENDER_METRICS_ADDR"),
    ] {
        assert!(
            help.contains(flag) && help.contains(&format!("[env: {env}=")),
            "{flag}: {help}"
        );
    }
    assert!(help.contains("[default: :12345]"), "{help}");
}

/// A measurement for docs/BENCHMARKS.md, not a check (run with
/// `--ignored --nocapture`): how much the extender's peak RSS grows with
/// the largest filters it accepts, 5000 of the longest node names and
/// whole Nodes near the body limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement"]
async fn peak_rss_of_the_largest_filters() {
    let cluster = Cluster::start().await;
    for shape in ["NodeNames", "Nodes"] {
        let extender = Extender::start(&cluster, &[]).await;
        let before = extender.peak_rss();
        let mut args = fixture("filter-node-list.json");
        if shape == "NodeNames" {
            let names: Vec<String> = (0..5000).map(|i| format!("{i:0>253}")).collect();
            args["Nodes"] = Value::Null;
            args["NodeNames"] = json!(names);
        } else {
            let items = args["Nodes"]["items"].as_array().unwrap().clone();
            let size = serde_json::to_vec(&items).unwrap().len() / items.len() + 12;
            let count = ((8 << 20) - 200_000) / size;
            let all: Vec<Value> = (0..count)
                .map(|i| {
                    let mut node = items[i % items.len()].clone();
                    node["metadata"]["name"] = json!(format!("node-{i}"));
                    node
                })
                .collect();
            args["Nodes"]["items"] = json!(all);
        }
        let body = serde_json::to_vec(&args).unwrap();
        let len = body.len();
        let (status, _) = http1::exchange(extender.addr, "POST", "/filter", Bytes::from(body))
            .await
            .unwrap();
        assert_eq!(status, 200);
        let after = extender.peak_rss();
        println!(
            "{shape}: a {len}-byte filter; VmHWM {} -> {} KiB (+{} KiB)",
            before >> 10,
            after >> 10,
            (after - before) >> 10
        );
    }
}
