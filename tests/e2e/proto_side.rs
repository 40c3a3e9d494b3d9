//! The protobuf side (`cache::reflector::proto`) against a real kube-apiserver: what it
//! attaches is, byte for byte, what a protobuf GET or the write itself returned for that
//! object at that resourceVersion; it resumes a watch the apiserver ended from its last
//! resourceVersion (no fresh initial state). Not covered live: a 410 (the apiserver's watch
//! cache answers a watch from resourceVersion 1 with its state as ADDED events, even after an
//! etcd compaction, while it has evicted no event); `proto::state`'s unit tests cover it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::proxy::{Https, apiserver_client};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::cache::reflector::ReflectorConfig;
use kube_cache_proxy::cache::reflector::proto::{ProtoSide, ProtoSink};
use kube_cache_proxy::cache::{EventKind, ObjectKey, Resource};
use kube_cache_proxy::config::UpstreamConfig;
use kube_cache_proxy::k8s::protobuf::{envelope, object_meta};
use kube_cache_proxy::k8s::protobuf_write::bookmark_object;
use kube_cache_proxy::upstream::Upstream;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";
const NS: &str = "pside";

#[derive(Debug, Clone, PartialEq)]
enum Call {
    Attach(EventKind, ObjectKey, u64, Bytes),
    Bookmark(u64, bool, Bytes),
    Restarted,
}

#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<Call>>,
    changed: tokio::sync::Notify,
}

impl ProtoSink for Recorder {
    fn attach(&self, kind: EventKind, key: ObjectKey, rv: u64, envelope: Bytes) {
        self.push(Call::Attach(kind, key, rv, envelope));
    }
    fn bookmark(&self, rv: u64, initial_events_end: bool, envelope: Bytes) {
        self.push(Call::Bookmark(rv, initial_events_end, envelope));
    }
    fn restarted(&self) {
        self.push(Call::Restarted);
    }
}

impl Recorder {
    fn push(&self, c: Call) {
        self.calls.lock().unwrap().push(c);
        self.changed.notify_waiters();
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits (30 s at most) until `f` holds for the calls so far.
    async fn wait_for<T>(&self, what: &str, f: impl Fn(&[Call]) -> Option<T>) -> T {
        tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let notified = self.changed.notified();
                if let Some(t) = f(&self.calls.lock().unwrap()) {
                    return t;
                }
                notified.await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what}: not within 30 s; calls: {:?}", self.calls()))
    }
}

/// The index of the first initial-events-end bookmark.
fn initial_end(calls: &[Call]) -> Option<usize> {
    calls
        .iter()
        .position(|c| matches!(c, Call::Bookmark(_, true, _)))
}

struct Direct {
    http: Https,
    url: String,
    token: String,
}

impl Direct {
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<(&str, Value)>,
    ) -> (StatusCode, Bytes) {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.url))
            .header("authorization", format!("Bearer {}", self.token))
            .header("accept", PROTOBUF);
        let body = match body {
            Some((content_type, v)) => {
                req = req.header("content-type", content_type);
                Full::new(Bytes::from(v.to_string()))
            }
            None => Full::default(),
        };
        let resp = self.http.request(req.body(body).unwrap()).await.unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, body)
    }

    async fn ok(&self, method: Method, path: &str, body: Option<(&str, Value)>) -> Bytes {
        let (status, b) = self.send(method.clone(), path, body).await;
        assert!(status.is_success(), "{method} {path}: {status}");
        b
    }
}

/// (key, resourceVersion) of a protobuf object body.
fn key_rv(body: &[u8]) -> (ObjectKey, u64) {
    let m = object_meta(envelope(body).expect("an envelope").raw).expect("metadata");
    (
        ObjectKey::new(m.namespace, m.name),
        m.resource_version.parse().unwrap(),
    )
}

fn cms() -> Resource {
    Resource::core("configmaps", "ConfigMap", true)
}

fn path(name: &str) -> String {
    format!("/api/v1/namespaces/{NS}/configmaps/{name}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protobuf_side_attaches_the_apiservers_exact_bytes_and_resumes() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    cp.create_default_service_account(NS).await.unwrap();
    let d = Direct {
        http: apiserver_client(&cp.ca_pem, false),
        url: cp.url.clone(),
        token: cp.admin_token().to_string(),
    };
    let collection = format!("/api/v1/namespaces/{NS}/configmaps");
    for (name, data) in [
        ("cm-a", "1".to_string()),
        ("cm-b", "2".to_string()),
        ("cm-c", "x".repeat(300)),
    ] {
        let cm = json!({"metadata": {"name": name, "labels": {"app": "pside"},
            "annotations": {"note": "ü"}}, "data": {"k": data}});
        d.ok(Method::POST, &collection, Some(("application/json", cm)))
            .await;
    }

    let kc = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(&cp.admin_kubeconfig_yaml()).unwrap(),
        &Default::default(),
    )
    .await
    .unwrap();
    let upstream = Upstream::new(&kc, &UpstreamConfig::default()).unwrap();
    // Short watches (timeoutSeconds 3-5), so the apiserver ends them during the test.
    let cfg = ReflectorConfig {
        watch_timeout: Duration::from_secs(3),
        ..ReflectorConfig::default()
    };
    let sink = Arc::new(Recorder::default());
    let shutdown = CancellationToken::new();
    let side = ProtoSide::spawn(cms(), upstream, sink.clone(), cfg, shutdown.clone());

    // The initial state: every object ADDED with a GET's exact bytes, then the bookmark.
    let end = sink.wait_for("initial-events-end", initial_end).await;
    let calls = sink.calls();
    let Call::Bookmark(synced_rv, true, bookmark) = &calls[end] else {
        unreachable!()
    };
    assert_eq!(
        bookmark,
        &bookmark_object("v1", "ConfigMap", &[], &synced_rv.to_string(), true)
    );
    let mut compared = 0;
    for c in &calls[..end] {
        let Call::Attach(kind, key, rv, env) = c else {
            panic!("before the initial-events-end bookmark: {c:?}")
        };
        assert_eq!(*kind, EventKind::Added, "{key:?}");
        assert!(rv <= synced_rv, "{key:?}@{rv} after {synced_rv}");
        assert_eq!(key_rv(env), (key.clone(), *rv));
        let get = d
            .ok(
                Method::GET,
                &format!(
                    "/api/v1/namespaces/{}/configmaps/{}",
                    key.namespace, key.name
                ),
                None,
            )
            .await;
        if key_rv(&get).1 == *rv {
            assert_eq!(&get, env, "{key:?}@{rv}: the GET's bytes");
            compared += 1;
        }
        if &*key.namespace == NS {
            assert_eq!(key_rv(&get).1, *rv, "nothing wrote {key:?}");
        }
    }
    let ours = calls[..end]
        .iter()
        .filter(|c| matches!(c, Call::Attach(_, k, ..) if &*k.namespace == NS))
        .count();
    assert_eq!(ours, 3, "each of the namespace's objects once");
    assert!(compared >= 3);

    // The apiserver ends the first watch (timeoutSeconds); the task resumes without
    // initial events. Writes then reach it through the resumed watch.
    let stats = side.stats().clone();
    tokio::time::timeout(Duration::from_secs(30), async {
        while stats.snapshot().watch_starts < 2 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("a second watch within 30 s");
    let merge = "application/merge-patch+json";
    let mut written: BTreeMap<(ObjectKey, u64), (EventKind, Bytes)> = BTreeMap::new();
    let mut record = |kind: EventKind, b: Bytes| {
        written.insert(key_rv(&b), (kind, b));
    };
    record(
        EventKind::Modified,
        d.ok(
            Method::PATCH,
            &path("cm-a"),
            Some((merge, json!({"metadata": {"labels": {"changed": "1"}}}))),
        )
        .await,
    );
    record(
        EventKind::Added,
        d.ok(
            Method::POST,
            &collection,
            Some((
                "application/json",
                json!({"metadata": {"name": "cm-d"}, "data": {"n": "1"}}),
            )),
        )
        .await,
    );
    record(
        EventKind::Modified,
        d.ok(
            Method::PATCH,
            &path("cm-c"),
            Some((merge, json!({"data": {"k": null, "j": "é"}}))),
        )
        .await,
    );
    let last_b = d.ok(Method::GET, &path("cm-b"), None).await;
    let (b_key, b_rv) = key_rv(&last_b);
    d.ok(Method::DELETE, &path("cm-b"), None).await;
    let deleted = sink
        .wait_for("DELETED cm-b", |calls| {
            calls.iter().find_map(|c| match c {
                Call::Attach(EventKind::Deleted, k, rv, env) if *k == b_key => {
                    Some((*rv, env.clone()))
                }
                _ => None,
            })
        })
        .await;
    // Every write's response is what was attached for its (key, rv), as its event kind.
    let calls = sink.calls();
    for ((key, rv), (kind, body)) in &written {
        let attached: Vec<_> = calls
            .iter()
            .filter(|c| matches!(c, Call::Attach(_, k, r, _) if k == key && r == rv))
            .collect();
        assert_eq!(
            attached,
            [&Call::Attach(*kind, key.clone(), *rv, body.clone())],
            "{key:?}@{rv}"
        );
    }
    // DELETED: the last state at the deletion's resourceVersion.
    let (del_rv, del_env) = deleted;
    assert!(del_rv > b_rv && del_rv > *written.keys().map(|(_, rv)| rv).max().unwrap());
    assert_eq!(key_rv(&del_env), (b_key.clone(), del_rv));
    let (old, new) = (b_rv.to_string(), del_rv.to_string());
    if old.len() == new.len() {
        let at = last_b
            .windows(old.len() + 2)
            .position(|w| w[0] == 0x32 && w[1] as usize == old.len() && &w[2..] == old.as_bytes())
            .expect("the resourceVersion field");
        let mut want = last_b.to_vec();
        want[at + 2..at + 2 + old.len()].copy_from_slice(new.as_bytes());
        assert_eq!(
            &del_env[..],
            &want[..],
            "the last state but for its resourceVersion"
        );
    }

    // Another end and resume by the apiserver; then the history holds no second initial state:
    // no restart, one initial-events-end bookmark, each object version attached once and
    // every later one after the synced resourceVersion.
    let starts = stats.snapshot().watch_starts;
    tokio::time::timeout(Duration::from_secs(30), async {
        while stats.snapshot().watch_starts <= starts {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("another resumed watch within 30 s");
    let calls = sink.calls();
    let s = stats.snapshot();
    eprintln!("protobuf side: {s:?}");
    assert_eq!(
        (s.initial_watches, s.restarts, s.errors),
        (1, 0, 0),
        "{s:?}"
    );
    assert!(
        s.synced && s.clean_ends >= 2 && s.last_rv >= del_rv,
        "{s:?}"
    );
    assert!(!calls.contains(&Call::Restarted));
    assert_eq!(
        calls
            .iter()
            .filter(|c| matches!(c, Call::Bookmark(_, true, _)))
            .count(),
        1
    );
    let mut seen = BTreeMap::new();
    for c in &calls[end + 1..] {
        match c {
            Call::Attach(_, k, rv, _) => {
                assert!(rv > synced_rv, "{k:?}@{rv}: not after the initial state");
                assert!(
                    seen.insert((k.clone(), *rv), ()).is_none(),
                    "{k:?}@{rv} twice"
                );
            }
            Call::Bookmark(rv, false, env) => {
                assert!(rv >= synced_rv);
                assert_eq!(
                    env,
                    &bookmark_object("v1", "ConfigMap", &[], &rv.to_string(), false)
                );
            }
            other => panic!("after the initial state: {other:?}"),
        }
    }
    assert_eq!(seen.len(), written.len() + 1, "{seen:?}");

    shutdown.cancel();
    side.join().await.unwrap();
    cp.stop().await;
}
