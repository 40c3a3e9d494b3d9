//! A real kube-controller-manager and a real kube-scheduler (issue 18's "real clients"), built
//! from the pinned k8s.io/kubernetes like the apiserver, run with their kubeconfig pointed at
//! the proxy (`cache.resources: [all]`) and their own content type (protobuf), while the test
//! writes straight to the apiserver: three fake Nodes (no kubelet) and a Deployment. The
//! controller-manager must create the ReplicaSet and its Pods and the scheduler must bind
//! every Pod to a fake Node, all through the proxy.
//!
//! What the proxy serves them: client-go 1.35+ starts informers with a streaming list (a
//! WATCH with `sendInitialEvents=true`, feature gate `WatchListClient`, on by default); the
//! resources' protobuf sides start with their caches (`cache.protobufSide: eager`), and a
//! watch that comes while one syncs waits for it or is asked to retry (429), so with their
//! defaults these components LIST none of these resources. Once those
//! have synced, each component is restarted with `--feature-gates=WatchListClient=false` (the
//! LIST+WATCH start every client-go before 1.35 makes): the LISTs of pods, nodes,
//! replicasets and deployments their informers make must then come from the cache, and the
//! restarted pair must still scale the Deployment. Phase 3 restarts both with their defaults
//! again: their streaming lists (protobuf WATCHes with `sendInitialEvents=true`) of those
//! resources must now come from the cache, and the pair must scale the Deployment once more. How every LIST and WATCH of those
//! resources was served is printed per phase, from the proxy's metrics and its access log
//! (which names the component by its User-Agent).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, ServiceAccount};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions, ensure_conformance_binaries};
use kube_cache_proxy::config::LogFormat;
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::support::components::Component;
use crate::support::eventually::{eventually, ok_if, poll_within};
use crate::support::proxy::{TestProxy, client_cert};
use crate::support::watch_validator::sum_metric;

/// Bound on each wait: the components start in a few seconds and act within a second of a
/// write; much more on two loaded cores.
const BOUND: Duration = Duration::from_secs(120);
const NS: &str = "e2e-components";
const NODES: [&str; 3] = ["fake-node-1", "fake-node-2", "fake-node-3"];
/// The resources whose LISTs must come from the cache, with their group and version.
const RESOURCES: [(&str, &str, &str); 4] = [
    ("", "v1", "pods"),
    ("", "v1", "nodes"),
    ("apps", "v1", "replicasets"),
    ("apps", "v1", "deployments"),
];
/// client-go's streaming lists off: the components take client-go's gates in their own
/// `--feature-gates`.
const NO_WATCH_LIST: (&str, &str) = ("feature-gates", "WatchListClient=false");

#[tokio::test]
async fn controller_manager_and_scheduler_behind_the_proxy_run_a_deployment() {
    // The proxy runs on this test's (current-thread) runtime, so a thread-local subscriber
    // sees its access log and warnings, and no other test's.
    let (logs, _guard) = Captured::install();
    let bin = tokio::task::spawn_blocking(ensure_conformance_binaries)
        .await
        .unwrap()
        .expect("building kube-controller-manager and kube-scheduler");
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let admin = cp.admin_client().await.unwrap();
    let upstream = crate::clients::kube_config(&cp.admin_kubeconfig_yaml()).await;
    let proxy = TestProxy::start_with_kube(upstream, |c| {
        c.cache.resources = vec!["all".into()];
    })
    .await;
    eventually("the proxy's caches to sync", BOUND, async || {
        let (code, body) = proxy.admin_get("/readyz").await;
        ok_if(code == 200, body)
    })
    .await;
    register_nodes(&admin, &NODES).await;
    Api::<Namespace>::all(admin.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": NS}})).unwrap(),
        )
        .await
        .unwrap();

    let dir = out_dir();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // kube-controller-manager authenticates with the admin's bearer token, which the proxy
    // forwards (the harness's ControlPlane gives it the same; with that identity it needs no
    // `--use-service-account-credentials`). kube-scheduler has its own identity: a client
    // certificate for `system:kube-scheduler` from the proxy's client CA, which the proxy
    // verifies and impersonates, so the apiserver authorizes it by the bootstrap
    // ClusterRoleBindings `system:kube-scheduler` and `system:volume-scheduler`.
    let kcm_kubeconfig = dir.join("kube-controller-manager.kubeconfig");
    std::fs::write(&kcm_kubeconfig, proxy.kubeconfig_yaml(cp.admin_token())).unwrap();
    let (cert, key) = client_cert(&proxy.client_ca, "system:kube-scheduler", &[]);
    let sched_kubeconfig = dir.join("kube-scheduler.kubeconfig");
    std::fs::write(
        &sched_kubeconfig,
        ControlPlane::kubeconfig_yaml(
            &proxy.https(""),
            Some(&proxy.ca_pem),
            None,
            Some((&cert, &key)),
        ),
    )
    .unwrap();
    let mut kcm = Component::controller_manager(&bin, &cp, &kcm_kubeconfig, &dir);
    let mut sched = Component::scheduler(&bin, &sched_kubeconfig, &dir);
    kcm.start();
    sched.start();

    // Phase 1: the components as they come. kube-controller-manager's ServiceAccount
    // controller provisions the namespace's `default` ServiceAccount (pods need it).
    let sas: Api<ServiceAccount> = Api::namespaced(admin.clone(), NS);
    eventually(
        "the namespace's default ServiceAccount",
        BOUND,
        async || {
            live(&mut kcm);
            live(&mut sched);
            sas.get_opt("default")
                .await
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "not yet".to_string())
        },
    )
    .await;
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), NS);
    deployments
        .create(&PostParams::default(), &deployment("web", 3))
        .await
        .unwrap();
    let rs = wait_scheduled(&admin, &mut kcm, &mut sched, 3).await;
    println!(
        "phase 1 (default components: streaming lists): ReplicaSet {rs} and 3 Pods, each bound \
         to a fake Node"
    );
    let metrics_1 = metrics(&proxy).await;
    report("phase 1", &metrics_1, &logs.requests());
    // Their informers watched through the proxy (the test's own requests go straight to the
    // apiserver, so whatever the proxy served is theirs).
    for (_, _, r) in RESOURCES {
        let watches =
            served(&metrics_1, "WATCH", r, "cache") + served(&metrics_1, "WATCH", r, "upstream");
        assert!(
            watches > 0,
            "no {r} WATCH through the proxy in phase 1:\n{metrics_1}"
        );
    }

    // The protobuf sides their protobuf requests started have synced, with every object's
    // envelope: a protobuf LIST from now on is the cache's.
    eventually("the protobuf sides to sync", BOUND, async || {
        let sides: Vec<_> = RESOURCES
            .iter()
            .map(|(g, v, r)| {
                let c = proxy.cache(g, v, r);
                let (with, without) = c.as_ref().map_or((0, 0), |c| {
                    let (with, without, _) = c.protobuf_coverage();
                    (with, without)
                });
                let ready = c.is_some_and(|c| c.protobuf_ready());
                (*r, ready, with, without)
            })
            .collect();
        let synced = sides
            .iter()
            .all(|(_, ready, with, without)| *ready && *with > 0 && *without == 0);
        ok_if(synced, sides)
    })
    .await;

    // Phase 2: each component restarted with the LIST+WATCH start; its informers' LISTs
    // must come from the cache. The scheduler first, then the controller-manager. The
    // workload is settled (every Pod bound, nothing runs them) and the controller-manager,
    // the only writer, writes nothing before its informers have synced, so every object
    // keeps its envelope until those LISTs.
    sched.set_flag(NO_WATCH_LIST.0, NO_WATCH_LIST.1);
    let mark = logs.requests().len();
    sched.restart().await;
    let sched_lists = wait_lists(
        &logs,
        mark,
        &mut sched,
        "kube-scheduler",
        &["pods", "nodes"],
    )
    .await;
    kcm.set_flag(NO_WATCH_LIST.0, NO_WATCH_LIST.1);
    let mark = logs.requests().len();
    kcm.restart().await;
    let kcm_lists = wait_lists(
        &logs,
        mark,
        &mut kcm,
        "kube-controller-manager",
        &["pods", "nodes", "replicasets", "deployments"],
    )
    .await;
    // The restarted pair still works: one more replica is created and bound.
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 4}})),
        )
        .await
        .unwrap();
    wait_scheduled(&admin, &mut kcm, &mut sched, 4).await;
    println!("phase 2 (restarted, LIST+WATCH): the Deployment scaled to 4, each Pod bound");
    let metrics_2 = metrics(&proxy).await;

    // Phase 3: both restarted with their defaults again (streaming lists, protobuf). The
    // protobuf sides have synced, so their informers' streaming lists (protobuf WATCHes with
    // `sendInitialEvents=true`) now come from the cache. A watch's access-log line is
    // written when it ends: the components are stopped before they are read.
    let mark = logs.requests().len();
    sched.unset_flag(NO_WATCH_LIST.0);
    sched.restart().await;
    kcm.unset_flag(NO_WATCH_LIST.0);
    kcm.restart().await;
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 5}})),
        )
        .await
        .unwrap();
    wait_scheduled(&admin, &mut kcm, &mut sched, 5).await;
    println!(
        "phase 3 (restarted with defaults, streaming lists): the Deployment scaled to 5, each Pod bound"
    );

    // Stopped, their watches end and get their access-log lines.
    kcm.stop().await;
    sched.stop().await;
    let open = poll_within(BOUND, async || {
        let open = sum_metric(
            &metrics(&proxy).await,
            "kube_cache_proxy_inflight_requests",
            &["kind=\"watch\""],
        );
        ok_if(open == 0.0, open)
    })
    .await;
    if let Err(open) = open {
        println!("{open} watches still open at the proxy after both components stopped");
    }
    report("phases 1 and 2", &metrics_2, &logs.requests());
    let streaming: Vec<Request> = logs.requests()[mark..]
        .iter()
        .filter(|r| {
            r.verb == "WATCH"
                && r.path.contains("sendInitialEvents=true")
                && ["kube-scheduler", "kube-controller-manager"].contains(&r.component())
                && RESOURCES.iter().any(|(_, _, res)| r.resource == *res)
        })
        .cloned()
        .collect();
    let errors = component_errors(&dir);
    println!("component log lines at error level (E...), deduplicated:\n{errors}");
    let warnings = logs.warnings();
    println!(
        "proxy warnings and errors ({}):\n{}",
        warnings.len(),
        warnings.join("\n")
    );
    println!("component logs: {}", dir.display());
    proxy.shutdown().await;
    cp.stop().await;

    // The restarted components' informer LISTs: every one from the cache.
    for (who, lists) in [
        ("kube-scheduler", &sched_lists),
        ("kube-controller-manager", &kcm_lists),
    ] {
        let upstream: Vec<_> = lists.iter().filter(|r| r.served_by != "cache").collect();
        assert!(
            upstream.is_empty(),
            "{who}'s informer LISTs after the protobuf sides synced, not from the cache: \
             {upstream:#?}"
        );
    }
    // The scheduler read as itself: its client certificate's user, impersonated.
    for r in &sched_lists {
        assert_eq!(r.user, "system:kube-scheduler", "{r:?}");
    }
    // Phase 3: the restarted components' streaming lists of every resource came from the
    // cache (a start that found an envelope missing, within its 2 s wait, would have been
    // the apiserver's: printed, not failed).
    let upstream: Vec<_> = streaming
        .iter()
        .filter(|r| r.served_by != "cache")
        .collect();
    println!(
        "phase 3: {} streaming-list WATCHes of {:?}, {} not from the cache: {upstream:#?}",
        streaming.len(),
        RESOURCES.map(|(_, _, r)| r),
        upstream.len()
    );
    for (_, _, res) in RESOURCES {
        assert!(
            streaming
                .iter()
                .any(|r| r.resource == res && r.served_by == "cache"),
            "no streaming list of {res} from the cache after the restart with defaults: {streaming:#?}"
        );
    }
    // And the metrics agree: phase 2 added LISTs served by the cache for each resource.
    for (_, _, r) in RESOURCES {
        let before = served(&metrics_1, "LIST", r, "cache");
        let after = served(&metrics_2, "LIST", r, "cache");
        assert!(
            after > before,
            "no {r} LIST served by the cache in phase 2 ({before} before, {after} after)"
        );
    }
}

/// Panics with the exit status and log tail if `c` has exited.
fn live(c: &mut Component) {
    if let Err(e) = c.alive() {
        panic!("{e}");
    }
}

/// Creates fake Nodes named `names` at the apiserver, each `Ready` (through the status
/// subresource, as a kubelet posts it) with room for pods and no taint of its own; a few at a
/// time. The apiserver's `TaintNodesByCondition` admission gives each new Node the
/// `not-ready:NoSchedule` taint; kube-controller-manager's node lifecycle controller removes
/// it once it sees the `Ready` condition, as in a cluster.
pub(crate) async fn register_nodes(admin: &kube::Client, names: &[impl AsRef<str> + Sync]) {
    /// Writes in flight: enough to overlap round trips, few enough for two shared cores.
    const CONCURRENT: usize = 8;
    let nodes: Api<Node> = Api::all(admin.clone());
    let now = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let room = json!({"cpu": "4", "memory": "8Gi", "pods": "110"});
    futures_util::stream::iter(names.iter().map(AsRef::as_ref))
        .for_each_concurrent(CONCURRENT, |name| {
            let (nodes, now, room) = (&nodes, &now, &room);
            async move {
                let node: Node = serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": {
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                    }},
                }))
                .unwrap();
                nodes.create(&PostParams::default(), &node).await.unwrap();
                let status = json!({"status": {
                    "capacity": room,
                    "allocatable": room,
                    "conditions": [{
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "a fake Node: no kubelet behind it",
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }],
                }});
                nodes
                    .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
                    .await
                    .unwrap();
            }
        })
        .await;
}

fn deployment(name: &str, replicas: i32) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "pause",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                }]},
            },
        },
    }))
    .unwrap()
}

/// Waits until the Deployment `web` has one ReplicaSet owning `replicas` Pods, each bound to
/// one of the fake Nodes, all seen at the apiserver; returns the ReplicaSet's name.
async fn wait_scheduled(
    admin: &kube::Client,
    kcm: &mut Component,
    sched: &mut Component,
    replicas: usize,
) -> String {
    let rss: Api<ReplicaSet> = Api::namespaced(admin.clone(), NS);
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let nodes: Api<Node> = Api::all(admin.clone());
    let what = format!("{replicas} Pods of Deployment web, each bound to a fake Node");
    eventually(&what, BOUND, async || {
        live(kcm);
        live(sched);
        let lp = ListParams::default().labels("app=web");
        let rs: Vec<String> = rss
            .list(&lp)
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .filter_map(|r| r.metadata.name)
            .collect();
        let pods: Vec<(String, Option<String>, Option<String>)> = pods
            .list(&lp)
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| {
                let owner = p
                    .metadata
                    .owner_references
                    .unwrap_or_default()
                    .into_iter()
                    .find(|o| o.kind == "ReplicaSet")
                    .map(|o| o.name);
                (
                    p.metadata.name.unwrap_or_default(),
                    owner,
                    p.spec.and_then(|s| s.node_name),
                )
            })
            .collect();
        let done = rs.len() == 1
            && pods.len() == replicas
            && pods.iter().all(|(_, owner, node)| {
                owner.as_ref() == rs.first() && node.as_deref().is_some_and(|n| NODES.contains(&n))
            });
        if done {
            return Ok(rs[0].clone());
        }
        // What the scheduler saw of the Nodes, when it binds nothing.
        let taints: Vec<_> = nodes
            .list(&ListParams::default())
            .await
            .map_err(|e| e.to_string())?
            .items
            .into_iter()
            .map(|n| {
                let t: Vec<String> = n
                    .spec
                    .and_then(|s| s.taints)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|t| format!("{}:{}", t.key, t.effect))
                    .collect();
                (n.metadata.name.unwrap_or_default(), t)
            })
            .collect();
        Err(format!(
            "replicasets {rs:?}; pods (name, owner, node) {pods:?}; node taints {taints:?}"
        ))
    })
    .await
}

/// Waits until, among the requests after the `mark`-th, `component` has LISTed each of
/// `resources` with its informers' client (`shared-informers` for kube-controller-manager;
/// its metadata informers' LISTs ask for PartialObjectMetadata, which the proxy passes
/// through); returns those LISTs.
async fn wait_lists(
    logs: &Captured,
    mark: usize,
    c: &mut Component,
    component: &str,
    resources: &[&str],
) -> Vec<Request> {
    let what = format!("{component}'s informer LISTs of {resources:?}");
    eventually(&what, BOUND, async || {
        live(c);
        let lists: Vec<Request> = logs.requests()[mark..]
            .iter()
            .filter(|r| {
                r.component() == component
                    && r.verb == "LIST"
                    && resources.contains(&r.resource.as_str())
                    && (component != "kube-controller-manager" || r.client() == "shared-informers")
            })
            .cloned()
            .collect();
        let all = resources
            .iter()
            .all(|res| lists.iter().any(|r| r.resource == *res));
        ok_if(all, lists)
    })
    .await
}

async fn metrics(proxy: &TestProxy) -> String {
    let (code, body) = proxy.admin_get("/metrics").await;
    assert_eq!(code, 200, "{body}");
    body
}

/// Requests of `verb` for `resource` (every resource: `""`) served by `by` (`cache` or
/// `upstream`), from the proxy's `kube_cache_proxy_requests_total`.
fn served(metrics: &str, verb: &str, resource: &str, by: &str) -> u64 {
    let verb = format!("verb=\"{verb}\"");
    let by = format!("served_by=\"{by}\"");
    let resource = format!("resource=\"{resource}\"");
    let mut needles = vec![verb.as_str(), by.as_str()];
    if resource != "resource=\"\"" {
        needles.push(&resource);
    }
    sum_metric(metrics, "kube_cache_proxy_requests_total", &needles) as u64
}

/// Prints, for the watched resources, LISTs and WATCHes by who served them: from the
/// metrics, and per component and client from the access log (a WATCH's line is written
/// when it ends, so open watches are in the metrics only).
fn report(phase: &str, metrics: &str, requests: &[Request]) {
    println!(
        "{phase}: requests through the proxy (metrics: LIST cache/upstream, WATCH cache/upstream)"
    );
    for (_, _, r) in RESOURCES {
        println!(
            "  {r:<12} LIST {}/{}  WATCH {}/{}",
            served(metrics, "LIST", r, "cache"),
            served(metrics, "LIST", r, "upstream"),
            served(metrics, "WATCH", r, "cache"),
            served(metrics, "WATCH", r, "upstream"),
        );
    }
    let mut rows: BTreeMap<(String, String, String, String, String), usize> = BTreeMap::new();
    for r in requests {
        if (r.verb == "LIST" || r.verb == "WATCH")
            && RESOURCES.iter().any(|(_, _, res)| *res == r.resource)
        {
            let key = (
                r.component().into(),
                r.client().into(),
                r.resource.clone(),
                r.verb.clone(),
                r.served_by.clone(),
            );
            *rows.entry(key).or_default() += 1;
        }
    }
    println!(
        "{phase}: access log, {} lines (component, client, resource, verb, served by: count)",
        requests.len()
    );
    for ((component, client, resource, verb, by), n) in rows {
        println!("  {component} {client} {resource} {verb} {by}: {n}");
    }
    println!(
        "{phase}: all resources: LIST {}/{}  WATCH {}/{}",
        served(metrics, "LIST", "", "cache"),
        served(metrics, "LIST", "", "upstream"),
        served(metrics, "WATCH", "", "cache"),
        served(metrics, "WATCH", "", "upstream"),
    );
    println!(
        "{phase}: ended WATCHes of these resources (component, client, served by, code, path)"
    );
    for r in requests
        .iter()
        .filter(|r| r.verb == "WATCH" && RESOURCES.iter().any(|(_, _, res)| *res == r.resource))
    {
        println!(
            "  {} {} {} {} {}",
            r.component(),
            r.client(),
            r.served_by,
            r.code,
            r.path
        );
    }
    println!(
        "{phase}: LISTs of any resource the apiserver answered (component, client, user, code, path)"
    );
    for r in requests
        .iter()
        .filter(|r| r.verb == "LIST" && r.served_by != "cache")
    {
        println!(
            "  {} {} {} {} {}",
            r.component(),
            r.client(),
            r.user,
            r.code,
            r.path
        );
    }
}

/// Each component start's error lines (klog's `E` prefix), deduplicated by their text
/// after the timestamp and source location.
fn component_errors(dir: &std::path::Path) -> String {
    let mut out = String::new();
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap_or_default();
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        for l in text.lines().filter(|l| {
            l.len() > 5 && l.starts_with('E') && l[1..5].bytes().all(|b| b.is_ascii_digit())
        }) {
            let msg = l.split_once("] ").map_or(l, |(_, m)| m);
            *seen.entry(msg.chars().take(400).collect()).or_default() += 1;
        }
        out.push_str(&format!(
            "  {} ({} distinct):\n",
            f.file_name().unwrap().to_string_lossy(),
            seen.len()
        ));
        for (m, n) in seen {
            out.push_str(&format!("    {n}x {m}\n"));
        }
    }
    out
}

fn out_dir() -> std::path::PathBuf {
    let tmp = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("components")
}

/// One access-log line of the proxy.
#[derive(Debug, Clone)]
struct Request {
    user_agent: String,
    user: String,
    verb: String,
    resource: String,
    path: String,
    code: u64,
    served_by: String,
}

impl Request {
    /// The program, from the User-Agent client-go sends (`kube-scheduler/v1.36.3 (linux/amd64)
    /// kubernetes/<commit>[/<client>]`).
    fn component(&self) -> &str {
        self.user_agent.split('/').next().unwrap_or_default()
    }

    /// The client within the program: kube-controller-manager names each controller's
    /// client, and its informer factories', at the end of the User-Agent.
    fn client(&self) -> &str {
        self.user_agent
            .split_once(") kubernetes/")
            .and_then(|(_, rest)| rest.split_once('/'))
            .map_or("-", |(_, client)| client)
    }
}

/// The proxy's log (its warnings and access log, as JSON lines) captured in memory for the
/// current thread, parsed as it grows.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Log>>);

#[derive(Default)]
struct Log {
    /// Written and not parsed yet (at most a partial line after a parse).
    unparsed: Vec<u8>,
    requests: Vec<Request>,
    warnings: Vec<String>,
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unparsed.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Captured {
    fn install() -> (Captured, tracing::subscriber::DefaultGuard) {
        let c = Captured::default();
        let sub = kube_cache_proxy::app::cli::subscriber(
            "warn,kube_cache_proxy::access=info",
            LogFormat::Json,
            false,
            c.clone(),
        );
        (c, tracing::subscriber::set_default(sub))
    }

    /// Parses the complete lines written since the last call.
    fn parse_locked(log: &mut Log) {
        let Some(end) = log.unparsed.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        let done: Vec<u8> = log.unparsed.drain(..=end).collect();
        let s = |v: &Value| v.as_str().unwrap_or_default().to_string();
        for l in String::from_utf8_lossy(&done).lines() {
            let Ok(v) = serde_json::from_str::<Value>(l) else {
                log.warnings.push(l.to_string());
                continue;
            };
            if v["target"] != "kube_cache_proxy::access" {
                log.warnings.push(l.to_string());
                continue;
            }
            log.requests.push(Request {
                user_agent: s(&v["user_agent"]),
                user: s(&v["user"]),
                verb: s(&v["verb"]),
                resource: s(&v["resource"]),
                path: s(&v["path"]),
                code: v["code"].as_u64().unwrap_or_default(),
                served_by: s(&v["served_by"]),
            });
        }
    }

    /// The access log so far, in the order the requests ended.
    fn requests(&self) -> Vec<Request> {
        let mut log = self.0.lock();
        Self::parse_locked(&mut log);
        log.requests.clone()
    }

    /// The proxy's warnings and errors (not those of the test's own clients).
    fn warnings(&self) -> Vec<String> {
        let mut log = self.0.lock();
        Self::parse_locked(&mut log);
        log.warnings
            .iter()
            .filter(|l| l.contains("\"target\":\"kube_cache_proxy"))
            .cloned()
            .collect()
    }
}
