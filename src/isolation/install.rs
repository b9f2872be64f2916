//! `gpumem install-shim`: puts the shim and its one-line preload list into
//! the host directory that Allocate mounts into containers, and checks that
//! a file offered as the shim is one before anything preloads it.
//!
//! Each file is written beside its target and renamed over it, so a
//! starting container maps either the old library or the new one, never
//! half of one.

use crate::error_text::one_line;
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use object::{Architecture, Object, ObjectKind, ObjectSymbol};

use crate::atomic_file::{self, Durability};

use crate::isolation::inject::{CONTAINER_SHIM_DIR, PRELOAD_LIST, SHIM_LIBRARY};

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    // Whole in its own text, not chained: callers show it with `{}`.
    #[error("--from: {}", crate::error_text::chain(.0))]
    Source(ShimError),
    #[error("cannot install {what} into {path}")]
    Write {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

/// A file offered as the shim that cannot be used as one.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error("cannot read the shim {path}")]
    Read { path: PathBuf, source: io::Error },
    #[error(
        "{path} is not the gpumem shim: {defect}. Preloaded, it would leave GPU memory \
         uncapped, so gpumem refuses it"
    )]
    NotShim { path: PathBuf, defect: ShimDefect },
}

/// Why a file is not the shim. The loader skips an unusable preload with at
/// most a warning and the process then runs uncapped, so these are checked
/// before a command runs or a node gets the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShimDefect {
    #[error("it is not an ELF file")]
    NotElf,
    #[error("it is an ELF file but not a shared library")]
    NotSharedLibrary,
    #[error("it is built for {found}, and this machine is {expected}")]
    WrongMachine { found: String, expected: String },
    #[error("its ELF structure is cut short or broken ({0})")]
    Malformed(String),
    #[error("it does not export {SHIM_MARK}, which only gpumem's shim does")]
    NotOurs,
}

/// What a capped container's /etc/ld.so.preload says.
pub fn preload_line() -> String {
    format!("{CONTAINER_SHIM_DIR}/{SHIM_LIBRARY}\n")
}

/// Installs `library` as `<dir>/libgpumem_shim.so` and writes
/// `<dir>/ld.so.preload`. Returns the installed library's path. Refuses a
/// `library` that is not the shim: every container on the node would
/// preload it.
pub fn install(library: &Path, dir: &Path) -> Result<PathBuf, InstallError> {
    let bytes = fs::read(library).map_err(|source| {
        InstallError::Source(ShimError::Read {
            path: library.to_owned(),
            source,
        })
    })?;
    // The bytes checked are the bytes installed.
    if let Err(defect) = shim_defect(&bytes) {
        return Err(InstallError::Source(ShimError::NotShim {
            path: library.to_owned(),
            defect,
        }));
    }
    let err = |what, path: &Path| {
        let path = path.to_owned();
        move |source| InstallError::Write { what, path, source }
    };
    fs::create_dir_all(dir).map_err(err("the shim", dir))?;
    let target = dir.join(SHIM_LIBRARY);
    replace(&target, &bytes, 0o755).map_err(err("the shim", &target))?;
    let preload = dir.join(PRELOAD_LIST);
    replace(&preload, preload_line().as_bytes(), 0o644)
        .map_err(err("the preload list", &preload))?;
    Ok(target)
}

/// Checks that `path` is gpumem's shim, built for this machine.
pub fn check_shim(path: &Path) -> Result<(), ShimError> {
    let read_err = |source| ShimError::Read {
        path: path.to_owned(),
        source,
    };
    let mut file = fs::File::open(path).map_err(read_err)?;
    // Only an ELF file is read whole: `--shim` may name anything.
    let mut magic = [0u8; 4];
    let is_elf = match file.read_exact(&mut magic) {
        Ok(()) => &magic == b"\x7fELF",
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => false,
        Err(e) => return Err(read_err(e)),
    };
    let mut bytes = magic.to_vec();
    if is_elf {
        file.read_to_end(&mut bytes).map_err(read_err)?;
    }
    shim_defect(&bytes).map_err(|defect| ShimError::NotShim {
        path: path.to_owned(),
        defect,
    })
}

/// What only gpumem's shim exports (`shim/src/lib.rs`). A CUDA driver, real
/// or fake, exports the very hooks the shim does, so no hook name tells them
/// apart.
pub const SHIM_MARK: &str = "gpumem_shim_version";

/// The machine gpumem runs on, which a preloaded library must be built for.
const HOST_MACHINE: Option<Architecture> = if cfg!(target_arch = "x86_64") {
    Some(Architecture::X86_64)
} else if cfg!(target_arch = "aarch64") {
    Some(Architecture::Aarch64)
} else {
    None
};

/// Why `bytes` is not a shim for this machine, read from its ELF header and
/// dynamic symbol table (no loading: the daemon runs no foreign code).
pub fn shim_defect(bytes: &[u8]) -> Result<(), ShimDefect> {
    if bytes.get(..4) != Some(&b"\x7fELF"[..]) {
        return Err(ShimDefect::NotElf);
    }
    let malformed = |e: object::Error| ShimDefect::Malformed(one_line(&e));
    let file = object::File::parse(bytes).map_err(malformed)?;
    if file.kind() != ObjectKind::Dynamic {
        return Err(ShimDefect::NotSharedLibrary);
    }
    if let Some(host) = HOST_MACHINE {
        if file.architecture() != host {
            return Err(ShimDefect::WrongMachine {
                found: format!("{:?}", file.architecture()),
                expected: format!("{host:?}"),
            });
        }
    }
    for symbol in file.dynamic_symbols() {
        let exported = !symbol.is_undefined() && symbol.is_global();
        if exported && symbol.name_bytes().map_err(malformed)? == SHIM_MARK.as_bytes() {
            return Ok(());
        }
    }
    Err(ShimDefect::NotOurs)
}

/// Writes `bytes` beside `target`, syncs it, and renames it over `target`:
/// every container started after a reboot loads what is there.
fn replace(target: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let staging = (".gpumem-install.", "");
    atomic_file::replace(target, bytes, mode, staging, Durability::Synced)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    const ELF_MAGIC: [u8; 4] = *b"\x7fELF";
    const ET_DYN: u16 = 3;
    const SHT_DYNSYM: u32 = 11;
    const SHN_UNDEF: u16 = 0;

    /// A minimal ELF64 shared object exporting `exports` (and importing
    /// `malloc`), followed by `payload`: just enough for `shim_defect`.
    fn elf(machine: u16, exports: &[&str], payload: &[u8]) -> Vec<u8> {
        let mut names = vec![0u8];
        let mut symbols = vec![0u8; 24]; // the null symbol
        let mut add = |name: &str, section: u16| {
            let offset = u32::try_from(names.len()).unwrap();
            names.extend_from_slice(name.as_bytes());
            names.push(0);
            let mut sym = [0u8; 24];
            sym[..4].copy_from_slice(&offset.to_le_bytes());
            sym[4] = 0x12; // global function
            sym[6..8].copy_from_slice(&section.to_le_bytes());
            symbols.extend_from_slice(&sym);
        };
        add("malloc", SHN_UNDEF);
        for name in exports {
            add(name, 1);
        }
        let symbols_at = 64u64;
        let names_at = symbols_at + symbols.len() as u64;
        let headers_at = names_at + names.len() as u64;
        let mut bytes = vec![0u8; 64];
        bytes[..4].copy_from_slice(&ELF_MAGIC);
        bytes[4..7].copy_from_slice(&[2, 1, 1]);
        bytes[16..18].copy_from_slice(&ET_DYN.to_le_bytes());
        bytes[18..20].copy_from_slice(&machine.to_le_bytes());
        bytes[0x28..0x30].copy_from_slice(&headers_at.to_le_bytes());
        bytes[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        bytes[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        // Section names come from the string table too (all empty).
        bytes[0x3e..0x40].copy_from_slice(&2u16.to_le_bytes());
        bytes.extend_from_slice(&symbols);
        bytes.extend_from_slice(&names);
        let header = |kind: u32, offset: u64, size: u64, link: u32| {
            let mut h = [0u8; 64];
            h[4..8].copy_from_slice(&kind.to_le_bytes());
            h[24..32].copy_from_slice(&offset.to_le_bytes());
            h[32..40].copy_from_slice(&size.to_le_bytes());
            h[40..44].copy_from_slice(&link.to_le_bytes());
            h
        };
        bytes.extend_from_slice(&[0u8; 64]);
        bytes.extend_from_slice(&header(SHT_DYNSYM, symbols_at, symbols.len() as u64, 2));
        bytes.extend_from_slice(&header(3, names_at, names.len() as u64, 0));
        bytes.extend_from_slice(payload);
        bytes
    }

    /// `e_machine` of this machine.
    fn host() -> u16 {
        if cfg!(target_arch = "aarch64") {
            183
        } else {
            62
        }
    }

    fn shim(payload: &[u8]) -> Vec<u8> {
        elf(host(), &["cuMemAlloc_v2", SHIM_MARK], payload)
    }

    #[test]
    fn installs_by_rename_and_keeps_mapped_copies_intact() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("built.so");
        fs::write(&source, shim(b"version 1")).unwrap();
        let host = dir.path().join("host");
        let lib = install(&source, &host).unwrap();
        assert_eq!(fs::read(&lib).unwrap(), shim(b"version 1"));
        assert_eq!(
            fs::read_to_string(host.join("ld.so.preload")).unwrap(),
            "/usr/local/gpumem/libgpumem_shim.so\n"
        );
        // A running container holds the old file open; an upgrade must not change it.
        let held = fs::File::open(&lib).unwrap();
        let old_inode = held.metadata().unwrap().ino();
        fs::write(&source, shim(b"version 2")).unwrap();
        install(&source, &host).unwrap();
        assert_eq!(fs::read(&lib).unwrap(), shim(b"version 2"));
        assert_ne!(fs::metadata(&lib).unwrap().ino(), old_inode);
        let mut old = Vec::new();
        (&held).read_to_end(&mut old).unwrap();
        assert_eq!(old, shim(b"version 1"));
        assert_eq!(
            fs::read_dir(&host).unwrap().count(),
            2,
            "no staging files left"
        );
        assert_eq!(fs::metadata(&lib).unwrap().mode() & 0o777, 0o755);
    }

    #[test]
    fn missing_source_is_named_as_the_source() {
        let dir = tempfile::tempdir().unwrap();
        let err = install(&dir.path().join("nope.so"), dir.path()).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("--from")
                && text.contains("cannot read the shim")
                && text.contains("nope.so"),
            "{text}"
        );
        assert!(!text.contains("into"), "{text}");
    }

    #[test]
    fn only_the_shim_is_installed() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("libcuda.so.1");
        let driver = ["cuInit", "cuMemAlloc_v2", "nvmlDeviceGetMemoryInfo_v2"];
        fs::write(&source, elf(host(), &driver, b"")).unwrap();
        let host_dir = dir.path().join("host");
        let err = install(&source, &host_dir).unwrap_err().to_string();
        assert!(
            err.contains("libcuda.so.1") && err.contains(SHIM_MARK),
            "{err}"
        );
        assert!(!host_dir.exists(), "nothing installed");
    }

    #[test]
    fn tells_what_makes_a_file_not_the_shim() {
        assert_eq!(shim_defect(&shim(b"")), Ok(()));
        assert_eq!(
            shim_defect(b"root:x:0:0:root:/root:/bin/sh\n"),
            Err(ShimDefect::NotElf)
        );
        assert_eq!(shim_defect(b""), Err(ShimDefect::NotElf));
        let mut bytes = shim(b"");
        bytes[16] = 2; // ET_EXEC
        assert_eq!(shim_defect(&bytes), Err(ShimDefect::NotSharedLibrary));
        let other = if host() == 62 { 183 } else { 62 };
        assert!(matches!(
            shim_defect(&elf(other, &[SHIM_MARK], b"")),
            Err(ShimDefect::WrongMachine { .. })
        ));
        assert_eq!(
            shim_defect(&elf(host(), &["dlsym", "cuMemAlloc_v2"], b"")),
            Err(ShimDefect::NotOurs)
        );
        // Every prefix of a shim is refused without a panic (up to the last
        // section header's fields the check does not read).
        let whole = shim(b"");
        for len in 0..whole.len() - 20 {
            assert!(shim_defect(&whole[..len]).is_err(), "{len} bytes");
        }
        // Offsets pointing anywhere are refused without a panic.
        let mut bytes = shim(b"");
        bytes[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(
            matches!(shim_defect(&bytes), Err(ShimDefect::Malformed(_))),
            "{:?}",
            shim_defect(&bytes)
        );
    }

    #[test]
    fn check_shim_reads_only_what_it_needs() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("libgpumem_shim.so");
        fs::write(&file, shim(b"")).unwrap();
        check_shim(&file).unwrap();
        fs::write(&file, b"ab").unwrap();
        let err = check_shim(&file).unwrap_err().to_string();
        assert!(
            err.contains("libgpumem_shim.so") && err.contains("not an ELF file"),
            "{err}"
        );
        let err = check_shim(&dir.path().join("absent.so"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("absent.so"), "{err}");
    }
}
