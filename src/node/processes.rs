//! Per-process GPU memory: who holds how much of each GPU, as NVML lists it
//! (or the fake GPU file says), and what `/proc` says of those processes.

use crate::error_text::{chain, one_line};
use std::io::BufRead;
use std::ops::ControlFlow;
use std::path::Path;

use tracing::debug;

use crate::node::gpu::{GpuError, ProcessMemory};

/// The most bytes read of any one `/proc/<pid>/<name>` file. A process can
/// make its own files long (20,000 stacked mounts make a 145 MiB
/// `mountinfo`) to exhaust whoever reads them whole; a container's is 30–40
/// lines, a host process's a few per pod on the node, well under this.
pub const PROC_FILE_MAX_BYTES: u64 = 4 << 20;

/// The longest line of a `/proc` file looked at; a longer one (two paths of
/// `PATH_MAX` and their options fit well within) is passed over.
pub const PROC_LINE_MAX_BYTES: usize = 64 << 10;

/// How a read of a `/proc` file ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// To its end, every line looked at.
    Whole,
    /// Where the reader had what it needed.
    Stopped,
    /// At [`PROC_FILE_MAX_BYTES`], or with a line over
    /// [`PROC_LINE_MAX_BYTES`] passed over: the lines looked at are all
    /// that is known of it.
    Cut,
}

/// Feeds each line of `path` (without its newline) to `each` until it
/// breaks, the file ends or [`PROC_FILE_MAX_BYTES`] have been read; `None`
/// where it cannot be opened or read. Lines are read as bytes and given as
/// text with what is not UTF-8 replaced: a command name, a mount point or a
/// cgroup may hold any byte but `/` and NUL, and the fields looked for are
/// ASCII. At most one line is held at a time.
pub fn read_lines(path: &Path, each: &mut dyn FnMut(&str) -> ControlFlow<()>) -> Option<Read> {
    read_lines_from(std::fs::File::open(path).ok()?, each)
}

/// [`read_lines`] from what `source` reads.
pub(crate) fn read_lines_from(
    source: impl std::io::Read,
    each: &mut dyn FnMut(&str) -> ControlFlow<()>,
) -> Option<Read> {
    let mut reader = std::io::BufReader::new(source.take(PROC_FILE_MAX_BYTES + 1));
    let mut line = Vec::new();
    let mut long = false;
    let mut cut = false;
    loop {
        let buf = reader.fill_buf().ok()?;
        if buf.is_empty() {
            break;
        }
        let end = buf.iter().position(|&b| b == b'\n');
        let chunk = &buf[..end.unwrap_or(buf.len())];
        if !long && line.len() + chunk.len() <= PROC_LINE_MAX_BYTES {
            line.extend_from_slice(chunk);
        } else {
            long = true;
            line.clear();
        }
        let used = end.map_or(buf.len(), |at| at + 1);
        reader.consume(used);
        if end.is_some() {
            if long {
                cut = true;
            } else if each(&String::from_utf8_lossy(&line)).is_break() {
                return Some(Read::Stopped);
            }
            line.clear();
            long = false;
        }
    }
    // What is left past the cap, or a last line without its newline.
    let capped = reader.into_inner().limit() == 0;
    if capped || long {
        return Some(Read::Cut);
    }
    if !line.is_empty() && each(&String::from_utf8_lossy(&line)).is_break() {
        return Some(Read::Stopped);
    }
    Some(if cut { Read::Cut } else { Read::Whole })
}

/// What `/proc/<pid>/stat` and its threads' say of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// Its start time in clock ticks since boot (field 22), its leader's.
    pub start: u64,
    /// Whether all of it is on its way out: every thread a zombie, dead or
    /// exiting. A leader that exited alone is a zombie while the other
    /// threads run on, holding the process's memory and files.
    pub exiting: bool,
    /// The thread its other files are read through: the leader while it
    /// runs, else one that does. A zombie leader's `mountinfo` cannot be
    /// read (EINVAL), and on cgroup v1 its `cgroup` reads `/`.
    pub thread: u32,
}

/// Threads looked at for one that runs, past a leader on its way out: a
/// process with more, none of which runs, is taken as running.
const THREADS_LOOKED_AT: usize = 1024;

/// What `<proc_root>/<pid>/stat` and its threads' say; `None` once it is
/// gone (or its start time cannot be read).
pub fn proc_stat(proc_root: &Path, pid: u32) -> Option<ProcStat> {
    let dir = proc_root.join(pid.to_string());
    let (start, leader_exiting) = stat_of(&dir.join("stat"))?;
    let mut found = ProcStat {
        start,
        exiting: leader_exiting,
        thread: pid,
    };
    if !leader_exiting {
        return Some(found);
    }
    let Ok(tasks) = std::fs::read_dir(dir.join("task")) else {
        return Some(found);
    };
    for (looked, task) in tasks.enumerate() {
        let tid = task
            .ok()
            .and_then(|t| t.file_name().to_str()?.parse::<u32>().ok());
        let Some(tid) = tid.filter(|&tid| tid != pid) else {
            continue;
        };
        if looked >= THREADS_LOOKED_AT {
            found.exiting = false;
            break;
        }
        let path = dir.join("task").join(tid.to_string()).join("stat");
        if stat_of(&path).is_some_and(|(_, exiting)| !exiting) {
            found.exiting = false;
            found.thread = tid;
            break;
        }
    }
    Some(found)
}

/// A task's start time and whether it is on its way out, from its `stat`.
fn stat_of(path: &Path) -> Option<(u64, bool)> {
    let mut line = None;
    read_lines(path, &mut |text| {
        line = Some(text.to_owned());
        ControlFlow::Break(())
    })?;
    let line = line?;
    let start = gpumem_layout::protocol::start_time_in_stat(&line)?;
    Some((start, exiting_in_stat(&line)))
}

/// `PF_EXITING` in a task's flags (`stat` field 9): set as the exit
/// begins, before its files are closed.
const PF_EXITING: u64 = 0x4;

/// Whether a task's `stat` line is of one on its way out: a zombie, dead,
/// or exiting.
pub fn exiting_in_stat(stat: &str) -> bool {
    // Fields after the command name's last ')': state (3), then flags (9).
    let Some(close) = stat.rfind(')') else {
        return false;
    };
    let mut fields = stat[close + 1..].split_whitespace();
    let state = fields.next();
    let flags = fields.nth(5).and_then(|f| f.parse::<u64>().ok());
    matches!(state, Some("Z" | "X" | "x")) || flags.is_some_and(|f| f & PF_EXITING != 0)
}

/// The lines of `<proc_root>/<pid>/task/<thread>/<name>` (see
/// [`read_lines`]): a process's files as one of its threads that runs
/// shows them.
pub fn proc_lines(
    proc_root: &Path,
    pid: u32,
    thread: u32,
    name: &str,
    each: &mut dyn FnMut(&str) -> ControlFlow<()>,
) -> Option<Read> {
    let dir = proc_root.join(pid.to_string());
    let path = if thread == pid {
        dir.join(name)
    } else {
        dir.join("task").join(thread.to_string()).join(name)
    };
    read_lines(&path, each)
}

/// What `/proc` says of the processes NVML lists: the kernel's files on a
/// node; the fake GPU file's stand-ins for the processes it lists.
pub trait ProcFiles {
    /// What `/proc/<pid>/stat` and its threads' say of a listed process.
    fn proc_stat(&self, pid: u32) -> Option<ProcStat> {
        proc_stat(Path::new("/proc"), pid)
    }

    /// The lines of a listed process's `/proc` file `name` (`cgroup`,
    /// `mountinfo`) as its thread `thread` shows them (see [`read_lines`]):
    /// where attribution reads who it belongs to.
    fn proc_lines(
        &self,
        pid: u32,
        thread: u32,
        name: &str,
        each: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Option<Read> {
        proc_lines(Path::new("/proc"), pid, thread, name, each)
    }
}

/// The seam where per-process GPU memory enters: NVML on a node, the fake
/// GPU file in tests and the demo.
pub trait ProcessUsage: ProcFiles + Send + 'static {
    /// Device memory per process on each GPU, by UUID and host PID.
    fn usage(&mut self) -> Result<ProcessMemory, GpuError>;
}

/// NVML's running compute processes (about 26 µs per GPU on an H100).
pub struct NvmlProcesses {
    nvml: &'static nvml_wrapper::Nvml,
}

impl NvmlProcesses {
    /// Reads through the process's NVML ([`NvmlHardware`](crate::node::nvml::NvmlHardware)'s).
    pub fn new(nvml: &'static nvml_wrapper::Nvml) -> Self {
        NvmlProcesses { nvml }
    }
}

impl ProcFiles for NvmlProcesses {}

impl ProcessUsage for NvmlProcesses {
    fn usage(&mut self) -> Result<ProcessMemory, GpuError> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let nvml_err = |e: nvml_wrapper::error::NvmlError| GpuError::Nvml(one_line(&e));
        let mut memory = ProcessMemory::new();
        for index in 0..self.nvml.device_count().map_err(nvml_err)? {
            // A GPU that does not answer is left out: its containers keep
            // what was published for them (health reports the GPU itself).
            let answer = self
                .nvml
                .device_by_index(index)
                .and_then(|device| Ok((device.uuid()?, device.running_compute_processes()?)));
            let (uuid, processes) = match answer {
                Ok(answer) => answer,
                Err(err) => {
                    debug!(gpu = index, err = %chain(&err), "no per-process memory for this GPU");
                    continue;
                }
            };
            let per_pid = memory.entry(uuid).or_default();
            for process in processes {
                // Unavailable (some virtualised setups): nothing to compare.
                if let UsedGpuMemory::Used(bytes) = process.used_gpu_memory {
                    let total = per_pid.entry(process.pid).or_default();
                    *total = total.saturating_add(bytes);
                }
            }
        }
        Ok(memory)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(path: &Path) -> (Option<Read>, Vec<String>) {
        let mut seen = Vec::new();
        let read = read_lines(path, &mut |line| {
            seen.push(line.to_owned());
            ControlFlow::Continue(())
        });
        (read, seen)
    }

    #[test]
    fn lines_are_read_as_bytes_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        // A command name that is not UTF-8, and a last line without its
        // newline.
        std::fs::write(&path, b"7 (\xff\xfe) S 1\nlast").unwrap();
        let (read, seen) = lines_of(&path);
        assert_eq!(read, Some(Read::Whole));
        assert_eq!(seen, ["7 (\u{fffd}\u{fffd}) S 1", "last"]);
        // A line past the longest looked at is passed over, not cut short.
        let long = "x".repeat(PROC_LINE_MAX_BYTES + 1);
        std::fs::write(&path, format!("a\n{long}\nb\n")).unwrap();
        assert_eq!(
            lines_of(&path),
            (Some(Read::Cut), vec!["a".into(), "b".into()])
        );
        // A file past the cap: read up to it, and said so.
        let line = "y".repeat(1023) + "\n";
        let lines = (PROC_FILE_MAX_BYTES / 1024) as usize + 10;
        std::fs::write(&path, line.repeat(lines)).unwrap();
        let (read, seen) = lines_of(&path);
        assert_eq!(read, Some(Read::Cut));
        assert_eq!(seen.len() as u64, PROC_FILE_MAX_BYTES / 1024);
        // The reader stops once it has what it needs.
        let mut seen = 0;
        let read = read_lines(&path, &mut |_| {
            seen += 1;
            ControlFlow::Break(())
        });
        assert_eq!((read, seen), (Some(Read::Stopped), 1));
        assert_eq!(lines_of(&dir.path().join("gone")), (None, vec![]));
    }

    /// A `stat` line of a task in `state` with `flags`, started at 22.
    fn stat(state: &str, flags: u64) -> String {
        format!("7 (a (b) c) {state} 1 7 7 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0 22\n")
    }

    #[test]
    fn a_task_on_its_way_out_is_told_by_its_state_or_flags() {
        assert!(!exiting_in_stat(&stat("S", 0x400000)));
        assert!(exiting_in_stat(&stat("S", 0x400004)));
        assert!(exiting_in_stat(&stat("Z", 0)));
        assert!(exiting_in_stat(&stat("X", 0)));
        assert!(!exiting_in_stat("garbage"));
    }

    #[test]
    fn a_process_is_exiting_only_where_all_its_threads_are() {
        let root = tempfile::tempdir().unwrap();
        let task = |tid: u32, text: &str| {
            let dir = root.path().join(format!("7/task/{tid}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("stat"), text).unwrap();
        };
        task(7, &stat("Z", 0));
        std::fs::write(root.path().join("7/stat"), stat("Z", 0)).unwrap();
        task(8, &stat("S", 0x4));
        task(9, &stat("S", 0x40));
        // A leader that exited alone: its worker runs, and is read through.
        let found = proc_stat(root.path(), 7).unwrap();
        assert_eq!(
            found,
            ProcStat {
                start: 22,
                exiting: false,
                thread: 9
            }
        );
        // Every thread on its way out: the process is.
        task(9, &stat("Z", 0));
        assert!(proc_stat(root.path(), 7).unwrap().exiting);
        // A leader that runs is read directly.
        std::fs::write(root.path().join("7/stat"), stat("R", 0)).unwrap();
        let found = proc_stat(root.path(), 7).unwrap();
        assert_eq!((found.exiting, found.thread), (false, 7));
        assert_eq!(proc_stat(root.path(), 8), None, "gone");
    }

    /// This process, through the kernel's `/proc`: read whole, and through
    /// a thread of its own.
    #[test]
    fn reads_the_kernels_proc() {
        let me = std::process::id();
        let proc = Path::new("/proc");
        let found = proc_stat(proc, me).unwrap();
        assert!(!found.exiting);
        assert_eq!(found.thread, me);
        let count = |thread| {
            let mut lines = 0;
            let read = proc_lines(proc, me, thread, "mountinfo", &mut |_| {
                lines += 1;
                ControlFlow::Continue(())
            });
            (read, lines > 0)
        };
        assert_eq!(count(me), (Some(Read::Whole), true));
        // The test runs on a thread of its own.
        let thread = std::fs::read_dir(format!("/proc/{me}/task"))
            .unwrap()
            .filter_map(|t| t.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .find(|&tid| tid != me)
            .unwrap();
        assert_eq!(count(thread), (Some(Read::Whole), true));
    }
}
