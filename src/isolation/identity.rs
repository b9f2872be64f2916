//! Which pod and container a host process belongs to, read from outside:
//! the kubelet puts every container in a cgroup named after its pod's UID
//! and its container ID, so `/proc/<pid>/cgroup` says whose a GPU process
//! is whether or not it loaded the shim.
//!
//! The cgroup paths kubelet and the runtimes make (cgroup v1 and v2, the
//! systemd and cgroupfs drivers, containerd, CRI-O and cri-dockerd):
//!
//! ```text
//! systemd:  /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, _ for ->.slice/cri-containerd-<id>.scope
//!           /kubepods.slice/kubepods-pod<uid>.slice/crio-<id>.scope        (guaranteed QoS; docker-<id>.scope too)
//! cgroupfs: /kubepods/burstable/pod<uid>/<id>                                (containerd, docker)
//!           /kubepods/pod<uid>/crio-<id>                                     (CRI-O)
//! ```
//!
//! A process in a container nested inside a pod's container (docker in
//! docker, say) sits deeper in the same tree and is the outer container's.
//! A reader in its own cgroup namespace sees the paths with `..` in front:
//! the segments are searched, not the prefix.

use std::collections::hash_map::{Entry, HashMap};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use crate::isolation::statefs;
use crate::node::processes::{ProcFiles, Read};

/// The pod and container a process runs in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Owner {
    /// The pod's UID, with dashes (as the API server writes it).
    pub pod_uid: String,
    /// The container's ID as the runtime names it (64 hex digits); `None`
    /// for a process in the pod's cgroup but no container's (the pause
    /// process, or a runtime's helper).
    pub container_id: Option<String>,
}

/// The owner named by the contents of a `/proc/<pid>/cgroup` file; `None`
/// for a process outside every pod (a host daemon).
pub fn parse(cgroup: &str) -> Option<Owner> {
    cgroup.lines().find_map(owner_of_line)
}

/// The owner one line of a `cgroup` file names. v2 has one line
/// `0::<path>`; v1 one line per hierarchy, all of which kubelet puts the
/// container in: the first that names a pod decides.
fn owner_of_line(line: &str) -> Option<Owner> {
    owner_of_path(line.splitn(3, ':').nth(2)?)
}

/// The owner a process's `cgroup` file names, read line by line until one
/// names a pod: `None` where it cannot be read.
fn read_owner(source: &dyn ProcFiles, pid: u32, thread: u32) -> Option<Option<Owner>> {
    let mut owner = None;
    source.proc_lines(pid, thread, "cgroup", &mut |line| {
        owner = owner_of_line(line);
        if owner.is_some() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    })?;
    Some(owner)
}

/// Where the shim's state path shows in a container's mount table. The
/// runtime resolves symlinks in a mount's destination inside the image
/// (runc's `securejoin`), and in most images (Debian, Ubuntu, Alpine, UBI)
/// `/var/run` is a link to `/run`, so the kernel shows `/run/gpumem` there.
const STATE_MOUNT_POINTS: [&str; 2] = [gpumem_layout::CONTAINER_DIR, "/run/gpumem"];

/// Distinct directories kept of one mount table, at the state path and
/// elsewhere each: a container has one, and one per DRA claim (a pod
/// references at most 32); a table that names more is the process's own
/// making, no runtime's.
const MOUNTED_AT_MOST: usize = 64;

/// The gpumem container directories a process's mount table shows (see
/// [`MountScan`]), each a directory's name under `<state-dir>/containers`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Mounted {
    /// Those at the shim's state path (`/var/run/gpumem`, or `/run/gpumem`
    /// where `/var/run` links there) or directly inside it (a DRA claim's,
    /// `claim-<UID>`), in the order the shim reads their files: the state
    /// path's own, then the others by name.
    pub at_state_path: Vec<String>,
    /// Those mounted anywhere else, by name: where an image's `/var/run`
    /// links elsewhere, the runtime mounts the state path under the link's
    /// target. The state directory's own view shows them too (a host
    /// process sees each container's tmpfs under `<state-dir>/containers`),
    /// so these are believed only where the pod a process runs in was
    /// given the directory.
    pub elsewhere: Vec<String>,
    /// Whether the whole table was read: not cut at
    /// [`PROC_FILE_MAX_BYTES`](crate::node::processes::PROC_FILE_MAX_BYTES).
    pub whole: bool,
}

/// Reads a mount table line by line, keeping only the gpumem container
/// directories it mounts, which it tells by what is mounted, never only by
/// where: a bind of `<…>/containers/<name>` (mountinfo's root field), or
/// the directory's own tmpfs, whose source is `gpumem-state:<name>`.
/// Allocate or a claim's CDI spec mounted them, so every process of the
/// container has them, loaded the shim or not; only a process that makes a
/// user namespace of its own can shed them (docs/SECURITY.md, "Leaving the
/// container's mount view").
#[derive(Debug, Default)]
pub struct MountScan {
    at_state_path: Vec<(bool, String)>,
    elsewhere: Vec<(bool, String)>,
}

impl MountScan {
    /// Looks at one line of `/proc/<pid>/mountinfo`.
    pub fn line(&mut self, line: &str) {
        // ID, parent ID, major:minor, root, mount point, …
        let mut fields = line.split(' ');
        let (Some(root), Some(point)) = (fields.nth(3), fields.next()) else {
            return;
        };
        let Some(name) = mounted_name(line, root) else {
            return;
        };
        let (parent, last) = point.rsplit_once('/').unwrap_or(("", point));
        let claim = last.starts_with(gpumem_layout::CLAIM_DIR_PREFIX);
        let own = STATE_MOUNT_POINTS.contains(&point);
        let inside = claim && STATE_MOUNT_POINTS.contains(&parent);
        let found = if own || inside {
            &mut self.at_state_path
        } else {
            &mut self.elsewhere
        };
        let entry = (!own && claim, name.to_owned());
        if found.len() < MOUNTED_AT_MOST && !found.contains(&entry) {
            found.push(entry);
        }
    }

    /// What the lines looked at say; `whole` where they were all of them.
    pub fn finish(self, whole: bool) -> Mounted {
        let names = |mut found: Vec<(bool, String)>| {
            found.sort();
            found.dedup_by(|a, b| a.1 == b.1);
            found.into_iter().map(|(_, name)| name).collect()
        };
        Mounted {
            at_state_path: names(self.at_state_path),
            elsewhere: names(self.elsewhere),
            whole,
        }
    }
}

/// The gpumem directory a mount table line mounts, from its root field
/// and source.
fn mounted_name<'a>(line: &'a str, root: &'a str) -> Option<&'a str> {
    if root == "/" {
        // The directory's own tmpfs, named by its source.
        let mut source = line.split_once(" - ")?.1.split(' ');
        (source.next()? == "tmpfs").then_some(())?;
        source.next()?.strip_prefix(statefs::SOURCE_PREFIX)
    } else {
        let (parent, name) = root.rsplit_once('/')?;
        (parent.ends_with("/containers") || parent == "/containers").then_some(name)
    }
}

/// What the `/proc` files of the processes NVML lists say of them, read at
/// most once per sweep, and kept from one sweep to the next for as long as
/// the process lives: its mounts and cgroup are set up before it can reach a
/// GPU (what a process sheds after it was first seen here does not count),
/// and a PID taken by a
/// new process comes with a new start time (`stat`, one line). A
/// container's mount table is 30–40 lines the kernel writes out at every
/// read; a host process's has several per pod on the node.
///
/// Slot holders are kept alike, by PID and the start time their slot names
/// (the shim wrote it at claim), so a steady node reads nothing of them.
/// That start time is the container's word, but only ever compared with
/// itself: a process that lies in it can have its cgroup read again, or be
/// taken for the process it replaced under its PID in the same file, which
/// had the file too.
#[derive(Debug, Default)]
pub(crate) struct Identities {
    known: HashMap<u32, Known>,
    holders: HashMap<(u32, u64), Holder>,
    /// The current sweep's number.
    sweep: u64,
}

#[derive(Debug)]
struct Known {
    /// The last sweep that looked at the process.
    seen: u64,
    /// `None` where `stat` could not be read: nothing is kept then.
    start: Option<u64>,
    /// Whether `stat`, as read this sweep, says all of it is exiting.
    exiting: bool,
    /// The thread its files are read through, as `stat` said this sweep.
    thread: u32,
    /// What each file said, once it could be read.
    mounted: Option<Mounted>,
    owner: Option<Option<Owner>>,
}

/// What a slot holder's cgroup said.
#[derive(Debug)]
struct Holder {
    /// The accounting file whose slot it holds: a slot elsewhere that
    /// names the same PID and start time is read for itself.
    file: PathBuf,
    seen: u64,
    /// `None` where the cgroup could not be read: not kept past the sweep.
    owner: Option<Option<Owner>>,
}

/// In unit tests, a closure giving each file's text.
#[cfg(test)]
impl<F: Fn(u32, &str) -> Option<String>> ProcFiles for F {
    fn proc_stat(&self, pid: u32) -> Option<crate::node::processes::ProcStat> {
        let stat = self(pid, "stat")?;
        Some(crate::node::processes::ProcStat {
            start: gpumem_layout::protocol::start_time_in_stat(&stat)?,
            exiting: crate::node::processes::exiting_in_stat(&stat),
            thread: pid,
        })
    }

    fn proc_lines(
        &self,
        pid: u32,
        _thread: u32,
        name: &str,
        each: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Option<Read> {
        for line in self(pid, name)?.lines() {
            if each(line).is_break() {
                return Some(Read::Stopped);
            }
        }
        Some(Read::Whole)
    }
}

impl Identities {
    /// Starts a sweep that reads what `/proc` says through `source`;
    /// processes the sweep before did not look at are forgotten.
    pub(crate) fn sweep<'a>(&'a mut self, source: &'a dyn ProcFiles) -> Sweep<'a> {
        let last = self.sweep;
        self.known.retain(|_, known| known.seen == last);
        // A slot names start time 0 where its shim could not read one.
        self.holders.retain(|&(_, start), holder| {
            start != 0 && holder.seen == last && holder.owner.is_some()
        });
        self.sweep += 1;
        Sweep {
            identities: self,
            source,
        }
    }
}

/// One sweep's reads (see [`Identities`]).
pub(crate) struct Sweep<'a> {
    identities: &'a mut Identities,
    source: &'a dyn ProcFiles,
}

impl Sweep<'_> {
    /// What a listed process's mount table says, read once.
    fn mounts(&mut self, pid: u32) -> Option<&Mounted> {
        let source = self.source;
        let known = known(self.identities, source, pid);
        if known.mounted.is_none() {
            let mut scan = MountScan::default();
            let read = source.proc_lines(pid, known.thread, "mountinfo", &mut |line| {
                scan.line(line);
                ControlFlow::Continue(())
            });
            known.mounted = read.map(|read| scan.finish(read == Read::Whole));
        }
        known.mounted.as_ref()
    }

    /// The container directories a listed process has at the shim's state
    /// path, in the order the shim reads their files.
    pub(crate) fn mounted(&mut self, pid: u32) -> &[String] {
        self.mounts(pid).map_or(&[], |m| &m.at_state_path)
    }

    /// The container directories a listed process has mounted anywhere
    /// else (see [`Mounted::elsewhere`]).
    pub(crate) fn mounted_elsewhere(&mut self, pid: u32) -> &[String] {
        self.mounts(pid).map_or(&[], |m| &m.elsewhere)
    }

    /// Whether a listed process's whole mount table was read (after
    /// [`Sweep::mounted`]): an empty list then means it has no gpumem
    /// mount, not that it could not be read, or was read only in part.
    pub(crate) fn mounts_read(&mut self, pid: u32) -> bool {
        let known = known(self.identities, self.source, pid);
        known.mounted.as_ref().is_some_and(|m| m.whole)
    }

    /// Whether all of a listed process is exiting: the kernel dropped its
    /// record locks with its files, but the driver frees its memory only
    /// later in the exit, and meanwhile NVML still lists it, while its
    /// mount table can no longer be read. A leader that exited alone is
    /// not: its other threads run on with the process's memory and files.
    /// Its start time, where it is exiting.
    pub(crate) fn exiting(&mut self, pid: u32) -> Option<u64> {
        let known = known(self.identities, self.source, pid);
        known.start.filter(|_| known.exiting)
    }

    /// The pod and container a listed process's cgroup names.
    pub(crate) fn owner(&mut self, pid: u32) -> Option<Owner> {
        let source = self.source;
        let known = known(self.identities, source, pid);
        if known.owner.is_none() {
            known.owner = read_owner(source, pid, known.thread);
        }
        known.owner.clone().flatten()
    }

    /// The pod and container a slot holder's cgroup names: `pid` holds a
    /// slot of `file` that names `start` as its owner's start time.
    pub(crate) fn holder_owner(&mut self, file: &Path, pid: u32, start: u64) -> Option<Owner> {
        let sweep = self.identities.sweep;
        let source = self.source;
        let holder = match self.identities.holders.entry((pid, start)) {
            Entry::Occupied(entry) if entry.get().file == file => entry.into_mut(),
            entry => {
                let mut owner = read_owner(source, pid, pid);
                if !owner.as_ref().is_some_and(Option::is_some) {
                    // A leader that exited alone: its cgroup reads `/` on
                    // cgroup v1. Read again through a thread that runs.
                    let thread = source.proc_stat(pid).map_or(pid, |stat| stat.thread);
                    if thread != pid {
                        owner = read_owner(source, pid, thread);
                    }
                }
                let holder = Holder {
                    file: file.to_owned(),
                    seen: sweep,
                    owner,
                };
                entry.insert_entry(holder).into_mut()
            }
        };
        holder.seen = sweep;
        holder.owner.clone().flatten()
    }
}

/// What is known of `pid` this sweep: what the last sweep knew, where its
/// start time is the same.
fn known<'a>(identities: &'a mut Identities, source: &dyn ProcFiles, pid: u32) -> &'a mut Known {
    let sweep = identities.sweep;
    let known = identities.known.entry(pid).or_insert(Known {
        seen: 0,
        start: None,
        exiting: false,
        thread: pid,
        mounted: None,
        owner: None,
    });
    if known.seen != sweep {
        let stat = source.proc_stat(pid);
        known.exiting = stat.is_some_and(|stat| stat.exiting);
        known.thread = stat.map_or(pid, |stat| stat.thread);
        let start = stat.map(|stat| stat.start);
        if start.is_none() || start != known.start {
            known.start = start;
            known.mounted = None;
            known.owner = None;
        }
        known.seen = sweep;
    }
    known
}

fn owner_of_path(path: &str) -> Option<Owner> {
    let mut segments = path.split('/');
    let pod_uid = segments.by_ref().find_map(pod_uid_of)?;
    // The first segment below the pod's is its container's.
    let container_id = segments.next().and_then(container_id_of);
    Some(Owner {
        pod_uid,
        container_id,
    })
}

/// `pod<uid>` (cgroupfs) or `kubepods[-<qos>]-pod<uid with _>.slice`.
fn pod_uid_of(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".slice").unwrap_or(segment);
    // The UID is the name's last 36 characters (no "pod" fits in one):
    // looked at first, as most segments are not a pod's.
    let (before, uid) = name.split_at_checked(name.len().checked_sub(36)?)?;
    let before = before.strip_suffix("pod")?;
    if !(before.is_empty() || before.starts_with("kubepods")) {
        return None;
    }
    let uid = uid.replace('_', "-");
    is_uid(&uid).then_some(uid)
}

/// `<id>`, `cri-containerd-<id>.scope`, `crio-<id>[.scope]` or
/// `docker-<id>.scope`; CRI-O's `crio-conmon-<id>` is its monitor, no
/// container's process.
fn container_id_of(segment: &str) -> Option<String> {
    let name = segment.strip_suffix(".scope").unwrap_or(segment);
    let id = ["cri-containerd-", "crio-", "docker-"]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))
        .unwrap_or(name);
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_owned())
}

/// 8-4-4-4-12 hex digits.
fn is_uid(text: &str) -> bool {
    text.len() == 36
        && text.bytes().enumerate().all(|(at, b)| match at {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::processes::proc_lines;

    const UID: &str = "0a1b2c3d-4e5f-4678-9abc-def012345678";
    const UNDERSCORED: &str = "0a1b2c3d_4e5f_4678_9abc_def012345678";
    const ID: &str = "5f2c6a1b9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a";

    fn owner(container: bool) -> Option<Owner> {
        Some(Owner {
            pod_uid: UID.into(),
            container_id: container.then(|| ID.into()),
        })
    }

    #[test]
    fn every_driver_and_runtime_layout() {
        let layouts = [
            // cgroup v2, systemd driver: containerd, CRI-O, cri-dockerd.
            format!("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UNDERSCORED}.slice/cri-containerd-{ID}.scope\n"),
            format!("0::/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/crio-{ID}.scope\n"),
            format!("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UNDERSCORED}.slice/docker-{ID}.scope\n"),
            // cgroup v2, cgroupfs driver: containerd, CRI-O.
            format!("0::/kubepods/burstable/pod{UID}/{ID}\n"),
            format!("0::/kubepods/pod{UID}/crio-{ID}\n"),
            // cgroup v1: a line per hierarchy.
            format!(
                "12:pids:/kubepods/besteffort/pod{UID}/{ID}\n\
                 11:memory:/kubepods/besteffort/pod{UID}/{ID}\n\
                 1:name=systemd:/kubepods/besteffort/pod{UID}/{ID}\n\
                 0::/\n"
            ),
            // Seen from the daemon's own cgroup namespace.
            format!("0::/../../kubepods-burstable-pod{UNDERSCORED}.slice/cri-containerd-{ID}.scope\n"),
            // A container nested in the pod's container is the outer one's.
            format!("0::/kubepods/burstable/pod{UID}/{ID}/docker/{}\n", "e".repeat(64)),
        ];
        for text in &layouts {
            assert_eq!(parse(text), owner(true), "{text}");
        }
    }

    #[test]
    fn pod_level_processes_and_host_processes() {
        // The pod's own cgroup (the pause process) and CRI-O's monitor.
        assert_eq!(
            parse(&format!("0::/kubepods/burstable/pod{UID}\n")),
            owner(false)
        );
        assert_eq!(
            parse(&format!(
                "0::/kubepods.slice/kubepods-pod{UNDERSCORED}.slice/crio-conmon-{ID}.scope\n"
            )),
            owner(false)
        );
        for host in [
            "0::/system.slice/containerd.service\n",
            "0::/user.slice/user-0.slice/session-3.scope\n",
            "0::/\n",
            "",
            "garbage",
            // A name that merely contains "pod".
            "0::/system.slice/podman-1234.scope\n",
            "0::/kubepods/burstable/podnot-a-uid/abc\n",
            // Not quite a UID.
            "0::/kubepods/burstable/pod0a1b2c3d-4e5f-4678-9abc-def01234567/abc\n",
            "0::/kubepods/burstable/pod0a1b2c3d-4e5f-4678-9abc-def012345678x/abc\n",
            "0::/kubepods/burstable/pod0a1b2c3d-4e5f-4678-9abc-def01234567g/abc\n",
            "0::/kubepods/burstable/pod0a1b2c3d-4e5f4-678-9abc-def012345678/abc\n",
            "0::/kubepods/burstable/xpod0a1b2c3d-4e5f-4678-9abc-def012345678/abc\n",
        ] {
            assert_eq!(parse(host), None, "{host:?}");
        }
    }

    /// The gpumem container directories at the shim's state path of a
    /// whole `/proc/<pid>/mountinfo`.
    fn mounted_containers(mountinfo: &str) -> Vec<String> {
        let mut scan = MountScan::default();
        mountinfo.lines().for_each(|line| scan.line(line));
        scan.finish(true).at_state_path
    }

    #[test]
    fn the_state_mount_names_the_container() {
        let name = "a1b2c3d4e5f6-4u-0123456789abcdef";
        for root in [
            format!("/var/lib/gpumem/containers/{name}"),
            // The state directory on a file system of its own.
            format!("/containers/{name}"),
        ] {
            let mountinfo = format!(
                "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
                 2 1 8:1 {root} /var/run/gpumem rw - ext4 /dev/sda1 rw\n"
            );
            assert_eq!(mounted_containers(&mountinfo), [name]);
        }
        // Where `/var/run` links to `/run` in the image, as in most.
        let mountinfo = format!(
            "2 1 8:1 /var/lib/gpumem/containers/{name} /run/gpumem rw - ext4 /dev/sda1 rw\n"
        );
        assert_eq!(mounted_containers(&mountinfo), [name]);
        // The directory on a tmpfs of its own (statefs): named by the
        // tmpfs's source, and only a tmpfs's.
        let mountinfo = format!(
            "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
             2 1 0:61 / /var/run/gpumem rw,nosuid master:3 - tmpfs gpumem-state:{name} rw,size=106496k\n"
        );
        assert_eq!(mounted_containers(&mountinfo), [name]);
        let other = format!("2 1 0:61 / /var/run/gpumem rw - ext4 gpumem-state:{name} rw\n");
        assert!(mounted_containers(&other).is_empty());
        // A host process, and mounts elsewhere.
        assert!(mounted_containers("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n").is_empty());
        for point in [
            "/mnt",
            "/var/run/gpumem/claim-a/b",
            "/var/run/gpumemx/claim-a",
            "/run/gpumem/a",
        ] {
            assert!(
                mounted_containers(&format!(
                    "2 1 8:1 /x/containers/{name} {point} rw - ext4 a rw\n"
                ))
                .is_empty(),
                "{point}"
            );
        }
    }

    #[test]
    fn a_state_mount_elsewhere_is_known_by_what_it_mounts() {
        let name = "a1b2c3d4e5f6-4u-0123456789abcdef";
        let mut scan = MountScan::default();
        // An image whose /var/run links to /srv/run: the runtime mounted
        // the state path under the link's target.
        scan.line(&format!(
            "2 1 8:1 /var/lib/gpumem/containers/{name} /srv/run/gpumem rw - ext4 /dev/sda1 rw"
        ));
        scan.line("3 1 0:61 / /srv/run/gpumem/claim-b rw - tmpfs gpumem-state:claim-b rw");
        // Mounts of no gpumem directory.
        scan.line("4 1 8:1 /var/lib/docker/containers/x/hostname /etc/hostname rw - ext4 a rw");
        scan.line("5 1 0:62 / /x rw - tmpfs tmpfs rw");
        scan.line("6 1 0:62 / /y rw - ext4 gpumem-state:c rw");
        let mounted = scan.finish(false);
        assert!(mounted.at_state_path.is_empty());
        assert_eq!(mounted.elsewhere, [name, "claim-b"]);
        assert!(!mounted.whole);
        // A table that names more directories than a runtime mounts: the
        // first are kept, once each.
        let mut scan = MountScan::default();
        for n in 0..2 * MOUNTED_AT_MOST {
            for _ in 0..2 {
                scan.line(&format!(
                    "{n} 1 8:1 /containers/d{n:03} /var/run/gpumem rw - ext4 a rw"
                ));
            }
        }
        let kept = scan.finish(true).at_state_path;
        assert_eq!(kept.len(), MOUNTED_AT_MOST);
        assert_eq!(kept[0], "d000");
    }

    #[test]
    fn a_container_with_several_claims_names_each_in_the_shims_order() {
        let mountinfo = "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
             3 1 8:1 /var/lib/gpumem/containers/claim-b /run/gpumem/claim-b rw - ext4 a rw\n\
             4 1 8:1 /var/lib/gpumem/containers/claim-a /run/gpumem/claim-a rw - ext4 a rw\n\
             5 1 8:1 /var/lib/gpumem/containers/own /run/gpumem rw - ext4 a rw\n";
        assert_eq!(mounted_containers(mountinfo), ["own", "claim-a", "claim-b"]);
    }

    /// A `/proc` whose files tests change, counting what is read.
    #[derive(Default)]
    struct Proc {
        files: std::cell::RefCell<HashMap<(u32, &'static str), String>>,
        reads: std::cell::RefCell<Vec<(u32, String)>>,
    }

    impl Proc {
        fn set(&self, pid: u32, name: &'static str, text: &str) {
            self.files.borrow_mut().insert((pid, name), text.to_owned());
        }

        fn remove(&self, pid: u32, name: &'static str) {
            self.files.borrow_mut().remove(&(pid, name));
        }

        fn read(&self, pid: u32, name: &str) -> Option<String> {
            self.reads.borrow_mut().push((pid, name.to_owned()));
            let files = self.files.borrow();
            files
                .iter()
                .find(|((p, n), _)| *p == pid && *n == name)
                .map(|(_, t)| t.clone())
        }

        /// The reads since the last call, in order.
        fn taken(&self) -> Vec<(u32, String)> {
            std::mem::take(&mut *self.reads.borrow_mut())
        }

        /// `/proc/<pid>/stat` of a process started at `start`.
        fn start(&self, pid: u32, start: u64) {
            let fields: Vec<String> = (3..22).map(|f| f.to_string()).collect();
            self.set(
                pid,
                "stat",
                &format!("{pid} (python3) {} {start} 0\n", fields.join(" ")),
            );
        }
    }

    fn mounts(name: &str) -> String {
        format!("2 1 8:1 /var/lib/gpumem/containers/{name} /var/run/gpumem rw - ext4 a rw\n")
    }

    fn reads(expected: &[(u32, &str)]) -> Vec<(u32, String)> {
        expected.iter().map(|&(p, n)| (p, n.to_owned())).collect()
    }

    #[test]
    fn a_process_is_read_once_while_its_start_time_holds() {
        let proc = Proc::default();
        let read = |pid, name: &str| proc.read(pid, name);
        let mut identities = Identities::default();
        let container = format!("0::/kubepods/pod{UID}/{ID}\n");
        proc.start(10, 100);
        proc.set(10, "mountinfo", &mounts("a"));
        proc.set(10, "cgroup", &container);

        // First sweep: its start time, then each file once, however often asked.
        let mut sweep = identities.sweep(&read);
        for _ in 0..2 {
            assert_eq!(sweep.mounted(10), ["a"]);
            assert_eq!(sweep.owner(10), owner(true));
        }
        assert_eq!(
            proc.taken(),
            reads(&[(10, "stat"), (10, "mountinfo"), (10, "cgroup")])
        );
        // The next sweeps read its start time only.
        for _ in 0..2 {
            let mut sweep = identities.sweep(&read);
            assert_eq!(sweep.mounted(10), ["a"]);
            assert_eq!(sweep.owner(10), owner(true));
            assert_eq!(proc.taken(), reads(&[(10, "stat")]));
        }
        // Its PID taken by a new process: read afresh.
        proc.start(10, 200);
        proc.set(10, "mountinfo", &mounts("b"));
        proc.set(10, "cgroup", "0::/system.slice/x.service\n");
        let mut sweep = identities.sweep(&read);
        assert_eq!(sweep.mounted(10), ["b"]);
        assert_eq!(sweep.owner(10), None);
        assert_eq!(
            proc.taken(),
            reads(&[(10, "stat"), (10, "mountinfo"), (10, "cgroup")])
        );
        // A sweep that does not look at it forgets it.
        identities.sweep(&read);
        let mut sweep = identities.sweep(&read);
        assert_eq!(sweep.mounted(10), ["b"]);
        assert_eq!(proc.taken(), reads(&[(10, "stat"), (10, "mountinfo")]));
    }

    #[test]
    fn what_cannot_be_read_is_read_again() {
        let proc = Proc::default();
        let read = |pid, name: &str| proc.read(pid, name);
        let mut identities = Identities::default();
        // No start time (the process is gone, or stat is hidden): nothing is
        // kept from one sweep to the next.
        proc.set(11, "mountinfo", &mounts("a"));
        for _ in 0..2 {
            let mut sweep = identities.sweep(&read);
            assert_eq!(sweep.mounted(11), ["a"]);
            assert_eq!(proc.taken(), reads(&[(11, "stat"), (11, "mountinfo")]));
        }
        // A file that could not be read is not taken to say nothing.
        proc.start(12, 300);
        let mut sweep = identities.sweep(&read);
        assert!(sweep.mounted(12).is_empty());
        proc.set(12, "mountinfo", &mounts("a"));
        assert_eq!(sweep.mounted(12), ["a"]);
        assert_eq!(
            proc.taken(),
            reads(&[(12, "stat"), (12, "mountinfo"), (12, "mountinfo")])
        );
        proc.remove(12, "mountinfo");
        let mut sweep = identities.sweep(&read);
        assert_eq!(sweep.mounted(12), ["a"], "kept: same process");
    }

    #[test]
    fn a_slot_holder_is_read_once_while_its_slot_names_the_same_start() {
        let proc = Proc::default();
        let read = |pid, name: &str| proc.read(pid, name);
        let mut identities = Identities::default();
        let (a, b) = (Path::new("/s/a/accounting"), Path::new("/s/b/accounting"));
        proc.set(13, "cgroup", &format!("0::/kubepods/pod{UID}/{ID}\n"));
        // Read at the first sweep, however often asked; not at the next.
        for expected in [reads(&[(13, "cgroup")]), vec![]] {
            let mut sweep = identities.sweep(&read);
            assert_eq!(sweep.holder_owner(a, 13, 100), owner(true));
            assert_eq!(sweep.holder_owner(a, 13, 100), owner(true));
            assert_eq!(proc.taken(), expected);
        }
        // A new process with the PID (its slot names another start time),
        // or the same one holding a slot elsewhere: read for itself.
        proc.set(13, "cgroup", "0::/system.slice/x.service\n");
        let mut sweep = identities.sweep(&read);
        assert_eq!(sweep.holder_owner(a, 13, 200), None);
        assert_eq!(sweep.holder_owner(b, 13, 100), None);
        assert_eq!(
            proc.taken(),
            reads(&[(13, "cgroup"), (13, "stat"), (13, "cgroup"), (13, "stat")])
        );
        // A sweep that does not ask forgets; a slot without a start time,
        // or a cgroup that could not be read, is read once a sweep.
        identities.sweep(&read);
        for _ in 0..2 {
            let mut sweep = identities.sweep(&read);
            assert_eq!(sweep.holder_owner(a, 13, 0), None);
            assert_eq!(sweep.holder_owner(a, 13, 0), None);
            assert_eq!(proc.taken(), reads(&[(13, "cgroup"), (13, "stat")]));
        }
        proc.remove(13, "cgroup");
        for _ in 0..2 {
            let mut sweep = identities.sweep(&read);
            assert_eq!(sweep.holder_owner(a, 13, 200), None);
            assert_eq!(sweep.holder_owner(a, 13, 200), None);
            assert_eq!(proc.taken(), reads(&[(13, "cgroup"), (13, "stat")]));
        }
    }

    #[test]
    fn reads_under_a_proc_root() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("4242");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("cgroup"), format!("0::/kubepods/pod{UID}/{ID}\n")).unwrap();
        let read = |pid| {
            let mut owner = None;
            proc_lines(root.path(), pid, pid, "cgroup", &mut |line| {
                owner = owner_of_line(line);
                ControlFlow::Continue(())
            })?;
            owner
        };
        assert_eq!(read(4242), owner(true));
        assert_eq!(read(4243), None, "gone");
    }
}
