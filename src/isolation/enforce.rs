//! The over-cap action: a container whose footprint, as NVML counts it from
//! outside, stays above its cap for longer than a grace period has its GPU
//! processes killed, newest first, until it is back under (or is only
//! reported). The shim refuses allocations precisely; this is the backstop
//! for what does not go through it, as the kernel's OOM killer is for a
//! container's memory limit.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tracing::{error, warn};

/// What happens to a container that stays over its cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OverCapAction {
    /// SIGKILL its GPU processes, newest first, until it is under its cap:
    /// what Kubernetes does to a container over its memory limit.
    #[default]
    Kill,
    /// Log and count only.
    Report,
}

impl std::fmt::Display for OverCapAction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OverCapAction::Kill => "kill",
            OverCapAction::Report => "report",
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown over-cap action {0:?}: expected kill or report")]
pub struct UnknownAction(pub String);

impl FromStr for OverCapAction {
    type Err = UnknownAction;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "kill" => Ok(OverCapAction::Kill),
            "report" => Ok(OverCapAction::Report),
            _ => Err(UnknownAction(s.to_owned())),
        }
    }
}

/// The driver hands out memory in 2 MiB chunks, and NVML's per-process
/// figure may round a process's last chunk up where the shim's charge did
/// not: this much per process is not "over".
pub const TOLERANCE_PER_PROCESS: u64 = 2 << 20;

/// What the over-cap action did or saw, for whoever tells the pod's owners
/// (Kubernetes Events).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The GPU's UUID.
    pub gpu: String,
    pub what: Noticed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Noticed {
    /// A process of the container with this accounting file was killed.
    Killed {
        file: PathBuf,
        pid: u32,
        used_mib: u64,
        cap_mib: u64,
    },
    /// The container stayed over its cap; `--over-cap-action report`.
    OverCap {
        file: PathBuf,
        used_mib: u64,
        cap_mib: u64,
    },
    /// A process outside every gpumem container holds GPU memory; the pod
    /// it runs in, if any, by UID.
    Unmanaged {
        pid: u32,
        used_mib: u64,
        pod_uid: Option<String>,
    },
}

/// Where notices go; sending never blocks the reconcile loop.
pub type Notices = tokio::sync::mpsc::UnboundedSender<Notice>;

/// Actions taken, by kind; shared with the metrics endpoint.
#[derive(Debug, Default)]
pub struct Actions {
    pub kills: AtomicU64,
    pub reports: AtomicU64,
}

/// One container's GPU processes on one GPU, as sampled.
#[derive(Debug)]
pub struct Footprint<'a> {
    pub file: &'a Path,
    pub gpu: &'a str,
    pub cap: u64,
    /// PID and bytes NVML showed, for each process attributed to it.
    pub processes: Vec<(u32, u64)>,
}

impl<'a> Footprint<'a> {
    /// The footprint without the processes already killed this tick: one
    /// process can be in several (a claim capping two GPUs it uses), and
    /// its death counts in each.
    fn without(&self, killed: &HashSet<u32>) -> Footprint<'a> {
        Footprint {
            file: self.file,
            gpu: self.gpu,
            cap: self.cap,
            processes: self
                .processes
                .iter()
                .filter(|(pid, _)| !killed.contains(pid))
                .copied()
                .collect(),
        }
    }

    fn total(&self) -> u64 {
        self.processes
            .iter()
            .fold(0, |sum, &(_, bytes)| sum.saturating_add(bytes))
    }

    fn limit(&self) -> u64 {
        let slack = TOLERANCE_PER_PROCESS.saturating_mul(self.processes.len() as u64);
        self.cap.saturating_add(slack)
    }
}

/// Watches footprints across ticks and acts on those over their cap for
/// longer than `grace`.
pub struct Enforcer {
    action: OverCapAction,
    grace: Duration,
    /// When each (file, GPU) was first seen over, in the current episode.
    over_since: HashMap<(PathBuf, String), Instant>,
    actions: Arc<Actions>,
}

impl Enforcer {
    pub fn new(action: OverCapAction, grace: Duration) -> Self {
        Enforcer {
            action,
            grace,
            over_since: HashMap::new(),
            actions: Arc::default(),
        }
    }

    pub fn actions(&self) -> Arc<Actions> {
        self.actions.clone()
    }

    /// Looks at one tick's footprints. `sampled_at` is the system's uptime
    /// in clock ticks when NVML was asked: a process that started later is
    /// not the one NVML listed (its PID was reused) and is never killed.
    pub fn check(
        &mut self,
        footprints: &[Footprint<'_>],
        sampled_at: Option<u64>,
        notices: Option<&Notices>,
    ) {
        let notify = |gpu: &str, what| {
            if let Some(notices) = notices {
                let _ = notices.send(Notice {
                    gpu: gpu.to_owned(),
                    what,
                });
            }
        };
        let now = Instant::now();
        let mut still_over = HashMap::new();
        let mut killed = HashSet::new();
        for footprint in footprints {
            let footprint = &footprint.without(&killed);
            let key = (footprint.file.to_owned(), footprint.gpu.to_owned());
            if footprint.total() <= footprint.limit() {
                continue;
            }
            let since = self.over_since.get(&key).copied().unwrap_or(now);
            if now.duration_since(since) < self.grace {
                still_over.insert(key, since);
                continue;
            }
            // Acted on: a new episode starts if it is still over next time.
            match self.action {
                OverCapAction::Report => {
                    self.actions.reports.fetch_add(1, Ordering::Relaxed);
                    warn!(
                        file = %footprint.file.display(),
                        gpu = footprint.gpu,
                        used_mib = footprint.total() >> 20,
                        cap_mib = footprint.cap >> 20,
                        "container over its GPU memory cap for longer than the grace period \
                         (--over-cap-action report: nothing killed)"
                    );
                    notify(
                        footprint.gpu,
                        Noticed::OverCap {
                            file: footprint.file.to_owned(),
                            used_mib: footprint.total() >> 20,
                            cap_mib: footprint.cap >> 20,
                        },
                    );
                }
                OverCapAction::Kill => {
                    for (pid, bytes) in self.kill_until_under(footprint, sampled_at) {
                        killed.insert(pid);
                        notify(
                            footprint.gpu,
                            Noticed::Killed {
                                file: footprint.file.to_owned(),
                                pid,
                                used_mib: bytes >> 20,
                                cap_mib: footprint.cap >> 20,
                            },
                        );
                    }
                }
            }
        }
        self.over_since = still_over;
    }

    /// The processes killed, with what each held.
    fn kill_until_under(
        &self,
        footprint: &Footprint<'_>,
        sampled_at: Option<u64>,
    ) -> Vec<(u32, u64)> {
        let mut killed = Vec::new();
        let mut newest_first: Vec<(u64, u32, u64)> = footprint
            .processes
            .iter()
            .filter_map(|&(pid, bytes)| Some((self.start_time(pid)?, pid, bytes)))
            .collect();
        newest_first.sort_unstable_by(|a, b| b.cmp(a));
        let mut total = footprint.total();
        for (start, pid, bytes) in newest_first {
            if total <= footprint.limit() {
                break;
            }
            let reused = sampled_at.is_none_or(|at| start > at);
            // Checked again just before the signal: the same process still.
            if reused || self.start_time(pid) != Some(start) {
                warn!(
                    pid,
                    "not killed: the process NVML listed is gone or its PID was reused"
                );
                continue;
            }
            match kill(Pid::from_raw(pid as i32), Signal::SIGKILL) {
                Ok(()) => {
                    self.actions.kills.fetch_add(1, Ordering::Relaxed);
                    total = total.saturating_sub(bytes);
                    killed.push((pid, bytes));
                    warn!(
                        pid,
                        file = %footprint.file.display(),
                        gpu = footprint.gpu,
                        used_mib = bytes >> 20,
                        cap_mib = footprint.cap >> 20,
                        "killed a GPU process of a container over its cap for longer than the \
                         grace period (newest first; --over-cap-action kill)"
                    );
                }
                Err(err) => error!(pid, %err, "cannot kill a process of a container over its cap"),
            }
        }
        killed
    }

    fn start_time(&self, pid: u32) -> Option<u64> {
        start_time(Path::new("/proc"), pid)
    }
}

/// A process's start time in clock ticks since boot (/proc/PID/stat field 22).
pub fn start_time(proc_root: &Path, pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    gpumem_layout::protocol::start_time_in_stat(&stat)
}

/// The system's uptime in clock ticks (the unit of start times), read from
/// `/proc/uptime`; the kernel's USER_HZ is 100 on every Linux gpumem runs on.
pub fn uptime_ticks(proc_root: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(proc_root.join("uptime")).ok()?;
    let seconds: f64 = text.split_whitespace().next()?.parse().ok()?;
    // Rounded up: a process started in the same tick is not "later".
    Some((seconds * 100.0).ceil() as u64 + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_start_time_past_a_command_with_spaces_and_parens() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("7")).unwrap();
        let fields: Vec<String> = (3..=22).map(|f| f.to_string()).collect();
        std::fs::write(
            root.path().join("7/stat"),
            format!("7 (a (b) c) {}\n", fields.join(" ")),
        )
        .unwrap();
        assert_eq!(start_time(root.path(), 7), Some(22));
        assert_eq!(start_time(root.path(), 8), None);
        // This process started before now.
        let me = std::process::id();
        let proc = Path::new("/proc");
        assert!(start_time(proc, me).unwrap() <= uptime_ticks(proc).unwrap());
    }

    /// One process over two footprints (a claim capping two GPUs it uses)
    /// is killed once, and its death counts in both: the newer process
    /// that only the second footprint has stays.
    #[test]
    fn a_process_in_two_footprints_over_their_caps_is_killed_once() {
        const GIB: u64 = 1 << 30;
        let mut older = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        // A later start time (clock ticks are 10 ms).
        std::thread::sleep(Duration::from_millis(30));
        let mut newer = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let (p, q) = (older.id(), newer.id());
        let file = Path::new("/state/claim-x/accounting");
        let footprints = [
            Footprint {
                file,
                gpu: "GPU-x",
                cap: 5 * GIB,
                processes: vec![(p, 10 * GIB)],
            },
            Footprint {
                file,
                gpu: "GPU-y",
                cap: 10 * GIB,
                processes: vec![(p, 10 * GIB), (q, GIB)],
            },
        ];
        let mut enforcer = Enforcer::new(OverCapAction::Kill, Duration::ZERO);
        let sampled_at = uptime_ticks(Path::new("/proc"));
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        enforcer.check(&footprints, sampled_at, Some(&tx));
        let older_died = older.wait().unwrap();
        let newer_alive = newer.try_wait().unwrap().is_none();
        let _ = newer.kill();
        let _ = newer.wait();
        assert!(!older_died.success());
        assert!(newer_alive, "the newer process was killed too");
        assert_eq!(enforcer.actions().kills.load(Ordering::Relaxed), 1);
        let mut killed = Vec::new();
        while let Ok(notice) = rx.try_recv() {
            killed.push(notice.what);
        }
        assert_eq!(killed.len(), 1, "{killed:?}");
    }

    #[test]
    fn actions_parse_and_kill_is_the_default() {
        assert_eq!(OverCapAction::default(), OverCapAction::Kill);
        assert_eq!(
            "report".parse::<OverCapAction>().unwrap(),
            OverCapAction::Report
        );
        assert!("stop".parse::<OverCapAction>().is_err());
    }
}
