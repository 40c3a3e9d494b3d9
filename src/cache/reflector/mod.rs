//! The upstream reflector: ONE paged LIST, then ONE long-running WATCH, per cached resource,
//! delivering everything it learns to a [`ReflectorSink`](crate::cache::ReflectorSink) in
//! resourceVersion order.
//!
//! The reflector is an explicit state machine ([`State`]); `Reflector::step` is one `match`
//! that performs the I/O of the current state, then asks a pure function ([`after_list_error`],
//! [`after_watch`]) for the next state. It follows client-go's `tools/cache/reflector.go` where
//! that is right for a proxy, and deviates where a proxy that is the *only* client of a resource
//! can do better:
//!
//! ```text
//! state       outcome                                                next
//! List        all pages in; sink.replace(items, rv)                 Watch{rv}
//! List        410 on a continue page (snapshot compacted)           List{unpaged}, no delay
//! List        any other error                                       Backoff -> List
//! Watch{rv}   ended cleanly (after >= 1 s or >= 1 event), stalled   Watch{last rv}, no delay
//! Watch{rv}   410 Expired/Gone (HTTP status or ERROR event)         Backoff -> List
//! Watch{rv}   "Too large resource version", the 3rd in a row        Backoff -> List
//! Watch{rv}   anything else: connection lost, 5xx, 429, ERROR
//!             event, undecodable data, very short empty watch       Backoff -> Watch{last rv}
//! Backoff     delay elapsed                                         its next state
//! any         shutdown token cancelled                              Stopped
//! ```
//!
//! - Relists happen only for 410 Expired/Gone (the watch cannot resume), for a resourceVersion
//!   the apiserver keeps refusing as too large, and when a list attempt itself failed. Every
//!   other watch failure resumes from the last resourceVersion seen (an event or a BOOKMARK),
//!   which costs the apiserver nothing but a new watcher. client-go relists on most watch
//!   errors; a proxy serving hundreds of informers must not.
//! - The backoff is client-go's `NewExponentialBackoffManager(800ms, 30s, 2min, 2.0, 1.0)`
//!   (see [`Backoff`]).
//! - Silent-stall detection: with `allowWatchBookmarks=true` the apiserver sends a BOOKMARK
//!   about every minute even on a quiet resource, so nothing for
//!   [`ReflectorConfig::stall_timeout`] means the connection is dead without having told us.
//!
//! # Sink contract
//! Calls never overlap (one task), and arrive in order: `replace` (a whole consistent list),
//! then `apply`/`bookmark` with increasing resourceVersions, then possibly `replace` again
//! (a relist; its resourceVersion is normally newer, but after an etcd restore it may be
//! older). `set_unhealthy(Some(..))` is reported while listing, backing off, or after a broken
//! watch; `set_unhealthy(None)` once a watch is established after a sync and has delivered an
//! event or bookmark, or gone `task::WATCH_HEALTHY_GRACE` without an
//! ERROR event. Identical consecutive health reports are not repeated. The sink runs on the
//! reflector's task: a slow sink delays reading the watch (backpressure), so its methods must
//! not block.
//!
//! # Files
//! [`state`] (the states and the pure transitions), [`task`] (the task that runs them),
//! [`list`] (list pages and the pager), [`watch`] (watch stream lines and events),
//! [`backoff`], [`error`] (`Status` and the reflector's errors), [`stats`] (relist reasons,
//! counters, status), [`config`]; [`proto`], the second, protobuf watch of a built-in resource
//! whose objects' exact bytes a sink attaches to the JSON side's.

pub mod backfill;
pub mod backoff;
pub mod config;
pub mod error;
pub mod list;
pub mod proto;
pub mod state;
pub mod stats;
pub mod table;
pub mod task;
pub mod watch;

pub use backoff::Backoff;
pub use config::ReflectorConfig;
pub use error::{ApiStatus, ReflectorError};
pub use list::{ListPage, parse_list_page};
pub use state::{Next, State, WatchEnd, WatchOutcome, after_list_error, after_watch};
pub use stats::{ReflectorStats, ReflectorStatus, RelistReason, StatsSnapshot};
pub use task::{Reflector, ReflectorHandle};
pub use watch::{WatchItem, parse_event_line};

/// The attributes of a span of the cache's own upstream request.
fn span_attrs(resource: &crate::k8s::resource::Resource, pq: &str) -> Vec<crate::telemetry::Attr> {
    use crate::telemetry::Attr;
    vec![
        Attr::new("http.request.method", "GET"),
        Attr::new("http.target", pq.to_string()),
        Attr::new("kcp.resource", resource.label()),
    ]
}
