//! Who holds what on a GPU: every process attributed to its container,
//! untracked usage counted against the cap, and the over-cap action.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::daemon::{Admitted, Daemon, Holding, POD_UID, RECONCILE};
use common::wait::{eventually, poll, POLL};
use common::{shim_kit, WAIT};
use gpumem::isolation::enforce::OverCapAction;
use gpumem_testkit::fake_apiserver::Kind;

#[tokio::test]
async fn memory_the_driver_holds_beyond_allocations_counts_against_the_cap() {
    let mut h = Holding::start(None).await;
    let (d, container, state) = (&h.d, &h.dir, h.state.path());
    let c = d
        .wait_for_container("charged", |c| c.used_mib == Some(1300))
        .await;
    assert_eq!(c.untracked_mib, Some(0));

    // A broken file beside it is skipped, not fatal.
    let junk = state.join("containers/junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("accounting"), b"not an accounting file").unwrap();

    // NVML shows the process at 1600 MiB: 300 MiB of libraries beside its
    // 1000 MiB allocation and 300 MiB context.
    d.list_process(h.holder.id(), 1600, &[]);
    let c = d
        .wait_for_container("untracked usage published", |c| {
            c.untracked_mib == Some(300)
        })
        .await;
    assert_eq!(c.used_mib, Some(1600));
    let (_, metrics) = d.get("/metrics").await;
    for expected in [
        "gpumem_container_untracked_bytes{namespace=\"default\",pod=\"nb\",container=\"main\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 314572800",
        // What processes hold beyond their charges: reconciliation's part.
        "gpumem_gpu_process_overhead_bytes{gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 314572800",
    ] {
        assert!(metrics.contains(expected), "missing {expected}:\n{metrics}");
    }

    // Another process of the container sees 4308 - 1600 MiB left, less its
    // own context, and the cap holds there, not 300 MiB later.
    let (ok, lines, stderr) = common::run_lines(shim_kit().probe(Some(container)).args([
        "info",
        "nvml",
        "alloc:2409",
        "alloc:2408",
    ]));
    assert!(ok, "{stderr}");
    assert_eq!(
        common::field(&lines[1], "free"),
        2408 * common::MIB,
        "{lines:?}"
    );
    assert_eq!(
        common::field(&lines[2], "used"),
        1900 * common::MIB,
        "{lines:?}"
    );
    assert_eq!(
        common::field(&lines[3], "used"),
        1900 * common::MIB,
        "{lines:?}"
    );
    assert_eq!(lines[4..], ["alloc:2409 2 #0", "alloc:2408 0 #1"]);
    let c = d
        .wait_for_container("refusal counted", |c| c.refused_allocations == Some(1))
        .await;
    assert_eq!(c.peak_mib, Some(4308));
    let (_, metrics) = d.get("/metrics").await;
    for expected in [
        "# TYPE gpumem_container_refused_allocations counter",
        "gpumem_container_refused_allocations_total{namespace=\"default\",pod=\"nb\",container=\"main\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 1",
        "gpumem_container_peak_bytes{namespace=\"default\",pod=\"nb\",container=\"main\",gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 4517265408",
    ] {
        assert!(metrics.contains(expected), "missing {expected}:\n{metrics}");
    }

    // The process exits: its untracked usage goes with it.
    h.holder.kill().unwrap();
    h.holder.wait().unwrap();
    d.wait_for_container("released", |c| {
        c.untracked_mib == Some(0) && c.used_mib == Some(0)
    })
    .await;
    h.d.stop().await;
}

#[tokio::test]
async fn every_gpu_process_is_attributed_by_its_cgroup() {
    let container = in_container;
    let h = Holding::start(None).await;
    let (d, dir) = (&h.d, &h.dir);

    // The holder runs in container a. Beside it in the same container, a
    // process that did not load the shim (a static binary, say) holds
    // 500 MiB; container b of another pod reached the GPU without asking
    // for it, and a host daemon holds some too.
    d.list_process(h.holder.id(), 1300, &[("cgroup", &container('a'))]);
    d.list_process(900_001, 500, &[("cgroup", &container('a'))]);
    d.list_process(900_002, 700, &[("cgroup", &container('b'))]);
    d.list_process(
        900_003,
        200,
        &[("cgroup", "0::/system.slice/monitoring.service\n")],
    );
    // The shim-less process counts against its container's cap at once.
    let c = d
        .wait_for_container("the shim-less process counted", |c| {
            c.untracked_mib == Some(500)
        })
        .await;
    assert_eq!(c.used_mib, Some(1800));
    let status = d.status().await;
    assert_eq!(status.gpus[0].unmanaged_mib, Some(900), "{status:?}");
    assert!(
        status
            .table(false)
            .contains("warning: GPU0 has 900 MiB held outside every gpumem container"),
        "{}",
        status.table(false)
    );
    let (_, metrics) = d.get("/metrics").await;
    let expected = "gpumem_gpu_unmanaged_bytes{gpu=\"0\",UUID=\"GPU-6b1c2d3e-0000-4000-8000-000000000400\",modelName=\"Tesla T4\",Hostname=\"test-node\"} 943718400";
    assert!(metrics.contains(expected), "missing {expected}:\n{metrics}");

    // And the container's processes see it: 4308 - 1800 MiB left.
    let (ok, lines, stderr) = common::run_lines(shim_kit().probe(Some(dir)).args(["nvml"]));
    assert!(ok, "{stderr}");
    assert_eq!(
        common::field(&lines[0], "used"),
        1800 * common::MIB,
        "{lines:?}"
    );

    h.stop().await;
}

/// The driver takes a context's memory before the call that makes it
/// returns, and the shim charges it only then: a sample in between sees the
/// process hold it uncharged. Published as untracked, it would count twice
/// once charged, and refuse the container's first allocations.
#[tokio::test]
async fn a_context_being_made_is_not_untracked_usage() {
    let a = Admitted::start(None).await;
    let (d, dir) = (&a.d, &a.dir);
    let started = std::time::Instant::now();
    const MAKING: Duration = Duration::from_secs(6);
    let mut maker = common::Killed(
        shim_kit()
            .probe(Some(dir))
            .env("FAKEGPU_CONTEXT_DELAY_MS", MAKING.as_millis().to_string())
            .args(["ctx:0", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Its slot is claimed before the context is made.
    let file = dir.join(gpumem_layout::FILE_NAME);
    eventually("its slot", WAIT, Duration::from_millis(20), async || {
        gpumem::isolation::accounting::processes(&file)
            .unwrap()
            .live
            .iter()
            .any(|p| p.pid == Some(maker.0.id()))
            .then_some(())
            .ok_or("no slot claimed")
    })
    .await;
    d.list_process(maker.0.id(), 300, &[]);
    // A process of the container without the shim, listed after: once its
    // 50 MiB are published, a sample has seen the context being made.
    let shimless = rogue();
    let mountinfo = common::mountinfo_with_state_dir(dir);
    d.list_process(shimless.0.id(), 50, &[("mountinfo", &mountinfo)]);
    let c = d
        .wait_for_container("the shim-less process counted", |c| {
            c.untracked_mib.is_some_and(|u| u >= 50)
        })
        .await;
    let in_time = started.elapsed() < MAKING && maker.0.try_wait().unwrap().is_none();
    assert!(in_time, "the context was made before a sample saw it");
    assert_eq!(c.untracked_mib, Some(50), "{c:?}");
    a.d.stop().await;
}

/// A process of the container exits: the kernel drops its record lock
/// with its files, but NVML lists its memory until the driver's part of the
/// exit is done, and its mount table can no longer be read. That is not a
/// process outside every container, at any sample while it lasts.
#[tokio::test]
async fn a_holder_on_its_way_out_is_not_taken_for_a_stranger() {
    let mut h = Holding::start(None).await;
    let d = &h.d;
    let pid = h.holder.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let close = stat.rfind(')').unwrap();
    let mut fields: Vec<String> = stat[close + 1..]
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    // PF_EXITING in its flags, as from the first step of its exit.
    fields[6] = (fields[6].parse::<u64>().unwrap() | 0x4).to_string();
    let exiting = format!("{}) {}\n", &stat[..close], fields.join(" "));
    // Listed so while it still holds its slot (and is its slot's), so that
    // every sample after it lets go sees it on its way out.
    d.list_process(
        pid,
        1400,
        &[("stat", &exiting), ("cgroup", &in_container('a'))],
    );
    d.wait_for_container("a sample of it holding its slot", |c| {
        c.untracked_mib == Some(100)
    })
    .await;
    h.holder.kill().unwrap();
    h.holder.wait().unwrap();
    // Host daemons listed one after the other: once each shows, a sample
    // has seen the exiting process beside it.
    for (n, (stranger, mib)) in [(900_003, 200), (900_004, 100)].into_iter().enumerate() {
        d.list_process(
            stranger,
            mib,
            &[("cgroup", "0::/system.slice/monitoring.service\n")],
        );
        let expected = [200, 300][n];
        let status = eventually("the stranger shown", WAIT, POLL, async || {
            let status = d.status().await;
            if status.gpus[0].unmanaged_mib.is_some_and(|m| m >= expected) {
                Ok(status)
            } else {
                Err(format!("{status:?}"))
            }
        })
        .await;
        assert_eq!(status.gpus[0].unmanaged_mib, Some(expected), "{status:?}");
    }
    h.d.stop().await;
}

/// The mount table of a process that pivoted into a root of its own.
const PIVOTED: &str = "1 0 0:40 / / rw - tmpfs tmpfs rw\n";

/// A real process (so that a kill is real) that stands for a GPU process
/// without the shim, killed when the test lets go of it.
fn rogue() -> common::Killed {
    common::Killed(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    )
}

/// A container's cgroup in pod `POD`, for container ID `id` × 64.
fn in_container(id: char) -> String {
    in_pod(POD_UID, id)
}

/// The `/proc/<pid>/cgroup` of a process in container `id` of pod `uid`.
fn in_pod(uid: &str, id: char) -> String {
    let pod = uid.replace('-', "_");
    format!(
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{pod}.slice/\
         cri-containerd-{}.scope\n",
        id.to_string().repeat(64)
    )
}

/// A tenant that sheds its mounts: one allowed a user namespace (`unshare -Urm`,
/// `pivot_root` into a root without /var/run/gpumem) sheds the container's
/// mounts before it reaches the GPU, and no process of its container ever
/// held a slot. Its cgroup, which it cannot leave, names its pod, and
/// kubelet's checkpoint the pod's one gpumem container: it is held to that
/// container's cap, killed at 6300 MiB of its 4308.
#[tokio::test]
async fn a_process_that_shed_its_containers_mounts_is_held_by_its_cgroup() {
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let mut rogue = rogue();
    a.d.list_process(
        rogue.id(),
        6300,
        &[("cgroup", &in_pod(&a.pod_uid, 'e')), ("mountinfo", PIVOTED)],
    );
    killed_as_its_containers(&a.d, &mut rogue).await;
    // The pod is told its container runs a process without gpumem's mounts.
    let api = a.d.api.as_ref().expect("started with an API server");
    let event = eventually("the pod's Event", WAIT, POLL, async || {
        api.list(Kind::Event)
            .into_iter()
            .find(|e| {
                e["reason"] == "GPUMemoryNotIsolated"
                    && e.pointer("/regarding/name") == Some(&"nb".into())
            })
            .ok_or("no Event")
    })
    .await;
    let note = event["note"].as_str().unwrap();
    let expected = format!("Process {} of container main holds 6300 MiB", rogue.id());
    assert!(note.contains(&expected), "{note}");
    assert!(note.contains("enable_cdi"), "{note}");
    a.d.stop().await;
}

/// A tenant in a user namespace of its own can mount anything at
/// /var/run/gpumem, a neighbour's directory name included, to have its
/// memory counted against the neighbour's cap. Its cgroup names another
/// pod than the one kubelet gave that directory: the mount is not taken
/// for the container's, and the memory shows as held outside every
/// gpumem container.
#[tokio::test]
async fn a_mount_that_names_another_pods_container_is_not_believed() {
    let h = Holding::start(None).await;
    let (d, dir) = (&h.d, &h.dir);
    const STRANGER_POD: &str = "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a";
    d.list_process(
        900_004,
        2500,
        &[
            ("cgroup", &in_pod(STRANGER_POD, 'f')),
            ("mountinfo", &common::mountinfo_with_state_dir(dir)),
        ],
    );
    let status = eventually("the memory unmanaged", WAIT, RECONCILE, async || {
        let status = d.status().await;
        if status.gpus[0].unmanaged_mib == Some(2500) {
            Ok(status)
        } else {
            Err(format!("not unmanaged: {status:?}"))
        }
    })
    .await;
    let c = &status.containers[0];
    assert_eq!(
        (c.used_mib, c.untracked_mib),
        (Some(1300), Some(0)),
        "{c:?}"
    );
    h.stop().await;
}

/// A container over its cap through a process without the shim: with
/// `action`, what happens to it, its capped neighbour and a stranger.
async fn over_cap(action: OverCapAction) -> (std::process::ExitStatus, String) {
    let grace = Duration::from_millis(400);
    let mut h = Holding::start(Some((action, grace))).await;
    let (d, dir) = (&h.d, &h.dir);
    // The tenant rewrites the cap in its own accounting file: the outside
    // action keeps to the cap Allocate gave.
    {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(gpumem_layout::FILE_NAME))
            .unwrap();
        let at = gpumem_layout::device_offset(0) + gpumem_layout::device::CAP;
        file.write_all_at(&(1u64 << 50).to_le_bytes(), at as u64)
            .unwrap();
    }
    // Real processes, so a kill is real: one of the container's without the
    // shim, taking it to 5300 MiB of its 4308, and one of another pod.
    let mut rogue = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let mut stranger = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    d.list_process(h.holder.id(), 1300, &[("cgroup", &in_container('a'))]);
    d.list_process(rogue.id(), 4000, &[("cgroup", &in_container('a'))]);
    d.list_process(stranger.id(), 6000, &[("cgroup", &in_container('b'))]);
    let started = std::time::Instant::now();
    let counter = match action {
        OverCapAction::Kill => "gpumem_over_cap_kills_total 1",
        OverCapAction::Report => "gpumem_over_cap_reports_total 1",
    };
    let metrics = d.wait_for_metric(counter).await;
    // Not before the grace period.
    assert!(started.elapsed() >= grace, "{:?}", started.elapsed());
    let rogue_status = match action {
        OverCapAction::Kill => rogue.wait().unwrap(),
        OverCapAction::Report => {
            assert!(rogue.try_wait().unwrap().is_none(), "reported only");
            rogue.kill().unwrap();
            rogue.wait().unwrap()
        }
    };
    d.drop_process(rogue.id());
    // The container is under its cap again; its neighbour and the stranger
    // (never killed: it is no gpumem container's) live on, through samples
    // over longer than the grace period that any action waits for.
    d.checked_for(grace).await;
    assert!(
        h.holder.try_wait().unwrap().is_none(),
        "the capped neighbour lives"
    );
    assert!(stranger.try_wait().unwrap().is_none(), "the stranger lives");
    stranger.kill().unwrap();
    stranger.wait().unwrap();
    // Both show on the pod as Events, as `kubectl describe pod` lists them.
    let api = d.api.as_ref().expect("started with an API server");
    let left = WAIT.saturating_sub(started.elapsed());
    let (over, unmanaged) = eventually("both Events", left, POLL, async || {
        let events = api.list(Kind::Event);
        let reason = |r: &str| {
            events
                .iter()
                .find(|e| e["reason"] == r && e.pointer("/regarding/name") == Some(&"nb".into()))
                .cloned()
        };
        match (reason("GPUMemoryOverCap"), reason("GPUMemoryUnmanaged")) {
            (Some(over), Some(unmanaged)) => Ok((over, unmanaged)),
            _ => Err(format!("no Events: {events:?}")),
        }
    })
    .await;
    let note = over["note"].as_str().unwrap();
    let expected = match action {
        OverCapAction::Kill => format!("Killed process {} of container main", rogue.id()),
        OverCapAction::Report => "Container main holds 5300 MiB on GPU".to_owned(),
    };
    assert!(note.contains(&expected), "{note}");
    assert_eq!(over["type"], "Warning");
    assert_eq!(over.pointer("/regarding/uid"), Some(&POD_UID.into()));
    assert!(
        unmanaged["note"]
            .as_str()
            .unwrap()
            .contains(&format!("Process {} holds 6000 MiB", stranger.id())),
        "{unmanaged}"
    );

    // The pod object changes (a label), and the container goes over again:
    // the same Event counts up, as kubelet's own repeats do (the Event's
    // reference to the pod carries no resourceVersion).
    let mut pod = api.get(Kind::Pod, "default", "nb").unwrap();
    pod["metadata"]["labels"] = serde_json::json!({"touched": "yes"});
    let touched: u64 = api.put(pod)["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap();
    // The daemon's pod watch has been sent the change.
    eventually("the change", WAIT, Duration::from_millis(20), async || {
        (api.watch_delivered(Kind::Pod) >= touched)
            .then_some(())
            .ok_or("the pod watch never got the change")
    })
    .await;
    let mut again = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    d.list_process(again.id(), 4000, &[("cgroup", &in_container('a'))]);
    d.wait_for_metric(&counter.replace(" 1", " 2")).await;
    let _ = again.kill();
    again.wait().unwrap();
    d.drop_process(again.id());
    let left = (2 * WAIT).saturating_sub(started.elapsed());
    let repeated = eventually("the Event repeated", left, POLL, async || {
        let over: Vec<serde_json::Value> = api
            .list(Kind::Event)
            .into_iter()
            .filter(|e| e["reason"] == "GPUMemoryOverCap")
            .collect();
        if over.iter().any(|e| e.pointer("/series/count").is_some()) || over.len() > 1 {
            Ok(over)
        } else {
            Err(format!("no repeat: {over:?}"))
        }
    })
    .await;
    assert_eq!(repeated.len(), 1, "one Event, counted: {repeated:?}");
    assert_eq!(repeated[0].pointer("/series/count"), Some(&2.into()));
    h.stop().await;
    (rogue_status, metrics)
}

#[tokio::test]
async fn a_container_over_its_cap_loses_its_newest_process_after_the_grace_period() {
    use std::os::unix::process::ExitStatusExt;
    let (status, metrics) = over_cap(OverCapAction::Kill).await;
    assert_eq!(status.signal(), Some(9), "SIGKILL");
    assert!(
        metrics.contains("# TYPE gpumem_over_cap_kills counter"),
        "{metrics}"
    );
}

/// A tenant over its cap in bursts shorter than the grace period, with
/// shorter pauses under it between them (a tenant seen
/// doing 9 s over, 2.3 s under, with the defaults), is stopped: what counts is its time over the cap
/// within the window, not an unbroken run of samples over it.
#[tokio::test]
async fn a_container_over_its_cap_in_bursts_shorter_than_the_grace_period_is_stopped() {
    use std::os::unix::process::ExitStatusExt;
    let grace = Duration::from_millis(1000);
    // Each burst well under the grace, each pause a few reconcile periods.
    let (over, under) = (grace * 3 / 5, RECONCILE * 3);
    let mut h = Holding::start(Some((OverCapAction::Kill, grace))).await;
    let mut rogue = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let cgroup = in_container('a');
    let cgroup = [("cgroup", cgroup.as_str())];
    h.d.list_process(h.holder.id(), 1300, &cgroup);
    let started = std::time::Instant::now();
    let mut bursts = 0;
    // 5300 MiB of its 4308 while bursting, 2300 between.
    'bursting: loop {
        for (mib, pause) in [(4000, over), (1000, under)] {
            h.d.relist_process(rogue.id(), mib, &cgroup);
            let until = std::time::Instant::now() + pause;
            while std::time::Instant::now() < until {
                if rogue.try_wait().unwrap().is_some() {
                    break 'bursting;
                }
                tokio::time::sleep(RECONCILE / 4).await;
            }
        }
        bursts += 1;
        if started.elapsed() > WAIT {
            // Not left behind to hold the test's output open.
            for child in [&mut rogue, &mut *h.holder] {
                child.kill().unwrap();
                child.wait().unwrap();
            }
            panic!("never stopped after {bursts} bursts of {over:?} over its cap");
        }
    }
    let status = rogue.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "SIGKILL");
    h.d.drop_process(rogue.id());
    // Over for the grace period in total: within its second or third burst.
    assert!(bursts <= 4, "stopped only after {bursts} bursts");
    h.d.wait_for_metric("gpumem_over_cap_kills_total 1").await;
    assert!(
        h.holder.try_wait().unwrap().is_none(),
        "the capped neighbour lives"
    );
    h.stop().await;
}

#[tokio::test]
async fn a_container_whose_processes_never_load_the_shim_is_found_by_its_mounts() {
    a_rogue_is_found_by_its_mounts_and_killed(|_| {}).await;
}

/// No process of the container holds a slot; one has the container's
/// state directory mounted, as Allocate's mounts give every process of it,
/// and holds 5000 MiB of its 4308: it is killed, and no memory is taken
/// for unmanaged. The accounting file is mounted writable: after a process
/// of the container `tamper`s with it (the shims then cap nothing), the
/// same holds, against the cap Allocate gave.
async fn a_rogue_is_found_by_its_mounts_and_killed(tamper: impl FnOnce(&Path)) {
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let (d, dir) = (&a.d, &a.dir);
    tamper(&dir.join(gpumem_layout::FILE_NAME));
    let mut rogue = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let mountinfo = common::mountinfo_with_state_dir(dir);
    d.list_process(rogue.id(), 5000, &[("mountinfo", &mountinfo)]);
    killed_as_its_containers(d, &mut rogue).await;
    a.d.stop().await;
}

/// Waits until the daemon SIGKILLs `rogue` as a process of a container over
/// its cap (killing it on a time-out), and checks that none of the GPU's
/// memory was taken for unmanaged.
async fn killed_as_its_containers(d: &Daemon, rogue: &mut std::process::Child) {
    use std::os::unix::process::ExitStatusExt;
    let status = match poll(WAIT, POLL, async || rogue.try_wait().unwrap().ok_or(())).await {
        Ok(status) => status,
        Err(()) => {
            let _ = rogue.kill();
            panic!("not killed; status: {:?}", d.status().await.gpus[0]);
        }
    };
    assert_eq!(status.signal(), Some(9));
    assert_eq!(d.status().await.gpus[0].unmanaged_mib, Some(0));
}

#[tokio::test]
async fn a_container_that_removed_its_accounting_file_is_held_to_its_cap() {
    a_rogue_is_found_by_its_mounts_and_killed(|file| std::fs::remove_file(file).unwrap()).await;
}

#[tokio::test]
async fn a_container_that_overwrote_its_accounting_file_is_held_to_its_cap() {
    a_rogue_is_found_by_its_mounts_and_killed(|file| std::fs::write(file, b"junk").unwrap()).await;
}

#[tokio::test]
async fn a_container_that_renamed_the_gpu_in_its_accounting_file_is_held_to_its_cap() {
    use std::os::unix::fs::FileExt;
    a_rogue_is_found_by_its_mounts_and_killed(|file| {
        let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
        f.write_all_at(&[0xee; 16], gpumem_layout::device_offset(0) as u64)
            .unwrap();
    })
    .await;
}

#[tokio::test]
async fn with_report_a_container_over_its_cap_is_only_reported() {
    let (_, metrics) = over_cap(OverCapAction::Report).await;
    assert!(
        metrics.contains("gpumem_over_cap_kills_total 0"),
        "{metrics}"
    );
}

/// NVML answers played back in order.
struct Script(std::collections::VecDeque<u64>, u32);

impl gpumem::node::processes::ProcFiles for Script {}

impl gpumem::node::processes::ProcessUsage for Script {
    fn usage(&mut self) -> Result<gpumem::node::gpu::ProcessMemory, gpumem::node::gpu::GpuError> {
        let mib = self.0.pop_front().expect("script long enough");
        Ok([(
            common::T4_UUID.to_owned(),
            [(self.1, mib * common::MIB)].into(),
        )]
        .into())
    }
}

#[test]
fn untracked_usage_rises_at_once_and_falls_only_when_two_samples_agree() {
    use gpumem_layout::{slot, slot_offset, state, FILE_NAME};
    use std::os::unix::fs::FileExt;
    let dir = common::capped_dir(4308);
    let file = dir.path().join(FILE_NAME);
    // A process holding slot 0 with 1000 MiB charged, as a shim would.
    let at = slot_offset(1, 0);
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.write_all_at(
        &(1000 * common::MIB).to_le_bytes(),
        (at + slot::USED) as u64,
    )
    .unwrap();
    f.write_all_at(&(1u64 << 8 | state::ALIVE).to_le_bytes(), at as u64)
        .unwrap();
    f.write_all_at(&1u32.to_le_bytes(), gpumem_layout::header::SLOT_HWM as u64)
        .unwrap();
    let mut holder = common::hold_record_lock(&file, at);

    // NVML's view of the holder, tick by tick, and the untracked MiB that
    // must be published after each.
    let nvml = [1600, 1000, 1600, 1000, 1000, 1200];
    let published = [600, 600, 600, 600, 0, 200];
    let mut reconciler = gpumem::isolation::reconcile::Reconciler::new(Box::new(Script(
        nvml.into_iter().collect(),
        holder.id(),
    )));
    for (tick, want) in published.into_iter().enumerate() {
        reconciler.tick(std::slice::from_ref(&file));
        let usage = &gpumem::isolation::accounting::usage(&file).unwrap()[0];
        assert_eq!(usage.untracked_bytes, want * common::MIB, "tick {tick}");
        assert_eq!(usage.used_bytes, (1000 + want) * common::MIB, "tick {tick}");
    }
    holder.kill().unwrap();
    holder.wait().unwrap();
}

/// A process of the container that did not load the shim opens the
/// accounting file itself and takes two slots, each locked and `ALIVE`
/// under its PID, charging nothing. It is one process with two entries in
/// its own container's file, not a process charged in another file: it
/// counts once, against its container's cap, and is killed at 5000 MiB of
/// the 4308.
#[tokio::test]
async fn a_process_holding_two_slots_of_its_containers_file_is_held_to_its_cap() {
    use gpumem_layout::{header, slot, slot_offset, state, FILE_NAME};
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let file = a.dir.join(FILE_NAME);
    let alive = (1u64 << 8) | state::ALIVE;
    let mut script = format!(
        "import fcntl, os, struct, time\nf = open({file:?}, 'r+b')\n\
         f.seek({hwm}); f.write(struct.pack('<I', 2)); f.flush()\n",
        hwm = header::SLOT_HWM
    );
    for index in 0..2 {
        let at = slot_offset(1, index);
        script += &format!(
            "fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, {at}, 0)\n\
             f.seek({pid}); f.write(struct.pack('<Q', os.getpid())); f.flush()\n\
             f.seek({at}); f.write(struct.pack('<Q', {alive})); f.flush()\n",
            pid = at + slot::PID
        );
    }
    script += "print('holding', flush=True)\ntime.sleep(60)\n";
    let mut rogue = common::Killed(
        std::process::Command::new("python3")
            .args(["-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    common::wait_for_line(&mut rogue, "holding");
    let live = gpumem::isolation::accounting::processes(&file)
        .unwrap()
        .live;
    assert_eq!(live.len(), 2, "{live:?}");
    a.d.list_process(rogue.id(), 5000, &[]);
    killed_as_its_containers(&a.d, &mut rogue).await;
    a.d.stop().await;
}

/// A tenant's process keeps a slot in its pod's accounting file after the
/// pod ended (it was handed the file's descriptor from another of the
/// tenant's pods, which the cgroup here names). kubelet gives the same
/// units to a neighbour, whose directory has the same name: the neighbour
/// gets a file of its own, in which it makes a context and allocates up to
/// its cap, and the tenant's 4300 MiB are held outside every gpumem
/// container, never charged to the neighbour.
#[tokio::test]
async fn a_slot_that_outlives_its_pod_is_not_the_next_pods() {
    const TENANTS_OTHER_POD: &str = "5e6f7a8b-9c0d-4e1f-8a2b-3c4d5e6f7a8b";
    let a = Admitted::start(None).await;
    let (d, dir) = (&a.d, &a.dir);
    let mut kept = common::Killed(
        shim_kit()
            .probe(Some(dir))
            .args(["alloc:4000", "hold"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    common::wait_for_line(&mut kept, "holding");
    d.list_process(
        kept.id(),
        4300,
        &[("cgroup", &in_pod(TENANTS_OTHER_POD, 'x'))],
    );
    d.wait_for_container("the tenant's slot", |c| c.used_mib == Some(4300))
        .await;

    d.k().remove_pod("nb");
    let next = d
        .k()
        .admit("nc", "main", common::RESOURCE, 4)
        .await
        .unwrap();
    let next_dir = Path::new(&next.response.mounts[2].host_path);
    assert_eq!(next_dir, dir, "the same units, so the same directory");
    let file = next_dir.join(gpumem_layout::FILE_NAME);
    let live = gpumem::isolation::accounting::processes(&file)
        .unwrap()
        .live;
    assert!(live.is_empty(), "the neighbour's file has slots: {live:?}");
    let lines = common::probe(next_dir, &["alloc:3000"]);
    assert_eq!(common::line(&lines, "alloc:3000"), "alloc:3000 0 #0");
    let status = eventually("the memory unmanaged", WAIT, RECONCILE, async || {
        let status = d.status().await;
        if status.gpus[0].unmanaged_mib == Some(4300) {
            Ok(status)
        } else {
            Err(format!("{status:?}"))
        }
    })
    .await;
    let c = &status.containers[0];
    assert_eq!((c.used_mib, c.untracked_mib), (Some(0), Some(0)), "{c:?}");
    a.d.stop().await;
}

/// kubelet rewrites its device checkpoint twice within one tick of the
/// file system's clock: the second file has the modification time of the
/// first. A pod admitted by the second (here: the first put back, then the
/// second, each with the same time) is known all the same: its process that
/// shed its mounts is its container's, and is killed over the cap.
#[tokio::test]
async fn a_checkpoint_rewritten_within_one_clock_tick_is_read_again() {
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let checkpoint = a.d.dir.path().join(gpumem_testkit::simulator::CHECKPOINT);
    let without = std::fs::read(&checkpoint).unwrap();
    let second =
        a.d.k()
            .admit("second", "main", common::RESOURCE, 4)
            .await
            .unwrap();
    let with = std::fs::read(&checkpoint).unwrap();
    let tick = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    // As kubelet writes it: a whole file renamed into place.
    let put = |text: &[u8]| {
        let staging = checkpoint.with_extension("tmp");
        std::fs::write(&staging, text).unwrap();
        let file = std::fs::File::options().write(true).open(&staging).unwrap();
        file.set_modified(tick).unwrap();
        std::fs::rename(&staging, &checkpoint).unwrap();
    };
    put(&without);
    let mut rogue = rogue();
    a.d.list_process(
        rogue.id(),
        6300,
        &[
            ("cgroup", &in_pod(&second.pod_uid(), 'e')),
            ("mountinfo", PIVOTED),
        ],
    );
    // Read while it did not name the pod: the process is no container's.
    eventually("the memory unmanaged", WAIT, RECONCILE, async || {
        (a.d.status().await.gpus[0].unmanaged_mib == Some(6300))
            .then_some(())
            .ok_or("never unmanaged")
    })
    .await;
    put(&with);
    killed_as_its_containers(&a.d, &mut rogue).await;
    a.d.stop().await;
}

/// A tenant in a user namespace of its own mounts a tmpfs named as the
/// bounded state directory of a pod that ended (`gpumem-state:<name>`),
/// which clean-up keeps for its grace period: a released grant vouches for
/// no process. The tenant's process is its own container's, found by its
/// cgroup, and is killed at 5000 MiB over that container's 4308, under the
/// ended pod's 8616.
#[tokio::test]
async fn a_mount_named_after_a_finished_pods_directory_is_not_believed() {
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let ended =
        a.d.k()
            .admit("ended", "main", common::RESOURCE, 8)
            .await
            .unwrap();
    let ended_dir = Path::new(&ended.response.mounts[2].host_path);
    a.d.k().remove_pod("ended");
    // kubelet writes its checkpoint without the ended pod at its next
    // allocation.
    a.d.k()
        .admit("later", "main", common::RESOURCE, 1)
        .await
        .unwrap();
    assert!(ended_dir.is_dir(), "kept for the grace period");
    let name = ended_dir.file_name().unwrap().to_str().unwrap();
    let mountinfo = format!(
        "1 0 0:40 / / rw - tmpfs tmpfs rw\n\
         2 1 0:61 / /var/run/gpumem rw,nosuid - tmpfs gpumem-state:{name} rw,size=104k\n"
    );
    let mut rogue = rogue();
    a.d.list_process(
        rogue.id(),
        5000,
        &[
            ("cgroup", &in_pod(&a.pod_uid, 'e')),
            ("mountinfo", &mountinfo),
        ],
    );
    killed_as_its_containers(&a.d, &mut rogue).await;
    a.d.stop().await;
}

/// A GPU process whose name is not UTF-8 (`prctl(PR_SET_NAME)`; an
/// executable named so does the same) is found, and killed, like any
/// other: `/proc` is read as bytes.
#[tokio::test]
async fn a_process_whose_name_is_not_utf8_is_killed() {
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let mut rogue = common::tenant::start(&["--name"]);
    let stat = std::fs::read(format!("/proc/{}/stat", rogue.id())).unwrap();
    assert!(String::from_utf8(stat).is_err(), "the name is UTF-8");
    let mountinfo = common::mountinfo_with_state_dir(&a.dir);
    a.d.list_process(rogue.id(), 5000, &[("mountinfo", &mountinfo)]);
    killed_as_its_containers(&a.d, &mut rogue).await;
    a.d.stop().await;
}

/// A process of the container that loaded the shim and holds its slot,
/// whose leader thread then exits (a zombie in `stat`) while a worker
/// thread holds the memory on, and which lets go of its slot's lock,
/// taking it again for 50 ms each second: all of it is not exiting, so it
/// is not passed over as on its way out, and its mount table, which the
/// leader's `/proc` files no longer show, is read through the worker.
/// Killed at 6000 MiB of its 4308.
#[tokio::test]
async fn a_process_whose_leader_exited_is_held_by_its_other_threads() {
    use std::io::Write;
    if !tenant_may_mount() {
        return;
    }
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let kit = shim_kit();
    let mut rogue = common::Killed(
        std::process::Command::new(common::tenant::tenant())
            .args(["--mount", a.dir.to_str().unwrap()])
            .args(["--cuda", "--leader-exits", "--drop", "--relock"])
            .arg(gpumem_layout::slot_offset(1, 0).to_string())
            .env("LD_LIBRARY_PATH", &kit.driver_dir)
            .env("LD_PRELOAD", &kit.shim)
            .env("GPUMEM_STATE_DIR", "/run/gpumem")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    common::wait_for_line(&mut rogue, "ready");
    let pid = rogue.id();
    let started = std::time::Instant::now();
    let zombie_leader = || {
        let stat = std::fs::read(format!("/proc/{pid}/stat")).unwrap();
        let stat = String::from_utf8_lossy(&stat).into_owned();
        stat[stat.rfind(')').unwrap()..].starts_with(") Z")
    };
    eventually(
        "a zombie leader",
        WAIT,
        Duration::from_millis(20),
        async || zombie_leader().then_some(()).ok_or("the leader lives"),
    )
    .await;
    // Seen holding its slot (its context charged), under the cap.
    a.d.list_process(pid, 1000, &[]);
    a.d.wait_for_container("seen holding its slot", |c| c.untracked_mib == Some(700))
        .await;
    rogue.stdin.as_mut().unwrap().write_all(b"drop\n").unwrap();
    let file = a.dir.join(gpumem_layout::FILE_NAME);
    let holds = || {
        gpumem::isolation::accounting::processes(&file)
            .unwrap()
            .live
            .iter()
            .any(|p| p.pid == Some(pid))
    };
    let left = WAIT.saturating_sub(started.elapsed());
    eventually(
        "its slot let go",
        left,
        Duration::from_millis(20),
        async || (!holds()).then_some(()).ok_or("still holds its slot"),
    )
    .await;
    a.d.relist_process(pid, 6000, &[]);
    killed_as_its_containers(&a.d, &mut rogue).await;
    a.d.stop().await;
}

/// In a pod with two gpumem containers on one GPU, an image whose
/// `/var/run` links elsewhere has the runtime mount the state directory
/// under the link's target. A process of it that did not load the shim is
/// still its container's: the mount is known by what it mounts, and
/// kubelet gave that directory to the process's pod. A process of another
/// pod that mounts the host's `/var/lib` (a node agent), and so sees each
/// container's tmpfs where the state directory has it, is not.
#[tokio::test]
async fn a_state_mount_where_var_run_links_elsewhere_names_the_container() {
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let side =
        a.d.k()
            .admit("nb", "side", common::RESOURCE, 4)
            .await
            .unwrap();
    assert_eq!(side.pod_uid(), a.pod_uid);
    let mut rogue = common::Killed(
        std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap(),
    );
    let mountinfo = format!(
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
         2 1 8:1 {} /srv/run/gpumem rw - ext4 /dev/sda1 rw\n",
        a.dir.display()
    );
    a.d.list_process(
        rogue.id(),
        5000,
        &[
            ("cgroup", &in_pod(&a.pod_uid, 'e')),
            ("mountinfo", &mountinfo),
        ],
    );
    killed_as_its_containers(&a.d, &mut rogue).await;
    a.d.drop_process(rogue.id());
    let name = a.dir.file_name().unwrap().to_str().unwrap();
    let host_view = format!(
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
         2 1 0:61 / /host/var/lib/gpumem/containers/{name} rw - tmpfs gpumem-state:{name} rw\n"
    );
    const AGENT_POD: &str = "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a";
    a.d.list_process(
        900_010,
        2000,
        &[
            ("cgroup", &in_pod(AGENT_POD, 'a')),
            ("mountinfo", &host_view),
        ],
    );
    // Unmanaged, and not the container's (its killed process's memory
    // gone from it).
    eventually("the agent unmanaged", WAIT, RECONCILE, async || {
        let status = a.d.status().await;
        let main = status
            .containers
            .iter()
            .find(|c| c.container.as_deref() == Some("main"));
        let untracked = main.and_then(|c| c.untracked_mib);
        if status.gpus[0].unmanaged_mib == Some(2000) && untracked == Some(0) {
            Ok(())
        } else {
            Err(format!("{status:?}"))
        }
    })
    .await;
    a.d.stop().await;
}

/// Whether the tenant can make a mount namespace of its own (root); says
/// so where not.
fn tenant_may_mount() -> bool {
    let root = common::root();
    if !root {
        eprintln!("skipped: a mount namespace of the tenant's own needs root (CI runs as root)");
    }
    root
}

/// The daemon's peak resident memory, from `/proc/self/status`.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// A tenant with a mount namespace of its own makes 12,000 mounts of long
/// paths, which make its mount table over 64 MiB (20,000 made 145 MiB, past
/// the DaemonSet's memory limit): the daemon (here in the test's process)
/// reads no more of it than its cap, one line at a time, and still finds
/// the container's state mount among its first lines.
#[tokio::test]
async fn a_huge_mount_table_is_read_only_up_to_the_cap() {
    if !tenant_may_mount() {
        return;
    }
    let a = Admitted::start(Some((OverCapAction::Kill, Duration::from_millis(400)))).await;
    let dir = a.dir.to_str().unwrap();
    let mut rogue = common::tenant::start(&["--mount", dir, "--mounts", "12000"]);
    let mut table = std::fs::File::open(format!("/proc/{}/mountinfo", rogue.id())).unwrap();
    let bytes = std::io::copy(&mut table, &mut std::io::sink()).unwrap();
    assert!(bytes > 64 << 20, "{bytes} bytes");
    // The peak from now on.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let before = peak_rss();
    a.d.list_process(rogue.id(), 5000, &[]);
    killed_as_its_containers(&a.d, &mut rogue).await;
    // The kernel brings the peak up to date lazily: it may read lower.
    let grown = peak_rss().saturating_sub(before);
    assert!(grown < 32 << 20, "the peak grew by {} MiB", grown >> 20);
    a.d.stop().await;
}
