//! The monitoring the chart ships, against a real Prometheus: Debian's
//! `prometheus` scrapes a running `gpumem plugin` on a fake node with pods and
//! load, and every query of the Grafana dashboard returns the series it
//! should; `promtool test rules` proves each alert fires and clears.
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

use common::{shim_kit, Killed, RESOURCE, WAIT};
use gpumem_testkit::simulator::KubeletSim;
use serde_json::Value;

const T4: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";
/// What the plugin calls its node (`Hostname` on every GPU's series).
const NODE: &str = "gpu-node-1";
/// A pod gpumem did not place, whose process reached the GPU anyway.
const STRANGER_POD: &str = "0a1b2c3d-4e5f-4678-9abc-def012345678";
/// Prometheus starts, reads its first scrapes and answers within this.
const PROMETHEUS_WAIT: Duration = Duration::from_secs(60);

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// `name` from PATH, or a failure that says how to install it.
fn prometheus_tool(name: &str) -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "{name} is not installed, and the monitoring tests need a real Prometheus: on \
             Debian or Ubuntu run `apt-get update && apt-get install -y prometheus` (it gives \
             /usr/bin/prometheus and /usr/bin/promtool; stop the service it may start with \
             `systemctl disable --now prometheus`), elsewhere put the binaries of a Prometheus \
             release (2.x or later) on PATH"
        )
    })
}

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
            .env("NODE_NAME", NODE)
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

/// A port nothing listens on now.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// GET over HTTP/1.0 (no chunked answer to decode): the status and body,
/// or `None` while nothing listens.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await.ok()?;
    let code = response.get(9..12)?.parse().ok()?;
    let (_, body) = response.split_once("\r\n\r\n")?;
    Some((code, body.to_owned()))
}

/// Percent-encodes a query parameter.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The series Prometheus answers `query` with, now.
async fn query(port: u16, query: &str) -> Vec<BTreeMap<String, String>> {
    let path = format!("/api/v1/query?query={}", encode(query));
    let Some((200, body)) = get(port, &path).await else {
        return Vec::new();
    };
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["status"], "success", "{query}: {body}");
    answer["data"]["result"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|series| {
            let mut labels: BTreeMap<String, String> =
                serde_json::from_value(series["metric"].clone()).unwrap();
            labels.insert("@value".into(), series["value"][1].as_str().unwrap().into());
            labels
        })
        .collect()
}

/// Each query of the dashboard with its panel's title and legend, the
/// template variables as "All" selects them (`.*`) and Grafana's interval
/// as a minute.
fn dashboard_queries() -> Vec<(String, String, String)> {
    let path = repo("deploy/helm/gpumem/monitoring/gpumem-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            let expr = expr
                .replace("$__rate_interval", "1m")
                .replace("$node", ".*")
                .replace("$namespace", ".*");
            assert!(
                !expr.contains('$'),
                "a variable this test does not set: {expr}"
            );
            queries.push((
                panel["title"].as_str().unwrap().to_owned(),
                expr,
                target["legendFormat"].as_str().unwrap_or("").to_owned(),
            ));
        }
    }
    assert!(queries.len() > 10, "{queries:?}");
    queries
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
    let prometheus = prometheus_tool("prometheus");
    let queries = dashboard_queries();
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

    // Prometheus, in a directory of its own on a port of its own, scraping
    // the plugin every second with the chart's rules loaded.
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules:?}\n\
             scrape_configs:\n  - job_name: gpumem\n    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n",
            rules = repo("deploy/helm/gpumem/monitoring/gpumem.rules.yaml")
        ),
    )
    .unwrap();
    let prometheus_port = free_port();
    let prometheus_log = dir.path().join("prometheus.log");
    let _prometheus = Killed(
        Command::new(prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prometheus_port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&prometheus_log).unwrap())
            .spawn()
            .unwrap(),
    );
    let logs = || {
        format!(
            "plugin:\n{}\nprometheus:\n{}",
            plugin.log(),
            std::fs::read_to_string(&prometheus_log).unwrap_or_default()
        )
    };

    // Each query, until it answers with what it should (the pod's processes
    // are attributed at the plugin's next reconciliation, and a rate needs
    // two scrapes).
    let started = Instant::now();
    for (panel, expr, legend) in &queries {
        let series = loop {
            let series = query(prometheus_port, expr).await;
            if answers(&series, legend).is_ok() || started.elapsed() > PROMETHEUS_WAIT {
                break series;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        if let Err(why) = answers(&series, legend) {
            panic!("panel {panel:?}: {expr}: {why}: {series:?}\n{}", logs());
        }
    }

    // And the values are the node's: the pod's memory next to its GPU's
    // utilisation, temperature and power, its SMs, and the stranger.
    for (expr, expected) in [
        ("gpumem_container_used_bytes", "1363148800"),
        ("gpumem_container_sm_utilization_ratio", "0.4"),
        ("gpumem_gpu_utilization_ratio * on (UUID, Hostname) group_right () (gpumem_container_cap_bytes > bool 0)", "0.87"),
        ("gpumem_gpu_temperature_celsius * on (UUID, Hostname) group_right () (gpumem_container_cap_bytes > bool 0)", "64"),
        ("gpumem_gpu_power_watts * on (UUID, Hostname) group_right () (gpumem_container_cap_bytes > bool 0)", "70"),
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
    // The rules load and evaluate: the stranger's memory is pending.
    let pending = query(
        prometheus_port,
        "ALERTS{alertname=\"GpumemUnmanagedGpuMemory\"}",
    )
    .await;
    assert_eq!(pending.len(), 1, "{pending:?}\n{}", logs());
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
    let deadline = Instant::now() + WAIT;
    loop {
        let scrape = get(metrics_port, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default();
        let missing: Vec<_> = expected
            .iter()
            .filter(|(name, labels, value)| sample(&scrape, name, labels) != Some(*value))
            .collect();
        if missing.is_empty() {
            // NVML's used memory counts the pod's process too.
            let used = sample(&scrape, "gpumem_gpu_memory_used_bytes", &[&gpu]);
            let used: u64 = used.and_then(|v| v.parse().ok()).unwrap_or(0);
            assert!(used >= 1300 << 20, "{scrape}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{missing:?} not in:\n{scrape}\n{}",
            plugin.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether `series` is what a panel with legend `legend` should show: at
/// least one series, each with every label the legend names set, and the
/// pod's series its pod's.
fn answers(series: &[BTreeMap<String, String>], legend: &str) -> Result<(), String> {
    if series.is_empty() {
        return Err("no series".into());
    }
    let named: Vec<&str> = legend
        .split("{{")
        .skip(1)
        .filter_map(|part| part.split_once("}}").map(|(name, _)| name.trim()))
        .collect();
    for s in series {
        for label in &named {
            if s.get(*label).is_none_or(String::is_empty) {
                return Err(format!("a series without {label}"));
            }
        }
        if named.contains(&"pod") && s["pod"] != "nb" {
            return Err(format!("pod {:?}, not nb", s["pod"]));
        }
        if named.contains(&"Hostname") && s["Hostname"] != NODE {
            return Err(format!("Hostname {:?}, not {NODE}", s["Hostname"]));
        }
    }
    Ok(())
}
