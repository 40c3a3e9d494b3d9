//! When may a read with `resourceVersion` unset ("the most recent state") be answered from
//! the cache?
//!
//! kube-apiserver answers such reads at etcd's current revision; it learns that revision with
//! a quorum read and waits for its watch cache to get there, which etcd's progress
//! notifications make possible. The proxy cannot ask etcd, so it offers two modes, chosen per
//! resource (`lists.consistency`, `lists.consistencyByResource`):
//!
//! - `strict`: exactly as fresh as the apiserver. A probe learns the current revision R with
//!   a `limit=1` list (the apiserver makes that a consistent read), then the cache must be
//!   shown to hold every change up to R: directly when its resourceVersion already reached R,
//!   else by a short upstream watch from the cache's resourceVersion with bookmarks — the
//!   apiserver sends every event after it, then a bookmark (at least R, since its own cache
//!   reached R for the probe list); once the cache applied the last event seen on the probe,
//!   the cache is complete up to the bookmark and advances to it. That watch takes one to two
//!   seconds (the apiserver's bookmark timing), so it runs on its own, one per resource, and
//!   the reads of the rounds that needed it pass through to the apiserver meanwhile: they
//!   get their answer as fast as without the proxy rather than seconds later. Probes are
//!   single-flighted per resource: a read joins the next probe that starts after it
//!   arrived, so concurrent reads share one. When a probe fails or takes longer than
//!   `consistencyTimeout`, the read passes through to the apiserver (never stale).
//! - `bounded` (default): served from the cache while its upstream watch is up and confirmed,
//!   and once the cache reflects every write the proxy itself passed through for that
//!   resource (read-your-writes); otherwise the read passes through. Staleness is then the
//!   watch propagation delay (milliseconds), never a disconnected period.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, header};
use http_body_util::BodyExt;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::watch;

use crate::cache::ReflectorSink;
use crate::cache::ResourceCache;
use crate::cache::store::Snapshot;
use crate::http::body;
use crate::read::{Served, delegate};
use crate::upstream::{As, Upstream};

pub use crate::config::ConsistencyMode as Mode;

/// Counters for metrics.
#[derive(Debug)]
pub struct Stats {
    pub probes: std::sync::atomic::AtomicU64,
    pub probe_watches: std::sync::atomic::AtomicU64,
    pub probe_failures: std::sync::atomic::AtomicU64,
    pub fallbacks: std::sync::atomic::AtomicU64,
    /// Reads at a resourceVersion the cache had not reached that joined a probe round.
    pub reach_probes: std::sync::atomic::AtomicU64,
    /// Time unset-resourceVersion reads waited for confirmation, by mode.
    pub waits: prometheus_client::metrics::family::Family<
        ModeLabels,
        prometheus_client::metrics::histogram::Histogram,
    >,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            probes: Default::default(),
            probe_watches: Default::default(),
            probe_failures: Default::default(),
            fallbacks: Default::default(),
            reach_probes: Default::default(),
            waits: prometheus_client::metrics::family::Family::new_with_constructor(|| {
                prometheus_client::metrics::histogram::Histogram::new([
                    0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0,
                ])
            }),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ModeLabels {
    pub mode: &'static str,
}

/// Exposes [`Stats`].
#[derive(Debug)]
pub struct ConsistencyCollector(pub Arc<Consistency>);

impl prometheus_client::collector::Collector for ConsistencyCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use std::sync::atomic::Ordering::Relaxed;
        let st = &self.0.stats;
        let w = &st.waits;
        let e = enc.encode_descriptor(
            "kube_cache_proxy_consistent_read_wait_seconds",
            "Time unset-resourceVersion reads waited before the cache could answer (or fell back)",
            None,
            w.metric_type(),
        )?;
        w.encode(e)?;
        for (name, help, v) in [
            (
                "kube_cache_proxy_consistency_probes",
                "Upstream current-revision probes (strict mode)",
                st.probes.load(Relaxed),
            ),
            (
                "kube_cache_proxy_consistency_probe_watches",
                "Probes that needed an upstream watch up to a bookmark",
                st.probe_watches.load(Relaxed),
            ),
            (
                "kube_cache_proxy_consistency_probe_failures",
                "Probes that failed or timed out",
                st.probe_failures.load(Relaxed),
            ),
            (
                "kube_cache_proxy_consistency_fallbacks",
                "Unset-resourceVersion reads passed to the apiserver because the cache could not be confirmed",
                st.fallbacks.load(Relaxed),
            ),
            (
                "kube_cache_proxy_consistency_reach_probes",
                "Reads and watches at a resourceVersion the cache had not reached that joined a probe round to get there",
                st.reach_probes.load(Relaxed),
            ),
        ] {
            let c = ConstCounter::new(v);
            let e = enc.encode_descriptor(name, help, None, c.metric_type())?;
            c.encode(e)?;
        }
        Ok(())
    }
}

/// How long a probe waits for the cache's own watch to reach the current revision before
/// it takes the slow path (the catch-up, `Consistency::catch_up`).
pub const CATCH_UP_QUIET: Duration = Duration::from_millis(50);

/// How long a read at a resourceVersion the cache has not reached waits for the resource's
/// own events before it joins a probe round ([`Consistency::reach`]).
pub const REACH_QUIET: Duration = Duration::from_millis(100);

/// One resource's probe rounds.
struct Rounds {
    state: Mutex<RoundState>,
    /// An upstream watch is proving the cache complete up to a newer revision
    /// ([`Consistency::catch_up`]); at most one per resource.
    catching_up: std::sync::atomic::AtomicBool,
    /// (round number, outcome) of the last finished round.
    done: watch::Sender<(u64, bool)>,
}

#[derive(Default)]
struct RoundState {
    started: u64,
    wanted: u64,
    running: bool,
}

pub struct Consistency {
    upstream: Upstream,
    timeout: Duration,
    rounds: dashmap::DashMap<String, Arc<Rounds>>,
    /// Highest resourceVersion returned by a write passed through, per resource.
    writes: dashmap::DashMap<String, u64>,
    /// Resources with a write passed through whose resourceVersion could not be read (a
    /// Status body, an encoding the proxy does not parse, a large or compressed response),
    /// by the generation of the latest such write: reads confirm the cache with a probe
    /// first, as in strict mode, until one probe that started after the write succeeds.
    unknown_writes: dashmap::DashMap<String, u64>,
    unknown_generation: std::sync::atomic::AtomicU64,
    /// The newest resourceVersion the apiserver refused as compacted (etcd revisions are
    /// global, so every older one is compacted too).
    compacted_floor: std::sync::atomic::AtomicU64,
    /// Recent answers to "can the apiserver still list at this resourceVersion?", per
    /// resourceVersion, shared by concurrent askers ([`Consistency::compacted`]).
    listable: moka::future::Cache<u64, bool>,
    pub stats: Stats,
}

impl std::fmt::Debug for Consistency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Consistency")
    }
}

impl Consistency {
    pub fn new(upstream: Upstream, timeout: Duration) -> Arc<Consistency> {
        Arc::new(Consistency {
            upstream,
            timeout,
            rounds: Default::default(),
            writes: Default::default(),
            unknown_writes: Default::default(),
            unknown_generation: Default::default(),
            compacted_floor: Default::default(),
            listable: moka::future::Cache::builder()
                .max_capacity(4096)
                .time_to_live(COMPACTION_RECHECK)
                .build(),
            stats: Stats::default(),
        })
    }

    /// Records the resourceVersion a write passed through returned (read-your-writes).
    pub fn record_write(&self, resource: &str, rv: u64) {
        let mut e = self.writes.entry(resource.to_string()).or_insert(0);
        if rv > *e {
            *e = rv;
        }
    }

    /// Whether etcd has compacted `rv` away, so the apiserver would answer a continue token
    /// at `rv` with 410 (etcd3 storage's `handleCompactedErrorForPaging`). Learnt with a
    /// one-item `resourceVersionMatch=Exact` list at `rv` (410: compacted), shared per
    /// resourceVersion for [`COMPACTION_RECHECK`]; a compacted answer is remembered for good
    /// (revisions are global and compaction only moves forward). A failed probe says "not
    /// compacted": the walk goes on from the proxy's snapshot, which is consistent.
    pub async fn compacted(&self, cache: &ResourceCache, rv: u64) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if rv <= self.compacted_floor.load(Relaxed) {
            return true;
        }
        if self.upstream.reachability().is_unreachable() {
            // No answer would come: as a failed probe, "not compacted" (the snapshot is
            // consistent).
            return false;
        }
        let collection = cache.resource.collection_path(None);
        let listable = self
            .listable
            .get_with(rv, async {
                let path =
                    format!("{collection}?limit=1&resourceVersion={rv}&resourceVersionMatch=Exact");
                let mut req = Request::new(body::empty());
                *req.uri_mut() = self.upstream.uri(&path);
                req.headers_mut()
                    .insert(header::ACCEPT, HeaderValue::from_static("application/json"));
                let sent = self.upstream.send(req, As::Proxy, false);
                match tokio::time::timeout(self.timeout, sent).await {
                    Ok(Ok(r)) => r.status() != http::StatusCode::GONE,
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, rv, "compaction probe failed");
                        true
                    }
                    Err(_) => {
                        tracing::debug!(rv, "compaction probe timed out");
                        true
                    }
                }
            })
            .await;
        if !listable {
            self.compacted_floor.fetch_max(rv, Relaxed);
        }
        !listable
    }

    /// Records a write passed through whose resourceVersion is unknown (read-your-writes):
    /// the next reads of `resource` confirm the cache with an upstream probe first.
    pub fn record_unknown_write(&self, resource: &str) {
        let g = self
            .unknown_generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        self.unknown_writes.insert(resource.to_string(), g);
    }

    /// The state an unset-resourceVersion read may be served from, or the apiserver answers.
    pub async fn latest(
        self: &Arc<Self>,
        cache: &Arc<ResourceCache>,
        mode: Mode,
    ) -> Served<Snapshot> {
        use std::sync::atomic::Ordering::Relaxed;
        // The apiserver alone knows the most recent state, and it cannot be reached: fail at
        // once rather than wait for a probe or a passthrough that gets no answer.
        if let Some(o) = self.upstream.reachability().outage() {
            return Err(crate::read::unreachable(&o).into());
        }
        let start = Instant::now();
        let ok = match mode {
            Mode::Bounded => {
                if cache.unhealthy().is_some() {
                    false
                } else {
                    let label = cache.resource.label();
                    let written = self.writes.get(&label).map(|v| *v).unwrap_or(0);
                    let caught_up =
                        written <= cache.rv() || cache.wait_for_rv(written, self.timeout).await;
                    let unknown = self.unknown_writes.get(&label).map(|g| *g);
                    match unknown {
                        Some(g) if caught_up => {
                            // The probe round joined starts after this read arrived, so after
                            // the write's response was relayed.
                            let ok = tokio::time::timeout(self.timeout, self.confirm(cache, false))
                                .await
                                .unwrap_or(false);
                            if ok {
                                self.unknown_writes.remove_if(&label, |_, have| *have == g);
                            }
                            ok
                        }
                        _ => caught_up,
                    }
                }
            }
            Mode::Strict => {
                cache.unhealthy().is_none()
                    && tokio::time::timeout(self.timeout, self.confirm(cache, true))
                        .await
                        .unwrap_or(false)
            }
        };
        self.stats
            .waits
            .get_or_create(&ModeLabels {
                mode: match mode {
                    Mode::Strict => "strict",
                    Mode::Bounded => "bounded",
                },
            })
            .observe(start.elapsed().as_secs_f64());
        if !ok {
            self.stats.fallbacks.fetch_add(1, Relaxed);
            return delegate(crate::read::NOT_CONFIRMED);
        }
        Ok(cache.current())
    }

    /// Whether `cache` reaches `rv` within `bound`. A resourceVersion the apiserver gave out
    /// (a passed-through or consistent read, a write's response, another replica's list) is
    /// often ahead of one resource's cache only because other resources' writes moved etcd's
    /// revision: no event of this resource will bring the cache there until its next write
    /// or the apiserver's next periodic bookmark, a minute away. kube-apiserver's watch cache
    /// asks etcd for progress while a reader waits; the proxy, after [`REACH_QUIET`] without
    /// the cache getting there, joins a probe round (shared by every reader of the resource
    /// waiting meanwhile), which advances the cache to the current revision once it proved
    /// that nothing of the resource changed in between. A resourceVersion beyond the current
    /// revision stays unreached (the apiserver then answers it, as it answers such reads).
    pub async fn reach(
        self: &Arc<Self>,
        cache: &Arc<ResourceCache>,
        rv: u64,
        bound: Duration,
    ) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if cache.rv() >= rv {
            return true;
        }
        let deadline = tokio::time::Instant::now() + bound;
        if cache.wait_for_rv(rv, REACH_QUIET.min(bound)).await {
            return true;
        }
        if self.upstream.reachability().outage().is_some() || cache.unhealthy().is_some() {
            return cache
                .wait_for_rv(rv, deadline - tokio::time::Instant::now())
                .await;
        }
        self.stats.reach_probes.fetch_add(1, Relaxed);
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        tokio::select! {
            reached = cache.wait_for_rv(rv, left) => reached,
            _ = tokio::time::timeout(left, self.confirm(cache, false)) => {
                // The probe ended (confirmed or not): whatever it proved is in the cache's
                // resourceVersion now; the rest of the bound is for the resource's own events.
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                cache.rv() >= rv || cache.wait_for_rv(rv, left).await
            }
        }
    }

    /// Brings `cache` to the apiserver's current revision within `bound` (a probe round,
    /// which advances the cache once it proved that nothing of the resource changed since,
    /// waiting for a catch-up watch when one is needed); whether it got there. For a read
    /// that must be newer than a revision the caller cannot name (an inconsistent
    /// continuation, issued when etcd compacted the walk's revision).
    pub async fn advance(self: &Arc<Self>, cache: &Arc<ResourceCache>, bound: Duration) -> bool {
        if self.upstream.reachability().outage().is_some() || cache.unhealthy().is_some() {
            return false;
        }
        tokio::time::timeout(bound, self.confirm(cache, false))
            .await
            .unwrap_or(false)
    }

    /// Whether an upstream watch is catching the cache of `resource` (its label, e.g.
    /// `secrets`) up to a newer revision for strict reads, which meanwhile pass through.
    pub fn catching_up(&self, resource: &str) -> bool {
        self.rounds
            .get(resource)
            .is_some_and(|r| r.catching_up.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Joins the next probe round of `cache` that starts after now; true when it confirmed
    /// the cache current. `detach` (strict reads, which pass through when not confirmed):
    /// a round that needs the slow proof leaves it to a catch-up of its own and ends at once
    /// ([`Consistency::probe`]). Without it (a read after a write whose resourceVersion is
    /// unknown, a read reaching a resourceVersion: both would rather wait for the cache than
    /// pass through), the round waits for the proof.
    async fn confirm(self: &Arc<Self>, cache: &Arc<ResourceCache>, detach: bool) -> bool {
        let rounds = self
            .rounds
            .entry(cache.resource.label())
            .or_insert_with(|| {
                Arc::new(Rounds {
                    state: Mutex::new(RoundState::default()),
                    catching_up: Default::default(),
                    done: watch::channel((0, false)).0,
                })
            })
            .clone();
        // An upstream watch is proving the cache complete up to a newer revision: no probe
        // can confirm it before that ends, so none is sent (the read passes through).
        if detach
            && rounds
                .catching_up
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            return false;
        }
        let mut rx = rounds.done.subscribe();
        let target = {
            let mut s = rounds.state.lock();
            let target = s.started + 1;
            s.wanted = s.wanted.max(target);
            if !s.running {
                s.running = true;
                s.started += 1;
                self.clone()
                    .spawn_round(rounds.clone(), cache.clone(), detach);
            }
            target
        };
        match rx.wait_for(|(n, _)| *n >= target).await {
            Ok(v) => v.1,
            Err(_) => false,
        }
    }

    fn spawn_round(self: Arc<Self>, rounds: Arc<Rounds>, cache: Arc<ResourceCache>, detach: bool) {
        tokio::spawn(async move {
            loop {
                let n = rounds.state.lock().started;
                let outcome =
                    match tokio::time::timeout(self.timeout, self.probe(&rounds, &cache, detach))
                        .await
                    {
                        Ok(r) => r,
                        Err(_) => Err(ProbeError::TimedOut),
                    };
                let ok = outcome.is_ok();
                if let Err(e) = &outcome
                    && !matches!(e, ProbeError::CatchingUp)
                {
                    tracing::warn!(resource = %cache.resource.label(), error = %e, "consistency probe failed; reads pass through");
                    self.stats
                        .probe_failures
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                rounds.done.send_replace((n, ok));
                let mut s = rounds.state.lock();
                if s.wanted > s.started {
                    s.started += 1;
                } else {
                    s.running = false;
                    return;
                }
            }
        });
    }

    async fn get(
        &self,
        path_and_query: &str,
    ) -> Result<http::Response<hyper::body::Incoming>, ProbeError> {
        let mut req = Request::new(body::empty());
        *req.method_mut() = Method::GET;
        *req.uri_mut() = self.upstream.uri(path_and_query);
        req.headers_mut()
            .insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        let resp = self
            .upstream
            .send(req, As::Proxy, true)
            .await
            .map_err(ProbeError::Send)?;
        if !resp.status().is_success() {
            return Err(ProbeError::Status {
                path: path_and_query.to_string(),
                status: resp.status(),
            });
        }
        Ok(resp)
    }

    /// One probe: the current revision, then proof that the cache holds every change up to
    /// it. When the cache is behind and its own watch does not bring it there within
    /// [`CATCH_UP_QUIET`], the proof takes an upstream watch up to a bookmark, one to two
    /// seconds. With `detach` (a round of strict reads) that runs on its own
    /// ([`Consistency::catch_up`]) and this round's reads pass through meanwhile (the
    /// apiserver answers them as fresh as it would without the proxy, in milliseconds, where
    /// waiting for the proof made them wait seconds); without, the round waits for it.
    async fn probe(
        self: &Arc<Self>,
        rounds: &Arc<Rounds>,
        cache: &Arc<ResourceCache>,
        detach: bool,
    ) -> Result<(), ProbeError> {
        use std::sync::atomic::Ordering::Relaxed;
        self.stats.probes.fetch_add(1, Relaxed);
        let collection = cache.resource.collection_path(None);
        let resp = self.get(&format!("{collection}?limit=1")).await?;
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(ProbeError::Body)?
            .to_bytes();
        let current = list_rv(&body).ok_or(ProbeError::NoResourceVersion)?;
        if cache.rv() >= current {
            return Ok(());
        }
        // A catch-up under way is the cache's way there: pass through at once.
        if detach && rounds.catching_up.load(Relaxed) {
            return Err(ProbeError::CatchingUp);
        }
        // Usually the cache's own watch brings it there within milliseconds.
        if cache.wait_for_rv(current, CATCH_UP_QUIET).await {
            return Ok(());
        }
        if !detach {
            self.stats.probe_watches.fetch_add(1, Relaxed);
            return self.catch_up(cache, current).await;
        }
        if !rounds.catching_up.swap(true, Relaxed) {
            self.stats.probe_watches.fetch_add(1, Relaxed);
            let (this, rounds, cache) = (self.clone(), rounds.clone(), cache.clone());
            tokio::spawn(async move {
                let outcome = match tokio::time::timeout(
                    this.timeout,
                    this.catch_up(&cache, current),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => Err(ProbeError::TimedOut),
                };
                if let Err(e) = outcome {
                    tracing::warn!(resource = %cache.resource.label(), error = %e, "consistency catch-up failed; strict reads pass through until one succeeds");
                    this.stats.probe_failures.fetch_add(1, Relaxed);
                }
                rounds.catching_up.store(false, Relaxed);
            });
        }
        Err(ProbeError::CatchingUp)
    }

    /// Proves that the cache holds every change up to `current` and advances it there.
    /// Nothing of this resource may have changed since the cache's resourceVersion: ask the
    /// apiserver for everything after it, up to a bookmark. The apiserver sends one 2 s
    /// before a watch's deadline (and none if that moment has passed when the watch starts),
    /// so timeoutSeconds=3: the bookmark comes after about 1-2 s. This is the slow path of
    /// strict reads, taken when other resources' writes moved the revision.
    async fn catch_up(&self, cache: &Arc<ResourceCache>, current: u64) -> Result<(), ProbeError> {
        let collection = cache.resource.collection_path(None);
        let from = cache.rv();
        if from >= current {
            return Ok(());
        }
        let resp = self
            .get(&format!(
                "{collection}?watch=1&resourceVersion={from}&allowWatchBookmarks=true&timeoutSeconds=3"
            ))
            .await?;
        let mut body = resp.into_body();
        let mut buf = Vec::new();
        let mut last_event = from;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(ProbeError::Body)?;
            let Some(data) = frame.data_ref() else {
                continue;
            };
            buf.extend_from_slice(data);
            while let Some(nl) = memchr::memchr(b'\n', &buf) {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let Some((ty, rv)) = event_rv(&line) else {
                    continue;
                };
                match ty.as_str() {
                    "BOOKMARK" if rv >= current => {
                        // Every event up to `rv` was on this stream; once the cache applied
                        // the last of them, it is complete up to `rv`.
                        if last_event > cache.rv()
                            && !cache.wait_for_rv(last_event, self.timeout).await
                        {
                            return Err(ProbeError::NotApplied);
                        }
                        cache.bookmark(rv);
                        return Ok(());
                    }
                    "BOOKMARK" => {}
                    "ERROR" => return Err(ProbeError::WatchError),
                    _ => last_event = last_event.max(rv),
                }
            }
        }
        Err(ProbeError::NoBookmark)
    }
}

/// Why a consistency probe proved nothing; the reads waiting on it pass through.
#[derive(Debug, thiserror::Error)]
enum ProbeError {
    /// The cache is behind the current revision and an upstream watch is proving it
    /// complete ([`Consistency::catch_up`]): not a failure, the round's reads pass through.
    #[error("catching up")]
    CatchingUp,
    /// Longer than `lists.consistencyTimeout`.
    #[error("timed out")]
    TimedOut,
    /// No response (the upstream's error names the address and cause).
    #[error(transparent)]
    Send(tower::BoxError),
    #[error("{path}: {status}")]
    Status {
        path: String,
        status: http::StatusCode,
    },
    /// The body broke off.
    #[error(transparent)]
    Body(hyper::Error),
    #[error("no resourceVersion in the probe list")]
    NoResourceVersion,
    #[error("the cache did not apply the probed events")]
    NotApplied,
    /// The probe watch sent an ERROR event (its resourceVersion was compacted, say).
    #[error("probe watch error")]
    WatchError,
    #[error("probe watch ended without a bookmark")]
    NoBookmark,
}

fn list_rv(body: &Bytes) -> Option<u64> {
    #[derive(Deserialize)]
    struct L {
        metadata: M,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct M {
        resource_version: String,
    }
    serde_json::from_slice::<L>(body)
        .ok()?
        .metadata
        .resource_version
        .parse()
        .ok()
}

fn event_rv(line: &[u8]) -> Option<(String, u64)> {
    #[derive(Deserialize)]
    struct E {
        #[serde(rename = "type")]
        ty: String,
        object: O,
    }
    #[derive(Deserialize)]
    struct O {
        #[serde(default)]
        metadata: Option<M>,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct M {
        #[serde(default)]
        resource_version: String,
    }
    let e: E = serde_json::from_slice(line).ok()?;
    let rv = e
        .object
        .metadata
        .and_then(|m| m.resource_version.parse().ok())
        .unwrap_or(0);
    Some((e.ty, rv))
}

/// How long an answer of [`Consistency::compacted`] is reused.
pub const COMPACTION_RECHECK: Duration = Duration::from_secs(10);

/// The resourceVersion of the object in a write's response (read-your-writes), in the
/// encodings the apiserver writes objects in: JSON, and protobuf (`k8s\0` envelope).
pub fn response_rv(content_type: Option<&str>, body: &[u8]) -> Option<u64> {
    let media = content_type
        .and_then(|c| c.split(';').next())
        .map(str::trim)
        .unwrap_or("");
    match media {
        "application/vnd.kubernetes.protobuf" => {
            crate::k8s::protobuf::object_resource_version(body)
        }
        "application/json" | "" => body_rv(body),
        _ => None,
    }
}

/// The resourceVersion in a JSON write response body (read-your-writes), if it has one.
pub fn body_rv(body: &[u8]) -> Option<u64> {
    #[derive(Deserialize)]
    struct O {
        metadata: M,
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct M {
        resource_version: String,
    }
    serde_json::from_slice::<O>(body)
        .ok()?
        .metadata
        .resource_version
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_resource_versions_from_lists_events_and_objects() {
        assert_eq!(
            list_rv(&Bytes::from_static(
                br#"{"kind":"PodList","metadata":{"resourceVersion":"42"},"items":[]}"#
            )),
            Some(42)
        );
        assert_eq!(list_rv(&Bytes::from_static(b"{}")), None);
        assert_eq!(
            event_rv(br#"{"type":"BOOKMARK","object":{"kind":"Pod","metadata":{"resourceVersion":"7"}}}"#),
            Some(("BOOKMARK".into(), 7))
        );
        assert_eq!(
            event_rv(br#"{"type":"ERROR","object":{"kind":"Status","code":410}}"#),
            Some(("ERROR".into(), 0))
        );
        assert_eq!(
            body_rv(br#"{"metadata":{"name":"a","resourceVersion":"9"}}"#),
            Some(9)
        );
        assert_eq!(body_rv(br#"{"kind":"Status"}"#), None);
    }
}
