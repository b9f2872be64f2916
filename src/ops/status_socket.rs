//! Who holds what on the node (`/status`, what `gpumem inspect` reads),
//! served on a unix socket only the plugin's user may open, never on the network.

use crate::error_text::chain;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tracing::error;

use crate::ops::observed::Observed;
use crate::ops::status::NodeStatus;

/// The socket's name in the state dir, where no `--status-socket` is given.
pub const DEFAULT_NAME: &str = "status.sock";

/// Owner only: connecting to a unix socket needs write permission on it,
/// so no user but the plugin's (root in the DaemonSet) can ask.
const MODE: u32 = 0o600;

#[derive(Debug, thiserror::Error)]
pub enum StatusSocketError {
    #[error("--status-socket {}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "--status-socket {} exists and is not a socket: left alone (name another path, or \
         remove it)",
        path.display()
    )]
    NotASocket { path: PathBuf },
}

/// The socket for `--status-socket`, given as `flag` (`None`: the flag
/// was not given; an empty value turns the socket off).
pub fn path(flag: Option<&std::ffi::OsStr>, state_dir: &Path) -> Option<PathBuf> {
    match flag {
        None => Some(state_dir.join(DEFAULT_NAME)),
        Some(path) if path.is_empty() => None,
        Some(path) => Some(PathBuf::from(path)),
    }
}

/// Binds `path` with mode 0600, replacing a stale socket there: bound under
/// a temporary name, narrowed, then renamed into place, so it is never
/// reachable with wider permissions.
pub fn bind(path: &Path) -> Result<UnixListener, StatusSocketError> {
    let io = |source| StatusSocketError::Io {
        path: path.to_owned(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.file_type().is_socket() => {
            return Err(StatusSocketError::NotASocket {
                path: path.to_owned(),
            })
        }
        Ok(_) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(io(err)),
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let temporary = path.with_file_name(format!(".{name}.{}", std::process::id()));
    match std::fs::remove_file(&temporary) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(io(err)),
        _ => {}
    }
    let listener = UnixListener::bind(&temporary).map_err(io)?;
    let placed = std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(MODE))
        .and_then(|()| std::fs::rename(&temporary, path));
    if let Err(err) = placed {
        let _ = std::fs::remove_file(&temporary);
        return Err(io(err));
    }
    Ok(listener)
}

pub fn router(observed: Observed) -> Router {
    Router::new()
        .route("/status", get(status))
        .with_state(observed)
}

/// `/status`: who holds what, with their pods' names, for this socket,
/// never the network port.
async fn status(State(observed): State<Observed>) -> Result<Json<NodeStatus>, StatusCode> {
    match observed.status().await {
        Ok(status) => Ok(Json(status)),
        Err(err) => {
            error!(err = %chain(&err), "cannot read the node status");
            Err(StatusCode::INTERNAL_SERVER_ERROR)
        }
    }
}

/// Serves `/status` on `listener` (bound at `path`) until `shutdown`, then
/// removes the socket; logs a failure.
pub async fn serve_logged(
    listener: UnixListener,
    path: PathBuf,
    observed: Observed,
    shutdown: CancellationToken,
) {
    let served = axum::serve(listener, router(observed))
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await;
    if let Err(err) = served {
        error!(err = %chain(&err), socket = %path.display(), "the status socket failed");
    }
    let _ = std::fs::remove_file(&path);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_names_the_socket_or_turns_it_off() {
        let state = Path::new("/var/lib/gpumem");
        assert_eq!(
            path(None, state),
            Some(PathBuf::from("/var/lib/gpumem/status.sock"))
        );
        assert_eq!(path(Some("".as_ref()), state), None);
        assert_eq!(
            path(Some("/run/s.sock".as_ref()), state),
            Some(PathBuf::from("/run/s.sock"))
        );
    }

    #[tokio::test]
    async fn the_socket_is_owner_only_and_replaces_a_stale_one_but_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("run/status.sock");
        drop(bind(&socket).unwrap());
        // Stale now (nobody listens): replaced.
        let _listener = bind(&socket).unwrap();
        let meta = std::fs::symlink_metadata(&socket).unwrap();
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::read_dir(dir.path().join("run")).unwrap().count(),
            1
        );

        let file = dir.path().join("file");
        std::fs::write(&file, "keep").unwrap();
        let err = bind(&file).unwrap_err();
        assert!(matches!(err, StatusSocketError::NotASocket { .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    }
}
