//! Who the caller is, and the headers that carry that identity upstream.
//!
//! The rules (all enforced by [`upstream_headers`], a pure function):
//! - hop-by-hop headers (RFC 9110 §7.6.1) and every header named in `Connection` are dropped;
//! - a caller's bearer token is forwarded unchanged, with any `Impersonate-*` headers it sent:
//!   the apiserver then authenticates the token and authorizes the impersonation itself;
//! - a client-certificate caller is impersonated (`Impersonate-User`/`-Group`, and
//!   `-Uid`/`-Extra-<key>` when its identity has them: an impersonation the proxy authorized)
//!   over the proxy's own credentials; its own `Authorization`, `Impersonate-*` and
//!   `X-Remote-*` headers are dropped;
//! - an anonymous caller goes upstream anonymous (no credentials at all), its `X-Remote-*`
//!   headers dropped and its `Impersonate-*` headers kept: the apiserver authorizes (and
//!   refuses) `system:anonymous`'s impersonation itself, in its own words;
//! - identity headers are set *after* `Connection`-named removal, so `Connection:
//!   Impersonate-User` (or `Authorization`) can never strip what the proxy asserts.

use std::net::IpAddr;

use http::{HeaderMap, HeaderName, HeaderValue, header};

use crate::upstream::As;

/// A caller as identified by the listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A client certificate verified against the client CA: CN is the user, O the groups
    /// (kube-apiserver's x509 authenticator); uid and extra only as the target of an
    /// impersonation the proxy authorized.
    Certificate(CertIdentity),
    /// An `Authorization` header the proxy forwards unchanged.
    Bearer(HeaderValue),
    /// No credentials.
    Anonymous,
}

impl Caller {
    /// Identifies a caller from its connection's verified certificate (if any) and the
    /// request headers. A certificate wins over a token, as in kube-apiserver's
    /// authenticator union (x509 is consulted first).
    pub fn identify(cert: Option<&CertIdentity>, headers: &HeaderMap) -> Caller {
        if let Some(c) = cert {
            return Caller::Certificate(c.clone());
        }
        match headers.get(header::AUTHORIZATION) {
            Some(v) if !v.is_empty() => Caller::Bearer(v.clone()),
            _ => Caller::Anonymous,
        }
    }

    /// Which upstream identity pool serves this caller.
    pub fn upstream_as(&self) -> As {
        match self {
            Caller::Certificate(_) => As::Proxy,
            Caller::Bearer(_) | Caller::Anonymous => As::Caller,
        }
    }

    /// A label for logs that never contains a credential.
    pub fn describe(&self) -> String {
        match self {
            Caller::Certificate(c) => format!("x509:{}", c.user),
            Caller::Bearer(_) => "bearer".into(),
            Caller::Anonymous => "anonymous".into(),
        }
    }
}

/// The identity in a verified client certificate (or the target of an impersonation the
/// proxy authorized for a certificate caller).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CertIdentity {
    pub user: String,
    pub groups: Vec<String>,
    /// Empty from a certificate (kube-apiserver's x509 authenticator sets no uid).
    pub uid: String,
    /// Empty from a certificate.
    pub extra: std::collections::BTreeMap<String, Vec<String>>,
}

impl CertIdentity {
    /// Reads CN and O from a DER certificate that rustls has already verified.
    pub fn from_der(der: &[u8]) -> Option<CertIdentity> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let subject = cert.subject();
        let user = subject
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())?
            .to_string();
        if user.is_empty() {
            return None;
        }
        let groups = subject
            .iter_organization()
            .filter_map(|o| o.as_str().ok().map(str::to_string))
            .collect();
        Some(CertIdentity {
            user,
            groups,
            ..Default::default()
        })
    }
}

/// Headers that describe one connection hop, never forwarded (RFC 9110 §7.6.1, plus the
/// legacy `Proxy-Connection` and `Keep-Alive`).
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Drops hop-by-hop headers and those named in `Connection` (both directions), except the
/// headers the apiserver authenticates and authorizes by (`Authorization`, `Impersonate-*`):
/// the apiserver is an endpoint and reads them whatever `Connection` says, so a caller
/// naming them there must not get a different identity through the proxy.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .filter(|n| *n != header::AUTHORIZATION && !n.as_str().starts_with("impersonate-"))
        .collect();
    for name in named {
        headers.remove(&name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

fn is_identity_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    n.starts_with("impersonate-") || n.starts_with("x-remote-")
}

/// Builds the headers of the upstream request from the inbound ones.
///
/// `upgrade` is the inbound `Upgrade` header value when this is a protocol upgrade, which is
/// re-asserted after hop-by-hop removal. `peer` is appended to `X-Forwarded-For` (the
/// apiserver records it in audit `sourceIPs`).
pub fn upstream_headers(
    inbound: &HeaderMap,
    caller: &Caller,
    upgrade: Option<&HeaderValue>,
    peer: Option<IpAddr>,
) -> HeaderMap {
    let mut h = inbound.clone();
    strip_hop_by_hop(&mut h);
    h.remove(header::HOST);
    // The proxy's own extension (a watch's field filter): never the apiserver's business.
    h.remove(crate::k8s::watch_fields::HEADER);
    match caller {
        Caller::Bearer(token) => {
            h.insert(header::AUTHORIZATION, token.clone());
        }
        Caller::Certificate(c) => {
            h.remove(header::AUTHORIZATION);
            let names: Vec<HeaderName> = h
                .keys()
                .filter(|n| is_identity_header(n))
                .cloned()
                .collect();
            for n in names {
                h.remove(n);
            }
            if let Ok(v) = HeaderValue::from_str(&c.user) {
                h.insert("impersonate-user", v);
            }
            for g in &c.groups {
                if let Ok(v) = HeaderValue::from_str(g) {
                    h.append("impersonate-group", v);
                }
            }
            if !c.uid.is_empty()
                && let Ok(v) = HeaderValue::from_str(&c.uid)
            {
                h.insert("impersonate-uid", v);
            }
            for (k, vs) in &c.extra {
                let Ok(name) = HeaderName::from_bytes(
                    format!("impersonate-extra-{}", extra_key_escape(k)).as_bytes(),
                ) else {
                    continue;
                };
                for v in vs {
                    if let Ok(v) = HeaderValue::from_str(v) {
                        h.append(name.clone(), v);
                    }
                }
            }
        }
        Caller::Anonymous => {
            h.remove(header::AUTHORIZATION);
            // The request carries no credentials of the proxy's (`As::Caller`), so the
            // apiserver sees `system:anonymous` asking to impersonate, as it would directly.
            let names: Vec<HeaderName> = h
                .keys()
                .filter(|n| n.as_str().starts_with("x-remote-"))
                .cloned()
                .collect();
            for n in names {
                h.remove(n);
            }
        }
    }
    if let Some(proto) = upgrade {
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, proto.clone());
    }
    if let Some(ip) = peer {
        let xff = match h.get("x-forwarded-for").and_then(|v| v.to_str().ok()) {
            Some(prev) if !prev.is_empty() => format!("{prev}, {ip}"),
            _ => ip.to_string(),
        };
        if let Ok(v) = HeaderValue::from_str(&xff) {
            h.insert("x-forwarded-for", v);
        }
    }
    h
}

/// An extra key as a header-name suffix, as client-go's `headerKeyEscape`: every byte that is
/// not an RFC 7230 token character, and `%` itself, percent-encoded (`%2F`); the apiserver
/// lowercases the header name and `url.PathUnescape`s it. (Header names are case-insensitive,
/// so keys with upper-case letters cannot travel: Kubernetes' keys are lower case.)
pub fn extra_key_escape(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        let token = b.is_ascii_alphanumeric() || b"!#$&'*+-.^_`|~".contains(&b);
        if token {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The `Upgrade` protocol of an HTTP/1.1 upgrade request (`Connection: Upgrade` plus an
/// `Upgrade` header), or `None`.
pub fn upgrade_protocol(headers: &HeaderMap) -> Option<&HeaderValue> {
    let conn_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    if conn_upgrade {
        headers.get(header::UPGRADE)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hm(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    fn cert_caller() -> Caller {
        Caller::Certificate(CertIdentity {
            user: "jane".into(),
            groups: vec!["dev".into(), "ops".into()],
            ..Default::default()
        })
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_dropped() {
        let inbound = hm(&[
            ("connection", "keep-alive, x-secret-hop"),
            ("keep-alive", "timeout=5"),
            ("x-secret-hop", "1"),
            ("te", "trailers"),
            ("proxy-authorization", "Basic abc"),
            ("accept", "application/json"),
        ]);
        let out = upstream_headers(&inbound, &Caller::Anonymous, None, None);
        for gone in [
            "connection",
            "keep-alive",
            "x-secret-hop",
            "te",
            "proxy-authorization",
        ] {
            assert!(!out.contains_key(gone), "{gone} should be dropped");
        }
        assert_eq!(out["accept"], "application/json");
    }

    #[test]
    fn connection_header_cannot_strip_the_impersonation_the_proxy_asserts() {
        let inbound = hm(&[(
            "connection",
            "Impersonate-User, Impersonate-Group, Authorization",
        )]);
        let out = upstream_headers(&inbound, &cert_caller(), None, None);
        assert_eq!(out["impersonate-user"], "jane");
        let groups: Vec<_> = out.get_all("impersonate-group").iter().collect();
        assert_eq!(groups, ["dev", "ops"]);
    }

    #[test]
    fn connection_header_cannot_strip_a_bearer_callers_impersonation_request() {
        // The apiserver reads Impersonate-* whatever Connection says, and refuses a caller
        // who may not impersonate: stripping them would serve the request as the caller.
        let inbound = hm(&[
            ("authorization", "Bearer t0k"),
            ("impersonate-user", "system:admin"),
            ("impersonate-group", "system:masters"),
            ("connection", "Impersonate-User, impersonate-group, x-other"),
            ("x-other", "1"),
        ]);
        let caller = Caller::identify(None, &inbound);
        let out = upstream_headers(&inbound, &caller, None, None);
        assert_eq!(out["impersonate-user"], "system:admin");
        assert_eq!(out["impersonate-group"], "system:masters");
        assert!(!out.contains_key("x-other"));
        assert!(!out.contains_key("connection"));
    }

    #[test]
    fn connection_header_cannot_strip_a_forwarded_bearer_token() {
        let inbound = hm(&[
            ("authorization", "Bearer t0k"),
            ("connection", "authorization"),
        ]);
        let caller = Caller::identify(None, &inbound);
        let out = upstream_headers(&inbound, &caller, None, None);
        assert_eq!(out["authorization"], "Bearer t0k");
    }

    #[test]
    fn certificate_callers_cannot_smuggle_identity_headers() {
        let inbound = hm(&[
            ("authorization", "Bearer someone-elses"),
            ("impersonate-user", "system:admin"),
            ("impersonate-group", "system:masters"),
            ("impersonate-extra-scopes", "all"),
            ("impersonate-uid", "0"),
            ("x-remote-user", "root"),
            ("x-remote-group", "system:masters"),
        ]);
        let out = upstream_headers(&inbound, &cert_caller(), None, None);
        assert!(!out.contains_key("authorization"));
        assert_eq!(out["impersonate-user"], "jane");
        assert_eq!(out.get_all("impersonate-group").iter().count(), 2);
        assert!(!out.contains_key("impersonate-extra-scopes"));
        assert!(!out.contains_key("impersonate-uid"));
        assert!(!out.contains_key("x-remote-user"));
        assert!(!out.contains_key("x-remote-group"));
    }

    /// kube-apiserver refuses an anonymous impersonation itself (`configmaps is forbidden:
    /// User "system:anonymous" cannot impersonate-on:user-info:list ...`; 400 for groups
    /// without a user): the headers go up with no credentials, so its answer is the proxy's.
    #[test]
    fn anonymous_callers_go_upstream_without_credentials_asking_their_impersonation() {
        let inbound = hm(&[
            ("impersonate-user", "system:admin"),
            ("impersonate-group", "system:masters"),
            ("x-remote-user", "root"),
        ]);
        let caller = Caller::identify(None, &inbound);
        assert_eq!(caller, Caller::Anonymous);
        assert_eq!(caller.upstream_as(), As::Caller);
        let out = upstream_headers(&inbound, &caller, None, None);
        assert!(!out.contains_key("authorization"), "{out:?}");
        assert!(!out.contains_key("x-remote-user"), "{out:?}");
        assert_eq!(out["impersonate-user"], "system:admin");
        assert_eq!(out["impersonate-group"], "system:masters");
        assert_eq!(out.len(), 2, "{out:?}");
    }

    #[test]
    fn bearer_callers_keep_their_impersonation_headers_for_the_apiserver_to_authorize() {
        let inbound = hm(&[
            ("authorization", "Bearer t0k"),
            ("impersonate-user", "bob"),
            ("impersonate-group", "viewers"),
        ]);
        let caller = Caller::identify(None, &inbound);
        assert_eq!(caller.upstream_as(), As::Caller);
        let out = upstream_headers(&inbound, &caller, None, None);
        assert_eq!(out["authorization"], "Bearer t0k");
        assert_eq!(out["impersonate-user"], "bob");
        assert_eq!(out["impersonate-group"], "viewers");
    }

    #[test]
    fn a_certificate_wins_over_a_token() {
        let inbound = hm(&[("authorization", "Bearer t0k")]);
        let id = CertIdentity {
            user: "jane".into(),
            ..Default::default()
        };
        let caller = Caller::identify(Some(&id), &inbound);
        assert_eq!(caller.upstream_as(), As::Proxy);
        assert!(matches!(caller, Caller::Certificate(_)));
    }

    #[test]
    fn an_authorized_impersonation_target_goes_up_with_its_uid_and_escaped_extra() {
        let target = Caller::Certificate(CertIdentity {
            user: "carol".into(),
            groups: vec!["viewers".into()],
            uid: "u-42".into(),
            extra: [
                ("scopes".to_string(), vec!["a".to_string(), "b".to_string()]),
                (
                    "example.org/team name%".to_string(),
                    vec!["x y".to_string()],
                ),
            ]
            .into_iter()
            .collect(),
        });
        let inbound = hm(&[("impersonate-extra-smuggled", "1")]);
        let out = upstream_headers(&inbound, &target, None, None);
        assert_eq!(out["impersonate-user"], "carol");
        assert_eq!(out["impersonate-uid"], "u-42");
        let scopes: Vec<_> = out.get_all("impersonate-extra-scopes").iter().collect();
        assert_eq!(scopes, ["a", "b"]);
        assert_eq!(
            out["impersonate-extra-example.org%2Fteam%20name%25"], "x y",
            "{out:?}"
        );
        assert!(!out.contains_key("impersonate-extra-smuggled"));
        // What the apiserver decodes (lower-cased name, then url.PathUnescape) is the key.
        let decoded = percent_encoding::percent_decode_str("example.org%2fteam%20name%25")
            .decode_utf8()
            .unwrap();
        assert_eq!(decoded, "example.org/team name%");
    }

    #[test]
    fn upgrades_reassert_connection_and_upgrade() {
        let inbound = hm(&[
            ("connection", "Upgrade"),
            ("upgrade", "SPDY/3.1"),
            ("host", "proxy"),
        ]);
        let proto = upgrade_protocol(&inbound).cloned();
        assert_eq!(proto.as_ref().unwrap(), "SPDY/3.1");
        let out = upstream_headers(&inbound, &Caller::Anonymous, proto.as_ref(), None);
        assert_eq!(out["connection"], "Upgrade");
        assert_eq!(out["upgrade"], "SPDY/3.1");
        assert!(!out.contains_key("host"));
    }

    #[test]
    fn forwarded_for_is_appended() {
        let inbound = hm(&[("x-forwarded-for", "10.0.0.1")]);
        let out = upstream_headers(
            &inbound,
            &Caller::Anonymous,
            None,
            Some("127.0.0.9".parse().unwrap()),
        );
        assert_eq!(out["x-forwarded-for"], "10.0.0.1, 127.0.0.9");
    }

    #[test]
    fn certificate_subject_gives_user_and_groups() {
        let mut params = rcgen::CertificateParams::new(vec![]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "jane");
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "dev");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        let id = CertIdentity::from_der(cert.der()).unwrap();
        assert_eq!(id.user, "jane");
        assert_eq!(id.groups, vec!["dev".to_string()]);
    }
}
