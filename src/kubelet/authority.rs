//! Lets clients that send a socket path as HTTP/2 `:authority` reach our gRPC
//! servers: a read-side rewrite of the client's header blocks, below h2.
//!
//! kubelet up to 1.25 dials device plugins with the socket path as authority
//! (1.26 sends `localhost`, kubernetes PR 112597); the plugin watcher dials
//! registration sockets without an override (grpc-go then sends the path
//! percent-encoded), and grpcio sends the path too. h2's server parses
//! `:authority` as an `http::uri::Authority` and resets the stream with
//! PROTOCOL_ERROR when that fails, before tonic sees the request.
//!
//! [`LenientAuthority`] wraps an accepted connection. It follows the client's
//! frames (preface, 9-byte frame headers, HEADERS with PADDED/PRIORITY, then
//! CONTINUATION until END_HEADERS) and decodes every header block with an
//! HPACK decoder that mirrors the client's dynamic table. Header blocks pass
//! byte for byte until one carries an authority `Authority` refuses; that
//! value becomes `localhost`, and from then on every block of the connection
//! is re-encoded as literals without indexing. The server's table is then
//! never used again, so it cannot disagree with the client's. Writes pass
//! through untouched.
//!
//! This file can go when h2's server accepts such an authority: hyperium/h2
//! pull request 487 ("Do not require authority for UNIX domain sockets") is
//! still open as of November 2026. Until then, and while kubelets of 1.25 and
//! older or plugin-watcher dials can reach us, the rewrite stays.

use crate::error_text::{chain, one_line};
use std::borrow::Cow;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
// loona-hpack: the newest of the HPACK crates (0.4.3, November 2024), a fork
// of hpack-rs (last release 2016) made to pass h2spec in the loona server; no
// unsafe, and its dependencies (thiserror 1, tracing) are already in our
// tree. h2 keeps its own HPACK private, even behind its `unstable` feature.
use loona_hpack::decoder::DecoderError;
use loona_hpack::encoder::encode_integer_into;
use loona_hpack::Decoder;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::Connected;
use tracing::debug;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEAD: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The smallest SETTINGS_MAX_FRAME_SIZE a server may announce, so every
/// server accepts frames this large.
const MAX_FRAME: usize = 16_384;
/// h2's SETTINGS_HEADER_TABLE_SIZE, which tonic leaves at its default: a
/// client may not grow its table past it (h2 refuses that too).
const HEADER_TABLE_SIZE: usize = 4_096;
/// One header block, as sent (frames) and as decoded (HPACK's size: name +
/// value + 32 per field). Four times hyper's 16 KiB header-list limit, so
/// h2 still answers an oversized request itself; past this we stop.
const MAX_BLOCK: usize = 64 * 1024;
const AUTHORITY: &[u8] = b":authority";
const REPLACEMENT: &[u8] = b"localhost";
/// How much one read from the socket asks for.
const READ_CHUNK: usize = 16 * 1024;

/// Why a connection's client stream could not be rewritten.
#[derive(Debug, thiserror::Error)]
pub enum AuthorityError {
    #[error(
        "frame of type {kind:#x} on stream {stream} inside the header block of stream {block}"
    )]
    Interleaved { kind: u8, stream: u32, block: u32 },
    #[error("HEADERS frame on stream {stream}: padding and priority ({overhead} bytes) exceed its {len}-byte payload")]
    Padding {
        stream: u32,
        overhead: usize,
        len: usize,
    },
    #[error("header block of stream {stream} is over {MAX_BLOCK} bytes")]
    TooLarge { stream: u32 },
    #[error("header block of stream {stream} does not decode")]
    Hpack { stream: u32, source: DecoderError },
    #[error("cannot encode the header block of stream {stream}")]
    Encode { stream: u32, source: io::Error },
}

/// Wraps each connection of `incoming` in [`LenientAuthority`], for
/// `serve_with_incoming_shutdown`.
pub fn lenient<I, IO, E>(incoming: I) -> impl Stream<Item = Result<LenientAuthority<IO>, E>>
where
    I: Stream<Item = Result<IO, E>>,
{
    incoming.map(|conn| conn.map(LenientAuthority::new))
}

/// A server-side connection whose client may send any `:authority`.
pub struct LenientAuthority<S> {
    inner: S,
    rewriter: Rewriter,
    /// Rewritten bytes not yet handed to the reader.
    out: BytesMut,
    scratch: Box<[u8]>,
    read: ReadState,
}

enum ReadState {
    Open,
    Eof,
    /// What closes the connection, repeated to every later read.
    Failed(String),
}

impl<S> LenientAuthority<S> {
    pub fn new(inner: S) -> Self {
        LenientAuthority {
            inner,
            rewriter: Rewriter::new(),
            out: BytesMut::new(),
            scratch: vec![0; READ_CHUNK].into_boxed_slice(),
            read: ReadState::Open,
        }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: Connected> Connected for LenientAuthority<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for LenientAuthority<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            // Deliver what is rewritten before an error or the end.
            if !this.out.is_empty() {
                let n = this.out.len().min(buf.remaining());
                buf.put_slice(&this.out[..n]);
                this.out.advance(n);
                return Poll::Ready(Ok(()));
            }
            match &this.read {
                ReadState::Open => {}
                ReadState::Eof => return Poll::Ready(Ok(())),
                ReadState::Failed(why) => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        why.clone(),
                    )))
                }
            }
            let mut chunk = ReadBuf::new(&mut this.scratch);
            // Pending only here, with the inner stream holding the waker.
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut chunk))?;
            if chunk.filled().is_empty() {
                // An unfinished frame at the end is dropped: the server sees
                // the connection end either way.
                this.read = ReadState::Eof;
            } else if let Err(err) = this.rewriter.feed(chunk.filled(), &mut this.out) {
                debug!(err = %chain(&err), "closing a connection whose HTTP/2 stream cannot be rewritten");
                this.read = ReadState::Failed(one_line(&err));
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for LenientAuthority<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// The client-to-server byte stream's rewrite, independent of IO: bytes in,
/// bytes out, in any pieces.
struct Rewriter {
    state: State,
    /// Received bytes not yet consumed (an unfinished frame).
    input: BytesMut,
    /// Mirrors the client's HPACK encoder.
    decoder: Decoder<'static>,
    /// The header block being collected, HEADERS until END_HEADERS.
    block: Option<Block>,
    /// Set by the first rewrite: the server's HPACK table no longer matches
    /// the client's, so every later block is re-encoded without it.
    reencode: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Preface,
    /// At a frame header.
    Frames,
    /// Inside the payload of a frame that passes as it is.
    Payload(usize),
    /// Not followed any more: bytes pass as they are (not HTTP/2 with prior
    /// knowledge, or a stream that could not be followed before any rewrite).
    Passthrough,
}

struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    /// The frames as received, sent on when nothing needs rewriting.
    raw: Vec<u8>,
    /// The header block fragments, without padding and priority.
    fragment: Vec<u8>,
}

struct FrameHead {
    len: usize,
    kind: u8,
    flags: u8,
    stream: u32,
}

impl FrameHead {
    fn parse(head: &[u8]) -> Option<FrameHead> {
        let &[l0, l1, l2, kind, flags, s0, s1, s2, s3] = head.get(..FRAME_HEAD)? else {
            return None;
        };
        Some(FrameHead {
            len: usize::from(l0) << 16 | usize::from(l1) << 8 | usize::from(l2),
            kind,
            flags,
            stream: u32::from_be_bytes([s0, s1, s2, s3]) & 0x7fff_ffff,
        })
    }
}

impl Rewriter {
    fn new() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(HEADER_TABLE_SIZE);
        Rewriter {
            state: State::Preface,
            input: BytesMut::new(),
            decoder,
            block: None,
            reencode: false,
        }
    }

    /// Takes `data` from the client and appends to `out` what the server
    /// gets; keeps an unfinished frame for the next call.
    fn feed(&mut self, data: &[u8], out: &mut BytesMut) -> Result<(), AuthorityError> {
        self.input.extend_from_slice(data);
        loop {
            match self.state {
                State::Passthrough => {
                    out.extend_from_slice(&self.input.split());
                    return Ok(());
                }
                State::Preface => {
                    let n = self.input.len().min(PREFACE.len());
                    if self.input[..n] != PREFACE[..n] {
                        debug!("client did not start HTTP/2 with prior knowledge; passing its bytes as they are");
                        self.state = State::Passthrough;
                    } else if n < PREFACE.len() {
                        return Ok(());
                    } else {
                        out.extend_from_slice(&self.input.split_to(n));
                        self.state = State::Frames;
                    }
                }
                State::Payload(remaining) => {
                    if self.input.is_empty() {
                        return Ok(());
                    }
                    let n = remaining.min(self.input.len());
                    out.extend_from_slice(&self.input.split_to(n));
                    self.state = if n == remaining {
                        State::Frames
                    } else {
                        State::Payload(remaining - n)
                    };
                }
                State::Frames => {
                    let Some(head) = FrameHead::parse(&self.input) else {
                        return Ok(());
                    };
                    match self.frame(&head, out) {
                        Ok(true) => {}
                        // A header frame not yet complete.
                        Ok(false) => return Ok(()),
                        Err(err) => self.give_up(err, out)?,
                    }
                }
            }
        }
    }

    /// Handles the frame whose header starts `input`: passes it on, or
    /// collects it into the header block once it is complete. False when it
    /// is a header frame still incomplete. On an error, what was not sent on
    /// is still in `input` or the held block, for [`Rewriter::give_up`].
    fn frame(&mut self, head: &FrameHead, out: &mut BytesMut) -> Result<bool, AuthorityError> {
        if let Some(block) = &self.block {
            if head.kind != CONTINUATION || head.stream != block.stream {
                return Err(AuthorityError::Interleaved {
                    kind: head.kind,
                    stream: head.stream,
                    block: block.stream,
                });
            }
        } else if head.kind != HEADERS {
            // Everything else, a stray CONTINUATION included (h2 refuses it).
            out.extend_from_slice(&self.input.split_to(FRAME_HEAD));
            if head.len > 0 {
                self.state = State::Payload(head.len);
            }
            return Ok(true);
        }
        let collected = self.block.as_ref().map_or(0, |b| b.raw.len());
        if collected + FRAME_HEAD + head.len > MAX_BLOCK {
            return Err(AuthorityError::TooLarge {
                stream: head.stream,
            });
        }
        let Some(payload) = self.input.get(FRAME_HEAD..FRAME_HEAD + head.len) else {
            return Ok(false);
        };
        match self.block.as_mut() {
            Some(block) => block.fragment.extend_from_slice(payload),
            None => {
                let (fragment, priority) = headers_payload(head, payload)?;
                self.block = Some(Block {
                    stream: head.stream,
                    end_stream: head.flags & END_STREAM != 0,
                    priority,
                    raw: Vec::new(),
                    fragment: fragment.to_vec(),
                });
            }
        }
        let frame = self.input.split_to(FRAME_HEAD + head.len);
        if let Some(block) = self.block.as_mut() {
            block.raw.extend_from_slice(&frame);
        }
        if head.flags & END_HEADERS != 0 {
            if let Some(block) = self.block.take() {
                self.finish(block, out)?;
            }
        }
        Ok(true)
    }

    /// Sends on a complete header block, rewritten if it (or an earlier
    /// one) needed it.
    fn finish(&mut self, block: Block, out: &mut BytesMut) -> Result<(), AuthorityError> {
        let stream = block.stream;
        let mut fields: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut size = 0usize;
        let mut refused: Option<Vec<u8>> = None;
        let decoded = self.decoder.decode_with_cb(&block.fragment, |name, value| {
            size = size.saturating_add(name.len() + value.len() + 32);
            if size > MAX_BLOCK {
                return;
            }
            let value = if &*name == AUTHORITY && http::uri::Authority::try_from(&*value).is_err() {
                refused = Some(value.into_owned());
                Cow::Borrowed(REPLACEMENT)
            } else {
                value
            };
            fields.push((name.into_owned(), value.into_owned()));
        });
        if let Err(source) = decoded {
            // Give the block back so that, unless a rewrite happened before,
            // the server judges it itself.
            self.block = Some(block);
            return Err(AuthorityError::Hpack { stream, source });
        }
        if size > MAX_BLOCK {
            self.block = Some(block);
            return Err(AuthorityError::TooLarge { stream });
        }
        if let Some(value) = &refused {
            if !self.reencode {
                debug!(
                    stream,
                    authority = %String::from_utf8_lossy(value),
                    "client sent an :authority h2 refuses; serving it as localhost"
                );
            }
            self.reencode = true;
        }
        if !self.reencode {
            out.extend_from_slice(&block.raw);
            return Ok(());
        }
        let encoded =
            encode(&fields).map_err(|source| AuthorityError::Encode { stream, source })?;
        write_block(&block, &encoded, out);
        Ok(())
    }

    /// Before any rewrite the server's HPACK state still matches the
    /// client's: send on what is held and stop following, so that the server
    /// answers whatever this is. After one, the connection cannot go on.
    fn give_up(&mut self, err: AuthorityError, out: &mut BytesMut) -> Result<(), AuthorityError> {
        if self.reencode {
            return Err(err);
        }
        debug!(err = %chain(&err), "cannot follow the client's HTTP/2 stream; passing its bytes as they are");
        if let Some(block) = self.block.take() {
            out.extend_from_slice(&block.raw);
        }
        self.state = State::Passthrough;
        Ok(())
    }
}

/// Splits a HEADERS payload into its header block fragment and priority.
fn headers_payload<'a>(
    head: &FrameHead,
    payload: &'a [u8],
) -> Result<(&'a [u8], Option<[u8; 5]>), AuthorityError> {
    let mut start = 0;
    let mut pad = 0;
    if head.flags & PADDED != 0 {
        // An empty payload cannot hold its pad length.
        pad = payload.first().map_or(usize::MAX, |&p| usize::from(p));
        start = 1;
    }
    let mut priority = None;
    if head.flags & PRIORITY != 0 {
        priority = payload
            .get(start..start + 5)
            .and_then(|p| <[u8; 5]>::try_from(p).ok());
        start += 5;
    }
    payload
        .len()
        .checked_sub(pad)
        .and_then(|end| payload.get(start..end))
        .map(|fragment| (fragment, priority))
        .ok_or(AuthorityError::Padding {
            stream: head.stream,
            overhead: start.saturating_add(pad),
            len: payload.len(),
        })
}

/// Every field as a literal without indexing with a literal name (RFC 7541
/// §6.2.2): the server's dynamic table is neither read nor changed.
fn encode(fields: &[(Vec<u8>, Vec<u8>)]) -> io::Result<Vec<u8>> {
    let mut encoded = Vec::new();
    for (name, value) in fields {
        encoded.push(0);
        for string in [name, value] {
            encode_integer_into(string.len(), 7, 0, &mut encoded)?;
            encoded.extend_from_slice(string);
        }
    }
    Ok(encoded)
}

/// The block's HEADERS frame (its END_STREAM and priority kept, padding
/// dropped) and CONTINUATION frames, none over [`MAX_FRAME`].
fn write_block(block: &Block, encoded: &[u8], out: &mut BytesMut) {
    let priority: &[u8] = block.priority.as_ref().map_or(&[], |p| p);
    let (first, rest) = encoded.split_at(encoded.len().min(MAX_FRAME - priority.len()));
    let mut flags = 0;
    if block.end_stream {
        flags |= END_STREAM;
    }
    if !priority.is_empty() {
        flags |= PRIORITY;
    }
    if rest.is_empty() {
        flags |= END_HEADERS;
    }
    frame_head(
        out,
        priority.len() + first.len(),
        HEADERS,
        flags,
        block.stream,
    );
    out.extend_from_slice(priority);
    out.extend_from_slice(first);
    let mut chunks = rest.chunks(MAX_FRAME).peekable();
    while let Some(chunk) = chunks.next() {
        let flags = if chunks.peek().is_none() {
            END_HEADERS
        } else {
            0
        };
        frame_head(out, chunk.len(), CONTINUATION, flags, block.stream);
        out.extend_from_slice(chunk);
    }
}

fn frame_head(out: &mut BytesMut, len: usize, kind: u8, flags: u8, stream: u32) {
    // len <= MAX_FRAME, so it fits the 24-bit length.
    let len = u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes();
    out.extend_from_slice(&len[1..]);
    out.extend_from_slice(&[kind, flags]);
    out.extend_from_slice(&stream.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = "/var/lib/kubelet/device-plugins/gpumem.sock";
    const DATA: u8 = 0x0;
    const SETTINGS: u8 = 0x4;

    fn string(dst: &mut Vec<u8>, s: &[u8]) {
        encode_integer_into(s.len(), 7, 0, dst).unwrap();
        dst.extend_from_slice(s);
    }

    /// A literal field with a literal name, without (0x00) or with (0x40)
    /// incremental indexing.
    fn literal(prefix: u8, name: &str, value: &str) -> Vec<u8> {
        let mut out = vec![prefix];
        string(&mut out, name.as_bytes());
        string(&mut out, value.as_bytes());
        out
    }

    fn lit(name: &str, value: &str) -> Vec<u8> {
        literal(0x00, name, value)
    }

    fn lit_indexed(name: &str, value: &str) -> Vec<u8> {
        literal(0x40, name, value)
    }

    fn indexed(index: u8) -> Vec<u8> {
        vec![0x80 | index]
    }

    /// A gRPC request's fields around `authority` (static-table entries for
    /// :method POST and :scheme http, as grpc-go sends them).
    fn request(authority: Vec<u8>) -> Vec<u8> {
        [
            indexed(3),
            indexed(6),
            lit(":path", "/v1beta1.DevicePlugin/GetDevicePluginOptions"),
            authority,
            lit("content-type", "application/grpc"),
            lit("te", "trailers"),
        ]
        .concat()
    }

    fn expected(authority: &str) -> Fields {
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/v1beta1.DevicePlugin/GetDevicePluginOptions"),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .to_vec()
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        frame_head(&mut out, payload.len(), kind, flags, stream);
        out.extend_from_slice(payload);
        out.to_vec()
    }

    fn headers(stream: u32, block: &[u8]) -> Vec<u8> {
        frame(HEADERS, END_HEADERS, stream, block)
    }

    /// The empty gRPC message that GetDevicePluginOptions takes.
    fn data(stream: u32) -> Vec<u8> {
        frame(DATA, END_STREAM, stream, &[0; 5])
    }

    fn connection(frames: &[Vec<u8>]) -> Vec<u8> {
        let mut out = PREFACE.to_vec();
        out.extend(frame(SETTINGS, 0, 0, &[]));
        for f in frames {
            out.extend_from_slice(f);
        }
        out
    }

    /// Feeds `input` in pieces of `piece` bytes.
    fn rewrite_in(input: &[u8], piece: usize) -> Result<Vec<u8>, AuthorityError> {
        let mut rewriter = Rewriter::new();
        let mut out = BytesMut::new();
        for chunk in input.chunks(piece) {
            rewriter.feed(chunk, &mut out)?;
        }
        Ok(out.to_vec())
    }

    fn rewrite(input: &[u8]) -> Vec<u8> {
        rewrite_in(input, input.len().max(1)).unwrap()
    }

    type Fields = Vec<(String, String)>;

    #[derive(Debug, PartialEq)]
    struct Seen {
        /// Each header block: stream, HEADERS flags, fields.
        blocks: Vec<(u32, u8, Fields)>,
        /// Every other frame: type, stream, payload.
        others: Vec<(u8, u32, Vec<u8>)>,
    }

    /// What h2 sees in `bytes`: one HPACK decoder for the connection, as the
    /// server has. Checks every frame's size and the CONTINUATION rules.
    fn server_view(bytes: &[u8]) -> Seen {
        let mut rest = bytes.strip_prefix(PREFACE).expect("preface first");
        let mut decoder = Decoder::new();
        let mut seen = Seen {
            blocks: vec![],
            others: vec![],
        };
        let mut open: Option<(u32, u8, Vec<u8>)> = None;
        while !rest.is_empty() {
            let head = FrameHead::parse(rest).expect("whole frame header");
            assert!(head.len <= MAX_FRAME, "frame of {} bytes", head.len);
            let payload = &rest[FRAME_HEAD..FRAME_HEAD + head.len];
            rest = &rest[FRAME_HEAD + head.len..];
            let fragment = match (head.kind, open.as_mut()) {
                (HEADERS, None) => {
                    let (fragment, _) = headers_payload(&head, payload).unwrap();
                    open = Some((head.stream, head.flags, vec![]));
                    fragment
                }
                (CONTINUATION, Some((stream, _, _))) if *stream == head.stream => payload,
                (_, None) => {
                    seen.others.push((head.kind, head.stream, payload.to_vec()));
                    continue;
                }
                _ => panic!("frame type {} inside a header block", head.kind),
            };
            let block = open.as_mut().unwrap();
            block.2.extend_from_slice(fragment);
            if head.flags & END_HEADERS != 0 {
                let (stream, flags, block) = open.take().unwrap();
                let fields = decoder
                    .decode(&block)
                    .unwrap()
                    .into_iter()
                    .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                    .collect();
                seen.blocks.push((stream, flags, fields));
            }
        }
        assert!(open.is_none(), "header block left open");
        seen
    }

    fn fields_of(seen: &Seen) -> Vec<Fields> {
        seen.blocks.iter().map(|b| b.2.clone()).collect()
    }

    #[test]
    fn valid_authorities_pass_byte_for_byte() {
        // RFC 7541 C.4.1: GET http://www.example.com/, the authority
        // Huffman-coded and indexed.
        let rfc = vec![
            0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab,
            0x90, 0xf4, 0xff,
        ];
        let input = connection(&[
            headers(1, &request(lit(":authority", "localhost"))),
            data(1),
            headers(3, &rfc),
            headers(5, &request(lit(":authority", "[::1]:50051"))),
            // The client's table entry 62 is www.example.com.
            headers(7, &request(indexed(62))),
        ]);
        let output = rewrite(&input);
        assert_eq!(output, input);
        let seen = server_view(&output);
        assert_eq!(seen.blocks[1].2[3].1, "www.example.com");
        assert_eq!(seen.blocks[3].2[3].1, "www.example.com");
    }

    #[test]
    fn a_socket_path_authority_becomes_localhost() {
        let encoded = PATH.replace('/', "%2F");
        let input = connection(&[
            headers(1, &request(lit(":authority", PATH))),
            data(1),
            frame(
                HEADERS,
                END_HEADERS | END_STREAM,
                3,
                &request(lit(":authority", &encoded)),
            ),
            // The plugin watcher's grpc-go sends the path without its first slash.
            headers(5, &request(lit(":authority", &PATH[1..]))),
            data(5),
        ]);
        let seen = server_view(&rewrite(&input));
        assert_eq!(fields_of(&seen), vec![expected("localhost"); 3]);
        assert_eq!(seen.blocks[0].1, END_HEADERS);
        assert_eq!(
            seen.blocks[1].1,
            END_HEADERS | END_STREAM,
            "END_STREAM kept"
        );
        assert_eq!(
            seen.others,
            vec![
                (SETTINGS, 0, vec![]),
                (DATA, 1, vec![0; 5]),
                (DATA, 5, vec![0; 5])
            ]
        );
    }

    #[test]
    fn a_header_block_split_across_continuation_frames() {
        let block = request(lit(":authority", PATH));
        // The authority straddles both boundaries.
        let (a, rest) = block.split_at(50);
        let (b, c) = rest.split_at(30);
        let input = connection(&[
            frame(HEADERS, END_STREAM, 1, a),
            frame(CONTINUATION, 0, 1, b),
            frame(CONTINUATION, END_HEADERS, 1, c),
            frame(HEADERS, 0, 3, &request(lit(":authority", "localhost"))),
            frame(CONTINUATION, END_HEADERS, 3, &[]),
        ]);
        let seen = server_view(&rewrite(&input));
        assert_eq!(
            fields_of(&seen),
            vec![expected("localhost"), expected("localhost")]
        );
        assert_eq!(seen.blocks[0].1 & END_STREAM, END_STREAM);
    }

    #[test]
    fn padding_and_priority_are_read_and_padding_dropped() {
        let block = request(lit(":authority", PATH));
        let priority = [0x80, 0, 0, 0x01, 0x0f];
        let pad = 7u8;
        let payload = [&[pad][..], &priority, &block, &[0; 7]].concat();
        let input = connection(&[
            frame(HEADERS, END_HEADERS | PADDED | PRIORITY, 1, &payload),
            data(1),
        ]);
        let output = rewrite(&input);
        let seen = server_view(&output);
        assert_eq!(fields_of(&seen), vec![expected("localhost")]);
        assert_eq!(seen.blocks[0].1, END_HEADERS | PRIORITY);
        let headers_at = PREFACE.len() + FRAME_HEAD;
        let head = FrameHead::parse(&output[headers_at..]).unwrap();
        assert_eq!(
            &output[headers_at + FRAME_HEAD..][..5],
            &priority,
            "priority kept"
        );
        assert_eq!(head.len, 5 + seen_len(&seen), "no padding");

        // A valid authority with padding passes as it is.
        let valid = [
            &[pad][..],
            &request(lit(":authority", "localhost")),
            &[0; 7],
        ]
        .concat();
        let input = connection(&[frame(HEADERS, END_HEADERS | PADDED, 1, &valid)]);
        assert_eq!(rewrite(&input), input);
    }

    /// The re-encoded block's length: a literal per field.
    fn seen_len(seen: &Seen) -> usize {
        let fields: Vec<_> = seen.blocks[0]
            .2
            .iter()
            .map(|(n, v)| (n.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect();
        encode(&fields).unwrap().len()
    }

    #[test]
    fn later_requests_refer_to_the_clients_table() {
        // As grpc-go does: the authority and a custom field are indexed by
        // the first request and referred to by index afterwards.
        let first = [
            indexed(3),
            indexed(6),
            lit(":path", "/v1beta1.DevicePlugin/GetDevicePluginOptions"),
            lit_indexed(":authority", PATH),
            lit_indexed("x-trace", "abc"),
        ]
        .concat();
        // Newest first: 62 is x-trace, 63 the authority.
        let second = [
            indexed(3),
            indexed(6),
            lit(":path", "/v1beta1.DevicePlugin/ListAndWatch"),
            indexed(63),
            indexed(62),
        ]
        .concat();
        let input = connection(&[headers(1, &first), headers(3, &second), headers(5, &second)]);
        let seen = server_view(&rewrite(&input));
        let authority = |i: usize| seen.blocks[i].2[3].clone();
        let trace = |i: usize| seen.blocks[i].2[4].clone();
        for i in 0..3 {
            assert_eq!(authority(i), (":authority".into(), "localhost".into()));
            assert_eq!(trace(i), ("x-trace".into(), "abc".into()));
        }
    }

    #[test]
    fn a_rewrite_after_byte_for_byte_blocks_keeps_both_tables_right() {
        // The first block passes as it is, so the server's table holds its
        // entries; after the rewrite the server's table is no longer used.
        let first = [
            indexed(3),
            lit_indexed(":authority", "localhost"),
            lit_indexed("x-a", "1"),
        ]
        .concat();
        let second = [
            indexed(3),
            lit_indexed(":authority", PATH),
            indexed(62 + 1),
            lit_indexed("x-b", "2"),
        ]
        .concat();
        // The client's table is now x-b, the path, x-a, localhost (62 to
        // 65); the server's holds x-a and localhost only. A block with a
        // valid authority after the rewrite still refers to the client's.
        let third = [indexed(3), indexed(65), indexed(62), indexed(64)].concat();
        let first_frame = headers(1, &first);
        let input = connection(&[first_frame.clone(), headers(3, &second), headers(5, &third)]);
        let output = rewrite(&input);
        let prefix = connection(&[first_frame]);
        assert_eq!(output[..prefix.len()], prefix[..], "first block as sent");
        let seen = server_view(&output);
        let pairs = |v: &[(&str, &str)]| -> Fields {
            v.iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            fields_of(&seen),
            vec![
                pairs(&[
                    (":method", "POST"),
                    (":authority", "localhost"),
                    ("x-a", "1")
                ]),
                pairs(&[
                    (":method", "POST"),
                    (":authority", "localhost"),
                    ("x-a", "1"),
                    ("x-b", "2")
                ]),
                pairs(&[
                    (":method", "POST"),
                    (":authority", "localhost"),
                    ("x-b", "2"),
                    ("x-a", "1")
                ]),
            ]
        );
    }

    #[test]
    fn any_split_of_the_input_gives_the_same_output() {
        let padded = [
            &[3u8][..],
            &[0, 0, 0, 0, 16],
            &request(lit_indexed(":authority", PATH)),
            &[0; 3],
        ]
        .concat();
        let continued = request(indexed(62));
        let input = connection(&[
            frame(HEADERS, END_HEADERS | PADDED | PRIORITY, 1, &padded),
            data(1),
            frame(HEADERS, 0, 3, &continued[..10]),
            frame(CONTINUATION, 0, 3, &continued[10..20]),
            frame(CONTINUATION, END_HEADERS, 3, &continued[20..]),
            data(3),
            frame(0x8, 0, 0, &[0, 0, 1, 0]),
        ]);
        let whole = rewrite(&input);
        let seen = server_view(&whole);
        assert_eq!(
            fields_of(&seen),
            vec![expected("localhost"), expected("localhost")]
        );
        assert_eq!(seen.others.len(), 4, "settings, 2 data, window update");
        for piece in 1..input.len() {
            assert_eq!(
                rewrite_in(&input, piece).unwrap(),
                whole,
                "pieces of {piece}"
            );
        }
    }

    #[test]
    fn a_large_rewritten_block_is_split_at_the_frame_limit() {
        let big = "v".repeat(40_000);
        let block = [request(lit(":authority", PATH)), lit("x-big", &big)].concat();
        let mut frames = vec![];
        let chunks: Vec<_> = block.chunks(MAX_FRAME).collect();
        for (i, chunk) in chunks.iter().enumerate() {
            let kind = if i == 0 { HEADERS } else { CONTINUATION };
            let flags = if i + 1 == chunks.len() {
                END_HEADERS
            } else {
                0
            };
            frames.push(frame(kind, flags, 1, chunk));
        }
        // server_view checks every frame's size.
        let seen = server_view(&rewrite(&connection(&frames)));
        let fields = &seen.blocks[0].2;
        assert_eq!(fields[3].1, "localhost");
        assert_eq!(fields[6], ("x-big".into(), big));
    }

    #[test]
    fn what_cannot_be_followed_passes_as_it_is_before_any_rewrite() {
        let http1 = b"GET / HTTP/1.1\r\nHost: /tmp/x.sock\r\n\r\n".to_vec();
        let interleaved = connection(&[
            frame(HEADERS, 0, 1, &request(lit(":authority", PATH))),
            data(1),
        ]);
        let bad_padding = connection(&[frame(HEADERS, END_HEADERS | PADDED, 1, &[200, 0x82])]);
        let bad_index = connection(&[
            headers(1, &indexed(100)),
            headers(3, &request(lit(":authority", PATH))),
        ]);
        let too_large = connection(&[frame(HEADERS, END_HEADERS, 1, &vec![0x82; MAX_BLOCK])]);
        for input in [http1, interleaved, bad_padding, bad_index, too_large] {
            assert_eq!(rewrite(&input), input);
            assert_eq!(rewrite_in(&input, 5).unwrap(), input);
        }
    }

    #[test]
    fn what_cannot_be_followed_after_a_rewrite_is_an_error() {
        let rewritten = headers(1, &request(lit(":authority", PATH)));
        for (bad, want) in [
            (
                vec![frame(HEADERS, 0, 3, &indexed(2)), data(3)],
                "inside the header block",
            ),
            (vec![headers(3, &indexed(100))], "does not decode"),
            (
                vec![frame(HEADERS, END_HEADERS | PADDED, 3, &[9])],
                "padding",
            ),
            (
                vec![frame(HEADERS, END_HEADERS, 3, &vec![0x82; MAX_BLOCK])],
                "is over",
            ),
            (
                // Every field counts 32 bytes more than its name and value.
                vec![headers(3, &vec![0x82; MAX_BLOCK / 40])],
                "is over",
            ),
        ] {
            let input = connection(&[vec![rewritten.clone()], bad].concat());
            let err = rewrite_in(&input, 7).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn garbage_never_panics() {
        // A fixed xorshift: the same inputs every run.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let valid = connection(&[
            frame(
                HEADERS,
                END_HEADERS | PADDED | PRIORITY,
                1,
                &[
                    &[2u8, 0, 0, 0, 0, 1][..],
                    &request(lit_indexed(":authority", PATH)),
                    &[0, 0],
                ]
                .concat(),
            ),
            data(1),
            headers(3, &request(indexed(62))),
        ]);
        for _ in 0..3000 {
            let mut input = valid.clone();
            for _ in 0..1 + next() % 4 {
                let at = PREFACE.len() + (next() as usize) % (input.len() - PREFACE.len());
                input[at] = next() as u8;
            }
            let piece = 1 + (next() as usize) % 40;
            let _ = rewrite_in(&input, piece);
        }
    }

    #[tokio::test]
    async fn the_connection_hands_over_rewritten_bytes_in_any_read_size() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let input = connection(&[
            headers(1, &request(lit_indexed(":authority", PATH))),
            data(1),
            headers(3, &request(indexed(62))),
        ]);
        let expected = rewrite(&input);
        let (mut client, server) = tokio::net::UnixStream::pair().unwrap();
        let mut server = LenientAuthority::new(server);
        let sent = input.clone();
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(5) {
                client.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
            // Writes from the server pass through untouched.
            let mut reply = [0; 4];
            client.read_exact(&mut reply).await.unwrap();
            client.shutdown().await.unwrap();
            reply
        });
        let mut got = vec![];
        let mut buf = [0; 3];
        loop {
            let n = server.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&buf[..n]);
            if got.len() == expected.len() {
                server.write_all(b"pong").await.unwrap();
            }
        }
        assert_eq!(got, expected);
        assert_eq!(&writer.await.unwrap(), b"pong");
    }

    #[tokio::test]
    async fn the_connection_fails_after_what_it_could_rewrite() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let good = connection(&[headers(1, &request(lit(":authority", PATH)))]);
        let input = [good.clone(), headers(3, &indexed(100))].concat();
        let (mut client, server) = tokio::net::UnixStream::pair().unwrap();
        client.write_all(&input).await.unwrap();
        let mut server = LenientAuthority::new(server);
        let mut got = vec![];
        let err = server.read_to_end(&mut got).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(got, rewrite(&good));
        let again = server.read(&mut [0; 8]).await.unwrap_err();
        assert_eq!(again.kind(), io::ErrorKind::InvalidData);
    }
}
