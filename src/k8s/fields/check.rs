//! The cache-or-apiserver decision for a field selector on a resource: the apiserver's field
//! label conversion, applied before the cache evaluates anything.

use crate::k8s::Resource;
use crate::k8s::go_format::go_quote;
use crate::k8s::selectable::CustomFields;
use crate::k8s::selector::{FieldSelector, SelectorError};

use super::kinds::{Reject, UNMODELLED, kind};

/// What the apiserver would do with a field selector on a resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldCheck {
    /// Every field is supported: evaluate this selector (aliases such as pods' `spec.host`
    /// already rewritten) against the fields the cache extracted at ingest
    /// ([`FieldScan`](super::FieldScan)).
    Cache(FieldSelector),
    /// The apiserver answers 400 `BadRequest` with this message.
    Reject(SelectorError),
    /// The proxy cannot be sure what the apiserver does: send the request upstream.
    Passthrough,
}

/// Applies the apiserver's field label conversion for a resource to a parsed selector: the
/// step `ListResource` runs before storage sees the selector.
///
/// Terms are checked in the apiserver's order (sorted), so the first unsupported field named
/// in a rejection is the one the apiserver names. Built-in kinds without a modelled conversion
/// func are cached only for `metadata.name` / `metadata.namespace` (the default conversion);
/// any other field passes through. Custom resources follow [`check_custom_field_selector`].
pub fn check_field_selector(resource: &Resource, selector: &FieldSelector) -> FieldCheck {
    if resource.custom {
        return check_custom_field_selector(resource.namespaced, &resource.selectable, selector);
    }
    check_builtin_field_selector(&resource.group, &resource.resource, selector)
}

/// The field label conversion of a custom resource (`crConverter.ConvertFieldLabel` in
/// apiextensions-apiserver `pkg/apiserver/conversion/converter.go`): `metadata.name`,
/// `metadata.namespace` when namespaced, and the version's selectable fields; anything else
/// is `field label not supported: <label>`.
pub fn check_custom_field_selector(
    namespaced: bool,
    fields: &CustomFields,
    selector: &FieldSelector,
) -> FieldCheck {
    for t in selector.terms() {
        let f = t.field();
        let ok = f == "metadata.name"
            || (namespaced && f == "metadata.namespace")
            || fields.labels().any(|l| l == f);
        if !ok {
            // A declared path the proxy does not evaluate may be this label.
            if fields.is_opaque() {
                return FieldCheck::Passthrough;
            }
            return FieldCheck::Reject(SelectorError::UnsupportedField(format!(
                "field label not supported: {f}"
            )));
        }
    }
    FieldCheck::Cache(selector.clone())
}

/// [`check_field_selector`] for a built-in (or aggregated) resource.
pub fn check_builtin_field_selector(
    group: &str,
    resource: &str,
    selector: &FieldSelector,
) -> FieldCheck {
    if selector.is_everything() {
        return FieldCheck::Cache(selector.clone());
    }
    if UNMODELLED.contains(&(group, resource)) {
        return FieldCheck::Passthrough;
    }
    let Some(k) = kind(group, resource) else {
        let generic = selector
            .fields()
            .all(|f| f == "metadata.name" || f == "metadata.namespace");
        return if generic {
            FieldCheck::Cache(selector.clone())
        } else {
            FieldCheck::Passthrough
        };
    };
    let mut terms = Vec::with_capacity(selector.terms().len());
    for t in selector.terms() {
        let field = if let Some((_, to)) = k.aliases.iter().find(|(from, _)| *from == t.field()) {
            *to
        } else if let Some(f) = k.accepted.iter().find(|f| **f == t.field()) {
            *f
        } else {
            let msg = match k.reject {
                Reject::NotSupported => format!("field label not supported: {}", t.field()),
                Reject::NotSupportedForJob => {
                    format!("field label {} not supported for Job", go_quote(t.field()))
                }
            };
            return FieldCheck::Reject(SelectorError::UnsupportedField(msg));
        };
        terms.push(t.renamed(field));
    }
    FieldCheck::Cache(FieldSelector::from_terms(terms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_accept_their_fields_and_rewrite_spec_host() {
        let sel = FieldSelector::parse("spec.host=n1,status.phase=Running").unwrap();
        let FieldCheck::Cache(conv) = check_builtin_field_selector("", "pods", &sel) else {
            panic!("pods must be cacheable");
        };
        assert_eq!(conv.exact_value("spec.nodeName"), Some("n1"));
        assert_eq!(conv.to_string(), "spec.nodeName=n1,status.phase=Running");
    }

    #[test]
    fn unsupported_fields_are_rejected_with_the_conversion_funcs_message() {
        let check = |g, r, s| check_builtin_field_selector(g, r, &FieldSelector::parse(s).unwrap());
        assert_eq!(
            check("", "pods", "spec.foo=1,zzz=2"),
            FieldCheck::Reject(SelectorError::UnsupportedField(
                "field label not supported: spec.foo".into()
            ))
        );
        assert_eq!(
            check("", "nodes", "metadata.namespace=x"),
            FieldCheck::Reject(SelectorError::UnsupportedField(
                "field label not supported: metadata.namespace".into()
            ))
        );
        assert_eq!(
            check("batch", "jobs", "status.active=1"),
            FieldCheck::Reject(SelectorError::UnsupportedField(
                "field label \"status.active\" not supported for Job".into()
            ))
        );
    }

    #[test]
    fn unmodelled_and_aggregated_kinds_cache_only_metadata_fields() {
        let check = |g, r, s| check_builtin_field_selector(g, r, &FieldSelector::parse(s).unwrap());
        assert!(matches!(
            check("apps", "deployments", "metadata.name=a"),
            FieldCheck::Cache(_)
        ));
        assert_eq!(
            check("apps", "deployments", "status.replicas=1"),
            FieldCheck::Passthrough
        );
        assert_eq!(
            check("example.com", "widgets", "spec.color=red"),
            FieldCheck::Passthrough
        );
        assert_eq!(
            check("events.k8s.io", "events", "metadata.name=a"),
            FieldCheck::Passthrough
        );
        assert!(matches!(
            check("events.k8s.io", "events", ""),
            FieldCheck::Cache(_)
        ));
    }

    fn widgets(namespaced: bool, paths: &[&str]) -> Resource {
        Resource::test_widgets(namespaced, paths)
    }

    /// `crConverter.ConvertFieldLabel`: metadata.name always, metadata.namespace only when
    /// namespaced, declared fields of the version, anything else rejected with the apiserver's
    /// message (the router hands rejections to the apiserver, which writes the 400).
    #[test]
    fn custom_resources_accept_their_selectable_fields_and_reject_others() {
        let check =
            |r: &Resource, s: &str| check_field_selector(r, &FieldSelector::parse(s).unwrap());
        let ns = widgets(true, &[".spec.color", ".spec.size"]);
        let cluster = widgets(false, &[".spec.color"]);
        let cached = |r: &Resource, s: &str| match check(r, s) {
            FieldCheck::Cache(f) => f.to_string(),
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(cached(&ns, ""), "");
        assert_eq!(cached(&ns, "spec.color=red"), "spec.color=red");
        assert_eq!(
            cached(&ns, "spec.size!=3,metadata.namespace=a,metadata.name==w"),
            "metadata.name=w,metadata.namespace=a,spec.size!=3"
        );
        assert_eq!(
            cached(&cluster, "metadata.name=w,spec.color="),
            "metadata.name=w,spec.color="
        );
        let rejected = |r: &Resource, s: &str| match check(r, s) {
            FieldCheck::Reject(SelectorError::UnsupportedField(m)) => m,
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(
            rejected(&ns, "spec.weight=1"),
            "field label not supported: spec.weight"
        );
        // The first unsupported label in the apiserver's (sorted) order is named.
        assert_eq!(
            rejected(&ns, "status.z=1,spec.a=1,spec.color=red"),
            "field label not supported: spec.a"
        );
        assert_eq!(
            rejected(&cluster, "metadata.namespace=a"),
            "field label not supported: metadata.namespace"
        );
        // The path form, with its dot, is not a label.
        assert_eq!(
            rejected(&ns, ".spec.color=red"),
            "field label not supported: .spec.color"
        );
        assert_eq!(
            rejected(&widgets(true, &[]), "spec.color=red"),
            "field label not supported: spec.color"
        );
        // A CRD declaring a path the proxy does not evaluate: the apiserver decides.
        let odd = widgets(true, &[".spec.color", ".spec['a.b']"]);
        assert_eq!(check(&odd, "spec.color=red"), FieldCheck::Passthrough);
        assert!(matches!(
            check(&odd, "metadata.name=w"),
            FieldCheck::Cache(_)
        ));
    }
}
