//! Per-container accounting files for the shim: created and sized here (at
//! Allocate, or by `gpumem exec`), so caps are owned by the plugin and never
//! by whichever process starts first.

use std::fs;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{fcntl, FcntlArg};
use nix::libc;

use gpumem_layout::protocol::{self, AccountingFile, Snapshot};
use gpumem_layout::{self as layout, DeviceSpec};

use crate::atomic_file;
use crate::isolation::statefs::{self, StateFs};

const MIB: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum AccountingError {
    #[error("GPU UUID {0:?} is not in the GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx form")]
    BadUuid(String),
    #[error("a container can be capped on at most {max} GPUs, not {count}")]
    TooManyGpus { count: usize, max: usize },
    #[error("cannot write accounting state in {path}")]
    Io { path: PathBuf, source: io::Error },
    #[error("cannot mount the bounded file system of the accounting directory {path}")]
    Mount { path: PathBuf, source: io::Error },
}

/// One GPU's cap in a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cap {
    pub uuid: String,
    pub cap_mib: u64,
    pub context_charge_mib: u64,
}

fn specs(caps: &[Cap]) -> Result<Vec<DeviceSpec>, AccountingError> {
    if caps.is_empty() || caps.len() > layout::MAX_DEVICES {
        return Err(AccountingError::TooManyGpus {
            count: caps.len(),
            max: layout::MAX_DEVICES,
        });
    }
    caps.iter()
        .map(|c| {
            Ok(DeviceSpec {
                uuid: layout::parse_uuid(&c.uuid)
                    .ok_or_else(|| AccountingError::BadUuid(c.uuid.clone()))?,
                cap_bytes: c.cap_mib.saturating_mul(MIB),
                context_charge_bytes: c.context_charge_mib.saturating_mul(MIB),
            })
        })
        .collect()
}

/// Makes `dir` hold an accounting file for `caps`. An existing file with the
/// same GPUs and caps is kept, whatever context charge it records (its
/// processes may be running: kubelet can call Allocate again for a live
/// container, and a DRA claim is prepared again; `--context-charge-mib`
/// changing since must not empty a live file); anything else is replaced
/// atomically, so no process ever maps a half-written file.
pub fn prepare(dir: &Path, caps: &[Cap]) -> Result<PathBuf, AccountingError> {
    prepare_with(dir, caps, Durability::Synced, StateFs::Shared)
}

/// Whether a new accounting file is on disk before `prepare` returns:
/// synced for the device plugin, whose containers are restarted after a
/// reboot from kubelet's cached Allocate answers with the file as it is;
/// unsynced for the DRA driver, which prepares every claim anew after one.
pub use crate::atomic_file::Durability;

/// `prepare`, with the file as durable as `durability` says, on a tmpfs of
/// its own with `StateFs::Tmpfs`: mounted unless one is there already, or
/// a live process uses the file on the state dir's own file system (a
/// container from before, which keeps what it has).
pub fn prepare_with(
    dir: &Path,
    caps: &[Cap],
    durability: Durability,
    fs: StateFs,
) -> Result<PathBuf, AccountingError> {
    if fs == StateFs::Tmpfs {
        let path = dir.join(layout::FILE_NAME);
        let mounted = statefs::is_mount_point(dir).unwrap_or(false);
        if !mounted && !has_live_process(&path).unwrap_or(false) {
            mount_fresh(dir, caps)?;
        }
    }
    write(dir, caps, durability, true)
}

/// Mounts a new tmpfs for `caps`'s file at `dir`, detaching whatever was
/// mounted there: a container that ended may have filled its own.
fn mount_fresh(dir: &Path, caps: &[Cap]) -> Result<(), AccountingError> {
    let err = |source| AccountingError::Mount {
        path: dir.to_owned(),
        source,
    };
    fs::create_dir_all(dir).map_err(err)?;
    statefs::unmount(dir).map_err(err)?;
    let len = layout::file_len(caps.len(), layout::DEFAULT_SLOTS as usize);
    statefs::mount_bounded(dir, statefs::size_for(len)).map_err(err)
}

/// What [`prepare_afresh`] found in the place of the file it made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// No file.
    Nothing,
    /// A file a live process holds a slot in: never a process of the
    /// container being started (kubelet calls Allocate before it creates
    /// the container, and never again while it runs), so a slot that
    /// outlived its container's pod.
    InUse,
    /// A file no live process holds a slot in.
    LeftOver,
}

/// Makes a new accounting file for a container the device plugin's
/// Allocate names by its devices alone, so the directory may be one left
/// by a container that ended with the same units. Whatever is there is
/// replaced: a new grant starts with no slots, usage, peak or refusals of
/// the last one's, and inherits no process that still holds a slot in the
/// old file (a tenant can hand the file's descriptor to another of its
/// pods, which outlives the container). Such a process keeps the old inode
/// (and, with `StateFs::Tmpfs`, the old tmpfs), which the daemon no longer
/// reads: it is held by its own mounts and cgroup, never as the new
/// container's. A process that starts later maps the new file.
///
/// With `StateFs::Tmpfs` the file is written twice: synced on the state
/// dir's file system, where a container kubelet restarts from its cached
/// answer after a reboot finds it before gpumem is back, and on a new
/// tmpfs mounted over it, which is what containers get meanwhile.
pub fn prepare_afresh(
    dir: &Path,
    caps: &[Cap],
    fs: StateFs,
) -> Result<(PathBuf, Found), AccountingError> {
    let path = dir.join(layout::FILE_NAME);
    let found = match processes(&path) {
        Ok(processes) if !processes.live.is_empty() => Found::InUse,
        Err(err) if err.kind() == io::ErrorKind::NotFound => Found::Nothing,
        // Unreadable (a link or junk a container left in its place) or
        // unused: nothing of it is worth keeping.
        _ => Found::LeftOver,
    };
    if fs == StateFs::Tmpfs {
        let err = |source| AccountingError::Mount {
            path: dir.to_owned(),
            source,
        };
        statefs::unmount(dir).map_err(err)?;
        write(dir, caps, Durability::Synced, false)?;
        mount_fresh(dir, caps)?;
        let path = write(dir, caps, Durability::Unsynced, false)?;
        return Ok((path, found));
    }
    let path = write(dir, caps, Durability::Synced, false)?;
    Ok((path, found))
}

/// Writes `dir`'s accounting file for `caps`; with `keep`, a valid file
/// with the same GPUs and caps is left as it is.
fn write(
    dir: &Path,
    caps: &[Cap],
    durability: Durability,
    keep: bool,
) -> Result<PathBuf, AccountingError> {
    let devices = specs(caps)?;
    let io_err = |source| AccountingError::Io {
        path: dir.to_owned(),
        source,
    };
    fs::create_dir_all(dir).map_err(io_err)?;
    // Readable by the container's processes whatever their uid.
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(io_err)?;
    let path = dir.join(layout::FILE_NAME);
    if let Some((_, existing)) = keep.then(|| read_regular(&path, false).ok()).flatten() {
        let same = |found: Vec<DeviceSpec>| {
            let caps =
                |d: &[DeviceSpec]| -> Vec<_> { d.iter().map(|d| (d.uuid, d.cap_bytes)).collect() };
            caps(&found) == caps(&devices)
        };
        if layout::validate(&existing).is_ok_and(|g| same(layout::devices(&existing, g))) {
            return Ok(path);
        }
    }
    // A unique staging file: concurrent Allocate calls must not share one.
    // Opened read-write by processes of any uid in the container: the
    // shim's record locks need write access.
    let bytes = layout::encode(&devices, layout::DEFAULT_SLOTS);
    atomic_file::replace(&path, &bytes, 0o666, (".accounting.", ""), durability).map_err(
        |source| AccountingError::Io {
            path: path.clone(),
            source,
        },
    )?;
    Ok(path)
}

/// One device of an accounting file: its cap and what the container uses
/// of it. In the order of the caps the file was prepared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub uuid: String,
    pub cap_bytes: u64,
    /// What each process is charged at its first context.
    pub context_charge_bytes: u64,
    /// Charged by the container's live processes plus `untracked_bytes`.
    pub used_bytes: u64,
    /// What the node daemon saw the processes use beyond their charges.
    pub untracked_bytes: u64,
    /// The highest usage an allocation reached, since the file was made.
    pub peak_bytes: u64,
    /// Allocations refused for the cap, since the file was made.
    pub refusals: u64,
}

/// An accounting file read through one descriptor, so a file replaced
/// meanwhile is never half this one and half the next.
struct Opened {
    file: fs::File,
    bytes: Vec<u8>,
    /// The same bytes, read by the protocol's rules.
    snapshot: AccountingFile<Snapshot>,
}

/// More than any accounting file holds (256 slots take about 49 KiB).
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Opens and reads the file at `path` if it is a regular file of a sane
/// size. The directory is mounted read-write into the container, so its
/// processes can put a symlink, a FIFO or `/dev/zero` in the file's place:
/// the daemon must not follow the first, block on the second or fill its
/// memory from the third.
fn read_regular(path: &Path, write: bool) -> io::Result<(fs::File, Vec<u8>)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() > MAX_FILE_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not an accounting file", path.display()),
        ));
    }
    let mut bytes = Vec::new();
    (&file).take(MAX_FILE_BYTES).read_to_end(&mut bytes)?;
    Ok((file, bytes))
}

/// Opens and reads an accounting file. Asking who holds a lock needs only
/// read access.
fn open_validated(path: &Path, write: bool) -> io::Result<Opened> {
    let (file, bytes) = read_regular(path, write)?;
    let snapshot = AccountingFile::snapshot(&bytes)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(Opened {
        file,
        bytes,
        snapshot,
    })
}

/// Reads current usage: the charges of live processes plus the
/// daemon-observed extra. A dead process's slot still holds its charges
/// until a shim reaps it, but they are no longer in use.
pub fn usage(path: &Path) -> io::Result<Vec<Usage>> {
    Ok(processes(path)?.devices)
}

/// A process that holds a slot: its record lock is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveProcess {
    /// The lock holder's PID in this process's PID namespace, as the kernel
    /// translates it; `None` where the holder is not visible from here (a
    /// plugin without the host's PID namespace).
    pub pid: Option<u32>,
    /// Its start time in clock ticks since boot, as its slot names it (the
    /// shim writes it at claim): with `pid`, what tells it from a process
    /// that took the same PID later.
    pub start_time: u64,
    /// Bytes it charged, per device of the file.
    pub used: Vec<u64>,
    /// Bit per device of the file: making a context there, which the
    /// driver has taken and the shim not yet charged.
    pub creating: u64,
}

/// The devices and live processes of one accounting file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Processes {
    /// In file order; `LiveProcess::used` is indexed alike.
    pub devices: Vec<Usage>,
    pub live: Vec<LiveProcess>,
}

/// Finds the processes that hold slots, by asking the kernel who holds each
/// slot's record lock: the answer is a PID in our own namespace, so a
/// daemon in the host's PID namespace can match it with NVML's PIDs.
pub fn processes(path: &Path) -> io::Result<Processes> {
    // Never takes a lock: any lock of ours would be dropped, and others'
    // misread, by closing this descriptor.
    let Opened {
        file,
        bytes,
        snapshot,
    } = open_validated(path, false)?;
    let geometry = snapshot.geometry();
    let mut live = Vec::new();
    for slot in snapshot.slots() {
        if slot.state != layout::state::ALIVE {
            continue;
        }
        let copied = LiveProcess {
            pid: None,
            start_time: snapshot.owner(slot.index).start_time,
            used: slot.used,
            creating: slot.creating,
        };
        let word = snapshot.state(slot.index);
        if let Some(process) = owner_holding(&file, geometry, slot.index, word, copied)? {
            live.push(process);
        }
    }
    let devices = layout::devices(&bytes, geometry)
        .iter()
        .enumerate()
        .map(|(dev, d)| {
            let untracked_bytes = snapshot.observed_extra(dev);
            Usage {
                uuid: layout::format_uuid(&d.uuid),
                cap_bytes: d.cap_bytes,
                context_charge_bytes: d.context_charge_bytes,
                used_bytes: live
                    .iter()
                    .map(|p| p.used[dev])
                    .fold(untracked_bytes, u64::saturating_add),
                untracked_bytes,
                peak_bytes: snapshot.peak(dev),
                refusals: snapshot.refusals(dev),
            }
        })
        .collect();
    Ok(Processes { devices, live })
}

/// The process holding slot `index`'s record lock as its owner, if one
/// does: `copied` (the copy's view, with state word `word`) with the
/// holder's PID, or the slot as it reads now if another owner has claimed
/// it since. The word is read again after the lock is asked about: a
/// reaper locks an ALIVE slot only after moving its word on to REAPING, so
/// a lock held while the word is not ALIVE is no owner's, and a lock held
/// while it is ALIVE is the owner's of that word.
fn owner_holding(
    file: &fs::File,
    geometry: layout::Geometry,
    index: usize,
    word: protocol::StateWord,
    copied: LiveProcess,
) -> io::Result<Option<LiveProcess>> {
    let mut probe = write_lock(protocol::slot_lock_offset(geometry, index));
    fcntl(file.as_fd(), FcntlArg::F_GETLK(&mut probe)).map_err(io::Error::from)?;
    if probe.l_type == libc::F_UNLCK as libc::c_short {
        return Ok(None);
    }
    let pid = u32::try_from(probe.l_pid).ok().filter(|&p| p > 0);
    let mut now = vec![0u8; layout::SLOT_LEN];
    file.read_exact_at(
        &mut now,
        layout::slot_offset(geometry.devices, index) as u64,
    )?;
    let now_word = protocol::StateWord(layout::get_u64(&now, layout::slot::STATE));
    if now_word == word {
        return Ok(Some(LiveProcess { pid, ..copied }));
    }
    if now_word.state() != layout::state::ALIVE {
        return Ok(None);
    }
    Ok(Some(LiveProcess {
        pid,
        start_time: layout::get_u64(&now, layout::slot::START_TIME),
        used: (0..geometry.devices)
            .map(|dev| layout::get_u64(&now, layout::slot::USED + 8 * dev))
            .collect(),
        creating: layout::get_u64(&now, layout::slot::CREATING),
    }))
}

/// Whether a live process still has a slot in the accounting file.
pub fn has_live_process(path: &Path) -> io::Result<bool> {
    Ok(!processes(path)?.live.is_empty())
}

/// How long a publisher waits its turn: another publisher (a second
/// `gpumem exec` sharing the directory) holds it for three writes.
const PUBLISH_TRIES: u32 = 20;
const PUBLISH_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);

/// Publishes the untracked usage of device `dev` for the shims to fold into
/// their checks. The daemon has no atomics on the shared page, only file
/// writes: the protocol's publishing writes, in order, under the
/// publishers' lock.
pub fn publish_untracked(path: &Path, dev: usize, bytes: u64) -> io::Result<()> {
    let Opened { file, snapshot, .. } = open_validated(path, true)?;
    let geometry = snapshot.geometry();
    if dev >= geometry.devices {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} has no device {dev}", path.display()),
        ));
    }
    // Held until `file` closes; this process holds no slot lock that the
    // close could drop. Never waited for without bound: the file is
    // mounted writable, and a container process that holds this byte must
    // not stop the daemon's sweep of every container.
    let at = protocol::publisher_lock_offset(geometry);
    let turn = write_lock(at);
    let mut tries = 0;
    while let Err(err) = fcntl(file.as_fd(), FcntlArg::F_SETLK(&turn)) {
        if !matches!(err, nix::errno::Errno::EAGAIN | nix::errno::Errno::EACCES) {
            return Err(err.into());
        }
        tries += 1;
        if tries == PUBLISH_TRIES {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "another process holds the publishers' lock (byte {at}) of {}",
                    path.display()
                ),
            ));
        }
        std::thread::sleep(PUBLISH_PAUSE);
    }
    // Read again under the lock: the snapshot may predate another
    // publisher's turn.
    let mut seq = [0u8; 8];
    file.read_exact_at(&mut seq, protocol::observed_seq_offset(dev) as u64)?;
    for (at, value) in protocol::publish_writes(dev, u64::from_le_bytes(seq), bytes) {
        file.write_all_at(&value.to_le_bytes(), at as u64)?;
    }
    Ok(())
}

/// A write-lock request (or query) for the byte at `offset`.
fn write_lock(offset: usize) -> libc::flock {
    libc::flock {
        l_type: libc::F_WRLCK as libc::c_short,
        l_whence: libc::SEEK_SET as libc::c_short,
        l_start: offset as libc::off_t,
        l_len: 1,
        l_pid: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t4(cap_mib: u64) -> Vec<Cap> {
        vec![Cap {
            uuid: "GPU-6b1c2d3e-0000-4000-8000-000000000400".into(),
            cap_mib,
            context_charge_mib: 0,
        }]
    }

    /// Another process holding the write lock of the byte at `offset`.
    fn hold_lock(path: &Path, offset: usize) -> std::process::Child {
        let mut holder = std::process::Command::new("python3")
            .arg("-c")
            .arg(format!(
                "import fcntl, time\nf = open({path:?}, 'r+')\n\
                 fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, {offset}, 0)\n\
                 print('locked', flush=True)\ntime.sleep(60)"
            ))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut said = String::new();
        io::BufRead::read_line(
            &mut io::BufReader::new(holder.stdout.take().unwrap()),
            &mut said,
        )
        .unwrap();
        assert_eq!(said.trim(), "locked");
        holder
    }

    #[test]
    fn prepares_once_and_replaces_on_change() {
        let dir = tempfile::tempdir().unwrap();
        let path = prepare(dir.path(), &t4(4308)).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o666);
        let u = usage(&path).unwrap();
        assert_eq!(u[0].cap_bytes, 4308 * MIB);
        assert_eq!(u[0].uuid, "GPU-6b1c2d3e-0000-4000-8000-000000000400");

        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap());
        let first = inode(&path);
        prepare(dir.path(), &t4(4308)).unwrap();
        assert_eq!(inode(&path), first, "same caps: the live file is kept");
        let mut charged = t4(4308);
        charged[0].context_charge_mib = 300;
        prepare(dir.path(), &charged).unwrap();
        assert_eq!(inode(&path), first, "another context charge: still kept");
        prepare(dir.path(), &t4(2154)).unwrap();
        assert_ne!(
            inode(&path),
            first,
            "new caps: replaced, not rewritten in place"
        );
        assert_eq!(usage(&path).unwrap()[0].cap_bytes, 2154 * MIB);
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no staging file left"
        );
    }

    /// The device plugin's Allocate makes a new file whatever it finds: a
    /// file left by a container that ended, and one a live process still
    /// holds a slot in (which keeps the old inode), alike.
    #[test]
    fn afresh_replaces_every_file() {
        let dir = tempfile::tempdir().unwrap();
        let inode = |p: &Path| std::os::unix::fs::MetadataExt::ino(&fs::metadata(p).unwrap());
        let (path, found) = prepare_afresh(dir.path(), &t4(4308), StateFs::Shared).unwrap();
        assert_eq!(found, Found::Nothing);
        publish_untracked(&path, 0, 600 * MIB).unwrap();
        let left = inode(&path);
        let (path, found) = prepare_afresh(dir.path(), &t4(4308), StateFs::Shared).unwrap();
        assert_eq!(found, Found::LeftOver);
        assert_ne!(inode(&path), left, "replaced, not rewritten in place");
        assert_eq!(usage(&path).unwrap()[0].untracked_bytes, 0);

        // A live process: its slot's word ALIVE and its lock held.
        publish_untracked(&path, 0, 600 * MIB).unwrap();
        let geometry = AccountingFile::snapshot(&fs::read(&path).unwrap())
            .unwrap()
            .geometry();
        let word_at = (layout::slot_offset(geometry.devices, 0) + layout::slot::STATE) as u64;
        let alive = 1u64 << 8 | layout::state::ALIVE;
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&alive.to_le_bytes(), word_at)
            .unwrap();
        let mut holder = hold_lock(&path, protocol::slot_lock_offset(geometry, 0));
        let running = inode(&path);
        let again = prepare_afresh(dir.path(), &t4(4308), StateFs::Shared);
        holder.kill().unwrap();
        holder.wait().unwrap();
        let (path, found) = again.unwrap();
        assert_eq!(found, Found::InUse);
        assert_ne!(inode(&path), running, "a file in use is replaced too");
        assert_eq!(usage(&path).unwrap()[0].untracked_bytes, 0);
    }

    #[test]
    fn concurrent_prepares_all_succeed() {
        let dir = tempfile::tempdir().unwrap();
        std::thread::scope(|s| {
            for i in 0..16u64 {
                let dir = dir.path();
                s.spawn(move || prepare(dir, &t4(1000 + i % 2)).unwrap());
            }
        });
        let cap = usage(&dir.path().join("accounting")).unwrap()[0].cap_bytes;
        assert!(cap == 1000 * MIB || cap == 1001 * MIB);
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no staging file left"
        );
    }

    #[test]
    fn untracked_usage_is_published_under_an_even_sequence() {
        let dir = tempfile::tempdir().unwrap();
        let path = prepare(dir.path(), &t4(4308)).unwrap();
        let seq = |path: &Path| {
            let bytes = fs::read(path).unwrap();
            layout::get_u64(&bytes, protocol::observed_seq_offset(0))
        };
        publish_untracked(&path, 0, 600 * MIB).unwrap();
        assert_eq!(seq(&path), 2);
        let u = &usage(&path).unwrap()[0];
        assert_eq!((u.untracked_bytes, u.used_bytes), (600 * MIB, 600 * MIB));

        // A publisher that died between its writes left the sequence odd.
        let file = fs::OpenOptions::new().write(true).open(&path).unwrap();
        let at = protocol::observed_seq_offset(0) as u64;
        file.write_all_at(&3u64.to_le_bytes(), at).unwrap();
        publish_untracked(&path, 0, 100 * MIB).unwrap();
        assert_eq!(seq(&path), 6);
        assert_eq!(usage(&path).unwrap()[0].untracked_bytes, 100 * MIB);

        let err = publish_untracked(&path, 1, MIB).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(processes(&path).unwrap().live.is_empty());
    }

    /// A slot's lock held by a reaper finishing it (the word moved on to
    /// REAPING before it locked) is not its owner's; one held under a new
    /// ALIVE word is the new owner's, read as the slot is now.
    #[test]
    fn a_slot_locked_under_another_state_word_is_not_its_owners() {
        let dir = tempfile::tempdir().unwrap();
        let path = prepare(dir.path(), &t4(4308)).unwrap();
        let geometry = AccountingFile::snapshot(&fs::read(&path).unwrap())
            .unwrap()
            .geometry();
        let mut holder = hold_lock(&path, protocol::slot_lock_offset(geometry, 0));

        let alive = protocol::StateWord(1 << 8 | layout::state::ALIVE);
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let word_at = (layout::slot_offset(geometry.devices, 0) + layout::slot::STATE) as u64;
        file.write_all_at(&alive.0.to_le_bytes(), word_at).unwrap();
        let copied = LiveProcess {
            pid: None,
            start_time: 7,
            used: vec![5],
            creating: 0,
        };
        let held = owner_holding(&file, geometry, 0, alive, copied.clone()).unwrap();
        file.write_all_at(&alive.reaping().0.to_le_bytes(), word_at)
            .unwrap();
        let reaping = owner_holding(&file, geometry, 0, alive, copied.clone()).unwrap();
        // Reaped and claimed again since the copy: the new owner's, as the
        // slot reads now.
        let slot_at = layout::slot_offset(geometry.devices, 0) as u64;
        file.write_all_at(
            &9u64.to_le_bytes(),
            slot_at + layout::slot::START_TIME as u64,
        )
        .unwrap();
        file.write_all_at(&(2u64 << 8 | layout::state::ALIVE).to_le_bytes(), word_at)
            .unwrap();
        let claimed = owner_holding(&file, geometry, 0, alive, copied.clone()).unwrap();
        holder.kill().unwrap();
        holder.wait().unwrap();
        let pid = Some(holder.id());
        assert_eq!(
            held,
            Some(LiveProcess {
                pid,
                ..copied.clone()
            })
        );
        assert_eq!(reaping, None);
        let claimed = claimed.unwrap();
        assert_eq!(
            (claimed.pid, claimed.start_time, claimed.used),
            (pid, 9, vec![0])
        );
    }

    /// A process of the container holding the publishers' lock byte costs
    /// only this publish, not a daemon stuck on it.
    #[test]
    fn a_publisher_lock_held_for_good_is_given_up_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = prepare(dir.path(), &t4(4308)).unwrap();
        let geometry = AccountingFile::snapshot(&fs::read(&path).unwrap())
            .unwrap()
            .geometry();
        let mut holder = hold_lock(&path, protocol::publisher_lock_offset(geometry));
        let (tx, rx) = std::sync::mpsc::channel();
        let publishing = path.clone();
        std::thread::spawn(move || tx.send(publish_untracked(&publishing, 0, 600 * MIB)));
        let answer = rx.recv_timeout(std::time::Duration::from_secs(10));
        holder.kill().unwrap();
        holder.wait().unwrap();
        let err = answer.expect("still waiting for the lock").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        assert!(err.to_string().contains("publishers' lock"), "{err}");
        assert_eq!(usage(&path).unwrap()[0].untracked_bytes, 0);
        // Once it is let go, publishing works again.
        publish_untracked(&path, 0, 600 * MIB).unwrap();
        assert_eq!(usage(&path).unwrap()[0].untracked_bytes, 600 * MIB);
    }

    #[test]
    fn rejects_bad_input() {
        let dir = tempfile::tempdir().unwrap();
        let mut caps = t4(1);
        caps[0].uuid = "nvidia0".into();
        assert!(matches!(
            prepare(dir.path(), &caps),
            Err(AccountingError::BadUuid(_))
        ));
        assert!(matches!(
            prepare(dir.path(), &[]),
            Err(AccountingError::TooManyGpus { .. })
        ));
    }

    #[test]
    fn a_link_a_fifo_or_a_device_in_the_files_place_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        let cap = Cap {
            uuid: "GPU-6b1c2d3e-0000-4000-8000-000000000400".into(),
            cap_mib: 1024,
            context_charge_mib: 0,
        };
        let real = prepare(&target, std::slice::from_ref(&cap)).unwrap();
        let path = dir.path().join(layout::FILE_NAME);
        std::os::unix::fs::symlink(&real, &path).unwrap();
        assert!(usage(&path).is_err(), "a symlink is not followed");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        assert!(usage(&path).is_err());
        std::fs::remove_file(&path).unwrap();
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        // Returns at once instead of waiting for a writer.
        assert!(usage(&path).is_err());
        assert!(usage(&real).is_ok());
    }
}
