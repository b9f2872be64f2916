//! The file system under each container's state directory: a tmpfs of its
//! own, sized for its accounting file, so what a container writes there is
//! bounded and lands on no host disk (docs/SECURITY.md, "The state directory").

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};

/// How the containers' state directories are backed; decided once, when a
/// daemon starts ([`StateFs::detect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StateFs {
    /// A tmpfs per directory, mounted where the container runtime sees it:
    /// a container can write at most [`size_for`] bytes there, in memory
    /// charged to whoever writes it, never on the host's disk.
    Tmpfs,
    /// Plain directories on the state dir's file system: a container can
    /// fill it (`gpumem exec`, the demo, and a daemon that may not mount).
    #[default]
    Shared,
}

/// Whether a daemon bounds the containers' state directories
/// (`--bound-state-dirs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bounding {
    /// Never: plain directories, as `gpumem exec`, the demo and in-process
    /// daemons (tests) keep them.
    #[default]
    Off,
    /// Where it can ([`StateFs::detect`]); else plain, said at start.
    Auto,
    /// Or the daemon does not start.
    Require,
}

/// The tmpfs's source, which every mount table that shows it names:
/// `gpumem-state:<directory name>`, so a container's processes are still
/// found by their mounts (`identity::MountScan`).
pub const SOURCE_PREFIX: &str = "gpumem-state:";

/// Inodes a directory's tmpfs may hold: its root, the accounting file and
/// the staging file a replacement writes beside it, and one to spare.
const INODES: u32 = 4;
const PAGE: u64 = 4096;

/// The tmpfs size for an accounting file of `file_len` bytes: room for the
/// file and the staging copy a replacement writes beside it, in whole pages.
pub fn size_for(file_len: usize) -> u64 {
    2 * (file_len as u64).div_ceil(PAGE) * PAGE
}

impl StateFs {
    /// `Tmpfs` where this process may mount a tmpfs under `containers` and
    /// the mount reaches the mount namespace the container runtime works
    /// in; else `Shared`, with the reason. A mount that stayed in a
    /// namespace of our own would hide the accounting file from the
    /// containers, so propagation is checked before anything is mounted.
    pub fn detect(containers: &Path) -> (StateFs, Option<String>) {
        if let Err(err) = std::fs::create_dir_all(containers) {
            return (
                StateFs::Shared,
                Some(format!("cannot create {}: {err}", containers.display())),
            );
        }
        match reaches_host(containers) {
            Ok(true) => {}
            Ok(false) => {
                return (
                    StateFs::Shared,
                    Some(format!(
                        "mounts under {} do not reach the host (the state volume needs \
                         mountPropagation: Bidirectional)",
                        containers.display()
                    )),
                )
            }
            Err(err) => {
                return (
                    StateFs::Shared,
                    Some(format!("cannot read this process's mount table: {err}")),
                )
            }
        }
        let check = containers.join(".mount-check");
        let mounted = std::fs::create_dir_all(&check)
            .and_then(|()| mount_tmpfs(&check, "mount-check", PAGE))
            .and_then(|()| unmount(&check));
        let _ = std::fs::remove_dir(&check);
        match mounted {
            Ok(()) => (StateFs::Tmpfs, None),
            Err(err) => (
                StateFs::Shared,
                Some(format!(
                    "mounting a tmpfs under {} failed ({err}; it needs CAP_SYS_ADMIN: \
                     privileged: true in the DaemonSet)",
                    containers.display()
                )),
            ),
        }
    }
}

/// Refused by `--bound-state-dirs require`.
#[derive(Debug, thiserror::Error)]
#[error(
    "--bound-state-dirs require: cannot bound the containers' state directories: {0}; \
     run the daemon privileged with mountPropagation: Bidirectional on its state volume \
     (the manifests and the chart do), or pass --bound-state-dirs auto or off"
)]
pub struct Unbounded(pub String);

impl Bounding {
    /// What the state directories under `containers` are on: `Err` only
    /// for `Require` where they cannot be bounded; the reason they are not
    /// bounded beside `Shared`.
    pub fn resolve(self, containers: &Path) -> Result<(StateFs, Option<String>), Unbounded> {
        match self {
            Bounding::Off => Ok((StateFs::Shared, Some("--bound-state-dirs off".to_owned()))),
            Bounding::Auto => Ok(StateFs::detect(containers)),
            Bounding::Require => match StateFs::detect(containers) {
                (_, Some(reason)) => Err(Unbounded(reason)),
                found => Ok(found),
            },
        }
    }
}

/// Whether `dir` is the root of a file system mounted on its parent's.
pub fn is_mount_point(dir: &Path) -> io::Result<bool> {
    let parent = dir.parent().unwrap_or(Path::new("/"));
    Ok(std::fs::symlink_metadata(dir)?.dev() != std::fs::metadata(parent)?.dev())
}

/// Mounts a tmpfs of `size` bytes at `dir`, named after the directory.
pub fn mount_bounded(dir: &Path, size: u64) -> io::Result<()> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no directory name"))?;
    mount_tmpfs(dir, name, size)
}

fn mount_tmpfs(dir: &Path, name: &str, size: u64) -> io::Result<()> {
    // Files only: nothing there is run, nor a device.
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let options = format!("size={size},nr_inodes={INODES},mode=755");
    mount(
        Some(format!("{SOURCE_PREFIX}{name}").as_str()),
        dir,
        Some("tmpfs"),
        flags,
        Some(options.as_str()),
    )
    .map_err(io::Error::from)
}

/// Detaches the file system mounted at `dir`, if one is: containers that
/// still have it mounted keep it until they end. Nothing mounted there (or
/// no `dir`) is not an error, and asks for no privilege: a daemon that
/// may not mount removes plain directories all the same.
pub fn unmount(dir: &Path) -> io::Result<()> {
    match is_mount_point(dir) {
        Ok(true) => {}
        Ok(false) => return Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(err),
    }
    match umount2(dir, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()),
        Err(err) => Err(err.into()),
    }
}

/// Whether a mount made at `path` reaches the runtime's mount namespace:
/// this process is in the host's (PID 1's, where that can be read), or the
/// mount `path` is on propagates to its peers (`shared:`), as a volume
/// with `mountPropagation: Bidirectional` does.
fn reaches_host(path: &Path) -> io::Result<bool> {
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt"));
    if let (Ok(ours), Ok(host)) = (ns("self"), ns("1")) {
        if ours == host {
            return Ok(true);
        }
    }
    let path = path.canonicalize()?;
    let table = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(propagates(&table, &path))
}

/// Whether the mount in `mountinfo` that `path` is on (the last one mounted
/// at the longest mount point above it) is shared with peers.
fn propagates(mountinfo: &str, path: &Path) -> bool {
    let mut best: Option<(usize, bool)> = None;
    for line in mountinfo.lines() {
        // ID, parent ID, major:minor, root, mount point, options, optional
        // fields…, "-", …
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(point) = fields.get(4).map(|p| PathBuf::from(unescape(p))) else {
            continue;
        };
        if !path.starts_with(&point) {
            continue;
        }
        let shared = fields
            .iter()
            .skip(6)
            .take_while(|f| **f != "-")
            .any(|f| f.starts_with("shared:"));
        let depth = point.components().count();
        if best.is_none_or(|(d, _)| depth >= d) {
            best = Some((depth, shared));
        }
    }
    best.is_some_and(|(_, shared)| shared)
}

/// A mount table's path, whose space, tab, newline and backslash the
/// kernel writes as octal escapes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_and_its_staging_copy_fit_in_whole_pages() {
        let len = gpumem_layout::file_len(1, gpumem_layout::DEFAULT_SLOTS as usize);
        let size = size_for(len);
        assert!(size >= 2 * len as u64 && size < 2 * len as u64 + 2 * PAGE);
        assert_eq!(size % PAGE, 0);
    }

    #[test]
    fn off_never_looks_at_the_state_dir() {
        let (fs, why) = Bounding::Off
            .resolve(Path::new("/nonexistent/containers"))
            .unwrap();
        assert_eq!(fs, StateFs::Shared);
        assert!(why.is_some_and(|w| w.contains("off")));
    }

    #[test]
    fn only_a_shared_mount_under_the_state_dir_propagates() {
        let table = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                     30 22 0:40 / /var/lib/gpumem rw master:1 - ext4 /dev/sda1 rw\n";
        assert!(!propagates(table, Path::new("/var/lib/gpumem/containers")));
        assert!(propagates(table, Path::new("/var/lib/other")));
        let table =
            format!("{table}31 30 0:40 / /var/lib/gpumem rw shared:7 master:1 - ext4 a rw\n");
        assert!(propagates(&table, Path::new("/var/lib/gpumem/containers")));
        // A prefix of a name is not a parent.
        assert!(!propagates(
            "30 1 0:40 / /var/lib/gpumem rw shared:2 - ext4 a rw\n",
            Path::new("/var/lib/gpumem2/containers")
        ));
        let spaced = "30 1 0:40 / /state\\040dir rw shared:2 - ext4 a rw\n";
        assert!(propagates(spaced, Path::new("/state dir/containers")));
    }
}
