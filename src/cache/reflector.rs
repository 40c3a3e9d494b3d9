//! The upstream reflector: ONE paged LIST, then ONE long-running WATCH, per cached resource,
//! delivering everything it learns to a [`ReflectorSink`] in resourceVersion order.
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
//! event or bookmark, or gone [`WATCH_HEALTHY_GRACE`] without an ERROR event. Identical
//! consecutive health reports are not repeated. The sink runs on the reflector's task: a slow
//! sink delays reading the watch (backpressure), so its methods must not block.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::BodyExt as _;
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use serde::Deserialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, info, warn};

use crate::cache::object::ObjectError;
use crate::cache::{CachedObject, EventKind, ReflectorSink, Resource};
use crate::http::body::{self, BoxError};
use crate::k8s::scan::{Scalar, ScanError, Scanner};
use crate::upstream::{As, Upstream};

/// A watch event line longer than this is refused (the stream is then treated as broken).
/// etcd refuses objects above 1.5 MiB by default (`--max-request-bytes`); 16 MiB leaves room
/// for raised limits while keeping the line buffer bounded.
const MAX_EVENT_LINE: usize = 16 << 20;

/// How much of an error response body is read to build its Status.
const MAX_ERROR_BODY: usize = 64 << 10;

/// A watch that ends cleanly this soon without any event is treated as an error (backoff),
/// as client-go's `watchHandler` does ("very short watch"), so a server that closes every
/// watch at once cannot make the reflector spin.
const MIN_WATCH_LIFETIME: Duration = Duration::from_secs(1);

/// After this many consecutive "Too large resource version" answers to a watch, relist instead
/// of resuming: the apiserver has already waited (3 s in the cacher) for our resourceVersion
/// each time, so it is probably not coming (e.g. etcd was restored from a backup).
const TOO_LARGE_RELIST_AFTER: u32 = 3;

/// Upper bound on the capacity reserved from a list's `remainingItemCount`.
const MAX_RESERVE: usize = 1 << 20;

/// Tunables of one reflector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReflectorConfig {
    /// Items per LIST page (`limit`). client-go's pager default is 500.
    pub page_size: u32,
    /// When set, the adaptive page size ([`crate::paging`]), read for every page, instead of
    /// `page_size`.
    pub adaptive_page_size: Option<crate::paging::SharedPageSize>,
    /// With no event and no BOOKMARK for this long, the watch is dropped and re-established
    /// from the last resourceVersion. The apiserver sends a BOOKMARK about every minute to
    /// watches with `allowWatchBookmarks=true` (the cacher's bookmark frequency), so 3 minutes
    /// is two missed bookmarks plus slack; a false positive costs one cheap re-watch. It bounds
    /// how long a silently dead connection goes unnoticed: the HTTP/1.1 watch connection has no
    /// pings, and TCP keepalive alone takes ~11 minutes on Linux defaults.
    pub stall_timeout: Duration,
    /// The minimum `timeoutSeconds` sent with a watch; each watch uses a random value in
    /// `[watch_timeout, 2 * watch_timeout)` as client-go does (5 min → 5–10 min), so watches
    /// of many resources do not all end and restart together.
    pub watch_timeout: Duration,
    /// First backoff delay (client-go's reflector: 800 ms).
    pub backoff_initial: Duration,
    /// Backoff cap before jitter (client-go's reflector: 30 s; with jitter up to 60 s).
    pub backoff_max: Duration,
    /// A backoff that has not been needed for this long starts again from
    /// `backoff_initial` (client-go's reflector: 2 min).
    pub backoff_reset_after: Duration,
    /// Bound on one LIST page (request and body) and on waiting for a watch's response
    /// headers. kube-apiserver's own `--request-timeout` default is 1 minute.
    pub request_timeout: Duration,
}

impl ReflectorConfig {
    /// The `limit` of the next LIST page.
    pub fn current_page_size(&self) -> u32 {
        self.adaptive_page_size
            .as_ref()
            .map_or(self.page_size, |s| s.get())
            .max(1)
    }
}

impl Default for ReflectorConfig {
    fn default() -> Self {
        ReflectorConfig {
            page_size: 500,
            adaptive_page_size: None,
            stall_timeout: Duration::from_secs(180),
            watch_timeout: Duration::from_secs(300),
            backoff_initial: Duration::from_millis(800),
            backoff_max: Duration::from_secs(30),
            backoff_reset_after: Duration::from_secs(120),
            request_timeout: Duration::from_secs(60),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// A Kubernetes `Status` error, from an HTTP error response or a watch ERROR event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiStatus {
    pub code: u16,
    pub reason: String,
    pub message: String,
    /// `details.causes`: (reason, message).
    pub causes: Vec<(String, String)>,
    /// `details.retryAfterSeconds` or the `Retry-After` header.
    pub retry_after: Option<Duration>,
}

impl fmt::Display for ApiStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.code, self.reason, self.message)
    }
}

impl ApiStatus {
    /// client-go's `isExpiredError`: reason Expired or Gone (a bare 410 is Gone).
    pub fn is_expired(&self) -> bool {
        self.code == 410 || self.reason == "Expired" || self.reason == "Gone"
    }

    /// client-go's `isTooLargeResourceVersionError`: the `ResourceVersionTooLarge` cause, or
    /// (apiservers before 1.18.6) a Timeout whose message says so.
    pub fn is_too_large_resource_version(&self) -> bool {
        const MSG: &str = "Too large resource version";
        if self
            .causes
            .iter()
            .any(|(r, _)| r == "ResourceVersionTooLarge")
        {
            return true;
        }
        (self.code == 504 || self.reason == "Timeout")
            && (self.causes.iter().any(|(_, m)| m == MSG) || self.message.contains(MSG))
    }

    /// Parses a `Status` body; an unparseable body becomes the message.
    fn parse(code: u16, body: &[u8], retry_after: Option<Duration>) -> ApiStatus {
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Wire {
            code: u16,
            reason: String,
            message: String,
            details: Option<Details>,
        }
        #[derive(Deserialize, Default)]
        #[serde(default, rename_all = "camelCase")]
        struct Details {
            causes: Vec<Cause>,
            retry_after_seconds: Option<u64>,
        }
        #[derive(Deserialize, Default)]
        #[serde(default)]
        struct Cause {
            reason: String,
            message: String,
        }
        match serde_json::from_slice::<Wire>(body) {
            Ok(w) => {
                let details = w.details.unwrap_or_default();
                ApiStatus {
                    code: if code != 0 { code } else { w.code },
                    reason: w.reason,
                    message: w.message,
                    causes: details
                        .causes
                        .into_iter()
                        .map(|c| (c.reason, c.message))
                        .collect(),
                    retry_after: details
                        .retry_after_seconds
                        .map(Duration::from_secs)
                        .or(retry_after),
                }
            }
            Err(_) => ApiStatus {
                code,
                reason: StatusCode::from_u16(code)
                    .ok()
                    .and_then(|c| c.canonical_reason())
                    .unwrap_or_default()
                    .to_string(),
                message: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
                causes: Vec::new(),
                retry_after,
            },
        }
    }
}

/// Why a list or watch attempt failed. All of them come from upstream; whether a retry helps
/// and how (resume or relist) is decided by [`after_list_error`] and [`after_watch`].
#[derive(Debug, thiserror::Error)]
pub enum ReflectorError {
    #[error("{what}: sending request: {source}")]
    Transport {
        what: &'static str,
        #[source]
        source: BoxError,
    },
    #[error("{what}: no response within {timeout:?}")]
    Timeout {
        what: &'static str,
        timeout: Duration,
    },
    #[error("{what}: apiserver answered {status}")]
    Status {
        what: &'static str,
        status: ApiStatus,
    },
    #[error("{what}: reading response body: {source}")]
    Body {
        what: &'static str,
        #[source]
        source: BoxError,
    },
    #[error("{what}: decoding: {source}")]
    Decode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error("{what}: decoding: {source}")]
    Scan {
        what: &'static str,
        #[source]
        source: ScanError,
    },
    #[error("{what}: object: {source}")]
    Object {
        what: &'static str,
        #[source]
        source: ObjectError,
    },
    #[error("{what}: invalid resourceVersion {rv:?}")]
    BadResourceVersion { what: &'static str, rv: String },
    #[error("watch: unknown event type {0:?}")]
    UnknownEventType(String),
    #[error("watch: event line longer than {} bytes", MAX_EVENT_LINE)]
    LineTooLong,
    #[error("watch: stream ended in the middle of an event line")]
    TruncatedLine,
}

impl ReflectorError {
    fn status(&self) -> Option<&ApiStatus> {
        match self {
            ReflectorError::Status { status, .. } => Some(status),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Observability
// ---------------------------------------------------------------------------------------------

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

    fn index(self) -> usize {
        self as usize
    }
}

/// Counters the metrics layer reads (monotonic, relaxed atomics; read with [`Self::snapshot`]).
#[derive(Debug, Default)]
pub struct ReflectorStats {
    lists: [AtomicU64; RelistReason::ALL.len()],
    list_pages: AtomicU64,
    list_errors: AtomicU64,
    syncs: AtomicU64,
    watch_starts: AtomicU64,
    watches_established: AtomicU64,
    watch_errors: AtomicU64,
    watch_clean_ends: AtomicU64,
    events: AtomicU64,
    bookmarks: AtomicU64,
    stalls: AtomicU64,
    backoffs: AtomicU64,
    last_rv: AtomicU64,
}

/// A point-in-time copy of [`ReflectorStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// LIST attempts by reason, in [`RelistReason::ALL`] order.
    pub lists: [u64; RelistReason::ALL.len()],
    /// LIST page requests sent.
    pub list_pages: u64,
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
    /// Watches dropped for silence ([`ReflectorConfig::stall_timeout`]).
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
            list_errors: get(&self.list_errors),
            syncs: get(&self.syncs),
            watch_starts: get(&self.watch_starts),
            watches_established: get(&self.watches_established),
            watch_errors: get(&self.watch_errors),
            watch_clean_ends: get(&self.watch_clean_ends),
            events: get(&self.events),
            bookmarks: get(&self.bookmarks),
            stalls: get(&self.stalls),
            backoffs: get(&self.backoffs),
            last_rv: get(&self.last_rv),
        }
    }

    fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
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

// ---------------------------------------------------------------------------------------------
// Backoff
// ---------------------------------------------------------------------------------------------

/// client-go's `exponentialBackoffManagerImpl` (k8s.io/apimachinery `wait/backoff.go`) with
/// the reflector's parameters: each call returns the current step jittered into
/// `[d, 2d)` (`wait.Jitter(d, 1.0)` = `d + rand[0,1) * d`), then doubles the step, capped at
/// `max` *before* jitter (so sleeps reach up to `2 * max`). If the previous backoff *started*
/// more than `reset_after` ago, the step starts again from `initial`: a watch that has been
/// healthy that long gets the short delay again.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    reset_after: Duration,
    step: Duration,
    last_start: Option<Instant>,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration, reset_after: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            reset_after,
            step: initial.min(max),
            last_start: None,
        }
    }

    /// The next delay at `now`, with `unit` a random number in `[0, 1)`.
    pub fn next_delay(&mut self, now: Instant, unit: f64) -> Duration {
        if self
            .last_start
            .is_some_and(|t| now.saturating_duration_since(t) > self.reset_after)
        {
            self.step = self.initial.min(self.max);
        }
        self.last_start = Some(now);
        let d = self.step;
        self.step = self.step.saturating_mul(2).min(self.max);
        jitter(d, unit)
    }
}

/// `d + unit * d` with `unit` clamped into `[0, 1)`: client-go's `wait.Jitter(d, 1.0)`.
fn jitter(d: Duration, unit: f64) -> Duration {
    let unit = if unit.is_finite() {
        unit.clamp(0.0, 1.0)
    } else {
        0.0
    };
    d + d.mul_f64(unit)
}

/// A random number in `[0, 1)`, good enough for jitter (no `rand` dependency): std's
/// `RandomState` is randomly keyed per process and per instance.
fn random_unit() -> f64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

// ---------------------------------------------------------------------------------------------
// The state machine
// ---------------------------------------------------------------------------------------------

/// The reflector's state. [`Reflector::step`] runs one state and returns the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Listing the whole collection into a side buffer, then one `sink.replace`.
    ///
    /// Entered at start ([`RelistReason::Initial`]), after a backoff whose next step is a list
    /// (410 on the watch, repeated too-large resourceVersion, a failed list), and directly after
    /// a 410 on a continue page (then `paged: false`: one unpaged request cannot hit an expired
    /// snapshot, as client-go's pager falls back to a full list). Left for `Watch` from the
    /// list's resourceVersion once delivered, for `Backoff` on any error.
    List { reason: RelistReason, paged: bool },
    /// Watching from `rv` (events after `rv`).
    ///
    /// Entered after a list, after a clean stream end or a stall (from the last resourceVersion
    /// seen, no backoff), and after a backoff whose next step is a watch. Left when the stream
    /// ends: cleanly or stalled → `Watch` again; 410 → `Backoff` then `List`; anything else →
    /// `Backoff` then `Watch` from the last resourceVersion. `too_large` counts consecutive
    /// "Too large resource version" answers.
    Watch { rv: u64, too_large: u32 },
    /// Sleeping `after` before `next`. Entered after any error; left when the time is up.
    Backoff {
        next: Next,
        after: Duration,
        /// The error that led here, for status and health reports.
        cause: String,
    },
    /// Cancelled by the shutdown token. Entered from any state; never left.
    Stopped,
}

/// What a backoff leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    List { reason: RelistReason },
    Watch { rv: u64, too_large: u32 },
}

impl From<Next> for State {
    fn from(n: Next) -> State {
        match n {
            Next::List { reason } => State::List {
                reason,
                paged: true,
            },
            Next::Watch { rv, too_large } => State::Watch { rv, too_large },
        }
    }
}

impl State {
    fn name(&self) -> &'static str {
        match self {
            State::List { .. } => "list",
            State::Watch { .. } => "watch",
            State::Backoff { .. } => "backoff",
            State::Stopped => "stopped",
        }
    }
}

/// How a watch ended.
#[derive(Debug)]
pub enum WatchEnd {
    /// The request failed before any stream: transport error or an error status.
    Refused(ReflectorError),
    /// The server ended the stream cleanly (timeoutSeconds, apiserver shutdown).
    Closed,
    /// The stream broke: connection lost, or data that cannot be decoded.
    Broken(ReflectorError),
    /// An ERROR event carrying a Status.
    ErrorEvent(ApiStatus),
    /// No event or bookmark within the stall timeout.
    Stalled,
}

/// What one watch attempt did, for [`after_watch`].
#[derive(Debug)]
pub struct WatchOutcome {
    /// The resourceVersion the watch started from.
    pub from: u64,
    /// The last resourceVersion delivered (events and bookmarks); `from` if none.
    pub last_rv: u64,
    /// Events and bookmarks delivered.
    pub delivered: u64,
    /// From sending the request to the end.
    pub lived: Duration,
    pub end: WatchEnd,
}

/// The state after a failed list attempt. Pure.
///
/// A 410 on a continue page restarts at once, unpaged; anything else backs off and lists again
/// (the list is a consistent read from scratch, nothing to resume).
pub fn after_list_error(
    err: &ReflectorError,
    on_continue: bool,
    backoff: &mut Backoff,
    now: Instant,
    unit: f64,
) -> State {
    if on_continue && err.status().is_some_and(ApiStatus::is_expired) {
        return State::List {
            reason: RelistReason::ContinueExpired,
            paged: false,
        };
    }
    let after = delay_for(err.status(), backoff, now, unit);
    State::Backoff {
        next: Next::List {
            reason: RelistReason::Retry,
        },
        after,
        cause: err.to_string(),
    }
}

/// The state after a watch ended. Pure.
pub fn after_watch(
    out: &WatchOutcome,
    too_large: u32,
    backoff: &mut Backoff,
    now: Instant,
    unit: f64,
) -> State {
    let rv = out.last_rv;
    // Progress resets the count: the apiserver did reach our resourceVersion.
    let too_large = if out.delivered > 0 { 0 } else { too_large };
    let resume = Next::Watch { rv, too_large: 0 };
    let status = match &out.end {
        WatchEnd::Closed if out.delivered == 0 && out.lived < MIN_WATCH_LIFETIME => {
            return State::Backoff {
                next: resume,
                after: backoff.next_delay(now, unit),
                cause: format!(
                    "very short watch: ended after {:?} with no events",
                    out.lived
                ),
            };
        }
        WatchEnd::Closed | WatchEnd::Stalled => return resume.into(),
        WatchEnd::Broken(e) => {
            return State::Backoff {
                next: resume,
                after: backoff.next_delay(now, unit),
                cause: e.to_string(),
            };
        }
        WatchEnd::Refused(e) => match e.status() {
            Some(s) => s.clone(),
            None => {
                return State::Backoff {
                    next: resume,
                    after: backoff.next_delay(now, unit),
                    cause: e.to_string(),
                };
            }
        },
        WatchEnd::ErrorEvent(s) => s.clone(),
    };
    if status.is_expired() {
        // 410 is not a sign of overload but of a history gap: every moment spent backing off
        // is a moment the cache serves state it knows to be behind, so relist at once (a
        // failing LIST still backs off). client-go backs off here; it is one of thousands of
        // clients, the proxy is the only one.
        return Next::List {
            reason: RelistReason::Expired,
        }
        .into();
    }
    let after = delay_for(Some(&status), backoff, now, unit);
    let cause = format!("watch from resourceVersion {rv}: {status}");
    let next = if status.is_expired() {
        Next::List {
            reason: RelistReason::Expired,
        }
    } else if status.is_too_large_resource_version() {
        if too_large + 1 >= TOO_LARGE_RELIST_AFTER {
            Next::List {
                reason: RelistReason::TooLargeResourceVersion,
            }
        } else {
            Next::Watch {
                rv,
                too_large: too_large + 1,
            }
        }
    } else {
        resume
    };
    State::Backoff { next, after, cause }
}

/// The backoff delay, at least what the server asked for with Retry-After (429, 504).
fn delay_for(
    status: Option<&ApiStatus>,
    backoff: &mut Backoff,
    now: Instant,
    unit: f64,
) -> Duration {
    let d = backoff.next_delay(now, unit);
    match status.and_then(|s| s.retry_after) {
        Some(ra) => d.max(ra),
        None => d,
    }
}

// ---------------------------------------------------------------------------------------------
// Wire parsing (pure)
// ---------------------------------------------------------------------------------------------

/// One LIST page.
#[derive(Debug)]
pub struct ListPage {
    pub items: Vec<CachedObject>,
    pub rv: u64,
    /// `metadata.continue`, when more pages follow.
    pub cont: Option<String>,
    pub remaining: Option<u64>,
}

/// Parses a LIST response page in one pass, without building a generic JSON value: the
/// envelope's metadata is read and each item is parsed where it lies
/// ([`CachedObject::scan`]).
///
/// Items are copied out of the page: a slice would keep the whole page buffer alive for as
/// long as any one of its objects stays unmodified in the cache.
pub fn parse_list_page(body: &[u8], resource: &Resource) -> Result<ListPage, ReflectorError> {
    const WHAT: &str = "list";
    let mut s = Scanner::new(body);
    let mut rv_s: Option<String> = None;
    let mut has_meta = false;
    let mut cont = None;
    let mut remaining = None;
    let mut items = Vec::new();
    let mut item_err = None;
    let scanned = s
        .object(|s, k| match &*k {
            "metadata" => {
                has_meta = true;
                s.object(|s, k| {
                    match &*k {
                        "resourceVersion" => {
                            rv_s = s.opt_string()?.map(|v| v.into_owned());
                        }
                        "continue" => cont = s.opt_string()?.map(|v| v.into_owned()),
                        "remainingItemCount" => {
                            let at = s.pos();
                            remaining = match s.scalar()? {
                                Scalar::Null => None,
                                Scalar::Num(n) => {
                                    Some(n.parse::<u64>().map_err(|_| ScanError::Type {
                                        at,
                                        want: "an unsigned integer",
                                    })?)
                                }
                                _ => {
                                    return Err(ScanError::Type {
                                        at,
                                        want: "an unsigned integer",
                                    });
                                }
                            };
                        }
                        _ => s.skip()?,
                    }
                    Ok(())
                })
            }
            "items" => s.array(|s, _| match CachedObject::scan(s, body, resource) {
                Ok(o) => {
                    items.push(o);
                    Ok(())
                }
                Err(e) => {
                    let at = s.pos();
                    item_err = Some(e);
                    Err(ScanError::Syntax(at))
                }
            }),
            _ => s.skip(),
        })
        .and_then(|()| s.end());
    if let Some(source) = item_err {
        return Err(ReflectorError::Object { what: WHAT, source });
    }
    scanned.map_err(|source| ReflectorError::Scan { what: WHAT, source })?;
    if !has_meta {
        return Err(ReflectorError::BadResourceVersion {
            what: WHAT,
            rv: String::new(),
        });
    }
    let rv_s = rv_s.unwrap_or_default();
    let rv = rv_s
        .parse::<u64>()
        .map_err(|_| ReflectorError::BadResourceVersion {
            what: WHAT,
            rv: rv_s.clone(),
        })?;
    Ok(ListPage {
        items,
        rv,
        cont: cont.filter(|c| !c.is_empty()),
        remaining,
    })
}

/// One decoded watch event line.
#[derive(Debug)]
pub enum WatchItem {
    Object(EventKind, CachedObject),
    Bookmark(u64),
    Error(ApiStatus),
}

/// Decodes one watch line `{"type":..,"object":..}` in one pass, without a generic JSON
/// value: with `type` first (as the apiserver writes it) the object is parsed where it lies
/// and copied once into its own allocation (without kind/apiVersion).
pub fn parse_event_line(line: &Bytes, resource: &Resource) -> Result<WatchItem, ReflectorError> {
    const WHAT: &str = "watch event";
    let kind_of = |t: &str| match t {
        "ADDED" => Some(EventKind::Added),
        "MODIFIED" => Some(EventKind::Modified),
        "DELETED" => Some(EventKind::Deleted),
        _ => None,
    };
    let mut s = Scanner::new(line);
    let mut typ: Option<String> = None;
    let mut obj = None;
    let mut span = None;
    let mut obj_err = None;
    let scanned = s
        .object(|s, k| match &*k {
            "type" => {
                typ = s.opt_string()?.map(|t| t.into_owned());
                Ok(())
            }
            "object" => {
                if typ.as_deref().and_then(kind_of).is_some() {
                    match CachedObject::scan(s, line, resource) {
                        Ok(o) => obj = Some(o),
                        Err(e) => {
                            let at = s.pos();
                            obj_err = Some(e);
                            return Err(ScanError::Syntax(at));
                        }
                    }
                } else {
                    s.peek()?;
                    let start = s.pos();
                    s.skip()?;
                    span = Some(start..s.pos());
                }
                Ok(())
            }
            _ => s.skip(),
        })
        .and_then(|()| s.end());
    if let Some(source) = obj_err {
        return Err(ReflectorError::Object { what: WHAT, source });
    }
    scanned.map_err(|source| ReflectorError::Scan { what: WHAT, source })?;
    let Some(typ) = typ else {
        return Err(ReflectorError::UnknownEventType(String::new()));
    };
    if let Some(kind) = kind_of(&typ) {
        let obj = match (obj, span) {
            (Some(o), _) => o,
            // `object` before `type`.
            (None, Some(span)) => {
                let raw = &line[span];
                CachedObject::scan(&mut Scanner::new(raw), raw, resource)
                    .map_err(|source| ReflectorError::Object { what: WHAT, source })?
            }
            (None, None) => {
                return Err(ReflectorError::Scan {
                    what: WHAT,
                    source: ScanError::Eof,
                });
            }
        };
        return Ok(WatchItem::Object(kind, obj));
    }
    let raw = span.map(|r| &line[r]).unwrap_or(b"{}");
    match &*typ {
        "BOOKMARK" => {
            #[derive(Deserialize)]
            struct Rv<'a> {
                #[serde(borrow, default)]
                metadata: Option<RvMeta<'a>>,
            }
            #[derive(Deserialize)]
            #[serde(rename_all = "camelCase")]
            struct RvMeta<'a> {
                #[serde(borrow, default)]
                resource_version: Option<std::borrow::Cow<'a, str>>,
            }
            let r: Rv<'_> = serde_json::from_slice(raw)
                .map_err(|source| ReflectorError::Decode { what: WHAT, source })?;
            let s = r
                .metadata
                .and_then(|m| m.resource_version)
                .unwrap_or_default();
            let rv = s
                .parse::<u64>()
                .map_err(|_| ReflectorError::BadResourceVersion {
                    what: "bookmark",
                    rv: s.to_string(),
                })?;
            Ok(WatchItem::Bookmark(rv))
        }
        "ERROR" => Ok(WatchItem::Error(ApiStatus::parse(0, raw, None))),
        other => Err(ReflectorError::UnknownEventType(other.to_string())),
    }
}

/// Splits a chunked byte stream into newline-terminated lines, with a bounded carry-over.
#[derive(Debug, Default)]
struct LineSplitter {
    partial: Vec<u8>,
}

impl LineSplitter {
    /// Appends the complete lines in `chunk` (without their `\n`) to `out`. A line within one
    /// chunk is a zero-copy slice of it; a line spanning chunks is assembled in a fresh buffer.
    fn push(&mut self, mut chunk: Bytes, out: &mut Vec<Bytes>) -> Result<(), ReflectorError> {
        while let Some(pos) = chunk.iter().position(|b| *b == b'\n') {
            let head = chunk.split_to(pos + 1);
            let line = if self.partial.is_empty() {
                head.slice(..pos)
            } else {
                self.extend(&head[..pos])?;
                Bytes::from(std::mem::take(&mut self.partial))
            };
            out.push(line);
        }
        if !chunk.is_empty() {
            self.extend(&chunk)?;
        }
        Ok(())
    }

    fn extend(&mut self, data: &[u8]) -> Result<(), ReflectorError> {
        if self.partial.len() + data.len() > MAX_EVENT_LINE {
            self.partial = Vec::new();
            return Err(ReflectorError::LineTooLong);
        }
        self.partial.extend_from_slice(data);
        Ok(())
    }

    /// Whether a partial line (not just whitespace) is pending.
    fn has_partial(&self) -> bool {
        self.partial.iter().any(|b| !b.is_ascii_whitespace())
    }
}

// ---------------------------------------------------------------------------------------------
// The reflector task
// ---------------------------------------------------------------------------------------------

/// One resource's LIST+WATCH loop. Created and started by [`Reflector::spawn`].
pub struct Reflector {
    resource: Resource,
    upstream: Upstream,
    sink: Arc<dyn ReflectorSink>,
    cfg: ReflectorConfig,
    backoff: Backoff,
    stats: Arc<ReflectorStats>,
    status: watch::Sender<ReflectorStatus>,
    /// The last health report given to the sink (`None`: none yet).
    reported: Option<Option<String>>,
    /// The resourceVersion of the list just delivered, until the watch that follows it.
    listed_rv: Option<u64>,
}

/// Controls a spawned reflector.
pub struct ReflectorHandle {
    task: JoinHandle<()>,
    status: watch::Receiver<ReflectorStatus>,
    stats: Arc<ReflectorStats>,
}

impl ReflectorHandle {
    /// Status changes (list / watch / backoff / stopped).
    pub fn status(&self) -> watch::Receiver<ReflectorStatus> {
        self.status.clone()
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<ReflectorStats> {
        &self.stats
    }

    /// Stops the task at its next await point without the final `set_unhealthy` report;
    /// prefer cancelling the shutdown token.
    pub fn abort(&self) {
        self.task.abort();
    }

    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits for the task to end (after the shutdown token is cancelled, or `abort`).
    ///
    /// # Errors
    /// If the task panicked or was aborted.
    pub async fn join(self) -> Result<(), tokio::task::JoinError> {
        self.task.await
    }
}

impl Reflector {
    /// Starts the reflector for `resource` on the current tokio runtime. It runs until
    /// `shutdown` is cancelled; then it reports `set_unhealthy(Some("reflector stopped"))` and
    /// ends.
    pub fn spawn(
        resource: Resource,
        upstream: Upstream,
        sink: Arc<dyn ReflectorSink>,
        cfg: ReflectorConfig,
        shutdown: CancellationToken,
    ) -> ReflectorHandle {
        let label = resource.label();
        let initial = RelistReason::Initial;
        let (status_tx, status_rx) = watch::channel(ReflectorStatus::Listing { reason: initial });
        let stats = Arc::new(ReflectorStats::default());
        let r = Reflector {
            backoff: Backoff::new(
                cfg.backoff_initial,
                cfg.backoff_max,
                cfg.backoff_reset_after,
            ),
            resource,
            upstream,
            sink,
            cfg,
            stats: stats.clone(),
            status: status_tx,
            reported: None,
            listed_rv: None,
        };
        let span = tracing::info_span!("reflector", resource = %label);
        let task = tokio::spawn(r.run(shutdown).instrument(span));
        ReflectorHandle {
            task,
            status: status_rx,
            stats,
        }
    }

    async fn run(mut self, shutdown: CancellationToken) {
        let mut state = State::List {
            reason: RelistReason::Initial,
            paged: true,
        };
        info!("reflector starting");
        while state != State::Stopped {
            debug!(state = state.name(), detail = ?state, "reflector state");
            state = tokio::select! {
                biased;
                _ = shutdown.cancelled() => State::Stopped,
                next = self.step(state) => next,
            };
        }
        info!("reflector stopped");
        self.report_health(Some("reflector stopped".into()));
        self.status.send_replace(ReflectorStatus::Stopped);
    }

    /// Runs `state` (its I/O and sink calls) and returns the next state.
    async fn step(&mut self, state: State) -> State {
        match state {
            State::List { reason, paged } => {
                ReflectorStats::inc(&self.stats.lists[reason.index()]);
                self.status
                    .send_replace(ReflectorStatus::Listing { reason });
                self.report_health(Some(format!("listing ({})", reason.as_str())));
                match self.list(paged).await {
                    Ok((items, rv)) => {
                        debug!(items = items.len(), rv, "list complete");
                        self.sink.replace(items, rv);
                        self.listed_rv = Some(rv);
                        ReflectorStats::inc(&self.stats.syncs);
                        self.stats.last_rv.store(rv, Ordering::Relaxed);
                        State::Watch { rv, too_large: 0 }
                    }
                    Err((err, on_continue)) => {
                        ReflectorStats::inc(&self.stats.list_errors);
                        warn!(error = %err, reason = reason.as_str(), "list failed");
                        after_list_error(
                            &err,
                            on_continue,
                            &mut self.backoff,
                            Instant::now(),
                            random_unit(),
                        )
                    }
                }
            }
            State::Watch { rv, too_large } => {
                self.status.send_replace(ReflectorStatus::Watching { rv });
                let out = self.watch(rv).await;
                match &out.end {
                    WatchEnd::Closed => {
                        ReflectorStats::inc(&self.stats.watch_clean_ends);
                        debug!(from = rv, last_rv = out.last_rv, "watch ended cleanly");
                    }
                    WatchEnd::Stalled => {
                        ReflectorStats::inc(&self.stats.stalls);
                        warn!(
                            from = rv,
                            last_rv = out.last_rv,
                            timeout = ?self.cfg.stall_timeout,
                            "watch stalled: no event or bookmark, re-watching"
                        );
                        self.report_health(Some("watch stalled".into()));
                    }
                    WatchEnd::Refused(e) | WatchEnd::Broken(e) => {
                        ReflectorStats::inc(&self.stats.watch_errors);
                        warn!(from = rv, last_rv = out.last_rv, error = %e, "watch failed");
                    }
                    WatchEnd::ErrorEvent(s) => {
                        ReflectorStats::inc(&self.stats.watch_errors);
                        warn!(from = rv, last_rv = out.last_rv, status = %s, "watch ERROR event");
                    }
                }
                after_watch(
                    &out,
                    too_large,
                    &mut self.backoff,
                    Instant::now(),
                    random_unit(),
                )
            }
            State::Backoff { next, after, cause } => {
                ReflectorStats::inc(&self.stats.backoffs);
                self.status.send_replace(ReflectorStatus::BackingOff {
                    error: cause.clone(),
                    delay: after,
                });
                self.report_health(Some(cause));
                tokio::time::sleep(after).await;
                next.into()
            }
            State::Stopped => State::Stopped,
        }
    }

    /// Reports health to the sink unless it is the same as the last report.
    fn report_health(&mut self, reason: Option<String>) {
        if self.reported.as_ref() == Some(&reason) {
            return;
        }
        self.sink.set_unhealthy(reason.clone());
        self.reported = Some(reason);
    }

    /// Lists every page into a side buffer. On error, also says whether it happened on a
    /// continue page.
    async fn list(
        &mut self,
        paged: bool,
    ) -> Result<(Vec<CachedObject>, u64), (ReflectorError, bool)> {
        let path = self.resource.collection_path(None);
        let mut items: Vec<CachedObject> = Vec::new();
        let mut cont: Option<String> = None;
        loop {
            let on_continue = cont.is_some();
            // Read per page: an adaptive size follows the load even during a long list (the
            // apiserver accepts a different limit with each continue token).
            let limit = self.cfg.current_page_size();
            let pq = match (&cont, paged) {
                (Some(c), _) => format!(
                    "{path}?limit={limit}&continue={}",
                    utf8_percent_encode(c, NON_ALPHANUMERIC)
                ),
                (None, true) => format!("{path}?limit={limit}"),
                (None, false) => path.clone(),
            };
            ReflectorStats::inc(&self.stats.list_pages);
            let body = self.get_page(&pq).await.map_err(|e| (e, on_continue))?;
            let page = parse_list_page(&body, &self.resource).map_err(|e| (e, on_continue))?;
            drop(body);
            if let Some(rem) = page.remaining {
                items.reserve(usize::try_from(rem).unwrap_or(MAX_RESERVE).min(MAX_RESERVE));
            }
            items.extend(page.items);
            match page.cont {
                Some(c) if paged => cont = Some(c),
                _ => return Ok((items, page.rv)),
            }
        }
    }

    /// GETs one list page and returns its body.
    async fn get_page(&self, pq: &str) -> Result<Bytes, ReflectorError> {
        const WHAT: &str = "list";
        let req = Request::get(self.upstream.uri(pq))
            .header(header::ACCEPT, "application/json")
            .body(body::empty())
            .expect("a GET with a valid URI is a valid request");
        let fetch = async {
            let resp = self
                .upstream
                .send(req, As::Proxy, false)
                .await
                .map_err(|source| ReflectorError::Transport { what: WHAT, source })?;
            if !resp.status().is_success() {
                return Err(error_response(WHAT, resp).await);
            }
            resp.into_body()
                .collect()
                .await
                .map(|c| c.to_bytes())
                .map_err(|e| ReflectorError::Body {
                    what: WHAT,
                    source: e.into(),
                })
        };
        let timeout = self.cfg.request_timeout;
        tokio::time::timeout(timeout, fetch)
            .await
            .unwrap_or(Err(ReflectorError::Timeout {
                what: WHAT,
                timeout,
            }))
    }

    /// One watch from `from`: opens it, delivers its events, returns how it ended.
    async fn watch(&mut self, from: u64) -> WatchOutcome {
        let started = Instant::now();
        let mut out = WatchOutcome {
            from,
            last_rv: from,
            delivered: 0,
            lived: Duration::ZERO,
            end: WatchEnd::Closed,
        };
        // Only the first attempt after a list starts from state just read.
        let after_list = self.listed_rv.take() == Some(from);
        out.end = self.watch_inner(&mut out, after_list).await;
        out.lived = started.elapsed();
        out
    }

    async fn watch_inner(&mut self, out: &mut WatchOutcome, after_list: bool) -> WatchEnd {
        const WHAT: &str = "watch";
        let timeout_secs = jitter(self.cfg.watch_timeout, random_unit())
            .as_secs()
            .max(1);
        let pq = format!(
            "{}?watch=1&allowWatchBookmarks=true&resourceVersion={}&timeoutSeconds={timeout_secs}",
            self.resource.collection_path(None),
            out.from
        );
        let req = Request::get(self.upstream.uri(&pq))
            .header(header::ACCEPT, "application/json")
            .body(body::empty())
            .expect("a GET with a valid URI is a valid request");
        ReflectorStats::inc(&self.stats.watch_starts);
        let timeout = self.cfg.request_timeout;
        let resp =
            match tokio::time::timeout(timeout, self.upstream.send(req, As::Proxy, true)).await {
                Err(_) => {
                    return WatchEnd::Refused(ReflectorError::Timeout {
                        what: WHAT,
                        timeout,
                    });
                }
                Ok(Err(source)) => {
                    return WatchEnd::Refused(ReflectorError::Transport { what: WHAT, source });
                }
                Ok(Ok(resp)) => resp,
            };
        if !resp.status().is_success() {
            let err = tokio::time::timeout(timeout, error_response(WHAT, resp))
                .await
                .unwrap_or(ReflectorError::Timeout {
                    what: WHAT,
                    timeout,
                });
            return WatchEnd::Refused(err);
        }
        ReflectorStats::inc(&self.stats.watches_established);
        debug!(from = out.from, timeout_secs, "watch established");
        // A resumed watch is healthy once the stream proves it resumes: its first event or
        // bookmark, or a short grace without an ERROR (the apiserver answers a
        // resourceVersion it has compacted with 200 and then a 410 ERROR event; until that
        // line, the cache may be stale).
        // A watch right after a list starts from state just read: healthy at once.
        let mut healthy_at = if after_list {
            self.report_health(None);
            None
        } else {
            Some(Instant::now() + WATCH_HEALTHY_GRACE.min(self.cfg.stall_timeout / 2))
        };

        let mut body = resp.into_body();
        let mut lines = LineSplitter::default();
        let mut batch: Vec<Bytes> = Vec::new();
        let mut deadline = Instant::now() + self.cfg.stall_timeout;
        loop {
            let until = healthy_at.map_or(deadline, |h| h.min(deadline));
            let frame = match tokio::time::timeout_at(until, body.frame()).await {
                Err(_) if healthy_at.is_some_and(|h| Instant::now() >= h) => {
                    healthy_at = None;
                    self.report_health(None);
                    continue;
                }
                Err(_) => return WatchEnd::Stalled,
                Ok(None) if lines.has_partial() => {
                    return WatchEnd::Broken(ReflectorError::TruncatedLine);
                }
                Ok(None) => return WatchEnd::Closed,
                Ok(Some(Err(e))) => {
                    return WatchEnd::Broken(ReflectorError::Body {
                        what: WHAT,
                        source: e.into(),
                    });
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            if let Err(e) = lines.push(data, &mut batch) {
                return WatchEnd::Broken(e);
            }
            for line in batch.drain(..) {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                match parse_event_line(&line, &self.resource) {
                    Ok(WatchItem::Object(kind, obj)) => {
                        let rv = obj.meta.resource_version;
                        self.sink.apply(kind, obj);
                        out.last_rv = rv;
                        out.delivered += 1;
                        ReflectorStats::inc(&self.stats.events);
                        self.stats.last_rv.store(rv, Ordering::Relaxed);
                    }
                    Ok(WatchItem::Bookmark(rv)) => {
                        self.sink.bookmark(rv);
                        out.last_rv = rv;
                        out.delivered += 1;
                        ReflectorStats::inc(&self.stats.bookmarks);
                        self.stats.last_rv.store(rv, Ordering::Relaxed);
                    }
                    Ok(WatchItem::Error(status)) => return WatchEnd::ErrorEvent(status),
                    Err(e) => return WatchEnd::Broken(e),
                }
                if healthy_at.take().is_some() {
                    self.report_health(None);
                }
                deadline = Instant::now() + self.cfg.stall_timeout;
            }
        }
    }
}

/// How long an established watch must go without an ERROR event (when it carries nothing
/// else) before the reflector reports the cache healthy (at most half the stall timeout).
const WATCH_HEALTHY_GRACE: Duration = Duration::from_millis(500);

/// Reads (a bounded prefix of) an error response into a [`ReflectorError::Status`].
async fn error_response(
    what: &'static str,
    resp: http::Response<hyper::body::Incoming>,
) -> ReflectorError {
    let code = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    while buf.len() < MAX_ERROR_BODY {
        match body.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
            _ => break,
        }
    }
    ReflectorError::Status {
        what,
        status: ApiStatus::parse(code, &buf, retry_after),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cms() -> Resource {
        Resource::core("configmaps", "ConfigMap", true)
    }

    fn backoff() -> Backoff {
        Backoff::new(
            Duration::from_millis(800),
            Duration::from_secs(30),
            Duration::from_secs(120),
        )
    }

    fn status(code: u16, reason: &str) -> ApiStatus {
        ApiStatus {
            code,
            reason: reason.into(),
            message: "m".into(),
            ..ApiStatus::default()
        }
    }

    fn outcome(end: WatchEnd, delivered: u64) -> WatchOutcome {
        WatchOutcome {
            from: 10,
            last_rv: if delivered > 0 { 12 } else { 10 },
            delivered,
            lived: Duration::from_secs(30),
            end,
        }
    }

    fn refused(s: ApiStatus) -> WatchEnd {
        WatchEnd::Refused(ReflectorError::Status {
            what: "watch",
            status: s,
        })
    }

    #[test]
    fn backoff_doubles_from_800ms_caps_at_30s_without_jitter() {
        let mut b = backoff();
        let t = Instant::now();
        let got: Vec<u128> = (0..8)
            .map(|i| b.next_delay(t + Duration::from_secs(i), 0.0).as_millis())
            .collect();
        assert_eq!(got, [800, 1600, 3200, 6400, 12_800, 25_600, 30_000, 30_000]);
    }

    #[test]
    fn backoff_jitter_lies_in_d_to_2d() {
        let mut b = backoff();
        let t = Instant::now();
        assert_eq!(b.next_delay(t, 0.5), Duration::from_millis(1200));
        assert_eq!(
            b.next_delay(t, 0.999_999),
            Duration::from_micros(3_199_998) + Duration::from_nanos(400)
        );
        // Out-of-range randomness is clamped, never shortening or exploding the delay.
        assert_eq!(b.next_delay(t, -1.0), Duration::from_millis(3200));
        assert_eq!(b.next_delay(t, f64::NAN), Duration::from_millis(6400));
    }

    #[test]
    fn backoff_resets_when_previous_backoff_started_over_2min_ago() {
        let mut b = backoff();
        let t = Instant::now();
        b.next_delay(t, 0.0);
        b.next_delay(t, 0.0);
        assert_eq!(
            b.next_delay(t + Duration::from_secs(120), 0.0),
            Duration::from_millis(3200)
        );
        let later = t + Duration::from_secs(241);
        assert_eq!(b.next_delay(later, 0.0), Duration::from_millis(800));
    }

    #[test]
    fn random_unit_is_in_range() {
        for _ in 0..1000 {
            let u = random_unit();
            assert!((0.0..1.0).contains(&u), "{u}");
        }
    }

    #[test]
    fn status_classification_matches_client_go() {
        assert!(status(410, "Expired").is_expired());
        assert!(status(410, "Gone").is_expired());
        assert!(status(410, "").is_expired());
        assert!(!status(500, "InternalError").is_expired());
        let mut s = status(504, "Timeout");
        assert!(!s.is_too_large_resource_version());
        s.causes
            .push(("ResourceVersionTooLarge".into(), "x".into()));
        assert!(s.is_too_large_resource_version());
        let mut old = status(504, "Timeout");
        old.message = "Timeout: Too large resource version: 20, current: 10".into();
        assert!(old.is_too_large_resource_version());
        let mut old2 = status(504, "Timeout");
        old2.causes
            .push((String::new(), "Too large resource version".into()));
        assert!(old2.is_too_large_resource_version());
    }

    #[test]
    fn status_parses_from_apiserver_json_and_from_garbage() {
        let body = br#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Timeout: Too large resource version: 9, current: 3","reason":"Timeout","details":{"causes":[{"reason":"ResourceVersionTooLarge","message":"Too large resource version"}],"retryAfterSeconds":1},"code":504}"#;
        let s = ApiStatus::parse(0, body, None);
        assert_eq!(s.code, 504);
        assert_eq!(s.retry_after, Some(Duration::from_secs(1)));
        assert!(s.is_too_large_resource_version());
        let g = ApiStatus::parse(
            502,
            b"<html>bad gateway</html>",
            Some(Duration::from_secs(2)),
        );
        assert_eq!((g.code, g.reason.as_str()), (502, "Bad Gateway"));
        assert_eq!(g.message, "<html>bad gateway</html>");
        assert_eq!(g.retry_after, Some(Duration::from_secs(2)));
    }

    #[test]
    fn list_page_parses_envelope_and_items_without_type_meta() {
        let body = br#"{"kind":"ConfigMapList","apiVersion":"v1","metadata":{"resourceVersion":"42","continue":"abc","remainingItemCount":3},"items":[{"metadata":{"name":"a","namespace":"ns","resourceVersion":"40"},"data":{"k":"v"}},{"metadata":{"name":"b","namespace":"ns","resourceVersion":"41"}}]}"#;
        let p = parse_list_page(body, &cms()).unwrap();
        assert_eq!(p.rv, 42);
        assert_eq!(p.cont.as_deref(), Some("abc"));
        assert_eq!(p.remaining, Some(3));
        let names: Vec<&str> = p.items.iter().map(|o| &*o.meta.name).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            &p.items[0].body[..],
            br#"{"metadata":{"name":"a","namespace":"ns","resourceVersion":"40"},"data":{"k":"v"}}"#
        );
    }

    #[test]
    fn list_page_last_page_empty_continue_and_null_items() {
        let p = parse_list_page(
            br#"{"metadata":{"resourceVersion":"7","continue":""},"items":null}"#,
            &cms(),
        )
        .unwrap();
        assert_eq!((p.rv, p.cont, p.items.len()), (7, None, 0));
    }

    #[test]
    fn list_page_without_resource_version_is_an_error() {
        let e = parse_list_page(br#"{"metadata":{},"items":[]}"#, &cms()).unwrap_err();
        assert!(
            matches!(e, ReflectorError::BadResourceVersion { .. }),
            "{e}"
        );
        let e = parse_list_page(
            br#"{"metadata":{"resourceVersion":"1"},"items":[{"metadata":{}}]}"#,
            &cms(),
        )
        .unwrap_err();
        assert!(matches!(e, ReflectorError::Object { .. }), "{e}");
    }

    #[test]
    fn event_line_object_is_parsed_and_stripped_of_type_meta() {
        let line = Bytes::from_static(
            br#"{"type":"MODIFIED","object":{"kind":"ConfigMap","apiVersion":"v1","metadata":{"name":"a","namespace":"ns","resourceVersion":"43"}}}"#,
        );
        let WatchItem::Object(kind, obj) = parse_event_line(&line, &cms()).unwrap() else {
            panic!("not an object event");
        };
        assert_eq!(kind, EventKind::Modified);
        assert_eq!(obj.meta.resource_version, 43);
        assert_eq!(
            &obj.body[..],
            br#"{"metadata":{"name":"a","namespace":"ns","resourceVersion":"43"}}"#
        );
    }

    #[test]
    fn event_line_bookmark_error_and_unknown() {
        let bm = Bytes::from_static(
            br#"{"type":"BOOKMARK","object":{"kind":"ConfigMap","apiVersion":"v1","metadata":{"resourceVersion":"99"}}}"#,
        );
        assert!(matches!(
            parse_event_line(&bm, &cms()).unwrap(),
            WatchItem::Bookmark(99)
        ));
        let err = Bytes::from_static(
            br#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too old resource version: 5 (9)","reason":"Expired","code":410}}"#,
        );
        let WatchItem::Error(s) = parse_event_line(&err, &cms()).unwrap() else {
            panic!("not an error");
        };
        assert!(s.is_expired());
        assert_eq!(s.code, 410);
        let unk = Bytes::from_static(br#"{"type":"WHAT","object":{}}"#);
        assert!(
            matches!(parse_event_line(&unk, &cms()), Err(ReflectorError::UnknownEventType(t)) if t == "WHAT")
        );
        for bad in [
            &br#"{"type":"ADDED""#[..],
            br#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"1"}}"#,
            br#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"1"}]}"#,
            br#"{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"1"}}} x"#,
        ] {
            assert!(
                matches!(
                    parse_event_line(&Bytes::from_static(bad), &cms()),
                    Err(ReflectorError::Scan { .. } | ReflectorError::Object { .. })
                ),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn line_splitter_handles_lines_across_and_within_chunks() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        s.push(Bytes::from_static(b"{\"a\":1}\n{\"b\""), &mut out)
            .unwrap();
        assert_eq!(out, [Bytes::from_static(b"{\"a\":1}")]);
        assert!(s.has_partial());
        out.clear();
        s.push(Bytes::from_static(b":2"), &mut out).unwrap();
        assert!(out.is_empty());
        s.push(Bytes::from_static(b"}\n\n{\"c\":3}\n"), &mut out)
            .unwrap();
        assert_eq!(
            out,
            [
                Bytes::from_static(b"{\"b\":2}"),
                Bytes::new(),
                Bytes::from_static(b"{\"c\":3}")
            ]
        );
        assert!(!s.has_partial());
    }

    #[test]
    fn line_splitter_refuses_unbounded_lines() {
        let mut s = LineSplitter::default();
        let mut out = Vec::new();
        let big = Bytes::from(vec![b'x'; MAX_EVENT_LINE / 2 + 1]);
        s.push(big.clone(), &mut out).unwrap();
        assert!(matches!(
            s.push(big, &mut out),
            Err(ReflectorError::LineTooLong)
        ));
    }

    #[test]
    fn clean_end_and_stall_resume_from_last_rv_without_backoff() {
        let mut b = backoff();
        let now = Instant::now();
        for end in [WatchEnd::Closed, WatchEnd::Stalled] {
            let s = after_watch(&outcome(end, 2), 0, &mut b, now, 0.0);
            assert_eq!(
                s,
                State::Watch {
                    rv: 12,
                    too_large: 0
                }
            );
        }
        // No backoff step consumed.
        assert_eq!(b.next_delay(now, 0.0), Duration::from_millis(800));
    }

    #[test]
    fn very_short_empty_watch_backs_off() {
        let mut b = backoff();
        let mut out = outcome(WatchEnd::Closed, 0);
        out.lived = Duration::from_millis(10);
        let s = after_watch(&out, 0, &mut b, Instant::now(), 0.0);
        assert!(
            matches!(
                s,
                State::Backoff {
                    next: Next::Watch { rv: 10, .. },
                    ..
                }
            ),
            "{s:?}"
        );
    }

    #[test]
    fn expired_on_watch_relists_at_once() {
        let mut b = backoff();
        for end in [
            WatchEnd::ErrorEvent(status(410, "Expired")),
            refused(status(410, "Gone")),
        ] {
            let s = after_watch(&outcome(end, 0), 0, &mut b, Instant::now(), 0.0);
            let State::List { reason, .. } = s else {
                panic!("{s:?}");
            };
            assert_eq!(reason, RelistReason::Expired);
        }
    }

    #[test]
    fn connection_errors_and_5xx_resume_from_last_rv_after_backoff() {
        let mut b = backoff();
        let now = Instant::now();
        let broken = WatchEnd::Broken(ReflectorError::TruncatedLine);
        let s = after_watch(&outcome(broken, 1), 0, &mut b, now, 0.0);
        assert_eq!(
            s,
            State::Backoff {
                next: Next::Watch {
                    rv: 12,
                    too_large: 0
                },
                after: Duration::from_millis(800),
                cause: ReflectorError::TruncatedLine.to_string(),
            }
        );
        let s = after_watch(
            &outcome(refused(status(500, "InternalError")), 0),
            0,
            &mut b,
            now,
            0.0,
        );
        assert!(
            matches!(s, State::Backoff { next: Next::Watch { rv: 10, too_large: 0 }, after, .. } if after == Duration::from_millis(1600)),
            "{s:?}"
        );
        let s = after_watch(
            &outcome(WatchEnd::ErrorEvent(status(500, "InternalError")), 0),
            0,
            &mut b,
            now,
            0.0,
        );
        assert!(
            matches!(
                s,
                State::Backoff {
                    next: Next::Watch { rv: 10, .. },
                    ..
                }
            ),
            "{s:?}"
        );
    }

    #[test]
    fn retry_after_is_a_minimum_delay() {
        let mut b = backoff();
        let mut s429 = status(429, "TooManyRequests");
        s429.retry_after = Some(Duration::from_secs(5));
        let s = after_watch(&outcome(refused(s429), 0), 0, &mut b, Instant::now(), 0.0);
        assert!(
            matches!(s, State::Backoff { after, .. } if after == Duration::from_secs(5)),
            "{s:?}"
        );
    }

    #[test]
    fn too_large_rv_retries_the_watch_then_relists_on_the_third() {
        let mut b = backoff();
        let mut tl = status(504, "Timeout");
        tl.causes
            .push(("ResourceVersionTooLarge".into(), String::new()));
        let now = Instant::now();
        let mut count = 0;
        let mut nexts = Vec::new();
        for _ in 0..3 {
            let s = after_watch(&outcome(refused(tl.clone()), 0), count, &mut b, now, 0.0);
            let State::Backoff { next, .. } = s else {
                panic!("{s:?}");
            };
            if let Next::Watch { too_large, .. } = next {
                count = too_large;
            }
            nexts.push(next);
        }
        assert_eq!(
            nexts,
            [
                Next::Watch {
                    rv: 10,
                    too_large: 1
                },
                Next::Watch {
                    rv: 10,
                    too_large: 2
                },
                Next::List {
                    reason: RelistReason::TooLargeResourceVersion
                },
            ]
        );
    }

    #[test]
    fn list_errors_back_off_except_expired_continue_restarts_unpaged() {
        let mut b = backoff();
        let now = Instant::now();
        let gone = ReflectorError::Status {
            what: "list",
            status: status(410, "Expired"),
        };
        assert_eq!(
            after_list_error(&gone, true, &mut b, now, 0.0),
            State::List {
                reason: RelistReason::ContinueExpired,
                paged: false
            }
        );
        let s = after_list_error(&gone, false, &mut b, now, 0.0);
        assert!(
            matches!(s, State::Backoff { next: Next::List { reason: RelistReason::Retry }, after, .. } if after == Duration::from_millis(800)),
            "{s:?}"
        );
    }
}
