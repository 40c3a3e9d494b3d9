//! Scenario f: watch-field filtering, the proxy's opt-in extension (`docs/watch-fields.md`).
//!
//! Deployments get a status-heavy churn straight at the apiserver: most writes are
//! `deployments/status` merge patches (a new `status.observedGeneration`, as a heartbeat would
//! change a status), every `spec_every`-th write changes `spec` (an annotation of the pod
//! template). Watchers read the namespace's deployments; in the filtered phase every second
//! watcher sends `X-Kube-Cache-Proxy-Watch-Fields: spec`. The report compares, in one run, the
//! apiserver direct (no watcher can filter there), the proxy without filters and the proxy with
//! half the watchers filtered: deliveries, bytes read by the watchers, and the proxy's CPU per
//! write.
//!
//! Checked: an unfiltered watcher gets every write once; a filtered watcher gets every spec
//! write once and no status-only write, its responses say `applied`, and its resourceVersion
//! reaches the last write (from the proxy's bookmarks) although most events are suppressed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::bail;
use bytes::Bytes;
use http::{HeaderValue, Method};
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, Semaphore, watch};

use crate::client::{Conn, LineReader, Target, expect_ok, fetch, send, unix_nanos};
use crate::scenarios::{Until, join_watchers};
use crate::stats::{Summary, summarize};

/// The request header that asks the proxy to filter a watch.
pub const WATCH_FIELDS: &str = "x-kube-cache-proxy-watch-fields";
/// The response header that says whether the proxy filtered it.
const WATCH_FILTER: &str = "x-kube-cache-proxy-watch-filter";

#[derive(Debug, Clone, Serialize)]
pub struct FieldsOpts {
    pub namespace: String,
    pub watchers: usize,
    pub streams_per_conn: usize,
    /// Writes per second, all kinds together.
    pub rate: f64,
    /// Every `spec_every`-th write changes `spec`; the others change only `status`.
    pub spec_every: usize,
    pub objects: usize,
    pub duration_s: f64,
}

/// What one group of watchers (filtered or not) received.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GroupResult {
    pub watchers: usize,
    /// ADDED/MODIFIED/DELETED events read.
    pub deliveries: u64,
    pub bookmarks: u64,
    /// Bytes of watch events read (lines, bookmarks included).
    pub bytes: u64,
    /// Writes this group should have received but did not, summed over watchers.
    pub missed: u64,
    pub duplicated: u64,
    /// Status-only writes delivered to a filtered watcher (must be 0).
    pub unexpected: u64,
    /// Watchers whose resourceVersion (events and bookmarks) did not reach the last write.
    pub behind: usize,
    /// Watch responses that said `X-Kube-Cache-Proxy-Watch-Filter: applied`.
    pub applied: usize,
    pub rewatches: u64,
    pub watch_errors: u64,
    /// Write (timestamp taken just before the PATCH) to receipt, spec writes only: the events
    /// both groups get.
    pub spec_latency: Summary,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct FieldsResult {
    /// `none` (every watcher unfiltered) or `half` (every second watcher filters on `spec`).
    pub filters: String,
    pub connections: usize,
    pub writes: usize,
    pub spec_writes: usize,
    pub write_errors: u64,
    pub write_rate: f64,
    pub unfiltered: GroupResult,
    pub filtered: GroupResult,
}

impl FieldsResult {
    pub fn deliveries(&self) -> u64 {
        self.unfiltered.deliveries + self.filtered.deliveries
    }
    pub fn bytes(&self) -> u64 {
        self.unfiltered.bytes + self.filtered.bytes
    }
}

#[derive(Deserialize)]
struct Line {
    #[serde(rename = "type")]
    ty: String,
    object: Obj,
}

#[derive(Deserialize)]
struct Obj {
    metadata: Meta,
}

#[derive(Deserialize)]
struct Meta {
    #[serde(rename = "resourceVersion", default)]
    resource_version: String,
}

#[derive(Deserialize)]
struct ListMeta {
    #[serde(rename = "resourceVersion", default)]
    resource_version: String,
}

#[derive(Deserialize)]
struct List {
    metadata: ListMeta,
}

fn deployments(ns: &str) -> String {
    format!("/apis/apps/v1/namespaces/{ns}/deployments")
}

/// Creates `count` Deployments `f-{i}` in `ns` (an existing one is fine). Nothing runs them:
/// the load driver's control plane has no controller manager.
pub async fn create_deployments(
    t: &Target,
    conn: &Conn,
    ns: &str,
    count: usize,
) -> anyhow::Result<()> {
    for i in 0..count {
        let name = format!("f-{i}");
        let body = serde_json::json!({
            "metadata": {"name": name, "labels": {"loadtest": "f"}},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}, "annotations": {"ts": "0"}},
                    "spec": {"containers": [{"name": "c", "image": "registry.example/app:1"}]},
                },
            },
        })
        .to_string();
        let resp = send(
            conn,
            t.request(Method::POST, &deployments(ns), Some(body.into())),
        )
        .await?;
        let status = resp.status();
        if !(status.is_success() || status == http::StatusCode::CONFLICT) {
            bail!("creating deployment {name}: {status}");
        }
    }
    Ok(())
}

struct Log {
    filtered: bool,
    /// (resourceVersion, receipt time in Unix ns) of each ADDED/MODIFIED/DELETED event.
    events: Vec<(u64, u64)>,
    bookmarks: u64,
    bytes: u64,
    /// Highest resourceVersion seen, bookmarks included.
    max_rv: u64,
    applied: bool,
    rewatches: u64,
    errors: u64,
}

async fn run_watcher(
    t: Target,
    conn: Conn,
    path: String,
    start_rv: String,
    filtered: bool,
    ready: tokio::sync::mpsc::Sender<anyhow::Result<()>>,
    mut until: watch::Receiver<Until>,
) -> Log {
    let mut log = Log {
        filtered,
        events: Vec::new(),
        bookmarks: 0,
        bytes: 0,
        max_rv: 0,
        applied: false,
        rewatches: 0,
        errors: 0,
    };
    let mut rv = start_rv;
    let mut first = true;
    loop {
        let url = format!(
            "{path}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=1800"
        );
        let mut req = t.request(Method::GET, &url, None);
        if filtered {
            req.headers_mut()
                .insert(WATCH_FIELDS, HeaderValue::from_static("spec"));
        }
        let opened = match send(&conn, req).await {
            Ok(r) => expect_ok(r, "watch").await,
            Err(e) => Err(e),
        };
        let resp = match opened {
            Ok(r) => r,
            Err(e) => {
                log.errors += 1;
                if first {
                    let _ = ready.send(Err(e)).await;
                }
                return log;
            }
        };
        log.applied = resp
            .headers()
            .get(WATCH_FILTER)
            .is_some_and(|v| v == "applied");
        if first {
            let _ = ready.send(Ok(())).await;
            first = false;
        }
        let mut lines = LineReader::new(resp);
        loop {
            match *until.borrow() {
                Until::Stop => return log,
                Until::Rv(target) if log.max_rv >= target => return log,
                _ => {}
            }
            let line = tokio::select! {
                l = lines.next() => l,
                _ = until.changed() => continue,
            };
            let line = match line {
                Ok(Some(l)) => l,
                Ok(None) => break,
                Err(_) => {
                    log.errors += 1;
                    break;
                }
            };
            let now_ns = unix_nanos();
            log.bytes += line.len() as u64 + 1;
            let Ok(ev) = serde_json::from_slice::<Line>(&line) else {
                log.errors += 1;
                continue;
            };
            let r: u64 = ev.object.metadata.resource_version.parse().unwrap_or(0);
            match ev.ty.as_str() {
                "ERROR" => {
                    log.errors += 1;
                    return log;
                }
                "BOOKMARK" => log.bookmarks += 1,
                _ => log.events.push((r, now_ns)),
            }
            log.max_rv = log.max_rv.max(r);
            rv = ev.object.metadata.resource_version;
        }
        log.rewatches += 1;
    }
}

/// One phase of scenario f: `opts.watchers` watchers on `target` (every second one filtered on
/// `spec` when `filter_half`), the churn written straight to the apiserver through `writer`.
pub async fn watch_fields(
    target: &Target,
    direct: &Target,
    writer: &Conn,
    o: &FieldsOpts,
    filter_half: bool,
) -> anyhow::Result<FieldsResult> {
    let path = deployments(&o.namespace);
    // The collection's resourceVersion as the target serves it (an informer's LIST).
    let lister = target.connect().await?;
    let list = fetch(
        &lister,
        target.request(Method::GET, &format!("{path}?limit=1"), None),
    )
    .await?;
    let start_rv = serde_json::from_slice::<List>(&list)?
        .metadata
        .resource_version;
    let n_conns = o.watchers.div_ceil(o.streams_per_conn.max(1));
    let mut conns = Vec::with_capacity(n_conns);
    for _ in 0..n_conns {
        conns.push(target.connect().await?);
    }
    let (until_tx, until_rx) = watch::channel(Until::Running);
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(o.watchers.max(1));
    let mut watchers = tokio::task::JoinSet::new();
    for i in 0..o.watchers {
        watchers.spawn(run_watcher(
            target.clone(),
            conns[i / o.streams_per_conn.max(1)].clone(),
            path.clone(),
            start_rv.clone(),
            filter_half && i % 2 == 1,
            ready_tx.clone(),
            until_rx.clone(),
        ));
    }
    drop(ready_tx);
    for _ in 0..o.watchers {
        match tokio::time::timeout(Duration::from_secs(120), ready_rx.recv()).await {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(e))) => return Err(e.context("opening a watch")),
            Ok(None) | Err(_) => bail!("watches did not open within 120s"),
        }
    }

    // Churn, open loop: resourceVersion -> (write timestamp, spec write?).
    let written = Arc::new(Mutex::new(HashMap::<u64, (u64, bool)>::new()));
    let write_errors = Arc::new(AtomicU64::new(0));
    let sem = Arc::new(Semaphore::new(256));
    let first_write = Instant::now();
    let total = (o.rate * o.duration_s).round() as usize;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / o.rate.max(0.001)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut writes = tokio::task::JoinSet::new();
    for seq in 0..total {
        tick.tick().await;
        let permit = sem.clone().acquire_owned().await?;
        let name = format!("f-{}", seq % o.objects.max(1));
        let spec = seq % o.spec_every.max(1) == 0;
        let conn = writer.clone();
        let direct = direct.clone();
        let path = format!("{path}/{name}");
        let written = written.clone();
        let errors = write_errors.clone();
        writes.spawn(async move {
            let _permit = permit;
            let ts = unix_nanos();
            let (path, body) = if spec {
                (
                    path,
                    format!(
                        r#"{{"spec":{{"template":{{"metadata":{{"annotations":{{"ts":"{ts}"}}}}}}}}}}"#
                    ),
                )
            } else {
                // A new observedGeneration every time: a status-only change.
                (
                    format!("{path}/status"),
                    format!(r#"{{"status":{{"observedGeneration":{}}}}}"#, seq + 1),
                )
            };
            match fetch(
                &conn,
                direct.request(Method::PATCH, &path, Some(Bytes::from(body))),
            )
            .await
            .and_then(|b| Ok(serde_json::from_slice::<Obj>(&b)?))
            {
                Ok(obj) => {
                    let rv = obj.metadata.resource_version.parse().unwrap_or(0);
                    written.lock().await.insert(rv, (ts, spec));
                }
                Err(_) => {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        while writes.try_join_next().is_some() {}
    }
    while writes.join_next().await.is_some() {}
    let write_secs = first_write.elapsed().as_secs_f64();
    let written = std::mem::take(&mut *written.lock().await);
    let last = written.keys().copied().max().unwrap_or(0);
    let _ = until_tx.send(Until::Rv(last));

    // Every watcher should reach the last write (a filtered one through a bookmark, which the
    // proxy sends every `cache.filteredBookmarkInterval`); those that do not within the
    // deadline are stopped and counted.
    let logs = join_watchers(&mut watchers, &until_tx, Duration::from_secs(120)).await?;
    drop(conns);

    let all: HashSet<u64> = written.keys().copied().collect();
    let specs: HashSet<u64> = written
        .iter()
        .filter(|(_, (_, spec))| *spec)
        .map(|(rv, _)| *rv)
        .collect();
    let mut r = FieldsResult {
        filters: if filter_half { "half" } else { "none" }.into(),
        connections: n_conns,
        writes: written.len(),
        spec_writes: specs.len(),
        write_errors: write_errors.load(Ordering::Relaxed),
        write_rate: written.len() as f64 / write_secs,
        ..Default::default()
    };
    let mut lat: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
    for mut l in logs {
        let (g, expected) = if l.filtered {
            (&mut r.filtered, &specs)
        } else {
            (&mut r.unfiltered, &all)
        };
        g.watchers += 1;
        g.deliveries += l.events.len() as u64;
        g.bookmarks += l.bookmarks;
        g.bytes += l.bytes;
        g.rewatches += l.rewatches;
        g.watch_errors += l.errors;
        g.applied += usize::from(l.applied);
        g.behind += usize::from(l.max_rv < last);
        for (rv, at) in &l.events {
            if let Some((ts, true)) = written.get(rv) {
                lat[usize::from(l.filtered)].push(at.saturating_sub(*ts) / 1000);
            }
        }
        let mut rvs: Vec<u64> = l.events.drain(..).map(|(rv, _)| rv).collect();
        rvs.sort_unstable();
        let before = rvs.len();
        rvs.dedup();
        g.duplicated += (before - rvs.len()) as u64;
        let got = rvs.iter().filter(|rv| expected.contains(rv)).count();
        g.missed += (expected.len() - got) as u64;
        if l.filtered {
            g.unexpected += rvs
                .iter()
                .filter(|rv| all.contains(rv) && !specs.contains(rv))
                .count() as u64;
        }
    }
    let [u, f] = lat;
    r.unfiltered.spec_latency = summarize(u);
    r.filtered.spec_latency = summarize(f);
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// Scenario fields-attack (run alone: `--only fields-attack`): many *distinct* filters, the
// cross-namespace denial of service of issue 50. One proxy, every phase in the same run.

/// The proxy's configuration for the attack: bounds on distinct filters raised far above the
/// attack, so what is measured is the cost of the filters (the bounds are a separate defence).
pub const ATTACK_CONFIG: &str = "cache:\n  watchFields:\n    maxFiltersPerResource: 100000\n    maxFiltersPerIdentity: 100000\n";

#[derive(Debug, Clone, Serialize)]
pub struct AttackOpts {
    /// The attacker's namespace and the victim's.
    pub namespace: String,
    pub victim_namespace: String,
    /// Select phases: watchers (each with its own 32-path filter in the distinct phase) and
    /// writes per second of the small ConfigMap (each changes `data`, which every filter
    /// selects: delivered to all).
    pub select_watchers: usize,
    pub select_rate: f64,
    /// Ignore phases: watchers, keys of 8 bytes of the large ConfigMap, its writes per second
    /// (each changes its key `hot`, which every filter ignores: suppressed for all, so the
    /// phase measures the filters, not the deliveries of a large object).
    pub ignore_watchers: usize,
    pub keys: usize,
    pub ignore_rate: f64,
    pub streams_per_conn: usize,
    /// Seconds of writes per phase.
    pub secs: f64,
    /// The victim's writes per second (its own namespace, its own watch).
    pub victim_rate: f64,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct AttackPhase {
    pub name: String,
    pub watchers: usize,
    pub distinct_filters: usize,
    pub writes: usize,
    pub write_errors: u64,
    /// Proxy CPU seconds over the write window, per write (ms).
    pub proxy_cpu_ms_per_write: f64,
    pub proxy_cpu_s: f64,
    /// Events the attacker's watchers read.
    pub deliveries: u64,
    pub watch_errors: u64,
    /// The victim's watch (another namespace) through the proxy: write to receipt (the
    /// apiserver's write time included: large writes slow it whatever the proxy does)...
    pub victim: Summary,
    pub victim_missed: u64,
    /// ...the same events on a watch straight at the apiserver...
    pub victim_direct: Summary,
    /// ...and what the proxy added: its receipt minus the direct watch's, per event.
    pub victim_added: Summary,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct AttackResult {
    pub phases: Vec<AttackPhase>,
}

impl AttackResult {
    fn phase(&self, name: &str) -> Option<&AttackPhase> {
        self.phases.iter().find(|p| p.name == name)
    }

    /// (what, measured ratio, bound) of each claim. The victim's write-to-receipt includes
    /// the apiserver's own write of the attacker's large objects (it slows every write); the
    /// "adds" rows take it out (the proxy's receipt minus a direct watch's).
    pub fn checks(&self) -> Vec<(String, f64, f64)> {
        let ratio =
            |a: &str, b: &str, f: fn(&AttackPhase) -> f64| match (self.phase(a), self.phase(b)) {
                (Some(x), Some(y)) if f(y) > 0.0 => f(x) / f(y),
                _ => f64::NAN,
            };
        let cpu = |p: &AttackPhase| p.proxy_cpu_ms_per_write;
        let p99 = |p: &AttackPhase| p.victim.p99_ms;
        let added = |p: &AttackPhase| p.victim_added.p99_ms;
        vec![
            (
                "proxy CPU per write: distinct select filters / unfiltered watchers".into(),
                ratio("select-distinct", "select-unfiltered", cpu),
                2.0,
            ),
            (
                "proxy CPU per write: 100 distinct ignore filters / one shared filter".into(),
                ratio("ignore-distinct", "ignore-shared", cpu),
                2.0,
            ),
            (
                "victim watch p99: during the ignore attack / same writes, one shared filter"
                    .into(),
                ratio("ignore-distinct", "ignore-shared", p99),
                2.0,
            ),
            (
                "victim watch p99 (the apiserver's writes included): ignore attack / quiet".into(),
                ratio("ignore-distinct", "quiet", p99),
                2.0,
            ),
            (
                "victim p99 of what the proxy adds: ignore attack / same writes, one shared filter"
                    .into(),
                ratio("ignore-distinct", "ignore-shared", added),
                2.0,
            ),
            (
                "victim p99 of what the proxy adds: ignore attack / quiet (not gating: the quiet \
                 phase has no large writes)"
                    .into(),
                ratio("ignore-distinct", "quiet", added),
                2.0,
            ),
            (
                "victim p99 of what the proxy adds to the direct watch: select attack / unfiltered"
                    .into(),
                ratio("select-distinct", "select-unfiltered", added),
                2.0,
            ),
        ]
    }

    pub fn passed(&self) -> bool {
        self.phases
            .iter()
            .all(|p| p.write_errors == 0 && p.watch_errors == 0 && p.victim_missed == 0)
            && self
                .checks()
                .iter()
                .filter(|(what, _, _)| !what.contains("quiet"))
                .all(|(_, r, bound)| *r <= *bound)
    }
}

/// The `i`-th attacker's select filter: 30 annotation keys of its own, `data` and the
/// labels (32 paths, distinct per `i`).
fn select_filter(i: usize) -> String {
    (0..30)
        .map(|j| format!("metadata.annotations[example.com/w{i}-{j}]"))
        .chain(["data".to_string(), "metadata.labels".to_string()])
        .collect::<Vec<_>>()
        .join(",")
}

async fn put_configmap(
    t: &Target,
    conn: &Conn,
    ns: &str,
    name: &str,
    data: serde_json::Value,
) -> anyhow::Result<()> {
    let body = serde_json::json!({"metadata": {"name": name}, "data": data}).to_string();
    let path = format!("/api/v1/namespaces/{ns}/configmaps");
    let resp = send(conn, t.request(Method::POST, &path, Some(body.into()))).await?;
    let status = resp.status();
    if status == http::StatusCode::CONFLICT {
        let body = serde_json::json!({"data": data}).to_string();
        let mut req = t.request(Method::PATCH, &format!("{path}/{name}"), Some(body.into()));
        req.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/merge-patch+json"),
        );
        fetch(conn, req).await?;
    } else if !status.is_success() {
        bail!("creating configmap {ns}/{name}: {status}");
    }
    Ok(())
}

/// Creates the attacker's small and large ConfigMaps and the victim's.
pub async fn attack_setup(t: &Target, conn: &Conn, o: &AttackOpts) -> anyhow::Result<()> {
    for ns in [&o.namespace, &o.victim_namespace] {
        crate::scenarios::create_namespace(t, conn, ns).await?;
    }
    put_configmap(
        t,
        conn,
        &o.namespace,
        "small",
        serde_json::json!({"n": "0"}),
    )
    .await?;
    let big: serde_json::Map<String, serde_json::Value> = (0..o.keys)
        .map(|k| (format!("k{k}"), serde_json::json!("xxxxxxxx")))
        .chain([("hot".to_string(), serde_json::json!("00000000"))])
        .collect();
    put_configmap(t, conn, &o.namespace, "big", big.into()).await?;
    put_configmap(
        t,
        conn,
        &o.victim_namespace,
        "victim",
        serde_json::json!({"ts": "0"}),
    )
    .await?;
    Ok(())
}

/// A watch that counts what it reads until told to stop; the victim's (`victim`) records
/// each event's latency from the write time in its `data.ts`.
async fn attack_watcher(
    t: Target,
    conn: Conn,
    url: String,
    fields: Option<String>,
    victim: bool,
    ready: tokio::sync::mpsc::Sender<anyhow::Result<()>>,
    mut stop: watch::Receiver<bool>,
) -> (u64, u64, Vec<(u64, u64)>) {
    let (mut events, mut errors, mut lat) = (0u64, 0u64, Vec::new());
    let mut req = t.request(Method::GET, &url, None);
    if let Some(f) = &fields {
        match HeaderValue::from_str(f) {
            Ok(v) => {
                req.headers_mut().insert(WATCH_FIELDS, v);
            }
            Err(e) => {
                let _ = ready.send(Err(e.into())).await;
                return (0, 1, lat);
            }
        }
    }
    let resp = match send(&conn, req).await {
        Ok(r) => expect_ok(r, "watch").await,
        Err(e) => Err(e),
    };
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            let _ = ready.send(Err(e)).await;
            return (0, 1, lat);
        }
    };
    let _ = ready.send(Ok(())).await;
    let mut lines = LineReader::new(resp);
    loop {
        let line = tokio::select! {
            l = lines.next() => l,
            _ = stop.changed() => return (events, errors, lat),
        };
        let line = match line {
            Ok(Some(l)) => l,
            Ok(None) => return (events, errors, lat),
            Err(_) => return (events, errors + 1, lat),
        };
        let now = unix_nanos();
        events += 1;
        if victim {
            #[derive(Deserialize)]
            struct V {
                object: VObj,
            }
            #[derive(Deserialize)]
            struct VObj {
                #[serde(default)]
                data: HashMap<String, String>,
            }
            match serde_json::from_slice::<V>(&line) {
                Ok(v) => {
                    let ts: u64 = v
                        .object
                        .data
                        .get("ts")
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                    if ts > 0 {
                        lat.push((ts, now.saturating_sub(ts) / 1000));
                    }
                }
                Err(_) => errors += 1,
            }
        }
    }
}

/// Opens `filters.len()` watches of the attacker's namespace (`None`: no filter) and the
/// victim's watch, writes for `o.secs` (the attacker's `object`, the victim's ConfigMap), and
/// measures the proxy's CPU over the writes.
#[allow(clippy::too_many_arguments)]
async fn attack_phase(
    name: &str,
    t: &Target,
    direct: &Target,
    writer: &Conn,
    proxy_pid: u32,
    o: &AttackOpts,
    filters: Vec<Option<String>>,
    big: bool,
) -> anyhow::Result<AttackPhase> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let n_conns = filters.len().div_ceil(o.streams_per_conn.max(1)).max(1);
    let mut conns = Vec::with_capacity(n_conns);
    for _ in 0..n_conns {
        conns.push(t.connect().await?);
    }
    let rv_of = async |ns: &str| -> anyhow::Result<String> {
        let b = fetch(
            writer,
            direct.request(
                Method::GET,
                &format!("/api/v1/namespaces/{ns}/configmaps?limit=1"),
                None,
            ),
        )
        .await?;
        Ok(serde_json::from_slice::<List>(&b)?
            .metadata
            .resource_version)
    };
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(filters.len() + 1);
    let mut watchers = tokio::task::JoinSet::new();
    let distinct = filters.iter().flatten().collect::<HashSet<_>>().len();
    let rv = rv_of(&o.namespace).await?;
    let n = filters.len();
    for (i, f) in filters.into_iter().enumerate() {
        let url = format!(
            "/api/v1/namespaces/{}/configmaps?watch=1&resourceVersion={rv}&timeoutSeconds=1800",
            o.namespace
        );
        watchers.spawn(attack_watcher(
            t.clone(),
            conns[i / o.streams_per_conn.max(1)].clone(),
            url,
            f,
            false,
            ready_tx.clone(),
            stop_rx.clone(),
        ));
    }
    let vconn = t.connect().await?;
    let vrv = rv_of(&o.victim_namespace).await?;
    let victim = tokio::spawn(attack_watcher(
        t.clone(),
        vconn,
        format!(
            "/api/v1/namespaces/{}/configmaps?watch=1&resourceVersion={vrv}&timeoutSeconds=1800",
            o.victim_namespace
        ),
        None,
        true,
        ready_tx.clone(),
        stop_rx.clone(),
    ));
    let dconn = direct.connect().await?;
    let direct_victim = tokio::spawn(attack_watcher(
        direct.clone(),
        dconn,
        format!(
            "/api/v1/namespaces/{}/configmaps?watch=1&resourceVersion={vrv}&timeoutSeconds=1800",
            o.victim_namespace
        ),
        None,
        true,
        ready_tx.clone(),
        stop_rx.clone(),
    ));
    drop(ready_tx);
    for _ in 0..n + 2 {
        match tokio::time::timeout(Duration::from_secs(180), ready_rx.recv()).await {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(e))) => return Err(e.context("opening a watch")),
            Ok(None) | Err(_) => bail!("watches did not open within 180s"),
        }
    }
    // Let the opening settle before measuring.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let errors = Arc::new(AtomicU64::new(0));
    let cpu0 = crate::stats::cpu_seconds(proxy_pid).unwrap_or(0.0);
    let rate = if big { o.ignore_rate } else { o.select_rate };
    let total = (rate * o.secs).round() as usize;
    let victim_total = (o.victim_rate * o.secs).round() as usize;
    let patch = |ns: &str, name: &str, body: String| {
        let mut req = direct.request(
            Method::PATCH,
            &format!("/api/v1/namespaces/{ns}/configmaps/{name}"),
            Some(Bytes::from(body)),
        );
        req.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/merge-patch+json"),
        );
        req
    };
    let attacker = async {
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.001)));
        let mut js = tokio::task::JoinSet::new();
        for seq in 0..total {
            tick.tick().await;
            let (obj, body) = if big {
                (
                    "big",
                    format!(r#"{{"data":{{"hot":"{:08}"}}}}"#, (seq + 1) % 100_000_000),
                )
            } else {
                ("small", format!(r#"{{"data":{{"n":"{seq}"}}}}"#))
            };
            let req = patch(&o.namespace, obj, body);
            let conn = writer.clone();
            let errors = errors.clone();
            let write = async move {
                if let Err(e) = fetch(&conn, req).await
                    && errors.fetch_add(1, Ordering::Relaxed) == 0
                {
                    eprintln!("fields-attack: a write failed: {e:#}");
                }
            };
            // The large object's writes one at a time (at most the rate): concurrent ones
            // pile up in the apiserver, which then times them out (504).
            if big {
                write.await;
            } else {
                js.spawn(write);
            }
        }
        while js.join_next().await.is_some() {}
    };
    let victim_writes = async {
        let mut tick =
            tokio::time::interval(Duration::from_secs_f64(1.0 / o.victim_rate.max(0.001)));
        let mut written = Vec::new();
        for _ in 0..victim_total {
            tick.tick().await;
            let ts = unix_nanos();
            let req = patch(
                &o.victim_namespace,
                "victim",
                format!(r#"{{"data":{{"ts":"{ts}"}}}}"#),
            );
            if fetch(writer, req).await.is_ok() {
                written.push(ts);
            } else {
                errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        written
    };
    let (_, written) = tokio::join!(attacker, victim_writes);
    let cpu1 = crate::stats::cpu_seconds(proxy_pid).unwrap_or(0.0);
    // The last events' delivery, then stop.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop_tx.send(true);
    let (mut deliveries, mut watch_errors) = (0u64, 0u64);
    while let Some(r) = watchers.join_next().await {
        let (ev, err, _) = r?;
        deliveries += ev;
        watch_errors += err;
    }
    let (_, verr, vlat) = victim.await?;
    let (_, derr, dlat) = direct_victim.await?;
    let direct_at: HashMap<u64, u64> = dlat.iter().copied().collect();
    let added: Vec<u64> = vlat
        .iter()
        .filter_map(|(ts, us)| direct_at.get(ts).map(|d| us.saturating_sub(*d)))
        .collect();
    drop(conns);
    let seen: HashSet<u64> = vlat.iter().map(|(ts, _)| *ts).collect();
    let victim_missed = written.iter().filter(|ts| !seen.contains(ts)).count() as u64;
    let cpu = cpu1 - cpu0;
    // Per write the apiserver took (a failed one made no event).
    let write_errors = errors.load(Ordering::Relaxed);
    let done = total.saturating_sub(write_errors as usize);
    Ok(AttackPhase {
        name: name.into(),
        watchers: n,
        distinct_filters: distinct,
        writes: done,
        write_errors,
        proxy_cpu_ms_per_write: if done > 0 {
            cpu * 1e3 / done as f64
        } else {
            0.0
        },
        proxy_cpu_s: cpu,
        deliveries,
        watch_errors: watch_errors + verr + derr,
        victim: summarize(vlat.into_iter().map(|(_, us)| us).collect()),
        victim_missed,
        victim_direct: summarize(dlat.into_iter().map(|(_, us)| us).collect()),
        victim_added: summarize(added),
    })
}

/// Every phase of the attack against one proxy (`proxy_pid`), in one run: the victim alone;
/// the select form (unfiltered watchers, one shared filter, distinct filters); the ignore form
/// on the large ConfigMap (one shared filter, distinct filters).
pub async fn attack(
    t: &Target,
    direct: &Target,
    writer: &Conn,
    proxy_pid: u32,
    o: &AttackOpts,
) -> anyhow::Result<AttackResult> {
    let mut r = AttackResult::default();
    let w = o.select_watchers;
    let shared = select_filter(0);
    let ig = o.ignore_watchers;
    let phases: Vec<(&str, Vec<Option<String>>, bool)> = vec![
        ("quiet", vec![], false),
        ("select-unfiltered", vec![None; w], false),
        ("select-shared", vec![Some(shared); w], false),
        (
            "select-distinct",
            (0..w).map(|i| Some(select_filter(i))).collect(),
            false,
        ),
        (
            "ignore-shared",
            vec![Some("-data[hot],-data[k0]".to_string()); ig],
            true,
        ),
        (
            "ignore-distinct",
            (0..ig)
                .map(|i| Some(format!("-data[hot],-data[k{i}]")))
                .collect(),
            true,
        ),
    ];
    for (name, filters, big) in phases {
        eprintln!("fields-attack: phase {name} ({} watchers)", filters.len());
        let p = attack_phase(name, t, direct, writer, proxy_pid, o, filters, big).await?;
        eprintln!(
            "fields-attack: {name}: {:.2} ms proxy CPU per write, victim p99 {:.1} ms",
            p.proxy_cpu_ms_per_write, p.victim.p99_ms
        );
        r.phases.push(p);
    }
    Ok(r)
}

/// The report's table.
pub fn attack_markdown(o: &AttackOpts, r: &AttackResult) -> String {
    let mut md = format!(
        "# fields-attack: distinct watch field filters (one proxy, one run)\n\n\
         Select phases: {} watchers of `{}`, writes of a small ConfigMap's `data` at {}/s \
         (every filter selects `data`: delivered to all). Ignore phases: {} watchers, a \
         ConfigMap of {} keys × 8 B whose key `hot` is written at {}/s, every filter ignoring \
         `hot` and one key of its own (`-data[hot],-data[k<i>]`; the shared phase: all \
         `-data[hot],-data[k0]`), one write at a time: nothing is delivered, the filters are what \
         costs. Each phase {} s of \
         writes; the victim writes its own ConfigMap in `{}` at {}/s and watches it.\n\n\
         Victim: write to receipt through the proxy (p50/p99/max), the same on a watch straight at \
         the apiserver (p99), and the proxy's receipt minus the direct one per event (p50/p99).\n\n\
         | phase | watchers | distinct filters | writes | proxy CPU ms per write | deliveries | victim p50 ms | victim p99 ms | victim max ms | direct p99 ms | added p50 ms | added p99 ms | errors |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        o.select_watchers,
        o.namespace,
        o.select_rate,
        o.ignore_watchers,
        o.keys,
        o.ignore_rate,
        o.secs,
        o.victim_namespace,
        o.victim_rate,
    );
    for p in &r.phases {
        md.push_str(&format!(
            "| {} | {} | {} | {} | {:.2} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} |\n",
            p.name,
            p.watchers,
            p.distinct_filters,
            p.writes,
            p.proxy_cpu_ms_per_write,
            p.deliveries,
            p.victim.p50_ms,
            p.victim.p99_ms,
            p.victim.max_ms,
            p.victim_direct.p99_ms,
            p.victim_added.p50_ms,
            p.victim_added.p99_ms,
            p.write_errors + p.watch_errors + p.victim_missed,
        ));
    }
    md.push_str("\n| claim | measured | bound |\n| --- | --- | --- |\n");
    for (what, ratio, bound) in r.checks() {
        let bound = if what.contains("quiet") {
            "(for scale)".to_string()
        } else {
            format!("≤ {bound}×")
        };
        md.push_str(&format!("| {what} | {ratio:.2}× | {bound} |\n"));
    }
    md
}
