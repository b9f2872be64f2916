//! CDI (Container Device Interface) spec files for the `cdi` device-list
//! strategy: one spec per container, kind `gpumem.io/container`, holding its
//! env and shim mounts; written atomically and removed with its state.
//!
//! The format is cncf-tags/container-device-interface SPEC.md; the name
//! rules are its `pkg/parser`, which runtimes apply when they load a spec.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::atomic_file::{self, Durability};

/// Our vendor and classes: the device plugin's devices are
/// `gpumem.io/container=<container>`, the DRA driver's
/// `gpumem.io/claim=<claim UID>`.
pub const VENDOR: &str = "gpumem.io";
pub const CLASS: &str = "container";
pub const CLAIM_CLASS: &str = "claim";
/// NVIDIA's kind for whole GPUs, as `nvidia-ctk cdi generate` names them.
/// Since NVIDIA Container Toolkit 1.15 it names each GPU by index and by
/// UUID (`--device-name-strategy` defaults to both); gpumem uses the UUID.
pub const NVIDIA_GPU_KIND: &str = "nvidia.com/gpu";
/// The spec version written: the oldest that allows a device name starting
/// with a digit (ours start with the GPU key's hex). Runtimes refuse a spec
/// whose version they do not know, so the newest would shut out older ones.
pub const CDI_VERSION: &str = "0.5.0";
/// Where runtimes look for specs that change at run time (`/etc/cdi` holds
/// static ones; a spec in `/var/run/cdi` wins over one there).
pub const DEFAULT_SPEC_DIR: &str = "/var/run/cdi";

/// Where NVIDIA's CDI spec for the node's GPUs is looked for beside gpumem's
/// own specs in `spec_dir`: `nvidia-ctk cdi generate` writes
/// /etc/cdi/nvidia.yaml, NVIDIA's DaemonSet the runtime's directory.
pub fn nvidia_spec_dirs(spec_dir: &Path) -> Vec<PathBuf> {
    vec![PathBuf::from("/etc/cdi"), spec_dir.to_owned()]
}
/// Mount options for what a container reads only: a bind mount that cannot
/// carry set-uid programs or device nodes (the options NVIDIA's generated
/// specs use for driver files).
const READ_ONLY: [&str; 5] = ["ro", "nosuid", "nodev", "rbind", "rprivate"];
const READ_WRITE: [&str; 5] = ["rw", "nosuid", "nodev", "rbind", "rprivate"];

#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("{name:?} is not a valid CDI device name: {reason}")]
    DeviceName { name: String, reason: &'static str },
    #[error("{kind:?} is not a valid CDI kind (vendor/class): {reason}")]
    Kind { kind: String, reason: &'static str },
    #[error("cannot write the CDI spec {path} (--cdi-spec-dir)")]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot read the CDI spec {path}")]
    Read { path: PathBuf, source: io::Error },
    #[error("the CDI spec {path} does not parse")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// A CDI spec: the fields gpumem writes. Runtimes parse specs strictly, so
/// nothing else goes in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Spec {
    pub cdi_version: String,
    pub kind: String,
    pub devices: Vec<Device>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Device {
    pub name: String,
    /// Applied only to containers that request this device.
    pub container_edits: ContainerEdits,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerEdits {
    /// `KEY=VALUE`, set in the container (replacing its own value).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<Mount>,
}

impl ContainerEdits {
    /// Edits setting `env` (in name order, so equal grants write equal
    /// files) and bind-mounting `mounts`.
    pub fn new<'a>(
        env: &BTreeMap<String, String>,
        mounts: impl IntoIterator<Item = (&'a Path, &'a Path, bool)>,
    ) -> Self {
        ContainerEdits {
            env: env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            mounts: mounts
                .into_iter()
                .map(|(container, host, read_only)| Mount::bind(container, host, read_only))
                .collect(),
        }
    }

    /// The env as a map, as a runtime applies it.
    pub fn env_map(&self) -> BTreeMap<String, String> {
        self.env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Mount {
    pub host_path: String,
    pub container_path: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Mount {
    fn bind(container: &Path, host: &Path, read_only: bool) -> Self {
        let options = if read_only { READ_ONLY } else { READ_WRITE };
        Mount {
            host_path: host.display().to_string(),
            container_path: container.display().to_string(),
            options: options.map(str::to_owned).to_vec(),
        }
    }

    pub fn read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }
}

/// `vendor/class=name`.
pub fn qualified_name(kind: &str, name: &str) -> String {
    format!("{kind}={name}")
}

/// A spec of our container kind holding one device, `name`, with `edits`.
pub fn container_spec(name: &str, edits: ContainerEdits) -> Result<Spec, CdiError> {
    spec(CLASS, name, edits)
}

/// A spec of our kind `gpumem.io/<class>` holding one device, `name`.
pub fn spec(class: &str, name: &str, edits: ContainerEdits) -> Result<Spec, CdiError> {
    validate_device_name(name)?;
    Ok(Spec {
        cdi_version: CDI_VERSION.to_owned(),
        kind: format!("{VENDOR}/{class}"),
        devices: vec![Device {
            name: name.to_owned(),
            container_edits: edits,
        }],
    })
}

/// `gpumem.io/container`.
pub fn kind() -> String {
    format!("{VENDOR}/{CLASS}")
}

/// A device name as CDI's parser accepts it: letters, digits, `_`, `-`,
/// `.` and `:`, beginning and ending with a letter or digit.
pub fn validate_device_name(name: &str) -> Result<(), CdiError> {
    let err = |reason| {
        Err(CdiError::DeviceName {
            name: name.to_owned(),
            reason,
        })
    };
    let bytes = name.as_bytes();
    let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
        return err("empty");
    };
    if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return err("it must begin and end with a letter or digit");
    }
    if !bytes
        .iter()
        .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
    {
        return err("only letters, digits, '_', '-', '.' and ':' are allowed");
    }
    Ok(())
}

/// A kind `vendor/class` as CDI's parser accepts it: each part begins with
/// a letter, ends with a letter or digit, and holds letters, digits, `_`,
/// `-` and `.`; SPEC.md adds at most 63 characters for the class.
pub fn validate_kind(kind: &str) -> Result<(), CdiError> {
    let err = |reason| {
        Err(CdiError::Kind {
            kind: kind.to_owned(),
            reason,
        })
    };
    let Some((vendor, class)) = kind.split_once('/') else {
        return err("no '/' between vendor and class");
    };
    for part in [vendor, class] {
        let bytes = part.as_bytes();
        let (Some(first), Some(last)) = (bytes.first(), bytes.last()) else {
            return err("empty vendor or class");
        };
        if !first.is_ascii_alphabetic() || !last.is_ascii_alphanumeric() {
            return err("vendor and class must begin with a letter and end with a letter or digit");
        }
        if !bytes
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        {
            return err("only letters, digits, '_', '-' and '.' are allowed");
        }
    }
    if class.len() > 63 {
        return err("the class is longer than 63 characters");
    }
    Ok(())
}

/// The spec files of one of our kinds in one directory (`--cdi-spec-dir`),
/// one per device, named as CDI's `GenerateTransientSpecName` names them:
/// `gpumem.io-container_<device name>.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecDir {
    dir: PathBuf,
    class: &'static str,
}

impl SpecDir {
    /// The device plugin's container specs.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        SpecDir::of_class(dir, CLASS)
    }

    /// The specs of kind `gpumem.io/<class>`.
    pub fn of_class(dir: impl Into<PathBuf>, class: &'static str) -> Self {
        SpecDir {
            dir: dir.into(),
            class,
        }
    }

    /// `gpumem.io/<class>`.
    pub fn kind(&self) -> String {
        format!("{VENDOR}/{}", self.class)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn prefix(&self) -> String {
        format!("{VENDOR}-{}_", self.class)
    }

    /// Where the spec holding device `name` lives.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{}{name}.json", self.prefix()))
    }

    /// Writes `spec` (one device of our kind) atomically: a runtime that
    /// loads the directory meanwhile sees the old file or the new one, never
    /// a half-written one. The staging file's name does not end in `.json`,
    /// so runtimes never load it (they would see its device twice, a
    /// conflict that hides the device). A file with the same content is left
    /// alone, so rewriting it does not make every runtime reload the dir.
    /// Returns whether the file changed.
    pub fn write(&self, spec: &Spec) -> Result<bool, CdiError> {
        let name = match spec.devices.as_slice() {
            [device] => device.name.as_str(),
            _ => "",
        };
        validate_device_name(name)?;
        validate_kind(&spec.kind)?;
        let path = self.path(name);
        let mut text = serde_json::to_vec_pretty(spec).map_err(|err| CdiError::Write {
            path: path.clone(),
            source: io::Error::other(err),
        })?;
        text.push(b'\n');
        if fs::read(&path).is_ok_and(|old| old == text) {
            return Ok(false);
        }
        let write = || -> io::Result<()> {
            fs::create_dir_all(&self.dir)?;
            // Tools that list CDI devices need not be root. Synced: the
            // runtime reads it when kubelet restarts the container, which
            // may be after a reboot.
            let staging = format!(".{}", self.prefix());
            atomic_file::replace(&path, &text, 0o644, (&staging, ".tmp"), Durability::Synced)
        };
        write().map_err(|source| CdiError::Write { path, source })?;
        Ok(true)
    }

    /// Reads the spec holding device `name`.
    pub fn read(&self, name: &str) -> Result<Spec, CdiError> {
        let path = self.path(name);
        let text = fs::read(&path).map_err(|source| CdiError::Read {
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|source| CdiError::Parse { path, source })
    }

    /// The edits a runtime applies for the qualified device `qualified`
    /// (`gpumem.io/container=<name>`); `None` for another kind or no spec.
    pub fn edits(&self, qualified: &str) -> Option<ContainerEdits> {
        let name = qualified.strip_prefix(&format!("{}=", self.kind()))?;
        let spec = self.read(name).ok()?;
        spec.devices
            .into_iter()
            .find(|d| d.name == name)
            .map(|d| d.container_edits)
    }

    /// Removes the spec holding device `name`; one already gone is fine.
    pub fn remove(&self, name: &str) -> io::Result<()> {
        match fs::remove_file(self.path(name)) {
            Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        }
    }

    /// The device names of the specs of our kind present, in name order;
    /// none when the directory does not exist.
    pub fn list(&self) -> Vec<String> {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let prefix = self.prefix();
        let mut names: Vec<String> = entries
            .flatten()
            .filter_map(|e| {
                let file = e.file_name().into_string().ok()?;
                let name = file.strip_prefix(&prefix)?.strip_suffix(".json")?;
                Some(name.to_owned())
            })
            .collect();
        names.sort_unstable();
        names
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn edits() -> ContainerEdits {
        let env = BTreeMap::from([
            ("GPUMEM_LIMIT_MIB".to_owned(), "4308".to_owned()),
            ("A".to_owned(), "x=y".to_owned()),
        ]);
        ContainerEdits::new(
            &env,
            [(
                Path::new("/var/run/gpumem"),
                Path::new("/var/lib/gpumem/containers/x"),
                false,
            )],
        )
    }

    #[test]
    fn device_names_follow_the_cdi_parser() {
        for good in [
            "5f1c09a2-4u-00ff00ff00ff00ff",
            "GPU-6b1c2d3e-0000-4000-8000-000000000400",
            "0",
            "a:b.c_d",
        ] {
            validate_device_name(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        for bad in ["", "-a", "a-", "a/b", "a=b", "a b", "ä", ".a", "a:"] {
            assert!(validate_device_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn kinds_follow_the_cdi_parser() {
        for good in [
            kind().as_str(),
            NVIDIA_GPU_KIND,
            "vendor.com/foo",
            "foo.bar.baz/foo-bar123.B_az",
        ] {
            validate_kind(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        }
        let long = format!("vendor.com/{}", "a".repeat(64));
        for bad in [
            "foo",
            "vendor.com/foo/",
            "vendor.com/foo/bar",
            "/foo",
            "1vendor/foo",
            "v/-a",
            &long,
        ] {
            assert!(validate_kind(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_spec_names_its_device_and_carries_env_in_name_order() {
        let spec = container_spec("5f1c09a2-4u-00ff", edits()).unwrap();
        assert_eq!(spec.kind, "gpumem.io/container");
        assert_eq!(spec.devices[0].name, "5f1c09a2-4u-00ff");
        let edits = &spec.devices[0].container_edits;
        assert_eq!(edits.env, ["A=x=y", "GPUMEM_LIMIT_MIB=4308"]);
        assert_eq!(edits.env_map()["A"], "x=y");
        assert!(!edits.mounts[0].read_only());
        assert!(edits.mounts[0].options.iter().any(|o| o == "rbind"));
        assert!(matches!(
            container_spec("bad name", ContainerEdits::default()),
            Err(CdiError::DeviceName { .. })
        ));
    }

    #[test]
    fn writes_atomically_reads_lists_and_removes() {
        let root = tempfile::tempdir().unwrap();
        // Created on demand: /var/run is empty after a reboot.
        let specs = SpecDir::new(root.path().join("cdi"));
        assert!(specs.list().is_empty());
        let spec = container_spec("5f1c09a2-4u-00ff", edits()).unwrap();
        assert!(specs.write(&spec).unwrap(), "a new file");
        let path = specs.path("5f1c09a2-4u-00ff");
        assert_eq!(
            path.file_name().unwrap(),
            "gpumem.io-container_5f1c09a2-4u-00ff.json"
        );
        let mode = fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
        // Only the spec itself is in the directory: no staging file left.
        let files: Vec<_> = fs::read_dir(specs.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(files, [path.file_name().unwrap()]);
        assert_eq!(specs.read("5f1c09a2-4u-00ff").unwrap(), spec);
        assert_eq!(specs.list(), ["5f1c09a2-4u-00ff"]);
        assert_eq!(
            specs.edits("gpumem.io/container=5f1c09a2-4u-00ff"),
            Some(spec.devices[0].container_edits.clone())
        );
        assert_eq!(specs.edits("nvidia.com/gpu=5f1c09a2-4u-00ff"), None);

        // The same content again leaves the file (its inode) alone; other
        // content replaces it whole, through a new inode.
        use std::os::unix::fs::MetadataExt;
        let inode = fs::metadata(&path).unwrap().ino();
        assert!(!specs.write(&spec).unwrap(), "unchanged");
        assert_eq!(fs::metadata(&path).unwrap().ino(), inode);
        let mut other = spec.clone();
        other.devices[0].container_edits.env.push("B=1".into());
        assert!(specs.write(&other).unwrap(), "changed");
        assert_ne!(fs::metadata(&path).unwrap().ino(), inode);
        assert_eq!(specs.read("5f1c09a2-4u-00ff").unwrap(), other);

        // Files of other kinds are not ours.
        fs::write(specs.dir().join("nvidia.yaml"), "").unwrap();
        assert_eq!(specs.list(), ["5f1c09a2-4u-00ff"]);
        specs.remove("5f1c09a2-4u-00ff").unwrap();
        specs.remove("5f1c09a2-4u-00ff").unwrap();
        assert!(specs.list().is_empty());
        assert!(specs.dir().join("nvidia.yaml").exists());
    }

    #[test]
    fn a_reader_never_sees_a_half_written_spec() {
        let root = tempfile::tempdir().unwrap();
        let specs = SpecDir::new(root.path());
        let small = container_spec("a", edits()).unwrap();
        let mut large = small.clone();
        large.devices[0].container_edits.env = (0..2000)
            .map(|i| format!("K{i}={}", "v".repeat(64)))
            .collect();
        specs.write(&small).unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for i in 0..100 {
                    specs
                        .write(if i % 2 == 0 { &large } else { &small })
                        .unwrap();
                }
                done.store(true, std::sync::atomic::Ordering::Release);
            });
            let mut reads = 0;
            while !done.load(std::sync::atomic::Ordering::Acquire) || reads == 0 {
                let read = specs.read("a").unwrap();
                assert!(read == small || read == large, "a torn read");
                reads += 1;
            }
        });
    }

    #[test]
    fn a_write_that_fails_names_the_file_and_the_flag() {
        let root = tempfile::tempdir().unwrap();
        let blocker = root.path().join("not-a-dir");
        fs::write(&blocker, "").unwrap();
        let specs = SpecDir::new(&blocker);
        let err = specs
            .write(&container_spec("a", edits()).unwrap())
            .unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("--cdi-spec-dir") && text.contains("not-a-dir"),
            "{text}"
        );
    }
}
