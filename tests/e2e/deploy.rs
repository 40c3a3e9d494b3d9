//! deploy/ checked against a real kube-apiserver: the rendered Kustomize base, HA overlay and
//! Helm chart pass a server-side dry run (and the namespace's Pod Security "restricted"
//! check); their RBAC is wildcard-free and grants exactly what the configuration caches; the
//! proxy runs with exactly that RBAC (a token for its ServiceAccount, the clusters' default
//! grants to all authenticated users removed) and its caches, impersonation and access reviews
//! work; and the real binary, as replicas of the Deployment, runs on the in-cluster
//! configuration (ServiceAccount files plus KUBERNETES_SERVICE_HOST/PORT), continues another
//! replica's lists with the shared key file, and shuts down within the grace period.
//!
//! Tools: kubectl from the control-plane build (`tests/e2e/build-control-plane.sh`), helm from
//! `tests/e2e/build-helm.sh` (both cached under ~/.cache/kube-cache-proxy/).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::support;
use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::{EventReader, TestProxy, body_json, body_string};
use http_body_util::Full;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::config::Config;
use serde_json::{Value, json};

/// Bound on waiting for caches to sync and for the proxy to become ready.
const BOUND: Duration = Duration::from_secs(90);
/// The namespace the Kustomize base deploys into (and the chart is installed into here).
const NS: &str = "kube-cache-proxy";
/// The Helm release name; with it the chart's object names equal the Kustomize base's.
const RELEASE: &str = "kube-cache-proxy";

/// The proxy binary: cargo's build of this package, or `KCP_TEST_PROXY_BIN` (for a target
/// directory shared by several checkouts, where the binary cargo links there may be another
/// checkout's build).
fn proxy_bin() -> PathBuf {
    std::env::var_os("KCP_TEST_PROXY_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kube-cache-proxy")))
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// (kubectl, helm), built once and cached.
fn tools() -> &'static (PathBuf, PathBuf) {
    static TOOLS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    TOOLS.get_or_init(|| {
        let kubectl = kube_cache_proxy::app::dev::ensure_binaries()
            .expect("control-plane binaries")
            .join("kubectl");
        let out = Command::new("bash")
            .arg(repo().join("tests/e2e/build-helm.sh"))
            .stderr(Stdio::inherit())
            .output()
            .expect("running build-helm.sh");
        assert!(out.status.success(), "build-helm.sh failed");
        let dir = String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .expect("build-helm.sh prints its bin directory")
            .trim()
            .to_string();
        (kubectl, PathBuf::from(dir).join("helm"))
    })
}

fn run(cmd: &mut Command, stdin: Option<&str>) -> Output {
    let mut child = cmd
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    child.wait_with_output().unwrap()
}

fn ok_stdout(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `kubectl kustomize deploy/kustomize/<dir>`.
fn kustomize(dir: &str) -> String {
    let out = run(
        Command::new(&tools().0)
            .arg("kustomize")
            .arg(repo().join("deploy/kustomize").join(dir)),
        None,
    );
    ok_stdout(&format!("kubectl kustomize {dir}"), out)
}

/// A helm command with its state directories in `home` (nothing written to ~).
fn helm(home: &Path) -> Command {
    let mut c = Command::new(&tools().1);
    for (var, sub) in [
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ] {
        c.env(var, home.join(sub));
    }
    c
}

/// `helm template` of the chart with `--set` pairs.
fn helm_template(sets: &[&str]) -> String {
    ok_stdout(
        &format!("helm template {sets:?}"),
        helm_template_output(&[], sets),
    )
}

/// `helm template` with more arguments (`--api-versions ...`) and `--set` pairs, as run.
fn helm_template_output(args: &[&str], sets: &[&str]) -> Output {
    let home = tempfile::tempdir().unwrap();
    let mut c = helm(home.path());
    c.args(["template", RELEASE])
        .arg(repo().join("deploy/helm/kube-cache-proxy"))
        .args(["--namespace", NS])
        .args(args);
    for s in sets {
        c.args(["--set", s]);
    }
    run(&mut c, None)
}

/// `--api-versions` telling `helm template` the cluster has the Prometheus Operator's CRDs.
const WITH_PROMETHEUS_OPERATOR: [&str; 2] = ["--api-versions", "monitoring.coreos.com/v1"];

/// The objects of a multi-document YAML stream.
fn docs(yaml: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(yaml)
        .unwrap_or_else(|e| panic!("rendered YAML does not parse: {e}\n{yaml}"))
        .into_iter()
        .filter(|d| !d.is_null())
        .collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn one<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = of_kind(docs, kind);
    assert_eq!(found.len(), 1, "exactly one {kind}");
    found[0]
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .map(|s| s.as_str().expect("a string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn kubectl(kubeconfig: &Path, args: &[&str], stdin: Option<&str>) -> Output {
    run(
        Command::new(&tools().0)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args),
        stdin,
    )
}

/// `kubectl apply` of `objects` for real.
fn apply(kubeconfig: &Path, objects: &[&Value]) {
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    ok_stdout(
        "kubectl apply",
        kubectl(kubeconfig, &["apply", "-f", "-"], Some(&list.to_string())),
    );
}

/// The rendered Deployment's proxy configuration: the ConfigMap file its `--config` names.
fn proxy_config(docs: &[Value]) -> (String, Config) {
    let dep = one(docs, "Deployment");
    let pod = &dep["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args = strings(&c["args"]);
    assert_eq!(args[..2], ["serve", "--config"], "{args:?}");
    let path = Path::new(&args[2]);
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| Path::new(m["mountPath"].as_str().unwrap()) == path.parent().unwrap())
        .expect("the --config directory is a volume mount");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let cm_name = volume["configMap"]["name"]
        .as_str()
        .expect("the config volume is a ConfigMap");
    let cm = of_kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["name"] == cm_name)
        .unwrap_or_else(|| panic!("ConfigMap {cm_name} is rendered"));
    let text = cm["data"][path.file_name().unwrap().to_str().unwrap()]
        .as_str()
        .expect("the config file is in the ConfigMap")
        .to_string();
    let cfg = Config::from_yaml(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    (text, cfg)
}

/// `kube-cache-proxy check-config --no-files` on `text`, as the kustomize ConfigMap's header
/// says to check it: the files it names (serving certificate, key, client CA, continue-token
/// keys) exist only in the pod (`check_render` checks each is in a mounted volume).
fn check_config(text: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, text).unwrap();
    let out = run(
        Command::new(proxy_bin())
            .args(["check-config", "--no-files"])
            .arg(&file),
        None,
    );
    let stdout = ok_stdout("check-config", out);
    assert!(stdout.trim_end().ends_with(": ok"), "{stdout}");
}

/// `resource[.group]` -> (group, resource).
fn group_resource(name: &str) -> (String, String) {
    match name.split_once('.') {
        Some((r, g)) => (g.to_string(), r.to_string()),
        None => (String::new(), name.to_string()),
    }
}

fn default_cached() -> BTreeSet<(String, String)> {
    Config::default()
        .cache
        .resources
        .iter()
        .map(|r| group_resource(r))
        .collect()
}

/// What a rendered ClusterRole grants, rule by rule; panics on a wildcard or a rule of a kind
/// the proxy does not need.
#[derive(Debug, Default)]
struct Grants {
    /// (group, resource) with exactly get, list, watch.
    read: BTreeSet<(String, String)>,
    /// (group, resource) with exactly get.
    get_only: BTreeSet<(String, String)>,
    /// (group, resource) with exactly impersonate.
    impersonate: BTreeSet<(String, String)>,
    /// Non-resource URLs with exactly get.
    urls: BTreeSet<String>,
    /// get/list/watch on every resource of every group (`cache.resources: [all]`).
    read_everything: bool,
}

/// The one wildcard rule a role may have: what `cache.resources: [all]` needs.
fn is_read_everything(rule: &Value) -> bool {
    rule["apiGroups"] == json!(["*"])
        && rule["resources"] == json!(["*"])
        && rule["verbs"] == json!(["get", "list", "watch"])
        && rule.get("nonResourceURLs").is_none()
}

fn grants(what: &str, role: &Value) -> Grants {
    let mut g = Grants::default();
    for rule in role["rules"].as_array().expect("rules") {
        if is_read_everything(rule) {
            g.read_everything = true;
            continue;
        }
        for field in [
            "verbs",
            "apiGroups",
            "resources",
            "resourceNames",
            "nonResourceURLs",
        ] {
            for s in strings(&rule[field]) {
                // `/apis/*`: every group's discovery documents, with read_everything only
                // (checked by the caller).
                assert!(
                    !s.contains('*') || s == "/apis/*",
                    "{what}: wildcard {s:?} in {field}: {rule}"
                );
            }
        }
        let verbs: BTreeSet<String> = strings(&rule["verbs"]).into_iter().collect();
        let verbs: Vec<&str> = verbs.iter().map(String::as_str).collect();
        let pairs = || {
            strings(&rule["apiGroups"]).into_iter().flat_map(|grp| {
                strings(&rule["resources"])
                    .into_iter()
                    .map(move |r| (grp.clone(), r))
            })
        };
        assert!(
            rule.get("resourceNames").is_none(),
            "{what}: unexpected {rule}"
        );
        match (verbs.as_slice(), rule.get("nonResourceURLs")) {
            (["get"], Some(urls)) => g.urls.extend(strings(urls)),
            (["get", "list", "watch"], None) => g.read.extend(pairs()),
            (["get"], None) => g.get_only.extend(pairs()),
            (["impersonate"], None) => g.impersonate.extend(pairs()),
            _ => panic!("{what}: a rule the proxy does not need: {rule}"),
        }
    }
    g
}

fn set(pairs: &[(&str, &str)]) -> BTreeSet<(String, String)> {
    pairs
        .iter()
        .map(|(g, r)| (g.to_string(), r.to_string()))
        .collect()
}

fn labels_match(selector: &Value, labels: &Value) {
    let sel = selector.as_object().expect("matchLabels");
    assert!(!sel.is_empty());
    for (k, v) in sel {
        assert_eq!(
            &labels[k], v,
            "selector {k}={v} must match the pods' labels"
        );
    }
}

fn duration_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The consistency checks every render must pass; returns the rendered configuration.
fn check_render(what: &str, docs: &[Value]) -> Config {
    let (text, cfg) = proxy_config(docs);
    check_config(&text);

    // RBAC: the ServiceAccount the pods run as is bound to the ClusterRole and to
    // system:auth-delegator, and the role grants exactly what the configuration needs.
    // The scrape's own ServiceAccount and binding (serviceMonitor) are not the proxy's.
    let not_scraper = |d: &&Value| {
        !d["metadata"]["name"]
            .as_str()
            .is_some_and(|n| n.ends_with("-scraper"))
    };
    let sas: Vec<&Value> = of_kind(docs, "ServiceAccount")
        .into_iter()
        .filter(not_scraper)
        .collect();
    assert_eq!(sas.len(), 1, "{what}: one ServiceAccount for the proxy");
    let sa = sas[0];
    let sa_subject = (
        sa["metadata"]["name"].as_str().unwrap(),
        sa["metadata"]["namespace"].as_str().unwrap(),
    );
    assert_eq!(sa_subject.1, NS);
    let dep = one(docs, "Deployment");
    let pod = &dep["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], sa_subject.0);
    // The proxy's own role; the other one is for whoever reads its /metrics.
    let roles = of_kind(docs, "ClusterRole");
    let (readers, own): (Vec<&Value>, Vec<&Value>) = roles.iter().partition(|r| {
        r["metadata"]["name"]
            .as_str()
            .unwrap()
            .ends_with("-metrics-reader")
    });
    assert_eq!(own.len(), 1, "{what}: one ClusterRole for the proxy");
    let role = own[0];
    assert_eq!(readers.len(), 1, "{what}: a metrics-reader ClusterRole");
    assert_eq!(
        readers[0]["rules"],
        json!([{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]),
        "{what}"
    );
    assert!(
        of_kind(docs, "Role").is_empty(),
        "{what}: only the ClusterRole"
    );
    let role_name = role["metadata"]["name"].as_str().unwrap();
    let bindings: Vec<&Value> = of_kind(docs, "ClusterRoleBinding")
        .into_iter()
        .filter(not_scraper)
        .collect();
    let bound_to = |r: &str| {
        bindings.iter().any(|b| {
            b["roleRef"]["kind"] == "ClusterRole"
                && b["roleRef"]["name"] == r
                && b["subjects"].as_array().unwrap().iter().all(|s| {
                    s["kind"] == "ServiceAccount"
                        && s["name"] == sa_subject.0
                        && s["namespace"] == sa_subject.1
                })
        })
    };
    assert!(bound_to(role_name), "{what}: the ClusterRole is bound");
    assert!(
        bound_to("system:auth-delegator"),
        "{what}: system:auth-delegator is bound"
    );
    assert_eq!(bindings.len(), 2, "{what}: two bindings, no more");
    let g = grants(what, role);
    let all = cfg.cache.resources.iter().any(|r| r == "all");
    let cached: BTreeSet<_> = cfg
        .cache
        .resources
        .iter()
        .filter(|r| *r != "all")
        .map(|r| group_resource(r))
        .collect();
    assert_eq!(
        g.read_everything, all,
        "{what}: get/list/watch on everything exactly when cache.resources has `all`"
    );
    assert_eq!(
        g.urls.contains("/apis/*"),
        all,
        "{what}: every group's discovery exactly with `all`"
    );
    if !all {
        // Plus what the proxy follows for itself: ServiceAccounts (their tokens' lookup) and
        // RBAC objects (decisions follow them).
        let mut want = cached.clone();
        if cfg.authentication.service_account_lookup {
            want.insert((String::new(), "serviceaccounts".into()));
        }
        if cfg.cache.authorization_follow_rbac {
            for r in [
                "roles",
                "rolebindings",
                "clusterroles",
                "clusterrolebindings",
            ] {
                want.insert(("rbac.authorization.k8s.io".into(), r.into()));
            }
        }
        assert_eq!(
            g.read, want,
            "{what}: get/list/watch on exactly cache.resources and what the proxy follows"
        );
    }
    // CRDs are read only when custom resources are cached (then they are in cache.resources).
    assert_eq!(g.get_only, set(&[]));
    // Impersonation (acting as any user) only when client certificates are accepted.
    let c = &pod["containers"][0];
    let client_certs = cfg.tls.client_ca_file.is_some()
        || c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| e["name"] == "KCP_CLIENT_CA_FILE");
    let want_impersonate = if client_certs {
        set(&[
            ("", "users"),
            ("", "groups"),
            ("", "serviceaccounts"),
            ("authentication.k8s.io", "uids"),
        ])
    } else {
        set(&[])
    };
    assert_eq!(g.impersonate, want_impersonate, "{what}: impersonation");
    let mut want_urls: BTreeSet<String> = ["/api", "/api/v1", "/apis", "/metrics", "/readyz"]
        .map(String::from)
        .into();
    for (grp, _) in &cached {
        if !grp.is_empty() {
            want_urls.insert(format!("/apis/{grp}"));
        }
    }
    let missing: Vec<_> = want_urls.difference(&g.urls).collect();
    assert!(
        missing.is_empty(),
        "{what}: discovery URLs missing: {missing:?}"
    );

    // API Priority and Fairness: the proxy's ServiceAccount gets its own priority level.
    if let [fs] = of_kind(docs, "FlowSchema")[..] {
        let plc = one(docs, "PriorityLevelConfiguration");
        assert_eq!(
            fs["spec"]["priorityLevelConfiguration"]["name"],
            plc["metadata"]["name"]
        );
        assert_eq!(
            fs["spec"]["rules"][0]["subjects"],
            json!([{"kind": "ServiceAccount",
                    "serviceAccount": {"name": sa_subject.0, "namespace": sa_subject.1}}]),
            "{what}"
        );
        for o in [fs, plc] {
            assert!(o["metadata"].get("namespace").is_none(), "{what}: {o}");
        }
    }

    // The recommended labels on every object.
    for d in docs {
        for k in [
            "app.kubernetes.io/name",
            "app.kubernetes.io/instance",
            "app.kubernetes.io/version",
            "app.kubernetes.io/managed-by",
        ] {
            assert!(
                d["metadata"]["labels"][k].is_string(),
                "{what}: {} {} has no {k} label",
                d["kind"],
                d["metadata"]["name"]
            );
        }
    }

    // The Deployment agrees with its configuration.
    assert!(dep["spec"]["replicas"].as_u64().unwrap() >= 2, "{what}: HA");
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace >= duration_secs(cfg.shutdown.delay + cfg.shutdown.drain_timeout),
        "{what}: terminationGracePeriodSeconds {grace} < shutdown delay + drain"
    );
    assert!(
        !cfg.shutdown.delay.is_zero(),
        "{what}: a shutdown delay so Endpoints drain before the listeners close"
    );
    let port = c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "https")
        .expect("an https port");
    assert_eq!(port["containerPort"], cfg.listen.port());
    for (probe, path) in [("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
        let get = &c[probe]["httpGet"];
        assert_eq!(get["path"], path, "{what}: {probe}");
        assert_eq!(get["scheme"], "HTTPS", "{what}: {probe}");
        // The proxy's own health is on the admin listener (on the API port it is the
        // apiserver's).
        assert_eq!(get["port"], "admin", "{what}: {probe}");
    }
    let admin_port = c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "admin")
        .expect("an admin port");
    assert_eq!(admin_port["containerPort"], cfg.admin_addr().port());
    assert_ne!(cfg.admin_addr().port(), cfg.listen.port());
    assert_eq!(
        cfg.server.admin_auth,
        kube_cache_proxy::config::AdminAuth::Kubernetes,
        "{what}: /metrics protected"
    );
    for k in ["cpu", "memory"] {
        assert!(
            c["resources"]["requests"][k].is_string(),
            "{what}: request {k}"
        );
        assert!(c["resources"]["limits"][k].is_string(), "{what}: limit {k}");
    }
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"]);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    assert!(
        !pod["topologySpreadConstraints"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    // Every file the configuration names is in a mounted volume (a Secret for key material).
    let volumes: BTreeMap<&str, &Value> = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v))
        .collect();
    let mounts: BTreeMap<&str, &Value> = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["mountPath"].as_str().unwrap(),
                volumes[m["name"].as_str().unwrap()],
            )
        })
        .collect();
    let env_client_ca = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == "KCP_CLIENT_CA_FILE")
        .map(|e| PathBuf::from(e["value"].as_str().unwrap()));
    let mounted = |file: &Path, source: &str| {
        let dir = file.parent().unwrap().to_str().unwrap();
        let v = mounts
            .get(dir)
            .unwrap_or_else(|| panic!("{what}: {} is not in a mounted volume", file.display()));
        assert!(v.get(source).is_some(), "{what}: {dir} is not a {source}");
    };
    mounted(cfg.tls.cert_file.as_deref().expect("TLS"), "secret");
    mounted(cfg.tls.key_file.as_deref().expect("TLS"), "secret");
    if let Some(ca) = cfg
        .tls
        .client_ca_file
        .as_deref()
        .or(env_client_ca.as_deref())
    {
        mounted(ca, "configMap");
    }
    // The continue-token keys: one Secret shared by all replicas.
    mounted(
        cfg.tokens
            .key_file
            .as_deref()
            .unwrap_or_else(|| panic!("{what}: tokens.keyFile is set")),
        "secret",
    );

    // Service, PodDisruptionBudget and NetworkPolicy select the pods and the TLS port.
    let pod_labels = &dep["spec"]["template"]["metadata"]["labels"];
    labels_match(&dep["spec"]["selector"]["matchLabels"], pod_labels);
    let svc = one(docs, "Service");
    labels_match(&svc["spec"]["selector"], pod_labels);
    let sp = &svc["spec"]["ports"][0];
    assert_eq!(sp["port"], 443);
    assert!(sp["targetPort"] == "https" || sp["targetPort"] == cfg.listen.port());
    let metrics_port = svc["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "metrics")
        .unwrap_or_else(|| panic!("{what}: a metrics Service port"));
    assert_eq!(metrics_port["targetPort"], "admin");
    for pdb in of_kind(docs, "PodDisruptionBudget") {
        labels_match(&pdb["spec"]["selector"]["matchLabels"], pod_labels);
    }
    for np in of_kind(docs, "NetworkPolicy") {
        labels_match(&np["spec"]["podSelector"]["matchLabels"], pod_labels);
        assert_eq!(
            np["spec"]["ingress"][0]["ports"][0]["port"],
            cfg.listen.port()
        );
        // The admin port only from the monitoring namespace, not from everywhere.
        let admin_rules: Vec<&Value> = np["spec"]["ingress"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| {
                r["ports"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["port"] == cfg.admin_addr().port())
            })
            .collect();
        assert_eq!(admin_rules.len(), 1, "{what}: {np}");
        assert_eq!(
            admin_rules[0]["from"],
            json!([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]),
            "{what}"
        );
    }
    cfg
}

#[test]
fn rendered_rbac_is_wildcard_free_and_matches_the_configuration() {
    let renders = [
        ("kustomize base", docs(&kustomize("base")), true),
        (
            "kustomize overlays/ha",
            docs(&kustomize("overlays/ha")),
            true,
        ),
        ("helm defaults", docs(&helm_template(&[])), true),
        (
            "helm with options",
            docs(&helm_template(&[
                "tls.clientCAConfigMap=kube-cache-proxy-client-ca",
                "priorityClassName=system-cluster-critical",
                "replicaCount=3",
                "shutdown.delaySeconds=20",
                "shutdown.drainTimeoutSeconds=60",
                "networkPolicy.apiserverCIDRs[0].cidr=10.0.0.1/32",
                "config.cache.historyMaxAge=5m",
            ])),
            true,
        ),
        (
            "helm with other cached resources",
            docs(&helm_template(&[
                "cache.resources={pods,leases.coordination.k8s.io,cronjobs.batch,ingresses.networking.k8s.io}",
            ])),
            false,
        ),
    ];
    for (what, docs, default_resources) in &renders {
        let cfg = check_render(what, docs);
        if *default_resources {
            let cached: BTreeSet<_> = cfg
                .cache
                .resources
                .iter()
                .map(|r| group_resource(r))
                .collect();
            assert_eq!(
                cached,
                default_cached(),
                "{what}: caches what the proxy caches by default"
            );
        } else {
            assert_eq!(cfg.cache.resources.len(), 4, "{what}");
        }
    }
    // The overlay and the options took effect.
    let ha = &renders[1].1;
    assert_eq!(one(ha, "Deployment")["spec"]["replicas"], 3);
    let opts = &renders[3].1;
    let pod = &one(opts, "Deployment")["spec"]["template"]["spec"];
    assert_eq!(pod["terminationGracePeriodSeconds"], 85);
    assert_eq!(pod["priorityClassName"], "system-cluster-critical");
    let opts_cfg = proxy_config(opts).1;
    assert!(opts_cfg.tls.client_ca_file.is_some());
    // The passthrough `config` block reaches the proxy's configuration.
    assert_eq!(opts_cfg.cache.history_max_age, Duration::from_secs(300));
    // `all`: read everything, every discovery document.
    let all = check_render(
        "helm with all",
        &docs(&helm_template(&["cache.resources={all}"])),
    );
    assert_eq!(all.cache.resources, ["all"]);
    // Flow control by default, in both; the optional objects can be turned off.
    for (what, docs, _) in &renders[..4] {
        assert_eq!(of_kind(docs, "FlowSchema").len(), 1, "{what}");
    }
    let minimal = docs(&helm_template(&[
        "podDisruptionBudget.enabled=false",
        "networkPolicy.enabled=false",
        "flowControl.enabled=false",
    ]));
    check_render("helm minimal", &minimal);
    for kind in [
        "PodDisruptionBudget",
        "NetworkPolicy",
        "FlowSchema",
        "PriorityLevelConfiguration",
    ] {
        assert!(of_kind(&minimal, kind).is_empty(), "{kind}");
    }
    // CRD-dependent objects only when enabled.
    for (what, docs, _) in &renders {
        for kind in ["ServiceMonitor", "Certificate"] {
            assert!(
                of_kind(docs, kind).is_empty(),
                "{what}: no {kind} by default"
            );
        }
    }
}

#[test]
fn the_chart_renders_cert_manager_and_service_monitor_objects_when_enabled() {
    let sets = [
        "serviceMonitor.enabled=true",
        "tls.certManager.enabled=true",
        "tls.certManager.issuerRef.name=cluster-ca",
    ];
    // The ServiceMonitor only where its CRD is served (.Capabilities.APIVersions).
    assert!(of_kind(&docs(&helm_template(&sets)), "ServiceMonitor").is_empty());
    let docs = docs(&ok_stdout(
        "helm template",
        helm_template_output(&WITH_PROMETHEUS_OPERATOR, &sets),
    ));
    check_render("helm with cert-manager", &docs);
    let cert = one(&docs, "Certificate");
    let svc = one(&docs, "Service");
    let name = svc["metadata"]["name"].as_str().unwrap();
    assert!(
        strings(&cert["spec"]["dnsNames"]).contains(&format!("{name}.{NS}.svc")),
        "{cert}"
    );
    assert_eq!(cert["spec"]["issuerRef"]["name"], "cluster-ca");
    // The pods mount the Secret cert-manager writes.
    let pod = &one(&docs, "Deployment")["spec"]["template"]["spec"];
    let tls = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "tls")
        .unwrap();
    assert_eq!(tls["secret"]["secretName"], cert["spec"]["secretName"]);
    let sm = one(&docs, "ServiceMonitor");
    let ep = &sm["spec"]["endpoints"][0];
    assert_eq!(ep["path"], "/metrics");
    // The admin listener's Service port, with a bearer token and the CA cert-manager writes.
    assert_eq!(ep["port"], "metrics");
    assert_eq!(ep["scheme"], "https");
    // The Prometheus Operator's supported `authorization` (not the deprecated
    // `bearerTokenFile`), with the token of a ServiceAccount the chart binds to the
    // metrics-reader role.
    assert!(ep.get("bearerTokenFile").is_none(), "{ep}");
    let scraper = format!("{name}-scraper");
    assert_eq!(
        ep["authorization"],
        json!({"type": "Bearer", "credentials": {"name": format!("{scraper}-token"), "key": "token"}})
    );
    let token = of_kind(&docs, "Secret")
        .into_iter()
        .find(|s| s["metadata"]["name"] == format!("{scraper}-token"))
        .expect("the scraper's token Secret");
    assert_eq!(token["type"], "kubernetes.io/service-account-token");
    assert_eq!(
        token["metadata"]["annotations"]["kubernetes.io/service-account.name"],
        scraper.as_str()
    );
    let binding = of_kind(&docs, "ClusterRoleBinding")
        .into_iter()
        .find(|b| b["metadata"]["name"] == scraper.as_str())
        .expect("the scraper's binding");
    assert_eq!(binding["roleRef"]["name"], format!("{name}-metrics-reader"));
    assert_eq!(
        binding["subjects"],
        json!([{"kind": "ServiceAccount", "name": scraper, "namespace": NS}])
    );
    assert_eq!(
        ep["tlsConfig"]["ca"]["secret"],
        json!({"name": cert["spec"]["secretName"], "key": "ca.crt"})
    );
    assert_eq!(ep["tlsConfig"]["serverName"], format!("{name}.{NS}.svc"));
    // With a serving Secret of `kubectl create secret tls` (no ca.crt) the user names the CA
    // and the token; without a CA the chart refuses to render.
    let docs = self::docs(&ok_stdout(
        "helm template",
        helm_template_output(
            &WITH_PROMETHEUS_OPERATOR,
            &[
                "serviceMonitor.enabled=true",
                "serviceMonitor.caConfigMap.name=kcp-ca",
                "serviceMonitor.bearerTokenSecret.name=prometheus-token",
            ],
        ),
    ));
    let ep = &one(&docs, "ServiceMonitor")["spec"]["endpoints"][0];
    assert_eq!(
        ep["tlsConfig"]["ca"]["configMap"],
        json!({"name": "kcp-ca", "key": "ca.crt"})
    );
    assert_eq!(
        ep["authorization"],
        json!({"type": "Bearer", "credentials": {"name": "prometheus-token", "key": "token"}})
    );
    let out = helm_template_output(&WITH_PROMETHEUS_OPERATOR, &["serviceMonitor.enabled=true"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("serviceMonitor.caConfigMap"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_chart_checks_its_values_against_its_schema() {
    // helm lint validates values.yaml against values.schema.json (and the templates).
    let home = tempfile::tempdir().unwrap();
    let mut c = helm(home.path());
    c.arg("lint")
        .arg(repo().join("deploy/helm/kube-cache-proxy"))
        .arg("--strict");
    ok_stdout("helm lint --strict", run(&mut c, None));
    // Wrong types, unknown values and bad enums are refused before anything renders.
    for (set, says) in [
        ("replicaCount=two", "replicaCount"),
        ("admin.auth=off", "admin/auth"),
        ("image.digest=latest", "image/digest"),
        ("cache.resources={Deployments}", "cache/resources/0"),
        ("serviceMonitr.enabled=true", "serviceMonitr"),
        ("log.format=xml", "log/format"),
        // A number where the Pod API wants a string.
        ("env[0].name=A,env[0].value=1", "env/0/value"),
    ] {
        let out = helm_template_output(&[], &[set]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set}: rendered");
        assert!(
            stderr.contains("values don't meet the specifications of the schema")
                && stderr.contains(says),
            "{set}: {stderr}"
        );
    }
}

#[test]
fn the_chart_turns_tracing_on_only_with_an_endpoint() {
    // Off by default: no `tracing` section, so the proxy's defaults (off) apply.
    let (text, cfg) = proxy_config(&docs(&helm_template(&[])));
    assert!(!text.contains("tracing"), "{text}");
    assert_eq!(cfg.tracing.endpoint(|_| None), None);
    let (text, cfg) = proxy_config(&docs(&helm_template(&[
        "tracing.endpoint=http://otel-collector.observability:4318",
        "tracing.samplingRatio=1",
    ])));
    assert_eq!(
        cfg.tracing.endpoint(|_| None).as_deref(),
        Some("http://otel-collector.observability:4318")
    );
    assert_eq!(cfg.tracing.sampling_ratio, 1.0);
    check_config(&text);
    // `--set` passes a fraction as a string: accepted, rendered as the number.
    let (_, cfg) = proxy_config(&docs(&helm_template(&[
        "tracing.endpoint=http://otel-collector.observability:4318",
        "tracing.samplingRatio=0.01",
    ])));
    assert_eq!(cfg.tracing.sampling_ratio, 0.01);
    for bad in ["1.5", "often"] {
        let out = helm_template_output(
            &[],
            &[
                "tracing.endpoint=http://c:4318",
                &format!("tracing.samplingRatio={bad}"),
            ],
        );
        assert!(!out.status.success(), "{bad}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("tracing/samplingRatio"));
    }
    // A URL without a scheme is refused by the schema before anything renders.
    let out = helm_template_output(&[], &["tracing.endpoint=otel-collector:4318"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("tracing/endpoint"));
}

/// The TCP ports the rendered NetworkPolicy lets the pods reach.
fn egress_ports(docs: &[Value]) -> BTreeSet<u64> {
    one(docs, "NetworkPolicy")["spec"]["egress"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["ports"].as_array().cloned().unwrap_or_default())
        .filter(|p| p["protocol"] == "TCP")
        .filter_map(|p| p["port"].as_u64())
        .collect()
}

/// Egress follows the enabled features: the OTLP collector's port with tracing on, etcd's
/// metrics port with `paging.etcdMetricsUrl`, and rules of the user's own.
#[test]
fn the_chart_network_policy_lets_enabled_features_out() {
    assert_eq!(
        egress_ports(&docs(&helm_template(&[]))),
        [53, 443, 6443].into()
    );
    let docs = docs(&helm_template(&[
        "tracing.endpoint=http://otel-collector.observability:4318",
        "config.paging.etcdMetricsUrl=http://10.0.0.5:2381",
        "networkPolicy.extraEgress[0].ports[0].port=9090",
        "networkPolicy.extraEgress[0].ports[0].protocol=TCP",
    ]));
    assert_eq!(
        egress_ports(&docs),
        [53, 443, 2381, 4318, 6443, 9090].into()
    );
    // A URL without a port: the scheme's.
    let docs = self::docs(&helm_template(&[
        "tracing.endpoint=https://collector.example",
    ]));
    assert!(egress_ports(&docs).contains(&443));
    let docs = self::docs(&helm_template(&[
        "tracing.endpoint=http://collector.example",
    ]));
    assert!(egress_ports(&docs).contains(&80));
}

#[test]
fn the_chart_renders_digest_env_args_volumes_and_the_grafana_dashboard() {
    let digest = format!("sha256:{}", "ab".repeat(32));
    let docs = docs(&helm_template(&[
        "image.tag=9.9.9",
        &format!("image.digest={digest}"),
        "extraArgs={--log-level,debug}",
        "env[0].name=RUST_BACKTRACE",
        "env[0].value=full",
        "volumes[0].name=extra",
        "volumes[0].emptyDir.medium=Memory",
        "volumeMounts[0].name=extra",
        "volumeMounts[0].mountPath=/extra",
        "grafanaDashboard.enabled=true",
    ]));
    check_render("helm with digest, env, args, volumes", &docs);
    let pod = &one(&docs, "Deployment")["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    // The digest wins over the tag.
    assert_eq!(c["image"], format!("kube-cache-proxy@{digest}"));
    assert_eq!(
        strings(&c["args"])[3..],
        ["--log-level".to_string(), "debug".to_string()]
    );
    assert_eq!(
        c["env"],
        json!([{"name": "RUST_BACKTRACE", "value": "full"}])
    );
    assert!(
        c["volumeMounts"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "extra", "mountPath": "/extra"}))
    );
    assert!(
        pod["volumes"]
            .as_array()
            .unwrap()
            .contains(&json!({"name": "extra", "emptyDir": {"medium": "Memory"}}))
    );
    // The dashboard ConfigMap, for Grafana's sidecar, holds exactly the checked-in JSON.
    let cm = of_kind(&docs, "ConfigMap")
        .into_iter()
        .find(|c| c["metadata"]["labels"]["grafana_dashboard"] == "1")
        .expect("a ConfigMap labelled grafana_dashboard: \"1\"");
    let shipped: Value = serde_json::from_str(&dashboard_json()).unwrap();
    let rendered: Value =
        serde_json::from_str(cm["data"]["kube-cache-proxy.json"].as_str().unwrap()).unwrap();
    assert_eq!(rendered, shipped);
    // Off by default; the tag without a digest.
    let plain = self::docs(&helm_template(&["image.tag=9.9.9"]));
    let c = &one(&plain, "Deployment")["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["image"], "kube-cache-proxy:9.9.9");
    assert!(c.get("env").is_none());
    assert_eq!(strings(&c["args"]).len(), 3);
    assert!(
        of_kind(&plain, "ConfigMap")
            .iter()
            .all(|c| c["metadata"]["labels"].get("grafana_dashboard").is_none())
    );
}

/// Bytes of a Kubernetes quantity as the manifests write them (`512Mi`, `3Gi`, `1000`).
fn quantity_bytes(q: &str) -> u64 {
    let (n, unit) = q
        .find(|c: char| !c.is_ascii_digit())
        .map_or((q, ""), |i| q.split_at(i));
    let n: u64 = n.parse().unwrap_or_else(|_| panic!("quantity {q}"));
    n * match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        other => panic!("unit {other} of {q}"),
    }
}

/// The warm-restart state volume holds what a full cache saves: 1.14 x the cached bytes
/// (measured), which the container's memory limit bounds; a kubelet evicts a pod whose
/// emptyDir outgrows its sizeLimit, so every variant keeps it at 1.25 x the limit or more.
#[test]
fn the_state_volume_holds_the_saved_state_of_a_cache_as_large_as_the_memory_limit() {
    assert_eq!(quantity_bytes("3Gi"), 3 << 30);
    assert_eq!(quantity_bytes("512Mi"), 512 << 20);
    for (what, docs) in [
        ("kustomize base", docs(&kustomize("base"))),
        ("kustomize overlays/ha", docs(&kustomize("overlays/ha"))),
        ("helm defaults", docs(&helm_template(&[]))),
    ] {
        let pod = &one(&docs, "Deployment")["spec"]["template"]["spec"];
        let memory = pod["containers"][0]["resources"]["limits"]["memory"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: a memory limit"));
        let state = pod["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == "state")
            .unwrap_or_else(|| panic!("{what}: a state volume"));
        let size = state["emptyDir"]["sizeLimit"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: a sizeLimit"));
        assert!(
            quantity_bytes(size) * 4 >= quantity_bytes(memory) * 5,
            "{what}: state sizeLimit {size} < 1.25 x memory limit {memory}"
        );
    }
}

/// The Grafana dashboard shipped in deploy/ (and in the chart).
fn dashboard_json() -> String {
    std::fs::read_to_string(repo().join(DASHBOARD)).unwrap()
}

const DASHBOARD: &str = "deploy/helm/kube-cache-proxy/dashboards/kube-cache-proxy.json";

/// The metric names a PromQL expression selects: identifiers followed by a label matcher or
/// a range (`name{...}`, `name[5m]`), which is how every query of the dashboard names them.
fn promql_metrics(expr: &str) -> BTreeSet<String> {
    let b = expr.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_alphabetic() || c == b'_' || c == b':' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b':') {
                i += 1;
            }
            // Inside a label matcher's quoted value, or after a `$` variable: not a name.
            let quoted = expr[..start].matches('"').count() % 2 == 1;
            let variable = start > 0 && b[start - 1] == b'$';
            let mut j = i;
            while j < b.len() && b[j] == b' ' {
                j += 1;
            }
            if !quoted && !variable && j < b.len() && (b[j] == b'{' || b[j] == b'[') {
                out.insert(expr[start..i].to_string());
            }
        } else {
            i += 1;
        }
    }
    out
}

/// What a Prometheus text exposition offers: sample names with their label names, and each
/// family's type.
#[derive(Debug, Default)]
struct Scrape {
    samples: BTreeSet<String>,
    labels: BTreeMap<String, BTreeSet<String>>,
    types: BTreeMap<String, String>,
}

/// The label names of a sample line's `{...}` (values may hold `,`, `}` and escaped `"`).
fn sample_labels(l: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let Some(open) = l.find('{') else {
        return out;
    };
    let mut rest = &l[open + 1..];
    // The operator: `=`, or a query's `!=`, `=~`, `!~`.
    while let Some(op) = rest.find(['=', '!']) {
        let name = rest[..op].trim().trim_start_matches(',').trim();
        if name.is_empty() || name.contains('}') {
            break;
        }
        out.insert(name.to_string());
        // Skip the quoted value.
        let v = rest[op..].trim_start_matches(['=', '!', '~']);
        let Some(v) = v.strip_prefix('"') else { break };
        let mut end = None;
        let mut escaped = false;
        for (i, c) in v.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = Some(i);
                    break;
                }
                _ => escaped = false,
            }
        }
        let Some(end) = end else { break };
        rest = &v[end + 1..];
    }
    out
}

/// Labels a query may use without the proxy exporting them: those Prometheus adds to every
/// series of a scrape target (the ServiceMonitor's `job`, `namespace`, `pod`, ...).
const TARGET_LABELS: &[&str] = &[
    "job",
    "namespace",
    "pod",
    "instance",
    "service",
    "endpoint",
    "container",
];

/// The labels a PromQL expression groups by (`by (a, b)`, `without (c)`) or matches on
/// (`name{a="x"}`), as `(metric or "", label)` pairs: a matcher names its metric, a
/// grouping belongs to the expression.
fn promql_labels(expr: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let b = expr.as_bytes();
    let ident = |i: usize| {
        let mut j = i;
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_' || b[j] == b':') {
            j += 1;
        }
        j
    };
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'"' {
            // A string: skip it.
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        if b[i].is_ascii_alphabetic() || b[i] == b'_' {
            let end = ident(i);
            let word = &expr[i..end];
            let mut j = end;
            while j < b.len() && b[j] == b' ' {
                j += 1;
            }
            if matches!(word, "by" | "without") && j < b.len() && b[j] == b'(' {
                let close = expr[j..].find(')').map_or(b.len(), |c| c + j);
                for l in expr[j + 1..close].split(',') {
                    let l = l.trim();
                    if !l.is_empty() {
                        out.push((String::new(), l.to_string()));
                    }
                }
                i = close + 1;
                continue;
            }
            if j < b.len() && b[j] == b'{' {
                let close = expr[j..].find('}').map_or(b.len(), |c| c + j);
                for m in sample_labels(&format!("x{}", &expr[j..=close.min(b.len() - 1)])) {
                    out.push((word.to_string(), m));
                }
                i = close + 1;
                continue;
            }
            i = end;
            continue;
        }
        i += 1;
    }
    out
}

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let mut s = Scrape::default();
        for l in text.lines() {
            if let Some(t) = l.strip_prefix("# TYPE ") {
                let mut f = t.split_whitespace();
                if let (Some(name), Some(ty)) = (f.next(), f.next()) {
                    s.types.insert(name.to_string(), ty.to_string());
                }
            } else if !l.starts_with('#') && !l.is_empty() {
                let end = l.find(['{', ' ']).unwrap_or(l.len());
                s.samples.insert(l[..end].to_string());
                s.labels
                    .entry(l[..end].to_string())
                    .or_default()
                    .extend(sample_labels(l));
            }
        }
        s
    }

    /// Whether `name` can be queried: a sample in the scrape, or a series its family's type
    /// defines though no sample of it was there yet (`_total` of a counter, whose family is
    /// named without it in OpenMetrics and with it in the text format 0.0.4; `_bucket` of a
    /// histogram; `_sum`, `_count` of a histogram or summary; the name of a gauge). The
    /// proxy's per-resource counters have no sample until their first count.
    fn has(&self, name: &str) -> bool {
        if self.samples.contains(name) {
            return true;
        }
        let ty = |base: &str| self.types.get(base).map(String::as_str);
        if let Some(base) = name.strip_suffix("_total") {
            return ty(base) == Some("counter") || ty(name) == Some("counter");
        }
        if let Some(base) = name.strip_suffix("_bucket") {
            return ty(base) == Some("histogram");
        }
        if let Some(base) = name
            .strip_suffix("_sum")
            .or_else(|| name.strip_suffix("_count"))
        {
            return matches!(ty(base), Some("histogram" | "summary"));
        }
        matches!(ty(name), Some("gauge" | "unknown"))
    }
}

#[test]
fn promql_names_and_scrape_suffixes_are_read_exactly() {
    assert_eq!(
        promql_metrics(
            r#"histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{job=~"$job", x="y{z}"}[$__rate_interval]))) / b_total [5m]"#
        ),
        ["a_seconds_bucket", "b_total"].map(String::from).into()
    );
    let s = Scrape::parse(
        "# TYPE c counter\nc_total{a=\"1\"} 2\n# TYPE h histogram\n# TYPE g gauge\ng 1\n",
    );
    for yes in ["c_total", "h_bucket", "h_sum", "h_count", "g"] {
        assert!(s.has(yes), "{yes}");
    }
    for no in [
        "c", "c_bucket", "h", "h_total", "g_total", "g_count", "missing",
    ] {
        assert!(!s.has(no), "{no}");
    }
    // The text format 0.0.4 names a counter family with `_total`: declared, no sample yet.
    let t = Scrape::parse("# TYPE d_total counter\n# TYPE e_total gauge\n");
    assert!(t.has("d_total"));
    assert!(!t.has("d"));
    assert!(!t.has("e_total_total"));
    assert_eq!(
        s.labels["c_total"],
        ["a".to_string()].into_iter().collect::<BTreeSet<_>>()
    );
    assert_eq!(
        sample_labels(r#"m{a="x,y}",b="q\"z",c=""} 1"#),
        ["a", "b", "c"].map(String::from).into()
    );
    assert_eq!(
        promql_labels(
            r#"sum by (kind, pod) (rate(m_total{job=~"$job", x!="by (no)"}[5m])) / n{y!~"1"}"#
        ),
        [
            ("", "kind"),
            ("", "pod"),
            ("m_total", "job"),
            ("m_total", "x"),
            ("n", "y")
        ]
        .map(|(m, l)| (m.to_string(), l.to_string()))
        .to_vec()
    );
}

/// The dashboard is a Grafana dashboard model (the fields Grafana requires to import it) and
/// every metric it queries is in `scrape`, the proxy's own admin /metrics.
fn check_dashboard(scrape: &str) {
    let d: Value = serde_json::from_str(&dashboard_json()).expect("the dashboard is JSON");
    for field in ["title", "uid"] {
        assert!(
            d[field].as_str().is_some_and(|s| !s.is_empty()),
            "dashboard {field}"
        );
    }
    assert!(d["schemaVersion"].as_u64().is_some(), "schemaVersion");
    let panels = d["panels"].as_array().expect("panels");
    assert!(!panels.is_empty());
    let text = scrape;
    let scrape = Scrape::parse(scrape);
    let mut queried = BTreeSet::new();
    for p in panels {
        let title = p["title"].as_str().expect("a panel title");
        assert!(p["type"].is_string(), "{title}: type");
        let targets = p["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{title}: targets");
        for t in targets {
            let expr = t["expr"].as_str().expect("a PromQL expr");
            let names = promql_metrics(expr);
            assert!(!names.is_empty(), "{title}: no metric in {expr}");
            // Every label the query matches or groups by is one the proxy exports on those
            // metrics (or one Prometheus adds to the target), and so is every label the
            // legend names: `by (listener)` on a metric labelled `kind` shows nothing.
            let exported =
                |m: &str| -> BTreeSet<String> { scrape.labels.get(m).cloned().unwrap_or_default() };
            let known_samples = names.iter().all(|n| scrape.labels.contains_key(n));
            let legend = t["legendFormat"].as_str().unwrap_or("");
            let legend_labels = legend.split("{{").skip(1).filter_map(|s| {
                s.split_once("}}")
                    .map(|(l, _)| (String::new(), l.trim().to_string()))
            });
            for (metric, label) in promql_labels(expr).into_iter().chain(legend_labels) {
                if label == "le" || TARGET_LABELS.contains(&label.as_str()) {
                    continue;
                }
                let ok = if metric.is_empty() {
                    // A grouping: some metric of the query must carry it (only checkable
                    // when the scrape had samples of them all).
                    !known_samples || names.iter().any(|n| exported(n).contains(&label))
                } else {
                    !scrape.labels.contains_key(&metric) || exported(&metric).contains(&label)
                };
                assert!(
                    ok,
                    "{title}: label {label:?} is not on {} ({expr}); they have: {:?}",
                    if metric.is_empty() {
                        format!("{names:?}")
                    } else {
                        metric.clone()
                    },
                    names.iter().map(|n| (n, exported(n))).collect::<Vec<_>>()
                );
            }
            for n in names {
                assert!(
                    scrape.has(&n),
                    "{title}: {n} is not in the proxy's /metrics ({expr}); it has:\n{}",
                    text.lines()
                        .filter(|l| l.starts_with("# TYPE"))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                queried.insert(n);
            }
        }
    }
    // What the dashboard is for.
    for want in [
        "process_resident_memory_bytes",
        "kube_cache_proxy_upstream_up",
        "kube_cache_proxy_degraded",
        "kube_cache_proxy_passthrough_total",
        "kube_cache_proxy_connections",
        "kube_cache_proxy_requests_total",
        "kube_cache_proxy_upstream_requests_total",
        "kube_cache_proxy_watchers",
        "kube_cache_proxy_watch_events_sent_total",
        "kube_cache_proxy_list_snapshot_bytes",
        "kube_cache_proxy_page_size",
    ] {
        assert!(queried.contains(want), "the dashboard shows {want}");
    }
}

/// An admin kubeconfig file for `cp` in `dir`.
fn admin_kubeconfig(cp: &ControlPlane, dir: &Path) -> PathBuf {
    let p = dir.join("admin.kubeconfig");
    std::fs::write(&p, cp.admin_kubeconfig_yaml()).unwrap();
    p
}

async fn start_control_plane() -> (ControlPlane, tempfile::TempDir, PathBuf) {
    tokio::task::spawn_blocking(tools).await.unwrap();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let dir = tempfile::tempdir().unwrap();
    let kc = admin_kubeconfig(&cp, dir.path());
    (cp, dir, kc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendered_manifests_pass_a_server_side_dry_run() {
    let (cp, dir, kc) = start_control_plane().await;
    let base = kustomize("base");
    // The namespace for real first (with its Pod Security labels): a dry run creates nothing,
    // so the namespaced objects would not find it.
    let base_docs = docs(&base);
    apply(&kc, &[one(&base_docs, "Namespace")]);
    let renders = [
        ("kustomize base", base),
        ("kustomize overlays/ha", kustomize("overlays/ha")),
        ("helm defaults", helm_template(&[])),
        (
            "helm with options",
            helm_template(&[
                "tls.clientCAConfigMap=kube-cache-proxy-client-ca",
                "priorityClassName=system-cluster-critical",
                "networkPolicy.apiserverCIDRs[0].cidr=10.0.0.1/32",
                "tokens.keyFile=signing-keys",
            ]),
        ),
        (
            "helm with all, the dashboard, extra volumes",
            helm_template(&[
                "cache.resources={all}",
                "grafanaDashboard.enabled=true",
                "image.digest=sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                "volumes[0].name=extra",
                "volumes[0].emptyDir.medium=Memory",
                "volumeMounts[0].name=extra",
                "volumeMounts[0].mountPath=/extra",
            ]),
        ),
    ];
    for (what, yaml) in &renders {
        let n = docs(yaml).len();
        let out = kubectl(&kc, &["apply", "--dry-run=server", "-f", "-"], Some(yaml));
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let stdout = ok_stdout(&format!("{what}: kubectl apply --dry-run=server"), out);
        let accepted = stdout
            .lines()
            .filter(|l| l.ends_with("(server dry run)"))
            .count();
        assert_eq!(accepted, n, "{what}: every object accepted:\n{stdout}");
        // The namespace warns on Pod Security "restricted" violations of pod templates.
        assert!(
            !stderr.contains("Warning"),
            "{what}: the apiserver warned:\n{stderr}"
        );
    }
    // Nothing but the namespace was created.
    let out = kubectl(
        &kc,
        &[
            "get",
            "deployments,services,configmaps",
            "-n",
            NS,
            "-o",
            "name",
        ],
        None,
    );
    let names = ok_stdout("kubectl get", out);
    assert!(
        !names.contains("kube-cache-proxy"),
        "a dry run created objects: {names}"
    );

    // The chart's NOTES print a kubeconfig for controllers that names the Service.
    let home = tempfile::tempdir().unwrap();
    let out = run(
        helm(home.path())
            .args(["install", RELEASE])
            .arg(repo().join("deploy/helm/kube-cache-proxy"))
            .args(["--namespace", NS, "--dry-run=server", "--kubeconfig"])
            .arg(&kc),
        None,
    );
    let printed = ok_stdout("helm install --dry-run=server", out);
    let notes = printed
        .split_once("NOTES:")
        .expect("helm prints the NOTES")
        .1;
    let start = notes
        .find("apiVersion: v1\nkind: Config")
        .expect("a kubeconfig");
    let end = notes[start..].find("current-context:").unwrap() + start;
    let end = notes[end..].find('\n').unwrap() + end;
    let snippet = &notes[start..end];
    let parsed = kube::config::Kubeconfig::from_yaml(snippet)
        .unwrap_or_else(|e| panic!("NOTES kubeconfig does not parse: {e}\n{snippet}"));
    assert_eq!(
        parsed.clusters[0]
            .cluster
            .as_ref()
            .unwrap()
            .server
            .as_deref(),
        Some(format!("https://{RELEASE}.{NS}.svc:443").as_str())
    );
    // With cert-manager on, the NOTES still say that the continue-token Secret is the
    // user's to create (cert-manager writes only the serving certificate). The API needs
    // the Certificate kind for a server-side dry run: a stand-in CRD.
    apply(
        &kc,
        &[&json!({
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "certificates.cert-manager.io"},
            "spec": {
                "group": "cert-manager.io",
                "scope": "Namespaced",
                "names": {"kind": "Certificate", "plural": "certificates",
                          "singular": "certificate", "listKind": "CertificateList"},
                "versions": [{"name": "v1", "served": true, "storage": true,
                              "schema": {"openAPIV3Schema": {"type": "object",
                                  "x-kubernetes-preserve-unknown-fields": true}}}],
            },
        })],
    );
    let notes = eventually("a dry run with cert-manager", BOUND, async || {
        let out = run(
            helm(home.path())
                .args(["install", RELEASE])
                .arg(repo().join("deploy/helm/kube-cache-proxy"))
                .args(["--namespace", NS, "--dry-run=server", "--kubeconfig"])
                .arg(&kc)
                .args(["--set", "tls.certManager.enabled=true"])
                .args(["--set", "tls.certManager.issuerRef.name=cluster-ca"]),
            None,
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(text)
    })
    .await;
    let notes = notes.split_once("NOTES:").expect("helm prints the NOTES").1;
    assert!(
        notes.contains("until the Secret\nkube-cache-proxy-tokens holds the key file keys"),
        "{notes}"
    );
    // The example kubeconfig names the same Service.
    let example =
        std::fs::read_to_string(repo().join("deploy/examples/controller-kubeconfig.yaml")).unwrap();
    let example = kube::config::Kubeconfig::from_yaml(&example).unwrap();
    assert_eq!(
        example.clusters[0]
            .cluster
            .as_ref()
            .unwrap()
            .server
            .as_deref(),
        Some(format!("https://kube-cache-proxy.{NS}.svc:443").as_str())
    );
    drop(dir);
    cp.stop().await;
}

/// ClusterRoleBindings every cluster has that grant authenticated users or all
/// ServiceAccounts something the proxy uses (discovery, /readyz, /version, access reviews of
/// oneself, the issuer's discovery documents). Removed so the proxy runs with the rules from
/// deploy/ alone.
const DEFAULT_GRANTS: [&str; 4] = [
    "system:discovery",
    "system:basic-user",
    "system:public-info-viewer",
    "system:service-account-issuer-discovery",
];

/// Applies the rendered base's Namespace, ServiceAccount and RBAC for real, removes the default
/// cluster-wide grants, and returns a token for the ServiceAccount (TokenRequest API).
fn install_rbac_and_get_token(kc: &Path, base: &[Value]) -> String {
    let objects: Vec<&Value> = [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
    ]
    .iter()
    .flat_map(|k| of_kind(base, k))
    .collect();
    apply(kc, &objects);
    let mut args = vec!["delete", "clusterrolebinding"];
    args.extend(DEFAULT_GRANTS);
    ok_stdout("deleting default grants", kubectl(kc, &args, None));
    // What is left grants nothing to groups the proxy's ServiceAccount is in.
    let out = kubectl(
        kc,
        &[
            "get",
            "clusterrolebindings,rolebindings",
            "-A",
            "-o",
            "json",
        ],
        None,
    );
    let all: Value = serde_json::from_str(&ok_stdout("kubectl get bindings", out)).unwrap();
    let sa = one(base, "ServiceAccount")["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let ns_group = format!("system:serviceaccounts:{NS}");
    for b in all["items"].as_array().unwrap() {
        for s in b["subjects"].as_array().into_iter().flatten() {
            let name = s["name"].as_str().unwrap_or_default();
            let ours = s["kind"] == "ServiceAccount" && name == sa && s["namespace"] == NS;
            let group_of_ours = s["kind"] == "Group"
                && [
                    "system:authenticated",
                    "system:serviceaccounts",
                    ns_group.as_str(),
                ]
                .contains(&name);
            assert!(!group_of_ours, "a binding still grants {name}: {b}");
            if ours {
                let role = b["roleRef"]["name"].as_str().unwrap();
                assert!(
                    role == sa || role == "system:auth-delegator",
                    "unexpected binding of the proxy: {b}"
                );
            }
        }
    }
    let out = kubectl(
        kc,
        &["create", "token", &sa, "-n", NS, "--duration=1h"],
        None,
    );
    ok_stdout("kubectl create token", out).trim().to_string()
}

async fn wait_ready(c: &support::proxy::TestClient, url: &str, cached: &[String]) -> String {
    let body = eventually("readiness", BOUND, async || {
        let r = c.get(url, None).await;
        let code = r.status();
        let body = body_string(r).await;
        ok_if(code == 200, body)
    })
    .await;
    for res in cached {
        assert!(
            body.lines().any(|l| l == format!("[+]cache:{res} ok")),
            "{res} missing from readyz:\n{body}"
        );
    }
    body
}

/// `kube_cache_proxy_requests_total` served from the cache for `resource` and `verb`.
async fn served_from_cache(proxy: &TestProxy, resource: &str, verb: &str) -> f64 {
    let c = proxy.client(None, false);
    let m = body_string(c.get(&proxy.admin("/metrics"), None).await).await;
    m.lines()
        .filter(|l| {
            l.starts_with("kube_cache_proxy_requests_total{")
                && l.contains(&format!("resource=\"{resource}\""))
                && l.contains(&format!("verb=\"{verb}\""))
                && l.contains("served_by=\"cache\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_runs_with_exactly_the_rbac_from_deploy() {
    let (cp, dir, kc) = start_control_plane().await;
    // The HA overlay: the base plus client certificates, whose callers are impersonated.
    let base = docs(&kustomize("overlays/ha"));
    let (_, deploy_cfg) = proxy_config(&base);
    let token = install_rbac_and_get_token(&kc, &base);

    // Test data and the test callers' own permissions (not the proxy's).
    let ns = "e2e-deploy";
    cp.create_default_service_account(ns).await.unwrap();
    let setup = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "seed", "namespace": ns}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "robot", "namespace": ns}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "cm-rw", "namespace": ns},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch", "create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "cm-rw", "namespace": ns},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm-rw"},
         "subjects": [{"kind": "Group", "name": "e2e-writers", "apiGroup": "rbac.authorization.k8s.io"}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "e2e-self-review"},
         "rules": [{"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"], "verbs": ["create"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "e2e-self-review"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "e2e-self-review"},
         "subjects": [
            {"kind": "User", "name": "carol", "apiGroup": "rbac.authorization.k8s.io"},
            {"kind": "ServiceAccount", "name": "robot", "namespace": ns}]},
    ]});
    ok_stdout(
        "test setup",
        kubectl(&kc, &["apply", "-f", "-"], Some(&setup.to_string())),
    );

    // The proxy, in-process, with the ServiceAccount's token as its only credential and the
    // deploy configuration's cache.
    let upstream_yaml =
        ControlPlane::kubeconfig_yaml(&cp.url, Some(&cp.ca_pem), Some(&token), None);
    let upstream = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::from_yaml(&upstream_yaml).unwrap(),
        &Default::default(),
    )
    .await
    .unwrap();
    let resources = deploy_cfg.cache.resources.clone();
    let proxy = TestProxy::start_with_kube(upstream, move |c| c.cache.resources = resources).await;
    let anon = proxy.client(None, true);
    let readyz = wait_ready(
        &anon,
        &proxy.admin("/readyz?verbose"),
        &deploy_cfg.cache.resources,
    )
    .await;
    assert!(readyz.lines().any(|l| l == "[+]upstream ok"), "{readyz}");

    // A list and a watch through the proxy, served from its cache (bearer caller).
    let admin = cp.admin_token().to_string();
    let before_list = served_from_cache(&proxy, "configmaps", "LIST").await;
    let r = anon
        .get(
            &proxy.https(&format!(
                "/api/v1/namespaces/{ns}/configmaps?resourceVersion=0"
            )),
            Some(&admin),
        )
        .await;
    assert_eq!(r.status(), 200);
    let list = body_json(r).await;
    let names: Vec<_> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
        .collect();
    assert!(names.contains(&"seed".to_string()), "{list}");
    assert_eq!(
        served_from_cache(&proxy, "configmaps", "LIST").await,
        before_list + 1.0
    );
    let rv = list["metadata"]["resourceVersion"].as_str().unwrap();
    let r = anon
        .get(
            &proxy.https(&format!(
                "/api/v1/namespaces/{ns}/configmaps?watch=1&resourceVersion={rv}"
            )),
            Some(&admin),
        )
        .await;
    assert_eq!(r.status(), 200);
    let mut events = EventReader::new(r);
    let created = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "after-watch", "namespace": ns}});
    ok_stdout(
        "create configmap",
        kubectl(&kc, &["apply", "-f", "-"], Some(&created.to_string())),
    );
    let ev = tokio::time::timeout(BOUND, events.next())
        .await
        .expect("a watch event")
        .expect("the watch stays open");
    assert_eq!(ev["type"], "ADDED");
    assert_eq!(ev["object"]["metadata"]["name"], "after-watch");
    assert!(served_from_cache(&proxy, "configmaps", "WATCH").await >= 1.0);

    // The Grafana dashboard queries only what this proxy exports, scraped after the traffic
    // above and one request the apiserver answers (leases pass through), so the request,
    // watch and upstream series exist.
    let r = anon
        .get(
            &proxy.https(&format!(
                "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
            )),
            Some(&admin),
        )
        .await;
    assert_eq!(r.status(), 200);
    let scrape = body_string(
        proxy
            .client(None, false)
            .get(&proxy.admin("/metrics"), None)
            .await,
    )
    .await;
    check_dashboard(&scrape);

    // A client-certificate caller: impersonated towards the apiserver with the proxy's token.
    let (cert, key) = support::proxy::client_cert(&proxy.client_ca, "carol", &["e2e-writers"]);
    let carol = proxy.client(Some((&cert, &key)), true);
    let review = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"});
    let post = |path: &str, body: &Value| {
        http::Request::post(proxy.https(path))
            .header("content-type", "application/json")
            .body(Full::from(body.to_string()))
            .unwrap()
    };
    let r = carol
        .send(post(
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            &review,
        ))
        .await;
    assert_eq!(r.status(), 201);
    let who = body_json(r).await;
    assert_eq!(who["status"]["userInfo"]["username"], "carol", "{who}");
    assert!(
        strings(&who["status"]["userInfo"]["groups"]).contains(&"e2e-writers".to_string()),
        "{who}"
    );
    // A write as carol passes through as carol: allowed in her namespace, refused elsewhere
    // with the apiserver's message naming her (not the proxy).
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "by-carol"}});
    let r = carol
        .send(post(&format!("/api/v1/namespaces/{ns}/configmaps"), &cm))
        .await;
    assert_eq!(r.status(), 201);
    let r = carol
        .send(post("/api/v1/namespaces/default/configmaps", &cm))
        .await;
    assert_eq!(r.status(), 403);
    let refused = body_json(r).await;
    assert!(
        refused["message"]
            .as_str()
            .unwrap()
            .contains("User \"carol\""),
        "{refused}"
    );
    // A cache-served read by carol: authorized by a SubjectAccessReview with the proxy's
    // credentials (system:auth-delegator), then answered from memory.
    let allowed_before = proxy
        .running
        .as_ref()
        .unwrap()
        .state
        .authz
        .stats
        .allowed
        .load(std::sync::atomic::Ordering::Relaxed);
    let before_list = served_from_cache(&proxy, "configmaps", "LIST").await;
    let r = carol
        .get(
            &proxy.https(&format!(
                "/api/v1/namespaces/{ns}/configmaps?resourceVersion=0"
            )),
            None,
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        served_from_cache(&proxy, "configmaps", "LIST").await,
        before_list + 1.0,
        "carol's list was not served from the cache"
    );
    let allowed_after = proxy
        .running
        .as_ref()
        .unwrap()
        .state
        .authz
        .stats
        .allowed
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        allowed_after,
        allowed_before + 1,
        "one SubjectAccessReview allowed"
    );
    // The same cache-served read in a namespace carol may not read: not served from memory;
    // the apiserver refuses it as carol.
    let r = carol
        .get(
            &proxy.https("/api/v1/namespaces/default/configmaps?resourceVersion=0"),
            None,
        )
        .await;
    assert_eq!(r.status(), 403);

    // A certificate naming a ServiceAccount impersonates it (impersonate on serviceaccounts).
    let (cert, key) = support::proxy::client_cert(
        &proxy.client_ca,
        &format!("system:serviceaccount:{ns}:robot"),
        &[],
    );
    let robot = proxy.client(Some((&cert, &key)), true);
    let r = robot
        .send(post(
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            &review,
        ))
        .await;
    assert_eq!(r.status(), 201);
    let who = body_json(r).await;
    assert_eq!(
        who["status"]["userInfo"]["username"],
        format!("system:serviceaccount:{ns}:robot"),
        "{who}"
    );

    proxy.shutdown().await;
    drop(dir);
    cp.stop().await;
}

/// Polls `url` through `client` until `ok` holds for (status, body) or BOUND passes.
async fn poll(client: &kube::Client, url: &str, ok: impl Fn(u16, &str) -> bool) -> String {
    eventually(url, BOUND, async || {
        let req = http::Request::get(url).body(Vec::new()).unwrap();
        let (code, body) = match client.send(req.map(Into::into)).await {
            Ok(r) => {
                let code = r.status().as_u16();
                let b = http_body_util::BodyExt::collect(r.into_body())
                    .await
                    .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                    .unwrap_or_default();
                (code, b)
            }
            Err(e) => (0, e.to_string()),
        };
        if ok(code, &body) {
            return Ok(body);
        }
        Err(format!("{code}: {body}"))
    })
    .await
}

/// A line of a continue-token key file: `<id> <base64 secret>` with 32 random bytes.
fn key_line(id: &str) -> String {
    use base64::Engine as _;
    let mut secret = [0u8; 32];
    std::io::Read::read_exact(
        &mut std::fs::File::open("/dev/urandom").unwrap(),
        &mut secret,
    )
    .unwrap();
    format!(
        "{id} {}\n",
        base64::engine::general_purpose::STANDARD.encode(secret)
    )
}

/// One replica of the Deployment, as a process outside a pod: the real binary with the deploy
/// configuration, only its file paths and listen address changed, the in-cluster environment
/// (ServiceAccount files, KUBERNETES_SERVICE_HOST/PORT) and nothing else.
struct Replica {
    child: tokio::process::Child,
    /// The admin's token through this replica, trusting its serving CA.
    client: kube::Client,
    /// The same on the replica's admin listener (its own health and /metrics, behind the
    /// deploy configuration's authentication and authorization).
    admin: kube::Client,
    log: PathBuf,
}

impl Replica {
    async fn start(
        cp: &ControlPlane,
        dir: &Path,
        name: &str,
        deploy_config: &str,
        sa_dir: &Path,
        key_file: &Path,
    ) -> Replica {
        let dir = dir.join(name);
        std::fs::create_dir_all(dir.join("home")).unwrap();
        // The serving pair the TLS Secret would hold.
        let (ca_pem, cert, key) =
            kube_cache_proxy::http::tls::generate_serving_pair(&["127.0.0.1", "localhost"])
                .unwrap();
        std::fs::write(dir.join("tls.crt"), cert).unwrap();
        std::fs::write(dir.join("tls.key"), key).unwrap();
        let [port, admin_port] = kube_cache_proxy::app::dev::free_loopback_ports::<2>().unwrap();
        let mut cfg: Value = serde_saphyr::from_str(deploy_config).unwrap();
        cfg["listen"] = json!(format!("127.0.0.1:{port}"));
        cfg["server"]["adminListen"] = json!(format!("127.0.0.1:{admin_port}"));
        cfg["tls"]["certFile"] = json!(dir.join("tls.crt"));
        cfg["tls"]["keyFile"] = json!(dir.join("tls.key"));
        cfg["tokens"]["keyFile"] = json!(key_file);
        cfg["upstream"]["serviceAccountDir"] = json!(sa_dir);
        let cfg_file = dir.join("config.yaml");
        std::fs::write(&cfg_file, cfg.to_string()).unwrap();
        let (api_host, api_port) = cp
            .url
            .strip_prefix("https://")
            .and_then(|a| a.rsplit_once(':'))
            .unwrap();
        let log = dir.join("proxy.log");
        let child = tokio::process::Command::new(proxy_bin())
            .args(["serve", "--config"])
            .arg(&cfg_file)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            // No kubeconfig to fall back on: in-cluster or nothing.
            .env("HOME", dir.join("home"))
            .env("KUBERNETES_SERVICE_HOST", api_host)
            .env("KUBERNETES_SERVICE_PORT", api_port)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let client_at = async |port: u16| {
            kube_cache_proxy::app::dev::client_from_kubeconfig(&ControlPlane::kubeconfig_yaml(
                &format!("https://127.0.0.1:{port}"),
                Some(&ca_pem),
                Some(cp.admin_token()),
                None,
            ))
            .await
            .unwrap()
        };
        let client = client_at(port).await;
        let admin = client_at(admin_port).await;
        Replica {
            child,
            client,
            admin,
            log,
        }
    }

    /// Waits for `/readyz` and checks every cache is listed ok.
    async fn wait_ready(&mut self, cached: &[String]) {
        let log = |r: &Replica| std::fs::read_to_string(&r.log).unwrap_or_default();
        let readyz = eventually("the replica's readiness", BOUND, async || {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("the proxy exited ({status}):\n{}", log(self));
            }
            let (code, body) = self.get_admin_text("/readyz?verbose").await;
            if code == 200 {
                return Ok(body);
            }
            Err(format!("{code} {body}\n{}", log(self)))
        })
        .await;
        for res in cached {
            assert!(
                readyz.lines().any(|l| l == format!("[+]cache:{res} ok")),
                "{res}: {readyz}\n{}",
                log(self)
            );
        }
    }

    /// A GET on the replica's admin listener.
    async fn get_admin_text(&self, path: &str) -> (u16, String) {
        let req = http::Request::get(path).body(Vec::new()).unwrap();
        match self.admin.send(req.map(Into::into)).await {
            Ok(r) => {
                let code = r.status().as_u16();
                let b = http_body_util::BodyExt::collect(r.into_body())
                    .await
                    .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
                    .unwrap_or_default();
                (code, b)
            }
            Err(e) => (0, e.to_string()),
        }
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        let req = http::Request::get(path).body(Vec::new()).unwrap();
        let r = self.client.send(req.map(Into::into)).await.unwrap();
        let code = r.status().as_u16();
        let b = http_body_util::BodyExt::collect(r.into_body())
            .await
            .unwrap()
            .to_bytes();
        (code, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    async fn served_from_cache(&self, resource: &str, verb: &str) -> f64 {
        // The deploy configuration protects /metrics: the admin (system:masters) may read it.
        let m = poll(&self.admin, "/metrics", |code, _| code == 200).await;
        m.lines()
            .filter(|l| {
                l.starts_with("kube_cache_proxy_requests_total{")
                    && l.contains(&format!("resource=\"{resource}\""))
                    && l.contains(&format!("verb=\"{verb}\""))
                    && l.contains("served_by=\"cache\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// `kubectl auth can-i VERB RESOURCE` as the proxy's ServiceAccount: "yes" or "no".
fn can_i(kc: &Path, sa: &str, verb: &str, resource: &str) -> String {
    let out = kubectl(
        kc,
        &[
            "auth",
            "can-i",
            verb,
            resource,
            "--all-namespaces",
            &format!("--as=system:serviceaccount:{NS}:{sa}"),
        ],
        None,
    );
    // Exit status 1 with "no" on stdout is an answer, not a failure.
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        answer == "yes" || answer == "no",
        "can-i {verb} {resource}: {answer}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    answer
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chart_rbac_for_all_flow_control_and_check_config_discovery_on_a_real_apiserver() {
    let (cp, dir, kc) = start_control_plane().await;
    let crd = json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                 "versions": [{"name": "v1", "served": true, "storage": true,
                               "schema": {"openAPIV3Schema": {"type": "object",
                                   "x-kubernetes-preserve-unknown-fields": true}}}]}});
    ok_stdout(
        "create the CRD",
        kubectl(&kc, &["apply", "-f", "-"], Some(&crd.to_string())),
    );
    ok_stdout(
        "wait for the CRD",
        kubectl(
            &kc,
            &[
                "wait",
                "--for=condition=Established",
                "crd/widgets.example.com",
                "--timeout=90s",
            ],
            None,
        ),
    );

    // `cache.resources: [all]`: the rendered RBAC, applied for real, lets the proxy's
    // ServiceAccount list and watch anything, custom resources included; no impersonation.
    let rendered = docs(&helm_template(&["cache.resources={all}"]));
    // The chart installs into an existing namespace (helm install -n NS --create-namespace).
    ok_stdout(
        "create namespace",
        kubectl(&kc, &["create", "namespace", NS], None),
    );
    // The cluster's default grants stay: `kubectl auth can-i --as` asks as the
    // ServiceAccount (a SelfSubjectAccessReview, which system:basic-user allows), and none of
    // them grants reading or impersonating anything asked below.
    let objects: Vec<&Value> = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding"]
        .iter()
        .flat_map(|k| of_kind(&rendered, k))
        .collect();
    apply(&kc, &objects);
    let sa = one(&rendered, "ServiceAccount")["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_string();
    let token = ok_stdout(
        "kubectl create token",
        kubectl(
            &kc,
            &["create", "token", &sa, "-n", NS, "--duration=1h"],
            None,
        ),
    )
    .trim()
    .to_string();
    for resource in [
        "pods",
        "configmaps",
        "secrets",
        "leases.coordination.k8s.io",
        "widgets.example.com",
        "customresourcedefinitions.apiextensions.k8s.io",
    ] {
        for verb in ["get", "list", "watch"] {
            assert_eq!(can_i(&kc, &sa, verb, resource), "yes", "{verb} {resource}");
        }
        assert_eq!(
            can_i(&kc, &sa, "delete", resource),
            "no",
            "delete {resource}"
        );
    }
    for resource in ["users", "groups", "serviceaccounts"] {
        assert_eq!(can_i(&kc, &sa, "impersonate", resource), "no", "{resource}");
    }
    // With client certificates on, impersonation is granted.
    let with_certs = docs(&helm_template(&[
        "cache.resources={all}",
        "tls.clientCAConfigMap=kube-cache-proxy-client-ca",
    ]));
    apply(&kc, &of_kind(&with_certs, "ClusterRole"));
    for resource in ["users", "groups", "serviceaccounts"] {
        eventually(
            &format!("impersonate {resource} granted"),
            BOUND,
            async || {
                let a = can_i(&kc, &sa, "impersonate", resource);
                ok_if(a == "yes", a)
            },
        )
        .await;
    }

    // The FlowSchema and PriorityLevelConfiguration are accepted by the apiserver, and the
    // proxy's own requests land in its priority level (the apiserver says which in the
    // X-Kubernetes-PF-PriorityLevel-UID response header).
    let flow: Vec<&Value> = ["PriorityLevelConfiguration", "FlowSchema"]
        .iter()
        .flat_map(|k| of_kind(&rendered, k))
        .collect();
    assert_eq!(flow.len(), 2);
    apply(&kc, &flow);
    let plc: Value = serde_json::from_str(&ok_stdout(
        "get prioritylevelconfiguration",
        kubectl(
            &kc,
            &["get", "prioritylevelconfiguration", RELEASE, "-o", "json"],
            None,
        ),
    ))
    .unwrap();
    let plc_uid = plc["metadata"]["uid"].as_str().unwrap().to_string();
    let sa_client = cp.client_for_token(&token).await.unwrap();
    eventually(
        "the proxy's requests in its priority level",
        BOUND,
        async || {
            let req = http::Request::get("/api/v1/namespaces/default/configmaps?limit=1")
                .body(kube::client::Body::from(Vec::new()))
                .unwrap();
            let resp = sa_client.send(req).await.map_err(|e| e.to_string());
            match resp {
                Ok(r) => {
                    let level = r
                        .headers()
                        .get("X-Kubernetes-PF-PriorityLevel-UID")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string();
                    ok_if(level == plc_uid, level)
                }
                Err(e) => ok_if(false, e),
            }
        },
    )
    .await;

    // check-config --kubeconfig: cache.resources against this apiserver's discovery.
    let kustomize_cfg = "deploy/kustomize/base/config.yaml";
    let out = run(
        Command::new(proxy_bin())
            .args(["check-config", "--no-files", "--kubeconfig"])
            .arg(&kc)
            .arg(kustomize_cfg)
            .current_dir(repo()),
        None,
    );
    let stdout = ok_stdout("check-config --kubeconfig (the shipped config)", out);
    assert_eq!(stdout, format!("{kustomize_cfg}: ok\n"));
    let file = dir.path().join("typo.yaml");
    std::fs::write(
        &file,
        "insecureListen: 127.0.0.1:1\ncache:\n  resources: [all, pods, deployment.apps, \
         widgets.example.com, gadgets.example.com, bindings, configmaps]\n",
    )
    .unwrap();
    let out = run(
        Command::new(proxy_bin())
            .args(["check-config", "--kubeconfig"])
            .arg(&kc)
            .arg(&file),
        None,
    );
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = stderr.lines().skip(1).collect();
    assert_eq!(errors.len(), 3, "{stderr}");
    assert!(
        errors[0].contains("cache.resources[2]: \"deployment.apps\"")
            && errors[0].contains("did you mean deployments.apps?"),
        "{stderr}"
    );
    assert!(
        errors[1].contains("cache.resources[4]: \"gadgets.example.com\"")
            && errors[1].contains("no resource \"gadgets\" in API group \"example.com\""),
        "{stderr}"
    );
    // `bindings` is served but cannot be listed or watched.
    assert!(
        errors[2].contains("cache.resources[5]: \"bindings\"")
            && errors[2].contains("list and watch"),
        "{stderr}"
    );
    cp.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_run_on_the_in_cluster_config_and_share_continue_tokens() {
    let (cp, dir, kc) = start_control_plane().await;
    let base = docs(&kustomize("base"));
    let (text, deploy_cfg) = proxy_config(&base);
    let token = install_rbac_and_get_token(&kc, &base);
    let ns = "e2e-replicas";
    cp.create_default_service_account(ns).await.unwrap();
    let cms: Vec<Value> = (0..3)
        .map(|i| json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("cm-{i}"), "namespace": ns}}))
        .collect();
    ok_stdout(
        "creating configmaps",
        kubectl(
            &kc,
            &["apply", "-f", "-"],
            Some(&json!({"apiVersion": "v1", "kind": "List", "items": cms}).to_string()),
        ),
    );

    // What the kubelet mounts in every pod: the ServiceAccount's token, CA bundle and
    // namespace, and the continue-token key Secret.
    let sa_dir = dir.path().join("serviceaccount");
    std::fs::create_dir_all(&sa_dir).unwrap();
    std::fs::write(sa_dir.join("token"), &token).unwrap();
    std::fs::write(sa_dir.join("ca.crt"), &cp.ca_pem).unwrap();
    std::fs::write(sa_dir.join("namespace"), NS).unwrap();
    let shared_keys = dir.path().join("keys");
    std::fs::write(&shared_keys, key_line("k1")).unwrap();
    // A replica started without the shared Secret (its own key) for contrast.
    let other_keys = dir.path().join("other-keys");
    std::fs::write(&other_keys, key_line("other")).unwrap();

    let mut a = Replica::start(&cp, dir.path(), "a", &text, &sa_dir, &shared_keys).await;
    let mut b = Replica::start(&cp, dir.path(), "b", &text, &sa_dir, &shared_keys).await;
    let mut c = Replica::start(&cp, dir.path(), "c", &text, &sa_dir, &other_keys).await;
    for r in [&mut a, &mut b, &mut c] {
        // The caches synced with the ServiceAccount's token read from the file: the process
        // had no other credential.
        r.wait_ready(&deploy_cfg.cache.resources).await;
    }

    // A paginated list started on one replica continues on another holding the same keys,
    // from the cache on both.
    let base_path = format!("/api/v1/namespaces/{ns}/configmaps");
    let (code, first) = a.get(&format!("{base_path}?limit=2")).await;
    assert_eq!(code, 200, "{first}");
    assert_eq!(first["items"].as_array().unwrap().len(), 2, "{first}");
    let cont = first["metadata"]["continue"]
        .as_str()
        .expect("a continue token");
    let cont = percent_encode(cont);
    assert_eq!(a.served_from_cache("configmaps", "LIST").await, 1.0);
    let (code, second) = b.get(&format!("{base_path}?limit=2&continue={cont}")).await;
    assert_eq!(code, 200, "{second}");
    let names: Vec<&str> = first["items"]
        .as_array()
        .unwrap()
        .iter()
        .chain(second["items"].as_array().unwrap())
        .map(|i| i["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["cm-0", "cm-1", "cm-2"]);
    assert_eq!(b.served_from_cache("configmaps", "LIST").await, 1.0);
    // A replica with other keys (no shared Secret) cannot verify it: 400 BadRequest, which a
    // client's pager does not recover from by itself.
    let (code, refused) = c.get(&format!("{base_path}?limit=2&continue={cont}")).await;
    assert_eq!(code, 400, "{refused}");
    assert_eq!(refused["reason"], "BadRequest", "{refused}");
    assert!(
        refused["message"]
            .as_str()
            .unwrap()
            .contains("continue key is not valid"),
        "{refused}"
    );

    // SIGTERM: /readyz fails at once while the listener stays open for shutdown.delay, then
    // the process exits within the Deployment's grace period.
    let grace =
        one(&base, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap();
    let Replica {
        mut child, admin, ..
    } = a;
    let pid = child.id().unwrap();
    let term = std::time::Instant::now();
    ok_stdout(
        "kill -TERM",
        run(Command::new("kill").args(["-TERM", &pid.to_string()]), None),
    );
    let readyz = poll(&admin, "/readyz?verbose", |code, _| code == 500).await;
    assert!(readyz.contains("[-]shutdown failed"), "{readyz}");
    let status = tokio::time::timeout(Duration::from_secs(grace), child.wait())
        .await
        .expect("exits within terminationGracePeriodSeconds")
        .unwrap();
    assert!(status.success(), "{status}");
    assert!(
        term.elapsed() >= deploy_cfg.shutdown.delay,
        "listeners closed before shutdown.delay"
    );
    drop((b, c));
    cp.stop().await;
}

/// Percent-encodes a query parameter value.
fn percent_encode(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
