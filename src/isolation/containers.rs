//! The containers' state on this node: one accounting directory per container
//! under `<state-dir>/containers`, named after the devices it holds. Allocate
//! creates them, status and metrics read them, clean-up removes them.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::isolation::accounting::{self, AccountingError, Cap, Processes};
use crate::node::inventory::Inventory;
use crate::node::placement::{self, Assignment};

/// Under the state dir, the parent of the per-container directories.
const CONTAINERS: &str = "containers";
/// Names a DRA claim's directory (device plugin names start with hex).
const CLAIM_PREFIX: &str = "claim-";

/// The per-container directories of one state dir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Containers {
    root: PathBuf,
}

impl Containers {
    pub fn in_state_dir(state_dir: &Path) -> Self {
        Containers {
            root: state_dir.join(CONTAINERS),
        }
    }

    /// `<state-dir>/containers`.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The directory of the container named `name`, whether or not it exists.
    pub fn get(&self, name: ContainerName) -> ContainerDir {
        ContainerDir {
            path: self.root.join(name.as_str()),
            name,
        }
    }

    /// Every container directory now present, in name order; none when the
    /// state dir does not exist yet.
    pub fn list(&self) -> Vec<ContainerDir> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut dirs: Vec<ContainerDir> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| {
                let name = ContainerName(e.file_name().into_string().ok()?);
                Some(ContainerDir {
                    path: e.path(),
                    name,
                })
            })
            .collect();
        dirs.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        dirs
    }

    /// The accounting files present, for reconciliation.
    pub fn accounting_files(&self) -> Vec<PathBuf> {
        self.list()
            .into_iter()
            .map(|dir| dir.accounting_file())
            // Not through a link a container put there.
            .filter(|file| file.symlink_metadata().is_ok_and(|m| m.is_file()))
            .collect()
    }
}

/// A container's directory name, derived from the devices it holds:
/// `<gpu key>-<units>u-<hash of the device IDs>`. kubelet never gives the
/// same units to two live containers, and the name is the same if kubelet
/// calls Allocate again for the same container.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerName(String);

impl ContainerName {
    /// The directory of a DRA claim, shared by every container that
    /// references it (kubelet tells the driver nothing about containers):
    /// `claim-<claim UID>`. `None` for a UID that is not one (it becomes a
    /// path).
    pub fn of_claim(uid: &str) -> Option<Self> {
        let valid = !uid.is_empty()
            && uid.len() <= 64
            && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        valid.then(|| ContainerName(format!("{CLAIM_PREFIX}{uid}")))
    }

    /// The claim UID of a DRA claim's directory; `None` for a container's.
    pub fn claim_uid(&self) -> Option<&str> {
        self.0.strip_prefix(CLAIM_PREFIX)
    }

    /// The name of the container holding `ids`, the devices of `assignment`.
    pub fn of(inv: &Inventory, assignment: Assignment, ids: &[String]) -> Self {
        let mut sorted: Vec<&str> = ids.iter().map(String::as_str).collect();
        sorted.sort_unstable();
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in sorted.join(",").bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        ContainerName(format!(
            "{}-{}u-{hash:016x}",
            inv.gpus()[assignment.gpu].key,
            assignment.units
        ))
    }

    /// The name of the container holding the devices `ids`; `None` when
    /// they are not one valid placement (not ours, or on several GPUs).
    pub fn of_devices(inv: &Inventory, ids: &[String]) -> Option<Self> {
        let assignment = placement::assign(inv, ids).ok()?;
        Some(ContainerName::of(inv, assignment, ids))
    }

    /// The GPU key and units the name records; `None` for a directory not
    /// named here.
    fn parts(&self) -> Option<(&str, u32)> {
        let mut parts = self.0.split('-');
        let (key, units, _hash) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        Some((key, units.strip_suffix('u')?.parse().ok()?))
    }

    /// The units the name records; `None` for a directory not named here.
    pub fn units(&self) -> Option<u32> {
        self.parts().map(|(_, units)| units)
    }

    /// The GPU (by its position in `inv`) and the units the name records:
    /// what Allocate gave the container, so its grant can be rebuilt without
    /// kubelet. `None` for a directory not named here or a GPU not on the node.
    pub fn assignment(&self, inv: &Inventory) -> Option<Assignment> {
        let (key, units) = self.parts()?;
        let gpu = inv.gpus().iter().position(|g| g.key.to_string() == key)?;
        Some(Assignment { gpu, units })
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name of the directory at `path`.
    pub fn of_dir(path: &Path) -> Option<Self> {
        Some(ContainerName(path.file_name()?.to_str()?.to_owned()))
    }

    /// The cap Allocate gave the container on the GPU with `uuid`, in MiB,
    /// from what the name records and the node's inventory: unlike the cap
    /// in its accounting file, which the container can write.
    pub fn granted_mib(&self, inv: &Inventory, uuid: &str) -> Option<u64> {
        let (key, units) = self.parts()?;
        let gpu = inv
            .gpus()
            .iter()
            .find(|g| g.gpu.uuid == uuid && g.key.to_string() == key)?;
        Some(gpu.cap_mib(units))
    }
}

impl fmt::Display for ContainerName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One container's accounting directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerDir {
    pub name: ContainerName,
    pub path: PathBuf,
}

impl ContainerDir {
    pub fn accounting_file(&self) -> PathBuf {
        self.path.join(gpumem_layout::FILE_NAME)
    }

    /// Creates the directory and its accounting file for `caps`, keeping a
    /// file with the same caps (see `accounting::prepare`).
    pub fn prepare(&self, caps: &[Cap]) -> Result<(), AccountingError> {
        accounting::prepare(&self.path, caps).map(drop)
    }

    /// Its caps, usage and live processes, read from its accounting file.
    pub fn accounting(&self) -> io::Result<Processes> {
        accounting::processes(&self.accounting_file())
    }

    pub fn remove(&self) -> io::Result<()> {
        std::fs::remove_dir_all(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::gpu::{FakeGpus, GpuSource};
    use crate::node::units::MemoryUnit;

    fn t4() -> Inventory {
        let text = "[[gpu]]\nuuid = \"GPU-6b1c2d3e-0000-4000-8000-000000000400\"\n\
                    name = \"Tesla T4\"\nmemory_mib = 15079\n";
        let gpus = FakeGpus::parse(text, Path::new("t4.toml"))
            .and_then(|fake| fake.discover())
            .unwrap();
        Inventory::new(gpus, MemoryUnit::GiB).unwrap()
    }

    #[test]
    fn a_name_depends_on_the_device_set_only_and_records_the_units() {
        let inv = t4();
        let key = inv.gpus()[0].key;
        let held = Assignment { gpu: 0, units: 2 };
        let ids = |units: [u32; 2]| units.map(|u| format!("{key}-{u}")).to_vec();
        let name = ContainerName::of(&inv, held, &ids([3, 7]));
        assert_eq!(name, ContainerName::of(&inv, held, &ids([7, 3])));
        assert_ne!(name, ContainerName::of(&inv, held, &ids([3, 8])));
        assert!(name.as_str().starts_with(&format!("{key}-2u-")), "{name}");
        assert_eq!(name.units(), Some(2));
        assert_eq!(name.assignment(&inv), Some(held));
        assert_eq!(ContainerName("junk".into()).units(), None);
        assert_eq!(ContainerName("junk".into()).assignment(&inv), None);
        assert_eq!(ContainerName("0badbeef-2u-0".into()).assignment(&inv), None);
        assert_eq!(ContainerName("a-b-c".into()).units(), None);
    }

    #[test]
    fn lists_prepares_reads_and_removes() {
        let state = tempfile::tempdir().unwrap();
        let containers = Containers::in_state_dir(state.path());
        assert!(containers.list().is_empty(), "no state dir yet: nothing");
        let inv = t4();
        let key = inv.gpus()[0].key;
        let held = Assignment { gpu: 0, units: 1 };
        let dir = containers.get(ContainerName::of(&inv, held, &[format!("{key}-0")]));
        let cap = Cap {
            uuid: inv.gpus()[0].gpu.uuid.clone(),
            cap_mib: 1077,
            context_charge_mib: 0,
        };
        dir.prepare(std::slice::from_ref(&cap)).unwrap();
        // A stray file beside the directories is not a container.
        std::fs::write(containers.root().join("stray"), b"").unwrap();

        assert_eq!(containers.list(), std::slice::from_ref(&dir));
        assert_eq!(containers.accounting_files(), [dir.accounting_file()]);
        let read = dir.accounting().unwrap();
        assert_eq!(read.devices[0].cap_bytes, 1077 << 20);
        assert!(read.live.is_empty());
        dir.remove().unwrap();
        assert!(containers.list().is_empty());
    }
}
