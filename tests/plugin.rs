//! The plugin server over its real unix socket, driven by the in-process
//! kubelet simulator and by direct gRPC calls as kubelet makes them.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::wait::{eventually, POLL};
use common::{Node, RESOURCE, WAIT};
use gpumem::deviceplugin::api::deviceplugin::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    PreStartContainerRequest, PreferredAllocationRequest,
};
use gpumem::deviceplugin::plugin::SOCKET_NAME;
use gpumem::node::inventory::DeviceId;
use gpumem::node::placement::Policy;
use gpumem::node::units::MemoryUnit;
use gpumem_testkit::simulator::{AdmissionError, KubeletSim};
use tonic::Code;

#[tokio::test]
async fn registers_with_the_fields_kubelet_checks() {
    let node = Node::start("t4", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    let registrations = node.kubelet().registrations();
    assert_eq!(registrations.len(), 1);
    let r = &registrations[0];
    assert_eq!(r.version, "v1beta1");
    assert_eq!(r.endpoint, SOCKET_NAME, "a bare file name, not a path");
    assert_eq!(r.resource_name, RESOURCE);
    let options = r.options.expect("options sent for pre-2022 kubelets");
    assert!(options.get_preferred_allocation_available);
    assert!(!options.pre_start_required);

    let served = node
        .client()
        .await
        .get_device_plugin_options(Empty {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        served, options,
        "GetDevicePluginOptions agrees with Register"
    );

    let pre_start = node
        .client()
        .await
        .pre_start_container(PreStartContainerRequest {
            devices_ids: vec![],
        })
        .await;
    assert!(pre_start.is_ok());
    node.stop().await;
}

#[tokio::test]
async fn advertises_every_unit_healthy_for_each_fixture() {
    for (fixture, unit, expected) in [
        ("t4", MemoryUnit::GiB, 14),
        ("v100x2", MemoryUnit::GiB, 30),
        ("h100", MemoryUnit::GiB, 79),
        ("h100", MemoryUnit::MiB, 81559),
    ] {
        let node = Node::start(fixture, unit, Policy::Binpack).await;
        let devices = node.devices().await;
        assert_eq!(devices.len(), expected, "{fixture} in {unit}");
        assert!(devices.iter().all(|d| d.health == "Healthy"));
        let ids: HashSet<_> = devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids.len(), expected, "IDs are unique");
        assert!(devices.iter().all(|d| d.id.len() <= 63));
        node.stop().await;
    }
}

#[tokio::test]
async fn device_ids_survive_a_plugin_restart() {
    let node = Node::start("v100x2", MemoryUnit::GiB, Policy::Binpack).await;
    let first: Vec<_> = node.devices().await.into_iter().map(|d| d.id).collect();
    node.stop().await;
    let node = Node::start("v100x2", MemoryUnit::GiB, Policy::Binpack).await;
    let second: Vec<_> = node.devices().await.into_iter().map(|d| d.id).collect();
    assert_eq!(first, second);
    node.stop().await;
}

#[tokio::test]
async fn t4_notebooks_get_4308_mib_and_the_fourth_does_not_fit() {
    let node = Node::start("t4", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    let kubelet = node.kubelet();
    for pod in ["nb-1", "nb-2", "nb-3"] {
        let allocation = kubelet.admit(pod, "main", RESOURCE, 4).await.unwrap();
        let env = &allocation.response.envs;
        assert_eq!(
            env["NVIDIA_VISIBLE_DEVICES"],
            "GPU-6b1c2d3e-0000-4000-8000-000000000400"
        );
        assert_eq!(env["GPUMEM_LIMIT_MIB"], "4308");
        assert_eq!(env["ALIYUN_COM_GPU_MEM_IDX"], "0");
        assert_eq!(env["ALIYUN_COM_GPU_MEM_CONTAINER"], "4");
        assert_eq!(env["ALIYUN_COM_GPU_MEM_DEV"], "14");
        assert_eq!(env["ALIYUN_COM_GPU_MEM_UNIT"], "GiB");
    }
    let err = kubelet
        .admit("nb-4", "main", RESOURCE, 4)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            AdmissionError::Insufficient {
                requested: 4,
                available: 2,
                ..
            }
        ),
        "{err}"
    );
    // Freed units are placed again.
    kubelet.remove_pod("nb-1");
    kubelet.admit("nb-4", "main", RESOURCE, 4).await.unwrap();
    node.stop().await;
}

/// GPU index of every admitted pod, in admission order.
async fn admit_all(node: &Node, sizes: &[usize]) -> Vec<String> {
    let mut gpus = Vec::new();
    for (i, &size) in sizes.iter().enumerate() {
        let allocation = node
            .kubelet()
            .admit(&format!("pod-{i}"), "main", RESOURCE, size)
            .await
            .unwrap();
        gpus.push(allocation.response.envs["ALIYUN_COM_GPU_MEM_IDX"].clone());
    }
    gpus
}

#[tokio::test]
async fn binpack_fills_one_v100_before_the_next() {
    let node = Node::start("v100x2", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    // 15 units per V100: 4+4+4 on GPU0, 6 only fits GPU1, then 3 fits GPU0 exactly.
    assert_eq!(
        admit_all(&node, &[4, 4, 4, 6, 3]).await,
        ["0", "0", "0", "1", "0"]
    );
    node.stop().await;
}

#[tokio::test]
async fn spread_alternates_between_v100s() {
    let node = Node::start("v100x2", MemoryUnit::GiB, Policy::Spread).await;
    node.devices().await;
    assert_eq!(admit_all(&node, &[4, 4, 2, 4]).await, ["0", "1", "0", "1"]);
    node.stop().await;
}

#[tokio::test]
async fn preferred_allocation_is_exact_and_explains_misfits() {
    let node = Node::start("v100x2", MemoryUnit::GiB, Policy::Binpack).await;
    let devices = node.devices().await;
    let mut client = node.client().await;
    let ids: Vec<String> = devices.iter().map(|d| d.id.clone()).collect();
    let gpu_of = |id: &str| DeviceId::parse(id).unwrap().gpu;
    let gpu0 = gpu_of(&ids[0]);
    // 3 free on GPU0, 2 on GPU1.
    let (on0, on1): (Vec<_>, Vec<_>) = ids.iter().cloned().partition(|id| gpu_of(id) == gpu0);
    let available: Vec<String> = on0[..3].iter().chain(&on1[..2]).cloned().collect();

    let ask = |size: i32, must: Vec<String>| PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available.clone(),
            must_include_device_i_ds: must,
            allocation_size: size,
        }],
    };
    let picked = client
        .get_preferred_allocation(ask(2, vec![]))
        .await
        .unwrap()
        .into_inner();
    let picked = &picked.container_responses[0].device_i_ds;
    assert_eq!(picked.len(), 2);
    assert!(picked.iter().all(|id| available.contains(id)));
    assert!(
        picked.iter().all(|id| gpu_of(id) != gpu0),
        "binpack: the fuller GPU1 fits 2"
    );

    let must = vec![on0[1].clone()];
    let picked = client
        .get_preferred_allocation(ask(2, must.clone()))
        .await
        .unwrap()
        .into_inner();
    let picked = &picked.container_responses[0].device_i_ds;
    assert!(picked.contains(&must[0]) && picked.len() == 2);

    let err = client
        .get_preferred_allocation(ask(4, vec![]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(
        err.message(),
        "no single GPU has 4 free units (free units per GPU: GPU0 3, GPU1 2)"
    );
    node.stop().await;
}

#[tokio::test]
async fn bad_allocate_requests_are_rejected_and_the_plugin_keeps_serving() {
    let node = Node::start("v100x2", MemoryUnit::GiB, Policy::Binpack).await;
    let devices = node.devices().await;
    let mut client = node.client().await;
    let allocate = |ids: Vec<String>| AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
    };
    let first = devices[0].id.clone();
    let last = devices[devices.len() - 1].id.clone();

    let err = client
        .allocate(allocate(vec![
            first.clone(),
            "deadbeef-3".into(),
            "nvidia0".into(),
        ]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("deadbeef-3, nvidia0"),
        "{}",
        err.message()
    );
    assert!(!err.message().contains(&first), "{}", err.message());

    let err = client
        .allocate(allocate(vec![first.clone(), last.clone()]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains(&first) && err.message().contains(&last),
        "{}",
        err.message()
    );
    assert!(err.message().contains("one GPU"), "{}", err.message());

    let err = client.allocate(allocate(vec![])).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    let err = client
        .allocate(AllocateRequest {
            container_requests: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // Several containers in one request (krustlet-style) get one response each, in order.
    let ok = client
        .allocate(AllocateRequest {
            container_requests: vec![
                ContainerAllocateRequest {
                    devices_ids: vec![first.clone()],
                },
                ContainerAllocateRequest {
                    devices_ids: vec![last.clone()],
                },
            ],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.container_responses.len(), 2);
    assert_eq!(
        ok.container_responses[0].envs["ALIYUN_COM_GPU_MEM_IDX"],
        "0"
    );
    assert_eq!(
        ok.container_responses[1].envs["ALIYUN_COM_GPU_MEM_IDX"],
        "1"
    );
    assert_eq!(ok.container_responses[1].envs["GPUMEM_LIMIT_MIB"], "1077");

    assert!(
        node.kubelet().devices(RESOURCE).is_some(),
        "ListAndWatch still open"
    );
    node.stop().await;
}

#[tokio::test]
async fn thousands_of_bad_ids_get_a_short_invalid_argument_naming_a_few_and_the_count() {
    let node = Node::start("v100x2", MemoryUnit::GiB, Policy::Binpack).await;
    let devices = node.devices().await;
    let mut client = node.client().await;
    // Listing every ID overflowed the HTTP/2 trailer the status travels in:
    // the client saw a protocol error, not InvalidArgument.
    let unknown: Vec<String> = (0..5000).map(|i| format!("deadbeef-{i}")).collect();
    let short = |err: &tonic::Status, what: &str| {
        assert_eq!(err.code(), Code::InvalidArgument, "{what}: {err:?}");
        let message = err.message();
        assert!(message.len() < 1024, "{what}: {} bytes", message.len());
        message.to_owned()
    };

    let allocate = |ids: Vec<String>| AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
    };
    let err = client
        .allocate(allocate(unknown.clone()))
        .await
        .unwrap_err();
    let message = short(&err, "unknown");
    assert!(
        message.contains("deadbeef-0, deadbeef-1, deadbeef-2")
            && message.contains("and 4995 more (5000 in all)")
            && !message.contains("deadbeef-4999"),
        "{message}"
    );

    let twice = vec![devices[0].id.clone(); 5000];
    let err = client.allocate(allocate(twice)).await.unwrap_err();
    let message = short(&err, "repeated");
    assert!(
        message.contains(&devices[0].id) && message.contains("(4999 in all)"),
        "{message}"
    );

    // One ID of a megabyte is cut short too.
    let long = vec!["x".repeat(1 << 20)];
    let err = client.allocate(allocate(long)).await.unwrap_err();
    let message = short(&err, "long");
    assert!(
        message.contains(&format!("{}…", "x".repeat(64))),
        "{message}"
    );

    let err = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: unknown.clone(),
                must_include_device_i_ds: vec![],
                allocation_size: 1,
            }],
        })
        .await
        .unwrap_err();
    let message = short(&err, "preferred");
    assert!(message.contains("and 4995 more (5000 in all)"), "{message}");

    // The plugin still serves.
    client
        .allocate(allocate(vec![devices[0].id.clone()]))
        .await
        .unwrap();
    node.stop().await;
}

#[tokio::test]
async fn re_registers_after_kubelet_restarts() {
    let mut node = Node::start("t4", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    for round in 2..=4 {
        node.kubelet.as_mut().unwrap().restart().await.unwrap();
        let devices = node
            .kubelet()
            .wait_for_devices(RESOURCE, round, WAIT)
            .await
            .expect("registered again after kubelet restart");
        assert_eq!(devices.len(), 14);
        assert!(node.socket().exists(), "a fresh plugin socket is served");
    }
    // Allocation works through the new connection.
    node.kubelet()
        .admit("after-restart", "main", RESOURCE, 2)
        .await
        .unwrap();
    node.stop().await;
}

/// After the plugin's socket went, a new one that cannot be bound for a
/// while (here a directory in its place) is tried again, not the end of the
/// plugin: the node's containers keep running and kubelet waits for it.
#[tokio::test]
async fn a_socket_that_cannot_be_bound_again_is_retried() {
    let dir = tempfile::tempdir().unwrap();
    let kubelet = KubeletSim::start(dir.path()).unwrap();
    let log = dir.path().join("plugin.log");
    let mut plugin = common::bare_plugin(dir.path())
        .arg("--fake-gpus")
        .arg(common::fixture("t4"))
        .arg("--pod-resources-socket")
        .arg(kubelet.pod_resources_socket())
        .env_remove("RUST_LOG")
        .env_remove("GPUMEM_LOG_FORMAT")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    kubelet.wait_for_devices(RESOURCE, 1, WAIT).await.unwrap();
    let socket = dir.path().join(SOCKET_NAME);
    std::fs::remove_file(&socket).unwrap();
    std::fs::create_dir(&socket).unwrap();
    std::fs::write(socket.join("in-the-way"), "").unwrap();

    eventually("a second try", WAIT, POLL, async || {
        let tries = read_log()
            .matches("cannot serve a new plugin socket; retrying")
            .count();
        let failed = || format!("no second try, or the plugin stopped; log:\n{}", read_log());
        if tries >= 2 {
            return Ok(());
        }
        assert!(plugin.try_wait().unwrap().is_none(), "{}", failed());
        Err(failed())
    })
    .await;
    std::fs::remove_dir_all(&socket).unwrap();
    let again = kubelet.wait_for_devices(RESOURCE, 2, WAIT).await;
    let _ = plugin.kill();
    let _ = plugin.wait();
    again.unwrap_or_else(|| {
        panic!(
            "not registered again once the socket could be bound; log:\n{}",
            read_log()
        )
    });
}

#[tokio::test]
async fn registers_again_when_kubelet_ends_list_and_watch() {
    let node = Node::start("t4", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    // kubelet drops the stream (as on a failed read) but does not restart:
    // both sockets stay, and it will not call ListAndWatch again.
    node.kubelet().hang_up(RESOURCE);
    assert!(node.kubelet().wait_for_disconnect(RESOURCE, WAIT).await);
    let devices = node
        .kubelet()
        .wait_for_devices(RESOURCE, 2, WAIT)
        .await
        .expect("registered again after kubelet ended ListAndWatch");
    assert_eq!(devices.len(), 14);
    node.kubelet()
        .admit("after-hang-up", "main", RESOURCE, 2)
        .await
        .unwrap();
    // Once: the new registration's stream stays up, and carries what
    // changes after it.
    let sick = node.inventory.borrow().with_health(common::T4_UUID, false);
    node.inventory
        .send_replace(std::sync::Arc::new(sick.expect("the T4 was healthy")));
    node.kubelet()
        .wait_for_list(RESOURCE, WAIT, |l| {
            l.iter().all(|dev| dev.health == "Unhealthy")
        })
        .await
        .expect("a health change on the new stream");
    assert_eq!(node.kubelet().registrations().len(), 2);
    node.stop().await;
}

#[tokio::test]
async fn waits_for_kubelet_and_registers_when_it_appears() {
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::without_kubelet(dir, "t4", MemoryUnit::GiB, Policy::Binpack);
    // The plugin serves its socket and keeps retrying Register meanwhile.
    let every = Duration::from_millis(20);
    eventually("the plugin socket", WAIT, every, async || {
        node.socket()
            .exists()
            .then_some(())
            .ok_or("plugin socket created without a kubelet")
    })
    .await;
    assert!(
        !node.plugin.is_finished(),
        "plugin does not exit while kubelet is missing"
    );
    node.kubelet = Some(KubeletSim::start(node.dir.path()).unwrap());
    assert_eq!(node.devices().await.len(), 14);
    node.stop().await;
}

#[tokio::test]
async fn refuses_to_start_beside_a_live_instance() {
    let node = Node::start("t4", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    let second =
        gpumem::deviceplugin::plugin::Plugin::new(gpumem::deviceplugin::plugin::PluginConfig {
            kubelet_dir: node.dir.path().to_owned(),
            resource_name: Default::default(),
            policy: Policy::Binpack,
            isolation: gpumem::isolation::inject::Isolation::None,
            device_list: Default::default(),
        });
    let (_tx, rx) = tokio::sync::watch::channel(std::sync::Arc::new(common::inventory(
        "t4",
        MemoryUnit::GiB,
    )));
    let err = second.run(rx, Default::default()).await.unwrap_err();
    assert!(
        err.to_string().contains("another process is serving"),
        "{err}"
    );
    assert_eq!(
        node.kubelet().devices(RESOURCE).map(|d| d.len()),
        Some(14),
        "first instance unharmed"
    );
    node.stop().await;
}

#[tokio::test]
async fn health_changes_reach_kubelet() {
    let node = Node::start("v100x2", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    let mut gpus = common::inventory("v100x2", MemoryUnit::GiB)
        .gpus()
        .iter()
        .map(|g| g.gpu.clone())
        .collect::<Vec<_>>();
    gpus[1].healthy = false;
    let sick = gpumem::node::inventory::Inventory::new(gpus, MemoryUnit::GiB).unwrap();
    node.inventory.send_replace(std::sync::Arc::new(sick));
    let devices = node
        .kubelet()
        .wait_for_list(RESOURCE, WAIT, |list| {
            list.iter().any(|d| d.health == "Unhealthy")
        })
        .await
        .expect("health update received");
    assert_eq!(devices.len(), 30, "the full list, unhealthy units included");
    assert_eq!(
        devices.iter().filter(|d| d.health == "Unhealthy").count(),
        15
    );
    // Only the healthy GPU is offered now.
    let allocation = node
        .kubelet()
        .admit("p", "main", RESOURCE, 15)
        .await
        .unwrap();
    assert_eq!(allocation.response.envs["ALIYUN_COM_GPU_MEM_IDX"], "0");
    node.stop().await;
}
