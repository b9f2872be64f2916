//! Shared harness: a fake node (fixture GPUs), the in-process kubelet
//! simulator on a real unix socket, and the real plugin server.

#![allow(dead_code)]

pub mod cdi;
pub mod daemon;
pub mod prometheus;
pub mod tenant;
pub mod wait;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpumem::deviceplugin::api::deviceplugin::device_plugin_client::DevicePluginClient;
use gpumem::deviceplugin::api::deviceplugin::Device;
use gpumem::deviceplugin::plugin::{Plugin, PluginConfig, PluginError, SOCKET_NAME};
use gpumem::isolation::inject::Isolation;
use gpumem::kubelet::unix;
use gpumem::node::fake::FakeGpus;
use gpumem::node::inventory::Inventory;
use gpumem::node::placement::Policy;
use gpumem::node::resource::ResourceName;
use gpumem::node::units::MemoryUnit;
use gpumem_testkit::simulator::KubeletSim;
use tempfile::TempDir;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

pub const RESOURCE: &str = "aliyun.com/gpu-mem";
/// Generous: these bound waits for events, they do not time anything.
pub const WAIT: Duration = Duration::from_secs(20);

/// The real binary, without the environment's `GPUMEM_*` and `FAKEGPU_*`
/// settings: only what a test sets.
pub fn gpumem_cmd() -> std::process::Command {
    gpumem_cmd_at(Path::new(env!("CARGO_BIN_EXE_gpumem")))
}

/// [`gpumem_cmd`] for a copy of the binary at `binary`.
pub fn gpumem_cmd_at(binary: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(binary);
    for (key, _) in std::env::vars() {
        if key.starts_with("GPUMEM_") || key.starts_with("FAKEGPU_") {
            cmd.env_remove(key);
        }
    }
    cmd
}

/// `gpumem plugin` for kubelet at `kubelet_dir` and nothing else: no
/// isolation, no network endpoint, no status socket.
pub fn bare_plugin(kubelet_dir: &Path) -> std::process::Command {
    let mut cmd = gpumem_cmd();
    cmd.args([
        "plugin",
        "--isolation",
        "none",
        "--metrics-addr",
        "",
        "--status-socket",
        "",
    ])
    .arg("--kubelet-dir")
    .arg(kubelet_dir);
    cmd
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gpus")
        .join(format!("{name}.toml"))
}

pub fn inventory(name: &str, unit: MemoryUnit) -> Inventory {
    let gpus = FakeGpus::from_file(&fixture(name)).unwrap().gpus();
    Inventory::new(gpus, unit).unwrap()
}

/// A running plugin; `kubelet` is `None` until started (to test waiting).
pub struct Node {
    pub dir: TempDir,
    pub kubelet: Option<KubeletSim>,
    pub shutdown: CancellationToken,
    pub plugin: JoinHandle<Result<(), PluginError>>,
    pub inventory: watch::Sender<Arc<Inventory>>,
}

impl Node {
    pub async fn start(fixture_name: &str, unit: MemoryUnit, policy: Policy) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        let mut node = Node::without_kubelet(dir, fixture_name, unit, policy);
        node.kubelet = Some(kubelet);
        node
    }

    /// A node whose plugin enforces caps with `isolation`.
    pub async fn with_isolation(fixture_name: &str, isolation: Isolation) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        let mut node = Node::spawn(
            dir,
            fixture_name,
            MemoryUnit::GiB,
            Policy::Binpack,
            isolation,
        );
        node.kubelet = Some(kubelet);
        node
    }

    pub fn without_kubelet(
        dir: TempDir,
        fixture_name: &str,
        unit: MemoryUnit,
        policy: Policy,
    ) -> Node {
        Node::spawn(dir, fixture_name, unit, policy, Isolation::None)
    }

    fn spawn(
        dir: TempDir,
        fixture_name: &str,
        unit: MemoryUnit,
        policy: Policy,
        isolation: Isolation,
    ) -> Node {
        let shutdown = CancellationToken::new();
        let (tx, rx) = watch::channel(Arc::new(inventory(fixture_name, unit)));
        let plugin = Plugin::new(PluginConfig {
            kubelet_dir: dir.path().to_owned(),
            resource_name: ResourceName::default(),
            policy,
            isolation,
            device_list: Default::default(),
        });
        let plugin = tokio::spawn(plugin.run(rx, shutdown.clone()));
        Node {
            dir,
            kubelet: None,
            shutdown,
            plugin,
            inventory: tx,
        }
    }

    pub fn kubelet(&self) -> &KubeletSim {
        self.kubelet.as_ref().expect("kubelet started")
    }

    pub async fn devices(&self) -> Vec<Device> {
        self.kubelet()
            .wait_for_devices(RESOURCE, 1, WAIT)
            .await
            .expect("plugin registered and advertised devices")
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join(SOCKET_NAME)
    }

    /// A client of the plugin socket, as kubelet dials it.
    pub async fn client(&self) -> DevicePluginClient<Channel> {
        DevicePluginClient::new(unix::connect(&self.socket()).await.unwrap())
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.plugin)
            .await
            .expect("plugin stops on shutdown")
            .unwrap()
            .unwrap();
        assert!(
            !self.dir.path().join(SOCKET_NAME).exists(),
            "socket removed on shutdown"
        );
    }
}

/// The shim, the fake driver (as libcuda.so.1 and libnvidia-ml.so.1 in one
/// directory) and the probe, built once per test binary.
pub struct ShimKit {
    pub shim: PathBuf,
    pub driver_dir: PathBuf,
    pub probe: PathBuf,
}

pub const T4_UUID: &str = "GPU-6b1c2d3e-0000-4000-8000-000000000400";
pub const MIB: u64 = 1 << 20;

pub fn shim_kit() -> &'static ShimKit {
    static KIT: std::sync::OnceLock<ShimKit> = std::sync::OnceLock::new();
    KIT.get_or_init(|| {
        // target/<profile>/deps/<test binary> → target/<profile>
        let exe = std::env::current_exe().unwrap();
        let out = exe.parent().and_then(Path::parent).unwrap().to_owned();
        let profile = out.file_name().unwrap().to_str().unwrap().to_owned();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = std::process::Command::new(cargo);
        build.args([
            "build",
            "-p",
            "gpumem-shim",
            "-p",
            "gpumem-fakegpu",
            "-p",
            "gpumem-probe",
        ]);
        if profile == "release" {
            build.arg("--release");
        }
        let status = build
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .unwrap();
        assert!(
            status.success(),
            "building the shim, fake driver and probe failed"
        );
        // CI points this at the glibc-2.17 release build to test what ships.
        let shim = std::env::var_os("GPUMEM_TEST_SHIM")
            .map(PathBuf::from)
            .unwrap_or_else(|| out.join("libgpumem_shim.so"));
        assert!(shim.is_file(), "{} missing", shim.display());
        let driver_dir = out.join("fake-driver");
        std::fs::create_dir_all(&driver_dir).unwrap();
        for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
            // Copy then rename: a test binary running in parallel may have it mapped.
            let staging = driver_dir.join(format!(".{name}.{}", std::process::id()));
            std::fs::copy(out.join("libgpumem_fakegpu.so"), &staging).unwrap();
            std::fs::rename(&staging, driver_dir.join(name)).unwrap();
        }
        ShimKit {
            shim,
            driver_dir,
            probe: out.join("gpumem-probe"),
        }
    })
}

impl ShimKit {
    /// The probe with the fake driver on the library path and, when
    /// `state_dir` is given, the shim preloaded against it.
    pub fn probe(&self, state_dir: Option<&Path>) -> std::process::Command {
        let mut cmd = std::process::Command::new(&self.probe);
        cmd.env("LD_LIBRARY_PATH", &self.driver_dir);
        for (key, _) in std::env::vars() {
            if key.starts_with("GPUMEM_") || key.starts_with("FAKEGPU_") {
                cmd.env_remove(key);
            }
        }
        if let Some(dir) = state_dir {
            cmd.env("LD_PRELOAD", &self.shim)
                .env("GPUMEM_STATE_DIR", dir);
        }
        cmd
    }
}

/// A state directory capping the fake T4 at `cap_mib`.
pub fn capped_dir(cap_mib: u64) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    gpumem::isolation::accounting::prepare(
        dir.path(),
        &[gpumem::isolation::accounting::Cap {
            uuid: T4_UUID.into(),
            cap_mib,
            context_charge_mib: 0,
        }],
    )
    .unwrap();
    dir
}

/// Runs a command, returning (success, stdout lines, stderr).
pub fn run_lines(cmd: &mut std::process::Command) -> (bool, Vec<String>, String) {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    (
        out.status.success(),
        stdout,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// What a context takes on the fake driver (FAKEGPU_CONTEXT_MIB's default).
pub const FAKE_CONTEXT: u64 = 300 * MIB;

/// Runs the probe under the shim with `steps`, asserting it exits cleanly
/// and the shim had nothing to say.
pub fn probe(dir: &Path, args: &[&str]) -> Vec<String> {
    let (ok, lines, stderr) = run_lines(shim_kit().probe(Some(dir)).args(args));
    assert!(ok, "probe {args:?} failed: {stderr}");
    assert!(
        !stderr.contains("gpumem-shim"),
        "unexpected shim message: {stderr}"
    );
    lines
}

/// The `n`th line starting with `prefix`.
pub fn nth<'a>(lines: &'a [String], prefix: &str, n: usize) -> &'a str {
    lines
        .iter()
        .filter(|l| l.starts_with(prefix))
        .nth(n)
        .unwrap_or_else(|| panic!("no line {n} starting {prefix:?} in {lines:?}"))
}

/// The first line starting with `prefix`.
pub fn line<'a>(lines: &'a [String], prefix: &str) -> &'a str {
    nth(lines, prefix, 0)
}

/// The value of `key=` in a probe line.
pub fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// Reads a child's stdout until a line containing `marker` (the child keeps
/// running) and returns everything read, that line included.
pub fn wait_for_line(child: &mut std::process::Child, marker: &str) -> String {
    use std::io::BufRead;
    let stdout = child.stdout.take().expect("stdout piped");
    let mut reader = std::io::BufReader::new(stdout);
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "child exited before {marker:?}: {seen}"
        );
        seen.push_str(&line);
        if line.contains(marker) {
            // Keep the pipe open so the child never writes into a closed one.
            std::mem::forget(reader);
            return seen;
        }
    }
}

/// Another process holding the POSIX record lock on byte `offset` of
/// `file`, as a shim holds its slot's (or a claimer about to claim it).
pub fn hold_record_lock(file: &Path, offset: usize) -> std::process::Child {
    let mut holder = std::process::Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import fcntl, time\nf = open({file:?}, 'r+')\n\
             fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, {offset}, 0)\n\
             print('locked', flush=True)\ntime.sleep(60)"
        ))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_line(&mut holder, "locked");
    holder
}

/// A host directory laid out as the DaemonSet's installer leaves it.
pub fn installed_shim() -> TempDir {
    let host = tempfile::tempdir().unwrap();
    gpumem::isolation::install::install(&shim_kit().shim, host.path()).unwrap();
    host
}

/// A host directory with the shim "installed" in `dir`: Allocate and
/// Prepare only check that the library and the preload list are there;
/// nothing loads them.
pub fn fake_installed_shim(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("libgpumem_shim.so"), b"").unwrap();
    std::fs::write(
        dir.join("ld.so.preload"),
        b"/usr/local/gpumem/libgpumem_shim.so\n",
    )
    .unwrap();
}

/// Makes the fake NVML of the node file `gpus` (a `--fake-gpus` file) list
/// `pid` with `used_mib` on its last GPU, each `(name, text)` of
/// `proc_files` standing for its `/proc/<pid>/<name>` (`cgroup`,
/// `mountinfo`).
pub fn list_fake_process(gpus: &Path, pid: u32, used_mib: u64, proc_files: &[(&str, &str)]) {
    let mut text = std::fs::read_to_string(gpus).unwrap();
    text += &format!("\n[[gpu.process]]\npid = {pid}\nused_mib = {used_mib}\n");
    for (name, file) in proc_files {
        text += &format!("{name} = {file:?}\n");
    }
    rewrite_fake_gpus(gpus, text);
}

/// Write then rename: the watchers of the node file never read half of it.
pub fn rewrite_fake_gpus(gpus: &Path, text: String) {
    let staging = gpus.with_extension("toml.new");
    std::fs::write(&staging, text).unwrap();
    std::fs::rename(staging, gpus).unwrap();
}

/// A `/proc/<pid>/mountinfo` with `dir` at /var/run/gpumem, as Allocate's
/// mounts (or a claim's CDI spec) give every process of a container.
pub fn mountinfo_with_state_dir(dir: &Path) -> String {
    format!(
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n2 1 8:1 {} /var/run/gpumem rw - ext4 /dev/sda1 rw\n",
        dir.display()
    )
}

/// A `/proc/<pid>/mountinfo` with each of `dirs` (DRA claims' accounting
/// directories) inside /var/run/gpumem under its own name, as the claims'
/// CDI specs mount them in every process of a container (at /run, where
/// `/var/run` links there in the image).
pub fn mountinfo_with_claims(dirs: &[&Path]) -> String {
    let mut text = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n".to_owned();
    for (i, dir) in dirs.iter().enumerate() {
        let name = dir.file_name().unwrap().to_str().unwrap();
        text += &format!(
            "{} 1 8:1 {} /run/gpumem/{name} rw - ext4 /dev/sda1 rw\n",
            i + 2,
            dir.display()
        );
    }
    text
}

/// `gpumem plugin` (the binary) on the fake T4 with shim isolation, as a
/// node runs it: kubelet's directory and its pod-resources socket, the shim
/// installed in `shim_dir`, the accounting state in `state`; no metrics,
/// no reconciliation, and none of the test's own `GPUMEM_*` settings.
pub fn shim_plugin(
    kubelet_dir: &Path,
    kubelet: &KubeletSim,
    shim_dir: &Path,
    state: &Path,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gpumem"));
    for (key, _) in std::env::vars() {
        if key.starts_with("GPUMEM_") {
            cmd.env_remove(key);
        }
    }
    cmd.arg("plugin")
        .arg("--fake-gpus")
        .arg(fixture("t4"))
        .arg("--kubelet-dir")
        .arg(kubelet_dir)
        .arg("--pod-resources-socket")
        .arg(kubelet.pod_resources_socket())
        .args([
            "--metrics-addr",
            "",
            "--status-socket",
            "",
            "--reconcile-secs",
            "0",
        ])
        .arg("--shim-host-dir")
        .arg(shim_dir)
        .arg("--state-dir")
        .arg(state);
    cmd
}

/// A child process killed when the test lets go of it, also when the test
/// fails first: a probe left holding would keep the test's output open.
pub struct Killed(pub std::process::Child);

impl std::ops::Deref for Killed {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Compiles the C program `source` (with pthreads and libdl) in `dir`;
/// returns the program's path.
pub fn compile_c(source: &str, dir: &Path) -> PathBuf {
    let src = dir.join("program.c");
    std::fs::write(&src, source).unwrap();
    let program = dir.join("program");
    let status = std::process::Command::new("cc")
        .arg("-o")
        .arg(&program)
        .arg(&src)
        .args(["-ldl", "-lpthread"])
        .status()
        .expect("a C compiler (cc) is needed");
    assert!(status.success());
    program
}

/// Whether the tests run as root (CI does): what mounts needs.
pub fn root() -> bool {
    std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0
}

/// `daemon` (a `gpumem plugin` or `gpumem dra` command) run as a node runs
/// it with bounded state directories (`--bound-state-dirs require`), as
/// root, in a mount namespace of its own that ends with it: its state dir
/// `state` a 4 MiB tmpfs, shared as a volume with `mountPropagation:
/// Bidirectional` is, so what it mounts under it reaches the containers
/// made from its namespace (`in_container`).
pub fn with_bounded_state(daemon: &std::process::Command, state: &Path) -> std::process::Command {
    with_state_tmpfs(daemon, state, "--make-shared")
}

/// `with_bounded_state`, with the state dir's mount made `propagation`
/// (`--make-private`: a volume without `Bidirectional`).
pub fn with_state_tmpfs(
    daemon: &std::process::Command,
    state: &Path,
    propagation: &str,
) -> std::process::Command {
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mkdir -p \"$0\" && mount -t tmpfs -o size=4m gpumem-test-state \"$0\" && \
             mount {propagation} \"$0\" && exec \"$@\""
        ))
        .arg(state)
        .arg(daemon.get_program())
        .args(daemon.get_args());
    for (key, value) in daemon.get_envs() {
        match value {
            Some(value) => cmd.env(key, value),
            None => cmd.env_remove(key),
        };
    }
    cmd.env("GPUMEM_BOUND_STATE_DIRS", "require");
    cmd
}

/// Runs `script` as a container on the node of the daemon `plugin` (a PID)
/// runs: in a mount namespace made from the daemon's, with `state` (a host
/// path Allocate or a claim's CDI spec mounts) at /run/gpumem, as the
/// runtime binds it. `$FAKE`, `$PROBE` and `$SHIM` name the kit's files.
pub fn in_container(plugin: u32, state: &str, script: &str) -> (bool, String, String) {
    let kit = shim_kit();
    let setup = format!(
        "set -e
         mount -t tmpfs gpumem-run /run
         mkdir -p /run/gpumem
         mount --bind {state} /run/gpumem
         set +e
         {script}"
    );
    let out = std::process::Command::new("nsenter")
        .arg(format!("--mount=/proc/{plugin}/ns/mnt"))
        .args(["--", "unshare", "--mount", "--propagation", "private"])
        .args(["sh", "-c", &setup])
        .env("FAKE", &kit.driver_dir)
        .env("PROBE", &kit.probe)
        .env("SHIM", &kit.shim)
        .output()
        .expect("nsenter and unshare (util-linux) make the container");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Bytes free on the file system at `path` in the mount namespace of `pid`.
pub fn free_bytes(pid: u32, path: &Path) -> u64 {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--mount=/proc/{pid}/ns/mnt"))
        .args(["--", "stat", "-f", "-c", "%a %S"])
        .arg(path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let numbers: Vec<u64> = text
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    assert_eq!(numbers.len(), 2, "stat -f: {text}");
    numbers[0] * numbers[1]
}

/// Waits until a plugin's clean-up has swept `state` past its grace: a
/// directory `name` made now, which no container holds, is removed.
pub async fn swept_past_the_grace(state: &Path, name: &str) {
    let stray = state.join("containers").join(name);
    std::fs::create_dir_all(&stray).unwrap();
    wait::eventually("the clean-up", WAIT, wait::POLL, async || {
        if stray.exists() {
            Err(format!("{} was never cleaned up", stray.display()))
        } else {
            Ok(())
        }
    })
    .await;
}

/// Waits until clean-up has swept `state` past its grace twice: a stray
/// directory is removed, then another made after that. The sweep that
/// removed the first has then finished, and it found every older directory
/// past its grace too: one it would remove is gone, one still there is kept.
pub async fn swept_twice_past_the_grace(state: &Path) {
    swept_past_the_grace(state, "stray-1").await;
    swept_past_the_grace(state, "stray-2").await;
}
