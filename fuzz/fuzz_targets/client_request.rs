//! What a client controls in a request, through every parser the proxy runs on it before
//! anything reaches the cache or the apiserver: the path and query (`RequestInfo`, list and
//! watch parameters, label and field selectors, `allowWatchBookmarks`-style flags), and the
//! `Accept` header (the read's representation, the metrics format). None may panic; a
//! selector that parses prints to a string that parses to the same selector.

#![no_main]

use arbitrary::Arbitrary;
use http::Method;
use kube_cache_proxy::k8s::request_info::RequestInfo;
use kube_cache_proxy::k8s::selector::{FieldSelector, LabelSelector};
use kube_cache_proxy::k8s::watch_fields::WatchFields;
use kube_cache_proxy::read::plan::{ListParams, WatchParams};
use kube_cache_proxy::read::router::{ReadKind, negotiate};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Request<'a> {
    method: u8,
    path: &'a str,
    query: Option<&'a str>,
    accept: Option<&'a str>,
    selector: &'a str,
    custom: bool,
    pretty: bool,
}

const METHODS: [&str; 9] = [
    "GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "CONNECT", "WATCH",
];

fuzz_target!(|r: Request<'_>| {
    let method = Method::from_bytes(METHODS[usize::from(r.method) % METHODS.len()].as_bytes())
        .unwrap_or(Method::GET);
    let _ = RequestInfo::parse(&method, r.path, r.query);
    let _ = ListParams::parse(r.query);
    let _ = WatchParams::parse(r.query);
    for kind in [ReadKind::Get, ReadKind::List, ReadKind::Watch] {
        let _ = negotiate(r.accept, kind, r.custom, r.pretty);
    }
    let _ = kube_cache_proxy::metrics::text::Format::negotiate(r.accept);
    let _ = WatchFields::parse(r.selector);

    round_trip("label", r.selector, LabelSelector::parse);
    round_trip("field", r.selector, FieldSelector::parse);
});

/// A selector that parses prints to a string that parses back to the same selector.
fn round_trip<S, E>(what: &str, text: &str, parse: fn(&str) -> Result<S, E>)
where
    S: std::fmt::Display + PartialEq + std::fmt::Debug,
    E: std::fmt::Display,
{
    if let Ok(sel) = parse(text) {
        let printed = sel.to_string();
        let again = parse(&printed)
            .unwrap_or_else(|e| panic!("{what} selector {text:?} printed as {printed:?}: {e}"));
        assert_eq!(
            again, sel,
            "{what} selector {text:?} printed as {printed:?}"
        );
    }
}
