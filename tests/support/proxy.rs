//! The proxy embedded in a test on port 0, with generated TLS material, and HTTP clients that
//! talk to it over HTTP/1.1, HTTP/2 (ALPN) or h2c, with or without a client certificate.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::TokioExecutor;
use kube_cache_proxy::app::start::{self as server, Running};
use kube_cache_proxy::config::Config;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

pub struct TestProxy {
    pub running: Option<Running>,
    pub tls_addr: SocketAddr,
    pub insecure_addr: SocketAddr,
    /// The admin listener (TLS, the same serving certificate): the proxy's own health,
    /// `/metrics` and `/debug/*`.
    pub admin_addr: SocketAddr,
    /// CA that signed the proxy's serving certificate.
    pub ca_pem: String,
    pub dir: tempfile::TempDir,
    pub client_ca: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// What it was started with, for [`TestProxy::restart`].
    started: (Config, kube::Config),
}

/// A client CA for mTLS tests: (PEM certificate, issuer).
pub fn client_ca() -> (String, rcgen::Issuer<'static, rcgen::KeyPair>) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name
        .push(DnType::CommonName, "test-client-ca");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let cert = p.self_signed(&key).unwrap();
    (cert.pem(), rcgen::Issuer::new(p, key))
}

/// A client certificate (PEM cert, PEM key) with CN `user` and O `groups`.
pub fn client_cert(
    issuer: &rcgen::Issuer<'static, rcgen::KeyPair>,
    user: &str,
    groups: &[&str],
) -> (String, String) {
    use rcgen::{CertificateParams, DnType, KeyPair};
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.distinguished_name.push(DnType::CommonName, user);
    // rcgen keeps one value per attribute type; a second O goes in under its OID (2.5.4.10)
    // as a custom type, which encodes identically. Two groups are enough for the tests.
    assert!(groups.len() <= 2, "at most two groups");
    for (i, g) in groups.iter().enumerate() {
        let t = if i == 0 {
            DnType::OrganizationName
        } else {
            DnType::CustomDnType(vec![2, 5, 4, 10])
        };
        p.distinguished_name.push(t, *g);
    }
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let cert = p.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl TestProxy {
    /// The running proxy's cache of a resource (`None`: not cached, or not yet discovered).
    pub fn cache(
        &self,
        group: &str,
        version: &str,
        resource: &str,
    ) -> Option<std::sync::Arc<kube_cache_proxy::cache::ResourceCache>> {
        self.running
            .as_ref()?
            .state
            .caches
            .get(group, version, resource)
    }

    /// Starts the proxy in front of `upstream_url` (a plain-HTTP fake apiserver), with the
    /// proxy's own credential `Bearer proxy-token`, TLS + mTLS on one port and plain HTTP on
    /// another. `tweak` adjusts the config first.
    /// The cache is off unless `tweak` configures resources: these tests are about the
    /// transparent proxy, and the fake apiserver implements no access reviews. Adaptive
    /// paging samples (and scrapes the fake's `/metrics`) only if `tweak` shortens
    /// `paging.interval`, so tests that count or fault upstream requests meet no scrape.
    /// The fake speaks no protobuf watch, so the resources' protobuf sides start only with a
    /// protobuf reader (`cache.protobufSide: lazy`): started with every resource they would
    /// only fail and retry against it, adding upstream requests.
    /// For the same reason offline JWT verification (and with it the background fetch of the
    /// issuer's keys) is off unless `tweak` turns it on (the fake serves keys only after
    /// `Faults::set_jwks`), and so are the caches the proxy keeps for itself (ServiceAccounts
    /// for the token lookup, RBAC objects for decisions), which would add upstream requests.
    pub async fn start(upstream_url: &str, tweak: impl FnOnce(&mut Config)) -> TestProxy {
        Self::start_with_kube(Self::fake_kube(upstream_url), |c| {
            Self::fake_defaults(c);
            tweak(c)
        })
        .await
    }

    /// The proxy's connection to a plain-HTTP fake apiserver, with its own credential.
    fn fake_kube(upstream_url: &str) -> kube::Config {
        let mut kube = kube::Config::new(upstream_url.parse().unwrap());
        kube.auth_info.token = Some("proxy-token".to_string().into());
        kube
    }

    /// What [`Self::start`] turns off in front of the fake apiserver (see there).
    fn fake_defaults(c: &mut Config) {
        c.cache.resources.clear();
        c.paging.interval = std::time::Duration::from_secs(3600);
        c.authentication.service_account_jwt = false;
        c.authentication.service_account_lookup = false;
        c.cache.authorization_follow_rbac = false;
        c.cache.protobuf_side = kube_cache_proxy::config::ProtobufSide::Lazy;
    }

    /// Starts the proxy in front of a real control plane, with the admin's credentials as
    /// its own; when `static_users` names a file, the apiserver's static token users are
    /// written there and given to the proxy too (`authentication.tokenAuthFile`).
    pub async fn start_for(
        cp: &kube_cache_proxy::app::dev::ControlPlane,
        static_users: Option<&std::path::Path>,
        tweak: impl FnOnce(&mut Config),
    ) -> TestProxy {
        let mut kube = kube::Config::new(cp.url.parse().expect("apiserver URL"));
        kube.root_cert = Some(
            CertificateDer::pem_slice_iter(cp.ca_pem.as_bytes())
                .map(|c| c.expect("CA PEM").to_vec())
                .collect(),
        );
        kube.auth_info.token = Some(cp.admin_token().to_string().into());
        if let Some(path) = static_users {
            std::fs::write(path, kube_cache_proxy::app::dev::token_auth_file(&cp.users)).unwrap();
        }
        let file = static_users.map(std::path::Path::to_path_buf);
        Self::start_with_kube(kube, |c| {
            if file.is_some() {
                c.authentication.token_auth_file = file;
            }
            tweak(c)
        })
        .await
    }

    /// Starts the proxy in front of the apiserver `kube` describes (its credentials become the
    /// proxy's own).
    pub async fn start_with_kube(kube: kube::Config, tweak: impl FnOnce(&mut Config)) -> TestProxy {
        kube_cache_proxy::http::tls::install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let (ca_pem, cert, key) =
            kube_cache_proxy::http::tls::generate_serving_pair(&["127.0.0.1", "localhost"])
                .unwrap();
        std::fs::write(dir.path().join("tls.crt"), cert).unwrap();
        std::fs::write(dir.path().join("tls.key"), key).unwrap();
        let (client_ca_pem, client_ca) = client_ca();
        std::fs::write(dir.path().join("client-ca.crt"), client_ca_pem).unwrap();
        let cfg = config_in(dir.path(), tweak);
        let started = (cfg.clone(), kube.clone());
        let running = server::start(cfg, &kube).await.expect("proxy starts");
        TestProxy {
            started,
            tls_addr: running.tls_addr.unwrap(),
            insecure_addr: running.insecure_addr.unwrap(),
            admin_addr: running.admin_addr.unwrap(),
            running: Some(running),
            ca_pem,
            dir,
            client_ca,
        }
    }

    pub fn https(&self, path: &str) -> String {
        format!("https://localhost:{}{path}", self.tls_addr.port())
    }

    /// A URL on the admin listener (HTTPS, trusted by [`Self::client`]).
    pub fn admin(&self, path: &str) -> String {
        format!("https://localhost:{}{path}", self.admin_addr.port())
    }

    /// A GET on the admin listener without credentials: (status, body).
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        let r = self.client(None, false).get(&self.admin(path), None).await;
        (r.status().as_u16(), body_string(r).await)
    }

    pub fn http(&self, path: &str) -> String {
        format!("http://{}{path}", self.insecure_addr)
    }

    /// A kubeconfig (YAML) for the proxy's TLS listener with a bearer token.
    /// A watch through the plain listener (HTTP/2 when `h2c`) as the bearer `token`;
    /// panics unless the proxy answers 200.
    pub async fn watch_plain(&self, path_and_query: &str, token: &str, h2c: bool) -> EventReader {
        let r = plain_client(h2c)
            .request(
                Request::get(self.http(path_and_query))
                    .header("authorization", format!("Bearer {token}"))
                    .body(Full::default())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "watch {path_and_query}");
        EventReader::new(r)
    }

    pub fn kubeconfig_yaml(&self, token: &str) -> String {
        kube_cache_proxy::app::dev::ControlPlane::kubeconfig_yaml(
            &self.https(""),
            Some(&self.ca_pem),
            Some(token),
            None,
        )
    }

    pub fn cert_path(&self) -> PathBuf {
        self.dir.path().join("tls.crt")
    }

    pub fn key_path(&self) -> PathBuf {
        self.dir.path().join("tls.key")
    }

    /// A rustls client config trusting the proxy's CA, optionally with a client certificate.
    pub fn tls_client_config(
        &self,
        identity: Option<(&str, &str)>,
        alpn: &[&[u8]],
    ) -> rustls::ClientConfig {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let b = rustls::ClientConfig::builder().with_root_certificates(roots);
        let mut cfg = match identity {
            Some((cert, key)) => b
                .with_client_auth_cert(
                    CertificateDer::pem_slice_iter(cert.as_bytes())
                        .map(Result::unwrap)
                        .collect(),
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => b.with_no_client_auth(),
        };
        cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        cfg
    }

    /// A pooled HTTPS client (HTTP/2 when `h2`, else HTTP/1.1).
    pub fn client(&self, identity: Option<(&str, &str)>, h2: bool) -> TestClient {
        // hyper-rustls sets ALPN itself from the enabled protocols.
        let tls = self.tls_client_config(identity, &[]);
        let b = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        let conn = if h2 {
            b.enable_http2().build()
        } else {
            b.enable_http1().build()
        };
        let mut cb = Client::builder(TokioExecutor::new());
        cb.http2_only(h2);
        TestClient(cb.build(conn))
    }

    /// Stops the proxy gracefully (as SIGTERM does) and starts it again with the same
    /// configuration, serving certificate and addresses, as a restarted container would be:
    /// clients reconnect to the same URL.
    ///
    /// # Panics
    /// If the new proxy cannot bind the old addresses (another socket took one meanwhile)
    /// after a few tries.
    pub async fn restart(&mut self, tweak: impl FnOnce(&mut Config)) {
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
        let (mut cfg, kube) = self.started.clone();
        cfg.listen = self.tls_addr;
        cfg.insecure_listen = Some(self.insecure_addr);
        cfg.server.admin_listen = Some(self.admin_addr);
        tweak(&mut cfg);
        let mut last_error = None;
        // A closed listener's port can be taken by an outgoing connection's ephemeral port
        // before it is bound again; rare, and a retry with a pause gets past it.
        for _ in 0..20 {
            match server::start(cfg.clone(), &kube).await {
                Ok(running) => {
                    self.running = Some(running);
                    return;
                }
                Err(e) => last_error = Some(e.to_string()),
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        panic!("the restarted proxy could not start: {last_error:?}");
    }

    pub async fn shutdown(mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown().await;
        }
    }
}

/// The tests' proxy configuration with the TLS material in `dir`, on port 0.
fn config_in(dir: &std::path::Path, tweak: impl FnOnce(&mut Config)) -> Config {
    let mut cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        insecure_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..Config::default()
    };
    cfg.tls.cert_file = Some(dir.join("tls.crt"));
    cfg.tls.key_file = Some(dir.join("tls.key"));
    cfg.tls.client_ca_file = Some(dir.join("client-ca.crt"));
    cfg.tls.reload_interval = std::time::Duration::from_millis(100);
    cfg.upstream.health_check_interval = std::time::Duration::from_millis(200);
    cfg.shutdown.drain_timeout = std::time::Duration::from_secs(10);
    cfg.server.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    // Tests that are not about the admin listener's access control read it without
    // credentials; those that are set `kubernetes`.
    cfg.server.admin_auth = kube_cache_proxy::config::AdminAuth::None;
    tweak(&mut cfg);
    cfg
}

pub struct TestClient(pub Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>);

impl TestClient {
    pub async fn send(&self, req: Request<Full<Bytes>>) -> Response<Incoming> {
        self.0.request(req).await.expect("request to the proxy")
    }

    pub async fn get(&self, url: &str, token: Option<&str>) -> Response<Incoming> {
        let mut b = Request::get(url);
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        self.send(b.body(Full::default()).unwrap()).await
    }
}

/// A plain-HTTP client (HTTP/1.1, or h2c with prior knowledge).
pub fn plain_client(h2c: bool) -> Client<HttpConnector, Full<Bytes>> {
    let mut b = Client::builder(TokioExecutor::new());
    b.http2_only(h2c);
    b.build(HttpConnector::new())
}

pub async fn body_json(r: Response<Incoming>) -> serde_json::Value {
    let b = r.into_body().collect().await.unwrap().to_bytes();
    serde_json::from_slice(&b)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&b)))
}

pub async fn body_string(r: Response<Incoming>) -> String {
    let b = r.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&b).into_owned()
}

/// Reads newline-delimited watch events from a streaming body.
pub struct EventReader {
    body: Incoming,
    buf: Vec<u8>,
}

impl EventReader {
    pub fn new(r: Response<Incoming>) -> EventReader {
        EventReader {
            body: r.into_body(),
            buf: Vec::new(),
        }
    }

    /// The next event, or `None` at a clean end of stream. Panics on a body error.
    pub async fn next(&mut self) -> Option<serde_json::Value> {
        self.try_next().await.expect("watch stream error")
    }

    /// The next event; `Err` if the stream failed (not a clean end).
    pub async fn try_next(&mut self) -> Result<Option<serde_json::Value>, String> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Ok(Some(
                    serde_json::from_slice(&line).map_err(|e| e.to_string())?,
                ));
            }
            match self.body.frame().await {
                None => {
                    return if self.buf.is_empty() {
                        Ok(None)
                    } else {
                        Err(format!(
                            "stream ended mid-event: {:?}",
                            String::from_utf8_lossy(&self.buf)
                        ))
                    };
                }
                Some(Err(e)) => return Err(e.to_string()),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }
}

pub type SharedIssuer = Arc<rcgen::Issuer<'static, rcgen::KeyPair>>;

/// An HTTPS client of kube-apiserver trusting `ca_pem` (HTTP/1.1, and HTTP/2 when `h2`: an
/// HTTP/2 client drops a `Connection` header before it reaches the server).
pub type Https = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

pub fn apiserver_client(ca_pem: &str, h2: bool) -> Https {
    kube_cache_proxy::http::tls::install_crypto_provider();
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let conn = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1();
    let conn = if h2 {
        conn.enable_http2().build()
    } else {
        conn.build()
    };
    Client::builder(TokioExecutor::new()).build(conn)
}
