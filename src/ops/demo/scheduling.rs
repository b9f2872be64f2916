//! The demo's second scenario: scheduling by GPU. A node with two 16 GiB
//! V100s holds two pods of 5 GiB, one on each GPU, so 10 GiB is free on
//! each. A pod asking for 15 GiB fits the node's total but no single GPU:
//! gpumem's scheduler extender (the real `gpumem extender`, asked over HTTP
//! as kube-scheduler asks it) filters the node out with the reason, where
//! without it the pod would be scheduled and fail admission. A pod asking
//! for 4 GiB is bound by the extender, and the node's plugin, following
//! the extender, puts it on the GPU it chose; the annotations gpushare's
//! tools read are shown, and, with the shim built, what `nvidia-smi` prints
//! in the pod.

use crate::error_text::{chain, one_line};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::cluster::client::{self, ADMISSION_CALL_BOUND};
use crate::cluster::gpushare::{annotation, Extender};
use crate::cluster::pods::NodePods;
use crate::deviceplugin::plugin::{Plugin, PluginConfig};
use crate::isolation::inject::DeviceListStrategy;
use crate::node::fake::FakeGpus;
use crate::node::inventory::Inventory;
use crate::node::placement::Policy;
use crate::node::resource::ResourceName;
use crate::node::units::MemoryUnit;
use crate::ops::demo::{
    allocated_gpu, driver_dir, node_isolation, run_tenant, Applied, DemoError, TenantKit, STARTUP,
};
use gpumem_testkit::fake_apiserver::{FakeApiServer, Kind};
use gpumem_testkit::simulator::{KubeletSim, NAMESPACE};

/// Two Tesla V100-SXM2-16GB as NVML reports them.
const TWO_V100: &str = r#"
[[gpu]]
uuid = "GPU-1a2b3c4d-0000-4000-8000-000000010000"
name = "Tesla V100-SXM2-16GB"
memory_mib = 16160

[[gpu]]
uuid = "GPU-1a2b3c4d-0000-4000-8000-000000010001"
name = "Tesla V100-SXM2-16GB"
memory_mib = 16160
"#;

const NODE: &str = "v100-node";
const CONTAINER: &str = "main";
/// The pods, in GiB: two already running, one too big for either GPU, one
/// that fits.
const RUNNING: [(&str, u64); 2] = [("train-a", 5), ("train-b", 5)];
const TOO_BIG: (&str, u64) = ("big-notebook", 15);
const FITS: (&str, u64) = ("small-notebook", 4);

/// Runs the scenario and appends its report to `out`.
pub async fn run(
    kit: Option<&TenantKit>,
    resource: &ResourceName,
    unit: MemoryUnit,
    out: &mut String,
) -> Result<(), DemoError> {
    let dir = tempfile::Builder::new()
        .prefix("gpumem-demo-gpus-")
        .tempdir()?;
    let api = FakeApiServer::start().await?;
    let kubeconfig = dir.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)?;
    api.put(json!({"kind": "Node", "metadata": {"name": NODE}}));
    let client = client::connect(Some(&kubeconfig))
        .await
        .map_err(|err| DemoError::Cluster(one_line(&err)))?;

    let gpus = FakeGpus::parse(TWO_V100, Path::new("<embedded two-V100 node>"))?.gpus();
    let inventory = Arc::new(Inventory::new(gpus, unit)?);
    crate::deviceplugin::list::check(&inventory)?;
    crate::cluster::node::publish(&client, NODE, &inventory)
        .await
        .map_err(|err| DemoError::Cluster(one_line(&err)))?;

    let isolation = node_isolation(kit, dir.path())?;
    let kubelet_dir = dir.path().join("kubelet");
    std::fs::create_dir_all(&kubelet_dir)?;
    let kubelet = KubeletSim::start(&kubelet_dir)?;
    let stop = CancellationToken::new();
    let pods = NodePods::watch(client, NODE, stop.clone());
    let plugin = Plugin::new(PluginConfig {
        kubelet_dir,
        resource_name: resource.clone(),
        policy: Policy::Binpack,
        isolation,
        device_list: DeviceListStrategy::default(),
    })
    .with_extender(Extender::new(
        pods,
        resource.as_str(),
        Policy::Binpack,
        ADMISSION_CALL_BOUND,
    ));
    let (_keep, inventory_rx) = watch::channel(inventory.clone());
    let plugin_task = tokio::spawn(plugin.run(inventory_rx, stop.clone()));

    let extender = ExtenderProcess::start(&kubeconfig, resource).await;
    let outcome = match (
        extender,
        kubelet
            .wait_for_devices(resource.as_str(), 1, STARTUP)
            .await,
    ) {
        (Ok(extender), Some(_)) => {
            let scenario = Scenario {
                api: &api,
                kubelet: &kubelet,
                extender: extender.addr,
                resource: resource.as_str(),
                units_per_gib: 1024 / unit.mib(),
                inventory: &inventory,
            };
            scenario.play(kit, out).await
        }
        (Err(err), _) => Err(err),
        (_, None) => Err(DemoError::NotRegistered(STARTUP)),
    };
    stop.cancel();
    let _ = plugin_task.await;
    kubelet.stop().await;
    outcome
}

struct Scenario<'a> {
    api: &'a FakeApiServer,
    kubelet: &'a KubeletSim,
    extender: SocketAddr,
    resource: &'a str,
    units_per_gib: u64,
    inventory: &'a Inventory,
}

impl Scenario<'_> {
    async fn play(&self, kit: Option<&TenantKit>, out: &mut String) -> Result<(), DemoError> {
        let _ = writeln!(
            out,
            "\nScheduling by GPU: node {NODE:?} with two Tesla V100-SXM2-16GB ({} units each), \
             gpumem's scheduler extender (placement spread) and the plugin following it",
            self.inventory.gpus()[0].units
        );
        for (pod, gib) in RUNNING {
            let line = match self.schedule(pod, gib).await? {
                Ok(()) => self.admit(pod, gib).await,
                Err(reason) => format!("NOT scheduled: {reason}"),
            };
            let _ = writeln!(out, "  {pod:<15} {gib:>2} GiB: {line}");
        }
        let (pod, gib) = TOO_BIG;
        let line = match self.schedule(pod, gib).await? {
            Err(reason) => format!(
                "stays Pending, filtered out by the extender: {reason}\n  {:<15}         \
                 (without the extender it would be scheduled on the node's {} free units and \
                 fail admission there)",
                "",
                self.free_units()
            ),
            Ok(()) => format!("scheduled: {}", self.admit(pod, gib).await),
        };
        let _ = writeln!(out, "  {pod:<15} {gib:>2} GiB: {line}");
        let (pod, gib) = FITS;
        let line = match self.schedule(pod, gib).await? {
            Ok(()) => self.admit(pod, gib).await,
            Err(reason) => format!("NOT scheduled: {reason}"),
        };
        let _ = writeln!(out, "  {pod:<15} {gib:>2} GiB: {line}");

        let _ = writeln!(
            out,
            "\n  Annotations kubectl inspect gpushare and arena top node read:"
        );
        for (pod, _) in RUNNING.into_iter().chain([TOO_BIG, FITS]) {
            let annotations = self
                .api
                .get(Kind::Pod, NAMESPACE, pod)
                .and_then(|p| p.pointer("/metadata/annotations").cloned())
                .unwrap_or(Value::Null);
            let get = |key: &str| annotations.get(key).and_then(Value::as_str).unwrap_or("-");
            let _ = writeln!(
                out,
                "    {pod:<15} {}={} {}={} {}={} {}={}",
                annotation::IDX,
                get(annotation::IDX),
                annotation::POD,
                get(annotation::POD),
                annotation::DEV,
                get(annotation::DEV),
                annotation::ASSIGNED,
                get(annotation::ASSIGNED)
            );
        }
        if let Some(kit) = kit {
            let allocation = self
                .kubelet
                .allocations()
                .into_iter()
                .find(|a| a.pod == FITS.0);
            if let Some(allocation) = allocation {
                let driver = driver_dir(kit)?;
                let applied = Applied::of(&allocation, None);
                let ran = match allocated_gpu(self.inventory, &allocation) {
                    Ok(gpu) => run_tenant(kit, driver.path(), gpu, &applied).await,
                    Err(err) => Err(err),
                };
                let line = ran.unwrap_or_else(|err| format!("could not run: {err}"));
                let _ = writeln!(out, "\n  In {}: {line}", FITS.0);
            }
        }
        Ok(())
    }

    fn units(&self, gib: u64) -> u64 {
        gib * self.units_per_gib
    }

    /// Units the node has free, as kube-scheduler counts them.
    fn free_units(&self) -> u64 {
        let total: u64 = self
            .inventory
            .gpus()
            .iter()
            .map(|g| u64::from(g.units))
            .sum();
        let held: u64 = self
            .kubelet
            .allocations()
            .iter()
            .map(|a| a.device_ids.len() as u64)
            .sum();
        total - held
    }

    /// What kube-scheduler does with a new pod: filter, prioritize, bind.
    /// `Ok(Err(reason))`: the extender filtered the node out.
    async fn schedule(&self, pod: &str, gib: u64) -> Result<Result<(), String>, DemoError> {
        let units = self.units(gib).to_string();
        let stored = self.api.put(json!({
            "kind": "Pod",
            "metadata": {"name": pod, "namespace": NAMESPACE},
            "spec": {"containers": [{"name": CONTAINER, "image": "notebook", "resources": {
                "limits": {self.resource: units},
                "requests": {self.resource: units},
            }}]},
            "status": {"phase": "Pending"},
        }));
        let args = json!({"Pod": stored, "Nodes": null, "NodeNames": [NODE]});
        let filtered = self.post("/filter", &args).await?;
        if let Some(reason) = filtered
            .pointer(&format!("/FailedNodes/{NODE}"))
            .and_then(Value::as_str)
        {
            return Ok(Err(reason.to_owned()));
        }
        let error = filtered.get("Error").and_then(Value::as_str).unwrap_or("");
        if !error.is_empty() {
            return Ok(Err(error.to_owned()));
        }
        self.post("/prioritize", &args).await?;
        let bound = self
            .post(
                "/bind",
                &json!({
                    "PodName": pod,
                    "PodNamespace": NAMESPACE,
                    "PodUID": stored.pointer("/metadata/uid"),
                    "Node": NODE,
                }),
            )
            .await?;
        match bound.get("Error").and_then(Value::as_str) {
            Some(error) if !error.is_empty() => Ok(Err(error.to_owned())),
            _ => Ok(Ok(())),
        }
    }

    /// kubelet admits the bound pod; the line to print.
    async fn admit(&self, pod: &str, gib: u64) -> String {
        let count = usize::try_from(self.units(gib)).unwrap_or(usize::MAX);
        match self
            .kubelet
            .admit(pod, CONTAINER, self.resource, count)
            .await
        {
            Ok(allocation) => {
                let gpu = allocation
                    .device_ids
                    .first()
                    .and_then(|id| self.inventory.resolve(id))
                    .map_or("?".to_owned(), |(_, p)| {
                        self.inventory.gpus()[p].gpu.index.to_string()
                    });
                format!("bound by the extender, admitted on GPU{gpu}")
            }
            Err(err) => format!("bound, NOT admitted: {}", chain(&err)),
        }
    }

    async fn post(&self, path: &str, body: &Value) -> Result<Value, DemoError> {
        post_json(self.extender, path, body)
            .await
            .map_err(|err| DemoError::Cluster(format!("extender {path}: {err}")))
    }
}

/// `gpumem extender`, run as its own process from this binary, as a
/// Deployment runs it.
struct ExtenderProcess {
    addr: SocketAddr,
    _child: tokio::process::Child,
}

impl ExtenderProcess {
    async fn start(kubeconfig: &Path, resource: &ResourceName) -> Result<Self, DemoError> {
        let gpumem = std::env::current_exe()?;
        // A free port, chosen now and handed over.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let child = tokio::process::Command::new(gpumem)
            .arg("extender")
            .arg("--listen-addr")
            .arg(addr.to_string())
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--resource-name")
            .arg(resource.as_str())
            .args(["--placement", "spread"])
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let deadline = Instant::now() + STARTUP;
        loop {
            if get_ok(addr, "/healthz").await {
                return Ok(ExtenderProcess {
                    addr,
                    _child: child,
                });
            }
            if Instant::now() > deadline {
                return Err(DemoError::Cluster(format!(
                    "gpumem extender did not answer on {addr} within {STARTUP:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn get_ok(addr: SocketAddr, path: &str) -> bool {
    request(addr, "GET", path, None)
        .await
        .is_ok_and(|(status, _)| status == 200)
}

async fn post_json(addr: SocketAddr, path: &str, body: &Value) -> Result<Value, String> {
    let (status, text) = request(addr, "POST", path, Some(body.to_string())).await?;
    if status != 200 {
        return Err(format!("HTTP {status}: {text}"));
    }
    serde_json::from_str(&text).map_err(|err| format!("{err}: {text}"))
}

async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<String>,
) -> Result<(u16, String), String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| one_line(&e))?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| one_line(&e))?;
    tokio::spawn(connection);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(hyper::header::HOST, addr.to_string())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .body(http_body_util::Full::new(hyper::body::Bytes::from(
            body.unwrap_or_default(),
        )))
        .map_err(|e| one_line(&e))?;
    let response = tokio::time::timeout(Duration::from_secs(10), sender.send_request(request))
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| one_line(&e))?;
    let status = response.status().as_u16();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(|e| one_line(&e))?
        .to_bytes();
    Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
}
