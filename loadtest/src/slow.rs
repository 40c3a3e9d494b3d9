//! Scenario `slow-watcher`: one watcher stops reading during a burst of large updates.
//!
//! Normal watchers (scenario a's, over TLS and HTTP/2) watch a namespace while ConfigMaps
//! padded to `pad` bytes are patched there at `rate` per second; their latency is taken
//! from the timestamp each write carries. Alongside, one more watch on its own connection
//! (the `h2` crate's client with Go's default windows: 4 MiB per stream, 1 GiB per
//! connection, as client-go's transport) stops reading its socket once its watch has
//! started. After the burst its socket is read again to the end of the stream, or until
//! nothing arrives for 5 s: the bytes it then reads are what the server (and the two
//! sockets' buffers) held for it, and whether the stream ended says whether the server
//! closed it as slow. Both sides run the same scenario in the same run.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::client::{Conn, Target};
use crate::scenarios::{FanoutOpts, FanoutResult, current_rv, watch_fanout};

#[derive(Debug, Clone, Serialize)]
pub struct SlowResult {
    pub side: &'static str,
    /// The normal watchers during the burst.
    pub fanout: FanoutResult,
    /// Bytes and events the slow watcher read once it read again.
    pub slow_bytes: u64,
    pub slow_events: u64,
    /// Whether the server ended its stream (closed it as slow), and how.
    pub slow_closed: bool,
    pub slow_end: String,
}

/// An IO whose read side can be shut and opened again (also the hostile-streams scenario's
/// clients, which never open it again).
pub(crate) struct Gated<T> {
    pub(crate) inner: T,
    pub(crate) gate: Arc<Gate>,
}

#[derive(Default)]
pub(crate) struct Gate {
    shut: AtomicBool,
    waker: parking_lot::Mutex<Option<Waker>>,
}

impl Gate {
    /// Shuts (`true`) or opens the read side; opening wakes a read that waits.
    pub(crate) fn set(&self, shut: bool) {
        self.shut.store(shut, Ordering::SeqCst);
        if !shut && let Some(w) = self.waker.lock().take() {
            w.wake();
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Gated<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.gate.shut.load(Ordering::SeqCst) {
            *self.gate.waker.lock() = Some(cx.waker().clone());
            // Opened between the check and the registration: read now.
            if self.gate.shut.load(Ordering::SeqCst) {
                return Poll::Pending;
            }
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Gated<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

struct SlowWatch {
    body: h2::RecvStream,
    gate: Arc<Gate>,
    task: tokio::task::JoinHandle<()>,
    _send: h2::client::SendRequest<Bytes>,
}

/// Opens the slow watch on its own connection and shuts its socket's read side.
async fn open(t: &Target, path: &str) -> anyhow::Result<SlowWatch> {
    let gate = Arc::new(Gate::default());
    let io = Gated {
        inner: t.connect_tls().await?,
        gate: gate.clone(),
    };
    let (send, conn) = h2::client::Builder::new()
        .initial_window_size(4 << 20)
        .initial_connection_window_size(1 << 30)
        .handshake::<_, Bytes>(io)
        .await?;
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut send = send.ready().await?;
    let (parts, _) = t.request(Method::GET, path, None).into_parts();
    let (resp, _) = send.send_request(http::Request::from_parts(parts, ()), true)?;
    let resp = tokio::time::timeout(Duration::from_secs(30), resp).await??;
    anyhow::ensure!(
        resp.status().is_success(),
        "slow watch: {} from {}",
        resp.status(),
        t.side
    );
    gate.set(true);
    Ok(SlowWatch {
        body: resp.into_body(),
        gate,
        task,
        _send: send,
    })
}

/// Reads the slow watch again until its end or 5 s of silence.
async fn drain(mut w: SlowWatch) -> (u64, u64, bool, String) {
    w.gate.set(false);
    let (mut bytes, mut events) = (0u64, 0u64);
    let (closed, end) = loop {
        match tokio::time::timeout(Duration::from_secs(5), w.body.data()).await {
            Ok(Some(Ok(b))) => {
                bytes += b.len() as u64;
                events += memchr_count(&b);
                let _ = w.body.flow_control().release_capacity(b.len());
            }
            Ok(Some(Err(e))) => break (true, format!("reset: {e}")),
            Ok(None) => break (true, "ended".to_string()),
            Err(_) => break (false, "still open after 5 s of silence".to_string()),
        }
    };
    w.task.abort();
    (bytes, events, closed, end)
}

fn memchr_count(b: &[u8]) -> u64 {
    b.iter().filter(|c| **c == b'\n').count() as u64
}

/// One side: the slow watch opened, the burst with the normal watchers, the slow watch read.
pub async fn run(
    t: &Target,
    direct: &Target,
    writer: &Conn,
    o: &FanoutOpts,
    with_slow: bool,
) -> anyhow::Result<SlowResult> {
    let collection = format!("/api/v1/namespaces/{}/configmaps", o.namespace);
    let rv = current_rv(direct, writer, &collection).await?;
    let path = format!(
        "{collection}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=1800"
    );
    let slow = match with_slow {
        true => Some(open(t, &path).await?),
        false => None,
    };
    let fanout = watch_fanout(t, direct, writer, o).await?;
    let (slow_bytes, slow_events, slow_closed, slow_end) = match slow {
        Some(slow) => drain(slow).await,
        None => (0, 0, false, "no slow watcher (--sw-no-slow)".to_string()),
    };
    Ok(SlowResult {
        side: t.side,
        fanout,
        slow_bytes,
        slow_events,
        slow_closed,
        slow_end,
    })
}

/// The report's table.
pub fn markdown(o: &FanoutOpts, rows: &[SlowResult]) -> String {
    let mut s = format!(
        "## slow-watcher\n\n{} normal watchers ({} per HTTP/2 connection, TLS) and one watcher that \
         stops reading (client windows 4 MiB / 1 GiB, socket not read) on `{}`; {} writes/s for {} s, \
         each a merge patch padding one of {} ConfigMaps to {} KiB. Latency from the write's \
         timestamp to receipt. The slow watcher's bytes are what it read once it read again.\n\n\
         | target | writes | deliveries | missed | p50 ms | p99 ms | max ms | slow watcher: bytes held | events | closed |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
        o.watchers,
        o.streams_per_conn,
        o.namespace,
        o.rate,
        o.duration_s,
        o.objects,
        o.pad / 1024
    );
    for r in rows {
        let f = &r.fanout;
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} MB | {} | {} |\n",
            r.side,
            f.writes,
            f.deliveries,
            f.missed,
            f.latency.p50_ms,
            f.latency.p99_ms,
            f.latency.max_ms,
            r.slow_bytes as f64 / 1e6,
            r.slow_events,
            r.slow_end,
        ));
    }
    s
}
