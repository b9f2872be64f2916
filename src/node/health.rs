//! GPU health: XID events, memory repairs awaiting a reset and GPUs NVML
//! cannot reach turn a GPU's units Unhealthy in ListAndWatch, until it
//! recovers or, for what only a reset cures, until it is reset.

use crate::error_text::{chain, one_line};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::node::inventory::Inventory;

/// XIDs caused by applications, not hardware: the GPU stays usable. The
/// NVIDIA device plugin skips the first five for the same reason; 109
/// (context switch timeout) is most often a hung kernel, too.
pub const APPLICATION_XIDS: [u64; 6] = [13, 31, 43, 45, 68, 109];

/// `--ignore-xids`: XIDs separated by commas and/or spaces. Empty is a
/// list too (every XID counts), so an operator can turn the default off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XidList(pub Vec<u64>);

impl Default for XidList {
    fn default() -> Self {
        XidList(APPLICATION_XIDS.to_vec())
    }
}

/// A token of an `--ignore-xids` value that is not an XID. clap names the
/// flag and the whole value around this message.
#[derive(Debug, thiserror::Error)]
#[error(
    "{token:?} is not an XID; give XID numbers separated by commas or spaces (e.g. 13,31,43), \
     or an empty value for none"
)]
pub struct BadXidList {
    pub token: String,
}

impl std::str::FromStr for XidList {
    type Err = BadXidList;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        value
            .split(|c: char| c == ',' || c.is_whitespace())
            .filter(|token| !token.is_empty())
            .map(|token| {
                token.parse().map_err(|_| BadXidList {
                    token: token.to_owned(),
                })
            })
            .collect::<Result<_, _>>()
            .map(XidList)
    }
}

/// Comma-separated: the form `--help` shows as the default, and one that
/// parses back unchanged, quoted or not.
impl std::fmt::Display for XidList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let each: Vec<String> = self.0.iter().map(u64::to_string).collect();
        f.write_str(&each.join(","))
    }
}

/// How often health is looked at: a change reaches kubelet within a second.
const TICK: Duration = Duration::from_millis(250);

/// A GPU's health changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthChange {
    pub uuid: String,
    pub healthy: bool,
    pub reason: String,
}

/// The seam where health signals enter. `poll` blocks for at most
/// `timeout` and returns whatever changed meanwhile.
pub trait HealthWatch: Send + 'static {
    fn poll(&mut self, timeout: Duration) -> Vec<HealthChange>;
}

/// XIDs after which the GPU must be reset before it is trusted again. In
/// NVIDIA's Xid catalog their immediate action is RESET_GPU, RESTART_BM or
/// RESTART_VM, or a workflow that can end in a reset (48's, and the NVLink
/// ones for 74 and 144–150). docs/OPERATIONS.md has the table and its source.
pub const RESET_XIDS: [u64; 27] = [
    46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 144, 145, 146, 147, 148, 149,
    150, 151, 155, 156, 158, 160, 162,
];

/// Checks in a row that must fail with an error that proves nothing by
/// itself (NVML's `Unknown`, say) before the GPU counts as Unhealthy: about
/// 0.75 s of a GPU that does not answer, and never one stray failure.
pub const FAILED_CHECKS_LIMIT: u32 = 3;

/// What an XID does to its GPU's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XidAction {
    /// Listed in `--ignore-xids` (an application's error): nothing.
    Ignore,
    /// Unhealthy until the GPU has been quiet for `--health-recovery-secs`.
    Recover,
    /// Unhealthy until the GPU is reset ([`RESET_XIDS`]).
    Reset,
}

/// The operator's `--ignore-xids` first, then the Xid catalog.
pub fn xid_action(xid: u64, ignored: &HashSet<u64>) -> XidAction {
    if ignored.contains(&xid) {
        XidAction::Ignore
    } else if RESET_XIDS.contains(&xid) {
        XidAction::Reset
    } else {
        XidAction::Recover
    }
}

/// Health from NVML, looked at every tick:
///
/// - critical XID events, minus ignored ones: a reset-requiring XID keeps the
///   GPU Unhealthy for the life of this process (resetting a GPU needs every
///   NVML client stopped, this one included, so the restarted plugin is what
///   sees the reset GPU); any other XID until it has been quiet for `recovery`;
/// - a pending row remap or one that failed (A100 and newer), or pending page
///   retirement (older GPUs): Unhealthy while NVML reports it. Both pendings
///   clear with a reset; a remap failure never does (the GPU is due for
///   replacement);
/// - NVML saying the GPU is lost (fallen off the bus) or needs a reset:
///   Unhealthy while it says so;
/// - any other NVML failure proves nothing alone: it is logged and counted,
///   and [`FAILED_CHECKS_LIMIT`] of them in a row make the GPU Unhealthy.
///
/// A GPU Unhealthy for anything but a reset-requiring XID turns Healthy once
/// it answers NVML with nothing pending and has been quiet for `recovery`.
pub struct NvmlHealth {
    nvml: &'static nvml_wrapper::Nvml,
    events: Option<nvml_wrapper::EventSet<'static>>,
    uuids: Vec<String>,
    ignored: HashSet<u64>,
    recovery: Duration,
    gpus: HashMap<String, GpuState>,
}

#[derive(Debug, Default)]
struct GpuState {
    /// Set while Unhealthy.
    sick: Option<Sick>,
    /// Checks in a row that failed with an error proving nothing alone.
    failed_checks: u32,
    /// Such failures since the start, for the logs.
    failures: u64,
}

#[derive(Debug)]
struct Sick {
    /// When a problem last showed: recovery counts from here.
    last: Instant,
    /// Set when only a reset cures it: the XID that said so.
    reset: Option<String>,
    /// The latest problem, logged when it changes.
    reason: String,
}

/// What one look at a GPU found.
enum Finding {
    /// It answers NVML and nothing waits for a reset.
    Fine,
    /// Unhealthy while NVML keeps reporting this.
    Problem(String),
    /// NVML failed in a way that proves nothing by itself.
    Failed(nvml_wrapper::error::NvmlError),
}

impl NvmlHealth {
    /// Registers for critical XID events on every GPU that takes them.
    /// `nvml` lives as long as the process: the event set borrows it.
    pub fn new(
        nvml: &'static nvml_wrapper::Nvml,
        ignored: &[u64],
        recovery: Duration,
    ) -> Result<Self, crate::node::gpu::GpuError> {
        let nvml_err =
            |e: nvml_wrapper::error::NvmlError| crate::node::gpu::GpuError::Nvml(one_line(&e));
        let count = nvml.device_count().map_err(nvml_err)?;
        // A GPU that cannot be read is not advertised (see `NvmlHardware`):
        // the others are watched.
        let (indices, uuids): (Vec<u32>, Vec<String>) = (0..count)
            .filter_map(|index| {
                let uuid = nvml.device_by_index(index).and_then(|d| d.uuid());
                match uuid {
                    Ok(uuid) => Some((index, uuid)),
                    Err(err) => {
                        warn!(gpu = index, err = %chain(&err), "cannot read this GPU: its health is not watched");
                        None
                    }
                }
            })
            .unzip();
        Ok(NvmlHealth {
            nvml,
            events: xid_events(nvml, &indices),
            gpus: uuids
                .iter()
                .map(|u| (u.clone(), GpuState::default()))
                .collect(),
            uuids,
            ignored: ignored.iter().copied().collect(),
            recovery,
        })
    }

    /// Marks a GPU Unhealthy (again), for good if `reset`.
    fn mark(&mut self, uuid: &str, reason: String, reset: bool, changes: &mut Vec<HealthChange>) {
        let state = self.gpus.entry(uuid.to_owned()).or_default();
        match &mut state.sick {
            Some(sick) => {
                sick.last = Instant::now();
                if reset && sick.reset.is_none() {
                    sick.reset = Some(reason.clone());
                }
                if sick.reason != reason {
                    warn!(uuid, %reason, until_reset = sick.reset.is_some(), "GPU still unhealthy, now for another reason");
                    sick.reason = reason;
                }
            }
            None => {
                state.sick = Some(Sick {
                    last: Instant::now(),
                    reset: reset.then(|| reason.clone()),
                    reason: reason.clone(),
                });
                changes.push(HealthChange {
                    uuid: uuid.to_owned(),
                    healthy: false,
                    reason,
                });
            }
        }
    }

    /// Takes XID events for up to `timeout`. NVML returns at the first event,
    /// so this waits again for the rest: GPUs are looked at once a tick
    /// however many events arrive.
    fn take_events(&mut self, timeout: Duration, changes: &mut Vec<HealthChange>) {
        use nvml_wrapper::enums::event::XidError;
        use nvml_wrapper::error::NvmlError;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let Some(set) = &self.events else {
                std::thread::sleep(left);
                return;
            };
            let event = match set.wait(u32::try_from(left.as_millis()).unwrap_or(u32::MAX)) {
                Ok(event) => event,
                Err(NvmlError::Timeout) => return,
                Err(e) => {
                    warn!(error = %chain(&e), "waiting for NVML events failed");
                    std::thread::sleep(left);
                    return;
                }
            };
            let xid = match event.event_data {
                Some(XidError::Value(x)) => Some(x),
                _ => None,
            };
            let (action, reason) = match xid {
                Some(x) => match xid_action(x, &self.ignored) {
                    XidAction::Ignore => {
                        debug!(xid = x, "XID ignored (--ignore-xids)");
                        continue;
                    }
                    XidAction::Recover => (XidAction::Recover, format!("critical XID {x}")),
                    XidAction::Reset => (
                        XidAction::Reset,
                        format!(
                            "critical XID {x}: the GPU needs a reset (NVIDIA Xid catalog); \
                             Unhealthy until it is reset and gpumem restarts"
                        ),
                    ),
                },
                None => (XidAction::Recover, "critical XID (unknown)".to_owned()),
            };
            match event.device.uuid() {
                Ok(uuid) => self.mark(&uuid, reason, action == XidAction::Reset, changes),
                // An event we cannot attribute (its GPU may be the one that
                // stopped answering): every GPU is suspect, none for good.
                Err(_) => {
                    for uuid in self.uuids.clone() {
                        self.mark(&uuid, reason.clone(), false, changes);
                    }
                }
            }
        }
    }

    fn examine(&self, uuid: &str) -> Finding {
        use nvml_wrapper::error::NvmlError;
        match probe(self.nvml, uuid) {
            Ok(None) => Finding::Fine,
            Ok(Some(problem)) => Finding::Problem(problem),
            Err(NvmlError::GpuLost) => {
                Finding::Problem("GPU has fallen off the bus (NVML: GPU is lost)".into())
            }
            Err(NvmlError::ResetRequired) => {
                Finding::Problem("NVML says the GPU needs a reset".into())
            }
            Err(error) => Finding::Failed(error),
        }
    }

    /// Looks at one GPU, marking or recovering it.
    fn look_at(&mut self, uuid: &str, changes: &mut Vec<HealthChange>) {
        let finding = self.examine(uuid);
        let recovery = self.recovery;
        let state = self.gpus.entry(uuid.to_owned()).or_default();
        match finding {
            Finding::Problem(problem) => {
                state.failed_checks = 0;
                self.mark(uuid, problem, false, changes);
            }
            Finding::Failed(error) => {
                state.failed_checks += 1;
                state.failures += 1;
                let (in_a_row, failures) = (state.failed_checks, state.failures);
                if in_a_row == 1 {
                    warn!(
                        uuid,
                        error = ?error,
                        detail = %error,
                        failures,
                        limit = FAILED_CHECKS_LIMIT,
                        "NVML could not check the GPU; Unhealthy if this goes on for `limit` checks in a row"
                    );
                }
                if in_a_row >= FAILED_CHECKS_LIMIT {
                    let reason = format!(
                        "NVML failed {FAILED_CHECKS_LIMIT} checks in a row: {error:?} ({error})"
                    );
                    self.mark(uuid, reason, false, changes);
                } else if let Some(sick) = &mut state.sick {
                    // Not a recovery while it fails.
                    sick.last = Instant::now();
                }
            }
            Finding::Fine => {
                if state.failed_checks > 0 {
                    info!(
                        uuid,
                        failed_checks = state.failed_checks,
                        "NVML answers again"
                    );
                    state.failed_checks = 0;
                }
                let recovered = state
                    .sick
                    .as_ref()
                    .is_some_and(|s| s.reset.is_none() && s.last.elapsed() >= recovery);
                if recovered {
                    state.sick = None;
                    changes.push(HealthChange {
                        uuid: uuid.to_owned(),
                        healthy: true,
                        reason: format!("answering NVML and quiet for {recovery:?}"),
                    });
                }
            }
        }
    }
}

/// An event set holding critical XIDs of every GPU that takes them; the
/// others are only polled. nvml-wrapper frees the set whenever a
/// registration fails, so a GPU that refuses one is left out and the set
/// built again: one GPU must not cost every other its XIDs.
fn xid_events(
    nvml: &'static nvml_wrapper::Nvml,
    indices: &[u32],
) -> Option<nvml_wrapper::EventSet<'static>> {
    use nvml_wrapper::bitmasks::event::EventTypes;
    let xids = EventTypes::CRITICAL_XID_ERROR;
    let mut gpus: Vec<u32> = indices
        .iter()
        .copied()
        .filter(|&index| {
            let supported = nvml
                .device_by_index(index)
                .and_then(|d| d.supported_event_types());
            match supported {
                Ok(types) if !types.contains(xids) => {
                    warn!(
                        gpu = index,
                        "the GPU reports no XID events; only polling this GPU"
                    );
                    false
                }
                // Older drivers may not answer; registering will tell.
                _ => true,
            }
        })
        .collect();
    'build: loop {
        if gpus.is_empty() {
            return None;
        }
        let mut set = match nvml.create_event_set() {
            Ok(set) => set,
            Err(error) => {
                warn!(error = %chain(&error), "no NVML event set; XID events unavailable, only polling every GPU");
                return None;
            }
        };
        for (at, &index) in gpus.iter().enumerate() {
            let registered = nvml
                .device_by_index(index)
                .map_err(Into::into)
                .and_then(|d| d.register_events(xids, set));
            match registered {
                Ok(kept) => set = kept,
                Err(e) => {
                    warn!(gpu = index, error = %e.error, "XID events unavailable; only polling this GPU");
                    gpus.remove(at);
                    continue 'build;
                }
            }
        }
        info!(gpus = ?gpus, "watching XID events");
        return Some(set);
    }
}

/// One GPU's answer: `Some` problem that keeps it Unhealthy, or an NVML error.
fn probe(
    nvml: &nvml_wrapper::Nvml,
    uuid: &str,
) -> Result<Option<String>, nvml_wrapper::error::NvmlError> {
    let device = nvml.device_by_uuid(uuid)?;
    device.memory_info()?;
    match row_remapper(&device)? {
        Some(RowRemapper { failure: true, .. }) => {
            return Ok(Some(
                "row remapping failed (NVML): the GPU's memory can no longer be repaired".into(),
            ))
        }
        Some(RowRemapper { pending: true, .. }) => {
            return Ok(Some(
                "row remapping pending (NVML): it takes effect at the next GPU reset".into(),
            ))
        }
        Some(_) => return Ok(None),
        None => {}
    }
    // Before Ampere: page retirement instead of row remapping.
    match device.are_pages_pending_retired() {
        Ok(true) => Ok(Some(
            "page retirement pending (NVML): it takes effect at the next GPU reset".into(),
        )),
        Ok(false) => Ok(None),
        Err(e) if unanswered(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// An error from a query this GPU or driver may simply not answer
/// (`NotSupported`, a driver without the symbol or the field): the GPU has
/// answered `memory_info` already, so only errors about the GPU itself count.
fn unanswered(error: &nvml_wrapper::error::NvmlError) -> bool {
    use nvml_wrapper::error::NvmlError;
    !matches!(
        error,
        NvmlError::GpuLost | NvmlError::ResetRequired | NvmlError::Unknown
    )
}

struct RowRemapper {
    pending: bool,
    failure: bool,
}

/// The row remapper's flags, or `None` where a GPU has none to show (before
/// Ampere; MIG with active instances). Read as field values, the flags
/// `nvmlDeviceGetRemappedRows` returns too: nvml-wrapper 0.13 does not wrap
/// that call, and this crate has no `unsafe`.
fn row_remapper(
    device: &nvml_wrapper::Device,
) -> Result<Option<RowRemapper>, nvml_wrapper::error::NvmlError> {
    use nvml_wrapper::enums::device::SampleValue;
    use nvml_wrapper::structs::device::FieldId;
    use nvml_wrapper::sys_exports::field_id::{
        NVML_FI_DEV_REMAPPED_FAILURE, NVML_FI_DEV_REMAPPED_PENDING,
    };
    let fields = [
        FieldId(NVML_FI_DEV_REMAPPED_PENDING),
        FieldId(NVML_FI_DEV_REMAPPED_FAILURE),
    ];
    let samples = match device.field_values_for(&fields) {
        Ok(samples) => samples,
        Err(e) if unanswered(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut flags = [false; 2];
    for (flag, sample) in flags.iter_mut().zip(samples) {
        *flag = match sample.and_then(|s| s.value) {
            Ok(SampleValue::U32(v)) => v != 0,
            Ok(SampleValue::U64(v)) => v != 0,
            Ok(SampleValue::I64(v)) => v != 0,
            Ok(SampleValue::F64(v)) => v != 0.0,
            Err(e) if unanswered(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
    }
    Ok(Some(RowRemapper {
        pending: flags[0],
        failure: flags[1],
    }))
}

impl HealthWatch for NvmlHealth {
    fn poll(&mut self, timeout: Duration) -> Vec<HealthChange> {
        let mut changes = Vec::new();
        self.take_events(timeout, &mut changes);
        for uuid in self.uuids.clone() {
            self.look_at(&uuid, &mut changes);
        }
        changes
    }
}

/// Applies health changes to the advertised inventory until `shutdown`.
/// Runs the blocking watch on its own thread.
pub async fn run(
    mut watch: Box<dyn HealthWatch>,
    inventory: watch::Sender<Arc<Inventory>>,
    shutdown: CancellationToken,
) {
    let stop = shutdown.clone();
    let task = tokio::task::spawn_blocking(move || {
        // Also ends when nobody reads the inventory any more (the daemon is gone).
        while !stop.is_cancelled() && !inventory.is_closed() {
            for change in watch.poll(TICK) {
                inventory.send_if_modified(|inv| match applied(inv, &change) {
                    Some(updated) => {
                        *inv = Arc::new(updated);
                        true
                    }
                    None => false,
                });
            }
        }
    });
    let _ = task.await;
}

/// `inventory` as the watch finds it now, before anything is advertised:
/// a GPU with a remap pending or failed at start must never be offered,
/// not even until the watch's first tick.
pub fn first_look(
    watch: Option<&mut (dyn HealthWatch + 'static)>,
    inventory: Inventory,
) -> Inventory {
    let Some(watch) = watch else {
        return inventory;
    };
    watch
        .poll(Duration::ZERO)
        .iter()
        .fold(inventory, |inv, change| {
            applied(&inv, change).unwrap_or(inv)
        })
}

/// The inventory with `change` applied and logged; `None` if it changes
/// nothing there.
fn applied(inv: &Inventory, change: &HealthChange) -> Option<Inventory> {
    if change.healthy {
        info!(uuid = %change.uuid, reason = %change.reason, "GPU healthy again");
    } else {
        warn!(uuid = %change.uuid, reason = %change.reason, "GPU unhealthy: its units stop receiving pods");
    }
    inv.with_health(&change.uuid, change.healthy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xid_lists_take_commas_spaces_and_nothing() {
        let parse = |s: &str| s.parse::<XidList>().map(|l| l.0);
        let default = XidList::default().to_string();
        assert_eq!(default, "13,31,43,45,68,109");
        assert_eq!(parse(&default).unwrap(), APPLICATION_XIDS);
        // What older --help output showed, and mixtures.
        assert_eq!(parse("13 31 43 45 68 109").unwrap(), APPLICATION_XIDS);
        assert_eq!(parse(" 13, 31,,43\t45 ").unwrap(), [13, 31, 43, 45]);
        assert_eq!(parse("").unwrap(), Vec::<u64>::new());
        assert_eq!(parse(" , ").unwrap(), Vec::<u64>::new());
        let err = parse("13,x1,43").unwrap_err().to_string();
        assert!(err.contains("\"x1\"") && err.contains("commas"), "{err}");
        assert!(parse("-13").is_err());
    }

    #[test]
    fn xids_take_the_operators_list_then_the_catalog() {
        let defaults: HashSet<u64> = APPLICATION_XIDS.into_iter().collect();
        for xid in [
            46, 48, 62, 64, 74, 79, 95, 119, 120, 140, 143, 144, 150, 151, 160,
        ] {
            assert_eq!(xid_action(xid, &defaults), XidAction::Reset, "XID {xid}");
        }
        for xid in APPLICATION_XIDS {
            assert_eq!(xid_action(xid, &defaults), XidAction::Ignore, "XID {xid}");
        }
        // RESTART_APP, IGNORE and the rest of the catalog: recover when quiet.
        for xid in [8, 32, 63, 92, 94, 154, 999] {
            assert_eq!(xid_action(xid, &defaults), XidAction::Recover, "XID {xid}");
        }
        // 109 is RESET_GPU in the catalog but ignored by default, as the
        // NVIDIA device plugin does; an empty --ignore-xids brings it back.
        assert_eq!(xid_action(109, &HashSet::new()), XidAction::Reset);
        assert_eq!(xid_action(48, &[48].into()), XidAction::Ignore);
    }
}
