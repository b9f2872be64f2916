//! A client for the API server: a kubeconfig where one is named, else the
//! pod's service account (in-cluster), else the usual kubeconfig lookup.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kube::client::ClientBuilder;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tower::util::MapResultLayer;
use tracing::{info, warn};

use crate::error_text::one_line;
use crate::sync::LockExt;

/// Each request's own bound (a watch is re-opened by the watcher before
/// this; kube's default of 295 s is for watches).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one API call on kubelet's admission path may take before the
/// plugin answers kubelet without it: kubelet sets no deadline of its own
/// on GetPreferredAllocation and Allocate, so an unbounded wait would stall
/// every pod admission on the node.
pub const ADMISSION_CALL_BOUND: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `via`: how it was named (`--kubeconfig`, `KUBECONFIG`,
    /// `~/.kube/config`).
    #[error("cannot read the kubeconfig {} ({via})", path.display())]
    Kubeconfig {
        path: PathBuf,
        via: &'static str,
        source: kube::config::KubeconfigError,
    },
    #[error(
        "no API server configuration: not in a pod with a service account, and no kubeconfig \
         (set --kubeconfig or KUBECONFIG)"
    )]
    Infer(#[from] kube::config::InferConfigError),
    #[error("cannot build an API client")]
    Build(#[from] kube::Error),
}

/// Connects lazily: the first request reaches the server.
pub async fn connect(kubeconfig: Option<&Path>) -> Result<Client, ClientError> {
    Ok(connect_watched(kubeconfig).await?.0)
}

/// [`connect`], with what the process hears from the server: every
/// request's outcome is seen in one place, a layer on the client.
pub async fn connect_watched(
    kubeconfig: Option<&Path>,
) -> Result<(Client, ApiHealth), ClientError> {
    let mut config = match kubeconfig {
        Some(path) => load(path).await.map_err(|source| ClientError::Kubeconfig {
            path: path.to_owned(),
            via: "--kubeconfig",
            source,
        })?,
        None => match Config::infer().await {
            Ok(config) => config,
            // A kubeconfig that is there but does not load is the likelier
            // cause than the missing in-cluster environment: name it.
            Err(err) => match inferred_kubeconfig() {
                Some((path, via)) => match load(&path).await {
                    Err(source) => return Err(ClientError::Kubeconfig { path, via, source }),
                    Ok(_) => return Err(err.into()),
                },
                None => return Err(err.into()),
            },
        },
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    let health = ApiHealth::new(config.cluster_url.to_string());
    let observer = health.clone();
    let layer = MapResultLayer::new(move |result: Result<_, tower::BoxError>| {
        match &result {
            Ok(_) => observer.answered(),
            Err(err) => observer.failed(err.as_ref()),
        }
        result
    });
    let client = ClientBuilder::try_from(config)?.with_layer(&layer).build();
    Ok((client, health))
}

async fn load(path: &Path) -> Result<Config, kube::config::KubeconfigError> {
    let file = Kubeconfig::read_from(path)?;
    Config::from_custom_kubeconfig(file, &KubeConfigOptions::default()).await
}

/// The kubeconfig file `Config::infer` reads, where one exists, and how it
/// was found: the first of KUBECONFIG's paths, else ~/.kube/config.
fn inferred_kubeconfig() -> Option<(PathBuf, &'static str)> {
    match std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
        Some(paths) => std::env::split_paths(&paths)
            .find(|p| p.exists())
            .map(|p| (p, "KUBECONFIG")),
        None => std::env::var_os("HOME")
            .map(|home| PathBuf::from(home).join(".kube/config"))
            .filter(|p| p.exists())
            .map(|p| (p, "~/.kube/config")),
    }
}

/// Whether the API server answers, as this process last found: any HTTP
/// answer counts (a 403 or a 500 is the server speaking), a failure to
/// connect or to get an answer does not. The first failure after an answer
/// is logged once, naming the server and the cause, and the first answer
/// after failures; each caller retries with its own backoff meanwhile.
#[derive(Clone, Debug)]
pub struct ApiHealth {
    server: Arc<str>,
    failing: Arc<Mutex<Option<Failing>>>,
}

#[derive(Debug)]
struct Failing {
    since: Instant,
    cause: String,
}

impl ApiHealth {
    fn new(server: String) -> ApiHealth {
        ApiHealth {
            server: server.trim_end_matches('/').into(),
            failing: Arc::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, Option<Failing>> {
        self.failing.lock_unpoisoned()
    }

    fn answered(&self) {
        if let Some(failing) = self.state().take() {
            info!(
                server = %self.server,
                after_secs = failing.since.elapsed().as_secs(),
                "the API server answers again"
            );
        }
    }

    fn failed(&self, err: &(dyn std::error::Error + 'static)) {
        let cause = one_line(err);
        let mut state = self.state();
        match &mut *state {
            Some(failing) => failing.cause = cause,
            None => {
                warn!(
                    server = %self.server,
                    %cause,
                    "cannot reach the API server; what needs it is retried with backoff"
                );
                *state = Some(Failing {
                    since: Instant::now(),
                    cause,
                });
            }
        }
    }

    /// The server's URL.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// Why the server cannot be reached, and for how long; `None` while it
    /// answers (or before anything asked it).
    pub fn unreachable(&self) -> Option<String> {
        self.state().as_ref().map(|f| {
            format!(
                "cannot reach the API server at {} for {} s: {}",
                self.server,
                f.since.elapsed().as_secs(),
                f.cause
            )
        })
    }
}

/// What kube says when an error answer is not a Kubernetes `Status`.
const NOT_A_STATUS: &str = "Failed to parse error data";

/// A failed call to the API server in one line, for logs and messages.
/// kube prints an answer that is not a Kubernetes `Status` (a proxy's, or
/// another web server's) as `ApiError: <its body>: Failed to parse error
/// data`, whole pages of HTML included.
pub fn describe(err: &kube::Error) -> String {
    match err {
        kube::Error::Api(status) if status.reason == NOT_A_STATUS => {
            let body = status.message.lines().next().unwrap_or("").trim();
            let body: String = body.chars().take(120).collect();
            format!(
                "HTTP {} without a Kubernetes Status (is the kubeconfig's server a Kubernetes \
                 API server, its address with no path?){}",
                status.code,
                if body.is_empty() {
                    String::new()
                } else {
                    format!("; the answer began {body:?}")
                }
            )
        }
        kube::Error::Api(status) => {
            format!("{} {}: {}", status.code, status.reason, status.message)
        }
        other => one_line(other),
    }
}

/// [`describe`] for a watcher's error, saying which step failed.
pub fn describe_watch(err: &kube::runtime::watcher::Error) -> String {
    use kube::runtime::watcher::Error;
    match err {
        Error::InitialListFailed(err) => format!("listing: {}", describe(err)),
        Error::WatchStartFailed(err) => format!("starting the watch: {}", describe(err)),
        Error::WatchFailed(err) => format!("watching: {}", describe(err)),
        Error::WatchError(status) => format!(
            "watching: {} {}: {}",
            status.code, status.reason, status.message
        ),
        other => one_line(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;

    #[test]
    fn an_answer_that_is_no_status_is_described_in_one_short_line() {
        let html = "<!DOCTYPE HTML>\n<html><body><p>Error code: 404</p>".repeat(20);
        let err = kube::Error::Api(Status::failure(&html, NOT_A_STATUS).with_code(404).boxed());
        let text = describe(&err);
        assert!(
            text.starts_with("HTTP 404 without a Kubernetes Status")
                && text.ends_with(r#"the answer began "<!DOCTYPE HTML>""#),
            "{text}"
        );
        let empty = kube::Error::Api(Status::failure("", NOT_A_STATUS).with_code(404).boxed());
        assert!(describe(&empty).ends_with("its address with no path?)"));
        let forbidden = kube::Error::Api(
            Status::failure("pods is forbidden", "Forbidden")
                .with_code(403)
                .boxed(),
        );
        assert_eq!(describe(&forbidden), "403 Forbidden: pods is forbidden");
    }
}
