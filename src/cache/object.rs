//! One cached object: its raw JSON bytes plus the metadata the cache needs, parsed once.
//!
//! Objects are never parsed into a generic JSON value: a borrowed struct reads `metadata`
//! (and nothing else) from the bytes; the rest is skipped by the tokenizer. The bytes are
//! kept *without* `kind`/`apiVersion` (as list items are served); watch frames add them back
//! from the resource, so one copy serves both.

use std::collections::BTreeMap;

use bytes::Bytes;
use serde::Deserialize;

use super::Resource;

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("object is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("object has no metadata.name")]
    NoName,
    #[error("object has no numeric metadata.resourceVersion (got {0:?})")]
    BadResourceVersion(String),
}

/// The parsed part of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    /// Empty for cluster-scoped objects.
    pub namespace: Box<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    pub resource_version: u64,
    pub labels: BTreeMap<Box<str>, Box<str>>,
    /// Values of the resource's selectable fields (beyond metadata.name/namespace), e.g. pods'
    /// `spec.nodeName`, extracted at ingest so field selectors never re-parse the object.
    pub fields: Vec<(&'static str, String)>,
}

/// An object as the cache holds it. Cheap to clone (`Bytes` is reference counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedObject {
    /// The object's JSON without `kind` and `apiVersion`, starting with `{`.
    pub body: Bytes,
    pub meta: Meta,
}

#[derive(Deserialize)]
struct Partial<'a> {
    #[serde(borrow)]
    metadata: Option<MetaPartial<'a>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetaPartial<'a> {
    #[serde(borrow, default)]
    name: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    namespace: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    uid: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    resource_version: Option<std::borrow::Cow<'a, str>>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
}

impl CachedObject {
    /// Parses an object's JSON (from a list item or a watch event's `object`).
    pub fn parse(raw: Bytes, resource: &Resource) -> Result<CachedObject, ObjectError> {
        let p: Partial<'_> = serde_json::from_slice(&raw)?;
        let m = p.metadata.ok_or(ObjectError::NoName)?;
        let name = m.name.ok_or(ObjectError::NoName)?;
        let rv_s = m.resource_version.unwrap_or_default();
        let resource_version = rv_s
            .parse::<u64>()
            .map_err(|_| ObjectError::BadResourceVersion(rv_s.to_string()))?;
        let fields = resource.extract_fields(&raw)?;
        let meta = Meta {
            namespace: m.namespace.unwrap_or_default().into(),
            name: name.into(),
            uid: m.uid.unwrap_or_default().into(),
            resource_version,
            labels: m
                .labels
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k.into_boxed_str(), v.into_boxed_str()))
                .collect(),
            fields,
        };
        // Custom resources' list items carry their type meta: kept (see `Resource::custom`).
        let body = if resource.custom {
            raw
        } else {
            strip_type_meta(raw)
        };
        Ok(CachedObject { body, meta })
    }

    /// `namespace/name` (or `name`), the apiserver's storage key order within a resource.
    pub fn key(&self) -> ObjectKey {
        ObjectKey::new(&self.meta.namespace, &self.meta.name)
    }

    pub fn label(&self, key: &str) -> Option<&str> {
        self.meta.labels.get(key).map(|v| &**v)
    }

    /// A selectable field's value: metadata.name/namespace and the extracted fields.
    pub fn field(&self, path: &str) -> Option<&str> {
        match path {
            "metadata.name" => Some(&self.meta.name),
            "metadata.namespace" => Some(&self.meta.namespace),
            _ => self
                .meta
                .fields
                .iter()
                .find(|(k, _)| *k == path)
                .map(|(_, v)| v.as_str()),
        }
    }
}

/// The cache's key: namespace then name, ordered as etcd keys (`/registry/pods/<ns>/<name>`)
/// compare, byte by byte over `<ns>/<name>`. That is not tuple order: `-` sorts before `/`,
/// so namespace `a-b`'s objects come before namespace `a`'s, as in the apiserver's lists.
/// One namespace's keys are still one contiguous range, starting at `ObjectKey::new(ns, "")`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectKey {
    pub namespace: Box<str>,
    pub name: Box<str>,
}

impl ObjectKey {
    fn storage_bytes(&self) -> impl Iterator<Item = u8> + '_ {
        self.namespace
            .bytes()
            .chain(std::iter::once(b'/'))
            .chain(self.name.bytes())
    }
}

impl Ord for ObjectKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Fast path: different namespaces that are not prefixes of each other, or the same
        // namespace, compare as tuples do.
        if self.namespace == other.namespace {
            return self.name.cmp(&other.name);
        }
        self.storage_bytes().cmp(other.storage_bytes())
    }
}

impl PartialOrd for ObjectKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl ObjectKey {
    pub fn new(namespace: &str, name: &str) -> ObjectKey {
        ObjectKey {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

/// Removes leading `"kind":..,"apiVersion":..` members as the apiserver writes them (first,
/// in that order, for built-in types) so stored bodies match list items. Bodies in another
/// shape are kept as they are: the members are then simply present twice in watch frames'
/// objects' source, which never happens with kube-apiserver's encoder.
fn strip_type_meta(raw: Bytes) -> Bytes {
    let s = &raw[..];
    let mut i = 1;
    let mut cut = None;
    // Fast path for the encoder's exact output: {"kind":"X","apiVersion":"Y",...
    for key in [&b"\"kind\":"[..], &b"\"apiVersion\":"[..]] {
        if s.get(i..i + key.len()) != Some(key) {
            break;
        }
        i += key.len();
        // A JSON string without escapes in kind/apiVersion values.
        if s.get(i) != Some(&b'"') {
            break;
        }
        let Some(end) = s[i + 1..].iter().position(|b| *b == b'"') else {
            break;
        };
        i += end + 2;
        if s.get(i) == Some(&b',') {
            i += 1;
            cut = Some(i);
        } else {
            break;
        }
    }
    match cut {
        Some(at) => {
            let mut v = Vec::with_capacity(raw.len() - at + 1);
            v.push(b'{');
            v.extend_from_slice(&raw[at..]);
            Bytes::from(v)
        }
        None => raw,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pods() -> Resource {
        Resource::core("pods", "Pod", true)
    }

    #[test]
    fn parses_metadata_and_strips_type_meta() {
        let raw = Bytes::from_static(
            br#"{"kind":"Pod","apiVersion":"v1","metadata":{"name":"p","namespace":"ns","uid":"u1","resourceVersion":"42","labels":{"app":"a"}},"spec":{"nodeName":"n1"}}"#,
        );
        let o = CachedObject::parse(raw, &pods()).unwrap();
        assert_eq!(&*o.meta.name, "p");
        assert_eq!(&*o.meta.namespace, "ns");
        assert_eq!(o.meta.resource_version, 42);
        assert_eq!(o.label("app"), Some("a"));
        assert_eq!(o.field("spec.nodeName"), Some("n1"));
        assert_eq!(o.field("metadata.namespace"), Some("ns"));
        assert_eq!(
            &o.body[..],
            &br#"{"metadata":{"name":"p","namespace":"ns","uid":"u1","resourceVersion":"42","labels":{"app":"a"}},"spec":{"nodeName":"n1"}}"#[..]
        );
    }

    #[test]
    fn list_items_without_type_meta_are_kept_as_they_are() {
        let raw = Bytes::from_static(br#"{"metadata":{"name":"c","resourceVersion":"7"}}"#);
        let o = CachedObject::parse(
            raw.clone(),
            &Resource::core("configmaps", "ConfigMap", true),
        )
        .unwrap();
        assert_eq!(o.body, raw);
        assert_eq!(&*o.meta.namespace, "");
    }

    #[test]
    fn objects_without_name_or_numeric_rv_are_errors() {
        let r = Resource::core("configmaps", "ConfigMap", true);
        assert!(CachedObject::parse(Bytes::from_static(br#"{"metadata":{}}"#), &r).is_err());
        assert!(
            CachedObject::parse(
                Bytes::from_static(br#"{"metadata":{"name":"a","resourceVersion":"x"}}"#),
                &r
            )
            .is_err()
        );
        assert!(CachedObject::parse(Bytes::from_static(br#"not json"#), &r).is_err());
    }

    #[test]
    fn keys_order_by_namespace_then_name() {
        let mut keys = [
            ObjectKey::new("b", "a"),
            ObjectKey::new("a", "z"),
            ObjectKey::new("a", "b"),
        ];
        keys.sort();
        assert_eq!(
            keys.iter()
                .map(|k| format!("{}/{}", k.namespace, k.name))
                .collect::<Vec<_>>(),
            ["a/b", "a/z", "b/a"]
        );
    }

    #[test]
    fn keys_order_as_etcd_keys_not_as_tuples() {
        // etcd orders "/registry/x/a-b/n" before "/registry/x/a/n" ('-' < '/').
        let mut keys = [
            ObjectKey::new("a", "n"),
            ObjectKey::new("a-b", "n"),
            ObjectKey::new("a", ""),
            ObjectKey::new("a0", "n"),
        ];
        keys.sort();
        assert_eq!(
            keys.iter()
                .map(|k| format!("{}/{}", k.namespace, k.name))
                .collect::<Vec<_>>(),
            ["a-b/n", "a/", "a/n", "a0/n"]
        );
        let mut strings: Vec<String> = keys
            .iter()
            .map(|k| format!("{}/{}", k.namespace, k.name))
            .collect();
        strings.sort();
        assert_eq!(
            strings,
            keys.iter()
                .map(|k| format!("{}/{}", k.namespace, k.name))
                .collect::<Vec<_>>()
        );
    }
}
