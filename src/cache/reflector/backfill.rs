//! Backfill: extending a cache's history back in time from the apiserver, so a client
//! resuming a watch from a resourceVersion older than the history (after a proxy restart
//! without saved state, on a replica that listed after the client's last event, after the
//! history aged out) is served without 410 and without a relist.
//!
//! The apiserver still has the stretch the cache lacks while etcd has not compacted it: an
//! Exact list at the client's resourceVersion gives the state there (the base), and a watch
//! from it gives every change after it, in order, up to the history's start. The cache
//! joins them to its history only when replaying the changes over the base arrives at the
//! state its history starts from, object by object ([`ResourceCache::extend_history`]);
//! every later client resuming anywhere in the stretch is then served from the history
//! like any other, so one backfill serves them all. Backfills of one resource run one at
//! a time; a client waiting for one is served by it when its resourceVersion is covered.
//!
//! The watch needs an end: every change up to the history's start `h` has arrived when an
//! event after `h` or a bookmark at `h` or later arrives, or, when the cache knows no
//! change after `h` (the apiserver then has none to send after it either), when the replay
//! equals the history's start state and the short watch has ended (the apiserver sends a
//! resumed watch the changes it holds at once, before it times out).
//!
//! What the apiserver cannot serve *now* (429: its own watch cache is initializing after a
//! restart, as kube-apiserver answers while `ResilientWatchCacheInitialization` holds; a
//! 5xx, no answer, the backfill's time bound) ends the backfill as `Unavailable`: the client
//! is told to retry (429 with `Retry-After`, on which client-go watches again from the same
//! resourceVersion) rather than given a 410 that would make it relist.
//!
//! What the apiserver refuses (410: compacted, or older than its watch cache) ends the
//! backfill; the client then gets the 410 the apiserver would have given it, and no
//! backfill is tried again at or below that resourceVersion (a client chooses its
//! resourceVersion: it must not make the proxy list the resource upstream at will). A
//! stretch that would not fit the history's bound is refused the same way, and a resource
//! gets at most a few backfills, then one per 15 s (`BURST`, `REFILL`). A client that
//! finds the budget spent is told to retry, like one the apiserver could not serve (below),
//! for at most `SPELL` since the last try: its resourceVersion gathers with the others'
//! for the next try, so clients resuming from many different resourceVersions (a replica's
//! watchers moving to another) cost a few lists and no relist.
//!
//! A budget spent on tries the apiserver could not serve (a large cluster's apiserver can
//! take minutes to initialize its watch caches after a restart) still answers "retry", for
//! at most `SPELL` from the first of them: the retrying clients' resourceVersions gather
//! in the next backfill (it starts from the oldest), which serves them all once the
//! apiserver can. Past `SPELL` without a served backfill they get 410 and relist (from
//! the proxy's cache), rather than wait without end. Once the cache's own upstream watch
//! has come back after the last such try (the apiserver restarted and serves again), the
//! next client's try goes ahead without waiting for a refill: the clients resume as soon
//! as the apiserver can serve them.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, header};
use http_body_util::BodyExt as _;

use super::config::ReflectorConfig;
use super::error::{ReflectorError, error_response};
use super::list::Pager;
use super::stats::ReflectorStats;
use super::watch::{LineSplitter, WatchItem, parse_event_line};
use crate::cache::relist::Objects;
use crate::cache::{CachedObject, EventKind, ObjectKey, ResourceCache};
use crate::http::body;
use crate::upstream::{As, Upstream};

/// How a backfill extended the history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stretch {
    /// The apiserver's real events (a watch from the client's resourceVersion).
    Events,
    /// The difference from the state at the client's resourceVersion (an Exact list) to
    /// the history's start, as a relist's (`ResourceCache::extend_history_with_difference`).
    Difference,
}

/// Why a backfill did not extend the history.
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    /// The apiserver no longer has the stretch (410), or the cache's history cannot be
    /// joined (absorbed relist, bound): the client gets 410.
    #[error("{0}")]
    Gone(String),
    /// The apiserver could not serve the stretch now (429, 5xx, no answer, the time bound):
    /// the client is told to retry.
    #[error("{0}")]
    Unavailable(String),
    /// The events did not lead to the history's start, the backfill budget is spent, or
    /// the apiserver's answer was unusable: the client gets 410.
    #[error("{0}")]
    Failed(String),
}

/// Counters of backfills (read by the metrics collector).
#[derive(Debug, Default)]
pub struct BackfillStats {
    pub filled: std::sync::atomic::AtomicU64,
    pub events: std::sync::atomic::AtomicU64,
    pub gone: std::sync::atomic::AtomicU64,
    pub failed: std::sync::atomic::AtomicU64,
    /// The apiserver could not serve the stretch now; the client was told to retry.
    pub unavailable: std::sync::atomic::AtomicU64,
    /// Stretches the apiserver's watch no longer had, extended with the difference from
    /// its Exact list instead (not counted in `filled`).
    pub differences: std::sync::atomic::AtomicU64,
}

/// Backfills of one resource, at most: a burst of this many...
const BURST: u32 = 4;
/// ...then one per this long. Each costs the apiserver a list of the whole resource; a
/// client choosing ever older resourceVersions must not turn into a stream of them. After a
/// restart the clients of a resource are served by one or two (they are grouped).
const REFILL: Duration = Duration::from_secs(15);
/// How long after its first try the apiserver could not serve a resource's clients are
/// told to retry while its budget is spent (a few refills: each one tries again).
const SPELL: Duration = Duration::from_secs(60);

/// One resource's backfill budget, and since when its tries have ended `Unavailable`.
struct Budget {
    rate: governor::DefaultDirectRateLimiter,
    /// The first of the unbroken run of tries that ended `Unavailable`, if the last did,
    /// and the cache's upstream recoveries ([`ResourceCache::recoveries`]) at the last one.
    unavailable_since: std::sync::Mutex<Option<(tokio::time::Instant, u64)>>,
    /// The first of the unbroken run of clients refused a try because the budget was spent
    /// (reset by the next try).
    spent_since: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Budget {
    fn new() -> Budget {
        let q = governor::Quota::with_period(REFILL)
            .expect("a non-zero period")
            .allow_burst(std::num::NonZeroU32::new(BURST).expect("non-zero"));
        Budget {
            rate: governor::RateLimiter::direct(q),
            unavailable_since: Default::default(),
            spent_since: Default::default(),
        }
    }

    /// A client found the budget spent: for how long clients have (since the last try).
    fn spent(&self) -> Duration {
        let mut since = self.spent_since.lock().unwrap_or_else(|e| e.into_inner());
        since
            .get_or_insert_with(tokio::time::Instant::now)
            .elapsed()
    }

    /// Records how a try ended; `recoveries`: the cache's upstream recoveries before it.
    fn tried<T>(&self, out: &Result<T, BackfillError>, recoveries: u64) {
        *self.spent_since.lock().unwrap_or_else(|e| e.into_inner()) = None;
        let mut since = self
            .unavailable_since
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        match out {
            Err(BackfillError::Unavailable(_)) => {
                let first = since.map_or_else(tokio::time::Instant::now, |(t, _)| t);
                *since = Some((first, recoveries));
            }
            _ => *since = None,
        }
    }

    /// How long the apiserver has been unable to serve this resource's tries, when it still
    /// is and that began less than [`SPELL`] ago; and whether the cache's upstream watch
    /// came back since the last of them (`recoveries` now), when the apiserver most
    /// likely can serve it.
    fn in_spell(&self, recoveries: u64) -> Option<(Duration, bool)> {
        let since = *self
            .unavailable_since
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        since
            .map(|(t, at)| (t.elapsed(), recoveries > at))
            .filter(|(for_how_long, _)| *for_how_long <= SPELL)
    }
}

/// Extends caches' histories from the apiserver with the proxy's own identity.
#[derive(Clone)]
pub struct Backfiller {
    /// Per resource (its label): how many backfills it may start now.
    limits: Arc<dashmap::DashMap<String, Arc<Budget>>>,
    upstream: Upstream,
    cfg: ReflectorConfig,
    /// Bound on one backfill, waiting for another one of the same resource included.
    timeout: Duration,
    stats: Arc<ReflectorStats>,
    pub counters: Arc<BackfillStats>,
}

impl std::fmt::Debug for Backfiller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Backfiller")
    }
}

impl Backfiller {
    pub fn new(upstream: Upstream, cfg: ReflectorConfig, timeout: Duration) -> Backfiller {
        Backfiller {
            limits: Default::default(),
            upstream,
            cfg,
            timeout,
            stats: Default::default(),
            counters: Default::default(),
        }
    }

    /// Whether the apiserver is known to be unreachable (no backfill is tried then).
    pub fn unreachable(&self) -> bool {
        self.upstream.reachability().is_unreachable()
    }

    /// Extends `cache`'s history back to `from` (a watch from `from` can then be
    /// registered), or says why not. Returns the number of events added.
    pub async fn fill(&self, cache: &ResourceCache, from: u64) -> Result<usize, BackfillError> {
        use std::sync::atomic::Ordering::Relaxed;
        // One bound on the whole: waiting for another backfill, then this one's tries.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let late = || BackfillError::Unavailable(format!("no backfill within {:?}", self.timeout));
        let run = async {
            // Clients waiting behind a running backfill are served by the next one
            // together: it starts from the oldest resourceVersion any of them asked for.
            cache.backfill_wanted.fetch_min(from, Relaxed);
            let Ok(_one) = tokio::time::timeout_at(deadline, cache.backfill_lock.lock()).await
            else {
                return Err(late());
            };
            if from >= cache.oldest_rv() {
                return Ok(None); // another backfill covered it
            }
            // A client's resourceVersion is its own choice: one the apiserver refused, or
            // an older one, costs it no further upstream list.
            let floor = cache.backfill_floor.load(Relaxed);
            if from <= floor {
                return Err(BackfillError::Gone(
                    "the apiserver refused this resourceVersion or a newer one".into(),
                ));
            }
            if !cache.backfillable(from) {
                return Err(BackfillError::Gone(
                    "an absorbed relist lies between the resourceVersion and the history".into(),
                ));
            }
            let budget = self
                .limits
                .entry(cache.resource.label())
                .or_insert_with(|| Arc::new(Budget::new()))
                .clone();
            // The upstream recoveries before this try: a try that fails is retried, past the
            // budget, once the cache's upstream watch has come back after it (the apiserver
            // restarted and can serve again), so its clients are not told to wait a refill.
            let recoveries = cache.recoveries.load(Relaxed);
            if budget.rate.check().is_err() {
                match budget.in_spell(recoveries) {
                    Some((_, true)) => {}
                    // The clients' resourceVersions stay in `backfill_wanted` for the next try.
                    Some((for_how_long, false)) => {
                        return Err(BackfillError::Unavailable(format!(
                            "the apiserver could not serve this resource's backfills for {}s; \
                             the next try is within {REFILL:?}",
                            for_how_long.as_secs()
                        )));
                    }
                    // Clients resuming from resourceVersions scattered over the stretch
                    // (a replica's watchers moving to another) each want one: they are
                    // told to retry, and their resourceVersions gather for the next try,
                    // which serves them all; a 410 would make each of them relist. Bounded
                    // like the apiserver's unavailability: past `SPELL`, 410.
                    None => {
                        let for_how_long = budget.spent();
                        let why = format!(
                            "more than {BURST} backfills of this resource, then one per {REFILL:?}"
                        );
                        return Err(if for_how_long <= SPELL {
                            BackfillError::Unavailable(format!(
                                "{why}; the clients waiting are served by the next one"
                            ))
                        } else {
                            BackfillError::Failed(why)
                        });
                    }
                }
            }
            let oldest = cache.backfill_wanted.swap(u64::MAX, Relaxed).min(from);
            // Real events only for the waiting clients: a difference would make every
            // resume inside its stretch a 410, this client's own included.
            if oldest < from && oldest > floor && cache.backfillable(oldest) {
                let out = tokio::time::timeout_at(deadline, self.fill_from(cache, oldest, false))
                    .await
                    .unwrap_or_else(|_| Err(late()));
                budget.tried(&out, recoveries);
                match out {
                    Ok(n) => return Ok(Some(n)),
                    // The older one is not to be had: this client's own may be.
                    Err(e) => {
                        tracing::debug!(error = %e, oldest, from, "backfill for waiting clients failed")
                    }
                }
            }
            let out = tokio::time::timeout_at(deadline, self.fill_from(cache, from, true))
                .await
                .unwrap_or_else(|_| Err(late()));
            budget.tried(&out, recoveries);
            out.map(Some)
        };
        let out = run.await;
        match &out {
            Ok(None) => {}
            Ok(Some((n, how))) => {
                match how {
                    Stretch::Events => self.counters.filled.fetch_add(1, Relaxed),
                    Stretch::Difference => self.counters.differences.fetch_add(1, Relaxed),
                };
                self.counters.events.fetch_add(*n as u64, Relaxed);
                tracing::info!(resource = %cache.resource.label(), from, events = n, stretch = ?how, "history extended back from the apiserver");
            }
            Err(e) => {
                let c = match e {
                    BackfillError::Gone(_) => &self.counters.gone,
                    BackfillError::Unavailable(_) => &self.counters.unavailable,
                    BackfillError::Failed(_) => &self.counters.failed,
                };
                c.fetch_add(1, Relaxed);
                tracing::info!(resource = %cache.resource.label(), from, error = %e, "history not extended");
            }
        }
        out.map(|n| n.map_or(0, |(n, _)| n))
    }

    /// One backfill from `from`; a 410 sets the floor. `difference`: when the apiserver's
    /// watch no longer has the changes, extend with the difference instead.
    async fn fill_from(
        &self,
        cache: &ResourceCache,
        from: u64,
        difference: bool,
    ) -> Result<(usize, Stretch), BackfillError> {
        let out = self.fill_locked(cache, from, difference).await;
        if let Err(BackfillError::Gone(_)) = &out {
            cache
                .backfill_floor
                .fetch_max(from, std::sync::atomic::Ordering::Relaxed);
        }
        out
    }

    async fn fill_locked(
        &self,
        cache: &ResourceCache,
        from: u64,
        difference: bool,
    ) -> Result<(usize, Stretch), BackfillError> {
        let (h, target, later) = cache.history_start();
        let pager = Pager {
            upstream: &self.upstream,
            resource: &cache.resource,
            cfg: &self.cfg,
            stats: &self.stats,
            exact: Some(from),
        };
        let (base, rv) = pager.list(true).await.map_err(|(e, _)| classify(e))?;
        if rv != from {
            return Err(BackfillError::Failed(format!(
                "the Exact list answered resourceVersion {rv}, not {from}"
            )));
        }
        match self.changes(cache, from, h, &base, &target, later).await {
            Ok(events) => {
                let envelopes = self
                    .protobuf_envelopes(cache, from, h, events.len(), later)
                    .await;
                let out = cache
                    .extend_history(from, base, events)
                    .map(|n| (n, Stretch::Events))
                    .map_err(|e| BackfillError::Failed(e.to_string()));
                // Attached as the stretch joins (no await between): a protobuf client
                // resuming in it finds every envelope there, not a starting point whose
                // envelopes never come.
                if out.is_ok() {
                    for (key, rv, envelope) in envelopes {
                        cache.attach_protobuf(&key, rv, envelope);
                    }
                }
                out
            }
            // etcd still has the state at `from` (the Exact list) but the apiserver's watch
            // no longer has the changes after it (older than its watch cache), or they would
            // not fit the history: the difference still spares the client a relist.
            // The stretch then answers 410 to every resume strictly inside it (their place
            // among the difference's events is unknown): a client there that is newer than
            // the apiserver's window, arriving later, relists where real events could have
            // served it. Only for a client's own resourceVersion, never for waiting ones.
            Err(BackfillError::Gone(why)) if difference && cache.absorbs_relists() => {
                tracing::debug!(resource = %cache.resource.label(), from, why, "no changes from the apiserver: extending with the difference");
                cache
                    .extend_history_with_difference(from, base)
                    .map(|n| (n, Stretch::Difference))
                    .map_err(|e| BackfillError::Gone(format!("{why}; no difference: {e}")))
            }
            Err(e) => Err(e),
        }
    }

    /// Every change after `from` up to `h`, from a watch from `from`.
    async fn changes(
        &self,
        cache: &ResourceCache,
        from: u64,
        h: u64,
        base: &[CachedObject],
        target: &Objects,
        later: bool,
    ) -> Result<Vec<(EventKind, CachedObject)>, BackfillError> {
        const WHAT: &str = "backfill watch";
        // Keys whose replayed resourceVersion differs from the history's start.
        let mut state: std::collections::HashMap<ObjectKey, u64> = base
            .iter()
            .map(|o| (o.key(), o.meta.resource_version))
            .collect();
        let mut differ: std::collections::HashSet<ObjectKey> = state
            .iter()
            .filter(|(k, rv)| target.get(*k).map(|o| o.meta.resource_version) != Some(**rv))
            .map(|(k, _)| k.clone())
            .chain(target.keys().filter(|k| !state.contains_key(*k)).cloned())
            .collect();
        // With a change after `h` known, the watch ends at its event; without, a short watch
        // whose end says the apiserver sent all it held.
        let timeout_secs = if later {
            self.timeout.as_secs().max(1)
        } else {
            1
        };
        let pq = format!(
            "{}?watch=1&allowWatchBookmarks=true&resourceVersion={from}&timeoutSeconds={timeout_secs}",
            cache.resource.collection_path(None)
        );
        let req = Request::get(self.upstream.uri(&pq))
            .header(header::ACCEPT, "application/json")
            .body(body::empty())
            .expect("a GET with a valid URI is a valid request");
        let resp = self
            .upstream
            .send(req, As::Proxy, true)
            .await
            .map_err(|source| classify(ReflectorError::Transport { what: WHAT, source }))?;
        if !resp.status().is_success() {
            return Err(classify(error_response(WHAT, resp).await));
        }
        let mut events = Vec::new();
        let mut body = resp.into_body();
        let mut lines = LineSplitter::default();
        let mut batch = Vec::new();
        loop {
            let Some(frame) = body.frame().await else {
                // The watch ended: complete only if nothing after `h` was expected and the
                // replay arrived.
                if !later && differ.is_empty() {
                    return Ok(events);
                }
                return Err(BackfillError::Failed(format!(
                    "the watch ended before reaching resourceVersion {h} ({} objects differ)",
                    differ.len()
                )));
            };
            let frame = frame.map_err(|e| {
                classify(ReflectorError::Body {
                    what: WHAT,
                    source: e.into(),
                })
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            lines.push(data, &mut batch).map_err(classify)?;
            for line in batch.drain(..) {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                match parse_event_line(&line, &cache.resource).map_err(classify)? {
                    WatchItem::Object(_, o) if o.meta.resource_version > h => {
                        return self.reached(events, &differ, h);
                    }
                    WatchItem::Bookmark(rv) if rv >= h => return self.reached(events, &differ, h),
                    WatchItem::Bookmark(_) => {}
                    WatchItem::Object(kind, o) => {
                        let key = o.key();
                        let rv = o.meta.resource_version;
                        let now = if kind == EventKind::Deleted {
                            state.remove(&key);
                            None
                        } else {
                            state.insert(key.clone(), rv);
                            Some(rv)
                        };
                        if target.get(&key).map(|t| t.meta.resource_version) == now {
                            differ.remove(&key);
                        } else {
                            differ.insert(key);
                        }
                        if events.len() >= cache.history_room() {
                            return Err(BackfillError::Gone(
                                "the history would exceed historyMaxEvents".into(),
                            ));
                        }
                        events.push((kind, o));
                    }
                    WatchItem::Error(status) => {
                        return Err(classify(ReflectorError::Status { what: WHAT, status }));
                    }
                }
            }
        }
    }

    /// The protobuf envelopes of the `n` changes after `from` up to `h` (those
    /// [`Self::changes`] read in JSON), from a protobuf watch from `from`, when the
    /// resource's protobuf side runs: that side brings only the state it starts from and
    /// what follows, so without them a protobuf client resuming in a backfilled stretch (after
    /// a cold restart) would be handed to the apiserver. What cannot be had is logged and
    /// left out: such a client then goes to the apiserver, as before, and is moved back
    /// once it has passed the stretch (`serve::homing`).
    async fn protobuf_envelopes(
        &self,
        cache: &ResourceCache,
        from: u64,
        h: u64,
        n: usize,
        later: bool,
    ) -> Vec<(ObjectKey, u64, bytes::Bytes)> {
        if n == 0 || cache.resource.custom || !cache.protobuf_started() || cache.transcodes() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(n);
        let bound = if later {
            self.timeout
        } else {
            Duration::from_secs(2)
        };
        let read = tokio::time::timeout(
            bound,
            self.read_protobuf(cache, from, h, n, later, &mut out),
        );
        match read.await {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                tracing::info!(resource = %cache.resource.label(), from, got = out.len(), of = n, error = %why, "backfill: protobuf envelopes not all had");
            }
            Err(_) => {
                tracing::info!(resource = %cache.resource.label(), from, got = out.len(), of = n, "backfill: protobuf envelopes not all had within {bound:?}");
            }
        }
        out
    }

    async fn read_protobuf(
        &self,
        cache: &ResourceCache,
        from: u64,
        h: u64,
        n: usize,
        later: bool,
        out: &mut Vec<(ObjectKey, u64, bytes::Bytes)>,
    ) -> Result<(), BackfillError> {
        use super::proto::{FrameReader, ProtoItem, decode};
        const WHAT: &str = "backfill protobuf watch";
        let timeout_secs = if later {
            self.timeout.as_secs().max(1)
        } else {
            1
        };
        let pq = format!(
            "{}?watch=1&allowWatchBookmarks=true&resourceVersion={from}&timeoutSeconds={timeout_secs}",
            cache.resource.collection_path(None)
        );
        let req = Request::get(self.upstream.uri(&pq))
            .header(header::ACCEPT, "application/vnd.kubernetes.protobuf")
            .body(body::empty())
            .expect("a GET with a valid URI is a valid request");
        let resp = self
            .upstream
            .send(req, As::Proxy, true)
            .await
            .map_err(|source| classify(ReflectorError::Transport { what: WHAT, source }))?;
        if !resp.status().is_success() {
            return Err(classify(error_response(WHAT, resp).await));
        }
        let mut body = resp.into_body();
        let mut reader = FrameReader::default();
        let mut frames = Vec::new();
        while out.len() < n {
            let Some(frame) = body.frame().await else {
                return Ok(());
            };
            let frame = frame.map_err(|e| {
                classify(ReflectorError::Body {
                    what: WHAT,
                    source: e.into(),
                })
            })?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            reader
                .push(data, &mut frames)
                .map_err(|e| BackfillError::Failed(e.to_string()))?;
            for f in frames.drain(..) {
                match decode(&f).map_err(|e| BackfillError::Failed(e.to_string()))? {
                    ProtoItem::Object {
                        key, rv, envelope, ..
                    } if rv <= h => {
                        out.push((key, rv, envelope));
                    }
                    ProtoItem::Object { .. } => return Ok(()),
                    ProtoItem::Bookmark { rv, .. } if rv >= h => return Ok(()),
                    ProtoItem::Bookmark { .. } => {}
                    ProtoItem::Error(status) => {
                        return Err(classify(ReflectorError::Status { what: WHAT, status }));
                    }
                }
            }
        }
        Ok(())
    }

    fn reached(
        &self,
        events: Vec<(EventKind, CachedObject)>,
        differ: &std::collections::HashSet<ObjectKey>,
        h: u64,
    ) -> Result<Vec<(EventKind, CachedObject)>, BackfillError> {
        if differ.is_empty() {
            Ok(events)
        } else {
            Err(BackfillError::Failed(format!(
                "the apiserver's changes do not lead to the state at {h} ({} objects differ)",
                differ.len()
            )))
        }
    }
}

/// 410 (compacted, or past the apiserver's watch cache) is `Gone`; what a later try may
/// get past (429, 5xx, no answer, a broken body) `Unavailable`; the rest `Failed`.
fn classify(e: ReflectorError) -> BackfillError {
    match &e {
        ReflectorError::Status { status, .. } if status.code == 410 => {
            BackfillError::Gone(e.to_string())
        }
        ReflectorError::Status { status, .. } if status.code == 429 || status.code >= 500 => {
            BackfillError::Unavailable(e.to_string())
        }
        ReflectorError::Transport { .. }
        | ReflectorError::Timeout { .. }
        | ReflectorError::Body { .. } => BackfillError::Unavailable(e.to_string()),
        _ => BackfillError::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unavailable() -> Result<(), BackfillError> {
        Err(BackfillError::Unavailable("429".into()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_spell_starts_at_the_first_unavailable_try_and_ends_with_any_other_outcome() {
        let b = Budget::new();
        assert_eq!(b.in_spell(0), None, "no try yet");
        b.tried(&unavailable(), 0);
        tokio::time::advance(Duration::from_secs(20)).await;
        b.tried(&unavailable(), 0);
        assert_eq!(
            b.in_spell(0),
            Some((Duration::from_secs(20), false)),
            "counted from the first try of the run"
        );
        b.tried(&Err::<(), _>(BackfillError::Gone("410".into())), 0);
        assert_eq!(b.in_spell(0), None, "a 410 ends it");
        b.tried(&unavailable(), 0);
        b.tried(&Ok(()), 0);
        assert_eq!(b.in_spell(0), None, "a served try ends it");
        b.tried(&unavailable(), 0);
        tokio::time::advance(SPELL).await;
        assert_eq!(
            b.in_spell(0),
            Some((SPELL, false)),
            "still within its bound"
        );
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(b.in_spell(0), None, "past its bound: the clients get 410");
    }

    #[tokio::test(start_paused = true)]
    async fn clients_finding_the_budget_spent_count_from_the_first_of_them_until_the_next_try() {
        let b = Budget::new();
        assert_eq!(
            b.spent(),
            Duration::ZERO,
            "the first client starts the count"
        );
        tokio::time::advance(Duration::from_secs(20)).await;
        assert_eq!(b.spent(), Duration::from_secs(20), "counted from the first");
        tokio::time::advance(SPELL).await;
        assert!(b.spent() > SPELL, "past its bound: the clients get 410");
        b.tried(&Ok(()), 0);
        assert_eq!(b.spent(), Duration::ZERO, "a try starts a new count");
    }

    #[tokio::test(start_paused = true)]
    async fn a_spell_asks_for_a_try_once_the_upstream_watch_came_back_after_its_last_one() {
        let b = Budget::new();
        b.tried(&unavailable(), 3);
        assert_eq!(b.in_spell(3), Some((Duration::ZERO, false)), "still down");
        assert_eq!(
            b.in_spell(4),
            Some((Duration::ZERO, true)),
            "the upstream watch came back: try again now"
        );
        b.tried(&unavailable(), 4);
        assert_eq!(
            b.in_spell(4),
            Some((Duration::ZERO, false)),
            "that try failed too: wait for the next recovery or refill"
        );
    }
}
