//! What a container is given at Allocate: the env that tells it its cap,
//! with shim isolation the preload, the library and its own accounting
//! directory, and its GPU named to the runtime as the device-list strategy says.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::isolation::accounting::{self, AccountingError, Cap};
use crate::isolation::cdi::{self, CdiError, ContainerEdits, SpecDir};
use crate::isolation::containers::{ContainerDir, ContainerName, Containers};
use crate::isolation::statefs::StateFs;
use crate::node::inventory::Inventory;
use crate::node::placement::Assignment;

/// Env names, in one place so the demo, tests and docs agree.
pub mod env {
    /// For the NVIDIA container toolkit: the GPU's UUID (`envvar`), or where
    /// the device-list mounts are (`volume-mounts`).
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
/// Where the NVIDIA container toolkit looks for device-list mounts
/// (`accept-nvidia-visible-devices-as-volume-mounts`), one per GPU named by
/// the file name; NVIDIA's device plugin uses the same root.
pub const DEVICE_LIST_MOUNT_ROOT: &str = "/var/run/nvidia-container-devices";
/// The host side of every device-list mount: the toolkit only considers
/// mounts of `/dev/null`.
pub const DEVICE_LIST_MOUNT_SOURCE: &str = "/dev/null";

/// How Allocate names the container's GPU to the container runtime: the
/// device-list strategies of NVIDIA's device plugin.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceListStrategy {
    /// `NVIDIA_VISIBLE_DEVICES=<UUID>`. With the toolkit's defaults any
    /// container can set that env itself and get every GPU without asking.
    #[default]
    Envvar,
    /// A `/dev/null` mount at `/var/run/nvidia-container-devices/<UUID>`:
    /// only kubelet (or a hostPath volume) can give one. For toolkits that
    /// read these mounts and ignore the env in unprivileged containers.
    VolumeMounts,
    /// CDI device names: the GPU as NVIDIA's spec names it
    /// (`nvidia.com/gpu=<UUID>`) and, with the shim, the container's own
    /// device (`gpumem.io/container=<name>`) whose spec, written here,
    /// carries its env and mounts. No env names the GPU.
    Cdi(SpecDir),
}

impl DeviceListStrategy {
    pub fn as_str(&self) -> &'static str {
        match self {
            DeviceListStrategy::Envvar => "envvar",
            DeviceListStrategy::VolumeMounts => "volume-mounts",
            DeviceListStrategy::Cdi(_) => "cdi",
        }
    }

    /// Where the containers' CDI specs go; `None` unless `cdi`.
    pub fn cdi_specs(&self) -> Option<&SpecDir> {
        match self {
            DeviceListStrategy::Cdi(specs) => Some(specs),
            _ => None,
        }
    }
}

impl fmt::Display for DeviceListStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    /// What each accounting directory is on: a daemon decides at start
    /// (`StateFs::detect`); `gpumem exec` and the demo keep `Shared`.
    pub state_fs: StateFs,
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
    #[error(transparent)]
    Cdi(#[from] CdiError),
}

/// What one container is given: the isolation layer's answer, in no front
/// end's words. The device plugin puts it into an Allocate response; DRA
/// into CDI edits.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Grant {
    pub env: BTreeMap<String, String>,
    /// (container path, host path, read-only).
    pub mounts: Vec<(PathBuf, PathBuf, bool)>,
    /// Fully qualified CDI device names for the runtime.
    pub cdi_devices: Vec<String>,
}

impl Grant {
    /// The cap and the gpushare-compatible env; nothing for the shim.
    fn env_only(inv: &Inventory, assignment: Assignment) -> Self {
        let gpu = &inv.gpus()[assignment.gpu];
        let env = [
            (env::LIMIT_MIB, gpu.cap_mib(assignment.units).to_string()),
            (env::ALIYUN_IDX, gpu.gpu.index.to_string()),
            (env::ALIYUN_CONTAINER, assignment.units.to_string()),
            (env::ALIYUN_DEV, gpu.units.to_string()),
            (env::ALIYUN_UNIT, inv.unit().to_string()),
        ];
        Grant {
            env: env.map(|(k, v)| (k.to_owned(), v)).into(),
            mounts: Vec::new(),
            cdi_devices: Vec::new(),
        }
    }

    /// Plus the preload, the library and the container's accounting
    /// directory `dir`. A function of the directory's name, the inventory
    /// and the flags only: so it can be rebuilt for a container without
    /// kubelet (see `cdi_spec`).
    fn with_shim(
        inv: &Inventory,
        assignment: Assignment,
        shim: &ShimConfig,
        dir: &ContainerDir,
    ) -> Self {
        let mut grant = Grant::env_only(inv, assignment);
        grant.env.insert(
            env::STATE_DIR.to_owned(),
            gpumem_layout::CONTAINER_DIR.to_owned(),
        );
        grant.mounts = shim_mounts(shim, dir, gpumem_layout::CONTAINER_DIR.into());
        grant
    }

    fn edits(&self) -> ContainerEdits {
        ContainerEdits::new(
            &self.env,
            self.mounts
                .iter()
                .map(|(container, host, ro)| (container.as_path(), host.as_path(), *ro)),
        )
    }
}

/// The grant for one container holding `assignment` (the devices `ids`).
/// With shim isolation this creates and syncs files (and with `cdi` writes a
/// spec): call it off the async workers.
pub fn container_grant(
    inv: &Inventory,
    assignment: Assignment,
    ids: &[String],
    isolation: &Isolation,
    device_list: &DeviceListStrategy,
) -> Result<Grant, InjectError> {
    let gpu = &inv.gpus()[assignment.gpu];
    let uuid = &gpu.gpu.uuid;
    let (mut grant, dir) = match isolation {
        Isolation::Shim(shim) => {
            check_shim(shim)?;
            let dir = shim
                .containers()
                .get(ContainerName::of(inv, assignment, ids));
            // Named by the devices alone: the directory may be one a
            // container that ended with the same units left for clean-up.
            let found = dir.prepare_afresh(
                &[Cap {
                    uuid: uuid.clone(),
                    cap_mib: gpu.cap_mib(assignment.units),
                    context_charge_mib: shim.context_charge_mib,
                }],
                shim.state_fs,
            )?;
            match found {
                accounting::Found::LeftOver => {
                    info!(dir = %dir.path.display(), "a new accounting file replaced the one a container that ended left with the same units")
                }
                accounting::Found::InUse => {
                    warn!(dir = %dir.path.display(), "a new accounting file replaced one in which a process outside this container still holds a slot (its pod ended, or it was handed the file): that process keeps the old file, and is not counted as this container's")
                }
                accounting::Found::Nothing => {}
            }
            (Grant::with_shim(inv, assignment, shim, &dir), Some(dir))
        }
        Isolation::None => (Grant::env_only(inv, assignment), None),
    };
    match device_list {
        DeviceListStrategy::Envvar => {
            grant
                .env
                .insert(env::VISIBLE_DEVICES.to_owned(), uuid.clone());
            Ok(grant)
        }
        DeviceListStrategy::VolumeMounts => {
            grant.env.insert(
                env::VISIBLE_DEVICES.to_owned(),
                DEVICE_LIST_MOUNT_ROOT.to_owned(),
            );
            grant.mounts.push((
                Path::new(DEVICE_LIST_MOUNT_ROOT).join(uuid),
                DEVICE_LIST_MOUNT_SOURCE.into(),
                true,
            ));
            Ok(grant)
        }
        DeviceListStrategy::Cdi(specs) => {
            let mut devices = vec![cdi::qualified_name(cdi::NVIDIA_GPU_KIND, uuid)];
            let Some(dir) = dir else {
                // Nothing of ours to mount and no state to clean up: the env
                // goes in the response, which kubelet applies whatever the
                // runtime does with CDI.
                grant.cdi_devices = devices;
                return Ok(grant);
            };
            // The spec's device is named after the container's directory,
            // which is named after the devices it holds: a later container
            // given the same devices gets the same name. Runtimes cache
            // specs, but reusing the name is safe here: the spec is a
            // function of the name and the plugin's flags (`cdi_spec`
            // rebuilds it from them), so a cached copy holds the same edits;
            // a spec whose content changes (other flags) is rewritten, and
            // runtimes reload on every change to the directory. Two live
            // containers never share a name (kubelet never gives a unit to
            // two), and the spec goes only with the directory, under the
            // lock Allocate holds here.
            let spec = cdi::container_spec(dir.name.as_str(), grant.edits())?;
            specs.write(&spec)?;
            devices.push(cdi::qualified_name(&spec.kind, dir.name.as_str()));
            Ok(Grant {
                cdi_devices: devices,
                ..Grant::default()
            })
        }
    }
}

/// The CDI spec of the container whose accounting directory is `dir`, as
/// Allocate wrote it: rebuilt from the directory's name, the inventory and
/// the flags, e.g. after a reboot emptied the spec directory while kubelet
/// restarts containers from its cached Allocate answers. `None` for a
/// directory not named by Allocate or a GPU no longer on the node.
pub fn cdi_spec(inv: &Inventory, shim: &ShimConfig, dir: &ContainerDir) -> Option<cdi::Spec> {
    let assignment = dir.name.assignment(inv)?;
    if assignment.units == 0 || assignment.units > inv.gpus()[assignment.gpu].units {
        return None;
    }
    let grant = Grant::with_shim(inv, assignment, shim, dir);
    cdi::container_spec(dir.name.as_str(), grant.edits()).ok()
}

/// One GPU of a DRA claim: its position in the inventory and the claim's
/// cap on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimGpu {
    pub gpu: usize,
    pub cap_mib: u64,
}

/// What every container referencing a DRA claim is given, as CDI edits: the
/// cap env (on one GPU, with gpushare's env too), `visible` as
/// `NVIDIA_VISIBLE_DEVICES`, and with the shim its preload, library and the
/// claim's accounting directory `dir`.
pub fn claim_edits(
    inv: &Inventory,
    gpus: &[ClaimGpu],
    shim: Option<(&ShimConfig, &ContainerDir)>,
    visible: String,
) -> ContainerEdits {
    let mut grant = Grant::default();
    grant.env.insert(env::VISIBLE_DEVICES.to_owned(), visible);
    if let [one] = gpus {
        // gpushare's env speaks in units: the cap in whole units of the
        // GPU's, as its tools expect.
        let gpu = &inv.gpus()[one.gpu];
        let unit_mib = inv.unit().mib();
        let env = [
            (env::LIMIT_MIB, one.cap_mib.to_string()),
            (env::ALIYUN_IDX, gpu.gpu.index.to_string()),
            (env::ALIYUN_CONTAINER, (one.cap_mib / unit_mib).to_string()),
            (env::ALIYUN_DEV, gpu.units.to_string()),
            (env::ALIYUN_UNIT, inv.unit().to_string()),
        ];
        grant.env.extend(env.map(|(k, v)| (k.to_owned(), v)));
    }
    if let Some((shim, dir)) = shim {
        grant.env.insert(
            env::STATE_DIR.to_owned(),
            gpumem_layout::CONTAINER_DIR.to_owned(),
        );
        // Inside the state directory, under its own name: a container
        // that references several claims has each claim's file, and the
        // shim reads them all.
        let at = Path::new(gpumem_layout::CONTAINER_DIR).join(dir.name.as_str());
        grant.mounts = shim_mounts(shim, dir, at);
    }
    grant.edits()
}

/// The preload, the library and the accounting directory `dir` at `at`.
fn shim_mounts(
    shim: &ShimConfig,
    dir: &ContainerDir,
    at: PathBuf,
) -> Vec<(PathBuf, PathBuf, bool)> {
    vec![
        (
            Path::new(CONTAINER_SHIM_DIR).join(SHIM_LIBRARY),
            shim.library(),
            true,
        ),
        ("/etc/ld.so.preload".into(), shim.preload_list(), true),
        (at, dir.path.clone(), false),
    ]
}

/// The shim's files, which a container needs before it is given a cap.
pub fn check_shim(shim: &ShimConfig) -> Result<(), InjectError> {
    for needed in [shim.library(), shim.preload_list()] {
        if !needed.is_file() {
            return Err(InjectError::ShimMissing(needed));
        }
    }
    Ok(())
}
