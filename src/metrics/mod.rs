//! Prometheus metrics, labelled as the apiserver labels its own request metrics so existing
//! dashboards and queries carry over (`apiserver_request_total` ->
//! `kube_cache_proxy_requests_total`).

pub mod process;
pub mod text;
pub mod window;

pub use text::Format;

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

/// Responses on the API port by the encoding of their body (`encoding`: `json`,
/// `protobuf`, `cbor`, `yaml`, `other`; `none` without a `Content-Type`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EncodingLabels {
    pub verb: String,
    pub resource: String,
    pub encoding: String,
    pub served_by: String,
}

impl EncodingLabels {
    /// The `encoding` label of a response's `Content-Type` (its media type only: a watch's
    /// `;stream=watch` and any parameter are ignored).
    pub fn encoding_of(content_type: Option<&http::HeaderValue>) -> &'static str {
        let Some(v) = content_type.and_then(|v| v.to_str().ok()) else {
            return "none";
        };
        let media = v.split(';').next().unwrap_or("").trim();
        if media.eq_ignore_ascii_case("application/json") || media.ends_with("+json") {
            "json"
        } else if media.eq_ignore_ascii_case("application/vnd.kubernetes.protobuf") {
            "protobuf"
        } else if media.eq_ignore_ascii_case("application/cbor")
            || media.eq_ignore_ascii_case("application/cbor-seq")
            || media.ends_with("+cbor")
        {
            "cbor"
        } else if media.eq_ignore_ascii_case("application/yaml") {
            "yaml"
        } else {
            "other"
        }
    }
}

/// Whether `kube_cache_proxy_request_duration_seconds` observes requests of this (metrics)
/// verb: not the long-running ones, `WATCH` and `CONNECT` (exec, attach, port-forward), whose
/// duration is how long the client kept its stream (a watch's timeoutSeconds, minutes), all
/// in the `+Inf` bucket. kube-apiserver observes them too, and every latency query of its
/// histogram leaves them out (`verb!~"WATCH|CONNECT"`, as the shipped dashboard's
/// `verb!="WATCH"`): here they would be half the scrape (26 lines for each watched resource).
/// `kube_cache_proxy_requests_total` counts them.
pub fn observes_duration(verb: &str) -> bool {
    !matches!(verb, "WATCH" | "CONNECT")
}

/// `kube_cache_proxy_upstream_request_duration_seconds`'s buckets: the apiserver's own start at
/// 5 ms, above a passed-through GET's whole round trip (about 1 ms on one machine), which
/// the proxy's share of a request's latency is read against.
pub const UPSTREAM_DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// A passed-through request's upstream round trip, by verb and resource.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamDurationLabels {
    pub verb: String,
    pub resource: String,
}

/// Most distinct resources (group, version, resource, subresource) the request metrics label
/// requests with; past it, newly seen ones are counted as [`OTHER_RESOURCE`] too.
pub const MAX_RESOURCE_LABELS: usize = 4096;

/// The `resource` label of a request whose path names a resource not known to be served
/// (its `group`, `version` and `subresource` labels empty).
pub const OTHER_RESOURCE: &str = "other";

/// The resource labels of one request's metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceLabels {
    pub group: String,
    pub version: String,
    pub resource: String,
    pub subresource: String,
}

/// The resources requests have been labelled with. A client's path names any group, version,
/// resource and subresource it likes; a label for each would let any client, authenticated or
/// not, grow every request metric without bound. kube-apiserver records its request metrics
/// only in the handlers of the resources it serves. Here a resource becomes a label once a
/// request for it was answered in a way only a served resource is: from the cache, or by the
/// apiserver with a success or a code that needs the resource to exist (304, 409, 410, 422,
/// 429); until then, and past [`MAX_RESOURCE_LABELS`], its requests are counted as
/// [`OTHER_RESOURCE`]. A 404 (no such resource, or no such object), 401, 403, 400 or 5xx
/// teaches nothing.
#[derive(Debug, Default)]
pub struct KnownResources {
    known: parking_lot::RwLock<std::collections::HashSet<String>>,
}

impl KnownResources {
    /// Whether an answer with `code` from the apiserver shows that the resource exists.
    pub fn shows_served(code: http::StatusCode) -> bool {
        code.is_success() || matches!(code.as_u16(), 304 | 409 | 410 | 422 | 429)
    }

    /// The labels of a request for `group`/`version`/`resource`/`subresource` (as the path
    /// gave them), `served` when its answer shows the resource exists. A request that names
    /// no resource (discovery, `/version`, `/healthz`) has none of the four labels.
    pub fn labels(
        &self,
        group: &str,
        version: &str,
        resource: &str,
        subresource: &str,
        served: bool,
    ) -> ResourceLabels {
        if resource.is_empty() {
            return ResourceLabels::default();
        }
        let key = format!("{group}\0{version}\0{resource}\0{subresource}");
        let known = self.known.read().contains(&key)
            || (served && {
                let mut k = self.known.write();
                k.contains(&key) || (k.len() < MAX_RESOURCE_LABELS && k.insert(key))
            });
        if known {
            ResourceLabels {
                group: group.into(),
                version: version.into(),
                resource: resource.into(),
                subresource: subresource.into(),
            }
        } else {
            ResourceLabels {
                resource: OTHER_RESOURCE.into(),
                ..ResourceLabels::default()
            }
        }
    }

    /// How many resources are labels now.
    pub fn len(&self) -> usize {
        self.known.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
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

/// A read the cache path handed to the apiserver, and why (`reason`: a fixed string of
/// `read::delegate`, e.g. `resource not cached`, `resourceVersion not reached`).
///
/// `verb` is exported upper-case (`LIST`, `WATCH`, `GET`) whatever case it is given in (the
/// authorization verb, `list`): the apiserver's convention in `apiserver_request_total`,
/// and the one of every other `verb` label here.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct PassthroughLabels {
    pub verb: String,
    pub resource: String,
    pub reason: String,
}

impl prometheus_client::encoding::EncodeLabelSet for PassthroughLabels {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeLabel as _;
        ("verb", self.verb.to_ascii_uppercase()).encode(encoder.encode_label())?;
        ("resource", self.resource.as_str()).encode(encoder.encode_label())?;
        ("reason", self.reason.as_str()).encode(encoder.encode_label())
    }
}

pub struct Metrics {
    registry: Mutex<Registry>,
    pub requests: Family<RequestLabels, Counter>,
    pub request_duration: Family<DurationLabels, Histogram>,
    pub inflight: Family<KindLabels, Gauge>,
    pub upstream_requests: Family<UpstreamLabels, Counter>,
    /// From sending a passed-through request to kube-apiserver until its response head (or
    /// the failure) (`kube_cache_proxy_upstream_request_duration_seconds`): with
    /// `request_duration{served_by="upstream"}` it splits a request's latency into the
    /// apiserver's part and the proxy's.
    pub upstream_request_duration: Family<UpstreamDurationLabels, Histogram>,
    pub connections: Family<KindLabels, Gauge>,
    pub rejected: Family<ReasonLabels, Counter>,
    /// 1 while the last probe of the apiserver's `/readyz` with the proxy's identity
    /// succeeded (a 2xx within the timeout), 0 otherwise and before the first probe
    /// (`serve::state::State::spawn_upstream_probe`, every `upstream.healthCheckInterval`).
    pub upstream_up: Gauge,
    /// Bytes responses have produced for clients and their sockets have not taken yet, over
    /// all connections (`http::budget`).
    pub downstream_buffered: Gauge,
    /// Response bodies that waited for a budget (`budget`: `connection` or `process`).
    pub downstream_waits: Family<BudgetLabels, Counter>,
    /// Reads answered from the cache with a `Warning` because the apiserver was unreachable.
    pub degraded_reads: Counter,
    /// Responses by encoding (`kube_cache_proxy_responses_total`).
    pub responses: Family<EncodingLabels, Counter>,
    /// Body bytes written for clients by encoding, counted as each chunk leaves, so a
    /// long watch is counted while it runs (`kube_cache_proxy_response_bytes_total`).
    pub response_bytes: Family<EncodingLabels, Counter>,
    /// Reads passed through to the apiserver by reason (`kube_cache_proxy_passthrough_total`).
    pub passthrough: Family<PassthroughLabels, Counter>,
    /// Watches passed through to the apiserver and still open, by resource and reason
    /// (`kube_cache_proxy_passthrough_watches`; `verb` is always `watch`): a wave of them
    /// (a restart whose clients landed on the apiserver) shows as a step that stays.
    pub passthrough_watches: Family<PassthroughLabels, Gauge>,
    /// Passed-through watches ended once the cache could serve their clients, by resource
    /// and the reason they were passed through (`kube_cache_proxy_watches_moved_home_total`;
    /// `verb` is always `WATCH`; `serve::homing`).
    pub watches_moved_home: Family<PassthroughLabels, Counter>,
    /// The resources the request metrics may name ([`KnownResources`]).
    pub resources: KnownResources,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BudgetLabels {
    pub budget: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    revision: String,
}

/// The source revision the binary was built from: `KUBE_CACHE_PROXY_REVISION` at build
/// time, else `git rev-parse HEAD` (`build.rs`), else `unknown` (a build from a tarball).
pub const REVISION: &str = env!("KUBE_CACHE_PROXY_REVISION");

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
        let upstream_request_duration =
            Family::<UpstreamDurationLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(UPSTREAM_DURATION_BUCKETS.iter().copied())
            });
        let connections = Family::<KindLabels, Gauge>::default();
        let rejected = Family::<ReasonLabels, Counter>::default();
        let upstream_up = Gauge::default();
        let downstream_buffered = Gauge::default();
        let downstream_waits = Family::<BudgetLabels, Counter>::default();
        let degraded_reads = Counter::default();
        let responses = Family::<EncodingLabels, Counter>::default();
        let response_bytes = Family::<EncodingLabels, Counter>::default();
        let passthrough = Family::<PassthroughLabels, Counter>::default();
        registry.register(
            "kube_cache_proxy_passthrough",
            "Reads (get, list, watch) of resources handed to the apiserver instead of the cache, by verb, resource and reason",
            passthrough.clone(),
        );
        let passthrough_watches = Family::<PassthroughLabels, Gauge>::default();
        registry.register(
            "kube_cache_proxy_passthrough_watches",
            "Watches of resources handed to the apiserver and still open, by resource and reason (verb is always WATCH)",
            passthrough_watches.clone(),
        );
        let watches_moved_home = Family::<PassthroughLabels, Counter>::default();
        registry.register(
            "kube_cache_proxy_watches_moved_home",
            "Watches passed through to the apiserver while the cache could not serve them, ended cleanly once it could so that their clients watch again from the cache, by resource and the reason they were passed through (verb is always WATCH)",
            watches_moved_home.clone(),
        );
        registry.register(
            "kube_cache_proxy_responses",
            "Responses on the API port by verb, resource, body encoding (json, protobuf, cbor, yaml, other, none) and what served them",
            responses.clone(),
        );
        registry.register(
            "kube_cache_proxy_response_bytes",
            "Response body bytes sent on the API port by verb, resource, body encoding and what served them",
            response_bytes.clone(),
        );
        registry.register(
            "kube_cache_proxy_degraded_reads",
            "Reads answered from the cache, with a Warning header, while the apiserver was unreachable",
            degraded_reads.clone(),
        );
        registry.register(
            "kube_cache_proxy_downstream_buffered_bytes",
            "Bytes responses produced for clients that their sockets have not taken yet (server.connectionBufferBytes, server.downstreamBufferBytes bound it)",
            downstream_buffered.clone(),
        );
        registry.register(
            "kube_cache_proxy_downstream_buffer_waits",
            "Response bodies that waited because their connection's (connection) or the process's (process) buffered bytes reached the budget",
            downstream_waits.clone(),
        );
        let build_info = Family::<BuildLabels, Gauge>::default();
        build_info
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").into(),
                revision: REVISION.into(),
            })
            .set(1);
        registry.register(
            "kube_cache_proxy_build_info",
            "Always 1; the version and source revision of the running binary",
            build_info,
        );
        registry.register(
            "kube_cache_proxy_upstream_up",
            "1 while the proxy's last probe of the apiserver's /readyz succeeded, else 0 (unreachable, timed out, or not ready)",
            upstream_up.clone(),
        );
        registry.register_collector(Box::new(process::ProcessCollector));
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
            "kube_cache_proxy_upstream_request_duration_seconds",
            "Requests passed through to kube-apiserver: time from sending one until its response head arrived (or it failed), by verb and resource",
            upstream_request_duration.clone(),
        );
        registry.register(
            "kube_cache_proxy_connections",
            "Open downstream connections by listener (tls, insecure: the API port; admin)",
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
            upstream_request_duration,
            connections,
            rejected,
            upstream_up,
            downstream_buffered,
            downstream_waits,
            degraded_reads,
            responses,
            response_bytes,
            passthrough,
            passthrough_watches,
            watches_moved_home,
            resources: KnownResources::default(),
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

    /// The exposition in `format` (see [`Format::negotiate`]).
    pub fn encode_as(&self, format: Format) -> String {
        match format {
            Format::OpenMetrics => self.encode(),
            Format::Prometheus => text::openmetrics_to_prometheus(&self.encode()),
        }
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

#[cfg(test)]
mod encoding_tests {
    use super::EncodingLabels;

    #[test]
    fn a_responses_encoding_is_its_media_type() {
        let of =
            |v: &'static str| EncodingLabels::encoding_of(Some(&http::HeaderValue::from_static(v)));
        assert_eq!(of("application/json"), "json");
        assert_eq!(of("application/json;stream=watch"), "json");
        assert_eq!(of("application/merge-patch+json"), "json");
        assert_eq!(of("application/vnd.kubernetes.protobuf"), "protobuf");
        assert_eq!(
            of("application/vnd.kubernetes.protobuf;stream=watch"),
            "protobuf"
        );
        assert_eq!(of("application/cbor"), "cbor");
        assert_eq!(of("application/cbor-seq"), "cbor", "CBOR watch streams");
        assert_eq!(of("application/yaml"), "yaml");
        assert_eq!(of("text/plain; charset=utf-8"), "other");
        assert_eq!(EncodingLabels::encoding_of(None), "none");
    }
}

#[cfg(test)]
mod resource_label_tests {
    use super::{KnownResources, MAX_RESOURCE_LABELS, OTHER_RESOURCE, ResourceLabels};

    fn own(g: &str, v: &str, r: &str, s: &str) -> ResourceLabels {
        ResourceLabels {
            group: g.into(),
            version: v.into(),
            resource: r.into(),
            subresource: s.into(),
        }
    }

    fn other() -> ResourceLabels {
        ResourceLabels {
            resource: OTHER_RESOURCE.into(),
            ..ResourceLabels::default()
        }
    }

    /// A resource is a label once an answer showed it exists, and from then on whatever the
    /// answer; before that it is `other`, however many names clients make up.
    #[test]
    fn a_resource_is_a_label_once_it_was_served() {
        let k = KnownResources::default();
        assert_eq!(k.labels("apps", "v1", "deployments", "", false), other());
        assert_eq!(k.labels("x", "v1", "made-up-1", "", false), other());
        assert_eq!(
            k.labels("apps", "v1", "deployments", "", true),
            own("apps", "v1", "deployments", "")
        );
        assert_eq!(
            k.labels("apps", "v1", "deployments", "", false),
            own("apps", "v1", "deployments", ""),
            "a later 404 (no such object) keeps the label"
        );
        // Each of the four parts counts.
        assert_eq!(
            k.labels("apps", "v1", "deployments", "scale", false),
            other()
        );
        assert_eq!(k.labels("apps", "v2", "deployments", "", false), other());
        assert_eq!(k.labels("", "v1", "deployments", "", false), other());
        // Not confused by separators inside a part.
        assert_eq!(
            k.labels("apps", "v1\0deployments", "", "", false),
            ResourceLabels::default()
        );
        assert_eq!(k.labels("apps\0v1", "deployments", "x", "", false), other());
        assert_eq!(k.len(), 1);
        // No resource (discovery, /version): no resource labels at all.
        assert_eq!(
            k.labels("made-up", "v9", "", "", true),
            ResourceLabels::default()
        );
        assert_eq!(k.len(), 1);
    }

    #[test]
    fn at_most_max_resource_labels_are_learnt() {
        let k = KnownResources::default();
        for i in 0..MAX_RESOURCE_LABELS + 10 {
            k.labels("g", "v1", &format!("r{i}"), "", true);
        }
        assert_eq!(k.len(), MAX_RESOURCE_LABELS);
        assert_eq!(
            k.labels("g", "v1", "r0", "", false),
            own("g", "v1", "r0", "")
        );
        let last = format!("r{}", MAX_RESOURCE_LABELS + 5);
        assert_eq!(k.labels("g", "v1", &last, "", true), other());
    }

    #[test]
    fn only_answers_a_served_resource_gets_teach() {
        use http::StatusCode;
        for c in [200, 201, 304, 409, 410, 422, 429] {
            assert!(
                KnownResources::shows_served(StatusCode::from_u16(c).unwrap()),
                "{c}"
            );
        }
        for c in [400, 401, 403, 404, 405, 406, 415, 500, 503] {
            assert!(
                !KnownResources::shows_served(StatusCode::from_u16(c).unwrap()),
                "{c}"
            );
        }
    }
}

#[cfg(test)]
mod verb_label_tests {
    use super::*;

    /// Every `verb` label is the apiserver's upper-case one, the passthrough counters' too
    /// (they are given the lower-case authorization verb).
    #[test]
    fn passthrough_verbs_are_upper_case_as_in_the_request_metrics() {
        let m = Metrics::new();
        m.passthrough
            .get_or_create(&PassthroughLabels {
                verb: "list".into(),
                resource: "pods".into(),
                reason: "selector".into(),
            })
            .inc();
        let text = m.encode();
        assert!(
            text.contains(
                "kube_cache_proxy_passthrough_total{verb=\"LIST\",resource=\"pods\",reason=\"selector\"} 1"
            ),
            "{text}"
        );
        assert!(!text.contains("verb=\"list\""), "{text}");
    }
}
