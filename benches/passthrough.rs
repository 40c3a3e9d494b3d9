//! A micro-benchmark: added latency of the passthrough path, at a fixed request rate, against
//! an in-process fake upstream (the real path, TLS to a real kube-apiserver, is measured by
//! the load driver in `loadtest/`).
//!
//! An in-process upstream answers `GET /api/v1/namespaces/default/configmaps/x` with a fixed
//! ~1 KiB ConfigMap. The same client sends GETs at a fixed rate alternately straight to the
//! upstream and through the proxy (HTTP/1.1 keep-alive on both paths, so the difference is the
//! proxy's work), then through the proxy's TLS listener over HTTP/2. Prints p50/p99/max of each
//! path and the added latency at each percentile.
//!
//!     cargo bench --bench passthrough                     # 500 req/s for 10 s per path
//!     KCP_BENCH_RATE=1000 KCP_BENCH_SECONDS=20 cargo bench --bench passthrough
//!
//! Wall-clock numbers on a shared machine: compare the two paths of the same run, not runs.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube_cache_proxy::config::Config;
use tokio::net::TcpListener;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

async fn upstream() -> SocketAddr {
    let body = Bytes::from(
        serde_json::json!({
            "kind": "ConfigMap", "apiVersion": "v1",
            "metadata": {"name": "x", "namespace": "default", "resourceVersion": "12345",
                         "uid": "0b0b0b0b-0000-4000-8000-000000000000",
                         "labels": {"app": "bench"}},
            "data": {"payload": "y".repeat(900)}
        })
        .to_string(),
    );
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            let body = body.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |_req: Request<hyper::body::Incoming>| {
                    let body = body.clone();
                    async move {
                        let mut r = Response::new(Full::new(body));
                        r.headers_mut()
                            .insert("content-type", "application/json".parse().unwrap());
                        r.headers_mut().insert("audit-id", "bench".parse().unwrap());
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() {
    let rate = env("KCP_BENCH_RATE", 500);
    let secs = env("KCP_BENCH_SECONDS", 10);
    kube_cache_proxy::http::tls::install_crypto_provider();
    let up = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) =
        kube_cache_proxy::http::tls::generate_serving_pair(&["localhost"]).unwrap();
    std::fs::write(dir.path().join("c"), cert).unwrap();
    std::fs::write(dir.path().join("k"), key).unwrap();
    let mut cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        insecure_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..Config::default()
    };
    cfg.tls.cert_file = Some(dir.path().join("c"));
    cfg.tls.key_file = Some(dir.path().join("k"));
    cfg.log.level = "warn".into();
    // The passthrough path only: no cache (the bench upstream serves no discovery).
    cfg.cache.resources.clear();
    // The bench upstream serves neither ServiceAccounts nor RBAC objects.
    cfg.authentication.service_account_lookup = false;
    cfg.cache.authorization_follow_rbac = false;
    let kube = kube::Config::new(format!("http://{up}").parse().unwrap());
    let proxy = kube_cache_proxy::app::start::start(cfg, &kube)
        .await
        .unwrap();
    let path = "/api/v1/namespaces/default/configmaps/x";
    let direct_url = format!("http://{up}{path}");
    let proxy_url = format!("http://{}{path}", proxy.insecure_addr.unwrap());
    let tls_url = format!("https://localhost:{}{path}", proxy.tls_addr.unwrap().port());

    let h1: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut roots = rustls::RootCertStore::empty();
    use rustls_pki_types::pem::PemObject;
    for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let h2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(
            hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_only()
                .enable_http2()
                .build(),
        );
    let h1 = Arc::new(h1);
    let h2 = Arc::new(h2);

    async fn one<C>(c: &Client<C, Full<Bytes>>, url: &str) -> Duration
    where
        C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
    {
        let t = Instant::now();
        let r = c
            .request(
                Request::get(url)
                    .header("authorization", "Bearer bench")
                    .body(Full::default())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert!(r.status().is_success());
        r.into_body().collect().await.unwrap();
        t.elapsed()
    }

    // Warm up connections and code paths.
    for _ in 0..200 {
        one(&h1, &direct_url).await;
        one(&h1, &proxy_url).await;
        one(&h2, &tls_url).await;
    }

    let n = (rate * secs) as usize;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Duration)>();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    for i in 0..n * 3 {
        tick.tick().await;
        let (h1, h2, tx) = (h1.clone(), h2.clone(), tx.clone());
        let (d, p, t) = (direct_url.clone(), proxy_url.clone(), tls_url.clone());
        tokio::spawn(async move {
            let which = i % 3;
            let lat = match which {
                0 => one(&h1, &d).await,
                1 => one(&h1, &p).await,
                _ => one(&h2, &t).await,
            };
            let _ = tx.send((which, lat));
        });
    }
    drop(tx);
    let mut lats = [Vec::new(), Vec::new(), Vec::new()];
    while let Some((w, l)) = rx.recv().await {
        lats[w].push(l);
    }
    let wall = started.elapsed();
    for l in &mut lats {
        l.sort();
    }
    println!(
        "passthrough GET MICRO-BENCHMARK (an in-process fake upstream: not the real path; `loadtest` measures that against kube-apiserver over TLS), {} requests per path, {} req/s in total across the three interleaved paths, {:.1}s",
        n,
        rate,
        wall.as_secs_f64()
    );
    println!("| path | p50 ms | p90 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|");
    for (name, l) in [
        "upstream direct (h1)",
        "via proxy (h1 plain)",
        "via proxy (h2 TLS)",
    ]
    .iter()
    .zip(&lats)
    {
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} | {:.3} |",
            ms(pct(l, 0.5)),
            ms(pct(l, 0.9)),
            ms(pct(l, 0.99)),
            ms(*l.last().unwrap())
        );
    }
    println!(
        "added by the proxy (h1 plain vs direct): p50 {:+.3} ms, p99 {:+.3} ms",
        ms(pct(&lats[1], 0.5)) - ms(pct(&lats[0], 0.5)),
        ms(pct(&lats[1], 0.99)) - ms(pct(&lats[0], 0.99)),
    );
    println!(
        "added by the proxy (h2 TLS vs direct): p50 {:+.3} ms, p99 {:+.3} ms",
        ms(pct(&lats[2], 0.5)) - ms(pct(&lats[0], 0.5)),
        ms(pct(&lats[2], 0.99)) - ms(pct(&lats[0], 0.99)),
    );
    proxy.shutdown().await;
}
