//! `gpumem demo`: the real plugin against the in-process kubelet on a fake
//! node, replaying the gpushare notebook scenario and printing the result;
//! where the shim and the fake driver are built, one process per admitted
//! container runs under the shim and shows its cap holding.

use crate::error_text::{chain, one_line};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::deviceplugin::plugin::{Plugin, PluginConfig, PluginError};
use crate::isolation::cdi::SpecDir;
use crate::isolation::inject::{env, DeviceListStrategy, Isolation, ShimConfig, SHIM_LIBRARY};
use crate::isolation::statefs::StateFs;
use crate::node::fake::FakeGpus;
use crate::node::gpu::{Gpu, GpuError};
use crate::node::inventory::{Inventory, InventoryError};
use crate::node::placement::Policy;
use crate::node::resource::ResourceName;
use crate::node::units::MemoryUnit;
use gpumem_testkit::simulator::{AdmissionError, Allocation, KubeletSim};

mod dra;
mod scheduling;

/// The embedded default node: one Tesla T4 as NVML reports it on an Alibaba
/// Cloud ecs.gn6i instance.
pub const DEFAULT_NODE: &str = r#"
[[gpu]]
uuid = "GPU-6b1c2d3e-0000-4000-8000-000000000400"
name = "Tesla T4"
memory_mib = 15079
"#;

const NODE_NAME: &str = "demo-node";
const NAMESPACE: &str = "default";
const CONTAINER: &str = "tensorflow";
/// Three notebooks that fit a T4 and a fourth that does not.
const PODS: [&str; 4] = [
    "tf-notebook-1",
    "tf-notebook-2",
    "tf-notebook-3",
    "tf-notebook-4",
];
/// Each pod asks for 4 GiB, in the advertised unit.
const GIB_PER_POD: u64 = 4;
const STARTUP: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Default)]
pub struct DemoConfig {
    /// A fake GPU file; the embedded T4 node when `None`.
    pub fake_gpus: Option<PathBuf>,
    pub unit: MemoryUnit,
    pub policy: Policy,
    pub resource_name: ResourceName,
    /// Where the shim, the fake driver and the probe are: a process runs in
    /// each admitted container when all three are there.
    pub tenant_dir: Option<PathBuf>,
    /// How Allocate names the GPU. With `cdi` the specs go to a directory of
    /// the demo's own, whatever directory this names.
    pub device_list: DeviceListStrategy,
    /// Play the DRA driver's scenario instead of the device plugin's.
    pub dra: bool,
}

/// What a container's process needs, as `cargo build --release --workspace`
/// leaves it in `target/release`.
const FAKE_DRIVER: &str = "libgpumem_fakegpu.so";
const PROBE: &str = "gpumem-probe";
/// What a CUDA context costs on the fake driver (an H100 takes ~518 MiB).
const FAKE_CONTEXT_MIB: u64 = 300;
/// Each container's process fills its cap in steps of this size.
const STEP_MIB: u64 = 256;

/// The shim, the fake driver and the probe, when all are in `dir`.
struct TenantKit {
    shim: PathBuf,
    driver: PathBuf,
    probe: PathBuf,
}

impl TenantKit {
    fn find(dir: &Path) -> Option<TenantKit> {
        let kit = TenantKit {
            shim: dir.join(SHIM_LIBRARY),
            driver: dir.join(FAKE_DRIVER),
            probe: dir.join(PROBE),
        };
        [&kit.shim, &kit.driver, &kit.probe]
            .iter()
            .all(|p| p.is_file())
            .then_some(kit)
    }

    /// The directory beside the running `gpumem`.
    fn default_dir() -> Option<PathBuf> {
        std::env::current_exe().ok()?.parent().map(Path::to_owned)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    #[error(transparent)]
    List(#[from] crate::deviceplugin::list::TooLarge),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error("cannot set up the simulated kubelet")]
    Io(#[from] std::io::Error),
    #[error("the plugin did not register and advertise devices within {0:?}")]
    NotRegistered(Duration),
    #[error("--tenant-dir {dir}: {missing} not found there (build it with `cargo build --release --workspace`)")]
    TenantKitMissing { dir: PathBuf, missing: String },
    #[error(transparent)]
    Install(#[from] crate::isolation::install::InstallError),
    #[error("scheduling scenario: {0}")]
    Cluster(String),
    #[error("DRA scenario: {0}")]
    Dra(String),
}

/// Runs the scenario and returns the report to print.
pub async fn run(config: DemoConfig) -> Result<String, DemoError> {
    let source = match &config.fake_gpus {
        Some(path) => FakeGpus::from_file(path)?,
        None => FakeGpus::parse(DEFAULT_NODE, Path::new("<embedded T4 node>"))?,
    };
    let inventory = Arc::new(Inventory::new(source.gpus(), config.unit)?);
    crate::deviceplugin::list::check(&inventory)?;
    let kit = tenant_kit(config.tenant_dir.as_deref())?;
    if config.dra {
        let mut out = String::new();
        dra::run(&inventory, kit.as_ref(), &mut out).await?;
        return Ok(out);
    }
    let dir = tempfile::Builder::new().prefix("gpumem-demo-").tempdir()?;
    let isolation = node_isolation(kit.as_ref(), dir.path())?;
    // Never the host's spec directory.
    let device_list = match &config.device_list {
        DeviceListStrategy::Cdi(_) => DeviceListStrategy::Cdi(SpecDir::new(dir.path().join("cdi"))),
        other => other.clone(),
    };
    let kubelet_dir = dir.path().join("kubelet");
    std::fs::create_dir_all(&kubelet_dir)?;
    let kubelet = KubeletSim::start(&kubelet_dir)?;

    let shutdown = CancellationToken::new();
    let (_keep_inventory, inventory_rx) = watch::channel(inventory.clone());
    let plugin = Plugin::new(PluginConfig {
        kubelet_dir,
        resource_name: config.resource_name.clone(),
        policy: config.policy,
        isolation,
        device_list: device_list.clone(),
    });
    let plugin_task = tokio::spawn(plugin.run(inventory_rx, shutdown.clone()));

    let resource = config.resource_name.as_str();
    let per_pod = units_per_pod(inventory.unit());
    let outcome = match kubelet.wait_for_devices(resource, 1, STARTUP).await {
        Some(devices) => {
            let mut admitted = Vec::new();
            for pod in PODS {
                admitted.push((pod, kubelet.admit(pod, CONTAINER, resource, per_pod).await));
            }
            let mut out = report(&config, &inventory, devices.len(), &admitted);
            let specs = device_list.cdi_specs();
            match &kit {
                Some(kit) => run_tenants(kit, &inventory, &admitted, specs, &mut out).await,
                None => out.push_str(
                    "\n(Build the shim and the fake driver too, with `cargo build --release \
                     --workspace`, and the demo runs a process in each admitted container, \
                     held to its cap.)\n",
                ),
            }
            env_given(&admitted, specs, &mut out);
            // The second scenario has a node of its own; a node of the
            // user's plays the first only.
            if config.fake_gpus.is_none() {
                if let Err(err) =
                    scheduling::run(kit.as_ref(), &config.resource_name, config.unit, &mut out)
                        .await
                {
                    let _ = writeln!(out, "\nScheduling by GPU: could not run: {}", chain(&err));
                }
            }
            Ok(out)
        }
        None => Err(DemoError::NotRegistered(STARTUP)),
    };

    shutdown.cancel();
    let stopped = plugin_task.await;
    kubelet.stop().await;
    if let Ok(Err(err)) = stopped {
        return Err(err.into());
    }
    outcome
}

/// The node's side of shim isolation under `dir`, as the DaemonSet sets it
/// up, where the kit is built; else none.
fn node_isolation(kit: Option<&TenantKit>, dir: &Path) -> Result<Isolation, DemoError> {
    let Some(kit) = kit else {
        return Ok(Isolation::None);
    };
    let host_dir = dir.join("shim");
    crate::isolation::install::install(&kit.shim, &host_dir)?;
    Ok(Isolation::Shim(ShimConfig {
        host_dir,
        state_dir: dir.join("state"),
        context_charge_mib: 0,
        state_fs: StateFs::Shared,
    }))
}

/// Pods ask for 4 GiB whatever the unit, so the story is the same in MiB.
fn units_per_pod(unit: MemoryUnit) -> usize {
    usize::try_from(GIB_PER_POD * 1024 / unit.mib()).unwrap_or(usize::MAX)
}

/// The kit in `explicit` (an error if incomplete), else beside `gpumem`
/// (none if incomplete: the demo then shows placement only).
fn tenant_kit(explicit: Option<&Path>) -> Result<Option<TenantKit>, DemoError> {
    let Some(dir) = explicit else {
        return Ok(TenantKit::default_dir().and_then(|d| TenantKit::find(&d)));
    };
    TenantKit::find(dir).map(Some).ok_or_else(|| {
        let missing = [SHIM_LIBRARY, FAKE_DRIVER, PROBE]
            .into_iter()
            .filter(|name| !dir.join(name).is_file())
            .collect::<Vec<_>>()
            .join(", ");
        DemoError::TenantKitMissing {
            dir: dir.to_owned(),
            missing,
        }
    })
}

/// Runs one process in each admitted container, as the container runtime
/// would start it: only the env Allocate gave, the shim preloaded from its
/// mount, the accounting directory at its mount's host path, and the fake
/// driver standing in for the GPU the container was given.
async fn run_tenants(
    kit: &TenantKit,
    inv: &Inventory,
    admitted: &[(&str, Result<Allocation, AdmissionError>)],
    specs: Option<&SpecDir>,
    out: &mut String,
) {
    let _ = writeln!(
        out,
        "\nOne process in each admitted container, under the shim, on the fake CUDA driver \
         ({FAKE_CONTEXT_MIB} MiB per CUDA context):"
    );
    let driver_dir = match driver_dir(kit) {
        Ok(dir) => dir,
        Err(err) => {
            let _ = writeln!(out, "  cannot set up the fake driver: {}", chain(&err));
            return;
        }
    };
    for (pod, result) in admitted {
        let Ok(allocation) = result else { continue };
        let applied = Applied::of(allocation, specs);
        let gpu = allocated_gpu(inv, allocation);
        let ran = match gpu {
            Ok(gpu) => run_tenant(kit, driver_dir.path(), gpu, &applied).await,
            Err(err) => Err(err),
        };
        let line = match ran {
            Ok(line) => line,
            Err(err) => format!("could not run: {err}"),
        };
        let _ = writeln!(out, "  {pod:<14} {line}");
    }
}

/// `libcuda.so.1` and `libnvidia-ml.so.1`, both the fake driver.
fn driver_dir(kit: &TenantKit) -> std::io::Result<tempfile::TempDir> {
    let dir = tempfile::Builder::new()
        .prefix("gpumem-demo-driver-")
        .tempdir()?;
    for name in ["libcuda.so.1", "libnvidia-ml.so.1"] {
        std::os::unix::fs::symlink(&kit.driver, dir.path().join(name))?;
    }
    Ok(dir)
}

/// The GPU a container was admitted on.
fn allocated_gpu<'a>(inv: &'a Inventory, allocation: &Allocation) -> Result<&'a Gpu, String> {
    allocation
        .device_ids
        .first()
        .and_then(|id| inv.resolve(id))
        .map(|(_, position)| &inv.gpus()[position].gpu)
        .ok_or_else(|| "admitted with unknown devices".to_owned())
}

async fn run_tenant(
    kit: &TenantKit,
    driver_dir: &Path,
    gpu: &Gpu,
    applied: &Applied,
) -> Result<String, String> {
    let state = applied
        .state_dir()
        .map_err(|e| format!("could not make the state directory: {}", chain(&e)))?
        .ok_or("no accounting directory was mounted")?;
    let cap: u64 = applied
        .env
        .get(env::LIMIT_MIB)
        .and_then(|v| v.parse().ok())
        .ok_or("no cap was given")?;
    let steps = cap / STEP_MIB + 1;
    let mut cmd = tokio::process::Command::new(&kit.probe);
    cmd.env_clear()
        .envs(&applied.env)
        .env(env::STATE_DIR, state.path())
        .env("LD_PRELOAD", &kit.shim)
        .env("LD_LIBRARY_PATH", driver_dir)
        // The one GPU the runtime would expose, as the fake driver's only one.
        .env("FAKEGPU_UUIDS", &gpu.uuid)
        .env("FAKEGPU_MEMORY_MIB", gpu.memory_mib.to_string())
        .env("FAKEGPU_CONTEXT_MIB", FAKE_CONTEXT_MIB.to_string())
        .arg("nvml")
        .args((0..steps).map(|_| format!("alloc:{STEP_MIB}")))
        .kill_on_drop(true);
    let output = cmd.output().await.map_err(|e| one_line(&e))?;
    let text = String::from_utf8_lossy(&output.stdout);
    tenant_line(&text, cap).ok_or_else(|| {
        let stderr = String::from_utf8_lossy(&output.stderr);
        format!("unexpected output: {} {}", text.trim(), stderr.trim())
    })
}

/// What a container's process saw, from the probe's lines: NVML's view as
/// nvidia-smi prints it, then how far it filled before the first refusal.
fn tenant_line(probe: &str, cap: u64) -> Option<String> {
    const MIB: u64 = 1 << 20;
    let field = |line: &str, key: &str| -> Option<u64> {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.parse().ok())
    };
    let nvml = probe.lines().find(|l| l.starts_with("nvml "))?;
    let (used, total) = (field(nvml, "used=")? / MIB, field(nvml, "total=")? / MIB);
    let results: Vec<i64> = probe
        .lines()
        .filter(|l| l.starts_with("alloc:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    let granted = results.iter().take_while(|&&r| r == 0).count() as u64;
    let refusal = match results.get(granted as usize) {
        Some(2) => "refused: CUDA_ERROR_OUT_OF_MEMORY".to_owned(),
        Some(other) => format!("failed with CUDA error {other}"),
        None => format!("granted too: NOT capped at {cap} MiB"),
    };
    Some(format!(
        "nvidia-smi: {used}MiB / {total}MiB; {} MiB allocated in {STEP_MIB} MiB steps \
         beside its context, the next {STEP_MIB} MiB {refusal}",
        granted * STEP_MIB
    ))
}

fn report(
    config: &DemoConfig,
    inv: &Inventory,
    advertised: usize,
    admitted: &[(&str, Result<Allocation, AdmissionError>)],
) -> String {
    let resource = config.resource_name.as_str();
    let unit = inv.unit();
    let mut out = String::new();
    let gpus = inv.gpus();
    let _ = writeln!(
        out,
        "gpumem demo: node {NODE_NAME:?}, simulated kubelet, no GPU needed"
    );
    for g in gpus {
        let _ = writeln!(
            out,
            "  GPU{} {} {} ({} MiB) -> {} units",
            g.gpu.index, g.gpu.name, g.gpu.uuid, g.gpu.memory_mib, g.units
        );
    }
    let _ = writeln!(
        out,
        "  resource {resource}, 1 unit = 1 {unit}, placement {}; {advertised} devices advertised\n",
        config.policy
    );

    let _ = writeln!(
        out,
        "Admitting pods, each asking for {resource}: {}",
        units_per_pod(unit)
    );
    // Units held per (pod, GPU position).
    let mut held: Vec<(&str, usize, u32, u64)> = Vec::new();
    for (pod, result) in admitted {
        match result {
            Ok(allocation) => {
                let Some(gpu) = allocation.device_ids.first().and_then(|id| inv.resolve(id)) else {
                    let _ = writeln!(out, "  {pod:<14} admitted with unknown devices");
                    continue;
                };
                let units = u32::try_from(allocation.device_ids.len()).unwrap_or(u32::MAX);
                let g = &gpus[gpu.1];
                let cap = g.cap_mib(units);
                let _ = writeln!(
                    out,
                    "  {pod:<14} admitted: GPU{}, {units} units, cap {cap} MiB",
                    g.gpu.index
                );
                held.push((pod, gpu.1, units, cap));
            }
            Err(err) => {
                let _ = writeln!(out, "  {pod:<14} NOT admitted: {}", chain(err));
                if matches!(err, AdmissionError::Insufficient { .. }) {
                    let _ = writeln!(
                        out,
                        "  {:<14} (on a cluster the scheduler keeps this pod Pending for the same reason)",
                        ""
                    );
                }
            }
        }
    }

    // `arena top node -s -d` style: per GPU allocated/total, then per pod.
    let _ = writeln!(out);
    let gpu_cols: Vec<String> = gpus
        .iter()
        .map(|g| format!("GPU{}(Allocated/Total)", g.gpu.index))
        .collect();
    let _ = writeln!(
        out,
        "NAME       {}  GPU Memory({unit})",
        gpu_cols.join("  ")
    );
    let mut row = format!("{NODE_NAME:<10}");
    let (mut all_held, mut all_total) = (0u64, 0u64);
    for (pos, (g, col)) in gpus.iter().zip(&gpu_cols).enumerate() {
        let used: u32 = held.iter().filter(|h| h.1 == pos).map(|h| h.2).sum();
        all_held += u64::from(used);
        all_total += u64::from(g.units);
        let _ = write!(
            row,
            " {:<width$} ",
            format!("{used}/{}", g.units),
            width = col.len()
        );
    }
    let _ = writeln!(out, "{row} {all_held}/{all_total}");
    let percent = (all_held * 100).checked_div(all_total).unwrap_or(0);
    let _ = writeln!(
        out,
        "Allocated/Total GPU Memory In Cluster: {all_held}/{all_total} ({percent}%)\n"
    );

    let _ = writeln!(
        out,
        "{:<15} {:<10} {:<4} {:<6} CAP(MiB)",
        "POD", "NAMESPACE", "GPU", "UNITS"
    );
    for (pod, gpu, units, cap) in &held {
        let _ = writeln!(
            out,
            "{pod:<15} {NAMESPACE:<10} {:<4} {units:<6} {cap}",
            gpus[*gpu].gpu.index
        );
    }

    out
}

fn env_given(
    admitted: &[(&str, Result<Allocation, AdmissionError>)],
    specs: Option<&SpecDir>,
    out: &mut String,
) {
    let _ = writeln!(out, "\nEnv given to each admitted container:");
    for (pod, result) in admitted {
        if let Ok(allocation) = result {
            let _ = writeln!(out, "  {pod}/{}:", allocation.container);
            for device in &allocation.response.cdi_devices {
                let _ = writeln!(out, "    (CDI device {})", device.name);
            }
            for (key, value) in &Applied::of(allocation, specs).env {
                let _ = writeln!(out, "    {key}={value}");
            }
        }
    }
}

/// A container's env and mounts as the runtime applies them: Allocate's
/// answer, plus the edits of gpumem's CDI devices from their specs (the
/// demo has no NVIDIA spec; its fake driver stands in for the GPU).
struct Applied {
    env: BTreeMap<String, String>,
    /// Host path by container path.
    mounts: BTreeMap<PathBuf, PathBuf>,
}

/// The container's state directory, as the shim finds it.
enum StateDir<'a> {
    /// Mounted there itself (Allocate's).
    Mounted(&'a Path),
    /// Claims' directories mounted inside it, stood for by links.
    Links(tempfile::TempDir),
}

impl StateDir<'_> {
    fn path(&self) -> &Path {
        match self {
            StateDir::Mounted(path) => path,
            StateDir::Links(dir) => dir.path(),
        }
    }
}

impl Applied {
    /// The host directory mounted at the state directory, or else one of
    /// links to those mounted inside it; `None` where there are neither.
    fn state_dir(&self) -> std::io::Result<Option<StateDir<'_>>> {
        let root = Path::new(gpumem_layout::CONTAINER_DIR);
        if let Some(host) = self.mounts.get(root) {
            return Ok(Some(StateDir::Mounted(host)));
        }
        let inside: Vec<_> = self
            .mounts
            .iter()
            .filter_map(|(at, host)| Some((at.strip_prefix(root).ok()?, host)))
            .collect();
        if inside.is_empty() {
            return Ok(None);
        }
        let dir = tempfile::Builder::new()
            .prefix("gpumem-demo-state-")
            .tempdir()?;
        for (name, host) in inside {
            std::os::unix::fs::symlink(host, dir.path().join(name))?;
        }
        Ok(Some(StateDir::Links(dir)))
    }

    /// What a runtime applies for the CDI devices `ids` whose specs are in
    /// `specs` (others, such as NVIDIA's, the demo has not).
    fn of_cdi(ids: &[&str], specs: &SpecDir) -> Self {
        let mut applied = Applied {
            env: BTreeMap::new(),
            mounts: BTreeMap::new(),
        };
        for edits in ids.iter().filter_map(|id| specs.edits(id)) {
            applied.apply(edits);
        }
        applied
    }

    fn of(allocation: &Allocation, specs: Option<&SpecDir>) -> Self {
        let response = &allocation.response;
        let mut applied = Applied {
            env: response.envs.clone().into_iter().collect(),
            mounts: response
                .mounts
                .iter()
                .map(|m| (m.container_path.clone().into(), m.host_path.clone().into()))
                .collect(),
        };
        let edits = response
            .cdi_devices
            .iter()
            .filter_map(|d| specs?.edits(&d.name));
        for edits in edits {
            applied.apply(edits);
        }
        applied
    }

    /// A CDI device's edits, as the runtime applies them.
    fn apply(&mut self, edits: crate::isolation::cdi::ContainerEdits) {
        self.env.extend(edits.env_map());
        for m in edits.mounts {
            self.mounts
                .insert(m.container_path.into(), m.host_path.into());
        }
    }
}
