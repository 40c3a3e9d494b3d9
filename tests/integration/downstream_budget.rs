//! The byte budgets of what responses produced and clients have not read
//! (`server.connectionBufferBytes`, `server.downstreamBufferBytes`, `http::budget`): a
//! connection whose client never reads its socket stops being served once it holds its
//! budget, while other connections get every event; a stream blocked by its own flow-control
//! window does not starve the other streams of its connection; and what a closed connection
//! held is released.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{EventReader, TestProxy};
use crate::support::watch_validator::rv_of;

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(60);
/// Objects in the watched namespace and their size: 640 KB, more than two initial chunks
/// (256 KiB) per watch.
const OBJECTS: usize = 80;
const OBJECT_BYTES: usize = 8000;
/// The largest chunk a watch's body produces: its initial batch (256 KiB) plus one object.
const CHUNK: u64 = 256 * 1024 + 2 * OBJECT_BYTES as u64;

/// An IO that never reads: the client's socket receive buffer fills, then the proxy's send
/// buffer, and the proxy can no longer write to this connection.
struct NeverReads(tokio::net::TcpStream);

impl AsyncRead for NeverReads {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        _: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Poll::Pending
    }
}

impl AsyncWrite for NeverReads {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Opens `streams` watches from `resourceVersion=0` of `ns` on one h2c connection with the
/// largest windows HTTP/2 allows, and never reads. Abort the task to close the connection.
async fn never_reading(
    proxy: &TestProxy,
    ns: &str,
    streams: usize,
) -> (tokio::task::JoinHandle<()>, Vec<h2::client::ResponseFuture>) {
    let tcp = tokio::net::TcpStream::connect(proxy.insecure_addr)
        .await
        .unwrap();
    let (mut send, conn) = h2::client::Builder::new()
        .initial_window_size((1 << 31) - 1)
        .initial_connection_window_size((1 << 31) - 1)
        .handshake::<_, Bytes>(NeverReads(tcp))
        .await
        .unwrap();
    let conn_task = tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut held = Vec::new();
    for _ in 0..streams {
        let req = Request::get(format!(
            "http://127.0.0.1:{}/api/v1/namespaces/{ns}/configmaps?watch=true&resourceVersion=0",
            proxy.insecure_addr.port()
        ))
        .header("authorization", "Bearer hostile")
        .body(())
        .unwrap();
        send = send.ready().await.unwrap();
        held.push(send.send_request(req, true).unwrap().0);
    }
    (conn_task, held)
}

async fn seeded(ns: &str) -> FakeApiServer {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": ns}}))
        .await;
    let data = "x".repeat(OBJECT_BYTES);
    for i in 0..OBJECTS {
        fake.create(
            &format!("/api/v1/namespaces/{ns}/configmaps"),
            json!({"metadata": {"name": format!("big-{i}")}, "data": {"d": data}}),
        )
        .await;
    }
    fake
}

async fn synced(proxy: &TestProxy) {
    let state = proxy.running.as_ref().unwrap().state.clone();
    eventually("the configmaps cache to sync", GUARD, async || {
        state
            .caches
            .get("", "v1", "configmaps")
            .filter(|c| c.is_ready())
            .map(|_| ())
            .ok_or("not synced")
    })
    .await;
}

/// Reads a watch from `rv` on its own connection, recording the resourceVersions of the
/// events it gets.
fn fast_watcher(
    client: Client<HttpConnector, Full<Bytes>>,
    url: String,
    seen: Arc<Mutex<Vec<u64>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let req = Request::get(url)
            .header("authorization", "Bearer fast")
            .body(Full::default())
            .unwrap();
        let resp = client.request(req).await.expect("watch request");
        assert_eq!(resp.status(), 200);
        let mut r = EventReader::new(resp);
        while let Ok(Some(ev)) = r.try_next().await {
            if ev["type"] != "BOOKMARK" {
                seen.lock().unwrap().push(rv_of(&ev["object"]));
            }
        }
    })
}

fn h2c() -> Client<HttpConnector, Full<Bytes>> {
    let mut b = Client::builder(TokioExecutor::new());
    b.http2_only(true)
        .http2_initial_stream_window_size(1 << 20)
        .http2_initial_connection_window_size(16 << 20);
    b.build(HttpConnector::new())
}

async fn write_events(fake: &FakeApiServer, ns: &str, n: usize) -> Vec<u64> {
    let mut rvs = Vec::new();
    for i in 0..n {
        let o = fake
            .create(
                &format!("/api/v1/namespaces/{ns}/configmaps"),
                json!({"metadata": {"name": format!("new-{i}")}, "data": {"d": "y"}}),
            )
            .await;
        rvs.push(rv_of(&o));
    }
    rvs
}

/// A client that opens 100 watches from `resourceVersion=0` (640 KB each) with the largest
/// windows HTTP/2 allows and never reads: the proxy stops polling that connection's bodies
/// once it holds its budget (64 MB would be buffered otherwise), another connection's watcher
/// gets every event meanwhile, and closing the connection releases everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_never_reads_holds_at_most_its_budget() {
    let budget: u64 = 128 * 1024;
    let fake = seeded("hostile").await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.server.connection_buffer_bytes = budget;
    })
    .await;
    synced(&proxy).await;
    let metrics = &proxy.running.as_ref().unwrap().state.metrics;
    let waits = metrics
        .downstream_waits
        .get_or_create(&kube_cache_proxy::metrics::BudgetLabels {
            budget: "connection".into(),
        })
        .clone();

    let (conn_task, held) = never_reading(&proxy, "hostile", 100).await;

    // The proxy's socket fills; then the bodies wait.
    let bound = budget + CHUNK;
    eventually(
        "the non-reading connection's bodies to wait",
        GUARD,
        async || {
            let buffered = metrics.downstream_buffered.get() as u64;
            assert!(
                buffered <= bound,
                "{buffered} bytes buffered, bound {bound}"
            );
            ok_if(waits.get() > 0, buffered)
        },
    )
    .await;

    // Another connection meanwhile gets every event.
    let rv = fake.current_rv();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let fast = fast_watcher(
        h2c(),
        proxy.http(&format!(
            "/api/v1/namespaces/hostile/configmaps?watch=true&resourceVersion={rv}"
        )),
        seen.clone(),
    );
    let want = write_events(&fake, "hostile", 30).await;
    eventually(
        "the other connection's watcher to get every event",
        GUARD,
        async || {
            let buffered = metrics.downstream_buffered.get() as u64;
            // The fast connection holds at most its own budget.
            assert!(buffered <= 2 * bound, "{buffered} bytes buffered");
            let got = seen.lock().unwrap().clone();
            ok_if(got == want, (got.len(), want.len()))
        },
    )
    .await;
    let held_bytes = metrics.downstream_buffered.get() as u64;
    println!(
        "non-reading connection: {held_bytes} bytes buffered (budget {budget}), {} waits",
        waits.get()
    );

    // Closing the connection releases what it held.
    conn_task.abort();
    drop(held);
    fast.abort();
    eventually("the buffered bytes to return to 0", GUARD, async || {
        let b = metrics.downstream_buffered.get();
        ok_if(b == 0, b)
    })
    .await;
    proxy.shutdown().await;
}

/// A stream whose client never opens its window (a watch from `resourceVersion=0` that the
/// client never reads: HTTP/2 holds the rest of its first 256 KiB chunk, more than the
/// connection's budget) does not starve a watch on the same connection that reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_blocked_by_its_window_does_not_starve_its_neighbours() {
    let budget: u64 = 128 * 1024;
    let fake = seeded("windows").await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.server.connection_buffer_bytes = budget;
    })
    .await;
    synced(&proxy).await;
    let metrics = &proxy.running.as_ref().unwrap().state.metrics;

    // One connection (the client pools HTTP/2), stream windows of 64 KiB.
    let mut b = Client::builder(TokioExecutor::new());
    b.http2_only(true)
        .http2_initial_stream_window_size(65_535)
        .http2_initial_connection_window_size(16 << 20)
        .http2_adaptive_window(false);
    let client: Client<HttpConnector, Full<Bytes>> = b.build(HttpConnector::new());
    let path = "/api/v1/namespaces/windows/configmaps?watch=true";
    let stuck = client
        .request(
            Request::get(proxy.http(&format!("{path}&resourceVersion=0")))
                .header("authorization", "Bearer stuck")
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(stuck.status(), 200);
    eventually(
        "the stuck stream to hold more than the budget",
        GUARD,
        async || {
            let b = metrics.downstream_buffered.get() as u64;
            ok_if(b > budget, b)
        },
    )
    .await;

    let rv = fake.current_rv();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let fast = fast_watcher(
        client.clone(),
        proxy.http(&format!("{path}&resourceVersion={rv}")),
        seen.clone(),
    );
    let want = write_events(&fake, "windows", 30).await;
    eventually("the neighbour to get every event", GUARD, async || {
        let got = seen.lock().unwrap().clone();
        ok_if(got == want, (got.len(), want.len()))
    })
    .await;
    // The stuck stream's data is still there: what it held was set aside, not lost.
    let mut r = EventReader::new(stuck);
    let first = r.next().await.expect("the stuck stream's first event");
    assert_eq!(first["type"], "ADDED");
    fast.abort();
    drop((r, client));
    eventually("the buffered bytes to return to 0", GUARD, async || {
        let b = metrics.downstream_buffered.get();
        ok_if(b == 0, b)
    })
    .await;
    proxy.shutdown().await;
}

/// With a process budget of two connection budgets, three connections that never read hold
/// at most that budget plus, for each, what it may always hold (256 KiB) and one chunk; a
/// connection that reads (holding little) is never stopped and gets every event; closing
/// them releases everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_process_budget_stops_connections_that_hold_the_most() {
    let conn_budget: u64 = 1 << 20;
    let process_budget: u64 = 2 << 20;
    let fake = seeded("process").await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.server.connection_buffer_bytes = conn_budget;
        c.server.downstream_buffer_bytes = process_budget;
    })
    .await;
    synced(&proxy).await;
    let metrics = &proxy.running.as_ref().unwrap().state.metrics;
    let waits = metrics
        .downstream_waits
        .get_or_create(&kube_cache_proxy::metrics::BudgetLabels {
            budget: "process".into(),
        })
        .clone();
    let mut hostile = Vec::new();
    for _ in 0..3 {
        hostile.push(never_reading(&proxy, "process", 100).await);
    }
    let floor = kube_cache_proxy::http::budget::PROCESS_FLOOR;
    let bound = process_budget + 3 * (floor + CHUNK);
    eventually(
        "the process budget to stop a connection",
        GUARD,
        async || {
            let buffered = metrics.downstream_buffered.get() as u64;
            assert!(
                buffered <= bound,
                "{buffered} bytes buffered, bound {bound}"
            );
            ok_if(waits.get() > 0, buffered)
        },
    )
    .await;

    let rv = fake.current_rv();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let fast = fast_watcher(
        h2c(),
        proxy.http(&format!(
            "/api/v1/namespaces/process/configmaps?watch=true&resourceVersion={rv}"
        )),
        seen.clone(),
    );
    let want = write_events(&fake, "process", 30).await;
    eventually(
        "the reading connection's watcher to get every event",
        GUARD,
        async || {
            let got = seen.lock().unwrap().clone();
            ok_if(got == want, (got.len(), want.len()))
        },
    )
    .await;

    for (task, held) in hostile {
        task.abort();
        drop(held);
    }
    fast.abort();
    eventually("the buffered bytes to return to 0", GUARD, async || {
        let b = metrics.downstream_buffered.get();
        ok_if(b == 0, b)
    })
    .await;
    proxy.shutdown().await;
}
