//! Authorization of cache-served requests, decided by the apiserver itself.
//!
//! Passthrough requests are authorized by the apiserver as they reach it. A request the
//! proxy answers from memory must get the same decision first, so it asks the apiserver:
//! - a bearer caller: a `SelfSubjectAccessReview` sent with the caller's own token, which
//!   also authenticates the token (an invalid token is simply "not allowed");
//! - a client-certificate caller: a `SubjectAccessReview` for its user and groups, sent with
//!   the proxy's credentials (the proxy needs `create` on subjectaccessreviews);
//! - anonymous callers are never served from the cache.
//!
//! Only "allowed" is acted on: anything else (denied, no opinion, error, timeout) sends the
//! request through to the apiserver, which then answers exactly as it would have (403, 401
//! with its own message) — failing closed without inventing error texts. Decisions are
//! cached per (credential hash, attributes): allowed for 2 minutes (the apiserver's webhook
//! token cache TTL, which bounds how long a revoked token could still read from the cache),
//! not-allowed for 30 s (its webhook authorizer's unauthorized TTL). Tokens are stored only
//! as SHA-256 hashes.

use std::time::Duration;

use http::{HeaderValue, Method, Request, header};
use http_body_util::BodyExt;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::body;
use crate::identity::Caller;
use crate::upstream::{As, Upstream};

/// What is being asked.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Attributes {
    pub verb: String,
    pub group: String,
    pub version: String,
    pub resource: String,
    pub namespace: String,
    pub name: String,
}

/// Counters for the metrics layer.
#[derive(Debug, Default)]
pub struct AuthzStats {
    pub allowed: std::sync::atomic::AtomicU64,
    pub not_allowed: std::sync::atomic::AtomicU64,
    pub errors: std::sync::atomic::AtomicU64,
    pub cache_hits: std::sync::atomic::AtomicU64,
}

pub struct Authorizer {
    upstream: Upstream,
    allowed: moka::future::Cache<[u8; 32], ()>,
    denied: moka::future::Cache<[u8; 32], ()>,
    timeout: Duration,
    pub stats: AuthzStats,
}

impl std::fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Authorizer")
    }
}

#[derive(Deserialize)]
struct Review {
    status: Option<ReviewStatus>,
}

#[derive(Deserialize)]
struct ReviewStatus {
    #[serde(default)]
    allowed: bool,
}

impl Authorizer {
    pub fn new(upstream: Upstream, allow_ttl: Duration, deny_ttl: Duration) -> Authorizer {
        Authorizer {
            upstream,
            allowed: moka::future::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(allow_ttl)
                .build(),
            denied: moka::future::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(deny_ttl)
                .build(),
            timeout: Duration::from_secs(5),
            stats: AuthzStats::default(),
        }
    }

    fn key(caller: &Caller, a: &Attributes) -> Option<[u8; 32]> {
        let mut h = Sha256::new();
        match caller {
            Caller::Bearer(t) => {
                h.update(b"bearer\0");
                h.update(t.as_bytes());
            }
            Caller::Certificate { user, groups } => {
                h.update(b"x509\0");
                h.update(user.as_bytes());
                for g in groups {
                    h.update(b"\0");
                    h.update(g.as_bytes());
                }
            }
            Caller::Anonymous => return None,
        }
        for part in [
            &a.verb,
            &a.group,
            &a.version,
            &a.resource,
            &a.namespace,
            &a.name,
        ] {
            h.update(b"\x01");
            h.update(part.as_bytes());
        }
        Some(h.finalize().into())
    }

    /// True only when the apiserver says this caller may do this.
    pub async fn allowed(&self, caller: &Caller, a: &Attributes) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(key) = Self::key(caller, a) else {
            return false;
        };
        if self.allowed.contains_key(&key) {
            self.stats.cache_hits.fetch_add(1, Relaxed);
            return true;
        }
        if self.denied.contains_key(&key) {
            self.stats.cache_hits.fetch_add(1, Relaxed);
            return false;
        }
        match tokio::time::timeout(self.timeout, self.review(caller, a)).await {
            Ok(Ok(true)) => {
                self.stats.allowed.fetch_add(1, Relaxed);
                self.allowed.insert(key, ()).await;
                true
            }
            Ok(Ok(false)) => {
                self.stats.not_allowed.fetch_add(1, Relaxed);
                self.denied.insert(key, ()).await;
                false
            }
            Ok(Err(e)) => {
                self.stats.errors.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "access review failed; passing the request through");
                false
            }
            Err(_) => {
                self.stats.errors.fetch_add(1, Relaxed);
                tracing::warn!("access review timed out; passing the request through");
                false
            }
        }
    }

    async fn review(&self, caller: &Caller, a: &Attributes) -> Result<bool, String> {
        let ra = serde_json::json!({
            "verb": a.verb, "group": a.group, "version": a.version, "resource": a.resource,
            "namespace": a.namespace, "name": a.name,
        });
        let (path, body, who, auth) = match caller {
            Caller::Bearer(token) => (
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                serde_json::json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "spec": {"resourceAttributes": ra}}),
                As::Caller,
                Some(token.clone()),
            ),
            Caller::Certificate { user, groups } => {
                // The apiserver adds system:authenticated to every authenticated user.
                let mut groups = groups.clone();
                if !groups.iter().any(|g| g == "system:authenticated") {
                    groups.push("system:authenticated".into());
                }
                (
                    "/apis/authorization.k8s.io/v1/subjectaccessreviews",
                    serde_json::json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {"resourceAttributes": ra, "user": user, "groups": groups}}),
                    As::Proxy,
                    None,
                )
            }
            Caller::Anonymous => return Ok(false),
        };
        let mut req = Request::new(body::full(
            serde_json::to_vec(&body).map_err(|e| e.to_string())?,
        ));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = self.upstream.uri(path);
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        req.headers_mut()
            .insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        if let Some(t) = auth {
            req.headers_mut().insert(header::AUTHORIZATION, t);
        }
        let resp = self
            .upstream
            .send(req, who, false)
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if status == http::StatusCode::UNAUTHORIZED || status == http::StatusCode::FORBIDDEN {
            // An invalid token, or a caller not allowed to review itself: not allowed here,
            // and the apiserver will say so in its own words.
            return Ok(false);
        }
        if !status.is_success() {
            return Err(format!("access review returned {status}"));
        }
        let r: Review = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
        Ok(r.status.is_some_and(|s| s.allowed))
    }
}
