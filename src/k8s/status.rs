//! Kubernetes wire types the proxy writes itself.
//!
//! Every error the proxy produces is a `meta/v1 Status`, built here, so clients (client-go's
//! `errors.IsNotFound`, kubectl's messages, the Python client) read our errors exactly as they
//! read the apiserver's. See <https://kubernetes.io/docs/reference/using-api/api-concepts/#status>.

use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use serde::Serialize;

use crate::http::body::{self, Body};

/// The `reason` field of a failure Status, as spelled by k8s.io/apimachinery `metav1.StatusReason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    BadRequest,
    Unauthorized,
    Forbidden,
    NotFound,
    MethodNotAllowed,
    Conflict,
    Gone,
    Expired,
    RequestEntityTooLarge,
    UnsupportedMediaType,
    TooManyRequests,
    InternalError,
    ServiceUnavailable,
    Timeout,
    /// Used for 431, which has no apimachinery reason of its own.
    Unknown,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::BadRequest => "BadRequest",
            Reason::Unauthorized => "Unauthorized",
            Reason::Forbidden => "Forbidden",
            Reason::NotFound => "NotFound",
            Reason::MethodNotAllowed => "MethodNotAllowed",
            Reason::Conflict => "Conflict",
            Reason::Gone => "Gone",
            Reason::Expired => "Expired",
            Reason::RequestEntityTooLarge => "RequestEntityTooLarge",
            Reason::UnsupportedMediaType => "UnsupportedMediaType",
            Reason::TooManyRequests => "TooManyRequests",
            Reason::InternalError => "InternalError",
            Reason::ServiceUnavailable => "ServiceUnavailable",
            Reason::Timeout => "Timeout",
            Reason::Unknown => "",
        }
    }
}

/// A `meta/v1 Status` object with status `Failure`.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    kind: &'static str,
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    metadata: serde_json::Map<String, serde_json::Value>,
    status: &'static str,
    message: String,
    #[serde(skip_serializing_if = "str::is_empty")]
    reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<Details>,
    code: u16,
    #[serde(skip)]
    retry_after: Option<u32>,
}

#[derive(Debug, Clone, Default, Serialize)]
#[serde(rename_all = "camelCase")]
struct Details {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_seconds: Option<u32>,
}

impl Status {
    pub fn failure(code: StatusCode, reason: Reason, message: impl Into<String>) -> Self {
        Status {
            kind: "Status",
            api_version: "v1",
            metadata: serde_json::Map::new(),
            status: "Failure",
            message: message.into(),
            reason: reason.as_str(),
            details: None,
            code: code.as_u16(),
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::failure(StatusCode::BAD_REQUEST, Reason::BadRequest, message)
    }

    /// The apiserver's 401 for missing or invalid credentials.
    pub fn unauthorized() -> Self {
        Self::failure(
            StatusCode::UNAUTHORIZED,
            Reason::Unauthorized,
            "Unauthorized",
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            Reason::InternalError,
            message,
        )
    }

    /// 503 for an unreachable or failing upstream; a retry helps, so it carries `Retry-After`.
    pub fn service_unavailable(message: impl Into<String>, retry_after: u32) -> Self {
        Self::failure(
            StatusCode::SERVICE_UNAVAILABLE,
            Reason::ServiceUnavailable,
            message,
        )
        .with_retry_after(retry_after)
    }

    /// Sets `details.retryAfterSeconds` and the `Retry-After` header (integer seconds, as
    /// client-go's `ShouldRetry`/`RetryAfterSeconds` read it).
    pub fn with_retry_after(mut self, seconds: u32) -> Self {
        self.retry_after = Some(seconds);
        self.details
            .get_or_insert_with(Details::default)
            .retry_after_seconds = Some(seconds);
        self
    }

    /// Sets `details.name`, `details.group` and `details.kind` (the resource, as
    /// apimachinery's `NewForbidden` fills them); empty values are omitted.
    pub fn with_details(mut self, name: &str, group: &str, kind: &str) -> Self {
        let d = self.details.get_or_insert_with(Details::default);
        let opt = |s: &str| (!s.is_empty()).then(|| s.to_string());
        d.name = opt(name);
        d.group = opt(group);
        d.kind = opt(kind);
        self
    }

    /// Sets `metadata.continue` (a 410 for an expired list offers an inconsistent
    /// continuation this way).
    pub fn with_continue(mut self, token: String) -> Self {
        self.metadata
            .insert("continue".into(), serde_json::Value::String(token));
        self
    }

    pub fn code(&self) -> u16 {
        self.code
    }

    /// A watch's ERROR event carrying this status, in JSON or in protobuf.
    pub fn watch_error_frame(&self, protobuf: bool) -> Bytes {
        if protobuf {
            let object = crate::k8s::protobuf_write::failure_status(
                &self.message,
                self.reason,
                i32::from(self.code),
            );
            let mut out = Vec::with_capacity(object.len() + 24);
            // A Status is far smaller than a frame's 4 GiB.
            let _ = crate::k8s::protobuf_write::watch_frame(&mut out, "ERROR", &object);
            return Bytes::from(out);
        }
        let mut frame = b"{\"type\":\"ERROR\",\"object\":".to_vec();
        frame.extend_from_slice(&self.to_bytes());
        frame.extend_from_slice(b"}\n");
        Bytes::from(frame)
    }

    pub fn reason(&self) -> &str {
        self.reason
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    pub fn to_bytes(&self) -> Bytes {
        // Serialising a struct of strings and integers cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    pub fn into_response(self) -> http::Response<Body> {
        let mut resp = http::Response::new(body::full(self.to_bytes()));
        *resp.status_mut() =
            StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_serialises_like_the_apiserver() {
        let s = Status::bad_request("bad path").to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&s).unwrap();
        assert_eq!(v["kind"], "Status");
        assert_eq!(v["apiVersion"], "v1");
        assert_eq!(v["status"], "Failure");
        assert_eq!(v["reason"], "BadRequest");
        assert_eq!(v["code"], 400);
        assert_eq!(v["message"], "bad path");
        assert!(v["metadata"].as_object().unwrap().is_empty());
    }

    #[test]
    fn retry_after_sets_header_and_details() {
        let resp = Status::service_unavailable("upstream down", 3).into_response();
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "3");
    }
}
