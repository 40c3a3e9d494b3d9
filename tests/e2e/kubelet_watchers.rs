//! Issue 18's kubelet fan-out: 500 kubelet-like protobuf watches of pods
//! (`fieldSelector=spec.nodeName=node-<i>`, bookmarks allowed, client-go's protobuf Accept,
//! 100 streams per HTTP/2 connection as client-go shares one) through the proxy, over 500
//! fake Nodes, while pods are created, relabelled, annotated and deleted straight at the
//! apiserver on a third of the nodes. Each watch gets exactly its node's events (the types
//! and resourceVersions of that node's writes, in order), byte for byte what the same watch
//! asked of the apiserver from the same resourceVersion gets (bookmarks aside: each side
//! sends its own, when it likes). The proxy served all 500 from its cache (its request
//! metrics; 500 protobuf watchers of its pods cache on 5 connections while they were open),
//! and they added no pod watch at the apiserver (the apiserver's
//! `apiserver_longrunning_requests`, which does count the 500 direct ones).
//!
//! The end is deterministic: after its churn every node gets one more pod (`marker-<i>`),
//! and each stream is read until the marker's ADDED, so a node without churn shows that it
//! got nothing else: the marker alone.

use std::time::{Duration, Instant};

use futures_util::{StreamExt, future::join_all};
use http::Method;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use serde_json::{Value, json};

use crate::protobuf::{Direct, PROTOBUF, WatchFrames, event};
use crate::protobuf_watch::{frame_rv, rv_of};
use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::{TestProxy, apiserver_client, body_string};
use crate::support::watch_validator::sum_metric;

const NS: &str = "kubelets";
const NODES: usize = 500;
/// client-go's Accept for a typed client with protobuf (the kubelet's).
const ACCEPT: &str = "application/vnd.kubernetes.protobuf, application/json";
/// Streams per HTTP/2 connection to the proxy: client-go shares one connection per process;
/// 100 kubelets to a connection keeps it to a few connections.
const PROXY_STREAMS_PER_CONNECTION: usize = 100;
/// ... and to the apiserver, which allows 100 concurrent streams per connection
/// (`--http2-max-streams-per-connection`, since its rapid-reset hardening): half, so no
/// stream waits for another's slot.
const DIRECT_STREAMS_PER_CONNECTION: usize = 50;
/// Writes in flight during the churn: nodes written at once, each node's writes in order.
const CONCURRENT_NODES: usize = 16;
/// Bound on each wait; a failure guard for two loaded cores, never what is tested.
const GUARD: Duration = Duration::from_secs(120);

/// One write on a node's pods.
#[derive(Debug, Clone)]
enum Write {
    Create(String),
    Label(String),
    Annotate(String),
    Delete(String),
}

/// The writes of node `i`, in order: on every third node one to three pods, created, some
/// relabelled and annotated, some deleted; then, on every node, the marker pod.
fn plan(i: usize) -> Vec<Write> {
    let mut w = Vec::new();
    if i.is_multiple_of(3) {
        for j in 0..1 + (i / 3) % 3 {
            let pod = format!("pod-{i}-{j}");
            w.push(Write::Create(pod.clone()));
            if (i + j).is_multiple_of(2) {
                w.push(Write::Label(pod.clone()));
            }
            if (i + j).is_multiple_of(3) {
                w.push(Write::Annotate(pod.clone()));
            }
            if j == 0 && (i / 3).is_multiple_of(2) {
                w.push(Write::Delete(pod));
            }
        }
    }
    w.push(Write::Create(format!("marker-{i}")));
    w
}

/// A pod bound to `node` (no scheduler needed), about 2 KB once admitted (the token volume,
/// managedFields).
fn pod(name: &str, node: &str) -> Value {
    json!({
        "metadata": {"name": name, "labels": {"app": "kubelet-e2e", "node": node},
                     "annotations": {"note": "a pod of a kubelet-like watcher's node"}},
        "spec": {
            "nodeName": node,
            "containers": [{
                "name": "pause",
                "image": "registry.k8s.io/pause:3.10",
                "env": [{"name": "NODE", "value": node}, {"name": "POD", "value": name}],
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
            }],
        },
    })
}

/// An event a node's watch must show: its type and resourceVersion (`None`: not answered
/// by a write, only ordered between its neighbours).
type Expected = (&'static str, Option<u64>);

/// Performs node `i`'s writes in order at the apiserver; the events they make.
async fn write_node(d: &Direct, i: usize) -> Vec<Expected> {
    let node = format!("node-{i}");
    let path = format!("/api/v1/namespaces/{NS}/pods");
    let patch = async |name: &str, body: Value| {
        rv_of(&d.merge_patch(&format!("{path}/{name}"), body).await)
    };
    let mut events = Vec::new();
    for w in plan(i) {
        match w {
            Write::Create(name) => {
                let b = d
                    .ok(
                        Method::POST,
                        &path,
                        PROTOBUF,
                        Some(("application/json", pod(&name, &node))),
                    )
                    .await;
                events.push(("ADDED", Some(rv_of(&b))));
            }
            Write::Label(name) => {
                let rv = patch(&name, json!({"metadata": {"labels": {"churned": "yes"}}})).await;
                events.push(("MODIFIED", Some(rv)));
            }
            Write::Annotate(name) => {
                let body = json!({"metadata": {"annotations": {"note": null, "seen": "ü"}}});
                events.push(("MODIFIED", Some(patch(&name, body).await)));
            }
            Write::Delete(name) => {
                // A bound pod's deletion first marks it (deletionTimestamp, grace period 0:
                // a MODIFIED of its own), then removes it; the DELETE answers the removed
                // object at the removal's resourceVersion.
                let b = d
                    .ok(
                        Method::DELETE,
                        &format!("{path}/{name}?gracePeriodSeconds=0"),
                        PROTOBUF,
                        None,
                    )
                    .await;
                events.push(("MODIFIED", None));
                events.push(("DELETED", Some(rv_of(&b))));
            }
        }
    }
    events
}

/// `Direct` clients of `url`, one HTTP/2 connection each (checked: the first answer is
/// HTTP/2, and later requests share its connection).
async fn connections(n: usize, url: &str, ca_pem: &str, token: &str) -> Vec<Direct> {
    let mut out = Vec::new();
    for _ in 0..n {
        let d = Direct {
            http: apiserver_client(ca_pem, true),
            url: url.to_string(),
            token: token.to_string(),
        };
        let req = http::Request::get(format!("{url}/version"))
            .header("authorization", format!("Bearer {token}"))
            .body(http_body_util::Full::default())
            .unwrap();
        let resp = d.http.request(req).await.unwrap();
        assert_eq!(resp.version(), http::Version::HTTP_2, "{url}: HTTP/2");
        body_string(resp).await;
        out.push(d);
    }
    out
}

/// The 500 watches from `from`, `per_connection` streams on each of `conns`, by node.
async fn open_watches(conns: &[Direct], per_connection: usize, from: u64) -> Vec<WatchFrames> {
    join_all((0..NODES).map(|i| {
        let q = format!(
            "/api/v1/pods?watch=1&resourceVersion={from}&allowWatchBookmarks=true\
             &fieldSelector=spec.nodeName%3Dnode-{i}&timeoutSeconds=600"
        );
        async move { conns[i / per_connection].open_watch(&q, ACCEPT).await }
    }))
    .await
}

/// Reads every watch until it has shown its node's marker (`ends[i]`): the frames by node.
async fn read_all(watches: Vec<WatchFrames>, ends: &[u64]) -> Vec<Vec<Vec<u8>>> {
    let tasks: Vec<_> = watches
        .into_iter()
        .zip(ends)
        .map(|(w, &end)| {
            tokio::spawn(w.read_until(GUARD, move |frames: &[Vec<u8>]| {
                frames
                    .iter()
                    .rev()
                    .find(|f| event(f).0 != "BOOKMARK")
                    .is_some_and(|f| frame_rv(f) >= end)
            }))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// The proxy's `/metrics`.
async fn metrics(proxy: &TestProxy) -> String {
    body_string(
        proxy
            .client(None, true)
            .get(&proxy.admin("/metrics"), None)
            .await,
    )
    .await
}

/// Where two frame sequences part: each side's frames as (type, resourceVersion, length),
/// and the first differing frame and byte.
fn difference(proxied: &[&[u8]], direct: &[&[u8]]) -> String {
    let show = |frames: &[&[u8]]| -> Vec<(String, u64, usize)> {
        frames
            .iter()
            .map(|f| (event(f).0, frame_rv(f), f.len()))
            .collect()
    };
    let first = proxied.iter().zip(direct).position(|(p, d)| p != d);
    let byte = first.map(|n| {
        let (p, d) = (proxied[n], direct[n]);
        let at = p
            .iter()
            .zip(d)
            .position(|(a, b)| a != b)
            .unwrap_or(p.len().min(d.len()));
        let window = |f: &[u8]| hex::encode(&f[at.saturating_sub(8)..(at + 8).min(f.len())]);
        format!(
            "frame {n}, byte {at}: proxy {} direct {}",
            window(p),
            window(d)
        )
    });
    format!(
        "proxy {:?}, direct {:?}; {}",
        show(proxied),
        show(direct),
        byte.unwrap_or_else(|| "one is a prefix of the other".into())
    )
}

/// The frames that are not bookmarks.
fn events_only(frames: &[Vec<u8>]) -> Vec<&[u8]> {
    frames
        .iter()
        .filter(|f| event(f).0 != "BOOKMARK")
        .map(Vec::as_slice)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_hundred_kubelet_watches_get_exactly_their_nodes_events_from_the_cache() {
    let started = Instant::now();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    cp.create_default_service_account(NS).await.unwrap();
    let admin = cp.admin_client().await.unwrap();
    let token = cp.admin_token().to_string();
    let d = Direct {
        http: apiserver_client(&cp.ca_pem, true),
        url: cp.url.clone(),
        token: token.clone(),
    };
    let names: Vec<String> = (0..NODES).map(|i| format!("node-{i}")).collect();
    crate::components::register_nodes(&admin, &names).await;

    let upstream = crate::clients::kube_config(&cp.admin_kubeconfig_yaml()).await;
    let proxy = TestProxy::start_with_kube(upstream, |c| {
        c.cache.resources = vec!["pods".into()];
    })
    .await;
    // The kubelets' connections to the proxy; the first also makes their LIST.
    let via_proxy = connections(
        NODES / PROXY_STREAMS_PER_CONNECTION,
        &proxy.https(""),
        &proxy.ca_pem,
        &token,
    )
    .await;
    let p = &via_proxy[0];
    // A kubelet's LIST starts the pods' protobuf side; until it has synced the apiserver
    // answers. Done once a LIST with the kubelet's field selector comes from the cache.
    let list = "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-0";
    eventually(
        "a protobuf LIST of a node's pods from the cache",
        GUARD,
        async || {
            let served = || {
                proxy.cache("", "v1", "pods").map(|c| {
                    c.list_stats
                        .from_cache
                        .load(std::sync::atomic::Ordering::Relaxed)
                })
            };
            let before = served();
            // While the cache or its protobuf side initializes: 429, come back.
            let (status, body) = p.send(Method::GET, list, ACCEPT, None).await;
            if status == http::StatusCode::TOO_MANY_REQUESTS {
                return Err(None);
            }
            assert!(body.starts_with(b"k8s\0"), "a protobuf answer: {status}");
            let c = proxy.cache("", "v1", "pods");
            ok_if(
                before.is_some() && served() > before,
                c.map(|c| (c.protobuf_ready(), c.protobuf_coverage())),
            )
        },
    )
    .await;
    let cache = proxy.cache("", "v1", "pods").unwrap();

    // The watches' starting point: a write's resourceVersion (an unbound pod, no node's).
    let path = format!("/api/v1/namespaces/{NS}/pods");
    let unbound = json!({"metadata": {"name": "start"},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}});
    let from = rv_of(
        &d.ok(
            Method::POST,
            &path,
            PROTOBUF,
            Some(("application/json", unbound)),
        )
        .await,
    );
    eventually("the cache to reach the start", GUARD, async || {
        ok_if(
            cache.rv() >= from && cache.protobuf_coverage().1 == 0,
            (cache.rv(), cache.protobuf_coverage()),
        )
    })
    .await;
    let baseline = crate::support::e2e::apiserver_watches(&admin, "pods").await;

    let proxied = open_watches(&via_proxy, PROXY_STREAMS_PER_CONNECTION, from).await;
    let with_proxied = crate::support::e2e::apiserver_watches(&admin, "pods").await;
    let direct_conns = connections(
        NODES / DIRECT_STREAMS_PER_CONNECTION,
        &cp.url,
        &cp.ca_pem,
        &token,
    )
    .await;
    let direct = open_watches(&direct_conns, DIRECT_STREAMS_PER_CONNECTION, from).await;
    let with_direct = crate::support::e2e::apiserver_watches(&admin, "pods").await;
    let opened = started.elapsed();
    // While they are open: 500 protobuf watchers of the cache, on 5 HTTP/2 connections.
    let m = metrics(&proxy).await;
    let proto_watchers = sum_metric(
        &m,
        "kube_cache_proxy_cache_protobuf_watchers",
        &["resource=\"pods\""],
    );
    let connections = sum_metric(&m, "kube_cache_proxy_connections", &["kind=\"tls\""]);
    assert_eq!(proto_watchers, NODES as f64, "{m}");
    // The API port's only (this scrape's is counted as `admin`).
    assert_eq!(
        connections,
        (NODES / PROXY_STREAMS_PER_CONNECTION) as f64,
        "{m}"
    );

    // The churn, then each node's marker, nodes interleaved, each node's writes in order.
    let churn = Instant::now();
    let expected: Vec<Vec<Expected>> = futures_util::stream::iter(0..NODES)
        .map(|i| write_node(&d, i))
        .buffered(CONCURRENT_NODES)
        .collect()
        .await;
    let writes: usize = (0..NODES).map(|i| plan(i).len()).sum();
    let churned = churn.elapsed();
    let ends: Vec<u64> = expected
        .iter()
        .map(|e| e.last().unwrap().1.unwrap())
        .collect();
    let proxied = read_all(proxied, &ends).await;
    let direct = read_all(direct, &ends).await;
    let read = churn.elapsed();

    let (mut compared, mut bytes, mut bookmarks) = (0, 0, [0, 0]);
    for i in 0..NODES {
        let (p, d) = (events_only(&proxied[i]), events_only(&direct[i]));
        assert!(
            p == d,
            "node-{i}: the proxy's frames are not the apiserver's: {}",
            difference(&p, &d)
        );
        let want = &expected[i];
        let got: Vec<(String, u64)> = p.iter().map(|f| (event(f).0, frame_rv(f))).collect();
        let what = format!("node-{i}: events {got:?}, writes {want:?}");
        assert_eq!(got.len(), want.len(), "{what}");
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g.0, w.0, "{what}");
            assert!(w.1.is_none_or(|rv| rv == g.1), "{what}");
        }
        assert!(got.is_sorted_by(|a, b| a.1 < b.1), "{what}");
        if plan(i).len() == 1 {
            assert_eq!(got.len(), 1, "node-{i} had no churn: its marker alone");
        }
        compared += p.len();
        bytes += p.iter().map(|f| f.len()).sum::<usize>();
        bookmarks[0] += proxied[i].len() - p.len();
        bookmarks[1] += direct[i].len() - d.len();
    }

    // All 500 from the cache, and not one more pod watch at the apiserver (whose count does
    // see the 500 direct ones).
    let m = metrics(&proxy).await;
    let pod_watches = |by: &str| {
        sum_metric(
            &m,
            "kube_cache_proxy_requests_total",
            &[
                "verb=\"WATCH\"",
                "resource=\"pods\"",
                &format!("served_by=\"{by}\""),
            ],
        )
    };
    println!(
        "{NODES} kubelet watches: {writes} writes in {churned:?}, all streams read {read:?} \
         after the churn began ({opened:?} to get there); {compared} frames ({bytes} bytes) \
         compared, bookmarks (proxy, direct) {bookmarks:?}; WATCH pods served_by cache {}, \
         upstream {}; proxy connections {connections}, protobuf watchers {proto_watchers}; \
         apiserver pod watches (all, cluster): before {baseline:?}, with the proxy's \
         {with_proxied:?}, with the direct ones {with_direct:?}",
        pod_watches("cache") as u64,
        pod_watches("upstream") as u64,
    );
    assert_eq!(pod_watches("cache"), NODES as f64, "{m}");
    assert_eq!(pod_watches("upstream"), 0.0, "{m}");
    assert_eq!(
        with_proxied, baseline,
        "the proxy's 500 watches are its own"
    );
    assert_eq!(
        with_direct.1,
        baseline.1 + NODES as u64,
        "the apiserver counts the direct ones"
    );
    proxy.shutdown().await;
    cp.stop().await;
}
