//! The verdict cache: the chain's results by token hash, each kept no longer than its
//! method allows.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::identity::Identity;
use super::stats::AuthnMethod;

/// A cached verdict on one token: the identity, or the method that refused it.
#[derive(Clone)]
pub(super) struct Cached {
    pub(super) outcome: Result<(Arc<Identity>, AuthnMethod), Option<AuthnMethod>>,
    /// Unix time after which the entry is void (the token's `exp`).
    pub(super) until: Option<u64>,
    /// When a TokenReview (the apiserver's own ServiceAccount lookup) vouched for the
    /// identity: a doubt of the proxy's caches (see `liveness`) is then left alone for
    /// [`REVIEW_VOUCHES`], the time they take to catch up with the apiserver.
    pub(super) reviewed: Option<Instant>,
    /// The Secret an offline-verified token is bound to (name, uid), for the lookup.
    pub(super) secret: Option<Arc<(String, String)>>,
}

/// How long a TokenReview outweighs a doubt of the proxy's own copy of the ServiceAccounts
/// (an account created a moment ago is not in it yet): without this, every request of such
/// a caller would cost a TokenReview until the copy caught up.
pub(super) const REVIEW_VOUCHES: Duration = Duration::from_secs(1);

/// Verdicts by token hash (the SHA-256 of the token, never the token itself).
pub(super) type Verdicts = moka::future::Cache<[u8; 32], Cached>;

/// An empty verdict cache whose entries live as [`VerdictTtl`] says.
pub(super) fn verdicts(ok: Duration, failed: Duration) -> Verdicts {
    moka::future::Cache::builder()
        .max_capacity(200_000)
        .expire_after(VerdictTtl { ok, failed })
        .build()
}

/// How long a verdict is cached: successes `cacheTtl` but never past the token's `exp`,
/// failures `failureCacheTtl` (zero: shared by the concurrent requests of one flight only).
struct VerdictTtl {
    ok: Duration,
    failed: Duration,
}

impl moka::Expiry<[u8; 32], Cached> for VerdictTtl {
    fn expire_after_create(&self, _: &[u8; 32], v: &Cached, _: Instant) -> Option<Duration> {
        Some(match (&v.outcome, v.until) {
            (Ok(_), Some(until)) => self
                .ok
                .min(Duration::from_secs(until.saturating_sub(now_unix()))),
            (Ok(_), None) => self.ok,
            (Err(_), _) => self.failed,
        })
    }
}

/// Seconds since the Unix epoch (JWT time claims are in these).
pub(super) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
