//! Real clients pointed at the proxy, in front of a real kube-apiserver + etcd: client-go
//! informers (legacy LIST+WATCH, WatchList, metadata-only), kube-rs watcher/reflector (also
//! with streaming lists), kubectl, and the Python client. Each client's final view must equal
//! the apiserver's own state after creates, updates and deletes made directly upstream.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support;
use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::TestProxy;
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::cache::reflector::backfill::BackfillStats;
use serde_json::json;

pub(crate) const BOUND: Duration = Duration::from_secs(60);

pub(crate) struct Env {
    pub(crate) cp: ControlPlane,
    pub(crate) proxy: TestProxy,
    /// Direct admin client to the apiserver (the judge).
    pub(crate) admin: kube::Client,
    pub(crate) proxy_kubeconfig: PathBuf,
    pub(crate) direct_kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

pub(crate) async fn kube_config(yaml: &str) -> kube::Config {
    let kc = kube::config::Kubeconfig::from_yaml(yaml).unwrap();
    kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap()
}

async fn env(ns: &str) -> Env {
    env_with(ns, |_| {}).await
}

pub(crate) async fn env_with(
    ns: &str,
    configure: impl FnOnce(&mut kube_cache_proxy::config::Config),
) -> Env {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    cp.create_default_service_account(ns).await.unwrap();
    let upstream = kube_config(&cp.admin_kubeconfig_yaml()).await;
    let proxy = TestProxy::start_with_kube(upstream.clone(), configure).await;
    let admin = kube::Client::try_from(upstream).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy_kubeconfig = dir.path().join("proxy.kubeconfig");
    std::fs::write(&proxy_kubeconfig, proxy.kubeconfig_yaml(cp.admin_token())).unwrap();
    let direct_kubeconfig = dir.path().join("direct.kubeconfig");
    std::fs::write(&direct_kubeconfig, cp.admin_kubeconfig_yaml()).unwrap();
    Env {
        cp,
        proxy,
        admin,
        proxy_kubeconfig,
        direct_kubeconfig,
        _dir: dir,
    }
}

impl Env {
    async fn via_proxy(&self) -> kube::Client {
        let yaml = std::fs::read_to_string(&self.proxy_kubeconfig).unwrap();
        kube::Client::try_from(kube_config(&yaml).await).unwrap()
    }

    /// The apiserver's view: name -> (uid, resourceVersion), and the list RV.
    pub(crate) async fn truth(&self, ns: &str) -> (BTreeMap<String, (String, String)>, u64) {
        let l = Api::<ConfigMap>::namespaced(self.admin.clone(), ns)
            .list(&ListParams::default())
            .await
            .unwrap();
        let rv = l.metadata.resource_version.unwrap().parse().unwrap();
        let m = l
            .items
            .into_iter()
            .map(|c| {
                (
                    c.metadata.name.unwrap(),
                    (
                        c.metadata.uid.unwrap(),
                        c.metadata.resource_version.unwrap(),
                    ),
                )
            })
            .collect();
        (m, rv)
    }

    /// Creates, updates and deletes ConfigMaps directly on the apiserver; returns the RV of the
    /// last write.
    pub(crate) async fn churn(&self, ns: &str, prefix: &str, n: usize) -> u64 {
        let api = Api::<ConfigMap>::namespaced(self.admin.clone(), ns);
        let mut last = 0;
        for i in 0..n {
            let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": format!("{prefix}-{i}"), "labels": {"i": i.to_string()}}, "data": {"v": "0"}})).unwrap();
            last = rv(&api.create(&PostParams::default(), &cm).await.unwrap());
        }
        for i in (0..n).step_by(2) {
            let p = json!({"data": {"v": "1"}});
            last = rv(&api
                .patch(
                    &format!("{prefix}-{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(&p),
                )
                .await
                .unwrap());
        }
        for i in (0..n).step_by(3) {
            api.delete(&format!("{prefix}-{i}"), &DeleteParams::default())
                .await
                .unwrap();
        }
        // A final write gives an RV at or after every delete.
        let marker: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": format!("{prefix}-end")}})).unwrap();
        last = last.max(rv(&api
            .create(&PostParams::default(), &marker)
            .await
            .unwrap()));
        last
    }
}

/// A reflector's view: name -> (uid, resourceVersion), as `Env::truth` gives the apiserver's.
fn view(store: &reflector::Store<ConfigMap>) -> BTreeMap<String, (String, String)> {
    store
        .state()
        .iter()
        .map(|c| {
            let m = &c.metadata;
            (
                m.name.clone().unwrap(),
                (m.uid.clone().unwrap(), m.resource_version.clone().unwrap()),
            )
        })
        .collect()
}

fn rv(cm: &ConfigMap) -> u64 {
    cm.metadata
        .resource_version
        .as_deref()
        .unwrap()
        .parse()
        .unwrap()
}

/// A running `informer-check` (tests/e2e/go/cmd/informer-check): one client-go informer of
/// ConfigMaps in a namespace.
pub(crate) struct InformerCheck {
    what: String,
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: Option<std::thread::JoinHandle<Vec<String>>>,
}

impl InformerCheck {
    pub(crate) fn spawn(
        bin: &std::path::Path,
        kubeconfig: &std::path::Path,
        ns: &str,
        args: &[&str],
    ) -> Self {
        let mut child = Command::new(bin.join("informer-check"))
            .args([
                "--kubeconfig",
                kubeconfig.to_str().unwrap(),
                "--namespace",
                ns,
            ])
            .args(["--resource", "configmaps"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = support::e2e::line_receiver(child.stdout.take().unwrap());
        let stderr = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<_>>()
        });
        InformerCheck {
            what: format!("informer-check {args:?} ({})", kubeconfig.display()),
            stdin: child.stdin.take(),
            child,
            lines,
            stderr: Some(stderr),
        }
    }

    /// The next stdout line starting with `prefix` (others are skipped).
    pub(crate) fn next(&self, prefix: &str) -> String {
        loop {
            let l = self
                .lines
                .recv_timeout(BOUND)
                .unwrap_or_else(|_| panic!("{}: no {prefix} line", self.what));
            if l.starts_with(prefix) {
                return l;
            }
        }
    }

    /// Waits until the informer has seen the write at `rv`; its cache: name -> (uid, RV).
    pub(crate) fn wait(&mut self, rv: u64) -> BTreeMap<String, (String, String)> {
        writeln!(self.stdin.as_mut().unwrap(), "WAIT {rv}").unwrap();
        let cache = self.next("CACHE ");
        let cache: Vec<serde_json::Value> = serde_json::from_str(&cache["CACHE ".len()..]).unwrap();
        cache
            .iter()
            .map(|e| {
                (
                    e["name"].as_str().unwrap().to_string(),
                    (
                        e["uid"].as_str().unwrap().to_string(),
                        e["resourceVersion"].as_str().unwrap().to_string(),
                    ),
                )
            })
            .collect()
    }

    /// The handlers' calls so far: (adds, updates, deletes).
    fn counts(&mut self) -> (u64, u64, u64) {
        writeln!(self.stdin.as_mut().unwrap(), "COUNTS").unwrap();
        let l = self.next("COUNTS ");
        let n: Vec<u64> = l["COUNTS ".len()..]
            .split(' ')
            .map(|x| x.parse().unwrap())
            .collect();
        (n[0], n[1], n[2])
    }

    /// Waits until the informer's LastSyncResourceVersion reaches `rv` (events or bookmarks).
    fn wait_rv(&mut self, rv: u64) -> u64 {
        writeln!(self.stdin.as_mut().unwrap(), "WAITRV {rv}").unwrap();
        self.next("RV ")["RV ".len()..].parse().unwrap()
    }

    /// Waits like [`InformerCheck::wait`]; the cache's entries as the program printed them.
    fn wait_entries(&mut self, rv: u64) -> Vec<serde_json::Value> {
        writeln!(self.stdin.as_mut().unwrap(), "WAIT {rv}").unwrap();
        let cache = self.next("CACHE ");
        serde_json::from_str(&cache["CACHE ".len()..]).unwrap()
    }

    /// Ends the program (it must exit 0); its stderr lines.
    pub(crate) fn finish(mut self) -> Vec<String> {
        drop(self.stdin.take());
        let status = self.child.wait().unwrap();
        let errs = self.stderr.take().unwrap().join().unwrap();
        assert!(status.success(), "{}: {errs:?}", self.what);
        errs
    }
}

/// The control plane and proxy with six ConfigMaps in `ns`, and the client-go checker.
async fn env_with_objects_and_informer_check(ns: &str) -> (Env, PathBuf) {
    let env = env(ns).await;
    env.churn(ns, "pre", 6).await;
    let bin = tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_client_binaries)
        .await
        .unwrap()
        .unwrap();
    (env, bin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_go_informers_converge_to_the_apiservers_state() {
    let ns = "e2e-clientgo";
    let (env, bin) = env_with_objects_and_informer_check(ns).await;
    for mode in ["legacy", "watchlist", "metadata"] {
        let mut ic = InformerCheck::spawn(&bin, &env.proxy_kubeconfig, ns, &["--mode", mode]);
        let m = ic.next("MODE");
        assert!(
            m.contains(if mode == "watchlist" {
                "WatchListClient=true"
            } else {
                "WatchListClient=false"
            }),
            "{m}"
        );
        ic.next("SYNCED");
        let last = env.churn(ns, mode, 9).await;
        let seen = ic.wait(last);
        let (truth, _) = env.truth(ns).await;
        assert_eq!(
            seen, truth,
            "{mode}: the informer's cache differs from the apiserver"
        );
        let errs = ic.finish();
        let requests: Vec<_> = errs.iter().filter(|l| l.starts_with("REQUEST ")).collect();
        if mode == "watchlist" {
            assert!(
                requests
                    .iter()
                    .any(|l| l.contains("sendInitialEvents=true")),
                "watchlist mode made no streaming list: {requests:?}"
            );
        } else {
            assert!(
                requests
                    .iter()
                    .any(|l| !l.contains("watch=true") && l.contains("/configmaps")),
                "{mode}: no LIST: {requests:?}"
            );
        }
    }
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// Protobuf responses for configmaps the proxy served from its cache, for `verb`, from its
/// per-encoding metrics.
async fn configmaps_protobuf_from_cache(env: &Env, verb: &str) -> f64 {
    let (code, m) = env.proxy.admin_get("/metrics").await;
    assert_eq!(code, 200);
    support::watch_validator::sum_metric(
        &m,
        "kube_cache_proxy_responses_total",
        &[
            &format!("verb=\"{verb}\""),
            "resource=\"configmaps\"",
            "encoding=\"protobuf\"",
            "served_by=\"cache\"",
        ],
    )
}

/// client-go typed informers configured as kube-controller-manager and the kubelet configure
/// theirs (`rest.Config.ContentType: application/vnd.kubernetes.protobuf`), legacy (LIST,
/// then WATCH) and WatchList (one streaming WATCH), converge through the proxy to exactly the
/// apiserver's state, every request of theirs asks for protobuf first, and their LIST and
/// WATCH were answered in protobuf from the proxy's cache (its per-encoding metrics). The
/// resource's protobuf side starts with its cache; the test waits for it to serve a
/// protobuf LIST first (while it syncs, a LIST waits for it or gets 429).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_go_protobuf_informers_converge_from_the_cache() {
    let ns = "e2e-clientgo-pb";
    let (env, bin) = env_with_objects_and_informer_check(ns).await;
    let p = crate::protobuf::Direct {
        http: support::proxy::apiserver_client(&env.proxy.ca_pem, false),
        url: env.proxy.https(""),
        token: env.cp.admin_token().to_string(),
    };
    let path = format!("/api/v1/namespaces/{ns}/configmaps");
    eventually(
        "a protobuf LIST of configmaps served from the cache",
        Duration::from_secs(60),
        async || {
            let (status, body) = p
                .send(
                    http::Method::GET,
                    &path,
                    "application/vnd.kubernetes.protobuf, application/json",
                    None,
                )
                .await;
            if status == http::StatusCode::TOO_MANY_REQUESTS {
                return Err(0.0);
            }
            assert!(body.starts_with(b"k8s\0"), "a protobuf answer: {status}");
            let n = configmaps_protobuf_from_cache(&env, "LIST").await;
            ok_if(n >= 1.0, n)
        },
    )
    .await;
    for mode in ["legacy", "watchlist"] {
        let (lists, watches) = (
            configmaps_protobuf_from_cache(&env, "LIST").await,
            configmaps_protobuf_from_cache(&env, "WATCH").await,
        );
        let mut ic = InformerCheck::spawn(
            &bin,
            &env.proxy_kubeconfig,
            ns,
            &["--mode", mode, "--content-type", "protobuf"],
        );
        ic.next("MODE");
        ic.next("SYNCED");
        let last = env.churn(ns, &format!("pb{mode}"), 9).await;
        let seen = ic.wait(last);
        let (truth, _) = env.truth(ns).await;
        assert_eq!(
            seen, truth,
            "{mode}: the protobuf informer's cache differs from the apiserver"
        );
        let errs = ic.finish();
        let requests: Vec<_> = errs.iter().filter(|l| l.starts_with("REQUEST ")).collect();
        assert!(
            !requests.is_empty()
                && requests
                    .iter()
                    .all(|l| l.contains("accept=application/vnd.kubernetes.protobuf,")),
            "{mode}: every request asks for protobuf first: {requests:?}"
        );
        let (lists_after, watches_after) = (
            configmaps_protobuf_from_cache(&env, "LIST").await,
            configmaps_protobuf_from_cache(&env, "WATCH").await,
        );
        assert!(
            watches_after > watches,
            "{mode}: the informer's protobuf WATCH came from the cache ({watches} -> {watches_after}): {requests:?}"
        );
        if mode == "legacy" {
            assert!(
                lists_after > lists,
                "legacy: the informer's protobuf LIST came from the cache ({lists} -> {lists_after})"
            );
        }
    }
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// kube-apiserver killed (SIGKILL) and restarted, in a few randomized rounds (the real
/// subset of the fault tier, `tests/integration/fault_tier.rs`): client-go informers the
/// proxy serves from its cache keep their watches and do not relist (legacy and metadata:
/// their one initial LIST; WatchList: its one streaming start), and end each round with
/// exactly the apiserver's state. The proxy's own upstream watch breaks; if the new
/// apiserver cannot resume it, the proxy relists and tells its watchers the difference
/// (`cache.absorbRelists`). Most informers here ask for JSON (the Accept a controller with
/// `ContentType: application/json` sends); the one with client-go's own Accept (protobuf
/// first) is answered by the apiserver whenever its protobuf side cannot serve it (with
/// `cache.protobufSide: lazy` its first requests start the side and go there), so that
/// informer's watch may break with the apiserver's
/// connection, which the proxy ends as a clean end of stream (as the client would see the
/// connection drop direct). Its re-watch while the apiserver is still down is answered 503
/// by the proxy where a direct client meets a refused connection; client-go retries a watch
/// only after a refused connection or 429, so that informer may relist (seen with two kills
/// in a row): its LISTs are printed with the direct informer's, not asserted.
///
/// Each round, from its seed (`KCP_FAULT_REAL_SEEDS=1,2,3`, the default): writes before the
/// fault, then one of: a kill and restart; two kills in a row (the second while the proxy
/// and the informers recover from the first); writes, a kill, and writes at once after the
/// restart. Resume time (kill to the informer holding the apiserver's state) is printed per
/// informer; no assertion depends on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_go_informers_behind_the_proxy_do_not_relist_when_the_apiserver_restarts() {
    use support::watch_validator::Rng;
    let ns = "e2e-restart";
    let seeds: Vec<u64> = std::env::var("KCP_FAULT_REAL_SEEDS")
        .ok()
        .map(|v| v.split(',').map(|s| s.trim().parse().unwrap()).collect())
        .unwrap_or_else(|| vec![1, 2, 3]);
    let mut env = env(ns).await;
    env.churn(ns, "pre", 6).await;
    let bin = tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_client_binaries)
        .await
        .unwrap()
        .unwrap();
    let sides = [
        ("legacy", "json", &env.proxy_kubeconfig, "proxy"),
        ("watchlist", "json", &env.proxy_kubeconfig, "proxy"),
        ("metadata", "json", &env.proxy_kubeconfig, "proxy"),
        ("legacy", "client", &env.proxy_kubeconfig, "proxy"),
        ("legacy", "client", &env.direct_kubeconfig, "apiserver"),
    ];
    let mut informers: Vec<_> = sides
        .iter()
        .map(|(mode, accept, kc, side)| {
            let ic = InformerCheck::spawn(&bin, kc, ns, &["--mode", mode, "--accept", accept]);
            ic.next("SYNCED");
            (*mode, *accept, *side, ic)
        })
        .collect();
    let before = env.churn(ns, "before", 3).await;
    for (_, _, _, ic) in informers.iter_mut() {
        ic.wait(before);
    }
    let cache = env.proxy.cache("", "v1", "configmaps").unwrap();
    let relists_before = cache.relists();

    let mut rounds = Vec::new();
    for seed in seeds {
        let mut rng = Rng::new(seed);
        let fault = rng.below(3);
        env.churn(ns, &format!("s{seed}-pre"), 2 + rng.below(5))
            .await;
        let t = std::time::Instant::now();
        env.cp.kill_and_restart_apiserver().await.unwrap();
        if fault == 1 {
            env.cp.kill_and_restart_apiserver().await.unwrap();
        }
        let restart = t.elapsed();
        let n = if fault == 2 { 6 + rng.below(6) } else { 3 };
        let last = env.churn(ns, &format!("s{seed}-after"), n).await;
        let (truth, _) = env.truth(ns).await;
        let mut resumed = Vec::new();
        for (mode, accept, side, ic) in informers.iter_mut() {
            assert_eq!(
                ic.wait(last),
                truth,
                "seed {seed}: {mode} ({accept}) via {side}: the informer's cache differs from the \
                 apiserver"
            );
            resumed.push(format!("{mode}/{accept}/{side} {:?}", t.elapsed()));
        }
        let what = ["kill", "kill twice", "kill, writes at once"][fault];
        rounds.push(format!(
            "seed {seed} ({what}): apiserver ready again in {restart:?}; informers held its \
             state after {resumed:?}"
        ));
    }
    let mut compared = Vec::new();
    for (mode, accept, side, ic) in informers {
        let errs = ic.finish();
        match (accept, side) {
            ("json", "proxy") => assert_started_once(mode, "via proxy", &errs),
            _ => compared.push(format!(
                "{mode} ({accept}) via {side}: {} LIST(s)",
                informer_starts(&errs).0
            )),
        }
    }
    for r in &rounds {
        println!("{r}");
    }
    println!(
        "the proxy relisted configmaps {} time(s), told as a difference {:?}; informers the \
         cache does not serve: {compared:?}",
        cache.relists() - relists_before,
        cache.absorbed_relists()
    );
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// The proxy stopped gracefully (SIGTERM) and started again at the same address with
/// `cache.stateDir`: it saves each cache's state, loads it at start and resumes its upstream
/// watches without a LIST; client-go informers (legacy, WatchList, metadata, and a
/// controller-runtime cache's, each in JSON and in protobuf) re-watch from their last resourceVersion and get what they missed,
/// writes made while the proxy was down included: no informer relists, each ends with
/// exactly the apiserver's state, and none is left on the apiserver once the caches serve
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_go_informers_do_not_relist_when_the_proxy_restarts_with_its_saved_state() {
    proxy_restart("e2e-proxy-restart", Restart::Warm).await;
}

/// The same without `cache.stateDir`: the restarted proxy lists afresh, after the writes
/// made while it was down, so every informer resumes from a resourceVersion older than the
/// new cache's history. The proxy extends the history back from the apiserver (an Exact
/// list and a watch from the oldest resumed resourceVersion, `cache.backfill`, and a
/// protobuf watch for the stretch's envelopes) and the informers get exactly what they
/// missed: no relist either (so no 410 either: client-go relists on one). The protobuf
/// informers (legacy, WatchList, metadata, controller-runtime) re-watch from the cache too, and once the caches
/// serve them no informer's watch is left on the apiserver (the proxy's gauge of open
/// passed-through watches, polled until 0; a re-watch passed through while the cache or its
/// protobuf side started is moved home).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_go_informers_do_not_relist_when_the_proxy_restarts_without_saved_state() {
    proxy_restart("e2e-proxy-cold", Restart::Cold).await;
}

/// As above, and kube-apiserver is killed and restarted while the proxy is down: its new
/// watch cache starts at etcd's current revision, so it answers the backfill's watch from the
/// informers' resourceVersion with 410 (too old), though etcd still has that revision. The
/// proxy then extends its history with the difference between the Exact list at that
/// resourceVersion (read from etcd) and its cache (`Stretch::Difference`): the informers
/// get ordinary events for what changed and still do not relist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_go_informers_do_not_relist_when_the_proxy_and_the_apiserver_restart() {
    proxy_restart("e2e-proxy-cold-api", Restart::ColdWithApiserver).await;
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Restart {
    /// With `cache.stateDir`: the saved state is loaded.
    Warm,
    /// Without: a fresh cache, whose history the informers' resumes backfill.
    Cold,
    /// Without, and kube-apiserver restarted while the proxy is down.
    ColdWithApiserver,
}

async fn proxy_restart(ns: &str, how: Restart) {
    let warm = how == Restart::Warm;
    let state = tempfile::tempdir().unwrap();
    let state_dir = state.path().to_path_buf();
    let mut env = env_with(ns, |c| {
        if warm {
            c.cache.state_dir = Some(state_dir);
        }
    })
    .await;
    env.churn(ns, "pre", 6).await;
    let bin = tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_client_binaries)
        .await
        .unwrap()
        .unwrap();
    // JSON and protobuf (client-go's own Accept: protobuf first; controller-runtime asks for
    // protobuf for built-in kinds) informers of each kind.
    let sides = [
        ("legacy", "json"),
        ("watchlist", "json"),
        ("metadata", "json"),
        ("controller-runtime", "json"),
        ("legacy", "client"),
        ("watchlist", "client"),
        ("metadata", "client"),
        ("controller-runtime", "client"),
    ];
    let mut informers = spawn_informers(&bin, &env.proxy_kubeconfig, ns, &sides);
    let before = env.churn(ns, "before", 3).await;
    for (_, _, ic) in informers.iter_mut() {
        ic.wait(before);
    }

    // Down: graceful shutdown (watches end cleanly, states saved); writes go on meanwhile.
    let down_at = unix_millis();
    let t = std::time::Instant::now();
    env.proxy.running.take().unwrap().shutdown().await;
    let stopped = t.elapsed();
    let during = env.churn(ns, "during", 3).await;
    if how == Restart::ColdWithApiserver {
        env.cp.kill_and_restart_apiserver().await.unwrap();
    }
    let t_up = std::time::Instant::now();
    let up_at = unix_millis();
    env.proxy.restart(|_| {}).await;
    let started = t_up.elapsed();
    let entry = |state: &kube_cache_proxy::serve::state::State| {
        state
            .caches
            .entries()
            .into_iter()
            .find(|e| e.cache.resource.resource == "configmaps")
    };
    let state = env.proxy.running.as_ref().unwrap().state.clone();
    eventually(
        "the configmaps cache after the restart",
        BOUND,
        async || {
            let ready = entry(&state).is_some_and(|e| e.cache.is_ready());
            ok_if(ready, "not ready")
        },
    )
    .await;
    let ready = t_up.elapsed();
    // Every informer caught up with the writes made while the proxy was down.
    for (_, _, ic) in informers.iter_mut() {
        ic.wait(during);
    }
    let resumed = t_up.elapsed();
    let last = env.churn(ns, "after", 5).await;
    let (truth, _) = env.truth(ns).await;
    for (mode, accept, ic) in informers.iter_mut() {
        assert_eq!(
            ic.wait(last),
            truth,
            "{mode} ({accept}): the informer's cache differs from the apiserver"
        );
    }
    // No informer's watch is left on the apiserver once the caches serve them: a re-watch
    // the restarted proxy passed through (its cache or protobuf side still starting, a
    // starting point without envelopes) has been moved home by now (`serve::homing`).
    let configmaps_metric = async |name: &str| {
        let (_, m) = env.proxy.admin_get("/metrics").await;
        support::watch_validator::sum_metric(&m, name, &["resource=\"configmaps\""])
    };
    eventually(
        "no configmaps watch of an informer left on the apiserver",
        BOUND,
        async || {
            let open = configmaps_metric("kube_cache_proxy_passthrough_watches").await;
            ok_if(open == 0.0, open)
        },
    )
    .await;
    let passed_through = {
        let (_, m) = env.proxy.admin_get("/metrics").await;
        m.lines()
            .filter(|l| {
                l.starts_with("kube_cache_proxy_passthrough_total{")
                    && l.contains("verb=\"WATCH\"")
                    && l.contains("resource=\"configmaps\"")
            })
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let moved_home = configmaps_metric("kube_cache_proxy_watches_moved_home_total").await;
    let e = entry(&state).unwrap();
    let lists: u64 = e.reflector.stats().snapshot().lists.iter().sum();
    let backfills = |c: fn(&BackfillStats) -> &std::sync::atomic::AtomicU64| {
        state.watch.backfill.as_ref().map_or(0, |b| {
            c(&b.counters).load(std::sync::atomic::Ordering::Relaxed)
        })
    };
    let (filled, differences) = (backfills(|c| &c.filled), backfills(|c| &c.differences));
    match how {
        Restart::Warm => {
            assert_eq!(lists, 0, "the restarted proxy listed configmaps upstream");
            // The envelopes are written from the JSON objects (`cache.protobufTranscode`):
            // the restored state had them at once, with no protobuf watch of its own, and
            // the protobuf informer's re-watch came from the cache (its history's envelopes
            // too) instead of waiting for envelopes and going to the apiserver.
            let side = e.proto_stats().map(|s| s.snapshot());
            assert!(
                e.cache.transcodes() && side.is_none(),
                "protobuf written from the restored JSON, no protobuf side: {side:?}"
            );
            let from_cache = configmaps_protobuf_from_cache(&env, "WATCH").await;
            assert!(
                from_cache >= 1.0,
                "the protobuf informer's re-watch was served from the cache"
            );
        }
        Restart::Cold => {
            assert_eq!(lists, 1, "the cold proxy lists configmaps once");
            assert!(filled >= 1, "the informers' resumes were backfilled");
            // The backfill brought the stretch's protobuf envelopes too: no protobuf
            // re-watch went to the apiserver for want of them.
            assert!(
                !passed_through
                    .iter()
                    .any(|l| l.contains("protobuf envelopes of the starting point missing")),
                "{passed_through:?}"
            );
            let from_cache = configmaps_protobuf_from_cache(&env, "WATCH").await;
            assert!(
                from_cache >= 4.0,
                "the four protobuf informers' re-watches were served from the cache \
                 ({from_cache})"
            );
        }
        Restart::ColdWithApiserver => {
            assert_eq!(lists, 1, "the cold proxy lists configmaps once");
            assert!(
                differences >= 1,
                "the informers' resumes were extended with the difference \
                 ({filled} backfilled with the apiserver's events instead)"
            );
        }
    }
    let mut timelines = Vec::new();
    for (mode, accept, ic) in informers {
        let errs = ic.finish();
        assert_started_once(mode, accept, &errs);
        timelines.push(format!(
            "{mode}/{accept}: {}",
            request_timeline(&errs, down_at, up_at)
        ));
    }
    println!(
        "proxy ({}) stopped gracefully in {stopped:?}, started in {started:?}, configmaps \
         cache ready {ready:?} after the start ({lists} upstream LISTs, {filled} backfills, \
         {differences} differences), every informer had the writes made while it was down \
         {resumed:?} after the start; configmaps watches passed through by the restarted \
         proxy: {passed_through:?}, moved home: {}, left on the apiserver: 0; the \
         informers' requests from the stop on (ms after the start; - before it): \
         {timelines:#?}",
        match how {
            Restart::Warm => "saved state",
            Restart::Cold => "no saved state",
            Restart::ColdWithApiserver => "no saved state, kube-apiserver restarted",
        },
        moved_home as u64
    );
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_rs_reflectors_converge_with_and_without_streaming_lists() {
    let ns = "e2e-kubers";
    let env = env(ns).await;
    env.churn(ns, "pre", 6).await;
    for streaming in [false, true] {
        let api = Api::<ConfigMap>::namespaced(env.via_proxy().await, ns);
        let (reader, writer) = reflector::store();
        let cfg = if streaming {
            watcher::Config::default().streaming_lists()
        } else {
            watcher::Config::default()
        };
        let stream = reflector(writer, watcher(api, cfg)).applied_objects();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(r) = stream.next().await {
                if let Err(e) = r {
                    eprintln!("watcher error: {e}");
                }
            }
        });
        tokio::time::timeout(BOUND, reader.wait_until_ready())
            .await
            .unwrap()
            .unwrap();
        env.churn(ns, if streaming { "streaming" } else { "legacy" }, 9)
            .await;
        let (truth, _) = env.truth(ns).await;
        let what = format!("the reflector (streaming={streaming}) to converge on {truth:?}");
        eventually(&what, BOUND, async || {
            let seen = view(&reader);
            ok_if(seen == truth, seen)
        })
        .await;
        task.abort();
    }
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

fn kubectl(env: &Env, kubeconfig: &PathBuf, args: &[&str]) -> (bool, String, String) {
    let o = Command::new(env.cp.kubectl())
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .unwrap();
    (
        o.status.success(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_get_watch_apply_delete_and_exec_behave_as_direct() {
    let ns = "e2e-kubectl";
    let env = env(ns).await;
    env.churn(ns, "pre", 7).await;
    let pk = env.proxy_kubeconfig.clone();
    let dk = env.direct_kubeconfig.clone();
    // get, plain and chunked, equals the direct answer.
    let direct = kubectl(&env, &dk, &["get", "cm", "-n", ns, "-o", "name"]);
    for args in [
        &["get", "cm", "-n", ns, "-o", "name"][..],
        &["get", "cm", "-n", ns, "-o", "name", "--chunk-size=2"][..],
    ] {
        let via = kubectl(&env, &pk, args);
        assert!(via.0, "{}", via.2);
        assert_eq!(via.1, direct.1, "{args:?}");
    }
    // get -w sees a change made upstream.
    let mut w = Command::new(env.cp.kubectl())
        .arg("--kubeconfig")
        .arg(&pk)
        .args(["get", "cm", "-n", ns, "-w", "-o", "name"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = w.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    // The initial ADDED events arrive first; then a create made directly upstream.
    rx.recv_timeout(BOUND).expect("initial watch output");
    let api = Api::<ConfigMap>::namespaced(env.admin.clone(), ns);
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "watched"}})).unwrap();
    api.create(&PostParams::default(), &cm).await.unwrap();
    let deadline = std::time::Instant::now() + BOUND;
    loop {
        let l = rx.recv_timeout(BOUND).expect("watch output");
        if l == "configmap/watched" {
            break;
        }
        assert!(std::time::Instant::now() < deadline);
    }
    let _ = w.kill();
    let _ = w.wait();
    // apply and delete through the proxy land upstream.
    let manifest = env._dir.path().join("cm.yaml");
    std::fs::write(&manifest, format!("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: applied\n  namespace: {ns}\ndata:\n  k: v1\n")).unwrap();
    let a = kubectl(&env, &pk, &["apply", "-f", manifest.to_str().unwrap()]);
    assert!(a.0 && a.1.contains("configmap/applied created"), "{a:?}");
    std::fs::write(&manifest, format!("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: applied\n  namespace: {ns}\ndata:\n  k: v2\n")).unwrap();
    let a = kubectl(
        &env,
        &pk,
        &["apply", "--server-side", "-f", manifest.to_str().unwrap()],
    );
    assert!(a.0, "{a:?}");
    let got = api.get("applied").await.unwrap();
    assert_eq!(got.data.unwrap()["k"], "v2");
    let d = kubectl(&env, &pk, &["delete", "cm", "-n", ns, "applied"]);
    assert!(d.0, "{d:?}");
    assert!(api.get_opt("applied").await.unwrap().is_none());
    // exec: no nodes here, so the apiserver refuses the upgrade; the proxy relays its answer.
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(env.admin.clone(), ns);
    let pod = serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}})).unwrap();
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let via = kubectl(&env, &pk, &["exec", "-n", ns, "p", "--", "true"]);
    let direct = kubectl(&env, &dk, &["exec", "-n", ns, "p", "--", "true"]);
    assert!(!via.0 && !direct.0);
    assert!(
        direct.2.contains("does not have a host assigned"),
        "{}",
        direct.2
    );
    assert!(
        via.2.contains("does not have a host assigned"),
        "via proxy: {}",
        via.2
    );
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_client_lists_and_watches_through_the_proxy() {
    let ns = "e2e-python";
    let env = env(ns).await;
    env.churn(ns, "pre", 5).await;
    let setup = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/python/setup.sh");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash")
            .arg(setup)
            .stderr(Stdio::inherit())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "python venv setup failed");
    let python = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .to_string();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/python/list_watch.py");
    let n_events = 5;
    let mut child = Command::new(python)
        .arg(script)
        .args([
            env.proxy_kubeconfig.to_str().unwrap(),
            ns,
            &n_events.to_string(),
            "30",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let list = rx.recv_timeout(BOUND).expect("LIST line");
    let (truth, truth_rv) = env.truth(ns).await;
    let parts: Vec<_> = list.split_whitespace().collect();
    assert_eq!(parts[0], "LIST", "{list}");
    // resourceVersions are cluster-global and move with any write anywhere (other tests run
    // beside this one), so compare what the contract guarantees, not two reads' numbers:
    // the proxy's list is not newer than the apiserver's read after it, and not older than
    // any object it lists (this namespace is written only before the list).
    let listed_rv = parts[1].parse::<u64>().unwrap();
    assert!(listed_rv <= truth_rv, "{listed_rv} > {truth_rv}");
    let newest_item = truth
        .values()
        .map(|(_, rv)| rv.parse::<u64>().unwrap())
        .max()
        .unwrap_or(0);
    assert!(listed_rv >= newest_item, "{listed_rv} < {newest_item}");
    assert_eq!(parts[2].parse::<usize>().unwrap(), truth.len());
    let mut names = Vec::new();
    for _ in 0..truth.len() {
        names.push(rx.recv_timeout(BOUND).unwrap()["NAME ".len()..].to_string());
    }
    assert_eq!(names, truth.keys().cloned().collect::<Vec<_>>());
    // Five writes made directly upstream arrive as five events, in order.
    let api = Api::<ConfigMap>::namespaced(env.admin.clone(), ns);
    let mut want = Vec::new();
    for i in 0..3 {
        let cm: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": format!("py-{i}")}})).unwrap();
        let c = api.create(&PostParams::default(), &cm).await.unwrap();
        want.push(format!("EVENT ADDED py-{i} {}", rv(&c)));
    }
    let p = api
        .patch(
            "py-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"a": "b"}})),
        )
        .await
        .unwrap();
    want.push(format!("EVENT MODIFIED py-0 {}", rv(&p)));
    api.delete("py-1", &DeleteParams::default()).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..n_events {
        got.push(rx.recv_timeout(BOUND).expect("EVENT line"));
    }
    assert_eq!(&got[..4], &want[..]);
    assert!(got[4].starts_with("EVENT DELETED py-1 "), "{}", got[4]);
    assert_eq!(rx.recv_timeout(BOUND).unwrap(), format!("DONE {n_events}"));
    let status = child.wait().unwrap();
    assert!(status.success());
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_passthrough_watches_are_not_capped_by_the_apiservers_stream_limit() {
    // kube-apiserver allows 100 streams per HTTP/2 connection; 250 watches through the proxy
    // (on one downstream HTTP/2 connection) must all be served.
    let ns = "e2e-manywatches";
    let env = env(ns).await;
    let rv = env.churn(ns, "pre", 1).await;
    let c = env.proxy.client(None, true);
    let url = env.proxy.https(&format!(
        "/api/v1/namespaces/{ns}/configmaps?watch=1&resourceVersion={rv}"
    ));
    let token = env.cp.admin_token().to_string();
    let mut readers = Vec::new();
    for _ in 0..250 {
        let r = tokio::time::timeout(BOUND, c.get(&url, Some(&token)))
            .await
            .expect("watch headers");
        assert_eq!(r.status(), 200);
        readers.push(support::proxy::EventReader::new(r));
    }
    let api = Api::<ConfigMap>::namespaced(env.admin.clone(), ns);
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "fanout"}})).unwrap();
    api.create(&PostParams::default(), &cm).await.unwrap();
    for mut r in readers {
        // Bookmarks may come first; the first other event must be the create, as it is.
        let ev = loop {
            let ev = tokio::time::timeout(BOUND, r.next())
                .await
                .expect("event on every watch")
                .expect("the watch stays open");
            if ev["type"] != "BOOKMARK" {
                break ev;
            }
        };
        assert_eq!(ev["type"], "ADDED", "{ev}");
        assert_eq!(ev["object"]["metadata"]["name"], "fanout", "{ev}");
    }
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_watchers_add_no_watch_at_the_apiserver() {
    let ns = "e2e-fanout";
    let env = env(ns).await;
    env.churn(ns, "pre", 4).await;
    // Wait for the proxy's configmaps cache, protobuf included (written from the JSON
    // objects, `cache.protobufTranscode`): the apiserver then sees its one watch.
    eventually("the configmaps cache to sync", BOUND, async || {
        let synced = env.proxy.cache("", "v1", "configmaps").is_some_and(|c| {
            c.is_ready() && c.proto_synced.load(std::sync::atomic::Ordering::Relaxed) > 0
        });
        ok_if(synced, "not synced")
    })
    .await;
    let baseline = support::e2e::apiserver_watches(&env.admin, "configmaps").await;
    eprintln!("apiserver configmaps watches (all, cluster) with the proxy synced: {baseline:?}");
    let client = env.via_proxy().await;
    let mut readers = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let api = Api::<ConfigMap>::namespaced(client.clone(), ns);
        let (reader, writer) = reflector::store();
        let cfg = if i % 2 == 0 {
            watcher::Config::default()
        } else {
            watcher::Config::default().streaming_lists()
        };
        let stream = reflector(writer, watcher(api, cfg)).applied_objects();
        tasks.push(tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while stream.next().await.is_some() {}
        }));
        readers.push(reader);
    }
    for r in &readers {
        tokio::time::timeout(BOUND, r.wait_until_ready())
            .await
            .unwrap()
            .unwrap();
    }
    env.churn(ns, "live", 6).await;
    let (truth, _) = env.truth(ns).await;
    for r in &readers {
        eventually("every watcher to converge", BOUND, async || {
            let seen = view(r);
            ok_if(seen == truth, seen)
        })
        .await;
    }
    // The apiserver's own metrics: its open configmaps WATCHes are its own internal ones
    // plus the proxy's one (the protobuf is written from the JSON objects: no protobuf
    // side), however many watchers the proxy serves.
    let after = support::e2e::apiserver_watches(&env.admin, "configmaps").await;
    assert_eq!(
        after, baseline,
        "100 downstream watchers must not add upstream watches"
    );
    assert_eq!(
        after.1, 1,
        "the proxy's cluster-wide configmaps watches: one, its protobuf transcoded"
    );
    // And the proxy says it served them.
    let c = env.proxy.client(None, false);
    let m = support::proxy::body_string(c.get(&env.proxy.admin("/metrics"), None).await).await;
    let served: f64 = m
        .lines()
        .filter(|l| {
            l.starts_with("kube_cache_proxy_requests_total{")
                && l.contains("resource=\"configmaps\"")
                && l.contains("served_by=\"cache\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        served >= 100.0,
        "only {served} configmaps requests served from the cache:\n{m}"
    );
    for t in tasks {
        t.abort();
    }
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// Counts of a finished informer-check's requests: (LISTs, WATCHes) of configmaps, and its
/// watch and decode errors.
/// Now, in Unix milliseconds: the clock `informer-check` stamps its lines with (`at=`).
fn unix_millis() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    i64::try_from(now.unwrap().as_millis()).unwrap()
}

/// An informer-check's requests and outcomes stamped at or after `from` (Unix ms), each as
/// its time relative to `zero` in ms, what it asked (watch or list, resourceVersion) and how
/// it ended: where a resume after a restart spent its time.
fn request_timeline(errs: &[String], from: i64, zero: i64) -> String {
    let at = |l: &str| -> Option<i64> {
        let (_, t) = l.rsplit_once(" at=")?;
        t.split(':').next()?.parse().ok()
    };
    let mut out = Vec::new();
    for l in errs {
        let Some(t) = at(l).filter(|t| *t >= from) else {
            continue;
        };
        let what = if let Some(r) = l.strip_prefix("REQUEST ") {
            let query = r.split(['?', ' ']).nth(2).unwrap_or("");
            let rv = query
                .split('&')
                .find_map(|p| p.strip_prefix("resourceVersion="))
                .unwrap_or("-");
            let verb = if query.contains("watch=true") {
                "watch"
            } else {
                "list"
            };
            format!("{verb} rv={rv}")
        } else if let Some(o) = l.strip_prefix("OUTCOME ") {
            match o.split_once(" at=") {
                Some((head, tail)) => {
                    let status = head.rsplit(' ').next().unwrap_or("");
                    let err = tail.split_once(": ").map_or("", |(_, e)| e);
                    format!("-> {status} {err}").trim_end().to_string()
                }
                None => continue,
            }
        } else {
            continue;
        };
        out.push(format!("{:+} {what}", t - zero));
    }
    out.join(", ")
}

pub(crate) fn informer_traffic(errs: &[String]) -> (usize, usize, Vec<&String>) {
    let requests = errs
        .iter()
        .filter(|l| l.starts_with("REQUEST ") && l.contains("/configmaps"));
    let watches = requests
        .clone()
        .filter(|l| l.contains("watch=true"))
        .count();
    let lists = requests.count() - watches;
    let errors = errs
        .iter()
        .filter(|l| l.contains("watch error") || l.contains("decode"))
        .collect();
    (lists, watches, errors)
}

/// A finished informer-check's starts: (LISTs, streaming lists) of configmaps.
pub(crate) fn informer_starts(errs: &[String]) -> (usize, usize) {
    let (lists, _, _) = informer_traffic(errs);
    let streamed = errs
        .iter()
        .filter(|l| {
            l.starts_with("REQUEST ")
                && l.contains("/configmaps")
                && l.contains("sendInitialEvents=true")
        })
        .count();
    (lists, streamed)
}

/// Asserts that a finished informer-check started once and never relisted: legacy and
/// metadata informers one LIST, a WatchList informer one streaming list and no LIST.
pub(crate) fn assert_started_once(mode: &str, what: &str, errs: &[String]) {
    let (lists, streamed) = informer_starts(errs);
    if mode == "watchlist" {
        assert_eq!(
            (lists, streamed),
            (0, 1),
            "{what}: watchlist relisted: {errs:?}"
        );
    } else {
        assert_eq!(lists, 1, "{what}: {mode} relisted: {errs:?}");
    }
}

/// Starts one informer-check per mode through `kubeconfig`, each synced.
pub(crate) fn spawn_informers<'a>(
    bin: &std::path::Path,
    kubeconfig: &std::path::Path,
    ns: &str,
    modes: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str, InformerCheck)> {
    modes
        .iter()
        .map(|(mode, accept)| {
            let ic =
                InformerCheck::spawn(bin, kubeconfig, ns, &["--mode", mode, "--accept", accept]);
            ic.next("SYNCED");
            (*mode, *accept, ic)
        })
        .collect()
}

/// Requests for configmaps the proxy served from its cache, from its metrics.
async fn configmaps_served_from_cache(env: &Env) -> f64 {
    let c = env.proxy.client(None, false);
    let m = support::proxy::body_string(c.get(&env.proxy.admin("/metrics"), None).await).await;
    support::watch_validator::sum_metric(
        &m,
        "kube_cache_proxy_requests_total",
        &["resource=\"configmaps\"", "served_by=\"cache\""],
    )
}

/// A client-go metadata informer (`metadatainformer`) decodes every watch event through the
/// proxy as it does direct, so a bounded number of writes costs it no relist: one LIST, one
/// WATCH, no watch or decode error. The cache answers both, with the client's own Accept
/// (protobuf first: the protobuf side started with the cache) and with its JSON clauses only
/// (`--accept=json`), with PartialObjectMetadataList and PartialObjectMetadata events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_informers_do_not_relist_under_writes() {
    let ns = "e2e-metadata";
    let env = env(ns).await;
    env.churn(ns, "pre", 3).await;
    let bin = tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_client_binaries)
        .await
        .unwrap()
        .unwrap();
    let api = Api::<ConfigMap>::namespaced(env.admin.clone(), ns);
    let runs = [
        ("direct", &env.direct_kubeconfig, "client"),
        ("direct", &env.direct_kubeconfig, "json"),
        ("proxy", &env.proxy_kubeconfig, "client"),
        ("proxy", &env.proxy_kubeconfig, "json"),
    ];
    for (run, (via, kubeconfig, accept)) in runs.into_iter().enumerate() {
        let what = format!("{via}, accept={accept}");
        if via == "proxy" {
            // The protobuf side starts with the cache (`cache.protobufSide: eager`).
            eventually("the configmaps protobuf side to sync", BOUND, async || {
                let synced = env
                    .proxy
                    .cache("", "v1", "configmaps")
                    .is_some_and(|c| c.proto_synced.load(std::sync::atomic::Ordering::Relaxed) > 0);
                ok_if(synced, "not synced")
            })
            .await;
        }
        let cached_before = configmaps_served_from_cache(&env).await;
        let mut ic = InformerCheck::spawn(
            &bin,
            kubeconfig,
            ns,
            &["--mode", "metadata", "--accept", accept],
        );
        ic.next("SYNCED");
        // Twenty writes, each one event the informer's watch must decode.
        let mut last = 0;
        for i in 0..10 {
            let cm: ConfigMap = serde_json::from_value(
                json!({"metadata": {"name": format!("m{run}-{i}"), "labels": {"i": i.to_string()}}}),
            )
            .unwrap();
            api.create(&PostParams::default(), &cm).await.unwrap();
            let p = json!({"metadata": {"labels": {"touched": "yes"}}});
            last = rv(&api
                .patch(
                    &format!("m{run}-{i}"),
                    &PatchParams::default(),
                    &Patch::Merge(&p),
                )
                .await
                .unwrap());
        }
        let seen = ic.wait(last);
        let (truth, _) = env.truth(ns).await;
        assert_eq!(seen, truth, "{what}: the informer's cache");
        let errs = ic.finish();
        let (lists, watches, errors) = informer_traffic(&errs);
        assert!(errors.is_empty(), "{what}: {errors:?}");
        assert_eq!(
            (lists, watches),
            (1, 1),
            "{what}: relisted or rewatched: {errs:?}"
        );
        let from_cache = configmaps_served_from_cache(&env).await - cached_before;
        match (via, accept) {
            // The LIST and the WATCH, in JSON and in protobuf (the protobuf side started
            // with the cache).
            ("proxy", _) => assert_eq!(from_cache, 2.0, "{what}"),
            _ => assert_eq!(from_cache, 0.0, "{what}"),
        }
    }
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// kubectl's table output as cells, the time columns (AGE, DURATION) blanked. Each table's
/// header gives its columns' start offsets (kubectl's tabwriter starts every cell of a column
/// there); a blank line ends a table (`get all` prints several).
fn table_cells(out: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut header: Vec<(usize, String)> = Vec::new();
    for line in out.lines() {
        if line.trim().is_empty() {
            header.clear();
            rows.push(Vec::new());
            continue;
        }
        if header.is_empty() {
            let b = line.as_bytes();
            let starts: Vec<usize> = (0..b.len())
                .filter(|&i| {
                    b[i] != b' ' && (i == 0 || (i >= 2 && b[i - 1] == b' ' && b[i - 2] == b' '))
                })
                .collect();
            header = starts
                .iter()
                .enumerate()
                .map(|(k, &s)| {
                    let end = starts.get(k + 1).copied().unwrap_or(line.len());
                    (s, line[s..end].trim().to_string())
                })
                .collect();
        }
        let cells = header
            .iter()
            .enumerate()
            .map(|(k, (s, name))| {
                let end = header
                    .get(k + 1)
                    .map_or(line.len(), |h| h.0)
                    .min(line.len());
                let cell = line.get((*s).min(end)..end).unwrap_or("").trim();
                if matches!(name.as_str(), "AGE" | "DURATION") && cell != name {
                    "<age>".to_string()
                } else {
                    cell.to_string()
                }
            })
            .collect();
        rows.push(cells);
    }
    rows
}

/// `kubectl get` prints the same tables through the proxy as direct (READY, STATUS, RESTARTS,
/// the wide columns: the apiserver's Table, not a client-side fallback), and `get -w` the
/// same lines for the same writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_get_prints_the_same_tables_through_the_proxy() {
    let ns = "e2e-kget";
    let env = env(ns).await;
    let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(env.admin.clone(), ns);
    let pod = |name: &str, containers: usize| -> k8s_openapi::api::core::v1::Pod {
        let cs: Vec<_> = (0..containers)
            .map(|i| json!({"name": format!("c{i}"), "image": "busybox"}))
            .collect();
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {"app": name}}, "spec": {"containers": cs}})).unwrap()
    };
    for (name, n) in [("one", 1), ("two", 2)] {
        pods.create(&PostParams::default(), &pod(name, n))
            .await
            .unwrap();
    }
    let svc = serde_json::from_value(json!({"metadata": {"name": "svc"}, "spec": {"selector": {"app": "one"}, "ports": [{"port": 80}]}})).unwrap();
    Api::<k8s_openapi::api::core::v1::Service>::namespaced(env.admin.clone(), ns)
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let deploy = serde_json::from_value(json!({"metadata": {"name": "d"}, "spec": {"selector": {"matchLabels": {"app": "d"}}, "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}})).unwrap();
    Api::<k8s_openapi::api::apps::v1::Deployment>::namespaced(env.admin.clone(), ns)
        .create(&PostParams::default(), &deploy)
        .await
        .unwrap();
    let (pk, dk) = (&env.proxy_kubeconfig, &env.direct_kubeconfig);
    for args in [
        &["get", "pods", "-A"][..],
        &["get", "pods", "-A", "-o", "wide"][..],
        &["get", "ns"][..],
        &["get", "all", "-A"][..],
    ] {
        let what = format!("kubectl {args:?} through the proxy prints what it prints direct");
        eventually(&what, BOUND, async || {
            let direct = kubectl(&env, dk, args);
            let via = kubectl(&env, pk, args);
            assert!(direct.0 && via.0, "{direct:?} {via:?}");
            let same = table_cells(&direct.1) == table_cells(&via.1);
            ok_if(
                same,
                format!("direct:\n{}\nvia the proxy:\n{}", direct.1, via.1),
            )
        })
        .await;
    }
    // get -w: the initial rows, then a few writes, up to a last create both must print.
    let watch =
        |kubeconfig: &PathBuf| support::e2e::kubectl_watch_pods(&env.cp.kubectl(), kubeconfig, ns);
    let watches = [watch(dk), watch(pk)];
    // The header and the two pods, on both, before the writes.
    let mut lines: Vec<Vec<String>> = watches
        .iter()
        .map(|(_, rx)| {
            (0..3)
                .map(|_| rx.recv_timeout(BOUND).expect("initial rows"))
                .collect()
        })
        .collect();
    pods.create(&PostParams::default(), &pod("three", 3))
        .await
        .unwrap();
    let p = json!({"metadata": {"labels": {"touched": "yes"}}});
    pods.patch("one", &PatchParams::default(), &Patch::Merge(&p))
        .await
        .unwrap();
    pods.delete("two", &DeleteParams::default()).await.unwrap();
    pods.create(&PostParams::default(), &pod("zz-end", 1))
        .await
        .unwrap();
    support::e2e::kubectl_watches_until(watches.into(), &mut lines, "zz-end", BOUND);
    // Rows are flushed one by one, so split on whitespace; AGE by the header's position.
    let normalise = |lines: &[String]| -> Vec<Vec<String>> {
        let age = lines[0].split_whitespace().position(|h| h == "AGE");
        lines
            .iter()
            .enumerate()
            .map(|(i, l)| {
                l.split_whitespace()
                    .enumerate()
                    .map(|(k, c)| if i > 0 && Some(k) == age { "<age>" } else { c })
                    .map(String::from)
                    .collect()
            })
            .collect()
    };
    assert_eq!(
        normalise(&lines[1]),
        normalise(&lines[0]),
        "kubectl get -w through the proxy (left) and direct (right)"
    );
    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// The opt-in field-level change filter with real client-go informers (a transport wrapper
/// adds `X-Kube-Cache-Proxy-Watch-Fields`): a ConfigMap gets annotation-only "heartbeats" and
/// a few `data` changes. The informer filtering on `data` sees every data change and none of
/// the heartbeats, holds the apiserver's final data, and its resourceVersion keeps advancing
/// through bookmarks while heartbeats are suppressed; an unfiltered informer sees every
/// event; a filtered informer whose watch the apiserver answers (protobuf, which the cache
/// does not serve) is told so and sees every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_go_informers_with_a_field_filter_see_only_changes_of_their_fields() {
    let ns = "e2e-fields";
    let env = env_with(ns, |c| {
        c.cache.filtered_bookmark_interval = Duration::from_millis(300);
    })
    .await;
    let api = Api::<ConfigMap>::namespaced(env.admin.clone(), ns);
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "target"}, "data": {"v": "0"}}))
            .unwrap();
    api.create(&PostParams::default(), &cm).await.unwrap();
    let (truth, _) = env.truth(ns).await;
    let bin = tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_client_binaries)
        .await
        .unwrap()
        .unwrap();
    let spawn = |args: &[&str]| InformerCheck::spawn(&bin, &env.proxy_kubeconfig, ns, args);
    let mut filtered = spawn(&["--accept", "json", "--watch-fields", "data"]);
    let mut unfiltered = spawn(&["--accept", "json"]);
    let mut client_accept = spawn(&["--watch-fields", "data"]);
    for ic in [&filtered, &unfiltered, &client_accept] {
        ic.next("SYNCED");
    }
    // 24 updates: a data change every 6th (the last one too), annotation-only otherwise.
    let (mut last, mut data_changes) = (0, 0);
    for i in 0..24 {
        let p = if i % 6 == 5 {
            data_changes += 1;
            json!({"data": {"v": data_changes.to_string()}})
        } else {
            json!({"metadata": {"annotations": {"heartbeat": i.to_string()}}})
        };
        last = rv(&api
            .patch("target", &PatchParams::default(), &Patch::Merge(&p))
            .await
            .unwrap());
    }
    let adds = truth.len() as u64;
    let final_data = api.get("target").await.unwrap().data.unwrap();
    let seen = filtered.wait_entries(last);
    assert_eq!(
        seen[0]["data"],
        json!(final_data),
        "the filtered informer holds the apiserver's data"
    );
    assert_eq!(filtered.counts(), (adds, data_changes, 0));
    unfiltered.wait(last);
    assert_eq!(unfiltered.counts(), (adds, 24, 0));
    // Heartbeats only: the filtered informer gets no event, and still reaches their
    // resourceVersion (bookmarks).
    for i in 0..3 {
        let p = json!({"metadata": {"annotations": {"heartbeat": format!("late-{i}")}}});
        last = rv(&api
            .patch("target", &PatchParams::default(), &Patch::Merge(&p))
            .await
            .unwrap());
    }
    assert!(filtered.wait_rv(last) >= last);
    assert_eq!(filtered.counts(), (adds, data_changes, 0));
    // With the client's own Accept: the watch's answer says whether the cache filtered it.
    client_accept.wait(last);
    let counts = client_accept.counts();
    let errs = client_accept.finish();
    let watch_accept: Vec<_> = errs
        .iter()
        .filter(|l| l.starts_with("REQUEST GET") && l.contains("watch=true"))
        .collect();
    let filter_said: Vec<_> = errs
        .iter()
        .filter_map(|l| l.strip_prefix("WATCHFILTER "))
        .collect();
    assert!(!filter_said.is_empty(), "{errs:?}");
    let protobuf = watch_accept
        .iter()
        .all(|l| l.contains("accept=application/vnd.kubernetes.protobuf"));
    if protobuf {
        assert!(filter_said.iter().all(|v| *v == "unfiltered"), "{errs:?}");
        assert_eq!(
            counts,
            (adds, 27, 0),
            "an unfiltered watch delivers every event"
        );
    } else {
        assert!(filter_said.iter().all(|v| *v == "applied"), "{errs:?}");
        assert_eq!(counts, (adds, data_changes, 0));
    }
    eprintln!(
        "field filter: filtered informer {:?}, unfiltered {:?}, client Accept (protobuf: {protobuf}) {counts:?}",
        (adds, data_changes, 0),
        (adds, 24, 0)
    );
    let errs = filtered.finish();
    assert!(
        errs.iter()
            .filter_map(|l| l.strip_prefix("WATCHFILTER "))
            .all(|v| v == "applied"),
        "{errs:?}"
    );
    // Counted by the proxy.
    let (code, text) = env.proxy.admin_get("/metrics").await;
    assert_eq!(code, 200);
    assert!(
        text.lines().any(|l| l.starts_with(
            "kube_cache_proxy_watch_field_filter_events_total{resource=\"configmaps\",result=\"suppressed\"}"
        ) && !l.ends_with(" 0")),
        "{text}"
    );
    unfiltered.finish();
    env.proxy.shutdown().await;
    env.cp.stop().await;
}
