//! Operating the proxy: the access log, the metrics exposition formats, and errors that say
//! what to fix (an unknown cached resource, an unreachable apiserver, a bad config file).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{TestProxy, body_string};
use kube_cache_proxy::config::LogFormat;

const BOUND: Duration = Duration::from_secs(20);

/// Log output captured in memory, formatted as the binary formats it
/// (`app::cli::subscriber`). Installed for the current thread: a `#[tokio::test]` runtime
/// runs the proxy's tasks on it, and tests running in parallel on other threads do not write
/// here.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Captured {
    fn install(filter: &str, format: LogFormat) -> (Captured, tracing::subscriber::DefaultGuard) {
        let c = Captured::default();
        let sub = kube_cache_proxy::app::cli::subscriber(filter, format, false, c.clone());
        let guard = tracing::subscriber::set_default(sub);
        (c, guard)
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock()).into_owned()
    }

    /// The JSON lines whose `message` is `message`.
    fn json_lines(&self, message: &str) -> Vec<Value> {
        self.text()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["message"] == message)
            .collect()
    }
}

const SECRET: &str = "s3cr3t-t0ken-never-logged";

fn get(url: &str, token: &str, ua: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::GET)
        .uri(url)
        .header("authorization", format!("Bearer {token}"))
        .header("user-agent", ua)
        .header("audit-id", format!("audit-{ua}"))
        .body(Full::new(Bytes::new()))
        .unwrap()
}

fn by_ua_in(lines: &[serde_json::Value], ua: &str) -> serde_json::Value {
    lines
        .iter()
        .find(|l| l["user_agent"] == ua)
        .unwrap_or_else(|| panic!("no line for {ua}: {lines:#?}"))
        .clone()
}

/// One access-log line per request, with every field, in JSON; a cache read, a passthrough
/// and a refusal each say who served them; the bearer token appears nowhere; a watch with
/// the opt-in field filter names it.
#[tokio::test]
async fn the_access_log_names_each_request_and_never_its_token() {
    let (logs, _guard) = Captured::install("info", LogFormat::Json);
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    fake.create(
        "/api/v1/namespaces/ns1/configmaps",
        json!({"metadata": {"name": "cm1"}, "data": {"k": "v"}}),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.csv");
    std::fs::write(&tokens, format!("{SECRET},alice,uid-alice,\"dev,ops\"\n")).unwrap();
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.authentication.token_auth_file = Some(tokens.clone());
    })
    .await;
    let c = proxy.client(None, false);
    eventually("the configmaps cache to sync", BOUND, async || {
        let (code, body) = proxy.admin_get("/readyz").await;
        ok_if(code == 200, body)
    })
    .await;

    // A list from the cache, a passthrough (a namespace GET: not cached), a refusal (401).
    let list = "/api/v1/namespaces/ns1/configmaps?limit=500";
    let r = c
        .send(get(&proxy.https(list), SECRET, "cached-reader"))
        .await;
    assert_eq!(r.status(), 200);
    let list_bytes = body_string(r).await.len() as u64;
    let r = c
        .send(get(
            &proxy.https("/api/v1/namespaces/ns1"),
            SECRET,
            "passer",
        ))
        .await;
    assert_eq!(r.status(), 200);
    let ns_bytes = body_string(r).await.len() as u64;
    // A passthrough whose token only the apiserver can judge (a TokenReview would be needed).
    let r = c
        .send(get(
            &proxy.https("/api/v1/namespaces/ns1"),
            "only-the-apiserver-knows",
            "outsider",
        ))
        .await;
    assert_eq!(r.status(), 200);
    body_string(r).await;
    let r = c
        .send(get(
            &proxy.https("/api/v1/configmaps"),
            "invalid-token",
            "refused",
        ))
        .await;
    assert_eq!(r.status(), 401);
    body_string(r).await;
    // A watch with the opt-in field filter, served (and filtered) by the cache.
    let mut w = get(
        &proxy
            .https("/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion=0&timeoutSeconds=1"),
        SECRET,
        "filtered-watcher",
    );
    w.headers_mut().insert(
        "x-kube-cache-proxy-watch-fields",
        http::HeaderValue::from_static("data"),
    );
    let r = c.send(w).await;
    assert_eq!(r.status(), 200);
    body_string(r).await;

    let lines = eventually("five access-log lines", BOUND, async || {
        let l = logs.json_lines("request");
        ok_if(l.len() >= 5, l)
    })
    .await;
    assert_eq!(
        by_ua_in(&lines, "filtered-watcher")["watch_fields"],
        "data applied"
    );
    assert_eq!(by_ua_in(&lines, "cached-reader")["watch_fields"], "-");
    let by_ua = |ua: &str| {
        lines
            .iter()
            .find(|l| l["user_agent"] == ua)
            .unwrap_or_else(|| panic!("no line for {ua}: {lines:#?}"))
            .clone()
    };
    let cached = by_ua("cached-reader");
    assert_eq!(cached["target"], "kube_cache_proxy::access");
    assert_eq!(cached["level"], "INFO");
    assert_eq!(cached["user"], "alice");
    // dev, ops and system:authenticated.
    assert_eq!(cached["groups"], 3);
    assert_eq!(cached["verb"], "LIST");
    assert_eq!(cached["resource"], "configmaps");
    assert_eq!(cached["namespace"], "ns1");
    assert_eq!(cached["method"], "GET");
    assert_eq!(cached["path"], list);
    assert_eq!(cached["code"], 200);
    assert_eq!(cached["served_by"], "cache");
    assert_eq!(cached["bytes"], list_bytes);
    assert!(cached["latency_ms"].as_f64().unwrap() >= 0.0);
    assert_eq!(cached["audit_id"], "audit-cached-reader");
    let peer: std::net::SocketAddr = cached["peer"]
        .as_str()
        .expect("peer is text")
        .parse()
        .expect("peer is an address, not Some(..)");
    assert!(peer.ip().is_loopback());

    let passed = by_ua("passer");
    assert_eq!(passed["served_by"], "apiserver");
    assert_eq!(passed["verb"], "GET");
    assert_eq!(passed["resource"], "namespaces");
    assert_eq!(passed["code"], 200);
    assert_eq!(passed["bytes"], ns_bytes);
    // Passed through, but the proxy knows the caller (its token file): named as on a
    // cache read.
    assert_eq!(passed["user"], "alice");
    assert_eq!(passed["groups"], 3);
    // A caller only the apiserver authenticated: not named.
    let outsider = by_ua("outsider");
    assert_eq!(outsider["served_by"], "apiserver");
    assert_eq!(outsider["code"], 200);
    assert_eq!(outsider["user"], "-");
    assert_eq!(outsider["groups"], 0);

    let refused = by_ua("refused");
    assert_eq!(refused["served_by"], "proxy");
    assert_eq!(refused["code"], 401);
    assert_eq!(refused["user"], "-");
    assert!(refused["bytes"].as_u64().unwrap() > 0);

    let all = logs.text();
    assert!(!all.contains(SECRET), "a token in the log:\n{all}");
    assert!(!all.contains("invalid-token"), "a token in the log:\n{all}");
    assert!(!all.to_ascii_lowercase().contains("bearer"), "{all}");
    assert!(!all.contains('\u{1b}'), "ANSI codes in the log:\n{all}");
}

/// `log.access: off` writes no access lines; sampling 0 none either.
#[tokio::test]
async fn the_access_log_can_be_turned_off() {
    let (logs, _guard) = Captured::install("info", LogFormat::Text);
    let fake = FakeApiServer::start().await;
    for tweak in [
        (|c: &mut kube_cache_proxy::config::Config| c.log.access = false)
            as fn(&mut kube_cache_proxy::config::Config),
        |c| c.log.access_sampling = 0.0,
    ] {
        let proxy = TestProxy::start(&fake.url(), tweak).await;
        let c = proxy.client(None, false);
        let r = c.get(&proxy.https("/version"), Some("bob")).await;
        assert_eq!(r.status(), 200);
        body_string(r).await;
        proxy.shutdown().await;
    }
    // The control: the same request with the defaults writes a line.
    let proxy = TestProxy::start(&fake.url(), |_| {}).await;
    let c = proxy.client(None, false);
    let r = c.get(&proxy.https("/version"), Some("bob")).await;
    body_string(r).await;
    eventually("the control request's line", BOUND, async || {
        let n = logs
            .text()
            .lines()
            .filter(|l| l.contains("kube_cache_proxy::access"))
            .count();
        ok_if(n >= 1, n)
    })
    .await;
    let lines: Vec<String> = logs
        .text()
        .lines()
        .filter(|l| l.contains("kube_cache_proxy::access"))
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 1, "{lines:#?}");
    assert!(lines[0].contains("path=/version"), "{}", lines[0]);
}

/// The metric families of a text-format scrape: (name, HELP seen, TYPE) and every sample's
/// name, checked as `promtool check metrics` reads the format.
fn check_text_004(text: &str) -> Vec<String> {
    use std::collections::{HashMap, HashSet};
    let mut help: HashSet<String> = HashSet::new();
    let mut types: HashMap<String, String> = HashMap::new();
    let mut families = Vec::new();
    for line in text.lines() {
        assert!(!line.is_empty(), "empty line in:\n{text}");
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, h) = rest.split_once(' ').expect("HELP name text");
            assert!(!h.trim().is_empty(), "empty help for {name}");
            assert!(help.insert(name.to_string()), "HELP twice for {name}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, ty) = rest.split_once(' ').expect("TYPE name type");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty),
                "{line}"
            );
            assert!(help.contains(name), "TYPE before HELP for {name}");
            if ty == "counter" {
                assert!(name.ends_with("_total"), "counter without _total: {name}");
            }
            types.insert(name.to_string(), ty.to_string());
            families.push(name.to_string());
            continue;
        }
        assert!(!line.starts_with('#'), "{line:?} is not 0.0.4");
        // name{labels} value
        let name_end = line.find(['{', ' ']).expect("a sample");
        let name = &line[..name_end];
        let value = line.rsplit(' ').next().unwrap();
        assert!(
            value.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&value),
            "{line}"
        );
        let family = ["", "_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let f = name.strip_suffix(suffix)?;
            let ty = types.get(f)?;
            (suffix.is_empty() || ty == "histogram" || ty == "summary").then_some(f)
        });
        assert!(
            family.is_some(),
            "sample {name} has no HELP/TYPE family:\n{text}"
        );
    }
    families
}

/// `/metrics` speaks the text format 0.0.4 (HELP and TYPE for every family, `_total`
/// counters, no `# EOF`) unless the scraper asks for OpenMetrics, and carries the metrics an
/// operator expects: process, build, cache size, upstream health, expired watches.
#[tokio::test]
async fn metrics_are_served_as_text_0_0_4_or_openmetrics_by_accept() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    let cm = json!({"metadata": {"name": "cm1"}, "data": {"k": "v"}});
    fake.create("/api/v1/namespaces/ns1/configmaps", cm.clone())
        .await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
    })
    .await;
    let c = proxy.client(None, false);
    let scrape = async |accept: Option<&str>| {
        let mut b = Request::get(proxy.admin("/metrics"));
        if let Some(a) = accept {
            b = b.header("accept", a);
        }
        let r = c.send(b.body(Full::new(Bytes::new())).unwrap()).await;
        assert_eq!(r.status(), 200);
        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
        (ct, body_string(r).await)
    };
    // Synced and probed: the cache's bytes and the upstream gauge have their values.
    eventually("sync and a successful upstream probe", BOUND, async || {
        let (_, m) = scrape(None).await;
        ok_if(
            m.contains("kube_cache_proxy_upstream_up 1")
                && m.contains("kube_cache_proxy_cache_objects{resource=\"configmaps\"} 1"),
            m,
        )
    })
    .await;
    // A watch from before the cache's first list, which the apiserver has compacted (so
    // the history cannot be extended back to it): 410, counted as too_old.
    fake.compact(fake.writes("configmaps").last().unwrap().rv);
    let r = c
        .get(
            &proxy.https("/api/v1/configmaps?watch=1&resourceVersion=1"),
            Some("alice"),
        )
        .await;
    let body = body_string(r).await;
    assert!(body.contains("\"code\":410"), "{body}");
    // A list from the cache: the latency histogram observes it (not the watch).
    let r = c
        .get(&proxy.https("/api/v1/configmaps"), Some("alice"))
        .await;
    assert_eq!(r.status(), 200);
    body_string(r).await;

    for accept in [None, Some("text/plain"), Some("text/plain;version=0.0.4")] {
        let (ct, text) = scrape(accept).await;
        assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8", "{accept:?}");
        assert!(!text.contains("# EOF"));
        let families = check_text_004(&text);
        for want in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
            "kube_cache_proxy_build_info",
            "kube_cache_proxy_upstream_up",
            "kube_cache_proxy_cache_bytes",
            "kube_cache_proxy_watches_expired_total",
            "kube_cache_proxy_requests_total",
            "kube_cache_proxy_request_duration_seconds",
        ] {
            assert!(
                families.iter().any(|f| f == want),
                "{want} missing:\n{text}"
            );
        }
        let revision = kube_cache_proxy::metrics::REVISION;
        assert!(!revision.is_empty());
        assert!(
            text.contains(&format!(
                "kube_cache_proxy_build_info{{version=\"{}\",revision=\"{revision}\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        // The configmap's bytes as the apiserver sent them in the list.
        let bytes: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix("kube_cache_proxy_cache_bytes{resource=\"configmaps\"} "))
            .expect("cache bytes of configmaps")
            .parse()
            .unwrap();
        assert!(bytes > cm.to_string().len() as f64 / 2.0, "{bytes}");
        assert!(
            text.contains(
                "kube_cache_proxy_watches_expired_total{resource=\"configmaps\",reason=\"too_old\"} 1"
            ),
            "{text}"
        );
        // The scrape stays proportionate to what happened. A per-resource counter appears
        // with its first count, as kube-apiserver's counter vectors do, not at zero for every
        // reason nothing happened for (relists `expired`, continue tokens `invalid`, ...: most
        // of the cache families' lines at 57 resources)...
        assert!(
            text.contains(
                "kube_cache_proxy_upstream_relists_total{resource=\"configmaps\",reason=\"initial\"} 1"
            ),
            "{text}"
        );
        let zeros: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("_total{resource=") && l.ends_with(" 0"))
            .collect();
        assert!(
            zeros.is_empty(),
            "per-resource counters at zero: {zeros:#?}"
        );
        // ...and a watch's duration (its stream's lifetime, not a latency; every dashboard
        // leaves it out) is not observed by the latency histogram: 26 lines per watched
        // resource. The list is.
        assert!(
            text.contains("kube_cache_proxy_request_duration_seconds_count{verb=\"LIST\""),
            "{text}"
        );
        assert!(
            !text.contains("kube_cache_proxy_request_duration_seconds_count{verb=\"WATCH\""),
            "{text}"
        );
        assert!(
            text.contains("kube_cache_proxy_requests_total{verb=\"WATCH\""),
            "{text}"
        );
    }
    let (ct, om) = scrape(Some("application/openmetrics-text; version=1.0.0")).await;
    assert_eq!(
        ct,
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(om.ends_with("# EOF\n"));
    assert!(om.contains("# TYPE kube_cache_proxy_requests counter"));
}

/// A configured resource the apiserver does not serve (a typo) is logged at warn with the
/// reason, at start and on every retry, and `/readyz?verbose` names it with the reason.
#[tokio::test]
async fn an_unknown_cached_resource_is_named_in_the_log_and_readyz() {
    let (logs, _guard) = Captured::install("info", LogFormat::Json);
    let fake = FakeApiServer::start().await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into(), "deployment.apps".into()];
    })
    .await;
    // Until the first discovery has run, the line says "not discovered yet".
    let body = eventually("readyz naming deployment.apps", BOUND, async || {
        let (code, body) = proxy.admin_get("/readyz?verbose").await;
        ok_if(
            code == 500
                && body.contains("[+]upstream ok")
                && body.contains("deployment.apps is not served by the apiserver"),
            body,
        )
    })
    .await;
    let line = body
        .lines()
        .find(|l| l.starts_with("[-]cache:deployment.apps failed: "))
        .unwrap_or_else(|| panic!("{body}"));
    assert!(
        line.contains("deployment.apps is not served by the apiserver")
            && line.contains("deployments.apps"),
        "{line}"
    );
    let warn = |l: &Value| {
        l["level"] == "WARN"
            && l["resource"] == "deployment.apps"
            && l["reason"]
                .as_str()
                .is_some_and(|r| r.contains("is not served by the apiserver"))
    };
    eventually("the warning", BOUND, async || {
        let n = logs
            .json_lines("a resource in cache.resources is not cached; requests for it pass through")
            .iter()
            .filter(|l| warn(l))
            .count();
        ok_if(n >= 1, logs.text())
    })
    .await;
    // And again after the next discovery (retried every 30 s while the name is not served).
    eventually(
        "the warning after a rediscovery",
        Duration::from_secs(120),
        async || {
            let n = logs
                .json_lines(
                    "a resource in cache.resources is not cached; requests for it pass through",
                )
                .iter()
                .filter(|l| warn(l))
                .count();
            ok_if(n >= 2, n)
        },
    )
    .await;
}

/// An unreachable apiserver is named with its address and the cause, on `/readyz/upstream`
/// and in the 503 a passed-through request gets.
#[tokio::test]
async fn an_unreachable_apiserver_is_named_with_address_and_cause() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    // Not ready at once (no degraded time), so `/readyz/upstream` names why.
    let proxy = TestProxy::start(&format!("http://127.0.0.1:{port}"), |c| {
        c.cache.max_staleness = std::time::Duration::ZERO;
    })
    .await;
    let addr = format!("127.0.0.1:{port}");
    let body = eventually("a failed upstream probe", BOUND, async || {
        let (code, body) = proxy.admin_get("/readyz/upstream").await;
        ok_if(code == 500 && !body.contains("not probed yet"), body)
    })
    .await;
    assert!(body.contains(&addr), "{body}");
    assert!(body.contains("Connection refused"), "{body}");
    let c = proxy.client(None, false);
    let r = c
        .get(&proxy.https("/api/v1/namespaces"), Some("alice"))
        .await;
    assert_eq!(r.status(), 503);
    let body = body_string(r).await;
    assert!(
        body.contains(&addr) && body.contains("Connection refused"),
        "{body}"
    );
    assert!(!body.contains("client error (Connect)\""), "{body}");
}

/// A bad configuration file: one line on stderr naming the problem, exit code 1, no
/// backtrace (even with RUST_BACKTRACE set), no Debug dump.
#[test]
fn a_bad_config_file_is_one_line_without_a_backtrace() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "server:\n  maxConnections: many\n").unwrap();
    let kubeconfig = dir.path().join("missing.kubeconfig");
    let cases: [(Vec<&std::ffi::OsStr>, &str); 2] = [
        (
            vec!["serve".as_ref(), "--config".as_ref(), bad.as_os_str()],
            "invalid configuration",
        ),
        // An error at start (after the configuration): the kubeconfig cannot be read.
        (
            vec![
                "serve".as_ref(),
                "--kubeconfig".as_ref(),
                kubeconfig.as_os_str(),
                "--insecure-listen".as_ref(),
                "127.0.0.1:0".as_ref(),
            ],
            "error: ",
        ),
    ];
    for (args, prefix) in cases {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kube-cache-proxy"))
            .args(&args)
            .env("RUST_BACKTRACE", "1")
            .env("RUST_LIB_BACKTRACE", "1")
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line:\n{stderr}");
        assert!(stderr.starts_with(prefix), "{args:?}: {stderr}");
        assert!(!stderr.contains("acktrace"), "{stderr}");
        assert!(!stderr.contains("Caused by"), "{stderr}");
        assert!(!stderr.contains('\u{1b}'), "{stderr}");
        // Each cause once.
        let first = stderr.split(": ").nth(1).unwrap_or_default();
        assert_eq!(stderr.matches(first).count(), 1, "{stderr}");
    }
}

/// A kubeconfig in `dir` for the binary: `fake` as its upstream, with the proxy's token.
/// The binary's `serve` in front of `kubeconfig`'s upstream, with JSON logs on a piped
/// stderr, loopback listeners on free ports, none of the environment's log or in-cluster
/// settings, and `args` (the log level) added.
fn serve_command(kubeconfig: &std::path::Path, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kube-cache-proxy"));
    cmd.args(["serve", "--log-format", "json"])
        .args(args)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args([
            "--insecure-listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("RUST_LOG")
        .env_remove("KCP_LOG_LEVEL")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null());
    cmd
}

fn upstream_kubeconfig(dir: &std::path::Path, fake: &FakeApiServer) -> std::path::PathBuf {
    let kubeconfig = dir.join("upstream.kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\n\
             users:\n- name: proxy\n  user:\n    token: proxy-token\ncontexts:\n- name: fake\n  \
             context:\n    cluster: fake\n    user: proxy\ncurrent-context: fake\n",
            fake.url()
        ),
    )
    .unwrap();
    kubeconfig
}

/// The binary's stderr (not a terminal): no ANSI colour codes; at `--log-level debug` the
/// proxy's lines without hyper's, h2's or rustls' internals, which `RUST_LOG=debug` (the
/// control) does bring.
#[tokio::test]
async fn the_binary_logs_without_colours_and_without_library_debug_noise() {
    use std::io::BufRead;
    let fake = FakeApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = upstream_kubeconfig(dir.path(), &fake);
    let library = |l: &Value| {
        let t = l["target"].as_str().unwrap_or("");
        ["hyper", "hyper_util", "h2", "rustls", "tower"]
            .iter()
            .any(|k| t == *k || t.starts_with(&format!("{k}::")))
            && l["level"] == "DEBUG"
    };
    for rust_log in [None, Some("debug")] {
        let mut cmd = serve_command(&kubeconfig, &["--log-level", "debug"]);
        if let Some(v) = rust_log {
            cmd.env("RUST_LOG", v);
        }
        let mut child = cmd.spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut lines: Vec<String> = Vec::new();
        // Until the proxy has talked to the apiserver (a cache synced) and, for the control,
        // until hyper's debug lines show.
        let done = |lines: &[String]| {
            let parsed: Vec<Value> = lines
                .iter()
                .filter_map(|l| serde_json::from_str(l).ok())
                .collect();
            let synced = parsed.iter().any(|l| l["message"] == "cache synced");
            let noisy = parsed.iter().any(library);
            synced && (rust_log.is_none() || noisy)
        };
        let rx = Arc::new(Mutex::new(rx));
        eventually("the proxy's start-up lines", BOUND, async || {
            while let Ok(l) = rx.lock().try_recv() {
                lines.push(l);
            }
            ok_if(done(&lines), lines.len())
        })
        .await;
        child.kill().unwrap();
        child.wait().unwrap();
        let all = lines.join("\n");
        assert!(!all.contains('\u{1b}'), "ANSI codes on a pipe:\n{all}");
        let parsed: Vec<Value> = lines
            .iter()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|_| panic!("not JSON: {l}")))
            .collect();
        let noisy = parsed.iter().filter(|l| library(l)).count();
        match rust_log {
            None => assert_eq!(noisy, 0, "{all}"),
            Some(_) => assert!(noisy > 0, "the control shows library lines"),
        }
        assert!(parsed.iter().any(|l| l["message"] == "starting"), "{all}");
    }
}

/// The binary's access lines are gathered (`log.accessFlushInterval`) and written at the
/// latest when it exits: with an interval longer than the test, the lines of the requests it
/// served are all on stderr once SIGTERM ended it, in the order the requests ended.
#[tokio::test]
async fn the_binary_writes_its_gathered_access_lines_when_it_exits() {
    use std::io::BufRead;
    let fake = FakeApiServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = upstream_kubeconfig(dir.path(), &fake);
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "log:\n  accessFlushInterval: 60s\n").unwrap();
    // The start-up's lines (the listener's address), the access lines, nothing else: no other
    // line written after the requests writes the gathered ones before its own.
    let mut child = serve_command(
        &kubeconfig,
        &[
            "--log-level",
            "warn,kube_cache_proxy::app=info,kube_cache_proxy::access=info",
        ],
    )
    .arg("--config")
    .arg(&config)
    .spawn()
    .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let rx = Arc::new(Mutex::new(rx));
    let mut lines: Vec<Value> = Vec::new();
    let addr = eventually("the plain listener's address", BOUND, async || {
        while let Ok(l) = rx.lock().try_recv() {
            lines.push(serde_json::from_str(&l).unwrap_or_else(|_| panic!("not JSON: {l}")));
        }
        let addr = lines
            .iter()
            .find(|l| l["message"] == "serving plain HTTP (HTTP/1.1 and h2c) for local use")
            .and_then(|l| l["addr"].as_str().map(str::to_string));
        match addr {
            Some(a) => Ok(a),
            None => Err(lines.len()),
        }
    })
    .await;
    let client = crate::support::proxy::plain_client(false);
    for i in 0..3 {
        let r = client
            .request(
                Request::get(format!("http://{addr}/version"))
                    .header("authorization", "Bearer alice")
                    .header("user-agent", format!("gathered-{i}"))
                    .body(Full::default())
                    .unwrap(),
            )
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        body_string(r).await;
    }
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
    reader.join().unwrap();
    while let Ok(l) = rx.lock().try_recv() {
        lines.push(serde_json::from_str(&l).unwrap_or_else(|_| panic!("not JSON: {l}")));
    }
    let agents: Vec<&str> = lines
        .iter()
        .filter(|l| l["target"] == "kube_cache_proxy::access")
        .filter_map(|l| l["user_agent"].as_str())
        .collect();
    assert_eq!(
        agents,
        ["gathered-0", "gathered-1", "gathered-2"],
        "{lines:#?}"
    );
}
