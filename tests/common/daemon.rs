//! The whole daemon in-process (plugin, health, endpoint, clean-up,
//! reconciliation) against the simulated kubelet, and ways to start it.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use super::wait::{eventually, POLL};
use super::{fixture, shim_kit, RESOURCE, WAIT};
use gpumem::deviceplugin::plugin::PluginConfig;
use gpumem::isolation::enforce::OverCapAction;
use gpumem::isolation::inject::{Isolation, ShimConfig};
use gpumem::isolation::statefs::StateFs;
use gpumem::node::fake::FakeGpus;
use gpumem::node::fake::FakeHealth;
use gpumem::node::fake::{FakeProcesses, FakeSensors};
use gpumem::node::inventory::Inventory;
use gpumem::node::placement::Policy;
use gpumem::node::units::MemoryUnit;
use gpumem::ops::daemon::{self, Common, DaemonConfig};
use gpumem::ops::status::NodeStatus;
use gpumem_testkit::fake_apiserver::FakeApiServer;
use gpumem_testkit::simulator::KubeletSim;
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How often the test daemon reconciles untracked usage.
pub const RECONCILE: Duration = Duration::from_millis(100);
/// What the daemons call their node in metrics.
pub const HOSTNAME: &str = "test-node";

/// The whole daemon (plugin, health, endpoint, clean-up) against the
/// simulated kubelet, on a copy of a fixture that tests may edit.
pub struct Daemon {
    pub dir: TempDir,
    pub node_file: PathBuf,
    pub kubelet: Option<KubeletSim>,
    pub addr: std::net::SocketAddr,
    /// Where the daemon serves `/status`.
    pub status_socket: PathBuf,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<Result<(), daemon::DaemonError>>,
    /// The API server, for daemons started with one.
    pub api: Option<FakeApiServer>,
}

/// The node the daemons with an API server run on.
pub const NODE: &str = "gpu-node-1";
/// The UID of the pod `in_container` puts processes in.
pub const POD_UID: &str = "0a1b2c3d-4e5f-4678-9abc-def012345678";

impl Daemon {
    pub async fn start(fixture_name: &str, isolation: Isolation, grace: Duration) -> Daemon {
        Daemon::start_with(fixture_name, isolation, grace, true).await
    }

    /// With `pod_resources` false, the daemon is pointed at a pod-resources
    /// socket nobody serves.
    pub async fn start_with(
        fixture_name: &str,
        isolation: Isolation,
        grace: Duration,
        pod_resources: bool,
    ) -> Daemon {
        Daemon::start_full(fixture_name, isolation, grace, pod_resources, None, false).await
    }

    /// With `api`, the daemon talks to a fake API server that holds the
    /// simulated kubelet's pod `nb` (UID `POD_UID`).
    pub async fn start_full(
        fixture_name: &str,
        isolation: Isolation,
        grace: Duration,
        pod_resources: bool,
        over_cap: Option<(OverCapAction, Duration)>,
        api: bool,
    ) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let (api, cluster) = if api {
            let server = FakeApiServer::start().await.unwrap();
            let kubeconfig = dir.path().join("kubeconfig");
            server.write_kubeconfig(&kubeconfig).unwrap();
            server.put(serde_json::json!({"kind": "Node", "metadata": {"name": NODE}}));
            server.put(serde_json::json!({
                "kind": "Pod",
                "metadata": {"name": "nb", "namespace": "default", "uid": POD_UID},
                "spec": {"nodeName": NODE, "containers": [{"name": "main"}]},
                "status": {"phase": "Running"},
            }));
            let (client, api) = gpumem::cluster::client::connect_watched(Some(&kubeconfig))
                .await
                .unwrap();
            let cluster = daemon::Cluster {
                client,
                api,
                node: NODE.to_owned(),
                gpushare_extender: false,
                startup_taint: None,
            };
            (Some(server), Some(cluster))
        } else {
            (None, None)
        };
        let node_file = dir.path().join("node.toml");
        std::fs::copy(fixture(fixture_name), &node_file).unwrap();
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let status_socket = dir.path().join("status.sock");
        let pod_resources_socket = if pod_resources {
            kubelet.pod_resources_socket()
        } else {
            dir.path().join("no-pod-resources.sock")
        };
        let (shutdown, task) = spawn_daemon(
            dir.path(),
            &node_file,
            isolation,
            MemoryUnit::GiB,
            |config| {
                config.pod_resources_socket = pod_resources_socket;
                config.common.metrics = Some(listener);
                config.common.status_socket = Some(status_socket.clone());
                config.common.state_grace = grace;
                config.common.over_cap = over_cap;
                config.cluster = cluster;
            },
        );
        kubelet
            .wait_for_devices(RESOURCE, 1, WAIT)
            .await
            .expect("registered");
        Daemon {
            dir,
            node_file,
            kubelet: Some(kubelet),
            addr,
            status_socket,
            shutdown,
            task,
            api,
        }
    }

    /// On a T4 with the shim installed in a fresh host directory and state
    /// directory, which live as long as the returned guards.
    pub async fn with_shim(grace: Duration) -> (Daemon, TempDir, TempDir) {
        let host = super::installed_shim();
        let state = tempfile::tempdir().unwrap();
        let d = Daemon::start("t4", shim(host.path(), state.path()), grace).await;
        (d, host, state)
    }

    pub fn k(&self) -> &KubeletSim {
        self.kubelet.as_ref().expect("kubelet running")
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        get(self.addr, path).await
    }

    /// Waits until the over-cap action has checked samples taken over more
    /// than `span` from now (see [`wait_for_checks`]).
    pub async fn checked_for(&self, span: Duration) {
        wait_for_checks(self.addr, samples_over(span)).await;
    }

    /// Who holds what, from the status socket, as `gpumem inspect` reads it.
    pub async fn status(&self) -> NodeStatus {
        gpumem::ops::inspect::fetch(&self.status_socket)
            .await
            .unwrap()
    }

    pub fn set_healthy(&self, healthy: bool) {
        let text = std::fs::read_to_string(&self.node_file).unwrap();
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with("healthy"))
            .map(str::to_owned)
            .collect();
        lines.push(format!("healthy = {healthy}"));
        self.rewrite_node_file(lines.join("\n") + "\n");
    }

    /// Makes the fake NVML list `pid` with `used_mib` on the (last) GPU,
    /// and each `(name, text)` of `proc_files` stand for its
    /// `/proc/<pid>/<name>` (`cgroup`, `mountinfo`).
    pub fn list_process(&self, pid: u32, used_mib: u64, proc_files: &[(&str, &str)]) {
        super::list_fake_process(&self.node_file, pid, used_mib, proc_files);
    }

    /// Makes the fake NVML stop listing `pid`, as NVML does once it exits.
    pub fn drop_process(&self, pid: u32) {
        let text = std::fs::read_to_string(&self.node_file).unwrap();
        let kept: Vec<&str> = text
            .split("\n[[gpu.process]]\n")
            .filter(|block| !block.starts_with(&format!("pid = {pid}\n")))
            .collect();
        self.rewrite_node_file(kept.join("\n[[gpu.process]]\n"));
    }

    /// Makes the fake NVML list `pid` at `used_mib` in place of what it
    /// listed for it, in one rewrite: no sample sees it gone in between.
    pub fn relist_process(&self, pid: u32, used_mib: u64, proc_files: &[(&str, &str)]) {
        let text = std::fs::read_to_string(&self.node_file).unwrap();
        let mut text = text
            .split("\n[[gpu.process]]\n")
            .filter(|block| !block.starts_with(&format!("pid = {pid}\n")))
            .collect::<Vec<_>>()
            .join("\n[[gpu.process]]\n");
        text += &format!("\n[[gpu.process]]\npid = {pid}\nused_mib = {used_mib}\n");
        for (name, file) in proc_files {
            text += &format!("{name} = {file:?}\n");
        }
        self.rewrite_node_file(text);
    }

    pub fn rewrite_node_file(&self, text: String) {
        super::rewrite_fake_gpus(&self.node_file, text);
    }

    /// Waits until `/metrics` has `line`; returns the page.
    pub async fn wait_for_metric(&self, line: &str) -> String {
        eventually("the metric line", WAIT, POLL, async || {
            let (_, metrics) = self.get("/metrics").await;
            if metrics.contains(line) {
                Ok(metrics)
            } else {
                Err(format!("no {line}:\n{metrics}"))
            }
        })
        .await
    }

    /// Waits until the one container's status passes `check`.
    pub async fn wait_for_container(
        &self,
        what: &str,
        check: impl Fn(&gpumem::ops::status::ContainerStatus) -> bool,
    ) -> gpumem::ops::status::ContainerStatus {
        eventually("the container", WAIT, RECONCILE, async || {
            let status = self.status().await;
            match status.containers.iter().find(|c| check(c)) {
                Some(c) => Ok(c.clone()),
                None => Err(format!("{what}: {:?}", status.containers)),
            }
        })
        .await
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Some(kubelet) = self.kubelet {
            kubelet.stop().await;
        }
    }
}

pub fn shim(host: &Path, state: &Path) -> Isolation {
    Isolation::Shim(ShimConfig {
        host_dir: host.to_owned(),
        state_dir: state.to_owned(),
        context_charge_mib: 0,
        state_fs: StateFs::Shared,
    })
}

/// A daemon with shim isolation and one admitted pod.
pub struct Admitted {
    pub d: Daemon,
    /// The pod's accounting directory.
    pub dir: PathBuf,
    /// The pod's UID, as kubelet's checkpoint records it.
    pub pod_uid: String,
    pub _host: TempDir,
    pub state: TempDir,
}

impl Admitted {
    pub async fn start(over_cap: Option<(OverCapAction, Duration)>) -> Admitted {
        let host = super::installed_shim();
        let state = tempfile::tempdir().unwrap();
        let d = Daemon::start_full(
            "t4",
            shim(host.path(), state.path()),
            Duration::from_secs(300),
            true,
            over_cap,
            over_cap.is_some(),
        )
        .await;
        let allocation = d.k().admit("nb", "main", RESOURCE, 4).await.unwrap();
        let dir = PathBuf::from(&allocation.response.mounts[2].host_path);
        Admitted {
            d,
            dir,
            pod_uid: allocation.pod_uid(),
            _host: host,
            state,
        }
    }
}

/// `Admitted`, with a process in the pod that holds 1000 MiB under the shim
/// (1300 MiB charged with its context).
pub struct Holding {
    pub d: Daemon,
    pub dir: PathBuf,
    pub holder: super::Killed,
    pub _host: TempDir,
    pub state: TempDir,
}

impl Holding {
    pub async fn start(over_cap: Option<(OverCapAction, Duration)>) -> Holding {
        let Admitted {
            d,
            dir,
            _host,
            state,
            ..
        } = Admitted::start(over_cap).await;
        let mut holder = shim_kit()
            .probe(Some(&dir))
            .args(["alloc:1000", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        super::wait_for_line(&mut holder, "holding");
        d.wait_for_container("charged", |c| c.used_mib == Some(1300))
            .await;
        Holding {
            d,
            dir,
            holder: super::Killed(holder),
            _host,
            state,
        }
    }

    pub async fn stop(mut self) {
        self.holder.kill().unwrap();
        self.holder.wait().unwrap();
        self.d.stop().await;
    }
}

/// What the real `gpumem` prints with `args`, which must succeed.
pub fn gpumem_stdout(args: &[impl AsRef<std::ffi::OsStr>]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(args)
        .env_remove("GPUMEM_STATUS_SOCKET")
        .env_remove("GPUMEM_STATE_DIR")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The daemon as these tests run it, in `dir` (kubelet's directory) with
/// the GPUs of `node_file` counted in `unit`, reconciling every
/// `RECONCILE`; `configure` sets what a test needs beyond that (no
/// pod-resources, metrics, over-cap action or API server by default).
pub fn spawn_daemon(
    dir: &Path,
    node_file: &Path,
    isolation: Isolation,
    unit: MemoryUnit,
    configure: impl FnOnce(&mut DaemonConfig),
) -> (
    CancellationToken,
    JoinHandle<Result<(), daemon::DaemonError>>,
) {
    let gpus = FakeGpus::from_file(node_file).unwrap().gpus();
    let mut config = DaemonConfig {
        plugin: PluginConfig {
            kubelet_dir: dir.to_owned(),
            resource_name: Default::default(),
            policy: Policy::Binpack,
            isolation,
            device_list: Default::default(),
        },
        pod_resources_socket: dir.join("no-pod-resources.sock"),
        common: Common {
            reconcile: Some((Box::new(FakeProcesses::new(node_file)), RECONCILE)),
            sensors: Some(Arc::new(FakeSensors::new(node_file))),
            ..Common::quiet(dir.join("state"), HOSTNAME)
        },
        cluster: None,
    };
    configure(&mut config);
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(daemon::run(
        config,
        Inventory::new(gpus, unit).unwrap(),
        Some(Box::new(FakeHealth::new(node_file))),
        shutdown.clone(),
    ));
    (shutdown, task)
}

/// `GET path` from a daemon's HTTP endpoint at `addr`: the status code and
/// the body.
pub async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: gpumem\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let code = response[9..12].parse().unwrap();
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (code, body)
}

/// How many samples, [`RECONCILE`] apart, it takes to span more than
/// `span`.
pub fn samples_over(span: Duration) -> u64 {
    (span.as_millis() / RECONCILE.as_millis()) as u64 + 2
}

/// Samples the over-cap action of the daemon at `addr` has checked so far.
pub async fn over_cap_checks(addr: std::net::SocketAddr) -> u64 {
    let (_, metrics) = get(addr, "/metrics").await;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("gpumem_over_cap_checks_total "))
        .unwrap_or_else(|| panic!("no over-cap checks (action off?):\n{metrics}"))
        .parse()
        .unwrap()
}

/// Waits until the over-cap action of the daemon at `addr` has checked
/// `samples` samples taken from now on: whatever they showed has been
/// acted on or let be. The check under way now, if any, is of a sample
/// taken before, so it is waited for and not counted; with `samples` 0,
/// only it is waited for (or, with none under way, the next).
pub async fn wait_for_checks(addr: std::net::SocketAddr, samples: u64) {
    let target = over_cap_checks(addr).await + 1 + samples;
    eventually("the over-cap checks", WAIT, POLL, async || {
        let checks = over_cap_checks(addr).await;
        if checks >= target {
            Ok(())
        } else {
            Err(format!("{checks} over-cap checks, waited for {target}"))
        }
    })
    .await
}
