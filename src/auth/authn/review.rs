//! TokenReview: asking the apiserver, with the proxy's own credentials, who a token belongs
//! to (the chain's last resort, and its revocation check for ServiceAccount JWTs).

use std::collections::BTreeMap;
use std::time::Duration;

use http::{HeaderValue, Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use serde::Deserialize;

use super::identity::Identity;
use crate::http::body;
use crate::upstream::{As, Upstream};

/// Why the apiserver could not say whether a token authenticates (the caller gets 503, with
/// this message).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("token review timed out")]
    Timeout,
    #[error("token review: {0}")]
    Send(#[source] body::BoxError),
    #[error("token review: {0}")]
    Body(#[source] hyper::Error),
    #[error("token review returned {0}")]
    Status(StatusCode),
    #[error("token review: {0}")]
    Decode(#[source] serde_json::Error),
}

impl ReviewError {
    /// The apiserver gave no answer (as opposed to an answer the proxy could not use): a
    /// verdict it gave before may then be served stale (`staleWhileUnreachable`).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            ReviewError::Timeout | ReviewError::Send(_) | ReviewError::Body(_)
        )
    }
}

/// A TokenReview with the proxy's credentials: `Ok(None)` when the apiserver says the
/// token does not authenticate, `Err` when it cannot say (no answer within `timeout`).
pub(super) async fn token_review(
    upstream: &Upstream,
    timeout: Duration,
    token: &str,
) -> Result<Option<Identity>, ReviewError> {
    #[derive(Deserialize)]
    struct Review {
        status: Option<ReviewStatus>,
    }
    #[derive(Deserialize)]
    struct ReviewStatus {
        #[serde(default)]
        authenticated: bool,
        #[serde(default)]
        user: Option<ReviewUser>,
    }
    #[derive(Deserialize)]
    struct ReviewUser {
        #[serde(default)]
        username: String,
        #[serde(default)]
        uid: String,
        #[serde(default)]
        groups: Vec<String>,
        #[serde(default)]
        extra: BTreeMap<String, Vec<String>>,
    }
    let body = serde_json::json!({
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token},
    });
    let mut req = Request::new(body::full(body.to_string()));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = upstream.uri("/apis/authentication.k8s.io/v1/tokenreviews");
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    req.headers_mut()
        .insert(header::ACCEPT, HeaderValue::from_static("application/json"));
    let unreachable = |e: ReviewError| {
        upstream.reachability().unreachable(&e);
        e
    };
    let fut = upstream.send(req, As::Proxy, false);
    let resp = tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| unreachable(ReviewError::Timeout))?
        .map_err(|e| unreachable(ReviewError::Send(e)))?;
    let status = resp.status();
    let b = tokio::time::timeout(timeout, resp.into_body().collect())
        .await
        .map_err(|_| unreachable(ReviewError::Timeout))?
        .map_err(|e| unreachable(ReviewError::Body(e)))?
        .to_bytes();
    if !status.is_success() {
        return Err(ReviewError::Status(status));
    }
    let r: Review = serde_json::from_slice(&b).map_err(ReviewError::Decode)?;
    match r.status {
        Some(ReviewStatus {
            authenticated: true,
            user: Some(u),
        }) if !u.username.is_empty() => Ok(Some(Identity {
            user: u.username,
            uid: u.uid,
            groups: u.groups,
            extra: u.extra,
            tenant: String::new(),
        })),
        _ => Ok(None),
    }
}
