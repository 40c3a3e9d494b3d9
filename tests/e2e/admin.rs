//! The API port is the apiserver's whole surface, against a real kube-apiserver: `/metrics`,
//! health, `/version`, `/openapi` and `/debug` through the proxy are the apiserver's answers
//! (an anonymous caller gets exactly the apiserver's refusal, an admin its metrics). The
//! proxy's own endpoints are on the admin listener, protected with real RBAC: 401 without
//! credentials, the apiserver's own 403 for a user without the `/metrics` grant, 200 once the
//! shipped metrics-reader ClusterRole is bound. `promtool check metrics` (built by
//! `tests/e2e/build-promtool.sh`) accepts the proxy's `/metrics`.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::{TestProxy, body_string};
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::config::AdminAuth;
use serde_json::Value;

const BOUND: Duration = Duration::from_secs(90);

async fn send(
    c: &crate::support::proxy::Https,
    method: Method,
    url: &str,
    token: Option<&str>,
    body: Option<String>,
) -> (u16, String) {
    let mut b = Request::builder().method(method).uri(url);
    if let Some(t) = token {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    if body.is_some() {
        b = b.header("content-type", "application/json");
    }
    let r = c
        .request(
            b.body(Full::new(body.map(Bytes::from).unwrap_or_default()))
                .unwrap(),
        )
        .await
        .unwrap();
    let code = r.status().as_u16();
    let b = r.into_body().collect().await.unwrap().to_bytes();
    (code, String::from_utf8_lossy(&b).into_owned())
}

/// The metrics-reader ClusterRole as shipped in the Kustomize base.
fn shipped_metrics_reader() -> Value {
    let rbac = include_str!("../../deploy/kustomize/base/rbac.yaml");
    rbac.split("\n---\n")
        .map(|d| serde_saphyr::from_str::<Value>(d).unwrap())
        .find(|d| d["metadata"]["name"] == "kube-cache-proxy-metrics-reader")
        .expect("the metrics-reader ClusterRole in deploy/kustomize/base/rbac.yaml")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_port_is_the_apiservers_and_the_admin_port_is_guarded_by_rbac() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("tokens.csv");
    let proxy = TestProxy::start_for(&cp, Some(&token_file), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.server.admin_auth = AdminAuth::Kubernetes;
    })
    .await;
    let direct = crate::support::proxy::apiserver_client(&cp.ca_pem, false);
    let pc = proxy.client(None, false);
    let admin = cp.admin_token().to_string();
    let via_proxy = async |path: &str, token: Option<&str>| {
        let r = pc.get(&proxy.https(path), token).await;
        (r.status().as_u16(), body_string(r).await)
    };
    let at_apiserver = async |path: &str, token: Option<&str>| {
        send(
            &direct,
            Method::GET,
            &format!("{}{path}", cp.url),
            token,
            None,
        )
        .await
    };

    // Anonymous: exactly the apiserver's answer (its 401 or 403 Status, or its "ok").
    for path in ["/metrics", "/debug/pprof/", "/version", "/livez"] {
        let d = at_apiserver(path, None).await;
        let p = via_proxy(path, None).await;
        assert_eq!(p, d, "anonymous {path}");
    }
    let (code, body) = via_proxy("/metrics", None).await;
    assert!(code == 401 || code == 403, "{code} {body}");

    // The admin gets the apiserver's metrics (APF included), not the proxy's.
    let (code, m) = via_proxy("/metrics", Some(&admin)).await;
    assert_eq!(code, 200);
    assert!(m.contains("\napiserver_request_total{"), "{m}");
    assert!(m.contains("apiserver_flowcontrol_"), "{m}");
    assert!(!m.contains("kube_cache_proxy_"), "{m}");
    // The apiserver's health checks, with its own check names, sub-paths and exclusions.
    let (code, r) = via_proxy("/readyz?verbose", Some(&admin)).await;
    assert_eq!(code, 200, "{r}");
    assert!(
        r.contains("[+]etcd ok") && r.ends_with("readyz check passed\n"),
        "{r}"
    );
    assert!(!r.contains("[+]upstream ok"), "{r}");
    let (code, r) = via_proxy("/livez?verbose&exclude=etcd", Some(&admin)).await;
    assert_eq!(code, 200, "{r}");
    assert!(r.contains("[+]etcd excluded: ok"), "{r}");
    assert_eq!(
        via_proxy("/healthz/etcd", Some(&admin)).await,
        at_apiserver("/healthz/etcd", Some(&admin)).await
    );
    let (code, v) = via_proxy("/version", Some(&admin)).await;
    assert_eq!(code, 200);
    let (_, dv) = at_apiserver("/version", Some(&admin)).await;
    assert_eq!(
        serde_json::from_str::<Value>(&v).unwrap(),
        serde_json::from_str::<Value>(&dv).unwrap()
    );
    let (code, o) = via_proxy("/openapi/v3", Some(&admin)).await;
    assert_eq!(code, 200);
    assert!(serde_json::from_str::<Value>(&o).unwrap()["paths"].is_object());

    // The admin listener: the proxy's own health, open; the per-resource checks are shown
    // to an authorized caller only (anonymous callers see one `caches` check).
    let ready = eventually("the proxy's own readiness", BOUND, async || {
        let r = proxy
            .client(None, false)
            .get(&proxy.admin("/readyz?verbose"), Some(&admin))
            .await;
        let code = r.status();
        let body = body_string(r).await;
        ok_if(code == 200, body)
    })
    .await;
    assert!(ready.contains("[+]upstream ok\n"), "{ready}");
    assert!(ready.contains("[+]cache:configmaps ok\n"), "{ready}");
    let (code, public) = proxy.admin_get("/readyz?verbose").await;
    assert_eq!(code, 200, "{public}");
    assert!(public.contains("[+]caches ok\n"), "{public}");
    assert!(!public.contains("cache:"), "{public}");
    // /metrics: 401 without credentials; the apiserver's own 403 for a user without the
    // grant (the same Status as alice gets from the apiserver's /metrics directly).
    let (code, body) = proxy.admin_get("/metrics").await;
    assert_eq!(code, 401, "{body}");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["reason"],
        "Unauthorized"
    );
    let alice = cp.user("alice").token.clone();
    let bob = cp.user("bob").token.clone();
    let admin_listener = async |path: &str, token: &str| {
        let r = pc.get(&proxy.admin(path), Some(token)).await;
        (r.status().as_u16(), body_string(r).await)
    };
    let (code, denied) = admin_listener("/metrics", &alice).await;
    assert_eq!(code, 403, "{denied}");
    let denied: Value = serde_json::from_str(&denied).unwrap();
    let (dcode, direct_denied) = at_apiserver("/metrics", Some(&alice)).await;
    assert_eq!(dcode, 403, "{direct_denied}");
    let direct_denied: Value = serde_json::from_str(&direct_denied).unwrap();
    assert_eq!(denied["message"], direct_denied["message"]);
    assert_eq!(denied["reason"], "Forbidden");
    assert_eq!(
        denied["message"],
        "forbidden: User \"alice\" cannot get path \"/metrics\""
    );
    // The shipped role, bound to bob: 200 with the proxy's own metrics.
    let role = shipped_metrics_reader();
    let (code, body) = send(
        &direct,
        Method::POST,
        &format!("{}/apis/rbac.authorization.k8s.io/v1/clusterroles", cp.url),
        Some(&admin),
        Some(role.to_string()),
    )
    .await;
    assert_eq!(code, 201, "{body}");
    let binding = serde_json::json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "e2e-metrics-reader"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "kube-cache-proxy-metrics-reader"},
        "subjects": [{"kind": "User", "name": "bob", "apiGroup": "rbac.authorization.k8s.io"}],
    });
    let (code, body) = send(
        &direct,
        Method::POST,
        &format!(
            "{}/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            cp.url
        ),
        Some(&admin),
        Some(binding.to_string()),
    )
    .await;
    assert_eq!(code, 201, "{body}");
    // RBAC's informers take the binding in shortly; bob was never asked before, so no cached
    // denial stands in the way.
    let m = eventually("bob's grant to reach the authorizer", BOUND, async || {
        let (code, body) = admin_listener("/metrics", &bob).await;
        ok_if(code == 200, format!("{code} {body}"))
    })
    .await;
    assert!(m.contains("kube_cache_proxy_requests_total"), "{m}");
    assert!(!m.contains("apiserver_request_total"), "{m}");
    // The role grants /metrics only: /debug/paging stays forbidden.
    assert_eq!(admin_listener("/debug/paging", &bob).await.0, 403);
    assert_eq!(admin_listener("/debug/paging", &admin).await.0, 200);
    proxy.shutdown().await;
    cp.stop().await;
}

/// `promtool` (built once by `tests/e2e/build-promtool.sh`, cached under
/// ~/.cache/kube-cache-proxy/promtool/).
fn promtool() -> std::path::PathBuf {
    let out = std::process::Command::new("bash")
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/build-promtool.sh"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("running build-promtool.sh");
    assert!(out.status.success(), "build-promtool.sh failed");
    let dir = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .expect("build-promtool.sh prints its bin directory")
        .trim()
        .to_string();
    std::path::PathBuf::from(dir).join("promtool")
}

/// `promtool check metrics` accepts a scrape of a proxy that has served, passed through and
/// expired requests in front of a real apiserver (every family with samples): exit 0, no
/// findings. It exited 3 with 17 "no help text" findings when `/metrics` was OpenMetrics only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_proxys_metrics() {
    use std::io::Write;
    let promtool = tokio::task::spawn_blocking(promtool).await.unwrap();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let proxy = TestProxy::start_for(&cp, None, |c| {
        c.cache.resources = vec!["configmaps".into(), "namespaces".into()];
    })
    .await;
    eventually("the proxy to be ready", BOUND, async || {
        let (code, body) = proxy.admin_get("/readyz?verbose").await;
        ok_if(code == 200, body)
    })
    .await;
    let c = proxy.client(None, false);
    let admin = cp.admin_token().to_string();
    for path in [
        "/api/v1/configmaps?limit=1",
        "/api/v1/namespaces/default",
        // An old resourceVersion: 410, or (backfilled from the apiserver) a stream the
        // timeout ends.
        "/api/v1/configmaps?watch=1&resourceVersion=1&timeoutSeconds=2",
        "/version",
    ] {
        let r = c.get(&proxy.https(path), Some(&admin)).await;
        body_string(r).await;
    }
    for accept in [None, Some("text/plain;version=0.0.4")] {
        let mut b = Request::get(proxy.admin("/metrics"));
        if let Some(a) = accept {
            b = b.header("accept", a);
        }
        let r = c.send(b.body(Full::new(Bytes::new())).unwrap()).await;
        assert_eq!(r.status(), 200);
        let text = body_string(r).await;
        assert!(
            text.contains("kube_cache_proxy_watches_expired_total"),
            "{text}"
        );
        let mut child = std::process::Command::new(&promtool)
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "promtool check metrics ({accept:?}):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
