//! A watch-history validator: what each downstream watcher saw, checked against the real
//! history of writes, with the properties etcd's robustness tests define for watches
//! (`tests/robustness/validate/watch.go` in etcd-io/etcd, after
//! <https://etcd.io/docs/v3.6/learning/api_guarantees/#watch-apis>), translated to the
//! Kubernetes watch contract:
//!
//! - **ordered**: event resourceVersions strictly increase within a watch (after its initial
//!   state);
//! - **unique**: no event is delivered twice (one key per revision in Kubernetes, so strictly
//!   increasing also covers it);
//! - **atomic**: a revision is never split (trivially true for single-key Kubernetes writes,
//!   checked by the same ordering);
//! - **reliable**: no event of the real history that matches the watcher's scope (with
//!   selector transitions: an object entering the selection is ADDED, one leaving it DELETED)
//!   is missing between where the watch started and the last progress it saw;
//! - **resumable**: a watch from resourceVersion N delivers exactly the matching history after N;
//! - **bookmarkable**: a BOOKMARK never goes backwards and never claims progress past an event
//!   not yet delivered (no later event at or below it, no gap below it);
//! - **served events match the real history**: each delivered object equals the written one;
//! - an initial state (RV unset, "0", `sendInitialEvents`) is exactly the real state at some
//!   resourceVersion S, followed by the history after S; with `sendInitialEvents` S is the
//!   `k8s.io/initial-events-end` bookmark and at least the requested resourceVersion.
//!
//! The driver ([`run_watcher`]) behaves like a client-go watcher: it resumes from its last
//! resourceVersion when a stream ends and starts over (relists) after a 410 ERROR event.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::Connect;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::fake_apiserver::{FakeApiServer, Write};
use super::proxy::EventReader;

/// `namespace/name`.
pub type Key = String;

/// A tiny seeded xorshift64* generator: the workload is reproducible from its seed without a
/// `rand` dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

// ---------------------------------------------------------------------------------------------
// Scopes
// ---------------------------------------------------------------------------------------------

/// One label requirement, evaluated here independently of the proxy's selector code.
#[derive(Debug, Clone)]
pub enum Req {
    Eq(&'static str, &'static str),
    NotEq(&'static str, &'static str),
    In(&'static str, &'static [&'static str]),
    NotIn(&'static str, &'static [&'static str]),
    Exists(&'static str),
    NotExists(&'static str),
}

impl Req {
    fn matches(&self, labels: Option<&serde_json::Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        match self {
            Req::Eq(k, v) => get(k) == Some(*v),
            Req::NotEq(k, v) => get(k) != Some(*v),
            Req::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Req::NotIn(k, vs) => get(k).is_none_or(|x| !vs.contains(&x)),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
        }
    }

    fn render(&self) -> String {
        match self {
            Req::Eq(k, v) => format!("{k}={v}"),
            Req::NotEq(k, v) => format!("{k}!={v}"),
            Req::In(k, vs) => format!("{k} in ({})", vs.join(",")),
            Req::NotIn(k, vs) => format!("{k} notin ({})", vs.join(",")),
            Req::Exists(k) => (*k).to_string(),
            Req::NotExists(k) => format!("!{k}"),
        }
    }
}

/// What a watcher asks for: a namespace (or the cluster) and a label selector.
#[derive(Debug, Clone, Default)]
pub struct Scope {
    pub namespace: Option<String>,
    pub labels: Vec<Req>,
}

impl Scope {
    pub fn matches(&self, obj: &Value) -> bool {
        let meta = obj.get("metadata");
        if let Some(ns) = &self.namespace
            && meta
                .and_then(|m| m.get("namespace"))
                .and_then(Value::as_str)
                != Some(ns)
        {
            return false;
        }
        let labels = meta
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_object);
        self.labels.iter().all(|r| r.matches(labels))
    }

    /// The `labelSelector` query value (not yet percent-encoded).
    pub fn label_selector(&self) -> String {
        self.labels
            .iter()
            .map(Req::render)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The collection path of core/v1 `resource` in this scope.
    pub fn path(&self, resource: &str) -> String {
        match &self.namespace {
            Some(ns) => format!("/api/v1/namespaces/{ns}/{resource}"),
            None => format!("/api/v1/{resource}"),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "ns={} labels={:?}",
            self.namespace.as_deref().unwrap_or("*"),
            self.label_selector()
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Ground truth
// ---------------------------------------------------------------------------------------------

/// One real write.
#[derive(Debug, Clone)]
pub struct TruthEvent {
    pub rv: u64,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub typ: &'static str,
    pub key: Key,
    /// After the write; for a delete the last state at the delete's resourceVersion.
    pub object: Value,
}

/// The real history of one resource: a base state and every write after it.
#[derive(Debug, Clone, Default)]
pub struct Truth {
    /// The latest resourceVersion of the whole store (other resources share the counter):
    /// no bookmark may claim more.
    pub horizon: u64,
    pub base_rv: u64,
    pub base: BTreeMap<Key, Value>,
    pub events: Vec<TruthEvent>,
    /// Relists the proxy told its watchers as a difference (`(before, after]`, from
    /// `ResourceCache::absorbed_relists`): inside one, a watcher sees the difference between
    /// the states at its ends, not the individual writes.
    pub absorbed: Vec<(u64, u64)>,
}

/// An event as a watcher with some scope must see it.
#[derive(Debug, Clone, PartialEq)]
pub struct Expected {
    pub rv: u64,
    pub typ: &'static str,
    pub key: Key,
    pub object: Value,
}

pub fn key_of(obj: &Value) -> Key {
    let m = obj.get("metadata");
    let s = |f: &str| {
        m.and_then(|m| m.get(f))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string()
    };
    format!("{}/{}", s("namespace"), s("name"))
}

pub fn rv_of(obj: &Value) -> u64 {
    obj.get("metadata")
        .and_then(|m| m.get("resourceVersion"))
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        m.insert("resourceVersion".into(), Value::String(rv.to_string()));
    }
}

/// The object without its type meta (the cache adds it on the way out; it is not history).
fn comparable(obj: &Value) -> Value {
    let mut o = obj.clone();
    if let Some(m) = o.as_object_mut() {
        m.remove("kind");
        m.remove("apiVersion");
    }
    o
}

impl Truth {
    /// From the fake apiserver's journal of one resource (it starts empty at resourceVersion 0).
    pub fn from_fake(writes: &[Write]) -> Truth {
        let mut t = Truth::default();
        for w in writes {
            t.push(w.rv, w.typ, w.object.clone());
        }
        t
    }

    /// Appends a write (in resourceVersion order; older or repeated ones are ignored).
    pub fn push(&mut self, rv: u64, typ: &str, object: Value) {
        if rv <= self.last_rv() {
            return;
        }
        let typ = match typ {
            "ADDED" => "ADDED",
            "MODIFIED" => "MODIFIED",
            _ => "DELETED",
        };
        self.events.push(TruthEvent {
            rv,
            typ,
            key: key_of(&object),
            object,
        });
    }

    pub fn last_rv(&self) -> u64 {
        self.events.last().map_or(self.base_rv, |e| e.rv)
    }

    /// Everything a watcher with `scope` sees, from the base on: (its initial state at the base,
    /// its events with selector transitions, as k8s.io/apiserver's cacher converts them).
    pub fn filtered(&self, scope: &Scope) -> Filtered {
        let mut cur: BTreeMap<Key, Value> = self.base.clone();
        let base: BTreeMap<Key, Value> = self
            .base
            .iter()
            .filter(|(_, o)| scope.matches(o))
            .map(|(k, o)| (k.clone(), o.clone()))
            .collect();
        let mut events = Vec::new();
        for e in &self.events {
            let prev = cur.get(&e.key).cloned();
            let now = e.typ != "DELETED" && scope.matches(&e.object);
            let before = match e.typ {
                "DELETED" => scope.matches(&e.object),
                _ => prev.as_ref().is_some_and(|p| scope.matches(p)),
            };
            let seen = match (before, now) {
                (false, true) => Some(("ADDED", e.object.clone())),
                (true, true) => Some(("MODIFIED", e.object.clone())),
                (true, false) if e.typ == "DELETED" => Some(("DELETED", e.object.clone())),
                (true, false) => {
                    let mut p = prev.clone().unwrap_or(Value::Null);
                    set_rv(&mut p, e.rv);
                    Some(("DELETED", p))
                }
                (false, false) => None,
            };
            if let Some((typ, object)) = seen {
                events.push(Expected {
                    rv: e.rv,
                    typ,
                    key: e.key.clone(),
                    object,
                });
            }
            if e.typ == "DELETED" {
                cur.remove(&e.key);
            } else {
                cur.insert(e.key.clone(), e.object.clone());
            }
        }
        Filtered {
            base_rv: self.base_rv,
            base,
            events,
            absorbed: self.absorbed.clone(),
        }
    }
}

/// The history as one scope sees it.
#[derive(Debug, Clone)]
pub struct Filtered {
    pub base_rv: u64,
    pub base: BTreeMap<Key, Value>,
    pub events: Vec<Expected>,
    pub absorbed: Vec<(u64, u64)>,
}

impl Filtered {
    /// The scope's state at `rv` (>= base_rv).
    pub fn state_at(&self, rv: u64) -> BTreeMap<Key, Value> {
        let mut s = self.base.clone();
        for e in self.events.iter().take_while(|e| e.rv <= rv) {
            if e.typ == "DELETED" {
                s.remove(&e.key);
            } else {
                s.insert(e.key.clone(), e.object.clone());
            }
        }
        s
    }

    /// The events in `(from, to]`.
    pub fn between(&self, from: u64, to: u64) -> &[Expected] {
        let a = self.events.partition_point(|e| e.rv <= from);
        let b = self.events.partition_point(|e| e.rv <= to);
        &self.events[a..b.max(a)]
    }
}

// ---------------------------------------------------------------------------------------------
// What watchers saw
// ---------------------------------------------------------------------------------------------

/// How one watch request started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// resourceVersion unset: the current state (consistent), then changes.
    Unset,
    /// resourceVersion "0": a state of any freshness, then changes.
    Zero,
    /// `sendInitialEvents=true&resourceVersionMatch=NotOlderThan` (with `resourceVersion=N`
    /// when given): the state at >= N, the initial-events-end bookmark, then changes.
    SendInitial(Option<u64>),
    /// resourceVersion N: the changes after N.
    Resume(u64),
}

impl Start {
    fn is_initial(self) -> bool {
        !matches!(self, Start::Resume(_))
    }

    fn query(self) -> String {
        match self {
            Start::Unset => String::new(),
            Start::Zero => "&resourceVersion=0".into(),
            Start::SendInitial(rv) => {
                let mut q = "&sendInitialEvents=true&resourceVersionMatch=NotOlderThan".to_string();
                if let Some(rv) = rv {
                    let _ = write!(q, "&resourceVersion={rv}");
                }
                q
            }
            Start::Resume(rv) => format!("&resourceVersion={rv}"),
        }
    }
}

/// One line of a watch stream.
#[derive(Debug, Clone)]
pub enum Obs {
    Event {
        typ: String,
        rv: u64,
        key: Key,
        object: Value,
    },
    Bookmark {
        rv: u64,
        initial_end: bool,
    },
    Error {
        code: u64,
        message: String,
    },
}

/// How a watch request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum End {
    /// The server ended the stream cleanly.
    Clean,
    /// The body failed (connection lost, reset).
    Broken(String),
    /// The test stopped reading.
    Stopped,
    /// Not a 200 response.
    Http(u16, String),
    /// The request itself failed.
    Request(String),
}

/// One watch request and what came back.
#[derive(Debug, Clone)]
pub struct Session {
    pub start: Start,
    /// The real latest resourceVersion just before the request was sent (for freshness).
    pub truth_rv_at_request: Option<u64>,
    /// The test's fault epoch when the request was sent (410s are legitimate only after a
    /// forced relist).
    pub epoch: u64,
    /// The fault epoch when the session ended (or was recorded, if it never started).
    pub end_epoch: u64,
    pub items: Vec<Obs>,
    pub end: End,
}

/// Everything one watcher saw, and its reconstructed view.
#[derive(Debug, Clone)]
pub struct WatchLog {
    pub id: usize,
    pub scope: Scope,
    pub bookmarks: bool,
    pub sessions: Vec<Session>,
    /// The client's store: key -> object, rebuilt from every event (reset at each initial
    /// start, as a reflector's Replace does).
    pub state: BTreeMap<Key, Value>,
}

impl WatchLog {
    pub fn new(id: usize, scope: Scope, bookmarks: bool) -> WatchLog {
        WatchLog {
            id,
            scope,
            bookmarks,
            sessions: Vec::new(),
            state: BTreeMap::new(),
        }
    }

    /// Whether the view holds exactly these objects and nothing of the scope's history up to
    /// `last` (its last write) can still be on its way to the watcher: its current session
    /// has shown `last` (an event or bookmark at or past it, or a resume from there). A view
    /// can equal the final state before its last events arrive (an object added and deleted
    /// again); a watcher stopped then would end with the add alone. A run ends each scope
    /// with an ADDED ([`write_fences`]) so that every watcher can show `last`.
    pub fn caught_up(&self, want: &BTreeMap<Key, Value>, last: u64) -> bool {
        if !self.converged(want) {
            return false;
        }
        let Some(s) = self.sessions.last() else {
            return true;
        };
        let from = match s.start {
            Start::Resume(rv) => rv,
            _ => 0,
        };
        let seen = s
            .items
            .iter()
            .filter_map(|o| match o {
                Obs::Event { rv, .. } | Obs::Bookmark { rv, .. } => Some(*rv),
                Obs::Error { .. } => None,
            })
            .max()
            .unwrap_or(0)
            .max(from);
        seen >= last
    }

    /// Whether the reconstructed view holds exactly these objects (by resourceVersion).
    pub fn converged(&self, want: &BTreeMap<Key, Value>) -> bool {
        self.state.len() == want.len()
            && self
                .state
                .iter()
                .zip(want)
                .all(|((k1, o1), (k2, o2))| k1 == k2 && rv_of(o1) == rv_of(o2))
    }
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

/// What checking one or many watchers found.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub violations: Vec<String>,
    pub watchers: usize,
    pub sessions: usize,
    /// Events compared with the real history (initial state and changes).
    pub events_checked: usize,
    pub bookmarks: usize,
    pub initial_end_bookmarks: usize,
    pub expired_410: usize,
    /// 410s for resumes from inside an absorbed relist (`Truth::absorbed`).
    pub expired_inside_absorbed: usize,
    pub clean_ends: usize,
    /// Requests that failed (HTTP 429/5xx, or no response) while a fault the run declared
    /// transient (`Rules::transient_epochs`) was on.
    pub transient_errors: usize,
    /// Initial starts whose stream ended before their state was told complete, holding a
    /// correct part of it (the client started over).
    pub partial_initial: usize,
    /// Streams that ended with an error (e.g. a passthrough watch whose upstream broke).
    pub broken: usize,
    /// Consistent (RV unset) starts whose state was older than the real latest
    /// resourceVersion at the time of the request, and by how much at most.
    pub stale_consistent_starts: usize,
    pub max_staleness: u64,
    pub per_watcher_events: Vec<usize>,
}

impl Report {
    pub fn merge(&mut self, o: Report) {
        self.violations.extend(o.violations);
        self.watchers += o.watchers;
        self.sessions += o.sessions;
        self.events_checked += o.events_checked;
        self.bookmarks += o.bookmarks;
        self.initial_end_bookmarks += o.initial_end_bookmarks;
        self.expired_410 += o.expired_410;
        self.expired_inside_absorbed += o.expired_inside_absorbed;
        self.clean_ends += o.clean_ends;
        self.transient_errors += o.transient_errors;
        self.partial_initial += o.partial_initial;
        self.broken += o.broken;
        self.stale_consistent_starts += o.stale_consistent_starts;
        self.max_staleness = self.max_staleness.max(o.max_staleness);
        self.per_watcher_events.extend(o.per_watcher_events);
    }

    pub fn summary(&self) -> String {
        let per = &self.per_watcher_events;
        let (min, max) = (
            per.iter().min().copied().unwrap_or(0),
            per.iter().max().copied().unwrap_or(0),
        );
        format!(
            "watchers={} sessions={} events_checked={} (per watcher min={min} max={max} mean={}) \
             bookmarks={} initial_end_bookmarks={} expired_410={} (inside absorbed relists {}) clean_ends={} \
             transient_errors={} partial_initial={} broken={} stale_consistent_starts={} max_staleness={} violations={}",
            self.watchers,
            self.sessions,
            self.events_checked,
            self.events_checked / self.watchers.max(1),
            self.bookmarks,
            self.initial_end_bookmarks,
            self.expired_410,
            self.expired_inside_absorbed,
            self.clean_ends,
            self.transient_errors,
            self.partial_initial,
            self.broken,
            self.stale_consistent_starts,
            self.max_staleness,
            self.violations.len()
        )
    }
}

/// Options of [`validate`].
#[derive(Debug, Clone, Default)]
pub struct Rules {
    /// Sessions sent at this fault epoch or later may get 410 Expired (the proxy relisted).
    pub expired_from_epoch: Option<u64>,
    /// Treat a consistent start older than the request time as a violation (strict mode),
    /// in the watcher's first session.
    pub strict_consistency: bool,
    /// `(epoch, rv)`: from this fault epoch on, a resume from below `rv` may get 410 Expired
    /// (etcd compacted at `rv`, or a restarted proxy whose history starts at `rv`). A session
    /// counts if it ended at that epoch or later.
    pub expired_below: Vec<(u64, u64)>,
    /// Fault epochs during which requests may fail (the apiserver refusing connections, 5xx
    /// answers, the proxy restarting): a session whose lifetime overlaps one may end with HTTP
    /// 429/5xx or without a response (counted in `Report::transient_errors`); the client
    /// retries, as client-go's reflector does.
    pub transient_epochs: Vec<u64>,
}

impl Rules {
    fn transient(&self, s: &Session) -> bool {
        self.transient_epochs
            .iter()
            .any(|e| (s.epoch..=s.end_epoch).contains(e))
    }
}

/// Checks one watcher's log against the truth, and its final view against `final_state`
/// (the real state filtered by its scope; `None` skips that check).
pub fn validate(truth: &Truth, log: &WatchLog, rules: Rules, check_final: bool) -> Report {
    let f = truth.filtered(&log.scope);
    let mut r = Report {
        watchers: 1,
        ..Report::default()
    };
    let who = format!("watcher {} ({})", log.id, log.scope.describe());
    let mut checked = 0;
    for (i, s) in log.sessions.iter().enumerate() {
        r.sessions += 1;
        let mut v = Vec::new();
        let horizon = truth.horizon.max(truth.last_rv());
        // Strict consistency is asked of a watcher's first session only (the late watchers
        // start while the upstream watch is down, when the proxy must not serve its stale
        // cache); later sessions get the documented bounded-staleness default, counted in
        // `stale_consistent_starts`, until consistent reads from the cache land.
        let rules = Rules {
            strict_consistency: rules.strict_consistency && i == 0,
            ..rules.clone()
        };
        checked += check_session(&f, horizon, s, &rules, &mut r, &mut v);
        for msg in v {
            r.violations
                .push(format!("{who} session {i} ({:?}): {msg}", s.start));
        }
    }
    r.events_checked = checked;
    r.per_watcher_events.push(checked);
    if check_final {
        let want = f.state_at(u64::MAX);
        if !log.converged(&want) {
            let have: Vec<_> = log.state.iter().map(|(k, o)| (k, rv_of(o))).collect();
            let want: Vec<_> = want.iter().map(|(k, o)| (k, rv_of(o))).collect();
            r.violations.push(format!(
                "{who}: final view differs from the real state: have {have:?}, want {want:?}"
            ));
        } else {
            for (k, o) in &log.state {
                if comparable(o) != comparable(&want[k]) {
                    r.violations
                        .push(format!("{who}: final object {k} differs from the real one"));
                }
            }
        }
    }
    r
}

/// Checks one session; returns the number of events compared.
fn check_session(
    f: &Filtered,
    truth_last: u64,
    s: &Session,
    rules: &Rules,
    r: &mut Report,
    v: &mut Vec<String>,
) -> usize {
    match &s.end {
        End::Clean => r.clean_ends += 1,
        End::Stopped => {}
        // A passthrough watch relays the apiserver's connection loss; the client resumes.
        End::Broken(_) => r.broken += 1,
        End::Http(code, _) if (*code == 429 || *code >= 500) && rules.transient(s) => {
            r.transient_errors += 1;
        }
        End::Request(_) if rules.transient(s) => r.transient_errors += 1,
        End::Http(code, body) => v.push(format!("HTTP {code}: {body}")),
        End::Request(e) => v.push(format!("request failed: {e}")),
    }
    if matches!(s.end, End::Http(..) | End::Request(_)) {
        // No stream: nothing was delivered.
        return 0;
    }
    // A 410 ERROR event ends the session; it must be the only thing the server said.
    let mut items: &[Obs] = &s.items;
    if let Some(pos) = items.iter().position(|o| matches!(o, Obs::Error { .. })) {
        if let Obs::Error { code, message } = &items[pos] {
            // A resume from inside an absorbed relist cannot be exact (the cache's history
            // there is a difference): 410 is the answer, whatever the epoch.
            let inside_absorbed = matches!(s.start, Start::Resume(n)
                if f.absorbed.iter().any(|(a, b)| n > *a && n < *b));
            if *code == 410 && inside_absorbed {
                r.expired_inside_absorbed += 1;
            } else if *code == 410 {
                r.expired_410 += 1;
                let below_floor = matches!(s.start, Start::Resume(n)
                    if rules.expired_below.iter().any(|(e, rv)| s.end_epoch >= *e && n < *rv));
                let allowed = below_floor || rules.expired_from_epoch.is_some_and(|e| s.epoch >= e);
                if !allowed {
                    v.push(format!("unexpected 410 Expired: {message}"));
                }
                if s.start.is_initial() {
                    v.push("410 for a start that has no resourceVersion to expire".into());
                }
            } else {
                v.push(format!("ERROR event {code}: {message}"));
            }
        }
        if pos + 1 != items.len() {
            v.push("items after an ERROR event".into());
        }
        items = &items[..pos];
    }
    for o in items {
        if let Obs::Bookmark { initial_end, .. } = o {
            r.bookmarks += 1;
            if *initial_end {
                r.initial_end_bookmarks += 1;
            }
        }
    }
    match s.start {
        Start::Resume(n) => check_live(f, truth_last, n, items, v),
        start => check_initial(f, truth_last, s, start, items, rules, r, v),
    }
}

/// The live part of a session, after `from`: ordering, bookmarks, and equality with the
/// scope's history in `(from, last progress]`. Returns the number of events compared.
fn check_live(
    f: &Filtered,
    truth_last: u64,
    from: u64,
    items: &[Obs],
    v: &mut Vec<String>,
) -> usize {
    let mut last_event = from;
    let mut progress = from;
    let mut got: Vec<(&str, u64, &Key, &Value)> = Vec::new();
    for o in items {
        match o {
            Obs::Event {
                typ,
                rv,
                key,
                object,
            } => {
                if *rv <= last_event {
                    v.push(format!(
                        "ordered/unique: event {typ} {key} at {rv} after an event at {last_event}"
                    ));
                }
                if *rv <= progress && progress > last_event {
                    v.push(format!(
                        "bookmarkable: event {typ} {key} at {rv} after a bookmark at {progress}"
                    ));
                }
                last_event = last_event.max(*rv);
                progress = progress.max(*rv);
                got.push((typ, *rv, key, object));
            }
            Obs::Bookmark { rv, initial_end } => {
                if *rv < progress {
                    v.push(format!(
                        "bookmark went backwards: {rv} after progress {progress}"
                    ));
                }
                if *rv > truth_last {
                    v.push(format!(
                        "bookmark at {rv} beyond the real latest resourceVersion {truth_last}"
                    ));
                }
                if *initial_end {
                    v.push(format!(
                        "initial-events-end bookmark at {rv} in a live stream"
                    ));
                }
                progress = progress.max(*rv);
            }
            Obs::Error { .. } => {}
        }
    }
    // Outside absorbed relists, the events are the history; inside one, they are a
    // difference, checked as such.
    let inside = |rv: u64| {
        f.absorbed
            .iter()
            .find(|(a, b)| rv > *a && rv <= *b)
            .copied()
    };
    let want: Vec<Expected> = f
        .between(from, progress)
        .iter()
        .filter(|e| inside(e.rv).is_none())
        .cloned()
        .collect();
    let outside: Vec<_> = got
        .iter()
        .filter(|g| inside(g.1).is_none())
        .cloned()
        .collect();
    compare(&want, &outside, v);
    for &(a, b) in &f.absorbed {
        if a >= progress || b <= from {
            continue;
        }
        let part: Vec<_> = got
            .iter()
            .filter(|g| g.1 > a && g.1 <= b)
            .cloned()
            .collect();
        // A watch the apiserver answered (passed through) sees the real history there.
        let mut exact = Vec::new();
        compare(f.between(a.max(from), b.min(progress)), &part, &mut exact);
        if !exact.is_empty() {
            check_difference(f, (a, b), from <= a && progress >= b, &part, v);
        }
    }
    got.len()
}

/// The events of one absorbed relist `(a, b]` a session saw. Each ADDED or MODIFIED object
/// is the real object at `b`, each DELETED key is gone at `b` (or re-created). When the
/// session saw the whole window, applying them to the state at `a` gives the state at `b`
/// (nothing missed, nothing extra), with no change to an absent key and no addition of a
/// present one.
fn check_difference(
    f: &Filtered,
    (a, b): (u64, u64),
    whole: bool,
    got: &[(&str, u64, &Key, &Value)],
    v: &mut Vec<String>,
) {
    let end = f.state_at(b);
    let uid = |o: &Value| o["metadata"]["uid"].clone();
    for (typ, rv, key, object) in got {
        let ok = match *typ {
            "DELETED" => end.get(*key).is_none_or(|o| uid(o) != uid(object)),
            _ => end
                .get(*key)
                .is_some_and(|o| comparable(o) == comparable(object)),
        };
        if !ok {
            v.push(format!(
                "relist difference ({a}, {b}]: {typ} {key} at {rv} is not the state at {b}"
            ));
        }
    }
    if !whole {
        return;
    }
    let mut st = f.state_at(a);
    for (typ, rv, key, object) in got {
        let held = st.contains_key(*key);
        let fits = match *typ {
            "ADDED" => !held,
            _ => held,
        };
        if !fits {
            v.push(format!(
                "relist difference ({a}, {b}]: {typ} {key} at {rv} for a key {} in the watcher's view",
                if held { "already" } else { "not" }
            ));
        }
        if *typ == "DELETED" {
            st.remove(*key);
        } else {
            st.insert((*key).clone(), (*object).clone());
        }
    }
    let keys = |m: &BTreeMap<Key, Value>| m.keys().cloned().collect::<Vec<_>>();
    if keys(&st) != keys(&end) {
        v.push(format!(
            "relist difference ({a}, {b}]: leads to {:?}, the state at {b} is {:?}",
            keys(&st),
            keys(&end)
        ));
    }
}

/// Compares delivered events with the expected ones, merged by resourceVersion.
fn compare(want: &[Expected], got: &[(&str, u64, &Key, &Value)], v: &mut Vec<String>) {
    let (mut i, mut j) = (0, 0);
    let mut reported = 0;
    let mut report = |v: &mut Vec<String>, m: String| {
        reported += 1;
        if reported <= 5 {
            v.push(m);
        } else if reported == 6 {
            v.push("(further differences not shown)".into());
        }
    };
    while i < want.len() || j < got.len() {
        match (want.get(i), got.get(j)) {
            (Some(w), Some(g)) if w.rv == g.1 => {
                if w.typ != g.0 || &w.key != g.2 {
                    report(
                        v,
                        format!(
                            "history mismatch at {}: got {} {}, real {} {}",
                            w.rv, g.0, g.2, w.typ, w.key
                        ),
                    );
                } else if comparable(&w.object) != comparable(g.3) {
                    report(
                        v,
                        format!(
                            "served object differs at {} ({} {}): got {}, real {}",
                            w.rv, w.typ, w.key, g.3, w.object
                        ),
                    );
                }
                i += 1;
                j += 1;
            }
            (Some(w), g) if g.is_none_or(|g| w.rv < g.1) => {
                report(
                    v,
                    format!("reliable: missing {} {} at {}", w.typ, w.key, w.rv),
                );
                i += 1;
            }
            (_, Some(g)) => {
                report(
                    v,
                    format!(
                        "event {} {} at {} is not in the real history of this scope",
                        g.0, g.2, g.1
                    ),
                );
                j += 1;
            }
            (None, None) => break,
            (Some(_), None) => unreachable!("handled above"),
        }
    }
}

/// An initial-state session: a prefix of ADDED events equal to the scope's state at some S,
/// then the live history after S. Without an initial-events-end bookmark the boundary is found
/// by search: the session is correct if some boundary explains it.
#[allow(clippy::too_many_arguments)] // One call site; a struct would only rename them.
fn check_initial(
    f: &Filtered,
    truth_last: u64,
    s: &Session,
    start: Start,
    items: &[Obs],
    rules: &Rules,
    r: &mut Report,
    v: &mut Vec<String>,
) -> usize {
    let added_prefix = items
        .iter()
        .take_while(|o| matches!(o, Obs::Event { typ, .. } if typ == "ADDED"))
        .count();
    let marker = items.iter().position(|o| {
        matches!(
            o,
            Obs::Bookmark {
                initial_end: true,
                ..
            }
        )
    });
    if let Start::SendInitial(_) = start
        && marker.is_none()
        && items.len() > added_prefix
    {
        v.push("sendInitialEvents without the initial-events-end bookmark".into());
    }
    // Candidate (k, S): k initial events, state at S.
    let candidates: Vec<usize> = match marker {
        Some(m) => {
            if m != added_prefix {
                v.push(format!(
                    "initial-events-end bookmark after {m} items, but {added_prefix} initial ADDED events"
                ));
            }
            vec![m]
        }
        None => (0..=added_prefix).rev().collect(),
    };
    let mut first_failure: Option<Vec<String>> = None;
    for k in candidates {
        let mut w = Vec::new();
        let (checked, s_rv) = check_initial_at(
            f,
            truth_last,
            items,
            k,
            marker,
            s.truth_rv_at_request,
            &mut w,
        );
        if let Some(s_rv) = s_rv {
            match start {
                Start::SendInitial(Some(n)) if s_rv < n => w.push(format!(
                    "initial state at {s_rv} is older than the requested {n}"
                )),
                Start::Unset | Start::SendInitial(None) => {
                    if let Some(at) = s.truth_rv_at_request
                        && s_rv < at
                    {
                        if rules.strict_consistency {
                            w.push(format!(
                                "consistent start at {s_rv} older than the latest {at} at request time"
                            ));
                        } else if w.is_empty() {
                            r.stale_consistent_starts += 1;
                            r.max_staleness = r.max_staleness.max(at - s_rv);
                        }
                    }
                }
                _ => {}
            }
        }
        if w.is_empty() {
            return checked;
        }
        if first_failure.is_none() {
            first_failure = Some(w);
        }
    }
    // A stream that the server ended before anything told the initial state complete (only
    // ADDED events, no bookmark) may hold part of it: every object must still be the real
    // one; the client starts over (see `run_watcher`).
    if s.end != End::Stopped
        && added_prefix == items.len()
        && partial_initial_fits(f, items, &mut Vec::new())
    {
        r.partial_initial += 1;
        return added_prefix;
    }
    v.extend(first_failure.unwrap_or_default());
    items
        .iter()
        .filter(|o| matches!(o, Obs::Event { .. }))
        .count()
}

/// Whether ADDED events (no bookmark) are part of the real state at some resourceVersion:
/// each is the real object at the newest of their resourceVersions (an object of a state at
/// S did not change between its own resourceVersion and S).
fn partial_initial_fits(f: &Filtered, items: &[Obs], v: &mut Vec<String>) -> bool {
    let max_rv = items
        .iter()
        .filter_map(|o| match o {
            Obs::Event { rv, .. } => Some(*rv),
            _ => None,
        })
        .max()
        .unwrap_or(f.base_rv);
    let at = f.state_at(max_rv);
    for o in items {
        if let Obs::Event { key, object, .. } = o
            && at
                .get(key)
                .is_none_or(|r| comparable(r) != comparable(object))
        {
            v.push(format!("{key} is not in the real state at {max_rv}"));
        }
    }
    v.is_empty()
}

/// Checks the session with `k` initial events; returns (events compared, S if one fits).
/// When the stream does not pin S, the freshest fitting S is taken, from `fresh` (the latest
/// resourceVersion at request time) if the state there fits.
fn check_initial_at(
    f: &Filtered,
    truth_last: u64,
    items: &[Obs],
    k: usize,
    marker: Option<usize>,
    fresh: Option<u64>,
    v: &mut Vec<String>,
) -> (usize, Option<u64>) {
    let mut initial: BTreeMap<&Key, &Value> = BTreeMap::new();
    let mut max_rv = f.base_rv;
    for o in &items[..k] {
        if let Obs::Event {
            key, object, rv, ..
        } = o
        {
            if initial.insert(key, object).is_some() {
                v.push(format!("unique: {key} twice in the initial state"));
            }
            max_rv = max_rv.max(*rv);
        }
    }
    let rest = match marker {
        Some(m) => &items[m + 1..],
        None => &items[k..],
    };
    // S is pinned by the marker, else the latest point before the first live progress, else
    // any change point at which the state matches.
    let first_live = rest.iter().find_map(|o| match o {
        Obs::Event { rv, .. } => Some(rv.saturating_sub(1)),
        Obs::Bookmark { rv, .. } => Some(*rv),
        Obs::Error { .. } => None,
    });
    // A first event inside an absorbed relist `(a, b]` after an initial state no newer than
    // `a` may be part of the difference, whose revisions are not the real writes': the state
    // was then served at `a` at the latest. Or it is a real write: the watch was served by
    // the apiserver (passed through while the cache could not be confirmed) or by another
    // proxy, which told the real writes there. Either state must fit.
    let inside = first_live.and_then(|up| {
        f.absorbed
            .iter()
            .find(|(a, b)| up + 1 > *a && up < *b && max_rv <= *a)
            .map(|(a, _)| up.min(*a))
            .filter(|a| *a != up)
    });
    let pinned = match (marker, first_live) {
        (Some(m), _) => match &items[m] {
            Obs::Bookmark { rv, .. } => Some(*rv),
            _ => unreachable!("the marker is a bookmark"),
        },
        (None, Some(up)) => Some(up),
        (None, None) => None,
    };
    let same = |st: &BTreeMap<Key, Value>| {
        st.len() == initial.len()
            && st
                .iter()
                .zip(&initial)
                .all(|((k1, o1), (k2, o2))| k1 == *k2 && comparable(o1) == comparable(o2))
    };
    let fits = |s: u64| (s >= max_rv && same(&f.state_at(s))).then_some(s);
    let found = match pinned {
        Some(s) if marker.is_none() => inside.and_then(fits).or_else(|| fits(s)),
        Some(s) => fits(s),
        // Any point from the newest initial object on: the request time if it fits, else walk
        // the scope's changes.
        None => fresh
            .map(|at| at.max(max_rv))
            .filter(|at| same(&f.state_at(*at)))
            .or_else(|| {
                let mut st = f.state_at(max_rv);
                let mut found = same(&st).then_some(max_rv);
                for e in f.events.iter().filter(|e| e.rv > max_rv) {
                    if found.is_some() {
                        break;
                    }
                    if e.typ == "DELETED" {
                        st.remove(&e.key);
                    } else {
                        st.insert(e.key.clone(), e.object.clone());
                    }
                    found = same(&st).then_some(e.rv);
                }
                found
            }),
    };
    let Some(s_rv) = found else {
        let s_rv = inside.or(pinned).unwrap_or(max_rv);
        let real: Vec<_> = f
            .state_at(s_rv)
            .iter()
            .map(|(k, o)| (k.clone(), rv_of(o)))
            .collect();
        let got: Vec<_> = initial.iter().map(|(k, o)| (*k, rv_of(o))).collect();
        v.push(format!(
            "initial state ({k} events) is not the real state at any fitting resourceVersion \
             (tried {s_rv}): got {got:?}, real {real:?}"
        ));
        return (k, None);
    };
    let live = check_live(f, truth_last, s_rv, rest, v);
    (k + live, Some(s_rv))
}

// ---------------------------------------------------------------------------------------------
// The watcher driver
// ---------------------------------------------------------------------------------------------

/// Waits (within `limit`) until every watcher has caught up with its scope's final state
/// (`finals`: the state and the scope's last write, see [`WatchLog::caught_up`]), then stops
/// them all. The check and the stop happen under every log's lock, and a watcher applies
/// nothing once stopped: the views judged caught up are the final views (a watcher that
/// starts over or takes one more event in between would otherwise end with another).
/// Returns how many were still behind when the limit ran out (they are stopped too).
pub async fn stop_when_caught_up(
    logs: &[Arc<Mutex<WatchLog>>],
    finals: &[(BTreeMap<Key, Value>, u64)],
    ctl: &Control,
    limit: Duration,
) -> usize {
    let behind = super::eventually::poll_within_sync(limit, || {
        let views: Vec<_> = logs.iter().map(|l| l.lock().unwrap()).collect();
        let behind = views
            .iter()
            .zip(finals)
            .filter(|(l, (want, last))| !l.caught_up(want, *last))
            .count();
        if behind == 0 {
            ctl.stop.cancel();
        }
        if behind == 0 { Ok(()) } else { Err(behind) }
    })
    .await;
    ctl.stop.cancel();
    if behind.is_err() {
        for (l, (want, last)) in logs.iter().zip(finals) {
            let l = l.lock().unwrap();
            if !l.caught_up(want, *last) {
                let s = l.sessions.last();
                eprintln!(
                    "watcher {} ({}) still behind after {limit:?}: view {} its scope's final \
                     state, bookmarks {}, last session {:?} requested at {:?}, last write {last}",
                    l.id,
                    l.scope.describe(),
                    if l.converged(want) {
                        "equals"
                    } else {
                        "differs from"
                    },
                    l.bookmarks,
                    s.map(|s| s.start),
                    s.and_then(|s| s.truth_rv_at_request),
                );
            }
        }
    }
    behind.err().unwrap_or(0)
}

/// Shared controls of a run.
#[derive(Clone)]
pub struct Control {
    pub stop: CancellationToken,
    /// Bumped by the test at each fault (see [`Session::epoch`]).
    pub epoch: Arc<AtomicU64>,
    /// The real latest resourceVersion, when the test can know it.
    pub truth_rv: Arc<dyn Fn() -> Option<u64> + Send + Sync>,
}

/// One watcher's configuration.
#[derive(Clone)]
pub struct WatcherSpec {
    pub resource: &'static str,
    /// `https://host:port` or `http://host:port`.
    pub base: String,
    pub token: Option<String>,
    pub first: Start,
    /// How it starts over after a 410 (client-go relists with RV unset or "0").
    pub relist: Start,
    pub timeout_secs: Option<u64>,
    /// While this holds `true` the watcher stops reading its stream (a slow consumer): the
    /// proxy may close it as slow; it resumes as client-go would once it reads again.
    pub pause: Option<tokio::sync::watch::Receiver<bool>>,
}

fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

/// Watches until `ctl.stop`, recording every session into `log`.
pub async fn run_watcher<C>(
    client: Client<C, Full<Bytes>>,
    spec: WatcherSpec,
    log: Arc<Mutex<WatchLog>>,
    ctl: Control,
) where
    C: Connect + Clone + Send + Sync + 'static,
{
    let (scope, bookmarks) = {
        let l = log.lock().unwrap();
        (l.scope.clone(), l.bookmarks)
    };
    let mut start = spec.first;
    let mut last_rv: Option<u64> = None;
    let mut pause = spec.pause.clone();
    let epoch = || ctl.epoch.load(Ordering::SeqCst);
    while !ctl.stop.is_cancelled() {
        let mut q = "watch=1".to_string();
        let sel = scope.label_selector();
        if !sel.is_empty() {
            let _ = write!(q, "&labelSelector={}", encode(&sel));
        }
        if bookmarks || matches!(start, Start::SendInitial(_)) {
            q.push_str("&allowWatchBookmarks=true");
        }
        if let Some(t) = spec.timeout_secs {
            let _ = write!(q, "&timeoutSeconds={t}");
        }
        q.push_str(&start.query());
        let url = format!("{}{}?{q}", spec.base, scope.path(spec.resource));
        let mut b = Request::get(url);
        if let Some(t) = &spec.token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        let req = b.body(Full::default()).expect("request");
        let mut session = Session {
            start,
            truth_rv_at_request: (ctl.truth_rv)(),
            epoch: epoch(),
            end_epoch: 0,
            items: Vec::new(),
            end: End::Stopped,
        };
        if start.is_initial() {
            let mut l = log.lock().unwrap();
            // Stopped under the lock of a check of every view (`stop_when_caught_up`): the
            // view it judged is the final one.
            if ctl.stop.is_cancelled() {
                session.end_epoch = epoch();
                l.sessions.push(session);
                return;
            }
            l.state.clear();
        }
        let resp = tokio::select! {
            _ = ctl.stop.cancelled() => {
                session.end_epoch = epoch();
                log.lock().unwrap().sessions.push(session);
                return;
            }
            r = client.request(req) => r,
        };
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                session.end = End::Request(e.to_string());
                session.end_epoch = epoch();
                log.lock().unwrap().sessions.push(session);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if resp.status() != http::StatusCode::OK {
            let code = resp.status().as_u16();
            let body = super::proxy::body_string(resp).await;
            session.end = End::Http(code, body);
            session.end_epoch = epoch();
            log.lock().unwrap().sessions.push(session);
            if code == 410 {
                start = spec.relist;
                last_rv = None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let idx = {
            let mut l = log.lock().unwrap();
            l.sessions.push(session);
            l.sessions.len() - 1
        };
        let mut reader = EventReader::new(resp);
        let mut expired = false;
        // Whether an initial start's state is known to be complete: the initial-events-end
        // bookmark (sendInitialEvents), else any bookmark or non-ADDED event.
        let mut complete = !start.is_initial();
        let end = loop {
            if let Some(p) = &mut pause {
                tokio::select! {
                    _ = ctl.stop.cancelled() => break End::Stopped,
                    r = p.wait_for(|paused| !*paused) => drop(r),
                }
            }
            let next = tokio::select! {
                _ = ctl.stop.cancelled() => break End::Stopped,
                n = reader.try_next() => n,
            };
            let ev = match next {
                Ok(Some(ev)) => ev,
                Ok(None) => break End::Clean,
                Err(e) => break End::Broken(e),
            };
            let typ = ev["type"].as_str().unwrap_or("").to_string();
            let obj = ev["object"].clone();
            let mut l = log.lock().unwrap();
            if ctl.stop.is_cancelled() {
                break End::Stopped;
            }
            match typ.as_str() {
                "ADDED" | "MODIFIED" | "DELETED" => {
                    let rv = rv_of(&obj);
                    let key = key_of(&obj);
                    if typ == "DELETED" {
                        l.state.remove(&key);
                    } else {
                        l.state.insert(key.clone(), obj.clone());
                    }
                    last_rv = Some(last_rv.unwrap_or(0).max(rv));
                    complete |= typ != "ADDED" && !matches!(start, Start::SendInitial(_));
                    l.sessions[idx].items.push(Obs::Event {
                        typ,
                        rv,
                        key,
                        object: obj,
                    });
                }
                "BOOKMARK" => {
                    let rv = rv_of(&obj);
                    let initial_end =
                        obj["metadata"]["annotations"]["k8s.io/initial-events-end"] == "true";
                    last_rv = Some(last_rv.unwrap_or(0).max(rv));
                    complete |= initial_end || !matches!(start, Start::SendInitial(_));
                    l.sessions[idx]
                        .items
                        .push(Obs::Bookmark { rv, initial_end });
                }
                _ => {
                    let code = obj["code"].as_u64().unwrap_or(0);
                    let message = obj["message"].as_str().unwrap_or("").to_string();
                    l.sessions[idx].items.push(Obs::Error { code, message });
                    expired = code == 410;
                }
            }
        };
        let stopped = end == End::Stopped;
        {
            let mut l = log.lock().unwrap();
            l.sessions[idx].end = end;
            l.sessions[idx].end_epoch = epoch();
        }
        if stopped {
            return;
        }
        // A stream that ended before its initial state was known to be complete (the proxy
        // drained mid-state) cannot be resumed: the client starts over, as client-go's
        // watch-list does without the initial-events-end bookmark.
        start = if expired || !complete {
            last_rv = None;
            spec.relist
        } else {
            match last_rv {
                Some(rv) => Start::Resume(rv),
                None => spec.relist,
            }
        };
    }
}

/// Sums `kube_cache_proxy_requests_total` samples whose labels contain every `needle`.
pub fn sum_metric(metrics: &str, name: &str, needles: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Label selectors the validator workloads give their watchers: every operator, and
/// combinations, over the labels `random_labels` writes.
pub const SELECTORS: &[&[Req]] = &[
    &[],
    &[Req::Eq("app", "a")],
    &[Req::NotEq("app", "b")],
    &[Req::In("app", &["a", "c"])],
    &[Req::NotIn("app", &["a"])],
    &[Req::Exists("tier")],
    &[Req::NotExists("tier")],
    &[Req::Eq("env", "prod"), Req::In("app", &["b", "c"])],
    &[Req::Eq("tier", "web"), Req::NotEq("env", "dev")],
];

/// After a run's last write, one more per watcher scope: a new ConfigMap (`fence-<i>`) that
/// the scope selects. Every watcher's scope then ends with an ADDED under a real
/// resourceVersion, which it shows it has seen (as an event or in an initial state, also
/// inside a relist's difference, which keeps an added object's own resourceVersion), so
/// [`WatchLog::caught_up`] never waits on a watcher that has nothing more to show (a
/// deletion told inside a difference carries another revision than the real one).
pub async fn write_fences(fake: &FakeApiServer, scopes: &[Scope], namespaces: &[&str], n: u64) {
    const LABELS: [&[(&str, &str)]; 6] = [
        &[],
        &[("app", "a")],
        &[("app", "c"), ("tier", "web")],
        &[("app", "b"), ("env", "prod")],
        &[("app", "c"), ("env", "prod"), ("tier", "web")],
        &[("tier", "web")],
    ];
    for (i, scope) in scopes.iter().enumerate() {
        let ns = scope.namespace.as_deref().unwrap_or(namespaces[0]);
        let name = format!("fence-{i}");
        let fitting = LABELS.iter().find_map(|l| {
            let labels: serde_json::Map<String, Value> = l
                .iter()
                .map(|(k, v)| ((*k).to_string(), Value::String((*v).to_string())))
                .collect();
            let obj = configmap(ns, &name, Value::Object(labels), n, 0);
            scope.matches(&obj).then_some(obj)
        });
        let obj = fitting.unwrap_or_else(|| panic!("no fence label set fits {}", scope.describe()));
        fake.create(&format!("/api/v1/namespaces/{ns}/configmaps"), obj)
            .await;
    }
}

/// Random `app`/`env`/`tier` labels; updates change them so objects cross selectors.
pub fn random_labels(rng: &mut Rng) -> Value {
    let mut l = serde_json::Map::new();
    l.insert("app".into(), (*rng.pick(&["a", "b", "c"])).into());
    l.insert("env".into(), (*rng.pick(&["prod", "dev"])).into());
    if let Some(t) = rng.pick(&[Some("web"), Some("db"), None]) {
        l.insert("tier".into(), (*t).into());
    }
    Value::Object(l)
}

/// A ConfigMap with labels and a data field `n` (and `pad` bytes more data).
pub fn configmap(ns: &str, name: &str, labels: Value, n: u64, pad: usize) -> Value {
    let mut data = serde_json::Map::new();
    data.insert("n".into(), n.to_string().into());
    if pad > 0 {
        data.insert("pad".into(), "x".repeat(pad).into());
    }
    serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "data": data,
    })
}

/// The random ConfigMap writes of the validator workloads, written directly to the fake
/// apiserver: names `cm-0..names` in `namespaces`.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub namespaces: &'static [&'static str],
    pub names: usize,
    /// Each write carries up to this many bytes of extra data (0: none, and no draw).
    pub max_pad: usize,
}

impl Workload {
    /// One random write: create a missing object, else update it (often moving it across
    /// selectors by its labels) or delete it. `n` goes into the object's data.
    pub async fn write(&self, fake: &FakeApiServer, rng: &mut Rng, n: u64) {
        let ns = *rng.pick(self.namespaces);
        let name = format!("cm-{}", rng.below(self.names));
        let pad = if self.max_pad > 0 {
            rng.below(self.max_pad + 1)
        } else {
            0
        };
        let item = format!("/api/v1/namespaces/{ns}/configmaps/{name}");
        match fake.get(&item) {
            None => {
                let labels = random_labels(rng);
                fake.create(
                    &format!("/api/v1/namespaces/{ns}/configmaps"),
                    configmap(ns, &name, labels, n, pad),
                )
                .await;
            }
            Some(cur) if rng.chance(75) => {
                let labels = if rng.chance(50) {
                    random_labels(rng)
                } else {
                    cur["metadata"]["labels"].clone()
                };
                fake.update(&item, configmap(ns, &name, labels, n, pad))
                    .await;
            }
            Some(_) => {
                fake.delete(&item).await;
            }
        }
    }
}
