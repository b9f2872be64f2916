//! kubelet's side of DRA for `gpumem demo` and the tests: registers a DRA
//! driver the way kubelet's plugin watcher does, then prepares claims and
//! watches device health.
//!
//! It follows the real kubelet where a driver can tell the difference
//! (pkg/kubelet/pluginmanager/operationexecutor and pkg/kubelet/cm/dra/plugin):
//! one connection to the registration socket with grpc-go's default
//! `:authority` (the socket path, percent-encoded, indexed by the first
//! request and referred to by the second), GetInfo, the first of the
//! plugin's versions this kubelet knows, NotifyRegistrationStatus on the same
//! connection, refusals told to the plugin before they are returned, and
//! the health stream opened as each release opens it: 1.34 to 1.36 call
//! `v1alpha1.DRAResourceHealth` on every driver, 1.37 only the newest health
//! service the registration lists, and none if it lists none. It is
//! stricter in one place: it dials the DRA endpoint before accepting, where
//! kubelet connects lazily, so a driver that advertises its endpoint before
//! serving it fails here.

use std::collections::BTreeMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use prost::Message;
use tonic::transport::Channel;

use gpumem_kubelet_api::dra::health::v1::NodeWatchResourcesResponse;
pub use gpumem_kubelet_api::dra::health::v1::{DeviceHealth, HealthStatus};
use gpumem_kubelet_api::dra::health::{self, v1alpha1};
use gpumem_kubelet_api::dra::{v1, v1beta1};
pub use gpumem_kubelet_api::dra::{ClaimRef, Prepared, PreparedDevice, Unprepared};
use gpumem_kubelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse, DRA_PLUGIN,
};

use crate::h2c::{grpc_go_authority, Authority, RawGrpc, FIRST_DYNAMIC};
use gpumem_kubelet_api::unix;

/// The services kubelets 1.37 to 1.39 look for in a DRA plugin's
/// registration, newest first in each kind: DRAPlugin, then the optional
/// DRAResourceHealth.
pub const KUBELET_1_37: &[&str] = &[
    v1::SERVICE,
    v1beta1::SERVICE,
    health::v1::SERVICE,
    health::v1alpha1::SERVICE,
];
/// The DRA versions of kubelets 1.34 to 1.36, which list no health service:
/// they call v1alpha1 on every driver.
pub const KUBELET_1_34: &[&str] = &[v1::SERVICE, v1beta1::SERVICE];
/// The DRA versions of kubelets 1.32 and 1.33.
pub const KUBELET_1_33: &[&str] = &[v1beta1::SERVICE];

/// How long one call may take. kubelet allows GetInfo 1 s; the tests share
/// small machines, so this is generous.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How often [`wait_for_socket`] looks (kubelet is told by inotify).
const POLL: Duration = Duration::from_millis(10);

const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";
const NOTIFY: &str = "/pluginregistration.Registration/NotifyRegistrationStatus";

#[derive(Debug, thiserror::Error)]
pub enum FakeKubeletError {
    #[error("registration socket {path} did not appear within {timeout:?}")]
    NoSocket { path: PathBuf, timeout: Duration },
    #[error("cannot connect to {path}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{method} on {path}: {reason}")]
    Call {
        path: PathBuf,
        method: &'static str,
        reason: String,
    },
    /// kubelet refused the plugin, and told it so.
    #[error("kubelet refused the plugin: {0}")]
    Refused(String),
    /// A kubelet that names its health services (1.37 and later) found
    /// none of them among the plugin's, so it never watches its health.
    #[error("the plugin's supported versions {0:?} list no DRAResourceHealth service this kubelet knows: it never calls NodeWatchResources")]
    NoHealthService(Vec<String>),
    #[error("{method} failed: {status}")]
    Status {
        method: &'static str,
        status: tonic::Status,
    },
}

/// The DRA API version a kubelet chose for a plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraVersion {
    V1,
    V1beta1,
}

impl DraVersion {
    /// Its name in `PluginInfo.supported_versions`.
    pub fn service(self) -> &'static str {
        match self {
            DraVersion::V1 => v1::SERVICE,
            DraVersion::V1beta1 => v1beta1::SERVICE,
        }
    }

    fn of(service: &str) -> Option<DraVersion> {
        [DraVersion::V1, DraVersion::V1beta1]
            .into_iter()
            .find(|v| v.service() == service)
    }
}

/// The DRAResourceHealth version a kubelet calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthVersion {
    V1,
    V1alpha1,
}

impl HealthVersion {
    /// Its name in `PluginInfo.supported_versions`.
    pub fn service(self) -> &'static str {
        match self {
            HealthVersion::V1 => health::v1::SERVICE,
            HealthVersion::V1alpha1 => health::v1alpha1::SERVICE,
        }
    }

    /// What a kubelet that knows `known` calls on a plugin that lists
    /// `advertised`. A kubelet that knows no health service by name (before
    /// 1.37) calls v1alpha1 whatever the plugin lists; one that does takes
    /// the first of its own the plugin lists, or calls none.
    fn negotiate(known: &[&str], advertised: &[String]) -> Option<HealthVersion> {
        let versions = [HealthVersion::V1, HealthVersion::V1alpha1];
        let known: Vec<HealthVersion> = versions
            .into_iter()
            .filter(|v| known.contains(&v.service()))
            .collect();
        if known.is_empty() {
            return Some(HealthVersion::V1alpha1);
        }
        known
            .into_iter()
            .find(|v| advertised.iter().any(|a| a == v.service()))
    }
}

enum Client {
    V1(v1::dra_plugin_client::DraPluginClient<Channel>),
    V1beta1(v1beta1::dra_plugin_client::DraPluginClient<Channel>),
}

/// A kubelet that has registered one DRA driver.
pub struct FakeDraKubelet {
    info: PluginInfo,
    version: DraVersion,
    health: Option<HealthVersion>,
    client: Client,
    /// The DRA socket's connection, which kubelet also calls
    /// DRAResourceHealth on.
    channel: Channel,
}

impl FakeDraKubelet {
    /// Registers the plugin at `registration_socket` as a kubelet that knows
    /// `known_versions` (such as [`KUBELET_1_37`]; DRAPlugin versions other
    /// than v1 and v1beta1 count as unknown), health services among them
    /// as [`HealthVersion`] reads them. A plugin it cannot use is told so
    /// through NotifyRegistrationStatus and the refusal returned.
    pub async fn register(
        registration_socket: &Path,
        known_versions: &[&str],
    ) -> Result<FakeDraKubelet, FakeKubeletError> {
        let mut conn = RegistrationConnection::connect(registration_socket).await?;
        let info: PluginInfo = conn.call(GET_INFO, &InfoRequest {}).await?;
        // kubelet's words, so that tests and the demo show what a node shows.
        let accepted = if info.r#type != DRA_PLUGIN {
            Err(format!(
                "RegisterPlugin error -- no handler registered for plugin type: {} at socket {}",
                info.r#type,
                registration_socket.display()
            ))
        } else {
            let chosen = info
                .supported_versions
                .iter()
                .find(|v| known_versions.contains(&v.as_str()))
                .and_then(|v| DraVersion::of(v));
            match chosen {
                Some(version) => connect_endpoint(registration_socket, &info, version).await,
                None => Err(format!(
                    "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA driver plugin {} at endpoint {}: none of services supported by the plugin ({:?}) are supported by the kubelet ({:?})",
                    info.name, info.endpoint, info.supported_versions, known_versions
                )),
            }
        };
        let status = RegistrationStatus {
            plugin_registered: accepted.is_ok(),
            error: accepted.as_ref().err().cloned().unwrap_or_default(),
        };
        let _: RegistrationStatusResponse = conn.call(NOTIFY, &status).await?;
        let (version, client, channel) = accepted.map_err(FakeKubeletError::Refused)?;
        let health = HealthVersion::negotiate(known_versions, &info.supported_versions);
        Ok(FakeDraKubelet {
            info,
            version,
            health,
            client,
            channel,
        })
    }

    /// Asks the plugin at `registration_socket` for its info and refuses it
    /// with `reason`, as kubelet does with a plugin it cannot take.
    pub async fn refuse(
        registration_socket: &Path,
        reason: &str,
    ) -> Result<PluginInfo, FakeKubeletError> {
        let mut conn = RegistrationConnection::connect(registration_socket).await?;
        let info: PluginInfo = conn.call(GET_INFO, &InfoRequest {}).await?;
        let status = RegistrationStatus {
            plugin_registered: false,
            error: reason.to_owned(),
        };
        let _: RegistrationStatusResponse = conn.call(NOTIFY, &status).await?;
        Ok(info)
    }

    /// The version chosen: the first of the plugin's that this kubelet knows.
    pub fn version(&self) -> DraVersion {
        self.version
    }

    /// The health service this kubelet calls, if any.
    pub fn health_version(&self) -> Option<HealthVersion> {
        self.health
    }

    /// What the plugin answered to GetInfo.
    pub fn info(&self) -> &PluginInfo {
        &self.info
    }

    /// NodePrepareResources for `claims`: exactly the entries the plugin
    /// answered, a non-empty `error` as `Err`.
    pub async fn prepare(&self, claims: &[ClaimRef]) -> Result<Prepared, FakeKubeletError> {
        let status = |status| FakeKubeletError::Status {
            method: "NodePrepareResources",
            status,
        };
        // The versions' messages have the same fields but their own types;
        // `share` reads the share ID where the version has one.
        macro_rules! prepare {
            ($version:ident, $client:expr, $share:expr) => {{
                let request = $version::NodePrepareResourcesRequest {
                    claims: claims.iter().map(|c| claim!($version, c)).collect(),
                };
                let response = $client
                    .clone()
                    .node_prepare_resources(request)
                    .await
                    .map_err(status)?;
                let device = |d: $version::Device| PreparedDevice {
                    share_id: $share(&d),
                    request_names: d.request_names,
                    pool_name: d.pool_name,
                    device_name: d.device_name,
                    cdi_device_ids: d.cdi_device_ids,
                };
                response
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|(uid, r)| {
                        let result =
                            failed(r.error).map(|()| r.devices.into_iter().map(device).collect());
                        (uid, result)
                    })
                    .collect()
            }};
        }
        Ok(match &self.client {
            Client::V1(client) => prepare!(v1, client, |d: &v1::Device| d.share_id.clone()),
            Client::V1beta1(client) => prepare!(v1beta1, client, |_: &v1beta1::Device| None),
        })
    }

    /// `DRAResourceHealth/NodeWatchResources` in the version negotiated at
    /// registration, on the DRA socket's connection, as kubelets with
    /// `ResourceHealthStatus` call it (whatever DRAPlugin version they
    /// chose): the stream of the driver's device health, v1alpha1's
    /// messages read as v1's. A kubelet that negotiated none never calls.
    pub async fn watch_resources(&self) -> Result<HealthStream, FakeKubeletError> {
        let status = |status| FakeKubeletError::Status {
            method: "NodeWatchResources",
            status,
        };
        let timed_out = || {
            status(tonic::Status::deadline_exceeded(format!(
                "no answer within {CALL_TIMEOUT:?}"
            )))
        };
        let stream = match self.health {
            None => {
                return Err(FakeKubeletError::NoHealthService(
                    self.info.supported_versions.clone(),
                ))
            }
            Some(HealthVersion::V1) => {
                let mut client =
                    health::v1::dra_resource_health_client::DraResourceHealthClient::new(
                        self.channel.clone(),
                    );
                let call = client.node_watch_resources(health::v1::NodeWatchResourcesRequest {});
                let stream = tokio::time::timeout(CALL_TIMEOUT, call)
                    .await
                    .map_err(|_| timed_out())?
                    .map_err(status)?;
                Messages::V1(stream.into_inner())
            }
            Some(HealthVersion::V1alpha1) => {
                let mut client = v1alpha1::dra_resource_health_client::DraResourceHealthClient::new(
                    self.channel.clone(),
                );
                let call = client.node_watch_resources(v1alpha1::NodeWatchResourcesRequest {});
                let stream = tokio::time::timeout(CALL_TIMEOUT, call)
                    .await
                    .map_err(|_| timed_out())?
                    .map_err(status)?;
                Messages::V1alpha1(stream.into_inner())
            }
        };
        Ok(HealthStream { stream })
    }

    /// NodeUnprepareResources for `claims`: exactly the entries the plugin
    /// answered, a non-empty `error` as `Err`.
    pub async fn unprepare(&self, claims: &[ClaimRef]) -> Result<Unprepared, FakeKubeletError> {
        let status = |status| FakeKubeletError::Status {
            method: "NodeUnprepareResources",
            status,
        };
        macro_rules! unprepare {
            ($version:ident, $client:expr) => {{
                let request = $version::NodeUnprepareResourcesRequest {
                    claims: claims.iter().map(|c| claim!($version, c)).collect(),
                };
                let response = $client
                    .clone()
                    .node_unprepare_resources(request)
                    .await
                    .map_err(status)?;
                response
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|(uid, r)| (uid, failed(r.error)))
                    .collect()
            }};
        }
        Ok(match &self.client {
            Client::V1(client) => unprepare!(v1, client),
            Client::V1beta1(client) => unprepare!(v1beta1, client),
        })
    }
}

/// A driver's NodeWatchResources stream, as kubelet reads it.
pub struct HealthStream {
    stream: Messages,
}

enum Messages {
    V1(tonic::Streaming<NodeWatchResourcesResponse>),
    V1alpha1(tonic::Streaming<v1alpha1::NodeWatchResourcesResponse>),
}

impl Messages {
    async fn message(&mut self) -> Result<Option<NodeWatchResourcesResponse>, tonic::Status> {
        match self {
            Messages::V1(stream) => stream.message().await,
            Messages::V1alpha1(stream) => Ok(stream.message().await?.map(from_v1alpha1)),
        }
    }
}

/// A v1alpha1 message as v1's: the same fields, as kubelet converts it.
fn from_v1alpha1(message: v1alpha1::NodeWatchResourcesResponse) -> NodeWatchResourcesResponse {
    let devices = message.devices.into_iter().map(|d| DeviceHealth {
        health: match d.health() {
            v1alpha1::HealthStatus::Unknown => HealthStatus::Unknown,
            v1alpha1::HealthStatus::Healthy => HealthStatus::Healthy,
            v1alpha1::HealthStatus::Unhealthy => HealthStatus::Unhealthy,
        }
        .into(),
        device: d.device.map(|id| health::v1::DeviceIdentifier {
            pool_name: id.pool_name,
            device_name: id.device_name,
        }),
        last_updated_time: d.last_updated_time,
        health_check_timeout_seconds: d.health_check_timeout_seconds,
        message: d.message,
    });
    NodeWatchResourcesResponse {
        devices: devices.collect(),
    }
}

impl HealthStream {
    /// The next message within `timeout`; `None` when the driver ended the
    /// stream.
    pub async fn next(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<NodeWatchResourcesResponse>, FakeKubeletError> {
        let status = |status| FakeKubeletError::Status {
            method: "NodeWatchResources",
            status,
        };
        tokio::time::timeout(timeout, self.stream.message())
            .await
            .map_err(|_| {
                status(tonic::Status::deadline_exceeded(format!(
                    "no message within {timeout:?}"
                )))
            })?
            .map_err(status)
    }

    /// The next message, as kubelet's health cache keys it: health per
    /// `<pool>/<device>`.
    pub async fn next_health(
        &mut self,
        timeout: Duration,
    ) -> Result<Option<BTreeMap<String, HealthStatus>>, FakeKubeletError> {
        Ok(self.next(timeout).await?.map(|m| health_of(&m)))
    }
}

/// Health per `<pool>/<device>` in one message.
pub fn health_of(message: &NodeWatchResourcesResponse) -> BTreeMap<String, HealthStatus> {
    message
        .devices
        .iter()
        .map(|d| {
            let id = d.device.clone().unwrap_or_default();
            (format!("{}/{}", id.pool_name, id.device_name), d.health())
        })
        .collect()
}

/// A claim in one version's message.
macro_rules! claim {
    ($version:ident, $c:expr) => {
        $version::Claim {
            namespace: $c.namespace.clone(),
            uid: $c.uid.clone(),
            name: $c.name.clone(),
        }
    };
}
use claim;

/// kubelet reads a claim's entry as failed when its error is non-empty.
fn failed(error: String) -> Result<(), String> {
    if error.is_empty() {
        Ok(())
    } else {
        Err(error)
    }
}

/// Dials the plugin's DRA endpoint (kubelet's own socket when it names
/// none), as a refusal reason on failure.
async fn connect_endpoint(
    registration_socket: &Path,
    info: &PluginInfo,
    version: DraVersion,
) -> Result<(DraVersion, Client, Channel), String> {
    let endpoint = if info.endpoint.is_empty() {
        registration_socket.to_owned()
    } else {
        PathBuf::from(&info.endpoint)
    };
    // Through the DRA socket kubelet sends `localhost` as `:authority`,
    // which a tonic channel does too.
    let channel = tokio::time::timeout(CALL_TIMEOUT, unix::connect(&endpoint))
        .await
        .map_err(|_| format!("dial {}: timed out", endpoint.display()))?
        .map_err(|err| {
            format!(
                "RegisterPlugin error -- failed to connect to DRA driver plugin {} at endpoint {}: {err}",
                info.name,
                endpoint.display()
            )
        })?;
    let client = match version {
        DraVersion::V1 => Client::V1(v1::dra_plugin_client::DraPluginClient::new(channel.clone())),
        DraVersion::V1beta1 => Client::V1beta1(v1beta1::dra_plugin_client::DraPluginClient::new(
            channel.clone(),
        )),
    };
    Ok((version, client, channel))
}

/// Waits until a socket is at `path`, as kubelet's plugin watcher notices
/// one; fails after `timeout`.
pub async fn wait_for_socket(path: &Path, timeout: Duration) -> Result<(), FakeKubeletError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let is_socket = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket());
        if is_socket {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(FakeKubeletError::NoSocket {
                path: path.to_owned(),
                timeout,
            });
        }
        tokio::time::sleep(POLL).await;
    }
}

/// kubelet's plugin watcher connection: grpc-go's default `:authority` for
/// a bare path (the path, percent-encoded), added to the client's HPACK
/// table by the first request and referred to by the next.
struct RegistrationConnection {
    path: PathBuf,
    raw: RawGrpc,
    authority: String,
    /// Whether the authority is in our (the client's) HPACK table yet: only
    /// it is ever added, so it is always at [`FIRST_DYNAMIC`].
    authority_indexed: bool,
}

impl RegistrationConnection {
    async fn connect(path: &Path) -> Result<RegistrationConnection, FakeKubeletError> {
        let raw = RawGrpc::connect(path)
            .await
            .map_err(|source| FakeKubeletError::Connect {
                path: path.to_owned(),
                source,
            })?;
        Ok(RegistrationConnection {
            path: path.to_owned(),
            raw,
            authority: grpc_go_authority(path),
            authority_indexed: false,
        })
    }

    async fn call<A: Message + Default>(
        &mut self,
        method: &'static str,
        request: &impl Message,
    ) -> Result<A, FakeKubeletError> {
        let message = request.encode_to_vec();
        let authority = if self.authority_indexed {
            Authority::Table(FIRST_DYNAMIC)
        } else {
            Authority::Indexed(&self.authority)
        };
        let call = self.raw.call(method, authority, &message);
        let answered = tokio::time::timeout(CALL_TIMEOUT, call).await;
        // The request's header block added the authority to our table.
        self.authority_indexed = true;
        let reason = match answered {
            Ok(Ok(reply)) => match reply.message().map(A::decode) {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(err)) => format!("cannot decode the answer: {err}"),
                Err(reason) => reason,
            },
            Ok(Err(reason)) => reason,
            Err(_) => format!("no answer within {CALL_TIMEOUT:?}"),
        };
        Err(FakeKubeletError::Call {
            path: self.path.clone(),
            method,
            reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_kubelet_api::pluginregistration::registration_server::{
        Registration, RegistrationServer,
    };
    use tokio_stream::wrappers::UnixListenerStream;

    struct Accepting;

    #[tonic::async_trait]
    impl Registration for Accepting {
        async fn get_info(
            &self,
            _: tonic::Request<InfoRequest>,
        ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
            panic!("a server that refuses the authority never gets here")
        }

        async fn notify_registration_status(
            &self,
            _: tonic::Request<RegistrationStatus>,
        ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
            panic!("a server that refuses the authority never gets here")
        }
    }

    /// The reason the driver serves its registration socket through the
    /// lenient authority: without it, this kubelet (like the real one) is
    /// never answered.
    #[tokio::test]
    async fn a_plain_tonic_server_refuses_the_plugin_watchers_authority() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("plain-reg.sock");
        let listener = tokio::net::UnixListener::bind(&socket).unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(Accepting))
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(listener),
                    stop.clone().cancelled_owned(),
                ),
        );
        let err = match FakeDraKubelet::register(&socket, KUBELET_1_34).await {
            Ok(_) => panic!("registered through a server that refuses the authority"),
            Err(err) => err,
        };
        assert!(
            matches!(&err, FakeKubeletError::Call { method, reason, .. }
                if *method == GET_INFO && reason.contains("error code 1")),
            "{err}"
        );
        stop.cancel();
        server.await.unwrap().unwrap();
    }

    /// As kubelet's `pickHealthService`: 1.37 takes the newest health
    /// service both sides list, and none when the plugin lists none; older
    /// kubelets list none of their own and call v1alpha1 regardless.
    #[test]
    fn the_health_service_is_negotiated_as_each_kubelet_release_does() {
        let plugin = |services: &[&str]| services.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let dra_only = plugin(&[v1::SERVICE, v1beta1::SERVICE]);
        let both = plugin(&[v1::SERVICE, health::v1alpha1::SERVICE, health::v1::SERVICE]);
        let alpha = plugin(&[v1::SERVICE, health::v1alpha1::SERVICE]);
        use HealthVersion::{V1alpha1, V1};
        assert_eq!(HealthVersion::negotiate(KUBELET_1_37, &dra_only), None);
        assert_eq!(HealthVersion::negotiate(KUBELET_1_37, &both), Some(V1));
        assert_eq!(
            HealthVersion::negotiate(KUBELET_1_37, &alpha),
            Some(V1alpha1)
        );
        for older in [KUBELET_1_34, KUBELET_1_33] {
            assert_eq!(HealthVersion::negotiate(older, &dra_only), Some(V1alpha1));
            assert_eq!(HealthVersion::negotiate(older, &both), Some(V1alpha1));
        }
    }
}
