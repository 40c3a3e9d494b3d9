//! An in-process fake kube-apiserver for deterministic integration and fault tests.
//!
//! It serves plain HTTP on `127.0.0.1:0` (HTTP/1.1, and HTTP/2 with prior knowledge) and keeps
//! namespaces, configmaps and pods in memory behind one global resourceVersion counter, the way
//! etcd's revision works; also CustomResourceDefinitions (established on creation) and one
//! custom resource, `widgets.example.com/v1`, served with its discovery documents only while
//! its CRD exists (deleting the CRD deletes the widgets and ends their watches). Where it implements a behaviour it follows kube-apiserver's wire
//! contract: `Status` errors with the same codes, reasons and messages, the same continue-token
//! format, watch framing, bookmarks and the `k8s.io/initial-events-end` annotation.
//! See <https://kubernetes.io/docs/reference/using-api/api-concepts/>.
//!
//! # Layout
//! - [`FakeApiServer`]: lifecycle, request log, direct store helpers.
//! - [`Faults`]: fault switches (fail next requests, delays, refusing connections, ending or
//!   expiring watches, denying callers, the `/metrics` text).
//! - `Store`: objects per kind, event history for watch resume and Exact lists, open watchers.
//! - request handling: routing, list, watch, writes, upgrades, discovery, access reviews.
//! - selectors, continue tokens, `Status` construction, small helpers (timestamps, the WebSocket accept key).
//!
//! # Simplifications (not the real apiserver)
//! - No admission, no defaulting beyond the few fields named below, no managedFields, no
//!   protobuf/Table, no dryRun, no deletecollection, no JSON patch or server-side apply (415).
//! - Pods are deleted immediately (as the apiserver does for unscheduled pods); a namespace
//!   DELETE answers with the Terminating namespace like the apiserver, then the fake's
//!   "namespace controller" immediately deletes its content and the namespace itself.
//! - Name validation is a plain RFC 1123 check.
//! - No authentication: a bearer token is its own user name. Authorization allows everything
//!   except callers on the deny list ([`Faults::deny`]): their resource requests get 403 and
//!   access reviews about them answer `allowed: false`.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use bytes::Bytes;
use futures_util::StreamExt as _;
use http::header::{CONTENT_TYPE, HeaderValue, UPGRADE};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Map, Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Body = UnsyncBoxBody<Bytes, BoxError>;

/// Events kept for watch resume and Exact lists; older ones are compacted away (like etcd
/// compaction) and then answer 410.
const HISTORY_CAPACITY: usize = 10_000;

/// How long a list or watch for a future resourceVersion waits before 504 "Too large resource
/// version": the apiserver's cacher waits 3 s (`blockTimeout` in `watch_cache.go`).
const FRESHNESS_WAIT: Duration = Duration::from_secs(3);

/// Default bookmark period. The apiserver's is about a minute; tests want it short.
const DEFAULT_BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

/// The apiserver sends a bookmark this long before a watch's `timeoutSeconds` deadline.
const PRE_DEADLINE_BOOKMARK: Duration = Duration::from_secs(2);

/// Namespaces a fresh cluster has; created at start so namespaced writes work at once.
const INITIAL_NAMESPACES: [&str; 4] = ["default", "kube-node-lease", "kube-public", "kube-system"];

/// Reported by `/version`.
const GIT_VERSION: &str = "v1.36.0";

/// One request as the fake received it.
#[derive(Debug, Clone)]
pub struct LoggedRequest {
    pub method: Method,
    pub path: String,
    pub query: Option<String>,
    pub headers: HeaderMap,
    /// Empty for upgrade requests (their body is the upgraded stream).
    pub body: Bytes,
}

/// A running fake apiserver. Dropping it stops it too; [`FakeApiServer::shutdown`] also waits.
pub struct FakeApiServer {
    shared: Arc<Shared>,
    faults: Faults,
    accept: Option<JoinHandle<()>>,
}

/// Cheap-clone handle to the fault switches of one [`FakeApiServer`].
#[derive(Clone)]
pub struct Faults {
    shared: Arc<Shared>,
}

/// Makes the `/metrics` text of the n-th scrape (counting from 1).
type MetricsText = Arc<dyn Fn(u64) -> String + Send + Sync>;

struct Shared {
    addr: SocketAddr,
    store: Mutex<Store>,
    /// Latest resourceVersion, for requests waiting on a future one.
    rv_tx: tokio::sync::watch::Sender<u64>,
    log: Mutex<Vec<LoggedRequest>>,
    fail_next: Mutex<(usize, u16)>,
    delay: Mutex<Duration>,
    refuse: AtomicBool,
    bookmark_interval: Mutex<Duration>,
    /// Tokens and user names that are not authorized for anything (see [`Faults::deny`]).
    deny: Mutex<HashSet<String>>,
    impersonators: Mutex<HashSet<String>>,
    only_in: Mutex<std::collections::HashMap<String, HashSet<String>>>,
    /// Extra delay of access and token reviews only (see [`Faults::set_review_delay`]).
    review_delay: Mutex<Duration>,
    /// While set, access and token reviews answer 500 (see [`Faults::fail_reviews`]).
    fail_reviews: AtomicBool,
    /// The ServiceAccount issuer and JWKS served (see [`Faults::set_jwks`]).
    jwks: Mutex<Option<(String, String)>>,
    /// The `/metrics` text for the n-th scrape (see [`Faults::set_metrics`]), and scrapes so far.
    metrics: Mutex<(MetricsText, u64)>,
    shutdown: CancellationToken,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }
}

/// Locks ignoring poison: a panicking test thread must not cascade into every other request.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl FakeApiServer {
    /// Binds `127.0.0.1:0` and serves until [`FakeApiServer::shutdown`] or drop.
    pub async fn start() -> FakeApiServer {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let (rv_tx, _) = tokio::sync::watch::channel(0);
        let shared = Arc::new(Shared {
            addr,
            store: Mutex::new(Store::new()),
            rv_tx,
            log: Mutex::new(Vec::new()),
            fail_next: Mutex::new((0, 500)),
            delay: Mutex::new(Duration::ZERO),
            refuse: AtomicBool::new(false),
            bookmark_interval: Mutex::new(DEFAULT_BOOKMARK_INTERVAL),
            deny: Mutex::new(HashSet::new()),
            impersonators: Mutex::new(HashSet::new()),
            only_in: Mutex::new(std::collections::HashMap::new()),
            review_delay: Mutex::new(Duration::ZERO),
            fail_reviews: AtomicBool::new(false),
            jwks: Mutex::new(None),
            metrics: Mutex::new((Arc::new(|_| String::new()), 0)),
            shutdown: CancellationToken::new(),
        });
        for ns in INITIAL_NAMESPACES {
            create_object(
                &shared,
                Kind::Namespace,
                None,
                json!({"metadata": {"name": ns}}),
            )
            .expect("initial namespace");
        }
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        FakeApiServer {
            faults: Faults {
                shared: shared.clone(),
            },
            shared,
            accept: Some(accept),
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }

    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<LoggedRequest> {
        lock(&self.shared.log).clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.log).clear();
    }

    /// The latest resourceVersion (etcd revision) of the whole store.
    pub fn current_rv(&self) -> u64 {
        self.shared.store().rv
    }

    /// Every write of `resource` (e.g. `configmaps`) since the start, in resourceVersion order:
    /// the ground truth a watch is checked against. Unlike the watch history this journal is
    /// never compacted.
    pub fn writes(&self, resource: &str) -> Vec<Write> {
        self.shared
            .store()
            .journal
            .iter()
            .filter(|w| w.resource == resource)
            .cloned()
            .collect()
    }

    /// Forgets history below `rv`, like an etcd compaction at `rv`.
    ///
    /// Afterwards Exact lists at an older resourceVersion, continue tokens from an older snapshot
    /// and watches from an older resourceVersion get 410 Expired. Compacting beyond the current
    /// resourceVersion compacts up to the current one.
    pub fn compact(&self, rv: u64) {
        self.shared.store().compact(rv);
    }

    /// Creates an object in-process (not logged), as `POST collection_path` would.
    ///
    /// `collection_path` is e.g. `/api/v1/namespaces/default/configmaps`.
    ///
    /// # Panics
    /// If the path is not a collection or the store rejects the object (the `Status` is shown).
    pub async fn create(&self, collection_path: &str, obj: Value) -> Value {
        let (kind, ns) = match parse_route(collection_path) {
            Some(Route::Collection { kind, namespace }) => (kind, namespace),
            _ => panic!("not a collection path: {collection_path}"),
        };
        create_object(&self.shared, kind, ns.as_deref(), obj)
            .unwrap_or_else(|s| panic!("create {collection_path}: {}", s.to_json()))
    }

    /// Replaces an object in-process (not logged), as `PUT item_path` would.
    ///
    /// # Panics
    /// If the path is not an object path or the store rejects the update.
    pub async fn update(&self, item_path: &str, obj: Value) -> Value {
        let (kind, ns, name) = item_route(item_path);
        update_object(&self.shared, kind, ns.as_deref(), &name, obj, false)
            .unwrap_or_else(|s| panic!("update {item_path}: {}", s.to_json()))
    }

    /// Deletes an object in-process (not logged), as `DELETE item_path` would; returns what the
    /// apiserver would answer (a `Status` for configmaps, the object for pods and namespaces).
    ///
    /// # Panics
    /// If the path is not an object path or the object does not exist.
    pub async fn delete(&self, item_path: &str) -> Value {
        let (kind, ns, name) = item_route(item_path);
        delete_object(&self.shared, kind, ns.as_deref(), &name, &Value::Null)
            .unwrap_or_else(|s| panic!("delete {item_path}: {}", s.to_json()))
    }

    /// The stored object at `item_path`, if any.
    pub fn get(&self, item_path: &str) -> Option<Value> {
        let (kind, ns, name) = item_route(item_path);
        self.shared
            .store()
            .objects(kind)
            .get(&object_key(kind, ns.as_deref(), &name))
            .cloned()
    }

    /// Stops accepting, closes every connection (open watches end abruptly) and waits for the
    /// accept loop to finish.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.cancel();
        if let Some(accept) = self.accept.take() {
            let _ = accept.await;
        }
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
    }
}

fn item_route(path: &str) -> (Kind, Option<String>, String) {
    match parse_route(path) {
        Some(Route::Item {
            kind,
            namespace,
            name,
            subresource: None,
        }) => (kind, namespace, name),
        _ => panic!("not an object path: {path}"),
    }
}

impl Faults {
    /// Ends every open watch stream now, abruptly: the body ends with an error, as on a
    /// connection loss (HTTP/1.1 closes the connection without the last chunk, HTTP/2 resets the
    /// stream).
    pub fn drop_watches(&self) {
        self.shared.store().end_watchers(WatchMsg::Abort);
    }

    /// Ends every open watch stream cleanly, as the apiserver does at a watch's timeout.
    pub fn end_watches_cleanly(&self) {
        self.shared.store().end_watchers(WatchMsg::End);
    }

    /// The next `n` requests (of any kind) get a `Status` error with `code`.
    ///
    /// The reason follows the code: 500 InternalError, 503 ServiceUnavailable, 429
    /// TooManyRequests (with `Retry-After: 1`), 410 Expired, 504 Timeout, 401 Unauthorized, 403
    /// Forbidden, 404 NotFound, 409 Conflict, 400 BadRequest, 422 Invalid.
    pub fn fail_next(&self, n: usize, code: u16) {
        *lock(&self.shared.fail_next) = (n, code);
    }

    /// Delays every response (including injected failures and watch headers) by `d`.
    pub fn set_delay(&self, d: Duration) {
        *lock(&self.shared.delay) = d;
    }

    /// While on, new connections are closed right after accept, and requests arriving on
    /// already open connections get the connection closed without a response.
    pub fn set_refuse(&self, on: bool) {
        self.shared.refuse.store(on, Ordering::SeqCst);
    }

    /// Puts a bearer token or a user name (a client certificate's CN, sent by the proxy as
    /// `Impersonate-User`, or a SubjectAccessReview's user or group) on the deny list: its
    /// resource requests get 403 Forbidden and access reviews about it answer
    /// `allowed: false`. Everyone else is allowed everything but impersonation
    /// ([`Faults::allow_impersonation`]).
    pub fn deny(&self, token_or_user: &str) {
        lock(&self.shared.deny).insert(token_or_user.to_string());
    }

    /// Lets `user` impersonate: SubjectAccessReviews with verb `impersonate` are allowed only
    /// for such users.
    pub fn allow_impersonation(&self, user: &str) {
        lock(&self.shared.impersonators).insert(user.to_string());
    }

    /// SubjectAccessReviews about `user` are allowed only in these namespaces (denied at
    /// cluster scope and elsewhere), like a user with RoleBindings in just those.
    pub fn allow_only_in(&self, user: &str, namespaces: &[&str]) {
        lock(&self.shared.only_in).insert(
            user.to_string(),
            namespaces.iter().map(|n| n.to_string()).collect(),
        );
    }

    /// Delays the answers to SubjectAccessReviews and TokenReviews (nothing else) by `d`, so
    /// concurrent identical reviews overlap.
    pub fn set_review_delay(&self, d: Duration) {
        *lock(&self.shared.review_delay) = d;
    }

    /// While on, SubjectAccessReviews and TokenReviews (nothing else) answer 500.
    pub fn fail_reviews(&self, on: bool) {
        self.shared.fail_reviews.store(on, Ordering::SeqCst);
    }

    /// Serves `/.well-known/openid-configuration` naming `issuer` and `/openid/v1/jwks` with
    /// `jwks` (a JWK set document); `None`: both answer 503, as an apiserver that cannot.
    pub fn set_jwks(&self, issuer_and_jwks: Option<(&str, &str)>) {
        *lock(&self.shared.jwks) = issuer_and_jwks.map(|(i, j)| (i.to_string(), j.to_string()));
    }

    /// Ends every open watch with an ERROR event carrying 410 Expired ("too old resource
    /// version"), as the apiserver does when a watcher falls behind its window; a client must
    /// relist.
    pub fn expire_watches(&self) {
        let mut store = self.shared.store();
        let rv = store.rv;
        let status = Status::expired(&format!("too old resource version: {rv} ({})", rv + 1));
        let obj: Value = serde_json::from_str(&status.to_json()).unwrap_or(Value::Null);
        for w in store.watchers.drain(..) {
            let _ = w.tx.send(WatchMsg::Line(event_line("ERROR", &obj)));
            let _ = w.tx.send(WatchMsg::End);
        }
    }

    /// Serves `GET /metrics` (Prometheus text) from `text(n)` for the n-th scrape, counting
    /// from 1, so a test can make counters and histograms move between scrapes. Default: an
    /// empty exposition.
    pub fn set_metrics(&self, text: impl Fn(u64) -> String + Send + Sync + 'static) {
        lock(&self.shared.metrics).0 = Arc::new(text);
    }

    /// Period of BOOKMARK events on watches with `allowWatchBookmarks=true` (default 1 s).
    /// Applies from each watch's next bookmark on.
    pub fn set_bookmark_interval(&self, d: Duration) {
        *lock(&self.shared.bookmark_interval) = d.max(Duration::from_millis(1));
    }
}

// ---------------------------------------------------------------------------------------------
// Kinds and keys
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Namespace,
    ConfigMap,
    Pod,
    /// apiextensions.k8s.io/v1 CustomResourceDefinitions (stored, established at once).
    Crd,
    /// example.com/v1 widgets: a custom resource, served only while the CRD
    /// [`WIDGETS_CRD`] exists.
    Widget,
}

/// The one CRD whose resource the fake serves.
pub const WIDGETS_CRD: &str = "widgets.example.com";

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::Namespace,
        Kind::ConfigMap,
        Kind::Pod,
        Kind::Crd,
        Kind::Widget,
    ];
    const CORE: [Kind; 3] = [Kind::Namespace, Kind::ConfigMap, Kind::Pod];

    fn resource(self) -> &'static str {
        match self {
            Kind::Namespace => "namespaces",
            Kind::ConfigMap => "configmaps",
            Kind::Pod => "pods",
            Kind::Crd => "customresourcedefinitions",
            Kind::Widget => "widgets",
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::ConfigMap => "ConfigMap",
            Kind::Pod => "Pod",
            Kind::Crd => "CustomResourceDefinition",
            Kind::Widget => "Widget",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::Crd => "apiextensions.k8s.io/v1",
            Kind::Widget => "example.com/v1",
            _ => "v1",
        }
    }

    /// Custom resources keep kind/apiVersion in list items.
    fn custom(self) -> bool {
        self == Kind::Widget
    }

    fn namespaced(self) -> bool {
        !matches!(self, Kind::Namespace | Kind::Crd)
    }

    fn has_status(self) -> bool {
        !matches!(self, Kind::ConfigMap | Kind::Widget)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The object's key relative to `/registry/<resource>/`: `ns/name` or `name`. Sorting these as
/// bytes gives etcd's key order.
fn object_key(kind: Kind, ns: Option<&str>, name: &str) -> String {
    match (kind.namespaced(), ns) {
        (true, Some(ns)) => format!("{ns}/{name}"),
        _ => name.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Store
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One write as the store applied it, for [`FakeApiServer::writes`].
#[derive(Debug, Clone)]
pub struct Write {
    pub rv: u64,
    /// `configmaps`, `pods` or `namespaces`.
    pub resource: &'static str,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub typ: &'static str,
    /// The object after the write; for a delete its last state stamped with the delete's
    /// resourceVersion (as a watch delivers it).
    pub object: Value,
}

/// One write. `obj` is the object after the write (for DELETED: the last state, stamped with
/// the deletion's resourceVersion, as etcd watch delivers it); `prev` the stored state before.
struct HistEvent {
    rv: u64,
    kind: Kind,
    key: String,
    typ: EventType,
    obj: Value,
    prev: Option<Value>,
}

#[derive(Clone)]
enum WatchMsg {
    Line(Bytes),
    End,
    Abort,
}

struct Watcher {
    id: u64,
    filter: Filter,
    tx: mpsc::UnboundedSender<WatchMsg>,
}

struct Store {
    rv: u64,
    /// Oldest resourceVersion whose state can still be rebuilt: history holds every event with
    /// `rv > floor`.
    floor: u64,
    objects: [BTreeMap<String, Value>; 5],
    history: VecDeque<HistEvent>,
    /// Every write ever, for [`FakeApiServer::writes`]; never compacted.
    journal: Vec<Write>,
    watchers: Vec<Watcher>,
    next_watcher_id: u64,
    next_uid: u64,
}

impl Store {
    fn new() -> Store {
        Store {
            rv: 0,
            floor: 0,
            objects: Default::default(),
            history: VecDeque::new(),
            journal: Vec::new(),
            watchers: Vec::new(),
            next_watcher_id: 0,
            next_uid: 0,
        }
    }

    fn objects(&self, kind: Kind) -> &BTreeMap<String, Value> {
        &self.objects[kind.index()]
    }

    fn compact(&mut self, rv: u64) {
        let rv = rv.min(self.rv);
        if rv <= self.floor {
            return;
        }
        self.floor = rv;
        while self.history.front().is_some_and(|e| e.rv <= rv) {
            self.history.pop_front();
        }
    }

    fn new_uid(&mut self) -> String {
        self.next_uid += 1;
        // Unique per server and stable in shape; the prefix keeps servers apart.
        static SERVER_NONCE: AtomicU64 = AtomicU64::new(0);
        let nonce = SERVER_NONCE.fetch_add(1, Ordering::Relaxed) & 0xffff;
        format!(
            "{:08x}-{:04x}-4000-8000-{:012x}",
            std::process::id(),
            nonce,
            self.next_uid
        )
    }

    /// Applies one write: bumps the resourceVersion, stamps it, records history and notifies
    /// watchers. `new` is the object to store (`None` deletes). Returns the event's object.
    fn write_locked(&mut self, kind: Kind, key: &str, new: Option<Value>) -> Value {
        self.rv += 1;
        let rv = self.rv;
        let map = &mut self.objects[kind.index()];
        let prev = map.get(key).cloned();
        let (typ, obj) = match new {
            Some(mut obj) => {
                set_rv(&mut obj, rv);
                map.insert(key.to_string(), obj.clone());
                let typ = if prev.is_some() {
                    EventType::Modified
                } else {
                    EventType::Added
                };
                (typ, obj)
            }
            None => {
                map.remove(key);
                let mut obj = prev.clone().unwrap_or(Value::Null);
                set_rv(&mut obj, rv);
                (EventType::Deleted, obj)
            }
        };
        let event = HistEvent {
            rv,
            kind,
            key: key.to_string(),
            typ,
            obj: obj.clone(),
            prev,
        };
        self.watchers.retain(|w| match w.filter.convert(&event) {
            Some(line) => w.tx.send(WatchMsg::Line(line)).is_ok(),
            None => !w.tx.is_closed(),
        });
        self.journal.push(Write {
            rv,
            resource: kind.resource(),
            typ: typ.as_str(),
            object: obj.clone(),
        });
        self.history.push_back(event);
        if self.history.len() > HISTORY_CAPACITY
            && let Some(old) = self.history.pop_front()
        {
            self.floor = old.rv;
        }
        obj
    }

    /// The objects of `kind` as they were at `rv` (`floor <= rv <= self.rv`).
    fn state_at(&self, kind: Kind, rv: u64) -> BTreeMap<String, Value> {
        let mut map = self.objects(kind).clone();
        for e in self.history.iter().rev().take_while(|e| e.rv > rv) {
            if e.kind != kind {
                continue;
            }
            match &e.prev {
                Some(prev) => map.insert(e.key.clone(), prev.clone()),
                None => map.remove(&e.key),
            };
        }
        map
    }

    fn end_watchers(&mut self, msg: WatchMsg) {
        for w in self.watchers.drain(..) {
            let _ = w.tx.send(msg.clone());
        }
    }
}

fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
    }
}

// ---------------------------------------------------------------------------------------------
// Server plumbing
// ---------------------------------------------------------------------------------------------

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let stream = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        if shared.refuse.load(Ordering::SeqCst) {
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            let service_shared = shared.clone();
            let service = service_fn(move |req| handle(service_shared.clone(), req));
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::select! {
                _ = shared.shutdown.cancelled() => {}
                _ = conn => {}
            }
        });
    }
}

async fn handle(
    shared: Arc<Shared>,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, BoxError> {
    let upgrade_requested = req.headers().contains_key(UPGRADE);
    let on_upgrade = upgrade_requested.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let body = if upgrade_requested {
        Bytes::new()
    } else {
        body.collect().await?.to_bytes()
    };
    lock(&shared.log).push(LoggedRequest {
        method: parts.method.clone(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts.headers.clone(),
        body: body.clone(),
    });

    if shared.refuse.load(Ordering::SeqCst) {
        return Err("connection refused by fault injection".into());
    }
    let injected = {
        let mut fail = lock(&shared.fail_next);
        if fail.0 > 0 {
            fail.0 -= 1;
            Some(fail.1)
        } else {
            None
        }
    };
    let delay = *lock(&shared.delay);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if let Some(code) = injected {
        return Ok(Status::injected(code).into_response());
    }

    let req = ReadRequest {
        method: parts.method,
        path: parts.uri.path().to_string(),
        query: Query::parse(parts.uri.query().unwrap_or("")),
        headers: parts.headers,
        body,
    };
    Ok(match route(&shared, req, on_upgrade).await {
        Ok(resp) => resp,
        Err(status) => status.into_response(),
    })
}

/// A request with its body read.
struct ReadRequest {
    method: Method,
    path: String,
    query: Query,
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Debug, PartialEq)]
enum Route {
    Collection {
        kind: Kind,
        namespace: Option<String>,
    },
    Item {
        kind: Kind,
        namespace: Option<String>,
        name: String,
        subresource: Option<String>,
    },
}

/// Parses `/api/v1/...`, `/apis/apiextensions.k8s.io/v1/...` and `/apis/example.com/v1/...`
/// resource paths. `/api/v1/watch/...` paths are handled by the caller.
fn parse_route(path: &str) -> Option<Route> {
    let (rest, kinds): (&str, &[Kind]) = if let Some(r) = path.strip_prefix("/api/v1/") {
        (r, &Kind::CORE)
    } else if let Some(r) = path.strip_prefix("/apis/apiextensions.k8s.io/v1/") {
        (r, &[Kind::Crd])
    } else if let Some(r) = path.strip_prefix("/apis/example.com/v1/") {
        (r, &[Kind::Widget])
    } else {
        return None;
    };
    let from_resource = |res: &str| kinds.iter().copied().find(|k| k.resource() == res);
    let core = kinds.contains(&Kind::Namespace);
    let segs: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    if segs.iter().any(|s| s.is_empty()) {
        return None;
    }
    match segs.as_slice() {
        [res] => Some(Route::Collection {
            kind: from_resource(res)?,
            namespace: None,
        }),
        [res, name] if !core => Some(Route::Item {
            kind: from_resource(res).filter(|k| !k.namespaced())?,
            namespace: None,
            name: name.to_string(),
            subresource: None,
        }),
        ["namespaces", name] if core => Some(Route::Item {
            kind: Kind::Namespace,
            namespace: None,
            name: name.to_string(),
            subresource: None,
        }),
        ["namespaces", name, "status"] if core => Some(Route::Item {
            kind: Kind::Namespace,
            namespace: None,
            name: name.to_string(),
            subresource: Some("status".into()),
        }),
        ["namespaces", ns, res] => {
            let kind = from_resource(res).filter(|k| k.namespaced())?;
            Some(Route::Collection {
                kind,
                namespace: Some(ns.to_string()),
            })
        }
        ["namespaces", ns, res, name] => {
            let kind = from_resource(res).filter(|k| k.namespaced())?;
            Some(Route::Item {
                kind,
                namespace: Some(ns.to_string()),
                name: name.to_string(),
                subresource: None,
            })
        }
        ["namespaces", ns, res, name, sub] => {
            let kind = from_resource(res).filter(|k| k.namespaced())?;
            let known = match kind {
                Kind::Pod => ["status", "exec", "attach", "portforward"].contains(sub),
                _ => false,
            };
            known.then(|| Route::Item {
                kind,
                namespace: Some(ns.to_string()),
                name: name.to_string(),
                subresource: Some(sub.to_string()),
            })
        }
        _ => None,
    }
}

async fn route(
    shared: &Arc<Shared>,
    req: ReadRequest,
    on_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response<Body>, Status> {
    let path = req.path.as_str();
    match path {
        "/livez" | "/readyz" | "/healthz" => return Ok(text_response(StatusCode::OK, "ok")),
        "/version" => return Ok(json_response(StatusCode::OK, version_json())),
        "/metrics" => {
            let (text, n) = {
                let mut m = lock(&shared.metrics);
                m.1 += 1;
                (m.0.clone(), m.1)
            };
            let mut resp = Response::new(full_body(text(n)));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            return Ok(resp);
        }
        "/api" => {
            return Ok(json_response(
                StatusCode::OK,
                api_versions_json(shared.addr),
            ));
        }
        "/api/v1" => return Ok(json_response(StatusCode::OK, api_resource_list_json())),
        // The authorization group is not advertised in discovery: the proxy posts its
        // reviews directly, and clients that discover it would expect more of it.
        "/apis" => {
            let mut groups = vec![api_group_json("apiextensions.k8s.io")];
            if widgets_served(shared) {
                groups.push(api_group_json("example.com"));
            }
            return Ok(json_response(
                StatusCode::OK,
                format!(
                    r#"{{"kind":"APIGroupList","apiVersion":"v1","groups":[{}]}}"#,
                    groups.join(",")
                ),
            ));
        }
        "/apis/apiextensions.k8s.io" => {
            return Ok(json_response(
                StatusCode::OK,
                api_group_json("apiextensions.k8s.io"),
            ));
        }
        "/apis/apiextensions.k8s.io/v1" => {
            return Ok(json_response(
                StatusCode::OK,
                group_resource_list_json(Kind::Crd),
            ));
        }
        "/apis/example.com" if widgets_served(shared) => {
            return Ok(json_response(StatusCode::OK, api_group_json("example.com")));
        }
        "/apis/example.com/v1" if widgets_served(shared) => {
            return Ok(json_response(
                StatusCode::OK,
                group_resource_list_json(Kind::Widget),
            ));
        }
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews" => {
            return access_review(shared, &req, true);
        }
        "/apis/authorization.k8s.io/v1/subjectaccessreviews"
        | "/apis/authentication.k8s.io/v1/tokenreviews" => {
            let d = *lock(&shared.review_delay);
            tokio::time::sleep(d).await;
            if shared.fail_reviews.load(Ordering::SeqCst) {
                return Ok(Status::injected(500).into_response());
            }
            return if path.ends_with("/tokenreviews") {
                token_review(&req)
            } else {
                access_review(shared, &req, false)
            };
        }
        "/.well-known/openid-configuration" | "/openid/v1/jwks" => {
            let served = lock(&shared.jwks).clone();
            let Some((issuer, jwks)) = served else {
                return Ok(json_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    r#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":503}"#
                        .to_string(),
                ));
            };
            let doc = if path == "/openid/v1/jwks" {
                jwks
            } else {
                json!({"issuer": issuer, "jwks_uri": format!("{issuer}/openid/v1/jwks")})
                    .to_string()
            };
            return Ok(json_response(StatusCode::OK, doc));
        }
        _ => {}
    }

    // Legacy watch paths: /api/v1/watch/<collection or item>.
    let (path, legacy_watch) = match path.strip_prefix("/api/v1/watch/") {
        Some(rest) => (format!("/api/v1/{rest}"), true),
        None => (path.to_string(), false),
    };
    let Some(route) = parse_route(&path) else {
        return Err(Status::not_found_path());
    };
    let kind = match &route {
        Route::Collection { kind, .. } | Route::Item { kind, .. } => *kind,
    };
    if kind == Kind::Widget && !widgets_served(shared) {
        return Err(Status::not_found_path());
    }
    let method = req.method.clone();
    if let Some(user) = denied_caller(shared, &req.headers) {
        return Err(forbidden(
            &user,
            &method,
            legacy_watch || req.query.flag("watch"),
            &route,
        ));
    }
    match route {
        Route::Collection { kind, namespace } => {
            if let Some(ns) = &namespace {
                check_ns_segment(ns)?;
            }
            match method {
                Method::GET if legacy_watch || req.query.flag("watch") => {
                    let params = ListParams::parse(
                        &req.query,
                        kind,
                        true,
                        &selectable_fields(shared, kind),
                    )?;
                    watch(shared, kind, namespace, params).await
                }
                Method::GET => {
                    let params = ListParams::parse(
                        &req.query,
                        kind,
                        false,
                        &selectable_fields(shared, kind),
                    )?;
                    list(shared, kind, namespace.as_deref(), params).await
                }
                Method::POST if namespace.is_some() || !kind.namespaced() => {
                    let obj = parse_body(kind, &req.body)?;
                    let created = create_object(shared, kind, namespace.as_deref(), obj)?;
                    Ok(json_response(StatusCode::CREATED, to_json(&created)))
                }
                _ => Err(Status::method_not_allowed()),
            }
        }
        Route::Item {
            kind,
            namespace,
            name,
            subresource,
        } => {
            if let Some(ns) = &namespace {
                check_ns_segment(ns)?;
            }
            let ns = namespace.as_deref();
            if legacy_watch {
                if subresource.is_some() || method != Method::GET {
                    return Err(Status::not_found_path());
                }
                let mut params =
                    ListParams::parse(&req.query, kind, true, &selectable_fields(shared, kind))?;
                params.fields.reqs.push(FieldReq {
                    field: "metadata.name".into(),
                    value: name,
                    equal: true,
                });
                return watch(shared, kind, namespace, params).await;
            }
            match subresource.as_deref() {
                Some("exec" | "attach" | "portforward") => {
                    upgrade(shared, &req, ns, &name, on_upgrade)
                }
                Some(_status) => match method {
                    Method::GET => get_object(shared, kind, ns, &name),
                    Method::PUT => {
                        let obj = parse_body(kind, &req.body)?;
                        let updated = update_object(shared, kind, ns, &name, obj, true)?;
                        Ok(json_response(StatusCode::OK, to_json(&updated)))
                    }
                    Method::PATCH => patch(shared, &req, kind, ns, &name, true),
                    _ => Err(Status::method_not_allowed()),
                },
                None => match method {
                    Method::GET => get_object(shared, kind, ns, &name),
                    Method::PUT => {
                        let obj = parse_body(kind, &req.body)?;
                        let updated = update_object(shared, kind, ns, &name, obj, false)?;
                        Ok(json_response(StatusCode::OK, to_json(&updated)))
                    }
                    Method::PATCH => patch(shared, &req, kind, ns, &name, false),
                    Method::DELETE => {
                        let options = if req.body.is_empty() {
                            Value::Null
                        } else {
                            serde_json::from_slice(&req.body).map_err(|e| {
                                Status::bad_request(format!(
                                    "the object provided is unrecognized (must be of type DeleteOptions): {e}"
                                ))
                            })?
                        };
                        let out = delete_object(shared, kind, ns, &name, &options)?;
                        Ok(json_response(StatusCode::OK, to_json(&out)))
                    }
                    _ => Err(Status::method_not_allowed()),
                },
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Authorization
// ---------------------------------------------------------------------------------------------

/// The bearer token of a request, if any.
fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// The caller's user name (the impersonated user, else the token) when it is on the deny list.
fn denied_caller(shared: &Shared, headers: &HeaderMap) -> Option<String> {
    let deny = lock(&shared.deny);
    if deny.is_empty() {
        return None;
    }
    let impersonated = headers
        .get("impersonate-user")
        .and_then(|v| v.to_str().ok());
    [impersonated, bearer_token(headers)]
        .into_iter()
        .flatten()
        .find(|u| deny.contains(*u))
        .map(str::to_string)
}

/// RBAC's 403 for a resource request, in the apiserver's words.
fn forbidden(user: &str, method: &Method, watch: bool, route: &Route) -> Status {
    let (kind, namespace, name, collection) = match route {
        Route::Collection { kind, namespace } => (*kind, namespace.clone(), None, true),
        Route::Item {
            kind,
            namespace,
            name,
            ..
        } => (*kind, namespace.clone(), Some(name.clone()), false),
    };
    let verb = match *method {
        Method::GET if watch => "watch",
        Method::GET if collection => "list",
        Method::GET => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "unknown",
    };
    let subject = match &name {
        Some(n) => format!("{} {n:?}", kind.resource()),
        None => kind.resource().to_string(),
    };
    let scope = match &namespace {
        Some(ns) => format!(" in the namespace {ns:?}"),
        None => " at the cluster scope".to_string(),
    };
    Status::new(
        403,
        "Forbidden",
        format!(
            "{subject} is forbidden: User {user:?} cannot {verb} resource {:?} in API group \"\"{scope}",
            kind.resource()
        ),
    )
    .with_details(Details {
        name,
        kind: Some(kind.resource().to_string()),
        ..Details::default()
    })
}

/// `POST .../selfsubjectaccessreviews` (about the bearer token's user) and
/// `.../subjectaccessreviews` (about `spec.user` and `spec.groups`): the review back with
/// `status.allowed`, true unless a subject is on the deny list. 201 Created, like the apiserver.
fn access_review(
    shared: &Shared,
    req: &ReadRequest,
    self_review: bool,
) -> Result<Response<Body>, Status> {
    if req.method != Method::POST {
        return Err(Status::method_not_allowed());
    }
    let kind = if self_review {
        "SelfSubjectAccessReview"
    } else {
        "SubjectAccessReview"
    };
    let mut review: Value = serde_json::from_slice(&req.body).map_err(|e| {
        Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {kind}): {e}"
        ))
    })?;
    if !review.is_object() || review.get("kind").is_some_and(|k| k != kind) {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {kind})"
        )));
    }
    let token = bearer_token(&req.headers).map(str::to_string);
    let deny = lock(&shared.deny).clone();
    let spec = review.get("spec").cloned().unwrap_or(Value::Null);
    let allowed = if self_review {
        let Some(token) = token else {
            return Err(Status::new(401, "Unauthorized", "Unauthorized".into()));
        };
        !deny.contains(&token)
    } else {
        if let Some(caller) = token.filter(|t| deny.contains(t)) {
            return Err(Status::new(
                403,
                "Forbidden",
                format!(
                    "subjectaccessreviews.authorization.k8s.io is forbidden: User {caller:?} cannot create resource \"subjectaccessreviews\" in API group \"authorization.k8s.io\" at the cluster scope"
                ),
            ));
        }
        let user = spec.get("user").and_then(Value::as_str).unwrap_or("");
        let groups = spec
            .get("groups")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let impersonate = spec.pointer("/resourceAttributes/verb") == Some(&json!("impersonate"));
        let ns = spec
            .pointer("/resourceAttributes/namespace")
            .and_then(Value::as_str)
            .unwrap_or("");
        let in_scope = lock(&shared.only_in)
            .get(user)
            .is_none_or(|set| set.contains(ns));
        in_scope
            && (!impersonate || lock(&shared.impersonators).contains(user))
            && !deny.contains(user)
            && !groups
                .iter()
                .filter_map(Value::as_str)
                .any(|g| deny.contains(g))
    };
    let mut status = json!({ "allowed": allowed });
    if !allowed {
        status["reason"] = Value::from("denied by the fake apiserver's deny list");
    }
    let o = review.as_object_mut().expect("checked above");
    o.insert("kind".into(), kind.into());
    o.insert("apiVersion".into(), "authorization.k8s.io/v1".into());
    o.insert("metadata".into(), json!({ "creationTimestamp": null }));
    o.insert("status".into(), status);
    Ok(json_response(StatusCode::CREATED, to_json(&review)))
}

/// `POST .../tokenreviews`: every token authenticates as the user named like the token
/// itself (so the deny list applies to it in access reviews), in `system:authenticated`,
/// except tokens starting with `invalid`. 201 Created, like the apiserver.
fn token_review(req: &ReadRequest) -> Result<Response<Body>, Status> {
    if req.method != Method::POST {
        return Err(Status::method_not_allowed());
    }
    let mut review: Value = serde_json::from_slice(&req.body).map_err(|e| {
        Status::bad_request(format!(
            "the object provided is unrecognized (must be of type TokenReview): {e}"
        ))
    })?;
    let token = review
        .pointer("/spec/token")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let status = if token.is_empty() || token.starts_with("invalid") {
        json!({ "authenticated": false, "user": {}, "error": "invalid bearer token" })
    } else {
        json!({
            "authenticated": true,
            "user": { "username": token, "uid": format!("uid-{token}"), "groups": ["system:authenticated"] },
            "audiences": ["https://kubernetes.default.svc.cluster.local"],
        })
    };
    let Some(o) = review.as_object_mut() else {
        return Err(Status::bad_request(
            "the object provided is unrecognized (must be of type TokenReview)".into(),
        ));
    };
    o.insert("kind".into(), "TokenReview".into());
    o.insert("apiVersion".into(), "authentication.k8s.io/v1".into());
    o.insert("metadata".into(), json!({ "creationTimestamp": null }));
    o.insert("status".into(), status);
    Ok(json_response(StatusCode::CREATED, to_json(&review)))
}

fn check_ns_segment(ns: &str) -> Result<(), Status> {
    if is_dns_label(ns) {
        Ok(())
    } else {
        Err(Status::not_found(Kind::Namespace, ns))
    }
}

// ---------------------------------------------------------------------------------------------
// Reads
// ---------------------------------------------------------------------------------------------

fn get_object(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
) -> Result<Response<Body>, Status> {
    let store = shared.store();
    match store.objects(kind).get(&object_key(kind, ns, name)) {
        Some(obj) => Ok(json_response(StatusCode::OK, to_json(obj))),
        None => Err(Status::not_found(kind, name)),
    }
}

/// Parsed list/watch query parameters.
struct ListParams {
    rv: Option<u64>,
    /// `resourceVersion` was given and non-empty, but it is `"0"`.
    rv_zero: bool,
    rv_match: Option<String>,
    limit: Option<usize>,
    cont: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
    allow_bookmarks: bool,
    send_initial: Option<bool>,
    timeout: Option<Duration>,
}

impl ListParams {
    /// `selectable`: the kind's fields beyond [`supported_fields`] (a CRD's `selectableFields`).
    fn parse(
        q: &Query,
        kind: Kind,
        watch: bool,
        selectable: &[String],
    ) -> Result<ListParams, Status> {
        let rv_raw = q.get("resourceVersion").unwrap_or("");
        let rv = if rv_raw.is_empty() {
            None
        } else {
            Some(rv_raw.parse::<u64>().map_err(|_| {
                Status::bad_request(format!(
                    "resourceVersion: Invalid value: {rv_raw:?}: invalid resource version: strconv.ParseUint: parsing {rv_raw:?}: invalid syntax"
                ))
            })?)
        };
        let rv_match = q
            .get("resourceVersionMatch")
            .filter(|m| !m.is_empty())
            .map(str::to_string);
        let limit = match q.get("limit").filter(|l| !l.is_empty()) {
            None => None,
            Some(l) => {
                let n = l.parse::<i64>().map_err(|_| {
                    Status::bad_request(format!("strconv.ParseInt: parsing {l:?}: invalid syntax"))
                })?;
                // The apiserver treats limit <= 0 as "no limit".
                (n > 0).then(|| usize::try_from(n).unwrap_or(usize::MAX))
            }
        };
        let timeout = match q.get("timeoutSeconds").filter(|t| !t.is_empty()) {
            None => None,
            Some(t) => {
                let n = t.parse::<i64>().map_err(|_| {
                    Status::bad_request(format!("strconv.ParseInt: parsing {t:?}: invalid syntax"))
                })?;
                (n > 0).then(|| Duration::from_secs(n.unsigned_abs()))
            }
        };
        let send_initial = q.get("sendInitialEvents").map(parse_bool);
        let params = ListParams {
            rv,
            rv_zero: rv == Some(0),
            rv_match,
            limit,
            cont: q
                .get("continue")
                .filter(|c| !c.is_empty())
                .map(str::to_string),
            labels: LabelSelector::parse(q.get("labelSelector").unwrap_or(""))?,
            fields: FieldSelector::parse(q.get("fieldSelector").unwrap_or(""), kind, selectable)?,
            allow_bookmarks: q.flag("allowWatchBookmarks"),
            send_initial,
            timeout,
        };
        params.validate(watch, rv_raw)?;
        Ok(params)
    }

    /// Mirrors `ValidateListOptions` in k8s.io/apimachinery `internalversion/validation`.
    fn validate(&self, watch: bool, rv_raw: &str) -> Result<(), Status> {
        let mut errs: Vec<(&str, String, &str)> = Vec::new();
        let m = self.rv_match.as_deref();
        if watch {
            if let Some(_send) = self.send_initial
                && m != Some("NotOlderThan")
            {
                errs.push((
                    "resourceVersionMatch",
                    "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan".into(),
                    "FieldValueForbidden",
                ));
            }
            if let Some(m) = m {
                if self.send_initial.is_none() {
                    errs.push((
                        "resourceVersionMatch",
                        "Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided".into(),
                        "FieldValueForbidden",
                    ));
                }
                if m != "NotOlderThan" {
                    errs.push((
                        "resourceVersionMatch",
                        format!("Unsupported value: {m:?}: supported values: \"NotOlderThan\""),
                        "FieldValueNotSupported",
                    ));
                }
            }
        } else {
            if self.send_initial.is_some() {
                errs.push((
                    "sendInitialEvents",
                    "Forbidden: sendInitialEvents is forbidden for list".into(),
                    "FieldValueForbidden",
                ));
            }
            if let Some(m) = m {
                if rv_raw.is_empty() {
                    errs.push((
                        "resourceVersionMatch",
                        "Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided".into(),
                        "FieldValueForbidden",
                    ));
                }
                if self.cont.is_some() {
                    errs.push((
                        "resourceVersionMatch",
                        "Forbidden: resourceVersionMatch is forbidden when continue is provided"
                            .into(),
                        "FieldValueForbidden",
                    ));
                }
                match m {
                    "Exact" if self.rv_zero => errs.push((
                        "resourceVersionMatch",
                        "Forbidden: resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"".into(),
                        "FieldValueForbidden",
                    )),
                    "Exact" | "NotOlderThan" => {}
                    other => errs.push((
                        "resourceVersionMatch",
                        format!(
                            "Unsupported value: {other:?}: supported values: \"Exact\", \"NotOlderThan\", \"\""
                        ),
                        "FieldValueNotSupported",
                    )),
                }
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(Status::invalid_list_options(&errs))
        }
    }
}

/// Waits (bounded) until the store has reached `rv`.
///
/// # Errors
/// 504 "Too large resource version" with `Retry-After: 1`, like the apiserver's cacher.
async fn wait_for_rv(shared: &Shared, rv: u64) -> Result<(), Status> {
    let mut rx = shared.rv_tx.subscribe();
    if shared.store().rv >= rv {
        return Ok(());
    }
    let reached = tokio::time::timeout(FRESHNESS_WAIT, rx.wait_for(|v| *v >= rv)).await;
    match reached {
        Ok(Ok(_)) => Ok(()),
        _ => Err(Status::too_large_rv(rv, shared.store().rv)),
    }
}

async fn list(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    p: ListParams,
) -> Result<Response<Body>, Status> {
    let prefix = ns.map(|ns| format!("{ns}/")).unwrap_or_default();
    // (snapshot rv or None for latest, start key)
    let (at, start) = if let Some(token) = &p.cont {
        if p.rv.is_some() && !p.rv_zero {
            return Err(Status::bad_request(
                "specifying resource version is not allowed when using continue".into(),
            ));
        }
        let (start, token_rv) = decode_continue(token, &prefix)
            .map_err(|e| Status::bad_request(format!("invalid continue token: {e}")))?;
        (u64::try_from(token_rv).ok(), Some(start))
    } else {
        let exact = match (p.rv, p.rv_match.as_deref()) {
            (Some(n), Some("Exact")) => Some(n),
            // Legacy: a non-zero resourceVersion with a limit and no match means Exact.
            (Some(n), None) if n > 0 && p.limit.is_some() => Some(n),
            _ => None,
        };
        match (exact, p.rv) {
            (Some(n), _) => (Some(n), None),
            (None, Some(n)) if n > 0 => {
                wait_for_rv(shared, n).await?;
                (None, None)
            }
            _ => (None, None),
        }
    };
    if let Some(at) = at {
        wait_for_rv(shared, at).await?;
    }

    let store = shared.store();
    let snapshot_rv = at.unwrap_or(store.rv);
    if snapshot_rv < store.floor {
        return Err(match &start {
            Some(start) => Status::continue_expired(&encode_continue(&start[prefix.len()..], -1)),
            None => Status::expired("The resourceVersion for the provided list is too old."),
        });
    }
    let snapshot;
    let objects = if snapshot_rv == store.rv {
        store.objects(kind)
    } else {
        snapshot = store.state_at(kind, snapshot_rv);
        &snapshot
    };
    let from = start.unwrap_or_else(|| prefix.clone());
    let mut in_scope = objects
        .range(from..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .peekable();
    let mut items: Vec<&Value> = Vec::new();
    let mut last_key: Option<&String> = None;
    // resourceVersion "0" is served from the apiserver's watch cache, which ignores limit.
    let limit = match p.limit {
        Some(l) if !p.rv_zero => l,
        _ => usize::MAX,
    };
    while items.len() < limit {
        let Some((key, obj)) = in_scope.next() else {
            break;
        };
        if p.labels.matches(obj) && p.fields.matches(obj) {
            items.push(obj);
            last_key = Some(key);
        }
    }
    let has_more = items.len() >= limit && in_scope.peek().is_some();
    let mut meta = JsonObj::new().str("resourceVersion", &snapshot_rv.to_string());
    if has_more && let Some(last) = last_key {
        let token = encode_continue(
            &format!("{}\u{0}", &last[prefix.len()..]),
            snapshot_rv as i64,
        );
        meta = meta.str("continue", &token);
        // etcd counts the remaining keys; with selectors the count would be wrong, so the
        // apiserver leaves it out.
        if p.labels.is_empty() && p.fields.is_empty() {
            meta = meta.raw("remainingItemCount", &in_scope.count().to_string());
        }
    }
    let mut out = JsonObj::new()
        .str("kind", &format!("{}List", kind.kind()))
        .str("apiVersion", kind.api_version())
        .raw("metadata", &meta.finish())
        .finish();
    out.pop();
    out.push_str(",\"items\":[");
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Items of a typed list carry no kind/apiVersion; a custom resource's do.
        let mut item = (*item).clone();
        if let Some(o) = item.as_object_mut().filter(|_| !kind.custom()) {
            o.remove("kind");
            o.remove("apiVersion");
        }
        out.push_str(&to_json(&item));
    }
    out.push_str("]}");
    Ok(json_response(StatusCode::OK, out))
}

// ---------------------------------------------------------------------------------------------
// Watch
// ---------------------------------------------------------------------------------------------

/// What a watcher receives: kind, namespace scope and selectors.
struct Filter {
    kind: Kind,
    /// Only events after this resourceVersion (a watch from a future resourceVersion waits).
    after_rv: u64,
    namespace: Option<String>,
    labels: LabelSelector,
    fields: FieldSelector,
}

impl Filter {
    fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && meta_str(obj, "namespace") != Some(ns.as_str())
        {
            return false;
        }
        self.labels.matches(obj) && self.fields.matches(obj)
    }

    /// The watch line this watcher sees for `e`, following the cacher's rules: an object that
    /// starts matching arrives as ADDED, one that stops matching as DELETED.
    fn convert(&self, e: &HistEvent) -> Option<Bytes> {
        if e.kind != self.kind || e.rv <= self.after_rv {
            return None;
        }
        let cur = e.typ != EventType::Deleted && self.matches(&e.obj);
        let old = match e.typ {
            EventType::Added => false,
            EventType::Modified => e.prev.as_ref().is_some_and(|p| self.matches(p)),
            EventType::Deleted => self.matches(&e.obj),
        };
        match (old, cur) {
            (false, true) => Some(event_line(EventType::Added.as_str(), &e.obj)),
            (true, true) => Some(event_line(EventType::Modified.as_str(), &e.obj)),
            (true, false) if e.typ == EventType::Deleted => {
                Some(event_line(EventType::Deleted.as_str(), &e.obj))
            }
            (true, false) => {
                // The previous state, stamped with this event's resourceVersion.
                let mut prev = e.prev.clone().unwrap_or(Value::Null);
                set_rv(&mut prev, e.rv);
                Some(event_line(EventType::Deleted.as_str(), &prev))
            }
            (false, false) => None,
        }
    }
}

fn event_line(typ: &str, obj: &Value) -> Bytes {
    let mut s = String::with_capacity(64);
    s.push_str("{\"type\":\"");
    s.push_str(typ);
    s.push_str("\",\"object\":");
    s.push_str(&to_json(obj));
    s.push_str("}\n");
    Bytes::from(s)
}

fn bookmark_line(kind: Kind, rv: u64, initial_events_end: bool) -> Bytes {
    let mut meta = JsonObj::new().str("resourceVersion", &rv.to_string());
    if initial_events_end {
        meta = meta.raw("annotations", r#"{"k8s.io/initial-events-end":"true"}"#);
    }
    let obj = JsonObj::new()
        .str("kind", kind.kind())
        .str("apiVersion", kind.api_version())
        .raw("metadata", &meta.finish())
        .finish();
    Bytes::from(format!("{{\"type\":\"BOOKMARK\",\"object\":{obj}}}\n"))
}

async fn watch(
    shared: &Arc<Shared>,
    kind: Kind,
    namespace: Option<String>,
    p: ListParams,
) -> Result<Response<Body>, Status> {
    if p.send_initial == Some(true)
        && let Some(n) = p.rv.filter(|n| *n > 0)
    {
        wait_for_rv(shared, n).await?;
    }
    let mut filter = Filter {
        kind,
        after_rv: 0,
        namespace,
        labels: p.labels,
        fields: p.fields,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let id;
    let start_rv;
    {
        let mut store = shared.store();
        id = store.next_watcher_id;
        store.next_watcher_id += 1;
        let initial_events = match p.send_initial {
            Some(send) => send,
            None => p.rv.is_none_or(|n| n == 0),
        };
        let mut registered = true;
        filter.after_rv = store.rv;
        if initial_events {
            for obj in store.objects(kind).values().filter(|o| filter.matches(o)) {
                let _ = tx.send(WatchMsg::Line(event_line("ADDED", obj)));
            }
            // kube-apiserver 1.36 ends initial events with this bookmark whenever bookmarks
            // are allowed, also for RV unset / "0" watches without sendInitialEvents.
            if p.allow_bookmarks {
                let _ = tx.send(WatchMsg::Line(bookmark_line(kind, store.rv, true)));
            }
        } else if let Some(n) = p.rv.filter(|n| *n > 0) {
            if n < store.floor {
                let status =
                    Status::expired(&format!("too old resource version: {n} ({})", store.floor));
                let obj: Value = serde_json::from_str(&status.to_json()).unwrap_or(Value::Null);
                let _ = tx.send(WatchMsg::Line(event_line("ERROR", &obj)));
                let _ = tx.send(WatchMsg::End);
                registered = false;
            } else {
                filter.after_rv = n;
                for e in store.history.iter().filter(|e| e.rv > n) {
                    if let Some(line) = filter.convert(e) {
                        let _ = tx.send(WatchMsg::Line(line));
                    }
                }
            }
        }
        start_rv = filter.after_rv;
        if registered {
            store.watchers.push(Watcher {
                id,
                filter,
                tx: tx.clone(),
            });
        }
    }
    let now = Instant::now();
    let state = WatchStream {
        rx,
        tx,
        shared: shared.clone(),
        id,
        kind,
        start_rv,
        bookmarks: p.allow_bookmarks,
        next_bookmark: after(now, *lock(&shared.bookmark_interval)),
        pre_deadline_bookmark: p
            .timeout
            .filter(|t| *t > PRE_DEADLINE_BOOKMARK)
            .map(|t| after(now, t - PRE_DEADLINE_BOOKMARK)),
        deadline: p.timeout.map(|t| after(now, t)),
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut ws| async move {
        let item = ws.next_item().await?;
        Some((item, ws))
    });
    let body = StreamBody::new(stream.boxed()).boxed_unsync();
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    add_common_headers(resp.headers_mut());
    Ok(resp)
}

/// Stands in for "never" in timers.
const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365);

/// `t + d`, saturating far in the future instead of overflowing on absurd inputs.
fn after(t: Instant, d: Duration) -> Instant {
    t.checked_add(d.min(FAR_FUTURE))
        .unwrap_or_else(|| t + Duration::from_secs(86_400))
}

/// The state of one open watch response body.
struct WatchStream {
    rx: mpsc::UnboundedReceiver<WatchMsg>,
    /// For bookmarks: they are queued under the store lock so they never overtake an event.
    tx: mpsc::UnboundedSender<WatchMsg>,
    shared: Arc<Shared>,
    id: u64,
    kind: Kind,
    /// The resourceVersion the watch starts after.
    start_rv: u64,
    bookmarks: bool,
    next_bookmark: Instant,
    pre_deadline_bookmark: Option<Instant>,
    deadline: Option<Instant>,
    done: bool,
}

impl WatchStream {
    async fn next_item(&mut self) -> Option<Result<Frame<Bytes>, BoxError>> {
        if self.done {
            return None;
        }
        loop {
            let far = after(Instant::now(), FAR_FUTURE);
            let bookmark_at = match self.pre_deadline_bookmark {
                Some(pre) if pre < self.next_bookmark => pre,
                _ => self.next_bookmark,
            };
            tokio::select! {
                biased;
                msg = self.rx.recv() => match msg {
                    Some(WatchMsg::Line(line)) => return Some(Ok(Frame::data(line))),
                    Some(WatchMsg::End) | None => {
                        self.finish();
                        return None;
                    }
                    Some(WatchMsg::Abort) => {
                        self.finish();
                        return Some(Err("watch dropped by fault injection".into()));
                    }
                },
                _ = tokio::time::sleep_until(self.deadline.unwrap_or(far)) => {
                    self.finish();
                    return None;
                }
                _ = tokio::time::sleep_until(bookmark_at), if self.bookmarks => {
                    if self.pre_deadline_bookmark.is_some_and(|pre| pre <= Instant::now()) {
                        self.pre_deadline_bookmark = None;
                    } else {
                        self.next_bookmark =
                            after(Instant::now(), *lock(&self.shared.bookmark_interval));
                    }
                    let store = self.shared.store();
                    // Queued while holding the lock: every event up to store.rv is already
                    // in the queue ahead of it.
                    // Never below where the watch started (a watch from a future resourceVersion).
                    let rv = store.rv.max(self.start_rv);
                    let _ = self.tx.send(WatchMsg::Line(bookmark_line(self.kind, rv, false)));
                }
            }
        }
    }

    fn finish(&mut self) {
        self.done = true;
        let id = self.id;
        self.shared.store().watchers.retain(|w| w.id != id);
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        if !self.done {
            self.finish();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writes
// ---------------------------------------------------------------------------------------------

/// Decodes a request body as an object of `kind`.
///
/// # Errors
/// 400 BadRequest for malformed JSON, a non-object, or another kind/apiVersion.
fn parse_body(kind: Kind, body: &[u8]) -> Result<Value, Status> {
    let unrecognized = |detail: String| {
        Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): {detail}",
            kind.kind()
        ))
    };
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| unrecognized(format!("couldn't get version/kind; json parse error: {e}")))?;
    if !v.is_object() {
        return Err(unrecognized(
            "couldn't get version/kind; json parse error: expected an object".into(),
        ));
    }
    check_type_meta(kind, &v)?;
    Ok(v)
}

fn check_type_meta(kind: Kind, v: &Value) -> Result<(), Status> {
    if let Some(k) = v
        .get("kind")
        .and_then(Value::as_str)
        .filter(|k| !k.is_empty())
        && k != kind.kind()
    {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): {k} (not {})",
            kind.kind(),
            kind.kind()
        )));
    }
    if let Some(av) = v
        .get("apiVersion")
        .and_then(Value::as_str)
        .filter(|a| !a.is_empty())
        && av != kind.api_version()
    {
        return Err(Status::bad_request(format!(
            "the API version in the data ({av}) does not match the expected API version ({})",
            kind.api_version()
        )));
    }
    Ok(())
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn metadata_mut(obj: &mut Value) -> &mut Map<String, Value> {
    let o = obj.as_object_mut().expect("object checked by parse_body");
    let meta = o
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !meta.is_object() {
        *meta = Value::Object(Map::new());
    }
    meta.as_object_mut().expect("just made an object")
}

fn create_object(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    mut obj: Value,
) -> Result<Value, Status> {
    if !obj.is_object() {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {})",
            kind.kind()
        )));
    }
    check_type_meta(kind, &obj)?;
    let meta = obj.get("metadata");
    if meta.is_some_and(|m| !m.is_object() && !m.is_null()) {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): metadata must be an object",
            kind.kind()
        )));
    }
    if kind.namespaced()
        && let Some(body_ns) = meta_str(&obj, "namespace").filter(|n| !n.is_empty())
        && Some(body_ns) != ns
    {
        return Err(Status::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
                .into(),
        ));
    }
    let mut store = shared.store();
    let mut name = meta_str(&obj, "name").unwrap_or("").to_string();
    if name.is_empty() {
        let generate = meta_str(&obj, "generateName").unwrap_or("").to_string();
        if generate.is_empty() {
            return Err(Status::invalid_object(
                kind,
                "",
                "metadata.name",
                "Required value: name or generateName is required",
                "FieldValueRequired",
            ));
        }
        // Like the apiserver: five characters from a consonant-and-digit alphabet.
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        let mut n = store.rv.wrapping_mul(2_654_435_761) ^ store.next_uid;
        let mut suffix = String::new();
        for _ in 0..5 {
            suffix.push(ALPHABET[(n % ALPHABET.len() as u64) as usize] as char);
            n /= ALPHABET.len() as u64;
        }
        name = format!("{generate}{suffix}");
    }
    let valid_name = if kind == Kind::Namespace {
        is_dns_label(&name)
    } else {
        is_dns_subdomain(&name)
    };
    if !valid_name {
        return Err(Status::invalid_object(
            kind,
            &name,
            "metadata.name",
            &format!(
                "Invalid value: {name:?}: a lowercase RFC 1123 {} must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                if kind == Kind::Namespace {
                    "label"
                } else {
                    "subdomain"
                }
            ),
            "FieldValueInvalid",
        ));
    }
    if let Some(ns) = ns
        && !store.objects(Kind::Namespace).contains_key(ns)
    {
        return Err(Status::not_found(Kind::Namespace, ns));
    }
    let key = object_key(kind, ns, &name);
    if store.objects(kind).contains_key(&key) {
        return Err(Status::already_exists(kind, &name));
    }
    let uid = store.new_uid();
    {
        let o = obj.as_object_mut().expect("checked above");
        o.insert("kind".into(), kind.kind().into());
        o.insert("apiVersion".into(), kind.api_version().into());
    }
    let meta = metadata_mut(&mut obj);
    meta.insert("name".into(), name.clone().into());
    if let Some(ns) = ns {
        meta.insert("namespace".into(), ns.into());
    } else {
        meta.remove("namespace");
    }
    meta.insert("uid".into(), uid.into());
    meta.insert("creationTimestamp".into(), now_rfc3339().into());
    for system in [
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "selfLink",
        "generation",
    ] {
        meta.remove(system);
    }
    match kind {
        Kind::Namespace => {
            let labels = meta
                .entry("labels")
                .or_insert_with(|| Value::Object(Map::new()));
            if !labels.is_object() {
                *labels = Value::Object(Map::new());
            }
            labels
                .as_object_mut()
                .expect("object")
                .insert("kubernetes.io/metadata.name".into(), name.clone().into());
            let o = obj.as_object_mut().expect("object");
            o.insert("spec".into(), json!({"finalizers": ["kubernetes"]}));
            o.insert("status".into(), json!({"phase": "Active"}));
        }
        Kind::Pod => {
            obj.as_object_mut()
                .expect("object")
                .insert("status".into(), json!({"phase": "Pending"}));
        }
        // Established at once (the apiserver's establishing controller takes a moment).
        Kind::Crd => {
            obj.as_object_mut().expect("object").insert(
                "status".into(),
                json!({"conditions": [
                    {"type": "NamesAccepted", "status": "True"},
                    {"type": "Established", "status": "True"},
                ]}),
            );
        }
        Kind::ConfigMap | Kind::Widget => {}
    }
    let created = store.write_locked(kind, &key, Some(obj));
    let rv = store.rv;
    drop(store);
    // After the lock is released: waiters re-check the store.
    shared.rv_tx.send_replace(rv);
    Ok(created)
}

/// PUT semantics. `status_only` is the `/status` subresource: only `.status` changes.
fn update_object(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    obj: Value,
    status_only: bool,
) -> Result<Value, Status> {
    let mut store = shared.store();
    let updated = update_locked(&mut store, kind, ns, name, obj, status_only)?;
    let rv = store.rv;
    drop(store);
    shared.rv_tx.send_replace(rv);
    Ok(updated)
}

fn update_locked(
    store: &mut Store,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    mut obj: Value,
    status_only: bool,
) -> Result<Value, Status> {
    if !obj.is_object() {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {})",
            kind.kind()
        )));
    }
    check_type_meta(kind, &obj)?;
    let body_name = meta_str(&obj, "name").unwrap_or("");
    if body_name != name {
        return Err(Status::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    if kind.namespaced()
        && let Some(body_ns) = meta_str(&obj, "namespace").filter(|n| !n.is_empty())
        && Some(body_ns) != ns
    {
        return Err(Status::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
                .into(),
        ));
    }
    let key = object_key(kind, ns, name);
    let Some(old) = store.objects(kind).get(&key).cloned() else {
        return Err(Status::not_found(kind, name));
    };
    let old_rv = meta_str(&old, "resourceVersion").unwrap_or("").to_string();
    if let Some(rv) = meta_str(&obj, "resourceVersion").filter(|rv| !rv.is_empty())
        && rv != old_rv
    {
        return Err(Status::conflict(
            kind,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        ));
    }
    let mut new = if status_only {
        let mut new = old.clone();
        let status = obj.get("status").cloned().unwrap_or(Value::Null);
        new.as_object_mut()
            .expect("stored objects are objects")
            .insert("status".into(), status);
        new
    } else {
        {
            let o = obj.as_object_mut().expect("checked above");
            o.insert("kind".into(), kind.kind().into());
            o.insert("apiVersion".into(), kind.api_version().into());
            // The main resource cannot change status (pod and namespace strategies keep it).
            if kind.has_status() {
                match old.get("status") {
                    Some(s) => o.insert("status".into(), s.clone()),
                    None => o.remove("status"),
                };
            }
        }
        let meta = metadata_mut(&mut obj);
        for system in ["uid", "creationTimestamp", "deletionTimestamp", "namespace"] {
            match old.get("metadata").and_then(|m| m.get(system)) {
                Some(v) => meta.insert(system.into(), v.clone()),
                None => meta.remove(system),
            };
        }
        obj
    };
    set_rv(&mut new, old_rv.parse().unwrap_or(0));
    if new == old {
        // The apiserver skips writes that change nothing: same resourceVersion, no event.
        return Ok(old);
    }
    Ok(store.write_locked(kind, &key, Some(new)))
}

fn patch(
    shared: &Shared,
    req: &ReadRequest,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    status_only: bool,
) -> Result<Response<Body>, Status> {
    let ct = req
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if ct != "application/merge-patch+json" && ct != "application/strategic-merge-patch+json" {
        return Err(Status::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (this fake does not implement {ct:?})"
            ),
        ));
    }
    let patch: Value = serde_json::from_slice(&req.body)
        .map_err(|e| Status::bad_request(format!("error decoding patch: {e}")))?;
    if !patch.is_object() {
        return Err(Status::bad_request(
            "error decoding patch: a merge patch must be a JSON object".into(),
        ));
    }
    let mut store = shared.store();
    let key = object_key(kind, ns, name);
    let Some(old) = store.objects(kind).get(&key).cloned() else {
        return Err(Status::not_found(kind, name));
    };
    let mut merged = old.clone();
    merge_patch(&mut merged, &patch);
    if !merged.is_object() {
        return Err(Status::bad_request(
            "the patch produced something that is not an object".into(),
        ));
    }
    // A resourceVersion in the patch is a precondition; without one the patch always applies.
    if meta_str(&patch, "resourceVersion").is_none() {
        let old_rv = meta_str(&old, "resourceVersion").unwrap_or("").to_string();
        if let Some(meta) = merged.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), old_rv.into());
        }
    }
    if meta_str(&merged, "name") != Some(name) {
        return Err(Status::bad_request(format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            meta_str(&merged, "name").unwrap_or("")
        )));
    }
    let updated = update_locked(&mut store, kind, ns, name, merged, status_only)?;
    let rv = store.rv;
    drop(store);
    shared.rv_tx.send_replace(rv);
    Ok(json_response(StatusCode::OK, to_json(&updated)))
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(patch_obj) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let t = target.as_object_mut().expect("made an object");
    for (k, v) in patch_obj {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// DELETE semantics; returns the response body the apiserver gives for `kind`.
fn delete_object(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    options: &Value,
) -> Result<Value, Status> {
    let mut store = shared.store();
    let key = object_key(kind, ns, name);
    let Some(old) = store.objects(kind).get(&key).cloned() else {
        return Err(Status::not_found(kind, name));
    };
    let pre = options.get("preconditions");
    let uid = meta_str(&old, "uid").unwrap_or("").to_string();
    let rv = meta_str(&old, "resourceVersion").unwrap_or("").to_string();
    if let Some(want) = pre.and_then(|p| p.get("uid")).and_then(Value::as_str)
        && want != uid
    {
        return Err(Status::conflict(
            kind,
            name,
            &format!("Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"),
        ));
    }
    if let Some(want) = pre
        .and_then(|p| p.get("resourceVersion"))
        .and_then(Value::as_str)
        && want != rv
    {
        return Err(Status::conflict(
            kind,
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in object meta: {rv}"
            ),
        ));
    }
    let out = match kind {
        Kind::ConfigMap | Kind::Widget => {
            store.write_locked(kind, &key, None);
            let details = JsonObj::new()
                .str("name", name)
                .str("kind", kind.resource())
                .str("uid", &uid)
                .finish();
            let status = JsonObj::new()
                .str("kind", "Status")
                .str("apiVersion", "v1")
                .raw("metadata", "{}")
                .str("status", "Success")
                .raw("details", &details)
                .finish();
            serde_json::from_str(&status).unwrap_or(Value::Null)
        }
        Kind::Pod => store.write_locked(kind, &key, None),
        Kind::Crd => {
            // The apiserver's CRD finalizer deletes every object first; then the resource
            // stops being served and its watches end.
            if name == WIDGETS_CRD {
                let keys: Vec<String> = store.objects(Kind::Widget).keys().cloned().collect();
                for k in keys {
                    store.write_locked(Kind::Widget, &k, None);
                }
            }
            let out = store.write_locked(kind, &key, None);
            if name == WIDGETS_CRD {
                store.watchers.retain(|w| {
                    if w.filter.kind == Kind::Widget {
                        let _ = w.tx.send(WatchMsg::End);
                        false
                    } else {
                        true
                    }
                });
            }
            out
        }
        Kind::Namespace => {
            // The apiserver answers with the Terminating namespace; its namespace controller
            // then empties it and removes it. Here that happens at once.
            let mut terminating = old.clone();
            if let Some(meta) = terminating
                .get_mut("metadata")
                .and_then(Value::as_object_mut)
            {
                meta.insert("deletionTimestamp".into(), now_rfc3339().into());
            }
            if let Some(o) = terminating.as_object_mut() {
                o.insert("status".into(), json!({"phase": "Terminating"}));
            }
            let out = store.write_locked(kind, &key, Some(terminating));
            let prefix = format!("{name}/");
            for content_kind in [Kind::ConfigMap, Kind::Pod] {
                let keys: Vec<String> = store
                    .objects(content_kind)
                    .keys()
                    .filter(|k| k.starts_with(&prefix))
                    .cloned()
                    .collect();
                for k in keys {
                    store.write_locked(content_kind, &k, None);
                }
            }
            store.write_locked(kind, &key, None);
            out
        }
    };
    let rv = store.rv;
    drop(store);
    shared.rv_tx.send_replace(rv);
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Upgrades (exec / attach / portforward)
// ---------------------------------------------------------------------------------------------

fn upgrade(
    shared: &Shared,
    req: &ReadRequest,
    ns: Option<&str>,
    name: &str,
    on_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response<Body>, Status> {
    if req.method != Method::GET && req.method != Method::POST {
        return Err(Status::method_not_allowed());
    }
    if !shared
        .store()
        .objects(Kind::Pod)
        .contains_key(&object_key(Kind::Pod, ns, name))
    {
        return Err(Status::not_found(Kind::Pod, name));
    }
    let Some(on_upgrade) = on_upgrade else {
        return Err(Status::bad_request("Upgrade request required".into()));
    };
    let mut resp = Response::new(empty_body());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONNECTION,
        HeaderValue::from_static("Upgrade"),
    );
    if let Some(proto) = req.headers.get(UPGRADE) {
        h.insert(UPGRADE, proto.clone());
    }
    // SPDY: the client offers protocol versions, the server picks one (the first).
    if let Some(v) = req.headers.get("x-stream-protocol-version") {
        h.insert("x-stream-protocol-version", first_token(v));
    }
    // WebSocket: the handshake answer (RFC 6455 section 4.2.2) and the chosen subprotocol.
    if let Some(key) = req.headers.get("sec-websocket-key") {
        let mut input = key.as_bytes().to_vec();
        input.extend_from_slice(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
        let accept = base64::engine::general_purpose::STANDARD.encode(sha1(&input));
        if let Ok(v) = HeaderValue::from_str(&accept) {
            h.insert("sec-websocket-accept", v);
        }
    }
    if let Some(v) = req.headers.get("sec-websocket-protocol") {
        h.insert("sec-websocket-protocol", first_token(v));
    }
    tokio::spawn(async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let io = TokioIo::new(upgraded);
        let (mut r, mut w) = tokio::io::split(io);
        let _ = tokio::io::copy(&mut r, &mut w).await;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut w).await;
    });
    Ok(resp)
}

fn first_token(v: &HeaderValue) -> HeaderValue {
    v.to_str()
        .ok()
        .and_then(|s| s.split(',').next())
        .and_then(|s| HeaderValue::from_str(s.trim()).ok())
        .unwrap_or_else(|| v.clone())
}

// ---------------------------------------------------------------------------------------------
// Selectors
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
enum LabelReq {
    Exists(String),
    NotExists(String),
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Gt(String, i64),
    Lt(String, i64),
}

/// A label selector as `labels.Parse` understands it: `=`, `==`, `!=`, `in`, `notin`, `key`,
/// `!key`, `>`, `<`, comma-separated (ANDed).
#[derive(Debug, Default)]
struct LabelSelector {
    reqs: Vec<LabelReq>,
}

#[derive(Debug, PartialEq)]
enum Tok {
    Ident(String),
    Not,
    Eq,
    DoubleEq,
    NotEq,
    Gt,
    Lt,
    Open,
    Close,
    Comma,
}

fn lex_selector(s: &str) -> Vec<Tok> {
    let mut toks = Vec::new();
    let mut chars = s.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            c if c.is_whitespace() => {
                chars.next();
            }
            '!' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    toks.push(Tok::NotEq);
                } else {
                    toks.push(Tok::Not);
                }
            }
            '=' => {
                chars.next();
                if chars.peek() == Some(&'=') {
                    chars.next();
                    toks.push(Tok::DoubleEq);
                } else {
                    toks.push(Tok::Eq);
                }
            }
            '>' => {
                chars.next();
                toks.push(Tok::Gt);
            }
            '<' => {
                chars.next();
                toks.push(Tok::Lt);
            }
            '(' => {
                chars.next();
                toks.push(Tok::Open);
            }
            ')' => {
                chars.next();
                toks.push(Tok::Close);
            }
            ',' => {
                chars.next();
                toks.push(Tok::Comma);
            }
            _ => {
                let mut ident = String::new();
                while let Some(&c) = chars.peek() {
                    if c.is_whitespace() || "!=<>(),".contains(c) {
                        break;
                    }
                    ident.push(c);
                    chars.next();
                }
                toks.push(Tok::Ident(ident));
            }
        }
    }
    toks
}

impl LabelSelector {
    fn parse(s: &str) -> Result<LabelSelector, Status> {
        let err = |m: &str| {
            Status::bad_request(format!(
                "unable to parse requirement: {m} (in label selector {s:?})"
            ))
        };
        let toks = lex_selector(s);
        let mut reqs = Vec::new();
        let mut i = 0;
        let ident = |i: usize| match toks.get(i) {
            Some(Tok::Ident(s)) => Some(s.clone()),
            _ => None,
        };
        while i < toks.len() {
            let req = if toks[i] == Tok::Not {
                let key = ident(i + 1).ok_or_else(|| err("expected a key after '!'"))?;
                i += 2;
                LabelReq::NotExists(key)
            } else {
                let key = ident(i).ok_or_else(|| err("expected a key"))?;
                i += 1;
                match toks.get(i) {
                    None | Some(Tok::Comma) => LabelReq::Exists(key),
                    Some(op @ (Tok::Eq | Tok::DoubleEq | Tok::NotEq)) => {
                        let value = match toks.get(i + 1) {
                            Some(Tok::Ident(v)) => {
                                i += 2;
                                v.clone()
                            }
                            None | Some(Tok::Comma) => {
                                i += 1;
                                String::new()
                            }
                            _ => return Err(err("expected a value")),
                        };
                        if *op == Tok::NotEq {
                            LabelReq::NotEq(key, value)
                        } else {
                            LabelReq::Eq(key, value)
                        }
                    }
                    Some(op @ (Tok::Gt | Tok::Lt)) => {
                        let n = ident(i + 1)
                            .and_then(|v| v.parse::<i64>().ok())
                            .ok_or_else(|| err("for 'Gt', 'Lt' operators, exactly one integer value is required"))?;
                        let gt = *op == Tok::Gt;
                        i += 2;
                        if gt {
                            LabelReq::Gt(key, n)
                        } else {
                            LabelReq::Lt(key, n)
                        }
                    }
                    Some(Tok::Ident(kw)) if kw == "in" || kw == "notin" => {
                        let negate = kw == "notin";
                        i += 1;
                        if toks.get(i) != Some(&Tok::Open) {
                            return Err(err("found '', expected: '('"));
                        }
                        i += 1;
                        let mut values = Vec::new();
                        loop {
                            match toks.get(i) {
                                Some(Tok::Ident(v)) => {
                                    values.push(v.clone());
                                    i += 1;
                                }
                                Some(Tok::Comma) => i += 1,
                                Some(Tok::Close) => {
                                    i += 1;
                                    break;
                                }
                                _ => return Err(err("expected ')'")),
                            }
                        }
                        if values.is_empty() {
                            return Err(err(
                                "for 'in', 'notin' operators, values set can't be empty",
                            ));
                        }
                        if negate {
                            LabelReq::NotIn(key, values)
                        } else {
                            LabelReq::In(key, values)
                        }
                    }
                    _ => return Err(err("expected an operator")),
                }
            };
            reqs.push(req);
            match toks.get(i) {
                None => {}
                Some(Tok::Comma) => {
                    i += 1;
                    if i == toks.len() {
                        return Err(err("expected a requirement after ','"));
                    }
                }
                _ => return Err(err("expected ','")),
            }
        }
        Ok(LabelSelector { reqs })
    }

    fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    fn matches(&self, obj: &Value) -> bool {
        let labels = obj.get("metadata").and_then(|m| m.get("labels"));
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.reqs.iter().all(|r| match r {
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            LabelReq::Gt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            LabelReq::Lt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x < *n),
        })
    }
}

#[derive(Debug)]
struct FieldReq {
    field: String,
    value: String,
    equal: bool,
}

/// A field selector: `field=value`, `field==value`, `field!=value`, comma-separated.
#[derive(Debug, Default)]
struct FieldSelector {
    reqs: Vec<FieldReq>,
}

/// Fields each kind can be selected on, as its `AddFieldLabelConversionFunc` allows.
fn supported_fields(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::ConfigMap => &["metadata.name", "metadata.namespace"],
        Kind::Namespace => &["metadata.name", "status.phase"],
        Kind::Crd => &["metadata.name"],
        Kind::Widget => &["metadata.name", "metadata.namespace"],
        Kind::Pod => &[
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
    }
}

/// The field labels the widgets CRD declares for v1 (`selectableFields`, without the leading
/// dot), as the apiserver's CR field label conversion accepts them; none for other kinds.
fn selectable_fields(shared: &Shared, kind: Kind) -> Vec<String> {
    if kind != Kind::Widget {
        return Vec::new();
    }
    let store = shared.store();
    let Some(crd) = store.objects(Kind::Crd).get(WIDGETS_CRD) else {
        return Vec::new();
    };
    let versions = crd.pointer("/spec/versions").and_then(Value::as_array);
    versions
        .into_iter()
        .flatten()
        .filter(|v| v["name"] == "v1")
        .flat_map(|v| {
            v["selectableFields"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|f| Some(f["jsonPath"].as_str()?.trim_start_matches('.').to_string()))
        .collect()
}

impl FieldSelector {
    fn parse(s: &str, kind: Kind, selectable: &[String]) -> Result<FieldSelector, Status> {
        let mut reqs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (field, value, equal) = if let Some((f, v)) = part.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, v, true)
            } else {
                return Err(Status::bad_request(format!(
                    "invalid selector: '{s}'; can't understand '{part}'"
                )));
            };
            let field = field.trim();
            if !supported_fields(kind).contains(&field) && !selectable.iter().any(|f| f == field) {
                return Err(Status::bad_request(match kind {
                    Kind::ConfigMap => format!(
                        "{field:?} is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
                    ),
                    _ => format!("field label not supported: {field}"),
                }));
            }
            reqs.push(FieldReq {
                field: field.to_string(),
                value: value.trim().to_string(),
                equal,
            });
        }
        Ok(FieldSelector { reqs })
    }

    fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    fn matches(&self, obj: &Value) -> bool {
        self.reqs.iter().all(|r| {
            let actual = field_value(obj, &r.field);
            (actual == r.value) == r.equal
        })
    }
}

fn field_value(obj: &Value, field: &str) -> String {
    if field == "spec.hostNetwork" {
        let on = obj
            .pointer("/spec/hostNetwork")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        return on.to_string();
    }
    // As the CR strategy formats a selectable field (`fmt.Sprint`): strings as they are,
    // integers in decimal, booleans as true/false, absent or null as "".
    let pointer = format!("/{}", field.replace('.', "/"));
    match obj.pointer(&pointer) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// Continue tokens (k8s.io/apiserver/pkg/storage/continue.go)
// ---------------------------------------------------------------------------------------------

/// base64url (no padding) of `{"v":"meta.k8s.io/v1","rv":N,"start":"<key>"}`, the key relative
/// to the list's key prefix.
fn encode_continue(start: &str, rv: i64) -> String {
    let json = JsonObj::new()
        .str("v", "meta.k8s.io/v1")
        .raw("rv", &rv.to_string())
        .str("start", start)
        .finish();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(json)
}

/// Returns (absolute start key, resourceVersion; -1 means "latest").
fn decode_continue(token: &str, prefix: &str) -> Result<(String, i64), String> {
    const INVALID: &str = "continue key is not valid";
    let data = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.trim_end_matches('='))
        .map_err(|e| format!("{INVALID}: {e}"))?;
    let v: Value = serde_json::from_slice(&data).map_err(|e| format!("{INVALID}: {e}"))?;
    let version = v.get("v").and_then(Value::as_str).unwrap_or("");
    if version != "meta.k8s.io/v1" {
        return Err(format!(
            "{INVALID}: server does not recognize this encoded version {version}"
        ));
    }
    let rv = v.get("rv").and_then(Value::as_i64).unwrap_or(0);
    if rv == 0 {
        return Err(format!(
            "{INVALID}: incorrect encoded start resourceVersion (version meta.k8s.io/v1)"
        ));
    }
    let start = v.get("start").and_then(Value::as_str).unwrap_or("");
    if start.is_empty() {
        return Err(format!(
            "{INVALID}: encoded start key empty (version meta.k8s.io/v1)"
        ));
    }
    // The apiserver's path.Clean check: no empty, "." or ".." segments, no leading slash games.
    let rel = start.strip_prefix('/').unwrap_or(start);
    if rel
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err(format!("{INVALID}: {start}"));
    }
    Ok((format!("{prefix}{rel}"), rv))
}

// ---------------------------------------------------------------------------------------------
// Status
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Cause {
    reason: String,
    message: String,
    field: Option<String>,
}

#[derive(Debug, Default)]
struct Details {
    name: Option<String>,
    group: Option<String>,
    kind: Option<String>,
    causes: Vec<Cause>,
    retry_after: Option<u32>,
}

/// A `metav1.Status` failure.
#[derive(Debug)]
struct Status {
    code: u16,
    reason: &'static str,
    message: String,
    /// Boxed to keep `Result<_, Status>` small.
    details: Option<Box<Details>>,
    /// `metadata.continue` of an expired continue (the inconsistent-continuation token).
    cont: Option<String>,
}

impl Status {
    fn new(code: u16, reason: &'static str, message: String) -> Status {
        Status {
            code,
            reason,
            message,
            details: None,
            cont: None,
        }
    }

    fn with_details(mut self, d: Details) -> Status {
        self.details = Some(Box::new(d));
        self
    }

    fn named(kind: Kind, name: &str) -> Details {
        Details {
            name: Some(name.to_string()),
            kind: Some(kind.resource().to_string()),
            ..Details::default()
        }
    }

    fn not_found(kind: Kind, name: &str) -> Status {
        Status::new(
            404,
            "NotFound",
            format!("{} {name:?} not found", kind.resource()),
        )
        .with_details(Status::named(kind, name))
    }

    fn not_found_path() -> Status {
        Status::new(
            404,
            "NotFound",
            "the server could not find the requested resource".into(),
        )
        .with_details(Details::default())
    }

    fn already_exists(kind: Kind, name: &str) -> Status {
        Status::new(
            409,
            "AlreadyExists",
            format!("{} {name:?} already exists", kind.resource()),
        )
        .with_details(Status::named(kind, name))
    }

    fn conflict(kind: Kind, name: &str, why: &str) -> Status {
        Status::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {name:?}: {why}",
                kind.resource()
            ),
        )
        .with_details(Status::named(kind, name))
    }

    fn bad_request(message: String) -> Status {
        Status::new(400, "BadRequest", message)
    }

    fn method_not_allowed() -> Status {
        Status::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource".into(),
        )
        .with_details(Details::default())
    }

    fn expired(message: &str) -> Status {
        Status::new(410, "Expired", message.to_string())
    }

    fn continue_expired(new_token: &str) -> Status {
        let mut s = Status::expired(
            "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
        );
        s.cont = Some(new_token.to_string());
        s
    }

    fn too_large_rv(wanted: u64, current: u64) -> Status {
        Status::new(
            504,
            "Timeout",
            format!("Timeout: Too large resource version: {wanted}, current: {current}"),
        )
        .with_details(Details {
            causes: vec![Cause {
                reason: "ResourceVersionTooLarge".into(),
                message: "Too large resource version".into(),
                field: None,
            }],
            retry_after: Some(1),
            ..Details::default()
        })
    }

    fn invalid_object(kind: Kind, name: &str, field: &str, detail: &str, cause: &str) -> Status {
        Status::new(
            422,
            "Invalid",
            format!("{} {name:?} is invalid: {field}: {detail}", kind.kind()),
        )
        .with_details(Details {
            name: Some(name.to_string()),
            kind: Some(kind.kind().to_string()),
            causes: vec![Cause {
                reason: cause.to_string(),
                message: detail.to_string(),
                field: Some(field.to_string()),
            }],
            ..Details::default()
        })
    }

    fn invalid_list_options(errs: &[(&str, String, &str)]) -> Status {
        let joined: Vec<String> = errs.iter().map(|(f, m, _)| format!("{f}: {m}")).collect();
        let message = if joined.len() == 1 {
            joined[0].clone()
        } else {
            format!("[{}]", joined.join(", "))
        };
        Status::new(
            422,
            "Invalid",
            format!("ListOptions.meta.k8s.io \"\" is invalid: {message}"),
        )
        .with_details(Details {
            group: Some("meta.k8s.io".into()),
            kind: Some("ListOptions".into()),
            causes: errs
                .iter()
                .map(|(f, m, r)| Cause {
                    reason: r.to_string(),
                    message: m.clone(),
                    field: Some(f.to_string()),
                })
                .collect(),
            ..Details::default()
        })
    }

    /// The error [`Faults::fail_next`] injects for `code`.
    fn injected(code: u16) -> Status {
        const WHY: &str = "injected fault";
        match code {
            400 => Status::bad_request(WHY.into()),
            401 => Status::new(401, "Unauthorized", "Unauthorized".into()),
            403 => Status::new(403, "Forbidden", format!("forbidden: {WHY}")),
            404 => Status::not_found_path(),
            405 => Status::method_not_allowed(),
            409 => Status::new(409, "Conflict", format!("conflict: {WHY}")),
            410 => Status::expired("The resourceVersion for the provided list is too old."),
            422 => Status::new(422, "Invalid", format!("invalid: {WHY}")),
            429 => Status::new(
                429,
                "TooManyRequests",
                "Too many requests, please try again later.".into(),
            )
            .with_details(Details {
                retry_after: Some(1),
                ..Details::default()
            }),
            500 => Status::new(
                500,
                "InternalError",
                format!("Internal error occurred: {WHY}"),
            )
            .with_details(Details {
                causes: vec![Cause {
                    message: WHY.into(),
                    ..Cause::default()
                }],
                ..Details::default()
            }),
            503 => Status::new(
                503,
                "ServiceUnavailable",
                format!("service unavailable: {WHY}"),
            ),
            504 => Status::new(504, "Timeout", format!("Timeout: {WHY}")),
            other => Status::new(other, "", format!("{WHY} (code {other})")),
        }
    }

    fn to_json(&self) -> String {
        let mut meta = JsonObj::new();
        if let Some(c) = &self.cont {
            meta = meta.str("continue", c);
        }
        let mut o = JsonObj::new()
            .str("kind", "Status")
            .str("apiVersion", "v1")
            .raw("metadata", &meta.finish())
            .str("status", "Failure")
            .str("message", &self.message);
        if !self.reason.is_empty() {
            o = o.str("reason", self.reason);
        }
        if let Some(d) = &self.details {
            let mut dj = JsonObj::new();
            if let Some(n) = &d.name {
                dj = dj.str("name", n);
            }
            if let Some(g) = &d.group {
                dj = dj.str("group", g);
            }
            if let Some(k) = &d.kind {
                dj = dj.str("kind", k);
            }
            if !d.causes.is_empty() {
                let causes: Vec<String> = d
                    .causes
                    .iter()
                    .map(|c| {
                        let mut cj = JsonObj::new();
                        if !c.reason.is_empty() {
                            cj = cj.str("reason", &c.reason);
                        }
                        cj = cj.str("message", &c.message);
                        if let Some(f) = &c.field {
                            cj = cj.str("field", f);
                        }
                        cj.finish()
                    })
                    .collect();
                dj = dj.raw("causes", &format!("[{}]", causes.join(",")));
            }
            if let Some(r) = d.retry_after {
                dj = dj.raw("retryAfterSeconds", &r.to_string());
            }
            o = o.raw("details", &dj.finish());
        }
        o.raw("code", &self.code.to_string()).finish()
    }

    fn into_response(self) -> Response<Body> {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = json_response(code, self.to_json());
        if let Some(r) = self.details.as_ref().and_then(|d| d.retry_after) {
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(r));
        }
        resp
    }
}

// ---------------------------------------------------------------------------------------------
// Discovery
// ---------------------------------------------------------------------------------------------

fn version_json() -> String {
    JsonObj::new()
        .str("major", "1")
        .str("minor", "36")
        .str("emulationMajor", "1")
        .str("emulationMinor", "36")
        .str("minCompatibilityMajor", "1")
        .str("minCompatibilityMinor", "35")
        .str("gitVersion", GIT_VERSION)
        .str("gitCommit", "0000000000000000000000000000000000000000")
        .str("gitTreeState", "clean")
        .str("buildDate", "2026-01-01T00:00:00Z")
        .str("goVersion", "go1.25.0")
        .str("compiler", "gc")
        .str("platform", "linux/amd64")
        .finish()
}

fn api_versions_json(addr: SocketAddr) -> String {
    format!(
        r#"{{"kind":"APIVersions","versions":["v1"],"serverAddressByClientCIDRs":[{{"clientCIDR":"0.0.0.0/0","serverAddress":"{addr}"}}]}}"#
    )
}

/// An `APIGroup` with the one version v1.
fn api_group_json(group: &str) -> String {
    format!(
        r#"{{"kind":"APIGroup","apiVersion":"v1","name":"{group}","versions":[{{"groupVersion":"{group}/v1","version":"v1"}}],"preferredVersion":{{"groupVersion":"{group}/v1","version":"v1"}}}}"#
    )
}

/// The `APIResourceList` of a one-resource group version (CRDs, widgets).
fn group_resource_list_json(kind: Kind) -> String {
    let mut resources = vec![json!({
        "name": kind.resource(),
        "singularName": kind.kind().to_lowercase(),
        "namespaced": kind.namespaced(),
        "kind": kind.kind(),
        "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
    })];
    if kind.has_status() {
        resources.push(json!({
            "name": format!("{}/status", kind.resource()),
            "singularName": "",
            "namespaced": kind.namespaced(),
            "kind": kind.kind(),
            "verbs": ["get", "patch", "update"],
        }));
    }
    JsonObj::new()
        .str("kind", "APIResourceList")
        .str("groupVersion", kind.api_version())
        .raw("resources", &to_json(&Value::Array(resources)))
        .finish()
}

/// Whether the widgets CRD exists (its resource is served).
fn widgets_served(shared: &Shared) -> bool {
    shared.store().objects(Kind::Crd).contains_key(WIDGETS_CRD)
}

fn api_resource_list_json() -> String {
    let mut resources = Vec::new();
    for kind in Kind::CORE {
        let (short, singular) = match kind {
            Kind::Namespace => ("ns", "namespace"),
            Kind::ConfigMap => ("cm", "configmap"),
            _ => ("po", "pod"),
        };
        let mut r = json!({
            "name": kind.resource(),
            "singularName": singular,
            "namespaced": kind.namespaced(),
            "kind": kind.kind(),
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            "shortNames": [short],
        });
        if kind == Kind::Pod {
            r["categories"] = json!(["all"]);
        }
        resources.push(r);
        if kind.has_status() {
            resources.push(json!({
                "name": format!("{}/status", kind.resource()),
                "singularName": "",
                "namespaced": kind.namespaced(),
                "kind": kind.kind(),
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    for (sub, k) in [
        ("attach", "PodAttachOptions"),
        ("exec", "PodExecOptions"),
        ("portforward", "PodPortForwardOptions"),
    ] {
        resources.push(json!({
            "name": format!("pods/{sub}"),
            "singularName": "",
            "namespaced": true,
            "kind": k,
            "verbs": ["create", "get"],
        }));
    }
    resources.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    JsonObj::new()
        .str("kind", "APIResourceList")
        .str("groupVersion", "v1")
        .raw("resources", &to_json(&Value::Array(resources)))
        .finish()
}

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

/// Builds a JSON object with fields in the given order (serde_json's `Map` would sort them; the
/// apiserver writes `kind`, `apiVersion`, `metadata` first).
struct JsonObj(String);

impl JsonObj {
    fn new() -> JsonObj {
        JsonObj(String::from("{"))
    }

    fn raw(mut self, key: &str, json: &str) -> JsonObj {
        if self.0.len() > 1 {
            self.0.push(',');
        }
        let _ = write!(self.0, "{}:{json}", to_json(&Value::from(key)));
        self
    }

    fn str(self, key: &str, value: &str) -> JsonObj {
        let v = to_json(&Value::from(value));
        self.raw(key, &v)
    }

    fn finish(mut self) -> String {
        self.0.push('}');
        self.0
    }
}

fn to_json(v: &Value) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".into())
}

fn add_common_headers(h: &mut HeaderMap) {
    h.insert(
        http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
}

fn full_body(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

fn empty_body() -> Body {
    full_body(Bytes::new())
}

fn json_response(code: StatusCode, body: String) -> Response<Body> {
    let mut resp = Response::new(full_body(body));
    *resp.status_mut() = code;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    add_common_headers(resp.headers_mut());
    resp
}

fn text_response(code: StatusCode, body: &'static str) -> Response<Body> {
    let mut resp = Response::new(full_body(body));
    *resp.status_mut() = code;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp.headers_mut().insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    resp
}

/// Decoded query parameters, in order (`+` is a space, as Go's `url.ParseQuery` has it).
#[derive(Debug, Default)]
struct Query(Vec<(String, String)>);

impl Query {
    fn parse(raw: &str) -> Query {
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(&s.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned()
        };
        Query(
            raw.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| match p.split_once('=') {
                    Some((k, v)) => (decode(k), decode(v)),
                    None => (decode(p), String::new()),
                })
                .collect(),
        )
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn flag(&self, key: &str) -> bool {
        self.get(key).is_some_and(parse_bool)
    }
}

/// Go's `strconv.ParseBool` truths; anything else is false.
fn parse_bool(s: &str) -> bool {
    matches!(s, "1" | "t" | "T" | "true" | "TRUE" | "True")
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// Now as RFC 3339 in UTC with second precision, as `metav1.Time` serializes.
fn now_rfc3339() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil-from-days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// SHA-1, only for the WebSocket handshake's `Sec-WebSocket-Accept` (RFC 6455 requires it).
fn sha1(data: &[u8]) -> [u8; 20] {
    use sha1::Digest;
    sha1::Sha1::digest(data).into()
}
