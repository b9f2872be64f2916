//! The node's advertised devices: each GPU split into units, the stable
//! device IDs that name them, and each device's health.

use std::collections::HashMap;
use std::fmt;

use crate::node::gpu::Gpu;
use crate::node::units::{cap_mib, MemoryUnit};

/// A GPU with its share of units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuUnits {
    pub gpu: Gpu,
    /// Short, stable key derived from the UUID; the first half of each device ID.
    pub key: GpuKey,
    pub units: u32,
}

impl GpuUnits {
    /// MiB cap for a container holding `held` units of this GPU.
    pub fn cap_mib(&self, held: u32) -> u64 {
        cap_mib(held, self.units, self.gpu.memory_mib)
    }
}

/// 32-bit FNV-1a of the GPU UUID, printed as 8 hex digits. Derived from the
/// UUID (not the index) so IDs survive reboots and GPU reordering, and kept
/// short so MiB mode on an 80 GiB card still fits kubelet's message limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuKey(u32);

impl GpuKey {
    pub fn of(uuid: &str) -> Self {
        let mut hash: u32 = 0x811c_9dc5;
        for byte in uuid.bytes() {
            hash ^= u32::from(byte);
            hash = hash.wrapping_mul(0x0100_0193);
        }
        GpuKey(hash)
    }
}

impl fmt::Display for GpuKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:08x}", self.0)
    }
}

/// One unit of one GPU: `<gpu key>-<unit number>`, e.g. `3f2a9c01-13`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId {
    pub gpu: GpuKey,
    pub unit: u32,
}

impl DeviceId {
    /// Parses the textual form; `None` for anything we could not have produced.
    pub fn parse(text: &str) -> Option<Self> {
        let (key, unit) = text.split_once('-')?;
        if key.len() != 8 || unit.is_empty() || unit.len() > 10 {
            return None;
        }
        // Reject signs and leading zeros so each unit has exactly one spelling.
        if !unit.bytes().all(|b| b.is_ascii_digit()) || (unit.len() > 1 && unit.starts_with('0')) {
            return None;
        }
        if !key.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        Some(DeviceId {
            gpu: GpuKey(u32::from_str_radix(key, 16).ok()?),
            unit: unit.parse().ok()?,
        })
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.gpu, self.unit)
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InventoryError {
    #[error(
        "GPUs {first} and {second} hash to the same device ID prefix {key}; please report this"
    )]
    KeyCollision {
        first: String,
        second: String,
        key: GpuKey,
    },
    #[error(
        "{} smaller than one 1 {unit} unit, so there is nothing to advertise; use \
         --memory-unit MiB",
        describe_small(.gpus)
    )]
    SmallerThanOneUnit {
        /// UUID and memory of each GPU.
        gpus: Vec<(String, u64)>,
        unit: MemoryUnit,
    },
}

fn describe_small(gpus: &[(String, u64)]) -> String {
    let each: Vec<String> = gpus
        .iter()
        .map(|(uuid, mib)| format!("{uuid} ({mib} MiB)"))
        .collect();
    match each.as_slice() {
        [one] => format!("GPU {one} is"),
        _ => format!("GPUs {} are", each.join(", ")),
    }
}

/// What the plugin advertises. Immutable; a health change builds a new one.
#[derive(Debug, Clone)]
pub struct Inventory {
    unit: MemoryUnit,
    gpus: Vec<GpuUnits>,
    by_key: HashMap<GpuKey, usize>,
}

impl Inventory {
    /// Splits `gpus` into units.
    pub fn new(gpus: Vec<Gpu>, unit: MemoryUnit) -> Result<Self, InventoryError> {
        let mut by_key = HashMap::with_capacity(gpus.len());
        let mut split = Vec::with_capacity(gpus.len());
        for (position, gpu) in gpus.into_iter().enumerate() {
            let key = GpuKey::of(&gpu.uuid);
            if let Some(&other) = by_key.get(&key) {
                let first: &GpuUnits = &split[other];
                return Err(InventoryError::KeyCollision {
                    first: first.gpu.uuid.clone(),
                    second: gpu.uuid,
                    key,
                });
            }
            by_key.insert(key, position);
            split.push(GpuUnits {
                units: unit.units_for(gpu.memory_mib),
                key,
                gpu,
            });
        }
        let small: Vec<(String, u64)> = split
            .iter()
            .filter(|g| g.units == 0)
            .map(|g| (g.gpu.uuid.clone(), g.gpu.memory_mib))
            .collect();
        if !small.is_empty() && small.len() == split.len() {
            return Err(InventoryError::SmallerThanOneUnit { gpus: small, unit });
        }
        for (uuid, mib) in &small {
            tracing::warn!(
                "GPU {uuid} ({mib} MiB) is smaller than one 1 {unit} unit and is not advertised; \
                 --memory-unit MiB would advertise it"
            );
        }
        Ok(Inventory {
            unit,
            gpus: split,
            by_key,
        })
    }

    /// This inventory with one GPU's health changed; `None` when the UUID is
    /// unknown or already has that health.
    pub fn with_health(&self, uuid: &str, healthy: bool) -> Option<Inventory> {
        let position = self
            .gpus
            .iter()
            .position(|g| g.gpu.uuid == uuid && g.gpu.healthy != healthy)?;
        let mut updated = self.clone();
        updated.gpus[position].gpu.healthy = healthy;
        Some(updated)
    }

    pub fn unit(&self) -> MemoryUnit {
        self.unit
    }

    pub fn gpus(&self) -> &[GpuUnits] {
        &self.gpus
    }

    /// Total advertised devices (units) over all GPUs.
    pub fn device_count(&self) -> usize {
        self.gpus.iter().map(|g| g.units as usize).sum()
    }

    /// Position in `gpus()` of the GPU a device ID belongs to, if it is ours.
    pub fn locate(&self, id: &DeviceId) -> Option<usize> {
        let &position = self.by_key.get(&id.gpu)?;
        (id.unit < self.gpus[position].units).then_some(position)
    }

    /// Parses and locates a device ID string.
    pub fn resolve(&self, id: &str) -> Option<(DeviceId, usize)> {
        let parsed = DeviceId::parse(id)?;
        Some((parsed, self.locate(&parsed)?))
    }

    /// Every device, each GPU's units in order, with its GPU's health.
    pub fn devices(&self) -> impl Iterator<Item = (DeviceId, bool)> + '_ {
        self.gpus.iter().flat_map(|gpu| {
            (0..gpu.units).map(move |unit| (DeviceId { gpu: gpu.key, unit }, gpu.gpu.healthy))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::node::gpu::test_gpu as gpu;

    #[test]
    fn ids_round_trip_and_reject_foreign_spellings() {
        let id = DeviceId {
            gpu: GpuKey::of("GPU-x"),
            unit: 13,
        };
        assert_eq!(DeviceId::parse(&id.to_string()), Some(id));
        for bad in [
            "",
            "-",
            "abc-1",
            "0123456g-1",
            "01234567-",
            "01234567-01",
            "01234567-+1",
            "01234567-1-2",
            "0123456A-1",
            "GPU-6b1c2d3e-0000-4000-8000-000000000400",
        ] {
            assert_eq!(DeviceId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn v100_pair_gets_distinct_keys_despite_similar_uuids() {
        let a = GpuKey::of("GPU-1a2b3c4d-0000-4000-8000-000000010000");
        let b = GpuKey::of("GPU-1a2b3c4d-0000-4000-8000-000000010001");
        assert_ne!(a, b);
    }

    #[test]
    fn a_gpu_smaller_than_one_unit_is_named_with_the_fix() {
        let err = Inventory::new(vec![gpu(0, "GPU-tiny", 500)], MemoryUnit::GiB).unwrap_err();
        assert_eq!(
            err.to_string(),
            "GPU GPU-tiny (500 MiB) is smaller than one 1 GiB unit, so there is nothing to \
             advertise; use --memory-unit MiB"
        );
        let inv = Inventory::new(vec![gpu(0, "GPU-tiny", 500)], MemoryUnit::MiB).unwrap();
        assert_eq!(inv.device_count(), 500);
        // Beside a real GPU, the small one is left out with a warning.
        let mixed = Inventory::new(
            vec![gpu(0, "GPU-tiny", 500), gpu(1, "GPU-b", 2048)],
            MemoryUnit::GiB,
        )
        .unwrap();
        assert_eq!(mixed.device_count(), 2);
    }
}
