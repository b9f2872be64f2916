//! A raw HTTP/2 gRPC client on a unix socket that sends whatever
//! `:authority` it is told to, as kubelet up to 1.25, grpc-go's plugin
//! watcher and grpcio do. tonic's client cannot: `http::uri::Authority`
//! refuses a socket path. Just enough HTTP/2 for unary and
//! server-streaming calls: no Huffman coding, no flow control of our own.

use std::io;
use std::path::Path;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

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
pub const FIRST_DYNAMIC: usize = 62;
/// A header block from our own servers stays far below this.
const MAX_BLOCK: usize = 64 * 1024;

/// How a request's `:authority` is encoded (RFC 7541 §6).
#[derive(Debug, Clone, Copy)]
pub enum Authority<'a> {
    /// A literal without indexing.
    Literal(&'a str),
    /// A literal added to the client's dynamic table (grpc-go's choice).
    Indexed(&'a str),
    /// A reference to the client's dynamic table.
    Table(usize),
}

/// What the server answered on one stream.
#[derive(Debug, Default)]
pub struct Reply {
    pub headers: Vec<(String, String)>,
    /// Each length-prefixed message, without its prefix.
    pub messages: Vec<Vec<u8>>,
    pub trailers: Vec<(String, String)>,
    compressed: bool,
}

impl Reply {
    /// The call's `grpc-status`; a trailers-only reply carries it in the
    /// headers.
    pub fn grpc_status(&self) -> Option<&str> {
        self.field("grpc-status")
    }

    fn field(&self, name: &str) -> Option<&str> {
        self.trailers
            .iter()
            .chain(&self.headers)
            .find(|(n, _)| n == name)
            .map(|(_, value)| value.as_str())
    }

    /// A unary call's one message, or its gRPC error.
    pub fn message(&self) -> Result<&[u8], String> {
        match self.grpc_status() {
            Some("0") => {}
            Some(code) => {
                return Err(format!(
                    "gRPC status {code}: {}",
                    self.field("grpc-message").unwrap_or_default()
                ))
            }
            None => return Err("the answer has no grpc-status".to_owned()),
        }
        if self.compressed {
            return Err("the answer is compressed".to_owned());
        }
        self.messages
            .first()
            .map(Vec::as_slice)
            .ok_or_else(|| "the answer has no message".to_owned())
    }
}

struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// One HTTP/2 connection. Errors are strings a test can show as they are.
pub struct RawGrpc {
    stream: UnixStream,
    /// Mirrors the server's HPACK encoder, across all streams.
    decoder: loona_hpack::Decoder<'static>,
    next_stream: u32,
}

impl RawGrpc {
    /// Connects and sends the preface with empty SETTINGS.
    pub async fn connect(path: &Path) -> io::Result<RawGrpc> {
        let mut stream = UnixStream::connect(path).await?;
        let mut hello = PREFACE.to_vec();
        push_frame(&mut hello, SETTINGS, 0, 0, &[]);
        stream.write_all(&hello).await?;
        Ok(RawGrpc {
            stream,
            decoder: loona_hpack::Decoder::new(),
            next_stream: 1,
        })
    }

    /// Sends one request message to `path` (`/package.Service/Method`);
    /// returns its stream.
    pub async fn send(
        &mut self,
        path: &str,
        authority: Authority<'_>,
        message: &[u8],
    ) -> Result<u32, String> {
        let id = self.next_stream;
        self.next_stream += 2;
        let mut block = vec![0x83, 0x86]; // :method POST, :scheme http
        literal(&mut block, 0x00, ":path", path);
        match authority {
            Authority::Literal(value) => literal(&mut block, 0x00, ":authority", value),
            Authority::Indexed(value) => literal(&mut block, 0x40, ":authority", value),
            Authority::Table(index) => integer(&mut block, 0x80, 7, index),
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
        Ok(id)
    }

    /// One call: sends the request and reads the whole reply.
    pub async fn call(
        &mut self,
        path: &str,
        authority: Authority<'_>,
        message: &[u8],
    ) -> Result<Reply, String> {
        let id = self.send(path, authority, message).await?;
        self.reply(id, false).await
    }

    /// Reads until stream `id` ends (or, with `first_only`, has one
    /// message), or fails with what closed or reset it.
    pub async fn reply(&mut self, id: u32, first_only: bool) -> Result<Reply, String> {
        let mut reply = Reply::default();
        let mut got_headers = false;
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
                GOAWAY => {
                    return Err(format!(
                        "connection closed by the server (GOAWAY, error code {})",
                        code_at(&frame.payload, 4)
                    ))
                }
                RST_STREAM if frame.stream == id => {
                    return Err(format!(
                        "stream reset by the server with error code {} (1 is PROTOCOL_ERROR: an :authority it refused?)",
                        code_at(&frame.payload, 0)
                    ))
                }
                HEADERS => {
                    let block = self.header_block(&frame).await?;
                    let fields = self
                        .decoder
                        .decode(&block)
                        .map_err(|err| format!("answer headers do not decode: {err:?}"))?
                        .into_iter()
                        .map(|(n, v)| {
                            let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
                            (text(n), text(v))
                        })
                        .collect();
                    if frame.stream == id {
                        if got_headers {
                            reply.trailers = fields;
                        } else {
                            reply.headers = fields;
                            got_headers = true;
                        }
                        if frame.flags & END_STREAM != 0 {
                            return Ok(reply);
                        }
                    }
                }
                DATA if frame.stream == id => {
                    body.extend_from_slice(unpadded(&frame)?);
                    // Give the flow-control window back: the connection is
                    // reused for the next call.
                    if !frame.payload.is_empty() {
                        let len = u32::try_from(frame.payload.len()).unwrap_or(u32::MAX);
                        let mut update = Vec::new();
                        push_frame(&mut update, WINDOW_UPDATE, 0, 0, &len.to_be_bytes());
                        self.write(&update).await?;
                    }
                    while let Some(head) = body.get(..5) {
                        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
                        let len = usize::try_from(len).map_err(|_| "message too large")?;
                        if body.len() < 5 + len {
                            break;
                        }
                        reply.compressed |= body[0] != 0;
                        reply.messages.push(body[5..5 + len].to_vec());
                        body.drain(..5 + len);
                    }
                    if frame.flags & END_STREAM != 0 || (first_only && !reply.messages.is_empty())
                    {
                        return Ok(reply);
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
        let closed = |err: io::Error| format!("connection lost: {err}");
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

/// grpc-go's `:authority` for a target that is a bare path: the path with
/// every character RFC 3986 does not allow in an authority percent-encoded
/// (grpc-go's `encodeAuthority`).
pub fn grpc_go_authority(path: &Path) -> String {
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
    // Requests and control frames are far within the 24-bit length.
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
}
