//! What a container is given at Allocate: the env that pins it to its GPU
//! and tells it (and gpushare-aware tools) its memory cap.

use std::collections::HashMap;

use crate::api::deviceplugin::ContainerAllocateResponse;
use crate::inventory::Inventory;
use crate::placement::Assignment;

/// Env names, in one place so the demo, tests and docs agree.
pub mod env {
    /// GPU UUID for the NVIDIA container runtime: the only GPU the container sees.
    pub const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
    /// The container's memory cap in MiB, enforced by the shim.
    pub const LIMIT_MIB: &str = "GPUMEM_LIMIT_MIB";
    /// gpushare-compatible: the GPU's NVML index.
    pub const ALIYUN_IDX: &str = "ALIYUN_COM_GPU_MEM_IDX";
    /// gpushare-compatible: units the container holds.
    pub const ALIYUN_CONTAINER: &str = "ALIYUN_COM_GPU_MEM_CONTAINER";
    /// gpushare-compatible: units the whole GPU has.
    pub const ALIYUN_DEV: &str = "ALIYUN_COM_GPU_MEM_DEV";
    /// gpushare-compatible: `GiB` or `MiB`.
    pub const ALIYUN_UNIT: &str = "ALIYUN_COM_GPU_MEM_UNIT";
}

/// The response for one container holding `assignment`.
pub fn container_response(inv: &Inventory, assignment: Assignment) -> ContainerAllocateResponse {
    let gpu = &inv.gpus()[assignment.gpu];
    let envs = HashMap::from([
        (env::VISIBLE_DEVICES.to_owned(), gpu.gpu.uuid.clone()),
        (
            env::LIMIT_MIB.to_owned(),
            gpu.cap_mib(assignment.units).to_string(),
        ),
        (env::ALIYUN_IDX.to_owned(), gpu.gpu.index.to_string()),
        (
            env::ALIYUN_CONTAINER.to_owned(),
            assignment.units.to_string(),
        ),
        (env::ALIYUN_DEV.to_owned(), gpu.units.to_string()),
        (env::ALIYUN_UNIT.to_owned(), inv.unit().to_string()),
    ]);
    ContainerAllocateResponse {
        envs,
        ..Default::default()
    }
}
