//! Scenarios `pb-fanout` and `pb-list`: the protobuf benchmarks of the native-protobuf issue,
//! the apiserver straight and the proxy in one run, asked for with client-go's protobuf
//! `Accept` (`application/vnd.kubernetes.protobuf, application/json`).
//!
//! - `pb-fanout`: N protobuf watchers on one namespace's pods (S streams per HTTP/2
//!   connection) while a writer merge-patches pods of about 5 KB straight at the apiserver at
//!   a rate, its send time in the annotation `loadtest/ts`, read back from each frame with
//!   the proxy's own protobuf readers (scenario a's fan-out with [`Churned::Pods`] and
//!   [`Encoding::Protobuf`]). Phases: the apiserver in protobuf; the proxy in protobuf; the
//!   same proxy in JSON (`Accept: application/json`), so its CPU per delivery is compared
//!   under the same upstream load (its protobuf side keeps running in the JSON phase). Each
//!   rate of `--pb-rates` is one phase per side: the highest at which p99 ≤ 50 ms with
//!   nothing missed is the reported capacity; one rate is a fixed-rate measurement.
//! - `pb-list`: P walkers each walk K pods of about 1 KB with `limit=500` and continue
//!   tokens in protobuf: the apiserver, then the proxy. Pages are counted by reading the
//!   protobuf list; a page before a walk's last that holds fewer items than asked for is
//!   counted (`short_pages`), and pages per walk are compared between the sides. With it,
//!   the memory of the protobuf representation: the proxy's RSS before its first protobuf
//!   request and once its protobuf side has synced, against
//!   `kube_cache_proxy_cache_protobuf_bytes`.
//!
//! The proxy serves protobuf from its cache only once its protobuf side for the resource has
//! synced (the first protobuf request starts it; until then protobuf requests are passed
//! through). Before a measured proxy phase a protobuf LIST starts it and [`sync_protobuf`]
//! waits (bounded) until every cached pod has its envelope; each phase then reports what
//! served its requests (`kube_cache_proxy_requests_total{resource="pods",served_by}`).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use http::Method;
use serde::Serialize;

use crate::client::fetch;
use crate::proxy::{ProxyChild, ServedBy, served};
use crate::report::{cpu_rss, lat};
use crate::scenarios::{
    Churned, Encoding, FanoutOpts, ListResult, WalkSpec, create_namespace, create_objects,
    list_storm,
};
use crate::stats::{metrics, sum};
use crate::sweep::{Capacity, FanoutPhase, P99_TARGET_MS, fanout_phase, watches_from_cache};
use crate::{Check, Env, Usage};

/// The fan-out's namespace and the list walk's.
const FANOUT_NS: &str = "lt-pb";
const LIST_NS: &str = "lt-pbl";
/// Pods the fan-out's writer patches in turn (as scenario a's 50 ConfigMaps: a watcher's
/// events are spread over several objects).
const FANOUT_PODS: usize = 20;
/// Annotation padding of the fan-out's pods (about 5 KB in protobuf with the defaulted spec
/// and the ServiceAccount token volume) and of the list's (about 1 KB).
const FANOUT_PAD: usize = 3_600;
const LIST_PAD: usize = 0;
/// How long the proxy's protobuf side may take to sync before the phase runs anyway (and
/// says so): 100,000 pods arrive as one upstream watch's initial events.
const SYNC_WITHIN: Duration = Duration::from_secs(300);

/// Sizes of both scenarios (`--pb-*`).
#[derive(Debug, Clone, Serialize)]
pub struct PbOpts {
    pub watchers: usize,
    pub streams_per_conn: usize,
    /// Writes per second, one fan-out phase per side each.
    pub rates: Vec<f64>,
    pub secs: f64,
    pub pods: usize,
    pub walkers: usize,
    pub limit: usize,
}

/// The proxy's protobuf side for pods, from its `/metrics`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProtoSide {
    /// From the protobuf LIST that started it to the last reading.
    pub waited_s: f64,
    /// Every cached pod had its envelope (and at least as many as seeded).
    pub synced: bool,
    /// `kube_cache_proxy_cache_protobuf_objects{resource="pods"}`, with and without.
    pub with: f64,
    pub without: f64,
    /// `kube_cache_proxy_cache_protobuf_bytes{resource="pods"}`.
    pub bytes: f64,
    /// `kube_cache_proxy_cache_bytes{resource="pods"}`: the JSON bodies.
    pub json_bytes: f64,
}

impl ProtoSide {
    fn read(text: &str, expected: usize, waited: Duration) -> ProtoSide {
        let objects = |state: &str| {
            let state = format!("state=\"{state}\"");
            sum(
                text,
                "kube_cache_proxy_cache_protobuf_objects",
                &[PODS, &state],
            )
        };
        let (with, without) = (objects("with"), objects("without"));
        ProtoSide {
            waited_s: waited.as_secs_f64(),
            synced: without == 0.0 && with > 0.0 && with >= expected as f64,
            with,
            without,
            bytes: sum(text, "kube_cache_proxy_cache_protobuf_bytes", &[PODS]),
            json_bytes: sum(text, "kube_cache_proxy_cache_bytes", &[PODS]),
        }
    }
}

const PODS: &str = "resource=\"pods\"";

/// Starts the proxy's protobuf side for pods (a protobuf LIST through it, `limit=1`) and
/// waits until every cached pod, at least `expected`, has its envelope, or `within`.
pub async fn sync_protobuf(
    px: &ProxyChild,
    ns: &str,
    expected: usize,
    within: Duration,
) -> anyhow::Result<ProtoSide> {
    let admin = px.admin.as_ref().context("the proxy's admin listener")?;
    let t0 = Instant::now();
    let conn = px.target.connect().await?;
    let path = format!("/api/v1/namespaces/{ns}/pods?limit=1");
    fetch(&conn, Encoding::Protobuf.request(&px.target, &path)).await?;
    loop {
        let side = ProtoSide::read(&metrics(admin).await?, expected, t0.elapsed());
        if side.synced || t0.elapsed() >= within {
            say!(
                "proxy protobuf side for pods: {} after {:.1}s ({} with, {} without their envelope)",
                if side.synced { "synced" } else { "NOT synced" },
                side.waited_s,
                side.with,
                side.without
            );
            return Ok(side);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Starts the proxy, runs `f` with it and stops it, whatever `f` returned.
async fn with_proxy<T>(
    env: &Env,
    f: impl AsyncFnOnce(&ProxyChild) -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let px = env.start_proxy().await?;
    let r = f(&px).await;
    px.stop().await;
    r
}

/// Creates `ns`, its ServiceAccount `default` (the ServiceAccount admission plugin rejects
/// pods without it, and no controller-manager creates it here) and `count` pods `w-{i}`
/// carrying `pad` bytes in an annotation, straight at the apiserver. Returns pods per
/// second and the size of `w-0` in protobuf and in JSON.
pub(crate) async fn seed_pods(
    env: &Env,
    ns: &str,
    count: usize,
    pad: usize,
) -> anyhow::Result<(f64, usize, usize)> {
    let d = &env.direct;
    create_namespace(d, &env.admin_conn().await?, ns).await?;
    let sa = format!("/api/v1/namespaces/{ns}/serviceaccounts");
    create_objects(d, &sa, 1, 1, |_| {
        r#"{"metadata":{"name":"default"}}"#.into()
    })
    .await?;
    let filler = "x".repeat(pad);
    let pods = format!("/api/v1/namespaces/{ns}/pods");
    let rate = create_objects(d, &pods, count, 64, |i| {
        serde_json::json!({
            "metadata": {
                "name": format!("w-{i}"),
                "labels": {"loadtest": "pb", "app": format!("app-{}", i % 10)},
                "annotations": {"loadtest/pad": filler, "loadtest/ts": "0"},
            },
            "spec": {
                "containers": [{
                    "name": "c",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
                }],
                "terminationGracePeriodSeconds": 0,
            },
        })
        .to_string()
    })
    .await?;
    let one = format!("{pods}/w-0");
    let conn = env.admin_conn().await?;
    let pb = fetch(&conn, Encoding::Protobuf.request(d, &one)).await?;
    let json = fetch(&conn, d.request(Method::GET, &one, None)).await?;
    Ok((rate, pb.len(), json.len()))
}

// ---------------------------------------------------------------------------------------------
// pb-fanout
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize)]
pub struct FanoutReport {
    pub opts: PbOpts,
    pub pod_protobuf_bytes: usize,
    pub pod_json_bytes: usize,
    pub proto_side: ProtoSide,
    pub phases: Vec<FanoutPhase>,
}

/// Scenario pb-fanout: the apiserver in protobuf, then one proxy in protobuf and in JSON, at
/// each rate.
pub async fn fanout(env: &Env, o: &PbOpts) -> anyhow::Result<FanoutReport> {
    say!("pb-fanout: seeding {FANOUT_NS} ({FANOUT_PODS} pods) ...");
    let (_, pod_protobuf_bytes, pod_json_bytes) =
        seed_pods(env, FANOUT_NS, FANOUT_PODS, FANOUT_PAD).await?;
    say!("pb-fanout: a pod is {pod_protobuf_bytes} B in protobuf, {pod_json_bytes} B in JSON");
    let opts = |rate, encoding| FanoutOpts {
        churned: Churned::Pods,
        encoding,
        namespace: FANOUT_NS.into(),
        watchers: o.watchers,
        streams_per_conn: o.streams_per_conn,
        rate,
        objects: FANOUT_PODS,
        duration_s: o.secs,
        pad: 0,
    };
    let mut phases = Vec::new();
    for &rate in &o.rates {
        phases.push(fanout_phase(env, None, &opts(rate, Encoding::Protobuf)).await?);
    }
    let proto_side = with_proxy(env, async |px| {
        let side = sync_protobuf(px, FANOUT_NS, FANOUT_PODS, SYNC_WITHIN).await?;
        for &rate in &o.rates {
            for encoding in [Encoding::Protobuf, Encoding::Json] {
                phases.push(fanout_phase(env, Some(px), &opts(rate, encoding)).await?);
            }
        }
        Ok(side)
    })
    .await?;
    Ok(FanoutReport {
        opts: o.clone(),
        pod_protobuf_bytes,
        pod_json_bytes,
        proto_side,
        phases,
    })
}

fn fanout_checks(r: &FanoutReport) -> Vec<Check> {
    let mut out = Vec::new();
    for p in &r.phases {
        let what = format!("pb-fanout {} {:?} at {}/s", p.side, p.encoding, p.rate);
        out.push(Check {
            name: format!("{what}: nothing missed or duplicated"),
            pass: p.result.missed == 0 && p.result.duplicated == 0 && p.result.watch_errors == 0,
            detail: format!(
                "missed {}, duplicated {}, watch errors {}",
                p.result.missed, p.result.duplicated, p.result.watch_errors
            ),
        });
        if p.side == "proxy" {
            out.push(watches_from_cache(&what, &p.watches));
        }
    }
    out
}

pub fn fanout_markdown(r: &FanoutReport) -> String {
    let o = &r.opts;
    let mut s = format!(
        "## pb-fanout\n\n{} watchers ({} streams per HTTP/2 connection, TLS) on `{FANOUT_NS}`'s \
         pods; a writer merge-patches {FANOUT_PODS} pods ({} B each in protobuf, {} B in JSON) \
         straight at the apiserver at the rate in the row for {} s, its send time in the \
         annotation `loadtest/ts`, read back from every frame with the proxy's protobuf readers. \
         Accept `protobuf`: client-go's `application/vnd.kubernetes.protobuf, application/json`; \
         `json`: `application/json`. The proxy's two phases run on one proxy process, its \
         protobuf side running in both. CPU is over the phase, opening the watches included; \
         `watches` counts the proxy's pods WATCH requests by what served them \
         (`kube_cache_proxy_requests_total`).\n\n\
         Proxy protobuf side: started by a protobuf LIST, {} after {:.1} s ({} pods with their \
         envelope, {} without, {:.1} MB of envelopes).\n\n\
         | side | Accept | writes/s (achieved) | watchers (conns) | deliveries | deliveries/s | latency p50 / p99 / max (ms) | a write's first / last delivery, median (ms) | missed | duplicated | watches cache / passed through | proxy CPU, RSS | proxy µs/delivery | kube-apiserver CPU, RSS | apiserver µs/delivery | driver CPU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        o.watchers,
        o.streams_per_conn,
        r.pod_protobuf_bytes,
        r.pod_json_bytes,
        o.secs,
        if r.proto_side.synced {
            "synced"
        } else {
            "NOT synced"
        },
        r.proto_side.waited_s,
        r.proto_side.with,
        r.proto_side.without,
        r.proto_side.bytes / 1e6,
    );
    for p in &r.phases {
        let f = &p.result;
        s.push_str(&format!(
            "| {} | {} | {} ({:.1}) | {} ({}) | {} | {:.0} | {} | {} | {} | {} | {} |\n",
            p.side,
            match p.encoding {
                Encoding::Json => "json",
                Encoding::Protobuf => "protobuf",
            },
            p.rate,
            f.write_rate,
            f.watchers,
            f.connections,
            f.deliveries,
            f.deliveries_per_s,
            lat(&f.latency),
            crate::report::first_last(f),
            f.missed,
            f.duplicated,
            crate::report::served_and_cost_cells(p),
        ));
    }
    s.push_str(&format!(
        "\nCapacity, the highest write rate tried at which p99 ≤ {P99_TARGET_MS} ms with nothing \
         missed or duplicated (rates tried: {:?}/s; deliveries/s at one rate is that rate × \
         the watchers, not a capacity):\n\n\
         - apiserver, protobuf: {}\n- proxy, protobuf: {}\n- proxy, JSON: {}\n",
        o.rates,
        Capacity::of(&r.phases, "apiserver", Encoding::Protobuf),
        Capacity::of(&r.phases, "proxy", Encoding::Protobuf),
        Capacity::of(&r.phases, "proxy", Encoding::Json),
    ));
    if o.rates.len() == 1 {
        s.push_str("\nOne rate was tried: this is a fixed-rate measurement, not a capacity.\n");
    }
    s
}

// ---------------------------------------------------------------------------------------------
// pb-list
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Serialize)]
pub struct ListPhase {
    pub side: &'static str,
    pub result: ListResult,
    pub usage: Usage,
    /// The apiserver's pods LISTs during the walks (through the proxy: what it sent
    /// upstream, every client's included).
    pub apiserver_lists: u64,
    /// The proxy's pods LIST requests during the walks, by what served them.
    pub pages: ServedBy,
}

/// The memory of the protobuf representation in the proxy.
#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    /// VmRSS once ready (JSON caches synced), before any protobuf request.
    pub rss_before_mb: f64,
    /// VmRSS once the protobuf side for pods has synced.
    pub rss_synced_mb: f64,
    pub proto_side: ProtoSide,
    /// (RSS synced − RSS before) / pods with their envelope.
    pub extra_rss_per_object_b: f64,
    pub protobuf_bytes_per_object: f64,
    /// `extra_rss_per_object_b / protobuf_bytes_per_object` (the target: ≤ 1.1).
    pub ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ListReport {
    pub opts: PbOpts,
    pub create_rate: f64,
    pub pod_protobuf_bytes: usize,
    pub pod_json_bytes: usize,
    pub phases: Vec<ListPhase>,
    pub memory: Option<Memory>,
}

async fn list_phase(env: &Env, px: Option<&ProxyChild>, o: &PbOpts) -> anyhow::Result<ListPhase> {
    let t = px.map_or(&env.direct, |p| &p.target);
    say!(
        "pb-list via {}: {} walkers, {} pods, limit={}",
        t.side,
        o.walkers,
        o.pods,
        o.limit
    );
    let spec = WalkSpec {
        path: format!("/api/v1/namespaces/{LIST_NS}/pods"),
        limit: o.limit,
        encoding: Encoding::Protobuf,
    };
    let before = (
        env.scrape_resource("pods").await?,
        served(px, "pods", "LIST").await?,
    );
    let (result, usage) = env
        .measure(px, list_storm(t, &spec, o.walkers, 1, o.pods, None))
        .await?;
    let after = (
        env.scrape_resource("pods").await?,
        served(px, "pods", "LIST").await?,
    );
    Ok(ListPhase {
        side: t.side,
        result,
        usage,
        apiserver_lists: after.0.delta(&before.0).get("LIST").copied().unwrap_or(0),
        pages: after.1.since(before.1),
    })
}

/// Scenario pb-list: the apiserver, then the proxy once its protobuf side synced (its RSS read
/// before the first protobuf request and after the sync).
pub async fn list(env: &Env, o: &PbOpts) -> anyhow::Result<ListReport> {
    say!("pb-list: seeding {LIST_NS} ({} pods) ...", o.pods);
    let (create_rate, pod_protobuf_bytes, pod_json_bytes) =
        seed_pods(env, LIST_NS, o.pods, LIST_PAD).await?;
    say!(
        "pb-list: created at {create_rate:.0}/s; a pod is {pod_protobuf_bytes} B in protobuf, \
         {pod_json_bytes} B in JSON"
    );
    let mut phases = vec![list_phase(env, None, o).await?];
    let memory = with_proxy(env, async |px| {
        let memory = match px.pid {
            Some(pid) => {
                let rss_mb = || async {
                    // Let the allocator settle after the sync before reading.
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    crate::stats::rss_kb(pid).unwrap_or(0) as f64 / 1024.0
                };
                let rss_before_mb = rss_mb().await;
                let side = sync_protobuf(px, LIST_NS, o.pods, SYNC_WITHIN).await?;
                let rss_synced_mb = rss_mb().await;
                let per = |v: f64| v / side.with.max(1.0);
                let extra = per((rss_synced_mb - rss_before_mb) * 1024.0 * 1024.0);
                let pb = per(side.bytes);
                Some(Memory {
                    rss_before_mb,
                    rss_synced_mb,
                    extra_rss_per_object_b: extra,
                    protobuf_bytes_per_object: pb,
                    ratio: extra / pb.max(1.0),
                    proto_side: side,
                })
            }
            None => {
                sync_protobuf(px, LIST_NS, o.pods, SYNC_WITHIN).await?;
                None
            }
        };
        phases.push(list_phase(env, Some(px), o).await?);
        Ok(memory)
    })
    .await?;
    Ok(ListReport {
        opts: o.clone(),
        create_rate,
        pod_protobuf_bytes,
        pod_json_bytes,
        memory,
        phases,
    })
}

fn list_checks(r: &ListReport) -> Vec<Check> {
    let mut out = Vec::new();
    for p in &r.phases {
        let l = &p.result;
        out.push(Check {
            name: format!("pb-list {}: every walk returned every pod", p.side),
            pass: l.wrong_counts == 0 && l.errors == 0 && l.walks == r.opts.walkers,
            detail: format!(
                "{} walks, {} with a wrong count, {} errors",
                l.walks, l.wrong_counts, l.errors
            ),
        });
        out.push(Check {
            name: format!("pb-list {}: full pages of `limit` items", p.side),
            pass: l.short_pages == 0,
            detail: format!("{} short pages before a walk's last", l.short_pages),
        });
        if p.side == "proxy" {
            out.push(Check {
                name: "pb-list proxy: every page served from the cache".into(),
                pass: p.pages.upstream == 0 && p.apiserver_lists == 0,
                detail: format!(
                    "{} from the cache, {} passed through; the apiserver counted {} pods LISTs",
                    p.pages.cache, p.pages.upstream, p.apiserver_lists
                ),
            });
        }
    }
    let per_walk: Vec<usize> = r
        .phases
        .iter()
        .map(|p| p.result.pages / p.result.walks.max(1))
        .collect();
    out.push(Check {
        name: "pb-list: the same pages per walk on both sides (equal `limit` semantics)".into(),
        pass: per_walk.windows(2).all(|w| w[0] == w[1]),
        detail: format!("pages per walk: {per_walk:?}"),
    });
    out
}

pub fn list_markdown(r: &ListReport) -> String {
    let o = &r.opts;
    let mut s = format!(
        "## pb-list\n\n{} walkers in parallel (one HTTP/2 connection each, TLS) each walk {} pods \
         of `{LIST_NS}` ({} B each in protobuf, {} B in JSON; created at {:.0}/s straight at \
         the apiserver) with `limit={}` and continue tokens, Accept client-go's \
         `application/vnd.kubernetes.protobuf, application/json`. Items are counted by reading \
         each protobuf list page. The proxy's walk starts once its protobuf side for pods has \
         synced. `upstream LISTs`: the apiserver's pods LISTs during the walks; `pages cache / \
         passed through`: the proxy's own count.\n\n\
         | side | walks | pages per walk | short pages | page latency p50 / p99 / max (ms) | walk time p50 / max (s) | items/s | GB/s | upstream LISTs | pages cache / passed through | proxy CPU, RSS | kube-apiserver CPU, RSS | driver CPU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        o.walkers, o.pods, r.pod_protobuf_bytes, r.pod_json_bytes, r.create_rate, o.limit,
    );
    for p in &r.phases {
        let l = &p.result;
        s.push_str(&format!(
            "| {} | {} | {:.1} | {} | {} | {:.2} / {:.2} | {:.0} | {:.3} | {} | {} | {} | {} | {} |\n",
            p.side,
            l.walks,
            l.pages as f64 / l.walks.max(1) as f64,
            l.short_pages,
            lat(&l.page_latency),
            l.walk_time.p50_ms / 1000.0,
            l.walk_time.max_ms / 1000.0,
            l.items_per_s,
            l.mb_per_s / 1000.0,
            p.apiserver_lists,
            if p.side == "proxy" {
                format!("{} / {}", p.pages.cache, p.pages.upstream)
            } else {
                "-".into()
            },
            cpu_rss(&p.usage, "proxy"),
            cpu_rss(&p.usage, "kube-apiserver"),
            cpu_rss(&p.usage, "driver"),
        ));
    }
    if let Some(m) = &r.memory {
        let side = &m.proto_side;
        s.push_str(&format!(
            "\n### Memory of the protobuf representation\n\n\
             The proxy's RSS once ready (JSON caches synced, no protobuf request yet): {:.1} MB; \
             once its protobuf side for pods synced ({} after {:.1} s; {} pods with their \
             envelope, {} without): {:.1} MB. `kube_cache_proxy_cache_protobuf_bytes` for pods: \
             {:.1} MB (JSON bodies: {:.1} MB).\n\n\
             | extra RSS per pod | protobuf bytes per pod | ratio (target ≤ 1.10) |\n|---|---|---|\n\
             | {:.0} B | {:.0} B | {:.2} |\n\n\
             RSS moves with the allocator's retention and everything else the process does \
             meanwhile (the upstream protobuf watch's buffers, the LIST that started it): \
             read the ratio as an estimate over {} objects.\n",
            m.rss_before_mb,
            if side.synced { "synced" } else { "NOT synced" },
            side.waited_s,
            side.with,
            side.without,
            m.rss_synced_mb,
            side.bytes / 1e6,
            side.json_bytes / 1e6,
            m.extra_rss_per_object_b,
            m.protobuf_bytes_per_object,
            m.ratio,
            side.with,
        ));
    }
    s
}

/// Runs the protobuf scenarios asked for (`--only pb-fanout,pb-list`), writes their reports
/// and returns whether every check passed.
pub async fn run(
    env: &Env,
    o: &PbOpts,
    want: impl Fn(&str) -> bool,
    out: &std::path::Path,
    extra_config: Option<&str>,
) -> anyhow::Result<bool> {
    if !matches!(env.cluster, crate::Cluster::Local { .. }) {
        anyhow::bail!("pb-fanout and pb-list read the proxy's own /metrics: not with --kubeconfig");
    }
    let mut checks = Vec::new();
    if want("pb-fanout") {
        let r = fanout(env, o).await?;
        checks.extend(fanout_checks(&r));
        crate::write_scenario_report(out, "pb-fanout", fanout_markdown(&r), extra_config, &r)?;
    }
    if want("pb-list") {
        let r = list(env, o).await?;
        checks.extend(list_checks(&r));
        crate::write_scenario_report(out, "pb-list", list_markdown(&r), extra_config, &r)?;
    }
    for c in checks.iter().filter(|c| !c.pass) {
        say!("CHECK FAILED: {}: {}", c.name, c.detail);
    }
    Ok(checks.iter().all(|c| c.pass))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protobuf_side_is_synced_when_no_pod_lacks_its_envelope() {
        let text = "kube_cache_proxy_cache_protobuf_objects{resource=\"pods\",state=\"with\"} 5\n\
                    kube_cache_proxy_cache_protobuf_objects{resource=\"pods\",state=\"without\"} 0\n\
                    kube_cache_proxy_cache_protobuf_objects{resource=\"configmaps\",state=\"without\"} 3\n\
                    kube_cache_proxy_cache_protobuf_bytes{resource=\"pods\"} 5000\n";
        let s = ProtoSide::read(text, 5, Duration::ZERO);
        assert!(s.synced);
        assert_eq!((s.with, s.without, s.bytes), (5.0, 0.0, 5000.0));
        // Fewer than seeded, or a side that has not started (no samples): not synced.
        assert!(!ProtoSide::read(text, 6, Duration::ZERO).synced);
        assert!(!ProtoSide::read("", 0, Duration::ZERO).synced);
    }
}
