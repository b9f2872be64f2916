//! gpumem's own kube-scheduler extender (`gpumem extender`): filters nodes
//! by the free units of each GPU, scores them binpack or spread, and binds
//! each pod with gpushare's annotations, so the node's plugin
//! (`--scheduler gpushare-extender`) puts it on the GPU chosen here.
//!
//! A front end beside the device plugin: it speaks kube-scheduler's JSON
//! and uses the cluster layer (API client, gpushare's annotations, the
//! GPUs each plugin publishes on its Node) and the node layer's policy.
//! `cache` and `fit` are pure; `watch`, `bind` and `server` do the I/O.

pub mod api;
pub mod bind;
pub mod cache;
pub mod fit;
pub mod metrics;
pub mod server;
pub mod watch;

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Client;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::extender::bind::Binder;
use crate::extender::cache::Cache;
use crate::extender::metrics::ExtenderMetrics;
use crate::node::placement::Policy;
use crate::node::resource::ResourceName;

pub struct ExtenderConfig {
    /// The extended resource whose units are placed.
    pub resource_name: ResourceName,
    /// GPU and node choice: binpack or spread.
    pub policy: Policy,
    /// How long a bind's booking waits for the pod watch to show the pod
    /// bound before it is dropped.
    pub assume_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ExtenderError {
    #[error("cannot serve the extender on {addr}")]
    Serve { addr: String, source: io::Error },
    #[error("cannot serve the extender's metrics on {addr}")]
    Metrics { addr: String, source: io::Error },
}

fn address(listener: &TcpListener) -> String {
    listener
        .local_addr()
        .map_or_else(|_| "?".to_owned(), |a: SocketAddr| a.to_string())
}

/// Watches pods and nodes and serves kube-scheduler's verbs on `listener`,
/// and `/metrics` on `metrics_listener` where given, until `shutdown`.
pub async fn run(
    config: ExtenderConfig,
    client: Client,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    shutdown: CancellationToken,
) -> Result<(), ExtenderError> {
    crate::version::log_start();
    let addr = address(&listener);
    let cache = Arc::new(Mutex::new(Cache::new(config.resource_name.as_str())));
    let watches = watch::spawn(client.clone(), cache.clone(), shutdown.clone());
    let metrics = Arc::new(ExtenderMetrics::new(cache.clone()));
    let binder = Arc::new(Binder {
        client,
        cache,
        policy: config.policy,
        assume_timeout: config.assume_timeout,
    });
    let scrapes = metrics_listener.map(|metrics_listener| {
        let metrics_addr = address(&metrics_listener);
        info!(metrics_addr, "serving /metrics");
        let served = axum::serve(metrics_listener, self::metrics::router(metrics.clone()))
            .with_graceful_shutdown(shutdown.clone().cancelled_owned());
        let failed = shutdown.clone();
        tokio::spawn(async move {
            let served = served.await;
            // Without its metrics the extender would go unwatched: stop.
            failed.cancel();
            served.map_err(|source| ExtenderError::Metrics {
                addr: metrics_addr,
                source,
            })
        })
    });
    info!(
        addr,
        resource = %config.resource_name,
        placement = %config.policy,
        assume_timeout = ?config.assume_timeout,
        "serving /filter, /prioritize, /bind and /healthz"
    );
    let served = server::serve(listener, server::router(binder, metrics), shutdown.clone()).await;
    shutdown.cancel();
    for watch in watches {
        let _ = watch.await;
    }
    served.map_err(|source| ExtenderError::Serve { addr, source })?;
    match scrapes {
        Some(scrapes) => scrapes.await.unwrap_or(Ok(())),
        None => Ok(()),
    }
}
