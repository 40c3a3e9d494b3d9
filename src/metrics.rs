//! Prometheus metrics, labelled as the apiserver labels its own request metrics so existing
//! dashboards and queries carry over (`apiserver_request_total` ->
//! `kube_cache_proxy_requests_total`).

use std::sync::Mutex;

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
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .register_collector(c);
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
        let reg = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        // Encoding into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
        out
    }
}

/// Authentication, authorization and tenant-quota metrics, read from their counters at scrape
/// time.
#[derive(Debug)]
pub struct AuthCollector {
    pub authn: std::sync::Arc<crate::authn::Authenticator>,
    pub authz: std::sync::Arc<crate::authz::Authorizer>,
    pub tenancy: std::sync::Arc<crate::tenancy::Tenancy>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AuthnLabels {
    method: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabels {
    tenant: String,
    quota: String,
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

impl prometheus_client::collector::Collector for AuthCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use std::sync::atomic::Ordering::Relaxed;
        let authn = Family::<AuthnLabels, Counter>::default();
        let a = &self.authn.stats;
        for (i, m) in crate::authn::METHODS.iter().enumerate() {
            authn
                .get_or_create(&AuthnLabels {
                    method: m.as_str().into(),
                    result: "success".into(),
                })
                .inc_by(a.ok[i].load(Relaxed));
        }
        // Refusals by the method that refused (`none`: no usable credentials); only
        // TokenReview can be unavailable.
        let refusers = crate::authn::METHODS
            .iter()
            .map(|m| m.as_str())
            .chain([crate::authn::NO_METHOD.1]);
        for (i, method) in refusers.enumerate() {
            authn
                .get_or_create(&AuthnLabels {
                    method: method.into(),
                    result: "unauthorized".into(),
                })
                .inc_by(a.unauthorized[i].load(Relaxed));
        }
        authn
            .get_or_create(&AuthnLabels {
                method: crate::authn::AuthnMethod::TokenReview.as_str().into(),
                result: "unavailable".into(),
            })
            .inc_by(a.unavailable.load(Relaxed));
        emit(
            &mut enc,
            "kube_cache_proxy_authentications",
            "Authentications of cache-served requests by method and result",
            &authn,
        )?;
        let authn_cache = Family::<ResultLabels, Counter>::default();
        authn_cache
            .get_or_create(&ResultLabels {
                result: "hit".into(),
            })
            .inc_by(a.cache_hits.load(Relaxed));
        emit(
            &mut enc,
            "kube_cache_proxy_authentication_cache",
            "Token authentications answered from the proxy's token cache",
            &authn_cache,
        )?;
        let jwks = Family::<ResultLabels, Counter>::default();
        let (fetches, failures) = (
            a.jwks_fetches.load(Relaxed),
            a.jwks_fetch_failures.load(Relaxed),
        );
        for (result, n) in [
            ("success", fetches.saturating_sub(failures)),
            ("failure", failures),
        ] {
            jwks.get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc_by(n);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_jwks_fetches",
            "Fetches of the ServiceAccount issuer's discovery document and JWKS (a failure keeps the previous keys)",
            &jwks,
        )?;

        let z = &self.authz.stats;
        let decisions = Family::<ResultLabels, Counter>::default();
        for (result, n) in [
            ("allowed", z.allowed.load(Relaxed)),
            ("denied", z.denied.load(Relaxed)),
            ("error", z.errors.load(Relaxed)),
        ] {
            decisions
                .get_or_create(&ResultLabels {
                    result: result.into(),
                })
                .inc_by(n);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_authorization_decisions",
            "Authorization decisions on cache-served requests (errors fail closed)",
            &decisions,
        )?;
        let lookups = Family::<ResultLabels, Counter>::default();
        for (result, n) in [
            ("hit", z.cache_hits.load(Relaxed)),
            ("miss", z.cache_misses.load(Relaxed)),
        ] {
            lookups
                .get_or_create(&ResultLabels {
                    result: result.into(),
                })
                .inc_by(n);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_authorization_cache_lookups",
            "Authorization decision cache lookups (hit ratio = hit / (hit + miss))",
            &lookups,
        )?;

        let quota = Family::<QuotaLabels, Counter>::default();
        for t in self.tenancy.tenants() {
            let r = &t.rejections;
            for (q, n) in [
                ("watches", r.watches.load(Relaxed)),
                ("rate", r.rate.load(Relaxed)),
                ("list_size", r.list_size.load(Relaxed)),
            ] {
                quota
                    .get_or_create(&QuotaLabels {
                        tenant: t.config.name.clone(),
                        quota: q.into(),
                    })
                    .inc_by(n);
            }
        }
        emit(
            &mut enc,
            "kube_cache_proxy_quota_rejections",
            "Requests (cache-served, and passthrough lists/watches of identified callers) refused with 429 by tenant quota",
            &quota,
        )
    }
}
