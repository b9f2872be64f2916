//! The fake GPU file (`--fake-gpus`) as the node's hardware: its GPUs,
//! facts, readings, health and processes, re-read at each look so tests can
//! edit it live. The file's text is read in `file`.

mod file;

pub use file::FakeGpus;

use std::collections::HashMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::node::gpu::{Gpu, GpuError, NodeFacts, ProcessMemory};
use crate::node::hardware::Hardware;
use crate::node::health::{HealthChange, HealthWatch};
use crate::node::processes::{
    exiting_in_stat, proc_lines, proc_stat, read_lines_from, ProcFiles, ProcStat, ProcessUsage,
    Read,
};
use crate::node::sensors::{Readings, Sensors};

/// A node described in a fake GPU file, read again by each question, so
/// tests can change it while the daemon runs. Ignored XIDs and the recovery
/// time mean nothing here: a GPU's health is what the file says.
pub struct FakeHardware {
    path: PathBuf,
}

impl FakeHardware {
    pub fn new(path: &Path) -> Self {
        FakeHardware {
            path: path.to_owned(),
        }
    }
}

impl Hardware for FakeHardware {
    fn discover(&self) -> Result<Vec<Gpu>, GpuError> {
        Ok(FakeGpus::from_file(&self.path)?.gpus())
    }

    fn facts(&self) -> Result<NodeFacts, GpuError> {
        Ok(FakeGpus::from_file(&self.path)?.facts())
    }

    fn sensors(&self) -> Option<Arc<dyn Sensors>> {
        Some(Arc::new(FakeSensors::new(&self.path)))
    }

    fn health(&self, _ignored: &[u64], _recovery: Duration) -> Option<Box<dyn HealthWatch>> {
        Some(Box::new(FakeHealth::new(&self.path)))
    }

    fn processes(&self) -> Option<Box<dyn ProcessUsage>> {
        Some(Box::new(FakeProcesses::new(&self.path)))
    }
}

/// The sensor readings of a fake GPU file, read again at every look.
pub struct FakeSensors {
    path: PathBuf,
}

impl FakeSensors {
    pub fn new(path: &Path) -> Self {
        FakeSensors {
            path: path.to_owned(),
        }
    }
}

impl Sensors for FakeSensors {
    fn read(&self) -> Result<Readings, GpuError> {
        Ok(FakeGpus::from_file(&self.path)?.readings().clone())
    }
}

/// Health from the fake GPU file: edit `healthy = false` in it and the GPU
/// goes Unhealthy; set it back and it recovers.
pub struct FakeHealth {
    path: PathBuf,
    last: HashMap<String, bool>,
}

impl FakeHealth {
    pub fn new(path: &Path) -> Self {
        let mut watch = FakeHealth {
            path: path.to_owned(),
            last: HashMap::new(),
        };
        watch.read();
        watch
    }

    /// Re-reads the (small) file every tick.
    fn read(&mut self) -> Vec<HealthChange> {
        // A half-written or broken edit is ignored until it parses.
        let Ok(gpus) = FakeGpus::from_file(&self.path).map(|f| f.gpus()) else {
            return Vec::new();
        };
        let mut changes = Vec::new();
        for gpu in gpus {
            let before = self.last.insert(gpu.uuid.clone(), gpu.healthy);
            if before.is_some_and(|b| b != gpu.healthy) {
                changes.push(HealthChange {
                    uuid: gpu.uuid,
                    healthy: gpu.healthy,
                    reason: format!("healthy = {} in {}", gpu.healthy, self.path.display()),
                });
            }
        }
        changes
    }
}

impl HealthWatch for FakeHealth {
    fn poll(&mut self, timeout: Duration) -> Vec<HealthChange> {
        std::thread::sleep(timeout);
        self.read()
    }
}

/// The `[[gpu.process]]` tables of a fake GPU file, re-read on every call
/// so tests can change them while the daemon runs; a process's `cgroup`
/// and `mountinfo` there stand in for its files under `/proc/<pid>/`.
pub struct FakeProcesses {
    path: PathBuf,
    last: Option<FakeGpus>,
}

impl FakeProcesses {
    pub fn new(path: &Path) -> Self {
        FakeProcesses {
            path: path.to_owned(),
            last: None,
        }
    }
}

impl FakeProcesses {
    /// What the file last read says `/proc/<pid>/<name>` holds.
    fn fake_file(&self, pid: u32, name: &str) -> Option<&str> {
        self.last.as_ref()?.proc_file(pid, name)
    }
}

impl ProcessUsage for FakeProcesses {
    fn usage(&mut self) -> Result<ProcessMemory, GpuError> {
        let fake = FakeGpus::from_file(&self.path)?;
        let memory = fake.processes().clone();
        self.last = Some(fake);
        Ok(memory)
    }
}

impl ProcFiles for FakeProcesses {
    fn proc_stat(&self, pid: u32) -> Option<ProcStat> {
        let Some(text) = self.fake_file(pid, "stat") else {
            return proc_stat(Path::new("/proc"), pid);
        };
        // The fake process's `stat` stands for all of its threads'.
        let start = gpumem_layout::protocol::start_time_in_stat(text)?;
        Some(ProcStat {
            start,
            exiting: exiting_in_stat(text),
            thread: pid,
        })
    }

    fn proc_lines(
        &self,
        pid: u32,
        thread: u32,
        name: &str,
        each: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Option<Read> {
        match self.fake_file(pid, name) {
            Some(text) => read_lines_from(text.as_bytes(), each),
            None => proc_lines(Path::new("/proc"), pid, thread, name, each),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_file_edits_become_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.toml");
        let write = |healthy: bool| {
            std::fs::write(
                &path,
                format!("[[gpu]]\nuuid = \"GPU-a\"\nname = \"T4\"\nmemory_mib = 15079\nhealthy = {healthy}\n"),
            )
            .unwrap();
        };
        write(true);
        let mut watch = FakeHealth::new(&path);
        assert!(watch.poll(Duration::ZERO).is_empty());
        write(false);
        let changes = watch.poll(Duration::ZERO);
        assert_eq!(changes.len(), 1);
        assert!(!changes[0].healthy && changes[0].uuid == "GPU-a");
        std::fs::write(&path, "[[gpu]]\nuuid = ").unwrap();
        assert!(
            watch.poll(Duration::ZERO).is_empty(),
            "broken edits are ignored"
        );
        write(true);
        assert!(watch.poll(Duration::ZERO)[0].healthy);
    }
}
