//! The `gpumem` command line: parses flags and calls the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use tokio_util::sync::CancellationToken;
use tracing::info;

use gpumem::deviceplugin::plugin::PluginConfig;
use gpumem::deviceplugin::podresources::{self, PodResources};
use gpumem::dra;
use gpumem::isolation::cdi::{self, SpecDir};
use gpumem::isolation::enforce::OverCapAction;
use gpumem::isolation::inject::{DeviceListStrategy, Isolation, ShimConfig};
use gpumem::node::hardware::Hardware;
use gpumem::node::health::{self, XidList};
use gpumem::node::inventory::Inventory;
use gpumem::node::placement::Policy;
use gpumem::node::processes::{self, ProcessUsage};
use gpumem::node::resource::{ResourceName, DEFAULT_RESOURCE_NAME};
use gpumem::node::units::{MemorySize, MemoryUnit};
use gpumem::ops::daemon::{self, DaemonConfig};
#[cfg(feature = "demo")]
use gpumem::ops::demo::{self, DemoConfig};
use gpumem::ops::exec::{self, ExecConfig};
use gpumem::ops::inspect;
use gpumem::ops::metrics;
use gpumem::ops::status::NodeStatus;

/// Share NVIDIA GPUs between Kubernetes pods by memory.
///
/// Every flag can also be set through the environment variable shown with
/// it: GPUMEM_<FLAG>, or GPUMEM_<COMMAND>_<FLAG> where the short name means
/// something else elsewhere (exec's --state-dir is GPUMEM_EXEC_STATE_DIR:
/// the shim reads GPUMEM_STATE_DIR).
#[derive(Parser)]
#[command(name = "gpumem", version, propagate_version = true)]
struct Cli {
    /// Log format: text for people (coloured only on a terminal, and not
    /// with NO_COLOR set), json for log pipelines.
    #[arg(long, global = true, env = "GPUMEM_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum IsolationMode {
    Shim,
    None,
}

/// NVIDIA's device plugin's device-list strategies (docs/OPERATIONS.md).
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DeviceListMode {
    Envvar,
    VolumeMounts,
    Cdi,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OutputFormat {
    Table,
    Json,
}

/// What is advertised: the resource and its unit.
#[derive(Args)]
struct ResourceArgs {
    /// Extended resource name to advertise (validated as kubelet does).
    #[arg(long, env = "GPUMEM_RESOURCE_NAME", default_value = DEFAULT_RESOURCE_NAME)]
    resource_name: ResourceName,

    /// Size of one unit: GiB (gpushare-compatible) or MiB.
    #[arg(
        long,
        env = "GPUMEM_MEMORY_UNIT",
        default_value = "GiB",
        value_name = "GiB|MiB"
    )]
    memory_unit: MemoryUnit,
}

#[derive(Args)]
struct PlacementArgs {
    /// GPU choice: binpack (fullest GPU that fits) or spread (emptiest GPU).
    #[arg(
        long,
        env = "GPUMEM_PLACEMENT",
        default_value = "binpack",
        value_name = "binpack|spread"
    )]
    placement: Policy,
}

/// The node: its GPUs, kubelet's pod-resources API, and isolation state.
#[derive(Args)]
struct NodeArgs {
    /// Describe the node's GPUs in a TOML file instead of asking NVML.
    #[arg(long, env = "GPUMEM_FAKE_GPUS", value_name = "FILE")]
    fake_gpus: Option<PathBuf>,

    /// kubelet's pod-resources socket: who holds which devices.
    #[arg(long, env = "GPUMEM_POD_RESOURCES_SOCKET", default_value = podresources::DEFAULT_SOCKET)]
    pod_resources_socket: PathBuf,

    /// Who enforces caps: shim (gpumem's LD_PRELOAD library) or none
    /// (something else, e.g. Alibaba cGPU reading ALIYUN_COM_GPU_MEM_*).
    #[arg(
        long,
        env = "GPUMEM_ISOLATION",
        default_value = "shim",
        value_name = "shim|none"
    )]
    isolation: IsolationMode,

    /// Host directory where the DaemonSet installs libgpumem_shim.so and ld.so.preload.
    #[arg(
        long,
        env = "GPUMEM_SHIM_HOST_DIR",
        default_value = "/usr/local/gpumem"
    )]
    shim_host_dir: PathBuf,

    /// Host directory for per-container accounting state (mounted into each
    /// container at /var/run/gpumem).
    #[arg(long, env = "GPUMEM_STATE_DIR", default_value = "/var/lib/gpumem")]
    state_dir: PathBuf,

    #[command(flatten)]
    context: ContextArgs,
}

#[derive(Args)]
struct ContextArgs {
    /// MiB charged for a CUDA context where the shim cannot measure it. The
    /// shim charges each context what the driver took for it (NVML's figure
    /// for the process, read around the call: 518 MiB on an H100 with driver
    /// 580); without NVML in the container it charges this instead, and
    /// refuses a context up front when this much does not fit. 0: contexts
    /// that cannot be measured are left to reconciliation.
    #[arg(long, env = "GPUMEM_CONTEXT_CHARGE_MIB", default_value_t = 0)]
    context_charge_mib: u64,
}

#[derive(Args)]
struct ReconcileArgs {
    /// Seconds between comparisons of NVML's per-process GPU memory with
    /// what the shim charged; the excess (CUDA contexts, libraries, pool
    /// reserves) counts against the cap. The plugin needs the host's PID
    /// namespace for it. 0: off (what the shim charges, only).
    #[arg(long, env = "GPUMEM_RECONCILE_SECS", default_value_t = 2)]
    reconcile_secs: u64,
}

/// How Allocate names the container's GPU to the container runtime.
#[derive(Args)]
struct DeviceListArgs {
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
    device_list_strategy: DeviceListMode,

    /// Host directory for the containers' CDI specs (with
    /// --device-list-strategy cdi): one the runtime reads (its cdi_spec_dirs).
    #[arg(long, env = "GPUMEM_CDI_SPEC_DIR", default_value = cdi::DEFAULT_SPEC_DIR)]
    cdi_spec_dir: PathBuf,
}

impl DeviceListArgs {
    fn strategy(&self) -> DeviceListStrategy {
        self.device_list_strategy.strategy(&self.cdi_spec_dir)
    }
}

impl DeviceListMode {
    fn strategy(self, cdi_spec_dir: &Path) -> DeviceListStrategy {
        match self {
            DeviceListMode::Envvar => DeviceListStrategy::Envvar,
            DeviceListMode::VolumeMounts => DeviceListStrategy::VolumeMounts,
            DeviceListMode::Cdi => DeviceListStrategy::Cdi(SpecDir::new(cdi_spec_dir)),
        }
    }
}

impl ReconcileArgs {
    fn source(&self, hardware: &Hardware) -> Option<(Box<dyn ProcessUsage>, Duration)> {
        if self.reconcile_secs == 0 {
            return None;
        }
        let every = Duration::from_secs(self.reconcile_secs);
        processes::source_for(hardware).map(|source| (source, every))
    }
}

#[derive(Args)]
struct PluginArgs {
    /// Directory holding kubelet.sock; our socket (gpumem.sock) is created here.
    #[arg(
        long,
        env = "GPUMEM_KUBELET_DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    kubelet_dir: PathBuf,

    #[command(flatten)]
    resource: ResourceArgs,

    #[command(flatten)]
    placement: PlacementArgs,

    #[command(flatten)]
    daemon: DaemonArgs,

    #[command(flatten)]
    device_list: DeviceListArgs,

    #[command(flatten)]
    cluster: ClusterArgs,
}

/// What both front ends run beside kubelet's API: the node, health, the
/// HTTP endpoint, reconciliation, the over-cap action and clean-up.
#[derive(Args)]
struct DaemonArgs {
    #[command(flatten)]
    node: NodeArgs,

    /// Address for /metrics, /healthz and /status (HOST:PORT or :PORT; empty: off).
    #[arg(long, env = "GPUMEM_METRICS_ADDR", default_value = ":9400")]
    metrics_addr: String,

    /// XIDs that do not make a GPU unhealthy (application errors): numbers
    /// separated by commas and/or spaces. Empty: every XID makes it unhealthy.
    #[arg(
        long,
        env = "GPUMEM_IGNORE_XIDS",
        value_name = "XIDS",
        default_value_t = XidList::default()
    )]
    ignore_xids: XidList,

    /// Seconds an unhealthy GPU must answer NVML without new errors before it
    /// is Healthy again. Problems that need a GPU reset (reset-class XIDs such
    /// as 48, 79, 95; a failed row remap) never recover this way
    /// (docs/OPERATIONS.md).
    #[arg(long, env = "GPUMEM_HEALTH_RECOVERY_SECS", default_value_t = 60)]
    health_recovery_secs: u64,

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
    over_cap_action: OverCapAction,

    /// Seconds a container may stay over its cap before the over-cap action.
    #[arg(long, env = "GPUMEM_OVER_CAP_GRACE_SECS", default_value_t = 10)]
    over_cap_grace_secs: u64,

    /// Seconds a finished container's accounting directory is kept before removal.
    #[arg(long, env = "GPUMEM_STATE_GRACE_SECS", default_value_t = 300)]
    state_grace_secs: u64,

    #[command(flatten)]
    reconcile: ReconcileArgs,
}

/// The DRA driver: kubelet's DRA plugin API instead of the device plugin's.
#[derive(Args)]
struct DraArgs {
    /// The driver's name, a DNS subdomain: in the ResourceSlice, the
    /// DeviceClass's selector, and the names of kubelet's sockets.
    #[arg(long, env = "GPUMEM_DRIVER_NAME", default_value = dra::DEFAULT_DRIVER_NAME)]
    driver_name: String,

    /// kubelet's DRA plugin directory; the DRA socket is created at
    /// <dir>/<driver-name>/dra.sock.
    #[arg(
        long,
        env = "GPUMEM_KUBELET_PLUGINS_DIR",
        default_value = dra::service::DEFAULT_PLUGINS_DIR
    )]
    kubelet_plugins_dir: PathBuf,

    /// kubelet's plugin-registration directory, which it watches; the
    /// registration socket is created at <dir>/<driver-name>-reg.sock.
    #[arg(
        long,
        env = "GPUMEM_KUBELET_REGISTRY_DIR",
        default_value = dra::service::DEFAULT_REGISTRY_DIR
    )]
    kubelet_registry_dir: PathBuf,

    /// Step of each claim's memory: GiB or MiB. The ResourceSlice offers
    /// each GPU's memory in whole steps (a 15079 MiB T4: at most 14Gi per claim
    /// with GiB).
    #[arg(
        long,
        env = "GPUMEM_MEMORY_UNIT",
        default_value = "GiB",
        value_name = "GiB|MiB"
    )]
    memory_unit: MemoryUnit,

    /// This node's name (the DaemonSet sets it from spec.nodeName): the
    /// ResourceSlice's node and pool.
    #[arg(long, env = "GPUMEM_NODE_NAME", value_name = "NAME")]
    node_name: String,

    /// kubeconfig for the API server (default: the pod's service account,
    /// then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "GPUMEM_KUBECONFIG", value_name = "FILE")]
    kubeconfig: Option<PathBuf>,

    /// Host directory for the claims' CDI specs: one the container runtime
    /// reads (containerd needs enable_cdi). NVIDIA's spec for the GPUs is
    /// looked for here and in /etc/cdi.
    #[arg(long, env = "GPUMEM_CDI_SPEC_DIR", default_value = cdi::DEFAULT_SPEC_DIR)]
    cdi_spec_dir: PathBuf,

    #[command(flatten)]
    daemon: DaemonArgs,
}

/// The API server: optional, for what only it knows.
#[derive(Args)]
struct ClusterArgs {
    /// This node's name (the DaemonSet sets it from spec.nodeName). With it
    /// gpumem uses the API server: it writes gpushare's pod annotations and
    /// GPU count (for `kubectl inspect gpushare`), publishes each GPU's
    /// units and health on the Node, and can follow gpushare's scheduler
    /// extender. Without it, kubelet is all gpumem talks to.
    #[arg(long, env = "GPUMEM_NODE_NAME", value_name = "NAME")]
    node_name: Option<String>,

    /// kubeconfig for the API server (default: the pod's service account,
    /// then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "GPUMEM_KUBECONFIG", value_name = "FILE")]
    kubeconfig: Option<PathBuf>,

    /// Who chooses each container's GPU: gpumem at admission (default: by
    /// --placement), or gpushare's scheduler extender through its pod
    /// annotations (gpushare-extender; needs --node-name).
    #[arg(
        long,
        env = "GPUMEM_SCHEDULER",
        default_value = "default",
        value_name = "default|gpushare-extender"
    )]
    scheduler: SchedulerMode,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum SchedulerMode {
    Default,
    GpushareExtender,
}

impl ClusterArgs {
    async fn connect(&self) -> anyhow::Result<Option<daemon::Cluster>> {
        let Some(node) = self.node_name.clone().filter(|n| !n.is_empty()) else {
            if self.scheduler == SchedulerMode::GpushareExtender {
                anyhow::bail!(
                    "--scheduler gpushare-extender needs --node-name (GPUMEM_NODE_NAME): the \
                     extender's choice is read from the pods bound to this node"
                );
            }
            return Ok(None);
        };
        let client = gpumem::cluster::client::connect(self.kubeconfig.as_deref()).await?;
        Ok(Some(daemon::Cluster {
            client,
            node,
            gpushare_extender: self.scheduler == SchedulerMode::GpushareExtender,
        }))
    }
}

#[cfg(feature = "demo")]
#[derive(Args)]
struct DemoArgs {
    /// Fake GPU file describing the demo node (default: one Tesla T4, 15079 MiB).
    #[arg(long, env = "GPUMEM_FAKE_GPUS", value_name = "FILE")]
    fake_gpus: Option<PathBuf>,

    #[command(flatten)]
    resource: ResourceArgs,

    #[command(flatten)]
    placement: PlacementArgs,

    /// Directory with libgpumem_shim.so, the fake driver libgpumem_fakegpu.so
    /// and gpumem-probe: each admitted container then runs a process held to
    /// its cap (default: beside gpumem, where `cargo build --release
    /// --workspace` puts them; skipped if they are not there).
    #[arg(long, env = "GPUMEM_DEMO_TENANT_DIR", value_name = "DIR")]
    tenant_dir: Option<PathBuf>,

    /// Play the DRA driver's scenario instead: the driver publishes the T4's
    /// memory as consumable capacity and prepares three claims of 4Gi
    /// (GPUMEM_DEMO_DRA: true or false).
    #[arg(
        long,
        env = "GPUMEM_DEMO_DRA",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    dra: bool,

    /// How Allocate names the GPU to the runtime: envvar, volume-mounts or
    /// cdi (the demo writes CDI specs into its own temporary directory).
    #[arg(
        long,
        env = "GPUMEM_DEVICE_LIST_STRATEGY",
        default_value = "envvar",
        value_name = "envvar|volume-mounts|cdi"
    )]
    device_list_strategy: DeviceListMode,
}

#[derive(Args)]
struct ExecArgs {
    /// Memory cap per GPU, greater than 0: 4308MiB, 4GiB, or a number of
    /// MiB. A GPU with less memory than this is not limited by it (gpumem
    /// warns).
    #[arg(long, env = "GPUMEM_MEM", value_name = "SIZE")]
    mem: MemorySize,

    /// GPU to cap, by index or UUID (repeatable or comma-separated;
    /// default: every GPU). Also limits CUDA to the chosen GPUs.
    #[arg(
        long = "gpu",
        env = "GPUMEM_GPU",
        value_name = "INDEX|UUID",
        value_delimiter = ','
    )]
    gpus: Vec<String>,

    /// Accounting directory to share between commands (each `gpumem exec`
    /// with the same one shares one cap); default: a private temporary one.
    /// (Not GPUMEM_STATE_DIR: the shim reads that in the capped command.)
    #[arg(long, env = "GPUMEM_EXEC_STATE_DIR", value_name = "DIR")]
    state_dir: Option<PathBuf>,

    /// The shim library (default: libgpumem_shim.so next to gpumem, then
    /// /usr/local/gpumem/libgpumem_shim.so).
    #[arg(long, env = "GPUMEM_SHIM", value_name = "FILE")]
    shim: Option<PathBuf>,

    /// Describe GPUs in a TOML file instead of asking NVML.
    #[arg(long, env = "GPUMEM_FAKE_GPUS", value_name = "FILE")]
    fake_gpus: Option<PathBuf>,

    #[command(flatten)]
    context: ContextArgs,

    #[command(flatten)]
    reconcile: ReconcileArgs,

    /// The command and its arguments: everything from the first word that
    /// is not a gpumem flag. `--` before it is optional (needed for a
    /// command that starts with `-`).
    #[arg(
        trailing_var_arg = true,
        required = true,
        num_args = 1..,
        value_name = "COMMAND"
    )]
    command: Vec<std::ffi::OsString>,
}

#[derive(Args)]
struct InstallArgs {
    /// The shim to install (default: libgpumem_shim.so next to gpumem).
    /// Refused unless it is the shim, built for this machine.
    #[arg(long, env = "GPUMEM_INSTALL_SHIM_FROM", value_name = "FILE")]
    from: Option<PathBuf>,

    /// Host directory to install into (the plugin's --shim-host-dir).
    #[arg(
        long,
        env = "GPUMEM_INSTALL_SHIM_TO",
        value_name = "DIR",
        default_value = "/usr/local/gpumem"
    )]
    to: PathBuf,
}

#[derive(Args)]
struct ExtenderArgs {
    /// Address for kube-scheduler's calls (POST /filter, /prioritize,
    /// /bind) and GET /healthz (HOST:PORT or :PORT).
    #[arg(long, env = "GPUMEM_EXTENDER_LISTEN_ADDR", default_value = ":12345")]
    listen_addr: String,

    /// kubeconfig for the API server (default: the pod's service account,
    /// then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "GPUMEM_KUBECONFIG", value_name = "FILE")]
    kubeconfig: Option<PathBuf>,

    /// Extended resource whose units are placed (the plugins' --resource-name).
    #[arg(long, env = "GPUMEM_RESOURCE_NAME", default_value = DEFAULT_RESOURCE_NAME)]
    resource_name: ResourceName,

    #[command(flatten)]
    placement: PlacementArgs,

    /// Seconds a bind's booking of GPU units waits for the pod watch to
    /// show the pod bound before it is dropped.
    #[arg(long, env = "GPUMEM_ASSUME_TIMEOUT_SECS", default_value_t = 60)]
    assume_timeout_secs: u64,
}

#[derive(Args)]
struct InspectArgs {
    /// Show each pod and container with its units, cap and usage
    /// (GPUMEM_INSPECT_DETAILS: true or false).
    #[arg(
        short = 'd',
        long,
        env = "GPUMEM_INSPECT_DETAILS",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    details: bool,

    /// Output format.
    #[arg(
        short = 'o',
        long,
        env = "GPUMEM_INSPECT_OUTPUT",
        default_value = "table",
        value_name = "table|json"
    )]
    output: OutputFormat,

    /// The running plugin's --metrics-addr; without an answer there, the
    /// node is read directly (GPUs, pod-resources, accounting files).
    #[arg(long, env = "GPUMEM_METRICS_ADDR", default_value = ":9400")]
    metrics_addr: String,

    #[command(flatten)]
    resource: ResourceArgs,

    #[command(flatten)]
    node: NodeArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Plugin(_) | Command::Dra(_) => "info",
        Command::InstallShim(_) | Command::Extender(_) => "info",
        #[cfg(feature = "demo")]
        Command::Demo(_) => "warn",
        Command::Exec(_) | Command::Inspect(_) => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // Colours only for a person at a terminal: `kubectl logs` and log
    // pipelines would show the escape codes.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }

    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
        .and_then(|runtime| {
            runtime.block_on(async {
                match cli.command {
                    Command::Plugin(args) => plugin(args).await.map(|()| ExitCode::SUCCESS),
                    Command::Dra(args) => dra_driver(args).await.map(|()| ExitCode::SUCCESS),
                    #[cfg(feature = "demo")]
                    Command::Demo(args) => {
                        let report = demo::run(DemoConfig {
                            fake_gpus: args.fake_gpus,
                            unit: args.resource.memory_unit,
                            policy: args.placement.placement,
                            resource_name: args.resource.resource_name,
                            tenant_dir: args.tenant_dir,
                            device_list: args
                                .device_list_strategy
                                .strategy(Path::new(cdi::DEFAULT_SPEC_DIR)),
                            dra: args.dra,
                        })
                        .await?;
                        print!("{report}");
                        Ok(ExitCode::SUCCESS)
                    }
                    Command::Exec(args) => exec(args).await,
                    Command::Inspect(args) => inspect(args).await.map(|()| ExitCode::SUCCESS),
                    Command::Extender(args) => extender(args).await.map(|()| ExitCode::SUCCESS),
                    Command::InstallShim(args) => {
                        let from = match args.from {
                            Some(path) => path,
                            None => exec::find_shim(None, "--from")?,
                        };
                        let installed = gpumem::isolation::install::install(&from, &args.to)?;
                        info!(shim = %installed.display(), "installed");
                        Ok(ExitCode::SUCCESS)
                    }
                }
            })
        });
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("gpumem: error: {}", one_line(err.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, each said once. gpumem's errors put
/// their cause in their own message, so they read whole wherever they are
/// shown; anyhow's `{:#}` would then print the cause a second time.
fn one_line(err: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    let mut outer = String::new();
    for cause in std::iter::successors(Some(err), |e| e.source()) {
        let text = cause.to_string();
        if !outer.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        outer = text;
    }
    line
}

impl NodeArgs {
    fn isolation(&self) -> Isolation {
        match self.isolation {
            IsolationMode::Shim => Isolation::Shim(ShimConfig {
                host_dir: self.shim_host_dir.clone(),
                state_dir: self.state_dir.clone(),
                context_charge_mib: self.context.context_charge_mib,
            }),
            IsolationMode::None => Isolation::None,
        }
    }
}

async fn plugin(args: PluginArgs) -> anyhow::Result<()> {
    let unit = args.resource.memory_unit;
    let hardware = Hardware::new(args.daemon.node.fake_gpus.as_deref());
    let daemon = args.daemon.start(&hardware, unit).await?;
    info!(
        %unit,
        placement = %args.placement.placement,
        metrics = %args.daemon.metrics_addr,
        ignore_xids = ?args.daemon.ignore_xids.0,
        device_list = %args.device_list.strategy(),
        "starting"
    );
    let cluster = args.cluster.connect().await?;
    let config = DaemonConfig {
        plugin: PluginConfig {
            kubelet_dir: args.kubelet_dir,
            resource_name: args.resource.resource_name,
            policy: args.placement.placement,
            isolation: args.daemon.node.isolation(),
            device_list: args.device_list.strategy(),
        },
        pod_resources_socket: args.daemon.node.pod_resources_socket.clone(),
        common: daemon.common,
        cluster,
    };
    daemon::run(config, daemon.inventory, daemon.health, daemon.shutdown).await?;
    Ok(())
}

async fn dra_driver(args: DraArgs) -> anyhow::Result<()> {
    dra::validate_driver_name(&args.driver_name).map_err(|reason| {
        anyhow::anyhow!("invalid --driver-name {:?}: {reason}", args.driver_name)
    })?;
    if args.node_name.is_empty() {
        anyhow::bail!("--node-name (GPUMEM_NODE_NAME) is empty: the DRA driver publishes this node's GPUs under its name");
    }
    let unit = args.memory_unit;
    let hardware = Hardware::new(args.daemon.node.fake_gpus.as_deref());
    let facts = hardware.facts()?;
    let daemon = args.daemon.start(&hardware, unit).await?;
    info!(
        driver = %args.driver_name,
        node = %args.node_name,
        %unit,
        metrics = %args.daemon.metrics_addr,
        "starting the DRA driver"
    );
    let client = gpumem::cluster::client::connect(args.kubeconfig.as_deref()).await?;
    let boot_id = dra::checkpoint::current_boot_id()
        .context("cannot read the boot ID (/proc/sys/kernel/random/boot_id)")?;
    let config = daemon::DraDaemonConfig {
        driver: dra::prepare::DriverConfig {
            driver: args.driver_name.clone(),
            node: args.node_name.clone(),
            isolation: args.daemon.node.isolation(),
            specs: SpecDir::of_class(&args.cdi_spec_dir, cdi::CLAIM_CLASS),
            nvidia_spec_dirs: vec![PathBuf::from("/etc/cdi"), args.cdi_spec_dir.clone()],
        },
        sockets: dra::service::DraSockets {
            driver_name: args.driver_name,
            plugins_dir: args.kubelet_plugins_dir,
            registry_dir: args.kubelet_registry_dir,
        },
        client,
        facts,
        boot_id,
        pod_resources_socket: args.daemon.node.pod_resources_socket.clone(),
        common: daemon.common,
    };
    daemon::run_dra(config, daemon.inventory, daemon.health, daemon.shutdown).await?;
    Ok(())
}

/// A front end's daemon, ready to start: what `DaemonArgs` gave.
struct Started {
    inventory: Inventory,
    health: Option<Box<dyn health::HealthWatch>>,
    common: daemon::Common,
    shutdown: CancellationToken,
}

impl DaemonArgs {
    /// Discovers the GPUs, binds the HTTP endpoint (so a bad address fails
    /// before anything starts) and installs the signal handlers.
    async fn start(&self, hardware: &Hardware, unit: MemoryUnit) -> anyhow::Result<Started> {
        let inventory = Inventory::new(hardware.discover()?, unit)?;
        for g in inventory.gpus() {
            info!(
                index = g.gpu.index,
                name = %g.gpu.name,
                uuid = %g.gpu.uuid,
                memory_mib = g.gpu.memory_mib,
                units = g.units,
                id_prefix = %g.key,
                "GPU"
            );
        }
        let metrics = match metrics::parse_address(&self.metrics_addr)? {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("--metrics-addr {addr}: cannot listen"))?,
            ),
            None => None,
        };
        let health = health::watch_for(
            hardware,
            &self.ignore_xids.0,
            Duration::from_secs(self.health_recovery_secs),
        );
        let shutdown = CancellationToken::new();
        tokio::spawn(stop_on_signal(shutdown.clone()));
        let reconcile = match self.node.isolation {
            IsolationMode::Shim => self.reconcile.source(hardware),
            IsolationMode::None => None,
        };
        Ok(Started {
            inventory,
            health,
            common: daemon::Common {
                state_dir: self.node.state_dir.clone(),
                metrics,
                state_grace: Duration::from_secs(self.state_grace_secs),
                reconcile,
                over_cap: Some((
                    self.over_cap_action,
                    Duration::from_secs(self.over_cap_grace_secs),
                )),
            },
            shutdown,
        })
    }
}

async fn extender(args: ExtenderArgs) -> anyhow::Result<()> {
    let addr = metrics::parse_address(&args.listen_addr)
        .ok()
        .flatten()
        .with_context(|| {
            format!(
                "invalid --listen-addr {:?}: expected HOST:PORT or :PORT",
                args.listen_addr
            )
        })?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("--listen-addr {addr}: cannot listen"))?;
    let client = gpumem::cluster::client::connect(args.kubeconfig.as_deref()).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let config = gpumem::extender::ExtenderConfig {
        resource_name: args.resource_name,
        policy: args.placement.placement,
        assume_timeout: Duration::from_secs(args.assume_timeout_secs),
    };
    gpumem::extender::run(config, client, listener, shutdown).await?;
    Ok(())
}

async fn exec(args: ExecArgs) -> anyhow::Result<ExitCode> {
    let only_selected = !args.gpus.is_empty();
    let hardware = Hardware::new(args.fake_gpus.as_deref());
    let gpus = exec::select(hardware.discover()?, &args.gpus)?;
    let mem_mib = args.mem.mib;
    // Most likely a typo or the wrong node; still run, as one cap for
    // mixed GPUs is legitimate.
    for gpu in exec::smaller_than_cap(&gpus, mem_mib) {
        eprintln!(
            "gpumem: warning: --mem {mem_mib} MiB is more than GPU {} ({}) has, {} MiB, so it \
             does not limit the command there",
            gpu.index, gpu.name, gpu.memory_mib
        );
    }
    let shared = args.state_dir.clone();
    let run = exec::run(ExecConfig {
        mem_mib: args.mem.mib,
        gpus,
        state_dir: args.state_dir,
        shim: exec::find_shim(args.shim, "--shim")?,
        context_charge_mib: args.context.context_charge_mib,
        only_selected,
        reconcile: args.reconcile.source(&hardware),
        command: args.command,
    })
    .await;
    let finished = match run {
        Ok(finished) => finished,
        Err(err) => match err.exit_code() {
            // A shell's status for a command it cannot start.
            Some(code) => {
                eprintln!("gpumem: error: {}", one_line(&err));
                return Ok(ExitCode::from(code));
            }
            None => return Err(err.into()),
        },
    };
    if finished.refusals > 0 {
        // Why the command may have failed with out-of-memory. The file
        // counts refusals per GPU, not per process.
        let whose = match shared {
            Some(dir) => format!(
                " while the command ran, by it or another command sharing --state-dir {}",
                dir.display()
            ),
            None => String::new(),
        };
        eprintln!(
            "gpumem: {} GPU allocation(s) refused at the {mem_mib} MiB cap{whose} (peak use {} MiB)",
            finished.refusals, finished.peak_mib
        );
    }
    let status = finished.status;
    // A child killed by a signal exits 128 + signal, as shells report it.
    let code = status
        .code()
        .or_else(|| std::os::unix::process::ExitStatusExt::signal(&status).map(|s| 128 + s))
        .unwrap_or(1);
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let from_plugin = match metrics::parse_address(&args.metrics_addr)? {
        Some(addr) => Some(inspect::fetch(inspect::local(addr)).await),
        None => None,
    };
    let status = match from_plugin {
        Some(Ok(status)) => status,
        fallback => {
            if let Some(Err(err)) = fallback {
                tracing::info!(%err, "reading the node directly");
            }
            let hardware = Hardware::new(args.node.fake_gpus.as_deref());
            let inventory = Inventory::new(hardware.discover()?, args.resource.memory_unit)?;
            let resource = args.resource.resource_name.to_string();
            let holdings = PodResources::new(&args.node.pod_resources_socket, &resource)
                .holdings()
                .await;
            NodeStatus::build(
                &inventory,
                &resource,
                false,
                holdings,
                &args.node.isolation(),
            )
        }
    };
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&status)?),
        OutputFormat::Table => print!("{}", status.table(args.details)),
    }
    Ok(())
}

/// SIGTERM (kubelet stopping the pod) or SIGINT fans out to one token.
async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; SIGTERM will not stop gpumem cleanly");
        return;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: stopping"),
        _ = int.recv() => info!("SIGINT: stopping"),
    }
    shutdown.cancel();
}
