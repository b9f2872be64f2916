//! `gpumem demo`: the real plugin against the in-process kubelet on a fake
//! node, replaying the gpushare notebook scenario and printing the result.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::gpu::{FakeGpus, GpuError, GpuSource};
use crate::inject::Isolation;
use crate::inventory::{Inventory, InventoryError};
use crate::placement::Policy;
use crate::plugin::{Plugin, PluginConfig, PluginError};
use crate::resource::ResourceName;
use crate::simulator::{AdmissionError, Allocation, KubeletSim};
use crate::units::MemoryUnit;

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
const UNITS_PER_POD: usize = 4;
const STARTUP: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Default)]
pub struct DemoConfig {
    /// A fake GPU file; the embedded T4 node when `None`.
    pub fake_gpus: Option<PathBuf>,
    pub unit: MemoryUnit,
    pub policy: Policy,
    pub resource_name: ResourceName,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error("cannot set up the simulated kubelet: {0}")]
    Io(#[from] std::io::Error),
    #[error("the plugin did not register and advertise devices within {0:?}")]
    NotRegistered(Duration),
}

/// Runs the scenario and returns the report to print.
pub async fn run(config: DemoConfig) -> Result<String, DemoError> {
    let source = match &config.fake_gpus {
        Some(path) => FakeGpus::from_file(path)?,
        None => FakeGpus::parse(DEFAULT_NODE, Path::new("<embedded T4 node>"))?,
    };
    let inventory = Arc::new(Inventory::new(source.discover()?, config.unit)?);
    let dir = tempfile::Builder::new().prefix("gpumem-demo-").tempdir()?;
    let kubelet = KubeletSim::start(dir.path())?;

    let shutdown = CancellationToken::new();
    let (_keep_inventory, inventory_rx) = watch::channel(inventory.clone());
    let plugin = Plugin::new(PluginConfig {
        kubelet_dir: dir.path().to_owned(),
        resource_name: config.resource_name.clone(),
        policy: config.policy,
        // No shim is installed in the demo's temp dir: show the placement
        // and env; `gpumem exec` shows enforcement.
        isolation: Isolation::None,
    });
    let plugin_task = tokio::spawn(plugin.run(inventory_rx, shutdown.clone()));

    let resource = config.resource_name.as_str();
    let outcome = match kubelet.wait_for_devices(resource, 1, STARTUP).await {
        Some(devices) => {
            let mut admitted = Vec::new();
            for pod in PODS {
                admitted.push((
                    pod,
                    kubelet.admit(pod, CONTAINER, resource, UNITS_PER_POD).await,
                ));
            }
            Ok(report(&config, &inventory, devices.len(), &admitted))
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
        "Admitting pods, each asking for {resource}: {UNITS_PER_POD}"
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
                let _ = writeln!(out, "  {pod:<14} NOT admitted: {err}");
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

    let _ = writeln!(out, "\nEnv given to each admitted container:");
    for (pod, result) in admitted {
        if let Ok(allocation) = result {
            let _ = writeln!(out, "  {pod}/{}:", allocation.container);
            let mut envs: Vec<_> = allocation.response.envs.iter().collect();
            envs.sort();
            for (key, value) in envs {
                let _ = writeln!(out, "    {key}={value}");
            }
        }
    }
    out
}
