//! Two replicas behind one address, and a proxy whose upstream is another proxy, in front of
//! a real kube-apiserver with real client-go informers.
//!
//! The replicas share what the deploy manifests share: the serving certificate (the
//! balancer, `support::balancer`, passes TLS through as a Service does) and the
//! continue-token key file; each has its own `cache.stateDir` (an `emptyDir` per pod).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use crate::clients::{BOUND, Env, assert_started_once, env_with, kube_config, spawn_informers};
use crate::support::balancer::Balancer;
use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::{TestProxy, body_json};
use kube_cache_proxy::app::dev::ControlPlane;

/// A continue-token key file (`tokens.keyFile`) with one random key.
fn key_file(dir: &Path) -> PathBuf {
    use base64::Engine as _;
    let mut secret = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret).unwrap();
    let path = dir.join("keys");
    let line = base64::engine::general_purpose::STANDARD.encode(secret);
    std::fs::write(&path, format!("k1 {line}\n")).unwrap();
    path
}

/// Replica A (the env's proxy) and replica B: the same serving certificate and token keys,
/// each its own state directory.
async fn two_replicas(ns: &str, dir: &Path) -> (Env, TestProxy) {
    let keys = key_file(dir);
    let (ka, sa, sb) = (keys.clone(), dir.join("state-a"), dir.join("state-b"));
    let env = env_with(ns, |c| {
        c.tokens.key_file = Some(ka);
        c.cache.state_dir = Some(sa);
    })
    .await;
    let (cert, key) = (env.proxy.cert_path(), env.proxy.key_path());
    let upstream = kube_config(&env.cp.admin_kubeconfig_yaml()).await;
    let b = TestProxy::start_with_kube(upstream, |c| {
        c.tls.cert_file = Some(cert);
        c.tls.key_file = Some(key);
        c.tokens.key_file = Some(keys);
        c.cache.state_dir = Some(sb);
    })
    .await;
    (env, b)
}

/// [`two_replicas`], both ready, behind a loopback balancer, and a kubeconfig (in `dir`)
/// for the admin through it.
async fn two_replicas_behind_a_balancer(
    ns: &str,
    dir: &Path,
) -> (Env, TestProxy, Balancer, PathBuf) {
    let (env, b) = two_replicas(ns, dir).await;
    wait_ready(&env.proxy).await;
    wait_ready(&b).await;
    let lb = Balancer::start(vec![env.proxy.tls_addr, b.tls_addr]).await;
    let kubeconfig = dir.join("lb.kubeconfig");
    std::fs::write(
        &kubeconfig,
        ControlPlane::kubeconfig_yaml(
            &format!("https://localhost:{}", lb.addr.port()),
            Some(&env.proxy.ca_pem),
            Some(env.cp.admin_token()),
            None,
        ),
    )
    .unwrap();
    (env, b, lb, kubeconfig)
}

/// Synced, and its upstream watch confirmed: until then a list without resourceVersion
/// passes through (bounded consistency) and its continue token is the apiserver's.
async fn wait_ready(p: &TestProxy) {
    eventually("the replica's configmaps cache", BOUND, async || {
        ok_if(
            p.cache("", "v1", "configmaps")
                .is_some_and(|c| c.is_ready() && c.unhealthy().is_none()),
            "not ready",
        )
    })
    .await;
}

/// A list started on one replica continues on the other: the continue token is signed with
/// the shared key and names a snapshot the other replica rebuilds from its own history (the
/// same upstream resourceVersions), so the pages join into exactly the apiserver's list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_started_on_one_replica_continues_on_the_other() {
    let ns = "e2e-ha-pages";
    let dir = tempfile::tempdir().unwrap();
    let (env, b) = two_replicas(ns, dir.path()).await;
    env.churn(ns, "p", 30).await;
    let (truth, _) = env.truth(ns).await;
    wait_ready(&env.proxy).await;
    wait_ready(&b).await;
    // Both replicas serve the same certificate: one client (trusting it) talks to either.
    let client = env.proxy.client(None, true);
    let token = env.cp.admin_token().to_string();
    let at = |p: &TestProxy, path: &str| format!("https://localhost:{}{path}", p.tls_addr.port());
    let continued = async |p: &TestProxy| {
        let url = format!("https://localhost:{}/metrics", p.admin_addr.port());
        let m = crate::support::proxy::body_string(client.get(&url, None).await).await;
        m.lines()
            .find(|l| {
                l.starts_with("kube_cache_proxy_list_continued_pages_total{")
                    && l.contains("resource=\"configmaps\"")
            })
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let b_before = continued(&b).await;
    let base = format!("/api/v1/namespaces/{ns}/configmaps?limit=7");
    let mut names = Vec::new();
    let mut cont = String::new();
    let mut list_rv = None;
    let mut pages = 0;
    loop {
        // Alternate replicas: A, B, A, B, ...
        let p = if pages % 2 == 0 { &env.proxy } else { &b };
        let path = if cont.is_empty() {
            base.clone()
        } else {
            format!("{base}&continue={cont}")
        };
        let r = client.get(&at(p, &path), Some(&token)).await;
        assert_eq!(r.status(), 200, "page {pages}");
        let page = body_json(r).await;
        let rv = page["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(
            *list_rv.get_or_insert(rv.clone()),
            rv,
            "every page at one resourceVersion"
        );
        for o in page["items"].as_array().unwrap() {
            names.push(o["metadata"]["name"].as_str().unwrap().to_string());
        }
        pages += 1;
        cont = page["metadata"]["continue"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if cont.is_empty() {
            break;
        }
    }
    let want: Vec<String> = truth.keys().cloned().collect();
    assert_eq!(
        names, want,
        "the pages of both replicas are the apiserver's list"
    );
    assert_eq!(pages, want.len().div_ceil(7), "pages of 7");
    assert!(pages >= 3, "both replicas served a page");
    assert!(
        continued(&b).await > b_before,
        "replica B served continued pages from its cache"
    );
    b.shutdown().await;
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// Two replicas behind one address, restarted one at a time (each draining, saving its state
/// and loading it again), while client-go informers (legacy, WatchList, metadata) watch
/// through the address and writes go on: no informer relists, and each ends with exactly the
/// apiserver's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_two_replicas_costs_informers_no_relist() {
    let ns = "e2e-ha-rolling";
    let dir = tempfile::tempdir().unwrap();
    let (mut env, mut b, lb, kubeconfig) = two_replicas_behind_a_balancer(ns, dir.path()).await;
    env.churn(ns, "pre", 6).await;
    let bin = tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_client_binaries)
        .await
        .unwrap()
        .unwrap();
    let modes = ["legacy", "watchlist", "metadata"].map(|m| (m, "json"));
    let mut informers = spawn_informers(&bin, &kubeconfig, ns, &[modes, modes].concat());
    let mut last = env.churn(ns, "before", 3).await;
    for (_, _, ic) in informers.iter_mut() {
        ic.wait(last);
    }
    for (i, step) in ["restart-a", "restart-b"].iter().enumerate() {
        if i == 0 {
            env.proxy.restart(|_| {}).await;
            wait_ready(&env.proxy).await;
        } else {
            b.restart(|_| {}).await;
            wait_ready(&b).await;
        }
        last = env.churn(ns, step, 3).await;
        for (_, _, ic) in informers.iter_mut() {
            ic.wait(last);
        }
    }
    let last = env.churn(ns, "after", 4).await;
    let (truth, _) = env.truth(ns).await;
    for (mode, _, ic) in informers.iter_mut() {
        assert_eq!(
            ic.wait(last),
            truth,
            "{mode}: the informer differs from the apiserver"
        );
    }
    for (mode, _, ic) in informers {
        assert_started_once(mode, "through the balancer", &ic.finish());
    }
    println!(
        "connections the balancer handed to A and B: {:?}",
        lb.handed
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect::<Vec<_>>()
    );
    b.shutdown().await;
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// A cold rolling restart (no saved state) while informers of several namespaces watch
/// through the address, each last written at a different moment, so each resumes from its
/// own resourceVersion, older than a cold replica's history: no informer relists, each ends
/// with exactly the apiserver's state, and the watchers a drained replica ends resume
/// together from its progress (the bookmark it sends them at the drain), costing the other
/// replica at most one backfill rather than one per informer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_rolling_restart_costs_informers_resuming_from_scattered_versions_no_relist() {
    let ns = "e2e-ha-cold";
    let dir = tempfile::tempdir().unwrap();
    let (mut env, mut b, _lb, kubeconfig) = two_replicas_behind_a_balancer(ns, dir.path()).await;
    let bin = tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_client_binaries)
        .await
        .unwrap()
        .unwrap();
    let modes = ["legacy", "watchlist", "metadata", "controller-runtime"];
    let namespaces: Vec<String> = (0..6).map(|i| format!("{ns}-{i}")).collect();
    let mut informers = Vec::new();
    for (i, n) in namespaces.iter().enumerate() {
        env.cp.create_default_service_account(n).await.unwrap();
        env.churn(n, "pre", 2).await;
        let mode = modes[i % modes.len()];
        informers.extend(
            spawn_informers(&bin, &kubeconfig, n, &[(mode, "json")])
                .into_iter()
                .map(|x| (n.clone(), x)),
        );
    }
    // One namespace after another: each informer's last event is its own resourceVersion.
    for (n, (_, _, ic)) in informers.iter_mut() {
        let last = env.churn(n, "before", 2).await;
        ic.wait(last);
    }
    let cold = |c: &mut kube_cache_proxy::config::Config| c.cache.state_dir = None;
    // A cold, then B cold: B's watchers (all of them by then) move to A, whose history
    // starts after every informer's last event.
    env.proxy.restart(cold).await;
    wait_ready(&env.proxy).await;
    let before = backfills(&env.proxy).await;
    b.restart(cold).await;
    wait_ready(&b).await;
    for (n, (mode, _, ic)) in informers.iter_mut() {
        let last = env.churn(n, "after", 2).await;
        let (truth, _) = env.truth(n).await;
        assert_eq!(
            ic.wait(last),
            truth,
            "{mode} in {n}: differs from the apiserver"
        );
    }
    let after = backfills(&env.proxy).await;
    assert!(
        after - before <= 1,
        "the informers B drained resumed from one resourceVersion: {before} -> {after} backfills"
    );
    for (n, (mode, _, ic)) in informers {
        assert_started_once(mode, &format!("{n} through the balancer"), &ic.finish());
    }
    b.shutdown().await;
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// The backfills a proxy made (served with events or with a difference).
async fn backfills(p: &TestProxy) -> u64 {
    let (_, metrics) = p.admin_get("/metrics").await;
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("kube_cache_proxy_backfills_total{outcome=\"filled\"}")
                || l.starts_with("kube_cache_proxy_backfills_total{outcome=\"difference\"}")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// A proxy whose upstream is another proxy (a tier): its informers sync and converge, and the
/// top proxy sees ONE watcher of configmaps for the lower proxy however many informers the
/// lower one serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_in_front_of_a_proxy_keeps_one_upstream_watch_at_the_top() {
    let ns = "e2e-tier";
    let env = env_with(ns, |_| {}).await;
    wait_ready(&env.proxy).await;
    let top = env.proxy.cache("", "v1", "configmaps").unwrap();
    let top_watchers = top.hub.len();
    let upstream = kube_config(&env.proxy.kubeconfig_yaml(env.cp.admin_token())).await;
    let lower = TestProxy::start_with_kube(upstream, |_| {}).await;
    wait_ready(&lower).await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("lower.kubeconfig");
    std::fs::write(&kubeconfig, lower.kubeconfig_yaml(env.cp.admin_token())).unwrap();
    env.churn(ns, "pre", 6).await;
    let bin = tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_client_binaries)
        .await
        .unwrap()
        .unwrap();
    let modes = ["legacy", "watchlist", "metadata"].map(|m| (m, "json"));
    let mut informers = spawn_informers(&bin, &kubeconfig, ns, &modes);
    let last = env.churn(ns, "tier", 5).await;
    let (truth, _) = env.truth(ns).await;
    for (mode, _, ic) in informers.iter_mut() {
        assert_eq!(ic.wait(last), truth, "{mode} via two proxies");
    }
    let lower_cache = lower.cache("", "v1", "configmaps").unwrap();
    assert_eq!(
        lower_cache.hub.len(),
        3,
        "the three informers watch the lower proxy"
    );
    assert_eq!(
        top.hub.len(),
        top_watchers + 1,
        "the top proxy serves one watch of configmaps for the lower proxy"
    );
    for (mode, _, ic) in informers {
        assert_started_once(mode, "via two proxies", &ic.finish());
    }
    lower.shutdown().await;
    env.proxy.shutdown().await;
    env.cp.stop().await;
}
