//! The node's advertised devices: each GPU split into units, the stable
//! device IDs that name them, and the ListAndWatch list kubelet receives.

use std::collections::HashMap;
use std::fmt;

use crate::deviceplugin::api::deviceplugin::{self as dp, ListAndWatchResponse};
use crate::node::gpu::Gpu;
use crate::node::units::{cap_mib, MemoryUnit};

/// Largest message kubelet's gRPC client accepts (grpc-go's default receive
/// limit); a bigger ListAndWatch reply disconnects the plugin.
pub const KUBELET_MAX_MESSAGE: usize = 4 * 1024 * 1024;

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
        "{devices} devices in {unit} units encode to up to {bytes} bytes per ListAndWatch message \
         (with every GPU Unhealthy), over kubelet's {limit}-byte limit; {}",
        too_large_advice(*.unit)
    )]
    TooLarge {
        devices: usize,
        unit: MemoryUnit,
        bytes: usize,
        limit: usize,
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

fn too_large_advice(unit: MemoryUnit) -> &'static str {
    match unit {
        MemoryUnit::MiB => "use --memory-unit GiB",
        // Only GPUs far larger than any made, or very many, get here.
        MemoryUnit::GiB => "this node has more GPU memory than one resource can advertise",
    }
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
    /// Splits `gpus` into units and checks kubelet could receive the list.
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
        let inventory = Inventory {
            unit,
            gpus: split,
            by_key,
        };
        // The largest list this inventory can send: every GPU Unhealthy
        // ("Unhealthy" is 2 bytes longer than "Healthy" per device). A
        // health change resends the whole list, and one kubelet cannot
        // receive ends the stream: kubelet drops the plugin's devices.
        // Counted, not built: this is what bounds the devices any list
        // holds (about 160,000), however many units the GPUs would make.
        let bytes = inventory.worst_list_len();
        // Leave room for gRPC's 5-byte frame header.
        if bytes.saturating_add(5) > KUBELET_MAX_MESSAGE as u64 {
            return Err(InventoryError::TooLarge {
                devices: inventory.device_count(),
                unit,
                bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
                limit: KUBELET_MAX_MESSAGE,
            });
        }
        Ok(inventory)
    }

    /// The encoded length of [`Inventory::list_and_watch`] with every GPU
    /// Unhealthy, worked out from the unit counts. A device ID is the 8-digit
    /// key, `-` and the unit number, so devices differ only in how many
    /// digits their unit number has.
    fn worst_list_len(&self) -> u64 {
        use prost::encoding::{encoded_len_varint as varint, key_len};
        let health = dp::UNHEALTHY.len() as u64;
        let string = |tag, len: u64| (key_len(tag) as u64) + varint(len) as u64 + len;
        self.gpus
            .iter()
            .map(|gpu| {
                let units = u64::from(gpu.units);
                let mut total = 0u64;
                // Units [low, high) have `digits` digits.
                let (mut low, mut high, mut digits) = (0u64, 10u64, 1u64);
                while low < units {
                    let device = string(1, 8 + 1 + digits) + string(2, health);
                    total += (units.min(high) - low) * string(1, device);
                    (low, high, digits) = (high, high * 10, digits + 1);
                }
                total
            })
            .sum()
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

    /// The complete device list, as every ListAndWatch message must carry it.
    pub fn list_and_watch(&self) -> ListAndWatchResponse {
        let mut devices = Vec::with_capacity(self.device_count());
        for gpu in &self.gpus {
            let health = if gpu.gpu.healthy {
                dp::HEALTHY
            } else {
                dp::UNHEALTHY
            };
            devices.extend((0..gpu.units).map(|unit| dp::Device {
                id: DeviceId { gpu: gpu.key, unit }.to_string(),
                health: health.to_owned(),
                topology: None,
            }));
        }
        ListAndWatchResponse { devices }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn gpu(index: u32, uuid: &str, memory_mib: u64) -> Gpu {
        Gpu {
            index,
            uuid: uuid.into(),
            name: "test".into(),
            memory_mib,
            healthy: true,
        }
    }

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
    fn list_covers_every_unit_once_and_locates_them() {
        let inv = Inventory::new(
            vec![gpu(0, "GPU-a", 16160), gpu(1, "GPU-b", 16160)],
            MemoryUnit::GiB,
        )
        .unwrap();
        let list = inv.list_and_watch();
        assert_eq!(list.devices.len(), 30);
        let mut seen = std::collections::HashSet::new();
        for d in &list.devices {
            assert!(seen.insert(d.id.clone()));
            assert!(d.id.len() <= 63);
            assert_eq!(d.health, "Healthy");
            assert!(inv.resolve(&d.id).is_some());
        }
        let out_of_range = DeviceId {
            gpu: GpuKey::of("GPU-a"),
            unit: 15,
        };
        assert_eq!(inv.locate(&out_of_range), None);
    }

    #[test]
    fn mib_mode_fits_one_h100_but_not_eight_141_gib_cards() {
        let h100 = Inventory::new(vec![gpu(0, "GPU-h100", 81559)], MemoryUnit::MiB).unwrap();
        assert_eq!(h100.device_count(), 81559);
        assert!(h100.list_and_watch().encoded_len() < KUBELET_MAX_MESSAGE);

        let eight: Vec<_> = (0..8)
            .map(|i| gpu(i, &format!("GPU-{i}"), 144_384))
            .collect();
        let err = Inventory::new(eight.clone(), MemoryUnit::MiB).unwrap_err();
        assert!(err.to_string().contains("--memory-unit GiB"), "{err}");
        assert!(Inventory::new(eight, MemoryUnit::GiB).is_ok());
    }

    #[test]
    fn an_accepted_inventory_fits_kubelets_limit_with_every_gpu_unhealthy() {
        // One H200 (143771 MiB): its Healthy list fits in MiB units, but
        // not the same list once the GPU is Unhealthy.
        let h200 = gpu(0, "GPU-h200", 143_771);
        let healthy = Inventory {
            unit: MemoryUnit::MiB,
            gpus: vec![GpuUnits {
                units: 143_771,
                key: GpuKey::of("GPU-h200"),
                gpu: h200.clone(),
            }],
            by_key: HashMap::new(),
        };
        assert!(healthy.list_and_watch().encoded_len() + 5 <= KUBELET_MAX_MESSAGE);
        let err = Inventory::new(vec![h200.clone()], MemoryUnit::MiB).unwrap_err();
        assert!(
            err.to_string().contains("(with every GPU Unhealthy)")
                && err.to_string().contains("--memory-unit GiB"),
            "{err}"
        );
        // Whatever is accepted still fits once unhealthy.
        for mib in [81_559, 100_000, 130_000] {
            let Ok(inv) = Inventory::new(vec![gpu(0, "GPU-x", mib)], MemoryUnit::MiB) else {
                continue;
            };
            let sick = inv.with_health("GPU-x", false).unwrap();
            assert!(
                sick.list_and_watch().encoded_len() + 5 <= KUBELET_MAX_MESSAGE,
                "{mib}"
            );
        }
    }

    #[test]
    fn the_worst_list_is_counted_as_prost_encodes_it() {
        // Unit counts on each side of a change in digits, on two GPUs.
        for units in [1u64, 9, 10, 11, 99, 100, 101, 1000, 10_001] {
            let gpus = vec![gpu(0, "GPU-a", units), gpu(1, "GPU-b", 3 * units + 1)];
            let inv = Inventory::new(gpus, MemoryUnit::MiB).unwrap();
            let mut sick = inv.with_health("GPU-a", false).unwrap();
            sick = sick.with_health("GPU-b", false).unwrap();
            let encoded = sick.list_and_watch().encoded_len() as u64;
            assert_eq!(inv.worst_list_len(), encoded, "{units}");
        }
    }

    #[test]
    fn too_many_units_are_refused_without_listing_them() {
        // u32::MAX units of one GPU: counted in no time, never allocated.
        let start = std::time::Instant::now();
        let err = Inventory::new(vec![gpu(0, "GPU-x", u64::MAX)], MemoryUnit::MiB).unwrap_err();
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
        assert!(
            matches!(err, InventoryError::TooLarge { devices, .. } if devices == u32::MAX as usize),
            "{err}"
        );
        // In GiB units the advice is not to use GiB units.
        let huge: Vec<_> = (0..12)
            .map(|i| gpu(i, &format!("GPU-{i}"), 16 << 20))
            .collect();
        let err = Inventory::new(huge, MemoryUnit::GiB).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("more GPU memory than one resource can advertise"),
            "{err}"
        );
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

    #[test]
    fn unhealthy_gpu_units_are_reported_unhealthy() {
        let mut sick = gpu(1, "GPU-b", 2048);
        sick.healthy = false;
        let inv = Inventory::new(vec![gpu(0, "GPU-a", 2048), sick], MemoryUnit::GiB).unwrap();
        let health: Vec<_> = inv
            .list_and_watch()
            .devices
            .into_iter()
            .map(|d| d.health)
            .collect();
        assert_eq!(health, ["Healthy", "Healthy", "Unhealthy", "Unhealthy"]);
    }
}
