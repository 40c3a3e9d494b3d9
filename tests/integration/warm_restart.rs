//! Warm restart (`cache.stateDir`): a proxy stopped gracefully saves each cache's state and
//! the restarted proxy loads it, resumes its upstream watch from the saved resourceVersion
//! (no LIST) and serves a client's resumed watch with exactly the writes it missed, the
//! writes made while the proxy was down included: no 410, no relist. A damaged file is
//! ignored (the cache lists as on a cold start) and never served.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::{FakeApiServer, LoggedRequest};
use crate::support::proxy::{EventReader, TestProxy, body_json};
use crate::support::watch_validator::rv_of;
use serde_json::{Value, json};

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(30);
const NS: &str = "warm";

fn cm(name: &str, n: u64) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "namespace": NS}, "data": {"n": n.to_string()}})
}

async fn start(fake: &FakeApiServer, dir: &std::path::Path) -> TestProxy {
    let dir = dir.to_path_buf();
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.cache.state_dir = Some(dir);
    })
    .await;
    wait_ready(&proxy).await;
    proxy
}

async fn wait_ready(proxy: &TestProxy) {
    eventually("the configmaps cache to be ready", GUARD, async || {
        let ready = proxy
            .cache("", "v1", "configmaps")
            .is_some_and(|c| c.is_ready());
        ok_if(ready, "not ready")
    })
    .await;
}

/// The proxy's own requests for configmaps: (lists, watches with their resourceVersion).
fn upstream_reads(reqs: &[LoggedRequest]) -> (usize, Vec<String>) {
    let mut lists = 0;
    let mut watches = Vec::new();
    for r in reqs.iter().filter(|r| r.path.ends_with("/configmaps")) {
        let q = r.query.as_deref().unwrap_or("");
        let param = |k: &str| {
            q.split('&')
                .find_map(|p| p.strip_prefix(k))
                .map(str::to_string)
        };
        if param("watch=").is_some() {
            watches.push(param("resourceVersion=").unwrap_or_default());
        } else {
            lists += 1;
        }
    }
    (lists, watches)
}

/// Reads a watch until `n` events (bookmarks skipped): (type, name, resourceVersion).
pub(crate) async fn events(r: &mut EventReader, n: usize) -> Vec<(String, String, u64)> {
    let mut got = Vec::new();
    while got.len() < n {
        let ev = tokio::time::timeout(GUARD, r.next())
            .await
            .expect("an event within the guard")
            .expect("the stream stays open");
        let t = ev["type"].as_str().unwrap().to_string();
        assert_ne!(t, "ERROR", "{ev}");
        if t != "BOOKMARK" {
            let name = ev["object"]["metadata"]["name"]
                .as_str()
                .unwrap()
                .to_string();
            got.push((t, name, rv_of(&ev["object"])));
        }
    }
    got
}

/// The fake's writes after `rv`, as a watch shows them.
pub(crate) fn writes_after(fake: &FakeApiServer, rv: u64) -> Vec<(String, String, u64)> {
    fake.writes("configmaps")
        .into_iter()
        .filter(|w| w.rv > rv)
        .map(|w| {
            let name = w.object["metadata"]["name"].as_str().unwrap().to_string();
            (w.typ.to_string(), name, w.rv)
        })
        .collect()
}

/// The apiserver's configmaps (name, resourceVersion), sorted, from its write log.
fn state_of(fake: &FakeApiServer) -> Vec<(String, String)> {
    let mut state = std::collections::BTreeMap::new();
    for w in fake.writes("configmaps") {
        let name = w.object["metadata"]["name"].as_str().unwrap().to_string();
        if w.typ == "DELETED" {
            state.remove(&name);
        } else {
            state.insert(name, w.rv.to_string());
        }
    }
    state.into_iter().collect()
}

async fn write_some(fake: &FakeApiServer, from: u64, n: u64) {
    for i in from..from + n {
        let item = format!("/api/v1/namespaces/{NS}/configmaps/cm-{}", i % 7);
        if fake.get(&item).is_none() {
            fake.create(
                &format!("/api/v1/namespaces/{NS}/configmaps"),
                cm(&format!("cm-{}", i % 7), i),
            )
            .await;
        } else if i % 5 == 0 {
            fake.delete(&item).await;
        } else {
            fake.update(&item, cm(&format!("cm-{}", i % 7), i)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_proxy_resumes_from_its_saved_state_without_a_list_or_a_client_relist() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
        .await;
    write_some(&fake, 0, 20).await;
    let state = tempfile::tempdir().unwrap();
    let mut proxy = start(&fake, state.path()).await;
    let client = proxy.client(None, true);
    let base = proxy.https(&format!("/api/v1/namespaces/{NS}/configmaps"));

    // A client watching through the proxy from the state it listed.
    let list = body_json(client.get(&base, Some("tok")).await).await;
    assert!(list["items"].is_array(), "{list}");
    let listed: u64 = list["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let watch = format!("{base}?watch=1&allowWatchBookmarks=true&resourceVersion={listed}");
    let mut r = EventReader::new(client.get(&watch, Some("tok")).await);
    write_some(&fake, 20, 10).await;
    let seen = events(&mut r, 10).await;
    assert_eq!(seen, writes_after(&fake, listed));
    let last = seen.last().unwrap().2;

    // SIGTERM: the watch ends cleanly, the state is saved; writes go on while the proxy is
    // down; the proxy starts again at the same address.
    proxy.running.take().unwrap().shutdown().await;
    // The drain ends it after a bookmark at the cache's progress (it allows bookmarks).
    let bm = r.next().await.expect("a bookmark at the drain");
    assert_eq!(bm["type"], "BOOKMARK", "{bm}");
    let progress: u64 = bm["object"]["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(progress >= last, "{bm}");
    assert!(r.next().await.is_none(), "the watch ended at the drain");
    let file = state.path().join("core_v1_configmaps.state");
    assert!(file.exists(), "the state was saved");
    write_some(&fake, 30, 6).await;
    fake.clear_requests();
    proxy.restart(|_| {}).await;
    wait_ready(&proxy).await;

    // The client resumes from its last resourceVersion (the bookmark's): exactly what it
    // missed, no 410.
    let client = proxy.client(None, true);
    let resume = format!("{base}?watch=1&allowWatchBookmarks=true&resourceVersion={progress}");
    let resp = client.get(&resume, Some("tok")).await;
    assert_eq!(resp.status(), 200);
    let mut r = EventReader::new(resp);
    let missed = writes_after(&fake, progress);
    assert_eq!(missed.len(), 6);
    assert_eq!(events(&mut r, 6).await, missed);
    // And what follows.
    write_some(&fake, 36, 3).await;
    assert_eq!(events(&mut r, 3).await, writes_after(&fake, missed[5].2));

    // Upstream: no LIST of configmaps at all, one watch from the saved resourceVersion.
    let (lists, watches) = upstream_reads(&fake.requests());
    assert_eq!(lists, 0, "no upstream LIST after a warm restart");
    let metrics = proxy.admin_get("/metrics").await.1;
    let warm = metrics
        .lines()
        .find(|l| l.starts_with("kube_cache_proxy_cache_warm_start{"))
        .unwrap_or_default()
        .to_string();
    assert!(warm.ends_with(" 1"), "{warm}");
    assert_eq!(
        watches.first().map(String::as_str),
        Some(&*last.to_string())
    );

    // A list served from the restored cache equals the apiserver's state.
    let names = |l: &Value| {
        let mut v: Vec<(String, String)> = l["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| {
                (
                    o["metadata"]["name"].as_str().unwrap().to_string(),
                    o["metadata"]["resourceVersion"]
                        .as_str()
                        .unwrap()
                        .to_string(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let direct = state_of(&fake);
    eventually(
        "the restored cache to reach the apiserver's state",
        GUARD,
        async || {
            let list = body_json(
                client
                    .get(&format!("{base}?resourceVersion=0"), Some("tok"))
                    .await,
            )
            .await;
            ok_if(names(&list) == direct, names(&list))
        },
    )
    .await;
    proxy.shutdown().await;
}

/// A proxy that crashed (no drain, no final save) restarts from its last periodic save,
/// which is older than what its clients saw: it resumes its upstream watch from the saved
/// resourceVersion (no LIST), catches up, and a client resuming from its newer
/// resourceVersion gets exactly the writes after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_proxy_restarts_from_its_last_periodic_save() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
        .await;
    write_some(&fake, 0, 12).await;
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().to_path_buf();
    let mut proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.cache.state_dir = Some(dir);
        // The periodic save is called by the test, not by a timer.
        c.cache.state_save_interval = Duration::ZERO;
    })
    .await;
    wait_ready(&proxy).await;
    let client = proxy.client(None, true);
    let base = proxy.https(&format!("/api/v1/namespaces/{NS}/configmaps"));
    let from = proxy.cache("", "v1", "configmaps").unwrap().rv();
    let watch = format!("{base}?watch=1&resourceVersion={from}");
    let mut r = EventReader::new(client.get(&watch, Some("tok")).await);
    write_some(&fake, 12, 5).await;
    events(&mut r, 5).await;
    // The last periodic save, then more writes the client sees.
    let caches = proxy.running.as_ref().unwrap().state.caches.clone();
    assert_eq!(caches.save_all(false).await, 1);
    assert_eq!(
        caches.save_all(false).await,
        0,
        "unchanged: not saved again"
    );
    let saved = proxy.cache("", "v1", "configmaps").unwrap().rv();
    write_some(&fake, 17, 6).await;
    let seen = events(&mut r, 6).await;
    let last = seen.last().unwrap().2;
    assert!(last > saved);
    drop(caches);

    proxy.running.take().unwrap().crash().await;
    drop(r);
    write_some(&fake, 23, 4).await;
    fake.clear_requests();
    proxy.restart(|_| {}).await;
    wait_ready(&proxy).await;
    let client = proxy.client(None, true);
    let resume = format!("{base}?watch=1&resourceVersion={last}");
    let resp = client.get(&resume, Some("tok")).await;
    assert_eq!(resp.status(), 200);
    let mut r = EventReader::new(resp);
    let missed = writes_after(&fake, last);
    assert_eq!(missed.len(), 4);
    assert_eq!(events(&mut r, 4).await, missed);
    let (lists, watches) = upstream_reads(&fake.requests());
    assert_eq!(lists, 0, "no upstream LIST after the crash");
    assert_eq!(
        watches.first().map(String::as_str),
        Some(&*saved.to_string())
    );
    proxy.shutdown().await;
}

/// A damaged state file is ignored: the cache lists as on a cold start and serves the
/// apiserver's state, never the file's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_state_file_is_ignored_and_the_cache_lists() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
        .await;
    write_some(&fake, 0, 10).await;
    let state = tempfile::tempdir().unwrap();
    let mut proxy = start(&fake, state.path()).await;
    proxy.running.take().unwrap().shutdown().await;
    let file = state.path().join("core_v1_configmaps.state");
    let mut bytes = std::fs::read(&file).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    write_some(&fake, 10, 4).await;
    fake.clear_requests();
    proxy.restart(|_| {}).await;
    wait_ready(&proxy).await;
    let (lists, _) = upstream_reads(&fake.requests());
    assert_eq!(lists, 1, "the cache listed");
    let metrics = proxy.admin_get("/metrics").await.1;
    assert!(
        metrics.contains("kube_cache_proxy_cache_warm_start{resource=\"configmaps\"} 0"),
        "a cold start"
    );
    let cache = proxy.cache("", "v1", "configmaps").unwrap();
    let mut cached: Vec<(String, String)> = cache
        .current()
        .objects
        .values()
        .map(|o| (o.meta.name.to_string(), o.meta.resource_version.to_string()))
        .collect();
    cached.sort();
    assert_eq!(
        cached,
        state_of(&fake),
        "the apiserver's state, not the file's"
    );
    proxy.shutdown().await;
}
