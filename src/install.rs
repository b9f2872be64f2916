//! `gpumem install-shim`: puts the shim and its one-line preload list into
//! the host directory that Allocate mounts into containers. Each file is
//! written beside its target and renamed over it, so a starting container
//! maps either the old library or the new one, never half of one.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::inject::{CONTAINER_SHIM_DIR, PRELOAD_LIST, SHIM_LIBRARY};

#[derive(Debug, thiserror::Error)]
#[error("cannot install {what} into {path}: {source}")]
pub struct InstallError {
    pub what: &'static str,
    pub path: PathBuf,
    pub source: io::Error,
}

/// What a capped container's /etc/ld.so.preload says.
pub fn preload_line() -> String {
    format!("{CONTAINER_SHIM_DIR}/{SHIM_LIBRARY}\n")
}

/// Installs `library` as `<dir>/libgpumem_shim.so` and writes
/// `<dir>/ld.so.preload`. Returns the installed library's path.
pub fn install(library: &Path, dir: &Path) -> Result<PathBuf, InstallError> {
    let bytes = fs::read(library).map_err(|source| InstallError {
        what: "the shim (reading it)",
        path: library.to_owned(),
        source,
    })?;
    let err = |what, path: &Path| {
        let path = path.to_owned();
        move |source| InstallError { what, path, source }
    };
    fs::create_dir_all(dir).map_err(err("the shim", dir))?;
    let target = dir.join(SHIM_LIBRARY);
    replace(&target, &bytes, 0o755).map_err(err("the shim", &target))?;
    let preload = dir.join(PRELOAD_LIST);
    replace(&preload, preload_line().as_bytes(), 0o644)
        .map_err(err("the preload list", &preload))?;
    Ok(target)
}

/// Writes `bytes` to a temporary file beside `target`, syncs it, and
/// renames it over `target`.
fn replace(target: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let dir = target.parent().unwrap_or(Path::new("."));
    let mut staging = tempfile::Builder::new()
        .prefix(".gpumem-install.")
        .tempfile_in(dir)?;
    staging.write_all(bytes)?;
    staging
        .as_file()
        .set_permissions(fs::Permissions::from_mode(mode))?;
    staging.as_file().sync_all()?;
    staging.persist(target).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn installs_by_rename_and_keeps_mapped_copies_intact() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("built.so");
        fs::write(&source, b"version 1").unwrap();
        let host = dir.path().join("host");
        let lib = install(&source, &host).unwrap();
        assert_eq!(fs::read(&lib).unwrap(), b"version 1");
        assert_eq!(
            fs::read_to_string(host.join("ld.so.preload")).unwrap(),
            "/usr/local/gpumem/libgpumem_shim.so\n"
        );
        // A running container holds the old file open; an upgrade must not change it.
        let held = fs::File::open(&lib).unwrap();
        let old_inode = held.metadata().unwrap().ino();
        fs::write(&source, b"version 2").unwrap();
        install(&source, &host).unwrap();
        assert_eq!(fs::read(&lib).unwrap(), b"version 2");
        assert_ne!(fs::metadata(&lib).unwrap().ino(), old_inode);
        assert_eq!(std::io::read_to_string(&held).unwrap(), "version 1");
        assert_eq!(
            fs::read_dir(&host).unwrap().count(),
            2,
            "no staging files left"
        );
        assert_eq!(fs::metadata(&lib).unwrap().mode() & 0o777, 0o755);
    }

    #[test]
    fn missing_source_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = install(&dir.path().join("nope.so"), dir.path()).unwrap_err();
        assert!(err.to_string().contains("nope.so"), "{err}");
    }
}
