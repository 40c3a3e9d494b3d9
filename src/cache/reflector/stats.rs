//! What the reflector tells the outside: why it lists ([`RelistReason`]), its counters
//! ([`ReflectorStats`], read by the metrics layer) and its current status
//! ([`ReflectorStatus`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Why a LIST was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RelistReason {
    /// The first sync.
    Initial,
    /// The watch got 410 Expired/Gone: its resourceVersion is compacted away.
    Expired,
    /// A continue token's snapshot was compacted mid-list; listed again unpaged.
    ContinueExpired,
    /// The apiserver kept answering "Too large resource version" to the watch.
    TooLargeResourceVersion,
    /// The previous list attempt failed.
    Retry,
}

impl RelistReason {
    pub const ALL: [RelistReason; 5] = [
        RelistReason::Initial,
        RelistReason::Expired,
        RelistReason::ContinueExpired,
        RelistReason::TooLargeResourceVersion,
        RelistReason::Retry,
    ];

    /// A metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RelistReason::Initial => "initial",
            RelistReason::Expired => "expired",
            RelistReason::ContinueExpired => "continue_expired",
            RelistReason::TooLargeResourceVersion => "too_large_resource_version",
            RelistReason::Retry => "retry",
        }
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

/// Counters the metrics layer reads (monotonic, relaxed atomics; read with [`Self::snapshot`]).
#[derive(Debug, Default)]
pub struct ReflectorStats {
    pub(super) lists: [AtomicU64; RelistReason::ALL.len()],
    pub(super) list_pages: AtomicU64,
    pub(super) list_bytes: AtomicU64,
    pub(super) list_errors: AtomicU64,
    pub(super) syncs: AtomicU64,
    pub(super) watch_starts: AtomicU64,
    pub(super) watches_established: AtomicU64,
    pub(super) watch_errors: AtomicU64,
    pub(super) watch_clean_ends: AtomicU64,
    pub(super) events: AtomicU64,
    pub(super) bookmarks: AtomicU64,
    pub(super) watch_bytes: AtomicU64,
    pub(super) stalls: AtomicU64,
    pub(super) backoffs: AtomicU64,
    pub(super) last_rv: AtomicU64,
}

/// A point-in-time copy of [`ReflectorStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// LIST attempts by reason, in [`RelistReason::ALL`] order.
    pub lists: [u64; RelistReason::ALL.len()],
    /// LIST page requests sent.
    pub list_pages: u64,
    /// Bytes of the LIST pages' bodies received (as decoded by the HTTP layer).
    pub list_bytes: u64,
    /// LIST attempts that failed.
    pub list_errors: u64,
    /// Completed lists delivered with `replace`.
    pub syncs: u64,
    /// WATCH requests sent.
    pub watch_starts: u64,
    /// WATCH requests answered 200.
    pub watches_established: u64,
    /// Watches refused, broken, or ended by an ERROR event.
    pub watch_errors: u64,
    /// Watches the apiserver ended cleanly (timeoutSeconds, apiserver shutdown).
    pub watch_clean_ends: u64,
    /// ADDED/MODIFIED/DELETED events delivered.
    pub events: u64,
    /// BOOKMARK events delivered.
    pub bookmarks: u64,
    /// Bytes of the watches' bodies received (every line: events, bookmarks, errors).
    pub watch_bytes: u64,
    /// Watches dropped for silence (`ReflectorConfig::stall_timeout`).
    pub stalls: u64,
    /// Backoff sleeps.
    pub backoffs: u64,
    /// The last resourceVersion delivered to the sink (list, event or bookmark).
    pub last_rv: u64,
}

impl StatsSnapshot {
    pub fn lists(&self, reason: RelistReason) -> u64 {
        self.lists[reason.index()]
    }
}

impl ReflectorStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            lists: RelistReason::ALL.map(|r| get(&self.lists[r.index()])),
            list_pages: get(&self.list_pages),
            list_bytes: get(&self.list_bytes),
            list_errors: get(&self.list_errors),
            syncs: get(&self.syncs),
            watch_starts: get(&self.watch_starts),
            watches_established: get(&self.watches_established),
            watch_errors: get(&self.watch_errors),
            watch_clean_ends: get(&self.watch_clean_ends),
            events: get(&self.events),
            bookmarks: get(&self.bookmarks),
            watch_bytes: get(&self.watch_bytes),
            stalls: get(&self.stalls),
            backoffs: get(&self.backoffs),
            last_rv: get(&self.last_rv),
        }
    }

    pub(super) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// What the reflector is doing, published on every state change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReflectorStatus {
    /// A LIST is in progress.
    Listing { reason: RelistReason },
    /// A WATCH from `rv` is being opened or is open.
    Watching { rv: u64 },
    /// Waiting `delay` after `error` before the next attempt.
    BackingOff { error: String, delay: Duration },
    /// Cancelled; nothing more will be delivered.
    Stopped,
}
