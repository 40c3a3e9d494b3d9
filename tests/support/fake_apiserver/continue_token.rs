//! Continue tokens (k8s.io/apiserver/pkg/storage/continue.go).

use super::*;

/// base64url (no padding) of `{"v":"meta.k8s.io/v1","rv":N,"start":"<key>"}`, the key relative
/// to the list's key prefix.
pub(super) fn encode_continue(start: &str, rv: i64) -> String {
    let json = JsonObj::new()
        .str("v", "meta.k8s.io/v1")
        .raw("rv", &rv.to_string())
        .str("start", start)
        .finish();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
}

/// Returns (absolute start key, resourceVersion; -1 means "latest").
pub(super) fn decode_continue(token: &str, prefix: &str) -> Result<(String, i64), String> {
    const INVALID: &str = "continue key is not valid";
    let data = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.trim_end_matches('='))
        .map_err(|e| format!("{INVALID}: {e}"))?;
    let v: Value = serde_json::from_slice(&data).map_err(|e| format!("{INVALID}: {e}"))?;
    let version = v.get("v").and_then(Value::as_str).unwrap_or("");
    if version != "meta.k8s.io/v1" {
        return Err(format!(
            "{INVALID}: server does not recognize this encoded version {version}"
        ));
    }
    let rv = v.get("rv").and_then(Value::as_i64).unwrap_or(0);
    if rv == 0 {
        return Err(format!(
            "{INVALID}: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"
        ));
    }
    let start = v.get("start").and_then(Value::as_str).unwrap_or("");
    if start.is_empty() {
        return Err(format!(
            "{INVALID}: encoded start key empty (version meta.k8s.io/v1)"
        ));
    }
    // The apiserver's path.Clean check: no empty, "." or ".." segments, no leading slash games.
    let rel = start.strip_prefix('/').unwrap_or(start);
    if rel
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err(format!("{INVALID}: {start}"));
    }
    Ok((format!("{prefix}{rel}"), rv))
}
