//! `--memory-unit` changed under running containers: their caps hold, and
//! the change is said.

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use common::daemon::{samples_over, shim, spawn_daemon, wait_for_checks};
use common::wait::{poll, POLL};
use common::{fixture, swept_past_the_grace, RESOURCE, WAIT};
use gpumem::isolation::enforce::OverCapAction;
use gpumem::node::units::MemoryUnit;
use gpumem_testkit::simulator::KubeletSim;

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
    let grace = Duration::from_millis(400);
    let start = |unit, metrics| {
        spawn_daemon(
            dir.path(),
            &node_file,
            shim(host.path(), state.path()),
            unit,
            |config| {
                config.pod_resources_socket = kubelet.pod_resources_socket();
                config.common.over_cap = Some((OverCapAction::Kill, grace));
                config.common.metrics = metrics;
            },
        )
    };

    let (stop, task) = start(MemoryUnit::GiB, None);
    kubelet.wait_for_devices(RESOURCE, 1, WAIT).await.unwrap();
    let allocation = kubelet.admit("nb", "main", RESOURCE, 4).await.unwrap();
    assert_eq!(allocation.response.envs["GPUMEM_LIMIT_MIB"], "4308");
    let container_dir = PathBuf::from(&allocation.response.mounts[2].host_path);
    stop.cancel();
    task.await.unwrap().unwrap();

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, task) = start(MemoryUnit::MiB, Some(listener));
    kubelet.wait_for_devices(RESOURCE, 2, WAIT).await.unwrap();
    let mut worker = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let mountinfo = common::mountinfo_with_state_dir(&container_dir);
    common::list_fake_process(&node_file, worker.id(), 2000, &[("mountinfo", &mountinfo)]);
    // Checked over two grace periods, every sample with the worker listed:
    // read as 4 MiB, the cap would have had it killed by then.
    wait_for_checks(addr, samples_over(2 * grace)).await;
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
        // Not there in time: the count below says so, with the log.
        let _ = poll(WAIT, POLL, async || {
            log(1).contains(said).then_some(()).ok_or(())
        })
        .await;
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
