//! ListAndWatch's device list: the inventory in kubelet's words, and the
//! start-up checks that kubelet can receive it and live with it.

use std::time::Duration;

use crate::deviceplugin::api::deviceplugin::{self as dp, ListAndWatchResponse};
use crate::node::inventory::Inventory;
use crate::node::units::MemoryUnit;

/// Largest message kubelet's gRPC client accepts (grpc-go's default receive
/// limit); a bigger ListAndWatch reply disconnects the plugin.
pub const KUBELET_MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// An inventory whose device list kubelet could not receive.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "{devices} devices in {unit} units encode to up to {bytes} bytes per ListAndWatch message \
     (with every GPU Unhealthy), over kubelet's {limit}-byte limit; {}",
    too_large_advice(*.unit)
)]
pub struct TooLarge {
    pub devices: usize,
    pub unit: MemoryUnit,
    pub bytes: usize,
    pub limit: usize,
}

fn too_large_advice(unit: MemoryUnit) -> &'static str {
    match unit {
        MemoryUnit::MiB => "use --memory-unit GiB",
        // Only GPUs far larger than any made, or very many, get here.
        MemoryUnit::GiB => "this node has more GPU memory than one resource can advertise",
    }
}

/// Checks kubelet could receive `inv`'s device list, however its health
/// changes.
pub fn check(inv: &Inventory) -> Result<(), TooLarge> {
    // The largest list this inventory can send: every GPU Unhealthy
    // ("Unhealthy" is 2 bytes longer than "Healthy" per device). A
    // health change resends the whole list, and one kubelet cannot
    // receive ends the stream: kubelet drops the plugin's devices.
    // Counted, not built: this is what bounds the devices any list
    // holds (about 160,000), however many units the GPUs would make.
    let bytes = worst_list_len(inv);
    // Leave room for gRPC's 5-byte frame header.
    if bytes.saturating_add(5) > KUBELET_MAX_MESSAGE as u64 {
        return Err(TooLarge {
            devices: inv.device_count(),
            unit: inv.unit(),
            bytes: usize::try_from(bytes).unwrap_or(usize::MAX),
            limit: KUBELET_MAX_MESSAGE,
        });
    }
    Ok(())
}

/// What kubelet's device manager spends per pair of an advertised device
/// and an allocated one when a plugin registers after kubelet restarted:
/// it compares each with each under its lock, node capacity 0 and
/// admissions blocked meanwhile. Measured on kubelet v1.37.2 with 81559
/// devices (an H100 in MiB): 1024 units held, 9.2 s to 10.0 s; 4096, 35 s to
/// 43 s; 16384, 134 s to 151 s (docs/BENCHMARKS.md, "Real kubelet: restart
/// → allocatable").
const NANOS_PER_DEVICE_PAIR: u64 = 100;

/// A full node's kubelet restart stalling longer than this is said at
/// start.
pub const SLOW_RESTART: Duration = Duration::from_secs(60);

/// Says at start when [`slow_kubelet_restart`] finds one.
pub fn warn_of_slow_kubelet_restarts(inv: &Inventory) {
    if let Some(stall) = slow_kubelet_restart(inv) {
        tracing::warn!(
            devices = inv.device_count(),
            unit = %inv.unit(),
            "a kubelet restart with every unit allocated would keep this node's allocatable at 0 \
             and its admissions blocked for about {} s: kubelet compares each device with each \
             allocated one (README, \"Device IDs\"); --memory-unit GiB avoids it",
            stall.as_secs()
        );
    }
}

/// How long kubelet would keep the node at 0 allocatable and admissions
/// blocked after its restart with every unit of `inv` allocated, where
/// that is over [`SLOW_RESTART`] (many small units: `--memory-unit MiB` on
/// a GPU of more than about 24 GiB).
pub fn slow_kubelet_restart(inv: &Inventory) -> Option<Duration> {
    let devices = inv.device_count() as u64;
    let stall = Duration::from_nanos(
        devices
            .saturating_mul(devices)
            .saturating_mul(NANOS_PER_DEVICE_PAIR),
    );
    (stall > SLOW_RESTART).then_some(stall)
}

/// The encoded length of [`list_and_watch`] with every GPU Unhealthy,
/// worked out from the unit counts. A device ID is the 8-digit key, `-` and
/// the unit number, so devices differ only in how many digits their unit
/// number has.
fn worst_list_len(inv: &Inventory) -> u64 {
    use prost::encoding::{encoded_len_varint as varint, key_len};
    let health = dp::UNHEALTHY.len() as u64;
    let string = |tag, len: u64| (key_len(tag) as u64) + varint(len) as u64 + len;
    inv.gpus()
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

/// The complete device list, as every ListAndWatch message must carry it.
pub fn list_and_watch(inv: &Inventory) -> ListAndWatchResponse {
    let mut devices = Vec::with_capacity(inv.device_count());
    devices.extend(inv.devices().map(|(id, healthy)| dp::Device {
        id: id.to_string(),
        health: if healthy { dp::HEALTHY } else { dp::UNHEALTHY }.to_owned(),
        topology: None,
    }));
    ListAndWatchResponse { devices }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::inventory::{DeviceId, GpuKey};
    use prost::Message;

    use crate::node::gpu::test_gpu as gpu;

    #[test]
    fn list_covers_every_unit_once_and_locates_them() {
        let inv = Inventory::new(
            vec![gpu(0, "GPU-a", 16160), gpu(1, "GPU-b", 16160)],
            MemoryUnit::GiB,
        )
        .unwrap();
        let list = list_and_watch(&inv);
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
        assert!(list_and_watch(&h100).encoded_len() < KUBELET_MAX_MESSAGE);

        let eight: Vec<_> = (0..8)
            .map(|i| gpu(i, &format!("GPU-{i}"), 144_384))
            .collect();
        let err = check(&Inventory::new(eight.clone(), MemoryUnit::MiB).unwrap()).unwrap_err();
        assert!(err.to_string().contains("--memory-unit GiB"), "{err}");
        assert!(check(&Inventory::new(eight, MemoryUnit::GiB).unwrap()).is_ok());
    }

    #[test]
    fn an_accepted_inventory_fits_kubelets_limit_with_every_gpu_unhealthy() {
        // One H200 (143771 MiB): its Healthy list fits in MiB units, but
        // not the same list once the GPU is Unhealthy.
        let h200 = gpu(0, "GPU-h200", 143_771);
        let healthy = Inventory::new(vec![h200.clone()], MemoryUnit::MiB).unwrap();
        assert!(list_and_watch(&healthy).encoded_len() + 5 <= KUBELET_MAX_MESSAGE);
        let err = check(&healthy).unwrap_err();
        assert!(
            err.to_string().contains("(with every GPU Unhealthy)")
                && err.to_string().contains("--memory-unit GiB"),
            "{err}"
        );
        // Whatever is accepted still fits once unhealthy.
        for mib in [81_559, 100_000, 130_000] {
            let inv = Inventory::new(vec![gpu(0, "GPU-x", mib)], MemoryUnit::MiB).unwrap();
            if check(&inv).is_err() {
                continue;
            }
            let sick = inv.with_health("GPU-x", false).unwrap();
            assert!(
                list_and_watch(&sick).encoded_len() + 5 <= KUBELET_MAX_MESSAGE,
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
            let encoded = list_and_watch(&sick).encoded_len() as u64;
            assert_eq!(worst_list_len(&inv), encoded, "{units}");
        }
    }

    #[test]
    fn too_many_units_are_refused_without_listing_them() {
        // u32::MAX units of one GPU: counted in no time, never allocated.
        let start = std::time::Instant::now();
        let inv = Inventory::new(vec![gpu(0, "GPU-x", u64::MAX)], MemoryUnit::MiB).unwrap();
        let err = check(&inv).unwrap_err();
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
        assert!(
            matches!(err, TooLarge { devices, .. } if devices == u32::MAX as usize),
            "{err}"
        );
        // In GiB units the advice is not to use GiB units.
        let huge: Vec<_> = (0..12)
            .map(|i| gpu(i, &format!("GPU-{i}"), 16 << 20))
            .collect();
        let err = check(&Inventory::new(huge, MemoryUnit::GiB).unwrap()).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("more GPU memory than one resource can advertise"),
            "{err}"
        );
    }

    #[test]
    fn unhealthy_gpu_units_are_reported_unhealthy() {
        let mut sick = gpu(1, "GPU-b", 2048);
        sick.healthy = false;
        let inv = Inventory::new(vec![gpu(0, "GPU-a", 2048), sick], MemoryUnit::GiB).unwrap();
        let health: Vec<_> = list_and_watch(&inv)
            .devices
            .into_iter()
            .map(|d| d.health)
            .collect();
        assert_eq!(health, ["Healthy", "Healthy", "Unhealthy", "Unhealthy"]);
    }
}
