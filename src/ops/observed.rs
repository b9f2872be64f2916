//! What gpumem's endpoints report on: the front end kubelet talks to and
//! the node's live handles, and the node status (`/status`) built from them.

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinError;

use crate::cluster::client::ApiHealth;
use crate::deviceplugin::plugin::PluginStatus;
use crate::deviceplugin::service::Counters;
use crate::dra::prepare::PreparedClaims;
use crate::dra::registration::Registration;
use crate::dra::slice::SliceStatus;
use crate::isolation::enforce::Actions;
use crate::isolation::inject::Isolation;
use crate::isolation::reconcile::attribution::SharedSnapshot;
use crate::isolation::reconcile::{Overheads, Reconciler, Unmanaged};
use crate::kubelet::podresources::{Holding, PodResources, PodResourcesError};
use crate::node::inventory::Inventory;
use crate::node::sensors::Sensors;
use crate::ops::status::{ClaimShare, DraStatus, NodeStatus};
use crate::sync::LockExt;

const MIB: u64 = 1 << 20;

/// The front end kubelet talks to, and what it knows.
#[derive(Clone)]
pub enum FrontEnd {
    DevicePlugin(watch::Receiver<PluginStatus>),
    Dra {
        registration: watch::Receiver<Registration>,
        slice: watch::Receiver<SliceStatus>,
        claims: PreparedClaims,
    },
}

impl FrontEnd {
    /// Registered with the running kubelet.
    pub fn registered(&self) -> bool {
        match self {
            FrontEnd::DevicePlugin(plugin) => plugin.borrow().registered,
            FrontEnd::Dra { registration, .. } => {
                matches!(*registration.borrow(), Registration::Registered)
            }
        }
    }

    /// Registrations with kubelet so far (the device plugin re-registers
    /// at every kubelet restart; the DRA driver is registered by kubelet).
    pub(crate) fn registrations(&self) -> u64 {
        match self {
            FrontEnd::DevicePlugin(plugin) => plugin.borrow().registrations,
            FrontEnd::Dra { .. } => u64::from(self.registered()),
        }
    }
}

/// Everything the endpoints report on.
#[derive(Clone)]
pub struct Observed {
    pub resource: String,
    pub inventory: watch::Receiver<Arc<Inventory>>,
    pub front_end: FrontEnd,
    pub counters: Arc<Counters>,
    pub pod_resources: PodResources,
    pub isolation: Arc<Isolation>,
    /// Per-GPU process overhead, where untracked usage is reconciled.
    pub overheads: Option<Overheads>,
    /// Per-GPU memory outside every gpumem container, where reconciled.
    pub unmanaged: Option<Unmanaged>,
    /// Over-cap actions taken, where the action is on.
    pub over_cap: Option<Arc<Actions>>,
    /// Whether the API server answers, where gpumem uses one.
    pub api: Option<ApiHealth>,
    /// Whose each GPU process is, where reconciled.
    pub attribution: Option<SharedSnapshot>,
    /// The GPUs' sensors, where they can be read.
    pub sensors: Option<Arc<dyn Sensors>>,
    /// The node's name (`Hostname` on every GPU's series, as dcgm-exporter
    /// labels its own, so the two join).
    pub hostname: String,
    /// Also serve the series arena reads (`--arena-metrics`, [`arena`]).
    pub arena_series: bool,
}

impl Observed {
    /// What the endpoints report on; `reconciler` where usage is reconciled.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        resource: String,
        inventory: watch::Receiver<Arc<Inventory>>,
        front_end: FrontEnd,
        counters: Arc<Counters>,
        pod_resources: PodResources,
        isolation: Arc<Isolation>,
        reconciler: Option<&Reconciler>,
        sensors: Option<Arc<dyn Sensors>>,
        hostname: String,
    ) -> Self {
        Observed {
            resource,
            inventory,
            front_end,
            counters,
            pod_resources,
            isolation,
            overheads: reconciler.map(Reconciler::overheads),
            unmanaged: reconciler.map(Reconciler::unmanaged),
            over_cap: reconciler.and_then(Reconciler::actions),
            api: None,
            attribution: reconciler.map(Reconciler::attribution),
            sensors,
            hostname,
            arena_series: false,
        }
    }

    /// Serves the series arena reads too (`--arena-metrics`).
    pub fn with_arena_series(mut self, on: bool) -> Self {
        self.arena_series = on;
        self
    }

    /// Reports the API server's reachability too.
    pub fn with_api(mut self, api: ApiHealth) -> Self {
        self.api = Some(api);
        self
    }

    /// Asks pod-resources, then reads the accounting files off the async
    /// workers.
    pub async fn status(&self) -> Result<NodeStatus, JoinError> {
        let holdings = self.pod_resources.holdings().await;
        let observed = self.clone();
        tokio::task::spawn_blocking(move || observed.build(holdings)).await
    }

    pub(crate) fn build(&self, holdings: Result<Vec<Holding>, PodResourcesError>) -> NodeStatus {
        let inventory = self.inventory.borrow().clone();
        let claim_holders = holdings.as_ref().ok().cloned().unwrap_or_default();
        let mut status = NodeStatus::build(
            &inventory,
            &self.resource,
            self.front_end.registered(),
            holdings,
            &self.isolation,
        );
        status.api_server_error = self.api.as_ref().and_then(ApiHealth::unreachable);
        if let FrontEnd::Dra {
            registration,
            slice,
            claims,
        } = &self.front_end
        {
            let shares = claims
                .shares()
                .into_iter()
                .map(|s| ClaimShare {
                    namespace: s.claim.namespace,
                    name: s.claim.name,
                    uid: s.claim.uid,
                    gpu_uuid: s.gpu_uuid,
                    cap_mib: s.cap_mib,
                    dir: s.dir,
                })
                .collect();
            status.add_claims(&inventory, shares, &claim_holders, &self.isolation);
            let slice = slice.borrow().clone();
            status.dra = Some(DraStatus {
                driver: self.resource.clone(),
                registration: match &*registration.borrow() {
                    Registration::Waiting => "waiting for kubelet".to_owned(),
                    Registration::Registered => "registered with kubelet".to_owned(),
                    Registration::Refused(reason) => format!("REFUSED by kubelet: {reason}"),
                },
                slice: Some(slice.name).filter(|n| !n.is_empty() && slice.generation > 0),
                slice_devices: slice.devices,
                consumable_capacity: slice.consumable_capacity,
                slice_error: slice.last_error,
            });
        }
        if let Some(unmanaged) = &self.unmanaged {
            let unmanaged = unmanaged.lock_unpoisoned();
            for gpu in &mut status.gpus {
                gpu.unmanaged_mib = Some(unmanaged.get(&gpu.uuid).map_or(0, |b| b / MIB));
            }
        }
        status
    }
}
