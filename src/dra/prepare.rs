//! Prepares DRA claims on this node: reads each claim kubelet names, takes
//! its cap on each GPU from what the scheduler allocated, and gives every
//! container that references it the same cap through one accounting
//! directory and one CDI spec. The checkpoint records what was made, so
//! Unprepare and a restarted driver never depend on the API server.

use crate::error_text::{chain, one_line};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use kube::Api;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::cluster::client::ADMISSION_CALL_BOUND;
use crate::dra::checkpoint::{Checkpoint, ClaimEntry, DeviceEntry, State};
use crate::dra::claims::{ClaimRef, Claims, Prepared, PreparedDevice, Unprepared};
use crate::dra::slice::{self, MEMORY};
use crate::isolation::accounting::{self, Cap, Durability};
use crate::isolation::cdi::{self, SpecDir};
use crate::isolation::containers::{ContainerDir, ContainerName};
use crate::isolation::inject::{self, ClaimGpu, Isolation, ShimConfig};
use crate::isolation::reconcile::attribution::PodGrants;
use crate::node::inventory::Inventory;
use crate::node::quantity;
use crate::sync::LockExt;

#[derive(Debug, Clone)]
pub struct DriverConfig {
    /// The driver's name: results of other drivers are theirs to prepare.
    pub driver: String,
    /// This node's name, which is also the pool of our slice.
    pub node: String,
    pub isolation: Isolation,
    /// Where the claims' CDI specs go (kind `gpumem.io/claim`).
    pub specs: SpecDir,
    /// Where NVIDIA's CDI spec for the node's GPUs may be (`nvidia-ctk cdi
    /// generate` writes /etc/cdi/nvidia.yaml; its DaemonSet /var/run/cdi).
    pub nvidia_spec_dirs: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error("claim UID {0:?} is not a UID")]
    BadUid(String),
    #[error("ResourceClaim {namespace}/{name} does not exist (deleted before its pod started?)")]
    NotFound { namespace: String, name: String },
    #[error("cannot read ResourceClaim {namespace}/{name} from the API server")]
    Api {
        namespace: String,
        name: String,
        source: kube::Error,
    },
    #[error(
        "the API server did not answer within {secs} s for ResourceClaim {namespace}/{name}; \
         kubelet will ask again"
    )]
    Timeout {
        namespace: String,
        name: String,
        secs: u64,
    },
    #[error(
        "ResourceClaim {namespace}/{name} now has UID {found}, not {asked}: it was deleted and \
         created again, and the pod refers to the old one; delete the pod so it is created with \
         the new claim"
    )]
    UidChanged {
        namespace: String,
        name: String,
        asked: String,
        found: String,
    },
    #[error(
        "ResourceClaim {namespace}/{name} is not allocated: the scheduler allocates a claim \
         before it binds the pod"
    )]
    NotAllocated { namespace: String, name: String },
    #[error(
        "ResourceClaim {claim} was allocated device {device} of pool {pool}, which is not this \
         node's pool {node}"
    )]
    OtherPool {
        claim: String,
        device: String,
        pool: String,
        node: String,
    },
    #[error(
        "ResourceClaim {claim} was allocated device {device}, which this node does not have \
         (its GPUs: {known}); was a GPU removed since the claim was allocated?"
    )]
    UnknownDevice {
        claim: String,
        device: String,
        known: String,
    },
    #[error(
        "ResourceClaim {claim} consumes {value:?} of {MEMORY} on device {device}, which is not a \
         quantity of at least 1Mi"
    )]
    BadCapacity {
        claim: String,
        device: String,
        value: String,
    },
    #[error(
        "ResourceClaim {claim} consumes {cap_mib} MiB on device {device}, more than its {gpu_mib} MiB"
    )]
    OverGpu {
        claim: String,
        device: String,
        cap_mib: u64,
        gpu_mib: u64,
    },
    #[error(transparent)]
    Inject(#[from] inject::InjectError),
    #[error(transparent)]
    Accounting(#[from] crate::isolation::accounting::AccountingError),
    #[error(transparent)]
    Cdi(#[from] cdi::CdiError),
    #[error(transparent)]
    Checkpoint(#[from] crate::dra::checkpoint::CheckpointError),
    #[error("preparing the claim stopped unexpectedly: {0}")]
    Internal(String),
    #[error("cannot remove the CDI spec {path}")]
    RemoveSpec {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One claim's share of one GPU, as status and metrics show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Share {
    pub claim: ClaimRef,
    pub gpu_uuid: String,
    pub cap_mib: u64,
    /// The claim's accounting directory (name).
    pub dir: ContainerName,
}

/// The claims prepared on this node. Cheap to clone.
#[derive(Clone)]
pub struct PreparedClaims {
    inner: Arc<Inner>,
}

struct Inner {
    config: DriverConfig,
    client: kube::Client,
    inventory: watch::Receiver<Arc<Inventory>>,
    /// Taken to record a claim started and completed, and around the
    /// decisions that depend on its entry; the files are made without it.
    checkpoint: Mutex<Checkpoint>,
    /// Per claim UID, the prepares making its files now (two pods starting
    /// with one claim). Changed and read only with `checkpoint` held.
    in_flight: Mutex<HashMap<String, usize>>,
}

impl PreparedClaims {
    /// Over `checkpoint` as opened at start. Roll-back of its interrupted
    /// and stale entries is the caller's (see `recover`).
    pub fn new(
        config: DriverConfig,
        client: kube::Client,
        inventory: watch::Receiver<Arc<Inventory>>,
        checkpoint: Checkpoint,
    ) -> Self {
        PreparedClaims {
            inner: Arc::new(Inner {
                config,
                client,
                inventory,
                checkpoint: Mutex::new(checkpoint),
                in_flight: Mutex::default(),
            }),
        }
    }

    fn checkpoint(&self) -> MutexGuard<'_, Checkpoint> {
        // A panic while holding it left the file as it was written last.
        self.inner.checkpoint.lock_unpoisoned()
    }

    /// Take with the checkpoint's lock held.
    fn in_flight(&self) -> MutexGuard<'_, HashMap<String, usize>> {
        self.inner.in_flight.lock_unpoisoned()
    }

    /// Removes what `entries` (interrupted prepares, or those of another
    /// boot) created and forgets them. Their accounting directories follow
    /// the clean-up rules: they go once no process uses them.
    pub fn recover(&self, entries: Vec<(String, ClaimEntry)>, why: &str) {
        for (uid, entry) in entries {
            info!(claim = %format!("{}/{}", entry.namespace, entry.name), %uid, why, "rolling back a prepared claim");
            if let Err(err) = self.forget_entry(&mut self.checkpoint(), &uid, &entry) {
                warn!(%uid, err = %chain(&err), "cannot roll back a prepared claim; trying again at the next start");
            }
        }
    }

    /// Removes the specs of our kind that no prepared claim names and that
    /// were written before `booted`, this boot's start: those of another
    /// boot's claims whose roll-back was cut off (in a spec directory that
    /// survives a reboot, `/etc/cdi`). A spec written since may be a live
    /// claim's whose record was lost (a checkpoint that did not parse or
    /// went missing, at this start or an earlier one of this boot): kubelet
    /// restarts its containers from it, and its Unprepare removes it (see
    /// `forget`). Call it at start, before kubelet can prepare. A claim
    /// whose entry did not read keeps the spec named by its UID.
    pub fn remove_unrecorded_specs(&self, booted: SystemTime) {
        let specs = &self.inner.config.specs;
        let checkpoint = self.checkpoint();
        for name in specs.list() {
            if checkpoint.claims().any(|(_, e)| e.cdi_device == name)
                || checkpoint.unreadable().any(|uid| uid == name)
            {
                continue;
            }
            let written = std::fs::metadata(specs.path(&name)).and_then(|m| m.modified());
            if written.is_ok_and(|at| at >= booted) {
                continue;
            }
            match specs.remove(&name) {
                Ok(()) => {
                    info!(spec = %specs.path(&name).display(), "removed the CDI spec of a claim no longer prepared, written before the node booted")
                }
                Err(err) => {
                    warn!(spec = %specs.path(&name).display(), err = %chain(&err), "cannot remove the CDI spec of a claim no longer prepared")
                }
            }
        }
    }

    /// The directories of prepared claims, and of claims with a spec here
    /// (those whose record was lost, see `remove_unrecorded_specs`: their
    /// pods may still run, and their specs mount these directories): never
    /// removed by clean-up.
    pub fn live_dirs(&self) -> HashSet<ContainerName> {
        let specs = self.inner.config.specs.list();
        let checkpoint = self.checkpoint();
        checkpoint
            .claims()
            .map(|(uid, _)| uid)
            .chain(checkpoint.unreadable())
            .chain(specs.iter().map(String::as_str))
            .filter_map(ContainerName::of_claim)
            .collect()
    }

    /// Every prepared claim's share of each GPU.
    pub fn shares(&self) -> Vec<Share> {
        let checkpoint = self.checkpoint();
        let mut shares = Vec::new();
        for (uid, entry) in checkpoint.claims() {
            let Some(dir) = ContainerName::of_claim(uid) else {
                continue;
            };
            let claim = ClaimRef {
                namespace: entry.namespace.clone(),
                uid: uid.to_owned(),
                name: entry.name.clone(),
            };
            for (gpu_uuid, cap_mib) in caps_by_gpu(&entry.devices) {
                shares.push(Share {
                    claim: claim.clone(),
                    gpu_uuid,
                    cap_mib,
                    dir: dir.clone(),
                });
            }
        }
        shares
    }

    /// The claim whose directory is `dir`, if it is prepared here.
    pub fn claim_of(&self, dir: &ContainerName) -> Option<ClaimRef> {
        let uid = dir.claim_uid()?;
        let checkpoint = self.checkpoint();
        let entry = checkpoint.get(uid)?;
        Some(ClaimRef {
            namespace: entry.namespace.clone(),
            uid: uid.to_owned(),
            name: entry.name.clone(),
        })
    }

    /// The cap of the claim whose directory is `dir` on the GPU `uuid`, in
    /// MiB, from the checkpoint: never from the accounting file, which the
    /// claim's containers can write.
    pub fn granted_mib(&self, dir: &ContainerName, uuid: &str) -> Option<u64> {
        let uid = dir.claim_uid()?;
        let checkpoint = self.checkpoint();
        let entry = checkpoint.get(uid)?;
        caps_by_gpu(&entry.devices).remove(uuid)
    }

    /// The prepared claims of namespace `namespace` named in `names` (those
    /// a pod references) whose record does not name pod `pod`.
    pub fn unrecorded(&self, namespace: &str, names: &[String], pod: &str) -> Vec<ClaimRef> {
        self.checkpoint()
            .claims()
            .filter(|(_, e)| e.state == State::Completed && e.namespace == namespace)
            .filter(|(_, e)| names.contains(&e.name) && !e.pods.iter().any(|p| p == pod))
            .map(|(uid, e)| ClaimRef {
                namespace: e.namespace.clone(),
                uid: uid.to_owned(),
                name: e.name.clone(),
            })
            .collect()
    }

    /// Reads `claim` and records the pods it is reserved for now: kubelet
    /// prepares a claim once, whichever pods come to share it later, and
    /// the scheduler reserves it for each of them before it binds them.
    /// The pods recorded, `None` where the record did not change.
    pub async fn record_reserved(
        &self,
        claim: &ClaimRef,
    ) -> Result<Option<Vec<String>>, PrepareError> {
        let object = self.read(claim).await?;
        let pods = reserved_pods(&object);
        if pods.is_empty() {
            return Ok(None);
        }
        let this = self.clone();
        let uid = claim.uid.clone();
        tokio::task::spawn_blocking(move || {
            let changed = this.checkpoint().set_pods(&uid, pods.clone())?;
            Ok(changed.then_some(pods))
        })
        .await
        .unwrap_or_else(|err| Err(PrepareError::Internal(one_line(&err))))
    }

    /// Each pod's claim directories by pod UID, as the checkpoint recorded
    /// the pods each claim is reserved for; a claim recorded without them
    /// (prepared by a version that did not record them), or whose entry
    /// does not read, is any pod's.
    pub fn pod_dirs(&self) -> PodGrants {
        let mut grants = PodGrants::default();
        let checkpoint = self.checkpoint();
        let unread = checkpoint.unreadable().filter_map(ContainerName::of_claim);
        grants
            .any_pod
            .extend(unread.map(|name| name.as_str().to_owned()));
        for (_, entry) in checkpoint.claims() {
            if entry.pods.is_empty() {
                grants.any_pod.insert(entry.dir.clone());
            }
            for pod in &entry.pods {
                grants
                    .by_pod
                    .entry(pod.clone())
                    .or_default()
                    .push(entry.dir.clone());
            }
        }
        grants
    }

    async fn prepare_one(&self, claim: &ClaimRef) -> Result<Vec<PreparedDevice>, PrepareError> {
        let key = ClaimKey::new(&claim.uid)?;
        if let Some(done) = self.completed(&claim.uid) {
            // Kubelet asks again after its own restart, and for each pod
            // sharing the claim: the same answer, with the spec back if it
            // went (a reboot empties /var/run).
            let this = self.clone();
            return tokio::task::spawn_blocking(move || this.restore_spec(&key, &done))
                .await
                .unwrap_or_else(|err| Err(PrepareError::Internal(one_line(&err))));
        }
        let object = self.read(claim).await?;
        let inv = self.inner.inventory.borrow().clone();
        let this = self.clone();
        let claim = claim.clone();
        // The plan reads NVIDIA's specs, the commit writes files: both off
        // the async workers.
        tokio::task::spawn_blocking(move || {
            let devices = this.plan(&claim, &object, &inv)?;
            this.commit(&claim, key, devices, reserved_pods(&object), &inv)
        })
        .await
        .unwrap_or_else(|err| Err(PrepareError::Internal(one_line(&err))))
    }

    fn completed(&self, uid: &str) -> Option<ClaimEntry> {
        self.checkpoint()
            .get(uid)
            .filter(|e| e.state == State::Completed)
            .cloned()
    }

    /// The claim, checked to be the one kubelet means and allocated.
    async fn read(&self, claim: &ClaimRef) -> Result<ResourceClaim, PrepareError> {
        let api: Api<ResourceClaim> = Api::namespaced(self.inner.client.clone(), &claim.namespace);
        let (namespace, name) = (claim.namespace.clone(), claim.name.clone());
        let object =
            match tokio::time::timeout(ADMISSION_CALL_BOUND, api.get_opt(&claim.name)).await {
                Err(_) => {
                    return Err(PrepareError::Timeout {
                        namespace,
                        name,
                        secs: ADMISSION_CALL_BOUND.as_secs(),
                    })
                }
                Ok(Err(source)) => {
                    return Err(PrepareError::Api {
                        namespace,
                        name,
                        source,
                    })
                }
                Ok(Ok(None)) => return Err(PrepareError::NotFound { namespace, name }),
                Ok(Ok(Some(object))) => object,
            };
        let found = object.metadata.uid.clone().unwrap_or_default();
        if found != claim.uid {
            return Err(PrepareError::UidChanged {
                namespace,
                name,
                asked: claim.uid.clone(),
                found,
            });
        }
        Ok(object)
    }

    /// What the scheduler allocated to the claim from our driver, as the
    /// devices to prepare.
    fn plan(
        &self,
        claim: &ClaimRef,
        object: &ResourceClaim,
        inv: &Inventory,
    ) -> Result<Vec<DeviceEntry>, PrepareError> {
        let config = &self.inner.config;
        let results: &[DeviceRequestAllocationResult] = object
            .status
            .as_ref()
            .and_then(|s| s.allocation.as_ref())
            .ok_or_else(|| PrepareError::NotAllocated {
                namespace: claim.namespace.clone(),
                name: claim.name.clone(),
            })?
            .devices
            .as_ref()
            .and_then(|d| d.results.as_deref())
            .unwrap_or_default();
        let label = format!("{}/{}", claim.namespace, claim.name);
        let cdi_id = cdi::qualified_name(&config.specs.kind(), &claim.uid);
        let mut devices = Vec::new();
        for result in results.iter().filter(|r| r.driver == config.driver) {
            if result.pool != config.node {
                return Err(PrepareError::OtherPool {
                    claim: label,
                    device: result.device.clone(),
                    pool: result.pool.clone(),
                    node: config.node.clone(),
                });
            }
            let Some(gpu) = inv
                .gpus()
                .iter()
                .find(|g| slice::device_name(&g.gpu) == result.device)
            else {
                return Err(PrepareError::UnknownDevice {
                    claim: label,
                    device: result.device.clone(),
                    known: inv
                        .gpus()
                        .iter()
                        .map(|g| slice::device_name(&g.gpu))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            };
            // Without consumedCapacity (an API server without
            // DRAConsumableCapacity) the device was allocated whole.
            let cap_mib = match result
                .consumed_capacity
                .as_ref()
                .and_then(|c| c.get(MEMORY))
            {
                None => gpu.gpu.memory_mib,
                Some(value) => quantity::mib(&value.0)
                    .filter(|&mib| mib > 0)
                    .ok_or_else(|| PrepareError::BadCapacity {
                        claim: label.clone(),
                        device: result.device.clone(),
                        value: value.0.clone(),
                    })?,
            };
            if cap_mib > gpu.gpu.memory_mib {
                return Err(PrepareError::OverGpu {
                    claim: label,
                    device: result.device.clone(),
                    cap_mib,
                    gpu_mib: gpu.gpu.memory_mib,
                });
            }
            let mut cdi_device_ids = vec![cdi_id.clone()];
            if let Some(nvidia) = nvidia_cdi_id(&config.nvidia_spec_dirs, &gpu.gpu.uuid) {
                cdi_device_ids.push(nvidia);
            }
            devices.push(DeviceEntry {
                // kubelet matches a container's `request` against the
                // claim's request, not a prioritized list's subrequest
                // (`gpu/small`).
                request_names: vec![base_request(&result.request).to_owned()],
                pool: result.pool.clone(),
                device: result.device.clone(),
                share_id: result.share_id.clone(),
                gpu_uuid: gpu.gpu.uuid.clone(),
                cap_mib,
                cdi_device_ids,
                ..Default::default()
            });
        }
        Ok(devices)
    }

    /// Records the claim as started, makes its directory and spec, and
    /// records it completed: a crash in between is rolled back at start.
    fn commit(
        &self,
        claim: &ClaimRef,
        key: ClaimKey,
        devices: Vec<DeviceEntry>,
        pods: Vec<String>,
        inv: &Inventory,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        let entry = ClaimEntry {
            namespace: claim.namespace.clone(),
            name: claim.name.clone(),
            state: State::Started,
            dir: key.dir.as_str().to_owned(),
            cdi_device: claim.uid.clone(),
            devices,
            pods,
            ..Default::default()
        };
        {
            let mut checkpoint = self.checkpoint();
            if let Some(done) = checkpoint
                .get(&claim.uid)
                .filter(|e| e.state == State::Completed)
            {
                // Prepared by a concurrent call meanwhile.
                return Ok(answer(done));
            }
            checkpoint.start(&claim.uid, entry.clone())?;
            *self.in_flight().entry(claim.uid.clone()).or_default() += 1;
        }
        // The files without the lock: other claims' prepares go on
        // meanwhile. A concurrent prepare of this claim makes the same
        // files (each write is atomic) and records the same devices. A
        // panic is a failure like any other: the count and the entry are
        // settled below, not left to the next start.
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.make_files(&key, &entry, inv)
        }))
        .unwrap_or_else(|_| {
            Err(PrepareError::Internal(
                "making the claim's files panicked".into(),
            ))
        });
        let mut checkpoint = self.checkpoint();
        let others = {
            let mut in_flight = self.in_flight();
            let count = in_flight.entry(claim.uid.clone()).or_default();
            *count = count.saturating_sub(1);
            let others = *count;
            if others == 0 {
                in_flight.remove(&claim.uid);
            }
            others
        };
        let made = made.and_then(|()| Ok(checkpoint.complete(&claim.uid, entry.devices.clone())?));
        if let Err(err) = made {
            if let Some(done) = checkpoint
                .get(&claim.uid)
                .filter(|e| e.state == State::Completed)
            {
                // A concurrent prepare of this claim (two pods starting
                // with it) finished, and kubelet may already have its
                // answer: what it made stays.
                warn!(uid = %claim.uid, err = %chain(&err), "a concurrent prepare of the claim failed after another succeeded");
                return Ok(answer(done));
            }
            if others > 0 {
                // Another prepare of this claim is making the files now:
                // removing them would leave it to complete a claim without
                // its spec. The last one to finish completes or undoes it.
                return Err(err);
            }
            // Nothing half-made stays named: the spec goes, the directory
            // follows the clean-up rules.
            let _ = self.inner.config.specs.remove(&claim.uid);
            if let Err(forget) = checkpoint.remove(&claim.uid) {
                warn!(uid = %claim.uid, err = %chain(&forget), "cannot forget a failed prepare; it is rolled back at the next start");
            }
            return Err(err);
        }
        drop(checkpoint);
        info!(
            claim = %format!("{}/{}", claim.namespace, claim.name),
            uid = %claim.uid,
            caps = ?caps_by_gpu(&entry.devices),
            "prepared"
        );
        Ok(answer(&entry))
    }

    /// The claim's accounting directory (with the shim) and CDI spec.
    fn make_files(
        &self,
        key: &ClaimKey,
        entry: &ClaimEntry,
        inv: &Inventory,
    ) -> Result<(), PrepareError> {
        let dir = self.shim_dir(key)?;
        if let Some((shim, dir)) = &dir {
            let caps: Vec<Cap> = caps_by_gpu(&entry.devices)
                .into_iter()
                .map(|(uuid, cap_mib)| Cap {
                    uuid,
                    cap_mib,
                    context_charge_mib: shim.context_charge_mib,
                })
                .collect();
            if !caps.is_empty() {
                // After a reboot kubelet prepares the claim again.
                accounting::prepare_with(&dir.path, &caps, Durability::Unsynced, shim.state_fs)?;
            }
        }
        self.write_spec_with(key, entry, inv, &claim_gpus(entry, inv), dir.as_ref())?;
        Ok(())
    }

    /// With the shim, the claim's accounting directory, the shim checked
    /// first: a spec never names shim files that are not there.
    fn shim_dir(
        &self,
        key: &ClaimKey,
    ) -> Result<Option<(&ShimConfig, ContainerDir)>, PrepareError> {
        match &self.inner.config.isolation {
            Isolation::Shim(shim) => {
                inject::check_shim(shim)?;
                Ok(Some((shim, shim.containers().get(key.dir.clone()))))
            }
            Isolation::None => Ok(None),
        }
    }

    /// Writes the claim's CDI spec for its GPUs `gpus`; whether it changed.
    fn write_spec(
        &self,
        key: &ClaimKey,
        entry: &ClaimEntry,
        inv: &Inventory,
        gpus: &[ClaimGpu],
    ) -> Result<bool, PrepareError> {
        let dir = self.shim_dir(key)?;
        self.write_spec_with(key, entry, inv, gpus, dir.as_ref())
    }

    /// `write_spec` with the shim's directory found already.
    fn write_spec_with(
        &self,
        key: &ClaimKey,
        entry: &ClaimEntry,
        inv: &Inventory,
        gpus: &[ClaimGpu],
        dir: Option<&(&ShimConfig, ContainerDir)>,
    ) -> Result<bool, PrepareError> {
        let spec = claim_spec(&key.uid, entry, inv, gpus, dir.map(|(s, d)| (*s, d)))?;
        Ok(self.inner.config.specs.write(&spec)?)
    }

    /// Brings prepared claims' specs to what this version makes, at start,
    /// before kubelet can prepare. Kubelet prepares a claim once while its
    /// pods run and restarts their containers from the CDI ID it was given,
    /// so a claim prepared by an older version would keep that version's
    /// spec for as long as it lives (before claims had their own place
    /// under /var/run/gpumem, two in one container hid each other's
    /// directory). Only a spec that mounts the claim's accounting directory
    /// is rewritten, and only with shim isolation on: a claim keeps the
    /// isolation it was prepared with, as a device plugin container keeps
    /// what Allocate gave it. The accounting file, live, stays as it is; a
    /// spec or file that is gone is made again, as a repeated Prepare
    /// would. A claim whose GPU this node no longer lists keeps its spec.
    pub fn refresh_specs(&self) {
        let inv = self.inner.inventory.borrow().clone();
        let prepared: Vec<(String, ClaimEntry)> = self
            .checkpoint()
            .claims()
            .filter(|(_, e)| e.state == State::Completed)
            .map(|(uid, e)| (uid.to_owned(), e.clone()))
            .collect();
        for (uid, entry) in prepared {
            let gpus = claim_gpus(&entry, &inv);
            if gpus.len() != caps_by_gpu(&entry.devices).len() {
                warn!(%uid, "a GPU of this prepared claim is not on the node any more: its CDI spec is left as it is");
                continue;
            }
            let refreshed = ClaimKey::new(&uid).and_then(|key| {
                if self.files_missing(&key) {
                    self.restore_files(&key, &entry, &inv).map(|()| {
                        info!(%uid, "made the missing files of a prepared claim again");
                        false
                    })
                } else if self.mounts_its_dir(&key) {
                    self.write_spec(&key, &entry, &inv, &gpus)
                } else {
                    Ok(false)
                }
            });
            match refreshed {
                Ok(true) => info!(
                    %uid,
                    spec = %self.inner.config.specs.path(&uid).display(),
                    "rewrote the CDI spec of a prepared claim: containers that start from it now get this version's"
                ),
                Ok(false) => {}
                Err(err) => {
                    warn!(%uid, err = %chain(&err), "cannot bring the CDI spec of a prepared claim up to date; it stays as it was")
                }
            }
        }
    }

    /// Whether the claim's spec mounts its accounting directory, with shim
    /// isolation on.
    fn mounts_its_dir(&self, key: &ClaimKey) -> bool {
        let config = &self.inner.config;
        let Isolation::Shim(shim) = &config.isolation else {
            return false;
        };
        let dir = shim
            .containers()
            .get(key.dir.clone())
            .path
            .display()
            .to_string();
        config.specs.read(&key.uid).is_ok_and(|spec| {
            spec.devices
                .iter()
                .flat_map(|d| &d.container_edits.mounts)
                .any(|m| m.host_path == dir)
        })
    }

    /// Makes again what of a prepared claim's files is gone: the
    /// accounting file only where there is none (one that is there is
    /// live, and stays as it is whatever the flags say now), and the spec.
    fn restore_files(
        &self,
        key: &ClaimKey,
        entry: &ClaimEntry,
        inv: &Inventory,
    ) -> Result<(), PrepareError> {
        match &self.inner.config.isolation {
            Isolation::Shim(shim) if !accounting_file_present(shim, key) => {
                self.make_files(key, entry, inv)
            }
            _ => {
                self.write_spec(key, entry, inv, &claim_gpus(entry, inv))?;
                Ok(())
            }
        }
    }

    /// Whether the claim's spec is gone, or the accounting file its spec
    /// mounts (a claim prepared without the shim has none, and keeps none).
    fn files_missing(&self, key: &ClaimKey) -> bool {
        let config = &self.inner.config;
        if !config.specs.path(&key.uid).exists() {
            return true;
        }
        match &config.isolation {
            Isolation::Shim(shim) => {
                !accounting_file_present(shim, key) && self.mounts_its_dir(key)
            }
            Isolation::None => false,
        }
    }

    /// A prepared claim's answer, its files made again where they are
    /// missing (see `restore_files`).
    fn restore_spec(
        &self,
        key: &ClaimKey,
        entry: &ClaimEntry,
    ) -> Result<Vec<PreparedDevice>, PrepareError> {
        if self.files_missing(key) {
            let inv = self.inner.inventory.borrow().clone();
            self.restore_files(key, entry, &inv)?;
            info!(uid = %key.uid, "made the missing files of a prepared claim again");
        }
        Ok(answer(entry))
    }

    /// Removes the claim's spec and record; its directory follows the
    /// clean-up rules.
    fn forget(&self, uid: &str) -> Result<(), PrepareError> {
        let mut checkpoint = self.checkpoint();
        match checkpoint.get(uid).cloned() {
            Some(entry) => self.forget_entry(&mut checkpoint, uid, &entry),
            // Not recorded (a checkpoint lost or moved aside) or not
            // readable: a spec of ours for the claim is named by its UID.
            None if ContainerName::of_claim(uid).is_some() => {
                self.remove_spec(uid)?;
                checkpoint.remove(uid)?;
                Ok(())
            }
            None => Ok(()),
        }
    }

    fn forget_entry(
        &self,
        checkpoint: &mut Checkpoint,
        uid: &str,
        entry: &ClaimEntry,
    ) -> Result<(), PrepareError> {
        self.remove_spec(&entry.cdi_device)?;
        checkpoint.remove(uid)?;
        Ok(())
    }

    /// Removes the CDI spec of device `name`, if there is one.
    fn remove_spec(&self, name: &str) -> Result<(), PrepareError> {
        let specs = &self.inner.config.specs;
        specs
            .remove(name)
            .map_err(|source| PrepareError::RemoveSpec {
                path: specs.path(name),
                source,
            })
    }
}

#[tonic::async_trait]
impl Claims for PreparedClaims {
    async fn prepare(&self, claims: Vec<ClaimRef>) -> Prepared {
        let answers =
            futures_util::future::join_all(claims.iter().map(|c| self.prepare_one(c))).await;
        claims
            .into_iter()
            .zip(answers)
            .map(|(claim, answer)| {
                let answer = answer.map_err(|err| {
                    warn!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, err = %chain(&err), "cannot prepare");
                    one_line(&err)
                });
                (claim.uid, answer)
            })
            .collect()
    }

    async fn unprepare(&self, claims: Vec<ClaimRef>) -> Unprepared {
        let this = self.clone();
        let answers = tokio::task::spawn_blocking(move || {
            claims
                .into_iter()
                .map(|claim| {
                    let done = this.forget(&claim.uid).map_err(|err| one_line(&err));
                    if done.is_ok() {
                        info!(claim = %format!("{}/{}", claim.namespace, claim.name), uid = %claim.uid, "unprepared");
                    }
                    (claim.uid, done)
                })
                .collect::<Unprepared>()
        })
        .await;
        answers.unwrap_or_default()
    }
}

/// The CDI spec of claim `uid`: the edits every container referencing it gets.
fn claim_spec(
    uid: &str,
    entry: &ClaimEntry,
    inv: &Inventory,
    gpus: &[ClaimGpu],
    shim: Option<(&ShimConfig, &ContainerDir)>,
) -> Result<cdi::Spec, PrepareError> {
    // With NVIDIA's CDI device in the answer, the runtime gets the GPU
    // from it, and `void` keeps NVIDIA's legacy hook from adding it
    // again; without, the hook reads the UUIDs.
    let nvidia_cdi = entry.devices.iter().any(|d| {
        d.cdi_device_ids
            .iter()
            .any(|id| id.starts_with(cdi::NVIDIA_GPU_KIND))
    });
    let visible = if nvidia_cdi {
        "void".to_owned()
    } else {
        let uuids: Vec<&str> = gpus
            .iter()
            .map(|g| inv.gpus()[g.gpu].gpu.uuid.as_str())
            .collect();
        if uuids.is_empty() {
            "void".to_owned()
        } else {
            uuids.join(",")
        }
    };
    let edits = inject::claim_edits(inv, gpus, shim, visible);
    Ok(cdi::spec(cdi::CLAIM_CLASS, uid, edits)?)
}

/// A claim's UID and the accounting directory named after it, checked
/// and derived once per call.
struct ClaimKey {
    uid: String,
    dir: ContainerName,
}

impl ClaimKey {
    fn new(uid: &str) -> Result<ClaimKey, PrepareError> {
        let dir =
            ContainerName::of_claim(uid).ok_or_else(|| PrepareError::BadUid(uid.to_owned()))?;
        Ok(ClaimKey {
            uid: uid.to_owned(),
            dir,
        })
    }
}

fn accounting_file_present(shim: &ShimConfig, key: &ClaimKey) -> bool {
    shim.containers()
        .get(key.dir.clone())
        .accounting_file()
        .is_file()
}

/// The node's GPUs a claim has a cap on, with the cap; those the node no
/// longer lists are left out.
fn claim_gpus(entry: &ClaimEntry, inv: &Inventory) -> Vec<ClaimGpu> {
    caps_by_gpu(&entry.devices)
        .into_iter()
        .filter_map(|(uuid, cap_mib)| {
            let gpu = inv.gpus().iter().position(|g| g.gpu.uuid == uuid)?;
            Some(ClaimGpu { gpu, cap_mib })
        })
        .collect()
}

/// The claim's request a result serves: `gpu` of a subrequest `gpu/small`.
fn base_request(request: &str) -> &str {
    request.split_once('/').map_or(request, |(base, _)| base)
}

/// What kubelet is told for a prepared claim.
fn answer(entry: &ClaimEntry) -> Vec<PreparedDevice> {
    entry
        .devices
        .iter()
        .map(|d| PreparedDevice {
            request_names: d.request_names.clone(),
            pool_name: d.pool.clone(),
            device_name: d.device.clone(),
            cdi_device_ids: d.cdi_device_ids.clone(),
            share_id: d.share_id.clone(),
        })
        .collect()
}

/// The claim's cap on each GPU: its shares of one GPU add up.
fn caps_by_gpu(devices: &[DeviceEntry]) -> BTreeMap<String, u64> {
    let mut caps = BTreeMap::new();
    for device in devices {
        *caps.entry(device.gpu_uuid.clone()).or_insert(0u64) += device.cap_mib;
    }
    caps
}

/// NVIDIA's CDI name for the GPU `uuid` (`nvidia.com/gpu=<UUID>`) where a
/// spec of NVIDIA's in `dirs` names it (`nvidia-ctk cdi generate` names
/// each GPU by index and by UUID).
pub fn nvidia_cdi_id(dirs: &[PathBuf], uuid: &str) -> Option<String> {
    let names_gpu = |path: &std::path::Path| -> bool {
        let Ok(text) = std::fs::read_to_string(path) else {
            return false;
        };
        if path.extension().is_some_and(|e| e == "json") {
            let Ok(spec) = serde_json::from_str::<serde_json::Value>(&text) else {
                return false;
            };
            return spec["kind"] == cdi::NVIDIA_GPU_KIND
                && spec["devices"]
                    .as_array()
                    .is_some_and(|d| d.iter().any(|d| d["name"] == uuid));
        }
        // YAML, read as text (no YAML parser for one lookup): the kind, and
        // a device whose name is the UUID.
        let value = |line: &str, key: &str| -> Option<String> {
            let line = line.trim().trim_start_matches("- ");
            let v = line.strip_prefix(key)?.strip_prefix(':')?.trim();
            Some(v.trim_matches(['"', '\'']).to_owned())
        };
        text.lines()
            .any(|l| value(l, "kind").as_deref() == Some(cdi::NVIDIA_GPU_KIND))
            && text
                .lines()
                .any(|l| value(l, "name").as_deref() == Some(uuid))
    };
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        // Our own specs (one per claim) are never NVIDIA's: not read.
        let ours = format!("{}-", cdi::VENDOR);
        let found = entries
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with(&ours))
            .map(|e| e.path())
            .any(|path| {
                path.extension()
                    .is_some_and(|e| e == "json" || e == "yaml" || e == "yml")
                    && names_gpu(&path)
            });
        if found {
            return Some(cdi::qualified_name(cdi::NVIDIA_GPU_KIND, uuid));
        }
    }
    None
}

#[tonic::async_trait]
impl crate::isolation::cleanup::Holders for PreparedClaims {
    async fn live(&self) -> Result<HashSet<ContainerName>, String> {
        Ok(self.live_dirs())
    }

    /// Under the checkpoint lock, which a prepare holds while it records
    /// the claim, before it makes the directory: a claim prepared again
    /// since `live` keeps its directory.
    fn remove_unless_taken(
        &self,
        name: &ContainerName,
        remove: &mut dyn FnMut() -> std::io::Result<()>,
    ) -> Option<std::io::Result<()>> {
        let checkpoint = self.checkpoint();
        let taken = name.claim_uid().is_some_and(|uid| {
            checkpoint.get(uid).is_some() || self.inner.config.specs.path(uid).exists()
        });
        // The removal runs with the lock held.
        (!taken).then(remove)
    }
}

/// The UIDs of the pods `claim` is reserved for. The scheduler reserves it
/// for a pod before kubelet can prepare it for that pod, or run that pod
/// with it once prepared (see `sharing`).
fn reserved_pods(claim: &ResourceClaim) -> Vec<String> {
    let reserved = claim.status.as_ref().and_then(|s| s.reserved_for.as_ref());
    reserved
        .into_iter()
        .flatten()
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .map(|r| r.uid.clone())
        .collect()
}
