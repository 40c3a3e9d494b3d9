//! Per-node agents of the simulated cluster, as lightweight tasks of the driver: for each node a
//! kubelet-like client (client certificate `system:node:<node>`, group `system:nodes`) watching
//! its pods and its Node and GETting the ConfigMaps and Secrets its pods reference, and K
//! DaemonSet-agent-like clients (a ServiceAccount token each) watching their node's pods, every
//! Node and every EndpointSlice.
//!
//! Each watch is an informer as client-go's reflector runs one: a LIST (`resourceVersion=0`,
//! served from the watch cache), then a WATCH from the list's resourceVersion with bookmarks
//! and a random 5–10 minute `timeoutSeconds`; a watch that ends is opened again from the last
//! resourceVersion seen (a watch restart); a `410 Gone` (as a status or an `ERROR` event) makes
//! it LIST again (a relist). Every agent has one HTTP/2 connection, which it opens again when
//! it breaks. Events are read as JSON.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use http::{Method, StatusCode};
use http_body_util::BodyExt as _;
use serde_json::Value;

use crate::client::{Conn, LineReader, Target, send, unix_nanos};

/// Counters over every agent of one side.
#[derive(Default)]
pub struct Counters {
    /// LISTs (initial ones included).
    pub lists: AtomicU64,
    /// LISTs by an informer that had synced before: what a relist storm is made of.
    pub relists: AtomicU64,
    /// WATCH requests opened.
    pub watches: AtomicU64,
    /// WATCHes opened again after one ended or broke (not after a LIST).
    pub watch_restarts: AtomicU64,
    /// `410 Gone` answers and `ERROR` events with code 410.
    pub gone: AtomicU64,
    /// 403 answers (LIST, WATCH or GET).
    pub forbidden: AtomicU64,
    /// Other failed requests and broken connections.
    pub errors: AtomicU64,
    /// Watch events read (bookmarks not counted).
    pub events: AtomicU64,
    /// ConfigMap and Secret GETs of the kubelets (successful).
    pub gets: AtomicU64,
    /// Pods the kubelets see Running (not being deleted), summed over nodes.
    pub running_seen: AtomicI64,
    /// Latency write → receipt of the driver's Node annotation writes, in µs.
    pub latencies: parking_lot::Mutex<Vec<u64>>,
    /// The 410s by collection (`pods`, `pods with a field selector`, ...), taken by each
    /// phase.
    pub gone_by: parking_lot::Mutex<std::collections::BTreeMap<String, u64>>,
}

/// A snapshot of [`Counters`] (or the difference of two).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct CounterValues {
    pub lists: u64,
    pub relists: u64,
    pub watches: u64,
    pub watch_restarts: u64,
    pub gone: u64,
    pub forbidden: u64,
    pub errors: u64,
    pub events: u64,
    pub gets: u64,
}

impl Counters {
    pub fn values(&self) -> CounterValues {
        CounterValues {
            lists: self.lists.load(Relaxed),
            relists: self.relists.load(Relaxed),
            watches: self.watches.load(Relaxed),
            watch_restarts: self.watch_restarts.load(Relaxed),
            gone: self.gone.load(Relaxed),
            forbidden: self.forbidden.load(Relaxed),
            errors: self.errors.load(Relaxed),
            events: self.events.load(Relaxed),
            gets: self.gets.load(Relaxed),
        }
    }
}

impl CounterValues {
    pub fn since(self, b: CounterValues) -> CounterValues {
        CounterValues {
            lists: self.lists - b.lists,
            relists: self.relists - b.relists,
            watches: self.watches - b.watches,
            watch_restarts: self.watch_restarts - b.watch_restarts,
            gone: self.gone - b.gone,
            forbidden: self.forbidden - b.forbidden,
            errors: self.errors - b.errors,
            events: self.events - b.events,
            gets: self.gets - b.gets,
        }
    }
}

/// One informer's state, for convergence checks.
#[derive(Default)]
pub struct InformerState {
    /// Its first LIST is done.
    pub synced: AtomicBool,
    /// A WATCH is open (its response head came with 200) and has not ended.
    pub watching: AtomicBool,
}

/// One agent's connection, opened again after it broke.
struct Connection {
    target: Target,
    conn: tokio::sync::Mutex<Option<Conn>>,
}

impl Connection {
    async fn get(&self) -> anyhow::Result<Conn> {
        let mut g = self.conn.lock().await;
        if let Some(c) = g.as_ref()
            && !c.is_closed()
        {
            return Ok(c.clone());
        }
        let c = tokio::time::timeout(Duration::from_secs(10), self.target.connect()).await??;
        *g = Some(c.clone());
        Ok(c)
    }

    async fn reset(&self) {
        *self.conn.lock().await = None;
    }
}

/// What an informer's events feed.
enum Sink {
    /// A kubelet's pods: phase tracking (`running_seen`) and the GETs of what they reference.
    KubeletPods(KubeletPods),
    /// Nodes: the latency of the driver's annotation writes.
    Nodes(HashMap<String, u64>),
    /// Nothing but the count.
    Count,
}

struct KubeletPods {
    conn: Arc<Connection>,
    counters: Arc<Counters>,
    /// Pod name → counted as Running.
    running: HashMap<String, bool>,
    /// ConfigMaps and Secrets already fetched (`configmaps/ns/name`).
    fetched: HashSet<String>,
}

impl KubeletPods {
    fn set(&mut self, name: &str, running: bool) {
        let was = self
            .running
            .insert(name.to_string(), running)
            .unwrap_or(false);
        match (was, running) {
            (false, true) => self.counters.running_seen.fetch_add(1, Relaxed),
            (true, false) => self.counters.running_seen.fetch_sub(1, Relaxed),
            _ => 0,
        };
    }

    fn remove(&mut self, name: &str) {
        if self.running.remove(name) == Some(true) {
            self.counters.running_seen.fetch_sub(1, Relaxed);
        }
    }

    fn pod(&mut self, pod: &Value, deleted: bool) {
        let Some(name) = pod["metadata"]["name"].as_str() else {
            return;
        };
        if deleted {
            self.remove(name);
            return;
        }
        let running =
            pod["status"]["phase"] == "Running" && pod["metadata"]["deletionTimestamp"].is_null();
        self.set(name, running);
        let ns = pod["metadata"]["namespace"].as_str().unwrap_or("default");
        for r in references(pod) {
            let key = format!("{}/{ns}/{}", r.0, r.1);
            if self.fetched.insert(key) {
                let path = format!("/api/v1/namespaces/{ns}/{}/{}", r.0, r.1);
                tokio::spawn(get_with_retries(
                    self.conn.clone(),
                    self.counters.clone(),
                    path,
                ));
            }
        }
    }

    fn replace(&mut self, items: &[Value]) {
        let names: HashSet<&str> = items
            .iter()
            .filter_map(|p| p["metadata"]["name"].as_str())
            .collect();
        let gone: Vec<String> = self
            .running
            .keys()
            .filter(|n| !names.contains(n.as_str()))
            .cloned()
            .collect();
        for n in gone {
            self.remove(&n);
        }
        for p in items {
            self.pod(p, false);
        }
    }
}

/// The ConfigMaps and Secrets a pod references (`("configmaps"|"secrets", name)`): envFrom,
/// env valueFrom, volumes and projected volume sources, as the kubelet's managers read them.
pub fn references(pod: &Value) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let mut add = |kind: &'static str, v: &Value| {
        if let Some(n) = v.as_str() {
            let r = (kind, n.to_string());
            if !out.contains(&r) {
                out.push(r);
            }
        }
    };
    let spec = &pod["spec"];
    for list in ["containers", "initContainers"] {
        for c in spec[list].as_array().into_iter().flatten() {
            for e in c["envFrom"].as_array().into_iter().flatten() {
                add("configmaps", &e["configMapRef"]["name"]);
                add("secrets", &e["secretRef"]["name"]);
            }
            for e in c["env"].as_array().into_iter().flatten() {
                add("configmaps", &e["valueFrom"]["configMapKeyRef"]["name"]);
                add("secrets", &e["valueFrom"]["secretKeyRef"]["name"]);
            }
        }
    }
    for v in spec["volumes"].as_array().into_iter().flatten() {
        add("configmaps", &v["configMap"]["name"]);
        add("secrets", &v["secret"]["secretName"]);
        for s in v["projected"]["sources"].as_array().into_iter().flatten() {
            add("configmaps", &s["configMap"]["name"]);
            add("secrets", &s["secret"]["name"]);
        }
    }
    out
}

/// A kubelet's GET of a referenced object; a 403 (the Node authorizer's graph has not seen the
/// pod yet) is tried again, up to 10 times a second apart.
async fn get_with_retries(conn: Arc<Connection>, counters: Arc<Counters>, path: String) {
    for _ in 0..10 {
        let r = async {
            let c = conn.get().await?;
            let resp = send(&c, conn.target.request(Method::GET, &path, None)).await?;
            let status = resp.status();
            let _ = resp.into_body().collect().await?;
            anyhow::Ok(status)
        }
        .await;
        match r {
            Ok(s) if s.is_success() => {
                counters.gets.fetch_add(1, Relaxed);
                return;
            }
            // The object may not exist (yet): as the kubelet, try again later.
            Ok(StatusCode::FORBIDDEN) => {
                counters.forbidden.fetch_add(1, Relaxed);
            }
            Ok(_) => {
                counters.errors.fetch_add(1, Relaxed);
            }
            Err(_) => {
                counters.errors.fetch_add(1, Relaxed);
                conn.reset().await;
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The string value after the first `"key":"` in `line`.
fn str_field<'a>(line: &'a [u8], key: &str) -> Option<&'a str> {
    let pat = format!("\"{key}\":\"");
    let i = memchr::memmem::find(line, pat.as_bytes())? + pat.len();
    let j = memchr::memchr(b'"', &line[i..])?;
    std::str::from_utf8(&line[i..i + j]).ok()
}

/// One informer: LIST + WATCH of `path` (a collection) with `selector` (a field selector, or
/// empty), until aborted.
async fn informer(
    conn: Arc<Connection>,
    counters: Arc<Counters>,
    state: Arc<InformerState>,
    path: String,
    selector: String,
    mut sink: Sink,
) {
    let sel = if selector.is_empty() {
        String::new()
    } else {
        format!("&fieldSelector={selector}")
    };
    let mut rv: Option<String> = None;
    let mut ever_synced = false;
    // Bounded by the task's life: the phases abort it.
    loop {
        let Some(from) = rv.clone() else {
            match list(&conn, &counters, &path, &sel, &mut sink).await {
                Ok(list_rv) => {
                    counters.lists.fetch_add(1, Relaxed);
                    if ever_synced {
                        counters.relists.fetch_add(1, Relaxed);
                    }
                    ever_synced = true;
                    state.synced.store(true, Relaxed);
                    rv = Some(list_rv);
                }
                Err(e) => {
                    note_error(&counters, &e);
                    conn.reset().await;
                    backoff().await;
                }
            }
            continue;
        };
        let timeout = 300 + unix_nanos() % 300;
        let url = format!(
            "{path}?watch=true&resourceVersion={from}&allowWatchBookmarks=true&timeoutSeconds={timeout}{sel}"
        );
        counters.watches.fetch_add(1, Relaxed);
        let r = watch(&conn, &counters, &state, &url, &mut rv, &mut sink).await;
        state.watching.store(false, Relaxed);
        match r {
            Ok(()) => {
                counters.watch_restarts.fetch_add(1, Relaxed);
            }
            Err(e) => {
                if e.downcast_ref::<Gone>().is_some() {
                    counters.gone.fetch_add(1, Relaxed);
                    let what = path.rsplit('/').next().unwrap_or("?");
                    let what = if selector.is_empty() {
                        what.to_string()
                    } else {
                        format!("{what} with a field selector")
                    };
                    *counters.gone_by.lock().entry(what).or_default() += 1;
                    rv = None;
                } else {
                    note_error(&counters, &e);
                    counters.watch_restarts.fetch_add(1, Relaxed);
                    conn.reset().await;
                    backoff().await;
                }
            }
        }
    }
}

/// A `410 Gone`: the resourceVersion is too old; LIST again.
#[derive(Debug)]
struct Gone;

impl std::fmt::Display for Gone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("410 Gone")
    }
}

impl std::error::Error for Gone {}

#[derive(Debug)]
struct Forbidden;

impl std::fmt::Display for Forbidden {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("403 Forbidden")
    }
}

impl std::error::Error for Forbidden {}

fn note_error(counters: &Counters, e: &anyhow::Error) {
    if e.downcast_ref::<Forbidden>().is_some() {
        counters.forbidden.fetch_add(1, Relaxed);
    } else {
        counters.errors.fetch_add(1, Relaxed);
    }
}

/// client-go's reflector backs off 800 ms .. 30 s; a second with jitter here.
async fn backoff() {
    tokio::time::sleep(Duration::from_millis(800 + unix_nanos() % 400)).await;
}

fn status_error(status: StatusCode, what: &str) -> anyhow::Error {
    match status {
        StatusCode::GONE => Gone.into(),
        StatusCode::FORBIDDEN => Forbidden.into(),
        s => anyhow::anyhow!("{what}: {s}"),
    }
}

/// A LIST from the watch cache (`resourceVersion=0`, pages of 500 if the server pages), fed to
/// `sink`; returns the list's resourceVersion.
async fn list(
    conn: &Connection,
    counters: &Counters,
    path: &str,
    sel: &str,
    sink: &mut Sink,
) -> anyhow::Result<String> {
    let mut items: Vec<Value> = Vec::new();
    let mut cont = String::new();
    // Bounded: a list of 1,000 pages is far beyond the sizes here.
    for _ in 0..1000 {
        let url = if cont.is_empty() {
            format!("{path}?resourceVersion=0&limit=500{sel}")
        } else {
            format!("{path}?limit=500&continue={cont}{sel}")
        };
        let c = conn.get().await?;
        let resp = send(&c, conn.target.request(Method::GET, &url, None)).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            return Err(status_error(status, "LIST"));
        }
        let mut v: Value = serde_json::from_slice(&body)?;
        let rv = v["metadata"]["resourceVersion"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        cont = v["metadata"]["continue"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if let Value::Array(a) = v["items"].take() {
            items.extend(a);
        }
        if cont.is_empty() {
            match sink {
                Sink::KubeletPods(k) => k.replace(&items),
                Sink::Nodes(_) | Sink::Count => {}
            }
            let _ = counters;
            return Ok(rv);
        }
    }
    anyhow::bail!("LIST {path}: more than 1,000 pages")
}

/// One WATCH, read until it ends (`Ok`) or fails; `rv` follows its events and bookmarks.
async fn watch(
    conn: &Connection,
    counters: &Counters,
    state: &InformerState,
    url: &str,
    rv: &mut Option<String>,
    sink: &mut Sink,
) -> anyhow::Result<()> {
    let c = conn.get().await?;
    let resp = send(&c, conn.target.request(Method::GET, url, None)).await?;
    let status = resp.status();
    if !status.is_success() {
        let _ = resp.into_body().collect().await;
        return Err(status_error(status, "WATCH"));
    }
    state.watching.store(true, Relaxed);
    let mut lines = LineReader::new(resp);
    while let Some(line) = lines.next().await? {
        let Some(kind) = str_field(&line, "type") else {
            continue;
        };
        match kind {
            "ERROR" => {
                let v: Value = serde_json::from_slice(&line).unwrap_or(Value::Null);
                if v["object"]["code"] == 410 {
                    return Err(Gone.into());
                }
                anyhow::bail!("watch ERROR event: {}", v["object"]["message"]);
            }
            "BOOKMARK" => {
                if let Some(r) = str_field(&line, "resourceVersion") {
                    *rv = Some(r.to_string());
                }
                continue;
            }
            _ => {}
        }
        counters.events.fetch_add(1, Relaxed);
        if let Some(r) = str_field(&line, "resourceVersion") {
            *rv = Some(r.to_string());
        }
        match sink {
            Sink::KubeletPods(k) => {
                let v: Value = serde_json::from_slice(&line)?;
                k.pod(&v["object"], kind == "DELETED");
            }
            Sink::Nodes(seen) => {
                if let (Some(name), Some(ts)) = (
                    str_field(&line, "name"),
                    str_field(&line, "loadtest/ts").and_then(|t| t.parse::<u64>().ok()),
                ) && seen.get(name) != Some(&ts)
                {
                    seen.insert(name.to_string(), ts);
                    let now = unix_nanos();
                    counters
                        .latencies
                        .lock()
                        .push(now.saturating_sub(ts) / 1000);
                }
            }
            Sink::Count => {}
        }
    }
    Ok(())
}

/// A running agent: its informers' tasks (aborted when dropped) and states.
pub struct Agent {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    pub informers: Vec<Arc<InformerState>>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Agent {
    fn start(
        target: Target,
        counters: &Arc<Counters>,
        specs: Vec<(String, String, Sink)>,
    ) -> Agent {
        let conn = Arc::new(Connection {
            target,
            conn: tokio::sync::Mutex::new(None),
        });
        let mut tasks = Vec::new();
        let mut informers = Vec::new();
        for (path, selector, sink) in specs {
            let state = Arc::new(InformerState::default());
            informers.push(state.clone());
            tasks.push(tokio::spawn(informer(
                conn.clone(),
                counters.clone(),
                state,
                path,
                selector,
                sink,
            )));
        }
        Agent { tasks, informers }
    }

    /// A kubelet-like agent of `node` (`target` carries its node certificate): its pods and
    /// its Node, and the GETs of what its pods reference.
    pub fn kubelet(target: Target, counters: &Arc<Counters>, node: &str) -> Agent {
        let conn = Arc::new(Connection {
            target: target.clone(),
            conn: tokio::sync::Mutex::new(None),
        });
        let pods = Sink::KubeletPods(KubeletPods {
            conn,
            counters: counters.clone(),
            running: HashMap::new(),
            fetched: HashSet::new(),
        });
        Agent::start(
            target,
            counters,
            vec![
                (
                    "/api/v1/pods".into(),
                    format!("spec.nodeName%3D{node}"),
                    pods,
                ),
                (
                    "/api/v1/nodes".into(),
                    format!("metadata.name%3D{node}"),
                    Sink::Nodes(HashMap::new()),
                ),
            ],
        )
    }

    /// A DaemonSet-agent-like client on `node` (`target` carries its ServiceAccount token):
    /// its node's pods, every Node, every EndpointSlice.
    pub fn daemon(target: Target, counters: &Arc<Counters>, node: &str) -> Agent {
        Agent::start(
            target,
            counters,
            vec![
                (
                    "/api/v1/pods".into(),
                    format!("spec.nodeName%3D{node}"),
                    Sink::Count,
                ),
                (
                    "/api/v1/nodes".into(),
                    String::new(),
                    Sink::Nodes(HashMap::new()),
                ),
                (
                    "/apis/discovery.k8s.io/v1/endpointslices".into(),
                    String::new(),
                    Sink::Count,
                ),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_from_a_watch_line_without_parsing_it() {
        let line = br#"{"type":"MODIFIED","object":{"kind":"Node","apiVersion":"v1","metadata":{"name":"n-1","uid":"u","resourceVersion":"42","annotations":{"loadtest/ts":"1234"}}}}"#;
        assert_eq!(str_field(line, "type"), Some("MODIFIED"));
        assert_eq!(str_field(line, "name"), Some("n-1"));
        assert_eq!(str_field(line, "resourceVersion"), Some("42"));
        assert_eq!(str_field(line, "loadtest/ts"), Some("1234"));
        assert_eq!(str_field(line, "missing"), None);
    }

    #[test]
    fn a_pods_references_are_its_configmaps_and_secrets() {
        let pod = serde_json::json!({"spec": {
            "containers": [{"envFrom": [{"configMapRef": {"name": "cfg"}}, {"secretRef": {"name": "sec"}}],
                            "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}}]}],
            "volumes": [{"projected": {"sources": [{"configMap": {"name": "kube-root-ca.crt"}}, {"serviceAccountToken": {}}]}},
                        {"secret": {"secretName": "s2"}}]
        }});
        assert_eq!(
            references(&pod),
            [
                ("configmaps", "cfg".to_string()),
                ("secrets", "sec".to_string()),
                ("configmaps", "kube-root-ca.crt".to_string()),
                ("secrets", "s2".to_string()),
            ]
        );
    }
}
