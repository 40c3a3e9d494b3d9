//! The planning of a cache read, from the request's parameters alone: which parameters the
//! cache implements exactly (anything else is the apiserver's), which state a read asks for
//! (the resourceVersion forms of
//! <https://kubernetes.io/docs/reference/using-api/api-concepts/#resource-versions>, tabled in
//! `docs/architecture.md`), how many items a page holds, and
//! where a watch starts. Pure functions, table-tested; `list`, `watch` and the pipeline
//! execute the plans against a cache.
//!
//! Keep in step with the apiserver: `ValidateListOptions` (k8s.io/apiserver) for the
//! combinations it refuses (left to it, so its error is exact), and the cacher's
//! `shouldDelegateList`/`GetList` for which state each form reads.

use std::time::Duration;

use crate::cache::Start;
use crate::k8s::status::Status;

/// `resourceVersion` of a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rv {
    Unset,
    Zero,
    At(u64),
}

/// `resourceVersionMatch` of a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RvMatch {
    Unset,
    NotOlderThan,
    Exact,
}

/// The list parameters the cache understands; anything else passes through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListParams {
    pub rv: Rv,
    pub rv_match: RvMatch,
    /// 0: no limit.
    pub limit: u64,
    pub continue_: Option<String>,
    pub label_selector: String,
    pub field_selector: String,
}

/// A resourceVersion as the apiserver parses it (Go's `strconv.ParseUint(s, 10, 64)`): ASCII
/// digits only. Rust's `u64::from_str` also takes a leading `+`, which the apiserver refuses
/// with 400.
fn go_uint(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

impl ListParams {
    /// Parses a list query, or says why the apiserver must answer it (unknown parameters,
    /// and every invalid combination: the apiserver writes those errors exactly).
    pub fn parse(query: Option<&str>) -> Result<ListParams, &'static str> {
        let mut p = ListParams {
            rv: Rv::Unset,
            rv_match: RvMatch::Unset,
            limit: 0,
            continue_: None,
            label_selector: String::new(),
            field_selector: String::new(),
        };
        let mut seen = std::collections::HashSet::new();
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let plus = v.replace('+', " ");
            let v = percent_encoding::percent_decode_str(&plus)
                .decode_utf8()
                .map_err(|_| "query encoding")?;
            // A repeated parameter: the apiserver's query decoding takes the first value.
            if !seen.insert(k) {
                continue;
            }
            match k {
                "resourceVersion" => {
                    p.rv = match &*v {
                        "" => Rv::Unset,
                        "0" => Rv::Zero,
                        n => Rv::At(go_uint(n).filter(|n| *n > 0).ok_or("resourceVersion")?),
                    }
                }
                "resourceVersionMatch" => {
                    p.rv_match = match &*v {
                        "" => RvMatch::Unset,
                        "NotOlderThan" => RvMatch::NotOlderThan,
                        "Exact" => RvMatch::Exact,
                        _ => return Err("resourceVersionMatch"),
                    }
                }
                "limit" => {
                    let l = v.parse::<i64>().map_err(|_| "limit")?;
                    p.limit = l.max(0) as u64;
                }
                "continue" if !v.is_empty() => p.continue_ = Some(v.into_owned()),
                "continue" => {}
                "watch" if v == "false" || v == "0" => {}
                "labelSelector" => p.label_selector = v.into_owned(),
                "fieldSelector" => p.field_selector = v.into_owned(),
                "timeout" | "timeoutSeconds" => {}
                _ => return Err("list parameters"),
            }
        }
        // Combinations the apiserver refuses (ValidateListOptions): it writes the error.
        match (p.rv, p.rv_match) {
            (Rv::Unset, RvMatch::NotOlderThan | RvMatch::Exact) => return Err("match without rv"),
            (Rv::Zero, RvMatch::Exact) => return Err("exact rv 0"),
            _ => {}
        }
        if let Some(c) = &p.continue_ {
            if !c.starts_with("k1.") {
                return Err("continue token not issued by the proxy");
            }
            if p.rv_match != RvMatch::Unset {
                return Err("continue with resourceVersionMatch");
            }
        }
        Ok(p)
    }
}

/// The query of a watch the cache can serve. Anything else (unknown parameters, invalid
/// combinations) is left to the apiserver, which also writes the exact error.
#[derive(Debug, Clone, PartialEq)]
pub struct WatchParams {
    pub resource_version: Option<String>,
    pub send_initial_events: Option<bool>,
    pub allow_bookmarks: bool,
    pub timeout: Option<Duration>,
    pub label_selector: String,
    pub field_selector: String,
}

fn parse_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "true" | "True" | "TRUE" | "t" | "T" => Some(true),
        "0" | "false" | "False" | "FALSE" | "f" | "F" => Some(false),
        _ => None,
    }
}

impl WatchParams {
    /// A watch resuming from a resourceVersion it has seen (not "", not "0", no initial
    /// events): what a client's informer sends after every disconnect.
    pub fn resumes(&self) -> bool {
        self.resource_version
            .as_deref()
            .is_some_and(|rv| !rv.is_empty() && rv != "0")
            && self.send_initial_events != Some(true)
    }

    /// `None` when the query holds something the cache does not implement exactly.
    pub fn parse(query: Option<&str>) -> Option<WatchParams> {
        let mut p = WatchParams {
            resource_version: None,
            send_initial_events: None,
            allow_bookmarks: false,
            timeout: None,
            label_selector: String::new(),
            field_selector: String::new(),
        };
        let mut rv_match: Option<String> = None;
        let mut watch = false;
        let mut seen = std::collections::HashSet::new();
        for pair in query.unwrap_or("").split('&').filter(|s| !s.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            // A repeated parameter: the apiserver's query decoding takes the first value.
            if !seen.insert(k) {
                continue;
            }
            let v = percent_encoding::percent_decode_str(&v.replace('+', " "))
                .decode_utf8()
                .ok()?
                .into_owned();
            match k {
                "watch" => watch = parse_bool(&v)?,
                "resourceVersion" => p.resource_version = Some(v),
                "resourceVersionMatch" => rv_match = Some(v),
                "sendInitialEvents" => p.send_initial_events = Some(parse_bool(&v)?),
                "allowWatchBookmarks" => p.allow_bookmarks = parse_bool(&v)?,
                "timeoutSeconds" => p.timeout = Some(Duration::from_secs(v.parse().ok()?)),
                "labelSelector" => p.label_selector = v,
                "fieldSelector" => p.field_selector = v,
                // The request timeout of a long-running request is ignored by the apiserver.
                "timeout" => {}
                _ => return None,
            }
        }
        let _ = watch;
        match (&p.send_initial_events, rv_match.as_deref()) {
            (Some(_), Some("NotOlderThan")) => {}
            (None, None) => {}
            // Everything else is a validation error the apiserver words itself.
            _ => return None,
        }
        match p.resource_version.as_deref() {
            None | Some("") | Some("0") => {}
            Some(n) if go_uint(n).is_some() => {}
            _ => return None,
        }
        Some(p)
    }
}

/// Where a watch starts, and the resourceVersion the cache must reach first (a watch for a
/// resourceVersion newer than the cache waits for it, then passes through if it never comes).
pub fn watch_start(p: &WatchParams, cache_rv: u64) -> (Start, Option<u64>) {
    let rv = p.resource_version.as_deref().unwrap_or("");
    let n = go_uint(rv).filter(|n| *n > 0);
    match p.send_initial_events {
        // The initial state at least as new as N (waited for by the caller).
        Some(true) => (Start::Initial, n),
        Some(false) => match n {
            Some(n) => (Start::After(n), Some(n)),
            None => (Start::After(cache_rv), None),
        },
        // Changes after N, once the cache has reached N (as the apiserver's cacher waits for
        // a fresh resourceVersion): a watcher never registers ahead of the cache's state,
        // so a relist between its start and N cannot hide what it told as a difference
        // (`cache::relist`).
        None => match n {
            Some(n) => (Start::After(n), Some(n)),
            None => (Start::Initial, None),
        },
    }
}

/// Which state of a resource a read asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadAt {
    /// resourceVersion unset: the most recent state, once the consistency policy confirms
    /// the cache (`read::consistency`).
    Latest,
    /// "0": any state; the cache's current one.
    Any,
    /// N, `NotOlderThan` (or no match without a limit): the current state once the cache
    /// has reached N.
    NotOlderThan(u64),
    /// N, `Exact` (or no match with a limit, the legacy paging form): exactly the state at
    /// N, from a retained snapshot.
    Exact(u64),
}

impl ReadAt {
    /// Whether a first page may read through an index (the pods' `spec.nodeName`): the
    /// apiserver's cacher does for the current state, not for an exact snapshot.
    pub fn uses_index(self) -> bool {
        !matches!(self, ReadAt::Exact(_))
    }
}

/// Where a list's page comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListFrom<'a> {
    /// The position in a continue token (verified when it is executed).
    Continue(&'a str),
    /// The beginning of the state `ReadAt` names.
    Start(ReadAt),
}

/// What a list reads and how much of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListPlan<'a> {
    pub from: ListFrom<'a>,
    /// Items per page; 0: everything in one response.
    pub limit: u64,
}

/// Plans a list the cache may serve (`ListParams::parse` accepted it).
///
/// # Errors
/// A continue token with a resourceVersion: the apiserver's 400, written by the proxy because
/// the token is the proxy's own.
pub fn list(p: &ListParams) -> Result<ListPlan<'_>, Box<Status>> {
    // The cacher serves resourceVersion=0 whole, ignoring `limit`.
    let limit = if p.rv == Rv::Zero { 0 } else { p.limit };
    let from = if let Some(token) = &p.continue_ {
        if let Rv::At(_) = p.rv {
            return Err(Box::new(Status::bad_request(
                "specifying resource version is not allowed when using continue",
            )));
        }
        ListFrom::Continue(token)
    } else {
        let exact = p.rv_match == RvMatch::Exact
            || (p.rv_match == RvMatch::Unset && limit > 0 && matches!(p.rv, Rv::At(_)));
        ListFrom::Start(match p.rv {
            Rv::At(n) if exact => ReadAt::Exact(n),
            Rv::At(n) => ReadAt::NotOlderThan(n),
            Rv::Zero => ReadAt::Any,
            Rv::Unset => ReadAt::Latest,
        })
    };
    Ok(ListPlan { from, limit })
}

/// Plans a GET of one object: `resourceVersion` unset (the most recent state) or "0" (any);
/// `None` for anything else, which the apiserver answers.
pub fn get(query: Option<&str>) -> Option<ReadAt> {
    let params: Vec<&str> = query
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
        .collect();
    match params.as_slice() {
        [] | ["resourceVersion="] => Some(ReadAt::Latest),
        ["resourceVersion=0"] => Some(ReadAt::Any),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(q: &str) -> ListParams {
        ListParams::parse(Some(q)).unwrap()
    }

    #[test]
    fn every_resource_version_form_of_a_list_reads_the_state_the_apiserver_reads() {
        use ReadAt::*;
        for (query, at, limit) in [
            ("", Latest, 0),
            ("limit=500", Latest, 500),
            ("resourceVersion=0", Any, 0),
            // The cacher ignores `limit` for resourceVersion=0.
            ("resourceVersion=0&limit=500", Any, 0),
            (
                "resourceVersion=0&resourceVersionMatch=NotOlderThan&limit=5",
                Any,
                0,
            ),
            ("resourceVersion=7", NotOlderThan(7), 0),
            (
                "resourceVersion=7&resourceVersionMatch=NotOlderThan",
                NotOlderThan(7),
                0,
            ),
            (
                "resourceVersion=7&resourceVersionMatch=NotOlderThan&limit=5",
                NotOlderThan(7),
                5,
            ),
            // Legacy paging: an RV with a limit and no match reads exactly that state.
            ("resourceVersion=7&limit=5", Exact(7), 5),
            ("resourceVersion=7&resourceVersionMatch=Exact", Exact(7), 0),
            (
                "resourceVersion=7&resourceVersionMatch=Exact&limit=5",
                Exact(7),
                5,
            ),
        ] {
            let p = params(query);
            let plan = list(&p).unwrap();
            assert_eq!(plan.from, ListFrom::Start(at), "{query}");
            assert_eq!(plan.limit, limit, "{query}");
        }
    }

    #[test]
    fn a_continue_token_positions_the_page_and_refuses_a_resource_version() {
        let p = params("limit=5&continue=k1.abc");
        assert_eq!(list(&p).unwrap().from, ListFrom::Continue("k1.abc"));
        let p = params("limit=5&continue=k1.abc&resourceVersion=9");
        let err = list(&p).unwrap_err();
        assert_eq!(err.code(), 400);
        assert!(err.message().contains("not allowed when using continue"));
    }

    #[test]
    fn only_the_exact_snapshot_read_avoids_the_index() {
        assert!(ReadAt::Latest.uses_index());
        assert!(ReadAt::Any.uses_index());
        assert!(ReadAt::NotOlderThan(3).uses_index());
        assert!(!ReadAt::Exact(3).uses_index());
    }

    #[test]
    fn a_get_is_planned_only_for_the_latest_or_any_state() {
        assert_eq!(get(None), Some(ReadAt::Latest));
        assert_eq!(get(Some("")), Some(ReadAt::Latest));
        assert_eq!(get(Some("resourceVersion=")), Some(ReadAt::Latest));
        assert_eq!(get(Some("resourceVersion=0")), Some(ReadAt::Any));
        assert_eq!(get(Some("resourceVersion=5")), None);
        assert_eq!(get(Some("resourceVersion=0&pretty=true")), None);
    }

    #[test]
    fn a_watch_starts_where_the_apiserver_starts_it() {
        let w = |q: &str| WatchParams::parse(Some(q)).unwrap();
        for (query, cache_rv, start, wait) in [
            // No RV: the initial state then changes.
            ("watch=1", 40, Start::Initial, None),
            ("watch=1&resourceVersion=0", 40, Start::Initial, None),
            // N: changes after N, once the cache has reached N.
            ("watch=1&resourceVersion=12", 40, Start::After(12), Some(12)),
            // WatchList: the initial state at least as new as N.
            (
                "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan",
                40,
                Start::Initial,
                None,
            ),
            (
                "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&resourceVersion=50",
                40,
                Start::Initial,
                Some(50),
            ),
            // sendInitialEvents=false: changes only, from N or from now.
            (
                "watch=1&sendInitialEvents=false&resourceVersionMatch=NotOlderThan&resourceVersion=50",
                40,
                Start::After(50),
                Some(50),
            ),
            (
                "watch=1&sendInitialEvents=false&resourceVersionMatch=NotOlderThan",
                40,
                Start::After(40),
                None,
            ),
        ] {
            assert_eq!(watch_start(&w(query), cache_rv), (start, wait), "{query}");
        }
    }

    #[test]
    fn watch_params_read_resource_versions_and_repeats_as_the_apiserver() {
        let w = |q: &str| WatchParams::parse(Some(q));
        assert!(w("watch=1&resourceVersion=+5").is_none());
        assert!(w("watch=1&resourceVersion=0x5").is_none());
        let p = w("watch=1&resourceVersion=5&resourceVersion=9&labelSelector=a&labelSelector=b")
            .unwrap();
        assert_eq!(p.resource_version.as_deref(), Some("5"));
        assert_eq!(p.label_selector, "a");
    }

    #[test]
    fn list_params_leave_invalid_combinations_to_the_apiserver() {
        let ok = |q: &str| ListParams::parse(Some(q));
        assert_eq!(ok("limit=5&resourceVersion=0").unwrap().rv, Rv::Zero);
        assert_eq!(
            ok("resourceVersion=12&resourceVersionMatch=Exact")
                .unwrap()
                .rv_match,
            RvMatch::Exact
        );
        assert!(ok("resourceVersionMatch=Exact").is_err());
        assert!(ok("resourceVersion=0&resourceVersionMatch=Exact").is_err());
        assert!(ok("resourceVersionMatch=NotOlderThan").is_err());
        assert!(ok("resourceVersionMatch=Bogus&resourceVersion=3").is_err());
        assert!(ok("resourceVersion=abc").is_err());
        assert!(ok("limit=abc").is_err());
        assert!(
            ok("resourceVersion=+5").is_err(),
            "Go's ParseUint takes no sign"
        );
        assert!(ok("resourceVersion=-5").is_err());
        assert!(ok("resourceVersion= 5").is_err());
        // A repeated parameter: the first value, as the apiserver's query decoding.
        assert_eq!(ok("limit=1&limit=2").unwrap().limit, 1);
        assert_eq!(
            ok("resourceVersion=5&resourceVersion=0").unwrap().rv,
            Rv::At(5)
        );
        assert!(ok("continue=eyJ2IjoibWV0YS5rOHMuaW8vdjEifQ").is_err());
        assert!(ok("continue=k1.dev.AAAA&resourceVersionMatch=Exact").is_err());
        assert_eq!(ok("limit=-3").unwrap().limit, 0);
        assert!(ok("pretty=true").is_err());
    }
}
