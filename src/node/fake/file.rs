//! The fake GPU file's text: a TOML-described node read, bounded and
//! validated into the GPUs, facts, processes and readings it stands for.

use crate::error_text::one_line;
use std::collections::{HashMap, HashSet};
use std::fs::FileType;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use nix::libc;
use serde::Deserialize;

use crate::node::gpu::{
    over_bound, Gpu, GpuError, NodeFacts, ProcessMemory, MAX_FAKE_FILE_BYTES, MAX_GPU_MEMORY_MIB,
};
use crate::node::sensors::{GpuReading, Readings};

/// The article and name of a file type other than a regular file's.
fn describe(kind: FileType) -> &'static str {
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "something other than a file"
    }
}

/// A node described in TOML (`[[gpu]]` tables with `uuid`, `name`,
/// `memory_mib`, optional `index`, `healthy` and `compute_capability`
/// (`"7.5"`), and optional `[[gpu.process]]` tables with `pid` and
/// `used_mib` standing in for NVML's per-process usage, and `cgroup`,
/// `mountinfo` and `stat` for what `/proc/<pid>/cgroup`, `mountinfo` and
/// `stat` say of that process, and `sm_percent` for its share of the SMs;
/// optional top-level `driver_version` (`"580.65.06"`) and
/// `cuda_driver_version` (`"13.0"`); and optional sensor readings per GPU:
/// `memory_used_mib` (the processes' sum where left out),
/// `utilization_percent`, `temperature_celsius`, `power_watts`). Sizes are at most
/// [`MAX_GPU_MEMORY_MIB`], and the file a regular one of at most
/// [`MAX_FAKE_FILE_BYTES`].
#[derive(Debug, Clone)]
pub struct FakeGpus {
    gpus: Vec<Gpu>,
    facts: NodeFacts,
    processes: ProcessMemory,
    readings: Readings,
    /// `(pid, file name)` → what `/proc/<pid>/<file name>` holds.
    proc_files: HashMap<(u32, String), String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FakeFile {
    driver_version: Option<String>,
    cuda_driver_version: Option<String>,
    #[serde(default)]
    gpu: Vec<FakeEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FakeEntry {
    uuid: String,
    name: String,
    memory_mib: u64,
    index: Option<u32>,
    #[serde(default = "default_healthy")]
    healthy: bool,
    compute_capability: Option<String>,
    memory_used_mib: Option<u64>,
    utilization_percent: Option<u32>,
    temperature_celsius: Option<u32>,
    power_watts: Option<u32>,
    #[serde(default)]
    process: Vec<FakeProcess>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FakeProcess {
    pid: u32,
    used_mib: u64,
    cgroup: Option<String>,
    mountinfo: Option<String>,
    stat: Option<String>,
    sm_percent: Option<u32>,
}

fn default_healthy() -> bool {
    true
}

/// `"7.5"` → `(7, 5)`: digits, one dot, digits.
fn major_minor(text: &str) -> Option<(u32, u32)> {
    let (major, minor) = text.split_once('.')?;
    let number = |part: &str| {
        // Digits only: `parse` alone would take "+7".
        (!part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
            .then(|| part.parse().ok())
            .flatten()
    };
    Some((number(major)?, number(minor)?))
}

impl FakeGpus {
    /// Reads and validates a fake GPU file; errors name the file and field.
    /// Only a regular file of at most [`MAX_FAKE_FILE_BYTES`] is read.
    pub fn from_file(path: &Path) -> Result<Self, GpuError> {
        let read = |source| GpuError::Read {
            path: path.to_owned(),
            source,
        };
        let regular = |kind: FileType| {
            if kind.is_file() {
                Ok(())
            } else {
                Err(GpuError::NotRegular {
                    path: path.to_owned(),
                    kind: describe(kind),
                })
            }
        };
        // Looked at before it is opened: opening a FIFO for reading waits
        // for a writer, and opening a device can act on it.
        regular(std::fs::metadata(path).map_err(read)?.file_type())?;
        // Opened so that it cannot block, and looked at again through the
        // descriptor: the path may name something else by now.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(read)?;
        let metadata = file.metadata().map_err(read)?;
        regular(metadata.file_type())?;
        let too_big = |bytes| GpuError::TooBig {
            path: path.to_owned(),
            bytes,
        };
        if metadata.len() > MAX_FAKE_FILE_BYTES {
            return Err(too_big(metadata.len()));
        }
        let mut text = String::new();
        // The file may grow while it is read.
        file.take(MAX_FAKE_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(read)?;
        let bytes = text.len() as u64;
        if bytes > MAX_FAKE_FILE_BYTES {
            return Err(too_big(bytes));
        }
        Self::parse(&text, path)
    }

    /// Parses fake GPU TOML; `origin` names the source in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, GpuError> {
        let file: FakeFile = toml::from_str(text).map_err(|e| GpuError::Parse {
            path: origin.to_owned(),
            message: one_line(&e).trim_end().to_owned(),
        })?;
        if file.gpu.is_empty() {
            return Err(GpuError::Parse {
                path: origin.to_owned(),
                message: "no [[gpu]] entries".into(),
            });
        }
        let field = |position, field: &str, message: String| GpuError::Field {
            path: origin.to_owned(),
            position,
            field: field.to_owned(),
            message,
        };
        let top = |field: &str, message: String| GpuError::Parse {
            path: origin.to_owned(),
            message: format!("{field}: {message}"),
        };
        let mut facts = NodeFacts::default();
        if let Some(version) = file.driver_version {
            if version.trim().is_empty() {
                return Err(top("driver_version", "must not be empty".into()));
            }
            facts.driver_version = Some(version);
        }
        if let Some(version) = file.cuda_driver_version {
            facts.cuda_driver_version = Some(major_minor(&version).ok_or_else(|| {
                top(
                    "cuda_driver_version",
                    format!("{version:?} is not a CUDA version like \"13.0\""),
                )
            })?);
        }
        let mut uuids = HashSet::new();
        let mut indices = HashSet::new();
        let mut gpus = Vec::with_capacity(file.gpu.len());
        let mut processes = ProcessMemory::new();
        let mut readings = Readings::default();
        let mut proc_files = HashMap::new();
        for (position, entry) in file.gpu.into_iter().enumerate() {
            let index = match entry.index {
                Some(index) => index,
                None => u32::try_from(position)
                    .map_err(|_| field(position, "index", "too many GPUs".into()))?,
            };
            if !entry.uuid.starts_with("GPU-") || entry.uuid.len() > 64 {
                return Err(field(
                    position,
                    "uuid",
                    format!("{:?} is not a GPU UUID like \"GPU-6b1c2d3e-…\"", entry.uuid),
                ));
            }
            if !uuids.insert(entry.uuid.clone()) {
                return Err(field(
                    position,
                    "uuid",
                    format!("{} appears twice", entry.uuid),
                ));
            }
            if !indices.insert(index) {
                return Err(field(position, "index", format!("{index} appears twice")));
            }
            if entry.memory_mib == 0 {
                return Err(field(
                    position,
                    "memory_mib",
                    "must be greater than 0".into(),
                ));
            }
            if entry.memory_mib > MAX_GPU_MEMORY_MIB {
                return Err(field(position, "memory_mib", over_bound(entry.memory_mib)));
            }
            if entry.name.trim().is_empty() {
                return Err(field(position, "name", "must not be empty".into()));
            }
            let percent = |name: &str, value: Option<u32>| match value {
                Some(v) if v > 100 => Err(field(position, name, format!("{v} is over 100"))),
                _ => Ok(()),
            };
            percent("utilization_percent", entry.utilization_percent)?;
            if let Some(used) = entry.memory_used_mib.filter(|&m| m > entry.memory_mib) {
                return Err(field(
                    position,
                    "memory_used_mib",
                    format!("{used} is more than memory_mib ({})", entry.memory_mib),
                ));
            }
            let mut memory = HashMap::new();
            let mut sm = HashMap::new();
            for (i, p) in entry.process.iter().enumerate() {
                percent(&format!("process[{i}].sm_percent"), p.sm_percent)?;
                if let Some(percent) = p.sm_percent {
                    sm.insert(p.pid, percent);
                }
                if p.pid == 0 {
                    return Err(field(
                        position,
                        &format!("process[{i}].pid"),
                        "must be greater than 0".into(),
                    ));
                }
                if p.used_mib > MAX_GPU_MEMORY_MIB {
                    return Err(field(
                        position,
                        &format!("process[{i}].used_mib"),
                        over_bound(p.used_mib),
                    ));
                }
                if memory
                    .insert(p.pid, p.used_mib.saturating_mul(1 << 20))
                    .is_some()
                {
                    return Err(field(
                        position,
                        &format!("process[{i}].pid"),
                        format!("{} appears twice", p.pid),
                    ));
                }
                let files = [
                    ("cgroup", &p.cgroup),
                    ("mountinfo", &p.mountinfo),
                    ("stat", &p.stat),
                ];
                for (name, text) in files {
                    if let Some(text) = text {
                        proc_files.insert((p.pid, name.to_owned()), text.clone());
                    }
                }
            }
            if let Some(text) = &entry.compute_capability {
                let capability = major_minor(text).ok_or_else(|| {
                    field(
                        position,
                        "compute_capability",
                        format!("{text:?} is not a compute capability like \"7.5\""),
                    )
                })?;
                facts
                    .compute_capability
                    .insert(entry.uuid.clone(), capability);
            }
            let listed: u64 = memory.values().fold(0, |a: u64, &b| a.saturating_add(b));
            readings.gpus.insert(
                entry.uuid.clone(),
                GpuReading {
                    memory_used_bytes: Some(
                        entry
                            .memory_used_mib
                            .map_or(listed, |mib| mib.saturating_mul(1 << 20)),
                    ),
                    utilization_percent: entry.utilization_percent,
                    temperature_celsius: entry.temperature_celsius,
                    power_milliwatts: entry.power_watts.map(|w| w.saturating_mul(1000)),
                },
            );
            readings.process_sm.insert(entry.uuid.clone(), sm);
            processes.insert(entry.uuid.clone(), memory);
            gpus.push(Gpu {
                index,
                uuid: entry.uuid,
                name: entry.name,
                memory_mib: entry.memory_mib,
                healthy: entry.healthy,
            });
        }
        gpus.sort_by_key(|g| g.index);
        Ok(FakeGpus {
            gpus,
            facts,
            processes,
            readings,
            proc_files,
        })
    }

    /// The GPUs the file describes, ordered by index.
    pub fn gpus(&self) -> Vec<Gpu> {
        self.gpus.clone()
    }

    /// What the file says of the driver and each GPU's compute capability.
    pub fn facts(&self) -> NodeFacts {
        self.facts.clone()
    }

    /// The sensor readings the file describes.
    pub fn readings(&self) -> &Readings {
        &self.readings
    }

    /// The per-process usage the file describes.
    pub fn processes(&self) -> &ProcessMemory {
        &self.processes
    }

    /// What the file says `/proc/<pid>/<name>` holds for a process it lists
    /// (`cgroup`, `mountinfo`, `stat`).
    pub fn proc_file(&self, pid: u32, name: &str) -> Option<&str> {
        self.proc_files
            .get(&(pid, name.to_owned()))
            .map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<Gpu>, GpuError> {
        FakeGpus::parse(text, Path::new("node.toml")).map(|f| f.gpus())
    }

    #[test]
    fn index_defaults_to_position() {
        let gpus = parse(
            r#"
            [[gpu]]
            uuid = "GPU-a"
            name = "Tesla V100"
            memory_mib = 16160
            [[gpu]]
            uuid = "GPU-b"
            name = "Tesla V100"
            memory_mib = 16160
            healthy = false
            "#,
        )
        .unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!((gpus[0].index, gpus[1].index), (0, 1));
        assert!(gpus[0].healthy && !gpus[1].healthy);
    }

    #[test]
    fn processes_stand_in_for_nvmls_per_process_usage() {
        let gpu = "[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 15079\n";
        let fake = FakeGpus::parse(
            &format!(
                "{gpu}[[gpu.process]]\npid = 41\nused_mib = 600\n\
                 [[gpu.process]]\npid = 42\nused_mib = 1\n"
            ),
            Path::new("node.toml"),
        )
        .unwrap();
        assert_eq!(
            fake.processes()["GPU-a"],
            [(41, 600 << 20), (42, 1 << 20)].into()
        );

        let twice = format!(
            "{gpu}[[gpu.process]]\npid = 41\nused_mib = 1\n[[gpu.process]]\npid = 41\nused_mib = 2\n"
        );
        let err = parse(&twice).unwrap_err();
        assert_eq!(
            err.to_string(),
            "fake GPU file node.toml: gpu[0].process[1].pid: 41 appears twice"
        );
        let err = parse(&format!("{gpu}[[gpu.process]]\npid = 0\nused_mib = 1\n")).unwrap_err();
        assert!(err.to_string().contains("gpu[0].process[0].pid"), "{err}");
    }

    #[test]
    fn sensor_readings_come_from_the_file_and_are_optional() {
        use crate::node::sensors::GpuReading;
        let gpu = "[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 15079\n";
        let plain = FakeGpus::parse(gpu, Path::new("node.toml")).unwrap();
        assert_eq!(
            plain.readings().gpus["GPU-a"],
            GpuReading {
                memory_used_bytes: Some(0),
                ..GpuReading::default()
            }
        );
        let text = format!(
            "{gpu}utilization_percent = 87\ntemperature_celsius = 64\npower_watts = 70\n\
             [[gpu.process]]\npid = 41\nused_mib = 600\nsm_percent = 30\n\
             [[gpu.process]]\npid = 42\nused_mib = 100\n"
        );
        let fake = FakeGpus::parse(&text, Path::new("node.toml")).unwrap();
        assert_eq!(
            fake.readings().gpus["GPU-a"],
            GpuReading {
                // The processes' sum, where the file does not say.
                memory_used_bytes: Some(700 << 20),
                utilization_percent: Some(87),
                temperature_celsius: Some(64),
                power_milliwatts: Some(70_000),
            }
        );
        assert_eq!(fake.readings().process_sm["GPU-a"], [(41, 30)].into());
        let used =
            FakeGpus::parse(&format!("{gpu}memory_used_mib = 900\n"), Path::new("n")).unwrap();
        assert_eq!(
            used.readings().gpus["GPU-a"].memory_used_bytes,
            Some(900 << 20)
        );

        let err = parse(&format!("{gpu}utilization_percent = 101\n")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "fake GPU file node.toml: gpu[0].utilization_percent: 101 is over 100"
        );
        let err = parse(&format!("{gpu}memory_used_mib = 15080\n")).unwrap_err();
        assert!(err.to_string().contains("gpu[0].memory_used_mib"), "{err}");
        let err = parse(&format!(
            "{gpu}[[gpu.process]]\npid = 41\nused_mib = 1\nsm_percent = 200\n"
        ))
        .unwrap_err();
        assert!(
            err.to_string().contains("gpu[0].process[0].sm_percent"),
            "{err}"
        );
    }

    #[test]
    fn facts_come_from_the_file_and_are_optional() {
        let gpu = "[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 15079\n";
        let plain = FakeGpus::parse(gpu, Path::new("node.toml")).unwrap();
        assert_eq!(plain.facts(), NodeFacts::default());

        let text = format!(
            "driver_version = \"580.65.06\"\ncuda_driver_version = \"13.0\"\n\
             {gpu}compute_capability = \"7.5\"\n\
             [[gpu]]\nuuid = \"GPU-b\"\nname = \"T4\"\nmemory_mib = 15079\n"
        );
        let facts = FakeGpus::parse(&text, Path::new("node.toml"))
            .unwrap()
            .facts();
        assert_eq!(facts.driver_version.as_deref(), Some("580.65.06"));
        assert_eq!(facts.cuda_driver_version, Some((13, 0)));
        assert_eq!(
            facts.compute_capability,
            HashMap::from([("GPU-a".to_owned(), (7, 5))])
        );

        let err = parse(&format!("{gpu}compute_capability = \"7\"\n")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "fake GPU file node.toml: gpu[0].compute_capability: \"7\" is not a compute \
             capability like \"7.5\""
        );
        let err = parse(&format!("{gpu}compute_capability = \"+7.5\"\n")).unwrap_err();
        assert!(
            err.to_string().contains("gpu[0].compute_capability"),
            "{err}"
        );
        let err = parse(&format!("driver_version = \" \"\n{gpu}")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "fake GPU file node.toml: driver_version: must not be empty"
        );
        let err = parse(&format!("cuda_driver_version = \"13\"\n{gpu}")).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("fake GPU file node.toml: cuda_driver_version: \"13\""),
            "{err}"
        );
    }

    #[test]
    fn shared_fixtures_still_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gpus");
        let mut parsed = 0;
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "toml") {
                if let Err(err) = FakeGpus::from_file(&path) {
                    panic!("{err}");
                }
                parsed += 1;
            }
        }
        assert!(parsed > 0, "no fixtures in {}", dir.display());
    }

    #[test]
    fn errors_name_file_and_field() {
        let err = parse("[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 0\n").unwrap_err();
        assert_eq!(
            err.to_string(),
            "fake GPU file node.toml: gpu[0].memory_mib: must be greater than 0"
        );
        let err = parse("[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\n").unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("fake GPU file node.toml:") && text.contains("memory_mib"),
            "{text}"
        );
        let err = parse("[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 1\nmemroy = 2\n")
            .unwrap_err();
        assert!(err.to_string().contains("memroy"), "{err}");
        let err = parse("[[gpu]]\nuuid = \"0000\"\nname = \"T4\"\nmemory_mib = 1\n").unwrap_err();
        assert!(err.to_string().contains("gpu[0].uuid"), "{err}");
        let two = "[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 1\n";
        let err = parse(&format!("{two}{two}")).unwrap_err();
        assert!(
            err.to_string().contains("gpu[1].uuid: GPU-a appears twice"),
            "{err}"
        );
        assert!(parse("")
            .unwrap_err()
            .to_string()
            .contains("no [[gpu]] entries"));
    }
}
