//! A watcher that stops reading is closed by the hub once its queue overflows and the dispatch
//! budget runs out, while every other watcher keeps receiving every event (ARCHITECTURE.md:
//! "a watcher that cannot keep up is closed (and counted), never allowed to stall the others"),
//! including a watcher on the same HTTP/2 connection. (Checked: with that connection's
//! flow-control window as small as the slow stream's, the neighbour misses events, so it does
//! share the connection.)

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{EventReader, TestProxy, plain_client};
use crate::support::watch_validator::{Truth, rv_of};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::json;

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(30);
/// Large enough that a few hundred events fill the HTTP/2 windows and buffers in front of the
/// slow watcher quickly.
const DATA_BYTES: usize = 4096;
const MAX_WRITES: usize = 3000;
/// Writes after the slow watcher was closed: the others must get these too.
const WRITES_AFTER_CLOSE: usize = 50;

/// Reads a watch from `rv`, resuming from its last resourceVersion whenever the stream ends
/// (as client-go does), recording event resourceVersions and how often it was closed.
async fn fast_watcher(
    client: Client<
        impl hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
        Full<Bytes>,
    >,
    url_base: String,
    mut rv: u64,
    seen: Arc<Mutex<(Vec<u64>, usize)>>,
    stop: tokio_util::sync::CancellationToken,
) {
    while !stop.is_cancelled() {
        let req = Request::get(format!("{url_base}&resourceVersion={rv}"))
            .header("authorization", "Bearer fast")
            .body(Full::default())
            .unwrap();
        let resp = tokio::select! {
            _ = stop.cancelled() => return,
            r = client.request(req) => r.expect("watch request"),
        };
        assert_eq!(resp.status(), 200);
        let mut r = EventReader::new(resp);
        loop {
            let ev = tokio::select! {
                _ = stop.cancelled() => return,
                ev = r.try_next() => ev,
            };
            match ev {
                Ok(Some(ev)) => {
                    let t = ev["type"].as_str().unwrap_or("");
                    assert!(
                        matches!(t, "ADDED" | "MODIFIED" | "DELETED" | "BOOKMARK"),
                        "{ev}"
                    );
                    let erv = rv_of(&ev["object"]);
                    if t != "BOOKMARK" {
                        seen.lock().unwrap().0.push(erv);
                    }
                    rv = rv.max(erv);
                }
                Ok(None) | Err(_) => {
                    seen.lock().unwrap().1 += 1;
                    break;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_stops_reading_is_closed_and_the_others_get_every_event() {
    let closed_at = slow_watcher_scenario(16, usize::MAX, DATA_BYTES).await;
    assert!(closed_at > 16, "{closed_at}");
}

/// With the default queue (1,024 events) and its byte bound (`cache.watcherQueueBytes`, here
/// 1 MiB), a slow reader of 16 KiB objects is closed by bytes: after about 1 MiB plus what
/// the HTTP/2 buffers in front of it absorbed, not after 1,024 events (16 MiB).
#[tokio::test]
async fn a_slow_reader_of_large_objects_is_closed_by_queued_bytes() {
    let data = 16 << 10;
    let closed_at = slow_watcher_scenario(1024, 1 << 20, data).await;
    let written = closed_at * data;
    println!("16 KiB objects: slow watcher closed after {closed_at} writes ({written} bytes)");
    assert!(
        written < 4 << 20,
        "closed after {closed_at} writes of {data} bytes: the byte bound did not act"
    );
}

/// A watcher that stops reading among fast ones on every transport; returns the number of
/// writes after which the hub closed it. Every fast watcher must get every event.
async fn slow_watcher_scenario(queue: usize, queue_bytes: usize, data_bytes: usize) -> usize {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "slow"}}))
        .await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into(), "pods".into()];
        c.cache.watcher_queue = queue;
        c.cache.watcher_queue_bytes = queue_bytes;
        c.cache.dispatch_budget = Duration::from_millis(50);
    })
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    let cache = eventually("the configmaps cache to sync", GUARD, async || {
        state
            .caches
            .get("", "v1", "configmaps")
            .filter(|c| c.is_ready())
            .ok_or("not synced")
    })
    .await;
    let rv0 = fake.current_rv();
    let path = "/api/v1/namespaces/slow/configmaps?watch=1";

    // The slow watcher: an h2c stream with a small flow-control window, so the proxy soon
    // cannot write to it; it receives the response head and then never polls the body. The
    // connection's window is large: a fast watcher shares this connection (the proxy runs a
    // connection's streams in one task, `local_streams`), and must not wait for its neighbour.
    let mut b = Client::builder(TokioExecutor::new());
    b.http2_only(true)
        .http2_initial_stream_window_size(65_535)
        .http2_initial_connection_window_size(16 << 20)
        .http2_adaptive_window(false);
    let slow_client: Client<HttpConnector, Full<Bytes>> = b.build(HttpConnector::new());
    let slow = slow_client
        .request(
            Request::get(proxy.http(&format!("{path}&resourceVersion={rv0}")))
                .header("authorization", "Bearer slow")
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(slow.status(), 200);

    // The others: TLS HTTP/2, TLS HTTP/1.1, h2c, and h2c on the slow watcher's own
    // connection — each reading as fast as it can.
    let stop = tokio_util::sync::CancellationToken::new();
    let mut fast = Vec::new();
    let mut tasks = Vec::new();
    for (i, kind) in ["h2", "http/1.1", "h2c", "h2c beside the slow watcher"]
        .iter()
        .enumerate()
    {
        let seen = Arc::new(Mutex::new((Vec::new(), 0usize)));
        fast.push((kind, seen.clone()));
        let s = stop.clone();
        tasks.push(match i {
            0 => tokio::spawn(fast_watcher(
                proxy.client(None, true).0,
                proxy.https(path),
                rv0,
                seen,
                s,
            )),
            1 => tokio::spawn(fast_watcher(
                proxy.client(None, false).0,
                proxy.https(path),
                rv0,
                seen,
                s,
            )),
            2 => tokio::spawn(fast_watcher(
                plain_client(true),
                proxy.http(path),
                rv0,
                seen,
                s,
            )),
            _ => tokio::spawn(fast_watcher(
                slow_client.clone(),
                proxy.http(path),
                rv0,
                seen,
                s,
            )),
        });
    }

    // Write until the hub closes the slow watcher, then some more.
    let data = "x".repeat(data_bytes);
    let mut writes = 0;
    let mut closed_at = None;
    while closed_at.is_none_or(|c| writes < c + WRITES_AFTER_CLOSE) {
        assert!(
            writes < MAX_WRITES,
            "the slow watcher was never closed after {writes} writes"
        );
        fake.create(
            "/api/v1/namespaces/slow/configmaps",
            json!({"metadata": {"name": format!("cm-{writes}")}, "data": {"d": data}}),
        )
        .await;
        writes += 1;
        if closed_at.is_none() && cache.hub.stats.closed_slow.load(Ordering::Relaxed) > 0 {
            closed_at = Some(writes);
        }
        tokio::task::yield_now().await;
    }
    let truth = Truth::from_fake(&fake.writes("configmaps"));
    let all: Vec<u64> = truth
        .events
        .iter()
        .map(|e| e.rv)
        .filter(|rv| *rv > rv0)
        .collect();
    assert_eq!(all.len(), writes);

    // Every fast watcher gets every event, in order, exactly once.
    eventually("every fast watcher to get every event", GUARD, async || {
        let got: Vec<(&str, usize)> = fast
            .iter()
            .map(|(kind, s)| (**kind, s.lock().unwrap().0.len()))
            .collect();
        ok_if(got.iter().all(|(_, n)| *n >= all.len()), got)
    })
    .await;
    stop.cancel();
    for t in tasks {
        t.await.unwrap();
    }
    let mut fast_closes = 0;
    for (kind, s) in &fast {
        let s = s.lock().unwrap();
        assert_eq!(s.0, all, "{kind} watcher missed or repeated events");
        fast_closes += s.1;
    }

    // The slow watcher: what was buffered for it, a gap-free prefix, then a clean end.
    let mut r = EventReader::new(slow);
    let mut got = Vec::new();
    let end = tokio::time::timeout(GUARD, async {
        loop {
            match r.try_next().await {
                Ok(Some(ev)) => got.push(rv_of(&ev["object"])),
                Ok(None) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    })
    .await
    .expect("the slow watcher's stream never ended");
    println!(
        "writes={writes} (slow watcher closed after {closed_at:?}); slow watcher got {} events \
         before its clean end; fast watchers got {} each, closed {fast_closes} times; \
         hub closed_slow={}",
        got.len(),
        all.len(),
        cache.hub.stats.closed_slow.load(Ordering::Relaxed),
    );
    end.expect("the slow watcher's stream must end cleanly");
    assert!(got.len() < all.len(), "the slow watcher was not cut off");
    assert_eq!(
        got,
        all[..got.len()],
        "the slow watcher's events are not a gap-free prefix"
    );
    assert_eq!(
        cache.hub.stats.closed_slow.load(Ordering::Relaxed),
        1 + fast_closes as u64,
        "only the slow watcher (and any fast one that resumed) was closed"
    );
    proxy.shutdown().await;
    closed_at.unwrap()
}
