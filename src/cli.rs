//! The command line's flags: each with its help text, environment variable
//! and default, and what they turn into for the library.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use gpumem::dra;
use gpumem::isolation::cdi::{self, SpecDir};
use gpumem::isolation::enforce::OverCapAction;
use gpumem::isolation::inject::{DeviceListStrategy, Isolation, ShimConfig};
use gpumem::isolation::statefs::{Bounding, StateFs};
use gpumem::kubelet::podresources;
use gpumem::node::fake::FakeHardware;
use gpumem::node::hardware::Hardware;
use gpumem::node::health::XidList;
use gpumem::node::nvml::NvmlHardware;
use gpumem::node::placement::Policy;
use gpumem::node::processes::ProcessUsage;
use gpumem::node::resource::{ResourceName, DEFAULT_RESOURCE_NAME};
use gpumem::node::units::{MemorySize, MemoryUnit};
use gpumem::ops::daemon;

/// Share NVIDIA GPUs between Kubernetes pods by memory.
///
/// Every flag can also be set through the environment variable shown with
/// it: GPUMEM_<FLAG>, or GPUMEM_<COMMAND>_<FLAG> where the short name means
/// something else elsewhere (exec's --state-dir is GPUMEM_EXEC_STATE_DIR:
/// the shim reads GPUMEM_STATE_DIR).
#[derive(Parser)]
#[command(name = "gpumem", version = gpumem::version::LONG, propagate_version = true)]
pub struct Cli {
    /// Log format: text for people (coloured only on a terminal, and not
    /// with NO_COLOR set), json for log pipelines.
    #[arg(long, global = true, env = "GPUMEM_LOG_FORMAT", default_value = "text")]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the device plugin on a GPU node (the DaemonSet's command).
    Plugin(PluginArgs),
    /// Run the DRA driver on a GPU node instead of the device plugin
    /// (Kubernetes 1.34+, resource.k8s.io/v1; each GPU's memory as
    /// consumable capacity). A node runs one of the two.
    Dra(DraArgs),
    /// Run the real plugin against a simulated kubelet on a fake T4 node and
    /// replay the gpushare notebook scenario. Needs no GPU and no cluster.
    #[cfg(feature = "demo")]
    Demo(DemoArgs),
    /// Run a command with its GPU memory capped, as in a gpumem container
    /// (e.g. `gpumem exec --mem 4308MiB -- nvidia-smi`).
    Exec(ExecArgs),
    /// Show the node's GPUs and which containers hold how much of them.
    Inspect(InspectArgs),
    /// Install the shim and ld.so.preload into the host directory, atomically
    /// (the DaemonSet's init container).
    InstallShim(InstallArgs),
    /// Run gpumem's kube-scheduler extender: filters and scores nodes by
    /// each GPU's free units and binds pods with gpushare's annotations.
    Extender(ExtenderArgs),
    /// Remove what gpumem published on Nodes (the gpumem.io/gpus annotation
    /// and the aliyun.com/gpu-count capacity) once gpumem is uninstalled:
    /// the chart's post-delete hook.
    Unpublish(UnpublishArgs),
    /// Print what a node group's template must say for an autoscaler to add
    /// a gpumem node from zero: the aliyun.com/gpu-mem and gpu-count capacity
    /// the plugin will advertise for the GPUs, and the DaemonSet's labels, as
    /// AWS or Azure tags, Cluster API annotations, a Karpenter NodeOverlay or
    /// JSON (docs/OPERATIONS.md, "Autoscaling").
    NodeTemplate(NodeTemplateArgs),
}

#[derive(Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// `--bound-state-dirs`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BoundStateDirs {
    Off,
    Auto,
    Require,
}

impl From<BoundStateDirs> for Bounding {
    fn from(mode: BoundStateDirs) -> Bounding {
        match mode {
            BoundStateDirs::Off => Bounding::Off,
            BoundStateDirs::Auto => Bounding::Auto,
            BoundStateDirs::Require => Bounding::Require,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum IsolationMode {
    Shim,
    None,
}

/// NVIDIA's device plugin's device-list strategies (docs/OPERATIONS.md).
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceListMode {
    Envvar,
    VolumeMounts,
    Cdi,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

/// `--kubeconfig`, for every command that talks to the API server.
#[derive(Args)]
pub struct KubeconfigArgs {
    /// kubeconfig for the API server (default: the pod's service account,
    /// then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "GPUMEM_KUBECONFIG", value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
}

impl KubeconfigArgs {
    pub fn path(&self) -> Option<&Path> {
        self.kubeconfig.as_deref()
    }
}

#[derive(Args)]
pub struct UnpublishArgs {
    /// Only this Node (repeatable; default: every Node carrying gpumem's
    /// annotation). A named Node without it is an error.
    #[arg(long = "node", value_name = "NAME")]
    pub nodes: Vec<String>,

    /// Only Nodes with these labels (a label selector, e.g.
    /// `gpushare=true`): the chart's hook passes its release's nodeSelector,
    /// so that another release's Nodes keep what their agents published.
    #[arg(long, env = "GPUMEM_UNPUBLISH_SELECTOR", value_name = "SELECTOR")]
    pub selector: Option<String>,

    #[command(flatten)]
    pub kubeconfig: KubeconfigArgs,
}

/// `--fake-gpus`, for every command that reads GPUs (exec and the demo
/// say it in their own words).
#[derive(Args)]
pub struct FakeGpusArgs {
    /// Describe the node's GPUs in a TOML file instead of asking NVML.
    #[arg(long, env = "GPUMEM_FAKE_GPUS", value_name = "FILE")]
    pub fake_gpus: Option<PathBuf>,
}

impl FakeGpusArgs {
    /// The one hardware value the command reads GPUs through: the fake
    /// file where one is given, NVML otherwise.
    pub fn hardware(&self) -> Box<dyn Hardware> {
        match &self.fake_gpus {
            Some(path) => Box::new(FakeHardware::new(path)),
            None => Box::new(NvmlHardware::default()),
        }
    }
}

/// What is advertised: the resource and its unit.
#[derive(Args)]
pub struct ResourceArgs {
    /// Extended resource name to advertise (validated as kubelet does).
    #[arg(long, env = "GPUMEM_RESOURCE_NAME", default_value = DEFAULT_RESOURCE_NAME)]
    pub resource_name: ResourceName,

    /// Size of one unit: GiB (gpushare-compatible) or MiB.
    #[arg(
        long,
        env = "GPUMEM_MEMORY_UNIT",
        default_value = "GiB",
        value_name = "GiB|MiB"
    )]
    pub memory_unit: MemoryUnit,
}

#[derive(Args)]
pub struct PlacementArgs {
    /// GPU choice: binpack (fullest GPU that fits) or spread (emptiest GPU).
    #[arg(
        long,
        env = "GPUMEM_PLACEMENT",
        default_value = "binpack",
        value_name = "binpack|spread"
    )]
    pub placement: Policy,
}

/// The node: its GPUs, kubelet's pod-resources API, and isolation state.
#[derive(Args)]
pub struct NodeArgs {
    #[command(flatten)]
    pub fake_gpus: FakeGpusArgs,

    /// kubelet's pod-resources socket: who holds which devices.
    #[arg(long, env = "GPUMEM_POD_RESOURCES_SOCKET", default_value = podresources::DEFAULT_SOCKET)]
    pub pod_resources_socket: PathBuf,

    /// Who enforces caps: shim (gpumem's LD_PRELOAD library) or none
    /// (something else, e.g. Alibaba cGPU reading ALIYUN_COM_GPU_MEM_*).
    #[arg(
        long,
        env = "GPUMEM_ISOLATION",
        default_value = "shim",
        value_name = "shim|none"
    )]
    pub isolation: IsolationMode,

    /// Host directory where the DaemonSet installs libgpumem_shim.so and ld.so.preload.
    #[arg(
        long,
        env = "GPUMEM_SHIM_HOST_DIR",
        default_value = "/usr/local/gpumem"
    )]
    pub shim_host_dir: PathBuf,

    /// Host directory for per-container accounting state (mounted into each
    /// container at /var/run/gpumem).
    #[arg(long, env = "GPUMEM_STATE_DIR", default_value = "/var/lib/gpumem")]
    pub state_dir: PathBuf,

    /// Mount a tmpfs of a few hundred KiB for each container's state
    /// directory, so no container can fill the disk under --state-dir
    /// through it: off, auto (where this process can mount one the runtime
    /// sees; else unbounded, said at start) or require (else refuse to
    /// start). Needs CAP_SYS_ADMIN and mount propagation to the host
    /// (docs/SECURITY.md, "The state directory").
    #[arg(
        long,
        env = "GPUMEM_BOUND_STATE_DIRS",
        default_value = "off",
        value_name = "off|auto|require"
    )]
    pub bound_state_dirs: BoundStateDirs,

    /// Unix socket where the plugin serves /status, who holds what (pods'
    /// names and usage), and `gpumem inspect` reads it; mode 0600, for the
    /// plugin's user (root) alone, never on the network port (default:
    /// status.sock in --state-dir; empty: not served).
    #[arg(long, env = "GPUMEM_STATUS_SOCKET", value_name = "PATH")]
    pub status_socket: Option<std::ffi::OsString>,

    #[command(flatten)]
    pub context: ContextArgs,
}

#[derive(Args)]
pub struct ContextArgs {
    /// MiB charged for a CUDA context where the shim cannot measure it. The
    /// shim charges each context what the driver took for it (NVML's figure
    /// for the process, read around the call: 518 MiB on an H100 with driver
    /// 580); without NVML in the container it charges this instead, and
    /// refuses a context up front when this much does not fit. 0: contexts
    /// that cannot be measured are left to reconciliation.
    #[arg(long, env = "GPUMEM_CONTEXT_CHARGE_MIB", default_value_t = 0)]
    pub context_charge_mib: u64,
}

#[derive(Args)]
pub struct ReconcileArgs {
    /// Seconds between comparisons of NVML's per-process GPU memory with
    /// what the shim charged; the excess (CUDA contexts, libraries, pool
    /// reserves) counts against the cap. The plugin needs the host's PID
    /// namespace for it. 0: off (what the shim charges, only).
    #[arg(long, env = "GPUMEM_RECONCILE_SECS", default_value_t = 2)]
    pub reconcile_secs: u64,
}

/// How Allocate names the container's GPU to the container runtime.
#[derive(Args)]
pub struct DeviceListArgs {
    /// How the container runtime learns the container's GPU: envvar
    /// (NVIDIA_VISIBLE_DEVICES, which any pod can also set itself),
    /// volume-mounts (/dev/null mounts under /var/run/nvidia-container-devices;
    /// the NVIDIA toolkit set to read them and to ignore the env in
    /// unprivileged containers), or cdi (CDI device names: the GPU as
    /// nvidia.com/gpu=<UUID>, the container's env and shim mounts in a spec
    /// under --cdi-spec-dir; needs CDI in the runtime).
    #[arg(
        long,
        env = "GPUMEM_DEVICE_LIST_STRATEGY",
        default_value = "envvar",
        value_name = "envvar|volume-mounts|cdi"
    )]
    pub device_list_strategy: DeviceListMode,

    /// Host directory for the containers' CDI specs (with
    /// --device-list-strategy cdi): one the runtime reads (its cdi_spec_dirs).
    #[arg(long, env = "GPUMEM_CDI_SPEC_DIR", default_value = cdi::DEFAULT_SPEC_DIR)]
    pub cdi_spec_dir: PathBuf,
}

impl DeviceListArgs {
    pub fn strategy(&self) -> DeviceListStrategy {
        self.device_list_strategy.strategy(&self.cdi_spec_dir)
    }
}

impl DeviceListMode {
    pub fn strategy(self, cdi_spec_dir: &Path) -> DeviceListStrategy {
        match self {
            DeviceListMode::Envvar => DeviceListStrategy::Envvar,
            DeviceListMode::VolumeMounts => DeviceListStrategy::VolumeMounts,
            DeviceListMode::Cdi => DeviceListStrategy::Cdi(SpecDir::new(cdi_spec_dir)),
        }
    }
}

impl ReconcileArgs {
    /// How often to reconcile; `None`: off.
    pub fn every(&self) -> Option<Duration> {
        (self.reconcile_secs != 0).then(|| Duration::from_secs(self.reconcile_secs))
    }

    pub fn source(&self, hardware: &dyn Hardware) -> Option<(Box<dyn ProcessUsage>, Duration)> {
        let every = self.every()?;
        hardware.processes().map(|source| (source, every))
    }
}

#[derive(Args)]
pub struct PluginArgs {
    /// Directory holding kubelet.sock; our socket (gpumem.sock) is created here.
    #[arg(
        long,
        env = "GPUMEM_KUBELET_DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    pub kubelet_dir: PathBuf,

    #[command(flatten)]
    pub resource: ResourceArgs,

    #[command(flatten)]
    pub placement: PlacementArgs,

    #[command(flatten)]
    pub daemon: DaemonArgs,

    #[command(flatten)]
    pub device_list: DeviceListArgs,

    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// What both front ends run beside kubelet's API: the node, health, the
/// HTTP endpoint, reconciliation, the over-cap action and clean-up.
#[derive(Args)]
pub struct DaemonArgs {
    #[command(flatten)]
    pub node: NodeArgs,

    /// Address for /metrics and /healthz (HOST:PORT or :PORT; empty: off).
    /// Who holds what is on --status-socket, not here.
    #[arg(long, env = "GPUMEM_METRICS_ADDR", default_value = ":9400")]
    pub metrics_addr: String,

    /// The node's name in the metrics' Hostname label, as dcgm-exporter's,
    /// so that the two join (the chart sets it from spec.nodeName).
    /// Default: --node-name, else the host name.
    #[arg(long, env = "GPUMEM_METRICS_HOSTNAME", value_name = "NAME")]
    pub metrics_hostname: Option<String>,

    /// XIDs that do not make a GPU unhealthy (application errors): numbers
    /// separated by commas and/or spaces. Empty: every XID makes it unhealthy.
    #[arg(
        long,
        env = "GPUMEM_IGNORE_XIDS",
        value_name = "XIDS",
        default_value_t = XidList::default()
    )]
    pub ignore_xids: XidList,

    /// Seconds an unhealthy GPU must answer NVML without new errors before it
    /// is Healthy again. Problems that need a GPU reset (reset-class XIDs such
    /// as 48, 79, 95; a failed row remap) never recover this way
    /// (docs/OPERATIONS.md).
    #[arg(long, env = "GPUMEM_HEALTH_RECOVERY_SECS", default_value_t = 60)]
    pub health_recovery_secs: u64,

    /// What to do with a container whose GPU memory, as NVML counts it from
    /// outside (every process in its cgroup, with or without the shim),
    /// stays above its cap for longer than --over-cap-grace-secs: kill its
    /// GPU processes, newest first, until it is under (as Kubernetes kills a
    /// container over its memory limit), or only report it. Needs shim
    /// isolation and reconciliation.
    #[arg(
        long,
        env = "GPUMEM_OVER_CAP_ACTION",
        value_name = "kill|report",
        default_value_t = OverCapAction::Kill
    )]
    pub over_cap_action: OverCapAction,

    /// Seconds a container may be over its cap, in total within any window of
    /// six times this, before the over-cap action.
    #[arg(long, env = "GPUMEM_OVER_CAP_GRACE_SECS", default_value_t = 10)]
    pub over_cap_grace_secs: u64,

    /// Seconds a finished container's accounting directory is kept before removal.
    #[arg(long, env = "GPUMEM_STATE_GRACE_SECS", default_value_t = 300)]
    pub state_grace_secs: u64,

    #[command(flatten)]
    pub reconcile: ReconcileArgs,

    /// Also serve, on /metrics, each GPU's and pod's memory and the GPU's
    /// duty cycle as Alibaba Cloud's GPU exporter names them
    /// (nvidia_gpu_memory_used_bytes, nvidia_gpu_memory_total_bytes,
    /// nvidia_gpu_duty_cycle), which `arena top node` and `arena top job`
    /// read from Prometheus (GPUMEM_ARENA_METRICS: true or false).
    #[arg(
        long,
        env = "GPUMEM_ARENA_METRICS",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub arena_metrics: bool,
}

/// The DRA driver: kubelet's DRA plugin API instead of the device plugin's.
#[derive(Args)]
pub struct DraArgs {
    /// The driver's name, a DNS subdomain: in the ResourceSlice, the
    /// DeviceClass's selector, and the names of kubelet's sockets.
    #[arg(long, env = "GPUMEM_DRIVER_NAME", default_value = dra::DEFAULT_DRIVER_NAME)]
    pub driver_name: String,

    /// kubelet's DRA plugin directory; the DRA socket is created at
    /// <dir>/<driver-name>/dra.sock.
    #[arg(
        long,
        env = "GPUMEM_KUBELET_PLUGINS_DIR",
        default_value = dra::service::DEFAULT_PLUGINS_DIR
    )]
    pub kubelet_plugins_dir: PathBuf,

    /// kubelet's plugin-registration directory, which it watches; the
    /// registration socket is created at <dir>/<driver-name>-reg.sock.
    #[arg(
        long,
        env = "GPUMEM_KUBELET_REGISTRY_DIR",
        default_value = dra::service::DEFAULT_REGISTRY_DIR
    )]
    pub kubelet_registry_dir: PathBuf,

    /// Step of each claim's memory: GiB or MiB. The ResourceSlice offers
    /// each GPU's memory in whole steps (a 15079 MiB T4: at most 14Gi per claim
    /// with GiB).
    #[arg(
        long,
        env = "GPUMEM_MEMORY_UNIT",
        default_value = "GiB",
        value_name = "GiB|MiB"
    )]
    pub memory_unit: MemoryUnit,

    /// This node's name (the DaemonSet sets it from spec.nodeName): the
    /// ResourceSlice's node and pool.
    #[arg(long, env = "GPUMEM_NODE_NAME", value_name = "NAME")]
    pub node_name: String,

    #[command(flatten)]
    pub kubeconfig: KubeconfigArgs,

    #[command(flatten)]
    pub startup_taint: StartupTaintArgs,

    /// Host directory for the claims' CDI specs: one the container runtime
    /// reads (containerd needs enable_cdi). NVIDIA's spec for the GPUs is
    /// looked for here and in /etc/cdi.
    #[arg(long, env = "GPUMEM_CDI_SPEC_DIR", default_value = cdi::DEFAULT_SPEC_DIR)]
    pub cdi_spec_dir: PathBuf,

    #[command(flatten)]
    pub daemon: DaemonArgs,
}

/// The API server: optional, for what only it knows.
#[derive(Args)]
pub struct ClusterArgs {
    /// This node's name (the DaemonSet sets it from spec.nodeName). With it
    /// gpumem uses the API server: it writes gpushare's pod annotations and
    /// GPU count (for `kubectl inspect gpushare`), publishes each GPU's
    /// units and health on the Node, and can follow gpushare's scheduler
    /// extender. Without it, kubelet is all gpumem talks to.
    #[arg(long, env = "GPUMEM_NODE_NAME", value_name = "NAME")]
    pub node_name: Option<String>,

    #[command(flatten)]
    pub kubeconfig: KubeconfigArgs,

    /// Who chooses each container's GPU: gpumem at admission (default: by
    /// --placement), or gpushare's scheduler extender through its pod
    /// annotations (gpushare-extender; needs --node-name).
    #[arg(
        long,
        env = "GPUMEM_SCHEDULER",
        default_value = "default",
        value_name = "default|gpushare-extender"
    )]
    pub scheduler: SchedulerMode,

    #[command(flatten)]
    pub startup_taint: StartupTaintArgs,
}

/// `--startup-taint`, for both front ends.
#[derive(Args)]
pub struct StartupTaintArgs {
    /// Taint (KEY[=VALUE]:EFFECT) to remove from this node once its GPUs can
    /// take pods: kubelet shows the resource allocatable (plugin) or the
    /// ResourceSlice offers them (dra). Start GPU nodes with it (Karpenter's
    /// startupTaints, kubelet's --register-with-taints) so that no GPU pod
    /// lands before. Needs --node-name. Empty: none.
    #[arg(
        long,
        env = "GPUMEM_STARTUP_TAINT",
        value_name = "KEY[=VALUE]:EFFECT",
        default_value = gpumem::cluster::node::DEFAULT_STARTUP_TAINT
    )]
    pub startup_taint: String,
}

impl StartupTaintArgs {
    pub fn taint(&self) -> anyhow::Result<Option<gpumem::cluster::node::StartupTaint>> {
        if self.startup_taint.trim().is_empty() {
            return Ok(None);
        }
        Ok(Some(self.startup_taint.parse().map_err(|err| {
            anyhow::anyhow!("--startup-taint (GPUMEM_STARTUP_TAINT): {err}")
        })?))
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SchedulerMode {
    Default,
    GpushareExtender,
}

impl ClusterArgs {
    pub async fn connect(&self) -> anyhow::Result<Option<daemon::Cluster>> {
        let startup_taint = self.startup_taint.taint()?;
        let Some(node) = self.node_name.clone().filter(|n| !n.is_empty()) else {
            if self.scheduler == SchedulerMode::GpushareExtender {
                anyhow::bail!(
                    "--scheduler gpushare-extender needs --node-name (GPUMEM_NODE_NAME): the \
                     extender's choice is read from the pods bound to this node"
                );
            }
            return Ok(None);
        };
        let (client, api) =
            gpumem::cluster::client::connect_watched(self.kubeconfig.path()).await?;
        Ok(Some(daemon::Cluster {
            client,
            api,
            node,
            gpushare_extender: self.scheduler == SchedulerMode::GpushareExtender,
            startup_taint,
        }))
    }
}

#[cfg(feature = "demo")]
#[derive(Args)]
#[command(mut_arg("fake_gpus", |arg| arg.help(
    "Fake GPU file describing the demo node (default: one Tesla T4, 15079 MiB)"
)))]
pub struct DemoArgs {
    #[command(flatten)]
    pub fake_gpus: FakeGpusArgs,

    #[command(flatten)]
    pub resource: ResourceArgs,

    #[command(flatten)]
    pub placement: PlacementArgs,

    /// Directory with libgpumem_shim.so, the fake driver libgpumem_fakegpu.so
    /// and gpumem-probe: each admitted container then runs a process held to
    /// its cap (default: beside gpumem, where `cargo build --release
    /// --workspace` puts them; skipped if they are not there).
    #[arg(long, env = "GPUMEM_DEMO_TENANT_DIR", value_name = "DIR")]
    pub tenant_dir: Option<PathBuf>,

    /// Play the DRA driver's scenario instead: the driver publishes the T4's
    /// memory as consumable capacity and prepares three claims of 4Gi
    /// (GPUMEM_DEMO_DRA: true or false).
    #[arg(
        long,
        env = "GPUMEM_DEMO_DRA",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub dra: bool,

    /// How Allocate names the GPU to the runtime: envvar, volume-mounts or
    /// cdi (the demo writes CDI specs into its own temporary directory).
    #[arg(
        long,
        env = "GPUMEM_DEVICE_LIST_STRATEGY",
        default_value = "envvar",
        value_name = "envvar|volume-mounts|cdi"
    )]
    pub device_list_strategy: DeviceListMode,
}

#[cfg(feature = "demo")]
impl DemoArgs {
    /// The demo writes CDI specs into its own temporary directory.
    pub fn device_list(&self) -> DeviceListStrategy {
        self.device_list_strategy
            .strategy(Path::new(cdi::DEFAULT_SPEC_DIR))
    }
}

#[derive(Args)]
#[command(mut_arg("fake_gpus", |arg| arg.help(
    "Describe GPUs in a TOML file instead of asking NVML"
)))]
pub struct ExecArgs {
    /// Memory cap per GPU, at least 1 MiB: 4308MiB, 4GiB, a number of MiB,
    /// or a Kubernetes quantity (4Gi, 4096Mi, 4G; rounded down to whole
    /// MiB). A GPU with less memory than this is not limited by it (gpumem
    /// warns).
    #[arg(long, env = "GPUMEM_MEM", value_name = "SIZE")]
    pub mem: MemorySize,

    /// GPU to cap, by index or UUID (repeatable or comma-separated;
    /// default: every GPU). Also limits CUDA to the chosen GPUs.
    #[arg(
        long = "gpu",
        env = "GPUMEM_GPU",
        value_name = "INDEX|UUID",
        value_delimiter = ','
    )]
    pub gpus: Vec<String>,

    /// Accounting directory to share between commands (each `gpumem exec`
    /// with the same one shares one cap); default: a private temporary one.
    /// (Not GPUMEM_STATE_DIR: the shim reads that in the capped command.)
    #[arg(long, env = "GPUMEM_EXEC_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,

    /// The shim library (default: libgpumem_shim.so next to gpumem, then
    /// /usr/local/gpumem/libgpumem_shim.so).
    #[arg(long, env = "GPUMEM_SHIM", value_name = "FILE")]
    pub shim: Option<PathBuf>,

    #[command(flatten)]
    pub fake_gpus: FakeGpusArgs,

    #[command(flatten)]
    pub context: ContextArgs,

    #[command(flatten)]
    pub reconcile: ReconcileArgs,

    /// The command and its arguments: everything from the first word that
    /// is not a gpumem flag. `--` before it is optional (needed for a
    /// command that starts with `-`).
    #[arg(
        trailing_var_arg = true,
        required = true,
        num_args = 1..,
        value_name = "COMMAND"
    )]
    pub command: Vec<std::ffi::OsString>,
}

#[derive(Args)]
pub struct InstallArgs {
    /// The shim to install (default: libgpumem_shim.so next to gpumem).
    /// Refused unless it is the shim, built for this machine.
    #[arg(long, env = "GPUMEM_INSTALL_SHIM_FROM", value_name = "FILE")]
    pub from: Option<PathBuf>,

    /// Host directory to install into (the plugin's --shim-host-dir).
    #[arg(
        long,
        env = "GPUMEM_INSTALL_SHIM_TO",
        value_name = "DIR",
        default_value = "/usr/local/gpumem"
    )]
    pub to: PathBuf,
}

#[derive(Args)]
pub struct ExtenderArgs {
    /// Address for kube-scheduler's calls (POST /filter, /prioritize,
    /// /bind) and GET /healthz (HOST:PORT or :PORT).
    #[arg(long, env = "GPUMEM_EXTENDER_LISTEN_ADDR", default_value = ":12345")]
    pub listen_addr: String,

    /// Address for GET /metrics (HOST:PORT or :PORT; empty: off), apart
    /// from --listen-addr, which may be loopback only (the second
    /// scheduler's pod). The manifests and the chart set :9401.
    #[arg(long, env = "GPUMEM_EXTENDER_METRICS_ADDR", default_value = "")]
    pub metrics_addr: String,

    #[command(flatten)]
    pub kubeconfig: KubeconfigArgs,

    /// Extended resource whose units are placed (the plugins' --resource-name).
    #[arg(long, env = "GPUMEM_RESOURCE_NAME", default_value = DEFAULT_RESOURCE_NAME)]
    pub resource_name: ResourceName,

    #[command(flatten)]
    pub placement: PlacementArgs,

    /// Seconds a bind's booking of GPU units waits for the pod watch to
    /// show the pod bound before it is dropped.
    #[arg(long, env = "GPUMEM_ASSUME_TIMEOUT_SECS", default_value_t = 60)]
    pub assume_timeout_secs: u64,
}

#[derive(Args)]
pub struct InspectArgs {
    /// Show each pod and container with its units, cap and usage
    /// (GPUMEM_INSPECT_DETAILS: true or false).
    #[arg(
        short = 'd',
        long,
        env = "GPUMEM_INSPECT_DETAILS",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub details: bool,

    /// Output format.
    #[arg(
        short = 'o',
        long,
        env = "GPUMEM_INSPECT_OUTPUT",
        default_value = "table",
        value_name = "table|json"
    )]
    pub output: OutputFormat,

    /// Where inspect once asked the plugin; the plugin now answers on
    /// --status-socket alone. Taken, with a warning, so scripts still run.
    #[arg(long, hide = true, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,

    #[command(flatten)]
    pub resource: ResourceArgs,

    #[command(flatten)]
    pub node: NodeArgs,
}

impl NodeArgs {
    /// Where the plugin serves `/status`; `None`: nowhere.
    pub fn status_socket(&self) -> Option<PathBuf> {
        gpumem::ops::status_socket::path(self.status_socket.as_deref(), &self.state_dir)
    }

    pub fn isolation(&self) -> Isolation {
        match self.isolation {
            IsolationMode::Shim => Isolation::Shim(ShimConfig {
                host_dir: self.shim_host_dir.clone(),
                state_dir: self.state_dir.clone(),
                context_charge_mib: self.context.context_charge_mib,
                // The daemon decides at start whether it can bound them.
                state_fs: StateFs::Shared,
            }),
            IsolationMode::None => Isolation::None,
        }
    }
}

impl DaemonArgs {
    /// What `daemon::start` needs from the flags both front ends share.
    pub fn node<'a>(
        &'a self,
        hardware: &'a dyn Hardware,
        unit: MemoryUnit,
        node_name: Option<&'a str>,
    ) -> daemon::NodeConfig<'a> {
        daemon::NodeConfig {
            hardware,
            unit,
            metrics_addr: &self.metrics_addr,
            metrics_hostname: self.metrics_hostname.as_deref(),
            status_socket: self.node.status_socket(),
            ignore_xids: &self.ignore_xids.0,
            health_recovery: Duration::from_secs(self.health_recovery_secs),
            reconcile: match self.node.isolation {
                IsolationMode::Shim => self.reconcile.every(),
                IsolationMode::None => None,
            },
            state_dir: self.node.state_dir.clone(),
            state_grace: Duration::from_secs(self.state_grace_secs),
            bound_state_dirs: self.node.bound_state_dirs.into(),
            over_cap: (
                self.over_cap_action,
                Duration::from_secs(self.over_cap_grace_secs),
            ),
            node_name,
            arena_series: self.arena_metrics,
        }
    }
}

/// `gpumem node-template`.
#[derive(Args)]
#[command(group = clap::ArgGroup::new("gpus").required(true).args(["gpu", "gpu_mib", "fake_gpus"]))]
pub struct NodeTemplateArgs {
    /// GPU model, by short or NVML name: t4 (Tesla T4, 15079 MiB),
    /// v100-16gb (Tesla V100-SXM2-16GB, 16160 MiB), h100-80gb (NVIDIA H100
    /// 80GB HBM3, 81559 MiB). Others: --gpu-mib.
    #[arg(long, env = "GPUMEM_TEMPLATE_GPU", value_name = "MODEL")]
    pub gpu: Option<String>,

    /// Each GPU's total memory in MiB as NVML reports it (`nvidia-smi
    /// --query-gpu=memory.total --format=csv`), for a model --gpu does not know.
    #[arg(long, env = "GPUMEM_TEMPLATE_GPU_MIB", value_name = "MIB")]
    pub gpu_mib: Option<u64>,

    /// GPUs per node (with --gpu or --gpu-mib).
    #[arg(
        long,
        env = "GPUMEM_TEMPLATE_COUNT",
        default_value_t = 1,
        conflicts_with = "fake_gpus"
    )]
    pub count: u32,

    /// The node's GPUs from a fake GPU file (as the plugin's --fake-gpus),
    /// e.g. one written from a node of the group.
    #[arg(long, env = "GPUMEM_FAKE_GPUS", value_name = "FILE")]
    pub fake_gpus: Option<PathBuf>,

    #[command(flatten)]
    pub resource: ResourceArgs,

    /// A label the group's nodes carry (repeatable): those the DaemonSet's
    /// nodeSelector needs (daemonset/gpumem.yaml: gpushare=true; the
    /// chart's DRA front end: gpushare=dra).
    #[arg(
        long = "label",
        env = "GPUMEM_TEMPLATE_LABELS",
        value_name = "KEY=VALUE",
        value_delimiter = ',',
        default_value = "gpushare=true"
    )]
    pub labels: Vec<gpumem::ops::template::Label>,

    /// Output: aws (Auto Scaling group tags), azure (VM scale set tags),
    /// cluster-api (MachineDeployment annotations), karpenter (a
    /// NodeOverlay; needs --instance-type or --node-pool) or json.
    #[arg(
        short = 'o',
        long,
        env = "GPUMEM_TEMPLATE_OUTPUT",
        default_value = "aws",
        value_name = "aws|azure|cluster-api|karpenter|json"
    )]
    pub output: TemplateFormat,

    /// Karpenter: the instance types the overlay applies to (repeatable).
    #[arg(
        long = "instance-type",
        env = "GPUMEM_TEMPLATE_INSTANCE_TYPES",
        value_name = "TYPE",
        value_delimiter = ','
    )]
    pub instance_types: Vec<String>,

    /// Karpenter: the NodePool the overlay applies to.
    #[arg(long, env = "GPUMEM_TEMPLATE_NODE_POOL", value_name = "NAME")]
    pub node_pool: Option<String>,

    /// Karpenter: the overlay's name (default: gpumem-<count>x-<model>).
    #[arg(long, env = "GPUMEM_TEMPLATE_NAME", value_name = "NAME")]
    pub name: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TemplateFormat {
    Aws,
    Azure,
    ClusterApi,
    Karpenter,
    Json,
}

impl From<TemplateFormat> for gpumem::ops::template::Format {
    fn from(format: TemplateFormat) -> Self {
        use gpumem::ops::template::Format;
        match format {
            TemplateFormat::Aws => Format::Aws,
            TemplateFormat::Azure => Format::Azure,
            TemplateFormat::ClusterApi => Format::ClusterApi,
            TemplateFormat::Karpenter => Format::Karpenter,
            TemplateFormat::Json => Format::Json,
        }
    }
}
