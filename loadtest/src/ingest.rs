//! Scenario `ingest` (the P8): what it costs the proxy, in CPU, to take in what the
//! apiserver sends it, end to end (TLS, HTTP/2, parsing, the store), for its initial LIST and
//! for watch events.
//!
//! The namespace `lt-i` is seeded with N ConfigMaps of S KiB. A proxy (a child process, the
//! default cached resources, ConfigMaps among them) is started cold: from its spawn until its
//! `/readyz` passes it lists every cached resource; its CPU seconds over that time (the whole
//! process: start-up included, so an upper bound) against the LIST bytes its reflectors took
//! in (`kube_cache_proxy_upstream_received_bytes_total{phase="list"}`) give GB per CPU-second.
//! Then, after an idle stretch that measures the proxy's CPU at rest, every seeded ConfigMap is
//! merge-patched once straight at the apiserver (each event then carries the whole object);
//! the proxy's CPU from the first patch until its reflectors have taken in every event
//! (`kube_cache_proxy_upstream_watch_events_total`), against the watch bytes taken in
//! meanwhile (`phase="watch"`), gives the watch figure. The proxy has no downstream clients
//! here: the figures are its ingest only. kube-apiserver's and etcd's CPU over the same
//! stretches are reported beside them for scale: the apiserver's own ingest (its watch cache
//! fed from etcd) is not separable from its other work, so there is no same-run ratio.

use std::time::{Duration, Instant};

use http::Method;
use serde::Serialize;

use crate::client::Target;
use crate::proxy::ProxyChild;
use crate::scenarios::send_each;
use crate::stats::{cpu_seconds, metrics, sum};

#[derive(Debug, Clone, Serialize)]
pub struct IngestResult {
    pub objects: usize,
    pub object_kib: usize,
    /// Spawn to `/readyz` passing.
    pub list_s: f64,
    pub list_bytes: f64,
    /// The proxy's CPU seconds from spawn to ready.
    pub list_cpu_s: f64,
    /// kube-apiserver's and etcd's over the same time.
    pub list_apiserver_cpu_s: f64,
    pub list_etcd_cpu_s: f64,
    /// The proxy's CPU per second while nothing happens (before the patches).
    pub idle_cpu_per_s: f64,
    pub watch_events: f64,
    pub watch_bytes: f64,
    /// First patch to the last event taken in.
    pub watch_s: f64,
    pub watch_cpu_s: f64,
    pub watch_apiserver_cpu_s: f64,
    pub watch_etcd_cpu_s: f64,
}

impl IngestResult {
    pub fn list_gb_per_cpu_s(&self) -> f64 {
        self.list_bytes / 1e9 / self.list_cpu_s.max(1e-3)
    }

    pub fn watch_gb_per_cpu_s(&self) -> f64 {
        self.watch_bytes / 1e9 / self.watch_cpu_s.max(1e-3)
    }
}

pub struct IngestOpts<'a> {
    pub namespace: &'a str,
    pub objects: usize,
    pub object_kib: usize,
    /// Seconds at rest before the patches (the proxy's idle CPU).
    pub idle_s: f64,
    /// How long the events may take to reach the proxy after the last patch.
    pub settle_timeout: Duration,
}

/// Runs both phases; `start` spawns the proxy and returns it once ready, `cp` gives the
/// apiserver's and etcd's pids.
pub async fn run<F, Fut>(
    direct: &Target,
    o: &IngestOpts<'_>,
    cp_pids: (u32, u32),
    start: F,
) -> anyhow::Result<IngestResult>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<ProxyChild>>,
{
    let (etcd, apiserver) = cp_pids;
    let cpu = |pid: u32| cpu_seconds(pid).unwrap_or(0.0);
    let (a0, e0) = (cpu(apiserver), cpu(etcd));
    let t = Instant::now();
    let px = start().await?;
    let list_s = t.elapsed().as_secs_f64();
    let pid = px
        .pid
        .ok_or_else(|| anyhow::anyhow!("the proxy's pid is unknown"))?;
    let list_cpu_s = cpu(pid);
    let (list_apiserver_cpu_s, list_etcd_cpu_s) = (cpu(apiserver) - a0, cpu(etcd) - e0);
    let admin = px
        .admin
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the proxy's admin listener is unknown"))?;
    let own = metrics(&admin).await?;
    let received = |text: &str, phase: &str| {
        sum(
            text,
            "kube_cache_proxy_upstream_received_bytes_total",
            &[&format!("phase=\"{phase}\"")],
        )
    };
    let list_bytes = received(&own, "list");

    // At rest: the proxy's own background work (timers, bookmarks, probes).
    let c0 = cpu(pid);
    tokio::time::sleep(Duration::from_secs_f64(o.idle_s)).await;
    let idle_cpu_per_s = (cpu(pid) - c0) / o.idle_s;

    let events = |text: &str| sum(text, "kube_cache_proxy_upstream_watch_events_total", &[]);
    let before = metrics(&admin).await?;
    let (ev0, wb0) = (events(&before), received(&before, "watch"));
    let (c0, a0, e0) = (cpu(pid), cpu(apiserver), cpu(etcd));
    let t = Instant::now();
    // Each ConfigMap `i-{i}` once, with a new `data.ts` (not "0", the seeded value: a patch
    // that changes nothing makes no event); a failed patch fails the run.
    send_each(direct, o.objects, 32, "patch", |i| {
        let path = format!("/api/v1/namespaces/{}/configmaps/i-{i}", o.namespace);
        let body = serde_json::json!({"data": {"ts": (i + 1).to_string()}}).to_string();
        direct.request(Method::PATCH, &path, Some(body.into()))
    })
    .await?;
    let want = ev0 + o.objects as f64;
    let deadline = Instant::now() + o.settle_timeout;
    let after = loop {
        let m = metrics(&admin).await?;
        if events(&m) >= want {
            break m;
        }
        if Instant::now() > deadline {
            px.stop().await;
            anyhow::bail!(
                "the proxy took in {} of {} events within {:?} of the last patch",
                events(&m) - ev0,
                want - ev0,
                o.settle_timeout
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let watch_s = t.elapsed().as_secs_f64();
    let watch_cpu_s = cpu(pid) - c0;
    let (watch_apiserver_cpu_s, watch_etcd_cpu_s) = (cpu(apiserver) - a0, cpu(etcd) - e0);
    px.stop().await;
    Ok(IngestResult {
        objects: o.objects,
        object_kib: o.object_kib,
        list_s,
        list_bytes,
        list_cpu_s,
        list_apiserver_cpu_s,
        list_etcd_cpu_s,
        idle_cpu_per_s,
        watch_events: events(&after) - ev0,
        watch_bytes: received(&after, "watch") - wb0,
        watch_s,
        watch_cpu_s,
        watch_apiserver_cpu_s,
        watch_etcd_cpu_s,
    })
}

pub fn markdown(r: &IngestResult) -> String {
    let mb = |b: f64| b / 1e6;
    format!(
        "## Ingest ({} ConfigMaps of {} KiB in lt-i; the proxy's default cached resources)\n\n\
         | phase | target | bytes taken in | proxy CPU | GB per CPU-second | wall | kube-apiserver CPU | etcd CPU |\n\
         |---|---|---|---|---|---|---|---|\n\
         | initial LIST (spawn to `/readyz`; the whole process, start-up included) | ≥ 1 GB/CPU-s | {:.1} MB | {:.2} s | {:.3} | {:.2} s | {:.2} s | {:.2} s |\n\
         | watch events ({:.0} MODIFIED events of whole objects) | ≥ 1 GB/CPU-s | {:.1} MB | {:.2} s | {:.3} | {:.2} s | {:.2} s | {:.2} s |\n\n\
         The proxy at rest: {:.3} CPU-s per second (in the watch row's CPU: {:.2} s of it). \
         Bytes: the bodies of the upstream responses the proxy's \
         reflectors read (`kube_cache_proxy_upstream_received_bytes_total`), before TLS and \
         HTTP/2 framing.\n",
        r.objects,
        r.object_kib,
        mb(r.list_bytes),
        r.list_cpu_s,
        r.list_gb_per_cpu_s(),
        r.list_s,
        r.list_apiserver_cpu_s,
        r.list_etcd_cpu_s,
        r.watch_events,
        mb(r.watch_bytes),
        r.watch_cpu_s,
        r.watch_gb_per_cpu_s(),
        r.watch_s,
        r.watch_apiserver_cpu_s,
        r.watch_etcd_cpu_s,
        r.idle_cpu_per_s,
        r.idle_cpu_per_s * r.watch_s,
    )
}
