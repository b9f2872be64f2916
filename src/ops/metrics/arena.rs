//! The opt-in series named as Alibaba Cloud's GPU exporter names them
//! (`--arena-metrics`), which `arena top node` and `arena top job` read
//! from Prometheus: each GPU's memory and duty cycle, each pod's memory.
//!
//! arena (kubeflow/arena pkg/prometheus) asks for
//! `{__name__=~"nvidia_gpu_duty_cycle|nvidia_gpu_memory_used_bytes|nvidia_gpu_memory_total_bytes", node_name=~…}`
//! (or `pod_name=~…`), keys each series by `node_name` and `minor_number`
//! (the GPU's index), keeps the last value it reads of a GPU's total and
//! duty cycle, and takes a GPU's used memory as the sum of its series with
//! `allocate_mode="share"` where there are any, else the last. So every
//! series of one GPU carries the same total and duty cycle, the GPU's own
//! used series has no `allocate_mode`, and each pod's has `share`.

use std::collections::BTreeMap;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::gauge::ConstGauge;

use super::encode::{bytes, family, Labels, NodeCollector, Reading};
use crate::ops::status::GpuStatus;
use crate::sync::LockExt;

/// Encodes the latest reading of the collector it shares, unprefixed.
#[derive(Debug)]
pub(super) struct ArenaCollector(pub(super) std::sync::Arc<NodeCollector>);

/// A pod on a GPU: (namespace, pod) → MiB its containers there use.
type PodsOnGpu = BTreeMap<(String, String), u64>;

fn gpu_labels(gpu: &GpuStatus, node: &str) -> Labels {
    vec![
        ("node_name", node.to_owned()),
        ("uuid", gpu.uuid.clone()),
        ("minor_number", gpu.index.to_string()),
    ]
}

fn pod_labels(gpu: &GpuStatus, node: &str, (namespace, pod): &(String, String)) -> Labels {
    let mut labels = gpu_labels(gpu, node);
    labels.extend([
        ("namespace_name", namespace.clone()),
        ("pod_name", pod.clone()),
        ("allocate_mode", "share".to_owned()),
    ]);
    labels
}

/// Each GPU with the pods on it whose usage is known (shim isolation).
fn pods_by_gpu(r: &Reading) -> Vec<(&GpuStatus, PodsOnGpu)> {
    r.status
        .gpus
        .iter()
        .map(|gpu| {
            let mut pods = PodsOnGpu::new();
            for c in r.status.containers.iter().filter(|c| c.gpu == gpu.index) {
                let (Some(namespace), Some(pod), Some(used)) = (&c.namespace, &c.pod, c.used_mib)
                else {
                    continue;
                };
                *pods.entry((namespace.clone(), pod.clone())).or_default() += used;
            }
            (gpu, pods)
        })
        .collect()
}

impl Collector for ArenaCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let reading = self.0.reading.lock_unpoisoned();
        let Some(r) = reading.as_ref() else {
            return Ok(());
        };
        let node = r.hostname.as_str();
        let gpus = pods_by_gpu(r);
        // The GPU's series, then one per pod on it, all with `value`.
        let every_series = |value: &dyn Fn(&GpuStatus) -> Option<f64>| {
            let mut samples: Vec<(Labels, ConstGauge<f64>)> = Vec::new();
            for (gpu, pods) in &gpus {
                let Some(v) = value(gpu) else { continue };
                samples.push((gpu_labels(gpu, node), ConstGauge::new(v)));
                for pod in pods.keys() {
                    samples.push((pod_labels(gpu, node, pod), ConstGauge::new(v)));
                }
            }
            samples
        };
        let e = &mut encoder;
        family(
            e,
            "nvidia_gpu_memory_total_bytes",
            "GPU memory as NVML reports it (on the GPU's series and each of its pods')",
            every_series(&|g| Some(bytes(g.memory_mib) as f64)),
        )?;
        family(
            e,
            "nvidia_gpu_duty_cycle",
            "Percent of NVML's last sample period in which a kernel ran on the GPU (on the \
             GPU's series and each of its pods')",
            every_series(&|g| {
                let percent = r.sensors.gpus.get(&g.uuid)?.utilization_percent?;
                Some(f64::from(percent))
            }),
        )?;
        let mut used: Vec<(Labels, ConstGauge<f64>)> = Vec::new();
        for (gpu, pods) in &gpus {
            if let Some(v) = r
                .sensors
                .gpus
                .get(&gpu.uuid)
                .and_then(|s| s.memory_used_bytes)
            {
                used.push((gpu_labels(gpu, node), ConstGauge::new(v as f64)));
            }
            for (pod, mib) in pods {
                used.push((
                    pod_labels(gpu, node, pod),
                    ConstGauge::new(bytes(*mib) as f64),
                ));
            }
        }
        family(
            e,
            "nvidia_gpu_memory_used_bytes",
            "GPU memory in use: the GPU's as NVML counts it, and each pod's containers' on it \
             (allocate_mode=\"share\")",
            used,
        )
    }
}
