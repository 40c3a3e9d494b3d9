//! Local RBAC against the real apiserver (issue 53): generated RBAC policies (Roles,
//! ClusterRoles, RoleBindings, ClusterRoleBindings; users, groups, ServiceAccounts with and
//! without a namespace; wildcards, subresources, `*/subresource`, resourceNames,
//! nonResourceURLs exact and `prefix*`; bindings to missing roles and to a Role from the
//! cluster scope) and generated questions. For every question the proxy's RBAC evaluation
//! ([`Policy::allows`], over the objects as the apiserver lists them, the bootstrap policy
//! included) must give what the apiserver's `SubjectAccessReview` gives: the same allow, and
//! no allow where it has none. The policy then changes (bindings deleted, roles rewritten,
//! new bindings) and the questions are asked again. A fixed seed; `KCP_RBAC_SEED` and
//! `KCP_RBAC_CASES` run others and more.
//!
//! A second test runs the proxy in front of the same kind of apiserver: local RBAC is
//! confirmed by its probe, a ServiceAccount's reads of many objects by name cost no review,
//! a deleted binding revokes at the next read, as direct.

use std::sync::Arc;
use std::time::Duration;

use futures_util::{StreamExt, stream};
use http::{Method, Request, StatusCode};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::auth::authz::Attributes;
use kube_cache_proxy::auth::rbac::{BindingObject, Policy, PolicyObjects, RoleObject};
use kube_cache_proxy::config::LocalRbacMode;
use serde_json::{Value, json};

use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::{TestClient, TestProxy, body_string};
use crate::support::watch_validator::sum_metric;

const NAMESPACES: [&str; 3] = ["lr-a", "lr-b", "lr-c"];
const USERS: [&str; 4] = ["u0", "u1", "u2", "u3"];
const GROUPS: [&str; 3] = ["g0", "g1", "g2"];
const SERVICE_ACCOUNTS: [&str; 2] = ["sa0", "sa1"];
const VERBS: [&str; 6] = ["get", "list", "watch", "create", "delete", "*"];
const GROUPS_API: [&str; 4] = ["", "apps", "batch", "*"];
const RESOURCES: [&str; 9] = [
    "pods",
    "pods/log",
    "pods/status",
    "configmaps",
    "secrets",
    "deployments",
    "deployments/scale",
    "*",
    "*/status",
];
const NAMES: [&str; 3] = ["a", "b", "c"];
const URLS: [&str; 6] = [
    "/healthz",
    "/metrics",
    "/api/*",
    "/apis/apps*",
    "*",
    "/logs/",
];
const PATHS: [&str; 7] = [
    "/healthz",
    "/metrics",
    "/api/v1",
    "/api",
    "/apis/apps/v1",
    "/logs/",
    "/version",
];

/// splitmix64: a small deterministic generator (the cases must be the same on every run of
/// a seed).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub(crate) fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn some<'a>(&mut self, xs: &[&'a str], max: usize) -> Vec<&'a str> {
        let n = 1 + self.below(max);
        let mut v: Vec<&str> = (0..n).map(|_| self.pick(xs)).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

pub(crate) fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn rule(rng: &mut Rng, cluster: bool) -> Value {
    if cluster && rng.chance(20) {
        return json!({"verbs": rng.some(&["get", "post", "*"], 2), "nonResourceURLs": rng.some(&URLS, 2)});
    }
    let mut r = json!({
        "verbs": rng.some(&VERBS, 3),
        "apiGroups": rng.some(&GROUPS_API, 2),
        "resources": rng.some(&RESOURCES, 3),
    });
    if rng.chance(25) {
        r["resourceNames"] = json!(rng.some(&NAMES, 2));
    }
    r
}

fn rules(rng: &mut Rng, cluster: bool) -> Value {
    let n = 1 + rng.below(3);
    Value::Array((0..n).map(|_| rule(rng, cluster)).collect())
}

fn subject(rng: &mut Rng) -> Value {
    match rng.below(4) {
        0 | 1 => {
            json!({"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": rng.pick(&USERS)})
        }
        2 => {
            json!({"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": rng.pick(&GROUPS)})
        }
        _ => {
            json!({"kind": "ServiceAccount", "name": rng.pick(&SERVICE_ACCOUNTS), "namespace": rng.pick(&NAMESPACES)})
        }
    }
}

/// `(path, body)` of every object of one generated policy, named with `tag` so a second
/// generation adds to the first.
fn policy_objects(rng: &mut Rng, tag: &str) -> Vec<(String, Value)> {
    let rbac = "/apis/rbac.authorization.k8s.io/v1";
    let mut out = Vec::new();
    for i in 0..6 {
        out.push((
            format!("{rbac}/clusterroles"),
            json!({"metadata": {"name": format!("lr-{tag}-cr{i}")}, "rules": rules(rng, true)}),
        ));
    }
    for ns in NAMESPACES {
        for i in 0..3 {
            out.push((
                format!("{rbac}/namespaces/{ns}/roles"),
                json!({"metadata": {"name": format!("lr-{tag}-r{i}")}, "rules": rules(rng, false)}),
            ));
        }
        for i in 0..5 {
            // Roles of this namespace, ClusterRoles, and missing ones of both kinds.
            let (kind, name) = match rng.below(5) {
                0 | 1 => ("Role", format!("lr-{tag}-r{}", rng.below(4))),
                2 | 3 => ("ClusterRole", format!("lr-{tag}-cr{}", rng.below(7))),
                _ => ("ClusterRole", "lr-missing".to_string()),
            };
            let mut subjects: Vec<Value> = (0..1 + rng.below(3)).map(|_| subject(rng)).collect();
            if rng.chance(30) {
                // A ServiceAccount without namespace: the binding's.
                subjects
                    .push(json!({"kind": "ServiceAccount", "name": rng.pick(&SERVICE_ACCOUNTS)}));
            }
            out.push((
                format!("{rbac}/namespaces/{ns}/rolebindings"),
                json!({"metadata": {"name": format!("lr-{tag}-rb{i}")},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
                    "subjects": subjects}),
            ));
        }
    }
    for i in 0..4 {
        let name = if rng.chance(20) {
            "lr-missing".to_string()
        } else {
            format!("lr-{tag}-cr{}", rng.below(6))
        };
        let subjects: Vec<Value> = (0..1 + rng.below(2)).map(|_| subject(rng)).collect();
        out.push((
            format!("{rbac}/clusterrolebindings"),
            json!({"metadata": {"name": format!("lr-{tag}-crb{i}")},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": subjects}),
        ));
    }
    out
}

/// A generated caller: a user or a ServiceAccount, with some groups.
fn caller(rng: &mut Rng) -> (String, Vec<String>) {
    let mut groups: Vec<String> = Vec::new();
    let user = if rng.chance(40) {
        let ns = rng.pick(&NAMESPACES);
        groups.push("system:serviceaccounts".into());
        groups.push(format!("system:serviceaccounts:{ns}"));
        format!("system:serviceaccount:{ns}:{}", rng.pick(&SERVICE_ACCOUNTS))
    } else {
        rng.pick(&USERS).to_string()
    };
    for g in GROUPS {
        if rng.chance(30) {
            groups.push(g.into());
        }
    }
    if rng.chance(50) {
        groups.push("system:authenticated".into());
    }
    (user, groups)
}

fn question(rng: &mut Rng) -> Attributes {
    if rng.chance(15) {
        return Attributes {
            verb: rng.pick(&["get", "post", "put"]).into(),
            path: rng.pick(&PATHS).into(),
            ..Default::default()
        };
    }
    let resource = rng.pick(&[
        "pods",
        "pods/log",
        "pods/status",
        "configmaps",
        "secrets",
        "deployments",
        "deployments/scale",
        "deployments/status",
        "jobs",
        "roles",
    ]);
    let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
    let group = match resource {
        "deployments" => "apps",
        "jobs" => "batch",
        "roles" => "rbac.authorization.k8s.io",
        _ => "",
    };
    let namespace = if rng.chance(20) {
        ""
    } else {
        rng.pick(&NAMESPACES)
    };
    let verb = rng.pick(&["get", "list", "watch", "create", "delete", "patch"]);
    let name = if verb == "create" || (matches!(verb, "list" | "watch") && rng.chance(70)) {
        ""
    } else {
        rng.pick(&["a", "b", "c", "d"])
    };
    Attributes {
        verb: verb.into(),
        group: group.into(),
        version: "v1".into(),
        resource: resource.into(),
        subresource: subresource.into(),
        namespace: namespace.into(),
        name: name.into(),
        ..Default::default()
    }
}

pub(crate) async fn call(
    client: &kube::Client,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Value {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(body.map(|b| b.to_string().into_bytes()).unwrap_or_default())
        .unwrap();
    client
        .request::<Value>(req)
        .await
        .unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The apiserver's RBAC objects now, as the proxy's policy is built from them.
async fn current_policy(client: &kube::Client) -> Policy {
    let rbac = "/apis/rbac.authorization.k8s.io/v1";
    let items = async |r: &str| -> Vec<Value> {
        let v = call(client, Method::GET, &format!("{rbac}/{r}"), None).await;
        v["items"].as_array().cloned().unwrap_or_default()
    };
    let (roles, cluster_roles, role_bindings, cluster_role_bindings) = (
        items("roles").await,
        items("clusterroles").await,
        items("rolebindings").await,
        items("clusterrolebindings").await,
    );
    let meta = |o: &Value| {
        (
            o["metadata"]["namespace"]
                .as_str()
                .unwrap_or("")
                .to_string(),
            o["metadata"]["name"].as_str().unwrap().to_string(),
        )
    };
    let role = |o: &Value| Arc::new(serde_json::from_value::<RoleObject>(o.clone()).unwrap());
    let binding = |o: &Value| Arc::new(serde_json::from_value::<BindingObject>(o.clone()).unwrap());
    let roles: Vec<(String, String, Arc<RoleObject>)> = roles
        .iter()
        .map(|o| {
            let (ns, n) = meta(o);
            (ns, n, role(o))
        })
        .collect();
    let cluster_roles: Vec<(String, Arc<RoleObject>)> =
        cluster_roles.iter().map(|o| (meta(o).1, role(o))).collect();
    let role_bindings: Vec<(String, Arc<BindingObject>)> = role_bindings
        .iter()
        .map(|o| (meta(o).0, binding(o)))
        .collect();
    Policy::new(PolicyObjects {
        roles: roles
            .iter()
            .map(|(ns, n, r)| (ns.as_str(), n.as_str(), r.clone()))
            .collect(),
        cluster_roles: cluster_roles
            .iter()
            .map(|(n, r)| (n.as_str(), r.clone()))
            .collect(),
        role_bindings: role_bindings
            .iter()
            .map(|(ns, b)| (ns.as_str(), b.clone()))
            .collect(),
        cluster_role_bindings: cluster_role_bindings.iter().map(binding).collect(),
    })
}

/// The apiserver's SubjectAccessReview answer.
async fn review(client: &kube::Client, user: &str, groups: &[String], a: &Attributes) -> bool {
    let mut spec = json!({"user": user, "groups": groups});
    if a.path.is_empty() {
        spec["resourceAttributes"] = json!({"verb": a.verb, "group": a.group, "version": a.version,
            "resource": a.resource, "subresource": a.subresource, "namespace": a.namespace, "name": a.name});
    } else {
        spec["nonResourceAttributes"] = json!({"verb": a.verb, "path": a.path});
    }
    let body = json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec});
    let v = call(
        client,
        Method::POST,
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        Some(&body),
    )
    .await;
    v["status"]["allowed"].as_bool().unwrap_or(false)
}

/// Asks `cases` generated questions of the apiserver and of `policy`; the mismatches.
async fn compare(
    client: &kube::Client,
    policy: &Policy,
    rng: &mut Rng,
    cases: usize,
) -> (Vec<String>, usize) {
    let questions: Vec<(String, Vec<String>, Attributes)> = (0..cases)
        .map(|_| {
            let (u, g) = caller(rng);
            (u, g, question(rng))
        })
        .collect();
    let answers: Vec<bool> = stream::iter(questions.iter())
        .map(|(u, g, a)| review(client, u, g, a))
        .buffered(16)
        .collect()
        .await;
    let mut mismatches = Vec::new();
    let mut allowed = 0;
    for ((u, g, a), apiserver) in questions.iter().zip(answers) {
        let local = policy.allows(u, g, a);
        allowed += usize::from(apiserver);
        if local != apiserver {
            mismatches.push(format!(
                "{u} {g:?} {a:?}: apiserver {apiserver}, local {local}"
            ));
        }
    }
    (mismatches, allowed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_rbac_decides_every_generated_question_as_the_apiserver() {
    let seed = env_u64("KCP_RBAC_SEED", 53);
    let cases = env_u64("KCP_RBAC_CASES", 6000) as usize;
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let admin = cp.admin_client().await.unwrap();
    for ns in NAMESPACES {
        call(
            &admin,
            Method::POST,
            "/api/v1/namespaces",
            Some(&json!({"metadata": {"name": ns}})),
        )
        .await;
    }
    let mut rng = Rng(seed);
    let first = policy_objects(&mut rng, "one");
    for (path, body) in &first {
        call(&admin, Method::POST, path, Some(body)).await;
    }
    // The apiserver's RBAC authorizer reads through its informers: wait until it sees the
    // last object created (a binding it must now honour, asked until allowed or bounded).
    let settle = async |policy: &Policy, rng: &mut Rng| {
        let probe: Vec<(String, Vec<String>, Attributes)> = (0..2000)
            .map(|_| {
                let (u, g) = caller(rng);
                (u, g, question(rng))
            })
            .filter(|(u, g, a)| policy.allows(u, g, a))
            .take(20)
            .collect();
        eventually(
            "the apiserver's authorizer to see the policy",
            Duration::from_secs(60),
            async || {
                let mut pending = 0;
                for (u, g, a) in &probe {
                    if !review(&admin, u, g, a).await {
                        pending += 1;
                    }
                }
                ok_if(
                    pending == 0,
                    format!("{pending} of {} not allowed yet", probe.len()),
                )
            },
        )
        .await;
    };
    let policy = current_policy(&admin).await;
    settle(&policy, &mut Rng(seed ^ 1)).await;
    let (mismatches, allowed) = compare(&admin, &policy, &mut rng, cases).await;
    eprintln!(
        "seed {seed}: {cases} questions, {allowed} allowed, {} mismatches (policy of {} objects)",
        mismatches.len(),
        policy.objects()
    );
    assert!(
        mismatches.is_empty(),
        "{:#?}",
        &mismatches[..mismatches.len().min(20)]
    );
    // Both answers occur often enough for the comparison to mean something.
    assert!(
        allowed > cases / 20 && allowed < cases * 19 / 20,
        "{allowed} of {cases} allowed"
    );

    // The policy changes mid-run: half the bindings deleted, roles rewritten, new objects.
    for (path, body) in &first {
        let name = body["metadata"]["name"].as_str().unwrap();
        if path.ends_with("bindings") && rng.chance(50) {
            call(&admin, Method::DELETE, &format!("{path}/{name}"), None).await;
        } else if path.ends_with("roles") && rng.chance(50) {
            let mut b = body.clone();
            b["rules"] = rules(&mut rng, path.ends_with("clusterroles"));
            call(&admin, Method::PUT, &format!("{path}/{name}"), Some(&b)).await;
        }
    }
    for (path, body) in &policy_objects(&mut rng, "two") {
        call(&admin, Method::POST, path, Some(body)).await;
    }
    let changed = current_policy(&admin).await;
    settle(&changed, &mut Rng(seed ^ 2)).await;
    // Deletions must have reached the authorizer too: re-ask until a question the old
    // policy allowed and the new does not is refused.
    let (mismatches, allowed) = compare(&admin, &changed, &mut rng, cases).await;
    eprintln!(
        "after the change: {cases} questions, {allowed} allowed, {} mismatches",
        mismatches.len()
    );
    assert!(
        mismatches.is_empty(),
        "{:#?}",
        &mismatches[..mismatches.len().min(20)]
    );
    cp.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_authorizes_rbac_reads_locally_and_revokes_at_the_next_read() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let admin = cp.admin_client().await.unwrap();
    let ns = "lr-proxy";
    configmap_reader(&admin, ns, "ClusterRole").await;
    const OBJECTS: usize = 50;
    for i in 0..OBJECTS {
        call(
            &admin,
            Method::POST,
            &format!("/api/v1/namespaces/{ns}/configmaps"),
            Some(&json!({"metadata": {"name": format!("cm-{i}")}})),
        )
        .await;
    }
    let proxy = TestProxy::start_for(&cp, None, |_| {}).await;
    let client = proxy.client(None, true);
    let get = async |token: &str, path: &str| -> (StatusCode, String) {
        let r = TestClient::get(&client, &proxy.https(path), Some(token)).await;
        let code = r.status();
        (code, body_string(r).await)
    };
    synced(&proxy).await;
    eventually(
        "local RBAC to be confirmed",
        Duration::from_secs(120),
        async || {
            let (_, text) = proxy.admin_get("/metrics").await;
            let active = sum_metric(
                &text,
                "kube_cache_proxy_authorization_local_rbac_mode",
                &["mode=\"active\""],
            );
            ok_if(
                active == 1.0,
                text.lines()
                    .filter(|l| l.contains("local_rbac_mode"))
                    .collect::<Vec<_>>()
                    .join("\n"),
            )
        },
    )
    .await;
    // Local Node authorization's probe (one review, sent once local RBAC is active) is
    // answered before the reviews are counted.
    let state = proxy.running.as_ref().unwrap().state.clone();
    eventually(
        "local Node authorization to be confirmed",
        Duration::from_secs(120),
        async || {
            let mode = state.authz.local_node().map_or("off", |n| n.mode());
            ok_if(mode == "active", mode)
        },
    )
    .await;
    // Two tokens of the ServiceAccount (two pods' worth): reads of every object by name.
    let tokens = [
        reader_token(&admin, ns).await,
        reader_token(&admin, ns).await,
    ];
    let reviews = async || {
        let (_, text) = proxy.admin_get("/metrics").await;
        sum_metric(
            &text,
            "kube_cache_proxy_authorization_reviews_sent_total",
            &[],
        )
    };
    let before = reviews().await;
    for t in &tokens {
        for i in 0..OBJECTS {
            let (code, body) = get(t, &format!("/api/v1/namespaces/{ns}/configmaps/cm-{i}")).await;
            assert_eq!(code, StatusCode::OK, "{body}");
        }
        let (code, body) = get(t, &format!("/api/v1/namespaces/{ns}/configmaps")).await;
        assert_eq!(code, StatusCode::OK, "{body}");
    }
    let (_, text) = proxy.admin_get("/metrics").await;
    let local = sum_metric(
        &text,
        "kube_cache_proxy_authorization_decisions_by_source_total",
        &["source=\"local_rbac\""],
    );
    assert!(
        local >= (2 * (OBJECTS + 1)) as f64,
        "local decisions: {local}"
    );
    assert_eq!(reviews().await, before, "no review for reads RBAC allows");
    // Revocation: the binding deleted at the apiserver; the next reads refused as direct.
    call(
        &admin,
        Method::DELETE,
        &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/lr-cm-reader"),
        None,
    )
    .await;
    eventually(
        "the revocation at the proxy",
        Duration::from_secs(30),
        async || {
            let (code, body) = get(
                &tokens[0],
                &format!("/api/v1/namespaces/{ns}/configmaps/cm-0"),
            )
            .await;
            ok_if(code == StatusCode::FORBIDDEN, format!("{code} {body}"))
        },
    )
    .await;
    let (code, body) = get(
        &tokens[0],
        &format!("/api/v1/namespaces/{ns}/configmaps/cm-1"),
    )
    .await;
    assert_eq!(code, StatusCode::FORBIDDEN, "{body}");
    assert!(
        body.contains("cannot get resource \\\"configmaps\\\""),
        "{body}"
    );
    cp.stop().await;
}

/// Issue 53's stale refusals: a restarted kube-apiserver denies requests until its RBAC
/// informers have synced; through the proxy those denials were cached for the deny TTL and
/// clients saw 403s for half a minute after the apiserver was ready. Now: a ServiceAccount
/// reading through the proxy while the apiserver is killed and restarted never gets a 403
/// once the apiserver is ready again (counted over the reads that follow, not over time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_refusal_outlives_an_apiserver_restart() {
    restart_under_reads(LocalRbacMode::Auto).await;
}

/// The same with every question reviewed (`authorization.localRbac: off`, as for identities
/// RBAC does not allow): a denial answered just after the outage is not cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_reviewed_refusal_outlives_an_apiserver_restart() {
    restart_under_reads(LocalRbacMode::Off).await;
}

async fn restart_under_reads(mode: LocalRbacMode) {
    let mut cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let admin = cp.admin_client().await.unwrap();
    let ns = "lr-restart";
    configmap_reader(&admin, ns, "Role").await;
    call(
        &admin,
        Method::POST,
        &format!("/api/v1/namespaces/{ns}/configmaps"),
        Some(&json!({"metadata": {"name": "cm"}})),
    )
    .await;
    let token = reader_token(&admin, ns).await;
    let proxy =
        Arc::new(TestProxy::start_for(&cp, None, |c| c.authorization.local_rbac = mode).await);
    synced(&proxy).await;
    let client = Arc::new(proxy.client(None, true));
    // Each object name is a question of its own (a decision per name): while the apiserver
    // restarts, reads ask questions it has not answered before, so the proxy must ask them
    // then. `cm` exists (200); the others do not (404 once allowed).
    const NAMES: usize = 40;
    let url = |i: usize| {
        let name = if i == 0 {
            "cm".to_string()
        } else {
            format!("cm-{i}")
        };
        proxy.https(&format!(
            "/api/v1/namespaces/{ns}/configmaps/{name}?resourceVersion=0"
        ))
    };
    let urls: Arc<Vec<String>> = Arc::new((0..NAMES).map(url).collect());
    let read = {
        let (client, token) = (client.clone(), token.clone());
        move |i: usize| {
            let (client, token, path) = (client.clone(), token.clone(), urls[i % NAMES].clone());
            async move {
                let r = client.get(&path, Some(&token)).await;
                let code = r.status();
                (code, body_string(r).await)
            }
        }
    };
    let (code, body) = read(0).await;
    assert_eq!(code, StatusCode::OK, "{body}");
    // Reads all along the restart.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let during = tokio::spawn({
        let (read, stop) = (read.clone(), stop.clone());
        async move {
            let mut codes = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && codes.len() < 100_000 {
                codes.push(read(codes.len() + 1).await.0);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            codes
        }
    });
    cp.kill_and_restart_apiserver()
        .await
        .expect("the apiserver restarts");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let during = during.await.unwrap();
    // The apiserver is ready: every read from now on is allowed, as direct (each name
    // asked again several times).
    let mut after = Vec::new();
    for i in 0..4 * NAMES {
        let (code, body) = read(i).await;
        after.push(code);
        assert_ne!(
            code,
            StatusCode::FORBIDDEN,
            "a refusal after the apiserver was ready: {body}"
        );
    }
    let count = |v: &[StatusCode], c: StatusCode| v.iter().filter(|x| **x == c).count();
    eprintln!(
        "{mode:?}: during the restart: {} reads, {} 403, {} 200, {} 404; after: {} reads, {} 200, {} 404",
        during.len(),
        count(&during, StatusCode::FORBIDDEN),
        count(&during, StatusCode::OK),
        count(&during, StatusCode::NOT_FOUND),
        after.len(),
        count(&after, StatusCode::OK),
        count(&after, StatusCode::NOT_FOUND),
    );
    assert_eq!(
        count(&after, StatusCode::OK) + count(&after, StatusCode::NOT_FOUND),
        after.len(),
        "{after:?}"
    );
    drop(client);
    cp.stop().await;
}

/// Namespace `ns` with ServiceAccount `reader`, allowed to read ConfigMaps there through a
/// `role_kind` (`Role` or `ClusterRole`) named `lr-cm-reader` and a RoleBinding.
async fn configmap_reader(admin: &kube::Client, ns: &str, role_kind: &str) {
    let rbac = "/apis/rbac.authorization.k8s.io/v1";
    let role_path = match role_kind {
        "Role" => format!("{rbac}/namespaces/{ns}/roles"),
        _ => format!("{rbac}/clusterroles"),
    };
    for (path, body) in [
        (
            "/api/v1/namespaces".to_string(),
            json!({"metadata": {"name": ns}}),
        ),
        (
            format!("/api/v1/namespaces/{ns}/serviceaccounts"),
            json!({"metadata": {"name": "reader"}}),
        ),
        (
            role_path,
            json!({"metadata": {"name": "lr-cm-reader"},
            "rules": [{"verbs": ["get", "list", "watch"], "apiGroups": [""], "resources": ["configmaps"]}]}),
        ),
        (
            format!("{rbac}/namespaces/{ns}/rolebindings"),
            json!({"metadata": {"name": "lr-cm-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": "lr-cm-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader"}]}),
        ),
    ] {
        call(admin, Method::POST, &path, Some(&body)).await;
    }
}

/// A new token of ServiceAccount `reader` in `ns` (each pod gets its own).
async fn reader_token(admin: &kube::Client, ns: &str) -> String {
    let v = call(
        admin,
        Method::POST,
        &format!("/api/v1/namespaces/{ns}/serviceaccounts/reader/token"),
        Some(&json!({"spec": {}})),
    )
    .await;
    v["status"]["token"].as_str().unwrap().to_string()
}

/// Waits until the proxy's caches have synced.
async fn synced(proxy: &TestProxy) {
    eventually(
        "the proxy's caches to sync",
        Duration::from_secs(120),
        async || {
            let (code, body) = proxy.admin_get("/readyz").await;
            ok_if(code == 200, body)
        },
    )
    .await;
}
