//! The opt-in watch field filters (`X-Kube-Cache-Proxy-Watch-Fields`, `docs/watch-fields.md`)
//! as a client sees them: the apiserver's error order for a malformed header, and the bounds
//! on distinct filters per resource and per identity (`cache.watchFields`).

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{TestProxy, body_json, body_string};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::json;

const BOUND: Duration = Duration::from_secs(30);

fn watch(url: &str, token: &str, fields: &str) -> Request<Full<Bytes>> {
    Request::get(url)
        .header("authorization", format!("Bearer {token}"))
        .header("x-kube-cache-proxy-watch-fields", fields)
        .body(Full::default())
        .unwrap()
}

/// A caller who may not watch learns that before anything about its header: 401 without
/// valid credentials, 403 without permission, and only then 400 for a malformed filter, as
/// kube-apiserver orders its errors. On the cache's path (ConfigMaps) and on the apiserver's
/// (Pods, not cached), where the apiserver's own answer comes first.
#[tokio::test]
async fn a_malformed_filter_is_refused_after_authentication_and_authorization() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    fake.faults().deny("mallory");
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
    })
    .await;
    let c = proxy.client(None, true);
    let rv = fake.current_rv();
    for (resource, applied) in [("configmaps", "applied"), ("pods", "unfiltered")] {
        let url = proxy.https(&format!(
            "/api/v1/namespaces/ns1/{resource}?watch=1&resourceVersion={rv}&timeoutSeconds=1"
        ));
        // The well-formed header first: the cache is ready, and the route is the one meant.
        eventually("a filtered watch served", BOUND, async || {
            let r = c.send(watch(&url, "alice", "data")).await;
            let got = (
                r.status(),
                r.headers()
                    .get("x-kube-cache-proxy-watch-filter")
                    .map(|v| v.to_str().unwrap().to_string()),
            );
            drop(body_string(r).await);
            ok_if(got == (StatusCode::OK, Some(applied.to_string())), got)
        })
        .await;
        for (token, code, reason) in [
            ("invalid-token", StatusCode::UNAUTHORIZED, "Unauthorized"),
            ("mallory", StatusCode::FORBIDDEN, "Forbidden"),
            ("alice", StatusCode::BAD_REQUEST, "BadRequest"),
        ] {
            // The fake apiserver does not authenticate resource requests (only the proxy's
            // reviews): on its path, its 403 for a denied caller stands for its answers.
            if resource == "pods" && code == StatusCode::UNAUTHORIZED {
                continue;
            }
            let r = c.send(watch(&url, token, "spec,-status")).await;
            assert_eq!(r.status(), code, "{resource} as {token}");
            let s = body_json(r).await;
            assert_eq!(s["kind"], "Status", "{resource} as {token}: {s}");
            assert_eq!(s["reason"], reason, "{resource} as {token}: {s}");
            if code == StatusCode::BAD_REQUEST {
                assert!(
                    s["message"]
                        .as_str()
                        .unwrap()
                        .contains("paths are either all selected or all ignored"),
                    "{s}"
                );
            }
        }
    }
    // The header never reaches the apiserver.
    assert!(
        fake.requests()
            .iter()
            .all(|r| !r.headers.contains_key("x-kube-cache-proxy-watch-fields"))
    );
    proxy.shutdown().await;
}

/// Distinct filters beyond `cache.watchFields` get 429 TooManyRequests with Retry-After
/// (client-go's reflector retries it); a filter already in use is admitted (the user's own for
/// the user's bound, anyone's for the resource's); the room comes back as watches end; the
/// metrics count what was refused and the filters in use.
#[tokio::test]
async fn distinct_filters_beyond_the_bounds_are_refused_with_429() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.cache.watch_fields.max_filters_per_resource = 3;
        c.cache.watch_fields.max_filters_per_identity = 2;
    })
    .await;
    let c = proxy.client(None, true);
    let rv = fake.current_rv();
    let url = proxy.https(&format!(
        "/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion={rv}&timeoutSeconds=300"
    ));
    let first = eventually("a filtered watch served", BOUND, async || {
        let r = c.send(watch(&url, "alice", "data")).await;
        match r.status() {
            StatusCode::OK => Ok(r),
            other => Err(other),
        }
    })
    .await;
    assert_eq!(
        first.headers()["x-kube-cache-proxy-watch-filter"],
        "applied"
    );
    let open = async |token: &str, fields: &str| {
        let r = c.send(watch(&url, token, fields)).await;
        (r.status(), r)
    };
    let refused = async |r: http::Response<hyper::body::Incoming>, bound: &str| {
        assert!(r.headers().contains_key("retry-after"), "{:?}", r.headers());
        let s = body_json(r).await;
        assert_eq!(s["kind"], "Status");
        assert_eq!(s["reason"], "TooManyRequests");
        assert_eq!(s["code"], 429);
        assert!(s["message"].as_str().unwrap().contains(bound), "{s}");
    };
    let (code, second) = open("alice", "metadata.labels").await;
    assert_eq!(code, StatusCode::OK);
    // Alice's third distinct filter is over her bound; one she uses is not.
    let (code, r) = open("alice", "metadata.annotations").await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS);
    refused(r, "maxFiltersPerIdentity").await;
    let (code, again) = open("alice", " data ").await;
    assert_eq!(code, StatusCode::OK);
    // Bob's filter is the resource's third; Carol's new one is over the resource's bound, one
    // in use is admitted.
    let (code, bob) = open("bob", "metadata.annotations").await;
    assert_eq!(code, StatusCode::OK);
    let (code, r) = open("carol", "-status").await;
    assert_eq!(code, StatusCode::TOO_MANY_REQUESTS);
    refused(r, "maxFiltersPerResource").await;
    let (code, carol) = open("carol", "metadata.labels").await;
    assert_eq!(code, StatusCode::OK);
    // Unfiltered watches are not counted.
    let r = c
        .send(
            Request::get(&url)
                .header("authorization", "Bearer carol")
                .body(Full::default())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let h1 = proxy.client(None, false);
    let m = body_string(h1.get(&proxy.admin("/metrics"), None).await).await;
    assert!(
        m.contains(r#"kube_cache_proxy_watch_field_filters{resource="configmaps"} 3"#),
        "{m}"
    );
    for reason in ["identity_limit", "resource_limit"] {
        let line = format!(
            r#"kube_cache_proxy_watch_field_filter_refused_total{{resource="configmaps",reason="{reason}"}} 1"#
        );
        assert!(m.contains(&line), "{line}\n{m}");
    }
    // Bob's watch ends: his filter leaves the resource, and Carol's new one fits.
    drop(bob);
    eventually("bob's filter released", BOUND, async || {
        let (code, r) = open("carol", "-status").await;
        ok_if(code == StatusCode::OK, code).map(|_| r)
    })
    .await;
    drop((first, second, again, carol));
    proxy.shutdown().await;
}
