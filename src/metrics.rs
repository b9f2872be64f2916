//! The plugin's HTTP endpoint: Prometheus metrics, a liveness probe that
//! fails while the plugin is not registered, and the node status as JSON
//! (what `gpumem inspect` reads).

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::inject::Isolation;
use crate::inventory::Inventory;
use crate::plugin::PluginStatus;
use crate::podresources::PodResources;
use crate::reconcile::Overheads;
use crate::service::Counters;
use crate::status::NodeStatus;

/// Everything the endpoints report on.
#[derive(Clone)]
pub struct Observed {
    pub resource: String,
    pub inventory: watch::Receiver<Arc<Inventory>>,
    pub plugin: watch::Receiver<PluginStatus>,
    pub counters: Arc<Counters>,
    pub pod_resources: PodResources,
    pub isolation: Arc<Isolation>,
    /// Per-GPU process overhead, where untracked usage is reconciled.
    pub overheads: Option<Overheads>,
}

impl Observed {
    pub async fn status(&self) -> NodeStatus {
        let holdings = self.pod_resources.holdings().await;
        let inventory = self.inventory.borrow().clone();
        NodeStatus::build(
            &inventory,
            &self.resource,
            self.plugin.borrow().registered,
            holdings,
            &self.isolation,
        )
    }
}

#[derive(Debug, thiserror::Error)]
#[error("invalid --metrics-addr {0:?}: expected HOST:PORT or :PORT, or empty to turn it off")]
pub struct BadAddress(pub String);

/// Parses `--metrics-addr`: `:9400` listens on every interface; empty is off.
pub fn parse_address(text: &str) -> Result<Option<SocketAddr>, BadAddress> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    let full = match text.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => text.to_owned(),
    };
    full.parse()
        .map(Some)
        .map_err(|_| BadAddress(text.to_owned()))
}

pub fn router(observed: Observed) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/status", get(status))
        .with_state(observed)
}

/// Serves the endpoints on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    observed: Observed,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    axum::serve(listener, router(observed))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

async fn healthz(State(observed): State<Observed>) -> impl IntoResponse {
    if observed.plugin.borrow().registered {
        (StatusCode::OK, "ok\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not registered with kubelet\n",
        )
    }
}

async fn status(State(observed): State<Observed>) -> Json<NodeStatus> {
    Json(observed.status().await)
}

type Labels = Vec<(&'static str, String)>;

async fn metrics(State(observed): State<Observed>) -> impl IntoResponse {
    let status = observed.status().await;
    let mut registry = Registry::with_prefix("gpumem");
    let gauge = |registry: &mut Registry, name: &str, help: &str| {
        let family = Family::<Labels, Gauge>::default();
        registry.register(name, help, family.clone());
        family
    };
    let units = gauge(&mut registry, "gpu_units", "Units the GPU is advertised as");
    let allocated = gauge(
        &mut registry,
        "gpu_allocated_units",
        "Units of the GPU held by containers",
    );
    let memory = gauge(
        &mut registry,
        "gpu_memory_mib",
        "GPU memory as NVML reports it, MiB",
    );
    let healthy = gauge(
        &mut registry,
        "gpu_healthy",
        "1 if the GPU's units are Healthy",
    );
    let overhead = gauge(
        &mut registry,
        "gpu_process_overhead_bytes",
        "Median GPU memory a recent process held beyond what the shim charged it (modules \
         loaded lazily, library workspaces, pool reserves): what reconciliation catches",
    );
    let overheads = observed
        .overheads
        .as_ref()
        .map(|o| o.lock().unwrap_or_else(|e| e.into_inner()).clone())
        .unwrap_or_default();
    for g in &status.gpus {
        let labels = vec![("gpu", g.index.to_string()), ("uuid", g.uuid.clone())];
        if let Some(&bytes) = overheads.get(&g.uuid) {
            overhead
                .get_or_create(&labels)
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        units.get_or_create(&labels).set(i64::from(g.units));
        allocated
            .get_or_create(&labels)
            .set(i64::from(g.allocated_units));
        memory
            .get_or_create(&labels)
            .set(i64::try_from(g.memory_mib).unwrap_or(i64::MAX));
        healthy.get_or_create(&labels).set(i64::from(g.healthy));
    }
    let cap = gauge(
        &mut registry,
        "container_cap_bytes",
        "The container's GPU memory cap",
    );
    let used = gauge(
        &mut registry,
        "container_used_bytes",
        "GPU memory the container's processes hold",
    );
    let untracked = gauge(
        &mut registry,
        "container_untracked_bytes",
        "Part of container_used_bytes held beyond charged allocations (CUDA contexts, libraries)",
    );
    let peak = gauge(
        &mut registry,
        "container_peak_bytes",
        "Highest GPU memory use an allocation of the container reached",
    );
    let refused = gauge(
        &mut registry,
        "container_refused_allocations",
        "Allocations refused for the container's cap (it wanted more than its slice)",
    );
    for c in &status.containers {
        let labels = vec![
            ("namespace", c.namespace.clone()),
            ("pod", c.pod.clone()),
            ("container", c.container.clone()),
            ("gpu", c.gpu.to_string()),
        ];
        let bytes = |mib: u64| i64::try_from(mib << 20).unwrap_or(i64::MAX);
        cap.get_or_create(&labels).set(bytes(c.cap_mib));
        if let Some(u) = c.used_mib {
            used.get_or_create(&labels).set(bytes(u));
        }
        if let Some(u) = c.untracked_mib {
            untracked.get_or_create(&labels).set(bytes(u));
        }
        if let Some(p) = c.peak_mib {
            peak.get_or_create(&labels).set(bytes(p));
        }
        if let Some(n) = c.refused_allocations {
            refused
                .get_or_create(&labels)
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    let counter = |registry: &mut Registry, name: &str, help: &str, value: u64| {
        let c = Counter::<u64>::default();
        c.inc_by(value);
        registry.register(name, help, c);
    };
    counter(
        &mut registry,
        "allocate_calls",
        "Allocate calls from kubelet",
        observed.counters.allocations.load(Relaxed),
    );
    counter(
        &mut registry,
        "allocate_errors",
        "Allocate calls refused",
        observed.counters.allocation_errors.load(Relaxed),
    );
    let registrations = observed.plugin.borrow().registrations;
    counter(
        &mut registry,
        "registrations",
        "Successful Register calls (one per kubelet start)",
        registrations,
    );
    let registered = Gauge::<i64>::default();
    registered.set(i64::from(status.registered));
    registry.register(
        "registered",
        "1 while registered with the running kubelet",
        registered,
    );
    let up = Gauge::<i64>::default();
    up.set(i64::from(status.pod_resources_error.is_none()));
    registry.register(
        "pod_resources_up",
        "1 if kubelet's pod-resources API answered",
        up,
    );

    let mut body = String::new();
    if encode(&mut body, &registry).is_err() {
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            String::new(),
        );
    }
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(parse_address("").unwrap(), None);
        assert_eq!(
            parse_address(":9400").unwrap(),
            Some("0.0.0.0:9400".parse().unwrap())
        );
        assert_eq!(
            parse_address("127.0.0.1:0").unwrap(),
            Some("127.0.0.1:0".parse().unwrap())
        );
        assert!(parse_address("localhost")
            .unwrap_err()
            .to_string()
            .contains("--metrics-addr"));
    }
}
