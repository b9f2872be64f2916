//! Who holds the device plugin's accounting directories, for clean-up: the
//! containers kubelet's pod-resources List shows, and those only kubelet's
//! device checkpoint names. List never shows a regular init container, so
//! an init container waiting for its image longer than the grace period
//! would otherwise lose its directory before it starts.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::deviceplugin::checkpoint;
use crate::error_text::{chain, one_line};
use crate::isolation::cleanup::Holders;
use crate::isolation::containers::ContainerName;
use crate::isolation::reconcile::attribution::{PodDirs, PodGrants};
use crate::kubelet::podresources::PodResources;
use crate::sync::LockExt;

/// The least time between two unprompted resends, whatever the grace
/// period: each makes kubelet rewrite its checkpoint.
const MIN_RESEND_EVERY: Duration = Duration::from_secs(5);

/// The accounting directories Allocate made or took again, and when.
/// Allocate records a directory under the same lock that clean-up's removal
/// takes, so a directory named by devices an ended container held, taken
/// again by a new container after clean-up asked kubelet who holds what,
/// is kept rather than removed under the new container.
#[derive(Clone, Default)]
pub struct Granted(Arc<Mutex<HashMap<ContainerName, Instant>>>);

impl Granted {
    /// Runs `make`, which makes or takes again `name`'s directory, and
    /// records it, with no removal in between.
    pub fn grant<T>(&self, name: ContainerName, make: impl FnOnce() -> T) -> T {
        let mut granted = self.0.lock_unpoisoned();
        let made = make();
        granted.insert(name, Instant::now());
        made
    }
}

pub struct KubeletHolders {
    pod_resources: PodResources,
    /// What Allocate took, shared with the plugin's service.
    granted: Granted,
    /// When `live` last began: a directory granted since then may be in use
    /// though kubelet's answer did not show it yet.
    asked: Mutex<Option<Instant>>,
    checkpoint: PathBuf,
    resource: String,
    /// Bumped to have the plugin send its device list again: kubelet writes
    /// its checkpoint at every device list.
    resend: watch::Sender<u64>,
    /// What was seen when the list was last sent again, and when.
    resent: Mutex<Option<(u64, Instant)>>,
    /// How often the list is sent again while nothing changes.
    every: Duration,
    /// A checkpoint that cannot be read is logged once.
    warned: AtomicBool,
}

impl KubeletHolders {
    /// `device_plugins` is kubelet's device-plugins directory (where its
    /// checkpoint lives); `resend` reaches the plugin's ListAndWatch, at
    /// most once per `every` while nothing changes (the grace period; at
    /// least [`MIN_RESEND_EVERY`]); `granted` is what the plugin's Allocate
    /// records.
    pub fn new(
        pod_resources: PodResources,
        device_plugins: &Path,
        resource: &str,
        resend: watch::Sender<u64>,
        every: Duration,
        granted: Granted,
    ) -> Self {
        KubeletHolders {
            pod_resources,
            granted,
            asked: Mutex::new(None),
            checkpoint: device_plugins.join(checkpoint::FILE_NAME),
            resource: resource.to_owned(),
            resend,
            resent: Mutex::new(None),
            every: every.max(MIN_RESEND_EVERY),
            warned: AtomicBool::new(false),
        }
    }

    /// kubelet forgets a pod that ended (at the List just made) but writes
    /// its checkpoint only at its next allocation or device list, so the
    /// pod's entries could outlive it for hours on a quiet node. A device
    /// list has kubelet write it: sent when what List and the checkpoint
    /// say changes (`seen`), and every `every` while they keep disagreeing,
    /// since an ended pod can change neither (kubelets before 1.34 list it
    /// until it is deleted, and one with a GPU only in an init container
    /// was never in List's holdings).
    fn resend_if_due(&self, seen: u64) {
        let mut resent = self.resent.lock_unpoisoned();
        let due = resent
            .as_ref()
            .is_none_or(|(before, at)| *before != seen || at.elapsed() >= self.every);
        if due {
            *resent = Some((seen, Instant::now()));
            self.resend.send_modify(|n| *n = n.wrapping_add(1));
            debug!("kubelet's checkpoint names containers List does not show; sending the device list again so that kubelet rewrites it");
        }
    }
}

#[tonic::async_trait]
impl Holders for KubeletHolders {
    async fn live(&self) -> Result<HashSet<ContainerName>, String> {
        let now = Instant::now();
        if let Some(before) = self.asked.lock_unpoisoned().replace(now) {
            // Grants before the last answer show in this one, or ended.
            let mut granted = self.granted.0.lock_unpoisoned();
            granted.retain(|_, at| *at >= before);
        }
        let listed = self
            .pod_resources
            .listed()
            .await
            .map_err(|err| one_line(&err))?;
        // Every unit's name: a container allocated before --memory-unit
        // changed keeps its directory.
        let mut live: HashSet<ContainerName> = listed
            .holdings
            .iter()
            .flat_map(|h| ContainerName::of_devices_any_unit(&h.device_ids))
            .collect();
        let (path, resource) = (self.checkpoint.clone(), self.resource.clone());
        let read = tokio::task::spawn_blocking(move || checkpoint::read(&path, &resource))
            .await
            .map_err(|err| one_line(&err))?;
        let entries = match read {
            Ok(entries) => entries,
            Err(err) => {
                // List alone, as before this reader: init containers may
                // lose their directories, nothing else changes.
                if !self.warned.swap(true, Ordering::Relaxed) {
                    warn!(err = %chain(&err), "init containers' accounting directories are kept only while they run; the rest of clean-up goes on");
                }
                return Ok(live);
            }
        };
        let mut unlisted: Vec<String> = Vec::new();
        for entry in &entries {
            for name in ContainerName::of_devices_any_unit(&entry.device_ids) {
                if !live.contains(&name) {
                    unlisted.push(name.as_str().to_owned());
                    live.insert(name);
                }
            }
        }
        if !unlisted.is_empty() {
            unlisted.sort_unstable();
            let seen = {
                use std::hash::{Hash, Hasher};
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                (&listed.pods, &unlisted).hash(&mut hasher);
                hasher.finish()
            };
            self.resend_if_due(seen);
        }
        Ok(live)
    }

    /// Under the lock Allocate records its directories with: one granted
    /// since `live` began is kept.
    fn remove_unless_taken(
        &self,
        name: &ContainerName,
        remove: &mut dyn FnMut() -> std::io::Result<()>,
    ) -> Option<std::io::Result<()>> {
        let asked = *self.asked.lock_unpoisoned();
        let granted = self.granted.0.lock_unpoisoned();
        let taken = granted
            .get(name)
            .is_some_and(|at| asked.is_none_or(|asked| *at >= asked));
        // The removal runs with the lock held.
        (!taken).then(remove)
    }

    /// Every container kubelet's checkpoint names: those kubelet restarts
    /// from its cached answers after a reboot, and only those (a pod that
    /// ended while the plugin ran is gone from it, see `resend_if_due`).
    fn restartable(&self) -> Option<HashSet<ContainerName>> {
        let entries = checkpoint::read(&self.checkpoint, &self.resource)
            .inspect_err(
                |err| debug!(err = %chain(err), "no checkpoint to tell which containers kubelet restarts"),
            )
            .ok()?;
        Some(
            entries
                .iter()
                .flat_map(|entry| ContainerName::of_devices_any_unit(&entry.device_ids))
                .collect(),
        )
    }
}

/// Each pod's accounting directories by pod UID, from kubelet's device
/// checkpoint in `device_plugins`: what attributes a GPU process by its
/// cgroup (`Reconciler::with_pod_dirs`). kubelet writes the entry before
/// it creates the container, and no container can write the file.
pub fn pod_dirs(device_plugins: &Path, resource: &str) -> PodDirs {
    let (path, resource) = (
        device_plugins.join(checkpoint::FILE_NAME),
        resource.to_owned(),
    );
    let last: Mutex<Option<(FileKey, PodGrants)>> = Mutex::new(None);
    Box::new(move || {
        // A node with MiB units has a large file, and a shim-less process
        // makes the reconciler ask at every tick: parsed again only when
        // the file may have changed.
        // No file (or none to look at) tells nothing: kubelet writes it at
        // its first device list, before any container of ours can run.
        let key = FileKey::of(&path)?;
        let mut last = last.lock_unpoisoned();
        if let Some((seen, grants)) = last.as_ref() {
            if seen.settled && seen.same_file(&key) {
                return Some(grants.clone());
            }
        }
        let entries = checkpoint::read(&path, &resource)
            .inspect_err(
                |err| debug!(err = %chain(err), "GPU processes are attributed without their pods"),
            )
            .ok()?;
        let mut by_pod: HashMap<String, Vec<String>> = HashMap::new();
        for entry in entries {
            let names = ContainerName::of_devices_any_unit(&entry.device_ids);
            by_pod
                .entry(entry.pod_uid)
                .or_default()
                .extend(names.into_iter().map(|n| n.as_str().to_owned()));
        }
        let grants = PodGrants {
            by_pod,
            ..PodGrants::default()
        };
        *last = Some((key, grants.clone()));
        Some(grants)
    })
}

/// What tells one version of kubelet's checkpoint from the next without
/// reading it. kubelet writes each version to a new file renamed into
/// place, and two can come within one tick of the file system's clock
/// (a few milliseconds): the same modification time, maybe the same size,
/// and the inode number of a file freed a moment before. Any change made
/// after the file was looked at gets a change time at or after that look,
/// so a file whose change time was already well past then is the same
/// file as long as its key is; a younger one is read again.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileKey {
    dev: u64,
    ino: u64,
    len: u64,
    modified: (i64, i64),
    changed: (i64, i64),
    /// Its change time was before the look by more than the clock's tick:
    /// no later change can give it the same key.
    settled: bool,
}

/// Far more than any file system's timestamp tick (a jiffy, or a second
/// on old ones) and than the clock's steps: a file changed within it of
/// being looked at is read again at the next look.
const SETTLED_AFTER: std::time::Duration = std::time::Duration::from_secs(2);

impl FileKey {
    /// The key of the file at `path` now; `None` if it cannot be looked at.
    fn of(path: &Path) -> Option<FileKey> {
        use std::os::unix::fs::MetadataExt;
        let now = std::time::SystemTime::now();
        let meta = std::fs::metadata(path).ok()?;
        let changed = std::time::UNIX_EPOCH
            + std::time::Duration::new(
                u64::try_from(meta.ctime()).ok()?,
                u32::try_from(meta.ctime_nsec()).ok()?,
            );
        let settled = now
            .duration_since(changed)
            .is_ok_and(|age| age > SETTLED_AFTER);
        Some(FileKey {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            modified: (meta.mtime(), meta.mtime_nsec()),
            changed: (meta.ctime(), meta.ctime_nsec()),
            settled,
        })
    }

    /// The same version of the file, as far as its metadata tells.
    fn same_file(&self, now: &FileKey) -> bool {
        (self.dev, self.ino, self.len, self.modified, self.changed)
            == (now.dev, now.ino, now.len, now.modified, now.changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory named by one device of a 15079 MiB GPU's units.
    fn name(unit: u32) -> ContainerName {
        ContainerName::of_devices_any_unit(&[format!("ae414f82-{unit}")])
            .into_iter()
            .next()
            .expect("a device plugin directory name")
    }

    /// Clean-up asked kubelet who holds what; then Allocate gave an ended
    /// container's units, and so its directory, to a new container. The
    /// removal that follows keeps that directory; one Allocate took before
    /// the question, or never, goes.
    #[tokio::test]
    async fn a_directory_allocate_takes_after_cleanup_asked_kubelet_is_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let resource = "aliyun.com/gpu-mem";
        let granted = Granted::default();
        let holders = KubeletHolders::new(
            PodResources::new(&tmp.path().join("no-kubelet.sock"), resource),
            tmp.path(),
            resource,
            watch::Sender::new(0),
            Duration::from_secs(60),
            granted.clone(),
        );
        let dir = |name: &ContainerName| tmp.path().join(name.as_str());
        let make = |name: &ContainerName| std::fs::create_dir(dir(name)).unwrap();
        let (before, after, never) = (name(0), name(1), name(2));
        granted.grant(before.clone(), || make(&before));
        make(&never);
        // No kubelet here: the answer is an error, but the question was asked.
        assert!(holders.live().await.is_err());
        granted.grant(after.clone(), || make(&after));

        for (name, kept) in [(&after, true), (&before, false), (&never, false)] {
            let path = dir(name);
            let removed = holders.remove_unless_taken(name, &mut || std::fs::remove_dir(&path));
            assert_eq!(removed.is_none(), kept, "{name:?}");
            assert_eq!(path.exists(), kept, "{name:?}");
        }
    }
}
