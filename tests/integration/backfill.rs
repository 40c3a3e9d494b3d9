//! Backfill (`cache.backfill`): a watch from a resourceVersion older than the cache's
//! history — here a client resuming after a proxy restart without saved state, whose new
//! cache listed after the client's last event — is served from the apiserver's stretch
//! (an Exact list at that resourceVersion and a watch from it) joined to the history:
//! exactly the writes the client missed, then what follows, without 410 or relist. One
//! backfill serves every later client in the stretch; a compacted resourceVersion gets 410.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::{FakeApiServer, LoggedRequest};
use crate::support::proxy::{EventReader, TestProxy, body_json};
use crate::warm_restart::{events, writes_after};
use serde_json::{Value, json};

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(30);
const NS: &str = "backfill";

fn cm(name: &str, n: u64) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap",
           "metadata": {"name": name, "namespace": NS, "labels": {"parity": (n % 2).to_string()}},
           "data": {"n": n.to_string()}})
}

/// Creates, updates (label flips between parity 0 and 1) and deletes over 7 names.
async fn write_some(fake: &FakeApiServer, from: u64, n: u64) {
    for i in from..from + n {
        let name = format!("cm-{}", i % 7);
        let item = format!("/api/v1/namespaces/{NS}/configmaps/{name}");
        if fake.get(&item).is_none() {
            fake.create(&format!("/api/v1/namespaces/{NS}/configmaps"), cm(&name, i))
                .await;
        } else if i % 5 == 0 {
            fake.delete(&item).await;
        } else {
            fake.update(&item, cm(&name, i)).await;
        }
    }
}

async fn start(fake: &FakeApiServer, backfill: bool) -> TestProxy {
    start_with(fake, |c| c.cache.backfill = backfill).await
}

/// The proxy caching configmaps, `tweak`ed, once its cache is ready.
async fn start_with(
    fake: &FakeApiServer,
    tweak: impl FnOnce(&mut kube_cache_proxy::config::Config),
) -> TestProxy {
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        tweak(c);
    })
    .await;
    eventually("the configmaps cache to be ready", GUARD, async || {
        let ready = proxy
            .cache("", "v1", "configmaps")
            .is_some_and(|c| c.is_ready());
        ok_if(ready, "not ready")
    })
    .await;
    proxy
}

/// The same writes as a `parity=1` label-selector watch shows them: an object entering the
/// selection is ADDED, one leaving it DELETED (with its new state), as the apiserver does.
fn selected_writes_after(fake: &FakeApiServer, rv: u64) -> Vec<(String, String, u64)> {
    let mut selected = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for w in fake.writes("configmaps") {
        let name = w.object["metadata"]["name"].as_str().unwrap().to_string();
        let now = w.typ != "DELETED" && w.object["metadata"]["labels"]["parity"] == "1";
        let was = selected.contains(&name);
        let typ = match (was, now) {
            (false, true) => Some("ADDED"),
            (true, true) => Some("MODIFIED"),
            (true, false) => Some("DELETED"),
            (false, false) => None,
        };
        if now {
            selected.insert(name.clone());
        } else {
            selected.remove(&name);
        }
        if let Some(t) = typ
            && w.rv > rv
        {
            out.push((t.to_string(), name, w.rv));
        }
    }
    out
}

/// The next event of a watch (here: the ERROR a refused resume gets).
async fn first_event(r: &mut EventReader) -> Value {
    tokio::time::timeout(GUARD, r.next())
        .await
        .expect("an answer within the guard")
        .expect("an event")
}

/// Resumes the watch `url` (from `from`) and reads exactly the writes after `from`; returns
/// the stream (for what follows) and those writes.
async fn resume_gets_what_it_missed(
    client: &crate::support::proxy::TestClient,
    url: &str,
    fake: &FakeApiServer,
    from: u64,
) -> (EventReader, Vec<(String, String, u64)>) {
    let resp = client.get(url, Some("tok")).await;
    assert_eq!(resp.status(), 200);
    let mut r = EventReader::new(resp);
    let missed = writes_after(fake, from);
    assert_eq!(events(&mut r, missed.len()).await, missed);
    (r, missed)
}

/// Exact lists of configmaps the proxy sent upstream (its backfills' bases).
fn exact_lists(reqs: &[LoggedRequest]) -> usize {
    reqs.iter()
        .filter(|r| r.path.ends_with("/configmaps"))
        .filter(|r| {
            r.query
                .as_deref()
                .is_some_and(|q| q.contains("resourceVersionMatch=Exact"))
        })
        .count()
}

/// `kube_cache_proxy_backfills_total{outcome}` is `n`.
async fn assert_backfills(proxy: &TestProxy, outcome: &str, n: u64) {
    let line = format!("kube_cache_proxy_backfills_total{{outcome=\"{outcome}\"}}");
    assert!(
        metric(proxy, &line).await.ends_with(&format!(" {n}")),
        "{}",
        proxy.admin_get("/metrics").await.1
    );
}

async fn metric(proxy: &TestProxy, prefix: &str) -> String {
    let metrics = proxy.admin_get("/metrics").await.1;
    metrics
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_resuming_from_before_a_cold_restarted_proxys_list_gets_exactly_what_it_missed() {
    for writes_after_restart in [true, false] {
        let fake = FakeApiServer::start().await;
        fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
            .await;
        write_some(&fake, 0, 20).await;
        let mut proxy = start(&fake, true).await;
        let client = proxy.client(None, true);
        let base = proxy.https(&format!("/api/v1/namespaces/{NS}/configmaps"));
        let from = proxy.cache("", "v1", "configmaps").unwrap().rv();
        let mut r = EventReader::new(
            client
                .get(
                    &format!("{base}?watch=1&resourceVersion={from}"),
                    Some("tok"),
                )
                .await,
        );
        write_some(&fake, 20, 6).await;
        let seen = events(&mut r, 6).await;
        let last = seen.last().unwrap().2;
        drop(r);

        // Restarted without saved state: the new cache lists after the client's last event.
        proxy.running.take().unwrap().shutdown().await;
        write_some(&fake, 26, 9).await;
        proxy.restart(|_| {}).await;
        eventually("the cache to be ready", GUARD, async || {
            let c = proxy.cache("", "v1", "configmaps");
            ok_if(c.is_some_and(|c| c.is_ready()), "not ready")
        })
        .await;
        if writes_after_restart {
            write_some(&fake, 35, 3).await;
            let want = fake.writes("configmaps").last().unwrap().rv;
            let cache = proxy.cache("", "v1", "configmaps").unwrap();
            assert!(cache.wait_for_rv(want, GUARD).await);
        }
        let cache = proxy.cache("", "v1", "configmaps").unwrap();
        assert!(
            cache.oldest_rv() > last,
            "the new history starts after the client"
        );
        fake.clear_requests();

        // The client resumes from its last resourceVersion: exactly what it missed.
        let client = proxy.client(None, true);
        let resume = format!("{base}?watch=1&allowWatchBookmarks=true&resourceVersion={last}");
        let (mut r, missed) = resume_gets_what_it_missed(&client, &resume, &fake, last).await;
        assert_eq!(
            cache.oldest_rv(),
            last,
            "the history reaches back to the client"
        );
        // And what follows.
        let before = fake.writes("configmaps").last().unwrap().rv;
        write_some(&fake, 40, 4).await;
        assert_eq!(events(&mut r, 4).await, writes_after(&fake, before));

        // A selector watch resuming inside the stretch: served from the extended history,
        // transitions included, no second backfill.
        let mid = missed[missed.len() / 3].2;
        let sel = format!("{base}?watch=1&labelSelector=parity%3D1&resourceVersion={mid}");
        let mut s = EventReader::new(client.get(&sel, Some("tok")).await);
        let want = selected_writes_after(&fake, mid);
        assert!(want.iter().any(|e| e.0 == "DELETED"), "{want:?}");
        assert_eq!(events(&mut s, want.len()).await, want);
        assert_eq!(exact_lists(&fake.requests()), 1, "one backfill for both");
        assert_backfills(&proxy, "filled", 1).await;
        proxy.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compacted_resource_version_still_gets_410_and_backfill_can_be_turned_off() {
    for (backfill, compact) in [(true, true), (false, false)] {
        let fake = FakeApiServer::start().await;
        fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
            .await;
        write_some(&fake, 0, 10).await;
        let old = fake.writes("configmaps").last().unwrap().rv;
        write_some(&fake, 10, 10).await;
        if compact {
            let now = fake.writes("configmaps").last().unwrap().rv;
            fake.compact(now);
        }
        let proxy = start(&fake, backfill).await;
        let client = proxy.client(None, true);
        let base = proxy.https(&format!("/api/v1/namespaces/{NS}/configmaps"));
        fake.clear_requests();
        let resp = client
            .get(
                &format!("{base}?watch=1&resourceVersion={old}"),
                Some("tok"),
            )
            .await;
        assert_eq!(resp.status(), 200);
        let mut r = EventReader::new(resp);
        let ev = first_event(&mut r).await;
        assert_eq!(ev["type"], "ERROR", "{ev}");
        assert_eq!(ev["object"]["code"], 410, "{ev}");
        assert_eq!(ev["object"]["reason"], "Expired", "{ev}");
        let tried = exact_lists(&fake.requests());
        assert_eq!(tried, usize::from(backfill), "backfill={backfill}");
        proxy.shutdown().await;
    }
}

/// A backfill the apiserver cannot serve at the moment (just restarted, its watch cache of
/// the resource still initializing: watches answer 429) is no reason to relist: the client
/// gets 429 with `Retry-After` (client-go then watches again from the same
/// resourceVersion), not the 410 that makes it relist, and its next try is backfilled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_the_apiserver_cannot_serve_yet_tells_the_client_to_retry_not_to_relist() {
    let Behind {
        fake,
        proxy,
        client,
        url,
        old,
    } = behind_the_history().await;
    let cache = proxy.cache("", "v1", "configmaps").unwrap();

    fake.faults().initializing_watch_cache(true);
    assert_retry_later(client.get(&url, Some("tok")).await).await;
    assert!(cache.oldest_rv() > old, "nothing was joined to the history");
    assert_backfills(&proxy, "unavailable", 1).await;

    // The apiserver's watch cache is ready: the same resume is served, exactly what the
    // client missed, without an ERROR.
    fake.faults().initializing_watch_cache(false);
    resume_gets_what_it_missed(&client, &url, &fake, old).await;
    assert_eq!(
        cache.oldest_rv(),
        old,
        "the history reaches back to the client"
    );
    proxy.shutdown().await;
}

/// A spell of 429s longer than the resource's backfill budget (a large cluster's apiserver
/// can take minutes to initialize its watch caches after a restart): once the budget is
/// spent on tries the apiserver could not serve, clients are still told to retry (at no
/// upstream cost), not to relist, and the first try once the budget refills serves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spell_of_429s_longer_than_the_backfill_budget_still_spares_the_client_a_relist() {
    let Behind {
        fake,
        proxy,
        client,
        url,
        old,
    } = behind_the_history().await;

    fake.faults().initializing_watch_cache(true);
    fake.clear_requests();
    // The budget's 4 tries, each answered 429 by the apiserver, then one past the budget.
    for _ in 0..5 {
        assert_retry_later(client.get(&url, Some("tok")).await).await;
    }
    assert_eq!(
        exact_lists(&fake.requests()),
        4,
        "the retry past the budget cost the apiserver nothing"
    );
    assert_backfills(&proxy, "unavailable", 5).await;

    // The apiserver can serve it now: the client retries as client-go does (after
    // Retry-After) until the budget's next try, which serves it.
    fake.faults().initializing_watch_cache(false);
    let tries = tokio::time::timeout(Duration::from_secs(60), async {
        let mut tries = 1;
        loop {
            let resp = client.get(&url, Some("tok")).await;
            if resp.status() != 429 {
                assert_eq!(resp.status(), 200, "served, not refused");
                return tries;
            }
            tries += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await
    .expect("served within a budget refill and a margin");
    assert!(
        tries > 1,
        "the budget was still spent when the apiserver recovered"
    );
    resume_gets_what_it_missed(&client, &url, &fake, old).await;
    assert_backfills(&proxy, "filled", 1).await;
    proxy.shutdown().await;
}

/// A client whose resourceVersion is older than a freshly started proxy's history (10
/// writes after it), and its watch's URL.
struct Behind {
    fake: FakeApiServer,
    proxy: TestProxy,
    client: crate::support::proxy::TestClient,
    url: String,
    old: u64,
}

async fn behind_the_history() -> Behind {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
        .await;
    write_some(&fake, 0, 10).await;
    let old = fake.writes("configmaps").last().unwrap().rv;
    write_some(&fake, 10, 10).await;
    let proxy = start(&fake, true).await;
    let cache = proxy.cache("", "v1", "configmaps").unwrap();
    assert!(
        cache.oldest_rv() > old,
        "the history starts after the client"
    );
    let client = proxy.client(None, true);
    let url = proxy.https(&format!(
        "/api/v1/namespaces/{NS}/configmaps?watch=1&allowWatchBookmarks=true&resourceVersion={old}"
    ));
    Behind {
        fake,
        proxy,
        client,
        url,
        old,
    }
}

/// The proxy's "retry later" answer to a watch: 429, `Retry-After: 1`, a TooManyRequests
/// Status saying the same.
async fn assert_retry_later(resp: hyper::Response<hyper::body::Incoming>) {
    assert_eq!(resp.status(), 429);
    assert_eq!(
        resp.headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let status = body_json(resp).await;
    assert_eq!(status["kind"], "Status", "{status}");
    assert_eq!(status["reason"], "TooManyRequests", "{status}");
    assert_eq!(status["details"]["retryAfterSeconds"], 1, "{status}");
}

/// A client choosing ever older resourceVersions gets a few backfills of a resource (each
/// an upstream list of the whole resource), then is told to retry (429, at no upstream
/// cost) rather than given a 410 that would make it relist; clients retrying gather, and
/// the first try once the budget refills serves them all (it starts from the oldest).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backfills_of_one_resource_are_rate_limited_and_the_clients_past_the_budget_retry() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
        .await;
    write_some(&fake, 0, 12).await;
    let proxy = start(&fake, true).await;
    let client = proxy.client(None, true);
    let base = proxy.https(&format!("/api/v1/namespaces/{NS}/configmaps"));
    let newest = fake.writes("configmaps").last().unwrap().rv;
    let url = |back: u64| {
        format!(
            "{base}?watch=1&resourceVersion={}&timeoutSeconds=1",
            newest - back
        )
    };
    fake.clear_requests();
    let mut answers = Vec::new();
    for back in 1..=6 {
        let resp = client.get(&url(back), Some("tok")).await;
        if resp.status() == 429 {
            assert_retry_later(resp).await;
            answers.push("retry");
            continue;
        }
        let mut r = EventReader::new(resp);
        let first = tokio::time::timeout(GUARD, r.next())
            .await
            .expect("an answer within the guard");
        let expired = first.is_some_and(|e| e["type"] == "ERROR" && e["object"]["code"] == 410);
        answers.push(if expired { "410" } else { "served" });
    }
    assert_eq!(
        answers,
        ["served", "served", "served", "served", "retry", "retry"],
        "4 backfills, then retry"
    );
    assert_eq!(
        exact_lists(&fake.requests()),
        4,
        "the retries cost nothing upstream"
    );
    assert_backfills(&proxy, "unavailable", 2).await;

    // The newer of the two retries as client-go does (after Retry-After) until the budget's
    // next try: it starts from the older one's resourceVersion, so both are served by it.
    let tries = tokio::time::timeout(Duration::from_secs(60), async {
        let mut tries = 1;
        loop {
            let resp = client.get(&url(5), Some("tok")).await;
            if resp.status() != 429 {
                assert_eq!(resp.status(), 200, "served, not refused");
                let mut r = EventReader::new(resp);
                let first = r.next().await.expect("an event");
                assert_ne!(first["type"], "ERROR", "{first}");
                return tries;
            }
            tries += 1;
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    })
    .await
    .expect("served within a budget refill and a margin");
    assert!(tries > 1, "the budget was still spent");
    let mut r = EventReader::new(client.get(&url(6), Some("tok")).await);
    let first = tokio::time::timeout(GUARD, r.next())
        .await
        .expect("an answer within the guard")
        .expect("an event");
    assert_ne!(
        first["type"], "ERROR",
        "the older one, served by the same try: {first}"
    );
    assert_eq!(
        exact_lists(&fake.requests()),
        5,
        "one list served both waiting clients"
    );
    proxy.shutdown().await;
}

/// The configmaps (name → (uid, resourceVersion)) at `rv`, from the fake's write log.
fn state_at(fake: &FakeApiServer, rv: u64) -> std::collections::BTreeMap<String, (String, u64)> {
    let mut state = std::collections::BTreeMap::new();
    for w in fake.writes("configmaps").into_iter().filter(|w| w.rv <= rv) {
        let name = w.object["metadata"]["name"].as_str().unwrap().to_string();
        if w.typ == "DELETED" {
            state.remove(&name);
        } else {
            let uid = w.object["metadata"]["uid"].as_str().unwrap().to_string();
            state.insert(name, (uid, w.rv));
        }
    }
    state
}

/// A client resuming from a resourceVersion older than the apiserver's watch window, which
/// etcd still holds (an Exact list there works, a watch from there gets 410, as from
/// kube-apiserver past its watch cache): with `cache.absorbRelists` (the default) the proxy
/// extends its history with the difference from that state to its history's start, so the
/// client gets ADDED/MODIFIED/DELETED events, in increasing resourceVersions, that take its
/// state exactly to the apiserver's, then every later write, without 410 or relist; a
/// resume strictly inside that stretch gets 410 (its place among a difference's events is
/// unknown). With `absorbRelists: false` the client gets 410, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_older_than_the_apiservers_watch_window_gets_the_difference() {
    for absorb in [true, false] {
        let fake = FakeApiServer::start().await;
        fake.create("/api/v1/namespaces", json!({"metadata": {"name": NS}}))
            .await;
        write_some(&fake, 0, 20).await;
        let at = fake.writes("configmaps").last().unwrap().rv;
        write_some(&fake, 20, 16).await;
        fake.set_watch_window_start(fake.writes("configmaps").last().unwrap().rv);
        let proxy = start_with(&fake, |c| c.cache.absorb_relists = absorb).await;
        let cache = proxy.cache("", "v1", "configmaps").unwrap();
        let oldest = cache.oldest_rv();
        assert!(oldest > at + 1, "the history starts after the client");
        fake.clear_requests();
        let client = proxy.client(None, true);
        let base = proxy.https(&format!("/api/v1/namespaces/{NS}/configmaps"));
        let resp = client
            .get(
                &format!("{base}?watch=1&allowWatchBookmarks=true&resourceVersion={at}"),
                Some("tok"),
            )
            .await;
        assert_eq!(resp.status(), 200);
        let mut r = EventReader::new(resp);
        assert_eq!(exact_lists(&fake.requests()), 1, "one Exact list at {at}");
        if !absorb {
            let ev = first_event(&mut r).await;
            assert_eq!(ev["type"], "ERROR", "{ev}");
            assert_eq!(ev["object"]["code"], 410, "{ev}");
            proxy.shutdown().await;
            continue;
        }
        // The difference the client's own relist would compute, to the history's start;
        // then the history's real events.
        let (then, now) = (state_at(&fake, at), state_at(&fake, oldest));
        // A name deleted and created again (another uid) is a deletion and an addition.
        let mut want: Vec<(String, String)> = Vec::new();
        for (name, (uid, rv)) in &now {
            match then.get(name) {
                Some((u, r)) if u == uid => {
                    if r != rv {
                        want.push(("MODIFIED".into(), name.clone()));
                    }
                }
                Some(_) => {
                    want.push(("DELETED".into(), name.clone()));
                    want.push(("ADDED".into(), name.clone()));
                }
                None => want.push(("ADDED".into(), name.clone())),
            }
        }
        for name in then.keys().filter(|n| !now.contains_key(*n)) {
            want.push(("DELETED".into(), name.clone()));
        }
        assert!(
            want.iter().any(|(t, _)| t == "DELETED") && want.iter().any(|(t, _)| t != "DELETED"),
            "the workload deletes and changes: {want:?}"
        );
        let got = events(&mut r, want.len()).await;
        let now: std::collections::BTreeMap<String, u64> =
            now.into_iter().map(|(n, (_, rv))| (n, rv)).collect();
        let mut state: std::collections::BTreeMap<String, u64> =
            then.into_iter().map(|(n, (_, rv))| (n, rv)).collect();
        let mut last = at;
        for (t, name, rv) in &got {
            assert!(*rv > last, "increasing resourceVersions: {got:?}");
            last = *rv;
            if t == "DELETED" {
                assert!(state.remove(name).is_some(), "{got:?}");
            } else {
                assert_eq!(
                    t == "ADDED",
                    state.insert(name.clone(), *rv).is_none(),
                    "{got:?}"
                );
            }
        }
        assert!(last <= oldest, "{got:?}");
        assert_eq!(state, now, "the client's state is the apiserver's: {got:?}");
        let mut kinds: Vec<_> = got.iter().map(|(t, n, _)| (t.clone(), n.clone())).collect();
        kinds.sort();
        want.sort();
        assert_eq!(kinds, want);
        let real = writes_after(&fake, oldest);
        assert_eq!(events(&mut r, real.len()).await, real);
        // Then every later write, as it happens.
        let before = fake.writes("configmaps").last().unwrap().rv;
        write_some(&fake, 40, 4).await;
        assert_eq!(events(&mut r, 4).await, writes_after(&fake, before));
        assert_backfills(&proxy, "difference", 1).await;
        // Inside the stretch: 410, no further upstream list.
        let resp = client
            .get(
                &format!("{base}?watch=1&resourceVersion={}", at + 1),
                Some("tok"),
            )
            .await;
        let ev = first_event(&mut EventReader::new(resp)).await;
        assert_eq!(ev["object"]["code"], 410, "{ev}");
        assert_eq!(exact_lists(&fake.requests()), 1);
        proxy.shutdown().await;
    }
}
