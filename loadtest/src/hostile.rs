//! Scenario `hostile-streams`: clients that open many watch streams and never read.
//!
//! N HTTP/2 connections (TLS, ALPN h2, the `h2` crate's client with 2^31-1 byte stream and
//! connection windows) each open up to M watches from `resourceVersion=0` on a namespace
//! holding about K KB of ConfigMaps, and then never read their socket again (the IO's read
//! side is gated shut once the server's SETTINGS are in, so flow control never stops the
//! server: only its own buffers do). The target's RSS (`/proc/PID/status` VmRSS) is sampled
//! before, every 200 ms while the streams are held (peak), and some seconds after they are
//! closed. Meanwhile a normal client GETs objects (`resourceVersion=0`) at a fixed rate, and
//! its latency is compared with the same GETs before the hostile clients arrived. A server
//! that allows fewer streams per connection than asked gets what it allows: a request that
//! cannot start within 2 s ends that connection's opening.
//!
//! Then, when `list_mb` > 0, one LIST of a namespace holding that many MB (one page) is timed
//! a few times, the throughput a per-stream or per-connection bound must not hurt.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Method;
use serde::Serialize;

use crate::client::{Target, fetch};
use crate::scenarios::{GetKind, GetResult, get_rate};
use crate::slow::{Gate, Gated};
use crate::stats::{Summary, summarize};

#[derive(Debug, Clone, Serialize)]
pub struct HostileOpts {
    pub namespace: String,
    pub conns: usize,
    pub streams: usize,
    /// Streams are held this long after the last one opened.
    pub hold_s: f64,
    /// RSS is read this long after the connections closed.
    pub after_s: f64,
    /// The normal client's GET rate.
    pub get_rate: f64,
    /// Objects in the namespace (named `d-<i>`, as `get_rate` asks for them).
    pub objects: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct HostileResult {
    pub side: &'static str,
    pub streams_opened: usize,
    pub open_s: f64,
    pub rss_before_mb: f64,
    pub rss_peak_mb: f64,
    pub rss_after_mb: f64,
    pub gets_before: GetResult,
    pub gets_during: GetResult,
    pub list: Option<Summary>,
    pub list_mb: f64,
    /// Open configmaps watches, and the proxy's budget metrics and connection count, while the
    /// streams are held and after they closed (the apiserver's `/metrics`, the proxy's admin
    /// `/metrics`).
    pub metrics_held: Vec<String>,
    pub metrics_after: Vec<String>,
}

/// The lines of a target's `/metrics` about its open watches (both), downstream buffers and
/// connections (the proxy's admin listener).
async fn budget_metrics(admin: Option<&Target>) -> Vec<String> {
    let Some(admin) = admin else {
        return Vec::new();
    };
    let text = match admin.connect().await {
        Ok(c) => fetch(&c, admin.request(Method::GET, "/metrics", None)).await,
        Err(e) => Err(e),
    };
    match text {
        Ok(b) => String::from_utf8_lossy(&b)
            .lines()
            .filter(|l| {
                l.starts_with("kube_cache_proxy_downstream_buffer")
                    || l.starts_with("kube_cache_proxy_connections")
                    || l.starts_with("kube_cache_proxy_inflight_requests{kind=\"watch\"}")
                    || (l.starts_with("apiserver_longrunning_requests{")
                        && l.contains("resource=\"configmaps\"")
                        && l.contains("verb=\"WATCH\""))
            })
            .map(str::to_string)
            .collect(),
        Err(e) => vec![format!("/metrics: {e}")],
    }
}

/// One hostile connection: its streams (kept, so they are not reset) and its task.
struct Hostile {
    streams: Vec<h2::client::ResponseFuture>,
    task: tokio::task::JoinHandle<()>,
}

const WINDOW: u32 = (1 << 31) - 1;

async fn hostile_conn(t: &Target, path: &str, streams: usize) -> anyhow::Result<Hostile> {
    let tls = t.connect_tls().await?;
    let gate = Arc::new(Gate::default());
    let io = Gated {
        inner: tls,
        gate: gate.clone(),
    };
    let (send, conn) = h2::client::Builder::new()
        .initial_window_size(WINDOW)
        .initial_connection_window_size(WINDOW)
        .max_concurrent_reset_streams(streams)
        .handshake::<_, Bytes>(io)
        .await?;
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut send = send.ready().await?;
    // The server's SETTINGS (its stream limit) arrive with its first frames.
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.set(true);
    let mut kept = Vec::with_capacity(streams);
    for _ in 0..streams {
        let (parts, _) = t.request(Method::GET, path, None).into_parts();
        let req = http::Request::from_parts(parts, ());
        // Ready once this handle's previous request has started: at the server's stream
        // limit it never does, since no stream closes.
        let ready = std::future::poll_fn(|cx| send.poll_ready(cx));
        match tokio::time::timeout(Duration::from_secs(2), ready).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => break,
        }
        let (resp, _) = send.send_request(req, true)?;
        kept.push(resp);
    }
    Ok(Hostile {
        streams: kept,
        task,
    })
}

/// Opens N × M non-reading watch streams on `t`, samples `pid`'s RSS, closes them.
pub async fn run(
    t: &Target,
    pid: u32,
    o: &HostileOpts,
    list_path: Option<&str>,
    admin: Option<&Target>,
) -> anyhow::Result<HostileResult> {
    let rss_mb = || crate::stats::rss_kb(pid).unwrap_or(0) as f64 / 1024.0;
    let gets = |secs: f64| get_rate(t, &o.namespace, o.objects, o.get_rate, secs, GetKind::Rv0);
    let gets_before = gets(5.0).await?;
    let rss_before_mb = rss_mb();
    let path = format!(
        "/api/v1/namespaces/{}/configmaps?watch=true&resourceVersion=0",
        o.namespace
    );
    let peak = Arc::new(parking_lot::Mutex::new(rss_before_mb));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::SeqCst) {
                let r = crate::stats::rss_kb(pid).unwrap_or(0) as f64 / 1024.0;
                {
                    let mut p = peak.lock();
                    *p = p.max(r);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let t0 = Instant::now();
    let mut opening = tokio::task::JoinSet::new();
    for _ in 0..o.conns {
        let (t, path, m) = (t.clone(), path.clone(), o.streams);
        opening.spawn(async move { hostile_conn(&t, &path, m).await });
    }
    let mut held = Vec::new();
    while let Some(r) = opening.join_next().await {
        held.push(r??);
    }
    let open_s = t0.elapsed().as_secs_f64();
    let streams_opened = held.iter().map(|h| h.streams.len()).sum();
    say!(
        "{}: {streams_opened} non-reading streams open in {open_s:.1}s; holding {}s with GETs",
        t.side,
        o.hold_s
    );
    let gets_during = gets(o.hold_s).await?;
    sampling.store(false, Ordering::SeqCst);
    let _ = sampler.await;
    let rss_peak_mb = *peak.lock();
    let metrics_held = budget_metrics(admin).await;
    for h in held {
        h.task.abort();
        let _ = h.task.await;
    }
    tokio::time::sleep(Duration::from_secs_f64(o.after_s)).await;
    let rss_after_mb = rss_mb();
    let metrics_after = budget_metrics(admin).await;
    let (list, list_mb) = match list_path {
        Some(p) => {
            let conn = t.connect().await?;
            let mut lat = Vec::new();
            let mut bytes = 0;
            for _ in 0..5 {
                let t1 = Instant::now();
                let b = fetch(&conn, t.request(Method::GET, p, None)).await?;
                lat.push(t1.elapsed().as_micros() as u64);
                bytes = b.len();
            }
            (Some(summarize(lat)), bytes as f64 / 1e6)
        }
        None => (None, 0.0),
    };
    Ok(HostileResult {
        side: t.side,
        streams_opened,
        open_s,
        rss_before_mb,
        rss_peak_mb,
        rss_after_mb,
        gets_before,
        gets_during,
        list,
        list_mb,
        metrics_held,
        metrics_after,
    })
}

/// The report's table.
pub fn markdown(o: &HostileOpts, kb: usize, rows: &[HostileResult]) -> String {
    let mut s = format!(
        "## hostile-streams\n\n{} connections × {} watch streams (`resourceVersion=0`, {} KB of ConfigMaps, \
         client windows 2^31-1, socket never read), held {} s; RSS read {} s after closing. \
         Normal client: `resourceVersion=0` GETs at {}/s.\n\n\
         | target | streams requested | RSS before MB | RSS peak MB | RSS after close MB | GET p99 before ms | GET p99 during ms | GET errors during | LIST MB | LIST p50 ms | LIST max ms |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        o.conns, o.streams, kb, o.hold_s, o.after_s, o.get_rate
    );
    for r in rows {
        let (lp50, lmax) = r.list.as_ref().map_or((0.0, 0.0), |l| (l.p50_ms, l.max_ms));
        s.push_str(&format!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {:.1} |\n",
            r.side,
            r.streams_opened,
            r.rss_before_mb,
            r.rss_peak_mb,
            r.rss_after_mb,
            r.gets_before.latency.p99_ms,
            r.gets_during.latency.p99_ms,
            r.gets_during.errors,
            r.list_mb,
            lp50,
            lmax,
        ));
    }
    for r in rows.iter().filter(|r| !r.metrics_held.is_empty()) {
        s.push_str(&format!(
            "\n{} metrics while held:\n\n```\n{}\n```\n\nafter closing:\n\n```\n{}\n```\n",
            r.side,
            r.metrics_held.join("\n"),
            r.metrics_after.join("\n")
        ));
    }
    s
}
