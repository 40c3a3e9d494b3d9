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
//!
//! A request the apiserver never processed is sent once more on a fresh connection, as Go's
//! HTTP/2 transport does for client-go: kube-apiserver closes an HTTP/2 connection idle for
//! 90 s with a GOAWAY, and a request sent on it at that moment is refused (see
//! [`never_processed`]). The pools also drop idle connections after 60 s, before the
//! apiserver does, so that race is rare to begin with.

pub mod reachability;

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::ConfigExt;
use tower::{BoxError, ServiceBuilder, ServiceExt, util::BoxCloneSyncService};

use crate::config::UpstreamConfig;
use crate::http::body::Body;

/// The `User-Agent` of the proxy's own requests to the apiserver.
pub const USER_AGENT: &str = concat!("kube-cache-proxy/", env!("CARGO_PKG_VERSION"));

/// How long a pooled connection to the apiserver may stay unused (see the module docs).
pub const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// A request sender to the apiserver.
pub type HttpService = BoxCloneSyncService<Request<Body>, Response<Incoming>, BoxError>;

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("loading kubeconfig: {0}")]
    Kubeconfig(#[source] kube::config::KubeconfigError),
    #[error("in-cluster config: {0}")]
    InClusterEnv(String),
    #[error("in-cluster config: reading {path}: {source}")]
    InClusterFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
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
    latency: std::sync::Arc<crate::metrics::window::LatencyWindow>,
    /// Spans of the proxy's own upstream work (the cache's LIST and WATCH); off by default.
    telemetry: crate::telemetry::Telemetry,
    /// Whether the apiserver can be reached, shared by every clone.
    reachability: Arc<reachability::Reachability>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("base", &self.base)
            .finish()
    }
}

/// Where the kubelet mounts a pod's ServiceAccount token, CA bundle and namespace; the fixed
/// path client-go and kube-rs read in-cluster credentials from.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Loads the kube config the proxy talks to the apiserver with.
///
/// Order: an explicit kubeconfig path; else in-cluster (when `KUBERNETES_SERVICE_HOST` is
/// set, as in a pod; see [`in_cluster_config`]); else `$KUBECONFIG` / `~/.kube/config`.
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
        let dir = cfg
            .service_account_dir
            .as_deref()
            .unwrap_or(std::path::Path::new(SERVICE_ACCOUNT_DIR));
        in_cluster_config(dir)?
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

/// In-cluster config, as client-go's `rest.InClusterConfig` builds it: the apiserver at
/// `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`, trusting `dir/ca.crt`, with the
/// bearer token in `dir/token`. Both files are re-read while running (the kubelet rotates
/// the projected token; CA bundles rotate too), as kube-rs does for its own in-cluster config.
/// `dir` is [`SERVICE_ACCOUNT_DIR`] in a pod; `upstream.serviceAccountDir` overrides it
/// (tests, or credentials mounted elsewhere).
///
/// # Errors
/// A missing or unparsable variable, or an unreadable token or CA file.
pub fn in_cluster_config(dir: &std::path::Path) -> Result<kube::Config, UpstreamError> {
    let env = |name: &str| {
        std::env::var(name).map_err(|e| UpstreamError::InClusterEnv(format!("{name}: {e}")))
    };
    in_cluster_config_from(
        &env("KUBERNETES_SERVICE_HOST")?,
        &env("KUBERNETES_SERVICE_PORT")?,
        dir,
    )
}

/// [`in_cluster_config`] with the two variables' values given.
fn in_cluster_config_from(
    host: &str,
    port: &str,
    dir: &std::path::Path,
) -> Result<kube::Config, UpstreamError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;

    let port: u16 = port
        .parse()
        .map_err(|e| UpstreamError::InClusterEnv(format!("KUBERNETES_SERVICE_PORT: {e}")))?;
    // An IPv6 address needs brackets in a URL.
    let host = match host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(ip)) => format!("[{ip}]"),
        _ => host.to_string(),
    };
    let url: Uri = format!("https://{host}:{port}").parse().map_err(|e| {
        UpstreamError::InClusterEnv(format!("apiserver URL from {host}:{port}: {e}"))
    })?;
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read(&path).map_err(|source| UpstreamError::InClusterFile { path, source })
    };
    let ca_path = dir.join("ca.crt");
    let ca = read("ca.crt")?;
    let certs: Vec<Vec<u8>> = CertificateDer::pem_slice_iter(&ca)
        .filter_map(Result::ok)
        .map(|c| c.to_vec())
        .collect();
    if certs.is_empty() {
        return Err(UpstreamError::InClusterFile {
            path: ca_path,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "no PEM certificate in the CA bundle",
            ),
        });
    }
    // Fail at start, not on the first request, when the token is missing.
    let token_path = dir.join("token");
    read("token")?;
    let mut kc = kube::Config::new(url);
    // The namespace file is informational for the proxy (it names no namespace itself).
    if let Ok(ns) = read("namespace") {
        kc.default_namespace = String::from_utf8_lossy(&ns).trim().to_string();
    }
    kc.root_cert = Some(certs);
    kc.root_cert_file = Some(ca_path);
    kc.auth_info.token_file = Some(token_path.to_string_lossy().into_owned());
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
                // Below kube-apiserver's HTTP/2 idle timeout (90 s): the proxy closes an
                // idle connection before the apiserver sends it a GOAWAY.
                .pool_idle_timeout(POOL_IDLE_TIMEOUT)
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
            telemetry: Default::default(),
            reachability: Default::default(),
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

    /// These pools with `telemetry` for the spans of the proxy's own upstream work.
    pub fn with_telemetry(mut self, telemetry: crate::telemetry::Telemetry) -> Upstream {
        self.telemetry = telemetry;
        self
    }

    pub fn telemetry(&self) -> &crate::telemetry::Telemetry {
        &self.telemetry
    }

    /// Whether the apiserver can be reached (see [`reachability`]).
    pub fn reachability(&self) -> &reachability::Reachability {
        &self.reachability
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
    pub fn latency(&self) -> &std::sync::Arc<crate::metrics::window::LatencyWindow> {
        &self.latency
    }

    /// [`Upstream::send`] without latency accounting. The proxy's own requests
    /// (`As::Proxy`) without a `User-Agent` carry [`USER_AGENT`], so the apiserver's audit
    /// log and metrics name them; a caller's request (impersonated or not) keeps its own.
    /// Sent while a traced request runs, it carries a `traceparent` naming the current span
    /// (replacing a caller's: [`crate::telemetry::inject`]).
    pub fn send_untimed(
        &self,
        mut req: Request<Body>,
        who: As,
        http1: bool,
    ) -> impl Future<Output = Result<Response<Incoming>, BoxError>> + Send + 'static {
        if who == As::Proxy {
            req.headers_mut()
                .entry(http::header::USER_AGENT)
                .or_insert(http::HeaderValue::from_static(USER_AGENT));
        }
        crate::telemetry::inject(req.headers_mut());
        let svc = match (who, http1) {
            (As::Caller, false) => &self.caller,
            (As::Caller, true) => &self.caller_h1,
            (As::Proxy, false) => &self.proxy,
            (As::Proxy, true) => &self.proxy_h1,
        };
        let target = self.authority();
        let again = Replay::of(&req);
        // Boxed where the types are concrete: rustc cannot prove an async block that names
        // the service's request type `Send` (its `dyn Error` lifetimes are higher-ranked).
        type Sent = futures_util::future::BoxFuture<'static, Result<Response<Incoming>, BoxError>>;
        let svc = svc.clone();
        let send = move |req: Request<Body>| -> Sent { Box::pin(svc.clone().oneshot(req)) };
        let first = send(req);
        async move {
            let r = match (first.await, again) {
                (Err(e), Some(again)) if never_processed(e.as_ref(), &again.method) => {
                    tracing::debug!(error = %error_chain(e.as_ref()), method = %again.method,
                        "the apiserver did not process the request; sending it again");
                    send(again.request()).await
                }
                (r, _) => r,
            };
            r.map_err(move |source| BoxError::from(SendError { target, source }))
        }
    }

    /// `host:port` of the apiserver, as errors name it.
    fn authority(&self) -> String {
        let host = self.base.host().unwrap_or_default();
        let port = self
            .base
            .port_u16()
            .unwrap_or(match self.base.scheme_str() {
                Some("http") => 80,
                _ => 443,
            });
        format!("{host}:{port}")
    }
}

/// What is needed to send a request with no body again: everything but the body.
struct Replay {
    method: http::Method,
    uri: Uri,
    version: http::Version,
    headers: http::HeaderMap,
    extensions: http::Extensions,
}

impl Replay {
    /// A copy of `req` to send again, when it has no body (a body is streamed and gone once
    /// sent; the proxy's own requests and callers' reads have none).
    fn of(req: &Request<Body>) -> Option<Replay> {
        use http_body::Body as _;
        req.body().is_end_stream().then(|| Replay {
            method: req.method().clone(),
            uri: req.uri().clone(),
            version: req.version(),
            headers: req.headers().clone(),
            extensions: req.extensions().clone(),
        })
    }

    fn request(self) -> Request<Body> {
        let mut req = Request::new(crate::http::body::empty());
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.version_mut() = self.version;
        *req.headers_mut() = self.headers;
        *req.extensions_mut() = self.extensions;
        req
    }
}

/// Whether a request that failed with `e` certainly did not change anything at the
/// apiserver, so sending it again is safe:
/// - the apiserver refused the stream (`REFUSED_STREAM`, RFC 9113 §8.7: not processed), or
///   hyper cancelled the request before sending it;
/// - a graceful GOAWAY (`NO_ERROR`: idle timeout, `--goaway-chance`, shutdown) ended the
///   stream, for a method without side effects. h2 fails both the streams above the
///   GOAWAY's last stream ID (never processed) and, should the connection then close, the
///   ones below it with the same error, so only a safe method is sent again there, as Go's
///   transport does for a request it cannot prove unprocessed.
pub fn never_processed(e: &(dyn std::error::Error + 'static), method: &http::Method) -> bool {
    let safe = matches!(
        *method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    );
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper::Error>()
            && h.is_canceled()
        {
            return true;
        }
        if let Some(he) = err.downcast_ref::<h2::Error>() {
            return match he.reason() {
                Some(h2::Reason::REFUSED_STREAM) => he.is_remote(),
                Some(h2::Reason::NO_ERROR) => safe && he.is_go_away() && he.is_remote(),
                _ => false,
            };
        }
        cur = err.source();
    }
    false
}

/// A request to the apiserver that got no response: its address and the whole cause.
///
/// hyper_util's client error says only `client error (Connect)` and keeps the cause in its
/// `source()` chain (`tcp connect error`, `Connection refused (os error 111)`); the message
/// here walks the chain, so logs and 503 messages say what happened and where.
/// `source()` is the original error, so callers can still look for a cause by type.
#[derive(Debug)]
pub struct SendError {
    /// `host:port` of the apiserver.
    pub target: String,
    pub source: BoxError,
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.target, error_chain(&*self.source))
    }
}

impl std::error::Error for SendError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// An error and its sources as one line, `outer: inner: innermost`; a source whose message
/// the outer one already contains is skipped.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let msg = s.to_string();
        if !msg.is_empty() && !out.contains(&msg) {
            out.push_str(": ");
            out.push_str(&msg);
        }
        cur = s.source();
    }
    out
}

#[cfg(test)]
mod refused;

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused connection names the address and the cause, not `client error (Connect)`.
    #[tokio::test]
    async fn a_refused_connection_names_the_address_and_the_cause() {
        // A port with nothing listening: bound, then closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let kc = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let up = Upstream::new(&kc, &UpstreamConfig::default()).unwrap();
        let mut req = Request::new(crate::http::body::empty());
        *req.uri_mut() = up.uri("/readyz");
        let e = up.send(req, As::Proxy, false).await.unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with(&format!("127.0.0.1:{port}: ")), "{msg}");
        assert!(msg.contains("Connection refused"), "{msg}");
        // The original error is still the source (callers look for causes by type).
        assert!(std::error::Error::source(&*e).is_some());
    }

    fn ca() -> String {
        crate::http::tls::generate_serving_pair(&["localhost"])
            .unwrap()
            .0
    }

    fn sa_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, content) in files {
            std::fs::write(dir.path().join(name), content).unwrap();
        }
        dir
    }

    #[test]
    fn in_cluster_config_reads_the_service_account_directory() {
        // The port stays in the URL, as client-go's net.JoinHostPort(host, port) keeps it.
        let dir = sa_dir(&[
            ("token", "t0ken"),
            ("ca.crt", &ca()),
            ("namespace", "kcp\n"),
        ]);
        let kc = in_cluster_config_from("10.96.0.1", "443", dir.path()).unwrap();
        assert_eq!(kc.cluster_url.to_string(), "https://10.96.0.1:443/");
        assert_eq!(kc.default_namespace, "kcp");
        assert_eq!(kc.root_cert.as_ref().map(Vec::len), Some(1));
        assert_eq!(
            kc.root_cert_file.as_deref(),
            Some(dir.path().join("ca.crt").as_path())
        );
        assert_eq!(
            kc.auth_info.token_file.as_deref(),
            Some(dir.path().join("token").to_str().unwrap())
        );
    }

    #[test]
    fn in_cluster_config_brackets_ipv6_and_keeps_the_port() {
        let dir = sa_dir(&[("token", "t"), ("ca.crt", &ca())]);
        let kc = in_cluster_config_from("fd00::1", "6443", dir.path()).unwrap();
        assert_eq!(kc.cluster_url.to_string(), "https://[fd00::1]:6443/");
        assert_eq!(kc.default_namespace, "default");
    }

    #[test]
    fn in_cluster_config_names_what_is_missing() {
        let dir = sa_dir(&[("ca.crt", &ca())]);
        let e = in_cluster_config_from("10.0.0.1", "443", dir.path()).unwrap_err();
        assert!(e.to_string().contains("token"), "{e}");
        let dir = sa_dir(&[("token", "t"), ("ca.crt", "not a certificate")]);
        let e = in_cluster_config_from("10.0.0.1", "443", dir.path()).unwrap_err();
        assert!(e.to_string().contains("ca.crt"), "{e}");
        let e = in_cluster_config_from("10.0.0.1", "https", dir.path()).unwrap_err();
        assert!(e.to_string().contains("KUBERNETES_SERVICE_PORT"), "{e}");
    }
}
