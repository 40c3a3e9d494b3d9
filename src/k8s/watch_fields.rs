//! Field-level change filtering for watchers: an opt-in extension of the proxy (Kubernetes has
//! no such thing). A watch that sends [`HEADER`] names the fields it cares about; a MODIFIED
//! event that changes none of them is not delivered to it (ADDED and DELETED always are).
//!
//! The header's value is a comma-separated list of field paths, all of one form:
//! - **select**: `spec, metadata.labels, metadata.annotations[example.com/x]` — deliver a
//!   MODIFIED event when any of these differs between the previous and the new object;
//! - **ignore**: `-status, -metadata.managedFields` — deliver it when anything but these
//!   differs (`metadata.resourceVersion` is always ignored in this form: it changes with
//!   every write).
//!
//! A path is dot-separated JSON field names (`[A-Za-z0-9_$-]`), each optionally followed by
//! `[key]` naming a map key that may contain dots or slashes (`metadata.labels[app.kubernetes.io/name]`).
//! Lists are compared whole. A missing field and a JSON `null` are the same (Kubernetes'
//! `omitempty` writes neither), objects compare by content whatever their key order.
//! Hostile input is bounded: at most [`MAX_PATHS`] paths of at most [`MAX_PATH_LEN`] bytes.

use std::hash::{Hash, Hasher};

use serde_json::Value;

/// The request header naming the fields (removed before a request reaches the apiserver).
pub const HEADER: &str = "x-kube-cache-proxy-watch-fields";
/// The response header saying whether a watch that asked is filtered: `applied`, or
/// `unfiltered` when the apiserver answers it (it cannot filter).
pub const APPLIED_HEADER: &str = "x-kube-cache-proxy-watch-filter";

pub const MAX_PATHS: usize = 32;
pub const MAX_PATH_LEN: usize = 256;

/// One segment of a path: a field name, then any `[key]` map keys.
type Path = Vec<String>;

/// A parsed filter. Equal filters have equal [`WatchFields::id`]s: the hub decides once per
/// event per distinct filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchFields {
    ignore: bool,
    paths: Vec<Path>,
    /// The canonical form (sorted, deduplicated), for logs and metrics.
    canonical: String,
    id: u64,
}

impl WatchFields {
    /// Parses the header's value; the error says what is wrong (a 400 `Status` message).
    pub fn parse(value: &str) -> Result<WatchFields, String> {
        let items: Vec<&str> = value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        if items.is_empty() {
            return Err(format!("{HEADER}: no field paths"));
        }
        if items.len() > MAX_PATHS {
            return Err(format!("{HEADER}: more than {MAX_PATHS} field paths"));
        }
        let ignore = items[0].starts_with('-');
        let mut paths = Vec::with_capacity(items.len());
        for item in &items {
            let (neg, p) = match item.strip_prefix('-') {
                Some(p) => (true, p.trim()),
                None => (false, *item),
            };
            if neg != ignore {
                return Err(format!(
                    "{HEADER}: {item:?}: paths are either all selected or all ignored ('-')"
                ));
            }
            if p.len() > MAX_PATH_LEN {
                return Err(format!(
                    "{HEADER}: a field path is longer than {MAX_PATH_LEN} bytes"
                ));
            }
            paths.push(parse_path(p).map_err(|e| format!("{HEADER}: {p:?}: {e}"))?);
        }
        if ignore {
            paths.push(vec!["metadata".into(), "resourceVersion".into()]);
        }
        paths.sort();
        paths.dedup();
        let canonical = paths
            .iter()
            .filter(|p| !(ignore && p[..] == ["metadata", "resourceVersion"]))
            .map(|p| {
                let s = display(p);
                if ignore { format!("-{s}") } else { s }
            })
            .collect::<Vec<_>>()
            .join(",");
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (ignore, &paths).hash(&mut h);
        Ok(WatchFields {
            ignore,
            paths,
            canonical,
            id: h.finish(),
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn canonical(&self) -> &str {
        &self.canonical
    }

    /// Whether the change from `old` to `new` concerns this filter.
    pub fn changed(&self, old: &Value, new: &Value) -> bool {
        if self.ignore {
            let ignored: Vec<&[String]> = self.paths.iter().map(|p| &p[..]).collect();
            !eq_except(Some(old), Some(new), &ignored)
        } else {
            self.paths.iter().any(|p| !same(at(old, p), at(new, p)))
        }
    }

    /// [`WatchFields::changed`] on two objects' JSON; unreadable JSON counts as changed (the
    /// event is delivered).
    pub fn changed_json(&self, old: &[u8], new: &[u8]) -> bool {
        match (
            serde_json::from_slice::<Value>(old),
            serde_json::from_slice::<Value>(new),
        ) {
            (Ok(a), Ok(b)) => self.changed(&a, &b),
            _ => true,
        }
    }
}

fn display(p: &[String]) -> String {
    let mut s = String::new();
    for (i, seg) in p.iter().enumerate() {
        let plain = !seg.is_empty() && seg.bytes().all(is_name_byte);
        if i == 0 {
            s.push_str(seg);
        } else if plain {
            s.push('.');
            s.push_str(seg);
        } else {
            s.push('[');
            s.push_str(seg);
            s.push(']');
        }
    }
    s
}

fn is_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'$'
}

/// `a.b[key].c` -> ["a", "b", "key", "c"].
fn parse_path(p: &str) -> Result<Path, String> {
    let mut out = Vec::new();
    let b = p.as_bytes();
    let mut i = 0;
    let mut expect_name = true;
    while i < b.len() {
        match b[i] {
            b'[' => {
                if out.is_empty() {
                    return Err("a path starts with a field name".into());
                }
                let Some(end) = p[i + 1..].find(']') else {
                    return Err("unclosed '['".into());
                };
                let key = &p[i + 1..i + 1 + end];
                if key.is_empty() {
                    return Err("empty map key".into());
                }
                if key.contains('[') {
                    return Err("'[' inside a map key".into());
                }
                out.push(key.to_string());
                i += end + 2;
                expect_name = false;
            }
            b'.' => {
                if expect_name {
                    return Err("empty field name".into());
                }
                expect_name = true;
                i += 1;
            }
            _ => {
                if !expect_name {
                    return Err("expected '.' or '[' after a field".into());
                }
                let start = i;
                while i < b.len() && is_name_byte(b[i]) {
                    i += 1;
                }
                if i == start {
                    return Err(format!(
                        "unexpected {:?}",
                        p[i..].chars().next().unwrap_or(' ')
                    ));
                }
                out.push(p[start..i].to_string());
                expect_name = false;
            }
        }
    }
    if expect_name {
        return Err("empty field name".into());
    }
    Ok(out)
}

/// The value at `path`, `None` when absent (or under a non-object).
fn at<'a>(v: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut cur = v;
    for seg in path {
        cur = cur.as_object()?.get(seg)?;
    }
    Some(cur)
}

/// Equal, a missing field being the same as `null` at any depth.
fn same(a: Option<&Value>, b: Option<&Value>) -> bool {
    match (a, b) {
        (None | Some(Value::Null), None | Some(Value::Null)) => true,
        (Some(Value::Object(x)), Some(Value::Object(y))) => {
            x.iter().all(|(k, v)| same(Some(v), y.get(k)))
                && y.iter()
                    .all(|(k, v)| x.contains_key(k) || same(None, Some(v)))
        }
        (Some(Value::Array(x)), Some(Value::Array(y))) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(Some(a), Some(b)))
        }
        (Some(a), Some(b)) => a == b,
        _ => false,
    }
}

/// Equal except under the `ignored` paths (relative to `a` and `b`); a missing or `null`
/// object is an empty one.
fn eq_except(a: Option<&Value>, b: Option<&Value>, ignored: &[&[String]]) -> bool {
    if ignored.iter().any(|p| p.is_empty()) {
        return true; // this whole subtree is ignored
    }
    if ignored.is_empty() {
        return same(a, b);
    }
    let empty = serde_json::Map::new();
    fn as_map<'a>(
        v: Option<&'a Value>,
        empty: &'a serde_json::Map<String, Value>,
    ) -> Option<&'a serde_json::Map<String, Value>> {
        match v {
            None | Some(Value::Null) => Some(empty),
            Some(Value::Object(m)) => Some(m),
            Some(_) => None,
        }
    }
    let (Some(ma), Some(mb)) = (as_map(a, &empty), as_map(b, &empty)) else {
        return same(a, b);
    };
    ma.keys()
        .chain(mb.keys().filter(|k| !ma.contains_key(*k)))
        .all(|k| {
            let under: Vec<&[String]> = ignored
                .iter()
                .filter(|p| p[0] == *k)
                .map(|p| &p[1..])
                .collect();
            eq_except(ma.get(k), mb.get(k), &under)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn f(s: &str) -> WatchFields {
        WatchFields::parse(s).unwrap()
    }

    #[test]
    fn paths_parse_with_map_keys_and_bad_ones_say_why() {
        assert_eq!(
            parse_path("metadata.annotations[example.com/x]").unwrap(),
            ["metadata", "annotations", "example.com/x"]
        );
        assert_eq!(parse_path("a[b][c].d").unwrap(), ["a", "b", "c", "d"]);
        for (bad, why) in [
            ("", "empty field name"),
            ("spec.", "empty field name"),
            (".spec", "empty field name"),
            ("a..b", "empty field name"),
            ("[x]", "a path starts with a field name"),
            ("a[x", "unclosed '['"),
            ("a[]", "empty map key"),
            ("a b", "expected '.' or '[' after a field"),
            ("a/b", "expected '.' or '[' after a field"),
            ("*", "unexpected '*'"),
        ] {
            assert_eq!(parse_path(bad).unwrap_err(), why, "{bad:?}");
        }
    }

    #[test]
    fn a_header_is_one_form_bounded_and_canonical() {
        assert_eq!(
            f("spec, metadata.labels,spec").canonical(),
            "metadata.labels,spec"
        );
        assert_eq!(
            f(" -status , -metadata.managedFields").canonical(),
            "-metadata.managedFields,-status"
        );
        assert_eq!(
            f("spec,metadata.labels").id(),
            f("metadata.labels, spec").id()
        );
        assert_ne!(f("spec").id(), f("-spec").id());
        let e = WatchFields::parse("spec,-status").unwrap_err();
        assert!(e.contains("either all selected or all ignored"), "{e}");
        assert!(
            WatchFields::parse(" , ")
                .unwrap_err()
                .contains("no field paths")
        );
        let many = vec!["spec"; MAX_PATHS + 1].join(",");
        assert!(WatchFields::parse(&many).unwrap_err().contains("more than"));
        let long = format!("a{}", ".b".repeat(MAX_PATH_LEN));
        assert!(
            WatchFields::parse(&long)
                .unwrap_err()
                .contains("longer than")
        );
        assert!(
            WatchFields::parse("spec[")
                .unwrap_err()
                .contains("\"spec[\"")
        );
    }

    #[test]
    fn selected_fields_decide() {
        let old = json!({"metadata": {"resourceVersion": "1", "labels": {"a": "1"},
                                       "annotations": {"example.com/x": "1", "other": "1"}},
                         "spec": {"replicas": 1, "list": [1, 2]}, "status": {"n": 1}});
        let status_only = {
            let mut v = old.clone();
            v["status"]["n"] = json!(2);
            v["metadata"]["resourceVersion"] = json!("2");
            v
        };
        let spec = f("spec");
        assert!(!spec.changed(&old, &status_only));
        let mut list = old.clone();
        list["spec"]["list"] = json!([2, 1]);
        assert!(spec.changed(&old, &list), "lists compare whole, in order");
        let ann = f("metadata.annotations[example.com/x]");
        let mut other = old.clone();
        other["metadata"]["annotations"]["other"] = json!("2");
        assert!(!ann.changed(&old, &other));
        let mut mine = old.clone();
        mine["metadata"]["annotations"]["example.com/x"] = json!("2");
        assert!(ann.changed(&old, &mine));
        // Missing and null are the same; a field appearing with a value is a change.
        let mut null = old.clone();
        null["spec"]["extra"] = Value::Null;
        assert!(!spec.changed(&old, &null));
        let mut added = old.clone();
        added["spec"]["extra"] = json!(0);
        assert!(spec.changed(&old, &added));
        // Key order does not matter.
        let a: Value = serde_json::from_str(r#"{"spec":{"a":1,"b":2}}"#).unwrap();
        let b: Value = serde_json::from_str(r#"{"spec":{"b":2,"a":1}}"#).unwrap();
        assert!(!spec.changed(&a, &b));
    }

    #[test]
    fn ignored_fields_and_the_resource_version_never_decide() {
        let ig = f("-status,-metadata.managedFields");
        let old = json!({"metadata": {"resourceVersion": "1", "managedFields": [{"t": 1}],
                                       "labels": {"a": "1"}},
                         "spec": {"x": 1}, "status": {"n": 1}});
        let mut heartbeat = old.clone();
        heartbeat["status"]["n"] = json!(2);
        heartbeat["metadata"]["managedFields"] = json!([{"t": 2}]);
        heartbeat["metadata"]["resourceVersion"] = json!("2");
        assert!(!ig.changed(&old, &heartbeat));
        let mut label = heartbeat.clone();
        label["metadata"]["labels"]["a"] = json!("2");
        assert!(ig.changed(&old, &label));
        // An ignored subtree appearing or vanishing is no change; anything else is.
        let mut no_status = old.clone();
        no_status.as_object_mut().unwrap().remove("status");
        assert!(!ig.changed(&old, &no_status));
        let mut new_field = old.clone();
        new_field["spec"]["y"] = json!(true);
        assert!(ig.changed(&old, &new_field));
        // A map key path inside the ignore form.
        let ann = f("-metadata.annotations[ts]");
        let a = json!({"metadata": {"annotations": {"ts": "1", "k": "v"}}});
        let b = json!({"metadata": {"annotations": {"ts": "2", "k": "v"}}});
        assert!(!ann.changed(&a, &b));
    }

    proptest::proptest! {
        /// A filter selecting a top-level field decides exactly as comparing that field, and
        /// the ignore form of every other top-level field agrees with it.
        #[test]
        fn select_and_ignore_agree(
            a in proptest::collection::btree_map("[abc]", 0i64..3, 0..4),
            b in proptest::collection::btree_map("[abc]", 0i64..3, 0..4),
        ) {
            let to = |m: &std::collections::BTreeMap<String, i64>| {
                Value::Object(m.iter().map(|(k, v)| (k.clone(), json!(v))).collect())
            };
            let (va, vb) = (json!({"x": to(&a), "y": to(&b)}), json!({"x": to(&b), "y": to(&b)}));
            let select = f("x");
            let ignore = f("-y");
            proptest::prop_assert_eq!(select.changed(&va, &vb), a != b);
            proptest::prop_assert_eq!(ignore.changed(&va, &vb), a != b);
            proptest::prop_assert!(!select.changed(&va, &va));
        }
    }
}
