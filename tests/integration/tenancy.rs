//! Tenancy against the fake apiserver: filtered cluster views from the one shared cache (lists
//! and watch streams show only the namespaces a tenant's caller may list; page walks bound to
//! the view) and quotas (429 with an integer `Retry-After`), on cache-served requests and on
//! passthrough lists and watches of callers the proxy identifies.

use std::time::Duration;

use crate::support;
use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{EventReader, TestProxy, body_json, body_string};
use kube_cache_proxy::config::{TenantConfig, TenantMatch, TenantQuotas};
use serde_json::{Value, json};

const GUARD: Duration = Duration::from_secs(20);

fn tenant(name: &str, user_pattern: &str, view: bool, quotas: TenantQuotas) -> TenantConfig {
    TenantConfig {
        name: name.into(),
        matches: TenantMatch {
            username_patterns: vec![user_pattern.into()],
            ..Default::default()
        },
        namespaces: vec!["ns1".into(), "ns2".into()],
        namespace_selector: Some("team=a".into()),
        filtered_cluster_view: view,
        view_recheck_interval: Duration::from_millis(200),
        quotas,
    }
}

async fn setup(tenants: Vec<TenantConfig>) -> (FakeApiServer, TestProxy) {
    setup_with(tenants, |_| {}).await
}

async fn setup_with(
    tenants: Vec<TenantConfig>,
    tweak: impl FnOnce(&mut kube_cache_proxy::config::Config),
) -> (FakeApiServer, TestProxy) {
    let fake = FakeApiServer::start().await;
    for (ns, labels) in [
        ("ns1", json!({})),
        ("ns2", json!({})),
        ("ns3", json!({"team": "a"})),
        ("ns4", json!({})),
    ] {
        fake.create(
            "/api/v1/namespaces",
            json!({"metadata": {"name": ns, "labels": labels}}),
        )
        .await;
        fake.create(
            &format!("/api/v1/namespaces/{ns}/configmaps"),
            json!({"metadata": {"name": format!("cm-{ns}")}}),
        )
        .await;
    }
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into(), "namespaces".into()];
        c.tenants = tenants;
        tweak(c);
    })
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    // Synced and their watches confirmed: until then a list without resourceVersion (the
    // page walks below) passes through (bounded consistency), neither filtered nor bound.
    eventually(
        "the configmaps and namespaces caches to sync",
        GUARD,
        async || {
            let synced = ["configmaps", "namespaces"].iter().all(|r| {
                state
                    .caches
                    .get("", "v1", r)
                    .is_some_and(|c| c.is_ready() && c.unhealthy().is_none())
            });
            ok_if(synced, "not synced")
        },
    )
    .await;
    (fake, proxy)
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_cluster_view_shows_only_the_tenants_namespaces_the_caller_may_list() {
    let (fake, proxy) = setup(vec![
        tenant("team-a", "a-*", true, TenantQuotas::default()),
        tenant("team-b", "b-*", false, TenantQuotas::default()),
    ])
    .await;
    // RBAC: a-user may read ns1 and ns3 (and ns4, outside the tenant), not ns2 or cluster-wide.
    fake.faults()
        .allow_only_in("a-user", &["ns1", "ns3", "ns4"]);
    fake.faults().allow_only_in("b-user", &["ns1"]);
    let client = proxy.client(None, true);

    let list = client
        .get(
            &proxy.https("/api/v1/configmaps?resourceVersion=0"),
            Some("a-user"),
        )
        .await;
    assert_eq!(list.status(), 200);
    // ns2 is the tenant's but RBAC denies it; ns4 is allowed but not the tenant's; ns3 is the
    // tenant's by its label.
    assert_eq!(names(&body_json(list).await), ["cm-ns1", "cm-ns3"]);

    // The same view on a watch, including events after it started.
    let w = client
        .get(
            &proxy.https("/api/v1/configmaps?watch=1&resourceVersion=0&allowWatchBookmarks=true"),
            Some("a-user"),
        )
        .await;
    assert_eq!(w.status(), 200);
    let mut r = EventReader::new(w);
    let mut seen = Vec::new();
    for ns in ["ns2", "ns4", "ns1"] {
        fake.create(
            &format!("/api/v1/namespaces/{ns}/configmaps"),
            json!({"metadata": {"name": format!("late-{ns}")}}),
        )
        .await;
    }
    // Read until the last write (ns1) arrives: nothing of ns2/ns4 may come before or with it.
    while !seen.contains(&"ns1/late-ns1".to_string()) {
        let ev = tokio::time::timeout(GUARD, r.next())
            .await
            .expect("event in time")
            .expect("stream open");
        if ev["type"] == "BOOKMARK" {
            assert!(
                ev["object"]["metadata"].get("name").is_none(),
                "bookmarks carry no object: {ev}"
            );
            continue;
        }
        let o = &ev["object"]["metadata"];
        seen.push(format!(
            "{}/{}",
            o["namespace"].as_str().unwrap(),
            o["name"].as_str().unwrap()
        ));
    }
    assert_eq!(seen, ["ns1/cm-ns1", "ns3/cm-ns3", "ns1/late-ns1"]);
    drop(r);

    // A tenant without the filtered view gets the apiserver's 403.
    let denied = client
        .get(
            &proxy.https("/api/v1/configmaps?resourceVersion=0"),
            Some("b-user"),
        )
        .await;
    assert_eq!(denied.status(), 403);
    let body = body_string(denied).await;
    assert!(
        body.contains(
            "cannot list resource \\\"configmaps\\\" in API group \\\"\\\" at the cluster scope"
        ),
        "{body}"
    );
    // So does a caller of the filtered tenant whose RBAC allows none of its namespaces.
    fake.faults().allow_only_in("a-nobody", &["ns4"]);
    let none = client
        .get(
            &proxy.https("/api/v1/configmaps?resourceVersion=0"),
            Some("a-nobody"),
        )
        .await;
    assert_eq!(none.status(), 403);
    proxy.shutdown().await;
}

fn retry_after(r: &http::Response<hyper::body::Incoming>) -> u32 {
    r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .expect("an integer Retry-After")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_quota_requests_get_429_with_an_integer_retry_after() {
    let (_fake, proxy) = setup(vec![
        tenant(
            "rate",
            "r-*",
            false,
            TenantQuotas {
                list_qps: Some(0.2),
                list_burst: Some(2),
                ..Default::default()
            },
        ),
        tenant(
            "watches",
            "w-*",
            false,
            TenantQuotas {
                max_watches: Some(1),
                ..Default::default()
            },
        ),
        tenant(
            "size",
            "s-*",
            false,
            TenantQuotas {
                max_list_objects: Some(1),
                ..Default::default()
            },
        ),
    ])
    .await;
    let client = proxy.client(None, true);
    let list = proxy.https("/api/v1/namespaces/ns1/configmaps?resourceVersion=0");

    // Rate: the burst, then 429 for this tenant only.
    for _ in 0..2 {
        assert_eq!(client.get(&list, Some("r-1")).await.status(), 200);
    }
    let r = client.get(&list, Some("r-2")).await;
    assert_eq!(r.status(), 429);
    assert!((1..=5).contains(&retry_after(&r)), "one token per 5 s");
    let body = body_json(r).await;
    assert_eq!(body["reason"], "TooManyRequests");
    assert_eq!(client.get(&list, Some("other")).await.status(), 200);

    // Concurrent watches.
    let watch = proxy.https("/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion=0");
    let first = client.get(&watch, Some("w-1")).await;
    assert_eq!(first.status(), 200);
    let second = client.get(&watch, Some("w-2")).await;
    assert_eq!(second.status(), 429);
    assert_eq!(retry_after(&second), 1);
    drop(first);

    // Unpaginated lists over the size limit; namespaced lists within it are fine.
    let all = proxy.https("/api/v1/configmaps?resourceVersion=0");
    let s = client.get(&all, Some("s-1")).await;
    assert_eq!(s.status(), 429);
    assert_eq!(retry_after(&s), 1);
    assert!(body_string(s).await.contains("limit of 1"));
    assert_eq!(client.get(&list, Some("s-1")).await.status(), 200);
    let paged = proxy.https("/api/v1/configmaps?resourceVersion=0&limit=1");
    assert_ne!(client.get(&paged, Some("s-1")).await.status(), 429);

    // Rejections by tenant and quota, and the auth counters, on /metrics.
    let metrics = proxy.running.as_ref().unwrap().state.metrics.encode();
    for line in [
        "kube_cache_proxy_quota_rejections_total{tenant=\"rate\",quota=\"rate\"} 1",
        "kube_cache_proxy_quota_rejections_total{tenant=\"watches\",quota=\"watches\"} 1",
        "kube_cache_proxy_quota_rejections_total{tenant=\"size\",quota=\"list_size\"} 1",
        // Nine requests by six tokens: six TokenReviews, three answered from the token cache.
        "kube_cache_proxy_authentications_total{method=\"token_review\",result=\"success\"} 9",
        "kube_cache_proxy_authentication_cache_total{result=\"hit\"} 3",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
    assert!(metrics.contains("kube_cache_proxy_authorization_cache_lookups_total{result=\"hit\"}"));
    assert!(metrics.contains("kube_cache_proxy_authorization_decisions_total{result=\"allowed\"}"));
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continue_token_replayed_by_another_identity_or_tenant_is_refused() {
    let (_fake, proxy) = setup(vec![
        tenant("team-a", "a-*", false, TenantQuotas::default()),
        tenant("team-b", "b-*", false, TenantQuotas::default()),
    ])
    .await;
    let client = proxy.client(None, true);
    let first = client
        .get(&proxy.https("/api/v1/configmaps?limit=1"), Some("a-one"))
        .await;
    assert_eq!(first.status(), 200);
    let page = body_json(first).await;
    assert_eq!(page["items"].as_array().unwrap().len(), 1);
    let token = page["metadata"]["continue"]
        .as_str()
        .expect("a continue token")
        .to_string();
    let next = |who: &'static str| {
        let url = proxy.https(&format!("/api/v1/configmaps?limit=1&continue={token}"));
        let client = &client;
        async move { client.get(&url, Some(who)).await }
    };
    // The owner continues; another identity of the same tenant, and a caller of another
    // tenant, are refused without any object.
    assert_eq!(next("a-one").await.status(), 200);
    for other in ["a-two", "b-one"] {
        let r = next(other).await;
        assert_eq!(r.status(), 400, "{other}");
        let body = body_json(r).await;
        assert_eq!(body["kind"], "Status", "{other}: {body}");
        assert!(body.get("items").is_none());
    }
    proxy.shutdown().await;
}

/// Reads watch events until one for `last` (`ns/name`) arrives; returns the `ns/name` of every
/// non-bookmark event seen, in order.
async fn read_until(r: &mut EventReader, last: &str) -> Vec<String> {
    let mut seen = Vec::new();
    while !seen.iter().any(|s| s == last) {
        let ev = tokio::time::timeout(GUARD, r.next())
            .await
            .expect("event in time")
            .expect("stream open");
        if ev["type"] == "BOOKMARK" {
            continue;
        }
        let o = &ev["object"]["metadata"];
        seen.push(format!(
            "{}/{}",
            o["namespace"].as_str().unwrap(),
            o["name"].as_str().unwrap()
        ));
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_walk_or_watch_whose_filtered_view_changed_is_refused_or_ended_with_410() {
    let (fake, proxy) = setup(vec![tenant("team-a", "a-*", true, TenantQuotas::default())]).await;
    fake.faults()
        .allow_only_in("a-user", &["ns1", "ns3", "ns4"]);
    let client = proxy.client(None, true);
    let first = client
        .get(&proxy.https("/api/v1/configmaps?limit=1"), Some("a-user"))
        .await;
    assert_eq!(first.status(), 200);
    let page = body_json(first).await;
    assert_eq!(names(&page), ["cm-ns1"]);
    let token = page["metadata"]["continue"].as_str().unwrap().to_string();
    let next = proxy.https(&format!("/api/v1/configmaps?limit=1&continue={token}"));
    // Same view: the walk continues.
    let same = client.get(&next, Some("a-user")).await;
    assert_eq!(same.status(), 200);
    assert_eq!(names(&body_json(same).await), ["cm-ns3"]);

    // A watch through the view {ns1, ns3}, open while the view changes.
    let w = client
        .get(
            &proxy.https("/api/v1/configmaps?watch=1&resourceVersion=0"),
            Some("a-user"),
        )
        .await;
    assert_eq!(w.status(), 200);
    let mut events = EventReader::new(w);
    assert_eq!(
        read_until(&mut events, "ns3/cm-ns3").await,
        ["ns1/cm-ns1", "ns3/cm-ns3"]
    );

    // ns4 joins the tenant (its label), and RBAC allows it: the view is now {ns1, ns3, ns4}.
    fake.update(
        "/api/v1/namespaces/ns4",
        json!({"metadata": {"name": "ns4", "labels": {"team": "a"}}}),
    )
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    eventually(
        "the namespace cache to see ns4's label",
        GUARD,
        async || {
            let ns = state.caches.get("", "v1", "namespaces").unwrap();
            let labelled = ns
                .current()
                .objects
                .values()
                .any(|o| o.meta.name.as_ref() == "ns4" && o.label("team") == Some("a"));
            ok_if(labelled, "not labelled")
        },
    )
    .await;
    // The walk started under the old view is refused, with no object, instead of going on
    // with pages of another view.
    let changed = client.get(&next, Some("a-user")).await;
    assert_eq!(changed.status(), 400);
    let body = body_json(changed).await;
    assert_eq!(body["kind"], "Status");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("start a new list without the continue parameter"),
        "{body}"
    );
    assert!(body.get("items").is_none());
    // A new list shows the new view.
    let fresh = client
        .get(&proxy.https("/api/v1/configmaps?limit=10"), Some("a-user"))
        .await;
    assert_eq!(
        names(&body_json(fresh).await),
        ["cm-ns1", "cm-ns3", "cm-ns4"]
    );

    // The watch opened under the old view never delivers anything of ns4; it ends with a
    // 410 Expired ERROR event, so the client relists into the new view.
    fake.create(
        "/api/v1/namespaces/ns4/configmaps",
        json!({"metadata": {"name": "late-ns4"}}),
    )
    .await;
    assert_eq!(
        read_to_view_change(&mut events).await,
        Vec::<String>::new(),
        "nothing from outside the view"
    );
    // A new watch sees the new view, ns4 included.
    let w = client
        .get(
            &proxy.https("/api/v1/configmaps?watch=1&resourceVersion=0"),
            Some("a-user"),
        )
        .await;
    let mut events = EventReader::new(w);
    assert_eq!(
        read_until(&mut events, "ns4/late-ns4").await,
        ["ns1/cm-ns1", "ns3/cm-ns3", "ns4/cm-ns4", "ns4/late-ns4"]
    );
    // ns3 leaves the tenant (its label goes): that watch ends the same way, without any
    // event of ns3 after it left.
    fake.update(
        "/api/v1/namespaces/ns3",
        json!({"metadata": {"name": "ns3", "labels": {}}}),
    )
    .await;
    fake.create(
        "/api/v1/namespaces/ns3/configmaps",
        json!({"metadata": {"name": "late-ns3"}}),
    )
    .await;
    let seen = read_to_view_change(&mut events).await;
    assert!(seen.iter().all(|s| s == "ns3/late-ns3"), "{seen:?}");
    let fresh = client
        .get(&proxy.https("/api/v1/configmaps?limit=10"), Some("a-user"))
        .await;
    assert_eq!(
        names(&body_json(fresh).await),
        ["cm-ns1", "cm-ns4", "late-ns4"]
    );
    proxy.shutdown().await;
}

/// Reads a watch until the ERROR event that ends it when the caller's view changed (410
/// Expired), then checks the stream ends; returns the `ns/name` of the events before it.
async fn read_to_view_change(r: &mut EventReader) -> Vec<String> {
    let mut seen = Vec::new();
    loop {
        let ev = tokio::time::timeout(GUARD, r.next())
            .await
            .expect("event in time")
            .expect("the stream ends with an ERROR event, not silently");
        match ev["type"].as_str() {
            Some("BOOKMARK") => {}
            Some("ERROR") => {
                assert_eq!(ev["object"]["code"], 410, "{ev}");
                assert_eq!(ev["object"]["reason"], "Expired", "{ev}");
                break;
            }
            _ => {
                let o = &ev["object"]["metadata"];
                seen.push(format!(
                    "{}/{}",
                    o["namespace"].as_str().unwrap(),
                    o["name"].as_str().unwrap()
                ));
            }
        }
    }
    let end = tokio::time::timeout(GUARD, r.next())
        .await
        .expect("end in time");
    assert!(end.is_none(), "nothing after the ERROR event: {end:?}");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passthrough_lists_and_watches_of_identified_callers_count_against_the_tenant_quota() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.csv");
    std::fs::write(&tokens, "tok-r,r-file,u1\ntok-w,w-file,u2\n").unwrap();
    let (fake, proxy) = setup_with(
        vec![
            tenant(
                "rate",
                "r-*",
                false,
                TenantQuotas {
                    list_qps: Some(0.2),
                    list_burst: Some(2),
                    ..Default::default()
                },
            ),
            tenant(
                "watches",
                "w-*",
                false,
                TenantQuotas {
                    max_watches: Some(1),
                    ..Default::default()
                },
            ),
        ],
        |c| c.authentication.token_auth_file = Some(tokens.clone()),
    )
    .await;
    let client = proxy.client(None, true);
    // Pods are not cached: these lists and watches pass through.
    let pods = proxy.https("/api/v1/namespaces/ns1/pods");
    let pod_lists = |fake: &FakeApiServer| {
        fake.requests()
            .iter()
            .filter(|r| r.path == "/api/v1/namespaces/ns1/pods" && r.query.is_none())
            .count()
    };

    // A token-file caller: the burst, then 429 before the apiserver sees the request.
    fake.clear_requests();
    for _ in 0..2 {
        assert_eq!(client.get(&pods, Some("tok-r")).await.status(), 200);
    }
    let r = client.get(&pods, Some("tok-r")).await;
    assert_eq!(r.status(), 429);
    assert!((1..=5).contains(&retry_after(&r)), "one token per 5 s");
    assert_eq!(body_json(r).await["reason"], "TooManyRequests");
    assert_eq!(
        pod_lists(&fake),
        2,
        "the refused list never reached the apiserver"
    );
    // The same bucket as the tenant's cache-served reads.
    let cached = proxy.https("/api/v1/namespaces/ns1/configmaps?resourceVersion=0");
    assert_eq!(client.get(&cached, Some("tok-r")).await.status(), 429);
    // A caller only a TokenReview could name is the apiserver's business...
    for _ in 0..3 {
        assert_eq!(client.get(&pods, Some("r-unseen")).await.status(), 200);
    }
    assert!(
        !fake
            .requests()
            .iter()
            .any(|r| r.path.ends_with("/tokenreviews")),
        "no TokenReview for a passthrough request"
    );
    // ...until a cache-served request verified it: its cached verdict names the tenant.
    assert_eq!(client.get(&cached, Some("r-seen")).await.status(), 429);
    assert_eq!(client.get(&pods, Some("r-seen")).await.status(), 429);

    // Watch slots: a client-certificate caller's passthrough watch holds the tenant's one
    // slot until its stream ends.
    let (cert, key) = support::proxy::client_cert(&proxy.client_ca, "w-cert", &[]);
    let cert_client = proxy.client(Some((&cert, &key)), true);
    let watch = proxy.https("/api/v1/namespaces/ns1/pods?watch=1");
    let first = cert_client.get(&watch, None).await;
    assert_eq!(first.status(), 200);
    let second = client.get(&watch, Some("tok-w")).await;
    assert_eq!(second.status(), 429);
    assert_eq!(retry_after(&second), 1);
    // A cache-served watch of the tenant counts against the same slots.
    let cached_watch = proxy.https("/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion=0");
    assert_eq!(client.get(&cached_watch, Some("tok-w")).await.status(), 429);
    // Anyone else is not limited by this tenant.
    assert_eq!(client.get(&watch, Some("tok-r")).await.status(), 200);
    let metrics = proxy.running.as_ref().unwrap().state.metrics.encode();
    for line in [
        "kube_cache_proxy_quota_rejections_total{tenant=\"rate\",quota=\"rate\"} 4",
        "kube_cache_proxy_quota_rejections_total{tenant=\"watches\",quota=\"watches\"} 2",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
    drop(first);
    eventually("the ended watch to give its slot back", GUARD, async || {
        let r = client.get(&watch, Some("tok-w")).await;
        if r.status() == 200 {
            return Ok(());
        }
        assert_eq!(r.status(), 429);
        Err(r.status())
    })
    .await;
    proxy.shutdown().await;
}
