//! The node's view, as `arena top node -s -d` shows it for gpushare: per
//! GPU health and allocated units, per container its GPU, units, cap and
//! actual usage. Built from the inventory, kubelet's pod-resources answer
//! and the containers' accounting files (those alone when pod-resources
//! cannot be read); served as JSON and as metrics.

use crate::error_text::one_line;
use serde::{Deserialize, Serialize};

use crate::isolation::accounting::Usage;
use crate::isolation::containers::{ContainerName, Containers};
use crate::isolation::inject::Isolation;
use crate::kubelet::podresources::{Holding, PodResourcesError};
use crate::node::inventory::Inventory;
use crate::node::placement;

const MIB: u64 = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// The gpumem that read the node: its version and commit (empty from
    /// a plugin older than these fields).
    #[serde(default)]
    pub version: String,
    #[serde(default)]
    pub commit: String,
    pub resource: String,
    pub unit: String,
    /// Registered with the running kubelet (false when read without a plugin).
    pub registered: bool,
    /// Read by `inspect` itself, no plugin answering: `registered` says
    /// nothing then.
    #[serde(skip)]
    pub read_directly: bool,
    pub gpus: Vec<GpuStatus>,
    pub containers: Vec<ContainerStatus>,
    /// Set when kubelet's pod-resources API could not be read: allocations
    /// are then unknown, not zero.
    pub pod_resources_error: Option<String>,
    /// The DRA driver's claims prepared on this node, one row per GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub claims: Vec<ClaimStatus>,
    /// The DRA driver's own state; `None` for the device plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dra: Option<DraStatus>,
    /// Why the API server cannot be reached, while it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_server_error: Option<String>,
}

/// One DRA claim's share of one GPU: every container referencing the claim
/// shares its cap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimStatus {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub gpu: u32,
    pub cap_mib: u64,
    #[serde(default)]
    pub accounting_dir: Option<String>,
    /// The containers referencing the claim, `pod/container`, as kubelet's
    /// pod-resources API lists them (empty when it could not be read).
    #[serde(default)]
    pub containers: Vec<String>,
    #[serde(default)]
    pub used_mib: Option<u64>,
    #[serde(default)]
    pub untracked_mib: Option<u64>,
    #[serde(default)]
    pub peak_mib: Option<u64>,
    #[serde(default)]
    pub refused_allocations: Option<u64>,
}

/// The DRA driver: its registration with kubelet and its ResourceSlice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraStatus {
    pub driver: String,
    /// `Waiting`, `Registered` or `Refused: <kubelet's reason>`.
    pub registration: String,
    /// The published slice's name; `None` until published.
    #[serde(default)]
    pub slice: Option<String>,
    #[serde(default)]
    pub slice_devices: usize,
    /// Whether the API server kept the slice's consumable-capacity fields
    /// (`DRAConsumableCapacity`); `false`: each GPU goes whole to one claim.
    #[serde(default)]
    pub consumable_capacity: Option<bool>,
    /// The last failure to publish the slice, if it has not been published since.
    #[serde(default)]
    pub slice_error: Option<String>,
}

/// One claim's cap on one GPU, from the driver's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimShare {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub gpu_uuid: String,
    pub cap_mib: u64,
    pub dir: ContainerName,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub healthy: bool,
    pub memory_mib: u64,
    pub units: u32,
    pub allocated_units: u32,
    /// Sum of the caps of the containers on this GPU.
    pub allocated_mib: u64,
    /// Memory processes in no gpumem container hold here (host daemons,
    /// pods that reached the GPU without asking); `None` where it is not
    /// reconciled.
    #[serde(default)]
    pub unmanaged_mib: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerStatus {
    /// Who holds the devices, as kubelet's pod-resources API says; `None`
    /// when it could not be read and the container was found by its
    /// accounting directory instead.
    pub namespace: Option<String>,
    pub pod: Option<String>,
    pub container: Option<String>,
    pub gpu: u32,
    pub units: u32,
    pub cap_mib: u64,
    /// The container's directory under `<state-dir>/containers` (only with
    /// shim isolation).
    #[serde(default)]
    pub accounting_dir: Option<String>,
    /// What the container's processes use now, from its accounting file
    /// (only with shim isolation, and only where the file is readable).
    pub used_mib: Option<u64>,
    /// The part of `used_mib` the driver holds beyond the charged
    /// allocations (contexts, libraries), as last reconciled.
    #[serde(default)]
    pub untracked_mib: Option<u64>,
    /// The highest usage an allocation reached in this container.
    #[serde(default)]
    pub peak_mib: Option<u64>,
    /// Allocations refused for the cap: the container wanted more.
    #[serde(default)]
    pub refused_allocations: Option<u64>,
}

impl NodeStatus {
    /// Reads the containers' accounting files: call it off the async workers.
    pub fn build(
        inv: &Inventory,
        resource: &str,
        registered: bool,
        holdings: Result<Vec<Holding>, PodResourcesError>,
        isolation: &Isolation,
    ) -> NodeStatus {
        let mut gpus: Vec<GpuStatus> = inv
            .gpus()
            .iter()
            .map(|g| GpuStatus {
                index: g.gpu.index,
                name: g.gpu.name.clone(),
                uuid: g.gpu.uuid.clone(),
                healthy: g.gpu.healthy,
                memory_mib: g.gpu.memory_mib,
                units: g.units,
                allocated_units: 0,
                allocated_mib: 0,
                unmanaged_mib: None,
            })
            .collect();
        let state = match isolation {
            Isolation::Shim(shim) => Some(shim.containers()),
            Isolation::None => None,
        };
        let (mut containers, pod_resources_error) = match holdings {
            Ok(holdings) => (held(inv, holdings, state.as_ref(), &mut gpus), None),
            // Who holds what is unknown, but the state dir still tells which
            // containers have caps here and what they use.
            Err(e) => (
                state.map_or_else(Vec::new, |state| found(inv, &state)),
                Some(one_line(&e)),
            ),
        };
        containers.sort_by(|a, b| {
            (&a.namespace, &a.pod, &a.container, a.gpu, &a.accounting_dir).cmp(&(
                &b.namespace,
                &b.pod,
                &b.container,
                b.gpu,
                &b.accounting_dir,
            ))
        });
        NodeStatus {
            version: crate::version::VERSION.to_owned(),
            commit: crate::version::COMMIT.to_owned(),
            resource: resource.to_owned(),
            unit: inv.unit().to_string(),
            registered,
            read_directly: false,
            gpus,
            containers,
            pod_resources_error,
            claims: Vec::new(),
            dra: None,
            api_server_error: None,
        }
    }

    /// Adds the DRA driver's claims, counted on their GPUs, with the
    /// containers `holdings` says reference them and, with the shim, their
    /// usage. Reads accounting files: call it off the async workers.
    pub fn add_claims(
        &mut self,
        inv: &Inventory,
        shares: Vec<ClaimShare>,
        holdings: &[Holding],
        isolation: &Isolation,
    ) {
        let state = match isolation {
            Isolation::Shim(shim) => Some(shim.containers()),
            Isolation::None => None,
        };
        for share in shares {
            let Some(position) = inv.gpus().iter().position(|g| g.gpu.uuid == share.gpu_uuid)
            else {
                continue;
            };
            let dir = state.as_ref().map(|c| c.get(share.dir.clone()));
            let usage = dir
                .as_ref()
                .and_then(|d| d.accounting().ok())
                .and_then(|p| p.devices.into_iter().find(|u| u.uuid == share.gpu_uuid));
            let gpu = &mut self.gpus[position];
            gpu.allocated_mib += share.cap_mib;
            let containers = holdings
                .iter()
                .filter(|h| {
                    h.claims
                        .iter()
                        .any(|(ns, name)| *ns == share.namespace && *name == share.name)
                })
                .map(|h| format!("{}/{}", h.pod, h.container))
                .collect();
            self.claims.push(ClaimStatus {
                namespace: share.namespace,
                name: share.name,
                uid: share.uid,
                gpu: gpu.index,
                cap_mib: share.cap_mib,
                accounting_dir: dir.map(|d| d.name.to_string()),
                containers,
                used_mib: usage.as_ref().map(|u| u.used_bytes / MIB),
                untracked_mib: usage.as_ref().map(|u| u.untracked_bytes / MIB),
                peak_mib: usage.as_ref().map(|u| u.peak_bytes / MIB),
                refused_allocations: usage.as_ref().map(|u| u.refusals),
            });
        }
        self.claims
            .sort_by(|a, b| (&a.namespace, &a.name, a.gpu).cmp(&(&b.namespace, &b.name, b.gpu)));
    }

    /// A table like `arena top node -s` (and `-d` with `details`).
    pub fn table(&self, details: bool) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<4} {:<24} {:<42} {:<10} {:<22} MEMORY MiB(Allocated/Total)",
            "GPU", "NAME", "UUID", "HEALTH", "UNITS(Allocated/Total)"
        );
        let (mut held, mut total) = (0u64, 0u64);
        for g in &self.gpus {
            held += u64::from(g.allocated_units);
            total += u64::from(g.units);
            let units = format!("{}/{}", g.allocated_units, g.units);
            let health = if g.healthy { "Healthy" } else { "Unhealthy" };
            let _ = writeln!(
                out,
                "{:<4} {:<24} {:<42} {health:<10} {units:<22} {}/{}",
                g.index, g.name, g.uuid, g.allocated_mib, g.memory_mib
            );
        }
        let percent = (held * 100).checked_div(total).unwrap_or(0);
        let _ = writeln!(
            out,
            "Allocated/Total {} ({}): {held}/{total} ({percent}%)",
            self.resource, self.unit
        );
        // The DRA driver's registration has its own line below.
        if !self.registered && !self.read_directly && self.dra.is_none() {
            let _ = writeln!(
                out,
                "warning: not registered with kubelet: the node advertises no {} from this \
                 plugin (its log says why)",
                self.resource
            );
        }
        if let Some(err) = &self.pod_resources_error {
            let _ = writeln!(out, "warning: allocations unknown: {err}");
        }
        if let Some(err) = &self.api_server_error {
            let _ = writeln!(out, "warning: {err}");
        }
        for g in &self.gpus {
            if let Some(mib) = g.unmanaged_mib.filter(|&mib| mib > 0) {
                let _ = writeln!(
                    out,
                    "warning: GPU{} has {mib} MiB held outside every gpumem container (the \
                     plugin's log names the processes)",
                    g.index
                );
            }
        }
        if let Some(dra) = &self.dra {
            let capacity = match dra.consumable_capacity {
                Some(true) => "memory as consumable capacity",
                Some(false) => "consumable capacity DROPPED by the API server: each GPU goes whole to one claim",
                None => "not published yet",
            };
            let _ = writeln!(
                out,
                "DRA driver {}: {}; ResourceSlice {} ({} devices; {capacity})",
                dra.driver,
                dra.registration,
                dra.slice.as_deref().unwrap_or("-"),
                dra.slice_devices
            );
            if let Some(err) = &dra.slice_error {
                let _ = writeln!(out, "warning: ResourceSlice: {err}");
            }
        }
        if details && !self.claims.is_empty() {
            let mib = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |u| u.to_string());
            let _ = writeln!(
                out,
                "\n{:<16} {:<24} {:<4} {:<9} {:<10} {:<15} {:<8} CONTAINERS",
                "NAMESPACE", "CLAIM", "GPU", "CAP(MiB)", "USED(MiB)", "UNTRACKED(MiB)", "REFUSED"
            );
            for c in &self.claims {
                let containers = if c.containers.is_empty() {
                    "-".to_owned()
                } else {
                    c.containers.join(",")
                };
                let _ = writeln!(
                    out,
                    "{:<16} {:<24} {:<4} {:<9} {:<10} {:<15} {:<8} {containers}",
                    c.namespace,
                    c.name,
                    c.gpu,
                    c.cap_mib,
                    mib(c.used_mib),
                    mib(c.untracked_mib),
                    mib(c.refused_allocations)
                );
            }
        }
        if details && (self.dra.is_none() || !self.containers.is_empty()) {
            let _ = writeln!(
                out,
                "\n{:<16} {:<24} {:<16} {:<4} {:<6} {:<9} {:<10} {:<15} REFUSED",
                "NAMESPACE",
                "POD",
                "CONTAINER",
                "GPU",
                "UNITS",
                "CAP(MiB)",
                "USED(MiB)",
                "UNTRACKED(MiB)"
            );
            let mib = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |u| u.to_string());
            let who = |v: &Option<String>| v.as_deref().unwrap_or("-").to_owned();
            for c in &self.containers {
                let _ = writeln!(
                    out,
                    "{:<16} {:<24} {:<16} {:<4} {:<6} {:<9} {:<10} {:<15} {}",
                    who(&c.namespace),
                    c.pod.as_deref().unwrap_or("(unknown)"),
                    who(&c.container),
                    c.gpu,
                    c.units,
                    c.cap_mib,
                    mib(c.used_mib),
                    mib(c.untracked_mib),
                    mib(c.refused_allocations)
                );
            }
        }
        out
    }
}

/// The containers kubelet lists as holding our devices, counted on their GPUs.
fn held(
    inv: &Inventory,
    holdings: Vec<Holding>,
    containers: Option<&Containers>,
    gpus: &mut [GpuStatus],
) -> Vec<ContainerStatus> {
    let mut listed = Vec::new();
    for holding in holdings {
        // IDs from an older configuration (say, another unit size) are not ours.
        let Ok(assignment) = placement::assign(inv, &holding.device_ids) else {
            continue;
        };
        let gpu = &inv.gpus()[assignment.gpu];
        let cap_mib = gpu.cap_mib(assignment.units);
        let dir = containers.map(|c| c.holding(inv, assignment, &holding.device_ids));
        let usage = dir
            .as_ref()
            .and_then(|d| d.accounting().ok())
            .and_then(|p| p.devices.into_iter().next());
        gpus[assignment.gpu].allocated_units += assignment.units;
        gpus[assignment.gpu].allocated_mib += cap_mib;
        listed.push(ContainerStatus::new(
            Some(holding),
            gpu.gpu.index,
            assignment.units,
            cap_mib,
            dir.map(|d| d.name.to_string()),
            usage.as_ref(),
        ));
    }
    listed
}

/// Every container with an accounting file for one of our GPUs, pod unknown.
/// Some may have finished (their directories stay for the grace period),
/// so they are not counted as allocations.
fn found(inv: &Inventory, containers: &Containers) -> Vec<ContainerStatus> {
    containers
        .list()
        .into_iter()
        .filter_map(|dir| {
            let units = dir.name.units()?;
            let usage = dir.accounting().ok()?.devices.into_iter().next()?;
            let gpu = inv.gpus().iter().find(|g| g.gpu.uuid == usage.uuid)?;
            Some(ContainerStatus::new(
                None,
                gpu.gpu.index,
                units,
                usage.cap_bytes / MIB,
                Some(dir.name.to_string()),
                Some(&usage),
            ))
        })
        .collect()
}

impl ContainerStatus {
    /// `holder` where kubelet said who it is; `usage` where its accounting
    /// file was read.
    fn new(
        holder: Option<Holding>,
        gpu: u32,
        units: u32,
        cap_mib: u64,
        accounting_dir: Option<String>,
        usage: Option<&Usage>,
    ) -> ContainerStatus {
        let (namespace, pod, container) = match holder {
            Some(h) => (Some(h.namespace), Some(h.pod), Some(h.container)),
            None => (None, None, None),
        };
        ContainerStatus {
            namespace,
            pod,
            container,
            gpu,
            units,
            cap_mib,
            accounting_dir,
            used_mib: usage.map(|u| u.used_bytes / MIB),
            untracked_mib: usage.map(|u| u.untracked_bytes / MIB),
            peak_mib: usage.map(|u| u.peak_bytes / MIB),
            refused_allocations: usage.map(|u| u.refusals),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A registered T4 node's status with `containers` and nothing else.
    pub(crate) fn node_status(containers: Vec<ContainerStatus>) -> NodeStatus {
        NodeStatus {
            version: "0.1.0".into(),
            commit: "1a2b3c4d5e6f".into(),
            resource: "aliyun.com/gpu-mem".into(),
            unit: "GiB".into(),
            registered: true,
            read_directly: false,
            gpus: vec![],
            containers,
            pod_resources_error: None,
            claims: vec![],
            dra: None,
            api_server_error: None,
        }
    }

    #[test]
    fn the_detail_table_lines_up_usage_under_its_headings() {
        let status = node_status(vec![ContainerStatus {
            namespace: Some("default".into()),
            pod: Some("tf-notebook-1".into()),
            container: Some("main".into()),
            gpu: 0,
            units: 4,
            cap_mib: 4308,
            accounting_dir: None,
            used_mib: Some(1873),
            untracked_mib: Some(412),
            peak_mib: Some(4300),
            refused_allocations: Some(3),
        }]);
        let table = status.table(true);
        let lines: Vec<&str> = table.lines().collect();
        let heading = lines.iter().find(|l| l.starts_with("NAMESPACE")).unwrap();
        let row = lines.last().unwrap();
        for (title, value) in [
            ("CAP(MiB)", "4308"),
            ("USED(MiB)", "1873"),
            ("UNTRACKED(MiB)", "412"),
            ("REFUSED", "3"),
        ] {
            let at = heading.find(title).unwrap();
            assert_eq!(&row[at..at + value.len()], value, "{title}:\n{table}");
        }
        // Without shim isolation there is nothing to show, not zero.
        let mut bare = status.clone();
        bare.containers[0].used_mib = None;
        bare.containers[0].refused_allocations = None;
        let row = bare.table(true).lines().last().unwrap().to_owned();
        assert!(row.ends_with(" -"), "{row}");
        // Found by its accounting directory alone: the pod is unknown.
        let mut found = status.clone();
        found.containers[0].namespace = None;
        found.containers[0].pod = None;
        found.containers[0].container = None;
        let row = found.table(true).lines().last().unwrap().to_owned();
        assert!(row.starts_with("-                (unknown)  "), "{row}");
    }
}
