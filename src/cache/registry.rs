//! The set of cached resources: one cache and one reflector per selected resource, kept in
//! step with the apiserver. Until a resource is discovered and synced, its requests pass
//! through.
//!
//! A background task (the "manager") resolves `cache.resources` with [`discovery::plan`]
//! whenever a fact changes: at start (discovery retried with backoff until it succeeds), on
//! every change of the CustomResourceDefinitions (watched by a reflector of their own when
//! custom resources may be cached), and periodically in `all` mode (new built-in or
//! aggregated resources). It then starts caches for new resources and removes those no
//! longer in the plan: a removed resource's reflector is stopped, its downstream watchers
//! are closed cleanly (clients re-watch, and pass through to the apiserver's own answer,
//! e.g. 404 for a deleted CRD), and its cache and metric series go; its requests pass
//! through from then on. A CRD re-created under the same name (a new uid) gets a fresh cache.
//!
//! Pinned resources (ServiceAccounts for the token lookup, the RBAC resources for decision
//! invalidation) are cached from the start for the proxy's own use, whatever the plan says;
//! when the plan selects one of them, the served cache is that same cache (one upstream
//! watch), and it counts for readiness only then.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use dashmap::DashMap;
use http::Request;
use http_body_util::BodyExt;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::discovery::{self, Crd, Discovery, Plan, Selection};
use super::persist::{Persist, PersistError};
use super::{ReflectorSink, Resource, ResourceCache, StoreConfig};
use crate::cache::reflector::proto::ProtoStats;
use crate::cache::reflector::{Reflector, ReflectorConfig, ReflectorHandle, ReflectorStatus};
use crate::http::body;
use crate::upstream::{As, Upstream};

/// In `all` mode, discovery is read again this often to find built-in or aggregated
/// resources added by an apiserver upgrade or a new APIService (custom resources are
/// followed at once through the CRD watch). kubectl's discovery cache lives 6 hours; a few
/// minutes is cheap (one request per group version).
const REDISCOVERY_INTERVAL: Duration = Duration::from_secs(300);

/// Retry bounds of a failed or incomplete discovery (client-go's reflector backoff cap).
const RETRY_INITIAL: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// How often the manager looks whether the CRD list has synced, until it has.
const CRD_SYNC_POLL: Duration = Duration::from_millis(200);

pub struct CacheEntry {
    pub cache: Arc<ResourceCache>,
    pub reflector: ReflectorHandle,
    /// Cancelled when the resource leaves the plan (a child of the process's shutdown).
    stop: CancellationToken,
    /// The CRD's uid for a custom resource, else empty.
    uid: String,
    /// The protobuf side's counters, once its first protobuf reader started it.
    proto_stats: Arc<std::sync::OnceLock<Arc<ProtoStats>>>,
}

impl CacheEntry {
    /// An entry for a cache and reflector built elsewhere (tests); `stop` ends the reflector.
    pub fn new(
        cache: Arc<ResourceCache>,
        reflector: ReflectorHandle,
        stop: CancellationToken,
    ) -> CacheEntry {
        CacheEntry {
            cache,
            reflector,
            stop,
            uid: String::new(),
            proto_stats: Default::default(),
        }
    }

    /// The counters of the resource's protobuf side; `None` until a protobuf reader started
    /// it (and for custom resources, which have none).
    pub fn proto_stats(&self) -> Option<&ProtoStats> {
        self.proto_stats.get().map(|s| &**s)
    }
}

/// Cached resources by (group, version, resource).
#[derive(Default)]
pub struct Caches {
    map: DashMap<(String, String, String), Arc<CacheEntry>>,
    /// Selected names without a cache yet, with the reason (built-in ones keep the proxy unready).
    pub missing: DashMap<String, String>,
    /// Named resources that will not be cached (not listable and watchable), with the reason.
    pub refused: DashMap<String, String>,
    /// Resources the proxy follows for itself (ServiceAccounts for token liveness, RBAC for
    /// decision invalidation), cached whether or not `cache.resources` selects them; when it
    /// does, the served cache is this one (one upstream watch per resource).
    pinned: Vec<Arc<CacheEntry>>,
    /// Warm restart (`cache.stateDir`): states are loaded when caches start and saved by
    /// [`Caches::save_all`].
    persist: Option<Arc<Persist>>,
    /// Every entry started, for [`Caches::save_all`] (the CRD watch's own cache is in no map).
    spawned: parking_lot::Mutex<Vec<std::sync::Weak<CacheEntry>>>,
    /// When [`Caches::start`] ran (`None`: built otherwise, e.g. in tests).
    started: Option<std::time::Instant>,
    /// Woken after every application of a plan ([`Caches::wait_discovered`]).
    planned: tokio::sync::Notify,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("resources", &self.map.len())
            .finish()
    }
}

impl Caches {
    pub fn get(&self, group: &str, version: &str, resource: &str) -> Option<Arc<ResourceCache>> {
        self.map
            .get(&(group.to_string(), version.to_string(), resource.to_string()))
            .map(|e| e.cache.clone())
    }

    /// A resource the proxy follows for itself (see [`Caches::start`]), served or not.
    pub fn pinned(&self, group: &str, version: &str, resource: &str) -> Option<Arc<ResourceCache>> {
        self.pinned
            .iter()
            .find(|e| {
                let r = &e.cache.resource;
                r.group == group && r.version == version && r.resource == resource
            })
            .map(|e| e.cache.clone())
    }

    pub fn entries(&self) -> Vec<Arc<CacheEntry>> {
        let mut v: Vec<_> = self.map.iter().map(|e| e.value().clone()).collect();
        v.sort_by_key(|e| e.cache.resource.label());
        v
    }

    /// Whether the resource `resource` of `group` may still get a cache from the first
    /// discovery, which has not succeeded yet (the proxy started less than
    /// [`crate::cache::store::STARTING`] ago): named in `cache.resources`, or any resource
    /// with `all`. A watch of it then waits for that discovery rather than go to the
    /// apiserver to stay there ([`Caches::wait_discovered`]).
    pub fn discovering(&self, group: &str, resource: &str) -> bool {
        if self
            .started
            .is_none_or(|t| t.elapsed() >= crate::cache::store::STARTING)
        {
            return false;
        }
        let name = if group.is_empty() {
            resource.to_string()
        } else {
            format!("{resource}.{group}")
        };
        let pending = |k: &str, why: &str| {
            self.missing
                .get(k)
                .is_some_and(|v| v.as_str() == why || v.starts_with("waiting for"))
        };
        pending(discovery::ALL, "not discovered yet")
            || pending(&name, "discovery has not succeeded yet")
    }

    /// Waits (bounded) until the first discovery has been applied for `resource` of `group`
    /// (see [`Caches::discovering`]); false on timeout.
    pub async fn wait_discovered(&self, group: &str, resource: &str, bound: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let n = self.planned.notified();
            tokio::pin!(n);
            // Registered before the check: a plan applied between the two still wakes it.
            n.as_mut().enable();
            if !self.discovering(group, resource) {
                return true;
            }
            if tokio::time::timeout_at(deadline, n).await.is_err() {
                return !self.discovering(group, resource);
            }
        }
    }

    /// Registers an already-built cache (tests, or resources known without discovery).
    pub fn insert(&self, entry: CacheEntry) {
        self.insert_arc(Arc::new(entry));
    }

    fn insert_arc(&self, entry: Arc<CacheEntry>) {
        let r = &entry.cache.resource;
        self.map.insert(
            (r.group.clone(), r.version.clone(), r.resource.clone()),
            entry,
        );
    }

    /// Resolves `resources` (names, or `all`) minus `exclude` against the apiserver and
    /// keeps a cache and a reflector for each selected resource, in the background until
    /// `shutdown` fires (see the module docs). `pinned` are followed from the start and for
    /// good, for the proxy's own use ([`Caches::pinned`]); they are served (and count for
    /// readiness) only while the plan selects them.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        resources: Vec<String>,
        exclude: Vec<String>,
        pinned: Vec<Resource>,
        upstream: Upstream,
        store: StoreConfig,
        reflector: ReflectorConfig,
        persist: Option<Persist>,
        shutdown: CancellationToken,
    ) -> Arc<Caches> {
        let mut caches = Caches {
            persist: persist.map(Arc::new),
            started: Some(std::time::Instant::now()),
            ..Caches::default()
        };
        caches.pinned = pinned
            .into_iter()
            .map(|r| caches.spawn_entry(r, String::new(), &upstream, &store, &reflector, &shutdown))
            .collect();
        let caches = Arc::new(caches);
        if let Some(every) = caches
            .persist
            .as_ref()
            .map(|p| p.save_interval)
            .filter(|d| !d.is_zero())
        {
            // Periodic saves until the drain (the final save follows it).
            let (c, stop) = (caches.clone(), shutdown.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(every) => {}
                    }
                    c.save_all(false).await;
                }
            });
        }
        {
            // The histories' bounds kept while a resource is quiet: an event trims its
            // resource's history, a resource without events is trimmed here, about once a
            // second (`ResourceCache::trim_history`).
            let (c, stop) = (Arc::downgrade(&caches), shutdown.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(HISTORY_TRIM);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    let Some(c) = c.upgrade() else { return };
                    c.trim_histories();
                }
            });
        }
        let sel = Selection::new(&resources, &exclude);
        let initial = discovery::plan(&sel, None, None, &HashSet::new());
        for (name, why) in initial.missing {
            caches.missing.insert(name, why);
        }
        if sel.all || !sel.names.is_empty() {
            let m = Manager {
                caches: caches.clone(),
                sel,
                upstream,
                store,
                reflector,
                shutdown,
                crds: None,
                parsed: HashMap::new(),
                ever_custom: HashSet::new(),
            };
            tokio::spawn(m.run());
        }
        caches
    }

    /// Starts a cache and its reflector for `resource`: from its saved state when there is
    /// a usable one (the reflector then resumes with a WATCH), else with a LIST.
    fn spawn_entry(
        &self,
        resource: Resource,
        uid: String,
        upstream: &Upstream,
        store: &StoreConfig,
        reflector: &ReflectorConfig,
        shutdown: &CancellationToken,
    ) -> Arc<CacheEntry> {
        let stop = shutdown.child_token();
        let cache = ResourceCache::new(resource.clone(), store.clone());
        // Settled once the saved state, if any, has been loaded (or found unusable).
        let (settled_tx, mut settled) = tokio::sync::watch::channel(false);
        let from = {
            let (persist, cache, uid) = (self.persist.clone(), cache.clone(), uid.clone());
            async move {
                let from = match persist {
                    Some(p) => tokio::task::spawn_blocking(move || restore(&p, &cache, &uid))
                        .await
                        .ok()
                        .flatten(),
                    None => None,
                };
                let _ = settled_tx.send(true);
                from
            }
        };
        // The protobuf side: a second upstream watch, in protobuf, started with the served
        // resource (`cache.protobufSide: eager`) or when the first protobuf reader of this
        // built-in resource comes (custom resources have none).
        let proto_stats: Arc<std::sync::OnceLock<Arc<ProtoStats>>> = Default::default();
        let mut table_settled = settled.clone();
        if !resource.custom {
            let (c, up, cfg, stop, r, stats) = (
                cache.clone(),
                upstream.clone(),
                reflector.clone(),
                stop.clone(),
                resource.clone(),
                proto_stats.clone(),
            );
            tokio::spawn(async move {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = c.protobuf_wanted() => {}
                }
                // Not before the saved state is loaded: an eager side is wanted as soon as
                // the resource is served, and must resume where that state left it rather
                // than fetch the whole state again. (A closed channel: the reflector
                // stopped first; the side stops too at `stop`.)
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = settled.wait_for(|s| *s) => {}
                }
                // Envelopes written from the JSON objects: no upstream watch of its own
                // until an object cannot be transcoded.
                let mut tick = tokio::time::interval(PROTO_RECONCILE);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                if c.transcodes() {
                    tracing::info!(resource = %r.label(), "protobuf envelopes written from the JSON objects (no protobuf watch of its own)");
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => return,
                            () = c.proto_shed.cancelled() => return,
                            () = c.transcode_off.cancelled() => break,
                            _ = tick.tick() => c.reconcile_protobuf(),
                        }
                    }
                }
                // Resumed where a warm restart's saved state left it, else from the whole
                // state (`ResourceCache::restore_protobuf`).
                let from = c.take_protobuf_resume();
                tracing::info!(resource = %r.label(), resume_from = ?from, "starting the protobuf side (with the resource, for a protobuf reader, or restored)");
                // Stopped at shutdown, or for good when the protobuf bound sheds the resource.
                let side_stop = stop.child_token();
                let side = crate::cache::reflector::proto::ProtoSide::spawn_from(
                    r,
                    up,
                    c.clone() as Arc<dyn crate::cache::reflector::proto::ProtoSink>,
                    cfg,
                    side_stop.clone(),
                    from,
                );
                let _ = stats.set(side.stats().clone());
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = c.proto_shed.cancelled() => break,
                        _ = tick.tick() => c.reconcile_protobuf(),
                    }
                }
                side_stop.cancel();
                let _ = side.join().await;
            });
        }
        // The table side: an upstream watch in Table form, started by the first Table
        // reader of the resource (`cache::table`); its rows are pruned as the JSON side
        // moves on, and it stops at shutdown or when the table bound sheds it.
        {
            let (c, up, cfg, stop, r) = (
                cache.clone(),
                upstream.clone(),
                reflector.clone(),
                stop.clone(),
                resource.clone(),
            );
            tokio::spawn(async move {
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = c.table.wanted() => {}
                }
                // Not before the saved state is loaded: a restored side resumes where it
                // stopped (`TableStore::restore`).
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = table_settled.wait_for(|s| *s) => {}
                }
                let from = c.table.take_resume();
                tracing::info!(resource = %r.label(), resume_from = ?from, "starting the table side (for a Table reader, or restored)");
                let side_stop = stop.child_token();
                let task = crate::cache::reflector::table::spawn(
                    r,
                    up,
                    c.table.clone(),
                    cfg,
                    side_stop.clone(),
                    from,
                );
                let mut tick = tokio::time::interval(PROTO_RECONCILE);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = c.table.shed.cancelled() => break,
                        _ = tick.tick() => {
                            let snap = c.current();
                            c.table.reconcile(snap.rv, |k| {
                                snap.objects.get(k).map(|o| o.meta.resource_version)
                            });
                        }
                    }
                }
                side_stop.cancel();
                let _ = task.await;
            });
        }
        let handle = Reflector::spawn_from(
            resource,
            upstream.clone(),
            cache.clone() as Arc<dyn ReflectorSink>,
            reflector.clone(),
            stop.clone(),
            from,
        );
        let entry = Arc::new(CacheEntry {
            cache,
            reflector: handle,
            stop,
            uid,
            proto_stats,
        });
        let mut spawned = self.spawned.lock();
        spawned.retain(|w| w.strong_count() > 0);
        spawned.push(Arc::downgrade(&entry));
        entry
    }

    /// The caches spawned and still running.
    fn live_entries(&self) -> Vec<Arc<CacheEntry>> {
        self.spawned
            .lock()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect()
    }

    /// Applies every cache's history bounds ([`ResourceCache::trim_history`]).
    pub fn trim_histories(&self) {
        for e in self.live_entries() {
            e.cache.trim_history();
        }
    }

    /// Writes the state of every synced cache to `cache.stateDir`, one blocking task per
    /// resource: at shutdown (`last`), after the reflectors stopped, so each state is final;
    /// otherwise (the periodic save) only the caches that changed since their last save.
    /// Returns the number of states written; failures are logged.
    pub async fn save_all(&self, last: bool) -> usize {
        let Some(p) = self.persist.clone() else {
            return 0;
        };
        let entries = self.live_entries();
        let mut tasks = Vec::new();
        // One bound for all: the reflectors were all told to stop at the same moment.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        for e in entries {
            if !p.may_save(&e.cache.resource) {
                continue;
            }
            if !last && e.cache.rv() == e.cache.saved_rv.load(Relaxed) {
                continue;
            }
            // The reflector's last sink call has returned (it stops at the drain).
            let mut status = e.reflector.status();
            let stopped = status.wait_for(|s| matches!(s, ReflectorStatus::Stopped));
            if last && tokio::time::timeout_at(deadline, stopped).await.is_err() {
                tracing::warn!(resource = %e.cache.resource.label(), "reflector still running; its state is not saved");
                continue;
            }
            let p = p.clone();
            tasks.push(tokio::task::spawn_blocking(move || {
                let started = std::time::Instant::now();
                let r = &e.cache.resource;
                let Some(image) = e.cache.image() else {
                    return false;
                };
                match p.save(r, &e.uid, &image) {
                    Ok(s) => {
                        e.cache.saved_rv.store(image.rv, Relaxed);
                        tracing::info!(resource = %r.label(), rv = image.rv, objects = s.objects, events = s.events, bytes = s.bytes, took = ?started.elapsed(), last, "cache state saved");
                        true
                    }
                    Err(err) => {
                        tracing::warn!(resource = %r.label(), error = %err, "cache state not saved");
                        false
                    }
                }
            }));
        }
        let mut saved = 0;
        for t in tasks {
            saved += usize::from(t.await.unwrap_or(false));
        }
        saved
    }

    /// Makes the caches match `plan`. `keep` are entries never stopped here (the CRD
    /// watch's own cache and the pinned ones, served only while the plan includes them).
    fn apply(
        &self,
        plan: Plan,
        mut start: impl FnMut(&Resource, &str) -> Arc<CacheEntry>,
        keep: &[Arc<CacheEntry>],
    ) {
        let stale: Vec<_> = self
            .map
            .iter()
            .filter(|e| {
                plan.cache
                    .get(e.key())
                    .is_none_or(|(r, uid)| *r != e.cache.resource || *uid != e.uid)
            })
            .map(|e| e.key().clone())
            .collect();
        for key in stale {
            if let Some((_, e)) = self.map.remove(&key) {
                if keep.iter().any(|k| Arc::ptr_eq(k, &e)) {
                    continue;
                }
                tracing::info!(resource = %e.cache.resource.label(), version = %e.cache.resource.version, "no longer cached; its requests pass through");
                e.stop.cancel();
                // Once the reflector has delivered its last call (a relist in flight must not
                // make the cache ready again): readiness Stopped, so requests that still hold
                // it pass through, and every downstream watcher ended cleanly, so clients
                // re-watch and reach the apiserver.
                let mut status = e.reflector.status();
                tokio::spawn(async move {
                    let _ = status
                        .wait_for(|s| matches!(s, ReflectorStatus::Stopped))
                        .await;
                    e.cache.stop();
                });
            }
        }
        for (key, (resource, uid)) in &plan.cache {
            if self.map.contains_key(key) {
                continue;
            }
            tracing::info!(resource = %resource.label(), version = %resource.version, custom = resource.custom, "caching");
            let entry = start(resource, uid);
            // `cache.protobufSide: eager`: the protobuf side starts with the served resource.
            entry.cache.served();
            self.insert_arc(entry);
        }
        // Names leave `missing` only now, so readiness never sees a name in neither place.
        self.missing.retain(|k, _| plan.missing.contains_key(k));
        for (k, v) in plan.missing {
            self.missing.insert(k, v);
        }
        self.refused.retain(|k, _| plan.refused.contains_key(k));
        for (k, v) in plan.refused {
            if !self.refused.contains_key(&k) {
                tracing::warn!(resource = %k, reason = %v, "not caching this resource; its requests pass through");
            }
            self.refused.insert(k, v);
        }
        self.planned.notify_waiters();
    }
}

/// Loads `cache`'s saved state, if there is a usable one: the resourceVersion to resume the
/// upstream watch from. Anything unusable is logged and ignored (the cache lists).
fn restore(p: &Persist, cache: &ResourceCache, uid: &str) -> Option<u64> {
    let r = &cache.resource;
    let started = std::time::Instant::now();
    let image = match p.load(r, uid) {
        Ok(Some(image)) => image,
        Ok(None) => return None,
        Err(e) => {
            let level_warn = !matches!(e, PersistError::Stale { .. });
            if level_warn {
                tracing::warn!(resource = %r.label(), error = %e, "saved cache state ignored; listing");
            } else {
                tracing::info!(resource = %r.label(), error = %e, "saved cache state ignored; listing");
            }
            return None;
        }
    };
    let rv = image.rv;
    match cache.restore(image) {
        Ok(()) => {
            tracing::info!(resource = %r.label(), rv, took = ?started.elapsed(), "warm start from the saved state");
            Some(rv)
        }
        Err(e) => {
            tracing::warn!(resource = %r.label(), error = %e, "saved cache state ignored; listing");
            None
        }
    }
}

/// The background task that keeps the caches in step with the plan.
struct Manager {
    caches: Arc<Caches>,
    sel: Selection,
    upstream: Upstream,
    store: StoreConfig,
    reflector: ReflectorConfig,
    shutdown: CancellationToken,
    /// The CRD watch, when custom resources may be cached.
    crds: Option<Arc<CacheEntry>>,
    /// CRDs parsed, by name: (resourceVersion, facts), so an event re-parses one object.
    parsed: HashMap<String, (u64, Option<Crd>)>,
    ever_custom: HashSet<(String, String)>,
}

impl Manager {
    async fn run(mut self) {
        if self.sel.needs_crds() {
            self.crds = Some(self.caches.spawn_entry(
                discovery::crd_resource(),
                String::new(),
                &self.upstream,
                &self.store,
                &self.reflector,
                &self.shutdown,
            ));
        }
        let mut found: Option<Discovery> = None;
        let mut retry = RETRY_INITIAL;
        let mut next_discovery = tokio::time::Instant::now();
        loop {
            let now = tokio::time::Instant::now();
            let discovered_now = now >= next_discovery;
            if discovered_now {
                let ok = match fetch(&self.upstream, &self.sel).await {
                    Ok(mut d) => {
                        for (g, e) in &d.failed_groups {
                            tracing::warn!(group = %g, error = %e, "discovery of this group failed; its resources pass through, retrying");
                        }
                        // A group that failed this time (an aggregated API briefly down)
                        // keeps what it served before: its caches stay.
                        if let Some(old) = &found {
                            for ((g, r), s) in &old.served {
                                if d.failed_groups.contains_key(g) {
                                    d.served.entry((g.clone(), r.clone())).or_insert(s.clone());
                                }
                            }
                        }
                        found = Some(d);
                        true
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "discovery failed; retrying");
                        false
                    }
                };
                let complete = ok && found.as_ref().is_some_and(|d| d.failed_groups.is_empty());
                next_discovery = now
                    + if !complete {
                        let d = retry;
                        retry = (retry * 2).min(RETRY_MAX);
                        d
                    } else {
                        retry = RETRY_INITIAL;
                        REDISCOVERY_INTERVAL
                    };
            }
            let (crds, crd_rv) = self.crds();
            let plan = discovery::plan(
                &self.sel,
                found.as_ref(),
                crds.as_deref(),
                &self.ever_custom,
            );
            // A named resource not served yet: look again soon (a CRD's resource is seen at
            // once through the CRD watch; this covers built-in and aggregated ones).
            if !self.sel.all && plan.missing.values().any(|m| m.contains("not served")) {
                next_discovery = next_discovery.min(tokio::time::Instant::now() + RETRY_MAX);
            }
            // Said at start and after every discovery while it lasts: a name the apiserver
            // does not serve (a typo such as `deployment.apps`) keeps every replica unready,
            // and the operator must learn why from the log as well as from /readyz?verbose.
            if discovered_now && found.is_some() {
                let retry_in =
                    next_discovery.saturating_duration_since(tokio::time::Instant::now());
                for (name, why) in &plan.missing {
                    if why.starts_with("waiting for") {
                        // The CRD list's reflector logs its own retries.
                        continue;
                    }
                    tracing::warn!(resource = %name, reason = %why, retry_in = ?retry_in, "a resource in cache.resources is not cached; requests for it pass through");
                }
            }
            let keep: Vec<Arc<CacheEntry>> = self
                .crds
                .iter()
                .chain(self.caches.pinned.iter())
                .cloned()
                .collect();
            let (up, store, refl, sd) =
                (&self.upstream, &self.store, &self.reflector, &self.shutdown);
            let caches = &self.caches;
            self.caches.apply(
                plan,
                |r, uid| match keep.iter().find(|e| e.cache.resource == *r) {
                    Some(e) => e.clone(),
                    None => caches.spawn_entry(r.clone(), uid.to_string(), up, store, refl, sd),
                },
                &keep,
            );
            // The columns each CRD declares, for the table sides of their resources.
            for c in crds.iter().flatten() {
                for (version, cols) in &c.printer_columns {
                    if let Some(cache) = self.caches.get(&c.group, version, &c.plural) {
                        cache.table.expect_columns(cols.clone());
                    }
                }
            }
            // Wait for the next discovery, a change of the CRDs, or shutdown.
            let until = next_discovery.saturating_duration_since(tokio::time::Instant::now());
            let crd_cache = self.crds.as_ref().map(|e| e.cache.clone());
            let crd_change = async {
                match (&crd_cache, crds.is_some()) {
                    (Some(c), true) => {
                        c.wait_for_rv(crd_rv + 1, until).await;
                    }
                    // Not synced yet: its readiness has no subscription; look again shortly
                    // (no I/O, the reflector does the retrying).
                    (Some(_), false) => tokio::time::sleep(CRD_SYNC_POLL.min(until)).await,
                    (None, _) => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(until) => {}
                _ = crd_change => {}
            }
        }
    }

    /// The CRDs when their list is synced, and the resourceVersion they are at.
    fn crds(&mut self) -> (Option<Vec<Crd>>, u64) {
        let Some(e) = &self.crds else {
            return (None, 0);
        };
        if !e.cache.is_ready() {
            return (None, 0);
        }
        let snap = e.cache.current();
        let mut parsed = HashMap::with_capacity(snap.objects.len());
        for o in snap.objects.values() {
            let name = o.meta.name.to_string();
            let rv = o.meta.resource_version;
            let facts = match self.parsed.remove(&name) {
                Some((at, facts)) if at == rv => facts,
                _ => Crd::parse(&o.body),
            };
            parsed.insert(name, (rv, facts));
        }
        self.parsed = parsed;
        let crds: Vec<Crd> = self
            .parsed
            .values()
            .filter_map(|(_, c)| c.clone())
            .collect();
        for c in &crds {
            self.ever_custom.insert((c.group.clone(), c.plural.clone()));
        }
        (Some(crds), snap.rv)
    }
}

/// Reads the discovery documents of `groups` (`None`: every group) with the proxy's identity
/// (also `check-config --kubeconfig`). Fails only when the core
/// documents cannot be read; a group that fails is recorded in [`Discovery::failed_groups`].
pub async fn fetch(upstream: &Upstream, sel: &Selection) -> Result<Discovery, DiscoveryError> {
    let groups = sel.groups();
    let groups = groups.as_ref();
    let mut d = Discovery::default();
    if groups.is_none_or(|g| g.contains("")) {
        let core: discovery::ResourceList = get_json(upstream, "/api/v1").await?;
        discovery::add_resources(&mut d, "", "v1", core);
    }
    let mut found: Vec<discovery::ApiGroup> = Vec::new();
    match groups {
        None => {
            let list: discovery::ApiGroupList = get_json(upstream, "/apis").await?;
            found = list.groups;
        }
        Some(groups) => {
            for g in groups.iter().filter(|g| !g.is_empty()) {
                match get_json::<discovery::ApiGroup>(upstream, &format!("/apis/{g}")).await {
                    Ok(group) => found.push(group),
                    Err(DiscoveryError::NotFound) => {
                        d.absent_groups.insert(g.clone());
                    }
                    Err(e) => {
                        d.failed_groups.insert(g.clone(), e.to_string());
                    }
                }
            }
        }
    }
    for g in found {
        for v in g.version_order() {
            let path = format!("/apis/{}/{v}", g.name);
            match get_json::<discovery::ResourceList>(upstream, &path).await {
                Ok(list) => discovery::add_resources(&mut d, &g.name, &v, list),
                Err(e) => {
                    d.failed_groups.insert(g.name.clone(), e.to_string());
                }
            }
            // Named mode: stop at the first version that has every wanted resource of the
            // group (the proxy's RBAC may grant only the preferred version's document).
            let complete = !sel.all
                && sel.names.iter().all(|n| {
                    let (r, grp) = discovery::split_name(n);
                    grp != g.name || d.served.contains_key(&(grp.to_string(), r.to_string()))
                });
            if complete {
                break;
            }
        }
    }
    Ok(d)
}

/// Why a discovery document could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// 404: the group is not served (an absent group, not a failure, when asked by name).
    #[error("not found")]
    NotFound,
    #[error("GET {path} timed out")]
    TimedOut { path: String },
    /// No response (the upstream's error names the address and cause).
    #[error("GET {path}: {source}")]
    Send {
        path: String,
        #[source]
        source: tower::BoxError,
    },
    /// The body broke off.
    #[error(transparent)]
    Body(hyper::Error),
    #[error("GET {path} returned {status}")]
    Status {
        path: String,
        status: http::StatusCode,
    },
    #[error("GET {path}: {source}")]
    Decode {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

async fn get_json<T: for<'de> Deserialize<'de>>(
    upstream: &Upstream,
    path: &str,
) -> Result<T, DiscoveryError> {
    let mut req = Request::new(body::empty());
    *req.uri_mut() = upstream.uri(path);
    req.headers_mut().insert(
        http::header::ACCEPT,
        http::HeaderValue::from_static("application/json"),
    );
    let resp = tokio::time::timeout(
        Duration::from_secs(30),
        upstream.send(req, As::Proxy, false),
    )
    .await
    .map_err(|_| DiscoveryError::TimedOut {
        path: path.to_string(),
    })?
    .map_err(|source| DiscoveryError::Send {
        path: path.to_string(),
        source,
    })?;
    let status = resp.status();
    let b = resp
        .into_body()
        .collect()
        .await
        .map_err(DiscoveryError::Body)?
        .to_bytes();
    if status == http::StatusCode::NOT_FOUND {
        return Err(DiscoveryError::NotFound);
    }
    if !status.is_success() {
        return Err(DiscoveryError::Status {
            path: path.to_string(),
            status,
        });
    }
    serde_json::from_slice(&b).map_err(|source| DiscoveryError::Decode {
        path: path.to_string(),
        source,
    })
}

/// How often a running protobuf side's charge to the protobuf bound is corrected to the
/// exact bytes of its cache's envelopes (`ResourceCache::reconcile_protobuf`); attachments
/// are charged as they come, so the bound holds between corrections too.
const PROTO_RECONCILE: std::time::Duration = std::time::Duration::from_secs(5);

/// How often quiet resources' histories are trimmed ([`Caches::trim_histories`]).
const HISTORY_TRIM: std::time::Duration = std::time::Duration::from_secs(1);

/// The resource's protobuf side (`reflector::proto`) attaches each object version's exact
/// protobuf envelope to the version the JSON side holds.
impl crate::cache::reflector::proto::ProtoSink for ResourceCache {
    fn attach(
        &self,
        _kind: crate::cache::EventKind,
        key: crate::cache::ObjectKey,
        rv: u64,
        envelope: bytes::Bytes,
    ) {
        self.attach_protobuf(&key, rv, envelope);
    }

    fn bookmark(&self, rv: u64, initial_events_end: bool, envelope: bytes::Bytes) {
        if let Some(e) = crate::k8s::protobuf::envelope(&envelope)
            && let Some(rest) = crate::k8s::protobuf_write::bookmark_rest(e.raw)
        {
            *self.proto_bookmark.lock() =
                Some((e.kind.to_string(), bytes::Bytes::copy_from_slice(rest)));
        }
        if initial_events_end {
            self.protobuf_synced(rv);
        }
    }

    fn restarted(&self) {
        // Until the fresh initial state has come, objects may lack their envelope; reads
        // check each object anyway, this only stops protobuf reads from trying.
        self.proto_synced
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watch waits for the first discovery only for a resource it may cache, and only
    /// while that discovery has not been applied within `STARTING` of the start.
    #[tokio::test(start_paused = true)]
    async fn a_watch_waits_for_the_first_discovery_only_where_it_may_bring_a_cache() {
        let named = Caches {
            started: Some(std::time::Instant::now()),
            ..Caches::default()
        };
        named.missing.insert(
            "configmaps".into(),
            "discovery has not succeeded yet".into(),
        );
        named.missing.insert(
            "deployment.apps".into(),
            "deployment.apps is not served by the apiserver".into(),
        );
        assert!(named.discovering("", "configmaps"));
        assert!(!named.discovering("", "pods"), "not selected");
        assert!(
            !named.discovering("apps", "deployment"),
            "discovered: not served"
        );
        let all = Caches {
            started: Some(std::time::Instant::now()),
            ..Caches::default()
        };
        all.missing
            .insert(discovery::ALL.into(), "not discovered yet".into());
        assert!(all.discovering("apps", "deployments"));
        // Built without `start` (tests): never.
        let other = Caches::default();
        other.missing.insert(
            "configmaps".into(),
            "discovery has not succeeded yet".into(),
        );
        assert!(!other.discovering("", "configmaps"));

        // A plan applied wakes the waiter; none within the bound: false.
        assert!(
            !named
                .wait_discovered("", "configmaps", Duration::from_secs(3))
                .await
        );
        let named = Arc::new(named);
        let waiting = tokio::spawn({
            let named = named.clone();
            async move {
                named
                    .wait_discovered("", "configmaps", Duration::from_secs(3))
                    .await
            }
        });
        tokio::task::yield_now().await;
        named.apply(Plan::default(), |_, _| unreachable!(), &[]);
        assert!(waiting.await.unwrap());
        assert!(!named.discovering("", "configmaps"));
    }
}
