//! The `gpumem` command line: parses flags and calls the library.

mod cli;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use tracing::info;

use gpumem::deviceplugin::plugin::PluginConfig;
use gpumem::dra;
use gpumem::isolation::cdi::{self, SpecDir};
use gpumem::ops::daemon::{self, DaemonConfig};
#[cfg(feature = "demo")]
use gpumem::ops::demo::{self, DemoConfig};
use gpumem::ops::exec::{self, ExecConfig};
use gpumem::ops::inspect;
use gpumem::ops::metrics;

use cli::{
    Cli, Command, DraArgs, ExecArgs, ExtenderArgs, InspectArgs, LogFormat, NodeTemplateArgs,
    OutputFormat, PluginArgs, UnpublishArgs,
};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Plugin(_) | Command::Dra(_) => "info",
        Command::InstallShim(_) | Command::Extender(_) | Command::Unpublish(_) => "info",
        #[cfg(feature = "demo")]
        Command::Demo(_) => "warn",
        Command::Exec(_) | Command::Inspect(_) | Command::NodeTemplate(_) => "warn",
    };
    // kube's client logs every failed request at ERROR with only its top
    // level ("client error (Connect)"), and its watcher each refused list;
    // gpumem says once which server and why (`cluster::client::ApiHealth`),
    // and each watch's failures with their backoff.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!(
            "{default_level},kube_client::client::builder=off,kube_runtime::watcher=error"
        ))
    });
    // Colours only for a person at a terminal: `kubectl logs` and log
    // pipelines would show the escape codes.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    let log_format = cli.log_format;
    match log_format {
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
                            device_list: args.device_list(),
                            fake_gpus: args.fake_gpus.fake_gpus,
                            unit: args.resource.memory_unit,
                            policy: args.placement.placement,
                            resource_name: args.resource.resource_name,
                            tenant_dir: args.tenant_dir,
                            dra: args.dra,
                        })
                        .await?;
                        print!("{report}");
                        Ok(ExitCode::SUCCESS)
                    }
                    Command::Exec(args) => exec(args).await,
                    Command::Inspect(args) => inspect(args).await.map(|()| ExitCode::SUCCESS),
                    Command::Extender(args) => extender(args).await.map(|()| ExitCode::SUCCESS),
                    Command::Unpublish(args) => unpublish(args).await.map(|()| ExitCode::SUCCESS),
                    Command::NodeTemplate(args) => node_template(args).map(|()| ExitCode::SUCCESS),
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
            let message = gpumem::error_text::one_line(err.as_ref());
            match log_format {
                // One more record for the log pipeline, not a line it
                // cannot parse.
                LogFormat::Json => tracing::error!(error = %message, "gpumem stopped"),
                LogFormat::Text => eprintln!("gpumem: error: {message}"),
            }
            ExitCode::FAILURE
        }
    }
}

async fn plugin(args: PluginArgs) -> anyhow::Result<()> {
    let unit = args.resource.memory_unit;
    let hardware = args.daemon.node.fake_gpus.hardware();
    let node_name = args.cluster.node_name.as_deref();
    let daemon = daemon::start(args.daemon.node(&*hardware, unit, node_name)).await?;
    gpumem::deviceplugin::list::warn_of_slow_kubelet_restarts(&daemon.inventory);
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
    let startup_taint = args.startup_taint.taint()?;
    let unit = args.memory_unit;
    let hardware = args.daemon.node.fake_gpus.hardware();
    let facts = hardware.facts()?;
    let daemon = daemon::start(args.daemon.node(&*hardware, unit, Some(&args.node_name))).await?;
    info!(
        driver = %args.driver_name,
        node = %args.node_name,
        %unit,
        metrics = %args.daemon.metrics_addr,
        "starting the DRA driver"
    );
    let (client, api) = gpumem::cluster::client::connect_watched(args.kubeconfig.path()).await?;
    let boot_id = dra::checkpoint::current_boot_id()
        .context("cannot read the boot ID (/proc/sys/kernel/random/boot_id)")?;
    let config = daemon::DraDaemonConfig {
        driver: dra::prepare::DriverConfig {
            driver: args.driver_name.clone(),
            node: args.node_name.clone(),
            isolation: args.daemon.node.isolation(),
            specs: SpecDir::of_class(&args.cdi_spec_dir, cdi::CLAIM_CLASS),
            nvidia_spec_dirs: cdi::nvidia_spec_dirs(&args.cdi_spec_dir),
        },
        sockets: dra::service::DraSockets {
            driver_name: args.driver_name,
            plugins_dir: args.kubelet_plugins_dir,
            registry_dir: args.kubelet_registry_dir,
        },
        client,
        api,
        facts,
        boot_id,
        pod_resources_socket: args.daemon.node.pod_resources_socket.clone(),
        startup_taint,
        common: daemon.common,
    };
    daemon::run_dra(config, daemon.inventory, daemon.health, daemon.shutdown).await?;
    Ok(())
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
    let metrics_listener = match metrics::parse_address(&args.metrics_addr)? {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--metrics-addr {addr}: cannot listen"))?,
        ),
        None => None,
    };
    let client = gpumem::cluster::client::connect(args.kubeconfig.path()).await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(daemon::stop_on_signal(shutdown.clone()));
    let config = gpumem::extender::ExtenderConfig {
        resource_name: args.resource_name,
        policy: args.placement.placement,
        assume_timeout: Duration::from_secs(args.assume_timeout_secs),
    };
    gpumem::extender::run(config, client, listener, metrics_listener, shutdown).await?;
    Ok(())
}

async fn unpublish(args: UnpublishArgs) -> anyhow::Result<()> {
    let client = gpumem::cluster::client::connect(args.kubeconfig.path()).await?;
    let selector = args.selector.as_deref().unwrap_or_default();
    let changed = gpumem::cluster::node::unpublish(&client, &args.nodes, selector).await?;
    if changed.is_empty() {
        match selector {
            "" => println!("no Node carries gpumem's annotation: nothing to remove"),
            s => println!("no Node labelled {s} carries gpumem's annotation: nothing to remove"),
        }
    }
    for node in changed {
        println!("removed gpumem's GPU count and annotation from Node {node}");
    }
    Ok(())
}

fn node_template(args: NodeTemplateArgs) -> anyhow::Result<()> {
    use gpumem::ops::template::{GpuChoice, NodeTemplate, OverlayScope};
    let choice = match (args.gpu, args.gpu_mib, args.fake_gpus) {
        (Some(model), _, _) => GpuChoice::Model(model, args.count),
        (_, Some(mib), _) => GpuChoice::Mib(mib, args.count),
        (_, _, Some(file)) => GpuChoice::File(file),
        (None, None, None) => anyhow::bail!("give the GPUs: --gpu, --gpu-mib or --fake-gpus"),
    };
    let template = NodeTemplate::new(
        choice.gpus()?,
        args.resource.memory_unit,
        &args.resource.resource_name,
        &args.labels,
    )?;
    let scope = OverlayScope {
        name: args.name,
        instance_types: args.instance_types,
        node_pool: args.node_pool,
    };
    print!("{}", template.render(args.output.into(), &scope)?);
    Ok(())
}

async fn exec(args: ExecArgs) -> anyhow::Result<ExitCode> {
    let only_selected = !args.gpus.is_empty();
    let hardware = args.fake_gpus.hardware();
    let gpus = exec::select(hardware.discover()?, &args.gpus)?;
    let mem_mib = args.mem.mib;
    for gpu in exec::smaller_than_cap(&gpus, mem_mib) {
        eprintln!("{}", exec::cap_warning(gpu, mem_mib));
    }
    let shared = args.state_dir.clone();
    let run = exec::run(ExecConfig {
        mem_mib: args.mem.mib,
        gpus,
        state_dir: args.state_dir,
        shim: exec::find_shim(args.shim, "--shim")?,
        context_charge_mib: args.context.context_charge_mib,
        only_selected,
        reconcile: args.reconcile.source(&*hardware),
        command: args.command,
    })
    .await;
    let finished = match run {
        Ok(finished) => finished,
        Err(err) => match err.exit_code() {
            // A shell's status for a command it cannot start.
            Some(code) => {
                eprintln!("gpumem: error: {}", gpumem::error_text::one_line(&err));
                return Ok(ExitCode::from(code));
            }
            None => return Err(err.into()),
        },
    };
    if let Some(report) = finished.refusal_report(mem_mib, shared.as_deref()) {
        eprintln!("{report}");
    }
    Ok(ExitCode::from(finished.exit_code()))
}

async fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    if let Some(addr) = &args.metrics_addr {
        tracing::warn!(
            "inspect --metrics-addr {addr} is ignored: the plugin serves who holds what on its \
             --status-socket only (docs/SECURITY.md)"
        );
    }
    let plugin = args.node.status_socket();
    let status = inspect::status(
        plugin.as_deref(),
        inspect::DirectRead {
            hardware: &*args.node.fake_gpus.hardware(),
            unit: args.resource.memory_unit,
            resource_name: &args.resource.resource_name,
            pod_resources_socket: &args.node.pod_resources_socket,
            isolation: &args.node.isolation(),
        },
    )
    .await?;
    match args.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&status)?),
        OutputFormat::Table => print!("{}", status.table(args.details)),
    }
    Ok(())
}
