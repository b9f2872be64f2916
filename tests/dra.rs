//! `gpumem dra`, the DRA driver, through the real binary: a fake kubelet
//! registers it and calls NodePrepareResources/NodeUnprepareResources over
//! unix sockets (both API versions) and watches device health
//! (NodeWatchResources), and the in-process fake API server
//! serves `resource.k8s.io/v1` (slices, claims; with and without
//! `DRAConsumableCapacity`).

mod common;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
use serde_json::{json, Value};

use common::cdi::check_cdi_spec;
use common::wait::{eventually, poll, POLL};
use common::{fixture, T4_UUID};
use gpumem::dra::claims::{ClaimRef, Prepared};
use gpumem_testkit::fake_apiserver::{allocated_claim, Allocated, FakeApiServer, Kind};
use gpumem_testkit::simulator::dra::{
    health_of, DraVersion, FakeDraKubelet, HealthStatus, HealthStream, HealthVersion, KUBELET_1_33,
    KUBELET_1_34, KUBELET_1_37,
};
use gpumem_testkit::simulator::{ClaimUse, KubeletSim};

const NODE: &str = "gpu-node-1";
const NODE_UID: &str = "3f1b7c2e-8d4a-4e6b-9c1d-2a5e7f9b0c43";
const DRIVER: &str = "gpumem.io";
const WAIT: Duration = Duration::from_secs(20);

/// One node's host directories, kept across driver restarts.
struct Host {
    root: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let root = tempfile::tempdir().unwrap();
        common::fake_installed_shim(&root.path().join("shim"));
        std::fs::create_dir_all(root.path().join("registry")).unwrap();
        Host { root }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.path().join(name)
    }

    fn registration_socket(&self) -> PathBuf {
        self.path("registry").join(format!("{DRIVER}-reg.sock"))
    }

    fn spec_file(&self, uid: &str) -> PathBuf {
        self.path("cdi").join(format!("gpumem.io-claim_{uid}.json"))
    }

    fn checkpoint(&self) -> PathBuf {
        self.path("state").join("dra/checkpoint.json")
    }

    /// The checkpoint as JSON.
    fn record(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.checkpoint()).unwrap()).unwrap()
    }

    /// Writes `record` as the checkpoint.
    fn write_record(&self, record: &Value) {
        std::fs::write(self.checkpoint(), serde_json::to_vec(record).unwrap()).unwrap();
    }

    /// Rewrites the checkpoint through `edit`; what `edit` returns.
    fn edit_record<T>(&self, edit: impl FnOnce(&mut Value) -> T) -> T {
        let mut record = self.record();
        let out = edit(&mut record);
        self.write_record(&record);
        out
    }
}

/// `gpumem dra` on a fake T4 node.
struct Driver {
    child: Child,
    log: PathBuf,
    /// Where the driver serves `/status`, for `gpumem inspect`.
    status_socket: PathBuf,
    /// Where it serves `/metrics`.
    metrics: std::net::SocketAddr,
}

impl Driver {
    async fn start(host: &Host, api: &FakeApiServer) -> Driver {
        Driver::start_on(host, api, "t4", &[]).await
    }

    async fn start_with(host: &Host, api: &FakeApiServer, pod_resources: &Path) -> Driver {
        Driver::start_custom(
            host,
            api,
            pod_resources,
            &fixture("t4"),
            &["--reconcile-secs", "0"],
        )
        .await
    }

    /// On fixture `gpus`, without kubelet's pod-resources, not reconciling,
    /// with `extra` flags.
    async fn start_on(host: &Host, api: &FakeApiServer, gpus: &str, extra: &[&str]) -> Driver {
        let flags = [&["--reconcile-secs", "0"], extra].concat();
        let sock = host.path("no-kubelet.sock");
        Driver::start_custom(host, api, &sock, &fixture(gpus), &flags).await
    }

    /// On a copy of fixture `name`, returned (tests list GPU processes
    /// there), reconciling every second and killing the processes of a
    /// claim over its cap for longer than `grace` seconds.
    async fn start_killing(
        host: &Host,
        api: &FakeApiServer,
        pod_resources: &Path,
        name: &str,
        grace: &str,
    ) -> (Driver, PathBuf) {
        let gpus = host.path("node.toml");
        std::fs::copy(fixture(name), &gpus).unwrap();
        let flags = [
            "--reconcile-secs",
            "1",
            "--over-cap-action",
            "kill",
            "--over-cap-grace-secs",
            grace,
        ];
        let driver = Driver::start_custom(host, api, pod_resources, &gpus, &flags).await;
        (driver, gpus)
    }

    /// On the node file `gpus`, with `extra` flags.
    async fn start_custom(
        host: &Host,
        api: &FakeApiServer,
        pod_resources: &Path,
        gpus: &Path,
        extra: &[&str],
    ) -> Driver {
        let cmd = Driver::command(host, api, pod_resources, gpus, extra);
        Driver::spawn(host, cmd).await
    }

    /// `start`, with each claim's directory a bounded tmpfs, in a mount
    /// namespace of its own (`common::with_bounded_state`).
    async fn start_bounded(host: &Host, api: &FakeApiServer) -> Driver {
        let sock = host.path("no-kubelet.sock");
        let flags = ["--reconcile-secs", "0"];
        let cmd = Driver::command(host, api, &sock, &fixture("t4"), &flags);
        Driver::spawn(host, common::with_bounded_state(&cmd, &host.path("state"))).await
    }

    /// `gpumem dra` on the node file `gpus`, with `extra` flags.
    fn command(
        host: &Host,
        api: &FakeApiServer,
        pod_resources: &Path,
        gpus: &Path,
        extra: &[&str],
    ) -> Command {
        let kubeconfig = host.path("kubeconfig");
        api.write_kubeconfig(&kubeconfig).unwrap();
        let metrics = {
            let probe = TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().to_string()
        };
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpumem"));
        cmd.arg("dra")
            .args(["--node-name", NODE, "--driver-name", DRIVER])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--fake-gpus")
            .arg(gpus)
            .arg("--kubelet-plugins-dir")
            .arg(host.path("plugins"))
            .arg("--kubelet-registry-dir")
            .arg(host.path("registry"))
            .arg("--cdi-spec-dir")
            .arg(host.path("cdi"))
            .arg("--state-dir")
            .arg(host.path("state"))
            .arg("--shim-host-dir")
            .arg(host.path("shim"))
            .arg("--pod-resources-socket")
            .arg(pod_resources)
            .args(["--state-grace-secs", "1"])
            .args(extra)
            .args(["--metrics-addr", &metrics]);
        cmd
    }

    /// Runs `cmd` and waits until it serves its registration socket.
    async fn spawn(host: &Host, mut cmd: Command) -> Driver {
        let metrics = cmd
            .get_args()
            .skip_while(|arg| *arg != "--metrics-addr")
            .nth(1)
            .and_then(|addr| addr.to_str()?.parse().ok())
            .expect("a --metrics-addr from Driver::command");
        let log = host.path(&format!("driver-{}.log", std::process::id()));
        let child = cmd
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap(),
            )
            .spawn()
            .unwrap();
        let driver = Driver {
            child,
            log,
            status_socket: host.path("state").join("status.sock"),
            metrics,
        };
        // A killed driver's socket stays behind: wait for one that answers.
        eventually(
            "a registration socket that answers",
            WAIT,
            POLL,
            async || {
                std::os::unix::net::UnixStream::connect(host.registration_socket()).map_err(|_| {
                    format!(
                        "no registration socket; the driver's log:\n{}",
                        driver.log()
                    )
                })
            },
        )
        .await;
        driver
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Kills this driver, lets `meanwhile` change the node while none runs,
    /// and starts another, with a 1.34 kubelet registered to call it.
    async fn restart(
        mut self,
        host: &Host,
        api: &FakeApiServer,
        meanwhile: impl FnOnce(),
    ) -> (Driver, FakeDraKubelet) {
        self.kill();
        meanwhile();
        let driver = Driver::start(host, api).await;
        (driver, kubelet_1_34(host).await)
    }

    /// `/status`, as `gpumem inspect -o json` reads it.
    async fn status(&self) -> Value {
        let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(["inspect", "-o", "json", "--status-socket"])
            .arg(&self.status_socket)
            .args(["--fake-gpus"])
            .arg(fixture("t4"))
            .output()
            .unwrap();
        let status: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
        // Read from the driver, not from the node directly.
        assert!(
            status.get("dra").is_some(),
            "{status}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        status
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn api() -> FakeApiServer {
    let api = FakeApiServer::start().await.unwrap();
    api.put(json!({
        "kind": "Node",
        "metadata": {"name": NODE, "uid": NODE_UID},
        "status": {"capacity": {"cpu": "8"}},
    }));
    api
}

/// A claim allocated from our driver: (device, consumed memory, share ID)
/// per result.
fn claim(name: &str, uid: &str, results: &[(&str, Option<&str>, Option<&str>)]) -> Value {
    let results: Vec<Allocated> = results
        .iter()
        .enumerate()
        .map(|(i, (device, memory, share))| Allocated {
            request: format!("gpu-{i}"),
            device: (*device).to_owned(),
            memory: memory.map(str::to_owned),
            share_id: share.map(str::to_owned),
        })
        .collect();
    allocated_claim("default", name, uid, DRIVER, NODE, &results)
}

/// A 1.34 kubelet registered with the driver on `host`.
async fn kubelet_1_34(host: &Host) -> FakeDraKubelet {
    FakeDraKubelet::register(&host.registration_socket(), KUBELET_1_34)
        .await
        .unwrap()
}

/// `gpumem dra` on `host` once a 1.34 kubelet had it prepare claim `nb`
/// (4Gi on gpu-0, UID `uid(1)`), and what kubelet was told.
async fn driver_with_notebook(host: &Host, api: &FakeApiServer) -> (Driver, Prepared) {
    let driver = Driver::start(host, api).await;
    let kubelet = kubelet_1_34(host).await;
    api.put(claim("nb", &uid(1), &[("gpu-0", Some("4Gi"), None)]));
    let prepared = kubelet.prepare(&[claim_ref("nb", &uid(1))]).await.unwrap();
    prepared[&uid(1)].as_ref().unwrap();
    (driver, prepared)
}

/// `gpumem dra` on `host` once a 1.34 kubelet had it prepare claims `c1`
/// and `c2` (2Gi each on gpu-0, UIDs `uid(1)` and `uid(2)`), their
/// references, and what kubelet was told.
async fn driver_with_two_claims(
    host: &Host,
    api: &FakeApiServer,
) -> (Driver, [ClaimRef; 2], Prepared) {
    let driver = Driver::start(host, api).await;
    let kubelet = kubelet_1_34(host).await;
    for (name, n) in [("c1", 1), ("c2", 2)] {
        api.put(claim(name, &uid(n), &[("gpu-0", Some("2Gi"), None)]));
    }
    let refs = [claim_ref("c1", &uid(1)), claim_ref("c2", &uid(2))];
    let prepared = kubelet.prepare(&refs).await.unwrap();
    assert!(prepared.values().all(Result::is_ok), "{prepared:?}");
    (driver, refs, prepared)
}

fn claim_ref(name: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

fn uid(n: u32) -> String {
    format!("0c5e1a7b-0000-4000-8000-{n:012}")
}

/// Has `kubelet` prepare `refs`, each of which must succeed.
async fn prepare_all(kubelet: &FakeDraKubelet, driver: &Driver, refs: &[ClaimRef]) {
    let prepared = kubelet.prepare(refs).await.unwrap();
    for claim in refs {
        prepared[&claim.uid]
            .as_ref()
            .unwrap_or_else(|e| panic!("{e}\n{}", driver.log()));
    }
}

/// A container's state directory as a runtime makes it from the claims'
/// CDI specs (CDI replaces a mount at a container path taken already),
/// with links standing in for the mounts.
fn container_state(host: &Host, refs: &[ClaimRef]) -> PathBuf {
    let state = host.path("container-state");
    std::fs::create_dir_all(&state).unwrap();
    for claim in refs {
        let spec: Value =
            serde_json::from_slice(&std::fs::read(host.spec_file(&claim.uid)).unwrap()).unwrap();
        for mount in spec["devices"][0]["containerEdits"]["mounts"]
            .as_array()
            .unwrap()
        {
            let at = mount["containerPath"].as_str().unwrap();
            let Some(inside) = at.strip_prefix(gpumem_layout::CONTAINER_DIR) else {
                continue;
            };
            let from = Path::new(mount["hostPath"].as_str().unwrap());
            let (from, to) = match inside.strip_prefix('/') {
                Some(name) => (from.to_owned(), state.join(name)),
                // Over the state directory itself: its file stands for it.
                None => (
                    from.join(gpumem_layout::FILE_NAME),
                    state.join(gpumem_layout::FILE_NAME),
                ),
            };
            let _ = std::fs::remove_file(&to);
            std::os::unix::fs::symlink(from, to).unwrap();
        }
    }
    state
}

fn our_slice(api: &FakeApiServer) -> Option<Value> {
    api.list(Kind::ResourceSlice)
        .into_iter()
        .find(|s| s["spec"]["nodeName"] == NODE && s["spec"]["driver"] == DRIVER)
}

#[tokio::test]
async fn registers_with_kubelets_that_speak_v1_and_those_that_speak_only_v1beta1() {
    let host = Host::new();
    let api = api().await;
    let driver = Driver::start(&host, &api).await;
    let kubelet = FakeDraKubelet::register(&host.registration_socket(), KUBELET_1_34)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", driver.log()));
    assert_eq!(kubelet.version(), DraVersion::V1);
    assert_eq!(kubelet.info().name, DRIVER);
    assert_eq!(
        kubelet.info().endpoint,
        host.path("plugins")
            .join(DRIVER)
            .join("dra.sock")
            .display()
            .to_string()
    );
    let old = FakeDraKubelet::register(&host.registration_socket(), KUBELET_1_33)
        .await
        .unwrap();
    assert_eq!(old.version(), DraVersion::V1beta1);
    let status = driver.status().await;
    assert_eq!(status["registered"], true, "{status}");
    assert_eq!(status["dra"]["driver"], DRIVER, "{status}");
}

/// Every name that appeared in `dir` (created, or renamed in) since
/// `watch` began, as kubelet's plugin watcher is told of them.
fn names_that_appeared(watch: &Inotify) -> Vec<String> {
    let mut names = Vec::new();
    loop {
        match watch.read_events() {
            Ok(events) => names.extend(
                events
                    .into_iter()
                    .filter_map(|e| e.name)
                    .map(|n| n.to_string_lossy().into_owned()),
            ),
            Err(nix::errno::Errno::EAGAIN) => return names,
            Err(err) => panic!("reading inotify events: {err}"),
        }
    }
}

#[tokio::test]
async fn kubelets_plugin_watcher_sees_only_the_final_registration_socket() {
    let host = Host::new();
    let api = api().await;
    // kubelet stats each new entry before it checks for a leading dot: any
    // other name, even a hidden one renamed away, logs an error there.
    let watch = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).unwrap();
    watch
        .add_watch(
            &host.path("registry"),
            AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO,
        )
        .unwrap();
    let mut first = Driver::start(&host, &api).await;
    // A killed driver leaves its socket: the next one replaces it.
    first.kill();
    let second = Driver::start(&host, &api).await;
    FakeDraKubelet::register(&host.registration_socket(), KUBELET_1_34)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", second.log()));
    let names = names_that_appeared(&watch);
    let final_name = format!("{DRIVER}-reg.sock");
    assert!(!names.is_empty(), "no socket appeared");
    assert!(
        names.iter().all(|n| *n == final_name),
        "kubelet's plugin watcher would see {names:?}"
    );
}

#[tokio::test]
async fn publishes_the_nodes_slice_and_publishes_it_again_when_kubelet_deletes_it() {
    let host = Host::new();
    let api = api().await;
    let driver = Driver::start(&host, &api).await;
    let slice = eventually("the slice", WAIT, POLL, async || our_slice(&api)).await;
    let golden: Value = serde_json::from_str(include_str!("fixtures/dra/slice-t4.json")).unwrap();
    assert_eq!(slice["metadata"]["name"], golden["metadata"]["name"]);
    assert_eq!(
        slice["metadata"]["ownerReferences"], golden["metadata"]["ownerReferences"],
        "the Node owns the slice"
    );
    assert_eq!(slice["spec"]["pool"]["name"], NODE);
    let device = &slice["spec"]["devices"][0];
    let want = &golden["spec"]["devices"][0];
    assert_eq!(slice["spec"]["devices"].as_array().unwrap().len(), 1);
    assert_eq!(device["name"], want["name"]);
    assert_eq!(device["allowMultipleAllocations"], true);
    assert_eq!(device["capacity"], want["capacity"], "{slice}");
    for attribute in ["uuid", "productName", "index", "type"] {
        assert_eq!(
            device["attributes"][attribute],
            want["attributes"][attribute]
        );
    }
    assert_eq!(device["attributes"]["uuid"]["string"], T4_UUID);

    // kubelet deletes the node's slices when it starts.
    assert!(!api.delete_node_slices(NODE, None).is_empty());
    assert!(our_slice(&api).is_none());
    let again = eventually("the slice again", WAIT, POLL, async || our_slice(&api)).await;
    assert_eq!(again["spec"]["devices"], slice["spec"]["devices"]);
    let status = driver.status().await;
    assert_eq!(status["dra"]["consumable_capacity"], true, "{status}");
}

/// The API server goes away under a running driver: the driver says so
/// once, naming the server and why, and `gpumem inspect` says it too.
#[tokio::test]
async fn an_api_server_gone_is_named_once_and_told_by_inspect() {
    let host = Host::new();
    let api = api().await;
    let driver = Driver::start(&host, &api).await;
    eventually("the slice", WAIT, POLL, async || our_slice(&api)).await;
    let server = api.url();
    drop(api);
    // The first failure seen may be a watch cut mid-stream; the cause
    // shown is the latest, which becomes the refused connection.
    let (Ok(status) | Err(status)) = poll(WAIT, Duration::from_millis(100), async || {
        let status = driver.status().await;
        let refused = status["api_server_error"]
            .as_str()
            .is_some_and(|e| e.contains("Connection refused"));
        if refused {
            Ok(status)
        } else {
            Err(status)
        }
    })
    .await;
    let error = status["api_server_error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with(&format!("cannot reach the API server at {server} for"))
            && error.contains("Connection refused"),
        "{status}\n{}",
        driver.log()
    );
    let log = driver.log();
    let said = log
        .lines()
        .filter(|l| l.contains("cannot reach the API server"))
        .count();
    assert_eq!(said, 1, "{log}");
}

#[tokio::test]
async fn an_api_server_without_consumable_capacity_is_detected_and_said() {
    let host = Host::new();
    let api = api().await;
    api.drop_consumable_capacity(true);
    let driver = Driver::start(&host, &api).await;
    let slice = eventually("the slice", WAIT, POLL, async || our_slice(&api)).await;
    assert!(slice["spec"]["devices"][0]
        .get("allowMultipleAllocations")
        .is_none());
    eventually("the log to say so", WAIT, POLL, async || {
        driver.log().contains("DRAConsumableCapacity").then_some(())
    })
    .await;
    let status = driver.status().await;
    assert_eq!(status["dra"]["consumable_capacity"], false, "{status}");
    let table = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["inspect", "--status-socket"])
        .arg(&driver.status_socket)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(
        table.contains("each GPU goes whole to one claim"),
        "{table}"
    );

    // A claim allocated whole (no consumedCapacity) is capped at the GPU.
    api.put(claim("whole", &uid(9), &[("gpu-0", None, None)]));
    let kubelet = kubelet_1_34(&host).await;
    let prepared = kubelet
        .prepare(&[claim_ref("whole", &uid(9))])
        .await
        .unwrap();
    prepared[&uid(9)].as_ref().unwrap();
    let spec: Value =
        serde_json::from_slice(&std::fs::read(host.spec_file(&uid(9))).unwrap()).unwrap();
    let env = spec["devices"][0]["containerEdits"]["env"].to_string();
    assert!(env.contains("GPUMEM_LIMIT_MIB=15079"), "{env}");
}

// Multi-threaded: the test blocks on `gpumem inspect` while the simulated
// kubelet it asks runs on the same runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_claims_of_4gi_on_a_t4_are_capped_at_4096_mib_each() {
    let host = Host::new();
    let api = api().await;
    std::fs::create_dir_all(host.path("kubelet")).unwrap();
    let pod_resources = KubeletSim::start(&host.path("kubelet")).unwrap();
    let driver = Driver::start_with(&host, &api, &pod_resources.pod_resources_socket()).await;
    let kubelet = kubelet_1_34(&host).await;
    let names = ["notebook-1", "notebook-2", "notebook-3"];
    let mut refs = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let share = format!("share-{i}");
        api.put(claim(
            name,
            &uid(i as u32),
            &[("gpu-0", Some("4Gi"), Some(&share))],
        ));
        refs.push(claim_ref(name, &uid(i as u32)));
    }
    let prepared = kubelet.prepare(&refs).await.unwrap();
    assert_eq!(prepared.len(), 3, "every claim gets an entry");
    for (i, claim) in refs.iter().enumerate() {
        let devices = prepared[&claim.uid]
            .as_ref()
            .unwrap_or_else(|e| panic!("{e}\n{}", driver.log()));
        assert_eq!(devices.len(), 1);
        let device = &devices[0];
        assert_eq!(device.pool_name, NODE);
        assert_eq!(device.device_name, "gpu-0");
        assert_eq!(device.request_names, ["gpu-0"]);
        assert_eq!(
            device.share_id.as_deref(),
            Some(format!("share-{i}").as_str())
        );
        let ours = format!("gpumem.io/claim={}", claim.uid);
        assert_eq!(device.cdi_device_ids, [ours]);

        // The spec: valid CDI, the cap and the shim's mounts.
        let spec: Value =
            serde_json::from_slice(&std::fs::read(host.spec_file(&claim.uid)).unwrap()).unwrap();
        check_cdi_spec(&spec).unwrap_or_else(|e| panic!("{e}: {spec}"));
        let edits = &spec["devices"][0]["containerEdits"];
        let env: Vec<&str> = edits["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap())
            .collect();
        assert!(env.contains(&"GPUMEM_LIMIT_MIB=4096"), "{env:?}");
        assert!(
            env.contains(&format!("NVIDIA_VISIBLE_DEVICES={T4_UUID}").as_str()),
            "{env:?}"
        );
        assert!(env.contains(&"ALIYUN_COM_GPU_MEM_CONTAINER=4"), "{env:?}");
        let mounts: Vec<(String, String)> = edits["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                (
                    m["containerPath"].as_str().unwrap().to_owned(),
                    m["hostPath"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        let dir = host
            .path("state")
            .join("containers")
            .join(format!("claim-{}", claim.uid));
        for (container, host_path) in [
            (
                "/usr/local/gpumem/libgpumem_shim.so".to_owned(),
                host.path("shim/libgpumem_shim.so"),
            ),
            (
                "/etc/ld.so.preload".to_owned(),
                host.path("shim/ld.so.preload"),
            ),
            (format!("/var/run/gpumem/claim-{}", claim.uid), dir.clone()),
        ] {
            assert!(
                mounts.contains(&(container.clone(), host_path.display().to_string())),
                "{container}: {mounts:?}"
            );
        }
        // The accounting file the shim reads holds the cap.
        let usage =
            gpumem::isolation::accounting::usage(&dir.join(gpumem_layout::FILE_NAME)).unwrap();
        assert_eq!(usage[0].uuid, T4_UUID);
        assert_eq!(usage[0].cap_bytes, 4096 << 20);
    }

    // Asked again (kubelet restarted, or a second pod): the same answer.
    let again = kubelet.prepare(&refs).await.unwrap();
    assert_eq!(again, prepared);

    // Two pods' containers share the first claim; kubelet's pod-resources
    // API links them to it.
    for pod in ["notebook-1-a", "notebook-1-b"] {
        pod_resources.run_with_claim(
            pod,
            "main",
            ClaimUse {
                namespace: "default".into(),
                name: "notebook-1".into(),
                driver: DRIVER.into(),
                pool: NODE.into(),
                device: "gpu-0".into(),
            },
        );
    }
    let status = driver.status().await;
    let claims = status["claims"].as_array().unwrap();
    assert_eq!(claims.len(), 3, "{status}");
    assert!(claims.iter().all(|c| c["cap_mib"] == 4096), "{status}");
    assert_eq!(status["gpus"][0]["allocated_mib"], 3 * 4096, "{status}");
    assert_eq!(
        claims[0]["containers"],
        json!(["notebook-1-a/main", "notebook-1-b/main"]),
        "{status}"
    );
    assert_eq!(claims[0]["used_mib"], 0, "{status}");
    let table = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["inspect", "-d", "--status-socket"])
        .arg(&driver.status_socket)
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    let row = table
        .lines()
        .find(|l| l.contains("notebook-1 "))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        row.contains("4096") && row.contains("notebook-1-a/main"),
        "{row}"
    );

    // Unprepared: the spec goes at once, the directory after the grace.
    let done = kubelet.unprepare(&refs[..1]).await.unwrap();
    done[&refs[0].uid].as_ref().unwrap();
    assert!(!host.spec_file(&refs[0].uid).exists());
    let dir = host
        .path("state/containers")
        .join(format!("claim-{}", refs[0].uid));
    eventually("the directory to be cleaned up", WAIT, POLL, async || {
        (!dir.exists()).then_some(())
    })
    .await;
    assert!(host.spec_file(&refs[1].uid).exists());
}

/// `gpumem dra` killing a claim's processes over its cap for a second, on
/// a copy of the T4 (returned), pod-resources served by a simulated
/// kubelet, and claim `notebook` (4Gi on gpu-0, UID `uid`, as `edit` leaves
/// it) prepared by a 1.34 kubelet, kept registered while it lives.
async fn killing_driver_with_notebook(
    host: &Host,
    api: &FakeApiServer,
    uid: &str,
    edit: impl FnOnce(&mut Value),
) -> (Driver, PathBuf, KubeletSim, FakeDraKubelet) {
    std::fs::create_dir_all(host.path("kubelet")).unwrap();
    let pod_resources = KubeletSim::start(&host.path("kubelet")).unwrap();
    let socket = pod_resources.pod_resources_socket();
    let (driver, gpus) = Driver::start_killing(host, api, &socket, "t4", "1").await;
    let kubelet = kubelet_1_34(host).await;
    let mut object = claim("notebook", uid, &[("gpu-0", Some("4Gi"), None)]);
    edit(&mut object);
    api.put(object);
    let prepared = kubelet
        .prepare(&[claim_ref("notebook", uid)])
        .await
        .unwrap();
    prepared[uid]
        .as_ref()
        .unwrap_or_else(|e| panic!("{e}\n{}", driver.log()));
    (driver, gpus, pod_resources, kubelet)
}

/// A claim's container takes more than the claim's cap through a process
/// that does not load the shim (found by the claim's directory, mounted in
/// it): the process is killed after the grace period, and the pod whose
/// containers reference the claim gets a Warning Event naming the claim
/// and them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_over_its_cap_loses_its_process_and_its_pod_gets_an_event() {
    use std::os::unix::process::ExitStatusExt;
    const POD_UID: &str = "6c0e5f3a-1b2d-4c8e-9a7f-3d5b1e2c4a60";
    let host = Host::new();
    let api = api().await;
    api.put(json!({
        "kind": "Pod",
        "metadata": {"name": "nb", "namespace": "default", "uid": POD_UID},
        "spec": {"nodeName": NODE, "containers": [{"name": "main"}]},
        "status": {"phase": "Running"},
    }));
    let uid = uid(7);
    let (driver, gpus, pod_resources, _kubelet) =
        killing_driver_with_notebook(&host, &api, &uid, |_| {}).await;
    // Two containers of the pod use the claim: one Event names both.
    for container in ["main", "sidecar"] {
        pod_resources.run_with_claim(
            "nb",
            container,
            ClaimUse {
                namespace: "default".into(),
                name: "notebook".into(),
                driver: DRIVER.into(),
                pool: NODE.into(),
                device: "gpu-0".into(),
            },
        );
    }

    // 5000 MiB of the claim's 4096, in a process with the claim's
    // directory at /var/run/gpumem/claim-<UID>, as the claim's CDI spec
    // mounts it.
    let mut rogue = Command::new("sleep").arg("60").spawn().unwrap();
    let dir = host.path("state/containers").join(format!("claim-{uid}"));
    let mountinfo = common::mountinfo_with_claims(&[&dir]);
    common::list_fake_process(&gpus, rogue.id(), 5000, &[("mountinfo", &mountinfo)]);

    let status = eventually("the over-cap kill", WAIT, POLL, async || {
        rogue.try_wait().unwrap()
    })
    .await;
    assert_eq!(status.signal(), Some(9), "SIGKILL\n{}", driver.log());
    let expected = format!(
        "Killed process {} of ResourceClaim default/notebook (used by containers main, sidecar)",
        rogue.id()
    );
    let event = eventually("the pod's Event", WAIT, POLL, async || {
        api.list(Kind::Event)
            .into_iter()
            .find(|e| e["reason"] == "GPUMemoryOverCap")
    })
    .await;
    let note = event["note"].as_str().unwrap();
    assert!(note.contains(&expected), "{note}");
    assert!(note.contains("the cap of 4096 MiB"), "{note}");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event.pointer("/regarding/uid"), Some(&POD_UID.into()));
    assert_eq!(event.pointer("/regarding/name"), Some(&"nb".into()));
}

/// A claim's escape by shedding mounts: a process of a claim's pod that made a
/// mount namespace of its own and left the claim's directory behind, in a
/// pod where no process holds a slot, is found by its cgroup (the pod the
/// claim was reserved for) and killed over the claim's cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claims_process_that_shed_its_mounts_is_held_by_its_cgroup() {
    use std::os::unix::process::ExitStatusExt;
    const POD_UID: &str = "7d1f6a4b-2c3e-4d9f-8b80-4e6c2f3d5b71";
    let host = Host::new();
    let api = api().await;
    let reserved = |claim: &mut Value| {
        claim["status"]["reservedFor"] =
            json!([{"resource": "pods", "name": "nb", "uid": POD_UID}]);
    };
    let (driver, gpus, _pod_resources, _kubelet) =
        killing_driver_with_notebook(&host, &api, &uid(8), reserved).await;

    // 5000 MiB of the claim's 4096, with no gpumem mount in sight.
    let mut rogue = Command::new("sleep").arg("60").spawn().unwrap();
    let cgroup = format!("0::/kubepods/burstable/pod{POD_UID}/{}\n", "e".repeat(64));
    let pivoted = "1 0 0:40 / / rw - tmpfs tmpfs rw\n";
    common::list_fake_process(
        &gpus,
        rogue.id(),
        5000,
        &[("cgroup", &cgroup), ("mountinfo", pivoted)],
    );
    let status = eventually("the over-cap kill", WAIT, POLL, async || {
        rogue.try_wait().unwrap()
    })
    .await;
    assert_eq!(status.signal(), Some(9), "SIGKILL\n{}", driver.log());
}

/// A pod that comes to share a claim already prepared for another: kubelet
/// does not prepare the claim again for it, so the driver learns it from
/// the claim's `reservedFor` once the pod is on the node. Its process
/// without the shim, with the claim's directory mounted where the claim's
/// CDI spec put it, is the claim's, and is killed over the claim's cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_that_joins_a_prepared_claim_is_held_to_its_cap() {
    use std::os::unix::process::ExitStatusExt;
    const FIRST: &str = "8e2a7b5c-3d4f-4e0a-9c91-5f7d3a4e6c82";
    const JOINER: &str = "9f3b8c6d-4e5a-4f1b-8da2-6a8e4b5f7d93";
    let reserved_for = |pods: &[(&str, &str)]| {
        let refs: Vec<Value> = pods
            .iter()
            .map(|(name, uid)| json!({"resource": "pods", "name": name, "uid": uid}))
            .collect();
        json!(refs)
    };
    let host = Host::new();
    let api = api().await;
    let uid = uid(9);
    let (driver, gpus, _pod_resources, _kubelet) =
        killing_driver_with_notebook(&host, &api, &uid, |claim| {
            claim["status"]["reservedFor"] = reserved_for(&[("nb", FIRST)]);
        })
        .await;
    // The scheduler reserves the claim for a second pod and binds it here.
    let mut object = api.get(Kind::ResourceClaim, "default", "notebook").unwrap();
    object["status"]["reservedFor"] = reserved_for(&[("nb", FIRST), ("nb2", JOINER)]);
    api.put(object);
    api.put(json!({
        "kind": "Pod",
        "metadata": {"name": "nb2", "namespace": "default", "uid": JOINER},
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "main"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "notebook"}],
        },
        "status": {"phase": "Running"},
    }));

    let mut rogue = Command::new("sleep").arg("60").spawn().unwrap();
    let dir = host.path("state/containers").join(format!("claim-{uid}"));
    let cgroup = format!("0::/kubepods/burstable/pod{JOINER}/{}\n", "e".repeat(64));
    common::list_fake_process(
        &gpus,
        rogue.id(),
        5000,
        &[
            ("cgroup", &cgroup),
            ("mountinfo", &common::mountinfo_with_claims(&[&dir])),
        ],
    );
    let status = eventually("the over-cap kill", WAIT, POLL, async || {
        rogue.try_wait().unwrap()
    })
    .await;
    assert_eq!(status.signal(), Some(9), "SIGKILL\n{}", driver.log());
}

/// A container that references two claims, one per GPU, is given both
/// claims' accounting directories (each spec mounts its own at its own
/// path), and the shim in it holds each GPU to its own claim's cap.
#[tokio::test]
async fn a_container_with_two_claims_is_held_to_each_on_its_gpu() {
    const V100: [&str; 2] = [
        "GPU-1a2b3c4d-0000-4000-8000-000000010000",
        "GPU-1a2b3c4d-0000-4000-8000-000000010001",
    ];
    let host = Host::new();
    let api = api().await;
    let driver = Driver::start_on(&host, &api, "v100x2", &[]).await;
    let kubelet = kubelet_1_34(&host).await;
    api.put(claim("train", &uid(1), &[("gpu-0", Some("4Gi"), None)]));
    api.put(claim("scratch", &uid(2), &[("gpu-1", Some("2Gi"), None)]));
    let refs = [claim_ref("train", &uid(1)), claim_ref("scratch", &uid(2))];
    prepare_all(&kubelet, &driver, &refs).await;

    let state = container_state(&host, &refs);
    let (ok, lines, stderr) = common::run_lines(
        common::shim_kit()
            .probe(Some(&state))
            .env("FAKEGPU_UUIDS", V100.join(","))
            .args([
                "ctx:0",
                "alloc:3700",
                "alloc:200",
                "ctx:1",
                "alloc:1700",
                "alloc:100",
            ]),
    );
    assert!(ok, "{stderr}");
    // Each cap less the fake driver's 300 MiB context.
    assert_eq!(
        lines[2..],
        [
            "alloc:3700 0 #0",
            "alloc:200 2 #1",
            "ctx:1 0",
            "alloc:1700 0 #2",
            "alloc:100 2 #3"
        ],
        "{stderr}"
    );
}

/// Claim A caps GPU X; claim B caps X and Y; a container references both.
/// The shim charges the container's use of X to A, the first of its files
/// that caps X, so the over-cap action must hold that use to A's cap
/// alone: B counts only what is B's on X (here a process that mounts B
/// only), and A kills once X's use passes A's cap.
#[tokio::test]
async fn a_gpu_two_of_a_containers_claims_cap_is_held_to_the_first_claims_cap() {
    use std::os::unix::process::ExitStatusExt;
    const X: &str = "GPU-1a2b3c4d-0000-4000-8000-000000010001";
    const Y: &str = "GPU-1a2b3c4d-0000-4000-8000-000000010000";
    let host = Host::new();
    let api = api().await;
    let socket = host.path("no-kubelet.sock");
    let (driver, gpus) = Driver::start_killing(&host, &api, &socket, "v100x2", "0").await;
    let kubelet = kubelet_1_34(&host).await;
    api.put(claim("a", &uid(1), &[("gpu-1", Some("4Gi"), None)]));
    api.put(claim(
        "b",
        &uid(2),
        &[("gpu-1", Some("2Gi"), None), ("gpu-0", Some("2Gi"), None)],
    ));
    let refs = [claim_ref("a", &uid(1)), claim_ref("b", &uid(2))];
    prepare_all(&kubelet, &driver, &refs).await;
    // A process of the container with a context on each GPU: a slot in A
    // (for X) and in B (for Y).
    let state = container_state(&host, &refs);
    let mut shimmed = common::shim_kit()
        .probe(Some(&state))
        .env("FAKEGPU_UUIDS", format!("{X},{Y}"))
        .args(["ctx:0", "ctx:1", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut shimmed, "holding");
    // Beside it, in NVML's list for X (the fixture's last GPU, where
    // listed processes go): 3000 MiB of its own, within A's 4096 but past
    // B's 2048, and a newer process that mounts only B's directory, with
    // 2500 MiB: past B's cap on its own.
    let dir = |n| {
        host.path("state/containers")
            .join(format!("claim-{}", uid(n)))
    };
    let mounts = common::mountinfo_with_claims(&[&dir(1), &dir(2)]);
    common::list_fake_process(&gpus, shimmed.id(), 3000, &[("mountinfo", &mounts)]);
    let mut rogue = Command::new("sleep").arg("60").spawn().unwrap();
    let only_b = common::mountinfo_with_claims(&[&dir(2)]);
    common::list_fake_process(&gpus, rogue.id(), 2500, &[("mountinfo", &only_b)]);

    // Killing the rogue brings B under its cap: one kill in the same
    // check, not two.
    eventually("the rogue's kill", WAIT, POLL, async || {
        rogue.try_wait().unwrap()
    })
    .await;
    // The check that killed it has finished.
    common::daemon::wait_for_checks(driver.metrics, 0).await;
    assert!(
        shimmed.try_wait().unwrap().is_none(),
        "the process within A's cap was killed for B's\n{}",
        driver.log()
    );
    let kills = |log: &str| log.matches("killed a GPU process").count();
    assert_eq!(kills(&driver.log()), 1, "{}", driver.log());

    // Past A's cap: A's action, on the process A holds.
    let text = std::fs::read_to_string(&gpus).unwrap();
    let listed = format!("pid = {}\nused_mib = 3000\n", shimmed.id());
    let raised = text.replace(
        &listed,
        &format!("pid = {}\nused_mib = 5000\n", shimmed.id()),
    );
    assert_ne!(raised, text);
    common::rewrite_fake_gpus(&gpus, raised);
    let status = eventually("the kill past A's cap", WAIT, POLL, async || {
        shimmed.try_wait().unwrap()
    })
    .await;
    assert_eq!(status.signal(), Some(9), "SIGKILL\n{}", driver.log());
    let log = driver.log();
    let last = log
        .lines()
        .rfind(|l| l.contains("killed a GPU process"))
        .unwrap();
    assert!(last.contains(&format!("claim-{}", uid(1))), "{last}");
    assert!(last.contains("cap_mib=4096"), "{last}");
}

#[tokio::test]
async fn where_nvidias_cdi_spec_names_the_gpu_the_claim_gets_it_too() {
    let host = Host::new();
    std::fs::create_dir_all(host.path("cdi")).unwrap();
    // As `nvidia-ctk cdi generate` writes it (YAML, each GPU by index and UUID).
    let nvidia = format!(
        "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: \"0\"\n  containerEdits: \
         {{}}\n- name: {T4_UUID}\n  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n"
    );
    std::fs::write(host.path("cdi/nvidia.yaml"), nvidia).unwrap();
    let api = api().await;
    let driver = Driver::start(&host, &api).await;
    let kubelet = kubelet_1_34(&host).await;
    api.put(claim("c", &uid(1), &[("gpu-0", Some("4Gi"), None)]));
    let prepared = kubelet.prepare(&[claim_ref("c", &uid(1))]).await.unwrap();
    let devices = prepared[&uid(1)]
        .as_ref()
        .unwrap_or_else(|e| panic!("{e}\n{}", driver.log()));
    assert_eq!(
        devices[0].cdi_device_ids,
        [
            format!("gpumem.io/claim={}", uid(1)),
            format!("nvidia.com/gpu={T4_UUID}")
        ]
    );
    // The GPU comes from NVIDIA's spec; the legacy hook must not add it again.
    let spec: Value =
        serde_json::from_slice(&std::fs::read(host.spec_file(&uid(1))).unwrap()).unwrap();
    let env = spec["devices"][0]["containerEdits"]["env"].to_string();
    assert!(env.contains("NVIDIA_VISIBLE_DEVICES=void"), "{env}");

    // A prioritized list's subrequest: kubelet matches containers against
    // the claim's request, so that is the name it must be told.
    let mut listed = claim("listed", &uid(2), &[("gpu-0", Some("2Gi"), None)]);
    listed["status"]["allocation"]["devices"]["results"][0]["request"] = json!("gpu/small");
    api.put(listed);
    let prepared = kubelet
        .prepare(&[claim_ref("listed", &uid(2))])
        .await
        .unwrap();
    assert_eq!(
        prepared[&uid(2)].as_ref().unwrap()[0].request_names,
        ["gpu"]
    );
}

#[tokio::test]
async fn claims_kubelet_must_not_use_are_refused_with_a_reason() {
    let host = Host::new();
    let api = api().await;
    let driver = Driver::start(&host, &api).await;
    let kubelet = FakeDraKubelet::register(&host.registration_socket(), KUBELET_1_33)
        .await
        .unwrap();
    // Deleted and created again under the same name: another UID.
    api.put(claim("recreated", &uid(2), &[("gpu-0", Some("4Gi"), None)]));
    let mut unallocated = claim("pending", &uid(3), &[]);
    unallocated["status"] = json!({});
    api.put(unallocated);
    api.put(claim("elsewhere", &uid(4), &[("gpu-7", Some("4Gi"), None)]));
    let asked = [
        claim_ref("recreated", &uid(1)),
        claim_ref("pending", &uid(3)),
        claim_ref("elsewhere", &uid(4)),
        claim_ref("gone", &uid(5)),
    ];
    let prepared = kubelet.prepare(&asked).await.unwrap();
    let error = |n: u32| prepared[&uid(n)].clone().unwrap_err();
    assert!(
        error(1).contains("deleted and created again"),
        "{}",
        error(1)
    );
    assert!(error(3).contains("is not allocated"), "{}", error(3));
    assert!(
        error(4).contains("gpu-7") && error(4).contains("gpu-0"),
        "{}",
        error(4)
    );
    assert!(error(5).contains("does not exist"), "{}", error(5));
    assert!(!host.spec_file(&uid(1)).exists());
    assert!(driver.log().contains("cannot prepare"));
}

/// A claim prepared by an older version keeps that version's CDI spec while
/// its pods run: kubelet does not prepare it again, it restarts their
/// containers from the CDI ID. A restarted driver writes this version's
/// spec and leaves the live accounting file alone; a claim whose GPU the
/// node no longer lists keeps its spec, and so does one when the shim is
/// off now.
#[tokio::test]
async fn a_restarted_driver_brings_prepared_claims_specs_up_to_date() {
    use std::os::unix::fs::MetadataExt;
    let host = Host::new();
    let api = api().await;
    let (mut driver, _) = driver_with_notebook(&host, &api).await;
    let spec_file = host.spec_file(&uid(1));
    let current = std::fs::read_to_string(&spec_file).unwrap();
    // As versions before claims had their own place wrote it.
    let inside = format!("{}/claim-{}", gpumem_layout::CONTAINER_DIR, uid(1));
    let old = current.replace(&inside, gpumem_layout::CONTAINER_DIR);
    assert_ne!(old, current);
    let accounting = host
        .path("state/containers")
        .join(format!("claim-{}", uid(1)))
        .join(gpumem_layout::FILE_NAME);
    let inode = std::fs::metadata(&accounting).unwrap().ino();

    // Restarted on a node that no longer lists the claim's GPU: kept.
    driver.kill();
    std::fs::write(&spec_file, &old).unwrap();
    let mut driver = Driver::start_on(&host, &api, "v100x2", &[]).await;
    assert_eq!(std::fs::read_to_string(&spec_file).unwrap(), old);
    assert!(
        driver.log().contains("is not on the node any more"),
        "{}",
        driver.log()
    );

    // Restarted without the shim: the claim keeps the isolation it was
    // prepared with.
    driver.kill();
    let mut driver = Driver::start_on(&host, &api, "t4", &["--isolation", "none"]).await;
    assert_eq!(std::fs::read_to_string(&spec_file).unwrap(), old);

    driver.kill();
    let mut driver = Driver::start(&host, &api).await;
    assert_eq!(
        std::fs::read_to_string(&spec_file).unwrap(),
        current,
        "{}",
        driver.log()
    );
    let rewrote = "rewrote the CDI spec of a prepared claim";
    assert!(driver.log().contains(rewrote), "{}", driver.log());
    assert_eq!(std::fs::metadata(&accounting).unwrap().ino(), inode);

    // The spec gone, and the flags changed since the claim's file was made
    // (another context charge): the spec is made again, the live file is
    // not replaced by one with nothing charged.
    driver.kill();
    std::fs::remove_file(&spec_file).unwrap();
    let driver = Driver::start_on(&host, &api, "t4", &["--context-charge-mib", "300"]).await;
    assert_eq!(
        std::fs::read_to_string(&spec_file).unwrap(),
        current,
        "{}",
        driver.log()
    );
    assert_eq!(std::fs::metadata(&accounting).unwrap().ino(), inode);

    // A claim prepared without the shim keeps that under the shim too.
    drop(driver);
    let mut driver = Driver::start_on(&host, &api, "t4", &["--isolation", "none"]).await;
    let kubelet = kubelet_1_34(&host).await;
    api.put(claim("bare", &uid(2), &[("gpu-0", Some("2Gi"), None)]));
    let prepared = kubelet
        .prepare(&[claim_ref("bare", &uid(2))])
        .await
        .unwrap();
    prepared[&uid(2)].as_ref().unwrap();
    let bare = std::fs::read_to_string(host.spec_file(&uid(2))).unwrap();
    driver.kill();
    let driver = Driver::start(&host, &api).await;
    assert_eq!(
        std::fs::read_to_string(host.spec_file(&uid(2))).unwrap(),
        bare,
        "{}",
        driver.log()
    );
    let bare_dir = host
        .path("state/containers")
        .join(format!("claim-{}", uid(2)));
    assert!(!bare_dir.join(gpumem_layout::FILE_NAME).exists());
}

#[tokio::test]
async fn a_restarted_driver_unprepares_from_its_checkpoint_and_drops_another_boots() {
    let host = Host::new();
    let api = api().await;
    let (driver, refs, prepared) = driver_with_two_claims(&host, &api).await;

    // Killed; the claim deleted meanwhile: unprepare needs only the record.
    let (driver, kubelet) = driver
        .restart(&host, &api, || {
            api.delete(Kind::ResourceClaim, "default", "c1");
        })
        .await;
    let again = kubelet.prepare(&refs[1..]).await.unwrap();
    assert_eq!(again[&uid(2)], prepared[&uid(2)], "the record answers");
    let done = kubelet.unprepare(&refs[..1]).await.unwrap();
    done[&uid(1)].as_ref().unwrap();
    assert!(!host.spec_file(&uid(1)).exists());
    let record = host.record();
    assert!(record["claims"].get(uid(1)).is_none(), "{record}");
    assert!(record["claims"].get(uid(2)).is_some(), "{record}");
    drop(driver);

    // The record says another boot wrote it: everything in it is stale.
    let mut record = record;
    record["bootId"] = json!("00000000-0000-0000-0000-000000000000");
    host.write_record(&record);
    let driver = Driver::start(&host, &api).await;
    eventually("the stale spec to go", WAIT, POLL, async || {
        (!host.spec_file(&uid(2)).exists()).then_some(())
    })
    .await;
    let record = host.record();
    assert!(record["claims"].get(uid(2)).is_none(), "{record}");
    assert!(driver.log().contains("rebooted"), "{}", driver.log());
}

#[tokio::test]
async fn a_node_runs_one_front_end() {
    let host = Host::new();
    let api = api().await;
    api.write_kubeconfig(&host.path("kubeconfig")).unwrap();
    let lock = host.path("state");
    std::fs::create_dir_all(&lock).unwrap();
    let file = std::fs::File::create(lock.join("front-end.lock")).unwrap();
    let _held = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| e)
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args([
            "dra",
            "--node-name",
            NODE,
            "--metrics-addr",
            "",
            "--status-socket",
            "",
        ])
        .arg("--fake-gpus")
        .arg(fixture("t4"))
        .arg("--state-dir")
        .arg(&lock)
        .arg("--kubeconfig")
        .arg(host.path("kubeconfig"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("another gpumem front end"), "{stderr}");
}

#[tokio::test]
async fn a_prepare_cut_off_by_a_crash_is_rolled_back_at_start() {
    let host = Host::new();
    let api = api().await;
    // What a driver killed between recording and finishing a prepare leaves:
    // the entry `Started` and the spec already written.
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    std::fs::create_dir_all(host.checkpoint().parent().unwrap()).unwrap();
    let record = json!({
        "version": 1,
        "bootId": boot_id.trim(),
        "claims": {uid(7): {
            "namespace": "default",
            "name": "cut-off",
            "state": "Started",
            "dir": format!("claim-{}", uid(7)),
            "cdiDevice": uid(7),
            "devices": [],
        }},
    });
    host.write_record(&record);
    std::fs::create_dir_all(host.path("cdi")).unwrap();
    std::fs::write(host.spec_file(&uid(7)), b"{}").unwrap();
    // And specs no record names: one written before the node booted (a
    // roll-back cut off by the reboot), and one since (its record lost:
    // its pods may still run).
    std::fs::write(host.spec_file(&uid(8)), b"{}").unwrap();
    std::fs::File::options()
        .write(true)
        .open(host.spec_file(&uid(8)))
        .unwrap()
        .set_modified(std::time::UNIX_EPOCH + Duration::from_secs(1))
        .unwrap();
    std::fs::write(host.spec_file(&uid(9)), b"{}").unwrap();
    // Not ours: left alone.
    std::fs::write(host.path("cdi/nvidia.yaml"), b"kind: nvidia.com/gpu\n").unwrap();

    let driver = Driver::start(&host, &api).await;
    eventually("the half-made spec to go", WAIT, POLL, async || {
        (!host.spec_file(&uid(7)).exists()).then_some(())
    })
    .await;
    let record = host.record();
    assert!(record["claims"].get(uid(7)).is_none(), "{record}");
    assert!(driver.log().contains("interrupted"), "{}", driver.log());
    assert!(!host.spec_file(&uid(8)).exists());
    assert!(host.spec_file(&uid(9)).exists());
    assert!(host.path("cdi/nvidia.yaml").exists());

    // Prepared afresh when kubelet asks again.
    api.put(claim("cut-off", &uid(7), &[("gpu-0", Some("4Gi"), None)]));
    let kubelet = kubelet_1_34(&host).await;
    let prepared = kubelet
        .prepare(&[claim_ref("cut-off", &uid(7))])
        .await
        .unwrap();
    prepared[&uid(7)].as_ref().unwrap();
    assert!(host.spec_file(&uid(7)).exists());
}

#[tokio::test]
async fn after_a_downgrade_a_claim_in_a_newer_state_is_prepared_again() {
    let host = Host::new();
    let api = api().await;
    let (driver, prepared) = driver_with_notebook(&host, &api).await;
    let refs = [claim_ref("nb", &uid(1))];

    // A newer version recorded a state this one does not know.
    let (driver, kubelet) = driver
        .restart(&host, &api, || {
            host.edit_record(|record| record["claims"][uid(1)]["state"] = json!("Resizing"));
        })
        .await;
    let again = kubelet.prepare(&refs).await.unwrap();
    assert_eq!(again[&uid(1)], prepared[&uid(1)], "{}", driver.log());
    let record = host.record();
    assert_eq!(record["claims"][uid(1)]["state"], "Completed", "{record}");
}

#[tokio::test]
async fn an_unreadable_checkpoint_entry_costs_only_its_own_claim() {
    let host = Host::new();
    let api = api().await;
    let (mut driver, refs, prepared) = driver_with_two_claims(&host, &api).await;

    // A hand edit breaks one entry while the driver is down.
    driver.kill();
    let broken = host.edit_record(|record| {
        record["claims"][uid(1)]["state"] = json!(7);
        record["claims"][uid(1)].clone()
    });
    let driver = Driver::start(&host, &api).await;
    let kubelet = kubelet_1_34(&host).await;

    // The other claim is answered from its entry, and the broken one is
    // kept as it was: the file was not moved aside.
    let again = kubelet.prepare(&refs[1..]).await.unwrap();
    assert_eq!(again[&uid(2)], prepared[&uid(2)], "{}", driver.log());
    let record = host.record();
    assert_eq!(record["claims"][uid(1)], broken, "{record}");
    assert!(
        driver
            .log()
            .contains("an entry of the DRA checkpoint does not read"),
        "{}",
        driver.log()
    );
    // Both claims' containers can still restart.
    assert!(host.spec_file(&uid(1)).exists(), "{}", driver.log());
    assert!(host.spec_file(&uid(2)).exists(), "{}", driver.log());

    // kubelet's Unprepare removes the broken claim's spec and entry.
    let done = kubelet.unprepare(&refs[..1]).await.unwrap();
    done[&uid(1)].as_ref().unwrap();
    assert!(!host.spec_file(&uid(1)).exists(), "{}", driver.log());
    let record = host.record();
    assert!(record["claims"].get(uid(1)).is_none(), "{record}");
    assert!(record["claims"].get(uid(2)).is_some(), "{record}");
}

/// A checkpoint that does not parse loses the records, not the claims: their
/// pods still run, and kubelet (which has them as prepared) hands the same
/// CDI devices to the runtime at every container restart without preparing
/// them again. Their specs stay, and kubelet's Unprepare removes each.
#[tokio::test]
async fn a_corrupt_checkpoint_keeps_the_files_of_prepared_claims_until_unprepare() {
    let reported = "started a new DRA checkpoint";
    without_a_readable_checkpoint(reported, |checkpoint| {
        std::fs::write(checkpoint, b"{\"version\":1,\"bootId\":").unwrap()
    })
    .await;
}

#[tokio::test]
async fn a_missing_checkpoint_keeps_the_files_of_prepared_claims_until_unprepare() {
    let reported = "no DRA checkpoint, but CDI specs of claims are there";
    without_a_readable_checkpoint(reported, |checkpoint| {
        std::fs::remove_file(checkpoint).unwrap()
    })
    .await;
}

/// The driver restarts and finds its checkpoint `damage`d: the prepared
/// claim's pods may still run, and kubelet restarts their containers from
/// the CDI ID without preparing it again, so its spec stays, and so does
/// the directory the spec mounts (past the clean-up's grace, though no
/// process holds it), until kubelet unprepares it.
async fn without_a_readable_checkpoint(reported: &str, damage: impl FnOnce(&Path)) {
    let host = Host::new();
    let api = api().await;
    let (driver, _) = driver_with_notebook(&host, &api).await;
    assert!(host.spec_file(&uid(1)).exists());
    let dir = host
        .path("state/containers")
        .join(format!("claim-{}", uid(1)));
    assert!(dir.is_dir());

    let (driver, kubelet) = driver
        .restart(&host, &api, || damage(&host.checkpoint()))
        .await;
    eventually("the checkpoint to be reported", WAIT, POLL, async || {
        driver.log().contains(reported).then_some(())
    })
    .await;
    assert!(
        host.spec_file(&uid(1)).exists(),
        "the prepared claim's CDI spec was removed: its containers cannot restart\n{}",
        driver.log()
    );
    common::swept_twice_past_the_grace(&host.path("state")).await;
    assert!(
        dir.is_dir(),
        "the directory the claim's spec mounts was removed\n{}",
        driver.log()
    );
    // Restarted again (a rollout, say): the checkpoint it wrote names no
    // claim, and the files stay all the same.
    drop(kubelet);
    let (driver, kubelet) = driver.restart(&host, &api, || ()).await;
    assert!(
        host.spec_file(&uid(1)).exists(),
        "the second start removed the spec\n{}",
        driver.log()
    );
    common::swept_twice_past_the_grace(&host.path("state")).await;
    assert!(dir.is_dir(), "{}", driver.log());

    let unprepared = kubelet
        .unprepare(&[claim_ref("nb", &uid(1))])
        .await
        .unwrap();
    unprepared[&uid(1)].as_ref().unwrap();
    assert!(!host.spec_file(&uid(1)).exists(), "{}", driver.log());
    eventually("the directory's clean-up", WAIT, POLL, async || {
        (!dir.exists()).then_some(())
    })
    .await;
}

/// Health per `<pool>/<device>` as kubelet keys it: the node's two GPUs,
/// `gpu-0` and `gpu-1` in pool `NODE`, as the slice names them.
fn v100x2_health(gpu0: HealthStatus, gpu1: HealthStatus) -> BTreeMap<String, HealthStatus> {
    BTreeMap::from([
        (format!("{NODE}/gpu-0"), gpu0),
        (format!("{NODE}/gpu-1"), gpu1),
    ])
}

/// Writes the two-V100 node file at `path` with GPU 1 `healthy` or not, as
/// an operator (or tests/health.rs) marks a fake GPU sick.
fn write_v100x2(path: &Path, gpu1_healthy: bool) {
    let text = std::fs::read_to_string(fixture("v100x2")).unwrap();
    std::fs::write(path, format!("{text}healthy = {gpu1_healthy}\n")).unwrap();
}

/// Reads `stream` until a message says `want` (the driver also repeats the
/// whole list now and then, so kubelet does not time its devices out).
async fn health_becomes(
    stream: &mut HealthStream,
    want: &BTreeMap<String, HealthStatus>,
    driver: &Driver,
) {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let got = stream
            .next_health(left)
            .await
            .unwrap_or_else(|e| panic!("waiting for {want:?}: {e}\n{}", driver.log()))
            .unwrap_or_else(|| panic!("the stream ended; log:\n{}", driver.log()));
        if &got == want {
            return;
        }
    }
}

/// kubelet (`ResourceHealthStatus`, on by default from 1.36) calls
/// NodeWatchResources on the DRA socket and puts what it hears in the status
/// of pods whose claims hold the device. From 1.37 it calls only a health
/// service the registration lists, and prefers v1.
#[tokio::test]
async fn device_health_reaches_kubelet_at_once_and_on_every_change() {
    let host = Host::new();
    let api = api().await;
    let gpus = host.path("node.toml");
    write_v100x2(&gpus, true);
    let sock = host.path("no-kubelet.sock");
    let driver = Driver::start_custom(&host, &api, &sock, &gpus, &["--reconcile-secs", "0"]).await;
    let kubelet = FakeDraKubelet::register(&host.registration_socket(), KUBELET_1_37)
        .await
        .unwrap();
    assert_eq!(kubelet.health_version(), Some(HealthVersion::V1));
    let mut health = kubelet
        .watch_resources()
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", driver.log()));

    // At once: every device, healthy, named as in the slice.
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let first = health
        .next(WAIT)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", driver.log()))
        .expect("the stream ended before its first message");
    let healthy = v100x2_health(HealthStatus::Healthy, HealthStatus::Healthy);
    assert_eq!(health_of(&first), healthy);
    for device in &first.devices {
        let when = u64::try_from(device.last_updated_time).unwrap();
        assert!(
            when > 0 && when <= before + 60,
            "last updated {when}, now {before}"
        );
    }
    let slice = eventually("our slice", WAIT, POLL, async || our_slice(&api)).await;
    assert_eq!(slice["spec"]["pool"]["name"], NODE);
    let published: Vec<String> = slice["spec"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| format!("{NODE}/{}", d["name"].as_str().unwrap()))
        .collect();
    assert_eq!(published, healthy.keys().cloned().collect::<Vec<_>>());

    // GPU 1 turns sick in the fake GPU file: kubelet hears it, though the
    // slice withdraws the device.
    write_v100x2(&gpus, false);
    let sick = v100x2_health(HealthStatus::Healthy, HealthStatus::Unhealthy);
    health_becomes(&mut health, &sick, &driver).await;
    // And again when it recovers.
    write_v100x2(&gpus, true);
    health_becomes(&mut health, &healthy, &driver).await;
}

/// Both DRAPlugin versions and both DRAResourceHealth versions share the
/// one DRA socket: kubelets 1.37 (v1 health, as registration offers it),
/// 1.34 and 1.33 (v1alpha1, unasked) each hear the devices' health,
/// whichever DRAPlugin version they chose; on shutdown the stream ends
/// cleanly (kubelet dials again), not with an error.
#[tokio::test]
async fn device_health_is_served_to_v1_and_v1beta1_kubelets_until_shutdown() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;

    let host = Host::new();
    let api = api().await;
    let gpus = host.path("node.toml");
    write_v100x2(&gpus, false);
    let sock = host.path("no-kubelet.sock");
    let mut driver =
        Driver::start_custom(&host, &api, &sock, &gpus, &["--reconcile-secs", "0"]).await;
    let sick = v100x2_health(HealthStatus::Healthy, HealthStatus::Unhealthy);
    let mut streams = Vec::new();
    for (known, version, health) in [
        (KUBELET_1_37, DraVersion::V1, HealthVersion::V1),
        (KUBELET_1_34, DraVersion::V1, HealthVersion::V1alpha1),
        (KUBELET_1_33, DraVersion::V1beta1, HealthVersion::V1alpha1),
    ] {
        let kubelet = FakeDraKubelet::register(&host.registration_socket(), known)
            .await
            .unwrap();
        assert_eq!(kubelet.version(), version);
        assert_eq!(kubelet.health_version(), Some(health), "{version:?}");
        let mut stream = kubelet
            .watch_resources()
            .await
            .unwrap_or_else(|e| panic!("{version:?}: {e}\n{}", driver.log()));
        let first = stream.next_health(WAIT).await.unwrap();
        assert_eq!(first.as_ref(), Some(&sick), "{version:?}");
        streams.push((version, stream));
    }

    kill(Pid::from_raw(driver.child.id() as i32), Signal::SIGTERM).unwrap();
    for (version, mut stream) in streams {
        // Repeats may still arrive before the end.
        loop {
            match stream.next(WAIT).await {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(err) => panic!("{version:?}: {err}\n{}", driver.log()),
            }
        }
    }
    let status = driver.child.wait().unwrap();
    assert!(status.success(), "{status}\n{}", driver.log());
}

/// A claim's tenant filling its state: a tenant that writes all it can into its
/// claim's directory (a file beside the accounting file, and the file
/// grown) fills only a bounded tmpfs of its own. The next claim is still
/// prepared (its accounting file and the checkpoint written), its
/// container's process is capped by the real shim, and the state dir's
/// file system keeps its space.
#[tokio::test]
async fn a_tenant_filling_its_claims_directory_cannot_fail_the_next_prepare() {
    if !common::root() {
        eprintln!("skipped: the driver mounts, which needs root (CI runs as root)");
        return;
    }
    let host = Host::new();
    let api = api().await;
    let driver = Driver::start_bounded(&host, &api).await;
    let pid = driver.child.id();
    let kubelet = kubelet_1_34(&host).await;
    let state = host.path("state");
    let before = common::free_bytes(pid, &state);
    let dir = |n: u32| format!("{}/containers/claim-{}", state.display(), uid(n));

    api.put(claim("a", &uid(1), &[("gpu-0", Some("4Gi"), None)]));
    prepare_all(&kubelet, &driver, &[claim_ref("a", &uid(1))]).await;
    let (_, out, err) = common::in_container(
        pid,
        &dir(1),
        "cat /dev/zero > /run/gpumem/fill
         cat /dev/zero >> /run/gpumem/accounting",
    );
    assert!(err.contains("No space left on device"), "{out}{err}");

    api.put(claim("b", &uid(2), &[("gpu-0", Some("4Gi"), None)]));
    prepare_all(&kubelet, &driver, &[claim_ref("b", &uid(2))]).await;
    let (ok, out, err) = common::in_container(
        pid,
        &dir(2),
        "env -i LD_LIBRARY_PATH=\"$FAKE\" LD_PRELOAD=\"$SHIM\" \
         GPUMEM_STATE_DIR=/run/gpumem \"$PROBE\" info alloc:3600 alloc:600",
    );
    assert!(ok, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(common::field(lines[1], "total"), 4096 << 20, "{out}");
    assert_eq!(lines[2..], ["alloc:3600 0 #0", "alloc:600 2 #1"], "{out}");

    let lost = before.saturating_sub(common::free_bytes(pid, &state));
    assert!(
        lost < 512 << 10,
        "the state dir lost {lost} bytes\n{}",
        driver.log()
    );
}

/// A node started with gpumem's startup taint (Karpenter's `startupTaints`)
/// keeps it while the driver cannot publish its ResourceSlice, and loses it
/// once the slice offers the GPU; the node's other taints stay.
#[tokio::test]
async fn the_startup_taint_goes_once_the_slice_offers_the_gpus() {
    let host = Host::new();
    let api = api().await;
    let dedicated = json!({"key": "dedicated", "value": "gpu", "effect": "NoSchedule"});
    let mut node = api.get(Kind::Node, "", NODE).unwrap();
    node["spec"] = json!({"taints": [
        {"key": "gpumem.io/not-ready", "effect": "NoSchedule"},
        dedicated,
    ]});
    api.put(node);
    api.forbid(Kind::ResourceSlice, true);
    let driver = Driver::start(&host, &api).await;
    let taints = || api.get(Kind::Node, "", NODE).unwrap()["spec"]["taints"].clone();
    let slice_reads = || {
        api.requests()
            .iter()
            .filter(|r| r.starts_with("GET /apis/resource.k8s.io/v1/resourceslices"))
            .count()
    };
    eventually(
        "the driver's tries to read its slice",
        WAIT,
        POLL,
        async || (slice_reads() >= 2).then_some(()),
    )
    .await;
    assert!(our_slice(&api).is_none());
    assert_eq!(
        taints().as_array().map(Vec::len),
        Some(2),
        "{}",
        driver.log()
    );

    api.forbid(Kind::ResourceSlice, false);
    // The driver says so once the API server has answered its write, a
    // moment after the write shows.
    eventually("the startup taint to go", WAIT, POLL, async || {
        (taints() == json!([dedicated]) && driver.log().contains("removed the startup taint"))
            .then_some(())
    })
    .await;
    assert!(our_slice(&api).is_some());
    assert!(
        driver.log().contains("removed the startup taint"),
        "{}",
        driver.log()
    );
}

/// The chart's dashboard for a DRA node, against a real Prometheus
/// scraping `gpumem dra`: claim `nb` (4Gi on the T4) whose container's
/// process holds 1000 MiB after one allocation its cap refused, and a
/// process of another pod on the GPU. Each query of the rows the DRA
/// driver fills (nodes, GPUs, claims) answers with the claim's and the
/// node's series, the variables offer the node and the claim's namespace,
/// and the figures are the claim's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dra_dashboard_query_returns_its_series() {
    use common::prometheus::{check_dashboard, static_scrape, Prometheus, DRA_ROWS};
    let host = Host::new();
    let api = api().await;
    // The T4 with NVML's sensors, and a stranger's process on it.
    let stranger_cgroup = format!(
        "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/\
         cri-containerd-{}.scope\n",
        "0a1b2c3d_4e5f_4678_9abc_def012345678",
        "b".repeat(64)
    );
    let gpus = host.path("node.toml");
    let base = std::fs::read_to_string(fixture("t4")).unwrap();
    std::fs::write(
        &gpus,
        format!(
            "{base}utilization_percent = 87\ntemperature_celsius = 64\npower_watts = 70\n\
             [[gpu.process]]\npid = 900003\nused_mib = 200\nsm_percent = 15\n\
             cgroup = {stranger_cgroup:?}\n"
        ),
    )
    .unwrap();
    let no_kubelet = host.path("no-kubelet.sock");
    let flags = ["--reconcile-secs", "1"];
    let driver = Driver::start_custom(&host, &api, &no_kubelet, &gpus, &flags).await;
    let kubelet = kubelet_1_34(&host).await;
    api.put(claim("nb", &uid(1), &[("gpu-0", Some("4Gi"), None)]));
    let refs = [claim_ref("nb", &uid(1))];
    prepare_all(&kubelet, &driver, &refs).await;
    let state = container_state(&host, &refs);
    let mut holder = common::Killed(
        common::shim_kit()
            .probe(Some(&state))
            .args(["alloc:1000", "alloc:5000", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    common::wait_for_line(&mut holder, "holding");

    let dir = host.path("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    let prometheus = Prometheus::start(&dir, &static_scrape(driver.metrics.port()));
    let logs = || {
        format!(
            "driver:\n{}\nprometheus:\n{}",
            driver.log(),
            prometheus.log()
        )
    };
    check_dashboard(
        &prometheus,
        DRA_ROWS,
        &[("claim", "nb"), ("Hostname", NODE)],
        &[("node", NODE), ("namespace", "default")],
        logs,
    )
    .await;

    // The claim's figures: its cap counted on its GPU, the holder's use
    // (1000 MiB and the fake driver's 300 MiB context), the refusal, and
    // the API server's consumable capacity kept.
    for (expr, expected) in [
        ("gpumem_claim_cap_bytes", "4294967296"),
        ("gpumem_gpu_allocated_bytes", "4294967296"),
        ("gpumem_claim_used_bytes", "1363148800"),
        ("gpumem_claim_peak_bytes", "1363148800"),
        ("gpumem_claim_refused_allocations_total", "1"),
        ("gpumem_dra_consumable_capacity", "1"),
    ] {
        let series = prometheus.query(expr).await;
        assert_eq!(series.len(), 1, "{expr}: {series:?}\n{}", logs());
        assert_eq!(series[0]["@value"], expected, "{expr}: {series:?}");
    }
}
