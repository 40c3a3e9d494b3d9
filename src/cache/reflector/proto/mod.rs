//! The protobuf side of a built-in resource's cache: a second upstream WATCH, in protobuf,
//! whose objects' exact bytes (each a whole envelope, byte-identical to a protobuf GET of the
//! object at that resourceVersion) are handed to a [`ProtoSink`] by (key, resourceVersion),
//! to be attached to the JSON side's objects. The JSON reflector stays authoritative: this
//! side only supplies bytes, and a cache serves protobuf only for what it has attached.
//!
//! ```text
//! state         outcome                                                   next
//! Initial       (watch, sendInitialEvents=true) the initial-events-end    Resume{last rv}
//!               bookmark arrived, then the stream ended or stalled
//! Initial       ended/broke before that bookmark                          [Backoff ->] Initial
//! Resume{rv}    ended cleanly, stalled                                    Resume{last rv}
//! Resume{rv}    410 Expired/Gone (HTTP status or ERROR event)             Initial (restarted)
//! Resume{rv}    "Too large resource version", the 3rd in a row            Backoff -> Initial
//! any watch     anything else: refused, 5xx, 429, broken stream, ERROR    Backoff -> same
//! Backoff       delay elapsed                                             its next state
//! any           shutdown token cancelled                                  Stopped
//! ```
//!
//! An initial watch sends `watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan
//! &allowWatchBookmarks=true&timeoutSeconds=<5-10 min>`; a resumed one
//! `resourceVersion=<last>&allowWatchBookmarks=true` instead of the first two
//! ([KEP-3157](https://github.com/kubernetes/enhancements/tree/master/keps/sig-api-machinery/3157-watch-list)).
//! Both ask `Accept: application/vnd.kubernetes.protobuf` with the proxy's own identity, on
//! the HTTP/1.1 pool of long requests, as the JSON reflector's watch.
//!
//! # Sink contract
//! Calls never overlap (one task). In an initial watch, `attach(Added, ..)` per object of the
//! state (in key order, not resourceVersion order), then `bookmark(rv, true, ..)`: every
//! object at that rv has been attached. Then changes in resourceVersion order, and bookmarks.
//! A watch that must start over (410, or a broken initial watch) calls `restarted` first. The
//! sink runs on the task: a slow sink delays reading the stream.
//!
//! # Files
//! [`frame`] (the frame reader and the event decoder), [`state`] (the states and the pure
//! transition), [`task`] (the task that runs them).

pub mod frame;
pub mod state;
pub mod task;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;

use crate::cache::{EventKind, ObjectKey};

pub use frame::{FrameError, FrameReader, MAX_FRAME, ProtoItem, decode};
pub use state::{ProtoError, ProtoState, ProtoWatchEnd, ProtoWatchOutcome, after_proto_watch};
pub use task::{ProtoSide, ProtoSideHandle};

/// Where the protobuf side delivers what it reads (see the module's sink contract).
pub trait ProtoSink: Send + Sync + 'static {
    /// One object version's exact protobuf envelope (for `Deleted`: the last state with the
    /// deletion's resourceVersion).
    fn attach(&self, kind: EventKind, key: ObjectKey, rv: u64, envelope: Bytes);
    /// A bookmark the apiserver sent (the first initial-events-end one marks the side synced:
    /// every object at that rv has been attached). `envelope` is the bookmark object's
    /// envelope: a template for the proxy's own bookmarks
    /// ([`crate::k8s::protobuf_write::bookmark_rest`] and `bookmark_object`).
    fn bookmark(&self, rv: u64, initial_events_end: bool, envelope: Bytes);
    /// The stream restarted from scratch (after 410): objects attached before may be followed
    /// by a fresh initial state.
    fn restarted(&self);
}

/// The protobuf side's counters (monotonic, relaxed atomics; read with [`Self::snapshot`]).
#[derive(Debug, Default)]
pub struct ProtoStats {
    pub(super) watch_starts: AtomicU64,
    pub(super) initial_watches: AtomicU64,
    pub(super) restarts: AtomicU64,
    pub(super) frames: AtomicU64,
    pub(super) bytes: AtomicU64,
    pub(super) objects: AtomicU64,
    pub(super) bookmarks: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) clean_ends: AtomicU64,
    pub(super) stalls: AtomicU64,
    pub(super) backoffs: AtomicU64,
    pub(super) last_rv: AtomicU64,
    pub(super) synced: AtomicBool,
}

/// A point-in-time copy of [`ProtoStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProtoStatsSnapshot {
    /// WATCH requests sent.
    pub watch_starts: u64,
    /// Of those, with initial events.
    pub initial_watches: u64,
    /// `restarted` calls: initial watches after the sink had been given something.
    pub restarts: u64,
    /// Frames read.
    pub frames: u64,
    /// Body bytes read.
    pub bytes: u64,
    /// Object versions attached.
    pub objects: u64,
    /// Bookmarks delivered.
    pub bookmarks: u64,
    /// Watches refused, broken, or ended by an ERROR event.
    pub errors: u64,
    /// Watches the apiserver ended cleanly.
    pub clean_ends: u64,
    /// Watches dropped for silence.
    pub stalls: u64,
    /// Backoff sleeps.
    pub backoffs: u64,
    /// The last resourceVersion of a synced stream.
    pub last_rv: u64,
    /// The current stream's initial state is complete (cleared by a restart).
    pub synced: bool,
}

impl ProtoStats {
    pub fn snapshot(&self) -> ProtoStatsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProtoStatsSnapshot {
            watch_starts: get(&self.watch_starts),
            initial_watches: get(&self.initial_watches),
            restarts: get(&self.restarts),
            frames: get(&self.frames),
            bytes: get(&self.bytes),
            objects: get(&self.objects),
            bookmarks: get(&self.bookmarks),
            errors: get(&self.errors),
            clean_ends: get(&self.clean_ends),
            stalls: get(&self.stalls),
            backoffs: get(&self.backoffs),
            last_rv: get(&self.last_rv),
            synced: self.synced.load(Ordering::Relaxed),
        }
    }

    pub(super) fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
