//! Watch-history validation end to end (see `support::watch_validator` for the properties):
//! 120 concurrent watchers through the proxy in front of a REAL kube-apiserver + etcd, with
//! mixed scopes, label selectors that objects move in and out of, and every start point
//! (resourceVersion unset, "0", `sendInitialEvents` with and without a resourceVersion, and a
//! recent resourceVersion from a direct list), while a seeded random workload of creates,
//! updates and deletes goes DIRECTLY to the apiserver.
//!
//! The ground truth is the apiserver's own history: a base state from a direct cluster-wide
//! list taken before the proxy starts, and a reference watch opened directly on the apiserver
//! from that list's resourceVersion. The reference is read after the watchers have stopped (from
//! the apiserver's watch cache, which keeps at least 75 s of history), so that while they run
//! the apiserver's only cluster-wide configmaps WATCH is the proxy's: 120 watchers cost it one
//! watch. The reference is itself cross-checked against the write responses (each create and
//! update returns the object at its new resourceVersion; a ConfigMap delete returns only a
//! Status, so the reference supplies the delete's resourceVersion and last state).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support;
use crate::support::eventually::{eventually, ok_if, poll_within};
use crate::support::proxy::TestProxy;
use crate::support::watch_validator::{
    Control, Key, Report, Rng, Rules, SELECTORS, Scope, Start, Truth, WatchLog, WatcherSpec,
    key_of, random_labels, run_watcher, rv_of, sum_metric, validate,
};
use futures_util::TryStreamExt as _;
use http_body_util::BodyExt as _;
use kube::core::WatchEvent;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use serde_json::{Value, json};

const NAMESPACES: [&str; 3] = ["e2e-wv-a", "e2e-wv-b", "e2e-wv-c"];
/// Holds the end marker only, outside every watched namespace.
const MARKER_NAMESPACE: &str = "e2e-wv-end";
const NAMES_PER_NAMESPACE: usize = 10;
const WATCHERS: usize = 120;
/// Writes before the watchers start (the proxy syncs after the first `SEED_WRITES / 2`).
const SEED_WRITES: usize = 40;
const WRITES: usize = 300;
/// Pace of the writer: the run lasts a few seconds, so watch timeouts (2-4 s) and bookmarks
/// (every 500 ms, below) happen while watchers are reading.
const WRITE_PACE: Duration = Duration::from_millis(10);
const BOOKMARK_INTERVAL: Duration = Duration::from_millis(500);
/// Guard against hangs only; the outcome does not depend on it.
const GUARD: Duration = Duration::from_secs(20);

fn configmap(ns: &str, name: &str, labels: &Value, n: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "data": {"n": n.to_string()},
    })
}

/// One write the workload made, as the apiserver answered it.
#[derive(Debug, Clone)]
struct Written {
    typ: &'static str,
    key: Key,
    /// The response object (creates and updates); `None` for deletes (a Status).
    object: Option<Value>,
}

/// The writer: the only client writing in [`NAMESPACES`], so its bookkeeping of which objects
/// exist (and with which labels) is exact.
struct Writer {
    admin: kube::Client,
    rng: Rng,
    n: u64,
    /// key -> labels of the objects that exist.
    live: BTreeMap<Key, Value>,
    journal: Vec<Written>,
    /// The resourceVersion of the latest write response (for the validator's freshness
    /// accounting of consistent starts).
    latest: Arc<AtomicU64>,
}

impl Writer {
    async fn send(&self, method: http::Method, path: &str, body: Option<&Value>) -> Value {
        let req = http::Request::builder()
            .method(method.clone())
            .uri(path)
            .header("content-type", "application/json")
            .body(body.map_or_else(Vec::new, |b| serde_json::to_vec(b).unwrap()))
            .unwrap();
        self.admin
            .request::<Value>(req)
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// One random write: create a missing object, else update it (half the time with new
    /// labels, moving it across selectors) or delete it.
    async fn random_write(&mut self) {
        self.n += 1;
        let ns = *self.rng.pick(&NAMESPACES);
        let name = format!("cm-{}", self.rng.below(NAMES_PER_NAMESPACE));
        let key = format!("{ns}/{name}");
        let collection = format!("/api/v1/namespaces/{ns}/configmaps");
        let item = format!("{collection}/{name}");
        let (typ, object) = match self.live.get(&key).cloned() {
            None => {
                let labels = random_labels(&mut self.rng);
                let body = configmap(ns, &name, &labels, self.n);
                let o = self
                    .send(http::Method::POST, &collection, Some(&body))
                    .await;
                self.live.insert(key.clone(), labels);
                ("ADDED", Some(o))
            }
            Some(labels) if self.rng.chance(75) => {
                let labels = if self.rng.chance(50) {
                    random_labels(&mut self.rng)
                } else {
                    labels
                };
                // An unconditional update (no resourceVersion in the body): the apiserver
                // allows it for ConfigMaps.
                let body = configmap(ns, &name, &labels, self.n);
                let o = self.send(http::Method::PUT, &item, Some(&body)).await;
                self.live.insert(key.clone(), labels);
                ("MODIFIED", Some(o))
            }
            Some(_) => {
                let status = self.send(http::Method::DELETE, &item, None).await;
                assert_eq!(
                    status["kind"], "Status",
                    "a ConfigMap delete returns a Status"
                );
                self.live.remove(&key);
                ("DELETED", None)
            }
        };
        if let Some(o) = &object {
            self.latest.fetch_max(rv_of(o), Ordering::SeqCst);
        }
        self.journal.push(Written { typ, key, object });
    }
}

/// A direct cluster-wide list of ConfigMaps: (resourceVersion, key -> object with its type meta,
/// as watch events carry it).
async fn list_direct(admin: &kube::Client) -> (u64, BTreeMap<Key, Value>) {
    let req = http::Request::get("/api/v1/configmaps")
        .body(Vec::new())
        .unwrap();
    let l: Value = admin.request(req).await.unwrap();
    let rv = l["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let items = l["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            let mut o = o.clone();
            o["kind"] = "ConfigMap".into();
            o["apiVersion"] = "v1".into();
            (key_of(&o), o)
        })
        .collect();
    (rv, items)
}

/// The reference history: a watch opened directly on the apiserver from `from`, read until the
/// event at `until` (exclusive). Returns the events (type, object) before it.
async fn reference_history(admin: &kube::Client, from: u64, until: u64) -> Vec<(String, Value)> {
    let req = http::Request::get(format!(
        "/api/v1/configmaps?watch=1&resourceVersion={from}&allowWatchBookmarks=true&timeoutSeconds=60"
    ))
    .body(Vec::new())
    .unwrap();
    let stream = admin.request_events::<Value>(req).await.unwrap();
    let mut stream = std::pin::pin!(stream);
    let mut events = Vec::new();
    let read = async {
        while let Some(ev) = stream.try_next().await.unwrap() {
            let (typ, o) = match ev {
                WatchEvent::Added(o) => ("ADDED", o),
                WatchEvent::Modified(o) => ("MODIFIED", o),
                WatchEvent::Deleted(o) => ("DELETED", o),
                WatchEvent::Bookmark(_) => continue,
                WatchEvent::Error(e) => panic!("the reference watch from {from} failed: {e:?}"),
            };
            if rv_of(&o) >= until {
                return;
            }
            events.push((typ.to_string(), o));
        }
        panic!("the reference watch ended before {until}");
    };
    tokio::time::timeout(GUARD, read)
        .await
        .expect("the reference watch reached the end marker");
    events
}

/// The reference agrees with the write responses: the writes in [`NAMESPACES`] are exactly
/// the workload's, in order, each create and update at its response's resourceVersion with its
/// response's object.
fn cross_check(truth: &Truth, journal: &[Written]) {
    let ours: Vec<_> = truth
        .events
        .iter()
        .filter(|e| {
            NAMESPACES
                .iter()
                .any(|ns| e.key.starts_with(&format!("{ns}/")))
        })
        .collect();
    assert_eq!(
        ours.len(),
        journal.len(),
        "the reference history holds {} workload events, the workload made {} writes",
        ours.len(),
        journal.len()
    );
    for (i, (e, w)) in ours.iter().zip(journal).enumerate() {
        assert_eq!((e.typ, &e.key), (w.typ, &w.key), "write {i}");
        if let Some(o) = &w.object {
            assert_eq!(e.rv, rv_of(o), "write {i} ({} {})", w.typ, w.key);
            assert_eq!(&e.object, o, "write {i} ({} {})", w.typ, w.key);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_through_the_proxy_see_exactly_the_apiservers_history() {
    let t_start = Instant::now();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let admin = cp.admin_client().await.unwrap();
    for ns in NAMESPACES.iter().chain([&MARKER_NAMESPACE]) {
        cp.create_default_service_account(ns).await.unwrap();
    }
    let latest = Arc::new(AtomicU64::new(0));
    let mut w = Writer {
        admin: admin.clone(),
        rng: Rng::new(0xe2e0_5eed_0bad_cafe),
        n: 0,
        live: BTreeMap::new(),
        journal: Vec::new(),
        latest: latest.clone(),
    };
    // The base of the truth, before the proxy starts: everything it serves is at or after it.
    let (base_rv, base) = list_direct(&admin).await;
    for _ in 0..SEED_WRITES / 2 {
        w.random_write().await;
    }

    let upstream = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(&cp.admin_kubeconfig_yaml()).unwrap(),
        &Default::default(),
    )
    .await
    .unwrap();
    let proxy = TestProxy::start_with_kube(upstream, |c| {
        c.cache.bookmark_interval = BOOKMARK_INTERVAL;
    })
    .await;
    let state = &proxy.running.as_ref().unwrap().state;
    let cache = eventually("the proxy's configmaps cache to sync", GUARD, async || {
        state
            .caches
            .get("", "v1", "configmaps")
            .filter(|c| c.is_ready())
            .ok_or("not synced")
    })
    .await;
    let history_start = cache.rv();
    let synced_after = t_start.elapsed();

    // Recent resourceVersions within the proxy's history, with the state at each (from a
    // direct list, as a client resuming from it would hold): resuming watchers start there.
    let mut snapshots = Vec::new();
    for _ in 0..3 {
        for _ in 0..SEED_WRITES / 6 {
            w.random_write().await;
        }
        let (rv, items) = list_direct(&admin).await;
        assert!(rv >= history_start, "{rv} before the proxy's history");
        snapshots.push((rv, items));
    }

    let client_h2a = proxy.client(None, true).0;
    let client_h2b = proxy.client(None, true).0;
    let client_h1 = proxy.client(None, false).0;
    let ctl = Control {
        stop: tokio_util::sync::CancellationToken::new(),
        epoch: Arc::new(AtomicU64::new(0)),
        truth_rv: {
            let latest = latest.clone();
            Arc::new(move || Some(latest.load(Ordering::SeqCst)))
        },
    };
    let mut rng = Rng::new(0x0bad_5eed_e2e0);
    let mut logs = Vec::new();
    let mut tasks = Vec::new();
    let mut kinds = BTreeMap::<&str, usize>::new();
    for i in 0..WATCHERS {
        let scope = Scope {
            namespace: rng
                .pick(&[None, Some(0), Some(1), Some(2)])
                .map(|n| NAMESPACES[n].to_string()),
            labels: rng.pick(SELECTORS).to_vec(),
        };
        let (snap_rv, snap) = rng.pick(&snapshots);
        let (first, kind) = match i % 5 {
            0 => (Start::Unset, "unset"),
            1 => (Start::Zero, "rv=0"),
            2 => (Start::SendInitial(None), "sendInitialEvents"),
            3 => (Start::SendInitial(Some(*snap_rv)), "sendInitialEvents+rv"),
            _ => (Start::Resume(*snap_rv), "resume"),
        };
        *kinds.entry(kind).or_default() += 1;
        let relist = match first {
            Start::Zero => Start::Zero,
            Start::SendInitial(_) => Start::SendInitial(None),
            _ => Start::Unset,
        };
        let bookmarks = matches!(first, Start::SendInitial(_)) || rng.chance(50);
        let timeout_secs = rng.chance(40).then(|| 2 + rng.below(3) as u64);
        let mut log = WatchLog::new(i, scope.clone(), bookmarks);
        if let Start::Resume(_) = first {
            log.state = snap
                .iter()
                .filter(|(_, o)| scope.matches(o))
                .map(|(k, o)| (k.clone(), o.clone()))
                .collect();
        }
        let log = Arc::new(Mutex::new(log));
        logs.push(log.clone());
        let spec = WatcherSpec {
            resource: "configmaps",
            base: proxy.https(""),
            token: Some(cp.admin_token().to_string()),
            first,
            relist,
            timeout_secs,
            pause: None,
        };
        let client = match i % 3 {
            0 => client_h2a.clone(),
            1 => client_h2b.clone(),
            _ => client_h1.clone(),
        };
        tasks.push(tokio::spawn(run_watcher(client, spec, log, ctl.clone())));
    }

    // The workload; the apiserver's watches are counted while all watchers are open.
    let t_writes = Instant::now();
    let mut upstream_watches = Vec::new();
    for i in 0..WRITES {
        if i == WRITES / 2 || i == WRITES - 1 {
            upstream_watches.push(support::e2e::apiserver_watches(&admin, "configmaps").await);
        }
        w.random_write().await;
        tokio::time::sleep(WRITE_PACE).await;
    }
    let writes_took = t_writes.elapsed();

    // Wait until every watcher's view equals the apiserver's state, then stop them.
    let (_, now) = list_direct(&admin).await;
    let finals: Vec<BTreeMap<Key, Value>> = logs
        .iter()
        .map(|l| {
            let scope = l.lock().unwrap().scope.clone();
            now.iter()
                .filter(|(_, o)| scope.matches(o))
                .map(|(k, o)| (k.clone(), o.clone()))
                .collect()
        })
        .collect();
    let t_conv = Instant::now();
    // (If some watchers are still behind after GUARD, the validation below says why.)
    let _still_behind = poll_within(GUARD, async || {
        let behind = logs
            .iter()
            .zip(&finals)
            .filter(|(l, want)| !l.lock().unwrap().converged(want))
            .count();
        ok_if(behind == 0, behind)
    })
    .await;
    let converge_took = t_conv.elapsed();
    upstream_watches.push(support::e2e::apiserver_watches(&admin, "configmaps").await);
    ctl.stop.cancel();
    for t in tasks {
        t.await.unwrap();
    }

    // The end marker: written after the watchers stopped, so everything they saw (bookmarks
    // included) is below it.
    let marker = w
        .send(
            http::Method::POST,
            &format!("/api/v1/namespaces/{MARKER_NAMESPACE}/configmaps"),
            Some(&json!({"metadata": {"name": "end"}})),
        )
        .await;
    let end_rv = rv_of(&marker);
    let t_ref = Instant::now();
    let mut truth = Truth {
        horizon: end_rv - 1,
        base_rv,
        base,
        events: Vec::new(),
        absorbed: Vec::new(),
    };
    for (typ, o) in reference_history(&admin, base_rv, end_rv).await {
        truth.push(rv_of(&o), &typ, o);
    }
    let reference_took = t_ref.elapsed();
    cross_check(&truth, &w.journal);

    let mut report = Report::default();
    for l in &logs {
        report.merge(validate(&truth, &l.lock().unwrap(), Rules::default(), true));
    }

    let c = proxy.client(None, false);
    let m = c.get(&proxy.admin("/metrics"), None).await;
    let m =
        String::from_utf8_lossy(&m.into_body().collect().await.unwrap().to_bytes()).into_owned();
    let cache_watches = sum_metric(
        &m,
        "kube_cache_proxy_requests_total",
        &[
            "resource=\"configmaps\"",
            "verb=\"WATCH\"",
            "served_by=\"cache\"",
        ],
    );
    let passthrough_watches = sum_metric(
        &m,
        "kube_cache_proxy_requests_total",
        &[
            "resource=\"configmaps\"",
            "verb=\"WATCH\"",
            "served_by=\"upstream\"",
        ],
    ) + 0.0; // An empty float sum is -0.0.

    println!(
        "control plane + proxy synced in {synced_after:?}; {} writes ({} in {writes_took:?} while \
         watching); converged in {converge_took:?}; reference read in {reference_took:?}; \
         total {:?}",
        w.journal.len(),
        WRITES,
        t_start.elapsed()
    );
    println!(
        "truth: base {} objects at {base_rv}, {} events up to {end_rv}; proxy history from \
         {history_start}; watcher starts {kinds:?}",
        truth.base.len(),
        truth.events.len()
    );
    println!("{}", report.summary());
    println!(
        "proxy: configmaps WATCH served_by=cache {cache_watches}, served_by=upstream \
         {passthrough_watches}; apiserver configmaps WATCHes (all, cluster-wide) while watching: \
         {upstream_watches:?}"
    );
    for v in report.violations.iter().take(40) {
        println!("VIOLATION {v}");
    }
    assert!(
        report.violations.is_empty(),
        "{} watch violations (see output)",
        report.violations.len()
    );
    assert_eq!(report.watchers, WATCHERS);
    assert!(
        report.events_checked > 10 * WATCHERS,
        "too few events checked: {}",
        report.events_checked
    );
    assert!(
        report.initial_end_bookmarks > 0,
        "no initial-events-end bookmark"
    );
    assert!(
        report.bookmarks > report.initial_end_bookmarks,
        "no periodic bookmark"
    );
    assert!(report.clean_ends > 0, "no watch timed out and resumed");
    for (_, cluster) in &upstream_watches {
        assert_eq!(
            *cluster, 1,
            "the apiserver must see only the proxy's cluster-wide configmaps watch, one (its \
             protobuf written from the JSON objects; all, cluster-wide): {upstream_watches:?}"
        );
    }
    assert!(
        cache_watches >= WATCHERS as f64,
        "watches were not served from the cache"
    );
    assert_eq!(passthrough_watches, 0.0, "watches passed through");
    proxy.shutdown().await;
    cp.stop().await;
}
