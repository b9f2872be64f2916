//! Per-container accounting files for the shim: created and sized here (at
//! Allocate, or by `gpumem exec`), so caps are owned by the plugin and never
//! by whichever process starts first.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use gpumem_layout::{self as layout, DeviceSpec};

const MIB: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum AccountingError {
    #[error("GPU UUID {0:?} is not in the GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx form")]
    BadUuid(String),
    #[error("a container can be capped on at most {max} GPUs, not {count}")]
    TooManyGpus { count: usize, max: usize },
    #[error("cannot write accounting state in {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
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
/// same caps is kept (its processes may be running: kubelet can call
/// Allocate again for a live container); anything else is replaced
/// atomically, so no process ever maps a half-written file.
pub fn prepare(dir: &Path, caps: &[Cap]) -> Result<PathBuf, AccountingError> {
    let devices = specs(caps)?;
    let io_err = |source| AccountingError::Io {
        path: dir.to_owned(),
        source,
    };
    fs::create_dir_all(dir).map_err(io_err)?;
    // Readable by the container's processes whatever their uid.
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(io_err)?;
    let path = dir.join(layout::FILE_NAME);
    if let Ok(existing) = fs::read(&path) {
        if layout::validate(&existing).is_ok_and(|g| layout::devices(&existing, g) == devices) {
            return Ok(path);
        }
    }
    // A unique staging file: concurrent Allocate calls must not share one.
    let write = || -> io::Result<()> {
        let mut staging = tempfile::Builder::new()
            .prefix(".accounting.")
            .tempfile_in(dir)?;
        staging.write_all(&layout::encode(&devices, layout::DEFAULT_SLOTS))?;
        staging.as_file().sync_all()?;
        // Opened read-write by processes of any uid in the container: the
        // shim's record locks need write access.
        staging
            .as_file()
            .set_permissions(fs::Permissions::from_mode(0o666))?;
        staging.persist(&path).map_err(|e| e.error)?;
        Ok(())
    };
    write().map_err(|source| AccountingError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// Usage figures read from an accounting file: per device, in the order of
/// the caps it was prepared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Usage {
    pub uuid: String,
    pub cap_bytes: u64,
    pub used_bytes: u64,
}

/// Reads current usage (sum of live and not-yet-reaped slots plus the
/// daemon-observed extra).
pub fn usage(path: &Path) -> io::Result<Vec<Usage>> {
    let bytes = fs::read(path)?;
    let geometry =
        layout::validate(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let used = layout::used_bytes(&bytes, geometry);
    Ok(layout::devices(&bytes, geometry)
        .into_iter()
        .zip(used)
        .map(|(d, used_bytes)| Usage {
            uuid: layout::format_uuid(&d.uuid),
            cap_bytes: d.cap_bytes,
            used_bytes,
        })
        .collect())
}

/// Whether a live process still has a slot in the accounting file: its
/// record lock is held (the kernel drops it when the process dies).
pub fn has_live_process(path: &Path) -> io::Result<bool> {
    use nix::fcntl::{fcntl, FcntlArg};
    use nix::libc;
    use std::os::fd::AsFd;
    let file = fs::OpenOptions::new().read(true).write(true).open(path)?;
    let bytes = fs::read(path)?;
    let geometry =
        layout::validate(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let hwm = (layout::get_u32(&bytes, layout::header::SLOT_HWM) as usize).min(geometry.slots);
    for index in 0..hwm {
        let at = layout::slot_offset(geometry.devices, index);
        if layout::get_u64(&bytes, at + layout::slot::STATE) & 0xff != layout::state::ALIVE {
            continue;
        }
        let mut probe = libc::flock {
            l_type: libc::F_WRLCK as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: at as libc::off_t,
            l_len: 1,
            l_pid: 0,
        };
        fcntl(file.as_fd(), FcntlArg::F_GETLK(&mut probe)).map_err(io::Error::from)?;
        if probe.l_type != libc::F_UNLCK as libc::c_short {
            return Ok(true);
        }
    }
    Ok(false)
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
}
