//! What the daemon reports: GPU health reaching kubelet, `/healthz` and
//! `/metrics` on its endpoint, who holds what on `/status`.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::daemon::{shim, Daemon};
use common::status_fixture;
use common::wait::{eventually, POLL};
use common::{shim_kit, RESOURCE, WAIT};
use gpumem::isolation::inject::Isolation;
use gpumem_testkit::simulator::KubeletSim;

#[tokio::test]
async fn an_unhealthy_gpu_stops_receiving_pods_and_recovers() {
    let d = Daemon::start("t4", Isolation::None, Duration::from_secs(300)).await;
    d.set_healthy(false);
    let started = tokio::time::Instant::now();
    let devices = d
        .k()
        .wait_for_list(RESOURCE, WAIT, |l| {
            l.iter().all(|dev| dev.health == "Unhealthy")
        })
        .await
        .expect("units marked Unhealthy");
    // Not a timing assertion, a sanity bound: the watcher ticks every 250 ms.
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(devices.len(), 14, "still advertised, as Unhealthy");
    assert!(d.k().admit("nb", "main", RESOURCE, 1).await.is_err());
    let (code, body) = d.get("/metrics").await;
    assert_eq!(code, 200);
    assert!(
        body.contains(
            "gpumem_gpu_healthy{gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 0"
        ),
        "{body}"
    );

    d.set_healthy(true);
    d.k()
        .wait_for_list(RESOURCE, WAIT, |l| {
            l.iter().all(|dev| dev.health == "Healthy")
        })
        .await
        .expect("healthy again");
    d.k().admit("nb", "main", RESOURCE, 1).await.unwrap();
    d.stop().await;
}

#[tokio::test]
async fn status_and_metrics_show_who_holds_what() {
    let host = common::installed_shim();
    let state = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        "v100x2",
        shim(host.path(), state.path()),
        Duration::from_secs(300),
    )
    .await;
    for pod in ["nb-1", "nb-2", "nb-3"] {
        d.k().admit(pod, "main", RESOURCE, 4).await.unwrap();
    }
    // One container's process really holds memory under the shim.
    let first = d.k().allocations()[0].response.mounts[2].host_path.clone();
    let mut holder = shim_kit()
        .probe(Some(Path::new(&first)))
        .env("FAKEGPU_UUIDS", "GPU-1a2b3c4d-0000-4000-8000-000000010000")
        .args(["alloc:1000", "hold"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_line(&mut holder, "holding");

    let status = d.status().await;
    assert!(status.registered);
    assert_eq!(status.gpus[0].allocated_units, 12);
    assert_eq!(status.gpus[1].allocated_units, 0);
    assert_eq!(status.containers.len(), 3);
    let nb1 = &status.containers[0];
    assert_eq!(
        (nb1.pod.as_deref(), nb1.gpu, nb1.units, nb1.cap_mib),
        (Some("nb-1"), 0, 4, 4309)
    );
    // 1000 MiB and its 300 MiB context.
    assert_eq!(nb1.used_mib, Some(1300));
    assert_eq!(status.containers[1].used_mib, Some(0));

    let (code, body) = d.get("/healthz").await;
    assert_eq!((code, body.trim()), (200, "ok"));
    let (_, metrics) = d.get("/metrics").await;
    for expected in [
        "gpumem_gpu_allocated_units{gpu=\"0\",UUID=\"GPU-1a2b3c4d-0000-4000-8000-000000010000\",modelName=\"Tesla V100-SXM2-16GB\",Hostname=\"test-node\"} 12",
        "gpumem_gpu_units{gpu=\"1\",UUID=\"GPU-1a2b3c4d-0000-4000-8000-000000010001\",modelName=\"Tesla V100-SXM2-16GB\",Hostname=\"test-node\"} 15",
        "gpumem_container_cap_bytes{namespace=\"default\",pod=\"nb-1\",container=\"main\",gpu=\"0\",UUID=\"GPU-1a2b3c4d-0000-4000-8000-000000010000\",modelName=\"Tesla V100-SXM2-16GB\",Hostname=\"test-node\"} 4518313984",
        "gpumem_container_used_bytes{namespace=\"default\",pod=\"nb-1\",container=\"main\",gpu=\"0\",UUID=\"GPU-1a2b3c4d-0000-4000-8000-000000010000\",modelName=\"Tesla V100-SXM2-16GB\",Hostname=\"test-node\"} 1363148800",
        "gpumem_allocate_calls_total 3",
        "gpumem_allocate_errors_total 0",
        "gpumem_registrations_total 1",
        "gpumem_registered 1",
    ] {
        assert!(metrics.contains(expected), "missing {expected}:\n{metrics}");
    }
    holder.kill().unwrap();
    holder.wait().unwrap();
    d.stop().await;
}

#[tokio::test]
async fn healthz_fails_while_not_registered() {
    let mut d = Daemon::start("t4", Isolation::None, Duration::from_secs(300)).await;
    assert_eq!(d.get("/healthz").await.0, 200);
    // kubelet goes away (and kubelet.sock with it): we are no longer registered.
    d.kubelet.take().unwrap().stop().await;
    let started = std::time::Instant::now();
    eventually("healthz to fail", WAIT, POLL, async || {
        (d.get("/healthz").await.0 == 503)
            .then_some(())
            .ok_or("healthz kept passing")
    })
    .await;
    let (_, body) = d.get("/metrics").await;
    assert!(body.contains("gpumem_registered 0"), "{body}");
    // It comes back, we register again, the probe passes again.
    d.kubelet = Some(KubeletSim::start(d.dir.path()).unwrap());
    d.k()
        .wait_for_devices(RESOURCE, 1, WAIT)
        .await
        .expect("registered again");
    let left = WAIT.saturating_sub(started.elapsed());
    eventually("healthz to pass", left, POLL, async || {
        (d.get("/healthz").await.0 == 200)
            .then_some(())
            .ok_or("healthz did not recover")
    })
    .await;
    d.stop().await;
}

#[tokio::test]
async fn pod_resources_is_read_within_kubelets_rate_limit() {
    let d = Daemon::start("t4", Isolation::None, Duration::from_secs(300)).await;
    d.k().admit("nb", "main", RESOURCE, 4).await.unwrap();
    let calls: Vec<_> = (0..50).map(|_| d.status()).collect();
    for status in futures_util::future::join_all(calls).await {
        assert_eq!(status.containers.len(), 1);
    }
    let (answered, refused) = d.k().pod_resources_calls();
    assert_eq!(refused, 0, "never rate-limited");
    assert!(
        answered <= 3,
        "50 status requests cost {answered} pod-resources calls"
    );
    d.stop().await;
}

/// The body the e2e runner decodes, with a container holding units under
/// the shim: the fields of tests/fixtures/status/device-plugin.json.
#[tokio::test]
async fn status_has_the_fields_the_e2e_runner_decodes() {
    let host = common::installed_shim();
    let state = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        "t4",
        shim(host.path(), state.path()),
        Duration::from_secs(300),
    )
    .await;
    d.k().admit("nb", "main", RESOURCE, 4).await.unwrap();
    let body = status_fixture::raw_status(&d.status_socket).await;
    status_fixture::check(
        "device-plugin",
        &body,
        &[
            (&state.path().display().to_string(), "/var/lib/gpumem"),
            (&host.path().display().to_string(), "/usr/local/gpumem"),
        ],
    );
    d.stop().await;
}
