//! Adaptive paging against the fake apiserver: when the upstream's `/metrics` reports rising
//! etcd latency, the controller shrinks its page sizes, the next relist asks the apiserver for
//! smaller pages (visible in the fake's request log), the downstream cap shrinks with it, and
//! both grow back once etcd recovers.
//!
//! The cap is checked as a value (`/debug/paging`): serving downstream pages from the cache is
//! not on this branch yet.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::{FakeApiServer, LoggedRequest};
use crate::support::proxy::{TestProxy, plain_client};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);
const CMS: &str = "/api/v1/namespaces/default/configmaps";

/// An apiserver exposition whose etcd request histogram gains 100 fast (< 5 ms) requests per
/// scrape, plus 100 slow ones (1–2 s) per scrape while `slow` is set.
fn etcd_metrics(slow: Arc<AtomicBool>) -> impl Fn(u64) -> String + Send + Sync + 'static {
    let fast_total = AtomicU64::new(0);
    let slow_total = AtomicU64::new(0);
    move |_| {
        let fast = fast_total.fetch_add(100, Ordering::SeqCst) + 100;
        let slow = if slow.load(Ordering::SeqCst) {
            slow_total.fetch_add(100, Ordering::SeqCst) + 100
        } else {
            slow_total.load(Ordering::SeqCst)
        };
        let l = r#"operation="list",type="/registry/configmaps""#;
        format!(
            "# HELP etcd_request_duration_seconds [ALPHA] Etcd request latency in seconds for each operation and object type.\n\
             # TYPE etcd_request_duration_seconds histogram\n\
             etcd_request_duration_seconds_bucket{{{l},le=\"0.005\"}} {fast}\n\
             etcd_request_duration_seconds_bucket{{{l},le=\"1\"}} {fast}\n\
             etcd_request_duration_seconds_bucket{{{l},le=\"2\"}} {t}\n\
             etcd_request_duration_seconds_bucket{{{l},le=\"+Inf\"}} {t}\n\
             etcd_request_duration_seconds_count{{{l}}} {t}\n\
             # TYPE apiserver_storage_objects gauge\n\
             apiserver_storage_objects{{resource=\"configmaps\"}} 200\n",
            t = fast + slow
        )
    }
}

/// A JSON document from the admin listener (`/debug/paging`).
async fn get_json(proxy: &TestProxy, path: &str) -> Value {
    let (code, b) = proxy.admin_get(path).await;
    assert!((200..300).contains(&code), "{path}: {code}");
    serde_json::from_str(&b).unwrap()
}

/// Polls `/debug/paging` until `f` accepts it (bounded by [`WAIT`]).
async fn debug_until(proxy: &TestProxy, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    eventually(what, WAIT, async || {
        let j = get_json(proxy, "/debug/paging").await;
        ok_if(f(&j), j)
    })
    .await
}

fn upstream_size(j: &Value) -> u64 {
    j["pageSize"]["upstream"].as_u64().unwrap()
}

fn downstream_cap(j: &Value) -> u64 {
    j["pageSize"]["downstream"].as_u64().unwrap()
}

fn query_param(r: &LoggedRequest, key: &str) -> Option<String> {
    r.query.as_deref()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| v.to_string())
    })
}

fn is_watch(r: &LoggedRequest) -> bool {
    query_param(r, "watch").is_some()
}

/// The `limit` of each configmaps LIST page the proxy sent, in order.
fn list_limits(fake: &FakeApiServer) -> Vec<u64> {
    fake.requests()
        .iter()
        .filter(|r| r.path == "/api/v1/configmaps" && !is_watch(r))
        .map(|r| {
            query_param(r, "limit")
                .expect("paged list")
                .parse()
                .unwrap()
        })
        .collect()
}

/// Waits until the fake has received a configmaps watch (the list before it is complete).
async fn wait_for_watch(fake: &FakeApiServer) {
    eventually("a configmaps watch", WAIT, async || {
        let requests = fake.requests();
        let watched = requests
            .iter()
            .any(|r| r.path == "/api/v1/configmaps" && is_watch(r));
        ok_if(watched, requests.len())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rising_etcd_latency_shrinks_the_next_relists_pages_and_the_downstream_cap() {
    let fake = FakeApiServer::start().await;
    for i in 0..200 {
        fake.create(CMS, json!({"metadata": {"name": format!("cm-{i:03}")}}))
            .await;
    }
    let slow = Arc::new(AtomicBool::new(false));
    fake.faults().set_metrics(etcd_metrics(slow.clone()));
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.paging.interval = Duration::from_millis(100);
        c.paging.cap_downstream = true;
    })
    .await;
    wait_for_watch(&fake).await;
    let initial = list_limits(&fake);
    assert!(!initial.is_empty());

    // Idle (no downstream LISTs: QPS factor 0.5), healthy etcd: 100 * 0.5 = 50.
    let idle = debug_until(&proxy, "the idle page size", |j| {
        upstream_size(j) == 50
            && j["current"]["inputs"]["load"]["score"]
                .as_f64()
                .is_some_and(|s| s < 0.1)
    })
    .await;
    assert_eq!(downstream_cap(&idle), 50);
    let etcd_p99 = &idle["current"]["inputs"]["load"]["signals"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "etcdRequestP99Seconds")
        .expect("etcd p99 from the histogram deltas")["value"];
    assert!(etcd_p99.as_f64().unwrap() <= 0.005, "{idle:#}");

    // etcd slows down: p99 between 1 and 2 s, load score 1, load factor 0.4: 100 * 0.5 * 0.4
    // = 20, reached through the moving average.
    slow.store(true, Ordering::SeqCst);
    let overloaded = debug_until(&proxy, "the overloaded page size", |j| {
        upstream_size(j) <= 22
    })
    .await;
    let cur = &overloaded["current"];
    assert_eq!(cur["inputs"]["load"]["score"], 1.0, "{cur:#}");
    assert_eq!(cur["factors"]["load"], 0.4);
    assert_eq!(cur["target"]["upstream"], 20.0);
    assert!(
        downstream_cap(&overloaded) <= 22,
        "the downstream cap shrinks too"
    );
    // The smoothing: sizes went down step by step, not in one jump.
    let sizes: Vec<u64> = overloaded["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["pageSize"]["upstream"].as_u64().unwrap())
        .collect();
    assert!(
        sizes.windows(2).any(|w| w[0] > w[1] && w[1] > 22),
        "intermediate sizes: {sizes:?}"
    );

    // Force a relist: the watch gets 410 Expired.
    fake.clear_requests();
    fake.faults().expire_watches();
    wait_for_watch(&fake).await;
    let relist = list_limits(&fake);
    eprintln!(
        "initial sync limits: {initial:?}; idle size {}; relist limits under etcd load: {relist:?}",
        upstream_size(&idle)
    );
    assert!(relist.len() >= 200 / 22, "{relist:?}");
    assert!(relist.iter().all(|l| *l <= 22), "{relist:?}");
    assert!(
        relist.iter().all(|l| *l < upstream_size(&idle)),
        "{relist:?}"
    );

    // The gauges say the same.
    let metrics = proxy.admin_get("/metrics").await.1;
    assert!(
        metrics.lines().any(
            |l| l.starts_with("kube_cache_proxy_page_size{target=\"upstream\"} ")
                && l.rsplit(' ').next().unwrap().parse::<u64>().unwrap() <= 22
        ),
        "{metrics}"
    );
    assert!(metrics.contains("kube_cache_proxy_paging_factor{factor=\"load\"} 0.4"));

    // Recovery, with downstream LISTs measured on the way.
    slow.store(false, Ordering::SeqCst);
    let client = plain_client(false);
    for _ in 0..20 {
        let req = http::Request::get(proxy.http(CMS))
            .header("authorization", "Bearer reader")
            .body(Full::default())
            .unwrap();
        let resp = client.request(req).await.unwrap();
        assert!(resp.status().is_success());
        resp.into_body().collect().await.unwrap();
    }
    let recovered = debug_until(&proxy, "recovery", |j| upstream_size(j) >= 45).await;
    let history = recovered["history"].as_array().unwrap();
    let lists: u64 = history
        .iter()
        .map(|r| r["inputs"]["downstreamLists"].as_u64().unwrap())
        .sum();
    assert!(lists >= 20, "downstream LISTs recorded: {lists}");
    assert!(
        history
            .iter()
            .any(|r| r["inputs"]["downstreamListLatencyP95Seconds"].is_number())
    );
    assert!(
        history
            .iter()
            .all(|r| r["inputs"]["upstreamRequests"].as_u64().is_some())
    );
    eprintln!(
        "sizes: idle {} -> overloaded {} -> recovered {}",
        upstream_size(&idle),
        upstream_size(&overloaded),
        upstream_size(&recovered)
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn switched_off_paging_keeps_the_configured_upstream_page_size() {
    let fake = FakeApiServer::start().await;
    for i in 0..5 {
        fake.create(CMS, json!({"metadata": {"name": format!("cm-{i}")}}))
            .await;
    }
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.cache.upstream_page_size = 2;
        c.paging.adapt_upstream = false;
        c.paging.cap_downstream = false;
        c.paging.interval = Duration::from_millis(100);
    })
    .await;
    wait_for_watch(&fake).await;
    assert_eq!(list_limits(&fake), [2, 2, 2]);
    let j = get_json(&proxy, "/debug/paging").await;
    assert_eq!(j["pageSize"]["upstream"], 2);
    assert_eq!(j["pageSize"]["downstream"], Value::Null);
    proxy.shutdown().await;
}
