//! What each GPU's sensors read now (memory in use, utilisation, temperature,
//! power) and each process's share of the SMs, from NVML or the fake file.

use crate::error_text::chain;
use std::collections::HashMap;

use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use tracing::debug;

use crate::node::gpu::GpuError;

/// One GPU's readings. Each is optional: a GPU or driver that does not
/// support one (power on some boards, temperature under vGPU) leaves it out
/// rather than hiding the others.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuReading {
    /// Device memory allocated by anyone (NVML's `used`).
    pub memory_used_bytes: Option<u64>,
    /// Percent of the last sample period a kernel ran.
    pub utilization_percent: Option<u32>,
    pub temperature_celsius: Option<u32>,
    pub power_milliwatts: Option<u32>,
}

/// SM utilisation per process: GPU UUID → PID → percent of the GPU's SMs
/// over NVML's last sample period.
pub type ProcessSm = HashMap<String, HashMap<u32, u32>>;

/// Everything one look at the sensors saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Readings {
    /// By GPU UUID.
    pub gpus: HashMap<String, GpuReading>,
    pub process_sm: ProcessSm,
}

/// The seam where sensor readings enter: NVML on a node, the fake GPU file
/// in tests and the demo. Shared, so the metrics endpoint can keep it.
pub trait Sensors: Send + Sync {
    /// Reads every GPU. Blocking (NVML, or a file).
    fn read(&self) -> Result<Readings, GpuError>;
}

/// The sensors NVML reads.
pub struct NvmlSensors {
    nvml: &'static nvml_wrapper::Nvml,
}

impl NvmlSensors {
    /// Reads through the process's NVML ([`NvmlHardware`](crate::node::nvml::NvmlHardware)'s).
    pub fn new(nvml: &'static nvml_wrapper::Nvml) -> Self {
        NvmlSensors { nvml }
    }
}

impl Sensors for NvmlSensors {
    fn read(&self) -> Result<Readings, GpuError> {
        Ok(read_nvml(self.nvml))
    }
}

/// NVML's answers; a GPU or reading that fails is left out (the health
/// watch reports a GPU that fell off the bus).
fn read_nvml(nvml: &nvml_wrapper::Nvml) -> Readings {
    let mut readings = Readings::default();
    for index in 0..nvml.device_count().unwrap_or(0) {
        let device = match nvml.device_by_index(index) {
            Ok(device) => device,
            Err(err) => {
                debug!(gpu = index, err = %chain(&err), "no readings for this GPU");
                continue;
            }
        };
        let Ok(uuid) = device.uuid() else { continue };
        readings.gpus.insert(
            uuid.clone(),
            GpuReading {
                memory_used_bytes: device.memory_info().ok().map(|m| m.used),
                utilization_percent: device.utilization_rates().ok().map(|u| u.gpu),
                temperature_celsius: device.temperature(TemperatureSensor::Gpu).ok(),
                power_milliwatts: device.power_usage().ok(),
            },
        );
        // Every sample the driver buffered (a few seconds' worth): a
        // process's latest counts, so a scrape shows what runs now.
        let samples = device
            .process_utilization_stats(None::<u64>)
            .unwrap_or_default();
        let mut latest: HashMap<u32, (u64, u32)> = HashMap::new();
        for s in samples {
            let slot = latest.entry(s.pid).or_insert((s.timestamp, s.sm_util));
            if s.timestamp >= slot.0 {
                *slot = (s.timestamp, s.sm_util);
            }
        }
        readings.process_sm.insert(
            uuid,
            latest.into_iter().map(|(pid, (_, sm))| (pid, sm)).collect(),
        );
    }
    readings
}
