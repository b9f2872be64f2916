//! Processes a container starts without the pod's environment (`env -i`,
//! `su -`, the login shells ssh and cron give) are capped all the same: the
//! cap comes from what Allocate mounts (`/etc/ld.so.preload` and the state
//! directory at `/var/run/gpumem`), never from the env. Each case runs the
//! real shim in a real process inside a mount namespace laid out as a
//! container is: an overlay on `/etc` holding the preload list, and the
//! container's accounting directory bound where the shim looks by default.

mod common;

use std::path::Path;
use std::process::Command;

use common::{shim_kit, MIB};

/// Cap of the container: a 300 MiB context and 512 MiB fit, 512 more do not.
const CAP_MIB: u64 = 1024;

/// Runs `script` in a private mount namespace set up as a container: the
/// preload list names the shim, and the state directory is mounted at the
/// shim's default path. `sh -c` there, so the script sets its own env.
fn in_container(state: &Path, script: &str) -> (bool, String, String) {
    let kit = shim_kit();
    let scratch = tempfile::tempdir().unwrap();
    let (upper, work) = (scratch.path().join("upper"), scratch.path().join("work"));
    std::fs::create_dir_all(&upper).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let setup = format!(
        "set -e
         mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={work} /etc
         echo {shim} > /etc/ld.so.preload
         mount -t tmpfs gpumem-run /run
         mkdir -p /run/gpumem
         mount --bind {state} /run/gpumem
         set +e
         {script}",
        upper = upper.display(),
        work = work.display(),
        shim = kit.shim.display(),
        state = state.display(),
    );
    // Root (CI, the GPU host) makes the namespace directly; anyone else
    // through a user namespace of their own.
    let mut cmd = Command::new("unshare");
    // /proc/self belongs to the effective user.
    let root = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap()) == 0;
    if !root {
        cmd.args(["--user", "--map-root-user"]);
    }
    let out = cmd
        .args(["--mount", "--propagation", "private", "sh", "-c", &setup])
        .env("FAKE", &kit.driver_dir)
        .env("PROBE", &kit.probe)
        .output()
        .expect("unshare (util-linux) runs the container's mount namespace");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The probe's steps: what NVML reports, then 512 MiB twice.
const STEPS: &str = "nvml alloc:512 alloc:512";

/// The probe's results for `STEPS`: NVML's total in MiB, then each
/// allocation's CUDA result.
fn results(stdout: &str) -> (u64, Vec<i64>) {
    let nvml = stdout
        .lines()
        .find(|l| l.starts_with("nvml "))
        .unwrap_or_else(|| panic!("no nvml line in {stdout:?}"));
    let total = nvml
        .split_whitespace()
        .find_map(|w| w.strip_prefix("total=")?.parse::<u64>().ok())
        .unwrap();
    let allocs = stdout
        .lines()
        .filter(|l| l.starts_with("alloc:512"))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse().unwrap())
        .collect();
    (total / MIB, allocs)
}

fn assert_capped(how: &str, script: &str) {
    let state = common::capped_dir(CAP_MIB);
    let (ok, stdout, stderr) = in_container(state.path(), script);
    assert!(ok, "{how}: {stdout}{stderr}");
    assert_eq!(
        results(&stdout),
        (CAP_MIB, vec![0, 2]),
        "{how}: NVML sees the cap and the second 512 MiB is refused\n{stdout}{stderr}"
    );
}

#[test]
fn a_process_started_with_an_empty_env_is_capped() {
    // The fake driver's directory stands in for the driver the NVIDIA
    // toolkit mounts into the container's library path.
    assert_capped(
        "env -i",
        &format!("env -i LD_LIBRARY_PATH=\"$FAKE\" \"$PROBE\" {STEPS}"),
    );
}

#[test]
fn a_login_shell_as_su_ssh_and_cron_give_is_capped() {
    // `su -` clears the env and starts a login shell, as sshd does for a
    // session; cron runs `sh -c` with an env of a few variables.
    assert_capped(
        "su -",
        &format!("su - root -c \"LD_LIBRARY_PATH=$FAKE $PROBE {STEPS}\""),
    );
    assert_capped(
        "cron-like sh -c",
        &format!(
            "env -i HOME=/root LOGNAME=root PATH=/usr/bin:/bin SHELL=/bin/sh \
             sh -c 'LD_LIBRARY_PATH=\"$0\" \"$1\" {STEPS}' \"$FAKE\" \"$PROBE\""
        ),
    );
}

#[test]
fn without_the_mounts_the_same_process_is_not_capped() {
    // The control: nothing in the env caps anything, so without the
    // preload list the second allocation is granted.
    let kit = shim_kit();
    let out = Command::new("env")
        .args([
            "-i",
            &format!("LD_LIBRARY_PATH={}", kit.driver_dir.display()),
        ])
        .arg(&kit.probe)
        .args(STEPS.split(' '))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (total, allocs) = results(&stdout);
    assert!(total > CAP_MIB, "{stdout}");
    assert_eq!(allocs, [0, 0], "{stdout}");
}
