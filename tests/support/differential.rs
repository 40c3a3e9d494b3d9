//! Differential checking: one corpus of requests sent to two backends, the answers compared
//! semantically.
//!
//! The subject (the proxy, or the in-process fake apiserver) must answer every request the way
//! the reference (a real kube-apiserver) does. A difference fails the check unless the
//! allow-list names it with a reason.
//!
//! # Layout
//! - corpus model: [`Corpus`] reads `tests/e2e/differential/corpus.yaml`, whose templates expand
//!   combinatorially into [`Request`]s (one per path x every combination of query values);
//! - a path segment `$repeat:<text>:<n>` is `<text>` n times (a 9,000-character namespace);
//! - symbols: `$seed`, `$current`, `$future`, `$compacted` and `$continue:<rv>:<start>` stand for
//!   resourceVersions (and continue tokens) that differ per backend ([`Symbols`]);
//! - [`Backend`]: a base URL, an HTTP client that trusts the backend's CA, a bearer token;
//!   also the seeding helpers every backend gets the same data from;
//! - observation: a response (all list pages, or a watch stream) flattened into
//!   `field -> value` ([`Observation`]); [`Mode`] says what is comparable;
//! - comparison: [`check`] compares one request, re-asking the reference to tell a moving
//!   reference (background writes, clocks) from a real difference; [`AllowList`] and the
//!   [`Report`] table.
//!
//! `DIFFERENTIAL_DUMP=<glob>` prints both observations of every request whose id matches.

use super::pb;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use futures_util::StreamExt as _;
use http::{Method, Request as HttpRequest, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use hyper_util::rt::TokioExecutor;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde::Deserialize;
use serde_json::{Value, json};

/// Bound on one plain (non-watch) response, headers and body. The slowest legitimate answer is
/// the apiserver's 3 s wait before "Too large resource version".
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A watch gets this long beyond its `timeoutSeconds` to end by itself before we stop reading.
const WATCH_GRACE: Duration = Duration::from_secs(10);

/// Pages followed per list before giving up (the corpus's largest walk is ~30 pages).
const MAX_PAGES: usize = 200;

/// How often a request is re-run when the reference itself answered differently the second
/// time (a background write, e.g. the apiserver's identity lease renewal every 10 s, moved the
/// global resourceVersion between the two answers).
const ATTEMPTS: usize = 4;

/// Shown per value in the report table; longer values are clipped around the first difference.
const CELL_WIDTH: usize = 90;

// ---------------------------------------------------------------------------------------------
// Corpus
// ---------------------------------------------------------------------------------------------

/// The corpus file: `requests` is a list of templates.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CorpusFile {
    requests: Vec<Template>,
}

/// One template of the corpus file; see the file's header for the format.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Template {
    group: String,
    #[serde(default)]
    method: Option<String>,
    /// One path or a list of paths.
    path: Value,
    /// `param: value` or `param: [values]`; `null` (`~`) leaves the parameter out.
    #[serde(default)]
    query: serde_json::Map<String, Value>,
    #[serde(default)]
    body: Option<String>,
    #[serde(default)]
    content_type: Option<String>,
    #[serde(default)]
    accept: Option<String>,
    /// Also compare the fake apiserver with the real one (default true).
    #[serde(default)]
    fake: Option<bool>,
    /// Follow `metadata.continue` and compare every page (default true).
    #[serde(default)]
    pages: Option<bool>,
    /// Watches: stop reading after this many events (default 200).
    #[serde(default)]
    max_events: Option<usize>,
}

/// One concrete request of the corpus, with symbolic values still unresolved.
#[derive(Debug, Clone)]
pub struct Request {
    /// `group: METHOD /path?query` (symbolic, so it is the same for every backend).
    pub id: String,
    pub method: Method,
    pub path: String,
    pub query: Vec<(String, String)>,
    pub body: Option<String>,
    pub content_type: Option<String>,
    pub accept: Option<String>,
    /// Part of the fake-vs-real comparison.
    pub fake: bool,
    pub pages: bool,
    pub watch: bool,
    pub max_events: usize,
}

impl Request {
    fn param(&self, key: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The expanded corpus.
#[derive(Debug)]
pub struct Corpus {
    pub requests: Vec<Request>,
}

impl Corpus {
    /// Reads and expands the corpus file.
    ///
    /// # Panics
    /// On an unreadable or malformed file, or two requests with the same id.
    pub fn load(path: &Path) -> Corpus {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let raw: Value = serde_saphyr::from_str(&text)
            .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()));
        let file: CorpusFile = serde_json::from_value(raw)
            .unwrap_or_else(|e| panic!("corpus format in {}: {e}", path.display()));
        let mut requests = Vec::new();
        for t in &file.requests {
            requests.extend(expand(t));
        }
        let mut seen = BTreeSet::new();
        for r in &requests {
            assert!(
                seen.insert(r.id.clone()),
                "duplicate corpus request {}",
                r.id
            );
        }
        Corpus { requests }
    }
}

fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

fn values(v: &Value) -> Vec<Option<String>> {
    match v {
        Value::Array(a) => a.iter().map(scalar).collect(),
        other => vec![scalar(other)],
    }
}

/// Every path x every combination of query values (parameters in the file's key order, which
/// serde_json keeps sorted).
fn expand(t: &Template) -> Vec<Request> {
    let paths: Vec<String> = values(&t.path).into_iter().flatten().collect();
    assert!(!paths.is_empty(), "template {} has no path", t.group);
    let mut combos: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for (key, vals) in &t.query {
        let vals = values(vals);
        let mut next = Vec::new();
        for c in &combos {
            for v in &vals {
                let mut c = c.clone();
                if let Some(v) = v {
                    c.push((key.clone(), v.clone()));
                }
                next.push(c);
            }
        }
        combos = next;
    }
    let method: Method = t
        .method
        .as_deref()
        .unwrap_or("GET")
        .parse()
        .unwrap_or_else(|e| panic!("template {}: bad method: {e}", t.group));
    let mut out = Vec::new();
    for path in &paths {
        for query in &combos {
            let qs: Vec<String> = query.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let mut id = format!("{}: {method} {path}", t.group);
            if !qs.is_empty() {
                let _ = write!(id, "?{}", qs.join("&"));
            }
            if let Some(a) = &t.accept {
                let _ = write!(id, " [accept {a}]");
            }
            if let Some(b) = &t.body {
                let _ = write!(id, " [body {}]", clip(b, 40));
            }
            let watch = path.contains("/watch/")
                || query
                    .iter()
                    .any(|(k, v)| k == "watch" && matches!(v.as_str(), "1" | "true"));
            out.push(Request {
                id: id.escape_debug().to_string(),
                method: method.clone(),
                path: path.clone(),
                query: query.clone(),
                body: t.body.clone(),
                content_type: t.content_type.clone(),
                accept: t.accept.clone(),
                fake: t.fake.unwrap_or(true),
                pages: t.pages.unwrap_or(true),
                watch,
                max_events: t.max_events.unwrap_or(200),
            });
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Symbols
// ---------------------------------------------------------------------------------------------

/// What the symbolic resourceVersions stand for on one backend.
#[derive(Debug, Clone, Default)]
pub struct Symbols {
    /// `$seed`: a resourceVersion in the middle of seeding (after d1's configmaps).
    pub seed: u64,
    /// `$current`: the backend's resourceVersion when the corpus starts.
    pub current: u64,
    /// `$compacted`: a resourceVersion older than the backend's compaction point.
    pub compacted: u64,
}

impl Symbols {
    /// `$future`: far beyond anything the backend will reach during the run.
    pub fn future(&self) -> u64 {
        self.current + 1_000_000
    }

    fn rv(&self, sym: &str) -> Option<u64> {
        Some(match sym {
            "$seed" => self.seed,
            "$current" => self.current,
            "$future" => self.future(),
            "$compacted" => self.compacted,
            _ => return None,
        })
    }

    /// Resolves one query value. `$continue:<rv symbol or number>:<start key>` builds an
    /// apiserver-format continue token (base64url JSON `{v, rv, start}`).
    pub fn resolve(&self, v: &str) -> String {
        if let Some(rest) = v.strip_prefix("$continue:") {
            let (rv, start) = rest
                .split_once(':')
                .unwrap_or_else(|| panic!("bad continue symbol {v}"));
            let rv = self
                .rv(rv)
                .or_else(|| rv.parse().ok())
                .unwrap_or_else(|| panic!("bad continue rv in {v}"));
            let json = json!({"v": "meta.k8s.io/v1", "rv": rv, "start": start});
            return base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json.to_string());
        }
        match self.rv(v) {
            Some(n) => n.to_string(),
            None => v.to_string(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------------------------

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// One server the corpus is sent to.
pub struct Backend {
    pub name: String,
    /// `https://host:port` or `http://host:port`, no trailing slash.
    pub base: String,
    pub token: Option<String>,
    pub symbols: Symbols,
    client: HttpsClient,
    /// For a target with a `#`, sent raw (`super::raw_http1`).
    tls: std::sync::Arc<rustls::ClientConfig>,
}

/// A response read in full.
pub struct Reply {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
}

impl Backend {
    /// A backend at `base` whose serving certificate chains to `ca_pem` (none: plain HTTP).
    /// HTTP/2 is offered through ALPN, as client-go does.
    pub fn new(name: &str, base: &str, ca_pem: Option<&str>, token: Option<&str>) -> Backend {
        kube_cache_proxy::http::tls::install_crypto_provider();
        let mut roots = rustls::RootCertStore::empty();
        if let Some(pem) = ca_pem {
            for c in CertificateDer::pem_slice_iter(pem.as_bytes()) {
                roots.add(c.expect("CA PEM")).expect("CA certificate");
            }
        }
        let tls = std::sync::Arc::new(
            rustls::ClientConfig::builder()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        );
        let conn = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config((*tls).clone())
            .https_or_http()
            .enable_http1()
            .enable_http2()
            .build();
        Backend {
            name: name.to_string(),
            base: base.trim_end_matches('/').to_string(),
            token: token.map(str::to_string),
            symbols: Symbols::default(),
            client: Client::builder(TokioExecutor::new()).build(conn),
            tls,
        }
    }

    fn request(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<&str>,
        content_type: Option<&str>,
        accept: Option<&str>,
    ) -> HttpRequest<Full<Bytes>> {
        let mut b = HttpRequest::builder()
            .method(method)
            .uri(format!("{}{path_and_query}", self.base));
        if let Some(t) = &self.token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        if let Some(ct) = content_type.or(body.map(|_| "application/json")) {
            b = b.header("content-type", ct);
        }
        if let Some(a) = accept {
            b = b.header("accept", a);
        }
        b.body(Full::new(Bytes::from(body.unwrap_or("").to_string())))
            .expect("valid request")
    }

    /// Sends a request and reads the whole response.
    ///
    /// # Errors
    /// Connection errors and timeouts, as text.
    pub async fn send(
        &self,
        method: Method,
        path_and_query: &str,
        body: Option<&str>,
        content_type: Option<&str>,
        accept: Option<&str>,
    ) -> Result<Reply, String> {
        if path_and_query.contains('#') {
            // A `http::Uri` drops the `#` and what follows: written as raw HTTP/1.1.
            let tls = Some(self.tls.clone());
            let token = self.token.as_deref();
            let raw =
                super::raw_http1::send(&self.base, tls, method.as_str(), path_and_query, token);
            let r = tokio::time::timeout(REQUEST_TIMEOUT, raw)
                .await
                .map_err(|_| format!("no complete response within {REQUEST_TIMEOUT:?}"))??;
            let (status, headers, body) = (r.status, r.headers, r.body);
            return Ok(Reply {
                status,
                headers,
                body,
            });
        }
        let req = self.request(method, path_and_query, body, content_type, accept);
        let fut = async {
            let resp = self.client.request(req).await.map_err(|e| e.to_string())?;
            let (parts, body) = resp.into_parts();
            let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
            Ok(Reply {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        tokio::time::timeout(REQUEST_TIMEOUT, fut)
            .await
            .map_err(|_| format!("no complete response within {REQUEST_TIMEOUT:?}"))?
    }

    /// GET returning JSON; panics unless 200.
    pub async fn get_json(&self, path: &str) -> Value {
        let r = self
            .send(Method::GET, path, None, None, None)
            .await
            .unwrap_or_else(|e| panic!("{}: GET {path}: {e}", self.name));
        assert_eq!(
            r.status,
            StatusCode::OK,
            "{}: GET {path}: {}",
            self.name,
            String::from_utf8_lossy(&r.body)
        );
        r.json()
    }

    /// POST a JSON object; panics unless 201. Returns the created object's resourceVersion.
    pub async fn create(&self, collection: &str, obj: &Value) -> u64 {
        let body = obj.to_string();
        let r = self
            .send(Method::POST, collection, Some(&body), None, None)
            .await
            .unwrap_or_else(|e| panic!("{}: POST {collection}: {e}", self.name));
        assert_eq!(
            r.status,
            StatusCode::CREATED,
            "{}: POST {collection} {body}: {}",
            self.name,
            String::from_utf8_lossy(&r.body)
        );
        rv_of(&r.json()["metadata"]["resourceVersion"])
    }

    /// The backend's current resourceVersion, from a cheap consistent list.
    pub async fn current_rv(&self) -> u64 {
        let list = self.get_json("/api/v1/namespaces?limit=1").await;
        rv_of(&list["metadata"]["resourceVersion"])
    }
}

fn rv_of(v: &Value) -> u64 {
    v.as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not a resourceVersion: {v}"))
}

// ---------------------------------------------------------------------------------------------
// Seed data
// ---------------------------------------------------------------------------------------------

/// Namespaces the corpus is about: d1 and d2 hold data, d3 stays empty.
pub const SEED_NAMESPACES: [&str; 3] = ["d1", "d2", "d3"];
/// ConfigMaps per data namespace.
pub const CONFIGMAPS_PER_NAMESPACE: usize = 12;

/// Creates the seed namespaces, and their `default` ServiceAccount when `service_accounts`
/// (the real apiserver has no controller-manager to create it, and admission rejects pods
/// without it).
pub async fn seed_namespaces(b: &Backend, service_accounts: bool) {
    for ns in SEED_NAMESPACES {
        b.create(
            "/api/v1/namespaces",
            &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {"seed": "true"}}}),
        )
        .await;
        if service_accounts {
            b.create(
                &format!("/api/v1/namespaces/{ns}/serviceaccounts"),
                &json!({"metadata": {"name": "default"}}),
            )
            .await;
        }
    }
}

/// The seed ConfigMap `cm-{i:02}`: `app` a|b alternating, `tier` x|y|absent in turn, `idx` i.
pub fn seed_configmap(i: usize) -> Value {
    let mut labels =
        json!({"app": if i.is_multiple_of(2) { "a" } else { "b" }, "idx": i.to_string()});
    match i % 3 {
        0 => labels["tier"] = "x".into(),
        1 => labels["tier"] = "y".into(),
        _ => {}
    }
    json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": format!("cm-{i:02}"), "labels": labels},
        "data": {"i": i.to_string(), "parity": if i.is_multiple_of(2) { "even" } else { "odd" }},
    })
}

/// The seed Pod `p{i}`: pinned to a (non-existent) node for i = 1 and 3, so `spec.nodeName`
/// selectors have something to tell apart. Every defaulted field a selector can look at is
/// set explicitly so that the fake, which defaults nothing, stores the same values.
pub fn seed_pod(i: usize) -> Value {
    let mut spec = json!({
        "containers": [{"name": "pause", "image": "registry.k8s.io/pause:3.10"}],
        "restartPolicy": if i == 2 { "Never" } else { "Always" },
        "schedulerName": "default-scheduler",
        "serviceAccountName": "default",
    });
    if i != 2 {
        spec["nodeName"] = format!("node-{}", if i == 1 { "a" } else { "b" }).into();
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": format!("p{i}"), "labels": {"app": if i.is_multiple_of(2) { "a" } else { "b" }}},
        "spec": spec,
    })
}

/// Creates d1's ConfigMaps, then d2's, then three Pods in each of d1 and d2. Returns the
/// resourceVersion after d1's ConfigMaps (`$seed`): an Exact list there sees half the data,
/// and a watch from there replays the second half.
pub async fn seed_objects(b: &Backend) -> u64 {
    let mut seed = 0;
    for ns in ["d1", "d2"] {
        for i in 0..CONFIGMAPS_PER_NAMESPACE {
            let rv = b
                .create(
                    &format!("/api/v1/namespaces/{ns}/configmaps"),
                    &seed_configmap(i),
                )
                .await;
            if ns == "d1" {
                seed = rv;
            }
        }
    }
    for ns in ["d1", "d2"] {
        for i in 1..=3 {
            b.create(&format!("/api/v1/namespaces/{ns}/pods"), &seed_pod(i))
                .await;
        }
    }
    seed
}

/// Copies what `from` has outside the seed namespaces (the apiserver's own ConfigMaps in
/// kube-system, namespaces it bootstrapped) into `to`, so cluster-wide lists compare.
pub async fn mirror_bootstrap_objects(from: &Backend, to: &Backend) {
    let theirs = from.get_json("/api/v1/namespaces").await;
    let ours = to.get_json("/api/v1/namespaces").await;
    let have: BTreeSet<&str> = ours["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["metadata"]["name"].as_str())
        .collect();
    for ns in theirs["items"].as_array().into_iter().flatten() {
        let name = ns["metadata"]["name"].as_str().unwrap_or_default();
        if !have.contains(name) && !SEED_NAMESPACES.contains(&name) {
            to.create(
                "/api/v1/namespaces",
                &json!({"metadata": {"name": name, "labels": ns["metadata"]["labels"]}}),
            )
            .await;
        }
    }
    for kind in ["configmaps", "pods"] {
        let list = from.get_json(&format!("/api/v1/{kind}")).await;
        for obj in list["items"].as_array().into_iter().flatten() {
            let ns = obj["metadata"]["namespace"].as_str().unwrap_or_default();
            if SEED_NAMESPACES.contains(&ns) {
                continue;
            }
            let mut copy = obj.clone();
            let meta = copy["metadata"].as_object_mut().expect("metadata");
            meta.retain(|k, _| matches!(k.as_str(), "name" | "labels" | "annotations"));
            to.create(&format!("/api/v1/namespaces/{ns}/{kind}"), &copy)
                .await;
        }
    }
}

/// Compacts etcd's history below `revision` through its JSON gateway (`/v3/kv/compaction`), as
/// the apiserver's periodic compactor would.
pub async fn compact_etcd(etcd_url: &str, revision: u64) {
    let b = Backend::new("etcd", etcd_url, None, None);
    let body = json!({"revision": revision.to_string(), "physical": true}).to_string();
    let r = b
        .send(Method::POST, "/v3/kv/compaction", Some(&body), None, None)
        .await
        .expect("etcd compaction request");
    assert_eq!(
        r.status,
        StatusCode::OK,
        "etcd compaction: {}",
        String::from_utf8_lossy(&r.body)
    );
}

// ---------------------------------------------------------------------------------------------
// Observation
// ---------------------------------------------------------------------------------------------

/// What a comparison may look at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Same data, same etcd: everything must be equal, including resourceVersions, uids and
    /// the full JSON of every object (proxy vs real apiserver).
    Exact,
    /// Same data created the same way in different stores: structure only. ResourceVersions
    /// and tokens are compared by presence, objects by name, labels and the fields selectors
    /// read, and digits in Status messages are masked (fake vs real apiserver).
    Structural,
}

/// A response flattened into `field -> value`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observation {
    pub fields: BTreeMap<String, String>,
}

impl Observation {
    fn set(&mut self, field: impl Into<String>, value: impl Into<String>) {
        self.fields.insert(field.into(), value.into());
    }
}

fn compact(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// Runs of digits become `N` (resourceVersions and uids inside messages).
fn mask_digits(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_digits = false;
    for c in s.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('N');
            }
            in_digits = true;
        } else {
            in_digits = false;
            out.push(c);
        }
    }
    out
}

fn obj_key(o: &Value) -> String {
    let m = &o["metadata"];
    match m["namespace"].as_str() {
        Some(ns) => format!("{ns}/{}", m["name"].as_str().unwrap_or("")),
        None => m["name"].as_str().unwrap_or("").to_string(),
    }
}

/// What [`Mode::Structural`] compares of an object: identity, labels and what selectors read.
fn projection(o: &Value) -> String {
    let mut p = serde_json::Map::new();
    for (key, ptr) in [
        ("name", "/metadata/name"),
        ("namespace", "/metadata/namespace"),
        ("labels", "/metadata/labels"),
        ("data", "/data"),
        ("nodeName", "/spec/nodeName"),
        ("restartPolicy", "/spec/restartPolicy"),
        ("phase", "/status/phase"),
    ] {
        if let Some(v) = o.pointer(ptr) {
            p.insert(key.into(), v.clone());
        }
    }
    compact(&Value::Object(p))
}

fn observe_status(o: &mut Observation, p: &str, s: &Value, mode: Mode) {
    o.set(format!("{p}status.code"), s["code"].to_string());
    o.set(format!("{p}status.reason"), s["reason"].to_string());
    o.set(format!("{p}status.status"), s["status"].to_string());
    let msg = s["message"].as_str().unwrap_or("");
    match mode {
        Mode::Exact => {
            o.set(format!("{p}status.message"), msg);
            o.set(format!("{p}status.details"), compact(&s["details"]));
        }
        Mode::Structural => {
            o.set(format!("{p}status.message"), mask_digits(msg));
            let d = &s["details"];
            for k in ["name", "kind", "group", "retryAfterSeconds"] {
                if !d[k].is_null() {
                    o.set(format!("{p}status.details.{k}"), d[k].to_string());
                }
            }
            let causes: Vec<String> = d["causes"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| format!("{} {}", c["reason"], c["field"]))
                .collect();
            if !causes.is_empty() {
                o.set(format!("{p}status.details.causes"), causes.join("; "));
            }
        }
    }
    if s["metadata"]["continue"]
        .as_str()
        .is_some_and(|c| !c.is_empty())
    {
        o.set(format!("{p}status.metadata.continue"), "present");
    }
}

/// A list in the apiserver's protobuf, recorded as a JSON list is: its resourceVersion (so
/// a latest-state list compares by contract, not by number), the continue token by
/// presence (each side signs its own), remainingItemCount, and every other byte exactly
/// (the envelope's fields, the list metadata's empty fields, each item's bytes). `None`
/// when `body` is not a protobuf list, else its continue token.
fn observe_protobuf_list(
    o: &mut Observation,
    p: &str,
    body: &[u8],
    mode: Mode,
) -> Option<Option<String>> {
    use prost::Message as _;
    use sha2::Digest as _;
    let rest = body.strip_prefix(b"k8s\0")?;
    let Ok(u) = pb::Unknown::decode(rest) else {
        return None;
    };
    let tm = u.type_meta.clone().unwrap_or_default();
    let kind = tm.kind.clone().unwrap_or_default();
    if !kind.ends_with("List") {
        return None;
    }
    let Some(Ok(list)) = u.raw.as_deref().map(pb::List::decode) else {
        return None;
    };
    let meta = list.metadata.clone().unwrap_or_default();
    o.set(format!("{p}kind"), format!("{kind:?}"));
    o.set(
        format!("{p}apiVersion"),
        format!("{:?}", tm.api_version.unwrap_or_default()),
    );
    o.set(
        format!("{p}protobuf.envelope"),
        format!(
            "contentEncoding {:?} contentType {:?} selfLink {:?}",
            u.content_encoding, u.content_type, meta.self_link
        ),
    );
    let rv = meta.resource_version.clone().unwrap_or_default();
    o.set(
        format!("{p}metadata.resourceVersion"),
        match (mode, rv.is_empty()) {
            (_, true) => "absent".to_string(),
            (Mode::Exact, false) => rv,
            (Mode::Structural, false) => "present".to_string(),
        },
    );
    let token = meta.r#continue.clone().filter(|c| !c.is_empty());
    if token.is_some() {
        o.set(format!("{p}metadata.continue"), "present");
    }
    if let Some(n) = meta.remaining_item_count {
        o.set(format!("{p}metadata.remainingItemCount"), n.to_string());
    }
    let items: Vec<String> = list
        .items
        .iter()
        .map(|i| match mode {
            Mode::Exact => hex::encode(sha2::Sha256::digest(i)),
            Mode::Structural => "item".to_string(),
        })
        .collect();
    o.set(
        format!("{p}items"),
        format!("[{}] {}", items.len(), items.join(", ")),
    );
    Some(token)
}

fn observe_list(o: &mut Observation, p: &str, l: &Value, mode: Mode) {
    o.set(format!("{p}kind"), l["kind"].to_string());
    o.set(format!("{p}apiVersion"), l["apiVersion"].to_string());
    let meta = &l["metadata"];
    let rv = meta["resourceVersion"].as_str().unwrap_or("");
    o.set(
        format!("{p}metadata.resourceVersion"),
        match (mode, rv.is_empty()) {
            (_, true) => "absent".to_string(),
            (Mode::Exact, false) => rv.to_string(),
            (Mode::Structural, false) => "present".to_string(),
        },
    );
    if meta["continue"].as_str().is_some_and(|c| !c.is_empty()) {
        o.set(format!("{p}metadata.continue"), "present");
    }
    if !meta["remainingItemCount"].is_null() {
        o.set(
            format!("{p}metadata.remainingItemCount"),
            meta["remainingItemCount"].to_string(),
        );
    }
    let keys = |v: &Value| -> String {
        v.as_object()
            .map(|m| m.keys().cloned().collect::<Vec<_>>().join(","))
            .unwrap_or_default()
    };
    if mode == Mode::Exact {
        o.set(format!("{p}keys"), keys(l));
        o.set(format!("{p}metadata.keys"), keys(meta));
    }
    let items = &l["items"];
    o.set(
        format!("{p}items.type"),
        match items {
            Value::Array(_) => "array",
            Value::Null => "null",
            _ => "other",
        },
    );
    let items = items.as_array().map(Vec::as_slice).unwrap_or_default();
    let names: Vec<String> = items
        .iter()
        .map(|i| match mode {
            Mode::Exact => format!(
                "{}@{}",
                obj_key(i),
                i["metadata"]["resourceVersion"].as_str().unwrap_or("")
            ),
            Mode::Structural => obj_key(i),
        })
        .collect();
    o.set(
        format!("{p}items"),
        format!("[{}] {}", names.len(), names.join(", ")),
    );
    for i in items {
        let v = match mode {
            Mode::Exact => compact(i),
            Mode::Structural => projection(i),
        };
        o.set(format!("{p}item[{}]", obj_key(i)), v);
    }
}

fn observe_object(o: &mut Observation, p: &str, v: &Value, mode: Mode) {
    match mode {
        // A Table: its resourceVersion observed apart, as a list's is (a GET's is its
        // object's).
        Mode::Exact if v["kind"] == "Table" => {
            let mut rest = v.clone();
            let meta = rest["metadata"].take();
            o.set(
                format!("{p}metadata.resourceVersion"),
                meta["resourceVersion"].as_str().unwrap_or("absent"),
            );
            o.set(format!("{p}metadata.rest"), {
                let mut m = meta;
                m["resourceVersion"].take();
                compact(&m)
            });
            o.set(format!("{p}object"), compact(&rest));
        }
        Mode::Exact => o.set(format!("{p}object"), compact(v)),
        Mode::Structural => {
            o.set(format!("{p}object.kind"), v["kind"].to_string());
            o.set(format!("{p}object.apiVersion"), v["apiVersion"].to_string());
            o.set(format!("{p}object"), projection(v));
        }
    }
}

fn observe_headers(o: &mut Observation, p: &str, h: &http::HeaderMap, mode: Mode) {
    let get = |n: &str| h.get(n).and_then(|v| v.to_str().ok()).map(str::to_string);
    if let Some(ct) = get("content-type") {
        let ct = match mode {
            Mode::Exact => ct,
            Mode::Structural => ct.split(';').next().unwrap_or("").trim().to_string(),
        };
        o.set(format!("{p}header.content-type"), ct);
    }
    for n in ["retry-after", "content-encoding"] {
        if let Some(v) = get(n) {
            o.set(format!("{p}header.{n}"), v);
        }
    }
}

/// Records one non-watch response under prefix `p`; returns the continue token of a list page.
fn observe_reply(o: &mut Observation, p: &str, r: &Reply, mode: Mode) -> Option<String> {
    o.set(format!("{p}code"), r.status.as_str());
    observe_headers(o, p, &r.headers, mode);
    if let Some(token) = observe_protobuf_list(o, p, &r.body, mode) {
        return token;
    }
    let Ok(v) = serde_json::from_slice::<Value>(&r.body) else {
        match std::str::from_utf8(&r.body) {
            Ok(text) => o.set(format!("{p}body.text"), text.trim()),
            Err(_) => {
                use sha2::Digest as _;
                let digest = hex::encode(sha2::Sha256::digest(&r.body));
                o.set(
                    format!("{p}body.binary"),
                    match mode {
                        Mode::Exact => format!("{} bytes sha256 {digest}", r.body.len()),
                        Mode::Structural => "binary".to_string(),
                    },
                );
            }
        }
        return None;
    };
    let kind = v["kind"].as_str().unwrap_or("");
    if kind == "Status" {
        observe_status(o, p, &v, mode);
        None
    } else if v["items"].is_array() || (kind.ends_with("List") && v.get("items").is_some()) {
        observe_list(o, p, &v, mode);
        v["metadata"]["continue"]
            .as_str()
            .filter(|c| !c.is_empty())
            .map(str::to_string)
    } else {
        observe_object(o, p, &v, mode);
        None
    }
}

/// A path with its `$repeat:<text>:<n>` segments expanded (`<text>` n times: a name longer
/// than any the API accepts, without writing it out in the corpus).
fn expand_path(path: &str) -> String {
    path.split('/')
        .map(|seg| {
            let Some(rest) = seg.strip_prefix("$repeat:") else {
                return seg.to_string();
            };
            let (text, n) = rest
                .rsplit_once(':')
                .unwrap_or_else(|| panic!("bad repeat symbol {seg}"));
            text.repeat(
                n.parse()
                    .unwrap_or_else(|_| panic!("bad repeat count in {seg}")),
            )
        })
        .collect::<Vec<_>>()
        .join("/")
}

fn path_and_query(req: &Request, symbols: &Symbols, query: &[(String, String)]) -> String {
    use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
    let path = expand_path(&req.path);
    let qs: Vec<String> = query
        .iter()
        .map(|(k, v)| {
            format!(
                "{}={}",
                utf8_percent_encode(k, NON_ALPHANUMERIC),
                utf8_percent_encode(&symbols.resolve(v), NON_ALPHANUMERIC)
            )
        })
        .collect();
    if qs.is_empty() {
        path
    } else {
        format!("{path}?{}", qs.join("&"))
    }
}

/// Sends `req` to `b` and flattens the answer: every page of a list (following `continue`
/// the way client-go's pager does: same parameters minus resourceVersion and
/// resourceVersionMatch), or the events of a watch.
pub async fn observe(b: &Backend, req: &Request, mode: Mode) -> Observation {
    let mut o = Observation::default();
    if req.watch {
        observe_watch(&mut o, b, req, mode).await;
        return o;
    }
    observe_pages(&mut o, b, req, mode).await;
    if mode == Mode::Exact {
        latest_state_rv(&mut o, req, &b.symbols);
    }
    o
}

async fn observe_pages(o: &mut Observation, b: &Backend, req: &Request, mode: Mode) {
    let mut query = req.query.clone();
    for page in 0..MAX_PAGES {
        let p = if page == 0 {
            String::new()
        } else {
            format!("page[{page}].")
        };
        let pq = path_and_query(req, &b.symbols, &query);
        let reply = b
            .send(
                req.method.clone(),
                &pq,
                req.body.as_deref(),
                req.content_type.as_deref(),
                req.accept.as_deref(),
            )
            .await;
        let reply = match reply {
            Ok(r) => r,
            Err(e) => {
                o.set(format!("{p}error"), e);
                return;
            }
        };
        let next = observe_reply(o, &p, &reply, mode);
        match next {
            Some(token) if req.pages => {
                query.retain(|(k, _)| {
                    !matches!(
                        k.as_str(),
                        "continue" | "resourceVersion" | "resourceVersionMatch"
                    )
                });
                query.push(("continue".into(), token));
            }
            _ => return,
        }
    }
    o.set("error", format!("more than {MAX_PAGES} pages"));
}

/// A list answered at the latest state (resourceVersion unset, "0", or N without `limit`, or
/// `NotOlderThan`) may carry any resourceVersion not older than the one asked for: the
/// apiserver's watch cache also advances on etcd progress notifications, which outside
/// clients cannot request, so the exact number is not part of the contract. Such a list's
/// resourceVersion is recorded as "latest >= N" when it satisfies the contract (later pages
/// must repeat the first page's number exactly: they come from the same snapshot).
fn latest_state_rv(o: &mut Observation, req: &Request, symbols: &Symbols) {
    if req.param("continue").is_some() {
        return;
    }
    let rv = req.param("resourceVersion").map(|v| symbols.resolve(v));
    let rv_match = req.param("resourceVersionMatch").unwrap_or("");
    let limited = req
        .param("limit")
        .and_then(|l| l.parse::<i64>().ok())
        .is_some_and(|l| l > 0);
    let min = match (rv.as_deref(), rv_match) {
        (None | Some(""), "") => 0,
        (Some("0"), "" | "NotOlderThan") => 0,
        (Some(n), "NotOlderThan") => n.parse::<u64>().unwrap_or(u64::MAX),
        (Some(n), "") if !limited => n.parse::<u64>().unwrap_or(u64::MAX),
        _ => return,
    };
    let key = "metadata.resourceVersion";
    let Some(first) = o.fields.get(key).cloned() else {
        return;
    };
    if first.parse::<u64>().is_ok_and(|v| v >= min) {
        for (k, v) in o.fields.iter_mut() {
            if k.ends_with(key) && *v == first {
                *v = format!("latest >= {min}");
            }
        }
    }
}

fn event_summary(e: &Value, mode: Mode) -> Option<String> {
    let typ = e["type"].as_str().unwrap_or("?");
    let obj = &e["object"];
    Some(match typ {
        "BOOKMARK" => {
            // Periodic bookmarks depend on timing; only the end of the initial events is part
            // of the contract.
            let end = obj["metadata"]["annotations"]["k8s.io/initial-events-end"].as_str();
            if end != Some("true") {
                return None;
            }
            "BOOKMARK initial-events-end".to_string()
        }
        "ERROR" => {
            let msg = obj["message"].as_str().unwrap_or("");
            let msg = match mode {
                Mode::Exact => msg.to_string(),
                Mode::Structural => mask_digits(msg),
            };
            format!("ERROR {} {} {msg}", obj["code"], obj["reason"])
        }
        _ => match mode {
            Mode::Exact => format!(
                "{typ} {}@{}",
                obj_key(obj),
                obj["metadata"]["resourceVersion"].as_str().unwrap_or("")
            ),
            Mode::Structural => format!("{typ} {}", obj_key(obj)),
        },
    })
}

async fn observe_watch(o: &mut Observation, b: &Backend, req: &Request, mode: Mode) {
    let pq = path_and_query(req, &b.symbols, &req.query);
    let http_req = b.request(
        req.method.clone(),
        &pq,
        req.body.as_deref(),
        req.content_type.as_deref(),
        req.accept.as_deref(),
    );
    let timeout = req
        .param("timeoutSeconds")
        .and_then(|t| t.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or_default();
    let deadline = tokio::time::Instant::now() + timeout + WATCH_GRACE;
    let resp = match tokio::time::timeout_at(deadline, b.client.request(http_req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return o.set("error", e.to_string()),
        Err(_) => return o.set("error", "no response headers before the deadline"),
    };
    let (parts, mut body) = resp.into_parts();
    if parts.status != StatusCode::OK {
        let bytes = match tokio::time::timeout_at(deadline, body.collect()).await {
            Ok(Ok(c)) => c.to_bytes(),
            _ => return o.set("error", "error body unreadable"),
        };
        observe_reply(
            o,
            "",
            &Reply {
                status: parts.status,
                headers: parts.headers,
                body: bytes,
            },
            mode,
        );
        return;
    }
    o.set("code", parts.status.as_str());
    observe_headers(o, "", &parts.headers, mode);
    let mut buf: Vec<u8> = Vec::new();
    let mut events: Vec<(String, Option<String>)> = Vec::new();
    let end = 'read: loop {
        while let Some(i) = buf.iter().position(|c| *c == b'\n') {
            let line: Vec<u8> = buf.drain(..=i).collect();
            let Ok(e) = serde_json::from_slice::<Value>(&line) else {
                break 'read format!("undecodable line {:?}", String::from_utf8_lossy(&line));
            };
            if let Some(s) = event_summary(&e, mode) {
                let full =
                    (mode == Mode::Exact && e["type"] != "BOOKMARK").then(|| compact(&e["object"]));
                events.push((s, full));
            }
            if events.len() >= req.max_events {
                break 'read "max-events".to_string();
            }
        }
        match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => break "still open at the deadline".to_string(),
            Ok(None) if buf.is_empty() => break "clean".to_string(),
            Ok(None) => break "ended mid-event".to_string(),
            Ok(Some(Err(e))) => break format!("stream error: {e}"),
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
        }
    };
    o.set("end", end);
    o.set("events", events.len().to_string());
    for (i, (summary, full)) in events.into_iter().enumerate() {
        o.set(format!("event[{i}]"), summary);
        if let Some(full) = full {
            o.set(format!("event[{i}].object"), full);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Comparison, allow-list, report
// ---------------------------------------------------------------------------------------------

/// One field that differs.
#[derive(Debug, Clone)]
pub struct Diff {
    pub id: String,
    pub field: String,
    pub subject: Option<String>,
    pub reference: Option<String>,
}

fn diff_fields(id: &str, subject: &Observation, reference: &Observation) -> Vec<Diff> {
    let keys: BTreeSet<&String> = subject
        .fields
        .keys()
        .chain(reference.fields.keys())
        .collect();
    keys.into_iter()
        .filter_map(|k| {
            let s = subject.fields.get(k);
            let r = reference.fields.get(k);
            (s != r).then(|| Diff {
                id: id.to_string(),
                field: k.clone(),
                subject: s.cloned(),
                reference: r.cloned(),
            })
        })
        .collect()
}

/// An accepted difference: `id` and `field` are globs (`*` matches anything).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Allow {
    pub id: String,
    pub field: String,
    pub reason: String,
}

/// The allow-list file: one section per comparison.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllowList {
    /// Proxy vs real apiserver.
    #[serde(default)]
    pub proxy: Vec<Allow>,
    /// Fake vs real apiserver: behaviour the fake does not implement.
    #[serde(default)]
    pub fake: Vec<Allow>,
}

impl AllowList {
    /// # Panics
    /// On an unreadable or malformed file, or an entry without a reason.
    pub fn load(path: &Path) -> AllowList {
        let text = std::fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let raw: Value = serde_saphyr::from_str(&text)
            .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()));
        let list: AllowList = if raw.is_null() {
            AllowList::default()
        } else {
            serde_json::from_value(raw)
                .unwrap_or_else(|e| panic!("allow-list format in {}: {e}", path.display()))
        };
        for a in list.proxy.iter().chain(&list.fake) {
            assert!(
                !a.reason.trim().is_empty(),
                "allow-list entry without a reason: {a:?}"
            );
        }
        list
    }
}

/// `*` globs for the allow-list: the proxy's own matcher (`tenancy::glob`, used for username
/// patterns), kept in one place.
#[allow(unused_imports)]
pub use kube_cache_proxy::tenancy::glob;

fn allowed(allow: &[Allow], d: &Diff) -> Option<usize> {
    allow
        .iter()
        .position(|a| glob(&a.id, &d.id) && glob(&a.field, &d.field))
}

/// The outcome of one request.
#[derive(Debug, Default)]
pub struct Checked {
    pub diffs: Vec<Diff>,
    /// Differences an allow-list entry (by index) accepted.
    pub allowed: Vec<(usize, Diff)>,
    /// Runs needed (more than one when the reference moved).
    pub attempts: usize,
}

/// Sends `req` to both backends (at the same time) and compares the answers.
///
/// A difference is only reported when the reference, asked again, repeats its first answer:
/// otherwise the reference itself moved between the two answers (a background write, a
/// clock-derived field) and the comparison is retried, up to [`ATTEMPTS`] times.
pub async fn check(
    req: &Request,
    subject: &Backend,
    reference: &Backend,
    mode: Mode,
    allow: &[Allow],
) -> Checked {
    let mut out = Checked::default();
    for attempt in 1..=ATTEMPTS {
        out.attempts = attempt;
        let (r, s) = tokio::join!(observe(reference, req, mode), observe(subject, req, mode));
        if let Ok(pattern) = std::env::var("DIFFERENTIAL_DUMP")
            && glob(&pattern, &req.id)
        {
            eprintln!(
                "{}\n  {}: {:#?}\n  {}: {:#?}",
                req.id, reference.name, r.fields, subject.name, s.fields
            );
        }
        let (allowed_now, diffs): (Vec<Diff>, Vec<Diff>) = diff_fields(&req.id, &s, &r)
            .into_iter()
            .partition(|d| allowed(allow, d).is_some());
        out.allowed = allowed_now
            .into_iter()
            .map(|d| (allowed(allow, &d).expect("partitioned"), d))
            .collect();
        out.diffs = diffs;
        if out.diffs.is_empty() {
            return out;
        }
        let again = observe(reference, req, mode).await;
        if again == r {
            return out;
        }
    }
    out
}

/// Every request's outcome.
#[derive(Debug)]
pub struct Report {
    pub title: String,
    pub requests: usize,
    pub diffs: Vec<Diff>,
    /// Per allow-list entry, how many differences it accepted.
    pub allow_hits: Vec<usize>,
    pub allow: Vec<Allow>,
    pub retried: Vec<String>,
    pub elapsed: Duration,
}

/// Runs the corpus, `concurrency` requests at a time (the corpus makes no writes, so order
/// does not matter; concurrency hides the seconds that watches and future-RV waits take).
pub async fn run(
    title: &str,
    requests: &[Request],
    subject: &Backend,
    reference: &Backend,
    mode: Mode,
    allow: &[Allow],
    concurrency: usize,
) -> Report {
    let started = Instant::now();
    let results: Vec<(usize, Checked)> = futures_util::stream::iter(requests.iter().enumerate())
        .map(|(i, r)| async move { (i, check(r, subject, reference, mode, allow).await) })
        .buffer_unordered(concurrency)
        .collect()
        .await;
    let mut results = results;
    results.sort_by_key(|(i, _)| *i);
    let mut report = Report {
        title: title.to_string(),
        requests: requests.len(),
        diffs: Vec::new(),
        allow_hits: vec![0; allow.len()],
        allow: allow.to_vec(),
        retried: Vec::new(),
        elapsed: Duration::ZERO,
    };
    for (i, c) in results {
        if c.attempts > 1 {
            report
                .retried
                .push(format!("{} ({} runs)", requests[i].id, c.attempts));
        }
        for (a, _) in &c.allowed {
            report.allow_hits[*a] += 1;
        }
        report.diffs.extend(c.diffs);
    }
    report.elapsed = started.elapsed();
    report
}

fn clip(s: &str, width: usize) -> String {
    if s.chars().count() <= width {
        s.to_string()
    } else {
        let head: String = s.chars().take(width.saturating_sub(1)).collect();
        format!("{head}…")
    }
}

/// Both values clipped to `width`, around where they start to differ.
fn clip_pair(a: &str, b: &str, width: usize) -> (String, String) {
    let common = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
    let skip = common.saturating_sub(width / 3);
    let cut = |s: &str| {
        let tail: String = s.chars().skip(skip).collect();
        let c = clip(&tail, width);
        if skip > 0 { format!("…{c}") } else { c }
    };
    (cut(a), cut(b))
}

impl Report {
    /// The differences as a table: request id, field, subject value, reference value.
    pub fn table(&self, subject: &str, reference: &str) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{}: {} difference(s) in {} requests",
            self.title,
            self.diffs.len(),
            self.requests
        );
        let mut last_id = "";
        for d in &self.diffs {
            if d.id != last_id {
                let _ = writeln!(t, "\n  {}", d.id);
                last_id = &d.id;
            }
            let none = "<absent>".to_string();
            let (s, r) = clip_pair(
                d.subject.as_ref().unwrap_or(&none),
                d.reference.as_ref().unwrap_or(&none),
                CELL_WIDTH,
            );
            let _ = writeln!(t, "    {:<36} {subject:>9}: {s}", d.field);
            let _ = writeln!(t, "    {:<36} {reference:>9}: {r}", "");
        }
        t
    }

    /// Allow-list use and retries, for the test log.
    pub fn summary(&self) -> String {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "{}: {} requests in {:.1?}, {} difference(s), {} request(s) re-run because the reference moved",
            self.title,
            self.requests,
            self.elapsed,
            self.diffs.len(),
            self.retried.len()
        );
        for (a, hits) in self.allow.iter().zip(&self.allow_hits) {
            let _ = writeln!(
                t,
                "  allow-list {:>4} hit(s): {} / {}{}",
                hits,
                a.id,
                a.field,
                if *hits == 0 { "  (UNUSED)" } else { "" }
            );
        }
        for r in &self.retried {
            let _ = writeln!(t, "  re-run: {r}");
        }
        t
    }
}
