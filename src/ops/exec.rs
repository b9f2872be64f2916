//! `gpumem exec`: run any command under a memory cap without Kubernetes,
//! with the same shim and accounting a capped container gets.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

use crate::isolation::accounting::{self, AccountingError, Cap};
use crate::isolation::inject::{env, CONTAINER_SHIM_DIR, SHIM_LIBRARY};
use crate::isolation::install::{self, ShimError};
use crate::isolation::reconcile::{self, Reconciler};
use crate::node::gpu::Gpu;
use crate::node::processes::ProcessUsage;

pub struct ExecConfig {
    /// Cap per GPU, MiB.
    pub mem_mib: u64,
    /// The GPUs to cap (every one the process can use should be here).
    pub gpus: Vec<Gpu>,
    /// Shared accounting directory; a private temporary one when `None`.
    pub state_dir: Option<PathBuf>,
    pub shim: PathBuf,
    pub context_charge_mib: u64,
    /// Restrict CUDA to the capped GPUs (set when the user picked GPUs).
    pub only_selected: bool,
    /// Per-process GPU memory and how often to fold what the command uses
    /// beyond its allocations (contexts, libraries) into its cap.
    pub reconcile: Option<(Box<dyn ProcessUsage>, Duration)>,
    pub command: Vec<OsString>,
}

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(
        "--gpu {selector:?} matches no GPU on this node (give an index or a UUID); {}",
        listing(.gpus)
    )]
    NoSuchGpu { selector: String, gpus: Vec<Gpu> },
    #[error(
        "shim library not found (looked for {}); build it with `cargo build --release -p gpumem-shim` \
         and pass {flag} PATH",
        .looked.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    NoShim {
        looked: Vec<PathBuf>,
        /// The flag that names the shim in the command at hand.
        flag: &'static str,
    },
    #[error("{flag}")]
    NotShim {
        flag: &'static str,
        #[source]
        error: ShimError,
    },
    #[error("no command given: gpumem exec --mem 4308MiB -- COMMAND [ARGS...]")]
    NoCommand,
    #[error(transparent)]
    Accounting(#[from] AccountingError),
    #[error("cannot create a temporary state directory: {0}")]
    TempDir(std::io::Error),
    #[error("cannot run {command:?}: {why}")]
    NotFound {
        command: OsString,
        why: &'static str,
    },
    #[error("cannot run {command:?}: not executable")]
    NotExecutable {
        command: OsString,
        source: std::io::Error,
    },
    #[error("lost track of {command:?}")]
    Wait {
        command: OsString,
        source: std::io::Error,
    },
}

impl ExecError {
    /// The status a shell gives a command it cannot start: 127 when it is
    /// not found, 126 when it is there but cannot be executed. Scripts
    /// (and `gpumem exec` inside them) tell the two from the command's own
    /// failures by these.
    pub fn exit_code(&self) -> Option<u8> {
        match self {
            ExecError::NotFound { .. } => Some(127),
            ExecError::NotExecutable { .. } => Some(126),
            _ => None,
        }
    }
}

/// Why spawning `command` found nothing: the kernel says ENOENT both for a
/// missing file and for a file whose interpreter is missing.
fn not_found(command: &OsString) -> &'static str {
    if !command.as_encoded_bytes().contains(&b'/') {
        "command not found in PATH"
    } else if Path::new(command).exists() {
        "its #! interpreter or ELF loader is missing"
    } else {
        "no such file"
    }
}

/// Keeps the GPUs named by `selectors` (indices or UUIDs); all when empty.
pub fn select(gpus: Vec<Gpu>, selectors: &[String]) -> Result<Vec<Gpu>, ExecError> {
    if selectors.is_empty() {
        return Ok(gpus);
    }
    selectors
        .iter()
        .map(|s| {
            gpus.iter()
                .find(|g| g.uuid.eq_ignore_ascii_case(s) || s.parse() == Ok(g.index))
                .cloned()
                .ok_or_else(|| ExecError::NoSuchGpu {
                    selector: s.clone(),
                    gpus: gpus.clone(),
                })
        })
        .collect()
}

/// The GPUs there are, as a user picks one: index, name, memory, UUID.
fn listing(gpus: &[Gpu]) -> String {
    if gpus.is_empty() {
        return "it has none".to_owned();
    }
    let each: Vec<String> = gpus
        .iter()
        .map(|g| format!("{}: {}, {} MiB, {}", g.index, g.name, g.memory_mib, g.uuid))
        .collect();
    format!("it has {}", each.join("; "))
}

/// GPUs with less memory than `mem_mib`: the cap never binds on them, the
/// card runs out first.
pub fn smaller_than_cap(gpus: &[Gpu], mem_mib: u64) -> impl Iterator<Item = &Gpu> {
    gpus.iter().filter(move |g| g.memory_mib < mem_mib)
}

/// The shim to preload: `explicit` (given with `flag`), else next to this
/// executable, else where the DaemonSet installs it. What is found must be
/// the shim: anything else would leave the command uncapped.
pub fn find_shim(explicit: Option<PathBuf>, flag: &'static str) -> Result<PathBuf, ExecError> {
    let mut candidates = Vec::new();
    match explicit {
        Some(path) => candidates.push(path),
        None => {
            if let Some(dir) = std::env::current_exe()
                .ok()
                .and_then(|e| e.parent().map(Path::to_owned))
            {
                candidates.push(dir.join(SHIM_LIBRARY));
            }
            candidates.push(Path::new(CONTAINER_SHIM_DIR).join(SHIM_LIBRARY));
        }
    }
    let Some(found) = candidates.iter().find(|p| p.is_file()) else {
        return Err(ExecError::NoShim {
            looked: candidates,
            flag,
        });
    };
    install::check_shim(found).map_err(|error| ExecError::NotShim { flag, error })?;
    Ok(std::path::absolute(found).unwrap_or_else(|_| found.clone()))
}

/// How the command ended, and what it wanted of its cap.
#[derive(Debug)]
pub struct Finished {
    pub status: ExitStatus,
    /// Allocations refused for the cap while the command ran (with a shared
    /// state directory: by any command sharing it, as the file counts
    /// refusals per GPU, not per process).
    pub refusals: u64,
    /// Highest usage of the accounting file's life, MiB.
    pub peak_mib: u64,
}

impl Finished {
    /// Why the command may have failed with out-of-memory, where the cap
    /// of `mem_mib` refused allocations; `shared` is `--state-dir`, whose
    /// file counts refusals per GPU, not per process.
    pub fn refusal_report(&self, mem_mib: u64, shared: Option<&Path>) -> Option<String> {
        if self.refusals == 0 {
            return None;
        }
        let whose = match shared {
            Some(dir) => format!(
                " while the command ran, by it or another command sharing --state-dir {}",
                dir.display()
            ),
            None => String::new(),
        };
        Some(format!(
            "gpumem: {} GPU allocation(s) refused at the {mem_mib} MiB cap{whose} (peak use {} MiB)",
            self.refusals, self.peak_mib
        ))
    }

    /// gpumem's exit code: the command's; for a command killed by a
    /// signal, 128 + the signal, as shells report it.
    pub fn exit_code(&self) -> u8 {
        let code = self
            .status
            .code()
            .or_else(|| {
                std::os::unix::process::ExitStatusExt::signal(&self.status).map(|s| 128 + s)
            })
            .unwrap_or(1);
        u8::try_from(code).unwrap_or(1)
    }
}

/// The warning for a GPU the cap does not limit: most likely a typo or the
/// wrong node, though one cap for mixed GPUs is legitimate.
pub fn cap_warning(gpu: &Gpu, mem_mib: u64) -> String {
    format!(
        "gpumem: warning: --mem {mem_mib} MiB is more than GPU {} ({}) has, {} MiB, so it \
         does not limit the command there",
        gpu.index, gpu.name, gpu.memory_mib
    )
}

/// Runs the command with the shim preloaded until it exits. SIGTERM is
/// passed on to the child; SIGINT already reaches it from the terminal, so
/// gpumem only waits for it to exit.
pub async fn run(config: ExecConfig) -> Result<Finished, ExecError> {
    let (program, args) = config.command.split_first().ok_or(ExecError::NoCommand)?;
    let temp;
    let state_dir = match &config.state_dir {
        Some(dir) => dir.clone(),
        None => {
            temp = tempfile::Builder::new()
                .prefix("gpumem-exec-")
                .tempdir()
                .map_err(ExecError::TempDir)?;
            temp.path().to_owned()
        }
    };
    let caps: Vec<Cap> = config
        .gpus
        .iter()
        .map(|g| Cap {
            uuid: g.uuid.clone(),
            cap_mib: config.mem_mib,
            context_charge_mib: config.context_charge_mib,
        })
        .collect();
    let file = accounting::prepare(&state_dir, &caps)?;
    // Refusals and peak over all GPUs of the file, in one read.
    let totals = || {
        accounting::usage(&file).map_or((0, 0), |u| {
            (
                u.iter().map(|d| d.refusals).sum::<u64>(),
                u.iter().map(|d| d.peak_bytes).max().unwrap_or(0),
            )
        })
    };
    let (refused_before, _) = totals();

    let mut preload = config.shim.clone().into_os_string();
    if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|p| !p.is_empty()) {
        preload.push(":");
        preload.push(existing);
    }
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .env("LD_PRELOAD", preload)
        .env(env::STATE_DIR, &state_dir)
        .env(env::LIMIT_MIB, config.mem_mib.to_string());
    if config.only_selected {
        let uuids: Vec<&str> = config.gpus.iter().map(|g| g.uuid.as_str()).collect();
        command.env("CUDA_VISIBLE_DEVICES", uuids.join(","));
    }
    let mut child = command.spawn().map_err(|source| {
        let command = program.clone();
        // What a shell calls "not found" (also a missing `#!` interpreter);
        // anything else found but not runnable.
        if source.kind() == std::io::ErrorKind::NotFound {
            let why = not_found(&command);
            ExecError::NotFound { command, why }
        } else {
            ExecError::NotExecutable { command, source }
        }
    })?;
    let pid = child
        .id()
        .and_then(|id| i32::try_from(id).ok())
        .map(Pid::from_raw);
    let reconciling = CancellationToken::new();
    let _stop_reconciling = reconciling.clone().drop_guard();
    if let Some((source, every)) = config.reconcile {
        tokio::spawn(reconcile::run(
            Reconciler::new(source),
            {
                let file = file.clone();
                move || vec![file.clone()]
            },
            every,
            reconciling,
        ));
    }
    // Handling these keeps gpumem alive to clean up after the child.
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    loop {
        tokio::select! {
            status = child.wait() => {
                let status = status.map_err(|source| ExecError::Wait { command: program.clone(), source })?;
                let (refused, peak) = totals();
                return Ok(Finished {
                    status,
                    refusals: refused.saturating_sub(refused_before),
                    peak_mib: peak >> 20,
                });
            }
            Some(()) = async { term.as_mut()?.recv().await } => {
                if let Some(pid) = pid {
                    let _ = kill(pid, Signal::SIGTERM);
                }
            }
            Some(()) = async { int.as_mut()?.recv().await } => {}
        }
    }
}
