//! Differential authorization matrix against a real kube-apiserver (RBAC and the Node
//! authorizer): subjects with different Roles/ClusterRoles (namespaced, cluster, resourceNames,
//! list without watch, watch without list, none) × verbs get/list/watch × cached resources ×
//! namespaces and cluster scope, plus selectors, the metadata client's Accept, paged lists
//! (every continue token followed) and namespaced paths to a cluster-scoped kind. Each cell is asked of the proxy (served from its cache, authenticated and
//! authorized by the proxy) and of the apiserver directly as the same identity; status codes,
//! 403 messages and the objects served (list items, get bodies, watch events) must be equal,
//! so the proxy never serves an object the apiserver would refuse.
//!
//! Subjects cover every authentication method of the proxy: static-token users (the
//! apiserver's token file, given to the proxy too), ServiceAccount JWTs verified offline
//! against the apiserver's JWKS, and a client certificate (asked of the apiserver by
//! impersonation). A last part checks revocation: a pod-bound token stops working at the proxy
//! once its pod is deleted.
//!
//! A second test measures revocation against the apiserver: a deleted (and re-created)
//! ServiceAccount's token, a deleted ClusterRoleBinding, a granted one, what an open watch does
//! when its caller loses access, and `Connection: Impersonate-User` from a bearer caller.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::support;
use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::{TestClient, TestProxy};
use bytes::Bytes;
use futures_util::StreamExt;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::auth::authn::{AuthnMethod, METHODS};
use kube_cache_proxy::auth::authz::Source;
use serde_json::{Value, json};

const NAMESPACES: [&str; 3] = ["ns-a", "ns-b", "ns-c"];

/// (resource, API prefix, group) of the cached resources in the matrix.
const RESOURCES: [(&str, &str, &str); 4] = [
    ("configmaps", "/api/v1", ""),
    ("secrets", "/api/v1", ""),
    ("pods", "/api/v1", ""),
    ("deployments", "/apis/apps/v1", "apps"),
];

async fn read(resp: http::Response<hyper::body::Incoming>) -> (StatusCode, Bytes) {
    let status = resp.status();
    let body = tokio::time::timeout(Duration::from_secs(30), resp.into_body().collect())
        .await
        .expect("response body within 30 s")
        .expect("response body")
        .to_bytes();
    (status, body)
}

/// How a subject reaches the apiserver directly and the proxy.
#[derive(Clone)]
enum Cred {
    Token(String),
    /// A client certificate at the proxy; `Impersonate-*` with the admin token directly.
    Cert {
        user: String,
        groups: Vec<String>,
        pem: (String, String),
    },
}

struct Subject {
    name: &'static str,
    cred: Cred,
}

struct Env {
    cp: ControlPlane,
    direct: support::proxy::Https,
    proxy: TestProxy,
}

impl Env {
    async fn admin(&self, method: Method, path: &str, body: Option<Value>) -> Value {
        let req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.cp.url))
            .header("authorization", format!("Bearer {}", self.cp.admin_token()))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(
                body.map(|b| b.to_string()).unwrap_or_default(),
            )))
            .unwrap();
        let (status, body) = read(self.direct.request(req).await.unwrap()).await;
        assert!(
            status.is_success() || status == StatusCode::CONFLICT,
            "{path}: {status} {}",
            String::from_utf8_lossy(&body)
        );
        serde_json::from_slice(&body).unwrap_or(Value::Null)
    }

    async fn ask_apiserver(&self, s: &Subject, path: &str) -> (StatusCode, Bytes) {
        self.ask_apiserver_as(s, path, None).await
    }

    async fn ask_apiserver_as(
        &self,
        s: &Subject,
        path: &str,
        accept: Option<&str>,
    ) -> (StatusCode, Bytes) {
        let mut b = Request::get(format!("{}{path}", self.cp.url));
        if let Some(a) = accept {
            b = b.header("accept", a);
        }
        match &s.cred {
            Cred::Token(t) => b = b.header("authorization", format!("Bearer {t}")),
            Cred::Cert { user, groups, .. } => {
                b = b
                    .header("authorization", format!("Bearer {}", self.cp.admin_token()))
                    .header("impersonate-user", user.as_str());
                for g in groups {
                    b = b.header("impersonate-group", g.as_str());
                }
            }
        }
        read(
            self.direct
                .request(b.body(Full::default()).unwrap())
                .await
                .unwrap(),
        )
        .await
    }

    async fn ask_proxy(
        &self,
        s: &Subject,
        clients: &ProxyClients,
        path: &str,
    ) -> (StatusCode, Bytes) {
        self.ask_proxy_as(s, clients, path, None).await
    }

    async fn ask_proxy_as(
        &self,
        s: &Subject,
        clients: &ProxyClients,
        path: &str,
        accept: Option<&str>,
    ) -> (StatusCode, Bytes) {
        let mut b = Request::get(self.proxy.https(path));
        if let Some(a) = accept {
            b = b.header("accept", a);
        }
        let client = match &s.cred {
            Cred::Token(t) => {
                b = b.header("authorization", format!("Bearer {t}"));
                &clients.plain
            }
            Cred::Cert { .. } => clients.cert(s.name),
        };
        read(client.send(b.body(Full::default()).unwrap()).await).await
    }

    /// One cell asked of the proxy (`via_proxy`) or of the apiserver: what the subject was
    /// shown, and how many requests it took (a paged list follows its continue tokens; each
    /// page is a request, authorized on its own).
    async fn ask_cell(
        &self,
        s: &Subject,
        clients: &ProxyClients,
        cell: &Cell,
        via_proxy: bool,
    ) -> (Seen, u64) {
        let mut path = cell.path.clone();
        let mut requests = 0;
        let mut all = Seen {
            status: 200,
            message: None,
            objects: BTreeSet::new(),
        };
        loop {
            requests += 1;
            let (status, body) = if via_proxy {
                self.ask_proxy_as(s, clients, &path, cell.accept).await
            } else {
                self.ask_apiserver_as(s, &path, cell.accept).await
            };
            let page = seen(status, &body, cell.watch);
            if page.status != 200 {
                return (page, requests);
            }
            all.objects.extend(page.objects);
            let next = serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
                v["metadata"]["continue"]
                    .as_str()
                    .filter(|c| !c.is_empty())
                    .map(str::to_string)
            });
            match next {
                Some(token) if cell.paged => {
                    assert!(requests < 50, "{}: pages without end", cell.path);
                    let base = cell.path.split('?').next().unwrap();
                    path = format!("{base}?limit=1&continue={}", urlencode(&token));
                }
                _ => return (all, requests),
            }
        }
    }
}

/// One question of the matrix.
struct Cell {
    subject: usize,
    verb: &'static str,
    path: String,
    watch: bool,
    /// An `Accept` header (the metadata client's), else none.
    accept: Option<&'static str>,
    /// A list with `limit=1`, its continue tokens followed to the end.
    paged: bool,
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The metadata client's Accept in its JSON form, which the proxy serves from the cache
/// (client-go's default puts protobuf first: that goes to the apiserver until the cache
/// speaks protobuf, and is authorized there).
const METADATA_ACCEPT: &str =
    "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json";

struct ProxyClients {
    plain: TestClient,
    certs: Vec<(&'static str, TestClient)>,
}

impl ProxyClients {
    fn cert(&self, name: &str) -> &TestClient {
        &self.certs.iter().find(|(n, _)| *n == name).unwrap().1
    }
}

/// What a caller was shown: the status, the 403 message, and the object keys served.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    status: u16,
    message: Option<String>,
    objects: BTreeSet<String>,
}

fn key(o: &Value) -> String {
    format!(
        "{}/{}",
        o["metadata"]["namespace"].as_str().unwrap_or(""),
        o["metadata"]["name"].as_str().unwrap_or("")
    )
}

fn seen(status: StatusCode, body: &[u8], watch: bool) -> Seen {
    let mut objects = BTreeSet::new();
    let mut message = None;
    if status.is_success() {
        if watch {
            for line in body.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
                let ev: Value = serde_json::from_slice(line).expect("watch event JSON");
                match ev["type"].as_str() {
                    Some("ADDED") | Some("MODIFIED") => {
                        objects.insert(key(&ev["object"]));
                    }
                    Some("BOOKMARK") => {}
                    other => {
                        objects.insert(format!("unexpected event {other:?}"));
                    }
                }
            }
        } else {
            let v: Value = serde_json::from_slice(body).expect("JSON body");
            match v["items"].as_array() {
                Some(items) => objects.extend(items.iter().map(key)),
                None => {
                    objects.insert(key(&v));
                }
            }
        }
    } else {
        let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        message = v["message"].as_str().map(str::to_string);
    }
    Seen {
        status: status.as_u16(),
        message,
        objects,
    }
}

async fn service_account_token(
    env: &Env,
    ns: &str,
    name: &str,
    bound_pod: Option<(&str, &str)>,
) -> String {
    let mut spec = json!({"expirationSeconds": 3600});
    if let Some((pod, uid)) = bound_pod {
        spec["boundObjectRef"] =
            json!({"kind": "Pod", "apiVersion": "v1", "name": pod, "uid": uid});
    }
    let r = env
        .admin(
            Method::POST,
            &format!("/api/v1/namespaces/{ns}/serviceaccounts/{name}/token"),
            Some(json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})),
        )
        .await;
    r["status"]["token"].as_str().expect("a token").to_string()
}

async fn setup_rbac(env: &Env) {
    let rule = |groups: &[&str], resources: &[&str], verbs: &[&str]| json!({"apiGroups": groups, "resources": resources, "verbs": verbs});
    let cluster_role = |name: &str, rules: Vec<Value>| {
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": name}, "rules": rules})
    };
    let subject = |kind: &str, name: &str, ns: Option<&str>| {
        let mut s = json!({"kind": kind, "name": name});
        if let Some(ns) = ns {
            s["namespace"] = json!(ns);
        } else {
            s["apiGroup"] = json!("rbac.authorization.k8s.io");
        }
        s
    };
    let role_ref = |kind: &str, name: &str| json!({"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name});
    for (name, rules) in [
        (
            "authz-pod-lister",
            vec![
                rule(&[""], &["pods"], &["get", "list"]),
                rule(&["apps"], &["deployments"], &["list", "watch"]),
            ],
        ),
        (
            "authz-secret-getter",
            vec![rule(&[""], &["secrets"], &["get"])],
        ),
        (
            "authz-watch-only",
            vec![rule(&[""], &["configmaps", "secrets"], &["watch"])],
        ),
        (
            "authz-cm-watcher",
            vec![rule(&[""], &["configmaps"], &["list", "watch"])],
        ),
        (
            "authz-all-watcher",
            vec![
                rule(
                    &[""],
                    &["configmaps", "pods", "secrets"],
                    &["list", "watch"],
                ),
                rule(&["apps"], &["deployments"], &["get", "list", "watch"]),
            ],
        ),
        (
            "authz-workloads",
            vec![
                rule(&[""], &["pods"], &["*"]),
                rule(&["apps"], &["*"], &["get", "list", "watch"]),
            ],
        ),
    ] {
        env.admin(
            Method::POST,
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            Some(cluster_role(name, rules)),
        )
        .await;
    }
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ns-a/roles",
        Some(json!({"metadata": {"name": "cm-reader"},
                    "rules": [rule(&[""], &["configmaps", "namespaces"], &["get", "list", "watch"])]})),
    )
    .await;
    let crb = |name: &str, role: &str, subjects: Vec<Value>| json!({"metadata": {"name": name}, "roleRef": role_ref("ClusterRole", role), "subjects": subjects});
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        Some(crb(
            "authz-viewers",
            "authz-pod-lister",
            vec![subject("Group", "viewers", None)],
        )),
    )
    .await;
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        Some(crb(
            "authz-watcher",
            "authz-all-watcher",
            vec![subject("ServiceAccount", "watcher", Some("ns-b"))],
        )),
    )
    .await;
    let rb = |ns: &str, name: &str, kind: &str, role: &str, subjects: Vec<Value>| {
        (
            format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"),
            json!({"metadata": {"name": name}, "roleRef": role_ref(kind, role), "subjects": subjects}),
        )
    };
    let mut bindings = vec![rb(
        "ns-a",
        "alice-cm",
        "Role",
        "cm-reader",
        vec![subject("User", "alice", None)],
    )];
    for ns in ["ns-a", "ns-b"] {
        bindings.push(rb(
            ns,
            "reader-secrets",
            "ClusterRole",
            "authz-secret-getter",
            vec![subject("ServiceAccount", "reader", Some("ns-a"))],
        ));
    }
    bindings.push(rb(
        "ns-b",
        "reader-cms",
        "ClusterRole",
        "authz-cm-watcher",
        vec![subject("ServiceAccount", "reader", Some("ns-a"))],
    ));
    // Watch without list: bob in ns-b.
    bindings.push(rb(
        "ns-b",
        "bob-watches",
        "ClusterRole",
        "authz-watch-only",
        vec![subject("User", "bob", None)],
    ));
    bindings.push(rb(
        "ns-c",
        "ops-workloads",
        "ClusterRole",
        "authz-workloads",
        vec![subject("Group", "ops", None)],
    ));
    // A binding to a Role that does not exist: RBAC's denial then carries a reason, which the
    // 403 message must repeat.
    bindings.push(rb(
        "ns-c",
        "broken",
        "Role",
        "missing-role",
        vec![subject("ServiceAccount", "broken", Some("ns-c"))],
    ));
    for (path, body) in bindings {
        env.admin(Method::POST, &path, Some(body)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_allows_and_denies_exactly_as_the_apiserver_and_never_serves_a_refused_object() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("kube_cache_proxy::auth::authn=debug,kube_cache_proxy::auth::authz=debug")
        .with_test_writer()
        .try_init();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("tokens.csv");
    let proxy = TestProxy::start_for(&cp, Some(&token_file), |c| {
        c.cache.resources = [
            "configmaps",
            "secrets",
            "pods",
            "deployments.apps",
            "namespaces",
        ]
        .map(String::from)
        .to_vec();
        c.authentication.token_auth_file = Some(token_file.clone());
        // Short, so the revocation part below does not wait long.
        c.authentication.cache_ttl = Duration::from_secs(1);
    })
    .await;
    let env = Env {
        direct: support::proxy::apiserver_client(&cp.ca_pem, true),
        cp,
        proxy,
    };

    // Data: three namespaces with one object of each resource, ServiceAccounts, RBAC.
    for ns in NAMESPACES {
        env.cp.create_default_service_account(ns).await.unwrap();
        env.admin(
            Method::POST,
            &format!("/api/v1/namespaces/{ns}/configmaps"),
            Some(json!({"metadata": {"name": "cm-1"}, "data": {"k": "v"}})),
        )
        .await;
        env.admin(
            Method::POST,
            &format!("/api/v1/namespaces/{ns}/secrets"),
            Some(json!({"metadata": {"name": "s-1"}, "stringData": {"k": "secret"}})),
        )
        .await;
        env.admin(Method::POST, &format!("/api/v1/namespaces/{ns}/pods"),
            Some(json!({"metadata": {"name": "p-1"},
                        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}))).await;
        env.admin(Method::POST, &format!("/apis/apps/v1/namespaces/{ns}/deployments"),
            Some(json!({"metadata": {"name": "d-1"}, "spec": {
                "selector": {"matchLabels": {"app": "d"}},
                "template": {"metadata": {"labels": {"app": "d"}},
                             "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}}}}))).await;
    }
    for (ns, sa) in [("ns-a", "reader"), ("ns-b", "watcher"), ("ns-c", "broken")] {
        env.admin(
            Method::POST,
            &format!("/api/v1/namespaces/{ns}/serviceaccounts"),
            Some(json!({"metadata": {"name": sa}})),
        )
        .await;
    }
    setup_rbac(&env).await;
    // A pod bound to node-1 (the Node authorizer lets that kubelet read it by selector, and
    // read the ConfigMap and Secret it refers to in ns-a, not those of other namespaces), and
    // bob may list and watch one ConfigMap of ns-a by name (RBAC `resourceNames`).
    env.admin(Method::POST, "/api/v1/namespaces/ns-a/pods",
        Some(json!({"metadata": {"name": "on-node-1"},
                    "spec": {"nodeName": "node-1",
                             "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10",
                                             "env": [{"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cm-1", "key": "k"}}}]}],
                             "volumes": [{"name": "s", "secret": {"secretName": "s-1"}}]}}))).await;
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ns-a/roles",
        Some(json!({"metadata": {"name": "one-cm"}, "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["cm-1"],
             "verbs": ["list", "watch"]}]})),
    )
    .await;
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ns-a/rolebindings",
        Some(json!({"metadata": {"name": "one-cm"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "one-cm"},
                    "subjects": [{"kind": "User", "name": "bob", "apiGroup": "rbac.authorization.k8s.io"}]})),
    )
    .await;

    let state = env.proxy.running.as_ref().unwrap().state.clone();
    eventually("every cache to sync", Duration::from_secs(60), async || {
        let unsynced: Vec<&str> = RESOURCES
            .iter()
            .filter(|(r, _, g)| state.caches.get(g, "v1", r).is_none_or(|c| !c.is_ready()))
            .map(|(r, _, _)| *r)
            .collect();
        ok_if(unsynced.is_empty(), unsynced)
    })
    .await;

    // The kubelet's reads of its pods' objects are decided in the proxy once the apiserver
    // confirmed it runs the Node authorizer (`auth::local_node`).
    eventually(
        "local Node authorization",
        Duration::from_secs(60),
        async || {
            let mode = state.authz.local_node().map_or("off", |n| n.mode());
            ok_if(mode == "active", mode)
        },
    )
    .await;
    let (cert, key) = support::proxy::client_cert(&env.proxy.client_ca, "carol", &["ops"]);
    let (node_cert, node_key) = support::proxy::client_cert(
        &env.proxy.client_ca,
        "system:node:node-1",
        &["system:nodes"],
    );
    let subjects = [
        Subject {
            name: "alice",
            cred: Cred::Token(env.cp.user("alice").token.clone()),
        },
        Subject {
            name: "bob",
            cred: Cred::Token(env.cp.user("bob").token.clone()),
        },
        Subject {
            name: "sa-reader",
            cred: Cred::Token(service_account_token(&env, "ns-a", "reader", None).await),
        },
        Subject {
            name: "sa-watcher",
            cred: Cred::Token(service_account_token(&env, "ns-b", "watcher", None).await),
        },
        Subject {
            name: "sa-broken",
            cred: Cred::Token(service_account_token(&env, "ns-c", "broken", None).await),
        },
        Subject {
            name: "carol",
            cred: Cred::Cert {
                user: "carol".into(),
                groups: vec!["ops".into()],
                pem: (cert.clone(), key.clone()),
            },
        },
        Subject {
            name: "kubelet-node-1",
            cred: Cred::Cert {
                user: "system:node:node-1".into(),
                groups: vec!["system:nodes".into()],
                pem: (node_cert, node_key),
            },
        },
    ];
    let clients = ProxyClients {
        plain: env.proxy.client(None, true),
        certs: subjects
            .iter()
            .filter_map(|s| match &s.cred {
                Cred::Cert { pem, .. } => {
                    Some((s.name, env.proxy.client(Some((&pem.0, &pem.1)), true)))
                }
                Cred::Token(_) => None,
            })
            .collect(),
    };

    // The cells: every subject × resource × (get, list, watch in each namespace; list and
    // watch at cluster scope).
    let mut cells = Vec::new();
    let cell = |subject, verb, path: String, watch| Cell {
        subject,
        verb,
        path,
        watch,
        accept: None,
        paged: false,
    };
    for (si, _) in subjects.iter().enumerate() {
        for (resource, prefix, _) in RESOURCES {
            let name = match resource {
                "configmaps" => "cm-1",
                "secrets" => "s-1",
                "pods" => "p-1",
                _ => "d-1",
            };
            for ns in NAMESPACES {
                let base = format!("{prefix}/namespaces/{ns}/{resource}");
                cells.push(cell(
                    si,
                    "get",
                    format!("{base}/{name}?resourceVersion=0"),
                    false,
                ));
                cells.push(cell(si, "list", format!("{base}?resourceVersion=0"), false));
                cells.push(cell(
                    si,
                    "watch",
                    format!("{base}?watch=1&resourceVersion=0&timeoutSeconds=2"),
                    true,
                ));
            }
            cells.push(cell(
                si,
                "list",
                format!("{prefix}/{resource}?resourceVersion=0"),
                false,
            ));
            cells.push(cell(
                si,
                "watch",
                format!("{prefix}/{resource}?watch=1&resourceVersion=0&timeoutSeconds=2"),
                true,
            ));
            // What real clients send too: the metadata client's Accept, and paged lists
            // (limit=1, every continue token followed; one authorization per page).
            for path in [
                format!("{prefix}/namespaces/ns-a/{resource}"),
                format!("{prefix}/{resource}"),
            ] {
                cells.push(Cell {
                    accept: Some(METADATA_ACCEPT),
                    ..cell(si, "list", format!("{path}?resourceVersion=0"), false)
                });
                cells.push(Cell {
                    paged: true,
                    ..cell(si, "list", format!("{path}?limit=1"), false)
                });
            }
        }
    }
    // Authorizers decide on selectors and on the name a `metadata.name` selector names: a
    // kubelet's pods by `spec.nodeName`, a `resourceNames` rule by list and watch.
    for (si, _) in subjects.iter().enumerate() {
        for path in [
            "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1",
            "/api/v1/namespaces/ns-a/pods?fieldSelector=spec.nodeName%3Dnode-1",
            "/api/v1/namespaces/ns-a/configmaps?fieldSelector=metadata.name%3Dcm-1",
            "/api/v1/namespaces/ns-a/configmaps?fieldSelector=metadata.name%3Dcm-2",
        ] {
            cells.push(cell(si, "list", path.to_string(), false));
            cells.push(cell(
                si,
                "watch",
                format!("{path}&watch=1&resourceVersion=0&timeoutSeconds=2"),
                true,
            ));
        }
        // A cluster-scoped kind under a namespaced path: the apiserver's 404, whoever asks
        // (alice may read namespaces in ns-a).
        for path in [
            "/api/v1/namespaces/ns-a/namespaces?resourceVersion=0",
            "/api/v1/namespaces/ns-a/namespaces/ns-a?resourceVersion=0",
            "/api/v1/namespaces/ns-a/namespaces?watch=1&resourceVersion=0&timeoutSeconds=2",
            "/api/v1/watch/namespaces/ns-a/namespaces?resourceVersion=0&timeoutSeconds=2",
        ] {
            cells.push(cell(si, "get", path.to_string(), path.contains("watch")));
        }
        cells.push(cell(
            si,
            "list",
            "/api/v1/namespaces?resourceVersion=0".into(),
            false,
        ));
    }
    let results: Vec<_> = futures_util::stream::iter(cells.iter())
        .map(|c| {
            let s = &subjects[c.subject];
            let env = &env;
            let clients = &clients;
            async move {
                let (via_proxy, proxy_requests) = env.ask_cell(s, clients, c, true).await;
                let (direct, _) = env.ask_cell(s, clients, c, false).await;
                (
                    s.name,
                    c.verb,
                    c.path.clone(),
                    via_proxy,
                    direct,
                    proxy_requests,
                )
            }
        })
        .buffer_unordered(12)
        .collect()
        .await;

    let mut diffs = Vec::new();
    let (mut allowed, mut denied, mut not_found) = (0, 0, 0);
    // Decisions the proxy made: one per request it served or refused (a page each).
    let (mut decided_allowed, mut decided_denied) = (0u64, 0u64);
    for (who, verb, path, via_proxy, direct, proxy_requests) in &results {
        // Namespaced paths to namespaces go to the apiserver, which decides (403, or 404).
        let passed_through = path.contains("/namespaces/ns-a/namespaces");
        let (decided, requests) = if passed_through {
            (0, 0)
        } else {
            (1, *proxy_requests)
        };
        match direct.status {
            200 => {
                allowed += 1;
                decided_allowed += requests;
            }
            403 => {
                denied += 1;
                decided_allowed += requests.saturating_sub(1);
                decided_denied += decided;
            }
            404 if passed_through => not_found += 1,
            other => diffs.push(format!(
                "{who} {verb} {path}: the apiserver answered {other}"
            )),
        }
        if via_proxy != direct {
            diffs.push(format!(
                "{who} {verb} {path}:\n  proxy     {via_proxy:?}\n  apiserver {direct:?}"
            ));
        }
    }
    eprintln!(
        "authorization matrix: {} cells ({allowed} allowed, {denied} denied, {not_found} not found), {} differences",
        results.len(),
        diffs.len()
    );
    assert!(
        diffs.is_empty(),
        "the proxy differs from the apiserver:\n{}",
        diffs.join("\n")
    );
    assert!(results.len() >= 5 * 3 * 3 * 3, "{} cells", results.len());
    assert!(
        allowed >= 30 && denied >= 30,
        "a matrix worth the name: {allowed} allowed, {denied} denied"
    );
    // A denial with an RBAC reason is among them, word for word.
    assert!(
        results.iter().any(|r| r.3.message.as_deref().is_some_and(
            |m| m.contains("RBAC: role.rbac.authorization.k8s.io \"missing-role\" not found")
        )),
        "no 403 carried RBAC's reason"
    );

    // The proxy decided these itself: served from its cache, identities verified by each
    // method (JWTs offline), decisions by SubjectAccessReview.
    let a = &state.authn.stats;
    let count = |m: AuthnMethod| {
        a.ok[METHODS.iter().position(|x| *x == m).unwrap()]
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert!(count(AuthnMethod::StaticToken) > 0);
    assert!(count(AuthnMethod::ServiceAccountJwt) > 0);
    assert!(count(AuthnMethod::Certificate) > 0);
    assert_eq!(
        count(AuthnMethod::TokenReview),
        0,
        "every token here verifies offline or by file"
    );
    let z = &state.authz.stats;
    // Every cell was decided by the proxy (none passed through but the namespaced paths to
    // namespaces, which are the apiserver's 404): one decision per request.
    let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        (load(&z.allowed), load(&z.denied), load(&z.errors)),
        (decided_allowed, decided_denied, 0),
        "decisions by the proxy: {z:?}"
    );

    // The kubelet's allowed reads of node-1's pods and of the Secret and ConfigMap its pod
    // refers to were decided locally (the rest of its questions were reviewed).
    let node_local = load(&z.by_source[Source::LocalNode as usize][0]);
    let kubelet_allowed = results
        .iter()
        .filter(|r| r.0 == "kubelet-node-1" && r.4.status == 200)
        .count() as u64;
    assert!(
        node_local >= 6 && node_local <= kubelet_allowed * 4,
        "local node decisions: {node_local}, the kubelet's allowed cells: {kubelet_allowed}"
    );

    // Impersonation by a client-certificate caller, uid and extra included: carol may
    // impersonate user dave, uid uid-dave and two extra values. Through the proxy (which
    // authorizes it, then impersonates over its own credentials), the apiserver's
    // SelfSubjectReview sees the whole identity that was checked.
    let uextra = |key: &str, names: &[&str]| {
        json!({"apiGroups": ["authentication.k8s.io"], "resources": [format!("userextras/{key}")],
               "resourceNames": names, "verbs": ["impersonate"]})
    };
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        Some(json!({"metadata": {"name": "impersonate-dave"}, "rules": [
            {"apiGroups": [""], "resources": ["users"], "resourceNames": ["dave"], "verbs": ["impersonate"]},
            {"apiGroups": ["authentication.k8s.io"], "resources": ["uids"], "resourceNames": ["uid-dave"], "verbs": ["impersonate"]},
            uextra("scopes", &["view"]),
            uextra("example.org/team", &["blue"]),
        ]})),
    )
    .await;
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        Some(json!({"metadata": {"name": "carol-impersonates-dave"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "impersonate-dave"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "carol"}]})),
    )
    .await;
    let who_am_i = |uid: &'static str| {
        let req = Request::post(
            env.proxy
                .https("/apis/authentication.k8s.io/v1/selfsubjectreviews"),
        )
        .header("content-type", "application/json")
        .header("impersonate-user", "dave")
        .header("impersonate-uid", uid)
        .header("impersonate-extra-scopes", "view")
        // client-go's escaping of the key `example.org/team`.
        .header("impersonate-extra-example.org%2fteam", "blue")
        .body(Full::new(Bytes::from(
            json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
                .to_string(),
        )))
        .unwrap();
        let c = clients.cert("carol");
        async move { read(c.send(req).await).await }
    };
    // RBAC RoleBindings take effect at once; retry briefly in case the authorizer cache lags.
    let review = eventually(
        "dave's review through impersonation",
        Duration::from_secs(30),
        async || {
            let (status, body) = who_am_i("uid-dave").await;
            if status == StatusCode::CREATED || status == StatusCode::OK {
                return Ok(serde_json::from_slice::<Value>(&body).unwrap());
            }
            Err(format!("{status} {}", String::from_utf8_lossy(&body)))
        },
    )
    .await;
    let user = &review["status"]["userInfo"];
    assert_eq!(user["username"], "dave", "{review}");
    assert_eq!(user["uid"], "uid-dave", "{review}");
    assert_eq!(
        user["extra"],
        json!({"scopes": ["view"], "example.org/team": ["blue"]}),
        "{review}"
    );
    // A uid carol may not impersonate is refused by the proxy, as by the apiserver.
    let (status, body) = who_am_i("uid-other").await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let refusal: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        refusal["message"],
        "uids.authentication.k8s.io \"uid-other\" is forbidden: User \"carol\" cannot impersonate resource \"uids\" in API group \"authentication.k8s.io\" at the cluster scope"
    );

    // An anonymous caller asking to impersonate gets the apiserver's own refusal, word for
    // word (kube-apiserver 1.36: `... User "system:anonymous" cannot
    // impersonate-on:user-info:list ...`; a group without a user is a 400).
    for headers in [
        &[("impersonate-user", "dave")][..],
        &[("impersonate-group", "system:masters")][..],
        &[("impersonate-user", "dave"), ("impersonate-group", "g")][..],
        &[("impersonate-user", "system:serviceaccount:ns-a:reader")][..],
    ] {
        let anonymous = |base: &str| {
            let mut b = Request::get(format!("{base}/api/v1/namespaces/ns-a/configmaps"));
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            b.body(Full::new(Bytes::new())).unwrap()
        };
        let direct = read(env.direct.request(anonymous(&env.cp.url)).await.unwrap()).await;
        let via = read(clients.plain.send(anonymous(&env.proxy.https(""))).await).await;
        let message = |b: &Bytes| serde_json::from_slice::<Value>(b).unwrap()["message"].clone();
        assert_eq!(
            (via.0, message(&via.1)),
            (direct.0, message(&direct.1)),
            "{headers:?}: {}",
            String::from_utf8_lossy(&direct.1)
        );
        assert!(direct.0 == StatusCode::FORBIDDEN || direct.0 == StatusCode::BAD_REQUEST);
    }

    // Revocation: a token bound to a pod stops working at the proxy once the pod is gone, as
    // at the apiserver (TokenReview on bound tokens; the proxy's authentication cache is 1 s
    // here, 10 s by default).
    let pod = env
        .admin(
            Method::POST,
            "/api/v1/namespaces/ns-a/pods",
            Some(json!({"metadata": {"name": "p-bound"}, "spec": {
                "serviceAccountName": "reader",
                "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}})),
        )
        .await;
    let uid = pod["metadata"]["uid"].as_str().unwrap().to_string();
    let bound = service_account_token(&env, "ns-a", "reader", Some(("p-bound", &uid))).await;
    let s = Subject {
        name: "sa-reader-bound",
        cred: Cred::Token(bound),
    };
    let path = "/api/v1/namespaces/ns-a/secrets/s-1?resourceVersion=0";
    let (status, body) = env.ask_proxy(&s, &clients, path).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    env.admin(
        Method::DELETE,
        "/api/v1/namespaces/ns-a/pods/p-bound?gracePeriodSeconds=0",
        None,
    )
    .await;
    eventually("the pod to go away", Duration::from_secs(30), async || {
        let gone = env
            .admin(
                Method::GET,
                "/api/v1/namespaces/ns-a/pods?fieldSelector=metadata.name%3Dp-bound",
                None,
            )
            .await;
        ok_if(gone["items"].as_array().is_some_and(|i| i.is_empty()), gone)
    })
    .await;
    // The apiserver itself caches token authentications for 10 s.
    eventually(
        "the apiserver to refuse the token",
        Duration::from_secs(30),
        async || {
            let status = env.ask_apiserver(&s, path).await.0;
            ok_if(status == StatusCode::UNAUTHORIZED, status)
        },
    )
    .await;
    // The proxy looks the bound pod up in its pod cache on every request.
    let body = eventually(
        "the proxy to refuse the token",
        Duration::from_secs(30),
        async || {
            let (status, body) = env.ask_proxy(&s, &clients, path).await;
            ok_if(status == StatusCode::UNAUTHORIZED, status).map(|_| body)
        },
    )
    .await;
    assert!(
        !String::from_utf8_lossy(&body).contains("secret"),
        "no object in a refusal"
    );

    env.proxy.shutdown().await;
    env.cp.stop().await;
}

/// Reads a watch stream until a line contains `needle` (or the stream ends, or 30 s pass):
/// whether it did.
async fn watch_shows(resp: http::Response<hyper::body::Incoming>, needle: &str) -> bool {
    let mut body = resp.into_body();
    let mut seen = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return false };
            if let Some(d) = frame.data_ref() {
                seen.extend_from_slice(d);
                if seen.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                    return true;
                }
            }
        }
        false
    })
    .await;
    found.unwrap_or(false)
}

impl Env {
    /// How long until the proxy and the apiserver (asked side by side) both answer `want`
    /// to `s` on `path`: (proxy, apiserver).
    async fn until_both(
        &self,
        what: &str,
        want: StatusCode,
        s: &Subject,
        clients: &ProxyClients,
        path: &str,
    ) -> (Duration, Duration) {
        let (at_proxy, at_apiserver) = (
            format!("the proxy: {what}"),
            format!("the apiserver: {what}"),
        );
        tokio::join!(
            until_status(&at_proxy, want, async || {
                self.ask_proxy(s, clients, path).await.0
            }),
            until_status(&at_apiserver, want, async || {
                self.ask_apiserver(s, path).await.0
            }),
        )
    }
}

/// Polls `ask` until it answers `want`; the time it took.
async fn until_status<F: AsyncFnMut() -> StatusCode>(
    what: &str,
    want: StatusCode,
    mut ask: F,
) -> Duration {
    let start = tokio::time::Instant::now();
    eventually(what, Duration::from_secs(60), async || {
        let s = ask().await;
        ok_if(s == want, s)
    })
    .await;
    start.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revocation_takes_effect_at_the_proxy_as_at_the_apiserver() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("tokens.csv");
    // Default caching of authentications (10 s) and decisions (allowed 5 min, denied 30 s):
    // revocation must not wait for them.
    let proxy = TestProxy::start_for(&cp, Some(&token_file), |c| {
        c.cache.resources = vec!["configmaps".into()];
    })
    .await;
    let env = Env {
        direct: support::proxy::apiserver_client(&cp.ca_pem, true),
        cp,
        proxy,
    };
    let ns = "rev";
    env.cp.create_default_service_account(ns).await.unwrap();
    env.admin(
        Method::POST,
        &format!("/api/v1/namespaces/{ns}/configmaps"),
        Some(json!({"metadata": {"name": "cm-1"}})),
    )
    .await;
    let state = env.proxy.running.as_ref().unwrap().state.clone();
    eventually("the caches to sync", Duration::from_secs(60), async || {
        let c = state.caches.get("", "v1", "configmaps");
        let a = state.caches.pinned("", "v1", "serviceaccounts");
        let b = state
            .caches
            .pinned("rbac.authorization.k8s.io", "v1", "clusterrolebindings");
        ok_if(
            [c, a, b]
                .iter()
                .all(|c| c.as_ref().is_some_and(|c| c.is_ready())),
            "not synced",
        )
    })
    .await;
    let clients = ProxyClients {
        plain: env.proxy.client(None, true),
        certs: Vec::new(),
    };
    let list = format!("/api/v1/namespaces/{ns}/configmaps?resourceVersion=0");

    // (The built-in `view` role is aggregated by the controller manager, absent here.)
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        Some(json!({"metadata": {"name": "cm-reader"}, "rules": [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]})),
    )
    .await;

    // 1. A ServiceAccount's token, the account deleted: refused at the proxy as soon as its
    // copy of the accounts has seen the deletion (the apiserver: within its 10 s token cache).
    env.admin(
        Method::POST,
        &format!("/api/v1/namespaces/{ns}/serviceaccounts"),
        Some(json!({"metadata": {"name": "doomed"}})),
    )
    .await;
    env.admin(
        Method::POST,
        &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"),
        Some(json!({"metadata": {"name": "doomed-views"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cm-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "doomed", "namespace": ns}]})),
    )
    .await;
    let doomed = Subject {
        name: "doomed",
        cred: Cred::Token(service_account_token(&env, ns, "doomed", None).await),
    };
    until_status("the token to read the cache", StatusCode::OK, async || {
        env.ask_proxy(&doomed, &clients, &list).await.0
    })
    .await;
    let served_by_cache = state.authn.stats.ok[METHODS
        .iter()
        .position(|m| *m == AuthnMethod::ServiceAccountJwt)
        .unwrap()]
    .load(std::sync::atomic::Ordering::Relaxed);
    assert!(served_by_cache > 0, "verified offline by the proxy");
    env.admin(
        Method::DELETE,
        &format!("/api/v1/namespaces/{ns}/serviceaccounts/doomed"),
        None,
    )
    .await;
    let (at_proxy, at_apiserver) = env
        .until_both(
            "refuse the deleted account's token",
            StatusCode::UNAUTHORIZED,
            &doomed,
            &clients,
            &list,
        )
        .await;
    eprintln!(
        "deleted ServiceAccount: token refused after {at_proxy:?} at the proxy, {at_apiserver:?} at the apiserver"
    );
    // Re-created under the same name (a new uid): the old token stays refused, a new one reads.
    env.admin(
        Method::POST,
        &format!("/api/v1/namespaces/{ns}/serviceaccounts"),
        Some(json!({"metadata": {"name": "doomed"}})),
    )
    .await;
    let reborn = Subject {
        name: "reborn",
        cred: Cred::Token(service_account_token(&env, ns, "doomed", None).await),
    };
    until_status(
        "the re-created account's token to read",
        StatusCode::OK,
        async || env.ask_proxy(&reborn, &clients, &list).await.0,
    )
    .await;
    for (who, (status, body)) in [
        ("proxy", env.ask_proxy(&doomed, &clients, &list).await),
        ("apiserver", env.ask_apiserver(&doomed, &list).await),
    ] {
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{who}: {}",
            String::from_utf8_lossy(&body)
        );
    }

    // 2. A ClusterRoleBinding deleted: the proxy had allowed alice (remembered 5 minutes);
    // it refuses within about a second of the apiserver. An open watch is kept by both.
    let alice = Subject {
        name: "alice",
        cred: Cred::Token(env.cp.user("alice").token.clone()),
    };
    let binding = json!({"metadata": {"name": "alice-reads-cms"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cm-reader"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}]});
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        Some(binding.clone()),
    )
    .await;
    until_status(
        "alice to read through the proxy",
        StatusCode::OK,
        async || env.ask_proxy(&alice, &clients, &list).await.0,
    )
    .await;
    let token = env.cp.user("alice").token.clone();
    let watch_path = format!("/api/v1/namespaces/{ns}/configmaps?watch=1&resourceVersion=0");
    let proxy_watch = clients
        .plain
        .get(&env.proxy.https(&watch_path), Some(&token))
        .await;
    let direct_watch = env
        .direct
        .request(
            Request::get(format!("{}{watch_path}", env.cp.url))
                .header("authorization", format!("Bearer {token}"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(proxy_watch.status(), StatusCode::OK);
    assert_eq!(direct_watch.status(), StatusCode::OK);
    let invalidations = state
        .authz
        .stats
        .rbac_invalidations
        .load(std::sync::atomic::Ordering::Relaxed);
    env.admin(
        Method::DELETE,
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/alice-reads-cms",
        None,
    )
    .await;
    let (at_proxy, at_apiserver) = env
        .until_both(
            "refuse alice",
            StatusCode::FORBIDDEN,
            &alice,
            &clients,
            &list,
        )
        .await;
    eprintln!(
        "deleted ClusterRoleBinding: refused after {at_proxy:?} at the proxy, {at_apiserver:?} at the apiserver"
    );
    assert!(
        state
            .authz
            .stats
            .rbac_invalidations
            .load(std::sync::atomic::Ordering::Relaxed)
            > invalidations,
        "the refusal came from following RBAC, not from a TTL"
    );
    let (p, d) = (
        env.ask_proxy(&alice, &clients, &list).await,
        env.ask_apiserver(&alice, &list).await,
    );
    assert_eq!(seen(p.0, &p.1, false), seen(d.0, &d.1, false));
    // The watches opened before the revocation still deliver, at the proxy as at the
    // apiserver (authorization is decided when a request starts).
    env.admin(
        Method::POST,
        &format!("/api/v1/namespaces/{ns}/configmaps"),
        Some(json!({"metadata": {"name": "after-revocation"}})),
    )
    .await;
    let (via_proxy, direct) = tokio::join!(
        watch_shows(proxy_watch, "after-revocation"),
        watch_shows(direct_watch, "after-revocation")
    );
    eprintln!("open watch after the revocation: proxy delivers {via_proxy}, apiserver {direct}");
    assert_eq!(
        via_proxy, direct,
        "an open watch: the proxy does as the apiserver"
    );
    // Granted again: the remembered denial (30 s) does not hold it back.
    env.admin(
        Method::POST,
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
        Some(binding),
    )
    .await;
    let (at_proxy, at_apiserver) = env
        .until_both("allow alice again", StatusCode::OK, &alice, &clients, &list)
        .await;
    eprintln!(
        "re-created ClusterRoleBinding: allowed after {at_proxy:?} at the proxy, {at_apiserver:?} at the apiserver"
    );

    // 3. `Connection: Impersonate-User` from a bearer caller over HTTP/1.1: the apiserver
    // reads the header whatever Connection says and refuses the impersonation.
    let h1 = env.proxy.client(None, false);
    let ask = |url: String| {
        Request::get(url)
            .header("authorization", format!("Bearer {token}"))
            .header("impersonate-user", "system:admin")
            .header("connection", "Impersonate-User")
            .body(Full::default())
            .unwrap()
    };
    let (ps, pb) = read(h1.send(ask(env.proxy.https(&list))).await).await;
    let direct_h1 = support::proxy::apiserver_client(&env.cp.ca_pem, false);
    let (ds, db) = read(
        direct_h1
            .request(ask(format!("{}{list}", env.cp.url)))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        ds,
        StatusCode::FORBIDDEN,
        "{}",
        String::from_utf8_lossy(&db)
    );
    assert_eq!(seen(ps, &pb, false), seen(ds, &db, false));

    env.proxy.shutdown().await;
    env.cp.stop().await;
}
