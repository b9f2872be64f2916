//! `--device-list-strategy`: how Allocate names the container's GPU to the
//! container runtime (envvar, volume-mounts, cdi), through the real binary
//! against the in-process kubelet; the CDI specs it writes, checked against
//! the CDI specification, and their clean-up with the container's state.

mod common;

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use common::cdi::check_cdi_spec;
use common::wait::{eventually, POLL};
use common::{RESOURCE, T4_UUID, WAIT};
use gpumem::deviceplugin::api::deviceplugin::ContainerAllocateResponse;
use gpumem_testkit::simulator::{self, Allocation, KubeletSim};
use serde_json::Value;
use tempfile::TempDir;

/// One node's host directories, shared by the plugins a test runs on it.
struct Host {
    root: TempDir,
}

impl Host {
    fn new() -> Host {
        let root = tempfile::tempdir().unwrap();
        common::fake_installed_shim(&root.path().join("shim"));
        Host { root }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.root.path().join(name)
    }

    fn cdi_dir(&self) -> PathBuf {
        self.path("cdi")
    }

    /// Every file in the CDI spec directory.
    fn cdi_files(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.cdi_dir()) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }
}

/// `gpumem plugin` on the fake T4 against a simulated kubelet in its own
/// directory; killed on drop.
struct Plugin {
    kubelet: KubeletSim,
    child: Child,
    kubelet_dir: TempDir,
    log: PathBuf,
    registrations: usize,
}

impl Plugin {
    async fn start(host: &Host, args: &[&str]) -> Plugin {
        let kubelet_dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletSim::start(kubelet_dir.path()).unwrap();
        let (child, log) = Plugin::spawn(host, kubelet_dir.path(), &kubelet, args);
        let mut plugin = Plugin {
            kubelet,
            child,
            kubelet_dir,
            log,
            registrations: 0,
        };
        plugin.wait_for_registration().await;
        plugin
    }

    fn spawn(
        host: &Host,
        kubelet_dir: &Path,
        kubelet: &KubeletSim,
        args: &[&str],
    ) -> (Child, PathBuf) {
        let log = (0..)
            .map(|i| host.path(&format!("plugin-{i}.log")))
            .find(|p| !p.exists())
            .unwrap();
        let mut cmd = common::shim_plugin(
            kubelet_dir,
            kubelet,
            &host.path("shim"),
            &host.path("state"),
        );
        cmd.arg("--cdi-spec-dir")
            .arg(host.cdi_dir())
            .args(args)
            .stdout(Stdio::null())
            .stderr(File::create(&log).unwrap());
        (cmd.spawn().unwrap(), log)
    }

    async fn wait_for_registration(&mut self) {
        self.registrations += 1;
        if self
            .kubelet
            .wait_for_devices(RESOURCE, self.registrations, WAIT)
            .await
            .is_none()
        {
            let _ = self.child.kill();
            panic!("the plugin did not register: {}", self.logs());
        }
    }

    /// Stops the plugin, runs `meanwhile`, and starts it again with `args`
    /// against the same kubelet, which keeps its pods and checkpoint.
    async fn restart(&mut self, host: &Host, args: &[&str], meanwhile: impl FnOnce()) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        meanwhile();
        let (child, log) = Plugin::spawn(host, self.kubelet_dir.path(), &self.kubelet, args);
        (self.child, self.log) = (child, log);
        self.wait_for_registration().await;
    }

    async fn admit(&self, pod: &str, units: usize) -> Allocation {
        match self.kubelet.admit(pod, "main", RESOURCE, units).await {
            Ok(a) => a,
            Err(err) => panic!("{pod} not admitted: {err}\n{}", self.logs()),
        }
    }

    /// The running plugin's log.
    fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// kubelet's device checkpoint as it is now.
    fn checkpoint(&self) -> String {
        let path = self.kubelet_dir.path().join(simulator::CHECKPOINT);
        std::fs::read_to_string(path).unwrap_or_default()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

use common::gpumem_cmd as gpumem;

/// (container path, host path, read-only) of a response's mounts.
fn mounts(response: &ContainerAllocateResponse) -> BTreeSet<(String, String, bool)> {
    response
        .mounts
        .iter()
        .map(|m| (m.container_path.clone(), m.host_path.clone(), m.read_only))
        .collect()
}

fn cdi_devices(response: &ContainerAllocateResponse) -> Vec<&str> {
    response
        .cdi_devices
        .iter()
        .map(|d| d.name.as_str())
        .collect()
}

const SHIM_IN_CONTAINER: &str = "/usr/local/gpumem/libgpumem_shim.so";
const STATE_IN_CONTAINER: &str = "/var/run/gpumem";

/// The host path mounted at `container` in a response.
fn host_of(response: &ContainerAllocateResponse, container: &str) -> String {
    response
        .mounts
        .iter()
        .find(|m| m.container_path == container)
        .unwrap_or_else(|| panic!("no mount at {container}: {response:?}"))
        .host_path
        .clone()
}

#[tokio::test]
async fn envvar_names_the_gpu_in_the_env_as_before() {
    let host = Host::new();
    // The default.
    let plugin = Plugin::start(&host, &[]).await;
    let response = plugin.admit("nb", 4).await.response;
    assert_eq!(response.envs["NVIDIA_VISIBLE_DEVICES"], T4_UUID);
    assert_eq!(response.envs["GPUMEM_LIMIT_MIB"], "4308");
    let containers: BTreeSet<String> = mounts(&response).into_iter().map(|m| m.0).collect();
    assert_eq!(
        containers,
        [SHIM_IN_CONTAINER, "/etc/ld.so.preload", STATE_IN_CONTAINER]
            .map(str::to_owned)
            .into()
    );
    assert!(response.cdi_devices.is_empty(), "{response:?}");
    assert!(host.cdi_files().is_empty(), "{:?}", host.cdi_files());
}

#[tokio::test]
async fn volume_mounts_name_the_gpu_by_a_dev_null_mount_not_the_env() {
    let host = Host::new();
    let envvar = Plugin::start(&host, &["--device-list-strategy", "envvar"]).await;
    let before = envvar.admit("nb", 4).await;
    drop(envvar);
    let plugin = Plugin::start(&host, &["--device-list-strategy=volume-mounts"]).await;
    let after = plugin.admit("nb", 4).await;
    assert_eq!(
        after.device_ids, before.device_ids,
        "same units, same container"
    );
    let response = after.response;

    // The toolkit reads the GPU from the mount's file name; the env only
    // says where the mounts are, as NVIDIA's device plugin sets it.
    assert_eq!(
        response.envs["NVIDIA_VISIBLE_DEVICES"],
        "/var/run/nvidia-container-devices"
    );
    let mut expected = mounts(&before.response);
    expected.insert((
        format!("/var/run/nvidia-container-devices/{T4_UUID}"),
        "/dev/null".to_owned(),
        true,
    ));
    assert_eq!(mounts(&response), expected);
    let mut env = before.response.envs.clone();
    env.remove("NVIDIA_VISIBLE_DEVICES");
    let mut got = response.envs.clone();
    got.remove("NVIDIA_VISIBLE_DEVICES");
    assert_eq!(got, env, "the rest of the env is the same");
    assert!(response.cdi_devices.is_empty(), "{response:?}");
    assert!(host.cdi_files().is_empty(), "{:?}", host.cdi_files());
}

#[tokio::test]
async fn cdi_names_the_gpu_and_the_container_and_writes_a_valid_spec() {
    let host = Host::new();
    let envvar = Plugin::start(&host, &[]).await;
    let before = envvar.admit("nb", 4).await;
    drop(envvar);
    let plugin = Plugin::start(&host, &["--device-list-strategy", "cdi"]).await;
    let after = plugin.admit("nb", 4).await;
    assert_eq!(
        after.device_ids, before.device_ids,
        "same units, same container"
    );
    let response = &after.response;

    // Nothing in the env or mounts: no NVIDIA_VISIBLE_DEVICES to copy.
    assert!(response.envs.is_empty(), "{:?}", response.envs);
    assert!(response.mounts.is_empty(), "{:?}", response.mounts);
    let state_dir = host_of(&before.response, STATE_IN_CONTAINER);
    let name = Path::new(&state_dir)
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_owned();
    let gpu = format!("nvidia.com/gpu={T4_UUID}");
    let ours = format!("gpumem.io/container={name}");
    assert_eq!(cdi_devices(response), [gpu.as_str(), ours.as_str()]);

    // The spec, where runtimes look, named as CDI names transient specs.
    let file = format!("gpumem.io-container_{name}.json");
    assert_eq!(host.cdi_files(), std::slice::from_ref(&file));
    let text = std::fs::read_to_string(host.cdi_dir().join(&file)).unwrap();
    let spec: Value = serde_json::from_str(&text).unwrap();
    if let Err(err) = check_cdi_spec(&spec) {
        panic!("not a valid CDI spec: {err}\n{text}");
    }
    assert_eq!(spec["kind"], "gpumem.io/container");
    let devices = spec["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0]["name"], name.as_str());
    let edits = &devices[0]["containerEdits"];

    // Its env is what envvar puts in the response, less the GPU's name.
    let env: BTreeSet<String> = edits["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_owned())
        .collect();
    let expected: BTreeSet<String> = before
        .response
        .envs
        .iter()
        .filter(|(k, _)| *k != "NVIDIA_VISIBLE_DEVICES")
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    assert_eq!(env, expected);
    for wanted in [
        "GPUMEM_LIMIT_MIB=4308",
        "GPUMEM_STATE_DIR=/var/run/gpumem",
        "ALIYUN_COM_GPU_MEM_IDX=0",
        "ALIYUN_COM_GPU_MEM_CONTAINER=4",
        "ALIYUN_COM_GPU_MEM_DEV=14",
        "ALIYUN_COM_GPU_MEM_UNIT=GiB",
    ] {
        assert!(env.contains(wanted), "{wanted} missing: {env:?}");
    }

    // Its mounts are the ones envvar gives: the same host paths, at the
    // same places, read-only alike; bind mounts, as the runtime needs.
    let spec_mounts: BTreeSet<(String, String, bool)> = edits["mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let options: Vec<&str> = m["options"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o.as_str().unwrap())
                .collect();
            assert!(options.contains(&"rbind"), "{m}");
            assert!(options.contains(&"ro") ^ options.contains(&"rw"), "{m}");
            (
                m["containerPath"].as_str().unwrap().to_owned(),
                m["hostPath"].as_str().unwrap().to_owned(),
                options.contains(&"ro"),
            )
        })
        .collect();
    assert_eq!(spec_mounts, mounts(&before.response));
    assert!(Path::new(&state_dir).join("accounting").is_file());
}

#[tokio::test]
async fn cdi_without_the_shim_names_the_gpu_and_leaves_the_env_in_the_response() {
    let host = Host::new();
    let plugin = Plugin::start(
        &host,
        &["--device-list-strategy", "cdi", "--isolation", "none"],
    )
    .await;
    let response = plugin.admit("nb", 4).await.response;
    assert_eq!(
        cdi_devices(&response),
        [format!("nvidia.com/gpu={T4_UUID}")]
    );
    assert!(
        !response.envs.contains_key("NVIDIA_VISIBLE_DEVICES"),
        "{:?}",
        response.envs
    );
    assert_eq!(response.envs["GPUMEM_LIMIT_MIB"], "4308");
    assert_eq!(response.envs["ALIYUN_COM_GPU_MEM_CONTAINER"], "4");
    assert!(response.mounts.is_empty(), "{:?}", response.mounts);
    assert!(host.cdi_files().is_empty(), "{:?}", host.cdi_files());
}

#[tokio::test]
async fn a_cdi_spec_goes_with_the_containers_state_and_stays_while_it_does() {
    let host = Host::new();
    let plugin = Plugin::start(
        &host,
        &["--device-list-strategy", "cdi", "--state-grace-secs", "1"],
    )
    .await;
    let name = |a: &Allocation| {
        a.response.cdi_devices[1]
            .name
            .strip_prefix("gpumem.io/container=")
            .unwrap()
            .to_owned()
    };
    let done = name(&plugin.admit("done", 4).await);
    let running = name(&plugin.admit("running", 4).await);
    let spec = |name: &str| {
        host.cdi_dir()
            .join(format!("gpumem.io-container_{name}.json"))
    };
    let state = |name: &str| host.path("state").join("containers").join(name);
    assert!(spec(&done).is_file() && spec(&running).is_file());
    // A spec left behind without its state (by hand, or by a plugin that
    // crashed and lost its state dir) is not kept.
    let stray = "5f1c09a2-2u-0000000000000000";
    std::fs::copy(spec(&running), spec(stray)).unwrap();

    plugin.kubelet.remove_pod("done");
    eventually(
        "the finished container's state to go",
        WAIT,
        POLL,
        async || {
            (!state(&done).exists())
                .then_some(())
                .ok_or_else(|| plugin.logs())
        },
    )
    .await;
    assert!(!spec(&done).exists(), "its spec outlived its state");
    eventually("the spec without state to go", WAIT, POLL, async || {
        (!spec(stray).exists())
            .then_some(())
            .ok_or_else(|| plugin.logs())
    })
    .await;

    // A listed container keeps both; a spec lost meanwhile (a reboot empties
    // /var/run/cdi while kubelet restarts containers from its cached
    // answers) is written again, the same.
    let kept = std::fs::read(spec(&running)).unwrap();
    std::fs::remove_file(spec(&running)).unwrap();
    eventually(
        "a live container's spec written again",
        WAIT,
        POLL,
        async || {
            spec(&running)
                .is_file()
                .then_some(())
                .ok_or_else(|| plugin.logs())
        },
    )
    .await;
    assert_eq!(std::fs::read(spec(&running)).unwrap(), kept);
    common::swept_twice_past_the_grace(&host.path("state")).await;
    assert!(state(&running).join("accounting").is_file());
    assert!(spec(&running).is_file());
    assert_eq!(
        host.cdi_files(),
        [format!("gpumem.io-container_{running}.json")]
    );
}

#[tokio::test]
async fn a_plugin_started_after_a_reboot_writes_the_specs_of_its_containers_again() {
    let host = Host::new();
    let args = ["--device-list-strategy", "cdi"];
    let mut plugin = Plugin::start(&host, &args).await;
    let allocation = plugin.admit("nb", 4).await;
    let file = host.cdi_files().pop().unwrap();
    let kept = std::fs::read(host.cdi_dir().join(&file)).unwrap();
    // /var/run is empty after a reboot; the state dir is not, and kubelet
    // restarts the pod from its checkpoint.
    plugin
        .restart(&host, &args, || {
            std::fs::remove_dir_all(host.cdi_dir()).unwrap()
        })
        .await;
    eventually("the spec written again at start", WAIT, POLL, async || {
        host.cdi_dir()
            .join(&file)
            .is_file()
            .then_some(())
            .ok_or_else(|| plugin.logs())
    })
    .await;
    assert_eq!(std::fs::read(host.cdi_dir().join(&file)).unwrap(), kept);
    assert!(allocation.response.cdi_devices[1].name.ends_with(
        file.strip_prefix("gpumem.io-container_")
            .unwrap()
            .strip_suffix(".json")
            .unwrap()
    ));
}

/// The CDI name Allocate gave a container: its accounting directory's.
fn container_name(a: &Allocation) -> String {
    a.response.cdi_devices[1]
        .name
        .strip_prefix("gpumem.io/container=")
        .unwrap()
        .to_owned()
}

/// A container deleted while the plugin ran leaves its directory until the
/// grace period ends. A plugin restarted meanwhile, with the spec gone (a
/// reboot, or a hand), must not take that directory for a live container's:
/// kubelet holds its units for no one, so its spec is not written again,
/// and the directory goes by the clean-up rules.
#[tokio::test]
async fn a_restarted_plugin_does_not_write_the_spec_of_a_container_that_ended() {
    let host = Host::new();
    let mut plugin = Plugin::start(
        &host,
        &["--device-list-strategy", "cdi", "--state-grace-secs", "8"],
    )
    .await;
    let done = plugin.admit("done", 4).await;
    let name = container_name(&done);
    let spec = host
        .cdi_dir()
        .join(format!("gpumem.io-container_{name}.json"));
    let state = host.path("state").join("containers").join(&name);
    plugin.kubelet.remove_pod("done");
    // The running plugin's clean-up has kubelet forget the pod and rewrite
    // its checkpoint, well within the grace period.
    eventually(
        "kubelet's checkpoint to forget the ended pod",
        WAIT,
        POLL,
        async || {
            (!plugin.checkpoint().contains(&done.pod_uid()))
                .then_some(())
                .ok_or_else(|| plugin.logs())
        },
    )
    .await;
    assert!(state.is_dir() && spec.is_file());

    plugin
        .restart(
            &host,
            &["--device-list-strategy", "cdi", "--state-grace-secs", "1"],
            || std::fs::remove_file(&spec).unwrap(),
        )
        .await;
    eventually(
        "the ended container's state to go",
        WAIT,
        POLL,
        async || (!state.exists()).then_some(()).ok_or_else(|| plugin.logs()),
    )
    .await;
    let logs = plugin.logs();
    assert!(
        !logs.contains("wrote the missing CDI spec"),
        "the spec of a container that ended was written again:\n{logs}"
    );
    assert!(host.cdi_files().is_empty(), "{:?}", host.cdi_files());
}

/// A container given the units of one that ended, before clean-up removed
/// that one's directory, starts from a new accounting file: not the old
/// container's usage, peak and refusals under its own name.
#[tokio::test]
async fn a_container_given_the_units_of_one_that_ended_starts_afresh() {
    use gpumem::isolation::accounting;
    use gpumem_layout::device;
    use std::os::unix::fs::FileExt;

    let host = Host::new();
    let plugin = Plugin::start(&host, &["--device-list-strategy", "cdi"]).await;
    let done = plugin.admit("done", 4).await;
    let file = host
        .path("state")
        .join("containers")
        .join(container_name(&done))
        .join("accounting");
    // What the ended container's processes and the daemon recorded.
    accounting::publish_untracked(&file, 0, 600 << 20).unwrap();
    let record = gpumem_layout::device_offset(0) as u64;
    let writer = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    writer
        .write_all_at(&(3000u64 << 20).to_le_bytes(), record + device::PEAK as u64)
        .unwrap();
    writer
        .write_all_at(&7u64.to_le_bytes(), record + device::OOM_COUNT as u64)
        .unwrap();
    let old = &accounting::usage(&file).unwrap()[0];
    assert_eq!(
        (old.untracked_bytes, old.peak_bytes, old.refusals),
        (600 << 20, 3000 << 20, 7)
    );

    plugin.kubelet.remove_pod("done");
    let next = plugin.admit("next", 4).await;
    let sorted = |a: &Allocation| a.device_ids.iter().cloned().collect::<BTreeSet<_>>();
    assert_eq!(sorted(&next), sorted(&done), "not given the same units");
    assert_eq!(container_name(&next), container_name(&done));
    let new = &accounting::usage(&file).unwrap()[0];
    assert_eq!(
        (new.untracked_bytes, new.peak_bytes, new.refusals),
        (0, 0, 0),
        "the new container inherited the ended one's accounting"
    );
    assert_eq!(new.cap_bytes, old.cap_bytes);
}

#[test]
fn a_bad_strategy_is_refused_naming_the_flag_and_the_choices() {
    for (args, env) in [
        (vec!["plugin", "--device-list-strategy", "cdi-cri"], None),
        (vec!["plugin"], Some("volume_mounts")),
    ] {
        let mut cmd = gpumem();
        cmd.args(&args);
        if let Some(value) = env {
            cmd.env("GPUMEM_DEVICE_LIST_STRATEGY", value);
        }
        let out = cmd.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        let bad = env.unwrap_or("cdi-cri");
        assert!(
            stderr.contains(&format!(
                "invalid value '{bad}' for '--device-list-strategy"
            )),
            "{stderr}"
        );
        assert!(
            stderr.contains("[possible values: envvar, volume-mounts, cdi]"),
            "{stderr}"
        );
    }
}

#[test]
fn the_spec_check_refuses_what_the_cdi_spec_refuses() {
    let good = serde_json::json!({
        "cdiVersion": "0.5.0",
        "kind": "gpumem.io/container",
        "devices": [{"name": "5f1c09a2-4u-00ff", "containerEdits": {
            "env": ["A=1"],
            "mounts": [{"hostPath": "/a", "containerPath": "/b", "options": ["ro", "rbind"]}]
        }}]
    });
    check_cdi_spec(&good).unwrap();
    let bad = |edit: &dyn Fn(&mut Value)| {
        let mut spec = good.clone();
        edit(&mut spec);
        check_cdi_spec(&spec).expect_err(&spec.to_string());
    };
    bad(&|s| s["cdiVersion"] = "0.4.0".into()); // a name starting with a digit
    bad(&|s| s["cdiVersion"] = "2.0.0".into());
    bad(&|s| s["kind"] = "container".into());
    bad(&|s| s["kind"] = "gpumem.io/container/x".into());
    bad(&|s| s["kind"] = "Gpumem.io/container".into());
    bad(&|s| s["devices"] = serde_json::json!([]));
    bad(&|s| s["devices"][0]["name"] = "a/b".into());
    bad(&|s| s["devices"][0]["name"] = "-a".into());
    bad(&|s| s["devices"][0]["containerEdits"] = serde_json::json!({}));
    bad(&|s| s["devices"][0]["containerEdits"]["env"][0] = "=1".into());
    bad(&|s| s["devices"][0]["containerEdits"]["env"][0] = "A".into());
    bad(&|s| s["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] = "".into());
    bad(&|s| s["devices"][0]["containerEdits"]["mounts"][0]["options"] = "ro".into());
    bad(&|s| s["devices"][0]["extra"] = 1.into());
    bad(&|s| s["extra"] = 1.into());
}

#[cfg(feature = "demo")]
#[test]
fn the_demo_shows_what_each_strategy_gives() {
    // The shim, the fake driver and the probe: the demo's containers then
    // run under the shim, as the env and mounts they were given say.
    let tenant_dir = common::shim_kit().probe.parent().unwrap();
    let demo = |strategy: &str| {
        let out = gpumem()
            .args(["demo", "--device-list-strategy", strategy, "--tenant-dir"])
            .arg(tenant_dir)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The first scenario's: the second (scheduling by GPU) has a node
        // and strategy of its own.
        stdout
            .split("\nScheduling by GPU:")
            .next()
            .unwrap_or_default()
            .to_owned()
    };
    let cdi = demo("cdi");
    assert!(
        cdi.contains(&format!("(CDI device nvidia.com/gpu={T4_UUID})")),
        "{cdi}"
    );
    assert!(cdi.contains("(CDI device gpumem.io/container="), "{cdi}");
    // The cap comes from the container's spec; nothing names the GPU in the env.
    assert!(cdi.contains("GPUMEM_LIMIT_MIB=4308"), "{cdi}");
    assert!(!cdi.contains("NVIDIA_VISIBLE_DEVICES"), "{cdi}");
    // Each container's process found its cap and accounting directory
    // through its spec, and was held to the cap.
    assert_eq!(
        cdi.matches("the next 256 MiB refused: CUDA_ERROR_OUT_OF_MEMORY")
            .count(),
        3,
        "{cdi}"
    );
    let mounts = demo("volume-mounts");
    assert!(
        mounts.contains("NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices"),
        "{mounts}"
    );
    assert!(!mounts.contains("CDI device"), "{mounts}");
}
