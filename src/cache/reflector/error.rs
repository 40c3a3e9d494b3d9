//! What goes wrong upstream: the Kubernetes `Status` an apiserver answers with
//! ([`ApiStatus`], classified as client-go does), the reflector's errors ([`ReflectorError`]),
//! and reading an error response into one.

use std::fmt;
use std::time::Duration;

use http::{StatusCode, header};
use http_body_util::BodyExt as _;
use serde::Deserialize;

use crate::cache::object::ObjectError;
use crate::http::body::BoxError;
use crate::k8s::scan::ScanError;

/// A watch event line longer than this is refused (the stream is then treated as broken).
/// etcd refuses objects above 1.5 MiB by default (`--max-request-bytes`); 16 MiB leaves room
/// for raised limits while keeping the line buffer bounded.
pub(super) const MAX_EVENT_LINE: usize = 16 << 20;

/// How much of an error response body is read to build its Status.
const MAX_ERROR_BODY: usize = 64 << 10;

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
    pub(super) fn parse(code: u16, body: &[u8], retry_after: Option<Duration>) -> ApiStatus {
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
/// and how (resume or relist) is decided by `after_list_error` and `after_watch`.
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
    /// The apiserver gave no answer (the request could not be sent, or nothing came back in
    /// time): reported to [`crate::upstream::reachability`].
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            ReflectorError::Transport { .. } | ReflectorError::Timeout { .. }
        )
    }
}

impl ReflectorError {
    pub(super) fn status(&self) -> Option<&ApiStatus> {
        match self {
            ReflectorError::Status { status, .. } => Some(status),
            _ => None,
        }
    }
}

/// Reads (a bounded prefix of) an error response into a [`ReflectorError::Status`].
pub(super) async fn error_response(
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

/// A Status from the apiserver with this code and reason, for the reflector's tests.
#[cfg(test)]
pub(super) fn test_status(code: u16, reason: &str) -> ApiStatus {
    ApiStatus {
        code,
        reason: reason.into(),
        message: "m".into(),
        ..ApiStatus::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16, reason: &str) -> ApiStatus {
        test_status(code, reason)
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
}
