//! The metrics endpoint on the network: `/metrics` in the format the
//! scraper accepts, and `/healthz`, live while registered with kubelet.

use crate::error_text::chain;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;
use tracing::error;

use super::encode::{Metrics, Reading};
use crate::cluster::client::ApiHealth;
use crate::ops::observed::Observed;

#[derive(Clone)]
struct Endpoint {
    observed: Observed,
    metrics: Arc<Metrics>,
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
    let metrics = Arc::new(Metrics::new(&observed.counters, observed.arena_series));
    Router::new()
        .route("/metrics", get(scrape))
        .route("/healthz", get(healthz))
        .with_state(Endpoint { observed, metrics })
}

/// Serves the endpoints until `shutdown`, logging a failure.
pub async fn serve_logged(
    listener: tokio::net::TcpListener,
    observed: Observed,
    shutdown: CancellationToken,
) {
    if let Err(err) = serve(listener, observed, shutdown).await {
        error!(err = %chain(&err), "metrics endpoint failed");
    }
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

/// Live while registered with kubelet. An API server that cannot be
/// reached is said, but does not fail the probe: a restart would not bring
/// it back, and kubelet would restart every node's gpumem at once.
async fn healthz(State(endpoint): State<Endpoint>) -> impl IntoResponse {
    let (code, mut text) = if endpoint.observed.front_end.registered() {
        (StatusCode::OK, "ok\n".to_owned())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not registered with kubelet\n".to_owned(),
        )
    };
    if let Some(why) = endpoint
        .observed
        .api
        .as_ref()
        .and_then(ApiHealth::unreachable)
    {
        text.push_str(&why);
        text.push('\n');
    }
    (code, text)
}
/// OpenMetrics for a scraper that accepts it (Prometheus asks for it
/// first); else Prometheus' classic text format (`text/plain;
/// version=0.0.4`), which scrapers that predate OpenMetrics ask for.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const CLASSIC_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn scrape(State(endpoint): State<Endpoint>, headers: HeaderMap) -> Response {
    let holdings = endpoint.observed.pod_resources.holdings().await;
    // The accounting files are read, and the text encoded, off the async workers.
    let body = tokio::task::spawn_blocking(move || {
        let reading = Reading::read(&endpoint.observed, holdings);
        endpoint.metrics.encode(reading)
    })
    .await;
    match body {
        Ok(body) => exposition(&headers, body),
        Err(err) => {
            error!(err = %chain(&err), "cannot read the node for metrics");
            failed()
        }
    }
}

fn failed() -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        [(header::CONTENT_TYPE, "text/plain")],
    )
        .into_response()
}

/// A scrape's answer: `openmetrics` (as encoded) in the format the
/// scraper's `Accept` asks for.
pub fn exposition(headers: &HeaderMap, openmetrics: Result<String, std::fmt::Error>) -> Response {
    match openmetrics {
        Ok(body) if accepts_openmetrics(headers) => {
            (StatusCode::OK, [(header::CONTENT_TYPE, OPENMETRICS)], body).into_response()
        }
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, CLASSIC_TEXT)],
            classic_text(&body),
        )
            .into_response(),
        Err(std::fmt::Error) => failed(),
    }
}

/// Whether the scraper takes OpenMetrics: it sent no Accept header (curl,
/// a browser: what gpumem always answered), or one listing OpenMetrics or
/// any type (`*/*`, `application/*`) without refusing it (`q=0`). One that
/// lists only `text/plain` gets the classic format.
fn accepts_openmetrics(headers: &HeaderMap) -> bool {
    let mut accepted = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter(|media| !media.trim().is_empty())
        .peekable();
    if accepted.peek().is_none() {
        return true;
    }
    accepted.any(|media| {
        let mut parts = media.split(';').map(str::trim);
        let kind = parts.next().unwrap_or_default().to_ascii_lowercase();
        matches!(
            kind.as_str(),
            "application/openmetrics-text" | "application/*" | "*/*"
        ) && !parts.any(|p| {
            p.strip_prefix("q=")
                .and_then(|q| q.parse::<f32>().ok())
                .is_some_and(|q| q <= 0.0)
        })
    })
}

/// OpenMetrics text as Prometheus' classic text format (0.0.4): the same
/// samples; a counter's and an info's metadata under their samples' names
/// (`_total`, `_info`, the latter a gauge), no `# UNIT`, no `# EOF`.
fn classic_text(openmetrics: &str) -> String {
    let kinds: HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' '))
        .collect();
    let renamed = |name: &str| match kinds.get(name).copied() {
        Some("counter") => format!("{name}_total"),
        Some("info") => format!("{name}_info"),
        _ => name.to_owned(),
    };
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some((name, kind)) = line.strip_prefix("# TYPE ").and_then(|r| r.split_once(' ')) {
            let kind = match kind {
                "info" => "gauge",
                "unknown" => "untyped",
                kind => kind,
            };
            out.push_str(&format!("# TYPE {} {kind}\n", renamed(name)));
        } else if let Some((name, help)) =
            line.strip_prefix("# HELP ").and_then(|r| r.split_once(' '))
        {
            out.push_str(&format!("# HELP {} {help}\n", renamed(name)));
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_scraper_that_lists_only_text_plain_gets_the_classic_format() {
        let accept = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for v in values {
                headers.append(header::ACCEPT, v.parse().unwrap());
            }
            accepts_openmetrics(&headers)
        };
        assert!(accept(&[]));
        assert!(accept(&["*/*"]));
        assert!(accept(&[
            "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
        ]));
        assert!(!accept(&["text/plain;version=0.0.4"]));
        assert!(!accept(&["text/plain", "application/openmetrics-text;q=0"]));
    }

    #[test]
    fn the_classic_format_names_counters_and_infos_by_their_samples() {
        let openmetrics = "# HELP gpumem_kills Kills.\n# TYPE gpumem_kills counter\n\
                           gpumem_kills_total 3\n# HELP gpumem_build The build.\n\
                           # TYPE gpumem_build info\ngpumem_build_info{version=\"0.1.0\"} 1\n\
                           # HELP gpumem_up Up.\n# TYPE gpumem_up gauge\n# UNIT gpumem_up x\n\
                           gpumem_up 1\n# EOF\n";
        assert_eq!(
            classic_text(openmetrics),
            "# HELP gpumem_kills_total Kills.\n# TYPE gpumem_kills_total counter\n\
             gpumem_kills_total 3\n# HELP gpumem_build_info The build.\n\
             # TYPE gpumem_build_info gauge\ngpumem_build_info{version=\"0.1.0\"} 1\n\
             # HELP gpumem_up Up.\n# TYPE gpumem_up gauge\ngpumem_up 1\n"
        );
    }

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
