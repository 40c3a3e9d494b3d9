//! RBAC evaluated in the proxy, with kube-apiserver's semantics: a [`Policy`] built from the
//! Roles, ClusterRoles, RoleBindings and ClusterRoleBindings the proxy caches, and
//! [`Policy::allows`], the RBAC authorizer's decision on a request's attributes.
//!
//! Mirrors k8s.io/kubernetes `plugin/pkg/auth/authorizer/rbac` (`RuleAllows`) and
//! `pkg/registry/rbac/validation/rule.go` (`VisitRulesFor`, `appliesToUser`,
//! `GetRoleReferenceRules`), with the matchers of `k8s.io/component-helpers/auth/rbac/
//! validation` (`VerbMatches`, `APIGroupMatches`, `ResourceMatches`, `ResourceNameMatches`,
//! `NonResourceURLMatches`):
//!
//! - every ClusterRoleBinding whose subjects name the caller applies, with the rules of the
//!   role it refers to (a ClusterRoleBinding's `Role` reference names a role in namespace
//!   `""`, which cannot exist: it grants nothing); for a request in a namespace, so does
//!   every RoleBinding of that namespace, with its Role there or its ClusterRole;
//! - subjects: `User` by name, `Group` by one of the caller's groups (as the identity gives
//!   them: `system:authenticated`, `system:serviceaccounts:<ns>` and the like are groups like
//!   any other), `ServiceAccount` by the username `system:serviceaccount:<ns>:<name>` (its
//!   namespace defaulting to the binding's; none in a ClusterRoleBinding: matches nobody);
//!   other kinds match nobody;
//! - a binding to a missing role grants nothing; an aggregated ClusterRole grants the rules
//!   the aggregation controller wrote into it;
//! - a rule allows a resource request when its verbs, API groups, resources (`*`,
//!   `resource/subresource`, `*/subresource`) and resource names (none: any name; a list or
//!   watch carries a name only when the request selected one) all match; a non-resource
//!   request when its verbs and non-resource URLs (exact, `*`, or a `prefix*`) match.
//!
//! Besides RBAC, kube-apiserver's chain always starts with the privileged-group authorizer:
//! `system:masters` may do anything. RBAC gives only allows: a request it does not allow is
//! "no opinion", for the next authorizer (the Node authorizer, webhooks) to decide, so a
//! `false` here is never a denial (see `local_rbac`).
//!
//! Cost: a decision looks up the caller's user name and each of its groups in the subject
//! indexes (hash maps), then checks only the rules of the roles bound to those subjects; the
//! number of bindings in the cluster does not enter it.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Deserializer};

use super::attributes::Attributes;
use crate::k8s::Resource;

/// The RBAC resources whose changes void cached decisions (`authorizationFollowRbac`).
pub fn rbac_resources() -> Vec<Resource> {
    let rbac = |resource: &str, kind: &str, namespaced| Resource {
        group: "rbac.authorization.k8s.io".into(),
        version: "v1".into(),
        resource: resource.into(),
        kind: kind.into(),
        namespaced,
        custom: false,
        selectable: Default::default(),
    };
    vec![
        rbac("roles", "Role", true),
        rbac("rolebindings", "RoleBinding", true),
        rbac("clusterroles", "ClusterRole", false),
        rbac("clusterrolebindings", "ClusterRoleBinding", false),
    ]
}

/// The group kube-apiserver's first authorizer allows everything
/// (`user.SystemPrivilegedGroup`).
pub const PRIVILEGED_GROUP: &str = "system:masters";
/// ServiceAccounts' usernames: `system:serviceaccount:<namespace>:<name>`.
const SERVICE_ACCOUNT_PREFIX: &str = "system:serviceaccount:";

/// `null` as an empty list (the apiserver writes `rules: null` for an aggregated ClusterRole
/// nothing was aggregated into yet).
fn nullable<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// One rule of a Role or ClusterRole (`rbac/v1` `PolicyRule`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct PolicyRule {
    #[serde(default, deserialize_with = "nullable")]
    pub verbs: Vec<String>,
    #[serde(default, rename = "apiGroups", deserialize_with = "nullable")]
    pub api_groups: Vec<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub resources: Vec<String>,
    #[serde(default, rename = "resourceNames", deserialize_with = "nullable")]
    pub resource_names: Vec<String>,
    #[serde(default, rename = "nonResourceURLs", deserialize_with = "nullable")]
    pub non_resource_urls: Vec<String>,
}

/// A Role or ClusterRole as cached (only what RBAC reads).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RoleObject {
    #[serde(default, deserialize_with = "nullable")]
    pub rules: Vec<PolicyRule>,
}

/// A binding's `roleRef`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct RoleRef {
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub name: String,
}

/// A binding's subject.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Subject {
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: String,
}

/// A RoleBinding or ClusterRoleBinding as cached.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct BindingObject {
    #[serde(rename = "roleRef", default)]
    pub role_ref: RoleRef,
    #[serde(default, deserialize_with = "nullable")]
    pub subjects: Vec<Subject>,
}

/// Which role a binding grants: resolved at decision time, so a role created after its
/// binding grants from then on, and a deleted one stops granting.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Grant {
    Role(Arc<str>),
    ClusterRole(Arc<str>),
}

/// The bindings of one scope (the cluster, or one namespace), by the subjects they name.
#[derive(Debug, Default)]
struct Subjects {
    /// `User` subjects by name, and `ServiceAccount` subjects by the username they match.
    users: HashMap<Box<str>, Vec<Grant>>,
    /// `Group` subjects by name.
    groups: HashMap<Box<str>, Vec<Grant>>,
}

impl Subjects {
    /// Indexes `binding`, made in `namespace` (`""`: a ClusterRoleBinding).
    fn add(&mut self, namespace: &str, binding: &BindingObject) {
        let grant = match binding.role_ref.kind.as_str() {
            "Role" => Grant::Role(binding.role_ref.name.as_str().into()),
            "ClusterRole" => Grant::ClusterRole(binding.role_ref.name.as_str().into()),
            // `GetRoleReferenceRules`: an unsupported kind grants nothing.
            _ => return,
        };
        for s in &binding.subjects {
            let (map, key) = match s.kind.as_str() {
                "User" => (&mut self.users, s.name.clone()),
                "Group" => (&mut self.groups, s.name.clone()),
                "ServiceAccount" => {
                    let ns = if s.namespace.is_empty() {
                        namespace
                    } else {
                        &s.namespace
                    };
                    if ns.is_empty() {
                        continue;
                    }
                    (
                        &mut self.users,
                        format!("{SERVICE_ACCOUNT_PREFIX}{ns}:{}", s.name),
                    )
                }
                _ => continue,
            };
            let grants = map.entry(key.into_boxed_str()).or_default();
            if !grants.contains(&grant) {
                grants.push(grant.clone());
            }
        }
    }

    /// The grants that apply to `user` in `groups`.
    fn for_caller<'a>(
        &'a self,
        user: &str,
        groups: &'a [String],
    ) -> impl Iterator<Item = &'a Grant> + 'a {
        let by_user = self.users.get(user).into_iter().flatten();
        let by_group = groups
            .iter()
            .filter_map(|g| self.groups.get(g.as_str()))
            .flatten();
        by_user.chain(by_group)
    }
}

/// The cluster's RBAC policy at one moment, indexed for decisions.
#[derive(Debug, Default)]
pub struct Policy {
    cluster_roles: HashMap<Box<str>, Arc<RoleObject>>,
    /// Roles by namespace, then name.
    roles: HashMap<Box<str>, HashMap<Box<str>, Arc<RoleObject>>>,
    cluster_bindings: Subjects,
    /// RoleBindings by namespace.
    bindings: HashMap<Box<str>, Subjects>,
    objects: usize,
}

/// The objects a [`Policy`] is built from: `(namespace, name, object)`.
pub struct PolicyObjects<'a> {
    pub roles: Vec<(&'a str, &'a str, Arc<RoleObject>)>,
    pub cluster_roles: Vec<(&'a str, Arc<RoleObject>)>,
    pub role_bindings: Vec<(&'a str, Arc<BindingObject>)>,
    pub cluster_role_bindings: Vec<Arc<BindingObject>>,
}

impl Policy {
    pub fn new(o: PolicyObjects<'_>) -> Policy {
        let mut p = Policy {
            objects: o.roles.len()
                + o.cluster_roles.len()
                + o.role_bindings.len()
                + o.cluster_role_bindings.len(),
            ..Default::default()
        };
        for (name, r) in o.cluster_roles {
            p.cluster_roles.insert(name.into(), r);
        }
        for (ns, name, r) in o.roles {
            p.roles.entry(ns.into()).or_default().insert(name.into(), r);
        }
        for b in &o.cluster_role_bindings {
            p.cluster_bindings.add("", b);
        }
        for (ns, b) in &o.role_bindings {
            p.bindings.entry((*ns).into()).or_default().add(ns, b);
        }
        p
    }

    /// Roles, ClusterRoles and bindings this policy holds.
    pub fn objects(&self) -> usize {
        self.objects
    }

    /// The rules `grant` refers to, made in `namespace` (`""`: by a ClusterRoleBinding).
    fn rules(&self, grant: &Grant, namespace: &str) -> &[PolicyRule] {
        let role = match grant {
            Grant::ClusterRole(name) => self.cluster_roles.get(&**name),
            Grant::Role(name) => self.roles.get(namespace).and_then(|rs| rs.get(&**name)),
        };
        role.map_or(&[], |r| &r.rules)
    }

    /// Whether kube-apiserver's privileged-group or RBAC authorizer allows `user` in
    /// `groups` to do `a`. `false` means "RBAC has no allow", not "denied".
    pub fn allows(&self, user: &str, groups: &[String], a: &Attributes) -> bool {
        if groups.iter().any(|g| g == PRIVILEGED_GROUP) {
            return true;
        }
        let granted = |subjects: &Subjects, namespace: &str| {
            subjects.for_caller(user, groups).any(|g| {
                self.rules(g, namespace)
                    .iter()
                    .any(|rule| rule_allows(rule, a))
            })
        };
        if granted(&self.cluster_bindings, "") {
            return true;
        }
        !a.namespace.is_empty()
            && self
                .bindings
                .get(a.namespace.as_str())
                .is_some_and(|s| granted(s, &a.namespace))
    }
}

/// `RuleAllows`.
pub fn rule_allows(rule: &PolicyRule, a: &Attributes) -> bool {
    if !rule.verbs.iter().any(|v| v == "*" || *v == a.verb) {
        return false;
    }
    if !a.path.is_empty() {
        return rule
            .non_resource_urls
            .iter()
            .any(|u| non_resource_url_matches(u, &a.path));
    }
    rule.api_groups.iter().any(|g| g == "*" || *g == a.group)
        && rule
            .resources
            .iter()
            .any(|r| resource_matches(r, &a.resource, &a.subresource))
        && (rule.resource_names.is_empty() || rule.resource_names.contains(&a.name))
}

/// `ResourceMatches` for one of a rule's resources: `*`, the combined
/// `resource[/subresource]`, or `*/subresource`.
fn resource_matches(rule: &str, resource: &str, subresource: &str) -> bool {
    if rule == "*" {
        return true;
    }
    if subresource.is_empty() {
        return rule == resource;
    }
    // The combined "resource/subresource", compared without building it.
    let combined = rule.len() == resource.len() + 1 + subresource.len()
        && rule.starts_with(resource)
        && rule[resource.len()..].starts_with('/')
        && rule.ends_with(subresource);
    combined
        || (rule.len() == subresource.len() + 2
            && rule.starts_with("*/")
            && rule.ends_with(subresource))
}

/// `NonResourceURLMatches` for one of a rule's URLs.
fn non_resource_url_matches(rule: &str, path: &str) -> bool {
    rule == "*"
        || rule == path
        || (rule.ends_with('*') && path.starts_with(rule.trim_end_matches('*')))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn role(rules: serde_json::Value) -> Arc<RoleObject> {
        Arc::new(serde_json::from_value(json!({ "rules": rules })).unwrap())
    }

    fn binding(kind: &str, name: &str, subjects: serde_json::Value) -> Arc<BindingObject> {
        Arc::new(
            serde_json::from_value(json!({
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": name},
                "subjects": subjects,
            }))
            .unwrap(),
        )
    }

    fn res(verb: &str, group: &str, resource: &str, ns: &str, name: &str) -> Attributes {
        let (resource, subresource) = resource.split_once('/').unwrap_or((resource, ""));
        Attributes {
            verb: verb.into(),
            group: group.into(),
            version: "v1".into(),
            resource: resource.into(),
            subresource: subresource.into(),
            namespace: ns.into(),
            name: name.into(),
            ..Default::default()
        }
    }

    fn path(verb: &str, p: &str) -> Attributes {
        Attributes {
            verb: verb.into(),
            path: p.into(),
            ..Default::default()
        }
    }

    fn groups(gs: &[&str]) -> Vec<String> {
        gs.iter().map(|g| g.to_string()).collect()
    }

    fn rule(v: serde_json::Value) -> PolicyRule {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn rules_match_verbs_groups_resources_subresources_and_names_as_the_apiserver() {
        let r = rule(
            json!({"verbs": ["get", "list"], "apiGroups": [""], "resources": ["pods", "pods/log"]}),
        );
        assert!(rule_allows(&r, &res("get", "", "pods", "ns", "p")));
        assert!(rule_allows(&r, &res("get", "", "pods/log", "ns", "p")));
        assert!(!rule_allows(&r, &res("watch", "", "pods", "ns", "")));
        assert!(!rule_allows(&r, &res("get", "apps", "pods", "ns", "")));
        // A resource does not grant its subresources, nor a subresource its resource.
        assert!(!rule_allows(&r, &res("get", "", "pods/status", "ns", "p")));
        let log_only =
            rule(json!({"verbs": ["get"], "apiGroups": [""], "resources": ["pods/log"]}));
        assert!(!rule_allows(&log_only, &res("get", "", "pods", "ns", "p")));
        // `*/subresource` grants that subresource of anything, and nothing else.
        let any_status =
            rule(json!({"verbs": ["get"], "apiGroups": ["*"], "resources": ["*/status"]}));
        assert!(rule_allows(
            &any_status,
            &res("get", "apps", "deployments/status", "", "d")
        ));
        assert!(!rule_allows(
            &any_status,
            &res("get", "apps", "deployments", "", "d")
        ));
        assert!(!rule_allows(
            &any_status,
            &res("get", "apps", "deployments/xstatus", "", "d")
        ));
        // `*` verbs, groups and resources.
        let all = rule(json!({"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}));
        assert!(rule_allows(
            &all,
            &res("delete", "x.io", "w/sub", "ns", "n")
        ));
        // Resource names: none means any; a list carries none unless it selected one.
        let named = rule(
            json!({"verbs": ["get", "list"], "apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["a"]}),
        );
        assert!(rule_allows(
            &named,
            &res("get", "", "configmaps", "ns", "a")
        ));
        assert!(!rule_allows(
            &named,
            &res("get", "", "configmaps", "ns", "b")
        ));
        assert!(!rule_allows(
            &named,
            &res("list", "", "configmaps", "ns", "")
        ));
        assert!(rule_allows(
            &named,
            &res("list", "", "configmaps", "ns", "a")
        ));
        // A resource rule says nothing about paths.
        assert!(!rule_allows(&all, &path("get", "/healthz")));
    }

    #[test]
    fn non_resource_urls_match_exactly_or_by_prefix() {
        let r = rule(json!({"verbs": ["get"], "nonResourceURLs": ["/healthz", "/api/*", "/x**"]}));
        assert!(rule_allows(&r, &path("get", "/healthz")));
        assert!(!rule_allows(&r, &path("get", "/healthz/etcd")));
        assert!(rule_allows(&r, &path("get", "/api/v1")));
        assert!(rule_allows(&r, &path("get", "/api/")));
        assert!(!rule_allows(&r, &path("get", "/api")));
        // Every trailing `*` is trimmed (`strings.TrimRight`).
        assert!(rule_allows(&r, &path("get", "/xyz")));
        assert!(!rule_allows(&r, &path("post", "/healthz")));
        let star = rule(json!({"verbs": ["get"], "nonResourceURLs": ["*"]}));
        assert!(rule_allows(&star, &path("get", "/anything")));
        // A non-resource rule grants no resource.
        assert!(!rule_allows(&star, &res("get", "", "pods", "", "")));
    }

    fn policy() -> Policy {
        let reader = role(
            json!([{"verbs": ["get", "list", "watch"], "apiGroups": [""], "resources": ["pods"]}]),
        );
        let cm = role(json!([{"verbs": ["get"], "apiGroups": [""], "resources": ["configmaps"]}]));
        let health = role(json!([{"verbs": ["get"], "nonResourceURLs": ["/healthz"]}]));
        Policy::new(PolicyObjects {
            roles: vec![("a", "cm", cm.clone()), ("b", "cm", cm)],
            cluster_roles: vec![("pod-reader", reader), ("health", health)],
            role_bindings: vec![
                // In a: alice reads ConfigMaps through the Role, the default SA pods through
                // the ClusterRole (namespace defaulted), group g pods too.
                (
                    "a",
                    binding("Role", "cm", json!([{"kind": "User", "name": "alice"}])),
                ),
                (
                    "a",
                    binding(
                        "ClusterRole",
                        "pod-reader",
                        json!([
                            {"kind": "ServiceAccount", "name": "default"},
                            {"kind": "Group", "name": "g"},
                        ]),
                    ),
                ),
                // In b: a binding to a Role that does not exist, and to one of another
                // namespace's name.
                (
                    "b",
                    binding("Role", "missing", json!([{"kind": "User", "name": "bob"}])),
                ),
                (
                    "b",
                    binding(
                        "Role",
                        "cm",
                        json!([{"kind": "ServiceAccount", "name": "sa", "namespace": "c"}]),
                    ),
                ),
            ],
            cluster_role_bindings: vec![
                binding(
                    "ClusterRole",
                    "health",
                    json!([{"kind": "Group", "name": "system:authenticated"}]),
                ),
                // A ServiceAccount without namespace in a ClusterRoleBinding: nobody.
                binding(
                    "ClusterRole",
                    "pod-reader",
                    json!([{"kind": "ServiceAccount", "name": "default"}]),
                ),
                // A Role reference in a ClusterRoleBinding: nothing.
                binding("Role", "cm", json!([{"kind": "User", "name": "carol"}])),
                binding(
                    "ClusterRole",
                    "pod-reader",
                    json!([{"kind": "Robot", "name": "carol"}]),
                ),
            ],
        })
    }

    #[test]
    fn bindings_apply_to_their_subjects_in_their_scope() {
        let p = policy();
        let none: Vec<String> = vec![];
        assert!(p.allows("alice", &none, &res("get", "", "configmaps", "a", "x")));
        assert!(!p.allows("alice", &none, &res("get", "", "configmaps", "b", "x")));
        assert!(!p.allows("alice", &none, &res("get", "", "configmaps", "", "x")));
        // A RoleBinding to a ClusterRole grants it in its namespace only.
        let sa = "system:serviceaccount:a:default";
        assert!(p.allows(sa, &none, &res("list", "", "pods", "a", "")));
        assert!(!p.allows(sa, &none, &res("list", "", "pods", "b", "")));
        assert!(!p.allows(sa, &none, &res("list", "", "pods", "", "")));
        assert!(!p.allows(
            "system:serviceaccount:b:default",
            &none,
            &res("list", "", "pods", "a", "")
        ));
        assert!(p.allows("x", &groups(&["g"]), &res("watch", "", "pods", "a", "")));
        assert!(!p.allows("x", &groups(&["h"]), &res("watch", "", "pods", "a", "")));
        // A ServiceAccount of another namespace, bound in b.
        assert!(p.allows(
            "system:serviceaccount:c:sa",
            &none,
            &res("get", "", "configmaps", "b", "")
        ));
        // Missing roles, Role references from the cluster scope and unknown kinds: nothing.
        assert!(!p.allows("bob", &none, &res("get", "", "configmaps", "b", "")));
        assert!(!p.allows("carol", &none, &res("get", "", "configmaps", "", "")));
        assert!(!p.allows("carol", &none, &res("get", "", "pods", "", "")));
        // Cluster bindings apply everywhere, non-resource URLs at the cluster scope.
        let authn = groups(&["system:authenticated"]);
        assert!(p.allows("anyone", &authn, &path("get", "/healthz")));
        assert!(!p.allows("anyone", &none, &path("get", "/healthz")));
        // system:masters: everything.
        assert!(p.allows(
            "root",
            &groups(&["system:masters"]),
            &res("delete", "x", "y", "", "")
        ));
    }

    #[test]
    fn hostile_objects_parse_or_grant_nothing() {
        // Nulls and missing fields are empty lists.
        let r: RoleObject = serde_json::from_str(r#"{"rules": null}"#).unwrap();
        assert!(r.rules.is_empty());
        let r: RoleObject =
            serde_json::from_str(r#"{"rules": [{"verbs": null, "resources": ["*"]}]}"#).unwrap();
        assert!(!rule_allows(&r.rules[0], &res("get", "", "pods", "", "")));
        let b: BindingObject = serde_json::from_str(r#"{"subjects": null}"#).unwrap();
        let p = Policy::new(PolicyObjects {
            roles: vec![],
            cluster_roles: vec![],
            role_bindings: vec![],
            cluster_role_bindings: vec![Arc::new(b)],
        });
        assert!(!p.allows("", &[], &res("get", "", "pods", "", "")));
        // Multi-byte names: comparisons never slice inside a character.
        assert!(!resource_matches("pods/é", "pods", "ü"));
        assert!(!resource_matches("*/é", "pods", "é!"));
        assert!(resource_matches("*/é", "pods", "é"));
    }
}
