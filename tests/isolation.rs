//! The plugin's half of isolation: what Allocate mounts and writes, and the
//! shim enforcing the result in a real process.

mod common;

use std::process::Stdio;

use common::{field, run_lines, shim_kit, Killed, Node, MIB, RESOURCE, WAIT};
use gpumem::deviceplugin::api::deviceplugin::{AllocateRequest, ContainerAllocateRequest};
use gpumem::isolation::inject::{Isolation, ShimConfig};
use gpumem::isolation::statefs::StateFs;
use gpumem_testkit::simulator::AdmissionError;
use gpumem_testkit::simulator::KubeletSim;
use tonic::Code;

fn shim_isolation(host: &std::path::Path, state: &std::path::Path) -> Isolation {
    Isolation::Shim(ShimConfig {
        host_dir: host.to_owned(),
        state_dir: state.to_owned(),
        context_charge_mib: 0,
        state_fs: StateFs::Shared,
    })
}

#[tokio::test]
async fn allocate_mounts_the_shim_and_a_private_accounting_directory() {
    let host = common::installed_shim();
    let state = tempfile::tempdir().unwrap();
    let node = Node::with_isolation("t4", shim_isolation(host.path(), state.path())).await;
    node.devices().await;

    let first = node
        .kubelet()
        .admit("nb-1", "main", RESOURCE, 4)
        .await
        .unwrap();
    let second = node
        .kubelet()
        .admit("nb-2", "main", RESOURCE, 4)
        .await
        .unwrap();
    let response = &first.response;
    assert_eq!(response.envs["GPUMEM_STATE_DIR"], "/var/run/gpumem");
    assert_eq!(response.envs["GPUMEM_LIMIT_MIB"], "4308");

    let mounts: Vec<_> = response
        .mounts
        .iter()
        .map(|m| (m.container_path.as_str(), m.host_path.clone(), m.read_only))
        .collect();
    assert_eq!(mounts.len(), 3, "{mounts:?}");
    assert_eq!(
        mounts[0],
        (
            "/usr/local/gpumem/libgpumem_shim.so",
            host.path().join("libgpumem_shim.so").display().to_string(),
            true
        )
    );
    assert_eq!(
        mounts[1],
        (
            "/etc/ld.so.preload",
            host.path().join("ld.so.preload").display().to_string(),
            true
        )
    );
    let (path, state_host, read_only) = &mounts[2];
    assert_eq!((*path, *read_only), ("/var/run/gpumem", false));
    assert!(state_host.starts_with(&state.path().join("containers").display().to_string()));
    let other = &second.response.mounts[2].host_path;
    assert_ne!(state_host, other, "each container has its own accounting");

    // What the container's processes will see: the shim against that directory.
    let (ok, lines, stderr) = run_lines(
        shim_kit()
            .probe(Some(std::path::Path::new(state_host)))
            .args(["info", "alloc:4000", "alloc:400"]),
    );
    assert!(ok, "{stderr}");
    assert_eq!(field(&lines[1], "total"), 4308 * MIB);
    assert_eq!(lines[2..], ["alloc:4000 0 #0", "alloc:400 2 #1"]);
    node.stop().await;
}

#[tokio::test]
async fn allocate_refuses_rather_than_run_a_container_uncapped() {
    let host = tempfile::tempdir().unwrap();
    let state = tempfile::tempdir().unwrap();
    let node = Node::with_isolation("t4", shim_isolation(host.path(), state.path())).await;
    node.devices().await;

    let err = node
        .kubelet()
        .admit("nb-1", "main", RESOURCE, 4)
        .await
        .unwrap_err();
    let AdmissionError::Allocate(status) = err else {
        panic!("{err}")
    };
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(
        status.message().contains("libgpumem_shim.so is missing"),
        "{}",
        status.message()
    );
    assert!(status
        .message()
        .contains(&host.path().display().to_string()));

    // Once installed, the same plugin serves the next pod.
    std::fs::copy(&shim_kit().shim, host.path().join("libgpumem_shim.so")).unwrap();
    std::fs::write(
        host.path().join("ld.so.preload"),
        "/usr/local/gpumem/libgpumem_shim.so\n",
    )
    .unwrap();
    node.kubelet()
        .admit("nb-2", "main", RESOURCE, 4)
        .await
        .unwrap();
    node.stop().await;
}

/// Allocate answers for every container or none: one container's bad IDs
/// must not leave another's accounting directory behind.
#[tokio::test]
async fn an_allocate_with_one_bad_container_writes_nothing() {
    let host = common::installed_shim();
    let state = tempfile::tempdir().unwrap();
    let node = Node::with_isolation("t4", shim_isolation(host.path(), state.path())).await;
    let devices = node.devices().await;
    let err = node
        .client()
        .await
        .allocate(AllocateRequest {
            container_requests: vec![
                ContainerAllocateRequest {
                    devices_ids: vec![devices[0].id.clone()],
                },
                ContainerAllocateRequest {
                    devices_ids: vec!["deadbeef-3".into()],
                },
            ],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err}");
    let containers = state.path().join("containers");
    let written: Vec<_> = std::fs::read_dir(&containers)
        .map(|dir| dir.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(written.is_empty(), "left behind: {written:?}");
    node.stop().await;
}

#[tokio::test]
async fn isolation_none_leaves_enforcement_to_others() {
    let node = Node::with_isolation("t4", Isolation::None).await;
    node.devices().await;
    let allocation = node
        .kubelet()
        .admit("nb", "main", RESOURCE, 4)
        .await
        .unwrap();
    assert!(allocation.response.mounts.is_empty());
    assert!(!allocation.response.envs.contains_key("GPUMEM_STATE_DIR"));
    assert_eq!(
        allocation.response.envs["ALIYUN_COM_GPU_MEM_CONTAINER"],
        "4"
    );
    node.stop().await;
}

/// The real `gpumem plugin` for the tests where it mounts: kubelet's
/// directory, the shim installed, a state dir, the simulated kubelet, and
/// the plugin's command line for them, to be run in a mount namespace.
struct Mounting {
    kubelet_dir: tempfile::TempDir,
    _host: tempfile::TempDir,
    state: tempfile::TempDir,
    kubelet: KubeletSim,
    plugin: std::process::Command,
}

impl Mounting {
    /// `None`, said, where not root: the plugin mounts (CI runs as root).
    fn new() -> Option<Mounting> {
        if !common::root() {
            eprintln!("skipped: the plugin mounts, which needs root (CI runs as root)");
            return None;
        }
        let kubelet_dir = tempfile::tempdir().unwrap();
        let host = common::installed_shim();
        let state = tempfile::tempdir().unwrap();
        let kubelet = KubeletSim::start(kubelet_dir.path()).unwrap();
        let plugin = common::shim_plugin(kubelet_dir.path(), &kubelet, host.path(), state.path());
        Some(Mounting {
            kubelet_dir,
            _host: host,
            state,
            kubelet,
            plugin,
        })
    }

    fn log(&self) -> std::path::PathBuf {
        self.kubelet_dir.path().join("plugin.log")
    }

    fn logs(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }

    /// Runs `cmd`, the plugin's command line as a test wraps it, with its
    /// log where [`Mounting::logs`] reads it.
    fn spawn(&self, cmd: &mut std::process::Command) -> Killed {
        let log = std::fs::File::create(self.log()).unwrap();
        Killed(cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap())
    }

    async fn registered(&self) {
        if self
            .kubelet
            .wait_for_devices(RESOURCE, 1, WAIT)
            .await
            .is_none()
        {
            panic!("the plugin did not register: {}", self.logs());
        }
    }
}

/// A tenant filling its state directory: one that writes all it can into its state
/// directory (a file beside the accounting file, and the accounting file
/// grown) fills only a bounded file system of its own. The next pod's
/// Allocate still writes its accounting file, its process is capped by the
/// real shim, and the state dir's file system keeps its space. The real
/// `gpumem plugin`, as root (it mounts), in a mount namespace of its own
/// whose state dir is a 4 MiB tmpfs shared as a Bidirectional volume is.
#[tokio::test]
async fn a_tenant_filling_its_state_directory_cannot_fail_the_next_allocate() {
    let Some(m) = Mounting::new() else { return };
    let (kubelet, state) = (&m.kubelet, m.state.path());
    let plugin = m.spawn(&mut common::with_bounded_state(&m.plugin, state));
    let pid = plugin.id();
    let logs = || m.logs();
    m.registered().await;
    let before = common::free_bytes(pid, state);

    let first = kubelet.admit("nb-1", "main", RESOURCE, 4).await.unwrap();
    let (_, out, err) = common::in_container(
        pid,
        &first.response.mounts[2].host_path,
        "cat /dev/zero > /run/gpumem/fill
         cat /dev/zero >> /run/gpumem/accounting
         ls -l /run/gpumem",
    );
    assert!(err.contains("No space left on device"), "{out}{err}");

    let second = kubelet
        .admit("nb-2", "main", RESOURCE, 4)
        .await
        .unwrap_or_else(|err| panic!("nb-2 not admitted: {err}\n{}", logs()));
    let (ok, out, err) = common::in_container(
        pid,
        &second.response.mounts[2].host_path,
        "env -i LD_LIBRARY_PATH=\"$FAKE\" LD_PRELOAD=\"$SHIM\" \
         GPUMEM_STATE_DIR=/run/gpumem \"$PROBE\" info alloc:4000 alloc:400",
    );
    assert!(ok, "{out}{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(field(lines[1], "total"), 4308 * MIB, "{out}");
    assert_eq!(lines[2..], ["alloc:4000 0 #0", "alloc:400 2 #1"], "{out}");

    // nb-1 wrote no more than its own bounded tmpfs holds (two accounting
    // files' worth); the state dir lost only the files Allocate wrote.
    let lost = before.saturating_sub(common::free_bytes(pid, state));
    assert!(
        lost < 512 << 10,
        "the state dir lost {lost} bytes\n{}",
        logs()
    );
    assert!(
        logs().contains("each container's state directory is a tmpfs of its own"),
        "{}",
        logs()
    );
    drop(plugin);
}

/// Where the daemon's mounts would not reach the runtime (a state volume
/// without `mountPropagation: Bidirectional`), `--bound-state-dirs require`
/// refuses to start, naming why; `auto` starts unbounded and says so.
#[tokio::test]
async fn bounded_state_dirs_are_refused_or_said_where_mounts_would_not_reach_the_host() {
    let Some(m) = Mounting::new() else { return };
    let (plugin, state) = (&m.plugin, m.state.path());

    let out = common::with_state_tmpfs(plugin, state, "--make-private")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("--bound-state-dirs require")
            && stderr.contains("mountPropagation: Bidirectional"),
        "{stderr}"
    );

    let _plugin = m.spawn(
        common::with_state_tmpfs(plugin, state, "--make-private")
            .env("GPUMEM_BOUND_STATE_DIRS", "auto"),
    );
    let logs = || m.logs();
    m.registered().await;
    assert!(
        logs().contains("WARN") && logs().contains("state directories are NOT bounded"),
        "{}",
        logs()
    );
}

/// A process that still holds a slot in a container's accounting file
/// when kubelet gives the same units to the next pod (its own pod ended;
/// it was handed the file's descriptor) leaves the next pod nothing of it:
/// with bounded state directories, Allocate mounts a new tmpfs with a new
/// file whatever the old one holds, and the next pod's process allocates
/// up to its cap. The real `gpumem plugin`, as root, as above.
#[tokio::test]
async fn a_live_slot_in_a_bounded_directory_is_not_the_next_pods() {
    let Some(m) = Mounting::new() else { return };
    let (kubelet, state) = (&m.kubelet, m.state.path());
    let plugin = m.spawn(&mut common::with_bounded_state(&m.plugin, state));
    let pid = plugin.id();
    m.registered().await;

    let first = kubelet.admit("nb-1", "main", RESOURCE, 4).await.unwrap();
    let marker = m.kubelet_dir.path().join("holding");
    let (ok, out, err) = common::in_container(
        pid,
        &first.response.mounts[2].host_path,
        &format!(
            "setsid env -i LD_LIBRARY_PATH=\"$FAKE\" LD_PRELOAD=\"$SHIM\" \
             GPUMEM_STATE_DIR=/run/gpumem \"$PROBE\" alloc:4000 hold \
             > {marker} 2>&1 < /dev/null &
             until grep -q holding {marker}; do sleep 0.05; done
             echo $!",
            marker = marker.display()
        ),
    );
    assert!(ok, "{out}{err}");
    let holder: i32 = out.trim().parse().unwrap();
    let kill = || {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(holder),
            nix::sys::signal::Signal::SIGKILL,
        );
    };

    kubelet.remove_pod("nb-1");
    let second = kubelet.admit("nb-2", "main", RESOURCE, 4).await.unwrap();
    let dir = &second.response.mounts[2].host_path;
    let same = dir == &first.response.mounts[2].host_path;
    let (ok, out, err) = common::in_container(
        pid,
        dir,
        "env -i LD_LIBRARY_PATH=\"$FAKE\" LD_PRELOAD=\"$SHIM\" \
         GPUMEM_STATE_DIR=/run/gpumem \"$PROBE\" alloc:4000",
    );
    kill();
    assert!(same, "the same units, so the same directory");
    assert!(ok, "{out}{err}");
    assert_eq!(
        out.lines().last(),
        Some("alloc:4000 0 #0"),
        "{out}{err}\n{}",
        m.logs()
    );
    assert!(
        m.logs()
            .contains("a process outside this container still holds a slot"),
        "{}",
        m.logs()
    );
    drop(plugin);
}
