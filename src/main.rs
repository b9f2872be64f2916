//! The `gpumem` command line: parses flags and calls the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

use gpumem::demo::{self, DemoConfig};
use gpumem::gpu::{FakeGpus, GpuSource, NvmlGpus};
use gpumem::inventory::Inventory;
use gpumem::placement::Policy;
use gpumem::plugin::{Plugin, PluginConfig};
use gpumem::resource::{ResourceName, DEFAULT_RESOURCE_NAME};
use gpumem::units::MemoryUnit;

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

    /// Directory for per-container accounting state (used by the memory-isolation shim).
    #[arg(long, env = "GPUMEM_STATE_DIR", default_value = "/var/lib/gpumem")]
    state_dir: PathBuf,
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
        Command::Demo(_) => "warn",
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
                    Command::Plugin(args) => plugin(args).await,
                    Command::Demo(args) => {
                        let report = demo::run(DemoConfig {
                            fake_gpus: args.fake_gpus,
                            unit: args.advertise.memory_unit,
                            policy: args.advertise.placement,
                            resource_name: args.advertise.resource_name,
                        })
                        .await?;
                        print!("{report}");
                        Ok(())
                    }
                }
            })
        });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("gpumem: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn plugin(args: PluginArgs) -> anyhow::Result<()> {
    let source: Box<dyn GpuSource> = match &args.fake_gpus {
        Some(path) => Box::new(FakeGpus::from_file(path)?),
        None => Box::new(NvmlGpus),
    };
    let unit = args.advertise.memory_unit;
    let inventory = Inventory::new(source.discover()?, unit)?;
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
    info!(state_dir = %args.state_dir.display(), %unit, placement = %args.advertise.placement, "starting");

    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    let (_keep_inventory, inventory) = watch::channel(Arc::new(inventory));
    Plugin::new(PluginConfig {
        kubelet_dir: args.kubelet_dir,
        resource_name: args.advertise.resource_name,
        policy: args.advertise.placement,
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
