//! The extender's metrics: each verb's requests by outcome and how long
//! they took, each bind's result, and what the books hold at each scrape.
//! Served on `--metrics-addr`, apart from the verbs' listener, which may be
//! loopback only (the second scheduler's pod).

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::extender::watch::{lock, SharedCache};
use crate::ops::metrics::{exposition, family, register_build, Labels};

/// kube-scheduler's verbs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Filter,
    Prioritize,
    Bind,
}

impl Verb {
    fn as_str(self) -> &'static str {
        match self {
            Verb::Filter => "filter",
            Verb::Prioritize => "prioritize",
            Verb::Bind => "bind",
        }
    }
}

/// Seconds: a verb answers from memory in well under a millisecond; a bind
/// waits for the API server; kube-scheduler gives up at its `httpTimeout`
/// (5 s in the shipped configurations).
const DURATION_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

type Durations = Family<Labels, Histogram, fn() -> Histogram>;

/// The extender's registry: counted as the verbs run, the books read at
/// each scrape.
pub struct ExtenderMetrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    durations: Durations,
    binds: Family<Labels, Counter>,
}

impl ExtenderMetrics {
    pub fn new(cache: SharedCache) -> ExtenderMetrics {
        let mut registry = Registry::with_prefix("gpumem");
        let requests = Family::<Labels, Counter>::default();
        registry.register(
            "extender_requests",
            "Requests from kube-scheduler by verb, HTTP status and outcome: ok, error (an Error \
             in a 200 answer, which kube-scheduler reads) or refused (an HTTP error: a body too \
             large, too slow or undecodable, or the books not listed yet)",
            requests.clone(),
        );
        let durations: Durations =
            Family::new_with_constructor(|| Histogram::new(DURATION_BUCKETS.iter().copied()));
        registry.register(
            "extender_request_duration_seconds",
            "How long the extender took to answer each verb, from the request's start to its \
             answer",
            durations.clone(),
        );
        let binds = Family::<Labels, Counter>::default();
        registry.register(
            "extender_binds",
            "Binds by result: ok, or why the pod was not bound (not_synced, bad_request, \
             pod_unreadable, other_pod, already_bound, no_fit, api_refused, unanswered)",
            binds.clone(),
        );
        register_build(&mut registry);
        registry.register_collector(Box::new(Books(cache)));
        ExtenderMetrics {
            registry,
            requests,
            durations,
            binds,
        }
    }

    /// One request of `verb`, answered `code` after `took`; `error`: the
    /// 200 answer carries an Error.
    pub fn request(&self, verb: Verb, code: StatusCode, error: bool, took: Duration) {
        let outcome = match (code == StatusCode::OK, error) {
            (true, false) => "ok",
            (true, true) => "error",
            (false, _) => "refused",
        };
        self.requests
            .get_or_create(&vec![
                ("verb", verb.as_str().to_owned()),
                ("code", code.as_u16().to_string()),
                ("outcome", outcome.to_owned()),
            ])
            .inc();
        self.durations
            .get_or_create(&vec![("verb", verb.as_str().to_owned())])
            .observe(took.as_secs_f64());
    }

    /// A bind's result: `ok`, or the reason it failed.
    pub fn bind(&self, result: &'static str) {
        self.binds
            .get_or_create(&vec![("result", result.to_owned())])
            .inc();
    }

    fn encode(&self) -> Result<String, fmt::Error> {
        let mut body = String::new();
        encode(&mut body, &self.registry).map(|()| body)
    }
}

/// The books, read at each scrape.
struct Books(SharedCache);

impl fmt::Debug for Books {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Books")
    }
}

impl Collector for Books {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        let (synced, stale, census) = {
            let cache = lock(&self.0);
            (
                cache.synced(),
                cache.stale(Instant::now()).is_some(),
                cache.census(),
            )
        };
        let e = &mut encoder;
        gauge(
            e,
            "extender_synced",
            "1 once the extender has listed pods and nodes; before, every verb is refused",
            usize::from(synced),
        )?;
        gauge(
            e,
            "extender_stale",
            "1 while a watch keeps failing: the view of GPU usage may be stale (and /healthz \
             fails)",
            usize::from(stale),
        )?;
        let nodes = |state: &str, count: usize| {
            (
                vec![("state", state.to_owned())],
                ConstGauge::new(i64::try_from(count).unwrap_or(i64::MAX)),
            )
        };
        family(
            e,
            "extender_nodes",
            "Nodes the extender knows by their published GPUs: published (GPU nodes it places \
             on), unpublished (no gpumem plugin has published GPUs) or invalid (unreadable)",
            [
                nodes("published", census.gpu_nodes),
                nodes("unpublished", census.unpublished_nodes),
                nodes("invalid", census.invalid_nodes),
            ],
        )?;
        let gpus = |healthy: bool, count: usize| {
            (
                vec![("healthy", healthy.to_string())],
                ConstGauge::new(i64::try_from(count).unwrap_or(i64::MAX)),
            )
        };
        family(
            e,
            "extender_gpus",
            "GPUs the nodes have published, by health (an unhealthy one is never chosen)",
            [
                gpus(true, census.healthy_gpus),
                gpus(false, census.unhealthy_gpus),
            ],
        )?;
        gauge(
            e,
            "extender_bookings",
            "Binds whose units stay booked until the pod watch shows the pod bound",
            census.bookings,
        )
    }
}

/// A gauge without labels.
fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: usize) -> fmt::Result {
    let help = format!("{help}.");
    let metric = encoder.encode_descriptor(name, &help, None, MetricType::Gauge)?;
    ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(metric)
}

pub fn router(metrics: Arc<ExtenderMetrics>) -> Router {
    Router::new()
        .route("/metrics", get(scrape))
        .with_state(metrics)
}

async fn scrape(State(metrics): State<Arc<ExtenderMetrics>>, headers: HeaderMap) -> Response {
    exposition(&headers, metrics.encode())
}
