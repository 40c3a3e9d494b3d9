//! The `#` of an HTTP/1 request target, which kube-apiserver keeps and hyper drops.
//!
//! Go's server reads a request target with `url.ParseRequestURI`, which keeps a `#` as a
//! character of the path or query: `/api/v1/namespaces/d/configmaps/cm-1#x` is the object
//! `cm-1#x` (404 NotFound), `?limit=1#x` a 400. The `http` crate hyper parses requests with
//! truncates the target at its first `#` (`PathAndQuery::from_shared`), before any handler
//! sees it, so the proxy would serve `cm-1`. Clients do not send a fragment (RFC 9110 leaves
//! it out of the target; client-go and kubectl never send one): only a hand-written request
//! has one, and it is answered as the apiserver answers it.
//!
//! [`Scanned`] reads a connection's bytes as they arrive and remembers each HTTP/1 request
//! line whose target holds a `#` ([`Targets`]; nothing is kept or allocated for a connection
//! that never sends one). When hyper hands over a request whose method and target are such a
//! line's with the `#` and what follows cut off, [`Targets::restore`] gives the target the
//! client wrote with every `#` encoded as `%23`, which Go's decoded path and query read the
//! same as the raw `#`: routing, authorization, the cache and the request passed through to
//! the apiserver all see what the apiserver would have. Lines are matched in the order they
//! came, and one found for a request drops the older ones.
//!
//! Limits: a request line longer than 16 KiB split across reads of the socket is not seen
//! (the request is served without the fragment, as before); a line inside a request body that looks like a
//! request line with a `#` can only be taken for a later request of the same connection with
//! the same method and target, which only that client can send. HTTP/2 (its preface opens
//! the connection) is not scanned: its `:path` is HPACK-encoded, and the same `#` is dropped.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Request lines with a `#` a connection holds at most, oldest dropped first.
const MAX_PENDING: usize = 8;

/// The longest request line carried from one read to the next.
const MAX_LINE: usize = 16 * 1024;

/// The HTTP/2 connection preface's start: a connection opening with it is not scanned.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

/// One connection's request lines with a `#` in their target, not yet matched to a request.
#[derive(Debug, Default)]
pub struct Targets {
    /// Whether `pending` holds anything: the per-request check without taking the lock.
    any: AtomicBool,
    /// (method, target as sent), in the order they arrived.
    pending: Mutex<VecDeque<(String, String)>>,
}

impl Targets {
    fn record(&self, method: &str, target: &str) {
        let mut p = self.pending.lock();
        if p.len() == MAX_PENDING {
            p.pop_front();
        }
        p.push_back((method.to_string(), target.to_string()));
        self.any.store(true, Ordering::Release);
    }

    /// The target the client sent for this request, `#` encoded as `%23`, when a request
    /// line with a `#` came for it (its method, and its target up to the first `#`, are the
    /// request's); `None` otherwise (the request stands as hyper parsed it).
    pub fn restore(&self, method: &http::Method, uri: &http::Uri) -> Option<http::Uri> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        let parsed = uri.path_and_query()?.as_str();
        let mut p = self.pending.lock();
        let i = p
            .iter()
            .position(|(m, t)| m == method.as_str() && t.split('#').next() == Some(parsed))?;
        let (_, target) = p.drain(..=i).next_back()?;
        if p.is_empty() {
            self.any.store(false, Ordering::Release);
        }
        target.replace('#', "%23").parse().ok()
    }
}

/// `METHOD SP target SP HTTP/1.x` with a `#` in an origin-form target: (method, target).
fn request_line(line: &[u8]) -> Option<(&str, &str)> {
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    let token =
        !method.is_empty() && method.len() <= 16 && method.bytes().all(|b| b.is_ascii_uppercase());
    (parts.next().is_none()
        && token
        && target.starts_with('/')
        && target.contains('#')
        && (version == "HTTP/1.1" || version == "HTTP/1.0"))
        .then_some((method, target))
}

/// A connection's reading side with its HTTP/1 request lines watched for a `#` (see the
/// module docs); writes go straight through.
#[derive(Debug)]
pub struct Scanned<IO> {
    io: IO,
    targets: std::sync::Arc<Targets>,
    /// Bytes of the HTTP/2 preface matched at the connection's start so far; `None` once
    /// decided: scanning (an HTTP/1 connection) or `off` (HTTP/2).
    preface: Option<usize>,
    off: bool,
    /// Whether the next byte read starts a line (the connection's first byte does).
    at_line_start: bool,
    /// A line begun in an earlier read that may be a request line (its bytes so far, at most
    /// [`MAX_LINE`]): hyper-util reads a connection's first bytes apart to tell HTTP/2 from
    /// HTTP/1, and a read may end anywhere.
    carry: Option<Vec<u8>>,
}

impl<IO> Scanned<IO> {
    pub fn new(io: IO, targets: std::sync::Arc<Targets>) -> Scanned<IO> {
        Scanned {
            io,
            targets,
            preface: Some(0),
            off: false,
            at_line_start: true,
            carry: None,
        }
    }

    fn scan(&mut self, chunk: &[u8]) {
        if chunk.is_empty() || self.off {
            return;
        }
        if let Some(matched) = self.preface {
            let n = (H2_PREFACE.len() - matched).min(chunk.len());
            if chunk[..n] == H2_PREFACE[matched..matched + n] {
                if matched + n == H2_PREFACE.len() {
                    self.off = true;
                    self.carry = None;
                    return;
                }
                self.preface = Some(matched + n);
            } else {
                self.preface = None;
            }
        }
        let mut rest = chunk;
        // Whether `rest` starts a line.
        let mut line_start = self.at_line_start;
        // A request line begun in an earlier read: completed, or carried further.
        if let Some(mut carry) = self.carry.take() {
            let Some(nl) = memchr::memchr(b'\n', rest) else {
                carry.extend_from_slice(rest);
                if carry.len() <= MAX_LINE && looks_like_request_line(&carry) {
                    self.carry = Some(carry);
                }
                self.at_line_start = false;
                return;
            };
            carry.extend_from_slice(&rest[..nl]);
            self.check_line(&carry);
            rest = &rest[nl + 1..];
            line_start = true;
        }
        // Whole lines of this read with a `#`.
        let mut from = 0;
        while let Some(p) = memchr::memchr(b'#', &rest[from..]) {
            let hash = from + p;
            let Some(e) = memchr::memchr(b'\n', &rest[hash..]) else {
                break;
            };
            let end = hash + e;
            let start = match memchr::memrchr(b'\n', &rest[..hash]) {
                Some(nl) => Some(nl + 1),
                None => line_start.then_some(0),
            };
            if let Some(start) = start {
                self.check_line(&rest[start..end]);
            }
            // The rest of this line is the same line.
            from = end;
        }
        // A line this read ends inside of, when it may be a request line.
        let tail = match memchr::memrchr(b'\n', rest) {
            Some(nl) => Some(&rest[nl + 1..]),
            None => line_start.then_some(rest),
        };
        if let Some(tail) = tail
            && !tail.is_empty()
            && tail.len() <= MAX_LINE
            && looks_like_request_line(tail)
        {
            self.carry = Some(tail.to_vec());
        }
        self.at_line_start = match rest.last() {
            Some(b) => *b == b'\n',
            None => line_start,
        };
    }

    /// Records `line` (its `\r\n` or `\n` cut off before) if it is a request line with a `#`.
    fn check_line(&self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some((method, target)) = request_line(line) {
            self.targets.record(method, target);
        }
    }
}

/// Whether `p`, the start of a line, can be the start of a request line: a method (up to
/// 16 upper-case letters), a space, and a `/`, as far as `p` goes. A body's lines (JSON,
/// YAML, protobuf) are not carried from one read to the next.
fn looks_like_request_line(p: &[u8]) -> bool {
    let method = p.iter().position(|b| *b == b' ').unwrap_or(p.len());
    method <= 16
        && p[..method].iter().all(u8::is_ascii_uppercase)
        && p.get(method + 1).is_none_or(|b| *b == b'/')
        && (method > 0 || p.is_empty())
}

impl<IO: AsyncRead + Unpin> AsyncRead for Scanned<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &r {
            this.scan(&buf.filled()[before..]);
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Scanned<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, data)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn scanned(chunks: &[&[u8]]) -> Arc<Targets> {
        let t = Arc::new(Targets::default());
        let mut s = Scanned::new((), t.clone());
        for c in chunks {
            s.scan(c);
        }
        t
    }

    fn restore(t: &Targets, method: &str, target: &str) -> Option<String> {
        let uri: http::Uri = target.parse().unwrap();
        t.restore(&method.parse().unwrap(), &uri)
            .map(|u| u.to_string())
    }

    #[test]
    fn a_target_with_a_hash_is_restored_with_it_encoded() {
        let t =
            scanned(&[b"GET /api/v1/namespaces/d/configmaps/cm-1#x HTTP/1.1\r\nHost: a\r\n\r\n"]);
        // hyper hands the request over with the target cut at the `#`.
        let cut: http::Uri = "/api/v1/namespaces/d/configmaps/cm-1#x".parse().unwrap();
        assert_eq!(cut.to_string(), "/api/v1/namespaces/d/configmaps/cm-1");
        assert_eq!(
            restore(&t, "POST", "/api/v1/namespaces/d/configmaps/cm-1"),
            None
        );
        assert_eq!(
            restore(&t, "GET", "/api/v1/namespaces/d/configmaps/cm-1").as_deref(),
            Some("/api/v1/namespaces/d/configmaps/cm-1%23x")
        );
        // Used once.
        assert_eq!(
            restore(&t, "GET", "/api/v1/namespaces/d/configmaps/cm-1"),
            None
        );
        // In the query too, every `#`.
        let t = scanned(&[b"GET /a?limit=1#x#y HTTP/1.1\r\n\r\n"]);
        assert_eq!(
            restore(&t, "GET", "/a?limit=1").as_deref(),
            Some("/a?limit=1%23x%23y")
        );
    }

    #[test]
    fn requests_on_one_connection_are_matched_in_order() {
        let t = scanned(&[
            b"GET /a#1 HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\n\r\n",
            b"GET /a#2 HTTP/1.1\r\n\r\n",
        ]);
        assert_eq!(restore(&t, "GET", "/a").as_deref(), Some("/a%231"));
        assert_eq!(restore(&t, "GET", "/b"), None);
        assert_eq!(restore(&t, "GET", "/a").as_deref(), Some("/a%232"));
        assert!(!t.any.load(Ordering::Acquire));
    }

    #[test]
    fn only_whole_request_lines_of_http1_count() {
        // A `#` in a header, a body, a line cut by the end of a read, not at a line start.
        let t = scanned(&[
            b"GET /a HTTP/1.1\r\nX-Note: GET /a#x HTTP/1.1\r\n\r\n",
            b"{\"k\": \"a # b\"}",
            b"GET /c#x HTTP/1.",
            b"1\r\n",
        ]);
        assert_eq!(restore(&t, "GET", "/a"), None);
        assert_eq!(restore(&t, "GET", "/c"), None);
        // A request line split across reads (hyper-util reads a connection's first bytes
        // apart), even between its `\r` and `\n`: seen once.
        let t = scanned(&[
            b"GET /api/v1/namespaces/n",
            b"s1/configmaps/cm-1#x HTTP/1.1\r",
            b"\nHost: a\r\n\r\n",
        ]);
        assert_eq!(t.pending.lock().len(), 1);
        assert_eq!(
            restore(&t, "GET", "/api/v1/namespaces/ns1/configmaps/cm-1").as_deref(),
            Some("/api/v1/namespaces/ns1/configmaps/cm-1%23x")
        );
        // A body's line is not carried.
        let mut s = Scanned::new((), Arc::new(Targets::default()));
        s.scan(b"PUT /a HTTP/1.1\r\n\r\n");
        s.scan(b"{\"data\": ");
        assert!(s.carry.is_none());
        // A line whose start ended the previous read is a line.
        let t = scanned(&[b"GET /a HTTP/1.1\r\n\r\n", b"GET /d#x HTTP/1.1\r\n"]);
        assert_eq!(restore(&t, "GET", "/d").as_deref(), Some("/d%23x"));
        // HTTP/2 (its preface, even cut across reads) is not scanned.
        let t = scanned(&[
            b"PRI * HT",
            b"TP/2.0\r\n\r\nSM\r\n\r\n",
            b"\nGET /e#x HTTP/1.1\r\n",
        ]);
        assert_eq!(restore(&t, "GET", "/e"), None);
        // At most MAX_PENDING lines are kept.
        let many: Vec<Vec<u8>> = (0..MAX_PENDING + 2)
            .map(|i| format!("GET /f#{i} HTTP/1.1\r\n\r\n").into_bytes())
            .collect();
        let t = scanned(&many.iter().map(Vec::as_slice).collect::<Vec<_>>());
        assert_eq!(t.pending.lock().len(), MAX_PENDING);
        assert_eq!(restore(&t, "GET", "/f").as_deref(), Some("/f%232"));
    }
}
