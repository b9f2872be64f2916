//! Registering with kubelet: the Register call, and the file identities
//! that reveal a kubelet restart.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::deviceplugin::api::deviceplugin::registration_client::RegistrationClient;
use crate::deviceplugin::api::deviceplugin::RegisterRequest;
use crate::kubelet::unix::connect;

/// kubelet's registration socket, inside `--kubelet-dir`.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// How long one Register call may take: kubelet dials us back inside it
/// with a 10 s timeout, then calls GetDevicePluginOptions.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(15);

#[derive(Debug, thiserror::Error)]
pub enum KubeletError {
    #[error("{path} does not exist yet (kubelet not running?)")]
    Missing { path: PathBuf },
    #[error("cannot connect to {path}")]
    Connect {
        path: PathBuf,
        source: tonic::transport::Error,
    },
    #[error("Register at {path} failed: {status}")]
    Register {
        path: PathBuf,
        status: tonic::Status,
    },
    #[error("Register at {path} timed out after {timeout:?}")]
    Timeout { path: PathBuf, timeout: Duration },
}

/// One Register call to the kubelet socket at `path`.
pub async fn register(path: &Path, request: RegisterRequest) -> Result<(), KubeletError> {
    let call = async {
        let channel = connect(path)
            .await
            .map_err(|source| KubeletError::Connect {
                path: path.to_owned(),
                source,
            })?;
        RegistrationClient::new(channel)
            .register(request)
            .await
            .map_err(|status| KubeletError::Register {
                path: path.to_owned(),
                status,
            })
    };
    match tokio::time::timeout(REGISTER_TIMEOUT, call).await {
        Ok(result) => result.map(drop),
        Err(_) => Err(KubeletError::Timeout {
            path: path.to_owned(),
            timeout: REGISTER_TIMEOUT,
        }),
    }
}

/// Identity of a socket file: kubelet's restart unlinks every socket and
/// makes a new `kubelet.sock`, so a changed or vanished inode is the signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketId {
    dev: u64,
    ino: u64,
}

impl SocketId {
    /// The identity of the socket at `path`, if a socket is there now.
    pub fn of(path: &Path) -> Option<SocketId> {
        let meta = std::fs::symlink_metadata(path).ok()?;
        meta.file_type().is_socket().then(|| SocketId {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}
