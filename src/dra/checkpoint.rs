//! The DRA driver's record of prepared claims, one JSON file, so that
//! NodeUnprepareResources works after a restart and a crashed prepare is undone.
//!
//! Kubelet's Unprepare names only namespace/uid/name, and the claim may be
//! deleted by then, so what a prepare created must be found here. The caller
//! follows a two-phase protocol:
//!
//! 1. Prepare: [`Checkpoint::start`] records the accounting directory and CDI
//!    device about to be made, *before* either exists; then the files are
//!    made; then [`Checkpoint::complete`] records the devices handed to
//!    kubelet. A claim already `Completed` is answered from [`Checkpoint::get`].
//! 2. Unprepare: remove the files the entry names, then [`Checkpoint::remove`].
//!    A crash in between leaves the entry, and the retry removes files already
//!    gone.
//!
//! [`Checkpoint::open`] returns the entries still `Started` (a prepare cut off
//! by a crash: the caller removes what they name, then calls `remove`) and,
//! when the boot ID differs, every entry as stale: after a reboot no process
//! of those claims runs and `/var/run/cdi` is empty, and answering a Prepare
//! from such an entry would hand out CDI devices whose specs are gone.
//!
//! Compatibility, both ways: fields unknown to this version are kept and
//! written back unchanged, so a downgrade loses nothing a newer version
//! wrote; missing optional fields default, so an older file loads. The
//! contract for later versions: never rename or remove a field, never change
//! its type, add only optional ones. `version` is for people reading the file;
//! nothing decides by it, and there is no checksum (a checksum over a
//! re-serialisation is what broke NVIDIA's driver across upgrades). A file
//! that does not parse at all is moved aside and reported, never a crash loop;
//! an entry that does not (a hand edit, another version's bug) costs only
//! itself: it is kept in the file as it is and reported, and its claim is
//! known by its UID alone (see [`Checkpoint::unreadable`]).
//!
//! Concurrency: mutations take `&mut self`; the caller holds the checkpoint in
//! a `std::sync::Mutex` (no `.await` while holding it), which also makes a
//! `get` followed by `start` atomic for one claim. Each mutation has written
//! the file (renamed into place, not fsynced: see `save`) before it returns,
//! and on a failed write leaves the checkpoint in memory as it was.

use crate::error_text::one_line;
use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{de, Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::atomic_file::{self, Durability};

/// Where Linux publishes the ID of the running boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// The format version this build writes. Informational: see the module doc.
pub const VERSION: u32 = 1;

/// The checkpoint names other tenants' claims, and only the driver (root)
/// reads it back: owner-only.
const MODE: u32 = 0o600;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read the DRA checkpoint {path} (check its permissions; removing it forgets the prepared claims)")]
    Read { path: PathBuf, source: io::Error },
    #[error(
        "cannot write the DRA checkpoint {path} (is its directory writable and the disk not full?)"
    )]
    Write { path: PathBuf, source: io::Error },
    /// Returned in [`Opened::corrupt`], not as a failure of `open`. The
    /// parse error sits mid-sentence, so it is told here and not chained.
    #[error("the DRA checkpoint {path} does not parse ({error}); it was moved to {moved_to} and an empty one started: the claims it recorded keep their CDI specs until kubelet unprepares them, and their accounting directories follow the clean-up rules")]
    Corrupt {
        path: PathBuf,
        moved_to: PathBuf,
        error: serde_json::Error,
    },
    #[error("claim {uid} is already recorded as {state} in the DRA checkpoint {path} (with accounting directory {dir:?}, CDI device {cdi_device:?}): roll that back first")]
    Conflict {
        path: PathBuf,
        uid: String,
        state: State,
        dir: String,
        cdi_device: String,
    },
    #[error("claim {uid} has no prepare started in the DRA checkpoint {path}")]
    NotStarted { path: PathBuf, uid: String },
    #[error("claim {uid}: {field} {value:?} is not a single file name ({reason})")]
    BadName {
        uid: String,
        field: &'static str,
        value: String,
        reason: &'static str,
    },
}

/// Reads the running boot's ID from [`BOOT_ID_PATH`].
pub fn current_boot_id() -> io::Result<String> {
    let id = fs::read_to_string(BOOT_ID_PATH)?.trim().to_owned();
    if id.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{BOOT_ID_PATH} is empty"),
        ));
    }
    Ok(id)
}

/// When this boot started (`btime` in /proc/stat); `None` if it cannot be
/// read.
pub fn boot_time() -> Option<std::time::SystemTime> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let secs: u64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
}

/// How far a claim's prepare got. Stored as a string; a state written by a
/// newer version is kept as [`State::Other`] and written back unchanged.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum State {
    /// Recorded before any file was made; the files may exist in part.
    #[default]
    Started,
    /// Every file made and the devices recorded.
    Completed,
    /// Unknown to this version. Never rolled back at open: the version that
    /// wrote it may have finished, and unpreparing still removes it.
    Other(String),
}

impl From<String> for State {
    fn from(s: String) -> Self {
        match s.as_str() {
            "Started" => State::Started,
            "Completed" => State::Completed,
            _ => State::Other(s),
        }
    }
}

impl From<State> for String {
    fn from(state: State) -> Self {
        match state {
            State::Started => "Started".to_owned(),
            State::Completed => "Completed".to_owned(),
            State::Other(s) => s,
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            State::Started => "Started",
            State::Completed => "Completed",
            State::Other(s) => s,
        })
    }
}

/// One claim, keyed by its UID in the checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    /// The claim's namespace and name, for logs: kubelet sends them, but the
    /// claim may be gone from the API server.
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub name: String,
    pub state: State,
    /// The claim's accounting directory: one file name under the accounting
    /// root, removed on unprepare and roll-back. Checked to be a single
    /// component so that removing it can never reach outside the root.
    #[serde(deserialize_with = "file_name")]
    pub dir: String,
    /// Our CDI device name (the part after `gpumem.io/…=`), whose spec file
    /// is removed on unprepare and roll-back. A single component, like `dir`.
    #[serde(deserialize_with = "file_name")]
    pub cdi_device: String,
    /// What kubelet was told, in its order; answers a repeated Prepare.
    /// Empty until `Completed`, unless the caller knew them at start.
    #[serde(default)]
    pub devices: Vec<DeviceEntry>,
    /// The UIDs of the pods the claim is reserved for (`status.reservedFor`),
    /// as read when it was prepared and whenever a pod on the node came to
    /// share it since: whose cgroups name the claim's processes, whatever
    /// mounts they shed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<String>,
    /// Fields of a newer version, written back unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ClaimEntry {
    /// An entry for [`Checkpoint::start`]: what is about to be created.
    pub fn started(namespace: &str, name: &str, dir: &str, cdi_device: &str) -> Self {
        ClaimEntry {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            state: State::Started,
            dir: dir.to_owned(),
            cdi_device: cdi_device.to_owned(),
            devices: Vec::new(),
            pods: Vec::new(),
            extra: Map::new(),
        }
    }
}

/// One device prepared for a claim: a result of its allocation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceEntry {
    /// The claim's requests this device serves; empty: all.
    #[serde(default)]
    pub request_names: Vec<String>,
    /// The ResourceSlice pool and device names of the allocation result.
    pub pool: String,
    pub device: String,
    /// The allocation's share of a device allocated many times
    /// (`DRAConsumableCapacity`); none where it is exclusive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    /// The GPU behind the device, as the accounting file names it.
    pub gpu_uuid: String,
    /// The memory cap granted on it, in MiB (the consumed capacity, rounded).
    pub cap_mib: u64,
    /// Fully qualified CDI device IDs handed to kubelet for this device.
    #[serde(default)]
    pub cdi_device_ids: Vec<String>,
    /// Fields of a newer version, written back unchanged.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The file's content.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Document {
    /// The newest format version whose fields may appear; for people only.
    #[serde(default)]
    version: u32,
    /// The build that last wrote the file; for people only.
    #[serde(default)]
    written_by: String,
    /// The boot the entries belong to. Missing or empty: not this boot,
    /// since nothing then shows the files they name still exist.
    #[serde(default)]
    boot_id: String,
    /// Per claim UID.
    #[serde(default)]
    claims: Claims,
    /// Fields of a newer version, written back unchanged.
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// The entries, read one by one.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Claims {
    read: BTreeMap<String, ClaimEntry>,
    /// Entries that did not read, as they were, and why not.
    unreadable: BTreeMap<String, (Value, String)>,
}

impl<'de> Deserialize<'de> for Claims {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut claims = Claims::default();
        for (uid, value) in BTreeMap::<String, Value>::deserialize(deserializer)? {
            match ClaimEntry::deserialize(&value) {
                Ok(entry) => {
                    claims.read.insert(uid, entry);
                }
                Err(err) => {
                    claims.unreadable.insert(uid, (value, one_line(&err)));
                }
            }
        }
        Ok(claims)
    }
}

impl Serialize for Claims {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.read.len() + self.unreadable.len()))?;
        for (uid, entry) in &self.read {
            map.serialize_entry(uid, entry)?;
        }
        for (uid, (value, _)) in &self.unreadable {
            map.serialize_entry(uid, value)?;
        }
        map.end()
    }
}

/// A `Document` as written, borrowed: a checkpoint of a busy node is tens
/// of KiB, written twice per Prepare, so it is not copied first.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Written<'a> {
    version: u32,
    written_by: &'a str,
    boot_id: &'a str,
    claims: &'a Claims,
    #[serde(flatten)]
    extra: &'a Map<String, Value>,
}

/// The checkpoint as loaded, and its file.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    doc: Document,
}

/// What [`Checkpoint::open`] found besides the checkpoint itself.
#[derive(Debug)]
pub struct Opened {
    pub checkpoint: Checkpoint,
    /// This boot's entries still `Started`: prepares cut off by a crash.
    /// Still in the checkpoint: the caller removes the accounting directory
    /// and CDI spec each names, then calls [`Checkpoint::remove`], so a crash
    /// during roll-back is rolled back again at the next open.
    pub interrupted: Vec<(String, ClaimEntry)>,
    /// Every entry of a file written in another boot, already dropped from
    /// the checkpoint. The caller logs them and removes what they name that
    /// survived the reboot (a CDI spec under `/etc/cdi`, say).
    pub stale: Vec<(String, ClaimEntry)>,
    /// A file that did not parse, moved aside: a [`CheckpointError::Corrupt`]
    /// for the caller to log.
    pub corrupt: Option<CheckpointError>,
    /// Whether there was a file (a first start has none; nor has a state
    /// directory wiped or changed while claims were prepared).
    pub found: bool,
    /// Entries that did not read, for the caller to log: this boot's are
    /// kept (see [`Checkpoint::unreadable`]), another boot's dropped with
    /// the rest of its entries.
    pub unreadable: Vec<UnreadableEntry>,
}

/// An entry of the file that this version cannot read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadableEntry {
    pub uid: String,
    /// Why it did not read.
    pub error: String,
    /// Of another boot: dropped.
    pub stale: bool,
}

impl Checkpoint {
    /// Loads the checkpoint at `path`, or starts an empty one (creating its
    /// directory), and writes it back at once: an unwritable location fails
    /// here, at startup, not at the first Prepare. `boot_id` is the running
    /// boot's, normally [`current_boot_id`]. Staging files a crash left
    /// behind are removed.
    pub fn open(path: &Path, boot_id: &str) -> Result<Opened, CheckpointError> {
        let (dir, name) = split(path).map_err(|source| CheckpointError::Read {
            path: path.to_owned(),
            source,
        })?;
        sweep_staging(&dir, &name);
        let mut corrupt = None;
        let mut found = true;
        let mut doc = match fs::read(path) {
            Ok(bytes) => match serde_json::from_slice::<Document>(&bytes) {
                Ok(doc) => doc,
                Err(error) => {
                    let moved_to = move_aside(path, &dir, &name)?;
                    corrupt = Some(CheckpointError::Corrupt {
                        path: path.to_owned(),
                        moved_to,
                        error,
                    });
                    Document::default()
                }
            },
            // No file yet; a missing directory is made, and a file in its
            // place fails the write below, naming the path.
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
                ) =>
            {
                found = false;
                Document::default()
            }
            Err(source) => {
                return Err(CheckpointError::Read {
                    path: path.to_owned(),
                    source,
                })
            }
        };
        let mut stale = Vec::new();
        let another_boot = doc.boot_id.is_empty() || doc.boot_id != boot_id;
        let unreadable = doc
            .claims
            .unreadable
            .iter()
            .map(|(uid, (_, error))| UnreadableEntry {
                uid: uid.clone(),
                error: error.clone(),
                stale: another_boot,
            })
            .collect();
        if another_boot {
            stale = std::mem::take(&mut doc.claims.read).into_iter().collect();
            doc.claims.unreadable.clear();
            doc.boot_id = boot_id.to_owned();
        }
        let interrupted = doc
            .claims
            .read
            .iter()
            .filter(|(_, entry)| entry.state == State::Started)
            .map(|(uid, entry)| (uid.clone(), entry.clone()))
            .collect();
        let checkpoint = Checkpoint {
            path: path.to_owned(),
            doc,
        };
        checkpoint.save()?;
        Ok(Opened {
            checkpoint,
            interrupted,
            stale,
            corrupt,
            found,
            unreadable,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The boot the entries belong to: the one `open` was given.
    pub fn boot_id(&self) -> &str {
        &self.doc.boot_id
    }

    pub fn get(&self, uid: &str) -> Option<&ClaimEntry> {
        self.doc.claims.read.get(uid)
    }

    /// Every entry that reads, by claim UID.
    pub fn claims(&self) -> impl Iterator<Item = (&str, &ClaimEntry)> {
        self.doc
            .claims
            .read
            .iter()
            .map(|(uid, e)| (uid.as_str(), e))
    }

    /// The UIDs of this boot's claims whose entries did not read: prepared,
    /// as far as anyone knows, with files named after the UID. `get` knows
    /// nothing of them; `start` replaces such an entry and `remove` drops it.
    pub fn unreadable(&self) -> impl Iterator<Item = &str> {
        self.doc.claims.unreadable.keys().map(String::as_str)
    }

    /// Records that a prepare of claim `uid` is about to create `entry.dir`
    /// and `entry.cdi_device`; call it before creating either. The entry is
    /// recorded as `Started` whatever its `state`. Repeating it for a
    /// `Started` entry naming the same files is a no-op (a retried prepare),
    /// and an entry in a state of a newer version naming them is replaced
    /// (after a downgrade, this version makes the same files again); any
    /// other existing entry is a [`CheckpointError::Conflict`]: a
    /// `Completed` one answers the prepare itself, and one naming other
    /// files must be rolled back first, or they would be forgotten.
    pub fn start(&mut self, uid: &str, mut entry: ClaimEntry) -> Result<(), CheckpointError> {
        for (field, value) in [("dir", &entry.dir), ("cdi_device", &entry.cdi_device)] {
            check_name(value).map_err(|reason| CheckpointError::BadName {
                uid: uid.to_owned(),
                field,
                value: value.clone(),
                reason,
            })?;
        }
        entry.state = State::Started;
        if let Some(old) = self.doc.claims.read.get(uid) {
            let same_files = old.dir == entry.dir && old.cdi_device == entry.cdi_device;
            match old.state {
                State::Started if same_files => return Ok(()),
                State::Other(_) if same_files => return self.set(uid, Some(entry)).map(drop),
                _ => {}
            }
            return Err(CheckpointError::Conflict {
                path: self.path.clone(),
                uid: uid.to_owned(),
                state: old.state.clone(),
                dir: old.dir.clone(),
                cdi_device: old.cdi_device.clone(),
            });
        }
        self.set(uid, Some(entry)).map(drop)
    }

    /// Records that the prepare of claim `uid` made every file, and the
    /// devices kubelet is told. Also replaces the devices of an entry already
    /// `Completed`. Fields of a newer version in the entry are kept.
    pub fn complete(
        &mut self,
        uid: &str,
        devices: Vec<DeviceEntry>,
    ) -> Result<(), CheckpointError> {
        let Some(old) = self.doc.claims.read.get(uid) else {
            return Err(CheckpointError::NotStarted {
                path: self.path.clone(),
                uid: uid.to_owned(),
            });
        };
        let entry = ClaimEntry {
            state: State::Completed,
            devices,
            ..old.clone()
        };
        self.set(uid, Some(entry)).map(drop)
    }

    /// Records `pods` as the pods claim `uid` is reserved for now, where
    /// its entry reads and is `Completed`. `false`, and nothing written,
    /// where there is no such entry or it says so already.
    pub fn set_pods(&mut self, uid: &str, mut pods: Vec<String>) -> Result<bool, CheckpointError> {
        pods.sort_unstable();
        pods.dedup();
        let Some(old) = self.doc.claims.read.get(uid) else {
            return Ok(false);
        };
        let mut recorded = old.pods.clone();
        recorded.sort_unstable();
        if old.state != State::Completed || recorded == pods {
            return Ok(false);
        }
        let entry = ClaimEntry {
            pods,
            ..old.clone()
        };
        self.set(uid, Some(entry)).map(|_| true)
    }

    /// Forgets claim `uid`, once the files it names are removed, whether
    /// its entry reads or not. `None`, and nothing written, if there is no
    /// such entry: Unprepare is idempotent.
    pub fn remove(&mut self, uid: &str) -> Result<Option<ClaimEntry>, CheckpointError> {
        let claims = &self.doc.claims;
        if !claims.read.contains_key(uid) && !claims.unreadable.contains_key(uid) {
            return Ok(None);
        }
        self.set(uid, None)
    }

    /// Replaces or removes one entry (an unreadable one too) and writes the
    /// file; on a failed write puts the old entry back, so the caller may
    /// treat the step as undone.
    fn set(
        &mut self,
        uid: &str,
        entry: Option<ClaimEntry>,
    ) -> Result<Option<ClaimEntry>, CheckpointError> {
        let claims = &mut self.doc.claims;
        let unreadable = claims.unreadable.remove(uid);
        let old = match entry {
            Some(entry) => claims.read.insert(uid.to_owned(), entry),
            None => claims.read.remove(uid),
        };
        if let Err(err) = self.save() {
            let claims = &mut self.doc.claims;
            match old {
                Some(old) => claims.read.insert(uid.to_owned(), old),
                None => claims.read.remove(uid),
            };
            if let Some(unreadable) = unreadable {
                claims.unreadable.insert(uid.to_owned(), unreadable);
            }
            return Err(err);
        }
        Ok(old)
    }

    /// Writes the file atomically: a staging file in the same directory,
    /// renamed over the old one, so a process that stops at any point leaves
    /// the old file or the new one. Not fsynced: only a power cut or a
    /// kernel crash loses what the page cache holds, both end in a new boot,
    /// and every entry of another boot is dropped at `open` whatever the
    /// file says (one that does not parse is moved aside). The fsyncs cost
    /// more than the rest of a Prepare together on a disk (docs/BENCHMARKS.md).
    fn save(&self) -> Result<(), CheckpointError> {
        let io_err = |source| CheckpointError::Write {
            path: self.path.clone(),
            source,
        };
        let (dir, name) = split(&self.path).map_err(io_err)?;
        let doc = Written {
            version: self.doc.version.max(VERSION),
            written_by: concat!("gpumem ", env!("CARGO_PKG_VERSION")),
            boot_id: &self.doc.boot_id,
            claims: &self.doc.claims,
            extra: &self.doc.extra,
        };
        // Compact: a third smaller than pretty, and `jq` reads it for people.
        let mut text = serde_json::to_vec(&doc).map_err(|e| io_err(io::Error::other(e)))?;
        text.push(b'\n');
        let write = || -> io::Result<()> {
            // Created on demand: nothing else makes the driver's directory.
            fs::create_dir_all(&dir)?;
            let staging = (staging_prefix(&name), STAGING_SUFFIX);
            let staging = (staging.0.as_str(), staging.1);
            atomic_file::replace(&self.path, &text, MODE, staging, Durability::Unsynced)
        };
        write().map_err(io_err)
    }
}

const STAGING_SUFFIX: &str = ".tmp";

/// Hidden, and never the checkpoint's own name: `open` removes these.
fn staging_prefix(name: &str) -> String {
    format!(".{name}.")
}

/// The directory and file name of `path`, which must name a file.
fn split(path: &Path) -> io::Result<(PathBuf, String)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a UTF-8 file path"))?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    Ok((dir, name.to_owned()))
}

/// Removes staging files a crash left between creating and renaming them.
/// Best effort: a leftover one is never read, so failing here blocks nothing.
fn sweep_staging(dir: &Path, name: &str) {
    let prefix = staging_prefix(name);
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        if file_name.starts_with(&prefix) && file_name.ends_with(STAGING_SUFFIX) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Renames a file that does not parse to `<name>.corrupt-<unix time>`
/// (`-<n>` added if taken), kept for a person to read.
fn move_aside(path: &Path, dir: &Path, name: &str) -> Result<PathBuf, CheckpointError> {
    // A clock before 1970 only makes the name less telling.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    let base = format!("{name}.corrupt-{now}");
    let taken = |p: &Path| fs::symlink_metadata(p).is_ok();
    let mut moved_to = dir.join(&base);
    for n in 1.. {
        if !taken(&moved_to) {
            break;
        }
        moved_to = dir.join(format!("{base}-{n}"));
    }
    fs::rename(path, &moved_to).map_err(|source| CheckpointError::Write {
        path: path.to_owned(),
        source,
    })?;
    Ok(moved_to)
}

/// Whether `name` is one path component: the caller joins it to a root and
/// removes the result.
fn check_name(name: &str) -> Result<(), &'static str> {
    match name {
        "" => Err("empty"),
        "." | ".." => Err("a relative directory"),
        _ if name.contains('/') => Err("contains '/'"),
        _ if name.contains('\0') => Err("contains NUL"),
        _ => Ok(()),
    }
}

fn file_name<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    let name = String::deserialize(deserializer)?;
    check_name(&name)
        .map_err(|reason| de::Error::custom(format!("{name:?} is not a file name: {reason}")))?;
    Ok(name)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use serde_json::json;

    const BOOT: &str = "3f0c1d7e-2b4a-4c1e-9a51-6d2f00c0ffee";
    const OTHER_BOOT: &str = "81d4e6a0-0000-4000-8000-00000000b007";

    fn device(n: u64) -> DeviceEntry {
        DeviceEntry {
            request_names: vec!["gpu".to_owned()],
            pool: "node-a".to_owned(),
            device: format!("gpu-{n}"),
            share_id: Some(format!("5d0a7c3e-0000-4000-8000-00000000000{n}")),
            gpu_uuid: format!("GPU-6b1c2d3e-0000-4000-8000-00000000040{n}"),
            cap_mib: 4096,
            cdi_device_ids: vec![format!("gpumem.io/claim=uid-{n}")],
            extra: Map::new(),
        }
    }

    fn started(uid: &str) -> ClaimEntry {
        ClaimEntry::started("ml", &format!("claim-{uid}"), &format!("dra-{uid}"), uid)
    }

    fn open(path: &Path, boot: &str) -> Opened {
        Checkpoint::open(path, boot).unwrap()
    }

    fn read_json(path: &Path) -> Value {
        serde_json::from_slice(&fs::read(path).unwrap()).unwrap()
    }

    fn file_names(dir: &Path) -> Vec<String> {
        let mut names: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn round_trip_creates_the_directory_owner_only() {
        let root = tempfile::tempdir().unwrap();
        // Created on demand, like the plugin directory on a fresh node.
        let path = root.path().join("plugins/gpumem.io/checkpoint.json");
        let mut cp = open(&path, BOOT).checkpoint;
        assert!(path.exists(), "written at open");
        cp.start("uid-1", started("uid-1")).unwrap();
        cp.complete("uid-1", vec![device(1), device(2)]).unwrap();
        cp.start("uid-2", started("uid-2")).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);

        let again = open(&path, BOOT);
        assert_eq!(again.checkpoint.doc.claims, cp.doc.claims);
        assert_eq!(again.checkpoint.boot_id(), BOOT);
        let uids: Vec<_> = again.checkpoint.claims().map(|(uid, _)| uid).collect();
        assert_eq!(uids, ["uid-1", "uid-2"]);
        let file = read_json(&path);
        assert_eq!(file["version"], VERSION);
        assert_eq!(file["bootId"], BOOT);
        assert_eq!(file["claims"]["uid-1"]["state"], "Completed");
        assert_eq!(file["claims"]["uid-1"]["devices"][1]["capMib"], 4096);
    }

    /// A completed claim's pods are replaced by those it is reserved for
    /// now, and written; a claim being prepared or unknown is left alone.
    #[test]
    fn the_pods_of_a_completed_claim_are_recorded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let mut cp = open(&path, BOOT).checkpoint;
        cp.start("uid-1", started("uid-1")).unwrap();
        let pods = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert!(
            !cp.set_pods("uid-1", pods(&["a"])).unwrap(),
            "still Started"
        );
        assert!(
            !cp.set_pods("uid-2", pods(&["a"])).unwrap(),
            "no such claim"
        );
        cp.complete("uid-1", vec![device(1)]).unwrap();
        assert!(cp.set_pods("uid-1", pods(&["b", "a", "a"])).unwrap());
        assert!(
            !cp.set_pods("uid-1", pods(&["a", "b"])).unwrap(),
            "the same"
        );
        let again = open(&path, BOOT).checkpoint;
        assert_eq!(again.get("uid-1").unwrap().pods, ["a", "b"]);
    }

    #[test]
    fn started_entry_is_returned_for_roll_back_until_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let mut cp = open(&path, BOOT).checkpoint;
        cp.start("uid-1", started("uid-1")).unwrap();
        drop(cp); // the crash, before `complete`

        let opened = open(&path, BOOT);
        assert_eq!(opened.interrupted, [("uid-1".to_owned(), started("uid-1"))]);
        assert!(opened.stale.is_empty() && opened.corrupt.is_none());
        // Still recorded, so a crash during roll-back is retried.
        drop(opened);
        let mut cp = open(&path, BOOT).checkpoint;
        assert_eq!(cp.get("uid-1").unwrap().dir, "dra-uid-1");
        assert_eq!(cp.remove("uid-1").unwrap(), Some(started("uid-1")));
        assert_eq!(cp.remove("uid-1").unwrap(), None, "idempotent");

        let opened = open(&path, BOOT);
        assert!(opened.interrupted.is_empty());
        assert_eq!(opened.checkpoint.claims().count(), 0);
    }

    #[test]
    fn completed_entry_survives_reopen_and_is_not_rolled_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let mut cp = open(&path, BOOT).checkpoint;
        cp.start("uid-1", started("uid-1")).unwrap();
        cp.complete("uid-1", vec![device(1)]).unwrap();

        let opened = open(&path, BOOT);
        assert!(opened.interrupted.is_empty() && opened.stale.is_empty());
        let entry = opened.checkpoint.get("uid-1").unwrap();
        assert_eq!(entry.state, State::Completed);
        assert_eq!(entry.devices, [device(1)]);
        assert_eq!(
            (entry.namespace.as_str(), entry.name.as_str()),
            ("ml", "claim-uid-1")
        );
    }

    #[test]
    fn another_boot_makes_every_entry_stale() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let mut cp = open(&path, OTHER_BOOT).checkpoint;
        cp.start("uid-1", started("uid-1")).unwrap();
        cp.complete("uid-1", vec![device(1)]).unwrap();
        cp.start("uid-2", started("uid-2")).unwrap();

        let opened = open(&path, BOOT);
        let stale: Vec<_> = opened
            .stale
            .iter()
            .map(|(uid, e)| (uid.as_str(), &e.state))
            .collect();
        assert_eq!(
            stale,
            [("uid-1", &State::Completed), ("uid-2", &State::Started)]
        );
        assert!(
            opened.interrupted.is_empty(),
            "stale, not rolled back twice"
        );
        assert_eq!(opened.checkpoint.claims().count(), 0);
        assert_eq!(opened.checkpoint.boot_id(), BOOT);
        // Dropped from the file too.
        let opened = open(&path, BOOT);
        assert!(opened.stale.is_empty());
        assert_eq!(read_json(&path)["bootId"], BOOT);
    }

    #[test]
    fn a_file_without_a_boot_id_is_stale() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let text =
            json!({"claims": {"uid-1": {"state": "Completed", "dir": "d", "cdiDevice": "c"}}});
        fs::write(&path, text.to_string()).unwrap();
        let opened = open(&path, BOOT);
        assert_eq!(opened.stale.len(), 1);
        assert_eq!(opened.checkpoint.claims().count(), 0);
    }

    #[test]
    fn unknown_fields_at_every_level_survive_a_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        // As a newer version might write it: new fields everywhere and a
        // state this version does not know.
        let newer = json!({
            "version": 3,
            "writtenBy": "gpumem 9.0.0",
            "bootId": BOOT,
            "nodeName": "node-a",
            "migrations": [{"from": 2, "to": 3}],
            "claims": {
                "uid-1": {
                    "namespace": "ml", "name": "train", "state": "Completed",
                    "dir": "dra-uid-1", "cdiDevice": "uid-1",
                    "priority": {"class": "high", "value": 7},
                    "devices": [{
                        "requestNames": ["gpu"], "pool": "node-a", "device": "gpu-0",
                        "shareId": "5d0a7c3e", "gpuUuid": "GPU-6b1c", "capMib": 2048,
                        "cdiDeviceIds": ["gpumem.io/claim=uid-1"],
                        "computePercent": 25, "mig": null
                    }]
                },
                "uid-3": {
                    "state": "Unpreparing", "dir": "dra-uid-3", "cdiDevice": "uid-3",
                    "devices": [], "reason": "evicted"
                }
            }
        });
        fs::write(&path, serde_json::to_vec(&newer).unwrap()).unwrap();

        let opened = open(&path, BOOT);
        assert!(
            opened.interrupted.is_empty(),
            "an unknown state is not rolled back"
        );
        assert!(opened.corrupt.is_none() && opened.stale.is_empty());
        let mut cp = opened.checkpoint;
        assert_eq!(
            cp.get("uid-3").unwrap().state,
            State::Other("Unpreparing".to_owned())
        );
        // Mutate another entry, so the file is rewritten.
        cp.start("uid-2", started("uid-2")).unwrap();
        cp.complete("uid-2", vec![device(2)]).unwrap();

        let file = read_json(&path);
        for key in ["nodeName", "migrations"] {
            assert_eq!(file[key], newer[key], "top-level {key}");
        }
        assert_eq!(file["version"], 3, "never lowered");
        // Every field as the newer version wrote it (this one adds defaults,
        // such as an empty namespace, which the newer one reads the same).
        for uid in ["uid-1", "uid-3"] {
            let (written, original) = (&file["claims"][uid], &newer["claims"][uid]);
            for (key, value) in original.as_object().unwrap() {
                assert_eq!(&written[key], value, "{uid}.{key}");
            }
        }
        assert_eq!(
            file["claims"]["uid-2"]["devices"][0]["gpuUuid"],
            device(2).gpu_uuid
        );

        // Completing an entry keeps its extras too.
        cp.complete("uid-1", vec![device(1)]).unwrap();
        assert_eq!(read_json(&path)["claims"]["uid-1"]["priority"]["value"], 7);
    }

    #[test]
    fn a_file_of_an_older_version_missing_optional_fields_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let older = json!({
            "bootId": BOOT,
            "claims": {
                "uid-1": {
                    "state": "Completed", "dir": "dra-uid-1", "cdiDevice": "uid-1",
                    "devices": [{"pool": "node-a", "device": "gpu-0", "gpuUuid": "GPU-6b1c", "capMib": 1024}]
                },
                "uid-2": {"state": "Started", "dir": "dra-uid-2", "cdiDevice": "uid-2"}
            }
        });
        fs::write(&path, older.to_string()).unwrap();

        let opened = open(&path, BOOT);
        assert!(opened.corrupt.is_none() && opened.stale.is_empty());
        assert_eq!(opened.interrupted.len(), 1);
        let entry = opened.checkpoint.get("uid-1").unwrap();
        assert_eq!(entry.namespace, "");
        let d = &entry.devices[0];
        assert!(d.request_names.is_empty() && d.cdi_device_ids.is_empty());
        assert_eq!((d.share_id.as_deref(), d.cap_mib), (None, 1024));
        assert_eq!(read_json(&path)["version"], VERSION);
    }

    #[test]
    fn a_corrupt_file_is_moved_aside_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let truncated = b"{\"bootId\": \"3f0c1d7e\", \"claims\": {\"uid-1\": {";
        fs::write(&path, truncated).unwrap();

        let opened = open(&path, BOOT);
        let Some(CheckpointError::Corrupt { moved_to, .. }) = &opened.corrupt else {
            panic!("not reported: {:?}", opened.corrupt);
        };
        let aside = moved_to.file_name().unwrap().to_str().unwrap();
        assert!(aside.starts_with("checkpoint.json.corrupt-"), "{aside}");
        assert_eq!(fs::read(moved_to).unwrap(), truncated, "kept as it was");
        let message = opened.corrupt.as_ref().unwrap().to_string();
        assert!(message.contains(path.to_str().unwrap()), "{message}");
        assert_eq!(opened.checkpoint.claims().count(), 0);
        assert_eq!(read_json(&path)["bootId"], BOOT, "a fresh one");

        // Another corrupt file in the same second gets its own name.
        fs::write(&path, b"").unwrap();
        let second = open(&path, BOOT);
        let Some(CheckpointError::Corrupt {
            moved_to: again, ..
        }) = &second.corrupt
        else {
            panic!("not reported");
        };
        assert_ne!(again, moved_to);
        assert_eq!(file_names(dir.path()).len(), 3);
    }

    #[test]
    fn a_name_that_could_leave_its_root_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let mut cp = open(&path, BOOT).checkpoint;
        for bad in ["", ".", "..", "../etc", "a/b"] {
            let entry = ClaimEntry::started("ml", "c", bad, "uid-1");
            assert!(matches!(
                cp.start("uid-1", entry),
                Err(CheckpointError::BadName { field: "dir", .. })
            ));
        }
        assert!(cp.get("uid-1").is_none());
        // An entry naming one does not read, and is never rolled back.
        let text = json!({"bootId": BOOT, "claims": {"u": {"state": "Started", "dir": "..", "cdiDevice": "c"}}});
        fs::write(&path, text.to_string()).unwrap();
        let opened = open(&path, BOOT);
        assert!(opened.corrupt.is_none());
        assert_eq!(opened.unreadable.len(), 1);
        assert!(opened.unreadable[0].error.contains("not a file name"));
        assert!(opened.interrupted.is_empty());
        assert_eq!(opened.checkpoint.unreadable().collect::<Vec<_>>(), ["u"]);
    }

    #[test]
    fn an_entry_that_does_not_read_costs_only_itself() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let bad = json!({"state": 7, "dir": "dra-bad", "cdiDevice": "bad"});
        let mut good = serde_json::to_value(started("good")).unwrap();
        good["state"] = json!("Completed");
        let text = json!({"bootId": BOOT, "claims": {"bad": bad, "good": good}});
        fs::write(&path, text.to_string()).unwrap();

        let Opened {
            checkpoint: mut cp,
            corrupt,
            unreadable,
            ..
        } = open(&path, BOOT);
        assert!(corrupt.is_none(), "the file is not moved aside");
        assert_eq!(cp.get("good").unwrap().state, State::Completed);
        assert!(cp.get("bad").is_none());
        let [entry] = &unreadable[..] else {
            panic!("{unreadable:?}")
        };
        assert_eq!((entry.uid.as_str(), entry.stale), ("bad", false));
        assert!(entry.error.contains("invalid type"), "{}", entry.error);

        // Kept as it was through other claims' writes.
        cp.start("other", started("other")).unwrap();
        assert_eq!(read_json(&path)["claims"]["bad"], bad);
        assert_eq!(cp.unreadable().collect::<Vec<_>>(), ["bad"]);

        // A prepare of its claim replaces it; removing forgets it.
        cp.start("bad", started("bad")).unwrap();
        assert_eq!(cp.unreadable().count(), 0);
        assert_eq!(read_json(&path)["claims"]["bad"]["state"], "Started");
        fs::write(&path, text.to_string()).unwrap();
        let mut cp = open(&path, BOOT).checkpoint;
        assert_eq!(cp.remove("bad").unwrap(), None);
        assert_eq!(cp.unreadable().count(), 0);
        assert!(read_json(&path)["claims"].get("bad").is_none());

        // Another boot's is dropped with the rest, and reported so.
        fs::write(&path, text.to_string()).unwrap();
        let opened = open(&path, OTHER_BOOT);
        assert!(opened.unreadable[0].stale);
        assert_eq!(opened.stale.len(), 1);
        assert_eq!(opened.checkpoint.unreadable().count(), 0);
        assert_eq!(read_json(&path)["claims"], json!({}));
    }

    #[test]
    fn start_is_idempotent_and_refuses_to_forget_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let mut cp = open(&path, BOOT).checkpoint;
        assert!(matches!(
            cp.complete("uid-1", vec![device(1)]),
            Err(CheckpointError::NotStarted { .. })
        ));
        cp.start("uid-1", started("uid-1")).unwrap();
        cp.start("uid-1", started("uid-1")).unwrap();
        let other = ClaimEntry::started("ml", "c", "dra-elsewhere", "uid-1");
        let err = cp.start("uid-1", other.clone()).unwrap_err();
        assert!(matches!(
            err,
            CheckpointError::Conflict {
                state: State::Started,
                ..
            }
        ));
        assert!(err.to_string().contains("dra-uid-1"), "{err}");
        cp.complete("uid-1", vec![device(1)]).unwrap();
        assert!(matches!(
            cp.start("uid-1", started("uid-1")),
            Err(CheckpointError::Conflict {
                state: State::Completed,
                ..
            })
        ));
        assert_eq!(cp.get("uid-1").unwrap().devices, [device(1)]);
    }

    #[test]
    fn a_newer_versions_state_is_prepared_again_over_the_same_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        let mut newer = serde_json::to_value(started("uid-1")).unwrap();
        newer["state"] = json!("Resizing");
        let text = json!({"bootId": BOOT, "claims": {"uid-1": newer}});
        fs::write(&path, text.to_string()).unwrap();
        let opened = open(&path, BOOT);
        assert!(opened.interrupted.is_empty(), "never rolled back");
        let mut cp = opened.checkpoint;

        let elsewhere = ClaimEntry::started("ml", "c", "dra-elsewhere", "uid-1");
        assert!(matches!(
            cp.start("uid-1", elsewhere),
            Err(CheckpointError::Conflict { .. })
        ));
        cp.start("uid-1", started("uid-1")).unwrap();
        assert_eq!(cp.get("uid-1").unwrap().state, State::Started);
        assert_eq!(read_json(&path)["claims"]["uid-1"]["state"], "Started");
    }

    #[test]
    fn no_staging_files_are_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        // As a crash between creating and renaming one leaves it.
        fs::write(dir.path().join(".checkpoint.json.a1b2c3.tmp"), b"{").unwrap();
        fs::write(dir.path().join("dra.sock"), b"").unwrap();
        let mut cp = open(&path, BOOT).checkpoint;
        for i in 0..5 {
            let uid = format!("uid-{i}");
            cp.start(&uid, started(&uid)).unwrap();
            cp.complete(&uid, vec![device(i)]).unwrap();
        }
        cp.remove("uid-0").unwrap();
        assert_eq!(file_names(dir.path()), ["checkpoint.json", "dra.sock"]);
    }

    #[test]
    fn an_unwritable_directory_is_an_error_naming_the_path() {
        let root = tempfile::tempdir().unwrap();
        // A file where the directory should be: refused even to root.
        fs::write(root.path().join("plugins"), b"").unwrap();
        let path = root.path().join("plugins/checkpoint.json");
        let err = Checkpoint::open(&path, BOOT).unwrap_err();
        assert!(matches!(err, CheckpointError::Write { .. }), "{err}");
        assert!(err.to_string().contains(path.to_str().unwrap()), "{err}");

        let dir = root.path().join("ro");
        fs::create_dir(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o555)).unwrap();
        // Root writes there anyway: then only the case above is checked.
        if fs::write(dir.join("probe"), b"").is_err() {
            let path = dir.join("checkpoint.json");
            let err = Checkpoint::open(&path, BOOT).unwrap_err();
            assert!(err.to_string().contains(path.to_str().unwrap()), "{err}");
        }
    }

    #[test]
    fn a_failed_write_leaves_the_checkpoint_as_it_was() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("plugin");
        let path = dir.join("checkpoint.json");
        let mut cp = open(&path, BOOT).checkpoint;
        cp.start("uid-1", started("uid-1")).unwrap();
        // The directory replaced by a file: every write now fails.
        fs::remove_dir_all(&dir).unwrap();
        fs::write(&dir, b"").unwrap();

        assert!(cp.start("uid-2", started("uid-2")).is_err());
        assert!(cp.get("uid-2").is_none());
        assert!(cp.complete("uid-1", vec![device(1)]).is_err());
        assert_eq!(cp.get("uid-1").unwrap().state, State::Started);
        assert!(cp.remove("uid-1").is_err());
        assert!(cp.get("uid-1").is_some(), "still to unprepare");
    }

    #[test]
    fn the_running_boot_has_an_id() {
        let id = current_boot_id().unwrap();
        assert_eq!(id.len(), 36, "{id:?}");
        assert_eq!(id, current_boot_id().unwrap());
    }
}
