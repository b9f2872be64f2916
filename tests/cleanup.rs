//! Clean-up of containers' accounting state: kept while kubelet lists the
//! container (init containers too) or a process uses it, then removed.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::daemon::Daemon;
use common::wait::{eventually, POLL};
use common::{shim_kit, swept_twice_past_the_grace, RESOURCE, WAIT};

#[tokio::test]
async fn an_init_container_keeps_its_state_until_its_pod_ends() {
    let grace = Duration::from_millis(400);
    let (d, _host, state) = Daemon::with_shim(grace).await;
    // Admitted, and waiting for its image longer than the grace period:
    // pod-resources never lists it, kubelet's checkpoint does.
    let dir = admit_init_container(&d, "slow").await;
    swept_twice_past_the_grace(state.path()).await;
    assert!(
        dir.join("accounting").exists(),
        "an admitted init container lost its state before it started"
    );

    // Its pod ends, and nothing else is allocated on the node: its state
    // still goes after the grace period.
    d.k().remove_pod("slow");
    eventually(
        "the removal of an ended init container's state",
        WAIT,
        POLL,
        async || (!dir.exists()).then_some(()),
    )
    .await;
    d.stop().await;
}

#[tokio::test]
async fn a_kubelet_that_lists_ended_pods_still_lets_their_init_state_go() {
    let grace = Duration::from_millis(400);
    let (d, _host, state) = Daemon::with_shim(grace).await;
    // Kubelets before 1.34 list an ended pod (a finished Job's, say), without
    // devices, until it is deleted: ending a pod whose GPU was only in its
    // init container changes nothing List shows.
    d.k().list_ended_pods();
    let dir = admit_init_container(&d, "job").await;
    swept_twice_past_the_grace(state.path()).await;
    assert!(dir.join("accounting").exists(), "removed while its pod ran");
    d.k().remove_pod("job");
    eventually(
        "the removal of an ended pod's init container state",
        WAIT,
        POLL,
        async || (!dir.exists()).then_some(()),
    )
    .await;
    d.stop().await;
}

/// Admits `pod`, whose only container with units is its init container
/// `fetch-model` (4 units); returns that container's accounting directory.
async fn admit_init_container(d: &Daemon, pod: &str) -> PathBuf {
    d.k().declare_init_container(pod, "fetch-model");
    let init = d.k().admit(pod, "fetch-model", RESOURCE, 4).await.unwrap();
    PathBuf::from(&init.response.mounts[2].host_path)
}

#[tokio::test]
async fn finished_containers_state_is_removed_after_the_grace_period_only() {
    let grace = Duration::from_millis(800);
    let (d, _host, state) = Daemon::with_shim(grace).await;
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

    eventually(
        "the removal of a finished container's state",
        WAIT,
        POLL,
        async || (!done.exists()).then_some(()),
    )
    .await;
    // Sweeps past the grace period later, the others are still there.
    swept_twice_past_the_grace(state.path()).await;
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
    eventually(
        "the removal of the orphan's state",
        WAIT,
        POLL,
        async || (!orphan.exists()).then_some(()),
    )
    .await;
    assert!(running.exists());
    d.stop().await;
}
