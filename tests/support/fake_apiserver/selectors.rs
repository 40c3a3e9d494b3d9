//! Label and field selectors.

use super::*;

#[derive(Debug)]
pub(super) enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Gt(String, i64),
    Lt(String, i64),
}

/// A label selector as `labels.Parse` understands it: `=`, `==`, `!=`, `in`, `notin`, `key`,
/// `!key`, `>`, `<`, comma-separated (ANDed).
#[derive(Debug, Default)]
pub(super) struct LabelSelector {
    pub(super) reqs: Vec<LabelReq>,
}

#[derive(Debug, PartialEq)]
pub(super) enum Tok {
    Ident(String),
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Gt,
    Lt,
    Open,
    Close,
    Comma,
}

pub(super) fn lex_selector(s: &str) -> Vec<Tok> {
    let mut toks = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '!' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    toks.push(Tok::NotEq);
                } else {
                    toks.push(Tok::Not);
                }
            }
            '=' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    toks.push(Tok::DoubleEq);
                } else {
                    toks.push(Tok::Eq);
                }
            }
            '>' => {
                chars.next();
                toks.push(Tok::Gt);
            }
            '<' => {
                chars.next();
                toks.push(Tok::Lt);
            }
            '(' => {
                chars.next();
                toks.push(Tok::Open);
            }
            ')' => {
                chars.next();
                toks.push(Tok::Close);
            }
            ',' => {
                chars.next();
                toks.push(Tok::Comma);
            }
            _ => {
                let mut ident = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_whitespace() || "!=<>(),".contains(c) {
                        break;
                    }
                    ident.push(c);
                    chars.next();
                }
                toks.push(Tok::Ident(ident));
            }
        }
    }
    toks
}

impl LabelSelector {
    pub(super) fn parse(s: &str) -> Result<LabelSelector, Status> {
        let err = |m: &str| {
            Status::bad_request(format!(
                "unable to parse requirement: {m} (in label selector {s:?})"
            ))
        };
        let toks = lex_selector(s);
        let mut reqs = Vec::new();
        let mut i = 0;
        let ident = |i: usize| match toks.get(i) {
            Some(Tok::Ident(s)) => Some(s.clone()),
            _ => None,
        };
        while i < toks.len() {
            let req = if toks[i] == Tok::Not {
                let key = ident(i + 1).ok_or_else(|| err("expected a key after '!'"))?;
                i += 2;
                LabelReq::NotExists(key)
            } else {
                let key = ident(i).ok_or_else(|| err("expected a key"))?;
                i += 1;
                match toks.get(i) {
                    None | Some(Tok::Comma) => LabelReq::Exists(key),
                    Some(op @ (Tok::Eq | Tok::DoubleEq | Tok::NotEq)) => {
                        let value = match toks.get(i + 1) {
                            Some(Tok::Ident(v)) => {
                                i += 2;
                                v.clone()
                            }
                            None | Some(Tok::Comma) => {
                                i += 1;
                                String::new()
                            }
                            _ => return Err(err("expected a value")),
                        };
                        if *op == Tok::NotEq {
                            LabelReq::NotEq(key, value)
                        } else {
                            LabelReq::Eq(key, value)
                        }
                    }
                    Some(op @ (Tok::Gt | Tok::Lt)) => {
                        let n = ident(i + 1)
                            .and_then(|v| v.parse::<i64>().ok())
                            .ok_or_else(|| err("for 'Gt', 'Lt' operators, exactly one integer value is required"))?;
                        let gt = *op == Tok::Gt;
                        i += 2;
                        if gt {
                            LabelReq::Gt(key, n)
                        } else {
                            LabelReq::Lt(key, n)
                        }
                    }
                    Some(Tok::Ident(kw)) if kw == "in" || kw == "notin" => {
                        let negate = kw == "notin";
                        i += 1;
                        if toks.get(i) != Some(&Tok::Open) {
                            return Err(err("found '', expected: '('"));
                        }
                        i += 1;
                        let mut values = Vec::new();
                        loop {
                            match toks.get(i) {
                                Some(Tok::Ident(v)) => {
                                    values.push(v.clone());
                                    i += 1;
                                }
                                Some(Tok::Comma) => i += 1,
                                Some(Tok::Close) => {
                                    i += 1;
                                    break;
                                }
                                _ => return Err(err("expected ')'")),
                            }
                        }
                        if values.is_empty() {
                            return Err(err(
                                "for 'in', 'notin' operators, values set can't be empty",
                            ));
                        }
                        if negate {
                            LabelReq::NotIn(key, values)
                        } else {
                            LabelReq::In(key, values)
                        }
                    }
                    _ => return Err(err("expected an operator")),
                }
            };
            reqs.push(req);
            match toks.get(i) {
                None => {}
                Some(Tok::Comma) => {
                    i += 1;
                    if i == toks.len() {
                        return Err(err("expected a requirement after ','"));
                    }
                }
                _ => return Err(err("expected ','")),
            }
        }
        Ok(LabelSelector { reqs })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        let labels = obj.get("metadata").and_then(|m| m.get("labels"));
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.reqs.iter().all(|r| match r {
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            LabelReq::Gt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            LabelReq::Lt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x < *n),
        })
    }
}

#[derive(Debug)]
pub(super) struct FieldReq {
    pub(super) field: String,
    pub(super) value: String,
    pub(super) equal: bool,
}

/// A field selector: `field=value`, `field==value`, `field!=value`, comma-separated.
#[derive(Debug, Default)]
pub(super) struct FieldSelector {
    pub(super) reqs: Vec<FieldReq>,
}

/// Fields each kind can be selected on, as its `AddFieldLabelConversionFunc` allows.
pub(super) fn supported_fields(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::ConfigMap => &["metadata.name", "metadata.namespace"],
        Kind::Namespace => &["metadata.name", "status.phase"],
        Kind::Crd => &["metadata.name"],
        Kind::Widget => &["metadata.name", "metadata.namespace"],
        Kind::Pod => &[
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
    }
}

/// The field labels the widgets CRD declares for v1 (`selectableFields`, without the leading
/// dot), as the apiserver's CR field label conversion accepts them; none for other kinds.
pub(super) fn selectable_fields(shared: &Shared, kind: Kind) -> Vec<String> {
    if kind != Kind::Widget {
        return Vec::new();
    }
    let store = shared.store();
    let Some(crd) = store.objects(Kind::Crd).get(WIDGETS_CRD) else {
        return Vec::new();
    };
    let versions = crd.pointer("/spec/versions").and_then(Value::as_array);
    versions
        .into_iter()
        .flatten()
        .filter(|v| v["name"] == "v1")
        .flat_map(|v| {
            v["selectableFields"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|f| Some(f["jsonPath"].as_str()?.trim_start_matches('.').to_string()))
        .collect()
}

impl FieldSelector {
    pub(super) fn parse(
        s: &str,
        kind: Kind,
        selectable: &[String],
    ) -> Result<FieldSelector, Status> {
        let mut reqs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (field, value, equal) = if let Some((f, v)) = part.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, v, true)
            } else {
                return Err(Status::bad_request(format!(
                    "invalid selector: '{s}'; can't understand '{part}'"
                )));
            };
            let field = field.trim();
            if !supported_fields(kind).contains(&field) && !selectable.iter().any(|f| f == field) {
                return Err(Status::bad_request(match kind {
                    Kind::ConfigMap => format!(
                        "{field:?} is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
                    ),
                    _ => format!("field label not supported: {field}"),
                }));
            }
            reqs.push(FieldReq {
                field: field.to_string(),
                value: value.trim().to_string(),
                equal,
            });
        }
        Ok(FieldSelector { reqs })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        self.reqs.iter().all(|r| {
            let actual = field_value(obj, &r.field);
            (actual == r.value) == r.equal
        })
    }
}

pub(super) fn field_value(obj: &Value, field: &str) -> String {
    if field == "spec.hostNetwork" {
        let on = obj
            .pointer("/spec/hostNetwork")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        return on.to_string();
    }
    // As the CR strategy formats a selectable field (`fmt.Sprint`): strings as they are,
    // integers in decimal, booleans as true/false, absent or null as "".
    let pointer = format!("/{}", field.replace('.', "/"));
    match obj.pointer(&pointer) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    }
}
