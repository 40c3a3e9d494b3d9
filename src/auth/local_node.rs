//! The Node authorizer's allows, decided in the proxy: a kubelet's cache reads of its own
//! Node, its pods and the Secrets and ConfigMaps its pods use, without a
//! `SubjectAccessReview` per read (on with local RBAC, `authorization.localRbac: auto`).
//!
//! kube-apiserver's Node authorizer (`plugin/pkg/auth/authorizer/node`) answers a node
//! identity (`system:node:<name>` in `system:nodes`) from a graph its informers build: pod →
//! node for every pod bound to the node, and secret, configmap, pvc, service account →
//! pod for what the pod refers to (`podutil.VisitPodSecretNames`,
//! `VisitPodConfigmapNames`; none for mirror pods). A node may read an object with a path
//! to it. The proxy holds the pods itself, indexed by `spec.nodeName`, so it can walk the
//! same path over its cache's current state:
//!
//! - `get`, `list`, `watch` of `nodes` named the node's own name (a list or watch names it
//!   by a `metadata.name` field selector): allowed by the Node authorizer by name, with or
//!   without `AuthorizeNodeWithSelectors` (without it, its static node rules allow any);
//! - `list`, `watch` of `pods` with a `spec.nodeName=<node>` field selector term: the same;
//! - `get` of a pod bound to the node (pod → node);
//! - `get`, `list`, `watch` of one named Secret or ConfigMap in a namespace that a pod
//!   bound to the node refers to, the pod not a mirror pod;
//! - `get` of the node's own Lease in `kube-node-lease`.
//!
//! Only allows are decided here, and only a subset of the Node authorizer's: what it does not
//! cover (other resources, its static node rules, persistent volumes, resource claims, a
//! pod's service account) goes to review as before, and so does every question while the
//! pods cache is not synced or its upstream watch is down. A pod's references and node are
//! immutable once bound (ephemeral containers only add references, which are re-read), so a
//! reference parsed from any version of a pod with the same uid still holds.
//!
//! Confirmed like local RBAC, once local RBAC is active: a review asks whether a node that
//! does not exist may `get` its own Node, a question the local RBAC policy does not allow
//! for it (otherwise the probe could not tell the Node authorizer from RBAC, and stays
//! pending). Allowed: the apiserver runs the Node authorizer, local node decisions are
//! active (logged). Denied: off for the process's life.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};

use serde_json::Value;

use super::attributes::Attributes;
use super::authn::Identity;
use crate::cache::registry::Caches;
use crate::cache::{CachedObject, ObjectKey, ResourceCache};
use crate::k8s::selector::FieldSelector;

/// The probe's node: no real node is called this (a name with a colon is not a valid
/// node name, so no kubelet can hold it).
pub const PROBE_NODE: &str = "kube-cache-proxy:node-probe";

/// The namespace of node leases (`api.NamespaceNodeLease`).
const NODE_LEASES: &str = "kube-node-lease";
/// `corev1.MirrorPodAnnotationKey`.
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

const PENDING: u8 = 0;
const ACTIVE: u8 = 1;
const REFUSED: u8 = 2;

/// Counters for the metrics layer.
#[derive(Debug, Default)]
pub struct NodeStats {
    /// Node questions allowed locally (no review).
    pub allowed: AtomicU64,
    /// Pod versions parsed for their references (once per uid, again only when a name is
    /// not found and the pod changed since).
    pub pods_parsed: AtomicU64,
}

/// What a pod refers to, as the Node authorizer's graph has it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PodRefs {
    pub mirror: bool,
    pub secrets: Vec<Box<str>>,
    pub config_maps: Vec<Box<str>>,
}

impl PodRefs {
    /// The references of a pod's JSON (`VisitPodSecretNames`, `VisitPodConfigmapNames`);
    /// empty names are skipped, as `skipEmptyNames` does.
    pub fn of(pod: &Value) -> PodRefs {
        let mut r = PodRefs {
            mirror: pod
                .pointer("/metadata/annotations")
                .and_then(|a| a.get(MIRROR_ANNOTATION))
                .is_some(),
            ..PodRefs::default()
        };
        let spec = &pod["spec"];
        let items = |v: &Value| v.as_array().map(Vec::as_slice).unwrap_or_default().to_vec();
        let push = |to: &mut Vec<Box<str>>, v: Option<&Value>| {
            if let Some(s) = v.and_then(Value::as_str).filter(|s| !s.is_empty()) {
                to.push(s.into());
            }
        };
        for s in items(&spec["imagePullSecrets"]) {
            push(&mut r.secrets, s.get("name"));
        }
        for list in ["initContainers", "containers", "ephemeralContainers"] {
            for c in items(&spec[list]) {
                for e in items(&c["envFrom"]) {
                    push(&mut r.secrets, e.pointer("/secretRef/name"));
                    push(&mut r.config_maps, e.pointer("/configMapRef/name"));
                }
                for e in items(&c["env"]) {
                    push(&mut r.secrets, e.pointer("/valueFrom/secretKeyRef/name"));
                    push(
                        &mut r.config_maps,
                        e.pointer("/valueFrom/configMapKeyRef/name"),
                    );
                }
            }
        }
        for v in items(&spec["volumes"]) {
            push(&mut r.secrets, v.pointer("/secret/secretName"));
            push(&mut r.config_maps, v.pointer("/configMap/name"));
            push(&mut r.secrets, v.pointer("/azureFile/secretName"));
            for source in [
                "cephfs",
                "cinder",
                "flexVolume",
                "rbd",
                "scaleIO",
                "iscsi",
                "storageos",
            ] {
                push(
                    &mut r.secrets,
                    v.get(source).and_then(|s| s.pointer("/secretRef/name")),
                );
            }
            push(&mut r.secrets, v.pointer("/csi/nodePublishSecretRef/name"));
            for p in items(&v["projected"]["sources"]) {
                push(&mut r.secrets, p.pointer("/secret/name"));
                push(&mut r.config_maps, p.pointer("/configMap/name"));
            }
        }
        r
    }
}

/// The node a node identity is (`nodeidentifier.NewDefaultNodeIdentifier`): `None` for
/// other identities and for `system:node:` with no name.
pub fn node_name(id: &Identity) -> Option<&str> {
    let name = id.user.strip_prefix("system:node:")?;
    (!name.is_empty() && id.groups.iter().any(|g| g == "system:nodes")).then_some(name)
}

/// Finds the pods cache (it may be registered after the authorizer starts).
type PodsCache = Box<dyn Fn() -> Option<Arc<ResourceCache>> + Send + Sync>;

pub struct LocalNode {
    pods: PodsCache,
    state: AtomicU8,
    /// Parsed references by pod, with the uid and resourceVersion they were parsed from.
    refs: dashmap::DashMap<ObjectKey, (Box<str>, u64, Arc<PodRefs>)>,
    pub stats: NodeStats,
}

impl std::fmt::Debug for LocalNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalNode")
            .field("mode", &self.mode())
            .finish_non_exhaustive()
    }
}

/// What the apiserver answered the probe.
pub enum NodeProbe {
    Allowed,
    Denied,
    Failed(String),
}

impl LocalNode {
    /// Decides from the pods cache of `caches` (`cache.resources` must select pods for the
    /// decisions that need them).
    pub fn new(caches: &Arc<Caches>) -> LocalNode {
        let caches: Weak<Caches> = Arc::downgrade(caches);
        LocalNode::with_pods(Box::new(move || caches.upgrade()?.get("", "v1", "pods")))
    }

    pub fn with_pods(pods: PodsCache) -> LocalNode {
        LocalNode {
            pods,
            state: AtomicU8::new(PENDING),
            refs: Default::default(),
            stats: NodeStats::default(),
        }
    }

    /// `pending`, `active` or `refused`.
    pub fn mode(&self) -> &'static str {
        match self.state.load(Relaxed) {
            ACTIVE => "active",
            REFUSED => "refused",
            _ => "pending",
        }
    }

    /// Records the probe's answer; `true` when settled (no further probe).
    pub fn probed(&self, answer: NodeProbe) -> bool {
        match answer {
            NodeProbe::Allowed => {
                self.state.store(ACTIVE, Relaxed);
                tracing::info!(
                    "local Node authorization active: the apiserver runs the Node authorizer; kubelets' cache reads of their Node, pods and their pods' Secrets and ConfigMaps are authorized in the proxy"
                );
                true
            }
            NodeProbe::Denied => {
                self.state.store(REFUSED, Relaxed);
                tracing::info!(
                    "local Node authorization off: the apiserver did not let a node read its own Node object (no Node authorizer); kubelets' cache reads are authorized by SubjectAccessReview"
                );
                true
            }
            NodeProbe::Failed(e) => {
                tracing::debug!(error = %e, "local Node authorization probe failed; asked again");
                false
            }
        }
    }

    /// The probe's identity and question.
    pub fn probe() -> (Identity, Attributes) {
        (
            Identity {
                user: format!("system:node:{PROBE_NODE}"),
                uid: String::new(),
                groups: vec!["system:nodes".into(), "system:authenticated".into()],
                extra: Default::default(),
                tenant: String::new(),
            },
            Attributes {
                verb: "get".into(),
                version: "v1".into(),
                resource: "nodes".into(),
                name: PROBE_NODE.into(),
                ..Default::default()
            },
        )
    }

    /// Whether the Node authorizer allows `id` doing `a`, decided from the cache; `false`
    /// means "ask the apiserver" (not a denial).
    pub fn allows(&self, id: &Identity, a: &Attributes) -> bool {
        if self.state.load(Relaxed) != ACTIVE || !a.path.is_empty() || !a.subresource.is_empty() {
            return false;
        }
        let Some(node) = node_name(id) else {
            return false;
        };
        let read = matches!(a.verb.as_str(), "get" | "list" | "watch");
        let allowed = match (a.group.as_str(), a.resource.as_str()) {
            ("", "nodes") => read && a.name == node,
            ("", "pods") => match a.verb.as_str() {
                "list" | "watch" => selects_node(&a.field_selector, node),
                "get" => self.pod_on(node, &a.namespace, &a.name),
                _ => false,
            },
            ("", "secrets") if read => self.refers(node, a, |r| &r.secrets),
            ("", "configmaps") if read => self.refers(node, a, |r| &r.config_maps),
            ("coordination.k8s.io", "leases") => {
                a.verb == "get" && a.namespace == NODE_LEASES && a.name == node
            }
            _ => false,
        };
        if allowed {
            self.stats.allowed.fetch_add(1, Relaxed);
        }
        allowed
    }

    /// The pods cache, when it may decide: synced and its upstream watch up.
    fn pods(&self) -> Option<Arc<ResourceCache>> {
        let c = (self.pods)()?;
        (c.is_ready() && !c.is_unhealthy()).then_some(c)
    }

    fn pod_on(&self, node: &str, namespace: &str, name: &str) -> bool {
        if namespace.is_empty() || name.is_empty() {
            return false;
        }
        let Some(pods) = self.pods() else {
            return false;
        };
        let (pod, _) = pods.get(namespace, name);
        pod.is_some_and(|p| p.field("spec.nodeName") == Some(node))
    }

    /// Whether a pod bound to `node` in `a`'s namespace refers to the object `a` names
    /// (`which` picks secrets or config maps).
    fn refers(&self, node: &str, a: &Attributes, which: fn(&PodRefs) -> &Vec<Box<str>>) -> bool {
        if a.namespace.is_empty() || a.name.is_empty() {
            return false;
        }
        let Some(pods) = self.pods() else {
            return false;
        };
        let snap = pods.current();
        let Some(on_node) = snap.index.as_ref().and_then(|i| i.get(node)) else {
            return false;
        };
        let n = snap.objects.len();
        let hit = |refs: &PodRefs| !refs.mirror && which(refs).iter().any(|r| **r == *a.name);
        // The node's pods in key order: those of the namespace are one range.
        on_node
            .range(ObjectKey::new(&a.namespace, "")..)
            .take_while(|k| *k.namespace == *a.namespace)
            .any(|key| {
                let Some(pod) = snap.objects.get(key) else {
                    return false;
                };
                match self.known_refs(key, pod) {
                    Some((refs, _)) if hit(&refs) => true,
                    // Parsed from this very version: nothing more to find.
                    Some((_, true)) => false,
                    // Not parsed yet, or from an older version (a newer one may have added
                    // ephemeral containers).
                    _ => hit(&self.parse_refs(key, pod, n)),
                }
            })
    }

    /// The references parsed before for this pod's uid, and whether from this version.
    /// A pod's node, mirror annotation and references are immutable once bound, except
    /// that ephemeral containers add references: what an older version of the same uid
    /// refers to, the current one still does.
    fn known_refs(&self, key: &ObjectKey, pod: &CachedObject) -> Option<(Arc<PodRefs>, bool)> {
        let e = self.refs.get(key)?;
        let (uid, rv, refs) = &*e;
        (**uid == *pod.meta.uid).then(|| (refs.clone(), *rv == pod.meta.resource_version))
    }

    /// Parses and remembers a pod's references; `pods`: how many pods the cache holds (the
    /// memo is bounded by it).
    fn parse_refs(&self, key: &ObjectKey, pod: &CachedObject, pods: usize) -> Arc<PodRefs> {
        let v: Value = serde_json::from_slice(&pod.body).unwrap_or_default();
        let refs = Arc::new(PodRefs::of(&v));
        self.stats.pods_parsed.fetch_add(1, Relaxed);
        // A memo grown well past the cache's pods (deleted pods' entries) starts over.
        if self.refs.len() > 2 * pods + 1024 {
            self.refs.clear();
        }
        self.refs.insert(
            key.clone(),
            (
                pod.meta.uid.clone(),
                pod.meta.resource_version,
                refs.clone(),
            ),
        );
        refs
    }
}

/// Whether a field selector has the term `spec.nodeName=<node>` (`=` or `==`), as the Node
/// authorizer reads `attrs.GetFieldSelector()`'s requirements. A selector that does not
/// parse has none.
fn selects_node(selector: &str, node: &str) -> bool {
    FieldSelector::parse(selector).is_ok_and(|s| {
        s.terms()
            .iter()
            .any(|t| t.is_equal() && t.field() == "spec.nodeName" && t.value() == node)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_pods_references_are_the_node_authorizers() {
        let pod = json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {
                "nodeName": "n1",
                "imagePullSecrets": [{"name": "pull"}, {"name": ""}],
                "initContainers": [{"envFrom": [{"secretRef": {"name": "init-env"}}]}],
                "containers": [{
                    "envFrom": [{"configMapRef": {"name": "cm-env"}}],
                    "env": [
                        {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s-key", "key": "k"}}},
                        {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "cm-key", "key": "k"}}},
                        {"name": "C", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                    ]
                }],
                "ephemeralContainers": [{"env": [{"name": "D", "valueFrom": {"secretKeyRef": {"name": "eph", "key": "k"}}}]}],
                "volumes": [
                    {"name": "a", "secret": {"secretName": "vol-secret"}},
                    {"name": "b", "configMap": {"name": "vol-cm"}},
                    {"name": "c", "projected": {"sources": [
                        {"secret": {"name": "proj-secret"}},
                        {"configMap": {"name": "proj-cm"}},
                        {"serviceAccountToken": {"path": "token"}}
                    ]}},
                    {"name": "d", "csi": {"driver": "x", "nodePublishSecretRef": {"name": "csi-secret"}}},
                    {"name": "e", "rbd": {"secretRef": {"name": "rbd-secret"}}},
                    {"name": "f", "azureFile": {"secretName": "azure"}},
                    {"name": "g", "persistentVolumeClaim": {"claimName": "claim"}}
                ]
            }
        });
        let r = PodRefs::of(&pod);
        fn names(v: &[Box<str>]) -> Vec<&str> {
            let mut v: Vec<&str> = v.iter().map(|s| &**s).collect();
            v.sort_unstable();
            v
        }
        assert_eq!(
            names(&r.secrets),
            [
                "azure",
                "csi-secret",
                "eph",
                "init-env",
                "proj-secret",
                "pull",
                "rbd-secret",
                "s-key",
                "vol-secret"
            ]
        );
        assert_eq!(
            names(&r.config_maps),
            ["cm-env", "cm-key", "proj-cm", "vol-cm"]
        );
        assert!(!r.mirror);
        let mirror =
            json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": "x"}}, "spec": {}});
        assert!(PodRefs::of(&mirror).mirror);
    }

    #[test]
    fn node_identities_are_the_node_identifiers() {
        let id = |user: &str, groups: &[&str]| Identity {
            user: user.into(),
            uid: String::new(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            extra: Default::default(),
            tenant: String::new(),
        };
        assert_eq!(
            node_name(&id("system:node:n1", &["system:nodes"])),
            Some("n1")
        );
        assert_eq!(
            node_name(&id("system:node:n1", &["system:authenticated"])),
            None
        );
        assert_eq!(node_name(&id("system:node:", &["system:nodes"])), None);
        assert_eq!(node_name(&id("n1", &["system:nodes"])), None);
    }

    fn pod(
        ns: &str,
        name: &str,
        uid: &str,
        rv: u64,
        node: &str,
        spec: serde_json::Value,
    ) -> CachedObject {
        let mut spec = spec;
        spec["nodeName"] = json!(node);
        let mut meta =
            json!({"name": name, "namespace": ns, "uid": uid, "resourceVersion": rv.to_string()});
        if name.starts_with("mirror") {
            meta["annotations"] = json!({MIRROR_ANNOTATION: "x"});
        }
        let v = json!({"metadata": meta, "spec": spec});
        let r = crate::k8s::resource::Resource::core("pods", "Pod", true);
        CachedObject::parse(v.to_string().into(), &r).unwrap()
    }

    fn node_id(node: &str) -> Identity {
        Identity {
            user: format!("system:node:{node}"),
            uid: String::new(),
            groups: vec!["system:nodes".into(), "system:authenticated".into()],
            extra: Default::default(),
            tenant: String::new(),
        }
    }

    fn ask(verb: &str, resource: &str, ns: &str, name: &str) -> Attributes {
        let (group, resource) = match resource.split_once('.') {
            Some((r, g)) => (g.to_string(), r.to_string()),
            None => (String::new(), resource.to_string()),
        };
        Attributes {
            verb: verb.into(),
            group,
            version: "v1".into(),
            resource,
            namespace: ns.into(),
            name: name.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_kubelet_reads_its_node_pods_and_their_objects_locally_and_nothing_else() {
        use crate::cache::{EventKind, ReflectorSink, StoreConfig};
        let r = crate::k8s::resource::Resource::core("pods", "Pod", true);
        let cache = ResourceCache::new(r, StoreConfig::default());
        let c = cache.clone();
        let local = LocalNode::with_pods(Box::new(move || Some(c.clone())));
        let secret_vol = |s: &str| {
            json!({"containers": [{"name": "c", "image": "i",
            "env": [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "cm1", "key": "k"}}}]}],
            "volumes": [{"name": "v", "secret": {"secretName": s}}]})
        };
        let n1 = node_id("n1");
        let n2 = node_id("n2");
        let get_s1 = ask("get", "secrets", "ns-a", "s1");
        // Pending (not confirmed): nothing is local.
        assert!(!local.allows(&n1, &ask("get", "nodes", "", "n1")));
        local.probed(NodeProbe::Allowed);
        assert_eq!(local.mode(), "active");
        // The pods cache not synced yet: only what needs no pod.
        assert!(!local.allows(&n1, &get_s1));
        assert!(local.allows(&n1, &ask("get", "nodes", "", "n1")));
        cache.replace(
            vec![
                pod("ns-a", "p1", "u1", 10, "n1", secret_vol("s1")),
                pod("ns-a", "mirror-1", "u2", 11, "n1", secret_vol("s-mirror")),
                pod("ns-b", "p2", "u3", 12, "n2", secret_vol("s2")),
                // A namespace whose keys sort next to ns-a's.
                pod("ns-a-b", "p3", "u4", 13, "n1", secret_vol("s3")),
            ],
            13,
        );
        cache.set_unhealthy(None);
        // Objects its pods refer to, by get or by a list or watch naming them.
        assert!(local.allows(&n1, &get_s1));
        assert!(local.allows(&n1, &ask("watch", "secrets", "ns-a", "s1")));
        assert!(local.allows(&n1, &ask("get", "configmaps", "ns-a", "cm1")));
        assert!(local.allows(&n2, &ask("get", "secrets", "ns-b", "s2")));
        assert!(local.allows(&n1, &ask("get", "secrets", "ns-a-b", "s3")));
        // Not its pods', not by a mirror pod, not in another namespace, not unnamed, not a
        // write, not a subresource, not another identity.
        assert!(!local.allows(&n2, &get_s1));
        assert!(!local.allows(&n1, &ask("get", "secrets", "ns-a", "s-mirror")));
        assert!(!local.allows(&n1, &ask("get", "secrets", "ns-b", "s1")));
        assert!(!local.allows(&n1, &ask("get", "secrets", "ns-a", "s3")));
        assert!(!local.allows(&n1, &ask("list", "secrets", "ns-a", "")));
        assert!(!local.allows(&n1, &ask("update", "secrets", "ns-a", "s1")));
        assert!(!local.allows(
            &n1,
            &Attributes {
                subresource: "x".into(),
                ..get_s1.clone()
            }
        ));
        let mut not_a_node = n1.clone();
        not_a_node.groups = vec!["system:authenticated".into()];
        assert!(!local.allows(&not_a_node, &get_s1));
        // Its Node (by name), its pods (by the selector, or by name), its Lease.
        assert!(local.allows(&n1, &ask("watch", "nodes", "", "n1")));
        assert!(!local.allows(&n1, &ask("list", "nodes", "", "")));
        assert!(!local.allows(&n1, &ask("get", "nodes", "", "n2")));
        let pods = |sel: &str| Attributes {
            field_selector: sel.into(),
            ..ask("watch", "pods", "", "")
        };
        assert!(local.allows(&n1, &pods("spec.nodeName=n1")));
        assert!(!local.allows(&n1, &pods("spec.nodeName=n2")));
        assert!(!local.allows(&n1, &pods("")));
        assert!(local.allows(&n1, &ask("get", "pods", "ns-a", "p1")));
        assert!(!local.allows(&n2, &ask("get", "pods", "ns-a", "p1")));
        assert!(local.allows(
            &n1,
            &ask("get", "leases.coordination.k8s.io", "kube-node-lease", "n1")
        ));
        assert!(!local.allows(
            &n1,
            &ask("get", "leases.coordination.k8s.io", "kube-node-lease", "n2")
        ));
        assert!(!local.allows(
            &n1,
            &ask(
                "update",
                "leases.coordination.k8s.io",
                "kube-node-lease",
                "n1"
            )
        ));
        // An ephemeral container's references count from the version that adds it.
        let get_eph = ask("get", "secrets", "ns-a", "s-eph");
        assert!(!local.allows(&n1, &get_eph));
        let mut spec = secret_vol("s1");
        spec["ephemeralContainers"] = json!([{"name": "e", "image": "i",
            "envFrom": [{"secretRef": {"name": "s-eph"}}]}]);
        cache.apply(EventKind::Modified, pod("ns-a", "p1", "u1", 20, "n1", spec));
        assert!(local.allows(&n1, &get_eph));
        // The pod deleted: revoked at the next question.
        cache.apply(
            EventKind::Deleted,
            pod("ns-a", "p1", "u1", 21, "n1", secret_vol("s1")),
        );
        assert!(!local.allows(&n1, &get_s1));
        assert!(!local.allows(&n1, &ask("get", "pods", "ns-a", "p1")));
        // The upstream watch down: back to review.
        cache.set_unhealthy(Some("down".into()));
        assert!(!local.allows(&n2, &ask("get", "secrets", "ns-b", "s2")));
    }

    #[test]
    fn a_pod_list_is_the_nodes_only_with_its_node_name_term() {
        assert!(selects_node("spec.nodeName=n1", "n1"));
        assert!(selects_node("spec.nodeName==n1,status.phase!=Failed", "n1"));
        assert!(!selects_node("spec.nodeName=n2", "n1"));
        assert!(!selects_node("spec.nodeName!=n1", "n1"));
        assert!(
            !selects_node("spec.host=n1", "n1"),
            "an alias is not the term"
        );
        assert!(!selects_node("", "n1"));
        assert!(!selects_node("spec.nodeName", "n1"), "does not parse");
    }
}
