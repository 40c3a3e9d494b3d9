//! Listeners, connections and the per-request entry point.
//!
//! [`run`] serves until its `shutdown` future completes, then drains: readiness fails at once,
//! listeners close after `shutdown.delay`, HTTP/2 connections get GOAWAY, idle HTTP/1.1
//! connections close, watch streams end at an event boundary, and everything is bounded by
//! `shutdown.drainTimeout`. Tests embed it on port 0.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::api::{Reason, Status};
use crate::body::{self, Body};
use crate::config::Config;
use crate::drain::Tracked;
use crate::health::Health;
use crate::identity::CertIdentity;
use crate::metrics::{DurationLabels, KindLabels, Metrics, RequestLabels};
use crate::passthrough::{self, ConnInfo};
use crate::request_info::{self, RequestInfo};
use crate::upstream::{As, Upstream};

/// Everything a request handler needs, shared by all connections.
#[derive(Debug)]
pub struct State {
    pub config: Config,
    pub upstream: Upstream,
    pub metrics: Metrics,
    pub health: Health,
    /// Cached resources (filled in the background as they are discovered and synced).
    pub caches: Arc<crate::cache::registry::Caches>,
    pub authn: Arc<crate::authn::Authenticator>,
    pub authz: Arc<crate::authz::Authorizer>,
    pub tenancy: Arc<crate::tenancy::Tenancy>,
    pub watch: crate::watch::WatchConfig,
    pub lists: crate::list::ListConfig,
    /// Continue-token keys.
    pub keys: Arc<crate::token::Keys>,
    pub consistency: Arc<crate::consistency::Consistency>,
    /// The adaptive page-size controller.
    pub paging: Arc<crate::paging::Paging>,
    /// Cancelled when draining starts: long-running responses end cleanly.
    pub drain: CancellationToken,
}

impl State {
    pub fn new(
        config: Config,
        upstream: Upstream,
        authn: crate::authn::Authenticator,
    ) -> Arc<State> {
        let drain = CancellationToken::new();
        let c = &config.cache;
        let store = crate::cache::StoreConfig {
            history_max_events: c.history_max_events,
            history_max_age: c.history_max_age,
            watcher_queue: c.watcher_queue,
            dispatch_budget: c.dispatch_budget,
            snapshot_retention: config.lists.snapshot_retention,
            snapshot_max: config.lists.snapshot_max,
        };
        let paging = crate::paging::Paging::new(config.paging.clone(), c.upstream_page_size);
        let reflector = crate::reflector::ReflectorConfig {
            page_size: c.upstream_page_size,
            adaptive_page_size: paging.upstream_source(),
            ..Default::default()
        };
        let caches = crate::cache::registry::Caches::start(
            c.resources.clone(),
            c.exclude.clone(),
            upstream.clone(),
            store,
            reflector,
            drain.clone(),
        );
        let authz = Arc::new(crate::authz::Authorizer::new(
            upstream.clone(),
            c.authorization_allow_ttl,
            c.authorization_deny_ttl,
        ));
        let authn = Arc::new(authn);
        let tenancy = Arc::new(crate::tenancy::Tenancy::new(&config.tenants));
        let watch = crate::watch::WatchConfig {
            bookmark_interval: c.bookmark_interval,
            ..Default::default()
        };
        let l = &config.lists;
        let lists = crate::list::ListConfig {
            wait_for_rv: l.wait_for_resource_version,
            gzip_min_bytes: l.gzip_min_bytes,
            gzip_level: l.gzip_level,
            ..Default::default()
        };
        let keys = crate::token::Keys::load(config.tokens.key_file.as_deref(), config.tokens.ttl)
            .unwrap_or_else(|e| {
                // `check-config` and startup validation refuse a bad key file; this only
                // happens if it broke in between.
                tracing::error!(error = %e, "continue-token keys: using a random key");
                crate::token::Keys::load(None, config.tokens.ttl).expect("generated keys")
            });
        keys.spawn_reloader(config.tokens.reload_interval);
        let consistency =
            crate::consistency::Consistency::new(upstream.clone(), l.consistency_timeout);
        let metrics = Metrics::new();
        metrics.register_collector(Box::new(crate::consistency::ConsistencyCollector(
            consistency.clone(),
        )));
        metrics.register_collector(Box::new(crate::cache::metrics::CacheCollector(
            caches.clone(),
        )));
        metrics.register_collector(Box::new(crate::metrics::AuthCollector {
            authn: authn.clone(),
            authz: authz.clone(),
            tenancy: tenancy.clone(),
        }));
        metrics.register_collector(Box::new(crate::paging::PagingCollector(paging.clone())));
        Arc::new(State {
            config,
            upstream,
            metrics,
            health: Health::new(),
            caches,
            authn,
            authz,
            tenancy,
            watch,
            lists,
            keys,
            consistency,
            paging,
            drain,
        })
    }

    /// Readiness checks of the cached resources: `cache:<resource>`, failing until synced.
    /// Readiness per cached resource. Built-in resources gate readiness until their first
    /// sync (a new replica must not take traffic before it caches anything); custom
    /// resources never do (a CRD with a broken conversion webhook, or deleted, must not take
    /// every replica out of service): they are listed with their state and pass through
    /// until synced.
    pub fn cache_checks(&self) -> Vec<(String, Result<Option<String>, String>)> {
        let gate = |custom: bool, why: String| {
            if custom {
                Ok(Some(format!("{why}; requests pass through")))
            } else {
                Err(why)
            }
        };
        self.caches
            .entries()
            .iter()
            .map(|e| {
                let c = &e.cache;
                let r = match c.readiness() {
                    crate::cache::Readiness::Ready => Ok(None),
                    crate::cache::Readiness::Pending => gate(
                        c.resource.custom,
                        format!("not synced yet: {}", c.unhealthy().unwrap_or_default()),
                    ),
                    crate::cache::Readiness::Stopped => gate(c.resource.custom, "stopped".into()),
                };
                (format!("cache:{}", c.resource.label()), r)
            })
            // A configured resource not discovered yet has no cache to sync: not ready either,
            // or a new replica would report ready before it caches anything (custom resources
            // excepted, as above: their CRD may not exist yet or may have been deleted).
            .chain(self.caches.missing.iter().map(|m| {
                let custom = crate::cache::discovery::is_custom_name(m.key());
                (
                    format!("cache:{}", m.key()),
                    gate(custom, format!("not discovered yet: {}", m.value())),
                )
            }))
            .collect()
    }

    /// Probes the upstream's `/readyz` with the proxy's own identity until draining starts.
    pub fn spawn_upstream_probe(self: &Arc<Self>) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(this.config.upstream.health_check_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = this.drain.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let r = this.probe_upstream().await;
                if let Err(e) = &r {
                    tracing::warn!(error = %e, "upstream apiserver is not ready");
                }
                this.health.upstream.set(r);
            }
        });
    }

    async fn probe_upstream(&self) -> Result<(), String> {
        let mut req = Request::new(body::empty());
        *req.uri_mut() = self.upstream.uri("/readyz");
        let timeout = self
            .config
            .upstream
            .health_check_interval
            .max(Duration::from_secs(2));
        match tokio::time::timeout(timeout, self.upstream.send(req, As::Proxy, false)).await {
            Err(_) => Err(format!("GET /readyz timed out after {timeout:?}")),
            Ok(Err(e)) => Err(format!("GET /readyz: {e}")),
            Ok(Ok(r)) if r.status().is_success() => Ok(()),
            Ok(Ok(r)) => Err(format!("GET /readyz returned {}", r.status())),
        }
    }
}

/// The sockets to serve on.
pub struct Listeners {
    pub tls: Option<(TcpListener, TlsAcceptor)>,
    pub insecure: Option<TcpListener>,
}

fn connection_builder(cfg: &Config) -> auto::Builder<crate::local_streams::LocalExec> {
    let s = &cfg.server;
    let mut b = auto::Builder::new(crate::local_streams::LocalExec);
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(s.header_read_timeout)
        .max_headers(256)
        // hyper refuses a head beyond its buffer with a bare 431; leave room above our own
        // limit so oversized heads reach the handler and get a Status.
        .max_buf_size((s.max_header_bytes + 64 * 1024).max(8192 + 4096));
    b.http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(s.http2_max_concurrent_streams)
        .keep_alive_interval(s.http2_keepalive_interval)
        .keep_alive_timeout(s.http2_keepalive_timeout)
        .max_pending_accept_reset_streams(s.http2_max_pending_accept_reset_streams)
        .max_local_error_reset_streams(s.http2_max_local_error_reset_streams)
        .max_header_list_size((s.max_header_bytes + 64 * 1024) as u32);
    b
}

/// Serves until `shutdown` completes, then drains (see the module docs).
pub async fn run(state: Arc<State>, listeners: Listeners, shutdown: impl Future<Output = ()>) {
    let builder = Arc::new(connection_builder(&state.config));
    let graceful = Arc::new(hyper_util::server::graceful::GracefulShutdown::new());
    let stop_accepting = CancellationToken::new();
    let permits = Arc::new(Semaphore::new(state.config.server.max_connections));
    let mut accept_tasks = Vec::new();
    if let Some((l, acceptor)) = listeners.tls {
        accept_tasks.push(tokio::spawn(accept_loop(
            state.clone(),
            builder.clone(),
            l,
            Some(acceptor),
            graceful.clone(),
            stop_accepting.clone(),
            permits.clone(),
        )));
    }
    if let Some(l) = listeners.insecure {
        accept_tasks.push(tokio::spawn(accept_loop(
            state.clone(),
            builder.clone(),
            l,
            None,
            graceful.clone(),
            stop_accepting.clone(),
            permits.clone(),
        )));
    }

    shutdown.await;
    tracing::info!(delay = ?state.config.shutdown.delay, "shutting down: readiness now fails");
    state.health.begin_shutdown();
    tokio::time::sleep(state.config.shutdown.delay).await;
    stop_accepting.cancel();
    for t in accept_tasks {
        let _ = t.await;
    }
    state.drain.cancel();
    // The accept loops held the only other references.
    let Ok(graceful) = Arc::try_unwrap(graceful) else {
        tracing::error!("connection tracker still shared; cannot drain");
        return;
    };
    tracing::info!(
        connections = graceful.count(),
        "listeners closed; draining connections"
    );
    let limit = state.config.shutdown.drain_timeout;
    match tokio::time::timeout(limit, graceful.shutdown()).await {
        Ok(()) => tracing::info!("all connections drained"),
        Err(_) => tracing::warn!(
            ?limit,
            "drain timeout reached; closing remaining connections"
        ),
    }
}

async fn accept_loop(
    state: Arc<State>,
    builder: Arc<auto::Builder<crate::local_streams::LocalExec>>,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    graceful: Arc<hyper_util::server::graceful::GracefulShutdown>,
    stop: CancellationToken,
    permits: Arc<Semaphore>,
) {
    let kind = if tls.is_some() { "tls" } else { "insecure" };
    loop {
        let permit = tokio::select! {
            _ = stop.cancelled() => return,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
        };
        let (stream, peer) = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let builder = builder.clone();
        let tls = tls.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let gauge = state
                .metrics
                .connections
                .get_or_create(&KindLabels { kind: kind.into() })
                .clone();
            gauge.inc();
            serve_connection(state, &builder, stream, peer, tls, watcher).await;
            gauge.dec();
        });
    }
}

async fn serve_connection(
    state: Arc<State>,
    builder: &auto::Builder<crate::local_streams::LocalExec>,
    stream: TcpStream,
    peer: SocketAddr,
    tls: Option<TlsAcceptor>,
    watcher: hyper_util::server::graceful::Watcher,
) {
    let Some(acceptor) = tls else {
        let conn = ConnInfo {
            peer: Some(peer),
            cert: None,
        };
        return serve_io(state, builder, stream, conn, watcher).await;
    };
    let hs =
        tokio::time::timeout(state.config.tls.handshake_timeout, acceptor.accept(stream)).await;
    let tls_stream = match hs {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            state.metrics.reject("tls_handshake");
            tracing::info!(%peer, error = %e, "TLS handshake failed; connection closed");
            return;
        }
        Err(_) => {
            state.metrics.reject("tls_handshake_timeout");
            tracing::info!(%peer, "TLS handshake timed out; connection closed");
            return;
        }
    };
    let cert = tls_stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|c| CertIdentity::from_der(c))
        .map(Arc::new);
    let conn = ConnInfo {
        peer: Some(peer),
        cert,
    };
    serve_io(state, builder, tls_stream, conn, watcher).await
}

/// Serves one connection. Its writes are coalesced (`crate::coalesce`): what one poll of the
/// connection writes, HTTP/2 frames of many streams included, leaves in one write.
async fn serve_io<S>(
    state: Arc<State>,
    builder: &auto::Builder<crate::local_streams::LocalExec>,
    stream: S,
    conn: ConnInfo,
    watcher: hyper_util::server::graceful::Watcher,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (io, coalescing) = crate::coalesce::coalesce(stream);
    let io = TokioIo::new(io);
    let peer = conn.peer;
    let conn = Arc::new(conn);
    let svc = service_fn(move |req| {
        let state = state.clone();
        let conn = conn.clone();
        // Boxed: an HTTP/2 stream's task holds the service future inline until the response
        // head is written and then keeps its size for the stream's life; `handle`'s future
        // is several KB, which every idle watch stream would carry.
        Box::pin(async move { Ok::<_, Infallible>(handle(&state, &conn, req).await) })
    });
    let c = builder.serve_connection_with_upgrades(io, svc);
    type BoxError = Box<dyn std::error::Error + Send + Sync>;
    type ConnFuture = std::pin::Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;
    let conn: ConnFuture = Box::pin(watcher.watch(c.into_owned()));
    let conn = crate::local_streams::WithStreams::new(conn);
    if let Err(e) = coalescing.drive(conn).await {
        tracing::debug!(?peer, error = %e, "connection ended with an error");
    }
}

/// Serves a read from memory when the router says it can and the apiserver says this caller
/// may; `None` sends the request through.
async fn serve_from_cache(
    state: &State,
    conn: &ConnInfo,
    req: &Request<Incoming>,
    info: &RequestInfo,
    query: Option<&str>,
    read_charged: &mut bool,
) -> Option<Response<Body>> {
    use crate::router::Route;
    let accept = req
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok());
    let route = crate::router::route(req.method(), info, query, accept, |g, v, r| {
        state.caches.get(g, v, r)
    });
    if let Route::Passthrough(why) = route {
        if info.is_resource_request && info.verb != "create" {
            tracing::trace!(reason = why, path = %req.uri().path(), "passthrough");
        }
        return None;
    }
    let namespaced = match &route {
        Route::Watch { cache, .. } | Route::Get { cache, .. } | Route::List { cache, .. } => {
            cache.resource.namespaced
        }
        Route::Passthrough(_) => false,
    };
    let (id, view) = match authenticate_and_authorize(state, conn, req, info, namespaced).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    // Tenant quotas (`tenancy`); the unnamed tenant has none.
    let tenant = state.tenancy.get(&id.tenant);
    let mut permit = None;
    if let Some(t) = tenant {
        let admitted = match &route {
            Route::Watch { .. } => t.admit_watch().map(|p| permit = p),
            _ => t.admit_read().map(|()| *read_charged = true),
        };
        if let Err(status) = admitted {
            return Some(status.into_response());
        }
    }
    match route {
        Route::Watch {
            cache,
            params,
            mut filter,
            enc,
        } => {
            // Most recent state (a watch or WatchList without resourceVersion): only once the
            // consistency policy confirms the cache.
            if params.resource_version.as_deref().unwrap_or("").is_empty()
                && state
                    .consistency
                    .latest(&cache, consistency_mode(state, &cache))
                    .await
                    .is_none()
            {
                return None;
            }
            filter.namespaces = view.clone();
            let resp = crate::watch::serve(
                cache,
                params,
                filter,
                enc,
                &state.watch,
                state.drain.clone(),
            )
            .await
            .ok()?;
            // The tenant's watch slot is held as long as the stream.
            let (parts, mut b) = resp.into_parts();
            // A filtered view is re-derived while the watch is open (`tenancy::ViewWatch`).
            if let Some(view) = view
                && parts.status.is_success()
            {
                b = crate::tenancy::ViewWatch {
                    tenancy: state.tenancy.clone(),
                    authz: state.authz.clone(),
                    caches: state.caches.clone(),
                    id: id.clone(),
                    attrs: authz_attributes(info),
                    view,
                }
                .guard(b);
            }
            let b = Tracked::new(b, Instant::now(), move |_| drop(permit));
            Some(Response::from_parts(parts, body::boxed(b)))
        }
        Route::Get {
            cache,
            enc,
            consistent,
        } => {
            let snap = if consistent {
                state
                    .consistency
                    .latest(&cache, consistency_mode(state, &cache))
                    .await?
            } else {
                cache.current()
            };
            crate::list::get(&cache, &snap, &info.namespace, &info.name, enc)
        }
        Route::List {
            cache,
            mut filter,
            enc,
            params,
        } => {
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
                if let Err(status) = t.admit_list_size(n) {
                    return Some(status.into_response());
                }
            }
            let latest = if params.rv == crate::list::Rv::Unset && params.continue_.is_none() {
                state
                    .consistency
                    .latest(&cache, consistency_mode(state, &cache))
                    .await
            } else {
                None
            };
            let cx = crate::list::ListContext {
                cfg: &state.lists,
                keys: &state.keys,
                binding: list_binding(&id, info, &params, filter.namespaces.as_deref()),
                accepts_gzip: accepts_gzip(req.headers()),
                page_cap: state.paging.downstream_cap().map(|c| c as u64),
            };
            match crate::list::list(&cache, &filter, enc, &params, &cx, latest).await {
                crate::list::Outcome::Served(r) => Some(r),
                crate::list::Outcome::Passthrough(why) => {
                    tracing::trace!(reason = why, path = %req.uri().path(), "list passthrough");
                    None
                }
            }
        }
        Route::Passthrough(_) => None,
    }
}

/// Authentication and authorization of a cache-served request (`authn`, `authz`): `Ok` to
/// serve it; `Err(Some(status))` the 401/403/503 to answer; `Err(None)` to pass it through
/// (impersonation requests, which the apiserver or [`impersonation_gate`] authorize).
/// A cluster-wide list/watch RBAC denies may still be served as the tenant's filtered view:
/// the namespace set comes back with the identity.
async fn authenticate_and_authorize(
    state: &State,
    conn: &ConnInfo,
    req: &Request<Incoming>,
    info: &RequestInfo,
    namespaced: bool,
) -> Result<AuthorizedView, Option<Response<Body>>> {
    use crate::authn::Outcome;
    use crate::authz::Decision;
    if has_impersonation(req.headers()) {
        return Err(None);
    }
    let id = match state
        .authn
        .authenticate(conn.cert.as_deref(), req.headers())
        .await
    {
        Outcome::Authenticated(id, _) => id,
        Outcome::Unauthorized => return Err(Some(Status::unauthorized().into_response())),
        Outcome::Unavailable(e) => {
            let msg = format!("authentication is unavailable: {e}");
            return Err(Some(Status::service_unavailable(msg, 1).into_response()));
        }
    };
    let attrs = authz_attributes(info);
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
                None => Err(Some(
                    crate::authz::forbidden(&id, &attrs, &reason).into_response(),
                )),
            }
        }
        Decision::Error(e) => {
            let msg = format!("authorization is unavailable: {e}");
            Err(Some(Status::service_unavailable(msg, 1).into_response()))
        }
    }
}

/// The attributes a cache-served request is authorized with.
fn authz_attributes(info: &RequestInfo) -> crate::authz::Attributes {
    crate::authz::Attributes {
        verb: info.verb.clone(),
        group: info.api_group.clone(),
        version: info.api_version.clone(),
        resource: info.resource.clone(),
        subresource: info.subresource.clone(),
        namespace: info.namespace.clone(),
        name: info.name.clone(),
    }
}

type AuthorizedView = (
    Arc<crate::authn::Identity>,
    Option<Arc<std::collections::BTreeSet<String>>>,
);

/// Whether a list asks for pages (`limit` > 0).
fn has_limit(query: Option<&str>) -> bool {
    query.unwrap_or("").split('&').any(|kv| {
        kv.strip_prefix("limit=")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|n| n > 0)
    })
}

fn has_impersonation(h: &http::HeaderMap) -> bool {
    h.keys().any(|k| k.as_str().starts_with("impersonate-"))
}

/// A client-certificate caller's `Impersonate-*` headers, authorized as the apiserver's
/// impersonation filter would (its requests travel with the proxy's credentials, so the
/// apiserver cannot): `Err` is the refusal; `Ok(Some(conn))` the connection info to pass
/// through as the impersonated user; `Ok(None)` nothing to do.
async fn impersonation_gate(
    state: &State,
    conn: &ConnInfo,
    req: &Request<Incoming>,
) -> Result<Option<ConnInfo>, Response<Body>> {
    let Some(cert) = conn.cert.as_deref() else {
        return Ok(None);
    };
    if !has_impersonation(req.headers()) {
        return Ok(None);
    }
    let id = match state.authn.authenticate(Some(cert), req.headers()).await {
        crate::authn::Outcome::Authenticated(id, _) => id,
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
    forward_as: &ConnInfo,
    req: Request<Incoming>,
    info: &RequestInfo,
    long_running: bool,
    read_charged: bool,
) -> (Response<Body>, &'static str) {
    let admitted = state
        .tenancy
        .admit_passthrough(
            &state.authn,
            conn.cert.as_deref(),
            req.headers(),
            info,
            read_charged,
        )
        .await;
    let permit = match admitted {
        Ok(p) => p,
        Err(refusal) => return (refusal.into_response(), "proxy"),
    };
    let resp = passthrough::forward(state, forward_as, req, info, long_running).await;
    let Some(permit) = permit else {
        return (resp, "upstream");
    };
    let (parts, b) = resp.into_parts();
    let b = Tracked::new(b, Instant::now(), move |_| drop(permit));
    (Response::from_parts(parts, body::boxed(b)), "upstream")
}

/// A successful write to a cached resource: remembers the resourceVersion it produced, so
/// later unset-resourceVersion reads through this proxy wait until the cache reflects it
/// (read-your-writes in the bounded consistency mode). The response of a write is one small
/// object; it is buffered (up to 1 MiB) to read that number and sent on unchanged.
async fn read_your_writes(
    state: &State,
    info: &RequestInfo,
    resp: Response<Body>,
) -> Response<Body> {
    if !matches!(info.verb.as_str(), "create" | "update" | "patch" | "delete")
        || !resp.status().is_success()
        || !info.subresource.is_empty() && info.subresource != "status"
    {
        return resp;
    }
    let Some(cache) = state
        .caches
        .get(&info.api_group, &info.api_version, &info.resource)
    else {
        return resp;
    };
    let small = resp
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .is_some_and(|n| n <= 1 << 20);
    let plain = resp.headers().get(header::CONTENT_ENCODING).is_none();
    if !small || !plain {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    match http_body_util::BodyExt::collect(body).await {
        Ok(b) => {
            let b = b.to_bytes();
            if let Some(rv) = crate::consistency::body_rv(&b) {
                state.consistency.record_write(&cache.resource.label(), rv);
            }
            Response::from_parts(parts, body::full(b))
        }
        Err(e) => Status::failure(
            StatusCode::BAD_GATEWAY,
            Reason::InternalError,
            format!("the apiserver's response to the write broke off: {e}"),
        )
        .into_response(),
    }
}

/// The consistency mode configured for a resource.
fn consistency_mode(
    state: &State,
    cache: &crate::cache::ResourceCache,
) -> crate::consistency::Mode {
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
    id: &crate::authn::Identity,
    info: &RequestInfo,
    p: &crate::list::ListParams,
    view: Option<&std::collections::BTreeSet<String>>,
) -> crate::token::Binding {
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
    crate::token::Binding::new(&parts)
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

/// Sum of header name and value lengths, as Go's `MaxHeaderBytes` roughly counts them.
fn header_bytes(req: &Request<Incoming>) -> usize {
    req.headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum::<usize>()
        + req.uri().to_string().len()
}

/// The entry point of every request: hygiene checks, local endpoints, passthrough, and the
/// request's metrics and log line.
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

    if let Err(e) = request_info::validate_path(&path) {
        state.metrics.reject("bad_path");
        return Status::bad_request(format!("invalid request path: {e}")).into_response();
    }
    if header_bytes(&req) > state.config.server.max_header_bytes {
        state.metrics.reject("headers_too_large");
        return Status::failure(
            StatusCode::from_u16(431).unwrap_or(StatusCode::BAD_REQUEST),
            Reason::Unknown,
            format!(
                "request headers exceed the limit of {} bytes",
                state.config.server.max_header_bytes
            ),
        )
        .into_response();
    }

    // Local endpoints. The proxy answers health for itself (its readiness includes the
    // upstream's); `/metrics` is the proxy's own.
    if method == Method::GET || method == Method::HEAD {
        if let Some(r) = state
            .health
            .respond_with(&path, query.as_deref(), state.cache_checks())
        {
            return r;
        }
        if path == "/metrics" {
            let mut r = Response::new(body::full(state.metrics.encode()));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            return r;
        }
        // Served like /metrics (unauthenticated for now; both get the authentication
        // issue's treatment together).
        if path == "/debug/paging" {
            return state.paging.debug_response();
        }
    }

    let info = RequestInfo::parse(&method, &path, query.as_deref());
    let upgrade = crate::identity::upgrade_protocol(req.headers()).is_some();
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

    // Whether the cache path took a read-quota token before handing the request over.
    let mut read_charged = false;
    // Each branch's future is boxed: this future then holds only the one a request takes,
    // not the largest of them (it was 6.8 KB for every request, watches included, and a burst
    // of thousands of watch requests held that many at once).
    let (resp, served_by) = match Box::pin(impersonation_gate(state, conn, &req)).await {
        Err(refused) => (refused, "proxy"),
        Ok(Some(as_target)) => {
            Box::pin(forward_within_quota(
                state,
                conn,
                &as_target,
                req,
                &info,
                long_running,
                false,
            ))
            .await
        }
        Ok(None) => match Box::pin(serve_from_cache(
            state,
            conn,
            &req,
            &info,
            query.as_deref(),
            &mut read_charged,
        ))
        .await
        {
            Some(r) => (r, "cache"),
            None => {
                let (resp, by) = Box::pin(forward_within_quota(
                    state,
                    conn,
                    conn,
                    req,
                    &info,
                    long_running,
                    read_charged,
                ))
                .await;
                (Box::pin(read_your_writes(state, &info, resp)).await, by)
            }
        },
    };

    let code = resp.status();
    state
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            verb: verb.clone(),
            group: info.api_group.clone(),
            version: info.api_version.clone(),
            resource: info.resource.clone(),
            subresource: info.subresource.clone(),
            scope: info.metrics_scope().into(),
            code: code.as_str().into(),
            served_by: served_by.into(),
        })
        .inc();
    tracing::debug!(
        %method,
        path = %path,
        verb = %verb,
        code = code.as_u16(),
        latency_ms = start.elapsed().as_secs_f64() * 1e3,
        peer = ?conn.peer,
        "request"
    );
    let scope = info.metrics_scope().to_string();
    let paging = (verb == "LIST").then(|| state.paging.clone());
    let hist = state
        .metrics
        .request_duration
        .get_or_create(&DurationLabels {
            verb,
            group: info.api_group,
            version: info.api_version,
            resource: info.resource,
            subresource: info.subresource,
            scope,
            served_by: served_by.into(),
        })
        .clone();
    let (parts, b) = resp.into_parts();
    let b = Tracked::new(b, start, move |start| {
        hist.observe(start.elapsed().as_secs_f64());
        if let Some(p) = &paging {
            p.record_list(start.elapsed());
        }
        inflight.dec();
    });
    Response::from_parts(parts, body::boxed(b))
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Upstream(#[from] crate::upstream::UpstreamError),
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    #[error(transparent)]
    Authn(#[from] crate::authn::AuthnError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A proxy serving in the background (used by the CLI, dev mode and tests).
#[derive(Debug)]
pub struct Running {
    pub state: Arc<State>,
    pub tls_addr: Option<SocketAddr>,
    pub insecure_addr: Option<SocketAddr>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Begins graceful shutdown (as SIGTERM does) without waiting for it.
    pub fn begin_shutdown(&self) {
        self.stop.cancel();
    }

    /// Shuts down gracefully and waits for the drain to finish.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }

    /// Waits until the server has stopped (after a shutdown began).
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Validates `config`, binds its listeners and starts serving against `kube`'s apiserver.
pub async fn start(config: Config, kube: &kube::Config) -> Result<Running, StartError> {
    config.validate()?;
    crate::tls::install_crypto_provider();
    let upstream = Upstream::new(kube, &config.upstream)?;
    let tls = match (&config.tls.cert_file, &config.tls.key_file) {
        (Some(cert), Some(key)) => {
            let rc = crate::tls::ReloadingCert::load(cert, key)?;
            rc.spawn_reloader(config.tls.reload_interval);
            let sc = crate::tls::server_config(rc, config.tls.client_ca_file.as_deref())?;
            let l = TcpListener::bind(config.listen)
                .await
                .map_err(|source| StartError::Bind {
                    addr: config.listen,
                    source,
                })?;
            Some((l, TlsAcceptor::from(Arc::new(sc))))
        }
        _ => None,
    };
    let insecure = match config.insecure_listen {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { addr, source })?,
        ),
        None => None,
    };
    let tls_addr = tls.as_ref().and_then(|(l, _)| l.local_addr().ok());
    let insecure_addr = insecure.as_ref().and_then(|l| l.local_addr().ok());
    let authn = crate::authn::Authenticator::new(
        config.authentication.clone(),
        crate::authn::TenantMapper::new(config.tenants.clone()),
        upstream.clone(),
    )?;
    let state = State::new(config, upstream, authn);
    state.spawn_upstream_probe();
    state.authn.spawn_jwks_refresher(state.drain.clone());
    state
        .paging
        .spawn(state.upstream.clone(), state.drain.clone());
    let stop = CancellationToken::new();
    let task = tokio::spawn(run(
        state.clone(),
        Listeners { tls, insecure },
        stop.clone().cancelled_owned(),
    ));
    if let Some(a) = tls_addr {
        tracing::info!(addr = %a, "serving TLS (HTTP/2 and HTTP/1.1)");
    }
    if let Some(a) = insecure_addr {
        tracing::info!(addr = %a, "serving plain HTTP (HTTP/1.1 and h2c) for local use");
    }
    Ok(Running {
        state,
        tls_addr,
        insecure_addr,
        stop,
        task,
    })
}
