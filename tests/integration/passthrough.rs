//! The proxy as a transparent passthrough in front of the in-process fake apiserver.

use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::{EventReader, TestProxy, body_json, body_string, client_cert};
use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BOUND: Duration = Duration::from_secs(20);

fn req(
    method: Method,
    url: &str,
    token: &str,
    body: Option<serde_json::Value>,
    ct: &str,
) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri(url)
        .header("authorization", format!("Bearer {token}"));
    if body.is_some() {
        b = b.header("content-type", ct);
    }
    b.body(Full::new(
        body.map(|v| Bytes::from(v.to_string())).unwrap_or_default(),
    ))
    .unwrap()
}

async fn setup() -> (FakeApiServer, TestProxy) {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    let proxy = TestProxy::start(&fake.url(), |_| {}).await;
    (fake, proxy)
}

#[tokio::test]
async fn every_verb_passes_through_with_the_callers_own_token() {
    let (fake, proxy) = setup().await;
    for h2 in [false, true] {
        let c = proxy.client(None, h2);
        let name = format!("cm-{h2}");
        let coll = proxy.https("/api/v1/namespaces/ns1/configmaps");
        let item = proxy.https(&format!("/api/v1/namespaces/ns1/configmaps/{name}"));

        let r = c
            .send(req(
                Method::POST,
                &coll,
                "alice-token",
                Some(json!({"metadata": {"name": name}, "data": {"a": "1"}})),
                "application/json",
            ))
            .await;
        assert_eq!(r.status(), StatusCode::CREATED);
        let created = body_json(r).await;
        assert_eq!(created["metadata"]["name"], name.as_str());

        let r = c
            .send(req(Method::GET, &item, "alice-token", None, ""))
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(body_json(r).await["data"]["a"], "1");

        let r = c
            .send(req(Method::GET, &coll, "alice-token", None, ""))
            .await;
        let list = body_json(r).await;
        assert_eq!(list["kind"], "ConfigMapList");
        assert!(
            list["items"]
                .as_array()
                .unwrap()
                .iter()
                .any(|i| i["metadata"]["name"] == name.as_str())
        );

        let mut updated = created.clone();
        updated["data"]["a"] = json!("2");
        let r = c
            .send(req(
                Method::PUT,
                &item,
                "alice-token",
                Some(updated),
                "application/json",
            ))
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(body_json(r).await["data"]["a"], "2");

        let r = c
            .send(req(
                Method::PATCH,
                &item,
                "alice-token",
                Some(json!({"data": {"b": "3"}})),
                "application/merge-patch+json",
            ))
            .await;
        assert_eq!(r.status(), 200);
        let patched = body_json(r).await;
        assert_eq!(
            (patched["data"]["a"].as_str(), patched["data"]["b"].as_str()),
            (Some("2"), Some("3"))
        );

        let r = c
            .send(req(Method::DELETE, &item, "alice-token", None, ""))
            .await;
        assert_eq!(r.status(), 200);
        assert!(
            fake.get(&format!("/api/v1/namespaces/ns1/configmaps/{name}"))
                .is_none()
        );

        let r = c
            .send(req(Method::GET, &item, "alice-token", None, ""))
            .await;
        assert_eq!(r.status(), 404);
        assert_eq!(body_json(r).await["reason"], "NotFound");
    }
    let logged = fake.requests();
    let via_proxy: Vec<_> = logged
        .iter()
        .filter(|r| r.path.contains("/configmaps"))
        .collect();
    assert_eq!(via_proxy.len(), 14);
    for r in via_proxy {
        assert_eq!(
            r.headers["authorization"], "Bearer alice-token",
            "{} {}",
            r.method, r.path
        );
        assert!(!r.headers.contains_key("impersonate-user"));
    }
    // Reads handed to the apiserver are counted with their reason; writes are not reads.
    let metrics = proxy.admin_get("/metrics").await.1;
    let passed = |verb: &str| -> Vec<(String, f64)> {
        metrics
            .lines()
            .filter(|l| l.starts_with("kube_cache_proxy_passthrough_total{"))
            .filter(|l| l.contains(&format!("verb=\"{verb}\"")))
            .filter(|l| l.contains("resource=\"configmaps\""))
            .map(|l| {
                let (labels, v) = l.rsplit_once(' ').unwrap();
                (labels.to_string(), v.parse().unwrap())
            })
            .collect()
    };
    let total = |verb| passed(verb).iter().map(|(_, v)| v).sum::<f64>();
    assert_eq!((total("GET"), total("LIST")), (4.0, 2.0), "{metrics}");
    for (labels, _) in passed("GET").into_iter().chain(passed("LIST")) {
        assert!(labels.contains("reason=\""), "{labels}");
    }
    for verb in ["create", "update", "patch", "delete"] {
        assert!(passed(verb).is_empty(), "{verb}: {metrics}");
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_watch_event_reaches_the_client_while_the_upstream_stream_stays_open() {
    let (fake, proxy) = setup().await;
    let c = proxy.client(None, true);
    let rv = fake.current_rv();
    let url = proxy.https(&format!(
        "/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion={rv}"
    ));
    let r = tokio::time::timeout(BOUND, c.get(&url, Some("t")))
        .await
        .expect("headers flushed before any event");
    assert_eq!(r.status(), 200);
    let mut events = EventReader::new(r);
    fake.create(
        "/api/v1/namespaces/ns1/configmaps",
        json!({"metadata": {"name": "w1"}}),
    )
    .await;
    let ev = tokio::time::timeout(BOUND, events.next())
        .await
        .expect("event delivered while the stream is open")
        .unwrap();
    assert_eq!(ev["type"], "ADDED");
    assert_eq!(ev["object"]["metadata"]["name"], "w1");
    fake.create(
        "/api/v1/namespaces/ns1/configmaps",
        json!({"metadata": {"name": "w2"}}),
    )
    .await;
    let ev = tokio::time::timeout(BOUND, events.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(ev["object"]["metadata"]["name"], "w2");
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_certificate_callers_are_impersonated_and_cannot_strip_it_with_connection() {
    let (fake, proxy) = setup().await;
    let (cert, key) = client_cert(&proxy.client_ca, "jane", &["dev", "ops"]);
    let c = proxy.client(Some((&cert, &key)), false);
    let r = c
        .send(
            Request::get(proxy.https("/api/v1/namespaces/ns1/configmaps"))
                .header(
                    "connection",
                    "impersonate-user, impersonate-group, authorization, x-drop-me",
                )
                .header("x-drop-me", "1")
                .header("x-remote-user", "root")
                .header("authorization", "Bearer stolen")
                .body(Full::default())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status(), 200);
    let logged = fake
        .requests()
        .into_iter()
        .rfind(|r| r.path.ends_with("/configmaps"))
        .unwrap();
    let h = &logged.headers;
    assert_eq!(h["impersonate-user"], "jane");
    let groups: Vec<_> = h
        .get_all("impersonate-group")
        .iter()
        .map(|v| v.to_str().unwrap())
        .collect();
    assert_eq!(groups, ["dev", "ops"]);
    assert_eq!(
        h["authorization"], "Bearer proxy-token",
        "the proxy's own credentials carry the impersonation"
    );
    for gone in ["x-remote-user", "x-drop-me", "connection"] {
        assert!(!h.contains_key(gone), "{gone} must not reach the apiserver");
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn client_certificate_callers_without_impersonate_rights_are_refused() {
    let (fake, proxy) = setup().await;
    let (cert, key) = client_cert(&proxy.client_ca, "jane", &["dev"]);
    let c = proxy.client(Some((&cert, &key)), false);
    let send = |user: &'static str, group: Option<&'static str>| {
        let mut b = Request::get(proxy.https("/api/v1/namespaces/ns1/configmaps"))
            .header("impersonate-user", user);
        if let Some(g) = group {
            b = b.header("impersonate-group", g);
        }
        c.send(b.body(Full::default()).unwrap())
    };
    fake.clear_requests();
    let r = send("system:admin", Some("system:masters")).await;
    assert_eq!(r.status(), 403);
    let body: serde_json::Value = serde_json::from_str(&body_string(r).await).unwrap();
    assert_eq!(body["reason"], "Forbidden");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .starts_with("users \"system:admin\" is forbidden: User \"jane\" cannot impersonate resource \"users\" in API group \"\" at the cluster scope"),
        "{body}"
    );
    assert!(
        !fake
            .requests()
            .iter()
            .any(|r| r.path.ends_with("/configmaps")),
        "a refused impersonation never reaches the apiserver"
    );

    // With impersonate rights (as the apiserver's impersonation filter): the request goes up
    // as the impersonated user and groups, over the proxy's credentials.
    fake.faults().allow_impersonation("jane");
    let r = send("carol", Some("viewers")).await;
    assert_eq!(r.status(), 200);
    let logged = fake
        .requests()
        .into_iter()
        .rfind(|r| r.path.ends_with("/configmaps"))
        .unwrap();
    assert_eq!(logged.headers["impersonate-user"], "carol");
    let groups: Vec<_> = logged.headers.get_all("impersonate-group").iter().collect();
    assert_eq!(groups, ["viewers"]);
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_authorized_certificate_impersonation_goes_up_with_its_uid_and_extra() {
    let (fake, proxy) = setup().await;
    fake.faults().allow_impersonation("jane");
    let (cert, key) = client_cert(&proxy.client_ca, "jane", &["dev"]);
    let c = proxy.client(Some((&cert, &key)), true);
    fake.clear_requests();
    let r = c
        .send(
            Request::get(proxy.https("/api/v1/namespaces/ns1/configmaps"))
                .header("impersonate-user", "carol")
                .header("impersonate-uid", "uid-carol")
                .header("impersonate-extra-scopes", "view")
                .header("impersonate-extra-scopes", "edit")
                // client-go's escaping of the key `example.org/team` (RFC 7230 tokens only).
                .header("impersonate-extra-example.org%2fteam", "blue")
                .body(Full::default())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status(), 200);
    // Every part was authorized, as the apiserver's impersonation filter does.
    let reviews: Vec<serde_json::Value> = fake
        .requests()
        .iter()
        .filter(|r| r.path.ends_with("/subjectaccessreviews"))
        .map(|r| serde_json::from_slice(&r.body).unwrap())
        .collect();
    let checked: Vec<String> = reviews
        .iter()
        .map(|r| {
            let a = &r["spec"]["resourceAttributes"];
            format!(
                "{}/{}/{}",
                a["resource"].as_str().unwrap(),
                a["subresource"].as_str().unwrap(),
                a["name"].as_str().unwrap()
            )
        })
        .collect();
    for want in [
        "users//carol",
        "uids//uid-carol",
        "userextras/scopes/view",
        "userextras/scopes/edit",
        "userextras/example.org/team/blue",
    ] {
        assert!(checked.iter().any(|c| c == want), "{want}: {checked:?}");
    }
    // ...and what was checked goes up: user, uid and every extra value, the key escaped
    // as kube-apiserver unescapes it.
    let logged = fake
        .requests()
        .into_iter()
        .rfind(|r| r.path.ends_with("/configmaps"))
        .unwrap();
    let h = &logged.headers;
    assert_eq!(h["impersonate-user"], "carol");
    assert_eq!(h["impersonate-uid"], "uid-carol");
    let scopes: Vec<_> = h.get_all("impersonate-extra-scopes").iter().collect();
    assert_eq!(scopes, ["view", "edit"]);
    assert_eq!(h["impersonate-extra-example.org%2Fteam"], "blue");
    assert_eq!(
        h.keys()
            .filter(|k| k.as_str().starts_with("impersonate-extra-"))
            .count(),
        2
    );
    assert_eq!(h["authorization"], "Bearer proxy-token");
    proxy.shutdown().await;
}

#[tokio::test]
async fn anonymous_callers_never_borrow_the_proxys_identity() {
    let (fake, proxy) = setup().await;
    let c = proxy.client(None, false);
    let r = c
        .send(
            Request::get(proxy.https("/api/v1/namespaces/ns1/configmaps"))
                .header("impersonate-user", "system:admin")
                .header("x-remote-group", "system:masters")
                .body(Full::default())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status(), 200);
    let logged = fake
        .requests()
        .into_iter()
        .rfind(|r| r.path.ends_with("/configmaps"))
        .unwrap();
    for gone in ["authorization", "x-remote-group"] {
        assert!(
            !logged.headers.contains_key(gone),
            "{gone} present: {:?}",
            logged.headers
        );
    }
    // Its impersonation request goes up with it, without any credentials (the caller pool
    // holds no identity of the proxy's): the apiserver refuses `system:anonymous`'s
    // impersonation itself, in its own words.
    assert_eq!(logged.headers["impersonate-user"], "system:admin");
    // A bearer caller's own impersonation request is the apiserver's to authorize.
    let r = c
        .send(
            Request::get(proxy.https("/api/v1/namespaces/ns1/configmaps"))
                .header("authorization", "Bearer bob-token")
                .header("impersonate-user", "carol")
                .body(Full::default())
                .unwrap(),
        )
        .await;
    assert_eq!(r.status(), 200);
    let logged = fake
        .requests()
        .into_iter()
        .rfind(|r| r.path.ends_with("/configmaps"))
        .unwrap();
    assert_eq!(logged.headers["authorization"], "Bearer bob-token");
    assert_eq!(logged.headers["impersonate-user"], "carol");
    proxy.shutdown().await;
}

#[tokio::test]
async fn upstream_response_headers_and_errors_are_relayed() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    // No readiness probe after the first, so the injected fault meets our request.
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.upstream.health_check_interval = Duration::from_secs(3600)
    })
    .await;
    eventually(
        "the proxy's first readiness probe upstream",
        BOUND,
        async || {
            let requests = fake.requests();
            ok_if(requests.iter().any(|r| r.path == "/readyz"), requests.len())
        },
    )
    .await;
    let c = proxy.client(None, true);
    fake.faults().fail_next(1, 429);
    let r = c
        .get(&proxy.https("/api/v1/namespaces/ns1/configmaps"), Some("t"))
        .await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let s = body_json(r).await;
    assert_eq!(
        (s["kind"].as_str(), s["reason"].as_str()),
        (Some("Status"), Some("TooManyRequests"))
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_unreachable_upstream_gives_a_retryable_status() {
    let fake = FakeApiServer::start().await;
    let url = fake.url();
    fake.shutdown().await;
    let proxy = TestProxy::start(&url, |_| {}).await;
    let c = proxy.client(None, false);
    let r = c.get(&proxy.https("/api/v1/pods"), Some("t")).await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(body_json(r).await["reason"], "ServiceUnavailable");
    proxy.shutdown().await;
}

#[tokio::test]
async fn exec_upgrades_are_relayed_byte_for_byte_and_refusals_close_the_connection() {
    let (fake, proxy) = setup().await;
    fake.create(
        "/api/v1/namespaces/ns1/pods",
        json!({"metadata": {"name": "p1"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}),
    )
    .await;
    // A raw HTTP/1.1 client, as kubectl's SPDY and WebSocket executors are.
    let mut s = tokio::net::TcpStream::connect(proxy.insecure_addr)
        .await
        .unwrap();
    s.write_all(b"POST /api/v1/namespaces/ns1/pods/p1/exec?command=sh HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer t\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\nContent-Length: 0\r\n\r\n").await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        tokio::time::timeout(BOUND, s.read_exact(&mut byte))
            .await
            .unwrap()
            .unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("upgrade: spdy/3.1"),
        "{head}"
    );
    s.write_all(b"ping through the tunnel").await.unwrap();
    let mut echo = [0u8; 23];
    tokio::time::timeout(BOUND, s.read_exact(&mut echo))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&echo, b"ping through the tunnel");
    let logged = fake
        .requests()
        .into_iter()
        .rfind(|r| r.path.ends_with("/exec"))
        .unwrap();
    assert_eq!(logged.headers["upgrade"], "SPDY/3.1");
    assert_eq!(logged.headers["authorization"], "Bearer t");

    // Missing pod: the apiserver's 404 is relayed and the connection closed.
    let mut s = tokio::net::TcpStream::connect(proxy.insecure_addr)
        .await
        .unwrap();
    s.write_all(b"POST /api/v1/namespaces/ns1/pods/nope/exec HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nContent-Length: 0\r\n\r\n").await.unwrap();
    let mut all = Vec::new();
    tokio::time::timeout(BOUND, s.read_to_end(&mut all))
        .await
        .expect("connection closed after a refused upgrade")
        .unwrap();
    let text = String::from_utf8_lossy(&all);
    assert!(text.starts_with("HTTP/1.1 404"), "{text}");
    assert!(text.contains("\"reason\":\"NotFound\""), "{text}");
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_thousand_watch_streams_share_one_http2_connection() {
    let (fake, proxy) = setup().await;
    let tls = proxy.tls_client_config(None, &[b"h2"]);
    let tcp = tokio::net::TcpStream::connect(proxy.tls_addr)
        .await
        .unwrap();
    let stream = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
        .connect("localhost".try_into().unwrap(), tcp)
        .await
        .unwrap();
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (sender, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .handshake::<_, Full<Bytes>>(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    let rv = fake.current_rv();
    let mut opened = Vec::new();
    for _ in 0..1000 {
        let mut s = sender.clone();
        let uri = format!(
            "https://localhost/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion={rv}"
        );
        opened.push(tokio::spawn(async move {
            s.ready().await.unwrap();
            let r = s
                .send_request(
                    Request::get(uri)
                        .header("authorization", "Bearer t")
                        .body(Full::default())
                        .unwrap(),
                )
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            EventReader::new(r)
        }));
    }
    let mut readers = Vec::new();
    for t in opened {
        readers.push(
            tokio::time::timeout(Duration::from_secs(60), t)
                .await
                .expect("all streams open")
                .unwrap(),
        );
    }
    fake.create(
        "/api/v1/namespaces/ns1/configmaps",
        json!({"metadata": {"name": "fanout"}}),
    )
    .await;
    let mut got = 0;
    for mut r in readers {
        let ev = tokio::time::timeout(Duration::from_secs(60), r.next())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(ev["object"]["metadata"]["name"], "fanout");
        got += 1;
    }
    assert_eq!(got, 1000);
    proxy.shutdown().await;
}

#[tokio::test]
async fn the_serving_certificate_is_reloaded_without_a_restart() {
    let (_fake, proxy) = setup().await;
    let (new_ca, cert, key) =
        kube_cache_proxy::http::tls::generate_serving_pair(&["127.0.0.1", "localhost"]).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    use rustls_pki_types::pem::PemObject;
    for c in rustls_pki_types::CertificateDer::pem_slice_iter(new_ca.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(
        rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    ));
    let try_handshake = || async {
        let tcp = tokio::net::TcpStream::connect(proxy.tls_addr)
            .await
            .unwrap();
        connector
            .connect("localhost".try_into().unwrap(), tcp)
            .await
            .is_ok()
    };
    assert!(
        !try_handshake().await,
        "the new CA must not be trusted before the rotation"
    );
    // A key written before its certificate must not break serving.
    std::fs::write(proxy.key_path(), &key).unwrap();
    std::fs::write(proxy.cert_path(), &cert).unwrap();
    eventually("the certificate to be reloaded", BOUND, async || {
        ok_if(try_handshake().await, "the new CA is not trusted yet")
    })
    .await;
    proxy.shutdown().await;
}

#[tokio::test]
async fn graceful_shutdown_fails_readiness_then_ends_watches_cleanly() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    let mut proxy = TestProxy::start(&fake.url(), |c| {
        c.shutdown.delay = Duration::from_millis(800)
    })
    .await;
    let c = proxy.client(None, true);
    let rv = fake.current_rv();
    let w1 = c
        .get(
            &proxy.https(&format!(
                "/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion={rv}"
            )),
            Some("t"),
        )
        .await;
    let w2 = c
        .get(
            &proxy.https(&format!(
                "/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion={rv}"
            )),
            Some("t"),
        )
        .await;
    let mut w1 = EventReader::new(w1);
    let mut w2 = EventReader::new(w2);
    fake.create(
        "/api/v1/namespaces/ns1/configmaps",
        json!({"metadata": {"name": "before"}}),
    )
    .await;
    assert_eq!(
        w1.next().await.unwrap()["object"]["metadata"]["name"],
        "before"
    );
    assert_eq!(
        w2.next().await.unwrap()["object"]["metadata"]["name"],
        "before"
    );

    let running = proxy.running.take().unwrap();
    let state = running.state.clone();
    running.begin_shutdown();
    // Readiness fails once shutdown begins (for the delay, while the listeners still accept)
    // and liveness holds. Asked of the admin listener's own handler in process: on a slow
    // machine a new connection to the admin port could come after the delay has closed it.
    let admin = async |path: &str| {
        use http_body_util::BodyExt as _;
        let conn = kube_cache_proxy::serve::state::ConnInfo {
            peer: None,
            cert: None,
        };
        let req = Request::get(path).body(()).unwrap();
        let r = kube_cache_proxy::serve::admin::handle(&state, &conn, req).await;
        let code = r.status();
        let body = r.into_body().collect().await.unwrap().to_bytes();
        (code, String::from_utf8_lossy(&body).into_owned())
    };
    eventually("readiness to fail", BOUND, async || {
        let (code, body) = admin("/readyz").await;
        if code == 500 {
            assert!(body.contains("[-]shutdown failed"), "{body}");
            return Ok(());
        }
        Err(code)
    })
    .await;
    assert_eq!(admin("/livez").await.0, 200);
    // Then both watches end with a clean end of stream, not an error or a torn event.
    assert_eq!(
        tokio::time::timeout(BOUND, w1.try_next()).await.unwrap(),
        Ok(None)
    );
    assert_eq!(
        tokio::time::timeout(BOUND, w2.try_next()).await.unwrap(),
        Ok(None)
    );
    tokio::time::timeout(BOUND, running.wait())
        .await
        .expect("drain finishes");
}

#[tokio::test]
async fn a_configured_resource_not_yet_discovered_keeps_the_proxy_unready() {
    // The fake apiserver does not serve coordination.k8s.io: a configured built-in resource
    // the apiserver does not serve keeps the proxy unready (a new replica would take traffic
    // it cannot cache). Custom resources never gate readiness (tests/integration/crd.rs).
    let fake = FakeApiServer::start().await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into(), "leases.coordination.k8s.io".into()];
    })
    .await;
    let c = proxy.client(None, false);
    // The upstream probe and discovery are separate rounds: wait for both to have answered
    // (before discovery's first answer every resource reads "discovery has not succeeded yet").
    let body = eventually(
        "a successful upstream probe and discovery",
        BOUND,
        async || {
            let r = c.get(&proxy.admin("/readyz?verbose"), None).await;
            let code = r.status();
            let body = body_string(r).await;
            if body.contains("[+]upstream ok") && !body.contains("discovery has not succeeded yet")
            {
                assert_eq!(code, 500, "{body}");
                return Ok(body);
            }
            Err(body)
        },
    )
    .await;
    // The reason is named (what to fix), not withheld.
    assert!(
        body.lines().any(|l| l.starts_with(
            "[-]cache:leases.coordination.k8s.io failed: not discovered yet: \
             leases.coordination.k8s.io is not served by the apiserver (cache.resources takes"
        )),
        "{body}"
    );
    let r = c
        .get(
            &proxy.admin("/readyz/cache:leases.coordination.k8s.io"),
            None,
        )
        .await;
    assert_eq!(r.status(), 500);
    assert!(body_string(r).await.contains("not discovered yet"));
}

/// Made-up resources, groups, subresources and methods in clients' paths do not become
/// metric labels (each would be a new series in every request metric, from any client, even
/// without credentials): they are counted as resource `other` and verb `other` until an
/// answer shows the resource exists.
#[tokio::test]
async fn made_up_paths_and_methods_do_not_grow_the_metrics() {
    let (_fake, proxy) = setup().await;
    let c = proxy.client(None, false);
    for i in 0..20 {
        let r = c
            .get(
                &proxy.https(&format!(
                    "/apis/made-up-{i}.example/v{i}/namespaces/ns1/things-{i}"
                )),
                Some("t"),
            )
            .await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let r = c
            .get(
                &proxy.https(&format!("/api/v1/namespaces/ns1/configmaps/x/sub-{i}")),
                None,
            )
            .await;
        assert!(r.status().is_client_error(), "{}", r.status());
        let req = Request::builder()
            .method(Method::from_bytes(format!("VERB{i}").as_bytes()).unwrap())
            .uri(proxy.https("/api/v1/namespaces/ns1/configmaps"))
            .header("authorization", "Bearer t")
            .body(Full::default())
            .unwrap();
        c.send(req).await;
    }
    // A resource that exists becomes a label with its first answer.
    let r = c
        .get(&proxy.https("/api/v1/namespaces/ns1/configmaps"), Some("t"))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let m = body_string(c.get(&proxy.admin("/metrics"), None).await).await;
    for made_up in ["made-up-", "things-", "sub-", "VERB"] {
        assert!(!m.contains(made_up), "{made_up} is a label:\n{m}");
    }
    assert!(
        m.contains(r#"kube_cache_proxy_requests_total{verb="LIST",group="",version="",resource="other",subresource="",scope="namespace",code="404",served_by="upstream"} 20"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kube_cache_proxy_requests_total{verb="GET",group="",version="",resource="other",subresource="",scope="resource",code="404",served_by="upstream"} 20"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kube_cache_proxy_upstream_requests_total{verb="other",resource="other",code="405"} 20"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kube_cache_proxy_requests_total{verb="LIST",group="",version="v1",resource="configmaps",subresource="",scope="namespace",code="200",served_by="upstream"} 1"#),
        "{m}"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn health_and_metrics_endpoints_answer_in_the_apiservers_format() {
    let (_fake, proxy) = setup().await;
    let c = proxy.client(None, false);
    eventually("the upstream probe to succeed", BOUND, async || {
        let r = c.get(&proxy.admin("/readyz?verbose"), None).await;
        if r.status() == 200 {
            assert_eq!(
                body_string(r).await,
                "[+]ping ok\n[+]shutdown ok\n[+]upstream ok\nreadyz check passed\n"
            );
            return Ok(());
        }
        Err(body_string(r).await)
    })
    .await;
    assert_eq!(
        body_string(c.get(&proxy.admin("/healthz"), None).await).await,
        "ok"
    );
    assert_eq!(
        body_string(c.get(&proxy.admin("/livez/ping"), None).await).await,
        "ok"
    );
    c.get(&proxy.https("/api/v1/namespaces/ns1/configmaps"), Some("t"))
        .await;
    let m = body_string(c.get(&proxy.admin("/metrics"), None).await).await;
    assert!(
        m.contains(r#"kube_cache_proxy_requests_total{verb="LIST",group="",version="v1",resource="configmaps",subresource="",scope="namespace",code="200",served_by="upstream"} 1"#),
        "{m}"
    );
    assert!(m.contains(r#"kube_cache_proxy_upstream_requests_total{verb="LIST",resource="configmaps",code="200"} 1"#), "{m}");
    // The passed-through LIST's upstream round trip, observed once.
    assert!(
        m.contains(r#"kube_cache_proxy_upstream_request_duration_seconds_count{verb="LIST",resource="configmaps"} 1"#),
        "{m}"
    );
    assert!(
        m.contains("kube_cache_proxy_request_duration_seconds_bucket{"),
        "{m}"
    );
    proxy.shutdown().await;
}

async fn raw_exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut out))
        .await
        .expect("server answers and closes");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn hostile_paths_get_a_bad_request_status_and_never_reach_upstream() {
    let (fake, proxy) = setup().await;
    for path in [
        "/api/v1/namespaces/ns1/../../../secrets",
        "/api/v1//namespaces",
        "/api/v1/namespaces/ns1%2F%2Fconfigmaps",
        "/api/v1/namespaces/%ff%fe",
        "/api/v1/namespaces/%2e%2e/secrets",
    ] {
        let text = raw_exchange(
            proxy.insecure_addr,
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(text.starts_with("HTTP/1.1 400"), "{path}: {text}");
        assert!(
            text.contains("\"kind\":\"Status\"") && text.contains("\"reason\":\"BadRequest\""),
            "{path}: {text}"
        );
    }
    // Raw invalid UTF-8 in the request line: refused by the HTTP parser, no panic.
    let text = raw_exchange(
        proxy.insecure_addr,
        b"GET /api/v1/namespaces/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
    )
    .await;
    assert!(
        text.starts_with("HTTP/1.1 400") || text.is_empty(),
        "{text}"
    );
    assert!(
        fake.requests()
            .iter()
            .all(|r| !r.path.contains("secrets") && !r.path.contains("%")),
        "a hostile path reached upstream"
    );
    // Still serving.
    let c = proxy.client(None, false);
    assert_eq!(c.get(&proxy.admin("/livez"), None).await.status(), 200);
    proxy.shutdown().await;
}

/// The apiserver's limits, not stricter ones: a head up to 1 MiB (one 300 KiB header, or
/// 300 headers) passes; beyond it a 431 Status. A body beyond 3 MiB is a 413 Status over
/// HTTP/1.1 and HTTP/2, announced (content-length) or streamed.
#[tokio::test]
async fn header_and_body_limits_are_the_apiservers() {
    let (fake, proxy) = setup().await;
    let path = "/api/v1/namespaces/ns1/configmaps";
    let big = "a".repeat(300 * 1024);
    let many: String = (0..300).map(|i| format!("X-H{i}: v\r\n")).collect();
    for (what, head) in [
        ("one 300 KiB header", format!("X-Big: {big}\r\n")),
        ("300 headers", many),
    ] {
        fake.clear_requests();
        let text = raw_exchange(
            proxy.insecure_addr,
            format!("GET {path} HTTP/1.1\r\nHost: x\r\n{head}Connection: close\r\n\r\n").as_bytes(),
        )
        .await;
        assert!(
            text.starts_with("HTTP/1.1 200"),
            "{what}: {}",
            &text[..text.len().min(300)]
        );
        let reached = fake.requests().iter().filter(|r| r.path == path).count();
        assert_eq!(reached, 1, "{what} reached the apiserver");
    }
    let over = "a".repeat(1024 * 1024 + 10);
    let text = raw_exchange(
        proxy.insecure_addr,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\nX-Big: {over}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await;
    assert!(
        text.starts_with("HTTP/1.1 431"),
        "{}",
        &text[..text.len().min(200)]
    );
    assert!(text.contains("\"kind\":\"Status\""), "{text}");
    // Far beyond the parser's buffer: hyper refuses it itself; the process survives.
    let huge = "a".repeat(3 * 1024 * 1024);
    let text = raw_exchange(
        proxy.insecure_addr,
        format!("GET / HTTP/1.1\r\nX-Huge: {huge}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 431"),
        "{}",
        &text[..text.len().min(200)]
    );

    let body = Bytes::from(vec![b'x'; 4 * 1024 * 1024]);
    for h2 in [false, true] {
        let c = proxy.client(None, h2);
        let r = c
            .send(
                Request::post(proxy.https(path))
                    .header("authorization", "Bearer t")
                    .header("content-type", "application/json")
                    .body(Full::new(body.clone()))
                    .unwrap(),
            )
            .await;
        assert_eq!(r.status(), 413, "h2={h2}");
        assert_eq!(body_json(r).await["reason"], "RequestEntityTooLarge");
    }
    // Streamed over HTTP/2 (no content-length): the limit is found while forwarding.
    let chunks = (0..64).map(|_| {
        Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(Bytes::from(vec![
            b'x';
            64 * 1024
        ])))
    });
    let streamed = http_body_util::StreamBody::new(futures_util::stream::iter(chunks));
    let h2 = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let r = h2
        .request(
            Request::post(proxy.http(path))
                .header("authorization", "Bearer t")
                .header("content-type", "application/json")
                .body(streamed)
                .unwrap(),
        )
        .await
        .expect("a response, not a reset stream");
    assert_eq!(r.status(), 413);
    let j = crate::support::proxy::body_json(r).await;
    assert_eq!(j["reason"], "RequestEntityTooLarge", "{j}");
    let c = proxy.client(None, false);
    assert_eq!(c.get(&proxy.admin("/livez"), None).await.status(), 200);
    proxy.shutdown().await;
}

/// Request targets the apiserver reads its own way: the HTTP CONNECT method is a 405
/// Status; a `#` is part of the path (Go's `ParseRequestURI`), not a fragment to drop.
#[tokio::test]
async fn connect_is_405_and_a_hash_is_part_of_the_path() {
    let (fake, proxy) = setup().await;
    let text = raw_exchange(
        proxy.insecure_addr,
        b"CONNECT /api/v1/namespaces HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(text.starts_with("HTTP/1.1 405"), "{text}");
    assert!(text.contains("\"reason\":\"MethodNotAllowed\""), "{text}");
    fake.clear_requests();
    let text = raw_exchange(
        proxy.insecure_addr,
        b"GET /api/v1/namespaces/ns1#frag HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    // The namespace `ns1#frag`, which does not exist (kube-apiserver 1.36: 404), never `ns1`.
    assert!(text.starts_with("HTTP/1.1 404"), "{text}");
    let paths: Vec<String> = fake
        .requests()
        .iter()
        .map(|r| r.path.clone())
        .filter(|p| p != "/readyz")
        .collect();
    assert!(
        !paths.contains(&"/api/v1/namespaces/ns1".to_string()),
        "{paths:?}"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn malformed_http2_and_tls_garbage_close_the_connection_without_harm() {
    let (_fake, proxy) = setup().await;
    // h2c preface followed by a frame of an impossible size.
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0x00, 0x00, 0, 0, 0, 0]);
    let _ = raw_exchange(proxy.insecure_addr, &bytes).await;
    // Not a TLS ClientHello at all.
    let out = raw_exchange(proxy.tls_addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(!out.contains("200"), "{out}");
    let c = proxy.client(None, true);
    assert_eq!(c.get(&proxy.admin("/livez"), None).await.status(), 200);
    let m = body_string(c.get(&proxy.admin("/metrics"), None).await).await;
    assert!(
        m.contains(r#"kube_cache_proxy_rejected_total{reason="tls_handshake"} 1"#),
        "{m}"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn upstream_redirects_are_relayed_never_followed() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // A bare upstream that redirects everything.
    let hits = std::sync::Arc::new(AtomicUsize::new(0));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let h = hits.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            let h = h.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |r: Request<hyper::body::Incoming>| {
                    if r.uri().path() != "/readyz" {
                        h.fetch_add(1, Ordering::SeqCst);
                    }
                    async {
                        Ok::<_, std::convert::Infallible>(
                            http::Response::builder()
                                .status(302)
                                .header("location", "http://127.0.0.1:1/elsewhere")
                                .header("warning", "299 - \"deprecated\"")
                                .header("audit-id", "abc")
                                .body(Full::<Bytes>::default())
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                .await;
            });
        }
    });
    let proxy = TestProxy::start(&format!("http://{addr}"), |c| {
        c.upstream.health_check_interval = Duration::from_secs(3600)
    })
    .await;
    let c = proxy.client(None, false);
    let r = c.get(&proxy.https("/api/v1/namespaces"), Some("t")).await;
    assert_eq!(r.status(), 302);
    assert_eq!(r.headers()["location"], "http://127.0.0.1:1/elsewhere");
    assert_eq!(r.headers()["warning"], "299 - \"deprecated\"");
    assert_eq!(r.headers()["audit-id"], "abc");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "exactly one upstream request"
    );
    proxy.shutdown().await;
}

/// The opt-in watch field filter header (`k8s::watch_fields`): a malformed one is the proxy's
/// 400 `Status` naming the problem, for any watch the caller may make (on this path once the
/// apiserver answered); a watch the apiserver answers is told it is unfiltered; the header
/// never reaches the apiserver, and lists ignore it.
#[tokio::test]
async fn watch_field_filters_are_validated_answered_for_and_never_forwarded() {
    let fake = FakeApiServer::start().await;
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    // Nothing cached: the apiserver answers every watch.
    let proxy = TestProxy::start(&fake.url(), |c| c.cache.resources = vec![]).await;
    let c = proxy.client(None, true);
    let ask = |path: &str, fields: &str| {
        Request::get(proxy.https(path))
            .header("authorization", "Bearer t")
            .header("x-kube-cache-proxy-watch-fields", fields)
            .body(Full::default())
            .unwrap()
    };
    let rv = fake.current_rv();
    let watch =
        format!("/api/v1/namespaces/ns1/configmaps?watch=1&resourceVersion={rv}&timeoutSeconds=1");
    let r = c.send(ask(&watch, "spec,-status")).await;
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    let s = body_json(r).await;
    assert_eq!(s["kind"], "Status");
    assert_eq!(s["reason"], "BadRequest");
    assert!(
        s["message"]
            .as_str()
            .unwrap()
            .contains("paths are either all selected or all ignored"),
        "{s}"
    );
    let r = c.send(ask(&watch, "spec")).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(r.headers()["x-kube-cache-proxy-watch-filter"], "unfiltered");
    drop(body_string(r).await);
    // A list: the header means nothing there, not even when malformed.
    let r = c
        .send(ask("/api/v1/namespaces/ns1/configmaps", "spec,-status"))
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(!r.headers().contains_key("x-kube-cache-proxy-watch-filter"));
    let upstream: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| r.path == "/api/v1/namespaces/ns1/configmaps")
        .collect();
    // The malformed watch too: the apiserver authorizes it first (401 and 403 come before
    // the proxy's 400, `watch_fields::a_malformed_filter_is_refused_after_authentication_and_authorization`).
    assert_eq!(upstream.len(), 3, "{upstream:?}");
    assert!(
        upstream
            .iter()
            .all(|r| !r.headers.contains_key("x-kube-cache-proxy-watch-fields")),
        "{upstream:?}"
    );
    proxy.shutdown().await;
}

/// A `#` in the request target is part of the path or query, as kube-apiserver (Go's
/// `url.ParseRequestURI`) reads it, not a fragment to drop: measured on 1.36,
/// `configmaps/cm-1#x` is the object `cm-1#x` (404), `configmaps#x` no resource (404).
/// hyper cuts the target at the `#` (the proxy served `cm-1`); `http::raw_target` gives it
/// back, encoded as `%23`, to the cache and to what passes through.
#[tokio::test]
async fn a_hash_in_the_request_target_is_part_of_it_as_on_the_apiserver() {
    let (fake, proxy) = setup().await;
    fake.create(
        "/api/v1/namespaces/ns1/configmaps",
        json!({"metadata": {"name": "cm-1"}, "data": {"k": "v"}}),
    )
    .await;
    let get = async |target: &str| {
        raw_exchange(
            proxy.insecure_addr,
            format!(
                "GET {target} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n\
                 Connection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
    };
    let item = "/api/v1/namespaces/ns1/configmaps/cm-1";
    let text = eventually("the proxy to serve cm-1", BOUND, async || {
        let t = get(item).await;
        ok_if(t.starts_with("HTTP/1.1 200"), t)
    })
    .await;
    assert!(text.contains("\"name\":\"cm-1\""), "{text}");
    // The object `cm-1#x`, which does not exist.
    fake.clear_requests();
    let text = get(&format!("{item}#x")).await;
    assert!(text.starts_with("HTTP/1.1 404"), "{text}");
    // Answered by the proxy for the name `cm-1#x`, or asked of the apiserver as `cm-1%23x`,
    // which kube-apiserver decodes to that name (the fake does not decode paths).
    let paths: Vec<String> = fake.requests().into_iter().map(|r| r.path).collect();
    assert!(
        text.contains(r#""message":"configmaps \"cm-1#x\" not found""#)
            || paths.contains(&format!("{item}%23x")),
        "{text} {paths:?}"
    );
    assert!(!paths.contains(&item.to_string()), "{paths:?}");
    // Passed through (secrets are not cached): the apiserver is asked for `s-1#x`.
    fake.clear_requests();
    let text = get("/api/v1/namespaces/ns1/secrets/s-1#x").await;
    assert!(text.starts_with("HTTP/1.1 404"), "{text}");
    let paths: Vec<String> = fake.requests().into_iter().map(|r| r.path).collect();
    assert!(
        paths.contains(&"/api/v1/namespaces/ns1/secrets/s-1%23x".to_string()),
        "{paths:?}"
    );
    // The same connection's next request without a `#` is itself.
    let text = raw_exchange(
        proxy.insecure_addr,
        format!(
            "GET {item}#x HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n\r\n\
             GET {item} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n\
             Connection: close\r\n\r\n"
        )
        .as_bytes(),
    )
    .await;
    let first = text.find("HTTP/1.1 404").expect("the first answer is 404");
    let second = text
        .rfind("HTTP/1.1 200")
        .expect("the second answer is 200");
    assert!(first < second, "{text}");
    proxy.shutdown().await;
}
