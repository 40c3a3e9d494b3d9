//! HTTP/2 over TLS to one target (the proxy or kube-apiserver), with explicit connections so a
//! scenario decides how many streams share one connection, and a line reader for watch bodies.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use bytes::{Bytes, BytesMut};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// One HTTP/2 connection; clones share it (one stream per request).
pub type Conn = SendRequest<Full<Bytes>>;

/// Where requests go and with which credential.
#[derive(Clone)]
pub struct Target {
    /// `proxy` or `apiserver`: the side in reports.
    pub side: &'static str,
    pub addr: SocketAddr,
    /// The server name: TLS SNI and certificate check, and the requests' authority.
    host: Arc<str>,
    tls: TlsConnector,
    token: Arc<str>,
}

impl Target {
    /// A target at `addr` whose serving certificate is signed by `ca_pem` and valid for
    /// `localhost` (both the apiserver's and the proxy's generated certificates are).
    pub fn new(side: &'static str, addr: SocketAddr, ca_pem: &str, token: &str) -> Target {
        let certs = CertificateDer::pem_slice_iter(ca_pem.as_bytes()).flatten();
        Target::with_roots(side, addr, "localhost", certs, token)
    }

    /// A target at `addr` (as [`Target::new`]) authenticated by a client certificate
    /// (`cert_pem`, `key_pem`: PEM, the key PKCS#8) instead of a bearer token: requests carry
    /// no `Authorization` header, as a kubelet's with its node certificate.
    pub fn with_client_cert(
        side: &'static str,
        addr: SocketAddr,
        ca_pem: &str,
        cert_pem: &str,
        key_pem: &str,
    ) -> anyhow::Result<Target> {
        use rustls_pki_types::PrivateKeyDer;
        kube_cache_proxy::http::tls::install_crypto_provider();
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(cert_pem.as_bytes()).collect::<Result<_, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())?;
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()).flatten() {
            let _ = roots.add(c);
        }
        let mut cfg = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Target {
            side,
            addr,
            host: "localhost".into(),
            tls: TlsConnector::from(Arc::new(cfg)),
            token: "".into(),
        })
    }

    /// The same server and TLS settings with another bearer token (e.g. a ServiceAccount's).
    pub fn with_token(&self, token: &str) -> Target {
        Target {
            token: token.into(),
            ..self.clone()
        }
    }

    fn with_roots(
        side: &'static str,
        addr: SocketAddr,
        host: &str,
        certs: impl IntoIterator<Item = CertificateDer<'static>>,
        token: &str,
    ) -> Target {
        kube_cache_proxy::http::tls::install_crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        for c in certs {
            let _ = roots.add(c);
        }
        let mut cfg = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Target {
            side,
            addr,
            host: host.into(),
            tls: TlsConnector::from(Arc::new(cfg)),
            token: token.into(),
        }
    }

    /// The server a kubeconfig names (its current context, or `context`), with its CA and
    /// bearer token (`token` or `tokenFile`). Exec plugins and client certificates are not
    /// supported: give the driver a token kubeconfig (e.g. from `kubectl create token`).
    pub async fn from_kubeconfig(
        side: &'static str,
        path: &Path,
        context: Option<&str>,
    ) -> anyhow::Result<Target> {
        use secrecy::ExposeSecret as _;
        let up = kube_cache_proxy::config::UpstreamConfig {
            kubeconfig: Some(path.to_owned()),
            context: context.map(String::from),
            ..Default::default()
        };
        let kc = kube_cache_proxy::upstream::load_kube_config(&up)
            .await
            .with_context(|| format!("{side}: reading {}", path.display()))?;
        let url = &kc.cluster_url;
        let host = url
            .host()
            .with_context(|| format!("{side}: {url} has no host"))?
            .trim_matches(['[', ']'])
            .to_string();
        let port = url.port_u16().unwrap_or(443);
        let addr = tokio::net::lookup_host((host.as_str(), port))
            .await
            .with_context(|| format!("{side}: resolving {host}"))?
            .next()
            .with_context(|| format!("{side}: {host} has no address"))?;
        let roots = kc.root_cert.clone().with_context(|| {
            format!(
                "{side}: {} names no certificate-authority(-data) (the driver does not load the \
                 system's roots)",
                path.display()
            )
        })?;
        let token = match (&kc.auth_info.token, &kc.auth_info.token_file) {
            (Some(t), _) => t.expose_secret().to_string(),
            (None, Some(f)) => std::fs::read_to_string(f)
                .with_context(|| format!("{side}: reading token file {f}"))?
                .trim()
                .to_string(),
            (None, None) => bail!(
                "{side}: {} has no bearer token (token or tokenFile); exec plugins and client \
                 certificates are not supported",
                path.display()
            ),
        };
        Ok(Target::with_roots(
            side,
            addr,
            &host,
            roots.into_iter().map(CertificateDer::from),
            &token,
        ))
    }

    /// Opens one TLS connection (ALPN h2), for a client of its own.
    pub async fn connect_tls(&self) -> anyhow::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let tcp = TcpStream::connect(self.addr)
            .await
            .with_context(|| format!("connecting to {} at {}", self.side, self.addr))?;
        tcp.set_nodelay(true)?;
        let name = ServerName::try_from(self.host.to_string())?;
        Ok(self.tls.connect(name, tcp).await?)
    }

    /// Opens one TLS + HTTP/2 connection.
    pub async fn connect(&self) -> anyhow::Result<Conn> {
        let tcp = TcpStream::connect(self.addr)
            .await
            .with_context(|| format!("connecting to {} at {}", self.side, self.addr))?;
        tcp.set_nodelay(true)?;
        let name = ServerName::try_from(self.host.to_string())?;
        let tls = self.tls.connect(name, tcp).await?;
        let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            // client-go's windows: Go's HTTP/2 transport defaults (4 MiB per stream, 1 GiB per
            // connection). Not hyper's adaptive windows, which start at 64 KiB: with a
            // connection window that small, h2's client (0.4.20) counts the server's split
            // DATA frames when hundreds of responses are written at once and closes the
            // connection with ENHANCE_YOUR_CALM (`too_many_data_frames`) — a client limit
            // client-go does not have, which made scenario d's strict row fail.
            .initial_stream_window_size(4 << 20)
            .initial_connection_window_size(1 << 30)
            .max_concurrent_reset_streams(10_000)
            .handshake(TokioIo::new(tls))
            .await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(send)
    }

    /// A request for `path_and_query` with this target's bearer token (none for a target
    /// with a client certificate).
    pub fn request(&self, method: Method, path: &str, body: Option<Bytes>) -> Request<Full<Bytes>> {
        let mut b = Request::builder()
            .method(method.clone())
            .uri(if self.host.contains(':') {
                format!("https://[{}]:{}{path}", self.host, self.addr.port())
            } else {
                format!("https://{}:{}{path}", self.host, self.addr.port())
            })
            .header("accept", "application/json");
        if !self.token.is_empty() {
            b = b.header("authorization", format!("Bearer {}", self.token));
        }
        if body.is_some() {
            let ct = if method == Method::PATCH {
                "application/merge-patch+json"
            } else {
                "application/json"
            };
            b = b.header("content-type", ct);
        }
        b.body(Full::new(body.unwrap_or_default()))
            .expect("static request parts")
    }
}

/// The `Accept` client-go sends with `ContentType: application/vnd.kubernetes.protobuf`.
pub const ACCEPT_PROTOBUF: &str = "application/vnd.kubernetes.protobuf, application/json";

/// `req` asking for `accept` instead of JSON.
pub fn with_accept(mut req: Request<Full<Bytes>>, accept: &'static str) -> Request<Full<Bytes>> {
    req.headers_mut()
        .insert(http::header::ACCEPT, http::HeaderValue::from_static(accept));
    req
}

/// Sends `req` on `conn` and returns the response head and streaming body.
pub async fn send(conn: &Conn, req: Request<Full<Bytes>>) -> anyhow::Result<Response<Incoming>> {
    let mut c = conn.clone();
    c.ready().await?;
    Ok(c.send_request(req).await?)
}

/// Sends `req` and reads the whole body; non-2xx is an error with the body's start.
pub async fn fetch(conn: &Conn, req: Request<Full<Bytes>>) -> anyhow::Result<Bytes> {
    let what = format!("{} {}", req.method(), req.uri().path());
    let resp = send(conn, req).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if !status.is_success() {
        bail!(
            "{what}: {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(300)])
        );
    }
    Ok(body)
}

/// Reads a watch body: newline-delimited JSON events ([`LineReader::next`]) or the
/// length-prefixed frames of a protobuf watch ([`LineReader::next_frame`]).
///
/// A line or frame that lies within one of the body's data frames is returned as a slice of
/// it (no copy); only one that spans data frames is assembled. The reader runs once per
/// delivery for 10,000 watchers on the same two cores as the proxy and the apiserver it
/// measures, so what it costs is taken from both sides' latency.
pub struct LineReader<B = Incoming> {
    body: B,
    /// What is left of the last data frame.
    pending: Bytes,
    /// A line or frame that began in an earlier data frame (when not empty, `pending` is).
    partial: BytesMut,
    /// The body has ended.
    ended: bool,
}

impl LineReader {
    pub fn new(resp: Response<Incoming>) -> LineReader {
        LineReader::from_body(resp.into_body())
    }
}

impl<B> LineReader<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    pub fn from_body(body: B) -> LineReader<B> {
        LineReader {
            body,
            pending: Bytes::new(),
            partial: BytesMut::new(),
            ended: false,
        }
    }

    /// Moves what is pending into `partial`, then takes the body's next data frame as
    /// `pending` (or notes that the body ended).
    async fn fill(&mut self) -> anyhow::Result<()> {
        if !self.pending.is_empty() {
            self.partial.extend_from_slice(&self.pending);
            self.pending = Bytes::new();
        }
        loop {
            match self.body.frame().await {
                None => {
                    self.ended = true;
                    return Ok(());
                }
                Some(Err(e)) => return Err(e.into()),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data()
                        && !d.is_empty()
                    {
                        self.pending = d;
                        return Ok(());
                    }
                }
            }
        }
    }

    /// The next line (without `\n`), `None` at the end of the stream.
    pub async fn next(&mut self) -> anyhow::Result<Option<Bytes>> {
        loop {
            if let Some(i) = memchr::memchr(b'\n', &self.pending) {
                let line = self.pending.split_to(i + 1);
                if self.partial.is_empty() {
                    return Ok(Some(line.slice(..i)));
                }
                self.partial.extend_from_slice(&line[..i]);
                return Ok(Some(self.partial.split().freeze()));
            }
            if self.ended {
                return Ok(None);
            }
            self.fill().await?;
        }
    }

    /// The next protobuf watch frame's message (without its 4-byte big-endian length, as
    /// client-go's `LengthDelimitedFrameReader` reads it), `None` at the end of the stream.
    pub async fn next_frame(&mut self) -> anyhow::Result<Option<Bytes>> {
        fn whole(b: &[u8]) -> Option<usize> {
            let len = u32::from_be_bytes(*b.first_chunk::<4>()?) as usize;
            (b.len() >= 4 + len).then_some(4 + len)
        }
        loop {
            if self.partial.is_empty() {
                if let Some(end) = whole(&self.pending) {
                    return Ok(Some(self.pending.split_to(end).slice(4..)));
                }
            } else {
                // The data frame just taken may complete the frame begun in `partial`: join
                // it before looking, or a frame split across data frames would wait for the
                // stream's next data frame (the next event) to be seen.
                if !self.pending.is_empty() {
                    self.partial.extend_from_slice(&self.pending);
                    self.pending = Bytes::new();
                }
                if let Some(end) = whole(&self.partial) {
                    return Ok(Some(self.partial.split_to(end).freeze().slice(4..)));
                }
            }
            if self.ended {
                return Ok(None);
            }
            self.fill().await?;
        }
    }
}

/// Checks a response status, reading the body for the error message.
pub async fn expect_ok(resp: Response<Incoming>, what: &str) -> anyhow::Result<Response<Incoming>> {
    if resp.status() == StatusCode::OK {
        return Ok(resp);
    }
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    bail!(
        "{what}: {status}: {}",
        String::from_utf8_lossy(&body[..body.len().min(300)])
    )
}

/// Unix time in nanoseconds (write timestamps in objects are compared with receipt times).
pub fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream;
    use http_body_util::StreamBody;
    use hyper::body::Frame;

    type Frames =
        StreamBody<stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::io::Error>>>>;

    fn reader(parts: &[&[u8]]) -> LineReader<Frames> {
        let frames = parts
            .iter()
            .map(|p| Ok(Frame::data(Bytes::copy_from_slice(p))))
            .collect::<Vec<_>>();
        LineReader::from_body(StreamBody::new(stream::iter(frames)))
    }

    async fn lines(mut r: LineReader<Frames>) -> Vec<String> {
        let mut out = vec![];
        while let Some(l) = r.next().await.unwrap() {
            out.push(String::from_utf8(l.to_vec()).unwrap());
        }
        out
    }

    async fn frames(mut r: LineReader<Frames>) -> Vec<Vec<u8>> {
        let mut out = vec![];
        while let Some(f) = r.next_frame().await.unwrap() {
            out.push(f.to_vec());
        }
        out
    }

    /// Lines within a data frame, several in one, one across three, empty data frames; a
    /// last line without its newline is not a line.
    #[tokio::test]
    async fn lines_within_and_across_data_frames() {
        let r = reader(&[b"a\nbb\n", b"", b"c", b"cc", b"c\nd", b"\n", b"\n", b"tail"]);
        assert_eq!(lines(r).await, ["a", "bb", "cccc", "d", ""]);
        assert!(lines(reader(&[])).await.is_empty());
    }

    /// Length-prefixed frames: several in one data frame, one split inside its length and
    /// inside its message, an empty message; a cut-off last frame is not a frame.
    #[tokio::test]
    async fn protobuf_frames_within_and_across_data_frames() {
        let frame = |m: &[u8]| {
            let mut f = (m.len() as u32).to_be_bytes().to_vec();
            f.extend_from_slice(m);
            f
        };
        let (a, b, c) = (frame(b"one"), frame(b""), frame(b"three!"));
        let mut all = [a.clone(), b.clone(), c.clone(), c.clone()].concat();
        all.truncate(all.len() - 2);
        let (head, rest) = all.split_at(a.len() + b.len() + 2);
        let (mid, tail) = rest.split_at(5);
        let got = frames(reader(&[head, mid, tail])).await;
        assert_eq!(got, [b"one".to_vec(), vec![], b"three!".to_vec()]);
    }

    /// A frame split across two data frames of a stream that stays open (as the apiserver
    /// writes a watch event larger than its write buffer) is read as soon as its second part
    /// is there, not when the stream's next data frame comes.
    #[tokio::test]
    async fn a_split_frame_is_read_without_waiting_for_more_data() {
        use futures_util::{FutureExt, StreamExt};
        let mut f = 6u32.to_be_bytes().to_vec();
        f.extend_from_slice(b"event!");
        let (first, second) = f.split_at(3);
        let parts = [first, second]
            .map(|p| Ok::<_, std::io::Error>(Frame::data(Bytes::copy_from_slice(p))));
        // Both parts are there; after them the stream stays open with nothing more.
        let body = StreamBody::new(stream::iter(parts).chain(stream::pending()));
        let mut r = LineReader::from_body(body);
        let got = r.next_frame().now_or_never();
        assert!(
            matches!(&got, Some(Ok(Some(m))) if &m[..] == b"event!"),
            "the frame was not read from the data it came in: {got:?}"
        );
    }
}
