//! Clients to the upstream kube-apiserver, built from kubeconfig or in-cluster config.
//!
//! Two identities travel to the apiserver, over separate connection pools:
//! - **caller**: TLS that trusts the apiserver's CA but presents no client certificate, and
//!   no credentials of the proxy. Callers' bearer tokens are forwarded over it unchanged, and
//!   anonymous callers stay anonymous. It must never carry the proxy's client certificate:
//!   kube-apiserver authenticates x509 before bearer tokens, so a proxy certificate would
//!   turn every caller into the proxy.
//! - **proxy**: the proxy's own credentials from kubeconfig (client certificate, static or
//!   file token, exec plugin; refreshed by the `kube` crate's auth layer). Used for the
//!   proxy's own requests and to impersonate client-certificate callers.
//!
//! Each has an HTTP/1.1-only twin, used for protocol upgrades (exec/attach/port-forward),
//! which cannot run over HTTP/2, and for long-running requests (watches, `logs -f`):
//! kube-apiserver allows only 100 concurrent streams per HTTP/2 connection (since the
//! CVE-2023-44487 hardening), and hyper's client queues requests beyond a connection's limit
//! instead of opening another connection as Go's transport does, so a long-lived stream must
//! never take one of those slots or the 101st watch would hang. Redirects are never followed: hyper's client does not follow them,
//! and the proxy relays a 3xx to its caller as it came.

use std::time::Duration;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::ConfigExt;
use tower::{BoxError, ServiceBuilder, ServiceExt, util::BoxCloneSyncService};

use crate::body::Body;
use crate::config::UpstreamConfig;

/// A request sender to the apiserver.
pub type HttpService = BoxCloneSyncService<Request<Body>, Response<Incoming>, BoxError>;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("loading kubeconfig: {0}")]
    Kubeconfig(#[source] kube::config::KubeconfigError),
    #[error("in-cluster config: {0}")]
    InCluster(#[source] kube::config::InClusterError),
    #[error("building TLS client configuration: {0}")]
    Tls(#[source] kube::Error),
    #[error("building credentials: {0}")]
    Auth(#[source] kube::Error),
    #[error("upstream URL {0} has no host")]
    BadUrl(String),
}

/// Which identity a request to the apiserver carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum As {
    /// The caller's own credentials (or none).
    Caller,
    /// The proxy's credentials from its kubeconfig.
    Proxy,
}

/// Connection pools to one kube-apiserver.
#[derive(Clone)]
pub struct Upstream {
    base: Uri,
    caller: HttpService,
    caller_h1: HttpService,
    proxy: HttpService,
    proxy_h1: HttpService,
    /// Latency of the proxy's own non-long-running requests, for adaptive paging.
    latency: std::sync::Arc<crate::paging::LatencyWindow>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("base", &self.base)
            .finish()
    }
}

/// Loads the kube config the proxy talks to the apiserver with.
///
/// Order: an explicit kubeconfig path; else in-cluster (when `KUBERNETES_SERVICE_HOST` is
/// set, as in a pod); else `$KUBECONFIG` / `~/.kube/config`.
pub async fn load_kube_config(cfg: &UpstreamConfig) -> Result<kube::Config, UpstreamError> {
    let opts = kube::config::KubeConfigOptions {
        context: cfg.context.clone(),
        ..Default::default()
    };
    let mut kc = if let Some(path) = &cfg.kubeconfig {
        let file = kube::config::Kubeconfig::read_from(path).map_err(UpstreamError::Kubeconfig)?;
        kube::Config::from_custom_kubeconfig(file, &opts)
            .await
            .map_err(UpstreamError::Kubeconfig)?
    } else if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
        kube::Config::incluster().map_err(UpstreamError::InCluster)?
    } else {
        kube::Config::from_kubeconfig(&opts)
            .await
            .map_err(UpstreamError::Kubeconfig)?
    };
    kc.connect_timeout = Some(cfg.connect_timeout);
    // Watches are long-lived: no read timeout on the stream itself; liveness comes from
    // HTTP/2 keepalive pings.
    kc.read_timeout = None;
    Ok(kc)
}

impl Upstream {
    pub fn new(kc: &kube::Config, cfg: &UpstreamConfig) -> Result<Upstream, UpstreamError> {
        if kc.cluster_url.host().is_none() {
            return Err(UpstreamError::BadUrl(kc.cluster_url.to_string()));
        }
        // The caller pools: same trust, no identity of the proxy.
        let mut anonymous = kc.clone();
        anonymous.auth_info = Default::default();
        let caller_tls = anonymous
            .rustls_client_config()
            .map_err(UpstreamError::Tls)?;
        let proxy_tls = kc.rustls_client_config().map_err(UpstreamError::Tls)?;
        // `AuthLayer` is not `Clone`: each proxy pool gets its own (token files and exec
        // plugins are then refreshed per pool, which costs one extra read per refresh).
        let auth = || kc.auth_layer().map_err(UpstreamError::Auth);

        let build = |mut tls: rustls::ClientConfig,
                     h2: bool,
                     auth: Option<kube::client::middleware::AuthLayer>|
         -> HttpService {
            let mut http = HttpConnector::new();
            http.enforce_http(false);
            http.set_nodelay(true);
            http.set_connect_timeout(Some(cfg.connect_timeout));
            http.set_keepalive(Some(Duration::from_secs(60)));
            // hyper-rustls derives ALPN from the enabled protocols and panics if it is preset.
            tls.alpn_protocols.clear();
            let b = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_or_http();
            let b = match &kc.tls_server_name {
                Some(name) => match rustls_pki_types::ServerName::try_from(name.clone()) {
                    Ok(sn) => {
                        b.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(sn))
                    }
                    Err(_) => b,
                },
                None => b,
            };
            let connector = if h2 {
                b.enable_http1().enable_http2().wrap_connector(http)
            } else {
                b.enable_http1().wrap_connector(http)
            };
            let client: Client<_, Body> = Client::builder(TokioExecutor::new())
                .timer(TokioTimer::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(Duration::from_secs(90))
                .http2_keep_alive_interval(cfg.keepalive_interval)
                .http2_keep_alive_timeout(Duration::from_secs(20))
                .http2_keep_alive_while_idle(true)
                .build(connector);
            let svc = client.map_err(BoxError::from);
            BoxCloneSyncService::new(ServiceBuilder::new().option_layer(auth).service(svc))
        };
        Ok(Upstream {
            base: kc.cluster_url.clone(),
            caller: build(caller_tls.clone(), true, None),
            caller_h1: build(caller_tls, false, None),
            proxy: build(proxy_tls.clone(), true, auth()?),
            proxy_h1: build(proxy_tls, false, auth()?),
            latency: Default::default(),
        })
    }

    /// The URI of `path_and_query` on the apiserver, keeping any path prefix of the
    /// configured server URL (e.g. a server behind a path-routing gateway).
    pub fn uri(&self, path_and_query: &str) -> Uri {
        let prefix = self.base.path().trim_end_matches('/');
        let mut parts = self.base.clone().into_parts();
        let pq = format!("{prefix}{path_and_query}");
        parts.path_and_query = pq.parse().ok();
        Uri::from_parts(parts).unwrap_or_else(|_| self.base.clone())
    }

    pub fn base(&self) -> &Uri {
        &self.base
    }

    /// Sends a request with the given identity; `http1` selects the HTTP/1.1 pool (upgrades
    /// and long-running requests, see the module docs). The time to response headers of the
    /// proxy's own short requests (`As::Proxy`, not `http1`) goes into [`Upstream::latency`].
    pub fn send(
        &self,
        req: Request<Body>,
        who: As,
        http1: bool,
    ) -> impl Future<Output = Result<Response<Incoming>, BoxError>> + Send + 'static {
        let timed = (who == As::Proxy && !http1).then(|| self.latency.clone());
        let start = std::time::Instant::now();
        let sent = self.send_untimed(req, who, http1);
        async move {
            let r = sent.await;
            if let (Some(w), Ok(_)) = (timed, &r) {
                w.observe(start.elapsed());
            }
            r
        }
    }

    /// The latency window of the proxy's own upstream requests (see [`Upstream::send`]).
    pub fn latency(&self) -> &std::sync::Arc<crate::paging::LatencyWindow> {
        &self.latency
    }

    /// [`Upstream::send`] without latency accounting.
    pub fn send_untimed(
        &self,
        req: Request<Body>,
        who: As,
        http1: bool,
    ) -> impl Future<Output = Result<Response<Incoming>, BoxError>> + Send + 'static {
        let svc = match (who, http1) {
            (As::Caller, false) => &self.caller,
            (As::Caller, true) => &self.caller_h1,
            (As::Proxy, false) => &self.proxy,
            (As::Proxy, true) => &self.proxy_h1,
        };
        svc.clone().oneshot(req)
    }
}
