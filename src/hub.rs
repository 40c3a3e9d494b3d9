//! Watch fan-out: every event of a resource goes to every interested watcher as a shared
//! `Arc<Event>` (frames are encoded once, in [`crate::cache::event`]).
//!
//! Each watcher has a bounded queue. Delivery tries a non-blocking send to everyone first;
//! watchers whose queues are full then share a bounded wait (the dispatch budget); any still
//! full after it are closed and counted, like k8s.io/apiserver's `cacheWatcher` with its
//! `dispatchTimeoutBudget`. A closed watcher's stream ends cleanly, so its client re-watches
//! from the last resourceVersion it saw. One slow client therefore costs the others at most
//! one budget, once.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use tokio::sync::mpsc;

use crate::cache::CachedObject;
use crate::cache::event::{Delivery, Event};
use crate::selector::{FieldSelector, LabelSelector};

/// What a watcher wants to see.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// Only this namespace; `None` for all.
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, o: &CachedObject) -> bool {
        if let Some(ns) = &self.namespace
            && &*o.meta.namespace != ns.as_str()
        {
            return false;
        }
        self.labels.matches(|k| o.label(k)) && self.fields.matches(|f| o.field(f))
    }

    /// How an event is seen through this filter, if at all (cacher `convertToWatchEvent`).
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

/// An item in a watcher's queue.
pub type Item = (Arc<Event>, Delivery);

struct Entry {
    tx: mpsc::Sender<Item>,
    filter: Arc<Filter>,
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
}

pub struct Hub {
    watchers: DashMap<u64, Entry>,
    /// The resourceVersion up to which every event has been queued to every watcher.
    dispatched: AtomicU64,
    next_id: AtomicU64,
    queue_len: usize,
    budget: Duration,
    pub stats: HubStats,
}

impl std::fmt::Debug for Hub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub")
            .field("watchers", &self.watchers.len())
            .finish()
    }
}

/// A registered watcher's end: drop it to unregister.
pub struct Subscription {
    pub id: u64,
    pub rx: mpsc::Receiver<Item>,
    hub: std::sync::Weak<Hub>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        if let Some(h) = self.hub.upgrade() {
            h.watchers.remove(&self.id);
        }
    }
}

impl Hub {
    /// `queue_len`: events buffered per watcher; `budget`: the shared wait for full queues
    /// per dispatched event.
    pub fn new(queue_len: usize, budget: Duration) -> Arc<Hub> {
        Arc::new(Hub {
            watchers: DashMap::new(),
            dispatched: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            queue_len: queue_len.max(1),
            budget,
            stats: HubStats::default(),
        })
    }

    pub fn len(&self) -> usize {
        self.watchers.len()
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
        self.watchers.is_empty()
    }

    pub fn subscribe(self: &Arc<Self>, filter: Arc<Filter>) -> Subscription {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(self.queue_len);
        self.watchers.insert(id, Entry { tx, filter });
        Subscription {
            id,
            rx,
            hub: Arc::downgrade(self),
        }
    }

    /// Closes every watcher (their streams end cleanly).
    pub fn close_all(&self, reason: CloseReason) {
        let n = self.watchers.len() as u64;
        self.watchers.clear();
        if reason == CloseReason::Relist {
            self.stats.closed_relist.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Delivers one event to every interested watcher (see the module docs).
    pub async fn dispatch(&self, ev: Arc<Event>) {
        let mut blocked: Vec<(u64, mpsc::Sender<Item>, Delivery)> = Vec::new();
        let mut closed: Vec<u64> = Vec::new();
        let mut sent = 0u64;
        for w in self.watchers.iter() {
            let Some(d) = w.filter.delivery(&ev) else {
                continue;
            };
            match w.tx.try_send((ev.clone(), d)) {
                Ok(()) => sent += 1,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    blocked.push((*w.key(), w.tx.clone(), d))
                }
                Err(mpsc::error::TrySendError::Closed(_)) => closed.push(*w.key()),
            }
        }
        // The iteration's shard locks are released here; waiting happens without them.
        if !blocked.is_empty() {
            let deadline = tokio::time::Instant::now() + self.budget;
            for (id, tx, d) in blocked {
                match tokio::time::timeout_at(deadline, tx.send((ev.clone(), d))).await {
                    Ok(Ok(())) => sent += 1,
                    _ => {
                        self.stats.closed_slow.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(watcher = id, "closing a watcher that does not keep up");
                        closed.push(id);
                    }
                }
            }
        }
        for id in closed {
            self.watchers.remove(&id);
        }
        self.stats.events_sent.fetch_add(sent, Ordering::Relaxed);
        self.dispatched.fetch_max(ev.rv, Ordering::AcqRel);
    }
}
