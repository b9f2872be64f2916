//! GPU health from NVML, end to end: the real binary over the fake driver as
//! `libnvidia-ml.so.1`, whose health file a test edits, and what kubelet sees.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::{shim_kit, RESOURCE, WAIT};
use gpumem::deviceplugin::api::deviceplugin::Device;
use gpumem::node::inventory::GpuKey;
use gpumem_testkit::simulator::KubeletSim;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;

const A: &str = "GPU-6b1c2d3e-0000-4000-8000-0000000000a1";
const B: &str = "GPU-6b1c2d3e-0000-4000-8000-0000000000b2";
const HEALTHY: &str = "Healthy";
const UNHEALTHY: &str = "Unhealthy";
/// What the log says when a GPU turns Unhealthy.
const UNHEALTHY_LOG: &str = "GPU unhealthy: its units stop receiving pods";
/// What it says of a GPU it cannot read at start.
const LOST_LOG: &str = "cannot read this GPU (lost, or needing a reset?): it is not advertised \
                        until gpumem restarts; the node's other GPUs are";
/// What it says when an Unhealthy GPU shows another problem.
const ANOTHER_LOG: &str = "GPU still unhealthy, now for another reason";

/// `gpumem plugin` on two fake GPUs, A and B, with a recovery time of one
/// second, watched through the kubelet simulator.
struct Plugin {
    dir: TempDir,
    kubelet: KubeletSim,
    child: Child,
    /// The fake driver's `FAKEGPU_HEALTH_FILE`.
    health: PathBuf,
    starts: usize,
    env: Vec<(String, String)>,
}

impl Plugin {
    async fn start(env: &[(&str, &str)]) -> Plugin {
        Plugin::start_reporting(env, &[]).await
    }

    /// Starts with these lines already in the health file.
    async fn start_reporting(env: &[(&str, &str)], lines: &[String]) -> Plugin {
        let mut plugin = Plugin::spawn_reporting(env, lines);
        plugin.registered().await;
        plugin
    }

    /// Spawns it with these lines in the health file, without waiting for
    /// it to register.
    fn spawn_reporting(env: &[(&str, &str)], lines: &[String]) -> Plugin {
        let dir = tempfile::tempdir().unwrap();
        let kubelet = KubeletSim::start(dir.path()).unwrap();
        let health = dir.path().join("health");
        std::fs::write(&health, lines.join("\n") + "\n").unwrap();
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let child = spawn(&dir, &health, &env, 0);
        Plugin {
            dir,
            kubelet,
            child,
            health,
            starts: 0,
            env,
        }
    }

    /// Waits for the latest start's registration, all Healthy.
    async fn registered(&mut self) {
        self.starts += 1;
        self.kubelet
            .wait_for_devices(RESOURCE, self.starts, WAIT)
            .await
            .unwrap_or_else(|| panic!("plugin did not register; log:\n{}", self.log()));
        self.until("started", HEALTHY, HEALTHY).await;
    }

    /// Stops the plugin (SIGTERM) and starts it again, as after a GPU reset.
    async fn restart(&mut self) {
        self.stop();
        assert!(self.kubelet.wait_for_disconnect(RESOURCE, WAIT).await);
        self.child = spawn(&self.dir, &self.health, &self.env, self.starts);
        self.registered().await;
    }

    fn stop(&mut self) {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "{status}; log:\n{}", self.log());
    }

    /// Replaces the health file whole, so the fake never reads half of it.
    fn report(&self, lines: &[String]) {
        let staging = self.dir.path().join("health.new");
        std::fs::write(&staging, lines.join("\n") + "\n").unwrap();
        std::fs::rename(&staging, &self.health).unwrap();
    }

    /// Waits until kubelet's list shows A's and B's units as `a` and `b`.
    async fn until(&self, what: &str, a: &str, b: &str) {
        let seen = self
            .kubelet
            .wait_for_list(RESOURCE, WAIT, |list| {
                health_of(list, A) == Some(a) && health_of(list, B) == Some(b)
            })
            .await;
        if seen.is_none() {
            let now = self.kubelet.devices(RESOURCE).unwrap_or_default();
            panic!(
                "{what}: wanted A {a} and B {b}, kubelet has A {:?} and B {:?}; log:\n{}",
                health_of(&now, A),
                health_of(&now, B),
                self.log()
            );
        }
    }

    /// The plugin's log so far, over all its starts.
    fn log(&self) -> String {
        (0..=self.starts)
            .filter_map(|n| std::fs::read_to_string(log_path(&self.dir, n)).ok())
            .collect()
    }

    /// The log's JSON lines with this message about this GPU.
    fn logged(&self, message: &str, uuid: &str) -> Vec<serde_json::Value> {
        self.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| l["fields"]["message"] == message && l["fields"]["uuid"] == uuid)
            .collect()
    }

    /// The log's JSON lines with this message, about any GPU.
    fn logged_anywhere(&self, message: &str) -> Vec<serde_json::Value> {
        self.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| l["fields"]["message"] == message)
            .collect()
    }

    /// Why `uuid` is Unhealthy, as last logged.
    fn reason(&self, uuid: &str) -> String {
        let lines: Vec<_> = self
            .log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| {
                let message = &l["fields"]["message"];
                l["fields"]["uuid"] == uuid && (message == UNHEALTHY_LOG || message == ANOTHER_LOG)
            })
            .collect();
        let last = lines
            .last()
            .unwrap_or_else(|| panic!("{uuid} never logged as unhealthy; log:\n{}", self.log()));
        last["fields"]["reason"].as_str().unwrap().to_owned()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        // A failed test must not leave the plugin running.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn log_path(dir: &TempDir, start: usize) -> PathBuf {
    dir.path().join(format!("plugin-{start}.log"))
}

fn spawn(dir: &TempDir, health: &PathBuf, env: &[(String, String)], start: usize) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpumem"));
    for (key, _) in std::env::vars() {
        if key.starts_with("GPUMEM_") || key.starts_with("FAKEGPU_") {
            cmd.env_remove(key);
        }
    }
    cmd.args(["--log-format", "json", "plugin", "--isolation", "none"])
        .args([
            "--metrics-addr",
            "",
            "--status-socket",
            "",
            "--health-recovery-secs",
            "1",
        ])
        .arg("--kubelet-dir")
        .arg(dir.path())
        .env("LD_LIBRARY_PATH", &shim_kit().driver_dir)
        .env("FAKEGPU_UUIDS", format!("{A},{B}"))
        .env("FAKEGPU_HEALTH_FILE", health)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log_path(dir, start)).unwrap())
        .spawn()
        .unwrap()
}

/// The health of `uuid`'s units, if they all have the same.
fn health_of<'a>(list: &'a [Device], uuid: &str) -> Option<&'a str> {
    let prefix = format!("{}-", GpuKey::of(uuid));
    let mut units = list.iter().filter(|d| d.id.starts_with(&prefix));
    let first = units.next()?.health.as_str();
    units.all(|d| d.health == first).then_some(first)
}

fn line(uuid: &str, what: &str) -> String {
    format!("{uuid} {what}")
}

#[tokio::test]
async fn an_xid_that_needs_a_reset_holds_the_gpu_until_then_and_others_recover() {
    let mut p = Plugin::start(&[]).await;
    // 13 is an application's (ignored by default); 94, a contained ECC
    // error, needs only the application restarted (the Xid catalog's
    // RESTART_APP): B recovers after a quiet second.
    let mut lines = vec![line(A, "xid 13"), line(B, "xid 94")];
    p.report(&lines);
    p.until("XID 94 on B", HEALTHY, UNHEALTHY).await;
    p.until("B quiet for a second", HEALTHY, HEALTHY).await;
    assert!(p.logged(UNHEALTHY_LOG, A).is_empty(), "{}", p.log());

    // 48, a double-bit ECC error, needs a reset: A stays Unhealthy while B,
    // marked after it, recovers.
    lines.extend([line(A, "xid 48"), line(B, "xid 94")]);
    p.report(&lines);
    p.until("XID 48 on A, 94 on B", UNHEALTHY, UNHEALTHY).await;
    p.until("B recovered", UNHEALTHY, HEALTHY).await;
    let reason = p.reason(A);
    assert!(
        reason.contains("XID 48") && reason.contains("reset"),
        "{reason}"
    );

    // Resetting a GPU takes every NVML client off it, this plugin too; the
    // plugin that starts afterwards does not replay old XIDs.
    p.restart().await;
    lines.push(line(B, "xid 79"));
    p.report(&lines);
    p.until("XID 79 (fallen off the bus) on B", HEALTHY, UNHEALTHY)
        .await;
    assert!(p.reason(B).contains("XID 79"));
    p.stop();
}

#[tokio::test]
async fn a_gpu_that_takes_no_xid_events_costs_no_other_gpu_its_own() {
    // NVML frees an event set when a registration fails: A, refusing,
    // must not take B's XIDs with it.
    let mut lines = vec![line(A, "xid-events refused")];
    let mut p = Plugin::start_reporting(&[], &lines).await;
    let refused = p.logged_anywhere("XID events unavailable; only polling this GPU");
    assert_eq!(refused.len(), 1, "{}", p.log());
    assert_eq!(refused[0]["fields"]["gpu"], 0);
    lines.push(line(B, "xid 94"));
    p.report(&lines);
    p.until("XID 94 on B", HEALTHY, UNHEALTHY).await;
    p.until("B quiet for a second", HEALTHY, HEALTHY).await;

    // A GPU whose supported event types lack XIDs is not even tried.
    lines = vec![line(A, "xid-events unsupported")];
    p.report(&lines);
    p.restart().await;
    let watching = p.logged_anywhere("watching XID events");
    assert_eq!(watching.len(), 2, "{}", p.log());
    assert_eq!(watching[1]["fields"]["gpus"], "[1]");
    assert_eq!(
        p.logged_anywhere("the GPU reports no XID events; only polling this GPU")
            .len(),
        1,
        "{}",
        p.log()
    );
    lines.push(line(B, "xid 79"));
    p.report(&lines);
    p.until("XID 79 on B", HEALTHY, UNHEALTHY).await;
    p.stop();
}

#[tokio::test]
async fn a_pending_or_failed_row_remap_holds_the_gpu_until_it_is_reset() {
    let mut p = Plugin::start(&[]).await;
    p.report(&[line(A, "remap pending")]);
    p.until("remap pending on A", UNHEALTHY, HEALTHY).await;
    assert!(p.reason(A).contains("row remapping pending"), "{}", p.log());
    // Still Unhealthy after B's recoverable XID has come and gone.
    p.report(&[line(A, "remap pending"), line(B, "xid 94")]);
    p.until("XID 94 on B", UNHEALTHY, UNHEALTHY).await;
    p.until("B recovered", UNHEALTHY, HEALTHY).await;

    // A reset applies A's remap and clears the flag; B's remap fails.
    p.report(&[line(B, "xid 94"), line(B, "remap failure")]);
    p.until("A reset, B's remap failed", HEALTHY, UNHEALTHY)
        .await;
    assert!(p.reason(B).contains("row remapping failed"), "{}", p.log());
    // A failed remap never clears (the GPU is due for replacement): B stays
    // Unhealthy while an XID on A comes and goes. Page retirement is
    // NOT_SUPPORTED on GPUs that remap rows, as on H100: A's line is moot.
    p.report(&[
        line(B, "xid 94"),
        line(B, "remap failure"),
        line(A, "retirement pending"),
        line(A, "xid 94"),
    ]);
    p.until("XID 94 on A", UNHEALTHY, UNHEALTHY).await;
    p.until("A recovered", HEALTHY, UNHEALTHY).await;
    p.stop();
}

#[tokio::test]
async fn before_ampere_pending_page_retirement_holds_the_gpu_until_it_is_reset() {
    let mut p = Plugin::start(&[("FAKEGPU_MEMORY_REPAIR", "retirement")]).await;
    p.report(&[line(A, "retirement pending"), line(B, "xid 94")]);
    p.until("retirement pending on A, XID 94 on B", UNHEALTHY, UNHEALTHY)
        .await;
    p.until("B recovered", UNHEALTHY, HEALTHY).await;
    assert!(
        p.reason(A).contains("page retirement pending"),
        "{}",
        p.log()
    );
    p.report(&[]);
    p.until("A reset", HEALTHY, HEALTHY).await;
    p.stop();
}

#[tokio::test]
async fn a_lost_gpu_is_unhealthy_at_once_an_unknown_failure_only_if_it_persists() {
    let mut p = Plugin::start(&[]).await;
    // Two failed checks in a row: logged, but A stays Healthy. B's XID and
    // recovery second give A time for several more checks.
    p.report(&[line(A, "unknown-error 2"), line(B, "xid 94")]);
    p.until("XID 94 on B", HEALTHY, UNHEALTHY).await;
    p.until("B recovered", HEALTHY, HEALTHY).await;
    assert!(p.logged(UNHEALTHY_LOG, A).is_empty(), "{}", p.log());
    let failures = p.logged(
        "NVML could not check the GPU; Unhealthy if this goes on for `limit` checks in a row",
        A,
    );
    assert_eq!(failures.len(), 1, "{}", p.log());
    assert_eq!(failures[0]["fields"]["error"], "Unknown");
    assert_eq!(p.logged("NVML answers again", A).len(), 1, "{}", p.log());

    // A failing on: Unhealthy after three checks. B lost: at once.
    p.report(&[line(A, "unknown-error"), line(B, "lost")]);
    p.until("A failing, B lost", UNHEALTHY, UNHEALTHY).await;
    let reason = p.reason(A);
    assert!(reason.contains("3 checks in a row"), "{reason}");
    assert!(p.reason(B).contains("fallen off the bus"), "{}", p.log());

    // Both answer again: Healthy after the quiet second.
    p.report(&[]);
    p.until("both answer again", HEALTHY, HEALTHY).await;

    // NVML's own "needs a reset" holds until it stops saying so.
    p.report(&[line(A, "reset-required")]);
    p.until("A needs a reset", UNHEALTHY, HEALTHY).await;
    assert!(p.reason(A).contains("needs a reset"), "{}", p.log());
    p.stop();
}

/// A GPU that cannot be read when the plugin starts (it fell off the bus
/// while gpumem was down) costs the node only its own units: the others are
/// advertised and watched, and the log names it.
#[tokio::test]
async fn a_gpu_lost_before_the_start_costs_only_its_own_units() {
    let mut p = Plugin::spawn_reporting(&[], &[line(B, "lost")]);
    let list = p
        .kubelet
        .wait_for_list(RESOURCE, WAIT, |list| health_of(list, A) == Some(HEALTHY))
        .await
        .unwrap_or_else(|| panic!("A's units never came; log:\n{}", p.log()));
    assert_eq!(health_of(&list, B), None, "B has no units to advertise");
    // A's health is watched: an XID that needs a reset marks it.
    p.report(&[line(B, "lost"), line(A, "xid 48")]);
    let marked = p
        .kubelet
        .wait_for_list(RESOURCE, WAIT, |list| health_of(list, A) == Some(UNHEALTHY))
        .await;
    assert!(
        marked.is_some(),
        "A never turned Unhealthy; log:\n{}",
        p.log()
    );
    let lost = p.logged_anywhere(LOST_LOG);
    assert_eq!(lost.len(), 1, "{}", p.log());
    assert_eq!(lost[0]["fields"]["gpu"], 1);
    p.stop();
}

/// A GPU whose row remap failed before the plugin started is Unhealthy in
/// the very first list kubelet gets: kubelet admits the pods waiting for the
/// node's units as soon as they are listed, before any later update.
#[tokio::test]
async fn a_gpu_with_a_failed_remap_at_start_is_never_listed_healthy() {
    let mut p = Plugin::spawn_reporting(&[], &[line(B, "remap failure")]);
    let listed = p.kubelet.wait_for_devices(RESOURCE, 1, WAIT).await;
    assert!(
        listed.is_some(),
        "plugin did not register; log:\n{}",
        p.log()
    );
    let first = p.kubelet.first_devices(RESOURCE).unwrap();
    assert_eq!(health_of(&first, A), Some(HEALTHY), "{}", p.log());
    assert_eq!(health_of(&first, B), Some(UNHEALTHY), "{}", p.log());
    p.stop();
}
