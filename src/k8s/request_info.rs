//! What a request is, in the apiserver's terms: path hygiene and `RequestInfo`.
//!
//! [`RequestInfo::parse`] mirrors k8s.io/apiserver `pkg/endpoints/request/requestinfo.go`
//! (`RequestInfoFactory.NewRequestInfo`); keep it in sync with that file when Kubernetes adds
//! namespace subresources or special verbs. Metrics labels and, later, the cache-or-passthrough
//! routing decision are derived from it.

use http::Method;
use percent_encoding::percent_decode_str;

/// Why a request path was refused before it reached any handler.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    #[error("the request path must start with '/'")]
    NotAbsolute,
    #[error("the request path contains an empty segment ('//')")]
    EmptySegment,
    #[error("the request path contains a '.' or '..' segment")]
    DotSegment,
    #[error("the request path contains a '\\'")]
    Backslash,
    #[error("the request path contains a control character")]
    ControlCharacter,
    #[error("the request path is not valid UTF-8 once percent-decoded")]
    InvalidUtf8,
}

/// Checks a raw request path as it came off the wire.
///
/// The apiserver's Go mux would clean `..` and `//` with a redirect; a proxy must not guess
/// which object the caller meant (and must not let `..` walk from a cached path to an uncached
/// one), so these are refused with 400, also when percent-encoded (`%2e%2e`, `%2F%2F`).
/// An encoded `/` is a separator, as in Go's `URL.Path`, which the apiserver routes and
/// authorizes by (`configmaps%2Fcm-1` is the object `cm-1`; the raw path that passes through
/// decodes to the same one upstream, so the two can never disagree). A `\` is refused: no
/// Kubernetes name contains one, and some servers take it for a separator.
/// Returns the percent-decoded path (what Go's `URL.Path` holds and what the apiserver
/// routes and authorizes by: `sec%2Dc` is namespace `sec-c`).
pub fn validate_path(raw: &str) -> Result<std::borrow::Cow<'_, str>, PathError> {
    if !raw.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    let decoded = percent_decode_str(raw)
        .decode_utf8()
        .map_err(|_| PathError::InvalidUtf8)?;
    if decoded.chars().any(|c| c.is_control()) {
        return Err(PathError::ControlCharacter);
    }
    if decoded.contains('\\') {
        return Err(PathError::Backslash);
    }
    if raw == "/" {
        return Ok(decoded);
    }
    // A single trailing slash is tolerated (`/api/v1/`), as the apiserver serves it.
    let trimmed = decoded.strip_suffix('/').unwrap_or(&decoded);
    for seg in trimmed[1..].split('/') {
        match seg {
            "" => return Err(PathError::EmptySegment),
            "." | ".." => return Err(PathError::DotSegment),
            _ => {}
        }
    }
    Ok(decoded)
}

/// The apiserver's view of a request (`k8s.io/apiserver/pkg/endpoints/request.RequestInfo`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RequestInfo {
    pub is_resource_request: bool,
    /// Lower-case authorization verb: get, list, watch, create, update, patch, delete,
    /// deletecollection, proxy; for non-resource requests the lower-cased HTTP method.
    pub verb: String,
    pub api_group: String,
    pub api_version: String,
    pub namespace: String,
    pub resource: String,
    pub subresource: String,
    pub name: String,
    /// The resource was addressed under `/namespaces/{namespace}/` (not the Namespace object's
    /// own `/namespaces/{name}` path). A cluster-scoped resource there is the apiserver's 404.
    pub under_namespace: bool,
    /// `name` came from a list or watch's `fieldSelector=metadata.name=X`, as the apiserver's
    /// RequestInfo takes it (authorization then sees the name: RBAC `resourceNames` rules).
    pub name_from_selector: bool,
}

/// Subresources of a Namespace object itself (`/api/v1/namespaces/x/status`), not namespaced
/// resources. From requestinfo.go `namespaceSubresources`.
const NAMESPACE_SUBRESOURCES: &[&str] = &["status", "finalize"];

impl RequestInfo {
    /// Parses a (validated) path and query as the apiserver does.
    pub fn parse(method: &Method, path: &str, query: Option<&str>) -> RequestInfo {
        let mut info = RequestInfo {
            verb: method.as_str().to_ascii_lowercase(),
            ..Default::default()
        };
        let trimmed = path.trim_matches('/');
        let mut parts: Vec<&str> = if trimmed.is_empty() {
            Vec::new()
        } else {
            trimmed.split('/').collect()
        };
        if parts.len() < 3 {
            // A resource request needs at least /api/v1/x or /apis/g/v; discovery is not one.
            return info;
        }
        match parts[0] {
            "api" => {
                info.api_version = parts[1].to_string();
                parts.drain(..2);
            }
            "apis" => {
                if parts.len() < 4 {
                    return info;
                }
                info.api_group = parts[1].to_string();
                info.api_version = parts[2].to_string();
                parts.drain(..3);
            }
            _ => return info,
        }
        info.is_resource_request = true;

        let mut special = None;
        if matches!(parts.first(), Some(&"watch") | Some(&"proxy")) {
            special = Some(parts[0]);
            parts.remove(0);
            if parts.is_empty() {
                info.is_resource_request = false;
                return info;
            }
        }
        info.verb = match special {
            Some(v) => v.to_string(),
            None => match *method {
                Method::POST => "create",
                Method::GET | Method::HEAD => "get",
                Method::PUT => "update",
                Method::PATCH => "patch",
                Method::DELETE => "delete",
                _ => "",
            }
            .to_string(),
        };

        if parts[0] == "namespaces" && parts.len() > 1 {
            info.namespace = parts[1].to_string();
            if parts.len() > 2 && !NAMESPACE_SUBRESOURCES.contains(&parts[2]) {
                info.under_namespace = true;
                parts.drain(..2);
            }
        }

        if parts.len() >= 3 && info.verb != "proxy" {
            info.subresource = parts[2].to_string();
        }
        if parts.len() >= 2 {
            info.name = parts[1].to_string();
        }
        info.resource = parts[0].to_string();

        if parts.len() == 1 && info.verb == "get" {
            info.verb = if query_flag(query, "watch") {
                "watch".into()
            } else {
                "list".into()
            };
            // requestinfo.go: `opts.FieldSelector.RequiresExactMatch("metadata.name")`, kept
            // when it is a valid path segment name.
            let selected = query_param(query, "fieldSelector")
                .and_then(|f| crate::k8s::selector::FieldSelector::parse(&f).ok())
                .and_then(|f| f.exact_value("metadata.name").map(str::to_string))
                .filter(|n| {
                    !matches!(n.as_str(), "." | "..") && !n.contains('/') && !n.contains('%')
                });
            if let Some(n) = selected {
                info.name = n;
                info.name_from_selector = true;
            }
        }
        if info.verb == "delete" && info.name.is_empty() {
            info.verb = "deletecollection".into();
        }
        info
    }

    /// The verb label of the apiserver's request metrics (`metrics.CleanVerb`): LIST, WATCH,
    /// GET, POST, PUT, PATCH, APPLY (server-side apply), DELETE, CONNECT; any other method a
    /// client sends is `other`, as the apiserver labels it (`cleanVerb`'s
    /// `validRequestMethods`): a label per method name would let a client grow the metrics
    /// without bound.
    pub fn metrics_verb(
        &self,
        method: &Method,
        content_type: Option<&str>,
        upgrade: bool,
    ) -> String {
        if upgrade
            || matches!(
                self.subresource.as_str(),
                "exec" | "attach" | "portforward" | "proxy"
            )
            || self.verb == "proxy"
        {
            return "CONNECT".into();
        }
        match self.verb.as_str() {
            "list" => "LIST".into(),
            "watch" => "WATCH".into(),
            "deletecollection" => "DELETE".into(),
            "patch" if content_type.is_some_and(|c| c.starts_with("application/apply-patch")) => {
                "APPLY".into()
            }
            _ => {
                let m = method.as_str().to_ascii_uppercase();
                if matches!(
                    m.as_str(),
                    "GET" | "POST" | "PUT" | "PATCH" | "DELETE" | "CONNECT" | "CREATE" | "UPDATE"
                ) {
                    m
                } else {
                    "other".into()
                }
            }
        }
    }

    /// The scope label of the apiserver's request metrics (`metrics.CleanScope`).
    pub fn metrics_scope(&self) -> &'static str {
        if !self.is_resource_request {
            return "";
        }
        if !self.name.is_empty() || self.verb == "create" {
            "resource"
        } else if !self.namespace.is_empty() {
            "namespace"
        } else {
            "cluster"
        }
    }

    /// Long-running requests (watches, upgrades, proxy, logs follow) are excluded from request
    /// timeouts and tracked separately, as the apiserver's `LongRunningRequestCheck` does.
    pub fn is_long_running(&self, query: Option<&str>, upgrade: bool) -> bool {
        upgrade
            || self.verb == "watch"
            || self.verb == "proxy"
            || matches!(
                self.subresource.as_str(),
                "exec" | "attach" | "portforward" | "proxy"
            )
            || (self.subresource == "log" && query_flag(query, "follow"))
    }
}

/// True when a boolean query parameter is set the way the apiserver's decoder accepts
/// (`watch=1`, `watch=true`, `watch=True`).
pub fn query_flag(query: Option<&str>, key: &str) -> bool {
    query_param(query, key)
        .is_some_and(|v| matches!(v.as_str(), "1" | "true" | "True" | "TRUE" | "t" | "T"))
}

/// The first value of a query parameter, percent-decoded.
pub fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    let q = query?;
    q.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == key).then(|| {
            percent_decode_str(&v.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(m: Method, p: &str, q: Option<&str>) -> RequestInfo {
        RequestInfo::parse(&m, p, q)
    }

    #[test]
    #[allow(clippy::type_complexity)] // a literal table reads best as tuples
    fn table_of_request_infos_matches_the_apiserver() {
        // (method, path, query, verb, group, version, namespace, resource, subresource, name)
        let cases: &[(
            Method,
            &str,
            Option<&str>,
            &str,
            &str,
            &str,
            &str,
            &str,
            &str,
            &str,
        )] = &[
            (
                Method::GET,
                "/api/v1/pods",
                None,
                "list",
                "",
                "v1",
                "",
                "pods",
                "",
                "",
            ),
            (
                Method::GET,
                "/api/v1/pods",
                Some("watch=1"),
                "watch",
                "",
                "v1",
                "",
                "pods",
                "",
                "",
            ),
            (
                Method::GET,
                "/api/v1/pods",
                Some("watch=false"),
                "list",
                "",
                "v1",
                "",
                "pods",
                "",
                "",
            ),
            (
                Method::GET,
                "/api/v1/namespaces/a/pods",
                None,
                "list",
                "",
                "v1",
                "a",
                "pods",
                "",
                "",
            ),
            (
                Method::GET,
                "/api/v1/namespaces/a/pods/p",
                None,
                "get",
                "",
                "v1",
                "a",
                "pods",
                "",
                "p",
            ),
            (
                Method::POST,
                "/api/v1/namespaces/a/pods/p/exec",
                None,
                "create",
                "",
                "v1",
                "a",
                "pods",
                "exec",
                "p",
            ),
            (
                Method::GET,
                "/api/v1/namespaces/a/pods/p/log",
                None,
                "get",
                "",
                "v1",
                "a",
                "pods",
                "log",
                "p",
            ),
            (
                Method::GET,
                "/api/v1/namespaces/a",
                None,
                "get",
                "",
                "v1",
                "a",
                "namespaces",
                "",
                "a",
            ),
            (
                Method::PUT,
                "/api/v1/namespaces/a/finalize",
                None,
                "update",
                "",
                "v1",
                "a",
                "namespaces",
                "finalize",
                "a",
            ),
            (
                Method::GET,
                "/api/v1/namespaces",
                None,
                "list",
                "",
                "v1",
                "",
                "namespaces",
                "",
                "",
            ),
            (
                Method::GET,
                "/api/v1/watch/namespaces/a/pods",
                None,
                "watch",
                "",
                "v1",
                "a",
                "pods",
                "",
                "",
            ),
            (
                Method::GET,
                "/apis/apps/v1/namespaces/a/deployments/d/scale",
                None,
                "get",
                "apps",
                "v1",
                "a",
                "deployments",
                "scale",
                "d",
            ),
            (
                Method::DELETE,
                "/api/v1/namespaces/a/configmaps",
                None,
                "deletecollection",
                "",
                "v1",
                "a",
                "configmaps",
                "",
                "",
            ),
            (
                Method::DELETE,
                "/api/v1/namespaces/a/configmaps/c",
                None,
                "delete",
                "",
                "v1",
                "a",
                "configmaps",
                "",
                "c",
            ),
            (
                Method::PATCH,
                "/apis/apps/v1/namespaces/a/deployments/d",
                None,
                "patch",
                "apps",
                "v1",
                "a",
                "deployments",
                "",
                "d",
            ),
            (
                Method::GET,
                "/api/v1/proxy/namespaces/a/pods/p/x/y",
                None,
                "proxy",
                "",
                "v1",
                "a",
                "pods",
                "",
                "p",
            ),
        ];
        for (m, p, q, verb, g, v, ns, r, sr, n) in cases {
            let i = parse(m.clone(), p, *q);
            assert!(i.is_resource_request, "{p}");
            assert_eq!(
                (
                    i.verb.as_str(),
                    i.api_group.as_str(),
                    i.api_version.as_str(),
                    i.namespace.as_str(),
                    i.resource.as_str(),
                    i.subresource.as_str(),
                    i.name.as_str()
                ),
                (*verb, *g, *v, *ns, *r, *sr, *n),
                "{m} {p}"
            );
        }
    }

    #[test]
    fn discovery_and_health_are_not_resource_requests() {
        for p in [
            "/",
            "/api",
            "/api/v1",
            "/apis",
            "/apis/apps",
            "/apis/apps/v1",
            "/version",
            "/readyz",
            "/openapi/v3",
        ] {
            assert!(!parse(Method::GET, p, None).is_resource_request, "{p}");
        }
    }

    #[test]
    fn a_resource_under_a_namespace_is_told_from_the_namespace_object() {
        for (p, under) in [
            ("/api/v1/namespaces/a", false),
            ("/api/v1/namespaces/a/status", false),
            ("/api/v1/namespaces/a/finalize", false),
            ("/api/v1/namespaces", false),
            ("/api/v1/nodes", false),
            ("/api/v1/namespaces/a/namespaces", true),
            ("/api/v1/namespaces/a/namespaces/a", true),
            ("/api/v1/watch/namespaces/a/namespaces", true),
            ("/api/v1/namespaces/a/nodes", true),
            ("/api/v1/namespaces/a/pods/p", true),
        ] {
            let info = parse(Method::GET, p, None);
            assert_eq!(info.under_namespace, under, "{p}");
            let ns = if p.contains("namespaces/a") { "a" } else { "" };
            assert_eq!(info.namespace, ns, "{p}");
        }
    }

    #[test]
    fn metrics_verbs_and_scopes_follow_clean_verb() {
        let list = parse(Method::GET, "/api/v1/pods", None);
        assert_eq!(list.metrics_verb(&Method::GET, None, false), "LIST");
        // Methods the apiserver does not serve are one label, whatever their names.
        let pod = parse(Method::GET, "/api/v1/namespaces/a/pods/p", None);
        for m in ["FOO", "PROPFIND", "OPTIONS", "HEAD", "TRACE"] {
            let method = Method::from_bytes(m.as_bytes()).unwrap();
            assert_eq!(pod.metrics_verb(&method, None, false), "other", "{m}");
        }
        assert_eq!(pod.metrics_verb(&Method::PUT, None, false), "PUT");
        assert_eq!(list.metrics_scope(), "cluster");
        let watch = parse(Method::GET, "/api/v1/namespaces/a/pods", Some("watch=true"));
        assert_eq!(watch.metrics_verb(&Method::GET, None, false), "WATCH");
        assert_eq!(watch.metrics_scope(), "namespace");
        let apply = parse(Method::PATCH, "/api/v1/namespaces/a/configmaps/c", None);
        assert_eq!(
            apply.metrics_verb(&Method::PATCH, Some("application/apply-patch+yaml"), false),
            "APPLY"
        );
        assert_eq!(apply.metrics_scope(), "resource");
        let exec = parse(Method::POST, "/api/v1/namespaces/a/pods/p/exec", None);
        assert_eq!(exec.metrics_verb(&Method::POST, None, true), "CONNECT");
        assert!(exec.is_long_running(None, true));
        let create = parse(Method::POST, "/api/v1/namespaces/a/configmaps", None);
        assert_eq!(create.metrics_scope(), "resource");
    }

    #[test]
    fn hostile_paths_are_refused() {
        let bad = [
            ("/api/v1/../secrets", PathError::DotSegment),
            ("/api/v1/./pods", PathError::DotSegment),
            ("/api/v1/%2e%2e/secrets", PathError::DotSegment),
            ("/api//v1/pods", PathError::EmptySegment),
            ("/api/v1/namespaces/a%2F%2Fb/pods", PathError::EmptySegment),
            ("/api/v1/namespaces/a%2F..%2Fb/pods", PathError::DotSegment),
            ("/api/v1/namespaces/a%5cb/pods", PathError::Backslash),
            ("/api/v1/namespaces/a\\b/pods", PathError::Backslash),
            ("/api/v1/namespaces/%ff/pods", PathError::InvalidUtf8),
            ("/api/v1/namespaces/%00/pods", PathError::ControlCharacter),
            ("api/v1", PathError::NotAbsolute),
        ];
        for (p, want) in bad {
            assert_eq!(validate_path(p).map(|_| ()), Err(want), "{p}");
        }
        for ok in [
            "/",
            "/api/v1/",
            "/api/v1/namespaces/a/pods",
            "/apis/apps/v1/deployments",
            "/api/v1/namespaces/caf%C3%A9",
        ] {
            assert!(validate_path(ok).is_ok(), "{ok}");
        }
    }

    /// Go's `URL.Path` decodes `%2F`: the apiserver serves `configmaps%2Fcm-1` as the object
    /// `cm-1` (200) and `cm-1%2Fx` as its subresource `x` (404), as measured against
    /// kube-apiserver 1.36.
    #[test]
    fn an_encoded_slash_separates_segments_as_in_the_apiservers_decoded_path() {
        let p = validate_path("/api/v1/namespaces/default/configmaps%2Fcm-1").unwrap();
        assert_eq!(p, "/api/v1/namespaces/default/configmaps/cm-1");
        let info = parse(Method::GET, &p, None);
        assert_eq!(
            (info.resource.as_str(), info.name.as_str()),
            ("configmaps", "cm-1")
        );
        let p = validate_path("/api/v1/namespaces/default/configmaps/cm-1%2fx").unwrap();
        let info = parse(Method::GET, &p, None);
        assert_eq!(info.subresource, "x");
    }

    #[test]
    fn query_flags_decode_like_the_apiserver() {
        assert!(query_flag(Some("a=b&watch=1"), "watch"));
        assert!(query_flag(Some("watch=true"), "watch"));
        assert!(!query_flag(Some("watch=0"), "watch"));
        assert!(!query_flag(None, "watch"));
        assert_eq!(
            query_param(Some("labelSelector=a%3Db"), "labelSelector").as_deref(),
            Some("a=b")
        );
    }
}
