//! Custom resources against the in-process fake apiserver: a CRD that appears gets a cache
//! (served from memory, one upstream watch), its deletion ends the downstream watchers, drops
//! the cache and its metric series and sends requests through, and a CRD re-created under the
//! same name starts from a fresh cache. Both with the resource named in `cache.resources` and
//! with `all`.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::{FakeApiServer, WIDGETS_CRD};
use crate::support::proxy::{EventReader, TestProxy, body_json, body_string, plain_client};
use serde_json::{Value, json};

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(30);

const CRDS: &str = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
const WIDGETS: &str = "/apis/example.com/v1/namespaces/a/widgets";

fn crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": WIDGETS_CRD},
        "spec": {"group": "example.com", "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
                 "versions": [{"name": "v1", "served": true, "storage": true}]}
    })
}

fn widget(name: &str) -> Value {
    json!({"apiVersion": "example.com/v1", "kind": "Widget",
           "metadata": {"name": name, "labels": {"app": "w"}}, "spec": {"color": "red"}})
}

async fn get(proxy: &TestProxy, path: &str) -> (u16, String) {
    get_url(proxy.http(path)).await
}

/// A GET as alice, over plain HTTP/1.1: status and body.
async fn get_url(url: String) -> (u16, String) {
    let c = plain_client(false);
    let r = c
        .request(
            http::Request::get(url)
                .header("authorization", "Bearer alice")
                .body(http_body_util::Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let code = r.status().as_u16();
    (code, body_string(r).await)
}

async fn watch(proxy: &TestProxy, query: &str) -> EventReader {
    proxy
        .watch_plain(&format!("{WIDGETS}?watch=1&{query}"), "alice", false)
        .await
}

async fn metrics(proxy: &TestProxy) -> String {
    proxy.admin_get("/metrics").await.1
}

/// Requests the fake saw for the widgets collection: (lists, watches).
fn upstream_widget_requests(fake: &FakeApiServer) -> (usize, usize) {
    let reqs = fake.requests();
    let widgets = reqs
        .iter()
        .filter(|r| r.path.starts_with("/apis/example.com/v1/") && r.path.ends_with("/widgets"));
    widgets.fold((0, 0), |(l, w), r| {
        if r.query.as_deref().unwrap_or("").contains("watch=") {
            (l, w + 1)
        } else {
            (l + 1, w)
        }
    })
}

/// Waits until `cond` holds on the proxy's caches.
async fn until(
    proxy: &TestProxy,
    what: &str,
    cond: impl Fn(&kube_cache_proxy::cache::registry::Caches) -> bool,
) {
    let state = proxy.running.as_ref().unwrap().state.clone();
    eventually(what, GUARD, async || ok_if(cond(&state.caches), "not yet")).await;
}

fn widgets_synced(c: &kube_cache_proxy::cache::registry::Caches) -> bool {
    c.get("example.com", "v1", "widgets")
        .is_some_and(|c| c.is_ready() && c.unhealthy().is_none())
}

/// Waits until the widgets cache is synced and has every write the fake has made. Its list
/// follows the CRD's watch event, so it may come before the widgets written right after the
/// CRD: those then reach the synced cache only over its upstream watch, later.
async fn widgets_synced_with_every_write(proxy: &TestProxy, fake: &FakeApiServer, what: &str) {
    let want = fake.current_rv();
    until(proxy, what, |c| {
        widgets_synced(c)
            && c.get("example.com", "v1", "widgets")
                .is_some_and(|w| w.rv() >= want)
    })
    .await;
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

/// Every line of `metrics` for `metric` about the widgets cache.
fn widget_series<'a>(metrics: &'a str, metric: &str) -> Vec<&'a str> {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with(&format!("{metric}{{")) && l.contains("resource=\"widgets.example.com\"")
        })
        .collect()
}

async fn crd_lifecycle(resources: &[&str]) {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "a"}}))
        .await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = resources.iter().map(|s| s.to_string()).collect();
    })
    .await;
    until(&proxy, "configmaps synced", |c| {
        c.get("", "v1", "configmaps").is_some_and(|c| c.is_ready())
    })
    .await;

    // No CRD yet: the apiserver's 404, through the proxy.
    let (code, body) = get(&proxy, WIDGETS).await;
    assert_eq!(code, 404, "{body}");

    // The CRD appears: a cache, synced from one upstream list and watch.
    fake.create(CRDS, crd()).await;
    for n in ["w1", "w2"] {
        fake.create(WIDGETS, widget(n)).await;
    }
    widgets_synced_with_every_write(&proxy, &fake, "widgets synced with w1 and w2").await;
    // A field the cache cannot evaluate for a custom resource goes to the apiserver, which
    // answers (here: rejects) it; never silently ignored.
    let (code, body) = get(&proxy, &format!("{WIDGETS}?fieldSelector=spec.color%3Dred")).await;
    assert_eq!(code, 400, "{body}");
    let (lists, watches) = upstream_widget_requests(&fake);
    let (code, body) = get(&proxy, &format!("{WIDGETS}?resourceVersion=0")).await;
    assert_eq!(code, 200, "{body}");
    // Items of a custom resource carry their type meta, once (as the apiserver writes them).
    assert_eq!(body.matches("\"kind\":\"Widget\"").count(), 2, "{body}");
    assert_eq!(body.matches("\"apiVersion\":").count(), 3, "{body}");
    let list: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list["kind"], "WidgetList");
    assert_eq!(list["apiVersion"], "example.com/v1");
    assert_eq!(names(&list), ["w1", "w2"]);
    assert_eq!(list["items"][0]["kind"], "Widget");
    // One object, from memory too.
    let (code, body) = get(&proxy, &format!("{WIDGETS}/w1?resourceVersion=0")).await;
    assert_eq!(code, 200);
    assert_eq!(body.matches("\"kind\":\"Widget\"").count(), 1, "{body}");
    let (_, body) = get(
        &proxy,
        &format!("{WIDGETS}?fieldSelector=metadata.name%3Dw2&resourceVersion=0"),
    )
    .await;
    assert_eq!(names(&serde_json::from_str(&body).unwrap()), ["w2"]);

    // Three downstream watchers, one upstream watch.
    let mut watchers = Vec::new();
    for _ in 0..3 {
        let mut w = watch(&proxy, "resourceVersion=0").await;
        for n in ["w1", "w2"] {
            let e = w.next().await.unwrap();
            assert_eq!(
                (e["type"].as_str(), e["object"]["metadata"]["name"].as_str()),
                (Some("ADDED"), Some(n))
            );
            assert_eq!(e["object"]["apiVersion"], "example.com/v1");
        }
        watchers.push(w);
    }
    fake.create(WIDGETS, widget("w3")).await;
    for w in &mut watchers {
        let e = w.next().await.unwrap();
        assert_eq!(e["type"], "ADDED");
        assert_eq!(e["object"]["metadata"]["name"], "w3");
    }
    assert_eq!(
        upstream_widget_requests(&fake),
        (lists, watches),
        "lists, gets and watches came from memory"
    );
    let m = metrics(&proxy).await;
    assert_eq!(
        widget_series(&m, "kube_cache_proxy_upstream_watches"),
        ["kube_cache_proxy_upstream_watches{resource=\"widgets.example.com\"} 1"]
    );
    assert_eq!(
        widget_series(&m, "kube_cache_proxy_watchers"),
        ["kube_cache_proxy_watchers{resource=\"widgets.example.com\"} 3"]
    );
    assert!(
        m.lines().any(|l| l
            .starts_with("kube_cache_proxy_requests_total{verb=\"WATCH\",group=\"example.com\"")
            && l.contains("served_by=\"cache\"")
            && l.ends_with(" 3")),
        "{m}"
    );

    // The CRD goes: the watchers end cleanly (after any DELETED events that arrive first).
    fake.delete(&format!("{CRDS}/{WIDGETS_CRD}")).await;
    for w in &mut watchers {
        loop {
            let e = tokio::time::timeout(GUARD, w.try_next())
                .await
                .expect("the watch ends")
                .expect("a clean end of stream");
            match e {
                None => break,
                Some(e) => assert_eq!(e["type"], "DELETED", "{e}"),
            }
        }
    }
    until(&proxy, "the widgets cache is gone", |c| {
        c.get("example.com", "v1", "widgets").is_none()
    })
    .await;
    let m = metrics(&proxy).await;
    for metric in [
        "kube_cache_proxy_upstream_watches",
        "kube_cache_proxy_watchers",
        "kube_cache_proxy_cache_objects",
    ] {
        assert!(widget_series(&m, metric).is_empty(), "{metric}: {m}");
    }
    // From now on the apiserver answers: 404 for lists and watches.
    let before = upstream_widget_requests(&fake);
    let (code, body) = get(&proxy, &format!("{WIDGETS}?resourceVersion=0")).await;
    assert_eq!(code, 404, "{body}");
    let (code, _) = get(&proxy, &format!("{WIDGETS}?watch=1&resourceVersion=0")).await;
    assert_eq!(code, 404);
    let after = upstream_widget_requests(&fake);
    assert_eq!((after.0 - before.0, after.1 - before.1), (1, 1));

    // Re-created under the same name: a fresh cache with only the new objects.
    fake.create(CRDS, crd()).await;
    fake.create(WIDGETS, widget("fresh")).await;
    widgets_synced_with_every_write(&proxy, &fake, "widgets synced again, with fresh").await;
    let (lists, watches) = upstream_widget_requests(&fake);
    let (code, body) = get(&proxy, &format!("{WIDGETS}?resourceVersion=0")).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(names(&serde_json::from_str(&body).unwrap()), ["fresh"]);
    let mut w = watch(&proxy, "resourceVersion=0").await;
    let e = w.next().await.unwrap();
    assert_eq!(e["object"]["metadata"]["name"], "fresh");
    assert_eq!(upstream_widget_requests(&fake), (lists, watches));
    let m = metrics(&proxy).await;
    assert_eq!(
        widget_series(&m, "kube_cache_proxy_cache_objects"),
        ["kube_cache_proxy_cache_objects{resource=\"widgets.example.com\"} 1"]
    );
    drop(w);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_custom_resource_follows_its_crd_through_creation_deletion_and_recreation() {
    crd_lifecycle(&["configmaps", "widgets.example.com"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_caches_every_listable_resource_and_follows_crds() {
    crd_lifecycle(&["all"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_lists_every_cached_resource_in_readiness() {
    let fake = FakeApiServer::start().await;
    fake.create(CRDS, crd()).await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["all".into()];
        c.cache.exclude = vec!["pods".into()];
    })
    .await;
    let body = eventually("readiness with every cache synced", GUARD, async || {
        let (code, body) = proxy.admin_get("/readyz?verbose").await;
        // Custom resources do not gate readiness: also wait for them to be synced.
        ok_if(code == 200 && !body.contains(" ok: "), body)
    })
    .await;
    let caches: Vec<&str> = body.lines().filter(|l| l.contains("cache:")).collect();
    assert_eq!(
        caches,
        [
            "[+]cache:configmaps ok",
            "[+]cache:customresourcedefinitions.apiextensions.k8s.io ok",
            "[+]cache:namespaces ok",
            "[+]cache:widgets.example.com ok",
        ],
        "{body}"
    );
    // The CRD list is watched once, shared by the registry and the served cache.
    let crd_watches = fake
        .requests()
        .iter()
        .filter(|r| r.path == CRDS && r.query.as_deref().unwrap_or("").contains("watch="))
        .count();
    assert_eq!(crd_watches, 1);
    let r = plain_client(false)
        .request(
            http::Request::get(proxy.http(CRDS))
                .header("authorization", "Bearer alice")
                .body(http_body_util::Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(names(&body_json(r).await), [WIDGETS_CRD]);
    proxy.shutdown().await;
}

/// A custom resource never gates readiness: with its CRD absent the proxy is ready and lists
/// the resource's state; once the CRD exists and the cache syncs, the line is a plain ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_resource_without_its_crd_does_not_keep_the_proxy_unready() {
    let fake = FakeApiServer::start().await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into(), "widgets.example.com".into()];
    })
    .await;
    let body = eventually("readiness", GUARD, async || {
        let (code, body) = proxy.admin_get("/readyz?verbose").await;
        ok_if(code == 200, body)
    })
    .await;
    let line = body
        .lines()
        .find(|l| l.contains("cache:widgets.example.com"))
        .unwrap_or_else(|| panic!("{body}"));
    assert!(
        line.starts_with("[+]cache:widgets.example.com ok: ")
            && line.ends_with("requests pass through"),
        "{body}"
    );
    assert!(body.contains("[+]cache:configmaps ok\n"), "{body}");
    // Built-in resources still gate: the single check of a synced one is ok.
    assert_eq!(proxy.admin_get("/readyz/cache:configmaps").await.0, 200);
    fake.create(CRDS, crd()).await;
    eventually("the widgets cache to sync", GUARD, async || {
        let (code, body) = proxy.admin_get("/readyz?verbose").await;
        ok_if(
            code == 200 && body.contains("[+]cache:widgets.example.com ok\n"),
            body,
        )
    })
    .await;
}

fn crd_with_fields(paths: &[&str]) -> Value {
    let mut c = crd();
    c["spec"]["versions"][0]["selectableFields"] = paths
        .iter()
        .map(|p| json!({"jsonPath": p}))
        .collect::<Vec<_>>()
        .into();
    c
}

fn colored(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "example.com/v1", "kind": "Widget",
           "metadata": {"name": name, "namespace": "a"}, "spec": spec})
}

/// GET straight from the fake apiserver: the answer the proxy must give.
async fn get_upstream(fake: &FakeApiServer, path: &str) -> (u16, String) {
    get_url(format!("{}{path}", fake.url())).await
}

/// A CRD's `selectableFields` are evaluated from memory: lists and watches with a field
/// selector on them give the apiserver's answer without reaching it, objects enter and leave
/// a field-selected watch as their field changes, a field the CRD does not declare goes to
/// the apiserver (which rejects it), and a change of the declared fields replaces the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selectable_fields_of_a_crd_are_served_from_the_cache() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "a"}}))
        .await;
    fake.create(
        CRDS,
        crd_with_fields(&[".spec.color", ".spec.size", ".spec.on"]),
    )
    .await;
    fake.create(
        WIDGETS,
        colored("w1", json!({"color": "red", "size": 1, "on": true})),
    )
    .await;
    fake.create(
        WIDGETS,
        colored("w2", json!({"color": "blue", "size": 2, "on": false})),
    )
    .await;
    fake.create(WIDGETS, colored("w3", json!({"color": null})))
        .await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["widgets.example.com".into()];
    })
    .await;
    until(&proxy, "widgets synced", widgets_synced).await;

    let selectors = [
        "spec.color=red",
        "spec.color!=red",
        "spec.color=",
        "spec.size=2",
        "spec.size!=1",
        "spec.on=true",
        "spec.on=false",
        "spec.on=",
        "spec.color=blue,metadata.name=w2",
        "spec.color=blue,metadata.name=w1",
        "metadata.namespace=a,spec.size=1",
    ];
    let before = upstream_widget_requests(&fake);
    let mut from_proxy = Vec::new();
    for s in selectors {
        let path = format!("{WIDGETS}?resourceVersion=0&fieldSelector={}", enc(s));
        let (code, body) = get(&proxy, &path).await;
        assert_eq!(code, 200, "{s}: {body}");
        from_proxy.push(names(&serde_json::from_str(&body).unwrap()));
    }
    assert_eq!(
        upstream_widget_requests(&fake),
        before,
        "every list came from memory"
    );
    for (s, got) in selectors.iter().zip(&from_proxy) {
        let (code, body) =
            get_upstream(&fake, &format!("{WIDGETS}?fieldSelector={}", enc(s))).await;
        assert_eq!(code, 200, "{s}: {body}");
        assert_eq!(*got, names(&serde_json::from_str(&body).unwrap()), "{s}");
    }
    assert_eq!(from_proxy[0], ["w1"]);
    assert_eq!(from_proxy[2], ["w3"]);
    assert_eq!(from_proxy[7], ["w3"]);

    // Not declared: the apiserver answers (400), never silently ignored.
    let (lists, watches) = upstream_widget_requests(&fake);
    let (code, body) = get(&proxy, &format!("{WIDGETS}?fieldSelector=spec.weight%3D1")).await;
    assert_eq!(code, 400, "{body}");
    assert!(
        body.contains("field label not supported: spec.weight"),
        "{body}"
    );
    assert_eq!(upstream_widget_requests(&fake), (lists + 1, watches));

    // A field-selected watch: objects enter (ADDED) and leave (DELETED) as their field changes.
    let (lists, watches) = upstream_widget_requests(&fake);
    let mut w = watch(&proxy, "resourceVersion=0&fieldSelector=spec.color%3Dred").await;
    let e = w.next().await.unwrap();
    assert_eq!(
        (e["type"].as_str(), e["object"]["metadata"]["name"].as_str()),
        (Some("ADDED"), Some("w1"))
    );
    fake.update(
        &format!("{WIDGETS}/w2"),
        colored("w2", json!({"color": "red", "size": 2})),
    )
    .await;
    let green = fake
        .update(
            &format!("{WIDGETS}/w1"),
            colored("w1", json!({"color": "green"})),
        )
        .await;
    fake.update(
        &format!("{WIDGETS}/w2"),
        colored("w2", json!({"color": "red", "size": 3})),
    )
    .await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let e = w.next().await.unwrap();
        if e["type"] == "DELETED" {
            assert_eq!(
                e["object"]["metadata"]["resourceVersion"],
                green["metadata"]["resourceVersion"]
            );
        }
        seen.push(format!(
            "{} {} {}",
            e["type"].as_str().unwrap(),
            e["object"]["metadata"]["name"].as_str().unwrap(),
            e["object"]["spec"]["color"].as_str().unwrap()
        ));
    }
    // Leaving, the object is sent with its last state that matched, at the resourceVersion
    // of the change (the apiserver's cacher `convertToWatchEvent`).
    assert_eq!(seen, ["ADDED w2 red", "DELETED w1 red", "MODIFIED w2 red"]);
    assert_eq!(upstream_widget_requests(&fake), (lists, watches));

    // The CRD declares another field: the cache is rebuilt with it (its watchers end cleanly
    // and re-watch), and the new field is served from memory.
    let old = proxy.cache("example.com", "v1", "widgets").unwrap();
    // spec.weight comes, spec.on goes.
    let mut crd = fake.get(&format!("{CRDS}/{WIDGETS_CRD}")).unwrap();
    crd["spec"]["versions"][0]["selectableFields"] = crd_with_fields(&[
        ".spec.color",
        ".spec.size",
        ".spec.weight",
    ])["spec"]["versions"][0]["selectableFields"]
        .clone();
    fake.update(&format!("{CRDS}/{WIDGETS_CRD}"), crd).await;
    let end = tokio::time::timeout(GUARD, w.try_next())
        .await
        .expect("the watch ends")
        .expect("a clean end of stream");
    assert!(end.is_none(), "{end:?}");
    until(&proxy, "a new widgets cache", |c| {
        c.get("example.com", "v1", "widgets")
            .is_some_and(|c| !std::sync::Arc::ptr_eq(&c, &old) && c.is_ready())
    })
    .await;
    fake.update(
        &format!("{WIDGETS}/w3"),
        colored("w3", json!({"weight": 5})),
    )
    .await;
    eventually("spec.weight=5 to select w3", GUARD, async || {
        let (code, body) = get(
            &proxy,
            &format!("{WIDGETS}?resourceVersion=0&fieldSelector=spec.weight%3D5"),
        )
        .await;
        assert_eq!(code, 200, "{body}");
        ok_if(names(&serde_json::from_str(&body).unwrap()) == ["w3"], body)
    })
    .await;
    let before = upstream_widget_requests(&fake);
    let (code, body) = get(
        &proxy,
        &format!("{WIDGETS}?resourceVersion=0&fieldSelector=spec.size%3D3"),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(names(&serde_json::from_str(&body).unwrap()), ["w2"]);
    assert_eq!(
        upstream_widget_requests(&fake),
        before,
        "served from the new cache"
    );
    // No longer declared: the apiserver's answer.
    let (code, body) = get(&proxy, &format!("{WIDGETS}?fieldSelector=spec.on%3Dtrue")).await;
    assert_eq!(code, 400, "{body}");
    drop(w);
    proxy.shutdown().await;
}

fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}
