//! The admin listener: the proxy's own `/livez`, `/readyz`, `/healthz` (open, for probes),
//! `/metrics` and `/debug/*` (authenticated and authorized as kube-rbac-proxy does).
//!
//! Health detail is the apiserver's: anyone may `get` `/readyz` (`?verbose` too: the
//! `system:public-info-viewer` default), but what a caller without credentials sees is the
//! public view ([`crate::serve::health::View`]: no cached resource by name), and
//! `/<endpoint>/<check>` answers it 403 in the apiserver's words. A caller with credentials
//! is authenticated (401) and authorized for the path (`get /readyz` for the listing,
//! `get /readyz/upstream` for one check: 403 unless RBAC allows it, as on the apiserver) and
//! then sees every check with its reason. Custom resource names are no secret from an
//! authenticated caller: discovery lists them to `system:authenticated` by default.
//!
//! The API port is the apiserver's whole surface, so the proxy's own endpoints live on a
//! second listener (`server.adminListen`), served by the same transport
//! ([`crate::http::listener`]) through [`Admin`]. `/metrics` and `/debug/*` need a caller the
//! authentication chain verifies (client certificate, token file, ServiceAccount JWT,
//! TokenReview: as for reads, [`crate::serve::caller`]) and a `SubjectAccessReview` allowing
//! the non-resource URL (`get` on `/metrics`; cached as resource reviews are,
//! [`crate::auth::authz`]); 401 and 403 are the apiserver's `Status`. `server.adminAuth: none`
//! turns that off for local use.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use rustls_pki_types::CertificateDer;

use crate::auth::authn::Outcome;
use crate::auth::authz::{Attributes, Decision};
use crate::config::AdminAuth;
use crate::http::body::{self, Body};
use crate::k8s::request_info;
use crate::k8s::status::{Reason, Status};
use crate::metrics::Metrics;
use crate::serve::caller::Caller;
use crate::serve::state::{ConnInfo, State};

/// The admin listener's service: the proxy's own endpoints over the shared [`State`].
#[derive(Debug, Clone)]
pub struct Admin {
    pub state: Arc<State>,
}

impl crate::http::listener::Service for Admin {
    type Conn = ConnInfo;

    fn accept(&self, peer: SocketAddr, cert: Option<&CertificateDer<'_>>) -> ConnInfo {
        <State as crate::http::listener::Service>::accept(&self.state, peer, cert)
    }

    fn call(
        self: Arc<Self>,
        conn: Arc<ConnInfo>,
        req: Request<Incoming>,
    ) -> Pin<Box<dyn Future<Output = Response<Body>> + Send>> {
        Box::pin(async move { handle(&self.state, &conn, req).await })
    }

    fn metrics(&self) -> &Metrics {
        &self.state.metrics
    }

    /// Scrapes and probes are not API clients: counted apart.
    fn connection_kind(&self, _tls: bool) -> &'static str {
        "admin"
    }

    fn downstream(&self) -> &Arc<crate::http::budget::Downstream> {
        &self.state.downstream
    }

    fn begin_shutdown(&self) {
        self.state.health.begin_shutdown();
    }

    fn begin_drain(&self) {
        self.state.drain.cancel();
    }
}

/// Answers one admin request.
pub async fn handle<B>(state: &State, conn: &ConnInfo, req: Request<B>) -> Response<Body> {
    let path = req.uri().path();
    let query = req.uri().query();
    if let Err(e) = request_info::validate_path(path) {
        state.metrics.reject("bad_path");
        return Status::bad_request(format!("invalid request path: {e}")).into_response();
    }
    let method = req.method();
    let protected = path == "/metrics" || path == "/debug" || path.starts_with("/debug/");
    let health = crate::serve::health::Endpoint::from_path(path).is_some();
    if !protected && !health {
        return not_found();
    }
    if method != Method::GET && method != Method::HEAD {
        return Status::failure(
            StatusCode::METHOD_NOT_ALLOWED,
            Reason::MethodNotAllowed,
            format!(
                "the server does not allow this method on the requested resource ({method} {path})"
            ),
        )
        .into_response();
    }
    if health {
        let view = match health_view(state, conn, req.headers(), path, query).await {
            Ok(v) => v,
            Err(refused) => return refused.into_response(),
        };
        return state
            .health
            .respond_with(
                path,
                query,
                Some(state.upstream_check()),
                state.cache_checks(),
                view,
            )
            .unwrap_or_else(not_found);
    }
    if state.config.server.admin_auth == AdminAuth::Kubernetes {
        let verb = if method == Method::HEAD {
            "head"
        } else {
            "get"
        };
        if let Err(refused) = authorize(state, conn, req.headers(), path, verb).await {
            return refused.into_response();
        }
    }
    match path {
        "/metrics" => {
            // OpenMetrics when the scraper prefers it (Prometheus does), else the text
            // format 0.0.4 (`promtool check metrics`, curl, older scrapers).
            let format = crate::metrics::Format::negotiate(
                req.headers()
                    .get(header::ACCEPT)
                    .and_then(|v| v.to_str().ok()),
            );
            let mut r = Response::new(body::full(state.metrics.encode_as(format)));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static(format.content_type()),
            );
            r
        }
        "/debug/paging" => state.paging.debug_response(),
        _ => not_found(),
    }
}

/// How much of the health checks this caller may see (see the module docs): plain
/// `/readyz` (a probe) is the public view without asking anyone; detail (`?verbose`,
/// `/readyz/<check>`) is the full view for a caller authorized for the path, the public
/// listing for a caller without credentials, and 403 for one check asked anonymously.
async fn health_view(
    state: &State,
    conn: &ConnInfo,
    headers: &http::HeaderMap,
    path: &str,
    query: Option<&str>,
) -> Result<crate::serve::health::View, Status> {
    use crate::serve::health::{Endpoint, View};
    if state.config.server.admin_auth == AdminAuth::None {
        return Ok(View::Full);
    }
    let single = Endpoint::from_path(path).is_some_and(|(_, one)| one.is_some());
    let verbose = query
        .unwrap_or("")
        .split('&')
        .any(|p| p.split_once('=').map_or(p, |(k, _)| k) == "verbose");
    if !single && !verbose {
        return Ok(View::Public);
    }
    let credentials = conn.cert.is_some() || headers.contains_key(header::AUTHORIZATION);
    if !credentials {
        if !single {
            return Ok(View::Public);
        }
        // kube-apiserver: `forbidden: User "system:anonymous" cannot get path "/readyz/etcd"`.
        let attrs = Attributes {
            verb: "get".into(),
            path: path.into(),
            ..Default::default()
        };
        let anonymous = crate::auth::authn::Identity::anonymous();
        return Err(crate::auth::authz::forbidden(&anonymous, &attrs, ""));
    }
    authorize(state, conn, headers, path, "get").await?;
    Ok(View::Full)
}

/// kube-rbac-proxy's check: the caller authenticated as for reads, then a
/// `SubjectAccessReview` for the non-resource URL `path` with `verb`.
async fn authorize(
    state: &State,
    conn: &ConnInfo,
    headers: &http::HeaderMap,
    path: &str,
    verb: &str,
) -> Result<(), Status> {
    let mut caller = Caller::default();
    let id = match caller.authenticate(state, conn, headers).await {
        Outcome::Authenticated(id, _) => id.clone(),
        Outcome::Unauthorized => return Err(Status::unauthorized()),
        Outcome::Unavailable(e) => {
            return Err(Status::service_unavailable(
                format!("authentication is unavailable: {e}"),
                1,
            ));
        }
    };
    let attrs = Attributes {
        verb: verb.into(),
        path: path.into(),
        ..Default::default()
    };
    match state.authz.authorize(&id, &attrs).await {
        Decision::Allow => Ok(()),
        Decision::Deny(reason) => Err(crate::auth::authz::forbidden(&id, &attrs, &reason)),
        Decision::Error(e) => Err(Status::service_unavailable(
            format!("authorization is unavailable: {e}"),
            1,
        )),
    }
}

fn not_found() -> Response<Body> {
    Status::failure(
        StatusCode::NOT_FOUND,
        Reason::NotFound,
        "the server could not find the requested resource",
    )
    .into_response()
}
