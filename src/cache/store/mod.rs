//! One resource's cache: current objects (a persistent ordered map, so a snapshot is an O(1)
//! clone), the event history window, readiness, and the reflector sink that feeds them.
//!
//! Ordering: the reflector calls the sink from one task, in resourceVersion order. Each
//! change is applied under the write lock and queued to the dispatcher task in the same
//! critical section, so the hub sees events in order. A new watcher takes its starting state
//! and subscribes under the read lock; events it may also receive from the dispatcher are
//! dropped by resourceVersion on its side, so it sees no gap and no duplicate.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use tokio::sync::{mpsc, watch};

use super::event::{Delivery, Event};
use super::persist::{Image, ProtoImage};
use super::{CachedObject, EventKind, ObjectKey, ReflectorSink, Resource};
use crate::cache::hub::{CloseReason, Filter, Hub, Subscription};
pub use extend::BackfillRefused;

/// Absorbed relists remembered per resource (for tests and diagnostics).
const ABSORBED_KEPT: usize = 16;

/// History and fan-out limits of one resource's cache.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Events kept for resuming watches, at most.
    pub history_max_events: usize,
    /// Events older than this are dropped even below the count.
    pub history_max_age: Duration,
    /// Past this age the history keeps an event without its encoded watch frames (see
    /// [`ResourceCache::record_locked`]).
    pub history_frames_kept: Duration,
    /// Queued events per watcher before it counts as slow...
    pub watcher_queue: usize,
    /// ...and queued object bytes (one event always fits).
    pub watcher_queue_bytes: usize,
    /// Shared wait for slow watchers per event before they are closed.
    pub dispatch_budget: Duration,
    /// A snapshot served to a paginated list stays available this long after its last use
    /// (KEP-4988 keeps the apiserver's for 75 s).
    pub snapshot_retention: Duration,
    /// Snapshots retained at most; the least recently used go first.
    pub snapshot_max: usize,
    /// A retained snapshot goes this long after it was taken, however often it is used.
    pub snapshot_max_age: Duration,
    /// Object bytes retained snapshots may keep alive (the [`ResourceCache::retained_bytes`]
    /// estimate); beyond it the oldest snapshots go first.
    pub snapshot_max_bytes: usize,
    /// After a relist, keep downstream watches open and send them the difference between
    /// the old and the new state ([`super::relist`]); `false` closes them (they come back,
    /// get 410 Expired and relist themselves).
    pub absorb_relists: bool,
    /// The process-wide bound on protobuf envelopes (`cache.protobufMaxBytes`), shared by
    /// every cache built from this configuration.
    pub proto_budget: Arc<crate::cache::proto_budget::ProtoBudget>,
    /// A built-in resource's protobuf side starts with the resource, once it is served
    /// (`cache.protobufSide: eager`), rather than with its first protobuf reader.
    pub protobuf_eager: bool,
    /// A built-in resource whose kind the proxy's protobuf schema describes gets its
    /// envelopes written from its JSON objects (`k8s::transcode`, `cache.protobufTranscode`)
    /// rather than from a second upstream watch.
    pub protobuf_transcode: bool,
    /// The process-wide bound on the table side's rows (`cache.tableMaxBytes`).
    pub table_budget: Arc<crate::cache::proto_budget::ProtoBudget>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            // kube-apiserver keeps at least 75 s of events (KEP-1904 `eventFreshDuration`);
            // twice that, capped by count so a burst cannot hold unbounded memory.
            history_max_events: 100_000,
            history_max_age: Duration::from_secs(150),
            // Its watchers were served within milliseconds; each holds its own reference.
            history_frames_kept: Duration::from_secs(5),
            watcher_queue: 1024,
            // A slow watcher of 16 KiB objects was closed by kube-apiserver after about
            // 3.5 MB queued for it.
            watcher_queue_bytes: 4 << 20,
            // No wait for full queues (`cache.dispatchBudget`; the cacher's is 100 ms).
            dispatch_budget: Duration::ZERO,
            snapshot_retention: Duration::from_secs(75),
            snapshot_max: 256,
            snapshot_max_age: Duration::from_secs(600),
            snapshot_max_bytes: 512 << 20,
            absorb_relists: true,
            proto_budget: Default::default(),
            protobuf_eager: true,
            // Off here, so a bare cache (the protobuf side's tests) has its side; the
            // configuration's default (`cache.protobufTranscode`) is on.
            protobuf_transcode: false,
            table_budget: Default::default(),
        }
    }
}

/// The cache's objects, in the apiserver's key order.
pub type Objects = imbl::OrdMap<ObjectKey, Arc<CachedObject>>;

/// An immutable state of a resource at a resourceVersion. Cloning is O(1); snapshots share
/// structure with each other and the live map, so each one costs only the tree nodes that
/// changed after it (the replaced objects themselves are also held by the event history).
#[derive(Clone)]
pub struct Snapshot {
    pub rv: u64,
    pub objects: Objects,
    /// The field index at the same state, for resources that have one.
    pub index: Option<FieldIndex>,
}

/// The keys of the objects holding each value of one selectable field (pods'
/// `spec.nodeName`, as the apiserver's pod `IndexFields`), persistent like the objects map,
/// so a snapshot carries it at O(1) and a kubelet's list reads only its node's pods.
#[derive(Clone, Debug)]
pub struct FieldIndex {
    pub field: &'static str,
    pub keys: imbl::OrdMap<Box<str>, imbl::OrdSet<ObjectKey>>,
}

impl FieldIndex {
    /// The index a resource keeps, if any.
    pub fn for_resource(r: &Resource) -> Option<FieldIndex> {
        (r.group.is_empty() && r.resource == "pods").then(|| FieldIndex {
            field: "spec.nodeName",
            keys: imbl::OrdMap::new(),
        })
    }

    /// Moves `key` from the entry of `old`'s value to that of `new`'s.
    pub fn update(
        &mut self,
        key: &ObjectKey,
        old: Option<&CachedObject>,
        new: Option<&CachedObject>,
    ) {
        let ov = old.and_then(|o| o.field(self.field));
        let nv = new.and_then(|o| o.field(self.field));
        if ov == nv {
            return;
        }
        if let Some(v) = ov
            && let Some(set) = self.keys.get_mut(v)
        {
            set.remove(key);
            if set.is_empty() {
                self.keys.remove(v);
            }
        }
        if let Some(v) = nv {
            self.keys.entry(v.into()).or_default().insert(key.clone());
        }
    }

    /// The keys holding `value`, in key order.
    pub fn get(&self, value: &str) -> Option<&imbl::OrdSet<ObjectKey>> {
        self.keys.get(value)
    }
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("rv", &self.rv)
            .field("len", &self.objects.len())
            .finish()
    }
}

struct Retained {
    snap: Snapshot,
    taken: Instant,
    last_used: Instant,
}

impl Retained {
    fn alive(&self, now: Instant, cfg: &StoreConfig) -> bool {
        now.duration_since(self.last_used) < cfg.snapshot_retention
            && now.duration_since(self.taken) < cfg.snapshot_max_age
    }
}

/// Readiness of a resource's cache (k8s.io/apiserver `cacher/ready.go`).
/// How long after its creation (the proxy's start, or a resource discovered later) a cache,
/// or after its first protobuf reader its protobuf side, counts as starting: a watch resuming
/// meanwhile waits for the sync (`read::watch`); later, a cache or side that has still not
/// synced is failing, and reads pass through at once as before.
pub const STARTING: Duration = Duration::from_secs(30);

/// How long a cache restored from saved state keeps the proxy's readiness failing while its
/// resumed upstream watch is not confirmed (`serve::state::cache_checks`).
pub const WARM_CONFIRM: Duration = Duration::from_secs(5);

/// Where the side of a resource's cache that a read needs (the JSON cache, or its protobuf
/// side) stands (`ResourceCache::side`); ordered from best to worst, so the state of two
/// sides together is the larger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Side {
    /// Serves reads.
    Ready,
    /// Initializing, and started less than [`STARTING`] ago: about to serve.
    Starting,
    /// Not serving and not about to (never synced within [`STARTING`], stopped, shed, or
    /// protobuf off): its reads go to the apiserver.
    Failing,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Not synced yet: requests pass through.
    Pending,
    /// Synced; `unhealthy` says whether the upstream watch is currently down.
    Ready,
    Stopped,
}

struct State {
    objects: Objects,
    index: Option<FieldIndex>,
    rv: u64,
    history: VecDeque<Arc<Event>>,
    /// How many of the history's oldest events are past `history_frames_kept` and hold no encoded
    /// frames of their own any more (see [`ResourceCache::record_locked`]).
    unframed: usize,
    /// When retained snapshots past their retention were last let go.
    snapshots_pruned: Instant,
    /// History holds every event with rv > oldest_rv.
    oldest_rv: u64,
    /// Bytes of the bodies of `objects` (the JSON as received).
    bytes: usize,
    /// The resourceVersion of the last relist after the first sync (the history starts
    /// there until it is trimmed).
    relist_rv: Option<u64>,
}

pub struct ResourceCache {
    pub resource: Resource,
    cfg: StoreConfig,
    state: RwLock<State>,
    pub hub: Arc<Hub>,
    dispatch: mpsc::UnboundedSender<Dispatch>,
    rv_tx: watch::Sender<u64>,
    ready_tx: watch::Sender<Readiness>,
    unhealthy: Mutex<Option<String>>,
    /// True once the upstream watch has been healthy at least once (the first sync
    /// confirmed, or a warm start's resumed watch proved itself).
    confirmed_tx: watch::Sender<bool>,
    relists: std::sync::atomic::AtomicU64,
    /// The last relists told to watchers as events: (the state's resourceVersion before,
    /// the new list's), most recent last, at most [`ABSORBED_KEPT`].
    absorbed: Mutex<VecDeque<(u64, u64)>>,
    /// Relists told to open watchers as a difference, and the events of those differences
    /// (read by the metrics collector).
    pub absorbed_total: std::sync::atomic::AtomicU64,
    pub absorbed_events: std::sync::atomic::AtomicU64,
    /// The resourceVersion of the saved state this cache started from (warm restart), 0 for
    /// a cold start (read by the metrics collector).
    pub restored_from: std::sync::atomic::AtomicU64,
    /// The resourceVersion of the last state saved (a periodic save skips an unchanged cache).
    pub saved_rv: std::sync::atomic::AtomicU64,
    /// Snapshots served to paginated lists, by resourceVersion.
    retained: Mutex<VecDeque<Retained>>,
    pub list_stats: ListStats,
    pub watch_stats: WatchStats,
    /// Backfills of this cache's history run one at a time (`reflector::backfill`)...
    pub backfill_lock: tokio::sync::Mutex<()>,
    /// ...and none is tried again at or below a resourceVersion the apiserver refused
    /// with 410 (compaction and the apiserver's window only move forward).
    pub backfill_floor: std::sync::atomic::AtomicU64,
    /// The oldest resourceVersion clients waiting for a backfill asked for (`u64::MAX`:
    /// none).
    pub backfill_wanted: std::sync::atomic::AtomicU64,
    /// How many times the upstream watch came back after being down (`set_unhealthy(None)`
    /// after `Some`): a backfill the apiserver could not serve is tried again after one.
    pub recoveries: std::sync::atomic::AtomicU64,
    /// The protobuf side (`protobuf_side`): object versions it delivered before the JSON
    /// side (by key and resourceVersion), attached when the JSON side applies them.
    proto_pending: Mutex<std::collections::HashMap<(ObjectKey, u64), Bytes>>,
    proto_pending_len: std::sync::atomic::AtomicUsize,
    /// The resourceVersion of the protobuf side's initial state (0: not synced): every
    /// object version the JSON side holds from then on gets its protobuf envelope.
    pub proto_synced: std::sync::atomic::AtomicU64,
    /// A protobuf BOOKMARK object's bytes after its resourceVersion, learnt from the
    /// apiserver's own (`protobuf_write::bookmark_rest`): the kind's empty fields.
    pub proto_bookmark: Mutex<Option<(String, Bytes)>>,
    /// The same for JSON: the bytes after a BOOKMARK object's metadata, learnt from the
    /// upstream watch's bookmarks (`event::json_bookmark_rest`); until one came, the cache's
    /// JSON bookmarks end at their metadata.
    json_bookmark: Mutex<Option<Bytes>>,
    proto_wanted_tx: watch::Sender<bool>,
    /// When the first protobuf reader came (`want_protobuf`); unset: none has.
    proto_wanted_at: std::sync::OnceLock<Instant>,
    /// Where the protobuf side resumes its watch after a warm restart whose saved state
    /// had every envelope (`restore_protobuf`); taken once by the registry.
    proto_resume: Mutex<Option<u64>>,
    /// When this cache was created: a cache still pending after [`STARTING`] is not about
    /// to sync (the proxy may not list it), so reads stop waiting for it.
    created: Instant,
    /// Protobuf watchers: fed by their own dispatcher, which passes each event on once the
    /// envelopes its frames are made from have come (`Event::proto_ready`), in order, so a
    /// protobuf watch waits for the protobuf side once per event, not once per watcher.
    pub proto_hub: Arc<Hub>,
    /// Woken whenever an envelope is attached (the protobuf dispatcher and protobuf watches
    /// starting wait on it).
    proto_attached: Arc<tokio::sync::Notify>,
    /// Protobuf events passed on without their envelope (bound reached): the protobuf
    /// watchers were closed instead (read by the metrics collector).
    pub proto_waits_expired: Arc<std::sync::atomic::AtomicU64>,
    /// Envelope bytes this cache has charged to `cfg.proto_budget`.
    proto_charged: std::sync::atomic::AtomicU64,
    /// An attachment under the write lock took the bound over: shed at the next
    /// [`ResourceCache::reconcile_protobuf`].
    proto_over: std::sync::atomic::AtomicBool,
    /// Cancelled when this resource is shed for the protobuf bound: its protobuf side stops
    /// for good (`crate::cache::proto_budget`).
    pub proto_shed: tokio_util::sync::CancellationToken,
    /// The envelopes are written from the JSON objects (`k8s::transcode`): the kind is in
    /// the schema (its message) and `cfg.protobuf_transcode` is on. Until
    /// [`Self::transcode_off`].
    proto_transcode: Option<crate::k8s::transcode::KindId>,
    /// Cancelled when an object could not be transcoded (a field the schema does not know:
    /// an apiserver newer than the proxy): the protobuf side's own upstream watch takes
    /// over for good.
    pub transcode_off: tokio_util::sync::CancellationToken,
    /// Object versions given an envelope written from their JSON.
    pub transcoded: std::sync::atomic::AtomicU64,
    /// The table side's rows and columns (`crate::cache::table`).
    pub table: Arc<crate::cache::table::TableStore>,
}

/// How long the protobuf dispatcher waits for an event's envelope before it closes the
/// protobuf watchers (they come back from their last resourceVersion and, while the
/// envelopes are missing, are passed to the apiserver). The protobuf side reads the same
/// events from the apiserver as the JSON side, so it is normally milliseconds behind.
pub const PROTO_WAIT: Duration = Duration::from_secs(10);

/// Waits until `ready` holds, re-checked on every notification of `attached`, for at most
/// `bound`; whether it held.
async fn wait_attached(
    attached: &tokio::sync::Notify,
    ready: impl Fn() -> bool,
    bound: Duration,
) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        let n = attached.notified();
        tokio::pin!(n);
        // Registered before the check: an attach between the two still wakes it.
        n.as_mut().enable();
        if ready() {
            return true;
        }
        if tokio::time::timeout_at(deadline, n).await.is_err() {
            return ready();
        }
    }
}

/// Downstream watches refused with 410 Expired, by why their resourceVersion is gone (read
/// by the metrics collector).
#[derive(Debug, Default)]
pub struct WatchStats {
    /// Older than the history window (`cache.historyMaxEvents`, `cache.historyMaxAge`), or
    /// than the cache's first list.
    pub expired_too_old: std::sync::atomic::AtomicU64,
    /// Older than the cache's last relist (its upstream watch expired or broke, so the
    /// history restarted there).
    pub expired_relist: std::sync::atomic::AtomicU64,
}

/// Counters of the lists of one resource (read by the metrics collector).
#[derive(Debug, Default)]
pub struct ListStats {
    /// Lists answered from the cache (every page counts).
    pub from_cache: std::sync::atomic::AtomicU64,
    /// Lists the cache declined (they went to the apiserver).
    pub passed_through: std::sync::atomic::AtomicU64,
    /// Pages after the first, served from a snapshot.
    pub continued: std::sync::atomic::AtomicU64,
    pub token_invalid: std::sync::atomic::AtomicU64,
    pub token_expired: std::sync::atomic::AtomicU64,
    pub snapshot_gone: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for ResourceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResourceCache")
            .field("resource", &self.resource.label())
            .finish()
    }
}

/// What the dispatcher task processes, in order.
enum Dispatch {
    Event(Arc<Event>),
    Progress(u64),
}

/// Where a watch starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// ADDED events for the current state, then changes.
    Initial,
    /// Changes after this resourceVersion.
    After(u64),
}

/// A registered watcher: frames to send first, the resourceVersion they bring it to, and its
/// subscription for what follows.
pub struct Registration {
    pub initial: Vec<(Arc<CachedObject>, Option<Arc<Event>>, Delivery)>,
    pub rv: u64,
    pub sub: Subscription,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WatchError {
    #[error("too old resource version: {requested} ({oldest})")]
    Expired { requested: u64, oldest: u64 },
    #[error("the cache of this resource is not ready")]
    NotReady,
}

/// The one place a watch registration's fault becomes a `Status`. `Expired` is the 410 the
/// apiserver answers past its own window (sent as an ERROR event on a 200 stream); the read
/// path hands `NotReady` to the apiserver instead, so its 503 is only what another caller
/// would show.
impl From<WatchError> for crate::k8s::status::Status {
    fn from(e: WatchError) -> Self {
        use crate::k8s::status::{Reason, Status};
        match e {
            WatchError::Expired { .. } => {
                Status::failure(http::StatusCode::GONE, Reason::Expired, e.to_string())
            }
            WatchError::NotReady => Status::service_unavailable(e.to_string(), 1),
        }
    }
}

impl ResourceCache {
    pub fn new(resource: Resource, cfg: StoreConfig) -> Arc<ResourceCache> {
        let proto_transcode = (cfg.protobuf_transcode && !resource.custom)
            .then(|| {
                crate::k8s::transcode::SCHEMA.kind(
                    &resource.group,
                    &resource.version,
                    &resource.kind,
                )
            })
            .flatten();
        let (dispatch, mut rx) = mpsc::unbounded_channel::<Dispatch>();
        let hub = Hub::with_queue_bytes(
            cfg.watcher_queue,
            cfg.watcher_queue_bytes,
            cfg.dispatch_budget,
        );
        let proto_hub = Hub::with_queue_bytes(
            cfg.watcher_queue,
            cfg.watcher_queue_bytes,
            cfg.dispatch_budget,
        );
        let (proto_dispatch, mut proto_rx) = mpsc::unbounded_channel::<Dispatch>();
        let proto_attached = Arc::new(tokio::sync::Notify::new());
        let proto_waits_expired = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let index = FieldIndex::for_resource(&resource);
        let table = Arc::new(crate::cache::table::TableStore::new(
            resource.custom,
            &resource.group,
            &resource.resource,
            cfg.table_budget.clone(),
        ));
        let cache = Arc::new(ResourceCache {
            resource,
            cfg,
            state: RwLock::new(State {
                objects: imbl::OrdMap::new(),
                index,
                rv: 0,
                history: VecDeque::new(),
                unframed: 0,
                snapshots_pruned: Instant::now(),
                oldest_rv: 0,
                bytes: 0,
                relist_rv: None,
            }),
            hub: hub.clone(),
            dispatch,
            rv_tx: watch::channel(0).0,
            ready_tx: watch::channel(Readiness::Pending).0,
            unhealthy: Mutex::new(Some("not synced yet".into())),
            confirmed_tx: watch::channel(false).0,
            relists: Default::default(),
            absorbed: Default::default(),
            absorbed_total: Default::default(),
            absorbed_events: Default::default(),
            restored_from: Default::default(),
            saved_rv: Default::default(),
            retained: Mutex::new(VecDeque::new()),
            list_stats: ListStats::default(),
            watch_stats: WatchStats::default(),
            backfill_lock: Default::default(),
            backfill_floor: Default::default(),
            backfill_wanted: std::sync::atomic::AtomicU64::new(u64::MAX),
            recoveries: Default::default(),
            proto_pending: Default::default(),
            proto_pending_len: Default::default(),
            proto_synced: Default::default(),
            proto_bookmark: Default::default(),
            json_bookmark: Default::default(),
            proto_wanted_tx: watch::channel(false).0,
            proto_wanted_at: Default::default(),
            proto_resume: Default::default(),
            created: Instant::now(),
            proto_hub: proto_hub.clone(),
            proto_attached: proto_attached.clone(),
            proto_waits_expired: proto_waits_expired.clone(),
            proto_charged: Default::default(),
            proto_over: Default::default(),
            proto_shed: Default::default(),
            proto_transcode,
            transcode_off: Default::default(),
            transcoded: Default::default(),
            table,
        });
        // The dispatcher: one task per resource, events in order; then the protobuf
        // watchers' (only while there are any: the events are dropped otherwise, and the
        // protobuf hub's progress still moves).
        tokio::spawn(async move {
            while let Some(d) = rx.recv().await {
                match d {
                    Dispatch::Event(ev) => {
                        hub.dispatch(ev.clone()).await;
                        let d = if proto_hub.is_empty() {
                            Dispatch::Progress(ev.rv)
                        } else {
                            Dispatch::Event(ev)
                        };
                        let _ = proto_dispatch.send(d);
                    }
                    Dispatch::Progress(rv) => {
                        hub.advance(rv);
                        let _ = proto_dispatch.send(Dispatch::Progress(rv));
                    }
                }
            }
        });
        let proto_hub = cache.proto_hub.clone();
        tokio::spawn(async move {
            while let Some(d) = proto_rx.recv().await {
                match d {
                    Dispatch::Event(ev) => {
                        if !ev.proto_ready()
                            && !wait_attached(&proto_attached, || ev.proto_ready(), PROTO_WAIT)
                                .await
                        {
                            // Its envelope is not coming (the protobuf side restarted past
                            // it, or is down): end the protobuf watches cleanly rather than
                            // skip the event or hold every later one.
                            proto_waits_expired.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            proto_hub.close_all(CloseReason::Relist);
                            proto_hub.advance(ev.rv);
                            continue;
                        }
                        proto_hub.dispatch(ev).await;
                    }
                    Dispatch::Progress(rv) => proto_hub.advance(rv),
                }
            }
        });
        cache
    }

    pub fn readiness(&self) -> Readiness {
        self.ready_tx.borrow().clone()
    }

    pub fn is_ready(&self) -> bool {
        self.readiness() == Readiness::Ready
    }

    /// Whether the cache was restored from saved state (a warm start) and its resumed
    /// upstream watch has not been confirmed yet, less than `within` after its creation:
    /// it holds the state of the proxy's last save, not yet the apiserver's latest.
    pub fn restored_unconfirmed(&self, within: Duration) -> bool {
        self.restored_from
            .load(std::sync::atomic::Ordering::Relaxed)
            != 0
            && self.readiness() == Readiness::Ready
            && !*self.confirmed_tx.borrow()
            && self.created.elapsed() < within
    }

    /// Whether the cache is in its first sync and young enough to be about to finish it
    /// (created less than [`STARTING`] ago): a resuming watch may wait for it.
    pub fn starting(&self) -> bool {
        self.readiness() == Readiness::Pending && self.created.elapsed() < STARTING
    }

    /// Where the sides a read needs stand: the JSON cache and, for `protobuf`, the protobuf
    /// side. `latest`: the read wants the most recent state (a watch without
    /// resourceVersion), which a cache serves only once its upstream watch is confirmed, so
    /// a cache that has synced (or was restored from saved state) but never been confirmed
    /// yet is still starting for it.
    pub fn side(&self, protobuf: bool, latest: bool) -> Side {
        let young = self.created.elapsed() < STARTING;
        let json = match self.readiness() {
            Readiness::Ready if latest && !*self.confirmed_tx.borrow() => {
                if young {
                    Side::Starting
                } else {
                    Side::Ready
                }
            }
            Readiness::Ready => Side::Ready,
            Readiness::Pending if young => Side::Starting,
            _ => Side::Failing,
        };
        if !protobuf {
            return json;
        }
        let proto = if self.protobuf_ready() {
            Side::Ready
        } else if self.protobuf_coming() {
            Side::Starting
        } else {
            Side::Failing
        };
        json.max(proto)
    }

    /// How long the sides a read needs have been starting (for its `Retry-After`).
    pub fn starting_for(&self, protobuf: bool) -> Duration {
        let json = self.created.elapsed();
        match self.proto_wanted_at.get() {
            Some(t) if protobuf && self.is_ready() => t.elapsed(),
            _ => json,
        }
    }

    /// Waits (bounded) until the upstream watch has been confirmed once (see
    /// [`Self::side`]); false on timeout.
    pub async fn wait_confirmed(&self, bound: Duration) -> bool {
        let mut r = self.confirmed_tx.subscribe();
        tokio::time::timeout(bound, r.wait_for(|c| *c))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Waits (bounded) until the cache has synced; false on timeout or once stopped.
    pub async fn wait_ready(&self, bound: Duration) -> bool {
        let mut r = self.ready_tx.subscribe();
        tokio::time::timeout(bound, r.wait_for(|s| *s != Readiness::Pending))
            .await
            .is_ok_and(|r| r.is_ok_and(|s| *s == Readiness::Ready))
    }

    pub fn unhealthy(&self) -> Option<String> {
        self.unhealthy.lock().clone()
    }

    /// Whether the upstream watch is currently down ([`ResourceCache::unhealthy`] without
    /// the reason).
    pub fn is_unhealthy(&self) -> bool {
        self.unhealthy.lock().is_some()
    }

    pub fn stop(&self) {
        // Under the write lock: a watcher registering concurrently either sees Stopped or is
        // subscribed before the hub closes everyone.
        let _s = self.write();
        self.ready_tx.send_replace(Readiness::Stopped);
        self.hub.close_all(CloseReason::Relist);
        self.proto_hub.close_all(CloseReason::Relist);
    }

    /// The cache's current resourceVersion.
    pub fn rv(&self) -> u64 {
        *self.rv_tx.borrow()
    }

    /// Waits (bounded) until the cache has reached `rv`; false on timeout.
    pub async fn wait_for_rv(&self, rv: u64, bound: Duration) -> bool {
        let mut r = self.rv_tx.subscribe();
        tokio::time::timeout(bound, r.wait_for(|cur| *cur >= rv))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    pub fn len(&self) -> usize {
        self.read().objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of the objects' bodies in the current state (the JSON as the apiserver sent
    /// it; parsed metadata, the history and retained snapshots are not counted).
    pub fn object_bytes(&self) -> usize {
        self.read().bytes
    }

    pub fn relists(&self) -> u64 {
        self.relists.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether `rv` lies strictly inside an absorbed relist `(a, b)`. The cache's history
    /// there is a difference, not the real writes: a state at such a resourceVersion never
    /// existed in the cache, and a client holding one (from the difference, or a real one
    /// from the apiserver) cannot be resumed from it exactly, since a deletion told at one
    /// revision may really have happened at another. Such a watch gets 410 Expired (the
    /// client relists), such a snapshot is not served.
    fn inside_absorbed(&self, rv: u64) -> bool {
        self.absorbed.lock().iter().any(|(a, b)| rv > *a && rv < *b)
    }

    /// The last relists whose difference watchers were sent as events: (resourceVersion
    /// before, the new list's). Between the two, a watcher sees the difference, not the
    /// individual writes (as after a relist of its own).
    pub fn absorbed_relists(&self) -> Vec<(u64, u64)> {
        self.absorbed.lock().iter().copied().collect()
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read()
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write()
    }

    /// The bytes after a JSON BOOKMARK object's metadata, once the apiserver's bookmarks
    /// showed them (`ReflectorSink::json_bookmark`).
    pub fn json_bookmark_rest(&self) -> Option<Bytes> {
        self.json_bookmark.lock().clone()
    }

    /// The current state: an O(1) consistent snapshot.
    pub fn current(&self) -> Snapshot {
        let s = self.read();
        Snapshot {
            rv: s.rv,
            objects: s.objects.clone(),
            index: s.index.clone(),
        }
    }

    /// Keeps `snap` available for [`ResourceCache::snapshot_at`] (the later pages of a list
    /// continue from it), refreshing its retention if it is already kept.
    pub fn retain(&self, snap: &Snapshot) {
        let now = Instant::now();
        let mut r = self.retained.lock();
        r.retain(|x| x.alive(now, &self.cfg));
        match r.binary_search_by_key(&snap.rv, |x| x.snap.rv) {
            Ok(i) => r[i].last_used = now,
            Err(i) => {
                r.insert(
                    i,
                    Retained {
                        snap: snap.clone(),
                        taken: now,
                        last_used: now,
                    },
                );
                // Checked when a walk starts, not on every page: the oldest snapshots go while
                // the bytes they alone keep alive are over the bound (the newest stays).
                while r.len() > 1
                    && r.front().is_some_and(|x| {
                        self.bytes_replaced_after(x.snap.rv) > self.cfg.snapshot_max_bytes
                    })
                {
                    r.pop_front();
                }
            }
        }
        while r.len() > self.cfg.snapshot_max {
            // The least recently used goes.
            if let Some((i, _)) = r.iter().enumerate().min_by_key(|(_, x)| x.last_used) {
                r.remove(i);
            }
        }
    }

    /// (snapshots retained, resourceVersion of the oldest).
    pub fn retained_snapshots(&self) -> (usize, Option<u64>) {
        let r = self.retained.lock();
        (r.len(), r.front().map(|x| x.snap.rv))
    }

    /// Bytes of object bodies kept alive by retained snapshots only: the states replaced or
    /// deleted after the oldest snapshot (an estimate from the history; the tree nodes the
    /// snapshots share are not counted).
    pub fn retained_bytes(&self) -> usize {
        let Some(oldest) = self.retained_snapshots().1 else {
            return 0;
        };
        self.bytes_replaced_after(oldest)
    }

    /// Bytes of the object states the history replaced or deleted after `rv`.
    fn bytes_replaced_after(&self, rv: u64) -> usize {
        let s = self.read();
        let from = s.history.partition_point(|e| e.rv <= rv);
        s.history
            .range(from..)
            .filter_map(|e| e.prev.as_ref().map(|p| p.body.len()))
            .sum()
    }

    /// The state exactly at `rv` (as the apiserver's `resourceVersionMatch=Exact`): a
    /// retained snapshot, the current state if nothing changed after `rv`, or the current
    /// state with the history's later events undone. `None` when `rv` is newer than the
    /// cache or older than both the retained snapshots and the history.
    pub fn snapshot_at(&self, rv: u64) -> Option<Snapshot> {
        {
            let now = Instant::now();
            let mut r = self.retained.lock();
            if let Ok(i) = r.binary_search_by_key(&rv, |x| x.snap.rv)
                && r[i].alive(now, &self.cfg)
            {
                r[i].last_used = now;
                return Some(r[i].snap.clone());
            }
        }
        let (mut objects, mut index, undo) = {
            let s = self.read();
            if rv > s.rv || rv < s.oldest_rv || self.inside_absorbed(rv) {
                return None;
            }
            let from = s.history.partition_point(|e| e.rv <= rv);
            let undo: Vec<Arc<Event>> = s.history.range(from..).cloned().collect();
            (s.objects.clone(), s.index.clone(), undo)
        };
        // Undone outside the lock, newest first.
        rewind(&mut objects, index.as_mut(), &undo);
        let snap = Snapshot { rv, objects, index };
        if !undo.is_empty() {
            self.retain(&snap);
        }
        Some(snap)
    }

    pub fn get(&self, namespace: &str, name: &str) -> (Option<Arc<CachedObject>>, u64) {
        let s = self.read();
        (
            s.objects.get(&ObjectKey::new(namespace, name)).cloned(),
            s.rv,
        )
    }

    /// The events after `rv` and the resourceVersion they bring the reader to; `Expired`
    /// when the history no longer reaches back to `rv` (a relist cleared it).
    pub fn changes_since(&self, rv: u64) -> Result<(Vec<Arc<Event>>, u64), WatchError> {
        let s = self.read();
        if rv < s.oldest_rv || self.inside_absorbed(rv) {
            return Err(WatchError::Expired {
                requested: rv,
                oldest: s.oldest_rv + 1,
            });
        }
        let from = s.history.partition_point(|e| e.rv <= rv);
        Ok((s.history.range(from..).cloned().collect(), s.rv))
    }

    /// Registers a watcher (see the module docs for the ordering argument).
    pub fn watch(&self, start: Start, filter: Arc<Filter>) -> Result<Registration, WatchError> {
        self.watch_on(&self.hub, start, filter)
    }

    /// [`Self::watch`] for a protobuf watcher: its events come from the protobuf hub, each
    /// once its envelopes have come. The starting point's objects may still lack theirs
    /// ([`Self::wait_protobuf`]).
    pub fn watch_protobuf(
        &self,
        start: Start,
        filter: Arc<Filter>,
    ) -> Result<Registration, WatchError> {
        self.watch_on(&self.proto_hub, start, filter)
    }

    /// Waits (bounded) until `ready` holds, re-checked whenever a protobuf envelope is
    /// attached; whether it held.
    pub async fn wait_protobuf(&self, ready: impl Fn() -> bool, bound: Duration) -> bool {
        wait_attached(&self.proto_attached, ready, bound).await
    }

    fn watch_on(
        &self,
        hub: &Arc<Hub>,
        start: Start,
        filter: Arc<Filter>,
    ) -> Result<Registration, WatchError> {
        let s = self.read();
        // Under the read lock, so `stop` cannot slip in before the subscription.
        if !self.is_ready() {
            return Err(WatchError::NotReady);
        }
        let (initial, rv) = match start {
            Start::Initial => {
                let indexed = s
                    .index
                    .as_ref()
                    .and_then(|ix| Some((ix, filter.fields.exact_value(ix.field)?)));
                let items = match indexed {
                    // Only the objects holding the selected value (a kubelet's pods).
                    Some((ix, v)) => ix
                        .get(v)
                        .into_iter()
                        .flatten()
                        .filter_map(|k| s.objects.get(k))
                        .filter(|o| filter.matches(o))
                        .map(|o| (o.clone(), None, Delivery::AsIs))
                        .collect(),
                    None => s
                        .objects
                        .values()
                        .filter(|o| filter.matches(o))
                        .map(|o| (o.clone(), None, Delivery::AsIs))
                        .collect(),
                };
                (items, s.rv)
            }
            Start::After(n) if n < s.oldest_rv || self.inside_absorbed(n) => {
                let counter = if s.relist_rv == Some(s.oldest_rv) || n >= s.oldest_rv {
                    &self.watch_stats.expired_relist
                } else {
                    &self.watch_stats.expired_too_old
                };
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Err(WatchError::Expired {
                    requested: n,
                    oldest: s.oldest_rv + 1,
                });
            }
            Start::After(n) => {
                let from = s.history.partition_point(|e| e.rv <= n);
                let items = s
                    .history
                    .range(from..)
                    .filter_map(|e| {
                        // A resumed watch skips what its change filter suppressed before.
                        filter
                            .delivery_of_changes(e, &mut Default::default())
                            .map(|d| (e.object.clone(), Some(e.clone()), d))
                    })
                    .collect();
                (items, n.max(s.rv))
            }
        };
        // Subscribing under the read lock: no change can be applied in between.
        let sub = hub.subscribe(filter);
        drop(s);
        Ok(Registration { initial, rv, sub })
    }

    /// What a warm restart needs to rebuild this cache exactly ([`super::persist`]): the
    /// state at the start of the history, the history's events (with their ages) and the
    /// resourceVersions. The lock is held only to clone (O(1) for the objects); the rewind
    /// runs outside it. `None` while the cache is not synced.
    pub fn image(&self) -> Option<Image> {
        if !self.is_ready() {
            return None;
        }
        let (mut objects, history, rv, oldest_rv, relist_rv) = {
            let s = self.read();
            (
                s.objects.clone(),
                s.history.iter().cloned().collect::<Vec<_>>(),
                s.rv,
                s.oldest_rv,
                s.relist_rv,
            )
        };
        let protobuf = self.protobuf_image(&objects);
        rewind(&mut objects, None, &history);
        let now = Instant::now();
        Some(Image {
            rv,
            oldest_rv,
            relist_rv,
            absorbed: self.absorbed_relists(),
            base: objects.values().cloned().collect(),
            events: history
                .iter()
                .map(|e| {
                    (
                        e.kind,
                        now.saturating_duration_since(e.at),
                        e.object.clone(),
                    )
                })
                .collect(),
            protobuf,
            table: self.table.image(),
        })
    }

    /// Loads a saved [`Image`] into a cache that has not synced: the base state, then the
    /// history replayed over it (so every event has its previous state, as when it was
    /// received), ready at the image's resourceVersion. The cache is marked unconfirmed
    /// until its upstream watch, resumed from that resourceVersion, proves it (reads that
    /// need the latest state go to the apiserver until then). An image that does not hold
    /// together (events out of order, objects newer than their place) is refused whole. A
    /// protobuf side that ran before the save starts again with its envelopes
    /// (`Self::restore_protobuf`).
    pub fn restore(&self, image: Image) -> Result<(), RestoreError> {
        let Image {
            rv,
            oldest_rv,
            relist_rv,
            absorbed,
            base,
            events,
            protobuf,
            table,
        } = image;
        if rv < oldest_rv {
            return Err(RestoreError("resourceVersion before the history's start"));
        }
        // Envelopes only for a protobuf side that starts again: nothing else would charge
        // them to the protobuf bound (a proxy restarted with protobuf off).
        let keep_protobuf =
            (protobuf.started || self.transcodes()) && self.cfg.proto_budget.enabled();
        let strip = |o: Arc<CachedObject>| {
            if keep_protobuf || o.proto.get().is_none() {
                o
            } else {
                Arc::new(o.without_protobuf())
            }
        };
        let mut objects = Objects::new();
        for o in base.into_iter().map(strip) {
            if o.meta.resource_version > oldest_rv {
                return Err(RestoreError("an object newer than the history's start"));
            }
            if objects.insert(o.key(), o).is_some() {
                return Err(RestoreError("an object twice"));
            }
        }
        let now = Instant::now();
        let mut history = VecDeque::with_capacity(events.len());
        let mut last = oldest_rv;
        for (kind, age, object) in events {
            let object = strip(object);
            let at = object.meta.resource_version;
            if at <= last || at > rv {
                return Err(RestoreError("history out of order"));
            }
            last = at;
            let key = object.key();
            let prev = match kind {
                // As when it was received (`apply_locked`).
                EventKind::Deleted => objects.remove(&key),
                _ => objects.insert(key, object.clone()),
            };
            let mut ev = Event::new(kind, object, prev);
            ev.at = now.checked_sub(age).unwrap_or(ev.at);
            history.push_back(Arc::new(ev));
        }
        // Envelopes the saved state did not have are written from the objects.
        let charged = self.transcode_all(
            objects
                .values()
                .map(|o| &**o)
                .chain(history.iter().map(|e| &*e.object)),
        );
        let mut s = self.write();
        if self.readiness() != Readiness::Pending {
            return Err(RestoreError("the cache has synced already"));
        }
        s.bytes = objects.values().map(|o| o.body.len()).sum();
        s.index = FieldIndex::for_resource(&self.resource).map(|mut ix| {
            for (k, o) in objects.iter() {
                ix.update(k, None, Some(o));
            }
            ix
        });
        s.objects = objects;
        s.rv = rv;
        s.oldest_rv = oldest_rv;
        s.relist_rv = relist_rv;
        s.history = history;
        s.unframed = 0;
        {
            let mut w = self.absorbed.lock();
            w.clear();
            w.extend(absorbed.into_iter().rev().take(ABSORBED_KEPT).rev());
        }
        self.restored_from
            .store(rv, std::sync::atomic::Ordering::Relaxed);
        *self.unhealthy.lock() = Some(format!(
            "restored at resourceVersion {rv}; upstream watch not confirmed yet"
        ));
        let _ = self.dispatch.send(Dispatch::Progress(rv));
        drop(s);
        self.finish_transcoding(charged, rv);
        self.restore_protobuf(rv, protobuf);
        if let Some(t) = table {
            let rows = t.rows.len();
            match self.table.restore(t) {
                Ok(()) => {
                    tracing::info!(resource = %self.resource.label(), rows, "table side restored from the saved state");
                }
                // The side starts afresh with its first Table reader.
                Err(e) => {
                    tracing::warn!(resource = %self.resource.label(), error = e, "the saved table side is not used");
                }
            }
        }
        self.rv_tx.send_replace(rv);
        self.ready_tx.send_replace(Readiness::Ready);
        tracing::info!(resource = %self.resource.label(), rv, objects = self.len(), history = self.read().history.len(), "cache restored from its saved state");
        Ok(())
    }

    /// The resourceVersion the history starts after: a watch from it or later is served
    /// from the history, an older one needs [`ResourceCache::extend_history`] first.
    pub fn oldest_rv(&self) -> u64 {
        self.read().oldest_rv
    }

    /// The history's start: its resourceVersion, the state there (the current state with
    /// the history undone) and whether any change follows it.
    pub fn history_start(&self) -> (u64, Objects, bool) {
        let (mut objects, undo, oldest) = {
            let s = self.read();
            let undo: Vec<Arc<Event>> = s.history.iter().cloned().collect();
            (s.objects.clone(), undo, s.oldest_rv)
        };
        let later = !undo.is_empty();
        rewind(&mut objects, None, &undo);
        (oldest, objects, later)
    }

    /// How many events the history can still take before its count bound.
    pub fn history_room(&self) -> usize {
        self.cfg
            .history_max_events
            .saturating_sub(self.read().history.len())
    }

    /// Whether relists (and backfills the apiserver's watch cannot serve) are told to
    /// watchers as a difference (`cache.absorbRelists`).
    pub fn absorbs_relists(&self) -> bool {
        self.cfg.absorb_relists
    }

    /// The history's bounds applied at `now`: events past `cache.historyMaxEvents` or
    /// `cache.historyMaxAge` leave it (the newest `keep` are kept whatever their age), and
    /// events past `cache.historyFramesKept` drop their frames.
    fn trim_locked(&self, s: &mut State, now: Instant, keep: usize) {
        while let Some(front) = s.history.front() {
            let too_many = s.history.len() > self.cfg.history_max_events;
            let too_old = now.duration_since(front.at) > self.cfg.history_max_age;
            if !(too_many || too_old) || s.history.len() <= keep {
                break;
            }
            s.oldest_rv = front.rv;
            s.history.pop_front();
            s.unframed = s.unframed.saturating_sub(1);
        }
        // Every watcher an event was dispatched to holds that event (and the frames encoded
        // for it) in its own queue; the history's copy only serves watches that start or
        // resume later. Past `history_frames_kept` the history keeps the event without its
        // frames (kilobytes per event: the object's JSON and protobuf frames, copies of its body),
        // freed once the queues let go of theirs; a late reader encodes them again. The
        // newest event (in a record, the one not dispatched yet) is never looked at.
        while s.unframed + 1 < s.history.len() {
            let e = &s.history[s.unframed];
            if now.duration_since(e.at) <= self.cfg.history_frames_kept {
                break;
            }
            if e.has_frames() {
                let bare = Arc::new(e.without_frames());
                s.history[s.unframed] = bare;
            }
            s.unframed += 1;
        }
    }

    /// [`ResourceCache::trim_locked`] without a new event: a resource that went quiet after
    /// a burst would otherwise hold the burst's events (and their frames) until its next
    /// event. Called about once a second by the registry; takes the write lock only when
    /// something is due. The newest event stays (as after any record).
    pub fn trim_history(&self) {
        self.trim_history_at(Instant::now());
    }

    fn trim_history_at(&self, now: Instant) {
        let due = {
            let s = self.read();
            let old = |e: &Arc<Event>, bound: Duration| now.duration_since(e.at) > bound;
            s.history.len() > 1
                && (s
                    .history
                    .front()
                    .is_some_and(|e| old(e, self.cfg.history_max_age))
                    || (s.unframed + 1 < s.history.len()
                        && old(&s.history[s.unframed], self.cfg.history_frames_kept)))
        };
        if due {
            let mut s = self.write();
            self.trim_locked(&mut s, now, 1);
        }
    }

    fn record_locked(&self, s: &mut State, ev: Arc<Event>) {
        s.rv = ev.rv;
        s.history.push_back(ev.clone());
        let now = Instant::now();
        self.trim_locked(s, now, 0);
        // A snapshot past its retention pins the object states it holds until it is let
        // go: at most once a second, without waiting (`retain` takes the locks the other way
        // round).
        if now.duration_since(s.snapshots_pruned) >= Duration::from_secs(1)
            && let Some(mut r) = self.retained.try_lock()
        {
            s.snapshots_pruned = now;
            r.retain(|x| x.alive(now, &self.cfg));
        }
        // Queued in the critical section so the dispatcher sees events in order.
        let _ = self.dispatch.send(Dispatch::Event(ev));
    }
}

/// Undoes `events` (oldest first in the slice) on `objects` and `index`, newest first: the
/// state before the first of them.
fn rewind(objects: &mut Objects, mut index: Option<&mut FieldIndex>, events: &[Arc<Event>]) {
    for e in events.iter().rev() {
        let key = e.object.key();
        let undone = match &e.prev {
            Some(p) => objects.insert(key.clone(), p.clone()),
            None => objects.remove(&key),
        };
        if let Some(ix) = index.as_deref_mut() {
            ix.update(&key, undone.as_deref(), e.prev.as_deref());
        }
    }
}

/// Waiting protobuf envelopes kept at most per resource (the protobuf stream ahead of
/// the JSON one); beyond, the oldest versions are dropped and those objects are passed
/// through to the apiserver for protobuf readers.
const PROTO_PENDING_MAX: usize = 65_536;

/// Where [`ResourceCache::attach_protobuf`] put an envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attached {
    /// On the object version the JSON side holds.
    Now,
    /// Waiting for the JSON side to reach that version.
    Later,
    /// The JSON side passed that version without keeping it.
    Dropped,
}

/// Why a saved image was not loaded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("saved state refused: {0}")]
pub struct RestoreError(&'static str);

impl ResourceCache {
    /// Applies one change under the write lock; `false` when it was already reflected.
    fn apply_locked(&self, s: &mut State, kind: EventKind, object: Arc<CachedObject>) -> bool {
        if object.meta.resource_version <= s.rv {
            // Already reflected (e.g. replayed after a re-watch): keep history strictly
            // increasing.
            return false;
        }
        self.take_pending_protobuf(&object);
        let key = object.key();
        let prev = match kind {
            EventKind::Deleted => s.objects.remove(&key),
            _ => s.objects.insert(key.clone(), object.clone()),
        };
        if kind != EventKind::Deleted {
            s.bytes += object.body.len();
        }
        if let Some(p) = &prev {
            s.bytes = s.bytes.saturating_sub(p.body.len());
        }
        if let Some(ix) = s.index.as_mut() {
            let now = (kind != EventKind::Deleted).then_some(&*object);
            ix.update(&key, prev.as_deref(), now);
        }
        let ev = Arc::new(Event::new(kind, object, prev));
        self.record_locked(s, ev);
        true
    }
}

impl ReflectorSink for ResourceCache {
    fn replace(&self, items: Vec<CachedObject>, rv: u64) {
        let first = !self.is_ready();
        // Outside the lock: writing envelopes is the costly part.
        let charged = self.transcode_all(items.iter());
        self.finish_transcoding(charged, rv);
        {
            let mut s = self.write();
            let new: Objects = items.into_iter().map(|o| (o.key(), Arc::new(o))).collect();
            // Protobuf envelopes of versions the relist did not change stay with them; the
            // others come from the protobuf side (waiting, or later).
            for (k, o) in new.iter() {
                match s.objects.get(k).and_then(|old| {
                    (old.meta.resource_version == o.meta.resource_version)
                        .then(|| old.proto.get().cloned())
                        .flatten()
                }) {
                    Some(b) => {
                        o.proto.set(b);
                    }
                    None => self.take_pending_protobuf(o),
                }
            }
            self.prune_pending_protobuf(rv);
            if !first {
                self.relists
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let changes = self
                    .cfg
                    .absorb_relists
                    .then(|| super::relist::difference(&s.objects, s.rv, &new, rv))
                    .flatten();
                if let Some(changes) = changes {
                    // Watchers stay open and learn the new state as events, then a bookmark
                    // at the list's resourceVersion; the history goes on, so a watch resumed
                    // from before the relist gets the same events.
                    let n = changes.len();
                    {
                        let mut w = self.absorbed.lock();
                        if w.len() == ABSORBED_KEPT {
                            w.pop_front();
                        }
                        w.push_back((s.rv, rv));
                    }
                    use std::sync::atomic::Ordering::Relaxed;
                    self.absorbed_total.fetch_add(1, Relaxed);
                    self.absorbed_events.fetch_add(n as u64, Relaxed);
                    for (kind, object, _) in changes {
                        self.apply_locked(&mut s, kind, object);
                    }
                    s.rv = rv;
                    let _ = self.dispatch.send(Dispatch::Progress(rv));
                    drop(s);
                    self.rv_tx.send_replace(rv);
                    tracing::info!(resource = %self.resource.label(), rv, objects = self.len(), events = n, "cache relisted; watchers were sent the difference");
                    return;
                }
                // The history was broken and no difference leads across (or absorbing is
                // off): watchers end cleanly and come back with their last
                // resourceVersion, which now gets 410 Expired, so they relist from this
                // fresh state — no replayed or skipped events. They are closed before the
                // new resourceVersion can reach the dispatcher: a bookmark must never carry
                // an old watcher across the gap.
                self.hub.close_all(CloseReason::Relist);
                self.proto_hub.close_all(CloseReason::Relist);
            }
            s.bytes = new.values().map(|o| o.body.len()).sum();
            s.relist_rv = (!first).then_some(rv);
            s.objects = new;
            s.index = FieldIndex::for_resource(&self.resource).map(|mut ix| {
                for (k, o) in s.objects.iter() {
                    ix.update(k, None, Some(o));
                }
                ix
            });
            s.rv = rv;
            s.history.clear();
            s.unframed = 0;
            s.oldest_rv = rv;
            let _ = self.dispatch.send(Dispatch::Progress(rv));
        }
        self.rv_tx.send_replace(rv);
        self.ready_tx.send_replace(Readiness::Ready);
        tracing::info!(resource = %self.resource.label(), rv, objects = self.len(), relist = !first, "cache synced");
    }

    fn apply(&self, kind: EventKind, object: CachedObject) {
        let charged = self.transcode_all(std::iter::once(&object));
        let object = Arc::new(object);
        let rv = object.meta.resource_version;
        if self.apply_locked(&mut self.write(), kind, object) {
            self.rv_tx.send_replace(rv);
        }
        self.finish_transcoding(charged, 0);
    }

    fn json_bookmark(&self, rest: Bytes) {
        let mut b = self.json_bookmark.lock();
        if b.as_ref() != Some(&rest) {
            *b = Some(rest);
        }
    }

    fn bookmark(&self, rv: u64) {
        let mut s = self.write();
        if rv > s.rv {
            s.rv = rv;
            let _ = self.dispatch.send(Dispatch::Progress(rv));
            drop(s);
            self.rv_tx.send_replace(rv);
        }
    }

    fn set_unhealthy(&self, reason: Option<String>) {
        let healthy = reason.is_none();
        let was_down = std::mem::replace(&mut *self.unhealthy.lock(), reason).is_some();
        if healthy && was_down {
            self.recoveries
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if healthy && self.is_ready() {
            self.confirmed_tx
                .send_if_modified(|c| !std::mem::replace(c, true));
        }
    }
}

mod extend;
mod proto;

#[cfg(test)]
mod tests;
