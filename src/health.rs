//! GPU health: critical XID events and GPUs falling off the bus turn a GPU's
//! units Unhealthy in ListAndWatch; a recovered GPU turns Healthy again.
//! The fake backend takes health from edits to its file, so CI tests it all.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::gpu::{FakeGpus, GpuSource};
use crate::inventory::Inventory;

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

/// Health from the fake GPU file: edit `healthy = false` in it and the GPU
/// goes Unhealthy; set it back and it recovers.
pub struct FakeHealth {
    path: PathBuf,
    last: HashMap<String, bool>,
}

impl FakeHealth {
    pub fn new(path: &Path) -> Self {
        let mut watch = FakeHealth {
            path: path.to_owned(),
            last: HashMap::new(),
        };
        watch.read();
        watch
    }

    /// Re-reads the (small) file every tick.
    fn read(&mut self) -> Vec<HealthChange> {
        // A half-written or broken edit is ignored until it parses.
        let Ok(gpus) = FakeGpus::from_file(&self.path).and_then(|f| f.discover()) else {
            return Vec::new();
        };
        let mut changes = Vec::new();
        for gpu in gpus {
            let before = self.last.insert(gpu.uuid.clone(), gpu.healthy);
            if before.is_some_and(|b| b != gpu.healthy) {
                changes.push(HealthChange {
                    uuid: gpu.uuid,
                    healthy: gpu.healthy,
                    reason: format!("healthy = {} in {}", gpu.healthy, self.path.display()),
                });
            }
        }
        changes
    }
}

impl HealthWatch for FakeHealth {
    fn poll(&mut self, timeout: Duration) -> Vec<HealthChange> {
        std::thread::sleep(timeout);
        self.read()
    }
}

/// Health from NVML: critical XID events (minus ignored ones) and devices
/// that stop answering mark a GPU Unhealthy. It turns Healthy again once it
/// answers NVML, has no page retirement pending (which needs a reset), and
/// has been quiet for `recovery`.
pub struct NvmlHealth {
    nvml: &'static nvml_wrapper::Nvml,
    events: Option<nvml_wrapper::EventSet<'static>>,
    uuids: Vec<String>,
    ignored: HashSet<u64>,
    recovery: Duration,
    /// Unhealthy GPUs and when they last showed a problem.
    sick: HashMap<String, Instant>,
}

impl NvmlHealth {
    /// Registers for critical XID events on every GPU.
    pub fn new(ignored: &[u64], recovery: Duration) -> Result<Self, crate::gpu::GpuError> {
        use nvml_wrapper::bitmasks::event::EventTypes;
        let nvml_err =
            |e: nvml_wrapper::error::NvmlError| crate::gpu::GpuError::Nvml(e.to_string());
        // Lives as long as the process: the event set borrows it.
        let nvml: &'static nvml_wrapper::Nvml =
            Box::leak(Box::new(nvml_wrapper::Nvml::init().map_err(nvml_err)?));
        let count = nvml.device_count().map_err(nvml_err)?;
        let mut events = Some(nvml.create_event_set().map_err(nvml_err)?);
        let mut uuids = Vec::new();
        for index in 0..count {
            let device = nvml.device_by_index(index).map_err(nvml_err)?;
            uuids.push(device.uuid().map_err(nvml_err)?);
            if let Some(set) = events.take() {
                match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
                    Ok(set) => events = Some(set),
                    Err(e) => {
                        warn!(gpu = index, error = %e.error, "XID events unavailable; only polling this GPU")
                    }
                }
            }
        }
        Ok(NvmlHealth {
            nvml,
            events,
            uuids,
            ignored: ignored.iter().copied().collect(),
            recovery,
            sick: HashMap::new(),
        })
    }

    fn mark(&mut self, uuid: &str, reason: String, changes: &mut Vec<HealthChange>) {
        if self.sick.insert(uuid.to_owned(), Instant::now()).is_none() {
            changes.push(HealthChange {
                uuid: uuid.to_owned(),
                healthy: false,
                reason,
            });
        }
    }
}

impl HealthWatch for NvmlHealth {
    fn poll(&mut self, timeout: Duration) -> Vec<HealthChange> {
        use nvml_wrapper::enums::event::XidError;
        use nvml_wrapper::error::NvmlError;
        let mut changes = Vec::new();
        match &self.events {
            Some(set) => match set.wait(u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX)) {
                Ok(event) => {
                    let xid = match event.event_data {
                        Some(XidError::Value(x)) => Some(x),
                        _ => None,
                    };
                    if xid.is_none_or(|x| !self.ignored.contains(&x)) {
                        let reason = xid.map_or("critical XID (unknown)".into(), |x| {
                            format!("critical XID {x}")
                        });
                        match event.device.uuid() {
                            Ok(uuid) => self.mark(&uuid, reason, &mut changes),
                            // An event we cannot attribute: every GPU is suspect.
                            Err(_) => {
                                for uuid in self.uuids.clone() {
                                    self.mark(&uuid, reason.clone(), &mut changes);
                                }
                            }
                        }
                    }
                }
                Err(NvmlError::Timeout) => {}
                Err(e) => {
                    warn!(error = %e, "waiting for NVML events failed");
                    std::thread::sleep(timeout);
                }
            },
            None => std::thread::sleep(timeout),
        }
        // Lost GPUs and recoveries.
        for uuid in self.uuids.clone() {
            let answer = self.nvml.device_by_uuid(uuid.as_str()).and_then(|d| {
                d.memory_info()?;
                // Pending page retirement only clears with a reset.
                d.are_pages_pending_retired().or(Ok(false))
            });
            match answer {
                Err(NvmlError::GpuLost) | Err(NvmlError::Unknown) => {
                    self.mark(&uuid, "GPU has fallen off the bus".into(), &mut changes);
                }
                Err(_) | Ok(true) => {
                    if let Some(at) = self.sick.get_mut(&uuid) {
                        *at = Instant::now();
                    }
                }
                Ok(false) => {
                    if self
                        .sick
                        .get(&uuid)
                        .is_some_and(|at| at.elapsed() >= self.recovery)
                    {
                        self.sick.remove(&uuid);
                        changes.push(HealthChange {
                            uuid,
                            healthy: true,
                            reason: format!("answering NVML and quiet for {:?}", self.recovery),
                        });
                    }
                }
            }
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
                if change.healthy {
                    info!(uuid = %change.uuid, reason = %change.reason, "GPU healthy again");
                } else {
                    warn!(uuid = %change.uuid, reason = %change.reason, "GPU unhealthy: its units stop receiving pods");
                }
                inventory.send_if_modified(|inv| {
                    match inv.with_health(&change.uuid, change.healthy) {
                        Some(updated) => {
                            *inv = Arc::new(updated);
                            true
                        }
                        None => false,
                    }
                });
            }
        }
    });
    let _ = task.await;
}

/// The health watch for a GPU source: the fake file, or NVML.
pub fn watch_for(
    fake_gpus: Option<&Path>,
    ignored: &[u64],
    recovery: Duration,
) -> Option<Box<dyn HealthWatch>> {
    match fake_gpus {
        Some(path) => Some(Box::new(FakeHealth::new(path))),
        None => match NvmlHealth::new(ignored, recovery) {
            Ok(watch) => Some(Box::new(watch)),
            Err(err) => {
                warn!(%err, "GPU health checks disabled");
                None
            }
        },
    }
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
    fn fake_file_edits_become_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        let write = |healthy: bool| {
            std::fs::write(
                &path,
                format!("[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 15079\nhealthy = {healthy}\n"),
            )
            .unwrap();
        };
        write(true);
        let mut watch = FakeHealth::new(&path);
        assert!(watch.poll(Duration::ZERO).is_empty());
        write(false);
        let changes = watch.poll(Duration::ZERO);
        assert_eq!(changes.len(), 1);
        assert!(!changes[0].healthy && changes[0].uuid == "GPU-a");
        std::fs::write(&path, "[[gpu]]\nuuid = ").unwrap();
        assert!(
            watch.poll(Duration::ZERO).is_empty(),
            "broken edits are ignored"
        );
        write(true);
        assert!(watch.poll(Duration::ZERO)[0].healthy);
    }
}
