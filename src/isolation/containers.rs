//! The containers' state on this node: one accounting directory per container
//! under `<state-dir>/containers`, named after the devices it holds. Allocate
//! creates them, status and metrics read them, clean-up removes them.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::isolation::accounting::{self, AccountingError, Cap, Processes};
use crate::isolation::statefs::{self, StateFs};
use crate::node::inventory::DeviceId;
use crate::node::inventory::Inventory;
use crate::node::placement::Assignment;
use crate::node::units::{cap_mib, MemoryUnit};

/// Under the state dir, the parent of the per-container directories.
const CONTAINERS: &str = "containers";
/// Names a DRA claim's directory (device plugin names start with hex).
const CLAIM_PREFIX: &str = gpumem_layout::CLAIM_DIR_PREFIX;

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

    /// The directory of the container holding `ids` (the devices of
    /// `assignment`): the one present under any unit's name (a container
    /// allocated before `--memory-unit` changed, or before names recorded
    /// the unit), else the one Allocate makes now.
    pub fn holding(&self, inv: &Inventory, assignment: Assignment, ids: &[String]) -> ContainerDir {
        ContainerName::of_devices_any_unit(ids)
            .into_iter()
            .map(|name| self.get(name))
            .find(|dir| dir.path.is_dir())
            .unwrap_or_else(|| self.get(ContainerName::of(inv, assignment, ids)))
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

    /// Every directory's accounting file, for reconciliation: also where it
    /// is missing, or a link or something else a container put in its
    /// place (reading refuses those), so that such a container is still
    /// held to its grant.
    pub fn accounting_files(&self) -> Vec<PathBuf> {
        self.list()
            .into_iter()
            .map(|dir| dir.accounting_file())
            .collect()
    }
}

/// A container's directory name, derived from the devices it holds:
/// `<gpu key>-<units>u-<hash of the device IDs>`. kubelet never gives the
/// same units to two live containers, and the name is the same if kubelet
/// calls Allocate again for the same container. A later container given the
/// same units gets the same name, so Allocate starts its file afresh, and
/// only containers kubelet holds get their CDI spec written again (see
/// `cleanup`).
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
    /// It records the unit the devices were counted in (`g`: GiB, `m`:
    /// MiB; names from before, with `u`, are in the inventory's unit), so a
    /// grant read back after `--memory-unit` changed is still the one
    /// Allocate gave.
    pub fn of(inv: &Inventory, assignment: Assignment, ids: &[String]) -> Self {
        Self::named(
            &inv.gpus()[assignment.gpu].key.to_string(),
            assignment.units,
            Some(inv.unit()),
            ids,
        )
    }

    fn named(key: &str, units: u32, unit: Option<MemoryUnit>, ids: &[String]) -> Self {
        let mut sorted: Vec<&str> = ids.iter().map(String::as_str).collect();
        sorted.sort_unstable();
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for byte in sorted.join(",").bytes() {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        let suffix = match unit {
            Some(MemoryUnit::GiB) => 'g',
            Some(MemoryUnit::MiB) => 'm',
            None => 'u',
        };
        ContainerName(format!("{key}-{units}{suffix}-{hash:016x}"))
    }

    /// Every name a container holding `ids` may have, whichever unit it was
    /// allocated in: for matching kubelet's list with the directories.
    pub fn of_devices_any_unit(ids: &[String]) -> Vec<Self> {
        let parsed: Option<Vec<DeviceId>> = ids.iter().map(|id| DeviceId::parse(id)).collect();
        let Some(parsed) = parsed.filter(|p| !p.is_empty()) else {
            return Vec::new();
        };
        if parsed.iter().any(|id| id.gpu != parsed[0].gpu) {
            return Vec::new();
        }
        let distinct: std::collections::BTreeSet<_> = parsed.iter().collect();
        let units = u32::try_from(distinct.len()).unwrap_or(u32::MAX);
        let key = parsed[0].gpu.to_string();
        [Some(MemoryUnit::GiB), Some(MemoryUnit::MiB), None]
            .into_iter()
            .map(|unit| Self::named(&key, units, unit, ids))
            .collect()
    }

    /// The GPU key and units the name records; `None` for a directory not
    /// named here.
    /// The unit is `None` for a name from before units were recorded: the
    /// inventory's.
    fn parts(&self) -> Option<(&str, u32, Option<MemoryUnit>)> {
        let mut parts = self.0.split('-');
        let (key, units, _hash) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let (units, unit) = if let Some(units) = units.strip_suffix('g') {
            (units, Some(MemoryUnit::GiB))
        } else if let Some(units) = units.strip_suffix('m') {
            (units, Some(MemoryUnit::MiB))
        } else {
            (units.strip_suffix('u')?, None)
        };
        Some((key, units.parse().ok()?, unit))
    }

    /// The unit the name records the units in; `None` for a directory not
    /// named here, or named before names recorded it.
    pub fn unit(&self) -> Option<MemoryUnit> {
        self.parts().and_then(|(_, _, unit)| unit)
    }

    /// The units the name records; `None` for a directory not named here.
    pub fn units(&self) -> Option<u32> {
        self.parts().map(|(_, units, _)| units)
    }

    /// The GPU (by its position in `inv`) and the units the name records:
    /// what Allocate gave the container, so its grant can be rebuilt without
    /// kubelet. `None` for a directory not named here or a GPU not on the node.
    pub fn assignment(&self, inv: &Inventory) -> Option<Assignment> {
        let (key, units, unit) = self.parts()?;
        if unit.is_some_and(|unit| unit != inv.unit()) {
            return None;
        }
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
        let (key, units, unit) = self.parts()?;
        let gpu = inv
            .gpus()
            .iter()
            .find(|g| g.gpu.uuid == uuid && g.key.to_string() == key)?;
        let unit = unit.unwrap_or(inv.unit());
        let memory = gpu.gpu.memory_mib;
        Some(cap_mib(units, unit.units_for(memory), memory))
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

    /// Creates the directory (on `fs`) and a new accounting file for `caps`
    /// at Allocate, whatever was there (see `accounting::prepare_afresh`).
    pub fn prepare_afresh(
        &self,
        caps: &[Cap],
        fs: StateFs,
    ) -> Result<accounting::Found, AccountingError> {
        accounting::prepare_afresh(&self.path, caps, fs).map(|(_, found)| found)
    }

    /// Its caps, usage and live processes, read from its accounting file.
    pub fn accounting(&self) -> io::Result<Processes> {
        accounting::processes(&self.accounting_file())
    }

    /// Removes the directory, its tmpfs detached first (containers that
    /// still have it mounted keep it until they end).
    pub fn remove(&self) -> io::Result<()> {
        statefs::unmount(&self.path)?;
        std::fs::remove_dir_all(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::fake::FakeGpus;
    use crate::node::units::MemoryUnit;

    fn t4() -> Inventory {
        let text = "[[gpu]]\nuuid = \"GPU-6b1c2d3e-0000-4000-8000-000000000400\"\n\
                    name = \"Tesla T4\"\nmemory_mib = 15079\n";
        let gpus = FakeGpus::parse(text, Path::new("t4.toml"))
            .map(|fake| fake.gpus())
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
        assert!(name.as_str().starts_with(&format!("{key}-2g-")), "{name}");
        assert_eq!(name.units(), Some(2));
        assert_eq!(name.assignment(&inv), Some(held));
        assert_eq!(ContainerName("junk".into()).units(), None);
        assert_eq!(ContainerName("junk".into()).assignment(&inv), None);
        assert_eq!(ContainerName("0badbeef-2u-0".into()).assignment(&inv), None);
        assert_eq!(ContainerName("a-b-c".into()).units(), None);
    }

    #[test]
    fn a_grant_is_read_in_the_unit_its_name_records() {
        let inv = t4();
        let (key, uuid) = (inv.gpus()[0].key, inv.gpus()[0].gpu.uuid.clone());
        let ids: Vec<String> = (0..4).map(|u| format!("{key}-{u}")).collect();
        let names = ContainerName::of_devices_any_unit(&ids);
        let [gib, mib, before] = names.as_slice() else {
            panic!("{names:?}")
        };
        assert_eq!(
            gib,
            &ContainerName::of(&inv, Assignment { gpu: 0, units: 4 }, &ids)
        );
        // 4 GiB units of the 15079 MiB T4 (14 units): 4308 MiB; 4 MiB units
        // are 4 MiB; a name from before is read in the configured unit.
        assert_eq!(gib.granted_mib(&inv, &uuid), Some(4308));
        assert_eq!(mib.granted_mib(&inv, &uuid), Some(4));
        assert_eq!(before.granted_mib(&inv, &uuid), Some(4308));
        assert_eq!(mib.assignment(&inv), None, "not this inventory's units");
        assert_eq!(
            before.assignment(&inv),
            Some(Assignment { gpu: 0, units: 4 })
        );
        // The directory present under any of the names is the container's.
        let state = tempfile::tempdir().unwrap();
        let containers = Containers::in_state_dir(state.path());
        std::fs::create_dir_all(containers.get(before.clone()).path).unwrap();
        let found = containers.holding(&inv, Assignment { gpu: 0, units: 4 }, &ids);
        assert_eq!(&found.name, before);
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
        dir.prepare_afresh(std::slice::from_ref(&cap), StateFs::Shared)
            .unwrap();
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
