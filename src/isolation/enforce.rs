//! The over-cap action: a container whose footprint, as NVML counts it from
//! outside, is above its cap for the grace period in total within a window
//! of `WINDOW_GRACES` grace periods has its GPU processes killed, newest
//! first, until it is back under (or is only reported). The shim refuses
//! allocations precisely; this is the backstop for what does not go through
//! it, as the kernel's OOM killer is for a container's memory limit. Time
//! over is summed within the window, not an unbroken run of samples, so
//! bursts with pauses under the cap between them add up: a tenant over for
//! 9 s, under for 2.3 s, repeated, never makes an unbroken run long enough.

use crate::error_text::chain;
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tracing::{error, info, warn};

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

/// Time over the cap is judged within a window this many grace periods
/// long: a container over its cap for the grace period in total within any
/// such window is acted on, however it spreads that time over bursts.
pub const WINDOW_GRACES: u32 = 6;

/// The window time over the cap is judged in, for `grace`.
pub fn window(grace: Duration) -> Duration {
    grace.saturating_mul(WINDOW_GRACES)
}

/// What one sample makes of a container's time over its cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Under,
    /// Over, with no time over before it in the window: an episode begins.
    WentOver,
    /// Over, with this much time over within the window: less than the grace.
    Over(Duration),
    /// Over, for the grace period or more in total within the window.
    Act(Duration),
}

/// One container's time over its cap on one GPU, as samples see it: from
/// each sample that finds it over to the next sample, whatever that finds.
#[derive(Debug, Default)]
struct OverTime {
    /// Spans over the cap that end within the window, oldest first.
    spans: VecDeque<(Instant, Instant)>,
    /// When the last sample found it over, if it did.
    over_at: Option<Instant>,
    /// Whether an episode (from going over until a window with no time
    /// over, or the action) is under way: it is logged once, as it begins.
    episode: bool,
}

impl OverTime {
    fn sample(&mut self, at: Instant, over: bool, grace: Duration) -> Verdict {
        if let Some(since) = self.over_at.take() {
            match self.spans.back_mut() {
                Some((_, end)) if *end == since => *end = at,
                _ => self.spans.push_back((since, at)),
            }
        }
        // Within a window of the clock's origin (boot), nothing is old
        // enough to drop.
        let from = at.checked_sub(window(grace));
        if let Some(from) = from {
            while self.spans.front().is_some_and(|&(_, end)| end <= from) {
                self.spans.pop_front();
            }
        }
        let total = self
            .spans
            .iter()
            .map(|&(start, end)| {
                end.saturating_duration_since(from.map_or(start, |f| start.max(f)))
            })
            .sum();
        if !over {
            self.episode &= !self.spans.is_empty();
            return Verdict::Under;
        }
        if total >= grace {
            // Acted on: if it is still over next time, that begins anew.
            *self = OverTime::default();
            return Verdict::Act(total);
        }
        self.over_at = Some(at);
        if std::mem::replace(&mut self.episode, true) {
            Verdict::Over(total)
        } else {
            Verdict::WentOver
        }
    }

    /// Nothing to remember: no time over within the window, not over now.
    fn is_idle(&self) -> bool {
        self.spans.is_empty() && self.over_at.is_none()
    }
}

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
    /// A process of the container with this accounting file is on the GPU
    /// without the container's gpumem mounts: found by its cgroup alone.
    NotIsolated {
        file: PathBuf,
        pid: u32,
        used_mib: u64,
    },
}

/// Where notices go; sending never blocks the reconcile loop.
pub type Notices = tokio::sync::mpsc::UnboundedSender<Notice>;

/// Actions taken, by kind; shared with the metrics endpoint.
#[derive(Debug, Default)]
pub struct Actions {
    pub kills: AtomicU64,
    pub reports: AtomicU64,
    /// Samples checked to the end: once it has moved past a value read
    /// after a change, the action has decided on what followed it, so a
    /// reader can tell "nothing was done" from "not looked at yet".
    pub checks: AtomicU64,
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
/// `grace` in total within `window(grace)`.
pub struct Enforcer {
    action: OverCapAction,
    grace: Duration,
    /// Each (file, GPU)'s recent time over its cap.
    over: HashMap<(PathBuf, String), OverTime>,
    actions: Arc<Actions>,
}

impl Enforcer {
    pub fn new(action: OverCapAction, grace: Duration) -> Self {
        Enforcer {
            action,
            grace,
            over: HashMap::new(),
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
        let mut seen = HashSet::new();
        let mut killed = HashSet::new();
        for footprint in footprints {
            let footprint = &footprint.without(&killed);
            let key = (footprint.file.to_owned(), footprint.gpu.to_owned());
            let over = footprint.total() > footprint.limit();
            let verdict = self
                .over
                .entry(key.clone())
                .or_default()
                .sample(now, over, self.grace);
            seen.insert(key);
            let over_ms = match verdict {
                Verdict::Under | Verdict::Over(_) => continue,
                Verdict::WentOver => {
                    info!(
                        file = %footprint.file.display(),
                        gpu = footprint.gpu,
                        used_mib = footprint.total() >> 20,
                        cap_mib = footprint.cap >> 20,
                        grace_ms = self.grace.as_millis() as u64,
                        window_ms = window(self.grace).as_millis() as u64,
                        "container over its GPU memory cap: the over-cap action follows once \
                         it has been over for the grace period in total within the window"
                    );
                    continue;
                }
                Verdict::Act(over) => over.as_millis() as u64,
            };
            // Acted on: a new episode starts if it is still over next time.
            let what_follows = match self.action {
                OverCapAction::Report => " (--over-cap-action report: nothing killed)",
                OverCapAction::Kill => {
                    ": killing its GPU processes, newest first, until it is under"
                }
            };
            warn!(
                file = %footprint.file.display(),
                gpu = footprint.gpu,
                used_mib = footprint.total() >> 20,
                cap_mib = footprint.cap >> 20,
                over_ms,
                window_ms = window(self.grace).as_millis() as u64,
                "container over its GPU memory cap for the grace period in total within the \
                 window{what_follows}"
            );
            match self.action {
                OverCapAction::Report => {
                    self.actions.reports.fetch_add(1, Ordering::Relaxed);
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
        // Those with no footprint this tick (no process on the GPU) are
        // under; each is forgotten once the window holds no time over.
        for (key, over) in &mut self.over {
            if !seen.contains(key) {
                over.sample(now, false, self.grace);
            }
        }
        self.over.retain(|_, over| !over.is_idle());
        // Release: whoever sees the count sees this check's kills done.
        self.actions.checks.fetch_add(1, Ordering::Release);
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
                        "killed a GPU process of a container over its cap for the grace period \
                         in total within the window (newest first; --over-cap-action kill)"
                    );
                }
                Err(err) => {
                    error!(pid, err = %chain(&err), "cannot kill a process of a container over its cap")
                }
            }
        }
        killed
    }

    fn start_time(&self, pid: u32) -> Option<u64> {
        start_time(Path::new("/proc"), pid)
    }
}

/// A process's start time in clock ticks since boot (/proc/PID/stat field
/// 22), read as bytes: its command name may be anything.
pub fn start_time(proc_root: &Path, pid: u32) -> Option<u64> {
    crate::node::processes::proc_stat(proc_root, pid).map(|stat| stat.start)
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

    const SECOND: Duration = Duration::from_secs(1);
    /// The default `--over-cap-grace-secs`.
    const GRACE: Duration = Duration::from_secs(10);

    /// Samples every `every` from `phase` until `until`, over where
    /// `over(t)` says: the verdicts, by the time of each sample.
    fn judge(
        every: Duration,
        phase: Duration,
        until: Duration,
        over: impl Fn(Duration) -> bool,
    ) -> Vec<(Duration, Verdict)> {
        let start = Instant::now();
        let mut clock = OverTime::default();
        let mut verdicts = Vec::new();
        let mut t = phase;
        while t <= until {
            verdicts.push((t, clock.sample(start + t, over(t), GRACE)));
            t += every;
        }
        verdicts
    }

    fn first_action(verdicts: &[(Duration, Verdict)]) -> Option<Duration> {
        verdicts
            .iter()
            .find(|(_, v)| matches!(v, Verdict::Act(_)))
            .map(|&(t, _)| t)
    }

    /// A tenant that dodges an unbroken run: 9 s over, 2.3 s under,
    /// repeated, sampled every 2 s (the default `--reconcile-secs`) at any
    /// phase. No run of samples over reaches the grace period, but the
    /// time over does, within the window: acted on in its second burst, and
    /// said once before.
    #[test]
    fn a_container_over_its_cap_in_bursts_is_acted_on() {
        for tenth in 0..20 {
            let phase = SECOND * tenth / 10;
            let verdicts = judge(2 * SECOND, phase, 45 * SECOND, |t| {
                t.as_secs_f64() % 11.3 < 9.0
            });
            let acted = first_action(&verdicts);
            assert!(
                acted.is_some_and(|t| t <= 20 * SECOND),
                "phase {phase:?}: acted at {acted:?}: {verdicts:?}"
            );
            let before = verdicts.iter().take_while(|(t, _)| Some(*t) < acted);
            let went_over = before.filter(|(_, v)| *v == Verdict::WentOver).count();
            assert_eq!(went_over, 1, "phase {phase:?}: {verdicts:?}");
        }
    }

    /// A well-behaved container briefly over (a context being made, a
    /// sample racing a free): 1 s over every 30 s is never acted on,
    /// sampled every second or every 2 s at any phase, and is forgotten
    /// once a window passes with no time over.
    #[test]
    fn a_container_briefly_over_now_and_then_is_left_alone() {
        for every in [SECOND, 2 * SECOND] {
            for tenth in 0..20 {
                let phase = SECOND * tenth / 10;
                let verdicts = judge(every, phase, 300 * SECOND, |t| t.as_secs_f64() % 30.0 < 1.0);
                assert_eq!(first_action(&verdicts), None, "{every:?} {phase:?}");
            }
        }
        let start = Instant::now();
        let mut clock = OverTime::default();
        clock.sample(start, true, GRACE);
        clock.sample(start + 2 * SECOND, false, GRACE);
        assert!(!clock.is_idle(), "its time over is still in the window");
        clock.sample(start + window(GRACE) + 2 * SECOND, false, GRACE);
        assert!(clock.is_idle());
    }

    /// Over without a break from t = 7 s: acted on at the first sample the
    /// grace period after the first sample over, as before the window.
    #[test]
    fn a_container_over_its_cap_throughout_is_acted_on_after_the_grace_period() {
        for every in [SECOND / 10, SECOND, 2 * SECOND, 3 * SECOND] {
            let verdicts = judge(every, Duration::ZERO, 60 * SECOND, |t| t >= 7 * SECOND);
            let first_over = verdicts.iter().find(|(t, _)| *t >= 7 * SECOND).unwrap().0;
            let expected = verdicts
                .iter()
                .find(|(t, _)| *t >= first_over + GRACE)
                .map(|&(t, _)| t);
            assert_eq!(first_action(&verdicts), expected, "every {every:?}");
        }
        // With no grace, at once.
        let mut clock = OverTime::default();
        let now = Instant::now();
        assert_eq!(
            clock.sample(now, true, Duration::ZERO),
            Verdict::Act(Duration::ZERO)
        );
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
