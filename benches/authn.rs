//! Added cost of authentication + authorization per cache-served request, with warm caches
//! (target: <= 20 µs p50): the `authn::Authenticator` and `authz::Authorizer` calls the
//! request path makes, for a static-file token, an offline-verified ServiceAccount JWT and a
//! client certificate. Also the cost of one cold offline JWT verification (what a token cache
//! miss costs before any upstream call).
//!
//! A small in-process upstream answers discovery, JWKS, TokenReview and SubjectAccessReview,
//! so the first (cold) calls succeed; the measured iterations never reach it.
//!
//! Run: `cargo bench --bench authn`. Measured on the 2-core dev machine (Nov 2026, shared),
//! median of 50 samples: static token 0.60 µs, ServiceAccount JWT 1.30 µs, client certificate
//! 0.44 µs per request (authn + authz, warm); one cold offline JWT verification (ES256, the
//! `rust_crypto` backend) 307 µs, paid once per token per `authentication.cacheTtl`.
//! Re-run after the caches became single-flight (moka `try_get_with`, one lookup per call
//! whether hit or miss; machine load ~4): static token 0.93 µs, ServiceAccount JWT 1.44 µs,
//! client certificate 0.65 µs; cold JWT verification 302 µs.

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use jsonwebtoken::{Algorithm, EncodingKey, Header, encode, jwk};
use kube_cache_proxy::auth::authn::{Authenticator, KeySet, Outcome, verify_jwt};
use kube_cache_proxy::auth::authz::{Attributes, Authorizer, Decision};
use kube_cache_proxy::auth::identity::CertIdentity;
use kube_cache_proxy::config::{AuthenticationConfig, UpstreamConfig};
use kube_cache_proxy::tenancy::TenantMapper;
use kube_cache_proxy::upstream::Upstream;
use serde_json::{Value, json};

const ISS: &str = "https://kubernetes.default.svc.cluster.local";

struct Keys {
    enc: EncodingKey,
    jwks: String,
}

fn keys() -> Keys {
    let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let enc = EncodingKey::from_ec_der(&kp.serialize_der());
    let mut j =
        serde_json::to_value(jwk::Jwk::from_encoding_key(&enc, Algorithm::ES256).unwrap()).unwrap();
    j["kid"] = json!("k1");
    j["use"] = json!("sig");
    Keys {
        enc,
        jwks: json!({ "keys": [j] }).to_string(),
    }
}

fn sa_token(k: &Keys) -> String {
    let now = jsonwebtoken::get_current_timestamp();
    let mut h = Header::new(Algorithm::ES256);
    h.kid = Some("k1".into());
    let c = json!({
        "iss": ISS, "aud": [ISS], "sub": "system:serviceaccount:team-a:builder",
        "iat": now, "nbf": now, "exp": now + 3600, "jti": "j",
        "kubernetes.io": {"namespace": "team-a", "serviceaccount": {"name": "builder", "uid": "u"}},
    });
    encode(&h, &c, &k.enc).unwrap()
}

/// Discovery, JWKS, TokenReview and SubjectAccessReview (always allowed) on port 0.
async fn upstream(jwks: String) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let jwks = Arc::new(jwks);
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                return;
            };
            let jwks = jwks.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let jwks = jwks.clone();
                    async move {
                        let path = req.uri().path().to_string();
                        let body = req.into_body().collect().await.unwrap().to_bytes();
                        let out = match path.as_str() {
                            "/.well-known/openid-configuration" => {
                                json!({"issuer": ISS, "jwks_uri": format!("{ISS}/openid/v1/jwks")})
                                    .to_string()
                            }
                            "/openid/v1/jwks" => jwks.to_string(),
                            p if p.ends_with("/tokenreviews") => {
                                let v: Value = serde_json::from_slice(&body).unwrap();
                                json!({"status": {"authenticated": true, "user": {
                                    "username": v["spec"]["token"], "groups": ["system:authenticated"]}}})
                                .to_string()
                            }
                            _ => json!({"status": {"allowed": true}}).to_string(),
                        };
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(out))))
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

/// What the request path does per cache-served request: authenticate, then authorize.
async fn once(
    authn: &Authenticator,
    authz: &Authorizer,
    attrs: &Attributes,
    cert: Option<&CertIdentity>,
    h: &HeaderMap,
) {
    let Outcome::Authenticated(id, _) = authn.authenticate(cert, h).await else {
        panic!("not authenticated");
    };
    assert_eq!(authz.authorize(&id, attrs).await, Decision::Allow);
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let k = keys();
    let url = rt.block_on(upstream(k.jwks.clone()));
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("tokens.csv");
    std::fs::write(&token_file, "static-token,alice,uid-alice,\"dev,ops\"\n").unwrap();
    let (authn, authz) = rt.block_on(async {
        kube_cache_proxy::http::tls::install_crypto_provider();
        let mut kube = kube::Config::new(url.parse().unwrap());
        kube.auth_info.token = Some("proxy".to_string().into());
        let up = Upstream::new(&kube, &UpstreamConfig::default()).unwrap();
        let cfg = AuthenticationConfig {
            token_auth_file: Some(token_file.clone()),
            cache_ttl: Duration::from_secs(600),
            ..AuthenticationConfig::default()
        };
        let authn = Authenticator::new(cfg, TenantMapper::default(), up.clone()).unwrap();
        let authz = Authorizer::new(up, Duration::from_secs(600), Duration::from_secs(600));
        (authn, authz)
    });
    let attrs = Attributes {
        verb: "list".into(),
        version: "v1".into(),
        resource: "pods".into(),
        namespace: "team-a".into(),
        ..Attributes::default()
    };
    let bearer = |t: &str| {
        let mut h = HeaderMap::new();
        h.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {t}")).unwrap(),
        );
        h
    };
    let jwt = sa_token(&k);
    let cases = [
        ("static_token", None, bearer("static-token")),
        ("serviceaccount_jwt", None, bearer(&jwt)),
        (
            "client_certificate",
            Some(CertIdentity {
                user: "carol".into(),
                groups: vec!["ops".into()],
                ..Default::default()
            }),
            HeaderMap::new(),
        ),
    ];
    let mut g = c.benchmark_group("authn_authz_warm");
    for (name, cert, headers) in &cases {
        // Warm the caches (the only upstream calls).
        rt.block_on(once(&authn, &authz, &attrs, cert.as_ref(), headers));
        g.bench_function(*name, |b| {
            b.to_async(&rt).iter(|| {
                once(
                    &authn,
                    &authz,
                    &attrs,
                    black_box(cert.as_ref()),
                    black_box(headers),
                )
            })
        });
    }
    g.finish();
    let ks = KeySet::from_jwks(ISS, k.jwks.as_bytes()).unwrap();
    c.bench_function("jwt_verify_offline_cold", |b| {
        b.iter(|| verify_jwt(black_box(&jwt), &ks, &[], Duration::from_secs(60)).unwrap())
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1)).sample_size(50);
    targets = bench
}
criterion_main!(benches);
