//! The API port is the apiserver's whole surface; the proxy's own health, `/metrics` and
//! `/debug/*` are on the admin listener, `/metrics` and `/debug/*` behind authentication and a
//! non-resource SubjectAccessReview (kube-rbac-proxy's model), with an explicit opt-out.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{TestProxy, body_json, body_string};
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use kube_cache_proxy::config::AdminAuth;
use serde_json::json;

const BOUND: Duration = Duration::from_secs(20);

/// What only the fake apiserver's `/metrics` says.
const FAKE_METRICS: &str = "# TYPE apiserver_flowcontrol_dispatched_requests_total counter\n\
apiserver_flowcontrol_dispatched_requests_total{flow_schema=\"fake\",priority_level=\"fake\"} 7\n";

async fn fake() -> FakeApiServer {
    let fake = FakeApiServer::start().await;
    fake.faults().set_metrics(|_| FAKE_METRICS.to_string());
    fake
}

/// `/metrics`, health (with sub-paths and `?verbose`/`?exclude`), `/version`, `/openapi/*` and
/// `/debug/*` on the API port are the apiserver's answers, sent up with the caller's own
/// credentials (none for an anonymous caller).
#[tokio::test]
async fn the_api_port_passes_the_apiservers_own_endpoints_through() {
    let fake = fake().await;
    let proxy = TestProxy::start(&fake.url(), |_| {}).await;
    for h2 in [false, true] {
        let c = proxy.client(None, h2);
        for token in [Some("alice"), None] {
            fake.clear_requests();
            let get = async |path: &str| {
                let r = c.get(&proxy.https(path), token).await;
                (r.status().as_u16(), body_string(r).await)
            };
            let (code, m) = get("/metrics").await;
            assert_eq!((code, m.as_str()), (200, FAKE_METRICS), "h2={h2}");
            for ep in ["livez", "readyz", "healthz"] {
                let (code, body) = get(&format!("/{ep}?verbose")).await;
                assert_eq!(code, 200, "{ep}: {body}");
                assert_eq!(
                    body,
                    format!("[+]ping ok\n[+]etcd ok\n[+]fake-apiserver ok\n{ep} check passed\n")
                );
                assert_eq!(get(&format!("/{ep}")).await, (200, "ok".into()));
                assert_eq!(get(&format!("/{ep}/etcd")).await, (200, "ok".into()));
            }
            // The proxy's own checks are not on this port: the apiserver has no such check.
            let (code, _) = get("/readyz/upstream").await;
            assert_ne!(code, 200);
            let (code, body) = get("/readyz?verbose&exclude=etcd").await;
            assert_eq!(code, 200);
            assert!(body.contains("[+]fake-apiserver ok"), "{body}");
            let (code, v) = get("/version").await;
            assert_eq!(code, 200);
            let v: serde_json::Value = serde_json::from_str(&v).unwrap();
            // The fake's build, not the proxy's.
            assert_eq!(v["gitCommit"], "0".repeat(40));
            assert_eq!(v["buildDate"], "2026-01-01T00:00:00Z");
            let (code, o) = get("/openapi/v2").await;
            assert_eq!(code, 200);
            assert!(o.contains("Kubernetes (fake apiserver)"), "{o}");
            assert_eq!(
                get("/debug/pprof/").await,
                (200, "fake apiserver debug endpoint\n".into())
            );
            assert_eq!(
                get("/debug/paging").await,
                (200, "fake apiserver debug endpoint\n".into())
            );
            // Each went up as the caller: its own token, or no credentials at all.
            let reqs = fake.requests();
            // (The proxy's own readiness probe asks `/readyz` without a query.)
            for (path, query) in [
                ("/metrics", None),
                ("/livez", Some("verbose")),
                ("/readyz", Some("verbose")),
                ("/version", None),
                ("/debug/pprof/", None),
            ] {
                let r = reqs
                    .iter()
                    .find(|r| r.path == path && r.query.as_deref() == query)
                    .unwrap_or_else(|| panic!("{path} did not reach the apiserver"));
                assert_eq!(
                    r.headers
                        .get("authorization")
                        .map(|v| v.to_str().unwrap().to_string()),
                    token.map(|t| format!("Bearer {t}")),
                    "{path}"
                );
            }
        }
    }
    proxy.shutdown().await;
}

async fn admin_get(proxy: &TestProxy, path: &str, token: Option<&str>) -> (u16, String) {
    let r = proxy
        .client(None, false)
        .get(&proxy.admin(path), token)
        .await;
    (r.status().as_u16(), body_string(r).await)
}

/// Health is open; `/metrics` and `/debug/*` need a caller the proxy authenticates (401) and
/// a SubjectAccessReview allowing the non-resource URL (403 in the apiserver's words).
#[tokio::test]
async fn the_admin_listener_protects_metrics_and_debug_as_kube_rbac_proxy_does() {
    let fake = fake().await;
    fake.faults().deny("mallory");
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.server.admin_auth = AdminAuth::Kubernetes;
    })
    .await;
    let body = eventually("the proxy's own readiness", BOUND, async || {
        let (code, body) = admin_get(&proxy, "/readyz?verbose", None).await;
        ok_if(code == 200, body)
    })
    .await;
    assert_eq!(
        body,
        "[+]ping ok\n[+]shutdown ok\n[+]upstream ok\nreadyz check passed\n"
    );
    assert_eq!(admin_get(&proxy, "/livez", None).await, (200, "ok".into()));
    // One check's detail is not for anonymous callers (tests below).
    assert_eq!(admin_get(&proxy, "/healthz/ping", None).await.0, 403);
    let (code, body) = admin_get(&proxy, "/readyz?verbose&exclude=upstream", None).await;
    assert_eq!(code, 200);
    assert!(body.contains("[+]upstream excluded: ok"), "{body}");

    for path in ["/metrics", "/debug/paging"] {
        for token in [None, Some("invalid-token")] {
            let r = proxy
                .client(None, true)
                .get(&proxy.admin(path), token)
                .await;
            assert_eq!(r.status(), 401, "{path} {token:?}");
            let s = body_json(r).await;
            assert_eq!(
                (s["kind"].as_str(), s["reason"].as_str(), s["code"].as_u64()),
                (Some("Status"), Some("Unauthorized"), Some(401)),
                "{s}"
            );
        }
        let r = proxy
            .client(None, false)
            .get(&proxy.admin(path), Some("mallory"))
            .await;
        assert_eq!(r.status(), 403, "{path}");
        let s = body_json(r).await;
        assert_eq!(s["reason"], "Forbidden");
        assert_eq!(
            s["message"],
            format!(
                "forbidden: User \"mallory\" cannot get path \"{path}\": denied by the fake apiserver's deny list"
            )
        );
    }
    let (code, m) = admin_get(&proxy, "/metrics", Some("prometheus")).await;
    assert_eq!(code, 200);
    assert!(m.contains("kube_cache_proxy_"), "{m}");
    assert!(!m.contains("apiserver_flowcontrol"), "{m}");
    let (code, d) = admin_get(&proxy, "/debug/paging", Some("prometheus")).await;
    assert_eq!(code, 200);
    assert!(
        serde_json::from_str::<serde_json::Value>(&d).unwrap()["pageSize"].is_object(),
        "{d}"
    );
    // The reviews asked about the non-resource URL, nothing else.
    let reviews: Vec<serde_json::Value> = fake
        .requests()
        .iter()
        .filter(|r| r.path == "/apis/authorization.k8s.io/v1/subjectaccessreviews")
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    let prometheus: Vec<&serde_json::Value> = reviews
        .iter()
        .filter(|r| r["spec"]["user"] == "prometheus")
        .map(|r| &r["spec"])
        .collect();
    assert_eq!(prometheus.len(), 2, "{reviews:?}");
    assert_eq!(
        prometheus[0]["nonResourceAttributes"],
        json!({"path": "/metrics", "verb": "get"})
    );
    assert!(prometheus[0].get("resourceAttributes").is_none());
    // Decisions are cached as resource reviews are.
    assert_eq!(
        admin_get(&proxy, "/metrics", Some("prometheus")).await.0,
        200
    );
    let n = fake
        .requests()
        .iter()
        .filter(|r| r.path == "/apis/authorization.k8s.io/v1/subjectaccessreviews")
        .count();
    assert_eq!(n, reviews.len());

    // Not found after authorization; other methods 405; no other paths.
    let (code, body) = admin_get(&proxy, "/debug/nothing", Some("prometheus")).await;
    assert_eq!(code, 404, "{body}");
    assert_eq!(admin_get(&proxy, "/debug/nothing", None).await.0, 401);
    let (code, body) = admin_get(&proxy, "/api/v1/pods", Some("prometheus")).await;
    assert_eq!(code, 404);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["reason"],
        "NotFound"
    );
    let r = proxy
        .client(None, false)
        .send(
            Request::builder()
                .method(Method::POST)
                .uri(proxy.admin("/metrics"))
                .header("authorization", "Bearer prometheus")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
    assert_eq!(r.status(), 405);
    assert_eq!(body_json(r).await["reason"], "MethodNotAllowed");
    // Nothing of the admin listener reached the apiserver as a request of its own.
    assert!(
        fake.requests()
            .iter()
            .all(|r| r.path != "/debug/paging" && r.path != "/debug/nothing"),
    );
    proxy.shutdown().await;
}

/// Plain `/readyz` and `/livez` are open for probes, and so is `?verbose`, as on the
/// apiserver (`system:public-info-viewer`), but without credentials no cached resource is
/// named (custom ones included) and one check's detail is refused in the apiserver's words
/// (`forbidden: User "system:anonymous" cannot get path "/readyz/etcd"`, measured on
/// kube-apiserver 1.36); an authorized caller sees every check.
#[tokio::test]
async fn health_detail_needs_an_authorized_caller_as_on_the_apiserver() {
    let fake = fake().await;
    fake.faults().deny("mallory");
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.server.admin_auth = AdminAuth::Kubernetes;
        c.cache.resources = vec!["configmaps".into()];
    })
    .await;
    let full = eventually("the proxy's own readiness", BOUND, async || {
        let (code, body) = admin_get(&proxy, "/readyz?verbose", Some("alice")).await;
        ok_if(code == 200, body)
    })
    .await;
    assert_eq!(
        full,
        "[+]ping ok\n[+]shutdown ok\n[+]upstream ok\n[+]cache:configmaps ok\nreadyz check passed\n"
    );
    assert_eq!(admin_get(&proxy, "/readyz", None).await, (200, "ok".into()));
    assert_eq!(admin_get(&proxy, "/livez", None).await, (200, "ok".into()));
    assert_eq!(
        admin_get(&proxy, "/readyz?verbose", None).await,
        (
            200,
            "[+]ping ok\n[+]shutdown ok\n[+]upstream ok\n[+]caches ok\nreadyz check passed\n"
                .into()
        )
    );
    assert_eq!(
        admin_get(&proxy, "/livez?verbose", None).await,
        (200, "[+]ping ok\nlivez check passed\n".into())
    );
    for path in [
        "/readyz/upstream",
        "/readyz/cache:configmaps",
        "/livez/ping",
        "/readyz/nope",
        // A trailing slash is no listing on the apiserver: a path of its own, not public.
        "/readyz/",
        "/livez/",
        "/readyz/a/b",
    ] {
        let (code, body) = admin_get(&proxy, path, None).await;
        assert_eq!(code, 403, "{path}: {body}");
        let s: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            s["message"],
            format!("forbidden: User \"system:anonymous\" cannot get path \"{path}\""),
        );
        assert_eq!(s["reason"], "Forbidden");
    }
    // Credentials are checked when given: 401 for bad ones, 403 when RBAC says no.
    assert_eq!(
        admin_get(&proxy, "/readyz?verbose", Some("invalid-token"))
            .await
            .0,
        401
    );
    let (code, body) = admin_get(&proxy, "/readyz/upstream", Some("mallory")).await;
    assert_eq!(code, 403, "{body}");
    let s: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        s["message"]
            .as_str()
            .unwrap()
            .starts_with("forbidden: User \"mallory\" cannot get path \"/readyz/upstream\""),
        "{body}"
    );
    assert_eq!(
        admin_get(&proxy, "/readyz/cache:configmaps", Some("alice")).await,
        (200, "ok".into())
    );
    assert_eq!(
        admin_get(&proxy, "/readyz/nope", Some("alice")).await.0,
        404
    );
    // kube-apiserver 1.36 to a caller allowed the path: `/readyz/` and `/livez/` are no
    // endpoint (404 `404 page not found`, as for an unknown check), not the plain answer.
    for path in ["/readyz/", "/livez/", "/readyz/a/b"] {
        assert_eq!(
            admin_get(&proxy, path, Some("alice")).await,
            (404, "404 page not found\n".into()),
            "{path}"
        );
    }
    proxy.shutdown().await;
}

/// `server.adminAuth: none` (local use): `/metrics` and `/debug/*` without credentials and
/// without any review.
#[tokio::test]
async fn the_admin_auth_opt_out_serves_metrics_to_anyone() {
    let fake = fake().await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.server.admin_auth = AdminAuth::None;
    })
    .await;
    let (code, m) = admin_get(&proxy, "/metrics", None).await;
    assert_eq!(code, 200);
    assert!(m.contains("kube_cache_proxy_"), "{m}");
    assert_eq!(admin_get(&proxy, "/debug/paging", None).await.0, 200);
    assert!(
        fake.requests()
            .iter()
            .all(|r| !r.path.ends_with("subjectaccessreviews") && !r.path.ends_with("tokenreviews"))
    );
    proxy.shutdown().await;
}
