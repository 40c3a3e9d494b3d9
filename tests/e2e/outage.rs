//! A real kube-apiserver frozen with SIGSTOP (issue 23): a caller authenticated by
//! TokenReview before keeps listing with `resourceVersion=0` through the proxy, from memory
//! with a `Warning`; a read of the latest state gets 503 with `Retry-After` at once; the
//! admin listener's `/readyz` stays 200 (degraded). After SIGCONT the warnings stop.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::{TestProxy, body_string};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};

const BOUND: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_apiserver_leaves_token_callers_reading_the_cache_with_a_warning() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    // No token file for the proxy: the admin's token is judged by TokenReview, and every
    // request needs a fresh verdict and decision (zero TTLs) or, frozen, a stale one.
    let proxy = TestProxy::start_for(&cp, None, |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.authentication.cache_ttl = Duration::ZERO;
        c.cache.authorization_allow_ttl = Duration::ZERO;
    })
    .await;
    eventually("the configmaps cache to sync", BOUND, async || {
        let ready = proxy
            .cache("", "v1", "configmaps")
            .is_some_and(|c| c.is_ready());
        ok_if(ready, "not ready")
    })
    .await;
    // Decisions are keyed by the RBAC generations: wait until the four RBAC caches synced and
    // voided every decision (at once and a second later each), so the decision below stays.
    let authz = proxy.running.as_ref().unwrap().state.authz.clone();
    eventually("the RBAC caches to sync", BOUND, async || {
        let n = authz
            .stats
            .rbac_invalidations
            .load(std::sync::atomic::Ordering::Relaxed);
        ok_if(n >= 8, n)
    })
    .await;
    let token = cp.admin_token().to_string();
    let client = proxy.client(None, true);
    let list0 = proxy.https("/api/v1/namespaces/default/configmaps?resourceVersion=0");
    let r = client.get(&list0, Some(&token)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("warning").is_none());

    let frozen = cp.freeze_apiserver().expect("SIGSTOP");
    eventually(
        "readiness to show the upstream degraded",
        BOUND,
        async || {
            let (code, body) = proxy.admin_get("/readyz?verbose").await;
            ok_if(
                code == 200 && body.contains("[+]upstream ok: degraded"),
                (code, body),
            )
        },
    )
    .await;
    let r = tokio::time::timeout(BOUND, client.get(&list0, Some(&token)))
        .await
        .expect("an answer while frozen");
    let (code, warning) = (
        r.status(),
        r.headers()
            .get("warning")
            .map(|v| v.to_str().unwrap().to_string()),
    );
    assert_eq!(code, 200, "{}", body_string(r).await);
    assert!(
        warning
            .as_deref()
            .is_some_and(|w| w.starts_with("299 - \"the apiserver has been unreachable for ")),
        "{warning:?}"
    );
    let latest = proxy.https("/api/v1/namespaces/default/configmaps");
    let r = tokio::time::timeout(BOUND, client.get(&latest, Some(&token)))
        .await
        .expect("an answer while frozen");
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.headers().get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    assert_eq!(proxy.admin_get("/readyz").await, (200, "ok".to_string()));
    let (_, metrics) = proxy.admin_get("/metrics").await;
    assert!(
        metrics.contains("\nkube_cache_proxy_degraded 1\n"),
        "{metrics}"
    );

    frozen.thaw().expect("SIGCONT");
    eventually("the outage to end", BOUND, async || {
        let (code, body) = proxy.admin_get("/readyz?verbose").await;
        ok_if(
            code == 200 && body.contains("[+]upstream ok\n"),
            (code, body),
        )
    })
    .await;
    let r = client.get(&list0, Some(&token)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("warning").is_none());
    proxy.shutdown().await;
    cp.stop().await;
}
