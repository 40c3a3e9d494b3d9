//! The upstream reflector against the fake apiserver: paged sync, event order, resume after
//! dropped / cleanly ended / stalled watches without relisting, relist after 410, backoff
//! through injected failures, bookmarks, cancellation.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::{FakeApiServer, LoggedRequest};
use kube_cache_proxy::cache::reflector::{
    Reflector, ReflectorConfig, ReflectorHandle, ReflectorStatus, RelistReason,
};
use kube_cache_proxy::cache::{CachedObject, EventKind, ReflectorSink, Resource};
use kube_cache_proxy::config::UpstreamConfig;
use kube_cache_proxy::upstream::Upstream;
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Bound on every wait for the reflector to reach a condition.
const WAIT: Duration = Duration::from_secs(10);

const CMS: &str = "/api/v1/namespaces/default/configmaps";

#[derive(Debug, Clone, PartialEq)]
enum Call {
    Replace {
        names: Vec<String>,
        rv: u64,
    },
    Apply {
        kind: EventKind,
        name: String,
        rv: u64,
    },
    Bookmark(u64),
    Health(Option<String>),
}

/// Records every sink call; tests await conditions on the record.
struct RecordingSink {
    calls: Mutex<Vec<Call>>,
    version: watch::Sender<u64>,
}

impl RecordingSink {
    fn new() -> Arc<RecordingSink> {
        Arc::new(RecordingSink {
            calls: Mutex::new(Vec::new()),
            version: watch::channel(0).0,
        })
    }

    fn record(&self, c: Call) {
        self.calls.lock().unwrap().push(c);
        // Guard dropped above: waiters re-lock to check.
        self.version.send_modify(|v| *v += 1);
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits (bounded by [`WAIT`]) until `f` returns `Some` on the recorded calls.
    async fn wait_for<T>(&self, what: &str, f: impl Fn(&[Call]) -> Option<T>) -> T {
        let mut rx = self.version.subscribe();
        let fut = async {
            loop {
                rx.borrow_and_update();
                if let Some(t) = f(&self.calls.lock().unwrap()) {
                    return t;
                }
                rx.changed().await.expect("sink alive");
            }
        };
        match tokio::time::timeout(WAIT, fut).await {
            Ok(t) => t,
            Err(_) => panic!("timed out waiting for {what}; calls: {:#?}", self.calls()),
        }
    }
}

impl ReflectorSink for RecordingSink {
    fn replace(&self, items: Vec<CachedObject>, rv: u64) {
        let names = items.iter().map(|o| o.meta.name.to_string()).collect();
        self.record(Call::Replace { names, rv });
    }
    fn apply(&self, kind: EventKind, object: CachedObject) {
        self.record(Call::Apply {
            kind,
            name: object.meta.name.to_string(),
            rv: object.meta.resource_version,
        });
    }
    fn bookmark(&self, rv: u64) {
        self.record(Call::Bookmark(rv));
    }
    fn set_unhealthy(&self, reason: Option<String>) {
        self.record(Call::Health(reason));
    }
}

/// The state the sink was told about: name → resourceVersion.
fn model(calls: &[Call]) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for c in calls {
        match c {
            Call::Replace { names, .. } => {
                // Replace carries names only; rvs come from later applies or stay 0.
                m = names.iter().map(|n| (n.clone(), 0)).collect();
            }
            Call::Apply { kind, name, rv } => match kind {
                EventKind::Deleted => {
                    m.remove(name);
                }
                _ => {
                    m.insert(name.clone(), *rv);
                }
            },
            _ => {}
        }
    }
    m
}

fn replaces(calls: &[Call]) -> Vec<(Vec<String>, u64)> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Replace { names, rv } => Some((names.clone(), *rv)),
            _ => None,
        })
        .collect()
}

fn apply_rvs(calls: &[Call]) -> Vec<u64> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Apply { rv, .. } => Some(*rv),
            _ => None,
        })
        .collect()
}

fn is_watch(r: &LoggedRequest) -> bool {
    r.query.as_deref().is_some_and(|q| q.contains("watch=1"))
}

fn configmap_requests(fake: &FakeApiServer) -> Vec<LoggedRequest> {
    fake.requests()
        .into_iter()
        .filter(|r| r.path == "/api/v1/configmaps")
        .collect()
}

fn watch_rvs(fake: &FakeApiServer) -> Vec<u64> {
    configmap_requests(fake)
        .iter()
        .filter(|r| is_watch(r))
        .map(|r| {
            query_param(r, "resourceVersion")
                .expect("watch has a resourceVersion")
                .parse()
                .unwrap()
        })
        .collect()
}

fn query_param(r: &LoggedRequest, key: &str) -> Option<String> {
    r.query.as_deref()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == key).then(|| v.to_string())
    })
}

fn config() -> ReflectorConfig {
    ReflectorConfig {
        page_size: 2,
        adaptive_page_size: None,
        stall_timeout: Duration::from_secs(30),
        watch_timeout: Duration::from_secs(60),
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        backoff_reset_after: Duration::from_secs(120),
        request_timeout: Duration::from_secs(5),
    }
}

struct Harness {
    fake: FakeApiServer,
    sink: Arc<RecordingSink>,
    handle: ReflectorHandle,
    shutdown: CancellationToken,
}

impl Harness {
    /// A fake apiserver holding `n` configmaps `cm-0..`, and a configmaps reflector over it.
    async fn start(n: usize, cfg: ReflectorConfig) -> Harness {
        Harness::start_with(n, cfg, |_| {}).await
    }

    async fn start_with(
        n: usize,
        cfg: ReflectorConfig,
        before: impl FnOnce(&FakeApiServer),
    ) -> Harness {
        let fake = FakeApiServer::start().await;
        for i in 0..n {
            fake.create(CMS, json!({"metadata": {"name": format!("cm-{i}")}}))
                .await;
        }
        before(&fake);
        kube_cache_proxy::http::tls::install_crypto_provider();
        let kc = kube::Config::new(fake.url().parse().unwrap());
        let upstream = Upstream::new(&kc, &UpstreamConfig::default()).unwrap();
        let sink = RecordingSink::new();
        let shutdown = CancellationToken::new();
        let handle = Reflector::spawn(
            Resource::core("configmaps", "ConfigMap", true),
            upstream,
            sink.clone(),
            cfg,
            shutdown.clone(),
        );
        Harness {
            fake,
            sink,
            handle,
            shutdown,
        }
    }

    /// Waits until the reflector has synced and its watch is established (healthy).
    async fn synced(&self) {
        self.sink
            .wait_for("sync and a healthy watch", |c| {
                let synced = c.iter().any(|c| matches!(c, Call::Replace { .. }));
                (synced && c.last() == Some(&Call::Health(None))).then_some(())
            })
            .await;
    }

    /// The apiserver's configmaps: name → resourceVersion.
    fn truth(&self, names: &[&str]) -> BTreeMap<String, u64> {
        names
            .iter()
            .filter_map(|n| {
                let obj = self.fake.get(&format!("{CMS}/{n}"))?;
                let rv = obj["metadata"]["resourceVersion"].as_str()?.parse().ok()?;
                Some((n.to_string(), rv))
            })
            .collect()
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.handle.join())
            .await
            .expect("reflector stops promptly")
            .expect("reflector task ends cleanly");
    }
}

/// The sink's view with replace-only entries (rv 0) filled from `truth` for comparison.
fn with_list_rvs(
    sink: &BTreeMap<String, u64>,
    truth: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    sink.iter()
        .map(|(k, v)| {
            let v = if *v == 0 {
                truth.get(k).copied().unwrap_or(0)
            } else {
                *v
            };
            (k.clone(), v)
        })
        .collect()
}

#[tokio::test]
async fn initial_sync_lists_in_pages_from_one_snapshot_and_replaces_once() {
    let h = Harness::start(5, config()).await;
    h.synced().await;

    let reqs = configmap_requests(&h.fake);
    let lists: Vec<&LoggedRequest> = reqs.iter().filter(|r| !is_watch(r)).collect();
    assert_eq!(lists.len(), 3, "5 objects at limit=2: {lists:#?}");
    for (i, r) in lists.iter().enumerate() {
        assert_eq!(query_param(r, "limit").as_deref(), Some("2"));
        assert_eq!(query_param(r, "resourceVersion"), None, "consistent read");
        assert_eq!(query_param(r, "continue").is_some(), i > 0, "{r:?}");
    }
    let calls = h.sink.calls();
    let reps = replaces(&calls);
    assert_eq!(reps.len(), 1);
    let (names, rv) = &reps[0];
    assert_eq!(names, &["cm-0", "cm-1", "cm-2", "cm-3", "cm-4"]);
    assert_eq!(*rv, h.fake.current_rv());
    // Unhealthy while listing, healthy once watching.
    assert!(matches!(calls.first(), Some(Call::Health(Some(_)))));

    let watch = reqs.iter().find(|r| is_watch(r)).expect("a watch");
    assert_eq!(
        query_param(watch, "resourceVersion"),
        Some(rv.to_string()),
        "watch from the list's resourceVersion"
    );
    assert_eq!(
        query_param(watch, "allowWatchBookmarks").as_deref(),
        Some("true")
    );
    let t: u64 = query_param(watch, "timeoutSeconds")
        .unwrap()
        .parse()
        .unwrap();
    assert!((60..120).contains(&t), "timeoutSeconds {t}");
    let stats = h.handle.stats().snapshot();
    assert_eq!(
        (stats.lists(RelistReason::Initial), stats.list_pages),
        (1, 3)
    );
    // The pages' bodies are counted (`kube_cache_proxy_upstream_received_bytes_total`): at
    // least the five objects' names are in them.
    assert!(
        stats.list_bytes >= 5 * r#""name":"cm-0""#.len() as u64,
        "{stats:?}"
    );
    h.stop().await;
}

#[tokio::test]
async fn events_after_sync_are_applied_in_order() {
    let h = Harness::start(2, config()).await;
    h.synced().await;
    let before = h.sink.calls().len();
    let bytes_before = h.handle.stats().snapshot().watch_bytes;

    let created = json!({"metadata": {"name": "new"}});
    let updated = json!({"metadata": {"name": "cm-0"}, "data": {"k": "v"}});
    h.fake.create(CMS, created.clone()).await;
    h.fake.update(&format!("{CMS}/cm-0"), updated.clone()).await;
    h.fake.delete(&format!("{CMS}/cm-1")).await;
    let rv = h.fake.current_rv();

    let got = h
        .sink
        .wait_for("three events", |c| {
            let applies: Vec<(EventKind, String, u64)> = c[before..]
                .iter()
                .filter_map(|c| match c {
                    Call::Apply { kind, name, rv } => Some((*kind, name.clone(), *rv)),
                    _ => None,
                })
                .collect();
            (applies.len() >= 3).then_some(applies)
        })
        .await;
    assert_eq!(
        got,
        [
            (EventKind::Added, "new".to_string(), rv - 2),
            (EventKind::Modified, "cm-0".to_string(), rv - 1),
            (EventKind::Deleted, "cm-1".to_string(), rv),
        ]
    );
    // The watch's bytes are counted: each event line holds its object, a superset of what
    // was written.
    let read = h.handle.stats().snapshot().watch_bytes - bytes_before;
    let written = (created.to_string().len() + updated.to_string().len()) as u64;
    assert!(read > written, "{read} bytes read, {written} written");
    h.stop().await;
}

/// Drops or ends the watch, writes, and checks the reflector resumed from the last
/// resourceVersion it saw, with no relist and every event exactly once.
async fn resume_after(fault: impl FnOnce(&FakeApiServer)) {
    let h = Harness::start(3, config()).await;
    // No bookmarks: the resume point is then exactly the last event's resourceVersion.
    h.fake
        .faults()
        .set_bookmark_interval(Duration::from_secs(3600));
    h.synced().await;
    h.fake
        .update(
            &format!("{CMS}/cm-0"),
            json!({"metadata": {"name": "cm-0"}, "data": {"a": "1"}}),
        )
        .await;
    let last = h.fake.current_rv();
    h.sink
        .wait_for("the first event", |c| {
            apply_rvs(c).contains(&last).then_some(())
        })
        .await;

    fault(&h.fake);
    for i in 0..3 {
        h.fake
            .create(CMS, json!({"metadata": {"name": format!("after-{i}")}}))
            .await;
    }
    h.fake.delete(&format!("{CMS}/cm-2")).await;
    let names = ["cm-0", "cm-1", "cm-2", "after-0", "after-1", "after-2"];
    let truth = h.truth(&names);
    h.sink
        .wait_for("all events after the fault", |c| {
            (with_list_rvs(&model(c), &truth) == truth).then_some(())
        })
        .await;

    let calls = h.sink.calls();
    assert_eq!(replaces(&calls).len(), 1, "no relist: {calls:#?}");
    let rvs = apply_rvs(&calls);
    assert!(
        rvs.windows(2).all(|w| w[0] < w[1]),
        "events once each, in order: {rvs:?}"
    );
    assert_eq!(rvs.len(), 5, "1 update + 3 creates + 1 delete: {rvs:?}");
    let watches = watch_rvs(&h.fake);
    assert!(watches.len() >= 2, "{watches:?}");
    assert_eq!(
        watches[1], last,
        "re-watch from the last event's resourceVersion"
    );
    let stats = h.handle.stats().snapshot();
    assert_eq!(stats.lists.iter().sum::<u64>(), 1);
    h.stop().await;
}

#[tokio::test]
async fn dropped_watch_resumes_from_last_rv_without_relist() {
    resume_after(|f| f.faults().drop_watches()).await;
}

#[tokio::test]
async fn cleanly_ended_watch_resumes_from_last_rv_without_relist() {
    resume_after(|f| f.faults().end_watches_cleanly()).await;
}

#[tokio::test]
async fn expired_resource_version_relists_with_the_current_state() {
    let h = Harness::start(3, config()).await;
    h.fake
        .faults()
        .set_bookmark_interval(Duration::from_secs(3600));
    h.synced().await;
    let first_rv = replaces(&h.sink.calls())[0].1;

    // Keep the reflector away while history moves on and is compacted.
    h.fake.faults().set_refuse(true);
    h.fake.faults().drop_watches();
    h.sink
        .wait_for("the watch loss to be reported", |c| {
            matches!(c.last(), Some(Call::Health(Some(_)))).then_some(())
        })
        .await;
    h.fake
        .create(CMS, json!({"metadata": {"name": "while-away"}}))
        .await;
    h.fake.delete(&format!("{CMS}/cm-1")).await;
    h.fake.compact(h.fake.current_rv());
    let current = h.fake.current_rv();
    h.fake.faults().set_refuse(false);

    let (names, rv) = h
        .sink
        .wait_for("a relist", |c| replaces(c).get(1).cloned())
        .await;
    assert_eq!(names, ["cm-0", "cm-2", "while-away"]);
    assert_eq!(rv, current);
    assert!(rv > first_rv);
    // From the watch loss to the relist the cache never claims health: the re-watch from the
    // compacted resourceVersion is answered 200 then a 410 ERROR event, and a cache that
    // reported healthy on those headers could serve stale consistent reads meanwhile.
    let calls = h.sink.calls();
    let replaced: Vec<usize> = calls
        .iter()
        .enumerate()
        .filter_map(|(i, c)| matches!(c, Call::Replace { .. }).then_some(i))
        .collect();
    let lost = (replaced[0]..replaced[1])
        .find(|i| matches!(calls[*i], Call::Health(Some(_))))
        .expect("the watch loss is reported");
    assert!(
        !calls[lost..replaced[1]]
            .iter()
            .any(|c| matches!(c, Call::Health(None))),
        "{calls:?}"
    );
    h.synced().await;
    // The first watch, and the one that got the 410 ERROR event, from the old resourceVersion.
    let from_first = watch_rvs(&h.fake)
        .iter()
        .filter(|w| **w == first_rv)
        .count();
    assert!(from_first >= 2, "{:?}", watch_rvs(&h.fake));
    let stats = h.handle.stats().snapshot();
    assert_eq!(stats.lists(RelistReason::Expired), 1);
    assert_eq!(stats.syncs, 2);

    // And it keeps following changes from the relist's resourceVersion.
    h.fake
        .create(CMS, json!({"metadata": {"name": "later"}}))
        .await;
    let later = h.fake.current_rv();
    h.sink
        .wait_for("an event after the relist", |c| {
            apply_rvs(c).contains(&later).then_some(())
        })
        .await;
    h.stop().await;
}

#[tokio::test]
async fn http_410_on_rewatch_relists() {
    let h = Harness::start(2, config()).await;
    h.synced().await;
    h.fake.faults().fail_next(1, 410);
    h.fake.faults().drop_watches();
    h.sink
        .wait_for("a relist", |c| (replaces(c).len() == 2).then_some(()))
        .await;
    h.synced().await;
    assert_eq!(h.handle.stats().snapshot().lists(RelistReason::Expired), 1);
    h.stop().await;
}

#[tokio::test]
async fn failing_rewatches_back_off_and_recover_without_relist() {
    let h = Harness::start(2, config()).await;
    h.fake
        .faults()
        .set_bookmark_interval(Duration::from_secs(3600));
    h.synced().await;
    h.fake.faults().fail_next(3, 500);
    h.fake.faults().drop_watches();
    h.fake.create(CMS, json!({"metadata": {"name": "x"}})).await;
    let rv = h.fake.current_rv();
    h.sink
        .wait_for("the event after recovery", |c| {
            apply_rvs(c).contains(&rv).then_some(())
        })
        .await;

    let calls = h.sink.calls();
    assert_eq!(replaces(&calls).len(), 1, "no relist");
    let watches = watch_rvs(&h.fake);
    assert_eq!(
        watches.len(),
        5,
        "first watch, 3 failures, recovery: {watches:?}"
    );
    assert!(
        watches[1..].iter().all(|w| *w == watches[0]),
        "every retry resumes from the same resourceVersion: {watches:?}"
    );
    let stats = h.handle.stats().snapshot();
    assert!(stats.backoffs >= 4, "{stats:?}");
    assert_eq!(
        stats.watch_errors, 4,
        "the drop + 3 injected 500s: {stats:?}"
    );
    // Unhealthy while backing off, healthy after.
    let health: Vec<&Call> = calls
        .iter()
        .filter(|c| matches!(c, Call::Health(_)))
        .collect();
    assert!(health.len() >= 4, "{health:?}");
    assert_eq!(health.last(), Some(&&Call::Health(None)));
    h.stop().await;
}

#[tokio::test]
async fn initial_list_failures_back_off_and_retry() {
    let h = Harness::start_with(3, config(), |f| f.faults().fail_next(2, 503)).await;
    h.synced().await;
    let stats = h.handle.stats().snapshot();
    assert_eq!(stats.lists(RelistReason::Initial), 1);
    assert_eq!(stats.lists(RelistReason::Retry), 2);
    assert_eq!(stats.list_errors, 2);
    assert_eq!(replaces(&h.sink.calls()).len(), 1);
    h.stop().await;
}

#[tokio::test]
async fn bookmarks_are_delivered_and_advance_the_resume_point() {
    let h = Harness::start(1, config()).await;
    h.fake
        .faults()
        .set_bookmark_interval(Duration::from_millis(50));
    h.synced().await;
    // Other kinds move the global resourceVersion; bookmarks carry it.
    h.fake
        .create("/api/v1/namespaces", json!({"metadata": {"name": "other"}}))
        .await;
    let rv = h.fake.current_rv();
    h.sink
        .wait_for("a bookmark at the current resourceVersion", |c| {
            c.contains(&Call::Bookmark(rv)).then_some(())
        })
        .await;
    h.fake.faults().drop_watches();
    h.sink
        .wait_for("a resumed watch", |_| watch_rvs(&h.fake).get(1).copied())
        .await;
    assert!(watch_rvs(&h.fake)[1] >= rv, "resume from the bookmark");
    assert!(h.handle.stats().snapshot().bookmarks >= 1);
    h.stop().await;
}

#[tokio::test]
async fn silent_watch_is_detected_and_resumed() {
    let cfg = ReflectorConfig {
        stall_timeout: Duration::from_millis(300),
        ..config()
    };
    let h = Harness::start(1, cfg).await;
    h.fake
        .faults()
        .set_bookmark_interval(Duration::from_secs(3600));
    h.synced().await;
    let stalled = h
        .sink
        .wait_for("a second watch after the stall", |_| {
            let w = watch_rvs(&h.fake);
            (w.len() >= 2).then_some(w)
        })
        .await;
    assert_eq!(
        stalled[0], stalled[1],
        "resumed from the same resourceVersion"
    );
    let stats = h.handle.stats().snapshot();
    assert!(stats.stalls >= 1);
    assert_eq!(stats.syncs, 1, "no relist");
    h.stop().await;
}

#[tokio::test]
async fn cancellation_stops_promptly_and_reports_unhealthy() {
    let h = Harness::start(1, config()).await;
    h.synced().await;
    let status = h.handle.status();
    let sink = h.sink.clone();
    let fake_requests = h.fake.requests().len();
    let shutdown = h.shutdown.clone();
    shutdown.cancel();
    tokio::time::timeout(WAIT, h.handle.join())
        .await
        .expect("stops promptly")
        .expect("ends cleanly");
    assert_eq!(*status.borrow(), ReflectorStatus::Stopped);
    assert_eq!(
        sink.calls().last(),
        Some(&Call::Health(Some("reflector stopped".into())))
    );
    // Nothing more is delivered or requested.
    let n = sink.calls().len();
    h.fake
        .create(CMS, json!({"metadata": {"name": "ignored"}}))
        .await;
    h.fake.faults().drop_watches();
    tokio::task::yield_now().await;
    assert_eq!(sink.calls().len(), n);
    assert_eq!(h.fake.requests().len(), fake_requests);
}

#[tokio::test]
async fn cancellation_during_backoff_stops_promptly() {
    let cfg = ReflectorConfig {
        backoff_initial: Duration::from_secs(3600),
        backoff_max: Duration::from_secs(3600),
        ..config()
    };
    let h = Harness::start_with(1, cfg, |f| f.faults().fail_next(1, 500)).await;
    let mut status = h.handle.status();
    tokio::time::timeout(
        WAIT,
        status.wait_for(|s| matches!(s, ReflectorStatus::BackingOff { .. })),
    )
    .await
    .expect("backing off")
    .unwrap();
    h.stop().await;
}

#[tokio::test]
async fn compaction_mid_list_restarts_the_list_unpaged() {
    // The first page is answered; the second page's request freezes the fake on arrival and
    // waits while the snapshot its continue token names is compacted away.
    let h = Harness::start_with(5, config(), |f| f.faults().freeze_at(2)).await;
    eventually("the second page's request", WAIT, async || {
        let requests = configmap_requests(&h.fake).len();
        ok_if(requests >= 2, requests)
    })
    .await;
    assert_eq!(
        h.fake.requests().len(),
        2,
        "only the first two pages were asked for: {:#?}",
        h.fake.requests()
    );
    h.fake
        .create(CMS, json!({"metadata": {"name": "mid-list"}}))
        .await;
    h.fake.compact(h.fake.current_rv());
    h.fake.faults().set_freeze(false);
    h.synced().await;

    let reps = replaces(&h.sink.calls());
    assert_eq!(reps.len(), 1, "the broken list is never delivered");
    assert_eq!(reps[0].0.len(), 6, "the restarted list sees the new object");
    assert_eq!(reps[0].1, h.fake.current_rv());
    let lists: Vec<LoggedRequest> = configmap_requests(&h.fake)
        .into_iter()
        .filter(|r| !is_watch(r))
        .collect();
    assert_eq!(lists.len(), 3, "{lists:#?}");
    assert!(query_param(&lists[1], "continue").is_some());
    assert_eq!(lists[2].query, None, "restarted unpaged");
    let stats = h.handle.stats().snapshot();
    assert_eq!(stats.lists(RelistReason::ContinueExpired), 1);
    h.stop().await;
}
