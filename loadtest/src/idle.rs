//! Scenario `idle-streams`: what an open, idle watch stream costs the server in memory.
//!
//! N watch streams over TLS HTTP/2, S per connection, each a WATCH of one namespace's
//! ConfigMaps as an informer opens it after its LIST (`resourceVersion=<the LIST's>`,
//! `allowWatchBookmarks=true`, a `timeoutSeconds` longer than the hold). Every body is read as
//! it comes (bookmarks, if any); nothing is written while the streams are held. The target's
//! RSS (`/proc/PID/status` VmRSS) is read before the streams open, once they are all open and
//! the target has settled, and some seconds after they are closed; the cost of one stream is
//! (RSS open − RSS before) / streams open. kube-apiserver's growth includes its own per-watch
//! state (its cacher's watchers); the proxy's, its HTTP/2 and TLS state, the request and the
//! watch. The streams the target holds are counted from its `/metrics`: the apiserver's
//! `apiserver_longrunning_requests` (configmaps WATCH) and the proxy's
//! `kube_cache_proxy_watchers{resource="configmaps"}` (watches served from its cache).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use http::Method;
use serde::Serialize;

use crate::client::{LineReader, Target, expect_ok, fetch, send};
use crate::stats::{metrics, sum};

#[derive(Debug, Clone, Serialize)]
pub struct IdleOpts {
    pub namespace: String,
    pub streams: usize,
    pub per_conn: usize,
    /// Seconds the target is left to settle once every stream is open, before RSS is read.
    pub settle_s: f64,
    /// RSS is read this long after the connections closed.
    pub after_s: f64,
    /// Connections opening their streams at once (informers starting together).
    pub opening: usize,
    /// The watches' `timeoutSeconds`: longer than the whole hold, so none ends meanwhile.
    pub timeout_s: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct IdleResult {
    pub side: &'static str,
    /// Streams whose response head (200) arrived.
    pub streams_opened: usize,
    /// The streams the target counted as open while held (see the module doc).
    pub streams_counted: f64,
    pub open_s: f64,
    pub rss_before_kb: u64,
    pub rss_open_kb: u64,
    pub rss_after_kb: u64,
    /// (RSS open − RSS before) / streams opened, in bytes.
    pub bytes_per_stream: f64,
    /// Lines (events, bookmarks) read from all streams while held.
    pub lines_read: u64,
    /// Streams that ended (or failed) before they were closed.
    pub ended_early: u64,
    /// The machine's 1-minute load average when RSS was read with the streams open.
    pub load_avg: f64,
    /// The proxy's configmaps WATCH requests by what served them, after closing (cache,
    /// upstream); 0, 0 for the apiserver.
    pub served_cache: f64,
    pub served_upstream: f64,
}

/// One connection's streams: the reader tasks (aborted to close them).
struct Held {
    readers: Vec<tokio::task::JoinHandle<()>>,
}

/// The namespace's LIST resourceVersion, as an informer gets it before it watches.
async fn list_rv(t: &Target, ns: &str) -> anyhow::Result<String> {
    let c = t.connect().await?;
    let path = format!("/api/v1/namespaces/{ns}/configmaps?limit=500");
    let b = fetch(&c, t.request(Method::GET, &path, None)).await?;
    let v: serde_json::Value = serde_json::from_slice(&b)?;
    v["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow::anyhow!("LIST {path}: no resourceVersion"))
}

/// Opens one connection's `n` watches on `path`; each body is read by a task of its own.
async fn open_conn(
    t: &Target,
    path: &str,
    n: usize,
    lines: Arc<AtomicU64>,
    ended: Arc<AtomicU64>,
) -> anyhow::Result<Held> {
    let conn = t.connect().await?;
    let mut heads = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (conn, req) = (conn.clone(), t.request(Method::GET, path, None));
        heads.spawn(async move {
            let resp = send(&conn, req).await.context("sending a watch")?;
            expect_ok(resp, "watch").await
        });
    }
    let mut readers = Vec::with_capacity(n);
    while let Some(r) = heads.join_next().await {
        let mut body = LineReader::new(r??);
        let (lines, ended) = (lines.clone(), ended.clone());
        readers.push(tokio::spawn(async move {
            while let Ok(Some(_)) = body.next().await {
                lines.fetch_add(1, Ordering::Relaxed);
            }
            ended.fetch_add(1, Ordering::Relaxed);
        }));
    }
    // The connection lives while a reader holds a stream of it (hyper's client closes it
    // when its last handle and stream are gone).
    drop(conn);
    Ok(Held { readers })
}

/// The streams `t` counts as open (module doc); `admin` is its `/metrics` endpoint.
async fn counted(t: &Target, admin: &Target) -> f64 {
    let Ok(text) = metrics(admin).await else {
        return -1.0;
    };
    if t.side == "proxy" {
        sum(
            &text,
            "kube_cache_proxy_watchers",
            &["resource=\"configmaps\""],
        )
    } else {
        sum(
            &text,
            "apiserver_longrunning_requests",
            &["resource=\"configmaps\"", "verb=\"WATCH\""],
        )
    }
}

/// Bytes of RSS per open stream: the growth from `before_kb` to `open_kb` (KiB) over
/// `streams` (a shrink is negative, not hidden).
fn per_stream(before_kb: u64, open_kb: u64, streams: usize) -> f64 {
    (open_kb as f64 - before_kb as f64) * 1024.0 / streams.max(1) as f64
}

/// The 1-minute load average (`/proc/loadavg`).
pub fn load_avg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(-1.0)
}

/// Opens `o.streams` idle watches on `t`, reads `pid`'s RSS before, open and after, closes them.
/// `admin`: where `t`'s `/metrics` is (the apiserver itself, the proxy's admin listener).
pub async fn run(t: &Target, pid: u32, o: &IdleOpts, admin: &Target) -> anyhow::Result<IdleResult> {
    let rss = || crate::stats::rss_kb(pid).unwrap_or(0);
    let rv = list_rv(t, &o.namespace).await?;
    let path = format!(
        "/api/v1/namespaces/{}/configmaps?allowWatchBookmarks=true&resourceVersion={rv}\
         &timeoutSeconds={}&watch=true",
        o.namespace, o.timeout_s
    );
    // The LIST's connection and buffers go away first.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_before_kb = rss();
    let (lines, ended) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let t0 = Instant::now();
    let mut opening = tokio::task::JoinSet::new();
    let mut left = o.streams;
    let gate = Arc::new(tokio::sync::Semaphore::new(o.opening.max(1)));
    while left > 0 {
        let n = left.min(o.per_conn.max(1));
        left -= n;
        let (t, path, lines, ended) = (t.clone(), path.clone(), lines.clone(), ended.clone());
        let gate = gate.clone();
        opening.spawn(async move {
            let _permit = gate.acquire_owned().await?;
            open_conn(&t, &path, n, lines, ended).await
        });
    }
    let mut held = Vec::new();
    while let Some(r) = opening.join_next().await {
        held.push(r??);
    }
    let open_s = t0.elapsed().as_secs_f64();
    let streams_opened: usize = held.iter().map(|h| h.readers.len()).sum();
    say!(
        "{}: {streams_opened} idle watch streams open in {open_s:.1}s; settling {}s",
        t.side,
        o.settle_s
    );
    tokio::time::sleep(Duration::from_secs_f64(o.settle_s)).await;
    let rss_open_kb = rss();
    let load_avg = load_avg();
    let streams_counted = counted(t, admin).await;
    let lines_read = lines.load(Ordering::Relaxed);
    for h in &held {
        for r in &h.readers {
            r.abort();
        }
    }
    for h in held {
        for r in h.readers {
            let _ = r.await;
        }
    }
    // Aborted readers count as ended; what ended before the close was counted already.
    let ended_early = ended.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs_f64(o.after_s)).await;
    let rss_after_kb = rss();
    let (served_cache, served_upstream) = if t.side == "proxy" {
        let text = metrics(admin).await.unwrap_or_default();
        let by = |b: &str| {
            let b = format!("served_by=\"{b}\"");
            sum(
                &text,
                "kube_cache_proxy_requests_total",
                &["resource=\"configmaps\"", "verb=\"WATCH\"", &b],
            )
        };
        // (`+ 0.0`: an empty sum is -0.)
        (by("cache") + 0.0, by("upstream") + 0.0)
    } else {
        (0.0, 0.0)
    };
    Ok(IdleResult {
        side: t.side,
        streams_opened,
        streams_counted,
        open_s,
        rss_before_kb,
        rss_open_kb,
        rss_after_kb,
        bytes_per_stream: per_stream(rss_before_kb, rss_open_kb, streams_opened),
        lines_read,
        ended_early,
        load_avg,
        served_cache,
        served_upstream,
    })
}

/// The report's table.
pub fn markdown(o: &IdleOpts, rows: &[IdleResult]) -> String {
    let mut s = format!(
        "## idle-streams\n\n{} watch streams, {} per TLS HTTP/2 connection, on `{}`'s ConfigMaps \
         from the LIST's resourceVersion (`allowWatchBookmarks=true&timeoutSeconds={}`), bodies \
         read, nothing written; RSS read {} s after the last stream opened and {} s after \
         closing.\n\n\
         | target | streams opened | counted open | open s | RSS before MB | RSS open MB | RSS after close MB | bytes per stream | lines read | ended early | load avg | served by cache / upstream |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        o.streams, o.per_conn, o.namespace, o.timeout_s, o.settle_s, o.after_s
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {} | {} | {:.2} | {:.0} / {:.0} |\n",
            r.side,
            r.streams_opened,
            r.streams_counted,
            r.open_s,
            r.rss_before_kb as f64 / 1024.0,
            r.rss_open_kb as f64 / 1024.0,
            r.rss_after_kb as f64 / 1024.0,
            r.bytes_per_stream,
            r.lines_read,
            r.ended_early,
            r.load_avg,
            r.served_cache,
            r.served_upstream,
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_stream_is_the_rss_growth_over_the_streams_open() {
        assert_eq!(per_stream(30_000, 70_000, 10_000), 4096.0);
        assert_eq!(per_stream(70_000, 69_000, 1_000), -1024.0);
        // No stream opened: the growth itself, not a division by zero.
        assert_eq!(per_stream(1, 2, 0), 1024.0);
    }
}
