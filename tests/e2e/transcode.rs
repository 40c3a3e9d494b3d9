//! The protobuf the proxy writes from an object's JSON (`k8s::transcode`) is kube-apiserver's,
//! byte for byte, for every object of every built-in resource of a real cluster: the
//! control plane's own objects (RBAC's bootstrap policy, flow control, the default
//! namespaces and services, CRDs, API services, leases, endpoints, events of
//! kube-controller-manager) and fixtures written to reach the schema's special cases (times
//! and micro-times, quantities, int-or-strings, raw extensions, base64 bytes, inlined
//! volume sources, maps of messages, pointers set to their zero value).

use std::collections::HashMap;

use crate::protobuf::{Direct, PROTOBUF};
use crate::support::pb as wire;
use crate::support::proxy::apiserver_client;
use http::Method;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::k8s::protobuf::object_meta;
use kube_cache_proxy::k8s::transcode::{SCHEMA, TranscodeError};
use prost::Message;
use serde_json::{Value, json};

#[derive(serde::Deserialize)]
struct RawList<'a> {
    #[serde(borrow)]
    items: Vec<&'a serde_json::value::RawValue>,
}

const JSON: &str = "application/json";
const NS: &str = "tc";

/// Objects chosen for the schema's special cases.
fn fixtures() -> Vec<(&'static str, Value)> {
    vec![
        (
            "/api/v1/namespaces/tc/pods",
            json!({
                "metadata": {"name": "rich", "labels": {"b": "2", "a": "1", "z.x": "y"},
                    "annotations": {"note": "héllo \u{2028} <tag> & \"q\""},
                    "finalizers": ["example.com/f"]},
                "spec": {
                    "containers": [{
                        "name": "c", "image": "img:1", "command": ["sh", "-c", ""],
                        "ports": [{"containerPort": 80, "protocol": "TCP", "name": "http"}],
                        "resources": {"limits": {"cpu": "1500m", "memory": "1Gi", "example.com/gpu": "2"},
                            "requests": {"cpu": "0.5", "memory": "100M", "example.com/gpu": "2"}},
                        "livenessProbe": {"httpGet": {"path": "/", "port": "http"},
                            "periodSeconds": 0, "timeoutSeconds": 3},
                        "readinessProbe": {"tcpSocket": {"port": 8080}},
                        "securityContext": {"privileged": false, "runAsUser": 0,
                            "capabilities": {"add": ["NET_ADMIN"]}},
                        "env": [{"name": "E", "value": ""},
                            {"name": "F", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        "volumeMounts": [{"name": "v", "mountPath": "/v", "readOnly": true}]
                    }],
                    "volumes": [
                        {"name": "v", "emptyDir": {"sizeLimit": "1Gi"}},
                        {"name": "cm", "configMap": {"name": "x", "defaultMode": 420, "optional": true}},
                        {"name": "p", "projected": {"sources": [{"serviceAccountToken": {"path": "t", "expirationSeconds": 3600}}]}}
                    ],
                    "terminationGracePeriodSeconds": 0,
                    "activeDeadlineSeconds": 100,
                    "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": -5}],
                    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "preference": {"matchExpressions": [{"key": "a", "operator": "In", "values": ["x", "y"]}]}}]}},
                    "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]}
                }
            }),
        ),
        (
            "/api/v1/namespaces/tc/secrets",
            json!({"metadata": {"name": "s"}, "data": {"k": "AAEC/w==", "empty": ""},
                "stringData": {"t": "text"}, "type": "Opaque"}),
        ),
        (
            "/api/v1/namespaces/tc/configmaps",
            json!({"metadata": {"name": "cm"}, "data": {"a": "", "b": "x\ny"},
                "binaryData": {"bin": "3q2+7w=="}, "immutable": false}),
        ),
        (
            "/api/v1/namespaces/tc/services",
            json!({"metadata": {"name": "svc"}, "spec": {
                "ports": [{"port": 80, "targetPort": "http", "name": "a"},
                    {"port": 81, "targetPort": 8081, "name": "b", "protocol": "UDP"}],
                "selector": {"app": "x"}, "sessionAffinity": "ClientIP",
                "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}}}),
        ),
        (
            "/apis/apps/v1/namespaces/tc/deployments",
            json!({"metadata": {"name": "d"}, "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": "d"}},
                "strategy": {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": 0}},
                "template": {"metadata": {"labels": {"app": "d"}},
                    "spec": {"containers": [{"name": "c", "image": "i"}]}}}}),
        ),
        (
            "/apis/apps/v1/namespaces/tc/controllerrevisions",
            json!({"metadata": {"name": "cr"}, "revision": 3,
                "data": {"spec": {"template": {"b": [1, 2.5, "x"], "a": null}}}}),
        ),
        (
            "/apis/batch/v1/namespaces/tc/cronjobs",
            json!({"metadata": {"name": "cj"}, "spec": {"schedule": "*/5 * * * *",
                "suspend": true, "timeZone": "Etc/UTC",
                "jobTemplate": {"spec": {"backoffLimit": 2, "template": {"spec": {
                    "restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}}}}}),
        ),
        (
            "/apis/autoscaling/v2/namespaces/tc/horizontalpodautoscalers",
            json!({"metadata": {"name": "hpa"}, "spec": {
                "scaleTargetRef": {"kind": "Deployment", "name": "d", "apiVersion": "apps/v1"},
                "minReplicas": 1, "maxReplicas": 3,
                "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                    "target": {"type": "AverageValue", "averageValue": "500m"}}}],
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]}}}}),
        ),
        (
            "/apis/coordination.k8s.io/v1/namespaces/tc/leases",
            json!({"metadata": {"name": "l"}, "spec": {"holderIdentity": "me",
                "leaseDurationSeconds": 15, "acquireTime": "2026-01-02T03:04:05.123456Z",
                "renewTime": "2026-01-02T03:04:06.000001Z", "leaseTransitions": 0}}),
        ),
        (
            "/apis/events.k8s.io/v1/namespaces/tc/events",
            json!({"metadata": {"name": "e"}, "eventTime": "2026-01-02T03:04:05.654321Z",
                "reportingController": "example.com/c", "reportingInstance": "i",
                "action": "A", "reason": "R", "type": "Normal", "note": "n",
                "regarding": {"kind": "Pod", "name": "rich", "namespace": NS},
                "series": {"count": 2, "lastObservedTime": "2026-01-02T03:04:07.000000Z"}}),
        ),
        (
            "/apis/policy/v1/namespaces/tc/poddisruptionbudgets",
            json!({"metadata": {"name": "pdb"}, "spec": {"maxUnavailable": "10%",
                "selector": {"matchExpressions": [{"key": "a", "operator": "Exists"}]}}}),
        ),
        (
            "/api/v1/persistentvolumes",
            json!({"metadata": {"name": "tc-pv"}, "spec": {"capacity": {"storage": "5Gi"},
                "accessModes": ["ReadWriteOnce"], "hostPath": {"path": "/tmp/x", "type": ""},
                "persistentVolumeReclaimPolicy": "Retain", "mountOptions": ["ro"]}}),
        ),
        (
            "/api/v1/namespaces/tc/resourcequotas",
            json!({"metadata": {"name": "q"}, "spec": {"hard": {"pods": "10", "requests.cpu": "2"},
                "scopeSelector": {"matchExpressions": [{"scopeName": "PriorityClass", "operator": "In", "values": ["x"]}]}}}),
        ),
        (
            "/api/v1/namespaces/tc/limitranges",
            json!({"metadata": {"name": "lr"}, "spec": {"limits": [{"type": "Container",
                "max": {"cpu": "2"}, "defaultRequest": {"cpu": "100m"}, "maxLimitRequestRatio": {"cpu": "10"}}]}}),
        ),
        (
            "/apis/node.k8s.io/v1/runtimeclasses",
            json!({"metadata": {"name": "tc-rc"}, "handler": "h",
                "overhead": {"podFixed": {"memory": "64Mi"}},
                "scheduling": {"nodeSelector": {"a": "b"}, "tolerations": [{"operator": "Exists"}]}}),
        ),
        (
            "/apis/networking.k8s.io/v1/namespaces/tc/networkpolicies",
            json!({"metadata": {"name": "np"}, "spec": {"podSelector": {},
                "ingress": [{"ports": [{"port": "http"}, {"port": 53, "endPort": 60, "protocol": "UDP"}],
                    "from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]}],
                "policyTypes": ["Ingress"]}}),
        ),
        (
            "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
            json!({"metadata": {"name": "tc-vwc"}, "webhooks": [{"name": "a.example.com",
                "clientConfig": {"url": "https://example.com/x", "caBundle": "AAAA"},
                "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                    "resources": ["pods"], "scope": "*"}],
                "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 5,
                "matchConditions": [{"name": "m", "expression": "true"}]}]}),
        ),
        (
            "/apis/storage.k8s.io/v1/storageclasses",
            json!({"metadata": {"name": "tc-sc"}, "provisioner": "example.com/p",
                "parameters": {"b": "2", "a": "1"}, "allowVolumeExpansion": true,
                "allowedTopologies": [{"matchLabelExpressions": [{"key": "z", "values": ["a"]}]}]}),
        ),
        (
            "/apis/scheduling.k8s.io/v1/priorityclasses",
            json!({"metadata": {"name": "tc-pc"}, "value": -10, "globalDefault": false,
                "preemptionPolicy": "Never"}),
        ),
        (
            "/api/v1/nodes",
            json!({"metadata": {"name": "tc-node", "labels": {"kubernetes.io/hostname": "tc-node"}},
                "spec": {"podCIDR": "10.0.0.0/24", "podCIDRs": ["10.0.0.0/24"],
                    "taints": [{"key": "k", "effect": "NoSchedule", "timeAdded": null}],
                    "unschedulable": true}}),
        ),
        (
            "/apis/apps/v1/namespaces/tc/statefulsets",
            json!({"metadata": {"name": "ss"}, "spec": {"serviceName": "svc", "replicas": 0,
                "selector": {"matchLabels": {"app": "ss"}},
                "template": {"metadata": {"labels": {"app": "ss"}},
                    "spec": {"containers": [{"name": "c", "image": "i"}]}},
                "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                    "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}],
                "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"}}}),
        ),
        (
            "/apis/batch/v1/namespaces/tc/jobs",
            json!({"metadata": {"name": "job"}, "spec": {"suspend": true, "parallelism": 2,
                "podFailurePolicy": {"rules": [{"action": "Ignore",
                    "onExitCodes": {"operator": "In", "values": [1, 2, 3]}}]},
                "template": {"spec": {"restartPolicy": "Never",
                    "containers": [{"name": "c", "image": "i"}]}}}}),
        ),
        (
            "/apis/networking.k8s.io/v1/namespaces/tc/ingresses",
            json!({"metadata": {"name": "ing"}, "spec": {"rules": [{"host": "a.example.com",
                "http": {"paths": [{"path": "/", "pathType": "Prefix",
                    "backend": {"service": {"name": "svc", "port": {"number": 80}}}}]}}]}}),
        ),
        (
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            json!({"metadata": {"name": "widgets.tc.example.com"}, "spec": {
                "group": "tc.example.com", "scope": "Namespaced",
                "names": {"plural": "widgets", "kind": "Widget"},
                "versions": [{"name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object",
                        "x-kubernetes-preserve-unknown-fields": true,
                        "properties": {"spec": {"type": "object", "default": {"a": 1},
                            "x-kubernetes-preserve-unknown-fields": true}}}}}]}}),
        ),
    ]
}

/// The listable resources the apiserver serves in protobuf: (path prefix, group, version,
/// resource, kind).
async fn built_in_resources(d: &Direct) -> Vec<(String, String, String, String, String)> {
    let mut versions = vec![(String::new(), "v1".to_string(), "/api/v1".to_string())];
    let apis: Value =
        serde_json::from_slice(&d.ok(Method::GET, "/apis", JSON, None).await).unwrap();
    for g in apis["groups"].as_array().unwrap() {
        for v in g["versions"].as_array().unwrap() {
            let gv = v["groupVersion"].as_str().unwrap();
            versions.push((
                g["name"].as_str().unwrap().to_string(),
                v["version"].as_str().unwrap().to_string(),
                format!("/apis/{gv}"),
            ));
        }
    }
    let mut out = Vec::new();
    for (group, version, prefix) in versions {
        let list: Value =
            serde_json::from_slice(&d.ok(Method::GET, &prefix, JSON, None).await).unwrap();
        for r in list["resources"].as_array().unwrap() {
            let name = r["name"].as_str().unwrap();
            let verbs: Vec<&str> = r["verbs"]
                .as_array()
                .map(|v| v.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            if name.contains('/') || !verbs.contains(&"list") {
                continue;
            }
            out.push((
                prefix.clone(),
                group.clone(),
                version.clone(),
                name.to_string(),
                r["kind"].as_str().unwrap().to_string(),
            ));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_built_in_objects_transcoded_protobuf_is_the_apiservers() {
    let cp = ControlPlane::start(ControlPlaneOptions {
        controller_manager: true,
        ..ControlPlaneOptions::default()
    })
    .await
    .expect("control plane");
    let d = Direct {
        http: apiserver_client(&cp.ca_pem, false),
        url: cp.url.clone(),
        token: cp.admin_token().to_string(),
    };
    d.ok(
        Method::POST,
        "/api/v1/namespaces",
        JSON,
        Some((JSON, json!({"metadata": {"name": NS}}))),
    )
    .await;
    for (path, obj) in fixtures() {
        d.ok(Method::POST, path, JSON, Some((JSON, obj))).await;
    }
    // Status as a kubelet writes it: conditions' times, container states, int64 sizes.
    let merge = "application/merge-patch+json";
    d.ok(
        Method::PATCH,
        "/api/v1/namespaces/tc/pods/rich/status",
        JSON,
        Some((
            merge,
            json!({"status": {
            "phase": "Running", "qosClass": "Burstable", "podIP": "10.0.0.5",
            "podIPs": [{"ip": "10.0.0.5"}], "startTime": "2026-01-02T03:04:05Z",
            "conditions": [{"type": "Ready", "status": "True",
                "lastTransitionTime": "2026-01-02T03:04:06Z", "lastProbeTime": null}],
            "containerStatuses": [{"name": "c", "ready": true, "restartCount": 0,
                "image": "img:1", "imageID": "", "started": true,
                "state": {"running": {"startedAt": "2026-01-02T03:04:05Z"}},
                "lastState": {"terminated": {"exitCode": -1, "startedAt": null,
                    "finishedAt": "2026-01-02T03:04:04Z", "reason": "Error"}},
                "allocatedResources": {"cpu": "500m"}}]}}),
        )),
    )
    .await;
    d.ok(
        Method::PATCH,
        "/api/v1/nodes/tc-node/status",
        JSON,
        Some((
            merge,
            json!({"status": {
            "capacity": {"cpu": "4", "memory": "16Gi", "pods": "110"},
            "allocatable": {"cpu": "3900m", "memory": "15Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True",
                "lastHeartbeatTime": "2026-01-02T03:04:05Z",
                "lastTransitionTime": "2026-01-02T03:04:05Z", "reason": "KubeletReady"}],
            "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {"machineID": "m", "systemUUID": "u", "bootID": "b",
                "kernelVersion": "6", "osImage": "o", "containerRuntimeVersion": "c",
                "kubeletVersion": "v1.36.3", "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": "amd64"},
            "images": [{"names": ["img:1"], "sizeBytes": 123456789012i64}]}}),
        )),
    )
    .await;

    let mut compared: HashMap<String, usize> = HashMap::new();
    let mut opaque: Vec<String> = Vec::new();
    let mut failures: Vec<String> = Vec::new();
    for (prefix, group, version, resource, kind) in built_in_resources(&d).await {
        // The fixture CRD's own resource: custom resources have no protobuf.
        if group == "tc.example.com" {
            continue;
        }
        if !SCHEMA.knows(&group, &version, &kind) {
            failures.push(format!("{group}/{version} {kind}: not in the schema"));
            continue;
        }
        let path = format!("{prefix}/{resource}");
        let json_body = d.ok(Method::GET, &path, JSON, None).await;
        let json_list: RawList<'_> = serde_json::from_slice(&json_body).unwrap();
        let pb = d.ok(Method::GET, &path, PROTOBUF, None).await;
        let unknown = wire::Unknown::decode(&pb[4..]).unwrap();
        let list = wire::List::decode(unknown.raw.unwrap().as_slice()).unwrap();
        let by_key: HashMap<(String, String, String), &Vec<u8>> = list
            .items
            .iter()
            .map(|raw| {
                let m = object_meta(raw).expect("item metadata");
                (
                    (
                        m.namespace.to_string(),
                        m.name.to_string(),
                        m.resource_version.to_string(),
                    ),
                    raw,
                )
            })
            .collect();
        for raw_item in json_list.items {
            let item: Value = serde_json::from_str(raw_item.get()).unwrap();
            let meta = &item["metadata"];
            let key = (
                meta["namespace"].as_str().unwrap_or("").to_string(),
                meta["name"].as_str().unwrap().to_string(),
                meta["resourceVersion"].as_str().unwrap_or("").to_string(),
            );
            // Changed between the two LISTs (a lease renewed): compared at another version.
            let Some(want) = by_key.get(&key) else {
                continue;
            };
            // The item's JSON exactly as the apiserver wrote it, as the cache holds it.
            let text = raw_item.get().as_bytes();
            match SCHEMA.object(&group, &version, &kind, text) {
                Ok(got) if got == **want => {
                    *compared.entry(format!("{group}/{version} {resource}")).or_default() += 1
                }
                Ok(got) => failures.push(format!(
                    "{group}/{version} {resource} {}/{}: {} bytes written, {} from the apiserver; first difference at byte {}\n  got  {}\n  want {}\n  json {}",
                    key.0,
                    key.1,
                    got.len(),
                    want.len(),
                    got.iter().zip(want.iter()).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len())),
                    hex(&got),
                    hex(want),
                    item
                )),
                Err(TranscodeError::Opaque(ty)) => {
                    opaque.push(format!("{group}/{version} {resource} {}: {ty}", key.1))
                }
                Err(e) => failures.push(format!(
                    "{group}/{version} {resource} {}/{}: {e}",
                    key.0, key.1
                )),
            }
        }
    }
    let total: usize = compared.values().sum();
    let mut summary: Vec<_> = compared.iter().collect();
    summary.sort();
    eprintln!(
        "transcoded byte for byte: {total} objects of {} resources",
        compared.len()
    );
    for (r, n) in &summary {
        eprintln!("  {r}: {n}");
    }
    eprintln!("not transcoded (their types write their own JSON): {opaque:?}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The fixtures' and the control plane's objects were all compared.
    for r in [
        "/v1 pods",
        "/v1 secrets",
        "/v1 configmaps",
        "/v1 services",
        "/v1 persistentvolumes",
        "/v1 resourcequotas",
        "/v1 limitranges",
        "/v1 namespaces",
        "/v1 endpoints",
        "apps/v1 deployments",
        "apps/v1 controllerrevisions",
        "batch/v1 cronjobs",
        "autoscaling/v2 horizontalpodautoscalers",
        "coordination.k8s.io/v1 leases",
        "events.k8s.io/v1 events",
        "policy/v1 poddisruptionbudgets",
        "node.k8s.io/v1 runtimeclasses",
        "networking.k8s.io/v1 networkpolicies",
        "admissionregistration.k8s.io/v1 validatingwebhookconfigurations",
        "storage.k8s.io/v1 storageclasses",
        "scheduling.k8s.io/v1 priorityclasses",
        "rbac.authorization.k8s.io/v1 clusterroles",
        "rbac.authorization.k8s.io/v1 clusterrolebindings",
        "flowcontrol.apiserver.k8s.io/v1 flowschemas",
        "flowcontrol.apiserver.k8s.io/v1 prioritylevelconfigurations",
        "apiregistration.k8s.io/v1 apiservices",
        "/v1 nodes",
        "apps/v1 statefulsets",
        "batch/v1 jobs",
        "networking.k8s.io/v1 ingresses",
        "apiextensions.k8s.io/v1 customresourcedefinitions",
    ] {
        assert!(
            compared.get(r).copied().unwrap_or(0) > 0,
            "no object of {r} compared: {summary:?}"
        );
    }
    cp.stop().await;
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The checked-in schema is what the generator writes from the modules pinned in
/// tests/e2e/go/go.mod (the control plane's): a pin moved without regenerating fails here.
#[test]
fn the_schema_is_generated_from_the_pinned_modules() {
    let go = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/go");
    let tmp = tempfile::tempdir().unwrap();
    // A copy of go.mod: the generator's imports are not among its direct requirements, and
    // go.mod is part of the cached builds' key, so it is never rewritten.
    std::fs::copy(go.join("go.mod"), tmp.path().join("ps.mod")).unwrap();
    std::fs::copy(go.join("go.sum"), tmp.path().join("ps.sum")).unwrap();
    let out = std::process::Command::new("go")
        .args(["run", "-mod=mod", "-modfile"])
        .arg(tmp.path().join("ps.mod"))
        .arg("./cmd/proto-schema")
        .current_dir(&go)
        .output()
        .expect("go run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let checked_in = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/k8s/transcode/schema.json"),
    )
    .unwrap();
    assert!(
        out.stdout == checked_in,
        "src/k8s/transcode/schema.json is not what tests/e2e/go/cmd/proto-schema writes; regenerate it (see the command's doc)"
    );
}
