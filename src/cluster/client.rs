//! A client for the API server: a kubeconfig where one is named, else the
//! pod's service account (in-cluster), else the usual kubeconfig lookup.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

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
    #[error("cannot read the kubeconfig {path} (--kubeconfig): {source}")]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error(
        "no API server configuration: not in a pod with a service account, and no kubeconfig \
         (set --kubeconfig or KUBECONFIG): {0}"
    )]
    Infer(#[from] kube::config::InferConfigError),
    #[error("cannot build an API client: {0}")]
    Build(#[from] kube::Error),
}

/// Connects lazily: the first request reaches the server.
pub async fn connect(kubeconfig: Option<&Path>) -> Result<Client, ClientError> {
    let mut config = match kubeconfig {
        Some(path) => {
            let bad = |source| ClientError::Kubeconfig {
                path: path.to_owned(),
                source,
            };
            let file = Kubeconfig::read_from(path).map_err(bad)?;
            Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                .await
                .map_err(bad)?
        }
        None => Config::infer().await?,
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    Ok(Client::try_from(config)?)
}
