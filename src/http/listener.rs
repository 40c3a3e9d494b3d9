//! Listeners and connections: accept, TLS handshake, HTTP/1.1 and HTTP/2 serving, drain.
//!
//! [`run`] serves until its `shutdown` future completes, then drains: readiness fails at once,
//! listeners close after `shutdown.delay`, HTTP/2 connections get GOAWAY, idle HTTP/1.1
//! connections close, watch streams end at an event boundary, and everything is bounded by
//! `shutdown.drainTimeout`. Tests embed it on port 0. What a request means is the
//! [`Service`]'s business (the request pipeline, [`crate::serve`]).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls_pki_types::CertificateDer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::http::body::Body;
use crate::http::budget::{self, Downstream};
use crate::http::local_streams::LocalExec;
use crate::metrics::{KindLabels, Metrics};

/// What the listener hands connections and requests to.
pub trait Service: Send + Sync + 'static {
    /// What the service keeps about one connection (its peer, the verified client
    /// certificate's identity), built once when the connection is accepted.
    type Conn: Send + Sync + 'static;
    /// A connection was accepted (after the TLS handshake, with the verified leaf certificate).
    fn accept(&self, peer: SocketAddr, cert: Option<&CertificateDer<'_>>) -> Self::Conn;
    /// Answers one request. Never fails: errors are responses (Kubernetes `Status`).
    fn call(
        self: Arc<Self>,
        conn: Arc<Self::Conn>,
        req: Request<Incoming>,
    ) -> Pin<Box<dyn Future<Output = Response<Body>> + Send>>;
    /// Connection counts and refusals.
    fn metrics(&self) -> &Metrics;
    /// The `kind` label of this listener's connections in `kube_cache_proxy_connections`.
    fn connection_kind(&self, tls: bool) -> &'static str {
        if tls { "tls" } else { "insecure" }
    }
    /// The process-wide budget of bytes produced for clients and not yet taken by their
    /// sockets ([`crate::http::budget`]), shared by every listener.
    fn downstream(&self) -> &Arc<Downstream>;
    /// Shutdown began: readiness fails from now on, while listeners still accept.
    fn begin_shutdown(&self);
    /// Listeners are closed: long-running responses (watches) end at an event boundary.
    fn begin_drain(&self);
}

/// The sockets to serve on.
pub struct Listeners {
    pub tls: Option<(TcpListener, TlsAcceptor)>,
    pub insecure: Option<TcpListener>,
}

fn connection_builder(cfg: &Config) -> auto::Builder<LocalExec> {
    let s = &cfg.server;
    let mut b = auto::Builder::new(LocalExec);
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(s.header_read_timeout)
        // Go's server limits only the bytes of the head; hyper also counts headers. 2048 is
        // far above what any client sends (kube-apiserver answered 300 headers; hyper's
        // default of 100 refused them), and the index it allocates per parse stays small.
        .max_headers(2048)
        // hyper refuses a head beyond its buffer with a bare 431; leave room above our own
        // limit so oversized heads reach the handler and get a Status.
        .max_buf_size((s.max_header_bytes + 64 * 1024).max(8192 + 4096));
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(s.http2_max_concurrent_streams)
        // Per stream: what h2 buffers while the client's window is open and its socket is
        // not (the connection's byte budget bounds the sum over its streams).
        .max_send_buf_size(s.http2_max_send_buffer_bytes)
        .keep_alive_interval(s.http2_keepalive_interval)
        .keep_alive_timeout(s.http2_keepalive_timeout)
        .max_pending_accept_reset_streams(s.http2_max_pending_accept_reset_streams)
        .max_local_error_reset_streams(s.http2_max_local_error_reset_streams)
        .max_header_list_size((s.max_header_bytes + 64 * 1024) as u32);
    b
}

/// Serves until `shutdown` completes, then drains (see the module docs).
pub async fn run<S: Service>(
    state: Arc<S>,
    config: &Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) {
    let builder = Arc::new(connection_builder(config));
    let graceful = Arc::new(hyper_util::server::graceful::GracefulShutdown::new());
    let stop_accepting = CancellationToken::new();
    let permits = Arc::new(Semaphore::new(config.server.max_connections));
    let mut accept_tasks = Vec::new();
    if let Some((l, acceptor)) = listeners.tls {
        accept_tasks.push(tokio::spawn(accept_loop(
            state.clone(),
            builder.clone(),
            l,
            Some((acceptor, config.tls.handshake_timeout)),
            graceful.clone(),
            stop_accepting.clone(),
            permits.clone(),
        )));
    }
    if let Some(l) = listeners.insecure {
        accept_tasks.push(tokio::spawn(accept_loop(
            state.clone(),
            builder.clone(),
            l,
            None,
            graceful.clone(),
            stop_accepting.clone(),
            permits.clone(),
        )));
    }

    shutdown.await;
    tracing::info!(delay = ?config.shutdown.delay, "shutting down: readiness now fails");
    state.begin_shutdown();
    tokio::time::sleep(config.shutdown.delay).await;
    stop_accepting.cancel();
    for t in accept_tasks {
        let _ = t.await;
    }
    state.begin_drain();
    // The accept loops held the only other references.
    let Ok(graceful) = Arc::try_unwrap(graceful) else {
        tracing::error!("connection tracker still shared; cannot drain");
        return;
    };
    tracing::info!(
        connections = graceful.count(),
        "listeners closed; draining connections"
    );
    let limit = config.shutdown.drain_timeout;
    match tokio::time::timeout(limit, graceful.shutdown()).await {
        Ok(()) => tracing::info!("all connections drained"),
        Err(_) => tracing::warn!(
            ?limit,
            "drain timeout reached; closing remaining connections"
        ),
    }
}

async fn accept_loop<S: Service>(
    state: Arc<S>,
    builder: Arc<auto::Builder<LocalExec>>,
    listener: TcpListener,
    tls: Option<(TlsAcceptor, Duration)>,
    graceful: Arc<hyper_util::server::graceful::GracefulShutdown>,
    stop: CancellationToken,
    permits: Arc<Semaphore>,
) {
    let kind = state.connection_kind(tls.is_some());
    loop {
        let permit = tokio::select! {
            _ = stop.cancelled() => return,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
        };
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let builder = builder.clone();
        let tls = tls.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let gauge = state
                .metrics()
                .connections
                .get_or_create(&KindLabels { kind: kind.into() })
                .clone();
            gauge.inc();
            serve_connection(state, &builder, stream, peer, tls, watcher).await;
            gauge.dec();
        });
    }
}

async fn serve_connection<S: Service>(
    state: Arc<S>,
    builder: &auto::Builder<LocalExec>,
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<(TlsAcceptor, Duration)>,
    watcher: hyper_util::server::graceful::Watcher,
) {
    let Some((acceptor, handshake_timeout)) = tls else {
        let conn = state.accept(peer, None);
        return serve_io(state, builder, stream, conn, Some(peer), watcher).await;
    };
    let hs = tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await;
    let tls_stream = match hs {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            state.metrics().reject("tls_handshake");
            tracing::info!(%peer, error = %e, "TLS handshake failed; connection closed");
            return;
        }
        Err(_) => {
            state.metrics().reject("tls_handshake_timeout");
            tracing::info!(%peer, "TLS handshake timed out; connection closed");
            return;
        }
    };
    let cert = tls_stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first());
    let conn = state.accept(peer, cert);
    serve_io(state, builder, tls_stream, conn, Some(peer), watcher).await
}

/// Serves one connection. Its writes are coalesced (`crate::http::coalesce`): what one poll of the
/// connection writes, HTTP/2 frames of many streams included, leaves in one write.
async fn serve_io<S: Service, IO>(
    state: Arc<S>,
    builder: &auto::Builder<LocalExec>,
    stream: IO,
    conn: S::Conn,
    peer: Option<SocketAddr>,
    watcher: hyper_util::server::graceful::Watcher,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let budget = Arc::new(budget::Conn::new(state.downstream().clone()));
    // HTTP/1 request lines with a `#`, which hyper cuts off (`crate::http::raw_target`).
    let targets = Arc::new(crate::http::raw_target::Targets::default());
    let stream = crate::http::raw_target::Scanned::new(stream, targets.clone());
    let (io, coalescing) = crate::http::coalesce::coalesce_counted(stream, Some(budget.clone()));
    let io = TokioIo::new(io);
    let conn = Arc::new(conn);
    // `call` returns a boxed future: an HTTP/2 stream holds the service future inline until
    // the response head is written and then keeps its size for the stream's life; the
    // pipeline's future is several KB, which every idle watch stream would carry.
    let svc = service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
        use futures_util::FutureExt;
        if let Some(target) = targets.restore(req.method(), req.uri()) {
            *req.uri_mut() = target;
        }
        let budget = budget.clone();
        state
            .clone()
            .call(conn.clone(), req)
            .map(move |r| Ok::<_, Infallible>(r.map(|b| budget::Budgeted::wrap(b, budget))))
    });
    let c = builder.serve_connection_with_upgrades(io, svc);
    type BoxError = Box<dyn std::error::Error + Send + Sync>;
    type ConnFuture = std::pin::Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;
    let conn: ConnFuture = Box::pin(watcher.watch(c.into_owned()));
    let conn = crate::http::local_streams::WithStreams::new(conn);
    if let Err(e) = coalescing.drive(conn).await {
        let peer = peer.map_or_else(|| "-".to_string(), |p| p.to_string());
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}
