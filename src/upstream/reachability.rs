//! Whether the apiserver can be reached at all: the one place that knows of an outage.
//!
//! Requests of the proxy's own that get no answer report it ([`Reachability::unreachable`]):
//! the probe of the apiserver's `/readyz` (`serve::state`), TokenReviews and
//! SubjectAccessReviews (`auth`), the caches' LISTs and WATCHes (`cache::reflector`). Only a
//! request that got *no* answer counts (a refused or reset connection, a timeout): an
//! apiserver that answers, even with an error, is reachable, and its answer is the caller's.
//! Only the periodic probe (every `upstream.healthCheckInterval`) ends an outage
//! ([`Reachability::reachable`]): one source decides when it is over, so the outage's start,
//! which bounds how stale the caches may be, is not reset by a request that happened to get
//! through while others did not.
//!
//! While the apiserver is unreachable, reads that accept any state are answered from memory
//! with a `Warning`, decisions on callers the apiserver made before are served stale for a
//! bounded time, reads that need the latest state fail at once with 503, and readiness holds
//! while the outage is shorter than `cache.maxStaleness` (see `docs/architecture.md`).

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// An ongoing outage: since when, and the first request that found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outage {
    pub since: Instant,
    pub cause: String,
}

impl Outage {
    /// How long the apiserver has been unreachable.
    pub fn duration(&self) -> Duration {
        self.since.elapsed()
    }

    /// The `Warning` header value of a response served from memory during this outage, in
    /// the format of the apiserver's warnings (RFC 7234 `299 - "text"`, as k8s.io/apiserver
    /// `warning.AddWarning` writes them; client-go prints the text).
    pub fn warning(&self) -> String {
        format!(
            "299 - \"the apiserver has been unreachable for {}s: served from the kube-cache-proxy cache, which may be stale\"",
            self.duration().as_secs()
        )
    }
}

/// The apiserver's reachability, shared by every user of one [`super::Upstream`].
#[derive(Debug, Default)]
pub struct Reachability {
    outage: Mutex<Option<Outage>>,
    /// When the last outage ended.
    recovered: Mutex<Option<Instant>>,
}

impl Reachability {
    /// A request to the apiserver got no answer (`cause` names it, for logs). The first such
    /// report starts an outage; later ones leave its start alone.
    pub fn unreachable(&self, cause: impl std::fmt::Display) {
        let mut o = self.outage.lock();
        if o.is_none() {
            let cause = cause.to_string();
            tracing::warn!(cause = %cause, "the apiserver is unreachable: serving what the caches hold");
            *o = Some(Outage {
                since: Instant::now(),
                cause,
            });
        }
    }

    /// The apiserver answered the reachability probe: any outage is over.
    pub fn reachable(&self) {
        if let Some(o) = self.outage.lock().take() {
            *self.recovered.lock() = Some(Instant::now());
            tracing::info!(after = ?o.duration(), "the apiserver is reachable again");
        }
    }

    /// Whether an outage ended less than `window` ago: an apiserver that answers again may
    /// not be ready yet (a restarted one refuses requests until its informers synced).
    pub fn recovered_within(&self, window: Duration) -> bool {
        self.recovered.lock().is_some_and(|t| t.elapsed() < window)
    }

    /// The ongoing outage, if any.
    pub fn outage(&self) -> Option<Outage> {
        self.outage.lock().clone()
    }

    /// Whether the apiserver is currently unreachable.
    pub fn is_unreachable(&self) -> bool {
        self.outage.lock().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_starts_at_the_first_report_and_ends_when_reachable() {
        let r = Reachability::default();
        assert!(r.outage().is_none());
        r.unreachable("connection refused");
        let first = r.outage().expect("an outage");
        r.unreachable("timed out");
        // Later reports keep the start and the first cause.
        assert_eq!(r.outage(), Some(first.clone()));
        assert!(
            first
                .warning()
                .starts_with("299 - \"the apiserver has been unreachable for ")
        );
        assert!(first.warning().ends_with("may be stale\""));
        r.reachable();
        assert!(!r.is_unreachable());
        r.unreachable("again");
        assert_eq!(r.outage().map(|o| o.cause), Some("again".to_string()));
    }
}
