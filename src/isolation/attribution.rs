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

use std::path::Path;

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
    // v2 has one line `0::<path>`; v1 one line per hierarchy, all of which
    // kubelet puts the container in: the first that names a pod decides.
    cgroup
        .lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .find_map(owner_of_path)
}

/// The gpumem container directory a process's mount table has at the
/// shim's state path (`/var/run/gpumem`), from the contents of its
/// `/proc/<pid>/mountinfo`: Allocate mounted it there, so every process of
/// the container has it, loaded the shim or not, and an unprivileged
/// container cannot change it. The name is the directory's under
/// `<state-dir>/containers`.
pub fn mounted_container(mountinfo: &str) -> Option<String> {
    mountinfo.lines().find_map(|line| {
        // ID, parent ID, major:minor, root, mount point, …
        let mut fields = line.split(' ');
        let root = fields.nth(3)?;
        let point = fields.next()?;
        if point != gpumem_layout::CONTAINER_DIR {
            return None;
        }
        let (parent, name) = root.rsplit_once('/')?;
        (parent.ends_with("/containers") || parent == "/containers").then(|| name.to_owned())
    })
}

/// The text of `<proc_root>/<pid>/<name>` (`/proc` on a node); `None` once
/// the process is gone.
pub fn proc_file(proc_root: &Path, pid: u32, name: &str) -> Option<String> {
    std::fs::read_to_string(proc_root.join(pid.to_string()).join(name)).ok()
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
    let (before, uid) = name.rsplit_once("pod")?;
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
    let groups: Vec<&str> = text.split('-').collect();
    groups.len() == 5
        && groups
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(g, len)| g.len() == len && g.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        ] {
            assert_eq!(parse(host), None, "{host:?}");
        }
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
            assert_eq!(mounted_container(&mountinfo).as_deref(), Some(name));
        }
        // A host process, and a mount elsewhere.
        assert_eq!(
            mounted_container("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"),
            None
        );
        assert_eq!(
            mounted_container(&format!(
                "2 1 8:1 /x/containers/{name} /mnt rw - ext4 a rw\n"
            )),
            None
        );
    }

    #[test]
    fn reads_under_a_proc_root() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("4242");
        std::fs::create_dir(&dir).unwrap();
        std::fs::write(dir.join("cgroup"), format!("0::/kubepods/pod{UID}/{ID}\n")).unwrap();
        let read = |pid| parse(&proc_file(root.path(), pid, "cgroup")?);
        assert_eq!(read(4242), owner(true));
        assert_eq!(read(4243), None, "gone");
    }
}
