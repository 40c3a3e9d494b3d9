//! Watches passed through only because the cache could not serve them yet are moved home
//! (`serve::homing`): once the cache holds the client's last resourceVersion, the relayed
//! stream ends cleanly, the client watches again from where it was and the cache serves it.
//! No event is lost or delivered twice across the two streams (the watch validator), and
//! the apiserver keeps no client watch.
//!
//! The cache is held behind without timing: the fake apiserver holds every watch event
//! (the proxy's own watch and the passed-through ones alike) while the test writes, so a
//! resume from the apiserver's newest resourceVersion is one the cache has not reached
//! ("resourceVersion not reached": passed through after the bounded wait). A WatchList from
//! that resourceVersion goes the same way and is moved only after its
//! initial-events-end bookmark.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::TestProxy;
use crate::support::watch_validator::{
    Control, End, Rules, Scope, Start, Truth, WatchLog, WatcherSpec, run_watcher,
    stop_when_caught_up, sum_metric, validate,
};

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(60);
const NS: &str = "homing";

async fn write(fake: &FakeApiServer, name: &str, n: u64) {
    fake.create(
        &format!("/api/v1/namespaces/{NS}/configmaps"),
        json!({"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"name": name, "namespace": NS}, "data": {"n": n.to_string()}}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_passed_through_while_the_cache_was_behind_is_moved_home_without_a_lost_event() {
    let fake = Arc::new(FakeApiServer::start().await);
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
        .await;
    for i in 0..3 {
        write(&fake, &format!("pre-{i}"), i).await;
    }
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        // The bounded wait of a watch for a resourceVersion the cache has not reached:
        // short, since the cache cannot reach it while the events are held.
        c.lists.wait_for_resource_version = Duration::from_millis(100);
    })
    .await;
    eventually("the configmaps cache to sync", GUARD, async || {
        ok_if(
            proxy
                .cache("", "v1", "configmaps")
                .is_some_and(|c| c.is_ready() && c.unhealthy().is_none()),
            "not ready",
        )
    })
    .await;
    let cache = proxy.cache("", "v1", "configmaps").unwrap();

    // The cache falls behind: events held, writes go on.
    fake.faults().hold_watch_events();
    for i in 0..3 {
        write(&fake, &format!("behind-{i}"), i).await;
    }
    let newest = fake.current_rv();
    assert!(cache.rv() < newest);

    let ctl = Control {
        stop: tokio_util::sync::CancellationToken::new(),
        epoch: Arc::new(AtomicU64::new(0)),
        truth_rv: {
            let fake = fake.clone();
            Arc::new(move || Some(fake.current_rv()))
        },
    };
    let scope = Scope {
        namespace: Some(NS.into()),
        labels: Vec::new(),
    };
    let truth = Truth::from_fake(&fake.writes("configmaps"));
    // A resume (HTTP/1.1) and a WatchList (HTTP/2), both from the newest resourceVersion.
    let starts = [
        (Start::Resume(newest), false),
        (Start::SendInitial(Some(newest)), true),
    ];
    let mut logs = Vec::new();
    let mut tasks = Vec::new();
    for (i, (first, h2)) in starts.into_iter().enumerate() {
        let mut log = WatchLog::new(i, scope.clone(), true);
        if let Start::Resume(rv) = first {
            log.state = truth.filtered(&scope).state_at(rv);
        }
        let log = Arc::new(Mutex::new(log));
        logs.push(log.clone());
        let spec = WatcherSpec {
            resource: "configmaps",
            base: proxy.https(""),
            token: Some("alice".into()),
            first,
            relist: Start::Unset,
            timeout_secs: None,
            pause: None,
        };
        let client = proxy.client(None, h2).0;
        tasks.push(tokio::spawn(run_watcher(client, spec, log, ctl.clone())));
    }
    let metric = async |name: &str| {
        let (_, m) = proxy.admin_get("/metrics").await;
        sum_metric(
            &m,
            name,
            &[
                "resource=\"configmaps\"",
                "reason=\"resourceVersion not reached\"",
            ],
        )
    };
    eventually("both watches passed through", GUARD, async || {
        let n = metric("kube_cache_proxy_passthrough_watches").await;
        ok_if(n == 2.0, n)
    })
    .await;
    assert_eq!(
        metric("kube_cache_proxy_watches_moved_home_total").await,
        0.0
    );

    // More writes, then the events flow: the cache catches up, and each passed-through
    // watch ends once the cache holds what its client has seen.
    for i in 0..2 {
        write(&fake, &format!("held-{i}"), i).await;
    }
    fake.faults().release_watch_events();
    eventually("both watches moved home", GUARD, async || {
        let (moved, open) = (
            metric("kube_cache_proxy_watches_moved_home_total").await,
            metric("kube_cache_proxy_passthrough_watches").await,
        );
        ok_if(moved == 2.0 && open == 0.0, (moved, open))
    })
    .await;
    for i in 0..3 {
        write(&fake, &format!("after-{i}"), i).await;
    }

    let truth = Truth::from_fake(&fake.writes("configmaps"));
    let f = truth.filtered(&scope);
    let last = f.events.last().map_or(f.base_rv, |e| e.rv);
    let finals: Vec<_> = logs.iter().map(|_| (f.state_at(u64::MAX), last)).collect();
    stop_when_caught_up(&logs, &finals, &ctl, GUARD).await;
    for t in tasks {
        t.await.unwrap();
    }
    let mut report = crate::support::watch_validator::Report::default();
    for l in &logs {
        let l = l.lock().unwrap();
        report.merge(validate(&truth, &l, Rules::default(), true));
        // The passed-through stream ended cleanly, and the re-watch was the last session.
        assert!(l.sessions.len() >= 2, "{:?}", l.sessions);
        assert_eq!(l.sessions[0].end, End::Clean, "{:?}", l.sessions[0]);
        assert!(
            l.sessions[1..]
                .iter()
                .all(|s| matches!(s.start, Start::Resume(_))),
            "the client resumed, never started over: {:?}",
            l.sessions
        );
    }
    assert!(report.violations.is_empty(), "{:#?}", report.violations);
    assert_eq!(report.expired_410, 0);
    println!("{}", report.summary());

    // The apiserver saw each client's first watch only: the re-watches were the cache's.
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
    assert_eq!(
        client_watches, 2,
        "only the two first watches reached the apiserver"
    );
    let (_, m) = proxy.admin_get("/metrics").await;
    let from_cache = sum_metric(
        &m,
        "kube_cache_proxy_requests_total",
        &[
            "verb=\"WATCH\"",
            "resource=\"configmaps\"",
            "served_by=\"cache\"",
        ],
    );
    assert!(from_cache >= 2.0, "the re-watches were served by the cache");
    proxy.shutdown().await;
}
