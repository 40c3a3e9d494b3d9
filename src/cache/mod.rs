//! The watch cache: per-resource store, event history, the upstream reflector's sink.
//!
//! Layout: [`object`] (an object's bytes + parsed metadata), [`store`] (current state,
//! history window, readiness), [`hub`] fans events out, [`reflector`] feeds the store from the apiserver, [`discovery`] (which
//! resources to cache: configuration, discovery, CRDs), [`registry`] (the caches and
//! reflectors of those resources, added and removed as CRDs come and go), [`persist`] (their
//! state saved at shutdown and loaded at start: warm restart), [`proto_budget`] (the bound on
//! the protobuf representation).

pub mod event;
pub mod hub;
pub mod object;
pub mod persist;
pub mod proto_budget;
pub mod reflector;
pub mod relist;
pub mod table;

pub use crate::k8s::Resource;
pub use object::{CachedObject, ObjectKey};

/// What an upstream watch event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Added,
    Modified,
    Deleted,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Added => "ADDED",
            EventKind::Modified => "MODIFIED",
            EventKind::Deleted => "DELETED",
        }
    }
}

/// Where a reflector delivers what it learns from the apiserver, in order.
///
/// Calls for one resource never overlap and arrive in resourceVersion order.
pub trait ReflectorSink: Send + Sync + 'static {
    /// A complete, consistent list at `rv`, replacing everything held before (initial sync
    /// and every relist, e.g. after 410 Gone). The implementation decides how downstream
    /// watchers learn about it.
    fn replace(&self, items: Vec<CachedObject>, rv: u64);
    /// One watch event. `object` is the new state (for `Deleted`, the last state).
    fn apply(&self, kind: EventKind, object: CachedObject);
    /// Progress confirmed by the apiserver up to `rv` (a BOOKMARK, or the RV of a list).
    fn bookmark(&self, rv: u64);
    /// A JSON BOOKMARK object's bytes after its metadata, as the apiserver wrote them
    /// ([`event::json_bookmark_rest`]: the kind's empty fields, such as a Pod's
    /// `,"spec":{"containers":null},"status":{}`), for the bookmarks the cache writes.
    fn json_bookmark(&self, _rest: bytes::Bytes) {}
    /// The upstream watch is down or unconfirmed: `Some(reason)`; healthy again: `None`.
    /// Used for readiness and consistent-read gating.
    fn set_unhealthy(&self, reason: Option<String>);
}

pub mod discovery;
pub mod metrics;
pub mod registry;
pub mod store;

pub use store::{ListStats, Readiness, ResourceCache, Side, Start, StoreConfig, WatchError};
