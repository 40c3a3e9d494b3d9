//! The request pipeline: every request's path from the listener to a response.
//!
//! Hygiene checks, then either a read served from the cache
//! (routed, authenticated, authorized, within the tenant's quotas) or the request handed to
//! the apiserver with the caller's identity; and the request's metrics and log line.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use rustls_pki_types::CertificateDer;

use crate::auth::identity::CertIdentity;
use crate::http::body::{self, Body};
use crate::k8s::request_info::{self, RequestInfo};
use crate::k8s::status::{Reason, Status};
use crate::k8s::watch_fields::{self, WatchFields};
use crate::metrics::{DurationLabels, EncodingLabels, KindLabels, Metrics, RequestLabels};
use crate::read::plan::{ReadAt, Rv};
use crate::read::router::{self, Route};
use crate::read::{NotServed, Served, delegate};
use crate::serve::caller::Caller;
use crate::serve::passthrough;
use crate::serve::state::{ConnInfo, State};

impl crate::http::listener::Service for State {
    type Conn = ConnInfo;

    fn accept(&self, peer: SocketAddr, cert: Option<&CertificateDer<'_>>) -> ConnInfo {
        ConnInfo {
            peer: Some(peer),
            cert: cert.and_then(|c| CertIdentity::from_der(c)).map(Arc::new),
        }
    }

    fn call(
        self: Arc<Self>,
        conn: Arc<ConnInfo>,
        req: Request<Incoming>,
    ) -> Pin<Box<dyn Future<Output = Response<Body>> + Send>> {
        Box::pin(async move { handle(&self, &conn, req).await })
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn downstream(&self) -> &Arc<crate::http::budget::Downstream> {
        &self.downstream
    }

    fn begin_shutdown(&self) {
        self.health.begin_shutdown();
    }

    fn begin_drain(&self) {
        self.drain.cancel();
    }
}

/// Serves a read from memory when the router says it can and the apiserver says this caller
/// may; otherwise hands it to the apiserver or refuses it (see [`NotServed`]).
async fn serve_from_cache(
    state: &State,
    conn: &ConnInfo,
    caller: &mut Caller,
    req: &Request<Incoming>,
    info: &RequestInfo,
    query: Option<&str>,
    watch_fields: Option<ParsedWatchFields>,
) -> Served {
    let route = |state: &State| {
        router::route(req.method(), info, query, req.headers(), |g, v, r| {
            state.caches.get(g, v, r)
        })
    };
    let route = match route(state) {
        // A watch of a resource the proxy's first discovery, still under way, may cache
        // (right after its start): it waits for that discovery, bounded, then is routed
        // again; still under way, it is asked to come back (429), as while a cache
        // initializes, rather than passed through to stay on the apiserver.
        Err(NotServed::Delegate(router::NOT_CACHED))
            if info.verb == "watch"
                && state.caches.discovering(&info.api_group, &info.resource) =>
        {
            let bound = state.watch.wait_for_rv;
            if !Box::pin(
                state
                    .caches
                    .wait_discovered(&info.api_group, &info.resource, bound),
            )
            .await
            {
                return Err(crate::read::initializing(bound).into());
            }
            route(state)?
        }
        r => r?,
    };
    let namespaced = route.cache().resource.namespaced;
    // Each step's future is boxed while it runs: this future then holds one pointer per
    // step instead of the largest of them (it was 44 KB, allocated for every cache-served
    // request, and 2,000 watch requests waiting together for one access review held 96 MB
    // of them).
    let (id, view) = Box::pin(authenticate_and_authorize(
        state, conn, caller, req, info, namespaced,
    ))
    .await?;
    // Tenant quotas (`tenancy`); the unnamed tenant has none.
    let tenant = state.tenancy.get(&id.tenant);
    let mut permit = None;
    if let Some(t) = tenant {
        match &route {
            Route::Watch { .. } => permit = t.admit_watch()?,
            _ => {
                t.admit_read()?;
                caller.read_charged = true;
            }
        }
    }
    match route {
        Route::Watch {
            cache,
            params,
            mut filter,
            enc,
            protobuf,
            table,
        } => {
            if table.is_some() {
                Box::pin(table_synced(&cache, state.watch.wait_for_rv)).await?;
            }
            // The field filter header, validated now that the caller is authenticated and
            // authorized (kube-apiserver's order: 401, 403, then 400 for a bad request).
            let watch_fields = match watch_fields {
                Some(Err(e)) => {
                    state.metrics.reject("watch_fields");
                    return Err(Status::bad_request(e).into());
                }
                Some(Ok(f)) => Some(f),
                None => None,
            };
            // While the cache or its protobuf side initializes: a bounded wait, then 429
            // (the client comes back), rather than a watch that stays on the apiserver.
            let latest = params.resource_version.as_deref().unwrap_or("").is_empty();
            Box::pin(crate::read::initialized(
                &cache,
                protobuf,
                latest,
                state.watch.wait_for_rv,
            ))
            .await?;
            if latest && cache.unhealthy().is_some() {
                return delegate(router::UNCONFIRMED_LATEST_WATCH);
            }
            // Most recent state (a watch or WatchList without resourceVersion): only once the
            // consistency policy confirms the cache.
            if latest
                && let Err(not) = Box::pin(
                    state
                        .consistency
                        .latest(&cache, consistency_mode(state, &cache)),
                )
                .await
            {
                // The apiserver is unreachable: a watch gets 429, not 503
                // (`read::watch_unreachable`).
                return Err(match not {
                    NotServed::Refuse(s) if s.code() == 503 => NotServed::Refuse(Box::new(
                        crate::read::watch_unreachable(s.message().to_string()),
                    )),
                    other => other,
                });
            }
            // The opt-in field-level change filter is served for JSON watches only (its
            // protobuf form is not built yet): the apiserver answers, unfiltered, as before.
            if protobuf && watch_fields.is_some() {
                return delegate("field-level change filter in protobuf");
            }
            if table.is_some() && watch_fields.is_some() {
                return delegate("field-level change filter in a Table");
            }
            let table = table.map(|form| crate::read::table::TableWatch::new(cache.clone(), form));
            filter.namespaces = view.clone();
            // A filter joins the resource's distinct filters within `cache.watchFields`
            // (`watch_fields::Registry`), held as long as the stream.
            let lease = match &watch_fields {
                Some(f) => Some(admit_watch_fields(state, &cache, f, &id)?),
                None => None,
            };
            filter.changes = watch_fields;
            let resp = Box::pin(crate::telemetry::in_span(
                "cache.watch",
                crate::read::watch::serve(
                    cache,
                    params,
                    filter,
                    enc,
                    protobuf,
                    &state.watch,
                    state.drain.clone(),
                ),
            ))
            .await?;
            // The tenant's watch slot is held as long as the stream.
            let (parts, mut b) = resp.into_parts();
            if let Some(t) = table
                && parts.status.is_success()
            {
                t.count_served();
                b = crate::read::table::watch_body(b, t);
            }
            // A filtered view is re-derived while the watch is open (`tenancy::ViewWatch`).
            if let Some(view) = view
                && parts.status.is_success()
            {
                b = crate::tenancy::ViewWatch {
                    tenancy: state.tenancy.clone(),
                    authz: state.authz.clone(),
                    caches: state.caches.clone(),
                    id: id.clone(),
                    attrs: authz_attributes(info, query),
                    view,
                    protobuf,
                }
                .guard(b);
            }
            if let Some(p) = permit {
                b.on_end(move || drop(p));
            }
            if let Some(l) = lease {
                b.on_end(move || drop(l));
            }
            Ok(Response::from_parts(parts, b))
        }
        Route::Get {
            cache,
            enc,
            protobuf,
            table,
            at,
        } => {
            if table.is_some() {
                Box::pin(table_synced(&cache, state.lists.wait_for_rv)).await?;
            }
            let snap = match at {
                ReadAt::Latest => {
                    Box::pin(
                        state
                            .consistency
                            .latest(&cache, consistency_mode(state, &cache)),
                    )
                    .await?
                }
                _ => cache.current(),
            };
            if let Some(form) = table {
                let bound = state.lists.wait_for_rv;
                return Box::pin(crate::telemetry::in_span(
                    "cache.get",
                    crate::read::list::get_table(
                        &cache,
                        &snap,
                        &info.namespace,
                        &info.name,
                        form,
                        bound,
                    ),
                ))
                .await;
            }
            crate::telemetry::in_span("cache.get", async {
                crate::read::list::get(&cache, &snap, &info.namespace, &info.name, enc, protobuf)
            })
            .await
        }
        Route::List {
            cache,
            mut filter,
            enc,
            protobuf,
            table,
            params,
        } => {
            if table.is_some() {
                Box::pin(table_synced(&cache, state.lists.wait_for_rv)).await?;
            }
            // While the cache or its protobuf side initializes (a list the apiserver's
            // cacher would not delegate): a bounded wait, then 429.
            Box::pin(crate::read::initialized(
                &cache,
                protobuf,
                false,
                state.lists.wait_for_rv,
            ))
            .await?;
            filter.namespaces = view;
            if let Some(t) = tenant
                && t.config.quotas.max_list_objects.is_some()
                && !has_limit(query)
            {
                let n = cache
                    .current()
                    .objects
                    .values()
                    .filter(|o| filter.matches(o))
                    .count();
                t.admit_list_size(n)?;
            }
            let latest = if params.rv == Rv::Unset && params.continue_.is_none() {
                Box::pin(
                    state
                        .consistency
                        .latest(&cache, consistency_mode(state, &cache)),
                )
                .await
            } else {
                delegate("not a most-recent list")
            };
            let cx = crate::read::list::ListContext {
                cfg: &state.lists,
                keys: &state.keys,
                binding: list_binding(&id, info, &params, filter.namespaces.as_deref()),
                accepts_gzip: accepts_gzip(req.headers()),
                page_cap: state.paging.downstream_cap().map(|c| c as u64),
                upstream: Some(&state.consistency),
                protobuf,
                table,
            };
            Box::pin(crate::telemetry::in_span(
                "cache.list",
                crate::read::list::list(&cache, &filter, enc, &params, &cx, latest),
            ))
            .await
        }
    }
}

/// A Table read while the resource's table side starts (its first Table reader started it):
/// a bounded wait for it to sync, then the apiserver answers (counted as passed through).
async fn table_synced(
    cache: &crate::cache::ResourceCache,
    bound: std::time::Duration,
) -> Served<()> {
    let t = &cache.table;
    if t.ready() || t.wait_until(bound, || t.ready()).await {
        return Ok(());
    }
    t.stats
        .passed_through
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    delegate(t.not_ready_reason().unwrap_or(router::TABLE))
}

/// A watch's `X-Kube-Cache-Proxy-Watch-Fields`, parsed when the request comes and refused
/// (400, the error) only after authentication and authorization: on the cache path once the
/// caller is authorized, on the apiserver's path once it answered 2xx.
type ParsedWatchFields = Result<Arc<WatchFields>, String>;

/// Admits a watch's field filter among its resource's distinct filters, or refuses it.
///
/// Beyond the bound: 429 TooManyRequests with Retry-After, not 400 or 403. The request is
/// well formed and the caller may watch (both already checked); what it asks is refused for
/// the load it would add while other watches hold the room, and the room comes back as those
/// end — the apiserver's own answer to "too much at once" (max-in-flight, priority and
/// fairness) is 429, and client-go's reflector retries a 429 with backoff instead of failing
/// the informer, as it does for a cache that initializes. A 403 would tell the client it may
/// not watch, which is false, and a 400 that the request is wrong, which it is not (the same
/// header is admitted once the load is gone).
fn admit_watch_fields(
    state: &State,
    cache: &crate::cache::store::ResourceCache,
    f: &Arc<WatchFields>,
    id: &crate::auth::authn::Identity,
) -> Result<crate::k8s::watch_fields::Lease, NotServed> {
    let owner = if id.tenant.is_empty() {
        id.user.clone()
    } else {
        format!("{}/{}", id.tenant, id.user)
    };
    let c = &state.config.cache.watch_fields;
    let limits = crate::k8s::watch_fields::Limits {
        per_resource: c.max_filters_per_resource,
        per_identity: c.max_filters_per_identity,
    };
    cache
        .hub
        .change_filters
        .admit(f, &owner, limits)
        .map_err(|e| {
            state.metrics.reject("watch_fields_limit");
            NotServed::Refuse(Box::new(
                Status::failure(
                    StatusCode::TOO_MANY_REQUESTS,
                    Reason::TooManyRequests,
                    e.to_string(),
                )
                .with_retry_after(10),
            ))
        })
}

/// Authentication and authorization of a cache-served request (`authn`, `authz`): the
/// identity and, for a tenant's filtered cluster view, its namespace set; a 401/403/503
/// refusal; or the apiserver decides (impersonation requests, which the apiserver or
/// [`impersonation_gate`] authorize). A cluster-wide list/watch RBAC denies may still be
/// served as the tenant's filtered view.
async fn authenticate_and_authorize(
    state: &State,
    conn: &ConnInfo,
    caller: &mut Caller,
    req: &Request<Incoming>,
    info: &RequestInfo,
    namespaced: bool,
) -> Served<AuthorizedView> {
    use crate::auth::authn::Outcome;
    use crate::auth::authz::Decision;
    if has_impersonation(req.headers()) {
        return delegate("impersonation");
    }
    let id = match caller.authenticate(state, conn, req.headers()).await {
        Outcome::Authenticated(id, _) => id.clone(),
        Outcome::Unauthorized => return Err(Status::unauthorized().into()),
        Outcome::Unavailable(e) => {
            let msg = format!("authentication is unavailable: {e}");
            return Err(Status::service_unavailable(msg, 1).into());
        }
    };
    let attrs = authz_attributes(info, req.uri().query());
    match state.authz.authorize(&id, &attrs).await {
        Decision::Allow => Ok((id, None)),
        Decision::Deny(reason) => {
            let ns_cache = state.caches.get("", "v1", "namespaces");
            let view = state
                .tenancy
                .filtered_view(&state.authz, ns_cache.as_deref(), &id, &attrs, namespaced)
                .await;
            match view {
                Some(set) => Ok((id, Some(set))),
                None => Err(crate::auth::authz::forbidden(&id, &attrs, &reason).into()),
            }
        }
        Decision::Error(e) => {
            let msg = format!("authorization is unavailable: {e}");
            Err(Status::service_unavailable(msg, 1).into())
        }
    }
}

/// The attributes a cache-served request is authorized with.
fn authz_attributes(info: &RequestInfo, query: Option<&str>) -> crate::auth::authz::Attributes {
    // The apiserver hands a list or watch's selectors to its authorizers.
    let selector = |key| {
        matches!(info.verb.as_str(), "list" | "watch" | "deletecollection")
            .then(|| request_info::query_param(query, key))
            .flatten()
            .unwrap_or_default()
    };
    crate::auth::authz::Attributes {
        field_selector: selector("fieldSelector"),
        label_selector: selector("labelSelector"),
        verb: info.verb.clone(),
        path: String::new(),
        group: info.api_group.clone(),
        version: info.api_version.clone(),
        resource: info.resource.clone(),
        subresource: info.subresource.clone(),
        namespace: info.namespace.clone(),
        name: info.name.clone(),
    }
}

type AuthorizedView = (
    Arc<crate::auth::authn::Identity>,
    Option<Arc<std::collections::BTreeSet<String>>>,
);

/// Whether a list asks for pages (`limit` > 0).
fn has_limit(query: Option<&str>) -> bool {
    request_info::query_param(query, "limit")
        .and_then(|v| v.parse::<i64>().ok())
        .is_some_and(|n| n > 0)
}

fn has_impersonation(h: &http::HeaderMap) -> bool {
    h.keys().any(|k| k.as_str().starts_with("impersonate-"))
}

/// Whether [`impersonation_gate`] has anything to do: a client-certificate caller sending
/// `Impersonate-*` headers.
fn needs_impersonation_gate(conn: &ConnInfo, req: &Request<Incoming>) -> bool {
    conn.cert.is_some() && has_impersonation(req.headers())
}

/// A client-certificate caller's `Impersonate-*` headers, authorized as the apiserver's
/// impersonation filter would (its requests travel with the proxy's credentials, so the
/// apiserver cannot): `Err` is the refusal; `Ok(Some(conn))` the connection info to pass
/// through as the impersonated user; `Ok(None)` nothing to do.
async fn impersonation_gate(
    state: &State,
    conn: &ConnInfo,
    caller: &mut Caller,
    req: &Request<Incoming>,
) -> Result<Option<ConnInfo>, Response<Body>> {
    if !needs_impersonation_gate(conn, req) {
        return Ok(None);
    }
    let id = match caller.authenticate(state, conn, req.headers()).await {
        crate::auth::authn::Outcome::Authenticated(id, _) => id.clone(),
        _ => return Err(Status::unauthorized().into_response()),
    };
    match state.authz.impersonate(&id, req.headers()).await {
        Ok(Some(target)) => Ok(Some(ConnInfo {
            peer: conn.peer,
            // Everything that was checked goes up: user, groups, uid and extra.
            cert: Some(Arc::new(CertIdentity {
                user: target.user,
                groups: target
                    .groups
                    .into_iter()
                    .filter(|g| g != "system:authenticated")
                    .collect(),
                uid: target.uid,
                extra: target.extra,
            })),
        })),
        Ok(None) => Ok(None),
        Err(status) => Err(status.into_response()),
    }
}

/// Passes a request through as `forward_as`, within the tenant quotas of the caller on `conn`
/// when the proxy can name it ([`crate::tenancy::Tenancy::admit_passthrough`]); a watch holds
/// its slot until the stream ends. The second value is the `served_by` label.
async fn forward_within_quota(
    state: &State,
    conn: &ConnInfo,
    caller: &mut Caller,
    forward_as: &ConnInfo,
    req: Request<Incoming>,
    info: &RequestInfo,
    long_running: bool,
) -> (Response<Body>, &'static str) {
    let mut permit = None;
    if state.tenancy.charges_passthrough(info, caller.read_charged)
        && let Some(id) = caller.identify(state, conn, req.headers()).await
    {
        match state.tenancy.admit_passthrough(&id, info) {
            Ok(p) => permit = p,
            Err(refusal) => return (Status::from(refusal).into_response(), "proxy"),
        }
    }
    let resp = passthrough::forward(state, forward_as, req, info, long_running).await;
    let Some(permit) = permit else {
        return (resp, "upstream");
    };
    let (parts, mut b) = resp.into_parts();
    b.on_end(move || drop(permit));
    (Response::from_parts(parts, b), "upstream")
}

/// A successful write to a cached resource: remembers the resourceVersion it produced, so
/// later unset-resourceVersion reads through this proxy wait until the cache reflects it
/// (read-your-writes in the bounded consistency mode). The response of a write is one object;
/// up to [`RYW_BUFFER`] of it is buffered to read that number in any encoding the apiserver
/// writes objects in (JSON, protobuf), then sent on unchanged. A write whose number cannot be
/// read (a Status, another encoding, a compressed or larger body, a delete of a collection)
/// makes the next reads of the resource confirm the cache with an upstream probe instead
/// ([`crate::read::consistency::Consistency::record_unknown_write`]): never a stale read after
/// the caller's own write.
async fn read_your_writes(
    state: &State,
    info: &RequestInfo,
    resp: Response<Body>,
) -> Response<Body> {
    if !matches!(
        info.verb.as_str(),
        "create" | "update" | "patch" | "delete" | "deletecollection"
    ) || !resp.status().is_success()
        // Streams to and from a pod, node or service, and ServiceAccount tokens: not writes
        // of the object.
        || matches!(
            info.subresource.as_str(),
            "proxy" | "exec" | "attach" | "portforward" | "token"
        )
    {
        return resp;
    }
    let Some(cache) = state
        .caches
        .get(&info.api_group, &info.api_version, &info.resource)
    else {
        return resp;
    };
    let resource = cache.resource.label();
    let unknown = || state.consistency.record_unknown_write(&resource);
    let length = resp
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if info.verb == "deletecollection"
        || resp.headers().contains_key(header::CONTENT_ENCODING)
        || length.is_some_and(|n| n > RYW_BUFFER)
    {
        unknown();
        return resp;
    }
    let content_type = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (parts, mut body) = resp.into_parts();
    let mut buf = bytes::BytesMut::new();
    loop {
        match http_body_util::BodyExt::frame(&mut body).await {
            None => break,
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    buf.extend_from_slice(data);
                }
                if buf.len() > RYW_BUFFER {
                    // Larger than any object: relay what was read and the rest as it comes.
                    unknown();
                    let head = futures_util::stream::once(std::future::ready(Ok(
                        hyper::body::Frame::data(buf.freeze()),
                    )));
                    let rest = http_body_util::BodyStream::new(body);
                    let chained =
                        http_body_util::StreamBody::new(futures_util::StreamExt::chain(head, rest));
                    return Response::from_parts(parts, body::boxed(chained));
                }
            }
            Some(Err(e)) => {
                return Status::failure(
                    StatusCode::BAD_GATEWAY,
                    Reason::InternalError,
                    format!("the apiserver's response to the write broke off: {e}"),
                )
                .into_response();
            }
        }
    }
    let b = buf.freeze();
    match crate::read::consistency::response_rv(content_type.as_deref(), &b) {
        Some(rv) => state.consistency.record_write(&resource, rv),
        None => unknown(),
    }
    Response::from_parts(parts, body::full(b))
}

/// The most of a write's response read for its resourceVersion (see [`read_your_writes`]).
const RYW_BUFFER: usize = 1 << 20;

/// The consistency mode configured for a resource.
fn consistency_mode(
    state: &State,
    cache: &crate::cache::ResourceCache,
) -> crate::read::consistency::Mode {
    let l = &state.config.lists;
    l.consistency_by_resource
        .get(&cache.resource.label())
        .copied()
        .unwrap_or(l.consistency)
}

/// What a continue token is bound to: the caller's tenant and verified identity
/// (`authn::Identity::identity_hash`), the resource, the namespace, the selectors and, for a
/// filtered cluster view, the hash of its namespace set (a walk whose view changed between
/// pages is refused instead of mixing two views).
fn list_binding(
    id: &crate::auth::authn::Identity,
    info: &RequestInfo,
    p: &crate::read::plan::ListParams,
    view: Option<&std::collections::BTreeSet<String>>,
) -> crate::read::token::Binding {
    let identity = id.identity_hash();
    let tenant = id.tenant.as_str();
    let view = view.map(crate::tenancy::view_hash);
    let mut parts: Vec<&[u8]> = vec![
        tenant.as_bytes(),
        &identity,
        info.api_group.as_bytes(),
        info.api_version.as_bytes(),
        info.resource.as_bytes(),
        info.namespace.as_bytes(),
        p.label_selector.as_bytes(),
        p.field_selector.as_bytes(),
    ];
    // Unfiltered lists keep their binding (tokens stay valid across an upgrade).
    if let Some(v) = &view {
        parts.push(v);
    }
    crate::read::token::Binding::new(&parts)
}

/// Whether `Accept-Encoding` allows gzip (`gzip;q=0` does not).
fn accepts_gzip(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|item| {
            let mut parts = item.split(';').map(str::trim);
            let coding = parts.next().unwrap_or("");
            let q_zero = parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q == 0.0)
            });
            (coding.eq_ignore_ascii_case("gzip") || coding == "*") && !q_zero
        })
}

const AUDIT_ID: header::HeaderName = header::HeaderName::from_static("audit-id");

/// The headers kube-apiserver's filters add to every response: `Audit-Id` (the caller's own,
/// echoed, else a fresh UUID) and `Cache-Control: no-cache, private` unless set.
fn stamp_apiserver_headers(audit_id: Option<&http::HeaderValue>, h: &mut http::HeaderMap) {
    if !h.contains_key(AUDIT_ID) {
        let id = match audit_id.filter(|v| !v.is_empty()) {
            Some(v) => v.clone(),
            None => http::HeaderValue::try_from(uuid::Uuid::new_v4().to_string())
                .unwrap_or(http::HeaderValue::from_static("")),
        };
        h.insert(AUDIT_ID, id);
    }
    h.entry(header::CACHE_CONTROL)
        .or_insert(http::HeaderValue::from_static("no-cache, private"));
}

/// A request span's name, as kube-apiserver's (`GET /api/v1/namespaces/{:namespace}/pods`):
/// the route with names left out, so names do not multiply span names; the method alone
/// for a non-resource request.
fn span_name(method: &Method, info: &RequestInfo) -> String {
    if !info.is_resource_request {
        return method.to_string();
    }
    let mut s = format!("{method} ");
    if info.api_group.is_empty() {
        s.push_str("/api");
    } else {
        s.push_str("/apis/");
        s.push_str(&info.api_group);
    }
    s.push('/');
    s.push_str(&info.api_version);
    if !info.namespace.is_empty() {
        s.push_str("/namespaces/{:namespace}");
    }
    s.push('/');
    s.push_str(&info.resource);
    if !info.name.is_empty() {
        s.push_str("/{:name}");
    }
    if !info.subresource.is_empty() {
        s.push('/');
        s.push_str(&info.subresource);
    }
    s
}

/// A request span's attributes: what kube-apiserver's span records (method, target, user
/// agent) and the request's Kubernetes attributes. No credentials, no user names.
fn span_attrs(
    req: &Request<Incoming>,
    method: &Method,
    info: &RequestInfo,
    verb: &str,
) -> Vec<crate::telemetry::Attr> {
    use crate::telemetry::Attr;
    let mut a = vec![
        Attr::new("http.request.method", method.to_string()),
        Attr::new(
            "http.target",
            req.uri()
                .path_and_query()
                .map_or_else(|| req.uri().path().to_string(), |pq| pq.to_string()),
        ),
        Attr::new("kcp.verb", verb.to_string()),
    ];
    if let Some(ua) = req
        .headers()
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
    {
        a.push(Attr::new("user_agent.original", ua.to_string()));
    }
    if info.is_resource_request {
        a.push(Attr::new("http.route", span_name(method, info)));
        let resource = if info.subresource.is_empty() {
            info.resource.clone()
        } else {
            format!("{}/{}", info.resource, info.subresource)
        };
        a.push(Attr::new("kcp.resource", resource));
        if !info.api_group.is_empty() {
            a.push(Attr::new("kcp.group", info.api_group.clone()));
        }
        if !info.namespace.is_empty() {
            a.push(Attr::new("k8s.namespace.name", info.namespace.clone()));
        }
    }
    a
}

/// Sum of header name and value lengths, as Go's `MaxHeaderBytes` roughly counts them.
fn header_bytes(req: &Request<Incoming>) -> usize {
    req.headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum::<usize>()
        + req.uri().to_string().len()
}

/// The entry point of every request on the API port: hygiene checks, cache or passthrough,
/// and the request's metrics and log line.
pub async fn handle(state: &State, conn: &ConnInfo, req: Request<Incoming>) -> Response<Body> {
    let start = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);

    let audit_id = req.headers().get(AUDIT_ID).cloned();
    // A Table read (`kubectl get`): its JSON answer is a Table in the per-encoding metrics.
    let asks_table = req
        .headers()
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("as=Table"));
    // The access-log line, when this request is sampled (`serve::access`). Boxed: the entry
    // lives as long as the response body (a watch's whole stream), and unboxed its ~270 bytes
    // were part of every stream's body even when nothing is logged (docs/architecture.md,
    // "Memory of an idle watch stream").
    let mut access = crate::serve::access::sampled(&state.config.log).then(|| {
        Box::new(crate::serve::access::Entry {
            method: method.to_string(),
            path: req
                .uri()
                .path_and_query()
                .map_or_else(|| path.clone(), |pq| pq.to_string()),
            user_agent: crate::serve::access::header(req.headers(), header::USER_AGENT),
            peer: conn.peer,
            ..Default::default()
        })
    });
    // Refusals before routing (bad path, CONNECT, oversized headers) log here.
    let refuse = |status: Status| {
        let mut r = status.into_response();
        stamp_apiserver_headers(audit_id.as_ref(), r.headers_mut());
        if let Some(a) = &access {
            let mut a = a.clone();
            a.code = r.status().as_u16();
            a.served_by = "proxy";
            a.audit_id = crate::serve::access::header(r.headers(), AUDIT_ID);
            let bytes = http_body::Body::size_hint(r.body()).exact().unwrap_or(0);
            a.emit(bytes, start.elapsed());
        }
        r
    };
    // Routed and authorized by the decoded path, as the apiserver does; the raw one is what
    // passes through.
    let decoded = match request_info::validate_path(&path) {
        Ok(d) => d.into_owned(),
        Err(e) => {
            state.metrics.reject("bad_path");
            return refuse(Status::bad_request(format!("invalid request path: {e}")));
        }
    };
    // The HTTP CONNECT method (a tunnel, not the `connect` verb of exec/attach/proxy, which
    // are GET/POST upgrades): kube-apiserver has no handler for it.
    if method == Method::CONNECT {
        state.metrics.reject("method");
        return refuse(Status::failure(
            StatusCode::METHOD_NOT_ALLOWED,
            Reason::MethodNotAllowed,
            "the CONNECT method is not supported".to_string(),
        ));
    }
    if header_bytes(&req) > state.config.server.max_header_bytes {
        state.metrics.reject("headers_too_large");
        return refuse(Status::failure(
            StatusCode::from_u16(431).unwrap_or(StatusCode::BAD_REQUEST),
            Reason::Unknown,
            format!(
                "request headers exceed the limit of {} bytes",
                state.config.server.max_header_bytes
            ),
        ));
    }

    // No local endpoints: the API port is the apiserver's whole surface (`/metrics`, health,
    // `/version`, `/openapi`, `/debug` included). The proxy's own are on the admin listener
    // (`serve::admin`).

    let info = RequestInfo::parse(&method, &decoded, query.as_deref());
    // The opt-in field-level change filter of a watch (`k8s::watch_fields`): validated for
    // every watch, applied by the cache; a watch the apiserver answers is told it is not. A
    // malformed one is refused only once the caller is authenticated and authorized (as any
    // apiserver: 401 and 403 before 400), so it is parsed here and refused later.
    let watch_fields: Option<ParsedWatchFields> = match req.headers().get(watch_fields::HEADER) {
        Some(v) if info.verb == "watch" => Some(
            v.to_str()
                .map_err(|_| format!("{}: not ASCII", watch_fields::HEADER))
                .and_then(WatchFields::parse)
                .map(Arc::new),
        ),
        _ => None,
    };
    // On the apiserver's path the apiserver authenticates and authorizes: a malformed header
    // is refused once it has answered 2xx (its stream is dropped unread).
    let malformed = |resp: Response<Body>, by: &'static str| match &watch_fields {
        Some(Err(e)) if resp.status().is_success() => {
            drop(resp);
            state.metrics.reject("watch_fields");
            (Status::bad_request(e.clone()).into_response(), "proxy")
        }
        _ => (resp, by),
    };
    // A watch that arrives while this proxy drains (on a connection opened before) would be
    // ended at once, which client-go takes for a failed watch ("very short watch") and, in
    // WatchList mode, answers with a new streaming list. As kube-apiserver with
    // `--shutdown-send-retry-after`: 429 with Retry-After, which client-go retries (on
    // another connection, so another replica) without relisting.
    if info.verb == "watch" && state.drain.is_cancelled() {
        state.metrics.reject("draining");
        return refuse(
            Status::failure(
                http::StatusCode::TOO_MANY_REQUESTS,
                crate::k8s::status::Reason::TooManyRequests,
                "The proxy is shutting down, please try again later.",
            )
            .with_retry_after(1),
        );
    }
    let upgrade = crate::auth::identity::upgrade_protocol(req.headers()).is_some();
    let long_running = info.is_long_running(query.as_deref(), upgrade);
    let verb = info.metrics_verb(&method, content_type.as_deref(), upgrade);
    let kind = if upgrade {
        "upgrade"
    } else if info.verb == "watch" {
        "watch"
    } else if matches!(method, Method::GET | Method::HEAD | Method::OPTIONS) {
        "readOnly"
    } else {
        "mutating"
    };
    let inflight = state
        .metrics
        .inflight
        .get_or_create(&KindLabels { kind: kind.into() })
        .clone();
    inflight.inc();

    // The request's span (`telemetry`; `None` when tracing is off), a child of the caller's
    // when its `traceparent` is valid. It ends when the response body does.
    let telemetry = state.upstream.telemetry();
    let traced = telemetry
        .is_on()
        .then(|| {
            telemetry.server_span(
                req.headers(),
                span_name(&method, &info),
                span_attrs(&req, &method, &info, &verb),
            )
        })
        .flatten();

    // Authenticated at most once, by whichever step needs it first.
    let mut caller = Caller::default();
    let logged = access.is_some();
    // A refusal the proxy wrote on the cache path (the access log's `served_by=proxy`; the
    // metrics keep `cache`).
    let mut refused = false;
    // Each branch's future is boxed: this future then holds only the one a request takes,
    // not the largest of them (it was 6.8 KB for every request, watches included, and a burst
    // of thousands of watch requests held that many at once).
    let work = async {
        // Only a client-certificate caller's impersonation goes through the gate: its future
        // (about 24 KB, an authentication and an access review inside) is not allocated for
        // every request.
        let gate = if needs_impersonation_gate(conn, &req) {
            Box::pin(impersonation_gate(state, conn, &mut caller, &req)).await
        } else {
            Ok(None)
        };
        match gate {
            Err(refused) => (refused, "proxy"),
            Ok(Some(as_target)) => {
                let (resp, by) = Box::pin(forward_within_quota(
                    state,
                    conn,
                    &mut caller,
                    &as_target,
                    req,
                    &info,
                    long_running,
                ))
                .await;
                malformed(resp, by)
            }
            Ok(None) => match Box::pin(serve_from_cache(
                state,
                conn,
                &mut caller,
                &req,
                &info,
                query.as_deref(),
                watch_fields.clone(),
            ))
            .await
            {
                Ok(r) => (r, "cache"),
                // A refusal decided on the cache path (401, 403, 429, 400 for a bad continue
                // token, ...): the only place the pipeline turns a `Status` into a response.
                Err(NotServed::Refuse(status)) => {
                    refused = true;
                    (status.into_response(), "cache")
                }
                Err(NotServed::Delegate(why))
                    if crate::read::needs_newer_state(why)
                        && let Some(o) = state.upstream.reachability().outage() =>
                {
                    // Only the apiserver has what this read needs, and it cannot be reached.
                    refused = true;
                    let status = crate::read::unreachable(&o);
                    let status = if info.verb == "watch" {
                        crate::read::watch_unreachable(status.message().to_string())
                    } else {
                        status
                    };
                    (status.into_response(), "cache")
                }
                Err(NotServed::Delegate(why)) => {
                    let read = info.is_resource_request
                        && matches!(info.verb.as_str(), "get" | "list" | "watch");
                    if read {
                        tracing::trace!(reason = why, path = %path, "passthrough");
                    }
                    // A watch passed through only because the cache could not serve it yet
                    // is ended cleanly once it can (`homing`).
                    let homing = crate::serve::homing::Homing::new(
                        state,
                        &info,
                        query.as_deref(),
                        req.headers(),
                        why,
                    );
                    // The access log names a passed-through request's caller when the
                    // proxy can identify it without asking the apiserver (remembered: the
                    // tenant quota's charge asks the same).
                    if logged {
                        caller.identify(state, conn, req.headers()).await;
                    }
                    let (resp, by) = Box::pin(forward_within_quota(
                        state,
                        conn,
                        &mut caller,
                        conn,
                        req,
                        &info,
                        long_running,
                    ))
                    .await;
                    let (resp, by) = malformed(resp, by);
                    // Counted once the answer shows whether the resource exists (its label).
                    let mut resp = resp;
                    if read {
                        let labels = state.metrics.resources.labels(
                            &info.api_group,
                            &info.api_version,
                            &info.resource,
                            &info.subresource,
                            by == "upstream"
                                && crate::metrics::KnownResources::shows_served(resp.status()),
                        );
                        let labels = crate::metrics::PassthroughLabels {
                            verb: info.verb.clone(),
                            resource: labels.resource,
                            reason: why.into(),
                        };
                        state.metrics.passthrough.get_or_create(&labels).inc();
                        // A watch the apiserver serves stays there as long as its stream:
                        // counted while it is open.
                        if info.verb == "watch" && resp.status().is_success() {
                            let open = state
                                .metrics
                                .passthrough_watches
                                .get_or_create(&labels)
                                .clone();
                            open.inc();
                            let (parts, mut b) = resp.into_parts();
                            b.on_end(move || {
                                open.dec();
                            });
                            resp = Response::from_parts(parts, b);
                            if let Some(h) = homing
                                && by == "upstream"
                            {
                                resp = h.wrap(resp, labels);
                            }
                        }
                    }
                    (Box::pin(read_your_writes(state, &info, resp)).await, by)
                }
            },
        }
    };
    let (resp, served_by) = match &traced {
        Some(t) => t.run(work).await,
        None => work.await,
    };

    // What the apiserver's filter chain puts on every response it writes itself
    // (WithAuditInit, WithCacheControl); passed-through responses carry the apiserver's own.
    let mut resp = resp;
    if served_by != "upstream" {
        stamp_apiserver_headers(audit_id.as_ref(), resp.headers_mut());
    }
    // Served from memory while the apiserver cannot be reached: say so, as the apiserver
    // says what a client should know about its answer (client-go logs warnings).
    if served_by == "cache"
        && resp.status().is_success()
        && let Some(o) = state.upstream.reachability().outage()
        && let Ok(v) = http::HeaderValue::from_str(&o.warning())
    {
        resp.headers_mut().append(header::WARNING, v);
        state.metrics.degraded_reads.inc();
    }
    if matches!(watch_fields, Some(Ok(_))) && resp.status().is_success() {
        let applied = if served_by == "cache" {
            "applied"
        } else {
            "unfiltered"
        };
        resp.headers_mut().insert(
            watch_fields::APPLIED_HEADER,
            http::HeaderValue::from_static(applied),
        );
    }
    let code = resp.status();
    let labels = state.metrics.resources.labels(
        &info.api_group,
        &info.api_version,
        &info.resource,
        &info.subresource,
        served_by == "cache"
            || (served_by == "upstream" && crate::metrics::KnownResources::shows_served(code)),
    );
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            verb: verb.clone(),
            group: labels.group.clone(),
            version: labels.version.clone(),
            resource: labels.resource.clone(),
            subresource: labels.subresource.clone(),
            scope: info.metrics_scope().into(),
            code: code.as_str().into(),
            served_by: served_by.into(),
        })
        .inc();
    if let Some(a) = access.as_mut() {
        a.verb = verb.clone();
        a.resource = if info.subresource.is_empty() {
            info.resource.clone()
        } else {
            format!("{}/{}", info.resource, info.subresource)
        };
        a.namespace = info.namespace.clone();
        a.code = code.as_u16();
        if let Some(Err(_)) = &watch_fields {
            a.watch_fields = Some("invalid refused".into());
        }
        if let Some(Ok(f)) = &watch_fields {
            let applied = resp
                .headers()
                .get(watch_fields::APPLIED_HEADER)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("refused");
            a.watch_fields = Some(format!("{} {applied}", f.canonical()));
        }
        a.served_by = match served_by {
            "cache" if refused => "proxy",
            "upstream" => "apiserver",
            other => other,
        };
        a.audit_id = crate::serve::access::header(resp.headers(), AUDIT_ID);
        // A passed-through request's caller as the proxy identified it (token file, a
        // verdict it holds, a ServiceAccount JWT it verified, a client certificate), unless
        // the apiserver refused the credentials.
        let known = caller
            .known(served_by == "upstream" && code == StatusCode::UNAUTHORIZED)
            .map(|id| (id.user.clone(), id.groups.len()))
            .or_else(|| conn.cert.as_ref().map(|c| (c.user.clone(), c.groups.len())));
        if let Some((user, groups)) = known {
            a.user = Some(user);
            a.groups = groups;
        }
    }
    let scope = info.metrics_scope().to_string();
    let paging = (verb == "LIST").then(|| state.paging.clone());
    let (hist_verb, hist_resource) = (verb.clone(), labels.resource.clone());
    // A long-running request's duration is its stream's lifetime (a watch's timeoutSeconds,
    // an exec session), not a latency: not observed (`crate::metrics::observes_duration`).
    let hist = crate::metrics::observes_duration(&verb).then(|| {
        state
            .metrics
            .request_duration
            .get_or_create(&DurationLabels {
                verb,
                group: labels.group,
                version: labels.version,
                resource: labels.resource,
                subresource: labels.subresource,
                scope,
                served_by: served_by.into(),
            })
            .clone()
    });
    let encoding = match EncodingLabels::encoding_of(resp.headers().get(header::CONTENT_TYPE)) {
        "json" if asks_table && resp.status().is_success() => "table",
        e => e,
    };
    let enc = EncodingLabels {
        verb: hist_verb,
        resource: hist_resource,
        encoding: encoding.into(),
        served_by: served_by.into(),
    };
    state.metrics.responses.get_or_create(&enc).inc();
    let bytes_metric = state.metrics.response_bytes.get_or_create(&enc).clone();
    let (parts, mut b) = resp.into_parts();
    // Only for a request the access log writes.
    let sent = access
        .is_some()
        .then(|| Arc::new(std::sync::atomic::AtomicU64::new(0)));
    // Held inline by the body (`http::body::Body`), not a wrapper around it: a box each
    // cost every watch frame a pointer chase and every open stream an allocation.
    b.count_into(bytes_metric, sent.clone());
    if let Some(t) = &traced {
        t.set(crate::telemetry::Attr::new(
            "kcp.served_by",
            match served_by {
                "cache" if refused => "proxy",
                "upstream" => "apiserver",
                other => other,
            },
        ));
    }
    b.on_end(move || {
        if let Some(t) = traced {
            t.end_with_status(code.as_u16());
        }
        if let Some(h) = &hist {
            h.observe(start.elapsed().as_secs_f64());
        }
        if let Some(p) = &paging {
            p.record_list(start.elapsed());
        }
        inflight.dec();
        if let Some(a) = access {
            let sent = sent.map_or(0, |s| s.load(std::sync::atomic::Ordering::Relaxed));
            a.emit(sent, start.elapsed());
        }
    });
    Response::from_parts(parts, b)
}
