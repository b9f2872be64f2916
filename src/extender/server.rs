//! The extender's HTTP side: kube-scheduler's verbs (`POST /filter`,
//! `/prioritize`, `/bind`) and `GET /healthz`, translating JSON to the
//! cache, the fit functions and the binder.
//!
//! Filter and bind answer problems inside an HTTP 200 (`Error`), which is
//! where kube-scheduler reads them; any other status reaches its log only
//! as "failed … code N". Prioritize has no `Error`: its failures are HTTP
//! errors, which kube-scheduler ignores (it scores without us).

use crate::error_text::one_line;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::extender::api::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult,
};
use crate::extender::bind::Binder;
use crate::extender::cache::Cache;
use crate::extender::fit;
use crate::extender::metrics::{ExtenderMetrics, Verb};
use crate::extender::watch::lock;

/// The largest request read. Sized for the largest cluster Kubernetes
/// supports, 5000 nodes, with `nodeCacheCapable: true` (what
/// daemonset/kube-scheduler-config.yaml sets): every node name at its
/// longest (253 bytes and JSON's quotes and comma: 1.3 MB) and a Pod at the
/// API server's largest (etcd takes 1.5 MiB; its JSON a little more) come
/// to under 4 MiB. Whole Nodes (without `nodeCacheCapable`) fit for about
/// 2000 nodes shaped like tests/fixtures/extender, or 400 with 50 images
/// each. Read whole before decoding, so one request holds at most this.
const BODY_LIMIT: usize = 8 << 20;

/// kube-scheduler writes a request's headers at once: a connection that
/// has not sent them in this long (or is idle this long between requests)
/// is closed, so half-sent requests cannot pile up.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// A body that has not arrived whole in this long is refused (408).
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections served at once. kube-scheduler opens a few (its binds run
/// in parallel); past this, further ones wait in the listen backlog.
const MAX_CONNECTIONS: usize = 1024;

const NOT_SYNCED: &str = "the gpumem extender has not listed pods and nodes yet (is the API \
                          server reachable?); the scheduler will retry";

pub fn router(binder: Arc<Binder>, metrics: Arc<ExtenderMetrics>) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/bind", post(bind))
        .route("/healthz", get(healthz))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(Served { binder, metrics })
}

#[derive(Clone)]
struct Served {
    binder: Arc<Binder>,
    metrics: Arc<ExtenderMetrics>,
}

type Verbs = State<Served>;

/// A verb's answer, and whether it carries an Error in its 200.
struct Answer {
    response: Response,
    error: bool,
}

impl Answer {
    fn of(response: impl IntoResponse) -> Answer {
        Answer {
            response: response.into_response(),
            error: false,
        }
    }

    fn error(response: impl IntoResponse) -> Answer {
        Answer {
            response: response.into_response(),
            error: true,
        }
    }
}

impl Served {
    /// Answers `verb`, counting the answer and the time it took.
    async fn counted(
        &self,
        verb: Verb,
        answer: impl std::future::Future<Output = Answer>,
    ) -> Response {
        let started = Instant::now();
        let Answer { response, error } = answer.await;
        self.metrics
            .request(verb, response.status(), error, started.elapsed());
        response
    }
}

/// Serves `router` on `listener` until `shutdown`, then waits for the
/// requests in flight. Unlike `axum::serve`, it bounds how long a client
/// may take to send its headers and how many connections are open.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let graceful = GracefulShutdown::new();
    let open = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let service = TowerToHyperService::new(router);
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    loop {
        let slot = tokio::select! {
            () = shutdown.cancelled() => break,
            slot = open.clone().acquire_owned() => slot,
        };
        let Ok(slot) = slot else { break };
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) => {
                // Out of descriptors, or a connection reset before it was
                // accepted: the listener itself is fine.
                warn!(err = %err, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let connection = builder.serve_connection(TokioIo::new(stream), service.clone());
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A client that went away or timed out: nothing to tell.
            let _ = connection.await;
            drop(slot);
        });
    }
    graceful.shutdown().await;
    Ok(())
}

/// The request's body, whole; 413 past [`BODY_LIMIT`] (at once where the
/// length is declared), 408 when it does not arrive in [`BODY_TIMEOUT`].
async fn body_of(request: Request) -> Result<Bytes, Response> {
    use axum::body::HttpBody;
    let declared = request.body().size_hint().lower();
    if declared > BODY_LIMIT as u64 {
        return Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("a body of {declared} bytes is past the limit of {BODY_LIMIT}"),
        )
            .into_response());
    }
    match tokio::time::timeout(BODY_TIMEOUT, Bytes::from_request(request, &())).await {
        Ok(read) => read.map_err(IntoResponse::into_response),
        Err(_) => Err((
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {BODY_TIMEOUT:?}"),
        )
            .into_response()),
    }
}

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

async fn filter(State(served): Verbs, request: Request) -> Response {
    served
        .counted(Verb::Filter, filter_answer(&served.binder, request))
        .await
}

async fn filter_answer(binder: &Binder, request: Request) -> Answer {
    let body = match body_of(request).await {
        Ok(body) => body,
        Err(refused) => return Answer::of(refused),
    };
    let failed = |error: String| {
        warn!(%error, "filter");
        Answer::error(Json(ExtenderFilterResult {
            error,
            ..ExtenderFilterResult::default()
        }))
    };
    let args: ExtenderArgs = match serde_json::from_slice(&body) {
        Ok(args) => args,
        Err(err) => return failed(format!("cannot decode the filter request: {err}")),
    };
    // Decoded: the text is not needed beside it.
    drop(body);
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
    Answer::of(Json(result))
}

async fn prioritize(State(served): Verbs, request: Request) -> Response {
    served
        .counted(Verb::Prioritize, prioritize_answer(&served.binder, request))
        .await
}

async fn prioritize_answer(binder: &Binder, request: Request) -> Answer {
    let body = match body_of(request).await {
        Ok(body) => body,
        Err(refused) => return Answer::of(refused),
    };
    let args: ExtenderArgs = match serde_json::from_slice(&body) {
        Ok(args) => args,
        Err(err) => {
            let message = format!("cannot decode the prioritize request: {err}");
            warn!(%message, "prioritize");
            return Answer::of((StatusCode::BAD_REQUEST, message));
        }
    };
    drop(body);
    let scores = {
        let mut cache = lock(&binder.cache);
        if !cache.synced() {
            return Answer::of((StatusCode::SERVICE_UNAVAILABLE, NOT_SYNCED));
        }
        expire(&mut cache);
        fit::prioritize(&cache, &args, binder.policy)
    };
    debug!(pod = pod_name(&args), ?scores, "prioritize");
    Answer::of(Json(scores))
}

async fn bind(State(served): Verbs, request: Request) -> Response {
    served
        .counted(Verb::Bind, bind_answer(&served, request))
        .await
}

async fn bind_answer(served: &Served, request: Request) -> Answer {
    let body = match body_of(request).await {
        Ok(body) => body,
        Err(refused) => return Answer::of(refused),
    };
    let args: ExtenderBindingArgs = match serde_json::from_slice(&body) {
        Ok(args) => args,
        Err(err) => {
            let error = format!("cannot decode the bind request: {err}");
            warn!(%error, "bind");
            served.metrics.bind("bad_request");
            return Answer::error(Json(ExtenderBindingResult { error }));
        }
    };
    drop(body);
    match served.binder.bind(&args).await {
        Ok(_) => {
            served.metrics.bind("ok");
            Answer::of(Json(ExtenderBindingResult::default()))
        }
        Err(err) => {
            let error = one_line(&err);
            warn!(%error, "bind failed");
            served.metrics.bind(err.reason());
            Answer::error(Json(ExtenderBindingResult { error }))
        }
    }
}

/// 200 while the books are listed and current; 503 before the first lists
/// and while a watch keeps failing (the readiness probe takes the extender
/// out of its Service: the verbs would answer from a stale view).
async fn healthz(State(served): Verbs) -> Response {
    let cache = lock(&served.binder.cache);
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
