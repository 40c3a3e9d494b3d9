//! The issuer's keys for offline JWT verification: fetched from the apiserver's OIDC
//! discovery document and JWKS, kept with the time they were fetched, refetched on use when
//! stale or when a token names an unknown `kid` (at most once per `jwksMinRefreshInterval`)
//! and by the chain's background refresher. A failed fetch keeps the previous keys.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use http::{HeaderValue, Request, StatusCode, header};
use http_body_util::BodyExt;
use serde::Deserialize;

use super::jwt::{KeySet, KeySetError};
use super::stats::AuthnStats;
use crate::http::body;
use crate::upstream::{As, Upstream};

/// Why the keys could not be fetched (logged; the previous keys stay).
#[derive(Debug, thiserror::Error)]
pub enum JwksError {
    #[error("GET {path} timed out")]
    Timeout { path: &'static str },
    #[error("GET {path}: {source}")]
    Send {
        path: &'static str,
        #[source]
        source: body::BoxError,
    },
    #[error("GET {path}: {source}")]
    Body {
        path: &'static str,
        #[source]
        source: hyper::Error,
    },
    #[error("GET {path} returned {status}")]
    Status {
        path: &'static str,
        status: StatusCode,
    },
    #[error("discovery document: {0}")]
    Discovery(#[source] serde_json::Error),
    #[error(transparent)]
    KeySet(#[from] KeySetError),
}

/// Why the keys are being fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Why {
    /// A token named a `kid` the key set lacks: only `jwksMinRefreshInterval` limits it.
    UnknownKid,
    /// On use, the keys are older than `jwksRefreshInterval`.
    Stale,
    /// The background refresher's tick.
    Periodic,
}

/// State of JWKS fetching, behind an async mutex (one fetch at a time).
struct Refresh {
    last_attempt: Option<Instant>,
}

/// The issuer's current keys and their fetching (see the module docs).
pub(super) struct Jwks {
    upstream: Upstream,
    /// `jwksRefreshInterval`.
    refresh_interval: Duration,
    /// `jwksMinRefreshInterval`.
    min_refresh_interval: Duration,
    timeout: Duration,
    keys: RwLock<Option<(Arc<KeySet>, Instant)>>,
    refresh: tokio::sync::Mutex<Refresh>,
}

impl Jwks {
    pub(super) fn new(
        upstream: Upstream,
        refresh_interval: Duration,
        min_refresh_interval: Duration,
        timeout: Duration,
    ) -> Jwks {
        Jwks {
            upstream,
            refresh_interval,
            min_refresh_interval,
            timeout,
            keys: RwLock::new(None),
            refresh: tokio::sync::Mutex::new(Refresh { last_attempt: None }),
        }
    }

    /// The keys at hand, however old, without fetching.
    pub(super) fn current(&self) -> Option<Arc<KeySet>> {
        self.keys.read().as_ref().map(|(k, _)| k.clone())
    }

    /// Replaces the keys at hand (tests: keys without an apiserver).
    #[cfg(test)]
    pub(super) fn set(&self, keys: KeySet) {
        *self.keys.write() = Some((Arc::new(keys), Instant::now()));
    }

    /// The current key set, fetched on first use and refreshed when older than
    /// `jwksRefreshInterval` (the background refresher normally keeps it fresh). `None` when
    /// discovery is unavailable (then TokenReview decides).
    pub(super) async fn key_set(&self, stats: &AuthnStats) -> Option<Arc<KeySet>> {
        let cur = self.keys.read().clone();
        match cur {
            Some((k, at)) if at.elapsed() < self.refresh_interval => Some(k),
            stale => {
                // Boxed: a fetch's future is large and only this branch needs it.
                Box::pin(self.refresh(Why::Stale, stats)).await;
                let fresh = self.keys.read().as_ref().map(|(k, _)| k.clone());
                fresh.or(stale.map(|(k, _)| k))
            }
        }
    }

    /// Refetches discovery + JWKS. On use (`Stale`, `UnknownKid`) not within
    /// `jwksMinRefreshInterval` of the last attempt, so a flood of forged `kid`s cannot hammer
    /// the apiserver; the background tick (`Periodic`) is paced by its own interval. True when
    /// new keys were stored by this call; a failure keeps the previous keys.
    pub(super) async fn refresh(&self, why: Why, stats: &AuthnStats) -> bool {
        let mut r = self.refresh.lock().await;
        if why != Why::Periodic
            && let Some(at) = r.last_attempt
            && at.elapsed() < self.min_refresh_interval
        {
            return false;
        }
        let fresh_for = match why {
            Why::UnknownKid => Duration::ZERO,
            Why::Stale => self.refresh_interval,
            // Ticks are `jwksRefreshInterval` apart: a tick meeting keys fetched since the
            // last one (on use) skips, without skipping every other tick on timer jitter.
            Why::Periodic => self.refresh_interval / 2,
        };
        if let Some((_, at)) = self.keys.read().clone()
            && at.elapsed() < fresh_for
        {
            // Another caller refreshed while this one waited for the lock.
            return false;
        }
        r.last_attempt = Some(Instant::now());
        stats.jwks_fetches.fetch_add(1, Relaxed);
        match self.fetch().await {
            Ok(ks) => {
                *self.keys.write() = Some((Arc::new(ks), Instant::now()));
                true
            }
            Err(e) => {
                stats.jwks_fetch_failures.fetch_add(1, Relaxed);
                let kept = self.keys.read().is_some();
                tracing::warn!(error = %e, kept_previous_keys = kept, ?why, "fetching the serviceaccount issuer's keys failed; tokens no key verifies go to TokenReview");
                false
            }
        }
    }

    async fn fetch(&self) -> Result<KeySet, JwksError> {
        #[derive(Deserialize)]
        struct Discovery {
            issuer: String,
        }
        let d = self
            .get("/.well-known/openid-configuration", "application/json")
            .await?;
        let d: Discovery = serde_json::from_slice(&d).map_err(JwksError::Discovery)?;
        // The document's jwks_uri names the issuer's external URL; the same keys are served
        // by the apiserver at this path, reached through the proxy's upstream client.
        // The apiserver answers 406 to this path for `Accept: application/json` alone.
        let jwks = self
            .get(
                "/openid/v1/jwks",
                "application/jwk-set+json, application/json",
            )
            .await?;
        Ok(KeySet::from_jwks(&d.issuer, &jwks)?)
    }

    async fn get(
        &self,
        path: &'static str,
        accept: &'static str,
    ) -> Result<bytes::Bytes, JwksError> {
        let mut req = Request::new(body::empty());
        *req.uri_mut() = self.upstream.uri(path);
        req.headers_mut()
            .insert(header::ACCEPT, HeaderValue::from_static(accept));
        let fut = self.upstream.send(req, As::Proxy, false);
        let resp = tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| JwksError::Timeout { path })?
            .map_err(|source| JwksError::Send { path, source })?;
        let status = resp.status();
        let b = resp
            .into_body()
            .collect()
            .await
            .map_err(|source| JwksError::Body { path, source })?
            .to_bytes();
        if !status.is_success() {
            return Err(JwksError::Status { path, status });
        }
        Ok(b)
    }
}
