//! OpenTelemetry tracing: spans exported over OTLP (HTTP/protobuf), and W3C trace context
//! (`traceparent`, `tracestate`) honoured from callers and sent upstream.
//!
//! Off unless an OTLP endpoint is configured ([`crate::config::TracingConfig`]): then no
//! exporter, no thread and no span exist, and every hook here is one relaxed atomic load.
//!
//! On, the pipeline opens one server span per request ([`Telemetry::server_span`]), a child of
//! the caller's span when its `traceparent` is valid (a malformed one is ignored: a new root),
//! and runs the request under it ([`Traced::run`]). Code below it opens child spans with
//! [`in_span`] without being handed anything: the span context travels in the OpenTelemetry
//! [`Context`] attached to the running future, with the tracer beside it, so a proxy without
//! tracing (tests run several in one process) never sees another's. Every request to the
//! apiserver made while such a context is attached carries a `traceparent` naming the
//! current span ([`inject`], called by `upstream`); with tracing off a caller's own headers
//! pass through untouched.
//!
//! Spans are batched (the SDK's batch processor: its own thread, a bounded queue that drops
//! when full) and never block a request; export failures are logged at most once a minute
//! (`ExportClient`). [`Telemetry::shutdown`] flushes what is queued.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{
    FutureExt as _, TraceContextExt as _, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_http::{HeaderExtractor, HeaderInjector, HttpClient, HttpError};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

use crate::config::TracingConfig;

pub use opentelemetry::KeyValue as Attr;
pub use opentelemetry::trace::SpanKind;

/// How many proxies in this process have tracing on: the hooks' fast path when none has.
static ON: AtomicUsize = AtomicUsize::new(0);

fn any_on() -> bool {
    ON.load(Ordering::Relaxed) != 0
}

/// One proxy's tracing: off ([`Telemetry::default`]) or an OTLP exporter with its tracer.
#[derive(Clone, Default)]
pub struct Telemetry {
    inner: Option<Arc<Inner>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("on", &self.inner.is_some())
            .finish()
    }
}

struct Inner {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
}

impl Drop for Inner {
    fn drop(&mut self) {
        ON.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The tracer of the proxy whose span a [`Context`] carries: child spans come from it.
#[derive(Clone)]
struct Tracing(Arc<Inner>);

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("tracing.otlp.endpoint: {0}")]
    Endpoint(String),
    #[error("building the OTLP exporter: {0}")]
    Exporter(String),
    #[error("the OTLP client's TLS roots: {0}")]
    Tls(#[source] std::io::Error),
}

/// How long one export may take (the OTLP exporter specification's default timeout).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most of a collector's response read (opentelemetry-http's own clients' limit).
const MAX_RESPONSE: usize = 4 << 20;
/// At most one log line about failed exports per this interval.
const FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(60);

impl Telemetry {
    /// Tracing as `cfg` and the environment say: off without an endpoint (see
    /// [`TracingConfig::endpoint`]). Must run inside a Tokio runtime (the exporter's HTTP
    /// client runs on it).
    ///
    /// # Errors
    /// An endpoint that is not an `http(s)` URL (from `OTEL_EXPORTER_OTLP_ENDPOINT`: the
    /// file's is validated with the rest), or an exporter that cannot be built.
    pub fn start(cfg: &TracingConfig) -> Result<Telemetry, TelemetryError> {
        let Some(base) = cfg.endpoint(|k| std::env::var(k).ok()) else {
            return Ok(Telemetry::default());
        };
        crate::config::check_endpoint(&base).map_err(TelemetryError::Endpoint)?;
        let url = format!("{}/v1/traces", base.trim_end_matches('/'));
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url)
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_timeout(EXPORT_TIMEOUT)
            .with_http_client(ExportClient::new()?)
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                cfg.sampling_ratio,
            ))))
            .with_resource(
                opentelemetry_sdk::Resource::builder_empty()
                    .with_service_name(cfg.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer("kube-cache-proxy");
        ON.fetch_add(1, Ordering::Relaxed);
        tracing::info!(endpoint = %base, sampling_ratio = cfg.sampling_ratio, "exporting OpenTelemetry spans");
        Ok(Telemetry {
            inner: Some(Arc::new(Inner { tracer, provider })),
        })
    }

    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// The span of one request on the API port, a child of the caller's span when its
    /// `traceparent` is valid (otherwise a new root: a malformed header is ignored, never an
    /// error). `None` when tracing is off.
    pub fn server_span(
        &self,
        headers: &HeaderMap,
        name: String,
        attrs: Vec<KeyValue>,
    ) -> Option<Traced> {
        let inner = self.inner.as_ref()?;
        let parent = TraceContextPropagator::new()
            .extract_with_context(&Context::new(), &HeaderExtractor(headers));
        let span = inner
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .with_attributes(attrs)
            .start_with_context(&inner.tracer, &parent);
        Some(Traced(
            parent.with_span(span).with_value(Tracing(inner.clone())),
        ))
    }

    /// A span that starts a trace of the proxy's own (the cache's upstream LIST and WATCH):
    /// sampled by `tracing.samplingRatio`. `None` when tracing is off.
    pub fn root_span(&self, name: String, attrs: Vec<KeyValue>) -> Option<Traced> {
        let inner = self.inner.as_ref()?;
        let span = inner
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .with_attributes(attrs)
            .start_with_context(&inner.tracer, &Context::new());
        Some(Traced(
            Context::new()
                .with_span(span)
                .with_value(Tracing(inner.clone())),
        ))
    }

    /// Runs `fut` in a new trace of the proxy's own ([`Telemetry::root_span`]), or just runs
    /// it when tracing is off.
    pub async fn in_root_span<F: Future>(
        &self,
        name: impl FnOnce() -> String,
        attrs: impl FnOnce() -> Vec<KeyValue>,
        fut: F,
    ) -> F::Output {
        if self.inner.is_none() {
            return fut.await;
        }
        match self.root_span(name(), attrs()) {
            Some(t) => {
                let out = t.run(fut).await;
                t.0.span().end();
                out
            }
            None => fut.await,
        }
    }

    /// Exports what is queued now (tests; [`Telemetry::shutdown`] does it too).
    pub async fn flush(&self) {
        if let Some(inner) = self.inner.clone() {
            // The batch processor's flush blocks until its thread has exported.
            let _ = tokio::task::spawn_blocking(move || inner.provider.force_flush()).await;
        }
    }

    /// Flushes the queued spans and stops the exporter (at shutdown, after the drain).
    pub async fn shutdown(&self) {
        if let Some(inner) = self.inner.clone() {
            let r = tokio::task::spawn_blocking(move || inner.provider.shutdown()).await;
            if let Ok(Err(e)) = r {
                tracing::debug!(error = %e, "stopping the span exporter");
            }
        }
    }
}

/// A span's context, attached to the work it covers with [`Traced::run`].
#[derive(Clone)]
pub struct Traced(Context);

impl Traced {
    /// Runs `fut` with this span as the current one (child spans and upstream requests made
    /// by it name this span as their parent).
    pub fn run<F: Future>(&self, fut: F) -> opentelemetry::trace::WithContext<F> {
        fut.with_context(self.0.clone())
    }

    pub fn set(&self, kv: KeyValue) {
        self.0.span().set_attribute(kv);
    }

    /// Records an HTTP status code (an error status for 5xx, as OpenTelemetry's HTTP
    /// conventions for servers) and ends the span.
    pub fn end_with_status(&self, code: u16) {
        let span = self.0.span();
        span.set_attribute(KeyValue::new("http.response.status_code", i64::from(code)));
        if code >= 500 {
            span.set_status(opentelemetry::trace::Status::error(""));
        }
        span.end();
    }

    /// The W3C `traceparent` naming this span.
    pub fn traceparent(&self) -> Option<String> {
        let mut h = HeaderMap::new();
        TraceContextPropagator::new().inject_context(&self.0, &mut HeaderInjector(&mut h));
        h.get("traceparent")?.to_str().ok().map(str::to_string)
    }
}

/// A child of the current span, when a traced request is running (`None` otherwise).
pub fn child(name: &'static str, kind: SpanKind, attrs: Vec<KeyValue>) -> Option<Traced> {
    if !any_on() {
        return None;
    }
    Context::map_current(|cx| {
        let t = cx.get::<Tracing>()?;
        let span =
            t.0.tracer
                .span_builder(name)
                .with_kind(kind)
                .with_attributes(attrs)
                .start_with_context(&t.0.tracer, cx);
        Some(Traced(cx.with_span(span)))
    })
}

/// Runs `fut` in a child span `name` of the current span when a traced request is running;
/// otherwise just runs it.
pub fn in_span<F: Future>(name: &'static str, fut: F) -> InSpan<F> {
    in_span_of(name, SpanKind::Internal, fut)
}

/// [`in_span`] of a given kind (`Client`: a request to the apiserver).
pub fn in_span_of<F: Future>(name: &'static str, kind: SpanKind, fut: F) -> InSpan<F> {
    InSpan {
        span: child(name, kind, Vec::new()),
        fut,
    }
}

pin_project_lite::pin_project! {
    /// The future of [`in_span`]: `fut`, polled with its span as the current one (when a
    /// traced request is running), the span ended when `fut` completes.
    ///
    /// A plain future holding `fut` once. As two nested `async fn`s taking `fut` by value,
    /// each of their states held a copy of it: a cache-served watch's future (11 KB in a
    /// debug build) took 33 KB, allocated for every watch request and held while it waits
    /// (10,000 JSON watches waiting together for the cache to reach their resourceVersion
    /// held 316 MB in the load driver's `pb-fanout`).
    pub struct InSpan<F> {
        #[pin]
        fut: F,
        span: Option<Traced>,
    }
}

impl<F: Future> Future for InSpan<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<F::Output> {
        let this = self.project();
        let out = match this.span {
            Some(t) => {
                let _current = t.0.clone().attach();
                std::task::ready!(this.fut.poll(cx))
            }
            None => std::task::ready!(this.fut.poll(cx)),
        };
        if let Some(t) = this.span.take() {
            t.0.span().end();
        }
        std::task::Poll::Ready(out)
    }
}

/// The HTTP status code of the current span's request (a `Client` span's answer).
pub fn set_status_code(code: u16) {
    set_current(|| KeyValue::new("http.response.status_code", i64::from(code)));
}

/// Sets an attribute on the current span, if a traced request is running.
pub fn set_current(kv: impl FnOnce() -> KeyValue) {
    if !any_on() {
        return;
    }
    Context::map_current(|cx| {
        if cx.get::<Tracing>().is_some() {
            cx.span().set_attribute(kv());
        }
    });
}

/// Writes the current span's `traceparent` (and `tracestate`, when it has one) into the
/// headers of a request to the apiserver, replacing any there (a caller's, on passthrough).
/// Nothing when no traced request is running: with tracing off, a caller's own headers go
/// on unchanged.
pub fn inject(headers: &mut HeaderMap) {
    if !any_on() {
        return;
    }
    Context::map_current(|cx| {
        if cx.get::<Tracing>().is_none() || !cx.span().span_context().is_valid() {
            return;
        }
        headers.remove("tracestate");
        TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(headers));
        if headers
            .get("tracestate")
            .is_some_and(|v: &HeaderValue| v.is_empty())
        {
            headers.remove("tracestate");
        }
    });
}

/// The exporter's HTTP client: hyper + rustls (the platform's roots), as the rest of the
/// proxy. The batch processor exports from its own thread under a plain executor, so each
/// request runs on the proxy's Tokio runtime and is awaited through its join handle.
struct ExportClient {
    client: hyper_util::client::legacy::Client<
        hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
        http_body_util::Full<Bytes>,
    >,
    rt: tokio::runtime::Handle,
    failures: parking_lot::Mutex<Failures>,
}

/// Export failures since the last line logged about them.
#[derive(Default)]
struct Failures {
    since_logged: u64,
    logged_at: Option<Instant>,
}

impl std::fmt::Debug for ExportClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportClient").finish_non_exhaustive()
    }
}

impl ExportClient {
    fn new() -> Result<ExportClient, TelemetryError> {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_native_roots(rustls::crypto::aws_lc_rs::default_provider())
            .map_err(TelemetryError::Tls)?
            .https_or_http()
            .enable_http1()
            .build();
        let client =
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(90))
                .build(https);
        let rt = tokio::runtime::Handle::try_current()
            .map_err(|e| TelemetryError::Exporter(format!("no Tokio runtime: {e}")))?;
        Ok(ExportClient {
            client,
            rt,
            failures: Default::default(),
        })
    }

    async fn send(&self, req: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        use http_body_util::BodyExt as _;
        let client = self.client.clone();
        // Named in the failure line: an export that cannot connect says where it tried.
        let target = req.uri().clone();
        let (parts, body) = req.into_parts();
        let req = Request::from_parts(parts, http_body_util::Full::new(body));
        let task = self.rt.spawn(async move {
            let fut = async {
                let resp = client.request(req).await?;
                let (parts, body) = resp.into_parts();
                let body = http_body_util::Limited::new(body, MAX_RESPONSE)
                    .collect()
                    .await?
                    .to_bytes();
                Ok::<_, HttpError>(Response::from_parts(parts, body))
            };
            match tokio::time::timeout(EXPORT_TIMEOUT, fut).await {
                Ok(r) => r,
                Err(_) => Err(format!("no answer within {EXPORT_TIMEOUT:?}").into()),
            }
        });
        let r = match task.await {
            Ok(r) => r,
            Err(e) => Err(e.into()),
        };
        match &r {
            Ok(resp) if resp.status().is_success() => {}
            Ok(resp) => self.failed(&format!(
                "POST {target}: the collector answered {}",
                resp.status()
            )),
            Err(e) => self.failed(&format!("POST {target}: {}", error_chain(e.as_ref()))),
        }
        r
    }

    /// Logs an export failure, at most once per [`FAILURE_LOG_INTERVAL`] with the count
    /// since the last line: a collector that is down must not flood the proxy's log.
    fn failed(&self, why: &str) {
        let mut f = self.failures.lock();
        f.since_logged += 1;
        if f.logged_at
            .is_none_or(|t| t.elapsed() >= FAILURE_LOG_INTERVAL)
        {
            tracing::warn!(failures = f.since_logged, error = %why, "exporting spans failed; spans are dropped");
            f.since_logged = 0;
            f.logged_at = Some(Instant::now());
        }
    }
}

/// An error and its sources, `: `-separated (hyper's own text is only `client error
/// (Connect)`; the cause, e.g. `Connection refused`, is in its sources).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = s.source();
    }
    out
}

impl HttpClient for ExportClient {
    // The trait is declared with `async_trait`: this is its expansion, written out.
    fn send_bytes<'a, 'b>(
        &'a self,
        request: Request<Bytes>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Bytes>, HttpError>> + Send + 'b>>
    where
        'a: 'b,
        Self: 'b,
    {
        Box::pin(self.send(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_bytes(v.as_bytes()).unwrap(),
            );
        }
        h
    }

    fn on() -> Telemetry {
        let cfg = TracingConfig {
            // Nothing listens there: exports fail quietly, which is part of the test.
            otlp: crate::config::OtlpConfig {
                endpoint: "http://127.0.0.1:9".into(),
                ..Default::default()
            },
            sampling_ratio: 1.0,
            ..Default::default()
        };
        Telemetry::start(&cfg).unwrap()
    }

    const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    /// A span around a future adds the span, not copies of the future: every cache-served
    /// watch and list is such a future, allocated per request and held while it waits.
    #[tokio::test]
    async fn a_span_holds_its_future_once() {
        let big = async {
            let buf = [7u8; 4096];
            tokio::task::yield_now().await;
            buf.iter().map(|b| usize::from(*b)).sum::<usize>()
        };
        let inner = std::mem::size_of_val(&big);
        assert!(inner >= 4096, "the test future holds its buffer: {inner}");
        let wrapped = in_span("test", big);
        let outer = std::mem::size_of_val(&wrapped);
        assert!(
            outer <= inner + std::mem::size_of::<Option<Traced>>() + 16,
            "in_span: {outer} bytes around a {inner}-byte future"
        );
        assert_eq!(wrapped.await, 7 * 4096);
    }

    #[tokio::test]
    async fn a_valid_traceparent_is_the_parent_and_a_hostile_one_starts_a_new_trace() {
        let t = on();
        let s = t
            .server_span(&headers(&[("traceparent", PARENT)]), "GET".into(), vec![])
            .unwrap();
        let tp = s.traceparent().unwrap();
        assert!(
            tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-"),
            "{tp}"
        );
        assert!(!tp.contains("b7ad6b7169203331"), "{tp}");
        assert!(tp.ends_with("-01"), "{tp}");
        for bad in [
            "garbage",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra-\u{7f}",
            "00-zz-b7ad6b7169203331-01",
            "",
        ] {
            let Ok(v) = HeaderValue::from_str(bad) else {
                continue;
            };
            let mut h = HeaderMap::new();
            h.insert("traceparent", v);
            h.insert("tracestate", HeaderValue::from_static("=,,=x,k=v=w"));
            let s = t.server_span(&h, "GET".into(), vec![]).unwrap();
            let tp = s.traceparent().unwrap();
            assert!(
                !tp.contains("0af7651916cd43dd8448eb211c80319c"),
                "{bad}: {tp}"
            );
        }
    }

    #[tokio::test]
    async fn upstream_headers_name_the_current_span_only_while_a_traced_request_runs() {
        let t = on();
        let s = t
            .server_span(
                &headers(&[("traceparent", PARENT), ("tracestate", "k=v")]),
                "GET".into(),
                vec![],
            )
            .unwrap();
        let mut out = headers(&[("traceparent", PARENT), ("tracestate", "k=v")]);
        s.run(async { inject(&mut out) }).await;
        assert_eq!(
            out.get("traceparent").unwrap().to_str().unwrap(),
            s.traceparent().unwrap()
        );
        assert_eq!(out.get("tracestate").unwrap(), "k=v");
        // A child span becomes the parent of what is sent inside it.
        let child_tp = s
            .run(async {
                let c = child("authorize", SpanKind::Internal, vec![]).unwrap();
                let mut h = HeaderMap::new();
                c.run(async { inject(&mut h) }).await;
                h.get("traceparent").unwrap().to_str().unwrap().to_string()
            })
            .await;
        assert_ne!(child_tp, s.traceparent().unwrap());
        assert!(child_tp.starts_with("00-0af7651916cd43dd8448eb211c80319c-"));
        // Outside any traced request nothing is touched.
        let mut untouched = headers(&[("traceparent", PARENT)]);
        inject(&mut untouched);
        assert_eq!(untouched.get("traceparent").unwrap(), PARENT);
        assert!(child("x", SpanKind::Internal, vec![]).is_none());
        t.shutdown().await;
    }

    /// The line about a failed export names the collector's address and the cause, not
    /// only hyper's `client error (Connect)`.
    #[tokio::test]
    async fn a_failed_export_is_logged_with_the_endpoint_and_its_cause() {
        #[derive(Clone, Default)]
        struct Buf(Arc<parking_lot::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let writer = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let _guard = tracing::subscriber::set_default(subscriber);
        // A port nothing listens on: bound, then closed.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let client = ExportClient::new().unwrap();
        let req = Request::post(format!("http://{addr}/v1/traces"))
            .body(Bytes::new())
            .unwrap();
        assert!(client.send(req).await.is_err());
        let log = String::from_utf8(buf.0.lock().clone()).unwrap();
        assert!(log.contains("exporting spans failed"), "{log}");
        assert!(
            log.contains(&format!(
                "POST http://{addr}/v1/traces: client error (Connect): "
            )),
            "{log}"
        );
    }

    #[tokio::test]
    async fn off_is_the_default_and_makes_no_spans() {
        let t = Telemetry::start(&TracingConfig::default());
        // (Unless the environment names a collector: then this test says nothing.)
        if std::env::var_os("OTEL_EXPORTER_OTLP_ENDPOINT").is_none() {
            let t = t.unwrap();
            assert!(!t.is_on());
            assert!(
                t.server_span(&HeaderMap::new(), "GET".into(), vec![])
                    .is_none()
            );
            assert!(t.root_span("LIST".into(), vec![]).is_none());
        }
    }
}
