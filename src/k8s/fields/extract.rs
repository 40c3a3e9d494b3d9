//! Ingest-time extraction of an object's selectable fields, with Go's formatting of their
//! values: from raw JSON ([`extract_fields`]) or during the cache's single scan of an object
//! ([`FieldScan`]), for built-in kinds and custom resources' declared fields.

use std::borrow::Cow;
use std::fmt;

use crate::k8s::Resource;
use crate::k8s::go_format::go_format_float;
use crate::k8s::scan::{Scalar, ScanError, Scanner};
use crate::k8s::selectable::{CustomField, FieldName};

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use super::kinds::{KindFields, kind};

/// A JSON string that borrows from the input when it has no escapes; `null` and absence read
/// as `""`, the zero value the Go structs would hold.
#[derive(Default)]
struct JStr<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for JStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = JStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or null")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(JStr(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(JStr(Cow::Owned(v.to_string())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(JStr(Cow::Owned(v)))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(JStr::default())
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(JStr::default())
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                d.deserialize_str(V)
            }
        }
        d.deserialize_option(V)
    }
}

impl JStr<'_> {
    fn get(&self) -> String {
        self.0.to_string()
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct Meta<'a> {
    #[serde(borrow)]
    name: JStr<'a>,
    #[serde(borrow)]
    namespace: JStr<'a>,
}

/// Only `metadata`; everything else is skipped without building values.
#[derive(Deserialize)]
struct MetaOnly<'a> {
    #[serde(borrow, default)]
    metadata: Option<Meta<'a>>,
}

/// The union of the paths the modelled kinds select on; each kind reads its own.
#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Selectable<'a> {
    #[serde(borrow)]
    metadata: Option<Meta<'a>>,
    #[serde(borrow)]
    spec: Option<Spec<'a>>,
    #[serde(borrow)]
    status: Option<Status<'a>>,
    /// Secret and Event `type`.
    #[serde(borrow, rename = "type")]
    type_: JStr<'a>,
    #[serde(borrow)]
    involved_object: Option<ObjectRef<'a>>,
    #[serde(borrow)]
    reason: JStr<'a>,
    #[serde(borrow)]
    reporting_component: JStr<'a>,
    #[serde(borrow)]
    source: Option<EventSource<'a>>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Spec<'a> {
    #[serde(borrow)]
    node_name: JStr<'a>,
    #[serde(borrow)]
    restart_policy: JStr<'a>,
    #[serde(borrow)]
    scheduler_name: JStr<'a>,
    #[serde(borrow)]
    service_account_name: JStr<'a>,
    /// Deprecated alias of `serviceAccountName`, honoured by the v1 → internal conversion.
    #[serde(borrow, rename = "serviceAccount")]
    deprecated_service_account: JStr<'a>,
    host_network: Option<bool>,
    unschedulable: Option<bool>,
    #[serde(borrow, rename = "clusterIP")]
    cluster_ip: JStr<'a>,
    #[serde(borrow, rename = "type")]
    type_: JStr<'a>,
    #[serde(borrow)]
    signer_name: JStr<'a>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct Status<'a> {
    #[serde(borrow)]
    phase: JStr<'a>,
    #[serde(borrow, rename = "podIP")]
    pod_ip: JStr<'a>,
    #[serde(borrow, rename = "podIPs")]
    pod_ips: Option<Vec<PodIp<'a>>>,
    #[serde(borrow)]
    nominated_node_name: JStr<'a>,
    replicas: Option<i64>,
    succeeded: Option<i64>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct PodIp<'a> {
    #[serde(borrow)]
    ip: JStr<'a>,
}

#[derive(Deserialize, Default)]
#[serde(default, rename_all = "camelCase")]
struct ObjectRef<'a> {
    #[serde(borrow)]
    kind: JStr<'a>,
    #[serde(borrow)]
    namespace: JStr<'a>,
    #[serde(borrow)]
    name: JStr<'a>,
    #[serde(borrow)]
    uid: JStr<'a>,
    #[serde(borrow)]
    api_version: JStr<'a>,
    #[serde(borrow)]
    resource_version: JStr<'a>,
    #[serde(borrow)]
    field_path: JStr<'a>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct EventSource<'a> {
    #[serde(borrow)]
    component: JStr<'a>,
}

/// Values of the selectable fields of an object of a built-in kind, from its raw JSON, as the
/// registry's `GetAttrs` computes them (custom resources' are read by [`FieldScan`] only):
/// `metadata.name`, `metadata.namespace` (`""` for cluster-scoped objects) and the kind's
/// [`supported_fields`](super::supported_fields). Look fields up by the names that
/// [`check_field_selector`](super::check_field_selector) returns (aliases already rewritten).
///
/// Formatting follows the Go code: booleans are `strconv.FormatBool` (`"true"`/`"false"`,
/// absent is `"false"`), counts are `strconv.Itoa` (absent is `"0"`), absent strings are `""`.
///
/// # Errors
///
/// When `raw` is not JSON or a selected path has an unexpected type.
pub fn extract_fields(
    group: &str,
    resource: &str,
    raw: &[u8],
) -> Result<Vec<(&'static str, String)>, serde_json::Error> {
    let Some(k) = kind(group, resource) else {
        let obj: MetaOnly<'_> = serde_json::from_slice(raw)?;
        let meta = obj.metadata.unwrap_or_default();
        return Ok(vec![
            ("metadata.name", meta.name.get()),
            ("metadata.namespace", meta.namespace.get()),
        ]);
    };
    let obj: Selectable<'_> = serde_json::from_slice(raw)?;
    Ok(fields_of(k, obj))
}

/// Collects an object's selectable fields during the cache's single pass over its JSON
/// ([`crate::k8s::scan`]): the same values as [`extract_fields`] for built-in kinds, and a
/// custom resource's declared [`CustomFields`](crate::k8s::selectable::CustomFields), without
/// a second parse.
pub struct FieldScan<'a, 'r> {
    kind: Option<&'static KindFields>,
    /// Top-level members the kind's fields read, besides `metadata`.
    wanted: &'static [&'static str],
    obj: Selectable<'a>,
    custom: Option<CustomScan<'r>>,
}

/// The values of a custom resource's selectable fields found so far, by field index.
struct CustomScan<'r> {
    fields: &'r [CustomField],
    values: Vec<Option<Box<str>>>,
}

impl CustomScan<'_> {
    /// The fields whose path starts with the top-level member `key`, as a bit set.
    fn first_segment_mask(&self, key: &str) -> u64 {
        segment_mask(self.fields, 0, u64::MAX, key)
    }
}

impl<'a, 'r> FieldScan<'a, 'r> {
    pub fn new(resource: &'r Resource) -> FieldScan<'a, 'r> {
        if resource.custom {
            let fields = resource.selectable.evaluated();
            return FieldScan {
                kind: None,
                wanted: &[],
                obj: Selectable::default(),
                custom: (!fields.is_empty()).then(|| CustomScan {
                    fields,
                    values: vec![None; fields.len()],
                }),
            };
        }
        let kind = kind(&resource.group, &resource.resource);
        let wanted: &'static [&'static str] = match kind.map(|k| (k.group, k.resource)) {
            Some(("", "pods")) => &["spec", "status"],
            Some(("", "nodes" | "services")) | Some(("certificates.k8s.io", _)) => &["spec"],
            Some(("", "replicationcontrollers" | "namespaces")) | Some(("batch", "jobs")) => {
                &["status"]
            }
            Some(("", "secrets")) => &["type"],
            Some(("", "events")) => &[
                "involvedObject",
                "reason",
                "reportingComponent",
                "source",
                "type",
            ],
            _ => &[],
        };
        FieldScan {
            kind,
            wanted,
            obj: Selectable::default(),
            custom: None,
        }
    }

    /// Whether the top-level member `key` is read by [`FieldScan::member`].
    pub fn wants(&self, key: &str) -> bool {
        match &self.custom {
            Some(c) => c.first_segment_mask(key) != 0,
            None => self.wanted.contains(&key),
        }
    }

    /// Reads the top-level member `key` (one [`FieldScan::wants`]) at the cursor.
    pub fn member(&mut self, key: &str, s: &mut Scanner<'a>) -> Result<(), ScanError> {
        if let Some(c) = &mut self.custom {
            let mask = c.first_segment_mask(key);
            return custom_value(s, c.fields, &mut c.values, 1, mask);
        }
        let o = &mut self.obj;
        match key {
            "spec" => {
                let spec = o.spec.get_or_insert_default();
                s.object(|s, k| {
                    match &*k {
                        "nodeName" => spec.node_name = jstr(s)?,
                        "restartPolicy" => spec.restart_policy = jstr(s)?,
                        "schedulerName" => spec.scheduler_name = jstr(s)?,
                        "serviceAccountName" => spec.service_account_name = jstr(s)?,
                        "serviceAccount" => spec.deprecated_service_account = jstr(s)?,
                        "hostNetwork" => spec.host_network = jbool(s)?,
                        "unschedulable" => spec.unschedulable = jbool(s)?,
                        "clusterIP" => spec.cluster_ip = jstr(s)?,
                        "type" => spec.type_ = jstr(s)?,
                        "signerName" => spec.signer_name = jstr(s)?,
                        _ => s.skip()?,
                    }
                    Ok(())
                })
            }
            "status" => {
                let st = o.status.get_or_insert_default();
                s.object(|s, k| {
                    match &*k {
                        "phase" => st.phase = jstr(s)?,
                        "podIP" => st.pod_ip = jstr(s)?,
                        "podIPs" => {
                            let mut ips = Vec::new();
                            s.array(|s, _| {
                                let mut ip = PodIp::default();
                                s.object(|s, k| {
                                    if k == "ip" {
                                        ip.ip = jstr(s)?;
                                    } else {
                                        s.skip()?;
                                    }
                                    Ok(())
                                })?;
                                ips.push(ip);
                                Ok(())
                            })?;
                            st.pod_ips = Some(ips);
                        }
                        "nominatedNodeName" => st.nominated_node_name = jstr(s)?,
                        "replicas" => st.replicas = jint(s)?,
                        "succeeded" => st.succeeded = jint(s)?,
                        _ => s.skip()?,
                    }
                    Ok(())
                })
            }
            "involvedObject" => {
                let io = o.involved_object.get_or_insert_default();
                s.object(|s, k| {
                    match &*k {
                        "kind" => io.kind = jstr(s)?,
                        "namespace" => io.namespace = jstr(s)?,
                        "name" => io.name = jstr(s)?,
                        "uid" => io.uid = jstr(s)?,
                        "apiVersion" => io.api_version = jstr(s)?,
                        "resourceVersion" => io.resource_version = jstr(s)?,
                        "fieldPath" => io.field_path = jstr(s)?,
                        _ => s.skip()?,
                    }
                    Ok(())
                })
            }
            "source" => {
                let src = o.source.get_or_insert_default();
                s.object(|s, k| {
                    if k == "component" {
                        src.component = jstr(s)?;
                    } else {
                        s.skip()?;
                    }
                    Ok(())
                })
            }
            "reason" => jstr(s).map(|v| o.reason = v),
            "reportingComponent" => jstr(s).map(|v| o.reporting_component = v),
            "type" => jstr(s).map(|v| o.type_ = v),
            _ => s.skip(),
        }
    }

    /// The fields beyond `metadata.name` / `metadata.namespace` (which the cache reads from
    /// the object's metadata), given the object's metadata name and namespace.
    pub fn finish(mut self, name: &str, namespace: &str) -> Vec<(FieldName, Box<str>)> {
        if let Some(c) = self.custom {
            // An absent field, or one that is null, is "" (`selectableFields` in the CR
            // strategy sets "" when the JSONPath finds nothing or a nil value).
            return c
                .fields
                .iter()
                .zip(c.values)
                .map(|(f, v)| (f.name(), v.unwrap_or_default()))
                .collect();
        }
        let Some(k) = self.kind else {
            return Vec::new();
        };
        self.obj.metadata = Some(Meta {
            name: JStr(Cow::Owned(name.to_string())),
            namespace: JStr(Cow::Owned(namespace.to_string())),
        });
        fields_of(k, self.obj)
            .into_iter()
            .skip(2)
            .map(|(f, v)| (FieldName::Builtin(f), v.into_boxed_str()))
            .collect()
    }
}

/// The fields of `mask` whose path segment `depth` is `key`.
fn segment_mask(fields: &[CustomField], depth: usize, mask: u64, key: &str) -> u64 {
    let mut m = 0;
    for (i, f) in fields.iter().enumerate() {
        if mask & (1 << i) != 0 && f.segments().nth(depth) == Some(key) {
            m |= 1 << i;
        }
    }
    m
}

/// Reads the value at the cursor, reached by path segment `depth - 1` of the fields in
/// `mask`: the value of those whose path ends there, the members of an object for those
/// whose path goes on. Anything else on the way (a scalar where a path goes on, an array)
/// leaves the field absent, as the apiserver's JSONPath lookup with missing keys allowed
/// finds nothing there.
fn custom_value(
    s: &mut Scanner<'_>,
    fields: &[CustomField],
    values: &mut [Option<Box<str>>],
    depth: usize,
    mask: u64,
) -> Result<(), ScanError> {
    if mask == 0 {
        return s.skip();
    }
    let mut ends = 0;
    for (i, f) in fields.iter().enumerate() {
        if mask & (1 << i) != 0 && f.depth() == depth {
            ends |= 1 << i;
        }
    }
    let goes_on = mask & !ends;
    match s.peek()? {
        b'{' if goes_on != 0 => s.object(|s, k| {
            let m = segment_mask(fields, depth, goes_on, &k);
            custom_value(s, fields, values, depth + 1, m)
        }),
        // CRD validation only lets a selectable field point at a string, boolean or integer
        // in the schema, which the apiserver enforces on every write: an object or array
        // where a path ends is never stored.
        b'{' | b'[' => s.skip(),
        _ if ends == 0 => s.skip(),
        _ => {
            let v = go_sprint(s.scalar()?, s.pos())?;
            for (i, slot) in values.iter_mut().enumerate() {
                if ends & (1 << i) != 0 {
                    *slot = v.clone();
                }
            }
            Ok(())
        }
    }
}

/// `fmt.Sprint` of a JSON scalar as the apiserver's unstructured decoding holds it (integers
/// that fit as int64, other numbers as float64); `None` for null.
fn go_sprint(v: Scalar<'_>, at: usize) -> Result<Option<Box<str>>, ScanError> {
    Ok(Some(match v {
        Scalar::Null => return Ok(None),
        Scalar::Bool(b) => if b { "true" } else { "false" }.into(),
        Scalar::Str(s) => s.into(),
        // strconv.ParseInt(s, 10, 64), as `convertNumber` tries first: the same inputs as
        // i64::from_str for JSON numbers ("-0" is 0).
        Scalar::Num(n) => match n.parse::<i64>() {
            Ok(i) => i.to_string().into(),
            Err(_) => {
                let f: f64 = n.parse().map_err(|_| ScanError::Type {
                    at,
                    want: "a number",
                })?;
                go_format_float(f).into()
            }
        },
    }))
}

fn jstr<'a>(s: &mut Scanner<'a>) -> Result<JStr<'a>, ScanError> {
    Ok(JStr(s.opt_string()?.unwrap_or_default()))
}

fn jbool(s: &mut Scanner<'_>) -> Result<Option<bool>, ScanError> {
    let at = s.pos();
    match s.scalar()? {
        Scalar::Null => Ok(None),
        Scalar::Bool(b) => Ok(Some(b)),
        _ => Err(ScanError::Type { at, want: "a bool" }),
    }
}

fn jint(s: &mut Scanner<'_>) -> Result<Option<i64>, ScanError> {
    let at = s.pos();
    match s.scalar()? {
        Scalar::Null => Ok(None),
        Scalar::Num(n) => n.parse().map(Some).map_err(|_| ScanError::Type {
            at,
            want: "an integer",
        }),
        _ => Err(ScanError::Type {
            at,
            want: "an integer",
        }),
    }
}

/// The selectable fields of a decoded object of kind `k`.
fn fields_of(k: &KindFields, obj: Selectable<'_>) -> Vec<(&'static str, String)> {
    let meta = obj.metadata.unwrap_or_default();
    let spec = obj.spec.unwrap_or_default();
    let status = obj.status.unwrap_or_default();
    let mut out = Vec::with_capacity(2 + k.extra.len());
    out.push(("metadata.name", meta.name.get()));
    out.push(("metadata.namespace", meta.namespace.get()));
    let bool_str = |b: Option<bool>| if b.unwrap_or(false) { "true" } else { "false" };
    match (k.group, k.resource) {
        ("", "pods") => {
            out.push(("spec.nodeName", spec.node_name.get()));
            out.push(("spec.restartPolicy", spec.restart_policy.get()));
            out.push(("spec.schedulerName", spec.scheduler_name.get()));
            // Convert_v1_PodSpec_To_core_PodSpec: serviceAccount stands in when
            // serviceAccountName is empty.
            let sa = if spec.service_account_name.0.is_empty() {
                spec.deprecated_service_account.get()
            } else {
                spec.service_account_name.get()
            };
            out.push(("spec.serviceAccountName", sa));
            out.push(("spec.hostNetwork", bool_str(spec.host_network).to_string()));
            out.push(("status.phase", status.phase.get()));
            // Convert_v1_PodStatus_To_core_PodStatus makes podIP authoritative, else podIPs[0];
            // ToSelectableFields then reads the internal podIPs[0].
            let pod_ip = if status.pod_ip.0.is_empty() {
                status
                    .pod_ips
                    .as_deref()
                    .and_then(|ips| ips.first())
                    .map(|ip| ip.ip.get())
                    .unwrap_or_default()
            } else {
                status.pod_ip.get()
            };
            out.push(("status.podIP", pod_ip));
            // Accepted by the conversion func but never set by ToSelectableFields, so the
            // apiserver always sees "".
            out.push(("status.podIPs", String::new()));
            out.push(("status.nominatedNodeName", status.nominated_node_name.get()));
        }
        ("", "nodes") => {
            out.push((
                "spec.unschedulable",
                bool_str(spec.unschedulable).to_string(),
            ));
        }
        ("", "replicationcontrollers") => {
            out.push(("status.replicas", status.replicas.unwrap_or(0).to_string()));
        }
        ("", "events") => {
            let io = obj.involved_object.unwrap_or_default();
            let reporting = obj.reporting_component.get();
            // EventToSelectableFields: source falls back to the reporting controller.
            let source = obj
                .source
                .map(|s| s.component.get())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| reporting.clone());
            out.push(("involvedObject.kind", io.kind.get()));
            out.push(("involvedObject.namespace", io.namespace.get()));
            out.push(("involvedObject.name", io.name.get()));
            out.push(("involvedObject.uid", io.uid.get()));
            out.push(("involvedObject.apiVersion", io.api_version.get()));
            out.push(("involvedObject.resourceVersion", io.resource_version.get()));
            out.push(("involvedObject.fieldPath", io.field_path.get()));
            out.push(("reason", obj.reason.get()));
            out.push(("reportingComponent", reporting));
            out.push(("source", source));
            out.push(("type", obj.type_.get()));
        }
        ("", "namespaces") => out.push(("status.phase", status.phase.get())),
        ("", "secrets") => out.push(("type", obj.type_.get())),
        ("", "services") => {
            out.push(("spec.clusterIP", spec.cluster_ip.get()));
            out.push(("spec.type", spec.type_.get()));
        }
        ("batch", "jobs") => {
            out.push((
                "status.successful",
                status.succeeded.unwrap_or(0).to_string(),
            ));
        }
        ("certificates.k8s.io", "certificatesigningrequests") => {
            out.push(("spec.signerName", spec.signer_name.get()));
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn extracted(group: &str, resource: &str, raw: &str) -> BTreeMap<&'static str, String> {
        extract_fields(group, resource, raw.as_bytes())
            .unwrap()
            .into_iter()
            .collect()
    }

    #[test]
    fn pod_fields_are_extracted_like_to_selectable_fields() {
        let raw = r#"{"apiVersion":"v1","kind":"Pod",
            "metadata":{"name":"p","namespace":"ns","labels":{"a":"b"}},
            "spec":{"nodeName":"n\u0031","restartPolicy":"Always","schedulerName":"default-scheduler",
                    "serviceAccount":"old","hostNetwork":true,"containers":[{"name":"c"}]},
            "status":{"phase":"Running","podIPs":[{"ip":"10.0.0.1"},{"ip":"fd00::1"}],
                      "nominatedNodeName":null}}"#;
        let f = extracted("", "pods", raw);
        assert_eq!(f["metadata.name"], "p");
        assert_eq!(f["metadata.namespace"], "ns");
        assert_eq!(f["spec.nodeName"], "n1");
        assert_eq!(f["spec.restartPolicy"], "Always");
        assert_eq!(f["spec.schedulerName"], "default-scheduler");
        assert_eq!(f["spec.serviceAccountName"], "old");
        assert_eq!(f["spec.hostNetwork"], "true");
        assert_eq!(f["status.phase"], "Running");
        assert_eq!(f["status.podIP"], "10.0.0.1");
        assert_eq!(f["status.podIPs"], "");
        assert_eq!(f["status.nominatedNodeName"], "");

        let bare = extracted("", "pods", r#"{"metadata":{"name":"p"}}"#);
        assert_eq!(bare["spec.hostNetwork"], "false");
        assert_eq!(bare["metadata.namespace"], "");
        let with_pod_ip = extracted(
            "",
            "pods",
            r#"{"status":{"podIP":"10.0.0.9","podIPs":[{"ip":"10.0.0.1"}]}}"#,
        );
        assert_eq!(with_pod_ip["status.podIP"], "10.0.0.9");
    }

    #[test]
    fn other_kinds_fields_are_extracted_with_go_formatting() {
        let node = extracted(
            "",
            "nodes",
            r#"{"metadata":{"name":"n"},"spec":{"unschedulable":true}}"#,
        );
        assert_eq!(node["spec.unschedulable"], "true");
        let node = extracted("", "nodes", r#"{"metadata":{"name":"n"},"spec":{}}"#);
        assert_eq!(node["spec.unschedulable"], "false");
        let job = extracted("batch", "jobs", r#"{"status":{"succeeded":3}}"#);
        assert_eq!(job["status.successful"], "3");
        let job = extracted("batch", "jobs", r#"{"status":{}}"#);
        assert_eq!(job["status.successful"], "0");
        let rc = extracted("", "replicationcontrollers", r#"{"status":{"replicas":2}}"#);
        assert_eq!(rc["status.replicas"], "2");
        let secret = extracted(
            "",
            "secrets",
            r#"{"type":"kubernetes.io/tls","data":{"a":"Yg=="}}"#,
        );
        assert_eq!(secret["type"], "kubernetes.io/tls");
        let svc = extracted(
            "",
            "services",
            r#"{"spec":{"clusterIP":"10.96.0.1","type":"ClusterIP"}}"#,
        );
        assert_eq!(svc["spec.clusterIP"], "10.96.0.1");
        assert_eq!(svc["spec.type"], "ClusterIP");
        let ns = extracted("", "namespaces", r#"{"status":{"phase":"Active"}}"#);
        assert_eq!(ns["status.phase"], "Active");
        let csr = extracted(
            "certificates.k8s.io",
            "certificatesigningrequests",
            r#"{"spec":{"signerName":"kubernetes.io/kubelet-serving","request":"AAAA"}}"#,
        );
        assert_eq!(csr["spec.signerName"], "kubernetes.io/kubelet-serving");
        let cm = extracted(
            "",
            "configmaps",
            r#"{"metadata":{"name":"c","namespace":"d"},"data":{"x":"y"}}"#,
        );
        assert_eq!(cm.len(), 2);
        assert_eq!(cm["metadata.name"], "c");
    }

    #[test]
    fn event_source_falls_back_to_the_reporting_component() {
        let raw = r#"{"metadata":{"name":"e","namespace":"ns"},
            "involvedObject":{"kind":"Pod","name":"p","namespace":"ns","uid":"u","apiVersion":"v1",
                              "resourceVersion":"7","fieldPath":"spec.containers{c}"},
            "reason":"Started","type":"Normal","reportingComponent":"kubelet","source":{}}"#;
        let f = extracted("", "events", raw);
        assert_eq!(f["involvedObject.kind"], "Pod");
        assert_eq!(f["involvedObject.fieldPath"], "spec.containers{c}");
        assert_eq!(f["involvedObject.resourceVersion"], "7");
        assert_eq!(f["reason"], "Started");
        assert_eq!(f["type"], "Normal");
        assert_eq!(f["reportingComponent"], "kubelet");
        assert_eq!(f["source"], "kubelet");
        let raw = r#"{"source":{"component":"scheduler"},"reportingComponent":"x"}"#;
        assert_eq!(extracted("", "events", raw)["source"], "scheduler");
    }

    #[test]
    fn extraction_rejects_non_json() {
        assert!(extract_fields("", "pods", b"not json").is_err());
        assert!(extract_fields("", "configmaps", b"{").is_err());
    }
}
