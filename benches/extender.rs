//! Extender benchmarks (not tests): `cargo bench --bench extender`.
//!
//! Filter, prioritize and the bind's choice-and-booking on 1000 nodes × 8
//! GPUs (79 units each, an 80 GB GPU in GiB) with 4 pods per GPU, through
//! the pure core, then filter through HTTP on loopback as kube-scheduler
//! calls it (names only, and whole Nodes). Target: filter ≤ 5 ms p99.
//! Results and the machine go to docs/BENCHMARKS.md.
mod common;

use common::percentile;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{json, Value};

use gpumem::cluster::gpushare::annotation;
use gpumem::cluster::node::{PublishedGpu, GPUS_ANNOTATION};
use gpumem::extender::api::{ExtenderArgs, NodeList};
use gpumem::extender::bind::Binder;
use gpumem::extender::cache::{Assume, Cache};
use gpumem::extender::{fit, server};
use gpumem::node::placement::Policy;
use gpumem_testkit::http1;

const RESOURCE: &str = "aliyun.com/gpu-mem";
const NODES: usize = 1000;
const GPUS: u32 = 8;
const GPU_UNITS: u32 = 79;
const PODS_PER_GPU: usize = 4;

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort_unstable();
    println!(
        "{name:<58} n={:<6} p50={:>8.1?} p99={:>8.1?} max={:>8.1?}",
        samples.len(),
        percentile(&samples, 0.50),
        percentile(&samples, 0.99),
        samples[samples.len() - 1]
    );
}

/// A small deterministic generator, so every run books the same pods.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % below
    }
}

fn node_name(i: usize) -> String {
    format!("gpu-node-{i:04}")
}

/// The node as kube-scheduler sends it whole: the fixture's V100 node
/// (labels, conditions, node info) with this node's name and GPUs.
fn node_json(template: &Value, i: usize, gpus: &str) -> Value {
    let mut node = template.clone();
    node["metadata"]["name"] = json!(node_name(i));
    node["metadata"]["labels"]["kubernetes.io/hostname"] = json!(node_name(i));
    node["metadata"]["annotations"][GPUS_ANNOTATION] = json!(gpus);
    node
}

fn pod(name: &str, units: u64, node: Option<&str>, gpu: Option<u32>) -> Pod {
    let annotations = gpu.map_or_else(
        || json!({}),
        |gpu| json!({annotation::IDX: gpu.to_string(), annotation::ASSIGNED: "true"}),
    );
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": "bench", "uid": format!("uid-{name}"),
                     "annotations": annotations},
        "spec": {"nodeName": node, "containers": [{"name": "main", "resources": {
            "limits": {RESOURCE: units.to_string()}, "requests": {RESOURCE: units.to_string()},
        }}]},
        "status": {"phase": "Running"},
    }))
    .unwrap()
}

/// The books of a 1000-node cluster, and its nodes as JSON.
fn cluster() -> (Cache, Vec<Value>) {
    let template = serde_json::from_str::<Value>(include_str!(
        "../tests/fixtures/extender/filter-node-list.json"
    ))
    .unwrap()["Nodes"]["items"][0]
        .clone();
    let mut rng = Lcg(7);
    let mut nodes = Vec::new();
    let mut node_json_list = Vec::new();
    let mut pods = Vec::new();
    for i in 0..NODES {
        let gpus: Vec<PublishedGpu> = (0..GPUS)
            .map(|g| PublishedGpu {
                index: g,
                uuid: format!("GPU-{i:04}-{g}"),
                model: "NVIDIA A100-SXM4-80GB".into(),
                memory_mib: 81920,
                units: GPU_UNITS,
                // One GPU in a hundred is unhealthy.
                healthy: rng.next(100) != 0,
            })
            .collect();
        let text = serde_json::to_string(&gpus).unwrap();
        let node = node_json(&template, i, &text);
        nodes.push(serde_json::from_value::<Node>(node.clone()).unwrap());
        node_json_list.push(node);
        for g in 0..GPUS {
            for p in 0..PODS_PER_GPU {
                // 2..=18 units: at most 72 of a GPU's 79.
                let units = 2 + rng.next(17);
                let name = format!("p-{i}-{g}-{p}");
                pods.push(pod(&name, units, Some(&node_name(i)), Some(g)));
            }
        }
    }
    let mut cache = Cache::new(RESOURCE);
    cache.replace_nodes(&nodes);
    cache.replace_pods(&pods);
    (cache, node_json_list)
}

fn args(units: u64, names: &[String], whole: Option<&[Value]>) -> ExtenderArgs {
    ExtenderArgs {
        pod: Some(pod("incoming", units, None, None)),
        nodes: whole.map(|items| NodeList {
            metadata: Some(json!({})),
            items: items
                .iter()
                .map(|n| serde_json::value::to_raw_value(n).expect("a node serialises"))
                .collect(),
        }),
        node_names: whole.is_none().then(|| names.to_vec()),
    }
}

fn pure(cache: &Cache, nodes: &[Value]) {
    let names: Vec<String> = (0..NODES).map(node_name).collect();
    println!(
        "\n# Pure core, {NODES} nodes × {GPUS} GPUs × {GPU_UNITS} units, {} pods",
        cache.pod_count()
    );
    for (units, what) in [
        (16, "typical"),
        (55, "a mix"),
        (70, "nearly all fail, each with its reason"),
    ] {
        let request = args(units, &names, None);
        let result = fit::filter(cache, request.clone());
        let passing = result.node_names.as_ref().map_or(0, Vec::len);
        let mut samples = Vec::new();
        for _ in 0..300 {
            let request = request.clone();
            let start = Instant::now();
            let result = std::hint::black_box(fit::filter(cache, request));
            samples.push(start.elapsed());
            // Dropped outside the timing: the server drops it after
            // writing the answer.
            drop(result);
        }
        report(
            &format!("filter, NodeNames, {units} units ({what}: {passing} pass)"),
            samples,
        );
    }
    let request = args(16, &names, Some(nodes));
    let mut samples = Vec::new();
    for _ in 0..100 {
        let request = request.clone();
        let start = Instant::now();
        let result = std::hint::black_box(fit::filter(cache, request));
        samples.push(start.elapsed());
        drop(result);
    }
    report("filter, whole Nodes, 16 units", samples);
    for policy in [Policy::Binpack, Policy::Spread] {
        let request = args(16, &names, None);
        let mut samples = Vec::new();
        for _ in 0..300 {
            let start = Instant::now();
            let scores = std::hint::black_box(fit::prioritize(cache, &request, policy));
            samples.push(start.elapsed());
            drop(scores);
        }
        report(
            &format!("prioritize, NodeNames, 16 units, {policy}"),
            samples,
        );
    }
}

/// The bind's critical section: choose the GPU and book it, under the lock.
fn bind_choice(cache: Cache) {
    println!("\n# Bind: choose a GPU and book it, under the cache's lock");
    let cache = Mutex::new(cache);
    let mut rng = Lcg(11);
    let mut samples = Vec::new();
    let mut booked = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(3600);
    for i in 0..10_000 {
        let node = node_name(rng.next(NODES as u64) as usize);
        let uid = format!("bind-{i}");
        let start = Instant::now();
        let mut guard = cache.lock().unwrap();
        if let Ok(gpu) = fit::choose(&guard, &node, 4, Policy::Binpack) {
            booked.push(guard.assume(
                Assume {
                    uid: &uid,
                    namespace: "bench",
                    name: &uid,
                    node: &node,
                    gpu: gpu.index,
                    units: 4,
                },
                deadline,
            ));
        }
        drop(guard);
        samples.push(start.elapsed());
        // Keep the cluster from filling up: half the bookings go again.
        if booked.len() > 1000 {
            let mut guard = cache.lock().unwrap();
            for a in booked.drain(..500) {
                guard.forget(&a);
            }
        }
    }
    report("choose + assume, 4 units, binpack", samples);
    let mut guard = cache.lock().unwrap();
    let start = Instant::now();
    let expired = guard.expire(deadline).len();
    println!("expire {expired} bookings at once: {:.1?}", start.elapsed());
}

async fn post(addr: std::net::SocketAddr, path: &str, body: Bytes) -> (u16, usize) {
    let (status, bytes) = http1::exchange(addr, "POST", path, body).await.unwrap();
    (status, bytes.len())
}

/// Filter as kube-scheduler calls it: a fresh connection, the JSON both
/// ways. The binder's client points nowhere: filter makes no API call.
async fn http(cache: Cache, nodes: Vec<Value>) {
    println!("\n# HTTP on loopback (new connection per call, as Go's client after idle)");
    let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
    let binder = Arc::new(Binder {
        client: kube::Client::try_from(config).unwrap(),
        cache: Arc::new(Mutex::new(cache)),
        policy: Policy::Binpack,
        assume_timeout: Duration::from_secs(60),
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            server::router(
                binder.clone(),
                Arc::new(gpumem::extender::metrics::ExtenderMetrics::new(
                    binder.cache.clone(),
                )),
            ),
        )
        .await
    });
    let names: Vec<String> = (0..NODES).map(node_name).collect();
    for (what, request, rounds) in [
        ("NodeNames", args(16, &names, None), 300),
        ("whole Nodes", args(16, &names, Some(&nodes)), 40),
    ] {
        let body = Bytes::from(serde_json::to_vec(&request).unwrap());
        let mut samples = Vec::new();
        let mut answer = 0;
        for _ in 0..rounds {
            let start = Instant::now();
            let (status, len) = post(addr, "/filter", body.clone()).await;
            samples.push(start.elapsed());
            assert_eq!(status, 200);
            answer = len;
        }
        report(
            &format!(
                "POST /filter, {what} ({} kB in, {} kB out)",
                body.len() / 1024,
                answer / 1024
            ),
            samples,
        );
    }
}

fn main() {
    // `cargo test --benches` runs this with --bench absent: keep that quick.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let start = Instant::now();
    let (cache, nodes) = cluster();
    println!("built the books in {:.1?}", start.elapsed());
    pure(&cache, &nodes);
    bind_choice(cluster().0);
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(http(cache, nodes));
}
