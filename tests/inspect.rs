//! `gpumem inspect`: from the plugin's status socket or else the node, with
//! or without kubelet's pod-resources API.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::daemon::{gpumem_stdout, shim, Daemon};
use common::wait::{eventually_blocking, POLL};
use common::{shim_kit, RESOURCE};
use gpumem::isolation::inject::Isolation;
use gpumem::ops::status::NodeStatus;

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
    assert!(!from_plugin.contains("not registered"), "{from_plugin}");
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
    // Read without a plugin, nothing is known of its registration.
    assert!(!direct.contains("not registered"), "{direct}");
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

/// A plugin no kubelet has registered (kubelet not running, or its socket
/// elsewhere): the table says so, for it is why the node advertises nothing.
#[test]
fn inspect_says_when_the_plugin_is_not_registered_with_kubelet() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("status.sock");
    // No kubelet.sock in its kubelet directory: it waits for one.
    let _plugin = common::Killed(
        common::gpumem_cmd()
            .args(["plugin", "--isolation", "none", "--metrics-addr", ""])
            .arg("--kubelet-dir")
            .arg(dir.path())
            .arg("--fake-gpus")
            .arg(common::fixture("t4"))
            .arg("--status-socket")
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    eventually_blocking("the status socket", common::WAIT, POLL, || {
        socket.exists().then_some(()).ok_or("no status socket")
    });
    let table = gpumem_stdout(&["inspect", "--status-socket", socket.to_str().unwrap()]);
    assert!(
        table.contains(
            "warning: not registered with kubelet: the node advertises no aliyun.com/gpu-mem"
        ),
        "{table}"
    );
}
