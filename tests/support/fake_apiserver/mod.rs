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
//! - this file: [`FakeApiServer`] (lifecycle, request log, direct store helpers) and [`Faults`]
//!   (fault switches: fail next requests, delays, refusing connections, ending or expiring
//!   watches, denying callers, the `/metrics` text);
//! - `kind`: the kinds served and their object keys; `store`: objects per kind, event history
//!   for watch resume and Exact lists, open watchers;
//! - request handling: `server` (connections, routing), `authz` (deny list, access and token
//!   reviews), `reads` (GET, LIST), `watch`, `writes`, `upgrade` (exec / attach / portforward),
//!   `discovery`;
//! - `selectors`, `continue_token`, `status` (`Status` construction), `util` (JSON bodies,
//!   query parsing, names, timestamps, the WebSocket accept key).
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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
    /// `Faults::initializing_watch_cache`: watches answer 429.
    watches_429: AtomicBool,
    delay: Mutex<Duration>,
    refuse: AtomicBool,
    /// The period of bookmarks (see [`Faults::set_bookmark_interval`]); open watches follow
    /// its changes at once.
    bookmark_interval: tokio::sync::watch::Sender<Duration>,
    /// Tokens and user names that are not authorized for anything (see [`Faults::deny`]).
    deny: Mutex<HashSet<String>>,
    /// `Faults::deny_resources_of`.
    deny_resources: Mutex<HashSet<String>>,
    impersonators: Mutex<HashSet<String>>,
    only_in: Mutex<std::collections::HashMap<String, HashSet<String>>>,
    /// Extra delay of access and token reviews only (see [`Faults::set_review_delay`]).
    review_delay: Mutex<Duration>,
    /// Access and token reviews still to answer 500 (`usize::MAX`: all of them; see
    /// [`Faults::fail_reviews`]).
    fail_reviews: AtomicUsize,
    /// While true, access and token reviews wait unanswered (see [`Faults::hold_reviews`]).
    reviews_held: tokio::sync::watch::Sender<bool>,
    /// While true, requests are accepted and never answered (see [`Faults::set_freeze`]).
    frozen: tokio::sync::watch::Sender<bool>,
    /// Requests to come until the one that freezes the fake on arrival, counting it (see
    /// [`Faults::freeze_at`]).
    freeze_at: Mutex<Option<usize>>,
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

    /// See [`Faults::set_freeze`].
    fn freeze(&self, on: bool) {
        self.store().hold_events(on);
        self.frozen.send_replace(on);
    }

    /// Counts a request's arrival toward [`Faults::freeze_at`], freezing at the chosen one.
    fn arrived(&self) {
        let mut at = lock(&self.freeze_at);
        match *at {
            Some(n) if n <= 1 => {
                *at = None;
                self.freeze(true);
            }
            Some(n) => *at = Some(n - 1),
            None => {}
        }
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
            watches_429: AtomicBool::new(false),
            delay: Mutex::new(Duration::ZERO),
            refuse: AtomicBool::new(false),
            bookmark_interval: tokio::sync::watch::channel(DEFAULT_BOOKMARK_INTERVAL).0,
            deny: Mutex::new(HashSet::new()),
            deny_resources: Mutex::new(HashSet::new()),
            impersonators: Mutex::new(HashSet::new()),
            only_in: Mutex::new(std::collections::HashMap::new()),
            review_delay: Mutex::new(Duration::ZERO),
            fail_reviews: AtomicUsize::new(0),
            reviews_held: tokio::sync::watch::channel(false).0,
            frozen: tokio::sync::watch::channel(false).0,
            freeze_at: Mutex::new(None),
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

    /// Watches from a resourceVersion below `rv` get 410 Expired from now on, while Exact
    /// lists and continue tokens there keep working until [`FakeApiServer::compact`]: like
    /// kube-apiserver, whose watch cache keeps a window of events (about 75 s or more)
    /// while etcd keeps every revision until compaction.
    pub fn set_watch_window_start(&self, rv: u64) {
        let mut s = self.shared.store();
        s.watch_floor = s.watch_floor.max(rv);
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
    /// Holds every watch event from now on (watchers lag behind the store) until
    /// [`Faults::release_watch_events`] delivers them in order.
    pub fn hold_watch_events(&self) {
        self.shared.store().hold_events(true);
    }

    pub fn release_watch_events(&self) {
        self.shared.store().hold_events(false);
    }

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

    /// While on, every watch request answers 429 TooManyRequests with `Retry-After: 1`
    /// (lists, gets and writes are served): kube-apiserver just restarted, whose watch cache
    /// of the resource is still initializing (`ResilientWatchCacheInitialization`).
    pub fn initializing_watch_cache(&self, on: bool) {
        self.shared.watches_429.store(on, Ordering::SeqCst);
    }

    /// Delays every response (including injected failures and watch headers) by `d`.
    pub fn set_delay(&self, d: Duration) {
        *lock(&self.shared.delay) = d;
    }

    /// While on, the fake is as a kube-apiserver stopped with SIGSTOP: connections are
    /// accepted (the kernel still completes the handshake) and requests arrive, but nothing is
    /// answered and open watches deliver nothing; off, the waiting requests are answered and
    /// the held watch events delivered, in order.
    pub fn set_freeze(&self, on: bool) {
        self.shared.freeze(on);
    }

    /// The `n`-th request from now on (counting from 1) freezes the fake on its arrival, as
    /// [`Faults::set_freeze`]`(true)` would just before it: the requests before it are
    /// answered, it and every later one wait for `set_freeze(false)`. E.g. `freeze_at(2)`
    /// serves a list's first page and holds its second.
    pub fn freeze_at(&self, n: usize) {
        *lock(&self.shared.freeze_at) = Some(n.max(1));
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

    /// While on, the resource requests (reads and writes, not reviews) of callers with this
    /// bearer token get 403 Forbidden: e.g. the proxy's own LIST of a resource, so its cache
    /// stays in its first sync while the proxy's access reviews still work.
    pub fn deny_resources_of(&self, token: &str, on: bool) {
        let mut d = lock(&self.shared.deny_resources);
        if on {
            d.insert(token.to_string());
        } else {
            d.remove(token);
        }
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

    /// While on, SubjectAccessReviews and TokenReviews (nothing else) arrive (they are in
    /// [`FakeApiServer::requests`]) and wait unanswered; off, the waiting ones are answered.
    /// A test holds a review until every request that should share it is known to wait.
    pub fn hold_reviews(&self, on: bool) {
        self.shared.reviews_held.send_replace(on);
    }

    /// While on, SubjectAccessReviews and TokenReviews (nothing else) answer 500.
    pub fn fail_reviews(&self, on: bool) {
        let n = if on { usize::MAX } else { 0 };
        self.shared.fail_reviews.store(n, Ordering::SeqCst);
    }

    /// The next `n` SubjectAccessReviews and TokenReviews (nothing else) answer 500, counted
    /// when they are answered (after [`Faults::hold_reviews`] lets them go).
    pub fn fail_next_reviews(&self, n: usize) {
        self.shared.fail_reviews.store(n, Ordering::SeqCst);
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
        self.expire_watches_where(|_| true);
    }

    /// [`Faults::expire_watches`] for the watches of the caller with bearer token `token` only
    /// (not those it sends for an impersonated user): e.g. the proxy's own upstream watches,
    /// and not the client watches it passes through.
    pub fn expire_watches_of(&self, token: &str) {
        self.expire_watches_where(|w| w.caller.as_deref() == Some(token));
    }

    fn expire_watches_where(&self, pick: impl Fn(&Watcher) -> bool) {
        let mut store = self.shared.store();
        let rv = store.rv;
        let status = Status::expired(&format!("too old resource version: {rv} ({})", rv + 1));
        let obj: Value = serde_json::from_str(&status.to_json()).unwrap_or(Value::Null);
        let (expired, kept): (Vec<_>, Vec<_>) = store.watchers.drain(..).partition(|w| pick(w));
        store.watchers = kept;
        for w in expired {
            let _ = w.tx.send(WatchMsg::Line(event_line("ERROR", &obj)));
            let _ = w.tx.send(WatchMsg::End);
        }
    }

    /// How many of the failures [`Faults::fail_next`] armed are still to be answered.
    pub fn pending_failures(&self) -> usize {
        lock(&self.shared.fail_next).0
    }

    /// Serves `GET /metrics` (Prometheus text) from `text(n)` for the n-th scrape, counting
    /// from 1, so a test can make counters and histograms move between scrapes. Default: an
    /// empty exposition.
    pub fn set_metrics(&self, text: impl Fn(u64) -> String + Send + Sync + 'static) {
        lock(&self.shared.metrics).0 = Arc::new(text);
    }

    /// Period of BOOKMARK events on watches with `allowWatchBookmarks=true` (default 1 s).
    /// Applies at once, also to open watches: each one's next periodic bookmark comes one new
    /// period after its last one (or its start), at once if that has passed. Once this
    /// returns, no watch sends a periodic bookmark the new period does not call for, so a
    /// long period set before a write keeps that write's revision out of bookmarks.
    pub fn set_bookmark_interval(&self, d: Duration) {
        self.shared
            .bookmark_interval
            .send_replace(d.max(Duration::from_millis(1)));
    }
}

mod authz;
mod continue_token;
mod discovery;
mod kind;
mod reads;
mod selectors;
mod server;
mod status;
mod store;
mod upgrade;
mod util;
mod watch;
mod writes;

use authz::*;
use continue_token::*;
use discovery::*;
pub use kind::WIDGETS_CRD;
use kind::*;
use reads::*;
use selectors::*;
use server::*;
use status::*;
pub use store::Write;
use store::*;
use upgrade::*;
use util::*;
use watch::*;
use writes::*;
