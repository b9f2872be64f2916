//! Files gpumem writes whole (CDI specs, accounting files, the installed
//! shim, the DRA checkpoint): written beside the target and renamed over
//! it, so a reader sees the old file or the new one, never a part.

use std::fs;
use std::io::{self, Write as _};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Whether the new file is on disk before [`replace`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// fsynced before the rename.
    Synced,
    /// Left to the page cache: for what only a power cut or a kernel crash
    /// can lose, where the next boot makes it anew.
    Unsynced,
}

/// Replaces `target` with `bytes`, mode `mode` (whatever the umask), through
/// a uniquely named staging file `<prefix>XXXXXX<suffix>` in the same
/// directory: concurrent writers never share one, and a directory scan can
/// tell leftovers of a crash by the name. The directory must exist.
pub fn replace(
    target: &Path,
    bytes: &[u8],
    mode: u32,
    (prefix, suffix): (&str, &str),
    durability: Durability,
) -> io::Result<()> {
    let dir = match target.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    let mut staging = tempfile::Builder::new()
        .prefix(prefix)
        .suffix(suffix)
        .tempfile_in(dir)?;
    staging.write_all(bytes)?;
    staging
        .as_file()
        .set_permissions(fs::Permissions::from_mode(mode))?;
    if durability == Durability::Synced {
        staging.as_file().sync_all()?;
    }
    staging.persist(target).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    #[test]
    fn replaces_whole_with_the_mode_asked_and_leaves_no_staging_file() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("spec.json");
        fs::write(&target, "old").unwrap();
        // Held open, so its inode cannot be reused by a staging file.
        let old = fs::File::open(&target).unwrap();
        let old_inode = old.metadata().unwrap().ino();
        for (mode, durability) in [(0o644, Durability::Synced), (0o600, Durability::Unsynced)] {
            replace(&target, b"new", mode, (".spec.", ".tmp"), durability).unwrap();
            let meta = fs::metadata(&target).unwrap();
            assert_eq!(fs::read(&target).unwrap(), b"new");
            assert_eq!(meta.mode() & 0o777, mode);
            assert_ne!(
                meta.ino(),
                old_inode,
                "renamed over, not rewritten in place"
            );
        }
        drop(old);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["spec.json"]);
    }

    #[test]
    fn a_missing_directory_is_an_error_not_a_file_elsewhere() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("absent/spec.json");
        let err = replace(&target, b"x", 0o644, (".s", ""), Durability::Synced).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
