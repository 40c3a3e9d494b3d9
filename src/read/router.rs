//! The cache-or-passthrough decision: one pure function, table-tested.
//!
//! Keep in step with what the cache implements exactly: a request is served from memory only
//! when every parameter it carries is understood; anything else goes to the apiserver, which
//! also writes the exact errors for invalid requests. Mirrors the spirit of
//! k8s.io/apiserver `shouldDelegateList`.

use std::sync::Arc;

use http::{HeaderMap, Method, header};

use crate::cache::event::Encoding;
use crate::cache::hub::Filter;
use crate::cache::table::{IncludeObject, TableForm};
use crate::cache::{ResourceCache, Side};
use crate::k8s::fields::{FieldCheck, check_field_selector};
use crate::k8s::request_info::RequestInfo;
use crate::k8s::selector::{FieldSelector, LabelSelector};
use crate::read::plan::{self, ListParams, ReadAt, WatchParams};
use crate::read::{Served, delegate};

#[derive(Debug)]
pub enum Route {
    Watch {
        cache: Arc<ResourceCache>,
        params: WatchParams,
        filter: Filter,
        enc: Encoding,
        /// The apiserver's protobuf instead of `enc` (`enc` then says whole objects or
        /// metadata).
        protobuf: bool,
        /// Each event as a Table of one row (`read::table::watch_body`), rows' objects as
        /// asked; `enc` is then JSON.
        table: Option<TableForm>,
    },
    Get {
        cache: Arc<ResourceCache>,
        enc: Encoding,
        /// The apiserver's protobuf instead of `enc`.
        protobuf: bool,
        /// A Table of meta.k8s.io/v1 instead of `enc` (`read::table`), rows' objects as asked.
        table: Option<TableForm>,
        /// `Latest` (subject to the consistency policy) or `Any`.
        at: ReadAt,
    },
    List {
        cache: Arc<ResourceCache>,
        filter: Filter,
        enc: Encoding,
        /// The apiserver's protobuf instead of `enc`.
        protobuf: bool,
        /// A Table of meta.k8s.io/v1 instead of `enc` (`read::table`), rows' objects as asked.
        table: Option<TableForm>,
        params: ListParams,
    },
}

impl Route {
    /// The cache the request reads.
    pub fn cache(&self) -> &Arc<ResourceCache> {
        match self {
            Route::Watch { cache, .. } | Route::Get { cache, .. } | Route::List { cache, .. } => {
                cache
            }
        }
    }
}

/// A read, as content negotiation sees it: what the apiserver transforms an object or a list
/// into depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadKind {
    Get,
    List,
    Watch,
}

/// The media types a resource endpoint of kube-apiserver serves, in its order (the codec
/// factory's: JSON, YAML, protobuf, then CBOR where its feature gate is on). `*/*` and
/// `application/*` take the first one a clause's parameters allow.
const SERVED: [(&str, &str); 4] = [
    ("application", "json"),
    ("application", "yaml"),
    ("application", "vnd.kubernetes.protobuf"),
    ("application", "cbor"),
];

/// One clause of an Accept header, as goautoneg parses it.
#[derive(Debug)]
struct Clause<'a> {
    ty: &'a str,
    sub: &'a str,
    q: f32,
    /// In header order; a repeated key's last value counts (Go map semantics).
    params: Vec<(&'a str, &'a str)>,
}

impl<'a> Clause<'a> {
    fn param(&self, key: &str) -> Option<&'a str> {
        self.params
            .iter()
            .rev()
            .find(|(k, _)| *k == key)
            .map(|p| p.1)
    }

    /// goautoneg's ordering: higher q first, then concrete types before `*`, then concrete
    /// subtypes before `*` (not a strict order: `parse_accept` sorts with it as Go does).
    fn less(&self, other: &Clause<'_>) -> bool {
        self.q > other.q
            || (self.ty != "*" && other.ty == "*")
            || (self.sub != "*" && other.sub == "*")
    }
}

/// Parses an Accept header exactly as github.com/munnerz/goautoneg `ParseAccept` (what
/// kube-apiserver negotiates with), then orders it as Go's `sort.Sort` does for up to 12
/// clauses (an insertion sort). `None` when the order cannot be reproduced here: more than
/// 12 clauses (Go then sorts unstably) or a q-value Rust and Go may parse differently.
fn parse_accept(header: &str) -> Option<Vec<Clause<'_>>> {
    fn trim(s: &str) -> &str {
        s.trim_matches(' ')
    }
    fn split(s: &str, sep: char) -> (&str, &str) {
        s.split_once(sep).unwrap_or((s, ""))
    }
    let mut clauses = Vec::new();
    let mut remaining = header;
    while !remaining.is_empty() {
        let (part, rest) = split(remaining, ',');
        remaining = rest;
        let (media, mut params) = split(trim(part), ';');
        let (ty, sub) = split(media, '/');
        let ty = trim(ty);
        let sub = if sub.is_empty() {
            if ty != "*" {
                continue;
            }
            "*"
        } else {
            let (sub, extra) = split(sub, '/');
            if !extra.is_empty() {
                continue;
            }
            trim(sub)
        };
        let mut clause = Clause {
            ty,
            sub,
            q: 1.0,
            params: Vec::new(),
        };
        while !params.is_empty() {
            let (p, rest) = split(params, ';');
            params = rest;
            let (key, value) = split(p, '=');
            if value.is_empty() {
                continue;
            }
            let (value, extra) = split(value, '=');
            if !extra.is_empty() {
                continue;
            }
            if trim(key) == "q" {
                clause.q = value.parse().ok()?;
            } else {
                clause.params.push((trim(key), trim(value)));
            }
        }
        clauses.push(clause);
    }
    if clauses.len() > 12 {
        return None;
    }
    for i in 1..clauses.len() {
        let mut j = i;
        while j > 0 && clauses[j].less(&clauses[j - 1]) {
            clauses.swap(j, j - 1);
            j -= 1;
        }
    }
    Some(clauses)
}

/// [`negotiate`]'s answer when the apiserver would write its protobuf for a read of a
/// built-in resource: the cache serves it from the objects' protobuf envelopes
/// (`Route::*` with `protobuf`) once the resource's protobuf side has synced; while that side
/// starts, [`while_unready`] decides.
pub const PROTOBUF: &str = "encoding: protobuf";

/// [`negotiate`]'s answer when the apiserver would write a Table of meta.k8s.io/v1 in JSON
/// (`kubectl get`): the cache writes it from the table side's rows (`Route::{Get, List}`
/// with `table`) once that side has synced; watches of Tables are the apiserver's.
pub const TABLE: &str = "encoding: Table";

/// As [`TABLE`], of meta.k8s.io/v1beta1 (older clients; kube-apiserver still serves it).
pub const TABLE_V1BETA1: &str = "encoding: Table v1beta1";

/// Why a read of a resource without a cache goes to the apiserver.
pub const NOT_CACHED: &str = "resource not cached";

/// Why a watch without resourceVersion goes to the apiserver while the cache's upstream
/// watch is down.
pub const UNCONFIRMED_LATEST_WATCH: &str = "cache unconfirmed for a most-recent watch";

/// [`negotiate`]'s answer for `PartialObjectMetadata` / `PartialObjectMetadataList` in
/// protobuf (the metadata client's first choice) of a built-in resource: served as
/// [`PROTOBUF`] is, from each envelope's `metadata` field.
pub const PROTOBUF_METADATA: &str = "encoding: protobuf metadata";

/// What the apiserver makes of a clause for one of its media types
/// (k8s.io/apiserver `acceptMediaTypeOptions` with a resource endpoint's restrictions).
enum Verdict {
    /// The endpoint cannot serve it: the apiserver tries the next one.
    Skip,
    /// The apiserver's answer; `Ok` when the cache writes the same.
    Wins(Result<Encoding, &'static str>),
}

fn verdict(c: &Clause<'_>, media: &str, read: ReadKind, custom: bool, pretty: bool) -> Verdict {
    let json = media == "json";
    if let Some(stream) = c.param("stream").filter(|s| !s.is_empty())
        && (stream != "watch" || media == "yaml")
    {
        return Verdict::Skip;
    }
    // `sv` must name the endpoint's meta group version; leave it to the apiserver.
    if c.param("sv").is_some_and(|v| !v.is_empty()) {
        return Verdict::Wins(Err("encoding: sv"));
    }
    let convert = ["as", "g", "v"]
        .iter()
        .any(|k| c.param(k).is_some())
        .then(|| {
            (
                c.param("as").unwrap_or(""),
                c.param("g").unwrap_or(""),
                c.param("v").unwrap_or(""),
            )
        });
    let Some((kind, group, version)) = convert else {
        // Custom resources are not served as protobuf (their endpoint's standard serializers).
        if custom && media == "vnd.kubernetes.protobuf" {
            return Verdict::Skip;
        }
        if media == "vnd.kubernetes.protobuf" {
            return Verdict::Wins(Err(PROTOBUF));
        }
        if !json {
            return Verdict::Wins(Err("encoding: not JSON"));
        }
        return Verdict::Wins(pretty_ok(Some(c), read, pretty).map(|()| Encoding::Json));
    };
    if group != "meta.k8s.io" || !matches!(version, "v1" | "v1beta1") {
        return Verdict::Skip;
    }
    match kind {
        "Table" if json => {
            let form = if version == "v1" {
                TABLE
            } else {
                TABLE_V1BETA1
            };
            Verdict::Wins(pretty_ok(Some(c), read, pretty).and(Err(form)))
        }
        "Table" if json || media == "yaml" => Verdict::Wins(Err("encoding: Table not JSON v1")),
        "PartialObjectMetadata" | "PartialObjectMetadataList" => {
            let protobuf = media == "vnd.kubernetes.protobuf";
            if !(json || protobuf) || version != "v1" {
                return Verdict::Wins(Err("encoding: metadata not as JSON meta.k8s.io/v1"));
            }
            // The apiserver refuses the list form for one object and the object form for a
            // list (406); a watch asking for the list form gets whatever its transform
            // falls back to: the apiserver's to write, all three.
            let fits = match read {
                ReadKind::Get | ReadKind::Watch => kind == "PartialObjectMetadata",
                ReadKind::List => kind == "PartialObjectMetadataList",
            };
            if !fits {
                return Verdict::Wins(Err("encoding: metadata form of another read"));
            }
            if protobuf {
                // From the objects' envelopes, which custom resources have none of.
                return Verdict::Wins(Err(if custom {
                    "encoding: protobuf metadata of a custom resource"
                } else {
                    PROTOBUF_METADATA
                }));
            }
            Verdict::Wins(pretty_ok(Some(c), read, pretty).map(|()| Encoding::Metadata))
        }
        _ => Verdict::Skip,
    }
}

/// `pretty=1`, or a `pretty_agent`, indents a GET's or LIST's JSON (not a watch's events);
/// the cache writes it compact.
fn pretty_ok(
    c: Option<&Clause<'_>>,
    read: ReadKind,
    pretty_agent: bool,
) -> Result<(), &'static str> {
    if read != ReadKind::Watch && (pretty_agent || c.and_then(|c| c.param("pretty")) == Some("1")) {
        return Err("encoding: pretty");
    }
    Ok(())
}

/// Browsers and command-line HTTP tools get indented JSON from the apiserver
/// (k8s.io/apiserver `isPrettyPrint`, by User-Agent; its `pretty` query parameter is
/// `read::plan`'s to refuse).
pub fn pretty_agent(user_agent: Option<&[u8]>) -> bool {
    user_agent.is_some_and(|ua| {
        [&b"curl"[..], b"Wget", b"Mozilla/5.0"]
            .iter()
            .any(|p| ua.starts_with(p))
    })
}

/// The representation a read gets, decided as kube-apiserver decides it
/// (k8s.io/apiserver `negotiation.NegotiateMediaTypeOptions` over goautoneg): the clauses in
/// goautoneg's order (q-value, then specificity), and the first clause one of the endpoint's
/// media types can serve wins. `Ok` when the cache writes exactly that (JSON, or JSON
/// PartialObjectMetadata / PartialObjectMetadataList of meta.k8s.io/v1); `Err(why)` when the
/// apiserver must answer: protobuf, YAML, Table, other versions, indented JSON, or nothing
/// acceptable (its 406). `custom`: the resource is a custom resource (no protobuf without a
/// transform); `pretty`: the client is a [`pretty_agent`].
pub fn negotiate(
    accept: Option<&str>,
    read: ReadKind,
    custom: bool,
    pretty: bool,
) -> Result<Encoding, &'static str> {
    let accept = accept.unwrap_or("").trim_matches([' ', '\t']);
    if accept.is_empty() {
        return pretty_ok(None, read, pretty).map(|()| Encoding::Json);
    }
    let clauses = parse_accept(accept).ok_or("encoding: Accept not reproducible")?;
    for c in &clauses {
        for (ty, sub) in SERVED {
            let matches =
                (c.ty == ty && (c.sub == sub || c.sub == "*")) || (c.ty == "*" && c.sub == "*");
            if !matches {
                continue;
            }
            if let Verdict::Wins(r) = verdict(c, sub, read, custom, pretty) {
                return r;
            }
        }
    }
    Err("encoding: not acceptable")
}

/// The filter for a request's scope and selectors; `None` when the apiserver must answer
/// (invalid selectors get its exact 400; fields the cache cannot evaluate exactly).
fn filter_for(
    cache: &ResourceCache,
    namespace: &str,
    labels: &str,
    fields: &str,
) -> Option<Filter> {
    let labels = LabelSelector::parse(labels).ok()?;
    let fields = FieldSelector::parse(fields).ok()?;
    let fields = match check_field_selector(&cache.resource, &fields) {
        FieldCheck::Cache(f) => f,
        FieldCheck::Reject(_) | FieldCheck::Passthrough => return None,
    };
    Some(Filter {
        namespace: (!namespace.is_empty()).then(|| namespace.to_string()),
        labels,
        fields,
        namespaces: None,
        changes: None,
    })
}

/// A read's representation: JSON (`enc`), or the apiserver's protobuf (`true`, `enc` then
/// saying whole objects or metadata) for a built-in resource whose protobuf side runs
/// (whether it has synced yet is [`while_unready`]'s to decide); the apiserver's otherwise.
fn with_protobuf(negotiated: Result<Encoding, &'static str>) -> Served<(Encoding, bool)> {
    match negotiated {
        Ok(enc) => Ok((enc, false)),
        Err(PROTOBUF) => Ok((Encoding::Json, true)),
        Err(PROTOBUF_METADATA) => Ok((Encoding::Metadata, true)),
        Err(why) => delegate(why),
    }
}

/// A Table read's `includeObject` (the apiserver's default, `Metadata`, when absent) and its
/// query without it, for the list and GET planners; `Err(why)` for the apiserver (a value it
/// refuses, repeated or encoded parameters).
pub fn table_query(query: Option<&str>) -> Result<(IncludeObject, String), &'static str> {
    let mut io = None;
    let mut rest = Vec::new();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == "includeObject" {
            if io.is_some() {
                return Err("table: repeated includeObject");
            }
            io = Some(IncludeObject::parse(v).ok_or("table: includeObject")?);
        } else {
            rest.push(pair);
        }
    }
    Ok((io.unwrap_or(IncludeObject::Metadata), rest.join("&")))
}

/// A read's Table form, when it asks for one the cache writes: its `includeObject` and its
/// query without it. A resource whose table side cannot serve (shed, off, or a column that
/// depends on the clock) sends its Tables to the apiserver.
fn table_of(
    negotiated: Result<Encoding, &'static str>,
    cache: &ResourceCache,
    query: Option<&str>,
) -> Served<Option<(TableForm, String)>> {
    let v1beta1 = match negotiated {
        Err(TABLE) => false,
        Err(TABLE_V1BETA1) => true,
        _ => return Ok(None),
    };
    let (io, rest) = match table_query(query) {
        Ok(q) => q,
        Err(why) => return delegate(why),
    };
    if !cache.table.ready() && !cache.table.coming(crate::cache::store::STARTING) {
        cache
            .table
            .stats
            .passed_through
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        return delegate(cache.table.not_ready_reason().unwrap_or(TABLE));
    }
    Ok(Some((TableForm { io, v1beta1 }, rest)))
}

/// What a read gets while a side of the cache it needs (the JSON cache, or the protobuf
/// side) is not ready: what kube-apiserver does while its watch cache initializes
/// (k8s.io/apiserver `storage/cacher`, feature ResilientWatchCacheInitialization, on and
/// locked since 1.34).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unready {
    /// The side is ready: served from the cache.
    Serve,
    /// The side is starting: the read waits for it, bounded (`lists.waitForResourceVersion`),
    /// and then is served, or refused with 429 "storage is (re)initializing" and
    /// `Retry-After` (`read::initialized`): client-go retries such a watch from the same
    /// resourceVersion without relisting, and the retry finds the cache ready. Passed
    /// through, a watch would stay on the apiserver for its whole life.
    Wait,
    /// The apiserver answers: a one-shot read the cacher itself delegates to etcd while it
    /// initializes (every GET, a LIST with a limit and no selector), which does not stay on
    /// the apiserver; or any read of a side that cannot become ready within
    /// [`crate::cache::store::STARTING`] of its start (never synced in that time, e.g. a
    /// resource the proxy may not list; stopped; protobuf shed or off), whose clients must
    /// not be refused for good.
    Delegate,
}

/// [`Unready`] for a read of `kind` whose sides stand at `side`. `list_delegable`: a LIST
/// with a limit and neither label nor field selector (the cacher's
/// `shouldDelegateListOnNotReadyCache`); other LISTs it refuses with 429 while not ready,
/// as it refuses watches (`Cacher.GetList`, `Cacher.Watch`: `ready.check`).
pub fn while_unready(kind: ReadKind, side: Side, list_delegable: bool) -> Unready {
    match (side, kind) {
        (Side::Ready, _) => Unready::Serve,
        (Side::Failing, _) | (Side::Starting, ReadKind::Get) => Unready::Delegate,
        (Side::Starting, ReadKind::List) if list_delegable => Unready::Delegate,
        (Side::Starting, ReadKind::List | ReadKind::Watch) => Unready::Wait,
    }
}

/// The passthrough reason of a read of sides that are not ready.
fn unready_reason(cache: &ResourceCache) -> &'static str {
    if cache.is_ready() {
        "protobuf side not synced"
    } else {
        "cache not synced"
    }
}

/// Decides where a request goes: a cache read, or the apiserver (with the reason).
/// `lookup(group, version, resource)` finds a cache.
pub fn route(
    method: &Method,
    info: &RequestInfo,
    query: Option<&str>,
    headers: &HeaderMap,
    lookup: impl Fn(&str, &str, &str) -> Option<Arc<ResourceCache>>,
) -> Served<Route> {
    if *method != Method::GET {
        return delegate("not a read");
    }
    if !info.is_resource_request || !info.subresource.is_empty() {
        return delegate("not a cacheable resource request");
    }
    let Some(cache) = lookup(&info.api_group, &info.api_version, &info.resource) else {
        return delegate(NOT_CACHED);
    };
    // Go reads a header's bytes as they are; bytes that are not UTF-8 match nothing either way.
    let accept = headers
        .get(header::ACCEPT)
        .map(|v| String::from_utf8_lossy(v.as_bytes()));
    let pretty = pretty_agent(headers.get(header::USER_AGENT).map(|v| v.as_bytes()));
    let negotiate = |read| negotiate(accept.as_deref(), read, cache.resource.custom, pretty);
    // A protobuf reader of a built-in resource starts its protobuf side if it has not
    // started with the resource (`cache.protobufSide: lazy`), whatever it reads and whether
    // or not the cache has synced: the protobuf reads after it are the cache's.
    if matches!(negotiate(ReadKind::List), Err(PROTOBUF | PROTOBUF_METADATA))
        || matches!(
            negotiate(ReadKind::Watch),
            Err(PROTOBUF | PROTOBUF_METADATA)
        )
    {
        cache.want_protobuf();
    }
    // A Table reader (kubectl get) starts the resource's table side: the Tables after it are
    // the cache's.
    if [ReadKind::List, ReadKind::Get]
        .into_iter()
        .any(|r| matches!(negotiate(r), Err(TABLE | TABLE_V1BETA1)))
    {
        cache.table.want();
    }
    // Not ready and not about to be: the apiserver answers whatever the read.
    if cache.side(false, false) == Side::Failing {
        return delegate("cache not synced");
    }
    // A cluster-scoped resource under a namespaced path (`/api/v1/namespaces/x/namespaces`,
    // `/api/v1/watch/namespaces/x/nodes`) is the apiserver's 404 to write: serving it would
    // hand the whole cluster-scoped list to anyone who may read that resource in namespace x.
    if !cache.resource.namespaced && info.under_namespace {
        return delegate("namespace on a cluster-scoped resource");
    }
    let ns = if info.resource == "namespaces" {
        ""
    } else {
        info.namespace.as_str()
    };
    match info.verb.as_str() {
        "watch" if info.name.is_empty() || info.name_from_selector => {
            let table = table_of(negotiate(ReadKind::Watch), &cache, query)?;
            let query = table.as_ref().map_or(query, |(_, q)| Some(q.as_str()));
            let Some(params) = WatchParams::parse(query) else {
                return delegate("watch parameters");
            };
            // A Table bookmark is the row of an empty object: the table side keeps the one
            // its own bookmarks showed (`TableStore::bookmark_row`); until one came, the
            // apiserver writes them.
            // With `includeObject=Object` a bookmark's row carries the empty object as the
            // apiserver writes it: its fields after the metadata must be known too.
            if let Some((form, _)) = &table
                && (params.allow_bookmarks || params.send_initial_events.is_some())
                && (!cache.table.bookmarks_servable()
                    || (form.io == IncludeObject::Object && cache.json_bookmark_rest().is_none()))
            {
                return delegate("table watch with bookmarks");
            }
            let (enc, protobuf) = match &table {
                Some(_) => (Encoding::Json, false),
                None => with_protobuf(negotiate(ReadKind::Watch))?,
            };
            let latest = params.resource_version.as_deref().unwrap_or("").is_empty();
            match while_unready(ReadKind::Watch, cache.side(protobuf, latest), false) {
                Unready::Delegate => return delegate(unready_reason(&cache)),
                // The wait is `read::initialized`'s, after authorization.
                Unready::Wait => {}
                // A watch without resourceVersion asks for the most recent state; while the
                // upstream watch is down (after it was confirmed once) the cache may be
                // behind, so the apiserver serves it.
                Unready::Serve => {
                    if latest && cache.unhealthy().is_some() {
                        return delegate(UNCONFIRMED_LATEST_WATCH);
                    }
                }
            }
            let Some(filter) =
                filter_for(&cache, ns, &params.label_selector, &params.field_selector)
            else {
                return delegate("selector");
            };
            Ok(Route::Watch {
                cache,
                params,
                filter,
                enc,
                protobuf,
                table: table.map(|(io, _)| io),
            })
        }
        "get" if !info.name.is_empty() => {
            let table = table_of(negotiate(ReadKind::Get), &cache, query)?;
            let (enc, protobuf) = match &table {
                Some(_) => (Encoding::Json, false),
                None => with_protobuf(negotiate(ReadKind::Get))?,
            };
            if while_unready(ReadKind::Get, cache.side(protobuf, false), false) != Unready::Serve {
                return delegate(unready_reason(&cache));
            }
            // resourceVersion=0 ("any") or unset (most recent, when the consistency policy
            // confirms the cache); anything else is the apiserver's.
            let query = table.as_ref().map_or(query, |(_, q)| Some(q.as_str()));
            let Some(at) = plan::get(query) else {
                return delegate("get parameters");
            };
            Ok(Route::Get {
                cache,
                enc,
                protobuf,
                table: table.map(|(io, _)| io),
                at,
            })
        }
        "list" => {
            let table = table_of(negotiate(ReadKind::List), &cache, query)?;
            let (enc, protobuf) = match &table {
                Some(_) => (Encoding::Json, false),
                None => with_protobuf(negotiate(ReadKind::List))?,
            };
            let query = table.as_ref().map_or(query, |(_, q)| Some(q.as_str()));
            let params = match ListParams::parse(query) {
                Ok(p) => p,
                Err(why) => return delegate(why),
            };
            let delegable = params.limit > 0
                && params.label_selector.is_empty()
                && params.field_selector.is_empty();
            if while_unready(ReadKind::List, cache.side(protobuf, false), delegable)
                == Unready::Delegate
            {
                return delegate(unready_reason(&cache));
            }
            let Some(filter) =
                filter_for(&cache, ns, &params.label_selector, &params.field_selector)
            else {
                return delegate("selector");
            };
            // A cluster-wide list narrowed to one namespace by field selector is read from
            // that namespace's keys by the apiserver, which then pages it inconsistently
            // (kube-apiserver 1.36 repeats the first page): leave paging such lists to it.
            if filter.namespace.is_none()
                && params.limit > 0
                && filter.fields.exact_value("metadata.namespace").is_some()
            {
                return delegate("namespace field selector with limit");
            }
            Ok(Route::List {
                cache,
                filter,
                enc,
                protobuf,
                table: table.map(|(io, _)| io),
                params,
            })
        }
        _ => delegate("verb"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBECTL_GET: &str = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";
    const CLIENT_GO_PROTOBUF: &str = "application/vnd.kubernetes.protobuf,application/json";
    const CLIENT_GO_PROTOBUF_ANY: &str = "application/vnd.kubernetes.protobuf, */*";
    const METADATA_LIST: &str = "application/vnd.kubernetes.protobuf;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json";
    const METADATA_OBJECT: &str = "application/vnd.kubernetes.protobuf;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json";
    const METADATA_LIST_JSON: &str =
        "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json";
    const METADATA_OBJECT_JSON: &str =
        "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json";

    use ReadKind::{Get, List, Watch};

    /// What the cache answers: `Some(encoding)`, or `None` for the apiserver.
    fn n(accept: &str, read: ReadKind) -> Option<Encoding> {
        negotiate(Some(accept), read, false, false).ok()
    }

    #[test]
    fn real_clients_accept_headers_are_negotiated_as_the_apiserver_does() {
        let json = Some(Encoding::Json);
        let meta = Some(Encoding::Metadata);
        // (Accept, GET, LIST, WATCH)
        let table: &[(&str, [Option<Encoding>; 3])] = &[
            // kubectl get, get -w, get -o wide: Table first, the apiserver's.
            (KUBECTL_GET, [None, None, None]),
            // client-go's default for built-in types: protobuf first.
            (CLIENT_GO_PROTOBUF, [None, None, None]),
            (CLIENT_GO_PROTOBUF_ANY, [None, None, None]),
            // The metadata client: protobuf first (its list form for LIST, object form for
            // GET and WATCH).
            (METADATA_LIST, [None, None, None]),
            (METADATA_OBJECT, [None, None, None]),
            // ... and its JSON clauses alone: metadata where the form fits the read; the
            // other form is the apiserver's (a GET of the list form is its 406).
            (METADATA_LIST_JSON, [None, meta, None]),
            (METADATA_OBJECT_JSON, [meta, None, meta]),
            // The dynamic client, kube-rs, curl.
            ("application/json", [json, json, json]),
            ("application/json, */*", [json, json, json]),
            ("*/*", [json, json, json]),
            ("application/*", [json, json, json]),
            ("*", [json, json, json]),
            ("application/json;charset=utf-8", [json, json, json]),
            ("application/json;stream=watch", [json, json, json]),
            // Only what the cache cannot write.
            ("application/yaml", [None, None, None]),
            ("application/vnd.kubernetes.protobuf", [None, None, None]),
            ("application/cbor", [None, None, None]),
            (
                "application/json;as=Table;v=v1;g=meta.k8s.io",
                [None, None, None],
            ),
            // Nothing acceptable: the apiserver's 406.
            ("text/html", [None, None, None]),
            ("application/xml, text/plain", [None, None, None]),
            (
                "application/json;as=Unknown;g=meta.k8s.io;v=v1",
                [None, None, None],
            ),
            // Clauses the apiserver skips; the next one counts.
            ("text/html, application/json", [json, json, json]),
            (
                "application/json;as=Unknown;g=meta.k8s.io;v=v1, application/json",
                [json, json, json],
            ),
            (
                "application/json;as=Table;g=example.com;v=v1, application/json",
                [json, json, json],
            ),
            (
                "application/json;as=Table, application/json",
                [json, json, json],
            ),
            (
                "application/json;v=v1, application/json",
                [json, json, json],
            ),
            (
                "application/vnd.kubernetes.protobuf;as=Table;g=meta.k8s.io;v=v1, application/json",
                [json, json, json],
            ),
            (
                "application/yaml;stream=watch, application/json",
                [json, json, json],
            ),
            (
                "application/json;stream=other, application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1",
                [meta, None, meta],
            ),
            // q-values and specificity order the clauses; q=0 still counts (last).
            (
                "application/vnd.kubernetes.protobuf;q=0.5, application/json",
                [json, json, json],
            ),
            (
                "application/json;q=0.5, application/vnd.kubernetes.protobuf",
                [None, None, None],
            ),
            (
                "application/json;q=0.9, application/yaml;q=0.8",
                [json, json, json],
            ),
            ("application/json;q=0", [json, json, json]),
            (
                "application/yaml;q=0, application/json;q=0.1",
                [json, json, json],
            ),
            ("*/*, application/yaml", [None, None, None]),
            ("application/*, application/yaml", [None, None, None]),
            (
                "*/*;q=0.8, application/vnd.kubernetes.protobuf;q=0.9",
                [None, None, None],
            ),
            ("application/json;q=0.5, */*", [json, json, json]),
            // Other versions and encodings of the metadata forms are the apiserver's.
            (
                "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1beta1",
                [None, None, None],
            ),
            (
                "application/yaml;as=PartialObjectMetadata;g=meta.k8s.io;v=v1",
                [None, None, None],
            ),
            (
                "*/*;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1",
                [None, meta, None],
            ),
            // pretty indents GET and LIST bodies, not watch events.
            ("application/json;pretty=1", [None, None, json]),
            ("application/json;pretty=0", [json, json, json]),
            // Case and spacing as goautoneg reads them.
            ("Application/JSON, application/yaml", [None, None, None]),
            ("  application/json ; charset=utf-8 ", [json, json, json]),
        ];
        for (accept, want) in table {
            for (read, want) in [Get, List, Watch].into_iter().zip(want) {
                assert_eq!(n(accept, read), *want, "{accept:?} for {read:?}");
            }
        }
    }

    /// While a side of the cache is not ready, each read gets what kube-apiserver's cacher
    /// gives it while its watch cache initializes: GETs and LISTs with a limit and no
    /// selector go to the apiserver (one-shot); other LISTs and every WATCH wait, bounded,
    /// then get 429 (they come back); a side that cannot become ready sends everything to
    /// the apiserver.
    #[test]
    fn reads_while_a_side_initializes_are_answered_as_the_apiservers_cacher_does() {
        use Unready::{Delegate, Serve, Wait};
        // (read, side, a LIST with a limit and no selector) -> decision
        let table = [
            (Get, Side::Ready, false, Serve),
            (List, Side::Ready, false, Serve),
            (List, Side::Ready, true, Serve),
            (Watch, Side::Ready, false, Serve),
            (Get, Side::Starting, false, Delegate),
            (List, Side::Starting, true, Delegate),
            (List, Side::Starting, false, Wait),
            (Watch, Side::Starting, false, Wait),
            (Get, Side::Failing, false, Delegate),
            (List, Side::Failing, true, Delegate),
            (List, Side::Failing, false, Delegate),
            (Watch, Side::Failing, false, Delegate),
        ];
        for (read, side, delegable, want) in table {
            assert_eq!(
                while_unready(read, side, delegable),
                want,
                "{read:?} {side:?} delegable={delegable}"
            );
        }
        // Two sides: the worse counts.
        assert_eq!(Side::Ready.max(Side::Starting), Side::Starting);
        assert_eq!(Side::Starting.max(Side::Failing), Side::Failing);
    }

    #[test]
    fn tables_of_v1_in_json_are_the_caches_and_other_tables_the_apiservers() {
        for read in [Get, List, Watch] {
            for custom in [false, true] {
                assert_eq!(
                    negotiate(Some(KUBECTL_GET), read, custom, false),
                    Err(TABLE)
                );
            }
            assert_eq!(
                negotiate(
                    Some("application/json;as=Table;v=v1beta1;g=meta.k8s.io"),
                    read,
                    false,
                    false
                ),
                Err(TABLE_V1BETA1)
            );
            for other in [
                "application/yaml;as=Table;v=v1;g=meta.k8s.io",
                "application/json;as=Table;v=v2;g=meta.k8s.io",
            ] {
                let got = negotiate(Some(other), read, false, false);
                assert!(
                    got.is_err() && got != Err(TABLE) && got != Err(TABLE_V1BETA1),
                    "{other} {read:?}"
                );
            }
        }
        // Indented: the apiserver's.
        let pretty = "application/json;as=Table;v=v1;g=meta.k8s.io;pretty=1";
        assert_eq!(
            negotiate(Some(pretty), List, false, false),
            Err("encoding: pretty")
        );
        assert_eq!(
            negotiate(Some(KUBECTL_GET), Get, false, true),
            Err("encoding: pretty")
        );
        // includeObject is read, and left out of the query the planners read.
        assert_eq!(
            table_query(Some("limit=2&includeObject=None&continue=x")),
            Ok((IncludeObject::None, "limit=2&continue=x".to_string()))
        );
        assert_eq!(
            table_query(None),
            Ok((IncludeObject::Metadata, String::new()))
        );
        assert_eq!(
            table_query(Some("includeObject=")),
            Ok((IncludeObject::Metadata, String::new()))
        );
        assert_eq!(
            table_query(Some("includeObject=Object")).map(|q| q.0),
            Ok(IncludeObject::Object)
        );
        // What the apiserver refuses (400) or reads in its own way is its to answer.
        for q in [
            "includeObject=Bogus",
            "includeObject=none",
            "includeObject=None&includeObject=Object",
        ] {
            assert!(table_query(Some(q)).is_err(), "{q}");
        }
    }

    #[test]
    fn no_accept_is_json() {
        for read in [Get, List, Watch] {
            assert_eq!(negotiate(None, read, false, false), Ok(Encoding::Json));
            assert_eq!(negotiate(Some(""), read, false, false), Ok(Encoding::Json));
            assert_eq!(
                negotiate(Some("  "), read, false, false),
                Ok(Encoding::Json)
            );
        }
    }

    #[test]
    fn custom_resources_skip_protobuf_unless_transformed() {
        for read in [Get, List, Watch] {
            assert_eq!(
                negotiate(Some(CLIENT_GO_PROTOBUF), read, true, false),
                Ok(Encoding::Json)
            );
            assert!(negotiate(Some(METADATA_LIST), read, true, false).is_err());
            assert!(negotiate(Some(KUBECTL_GET), read, true, false).is_err());
        }
    }

    #[test]
    fn goautoneg_parsing_and_order_are_reproduced() {
        let c =
            parse_accept("a/b;x=1;x=2;q=0.5;bad;y=;z=1=2;w==, */*, */x, c/*, *, d/e/f, g, h/i/")
                .unwrap();
        let got: Vec<_> = c.iter().map(|c| (c.ty, c.sub, c.q)).collect();
        assert_eq!(
            got,
            // As Go 1.26 orders it (checked against goautoneg itself): `less` is no strict
            // order, so a concrete type does not always precede `c/*`.
            [
                ("h", "i", 1.0),
                ("c", "*", 1.0),
                ("*", "x", 1.0),
                ("*", "*", 1.0),
                ("*", "*", 1.0),
                ("a", "b", 0.5)
            ],
        );
        let ab = c.iter().find(|c| c.ty == "a").unwrap();
        assert_eq!(ab.param("x"), Some("2"));
        assert_eq!(ab.param("y"), None);
        assert_eq!(ab.param("z"), None);
        assert_eq!(
            ab.param("w"),
            Some(""),
            "'w==': the key w with an empty value, as Go's map holds it"
        );
        // Unreproducible in Rust: the apiserver decides.
        assert!(negotiate(Some("application/json;q=0x1p-1"), List, false, false).is_err());
        let many = vec!["application/json"; 13].join(",");
        assert!(negotiate(Some(&many), List, false, false).is_err());
    }

    #[test]
    fn browsers_and_http_tools_get_the_apiservers_indented_json() {
        for ua in ["curl/8.5.0", "Wget/1.21", "Mozilla/5.0 (X11)"] {
            let pretty = pretty_agent(Some(ua.as_bytes()));
            assert!(pretty, "{ua}");
            for accept in [None, Some("application/json"), Some("*/*")] {
                assert!(
                    negotiate(accept, Get, false, pretty).is_err(),
                    "{ua} {accept:?}"
                );
                assert!(
                    negotiate(accept, List, false, pretty).is_err(),
                    "{ua} {accept:?}"
                );
                assert_eq!(
                    negotiate(accept, Watch, false, pretty),
                    Ok(Encoding::Json),
                    "watch events are never indented"
                );
            }
        }
        for ua in ["kubectl/v1.36.3", "Curl", "mozilla/5.0", ""] {
            assert!(!pretty_agent(Some(ua.as_bytes())), "{ua}");
        }
        assert!(!pretty_agent(None));
    }
}
