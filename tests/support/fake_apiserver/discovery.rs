//! Discovery documents and `/version`.

use super::*;

pub(super) fn version_json() -> String {
    JsonObj::new()
        .str("major", "1")
        .str("minor", "36")
        .str("emulationMajor", "1")
        .str("emulationMinor", "36")
        .str("minCompatibilityMajor", "1")
        .str("minCompatibilityMinor", "35")
        .str("gitVersion", GIT_VERSION)
        .str("gitCommit", "0000000000000000000000000000000000000000")
        .str("gitTreeState", "clean")
        .str("buildDate", "2026-01-01T00:00:00Z")
        .str("goVersion", "go1.25.0")
        .str("compiler", "gc")
        .str("platform", "linux/amd64")
        .finish()
}

pub(super) fn api_versions_json(addr: SocketAddr) -> String {
    format!(
        r#"{{"kind":"APIVersions","versions":["v1"],"serverAddressByClientCIDRs":[{{"clientCIDR":"0.0.0.0/0","serverAddress":"{addr}"}}]}}"#
    )
}

/// An `APIGroup` with the one version v1.
pub(super) fn api_group_json(group: &str) -> String {
    format!(
        r#"{{"kind":"APIGroup","apiVersion":"v1","name":"{group}","versions":[{{"groupVersion":"{group}/v1","version":"v1"}}],"preferredVersion":{{"groupVersion":"{group}/v1","version":"v1"}}}}"#
    )
}

/// The `APIResourceList` of a one-resource group version (CRDs, widgets).
pub(super) fn group_resource_list_json(kind: Kind) -> String {
    let mut resources = vec![json!({
        "name": kind.resource(),
        "singularName": kind.kind().to_lowercase(),
        "namespaced": kind.namespaced(),
        "kind": kind.kind(),
        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
    })];
    if kind.has_status() {
        resources.push(json!({
            "name": format!("{}/status", kind.resource()),
            "singularName": "",
            "namespaced": kind.namespaced(),
            "kind": kind.kind(),
            "verbs": ["get", "patch", "update"],
        }));
    }
    JsonObj::new()
        .str("kind", "APIResourceList")
        .str("groupVersion", kind.api_version())
        .raw("resources", &to_json(&Value::Array(resources)))
        .finish()
}

/// Whether the widgets CRD exists (its resource is served).
pub(super) fn widgets_served(shared: &Shared) -> bool {
    shared.store().objects(Kind::Crd).contains_key(WIDGETS_CRD)
}

pub(super) fn api_resource_list_json() -> String {
    let mut resources = Vec::new();
    for kind in Kind::CORE {
        let (short, singular) = match kind {
            Kind::Namespace => ("ns", "namespace"),
            Kind::ConfigMap => ("cm", "configmap"),
            _ => ("po", "pod"),
        };
        let mut r = json!({
            "name": kind.resource(),
            "singularName": singular,
            "namespaced": kind.namespaced(),
            "kind": kind.kind(),
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            "shortNames": [short],
        });
        if kind == Kind::Pod {
            r["categories"] = json!(["all"]);
        }
        resources.push(r);
        if kind.has_status() {
            resources.push(json!({
                "name": format!("{}/status", kind.resource()),
                "singularName": "",
                "namespaced": kind.namespaced(),
                "kind": kind.kind(),
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    for (sub, k) in [
        ("attach", "PodAttachOptions"),
        ("exec", "PodExecOptions"),
        ("portforward", "PodPortForwardOptions"),
    ] {
        resources.push(json!({
            "name": format!("pods/{sub}"),
            "singularName": "",
            "namespaced": true,
            "kind": k,
            "verbs": ["create", "get"],
        }));
    }
    resources.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    JsonObj::new()
        .str("kind", "APIResourceList")
        .str("groupVersion", "v1")
        .raw("resources", &to_json(&Value::Array(resources)))
        .finish()
}
