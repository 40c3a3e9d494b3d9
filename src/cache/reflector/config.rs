//! The tunables of one reflector: page size (static or adaptive), stall and watch timeouts,
//! backoff parameters, request timeout; with client-go's values as defaults.

use std::time::Duration;

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
