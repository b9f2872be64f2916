//! The `gpumem` binary: flags, env, errors a user sees, SIGTERM, and the demo.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::wait::{eventually_blocking, poll, poll_blocking};
use common::{fixture, RESOURCE, WAIT};
use gpumem_testkit::simulator::KubeletSim;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use common::gpumem_cmd as gpumem;

fn run(cmd: &mut Command) -> (Output, String) {
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

#[cfg(feature = "demo")]
#[test]
fn demo_replays_the_notebook_scenario() {
    let (out, text) = run(gpumem().arg("demo"));
    assert!(out.status.success(), "{text}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for pod in ["tf-notebook-1", "tf-notebook-2", "tf-notebook-3"] {
        assert!(
            stdout.contains(&format!("{pod}  admitted: GPU0, 4 units, cap 4308 MiB")),
            "{stdout}"
        );
    }
    assert!(
        stdout.contains("tf-notebook-4  NOT admitted: Insufficient aliyun.com/gpu-mem: requested 4, 2 available"),
        "{stdout}"
    );
    assert!(
        stdout.contains("Allocated/Total GPU Memory In Cluster: 12/14 (85%)"),
        "{stdout}"
    );
    assert!(stdout.contains("GPUMEM_LIMIT_MIB=4308"), "{stdout}");
    assert!(stdout.contains("NVIDIA_VISIBLE_DEVICES=GPU-6b1c2d3e-0000-4000-8000-000000000400"));
}

#[cfg(feature = "demo")]
#[test]
fn demo_takes_other_nodes() {
    let (out, text) = run(gpumem()
        .args(["demo", "--placement", "spread"])
        .arg("--fake-gpus")
        .arg(fixture("v100x2")));
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("tf-notebook-2  admitted: GPU1, 4 units, cap 4309 MiB"),
        "{text}"
    );
    assert!(text.contains("tf-notebook-4  admitted: GPU1"), "{text}");
}

#[test]
fn bad_fake_gpu_file_names_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("node.toml");
    std::fs::write(
        &file,
        "[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = -5\n",
    )
    .unwrap();
    let (out, text) = run(gpumem()
        .args(["plugin", "--kubelet-dir"])
        .arg(dir.path())
        .arg("--fake-gpus")
        .arg(&file));
    assert!(!out.status.success());
    assert!(
        text.contains(&file.display().to_string()) && text.contains("memory_mib"),
        "{text}"
    );

    if cfg!(feature = "demo") {
        let missing = dir.path().join("absent.toml");
        let (out, text) = run(gpumem().args(["demo", "--fake-gpus"]).arg(&missing));
        assert!(!out.status.success());
        assert!(text.contains("absent.toml"), "{text}");
    }
}

/// Runs `cmd` to its end, or kills it after `limit` and fails: a check that
/// regresses into a hang fails instead of hanging the suite. Output goes to
/// files, so a chatty child never blocks on a full pipe.
fn run_within(cmd: &mut Command, limit: Duration) -> (std::process::ExitStatus, String) {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let every = Duration::from_millis(20);
    let status = match poll_blocking(limit, every, || child.try_wait().unwrap().ok_or(())) {
        Ok(status) => status,
        Err(()) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{cmd:?} still running after {limit:?}: {}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
    };
    let text = std::fs::read_to_string(&out).unwrap() + &std::fs::read_to_string(&err).unwrap();
    (status, text)
}

/// `gpumem plugin` on a fake GPU file: exits at once when the file is refused.
fn plugin_on(dir: &std::path::Path, file: &std::path::Path) -> Command {
    let mut cmd = common::bare_plugin(dir);
    cmd.arg("--fake-gpus").arg(file);
    cmd
}

#[test]
fn absurd_gpu_sizes_are_refused_naming_the_field_and_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("node.toml");
    // 1e10 MiB took 26 s and 1.3 GB before failing; 1e12 and u64::MAX
    // aborted on an allocation failure. 16 TiB + 1 MiB is the first size
    // refused.
    for memory_mib in [
        "10000000000",
        "1000000000000",
        "18446744073709551615",
        "16777217",
    ] {
        std::fs::write(
            &file,
            format!(
                "[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 15079\n\
                 [[gpu]]\nuuid = \"GPU-b\"\nname = \"Huge\"\nmemory_mib = {memory_mib}\n"
            ),
        )
        .unwrap();
        let (status, text) = run_within(&mut plugin_on(dir.path(), &file), WAIT);
        assert_eq!(status.code(), Some(1), "{memory_mib}: {status:?} {text}");
        assert!(
            text.contains(&format!(
                "{}: gpu[1].memory_mib: {memory_mib} MiB",
                file.display()
            )) && text.contains("at most 16777216 MiB (16 TiB)"),
            "{memory_mib}: {text}"
        );
    }
    // As large as a GPU may be: accepted (the demo runs on it) ...
    let gpu = "[[gpu]]\nuuid = \"GPU-6b1c2d3e-0000-4000-8000-000000000401\"\n\
               name = \"Huge\"\nmemory_mib = 16777216\n";
    std::fs::write(&file, gpu).unwrap();
    if cfg!(feature = "demo") {
        let (status, text) = run_within(gpumem().args(["demo", "--fake-gpus"]).arg(&file), WAIT);
        assert!(status.success(), "{text}");
        assert!(text.contains("tf-notebook-1  admitted: GPU0"), "{text}");
    }
    // ... but not a process said to use more than that.
    std::fs::write(
        &file,
        format!("{gpu}[[gpu.process]]\npid = 7\nused_mib = 16777217\n"),
    )
    .unwrap();
    let (status, text) = run_within(&mut plugin_on(dir.path(), &file), WAIT);
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(
        text.contains("gpu[0].process[0].used_mib: 16777217 MiB")
            && text.contains("at most 16777216 MiB (16 TiB)"),
        "{text}"
    );
}

#[test]
fn a_fake_gpu_file_that_is_not_a_regular_file_is_refused_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    // A FIFO nobody writes: opening it for reading blocked for ever.
    let fifo = dir.path().join("fifo.toml");
    nix::unistd::mkfifo(
        &fifo,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
    let sub = dir.path().join("dir.toml");
    std::fs::create_dir(&sub).unwrap();
    for (path, kind) in [
        (fifo.as_path(), "a FIFO"),
        (sub.as_path(), "a directory"),
        (std::path::Path::new("/dev/null"), "a character device"),
    ] {
        let (status, text) = run_within(&mut plugin_on(dir.path(), path), WAIT);
        assert_eq!(status.code(), Some(1), "{kind}: {text}");
        assert!(
            text.contains(&format!("{}: {kind}, not a regular file", path.display())),
            "{kind}: {text}"
        );
        if cfg!(feature = "demo") {
            let (status, text) = run_within(gpumem().args(["demo", "--fake-gpus"]).arg(path), WAIT);
            assert_eq!(status.code(), Some(1), "demo, {kind}: {text}");
            assert!(text.contains("not a regular file"), "demo, {kind}: {text}");
        }
    }
    // A regular file too large to be a description of GPUs (sparse: it
    // costs no disk) is refused before it is read into memory.
    let big = dir.path().join("big.toml");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let (status, text) = run_within(&mut plugin_on(dir.path(), &big), WAIT);
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!("{}: 1073741824 bytes", big.display()))
            && text.contains("at most 16777216"),
        "{text}"
    );
}

#[test]
fn absurd_gpu_sizes_from_nvml_are_refused_naming_the_bound() {
    // The fake driver doubles as libnvidia-ml.so.1, reporting 1e12 MiB.
    let dir = tempfile::tempdir().unwrap();
    let (status, text) = run_within(
        common::bare_plugin(dir.path())
            .env("LD_LIBRARY_PATH", &common::shim_kit().driver_dir)
            .env("FAKEGPU_MEMORY_MIB", "1000000000000"),
        WAIT,
    );
    assert_eq!(status.code(), Some(1), "{status:?} {text}");
    assert!(
        text.contains(&format!(
            "GPU 0 ({}): NVML reports 1000000000000 MiB",
            common::T4_UUID
        )) && text.contains("at most 16777216 MiB (16 TiB)"),
        "{text}"
    );
}

#[test]
fn without_nvml_the_error_says_what_a_pod_needs_and_points_to_fake_gpus() {
    // In a pod, NVML fails to load when the container runs without NVIDIA's
    // runtime or the node lacks the driver: the error must send an operator
    // there, and a machine without GPUs to fake ones.
    let dir = tempfile::tempdir().unwrap();
    // An empty library path keeps a host NVML (if any) out of reach.
    let (out, text) = run(gpumem()
        .args(["plugin", "--kubelet-dir"])
        .arg(dir.path())
        .env("LD_LIBRARY_PATH", dir.path()));
    assert!(!out.status.success(), "plugin started without GPUs: {text}");
    for hint in [
        "NVML is not usable",
        "NVIDIA runtime",
        "runtimeClassName: nvidia",
        "NVIDIA driver",
        "--fake-gpus",
    ] {
        assert!(text.contains(hint), "no {hint:?} in: {text}");
    }
}

#[test]
fn logs_written_to_a_pipe_carry_no_colour_codes() {
    // As under a DaemonSet: `kubectl logs` shows stderr as it was written.
    let (out, text) = run(gpumem()
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .args([
            "plugin",
            "--metrics-addr",
            "",
            "--kubelet-dir",
            "/nonexistent",
        ])
        .arg("--fake-gpus")
        .arg(fixture("t4")));
    assert!(!out.status.success(), "{text}");
    let logs = String::from_utf8_lossy(&out.stderr);
    assert!(logs.contains("INFO") && logs.contains("Tesla T4"), "{logs}");
    assert!(!logs.contains('\x1b'), "escape codes in {logs:?}");
}

#[test]
fn invalid_flags_are_named() {
    let (out, text) = run(gpumem().args(["plugin", "--resource-name", "gpu-mem"]));
    assert!(!out.status.success());
    assert!(
        text.contains("--resource-name") && text.contains("<domain>/<name>"),
        "{text}"
    );

    let (out, text) = run(gpumem().args(["plugin", "--placement", "random"]));
    assert!(!out.status.success());
    assert!(
        text.contains("--placement") && text.contains("binpack or spread"),
        "{text}"
    );

    let (out, text) = run(gpumem().arg("plugin").env("GPUMEM_MEMORY_UNIT", "KB"));
    assert!(!out.status.success());
    assert!(
        text.contains("--memory-unit") && text.contains("GiB or MiB"),
        "{text}"
    );
}

#[test]
fn mib_units_that_cannot_fit_kubelets_limit_are_refused_with_advice() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("eight.toml");
    let mut toml = String::new();
    for i in 0..8 {
        toml.push_str(&format!(
            "[[gpu]]\nuuid = \"GPU-0000000{i}-0000-4000-8000-000000000000\"\nname = \"H200\"\nmemory_mib = 144384\n"
        ));
    }
    std::fs::write(&file, toml).unwrap();
    let (out, text) = run(gpumem()
        .args(["plugin", "--memory-unit", "MiB", "--kubelet-dir"])
        .arg(dir.path())
        .arg("--fake-gpus")
        .arg(&file));
    assert!(!out.status.success());
    assert!(
        text.contains("4194304-byte limit") && text.contains("--memory-unit GiB"),
        "{text}"
    );
}

#[tokio::test]
async fn a_rejected_allocate_logs_one_short_line_however_many_ids_it_names() {
    use gpumem::deviceplugin::api::deviceplugin::device_plugin_client::DevicePluginClient;
    use gpumem::deviceplugin::api::deviceplugin::{AllocateRequest, ContainerAllocateRequest};

    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let log = dir.path().join("plugin.log");
    let child = common::bare_plugin(dir.path())
        .arg("--fake-gpus")
        .arg(fixture("t4"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let child = common::Killed(child);
    assert!(kubelet.wait_for_devices(RESOURCE, 1, WAIT).await.is_some());
    let channel = gpumem::kubelet::unix::connect(&dir.path().join("gpumem.sock"))
        .await
        .unwrap();
    // 1M IDs once wrote one 48 MB line; 50,000 wrote 600 KB.
    let ids: Vec<String> = (0..50_000).map(|i| format!("deadbeef-{i}")).collect();
    let err = DevicePluginClient::new(channel)
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
        })
        .await
        .unwrap_err();
    // Logged before the answer left.
    drop(child);
    let logs = std::fs::read_to_string(&log).unwrap();
    let rejected = logs
        .lines()
        .find(|l| l.contains("Allocate rejected"))
        .unwrap_or_else(|| panic!("no rejection logged: {logs}"));
    assert!(
        rejected.len() < 2048 && rejected.contains("(50000 in all)"),
        "{} bytes: {}",
        rejected.len(),
        &rejected[..rejected.len().min(400)]
    );
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    kubelet.stop().await;
}

#[test]
fn help_documents_every_flag_and_its_env() {
    let (out, text) = run(gpumem().args(["plugin", "--help"]));
    assert!(out.status.success());
    for flag in [
        "kubelet-dir",
        "resource-name",
        "memory-unit",
        "fake-gpus",
        "placement",
        "state-dir",
    ] {
        assert!(text.contains(&format!("--{flag}")), "{flag}: {text}");
        let env = format!("GPUMEM_{}", flag.to_uppercase().replace('-', "_"));
        assert!(text.contains(&env), "{env}: {text}");
    }
}

#[tokio::test]
async fn sigterm_stops_the_plugin_and_removes_its_socket() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let mut child = gpumem()
        .arg("plugin")
        .env("GPUMEM_METRICS_ADDR", "")
        .env("GPUMEM_STATE_DIR", dir.path())
        .env("GPUMEM_ISOLATION", "none")
        .env("GPUMEM_KUBELET_DIR", dir.path())
        .env("GPUMEM_FAKE_GPUS", fixture("t4"))
        .env("GPUMEM_RESOURCE_NAME", "example.com/vram")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let devices = kubelet.wait_for_devices("example.com/vram", 1, WAIT).await;
    assert_eq!(
        devices.map(|d| d.len()),
        Some(14),
        "registered through env-configured flags"
    );
    assert!(kubelet.devices(RESOURCE).is_none());
    let socket = dir.path().join("gpumem.sock");
    assert!(socket.exists());
    let status_socket = dir.path().join("status.sock");
    assert!(status_socket.exists());

    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    let status = tokio::task::spawn_blocking(move || {
        eventually_blocking(
            "the plugin to stop",
            WAIT,
            Duration::from_millis(20),
            || {
                child
                    .try_wait()
                    .unwrap()
                    .ok_or("plugin did not stop on SIGTERM")
            },
        )
    })
    .await
    .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists(), "socket removed");
    assert!(!status_socket.exists(), "status socket removed");
    // kubelet saw the stream end: the endpoint is disconnected.
    assert!(kubelet.wait_for_disconnect("example.com/vram", WAIT).await);
    kubelet.stop().await;
}

/// `gpumem exec` with the fake driver standing in for NVML and CUDA.
fn exec() -> Command {
    let kit = common::shim_kit();
    let mut cmd = gpumem();
    cmd.arg("exec")
        .arg("--shim")
        .arg(&kit.shim)
        .env("LD_LIBRARY_PATH", &kit.driver_dir);
    cmd
}

/// [`exec`] of the probe with `--mem mem`, its state in `state`, and
/// `flags`; the probe's steps follow.
fn exec_probe(mem: &str, state: &std::path::Path, flags: &[&str]) -> Command {
    let mut cmd = exec();
    cmd.args(["--mem", mem])
        .args(flags)
        .arg("--state-dir")
        .arg(state)
        .arg("--")
        .arg(&common::shim_kit().probe);
    cmd
}

/// [`exec`] with `--mem mem` on the GPUs of fixture `gpus`; the command
/// follows.
fn exec_on(gpus: &str, mem: &str) -> Command {
    let mut cmd = exec();
    cmd.args(["--mem", mem, "--fake-gpus"]).arg(fixture(gpus));
    cmd
}

#[test]
fn exec_caps_any_command() {
    let kit = common::shim_kit();
    let (out, text) = run(exec()
        .args(["--mem", "4308MiB", "--"])
        .arg(&kit.probe)
        .args(["info", "nvml", "alloc:4000", "alloc:400"]));
    assert!(out.status.success(), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(common::field(lines[1], "total"), 4308 * common::MIB);
    assert_eq!(common::field(lines[2], "total"), 4308 * common::MIB);
    assert!(
        lines.contains(&"alloc:4000 0 #0") && lines.contains(&"alloc:400 2 #1"),
        "{text}"
    );
    // Why the command saw out-of-memory, in one line.
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(
            "gpumem: 1 GPU allocation(s) refused at the 4308 MiB cap (peak use 4300 MiB)"
        ),
        "{text}"
    );
}

#[test]
fn exec_commands_sharing_a_state_dir_share_the_cap() {
    let state = tempfile::tempdir().unwrap();
    let mut holder = exec_probe("4GiB", state.path(), &[])
        .args(["alloc:3000", "hold"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut holder, "holding");
    let (ok, text) = run(exec_probe("4GiB", state.path(), &[]).args(["alloc:2000", "alloc:400"]));
    assert!(ok.status.success(), "{text}");
    // 3000 MiB and two 300 MiB contexts of 4096: 400 MiB more fit, not 2000.
    assert!(
        text.contains("alloc:2000 2 #0") && text.contains("alloc:400 0 #1"),
        "{text}"
    );
    // The file counts refusals per GPU, not per command: each report says
    // that a command sharing the directory may have had them.
    let shared = format!(
        "gpumem: 1 GPU allocation(s) refused at the 4096 MiB cap while the command ran, by it \
         or another command sharing --state-dir {}",
        state.path().display()
    );
    assert!(text.contains(&shared), "{text}");
    // SIGTERM to gpumem reaches the command; gpumem reports how it ended.
    kill(Pid::from_raw(holder.id() as i32), Signal::SIGTERM).unwrap();
    let out = holder.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 15));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&shared),
        "the holder had no refusal of its own: {stderr}"
    );
}

#[test]
fn exec_holds_a_command_to_what_the_driver_shows_it_using() {
    let state = tempfile::tempdir().unwrap();
    // What NVML lists per process, through nvml-wrapper and the fake library.
    let nvml_processes = state.path().join("processes");
    std::fs::write(&nvml_processes, "").unwrap();
    let shared = state.path().join("shared");
    let mut holder = exec_probe("4308MiB", &shared, &["--reconcile-secs", "1"])
        .env("FAKEGPU_PROCESSES_FILE", &nvml_processes)
        .args(["alloc:1000", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let seen = common::wait_for_line(&mut holder, "holding");
    let pid = common::field(&seen, "pid");
    // Libraries loaded after its context: 300 MiB beyond the 1000 MiB it
    // allocated and the 300 MiB context it was charged.
    std::fs::write(&nvml_processes, format!("{pid} 1600\n")).unwrap();

    let probe = |steps: &[&str]| {
        run(exec_probe("4308MiB", &shared, &["--reconcile-secs", "0"]).args(steps))
    };
    eventually_blocking("reconciliation", WAIT, Duration::from_millis(100), || {
        let (out, text) = probe(&["info"]);
        assert!(out.status.success(), "{text}");
        let info = text.lines().find(|l| l.starts_with("info")).unwrap();
        // Less this probe's own context.
        if common::field(info, "free") == (4308 - 1600 - 300) * common::MIB {
            Ok(())
        } else {
            Err(format!("never reconciled: {info}"))
        }
    });
    let (_, text) = probe(&["alloc:2409", "alloc:2408"]);
    assert!(
        text.contains("alloc:2409 2 #0") && text.contains("alloc:2408 0 #1"),
        "{text}"
    );
    kill(Pid::from_raw(holder.id() as i32), Signal::SIGTERM).unwrap();
    holder.wait().unwrap();
}

#[test]
fn exec_reports_the_exit_code_and_bad_input() {
    let (out, _) = run(exec().args(["--mem", "1GiB", "--", "sh", "-c", "exit 7"]));
    assert_eq!(out.status.code(), Some(7));

    let (out, text) = run(gpumem()
        .args([
            "exec",
            "--shim",
            "/nonexistent/libgpumem_shim.so",
            "--mem",
            "1GiB",
            "--",
            "true",
        ])
        .env("LD_LIBRARY_PATH", &common::shim_kit().driver_dir));
    assert!(!out.status.success());
    assert!(
        text.contains("/nonexistent/libgpumem_shim.so") && text.contains("--shim"),
        "{text}"
    );

    let (out, text) = run(exec().args(["--mem", "4GB", "--", "true"]));
    assert!(!out.status.success());
    assert!(text.contains("--mem") && text.contains("4GiB"), "{text}");

    let (out, text) = run(exec().args(["--mem", "1GiB", "--gpu", "7", "--", "true"]));
    assert!(!out.status.success());
    assert!(text.contains("--gpu \"7\""), "{text}");
}

#[tokio::test]
async fn the_nvml_backend_advertises_what_nvml_reports() {
    // The fake driver doubles as libnvidia-ml.so.1: one 15079 MiB T4.
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let child = gpumem()
        .args([
            "--log-format",
            "json",
            "plugin",
            "--isolation",
            "none",
            "--metrics-addr",
            "",
            "--kubelet-dir",
        ])
        .arg(dir.path())
        .env("LD_LIBRARY_PATH", &common::shim_kit().driver_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let devices = kubelet.wait_for_devices(RESOURCE, 1, WAIT).await;
    let allocation = kubelet.admit("nb", "main", RESOURCE, 4).await;
    let rejected = kubelet.admit("nb-2", "main", RESOURCE, 14).await;
    kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).unwrap();
    let out = child.wait_with_output().unwrap();
    let status = out.status;
    assert_eq!(devices.map(|d| d.len()), Some(14));
    assert!(rejected.is_err());
    // Logs are JSON lines; every Allocate names GPU, units and cap.
    let logs: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stderr)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let allocate = logs
        .iter()
        .find(|l| l["fields"]["message"] == "Allocate")
        .expect("an Allocate log line");
    assert_eq!(allocate["fields"]["cap_mib"], 4308);
    assert_eq!(allocate["fields"]["units"], 4);
    assert_eq!(allocate["fields"]["gpu"], 0);
    let env = allocation.unwrap().response.envs;
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], common::T4_UUID);
    assert_eq!(env["GPUMEM_LIMIT_MIB"], "4308");
    assert!(status.success());
    kubelet.stop().await;
}

/// `gpumem plugin` on the T4 fixture with JSON logs on a pipe, for kubelet
/// at `dir` (none answers there).
fn json_plugin(dir: &std::path::Path) -> Command {
    json_plugin_on(dir, "t4")
}

/// [`json_plugin`] on the GPUs of fixture `gpus`.
fn json_plugin_on(dir: &std::path::Path, gpus: &str) -> Command {
    let mut cmd = common::bare_plugin(dir);
    cmd.arg("--log-format")
        .arg("json")
        .arg("--fake-gpus")
        .arg(fixture(gpus))
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// With JSON logs, the error that stops gpumem is one more JSON record, so
/// a log pipeline keeps it.
#[test]
fn a_fatal_error_is_a_json_record_with_json_logs() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = json_plugin(dir.path());
    cmd.args([
        "--node-name",
        "n1",
        "--kubeconfig",
        "/nonexistent/gpumem-kubeconfig",
    ]);
    let out = cmd.output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.lines().last().unwrap_or_default();
    let record: serde_json::Value = serde_json::from_str(last)
        .unwrap_or_else(|err| panic!("not JSON ({err}): {last}\nall of it:\n{stderr}"));
    assert_eq!(record["level"], "ERROR", "{record}");
    assert_eq!(record["fields"]["message"], "gpumem stopped", "{record}");
    let error = record["fields"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("/nonexistent/gpumem-kubeconfig"), "{record}");
}

/// The plugin's "starting" log line, as JSON; the plugin is then stopped.
fn plugin_start(configure: impl FnOnce(&mut Command)) -> serde_json::Value {
    plugin_start_log("t4", configure).pop().unwrap()
}

/// Every log record from the command line to the plugin's "starting" line
/// (the last), on the GPUs of fixture `gpus`; the plugin is then stopped.
fn plugin_start_log(gpus: &str, configure: impl FnOnce(&mut Command)) -> Vec<serde_json::Value> {
    plugin_logs_until(gpus, configure, |message| message == "starting")
        .unwrap_or_else(|seen| panic!("plugin did not start: {seen}"))
        .0
}

/// [`json_plugin_on`] `gpus`, as `configure` sets it, run until it logs a
/// record whose message `last` accepts; then stopped. Every JSON record up
/// to that one and the lines that were not JSON, or else all it wrote.
fn plugin_logs_until(
    gpus: &str,
    configure: impl FnOnce(&mut Command),
    last: impl Fn(&str) -> bool,
) -> Result<(Vec<serde_json::Value>, Vec<String>), String> {
    use std::io::BufRead;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = json_plugin_on(dir.path(), gpus);
    configure(&mut cmd);
    let mut child = common::Killed(cmd.spawn().unwrap());
    let stderr = std::io::BufReader::new(child.0.stderr.take().unwrap());
    let (mut seen, mut records, mut other) = (String::new(), Vec::new(), Vec::new());
    for line in stderr.lines() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        let Ok(log) = serde_json::from_str::<serde_json::Value>(&line) else {
            other.push(line);
            continue;
        };
        let done = log["fields"]["message"].as_str().is_some_and(&last);
        records.push(log);
        if done {
            return Ok((records, other));
        }
    }
    Err(seen)
}

/// kubelet's restart compares each device with each allocated one: where a
/// full node would stall it over a minute (measured per pair on kubelet
/// 1.37.2), the plugin says so at start; a T4 in MiB stays quiet.
#[test]
fn mib_units_on_a_large_gpu_warn_of_slow_kubelet_restarts() {
    let warnings = |fixture_name: &str| -> Vec<String> {
        plugin_start_log(fixture_name, |cmd| {
            cmd.args(["--memory-unit", "MiB"]);
        })
        .into_iter()
        .filter(|r| r["level"] == "WARN")
        .filter_map(|r| r["fields"]["message"].as_str().map(str::to_owned))
        .filter(|m| m.contains("kubelet restart"))
        .collect()
    };
    let h100 = warnings("h100");
    assert_eq!(h100.len(), 1, "{h100:?}");
    assert!(
        h100[0].contains("blocked for about 665 s") && h100[0].contains("--memory-unit GiB"),
        "{}",
        h100[0]
    );
    assert_eq!(warnings("t4"), Vec::<String>::new());
}

#[test]
fn ignore_xids_takes_what_help_shows_and_an_empty_list() {
    let (out, help) = run(gpumem().args(["plugin", "--help"]));
    assert!(out.status.success());
    let entry = help
        .split("--ignore-xids")
        .nth(1)
        .and_then(|rest| rest.split("\n      --").next())
        .unwrap();
    assert!(
        entry.contains("commas") && entry.contains("[default: 13,31,43,45,68,109]"),
        "{entry}"
    );
    let ignored = |configure: &dyn Fn(&mut Command)| {
        plugin_start(|cmd| configure(cmd))["fields"]["ignore_xids"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let default = "[13, 31, 43, 45, 68, 109]";
    assert_eq!(ignored(&|_| ()), default);
    // The default as --help shows it, and as older versions showed it.
    for shown in ["13,31,43,45,68,109", "13 31 43 45 68 109"] {
        assert_eq!(
            ignored(&|cmd| {
                cmd.args(["--ignore-xids", shown]);
            }),
            default
        );
    }
    assert_eq!(
        ignored(&|cmd| {
            cmd.env("GPUMEM_IGNORE_XIDS", "13, 79");
        }),
        "[13, 79]"
    );
    // Empty: every XID counts.
    assert_eq!(
        ignored(&|cmd| {
            cmd.args(["--ignore-xids", ""]);
        }),
        "[]"
    );
    assert_eq!(
        ignored(&|cmd| {
            cmd.env("GPUMEM_IGNORE_XIDS", "");
        }),
        "[]"
    );

    for bad in [
        gpumem().args(["plugin", "--ignore-xids", "13,x1"]),
        gpumem().arg("plugin").env("GPUMEM_IGNORE_XIDS", "13;x1"),
    ] {
        let (out, text) = run(bad);
        assert!(!out.status.success());
        assert!(
            text.contains("--ignore-xids")
                && text.contains("x1\" is not an XID")
                && text.contains("commas"),
            "{text}"
        );
    }
}

/// `gpumem install-shim` of `from` into `to`.
fn install_shim(from: &std::path::Path, to: &std::path::Path) -> Command {
    let mut cmd = gpumem();
    cmd.args(["install-shim", "--from"])
        .arg(from)
        .arg("--to")
        .arg(to);
    cmd
}

#[test]
fn exec_and_install_refuse_a_file_that_is_not_the_shim() {
    let kit = common::shim_kit();
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    // Not ELF; a CUDA driver (the fake one), which exports the same hooks;
    // a program.
    let cases = [
        (std::path::PathBuf::from("/etc/passwd"), "not an ELF file"),
        (
            kit.driver_dir.join("libcuda.so.1"),
            "does not export gpumem_shim_version",
        ),
        (kit.probe.clone(), "does not export"),
    ];
    for (file, why) in &cases {
        let (out, text) = run(gpumem()
            .args(["exec", "--mem", "1GiB", "--fake-gpus"])
            .arg(fixture("t4"))
            .arg("--shim")
            .arg(file)
            .arg("--")
            .arg("touch")
            .arg(&marker));
        assert!(!out.status.success());
        assert!(
            text.contains(&format!(
                "--shim: {} is not the gpumem shim",
                file.display()
            )) && text.contains(why)
                && text.contains("uncapped"),
            "{text}"
        );
        assert!(!marker.exists(), "the command ran uncapped: {text}");

        let to = dir.path().join("host");
        let (out, text) = run(&mut install_shim(file, &to));
        assert!(!out.status.success());
        assert!(
            text.contains(&format!(
                "--from: {} is not the gpumem shim",
                file.display()
            )) && text.contains(why),
            "{text}"
        );
        assert!(!to.exists(), "installed anyway");
    }

    // The shim itself passes both.
    let to = dir.path().join("host");
    let (out, text) = run(&mut install_shim(&kit.shim, &to));
    assert!(out.status.success(), "{text}");
    assert!(to.join("libgpumem_shim.so").is_file());
    let (out, text) = run(exec().args(["--mem", "1GiB", "--", "touch"]).arg(&marker));
    assert!(out.status.success() && marker.exists(), "{text}");
}

#[test]
fn exec_says_what_is_wrong_with_its_input() {
    let kit = common::shim_kit();
    // No `--` needed; the command's own flags stay its own.
    let (out, text) = run(exec()
        .args(["--mem", "4308MiB"])
        .arg(&kit.probe)
        .args(["info", "nvml"]));
    assert!(out.status.success(), "{text}");
    assert!(text.lines().any(|l| l.starts_with("info")), "{text}");
    let (out, text) = run(exec().args(["--mem", "1GiB", "sh", "-c", "exit 3"]));
    assert_eq!(out.status.code(), Some(3), "{text}");

    // 0 is a number of MiB; what is wrong with it is that it is 0.
    let (out, text) = run(exec().args(["--mem", "0", "--", "true"]));
    assert!(!out.status.success());
    assert!(
        text.contains("--mem")
            && text.contains("greater than 0")
            && !text.contains("expected a number"),
        "{text}"
    );

    // A cap beyond the card: runs, with a word naming the GPU and its memory.
    let (out, text) = run(exec_on("t4", "20GiB").args(["--", "true"]));
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("warning: --mem 20480 MiB is more than GPU 0 (Tesla T4) has, 15079 MiB"),
        "{text}"
    );
    let (_, text) = run(exec_on("t4", "15079MiB").args(["--", "true"]));
    assert!(!text.contains("warning"), "{text}");

    // A shell's statuses: 127 not found, 126 not executable.
    let (out, text) = run(exec().args(["--mem", "1GiB", "--", "gpumem-no-such-command"]));
    assert_eq!(out.status.code(), Some(127), "{text}");
    assert!(
        text.contains("cannot run \"gpumem-no-such-command\": command not found"),
        "{text}"
    );
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("script.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    let (out, text) = run(exec().args(["--mem", "1GiB", "--"]).arg(&script));
    assert_eq!(out.status.code(), Some(126), "{text}");
    assert!(
        text.contains(&format!("cannot run {:?}: not executable", script)),
        "{text}"
    );
}

#[test]
fn os_errors_are_printed_once_and_name_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let (out, text) = run(gpumem()
        .args([
            "install-shim",
            "--from",
            "/nonexistent/libgpumem_shim.so",
            "--to",
        ])
        .arg(dir.path()));
    assert!(!out.status.success());
    assert!(
        text.contains("--from: cannot read the shim /nonexistent/libgpumem_shim.so"),
        "{text}"
    );
    assert_eq!(text.matches("os error 2").count(), 1, "{text}");

    if cfg!(feature = "demo") {
        let (out, text) = run(gpumem().args(["demo", "--fake-gpus", "/nonexistent/node.toml"]));
        assert!(!out.status.success());
        assert_eq!(text.matches("os error 2").count(), 1, "{text}");
    }
}

/// Every flag of every command can be set through the environment, under
/// GPUMEM_<FLAG> or, where that would clash, GPUMEM_<COMMAND>_<FLAG>.
#[test]
fn every_flag_has_an_env_var_named_after_it() {
    let commands = [
        "plugin",
        "dra",
        "exec",
        "inspect",
        "install-shim",
        "extender",
    ];
    let demo = cfg!(feature = "demo").then_some("demo");
    for command in commands.into_iter().chain(demo) {
        let (out, help) = run(gpumem().args([command, "--help"]));
        assert!(out.status.success(), "{help}");
        let options = help.split("\nOptions:\n").nth(1).unwrap();
        // Entries start at a flag; clap's long help continues them indented.
        let mut entries: Vec<String> = Vec::new();
        for line in options.lines() {
            if line.starts_with("  -") || line.starts_with("      --") {
                entries.push(line.trim().to_owned());
            } else if let Some(last) = entries.last_mut() {
                last.push(' ');
                last.push_str(line.trim());
            }
        }
        let mut flags = 0;
        for entry in &entries {
            let flag = entry
                .split_whitespace()
                .find_map(|w| w.strip_prefix("--"))
                .unwrap()
                .trim_end_matches(',');
            if flag == "help" || flag == "version" {
                continue;
            }
            flags += 1;
            let env = entry
                .split("[env: ")
                .nth(1)
                .and_then(|rest| rest.split('=').next())
                .unwrap_or_else(|| panic!("{command} --{flag} has no env var: {entry}"));
            let name = |s: &str| s.to_uppercase().replace('-', "_");
            let plain = format!("GPUMEM_{}", name(flag));
            let prefixed = format!("GPUMEM_{}_{}", name(command), name(flag));
            assert!(
                env == plain || env == prefixed,
                "{command} --{flag}: {env}, not {plain} or {prefixed}"
            );
        }
        assert!(flags >= 2, "{command}: {help}");
    }
}

/// `--mem` takes Kubernetes quantities beside gpumem's own sizes; the cap
/// is the quantity in whole MiB, rounded down.
#[test]
fn exec_takes_kubernetes_quantities_for_mem() {
    for (mem, mib) in [
        ("4Gi", 4096),
        ("4096Mi", 4096),
        ("4194304Ki", 4096),
        ("1.5Gi", 1536),
        ("4G", 3814),
        ("4308MiB", 4308),
        ("4GiB", 4096),
        ("4308", 4308),
    ] {
        let (out, text) =
            run(exec_on("t4", mem).args(["--", "sh", "-c", "echo limit=$GPUMEM_LIMIT_MIB"]));
        assert!(out.status.success(), "{mem}: {text}");
        assert!(text.contains(&format!("limit={mib}\n")), "{mem}: {text}");
    }
    for (bad, why) in [
        ("4Gb", "Kubernetes quantity"),
        ("-1Gi", "Kubernetes quantity"),
        ("0Gi", "greater than 0"),
        ("512Ki", "less than 1 MiB"),
    ] {
        let (out, text) = run(exec().arg(format!("--mem={bad}")).args(["--", "true"]));
        assert!(!out.status.success(), "{bad}: {text}");
        assert!(
            text.contains("--mem") && text.contains(bad) && text.contains(why),
            "{bad}: {text}"
        );
    }
}

#[test]
fn exec_with_a_gpu_that_is_not_there_lists_those_that_are() {
    let (out, text) = run(exec_on("v100x2", "1GiB").args(["--gpu", "5", "--", "true"]));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("--gpu \"5\""), "{text}");
    for line in [
        "0: Tesla V100-SXM2-16GB, 16160 MiB, GPU-1a2b3c4d-0000-4000-8000-000000010000",
        "1: Tesla V100-SXM2-16GB, 16160 MiB, GPU-1a2b3c4d-0000-4000-8000-000000010001",
    ] {
        assert!(text.contains(line), "{line}: {text}");
    }
}

/// The plugin's JSON log lines up to its first registration attempt (no
/// kubelet answers: it fails, and the plugin is then stopped).
fn plugin_logs_until_registering(configure: impl FnOnce(&mut Command)) -> Vec<serde_json::Value> {
    let (logs, other) = plugin_logs_until("t4", configure, |m| {
        m.starts_with("registration with kubelet failed")
    })
    .unwrap_or_else(|seen| panic!("the plugin ended before registering: {seen}"));
    assert!(other.is_empty(), "not JSON: {other:?}");
    logs
}

#[test]
fn nvidias_resource_name_is_taken_with_a_warning() {
    let logs = plugin_logs_until_registering(|cmd| {
        cmd.args(["--resource-name", "nvidia.com/gpu"]);
    });
    let warning = logs
        .iter()
        .find(|l| {
            l["level"] == "WARN"
                && l["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("nvidia.com/gpu"))
        })
        .unwrap_or_else(|| panic!("no warning: {logs:?}"));
    let message = warning["fields"]["message"].as_str().unwrap();
    assert!(
        message.contains("NVIDIA's device plugin") && message.contains("--resource-name"),
        "{message}"
    );
    // The default name: no such warning.
    let logs = plugin_logs_until_registering(|_| {});
    assert!(
        !logs.iter().any(|l| l["level"] == "WARN"
            && l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("NVIDIA"))),
        "{logs:?}"
    );
}

/// `0.1.0 (commit 1a2b3c4d5e6f)`: the tests run from the git checkout.
fn assert_version(text: &str) {
    let commit = text
        .strip_prefix(concat!(env!("CARGO_PKG_VERSION"), " (commit "))
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("{text:?}"));
    let hash = commit.strip_suffix("-dirty").unwrap_or(commit);
    assert!(
        hash.len() == 12 && hash.bytes().all(|b| b.is_ascii_hexdigit()),
        "{text:?}"
    );
}

#[test]
fn the_version_names_the_commit_everywhere() {
    let (out, text) = run(gpumem().arg("--version"));
    assert!(out.status.success(), "{text}");
    let line = text.trim_end().strip_prefix("gpumem ").unwrap_or(&text);
    assert_version(line);
    let version = line.to_owned();

    // In the log when the plugin starts.
    let logs = plugin_logs_until_registering(|_| {});
    let build = logs
        .iter()
        .find(|l| l["fields"]["version"].is_string())
        .unwrap_or_else(|| panic!("no version logged: {logs:?}"));
    assert_eq!(build["fields"]["version"], env!("CARGO_PKG_VERSION"));
    assert!(version.contains(build["fields"]["commit"].as_str().unwrap()));

    // In /status (through inspect) and /metrics.
    let addr = free_addr();
    let dir = tempfile::tempdir().unwrap();
    let _plugin = common::Killed(
        t4_plugin(dir.path(), dir.path(), &addr)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Served once the metrics port answers; no kubelet, so not registered.
    let metrics = http_get(&addr, "/metrics").1;
    let (out, json) = run(gpumem()
        .args(["inspect", "-o", "json", "--state-dir"])
        .arg(dir.path())
        .env("LD_LIBRARY_PATH", dir.path()));
    assert!(out.status.success(), "{json}");
    let status: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {json}"));
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"), "{status}");
    let commit = status["commit"].as_str().unwrap_or_default();
    assert!(!commit.is_empty() && version.contains(commit), "{status}");
    let info = format!(
        "gpumem_build_info{{version=\"{}\",commit=\"{commit}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    assert!(metrics.contains(&info), "{info}: {metrics}");
}

/// `gpumem inspect` reading the T4 fixture when no plugin answers.
fn inspect_t4() -> Command {
    let mut cmd = gpumem();
    cmd.args(["inspect", "--fake-gpus"]).arg(fixture("t4"));
    cmd
}

#[test]
fn inspect_says_when_no_plugin_answers_and_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("status.sock");
    let unanswered = format!(
        "no gpumem plugin answers at {} (--status-socket)",
        socket.display()
    );
    // No NVML either (an empty library path keeps a host's out of reach).
    let (out, text) = run(gpumem()
        .args(["inspect", "--state-dir"])
        .arg(dir.path())
        .env("LD_LIBRARY_PATH", dir.path()));
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains(&unanswered) && text.contains("--fake-gpus"),
        "{text}"
    );

    // Read directly, a state directory that is not there is named.
    let nope = dir.path().join("nope");
    let (out, text) = run(inspect_t4()
        .arg("--status-socket")
        .arg(&socket)
        .arg("--state-dir")
        .arg(&nope));
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains(&format!("--state-dir {}", nope.display())) && text.contains(&unanswered),
        "{text}"
    );

    // Read directly: a warning says that no plugin answered; the old
    // --metrics-addr is taken, and said to be ignored.
    let (out, text) = run(inspect_t4()
        .args(["--metrics-addr", "127.0.0.1:1"])
        .arg("--state-dir")
        .arg(dir.path()));
    assert!(out.status.success(), "{text}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&unanswered)
            && stderr.contains("--metrics-addr 127.0.0.1:1 is ignored")
            && text.contains("Tesla T4"),
        "{text}"
    );

    // A socket this user may not open: said so, with where to run inspect.
    // (Root opens any socket: only a test run as another user sees it.)
    use std::os::unix::fs::MetadataExt;
    if std::fs::metadata("/proc/self").unwrap().uid() != 0 {
        use std::os::unix::fs::PermissionsExt;
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o000)).unwrap();
        let (_, text) = run(inspect_t4().arg("--state-dir").arg(dir.path()));
        assert!(text.contains("kubectl exec"), "{text}");
    }
}

/// An HTTP/1.0 GET over TCP: the status code and the body.
fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let every = Duration::from_millis(20);
    let mut stream = poll_blocking(WAIT, every, || std::net::TcpStream::connect(addr))
        .unwrap_or_else(|err| panic!("{addr}: {err}"));
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let code = answer.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (code, body)
}

/// `gpumem plugin` on the T4 fixture without isolation, for kubelet at
/// `kubelet_dir`, its state in `state` and its metrics on `addr`.
fn t4_plugin(kubelet_dir: &std::path::Path, state: &std::path::Path, addr: &str) -> Command {
    let mut cmd = gpumem();
    cmd.args(["plugin", "--isolation", "none", "--metrics-addr", addr])
        .arg("--kubelet-dir")
        .arg(kubelet_dir)
        .arg("--state-dir")
        .arg(state)
        .arg("--fake-gpus")
        .arg(fixture("t4"));
    cmd
}

/// A free TCP port on loopback, as `HOST:PORT`.
fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// An API server nobody answers at: said once, naming it and why, retried
/// with growing waits, and told on /healthz without failing the probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_api_server_is_named_backed_off_and_told_on_healthz() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    // A port nothing listens on.
    let server = format!("http://{}", free_addr());
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"{server}\"}}\n\
             contexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n\
             users:\n- name: u\n  user: {{token: t}}\n"
        ),
    )
    .unwrap();
    let log = dir.path().join("plugin.log");
    let addr = free_addr();
    let _plugin = common::Killed(
        t4_plugin(dir.path(), &dir.path().join("state"), &addr)
            .args(["--node-name", "gpu-node-1"])
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .arg("--pod-resources-socket")
            .arg(kubelet.pod_resources_socket())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    assert!(kubelet.wait_for_devices(RESOURCE, 1, WAIT).await.is_some());
    let (Ok(text) | Err(text)) = poll(WAIT, Duration::from_millis(100), async || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains("retry_in=3.2s") {
            Ok(text)
        } else {
            Err(text)
        }
    })
    .await;
    assert!(
        text.contains("watching this node's pods")
            && text.contains("retry_in=800ms")
            && text.contains("retry_in=1.6s")
            && text.contains("retry_in=3.2s"),
        "the pod watch is not backed off:\n{text}"
    );
    let said: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("cannot reach the API server"))
        .collect();
    assert_eq!(said.len(), 1, "said once, not at every retry:\n{text}");
    assert!(
        said[0].contains(&format!("server={server}")) && said[0].contains("Connection refused"),
        "{}",
        said[0]
    );
    assert!(
        !text.contains("kube_client"),
        "kube's own error lines:\n{text}"
    );

    let (code, body) = http_get(&addr, "/healthz");
    assert_eq!(code, 200, "registered with kubelet: {body}");
    assert!(
        body.contains(&format!("cannot reach the API server at {server} for")),
        "{body}"
    );
    let (out, text) = run(gpumem()
        .arg("inspect")
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .env("LD_LIBRARY_PATH", dir.path()));
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!(
            "warning: cannot reach the API server at {server} for"
        )),
        "{text}"
    );
    kubelet.stop().await;
}

// Multi-threaded: the test blocks on `gpumem inspect` while the simulated
// kubelet it admits through runs on the same runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn who_holds_what_is_told_on_the_owner_only_socket_not_the_network_port() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let state = dir.path().join("state");
    let addr = free_addr();
    let _plugin = common::Killed(
        t4_plugin(dir.path(), &state, &addr)
            .arg("--pod-resources-socket")
            .arg(kubelet.pod_resources_socket())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(kubelet.wait_for_devices(RESOURCE, 1, WAIT).await.is_some());
    kubelet
        .admit("tf-notebook-1", "main", RESOURCE, 4)
        .await
        .unwrap();

    // The network port: metrics and liveness, no longer who holds what.
    let (code, body) = http_get(&addr, "/status");
    assert_eq!(code, 404, "/status still served over TCP: {body}");
    let (code, metrics) = http_get(&addr, "/metrics");
    assert_eq!(code, 200, "{metrics}");
    assert!(metrics.contains("gpumem_registered 1"), "{metrics}");
    assert_eq!(http_get(&addr, "/healthz").0, 200);

    // The socket, beside the state, for root (the plugin's user) alone.
    let socket = state.join("status.sock");
    let meta =
        std::fs::symlink_metadata(&socket).unwrap_or_else(|e| panic!("{}: {e}", socket.display()));
    assert!(meta.file_type().is_socket(), "{meta:?}");
    assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{meta:?}");

    // `gpumem inspect` finds it from the same --state-dir: the plugin's
    // view (registered), without NVML or --fake-gpus to read the node itself.
    let inspect = |args: &[&str]| {
        let (out, text) = run(gpumem()
            .arg("inspect")
            .args(args)
            .arg("--state-dir")
            .arg(&state)
            .env("LD_LIBRARY_PATH", dir.path()));
        assert!(out.status.success(), "{text}");
        String::from_utf8(out.stdout).unwrap()
    };
    let table = inspect(&["-d"]);
    let row = table
        .lines()
        .find(|l| l.contains("tf-notebook-1"))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(row.contains("4308"), "{row}");
    let status: serde_json::Value = serde_json::from_str(&inspect(&["-o", "json"])).unwrap();
    assert_eq!(status["registered"], true, "{status}");
    assert_eq!(status["containers"][0]["pod"], "tf-notebook-1", "{status}");
    kubelet.stop().await;
}

/// `--state-dir` naming a file: both front ends say which flag and that it
/// is not a directory, not the OS's "File exists" on a path under it.
#[test]
fn a_state_dir_that_is_a_file_is_named_as_not_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("state");
    std::fs::write(&file, b"").unwrap();
    let t4 = common::fixture("t4");
    let mut plugin = gpumem();
    plugin
        .args(["plugin", "--metrics-addr", "", "--status-socket", ""])
        .arg("--kubelet-dir")
        .arg(dir.path())
        .arg("--shim-host-dir")
        .arg(dir.path())
        .arg("--fake-gpus")
        .arg(&t4)
        .arg("--state-dir")
        .arg(&file);
    // A server nothing answers at: the client connects lazily, so the
    // driver gets as far as its state directory.
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\ncurrent-context: x\n\
         clusters: [{name: c, cluster: {server: \"https://127.0.0.1:1\"}}]\n\
         users: [{name: u, user: {token: t}}]\n\
         contexts: [{name: x, context: {cluster: c, user: u}}]\n",
    )
    .unwrap();
    let mut dra = gpumem();
    dra.args(["dra", "--node-name", "n1", "--metrics-addr", ""])
        .args(["--status-socket", ""])
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("--kubelet-plugins-dir")
        .arg(dir.path())
        .arg("--kubelet-registry-dir")
        .arg(dir.path())
        .arg("--fake-gpus")
        .arg(&t4)
        .arg("--state-dir")
        .arg(&file);
    for mut cmd in [plugin, dra] {
        let (status, text) = run_within(&mut cmd, Duration::from_secs(20));
        assert!(!status.success());
        assert!(
            text.contains(&format!(
                "--state-dir {} is not a directory",
                file.display()
            )),
            "{text}"
        );
        assert!(!text.contains("File exists"), "{text}");
    }
}
