//! Protobuf watches served from the cache are kube-apiserver's streams, byte for byte: the
//! same watch (from one resourceVersion, with and without a label selector, whole objects
//! and `PartialObjectMetadata`) asked of the apiserver and of the proxy returns the same
//! frames, including an object entering the selection (ADDED), leaving it (DELETED of its
//! old state at the event's resourceVersion) and deletions; and the proxy's frames came from
//! its cache (the proxy's request metrics), not from the apiserver. Protobuf watches opened
//! the moment a cold proxy starts are the cache's too.

use std::time::Duration;

use http::Method;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::k8s::protobuf::{envelope, object_meta};
use serde_json::json;

use crate::protobuf::{AS_PARTIAL, Direct, PROTOBUF, event};
use crate::support::proxy::apiserver_client;

const NS: &str = "pbw";

/// The resourceVersion a write's protobuf answer carries.
pub(crate) fn rv_of(body: &[u8]) -> u64 {
    object_meta(envelope(body).expect("an envelope").raw)
        .expect("metadata")
        .resource_version
        .parse()
        .expect("a numeric resourceVersion")
}

/// The resourceVersion of a frame's object.
pub(crate) fn frame_rv(frame: &[u8]) -> u64 {
    rv_of(&event(frame).1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_watches_from_the_cache_are_the_apiservers_frames() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    cp.create_default_service_account(NS).await.unwrap();
    let token = cp.admin_token().to_string();
    let d = Direct {
        http: apiserver_client(&cp.ca_pem, false),
        url: cp.url.clone(),
        token: token.clone(),
    };
    let path = format!("/api/v1/namespaces/{NS}/configmaps");
    let create = async |name: &str, app: &str| {
        let cm = json!({"metadata": {"name": name, "labels": {"app": app}}, "data": {"k": name}});
        rv_of(
            &d.ok(
                Method::POST,
                &path,
                PROTOBUF,
                Some(("application/json", cm)),
            )
            .await,
        )
    };
    for (i, app) in ["a", "a", "b", "b", "a"].iter().enumerate() {
        create(&format!("cm-{i}"), app).await;
    }
    let upstream = crate::clients::kube_config(&cp.admin_kubeconfig_yaml()).await;
    let proxy = crate::support::proxy::TestProxy::start_with_kube(upstream, |c| {
        c.cache.resources = vec!["configmaps".into()];
    })
    .await;
    let p = Direct {
        http: apiserver_client(&proxy.ca_pem, false),
        url: proxy.https(""),
        token,
    };
    // The resource's protobuf side started with its cache (`cache.protobufSide: eager`);
    // the comparison below waits until it has every object's envelope.
    let accept = "application/vnd.kubernetes.protobuf, */*";
    crate::support::eventually::eventually(
        "the protobuf side to sync",
        Duration::from_secs(60),
        async || {
            p.ok(Method::GET, &path, accept, None).await;
            let c = proxy.cache("", "v1", "configmaps");
            crate::support::eventually::ok_if(
                c.as_ref()
                    .is_some_and(|c| c.protobuf_ready() && c.protobuf_coverage().1 == 0),
                c.map(|c| c.protobuf_coverage()),
            )
        },
    )
    .await;
    let cache = proxy.cache("", "v1", "configmaps").unwrap();

    // The writes the watches replay, all straight at the apiserver; `from` is the first
    // one's resourceVersion minus nothing: the watches start after the marker.
    let from = create("marker", "z").await;
    let patch = async |name: &str, body: serde_json::Value| {
        rv_of(&d.merge_patch(&format!("{path}/{name}"), body).await)
    };
    patch("cm-0", json!({"data": {"k": "changed"}})).await; // MODIFIED in app=a
    patch("cm-1", json!({"metadata": {"labels": {"app": "b"}}})).await; // leaves app=a
    patch("cm-2", json!({"metadata": {"labels": {"app": "a"}}})).await; // enters app=a
    d.ok(Method::DELETE, &format!("{path}/cm-4"), PROTOBUF, None)
        .await; // DELETED in app=a
    d.ok(Method::DELETE, &format!("{path}/cm-3"), PROTOBUF, None)
        .await; // DELETED outside app=a
    let last = create("the-end", "a").await; // seen by every watch below
    crate::support::eventually::eventually(
        "the cache to reach the last write with its envelope",
        Duration::from_secs(60),
        async || {
            crate::support::eventually::ok_if(
                cache.rv() >= last && cache.protobuf_coverage().1 == 0,
                (cache.rv(), cache.protobuf_coverage()),
            )
        },
    )
    .await;

    let mut total_frames = 0;
    for (accept, what) in [(PROTOBUF, "objects"), (AS_PARTIAL, "PartialObjectMetadata")] {
        for selector in ["", "&labelSelector=app%3Da"] {
            let q = format!("{path}?watch=1&resourceVersion={from}&timeoutSeconds=60{selector}");
            let until_last =
                |frames: &[Vec<u8>]| frames.last().is_some_and(|f| frame_rv(f) >= last);
            let direct = d.watch(&q, accept, until_last).await;
            let proxied = p.watch(&q, accept, until_last).await;
            let types: Vec<String> = direct.iter().map(|f| event(f).0).collect();
            println!("{what}{selector}: {} frames {types:?}", direct.len());
            assert_eq!(
                proxied, direct,
                "{what}{selector}: the proxy's frames are the apiserver's"
            );
            total_frames += proxied.len();
            if selector.is_empty() {
                assert_eq!(
                    types,
                    [
                        "MODIFIED", "MODIFIED", "MODIFIED", "DELETED", "DELETED", "ADDED"
                    ]
                );
            } else {
                // cm-0 changed, cm-1 left (DELETED), cm-2 entered (ADDED), cm-4 deleted,
                // the-end created.
                assert_eq!(types, ["MODIFIED", "DELETED", "ADDED", "DELETED", "ADDED"]);
            }
        }
    }
    // Every one of those watches was the cache's (the proxy's request metrics).
    let c = proxy.client(None, true);
    let m = crate::support::proxy::body_string(c.get(&proxy.admin("/metrics"), None).await).await;
    let watches = |by: &str| -> f64 {
        m.lines()
            .filter(|l| {
                l.starts_with("kube_cache_proxy_requests_total{verb=\"WATCH\",group=\"\",version=\"v1\",resource=\"configmaps\"")
                    && l.contains(&format!("served_by=\"{by}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(
        watches("cache"),
        4.0,
        "the four watches came from the cache:\n{m}"
    );
    assert_eq!(watches("upstream"), 0.0, "none passed through:\n{m}");
    println!("{total_frames} frames from the cache, byte for byte the apiserver's");

    // WatchList in protobuf: the initial state, then the initial-events-end bookmark whose
    // bytes are the apiserver's but for its resourceVersion (the proxy's is its cache's,
    // the apiserver's its own at that moment).
    let q = format!(
        "{path}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=60"
    );
    let until_bookmark =
        |frames: &[Vec<u8>]| frames.last().is_some_and(|f| event(f).0 == "BOOKMARK");
    let direct = d.watch(&q, PROTOBUF, until_bookmark).await;
    let proxied = p.watch(&q, PROTOBUF, until_bookmark).await;
    let objects = |frames: &[Vec<u8>]| {
        let mut v: Vec<Vec<u8>> = frames[..frames.len() - 1]
            .iter()
            .map(|f| event(f).1)
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        objects(&proxied),
        objects(&direct),
        "the initial state's objects"
    );
    let bookmark_at = |frames: &[Vec<u8>]| {
        let (ty, obj) = event(frames.last().unwrap());
        assert_eq!(ty, "BOOKMARK");
        let rv = rv_of(&obj);
        (
            kube_cache_proxy::k8s::protobuf_write::with_resource_version(&obj, "1").unwrap(),
            rv,
        )
    };
    let (pb, prv) = bookmark_at(&proxied);
    let (db, _) = bookmark_at(&direct);
    assert_eq!(pb, db, "the initial-events-end bookmark");
    assert!(
        prv >= last,
        "the bookmark is at the cache's resourceVersion"
    );
    proxy.shutdown().await;
    cp.stop().await;
}

/// Protobuf watches opened the moment a cold proxy starts, as client-go opens them (a
/// WatchList, and a LIST+WATCH informer's watch from resourceVersion 0; whole objects and
/// `PartialObjectMetadata`), are the cache's: the resource's protobuf side starts with its
/// cache, and while they initialize a watch waits for them or is answered 429 "storage is
/// (re)initializing", after whose `Retry-After` it comes back (as client-go's REST client
/// does). None goes to the apiserver, and each gets the whole state and its
/// initial-events-end bookmark from the proxy: nothing for the client to list again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_watches_opened_at_a_cold_start_are_the_caches() {
    const NS: &str = "pbw-cold";
    const OBJECTS: usize = 20;
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    cp.create_default_service_account(NS).await.unwrap();
    let token = cp.admin_token().to_string();
    let d = Direct {
        http: apiserver_client(&cp.ca_pem, false),
        url: cp.url.clone(),
        token: token.clone(),
    };
    let path = format!("/api/v1/namespaces/{NS}/configmaps");
    for i in 0..OBJECTS {
        let cm = json!({"metadata": {"name": format!("cm-{i}")}, "data": {"k": "v"}});
        d.ok(
            Method::POST,
            &path,
            PROTOBUF,
            Some(("application/json", cm)),
        )
        .await;
    }
    let upstream = crate::clients::kube_config(&cp.admin_kubeconfig_yaml()).await;
    let proxy = crate::support::proxy::TestProxy::start_with_kube(upstream, |c| {
        c.cache.resources = vec!["configmaps".into()];
    })
    .await;
    let p = Direct {
        http: apiserver_client(&proxy.ca_pem, false),
        url: proxy.https(""),
        token,
    };
    let watchlist = format!(
        "{path}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=60"
    );
    let from_zero =
        format!("{path}?watch=1&resourceVersion=0&allowWatchBookmarks=true&timeoutSeconds=60");
    let watches = [
        (watchlist.clone(), PROTOBUF),
        (watchlist, AS_PARTIAL),
        (from_zero.clone(), PROTOBUF),
        (from_zero, AS_PARTIAL),
    ];
    // All at once, right after the proxy's start; each retried on 429 after its Retry-After.
    let started = std::time::Instant::now();
    let outcomes = futures_util::future::join_all(watches.iter().map(|(q, accept)| {
        let p = p.clone();
        async move {
            let mut refused = 0;
            let w = loop {
                match p.try_open_watch(q, accept).await {
                    Ok(w) => break w,
                    Err((status, retry_after, body)) => {
                        assert_eq!(status, 429, "{q}: {}", String::from_utf8_lossy(&body));
                        assert!(
                            String::from_utf8_lossy(&body).contains("storage is (re)initializing"),
                            "{q}"
                        );
                        refused += 1;
                        assert!(refused < 30, "{q}: refused {refused} times");
                        let after = retry_after.expect("a Retry-After");
                        tokio::time::sleep(Duration::from_secs(after)).await;
                    }
                }
            };
            let until_bookmark =
                |frames: &[Vec<u8>]| frames.last().is_some_and(|f| event(f).0 == "BOOKMARK");
            let frames = w.read_until(Duration::from_secs(30), until_bookmark).await;
            let added = frames.iter().filter(|f| event(f).0 == "ADDED").count();
            (refused, added, frames.len())
        }
    }))
    .await;
    for ((q, accept), (refused, added, frames)) in watches.iter().zip(&outcomes) {
        println!(
            "{accept} {q}: {refused} x 429, then {added} ADDED of {frames} frames ({:?} after the start)",
            started.elapsed()
        );
        assert_eq!(*added, OBJECTS, "{accept} {q}: the whole state");
        assert_eq!(*frames, OBJECTS + 1, "{accept} {q}: and the bookmark");
    }
    let c = proxy.client(None, true);
    let m = crate::support::proxy::body_string(c.get(&proxy.admin("/metrics"), None).await).await;
    let sum = |prefix: &str, needles: &[&str]| -> f64 {
        m.lines()
            .filter(|l| l.starts_with(prefix) && needles.iter().all(|n| l.contains(n)))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let watch = "kube_cache_proxy_requests_total{verb=\"WATCH\",group=\"\",version=\"v1\",resource=\"configmaps\"";
    assert_eq!(
        sum(watch, &["served_by=\"cache\"", "code=\"200\""]),
        watches.len() as f64,
        "every watch was the cache's:\n{m}"
    );
    assert_eq!(sum(watch, &["served_by=\"upstream\""]), 0.0, "{m}");
    assert_eq!(
        sum(
            "kube_cache_proxy_passthrough_total",
            &["verb=\"WATCH\"", "resource=\"configmaps\""]
        ),
        0.0,
        "no watch passed through:\n{m}"
    );
    proxy.shutdown().await;
    cp.stop().await;
}
