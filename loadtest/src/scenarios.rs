//! The load shapes: watch fan-out under churn (a), informer start storms (b), paginated list
//! walks (c), GETs at a fixed rate (d). The mixed scenario (e) runs a, c and d together.
//!
//! Each takes a [`Target`] (the proxy or the apiserver) and, where it writes, a connection
//! straight to the apiserver: writes never go through the proxy, so both sides see the same
//! write path and differ only in how reads and watches are served.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use bytes::Bytes;
use http::Method;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, Semaphore, watch};

use crate::client::{
    ACCEPT_PROTOBUF, Conn, LineReader, Target, expect_ok, fetch, send, unix_nanos, with_accept,
};
use crate::stats::{Summary, summarize};

/// The annotation client-go waits for at the end of a WatchList's initial events.
const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";

#[derive(Deserialize)]
struct ListMeta {
    #[serde(rename = "resourceVersion", default)]
    resource_version: String,
    #[serde(rename = "continue", default)]
    continue_: Option<String>,
}

#[derive(Deserialize)]
struct List {
    metadata: ListMeta,
    #[serde(default)]
    items: Vec<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct EventLine {
    #[serde(rename = "type")]
    ty: String,
    object: EventObject,
}

#[derive(Deserialize)]
struct EventObject {
    #[serde(default)]
    metadata: ObjectMeta,
}

#[derive(Deserialize, Default)]
struct ObjectMeta {
    #[serde(rename = "resourceVersion", default)]
    resource_version: String,
    #[serde(default)]
    annotations: Option<HashMap<String, String>>,
}

/// Creates namespace `ns` (an existing one is fine).
pub async fn create_namespace(t: &Target, conn: &Conn, ns: &str) -> anyhow::Result<()> {
    let body = serde_json::json!({"metadata": {"name": ns}}).to_string();
    let resp = send(
        conn,
        t.request(Method::POST, "/api/v1/namespaces", Some(body.into())),
    )
    .await?;
    if !(resp.status().is_success() || resp.status() == http::StatusCode::CONFLICT) {
        bail!("creating namespace {ns}: {}", resp.status());
    }
    Ok(())
}

/// Creates `count` ConfigMaps `{prefix}-{i}` in `ns`, each with `payload` bytes of data,
/// `concurrency` requests in flight over a few connections. Returns objects per second.
pub async fn create_configmaps(
    t: &Target,
    ns: &str,
    prefix: &str,
    count: usize,
    payload: usize,
    concurrency: usize,
) -> anyhow::Result<f64> {
    let filler = "x".repeat(payload);
    let path = format!("/api/v1/namespaces/{ns}/configmaps");
    create_objects(t, &path, count, concurrency, |i| {
        serde_json::json!({
            "metadata": {"name": format!("{prefix}-{i}"), "labels": {"loadtest": prefix}},
            "data": {"payload": filler, "ts": "0"},
        })
        .to_string()
    })
    .await
}

/// POSTs `body(i)` for `i` in `0..count` to the collection `path`, `concurrency` requests in
/// flight over a few connections (an object that exists already is fine). Returns objects
/// per second.
pub async fn create_objects(
    t: &Target,
    path: &str,
    count: usize,
    concurrency: usize,
    body: impl Fn(usize) -> String,
) -> anyhow::Result<f64> {
    send_each(t, count, concurrency, "create", |i| {
        t.request(Method::POST, path, Some(body(i).into()))
    })
    .await
}

/// Sends `req(i)` for `i` in `0..count`, `concurrency` requests in flight over a few
/// connections; any answer but success (or 409 Conflict: an object that exists already)
/// fails with the apiserver's message. Returns requests per second.
pub async fn send_each(
    t: &Target,
    count: usize,
    concurrency: usize,
    what: &'static str,
    req: impl Fn(usize) -> http::Request<http_body_util::Full<Bytes>>,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    let mut conns = Vec::new();
    for _ in 0..4 {
        conns.push(t.connect().await?);
    }
    let sem = Arc::new(Semaphore::new(concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..count {
        let permit = sem.clone().acquire_owned().await?;
        let conn = conns[i % conns.len()].clone();
        let req = req(i);
        tasks.spawn(async move {
            let _permit = permit;
            let resp = send(&conn, req).await?;
            let status = resp.status();
            if !(status.is_success() || status == http::StatusCode::CONFLICT) {
                // Not 200 either: fails with the apiserver's message.
                expect_ok(resp, what).await?;
            }
            anyhow::Ok(())
        });
        while let Some(r) = tasks.try_join_next() {
            r??;
        }
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(count as f64 / started.elapsed().as_secs_f64())
}

/// The current resourceVersion of the collection at `path` (a `limit=1` list, as cheap as
/// lists get).
pub async fn current_rv(t: &Target, conn: &Conn, path: &str) -> anyhow::Result<String> {
    let b = fetch(
        conn,
        t.request(Method::GET, &format!("{path}?limit=1"), None),
    )
    .await?;
    Ok(serde_json::from_slice::<List>(&b)?
        .metadata
        .resource_version)
}

// ---------------------------------------------------------------------------------------------
// a. Watch fan-out under churn
// ---------------------------------------------------------------------------------------------

/// The annotation a pod write carries its send time in (Unix nanoseconds; pods have no
/// free-form `data`).
pub const TS_ANNOTATION: &str = "loadtest/ts";

/// What the fan-out's watchers watch and its writer patches.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum Churned {
    /// ConfigMaps `w-{i}`, the write's time in `data.ts`.
    ConfigMaps,
    /// Pods `w-{i}`, the write's time in the annotation [`TS_ANNOTATION`].
    Pods,
}

impl Churned {
    pub fn resource(self) -> &'static str {
        match self {
            Churned::ConfigMaps => "configmaps",
            Churned::Pods => "pods",
        }
    }

    /// The merge patch of write `seq` sent at `ts`, padded with `pad` (empty: none).
    fn patch(self, ts: u64, seq: usize, pad: &str) -> String {
        let mut fields = serde_json::json!({"ts": ts.to_string(), "seq": seq.to_string()});
        if !pad.is_empty() {
            fields["pad"] = pad.into();
        }
        match self {
            Churned::ConfigMaps => serde_json::json!({ "data": fields }),
            Churned::Pods => {
                let annotations: serde_json::Map<String, serde_json::Value> = fields
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (format!("loadtest/{k}"), v.clone()))
                    .collect();
                serde_json::json!({"metadata": {"annotations": annotations}})
            }
        }
        .to_string()
    }
}

/// How watch bodies are asked for and read.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum Encoding {
    /// `Accept: application/json`: one JSON event per line.
    Json,
    /// client-go's protobuf `Accept` ([`ACCEPT_PROTOBUF`]): length-prefixed `WatchEvent`s.
    Protobuf,
}

/// One watch event as the fan-out reads it (borrowed from its bytes unless escaped).
struct Seen<'a> {
    event_type: Cow<'a, str>,
    resource_version: Cow<'a, str>,
    /// The writer's send time carried by the object (`data.ts` or [`TS_ANNOTATION`]).
    ts: Option<u64>,
}

impl Encoding {
    pub fn request(self, t: &Target, path: &str) -> http::Request<http_body_util::Full<Bytes>> {
        let req = t.request(Method::GET, path, None);
        match self {
            Encoding::Json => req,
            Encoding::Protobuf => with_accept(req, ACCEPT_PROTOBUF),
        }
    }

    /// The next event's bytes: a JSON line or a protobuf frame's message.
    async fn next(self, r: &mut LineReader) -> anyhow::Result<Option<Bytes>> {
        match self {
            Encoding::Json => r.next().await,
            Encoding::Protobuf => r.next_frame().await,
        }
    }

    /// Reads one event (`None`: malformed). Protobuf frames are read with the proxy's own
    /// readers (`kube_cache_proxy::k8s::protobuf`): the event, the object's envelope, its
    /// `ObjectMeta` and annotations.
    fn seen(self, b: &[u8]) -> Option<Seen<'_>> {
        use kube_cache_proxy::k8s::protobuf;
        let ts = |v: &str| v.parse::<u64>().ok().filter(|t| *t > 0);
        match self {
            // With the proxy's own scanner (`kube_cache_proxy::k8s::scan`): the members read
            // are decoded, the rest skipped a block at a time (one per delivery, on the
            // cores the proxy and the apiserver share: nothing is allocated).
            Encoding::Json => {
                use kube_cache_proxy::k8s::scan::{ScanError, Scanner};
                let (mut ty, mut rv, mut in_data, mut in_annotation) = (None, None, None, None);
                let mut s = Scanner::new(b);
                /// Member `k`'s string into `out` when `k` is `want`, else skipped.
                fn only<'a>(
                    s: &mut Scanner<'a>,
                    want: &str,
                    k: &str,
                    out: &mut Option<Cow<'a, str>>,
                ) -> Result<(), ScanError> {
                    if k == want {
                        *out = s.opt_string()?;
                        Ok(())
                    } else {
                        s.skip()
                    }
                }
                s.object(|s, k| match &*k {
                    "type" => only(s, "type", &k, &mut ty),
                    "object" => s.object(|s, k| match &*k {
                        "metadata" => s.object(|s, k| match &*k {
                            "resourceVersion" => only(s, "resourceVersion", &k, &mut rv),
                            "annotations" => {
                                s.object(|s, k| only(s, TS_ANNOTATION, &k, &mut in_annotation))
                            }
                            _ => s.skip(),
                        }),
                        "data" => s.object(|s, k| only(s, "ts", &k, &mut in_data)),
                        _ => s.skip(),
                    }),
                    _ => s.skip(),
                })
                .and_then(|()| s.end())
                .ok()?;
                Some(Seen {
                    event_type: ty?,
                    ts: in_data.or(in_annotation).and_then(|t| ts(&t)),
                    resource_version: rv.unwrap_or_default(),
                })
            }
            Encoding::Protobuf => {
                let ev = protobuf::watch_event(b)?;
                let mut seen = Seen {
                    event_type: Cow::Borrowed(ev.event_type),
                    resource_version: Cow::Borrowed(""),
                    ts: None,
                };
                if ev.event_type != "ERROR" {
                    let meta = protobuf::object_meta(protobuf::envelope(ev.object)?.raw)?;
                    seen.resource_version = Cow::Borrowed(meta.resource_version);
                    // Only this annotation's value is decoded, not the padding's.
                    seen.ts = meta.annotation(TS_ANNOTATION).and_then(ts);
                }
                Some(seen)
            }
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct FanoutOpts {
    pub churned: Churned,
    pub encoding: Encoding,
    pub namespace: String,
    pub watchers: usize,
    pub streams_per_conn: usize,
    /// Writes per second, each a merge patch of one of `objects` ConfigMaps `w-{i}`.
    pub rate: f64,
    pub objects: usize,
    pub duration_s: f64,
    /// Bytes of padding each write sets (`data.pad`; 0: none).
    pub pad: usize,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct FanoutResult {
    pub watchers: usize,
    pub connections: usize,
    pub writes: usize,
    pub write_errors: u64,
    /// Writes made per second (the generator's achieved rate).
    pub write_rate: f64,
    pub deliveries: u64,
    /// Deliveries per second, from the first write to the last event read.
    pub deliveries_per_s: f64,
    /// Events written but never delivered, summed over watchers.
    pub missed: u64,
    /// Events delivered more than once, summed over watchers.
    pub duplicated: u64,
    /// Watch streams that ended early and were resumed from the last resourceVersion.
    pub rewatches: u64,
    /// ERROR events and failed (re)watches.
    pub watch_errors: u64,
    /// Write (timestamp in the object, taken just before the PATCH) to receipt at a watcher.
    pub latency: Summary,
    /// Over the writes: each write's earliest delivery (the path's base latency).
    pub first_delivery: Summary,
    /// Over the writes: each write's latest delivery (base plus the fan-out's own duration).
    pub last_delivery: Summary,
}

/// When a watcher stops: not yet known, at a resourceVersion (the last write), or now (the
/// drain deadline passed; what it has not received by then counts as missed).
#[derive(Debug, Clone, Copy)]
pub enum Until {
    Running,
    Rv(u64),
    Stop,
}

/// Joins every watcher task; those still running `within` from now are told to stop (what
/// they have not received by then counts as missed) and joined too.
pub async fn join_watchers<T: 'static>(
    watchers: &mut tokio::task::JoinSet<T>,
    until: &watch::Sender<Until>,
    within: Duration,
) -> anyhow::Result<Vec<T>> {
    let mut logs = Vec::with_capacity(watchers.len());
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, watchers.join_next()).await {
            Ok(Some(Ok(l))) => logs.push(l),
            Ok(Some(Err(e))) => bail!("watcher task: {e}"),
            Ok(None) => break,
            Err(_) => {
                let _ = until.send(Until::Stop);
                while let Some(l) = watchers.join_next().await {
                    logs.push(l?);
                }
                break;
            }
        }
    }
    Ok(logs)
}

struct WatcherLog {
    rvs: Vec<u64>,
    lat_us: Vec<u64>,
    rewatches: u64,
    errors: u64,
    last_at: Option<Instant>,
}

#[allow(
    clippy::too_many_arguments,
    reason = "one watcher task's inputs, each used once; a struct would only rename them"
)]
async fn run_watcher(
    t: Target,
    encoding: Encoding,
    conn: Conn,
    path: String,
    start_rv: String,
    ready: tokio::sync::mpsc::Sender<anyhow::Result<()>>,
    mut until: watch::Receiver<Until>,
) -> WatcherLog {
    let mut log = WatcherLog {
        rvs: Vec::new(),
        lat_us: Vec::new(),
        rewatches: 0,
        errors: 0,
        last_at: None,
    };
    let mut rv = start_rv;
    let mut max_seen = 0u64;
    let mut first = true;
    // The stop signal, read with an atomic version check per event; a change wakes the
    // watcher through one waiter registered for the whole run (not one per event).
    let mut state = *until.borrow_and_update();
    let mut stop = Box::pin(changed(until.clone()));
    loop {
        let url = format!(
            "{path}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=1800"
        );
        let opened = match send(&conn, encoding.request(&t, &url)).await {
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
        if first {
            let _ = ready.send(Ok(())).await;
            first = false;
        }
        let mut lines = LineReader::new(resp);
        loop {
            if until.has_changed().unwrap_or(false) {
                state = *until.borrow_and_update();
            }
            match state {
                Until::Stop => return log,
                Until::Rv(target) if max_seen >= target => return log,
                _ => {}
            }
            let line = tokio::select! {
                biased;
                l = encoding.next(&mut lines) => l,
                rx = &mut stop => {
                    stop = Box::pin(changed(rx));
                    continue;
                }
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
            let Some(ev) = encoding.seen(&line) else {
                log.errors += 1;
                continue;
            };
            match &*ev.event_type {
                "ERROR" => {
                    log.errors += 1;
                    return log;
                }
                "BOOKMARK" => (*ev.resource_version).clone_into(&mut rv),
                _ => {
                    let r: u64 = ev.resource_version.parse().unwrap_or(0);
                    log.rvs.push(r);
                    max_seen = max_seen.max(r);
                    log.last_at = Some(Instant::now());
                    if let Some(ts) = ev.ts {
                        log.lat_us.push(now_ns.saturating_sub(ts) / 1000);
                    }
                    (*ev.resource_version).clone_into(&mut rv);
                }
            }
        }
        log.rewatches += 1;
    }
}

/// Completes when `rx` sees a change (never once its sender is gone), handing it back.
async fn changed(mut rx: watch::Receiver<Until>) -> watch::Receiver<Until> {
    if rx.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
    rx
}

/// Scenario a: watchers on `target`, churn written to the apiserver through `writer`.
pub async fn watch_fanout(
    target: &Target,
    direct: &Target,
    writer: &Conn,
    o: &FanoutOpts,
) -> anyhow::Result<FanoutResult> {
    let path = format!(
        "/api/v1/namespaces/{}/{}",
        o.namespace,
        o.churned.resource()
    );
    let start_rv = current_rv(direct, writer, &path).await?;
    let n_conns = o.watchers.div_ceil(o.streams_per_conn.max(1));
    let mut conns = Vec::with_capacity(n_conns);
    for _ in 0..n_conns {
        conns.push(target.connect().await?);
    }
    let (until_tx, until_rx) = watch::channel(Until::Running);
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(o.watchers.max(1));
    // One task per connection runs its watchers together: a write wakes the task once for
    // all of the connection's streams rather than each stream's own task (the driver shares
    // the two cores with what it measures; real watchers run elsewhere). Each watcher still
    // reads its own stream and stamps each event when it takes it.
    let mut watchers = tokio::task::JoinSet::new();
    let per_conn = o.streams_per_conn.max(1);
    for (c, conn) in conns.iter().enumerate() {
        let group: futures_util::stream::FuturesUnordered<_> = (c * per_conn
            ..((c + 1) * per_conn).min(o.watchers))
            .map(|_| {
                run_watcher(
                    target.clone(),
                    o.encoding,
                    conn.clone(),
                    path.clone(),
                    start_rv.clone(),
                    ready_tx.clone(),
                    until_rx.clone(),
                )
            })
            .collect();
        watchers.spawn(futures_util::StreamExt::collect::<Vec<WatcherLog>>(group));
    }
    drop(ready_tx);
    for _ in 0..o.watchers {
        match tokio::time::timeout(Duration::from_secs(120), ready_rx.recv()).await {
            Ok(Some(Ok(()))) => {}
            Ok(Some(Err(e))) => return Err(e.context("opening a watch")),
            Ok(None) | Err(_) => bail!("watches did not open within 120s"),
        }
    }

    // Churn: open loop at the given rate; a slow apiserver gets more requests in flight, not
    // a lower rate (up to 256 in flight, then the generator falls behind and says so).
    let written = Arc::new(Mutex::new(Vec::<u64>::new()));
    let write_errors = Arc::new(AtomicU64::new(0));
    let sem = Arc::new(Semaphore::new(256));
    let first_write = Instant::now();
    let total = (o.rate * o.duration_s).round() as usize;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / o.rate.max(0.001)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut writes = tokio::task::JoinSet::new();
    let pad: Arc<str> = "x".repeat(o.pad).into();
    for seq in 0..total {
        tick.tick().await;
        let permit = sem.clone().acquire_owned().await?;
        let name = format!("w-{}", seq % o.objects.max(1));
        let conn = writer.clone();
        let direct = direct.clone();
        let path = format!("{path}/{name}");
        let written = written.clone();
        let errors = write_errors.clone();
        let pad = pad.clone();
        let churned = o.churned;
        writes.spawn(async move {
            let _permit = permit;
            let body = churned.patch(unix_nanos(), seq, &pad);
            match fetch(
                &conn,
                direct.request(Method::PATCH, &path, Some(Bytes::from(body))),
            )
            .await
            .and_then(|b| Ok(serde_json::from_slice::<EventObject>(&b)?))
            {
                Ok(obj) => written
                    .lock()
                    .await
                    .push(obj.metadata.resource_version.parse().unwrap_or(0)),
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
    let last = written.iter().copied().max().unwrap_or(0);
    let _ = until_tx.send(Until::Rv(last));

    // Every watcher should reach the last write; those that do not within 60 s are stopped and
    // their missing events counted.
    let logs: Vec<WatcherLog> = join_watchers(&mut watchers, &until_tx, Duration::from_secs(60))
        .await?
        .into_iter()
        .flatten()
        .collect();
    drop(conns);

    let expected: std::collections::HashSet<u64> = written.iter().copied().collect();
    let mut r = FanoutResult {
        watchers: o.watchers,
        connections: n_conns,
        writes: written.len(),
        write_errors: write_errors.load(Ordering::Relaxed),
        write_rate: written.len() as f64 / write_secs,
        ..Default::default()
    };
    let mut lat = Vec::new();
    let mut last_at = first_write;
    // Each write's first and last delivery (over the watchers that stamped it): the first is
    // the path's base latency (writer, apiserver, proxy ingest), last minus first the time
    // the fan-out of one event takes.
    let mut per_write: std::collections::HashMap<u64, (u64, u64)> = Default::default();
    for l in &logs {
        if l.rvs.len() != l.lat_us.len() {
            continue; // some events carried no timestamp: not paired
        }
        for (rv, &us) in l.rvs.iter().zip(&l.lat_us) {
            let e = per_write.entry(*rv).or_insert((us, us));
            e.0 = e.0.min(us);
            e.1 = e.1.max(us);
        }
    }
    let (firsts, lasts): (Vec<u64>, Vec<u64>) = per_write.into_values().unzip();
    for mut l in logs {
        r.deliveries += l.rvs.len() as u64;
        r.rewatches += l.rewatches;
        r.watch_errors += l.errors;
        if let Some(t) = l.last_at {
            last_at = last_at.max(t);
        }
        l.rvs.sort_unstable();
        let before = l.rvs.len();
        l.rvs.dedup();
        r.duplicated += (before - l.rvs.len()) as u64;
        let got = l.rvs.iter().filter(|rv| expected.contains(rv)).count();
        r.missed += (expected.len() - got) as u64;
        lat.append(&mut l.lat_us);
    }
    r.deliveries_per_s = r.deliveries as f64 / last_at.duration_since(first_write).as_secs_f64();
    r.latency = summarize(lat);
    r.first_delivery = summarize(firsts);
    r.last_delivery = summarize(lasts);
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// b. Informer start storm
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum StartMode {
    /// LIST `resourceVersion=0&limit=500` (pages followed), then WATCH from the list's RV.
    Legacy,
    /// One WATCH with `sendInitialEvents=true`, synced at the `initial-events-end` bookmark.
    WatchList,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct StormResult {
    pub clients: usize,
    pub synced: usize,
    pub errors: usize,
    /// Clients whose initial state did not have the expected number of objects.
    pub wrong_counts: usize,
    /// Start (all at once) to synced, per client.
    pub time_to_sync: Summary,
    /// Start to the last client synced.
    pub wall_s: f64,
}

/// Open watches of a storm, held until dropped (so the apiserver's gauge can be read).
pub struct Held {
    _streams: Vec<(Conn, LineReader)>,
}

async fn start_informer(
    t: Target,
    path: String,
    mode: StartMode,
    barrier: Arc<tokio::sync::Barrier>,
) -> anyhow::Result<(u64, usize, Conn, LineReader)> {
    let conn = t.connect().await?;
    barrier.wait().await;
    let started = Instant::now();
    let mut items = 0usize;
    let reader = match mode {
        StartMode::Legacy => {
            let mut cont: Option<String> = None;
            let mut rv = String::new();
            loop {
                let url = match &cont {
                    None => format!("{path}?limit=500&resourceVersion=0"),
                    Some(c) => format!("{path}?limit=500&continue={c}"),
                };
                let b = fetch(&conn, t.request(Method::GET, &url, None)).await?;
                let l: List = serde_json::from_slice(&b)?;
                items += l.items.len();
                if rv.is_empty() {
                    rv = l.metadata.resource_version;
                }
                match l.metadata.continue_.filter(|c| !c.is_empty()) {
                    Some(c) => cont = Some(c),
                    None => break,
                }
            }
            let url = format!(
                "{path}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=600"
            );
            let r = expect_ok(
                send(&conn, t.request(Method::GET, &url, None)).await?,
                "watch",
            )
            .await?;
            LineReader::new(r)
        }
        StartMode::WatchList => {
            let url = format!(
                "{path}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=600"
            );
            let r = expect_ok(
                send(&conn, t.request(Method::GET, &url, None)).await?,
                "watch",
            )
            .await?;
            let mut reader = LineReader::new(r);
            loop {
                let line = reader
                    .next()
                    .await?
                    .context("watch ended before the initial-events-end bookmark")?;
                let ev: EventLine = serde_json::from_slice(&line)?;
                match ev.ty.as_str() {
                    "ADDED" => items += 1,
                    "BOOKMARK"
                        if ev
                            .object
                            .metadata
                            .annotations
                            .as_ref()
                            .and_then(|a| a.get(INITIAL_EVENTS_END))
                            .is_some_and(|v| v == "true") =>
                    {
                        break;
                    }
                    "ERROR" => bail!("ERROR event: {}", String::from_utf8_lossy(&line)),
                    _ => {}
                }
            }
            reader
        }
    };
    Ok((started.elapsed().as_micros() as u64, items, conn, reader))
}

/// Scenario b: `clients` informers start at once on `ns`'s ConfigMaps; returns when all have
/// synced, with their watches still open.
pub async fn informer_storm(
    target: &Target,
    ns: &str,
    clients: usize,
    mode: StartMode,
    expected_items: usize,
) -> anyhow::Result<(StormResult, Held)> {
    let path = format!("/api/v1/namespaces/{ns}/configmaps");
    let barrier = Arc::new(tokio::sync::Barrier::new(clients + 1));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        tasks.spawn(start_informer(
            target.clone(),
            path.clone(),
            mode,
            barrier.clone(),
        ));
    }
    barrier.wait().await;
    let started = Instant::now();
    let mut r = StormResult {
        clients,
        ..Default::default()
    };
    let mut times = Vec::new();
    let mut held = Vec::new();
    while let Some(res) = tasks.join_next().await {
        match res? {
            Ok((us, items, conn, reader)) => {
                r.synced += 1;
                times.push(us);
                if items != expected_items {
                    r.wrong_counts += 1;
                }
                held.push((conn, reader));
            }
            Err(e) => {
                if r.errors == 0 {
                    say!("informer on {}: {e:#}", target.side);
                }
                r.errors += 1;
            }
        }
    }
    r.wall_s = started.elapsed().as_secs_f64();
    r.time_to_sync = summarize(times);
    Ok((r, Held { _streams: held }))
}

// ---------------------------------------------------------------------------------------------
// c. Paginated list walks
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Default, Serialize)]
pub struct ListResult {
    pub clients: usize,
    pub walks: usize,
    pub pages: usize,
    pub items: usize,
    /// Pages other than a walk's last that held fewer items than `limit` asked for (the
    /// apiserver fills every page but the last).
    pub short_pages: usize,
    /// Walks that did not return exactly the expected number of objects.
    pub wrong_counts: usize,
    pub errors: usize,
    pub bytes: u64,
    pub wall_s: f64,
    pub items_per_s: f64,
    pub mb_per_s: f64,
    pub page_latency: Summary,
    pub walk_time: Summary,
}

/// What a list walk asks for: the collection, the page size, the encoding.
#[derive(Debug, Clone)]
pub struct WalkSpec {
    /// The collection, e.g. `/api/v1/namespaces/lt-c/configmaps`.
    pub path: String,
    pub limit: usize,
    pub encoding: Encoding,
}

/// The parts of a protobuf list (`metav1.List`'s layout, shared by every `*List` kind:
/// k8s.io/apimachinery `generated.proto`) a walk reads; items stay undecoded slices of the
/// body.
#[derive(Clone, PartialEq, prost::Message)]
struct ProtoList {
    #[prost(message, optional, tag = "1")]
    metadata: Option<ProtoListMeta>,
    #[prost(bytes = "bytes", repeated, tag = "2")]
    items: Vec<Bytes>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProtoListMeta {
    #[prost(string, tag = "3")]
    continue_: String,
}

impl WalkSpec {
    /// One page: its items and continue token (`None` on the last page).
    fn page(&self, body: &Bytes) -> anyhow::Result<(usize, Option<String>)> {
        match self.encoding {
            Encoding::Json => {
                let l: List = serde_json::from_slice(body)?;
                Ok((
                    l.items.len(),
                    l.metadata.continue_.filter(|c| !c.is_empty()),
                ))
            }
            Encoding::Protobuf => {
                let env = kube_cache_proxy::k8s::protobuf::envelope(body)
                    .context("a list page that is not a protobuf object")?;
                let l = <ProtoList as prost::Message>::decode(body.slice_ref(env.raw))?;
                let cont = l.metadata.map(|m| m.continue_).filter(|c| !c.is_empty());
                Ok((l.items.len(), cont))
            }
        }
    }
}

/// One walk's pages: latency (µs) and items of each.
struct Walked {
    pages: Vec<(u64, usize)>,
    bytes: u64,
}

/// One `limit`-paged walk.
async fn walk(t: &Target, conn: &Conn, spec: &WalkSpec) -> anyhow::Result<Walked> {
    let mut w = Walked {
        pages: Vec::new(),
        bytes: 0,
    };
    let mut cont: Option<String> = None;
    loop {
        let url = match &cont {
            None => format!("{}?limit={}", spec.path, spec.limit),
            Some(c) => format!("{}?limit={}&continue={c}", spec.path, spec.limit),
        };
        let t0 = Instant::now();
        let b = fetch(conn, spec.encoding.request(t, &url)).await?;
        let us = t0.elapsed().as_micros() as u64;
        w.bytes += b.len() as u64;
        let (items, next) = spec.page(&b)?;
        w.pages.push((us, items));
        match next {
            Some(c) => cont = Some(c),
            None => return Ok(w),
        }
    }
}

/// Scenario c: `clients` parallel clients (one connection each) walk `spec`, `walks` times
/// each, or until `until` when given.
pub async fn list_storm(
    target: &Target,
    spec: &WalkSpec,
    clients: usize,
    walks: usize,
    expected_items: usize,
    until: Option<Instant>,
) -> anyhow::Result<ListResult> {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let t = target.clone();
        let spec = spec.clone();
        tasks.spawn(async move {
            let conn = t.connect().await?;
            let mut out = Vec::new();
            let mut i = 0;
            loop {
                let done = match until {
                    Some(u) => Instant::now() >= u,
                    None => i >= walks,
                };
                if done {
                    break;
                }
                let t0 = Instant::now();
                let r = walk(&t, &conn, &spec).await;
                out.push(r.map(|w| (w, t0.elapsed().as_micros() as u64)));
                i += 1;
            }
            anyhow::Ok(out)
        });
    }
    let mut r = ListResult {
        clients,
        ..Default::default()
    };
    let (mut pages, mut walk_times) = (Vec::new(), Vec::new());
    while let Some(res) = tasks.join_next().await {
        for w in res?? {
            match w {
                Ok((w, us)) => {
                    let n: usize = w.pages.iter().map(|p| p.1).sum();
                    r.walks += 1;
                    r.pages += w.pages.len();
                    r.items += n;
                    r.bytes += w.bytes;
                    let but_last = &w.pages[..w.pages.len().saturating_sub(1)];
                    r.short_pages += but_last.iter().filter(|p| p.1 < spec.limit).count();
                    if n != expected_items {
                        r.wrong_counts += 1;
                    }
                    pages.extend(w.pages.iter().map(|p| p.0));
                    walk_times.push(us);
                }
                Err(e) => {
                    if r.errors == 0 {
                        say!("list walk on {}: {e:#}", target.side);
                    }
                    r.errors += 1;
                }
            }
        }
    }
    r.wall_s = started.elapsed().as_secs_f64();
    r.items_per_s = r.items as f64 / r.wall_s;
    r.mb_per_s = r.bytes as f64 / r.wall_s / 1e6;
    r.page_latency = summarize(pages);
    r.walk_time = summarize(walk_times);
    Ok(r)
}

// ---------------------------------------------------------------------------------------------
// d. GETs at a fixed rate
// ---------------------------------------------------------------------------------------------

/// What the GETs of scenario d ask for.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum GetKind {
    /// ConfigMaps `d-{i}` without a resourceVersion: the most recent state (the apiserver
    /// reads etcd; the proxy serves it under its consistency mode).
    #[default]
    Quorum,
    /// ConfigMaps `d-{i}` with `resourceVersion=0`: any cache may answer.
    Rv0,
    /// Leases `d-{i}` (coordination.k8s.io), which the proxy's default configuration does not
    /// cache ("left out on purpose", config/kube-cache-proxy.yaml): every GET passes through.
    Passthrough,
}

impl GetKind {
    pub fn as_str(self) -> &'static str {
        match self {
            GetKind::Quorum => "quorum",
            GetKind::Rv0 => "rv0",
            GetKind::Passthrough => "passthrough",
        }
    }

    /// The resource as the proxy's metrics name it.
    pub fn resource(self) -> &'static str {
        match self {
            GetKind::Quorum | GetKind::Rv0 => "configmaps",
            GetKind::Passthrough => LEASES,
        }
    }

    /// The path of object `d-{i}` in `ns`.
    fn path(self, ns: &str, i: usize) -> String {
        match self {
            GetKind::Quorum => format!("/api/v1/namespaces/{ns}/configmaps/d-{i}"),
            GetKind::Rv0 => format!("/api/v1/namespaces/{ns}/configmaps/d-{i}?resourceVersion=0"),
            GetKind::Passthrough => format!("{}/d-{i}", leases_path(ns)),
        }
    }
}

/// The uncached resource of [`GetKind::Passthrough`].
pub const LEASES: &str = "leases";

fn leases_path(ns: &str) -> String {
    format!("/apis/coordination.k8s.io/v1/namespaces/{ns}/leases")
}

/// Creates `count` Leases `d-{i}` in `ns` (the objects of [`GetKind::Passthrough`]).
pub async fn create_leases(t: &Target, ns: &str, count: usize) -> anyhow::Result<f64> {
    create_objects(t, &leases_path(ns), count, 8, |i| {
        serde_json::json!({
            "metadata": {"name": format!("d-{i}"), "labels": {"loadtest": "d"}},
            "spec": {"holderIdentity": format!("loadtest-{i}"), "leaseDurationSeconds": 15},
        })
        .to_string()
    })
    .await
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct GetResult {
    pub kind: GetKind,
    pub target_rate: f64,
    pub achieved_rate: f64,
    pub requests: usize,
    pub errors: usize,
    pub latency: Summary,
}

/// Scenario d: GETs of `d-{i}` (`kind`) in `ns` at `rate` per second for `secs`, open loop,
/// over one HTTP/2 connection (as one client-go process would).
pub async fn get_rate(
    target: &Target,
    ns: &str,
    objects: usize,
    rate: f64,
    secs: f64,
    kind: GetKind,
) -> anyhow::Result<GetResult> {
    let conn = target.connect().await?;
    let total = (rate * secs).round() as usize;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(0.001)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let sem = Arc::new(Semaphore::new(1000));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..total {
        tick.tick().await;
        let permit = sem.clone().acquire_owned().await?;
        let req = target.request(Method::GET, &kind.path(ns, i % objects.max(1)), None);
        let conn = conn.clone();
        tasks.spawn(async move {
            let _permit = permit;
            let t0 = Instant::now();
            fetch(&conn, req)
                .await
                .map(|_| t0.elapsed().as_micros() as u64)
        });
    }
    let mut lat = Vec::with_capacity(total);
    let mut errors = 0;
    while let Some(r) = tasks.join_next().await {
        match r? {
            Ok(us) => lat.push(us),
            Err(e) => {
                if errors == 0 {
                    say!("{} GET on {}: {e:#}", kind.as_str(), target.side);
                }
                errors += 1;
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    Ok(GetResult {
        kind,
        target_rate: rate,
        achieved_rate: lat.len() as f64 / wall,
        requests: total,
        errors,
        latency: summarize(lat),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn a_pod_write_carries_its_time_in_an_annotation_and_a_configmap_write_in_data() {
        let pod: Value = serde_json::from_str(&Churned::Pods.patch(7, 3, "")).unwrap();
        assert_eq!(
            pod,
            json!({"metadata": {"annotations": {"loadtest/ts": "7", "loadtest/seq": "3"}}})
        );
        let cm: Value = serde_json::from_str(&Churned::ConfigMaps.patch(7, 3, "xx")).unwrap();
        assert_eq!(cm, json!({"data": {"ts": "7", "seq": "3", "pad": "xx"}}));
    }

    #[test]
    fn the_write_time_is_read_from_json_events_and_protobuf_frames() {
        let line = br#"{"type":"MODIFIED","object":{"metadata":{"resourceVersion":"5","annotations":{"loadtest/ts":"9"}}}}"#;
        let s = Encoding::Json.seen(line).unwrap();
        assert_eq!(
            (&*s.event_type, &*s.resource_version, s.ts),
            ("MODIFIED", "5", Some(9))
        );
        // A ConfigMap as the apiserver sends it: other annotations (escaped values are
        // skipped, not read), managedFields naming `f:ts`, the time in `data.ts`.
        let line = br#"{"type":"MODIFIED","object":{"kind":"ConfigMap","metadata":{"name":"w-1","resourceVersion":"77","annotations":{"a":"{\"x\":\"\u003cy\u003e\"}","b":"2"},"managedFields":[{"fieldsV1":{"f:data":{"f:ts":{}}}}]},"data":{"pad":"p","ts":"12","seq":"4"}}}"#;
        let s = Encoding::Json.seen(line).unwrap();
        assert_eq!(
            (&*s.event_type, &*s.resource_version, s.ts),
            ("MODIFIED", "77", Some(12))
        );
        let bookmark = br#"{"type":"BOOKMARK","object":{"kind":"ConfigMap","metadata":{"resourceVersion":"80","creationTimestamp":null}}}"#;
        let s = Encoding::Json.seen(bookmark).unwrap();
        assert_eq!(
            (&*s.event_type, &*s.resource_version, s.ts),
            ("BOOKMARK", "80", None)
        );
        assert!(Encoding::Json.seen(b"{\"type\":").is_none());

        // A Pod whose ObjectMeta holds name (1), resourceVersion (6) and one annotation (12),
        // in the apiserver's envelope and watch frame.
        fn field(n: u8, b: &[u8]) -> Vec<u8> {
            [&[(n << 3) | 2, b.len() as u8][..], b].concat()
        }
        let annotation = [field(1, TS_ANNOTATION.as_bytes()), field(2, b"9")].concat();
        let meta = [field(1, b"w-0"), field(6, b"5"), field(12, &annotation)].concat();
        let object =
            kube_cache_proxy::k8s::protobuf_write::object_envelope("v1", "Pod", &field(1, &meta));
        let mut frame = Vec::new();
        kube_cache_proxy::k8s::protobuf_write::watch_frame(&mut frame, "MODIFIED", &object)
            .unwrap();
        let s = Encoding::Protobuf.seen(&frame[4..]).unwrap();
        assert_eq!(
            (&*s.event_type, &*s.resource_version, s.ts),
            ("MODIFIED", "5", Some(9))
        );
        // A pod without the annotation (as seeded, `0`) has no write time.
        let meta = [field(1, b"w-0"), field(6, b"6")].concat();
        let object =
            kube_cache_proxy::k8s::protobuf_write::object_envelope("v1", "Pod", &field(1, &meta));
        let mut frame = Vec::new();
        kube_cache_proxy::k8s::protobuf_write::watch_frame(&mut frame, "ADDED", &object).unwrap();
        assert_eq!(Encoding::Protobuf.seen(&frame[4..]).unwrap().ts, None);
        assert!(Encoding::Protobuf.seen(b"\xff").is_none());
    }
}
