//! Cache-served lists side by side with the same lists sent directly to kube-apiserver, in
//! one run, against a real kube-apiserver + etcd (the e2e control plane):
//!
//! 1. a `limit=500` walk over every pod (default 100,000 pods of ~10 KB): p50/p99 per page
//!    and full-walk throughput, walks alternating between the two targets;
//! 2. a label selector that matches nothing over every ConfigMap (default 300,000 of ~1 KB):
//!    p50/p99;
//! 3. the proxy's peak extra heap during one page of (1), and during one unpaginated list
//!    of every pod (streamed in chunks): it follows the page, not the list.
//!
//! Both targets are reached the same way: HTTPS, HTTP/1.1 keep-alive, one connection, no
//! compression, bodies read to the end and dropped chunk by chunk.
//!
//!     cargo bench --bench lists
//!     KCP_BENCH_PODS=20000 KCP_BENCH_CMS=50000 KCP_BENCH_WALKS=2 cargo bench --bench lists
//!     KCP_BENCH_WAIT_FILE=/tmp/go cargo bench --bench lists   # measure once /tmp/go exists
//!
//! Wall-clock figures on a shared machine: compare the two targets of the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::config::Config;
use peak_alloc::PeakAlloc;

#[global_allocator]
static HEAP: PeakAlloc = PeakAlloc;

type HttpsClient = Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Full<Bytes>,
>;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn client(cas: &[&str]) -> HttpsClient {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for ca in cas {
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(ca.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
    }
    let tls = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4)
        .build(
            hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls)
                .https_only()
                .enable_http1()
                .build(),
        )
}

/// GET `url`, reading the body chunk by chunk; (status, bytes, elapsed, continue token).
async fn get(
    c: &HttpsClient,
    url: &str,
    token: &str,
    keep: bool,
) -> (u16, u64, Duration, Option<String>) {
    let t = Instant::now();
    let r = c
        .request(
            Request::get(url)
                .header("authorization", format!("Bearer {token}"))
                .header("accept", "application/json")
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = r.status().as_u16();
    let mut body = r.into_body();
    let mut n = 0u64;
    // The head of the body holds `metadata.continue`; keep only what is needed to read it.
    let mut head = Vec::new();
    while let Some(f) = body.frame().await {
        if let Some(d) = f.unwrap().data_ref() {
            n += d.len() as u64;
            if keep && head.len() < 4096 {
                head.extend_from_slice(&d[..d.len().min(4096 - head.len())]);
            }
        }
    }
    let elapsed = t.elapsed();
    let cont = keep.then(|| continue_of(&head)).flatten();
    (status, n, elapsed, cont)
}

fn continue_of(head: &[u8]) -> Option<String> {
    let s = String::from_utf8_lossy(head);
    let i = s.find("\"continue\":\"")? + "\"continue\":\"".len();
    let j = s[i..].find('"')?;
    Some(s[i..i + j].to_string())
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i].as_secs_f64() * 1e3
}

/// Creates `n` objects of about `bytes` each over 10 namespaces, 32 requests in flight.
async fn seed(c: &HttpsClient, base: &str, token: &str, kind: &str, n: u64, bytes: usize) {
    let t = Instant::now();
    let pad = "x".repeat(bytes.saturating_sub(600));
    let c = Arc::new(c.clone());
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (c, next, pad) = (c.clone(), next.clone(), pad.clone());
        let (base, token, kind) = (base.to_string(), token.to_string(), kind.to_string());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    return;
                }
                let ns = format!("bench-{}", i % 10);
                let (path, body) = if kind == "pods" {
                    (
                        format!("/api/v1/namespaces/{ns}/pods"),
                        serde_json::json!({"metadata": {"name": format!("p-{i:06}"), "labels": {"app": "bench"},
                            "annotations": {"pad": pad}},
                            "spec": {"containers": [{"name": "c", "image": "busybox"}]}}),
                    )
                } else {
                    (
                        format!("/api/v1/namespaces/{ns}/configmaps"),
                        serde_json::json!({"metadata": {"name": format!("cm-{i:06}"), "labels": {"app": "bench"}},
                            "data": {"pad": pad}}),
                    )
                };
                let r = c
                    .request(
                        Request::post(format!("{base}{path}"))
                            .header("authorization", format!("Bearer {token}"))
                            .header("content-type", "application/json")
                            .body(Full::from(body.to_string()))
                            .unwrap(),
                    )
                    .await
                    .unwrap();
                let code = r.status();
                let _ = r.into_body().collect().await;
                assert!(code.is_success() || code == 409, "seeding {path}: {code}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    println!(
        "seeded {n} {kind} of ~{bytes} B in {:.0}s ({:.0}/s)",
        t.elapsed().as_secs_f64(),
        n as f64 / t.elapsed().as_secs_f64()
    );
}

#[tokio::main]
async fn main() {
    let pods = env("KCP_BENCH_PODS", 100_000);
    let pod_bytes = env("KCP_BENCH_POD_BYTES", 10_000) as usize;
    let cms = env("KCP_BENCH_CMS", 300_000);
    let cm_bytes = env("KCP_BENCH_CM_BYTES", 1_000) as usize;
    let walks = env("KCP_BENCH_WALKS", 3);
    let settle = env("KCP_BENCH_SETTLE_SECS", 3);
    kube_cache_proxy::http::tls::install_crypto_provider();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane");
    let token = cp.admin_token().to_string();
    let dir = tempfile::tempdir().unwrap();
    let (proxy_ca, cert, key) =
        kube_cache_proxy::http::tls::generate_serving_pair(&["localhost", "127.0.0.1"]).unwrap();
    std::fs::write(dir.path().join("c"), cert).unwrap();
    std::fs::write(dir.path().join("k"), key).unwrap();
    let c = client(&[&cp.ca_pem, &proxy_ca]);
    for i in 0..10 {
        // The namespace and its default ServiceAccount (pods need one).
        cp.create_default_service_account(&format!("bench-{i}"))
            .await
            .unwrap();
    }
    seed(&c, &cp.url, &token, "pods", pods, pod_bytes).await;
    seed(&c, &cp.url, &token, "configmaps", cms, cm_bytes).await;

    let mut cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..Config::default()
    };
    cfg.tls.cert_file = Some(dir.path().join("c"));
    cfg.tls.key_file = Some(dir.path().join("k"));
    cfg.log.level = "warn".into();
    cfg.cache.resources = vec!["pods".into(), "configmaps".into()];
    // Pages of exactly `limit` (the adaptive cap would shorten them to ~100 on an idle proxy).
    cfg.paging.cap_downstream = false;
    // A fixed upstream page size for the initial sync (the adaptive one uses ~100-item pages on
    // an idle apiserver, which makes syncing 400k objects take minutes).
    cfg.paging.adapt_upstream = false;
    let kc = kube::config::Kubeconfig::from_yaml(&cp.admin_kubeconfig_yaml()).unwrap();
    let kube = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    let t = Instant::now();
    let proxy = kube_cache_proxy::app::start::start(cfg, &kube)
        .await
        .unwrap();
    let state = proxy.state.clone();
    loop {
        let ready = |r: &str, n: u64| {
            state
                .caches
                .get("", "v1", r)
                .is_some_and(|c| c.is_ready() && c.unhealthy().is_none() && c.len() as u64 >= n)
        };
        if ready("pods", pods) && ready("configmaps", cms) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(1800),
            "cache never synced"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("proxy synced in {:.1}s", t.elapsed().as_secs_f64());
    // Optionally hold the measurements until a file exists (seed on a busy machine, measure
    // once it is quiet).
    if let Ok(f) = std::env::var("KCP_BENCH_WAIT_FILE") {
        println!("waiting for {f} before measuring");
        while !std::path::Path::new(&f).exists() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let proxy_url = format!("https://localhost:{}", proxy.tls_addr.unwrap().port());
    let targets = [
        ("kube-apiserver", cp.url.clone()),
        ("proxy", proxy_url.clone()),
    ];

    // 1. limit=500 walks over every pod, alternating targets.
    let mut pages: [Vec<Duration>; 2] = [vec![], vec![]];
    let mut walk_rate: [Vec<f64>; 2] = [vec![], vec![]];
    let mut page_bytes = 0u64;
    for w in 0..walks {
        for (ti, (_, base)) in targets.iter().enumerate() {
            // Let the previous walk's aftermath (the apiserver's garbage collection after
            // ~1 GB of responses) settle, so it does not land in the other target's walk.
            tokio::time::sleep(Duration::from_secs(settle)).await;
            let first_page = pages[ti].len();
            let t = Instant::now();
            let mut total = 0u64;
            let mut cont: Option<String> = None;
            let mut n = 0;
            loop {
                let url = match &cont {
                    Some(c) => format!("{base}/api/v1/pods?limit=500&continue={c}"),
                    None => format!("{base}/api/v1/pods?limit=500"),
                };
                let (code, bytes, d, next) = get(&c, &url, &token, true).await;
                assert_eq!(code, 200, "{url}");
                total += bytes;
                pages[ti].push(d);
                n += 1;
                page_bytes = page_bytes.max(bytes);
                match next {
                    Some(c) => cont = Some(c),
                    None => break,
                }
            }
            let secs = t.elapsed().as_secs_f64();
            walk_rate[ti].push(total as f64 / secs);
            let mut this_walk = pages[ti][first_page..].to_vec();
            println!(
                "walk {w} {:>14}: {n} pages, {:.0} MB in {secs:.2}s ({:.2} GB/s), page p50 {:.1} ms p99 {:.1} ms",
                targets[ti].0,
                total as f64 / 1e6,
                total as f64 / secs / 1e9,
                pct(&mut this_walk, 0.50),
                pct(&mut this_walk, 0.99),
            );
        }
    }

    // 2. A label selector that matches nothing, over every ConfigMap.
    let mut nomatch: [Vec<Duration>; 2] = [vec![], vec![]];
    for _ in 0..10 {
        for (ti, (_, base)) in targets.iter().enumerate() {
            let url = format!("{base}/api/v1/configmaps?labelSelector=app%3Dnothing");
            let (code, _, d, _) = get(&c, &url, &token, false).await;
            assert_eq!(code, 200);
            nomatch[ti].push(d);
        }
    }

    // 3. The proxy's peak extra heap for one page, and for one unpaginated list of every pod
    // (the client reads and drops chunks; its own buffers are a few KB).
    let peak = |url: String| {
        let c = c.clone();
        let token = token.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let base = HEAP.current_usage();
            HEAP.reset_peak_usage();
            let (code, bytes, _, _) = get(&c, &url, &token, false).await;
            assert_eq!(code, 200);
            (HEAP.peak_usage().saturating_sub(base), bytes)
        }
    };
    let (page_peak, page_len) = peak(format!("{proxy_url}/api/v1/pods?limit=500")).await;
    let (all_peak, all_len) = peak(format!("{proxy_url}/api/v1/pods")).await;

    let mut out = String::new();
    out += &format!(
        "\n{pods} pods of ~{pod_bytes} B (largest page {:.1} MB), {cms} ConfigMaps of ~{cm_bytes} B, {walks} walks per target\n\n",
        page_bytes as f64 / 1e6
    );
    out += "| measure | kube-apiserver | proxy |\n|---|---|---|\n";
    let rate = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64 / 1e9;
    let [mut a, mut p] = pages;
    out += &format!(
        "| page (limit=500) p50 ms | {:.2} | {:.2} |\n",
        pct(&mut a, 0.5),
        pct(&mut p, 0.5)
    );
    out += &format!(
        "| page (limit=500) p99 ms | {:.2} | {:.2} |\n",
        pct(&mut a, 0.99),
        pct(&mut p, 0.99)
    );
    out += &format!(
        "| full walk GB/s (mean) | {:.3} | {:.3} |\n",
        rate(&walk_rate[0]),
        rate(&walk_rate[1])
    );
    let [mut a, mut p] = nomatch;
    out += &format!(
        "| no-match selector over all ConfigMaps p50 ms | {:.1} | {:.1} |\n",
        pct(&mut a, 0.5),
        pct(&mut p, 0.5)
    );
    out += &format!(
        "| no-match selector over all ConfigMaps p99 ms | {:.1} | {:.1} |\n",
        pct(&mut a, 0.99),
        pct(&mut p, 0.99)
    );
    out += &format!(
        "\nproxy peak extra heap: one page ({:.1} MB body) {:.1} MB; one unpaginated list of every pod ({:.0} MB body) {:.1} MB\n",
        page_len as f64 / 1e6,
        page_peak as f64 / 1e6,
        all_len as f64 / 1e6,
        all_peak as f64 / 1e6
    );
    println!("{out}");
    proxy.begin_shutdown();
    cp.stop().await;
}
