//! OpenTelemetry tracing through the proxy: a caller's W3C trace context is continued by the
//! proxy's spans (exported to an in-process OTLP receiver) and sent on to the fake apiserver
//! naming the proxy's span; a malformed `traceparent` is ignored; with tracing off the
//! caller's headers reach the apiserver unchanged and nothing is exported.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::{FakeApiServer, LoggedRequest};
use crate::support::otlp::{OtlpReceiver, ReceivedSpan};
use crate::support::proxy::{TestProxy, plain_client};
use serde_json::json;

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(30);

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn traceparent(trace: &str, span: &str) -> String {
    format!("00-{trace}-{span}-01")
}

async fn get(proxy: &TestProxy, path: &str, headers: &[(&str, &str)]) -> u16 {
    let mut b = http::Request::get(proxy.http(path)).header("authorization", "Bearer alice-token");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let r = plain_client(false)
        .request(b.body(http_body_util::Full::default()).unwrap())
        .await
        .unwrap();
    r.status().as_u16()
}

async fn setup(receiver: Option<&OtlpReceiver>, ratio: f64) -> (FakeApiServer, TestProxy) {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "a"}}))
        .await;
    fake.create(
        "/api/v1/namespaces/a/configmaps",
        json!({"metadata": {"name": "cm-1"}}),
    )
    .await;
    let endpoint = receiver.map(OtlpReceiver::url).unwrap_or_default();
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.tracing.otlp.endpoint = endpoint;
        c.tracing.sampling_ratio = ratio;
        c.tracing.service_name = "kcp-under-test".into();
    })
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    // Synced and its watch confirmed: until then a list without resourceVersion passes
    // through (bounded consistency), and the traced list must be the cache's.
    eventually("the configmaps cache to sync", GUARD, async || {
        let ready = state
            .caches
            .get("", "v1", "configmaps")
            .is_some_and(|c| c.is_ready() && c.unhealthy().is_none());
        ok_if(ready, ready)
    })
    .await;
    (fake, proxy)
}

/// The `traceparent` the fake apiserver received on requests to `path`.
fn upstream_traceparents(fake: &FakeApiServer, path: &str) -> Vec<String> {
    fake.requests()
        .iter()
        .filter(|r: &&LoggedRequest| r.path == path)
        .filter_map(|r| r.headers.get("traceparent"))
        .map(|v| v.to_str().unwrap().to_string())
        .collect()
}

async fn spans_until(
    receiver: &OtlpReceiver,
    proxy: &TestProxy,
    what: &str,
    done: impl Fn(&[ReceivedSpan]) -> bool,
) -> Vec<ReceivedSpan> {
    let telemetry = proxy
        .running
        .as_ref()
        .unwrap()
        .state
        .upstream
        .telemetry()
        .clone();
    eventually(what, GUARD, async || {
        telemetry.flush().await;
        let spans = receiver.spans();
        let names: Vec<String> = spans.iter().map(|s| s.name.clone()).collect();
        ok_if(done(&spans), names).map(|_| spans.clone())
    })
    .await
}

#[tokio::test]
async fn a_callers_trace_continues_through_the_cache_and_the_passthrough() {
    let receiver = OtlpReceiver::start().await;
    let (fake, proxy) = setup(Some(&receiver), 0.0).await;
    let tp = traceparent(TRACE, CLIENT_SPAN);

    // A LIST served from the cache: authenticated (TokenReview) and authorized (SAR) first.
    let code = get(
        &proxy,
        "/api/v1/namespaces/a/configmaps",
        &[("traceparent", &tp), ("user-agent", "tracing-test/1")],
    )
    .await;
    assert_eq!(code, 200);
    // A request the apiserver answers (pods are not cached here).
    let code = get(&proxy, "/api/v1/namespaces/a/pods", &[("traceparent", &tp)]).await;
    assert_eq!(code, 200);

    let spans = spans_until(&receiver, &proxy, "the requests' spans", |s| {
        s.iter().filter(|s| s.kind == 2).count() >= 2
            && s.iter().any(|s| s.name == "passthrough")
            && s.iter().any(|s| s.name == "cache.list")
    })
    .await;
    let ours: Vec<&ReceivedSpan> = spans.iter().filter(|s| s.trace_id == TRACE).collect();
    let server = |name: &str| {
        *ours
            .iter()
            .find(|s| s.kind == 2 && s.name == name)
            .unwrap_or_else(|| panic!("no server span {name}: {ours:#?}"))
    };
    let list = server("GET /api/v1/namespaces/{:namespace}/configmaps");
    assert_eq!(list.parent_span_id, CLIENT_SPAN, "{list:#?}");
    assert_eq!(list.service, "kcp-under-test");
    assert_eq!(list.attr("kcp.served_by"), Some("cache"), "{list:#?}");
    assert_eq!(list.attr("http.response.status_code"), Some("200"));
    assert_eq!(list.attr("http.request.method"), Some("GET"));
    assert_eq!(list.attr("kcp.verb"), Some("LIST"));
    assert_eq!(list.attr("kcp.resource"), Some("configmaps"));
    assert_eq!(list.attr("k8s.namespace.name"), Some("a"));
    assert_eq!(list.attr("user_agent.original"), Some("tracing-test/1"));
    // No credentials on spans.
    assert!(
        !list.attributes.values().any(|v| v.contains("alice")),
        "{list:#?}"
    );
    let child = |name: &str, parent: &ReceivedSpan| {
        *ours
            .iter()
            .find(|s| s.name == name && s.parent_span_id == parent.span_id)
            .unwrap_or_else(|| panic!("no child {name} of {}: {ours:#?}", parent.name))
    };
    let authn = child("authenticate", list);
    let authz = child("authorize", list);
    child("cache.list", list);
    assert_eq!(authz.attr("kcp.authz.decision"), Some("allow"));
    // The reviews the proxy made for this request name their spans upstream.
    let tr = upstream_traceparents(&fake, "/apis/authentication.k8s.io/v1/tokenreviews");
    assert!(tr.contains(&traceparent(TRACE, &authn.span_id)), "{tr:?}");
    let sar = upstream_traceparents(&fake, "/apis/authorization.k8s.io/v1/subjectaccessreviews");
    assert!(sar.contains(&traceparent(TRACE, &authz.span_id)), "{sar:?}");

    // The passthrough: the apiserver is sent the proxy's span, not the caller's.
    let secrets = server("GET /api/v1/namespaces/{:namespace}/pods");
    assert_eq!(secrets.parent_span_id, CLIENT_SPAN);
    assert_eq!(secrets.attr("kcp.served_by"), Some("apiserver"));
    let pass = child("passthrough", secrets);
    assert_eq!(pass.kind, 3, "a client span");
    assert_eq!(pass.attr("http.response.status_code"), Some("200"));
    let up = upstream_traceparents(&fake, "/api/v1/namespaces/a/pods");
    assert_eq!(up, [traceparent(TRACE, &pass.span_id)]);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_malformed_traceparent_is_ignored_not_refused() {
    let receiver = OtlpReceiver::start().await;
    let (fake, proxy) = setup(Some(&receiver), 1.0).await;
    let bad = [
        "nonsense",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-ff-ff-ff-ff-ff-ff-ff-ff-ff",
    ];
    for (i, tp) in bad.iter().enumerate() {
        let path = format!("/api/v1/namespaces/a/secrets/s{i}");
        let code = get(
            &proxy,
            &path,
            &[("traceparent", tp), ("tracestate", "=,=,,")],
        )
        .await;
        // The fake's 404 for a secret that does not exist: the request went through.
        assert_eq!(code, 404, "{tp}");
        let cached = get(
            &proxy,
            "/api/v1/namespaces/a/configmaps",
            &[("traceparent", tp)],
        )
        .await;
        assert_eq!(cached, 200, "{tp}");
        // A fresh trace goes upstream, well-formed, not the caller's.
        let up = upstream_traceparents(&fake, &path);
        assert_eq!(up.len(), 1, "{tp}: {up:?}");
        let parts: Vec<&str> = up[0].split('-').collect();
        assert_eq!(parts.len(), 4, "{up:?}");
        assert_eq!(parts[1].len(), 32);
        assert_ne!(parts[1], TRACE, "{tp}");
        assert_eq!(parts[3], "01", "sampled by samplingRatio 1");
    }
    // And the requests' spans are roots of their own traces.
    let spans = spans_until(&receiver, &proxy, "the server spans", |s| {
        s.iter().filter(|s| s.kind == 2).count() >= 2 * bad.len()
    })
    .await;
    for s in spans.iter().filter(|s| s.kind == 2) {
        assert!(s.parent_span_id.is_empty(), "{s:#?}");
        assert_ne!(s.trace_id, TRACE);
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn the_caches_own_list_and_watch_are_traced() {
    let receiver = OtlpReceiver::start().await;
    let (fake, proxy) = setup(Some(&receiver), 1.0).await;
    let spans = spans_until(&receiver, &proxy, "the reflector's spans", |s| {
        s.iter().any(|s| s.name == "LIST configmaps")
            && s.iter().any(|s| s.name == "WATCH configmaps")
    })
    .await;
    let list = spans.iter().find(|s| s.name == "LIST configmaps").unwrap();
    assert!(list.parent_span_id.is_empty(), "a root: {list:#?}");
    assert_eq!(list.kind, 3);
    assert_eq!(list.attr("http.response.status_code"), Some("200"));
    assert_eq!(list.attr("kcp.resource"), Some("configmaps"));
    let up = upstream_traceparents(&fake, "/api/v1/configmaps");
    assert!(
        up.contains(&traceparent(&list.trace_id, &list.span_id)),
        "{up:?} {list:#?}"
    );
    let watch = spans.iter().find(|s| s.name == "WATCH configmaps").unwrap();
    assert!(
        up.contains(&traceparent(&watch.trace_id, &watch.span_id)),
        "{up:?} {watch:#?}"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn with_tracing_off_the_callers_trace_context_reaches_the_apiserver_unchanged() {
    let receiver = OtlpReceiver::start().await;
    let (fake, proxy) = setup(None, 1.0).await;
    assert!(
        !proxy
            .running
            .as_ref()
            .unwrap()
            .state
            .upstream
            .telemetry()
            .is_on()
    );
    let tp = traceparent(TRACE, CLIENT_SPAN);
    let code = get(
        &proxy,
        "/api/v1/namespaces/a/pods",
        &[("traceparent", &tp), ("tracestate", "vendor=opaque")],
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(
        get(
            &proxy,
            "/api/v1/namespaces/a/configmaps",
            &[("traceparent", &tp)]
        )
        .await,
        200
    );
    let got: Vec<LoggedRequest> = fake
        .requests()
        .into_iter()
        .filter(|r| r.path == "/api/v1/namespaces/a/pods")
        .collect();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].headers.get("traceparent").unwrap(), tp.as_str());
    assert_eq!(got[0].headers.get("tracestate").unwrap(), "vendor=opaque");
    // The proxy's own requests carry none.
    let reviews =
        upstream_traceparents(&fake, "/apis/authorization.k8s.io/v1/subjectaccessreviews");
    assert!(reviews.is_empty(), "{reviews:?}");
    proxy.shutdown().await;
    // Nothing was exported: the receiver was never told about, and heard nothing.
    assert_eq!(receiver.posts(), 0);
}

#[tokio::test]
async fn spans_queued_at_shutdown_are_flushed_before_the_proxy_stops() {
    let receiver = OtlpReceiver::start().await;
    let (_fake, proxy) = setup(Some(&receiver), 0.0).await;
    let tp = traceparent(TRACE, CLIENT_SPAN);
    assert_eq!(
        get(
            &proxy,
            "/api/v1/namespaces/a/configmaps",
            &[("traceparent", &tp)]
        )
        .await,
        200
    );
    // No flush asked: the batch would wait its 5 s schedule. The graceful shutdown (as on
    // SIGTERM) sends what is queued once the drain is over, before it returns.
    proxy.shutdown().await;
    let spans = receiver.spans();
    assert!(
        spans
            .iter()
            .any(|s| s.kind == 2 && s.trace_id == TRACE && s.parent_span_id == CLIENT_SPAN),
        "{spans:#?}"
    );
}
