//! Watch-history validation through the proxy's cache (see `support::watch_validator` for
//! the properties): 120 concurrent watchers with mixed protocols, scopes, selectors, start
//! points and bookmarks, a seeded random workload written directly to the fake apiserver, an
//! upstream disconnect and a forced upstream 410 relist mid-run. Every watcher's history must
//! match the real one, and its final view the real state.
//!
//! Also: access reviews decide what is served from the cache (a denied caller gets the
//! apiserver's 403 from the proxy).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support;
use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::{FakeApiServer, LoggedRequest};
use crate::support::proxy::{TestProxy, body_string, client_cert};
use crate::support::watch_validator::{
    Control, Req, Rng, Rules, SELECTORS, Scope, Start, Truth, WatchLog, WatcherSpec, Workload,
    run_watcher, stop_when_caught_up, sum_metric, write_fences,
};
use serde_json::{Value, json};

const NAMESPACES: [&str; 3] = ["wv-a", "wv-b", "wv-c"];
const NAMES_PER_NAMESPACE: usize = 12;
const WATCHERS: usize = 120;
/// Watchers starting (RV unset, or sendInitialEvents) during the upstream outage.
const LATE_WATCHERS: usize = 10;
const WRITES: usize = 900;
/// Pace of the writer: the run lasts about WRITES * this, so watch timeouts (2-4 s), bookmarks
/// and both faults happen while watchers are reading.
const WRITE_PACE: Duration = Duration::from_millis(6);
/// Guard against hangs only; the outcome does not depend on it.
const GUARD: Duration = Duration::from_secs(30);

const WORKLOAD: Workload = Workload {
    namespaces: &NAMESPACES,
    names: NAMES_PER_NAMESPACE,
    max_pad: 0,
};

async fn random_write(fake: &FakeApiServer, rng: &mut Rng, n: u64) {
    WORKLOAD.write(fake, rng, n).await;
}

fn is_watch(r: &LoggedRequest) -> bool {
    let q = r.query.as_deref().unwrap_or("");
    r.method == http::Method::GET
        && (r.path.contains("/watch/") || q.split('&').any(|p| p == "watch=1" || p == "watch=true"))
}

/// The proxy's own requests (not a client-certificate caller it impersonates).
fn is_proxy(r: &LoggedRequest) -> bool {
    r.headers
        .get("authorization")
        .is_some_and(|v| v == "Bearer proxy-token")
        && !r.headers.contains_key("impersonate-user")
}

/// The `resourceVersion` a logged request asked for ("" when unset).
fn rv_param(r: &LoggedRequest) -> String {
    r.query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .find_map(|p| p.strip_prefix("resourceVersion="))
        .unwrap_or("")
        .to_string()
}

async fn start_proxy(fake: &FakeApiServer) -> TestProxy {
    start_proxy_absorbing(fake, true).await
}

async fn start_proxy_absorbing(fake: &FakeApiServer, absorb_relists: bool) -> TestProxy {
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into(), "pods".into()];
        c.cache.bookmark_interval = Duration::from_millis(400);
        c.cache.absorb_relists = absorb_relists;
    })
    .await;
    wait_synced(&proxy).await;
    proxy
}

async fn wait_synced(proxy: &TestProxy) {
    let state = &proxy.running.as_ref().unwrap().state;
    // Synced and their watches confirmed: until then a most-recent watch passes through
    // (bounded consistency), and the run counts watches served from the cache.
    eventually("the proxy's caches to sync", GUARD, async || {
        let synced = ["configmaps", "pods"].iter().all(|r| {
            state
                .caches
                .get("", "v1", r)
                .is_some_and(|c| c.is_ready() && c.unhealthy().is_none())
        });
        ok_if(synced, "not synced")
    })
    .await;
}

async fn metrics(proxy: &TestProxy) -> String {
    proxy.admin_get("/metrics").await.1
}

/// The proxy's forced relist reaches its watchers as the difference between the old and the
/// new state (the default): no watcher gets 410 or relists, and every stream stays valid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_through_the_cache_see_exactly_the_real_history_across_faults() {
    faulted_run(true).await;
}

/// With `cache.absorbRelists: false`, the forced relist closes the watchers: their re-watch
/// gets 410 Expired and they relist, as behind an apiserver whose watch cache relisted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_relist_after_the_proxys_relist_when_it_does_not_absorb_it() {
    faulted_run(false).await;
}

async fn faulted_run(absorb: bool) {
    let t_start = Instant::now();
    let fake = FakeApiServer::start().await;
    for ns in NAMESPACES {
        fake.create("/api/v1/namespaces", json!({"metadata": {"name": ns}}))
            .await;
    }
    let mut rng = Rng::new(0x5eed_cafe_f00d);
    let mut n = 0u64;
    for _ in 0..30 {
        n += 1;
        random_write(&fake, &mut rng, n).await;
    }
    let proxy = start_proxy_absorbing(&fake, absorb).await;
    let cache = proxy.cache("", "v1", "configmaps").unwrap();
    // The proxy's history starts at its initial list: a client resuming from an older
    // resourceVersion gets 410 Expired by contract (as from an apiserver past its window), so
    // resuming clients start from a resourceVersion they could have got from this proxy.
    let history_start = cache.rv();

    // Clients: two HTTP/2 connections, pooled HTTP/1.1 connections, and a client-certificate
    // user on HTTP/2 (authorized by SubjectAccessReview instead of SelfSubjectAccessReview).
    let (cert, key) = client_cert(&proxy.client_ca, "alice", &["team-a"]);
    let h2a = proxy.client(None, true).0;
    let h2b = proxy.client(None, true).0;
    let h1 = proxy.client(None, false).0;
    let mtls = proxy.client(Some((&cert, &key)), true).0;

    let fake = Arc::new(fake);
    let ctl = Control {
        stop: tokio_util::sync::CancellationToken::new(),
        epoch: Arc::new(AtomicU64::new(0)),
        truth_rv: {
            let fake = fake.clone();
            Arc::new(move || Some(fake.current_rv()))
        },
    };
    let mut logs = Vec::new();
    let mut tasks = Vec::new();
    let mut protocols = BTreeMap::<&str, usize>::new();
    let mut spawn = |i: usize, kind: usize, rng: &mut Rng| {
        let scope = Scope {
            namespace: rng
                .pick(&[None, Some(0), Some(1), Some(2)])
                .map(|n| NAMESPACES[n].to_string()),
            labels: rng.pick(SELECTORS).to_vec(),
        };
        let first = match kind {
            0 => Start::Unset,
            1 => Start::Zero,
            2 => Start::SendInitial(None),
            _ => Start::Resume(
                fake.current_rv()
                    .saturating_sub(rng.below(20) as u64)
                    .max(history_start),
            ),
        };
        let relist = match first {
            Start::Zero => Start::Zero,
            Start::SendInitial(_) => Start::SendInitial(None),
            _ => Start::Unset,
        };
        let bookmarks = matches!(first, Start::SendInitial(_)) || rng.chance(50);
        let timeout_secs = rng.chance(40).then(|| 2 + rng.below(3) as u64);
        let mut log = WatchLog::new(i, scope.clone(), bookmarks);
        if let Start::Resume(rv) = first {
            // A client that starts from a resourceVersion holds the state at it (from a list).
            let truth = Truth::from_fake(&fake.writes("configmaps"));
            log.state = truth.filtered(&scope).state_at(rv);
        }
        let log = Arc::new(Mutex::new(log));
        logs.push(log.clone());
        let mut spec = WatcherSpec {
            resource: "configmaps",
            base: proxy.https(""),
            token: Some(format!("token-{}", i % 5)),
            first,
            relist,
            timeout_secs,
            pause: None,
        };
        let ctl = ctl.clone();
        let task = match i % 5 {
            0 | 1 => {
                *protocols.entry("h2").or_default() += 1;
                let c = if i.is_multiple_of(5) {
                    h2a.clone()
                } else {
                    h2b.clone()
                };
                tokio::spawn(run_watcher(c, spec, log, ctl))
            }
            2 | 3 => {
                *protocols.entry("http/1.1").or_default() += 1;
                tokio::spawn(run_watcher(h1.clone(), spec, log, ctl))
            }
            _ => {
                *protocols.entry("h2 mTLS").or_default() += 1;
                spec.token = None;
                tokio::spawn(run_watcher(mtls.clone(), spec, log, ctl))
            }
        };
        tasks.push(task);
    };
    for i in 0..WATCHERS {
        spawn(i, i % 4, &mut rng);
    }

    // The workload, with an upstream disconnect and a forced relist (410) in the middle.
    let t_writes = Instant::now();
    for w in 0..WRITES {
        if w == WRITES / 4 {
            ctl.epoch.store(1, Ordering::SeqCst);
            fake.faults().drop_watches();
        }
        if w == WRITES / 2 {
            // The proxy's watch drops; while it backs off, history moves on and is compacted,
            // so its resume gets 410 and it must relist.
            ctl.epoch.store(2, Ordering::SeqCst);
            fake.faults().drop_watches();
            for _ in 0..5 {
                n += 1;
                random_write(&fake, &mut rng, n).await;
            }
            fake.compact(fake.current_rv());
            // New watchers asking for the most recent state while the upstream is down: they
            // must not get the stale cache (checked strictly below).
            eventually("the upstream outage to be noticed", GUARD, async || {
                cache.unhealthy().ok_or("healthy")
            })
            .await;
            for i in WATCHERS..WATCHERS + LATE_WATCHERS {
                spawn(i, 2 * (i % 2), &mut rng);
            }
        }
        n += 1;
        random_write(&fake, &mut rng, n).await;
        tokio::time::sleep(WRITE_PACE).await;
    }
    let writes_took = t_writes.elapsed();
    eventually("the forced upstream relist", GUARD, async || {
        ok_if(cache.relists() > 0, "no relist")
    })
    .await;

    // Wait until every watcher's view equals the real state, after its scope's last write
    // (or the guard runs out and the validation below says why), then stop them.
    let scopes: Vec<Scope> = logs
        .iter()
        .map(|l| l.lock().unwrap().scope.clone())
        .collect();
    write_fences(&fake, &scopes, &NAMESPACES, n + 1).await;
    let truth = Truth::from_fake(&fake.writes("configmaps"));
    let t_conv = Instant::now();
    let finals: Vec<_> = logs
        .iter()
        .map(|l| {
            let f = truth.filtered(&l.lock().unwrap().scope);
            let last = f.events.last().map_or(f.base_rv, |e| e.rv);
            (f.state_at(u64::MAX), last)
        })
        .collect();
    // (If some watchers are still behind after GUARD, the validation below says why.)
    stop_when_caught_up(&logs, &finals, &ctl, GUARD).await;
    let converge_took = t_conv.elapsed();
    for t in tasks {
        t.await.unwrap();
    }

    let mut truth = truth;
    truth.horizon = fake.current_rv();
    truth.absorbed = cache.absorbed_relists();
    let rules = Rules {
        expired_from_epoch: Some(2),
        ..Rules::default()
    };
    let mut report = support::watch_validator::Report::default();
    for (i, l) in logs.iter().enumerate() {
        let rules = Rules {
            strict_consistency: i >= WATCHERS,
            ..rules.clone()
        };
        report.merge(support::watch_validator::validate(
            &truth,
            &l.lock().unwrap(),
            rules,
            true,
        ));
    }

    let m = metrics(&proxy).await;
    let cache_watches = sum_metric(
        &m,
        "kube_cache_proxy_requests_total",
        &["verb=\"WATCH\"", "served_by=\"cache\""],
    );
    let passthrough_watches = sum_metric(
        &m,
        "kube_cache_proxy_requests_total",
        &["verb=\"WATCH\"", "served_by=\"upstream\""],
    );
    let reqs = fake.requests();
    let upstream_watches = reqs.iter().filter(|r| is_watch(r) && is_proxy(r)).count();
    // Client watches the proxy passed through, by start: resuming from before the cache's
    // history (its own start or last relist) is the apiserver's to answer; a most-recent watch
    // while the upstream watch is down too; "0" (any state) never needs to.
    let mut client_watches = BTreeMap::<&str, usize>::new();
    for r in reqs.iter().filter(|r| is_watch(r) && !is_proxy(r)) {
        let kind = match rv_param(r).as_str() {
            "" => "most-recent",
            "0" => "rv=0",
            _ => "resume",
        };
        *client_watches.entry(kind).or_default() += 1;
    }
    let reviews = reqs
        .iter()
        .filter(|r| r.path.contains("accessreviews"))
        .count();

    println!(
        "writes={} (+30 seed) in {writes_took:?}; converged in {converge_took:?}; total {:?}",
        WRITES + 5,
        t_start.elapsed()
    );
    println!("protocols: {protocols:?}");
    println!("{}", report.summary());
    println!(
        "proxy: WATCH served_by=cache {cache_watches}, served_by=upstream {passthrough_watches}; \
         cache relists {} (absorbed {:?}); fake saw {upstream_watches} upstream watches from the proxy, \
         client watches passed through {client_watches:?}, {reviews} access reviews",
        cache.relists(),
        truth.absorbed
    );
    for v in report.violations.iter().take(40) {
        println!("VIOLATION {v}");
    }
    assert!(
        report.violations.is_empty(),
        "{} watch violations (see output)",
        report.violations.len()
    );
    assert!(
        report.events_checked > 10 * WATCHERS,
        "too few events checked"
    );
    if absorb {
        assert!(
            !truth.absorbed.is_empty(),
            "the forced relist was not told as a difference"
        );
        assert_eq!(
            report.expired_410, 0,
            "a watcher got 410 although the relist was absorbed"
        );
    } else {
        assert!(truth.absorbed.is_empty());
        assert!(
            report.expired_410 > 0,
            "the forced relist never reached a watcher as 410"
        );
    }
    assert!(report.initial_end_bookmarks > 0);
    assert!(
        cache_watches >= WATCHERS as f64,
        "watches were not served from the cache"
    );
    assert_eq!(
        client_watches.get("rv=0"),
        None,
        "resourceVersion=0 watches reached the apiserver"
    );
    assert!(
        client_watches.values().sum::<usize>() < report.sessions / 2,
        "most watches passed through: {client_watches:?}"
    );
    assert!(
        (2..=20).contains(&upstream_watches),
        "the proxy opened {upstream_watches} upstream watches"
    );
    assert!(reviews > 0, "no access reviews were asked");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn denied_callers_are_not_served_from_the_cache_and_get_the_apiservers_403() {
    let fake = FakeApiServer::start().await;
    fake.create(
        "/api/v1/namespaces/default/configmaps",
        support::watch_validator::configmap("default", "one", json!({}), 1, 0),
    )
    .await;
    fake.faults().deny("bad-token");
    fake.faults().deny("mallory");
    let proxy = start_proxy(&fake).await;
    fake.clear_requests();
    let url = proxy.https("/api/v1/namespaces/default/configmaps?watch=1&resourceVersion=0");
    let client = proxy.client(None, true);

    // Allowed: served from the cache (the apiserver sees only the reviews).
    let ok = client.get(&url, Some("good-token")).await;
    assert_eq!(ok.status(), 200);
    let mut r = support::proxy::EventReader::new(ok);
    let first = r.next().await.unwrap();
    assert_eq!(first["type"], "ADDED");
    drop(r);

    // Denied token and denied client-certificate user: the proxy answers the apiserver's 403
    // itself, with the apiserver's message; nothing passes through.
    let denied = client.get(&url, Some("bad-token")).await;
    assert_eq!(denied.status(), 403);
    let body: Value = serde_json::from_str(&body_string(denied).await).unwrap();
    assert_eq!(body["reason"], "Forbidden");
    assert_eq!(
        body["message"],
        "configmaps is forbidden: User \"bad-token\" cannot watch resource \"configmaps\" in API group \"\" in the namespace \"default\": denied by the fake apiserver's deny list"
    );
    assert_eq!(body["details"]["kind"], "configmaps");
    let (cert, key) = client_cert(&proxy.client_ca, "mallory", &[]);
    let m = proxy.client(Some((&cert, &key)), true);
    let denied = m.get(&url, None).await;
    assert_eq!(denied.status(), 403);
    let (cert, key) = client_cert(&proxy.client_ca, "alice", &[]);
    let a = proxy.client(Some((&cert, &key)), true);
    assert_eq!(a.get(&url, None).await.status(), 200);
    // A token the apiserver does not accept: 401, as from the apiserver.
    let unauth = client.get(&url, Some("invalid-token")).await;
    assert_eq!(unauth.status(), 401);
    // Repeats are answered from the decision caches.
    assert_eq!(client.get(&url, Some("bad-token")).await.status(), 403);

    let reqs = fake.requests();
    // (The proxy's own upstream watch may start after the cache is ready: not counted.)
    assert_eq!(
        reqs.iter().filter(|r| is_watch(r) && !is_proxy(r)).count(),
        0,
        "no watch passes through"
    );
    let count = |suffix: &str| reqs.iter().filter(|r| r.path.ends_with(suffix)).count();
    // Tokens are verified by TokenReview (they are not JWTs of the issuer); every caller's
    // decision by one SubjectAccessReview with the proxy's credentials.
    assert_eq!(count("/tokenreviews"), 3, "one review per token");
    assert_eq!(count("/selfsubjectaccessreviews"), 0);
    assert_eq!(count("/subjectaccessreviews"), 4, "one review per identity");
    proxy.shutdown().await;
}

/// The validator itself: a correct log passes; a gap, a duplicate, an early bookmark and a
/// wrong object are each caught.
#[test]
fn the_validator_catches_gaps_duplicates_early_bookmarks_and_wrong_objects() {
    use support::watch_validator::{End, Obs, Session, validate};
    let cm = |name: &str, app: &str, rv: u64| {
        json!({"metadata": {"name": name, "namespace": "ns", "resourceVersion": rv.to_string(),
               "labels": {"app": app}}})
    };
    let mut truth = Truth::default();
    truth.push(1, "ADDED", cm("x", "a", 1));
    truth.push(2, "ADDED", cm("y", "b", 2));
    truth.push(3, "MODIFIED", cm("x", "b", 3)); // leaves app=a
    truth.push(4, "MODIFIED", cm("y", "a", 4)); // enters app=a
    truth.horizon = 4;
    let scope = Scope {
        namespace: Some("ns".into()),
        labels: vec![Req::Eq("app", "a")],
    };
    let ev = |typ: &str, obj: Value| Obs::Event {
        typ: typ.into(),
        rv: support::watch_validator::rv_of(&obj),
        key: support::watch_validator::key_of(&obj),
        object: obj,
    };
    let left = cm("x", "a", 3); // the old state at the event's resourceVersion
    let run = |truth: &Truth, items: Vec<Obs>, final_state: &[Value]| {
        let mut log = WatchLog::new(0, scope.clone(), true);
        log.sessions.push(Session {
            start: Start::Resume(0),
            truth_rv_at_request: None,
            epoch: 0,
            end_epoch: 0,
            items,
            end: End::Clean,
        });
        for o in final_state {
            log.state
                .insert(support::watch_validator::key_of(o), o.clone());
        }
        validate(truth, &log, Rules::default(), true).violations
    };
    let good = vec![
        ev("ADDED", cm("x", "a", 1)),
        ev("DELETED", left.clone()),
        Obs::Bookmark {
            rv: 3,
            initial_end: false,
        },
        ev("ADDED", cm("y", "a", 4)),
    ];
    assert_eq!(
        run(&truth, good.clone(), &[cm("y", "a", 4)]),
        Vec::<String>::new()
    );
    let gap = vec![ev("ADDED", cm("x", "a", 1)), ev("ADDED", cm("y", "a", 4))];
    assert!(
        run(&truth, gap, &[cm("y", "a", 4)])
            .iter()
            .any(|v| v.contains("missing"))
    );
    let mut dup = good.clone();
    dup.insert(1, ev("ADDED", cm("x", "a", 1)));
    assert!(
        run(&truth, dup, &[cm("y", "a", 4)])
            .iter()
            .any(|v| v.contains("ordered"))
    );
    let early = vec![
        ev("ADDED", cm("x", "a", 1)),
        Obs::Bookmark {
            rv: 3,
            initial_end: false,
        },
        ev("DELETED", left),
    ];
    assert!(
        run(&truth, early, &[])
            .iter()
            .any(|v| v.contains("bookmarkable"))
    );
    let wrong = vec![
        ev("ADDED", cm("x", "c", 1)),
        ev("DELETED", cm("x", "a", 3)),
        ev("ADDED", cm("y", "a", 4)),
    ];
    assert!(
        run(&truth, wrong, &[cm("y", "a", 4)])
            .iter()
            .any(|v| v.contains("differs"))
    );
    assert!(
        run(&truth, good, &[])
            .iter()
            .any(|v| v.contains("final view"))
    );

    // An absorbed relist over (1, 4]: the difference from the state at 1 ({x}) to the state
    // at 4 ({y}) is valid (x's deletion at a revision of the window no listed object holds),
    // and so is the real history; a difference that leaves x behind, or carries an object
    // that is not the state at 4, is not.
    truth.absorbed = vec![(1, 4)];
    let at = |o: Value, rv: u64| {
        let mut o = o;
        o["metadata"]["resourceVersion"] = json!(rv.to_string());
        o
    };
    let difference = vec![
        ev("ADDED", cm("x", "a", 1)),
        ev("DELETED", at(cm("x", "a", 1), 2)),
        ev("ADDED", cm("y", "a", 4)),
    ];
    assert_eq!(
        run(&truth, difference, &[cm("y", "a", 4)]),
        Vec::<String>::new()
    );
    let history = vec![
        ev("ADDED", cm("x", "a", 1)),
        ev("DELETED", cm("x", "a", 3)),
        ev("ADDED", cm("y", "a", 4)),
    ];
    assert_eq!(
        run(&truth, history, &[cm("y", "a", 4)]),
        Vec::<String>::new()
    );
    let incomplete = vec![ev("ADDED", cm("x", "a", 1)), ev("ADDED", cm("y", "a", 4))];
    assert!(
        run(&truth, incomplete, &[cm("y", "a", 4)])
            .iter()
            .any(|v| v.contains("relist difference") && v.contains("leads to"))
    );
    let stale = vec![
        ev("ADDED", cm("x", "a", 1)),
        ev("DELETED", at(cm("x", "a", 1), 2)),
        ev("ADDED", cm("y", "b", 4)),
    ];
    assert!(
        run(&truth, stale, &[cm("y", "a", 4)])
            .iter()
            .any(|v| v.contains("is not the state at 4"))
    );
}
