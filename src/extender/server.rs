//! The extender's HTTP side: kube-scheduler's verbs (`POST /filter`,
//! `/prioritize`, `/bind`) and `GET /healthz`, translating JSON to the
//! cache, the fit functions and the binder.
//!
//! Filter and bind answer problems inside an HTTP 200 (`Error`), which is
//! where kube-scheduler reads them; any other status reaches its log only
//! as "failed … code N". Prioritize has no `Error`: its failures are HTTP
//! errors, which kube-scheduler ignores (it scores without us).

use crate::error_text::one_line;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use tracing::{debug, warn};

use crate::extender::api::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
};
use crate::extender::bind::Binder;
use crate::extender::cache::Cache;
use crate::extender::fit;
use crate::extender::watch::lock;

/// A filter for a scheduler that is not `nodeCacheCapable` carries every
/// candidate Node whole: thousands of them run to tens of MB.
const BODY_LIMIT: usize = 128 << 20;

const NOT_SYNCED: &str = "the gpumem extender has not listed pods and nodes yet (is the API \
                          server reachable?); the scheduler will retry";

pub fn router(binder: Arc<Binder>) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/healthz", get(healthz))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(binder)
}

type Verbs = State<Arc<Binder>>;

/// Drops the bookings whose time is up; called by every verb, so what a
/// verb sees is current.
fn expire(cache: &mut Cache) {
    for expired in cache.expire(Instant::now()) {
        warn!(%expired, "a bind never showed in the pod watch; its booking expired");
    }
}

fn pod_name(args: &ExtenderArgs) -> String {
    args.pod.as_ref().map_or_else(String::new, |p| {
        format!(
            "{}/{}",
            p.metadata.namespace.as_deref().unwrap_or(""),
            p.metadata.name.as_deref().unwrap_or("")
        )
    })
}

async fn filter(State(binder): Verbs, body: Bytes) -> Json<ExtenderFilterResult> {
    let failed = |error: String| {
        warn!(%error, "filter");
        Json(ExtenderFilterResult {
            error,
            ..ExtenderFilterResult::default()
        })
    };
    let args: ExtenderArgs = match serde_json::from_slice(&body) {
        Ok(args) => args,
        Err(err) => return failed(format!("cannot decode the filter request: {err}")),
    };
    let pod = pod_name(&args);
    let result = {
        let mut cache = lock(&binder.cache);
        if !cache.synced() {
            return failed(NOT_SYNCED.to_owned());
        }
        expire(&mut cache);
        fit::filter(&cache, args)
    };
    debug!(
        pod,
        passed = result.node_names.as_ref().map_or_else(
            || result.nodes.as_ref().map_or(0, |l| l.items.len()),
            Vec::len
        ),
        failed = result.failed_nodes.len() + result.failed_and_unresolvable_nodes.len(),
        "filter"
    );
    Json(result)
}

async fn prioritize(State(binder): Verbs, body: Bytes) -> Response {
    let args: ExtenderArgs = match serde_json::from_slice(&body) {
        Ok(args) => args,
        Err(err) => {
            let message = format!("cannot decode the prioritize request: {err}");
            warn!(%message, "prioritize");
            return (StatusCode::BAD_REQUEST, message).into_response();
        }
    };
    let scores = {
        let mut cache = lock(&binder.cache);
        if !cache.synced() {
            return (StatusCode::SERVICE_UNAVAILABLE, NOT_SYNCED).into_response();
        }
        expire(&mut cache);
        fit::prioritize(&cache, &args, binder.policy)
    };
    debug!(pod = pod_name(&args), ?scores, "prioritize");
    Json(scores).into_response()
}

async fn bind(State(binder): Verbs, body: Bytes) -> Json<ExtenderBindingResult> {
    let args: ExtenderBindingArgs = match serde_json::from_slice(&body) {
        Ok(args) => args,
        Err(err) => {
            let error = format!("cannot decode the bind request: {err}");
            warn!(%error, "bind");
            return Json(ExtenderBindingResult { error });
        }
    };
    match binder.bind(&args).await {
        Ok(_) => Json(ExtenderBindingResult::default()),
        Err(err) => {
            let error = one_line(&err);
            warn!(%error, "bind failed");
            Json(ExtenderBindingResult { error })
        }
    }
}

/// 200 while the books are listed and current; 503 before the first lists
/// and while a watch keeps failing (the readiness probe takes the extender
/// out of its Service: the verbs would answer from a stale view).
async fn healthz(State(binder): Verbs) -> Response {
    let cache = lock(&binder.cache);
    let problem = if cache.synced() {
        cache.stale(Instant::now())
    } else {
        Some(NOT_SYNCED.to_owned())
    };
    drop(cache);
    match problem {
        None => (StatusCode::OK, "ok\n").into_response(),
        Some(problem) => (StatusCode::SERVICE_UNAVAILABLE, format!("{problem}\n")).into_response(),
    }
}
