//! Tests of the fake kube-apiserver itself, so the integration tests built on it can trust it.

use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::support::fake_apiserver::FakeApiServer;

/// Guards every wait so a broken fake fails a test instead of hanging it; never used to order
/// events.
const GUARD: Duration = Duration::from_secs(10);

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Value,
}

async fn send(
    c: &HttpClient,
    method: Method,
    url: String,
    body: Option<&Value>,
    content_type: &str,
) -> Reply {
    let mut req = Request::builder().method(method).uri(url);
    if body.is_some() {
        req = req.header("content-type", content_type);
    }
    let bytes = body
        .map(|b| Bytes::from(serde_json::to_vec(b).unwrap()))
        .unwrap_or_default();
    let resp = tokio::time::timeout(GUARD, c.request(req.body(Full::new(bytes)).unwrap()))
        .await
        .expect("response in time")
        .expect("response");
    let status = resp.status();
    let headers = resp.headers().clone();
    let raw = resp.into_body().collect().await.unwrap().to_bytes();
    let body = serde_json::from_slice(&raw)
        .unwrap_or(Value::String(String::from_utf8_lossy(&raw).into_owned()));
    Reply {
        status,
        headers,
        body,
    }
}

async fn get(c: &HttpClient, url: String) -> Reply {
    send(c, Method::GET, url, None, "").await
}

async fn post(c: &HttpClient, url: String, body: Value) -> Reply {
    send(c, Method::POST, url, Some(&body), "application/json").await
}

fn cm(name: &str, labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}, "data": {"k": name}})
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| {
            let m = &i["metadata"];
            match m["namespace"].as_str() {
                Some(ns) => format!("{ns}/{}", m["name"].as_str().unwrap()),
                None => m["name"].as_str().unwrap().to_string(),
            }
        })
        .collect()
}

fn rv_of(obj: &Value) -> u64 {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .expect("resourceVersion")
        .parse()
        .unwrap()
}

/// An open watch response, read event by event.
struct Watch {
    status: StatusCode,
    headers: HeaderMap,
    body: Incoming,
    buf: Vec<u8>,
}

/// How a watch stream ended.
#[derive(Debug, PartialEq)]
enum End {
    Clean,
    Error,
}

impl Watch {
    async fn open(c: &HttpClient, url: String) -> Watch {
        let req = Request::get(url).body(Full::new(Bytes::new())).unwrap();
        let resp = tokio::time::timeout(GUARD, c.request(req))
            .await
            .expect("watch headers in time")
            .expect("watch response");
        let status = resp.status();
        let headers = resp.headers().clone();
        Watch {
            status,
            headers,
            body: resp.into_body(),
            buf: Vec::new(),
        }
    }

    /// The next event, or how the stream ended.
    async fn next(&mut self) -> Result<Value, End> {
        loop {
            if let Some(pos) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=pos).collect();
                return Ok(serde_json::from_slice(&line).expect("event is JSON"));
            }
            let frame = tokio::time::timeout(GUARD, self.body.frame())
                .await
                .expect("watch progress in time");
            match frame {
                None => {
                    assert!(self.buf.is_empty(), "stream ended mid-event");
                    return Err(End::Clean);
                }
                Some(Err(_)) => return Err(End::Error),
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
            }
        }
    }

    async fn event(&mut self) -> Value {
        self.next().await.expect("an event")
    }

    /// Events until the stream ends, asserting how it ends.
    async fn rest(&mut self, end: End) -> Vec<Value> {
        let mut events = Vec::new();
        loop {
            match self.next().await {
                Ok(e) => events.push(e),
                Err(e) => {
                    assert_eq!(e, end);
                    return events;
                }
            }
        }
    }
}

fn summary(events: &[Value]) -> Vec<(String, String)> {
    events
        .iter()
        .map(|e| {
            (
                e["type"].as_str().unwrap().to_string(),
                e["object"]["metadata"]["name"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
            )
        })
        .collect()
}

fn pair(t: &str, n: &str) -> (String, String) {
    (t.to_string(), n.to_string())
}

#[tokio::test]
async fn configmap_crud_round_trips_and_errors_are_apiserver_statuses() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let base = format!("{}/api/v1/namespaces/default/configmaps", srv.url());

    let created = post(&c, base.clone(), cm("a", json!({"x": "1"}))).await;
    assert_eq!(created.status, StatusCode::CREATED);
    let obj = created.body;
    assert_eq!(obj["kind"], "ConfigMap");
    assert_eq!(obj["metadata"]["namespace"], "default");
    assert!(
        obj["metadata"]["uid"]
            .as_str()
            .is_some_and(|u| !u.is_empty())
    );
    assert!(
        obj["metadata"]["creationTimestamp"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z'))
    );
    assert_eq!(rv_of(&obj), srv.current_rv());

    let got = get(&c, format!("{base}/a")).await;
    assert_eq!(got.status, StatusCode::OK);
    assert_eq!(got.body, obj);

    let dup = post(&c, base.clone(), cm("a", json!({}))).await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert_eq!(
        dup.body,
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
               "message":"configmaps \"a\" already exists","reason":"AlreadyExists",
               "details":{"name":"a","kind":"configmaps"},"code":409})
    );

    let mut stale = obj.clone();
    stale["metadata"]["resourceVersion"] = json!("1");
    stale["data"]["k"] = json!("changed");
    let conflict = send(
        &c,
        Method::PUT,
        format!("{base}/a"),
        Some(&stale),
        "application/json",
    )
    .await;
    assert_eq!(conflict.status, StatusCode::CONFLICT);
    assert_eq!(conflict.body["reason"], "Conflict");
    assert_eq!(
        conflict.body["message"],
        "Operation cannot be fulfilled on configmaps \"a\": the object has been modified; please apply your changes to the latest version and try again"
    );

    let mut fresh = obj.clone();
    fresh["data"]["k"] = json!("changed");
    let updated = send(
        &c,
        Method::PUT,
        format!("{base}/a"),
        Some(&fresh),
        "application/json",
    )
    .await;
    assert_eq!(updated.status, StatusCode::OK);
    assert_eq!(updated.body["data"]["k"], "changed");
    assert_eq!(updated.body["metadata"]["uid"], obj["metadata"]["uid"]);
    assert!(rv_of(&updated.body) > rv_of(&obj));

    let patched = send(
        &c,
        Method::PATCH,
        format!("{base}/a"),
        Some(&json!({"metadata": {"labels": {"y": "2", "x": null}}})),
        "application/merge-patch+json",
    )
    .await;
    assert_eq!(patched.status, StatusCode::OK);
    assert_eq!(patched.body["metadata"]["labels"], json!({"y": "2"}));
    assert_eq!(patched.body["data"]["k"], "changed");

    let strategic = send(
        &c,
        Method::PATCH,
        format!("{base}/a"),
        Some(&json!({"data": {"extra": "v"}})),
        "application/strategic-merge-patch+json",
    )
    .await;
    assert_eq!(strategic.status, StatusCode::OK);
    assert_eq!(
        strategic.body["data"],
        json!({"k": "changed", "extra": "v"})
    );

    let deleted = send(&c, Method::DELETE, format!("{base}/a"), None, "").await;
    assert_eq!(deleted.status, StatusCode::OK);
    assert_eq!(
        deleted.body,
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Success",
               "details":{"name":"a","kind":"configmaps","uid":obj["metadata"]["uid"]}})
    );

    let missing = get(&c, format!("{base}/a")).await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(
        missing.body,
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
               "message":"configmaps \"a\" not found","reason":"NotFound",
               "details":{"name":"a","kind":"configmaps"},"code":404})
    );
    let missing_delete = send(&c, Method::DELETE, format!("{base}/a"), None, "").await;
    assert_eq!(missing_delete.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn pods_and_namespaces_get_server_set_status_and_delete_returns_the_object() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let ns = post(
        &c,
        format!("{}/api/v1/namespaces", srv.url()),
        json!({"metadata": {"name": "team"}}),
    )
    .await;
    assert_eq!(ns.status, StatusCode::CREATED);
    assert_eq!(ns.body["status"]["phase"], "Active");
    assert_eq!(
        ns.body["metadata"]["labels"]["kubernetes.io/metadata.name"],
        "team"
    );

    let pod = post(
        &c,
        format!("{}/api/v1/namespaces/team/pods", srv.url()),
        json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}, "status": {"phase": "Running"}}),
    )
    .await;
    assert_eq!(pod.status, StatusCode::CREATED);
    assert_eq!(pod.body["status"]["phase"], "Pending");

    let deleted = send(
        &c,
        Method::DELETE,
        format!("{}/api/v1/namespaces/team/pods/p", srv.url()),
        None,
        "",
    )
    .await;
    assert_eq!(deleted.status, StatusCode::OK);
    assert_eq!(deleted.body["kind"], "Pod");
    assert_eq!(rv_of(&deleted.body), srv.current_rv());

    let ns_deleted = send(
        &c,
        Method::DELETE,
        format!("{}/api/v1/namespaces/team", srv.url()),
        None,
        "",
    )
    .await;
    assert_eq!(ns_deleted.status, StatusCode::OK);
    assert_eq!(ns_deleted.body["status"]["phase"], "Terminating");
    assert!(ns_deleted.body["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(
        get(&c, format!("{}/api/v1/namespaces/team", srv.url()))
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn creating_in_a_missing_namespace_is_namespace_not_found() {
    let srv = FakeApiServer::start().await;
    let r = post(
        &client(),
        format!("{}/api/v1/namespaces/nope/configmaps", srv.url()),
        cm("a", json!({})),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(r.body["message"], "namespaces \"nope\" not found");
    assert_eq!(
        r.body["details"],
        json!({"name": "nope", "kind": "namespaces"})
    );
}

#[tokio::test]
async fn malformed_json_is_a_bad_request_status() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let req = Request::post(format!(
        "{}/api/v1/namespaces/default/configmaps",
        srv.url()
    ))
    .header("content-type", "application/json")
    .body(Full::new(Bytes::from_static(b"{not json")))
    .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["reason"], "BadRequest");
    assert_eq!(body["code"], 400);
    assert_eq!(srv.get("/api/v1/namespaces/default/configmaps/a"), None);
}

#[tokio::test]
async fn list_pagination_walks_the_whole_set_in_key_order_with_remaining_counts() {
    let srv = FakeApiServer::start().await;
    let c = client();
    for ns in ["b", "a"] {
        srv.create("/api/v1/namespaces", json!({"metadata": {"name": ns}}))
            .await;
    }
    for (ns, name) in [
        ("b", "x"),
        ("a", "z"),
        ("a", "y"),
        ("b", "w"),
        ("a", "x"),
        ("b", "v"),
        ("a", "w"),
    ] {
        srv.create(
            &format!("/api/v1/namespaces/{ns}/configmaps"),
            cm(name, json!({})),
        )
        .await;
    }
    let snapshot_rv = srv.current_rv();

    let mut seen = Vec::new();
    let mut remaining = Vec::new();
    let mut url = format!("{}/api/v1/configmaps?limit=3", srv.url());
    loop {
        let page = get(&c, url.clone()).await;
        assert_eq!(page.status, StatusCode::OK);
        assert_eq!(page.body["kind"], "ConfigMapList");
        assert_eq!(page.body["apiVersion"], "v1");
        assert_eq!(
            page.body["metadata"]["resourceVersion"],
            snapshot_rv.to_string()
        );
        assert!(
            page.body["items"][0].get("kind").is_none(),
            "list items carry no kind"
        );
        seen.extend(names(&page.body));
        remaining.push(page.body["metadata"]["remainingItemCount"].as_i64());
        // A write between pages must not show up: pages come from one snapshot.
        srv.create(
            "/api/v1/namespaces/a/configmaps",
            json!({"metadata": {"generateName": "late-"}}),
        )
        .await;
        match page.body["metadata"]["continue"].as_str() {
            Some(token) => {
                let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
                    .decode(token)
                    .unwrap();
                let decoded: Value = serde_json::from_slice(&raw).unwrap();
                assert_eq!(decoded["v"], "meta.k8s.io/v1");
                assert_eq!(decoded["rv"], snapshot_rv);
                assert!(decoded["start"].as_str().unwrap().ends_with('\u{0}'));
                url = format!("{}/api/v1/configmaps?limit=3&continue={token}", srv.url());
            }
            None => break,
        }
    }
    assert_eq!(seen, ["a/w", "a/x", "a/y", "a/z", "b/v", "b/w", "b/x"]);
    assert_eq!(remaining, [Some(4), Some(1), None]);

    let namespaced = get(
        &c,
        format!("{}/api/v1/namespaces/b/configmaps?limit=2", srv.url()),
    )
    .await;
    assert_eq!(names(&namespaced.body), ["b/v", "b/w"]);
    let token = namespaced.body["metadata"]["continue"].as_str().unwrap();
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token)
        .unwrap();
    let decoded: Value = serde_json::from_slice(&raw).unwrap();
    assert_eq!(
        decoded["start"], "w\u{0}",
        "namespaced tokens are relative to the namespace"
    );
}

#[tokio::test]
async fn selectors_filter_lists_and_unsupported_fields_are_bad_requests() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let base = "/api/v1/namespaces/default/configmaps";
    srv.create(base, cm("a", json!({"app": "web", "tier": "1"})))
        .await;
    srv.create(base, cm("b", json!({"app": "db"}))).await;
    srv.create(base, cm("c", json!({}))).await;
    let cases = [
        ("labelSelector=app%3Dweb", vec!["default/a"]),
        ("labelSelector=app%3D%3Ddb", vec!["default/b"]),
        ("labelSelector=app!%3Dweb", vec!["default/b", "default/c"]),
        (
            "labelSelector=app%20in%20(web,db)",
            vec!["default/a", "default/b"],
        ),
        (
            "labelSelector=app%20notin%20(web)",
            vec!["default/b", "default/c"],
        ),
        ("labelSelector=app", vec!["default/a", "default/b"]),
        ("labelSelector=!app", vec!["default/c"]),
        ("labelSelector=app,tier", vec!["default/a"]),
        ("fieldSelector=metadata.name%3Db", vec!["default/b"]),
        (
            "fieldSelector=metadata.name!%3Db",
            vec!["default/a", "default/c"],
        ),
        (
            "fieldSelector=metadata.namespace%3Ddefault&labelSelector=app",
            vec!["default/a", "default/b"],
        ),
    ];
    for (q, want) in cases {
        let r = get(&c, format!("{}{base}?{q}", srv.url())).await;
        assert_eq!(r.status, StatusCode::OK, "{q}");
        assert_eq!(names(&r.body), want, "{q}");
    }
    let bad = get(
        &c,
        format!("{}{base}?fieldSelector=spec.foo%3Dx", srv.url()),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        bad.body["message"],
        "\"spec.foo\" is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
    );
    let bad_label = get(&c, format!("{}{base}?labelSelector=app%20in%20", srv.url())).await;
    assert_eq!(bad_label.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn exact_list_at_an_older_resource_version_returns_the_state_then() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let base = "/api/v1/namespaces/default/configmaps";
    srv.create(base, cm("a", json!({}))).await;
    let then = srv.current_rv();
    srv.create(base, cm("b", json!({}))).await;
    srv.delete(&format!("{base}/a")).await;

    let now = get(&c, format!("{}{base}", srv.url())).await;
    assert_eq!(names(&now.body), ["default/b"]);
    let exact = get(
        &c,
        format!(
            "{}{base}?resourceVersion={then}&resourceVersionMatch=Exact",
            srv.url()
        ),
    )
    .await;
    assert_eq!(exact.status, StatusCode::OK);
    assert_eq!(names(&exact.body), ["default/a"]);
    assert_eq!(exact.body["metadata"]["resourceVersion"], then.to_string());
    assert_eq!(rv_of(&exact.body["items"][0]), then);

    // The legacy form: a resourceVersion with a limit and no match is Exact too.
    let legacy = get(
        &c,
        format!("{}{base}?resourceVersion={then}&limit=10", srv.url()),
    )
    .await;
    assert_eq!(names(&legacy.body), ["default/a"]);
}

#[tokio::test]
async fn compacted_exact_lists_and_continues_get_410_expired() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let base = "/api/v1/namespaces/default/configmaps";
    for n in ["a", "b", "c"] {
        srv.create(base, cm(n, json!({}))).await;
    }
    let old = srv.current_rv();
    let first = get(&c, format!("{}{base}?limit=1", srv.url())).await;
    let token = first.body["metadata"]["continue"]
        .as_str()
        .unwrap()
        .to_string();
    srv.create(base, cm("d", json!({}))).await;
    srv.compact(srv.current_rv());

    let exact = get(
        &c,
        format!(
            "{}{base}?resourceVersion={old}&resourceVersionMatch=Exact",
            srv.url()
        ),
    )
    .await;
    assert_eq!(exact.status, StatusCode::GONE);
    assert_eq!(
        exact.body,
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
               "message":"The resourceVersion for the provided list is too old.","reason":"Expired","code":410})
    );

    let cont = get(&c, format!("{}{base}?limit=1&continue={token}", srv.url())).await;
    assert_eq!(cont.status, StatusCode::GONE);
    assert_eq!(cont.body["reason"], "Expired");
    assert!(cont.body["message"].as_str().unwrap().starts_with(
        "The provided continue parameter is too old to display a consistent list result."
    ));
    // The inconsistent-continuation token (rv -1) continues at the latest state.
    let next = cont.body["metadata"]["continue"].as_str().unwrap();
    let rest = get(&c, format!("{}{base}?continue={next}", srv.url())).await;
    assert_eq!(rest.status, StatusCode::OK);
    assert_eq!(names(&rest.body), ["default/b", "default/c", "default/d"]);
}

#[tokio::test]
async fn list_for_a_future_resource_version_waits_for_it() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let want = srv.current_rv() + 1;
    let url = format!(
        "{}/api/v1/namespaces/default/configmaps?resourceVersion={want}",
        srv.url()
    );
    let pending = tokio::spawn(async move { get(&c, url).await });
    // The list cannot answer before the write: it answers at a resourceVersion >= want.
    while !srv.requests().iter().any(|r| {
        r.query
            .as_deref()
            .is_some_and(|q| q.contains("resourceVersion="))
    }) {
        tokio::task::yield_now().await;
    }
    srv.create("/api/v1/namespaces/default/configmaps", cm("a", json!({})))
        .await;
    let r = pending.await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(names(&r.body), ["default/a"]);
    assert_eq!(r.body["metadata"]["resourceVersion"], want.to_string());
}

#[tokio::test]
async fn list_for_a_resource_version_that_never_comes_is_504_too_large_with_retry_after() {
    let srv = FakeApiServer::start().await;
    let current = srv.current_rv();
    let want = current + 100;
    let r = get(
        &client(),
        format!(
            "{}/api/v1/configmaps?resourceVersion={want}&resourceVersionMatch=NotOlderThan",
            srv.url()
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(r.headers["retry-after"], "1");
    assert_eq!(
        r.body,
        json!({"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
               "message":format!("Timeout: Too large resource version: {want}, current: {current}"),
               "reason":"Timeout",
               "details":{"causes":[{"reason":"ResourceVersionTooLarge","message":"Too large resource version"}],"retryAfterSeconds":1},
               "code":504})
    );
}

#[tokio::test]
async fn watch_from_a_resource_version_sees_exactly_the_later_events() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let base = "/api/v1/namespaces/default/configmaps";
    srv.create(base, cm("before", json!({}))).await;
    let from = srv.current_rv();
    srv.create(base, cm("a", json!({}))).await;
    let mut b = srv.create(base, cm("b", json!({}))).await;
    srv.create(
        "/api/v1/namespaces/kube-system/configmaps",
        cm("other-ns", json!({})),
    )
    .await;
    srv.create(
        "/api/v1/namespaces/default/pods",
        json!({"metadata": {"name": "other-kind"}}),
    )
    .await;
    b["data"]["k"] = json!("v2");
    srv.update(&format!("{base}/b"), b).await;
    srv.delete(&format!("{base}/a")).await;

    let mut w = Watch::open(
        &c,
        format!("{}{base}?watch=1&resourceVersion={from}", srv.url()),
    )
    .await;
    assert_eq!(w.status, StatusCode::OK);
    assert_eq!(w.headers["content-type"], "application/json");
    srv.faults().end_watches_cleanly();
    let events = w.rest(End::Clean).await;
    assert_eq!(
        summary(&events),
        [
            pair("ADDED", "a"),
            pair("ADDED", "b"),
            pair("MODIFIED", "b"),
            pair("DELETED", "a")
        ]
    );
    let rvs: Vec<u64> = events.iter().map(|e| rv_of(&e["object"])).collect();
    assert!(rvs.windows(2).all(|p| p[0] < p[1]), "increasing: {rvs:?}");
    assert_eq!(
        *rvs.last().unwrap(),
        srv.current_rv(),
        "DELETED carries the deletion's rv"
    );
    assert_eq!(events[0]["object"]["kind"], "ConfigMap");
}

#[tokio::test]
async fn watch_without_resource_version_starts_with_added_events_then_streams_changes() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let base = "/api/v1/namespaces/default/configmaps";
    srv.create(base, cm("a", json!({}))).await;
    let mut w = Watch::open(&c, format!("{}{base}?watch=true", srv.url())).await;
    assert_eq!(summary(&[w.event().await]), [pair("ADDED", "a")]);
    srv.create(base, cm("b", json!({}))).await;
    assert_eq!(summary(&[w.event().await]), [pair("ADDED", "b")]);
}

#[tokio::test]
async fn watch_headers_arrive_before_any_event() {
    let srv = FakeApiServer::start().await;
    let rv = srv.current_rv();
    // No events exist after rv: the response still arrives (Watch::open would time out).
    let mut w = Watch::open(
        &client(),
        format!(
            "{}/api/v1/configmaps?watch=1&resourceVersion={rv}",
            srv.url()
        ),
    )
    .await;
    assert_eq!(w.status, StatusCode::OK);
    srv.create("/api/v1/namespaces/default/configmaps", cm("a", json!({})))
        .await;
    assert_eq!(summary(&[w.event().await]), [pair("ADDED", "a")]);
}

#[tokio::test]
async fn watch_from_a_compacted_resource_version_gets_one_410_error_event_and_ends() {
    let srv = FakeApiServer::start().await;
    let base = "/api/v1/namespaces/default/configmaps";
    srv.create(base, cm("a", json!({}))).await;
    let old = srv.current_rv();
    srv.create(base, cm("b", json!({}))).await;
    let compacted = srv.current_rv();
    srv.compact(compacted);

    let mut w = Watch::open(
        &client(),
        format!("{}{base}?watch=1&resourceVersion={old}", srv.url()),
    )
    .await;
    assert_eq!(w.status, StatusCode::OK);
    let events = w.rest(End::Clean).await;
    assert_eq!(
        events,
        [
            json!({"type": "ERROR", "object": {"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure",
            "message": format!("too old resource version: {old} ({compacted})"),"reason":"Expired","code":410}})
        ]
    );
}

#[tokio::test]
async fn send_initial_events_ends_with_the_initial_events_end_bookmark() {
    let srv = FakeApiServer::start().await;
    let base = "/api/v1/namespaces/default/configmaps";
    srv.create(base, cm("b", json!({}))).await;
    srv.create(base, cm("a", json!({}))).await;
    let rv = srv.current_rv();
    let mut w = Watch::open(
        &client(),
        format!(
            "{}{base}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true",
            srv.url()
        ),
    )
    .await;
    let first = [w.event().await, w.event().await];
    assert_eq!(summary(&first), [pair("ADDED", "a"), pair("ADDED", "b")]);
    let end = w.event().await;
    assert_eq!(
        end,
        json!({"type": "BOOKMARK", "object": {"kind": "ConfigMap", "apiVersion": "v1",
            "metadata": {"resourceVersion": rv.to_string(), "annotations": {"k8s.io/initial-events-end": "true"}}}})
    );
    srv.create(base, cm("c", json!({}))).await;
    let next = w.event().await;
    assert_eq!(summary(&[next]), [pair("ADDED", "c")]);
}

#[tokio::test]
async fn send_initial_events_without_not_older_than_is_invalid() {
    let srv = FakeApiServer::start().await;
    let r = get(
        &client(),
        format!(
            "{}/api/v1/configmaps?watch=1&sendInitialEvents=true",
            srv.url()
        ),
    )
    .await;
    assert_eq!(r.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(r.body["reason"], "Invalid");
}

#[tokio::test]
async fn bookmarks_arrive_periodically_with_only_kind_api_version_and_resource_version() {
    let srv = FakeApiServer::start().await;
    srv.faults()
        .set_bookmark_interval(Duration::from_millis(20));
    let rv = srv.current_rv();
    let mut w = Watch::open(
        &client(),
        format!(
            "{}/api/v1/pods?watch=1&resourceVersion={rv}&allowWatchBookmarks=true",
            srv.url()
        ),
    )
    .await;
    for _ in 0..2 {
        assert_eq!(
            w.event().await,
            json!({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                "metadata": {"resourceVersion": rv.to_string()}}})
        );
    }
}

#[tokio::test]
async fn a_new_bookmark_period_applies_to_open_watches_at_once() {
    let srv = FakeApiServer::start().await;
    srv.faults()
        .set_bookmark_interval(Duration::from_secs(3600));
    let rv = srv.current_rv();
    let mut w = Watch::open(
        &client(),
        format!(
            "{}/api/v1/configmaps?watch=1&resourceVersion={rv}&allowWatchBookmarks=true",
            srv.url()
        ),
    )
    .await;
    // Shorter: a bookmark comes now, not an hour after the watch began.
    srv.faults()
        .set_bookmark_interval(Duration::from_millis(20));
    assert_eq!(w.event().await["type"], "BOOKMARK");
    // Longer: once set, no bookmark carries a later revision (here a pod's, written before
    // the ConfigMap whose event ends the check); those queued before carry an earlier one.
    srv.faults()
        .set_bookmark_interval(Duration::from_secs(3600));
    let pod = srv
        .create(
            "/api/v1/namespaces/default/pods",
            json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}),
        )
        .await;
    let pod_rv: u64 = pod["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    srv.create(
        "/api/v1/namespaces/default/configmaps",
        json!({"metadata": {"name": "after"}}),
    )
    .await;
    loop {
        let ev = w.event().await;
        if ev["type"] == "ADDED" {
            assert_eq!(ev["object"]["metadata"]["name"], "after");
            break;
        }
        assert_eq!(ev["type"], "BOOKMARK", "{ev}");
        let at: u64 = ev["object"]["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(at < pod_rv, "a bookmark at {at}, after the period grew");
    }
}

#[tokio::test]
async fn watch_selectors_turn_objects_entering_and_leaving_the_selection_into_added_and_deleted() {
    let srv = FakeApiServer::start().await;
    let base = "/api/v1/namespaces/default/configmaps";
    let rv = srv.current_rv();
    let mut w = Watch::open(
        &client(),
        format!(
            "{}{base}?watch=1&resourceVersion={rv}&labelSelector=app%3Dweb",
            srv.url()
        ),
    )
    .await;
    let a = srv.create(base, cm("a", json!({"app": "db"}))).await;
    let mut a2 = a.clone();
    a2["metadata"]["labels"]["app"] = json!("web");
    let a2 = srv.update(&format!("{base}/a"), a2).await;
    let mut a3 = a2.clone();
    a3["metadata"]["labels"]["app"] = json!("db");
    srv.update(&format!("{base}/a"), a3).await;
    srv.faults().end_watches_cleanly();
    let events = w.rest(End::Clean).await;
    assert_eq!(summary(&events), [pair("ADDED", "a"), pair("DELETED", "a")]);
    assert_eq!(
        events[1]["object"]["metadata"]["labels"]["app"], "web",
        "DELETED shows the last matching state"
    );
    assert_eq!(rv_of(&events[1]["object"]), srv.current_rv());
}

#[tokio::test]
async fn timeout_seconds_ends_the_watch_cleanly() {
    let srv = FakeApiServer::start().await;
    let rv = srv.current_rv();
    let mut w = Watch::open(
        &client(),
        format!(
            "{}/api/v1/configmaps?watch=1&resourceVersion={rv}&timeoutSeconds=1",
            srv.url()
        ),
    )
    .await;
    assert!(w.rest(End::Clean).await.is_empty());
}

#[tokio::test]
async fn fail_next_fails_exactly_that_many_requests_with_a_status() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let url = format!("{}/api/v1/configmaps", srv.url());
    srv.faults().fail_next(2, 429);
    for _ in 0..2 {
        let r = get(&c, url.clone()).await;
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers["retry-after"], "1");
        assert_eq!(r.body["reason"], "TooManyRequests");
        assert_eq!(r.body["details"]["retryAfterSeconds"], 1);
    }
    assert_eq!(get(&c, url.clone()).await.status, StatusCode::OK);

    for (code, reason) in [
        (500, "InternalError"),
        (503, "ServiceUnavailable"),
        (410, "Expired"),
    ] {
        srv.faults().fail_next(1, code);
        let r = get(&c, url.clone()).await;
        assert_eq!(r.status.as_u16(), code);
        assert_eq!(r.body["reason"], reason);
        assert_eq!(r.body["code"], code);
    }
    assert_eq!(srv.requests().len(), 6, "failed requests are logged too");
}

#[tokio::test]
async fn drop_watches_ends_open_streams_with_an_error() {
    let srv = FakeApiServer::start().await;
    let rv = srv.current_rv();
    let mut w = Watch::open(
        &client(),
        format!(
            "{}/api/v1/configmaps?watch=1&resourceVersion={rv}",
            srv.url()
        ),
    )
    .await;
    srv.faults().drop_watches();
    assert!(w.rest(End::Error).await.is_empty());
}

#[tokio::test]
async fn end_watches_cleanly_ends_open_streams_without_error() {
    let srv = FakeApiServer::start().await;
    let mut w = Watch::open(
        &client(),
        format!("{}/api/v1/namespaces?watch=1", srv.url()),
    )
    .await;
    srv.faults().end_watches_cleanly();
    let initial = w.rest(End::Clean).await;
    assert_eq!(initial.len(), 4, "the initial namespaces, then a clean end");
}

#[tokio::test]
async fn refuse_closes_connections_without_a_response_until_switched_off() {
    let srv = FakeApiServer::start().await;
    srv.faults().set_refuse(true);
    let mut stream = tokio::net::TcpStream::connect(srv.addr()).await.unwrap();
    let _ = stream
        .write_all(b"GET /livez HTTP/1.1\r\nhost: x\r\n\r\n")
        .await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(GUARD, stream.read_to_end(&mut buf))
        .await
        .unwrap();
    assert!(
        read.is_err() || buf.is_empty(),
        "no response while refusing"
    );
    srv.faults().set_refuse(false);
    assert_eq!(
        get(&client(), format!("{}/livez", srv.url())).await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn delay_holds_every_response_back() {
    let srv = FakeApiServer::start().await;
    srv.faults().set_delay(Duration::from_millis(200));
    let start = std::time::Instant::now();
    assert_eq!(
        get(&client(), format!("{}/readyz", srv.url())).await.status,
        StatusCode::OK
    );
    assert!(start.elapsed() >= Duration::from_millis(200));
}

#[tokio::test]
async fn exec_upgrade_switches_protocols_and_echoes_bytes() {
    let srv = FakeApiServer::start().await;
    srv.create(
        "/api/v1/namespaces/default/pods",
        json!({"metadata": {"name": "p"}}),
    )
    .await;
    let stream = tokio::net::TcpStream::connect(srv.addr()).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn.with_upgrades());
    let req = Request::post("/api/v1/namespaces/default/pods/p/exec?command=sh&stdin=true")
        .header("host", "fake")
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .header(
            "sec-websocket-protocol",
            "v5.channel.k8s.io, v4.channel.k8s.io",
        )
        .header("x-stream-protocol-version", "v4.channel.k8s.io")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = sender.send_request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SWITCHING_PROTOCOLS);
    assert_eq!(resp.headers()["upgrade"], "websocket");
    assert_eq!(
        resp.headers()["sec-websocket-accept"],
        "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    );
    assert_eq!(
        resp.headers()["sec-websocket-protocol"],
        "v5.channel.k8s.io"
    );
    assert_eq!(
        resp.headers()["x-stream-protocol-version"],
        "v4.channel.k8s.io"
    );
    let upgraded = hyper::upgrade::on(resp).await.unwrap();
    let mut io = TokioIo::new(upgraded);
    io.write_all(b"hello, pod").await.unwrap();
    let mut buf = [0u8; 10];
    tokio::time::timeout(GUARD, io.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&buf, b"hello, pod");

    let logged = srv.requests().pop().unwrap();
    assert_eq!(logged.method, Method::POST);
    assert_eq!(logged.path, "/api/v1/namespaces/default/pods/p/exec");
    assert_eq!(logged.query.as_deref(), Some("command=sh&stdin=true"));
    assert!(logged.body.is_empty());
}

#[tokio::test]
async fn exec_for_a_missing_pod_is_404_and_without_upgrade_is_400() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let missing = Request::get(format!(
        "{}/api/v1/namespaces/default/pods/nope/exec",
        srv.url()
    ))
    .header("connection", "Upgrade")
    .header("upgrade", "SPDY/3.1")
    .body(Full::new(Bytes::new()))
    .unwrap();
    let resp = c.request(missing).await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let body: Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["message"], "pods \"nope\" not found");

    srv.create(
        "/api/v1/namespaces/default/pods",
        json!({"metadata": {"name": "p"}}),
    )
    .await;
    let plain = get(
        &c,
        format!("{}/api/v1/namespaces/default/pods/p/attach", srv.url()),
    )
    .await;
    assert_eq!(plain.status, StatusCode::BAD_REQUEST);
    assert_eq!(plain.body["message"], "Upgrade request required");
}

#[tokio::test]
async fn every_request_is_logged_with_method_path_query_headers_and_body() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let body = cm("a", json!({}));
    post(
        &c,
        format!(
            "{}/api/v1/namespaces/default/configmaps?fieldManager=t",
            srv.url()
        ),
        body.clone(),
    )
    .await;
    get(&c, format!("{}/version", srv.url())).await;
    let log = srv.requests();
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].method, Method::POST);
    assert_eq!(log[0].path, "/api/v1/namespaces/default/configmaps");
    assert_eq!(log[0].query.as_deref(), Some("fieldManager=t"));
    assert_eq!(log[0].headers["content-type"], "application/json");
    assert_eq!(serde_json::from_slice::<Value>(&log[0].body).unwrap(), body);
    assert_eq!(log[1].path, "/version");
    assert_eq!(log[1].query, None);
    srv.clear_requests();
    assert!(srv.requests().is_empty());
}

#[tokio::test]
async fn discovery_and_health_endpoints_answer() {
    let srv = FakeApiServer::start().await;
    let c = client();
    for p in ["/livez", "/readyz", "/healthz"] {
        let r = get(&c, format!("{}{p}", srv.url())).await;
        assert_eq!((r.status, r.body), (StatusCode::OK, json!("ok")));
    }
    let api = get(&c, format!("{}/api", srv.url())).await;
    assert_eq!(api.body["versions"], json!(["v1"]));
    let v1 = get(&c, format!("{}/api/v1", srv.url())).await;
    let resources = v1.body["resources"].as_array().unwrap();
    let cms = resources
        .iter()
        .find(|r| r["name"] == "configmaps")
        .unwrap();
    assert_eq!(cms["kind"], "ConfigMap");
    assert_eq!(cms["namespaced"], true);
    assert!(cms["verbs"].as_array().unwrap().contains(&json!("watch")));
    assert!(resources.iter().any(|r| r["name"] == "pods/exec"));
    let version = get(&c, format!("{}/version", srv.url())).await;
    assert_eq!(version.body["major"], "1");
    let unknown = get(&c, format!("{}/api/v1/widgets", srv.url())).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
    assert_eq!(
        unknown.body["message"],
        "the server could not find the requested resource"
    );
}

#[tokio::test]
async fn http2_prior_knowledge_is_served() {
    let srv = FakeApiServer::start().await;
    let c: HttpClient = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let req = Request::get(format!("{}/api/v1/namespaces/default", srv.url()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test]
async fn shutdown_ends_open_watches() {
    let srv = FakeApiServer::start().await;
    let rv = srv.current_rv();
    let mut w = Watch::open(
        &client(),
        format!(
            "{}/api/v1/configmaps?watch=1&resourceVersion={rv}",
            srv.url()
        ),
    )
    .await;
    srv.shutdown().await;
    assert!(w.rest(End::Error).await.is_empty());
}

#[tokio::test]
async fn pod_status_changes_only_through_the_status_subresource_and_field_selectors_see_it() {
    let srv = FakeApiServer::start().await;
    let c = client();
    let pods = "/api/v1/namespaces/default/pods";
    let p = srv
        .create(
            pods,
            json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}}),
        )
        .await;
    let rv = srv.current_rv();
    let mut w = Watch::open(
        &c,
        format!("{}/api/v1/watch/namespaces/default/pods?resourceVersion={rv}&fieldSelector=status.phase%3DRunning", srv.url()),
    )
    .await;

    let mut main = p.clone();
    main["status"]["phase"] = json!("Running");
    let via_main = send(
        &c,
        Method::PUT,
        format!("{}{pods}/p", srv.url()),
        Some(&main),
        "application/json",
    )
    .await;
    assert_eq!(via_main.status, StatusCode::OK);
    assert_eq!(
        via_main.body["status"]["phase"], "Pending",
        "the main resource keeps status"
    );

    let via_status = send(
        &c,
        Method::PATCH,
        format!("{}{pods}/p/status", srv.url()),
        Some(&json!({"status": {"phase": "Running"}})),
        "application/merge-patch+json",
    )
    .await;
    assert_eq!(via_status.status, StatusCode::OK);
    assert_eq!(via_status.body["status"]["phase"], "Running");
    assert_eq!(summary(&[w.event().await]), [pair("ADDED", "p")]);

    let on_node = get(
        &c,
        format!(
            "{}/api/v1/pods?fieldSelector=spec.nodeName%3Dn1,status.phase%3DRunning",
            srv.url()
        ),
    )
    .await;
    assert_eq!(names(&on_node.body), ["default/p"]);
    let bad = get(
        &c,
        format!("{}/api/v1/pods?fieldSelector=spec.bogus%3Dx", srv.url()),
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert_eq!(bad.body["message"], "field label not supported: spec.bogus");
}
