//! kubelet's side of DRA for `gpumem demo` and the tests: registers a DRA
//! driver the way kubelet's plugin watcher does, then prepares claims.
//!
//! It follows the real kubelet where a driver can tell the difference
//! (pkg/kubelet/pluginmanager/operationexecutor and pkg/kubelet/cm/dra/plugin):
//! one connection to the registration socket with grpc-go's default
//! `:authority` (the socket path, percent-encoded, indexed by the first
//! request and referred to by the second), GetInfo, the first of the
//! plugin's versions this kubelet knows, NotifyRegistrationStatus on the same
//! connection, refusals told to the plugin before they are returned. It is
//! stricter in one place: it dials the DRA endpoint before accepting, where
//! kubelet connects lazily, so a driver that advertises its endpoint before
//! serving it fails here.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tonic::transport::Channel;

use gpumem_kubelet_api::dra::{v1, v1beta1};
pub use gpumem_kubelet_api::dra::{ClaimRef, Prepared, PreparedDevice, Unprepared};
use gpumem_kubelet_api::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse, DRA_PLUGIN,
};

use crate::unix;

/// The DRA versions of kubelets 1.34 to 1.37.
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
    #[error("cannot connect to {path}: {source}")]
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

enum Client {
    V1(v1::dra_plugin_client::DraPluginClient<Channel>),
    V1beta1(v1beta1::dra_plugin_client::DraPluginClient<Channel>),
}

/// A kubelet that has registered one DRA driver.
pub struct FakeDraKubelet {
    info: PluginInfo,
    version: DraVersion,
    client: Client,
}

impl FakeDraKubelet {
    /// Registers the plugin at `registration_socket` as a kubelet that knows
    /// `known_versions` (such as [`KUBELET_1_34`]; versions other than v1 and
    /// v1beta1 count as unknown). A plugin it cannot use is told so through
    /// NotifyRegistrationStatus and the refusal returned.
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
        let (version, client) = accepted.map_err(FakeKubeletError::Refused)?;
        Ok(FakeDraKubelet {
            info,
            version,
            client,
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
) -> Result<(DraVersion, Client), String> {
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
        DraVersion::V1 => Client::V1(v1::dra_plugin_client::DraPluginClient::new(channel)),
        DraVersion::V1beta1 => {
            Client::V1beta1(v1beta1::dra_plugin_client::DraPluginClient::new(channel))
        }
    };
    Ok((version, client))
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

/// grpc-go's `:authority` for a target that is a bare path: the path with
/// every character RFC 3986 does not allow in an authority percent-encoded
/// (grpc-go's `encodeAuthority`).
fn grpc_go_authority(path: &Path) -> String {
    let mut out = String::new();
    for &b in path.as_os_str().as_encoded_bytes() {
        let allowed = b.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]@".contains(&b);
        if allowed {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const WINDOW_UPDATE: u8 = 0x8;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The first index of HPACK's dynamic table, past the 61 static entries.
const FIRST_DYNAMIC: usize = 62;
/// A header block from our own server stays far below this.
const MAX_BLOCK: usize = 64 * 1024;

/// kubelet's plugin watcher connection, below tonic: tonic's client cannot
/// send a socket path as `:authority` (`http::uri::Authority` refuses it),
/// so this speaks just enough HTTP/2 for unary gRPC calls.
struct RegistrationConnection {
    path: PathBuf,
    stream: UnixStream,
    /// Mirrors the server's HPACK encoder, across all streams.
    decoder: loona_hpack::Decoder<'static>,
    authority: String,
    /// Whether the authority is in our (the client's) HPACK table yet: only
    /// it is ever added, so it is always at [`FIRST_DYNAMIC`].
    authority_indexed: bool,
    next_stream: u32,
}

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

impl RegistrationConnection {
    async fn connect(path: &Path) -> Result<RegistrationConnection, FakeKubeletError> {
        let connect_err = |source| FakeKubeletError::Connect {
            path: path.to_owned(),
            source,
        };
        let mut stream = UnixStream::connect(path).await.map_err(connect_err)?;
        let mut hello = PREFACE.to_vec();
        push_frame(&mut hello, SETTINGS, 0, 0, &[]);
        stream.write_all(&hello).await.map_err(connect_err)?;
        Ok(RegistrationConnection {
            path: path.to_owned(),
            stream,
            decoder: loona_hpack::Decoder::new(),
            authority: grpc_go_authority(path),
            authority_indexed: false,
            next_stream: 1,
        })
    }

    async fn call<A: Message + Default>(
        &mut self,
        method: &'static str,
        request: &impl Message,
    ) -> Result<A, FakeKubeletError> {
        let message = request.encode_to_vec();
        let reason = match tokio::time::timeout(CALL_TIMEOUT, self.exchange(method, &message)).await
        {
            Ok(Ok(body)) => match A::decode(&body[..]) {
                Ok(answer) => return Ok(answer),
                Err(err) => format!("cannot decode the answer: {err}"),
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

    /// One unary call: the answer's message, or why there is none.
    async fn exchange(&mut self, method: &str, message: &[u8]) -> Result<Vec<u8>, String> {
        let id = self.next_stream;
        self.next_stream += 2;
        let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
        literal(&mut block, 0x00, ":path", method);
        if self.authority_indexed {
            integer(&mut block, 0x80, 7, FIRST_DYNAMIC);
        } else {
            // As grpc-go's encoder: a literal added to the table.
            literal(&mut block, 0x40, ":authority", &self.authority);
            self.authority_indexed = true;
        }
        literal(&mut block, 0x00, "content-type", "application/grpc");
        literal(&mut block, 0x00, "te", "trailers");
        let len = u32::try_from(message.len()).map_err(|_| "request too large".to_owned())?;
        let mut body = vec![0];
        body.extend_from_slice(&len.to_be_bytes());
        body.extend_from_slice(message);
        let mut out = Vec::new();
        push_frame(&mut out, HEADERS, END_HEADERS, id, &block);
        push_frame(&mut out, DATA, END_STREAM, id, &body);
        self.write(&out).await?;

        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut body = Vec::new();
        loop {
            let frame = self.read_frame().await?;
            match frame.kind {
                SETTINGS if frame.flags & ACK == 0 => {
                    let mut ack = Vec::new();
                    push_frame(&mut ack, SETTINGS, ACK, 0, &[]);
                    self.write(&ack).await?;
                }
                PING if frame.flags & ACK == 0 => {
                    let mut pong = Vec::new();
                    push_frame(&mut pong, PING, ACK, 0, &frame.payload);
                    self.write(&pong).await?;
                }
                GOAWAY => return Err(format!("connection closed by the server (GOAWAY, error code {})", code_at(&frame.payload, 4))),
                RST_STREAM if frame.stream == id => {
                    return Err(format!(
                        "stream reset by the server with error code {} (1 is PROTOCOL_ERROR: an :authority it refused?)",
                        code_at(&frame.payload, 0)
                    ))
                }
                HEADERS => {
                    let block = self.header_block(&frame).await?;
                    let decoded = self
                        .decoder
                        .decode(&block)
                        .map_err(|err| format!("answer headers do not decode: {err:?}"))?;
                    if frame.stream == id {
                        fields.extend(decoded);
                        if frame.flags & END_STREAM != 0 {
                            return grpc_answer(&fields, &body);
                        }
                    }
                }
                DATA if frame.stream == id => {
                    let data = unpadded(&frame)?;
                    body.extend_from_slice(data);
                    // Give the flow-control window back: the connection is
                    // reused for the next call.
                    if !frame.payload.is_empty() {
                        let len = u32::try_from(frame.payload.len()).unwrap_or(u32::MAX);
                        let mut update = Vec::new();
                        push_frame(&mut update, WINDOW_UPDATE, 0, 0, &len.to_be_bytes());
                        self.write(&update).await?;
                    }
                    if frame.flags & END_STREAM != 0 {
                        return grpc_answer(&fields, &body);
                    }
                }
                _ => {}
            }
        }
    }

    /// The header block a HEADERS frame starts, with its CONTINUATIONs.
    async fn header_block(&mut self, frame: &Frame) -> Result<Vec<u8>, String> {
        let mut block = unpadded(frame)?.to_vec();
        if frame.flags & PRIORITY != 0 {
            block = block.get(5..).ok_or("HEADERS too short")?.to_vec();
        }
        let mut flags = frame.flags;
        while flags & END_HEADERS == 0 {
            let more = self.read_frame().await?;
            if more.kind != CONTINUATION || more.stream != frame.stream {
                return Err(format!("frame of type {} inside a header block", more.kind));
            }
            block.extend_from_slice(&more.payload);
            if block.len() > MAX_BLOCK {
                return Err("answer headers too large".to_owned());
            }
            flags = more.flags;
        }
        Ok(block)
    }

    async fn read_frame(&mut self) -> Result<Frame, String> {
        let closed = |err: std::io::Error| format!("connection lost: {err}");
        let mut head = [0; 9];
        self.stream.read_exact(&mut head).await.map_err(closed)?;
        let [l0, l1, l2, kind, flags, s0, s1, s2, s3] = head;
        let len = usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2);
        let mut payload = vec![0; len];
        self.stream.read_exact(&mut payload).await.map_err(closed)?;
        Ok(Frame {
            kind,
            flags,
            stream: u32::from_be_bytes([s0, s1, s2, s3]) & 0x7fff_ffff,
            payload,
        })
    }

    async fn write(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.stream
            .write_all(bytes)
            .await
            .map_err(|err| format!("connection lost: {err}"))
    }
}

/// The message of a finished call, or its gRPC error.
fn grpc_answer(fields: &[(Vec<u8>, Vec<u8>)], body: &[u8]) -> Result<Vec<u8>, String> {
    let field = |name: &str| {
        fields
            .iter()
            .rev()
            .find(|(n, _)| n == name.as_bytes())
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    };
    match field("grpc-status").as_deref() {
        Some("0") => {}
        Some(code) => {
            return Err(format!(
                "gRPC status {code}: {}",
                field("grpc-message").unwrap_or_default()
            ))
        }
        None => return Err("the answer has no grpc-status".to_owned()),
    }
    // One length-prefixed, uncompressed message.
    let (head, rest) = body
        .split_at_checked(5)
        .ok_or("the answer has no message")?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    let len = usize::try_from(len).map_err(|_| "message too large".to_owned())?;
    if head[0] != 0 {
        return Err("the answer is compressed".to_owned());
    }
    rest.get(..len)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| "the answer's message is cut short".to_owned())
}

/// A DATA or HEADERS payload without its padding.
fn unpadded(frame: &Frame) -> Result<&[u8], String> {
    if frame.flags & PADDED == 0 {
        return Ok(&frame.payload);
    }
    let (&pad, rest) = frame.payload.split_first().ok_or("empty padded frame")?;
    let keep = rest
        .len()
        .checked_sub(usize::from(pad))
        .ok_or("padding longer than the frame")?;
    Ok(&rest[..keep])
}

/// The 32-bit error code at `at` in a frame's payload (0 when cut short).
fn code_at(payload: &[u8], at: usize) -> u32 {
    payload
        .get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_be_bytes)
}

fn push_frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    // Our frames are a few hundred bytes: far within the 24-bit length.
    let len = u32::try_from(payload.len())
        .unwrap_or(u32::MAX)
        .to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}

/// An HPACK literal with a literal name; `kind` 0x40 adds it to the table,
/// 0x00 does not (RFC 7541 §6.2). No Huffman coding.
fn literal(block: &mut Vec<u8>, kind: u8, name: &str, value: &str) {
    block.push(kind);
    for s in [name, value] {
        integer(block, 0, 7, s.len());
        block.extend_from_slice(s.as_bytes());
    }
}

/// An HPACK integer in an `bits`-bit prefix after `flags` (RFC 7541 §5.1).
fn integer(block: &mut Vec<u8>, flags: u8, bits: u32, value: usize) {
    let max = (1usize << bits) - 1;
    if value < max {
        // Below `max`, so it fits the prefix.
        block.push(flags | value as u8);
        return;
    }
    block.push(flags | max as u8);
    let mut rest = value - max;
    while rest >= 0x80 {
        block.push(0x80 | (rest & 0x7f) as u8);
        rest >>= 7;
    }
    block.push(rest as u8);
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_kubelet_api::pluginregistration::registration_server::{
        Registration, RegistrationServer,
    };
    use tokio_stream::wrappers::UnixListenerStream;

    #[test]
    fn the_authority_is_the_path_percent_encoded_as_grpc_go_does() {
        assert_eq!(
            grpc_go_authority(Path::new(
                "/var/lib/kubelet/plugins_registry/gpumem.io-reg.sock"
            )),
            "%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpumem.io-reg.sock"
        );
        assert_eq!(grpc_go_authority(Path::new("/a b%~")), "%2Fa%20b%25~");
    }

    #[test]
    fn hpack_integers_cross_the_prefix() {
        let encoded = |flags, bits, value| {
            let mut block = Vec::new();
            integer(&mut block, flags, bits, value);
            block
        };
        assert_eq!(encoded(0x80, 7, 62), [0xbe]);
        assert_eq!(encoded(0, 7, 127), [0x7f, 0]);
        // RFC 7541 C.1.2: 1337 in a 5-bit prefix.
        assert_eq!(encoded(0, 5, 1337), [0x1f, 0x9a, 0x0a]);
    }

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
}
