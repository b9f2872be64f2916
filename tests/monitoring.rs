//! The monitoring the chart ships, against a real Prometheus: Debian's
//! `prometheus` scrapes a running `gpumem plugin` on a fake node with pods and
//! load, and every query of the Grafana dashboard's rows that the device
//! plugin fills returns the series it should (tests/dra.rs checks the DRA
//! driver's); `promtool test rules` proves each alert fires and clears.
//!
//! Needs `prometheus` and `promtool` on PATH (Debian and Ubuntu: `apt-get
//! install prometheus`; `.ci/run` installs them). Without them the tests
//! that use them fail, saying so: a monitoring test that passes without
//! Prometheus proves nothing. The NVML path's readings are checked too,
//! through the fake `libnvidia-ml.so.1`.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::prometheus::{
    check_dashboard, free_port, get, prometheus_tool, query, repo, static_scrape, Prometheus,
    PLUGIN_ROWS,
};
use common::wait::{eventually, POLL};
use common::{shim_kit, Killed, RESOURCE, WAIT};
use gpumem_testkit::simulator::KubeletSim;
use serde_json::Value;

const T4: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";
/// What the plugin calls its node (`Hostname` on every GPU's series).
const NODE: &str = "gpu-node-1";
/// A pod gpumem did not place, whose process reached the GPU anyway.
const STRANGER_POD: &str = "0a1b2c3d-4e5f-4678-9abc-def012345678";
/// `gpumem plugin` as the chart runs it, registered with the simulated
/// kubelet, on a fake node under one directory: the shim installed,
/// reconciling every second, metrics on a free port.
struct ChartPlugin {
    kubelet: KubeletSim,
    metrics_port: u16,
    log: PathBuf,
    _plugin: Killed,
}

impl ChartPlugin {
    /// In `dir`, with what `node` adds to say what the node's GPUs are.
    async fn start(dir: &Path, node: impl FnOnce(&mut Command) -> &mut Command) -> ChartPlugin {
        let (kubelet_dir, host, state) = (dir.join("kubelet"), dir.join("shim"), dir.join("state"));
        for d in [&kubelet_dir, &host, &state] {
            std::fs::create_dir_all(d).unwrap();
        }
        common::fake_installed_shim(&host);
        let kubelet = KubeletSim::start(&kubelet_dir).unwrap();
        let metrics_port = free_port();
        let log = dir.join("plugin.log");
        let mut cmd = common::gpumem_cmd();
        cmd.arg("plugin")
            .arg("--kubelet-dir")
            .arg(&kubelet_dir)
            .arg("--pod-resources-socket")
            .arg(kubelet.pod_resources_socket())
            .arg("--shim-host-dir")
            .arg(&host)
            .arg("--state-dir")
            .arg(&state)
            .args(["--status-socket", "", "--reconcile-secs", "1"])
            // As the chart sets it (no --node-name: that means "use the API
            // server").
            .env("GPUMEM_METRICS_HOSTNAME", NODE)
            .arg(format!("--metrics-addr=127.0.0.1:{metrics_port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap());
        let plugin = ChartPlugin {
            _plugin: Killed(node(&mut cmd).spawn().unwrap()),
            kubelet,
            metrics_port,
            log,
        };
        if plugin
            .kubelet
            .wait_for_devices(RESOURCE, 1, WAIT)
            .await
            .is_none()
        {
            panic!("the plugin did not register:\n{}", plugin.log());
        }
        plugin
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

#[test]
fn each_alert_fires_and_clears() {
    let output = Command::new(prometheus_tool("promtool"))
        .args(["test", "rules"])
        .arg(repo("tests/fixtures/prometheus/rules-test.yaml"))
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "promtool test rules:\n{text}");
    // Every alert of the rules file has its test.
    let tests = std::fs::read_to_string(repo("tests/fixtures/prometheus/rules-test.yaml")).unwrap();
    let rules =
        std::fs::read_to_string(repo("deploy/helm/gpumem/monitoring/gpumem.rules.yaml")).unwrap();
    for alert in rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            tests.contains(&format!("alertname: {alert}")),
            "no test for {alert}"
        );
    }
}

/// GET `path` asking for `accept`: the Content-Type and the body.
async fn get_accepting(port: u16, path: &str, accept: &str) -> (String, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAccept: {accept}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let content_type = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    (content_type, body.to_owned())
}

fn both_logs(plugin: &ChartPlugin, prometheus: &Prometheus) -> String {
    format!(
        "plugin:\n{}\nprometheus:\n{}",
        plugin.log(),
        prometheus.log()
    )
}

/// The fake T4 with the readings NVML would give, the pod's holder at
/// 1300 MiB and 40 % of the SMs, and a stranger of another pod at 200 MiB
/// and 15 %.
fn node_file(holder: u32) -> String {
    let base = std::fs::read_to_string(common::fixture("t4")).unwrap();
    let stranger_cgroup = format!(
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/\
         cri-containerd-{}.scope\n",
        STRANGER_POD.replace('-', "_"),
        "b".repeat(64)
    );
    format!(
        "{base}utilization_percent = 87\ntemperature_celsius = 64\npower_watts = 70\n\
         [[gpu.process]]\npid = {holder}\nused_mib = 1300\nsm_percent = 40\n\
         [[gpu.process]]\npid = 900003\nused_mib = 200\nsm_percent = 15\ncgroup = {stranger_cgroup:?}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_its_series() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = dir.path().join("node.toml");
    common::rewrite_fake_gpus(
        &gpus,
        std::fs::read_to_string(common::fixture("t4")).unwrap(),
    );
    // The plugin as the chart runs it, on the fake node.
    let plugin = ChartPlugin::start(dir.path(), |cmd| cmd.arg("--fake-gpus").arg(&gpus)).await;
    let (kubelet, metrics_port) = (&plugin.kubelet, plugin.metrics_port);
    // A pod with 4 GiB, its process holding 1000 MiB under the shim.
    let allocation = kubelet.admit("nb", "main", RESOURCE, 4).await.unwrap();
    let container = PathBuf::from(&allocation.response.mounts[2].host_path);
    let mut holder = Killed(
        shim_kit()
            .probe(Some(&container))
            .args(["alloc:1000", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    common::wait_for_line(&mut holder, "holding");
    common::rewrite_fake_gpus(&gpus, node_file(holder.id()));

    // Prometheus scraping the plugin every second with the chart's rules
    // loaded.
    let prometheus = Prometheus::start(dir.path(), &static_scrape(metrics_port));
    let prometheus_port = prometheus.port;
    let logs = || both_logs(&plugin, &prometheus);

    // Each query of the rows the device plugin fills answers with the
    // pod's and the node's series, and the variables offer them.
    check_dashboard(
        &prometheus,
        PLUGIN_ROWS,
        &[("pod", "nb"), ("Hostname", NODE)],
        &[("node", NODE), ("namespace", "default")],
        logs,
    )
    .await;

    // And the values are the node's: the pod's memory next to its GPU's
    // utilisation, temperature and power, its SMs, and the stranger.
    for (expr, expected) in [
        ("gpumem_container_used_bytes", "1363148800"),
        ("gpumem_container_sm_utilization_ratio", "0.4"),
        ("gpumem_gpu_utilization_ratio * on (UUID) group_right () (gpumem_container_cap_bytes > bool 0)", "0.87"),
        ("gpumem_gpu_temperature_celsius * on (UUID) group_right () (gpumem_container_cap_bytes > bool 0)", "64"),
        ("gpumem_gpu_power_watts * on (UUID) group_right () (gpumem_container_cap_bytes > bool 0)", "70"),
    ] {
        let series = query(prometheus_port, expr).await;
        assert_eq!(series.len(), 1, "{expr}: {series:?}");
        let s = &series[0];
        assert_eq!(
            (s["pod"].as_str(), s["UUID"].as_str(), s["Hostname"].as_str(), s["@value"].as_str()),
            ("nb", T4, NODE, expected),
            "{expr}"
        );
    }
    let strangers = query(
        prometheus_port,
        "gpumem_unmanaged_process_sm_utilization_ratio",
    )
    .await;
    assert_eq!(strangers.len(), 1, "{strangers:?}");
    assert_eq!(
        (
            strangers[0].get("pid"),
            strangers[0]["pod_uid"].as_str(),
            strangers[0]["@value"].as_str()
        ),
        // Per pod and container: no PID, which would make a series of
        // every process a tenant starts.
        (None, STRANGER_POD, "0.15")
    );
    // Without --arena-metrics, none of the series arena reads.
    let arena = query(prometheus_port, r#"{__name__=~"nvidia_gpu_.*"}"#).await;
    assert!(arena.is_empty(), "{arena:?}");
    // The rules load and evaluate: the stranger's memory is pending.
    let pending = query(
        prometheus_port,
        "ALERTS{alertname=\"GpumemUnmanagedGpuMemory\"}",
    )
    .await;
    assert_eq!(pending.len(), 1, "{pending:?}\n{}", logs());
}

/// gpumem's own pod as Kubernetes service discovery describes it, for the
/// chart's ServiceMonitor (`endpoints` role, through the metrics Service) or
/// PodMonitor (`pod` role): the labels prometheus-operator's relabelings
/// read, as the chart (release gpumem in kube-system) sets them.
fn discovered_gpumem_pod(kind: &str) -> Value {
    let mut labels = serde_json::Map::new();
    let mut put = |name: &str, value: &str| {
        labels.insert(format!("__meta_kubernetes_{name}"), Value::from(value));
    };
    put("namespace", "kube-system");
    put("pod_name", "gpumem-x7k2p");
    put("pod_container_name", "gpumem");
    put("pod_container_port_name", "metrics");
    put("pod_node_name", NODE);
    put("pod_phase", "Running");
    let mut object_labels = vec![
        ("app_kubernetes_io_name", "gpumem"),
        ("app_kubernetes_io_instance", "gpumem"),
    ];
    if kind == "ServiceMonitor" {
        put("service_name", "gpumem-metrics");
        put("endpoint_port_name", "metrics");
        put("endpoint_address_target_kind", "Pod");
        put("endpoint_address_target_name", "gpumem-x7k2p");
        object_labels.push(("app_kubernetes_io_component", "metrics"));
    }
    let object = if kind == "ServiceMonitor" {
        "service"
    } else {
        "pod"
    };
    for (name, value) in object_labels {
        put(&format!("{object}_label_{name}"), value);
        put(&format!("{object}_labelpresent_{name}"), "true");
    }
    Value::Object(labels)
}

/// The chart's ServiceMonitor and PodMonitor as prometheus-operator turns
/// them into scrape configs (tests/fixtures/prometheus/, which
/// .ci/validate-manifests.py keeps equal to what the chart renders): its
/// target labels name gpumem's own pod, and a per-pod series must still
/// name the tenant's namespace, pod and container, not exported_* ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_pod_series_keep_the_tenants_labels_behind_prometheus_operator() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = ChartPlugin::start(dir.path(), |cmd| {
        cmd.arg("--fake-gpus").arg(common::fixture("t4"))
    })
    .await;
    plugin
        .kubelet
        .admit("nb", "main", RESOURCE, 4)
        .await
        .unwrap();
    let fixture = repo("tests/fixtures/prometheus/operator-scrape-configs.json");
    let configs: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    let mut scrape = String::from("scrape_configs:\n");
    for kind in ["ServiceMonitor", "PodMonitor"] {
        let kind_configs = configs[kind].as_array().unwrap();
        assert!(!kind_configs.is_empty(), "no {kind} scrape config");
        for config in kind_configs {
            let mut config = config.clone();
            config["scrape_interval"] = "1s".into();
            config["static_configs"] = serde_json::json!([{
                "targets": [format!("127.0.0.1:{}", plugin.metrics_port)],
                "labels": discovered_gpumem_pod(kind),
            }]);
            // JSON is YAML's flow style.
            scrape += &format!("  - {config}\n");
        }
    }
    let prometheus = Prometheus::start(dir.path(), &scrape);
    let logs = || both_logs(&plugin, &prometheus);

    // The `job` label each monitor's targets get: the Service's name, or
    // the PodMonitor's namespace/name.
    let started = Instant::now();
    for (kind, job) in [
        ("ServiceMonitor", "gpumem-metrics"),
        ("PodMonitor", "kube-system/gpumem"),
    ] {
        let expr = format!("gpumem_container_cap_bytes{{job={job:?}}}");
        let series = prometheus
            .query_until(&expr, started, |s| !s.is_empty())
            .await;
        assert_eq!(series.len(), 1, "{kind}: {expr}: {series:?}\n{}", logs());
        let s = &series[0];
        let label = |name: &str| s.get(name).map(String::as_str);
        assert_eq!(
            (label("namespace"), label("pod"), label("container")),
            (Some("default"), Some("nb"), Some("main")),
            "{kind}: the tenant's labels were replaced: {s:?}"
        );
        for renamed in ["exported_namespace", "exported_pod", "exported_container"] {
            assert_eq!(label(renamed), None, "{kind}: {s:?}");
        }
        // Where the series has none, the target's labels still say where
        // it was scraped.
        assert_eq!(
            (label("node"), label("endpoint")),
            (Some(NODE), Some("metrics")),
            "{kind}: {s:?}"
        );
        let up = query(prometheus.port, &format!("up{{job={job:?}}}")).await;
        assert_eq!(up.len(), 1, "{kind}: {up:?}");
        assert_eq!(
            (
                up[0]["namespace"].as_str(),
                up[0]["pod"].as_str(),
                up[0]["@value"].as_str()
            ),
            ("kube-system", "gpumem-x7k2p", "1"),
            "{kind}"
        );
    }
}

/// A scraper that takes only Prometheus' classic text format (0.0.4: many
/// agents and older scrapers) gets it, which promtool's text
/// parser reads; one that asks for OpenMetrics (Prometheus itself) gets
/// OpenMetrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_come_in_the_format_the_scraper_accepts() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = ChartPlugin::start(dir.path(), |cmd| {
        cmd.arg("--fake-gpus").arg(common::fixture("t4"))
    })
    .await;
    let port = plugin.metrics_port;
    plugin
        .kubelet
        .admit("nb", "main", RESOURCE, 4)
        .await
        .unwrap();

    let (content_type, text) = get_accepting(port, "/metrics", "text/plain;version=0.0.4").await;
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    assert!(!text.contains("# EOF"), "{text}");
    // Counters' and the build's metadata name their samples.
    assert!(
        text.contains("# TYPE gpumem_allocate_calls_total counter\n"),
        "{text}"
    );
    assert!(text.contains("# TYPE gpumem_build_info gauge\n"), "{text}");
    assert!(text.contains("gpumem_container_cap_bytes{"), "{text}");
    let mut check = Command::new(prometheus_tool("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        check
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let checked = check.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    // It parses (exit 1 and "error while linting" is a parse error); the
    // lint findings left (exit 3) are dcgm-exporter's label names, kept on
    // purpose: UUID, modelName, Hostname.
    let lint_only = said
        .lines()
        .all(|l| l.contains("label names should be written in 'snake_case'"));
    assert!(
        checked.status.success() || (checked.status.code() == Some(3) && lint_only),
        "promtool check metrics: {said}\n{text}"
    );

    // What Prometheus sends.
    let (content_type, text) = get_accepting(
        port,
        "/metrics",
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    )
    .await;
    assert!(
        content_type.starts_with("application/openmetrics-text; version=1.0.0"),
        "{content_type}"
    );
    assert!(text.ends_with("# EOF\n"), "{text}");
}

/// The value of the one sample of `name` in a scrape whose labels include
/// each of `labels`.
fn sample<'a>(scrape: &'a str, name: &str, labels: &[&str]) -> Option<&'a str> {
    scrape.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let rest = series.strip_prefix(name)?.strip_prefix('{')?;
        labels.iter().all(|l| rest.contains(l)).then_some(value)
    })
}

/// The same readings through NVML itself (the fake `libnvidia-ml.so.1`),
/// as a node without `--fake-gpus` reads them: the GPU's sensors, and the
/// per-process SM samples summed for the pod whose process holds memory.
/// No Prometheus needed.
#[tokio::test]
async fn nvml_readings_and_each_pods_sm_use_reach_the_metrics() {
    let kit = shim_kit();
    let dir = tempfile::tempdir().unwrap();
    // The fake driver's view of the node, shared by the plugin's NVML and
    // the pod's CUDA.
    let node = dir.path().join("fake-node");
    let plugin = ChartPlugin::start(dir.path(), |cmd| {
        cmd.env("LD_LIBRARY_PATH", &kit.driver_dir)
            .env("FAKEGPU_NODE_FILE", &node)
            .env("FAKEGPU_UTILIZATION_PERCENT", "87")
            .env("FAKEGPU_TEMPERATURE_C", "64")
            .env("FAKEGPU_POWER_MW", "70500")
            .env("FAKEGPU_PROCESS_SM_PERCENT", "40")
    })
    .await;
    let (kubelet, metrics_port) = (&plugin.kubelet, plugin.metrics_port);
    let allocation = kubelet.admit("nb", "main", RESOURCE, 4).await.unwrap();
    let container = PathBuf::from(&allocation.response.mounts[2].host_path);
    let mut holder = Killed(
        kit.probe(Some(&container))
            .env("FAKEGPU_NODE_FILE", &node)
            .args(["alloc:1000", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    common::wait_for_line(&mut holder, "holding");

    let gpu = format!("UUID=\"{T4}\"");
    let host_label = format!("Hostname=\"{NODE}\"");
    let pod = "pod=\"nb\"";
    let expected: [(&str, &[&str], &str); 5] = [
        ("gpumem_gpu_utilization_ratio", &[&gpu, &host_label], "0.87"),
        ("gpumem_gpu_temperature_celsius", &[&gpu, &host_label], "64"),
        ("gpumem_gpu_power_watts", &[&gpu, &host_label], "70.5"),
        // The pod's process: NVML lists it, reconciliation attributes it.
        ("gpumem_container_sm_utilization_ratio", &[pod, &gpu], "0.4"),
        ("gpumem_container_used_bytes", &[pod, &gpu], "1363148800"),
    ];
    eventually(
        "every sample",
        WAIT,
        Duration::from_millis(100),
        async || {
            let scrape = get(metrics_port, "/metrics")
                .await
                .map(|(_, body)| body)
                .unwrap_or_default();
            let missing: Vec<_> = expected
                .iter()
                .filter(|(name, labels, value)| sample(&scrape, name, labels) != Some(*value))
                .collect();
            if !missing.is_empty() {
                return Err(format!("{missing:?} not in:\n{scrape}\n{}", plugin.log()));
            }
            // NVML's used memory counts the pod's process too.
            let used = sample(&scrape, "gpumem_gpu_memory_used_bytes", &[&gpu]);
            let used: u64 = used.and_then(|v| v.parse().ok()).unwrap_or(0);
            assert!(used >= 1300 << 20, "{scrape}");
            Ok(())
        },
    )
    .await;
}

/// arena's query of a node's GPUs (kubeflow/arena pkg/prometheus,
/// `NODE_METRIC_TMP`), and of pods' (`POD_METRIC_TMP`).
const ARENA_SERIES: &str =
    "nvidia_gpu_duty_cycle|nvidia_gpu_memory_used_bytes|nvidia_gpu_memory_total_bytes";

/// With `--arena-metrics`, what `arena top node` and `arena top job` ask
/// Prometheus for answers with the node's GPU and the pod on it: the GPU's
/// memory and duty cycle on every series of it, and the pod's memory in
/// use, marked `share` (arena sums those per GPU).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arenas_queries_find_each_gpus_and_pods_memory() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = dir.path().join("node.toml");
    common::rewrite_fake_gpus(
        &gpus,
        std::fs::read_to_string(common::fixture("t4")).unwrap(),
    );
    let plugin = ChartPlugin::start(dir.path(), |cmd| {
        cmd.arg("--fake-gpus").arg(&gpus).arg("--arena-metrics")
    })
    .await;
    let allocation = plugin
        .kubelet
        .admit("nb", "main", RESOURCE, 4)
        .await
        .unwrap();
    let container = PathBuf::from(&allocation.response.mounts[2].host_path);
    let mut holder = Killed(
        shim_kit()
            .probe(Some(&container))
            .args(["alloc:1000", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    common::wait_for_line(&mut holder, "holding");
    common::rewrite_fake_gpus(&gpus, node_file(holder.id()));
    let prometheus = Prometheus::start(dir.path(), &static_scrape(plugin.metrics_port));

    // The pod's memory, once reconciled (1300 MiB by NVML) and scraped.
    let by_node = format!(r#"{{__name__=~"{ARENA_SERIES}", node_name=~"{NODE}"}}"#);
    let series = prometheus
        .query_until(&by_node, Instant::now(), |series| {
            series.iter().any(|s| {
                s["__name__"] == "nvidia_gpu_memory_used_bytes"
                    && s.get("pod_name").map(String::as_str) == Some("nb")
                    && s["@value"] == "1363148800"
            })
        })
        .await;
    let logs = || both_logs(&plugin, &prometheus);
    let of = |name: &str| -> Vec<&BTreeMap<String, String>> {
        series.iter().filter(|s| s["__name__"] == name).collect()
    };
    for s in &series {
        assert_eq!(
            (s["uuid"].as_str(), s["minor_number"].as_str()),
            (T4, "0"),
            "{s:?}"
        );
    }
    // The GPU's series and the pod's, each with the GPU's total and duty
    // cycle (arena keeps the last it reads).
    for (name, value) in [
        ("nvidia_gpu_memory_total_bytes", "15811477504"),
        ("nvidia_gpu_duty_cycle", "87"),
    ] {
        let found = of(name);
        assert_eq!(found.len(), 2, "{name}: {series:?}\n{}", logs());
        assert!(
            found.iter().all(|s| s["@value"] == value),
            "{name}: {found:?}"
        );
        assert!(
            found.iter().any(|s| s.get("pod_name").is_none()),
            "{name}: the GPU's own series: {found:?}"
        );
    }
    // Used: the pod's, marked share (what arena sums for the GPU), and the
    // GPU's own without a mode (what arena shows where no pod is marked).
    let used = of("nvidia_gpu_memory_used_bytes");
    let shared: Vec<_> = used
        .iter()
        .filter(|s| s.get("allocate_mode").map(String::as_str) == Some("share"))
        .collect();
    assert_eq!(shared.len(), 1, "{used:?}\n{}", logs());
    assert_eq!(
        (
            shared[0]["namespace_name"].as_str(),
            shared[0]["pod_name"].as_str(),
            shared[0]["@value"].as_str()
        ),
        ("default", "nb", "1363148800")
    );
    assert_eq!(used.len(), 2, "{used:?}");

    // `arena top job`: the pod's three series.
    let by_pod = format!(r#"{{__name__=~"{ARENA_SERIES}", pod_name=~"nb"}}"#);
    let pod = query(prometheus.port, &by_pod).await;
    let mut names: Vec<&str> = pod.iter().map(|s| s["__name__"].as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "nvidia_gpu_duty_cycle",
            "nvidia_gpu_memory_total_bytes",
            "nvidia_gpu_memory_used_bytes"
        ],
        "{pod:?}"
    );
}

/// The `Hostname` label comes from gpumem's own setting, as the chart sets
/// it, never from a `NODE_NAME` the pod's environment has for something
/// else.
#[tokio::test]
async fn the_hostname_label_is_gpumems_setting_not_the_pods_node_name() {
    let dir = tempfile::tempdir().unwrap();
    let gpus = dir.path().join("node.toml");
    common::rewrite_fake_gpus(
        &gpus,
        std::fs::read_to_string(common::fixture("t4")).unwrap(),
    );
    let plugin = ChartPlugin::start(dir.path(), |cmd| {
        cmd.arg("--fake-gpus")
            .arg(&gpus)
            .env("NODE_NAME", "not-this-node")
    })
    .await;
    let scrape = eventually("the metrics", WAIT, POLL, async || {
        match get(plugin.metrics_port, "/metrics").await {
            Some((200, body)) if body.contains("gpumem_gpu_units{") => Ok(body),
            _ => Err(format!("no metrics:\n{}", plugin.log())),
        }
    })
    .await;
    let units = sample(
        &scrape,
        "gpumem_gpu_units",
        &[&format!("Hostname=\"{NODE}\"")],
    );
    assert_eq!(units, Some("14"), "{scrape}");
    assert!(!scrape.contains("not-this-node"), "{scrape}");
}
