//! Watch fan-out: every event of a resource goes to every interested watcher as a shared
//! `Arc<Event>` (frames are encoded once, in [`crate::cache::event`]).
//!
//! Each watcher has a bounded queue. Delivery tries a non-blocking send to everyone first;
//! watchers whose queues are full then share a bounded wait (the dispatch budget); any still
//! full after it are closed and counted, like k8s.io/apiserver's `cacheWatcher` with its
//! `dispatchTimeoutBudget`. A closed watcher's stream ends cleanly, so its client re-watches
//! from the last resourceVersion it saw. The budget is one for all events, as the cacher's
//! `timeBudget`: what a dispatch waits is taken from it and it refills at half of it per
//! second (`TimeBudget`), so a client that frees one slot just before each deadline cannot
//! make every event wait a whole budget. One slow client therefore costs the others about
//! one budget, once. The proxy's default budget is zero (`cache.dispatchBudget`): its
//! queues hold over a thousand events, and any wait is paid by every other watcher.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;

use crate::cache::CachedObject;
use crate::cache::event::{Delivery, Event};
use crate::k8s::selector::{FieldSelector, LabelSelector};
use crate::k8s::watch_fields::{ChangeSet, Decisions, Slot, WatchFields};

/// What a watcher wants to see.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this namespace; `None` for all.
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    /// Only these namespaces (a tenant's filtered cluster view); `None` for all.
    pub namespaces: Option<Arc<std::collections::BTreeSet<String>>>,
    /// The opt-in field-level change filter (`k8s::watch_fields`): a MODIFIED event that
    /// changes none of its fields is not delivered. Selection is unaffected.
    pub changes: Option<Arc<WatchFields>>,
}

/// The change decisions of one event, shared by every watcher with the same change filter:
/// the event's changed paths are computed once (the two objects parsed and compared once,
/// only when a watcher has a change filter). The hub's watchers hold their filter's slot in
/// the resource's registry (`watch_fields::Slot`): at the first decision the event needs,
/// one walk of the changed paths with the trie of every select filter's paths marks the
/// changed ones, whatever their number; an ignore filter is decided once per event against
/// the changed paths, at a cost bounded by its size. Decisions are kept by slot in an array
/// reused from event to event (`watch_fields::Decisions`), so a watcher's lookup is an array
/// read, with one distinct filter or thousands. A filter without a slot (outside the hub) is
/// decided on each call.
#[derive(Default)]
pub struct ChangeMemo {
    decisions: Decisions,
    /// The changed paths (`None`: an object is unreadable, delivered).
    set: Option<Option<ChangeSet>>,
    /// Decisions computed without a slot, and the time spent on the filter work (parsing,
    /// changed paths, decisions), for the metrics.
    unslotted: u64,
    nanos: u64,
}

impl ChangeMemo {
    /// Starts the next event (the buffers are kept).
    fn begin(&mut self) {
        self.set = None;
        self.decisions.begin();
        self.unslotted = 0;
        self.nanos = 0;
    }

    fn changed(&mut self, f: &WatchFields, slot: Option<&Slot>, e: &Event) -> bool {
        // Decided already (or undecidable): no clock, no hashing.
        if let Some(s) = slot
            && let Some(c) = self.decisions.lookup(s)
        {
            return c;
        }
        if let Some(None) = self.set {
            return true;
        }
        let start = std::time::Instant::now();
        let set = self.set.get_or_insert_with(|| {
            let prev = e.prev.as_deref()?;
            ChangeSet::from_json(&prev.body, &e.object.body)
        });
        let c = match (set, slot) {
            (None, _) => true,
            (Some(set), Some(s)) => self.decisions.decide(s, set),
            (Some(set), None) => {
                self.unslotted += 1;
                f.changed_in(set)
            }
        };
        self.nanos += start.elapsed().as_nanos() as u64;
        c
    }

    /// Decisions computed so far in this event: walks of the select filters' trie (one per
    /// event), ignore-form filters decided (one per distinct filter) and filters decided
    /// without a slot.
    pub fn evaluations(&self) -> u64 {
        self.decisions.evaluations() + self.unslotted
    }
}

impl Filter {
    pub fn matches(&self, o: &CachedObject) -> bool {
        if let Some(ns) = &self.namespace
            && &*o.meta.namespace != ns.as_str()
        {
            return false;
        }
        if let Some(set) = &self.namespaces
            && !set.contains(&*o.meta.namespace)
        {
            return false;
        }
        self.labels.matches(|k| o.label(k)) && self.fields.matches(|f| o.field(f))
    }

    /// [`Filter::delivery`], then the change filter: a MODIFIED event delivered as it
    /// happened is dropped when it changes none of the selected fields (`memo` shares the
    /// decision between watchers with the same filter).
    pub fn delivery_of_changes(&self, e: &Event, memo: &mut ChangeMemo) -> Option<Delivery> {
        let d = self.delivery(e)?;
        self.passes_changes(e, d, None, memo).then_some(d)
    }

    /// Whether delivery `d` of `e` passes the change filter (always, without one); `slot`:
    /// the filter's slot in the hub's registry, if it holds one.
    fn passes_changes(
        &self,
        e: &Event,
        d: Delivery,
        slot: Option<&Slot>,
        memo: &mut ChangeMemo,
    ) -> bool {
        match &self.changes {
            Some(f) if e.kind == crate::cache::EventKind::Modified && d == Delivery::AsIs => {
                memo.changed(f, slot, e)
            }
            _ => true,
        }
    }

    /// How an event is seen through this filter's selection, if at all (cacher
    /// `convertToWatchEvent`).
    pub fn delivery(&self, e: &Event) -> Option<Delivery> {
        use crate::cache::EventKind::*;
        let cur = e.kind != Deleted && self.matches(&e.object);
        let old = match e.kind {
            // A delete carries the last state; selection is decided on it.
            Deleted => {
                e.prev.as_deref().map(|p| self.matches(p)).unwrap_or(false)
                    || self.matches(&e.object)
            }
            _ => e.prev.as_deref().is_some_and(|p| self.matches(p)),
        };
        match (cur, old) {
            (false, false) => None,
            (true, false) => Some(if e.kind == Modified {
                Delivery::Entered
            } else {
                Delivery::AsIs
            }),
            (true, true) => Some(Delivery::AsIs),
            (false, true) => Some(if e.kind == Deleted {
                Delivery::AsIs
            } else {
                Delivery::Left
            }),
        }
    }
}

/// The field whose single-value watchers the hub indexes (pods' `spec.nodeName`; other
/// resources' objects have no such field, so their events never look it up).
const INDEXED_FIELD: &str = "spec.nodeName";
/// Index bucket names cannot be namespaces (which have no `=`).
const INDEX_PREFIX: &str = "spec.nodeName=";

fn index_bucket(value: &str) -> String {
    format!("{INDEX_PREFIX}{value}")
}

/// An item in a watcher's queue.
pub type Item = (Arc<Event>, Delivery);

struct Entry {
    tx: Sender,
    filter: Arc<Filter>,
    /// The filter selects every object of its bucket (no selectors, no namespace set; its
    /// namespace, if any, is the bucket's): its delivery is the same for every such watcher
    /// and is computed once per event, without reading the filter.
    all: bool,
    /// The change filter's slot in `Hub::change_filters` (held as long as the entry).
    change: Option<Slot>,
}

/// A watcher's bounded queue. In place of `tokio::sync::mpsc`, whose channel costs about a
/// kilobyte per watcher before any event (cache-line padded halves and a first block of 32
/// slots allocated up front): this one is a small mutex-guarded `VecDeque` that allocates on
/// the first event and holds what is queued. The dispatcher is its only writer, the watch's
/// writer its only reader, so the lock is rarely contended. The reader's waker is kept under
/// the same lock: a push, and a receive that finds nothing, each take the lock once and touch
/// one cache line, where a separate `AtomicWaker` cost a receive three locked operations
/// more and a push a second line.
struct Queue {
    state: parking_lot::Mutex<QueueState>,
    cap: usize,
    /// Object bytes queued at most (one item always fits).
    cap_bytes: usize,
    /// Senders waiting for room (the dispatcher's bounded wait), woken when the reader takes
    /// an item while one waits, and when the reader goes.
    space: tokio::sync::Notify,
}

/// A watcher's queued items: the oldest held inline, the rest in a `VecDeque`. Most
/// watchers hold at most one item at a time (an event, taken before the next), so the
/// dispatcher's push and the reader's receive touch only the queue's own memory, not a
/// second allocation each (at 10,000 watchers that was a cache miss on each side of every
/// delivery).
#[derive(Default)]
struct Items {
    /// `None` only when `rest` is empty too.
    first: Option<Item>,
    rest: std::collections::VecDeque<Item>,
}

impl Items {
    fn len(&self) -> usize {
        usize::from(self.first.is_some()) + self.rest.len()
    }

    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    fn push_back(&mut self, item: Item) {
        if self.first.is_none() {
            self.first = Some(item);
        } else {
            self.rest.push_back(item);
        }
    }

    fn pop_front(&mut self) -> Option<Item> {
        let first = self.first.take()?;
        self.first = self.rest.pop_front();
        Some(first)
    }

    /// An idle watcher does not keep the room a burst needed.
    fn shrink_when_empty(&mut self) {
        if self.rest.is_empty() && self.rest.capacity() > 64 {
            self.rest.shrink_to(8);
        }
    }
}

#[derive(Default)]
struct QueueState {
    items: Items,
    /// Object bytes of the queued items ([`item_bytes`]).
    bytes: usize,
    senders: usize,
    /// The reader's task while it waits for an item, woken (and taken) by the next push and
    /// by the last sender's drop.
    rx_waker: Option<std::task::Waker>,
    rx_gone: bool,
    sender_waiting: bool,
}

impl Queue {
    fn lock(&self) -> parking_lot::MutexGuard<'_, QueueState> {
        self.state.lock()
    }
}

fn queue(cap: usize, cap_bytes: usize) -> (Sender, Receiver) {
    let q = Arc::new(Queue {
        state: parking_lot::Mutex::new(QueueState {
            senders: 1,
            ..QueueState::default()
        }),
        cap: cap.max(1),
        cap_bytes,
        space: tokio::sync::Notify::new(),
    });
    (Sender(q.clone()), Receiver(q))
}

/// What a queued item counts for the byte bound: the object's JSON (the frame written for it
/// is about that size; the object itself is shared by every watcher).
fn item_bytes((ev, _): &Item) -> usize {
    ev.object.body.len()
}

/// Why a non-blocking send did not queue the item.
enum TrySendError {
    Full(Item),
    Closed,
}

/// The hub's end of a watcher's queue; the queue closes when the last one is dropped.
struct Sender(Arc<Queue>);

impl Clone for Sender {
    fn clone(&self) -> Self {
        self.0.lock().senders += 1;
        Sender(self.0.clone())
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let waiting = {
            let mut st = self.0.lock();
            st.senders -= 1;
            if st.senders == 0 {
                st.rx_waker.take()
            } else {
                None
            }
        };
        if let Some(w) = waiting {
            w.wake();
        }
    }
}

impl Sender {
    fn try_send(&self, item: Item) -> Result<(), TrySendError> {
        self.push(item, false)
    }

    fn push(&self, item: Item, wait: bool) -> Result<(), TrySendError> {
        let waiting = {
            let mut st = self.0.lock();
            if st.rx_gone {
                return Err(TrySendError::Closed);
            }
            let size = item_bytes(&item);
            let over_bytes = !st.items.is_empty() && st.bytes + size > self.0.cap_bytes;
            if st.items.len() >= self.0.cap || over_bytes {
                st.sender_waiting |= wait;
                return Err(TrySendError::Full(item));
            }
            st.bytes += size;
            st.items.push_back(item);
            st.rx_waker.take()
        };
        if let Some(w) = waiting {
            w.wake();
        }
        Ok(())
    }

    /// Waits for room (cancel-safe: dropping the future drops the item); `Err` when the
    /// reader is gone.
    async fn send(&self, mut item: Item) -> Result<(), ()> {
        loop {
            let room = self.0.space.notified();
            tokio::pin!(room);
            // Registered before looking, so a reader taking an item right after cannot be
            // missed.
            room.as_mut().enable();
            match self.push(item, true) {
                Ok(()) => return Ok(()),
                Err(TrySendError::Closed) => return Err(()),
                Err(TrySendError::Full(i)) => item = i,
            }
            room.await;
        }
    }
}

/// Why [`Receiver::try_recv`] returned nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TryRecvError {
    /// Nothing queued now.
    Empty,
    /// Nothing queued, and the hub closed this watcher (or is gone).
    Disconnected,
}

/// A watcher's end of its queue.
pub struct Receiver(Arc<Queue>);

impl Receiver {
    pub fn try_recv(&mut self) -> Result<Item, TryRecvError> {
        self.recv_or_register(None)
    }

    /// Takes the next item; when there is none, registers `waker` (if given) under the same
    /// lock, so a push cannot fall between the look and the registration.
    fn recv_or_register(&mut self, waker: Option<&std::task::Waker>) -> Result<Item, TryRecvError> {
        let (item, wake_sender) = {
            let mut st = self.0.lock();
            match st.items.pop_front() {
                Some(i) => {
                    st.bytes -= item_bytes(&i);
                    st.items.shrink_when_empty();
                    (i, std::mem::take(&mut st.sender_waiting))
                }
                None if st.senders == 0 => return Err(TryRecvError::Disconnected),
                None => {
                    if let Some(w) = waker {
                        match &mut st.rx_waker {
                            Some(old) if old.will_wake(w) => {}
                            slot => *slot = Some(w.clone()),
                        }
                    }
                    return Err(TryRecvError::Empty);
                }
            }
        };
        if wake_sender {
            self.0.space.notify_waiters();
        }
        Ok(item)
    }

    /// The next item; `None` once the queue is empty and the hub has closed it. Takes part
    /// in tokio's cooperative budget like a tokio channel.
    pub fn poll_recv(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Option<Item>> {
        use std::task::Poll;
        let coop = std::task::ready!(tokio::task::coop::poll_proceed(cx));
        let r = match self.recv_or_register(Some(cx.waker())) {
            Ok(i) => Poll::Ready(Some(i)),
            Err(TryRecvError::Disconnected) => Poll::Ready(None),
            Err(TryRecvError::Empty) => Poll::Pending,
        };
        if r.is_ready() {
            coop.made_progress();
        }
        r
    }

    pub async fn recv(&mut self) -> Option<Item> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let items = {
            let mut st = self.0.lock();
            st.rx_gone = true;
            std::mem::take(&mut st.items)
        };
        drop(items);
        self.0.space.notify_waiters();
    }
}

/// Why a watcher was closed by the hub.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CloseReason {
    SlowConsumer,
    Relist,
}

/// Counters read by the metrics layer.
#[derive(Debug, Default)]
pub struct HubStats {
    pub events_sent: AtomicU64,
    pub closed_slow: AtomicU64,
    pub closed_relist: AtomicU64,
    /// MODIFIED deliveries to watchers with a change filter: delivered, and suppressed
    /// because they changed none of the watcher's fields.
    pub changes_delivered: AtomicU64,
    pub changes_suppressed: AtomicU64,
    /// Change-filter decisions computed (per event that concerned a filtered watcher: one
    /// walk deciding every select filter, plus one per distinct ignore filter concerned; see
    /// `ChangeMemo::evaluations`) and the time spent on the filter work, in nanoseconds.
    pub change_evaluations: AtomicU64,
    pub change_nanos: AtomicU64,
}

pub struct Hub {
    /// Watchers by the namespace they watch ("" = all namespaces): an event is offered only
    /// to its namespace's watchers and the cluster-wide ones, so namespace-scoped informers
    /// cost nothing for other namespaces' events. Watchers selecting one value of an indexed
    /// field (pods' `spec.nodeName=X`: every kubelet) are kept by that value instead
    /// ([`index_bucket`]), so a pod event costs the watchers of its node, not of every node.
    buckets: DashMap<Box<str>, DashMap<u64, Entry>>,
    /// Watchers in index buckets; when 0, events skip the index lookups.
    indexed: std::sync::atomic::AtomicUsize,
    count: std::sync::atomic::AtomicUsize,
    /// Watchers with a change filter.
    filtered: std::sync::atomic::AtomicUsize,
    /// The resourceVersion up to which every event has been queued to every watcher.
    dispatched: AtomicU64,
    next_id: AtomicU64,
    queue_len: usize,
    queue_bytes: usize,
    budget: TimeBudget,
    pub stats: HubStats,
    /// The distinct change filters of this resource's watches (admitted by the pipeline,
    /// within `cache.watchFields`; interned by `subscribe`, each watcher holding its slot).
    pub change_filters: Arc<crate::k8s::watch_fields::Registry>,
    /// The decision buffers, kept from one dispatch to the next (taken by a dispatch; a
    /// concurrent one starts empty).
    memo: parking_lot::Mutex<ChangeMemo>,
}

/// Time the dispatcher may spend waiting for full queues, shared by all events (as
/// k8s.io/apiserver's cacher `timeBudget`: 100 ms at most, refilled at 50 ms per second).
#[derive(Debug)]
struct TimeBudget {
    max: Duration,
    /// Available now, and when it was last refilled.
    state: parking_lot::Mutex<(Duration, tokio::time::Instant)>,
}

impl TimeBudget {
    fn new(max: Duration) -> TimeBudget {
        TimeBudget {
            max,
            state: parking_lot::Mutex::new((max, tokio::time::Instant::now())),
        }
    }

    /// All that is available now (refilled at `max / 2` per second since the last take).
    fn take(&self) -> Duration {
        let mut s = self.state.lock();
        let now = tokio::time::Instant::now();
        let refill = (self.max / 2).mul_f64(now.duration_since(s.1).as_secs_f64());
        s.0 = (s.0 + refill).min(self.max);
        s.1 = now;
        std::mem::take(&mut s.0)
    }

    /// Returns what a dispatch took and did not wait.
    fn give_back(&self, unused: Duration) {
        let mut s = self.state.lock();
        s.0 = (s.0 + unused).min(self.max);
    }
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("watchers", &self.len())
            .finish()
    }
}

/// A registered watcher's end: drop it to unregister.
pub struct Subscription {
    pub id: u64,
    pub rx: Receiver,
    bucket: Box<str>,
    hub: std::sync::Weak<Hub>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(h) = self.hub.upgrade() {
            h.remove(&self.bucket, self.id);
        }
    }
}

impl Hub {
    /// `queue_len`: events buffered per watcher; `budget`: the most the dispatcher waits for
    /// full queues, shared by all events (`TimeBudget`).
    pub fn new(queue_len: usize, budget: Duration) -> Arc<Hub> {
        Hub::with_queue_bytes(queue_len, usize::MAX, budget)
    }

    /// [`Hub::new`] with a bound on the object bytes queued per watcher too (one event
    /// always fits, however large).
    pub fn with_queue_bytes(queue_len: usize, queue_bytes: usize, budget: Duration) -> Arc<Hub> {
        Arc::new(Hub {
            buckets: DashMap::new(),
            indexed: Default::default(),
            count: Default::default(),
            filtered: Default::default(),
            dispatched: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            queue_len: queue_len.max(1),
            queue_bytes: queue_bytes.max(1),
            budget: TimeBudget::new(budget),
            stats: HubStats::default(),
            change_filters: Default::default(),
            memo: Default::default(),
        })
    }

    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Watchers with a change filter.
    pub fn filtered(&self) -> usize {
        self.filtered.load(Ordering::Relaxed)
    }

    fn remove(&self, bucket: &str, id: u64) {
        let mut removed = false;
        if let Some(b) = self.buckets.get(bucket)
            && let Some((_, e)) = b.remove(&id)
        {
            removed = true;
            if e.filter.changes.is_some() {
                self.filtered.fetch_sub(1, Ordering::Relaxed);
            }
        }
        if removed {
            self.count.fetch_sub(1, Ordering::Relaxed);
            if bucket.starts_with(INDEX_PREFIX) {
                self.indexed.fetch_sub(1, Ordering::Relaxed);
            }
        }
        // Holding the outer shard lock while checking, so a concurrent subscribe into this
        // bucket (which takes the same lock) is never lost.
        self.buckets.remove_if(bucket, |_, b| b.is_empty());
    }

    /// See the field's docs; bookmarks may claim this much progress.
    pub fn dispatched_rv(&self) -> u64 {
        self.dispatched.load(Ordering::Acquire)
    }

    /// Records progress without an event (an upstream bookmark, a relist), in dispatch order.
    pub fn advance(&self, rv: u64) {
        self.dispatched.fetch_max(rv, Ordering::AcqRel);
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn subscribe(self: &Arc<Self>, filter: Arc<Filter>) -> Subscription {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = queue(self.queue_len, self.queue_bytes);
        let all = filter.labels.is_everything()
            && filter.fields.is_everything()
            && filter.namespaces.is_none();
        let change = filter.changes.as_ref().map(|f| {
            self.filtered.fetch_add(1, Ordering::Relaxed);
            self.change_filters.intern(f)
        });
        let bucket: Box<str> = match filter.fields.exact_value(INDEXED_FIELD) {
            Some(v) => {
                self.indexed.fetch_add(1, Ordering::Relaxed);
                index_bucket(v).into()
            }
            None => filter.namespace.as_deref().unwrap_or("").into(),
        };
        self.buckets.entry(bucket.clone()).or_default().insert(
            id,
            Entry {
                tx,
                filter,
                all,
                change,
            },
        );
        self.count.fetch_add(1, Ordering::Relaxed);
        Subscription {
            id,
            rx,
            bucket,
            hub: Arc::downgrade(self),
        }
    }

    /// Closes every watcher (their streams end cleanly).
    pub fn close_all(&self, reason: CloseReason) {
        let mut n = 0;
        for b in self.buckets.iter() {
            n += b.len();
            let filtered = b.iter().filter(|e| e.filter.changes.is_some()).count();
            self.filtered.fetch_sub(filtered, Ordering::Relaxed);
            if b.key().starts_with(INDEX_PREFIX) {
                self.indexed.fetch_sub(b.len(), Ordering::Relaxed);
            }
            b.clear();
        }
        self.count.fetch_sub(n, Ordering::Relaxed);
        self.buckets.retain(|_, b| !b.is_empty());
        if reason == CloseReason::Relist {
            self.stats
                .closed_relist
                .fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// Delivers one event to every interested watcher (see the module docs).
    pub async fn dispatch(&self, ev: Arc<Event>) {
        let mut blocked: Vec<(&str, u64, Sender, Delivery)> = Vec::new();
        let mut closed: Vec<(&str, u64)> = Vec::new();
        let mut sent = 0u64;
        let ns: &str = &ev.object.meta.namespace;
        // The event's namespace, then the cluster-wide watchers (the same bucket for
        // cluster-scoped resources, whose objects have no namespace), then the watchers of
        // the indexed field's value before and after the event (a pod bound to a node enters
        // that node's watches).
        let base: [Option<&str>; 2] = if ns.is_empty() {
            [Some(""), None]
        } else {
            [Some(ns), Some("")]
        };
        let mut index_keys: [Option<String>; 2] = [None, None];
        if self.indexed.load(Ordering::Relaxed) > 0 {
            let now = ev.object.field(INDEXED_FIELD);
            let before = ev.prev.as_deref().and_then(|p| p.field(INDEXED_FIELD));
            index_keys[0] = now.map(index_bucket);
            index_keys[1] = before.filter(|b| Some(*b) != now).map(index_bucket);
        }
        let scopes = base
            .into_iter()
            .flatten()
            .chain(index_keys.iter().flatten().map(String::as_str));
        let for_all = Filter::default().delivery(&ev);
        let mut memo = std::mem::take(&mut *self.memo.lock());
        memo.begin();
        let (mut changes_delivered, mut changes_suppressed) = (0u64, 0u64);
        for scope in scopes {
            let Some(bucket) = self.buckets.get(scope) else {
                continue;
            };
            for w in bucket.iter() {
                let d = if w.all {
                    for_all
                } else {
                    w.filter.delivery(&ev)
                };
                let Some(d) = d else {
                    continue;
                };
                // Only watchers with a change filter pay for it.
                if w.filter.changes.is_some() && ev.kind == crate::cache::EventKind::Modified {
                    if !w
                        .filter
                        .passes_changes(&ev, d, w.change.as_ref(), &mut memo)
                    {
                        changes_suppressed += 1;
                        continue;
                    }
                    changes_delivered += 1;
                }
                match w.tx.try_send((ev.clone(), d)) {
                    Ok(()) => sent += 1,
                    Err(TrySendError::Full(_)) => blocked.push((scope, *w.key(), w.tx.clone(), d)),
                    Err(TrySendError::Closed) => closed.push((scope, *w.key())),
                }
            }
        }
        // The iteration's shard locks are released here; waiting happens without them.
        let (evaluations, nanos) = (memo.evaluations(), memo.nanos);
        memo.set = None; // the changed paths, dropped now rather than at the next event
        *self.memo.lock() = memo;
        if !blocked.is_empty() {
            let start = tokio::time::Instant::now();
            let available = self.budget.take();
            let deadline = start + available;
            for (scope, id, tx, d) in blocked {
                match tokio::time::timeout_at(deadline, tx.send((ev.clone(), d))).await {
                    Ok(Ok(())) => sent += 1,
                    _ => {
                        self.stats.closed_slow.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(watcher = id, "closing a watcher that does not keep up");
                        closed.push((scope, id));
                    }
                }
            }
            self.budget
                .give_back(available.saturating_sub(start.elapsed()));
        }
        for (scope, id) in closed {
            self.remove(scope, id);
        }
        self.stats.events_sent.fetch_add(sent, Ordering::Relaxed);
        if changes_delivered + changes_suppressed > 0 {
            let st = &self.stats;
            st.change_evaluations
                .fetch_add(evaluations, Ordering::Relaxed);
            st.change_nanos.fetch_add(nanos, Ordering::Relaxed);
            st.changes_delivered
                .fetch_add(changes_delivered, Ordering::Relaxed);
            st.changes_suppressed
                .fetch_add(changes_suppressed, Ordering::Relaxed);
        }
        self.dispatched.fetch_max(ev.rv, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{EventKind, Resource};
    use bytes::Bytes;

    fn ev(ns: &str, name: &str, rv: u64) -> Arc<Event> {
        let raw = format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"{ns}","resourceVersion":"{rv}"}}}}"#
        );
        let o = CachedObject::parse(
            Bytes::from(raw),
            &Resource::core("configmaps", "ConfigMap", true),
        )
        .unwrap();
        Arc::new(Event::new(EventKind::Added, Arc::new(o), None))
    }

    fn filter(ns: Option<&str>) -> Arc<Filter> {
        Arc::new(Filter {
            namespace: ns.map(str::to_string),
            ..Filter::default()
        })
    }

    /// A waker that counts its wakes.
    struct Count(std::sync::atomic::AtomicUsize);
    impl futures_util::task::ArcWake for Count {
        fn wake_by_ref(c: &Arc<Self>) {
            c.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn a_waiting_reader_is_woken_by_a_push_and_by_the_last_sender_going() {
        let count = Arc::new(Count(Default::default()));
        let waker = futures_util::task::waker(count.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let woken = || count.0.load(Ordering::Relaxed);
        let (tx, mut rx) = queue(4, usize::MAX);
        assert!(rx.poll_recv(&mut cx).is_pending());
        // Polled again while waiting: still one registration, one wake.
        assert!(rx.poll_recv(&mut cx).is_pending());
        assert!(tx.try_send((ev("a", "x", 1), Delivery::AsIs)).is_ok());
        assert_eq!(woken(), 1);
        // Nobody waits now: the next push wakes nobody.
        assert!(tx.try_send((ev("a", "x", 2), Delivery::AsIs)).is_ok());
        assert_eq!(woken(), 1);
        for rv in [1, 2] {
            match rx.poll_recv(&mut cx) {
                std::task::Poll::Ready(Some((e, _))) => assert_eq!(e.rv, rv),
                other => panic!("expected event {rv}, got {:?}", other.map(|o| o.is_some())),
            }
        }
        assert!(rx.poll_recv(&mut cx).is_pending());
        let tx2 = tx.clone();
        drop(tx);
        assert_eq!(woken(), 1, "another sender is left");
        drop(tx2);
        assert_eq!(woken(), 2);
        assert!(matches!(
            rx.poll_recv(&mut cx),
            std::task::Poll::Ready(None)
        ));
        assert_eq!(rx.try_recv().err(), Some(TryRecvError::Disconnected));
    }

    #[test]
    fn queued_items_come_out_in_order_across_the_inline_slot() {
        // Pushes and pops interleaved in every pattern of up to 4 pushes between pops,
        // against a plain VecDeque.
        let mut items = Items::default();
        let mut model = std::collections::VecDeque::new();
        let mut rv = 0;
        for pattern in 0u32..256 {
            for step in 0..8 {
                let pushes = (pattern >> (step % 4 * 2)) & 3;
                for _ in 0..pushes {
                    rv += 1;
                    let e = ev("a", "x", rv);
                    items.push_back((e.clone(), Delivery::AsIs));
                    model.push_back(rv);
                }
                if step % 3 != 2 {
                    assert_eq!(items.pop_front().map(|(e, _)| e.rv), model.pop_front());
                }
                assert_eq!(items.len(), model.len());
                assert_eq!(items.is_empty(), model.is_empty());
            }
        }
        while let Some(want) = model.pop_front() {
            assert_eq!(items.pop_front().map(|(e, _)| e.rv), Some(want));
        }
        assert!(items.pop_front().is_none());
        assert!(items.is_empty());
    }

    #[tokio::test]
    async fn events_reach_their_namespace_and_cluster_wide_watchers_only() {
        let hub = Hub::new(16, Duration::from_millis(10));
        let mut a = hub.subscribe(filter(Some("a")));
        let mut b = hub.subscribe(filter(Some("b")));
        let mut all = hub.subscribe(filter(None));
        assert_eq!(hub.len(), 3);
        hub.dispatch(ev("a", "x", 2)).await;
        hub.dispatch(ev("b", "y", 3)).await;
        assert_eq!(a.rx.try_recv().unwrap().0.rv, 2);
        assert!(a.rx.try_recv().is_err());
        assert_eq!(b.rx.try_recv().unwrap().0.rv, 3);
        assert!(b.rx.try_recv().is_err());
        assert_eq!(all.rx.try_recv().unwrap().0.rv, 2);
        assert_eq!(all.rx.try_recv().unwrap().0.rv, 3);
        assert_eq!(hub.dispatched_rv(), 3);
        drop(a);
        assert_eq!(hub.len(), 2);
    }

    #[tokio::test]
    async fn a_change_filter_drops_modifications_of_other_fields_once_per_filter() {
        let cm = |rv: u64, data: &str, note: &str| {
            let raw = format!(
                r#"{{"metadata":{{"name":"x","namespace":"a","resourceVersion":"{rv}","annotations":{{"n":"{note}"}}}},"data":{{"v":"{data}"}}}}"#
            );
            Arc::new(
                CachedObject::parse(
                    Bytes::from(raw),
                    &Resource::core("configmaps", "ConfigMap", true),
                )
                .unwrap(),
            )
        };
        let modified = |prev: &Arc<CachedObject>, next: &Arc<CachedObject>, rv| {
            let mut e = Event::new(EventKind::Modified, next.clone(), Some(prev.clone()));
            e.rv = rv;
            Arc::new(e)
        };
        let on_data = |ns: Option<&str>| {
            let mut f = (*filter(ns)).clone();
            f.changes = Some(Arc::new(WatchFields::parse("data").unwrap()));
            Arc::new(f)
        };
        let hub = Hub::new(16, Duration::from_millis(10));
        let mut plain = hub.subscribe(filter(None));
        let mut data = hub.subscribe(on_data(None));
        let mut data_ns = hub.subscribe(on_data(Some("a")));
        assert_eq!(hub.filtered(), 2);
        let (v1, v2, v3) = (cm(1, "0", "a"), cm(2, "0", "b"), cm(3, "1", "b"));
        hub.dispatch(modified(&v1, &v2, 2)).await; // an annotation only
        hub.dispatch(modified(&v2, &v3, 3)).await; // the data
        let rvs = |w: &mut Subscription| {
            std::iter::from_fn(|| w.rx.try_recv().ok().map(|(e, _)| e.rv)).collect::<Vec<_>>()
        };
        assert_eq!(rvs(&mut plain), [2, 3]);
        assert_eq!(rvs(&mut data), [3]);
        assert_eq!(rvs(&mut data_ns), [3]);
        let st = &hub.stats;
        assert_eq!(st.changes_suppressed.load(Ordering::Relaxed), 2);
        assert_eq!(st.changes_delivered.load(Ordering::Relaxed), 2);
        // The shared filter is decided once per event (one walk of its slot's trie).
        assert_eq!(st.change_evaluations.load(Ordering::Relaxed), 2);
        assert_eq!(hub.change_filters.interned(), 1);
        // Outside the hub (no slot), each call decides; added and deleted events always pass.
        let mut memo = ChangeMemo::default();
        let e = modified(&v1, &v2, 2);
        for f in [on_data(None), on_data(Some("a"))] {
            assert_eq!(f.delivery_of_changes(&e, &mut memo), None);
        }
        assert_eq!(memo.evaluations(), 2);
        let added = Arc::new(Event::new(EventKind::Added, v3.clone(), None));
        assert!(
            on_data(None)
                .delivery_of_changes(&added, &mut memo)
                .is_some()
        );
        drop(data);
        assert_eq!(hub.filtered(), 1);
        assert_eq!(hub.change_filters.interned(), 1, "data_ns holds it");
        hub.close_all(CloseReason::Relist);
        assert_eq!(hub.filtered(), 0);
        assert_eq!(hub.change_filters.interned(), 0);
    }

    fn configmap(v: serde_json::Value) -> Arc<CachedObject> {
        let raw = Bytes::from(v.to_string());
        let r = Resource::core("configmaps", "ConfigMap", true);
        Arc::new(CachedObject::parse(raw, &r).unwrap())
    }

    /// Thousands of distinct select filters: one walk of the event's changed paths with the
    /// trie of their paths decides them all, and each watcher gets exactly what the direct
    /// comparison of its fields says.
    #[tokio::test]
    async fn many_distinct_filters_are_decided_by_one_walk_of_the_changed_paths() {
        let cm = |rv: u64, keys: &[(usize, &str)]| {
            let data: serde_json::Map<String, serde_json::Value> = keys
                .iter()
                .map(|(k, v)| (format!("k{k}"), serde_json::json!(v)))
                .collect();
            configmap(
                serde_json::json!({"metadata": {"name": "x", "namespace": "a",
                "resourceVersion": rv.to_string()}, "data": data}),
            )
        };
        const N: usize = 2000;
        let hub = Hub::new(16, Duration::from_millis(10));
        // Watcher i selects key i (and 31 keys nobody writes); two watchers per filter.
        let mut subs: Vec<(usize, Subscription)> = (0..2 * N)
            .map(|w| {
                let i = w % N;
                let paths: Vec<String> = std::iter::once(format!("data[k{i}]"))
                    .chain((0..31).map(|j| format!("data[unused-{i}-{j}]")))
                    .collect();
                let f = Filter {
                    changes: Some(Arc::new(WatchFields::parse(&paths.join(",")).unwrap())),
                    ..Filter::default()
                };
                (i, hub.subscribe(Arc::new(f)))
            })
            .collect();
        let before: Vec<(usize, &str)> = (0..N).map(|k| (k, "0")).collect();
        let mut after = before.clone();
        for k in [7, 1234] {
            after[k].1 = "1";
        }
        let (v1, v2) = (cm(1, &before), cm(2, &after));
        let e = Arc::new(Event::new(
            EventKind::Modified,
            v2.clone(),
            Some(v1.clone()),
        ));
        hub.dispatch(e.clone()).await;
        let (old, new): (serde_json::Value, serde_json::Value) = (
            serde_json::from_slice(&v1.body).unwrap(),
            serde_json::from_slice(&v2.body).unwrap(),
        );
        for (i, s) in &mut subs {
            let got = s.rx.try_recv().is_ok();
            let f = WatchFields::parse(&format!("data[k{i}]")).unwrap();
            assert_eq!(got, f.changed(&old, &new), "watcher of k{i}");
            assert_eq!(got, *i == 7 || *i == 1234);
        }
        let st = &hub.stats;
        assert_eq!(st.change_evaluations.load(Ordering::Relaxed), 1);
        assert_eq!(st.changes_delivered.load(Ordering::Relaxed), 4);
        assert_eq!(
            st.changes_suppressed.load(Ordering::Relaxed),
            2 * N as u64 - 4
        );
        assert_eq!(hub.change_filters.interned(), N);
        drop(subs);
        assert_eq!(hub.change_filters.interned(), 0);
    }

    /// Select and ignore filters on watchers of two namespaces and of all, coming and going
    /// between events (their slots freed and reused): every watcher gets exactly the MODIFIED
    /// events the direct comparison of its fields says, each ignore filter is decided at
    /// most once per event, and the slots go with the last watchers.
    #[tokio::test]
    async fn watchers_coming_and_going_get_their_own_filters_decisions() {
        let headers = [
            "data",
            "data[k1]",
            "data[k2],metadata.labels",
            "metadata",
            "metadata.labels[app]",
            "-data",
            "-data[k1]",
            "-metadata.annotations",
            "-metadata,-data[k2]",
            "spec",
        ];
        let cm = |ns: &str, rv: u64, k1: u64, k2: u64, app: u64, note: u64| {
            configmap(
                serde_json::json!({"metadata": {"name": "x", "namespace": ns,
                "resourceVersion": rv.to_string(), "labels": {"app": app.to_string()},
                "annotations": {"n": note.to_string()}},
                "data": {"k1": k1.to_string(), "k2": k2.to_string()}}),
            )
        };
        let hub = Hub::new(1024, Duration::from_millis(10));
        let mut subs: Vec<(Option<&str>, usize, Subscription)> = Vec::new();
        let mut seed = 7u64;
        let mut rnd = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let mut objects = std::collections::HashMap::new();
        for rv in 2..300u64 {
            // A watcher goes, one comes.
            if !subs.is_empty() && rnd(2) == 0 {
                let i = rnd(subs.len() as u64) as usize;
                subs.swap_remove(i);
            }
            for _ in 0..2 {
                let ns = [Some("a"), Some("b"), None][rnd(3) as usize];
                let h = rnd(headers.len() as u64) as usize;
                let f = Filter {
                    namespace: ns.map(str::to_string),
                    changes: Some(Arc::new(WatchFields::parse(headers[h]).unwrap())),
                    ..Filter::default()
                };
                subs.push((ns, h, hub.subscribe(Arc::new(f))));
            }
            let ns = ["a", "b"][rnd(2) as usize];
            let prev = objects
                .entry(ns)
                .or_insert_with(|| cm(ns, 1, 0, 0, 0, 0))
                .clone();
            let v = |f: &str| {
                let j: serde_json::Value = serde_json::from_slice(&prev.body).unwrap();
                let s = if f == "app" {
                    j["metadata"]["labels"]["app"].as_str().unwrap().to_string()
                } else if f == "n" {
                    j["metadata"]["annotations"]["n"]
                        .as_str()
                        .unwrap()
                        .to_string()
                } else {
                    j["data"][f].as_str().unwrap().to_string()
                };
                s.parse::<u64>().unwrap()
            };
            let (mut k1, mut k2, mut app, mut note) = (v("k1"), v("k2"), v("app"), v("n"));
            match rnd(5) {
                0 => k1 += 1,
                1 => k2 += 1,
                2 => app += 1,
                3 => note += 1,
                _ => {}
            }
            let next = cm(ns, rv, k1, k2, app, note);
            objects.insert(ns, next.clone());
            let before = hub.stats.change_evaluations.load(Ordering::Relaxed);
            hub.dispatch(Arc::new(Event::new(
                EventKind::Modified,
                next.clone(),
                Some(prev.clone()),
            )))
            .await;
            let evaluations = hub.stats.change_evaluations.load(Ordering::Relaxed) - before;
            let ignore_filters = headers.iter().filter(|h| h.starts_with('-')).count();
            assert!(evaluations <= 1 + ignore_filters as u64, "{evaluations}");
            let (old, new): (serde_json::Value, serde_json::Value) = (
                serde_json::from_slice(&prev.body).unwrap(),
                serde_json::from_slice(&next.body).unwrap(),
            );
            for (wns, h, s) in &mut subs {
                let got = s.rx.try_recv().ok().map(|(e, _)| e.rv);
                let want = (wns.is_none() || *wns == Some(ns))
                    && WatchFields::parse(headers[*h]).unwrap().changed(&old, &new);
                assert_eq!(
                    got,
                    want.then_some(rv),
                    "{} in {wns:?}, event in {ns}",
                    headers[*h]
                );
            }
        }
        assert!(hub.change_filters.interned() <= headers.len());
        drop(subs);
        assert_eq!(hub.change_filters.interned(), 0);
    }

    #[tokio::test]
    async fn a_watcher_too_many_bytes_behind_is_closed_and_one_large_event_always_fits() {
        let big = |name: &str, rv: u64, kib: usize| {
            let raw = format!(
                r#"{{"metadata":{{"name":"{name}","namespace":"a","resourceVersion":"{rv}"}},"data":{{"v":"{}"}}}}"#,
                "x".repeat(kib << 10)
            );
            let o = CachedObject::parse(
                Bytes::from(raw),
                &Resource::core("configmaps", "ConfigMap", true),
            )
            .unwrap();
            Arc::new(Event::new(EventKind::Added, Arc::new(o), None))
        };
        // 1,000 events or 40 KiB per watcher; the dispatcher waits 5 ms for a full one.
        let hub = Hub::with_queue_bytes(1000, 40 << 10, Duration::from_millis(5));
        let mut slow = hub.subscribe(filter(None));
        let mut fast = hub.subscribe(filter(None));
        // One event larger than the bound fits an empty queue.
        hub.dispatch(big("huge", 2, 64)).await;
        assert_eq!(fast.rx.try_recv().unwrap().0.rv, 2);
        assert_eq!(slow.rx.try_recv().unwrap().0.rv, 2);
        // 16 KiB events: the slow watcher's queue holds two, the third closes it.
        for rv in 3..6 {
            hub.dispatch(big("x", rv, 16)).await;
            assert_eq!(fast.rx.try_recv().unwrap().0.rv, rv);
        }
        assert_eq!(hub.len(), 1, "closed by bytes, far below 1,000 events");
        assert_eq!(hub.stats.closed_slow.load(Ordering::Relaxed), 1);
        assert_eq!(slow.rx.recv().await.unwrap().0.rv, 3);
        assert_eq!(slow.rx.recv().await.unwrap().0.rv, 4);
        assert!(slow.rx.recv().await.is_none());
    }

    #[tokio::test]
    async fn a_full_queue_past_the_budget_closes_only_that_watcher() {
        let hub = Hub::new(1, Duration::from_millis(5));
        let mut slow = hub.subscribe(filter(None));
        let mut fast = hub.subscribe(filter(None));
        hub.dispatch(ev("a", "x", 2)).await;
        assert_eq!(fast.rx.try_recv().unwrap().0.rv, 2);
        hub.dispatch(ev("a", "x", 3)).await;
        assert_eq!(fast.rx.try_recv().unwrap().0.rv, 3);
        assert_eq!(hub.len(), 1, "the slow watcher is closed");
        assert_eq!(hub.stats.closed_slow.load(Ordering::Relaxed), 1);
        // It keeps what was queued, then sees the end of its stream.
        assert_eq!(slow.rx.recv().await.unwrap().0.rv, 2);
        assert!(slow.rx.recv().await.is_none());
    }

    /// The budget is shared by all events: a watcher that frees one slot 60 ms after each
    /// event (within a 100 ms budget every time) is closed at the second wait, once the
    /// budget spent on the first has not come back, instead of costing every event 60 ms.
    /// (Paused time: the clock moves only when every task waits.)
    #[tokio::test(start_paused = true)]
    async fn waits_for_full_queues_share_one_refilling_budget() {
        let hub = Hub::new(1, Duration::from_millis(100));
        let mut slow = hub.subscribe(filter(None));
        let mut fast = hub.subscribe(filter(None));
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                tokio::time::sleep(Duration::from_millis(60)).await;
                match slow.rx.recv().await {
                    Some((e, _)) => got.push(e.rv),
                    None => return got,
                }
            }
        });
        let start = tokio::time::Instant::now();
        for rv in 2..8 {
            hub.dispatch(ev("a", "x", rv)).await;
            assert_eq!(fast.rx.try_recv().unwrap().0.rv, rv);
        }
        assert_eq!(hub.stats.closed_slow.load(Ordering::Relaxed), 1);
        assert_eq!(hub.len(), 1, "only the slow watcher is closed");
        // Event 3 waited 60 ms for its slot; event 4 had the 40 ms left (and 3 ms refilled)
        // and closed the watcher; later events did not wait.
        assert_eq!(start.elapsed(), Duration::from_millis(103));
        assert_eq!(reader.await.unwrap(), vec![2, 3]);
    }

    /// The bounded wait: a watcher whose full queue gets room within the budget receives the
    /// event and stays; the reader taking an item wakes the waiting dispatcher.
    #[tokio::test]
    async fn a_full_queue_that_drains_within_the_budget_keeps_its_watcher() {
        let hub = Hub::new(1, Duration::from_secs(60));
        let mut w = hub.subscribe(filter(None));
        hub.dispatch(ev("a", "x", 2)).await;
        let h = hub.clone();
        let blocked = tokio::spawn(async move { h.dispatch(ev("a", "x", 3)).await });
        // Until the reader takes an item, the dispatcher waits (the event is not queued).
        tokio::task::yield_now().await;
        assert_eq!(w.rx.recv().await.unwrap().0.rv, 2);
        blocked.await.unwrap();
        assert_eq!(w.rx.recv().await.unwrap().0.rv, 3);
        assert_eq!(hub.len(), 1);
        assert_eq!(hub.stats.closed_slow.load(Ordering::Relaxed), 0);
        assert_eq!(hub.dispatched_rv(), 3);
        // The queue holds what is sent and reports emptiness, then the end once closed.
        assert_eq!(w.rx.try_recv().unwrap_err(), TryRecvError::Empty);
        hub.close_all(CloseReason::Relist);
        assert_eq!(w.rx.try_recv().unwrap_err(), TryRecvError::Disconnected);
    }

    #[tokio::test]
    async fn close_all_ends_every_watcher() {
        let hub = Hub::new(4, Duration::from_millis(5));
        let mut a = hub.subscribe(filter(Some("a")));
        let mut all = hub.subscribe(filter(None));
        hub.close_all(CloseReason::Relist);
        assert_eq!(hub.len(), 0);
        assert!(a.rx.recv().await.is_none());
        assert!(all.rx.recv().await.is_none());
        assert_eq!(hub.stats.closed_relist.load(Ordering::Relaxed), 2);
    }

    fn pod(name: &str, node: &str, rv: u64) -> Arc<CachedObject> {
        let raw = format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"ns","resourceVersion":"{rv}"}},"spec":{{"nodeName":"{node}"}}}}"#
        );
        Arc::new(
            CachedObject::parse(Bytes::from(raw), &Resource::core("pods", "Pod", true)).unwrap(),
        )
    }

    fn on_node(node: &str) -> Arc<Filter> {
        Arc::new(Filter {
            fields: crate::k8s::selector::FieldSelector::parse(&format!("spec.nodeName={node}"))
                .unwrap(),
            ..Filter::default()
        })
    }

    fn widget(name: &str, color: Option<&str>, rv: u64) -> Arc<CachedObject> {
        let r = Resource::test_widgets(true, &[".spec.color"]);
        let spec = color.map_or(String::new(), |c| format!(r#","spec":{{"color":"{c}"}}"#));
        let raw = format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"ns","resourceVersion":"{rv}"}}{spec}}}"#
        );
        Arc::new(CachedObject::parse(Bytes::from(raw), &r).unwrap())
    }

    /// A custom resource's selectable field moves objects in and out of a field-selected
    /// watch as the apiserver's cacher does: entering is ADDED, leaving is DELETED.
    #[tokio::test]
    async fn custom_resource_fields_move_objects_into_and_out_of_selected_watches() {
        let hub = Hub::new(16, Duration::from_millis(10));
        let f = |s: &str| {
            Arc::new(Filter {
                fields: crate::k8s::selector::FieldSelector::parse(s).unwrap(),
                ..Filter::default()
            })
        };
        let mut red = hub.subscribe(f("spec.color=red"));
        let mut not_red = hub.subscribe(f("spec.color!=red"));
        let mut unset = hub.subscribe(f("spec.color="));
        let w1 = widget("w", None, 2);
        let w2 = widget("w", Some("red"), 3);
        let w3 = widget("w", Some("blue"), 4);
        hub.dispatch(Arc::new(Event::new(EventKind::Added, w1.clone(), None)))
            .await;
        hub.dispatch(Arc::new(Event::new(
            EventKind::Modified,
            w2.clone(),
            Some(w1),
        )))
        .await;
        hub.dispatch(Arc::new(Event::new(
            EventKind::Modified,
            w3.clone(),
            Some(w2),
        )))
        .await;
        let gone = widget("w", Some("blue"), 5);
        hub.dispatch(Arc::new(Event::new(EventKind::Deleted, gone, Some(w3))))
            .await;
        assert_eq!(
            drain(&mut red),
            [(3, Delivery::Entered), (4, Delivery::Left)]
        );
        assert_eq!(
            drain(&mut not_red),
            [
                (2, Delivery::AsIs),
                (3, Delivery::Left),
                (4, Delivery::Entered),
                (5, Delivery::AsIs)
            ]
        );
        assert_eq!(
            drain(&mut unset),
            [(2, Delivery::AsIs), (3, Delivery::Left)]
        );
    }

    fn drain(s: &mut Subscription) -> Vec<(u64, Delivery)> {
        std::iter::from_fn(|| s.rx.try_recv().ok().map(|(e, d)| (e.rv, d))).collect()
    }

    /// Watchers of one node's pods are kept by node: they get exactly their node's events,
    /// including a pod being bound to the node (entered) and deleted, and are counted and
    /// removed like the others.
    #[tokio::test]
    async fn node_watchers_get_their_node_only() {
        let hub = Hub::new(16, Duration::from_millis(10));
        let mut a = hub.subscribe(on_node("a"));
        let mut b = hub.subscribe(on_node("b"));
        let mut unbound = hub.subscribe(on_node(""));
        let mut all = hub.subscribe(filter(None));
        let mut ns = hub.subscribe(filter(Some("ns")));
        assert_eq!(hub.len(), 5);
        let p1 = pod("p", "", 2);
        hub.dispatch(Arc::new(Event::new(EventKind::Added, p1.clone(), None)))
            .await;
        let p2 = pod("p", "a", 3);
        hub.dispatch(Arc::new(Event::new(
            EventKind::Modified,
            p2.clone(),
            Some(p1),
        )))
        .await;
        hub.dispatch(Arc::new(Event::new(
            EventKind::Added,
            pod("q", "b", 4),
            None,
        )))
        .await;
        hub.dispatch(Arc::new(Event::new(
            EventKind::Deleted,
            pod("p", "a", 5),
            Some(p2),
        )))
        .await;
        assert_eq!(drain(&mut a), [(3, Delivery::Entered), (5, Delivery::AsIs)]);
        assert_eq!(drain(&mut b), [(4, Delivery::AsIs)]);
        assert_eq!(
            drain(&mut unbound),
            [(2, Delivery::AsIs), (3, Delivery::Left)]
        );
        assert_eq!(drain(&mut all).len(), 4);
        assert_eq!(drain(&mut ns).len(), 4);
        drop(a);
        drop(b);
        drop(unbound);
        assert_eq!(hub.len(), 2);
        assert_eq!(hub.indexed.load(Ordering::Relaxed), 0);
    }
}
