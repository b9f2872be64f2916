//! `gpumem demo --dra`: the DRA driver on the fake T4 node. The real driver
//! (`gpumem dra`'s daemon, in process) publishes the node's ResourceSlice to
//! an in-process API server and registers with a fake kubelet; the demo
//! plays the scheduler's part, allocating three claims of 4Gi of the T4's
//! memory, and kubelet's, asking the driver to prepare them. Each claim's
//! CDI spec is applied as a runtime would, and, with the shim built, a
//! process in each claim's container shows what `nvidia-smi` prints there.

use crate::error_text::chain;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::dra::checkpoint::current_boot_id;
use crate::dra::claims::ClaimRef;
use crate::dra::prepare::DriverConfig;
use crate::dra::service::DraSockets;
use crate::dra::DEFAULT_DRIVER_NAME;
use crate::isolation::cdi::{self, SpecDir};
use crate::node::gpu::NodeFacts;
use crate::node::inventory::Inventory;
use crate::ops::daemon::{self, Common, DraDaemonConfig};
use crate::ops::demo::{driver_dir, node_isolation, run_tenant, Applied, DemoError, TenantKit};
use gpumem_testkit::fake_apiserver::{allocated_claim, Allocated, FakeApiServer, Kind};
use gpumem_testkit::simulator::dra::{FakeDraKubelet, KUBELET_1_37};

const NODE: &str = "t4-node";
const NODE_UID: &str = "7d0c6e1a-0000-4000-8000-00000000d7a0";
/// The claims, each asking `capacity.requests.memory: 4Gi`.
const CLAIMS: [&str; 3] = ["notebook-1", "notebook-2", "notebook-3"];
const REQUEST_GIB: u64 = 4;
const STARTUP: Duration = Duration::from_secs(10);

/// A step of the scenario that failed, with its error's whole chain.
fn fail(what: &str, err: &(dyn std::error::Error + 'static)) -> DemoError {
    DemoError::Dra(format!("{what}: {}", chain(err)))
}

/// Runs the scenario on the demo's node and appends its report.
pub async fn run(
    inventory: &Inventory,
    kit: Option<&TenantKit>,
    out: &mut String,
) -> Result<(), DemoError> {
    let dir = tempfile::Builder::new()
        .prefix("gpumem-demo-dra-")
        .tempdir()?;
    let api = FakeApiServer::start().await?;
    api.put(json!({"kind": "Node", "metadata": {"name": NODE, "uid": NODE_UID}}));
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    let (client, api_health) = crate::cluster::client::connect_watched(Some(&kubeconfig))
        .await
        .map_err(|e| fail("API client", &e))?;
    let isolation = node_isolation(kit, dir.path())?;
    let specs = SpecDir::of_class(dir.path().join("cdi"), cdi::CLAIM_CLASS);
    let registry = dir.path().join("plugins_registry");
    std::fs::create_dir_all(&registry)?;
    let sockets = DraSockets {
        driver_name: DEFAULT_DRIVER_NAME.to_owned(),
        plugins_dir: dir.path().join("plugins"),
        registry_dir: registry,
    };
    let config = DraDaemonConfig {
        driver: DriverConfig {
            driver: DEFAULT_DRIVER_NAME.to_owned(),
            node: NODE.to_owned(),
            isolation,
            specs: specs.clone(),
            nvidia_spec_dirs: Vec::new(),
        },
        sockets: sockets.clone(),
        client,
        api: api_health,
        facts: NodeFacts::default(),
        boot_id: current_boot_id().unwrap_or_else(|_| "demo".to_owned()),
        pod_resources_socket: dir.path().join("no-pod-resources.sock"),
        startup_taint: None,
        common: Common::quiet(dir.path().join("state"), NODE),
    };
    let shutdown = CancellationToken::new();
    let driver = tokio::spawn(daemon::run_dra(
        config,
        inventory.clone(),
        None,
        shutdown.clone(),
    ));
    let outcome = scenario(&api, &sockets, &specs, inventory, kit, out).await;
    shutdown.cancel();
    match driver.await {
        Ok(Err(err)) => return Err(fail("the DRA driver", &err)),
        Err(err) => return Err(fail("the DRA driver", &err)),
        Ok(Ok(())) => {}
    }
    outcome
}

async fn scenario(
    api: &FakeApiServer,
    sockets: &DraSockets,
    specs: &SpecDir,
    inventory: &Inventory,
    kit: Option<&TenantKit>,
    out: &mut String,
) -> Result<(), DemoError> {
    let socket = sockets.registration_socket();
    gpumem_testkit::simulator::dra::wait_for_socket(&socket, STARTUP)
        .await
        .map_err(|e| fail("registration", &e))?;
    let kubelet = FakeDraKubelet::register(&socket, KUBELET_1_37)
        .await
        .map_err(|e| fail("registration", &e))?;
    let slice = wait_for_slice(api)
        .await
        .ok_or_else(|| DemoError::Dra(format!("no ResourceSlice published within {STARTUP:?}")))?;
    let _ = writeln!(
        out,
        "\nDRA: the driver registered with kubelet ({}) and published ResourceSlice {}:",
        kubelet.version().service(),
        slice["metadata"]["name"].as_str().unwrap_or("?")
    );
    for device in slice["spec"]["devices"].as_array().into_iter().flatten() {
        let memory = &device["capacity"]["memory"];
        let range = &memory["requestPolicy"]["validRange"];
        let _ =
            writeln!(
            out,
            "  {} ({}): memory {}, claims take {}..{} in steps of {}, shared by many claims: {}",
            device["name"].as_str().unwrap_or("?"),
            device["attributes"]["productName"]["string"].as_str().unwrap_or("?"),
            memory["value"].as_str().unwrap_or("?"),
            range["min"].as_str().unwrap_or("?"),
            range["max"].as_str().unwrap_or("?"),
            range["step"].as_str().unwrap_or("?"),
            device["allowMultipleAllocations"] == true
        );
    }

    // The scheduler's part: each claim allocated 4Gi of gpu-0.
    let gpu = &inventory.gpus()[0].gpu;
    let device = crate::dra::slice::device_name(gpu);
    let mut claims = Vec::new();
    for (i, name) in CLAIMS.iter().enumerate() {
        let uid = format!("5d2f8c1e-0000-4000-8000-{:012}", i + 1);
        let memory = format!("{REQUEST_GIB}Gi");
        api.put(allocated_claim(
            "default",
            name,
            &uid,
            DEFAULT_DRIVER_NAME,
            NODE,
            &[Allocated {
                request: "gpu".to_owned(),
                device: device.clone(),
                memory: Some(memory),
                share_id: Some(format!("share-{}", i + 1)),
            }],
        ));
        claims.push(ClaimRef {
            namespace: "default".to_owned(),
            uid,
            name: (*name).to_owned(),
        });
    }
    let _ = writeln!(
        out,
        "\nThe scheduler allocates {} claims of {REQUEST_GIB}Gi on {device}; kubelet asks the \
         driver to prepare them:",
        claims.len()
    );
    let prepared = kubelet
        .prepare(&claims)
        .await
        .map_err(|e| fail("NodePrepareResources", &e))?;
    let driver_files = match kit {
        Some(kit) => Some(driver_dir(kit)?),
        None => None,
    };
    for claim in &claims {
        let devices = match &prepared.get(&claim.uid) {
            Some(Ok(devices)) => devices,
            Some(Err(err)) => {
                let _ = writeln!(out, "  {:<11} not prepared: {err}", claim.name);
                continue;
            }
            None => {
                let _ = writeln!(out, "  {:<11} no answer", claim.name);
                continue;
            }
        };
        let ids: Vec<&str> = devices
            .iter()
            .flat_map(|d| d.cdi_device_ids.iter().map(String::as_str))
            .collect();
        let applied = Applied::of_cdi(&ids, specs);
        let cap = applied.env.get(crate::isolation::inject::env::LIMIT_MIB);
        let _ = writeln!(
            out,
            "  {:<11} CDI {}  cap {} MiB",
            claim.name,
            ids.join(" "),
            cap.map_or("?", String::as_str)
        );
        if let (Some(kit), Some(files)) = (kit, &driver_files) {
            let line = run_tenant(kit, files.path(), gpu, &applied)
                .await
                .unwrap_or_else(|err| format!("could not run: {err}"));
            let _ = writeln!(out, "  {:<11} {line}", "");
        }
    }
    if kit.is_none() {
        out.push_str(
            "\n(Build the shim and the fake driver too, with `cargo build --release --workspace`, \
             and the demo runs a process in each claim's container, held to its cap.)\n",
        );
    }
    Ok(())
}

async fn wait_for_slice(api: &FakeApiServer) -> Option<Value> {
    let deadline = Instant::now() + STARTUP;
    loop {
        let slice = api
            .list(Kind::ResourceSlice)
            .into_iter()
            .find(|s| s["spec"]["nodeName"] == NODE);
        if slice.is_some() || Instant::now() > deadline {
            return slice;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
