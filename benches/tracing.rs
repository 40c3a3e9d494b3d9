//! Micro-benchmark: the tracing hooks of one cache-served request (the request span, the
//! `authenticate`, `authorize` and `cache.list` children, one upstream `traceparent`), with
//! tracing off (the default: atomic loads only) and on (sampling ratio 1, every span
//! recorded and queued to the export thread; the exporter points at a closed port, so
//! batches fail and the full queue drops spans, as with a collector that is down).
//!
//! Run: `cargo bench --bench tracing`. Measured on the 2-core dev machine (Dec 2026, shared,
//! load average ~7), median of 50 samples: the harness alone 1.5 ns; off 93 ns per request
//! (four hooks, each one relaxed atomic load, plus this benchmark's empty `HeaderMap` and
//! future nesting); on and sampled 6.3 µs per request (four spans built, recorded and queued,
//! one `traceparent` formatted). A first run under the same load: off 119 ns, on 7.4 µs.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue};
use kube_cache_proxy::config::{OtlpConfig, TracingConfig};
use kube_cache_proxy::telemetry::{self, Attr, Telemetry};

async fn one_request(t: &Telemetry, headers: &HeaderMap) {
    let traced = t.is_on().then(|| {
        t.server_span(
            headers,
            "GET /api/v1/namespaces/{:namespace}/pods".into(),
            vec![
                Attr::new("http.request.method", "GET"),
                Attr::new("kcp.verb", "LIST"),
            ],
        )
    });
    let work = async {
        telemetry::in_span("authenticate", async {}).await;
        telemetry::in_span("authorize", async {
            let mut up = HeaderMap::new();
            telemetry::inject(&mut up);
            black_box(up);
        })
        .await;
        telemetry::in_span("cache.list", async {}).await;
    };
    match traced.flatten() {
        Some(s) => {
            s.run(work).await;
            s.end_with_status(200);
        }
        None => work.await,
    }
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    let off = Telemetry::default();
    let mut headers = HeaderMap::new();
    headers.insert(
        "traceparent",
        HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    );
    let mut g = c.benchmark_group("tracing_hooks_per_request");
    // The harness alone (one `block_on` per iteration), to subtract.
    g.bench_function("baseline_empty", |b| b.to_async(&rt).iter(|| async {}));
    g.bench_function("off", |b| {
        b.to_async(&rt)
            .iter(|| one_request(&off, black_box(&headers)))
    });
    // Started only now: while no proxy in the process has tracing on, the hooks are one
    // atomic load each ("off" above).
    let on = Telemetry::start(&TracingConfig {
        otlp: OtlpConfig {
            endpoint: "http://127.0.0.1:9".into(),
            ..Default::default()
        },
        sampling_ratio: 1.0,
        ..Default::default()
    })
    .unwrap();
    g.bench_function("on_sampled", |b| {
        b.to_async(&rt)
            .iter(|| one_request(&on, black_box(&headers)))
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1)).sample_size(50);
    targets = bench
}
criterion_main!(benches);
