//! GET and LIST served from the cache, with the apiserver's list semantics
//! (k8s.io/apiserver `cacher.GetList`, `watchCache.waitUntilFreshAndList`, `PrepareContinueToken`):
//!
//! | resourceVersion | match | served at |
//! | --- | --- | --- |
//! | unset | - | the current state, once the consistency policy allows ([`crate::read::consistency`]) |
//! | `0` | unset / NotOlderThan | the current state; `limit` ignored (as the watch cache does) |
//! | N | NotOlderThan, or unset without `limit` | the current state once the cache reached N |
//! | N | Exact, or unset with `limit` | the snapshot at exactly N |
//!
//! Pages: every page of one walk comes from one snapshot (retained while the walk goes on,
//! or rebuilt from the event history); the continue token ([`crate::read::token`]) is signed,
//! bound to the caller and the query, and positions by key. `remainingItemCount` is set when
//! there are no selectors, as the apiserver does. A page holds at most `limit` items and may
//! hold fewer (the page-size cap of adaptive paging).
//!
//! The first page of a latest-state list uses the apiserver's "indexes": pods'
//! `spec.nodeName=X` reads only that node's pods, and `metadata.name=X` in a namespace (or on a
//! cluster-scoped resource) reads one key — which decides whether a continue token is
//! returned when nothing further matches, exactly as the apiserver decides it.
//!
//! Anything the cache cannot answer exactly passes through (a snapshot older than the
//! history, a resourceVersion the cache has not reached in time, tokens that are not the
//! proxy's). Bodies are written without re-encoding objects; an unpaginated list streams in
//! chunks from its snapshot, so memory per request stays near one chunk; large bodies are
//! gzipped when the client accepts it (the apiserver's 128 KiB threshold).

use std::io::Write;
use std::ops::Bound;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use http::{HeaderValue, Response, StatusCode, header};

use crate::cache::event::{Encoding, put_object};
use crate::cache::hub::Filter;
use crate::cache::store::Snapshot;
use crate::cache::table::TableForm;
use crate::cache::{CachedObject, ObjectKey, ResourceCache};
use crate::http::body::{self, Body};
use crate::k8s::status::{Reason, Status};
use crate::read::plan::{self, ListFrom, ListParams, ReadAt};
use crate::read::token::{Binding, Keys, TokenError};
use crate::read::{NotServed, Served, delegate};

/// Settings of cache-served lists.
#[derive(Debug, Clone)]
pub struct ListConfig {
    /// How long a list waits for the cache to reach a requested resourceVersion before the
    /// apiserver answers instead (the apiserver itself waits 3 s, then 504).
    pub wait_for_rv: Duration,
    /// Bodies at least this large are gzipped for clients that accept it (kube-apiserver:
    /// 128 KiB); 0 turns compression off.
    pub gzip_min_bytes: usize,
    /// flate2 level, 1 (fast) to 9.
    pub gzip_level: u32,
    /// Continue tokens at least this old are checked for compaction upstream.
    pub compaction_check_after: Duration,
    /// Chunk size of streamed, unpaginated lists.
    pub chunk_bytes: usize,
}

impl Default for ListConfig {
    fn default() -> Self {
        ListConfig {
            wait_for_rv: Duration::from_secs(3),
            gzip_min_bytes: 128 * 1024,
            gzip_level: 1,
            compaction_check_after: Duration::from_secs(15),
            chunk_bytes: 256 * 1024,
        }
    }
}

/// Why a protobuf read goes to the apiserver: an object version's envelope has not come
/// from the resource's protobuf side (yet).
const NO_PROTOBUF: &str = "protobuf of an object version not cached";

/// The content type of the apiserver's protobuf responses.
const PROTOBUF_TYPE: &str = "application/vnd.kubernetes.protobuf";

fn protobuf_response(b: Bytes) -> Response<Body> {
    let mut r = Response::new(body::full(b));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(PROTOBUF_TYPE),
    );
    r
}

/// A page in the apiserver's protobuf: the list envelope around each item's own message
/// (`protobuf_write::list_body`), or `None` when an item's envelope is missing or unreadable
/// (the apiserver answers then). Gzip as for JSON.
async fn write_proto_page(
    cache: &ResourceCache,
    enc: Encoding,
    cx: &ListContext<'_>,
    list_rv: u64,
    page: &Page,
    meta: Option<(String, Option<u64>)>,
) -> Served {
    use crate::k8s::protobuf_write::{ListMeta, list_body};
    let mut raws: Vec<&[u8]> = Vec::with_capacity(page.items.len());
    for o in &page.items {
        let Some(env) = o.proto.get() else {
            return delegate(NO_PROTOBUF);
        };
        let raw = crate::k8s::protobuf::envelope(env).and_then(|e| match enc {
            Encoding::Metadata => crate::k8s::protobuf_write::partial_object_metadata(e.raw),
            Encoding::Json => Some(e.raw),
        });
        let Some(raw) = raw else {
            return delegate(NO_PROTOBUF);
        };
        raws.push(raw);
    }
    let rv = list_rv.to_string();
    let (token, remaining) = match &meta {
        Some((t, n)) => (t.as_str(), n.and_then(|n| i64::try_from(n).ok())),
        None => ("", None),
    };
    let r = &cache.resource;
    let (api_version, list_kind) = match enc {
        Encoding::Metadata => (
            crate::k8s::protobuf_write::META_V1.to_string(),
            "PartialObjectMetadataList".to_string(),
        ),
        Encoding::Json => (r.api_version(), r.list_kind()),
    };
    let b = Bytes::from(list_body(
        &api_version,
        &list_kind,
        &ListMeta {
            resource_version: &rv,
            continue_token: token,
            remaining_item_count: remaining,
        },
        &raws,
    ));
    drop(raws);
    if cx.accepts_gzip
        && cx.cfg.gzip_min_bytes > 0
        && b.len() >= cx.cfg.gzip_min_bytes
        && let Some(z) = gzip_off_worker(vec![b.clone()], b.len(), cx.cfg.gzip_level).await
    {
        let mut r = gzipped(z);
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROTOBUF_TYPE),
        );
        return Ok(r);
    }
    Ok(protobuf_response(b))
}

fn json(b: Bytes) -> Response<Body> {
    let mut r = Response::new(body::full(b));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// One object, or the apiserver answers when the cache does not hold it (so a 404 comes from
/// the apiserver in its exact form, and an object newer than the cache is still found).
pub fn get(
    cache: &ResourceCache,
    snap: &Snapshot,
    namespace: &str,
    name: &str,
    enc: Encoding,
    protobuf: bool,
) -> Served {
    let ns = if cache.resource.namespaced {
        namespace
    } else {
        ""
    };
    let Some(obj) = snap.objects.get(&ObjectKey::new(ns, name)) else {
        return delegate("object not in the cache");
    };
    if protobuf {
        let Some(env) = obj.proto.get() else {
            return delegate(NO_PROTOBUF);
        };
        if enc == Encoding::Metadata {
            return match crate::k8s::protobuf_write::metadata_object(env) {
                Some(m) => Ok(protobuf_response(Bytes::from(m))),
                None => delegate(NO_PROTOBUF),
            };
        }
        return Ok(protobuf_response(env.clone()));
    }
    let mut b = BytesMut::with_capacity(obj.body.len() + 64);
    put_object(&mut b, &cache.resource, &obj.body, enc);
    Ok(json(b.freeze()))
}

/// The candidates of a page, in key order: the request's scope from after `after`,
/// narrowed by an index when the apiserver would use one.
struct Candidates<'a> {
    snap: &'a Snapshot,
    namespace: Option<&'a str>,
    single: Option<ObjectKey>,
    node_name: Option<&'a str>,
}

impl<'a> Candidates<'a> {
    fn new(
        cache: &ResourceCache,
        snap: &'a Snapshot,
        filter: &'a Filter,
        use_index: bool,
    ) -> Candidates<'a> {
        let namespace = filter.namespace.as_deref();
        // registry `Store.ListPredicate`: metadata.name=X reads one key when the key can be
        // built (a namespaced request, or a cluster-scoped resource) — on every page kind.
        let single = filter
            .fields
            .exact_value("metadata.name")
            .filter(|_| namespace.is_some() || !cache.resource.namespaced)
            .map(|n| ObjectKey::new(namespace.unwrap_or(""), n));
        // Pods' spec.nodeName index (pod strategy `IndexFields`), used by latest-state lists.
        let node_name =
            (use_index && cache.resource.group.is_empty() && cache.resource.resource == "pods")
                .then(|| filter.fields.exact_value("spec.nodeName"))
                .flatten();
        Candidates {
            snap,
            namespace,
            single,
            node_name,
        }
    }

    fn iter(
        &self,
        after: Option<&ObjectKey>,
    ) -> Box<dyn Iterator<Item = (&'a ObjectKey, &'a Arc<CachedObject>)> + 'a> {
        let objects = &self.snap.objects;
        if let Some(k) = &self.single {
            let hit = objects
                .get_key_value(k)
                .filter(|(key, _)| after.is_none_or(|a| *key > a));
            return Box::new(hit.into_iter());
        }
        let start = match (after, self.namespace) {
            (Some(a), _) => Bound::Excluded(a.clone()),
            (None, Some(ns)) => Bound::Included(ObjectKey::new(ns, "")),
            (None, None) => Bound::Unbounded,
        };
        let ns = self.namespace;
        let node = self.node_name;
        if let Some(n) = node
            && let Some(ix) = self
                .snap
                .index
                .as_ref()
                .filter(|ix| ix.field == "spec.nodeName")
        {
            // Only the keys holding the value, in the same key order.
            return Box::new(
                ix.get(n)
                    .into_iter()
                    .flat_map(move |set| set.range((start.clone(), Bound::Unbounded)))
                    .take_while(move |k| ns.is_none_or(|ns| &*k.namespace == ns))
                    .filter_map(move |k| objects.get_key_value(k)),
            );
        }
        Box::new(
            objects
                .range((start, Bound::Unbounded))
                .take_while(move |(k, _)| ns.is_none_or(|ns| &*k.namespace == ns))
                .filter(move |(_, o)| node.is_none_or(|n| o.field("spec.nodeName") == Some(n))),
        )
    }

    /// Candidates after `after` (all of them when `None`): remainingItemCount without
    /// selectors.
    fn count(&self, after: Option<&ObjectKey>) -> u64 {
        match (after, self.namespace, &self.single) {
            (None, None, None) if self.node_name.is_none() => self.snap.objects.len() as u64,
            _ => self.iter(after).count() as u64,
        }
    }
}

/// Where a page starts: a verified token, or the beginning.
struct Position {
    after: Option<ObjectKey>,
    seen: u64,
    total: Option<u64>,
}

struct Page {
    items: Vec<Arc<CachedObject>>,
    /// Set when candidates remain after the last item.
    next: Option<(ObjectKey, u64)>,
}

fn select_page(cands: &Candidates<'_>, filter: &Filter, pos: &Position, limit: u64) -> Page {
    let mut items = Vec::new();
    let mut it = cands.iter(pos.after.as_ref()).peekable();
    let mut seen = pos.seen;
    let mut last = None;
    while let Some((k, o)) = it.next() {
        seen += 1;
        if filter.matches(o) {
            items.push(o.clone());
            last = Some(k);
        }
        if limit > 0 && items.len() as u64 >= limit {
            // cacher.GetList: more when any candidate follows.
            let next = it
                .peek()
                .is_some()
                .then(|| last.map(|k| (k.clone(), seen)))
                .flatten();
            return Page { items, next };
        }
    }
    Page { items, next: None }
}

fn put_list_head(b: &mut BytesMut, cache: &ResourceCache, enc: Encoding) {
    let r = &cache.resource;
    match enc {
        Encoding::Json => {
            b.put_slice(b"{\"kind\":\"");
            b.put_slice(r.list_kind().as_bytes());
            b.put_slice(b"\",\"apiVersion\":\"");
            b.put_slice(r.api_version().as_bytes());
            b.put_slice(b"\"");
        }
        Encoding::Metadata => b.put_slice(
            b"{\"kind\":\"PartialObjectMetadataList\",\"apiVersion\":\"meta.k8s.io/v1\"",
        ),
    }
}

fn put_item(b: &mut BytesMut, cache: &ResourceCache, o: &CachedObject, enc: Encoding) {
    match enc {
        // List items carry no kind/apiVersion, as the apiserver writes them.
        Encoding::Json => b.put_slice(&o.body),
        Encoding::Metadata => put_object(b, &cache.resource, &o.body, enc),
    }
}

fn gzip<'a>(parts: impl Iterator<Item = &'a Bytes>, len: usize, level: u32) -> Option<Vec<u8>> {
    let mut e =
        flate2::write::GzEncoder::new(Vec::with_capacity(len / 4), flate2::Compression::new(level));
    for p in parts {
        e.write_all(p).ok()?;
    }
    e.finish().ok()
}

/// Runs `f` on the blocking pool: compressing a large page takes milliseconds of CPU, which
/// on the connection's task would hold back that connection's other streams (watch events
/// included, [`crate::http::local_streams`]) and on a runtime worker every task queued behind it.
async fn off_worker<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, std::io::Error> + Send + 'static,
) -> Result<T, body::BoxError> {
    Ok(tokio::task::spawn_blocking(f).await??)
}

fn gzipped(z: Vec<u8>) -> Response<Body> {
    let mut r = json(Bytes::from(z));
    r.headers_mut()
        .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    r.headers_mut()
        .insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    r
}

/// `parts` (`len` bytes) gzipped off the runtime's workers; `None` if that failed (the
/// caller then answers uncompressed).
async fn gzip_off_worker(parts: Vec<Bytes>, len: usize, level: u32) -> Option<Vec<u8>> {
    off_worker(move || gzip(parts.iter(), len, level).ok_or_else(|| std::io::Error::other("gzip")))
        .await
        .ok()
}

async fn respond(b: Bytes, cfg: &ListConfig, accepts_gzip: bool) -> Response<Body> {
    if accepts_gzip
        && cfg.gzip_min_bytes > 0
        && b.len() >= cfg.gzip_min_bytes
        && let Some(z) = gzip_off_worker(vec![b.clone()], b.len(), cfg.gzip_level).await
    {
        return gzipped(z);
    }
    json(b)
}

/// Everything a list needs besides its request.
pub struct ListContext<'a> {
    pub cfg: &'a ListConfig,
    pub keys: &'a Keys,
    /// Binds continue tokens to the caller and the query.
    pub binding: Binding,
    pub accepts_gzip: bool,
    /// Largest page the proxy writes (adaptive paging); `None`: the client's limit.
    pub page_cap: Option<u64>,
    /// Asked whether a continue token's resourceVersion is compacted upstream (the token
    /// then gets the apiserver's 410 whatever the proxy still holds), and to bring the cache
    /// to a resourceVersion it has not reached (`Consistency::reach`); `None`: never asked,
    /// the list only waits for its resource's events.
    pub upstream: Option<&'a Arc<crate::read::consistency::Consistency>>,
    /// The apiserver's protobuf instead of `enc` (`read::router::PROTOBUF`): pages are
    /// assembled from the objects' protobuf envelopes, or the apiserver answers when one is
    /// missing.
    pub protobuf: bool,
    /// A Table (`as=Table;v=v1;g=meta.k8s.io`) with rows' objects as asked: pages show the
    /// same objects, each by its row from the table side ([`crate::read::table`]).
    pub table: Option<TableForm>,
}

fn expired_continue(cx: &ListContext<'_>, after: ObjectKey) -> Status {
    // etcd3 `handleCompactedErrorForPaging`: 410 with a token that continues the walk from
    // the same key at the latest state (rv 0 in the proxy's tokens).
    let token = cx.keys.sign(&cx.binding, 0, after, 0, 0);
    Status::failure(
        StatusCode::GONE,
        Reason::Expired,
        "The provided continue parameter is too old to display a consistent list result. You \
         can start a new list without the continue parameter, or use the continue token in \
         this response to retrieve the remainder of the results. Continuing with the \
         provided token results in an inconsistent list - objects that were created, \
         modified, or deleted between the time the first chunk was returned and now may \
         show up in the list.",
    )
    .with_continue(token)
}

/// Whether `cache` reached `rv` within the configured wait, the apiserver probed when it
/// does not come by itself (`Consistency::reach`).
async fn reach(cache: &Arc<ResourceCache>, cx: &ListContext<'_>, rv: u64) -> bool {
    match cx.upstream {
        Some(c) => c.reach(cache, rv, cx.cfg.wait_for_rv).await,
        None => cache.wait_for_rv(rv, cx.cfg.wait_for_rv).await,
    }
}

/// Serves a list. `latest` is the current state the consistency policy allows for an
/// unset resourceVersion (the caller obtains it; other forms ignore it).
pub async fn list(
    cache: &Arc<ResourceCache>,
    filter: &Filter,
    enc: Encoding,
    p: &ListParams,
    cx: &ListContext<'_>,
    latest: Served<Snapshot>,
) -> Served {
    use std::sync::atomic::Ordering::Relaxed;
    let out = list_inner(cache, filter, enc, p, cx, latest).await;
    if cx.table.is_some() {
        let t = &cache.table.stats;
        match &out {
            Err(NotServed::Delegate(_)) => t.passed_through.fetch_add(1, Relaxed),
            _ => t.served.fetch_add(1, Relaxed),
        };
    }
    let st = &cache.list_stats;
    match &out {
        Ok(r) => {
            st.from_cache.fetch_add(1, Relaxed);
            if p.continue_.is_some() && r.status().is_success() {
                st.continued.fetch_add(1, Relaxed);
            }
        }
        Err(NotServed::Delegate(_)) => {
            st.passed_through.fetch_add(1, Relaxed);
        }
        // Refusals are answered by the proxy, from what the cache knows (bad or expired
        // continue tokens): served from the cache, as before they were counted so.
        Err(NotServed::Refuse(_)) => {
            st.from_cache.fetch_add(1, Relaxed);
        }
    }
    out
}

async fn list_inner(
    cache: &Arc<ResourceCache>,
    filter: &Filter,
    enc: Encoding,
    p: &ListParams,
    cx: &ListContext<'_>,
    latest: Served<Snapshot>,
) -> Served {
    use std::sync::atomic::Ordering::Relaxed;
    let plan = plan::list(p)?;
    let mut limit = plan.limit;
    // The snapshot, the list's resourceVersion, where the page starts, index use.
    let (snap, list_rv, pos, use_index) = match plan.from {
        ListFrom::Continue(c) => {
            let t = match cx.keys.verify(&cx.binding, c) {
                Ok(t) => t,
                Err(e) => {
                    let counter = match e {
                        TokenError::Invalid => Some(&cache.list_stats.token_invalid),
                        TokenError::Expired => Some(&cache.list_stats.token_expired),
                        TokenError::Foreign => None,
                    };
                    if let Some(c) = counter {
                        c.fetch_add(1, Relaxed);
                    }
                    // 400, 410 or to the apiserver: `From<TokenError> for NotServed`.
                    return Err(e.into());
                }
            };
            if t.rv == 0 {
                // An inconsistent continuation: the latest state from that key on, at etcd's
                // current revision as etcd3 storage reads it (its resourceVersion is newer
                // than the compacted one the walk started at, even when nothing of this
                // resource changed since and the cache's own resourceVersion is still that
                // old one). One probe round per walk; without an answer, the cache's
                // current state (consistent, if not as new).
                if let Some(c) = cx.upstream {
                    c.advance(cache, cx.cfg.wait_for_rv).await;
                }
                let snap = cache.current();
                let rv = snap.rv;
                (
                    snap,
                    rv,
                    Position {
                        after: Some(t.after),
                        seen: 0,
                        total: None,
                    },
                    false,
                )
            } else {
                if t.rv > cache.rv() {
                    // Issued by a replica whose cache is ahead.
                    reach(cache, cx, t.rv).await;
                }
                // Expired when the apiserver would expire it: once etcd compacted its revision.
                let age = cx.keys.age(&t);
                if let Some(c) = cx.upstream
                    && age >= cx.cfg.compaction_check_after
                    && c.compacted(cache, t.rv).await
                {
                    cache.list_stats.snapshot_gone.fetch_add(1, Relaxed);
                    return Err(expired_continue(cx, t.after).into());
                }
                let Some(snap) = cache.snapshot_at(t.rv) else {
                    cache.list_stats.snapshot_gone.fetch_add(1, Relaxed);
                    return Err(expired_continue(cx, t.after).into());
                };
                (
                    snap,
                    t.rv,
                    Position {
                        after: Some(t.after),
                        seen: t.seen,
                        total: Some(t.total),
                    },
                    false,
                )
            }
        }
        ListFrom::Start(at) => {
            let start = Position {
                after: None,
                seen: 0,
                total: None,
            };
            let snap = match at {
                ReadAt::Exact(n) => {
                    if cache.rv() < n && !reach(cache, cx, n).await {
                        return delegate(crate::read::NOT_REACHED);
                    }
                    let Some(snap) = cache.snapshot_at(n) else {
                        return delegate("snapshot older than the history");
                    };
                    snap
                }
                ReadAt::NotOlderThan(n) => {
                    if cache.rv() < n && !reach(cache, cx, n).await {
                        return delegate(crate::read::NOT_REACHED);
                    }
                    cache.current()
                }
                ReadAt::Any => cache.current(),
                ReadAt::Latest => latest?,
            };
            // An exact snapshot's resourceVersion is the one asked for.
            let rv = match at {
                ReadAt::Exact(n) => n,
                _ => snap.rv,
            };
            (snap, rv, start, at.uses_index())
        }
    };
    // A protobuf walk the cache starts it must finish (its continue tokens are the
    // proxy's): every object of the snapshot must have its envelope before the first page.
    if cx.protobuf && pos.after.is_none() && snap.objects.values().any(|o| o.proto.get().is_none())
    {
        return delegate(NO_PROTOBUF);
    }
    let no_selectors = filter.labels.is_everything() && filter.fields.is_everything();
    let cands = Candidates::new(cache, &snap, filter, use_index && pos.after.is_none());
    if limit == 0 {
        if let Some(form) = cx.table {
            let page = select_page(&cands, filter, &pos, 0);
            return write_table_page(cache, cx, form, list_rv, &page, None, &pos, None).await;
        }
        if cx.protobuf {
            let page = select_page(&cands, filter, &pos, 0);
            return write_proto_page(cache, enc, cx, list_rv, &page, None).await;
        }
        // A continue with no limit (legal, if odd) resumes after its key.
        if pos.after.is_some() {
            let page = select_page(&cands, filter, &pos, 0);
            return Ok(write_page(cache, enc, cx, list_rv, &page, None).await);
        }
        return Ok(stream_all(cache.clone(), &cands, filter, enc, cx, list_rv).await);
    }
    if let Some(cap) = cx.page_cap {
        limit = limit.min(cap.max(1));
    }
    let page = select_page(&cands, filter, &pos, limit);
    let meta = page.next.as_ref().map(|(last, seen)| {
        let total = if no_selectors {
            // Counted once per walk (the first page, or an inconsistent continuation), then
            // carried in the token.
            pos.total
                .unwrap_or_else(|| pos.seen + cands.count(pos.after.as_ref()))
        } else {
            0
        };
        cache.retain(&snap);
        let token = cx
            .keys
            .sign(&cx.binding, list_rv, last.clone(), *seen, total);
        (token, no_selectors.then(|| total.saturating_sub(*seen)))
    });
    if let Some(form) = cx.table {
        // A walk the cache starts it must finish (its continue tokens are the proxy's):
        // every object it will show must have its row before the first page.
        let walk = (pos.after.is_none() && page.next.is_some()).then_some((&cands, filter));
        return write_table_page(cache, cx, form, list_rv, &page, meta, &pos, walk).await;
    }
    if cx.protobuf {
        return write_proto_page(cache, enc, cx, list_rv, &page, meta).await;
    }
    Ok(write_page(cache, enc, cx, list_rv, &page, meta).await)
}

/// A page as a Table ([`crate::read::table`]). A row that does not come within the list's
/// wait sends a first page to the apiserver; a later page of a walk the cache started gets
/// the apiserver's answer to a continue token whose snapshot is gone (410 Expired, with a
/// token that continues at the latest state). `walk`: the candidates of a walk's first
/// page, every one of which must have its row.
#[allow(clippy::too_many_arguments)] // the page's parts, as `write_page` takes them, and the walk's
async fn write_table_page(
    cache: &ResourceCache,
    cx: &ListContext<'_>,
    form: TableForm,
    list_rv: u64,
    page: &Page,
    meta: Option<(String, Option<u64>)>,
    pos: &Position,
    walk: Option<(&Candidates<'_>, &Filter)>,
) -> Served {
    use crate::read::table;
    let bound = cx.cfg.wait_for_rv;
    if let Some((cands, filter)) = walk {
        let all: Vec<&Arc<CachedObject>> = cands
            .iter(None)
            .filter(|(_, o)| filter.matches(o))
            .map(|(_, o)| o)
            .collect();
        if table::rows_of(cache, &all, bound).await.is_none() {
            return delegate(table::NO_ROW);
        }
    }
    let items: Vec<&Arc<CachedObject>> = page.items.iter().collect();
    let Some((cols, rows)) = table::rows_of(cache, &items, bound).await else {
        return match &pos.after {
            Some(after) => Err(expired_continue(cx, after.clone()).into()),
            None => delegate(table::NO_ROW),
        };
    };
    let list_meta = table::list_meta(list_rv, meta.as_ref());
    let Some(b) = table::body(cache, &cols, &list_meta, &items, &rows, form) else {
        return match &pos.after {
            Some(after) => Err(expired_continue(cx, after.clone()).into()),
            None => delegate(table::NO_ROW),
        };
    };
    Ok(respond(b, cx.cfg, cx.accepts_gzip).await)
}

/// One object as a Table, or the apiserver's answer when the cache does not hold it or its
/// row does not come within `bound`.
pub async fn get_table(
    cache: &ResourceCache,
    snap: &Snapshot,
    namespace: &str,
    name: &str,
    form: TableForm,
    bound: Duration,
) -> Served {
    use std::sync::atomic::Ordering::Relaxed;
    let ns = if cache.resource.namespaced {
        namespace
    } else {
        ""
    };
    let out = match snap.objects.get(&ObjectKey::new(ns, name)) {
        None => delegate("object not in the cache"),
        Some(o) => crate::read::table::get(cache, o, form, bound)
            .await
            .map(json),
    };
    let t = &cache.table.stats;
    match &out {
        Ok(_) => t.served.fetch_add(1, Relaxed),
        Err(_) => t.passed_through.fetch_add(1, Relaxed),
    };
    out
}

/// Objects at least this large go into a page body as the bytes the cache shares, not copied.
const ZERO_COPY_MIN: usize = 4096;

/// A page's body: `meta` is the continue token and remainingItemCount, if any. Large items
/// are written as their own frames (the cache's shared bytes), small ones copied into 64 KiB
/// chunks, so a page costs no allocation the size of the page.
async fn write_page(
    cache: &ResourceCache,
    enc: Encoding,
    cx: &ListContext<'_>,
    list_rv: u64,
    page: &Page,
    meta: Option<(String, Option<u64>)>,
) -> Response<Body> {
    let mut f = body::FramesBuilder::new(64 * 1024, ZERO_COPY_MIN);
    let b = f.buf();
    put_list_head(b, cache, enc);
    b.put_slice(format!(",\"metadata\":{{\"resourceVersion\":\"{list_rv}\"").as_bytes());
    if let Some((token, remaining)) = meta {
        b.put_slice(b",\"continue\":\"");
        b.put_slice(token.as_bytes());
        b.put_u8(b'"');
        if let Some(n) = remaining {
            b.put_slice(format!(",\"remainingItemCount\":{n}").as_bytes());
        }
    }
    b.put_slice(b"},\"items\":[");
    for (i, o) in page.items.iter().enumerate() {
        if i > 0 {
            f.buf().put_u8(b',');
        }
        match enc {
            // List items carry no kind/apiVersion, as the apiserver writes them.
            Encoding::Json => f.put_bytes(&o.body),
            Encoding::Metadata => put_object(f.buf(), &cache.resource, &o.body, enc),
        }
    }
    f.buf().put_slice(b"]}");
    let frames = f.finish();
    if cx.accepts_gzip
        && cx.cfg.gzip_min_bytes > 0
        && frames.len() >= cx.cfg.gzip_min_bytes as u64
        && let Some(z) = gzip_off_worker(
            frames.iter().cloned().collect(),
            frames.len() as usize,
            cx.cfg.gzip_level,
        )
        .await
    {
        return gzipped(z);
    }
    let mut r = Response::new(body::boxed(frames));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// An unpaginated list, written in chunks straight from its snapshot: each chunk resumes the
/// key range after the previous one, so nothing but the chunk being written is buffered.
async fn stream_all(
    cache: Arc<ResourceCache>,
    cands: &Candidates<'_>,
    filter: &Filter,
    enc: Encoding,
    cx: &ListContext<'_>,
    list_rv: u64,
) -> Response<Body> {
    struct Gen {
        cache: Arc<ResourceCache>,
        snap: Snapshot,
        filter: Filter,
        single: Option<ObjectKey>,
        node_name: Option<String>,
        enc: Encoding,
        chunk: usize,
        /// Resume after this key; `None` at the start. `done` once the list is closed.
        after: Option<ObjectKey>,
        started: bool,
        any_item: bool,
        done: bool,
        list_rv: u64,
    }
    impl Gen {
        fn next(&mut self) -> Option<BytesMut> {
            if self.done {
                return None;
            }
            let mut b = BytesMut::with_capacity(self.chunk + 64 * 1024);
            if !self.started {
                self.started = true;
                put_list_head(&mut b, &self.cache, self.enc);
                b.put_slice(
                    format!(
                        ",\"metadata\":{{\"resourceVersion\":\"{}\"}},\"items\":[",
                        self.list_rv
                    )
                    .as_bytes(),
                );
            }
            let cands = Candidates {
                snap: &self.snap,
                namespace: self.filter.namespace.as_deref(),
                single: self.single.clone(),
                node_name: self.node_name.as_deref(),
            };
            let mut last = None;
            for (k, o) in cands.iter(self.after.as_ref()) {
                if !self.filter.matches(o) {
                    continue;
                }
                if self.any_item {
                    b.put_u8(b',');
                }
                self.any_item = true;
                put_item(&mut b, &self.cache, o, self.enc);
                if b.len() >= self.chunk {
                    last = Some(k.clone());
                    break;
                }
            }
            match last {
                Some(k) => self.after = Some(k),
                None => {
                    b.put_slice(b"]}");
                    self.done = true;
                }
            }
            Some(b)
        }
    }
    let mut g = Gen {
        cache,
        snap: cands.snap.clone(),
        filter: filter.clone(),
        single: cands.single.clone(),
        node_name: cands.node_name.map(str::to_string),
        enc,
        chunk: cx.cfg.chunk_bytes.max(4096),
        after: None,
        started: false,
        any_item: false,
        done: false,
        list_rv,
    };
    let first = g.next().unwrap_or_default();
    if g.done {
        return respond(first.freeze(), cx.cfg, cx.accepts_gzip).await;
    }
    // More than one chunk: at least `chunk_bytes`, so past the gzip threshold.
    let gz = (cx.accepts_gzip && cx.cfg.gzip_min_bytes > 0 && first.len() >= cx.cfg.gzip_min_bytes)
        .then(|| {
            flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(cx.cfg.gzip_level))
        });
    let compressed = gz.is_some();
    let stream = futures_util::stream::unfold(
        (Some(first), g, gz),
        |(pending, mut g, mut gz)| async move {
            let chunk = match pending {
                Some(c) => Some(c),
                None => g.next(),
            };
            // Each chunk is compressed off the runtime's workers (`off_worker`).
            let out = match (chunk, gz.take()) {
                (Some(c), None) => c.freeze(),
                (Some(c), Some(mut z)) => {
                    let r = off_worker(move || {
                        z.write_all(&c)?;
                        let out = std::mem::take(z.get_mut());
                        Ok((z, out))
                    })
                    .await;
                    match r {
                        Ok((z, out)) => {
                            gz = Some(z);
                            Bytes::from(out)
                        }
                        Err(e) => return Some((Err(e), (None, g, None))),
                    }
                }
                (None, Some(z)) => match off_worker(move || z.finish()).await {
                    Ok(v) => Bytes::from(v),
                    Err(e) => return Some((Err(e), (None, g, None))),
                },
                (None, None) => return None,
            };
            Some((Ok(http_body::Frame::data(out)), (None, g, gz)))
        },
    );
    let mut r = Response::new(body::boxed(http_body_util::StreamBody::new(stream)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if compressed {
        r.headers_mut()
            .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        r.headers_mut()
            .insert(header::VARY, HeaderValue::from_static("Accept-Encoding"));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::{EventKind, ReflectorSink, Resource, StoreConfig};
    use crate::k8s::selector::{FieldSelector, LabelSelector};
    use crate::read::plan::{Rv, RvMatch};
    use crate::read::token::KeySet;
    use http_body_util::BodyExt;
    use proptest::prelude::*;

    fn cm(ns: &str, name: &str, app: &str, rv: u64) -> CachedObject {
        let raw = format!(
            r#"{{"metadata":{{"name":"{name}","namespace":"{ns}","resourceVersion":"{rv}","labels":{{"app":"{app}"}}}},"data":{{"k":"v{rv}"}}}}"#
        );
        CachedObject::parse(
            Bytes::from(raw),
            &Resource::core("configmaps", "ConfigMap", true),
        )
        .unwrap()
    }

    async fn body_json(r: Response<Body>) -> serde_json::Value {
        let gz = r.headers().get(header::CONTENT_ENCODING).is_some();
        let b = r.into_body().collect().await.unwrap().to_bytes();
        let b = if gz { gunzip(&b) } else { b.to_vec() };
        serde_json::from_slice(&b).unwrap()
    }

    fn gunzip(b: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(b), &mut out).unwrap();
        out
    }

    fn key_of(v: &serde_json::Value) -> String {
        format!(
            "{}/{}",
            v["metadata"]["namespace"].as_str().unwrap_or(""),
            v["metadata"]["name"].as_str().unwrap()
        )
    }

    struct Walk {
        items: Vec<String>,
        rvs: Vec<String>,
        remaining: Vec<Option<u64>>,
        pages: usize,
    }

    /// Walks every page; `between` runs between pages (concurrent writes).
    async fn walk(
        cache: &Arc<ResourceCache>,
        filter: &Filter,
        limit: u64,
        keys: &Keys,
        mut between: impl FnMut(usize),
    ) -> Walk {
        let cfg = ListConfig {
            chunk_bytes: 4096,
            ..Default::default()
        };
        let cx = ListContext {
            cfg: &cfg,
            keys,
            binding: Binding::new(&[b"t", b"me"]),
            accepts_gzip: true,
            page_cap: None,
            upstream: None,
            protobuf: false,
            table: None,
        };
        let mut w = Walk {
            items: vec![],
            rvs: vec![],
            remaining: vec![],
            pages: 0,
        };
        let mut cont: Option<String> = None;
        loop {
            let p = ListParams {
                rv: Rv::Unset,
                rv_match: RvMatch::Unset,
                limit,
                continue_: cont.take(),
                label_selector: String::new(),
                field_selector: String::new(),
            };
            let latest = Ok(cache.current());
            let Ok(r) = list(cache, filter, Encoding::Json, &p, &cx, latest).await else {
                panic!("not served from the cache");
            };
            assert_eq!(r.status(), 200);
            let v = body_json(r).await;
            w.pages += 1;
            w.rvs.push(
                v["metadata"]["resourceVersion"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            );
            w.remaining
                .push(v["metadata"]["remainingItemCount"].as_u64());
            for i in v["items"].as_array().unwrap() {
                w.items.push(key_of(i));
            }
            match v["metadata"]["continue"].as_str() {
                Some(c) => {
                    between(w.pages);
                    cont = Some(c.to_string());
                }
                None => return w,
            }
        }
    }

    fn keys() -> Arc<Keys> {
        Keys::fixed(KeySet::generate(), Duration::from_secs(60))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]

        /// Walking every page with any limit yields exactly the first page's snapshot, once
        /// each, in the apiserver's key order, while writes land between the pages.
        #[test]
        fn pages_walk_one_snapshot_exactly_once(
            objects in proptest::collection::btree_map(
                ("(a|a-b|b|c)", "[a-z]{1,3}"), "(x|y)", 0..40),
            writes in proptest::collection::vec(
                (("(a|a-b|b|c)", "[a-z]{1,3}"), "(x|y)", any::<bool>()), 0..30),
            limit in 1u64..12,
            selector in proptest::option::of("(x|y)"),
            namespace in proptest::option::of("(a|a-b|b)"),
        ) {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let cache = ResourceCache::new(
                    Resource::core("configmaps", "ConfigMap", true),
                    StoreConfig::default(),
                );
                let mut rv = 10;
                let items: Vec<CachedObject> = objects
                    .iter()
                    .map(|((ns, n), app)| { rv += 1; cm(ns, n, app, rv) })
                    .collect();
                cache.replace(items, rv);
                cache.set_unhealthy(None);
                let filter = Filter {
                    namespace: namespace.clone(),
                    labels: LabelSelector::parse(
                        &selector.as_ref().map(|s| format!("app={s}")).unwrap_or_default()
                    ).unwrap(),
                    fields: FieldSelector::default(),
                    namespaces: None,
                    changes: None,
                };
                let expected: Vec<String> = {
                    let snap = cache.current();
                    snap.objects
                        .values()
                        .filter(|o| filter.matches(o))
                        .map(|o| format!("{}/{}", o.meta.namespace, o.meta.name))
                        .collect()
                };
                let keys = keys();
                let mut pending = writes.clone().into_iter();
                let c2 = cache.clone();
                let walk = walk(&cache, &filter, limit, &keys, |_| {
                    // Two writes between pages: the walk must not see them.
                    for ((ns, n), app, delete) in pending.by_ref().take(2) {
                        rv += 1;
                        let o = cm(&ns, &n, &app, rv);
                        let kind = if delete { EventKind::Deleted } else { EventKind::Modified };
                        c2.apply(kind, o);
                    }
                }).await;
                prop_assert_eq!(&walk.items, &expected);
                // One snapshot: every page carries the first page's resourceVersion.
                prop_assert!(walk.rvs.iter().all(|r| *r == walk.rvs[0]));
                // Pages hold `limit` items except the last.
                prop_assert!(walk.pages <= expected.len() / limit as usize + 1);
                if selector.is_none() {
                    // remainingItemCount: what is left after each page, without selectors.
                    for (i, rem) in walk.remaining.iter().enumerate() {
                        if let Some(rem) = rem {
                            prop_assert_eq!(*rem as usize, expected.len() - (i + 1) * limit as usize);
                        }
                    }
                } else {
                    prop_assert!(walk.remaining.iter().all(Option::is_none));
                }
                Ok(())
            })?;
        }
    }

    /// Pages mixing objects copied into chunks (small) and passed on as the cache's own bytes
    /// (large): the body is the exact JSON list, its declared length is its length, and the
    /// gzip form decodes to the same bytes.
    #[tokio::test]
    async fn pages_of_large_and_small_objects_are_exact() {
        let cache = ResourceCache::new(
            Resource::core("configmaps", "ConfigMap", true),
            StoreConfig::default(),
        );
        let objs: Vec<CachedObject> = (0..40u64)
            .map(|i| {
                let pad = "p".repeat(if i % 3 == 0 { 20_000 } else { 10 });
                let raw = format!(
                    r#"{{"metadata":{{"name":"o{i:02}","namespace":"a","resourceVersion":"{}"}},"data":{{"k":"{pad}"}}}}"#,
                    i + 1
                );
                CachedObject::parse(Bytes::from(raw), &cache.resource).unwrap()
            })
            .collect();
        let bodies: Vec<Bytes> = objs.iter().map(|o| o.body.clone()).collect();
        cache.replace(objs, 100);
        cache.set_unhealthy(None);
        let keys = keys();
        for gz in [false, true] {
            let cfg = ListConfig {
                gzip_min_bytes: 1024,
                ..Default::default()
            };
            let cx = ListContext {
                cfg: &cfg,
                keys: &keys,
                binding: Binding::new(&[b"t", b"me"]),
                accepts_gzip: gz,
                page_cap: None,
                upstream: None,
                protobuf: false,
                table: None,
            };
            let mut cont = None;
            let mut seen = Vec::new();
            loop {
                let p = ListParams {
                    rv: Rv::Unset,
                    rv_match: RvMatch::Unset,
                    limit: 7,
                    continue_: cont.take(),
                    label_selector: String::new(),
                    field_selector: String::new(),
                };
                let filter = Filter {
                    namespace: None,
                    labels: LabelSelector::default(),
                    fields: FieldSelector::default(),
                    namespaces: None,
                    changes: None,
                };
                let Ok(r) = list(
                    &cache,
                    &filter,
                    Encoding::Json,
                    &p,
                    &cx,
                    Ok(cache.current()),
                )
                .await
                else {
                    panic!("not served from the cache");
                };
                assert_eq!(r.headers().get(header::CONTENT_ENCODING).is_some(), gz);
                let declared = http_body::Body::size_hint(r.body()).exact();
                let raw = r.into_body().collect().await.unwrap().to_bytes();
                assert_eq!(declared, Some(raw.len() as u64));
                let text = if gz { gunzip(&raw) } else { raw.to_vec() };
                let v: serde_json::Value = serde_json::from_slice(&text).unwrap();
                for i in v["items"].as_array().unwrap() {
                    seen.push(serde_json::to_vec(i).unwrap());
                }
                // Items are the stored bytes verbatim, comma-separated.
                let text = String::from_utf8(text).unwrap();
                let start = text.find("\"items\":[").unwrap() + 9;
                let n = v["items"].as_array().unwrap().len();
                let first = seen.len() - n;
                let joined = bodies[first..first + n]
                    .iter()
                    .map(|b| std::str::from_utf8(b).unwrap())
                    .collect::<Vec<_>>()
                    .join(",");
                assert_eq!(&text[start..text.len() - 2], joined);
                match v["metadata"]["continue"].as_str() {
                    Some(c) => cont = Some(c.to_string()),
                    None => break,
                }
            }
            let expected: Vec<Vec<u8>> = bodies
                .iter()
                .map(|b| {
                    serde_json::to_vec(&serde_json::from_slice::<serde_json::Value>(b).unwrap())
                        .unwrap()
                })
                .collect();
            assert_eq!(seen, expected);
        }
    }

    #[tokio::test]
    async fn exact_resource_versions_are_rebuilt_from_the_history() {
        let cache = ResourceCache::new(
            Resource::core("configmaps", "ConfigMap", true),
            StoreConfig::default(),
        );
        cache.replace(vec![cm("a", "one", "x", 5), cm("a", "two", "x", 6)], 10);
        cache.apply(EventKind::Added, cm("a", "three", "x", 11));
        cache.apply(EventKind::Deleted, cm("a", "one", "x", 12));
        cache.apply(EventKind::Modified, cm("a", "two", "y", 13));
        let names = |s: &Snapshot| {
            s.objects
                .values()
                .map(|o| format!("{}@{}", o.meta.name, o.meta.resource_version))
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&cache.snapshot_at(10).unwrap()), ["one@5", "two@6"]);
        assert_eq!(
            names(&cache.snapshot_at(11).unwrap()),
            ["one@5", "three@11", "two@6"]
        );
        assert_eq!(
            names(&cache.snapshot_at(12).unwrap()),
            ["three@11", "two@6"]
        );
        assert_eq!(
            names(&cache.snapshot_at(13).unwrap()),
            ["three@11", "two@13"]
        );
        // Older than the history (it starts at the list at 10), or newer than the cache.
        assert!(cache.snapshot_at(9).is_none());
        assert!(cache.snapshot_at(14).is_none());
        // A rebuilt snapshot is retained for the pages that follow.
        assert_eq!(cache.retained_snapshots().0, 3);
    }

    #[tokio::test]
    async fn tokens_are_bound_to_the_caller_and_rejected_when_tampered_or_expired() {
        let cache = ResourceCache::new(
            Resource::core("configmaps", "ConfigMap", true),
            StoreConfig::default(),
        );
        cache.replace(
            (0..5)
                .map(|i| cm("a", &format!("c{i}"), "x", 5 + i))
                .collect(),
            20,
        );
        let cfg = ListConfig::default();
        let keys = keys();
        let filter = Filter::default();
        let serve = |binding: &'static [u8], cont: Option<String>, limit: u64| {
            let cache = cache.clone();
            let filter = filter.clone();
            let keys = keys.clone();
            let cfg = cfg.clone();
            async move {
                let cx = ListContext {
                    cfg: &cfg,
                    keys: &keys,
                    binding: Binding::new(&[binding]),
                    accepts_gzip: false,
                    page_cap: None,
                    upstream: None,
                    protobuf: false,
                    table: None,
                };
                let p = ListParams {
                    rv: Rv::Unset,
                    rv_match: RvMatch::Unset,
                    limit,
                    continue_: cont,
                    label_selector: String::new(),
                    field_selector: String::new(),
                };
                match list(
                    &cache,
                    &filter,
                    Encoding::Json,
                    &p,
                    &cx,
                    Ok(cache.current()),
                )
                .await
                {
                    Ok(r) => (r.status().as_u16(), body_json(r).await),
                    // The pipeline writes refusals; so does this test.
                    Err(NotServed::Refuse(s)) => {
                        let r = s.into_response();
                        (r.status().as_u16(), body_json(r).await)
                    }
                    Err(NotServed::Delegate(w)) => panic!("passthrough: {w}"),
                }
            }
        };
        let (code, first) = serve(b"alice", None, 2).await;
        assert_eq!(code, 200);
        let token = first["metadata"]["continue"].as_str().unwrap().to_string();
        assert_eq!(first["metadata"]["remainingItemCount"], 3);
        let (code, _) = serve(b"alice", Some(token.clone()), 2).await;
        assert_eq!(code, 200);
        let (code, v) = serve(b"mallory", Some(token.clone()), 2).await;
        assert_eq!((code, v["reason"].as_str()), (400, Some("BadRequest")));
        let mut bad = token.clone().into_bytes();
        let last = bad.len() - 1;
        bad[last] = if bad[last] == b'A' { b'B' } else { b'A' };
        let (code, _) = serve(b"alice", Some(String::from_utf8(bad).unwrap()), 2).await;
        assert_eq!(code, 400);
        // Expired: signed with a lifetime that has passed.
        let old = Keys::fixed((*keys.current()).clone(), Duration::ZERO);
        let expired = old.sign(
            &Binding::new(&[b"alice"]),
            20,
            ObjectKey::new("a", "c1"),
            2,
            5,
        );
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let (code, v) = serve(b"alice", Some(expired), 2).await;
        assert_eq!((code, v["reason"].as_str()), (410, Some("Expired")));
    }
}
