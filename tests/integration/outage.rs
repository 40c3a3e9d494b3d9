//! Serving while the apiserver is down (`upstream::reachability`): callers the apiserver
//! authenticated and authorized before keep reading what the cache holds, with a `Warning`;
//! reads that need newer state get a prompt 503 with `Retry-After`; readiness holds for
//! `cache.maxStaleness`; and once the apiserver answers again, warnings stop and decisions
//! are asked for afresh.
//!
//! Verdicts and decisions are cached for no time at all here (`authentication.cacheTtl`,
//! `cache.authorizationAllowTtl` and `authorizationDenyTtl` zero), so every request during
//! an outage needs a stale one: nothing below passes thanks to an ordinary cache hit.

use std::time::Duration;

use http::header;
use serde_json::{Value, json};

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{TestProxy, body_string};

const GUARD: Duration = Duration::from_secs(30);
const CMS: &str = "/api/v1/namespaces/ns1/configmaps";

/// The fake with one configmap, and the proxy caching configmaps (synced), deciding on every
/// request anew while the apiserver answers.
async fn setup(
    tweak: impl FnOnce(&mut kube_cache_proxy::config::Config),
) -> (FakeApiServer, TestProxy) {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    fake.create(CMS, json!({"metadata": {"name": "cm-1"}}))
        .await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.authentication.cache_ttl = Duration::ZERO;
        c.authentication.failure_cache_ttl = Duration::ZERO;
        c.cache.authorization_allow_ttl = Duration::ZERO;
        c.cache.authorization_deny_ttl = Duration::ZERO;
        c.cache.max_staleness = Duration::from_secs(3600);
        c.lists.wait_for_resource_version = Duration::from_millis(100);
        tweak(c);
    })
    .await;
    eventually("the configmaps cache to sync", GUARD, async || {
        let ready = proxy
            .cache("", "v1", "configmaps")
            .is_some_and(|c| c.is_ready());
        ok_if(ready, "not ready")
    })
    .await;
    (fake, proxy)
}

/// A GET through the proxy's TLS port: (status, `Warning` headers, `Retry-After`, body).
struct Answer {
    code: u16,
    warnings: Vec<String>,
    retry_after: Option<String>,
    body: String,
}

async fn get(proxy: &TestProxy, path: &str, token: &str) -> Answer {
    let r = tokio::time::timeout(
        GUARD,
        proxy
            .client(None, true)
            .get(&proxy.https(path), Some(token)),
    )
    .await
    .unwrap_or_else(|_| panic!("GET {path} got no answer"));
    let code = r.status().as_u16();
    let warnings = r
        .headers()
        .get_all(header::WARNING)
        .iter()
        .map(|v| v.to_str().unwrap().to_string())
        .collect();
    let retry_after = r
        .headers()
        .get(header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap().to_string());
    let body = if path.contains("watch=1") && code == 200 {
        // A watch stream: its headers are the answer.
        String::new()
    } else {
        body_string(r).await
    };
    Answer {
        code,
        warnings,
        retry_after,
        body,
    }
}

/// A sample of the admin listener's `/metrics`.
async fn metric(proxy: &TestProxy, name: &str) -> Option<f64> {
    let (code, text) = proxy.admin_get("/metrics").await;
    assert_eq!(code, 200);
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

async fn readyz_verbose(proxy: &TestProxy) -> (u16, String) {
    proxy.admin_get("/readyz?verbose").await
}

fn tokenreviews(fake: &FakeApiServer) -> usize {
    fake.requests()
        .iter()
        .filter(|r| r.path.ends_with("/tokenreviews"))
        .count()
}

/// Waits until the proxy has noticed the outage (its readiness says degraded).
async fn degraded(proxy: &TestProxy) {
    eventually(
        "readiness to show the upstream degraded",
        GUARD,
        async || {
            let (code, body) = readyz_verbose(proxy).await;
            ok_if(
                code == 200
                    && body.contains(
                        "[+]upstream ok: degraded: the apiserver has been unreachable for ",
                    ),
                (code, body),
            )
        },
    )
    .await;
}

fn assert_warned(a: &Answer, what: &str) {
    assert_eq!(a.code, 200, "{what}: {}", a.body);
    assert_eq!(a.warnings.len(), 1, "{what}: {:?}", a.warnings);
    assert!(
        a.warnings[0].starts_with("299 - \"the apiserver has been unreachable for ")
            && a.warnings[0]
                .ends_with("served from the kube-cache-proxy cache, which may be stale\""),
        "{what}: {:?}",
        a.warnings
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_decided_before_an_outage_keep_reading_the_cache_with_a_warning() {
    let (fake, proxy) = setup(|_| {}).await;
    let list0 = format!("{CMS}?resourceVersion=0");
    // Before the outage: alice and mallory are authenticated and allowed; mallory is then
    // denied, which voids her allowed decision.
    let before = get(&proxy, &list0, "alice").await;
    assert_eq!(before.code, 200, "{}", before.body);
    assert!(before.warnings.is_empty(), "{:?}", before.warnings);
    let rv: u64 =
        serde_json::from_str::<Value>(&before.body).unwrap()["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
    // Decisions are per request attributes (verb, name, ...): an informer's list and watch,
    // and a get, each asked once.
    for path in [
        format!("{CMS}/cm-1?resourceVersion=0"),
        format!("{CMS}?resourceVersion={rv}&resourceVersionMatch=NotOlderThan"),
        format!("{CMS}?watch=1&resourceVersion={rv}"),
    ] {
        let a = get(&proxy, &path, "alice").await;
        assert_eq!(a.code, 200, "{path}: {}", a.body);
    }
    assert_eq!(get(&proxy, &list0, "mallory").await.code, 200);
    fake.faults().deny("mallory");
    assert_eq!(get(&proxy, &list0, "mallory").await.code, 403);

    fake.faults().set_refuse(true);
    fake.faults().drop_watches();
    degraded(&proxy).await;

    // Reads that accept any state: from memory, with a warning.
    assert_warned(
        &get(&proxy, &list0, "alice").await,
        "a resourceVersion=0 list",
    );
    assert_warned(
        &get(&proxy, &format!("{CMS}/cm-1?resourceVersion=0"), "alice").await,
        "a resourceVersion=0 get",
    );
    assert_warned(
        &get(
            &proxy,
            &format!("{CMS}?resourceVersion={rv}&resourceVersionMatch=NotOlderThan"),
            "alice",
        )
        .await,
        "a NotOlderThan list at the cache's resourceVersion",
    );
    assert_warned(
        &get(
            &proxy,
            &format!("{CMS}?watch=1&resourceVersion={rv}"),
            "alice",
        )
        .await,
        "a watch from the cache's resourceVersion",
    );

    // Never served: a question never asked before (bob's token, alice reading another
    // object), and a caller the apiserver denied last.
    let unasked = get(&proxy, &format!("{CMS}/cm-2?resourceVersion=0"), "alice").await;
    assert_eq!(unasked.code, 503, "{}", unasked.body);
    let stranger = get(&proxy, &list0, "bob").await;
    assert_eq!(stranger.code, 503, "{}", stranger.body);
    assert!(
        stranger.body.contains("authentication is unavailable"),
        "{}",
        stranger.body
    );
    let denied = get(&proxy, &list0, "mallory").await;
    assert_eq!(denied.code, 503, "{}", denied.body);
    assert!(
        denied.body.contains("authorization is unavailable"),
        "{}",
        denied.body
    );

    // Reads that need newer state than the cache holds: 503 with Retry-After at once.
    for (path, what) in [
        (CMS.to_string(), "a consistent list"),
        (format!("{CMS}/cm-1"), "a consistent get"),
        (
            format!(
                "{CMS}?resourceVersion={}&resourceVersionMatch=NotOlderThan",
                rv + 1000
            ),
            "a list not older than a resourceVersion the cache lacks",
        ),
    ] {
        let a = get(&proxy, &path, "alice").await;
        assert_eq!(a.code, 503, "{what}: {}", a.body);
        assert_eq!(a.retry_after.as_deref(), Some("1"), "{what}");
        let status: Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(status["kind"], "Status", "{what}");
        assert_eq!(status["reason"], "ServiceUnavailable", "{what}");
        assert!(
            status["message"]
                .as_str()
                .unwrap()
                .starts_with("the apiserver has been unreachable for "),
            "{what}: {status}"
        );
        assert!(a.warnings.is_empty(), "{what}: {:?}", a.warnings);
    }

    // Passthrough requests are the apiserver's: with the connection refused, the proxy's own
    // 503 Status with Retry-After, as before.
    let write = proxy
        .client(None, true)
        .send(
            http::Request::post(proxy.https(CMS))
                .header("authorization", "Bearer alice")
                .header("content-type", "application/json")
                .body(http_body_util::Full::from(
                    json!({"metadata": {"name": "cm-during"}}).to_string(),
                ))
                .unwrap(),
        )
        .await;
    assert_eq!(write.status(), 503);
    assert_eq!(
        write
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap()),
        Some("1")
    );
    assert!(write.headers().get(header::WARNING).is_none());
    let status: Value = serde_json::from_str(&body_string(write).await).unwrap();
    assert_eq!(status["reason"], "ServiceUnavailable", "{status}");

    // Watches that need the apiserver get 429 with Retry-After: client-go then watches again
    // from its resourceVersion, as after the "connection refused" a direct client gets; on a
    // 503 it would list everything again.
    for (path, what) in [
        (format!("{CMS}?watch=1"), "a watch of the latest state"),
        (
            "/api/v1/namespaces/default/secrets?watch=1&resourceVersion=1".to_string(),
            "a watch passed through (an uncached resource)",
        ),
    ] {
        let a = get(&proxy, &path, "alice").await;
        assert_eq!(a.code, 429, "{what}: {}", a.body);
        assert_eq!(a.retry_after.as_deref(), Some("1"), "{what}");
        let status: Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(status["reason"], "TooManyRequests", "{what}: {status}");
    }

    // Visible in the metrics.
    assert_eq!(metric(&proxy, "kube_cache_proxy_degraded").await, Some(1.0));
    assert!(metric(&proxy, "kube_cache_proxy_upstream_unreachable_seconds").await > Some(0.0));
    assert!(metric(&proxy, "kube_cache_proxy_degraded_reads_total").await >= Some(4.0));
    assert!(
        metric(
            &proxy,
            "kube_cache_proxy_authentication_stale_verdicts_total"
        )
        .await
            >= Some(4.0)
    );
    assert!(
        metric(
            &proxy,
            "kube_cache_proxy_authorization_stale_decisions_total"
        )
        .await
            >= Some(4.0)
    );

    // The apiserver is back: no more warnings, and the apiserver decides again.
    fake.faults().set_refuse(false);
    eventually("readiness without degradation", GUARD, async || {
        let (code, body) = readyz_verbose(&proxy).await;
        ok_if(
            code == 200 && body.contains("[+]upstream ok\n"),
            (code, body),
        )
    })
    .await;
    assert_eq!(metric(&proxy, "kube_cache_proxy_degraded").await, Some(0.0));
    assert_eq!(
        metric(&proxy, "kube_cache_proxy_upstream_unreachable_seconds").await,
        Some(0.0)
    );
    let reviews = tokenreviews(&fake);
    let after = get(&proxy, &list0, "alice").await;
    assert_eq!(after.code, 200, "{}", after.body);
    assert!(after.warnings.is_empty(), "{:?}", after.warnings);
    assert_eq!(tokenreviews(&fake), reviews + 1, "a fresh TokenReview");
    assert_eq!(get(&proxy, &list0, "mallory").await.code, 403);
    let consistent = get(&proxy, CMS, "alice").await;
    assert_eq!(consistent.code, 200, "{}", consistent.body);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_decisions_end_after_stale_while_unreachable() {
    let (fake, proxy) = setup(|c| {
        c.authentication.stale_while_unreachable = Duration::from_millis(300);
    })
    .await;
    let list0 = format!("{CMS}?resourceVersion=0");
    assert_eq!(get(&proxy, &list0, "alice").await.code, 200);
    fake.faults().set_refuse(true);
    degraded(&proxy).await;
    // Served stale at most 300 ms past the (zero) TTLs: then 503, never a 200.
    eventually("the stale verdict to run out", GUARD, async || {
        let a = get(&proxy, &list0, "alice").await;
        if a.code == 200 {
            assert_warned(&a, "a stale read");
        }
        ok_if(a.code == 503, (a.code, a.body))
    })
    .await;
    fake.faults().set_refuse(false);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_decisions_are_off_with_zero() {
    let (fake, proxy) = setup(|c| {
        c.authentication.stale_while_unreachable = Duration::ZERO;
    })
    .await;
    let list0 = format!("{CMS}?resourceVersion=0");
    assert_eq!(get(&proxy, &list0, "alice").await.code, 200);
    fake.faults().set_refuse(true);
    degraded(&proxy).await;
    let a = get(&proxy, &list0, "alice").await;
    assert_eq!(a.code, 503, "{}", a.body);
    fake.faults().set_refuse(false);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_once_the_outage_is_longer_than_max_staleness() {
    let (fake, proxy) = setup(|c| {
        c.cache.max_staleness = Duration::from_millis(300);
    })
    .await;
    let list0 = format!("{CMS}?resourceVersion=0");
    assert_eq!(get(&proxy, &list0, "alice").await.code, 200);
    fake.faults().set_refuse(true);
    eventually("readiness to fail", GUARD, async || {
        let (code, body) = readyz_verbose(&proxy).await;
        ok_if(
            code == 500 && body.contains("[-]upstream failed: reason withheld"),
            (code, body),
        )
    })
    .await;
    let (code, why) = proxy.admin_get("/readyz/upstream").await;
    assert_eq!(code, 500);
    assert!(
        why.contains("longer than cache.maxStaleness (300ms)"),
        "{why}"
    );
    assert_eq!(metric(&proxy, "kube_cache_proxy_degraded").await, Some(0.0));
    assert!(metric(&proxy, "kube_cache_proxy_upstream_unreachable_seconds").await > Some(0.3));
    // Still served from memory to those who can be (readiness only steers new traffic).
    assert_warned(
        &get(&proxy, &list0, "alice").await,
        "a read after readiness failed",
    );
    fake.faults().set_refuse(false);
    eventually("readiness to come back", GUARD, async || {
        let (code, body) = readyz_verbose(&proxy).await;
        ok_if(code == 200, (code, body))
    })
    .await;
    proxy.shutdown().await;
}

/// As a kube-apiserver stopped with SIGSTOP: connections are accepted, nothing is answered.
/// The proxy finds out (its probe times out), then answers without waiting on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_apiserver_is_found_unreachable_and_reads_go_on_without_waiting() {
    let (fake, proxy) = setup(|_| {}).await;
    let list0 = format!("{CMS}?resourceVersion=0");
    assert_eq!(get(&proxy, &list0, "alice").await.code, 200);
    fake.faults().set_freeze(true);
    degraded(&proxy).await;
    assert_warned(
        &get(&proxy, &list0, "alice").await,
        "a resourceVersion=0 list",
    );
    // No TokenReview or SubjectAccessReview is sent while frozen: none would be answered.
    let reviews = tokenreviews(&fake);
    assert_warned(&get(&proxy, &list0, "alice").await, "again");
    assert_eq!(tokenreviews(&fake), reviews);
    let a = get(&proxy, CMS, "alice").await;
    assert_eq!(a.code, 503, "{}", a.body);
    assert_eq!(a.retry_after.as_deref(), Some("1"));
    let stranger = get(&proxy, &list0, "bob").await;
    assert_eq!(stranger.code, 503, "{}", stranger.body);
    fake.faults().set_freeze(false);
    eventually("the outage to end", GUARD, async || {
        let (code, body) = readyz_verbose(&proxy).await;
        ok_if(
            code == 200 && body.contains("[+]upstream ok\n"),
            (code, body),
        )
    })
    .await;
    let after = get(&proxy, &list0, "bob").await;
    assert_eq!(after.code, 200, "{}", after.body);
    assert!(after.warnings.is_empty(), "{:?}", after.warnings);
    proxy.shutdown().await;
}
