//! What to cache: the configured selection (`cache.resources`, `cache.exclude`) resolved
//! against the apiserver's discovery documents and its CustomResourceDefinitions.
//!
//! The I/O (`registry::fetch`) only gathers facts; [`plan`] is a pure function from (selection,
//! discovery, CRDs) to the set of group/version/resources to cache, table-tested below. The
//! registry ([`super::registry`]) runs both whenever a fact changes and reconciles its caches
//! with the plan.
//!
//! Rules, and why:
//! - One cache per group/resource, at the version a client resolving the resource through
//!   discovery would use: the group's preferred version if it serves the resource, else the
//!   first of the group's versions (discovery lists them in priority order) that does. For a
//!   custom resource: its highest-priority served version (kube-aware version order, as the
//!   apiserver orders a CRD group's versions in discovery). Requests for other versions
//!   pass through (the apiserver converts; one upstream watch per version would multiply
//!   the cost this proxy exists to cut).
//! - `all`: every resource whose verbs include `list` and `watch`, no subresources, minus
//!   `cache.exclude`. Custom resources come from the CRDs (Established ones), not from
//!   discovery, so a CRD that appears or disappears is seen at once via the CRD watch, and
//!   discovery lagging behind a deleted CRD cannot resurrect it.
//! - Whether a resource is custom decides its wire format ([`Resource::custom`]), so a
//!   resource in a group that might hold CRDs waits for the CRD list before it is cached.
//!   Resources in Kubernetes' own groups ([`BUILTIN_GROUPS`]) need no CRD list: the proxy
//!   then works without permission to list CRDs when no custom resource is configured.
//! - A custom resource's cache carries the `selectableFields` of the version it caches
//!   ([`Resource::selectable`]), so field selectors on them are answered from memory. They are
//!   part of the planned resource: when a CRD changes them, the plan differs from the running
//!   cache and the registry replaces it (its objects hold the old fields' values).

use std::collections::{BTreeMap, BTreeSet, HashSet};

use serde::Deserialize;

use super::Resource;
use crate::k8s::selectable::CustomFields;

/// The `cache.resources` entry that selects every listable and watchable resource.
pub const ALL: &str = "all";

/// Groups served by kube-apiserver itself (Kubernetes 1.36). Resources in them are never
/// custom resources, so they can be cached before (or without) a list of CRDs.
pub const BUILTIN_GROUPS: &[&str] = &[
    "",
    "admissionregistration.k8s.io",
    "apiextensions.k8s.io",
    "apiregistration.k8s.io",
    "apps",
    "authentication.k8s.io",
    "authorization.k8s.io",
    "autoscaling",
    "batch",
    "certificates.k8s.io",
    "coordination.k8s.io",
    "discovery.k8s.io",
    "events.k8s.io",
    "extensions",
    "flowcontrol.apiserver.k8s.io",
    "internal.apiserver.k8s.io",
    "networking.k8s.io",
    "node.k8s.io",
    "policy",
    "rbac.authorization.k8s.io",
    "resource.k8s.io",
    "scheduling.k8s.io",
    "storage.k8s.io",
    "storagemigration.k8s.io",
];

/// The CustomResourceDefinitions resource itself (watched to follow CRDs).
pub fn crd_resource() -> Resource {
    Resource {
        group: "apiextensions.k8s.io".into(),
        version: "v1".into(),
        resource: "customresourcedefinitions".into(),
        kind: "CustomResourceDefinition".into(),
        namespaced: false,
        custom: false,
        selectable: CustomFields::default(),
    }
}

/// `resource.group` (or `resource`) as (resource, group).
pub fn split_name(name: &str) -> (&str, &str) {
    name.split_once('.').unwrap_or((name, ""))
}

/// Whether a `cache.resources` name is a custom resource's (outside Kubernetes' own groups).
pub fn is_custom_name(name: &str) -> bool {
    name != ALL && !BUILTIN_GROUPS.contains(&split_name(name).1)
}

/// What `cache.resources` and `cache.exclude` ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// `all` was listed.
    pub all: bool,
    /// Named resources (`pods`, `deployments.apps`, `widgets.example.com`).
    pub names: Vec<String>,
    /// Left out of `all` (named resources are cached regardless).
    pub exclude: BTreeSet<String>,
}

impl Selection {
    pub fn new(resources: &[String], exclude: &[String]) -> Selection {
        Selection {
            all: resources.iter().any(|r| r == ALL),
            names: resources.iter().filter(|r| *r != ALL).cloned().collect(),
            exclude: exclude.iter().cloned().collect(),
        }
    }

    /// Whether the CRD list is needed: `all`, or a named resource outside Kubernetes' own
    /// groups (it may be a custom resource).
    pub fn needs_crds(&self) -> bool {
        self.all
            || self
                .names
                .iter()
                .any(|n| !BUILTIN_GROUPS.contains(&split_name(n).1))
    }

    /// The groups whose discovery documents are needed; `None`: all of them.
    pub fn groups(&self) -> Option<BTreeSet<String>> {
        (!self.all).then(|| {
            self.names
                .iter()
                .map(|n| split_name(n).1.to_string())
                .collect()
        })
    }
}

/// One resource as discovery reports it, at the version the proxy would cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    pub resource: Resource,
    /// Its verbs include `list` and `watch`.
    pub listable: bool,
}

/// The apiserver's discovery documents, reduced to what the plan needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Discovery {
    /// By (group, resource).
    pub served: BTreeMap<(String, String), Served>,
    /// Groups known not to be served (404).
    pub absent_groups: BTreeSet<String>,
    /// Groups whose documents could not be read (an aggregated API down, 403): their
    /// resources are neither cached nor known absent.
    pub failed_groups: BTreeMap<String, String>,
}

/// The facts about one CRD the plan needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Crd {
    pub uid: String,
    pub group: String,
    pub plural: String,
    pub kind: String,
    pub namespaced: bool,
    /// Served versions, highest priority first.
    pub served: Vec<String>,
    /// The selectable fields of the served versions that declare any, by version.
    pub selectable: BTreeMap<String, CustomFields>,
    /// `status.conditions[Established]` is True: the apiserver serves its resource.
    pub established: bool,
    /// The Table columns each served version declares after `Name` (its
    /// `additionalPrinterColumns`, or the default `Age`), as the apiserver describes them
    /// (`cache::table::crd_columns`): the table side's columns must be these.
    pub printer_columns: BTreeMap<String, Vec<crate::cache::table::ColumnSig>>,
}

impl Crd {
    /// Reads a CRD object's JSON.
    pub fn parse(body: &[u8]) -> Option<Crd> {
        #[derive(Deserialize)]
        struct Obj {
            metadata: Meta,
            spec: Spec,
            #[serde(default)]
            status: Option<Status>,
        }
        #[derive(Deserialize)]
        struct Meta {
            #[serde(default)]
            uid: String,
        }
        #[derive(Deserialize)]
        struct Spec {
            group: String,
            names: Names,
            scope: String,
            #[serde(default)]
            versions: Vec<Version>,
        }
        #[derive(Deserialize)]
        struct Names {
            plural: String,
            kind: String,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Version {
            name: String,
            #[serde(default)]
            served: bool,
            #[serde(default)]
            selectable_fields: Vec<SelectableField>,
            #[serde(default)]
            additional_printer_columns: Vec<crate::cache::table::PrinterColumn>,
        }
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct SelectableField {
            json_path: String,
        }
        #[derive(Deserialize)]
        struct Status {
            #[serde(default)]
            conditions: Vec<Condition>,
        }
        #[derive(Deserialize)]
        struct Condition {
            #[serde(rename = "type")]
            type_: String,
            status: String,
        }
        let o: Obj = serde_json::from_slice(body).ok()?;
        let served_versions = || o.spec.versions.iter().filter(|v| v.served);
        let mut served: Vec<String> = served_versions().map(|v| v.name.clone()).collect();
        let selectable = served_versions()
            .filter(|v| !v.selectable_fields.is_empty())
            .map(|v| {
                let paths = v.selectable_fields.iter().map(|f| f.json_path.as_str());
                (v.name.clone(), CustomFields::from_json_paths(paths))
            })
            .collect();
        served.sort_by(|a, b| version_order(a, b));
        let printer_columns = served_versions()
            .map(|v| {
                let cols = crate::cache::table::crd_columns(&v.additional_printer_columns);
                (v.name.clone(), cols)
            })
            .collect();
        Some(Crd {
            uid: o.metadata.uid,
            group: o.spec.group,
            plural: o.spec.names.plural,
            kind: o.spec.names.kind,
            namespaced: o.spec.scope == "Namespaced",
            served,
            selectable,
            printer_columns,
            established: o.status.is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            }),
        })
    }

    /// The resource to cache: its highest-priority served version, with that version's
    /// selectable fields (the apiserver evaluates a request's field selector with the fields
    /// of the version it names, and other versions pass through).
    pub fn resource(&self) -> Option<Resource> {
        let version = self.served.first()?;
        Some(Resource {
            group: self.group.clone(),
            version: version.clone(),
            resource: self.plural.clone(),
            kind: self.kind.clone(),
            namespaced: self.namespaced,
            custom: true,
            selectable: self.selectable.get(version).cloned().unwrap_or_default(),
        })
    }
}

/// Kubernetes' version priority (`version.CompareKubeAwareVersionStrings`), `Less` meaning
/// "preferred": GA before beta before alpha, then higher major, then higher minor; versions
/// not of that form last, alphabetically.
pub fn version_order(a: &str, b: &str) -> std::cmp::Ordering {
    priority(b).cmp(&priority(a))
}

/// `kube`'s version priority, except that `alpha`/`beta` without a number after it (`v1beta`)
/// is not a Kubernetes version for the apiserver (`^v(\d+)(?:(alpha|beta)(\d+))?$`): it sorts
/// with the other names, alphabetically.
fn priority(v: &str) -> impl Ord + use<> {
    use kube::core::Version;
    match Version::parse(v) {
        Version::Alpha(_, None) | Version::Beta(_, None) => Version::Nonconformant(v.to_owned()),
        parsed => parsed,
    }
    .priority()
}

/// What to cache now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// By (group, version, resource): the resource and, for a custom resource, its CRD's uid
    /// (a CRD deleted and re-created under the same name gets a fresh cache).
    pub cache: BTreeMap<(String, String, String), (Resource, String)>,
    /// Selected names without a cache yet, and why (built-in ones keep the proxy unready).
    pub missing: BTreeMap<String, String>,
    /// Named resources that will not be cached, and why (they pass through).
    pub refused: BTreeMap<String, String>,
}

/// Resolves the selection. `discovery` is `None` until discovery has succeeded once; `crds`
/// is `None` while the CRD list is not synced (or not watched: [`Selection::needs_crds`]).
/// `ever_custom` holds every (group, resource) seen as a CRD: discovery may still list a
/// deleted CRD's resource for a moment, and it must not come back as a built-in.
pub fn plan(
    sel: &Selection,
    discovery: Option<&Discovery>,
    crds: Option<&[Crd]>,
    ever_custom: &HashSet<(String, String)>,
) -> Plan {
    let mut p = Plan::default();
    let crd_by_name: BTreeMap<(&str, &str), &Crd> = crds
        .unwrap_or_default()
        .iter()
        .map(|c| ((c.group.as_str(), c.plural.as_str()), c))
        .collect();
    let add = |p: &mut Plan, r: Resource, uid: &str| {
        p.cache.insert(
            (r.group.clone(), r.version.clone(), r.resource.clone()),
            (r, uid.to_string()),
        );
    };
    // A discovered resource is taken as built-in only when it cannot be a custom resource.
    let builtin = |group: &str, resource: &str| {
        let key = (group.to_string(), resource.to_string());
        if BUILTIN_GROUPS.contains(&group) {
            true
        } else if crds.is_none() || ever_custom.contains(&key) {
            false
        } else {
            !crd_by_name.contains_key(&(group, resource))
        }
    };
    if sel.all {
        match discovery {
            None => {
                p.missing.insert(ALL.into(), "not discovered yet".into());
            }
            Some(d) => {
                for ((g, r), s) in &d.served {
                    if s.listable && builtin(g, r) && !sel.exclude.contains(&s.resource.label()) {
                        add(&mut p, s.resource.clone(), "");
                    }
                }
            }
        }
        match crds {
            None => {
                p.missing.insert(
                    "custom-resources".into(),
                    "waiting for the list of CustomResourceDefinitions".into(),
                );
            }
            Some(crds) => {
                for c in crds.iter().filter(|c| c.established) {
                    if let Some(r) = c.resource().filter(|r| !sel.exclude.contains(&r.label())) {
                        add(&mut p, r, &c.uid);
                    }
                }
            }
        }
    }
    for name in &sel.names {
        let (resource, group) = split_name(name);
        if let Some(c) = crd_by_name.get(&(group, resource)) {
            match c.resource() {
                Some(r) if c.established => add(&mut p, r, &c.uid),
                Some(_) => {
                    p.missing
                        .insert(name.clone(), "its CRD is not established yet".into());
                }
                None => {
                    p.missing
                        .insert(name.clone(), "its CRD serves no version".into());
                }
            }
            continue;
        }
        if !BUILTIN_GROUPS.contains(&group) && crds.is_none() {
            p.missing.insert(
                name.clone(),
                "waiting for the list of CustomResourceDefinitions".into(),
            );
            continue;
        }
        let Some(d) = discovery else {
            p.missing
                .insert(name.clone(), "discovery has not succeeded yet".into());
            continue;
        };
        let key = (group.to_string(), resource.to_string());
        match d.served.get(&key) {
            _ if ever_custom.contains(&key) => {
                p.missing.insert(
                    name.clone(),
                    "not served: its CustomResourceDefinition was deleted".into(),
                );
            }
            Some(s) if s.listable => add(&mut p, s.resource.clone(), ""),
            Some(_) => {
                p.refused
                    .insert(name.clone(), format!("{name} cannot be listed and watched"));
            }
            None => {
                let why = match d.failed_groups.get(group) {
                    Some(e) => format!("discovery of group {group:?} failed: {e}"),
                    None => format!(
                        "{name} is not served by the apiserver (cache.resources takes the plural \
                         resource name and its group, e.g. deployments.apps; `kubectl \
                         api-resources` lists them)"
                    ),
                };
                p.missing.insert(name.clone(), why);
            }
        }
    }
    p
}

// ---------------------------------------------------------------------------------------------
// Discovery documents
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize)]
pub struct ApiGroupList {
    #[serde(default)]
    pub groups: Vec<ApiGroup>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiGroup {
    pub name: String,
    #[serde(default)]
    pub versions: Vec<GroupVersion>,
    pub preferred_version: Option<GroupVersion>,
}

#[derive(Deserialize)]
pub struct GroupVersion {
    pub version: String,
}

#[derive(Deserialize)]
pub struct ResourceList {
    #[serde(default)]
    pub resources: Vec<ApiResource>,
}

#[derive(Deserialize)]
pub struct ApiResource {
    pub name: String,
    pub kind: String,
    pub namespaced: bool,
    #[serde(default)]
    pub verbs: Vec<String>,
}

impl ApiGroup {
    /// The versions to look in, in the order a client resolves a resource: preferred first.
    pub fn version_order(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .preferred_version
            .iter()
            .map(|p| p.version.clone())
            .collect();
        for gv in &self.versions {
            if !v.contains(&gv.version) {
                v.push(gv.version.clone());
            }
        }
        v
    }
}

/// Adds the top-level resources of one group version's document to `d`, those of this
/// (group, resource) not already found at a preferred version.
pub fn add_resources(d: &mut Discovery, group: &str, version: &str, list: ResourceList) {
    for r in list.resources {
        if r.name.contains('/') {
            continue;
        }
        let key = (group.to_string(), r.name.clone());
        if d.served.contains_key(&key) {
            continue;
        }
        let listable = r.verbs.iter().any(|v| v == "list") && r.verbs.iter().any(|v| v == "watch");
        d.served.insert(
            key,
            Served {
                resource: Resource {
                    group: group.to_string(),
                    version: version.to_string(),
                    resource: r.name,
                    kind: r.kind,
                    namespaced: r.namespaced,
                    custom: false,
                    selectable: CustomFields::default(),
                },
                listable,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(group: &str, version: &str, resource: &str, kind: &str, listable: bool) -> Served {
        Served {
            resource: Resource {
                group: group.into(),
                version: version.into(),
                resource: resource.into(),
                kind: kind.into(),
                namespaced: true,
                custom: false,
                selectable: CustomFields::default(),
            },
            listable,
        }
    }

    fn discovery(items: Vec<Served>) -> Discovery {
        let mut d = Discovery::default();
        for s in items {
            d.served
                .insert((s.resource.group.clone(), s.resource.resource.clone()), s);
        }
        d
    }

    fn widgets(uid: &str, established: bool) -> Crd {
        Crd {
            uid: uid.into(),
            group: "example.com".into(),
            plural: "widgets".into(),
            kind: "Widget".into(),
            namespaced: true,
            served: vec!["v1".into(), "v1beta1".into()],
            selectable: BTreeMap::new(),
            established,
            printer_columns: BTreeMap::new(),
        }
    }

    fn keys(p: &Plan) -> Vec<String> {
        p.cache
            .values()
            .map(|(r, _)| format!("{}/{}", r.label(), r.version))
            .collect()
    }

    fn sel(resources: &[&str], exclude: &[&str]) -> Selection {
        Selection::new(
            &resources.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            &exclude.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
    }

    #[test]
    fn kube_aware_version_order_prefers_ga_then_beta_then_alpha() {
        let mut v = vec![
            "v1alpha1",
            "v11alpha2",
            "foo1",
            "v10beta3",
            "v2",
            "v1",
            "v3beta1",
            "v10",
            "v12alpha1",
            "foo10",
            "v11beta2",
        ];
        v.sort_by(|a, b| version_order(a, b));
        // The list in the Kubernetes documentation of CRD versioning.
        assert_eq!(
            v,
            [
                "v10",
                "v2",
                "v1",
                "v11beta2",
                "v10beta3",
                "v3beta1",
                "v12alpha1",
                "v11alpha2",
                "v1alpha1",
                "foo1",
                "foo10"
            ]
        );
    }

    #[test]
    fn alpha_or_beta_without_a_number_is_not_a_kube_version() {
        let mut v = vec!["v1beta", "zeta", "v1alpha1", "v2alpha", "v1"];
        v.sort_by(|a, b| version_order(a, b));
        assert_eq!(v, ["v1", "v1alpha1", "v1beta", "v2alpha", "zeta"]);
    }

    #[test]
    fn crds_are_read_with_their_served_versions_in_priority_order() {
        let body = br#"{"metadata":{"name":"widgets.example.com","uid":"u1"},
            "spec":{"group":"example.com","scope":"Cluster","names":{"plural":"widgets","kind":"Widget"},
              "versions":[{"name":"v1beta1","served":true,"storage":true},{"name":"v1","served":true},{"name":"v2","served":false}]},
            "status":{"conditions":[{"type":"NamesAccepted","status":"True"},{"type":"Established","status":"True"}]}}"#;
        let c = Crd::parse(body).unwrap();
        assert_eq!(c.served, ["v1", "v1beta1"]);
        assert!(c.established && !c.namespaced);
        let r = c.resource().unwrap();
        assert_eq!((r.version.as_str(), r.custom), ("v1", true));
        let pending = br#"{"metadata":{"uid":"u"},"spec":{"group":"g.io","scope":"Namespaced","names":{"plural":"xs","kind":"X"},"versions":[{"name":"v1","served":true}]}}"#;
        assert!(!Crd::parse(pending).unwrap().established);
        assert!(Crd::parse(b"{}").is_none());
    }

    /// Each served version's `selectableFields`, by version; the cached resource carries the
    /// fields of the version it caches.
    #[test]
    fn crds_are_read_with_each_served_versions_selectable_fields() {
        let crd = |versions: &str| {
            let body = format!(
                r#"{{"metadata":{{"uid":"u1"}},"spec":{{"group":"example.com","scope":"Namespaced",
                   "names":{{"plural":"widgets","kind":"Widget"}},"versions":{versions}}}}}"#
            );
            Crd::parse(body.as_bytes()).unwrap()
        };
        let labels = |r: Option<Resource>| -> Vec<String> {
            r.unwrap().selectable.labels().map(str::to_string).collect()
        };
        /// The selectable field labels of one version.
        type Labels<'a> = (&'a str, &'a [&'a str]);
        let cases: &[(&str, &[Labels], &[&str])] = &[
            // (versions, selectable fields by version, the cached resource's labels)
            (r#"[{"name":"v1","served":true}]"#, &[], &[]),
            (
                r#"[{"name":"v1","served":true,"selectableFields":[{"jsonPath":".spec.color"},{"jsonPath":".spec.size"}]}]"#,
                &[("v1", &["spec.color", "spec.size"])],
                &["spec.color", "spec.size"],
            ),
            (
                r#"[{"name":"v1","served":true,"selectableFields":[]},
                    {"name":"v1beta1","served":true,"selectableFields":[{"jsonPath":".spec.colour"}]},
                    {"name":"v2","served":false,"selectableFields":[{"jsonPath":".spec.hue"}]}]"#,
                &[("v1beta1", &["spec.colour"])],
                &[],
            ),
            (
                r#"[{"name":"v1alpha1","served":true,"selectableFields":[{"jsonPath":".spec.a"}]},
                    {"name":"v1beta1","served":true,"selectableFields":[{"jsonPath":".spec.b"}]}]"#,
                &[("v1alpha1", &["spec.a"]), ("v1beta1", &["spec.b"])],
                &["spec.b"],
            ),
        ];
        for (versions, by_version, cached) in cases {
            let c = crd(versions);
            let got: Vec<(String, Vec<String>)> = c
                .selectable
                .iter()
                .map(|(v, f)| (v.clone(), f.labels().map(str::to_string).collect()))
                .collect();
            let want: Vec<(String, Vec<String>)> = by_version
                .iter()
                .map(|(v, l)| (v.to_string(), l.iter().map(|s| s.to_string()).collect()))
                .collect();
            assert_eq!(got, want, "{versions}");
            assert_eq!(labels(c.resource()), *cached, "{versions}");
        }
    }

    /// The registry replaces a cache whose planned resource differs from the running one: a
    /// change of the cached version's selectable fields must change the resource, or the
    /// cache would keep evaluating the old fields (and not have the new ones' values).
    #[test]
    fn a_change_of_the_cached_versions_selectable_fields_changes_the_planned_resource() {
        let s = sel(&["widgets.example.com"], &[]);
        let d = Discovery::default();
        let with = |paths: &[&str]| Crd {
            selectable: [(
                "v1".to_string(),
                CustomFields::from_json_paths(paths.iter().copied()),
            )]
            .into(),
            ..widgets("u1", true)
        };
        let key = (
            "example.com".to_string(),
            "v1".to_string(),
            "widgets".to_string(),
        );
        let planned = |c: Crd| plan(&s, Some(&d), Some(&[c]), &HashSet::new()).cache[&key].clone();
        let color = planned(with(&[".spec.color"]));
        assert_eq!(color, planned(with(&[".spec.color"])));
        assert_ne!(color, planned(with(&[".spec.color", ".spec.size"])));
        assert_ne!(color, planned(with(&[])));
        assert_ne!(color, planned(widgets("u1", true)));
        // Another version's fields are not the cached version's concern.
        let mut other = with(&[".spec.color"]);
        other
            .selectable
            .insert("v1beta1".into(), CustomFields::from_json_paths([".spec.x"]));
        assert_eq!(color, planned(other));
    }

    #[test]
    fn all_caches_every_listable_resource_and_established_crds_minus_exclusions() {
        let d = discovery(vec![
            served("", "v1", "pods", "Pod", true),
            served("", "v1", "events", "Event", true),
            served("", "v1", "bindings", "Binding", false),
            served("apps", "v1", "deployments", "Deployment", true),
            // Discovery also lists the CRD's resource: it must come from the CRD.
            served("example.com", "v1beta1", "widgets", "Widget", true),
            // An aggregated API (no CRD): cached like a built-in once the CRD list is known.
            served("metrics.example.io", "v1", "samples", "Sample", true),
        ]);
        let crds = [
            widgets("u1", true),
            Crd {
                plural: "gadgets".into(),
                ..widgets("u2", false)
            },
        ];
        let p = plan(
            &sel(&["all"], &["events"]),
            Some(&d),
            Some(&crds),
            &HashSet::new(),
        );
        assert_eq!(
            keys(&p),
            [
                "pods/v1",
                "deployments.apps/v1",
                "widgets.example.com/v1",
                "samples.metrics.example.io/v1"
            ]
        );
        let (w, uid) = &p.cache[&("example.com".into(), "v1".into(), "widgets".into())];
        assert!(w.custom);
        assert_eq!(uid, "u1");
        assert!(p.missing.is_empty() && p.refused.is_empty());
    }

    #[test]
    fn without_the_crd_list_only_kubernetes_own_groups_are_cached() {
        let d = discovery(vec![
            served("", "v1", "pods", "Pod", true),
            served("example.com", "v1", "widgets", "Widget", true),
        ]);
        let p = plan(&sel(&["all"], &[]), Some(&d), None, &HashSet::new());
        assert_eq!(keys(&p), ["pods/v1"]);
        assert!(p.missing.contains_key("custom-resources"));
        let p = plan(&sel(&["all"], &[]), None, None, &HashSet::new());
        assert!(p.cache.is_empty());
        assert!(p.missing.contains_key("all"));
    }

    #[test]
    fn named_custom_resources_follow_their_crd() {
        let s = sel(&["configmaps", "widgets.example.com"], &[]);
        let d = discovery(vec![served("", "v1", "configmaps", "ConfigMap", true)]);
        // No CRD yet: missing, configmaps cached.
        let p = plan(&s, Some(&d), Some(&[]), &HashSet::new());
        assert_eq!(keys(&p), ["configmaps/v1"]);
        assert!(p.missing["widgets.example.com"].contains("not served"));
        // Created, not established yet.
        let p = plan(&s, Some(&d), Some(&[widgets("u1", false)]), &HashSet::new());
        assert!(p.missing["widgets.example.com"].contains("not established"));
        // Established: cached at its preferred served version.
        let p = plan(&s, Some(&d), Some(&[widgets("u1", true)]), &HashSet::new());
        assert_eq!(keys(&p), ["configmaps/v1", "widgets.example.com/v1"]);
        // Deleted, while discovery still lists it: not cached.
        let mut d2 = d.clone();
        d2.served.insert(
            ("example.com".into(), "widgets".into()),
            served("example.com", "v1", "widgets", "Widget", true),
        );
        let ever: HashSet<_> = [("example.com".to_string(), "widgets".to_string())].into();
        let p = plan(&s, Some(&d2), Some(&[]), &ever);
        assert_eq!(keys(&p), ["configmaps/v1"]);
        assert!(p.missing.contains_key("widgets.example.com"));
        // Re-created: a new uid, so a new cache.
        let p = plan(&s, Some(&d2), Some(&[widgets("u2", true)]), &ever);
        assert_eq!(
            p.cache[&("example.com".into(), "v1".into(), "widgets".into())].1,
            "u2"
        );
    }

    #[test]
    fn a_version_that_stops_being_served_moves_the_cache_to_the_next() {
        let s = sel(&["widgets.example.com"], &[]);
        let d = Discovery::default();
        let p = plan(&s, Some(&d), Some(&[widgets("u1", true)]), &HashSet::new());
        assert_eq!(keys(&p), ["widgets.example.com/v1"]);
        let only_beta = Crd {
            served: vec!["v1beta1".into()],
            ..widgets("u1", true)
        };
        let p = plan(&s, Some(&d), Some(&[only_beta]), &HashSet::new());
        assert_eq!(keys(&p), ["widgets.example.com/v1beta1"]);
        // Same plural, another group: another resource.
        let other = Crd {
            group: "other.io".into(),
            ..widgets("u2", true)
        };
        let p = plan(
            &sel(&["all"], &[]),
            Some(&d),
            Some(&[widgets("u1", true), other]),
            &HashSet::new(),
        );
        assert_eq!(keys(&p), ["widgets.example.com/v1", "widgets.other.io/v1"]);
    }

    #[test]
    fn named_resources_resolve_through_discovery_or_are_refused() {
        let d = discovery(vec![
            served("", "v1", "pods", "Pod", true),
            served("", "v1", "componentstatuses", "ComponentStatus", false),
        ]);
        let mut d = d;
        d.failed_groups
            .insert("metrics.k8s.io".into(), "503".into());
        let s = sel(
            &[
                "pods",
                "componentstatuses",
                "nodes.metrics.k8s.io",
                "nothings",
            ],
            &[],
        );
        // Kubernetes' own groups need no CRD list.
        let p = plan(&s, Some(&d), None, &HashSet::new());
        assert_eq!(keys(&p), ["pods/v1"]);
        assert!(p.refused.contains_key("componentstatuses"));
        assert!(p.missing["nothings"].contains("not served"));
        // A group outside Kubernetes' own may hold CRDs: it waits for their list.
        assert!(p.missing["nodes.metrics.k8s.io"].contains("CustomResourceDefinitions"));
        let p = plan(&s, Some(&d), Some(&[]), &HashSet::new());
        assert!(p.missing["nodes.metrics.k8s.io"].contains("503"));
        // Exclusions narrow `all` only: a named resource is cached.
        let p = plan(
            &sel(&["all", "pods"], &["pods"]),
            Some(&d),
            None,
            &HashSet::new(),
        );
        assert_eq!(keys(&p), ["pods/v1"]);
        let p = plan(
            &sel(&["all"], &["pods"]),
            Some(&d),
            Some(&[]),
            &HashSet::new(),
        );
        assert!(p.cache.is_empty(), "{p:?}");
    }

    #[test]
    fn the_crd_list_is_needed_only_for_groups_that_may_hold_crds() {
        assert!(
            !sel(
                &["pods", "deployments.apps", "leases.coordination.k8s.io"],
                &[]
            )
            .needs_crds()
        );
        assert!(sel(&["pods", "widgets.example.com"], &[]).needs_crds());
        assert!(sel(&["all"], &[]).needs_crds());
        assert_eq!(
            sel(&["pods", "deployments.apps"], &[]).groups(),
            Some(["".to_string(), "apps".to_string()].into())
        );
        assert_eq!(sel(&["all", "pods"], &[]).groups(), None);
    }

    #[test]
    fn resources_are_taken_at_the_first_version_that_serves_them() {
        let mut d = Discovery::default();
        let list = |names: &[&str]| ResourceList {
            resources: names
                .iter()
                .map(|n| ApiResource {
                    name: n.to_string(),
                    kind: "K".into(),
                    namespaced: true,
                    verbs: vec!["list".into(), "watch".into()],
                })
                .collect(),
        };
        add_resources(
            &mut d,
            "autoscaling",
            "v2",
            list(&["horizontalpodautoscalers"]),
        );
        add_resources(
            &mut d,
            "autoscaling",
            "v1",
            list(&[
                "horizontalpodautoscalers",
                "horizontalpodautoscalers/status",
                "olds",
            ]),
        );
        let versions: Vec<_> = d
            .served
            .values()
            .map(|s| format!("{}/{}", s.resource.resource, s.resource.version))
            .collect();
        assert_eq!(versions, ["horizontalpodautoscalers/v2", "olds/v1"]);
    }
}
