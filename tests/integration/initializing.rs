//! Reads while a resource's cache initializes: answered as kube-apiserver answers while its
//! watch cache initializes (k8s.io/apiserver `storage/cacher`, ResilientWatchCacheInitialization),
//! not passed through to stay there. The proxy's own LIST is refused (403) until the test
//! lets it through, so the cache is starting for as long as the test needs, without timing:
//! every watch waits (bounded) and is then refused with 429 "storage is (re)initializing" and
//! `Retry-After`; a GET and a LIST with a limit and no selector go to the apiserver (one-shot,
//! as the cacher delegates them); a LIST it would not delegate gets 429 too. Once the cache
//! has synced, the same watches are served from it, and no client watch ever reached the
//! apiserver.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{TestProxy, body_json};
use crate::support::watch_validator::sum_metric;
use serde_json::json;

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(30);
const NS: &str = "init";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_while_the_cache_initializes_are_asked_to_retry_and_never_stay_on_the_apiserver() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
        .await;
    fake.create(
        &format!("/api/v1/namespaces/{NS}/configmaps"),
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "namespace": NS}}),
    )
    .await;
    // The proxy may not list configmaps yet: its cache stays in its first sync.
    fake.faults().deny_resources_of("proxy-token", true);
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        // The bounded wait of a watch (and of a list the cacher would not delegate) for a
        // starting cache: short, since this cache cannot sync meanwhile.
        c.lists.wait_for_resource_version = Duration::from_millis(100);
    })
    .await;
    eventually("the configmaps cache to exist", GUARD, async || {
        ok_if(proxy.cache("", "v1", "configmaps").is_some(), "no cache")
    })
    .await;
    let cache = proxy.cache("", "v1", "configmaps").unwrap();
    assert!(!cache.is_ready() && cache.starting());

    let client = proxy.client(None, true);
    let base = proxy.https(&format!("/api/v1/namespaces/{NS}/configmaps"));
    let watches = [
        "?watch=1&resourceVersion=0&allowWatchBookmarks=true",
        "?watch=1&allowWatchBookmarks=true",
        "?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true",
        "?watch=1&resourceVersion=1&allowWatchBookmarks=true",
    ];
    for q in watches {
        let r = client.get(&format!("{base}{q}"), Some("alice")).await;
        let (code, retry_after) = (r.status(), r.headers().get("retry-after").cloned());
        let s = body_json(r).await;
        assert_eq!(code, 429, "{q}: {s}");
        // Growing with the cache's time in initialization, as the apiserver's.
        let secs = s["details"]["retryAfterSeconds"].as_u64().unwrap();
        assert!((1..=30).contains(&secs), "{s}");
        assert_eq!(retry_after.unwrap(), secs.to_string().as_str(), "{q}");
        assert_eq!(s["message"], "storage is (re)initializing", "{q}: {s}");
        assert_eq!(s["reason"], "TooManyRequests", "{q}: {s}");
    }
    // A LIST the cacher would not delegate (no limit, or a selector): 429 as well.
    for q in ["", "?labelSelector=x%3Dy&limit=10"] {
        let r = client.get(&format!("{base}{q}"), Some("alice")).await;
        assert_eq!(r.status(), 429, "list {q:?}");
    }
    // One-shot reads the cacher delegates: the apiserver answers them.
    let r = client.get(&format!("{base}?limit=10"), Some("alice")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(body_json(r).await["items"][0]["metadata"]["name"], "a");
    let r = client.get(&format!("{base}/a"), Some("alice")).await;
    assert_eq!(r.status(), 200);

    // The proxy may list again: its cache syncs, and the same watches are the cache's.
    fake.faults().deny_resources_of("proxy-token", false);
    eventually(
        "the configmaps cache to sync and its watch to be up",
        GUARD,
        async || ok_if(cache.is_ready() && cache.unhealthy().is_none(), "not ready"),
    )
    .await;
    let resume = format!(
        "?watch=1&resourceVersion={}&allowWatchBookmarks=true",
        cache.rv()
    );
    for q in watches.iter().take(3).copied().chain([resume.as_str()]) {
        let q = format!("{q}&timeoutSeconds=1");
        let r = client.get(&format!("{base}{q}"), Some("alice")).await;
        assert_eq!(r.status(), 200, "{q}");
    }
    let (_, metrics) = proxy.admin_get("/metrics").await;
    let passthrough = |verb: &str| {
        sum_metric(
            &metrics,
            "kube_cache_proxy_passthrough_total",
            &[&format!("verb=\"{verb}\""), "resource=\"configmaps\""],
        )
    };
    assert_eq!(passthrough("WATCH"), 0.0, "no watch went to the apiserver");
    assert_eq!(passthrough("LIST"), 1.0, "the LIST with a limit");
    assert_eq!(passthrough("GET"), 1.0, "the GET");
    let served = sum_metric(
        &metrics,
        "kube_cache_proxy_requests_total",
        &[
            "verb=\"WATCH\"",
            "resource=\"configmaps\"",
            "served_by=\"cache\"",
            "code=\"200\"",
        ],
    );
    let lines: Vec<_> = metrics
        .lines()
        .filter(|l| l.starts_with("kube_cache_proxy_requests_total") && l.contains("WATCH"))
        .collect();
    assert_eq!(served, watches.len() as f64, "{lines:#?}");
    // The apiserver never saw a client's watch: only the proxy's own.
    let client_watches = fake
        .requests()
        .iter()
        .filter(|r| {
            r.path.ends_with("/configmaps")
                && r.query.as_deref().unwrap_or("").contains("watch=")
                && r.headers
                    .get(http::header::AUTHORIZATION)
                    .is_none_or(|v| v != "Bearer proxy-token")
        })
        .count();
    assert_eq!(client_watches, 0);

    // A watch the apiserver does serve (of a resource not cached) counts among the open
    // passthrough watches for as long as its stream is open.
    let open = async || {
        let (_, m) = proxy.admin_get("/metrics").await;
        sum_metric(
            &m,
            "kube_cache_proxy_passthrough_watches",
            &["reason=\"resource not cached\""],
        )
    };
    assert_eq!(open().await, 0.0);
    let w = proxy
        .watch_plain(
            &format!("/api/v1/namespaces/{NS}/pods?watch=1"),
            "alice",
            false,
        )
        .await;
    assert_eq!(open().await, 1.0);
    drop(w);
    eventually(
        "the passthrough watch to be counted out",
        GUARD,
        async || {
            let n = open().await;
            ok_if(n == 0.0, n)
        },
    )
    .await;
    proxy.shutdown().await;
}
