//! Differential checks against a real kube-apiserver: every request of
//! `tests/e2e/differential/corpus.yaml` is sent to a subject and to the apiserver directly, and
//! the answers must agree semantically unless `tests/e2e/differential/allowlist.yaml` accepts
//! the difference with a reason.
//!
//! 1. the proxy in front of the apiserver vs the apiserver (everything, exactly: the proxy must
//!    be indistinguishable);
//! 2. the in-process fake apiserver vs the apiserver (the corpus entries for the kinds the fake
//!    implements, by structure), so the fake the integration tests rely on cannot drift from
//!    the real one.
//!
//! Both run in one test against one control plane: starting kube-apiserver is the expensive part
//! (and two at once on a 2-core machine slow each other down).

use std::path::PathBuf;
use std::time::Instant;

use crate::support::differential::{
    AllowList, Backend, Corpus, Mode, Report, Symbols, compact_etcd, glob,
    mirror_bootstrap_objects, run, seed_namespaces, seed_objects,
};
use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::TestProxy;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};

/// Requests in flight at once. The corpus makes no writes, so order is irrelevant; this hides
/// the seconds that watches (timeoutSeconds) and future resourceVersions (3 s wait) take.
const CONCURRENCY: usize = 8;

/// A resourceVersion older than both backends' compaction point (both compact right after
/// creating the seed namespaces, well past revision 2) and, on the apiserver, older than its
/// watch cache (restarted after the compaction).
const COMPACTED_RV: u64 = 2;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/e2e/differential")
        .join(name)
}

#[test]
fn corpus_expands_to_at_least_200_distinct_requests() {
    let corpus = Corpus::load(&data("corpus.yaml"));
    assert!(
        corpus.requests.len() >= 200,
        "{} requests",
        corpus.requests.len()
    );
    let fake = corpus.requests.iter().filter(|r| r.fake).count();
    assert!(fake >= 200, "{fake} requests for the fake");
    assert!(corpus.requests.iter().any(|r| r.watch));
    AllowList::load(&data("allowlist.yaml"));
}

#[test]
fn allow_list_globs_match_anywhere() {
    assert!(glob(
        "list-*: GET /api/v1/*pods*",
        "list-rv: GET /api/v1/pods?limit=1"
    ));
    assert!(glob("*", ""));
    assert!(glob("exact", "exact"));
    assert!(!glob("a*c", "abcd"));
    assert!(!glob("*x*y", "yx"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_and_fake_answer_the_corpus_like_the_real_apiserver() {
    let corpus = Corpus::load(&data("corpus.yaml"));
    let allow = AllowList::load(&data("allowlist.yaml"));

    let started = Instant::now();
    // The apiserver serves old resourceVersions from its watch cache, whose history reaches back
    // to its own start: only a resourceVersion from before a restart (and below etcd's
    // compaction point) is really gone. So: namespaces, compaction, restart, then the data.
    let state = tempfile::tempdir().expect("state dir");
    let opts = ControlPlaneOptions {
        dir: Some(state.path().to_path_buf()),
        log_dir: None,
        ..ControlPlaneOptions::default()
    };
    let cp = ControlPlane::start(opts.clone())
        .await
        .expect("control plane starts");
    let real = apiserver_backend(&cp);
    seed_namespaces(&real, true).await;
    compact_etcd(&cp.etcd_url, real.current_rv().await).await;
    cp.stop().await;
    let cp = ControlPlane::start(opts)
        .await
        .expect("control plane restarts");
    // 1. The proxy, in front of the same apiserver, with the admin's token forwarded.
    let proxy = TestProxy::start_for(&cp, None, |_| {}).await;
    // The proxy syncs before the data is written, so its history holds every seeded event and
    // watches from the seed resourceVersion are answered from it, exactly.
    let state = proxy.running.as_ref().expect("running").state.clone();
    let limit = std::time::Duration::from_secs(60);
    eventually("every cache to sync", limit, async || {
        let unsynced: Vec<&str> = ["configmaps", "pods", "namespaces"]
            .into_iter()
            .filter(|r| state.caches.get("", "v1", r).is_none_or(|c| !c.is_ready()))
            .collect();
        ok_if(unsynced.is_empty(), unsynced)
    })
    .await;
    let mut real = apiserver_backend(&cp);
    let seed = seed_objects(&real).await;
    // Tables are served from each resource's table side, which its first Table reader starts
    // (and waits for, up to 3 s): start them now, as a running proxy has them, so the
    // corpus's Tables are answered when they are asked like its other reads.
    let table_client = proxy.client(None, true);
    for r in ["configmaps", "pods"] {
        let cache = state.caches.get("", "v1", r).expect("cached");
        let path = format!("/api/v1/namespaces/d1/{r}");
        eventually(&format!("{r}: the table side to sync"), limit, async || {
            let req = http::Request::get(proxy.https(&path))
                .header("authorization", format!("Bearer {}", cp.admin_token()))
                .header("accept", "application/json;as=Table;v=v1;g=meta.k8s.io")
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap();
            let _ = table_client.send(req).await;
            ok_if(cache.table.ready(), "not yet")
        })
        .await;
    }
    real.symbols = Symbols {
        seed,
        current: real.current_rv().await,
        compacted: COMPACTED_RV,
    };
    eprintln!(
        "control plane seeded in {:.1?}: {:?}",
        started.elapsed(),
        real.symbols
    );

    let mut via_proxy = Backend::new(
        "proxy",
        &proxy.https(""),
        Some(&proxy.ca_pem),
        Some(cp.admin_token()),
    );
    via_proxy.symbols = real.symbols.clone();
    let proxy_report = run(
        "proxy vs apiserver",
        &corpus.requests,
        &via_proxy,
        &real,
        Mode::Exact,
        &allow.proxy,
        CONCURRENCY,
    )
    .await;
    eprintln!("{}", proxy_report.summary());

    // 2. The fake, seeded the same way (plus a copy of what the apiserver bootstrapped).
    let fake = FakeApiServer::start().await;
    let mut fake_backend = Backend::new("fake", &fake.url(), None, None);
    mirror_bootstrap_objects(&real, &fake_backend).await;
    seed_namespaces(&fake_backend, false).await;
    fake.compact(fake_backend.current_rv().await);
    let seed = seed_objects(&fake_backend).await;
    fake_backend.symbols = Symbols {
        seed,
        current: fake_backend.current_rv().await,
        compacted: COMPACTED_RV,
    };
    real.symbols.current = real.current_rv().await;
    let fake_requests: Vec<_> = corpus.requests.iter().filter(|r| r.fake).cloned().collect();
    let fake_report = run(
        "fake vs apiserver",
        &fake_requests,
        &fake_backend,
        &real,
        Mode::Structural,
        &allow.fake,
        CONCURRENCY,
    )
    .await;
    eprintln!("{}", fake_report.summary());

    proxy.shutdown().await;
    fake.shutdown().await;
    cp.stop().await;
    eprintln!("differential test done in {:.1?}", started.elapsed());
    fail_on_diffs(&[(&proxy_report, "proxy"), (&fake_report, "fake")]);
}

fn apiserver_backend(cp: &ControlPlane) -> Backend {
    Backend::new(
        "apiserver",
        &cp.url,
        Some(&cp.ca_pem),
        Some(cp.admin_token()),
    )
}

fn fail_on_diffs(reports: &[(&Report, &str)]) {
    let mut tables = String::new();
    for (r, subject) in reports {
        if !r.diffs.is_empty() {
            tables.push_str(&r.table(subject, "apiserver"));
            tables.push('\n');
        }
    }
    assert!(
        tables.is_empty(),
        "answers differ from the real apiserver (accept a difference only with a reason in \
         tests/e2e/differential/allowlist.yaml):\n{tables}"
    );
}
