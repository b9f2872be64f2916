//! Node operations: health reaching kubelet, who holds what through the
//! pod-resources API, the HTTP endpoint, `gpumem inspect`, clean-up, logs.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::{fixture, shim_kit, RESOURCE, WAIT};
use gpumem::deviceplugin::plugin::PluginConfig;
use gpumem::isolation::enforce::OverCapAction;
use gpumem::isolation::inject::{Isolation, ShimConfig};
use gpumem::isolation::statefs::{Bounding, StateFs};
use gpumem::node::gpu::{FakeGpus, GpuSource};
use gpumem::node::health::FakeHealth;
use gpumem::node::inventory::Inventory;
use gpumem::node::placement::Policy;
use gpumem::node::processes::FakeProcesses;
use gpumem::node::sensors::Sensors;
use gpumem::node::units::MemoryUnit;
use gpumem::ops::daemon::{self, Common, DaemonConfig};
use gpumem::ops::status::NodeStatus;
use gpumem_testkit::fake_apiserver::{FakeApiServer, Kind};
use gpumem_testkit::simulator::KubeletSim;
use tempfile::TempDir;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How often the test daemon reconciles untracked usage.
const RECONCILE: Duration = Duration::from_millis(100);
/// What the daemons call their node in metrics.
const HOSTNAME: &str = "test-node";

/// The whole daemon (plugin, health, endpoint, clean-up) against the
/// simulated kubelet, on a copy of a fixture that tests may edit.
struct Daemon {
    dir: TempDir,
    node_file: PathBuf,
    kubelet: Option<KubeletSim>,
    addr: std::net::SocketAddr,
    /// Where the daemon serves `/status`.
    status_socket: PathBuf,
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), daemon::DaemonError>>,
    /// The API server, for daemons started with one.
    api: Option<FakeApiServer>,
}

/// The node the daemons with an API server run on.
const NODE: &str = "gpu-node-1";
/// The UID of the pod `in_container` puts processes in.
const POD_UID: &str = "0a1b2c3d-4e5f-4678-9abc-def012345678";

impl Daemon {
    async fn start(fixture_name: &str, isolation: Isolation, grace: Duration) -> Daemon {
        Daemon::start_with(fixture_name, isolation, grace, true).await
    }

    /// With `pod_resources` false, the daemon is pointed at a pod-resources
    /// socket nobody serves.
    async fn start_with(
        fixture_name: &str,
        isolation: Isolation,
        grace: Duration,
        pod_resources: bool,
    ) -> Daemon {
        Daemon::start_full(fixture_name, isolation, grace, pod_resources, None, false).await
    }

    /// With `api`, the daemon talks to a fake API server that holds the
    /// simulated kubelet's pod `nb` (UID `POD_UID`).
    async fn start_full(
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
    async fn with_shim(grace: Duration) -> (Daemon, TempDir, TempDir) {
        let host = common::installed_shim();
        let state = tempfile::tempdir().unwrap();
        let d = Daemon::start("t4", shim(host.path(), state.path()), grace).await;
        (d, host, state)
    }

    fn k(&self) -> &KubeletSim {
        self.kubelet.as_ref().expect("kubelet running")
    }

    async fn get(&self, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(self.addr).await.unwrap();
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

    /// Who holds what, from the status socket, as `gpumem inspect` reads it.
    async fn status(&self) -> NodeStatus {
        gpumem::ops::inspect::fetch(&self.status_socket)
            .await
            .unwrap()
    }

    fn set_healthy(&self, healthy: bool) {
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
    fn list_process(&self, pid: u32, used_mib: u64, proc_files: &[(&str, &str)]) {
        common::list_fake_process(&self.node_file, pid, used_mib, proc_files);
    }

    /// Makes the fake NVML stop listing `pid`, as NVML does once it exits.
    fn drop_process(&self, pid: u32) {
        let text = std::fs::read_to_string(&self.node_file).unwrap();
        let kept: Vec<&str> = text
            .split("\n[[gpu.process]]\n")
            .filter(|block| !block.starts_with(&format!("pid = {pid}\n")))
            .collect();
        self.rewrite_node_file(kept.join("\n[[gpu.process]]\n"));
    }

    /// Makes the fake NVML list `pid` at `used_mib` in place of what it
    /// listed for it, in one rewrite: no sample sees it gone in between.
    fn relist_process(&self, pid: u32, used_mib: u64, proc_files: &[(&str, &str)]) {
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

    fn rewrite_node_file(&self, text: String) {
        common::rewrite_fake_gpus(&self.node_file, text);
    }

    /// Waits until `/metrics` has `line`; returns the page.
    async fn wait_for_metric(&self, line: &str) -> String {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let (_, metrics) = self.get("/metrics").await;
            if metrics.contains(line) {
                return metrics;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {line}:\n{metrics}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the one container's status passes `check`.
    async fn wait_for_container(
        &self,
        what: &str,
        check: impl Fn(&gpumem::ops::status::ContainerStatus) -> bool,
    ) -> gpumem::ops::status::ContainerStatus {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let status = self.status().await;
            if let Some(c) = status.containers.iter().find(|c| check(c)) {
                return c.clone();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: {:?}",
                status.containers
            );
            tokio::time::sleep(RECONCILE).await;
        }
    }

    async fn stop(self) {
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

fn shim(host: &Path, state: &Path) -> Isolation {
    Isolation::Shim(ShimConfig {
        host_dir: host.to_owned(),
        state_dir: state.to_owned(),
        context_charge_mib: 0,
        state_fs: StateFs::Shared,
    })
}

#[tokio::test]
async fn an_unhealthy_gpu_stops_receiving_pods_and_recovers() {
    let d = Daemon::start("t4", Isolation::None, Duration::from_secs(300)).await;
    d.set_healthy(false);
    let started = tokio::time::Instant::now();
    let devices = d
        .k()
        .wait_for_list(RESOURCE, WAIT, |l| {
            l.iter().all(|dev| dev.health == "Unhealthy")
        })
        .await
        .expect("units marked Unhealthy");
    // Not a timing assertion, a sanity bound: the watcher ticks every 250 ms.
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(devices.len(), 14, "still advertised, as Unhealthy");
    assert!(d.k().admit("nb", "main", RESOURCE, 1).await.is_err());
    let (code, body) = d.get("/metrics").await;
    assert_eq!(code, 200);
    assert!(
        body.contains(
            "gpumem_gpu_healthy{gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 0"
        ),
        "{body}"
    );

    d.set_healthy(true);
    d.k()
        .wait_for_list(RESOURCE, WAIT, |l| {
            l.iter().all(|dev| dev.health == "Healthy")
        })
        .await
        .expect("healthy again");
    d.k().admit("nb", "main", RESOURCE, 1).await.unwrap();
    d.stop().await;
}

#[tokio::test]
async fn status_and_metrics_show_who_holds_what() {
    let host = common::installed_shim();
    let state = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        "v100x2",
        shim(host.path(), state.path()),
        Duration::from_secs(300),
    )
    .await;
    for pod in ["nb-1", "nb-2", "nb-3"] {
        d.k().admit(pod, "main", RESOURCE, 4).await.unwrap();
    }
    // One container's process really holds memory under the shim.
    let first = d.k().allocations()[0].response.mounts[2].host_path.clone();
    let mut holder = shim_kit()
        .probe(Some(Path::new(&first)))
        .env("FAKEGPU_UUIDS", "GPU-1a2b3c4d-0000-4000-8000-000000010000")
        .args(["alloc:1000", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut holder, "holding");

    let status = d.status().await;
    assert!(status.registered);
    assert_eq!(status.gpus[0].allocated_units, 12);
    assert_eq!(status.gpus[1].allocated_units, 0);
    assert_eq!(status.containers.len(), 3);
    let nb1 = &status.containers[0];
    assert_eq!(
        (nb1.pod.as_deref(), nb1.gpu, nb1.units, nb1.cap_mib),
        (Some("nb-1"), 0, 4, 4309)
    );
    // 1000 MiB and its 300 MiB context.
    assert_eq!(nb1.used_mib, Some(1300));
    assert_eq!(status.containers[1].used_mib, Some(0));

    let (code, body) = d.get("/healthz").await;
    assert_eq!((code, body.trim()), (200, "ok"));
    let (_, metrics) = d.get("/metrics").await;
    for expected in [
        "gpumem_gpu_allocated_units{gpu=\"0\",UUID=\"GPU-1a2b3c4d-0000-4000-8000-000000010000\",modelName=\"Tesla V100-SXM2-16GB\",Hostname=\"test-node\"} 12",
        "gpumem_gpu_units{gpu=\"1\",UUID=\"GPU-1a2b3c4d-0000-4000-8000-000000010001\",modelName=\"Tesla V100-SXM2-16GB\",Hostname=\"test-node\"} 15",
        "gpumem_container_cap_bytes{namespace=\"default\",pod=\"nb-1\",container=\"main\",gpu=\"0\",UUID=\"GPU-1a2b3c4d-0000-4000-8000-000000010000\",modelName=\"Tesla V100-SXM2-16GB\",Hostname=\"test-node\"} 4518313984",
        "gpumem_container_used_bytes{namespace=\"default\",pod=\"nb-1\",container=\"main\",gpu=\"0\",UUID=\"GPU-1a2b3c4d-0000-4000-8000-000000010000\",modelName=\"Tesla V100-SXM2-16GB\",Hostname=\"test-node\"} 1363148800",
        "gpumem_allocate_calls_total 3",
        "gpumem_allocate_errors_total 0",
        "gpumem_registrations_total 1",
        "gpumem_registered 1",
    ] {
        assert!(metrics.contains(expected), "missing {expected}:\n{metrics}");
    }
    holder.kill().unwrap();
    holder.wait().unwrap();
    d.stop().await;
}

#[tokio::test]
async fn healthz_fails_while_not_registered() {
    let mut d = Daemon::start("t4", Isolation::None, Duration::from_secs(300)).await;
    assert_eq!(d.get("/healthz").await.0, 200);
    // kubelet goes away (and kubelet.sock with it): we are no longer registered.
    d.kubelet.take().unwrap().stop().await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while d.get("/healthz").await.0 != 503 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "healthz kept passing"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, body) = d.get("/metrics").await;
    assert!(body.contains("gpumem_registered 0"), "{body}");
    // It comes back, we register again, the probe passes again.
    d.kubelet = Some(KubeletSim::start(d.dir.path()).unwrap());
    d.k()
        .wait_for_devices(RESOURCE, 1, WAIT)
        .await
        .expect("registered again");
    while d.get("/healthz").await.0 != 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "healthz did not recover"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    d.stop().await;
}

#[tokio::test]
async fn pod_resources_is_read_within_kubelets_rate_limit() {
    let d = Daemon::start("t4", Isolation::None, Duration::from_secs(300)).await;
    d.k().admit("nb", "main", RESOURCE, 4).await.unwrap();
    let calls: Vec<_> = (0..50).map(|_| d.status()).collect();
    for status in futures_util::future::join_all(calls).await {
        assert_eq!(status.containers.len(), 1);
    }
    let (answered, refused) = d.k().pod_resources_calls();
    assert_eq!(refused, 0, "never rate-limited");
    assert!(
        answered <= 3,
        "50 status requests cost {answered} pod-resources calls"
    );
    d.stop().await;
}

#[tokio::test]
async fn an_init_container_keeps_its_state_until_its_pod_ends() {
    let grace = Duration::from_millis(400);
    let (d, _host, _state) = Daemon::with_shim(grace).await;
    // Admitted, and waiting for its image far longer than the grace
    // period: pod-resources never lists it, kubelet's checkpoint does.
    let dir = admit_init_container(&d, "slow").await;
    tokio::time::sleep(grace * 5).await;
    assert!(
        dir.join("accounting").exists(),
        "an admitted init container lost its state before it started"
    );

    // Its pod ends, and nothing else is allocated on the node: its state
    // still goes after the grace period.
    d.k().remove_pod("slow");
    wait_until_removed(&dir, "an ended init container's state").await;
    d.stop().await;
}

#[tokio::test]
async fn a_kubelet_that_lists_ended_pods_still_lets_their_init_state_go() {
    let grace = Duration::from_millis(400);
    let (d, _host, _state) = Daemon::with_shim(grace).await;
    // Kubelets before 1.34 list an ended pod (a finished Job's, say), without
    // devices, until it is deleted: ending a pod whose GPU was only in its
    // init container changes nothing List shows.
    d.k().list_ended_pods();
    let dir = admit_init_container(&d, "job").await;
    tokio::time::sleep(grace * 3).await;
    assert!(dir.join("accounting").exists(), "removed while its pod ran");
    d.k().remove_pod("job");
    wait_until_removed(&dir, "an ended pod's init container state").await;
    d.stop().await;
}

/// Admits `pod`, whose only container with units is its init container
/// `fetch-model` (4 units); returns that container's accounting directory.
async fn admit_init_container(d: &Daemon, pod: &str) -> PathBuf {
    d.k().declare_init_container(pod, "fetch-model");
    let init = d.k().admit(pod, "fetch-model", RESOURCE, 4).await.unwrap();
    PathBuf::from(&init.response.mounts[2].host_path)
}

/// Waits up to [`WAIT`] for `dir` to be removed.
async fn wait_until_removed(dir: &Path, what: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while dir.exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} was never removed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn finished_containers_state_is_removed_after_the_grace_period_only() {
    let grace = Duration::from_millis(800);
    let (d, _host, _state) = Daemon::with_shim(grace).await;
    let dir_of =
        |a: &gpumem_testkit::simulator::Allocation| PathBuf::from(&a.response.mounts[2].host_path);
    let done = dir_of(&d.k().admit("done", "main", RESOURCE, 4).await.unwrap());
    let running = dir_of(&d.k().admit("running", "main", RESOURCE, 4).await.unwrap());
    let orphan = dir_of(&d.k().admit("orphan", "main", RESOURCE, 4).await.unwrap());
    // "orphan" is gone from kubelet but one of its processes still runs.
    let mut holder = shim_kit()
        .probe(Some(&orphan))
        .args(["alloc:100", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut holder, "holding");
    d.k().remove_pod("done");
    d.k().remove_pod("orphan");

    wait_until_removed(&done, "a finished container's state").await;
    // Several grace periods later, the others are still there.
    tokio::time::sleep(grace * 3).await;
    assert!(
        running.join("accounting").exists(),
        "a listed container's state was removed"
    );
    assert!(
        orphan.join("accounting").exists(),
        "state in use by a live process was removed"
    );

    holder.kill().unwrap();
    holder.wait().unwrap();
    wait_until_removed(&orphan, "the orphan's state").await;
    assert!(running.exists());
    d.stop().await;
}

/// A daemon with shim isolation and one admitted pod.
struct Admitted {
    d: Daemon,
    /// The pod's accounting directory.
    dir: PathBuf,
    /// The pod's UID, as kubelet's checkpoint records it.
    pod_uid: String,
    _host: TempDir,
    state: TempDir,
}

impl Admitted {
    async fn start(over_cap: Option<(OverCapAction, Duration)>) -> Admitted {
        let host = common::installed_shim();
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
struct Holding {
    d: Daemon,
    dir: PathBuf,
    holder: common::Killed,
    _host: TempDir,
    state: TempDir,
}

impl Holding {
    async fn start(over_cap: Option<(OverCapAction, Duration)>) -> Holding {
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
        common::wait_for_line(&mut holder, "holding");
        d.wait_for_container("charged", |c| c.used_mib == Some(1300))
            .await;
        Holding {
            d,
            dir,
            holder: common::Killed(holder),
            _host,
            state,
        }
    }

    async fn stop(mut self) {
        self.holder.kill().unwrap();
        self.holder.wait().unwrap();
        self.d.stop().await;
    }
}

#[tokio::test]
async fn memory_the_driver_holds_beyond_allocations_counts_against_the_cap() {
    let mut h = Holding::start(None).await;
    let (d, container, state) = (&h.d, &h.dir, h.state.path());
    let c = d
        .wait_for_container("charged", |c| c.used_mib == Some(1300))
        .await;
    assert_eq!(c.untracked_mib, Some(0));

    // A broken file beside it is skipped, not fatal.
    let junk = state.join("containers/junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("accounting"), b"not an accounting file").unwrap();

    // NVML shows the process at 1600 MiB: 300 MiB of libraries beside its
    // 1000 MiB allocation and 300 MiB context.
    d.list_process(h.holder.id(), 1600, &[]);
    let c = d
        .wait_for_container("untracked usage published", |c| {
            c.untracked_mib == Some(300)
        })
        .await;
    assert_eq!(c.used_mib, Some(1600));
    let (_, metrics) = d.get("/metrics").await;
    for expected in [
        "gpumem_container_untracked_bytes{namespace=\"default\",pod=\"nb\",container=\"main\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 314572800",
        // What processes hold beyond their charges: reconciliation's part.
        "gpumem_gpu_process_overhead_bytes{gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 314572800",
    ] {
        assert!(metrics.contains(expected), "missing {expected}:\n{metrics}");
    }

    // Another process of the container sees 4308 - 1600 MiB left, less its
    // own context, and the cap holds there, not 300 MiB later.
    let (ok, lines, stderr) = common::run_lines(shim_kit().probe(Some(container)).args([
        "info",
        "nvml",
        "alloc:2409",
        "alloc:2408",
    ]));
    assert!(ok, "{stderr}");
    assert_eq!(
        common::field(&lines[1], "free"),
        2408 * common::MIB,
        "{lines:?}"
    );
    assert_eq!(
        common::field(&lines[2], "used"),
        1900 * common::MIB,
        "{lines:?}"
    );
    assert_eq!(
        common::field(&lines[3], "used"),
        1900 * common::MIB,
        "{lines:?}"
    );
    assert_eq!(lines[4..], ["alloc:2409 2 #0", "alloc:2408 0 #1"]);
    let c = d
        .wait_for_container("refusal counted", |c| c.refused_allocations == Some(1))
        .await;
    assert_eq!(c.peak_mib, Some(4308));
    let (_, metrics) = d.get("/metrics").await;
    for expected in [
        "# TYPE gpumem_container_refused_allocations counter",
        "gpumem_container_refused_allocations_total{namespace=\"default\",pod=\"nb\",container=\"main\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 1",
        "gpumem_container_peak_bytes{namespace=\"default\",pod=\"nb\",container=\"main\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 4517265408",
    ] {
        assert!(metrics.contains(expected), "missing {expected}:\n{metrics}");
    }

    // The process exits: its untracked usage goes with it.
    h.holder.kill().unwrap();
    h.holder.wait().unwrap();
    d.wait_for_container("released", |c| {
        c.untracked_mib == Some(0) && c.used_mib == Some(0)
    })
    .await;
    h.d.stop().await;
}

#[tokio::test]
async fn every_gpu_process_is_attributed_by_its_cgroup() {
    let container = in_container;
    let h = Holding::start(None).await;
    let (d, dir) = (&h.d, &h.dir);

    // The holder runs in container a. Beside it in the same container, a
    // process that did not load the shim (a static binary, say) holds
    // 500 MiB; container b of another pod reached the GPU without asking
    // for it, and a host daemon holds some too.
    d.list_process(h.holder.id(), 1300, &[("cgroup", &container('a'))]);
    d.list_process(900_001, 500, &[("cgroup", &container('a'))]);
    d.list_process(900_002, 700, &[("cgroup", &container('b'))]);
    d.list_process(
        900_003,
        200,
        &[("cgroup", "0::/system.slice/monitoring.service\n")],
    );
    // The shim-less process counts against its container's cap at once.
    let c = d
        .wait_for_container("the shim-less process counted", |c| {
            c.untracked_mib == Some(500)
        })
        .await;
    assert_eq!(c.used_mib, Some(1800));
    let status = d.status().await;
    assert_eq!(status.gpus[0].unmanaged_mib, Some(900), "{status:?}");
    assert!(
        status
            .table(false)
            .contains("warning: GPU0 has 900 MiB held outside every gpumem container"),
        "{}",
        status.table(false)
    );
    let (_, metrics) = d.get("/metrics").await;
    let expected = "gpumem_gpu_unmanaged_bytes{gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 943718400";
    assert!(metrics.contains(expected), "missing {expected}:\n{metrics}");

    // And the container's processes see it: 4308 - 1800 MiB left.
    let (ok, lines, stderr) = common::run_lines(shim_kit().probe(Some(dir)).args(["nvml"]));
    assert!(ok, "{stderr}");
    assert_eq!(
        common::field(&lines[0], "used"),
        1800 * common::MIB,
        "{lines:?}"
    );

    h.stop().await;
}

/// The driver takes a context's memory before the call that makes it
/// returns, and the shim charges it only then: a sample in between sees the
/// process hold it uncharged. Published as untracked, it would count twice
/// once charged, and refuse the container's first allocations.
#[tokio::test]
async fn a_context_being_made_is_not_untracked_usage() {
    let a = Admitted::start(None).await;
    let (d, dir) = (&a.d, &a.dir);
    let started = std::time::Instant::now();
    const MAKING: Duration = Duration::from_secs(6);
    let mut maker = common::Killed(
        shim_kit()
            .probe(Some(dir))
            .env("FAKEGPU_CONTEXT_DELAY_MS", MAKING.as_millis().to_string())
            .args(["ctx:0", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Its slot is claimed before the context is made.
    let file = dir.join(gpumem_layout::FILE_NAME);
    let deadline = std::time::Instant::now() + WAIT;
    while !gpumem::isolation::accounting::processes(&file)
        .unwrap()
        .live
        .iter()
        .any(|p| p.pid == Some(maker.0.id()))
    {
        assert!(std::time::Instant::now() < deadline, "no slot claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    d.list_process(maker.0.id(), 300, &[]);
    // A process of the container without the shim, listed after: once its
    // 50 MiB are published, a sample has seen the context being made.
    let shimless = common::Killed(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    );
    let mountinfo = common::mountinfo_with_state_dir(dir);
    d.list_process(shimless.0.id(), 50, &[("mountinfo", &mountinfo)]);
    let c = d
        .wait_for_container("the shim-less process counted", |c| {
            c.untracked_mib.is_some_and(|u| u >= 50)
        })
        .await;
    let in_time = started.elapsed() < MAKING && maker.0.try_wait().unwrap().is_none();
    assert!(in_time, "the context was made before a sample saw it");
    assert_eq!(c.untracked_mib, Some(50), "{c:?}");
    a.d.stop().await;
}

/// A process of the container exits: the kernel drops its record lock
/// with its files, but NVML lists its memory until the driver's part of the
/// exit is done, and its mount table can no longer be read. That is not a
/// process outside every container, at any sample while it lasts.
#[tokio::test]
async fn a_holder_on_its_way_out_is_not_taken_for_a_stranger() {
    let mut h = Holding::start(None).await;
    let d = &h.d;
    let pid = h.holder.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let close = stat.rfind(')').unwrap();
    let mut fields: Vec<String> = stat[close + 1..]
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    // PF_EXITING in its flags, as from the first step of its exit.
    fields[6] = (fields[6].parse::<u64>().unwrap() | 0x4).to_string();
    let exiting = format!("{}) {}\n", &stat[..close], fields.join(" "));
    // Listed so while it still holds its slot (and is its slot's), so that
    // every sample after it lets go sees it on its way out.
    d.list_process(
        pid,
        1400,
        &[("stat", &exiting), ("cgroup", &in_container('a'))],
    );
    d.wait_for_container("a sample of it holding its slot", |c| {
        c.untracked_mib == Some(100)
    })
    .await;
    h.holder.kill().unwrap();
    h.holder.wait().unwrap();
    // Host daemons listed one after the other: once each shows, a sample
    // has seen the exiting process beside it.
    for (n, (stranger, mib)) in [(900_003, 200), (900_004, 100)].into_iter().enumerate() {
        d.list_process(
            stranger,
            mib,
            &[("cgroup", "0::/system.slice/monitoring.service\n")],
        );
        let expected = [200, 300][n];
        let deadline = std::time::Instant::now() + WAIT;
        let status = loop {
            let status = d.status().await;
            if status.gpus[0].unmanaged_mib.is_some_and(|m| m >= expected) {
                break status;
            }
            assert!(std::time::Instant::now() < deadline, "{status:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert_eq!(status.gpus[0].unmanaged_mib, Some(expected), "{status:?}");
    }
    h.d.stop().await;
}

/// A container's cgroup in pod `POD`, for container ID `id` × 64.
fn in_container(id: char) -> String {
    in_pod(POD_UID, id)
}

/// The `/proc/<pid>/cgroup` of a process in container `id` of pod `uid`.
fn in_pod(uid: &str, id: char) -> String {
    let pod = uid.replace('-', "_");
    format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod}.slice/\
         cri-containerd-{}.scope\n",
        id.to_string().repeat(64)
    )
}

/// Issue 29, item 2: a tenant allowed a user namespace (`unshare -Urm`,
/// `pivot_root` into a root without /var/run/gpumem) sheds the container's
/// mounts before it reaches the GPU, and no process of its container ever
/// held a slot. Its cgroup, which it cannot leave, names its pod, and
/// kubelet's checkpoint the pod's one gpumem container: it is held to that
/// container's cap, killed at 6300 MiB of its 4308.
#[tokio::test]
async fn a_process_that_shed_its_containers_mounts_is_held_by_its_cgroup() {
    use std::os::unix::process::ExitStatusExt;
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let mut rogue = common::Killed(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    );
    let pivoted = "1 0 0:40 / / rw - tmpfs tmpfs rw\n";
    a.d.list_process(
        rogue.id(),
        6300,
        &[("cgroup", &in_pod(&a.pod_uid, 'e')), ("mountinfo", pivoted)],
    );
    let deadline = std::time::Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = rogue.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not killed; status: {:?}",
            a.d.status().await.gpus[0]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.signal(), Some(9));
    assert_eq!(a.d.status().await.gpus[0].unmanaged_mib, Some(0));
    // The pod is told its container runs a process without gpumem's mounts.
    let api = a.d.api.as_ref().expect("started with an API server");
    let event = loop {
        let found = api.list(Kind::Event).into_iter().find(|e| {
            e["reason"] == "GPUMemoryNotIsolated"
                && e.pointer("/regarding/name") == Some(&"nb".into())
        });
        if let Some(event) = found {
            break event;
        }
        assert!(std::time::Instant::now() < deadline, "no Event");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let note = event["note"].as_str().unwrap();
    let expected = format!("Process {} of container main holds 6300 MiB", rogue.id());
    assert!(note.contains(&expected), "{note}");
    assert!(note.contains("enable_cdi"), "{note}");
    a.d.stop().await;
}

/// A tenant in a user namespace of its own can mount anything at
/// /var/run/gpumem, a neighbour's directory name included, to have its
/// memory counted against the neighbour's cap. Its cgroup names another
/// pod than the one kubelet gave that directory: the mount is not taken
/// for the container's, and the memory shows as held outside every
/// gpumem container.
#[tokio::test]
async fn a_mount_that_names_another_pods_container_is_not_believed() {
    let h = Holding::start(None).await;
    let (d, dir) = (&h.d, &h.dir);
    const STRANGER_POD: &str = "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a";
    d.list_process(
        900_004,
        2500,
        &[
            ("cgroup", &in_pod(STRANGER_POD, 'f')),
            ("mountinfo", &common::mountinfo_with_state_dir(dir)),
        ],
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    let status = loop {
        let status = d.status().await;
        if status.gpus[0].unmanaged_mib == Some(2500) {
            break status;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not unmanaged: {status:?}"
        );
        tokio::time::sleep(RECONCILE).await;
    };
    let c = &status.containers[0];
    assert_eq!(
        (c.used_mib, c.untracked_mib),
        (Some(1300), Some(0)),
        "{c:?}"
    );
    h.stop().await;
}

/// A container over its cap through a process without the shim: with
/// `action`, what happens to it, its capped neighbour and a stranger.
async fn over_cap(action: OverCapAction) -> (std::process::ExitStatus, String) {
    let grace = Duration::from_millis(400);
    let mut h = Holding::start(Some((action, grace))).await;
    let (d, dir) = (&h.d, &h.dir);
    // The tenant rewrites the cap in its own accounting file: the outside
    // action keeps to the cap Allocate gave.
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(gpumem_layout::FILE_NAME))
            .unwrap();
        let at = gpumem_layout::device_offset(0) + gpumem_layout::device::CAP;
        file.write_all_at(&(1u64 << 50).to_le_bytes(), at as u64)
            .unwrap();
    }
    // Real processes, so a kill is real: one of the container's without the
    // shim, taking it to 5300 MiB of its 4308, and one of another pod.
    let mut rogue = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let mut stranger = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    d.list_process(h.holder.id(), 1300, &[("cgroup", &in_container('a'))]);
    d.list_process(rogue.id(), 4000, &[("cgroup", &in_container('a'))]);
    d.list_process(stranger.id(), 6000, &[("cgroup", &in_container('b'))]);
    let started = std::time::Instant::now();
    let counter = match action {
        OverCapAction::Kill => "gpumem_over_cap_kills_total 1",
        OverCapAction::Report => "gpumem_over_cap_reports_total 1",
    };
    let metrics = d.wait_for_metric(counter).await;
    // Not before the grace period.
    assert!(started.elapsed() >= grace, "{:?}", started.elapsed());
    let rogue_status = match action {
        OverCapAction::Kill => rogue.wait().unwrap(),
        OverCapAction::Report => {
            assert!(rogue.try_wait().unwrap().is_none(), "reported only");
            rogue.kill().unwrap();
            rogue.wait().unwrap()
        }
    };
    d.drop_process(rogue.id());
    // The container is under its cap again; its neighbour and the stranger
    // (never killed: it is no gpumem container's) live on.
    tokio::time::sleep(grace * 3).await;
    assert!(
        h.holder.try_wait().unwrap().is_none(),
        "the capped neighbour lives"
    );
    assert!(stranger.try_wait().unwrap().is_none(), "the stranger lives");
    stranger.kill().unwrap();
    stranger.wait().unwrap();
    // Both show on the pod as Events, as `kubectl describe pod` lists them.
    let api = d.api.as_ref().expect("started with an API server");
    let (over, unmanaged) = loop {
        let events = api.list(Kind::Event);
        let reason = |r: &str| {
            events
                .iter()
                .find(|e| e["reason"] == r && e.pointer("/regarding/name") == Some(&"nb".into()))
                .cloned()
        };
        if let (Some(over), Some(unmanaged)) =
            (reason("GPUMemoryOverCap"), reason("GPUMemoryUnmanaged"))
        {
            break (over, unmanaged);
        }
        assert!(started.elapsed() < WAIT, "no Events: {events:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let note = over["note"].as_str().unwrap();
    let expected = match action {
        OverCapAction::Kill => format!("Killed process {} of container main", rogue.id()),
        OverCapAction::Report => "Container main holds 5300 MiB on GPU".to_owned(),
    };
    assert!(note.contains(&expected), "{note}");
    assert_eq!(over["type"], "Warning");
    assert_eq!(over.pointer("/regarding/uid"), Some(&POD_UID.into()));
    assert!(
        unmanaged["note"]
            .as_str()
            .unwrap()
            .contains(&format!("Process {} holds 6000 MiB", stranger.id())),
        "{unmanaged}"
    );

    // The pod object changes (a label), and the container goes over again:
    // the same Event counts up, as kubelet's own repeats do (the Event's
    // reference to the pod carries no resourceVersion).
    let mut pod = api.get(Kind::Pod, "default", "nb").unwrap();
    pod["metadata"]["labels"] = serde_json::json!({"touched": "yes"});
    let touched: u64 = api.put(pod)["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap();
    // The daemon's pod watch has been sent the change.
    let deadline = std::time::Instant::now() + WAIT;
    while api.watch_delivered(Kind::Pod) < touched {
        assert!(
            std::time::Instant::now() < deadline,
            "the pod watch never got the change"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut again = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    d.list_process(again.id(), 4000, &[("cgroup", &in_container('a'))]);
    d.wait_for_metric(&counter.replace(" 1", " 2")).await;
    let _ = again.kill();
    again.wait().unwrap();
    d.drop_process(again.id());
    let repeated = loop {
        let over: Vec<serde_json::Value> = api
            .list(Kind::Event)
            .into_iter()
            .filter(|e| e["reason"] == "GPUMemoryOverCap")
            .collect();
        if over.iter().any(|e| e.pointer("/series/count").is_some()) || over.len() > 1 {
            break over;
        }
        assert!(started.elapsed() < 2 * WAIT, "no repeat: {over:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(repeated.len(), 1, "one Event, counted: {repeated:?}");
    assert_eq!(repeated[0].pointer("/series/count"), Some(&2.into()));
    h.stop().await;
    (rogue_status, metrics)
}

#[tokio::test]
async fn a_container_over_its_cap_loses_its_newest_process_after_the_grace_period() {
    use std::os::unix::process::ExitStatusExt;
    let (status, metrics) = over_cap(OverCapAction::Kill).await;
    assert_eq!(status.signal(), Some(9), "SIGKILL");
    assert!(
        metrics.contains("# TYPE gpumem_over_cap_kills counter"),
        "{metrics}"
    );
}

/// A tenant over its cap in bursts shorter than the grace period, with
/// shorter pauses under it between them (issue 29: 9 s over, 2.3 s under,
/// with the defaults), is stopped: what counts is its time over the cap
/// within the window, not an unbroken run of samples over it.
#[tokio::test]
async fn a_container_over_its_cap_in_bursts_shorter_than_the_grace_period_is_stopped() {
    use std::os::unix::process::ExitStatusExt;
    let grace = Duration::from_millis(1000);
    // Each burst well under the grace, each pause a few reconcile periods.
    let (over, under) = (grace * 3 / 5, RECONCILE * 3);
    let mut h = Holding::start(Some((OverCapAction::Kill, grace))).await;
    let mut rogue = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let cgroup = in_container('a');
    let cgroup = [("cgroup", cgroup.as_str())];
    h.d.list_process(h.holder.id(), 1300, &cgroup);
    let started = std::time::Instant::now();
    let mut bursts = 0;
    // 5300 MiB of its 4308 while bursting, 2300 between.
    'bursting: loop {
        for (mib, pause) in [(4000, over), (1000, under)] {
            h.d.relist_process(rogue.id(), mib, &cgroup);
            let until = std::time::Instant::now() + pause;
            while std::time::Instant::now() < until {
                if rogue.try_wait().unwrap().is_some() {
                    break 'bursting;
                }
                tokio::time::sleep(RECONCILE / 4).await;
            }
        }
        bursts += 1;
        if started.elapsed() > WAIT {
            // Not left behind to hold the test's output open.
            for child in [&mut rogue, &mut *h.holder] {
                child.kill().unwrap();
                child.wait().unwrap();
            }
            panic!("never stopped after {bursts} bursts of {over:?} over its cap");
        }
    }
    let status = rogue.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "SIGKILL");
    h.d.drop_process(rogue.id());
    // Over for the grace period in total: within its second or third burst.
    assert!(bursts <= 4, "stopped only after {bursts} bursts");
    h.d.wait_for_metric("gpumem_over_cap_kills_total 1").await;
    assert!(
        h.holder.try_wait().unwrap().is_none(),
        "the capped neighbour lives"
    );
    h.stop().await;
}

#[tokio::test]
async fn a_container_whose_processes_never_load_the_shim_is_found_by_its_mounts() {
    a_rogue_is_found_by_its_mounts_and_killed(|_| {}).await;
}

/// No process of the container holds a slot; one has the container's
/// state directory mounted, as Allocate's mounts give every process of it,
/// and holds 5000 MiB of its 4308: it is killed, and no memory is taken
/// for unmanaged. The accounting file is mounted writable: after a process
/// of the container `tamper`s with it (the shims then cap nothing), the
/// same holds, against the cap Allocate gave.
async fn a_rogue_is_found_by_its_mounts_and_killed(tamper: impl FnOnce(&Path)) {
    use std::os::unix::process::ExitStatusExt;
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let (d, dir) = (&a.d, &a.dir);
    tamper(&dir.join(gpumem_layout::FILE_NAME));
    let mut rogue = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let mountinfo = common::mountinfo_with_state_dir(dir);
    d.list_process(rogue.id(), 5000, &[("mountinfo", &mountinfo)]);
    let deadline = std::time::Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = rogue.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() >= deadline {
            let _ = rogue.kill();
            panic!("not killed; status: {:?}", d.status().await.gpus[0]);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status.signal(), Some(9));
    assert_eq!(d.status().await.gpus[0].unmanaged_mib, Some(0));
    a.d.stop().await;
}

#[tokio::test]
async fn a_container_that_removed_its_accounting_file_is_held_to_its_cap() {
    a_rogue_is_found_by_its_mounts_and_killed(|file| std::fs::remove_file(file).unwrap()).await;
}

#[tokio::test]
async fn a_container_that_overwrote_its_accounting_file_is_held_to_its_cap() {
    a_rogue_is_found_by_its_mounts_and_killed(|file| std::fs::write(file, b"junk").unwrap()).await;
}

#[tokio::test]
async fn a_container_that_renamed_the_gpu_in_its_accounting_file_is_held_to_its_cap() {
    use std::os::unix::fs::FileExt;
    a_rogue_is_found_by_its_mounts_and_killed(|file| {
        let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
        f.write_all_at(&[0xee; 16], gpumem_layout::device_offset(0) as u64)
            .unwrap();
    })
    .await;
}

#[tokio::test]
async fn with_report_a_container_over_its_cap_is_only_reported() {
    let (_, metrics) = over_cap(OverCapAction::Report).await;
    assert!(
        metrics.contains("gpumem_over_cap_kills_total 0"),
        "{metrics}"
    );
}

// Multi-threaded: the test blocks on `gpumem inspect` while the daemon it
// queries runs on the same runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_reads_the_plugin_or_else_the_node() {
    let d = Daemon::start("t4", Isolation::None, Duration::from_secs(300)).await;
    for pod in ["tf-notebook-1", "tf-notebook-2", "tf-notebook-3"] {
        d.k().admit(pod, "main", RESOURCE, 4).await.unwrap();
    }
    let run = |args: Vec<String>| gpumem_stdout(&args);
    let socket = d.status_socket.display().to_string();
    let from_plugin = run(vec![
        "inspect".into(),
        "-d".into(),
        "--status-socket".into(),
        socket.clone(),
    ]);
    assert!(from_plugin.contains("12/14"), "{from_plugin}");
    assert!(
        from_plugin.contains("Allocated/Total aliyun.com/gpu-mem (GiB): 12/14 (85%)"),
        "{from_plugin}"
    );
    for pod in ["tf-notebook-1", "tf-notebook-2", "tf-notebook-3"] {
        let line = from_plugin
            .lines()
            .find(|l| l.contains(pod))
            .unwrap_or_else(|| panic!("{from_plugin}"));
        assert!(line.contains("4308"), "{line}");
    }
    let json = run(vec![
        "inspect".into(),
        "-o".into(),
        "json".into(),
        "--status-socket".into(),
        socket,
    ]);
    let status: NodeStatus = serde_json::from_str(&json).unwrap();
    assert!(status.registered);
    assert_eq!(status.containers.len(), 3);

    // No plugin at that socket: the node is read directly.
    let direct = run(vec![
        "inspect".into(),
        "-d".into(),
        "--status-socket".into(),
        d.dir.path().join("nobody.sock").display().to_string(),
        "--isolation".into(),
        "none".into(),
        "--fake-gpus".into(),
        d.node_file.display().to_string(),
        "--pod-resources-socket".into(),
        d.k().pod_resources_socket().display().to_string(),
    ]);
    assert!(
        direct.contains("12/14") && direct.contains("tf-notebook-2"),
        "{direct}"
    );
    d.stop().await;
}

// Multi-threaded: the test blocks on `gpumem inspect` while the daemon it
// queries runs on the same runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_pod_resources_the_state_dir_still_shows_each_container() {
    let host = common::installed_shim();
    let state = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(
        "t4",
        shim(host.path(), state.path()),
        Duration::from_secs(300),
        false,
    )
    .await;
    let mut dirs = Vec::new();
    for pod in ["nb-1", "nb-2"] {
        let allocation = d.k().admit(pod, "main", RESOURCE, 4).await.unwrap();
        dirs.push(PathBuf::from(&allocation.response.mounts[2].host_path));
    }
    let name = |dir: &Path| dir.file_name().unwrap().to_str().unwrap().to_owned();
    let (busy, idle) = (name(&dirs[0]), name(&dirs[1]));
    let mut holder = shim_kit()
        .probe(Some(&dirs[0]))
        .args(["alloc:1000", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut holder, "holding");
    // A broken file beside them is not a container.
    let junk = state.path().join("containers/junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("accounting"), b"not an accounting file").unwrap();

    let status = d.status().await;
    assert!(status.pod_resources_error.is_some());
    let row = |dir: &str| {
        let c = status
            .containers
            .iter()
            .find(|c| c.accounting_dir.as_deref() == Some(dir))
            .unwrap_or_else(|| panic!("{dir} not listed: {:?}", status.containers));
        (c.pod.clone(), c.gpu, c.units, c.cap_mib, c.used_mib)
    };
    assert_eq!(status.containers.len(), 2, "{:?}", status.containers);
    // 1000 MiB and its 300 MiB context.
    assert_eq!(row(&busy), (None, 0, 4, 4308, Some(1300)));
    assert_eq!(row(&idle), (None, 0, 4, 4308, Some(0)));

    let (_, metrics) = d.get("/metrics").await;
    for expected in [
        format!("gpumem_container_cap_bytes{{accounting_dir=\"{idle}\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"}} 4517265408"),
        format!("gpumem_container_used_bytes{{accounting_dir=\"{busy}\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"}} 1363148800"),
        format!(
            "gpumem_container_refused_allocations_total{{accounting_dir=\"{busy}\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"}} 0"
        ),
        "gpumem_pod_resources_up 0".to_owned(),
    ] {
        assert!(
            metrics.contains(&expected),
            "missing {expected}:\n{metrics}"
        );
    }

    // `gpumem inspect -d`, from the plugin and, with no plugin, from the node.
    let inspect = |args: &[&str]| gpumem_stdout(&[&["inspect", "-d"], args].concat());
    let plugin_socket = d.status_socket.display().to_string();
    let missing = d.dir.path().join("no-pod-resources.sock");
    let node_file = d.node_file.display().to_string();
    for table in [
        inspect(&["--status-socket", &plugin_socket]),
        inspect(&[
            "--status-socket",
            missing.to_str().unwrap(),
            "--fake-gpus",
            &node_file,
            "--pod-resources-socket",
            missing.to_str().unwrap(),
            "--shim-host-dir",
            host.path().to_str().unwrap(),
            "--state-dir",
            state.path().to_str().unwrap(),
        ]),
    ] {
        assert!(table.contains("warning: allocations unknown"), "{table}");
        let rows: Vec<Vec<&str>> = table
            .lines()
            .filter(|l| l.contains("(unknown)"))
            .map(|l| l.split_whitespace().collect())
            .collect();
        // NAMESPACE POD CONTAINER GPU UNITS CAP USED UNTRACKED REFUSED
        let mut used: Vec<&str> = rows.iter().map(|r| r[6]).collect();
        used.sort_unstable();
        assert_eq!(used, ["0", "1300"], "{table}");
        assert!(
            rows.iter().all(|r| r[3..6] == ["0", "4", "4308"]),
            "{table}"
        );
    }
    holder.kill().unwrap();
    holder.wait().unwrap();
    d.stop().await;
}

/// NVML answers played back in order.
struct Script(std::collections::VecDeque<u64>, u32);

impl gpumem::node::processes::ProcessUsage for Script {
    fn usage(&mut self) -> Result<gpumem::node::gpu::ProcessMemory, gpumem::node::gpu::GpuError> {
        let mib = self.0.pop_front().expect("script long enough");
        Ok([(
            common::T4_UUID.to_owned(),
            [(self.1, mib * common::MIB)].into(),
        )]
        .into())
    }
}

#[test]
fn untracked_usage_rises_at_once_and_falls_only_when_two_samples_agree() {
    use gpumem_layout::{slot, slot_offset, state, FILE_NAME};
    use std::os::unix::fs::FileExt;
    let dir = common::capped_dir(4308);
    let file = dir.path().join(FILE_NAME);
    // A process holding slot 0 with 1000 MiB charged, as a shim would.
    let at = slot_offset(1, 0);
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.write_all_at(
        &(1000 * common::MIB).to_le_bytes(),
        (at + slot::USED) as u64,
    )
    .unwrap();
    f.write_all_at(&(1u64 << 8 | state::ALIVE).to_le_bytes(), at as u64)
        .unwrap();
    f.write_all_at(&1u32.to_le_bytes(), gpumem_layout::header::SLOT_HWM as u64)
        .unwrap();
    let mut holder = common::hold_record_lock(&file, at);

    // NVML's view of the holder, tick by tick, and the untracked MiB that
    // must be published after each.
    let nvml = [1600, 1000, 1600, 1000, 1000, 1200];
    let published = [600, 600, 600, 600, 0, 200];
    let mut reconciler = gpumem::isolation::reconcile::Reconciler::new(Box::new(Script(
        nvml.into_iter().collect(),
        holder.id(),
    )));
    for (tick, want) in published.into_iter().enumerate() {
        reconciler.tick(std::slice::from_ref(&file));
        let usage = &gpumem::isolation::accounting::usage(&file).unwrap()[0];
        assert_eq!(usage.untracked_bytes, want * common::MIB, "tick {tick}");
        assert_eq!(usage.used_bytes, (1000 + want) * common::MIB, "tick {tick}");
    }
    holder.kill().unwrap();
    holder.wait().unwrap();
}

/// What the real `gpumem` prints with `args`, which must succeed.
fn gpumem_stdout(args: &[impl AsRef<std::ffi::OsStr>]) -> String {
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
fn spawn_daemon(
    dir: &Path,
    node_file: &Path,
    isolation: Isolation,
    unit: MemoryUnit,
    configure: impl FnOnce(&mut DaemonConfig),
) -> (
    CancellationToken,
    JoinHandle<Result<(), daemon::DaemonError>>,
) {
    let gpus = FakeGpus::from_file(node_file).unwrap().discover().unwrap();
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
            state_dir: dir.join("state"),
            metrics: None,
            status_socket: None,
            state_grace: Duration::from_secs(300),
            bound_state_dirs: Bounding::Off,
            reconcile: Some((Box::new(FakeProcesses::new(node_file)), RECONCILE)),
            over_cap: None,
            sensors: Some(Sensors::Fake(node_file.to_owned())),
            hostname: HOSTNAME.into(),
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

/// A container admitted with 4 GiB units (a 4308 MiB cap on the T4) keeps
/// its cap when the daemon restarts with `--memory-unit MiB`: read in the
/// new unit, its grant would be 4 MiB, and the over-cap action would kill a
/// process using 2000 MiB of its 4308.
#[tokio::test]
async fn a_container_keeps_its_cap_across_a_change_of_memory_unit() {
    let dir = tempfile::tempdir().unwrap();
    let node_file = dir.path().join("node.toml");
    std::fs::copy(fixture("t4"), &node_file).unwrap();
    let (host, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    common::fake_installed_shim(host.path());
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let start = |unit| {
        spawn_daemon(
            dir.path(),
            &node_file,
            shim(host.path(), state.path()),
            unit,
            |config| {
                config.pod_resources_socket = kubelet.pod_resources_socket();
                config.common.over_cap = Some((OverCapAction::Kill, Duration::from_millis(400)));
            },
        )
    };

    let (stop, task) = start(MemoryUnit::GiB);
    kubelet.wait_for_devices(RESOURCE, 1, WAIT).await.unwrap();
    let allocation = kubelet.admit("nb", "main", RESOURCE, 4).await.unwrap();
    assert_eq!(allocation.response.envs["GPUMEM_LIMIT_MIB"], "4308");
    let container_dir = PathBuf::from(&allocation.response.mounts[2].host_path);
    stop.cancel();
    task.await.unwrap().unwrap();

    let (stop, task) = start(MemoryUnit::MiB);
    kubelet.wait_for_devices(RESOURCE, 2, WAIT).await.unwrap();
    let mut worker = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let mountinfo = common::mountinfo_with_state_dir(&container_dir);
    common::list_fake_process(&node_file, worker.id(), 2000, &[("mountinfo", &mountinfo)]);
    // Many reconciliations and grace periods.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let killed = worker.try_wait().unwrap();
    let _ = worker.kill();
    let _ = worker.wait();
    stop.cancel();
    let _ = task.await;
    assert_eq!(
        killed, None,
        "a process using 2000 of its 4308 MiB was killed"
    );
}

/// Waits until a plugin's clean-up (run with `--state-grace-secs 1`) has
/// swept `state` past its grace: a directory `name` made now, which no
/// container holds, is removed.
async fn swept_past_the_grace(state: &Path, name: &str) {
    let stray = state.join("containers").join(name);
    std::fs::create_dir_all(&stray).unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while stray.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "{} was never cleaned up",
            stray.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A change from GiB to MiB units while a container allocated in GiB still
/// runs is said: kubelet now counts that container's 4 units as 4 MiB, so
/// its GPU could be handed out past its memory until it ends.
#[tokio::test]
async fn a_change_of_memory_unit_under_a_running_container_is_said() {
    let kubelet_dir = tempfile::tempdir().unwrap();
    let (host, state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    common::fake_installed_shim(host.path());
    let kubelet = KubeletSim::start(kubelet_dir.path()).unwrap();
    let said = "kubelet still holds units of a container allocated before --memory-unit changed";
    let start = |unit: &str, log: &Path| {
        common::shim_plugin(kubelet_dir.path(), &kubelet, host.path(), state.path())
            .args(["--memory-unit", unit, "--state-grace-secs", "1"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap()
    };
    let logs = [
        kubelet_dir.path().join("gib.log"),
        kubelet_dir.path().join("mib.log"),
    ];
    let log = |n: usize| std::fs::read_to_string(&logs[n]).unwrap_or_default();

    let mut gib = start("GiB", &logs[0]);
    kubelet.wait_for_devices(RESOURCE, 1, WAIT).await.unwrap();
    kubelet.admit("nb", "main", RESOURCE, 4).await.unwrap();
    // A clean-up sweep past its grace, which looks at the units first:
    // nothing to say in one unit.
    swept_past_the_grace(state.path(), "stray-1").await;
    let _ = gib.kill();
    let _ = gib.wait();
    assert!(!log(0).contains(said), "{}", log(0));

    let mut mib = start("MiB", &logs[1]);
    let seen = async {
        kubelet.wait_for_devices(RESOURCE, 2, WAIT).await?;
        let deadline = std::time::Instant::now() + WAIT;
        while !log(1).contains(said) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // More sweeps: said once.
        swept_past_the_grace(state.path(), "stray-2").await;
        Some(log(1))
    }
    .await;
    let _ = mib.kill();
    let _ = mib.wait();
    let text = seen.unwrap_or_else(|| panic!("no registration; log:\n{}", log(1)));
    assert_eq!(text.matches(said).count(), 1, "said once:\n{text}");
    assert!(
        text.contains("allocated_in=GiB") && text.contains("counted_in=MiB"),
        "{text}"
    );
}
