//! Prometheus metrics, labelled as the apiserver labels its own request metrics so existing
//! dashboards and queries carry over (`apiserver_request_total` ->
//! `kube_cache_proxy_requests_total`).

pub mod window;

use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// kube-apiserver's `apiserver_request_duration_seconds` buckets.
pub const APISERVER_DURATION_BUCKETS: &[f64] = &[
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub verb: String,
    pub group: String,
    pub version: String,
    pub resource: String,
    pub subresource: String,
    pub scope: String,
    pub code: String,
    pub served_by: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DurationLabels {
    pub verb: String,
    pub group: String,
    pub version: String,
    pub resource: String,
    pub subresource: String,
    pub scope: String,
    pub served_by: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    pub verb: String,
    pub resource: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: Family<DurationLabels, Histogram>,
    pub inflight: Family<KindLabels, Gauge>,
    pub upstream_requests: Family<UpstreamLabels, Counter>,
    pub connections: Family<KindLabels, Gauge>,
    pub rejected: Family<ReasonLabels, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let request_duration = Family::<DurationLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(APISERVER_DURATION_BUCKETS.iter().copied())
        });
        let inflight = Family::<KindLabels, Gauge>::default();
        let upstream_requests = Family::<UpstreamLabels, Counter>::default();
        let connections = Family::<KindLabels, Gauge>::default();
        let rejected = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "kube_cache_proxy_requests",
            "Requests served, by verb, resource, scope, HTTP code and what served them",
            requests.clone(),
        );
        registry.register(
            "kube_cache_proxy_request_duration_seconds",
            "Request latency until the response body ends, with the apiserver's buckets",
            request_duration.clone(),
        );
        registry.register(
            "kube_cache_proxy_inflight_requests",
            "Requests in flight by kind (readOnly, mutating, watch, upgrade)",
            inflight.clone(),
        );
        registry.register(
            "kube_cache_proxy_upstream_requests",
            "Requests sent to kube-apiserver, by verb, resource and HTTP code (error: no response)",
            upstream_requests.clone(),
        );
        registry.register(
            "kube_cache_proxy_connections",
            "Open downstream connections by listener (tls, insecure)",
            connections.clone(),
        );
        registry.register(
            "kube_cache_proxy_rejected",
            "Requests and connections refused before reaching a handler, by reason",
            rejected.clone(),
        );
        Metrics {
            registry: Mutex::new(registry),
            requests,
            request_duration,
            inflight,
            upstream_requests,
            connections,
            rejected,
        }
    }

    /// Adds a collector read at every scrape (per-resource cache metrics).
    pub fn register_collector(&self, c: Box<dyn prometheus_client::collector::Collector>) {
        self.registry.lock().register_collector(c);
    }

    pub fn reject(&self, reason: &str) {
        self.rejected
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let reg = self.registry.lock();
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
        out
    }
}

/// Writes one metric (family) of a scrape-time collector with its name and help.
pub fn emit<M: prometheus_client::encoding::EncodeMetric>(
    enc: &mut prometheus_client::encoding::DescriptorEncoder,
    name: &str,
    help: &str,
    m: &M,
) -> std::fmt::Result {
    let e = enc.encode_descriptor(name, help, None, m.metric_type())?;
    m.encode(e)
}
