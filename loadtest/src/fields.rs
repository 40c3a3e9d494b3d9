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
