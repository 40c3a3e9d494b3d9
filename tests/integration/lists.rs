//! Lists served from the cache, end to end through the proxy, against the in-process fake
//! apiserver: pages come from memory (the fake sees no list), continue tokens are bound to the
//! caller, namespace, selectors and resource, tampered tokens are 400, the apiserver's own
//! tokens pass through, and consistent reads are never answered stale when the upstream is cut.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{TestProxy, body_json, plain_client};
use serde_json::{Value, json};

/// Guard against hangs only; no assertion depends on time.
const GUARD: Duration = Duration::from_secs(30);

async fn get(proxy: &TestProxy, path: &str, token: &str) -> (u16, Value) {
    let c = plain_client(false);
    let r = c
        .request(
            http::Request::get(proxy.http(path))
                .header("authorization", format!("Bearer {token}"))
                .body(http_body_util::Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let code = r.status().as_u16();
    (code, body_json(r).await)
}

async fn setup(
    tweak: impl FnOnce(&mut kube_cache_proxy::config::Config),
) -> (FakeApiServer, TestProxy) {
    let fake = FakeApiServer::start().await;
    for ns in ["a", "b"] {
        fake.create("/api/v1/namespaces", json!({"metadata": {"name": ns}}))
            .await;
        for i in 0..7 {
            fake.create(
                &format!("/api/v1/namespaces/{ns}/configmaps"),
                json!({"metadata": {"name": format!("cm-{i}"), "labels": {"app": if i % 2 == 0 {"x"} else {"y"}}}}),
            )
            .await;
        }
    }
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into(), "pods".into()];
        tweak(c)
    })
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    eventually(
        "the configmaps and pods caches to sync",
        GUARD,
        async || {
            let synced = ["configmaps", "pods"].iter().all(|r| {
                state
                    .caches
                    .get("", "v1", r)
                    .is_some_and(|c| c.is_ready() && c.unhealthy().is_none())
            });
            ok_if(synced, "not synced")
        },
    )
    .await;
    (fake, proxy)
}

fn names(v: &Value) -> Vec<String> {
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

fn list_requests(fake: &FakeApiServer, path: &str) -> usize {
    fake.requests()
        .iter()
        .filter(|r| r.path == path && !r.query.as_deref().unwrap_or("").contains("watch"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paginated_lists_come_from_memory_with_tokens_bound_to_caller_and_query() {
    let (fake, proxy) = setup(|_| {}).await;
    fake.clear_requests();
    let base = "/api/v1/namespaces/a/configmaps";

    // A full walk with limit 3: 7 items, 3 pages, served without any list upstream.
    let mut all = Vec::new();
    let (code, first) = get(&proxy, &format!("{base}?limit=3"), "alice").await;
    assert_eq!(code, 200, "{first}");
    assert_eq!(first["metadata"]["remainingItemCount"], 4);
    let token = first["metadata"]["continue"].as_str().unwrap().to_string();
    assert!(token.starts_with("k1."), "{token}");
    all.extend(names(&first));
    let mut next = Some(token.clone());
    while let Some(t) = next.take() {
        let (code, page) = get(&proxy, &format!("{base}?limit=3&continue={t}"), "alice").await;
        assert_eq!(code, 200, "{page}");
        assert_eq!(
            page["metadata"]["resourceVersion"],
            first["metadata"]["resourceVersion"]
        );
        all.extend(names(&page));
        next = page["metadata"]["continue"].as_str().map(str::to_string);
    }
    assert_eq!(all, (0..7).map(|i| format!("cm-{i}")).collect::<Vec<_>>());
    assert_eq!(
        list_requests(&fake, base),
        0,
        "pages must come from the cache"
    );

    // The same token anywhere else is refused with 400 (and never reaches the apiserver).
    let reuse = [
        (format!("{base}?limit=3&continue={token}"), "bob"),
        (
            format!("/api/v1/namespaces/b/configmaps?limit=3&continue={token}"),
            "alice",
        ),
        (
            format!("{base}?limit=3&labelSelector=app%3Dx&continue={token}"),
            "alice",
        ),
        (
            format!("/api/v1/namespaces/a/pods?limit=3&continue={token}"),
            "alice",
        ),
        (
            format!("/api/v1/configmaps?limit=3&continue={token}"),
            "alice",
        ),
    ];
    for (path, who) in &reuse {
        let (code, v) = get(&proxy, path, who).await;
        assert_eq!(code, 400, "{path} as {who}: {v}");
        assert_eq!(v["kind"], "Status");
        assert_eq!(v["reason"], "BadRequest");
    }
    // Every single-character change of the signed part is refused too.
    let sig_start = token.rfind('.').unwrap() + 1;
    for i in (sig_start..token.len()).step_by(7) {
        let mut t = token.clone().into_bytes();
        t[i] = if t[i] == b'A' { b'B' } else { b'A' };
        let t = String::from_utf8(t).unwrap();
        let (code, _) = get(&proxy, &format!("{base}?limit=3&continue={t}"), "alice").await;
        assert_eq!(code, 400, "tampered at {i}");
    }
    // With a resourceVersion: the apiserver's error.
    let (code, v) = get(
        &proxy,
        &format!("{base}?limit=3&resourceVersion=5&continue={token}"),
        "alice",
    )
    .await;
    assert_eq!(code, 400);
    assert_eq!(
        v["message"],
        "specifying resource version is not allowed when using continue"
    );
    assert_eq!(list_requests(&fake, base), 0);

    // An apiserver-format token is not the proxy's: it goes to the apiserver.
    let apiserver_token = {
        let c = plain_client(false);
        let r = c
            .request(
                http::Request::get(format!("{}{base}?limit=3", fake.url()))
                    .body(http_body_util::Full::default())
                    .unwrap(),
            )
            .await
            .unwrap();
        body_json(r).await["metadata"]["continue"]
            .as_str()
            .unwrap()
            .to_string()
    };
    fake.clear_requests();
    let (code, page) = get(
        &proxy,
        &format!("{base}?limit=3&continue={apiserver_token}"),
        "alice",
    )
    .await;
    assert_eq!(code, 200, "{page}");
    assert_eq!(names(&page), ["cm-3", "cm-4", "cm-5"]);
    assert_eq!(list_requests(&fake, base), 1, "foreign tokens pass through");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_and_not_older_than_lists_and_writes_between_pages() {
    let (fake, proxy) = setup(|_| {}).await;
    let base = "/api/v1/namespaces/a/configmaps";
    let (_, first) = get(&proxy, &format!("{base}?limit=4"), "alice").await;
    let rv: u64 = first["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    // Writes after the first page: the walk still shows the state at `rv`.
    fake.create(base, json!({"metadata": {"name": "cm-00-new"}}))
        .await;
    fake.delete(&format!("{base}/cm-6")).await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    let cache = state.caches.get("", "v1", "configmaps").unwrap();
    eventually("the cache to catch up with the writes", GUARD, async || {
        let (cached, upstream) = (cache.rv(), fake.current_rv());
        ok_if(
            cached >= upstream,
            format!("cache at {cached}, upstream at {upstream}"),
        )
    })
    .await;
    let t = first["metadata"]["continue"].as_str().unwrap();
    let (code, second) = get(&proxy, &format!("{base}?limit=4&continue={t}"), "alice").await;
    assert_eq!(code, 200);
    assert_eq!(names(&second), ["cm-4", "cm-5", "cm-6"]);

    // Exact at the old rv: the old state, rebuilt from the history.
    fake.clear_requests();
    let (code, exact) = get(
        &proxy,
        &format!("{base}?resourceVersion={rv}&resourceVersionMatch=Exact"),
        "alice",
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(exact["metadata"]["resourceVersion"], rv.to_string());
    assert_eq!(names(&exact).len(), 7);
    assert!(!names(&exact).contains(&"cm-00-new".to_string()));
    // NotOlderThan the old rv: the current state.
    let (code, now) = get(
        &proxy,
        &format!("{base}?resourceVersion={rv}&resourceVersionMatch=NotOlderThan"),
        "alice",
    )
    .await;
    assert_eq!(code, 200);
    assert!(names(&now).contains(&"cm-00-new".to_string()));
    assert!(!names(&now).contains(&"cm-6".to_string()));
    assert_eq!(list_requests(&fake, base), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_reads_see_every_direct_write_and_nothing_stale_when_the_upstream_is_cut() {
    let (fake, proxy) = setup(|c| {
        c.lists.consistency = kube_cache_proxy::read::consistency::Mode::Strict;
        c.lists.consistency_timeout = Duration::from_secs(2);
    })
    .await;
    let base = "/api/v1/namespaces/b/configmaps";
    for i in 0..200 {
        let name = format!("w-{i}");
        fake.create(base, json!({"metadata": {"name": name}})).await;
        let (code, v) = get(&proxy, base, "alice").await;
        assert_eq!(code, 200);
        assert!(names(&v).contains(&name), "iteration {i}: {name} missing");
    }
    let state = proxy.running.as_ref().unwrap().state.clone();
    use std::sync::atomic::Ordering::Relaxed;
    assert!(state.consistency.stats.probes.load(Relaxed) > 0);

    // The upstream goes away: a consistent read must not come from the (now unconfirmable)
    // cache. It passes through and fails retryably.
    fake.faults().set_refuse(true);
    fake.faults().drop_watches();
    let (code, v) = get(&proxy, base, "alice").await;
    assert_ne!(
        code, 200,
        "a consistent read was answered while the upstream is cut: {v}"
    );
    assert_eq!(v["kind"], "Status");
    assert_eq!(code, 503);
    // resourceVersion=0 ("any") may still come from memory.
    let (code, v) = get(&proxy, &format!("{base}?resourceVersion=0"), "alice").await;
    assert_eq!(code, 200, "{v}");
}

/// A strict read that finds the cache behind only because another resource's write moved
/// the revision passes through at once: the proof that nothing of its own resource changed
/// (an upstream watch up to a bookmark, one to two seconds against kube-apiserver) runs on
/// its own, reads meanwhile pass through without a probe, and once the proof is in, strict
/// reads come from the cache again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strict_read_behind_a_foreign_write_passes_through_while_the_cache_catches_up() {
    use std::sync::atomic::Ordering::Relaxed;
    let (fake, proxy) = setup(|c| {
        c.lists.consistency = kube_cache_proxy::read::consistency::Mode::Strict;
        c.lists.consistency_timeout = Duration::from_secs(10);
    })
    .await;
    // No periodic bookmark moves the cache: only the catch-up's own watch can.
    fake.faults()
        .set_bookmark_interval(Duration::from_secs(3600));
    let state = proxy.running.as_ref().unwrap().state.clone();
    let st = &state.consistency.stats;
    let base = "/api/v1/namespaces/b/configmaps";
    let served_from_cache = async || {
        let before = st.fallbacks.load(Relaxed);
        let (code, v) = get(&proxy, base, "alice").await;
        assert_eq!(code, 200, "{v}");
        assert!(names(&v).contains(&"cm-6".to_string()), "{v}");
        st.fallbacks.load(Relaxed) == before
    };
    eventually("a strict read served from the cache", GUARD, async || {
        ok_if(served_from_cache().await, ())
    })
    .await;

    // A namespace (not cached) moves the revision past the configmaps cache; watch events
    // are held, so no bookmark can show the cache complete up to it yet.
    fake.faults().hold_watch_events();
    fake.create(
        "/api/v1/namespaces",
        json!({"metadata": {"name": "elsewhere"}}),
    )
    .await;
    let fallbacks = st.fallbacks.load(Relaxed);
    assert!(
        !served_from_cache().await,
        "the read waited for the catch-up rather than passing through"
    );
    assert_eq!(st.fallbacks.load(Relaxed), fallbacks + 1);
    assert!(st.probe_watches.load(Relaxed) > 0, "no catch-up started");
    // While the catch-up runs, a read passes through without a probe of its own (unless the
    // catch-up's watch ended meanwhile, a failure, after which a new probe is due).
    let (probes, failures) = (st.probes.load(Relaxed), st.probe_failures.load(Relaxed));
    assert!(!served_from_cache().await);
    assert!(
        st.probes.load(Relaxed) == probes || st.probe_failures.load(Relaxed) > failures,
        "a probe was sent while a catch-up was under way"
    );

    fake.faults().release_watch_events();
    eventually(
        "strict reads served from the cache after the catch-up",
        GUARD,
        async || ok_if(served_from_cache().await, ()),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_reads_see_the_writes_made_through_the_proxy() {
    let (_fake, proxy) = setup(|c| {
        c.lists.consistency = kube_cache_proxy::read::consistency::Mode::Bounded;
    })
    .await;
    let base = "/api/v1/namespaces/b/configmaps";
    let c = plain_client(false);
    for i in 0..200 {
        let name = format!("ryw-{i}");
        let r = c
            .request(
                http::Request::post(proxy.http(base))
                    .header("authorization", "Bearer alice")
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::from(
                        json!({"metadata": {"name": name}}).to_string(),
                    ))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
        let (code, v) = get(&proxy, base, "alice").await;
        assert_eq!(code, 200);
        assert!(names(&v).contains(&name), "iteration {i}: {name} missing");
    }
    let state = proxy.running.as_ref().unwrap().state.clone();
    let cache = state.caches.get("", "v1", "configmaps").unwrap();
    assert!(
        cache
            .list_stats
            .from_cache
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_opt_in_adaptive_cap_shortens_pages_whose_limit_is_above_it() {
    let (_fake, proxy) = setup(|c| {
        c.paging.cap_downstream = true;
        // A fixed cap of 3 (the controller's bounds pin it).
        c.paging.base_page_size = 3;
        c.paging.min_page_size = 3;
        c.paging.max_page_size = 3;
    })
    .await;
    let base = "/api/v1/namespaces/a/configmaps";
    let (code, first) = get(&proxy, &format!("{base}?limit=5"), "alice").await;
    assert_eq!(code, 200);
    assert_eq!(names(&first), ["cm-0", "cm-1", "cm-2"]);
    assert_eq!(first["metadata"]["remainingItemCount"], 4);
    let mut all = names(&first);
    let mut next = first["metadata"]["continue"].as_str().map(str::to_string);
    while let Some(t) = next.take() {
        let (code, page) = get(&proxy, &format!("{base}?limit=5&continue={t}"), "alice").await;
        assert_eq!(code, 200);
        assert!(names(&page).len() <= 3);
        all.extend(names(&page));
        next = page["metadata"]["continue"].as_str().map(str::to_string);
    }
    assert_eq!(all, (0..7).map(|i| format!("cm-{i}")).collect::<Vec<_>>());
    // Below the cap, and without limit, nothing changes.
    let (_, small) = get(&proxy, &format!("{base}?limit=2"), "alice").await;
    assert_eq!(names(&small).len(), 2);
    let (_, all) = get(&proxy, base, "alice").await;
    assert_eq!(names(&all).len(), 7);
}

/// `limit` is a promise by default: a page holds `min(limit, remaining)` items, as the
/// apiserver's (Kubernetes' chunking conformance test checks it), whatever the adaptive page
/// size is; only the opt-in `paging.capDownstream` shortens pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_page_holds_min_of_limit_and_remaining() {
    let (_fake, proxy) = setup(|c| {
        // The adaptive size pinned at 3, below every limit asked for here.
        c.paging.base_page_size = 3;
        c.paging.min_page_size = 3;
        c.paging.max_page_size = 3;
    })
    .await;
    let base = "/api/v1/namespaces/a/configmaps";
    // limit above the total: everything, no continue.
    let (code, all) = get(&proxy, &format!("{base}?limit=8"), "alice").await;
    assert_eq!(code, 200, "{all}");
    assert_eq!(names(&all).len(), 7);
    assert!(all["metadata"].get("continue").is_none(), "{all}");
    // limit between the adaptive size and the total: exactly limit, then the rest.
    let (_, first) = get(&proxy, &format!("{base}?limit=5"), "alice").await;
    assert_eq!(names(&first), ["cm-0", "cm-1", "cm-2", "cm-3", "cm-4"]);
    assert_eq!(first["metadata"]["remainingItemCount"], 2);
    let t = first["metadata"]["continue"]
        .as_str()
        .expect("a continue token");
    let (_, rest) = get(&proxy, &format!("{base}?limit=5&continue={t}"), "alice").await;
    assert_eq!(names(&rest), ["cm-5", "cm-6"]);
    assert!(rest["metadata"].get("continue").is_none(), "{rest}");
    // limit equal to the total: all of it, no continue.
    let (_, exact) = get(&proxy, &format!("{base}?limit=7"), "alice").await;
    assert_eq!(names(&exact).len(), 7);
    assert!(exact["metadata"].get("continue").is_none(), "{exact}");
}

/// Multi-megabyte lists over TLS, HTTP/1.1 and HTTP/2, to a reader that lets the socket fill
/// before it reads: every body arrives whole. (A flush the protocol asked for while the
/// socket was full once left the tail of a response in the TLS stream's buffer until
/// something else flushed it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_lists_over_tls_arrive_whole_to_slow_readers() {
    let (fake, proxy) = setup(|_| {}).await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "big"}}))
        .await;
    let payload = "x".repeat(100_000);
    for i in 0..40 {
        fake.create(
            "/api/v1/namespaces/big/configmaps",
            json!({"metadata": {"name": format!("big-{i:02}")}, "data": {"p": payload}}),
        )
        .await;
    }
    let state = proxy.running.as_ref().unwrap().state.clone();
    eventually("the cache to get the objects", GUARD, async || {
        let cached = state
            .caches
            .get("", "v1", "configmaps")
            .map_or(0, |c| c.len());
        ok_if(cached >= 14 + 40, cached)
    })
    .await;
    fake.clear_requests();
    let url = proxy.https("/api/v1/namespaces/big/configmaps?resourceVersion=0");
    for h2 in [false, true] {
        let c = proxy.client(None, h2);
        for round in 0..3 {
            let r = tokio::time::timeout(GUARD, c.get(&url, Some("alice")))
                .await
                .expect("response head");
            assert_eq!(r.status(), 200);
            // A slow reader: the socket stays full, so the proxy's last writes block too.
            let read = async {
                let mut body = r.into_body();
                let mut out = Vec::new();
                while let Some(f) = http_body_util::BodyExt::frame(&mut body).await {
                    if let Ok(d) = f.unwrap().into_data() {
                        out.extend_from_slice(&d);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                out
            };
            let body = tokio::time::timeout(GUARD, read)
                .await
                .unwrap_or_else(|_| panic!("h2={h2} round {round}: the body stalled"));
            let v: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(names(&v).len(), 40, "h2={h2} round {round}");
        }
    }
    assert_eq!(
        list_requests(&fake, "/api/v1/namespaces/big/configmaps"),
        0,
        "served from the cache"
    );
    proxy.shutdown().await;
}

/// What kube-apiserver's filter chain adds to every response it writes is on the responses
/// the proxy writes itself: `Audit-Id` (the caller's echoed, else a fresh UUID per request)
/// and `Cache-Control: no-cache, private`; and the proxy's own requests to the apiserver
/// name it in `User-Agent`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_served_responses_carry_the_apiservers_headers() {
    let (fake, proxy) = setup(|_| {}).await;
    let c = plain_client(false);
    let send = async |path: &str, audit: Option<&str>| {
        let mut b = http::Request::get(proxy.http(path)).header("authorization", "Bearer alice");
        if let Some(a) = audit {
            b = b.header("audit-id", a);
        }
        let r = c
            .request(b.body(http_body_util::Full::default()).unwrap())
            .await
            .unwrap();
        r.headers().clone()
    };
    let list = "/api/v1/namespaces/a/configmaps";
    let one = "/api/v1/namespaces/a/configmaps/cm-1";
    // A proxy token with one character changed: the proxy's 400, not the apiserver's.
    let (_, page) = get(&proxy, &format!("{list}?limit=1"), "alice").await;
    let mut token = page["metadata"]["continue"].as_str().unwrap().to_string();
    let last = if token.ends_with('A') { "B" } else { "A" };
    token.replace_range(token.len() - 1.., last);
    let bad_token = &format!("{list}?limit=1&continue={token}");
    let mut ids = std::collections::HashSet::new();
    for path in [list, one, bad_token.as_str(), list] {
        let h = send(path, None).await;
        assert_eq!(h["cache-control"], "no-cache, private", "{path}: {h:?}");
        let id = h.get("audit-id").unwrap_or_else(|| panic!("{path}: {h:?}"));
        let id = id.to_str().unwrap().to_string();
        assert!(uuid::Uuid::parse_str(&id).is_ok(), "{path}: {id}");
        assert!(ids.insert(id), "a fresh Audit-Id per request");
    }
    let h = send(list, Some("my-own-id")).await;
    assert_eq!(h["audit-id"], "my-own-id");
    // Nothing in this test reached the apiserver: the headers are the proxy's.
    assert_eq!(list_requests(&fake, list), 0);

    let own = fake
        .requests()
        .into_iter()
        .filter(|r| r.path == "/api/v1/configmaps")
        .collect::<Vec<_>>();
    assert!(!own.is_empty());
    for r in own {
        assert_eq!(
            r.headers["user-agent"],
            concat!("kube-cache-proxy/", env!("CARGO_PKG_VERSION")),
            "{:?}",
            r.query
        );
    }
}

/// The request is read as the apiserver reads it: the path percent-decoded before routing
/// and authorization (`%61` is namespace `a`), the first of repeated query parameters, and
/// a resourceVersion Go's `ParseUint` refuses (`+5`) left to the apiserver's 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_and_queries_are_read_as_the_apiserver_reads_them() {
    let (fake, proxy) = setup(|_| {}).await;
    let (code, plain) = get(&proxy, "/api/v1/namespaces/a/configmaps", "alice").await;
    assert_eq!(code, 200);
    let (code, encoded) = get(&proxy, "/api/v1/namespaces/%61/configmaps", "alice").await;
    assert_eq!(code, 200, "{encoded}");
    assert_eq!(names(&encoded), names(&plain));
    assert_eq!(names(&encoded).len(), 7);

    let (code, first) = get(
        &proxy,
        "/api/v1/namespaces/a/configmaps?limit=2&limit=5",
        "alice",
    )
    .await;
    assert_eq!(code, 200);
    assert_eq!(names(&first), ["cm-0", "cm-1"]);
    let (_, sel) = get(
        &proxy,
        "/api/v1/namespaces/a/configmaps?labelSelector=app%3Dx&labelSelector=app%3Dy",
        "alice",
    )
    .await;
    assert_eq!(names(&sel), ["cm-0", "cm-2", "cm-4", "cm-6"]);
    // All of it from memory.
    assert_eq!(list_requests(&fake, "/api/v1/namespaces/a/configmaps"), 0);

    for rv in ["%2B5", "-5", "0x5"] {
        fake.clear_requests();
        let path = format!("/api/v1/namespaces/a/configmaps?resourceVersion={rv}");
        let _ = get(&proxy, &path, "alice").await;
        assert_eq!(
            list_requests(&fake, "/api/v1/namespaces/a/configmaps"),
            1,
            "{rv}: the apiserver answers it"
        );
    }
}

/// Read-your-writes whatever the write's response is encoded in. The apiserver's watch lags
/// (its events are held back), so the cache is behind every write: a GET after the caller's
/// own write must not be answered from it. The write's resourceVersion is read from a
/// protobuf response (client-go's `Accept: application/vnd.kubernetes.protobuf, */*`) as from
/// JSON; a response the proxy cannot read (YAML here) makes the next reads confirm the cache
/// upstream first. Either way the read sees the write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_a_write_sees_it_whatever_the_responses_encoding() {
    let (fake, proxy) = setup(|c| {
        c.lists.consistency = kube_cache_proxy::read::consistency::Mode::Bounded;
        // Short: with the watch held, each read waits this long before the apiserver answers.
        c.lists.consistency_timeout = Duration::from_millis(200);
    })
    .await;
    let c = plain_client(false);
    let item = "/api/v1/namespaces/a/configmaps/cm-1";
    for (i, accept) in [
        "application/vnd.kubernetes.protobuf, */*",
        "application/json",
        "application/yaml",
    ]
    .into_iter()
    .enumerate()
    {
        fake.faults().hold_watch_events();
        let value = format!("v{i}");
        let r = c
            .request(
                http::Request::patch(proxy.http(item))
                    .header("authorization", "Bearer alice")
                    .header("accept", accept)
                    .header("content-type", "application/merge-patch+json")
                    .body(http_body_util::Full::from(
                        json!({"data": {"k": value}}).to_string(),
                    ))
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{accept}");
        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(accept.starts_with(&ct), "{accept}: answered in {ct}");
        let (code, got) = get(&proxy, item, "alice").await;
        assert_eq!(code, 200);
        assert_eq!(got["data"]["k"], value, "{accept}: a stale read: {got}");
        let (_, list) = get(&proxy, "/api/v1/namespaces/a/configmaps", "alice").await;
        let listed = list["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["metadata"]["name"] == "cm-1")
            .unwrap();
        assert_eq!(listed["data"]["k"], value, "{accept}: a stale list");
        fake.faults().release_watch_events();
        // Once the cache has the write, reads come from memory again.
        let state = proxy.running.as_ref().unwrap().state.clone();
        let cache = state.caches.get("", "v1", "configmaps").unwrap();
        let want = fake.current_rv();
        eventually("the cache to catch up", GUARD, async || {
            ok_if(cache.rv() >= want, cache.rv())
        })
        .await;
    }
}

/// A continue token expires when the apiserver would expire it: once etcd compacted its
/// resourceVersion, whatever the proxy still holds, with the apiserver's 410 and a token that
/// continues the walk at the latest state. Until then the walk goes on from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continue_token_expires_when_its_revision_is_compacted_upstream() {
    let (fake, proxy) = setup(|c| {
        // Every token is checked (the default spares those younger than 15 s).
        c.lists.compaction_check_after = Duration::ZERO;
    })
    .await;
    let base = "/api/v1/namespaces/a/configmaps";
    let first_page = async || {
        let (code, first) = get(&proxy, &format!("{base}?limit=2"), "alice").await;
        assert_eq!(code, 200);
        let token = first["metadata"]["continue"].as_str().unwrap().to_string();
        format!("{base}?limit=2&continue={token}")
    };
    let state = proxy.running.as_ref().unwrap().state.clone();
    let cache = state.caches.get("", "v1", "configmaps").unwrap();
    // A write anywhere, then the cache has it: walk B must start at a newer revision than
    // walk A (the probe's answer is shared per revision).
    let later = async |name: &str| {
        fake.create(
            "/api/v1/namespaces/b/configmaps",
            json!({"metadata": {"name": name}}),
        )
        .await;
        let want = fake.current_rv();
        eventually("the cache to have the write", GUARD, async || {
            ok_if(cache.rv() >= want, cache.rv())
        })
        .await;
    };
    // Walk A's first page; then a write anywhere.
    let page = first_page().await;
    later("later-1").await;
    // Walk B, at a newer revision, not compacted: its pages come from memory.
    let b = first_page().await;
    let (code, second) = get(&proxy, &b, "alice").await;
    assert_eq!(code, 200, "{second}");
    assert_eq!(names(&second), ["cm-2", "cm-3"]);

    // Another write, then etcd compacts up to it: walk A's revision is gone.
    later("later-2").await;
    fake.compact(fake.current_rv());
    let (code, gone) = get(&proxy, &page, "alice").await;
    assert_eq!(code, 410, "{gone}");
    assert_eq!(gone["reason"], "Expired");
    let cont = gone["metadata"]["continue"]
        .as_str()
        .expect("an inconsistent-continue token");
    let (code, rest) = get(&proxy, &format!("{base}?limit=10&continue={cont}"), "alice").await;
    assert_eq!(code, 200, "{rest}");
    assert_eq!(names(&rest), ["cm-2", "cm-3", "cm-4", "cm-5", "cm-6"]);
    // Served from memory, checked with one-item exact lists.
    assert_eq!(list_requests(&fake, base), 0);
    let probes = fake
        .requests()
        .iter()
        .filter(|r| r.path == "/api/v1/configmaps")
        .filter_map(|r| r.query.clone())
        .filter(|q| q.contains("resourceVersionMatch=Exact"))
        .collect::<Vec<_>>();
    assert_eq!(
        probes.len(),
        2,
        "walk B's revision, then walk A's: {probes:?}"
    );
    assert!(
        probes.iter().all(|q| q.starts_with("limit=1&")),
        "{probes:?}"
    );
}

/// A cluster-scoped resource under a namespaced path is the apiserver's 404, never the
/// cache's list of every namespace (anyone who may read `namespaces` in namespace `a`, as the
/// view, edit and admin roles allow, would otherwise read them all, labels included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_scoped_resource_under_a_namespace_path_goes_to_the_apiserver() {
    let (fake, proxy) = setup(|c| {
        c.cache.resources = vec!["configmaps".into(), "pods".into(), "namespaces".into()];
    })
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    // Synced and its watch confirmed: until then a read without resourceVersion passes
    // through (bounded consistency).
    eventually("the namespaces cache to sync", GUARD, async || {
        let ready = state
            .caches
            .get("", "v1", "namespaces")
            .is_some_and(|c| c.is_ready() && c.unhealthy().is_none());
        ok_if(ready, "not synced")
    })
    .await;
    // The Namespace object's own path is served from memory.
    fake.clear_requests();
    let (code, ns) = get(&proxy, "/api/v1/namespaces/a", "alice").await;
    assert_eq!((code, ns["metadata"]["name"].as_str()), (200, Some("a")));
    assert!(
        fake.requests()
            .iter()
            .all(|r| r.path != "/api/v1/namespaces/a")
    );
    for path in [
        "/api/v1/namespaces/a/namespaces",
        "/api/v1/namespaces/a/namespaces/b",
        "/api/v1/namespaces/a/namespaces/a",
        "/api/v1/namespaces/a/namespaces?watch=1&timeoutSeconds=1",
        "/api/v1/watch/namespaces/a/namespaces?timeoutSeconds=1",
    ] {
        fake.clear_requests();
        let _ = get(&proxy, path, "alice").await;
        let bare = path.split('?').next().unwrap();
        assert!(
            fake.requests().iter().any(|r| r.path == bare),
            "{path}: answered by the proxy, not the apiserver"
        );
    }
}

/// A resourceVersion the cache of one resource has not reached because other resources'
/// writes moved the revision (a pod written after the last ConfigMap): lists and watches of
/// ConfigMaps at it are still served from the cache, which a probe of the apiserver brings
/// there (kube-apiserver's watch cache asks etcd for progress in that case), instead of each
/// waiting for a bookmark and then passing through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_version_moved_by_other_resources_is_reached_by_a_probe_not_passed_through() {
    let (fake, proxy) = setup(|_| {}).await;
    let first = fake
        .create(
            "/api/v1/namespaces/a/pods",
            json!({"metadata": {"name": "p0"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}),
        )
        .await;
    let first: u64 = first["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let state = proxy.running.as_ref().unwrap().state.clone();
    let cms = state.caches.get("", "v1", "configmaps").unwrap();
    eventually("a periodic bookmark at p0's revision", GUARD, async || {
        ok_if(cms.rv() >= first, format!("at {}", cms.rv()))
    })
    .await;
    // No periodic bookmark from now on (the period applies at once, also to open watches):
    // nothing but a probe brings the ConfigMaps cache to the next pod's revision.
    fake.faults()
        .set_bookmark_interval(Duration::from_secs(3600));
    let pod = fake
        .create(
            "/api/v1/namespaces/a/pods",
            json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}),
        )
        .await;
    let rv: u64 = pod["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(cms.rv() < rv, "the ConfigMaps cache is at {}", cms.rv());
    fake.clear_requests();
    let base = "/api/v1/namespaces/a/configmaps";
    let passed_through = || {
        fake.requests()
            .iter()
            .filter(|r| r.path == base)
            .map(|r| r.query.clone().unwrap_or_default())
            .collect::<Vec<_>>()
    };

    let (code, v) = get(
        &proxy,
        &format!("{base}?resourceVersion={rv}&resourceVersionMatch=NotOlderThan"),
        "alice",
    )
    .await;
    assert_eq!(code, 200, "{v}");
    let list_rv: u64 = v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(list_rv >= rv, "listed at {list_rv}, asked for {rv}");
    assert_eq!(names(&v).len(), 7);

    // A watch from it, as an informer whose list came from elsewhere: from the cache, and
    // the next ConfigMap write arrives on it.
    let mut events = proxy
        .watch_plain(
            &format!("{base}?watch=1&resourceVersion={rv}"),
            "alice",
            true,
        )
        .await;
    fake.create(base, json!({"metadata": {"name": "after"}}))
        .await;
    let ev = tokio::time::timeout(GUARD, events.next())
        .await
        .expect("no event")
        .expect("stream ended");
    assert_eq!(ev["type"], "ADDED", "{ev}");
    assert_eq!(ev["object"]["metadata"]["name"], "after");

    // Neither went to the apiserver: only the probe's limit=1 list and its short watch from
    // the cache's own resourceVersion did (on the collection of every namespace).
    assert_eq!(passed_through(), Vec::<String>::new());
    use std::sync::atomic::Ordering::Relaxed;
    assert!(state.consistency.stats.reach_probes.load(Relaxed) >= 1);
    let watches = fake
        .requests()
        .iter()
        .filter(|r| {
            r.query.as_deref().unwrap_or("").contains("watch=") && r.path.ends_with("/configmaps")
        })
        .map(|r| r.query.clone().unwrap_or_default())
        .collect::<Vec<_>>();
    assert!(
        watches
            .iter()
            .all(|q| !q.contains(&format!("resourceVersion={rv}&"))),
        "{watches:?}"
    );
    proxy.shutdown().await;
}
