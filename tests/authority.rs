//! Clients that send the socket path as HTTP/2 `:authority`, as kubelet up to
//! 1.25 and grpc-go without an override do, reach the real plugin server.
//! tonic's client cannot send such an authority, so a raw HTTP/2 client does.

mod common;

use std::path::Path;

use common::{Node, WAIT};
use gpumem::deviceplugin::api::deviceplugin::{
    AllocateRequest, AllocateResponse, ContainerAllocateRequest, DevicePluginOptions,
    ListAndWatchResponse,
};
use gpumem::deviceplugin::service::plugin_options;
use gpumem::node::placement::Policy;
use gpumem::node::units::MemoryUnit;
use loona_hpack::encoder::encode_integer_into;
use loona_hpack::Decoder;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

const OPTIONS: &str = "/v1beta1.DevicePlugin/GetDevicePluginOptions";
const LIST_AND_WATCH: &str = "/v1beta1.DevicePlugin/ListAndWatch";
const ALLOCATE: &str = "/v1beta1.DevicePlugin/Allocate";

/// How the request's `:authority` is encoded (RFC 7541 §6).
enum Authority<'a> {
    /// A literal without indexing.
    Literal(&'a str),
    /// A literal added to the client's dynamic table (grpc-go's choice).
    Indexed(&'a str),
    /// A reference to the client's dynamic table.
    Table(u8),
}

fn string(dst: &mut Vec<u8>, s: &str) {
    encode_integer_into(s.len(), 7, 0, dst).unwrap();
    dst.extend_from_slice(s.as_bytes());
}

/// A gRPC request's header block: :method POST and :scheme http from the
/// static table, the rest literals with literal names.
fn request_block(path: &str, authority: Authority) -> Vec<u8> {
    let mut block = vec![0x83, 0x86, 0];
    string(&mut block, ":path");
    string(&mut block, path);
    match authority {
        Authority::Literal(value) | Authority::Indexed(value) => {
            block.push(if matches!(authority, Authority::Indexed(_)) {
                0x40
            } else {
                0
            });
            string(&mut block, ":authority");
            string(&mut block, value);
        }
        Authority::Table(index) => block.push(0x80 | index),
    }
    for (name, value) in [("content-type", "application/grpc"), ("te", "trailers")] {
        block.push(0);
        string(&mut block, name);
        string(&mut block, value);
    }
    block
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut out = len[1..].to_vec();
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
    out
}

#[derive(Debug, Default)]
struct Reply {
    headers: Vec<(String, String)>,
    messages: Vec<Vec<u8>>,
    trailers: Vec<(String, String)>,
}

impl Reply {
    fn grpc_status(&self) -> Option<&str> {
        // A trailers-only reply carries its status in the headers.
        self.trailers
            .iter()
            .chain(&self.headers)
            .find(|(name, _)| name == "grpc-status")
            .map(|(_, value)| value.as_str())
    }
}

/// Just enough of an HTTP/2 client for unary and server-streaming gRPC calls.
struct RawClient {
    stream: UnixStream,
    /// Mirrors the server's HPACK encoder, across all streams.
    decoder: Decoder<'static>,
    next_stream: u32,
}

impl RawClient {
    async fn connect(socket: &Path) -> RawClient {
        let mut stream = UnixStream::connect(socket).await.unwrap();
        let mut hello = PREFACE.to_vec();
        hello.extend(frame(SETTINGS, 0, 0, &[]));
        stream.write_all(&hello).await.unwrap();
        RawClient {
            stream,
            decoder: Decoder::new(),
            next_stream: 1,
        }
    }

    /// Sends one request message; returns the stream.
    async fn send(&mut self, block: &[u8], message: &[u8]) -> u32 {
        let id = self.next_stream;
        self.next_stream += 2;
        let mut grpc = vec![0];
        grpc.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
        grpc.extend_from_slice(message);
        let mut bytes = frame(HEADERS, END_HEADERS, id, block);
        bytes.extend(frame(DATA, END_STREAM, id, &grpc));
        self.stream.write_all(&bytes).await.unwrap();
        id
    }

    async fn read_frame(&mut self) -> (u8, u8, u32, Vec<u8>) {
        let mut head = [0; 9];
        self.stream.read_exact(&mut head).await.unwrap();
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let mut payload = vec![0; len];
        self.stream.read_exact(&mut payload).await.unwrap();
        (head[3], head[4], stream, payload)
    }

    /// Reads until `id` ends (or, with `first_only`, has one message), or
    /// fails with what reset it.
    async fn reply(&mut self, id: u32, first_only: bool) -> Result<Reply, String> {
        tokio::time::timeout(WAIT, self.reply_inner(id, first_only))
            .await
            .expect("the server answers")
    }

    async fn reply_inner(&mut self, id: u32, first_only: bool) -> Result<Reply, String> {
        let mut reply = Reply::default();
        let mut got_headers = false;
        let mut body = Vec::new();
        loop {
            let (kind, flags, stream, mut payload) = self.read_frame().await;
            match kind {
                SETTINGS if flags & ACK == 0 => {
                    self.stream
                        .write_all(&frame(SETTINGS, ACK, 0, &[]))
                        .await
                        .unwrap();
                }
                PING if flags & ACK == 0 => {
                    self.stream
                        .write_all(&frame(PING, ACK, 0, &payload))
                        .await
                        .unwrap();
                }
                GOAWAY => {
                    return Err(format!(
                        "GOAWAY with error code {}",
                        u32::from_be_bytes(payload[4..8].try_into().unwrap())
                    ))
                }
                RST_STREAM if stream == id => {
                    return Err(format!(
                        "stream {id} reset with error code {}",
                        u32::from_be_bytes(payload[..4].try_into().unwrap())
                    ))
                }
                HEADERS => {
                    let mut start = 0;
                    let mut end = payload.len();
                    if flags & PADDED != 0 {
                        start = 1;
                        end -= usize::from(payload[0]);
                    }
                    if flags & PRIORITY != 0 {
                        start += 5;
                    }
                    let mut block = payload[start..end].to_vec();
                    let mut last = flags;
                    while last & END_HEADERS == 0 {
                        let (kind, flags, _, more) = self.read_frame().await;
                        assert_eq!(kind, CONTINUATION);
                        block.extend(more);
                        last = flags;
                    }
                    let fields = self
                        .decoder
                        .decode(&block)
                        .unwrap()
                        .into_iter()
                        .map(|(n, v)| {
                            (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                        })
                        .collect();
                    if stream == id {
                        if got_headers {
                            reply.trailers = fields;
                        } else {
                            reply.headers = fields;
                            got_headers = true;
                        }
                        if flags & END_STREAM != 0 {
                            return Ok(reply);
                        }
                    }
                }
                DATA if stream == id => {
                    body.append(&mut payload);
                    while body.len() >= 5 {
                        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
                        if body.len() < 5 + len {
                            break;
                        }
                        reply.messages.push(body[5..5 + len].to_vec());
                        body.drain(..5 + len);
                    }
                    if flags & END_STREAM != 0 || (first_only && !reply.messages.is_empty()) {
                        return Ok(reply);
                    }
                }
                _ => {}
            }
        }
    }

    async fn call(
        &mut self,
        path: &str,
        authority: Authority<'_>,
        message: &[u8],
    ) -> Result<Reply, String> {
        let id = self.send(&request_block(path, authority), message).await;
        self.reply(id, false).await
    }
}

async fn plugin() -> Node {
    let node = Node::start("t4", MemoryUnit::GiB, Policy::Binpack).await;
    node.devices().await;
    node
}

/// GetDevicePluginOptions on a fresh connection, as kubelet's Register does.
async fn options(node: &Node, authority: &str) -> Result<DevicePluginOptions, String> {
    let mut client = RawClient::connect(&node.socket()).await;
    let reply = client
        .call(OPTIONS, Authority::Literal(authority), &[])
        .await?;
    assert_eq!(reply.grpc_status(), Some("0"), "{reply:?}");
    assert_eq!(reply.messages.len(), 1, "{reply:?}");
    Ok(DevicePluginOptions::decode(&reply.messages[0][..]).unwrap())
}

#[tokio::test]
async fn kubelet_1_25_sending_the_socket_path_gets_the_options() {
    let node = plugin().await;
    let path = node.socket().to_str().unwrap().to_owned();
    let served = options(&node, &path)
        .await
        .unwrap_or_else(|err| panic!(":authority {path}: {err}"));
    assert!(served.get_preferred_allocation_available);
    assert_eq!(served, plugin_options());
    node.stop().await;
}

#[tokio::test]
async fn encoded_forms_of_the_path_get_the_options() {
    let node = plugin().await;
    let path = node.socket().to_str().unwrap().to_owned();
    // Percent-encoded, as grpc-go encodes an authority; without the leading
    // slash, as a passthrough target's endpoint; both, as grpcio 1.85 sends.
    for authority in [
        path.replace('/', "%2F"),
        path[1..].to_owned(),
        path[1..].replace('/', "%2F"),
    ] {
        let served = options(&node, &authority)
            .await
            .unwrap_or_else(|err| panic!(":authority {authority}: {err}"));
        assert_eq!(served, plugin_options());
    }
    node.stop().await;
}

#[tokio::test]
async fn localhost_still_gets_the_options() {
    let node = plugin().await;
    assert_eq!(options(&node, "localhost").await.unwrap(), plugin_options());
    node.stop().await;
}

/// kubelet 1.25 keeps one connection and grpc-go's encoder indexes the
/// authority once, then refers to it: the rewrite must follow its table.
#[tokio::test]
async fn one_connection_like_kubelet_1_25_options_list_and_watch_allocate() {
    let node = plugin().await;
    let path = node.socket().to_str().unwrap().to_owned();
    let mut client = RawClient::connect(&node.socket()).await;

    let reply = client
        .call(OPTIONS, Authority::Indexed(&path), &[])
        .await
        .unwrap();
    assert_eq!(reply.grpc_status(), Some("0"), "{reply:?}");
    let served = DevicePluginOptions::decode(&reply.messages[0][..]).unwrap();
    assert_eq!(served, plugin_options());

    // The client's table: 62 is the authority.
    let id = client
        .send(&request_block(LIST_AND_WATCH, Authority::Table(62)), &[])
        .await;
    let reply = client.reply(id, true).await.unwrap();
    let first = ListAndWatchResponse::decode(&reply.messages[0][..]).unwrap();
    assert_eq!(first.devices.len(), 14, "a T4 in GiB");

    let request = AllocateRequest {
        container_requests: vec![ContainerAllocateRequest {
            devices_ids: vec![first.devices[0].id.clone()],
        }],
    };
    let reply = client
        .call(ALLOCATE, Authority::Table(62), &request.encode_to_vec())
        .await
        .unwrap();
    assert_eq!(reply.grpc_status(), Some("0"), "{reply:?}");
    let allocated = AllocateResponse::decode(&reply.messages[0][..]).unwrap();
    assert_eq!(allocated.container_responses.len(), 1);
    assert_eq!(
        allocated.container_responses[0].envs["ALIYUN_COM_GPU_MEM_CONTAINER"],
        "1"
    );

    drop(client);
    node.stop().await;
}
