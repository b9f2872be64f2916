//! `gpumem node-template`: what a node group's template must say so that an
//! autoscaler can add a gpumem node from zero — the capacity the plugin will
//! advertise for its GPUs, worked out as the plugin does, and the labels the
//! DaemonSet selects — in each autoscaler's own keys.
//!
//! Keys as cluster-autoscaler reads them (cloudprovider/aws/aws_manager.go,
//! cloudprovider/azure/azure_template.go and azure_util.go,
//! cloudprovider/clusterapi/clusterapi_utils.go and
//! clusterapi_unstructured.go) and as Karpenter's `NodeOverlay`
//! (karpenter.sh/v1alpha1) takes extended resources.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use serde::Serialize;
use serde_json::json;

use crate::cluster::gpushare::GPU_COUNT;
use crate::deviceplugin::list;
use crate::dra::slice;
use crate::node::fake::FakeGpus;
use crate::node::gpu::{Gpu, GpuError, NodeFacts, MAX_GPU_MEMORY_MIB};
use crate::node::inventory::{Inventory, InventoryError};
use crate::node::resource::ResourceName;
use crate::node::units::MemoryUnit;

/// A GPU model whose memory, as NVML reports it, is known.
pub struct KnownGpu {
    /// What `--gpu` takes (also the NVML name, in any case).
    pub short: &'static str,
    /// The name NVML reports.
    pub name: &'static str,
    /// Total memory as NVML reports it (less than the marketed size).
    pub memory_mib: u64,
}

/// Only figures read from real GPUs: a model missing here is given with
/// `--gpu-mib` (what `nvidia-smi --query-gpu=memory.total` says) or a fake
/// GPU file.
pub const KNOWN_GPUS: &[KnownGpu] = &[
    KnownGpu {
        short: "t4",
        name: "Tesla T4",
        memory_mib: 15079,
    },
    KnownGpu {
        short: "v100-16gb",
        name: "Tesla V100-SXM2-16GB",
        memory_mib: 16160,
    },
    KnownGpu {
        short: "h100-80gb",
        name: "NVIDIA H100 80GB HBM3",
        memory_mib: 81559,
    },
];

/// The model `--gpu` names: its short name or its NVML name, in any case.
pub fn known_gpu(name: &str) -> Option<&'static KnownGpu> {
    let name = name.trim();
    KNOWN_GPUS
        .iter()
        .find(|g| g.short.eq_ignore_ascii_case(name) || g.name.eq_ignore_ascii_case(name))
}

/// Where the template's GPUs come from.
#[derive(Debug, Clone)]
pub enum GpuChoice {
    /// A model of [`KNOWN_GPUS`] (`--gpu`), `count` of them.
    Model(String, u32),
    /// GPUs of this many MiB (`--gpu-mib`), `count` of them.
    Mib(u64, u32),
    /// The GPUs a fake GPU file describes (`--fake-gpus`).
    File(PathBuf),
}

impl GpuChoice {
    /// The GPUs, as discovery would give them to the plugin.
    pub fn gpus(&self) -> Result<Vec<Gpu>, TemplateError> {
        match self {
            GpuChoice::Model(model, count) => {
                let known = known_gpu(model).ok_or_else(|| TemplateError::UnknownModel {
                    model: model.clone(),
                    known: KNOWN_GPUS
                        .iter()
                        .map(|g| format!("{} ({}, {} MiB)", g.short, g.name, g.memory_mib))
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
                Ok(gpus_of(known.name, known.memory_mib, *count))
            }
            GpuChoice::Mib(mib, count) => {
                if *mib == 0 || *mib > MAX_GPU_MEMORY_MIB {
                    return Err(TemplateError::BadMib(*mib));
                }
                Ok(gpus_of("GPU", *mib, *count))
            }
            GpuChoice::File(path) => Ok(FakeGpus::from_file(path)?.gpus()),
        }
    }
}

/// `count` GPUs of `memory_mib` named `name`, as the plugin would discover
/// them (each its own UUID: the inventory keys GPUs by it).
pub fn gpus_of(name: &str, memory_mib: u64, count: u32) -> Vec<Gpu> {
    (0..count)
        .map(|index| Gpu {
            index,
            uuid: format!("GPU-node-template-{index}"),
            name: name.to_owned(),
            memory_mib,
            healthy: true,
        })
        .collect()
}

/// A node label (`--label KEY=VALUE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub key: String,
    pub value: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid label {0:?}: expected KEY=VALUE, with no ',' (Cluster API's labels annotation separates labels with it)")]
pub struct BadLabel(String);

impl std::str::FromStr for Label {
    type Err = BadLabel;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() && !s.contains(',') => Ok(Label {
                key: key.trim().to_owned(),
                value: value.trim().to_owned(),
            }),
            _ => Err(BadLabel(s.to_owned())),
        }
    }
}

/// The output formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// AWS Auto Scaling group tags.
    Aws,
    /// Azure VM scale set tags.
    Azure,
    /// Annotations on a Cluster API MachineDeployment or MachineSet.
    ClusterApi,
    /// A Karpenter `NodeOverlay`.
    Karpenter,
    /// Everything, for scripts.
    Json,
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("no GPUs: --count must be at least 1")]
    NoGpus,
    #[error("unknown --gpu {model:?}: known models are {known}; give any other with --gpu-mib")]
    UnknownModel { model: String, known: String },
    #[error("invalid --gpu-mib {0}: expected 1 to {MAX_GPU_MEMORY_MIB} MiB")]
    BadMib(u64),
    #[error(transparent)]
    Gpus(#[from] GpuError),
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    #[error("the plugin could not advertise these GPUs")]
    TooLarge(#[from] list::TooLarge),
    #[error(
        "resource {0:?} cannot be written as an Azure tag: cluster-autoscaler reads '_' in the \
         tag's name as '/'"
    )]
    AzureResource(String),
    #[error(
        "a Karpenter NodeOverlay needs --instance-type or --node-pool: without requirements it \
         would add this capacity to every instance type"
    )]
    OverlayForEverything,
}

/// What a node of the group will offer, in the plugin's own arithmetic.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeTemplate {
    pub resource_name: String,
    pub memory_unit: String,
    /// Units of the resource: each GPU's whole units, summed.
    pub units: u64,
    pub gpu_count: usize,
    pub gpus: Vec<TemplateGpu>,
    pub labels: BTreeMap<String, String>,
    /// The devices the DRA driver (`gpumem dra`) publishes in its
    /// ResourceSlice for these GPUs, less what only the node knows (each
    /// GPU's UUID, the driver's versions): for autoscalers that simulate
    /// claims from templates of a node's slices (Karpenter's cloud
    /// providers' `ResourceSliceTemplates`).
    pub dra_devices: Vec<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateGpu {
    pub model: String,
    pub memory_mib: u64,
    pub units: u32,
}

/// Where a Karpenter `NodeOverlay` applies.
#[derive(Debug, Clone, Default)]
pub struct OverlayScope {
    pub name: Option<String>,
    pub instance_types: Vec<String>,
    pub node_pool: Option<String>,
}

impl NodeTemplate {
    /// The template for a node with `gpus`, split into units as the plugin
    /// splits them (and refused where the plugin would refuse them).
    pub fn new(
        gpus: Vec<Gpu>,
        unit: MemoryUnit,
        resource_name: &ResourceName,
        labels: &[Label],
    ) -> Result<Self, TemplateError> {
        if gpus.is_empty() {
            return Err(TemplateError::NoGpus);
        }
        let inventory = Inventory::new(gpus, unit)?;
        list::check(&inventory)?;
        let published = slice::build("", "", "", &inventory, &NodeFacts::default(), 0);
        let dra_devices = published
            .spec
            .devices
            .unwrap_or_default()
            .into_iter()
            .map(|mut device| {
                if let Some(attributes) = device.attributes.as_mut() {
                    attributes.remove("uuid");
                }
                serde_json::to_value(device).unwrap_or_default()
            })
            .collect();
        Ok(NodeTemplate {
            resource_name: resource_name.to_string(),
            memory_unit: unit.to_string(),
            units: inventory.gpus().iter().map(|g| u64::from(g.units)).sum(),
            gpu_count: inventory.gpus().len(),
            gpus: inventory
                .gpus()
                .iter()
                .map(|g| TemplateGpu {
                    model: g.gpu.name.clone(),
                    memory_mib: g.gpu.memory_mib,
                    units: g.units,
                })
                .collect(),
            labels: labels
                .iter()
                .map(|l| (l.key.clone(), l.value.clone()))
                .collect(),
            dra_devices,
        })
    }

    /// The node's capacity in gpumem's resources: the units, and gpushare's
    /// GPU count that gpumem publishes beside them.
    pub fn capacity(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (self.resource_name.clone(), self.units.to_string()),
            (GPU_COUNT.to_owned(), self.gpu_count.to_string()),
        ])
    }

    /// AWS Auto Scaling group tags.
    pub fn aws_tags(&self) -> BTreeMap<String, String> {
        const PREFIX: &str = "k8s.io/cluster-autoscaler/node-template/";
        let mut tags = BTreeMap::new();
        for (name, value) in self.capacity() {
            tags.insert(format!("{PREFIX}resources/{name}"), value);
        }
        for (key, value) in &self.labels {
            tags.insert(format!("{PREFIX}label/{key}"), value.clone());
        }
        tags
    }

    /// Azure VM scale set tags: Azure tag names cannot hold '/', so
    /// cluster-autoscaler reads '_' as '/' (and, in label keys, "~2" as '_').
    pub fn azure_tags(&self) -> Result<BTreeMap<String, String>, TemplateError> {
        const PREFIX: &str = "k8s.io_cluster-autoscaler_node-template_";
        let mut tags = BTreeMap::new();
        for (name, value) in self.capacity() {
            if name.contains('_') {
                return Err(TemplateError::AzureResource(name));
            }
            tags.insert(
                format!("{PREFIX}resources_{}", name.replace('/', "_")),
                value,
            );
        }
        for (key, value) in &self.labels {
            let key = key.replace('_', "~2").replace('/', "_");
            tags.insert(format!("{PREFIX}label_{key}"), value.clone());
        }
        Ok(tags)
    }

    /// Cluster API annotations. cluster-autoscaler's Cluster API provider
    /// has no key for an arbitrary extended resource: `gpu-type` names one
    /// resource and `gpu-count` is its quantity, so the units go there and
    /// gpushare's GPU count cannot be said.
    pub fn cluster_api_annotations(&self) -> BTreeMap<String, String> {
        const PREFIX: &str = "capacity.cluster-autoscaler.kubernetes.io/";
        let mut annotations = BTreeMap::from([
            (format!("{PREFIX}gpu-type"), self.resource_name.clone()),
            (format!("{PREFIX}gpu-count"), self.units.to_string()),
        ]);
        if !self.labels.is_empty() {
            annotations.insert(format!("{PREFIX}labels"), self.labels_text(","));
        }
        annotations
    }

    /// A Karpenter `NodeOverlay` adding the capacity to the instance types
    /// (or node pool) in `scope`.
    pub fn karpenter_overlay(
        &self,
        scope: &OverlayScope,
    ) -> Result<serde_json::Value, TemplateError> {
        let mut requirements = Vec::new();
        if !scope.instance_types.is_empty() {
            requirements.push(json!({
                "key": "node.kubernetes.io/instance-type",
                "operator": "In",
                "values": scope.instance_types,
            }));
        }
        if let Some(pool) = &scope.node_pool {
            requirements.push(json!({
                "key": "karpenter.sh/nodepool",
                "operator": "In",
                "values": [pool],
            }));
        }
        if requirements.is_empty() {
            return Err(TemplateError::OverlayForEverything);
        }
        let name = scope.name.clone().unwrap_or_else(|| self.default_name());
        Ok(json!({
            "apiVersion": "karpenter.sh/v1alpha1",
            "kind": "NodeOverlay",
            "metadata": {"name": name},
            "spec": {"requirements": requirements, "capacity": self.capacity()},
        }))
    }

    /// The labels as `key=value`, joined by `separator`.
    fn labels_text(&self, separator: &str) -> String {
        let labels: Vec<String> = self
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        labels.join(separator)
    }

    /// `gpumem-<count>x-<model>`, as a DNS label.
    fn default_name(&self) -> String {
        let model = self.gpus.first().map(|g| g.model.as_str()).unwrap_or("gpu");
        let slug: String = model
            .to_ascii_lowercase()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let slug = slug
            .split('-')
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>();
        let name = format!("gpumem-{}x-{}", self.gpu_count, slug.join("-"));
        name.chars()
            .take(63)
            .collect::<String>()
            .trim_end_matches('-')
            .to_owned()
    }

    /// The template in `format`.
    pub fn render(&self, format: Format, scope: &OverlayScope) -> Result<String, TemplateError> {
        let mut out = String::new();
        let gpus = self.describe_gpus();
        match format {
            Format::Aws => {
                let _ = writeln!(
                    out,
                    "# AWS Auto Scaling group tags for cluster-autoscaler (scale from zero): {gpus}"
                );
                yaml_map(&mut out, "", &self.aws_tags());
            }
            Format::Azure => {
                let _ = writeln!(
                    out,
                    "# Azure VM scale set tags for cluster-autoscaler (scale from zero): {gpus}"
                );
                yaml_map(&mut out, "", &self.azure_tags()?);
            }
            Format::ClusterApi => {
                let _ = writeln!(
                    out,
                    "# Cluster API MachineDeployment/MachineSet annotations for cluster-autoscaler \
                     (scale from zero): {gpus}\n# gpu-type names the one extended resource this \
                     provider can template; {GPU_COUNT} cannot be given. Not with the dra-driver \
                     annotation (gpu-count would then count devices)."
                );
                yaml_map(&mut out, "", &self.cluster_api_annotations());
            }
            Format::Karpenter => {
                let overlay = self.karpenter_overlay(scope)?;
                let _ = writeln!(
                    out,
                    "# Karpenter NodeOverlay (karpenter.sh/v1alpha1, feature gate NodeOverlay): {gpus}"
                );
                if !self.labels.is_empty() {
                    let _ = writeln!(
                        out,
                        "# The NodePool's spec.template.metadata.labels must carry {} for the \
                         DaemonSet to run there.",
                        self.labels_text(", ")
                    );
                }
                yaml_value(&mut out, 0, &overlay);
            }
            Format::Json => {
                let mut all = serde_json::to_value(self).unwrap_or_default();
                all["capacity"] = json!(self.capacity());
                all["aws"] = json!(self.aws_tags());
                all["azure"] = match self.azure_tags() {
                    Ok(tags) => json!(tags),
                    Err(err) => json!({"error": err.to_string()}),
                };
                all["clusterApi"] = json!(self.cluster_api_annotations());
                if let Ok(overlay) = self.karpenter_overlay(scope) {
                    all["karpenter"] = overlay;
                }
                out = serde_json::to_string_pretty(&all).unwrap_or_default();
                out.push('\n');
            }
        }
        Ok(out)
    }

    /// "2 × Tesla V100-SXM2-16GB (16160 MiB: 15 units of 1 GiB each) = 30 aliyun.com/gpu-mem".
    fn describe_gpus(&self) -> String {
        let mut models: Vec<(&TemplateGpu, usize)> = Vec::new();
        for gpu in &self.gpus {
            match models
                .iter_mut()
                .find(|(g, _)| g.model == gpu.model && g.memory_mib == gpu.memory_mib)
            {
                Some((_, n)) => *n += 1,
                None => models.push((gpu, 1)),
            }
        }
        let each: Vec<String> = models
            .iter()
            .map(|(g, n)| {
                format!(
                    "{n} × {} ({} MiB: {} units of 1 {} each)",
                    g.model, g.memory_mib, g.units, self.memory_unit
                )
            })
            .collect();
        format!(
            "{} = {} {}",
            each.join(" + "),
            self.units,
            self.resource_name
        )
    }
}

/// `map` as YAML, keys plain (Kubernetes names, tag names), values as JSON
/// strings (valid YAML double-quoted scalars).
fn yaml_map(out: &mut String, indent: &str, map: &BTreeMap<String, String>) {
    for (key, value) in map {
        let _ = writeln!(out, "{indent}{key}: {}", json!(value));
    }
}

/// A small YAML writer for the overlay: objects and arrays of objects or
/// strings, strings quoted.
fn yaml_value(out: &mut String, depth: usize, value: &serde_json::Value) {
    let pad = "  ".repeat(depth);
    let serde_json::Value::Object(map) = value else {
        return;
    };
    for (key, value) in map {
        match value {
            serde_json::Value::Object(_) => {
                let _ = writeln!(out, "{pad}{key}:");
                yaml_value(out, depth + 1, value);
            }
            serde_json::Value::Array(items) => {
                let _ = writeln!(out, "{pad}{key}:");
                for item in items {
                    match item {
                        serde_json::Value::Object(_) => {
                            let mut nested = String::new();
                            yaml_value(&mut nested, 0, item);
                            for (i, line) in nested.lines().enumerate() {
                                let lead = if i == 0 { "- " } else { "  " };
                                let _ = writeln!(out, "{pad}{lead}{line}");
                            }
                        }
                        other => {
                            let _ = writeln!(out, "{pad}- {other}");
                        }
                    }
                }
            }
            other => {
                let _ = writeln!(out, "{pad}{key}: {other}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(model: &str, count: u32, unit: MemoryUnit) -> NodeTemplate {
        let gpu = known_gpu(model).unwrap();
        NodeTemplate::new(
            gpus_of(gpu.name, gpu.memory_mib, count),
            unit,
            &ResourceName::default(),
            &["gpushare=true".parse().unwrap()],
        )
        .unwrap()
    }

    #[test]
    fn units_are_summed_per_gpu_not_over_the_node() {
        // 2 × 16160 MiB = 32320 MiB would be 31 GiB over the node; the
        // plugin advertises 15 per GPU.
        let t = template("v100-16gb", 2, MemoryUnit::GiB);
        assert_eq!(t.units, 30);
        assert_eq!(t.gpu_count, 2);
        assert_eq!(template("T4", 1, MemoryUnit::MiB).units, 15079);
        assert_eq!(
            template("NVIDIA H100 80GB HBM3", 1, MemoryUnit::GiB).units,
            79
        );
    }

    #[test]
    fn azure_keys_spell_slashes_as_underscores() {
        let mut t = template("t4", 1, MemoryUnit::GiB);
        t.labels.insert("example.com/gpu_pool".into(), "a".into());
        let tags = t.azure_tags().unwrap();
        assert_eq!(
            tags["k8s.io_cluster-autoscaler_node-template_resources_aliyun.com_gpu-mem"],
            "14"
        );
        assert_eq!(
            tags["k8s.io_cluster-autoscaler_node-template_label_example.com_gpu~2pool"],
            "a"
        );
        t.resource_name = "example.com/gpu_mem".into();
        assert!(matches!(
            t.azure_tags(),
            Err(TemplateError::AzureResource(_))
        ));
    }

    #[test]
    fn labels_need_a_key_and_no_comma() {
        assert_eq!(
            "gpushare=true".parse::<Label>(),
            Ok(Label {
                key: "gpushare".into(),
                value: "true".into()
            })
        );
        assert!("=true".parse::<Label>().is_err());
        assert!("gpushare".parse::<Label>().is_err());
        assert!("a=b,c=d".parse::<Label>().is_err());
    }

    #[test]
    fn an_overlay_needs_a_scope_and_gets_a_dns_name() {
        let t = template("v100-16gb", 2, MemoryUnit::GiB);
        assert!(t.karpenter_overlay(&OverlayScope::default()).is_err());
        let overlay = t
            .karpenter_overlay(&OverlayScope {
                instance_types: vec!["p3.8xlarge".into()],
                ..OverlayScope::default()
            })
            .unwrap();
        assert_eq!(
            overlay["metadata"]["name"],
            "gpumem-2x-tesla-v100-sxm2-16gb"
        );
        assert_eq!(overlay["spec"]["capacity"]["aliyun.com/gpu-mem"], "30");
    }

    #[test]
    fn dra_devices_are_the_drivers_less_what_only_the_node_knows() {
        let gpu = known_gpu("v100-16gb").unwrap();
        let gpus = gpus_of(gpu.name, gpu.memory_mib, 2);
        let t = template("v100-16gb", 2, MemoryUnit::GiB);
        let inventory = Inventory::new(gpus, MemoryUnit::GiB).unwrap();
        let published = slice::build(
            "n",
            "uid",
            "gpumem.io",
            &inventory,
            &NodeFacts::default(),
            1,
        );
        let mut expected = serde_json::to_value(published.spec.devices.unwrap()).unwrap();
        for device in expected.as_array_mut().unwrap() {
            device["attributes"].as_object_mut().unwrap().remove("uuid");
        }
        assert_eq!(serde_json::Value::Array(t.dra_devices.clone()), expected);
        let first = &t.dra_devices[0];
        assert_eq!(first["name"], "gpu-0");
        assert_eq!(first["allowMultipleAllocations"], true);
        assert_eq!(first["capacity"]["memory"]["value"], "16160Mi");
        assert_eq!(
            first["capacity"]["memory"]["requestPolicy"]["validRange"]["max"],
            "15Gi"
        );
        assert_eq!(first["attributes"]["productName"]["string"], gpu.name);
        assert!(first["attributes"].get("uuid").is_none());
    }
}
