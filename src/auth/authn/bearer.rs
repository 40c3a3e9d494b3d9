//! The bearer token of a request's `Authorization` header.

use http::{HeaderMap, header};

/// What a request's `Authorization` header carries for the chain.
pub(super) enum Bearer<'a> {
    /// No bearer token: another scheme, or no header (anonymous, when enabled).
    None,
    /// A header that is not text: refused.
    Invalid,
    Token(&'a str),
}

/// The bearer token of `Authorization`, parsed as kube-apiserver's bearer-token
/// authenticator (`bearertoken.Authenticator.AuthenticateRequest`) does: the header trimmed,
/// split in at most three on single spaces; another scheme, `Bearer` alone and an empty token
/// (`Bearer  tok`) are "no token" (anonymous, when enabled); `Bearer tok extra` is `tok`.
pub(super) fn bearer(headers: &HeaderMap) -> Bearer<'_> {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return Bearer::None;
    };
    let Ok(v) = v.to_str() else {
        return Bearer::Invalid;
    };
    let v = v.trim();
    let mut parts = v.splitn(3, ' ');
    let scheme = parts.next().unwrap_or("");
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Bearer::None;
    }
    match parts.next() {
        Some(t) if !t.is_empty() => Bearer::Token(t),
        _ => Bearer::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn bearer_parsing_follows_the_apiserver() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            m
        };
        assert!(matches!(bearer(&h("Bearer abc")), Bearer::Token("abc")));
        assert!(matches!(bearer(&h("bearer abc")), Bearer::Token("abc")));
        assert!(matches!(bearer(&h("Bearer ")), Bearer::None));
        assert!(matches!(bearer(&h("Bearer")), Bearer::None));
        assert!(matches!(bearer(&h("Bearer  abc")), Bearer::None));
        assert!(matches!(bearer(&h("  Bearer abc  ")), Bearer::Token("abc")));
        assert!(matches!(bearer(&h("Bearer a b")), Bearer::Token("a")));
        assert!(matches!(bearer(&h("Basic abc")), Bearer::None));
        assert!(matches!(bearer(&HeaderMap::new()), Bearer::None));
    }
}
