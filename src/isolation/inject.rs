//! What a container is given at Allocate: the env that pins it to its GPU
//! and tells it its cap, and with shim isolation the preload, the library
//! and its own accounting directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::deviceplugin::api::deviceplugin::{ContainerAllocateResponse, Mount};
use crate::isolation::accounting::{AccountingError, Cap};
use crate::isolation::containers::{ContainerName, Containers};
use crate::node::inventory::Inventory;
use crate::node::placement::Assignment;

/// Env names, in one place so the demo, tests and docs agree.
pub mod env {
    /// GPU UUID for the NVIDIA container runtime: the only GPU the container sees.
    pub const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";
    /// The container's memory cap in MiB.
    pub const LIMIT_MIB: &str = "GPUMEM_LIMIT_MIB";
    /// Where the shim finds the container's accounting file.
    pub const STATE_DIR: &str = "GPUMEM_STATE_DIR";
    /// gpushare-compatible: the GPU's NVML index.
    pub const ALIYUN_IDX: &str = "ALIYUN_COM_GPU_MEM_IDX";
    /// gpushare-compatible: units the container holds.
    pub const ALIYUN_CONTAINER: &str = "ALIYUN_COM_GPU_MEM_CONTAINER";
    /// gpushare-compatible: units the whole GPU has.
    pub const ALIYUN_DEV: &str = "ALIYUN_COM_GPU_MEM_DEV";
    /// gpushare-compatible: `GiB` or `MiB`.
    pub const ALIYUN_UNIT: &str = "ALIYUN_COM_GPU_MEM_UNIT";
}

/// The shim library's file name, on the host and in containers.
pub const SHIM_LIBRARY: &str = "libgpumem_shim.so";
/// The one-line preload list installed beside the library.
pub const PRELOAD_LIST: &str = "ld.so.preload";
/// Where the library appears in containers; the preload list names it.
pub const CONTAINER_SHIM_DIR: &str = "/usr/local/gpumem";

/// Who enforces the cap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Isolation {
    /// Our LD_PRELOAD shim.
    Shim(ShimConfig),
    /// Something else (Alibaba's cGPU module reads the ALIYUN_COM_GPU_MEM_* env).
    None,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimConfig {
    /// Host directory holding the library and the preload list.
    pub host_dir: PathBuf,
    /// Host directory under which each container gets its accounting directory.
    pub state_dir: PathBuf,
    /// Charged once per process and GPU for its CUDA context.
    pub context_charge_mib: u64,
}

impl ShimConfig {
    pub fn library(&self) -> PathBuf {
        self.host_dir.join(SHIM_LIBRARY)
    }

    pub fn preload_list(&self) -> PathBuf {
        self.host_dir.join(PRELOAD_LIST)
    }

    /// The per-container accounting directories.
    pub fn containers(&self) -> Containers {
        Containers::in_state_dir(&self.state_dir)
    }

    /// Parent of the per-container directories.
    pub fn containers_dir(&self) -> PathBuf {
        self.containers().root().to_owned()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    #[error(
        "the gpumem shim {0} is missing on this node, so the container would run without a memory \
         cap; refusing. Check that the gpumem DaemonSet installed it (or run the plugin with \
         --isolation none if something else enforces caps)"
    )]
    ShimMissing(PathBuf),
    #[error(transparent)]
    Accounting(#[from] AccountingError),
}

/// The response for one container holding `assignment` (the devices `ids`).
/// With shim isolation this creates and syncs files: call it off the async
/// workers.
pub fn container_response(
    inv: &Inventory,
    assignment: Assignment,
    ids: &[String],
    isolation: &Isolation,
) -> Result<ContainerAllocateResponse, InjectError> {
    let gpu = &inv.gpus()[assignment.gpu];
    let cap_mib = gpu.cap_mib(assignment.units);
    let mut envs = HashMap::from([
        (env::VISIBLE_DEVICES.to_owned(), gpu.gpu.uuid.clone()),
        (env::LIMIT_MIB.to_owned(), cap_mib.to_string()),
        (env::ALIYUN_IDX.to_owned(), gpu.gpu.index.to_string()),
        (
            env::ALIYUN_CONTAINER.to_owned(),
            assignment.units.to_string(),
        ),
        (env::ALIYUN_DEV.to_owned(), gpu.units.to_string()),
        (env::ALIYUN_UNIT.to_owned(), inv.unit().to_string()),
    ]);
    let mut mounts = Vec::new();
    if let Isolation::Shim(shim) = isolation {
        let library = shim.library();
        let preload = shim.preload_list();
        for needed in [&library, &preload] {
            if !needed.is_file() {
                return Err(InjectError::ShimMissing(needed.clone()));
            }
        }
        let dir = shim
            .containers()
            .get(ContainerName::of(inv, assignment, ids));
        dir.prepare(&[Cap {
            uuid: gpu.gpu.uuid.clone(),
            cap_mib,
            context_charge_mib: shim.context_charge_mib,
        }])?;
        let mount = |container: &Path, host: &Path, read_only| Mount {
            container_path: container.display().to_string(),
            host_path: host.display().to_string(),
            read_only,
        };
        mounts = vec![
            mount(
                &Path::new(CONTAINER_SHIM_DIR).join(SHIM_LIBRARY),
                &library,
                true,
            ),
            mount(Path::new("/etc/ld.so.preload"), &preload, true),
            mount(Path::new(gpumem_layout::CONTAINER_DIR), &dir.path, false),
        ];
        envs.insert(
            env::STATE_DIR.to_owned(),
            gpumem_layout::CONTAINER_DIR.to_owned(),
        );
    }
    Ok(ContainerAllocateResponse {
        envs,
        mounts,
        ..Default::default()
    })
}
