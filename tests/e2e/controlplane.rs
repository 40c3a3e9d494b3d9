//! The local control plane (`devcluster`) is a real, secured kube-apiserver: it becomes ready,
//! serves kubectl, enforces RBAC, authenticates tokens and client certificates, issues
//! ServiceAccount tokens, and leaves no process behind when stopped.
//!
//! The first run builds kube-apiserver, kubectl and etcd (several minutes; cached afterwards).

use base64::Engine as _;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::api::{Api, ListParams};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions, client_from_kubeconfig};

use crate::support::eventually::{ok_if, poll_within};

async fn get_text(client: &kube::Client, path: &str) -> Result<String, kube::Error> {
    client
        .request_text(http::Request::get(path).body(Vec::new()).unwrap())
        .await
}

/// The k8s.io/kubernetes version pinned in tests/e2e/go/go.mod, e.g. `v1.36.3`.
fn pinned_kubernetes_version() -> String {
    let go_mod = include_str!("go/go.mod");
    go_mod
        .lines()
        .find_map(|l| l.trim().strip_prefix("k8s.io/kubernetes "))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("go.mod requires k8s.io/kubernetes")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_is_a_real_secured_apiserver_and_stops_cleanly() {
    let started = std::time::Instant::now();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    eprintln!(
        "control plane ready in {:?} at {}",
        started.elapsed(),
        cp.url
    );
    let dir = cp.dir.clone();
    let pids = cp.pids();
    assert_eq!(pids.len(), 2, "etcd and kube-apiserver run");

    let admin = cp.admin_client().await.unwrap();
    assert_eq!(get_text(&admin, "/readyz").await.unwrap(), "ok");

    // kubectl with an admin kubeconfig sees the namespaces the apiserver bootstraps.
    let kubeconfig = dir.join("admin.kubeconfig");
    std::fs::write(&kubeconfig, cp.admin_kubeconfig_yaml()).unwrap();
    let out = std::process::Command::new(cp.kubectl())
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["get", "ns", "-o", "name"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.lines().any(|l| l == "namespace/default"), "{stdout}");
    assert!(
        stdout.lines().any(|l| l == "namespace/kube-system"),
        "{stdout}"
    );

    // Every binary is stamped with the version pinned in go.mod: `kubectl version` prints it
    // for the client and the server (an unstamped build fails to parse its own version).
    let pinned = pinned_kubernetes_version();
    let out = std::process::Command::new(cp.kubectl())
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .arg("version")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl version failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("Client Version: {pinned}\n")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("Server Version: {pinned}\n")),
        "{stdout}"
    );

    // RBAC is on: alice (authenticated, no bindings) may not list secrets.
    let alice = cp.client_for_token(&cp.user("alice").token).await.unwrap();
    match Api::<Secret>::all(alice).list(&ListParams::default()).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("alice listing secrets: expected 403, got {other:?}"),
    }
    // An unknown token is rejected outright.
    let nobody = cp.client_for_token("not-a-token").await.unwrap();
    match Api::<Secret>::all(nobody)
        .list(&ListParams::default())
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 401, "{s:?}"),
        other => panic!("unknown token: expected 401, got {other:?}"),
    }

    // Client certificates from the client CA authenticate (CN user, O groups).
    let (cert, key) = cp.mint_client_cert("carol", &["system:masters"]);
    let yaml = ControlPlane::kubeconfig_yaml(&cp.url, Some(&cp.ca_pem), None, Some((&cert, &key)));
    let carol = client_from_kubeconfig(&yaml).await.unwrap();
    let namespaces = Api::<Namespace>::all(carol)
        .list(&ListParams::default())
        .await
        .expect("client-cert admin lists namespaces");
    assert!(!namespaces.items.is_empty());

    // ServiceAccount tokens: a JWT from the token subresource, keys at the JWKS endpoint.
    cp.create_default_service_account("default").await.unwrap();
    let req = http::Request::post("/api/v1/namespaces/default/serviceaccounts/default/token")
        .header("content-type", "application/json")
        .body(
            br#"{"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{}}"#
                .to_vec(),
        )
        .unwrap();
    let resp: serde_json::Value = admin.request(req).await.expect("token request");
    let jwt = resp["status"]["token"].as_str().expect("status.token");
    let parts: Vec<&str> = jwt.split('.').collect();
    assert_eq!(parts.len(), 3, "{jwt}");
    let claims: serde_json::Value = serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(parts[1])
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        claims["iss"],
        "https://kubernetes.default.svc.cluster.local"
    );
    assert_eq!(claims["sub"], "system:serviceaccount:default:default");
    let jwks: serde_json::Value =
        serde_json::from_str(&get_text(&admin, "/openid/v1/jwks").await.unwrap()).unwrap();
    assert!(!jwks["keys"].as_array().expect("keys").is_empty(), "{jwks}");

    // The SA token authenticates too (and, without bindings, is forbidden secrets).
    let sa = cp.client_for_token(jwt).await.unwrap();
    match Api::<Secret>::namespaced(sa, "default")
        .list(&ListParams::default())
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 403, "{s:?}"),
        other => panic!("SA listing secrets: expected 403, got {other:?}"),
    }

    cp.stop().await;
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} still exists after stop"
        );
    }
    assert!(
        !dir.exists(),
        "temporary state dir {} removed",
        dir.display()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_creates_demo_namespaces_and_dropping_kills_children() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    cp.seed().await.unwrap();
    // Idempotent: a second seed finds everything in place.
    cp.seed().await.unwrap();
    let admin = cp.admin_client().await.unwrap();
    for ns in ["demo-a", "demo-b"] {
        let cms = Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(admin.clone(), ns)
            .list(&ListParams::default().labels("app=demo"))
            .await
            .unwrap();
        assert_eq!(cms.items.len(), 3, "configmaps in {ns}");
        let pods = Api::<k8s_openapi::api::core::v1::Pod>::namespaced(admin.clone(), ns)
            .list(&ListParams::default())
            .await
            .unwrap();
        assert_eq!(pods.items.len(), 2, "pods in {ns}");
    }
    let pids = cp.pids();
    let dir = cp.dir.clone();
    drop(cp);
    // SIGKILL is sent synchronously in Drop; the kernel needs a moment to tear down.
    // (Then the check below names any survivor.)
    let _survivors = poll_within(std::time::Duration::from_secs(10), async || {
        let running: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
        ok_if(running.is_empty(), running)
    })
    .await;
    for pid in pids {
        assert!(!alive(pid), "process {pid} survived drop");
    }
    assert!(!dir.exists());
}

/// Running (a reaped or zombie process counts as gone).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}
