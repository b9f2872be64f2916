//! The `gpumem` command line: parses flags and calls the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

use gpumem::demo::{self, DemoConfig};
use gpumem::exec::{self, ExecConfig};
use gpumem::gpu::{FakeGpus, Gpu, GpuSource, NvmlGpus};
use gpumem::inject::{Isolation, ShimConfig};
use gpumem::inventory::Inventory;
use gpumem::placement::Policy;
use gpumem::plugin::{Plugin, PluginConfig};
use gpumem::resource::{ResourceName, DEFAULT_RESOURCE_NAME};
use gpumem::units::{MemorySize, MemoryUnit};

/// Share NVIDIA GPUs between Kubernetes pods by memory.
#[derive(Parser)]
#[command(name = "gpumem", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the device plugin on a GPU node (the DaemonSet's command).
    Plugin(PluginArgs),
    /// Run the real plugin against a simulated kubelet on a fake T4 node and
    /// replay the gpushare notebook scenario. Needs no GPU and no cluster.
    Demo(DemoArgs),
    /// Run a command with its GPU memory capped, as in a gpumem container
    /// (e.g. `gpumem exec --mem 4308MiB -- nvidia-smi`).
    Exec(ExecArgs),
}

/// Every flag can also be set through the environment variable shown.
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
    advertise: AdvertiseArgs,

    /// Describe the node's GPUs in a TOML file instead of asking NVML.
    #[arg(long, env = "GPUMEM_FAKE_GPUS", value_name = "FILE")]
    fake_gpus: Option<PathBuf>,

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
    /// MiB charged once per process and GPU for its CUDA context, which the
    /// driver takes outside any allocation (about 520 MiB on an H100 with
    /// driver 580; measure yours). 0 charges allocations only.
    #[arg(long, env = "GPUMEM_CONTEXT_CHARGE_MIB", default_value_t = 0)]
    context_charge_mib: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum IsolationMode {
    Shim,
    None,
}

#[derive(Args)]
struct ExecArgs {
    /// Memory cap per GPU: 4308MiB, 4GiB, or a number of MiB.
    #[arg(long, env = "GPUMEM_MEM")]
    mem: MemorySize,

    /// GPU to cap, by index or UUID (repeatable; default: every GPU). Also
    /// limits CUDA to the chosen GPUs.
    #[arg(long = "gpu", value_name = "INDEX|UUID")]
    gpus: Vec<String>,

    /// Accounting directory to share between commands (each `gpumem exec`
    /// with the same one shares one cap); default: a private temporary one.
    #[arg(long, env = "GPUMEM_STATE_DIR")]
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

    /// The command and its arguments.
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<std::ffi::OsString>,
}

#[derive(Args)]
struct AdvertiseArgs {
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

    /// GPU choice: binpack (fullest GPU that fits) or spread (emptiest GPU).
    #[arg(
        long,
        env = "GPUMEM_PLACEMENT",
        default_value = "binpack",
        value_name = "binpack|spread"
    )]
    placement: Policy,
}

#[derive(Args)]
struct DemoArgs {
    /// Fake GPU file describing the demo node (default: one Tesla T4, 15079 MiB).
    #[arg(long, env = "GPUMEM_FAKE_GPUS", value_name = "FILE")]
    fake_gpus: Option<PathBuf>,

    #[command(flatten)]
    advertise: AdvertiseArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Plugin(_) => "info",
        Command::Demo(_) | Command::Exec(_) => "warn",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .with_writer(std::io::stderr)
        .init();

    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
        .and_then(|runtime| {
            runtime.block_on(async {
                match cli.command {
                    Command::Plugin(args) => plugin(args).await.map(|()| ExitCode::SUCCESS),
                    Command::Demo(args) => {
                        let report = demo::run(DemoConfig {
                            fake_gpus: args.fake_gpus,
                            unit: args.advertise.memory_unit,
                            policy: args.advertise.placement,
                            resource_name: args.advertise.resource_name,
                        })
                        .await?;
                        print!("{report}");
                        Ok(ExitCode::SUCCESS)
                    }
                    Command::Exec(args) => exec(args).await,
                }
            })
        });
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("gpumem: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// GPUs from a fake file, or from NVML.
fn discover(fake_gpus: Option<&Path>) -> anyhow::Result<Vec<Gpu>> {
    let source: Box<dyn GpuSource> = match fake_gpus {
        Some(path) => Box::new(FakeGpus::from_file(path)?),
        None => Box::new(NvmlGpus),
    };
    Ok(source.discover()?)
}

async fn exec(args: ExecArgs) -> anyhow::Result<ExitCode> {
    let only_selected = !args.gpus.is_empty();
    let gpus = exec::select(discover(args.fake_gpus.as_deref())?, &args.gpus)?;
    let status = exec::run(ExecConfig {
        mem_mib: args.mem.mib,
        gpus,
        state_dir: args.state_dir,
        shim: exec::find_shim(args.shim)?,
        context_charge_mib: args.context.context_charge_mib,
        only_selected,
        command: args.command,
    })
    .await?;
    // A child killed by a signal exits 128 + signal, as shells report it.
    let code = status
        .code()
        .or_else(|| std::os::unix::process::ExitStatusExt::signal(&status).map(|s| 128 + s))
        .unwrap_or(1);
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

async fn plugin(args: PluginArgs) -> anyhow::Result<()> {
    let unit = args.advertise.memory_unit;
    let inventory = Inventory::new(discover(args.fake_gpus.as_deref())?, unit)?;
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
    info!(%unit, placement = %args.advertise.placement, "starting");

    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let (_keep_inventory, inventory) = watch::channel(Arc::new(inventory));
    let isolation = match args.isolation {
        IsolationMode::Shim => Isolation::Shim(ShimConfig {
            host_dir: args.shim_host_dir,
            state_dir: args.state_dir,
            context_charge_mib: args.context.context_charge_mib,
        }),
        IsolationMode::None => Isolation::None,
    };
    Plugin::new(PluginConfig {
        kubelet_dir: args.kubelet_dir,
        resource_name: args.advertise.resource_name,
        policy: args.advertise.placement,
        isolation,
    })
    .run(inventory, shutdown)
    .await?;
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
