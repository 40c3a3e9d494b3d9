//! How identities are established ([`AuthnMethod`], a metrics label) and the chain's
//! counters by method and result ([`AuthnStats`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// How an identity was established (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthnMethod {
    Certificate,
    StaticToken,
    ServiceAccountJwt,
    TokenReview,
    Anonymous,
}

impl AuthnMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthnMethod::Certificate => "x509",
            AuthnMethod::StaticToken => "token_file",
            AuthnMethod::ServiceAccountJwt => "serviceaccount_jwt",
            AuthnMethod::TokenReview => "token_review",
            AuthnMethod::Anonymous => "anonymous",
        }
    }
}

/// Counters for the metrics layer, by method and result.
#[derive(Debug, Default)]
pub struct AuthnStats {
    /// Successes by [`METHODS`] index.
    pub ok: [AtomicU64; 5],
    /// Refusals (401) by the method that refused: [`METHODS`] index, or the last slot
    /// ([`NO_METHOD`]) when no method applied (no or malformed credentials).
    pub unauthorized: [AtomicU64; 6],
    /// TokenReviews the apiserver could not answer (503).
    pub unavailable: AtomicU64,
    /// Successes served from a verdict past its TTL because the apiserver was unreachable
    /// (`authentication.staleWhileUnreachable`); also counted in `ok`.
    pub stale: AtomicU64,
    pub cache_hits: AtomicU64,
    pub jwks_fetches: AtomicU64,
    pub jwks_fetch_failures: AtomicU64,
}

/// The `unauthorized` slot and label of a refusal no method was responsible for.
pub const NO_METHOD: (usize, &str) = (5, "none");

impl AuthnStats {
    /// Refusals attributed to `m` (`None`: no credentials to judge).
    pub fn unauthorized_by(&self, m: Option<AuthnMethod>) -> u64 {
        self.unauthorized[method_slot(m)].load(Relaxed)
    }
}

pub(super) fn method_slot(m: Option<AuthnMethod>) -> usize {
    m.and_then(|m| METHODS.iter().position(|x| *x == m))
        .unwrap_or(NO_METHOD.0)
}

pub const METHODS: [AuthnMethod; 5] = [
    AuthnMethod::Certificate,
    AuthnMethod::StaticToken,
    AuthnMethod::ServiceAccountJwt,
    AuthnMethod::TokenReview,
    AuthnMethod::Anonymous,
];
