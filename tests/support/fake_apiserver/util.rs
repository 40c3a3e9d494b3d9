//! Small helpers: JSON bodies and responses, query parsing, names, timestamps, SHA-1.

use super::*;

/// Builds a JSON object with fields in the given order (serde_json's `Map` would sort them; the
/// apiserver writes `kind`, `apiVersion`, `metadata` first).
pub(super) struct JsonObj(pub(super) String);

impl JsonObj {
    pub(super) fn new() -> JsonObj {
        JsonObj(String::from("{"))
    }

    pub(super) fn raw(mut self, key: &str, json: &str) -> JsonObj {
        if self.0.len() > 1 {
            self.0.push(',');
        }
        let _ = write!(self.0, "{}:{json}", to_json(&Value::from(key)));
        self
    }

    pub(super) fn str(self, key: &str, value: &str) -> JsonObj {
        let v = to_json(&Value::from(value));
        self.raw(key, &v)
    }

    pub(super) fn finish(mut self) -> String {
        self.0.push('}');
        self.0
    }
}

/// `v` as JSON. An object's `kind` and `apiVersion` come first, in that order, as
/// kube-apiserver's encoder writes them (`TypeMeta` is the first, inlined, member of every
/// built-in type); the other members follow in `serde_json`'s (sorted) order.
pub(super) fn to_json(v: &Value) -> String {
    let Some(o) = v
        .as_object()
        .filter(|o| o.contains_key("kind") || o.contains_key("apiVersion"))
    else {
        return serde_json::to_string(v).unwrap_or_else(|_| "null".into());
    };
    let type_meta = ["kind", "apiVersion"];
    let members = type_meta
        .iter()
        .filter_map(|k| o.get_key_value(*k))
        .chain(o.iter().filter(|(k, _)| !type_meta.contains(&k.as_str())));
    let mut s = String::from("{");
    for (i, (k, m)) in members.enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&serde_json::to_string(k).unwrap_or_default());
        s.push(':');
        s.push_str(&serde_json::to_string(m).unwrap_or_else(|_| "null".into()));
    }
    s.push('}');
    s
}

pub(super) fn add_common_headers(h: &mut HeaderMap) {
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
}

pub(super) fn full_body(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

pub(super) fn empty_body() -> Body {
    full_body(Bytes::new())
}

pub(super) fn json_response(code: StatusCode, body: String) -> Response<Body> {
    let mut resp = Response::new(full_body(body));
    *resp.status_mut() = code;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    add_common_headers(resp.headers_mut());
    resp
}

pub(super) fn text_response(code: StatusCode, body: &'static str) -> Response<Body> {
    let mut resp = Response::new(full_body(body));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp.headers_mut().insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    resp
}

/// Decoded query parameters, in order (`+` is a space, as Go's `url.ParseQuery` has it).
#[derive(Debug, Default)]
pub(super) struct Query(Vec<(String, String)>);

impl Query {
    pub(super) fn parse(raw: &str) -> Query {
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        };
        Query(
            raw.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| match p.split_once('=') {
                    Some((k, v)) => (decode(k), decode(v)),
                    None => (decode(p), String::new()),
                })
                .collect(),
        )
    }

    pub(super) fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub(super) fn flag(&self, key: &str) -> bool {
        self.get(key).is_some_and(parse_bool)
    }
}

/// Go's `strconv.ParseBool` truths; anything else is false.
pub(super) fn parse_bool(s: &str) -> bool {
    matches!(s, "1" | "t" | "T" | "true" | "TRUE" | "True")
}

pub(super) fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

pub(super) fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// Now as RFC 3339 in UTC with second precision, as `metav1.Time` serializes.
pub(super) fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// SHA-1, only for the WebSocket handshake's `Sec-WebSocket-Accept` (RFC 6455 requires it).
pub(super) fn sha1(data: &[u8]) -> [u8; 20] {
    use sha1::Digest;
    sha1::Sha1::digest(data).into()
}
