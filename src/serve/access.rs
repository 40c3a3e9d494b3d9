//! The access log: one line per request on the API port, at info level under the target
//! `kube_cache_proxy::access`, written when the response body ends (a watch's line comes
//! when the watch ends), in the configured log format (`log.format`: text or JSON).
//!
//! Fields: `user` and `groups` (how many) when the proxy knows the caller: it authenticated
//! it (a cache read, a client certificate), or, for a request it passes through, identified
//! it without asking the apiserver (the token file, a verdict it holds, a ServiceAccount JWT
//! it verifies offline; not when the apiserver then answers 401); `-` otherwise (a token only
//! the apiserver can judge: it authenticates what passes through), `verb`, `resource` (with `/subresource`),
//! `namespace`, `path` (with the query), `code`, `served_by` (`cache`; `apiserver`: passed
//! through, including the 503 when the apiserver could not be reached; `proxy`: a refusal the
//! proxy wrote: 400, 401, 403, 429, ...), `bytes` (response body bytes sent, counted to the
//! end of the stream; an upgraded exec/attach/port-forward stream's bytes are not the
//! response body and are not counted), `latency_ms` (to the end of the body), `user_agent`, `audit_id`,
//! `peer`, and a watch's opt-in field filter (`watch_fields`: its canonical form and
//! `applied` or `unfiltered`). Credentials never appear: no header but `User-Agent` and `Audit-Id` is read.
//!
//! `log.access: off` (`--log-access off`) turns it off; `log.accessSampling` (0 to 1) writes
//! that fraction of requests.

use std::net::SocketAddr;
use std::time::Duration;

use http::HeaderMap;

/// What one request's access-log line says, collected as the request goes.
#[derive(Debug, Default, Clone)]
pub struct Entry {
    pub method: String,
    pub path: String,
    pub verb: String,
    pub resource: String,
    pub namespace: String,
    pub user_agent: String,
    pub peer: Option<SocketAddr>,
    pub user: Option<String>,
    pub groups: usize,
    pub code: u16,
    pub served_by: &'static str,
    pub audit_id: String,
    /// A watch's opt-in field filter (`k8s::watch_fields`, canonical form) and whether it
    /// was applied: `spec applied`, `spec unfiltered`; `-` without one.
    pub watch_fields: Option<String>,
}

/// Whether this request gets an access-log line (`log.access`, `log.accessSampling`, and a
/// log filter that lets info lines of `kube_cache_proxy::access` through: at `--log-level
/// warn` nothing of the line is collected).
pub fn sampled(cfg: &crate::config::LogConfig) -> bool {
    cfg.access
        && (cfg.access_sampling >= 1.0 || fastrand::f64() < cfg.access_sampling)
        && tracing::enabled!(target: "kube_cache_proxy::access", tracing::Level::INFO)
}

/// A header's value as text, `-` when absent or not text.
pub fn header(h: &HeaderMap, name: impl http::header::AsHeaderName) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .unwrap_or("-")
        .to_string()
}

impl Entry {
    /// Writes the line.
    pub fn emit(&self, bytes: u64, latency: Duration) {
        let peer = self.peer.map_or_else(|| "-".to_string(), |p| p.to_string());
        tracing::info!(
            target: "kube_cache_proxy::access",
            user = self.user.as_deref().unwrap_or("-"),
            groups = self.groups,
            verb = %self.verb,
            resource = %self.resource,
            namespace = %self.namespace,
            method = %self.method,
            path = %self.path,
            code = self.code,
            served_by = self.served_by,
            bytes,
            latency_ms = (latency.as_secs_f64() * 1e6).round() / 1e3,
            user_agent = %self.user_agent,
            audit_id = %self.audit_id,
            peer = %peer,
            watch_fields = self.watch_fields.as_deref().unwrap_or("-"),
            "request"
        );
    }
}
