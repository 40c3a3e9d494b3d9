//! One cached object: its raw JSON bytes plus the metadata the cache needs, parsed once.
//!
//! Objects are never parsed into a generic JSON value: a borrowed struct reads `metadata`
//! (and nothing else) from the bytes; the rest is skipped by the tokenizer. The bytes are
//! kept *without* `kind`/`apiVersion` (as list items are served); watch frames add them back
//! from the resource, so one copy serves both.

use std::collections::BTreeMap;

use crate::k8s::fields::FieldScan;
use crate::k8s::scan::{ScanError, Scanner};
use crate::k8s::selectable::FieldName;
use bytes::Bytes;

use super::Resource;

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("object is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("object is not valid JSON: {0}")]
    Scan(#[from] ScanError),
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
    /// `spec.nodeName` or a custom resource's declared `spec.color`, extracted at ingest so
    /// field selectors never re-parse the object. Empty (no allocation) for resources without
    /// such fields.
    pub fields: Vec<(FieldName, Box<str>)>,
}

/// An object as the cache holds it. Cheap to clone (`Bytes` is reference counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedObject {
    /// The object's JSON without `kind` and `apiVersion`, starting with `{`.
    pub body: Bytes,
    pub meta: Meta,
    /// The same object version in the apiserver's protobuf, once the resource's protobuf
    /// side has delivered it (`ResourceCache::attach_protobuf`).
    pub proto: ProtoSlot,
}

/// An object version's exact protobuf envelope (`k8s\0` + `runtime.Unknown`), as the
/// apiserver sends it for a GET of that version: set at most once, by whichever of the two
/// upstream streams (JSON, protobuf) delivers that version second, and shared by every
/// snapshot, history event and reader holding the object. Not part of the object's
/// equality (it is another encoding of the same state).
#[derive(Default, Clone)]
pub struct ProtoSlot(std::sync::OnceLock<Bytes>);

impl ProtoSlot {
    pub fn get(&self) -> Option<&Bytes> {
        self.0.get()
    }

    /// Sets the envelope; `false` when one was set already.
    pub fn set(&self, envelope: Bytes) -> bool {
        self.0.set(envelope).is_ok()
    }
}

impl PartialEq for ProtoSlot {
    fn eq(&self, _: &ProtoSlot) -> bool {
        true
    }
}

impl Eq for ProtoSlot {}

impl std::fmt::Debug for ProtoSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.get() {
            Some(b) => write!(f, "ProtoSlot({} bytes)", b.len()),
            None => f.write_str("ProtoSlot(none)"),
        }
    }
}

impl CachedObject {
    /// The same version without its protobuf envelope (the protobuf bound shed it).
    pub fn without_protobuf(&self) -> CachedObject {
        CachedObject {
            body: self.body.clone(),
            meta: self.meta.clone(),
            proto: ProtoSlot::default(),
        }
    }

    /// Parses an object's JSON (a whole document). The body is `raw` itself when it has no
    /// leading `kind`/`apiVersion`, else a copy without them.
    pub fn parse(raw: Bytes, resource: &Resource) -> Result<CachedObject, ObjectError> {
        let mut s = Scanner::new(&raw);
        let meta = scan_object(&mut s, resource)?;
        let end = s.pos();
        s.end()?;
        // Custom resources' list items carry their type meta: kept (see `Resource::custom`).
        let cut = (!resource.custom)
            .then(|| type_meta_cut(&raw[..end]))
            .flatten();
        let body = match cut {
            Some(at) => stripped(&raw[..end], at),
            None => raw.slice(..end),
        };
        Ok(CachedObject {
            body,
            meta,
            proto: ProtoSlot::default(),
        })
    }

    /// Parses the object at the scanner's cursor (inside a watch event or a list page) in
    /// the same pass that finds its end; the body is copied out of `src` (the scanner's
    /// input) into its own allocation, without `kind`/`apiVersion`, so the cache never pins
    /// the buffer it arrived in.
    pub fn scan(
        s: &mut Scanner<'_>,
        src: &[u8],
        resource: &Resource,
    ) -> Result<CachedObject, ObjectError> {
        s.peek()?;
        let start = s.pos();
        let meta = scan_object(s, resource)?;
        let obj = &src[start..s.pos()];
        let cut = (!resource.custom).then(|| type_meta_cut(obj)).flatten();
        let body = match cut {
            Some(at) => stripped(obj, at),
            None => Bytes::copy_from_slice(obj),
        };
        Ok(CachedObject {
            body,
            meta,
            proto: ProtoSlot::default(),
        })
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
                .find(|(k, _)| k.as_str() == path)
                .map(|(_, v)| &**v),
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

/// `{` followed by `obj[at..]`: the object without the members before `at`.
fn stripped(obj: &[u8], at: usize) -> Bytes {
    let mut v = Vec::with_capacity(obj.len() - at + 1);
    v.push(b'{');
    v.extend_from_slice(&obj[at..]);
    Bytes::from(v)
}

/// Where an object's body starts once leading `"kind":..,"apiVersion":..` members are
/// removed, as the apiserver writes them (first, in that order, strings without escapes).
/// Bodies in another shape are kept as they are: the members are then simply present twice
/// in watch frames' objects' source, which never happens with kube-apiserver's encoder.
fn type_meta_cut(s: &[u8]) -> Option<usize> {
    let mut i = 1;
    let mut cut = None;
    for key in [&b"\"kind\":"[..], &b"\"apiVersion\":"[..]] {
        if s.get(i..i + key.len()) != Some(key) {
            break;
        }
        i += key.len();
        if s.get(i) != Some(&b'"') {
            break;
        }
        let end = s[i + 1..].iter().position(|b| *b == b'"')?;
        i += end + 2;
        if s.get(i) == Some(&b',') {
            i += 1;
            cut = Some(i);
        } else {
            break;
        }
    }
    cut
}

/// One pass over the object at the cursor: its metadata and selectable fields; every other
/// member is skipped without being decoded.
fn scan_object(s: &mut Scanner<'_>, resource: &Resource) -> Result<Meta, ObjectError> {
    let mut name = None;
    let mut namespace = None;
    let mut uid = None;
    let mut rv = None;
    let mut labels = BTreeMap::new();
    let mut fields = FieldScan::new(resource);
    if s.peek()? != b'{' {
        return Err(ScanError::Type {
            at: s.pos(),
            want: "an object",
        }
        .into());
    }
    s.object(|s, key| match &*key {
        "metadata" => s.object(|s, k| {
            match &*k {
                "name" => name = s.opt_string()?,
                "namespace" => namespace = s.opt_string()?,
                "uid" => uid = s.opt_string()?,
                "resourceVersion" => rv = s.opt_string()?,
                "labels" => s.object(|s, k| {
                    let v = s.opt_string()?.unwrap_or_default();
                    labels.insert(Box::<str>::from(&*k), Box::<str>::from(&*v));
                    Ok(())
                })?,
                _ => s.skip()?,
            }
            Ok(())
        }),
        k if fields.wants(k) => fields.member(k, s),
        _ => s.skip(),
    })?;
    let name = name.ok_or(ObjectError::NoName)?;
    let rv_s = rv.unwrap_or_default();
    let resource_version = rv_s
        .parse::<u64>()
        .map_err(|_| ObjectError::BadResourceVersion(rv_s.to_string()))?;
    let namespace = namespace.unwrap_or_default();
    let meta = Meta {
        fields: fields.finish(&name, &namespace),
        namespace: namespace.into(),
        name: name.into(),
        uid: uid.unwrap_or_default().into(),
        resource_version,
        labels,
    };
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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

    fn widgets(paths: &[&str]) -> Resource {
        Resource::test_widgets(true, paths)
    }

    /// The values the apiserver's CR strategy computes (`fmt.Sprint` of the value its JSONPath
    /// finds, "" when it finds nothing or null), for each kind of value.
    #[test]
    fn custom_resource_selectable_fields_are_extracted_like_the_cr_strategy() {
        let r = widgets(&[
            ".spec.color",
            ".spec.size",
            ".spec.neg",
            ".spec.big",
            ".spec.on",
            ".spec.off",
            ".spec.gone",
            ".spec.none",
            ".spec.deep.inner.name",
            ".spec.esc",
            ".status.phase",
            ".top",
        ]);
        let raw = br#"{"apiVersion":"example.com/v1","kind":"Widget","metadata":{"name":"w","namespace":"a","resourceVersion":"5","labels":{"x":"y"}},
            "spec":{"other":{"color":"decoy"},"color":"red","size":3,"neg":-12,"big":9223372036854775807,"on":true,"off":false,
                    "none":null,"deep":{"skip":[1,{"name":"decoy"}],"inner":{"name":"n1"}},"esc":"a\u0062\"c,d=e"},
            "status":{"phase":"Ready"},"top":"t"}"#;
        let o = CachedObject::parse(Bytes::from_static(raw), &r).unwrap();
        let got = |f: &str| o.field(f).unwrap_or_else(|| panic!("{f} not extracted"));
        assert_eq!(got("spec.color"), "red");
        assert_eq!(got("spec.size"), "3");
        assert_eq!(got("spec.neg"), "-12");
        assert_eq!(got("spec.big"), "9223372036854775807");
        assert_eq!(got("spec.on"), "true");
        assert_eq!(got("spec.off"), "false");
        assert_eq!(got("spec.gone"), "");
        assert_eq!(got("spec.none"), "");
        assert_eq!(got("spec.deep.inner.name"), "n1");
        assert_eq!(got("spec.esc"), "ab\"c,d=e");
        assert_eq!(got("status.phase"), "Ready");
        assert_eq!(got("top"), "t");
        assert_eq!(got("metadata.name"), "w");
        assert_eq!(got("metadata.namespace"), "a");
        assert_eq!(o.field("spec.other"), None, "not declared");
        assert_eq!(o.meta.fields.len(), 12);
        // The body is the object as it came, type meta included (a custom resource's list
        // items carry it).
        assert_eq!(&o.body[..], &raw[..]);

        // Numbers beyond int64 (or not integral) are float64 to the apiserver.
        let r = widgets(&[".spec.n"]);
        for (n, want) in [
            ("0", "0"),
            ("-0", "0"),
            ("1e3", "1000"),
            ("2.0", "2"),
            ("1.5", "1.5"),
            ("9223372036854775808", "9.223372036854776e+18"),
            ("1e21", "1e+21"),
        ] {
            let raw = format!(
                r#"{{"metadata":{{"name":"w","resourceVersion":"1"}},"spec":{{"n":{n}}}}}"#
            );
            let o = CachedObject::parse(Bytes::from(raw), &r).unwrap();
            assert_eq!(o.field("spec.n"), Some(want), "{n}");
        }

        // Absent on the way: no spec, spec null, a scalar or an array where an object would be.
        let r = widgets(&[".spec.deep.name"]);
        for spec in [
            "",
            r#","spec":null"#,
            r#","spec":{"deep":"x"}"#,
            r#","spec":{"deep":[{"name":"x"}]}"#,
            r#","spec":{"deep":null}"#,
        ] {
            let raw = format!(r#"{{"metadata":{{"name":"w","resourceVersion":"1"}}{spec}}}"#);
            let o = CachedObject::parse(Bytes::from(raw), &r).unwrap();
            assert_eq!(o.field("spec.deep.name"), Some(""), "{spec}");
        }
    }

    #[test]
    fn resources_without_extra_fields_hold_none() {
        let raw = Bytes::from_static(br#"{"metadata":{"name":"w","namespace":"a","resourceVersion":"1"},"spec":{"color":"red"}}"#);
        for r in [
            widgets(&[]),
            widgets(&[".spec['color']"]),
            Resource::core("configmaps", "ConfigMap", true),
        ] {
            let o = CachedObject::parse(raw.clone(), &r).unwrap();
            assert!(o.meta.fields.is_empty(), "{r:?}");
            assert_eq!(o.field("metadata.name"), Some("w"));
            assert_eq!(o.field("spec.color"), None);
        }
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof!["[a-z0-9.-]{0,12}", ".{0,8}", Just("\"\\\u{1}é".to_string())]
    }

    fn junk() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i32>().prop_map(serde_json::Value::from),
            text().prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(4, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::from),
                proptest::collection::btree_map(text(), inner, 0..4)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// A random object of a kind with selectable fields: the fields it selects on, present or
    /// not, among unrelated members (nested junk, also under the same names elsewhere).
    fn object() -> impl Strategy<Value = (usize, serde_json::Value)> {
        let maybe =
            |v: serde_json::Value, keep: bool| if keep { v } else { serde_json::Value::Null };
        (
            0..RESOURCES.len(),
            text(),
            proptest::option::of(text()),
            any::<u32>(),
            proptest::collection::btree_map("[a-z/.]{1,6}", text(), 0..4),
            proptest::collection::vec((text(), text(), any::<bool>(), any::<i32>()), 0..3),
            junk(),
            any::<[bool; 6]>(),
        )
            .prop_map(move |(r, name, ns, rv, labels, vals, junk, keep)| {
                let mut spec = serde_json::json!({
                    "containers": [{"name": "c", "nodeName": "decoy", "env": junk.clone()}],
                    "nodeName": vals.first().map(|v| v.0.clone()),
                    "restartPolicy": "Always",
                    "serviceAccount": vals.get(1).map(|v| v.1.clone()),
                    "hostNetwork": vals.first().map(|v| v.2),
                    "unschedulable": vals.get(1).map(|v| v.2),
                    "clusterIP": vals.first().map(|v| v.1.clone()),
                    "type": "ClusterIP",
                    "signerName": vals.get(2).map(|v| v.0.clone()),
                    "extra": junk.clone(),
                });
                if !keep[0] {
                    spec.as_object_mut().unwrap().remove("nodeName");
                }
                let status = serde_json::json!({
                    "phase": maybe(serde_json::Value::from("Running"), keep[1]),
                    "podIP": vals.get(2).map(|v| v.1.clone()),
                    "podIPs": if keep[2] { serde_json::json!([{"ip": "10.0.0.1", "x": junk}, {"ip": "b"}]) } else { serde_json::json!([]) },
                    "replicas": vals.first().map(|v| v.3),
                    "succeeded": vals.get(1).map(|v| v.3),
                    "conditions": [{"type": "Ready", "status": "True"}],
                });
                let mut metadata = serde_json::json!({
                    "name": name,
                    "uid": "u-1",
                    "resourceVersion": rv.to_string(),
                    "labels": labels,
                    "annotations": {"name": "decoy"},
                    "managedFields": [{"manager": "m", "fieldsV1": {"f:metadata": {}}}],
                });
                if let Some(ns) = ns {
                    metadata["namespace"] = ns.into();
                }
                let obj = serde_json::json!({
                    "metadata": metadata,
                    "spec": spec,
                    "status": status,
                    "type": maybe(serde_json::Value::from("Opaque"), keep[3]),
                    "involvedObject": {"kind": "Pod", "name": vals.first().map(|v| v.1.clone()), "fieldPath": "spec"},
                    "reason": "Started",
                    "source": if keep[4] { serde_json::json!({"component": "kubelet"}) } else { serde_json::json!({}) },
                    "reportingComponent": maybe(serde_json::Value::from("rc"), keep[5]),
                });
                (r, obj)
            })
    }

    fn o_name_len_is_even(v: &serde_json::Value) -> bool {
        v["metadata"]["name"]
            .as_str()
            .unwrap()
            .len()
            .is_multiple_of(2)
    }

    const RESOURCES: [(&str, &str); 8] = [
        ("pods", "Pod"),
        ("events", "Event"),
        ("services", "Service"),
        ("nodes", "Node"),
        ("secrets", "Secret"),
        ("namespaces", "Namespace"),
        ("replicationcontrollers", "ReplicationController"),
        ("configmaps", "ConfigMap"),
    ];

    proptest! {
        /// The single-pass parse reads exactly what serde reads: metadata, labels and every
        /// selectable field (checked against the serde-based `extract_fields`), and the body
        /// is the object minus leading kind/apiVersion, byte for byte.
        #[test]
        fn single_pass_parse_agrees_with_serde((r, v) in object(), pretty in any::<bool>()) {
            let (res, kind) = RESOURCES[r];
            let resource = Resource::core(res, kind, true);
            let inner = if pretty { serde_json::to_string_pretty(&v) } else { serde_json::to_string(&v) }.unwrap();
            // kind and apiVersion lead, as the apiserver writes them, unless the name is odd.
            let text = if o_name_len_is_even(&v) {
                format!("{{\"kind\":\"{kind}\",\"apiVersion\":\"v1\",{}", &inner[1..])
            } else {
                inner
            };
            let o = CachedObject::parse(Bytes::from(text.clone()), &resource).unwrap();
            let m = &v["metadata"];
            prop_assert_eq!(&*o.meta.name, m["name"].as_str().unwrap());
            prop_assert_eq!(&*o.meta.namespace, m["namespace"].as_str().unwrap_or(""));
            prop_assert_eq!(o.meta.resource_version.to_string(), m["resourceVersion"].as_str().unwrap());
            let labels: BTreeMap<String, String> = serde_json::from_value(m["labels"].clone()).unwrap();
            let got: BTreeMap<String, String> = o.meta.labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            prop_assert_eq!(got, labels);
            let want = crate::k8s::fields::extract_fields("", res, text.as_bytes()).unwrap();
            let got: Vec<(&str, &str)> = o.meta.fields.iter().map(|(k, v)| (k.as_str(), &**v)).collect();
            // metadata.name/namespace are read from the metadata, not held twice.
            let want: Vec<(&str, &str)> = want.iter().skip(2).map(|(k, v)| (*k, v.as_str())).collect();
            prop_assert_eq!(got, want);
            // The body: the same JSON without the leading kind/apiVersion.
            prop_assert_eq!(o.body.first(), Some(&b'{'));
            prop_assert!(!std::str::from_utf8(&o.body).unwrap().contains("\"apiVersion\":\"v1\""));
            let body: serde_json::Value = serde_json::from_slice(&o.body).unwrap();
            prop_assert_eq!(body, v);
            // Inside a watch event, the same object parses the same.
            let line = Bytes::from(format!("{{\"type\":\"MODIFIED\",\"object\":{text}}}"));
            let crate::cache::reflector::WatchItem::Object(_, e) =
                crate::cache::reflector::parse_event_line(&line, &resource).unwrap() else { panic!() };
            prop_assert_eq!(e, o);
        }
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
