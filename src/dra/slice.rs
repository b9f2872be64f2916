//! The node's ResourceSlice: one device per healthy GPU, its memory offered as
//! consumable capacity, published and kept current against the API server.
//!
//! [`build`] is the pure part (what the slice says); [`run`] keeps the API
//! server's copy equal to it: at start, after every inventory (health)
//! change, and whenever someone else deletes or changes it (kubelet deletes
//! a node's slices at every start). It reads every write's answer back,
//! because an API server without `DRAConsumableCapacity` silently drops the
//! fields that make a GPU shareable.

use crate::error_text::{chain, one_line};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use serde::Serialize;
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::cluster::backoff::{backed_off, relisting};
use crate::cluster::client::describe_watch;
use crate::node::gpu::{Gpu, NodeFacts};
use crate::node::inventory::Inventory;
use crate::node::quantity;
use crate::node::units::MemoryUnit;

/// The capacity each device offers: its memory.
pub const MEMORY: &str = "memory";

/// The first wait after a failed publish; doubles up to [`BACKOFF_MAX`].
const BACKOFF_MIN: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(60);

/// One publishing pass (list, delete strays, write) may take this long; a
/// hung API call must not stall later health changes for ever.
const PASS_BOUND: Duration = Duration::from_secs(30);

/// A write that loses a race (409) is redone at once this many times.
const CONFLICT_RETRIES: usize = 3;

/// The longest name the API server accepts for a ResourceSlice (a DNS
/// subdomain).
const MAX_NAME: usize = 253;

/// The longest string attribute value the API server accepts, in bytes
/// (Go's `len`).
const MAX_STRING_ATTRIBUTE: usize = 64;

/// The longest prefix of `s` of at most `max` bytes that ends on a
/// character's boundary.
fn cut_to_bytes(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// What the publisher last did, for `/status` and metrics. It lives in a
/// `tokio::sync::watch` channel: [`run`] holds the sender, and readers
/// `borrow()` the latest value or wait for changes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceStatus {
    /// The slice's name (set at start, before the first write).
    pub name: String,
    /// `spec.pool.generation` of the slice as stored; 0 before the first.
    pub generation: i64,
    /// Devices (healthy GPUs) in the slice as stored.
    pub devices: usize,
    /// Whether the API server keeps `allowMultipleAllocations` and
    /// `requestPolicy` (`DRAConsumableCapacity`); `None` until a write with
    /// at least one device has told.
    pub consumable_capacity: Option<bool>,
    /// Whether the stored slice says what the node has now.
    pub in_sync: bool,
    /// Why the last pass failed; `None` once one succeeds.
    pub last_error: Option<String>,
}

/// The slice's name: node and driver, a valid DNS subdomain (node names and
/// driver names are DNS subdomains; a pair too long for one is cut and
/// suffixed with a hash of the whole, so it stays unique).
pub fn slice_name(node: &str, driver: &str) -> String {
    // What a DNS subdomain cannot hold becomes '-' (a node name given on the
    // command line is not checked), which also makes every byte one char,
    // so the cut below cannot split one.
    let full: String = format!("{node}-{driver}")
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '-' | '.') => c,
            _ => '-',
        })
        .collect();
    if full.len() <= MAX_NAME {
        return full;
    }
    let hash = fnv1a(&full);
    // A cut label must not end in '-' or '.'.
    let cut = full[..MAX_NAME - 9].trim_end_matches(['-', '.']);
    format!("{cut}-{hash:08x}")
}

fn fnv1a(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5, |hash: u32, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    })
}

/// A GPU's device name in the slice (a DNS label): `gpu-<NVML index>`, what
/// claims' allocation results name.
pub fn device_name(gpu: &Gpu) -> String {
    format!("gpu-{}", gpu.index)
}

/// The node's ResourceSlice: one device per healthy GPU, in pool `node`
/// (one slice), owned by the Node (`node_uid`) so it goes with it.
///
/// Unhealthy GPUs are withdrawn (left out), not tainted: device taints need
/// the `DRADeviceTaints` feature gate, which a cluster may lack (the server
/// would drop them silently, leaving a sick GPU allocatable). GPUs smaller
/// than one unit are left out too: their `validRange` would be empty.
pub fn build(
    node: &str,
    node_uid: &str,
    driver: &str,
    inventory: &Inventory,
    facts: &NodeFacts,
    generation: i64,
) -> ResourceSlice {
    let devices = inventory
        .gpus()
        .iter()
        .filter(|g| g.gpu.healthy && g.units > 0)
        .map(|g| device(&g.gpu, g.units, inventory.unit(), facts))
        .collect();
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node, driver)),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Node".into(),
                name: node.into(),
                uid: node_uid.into(),
                controller: Some(true),
                block_owner_deletion: None,
            }]),
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        },
    }
}

fn device(gpu: &Gpu, units: u32, unit: MemoryUnit, facts: &NodeFacts) -> Device {
    let suffix = match unit {
        MemoryUnit::GiB => "Gi",
        MemoryUnit::MiB => "Mi",
    };
    // Claims get whole units, as the device plugin gives them: step is one
    // unit, and max and default (a claim that names no amount gets the
    // whole GPU) are the GPU's whole units, so both are multiples of step
    // and at most value, as the API requires (15079 MiB in GiB: 14Gi).
    let step = Quantity(format!("1{suffix}"));
    let whole = Quantity(format!("{units}{suffix}"));
    let capacity = DeviceCapacity {
        value: Quantity(format!("{}Mi", gpu.memory_mib)),
        request_policy: Some(CapacityRequestPolicy {
            default: Some(whole.clone()),
            valid_range: Some(CapacityRequestPolicyRange {
                min: step.clone(),
                max: Some(whole),
                step: Some(step),
            }),
            valid_values: None,
        }),
    };
    // The API server refuses a string attribute over 64 bytes, and with it
    // the whole slice; a long product name (a fake GPU file takes any) is
    // cut instead, at a character's boundary.
    let string = |s: &str| DeviceAttribute {
        string: Some(cut_to_bytes(s, MAX_STRING_ATTRIBUTE).to_owned()),
        ..DeviceAttribute::default()
    };
    let version = |major: u32, minor: u32| DeviceAttribute {
        version: Some(format!("{major}.{minor}.0")),
        ..DeviceAttribute::default()
    };
    let mut attributes = BTreeMap::from([
        ("type".to_owned(), string("gpu")),
        ("uuid".to_owned(), string(&gpu.uuid)),
        ("productName".to_owned(), string(&gpu.name)),
        (
            "index".to_owned(),
            DeviceAttribute {
                int: Some(i64::from(gpu.index)),
                ..DeviceAttribute::default()
            },
        ),
    ]);
    if let Some(driver) = &facts.driver_version {
        // A `version` attribute must be semver 2.0, which the API server
        // checks; NVIDIA's "580.65.06" is not (a leading zero), so such a
        // version is published as a string rather than rewritten or
        // refused. Selectors comparing versions can use
        // cudaDriverVersion, which is always semver.
        let attribute = if is_semver(driver) && driver.len() <= MAX_STRING_ATTRIBUTE {
            DeviceAttribute {
                version: Some(driver.clone()),
                ..DeviceAttribute::default()
            }
        } else {
            string(driver)
        };
        attributes.insert("driverVersion".into(), attribute);
    }
    if let Some((major, minor)) = facts.cuda_driver_version {
        attributes.insert("cudaDriverVersion".into(), version(major, minor));
    }
    if let Some(&(major, minor)) = facts.compute_capability.get(&gpu.uuid) {
        attributes.insert("cudaComputeCapability".into(), version(major, minor));
    }
    Device {
        name: device_name(gpu),
        allow_multiple_allocations: Some(true),
        attributes: Some(attributes),
        capacity: Some(BTreeMap::from([(MEMORY.to_owned(), capacity)])),
        ..Device::default()
    }
}

/// Semantic Versioning 2.0.0: `MAJOR.MINOR.PATCH`, numbers without leading
/// zeros, optional `-pre.release` (numeric parts without leading zeros) and
/// `+build`.
fn is_semver(text: &str) -> bool {
    let ident =
        |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let number = |s: &str| {
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'))
    };
    let (rest, build) = match text.split_once('+') {
        Some((rest, build)) => (rest, Some(build)),
        None => (text, None),
    };
    if build.is_some_and(|b| !b.split('.').all(ident)) {
        return false;
    }
    let (core, pre) = match rest.split_once('-') {
        Some((core, pre)) => (core, Some(pre)),
        None => (rest, None),
    };
    let pre_ok = pre.is_none_or(|pre| {
        pre.split('.')
            .all(|part| ident(part) && (!part.bytes().all(|b| b.is_ascii_digit()) || number(part)))
    });
    let parts: Vec<&str> = core.split('.').collect();
    pre_ok && parts.len() == 3 && parts.iter().all(|p| number(p))
}

/// Publishes the node's slice and keeps it current until `stop`; see the
/// module header. `status` gets every outcome.
///
/// At stop the slice is left in place: kubelet deletes a driver's slices 30 s
/// after the driver goes away, and a quick restart (an upgrade, a crash)
/// that found its slice gone would make the scheduler see the node's GPUs
/// vanish and come back, and fail claims in between.
pub async fn run(
    client: Client,
    node: String,
    driver: String,
    mut inventory: watch::Receiver<Arc<Inventory>>,
    facts: NodeFacts,
    status: watch::Sender<SliceStatus>,
    stop: CancellationToken,
) {
    let mut publisher = Publisher::new(client, node, driver, facts);
    let name = publisher.name.clone();
    status.send_modify(|s| s.name = name);
    let config = watcher::Config::default().fields(&publisher.selector());
    let events = backed_off(relisting(publisher.slices.clone(), config));
    let mut events = std::pin::pin!(events);
    let mut dirty = true;
    let mut retry_at: Option<Instant> = None;
    let mut backoff = BACKOFF_MIN;
    let mut failing = Reported::default();
    let mut watch_failing = Reported::default();
    loop {
        if dirty && retry_at.is_none_or(|at| Instant::now() >= at) {
            let inv = inventory.borrow_and_update().clone();
            let outcome = tokio::select! {
                () = stop.cancelled() => return,
                outcome = tokio::time::timeout(PASS_BOUND, publisher.reconcile(&inv)) => {
                    outcome.unwrap_or_else(|_| Err(Failure::timeout()))
                }
            };
            match outcome {
                Ok(stored) => {
                    dirty = false;
                    retry_at = None;
                    backoff = BACKOFF_MIN;
                    if failing.clear() {
                        info!(slice = %publisher.name, "ResourceSlice published again");
                    }
                    status.send_if_modified(|s| {
                        let new = SliceStatus {
                            name: publisher.name.clone(),
                            generation: stored.generation,
                            devices: stored.devices,
                            consumable_capacity: publisher.consumable,
                            in_sync: true,
                            last_error: None,
                        };
                        let changed = *s != new;
                        *s = new;
                        changed
                    });
                }
                Err(failure) => {
                    retry_at = Some(Instant::now() + backoff);
                    if failing.first(failure.kind()) {
                        warn!(
                            slice = %publisher.name, failure = %chain(&failure), retry_in = ?backoff,
                            "cannot publish the ResourceSlice; retrying (repeats of this error \
                             are logged at debug)"
                        );
                    } else {
                        debug!(
                            slice = %publisher.name, failure = %chain(&failure), retry_in = ?backoff,
                            "cannot publish the ResourceSlice"
                        );
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    let message = one_line(&failure);
                    status.send_modify(|s| {
                        s.in_sync = false;
                        s.consumable_capacity = publisher.consumable;
                        s.last_error = Some(message);
                    });
                }
            }
        }
        let retry = async {
            match retry_at {
                Some(at) if dirty => tokio::time::sleep_until(at).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            () = stop.cancelled() => return,
            changed = inventory.changed() => {
                // The inventory's owner is gone: the daemon is stopping.
                if changed.is_err() {
                    return;
                }
                dirty = true;
            }
            Some((event, wait)) = events.next() => {
                match event {
                    // Init only says a list is about to be tried.
                    Ok(Event::Init) => {}
                    Ok(event) => {
                        watch_failing.clear();
                        if publisher.needs_look(&event) {
                            dirty = true;
                        }
                    }
                    // The watcher relists and rewatches itself (a 410
                    // included) when polled again, after the wait; a relist
                    // ends in InitDone.
                    Err(err) => {
                        let kind = FailureKind { step: Step::Watch, class: watch_class(&err) };
                        let retry_in = wait.unwrap_or_default();
                        if watch_failing.first(kind) {
                            warn!(err = %describe_watch(&err), ?retry_in, "watching this node's ResourceSlices; retrying");
                        } else {
                            debug!(err = %describe_watch(&err), ?retry_in, "watching this node's ResourceSlices");
                        }
                    }
                }
            },
            () = retry => {}
        }
    }
}

/// What a successful pass left stored.
struct Stored {
    generation: i64,
    devices: usize,
}

struct Publisher {
    slices: Api<ResourceSlice>,
    nodes: Api<Node>,
    node: String,
    driver: String,
    name: String,
    facts: NodeFacts,
    /// The Node's UID as last read; read again before every write, since a
    /// re-registered Node has a new one and a slice owned by the old UID
    /// would be garbage-collected.
    node_uid: Option<String>,
    /// The highest pool generation written or seen.
    generation: i64,
    /// The last write: what was sent and what the server stored, both
    /// [`normalized`]. The stored form counts as in sync with the sent one,
    /// so fields the server drops (or rewrites) do not cause a write loop.
    accepted: Option<(Value, Value)>,
    /// The resourceVersion of that answer, to tell our own write's watch
    /// event from someone else's.
    written_version: Option<String>,
    consumable: Option<bool>,
    /// Whether the gate-off error has been logged.
    told_gate_off: bool,
}

impl Publisher {
    fn new(client: Client, node: String, driver: String, facts: NodeFacts) -> Publisher {
        Publisher {
            slices: Api::all(client.clone()),
            nodes: Api::all(client),
            name: slice_name(&node, &driver),
            node,
            driver,
            facts,
            node_uid: None,
            generation: 0,
            accepted: None,
            written_version: None,
            consumable: None,
            told_gate_off: false,
        }
    }

    /// This node's slices of this driver (what kubelet deletes, too).
    fn selector(&self) -> String {
        format!("spec.nodeName={},spec.driver={}", self.node, self.driver)
    }

    /// Whether a watch event may leave the stored state other than wanted.
    fn needs_look(&self, event: &watcher::Event<ResourceSlice>) -> bool {
        match event {
            watcher::Event::Apply(slice) => {
                let echo = slice.metadata.name.as_deref() == Some(self.name.as_str())
                    && slice.metadata.resource_version.is_some()
                    && slice.metadata.resource_version == self.written_version;
                !echo
            }
            watcher::Event::Delete(_) | watcher::Event::InitDone => true,
            watcher::Event::Init | watcher::Event::InitApply(_) => false,
        }
    }

    async fn node_uid(&mut self, fresh: bool) -> Result<String, Failure> {
        if let (false, Some(uid)) = (fresh, &self.node_uid) {
            return Ok(uid.clone());
        }
        let node = self
            .nodes
            .get(&self.node)
            .await
            .map_err(|e| Failure::api(Step::ReadNode, &e))?;
        let uid = node.metadata.uid.ok_or_else(|| Failure {
            step: Step::ReadNode,
            class: "no uid".into(),
            message: format!("Node {} has no metadata.uid", self.node),
        })?;
        self.node_uid = Some(uid.clone());
        Ok(uid)
    }

    /// Makes the stored slices match `inv`, retrying lost races at once.
    async fn reconcile(&mut self, inv: &Inventory) -> Result<Stored, Failure> {
        let mut attempt = 0;
        loop {
            match self.pass(inv).await {
                Err(failure) if failure.is_conflict() && attempt + 1 < CONFLICT_RETRIES => {
                    debug!(
                        slice = %self.name, failure = %chain(&failure),
                        "lost a race writing the ResourceSlice; reading it again"
                    );
                    attempt += 1;
                }
                outcome => return outcome,
            }
        }
    }

    async fn pass(&mut self, inv: &Inventory) -> Result<Stored, Failure> {
        let listed = self
            .slices
            .list(&ListParams::default().fields(&self.selector()))
            .await
            .map_err(|e| Failure::api(Step::List, &e))?;
        let seen = listed
            .items
            .iter()
            .map(|s| s.spec.pool.generation)
            .max()
            .unwrap_or(0);
        self.generation = self.generation.max(seen);
        let mut ours = None;
        for slice in listed.items {
            if slice.metadata.name.as_deref() == Some(self.name.as_str()) {
                ours = Some(slice);
            } else {
                self.delete_stray(&slice).await?;
            }
        }

        let uid = self.node_uid(false).await?;
        let wanted = normalized(&build(&self.node, &uid, &self.driver, inv, &self.facts, 0));
        if let Some(stored) = &ours {
            let now = normalized(stored);
            let accepted = self
                .accepted
                .as_ref()
                .is_some_and(|(sent, answer)| *sent == wanted && *answer == now);
            if now == wanted || accepted {
                return Ok(Stored {
                    generation: stored.spec.pool.generation,
                    devices: device_count(stored),
                });
            }
        }

        let uid = self.node_uid(true).await?;
        let generation = self.generation + 1;
        let mut slice = build(&self.node, &uid, &self.driver, inv, &self.facts, generation);
        let answer = match &ours {
            Some(stored) => {
                slice.metadata.resource_version = stored.metadata.resource_version.clone();
                self.slices
                    .replace(&self.name, &PostParams::default(), &slice)
                    .await
                    .map_err(|e| Failure::api(Step::Replace, &e))?
            }
            None => self
                .slices
                .create(&PostParams::default(), &slice)
                .await
                .map_err(|e| Failure::api(Step::Create, &e))?,
        };
        self.generation = self.generation.max(answer.spec.pool.generation);
        self.written_version = answer.metadata.resource_version.clone();
        self.accepted = Some((normalized(&slice), normalized(&answer)));
        self.note_consumable_capacity(&slice, &answer);
        info!(
            slice = %self.name,
            generation = answer.spec.pool.generation,
            devices = device_count(&answer),
            "published the ResourceSlice"
        );
        Ok(Stored {
            generation: answer.spec.pool.generation,
            devices: device_count(&answer),
        })
    }

    /// Deletes a slice of our driver on our node that is not ours (an older
    /// naming, or a leftover): two slices would split the pool.
    async fn delete_stray(&self, slice: &ResourceSlice) -> Result<(), Failure> {
        let Some(name) = slice.metadata.name.as_deref() else {
            return Ok(());
        };
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: slice.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.slices.delete(name, &params).await {
            Ok(_) => {
                info!(
                    slice = name, kept = %self.name,
                    "deleted another ResourceSlice of this driver on this node"
                );
                Ok(())
            }
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(err) => Err(Failure::api(Step::DeleteStray, &err)),
        }
    }

    /// Reads the server's answer for the fields that need
    /// `DRAConsumableCapacity`, and says so, once, when they were dropped.
    /// No periodic re-check: turning the gate on needs a kubelet restart,
    /// which deletes the node's slices, so the next write (a create, with
    /// the fields) tells.
    fn note_consumable_capacity(&mut self, sent: &ResourceSlice, answer: &ResourceSlice) {
        let Some(kept) = keeps_consumable_capacity(sent, answer) else {
            return;
        };
        match (self.consumable, kept) {
            (_, false) if !self.told_gate_off => {
                self.told_gate_off = true;
                error!(
                    slice = %self.name,
                    "the API server dropped allowMultipleAllocations and the memory requestPolicy \
                     from this node's ResourceSlice: it runs without the DRAConsumableCapacity \
                     feature gate. Each GPU can then be allocated to one ResourceClaim only, \
                     whole, instead of being shared by memory. Enable DRAConsumableCapacity on \
                     kube-apiserver, kube-scheduler and kubelet (beta and on by default from \
                     Kubernetes 1.36, alpha in 1.34 and 1.35), then restart this driver if \
                     kubelet did not restart"
                );
            }
            (Some(false), true) => {
                info!(
                    slice = %self.name,
                    "the API server now keeps consumable capacity: GPUs are shared by memory"
                );
                self.told_gate_off = false;
            }
            _ => {}
        }
        self.consumable = Some(kept);
    }
}

/// Whether `answer` kept the consumable-capacity fields `sent` had; `None`
/// when `sent` had none to keep (no devices).
fn keeps_consumable_capacity(sent: &ResourceSlice, answer: &ResourceSlice) -> Option<bool> {
    let sent = sent.spec.devices.as_deref().unwrap_or_default();
    if !sent.iter().any(|d| d.allow_multiple_allocations.is_some()) {
        return None;
    }
    let answer = answer.spec.devices.as_deref().unwrap_or_default();
    if answer.is_empty() {
        return None;
    }
    Some(answer.iter().all(|d| {
        d.allow_multiple_allocations.is_some()
            && d.capacity
                .as_ref()
                .and_then(|c| c.get(MEMORY))
                .is_some_and(|c| c.request_policy.is_some())
    }))
}

fn device_count(slice: &ResourceSlice) -> usize {
    slice.spec.devices.as_ref().map_or(0, Vec::len)
}

/// What is compared between the wanted and the stored slice: the spec
/// without the pool generation (which changes with every write), and the
/// owner references; capacity quantities as bytes (the server returns them
/// canonical: `16384Mi` comes back as `16Gi`), and empty or null fields
/// dropped (the server omits them).
fn normalized(slice: &ResourceSlice) -> Value {
    let mut spec = serde_json::to_value(&slice.spec).unwrap_or(Value::Null);
    if let Some(pool) = spec.get_mut("pool").and_then(Value::as_object_mut) {
        pool.remove("generation");
    }
    if let Some(devices) = spec.get_mut("devices").and_then(Value::as_array_mut) {
        for capacity in devices
            .iter_mut()
            .filter_map(|d| d.get_mut("capacity"))
            .filter_map(Value::as_object_mut)
        {
            for cap in capacity.values_mut() {
                for pointer in [
                    "/value",
                    "/requestPolicy/default",
                    "/requestPolicy/validRange/min",
                    "/requestPolicy/validRange/max",
                    "/requestPolicy/validRange/step",
                ] {
                    if let Some(q) = cap.pointer_mut(pointer) {
                        as_bytes(q);
                    }
                }
                if let Some(values) = cap
                    .pointer_mut("/requestPolicy/validValues")
                    .and_then(Value::as_array_mut)
                {
                    values.iter_mut().for_each(as_bytes);
                }
            }
        }
    }
    let owners = serde_json::to_value(&slice.metadata.owner_references).unwrap_or(Value::Null);
    let mut both = serde_json::json!({"spec": spec, "ownerReferences": owners});
    prune(&mut both);
    both
}

/// A quantity string as its value in bytes; left as it is if it does not
/// parse (then it compares as text).
fn as_bytes(q: &mut Value) {
    if let Some(bytes) = q.as_str().and_then(quantity::bytes) {
        *q = Value::String(bytes.to_string());
    }
}

/// Removes nulls, empty arrays and empty objects, as Go's `omitempty` does
/// on the way back.
fn prune(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.values_mut().for_each(prune);
            map.retain(|_, v| !is_empty(v));
        }
        Value::Array(items) => items.iter_mut().for_each(prune),
        _ => {}
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.is_empty(),
        _ => false,
    }
}

/// Where a pass failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    List,
    ReadNode,
    DeleteStray,
    Create,
    Replace,
    Timeout,
    Watch,
}

impl Step {
    fn doing(self) -> &'static str {
        match self {
            Step::List => "listing this node's ResourceSlices",
            Step::ReadNode => "reading the Node (its UID owns the slice)",
            Step::DeleteStray => "deleting another ResourceSlice of this driver on this node",
            Step::Create => "creating the ResourceSlice",
            Step::Replace => "replacing the ResourceSlice",
            Step::Timeout => "publishing the ResourceSlice",
            Step::Watch => "watching this node's ResourceSlices",
        }
    }
}

/// A kind of failure: logged at warn the first time in a row, at debug
/// after, so a server down for an hour does not fill the log.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FailureKind {
    step: Step,
    /// The HTTP status and reason, or the class of a failure without one.
    class: String,
}

/// Why a pass failed: logged, and shown in [`SliceStatus::last_error`].
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", step.doing())]
struct Failure {
    step: Step,
    class: String,
    message: String,
}

impl Failure {
    fn api(step: Step, err: &kube::Error) -> Failure {
        let class = match err {
            kube::Error::Api(status) => format!("{} {}", status.code, status.reason),
            _ => "no answer".to_owned(),
        };
        Failure {
            step,
            class,
            message: one_line(err),
        }
    }

    fn timeout() -> Failure {
        Failure {
            step: Step::Timeout,
            class: "timeout".into(),
            message: format!("the API server did not answer within {PASS_BOUND:?}"),
        }
    }

    fn kind(&self) -> FailureKind {
        FailureKind {
            step: self.step,
            class: self.class.clone(),
        }
    }

    fn is_conflict(&self) -> bool {
        self.class.starts_with("409 ")
    }
}

fn watch_class(err: &watcher::Error) -> String {
    match err {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s)) => {
            format!("{} {}", s.code, s.reason)
        }
        watcher::Error::WatchError(s) => format!("{} {}", s.code, s.reason),
        _ => "no answer".into(),
    }
}

/// The last kind of failure logged.
#[derive(Default)]
struct Reported(Option<FailureKind>);

impl Reported {
    /// Whether `kind` differs from the last one (and so is to be logged).
    fn first(&mut self, kind: FailureKind) -> bool {
        let first = self.0.as_ref() != Some(&kind);
        self.0 = Some(kind);
        first
    }

    /// Forgets the last failure; whether there was one.
    fn clear(&mut self) -> bool {
        self.0.take().is_some()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;
    use crate::node::fake::FakeGpus;
    use gpumem_testkit::fake_apiserver::{FakeApiServer, Kind};

    const NODE: &str = "gpu-node-1";
    const NODE_UID: &str = "3f1b7c2e-8d4a-4e6b-9c1d-2a5e7f9b0c43";
    const DRIVER: &str = "gpumem.io";
    const WAIT: Duration = Duration::from_secs(20);

    fn t4() -> Vec<Gpu> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpus/t4.toml");
        FakeGpus::from_file(&path).unwrap().gpus()
    }

    fn gpu(index: u32, memory_mib: u64) -> Gpu {
        Gpu {
            index,
            uuid: format!("GPU-00000000-0000-4000-8000-00000000000{index}"),
            name: "Tesla V100-SXM2-16GB".into(),
            memory_mib,
            healthy: true,
        }
    }

    fn t4_facts() -> NodeFacts {
        NodeFacts {
            driver_version: Some("580.65.06".into()),
            cuda_driver_version: Some((13, 0)),
            compute_capability: [(
                "GPU-6b1c2d3e-0000-4000-8000-000000000400".to_owned(),
                (7, 5),
            )]
            .into(),
        }
    }

    fn memory(slice: &ResourceSlice, device: usize) -> &DeviceCapacity {
        let devices = slice.spec.devices.as_ref().unwrap();
        &devices[device].capacity.as_ref().unwrap()[MEMORY]
    }

    #[test]
    fn t4_slice_matches_the_golden_file() {
        let inv = Inventory::new(t4(), MemoryUnit::GiB).unwrap();
        let slice = build(NODE, NODE_UID, DRIVER, &inv, &t4_facts(), 1);
        let golden_path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dra/slice-t4.json");
        let golden: Value =
            serde_json::from_str(&std::fs::read_to_string(golden_path).unwrap()).unwrap();
        assert_eq!(serde_json::to_value(&slice).unwrap(), golden);
        // And it reads back as a ResourceSlice (field names and shapes).
        let parsed: ResourceSlice = serde_json::from_value(golden).unwrap();
        assert_eq!(parsed, slice);
    }

    #[test]
    fn mib_unit_offers_every_mib() {
        let inv = Inventory::new(t4(), MemoryUnit::MiB).unwrap();
        let slice = build(NODE, NODE_UID, DRIVER, &inv, &NodeFacts::default(), 1);
        let memory = memory(&slice, 0);
        assert_eq!(memory.value.0, "15079Mi");
        let policy = memory.request_policy.as_ref().unwrap();
        assert_eq!(policy.default.as_ref().unwrap().0, "15079Mi");
        let range = policy.valid_range.as_ref().unwrap();
        assert_eq!(range.min.0, "1Mi");
        assert_eq!(range.step.as_ref().unwrap().0, "1Mi");
        assert_eq!(range.max.as_ref().unwrap().0, "15079Mi");
        // Without facts, only what the GPU itself says.
        let devices = slice.spec.devices.unwrap();
        let names: Vec<&String> = devices[0].attributes.as_ref().unwrap().keys().collect();
        assert_eq!(names, ["index", "productName", "type", "uuid"]);
    }

    #[test]
    fn a_long_product_name_is_cut_to_64_bytes_not_64_characters() {
        let mut named = gpu(0, 16160);
        // 'Ä' takes two bytes: 40 of them are 80 bytes in 40 characters.
        named.name = format!("Tesla {}", "Ä".repeat(40));
        let inv = Inventory::new(vec![named], MemoryUnit::GiB).unwrap();
        let slice = build(NODE, NODE_UID, DRIVER, &inv, &NodeFacts::default(), 1);
        let devices = slice.spec.devices.unwrap();
        let attributes = devices[0].attributes.as_ref().unwrap();
        let name = attributes["productName"].string.as_deref().unwrap();
        // "Tesla " and 29 whole 'Ä's: 64 bytes would split the 30th.
        assert_eq!(name, format!("Tesla {}", "Ä".repeat(29)));
        assert_eq!(name.len(), 64);
    }

    #[test]
    fn unhealthy_gpus_are_withdrawn_and_an_empty_slice_remains() {
        let mut sick = gpu(1, 16160);
        sick.healthy = false;
        let inv = Inventory::new(vec![gpu(0, 16160), sick], MemoryUnit::GiB).unwrap();
        let slice = build(NODE, NODE_UID, DRIVER, &inv, &NodeFacts::default(), 3);
        let devices = slice.spec.devices.as_ref().unwrap();
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].name, "gpu-0");
        assert_eq!(memory(&slice, 0).value.0, "16160Mi");
        assert_eq!(slice.spec.pool.generation, 3);

        let all_sick = inv.with_health(&gpu(0, 0).uuid, false).unwrap();
        let slice = build(NODE, NODE_UID, DRIVER, &all_sick, &NodeFacts::default(), 4);
        // Still published: an empty pool says the driver runs and has nothing.
        assert_eq!(slice.spec.devices, Some(vec![]));
    }

    #[test]
    fn driver_version_is_a_version_only_when_semver() {
        for good in ["550.54.15", "1.2.3-rc.1+build.5", "0.0.0", "1.0.0-alpha-1"] {
            assert!(is_semver(good), "{good}");
        }
        for bad in [
            "580.65.06",
            "1.2",
            "01.2.3",
            "1.2.3-01",
            "1.2.3+",
            "1..3",
            "",
            "v1.2.3",
        ] {
            assert!(!is_semver(bad), "{bad}");
        }
        let inv = Inventory::new(t4(), MemoryUnit::GiB).unwrap();
        let facts = NodeFacts {
            driver_version: Some("550.54.15".into()),
            ..NodeFacts::default()
        };
        let slice = build(NODE, NODE_UID, DRIVER, &inv, &facts, 1);
        let attributes = slice.spec.devices.unwrap()[0].attributes.clone().unwrap();
        assert_eq!(
            attributes["driverVersion"].version.as_deref(),
            Some("550.54.15")
        );
    }

    #[test]
    fn names_are_dns_subdomains() {
        assert_eq!(slice_name(NODE, DRIVER), "gpu-node-1-gpumem.io");
        assert_eq!(device_name(&gpu(3, 1024)), "gpu-3");
        let long_node = format!("{}.example.com", "n".repeat(240));
        let a = slice_name(&long_node, DRIVER);
        let b = slice_name(&long_node, "other.example.com");
        assert!(a.len() <= MAX_NAME && b.len() <= MAX_NAME);
        assert_eq!(slice_name("Node_1", DRIVER), "node-1-gpumem.io");
        assert!(slice_name(&"ü".repeat(200), DRIVER).len() <= MAX_NAME);
        assert_ne!(a, b);
        assert!(a
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'.'));
        assert!(a
            .split('.')
            .all(|label| !label.starts_with('-') && !label.ends_with('-') && !label.is_empty()));
    }

    #[test]
    fn comparison_is_by_value_and_ignores_the_generation() {
        let inv = Inventory::new(vec![gpu(0, 16384)], MemoryUnit::MiB).unwrap();
        let ours = build(NODE, NODE_UID, DRIVER, &inv, &NodeFacts::default(), 1);
        let mut stored = serde_json::to_value(&ours).unwrap();
        let capacity = stored
            .pointer_mut("/spec/devices/0/capacity/memory")
            .unwrap();
        capacity["value"] = json!("16Gi");
        capacity["requestPolicy"]["default"] = json!("16Gi");
        stored["spec"]["pool"]["generation"] = json!(9);
        let stored: ResourceSlice = serde_json::from_value(stored).unwrap();
        assert_eq!(normalized(&ours), normalized(&stored));
        let other = build(NODE, "another-uid", DRIVER, &inv, &NodeFacts::default(), 1);
        assert_ne!(normalized(&ours), normalized(&other));
    }

    fn client(api: &FakeApiServer) -> Client {
        Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap()
    }

    /// `run` against the fake API server, with the node registered.
    struct Harness {
        api: FakeApiServer,
        inventory: watch::Sender<Arc<Inventory>>,
        status: watch::Receiver<SliceStatus>,
        stop: CancellationToken,
        node_uid: String,
    }

    impl Harness {
        async fn start(
            gpus: Vec<Gpu>,
            gate_off: bool,
            before: impl FnOnce(&FakeApiServer),
        ) -> Harness {
            let api = FakeApiServer::start().await.unwrap();
            api.drop_consumable_capacity(gate_off);
            let node = api.put(json!({"kind": "Node", "metadata": {"name": NODE}}));
            let node_uid = node["metadata"]["uid"].as_str().unwrap().to_owned();
            before(&api);
            let stop = CancellationToken::new();
            let (inventory, status, _) = spawn_run(&api, gpus, &stop);
            Harness {
                api,
                inventory,
                status,
                stop,
                node_uid,
            }
        }

        async fn until(
            &mut self,
            what: &str,
            done: impl FnMut(&SliceStatus) -> bool,
        ) -> SliceStatus {
            let outcome = tokio::time::timeout(WAIT, self.status.wait_for(done))
                .await
                .map(|r| r.map(|status| status.clone()));
            match outcome {
                Ok(Ok(status)) => status,
                _ => panic!("{what}: status is {:?}", *self.status.borrow()),
            }
        }

        fn stored(&self) -> Option<ResourceSlice> {
            let name = slice_name(NODE, DRIVER);
            let object = self.api.get(Kind::ResourceSlice, "", &name)?;
            Some(serde_json::from_value(object).unwrap())
        }

        fn set_health(&self, index: usize, healthy: bool) {
            let inv = self.inventory.borrow().clone();
            let uuid = inv.gpus()[index].gpu.uuid.clone();
            if let Some(changed) = inv.with_health(&uuid, healthy) {
                self.inventory.send_replace(Arc::new(changed));
            }
        }

        fn writes(&self) -> usize {
            self.api
                .requests()
                .iter()
                .filter(|r| {
                    (r.starts_with("POST ") || r.starts_with("PUT "))
                        && r.contains("/resourceslices")
                })
                .count()
        }
    }

    impl Drop for Harness {
        fn drop(&mut self) {
            self.stop.cancel();
        }
    }

    /// Spawns `run` for NODE against `api` with `gpus` as the inventory,
    /// until `stop`: the inventory's sender, the status, and the task.
    fn spawn_run(
        api: &FakeApiServer,
        gpus: Vec<Gpu>,
        stop: &CancellationToken,
    ) -> (
        watch::Sender<Arc<Inventory>>,
        watch::Receiver<SliceStatus>,
        tokio::task::JoinHandle<()>,
    ) {
        let inv = Arc::new(Inventory::new(gpus, MemoryUnit::GiB).unwrap());
        let (inventory, inventory_rx) = watch::channel(inv);
        let (status_tx, status) = watch::channel(SliceStatus::default());
        let task = tokio::spawn(run(
            client(api),
            NODE.into(),
            DRIVER.into(),
            inventory_rx,
            NodeFacts::default(),
            status_tx,
            stop.clone(),
        ));
        (inventory, status, task)
    }

    #[tokio::test]
    async fn published_then_republished_after_kubelet_deletes_it_or_someone_edits_it() {
        let mut h = Harness::start(vec![gpu(0, 16160), gpu(1, 16384)], false, |_| {}).await;
        let status = h.until("published", |s| s.in_sync).await;
        assert_eq!(status.name, "gpu-node-1-gpumem.io");
        assert_eq!((status.generation, status.devices), (1, 2));
        assert_eq!(status.consumable_capacity, Some(true));
        let stored = h.stored().unwrap();
        let owner = &stored.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Node", h.node_uid.as_str())
        );
        // The server returned 16384Mi as 16Gi; that is no reason to write again.
        assert_eq!(memory(&stored, 1).value.0, "16Gi");
        assert_eq!(h.writes(), 1);

        // kubelet's start: every slice of the node goes.
        assert_eq!(h.api.delete_node_slices(NODE, None).len(), 1);
        let status = h
            .until("republished", |s| s.generation == 2 && s.in_sync)
            .await;
        assert_eq!(status.devices, 2);
        assert_eq!(device_count(&h.stored().unwrap()), 2);

        // Someone empties it: put back.
        let mut edited = h.api.get(Kind::ResourceSlice, "", &status.name).unwrap();
        edited["spec"]["devices"] = json!([]);
        h.api.put(edited);
        let status = h
            .until("restored", |s| s.generation == 3 && s.in_sync)
            .await;
        assert_eq!(status.devices, 2);
        assert_eq!(device_count(&h.stored().unwrap()), 2);
    }

    #[tokio::test]
    async fn a_health_change_withdraws_the_gpu_in_a_new_generation() {
        let mut h = Harness::start(vec![gpu(0, 16160), gpu(1, 16160)], false, |_| {}).await;
        h.until("published", |s| s.in_sync && s.devices == 2).await;
        h.set_health(1, false);
        let status = h.until("updated", |s| s.devices == 1).await;
        assert_eq!(status.generation, 2);
        let stored = h.stored().unwrap();
        let devices = stored.spec.devices.unwrap();
        assert_eq!(devices.len(), 1);
        assert_eq!(devices[0].name, "gpu-0");
        assert_eq!(stored.spec.pool.generation, 2);

        h.set_health(1, true);
        let status = h.until("restored", |s| s.devices == 2).await;
        assert_eq!(status.generation, 3);
    }

    #[tokio::test]
    async fn an_api_server_without_consumable_capacity_is_detected_and_stays_reported() {
        let mut h = Harness::start(vec![gpu(0, 16160), gpu(1, 16160)], true, |_| {}).await;
        let status = h.until("published", |s| s.in_sync).await;
        assert_eq!(status.consumable_capacity, Some(false));
        let stored = h.stored().unwrap();
        let devices = stored.spec.devices.as_ref().unwrap();
        assert!(devices
            .iter()
            .all(|d| d.allow_multiple_allocations.is_none()));
        assert!(memory(&stored, 0).request_policy.is_none());

        // An update of a slice created without the fields drops them again.
        h.set_health(1, false);
        let status = h.until("updated", |s| s.devices == 1).await;
        assert_eq!(status.consumable_capacity, Some(false));
        assert_eq!(status.generation, 2);
        assert!(status.in_sync);
        assert_eq!(h.writes(), 2);
    }

    #[tokio::test]
    async fn other_slices_of_the_driver_on_the_node_are_removed() {
        let slice = |name: &str, node: &str, driver: &str, generation: i64| {
            json!({
                "kind": "ResourceSlice",
                "metadata": {"name": name},
                "spec": {
                    "driver": driver,
                    "nodeName": node,
                    "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                    "devices": [],
                },
            })
        };
        let mut h = Harness::start(vec![gpu(0, 16160)], false, |api| {
            api.put(slice("00000-gpumem.io-gpu-node-1-x7k2p", NODE, DRIVER, 7));
            api.put(slice("other-driver", NODE, "other.example.com", 1));
            api.put(slice("other-node", "gpu-node-2", DRIVER, 1));
        })
        .await;
        let status = h.until("published", |s| s.in_sync).await;
        // Above the stray's generation, so the scheduler never mixes them.
        assert_eq!(status.generation, 8);
        let names: Vec<String> = h
            .api
            .list(Kind::ResourceSlice)
            .iter()
            .map(|s| s["metadata"]["name"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            names,
            ["gpu-node-1-gpumem.io", "other-driver", "other-node"]
        );
    }

    #[tokio::test]
    async fn a_pass_in_sync_writes_nothing() {
        for gate_off in [false, true] {
            let api = FakeApiServer::start().await.unwrap();
            api.drop_consumable_capacity(gate_off);
            api.put(json!({"kind": "Node", "metadata": {"name": NODE}}));
            let inv = Inventory::new(vec![gpu(0, 16384), gpu(1, 15079)], MemoryUnit::MiB).unwrap();
            let mut publisher = Publisher::new(
                client(&api),
                NODE.into(),
                DRIVER.into(),
                NodeFacts::default(),
            );
            let first = publisher.reconcile(&inv).await.unwrap();
            assert_eq!((first.generation, first.devices), (1, 2));
            assert_eq!(publisher.consumable, Some(!gate_off));
            let writes = |api: &FakeApiServer| {
                api.requests()
                    .iter()
                    .filter(|r| r.starts_with("POST ") || r.starts_with("PUT "))
                    .count()
            };
            assert_eq!(writes(&api), 1);
            let again = publisher.reconcile(&inv).await.unwrap();
            assert_eq!(again.generation, 1, "gate off: {gate_off}");
            assert_eq!(writes(&api), 1, "gate off: {gate_off}");

            // A fresh publisher (a restart) adopts the slice as it is.
            let mut restarted = Publisher::new(
                client(&api),
                NODE.into(),
                DRIVER.into(),
                NodeFacts::default(),
            );
            restarted.reconcile(&inv).await.unwrap();
            // With the gate off, the restart cannot tell a dropped field from
            // an edit: it writes once and learns the gate from the answer.
            assert_eq!(writes(&api), if gate_off { 2 } else { 1 });
            assert_eq!(restarted.consumable, gate_off.then_some(false));
        }
    }

    #[tokio::test]
    async fn a_missing_node_is_an_error_in_the_status() {
        let api = FakeApiServer::start().await.unwrap();
        let stop = CancellationToken::new();
        let (_inventory, mut status, task) = spawn_run(&api, vec![gpu(0, 16160)], &stop);
        let failed = tokio::time::timeout(WAIT, status.wait_for(|s| s.last_error.is_some()))
            .await
            .unwrap()
            .unwrap()
            .clone();
        let error = failed.last_error.unwrap();
        assert!(error.starts_with("reading the Node"), "{error}");
        assert!(!failed.in_sync);
        // Then the node registers and the slice follows (after the backoff).
        api.put(json!({"kind": "Node", "metadata": {"name": NODE}}));
        tokio::time::timeout(
            WAIT,
            status.wait_for(|s| s.in_sync && s.last_error.is_none()),
        )
        .await
        .unwrap()
        .unwrap();
        stop.cancel();
        task.await.unwrap();
        // Left in place at stop.
        assert!(api
            .get(Kind::ResourceSlice, "", &slice_name(NODE, DRIVER))
            .is_some());
    }
}
