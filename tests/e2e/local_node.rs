//! Local Node authorization against the real apiserver's Node authorizer (issue 53): pods
//! bound to generated nodes refer to Secrets and ConfigMaps in every way a pod can (volumes,
//! projected volumes, env, envFrom, image pull secrets, init containers; mirror pods, which
//! may refer to none), then generated kubelet questions are asked of the proxy's local decision
//! (`auth::local_node`, over its pods cache) and of the apiserver's `SubjectAccessReview`.
//! The local decision must never allow what the apiserver does not, and must allow every
//! question of its kinds that the apiserver allows. Half the pods are then deleted and the
//! questions asked again (revocation). A fixed seed; `KCP_NODE_SEED` and `KCP_NODE_CASES`
//! run others and more.

use std::time::Duration;

use futures_util::{StreamExt, stream};
use http::Method;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::auth::authn::Identity;
use kube_cache_proxy::auth::authz::Attributes;
use serde_json::{Value, json};

use crate::local_rbac::{Rng, call, env_u64};
use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::TestProxy;

const NAMESPACES: [&str; 2] = ["ln-a", "ln-b"];
/// n3 has no pods.
const NODES: [&str; 4] = ["n0", "n1", "n2", "n3"];
const SECRETS: [&str; 6] = ["s0", "s1", "s2", "s3", "s4", "s5"];
const CONFIGMAPS: [&str; 6] = ["c0", "c1", "c2", "c3", "c4", "c5"];
const PODS: usize = 40;

/// A pod bound to one of the first three nodes, referring to a few Secrets and ConfigMaps
/// each in one of the ways a pod can.
fn pod(rng: &mut Rng, i: usize) -> (String, String, Value) {
    let ns = rng.pick(&NAMESPACES).to_string();
    let node = NODES[rng.below(3)];
    let name = format!("p{i}");
    let mut env = Vec::new();
    let mut env_from = Vec::new();
    let mut volumes = Vec::new();
    let mut pull = Vec::new();
    let mut init_env = Vec::new();
    for _ in 0..1 + rng.below(3) {
        let s = rng.pick(&SECRETS);
        let c = rng.pick(&CONFIGMAPS);
        let v = format!("v{}", volumes.len());
        match rng.below(7) {
            0 => volumes.push(json!({"name": v, "secret": {"secretName": s}})),
            1 => volumes.push(json!({"name": v, "configMap": {"name": c}})),
            2 => volumes.push(json!({"name": v, "projected": {"sources": [
                {"secret": {"name": s}}, {"configMap": {"name": c}}]}})),
            3 => env.push(json!({"name": format!("E{}", env.len()), "valueFrom": {"secretKeyRef": {"name": s, "key": "k"}}})),
            4 => env.push(json!({"name": format!("E{}", env.len()), "valueFrom": {"configMapKeyRef": {"name": c, "key": "k"}}})),
            5 => env_from.push(if rng.chance(50) {
                json!({"secretRef": {"name": s}})
            } else {
                json!({"configMapRef": {"name": c}})
            }),
            _ => {
                if rng.chance(50) {
                    pull.push(json!({"name": s}));
                } else {
                    init_env.push(json!({"secretRef": {"name": s}}));
                }
            }
        }
    }
    let mut spec = json!({
        "nodeName": node,
        "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10", "env": env, "envFrom": env_from}],
        "volumes": volumes,
        "imagePullSecrets": pull,
    });
    if !init_env.is_empty() {
        spec["initContainers"] =
            json!([{"name": "i", "image": "registry.k8s.io/pause:3.10", "envFrom": init_env}]);
    }
    let mut meta = json!({"name": name});
    if rng.chance(10) {
        // A mirror pod: the apiserver refuses one that refers to Secrets or ConfigMaps (and
        // the Node authorizer's graph gives a mirror pod no edge but to its node).
        meta["annotations"] = json!({"kubernetes.io/config.mirror": "mirror"});
        spec = json!({"nodeName": node,
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]});
    }
    (ns, name, json!({"metadata": meta, "spec": spec}))
}

fn node_identity(node: &str) -> Identity {
    Identity {
        user: format!("system:node:{node}"),
        uid: String::new(),
        groups: vec!["system:nodes".into(), "system:authenticated".into()],
        extra: Default::default(),
        tenant: String::new(),
    }
}

/// A kubelet's question: of the kinds local Node authorization decides, and some others.
fn question(rng: &mut Rng) -> Attributes {
    let a = |verb: &str, group: &str, resource: &str, ns: &str, name: &str| Attributes {
        verb: verb.into(),
        group: group.into(),
        version: "v1".into(),
        resource: resource.into(),
        namespace: ns.into(),
        name: name.into(),
        ..Default::default()
    };
    let ns = rng.pick(&NAMESPACES);
    let verb = rng.pick(&["get", "get", "list", "watch", "update"]);
    match rng.below(6) {
        0 => a(verb, "", "secrets", ns, rng.pick(&SECRETS)),
        1 => a(verb, "", "configmaps", ns, rng.pick(&CONFIGMAPS)),
        2 => {
            let name = format!("p{}", rng.below(PODS + 5));
            a(rng.pick(&["get", "get", "update"]), "", "pods", ns, &name)
        }
        3 => Attributes {
            field_selector: match rng.below(4) {
                0 => String::new(),
                1 => format!("spec.nodeName!={}", rng.pick(&NODES)),
                _ => format!("spec.nodeName={}", rng.pick(&NODES)),
            },
            ..a(rng.pick(&["list", "watch"]), "", "pods", "", "")
        },
        4 => a(
            verb,
            "",
            "nodes",
            "",
            if rng.chance(20) { "" } else { rng.pick(&NODES) },
        ),
        _ => a(
            rng.pick(&["get", "update"]),
            "coordination.k8s.io",
            "leases",
            rng.pick(&["kube-node-lease", "default"]),
            rng.pick(&NODES),
        ),
    }
}

/// The apiserver's SubjectAccessReview answer, the field selector included.
async fn review(client: &kube::Client, id: &Identity, a: &Attributes) -> bool {
    let mut attrs = json!({"verb": a.verb, "group": a.group, "version": a.version,
        "resource": a.resource, "namespace": a.namespace, "name": a.name});
    if !a.field_selector.is_empty() {
        attrs["fieldSelector"] = json!({"rawSelector": a.field_selector});
    }
    let body = json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": id.user, "groups": id.groups, "resourceAttributes": attrs}});
    let v = call(
        client,
        Method::POST,
        "/apis/authorization.k8s.io/v1/subjectaccessreviews",
        Some(&body),
    )
    .await;
    v["status"]["allowed"].as_bool().unwrap_or(false)
}

/// Whether local Node authorization decides questions of this kind (its allows are then
/// expected to be all of the apiserver's).
fn local_kind(a: &Attributes) -> bool {
    match (a.group.as_str(), a.resource.as_str()) {
        ("", "secrets" | "configmaps") => a.verb != "update",
        ("", "pods") => a.verb != "update",
        ("", "nodes") => a.verb != "update",
        ("coordination.k8s.io", "leases") => a.verb == "get",
        _ => false,
    }
}

/// The questions' answers, local and the apiserver's: (wrong local allows, missed allows,
/// local allows).
async fn compare(
    client: &kube::Client,
    proxy: &TestProxy,
    questions: &[(Identity, Attributes)],
) -> (Vec<String>, Vec<String>, usize) {
    let apiserver: Vec<bool> = stream::iter(questions.iter())
        .map(|(id, a)| review(client, id, a))
        .buffered(16)
        .collect()
        .await;
    let state = &proxy.running.as_ref().unwrap().state;
    let local = state.authz.local_node().expect("local Node authorization");
    let (mut wrong, mut missed, mut allowed) = (Vec::new(), Vec::new(), 0);
    for ((id, a), direct) in questions.iter().zip(apiserver) {
        let here = local.allows(id, a);
        allowed += usize::from(here);
        if here && !direct {
            wrong.push(format!("{} {a:?}", id.user));
        } else if direct && !here && local_kind(a) {
            missed.push(format!("{} {a:?}", id.user));
        }
    }
    (wrong, missed, allowed)
}

/// Waits until the apiserver's Node authorizer and the proxy's pods cache both hold the
/// pods of `pods` (`present`) or neither does.
async fn settled(
    client: &kube::Client,
    proxy: &TestProxy,
    pods: &[(String, String, Value)],
    present: bool,
) {
    let state = proxy.running.as_ref().unwrap().state.clone();
    eventually(
        "the pods at the apiserver's Node authorizer and in the proxy's cache",
        Duration::from_secs(120),
        async || {
            let Some(cache) = state.caches.get("", "v1", "pods") else {
                return Err("no pods cache".to_string());
            };
            let mut off = Vec::new();
            for (ns, name, p) in pods {
                let node = p["spec"]["nodeName"].as_str().unwrap();
                let get = Attributes {
                    verb: "get".into(),
                    version: "v1".into(),
                    resource: "pods".into(),
                    namespace: ns.clone(),
                    name: name.clone(),
                    ..Default::default()
                };
                let cached = cache.get(ns, name).0.is_some();
                if review(client, &node_identity(node), &get).await != present || cached != present
                {
                    off.push(format!("{ns}/{name}"));
                }
            }
            if off.is_empty() {
                Ok(())
            } else {
                Err(format!("not yet: {off:?}"))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_node_allows_exactly_what_the_node_authorizer_allows_of_its_kinds() {
    let seed = env_u64("KCP_NODE_SEED", 53);
    let cases = env_u64("KCP_NODE_CASES", 3000) as usize;
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
        cp.create_default_service_account(ns).await.unwrap();
    }
    let mut rng = Rng(seed);
    let pods: Vec<_> = (0..PODS).map(|i| pod(&mut rng, i)).collect();
    for (ns, _, p) in &pods {
        call(
            &admin,
            Method::POST,
            &format!("/api/v1/namespaces/{ns}/pods"),
            Some(p),
        )
        .await;
    }
    let proxy = TestProxy::start_for(&cp, None, |c| {
        c.cache.resources = ["pods", "secrets", "configmaps", "nodes"]
            .map(String::from)
            .to_vec();
    })
    .await;
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
    settled(&admin, &proxy, &pods, true).await;

    let questions: Vec<(Identity, Attributes)> = (0..cases)
        .map(|_| (node_identity(rng.pick(&NODES)), question(&mut rng)))
        .collect();
    let (wrong, missed, allowed) = compare(&admin, &proxy, &questions).await;
    eprintln!(
        "local Node authorization: {cases} questions, {allowed} allowed locally, {} wrong allows, {} missed allows",
        wrong.len(),
        missed.len()
    );
    assert!(
        wrong.is_empty(),
        "allowed locally, not by the apiserver: {wrong:#?}"
    );
    assert!(
        missed.is_empty(),
        "allowed by the apiserver, not locally: {missed:#?}"
    );
    assert!(
        allowed * 10 >= cases,
        "a test worth the name: {allowed} of {cases} allowed"
    );

    // Half the pods deleted: their nodes lose what only they granted, at the next question.
    let (gone, kept) = pods.split_at(PODS / 2);
    for (ns, name, _) in gone {
        call(
            &admin,
            Method::DELETE,
            &format!("/api/v1/namespaces/{ns}/pods/{name}?gracePeriodSeconds=0"),
            None,
        )
        .await;
    }
    settled(&admin, &proxy, gone, false).await;
    settled(&admin, &proxy, kept, true).await;
    let (wrong, missed, allowed_after) = compare(&admin, &proxy, &questions).await;
    eprintln!(
        "after deleting {} pods: {allowed_after} allowed locally, {} wrong allows, {} missed allows",
        gone.len(),
        wrong.len(),
        missed.len()
    );
    assert!(
        wrong.is_empty(),
        "allowed locally after the deletion, not by the apiserver: {wrong:#?}"
    );
    assert!(
        missed.is_empty(),
        "allowed by the apiserver after the deletion, not locally: {missed:#?}"
    );
    assert!(allowed_after < allowed, "the deletion revoked nothing");
}
