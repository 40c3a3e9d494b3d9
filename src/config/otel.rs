//! `tracing.*`: OpenTelemetry spans over OTLP (see `docs/tracing.md`).

use serde::{Deserialize, Serialize};

/// OpenTelemetry tracing: spans per request and per upstream call, exported over OTLP, and
/// W3C trace context (`traceparent`, `tracestate`) honoured from callers and sent upstream.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TracingConfig {
    pub otlp: OtlpConfig,
    /// The fraction of new traces recorded, 0 to 1, for requests that arrive without a
    /// sampled parent. Parent-based as kube-apiserver's: a caller's `traceparent` decides for
    /// its own requests (sampled flag set: recorded; clear: not). Default 0, kube-apiserver's
    /// `samplingRatePerMillion` default: only traces a caller started are recorded.
    pub sampling_ratio: f64,
    /// `service.name` of the spans.
    pub service_name: String,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp: OtlpConfig::default(),
            sampling_ratio: 0.0,
            service_name: "kube-cache-proxy".into(),
        }
    }
}

/// Where spans go.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct OtlpConfig {
    /// The collector's base URL, `http://` or `https://` (e.g. `http://otel-collector:4318`);
    /// spans are posted to its `/v1/traces`, as the OTLP exporter specification's
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`. Empty (the default): `OTEL_EXPORTER_OTLP_ENDPOINT` if
    /// set, else tracing is off (no exporter, no spans; `traceparent` passes through as any
    /// other header).
    pub endpoint: String,
    /// The OTLP transport: `http/protobuf` (the only one built in: it reuses the proxy's
    /// hyper + rustls client, where gRPC would bring a second HTTP stack).
    pub protocol: OtlpProtocol,
}

/// An OTLP transport.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Default)]
pub enum OtlpProtocol {
    #[default]
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

impl TracingConfig {
    /// The collector's base URL: `otlp.endpoint`, else `OTEL_EXPORTER_OTLP_ENDPOINT` from
    /// `env`. `None`: tracing is off.
    pub fn endpoint(&self, env: impl Fn(&str) -> Option<String>) -> Option<String> {
        Some(self.otlp.endpoint.trim().to_string())
            .filter(|e| !e.is_empty())
            .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT").filter(|e| !e.trim().is_empty()))
    }

    pub(super) fn validate_into(&self, err: &mut impl FnMut(&str, String)) {
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            err("tracing.samplingRatio", "must be between 0 and 1".into());
        }
        if self.service_name.trim().is_empty() {
            err("tracing.serviceName", "must not be empty".into());
        }
        let e = self.otlp.endpoint.trim();
        if !e.is_empty()
            && let Err(why) = check_endpoint(e)
        {
            err("tracing.otlp.endpoint", why);
        }
    }
}

/// An OTLP endpoint is an absolute `http` or `https` URL with a host, no query.
pub fn check_endpoint(e: &str) -> Result<(), String> {
    let uri: http::Uri = e.parse().map_err(|x| format!("invalid URL {e:?}: {x}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(format!("{e:?}: must start with http:// or https://"));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("{e:?}: has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("{e:?}: must not have a query"));
    }
    Ok(())
}
