//! A micro-benchmark (not the real path: no TLS, no kube-apiserver, events pushed into the
//! cache in-process; the load driver in `loadtest/` measures the real path side by side with
//! kube-apiserver). Watch fan-out on this machine: deliveries/s and delivery latency of one event to 1,000 and
//! 10,000 watchers, GB/s of 1 MB objects, memory per idle watcher, upstream ingest MB/s per
//! core, and loopback TCP throughput for scale. Prints one markdown table with each target.
//!
//! Two levels:
//!
//! - (a) in-process: a `ResourceCache` fed through `ReflectorSink::apply`; each watcher is a
//!   task draining its `Subscription` the way the HTTP writer (`watch.rs`) does: one `recv`,
//!   then up to 128 queued items or 256 KiB, each item's shared frame copied into one
//!   `BytesMut`. Latency is `Event::at` (set inside `apply`) to the end of that copy.
//! - (b) end to end: the proxy embedded on port 0 in front of a tiny fake upstream (discovery,
//!   an empty configmaps list, a watch that never sends, access reviews that allow). Events
//!   go in through `apply` on the proxy's own cache, from a runtime task as the reflector
//!   applies them. A child process (this binary again) opens N h2c watch streams over N/250
//!   connections, so the proxy's RSS is measured apart from the client's. Each object carries
//!   its send time (unix ns) in an annotation; latency is that to the end of its line being
//!   read by the client. Client and proxy share the machine's two cores, so the client's own
//!   CPU is part of every (b) latency: each (b) row is measured with two clients, a minimal
//!   HTTP/2 client (`h2raw`: frames parsed in place, one task per connection) that leaves
//!   the most CPU to the proxy, and hyper's HTTP/2 client as Rust controllers use it (one
//!   task per connection drives its streams). `KCP_FANOUT_WIRES=raw` or `=hyper` runs one.
//!
//! ```text
//! cargo bench --bench fanout
//! KCP_FANOUT_HTTP_MAX=1000 cargo bench --bench fanout   # skip the 10k HTTP run
//! KCP_FANOUT_HTTP=0 cargo bench --bench fanout          # in-process only
//! ```
//!
//! Throughput is a burst of back-to-back events (fewer than the per-watcher queue, so no
//! watcher can be closed as slow), timed from just before the first `apply` to the last
//! watcher reading the last event. Latency is a paced stream (one event every 100 ms) and, in
//! (b), isolated events (one per second), so it measures one event's fan-out, not a burst's
//! queueing. For (b) it also prints where the CPU went (proxy vs client process) and the
//! proxy's socket writes per delivery (`/proc/<pid>/stat`; `coalesce::socket_writes`).
//!
//! Wall-clock numbers on a shared machine: other work on the same cores moves them between
//! runs; compare rows of one run.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kube_cache_proxy::cache::event::Encoding;
use kube_cache_proxy::cache::hub::Filter;
use kube_cache_proxy::cache::registry::Caches;
use kube_cache_proxy::cache::{
    CachedObject, EventKind, ReflectorSink, Resource, ResourceCache, Start, StoreConfig,
};
use kube_cache_proxy::config::Config;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Counts the bytes this process has allocated and not freed, beside RSS: RSS per watcher
/// includes allocator slack and pages touched earlier, the heap count is what the watchers
/// themselves keep (one relaxed add per allocation and free).
struct CountingAlloc;

static HEAP_LIVE: AtomicU64 = AtomicU64::new(0);
/// The highest `HEAP_LIVE` seen since it was last reset to the live count.
static HEAP_PEAK: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only a counter is kept.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        let live = HEAP_LIVE.fetch_add(l.size() as u64, Ordering::Relaxed) + l.size() as u64;
        HEAP_PEAK.fetch_max(live, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        HEAP_LIVE.fetch_sub(l.size() as u64, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        HEAP_LIVE.fetch_add(l.size() as u64, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { std::alloc::System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new: usize) -> *mut u8 {
        HEAP_LIVE.fetch_add(new as u64, Ordering::Relaxed);
        HEAP_LIVE.fetch_sub(l.size() as u64, Ordering::Relaxed);
        // SAFETY: as the caller's contract.
        unsafe { std::alloc::System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn heap_live() -> u64 {
    HEAP_LIVE.load(Ordering::Relaxed)
}

/// This process's resident set in KiB.
fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// CPU seconds (user + system, all threads) of a process, and (for this process, which
/// embeds the proxy) the socket writes of the proxy's connections. (`/proc/<pid>/io`'s
/// `syscw` does not count `send`, which is what tokio's sockets use.)
fn proc_usage(pid: Option<u32>) -> (f64, u64) {
    let dir = pid.map_or("/proc/self".to_string(), |p| format!("/proc/{p}"));
    let stat = std::fs::read_to_string(format!("{dir}/stat")).unwrap_or_default();
    // Fields after the command name: state is the first, utime the 12th, stime the 13th.
    let f: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // USER_HZ is 100 on Linux.
    let cpu = (ticks(11) + ticks(12)) / 100.0;
    let writes = match pid {
        None => kube_cache_proxy::http::coalesce::socket_writes(),
        Some(_) => 0,
    };
    (cpu, writes)
}

/// Percentile of sorted microsecond samples, in ms.
fn pct_ms(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize] as f64 / 1e3
}

// ---------------------------------------------------------------------------------------------
// Objects
// ---------------------------------------------------------------------------------------------

/// The annotation holding an object's send time, early in the line so the client finds it in
/// the first few hundred bytes.
const SENT_KEY: &str = "kcp-bench/sent";

fn configmaps() -> Resource {
    Resource::core("configmaps", "ConfigMap", true)
}

/// A ConfigMap as the apiserver writes it, `payload` bytes of data.
fn configmap(rv: u64, sent_ns: u64, payload: usize) -> Bytes {
    let mut s = String::with_capacity(payload + 320);
    let _ = write!(
        s,
        r#"{{"kind":"ConfigMap","apiVersion":"v1","metadata":{{"name":"bench","namespace":"default","uid":"0b0b0b0b-0000-4000-8000-000000000000","resourceVersion":"{rv}","annotations":{{"{SENT_KEY}":"{sent_ns}"}},"labels":{{"app":"bench"}}}},"data":{{"payload":""#
    );
    s.extend(std::iter::repeat_n('y', payload));
    s.push_str(r#""}}"#);
    Bytes::from(s)
}

/// The data payload that makes a MODIFIED frame about `frame` bytes long (the frame adds
/// `{"type":"MODIFIED","object":` and `}\n` around the object).
fn payload_for(frame: usize) -> usize {
    frame.saturating_sub(configmap(1_000_000, unix_ns(), 0).len() + 30)
}

fn object(rv: u64, sent_ns: u64, payload: usize) -> CachedObject {
    CachedObject::parse(configmap(rv, sent_ns, payload), &configmaps()).expect("valid object")
}

// ---------------------------------------------------------------------------------------------
// (a) in-process
// ---------------------------------------------------------------------------------------------

/// What a phase measured.
#[derive(Debug, Default, Clone)]
struct Phase {
    watchers: usize,
    events: usize,
    deliveries: u64,
    bytes: u64,
    /// From just before the first apply to the last delivery.
    wall: Duration,
    /// Latency samples (µs), sorted.
    lat: Vec<u32>,
    /// Watchers that ended before receiving every event (closed as slow, stream error).
    ended: usize,
    timed_out: bool,
    /// Pacing of the events, `None` for a burst.
    pace: Option<Duration>,
    /// (b): CPU seconds of the proxy process and of the client process during the phase, and
    /// the proxy's socket writes.
    cpu: Option<(f64, f64, u64)>,
}

impl Phase {
    fn per_sec(&self) -> f64 {
        self.deliveries as f64 / self.wall.as_secs_f64()
    }
    fn gb_per_sec(&self) -> f64 {
        self.bytes as f64 / self.wall.as_secs_f64() / 1e9
    }
}

fn new_cache() -> Arc<ResourceCache> {
    let c = ResourceCache::new(configmaps(), StoreConfig::default());
    c.replace(Vec::new(), 1);
    c
}

/// A watcher that drains its queue like `watch.rs`'s `WatchBody` (without the HTTP write):
/// returns (latencies µs, bytes, last delivery, whether it ended early).
async fn drain_like_writer(
    mut reg: kube_cache_proxy::cache::store::Registration,
    expect: usize,
) -> (Vec<u32>, u64, Instant, bool) {
    const BATCH_FRAMES: usize = 128;
    const BATCH_BYTES: usize = 256 * 1024;
    let r = configmaps();
    let mut lat = Vec::with_capacity(expect);
    let mut ats = Vec::with_capacity(BATCH_FRAMES + 1);
    let mut bytes = 0u64;
    let mut got = 0usize;
    let mut last = Instant::now();
    while got < expect {
        let Some((ev, d)) = reg.sub.rx.recv().await else {
            return (lat, bytes, last, true);
        };
        let mut out = BytesMut::new();
        out.extend_from_slice(&ev.frame(&r, d, Encoding::Json));
        ats.push(ev.at);
        got += 1;
        for _ in 0..BATCH_FRAMES {
            if out.len() >= BATCH_BYTES || got >= expect {
                break;
            }
            match reg.sub.rx.try_recv() {
                Ok((ev, d)) => {
                    out.extend_from_slice(&ev.frame(&r, d, Encoding::Json));
                    ats.push(ev.at);
                    got += 1;
                }
                Err(_) => break,
            }
        }
        let chunk = black_box(out.freeze());
        bytes += chunk.len() as u64;
        last = Instant::now();
        for at in ats.drain(..) {
            lat.push(last.duration_since(at).as_micros().min(u32::MAX as u128) as u32);
        }
    }
    (lat, bytes, last, false)
}

/// `events` events of a ~`frame`-byte object to `n` watchers, back to back or one every
/// `pace`.
async fn inproc_phase(n: usize, events: usize, frame: usize, pace: Option<Duration>) -> Phase {
    let cache = new_cache();
    let payload = payload_for(frame);
    let filter = Arc::new(Filter::default());
    let rv = cache.rv();
    // Built before timing: the ingest cost is measured on its own below.
    let objs: Vec<CachedObject> = (1..=events as u64)
        .map(|i| object(rv + i, 0, payload))
        .collect();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let reg = cache.watch(Start::After(rv), filter.clone()).unwrap();
            tokio::spawn(drain_like_writer(reg, events))
        })
        .collect();
    // Let every watcher park on its queue first.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Applied from a task, as the reflector applies in the proxy (see `inject`).
    let c = cache.clone();
    let t0 = tokio::spawn(async move {
        let mut tick = pace.map(tokio::time::interval);
        let t0 = Instant::now();
        for o in objs {
            if let Some(t) = tick.as_mut() {
                t.tick().await;
            }
            c.apply(EventKind::Modified, o);
        }
        t0
    })
    .await
    .unwrap();
    let mut p = Phase {
        watchers: n,
        events,
        pace,
        ..Phase::default()
    };
    let mut last = t0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for t in tasks {
        match tokio::time::timeout_at(deadline, t).await {
            Ok(Ok((lat, bytes, l, ended))) => {
                p.deliveries += lat.len() as u64;
                p.bytes += bytes;
                p.lat.extend(lat);
                last = last.max(l);
                p.ended += ended as usize;
            }
            _ => p.timed_out = true,
        }
    }
    p.wall = last.duration_since(t0);
    p.lat.sort_unstable();
    p
}

/// RSS growth per watcher for `n` idle in-process registrations, and with a parked task each.
/// The registrations are returned so their memory stays out of later measurements' reach.
async fn inproc_idle(n: usize) -> (f64, f64, Vec<tokio::task::JoinHandle<()>>) {
    let cache = new_cache();
    cache.apply(EventKind::Modified, object(2, 0, payload_for(1024)));
    let filter = Arc::new(Filter::default());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let r0 = rss_kib();
    let h0 = heap_live();
    let regs: Vec<_> = (0..n)
        .map(|_| {
            cache
                .watch(Start::After(cache.rv()), filter.clone())
                .unwrap()
        })
        .collect();
    let r1 = rss_kib();
    let h1 = heap_live();
    let tasks: Vec<_> = regs
        .into_iter()
        .map(|mut reg| {
            tokio::spawn(async move {
                let _ = reg.sub.rx.recv().await;
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r2 = rss_kib();
    eprintln!(
        "fanout: in-process idle heap: {:.0} B/subscription, {:.0} B with a task",
        h1.saturating_sub(h0) as f64 / n as f64,
        heap_live().saturating_sub(h0) as f64 / n as f64
    );
    // Keeps the cache (and so the hub) alive with the tasks.
    std::mem::forget(cache);
    (
        (r1.saturating_sub(r0) * 1024) as f64 / n as f64,
        (r2.saturating_sub(r0) * 1024) as f64 / n as f64,
        tasks,
    )
}

// ---------------------------------------------------------------------------------------------
// (b) end to end: fake upstream, proxy, client child process
// ---------------------------------------------------------------------------------------------

type UpBody = BoxBody<Bytes, Infallible>;

fn json(status: StatusCode, v: serde_json::Value) -> Response<UpBody> {
    let mut r = Response::new(Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = status;
    r.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    r
}

/// Discovery for configmaps, an empty list at RV 1, a watch that stays open and silent (events
/// are injected into the proxy's cache directly), access reviews that allow. Counts watches
/// that arrive with the bench client's token: those were passed through, not served from cache.
async fn fake_upstream() -> (SocketAddr, Arc<AtomicU64>) {
    let passed = Arc::new(AtomicU64::new(0));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let p = passed.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let p = p.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let p = p.clone();
                    async move {
                        let path = req.uri().path();
                        let query = req.uri().query().unwrap_or("");
                        let r = match path {
                            "/api/v1" => json(
                                StatusCode::OK,
                                serde_json::json!({"kind": "APIResourceList", "groupVersion": "v1",
                                "resources": [{"name": "configmaps", "singularName": "configmap",
                                    "namespaced": true, "kind": "ConfigMap",
                                    "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}]}),
                            ),
                            "/api/v1/configmaps" if query.contains("watch=1") => {
                                if req
                                    .headers()
                                    .get("authorization")
                                    .is_some_and(|v| v == "Bearer bench")
                                {
                                    p.fetch_add(1, Ordering::Relaxed);
                                }
                                let s = futures_util::stream::pending::<
                                    Result<Frame<Bytes>, Infallible>,
                                >();
                                let mut r = Response::new(StreamBody::new(s).boxed());
                                r.headers_mut()
                                    .insert("content-type", "application/json".parse().unwrap());
                                r
                            }
                            "/api/v1/configmaps" => json(
                                StatusCode::OK,
                                serde_json::json!({"kind": "ConfigMapList", "apiVersion": "v1",
                                "metadata": {"resourceVersion": "1"}, "items": []}),
                            ),
                            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
                            | "/apis/authorization.k8s.io/v1/subjectaccessreviews" => json(
                                StatusCode::CREATED,
                                serde_json::json!({"apiVersion": "authorization.k8s.io/v1",
                                "status": {"allowed": true}}),
                            ),
                            "/readyz" | "/livez" | "/healthz" => {
                                Response::new(Full::new(Bytes::from_static(b"ok")).boxed())
                            }
                            _ => json(
                                StatusCode::NOT_FOUND,
                                serde_json::json!({"kind": "Status", "apiVersion": "v1",
                                "status": "Failure", "reason": "NotFound", "code": 404}),
                            ),
                        };
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    (addr, passed)
}

struct Proxy {
    running: kube_cache_proxy::app::start::Running,
    addr: SocketAddr,
    cache: Arc<ResourceCache>,
    passed: Arc<AtomicU64>,
}

async fn start_proxy() -> Option<Proxy> {
    let (up, passed) = fake_upstream().await;
    let mut cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        insecure_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..Config::default()
    };
    cfg.cache.resources = vec!["configmaps".into()];
    // The bench upstream serves neither ServiceAccounts nor RBAC objects.
    cfg.authentication.service_account_lookup = false;
    cfg.cache.authorization_follow_rbac = false;
    cfg.log.level = "warn".into();
    // The client child sends no credentials: served as system:anonymous, whose access
    // review the fake upstream allows (one review, then the cached decision).
    cfg.authentication.anonymous = true;
    let kube = kube::Config::new(format!("http://{up}").parse().unwrap());
    let running = kube_cache_proxy::app::start::start(cfg, &kube).await.ok()?;
    let addr = running.insecure_addr?;
    let caches: &Caches = &running.state.caches;
    let deadline = Instant::now() + Duration::from_secs(20);
    let cache = loop {
        if let Some(c) = caches.get("", "v1", "configmaps")
            && c.is_ready()
        {
            break c;
        }
        if Instant::now() > deadline {
            eprintln!("fanout: the proxy's configmaps cache did not become ready");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    Some(Proxy {
        running,
        addr,
        cache,
        passed,
    })
}

/// The client child process, driven over its stdin/stdout.
struct Child {
    proc: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

impl Child {
    fn spawn(addr: SocketAddr, n: usize, per_conn: usize, rv: u64, wire: Wire) -> Child {
        let mut proc = tokio::process::Command::new(std::env::current_exe().unwrap())
            .env("KCP_FANOUT_CLIENT", addr.to_string())
            .env("KCP_FANOUT_WIRE", wire.name())
            .env("KCP_FANOUT_N", n.to_string())
            .env("KCP_FANOUT_PER_CONN", per_conn.to_string())
            .env("KCP_FANOUT_RV", rv.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the client process");
        let stdin = proc.stdin.take().unwrap();
        let lines = BufReader::new(proc.stdout.take().unwrap()).lines();
        Child { proc, stdin, lines }
    }

    async fn line(&mut self, bound: Duration) -> Option<String> {
        match tokio::time::timeout(bound, self.lines.next_line()).await {
            Ok(Ok(Some(l))) => Some(l),
            _ => None,
        }
    }

    async fn send(&mut self, cmd: &str) {
        let _ = self.stdin.write_all(format!("{cmd}\n").as_bytes()).await;
        let _ = self.stdin.flush().await;
    }

    /// Arms a phase of `events` per stream, runs `inject`, and reads the result.
    async fn phase(
        &mut self,
        n: usize,
        events: usize,
        pace: Option<Duration>,
        inject: impl AsyncFnOnce() -> u64,
    ) -> Option<Phase> {
        self.send(&format!("phase {events}")).await;
        if self.line(Duration::from_secs(10)).await.as_deref() != Some("armed") {
            return None;
        }
        let (p0, w0) = proc_usage(None);
        let (c0, _) = proc_usage(self.proc.id());
        let t0 = inject().await;
        let l = self.line(Duration::from_secs(120)).await?;
        let (p1, w1) = proc_usage(None);
        let (c1, _) = proc_usage(self.proc.id());
        // done <reports> <ended> <deliveries> <bytes> <last_ns> <timed_out> <lat µs...>
        let mut it = l.split_whitespace();
        if it.next() != Some("done") {
            return None;
        }
        let mut num = || it.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let _reports = num();
        let ended = num() as usize;
        let deliveries = num();
        let bytes = num();
        let last_ns = num();
        let timed_out = num() != 0;
        let mut lat: Vec<u32> = it.filter_map(|v| v.parse().ok()).collect();
        lat.sort_unstable();
        Some(Phase {
            watchers: n,
            events,
            deliveries,
            bytes,
            wall: Duration::from_nanos(last_ns.saturating_sub(t0)),
            lat,
            ended,
            timed_out,
            pace,
            cpu: Some((p1 - p0, c1 - c0, w1 - w0)),
        })
    }

    async fn quit(mut self) {
        self.send("quit").await;
        let _ = tokio::time::timeout(Duration::from_secs(10), self.proc.wait()).await;
    }
}

/// Injects `events` objects of `payload` bytes, back to back or paced; returns the unix time
/// just before the first apply.
///
/// The applies run in a spawned task, as the proxy's reflector runs them: a task on a runtime
/// worker wakes the watchers' tasks into that worker's run queue (the other worker steals from
/// it), where the bench's main thread, outside the workers, would push every wake through the
/// runtime's shared injection queue and unpark a worker for it.
async fn inject(
    cache: &Arc<ResourceCache>,
    events: usize,
    payload: usize,
    pace: Option<Duration>,
) -> u64 {
    let cache = cache.clone();
    tokio::spawn(async move {
        let mut tick = pace.map(tokio::time::interval);
        let t0 = unix_ns();
        for _ in 0..events {
            if let Some(t) = tick.as_mut() {
                t.tick().await;
            }
            let o = object(cache.rv() + 1, unix_ns(), payload);
            cache.apply(EventKind::Modified, o);
        }
        t0
    })
    .await
    .unwrap()
}

/// The (b) client's HTTP/2 implementation.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wire {
    /// [`h2raw`]: frames parsed in place, the least client CPU.
    Raw,
    /// hyper's HTTP/2 client, as Rust controllers use it.
    Hyper,
}

impl Wire {
    fn name(self) -> &'static str {
        match self {
            Wire::Raw => "raw",
            Wire::Hyper => "hyper",
        }
    }
    fn label(self) -> &'static str {
        match self {
            Wire::Raw => "(b) HTTP/2, minimal client",
            Wire::Hyper => "(b) HTTP/2, hyper client",
        }
    }
}

#[derive(Default)]
struct HttpRun {
    idle_bytes_per_watcher: Option<f64>,
    idle_heap_per_watcher: Option<f64>,
    /// Highest heap while the streams were being opened, per stream (what opening them all
    /// at once needed in flight; the allocator keeps those pages after they are freed).
    open_peak_heap_per_watcher: Option<f64>,
    open_secs: f64,
    latency: Option<Phase>,
    isolated: Option<Phase>,
    burst: Option<Phase>,
    big: Option<Phase>,
    note: String,
}

async fn http_run(
    p: &Proxy,
    wire: Wire,
    n: usize,
    per_conn: usize,
    lat_events: usize,
    burst: usize,
    big: usize,
) -> HttpRun {
    let mut out = HttpRun::default();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r0 = rss_kib();
    let h0 = heap_live();
    HEAP_PEAK.store(h0, Ordering::Relaxed);
    let mut child = Child::spawn(p.addr, n, per_conn, p.cache.rv(), wire);
    // ready <opened> <not from cache> <failed> <secs>
    let Some(ready) = child.line(Duration::from_secs(120)).await else {
        out.note = format!("{n} streams: the client did not get ready");
        return out;
    };
    let f: Vec<f64> = ready
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let (opened, failed) = (
        f.first().copied().unwrap_or(0.0) as usize,
        f.get(2).copied().unwrap_or(0.0),
    );
    out.open_secs = f.get(3).copied().unwrap_or(0.0);
    let passed = p.passed.load(Ordering::Relaxed);
    if opened != n || failed > 0.0 || passed > 0 {
        out.note = format!(
            "{n} streams: {opened} opened, {failed} failed, {passed} passed through; {ready}"
        );
        child.quit().await;
        return out;
    }
    // Let the server side settle (connection buffers, first polls) before reading RSS.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r1 = rss_kib();
    out.idle_bytes_per_watcher = Some((r1.saturating_sub(r0) * 1024) as f64 / n as f64);
    out.idle_heap_per_watcher = Some(heap_live().saturating_sub(h0) as f64 / n as f64);
    out.open_peak_heap_per_watcher =
        Some(HEAP_PEAK.load(Ordering::Relaxed).saturating_sub(h0) as f64 / n as f64);
    let cache = p.cache.clone();
    let pay1k = payload_for(1024);
    let pace = Some(Duration::from_millis(100));
    out.latency = child
        .phase(n, lat_events, pace, async || {
            inject(&cache, lat_events, pay1k, pace).await
        })
        .await;
    // One event at a time with the system otherwise idle: one fan-out's own latency.
    let slow = Some(Duration::from_secs(1));
    let isolated = 5;
    if out.latency.is_some() {
        out.isolated = child
            .phase(n, isolated, slow, async || {
                inject(&cache, isolated, pay1k, slow).await
            })
            .await;
    }
    if out.isolated.is_some() {
        out.burst = child
            .phase(n, burst, None, async || {
                inject(&cache, burst, pay1k, None).await
            })
            .await;
    }
    if big > 0 && out.burst.is_some() {
        let pay1m = payload_for(1 << 20);
        out.big = child
            .phase(n, big, None, async || {
                inject(&cache, big, pay1m, None).await
            })
            .await;
    }
    child.quit().await;
    out
}

// --- the client process ---

/// Finds a line's send time in its first bytes and counts lines, without scanning for JSON.
#[derive(Default)]
struct LineScan {
    head: Vec<u8>,
    /// The current line's head has been read (its send time is known).
    head_done: bool,
    sent: u64,
}

const HEAD: usize = 400;

fn find_nl(d: &[u8]) -> Option<usize> {
    memchr::memchr(b'\n', d)
}

fn parse_sent(head: &[u8]) -> u64 {
    const KEY: &[u8] = b"\"kcp-bench/sent\":\"";
    let Some(i) = memchr::memmem::find(head, KEY) else {
        return 0;
    };
    head[i + KEY.len()..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .fold(0u64, |a, b| a * 10 + (b - b'0') as u64)
}

impl LineScan {
    /// Feeds one chunk; calls `line(sent_ns)` at the end of every line.
    fn feed(&mut self, mut d: &[u8], mut line: impl FnMut(u64)) {
        while !d.is_empty() {
            if !self.head_done {
                let take = (HEAD - self.head.len()).min(d.len());
                if self.head.is_empty() && take == HEAD {
                    // The whole head in this chunk: read it in place.
                    let head = &d[..HEAD];
                    if let Some(p) = find_nl(head) {
                        line(parse_sent(&head[..p]));
                        d = &d[p + 1..];
                    } else {
                        self.sent = parse_sent(head);
                        self.head_done = true;
                        d = &d[HEAD..];
                    }
                    continue;
                }
                if let Some(p) = find_nl(&d[..take]) {
                    self.head.extend_from_slice(&d[..p]);
                    line(parse_sent(&self.head));
                    self.head.clear();
                    d = &d[p + 1..];
                    continue;
                }
                self.head.extend_from_slice(&d[..take]);
                d = &d[take..];
                if self.head.len() == HEAD {
                    self.sent = parse_sent(&self.head);
                    self.head_done = true;
                }
            } else {
                match find_nl(d) {
                    Some(p) => {
                        line(self.sent);
                        self.head.clear();
                        self.head_done = false;
                        d = &d[p + 1..];
                    }
                    None => return,
                }
            }
        }
    }
}

struct Report {
    lat: Vec<u32>,
    delivered: u64,
    bytes: u64,
    last_ns: u64,
    ended: bool,
}

/// The hyper client's streams, `n` over `conns` connections.
async fn hyper_streams(
    addr: &str,
    n: usize,
    conns: usize,
    rv: u64,
    target: &Arc<AtomicU64>,
    rep_tx: &tokio::sync::mpsc::UnboundedSender<Report>,
    open_tx: &tokio::sync::mpsc::UnboundedSender<u8>,
) {
    let mut senders = Vec::new();
    for _ in 0..conns {
        let tcp = TcpStream::connect(addr)
            .await
            .expect("connect to the proxy");
        let _ = tcp.set_nodelay(true);
        let (send, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .initial_stream_window_size(2 << 20)
            .initial_connection_window_size(16 << 20)
            .handshake::<_, Empty<Bytes>>(TokioIo::new(tcp))
            .await
            .expect("h2c handshake");
        tokio::spawn(conn);
        senders.push(send);
    }
    let uri = format!("http://{addr}/api/v1/configmaps?watch=1&resourceVersion={rv}");
    let (first_tx, mut first_rx) = tokio::sync::mpsc::unbounded_channel::<u8>();
    // One watch stream's whole life: open, then read and report.
    let stream = |i: usize| {
        let mut send = senders[i % conns].clone();
        let (uri, target, rep_tx) = (uri.clone(), target.clone(), rep_tx.clone());
        let open_tx = if i == 0 {
            first_tx.clone()
        } else {
            open_tx.clone()
        };
        async move {
            // No credentials: the proxy serves this client as system:anonymous (a bearer
            // token would be reviewed by the fake upstream, which knows none).
            let req = Request::get(uri).body(Empty::new()).unwrap();
            let resp = match tokio::time::timeout(Duration::from_secs(60), async {
                send.ready().await?;
                send.send_request(req).await
            })
            .await
            {
                Ok(Ok(r)) if r.status().is_success() => r,
                _ => {
                    let _ = open_tx.send(2);
                    return;
                }
            };
            let _ = open_tx.send(0);
            let mut body = resp.into_body();
            let mut scan = LineScan::default();
            let (mut count, mut phase_start, mut bytes) = (0u64, 0u64, 0u64);
            let mut lat = Vec::new();
            loop {
                let f = match body.frame().await {
                    Some(Ok(f)) => f,
                    _ => break,
                };
                let Ok(d) = f.into_data() else { continue };
                let now = unix_ns();
                bytes += d.len() as u64;
                let mut done = false;
                scan.feed(&d, |sent| {
                    count += 1;
                    lat.push((now.saturating_sub(sent) / 1000).min(u32::MAX as u64) as u32);
                    if count == target.load(Ordering::Acquire) {
                        done = true;
                    }
                });
                if done {
                    let _ = rep_tx.send(Report {
                        lat: std::mem::take(&mut lat),
                        delivered: count - phase_start,
                        bytes,
                        last_ns: now,
                        ended: false,
                    });
                    phase_start = count;
                    bytes = 0;
                }
            }
            let _ = rep_tx.send(Report {
                lat,
                delivered: count - phase_start,
                bytes,
                last_ns: unix_ns(),
                ended: true,
            });
        }
    };
    // The first stream alone, so its access review is cached before the rest arrive.
    tokio::spawn(stream(0));
    if let Some(r) = first_rx.recv().await {
        let _ = open_tx.send(r);
    }
    // The others: one task per connection drives its streams (as one reader per connection
    // would), so the client's share of the CPUs, which the proxy competes with here, is not
    // spent scheduling a task per stream.
    let per_conn_streams: Vec<futures_util::stream::FuturesUnordered<_>> =
        (0..conns).map(|_| Default::default()).collect();
    for i in 1..n {
        per_conn_streams[i % conns].push(stream(i));
    }
    for mut streams in per_conn_streams {
        tokio::spawn(async move {
            use futures_util::StreamExt;
            while streams.next().await.is_some() {}
        });
    }
}

/// A minimal HTTP/2 client (RFC 9113, prior knowledge over TCP) for the bench's watch
/// streams: it opens GET streams, reads DATA, answers SETTINGS and PING, and returns flow
/// control credit. The client shares this machine's two cores with the proxy, so its own cost
/// is part of every (b) latency; this one parses frames in place with one task and one read
/// buffer per connection, where hyper's client runs a shared-state stream machine per DATA
/// frame. The hyper client is kept beside it (`KCP_FANOUT_WIRE=hyper`) as the real-client
/// reference.
mod h2raw {
    pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const END_STREAM: u8 = 0x1;
    pub const ACK: u8 = 0x1;
    pub const END_HEADERS: u8 = 0x4;
    pub const PADDED: u8 = 0x8;
    pub const PRIORITY: u8 = 0x20;
    /// Receive windows this client grants: per stream (as SETTINGS_INITIAL_WINDOW_SIZE) and
    /// for the connection; credit is returned once half of one is consumed.
    pub const STREAM_WINDOW: u32 = 2 << 20;
    pub const CONN_WINDOW: u32 = 16 << 20;
    const DEFAULT_WINDOW: u32 = 65_535;

    pub fn frame(out: &mut Vec<u8>, ty: u8, flags: u8, stream: u32, payload: &[u8]) {
        let len = payload.len() as u32;
        out.extend_from_slice(&len.to_be_bytes()[1..]);
        out.push(ty);
        out.push(flags);
        out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
        out.extend_from_slice(payload);
    }

    /// The connection's opening: preface, SETTINGS (no push, the stream window), and the
    /// connection window raised from its default.
    pub fn open(out: &mut Vec<u8>) {
        out.extend_from_slice(PREFACE);
        let mut s = Vec::new();
        for (id, v) in [(0x2u16, 0u32), (0x4, STREAM_WINDOW)] {
            s.extend_from_slice(&id.to_be_bytes());
            s.extend_from_slice(&v.to_be_bytes());
        }
        frame(out, SETTINGS, 0, 0, &s);
        window_update(out, 0, CONN_WINDOW - DEFAULT_WINDOW);
    }

    pub fn window_update(out: &mut Vec<u8>, stream: u32, inc: u32) {
        frame(out, 0x8, 0, stream, &(inc & 0x7fff_ffff).to_be_bytes());
    }

    /// HPACK integer with an `n`-bit prefix (RFC 7541 §5.1).
    fn int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
        let max = (1usize << n) - 1;
        if v < max {
            out.push(first | v as u8);
            return;
        }
        out.push(first | max as u8);
        v -= max;
        while v >= 128 {
            out.push((v % 128) as u8 | 0x80);
            v /= 128;
        }
        out.push(v as u8);
    }

    /// A literal header without indexing, its name from the static table, value not
    /// Huffman-coded.
    fn literal(out: &mut Vec<u8>, name_index: usize, value: &str) {
        int(out, 0x00, 4, name_index);
        int(out, 0x00, 7, value.len());
        out.extend_from_slice(value.as_bytes());
    }

    /// HEADERS of a GET without a body: `:method GET` and `:scheme http` are static-table
    /// entries 2 and 6, `:authority` and `:path` take names 1 and 4.
    pub fn get(out: &mut Vec<u8>, stream: u32, authority: &str, path: &str) {
        let mut h = vec![0x82, 0x86];
        literal(&mut h, 1, authority);
        literal(&mut h, 4, path);
        frame(out, HEADERS, END_STREAM | END_HEADERS, stream, &h);
    }

    /// A frame's payload without its padding (and, for HEADERS, its priority fields).
    pub fn body(ty: u8, flags: u8, p: &[u8]) -> Option<&[u8]> {
        let (mut p, pad) = if flags & PADDED != 0 {
            (p.get(1..)?, *p.first()? as usize)
        } else {
            (p, 0)
        };
        if ty == HEADERS && flags & PRIORITY != 0 {
            p = p.get(5..)?;
        }
        p.get(..p.len().checked_sub(pad)?)
    }

    /// Whether a response header block starts with `:status 200` (static entry 8, the form
    /// servers send it in), after any dynamic table size updates.
    pub fn is_200(block: &[u8]) -> bool {
        let mut i = 0;
        while let Some(b) = block.get(i) {
            if b & 0xe0 != 0x20 {
                return *b == 0x88;
            }
            i += 1;
            if b & 0x1f == 0x1f {
                while block.get(i).is_some_and(|b| b & 0x80 != 0) {
                    i += 1;
                }
                i += 1;
            }
        }
        false
    }
}

/// One watch stream's state in the raw client.
#[derive(Default)]
struct RawStream {
    /// Its response's HEADERS arrived.
    opened: bool,
    ended: bool,
    scan: LineScan,
    count: u64,
    phase_start: u64,
    bytes: u64,
    lat: Vec<u32>,
    unacked: u32,
}

impl RawStream {
    /// Reports what arrived since the last report (at `now`; `ended`: the stream is over).
    fn report(
        &mut self,
        rep_tx: &tokio::sync::mpsc::UnboundedSender<Report>,
        now: u64,
        ended: bool,
    ) {
        let _ = rep_tx.send(Report {
            lat: std::mem::take(&mut self.lat),
            delivered: self.count - self.phase_start,
            bytes: self.bytes,
            last_ns: now,
            ended,
        });
        self.phase_start = self.count;
        self.bytes = 0;
    }
}

/// What one connection of the raw client needs.
struct RawConn {
    addr: String,
    path: String,
    /// Streams to open on it.
    streams: usize,
    target: Arc<AtomicU64>,
    rep_tx: tokio::sync::mpsc::UnboundedSender<Report>,
    open_tx: tokio::sync::mpsc::UnboundedSender<u8>,
}

/// One connection of the raw client: opens `streams` watch streams on it and reads them
/// until the connection ends. With `gate`, the connection opens its first stream alone and
/// opens the rest only once that one answered (so the proxy's access review for this client
/// is cached before the others arrive) then signals the other connections.
async fn raw_conn(
    c: RawConn,
    gate: Option<tokio::sync::watch::Sender<bool>>,
    mut wait: tokio::sync::watch::Receiver<bool>,
) {
    let RawConn {
        addr,
        path,
        streams,
        target,
        rep_tx,
        open_tx,
    } = c;
    use h2raw::*;
    if gate.is_none() && wait.wait_for(|v| *v).await.is_err() {
        return;
    }
    let fail_all = |n: usize| {
        for _ in 0..n {
            let _ = open_tx.send(2);
        }
    };
    let Ok(mut tcp) = TcpStream::connect(&addr).await else {
        return fail_all(streams);
    };
    let _ = tcp.set_nodelay(true);
    let mut out = Vec::with_capacity(64 << 10);
    open(&mut out);
    let first = if gate.is_some() { 1 } else { streams };
    for i in 0..first {
        get(&mut out, 1 + 2 * i as u32, &addr, &path);
    }
    let mut gate = gate;
    let mut st: Vec<RawStream> = (0..streams).map(|_| RawStream::default()).collect();
    let mut buf = BytesMut::with_capacity(256 << 10);
    let mut conn_unacked = 0u32;
    'conn: loop {
        if !out.is_empty() {
            if tcp.write_all(&out).await.is_err() {
                break;
            }
            out.clear();
        }
        if buf.capacity() - buf.len() < 32 << 10 {
            buf.reserve(128 << 10);
        }
        match tcp.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let now = unix_ns();
        let target_now = target.load(Ordering::Acquire);
        let mut pos = 0;
        while buf.len() - pos >= 9 {
            let h = &buf[pos..pos + 9];
            let len = u32::from_be_bytes([0, h[0], h[1], h[2]]) as usize;
            if buf.len() - pos < 9 + len {
                break;
            }
            let (ty, flags) = (h[3], h[4]);
            let sid = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
            let payload = &buf[pos + 9..pos + 9 + len];
            pos += 9 + len;
            // Client streams are odd: stream 2i+1 is our i-th.
            let s = (sid % 2 == 1)
                .then(|| st.get_mut((sid / 2) as usize))
                .flatten();
            match (ty, s) {
                (RST_STREAM, Some(s)) if !s.opened => {
                    // Refused before it was answered.
                    s.opened = true;
                    s.ended = true;
                    let _ = open_tx.send(2);
                }
                (DATA, Some(s)) => {
                    conn_unacked += len as u32;
                    s.unacked += len as u32;
                    if s.unacked >= STREAM_WINDOW / 2 && flags & END_STREAM == 0 {
                        window_update(&mut out, sid, s.unacked);
                        s.unacked = 0;
                    }
                    let Some(d) = body(ty, flags, payload) else {
                        break 'conn;
                    };
                    s.bytes += d.len() as u64;
                    let mut done = false;
                    let (count, lat) = (&mut s.count, &mut s.lat);
                    s.scan.feed(d, |sent| {
                        *count += 1;
                        lat.push((now.saturating_sub(sent) / 1000).min(u32::MAX as u64) as u32);
                        if *count == target_now {
                            done = true;
                        }
                    });
                    if done {
                        s.report(&rep_tx, now, false);
                    }
                }
                (HEADERS, Some(s)) if !s.opened => {
                    s.opened = true;
                    let ok = body(ty, flags, payload).is_some_and(is_200);
                    let _ = open_tx.send(if ok { 0 } else { 2 });
                    if !ok {
                        s.ended = true;
                    }
                    if let Some(g) = gate.take() {
                        for i in 1..streams {
                            get(&mut out, 1 + 2 * i as u32, &addr, &path);
                        }
                        let _ = g.send(true);
                    }
                }
                (SETTINGS, _) if flags & ACK == 0 => frame(&mut out, SETTINGS, ACK, 0, &[]),
                (PING, _) if flags & ACK == 0 => frame(&mut out, PING, ACK, 0, payload),
                (GOAWAY, _) => break 'conn,
                _ => {}
            }
            // A stream ends with END_STREAM on its DATA or HEADERS, or a reset.
            if let Some(s) = (sid % 2 == 1)
                .then(|| st.get_mut((sid / 2) as usize))
                .flatten()
                && !s.ended
                && s.opened
                && ((matches!(ty, DATA | HEADERS) && flags & END_STREAM != 0) || ty == RST_STREAM)
            {
                s.ended = true;
                s.report(&rep_tx, now, true);
            }
        }
        let _ = buf.split_to(pos);
        if conn_unacked >= CONN_WINDOW / 2 {
            window_update(&mut out, 0, conn_unacked);
            conn_unacked = 0;
        }
    }
    // The connection ended: every stream still open ends with it.
    let mut unanswered = 0;
    for s in &mut st {
        if !s.opened {
            unanswered += 1;
        } else if !s.ended {
            s.report(&rep_tx, unix_ns(), true);
        }
    }
    fail_all(unanswered);
    if let Some(g) = gate {
        let _ = g.send(true);
    }
}

async fn client_main(addr: String) {
    let n = env("KCP_FANOUT_N", 1000) as usize;
    let per_conn = env("KCP_FANOUT_PER_CONN", 250).max(1) as usize;
    let rv = env("KCP_FANOUT_RV", 1);
    let started = Instant::now();
    let conns = n.div_ceil(per_conn);
    let target = Arc::new(AtomicU64::new(0));
    let (rep_tx, mut rep_rx) = tokio::sync::mpsc::unbounded_channel::<Report>();
    let (open_tx, mut open_rx) = tokio::sync::mpsc::unbounded_channel::<u8>();
    if std::env::var("KCP_FANOUT_WIRE").as_deref() == Ok("hyper") {
        hyper_streams(&addr, n, conns, rv, &target, &rep_tx, &open_tx).await;
    } else {
        let path = format!("/api/v1/configmaps?watch=1&resourceVersion={rv}");
        let (gate, wait) = tokio::sync::watch::channel(false);
        let mut gate = Some(gate);
        for c in 0..conns {
            let conn = RawConn {
                addr: addr.clone(),
                path: path.clone(),
                streams: (c..n).step_by(conns).count(),
                target: target.clone(),
                rep_tx: rep_tx.clone(),
                open_tx: open_tx.clone(),
            };
            tokio::spawn(raw_conn(conn, gate.take(), wait.clone()));
        }
    }
    drop((rep_tx, open_tx));
    let mut results = [0usize; 3];
    while results[0] + results[2] < n {
        match tokio::time::timeout(Duration::from_secs(90), open_rx.recv()).await {
            Ok(Some(r)) => results[r as usize] += 1,
            _ => break,
        }
    }
    println!(
        "ready {} {} {} {:.3}",
        results[0],
        results[1],
        results[2],
        started.elapsed().as_secs_f64()
    );
    let mut alive = results[0];
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(cmd)) = stdin.next_line().await {
        let Some(e) = cmd
            .strip_prefix("phase ")
            .and_then(|e| e.parse::<u64>().ok())
        else {
            break;
        };
        target.fetch_add(e, Ordering::AcqRel);
        println!("armed");
        let (mut reports, mut ended, mut deliveries, mut bytes, mut last) = (0, 0, 0, 0, 0);
        let mut lat: Vec<u32> = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        let mut timed_out = 0;
        while reports < alive {
            match tokio::time::timeout_at(deadline, rep_rx.recv()).await {
                Ok(Some(r)) => {
                    reports += 1;
                    if r.ended {
                        ended += 1;
                    }
                    deliveries += r.delivered;
                    bytes += r.bytes;
                    last = last.max(r.last_ns);
                    lat.extend(r.lat);
                }
                _ => {
                    timed_out = 1;
                    break;
                }
            }
        }
        alive -= ended;
        // Sampled to keep the line short: every k-th of the sorted latencies.
        lat.sort_unstable();
        let k = (lat.len() / 20_000).max(1);
        let mut line = format!("done {reports} {ended} {deliveries} {bytes} {last} {timed_out}");
        for (i, v) in lat.iter().enumerate() {
            if i % k == 0 || i + 1 == lat.len() {
                let _ = write!(line, " {v}");
            }
        }
        println!("{line}");
    }
    std::process::exit(0);
}

// ---------------------------------------------------------------------------------------------
// Ingest
// ---------------------------------------------------------------------------------------------

/// A ~4 KB pod as kube-apiserver writes it (managedFields included).
fn pod(i: usize, rv: u64) -> serde_json::Value {
    let ns = format!("team-{}", i % 37);
    let app = format!("svc-{}", i % 113);
    serde_json::json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {
            "name": format!("{app}-7d9f8c6b5-{i:05x}"), "generateName": format!("{app}-7d9f8c6b5-"),
            "namespace": ns, "uid": format!("6f1c2a7e-{:04x}-4b1e-9c3d-{:012x}", i % 65536, i),
            "resourceVersion": rv.to_string(), "creationTimestamp": "2025-11-02T10:15:30Z",
            "labels": {"app": app, "pod-template-hash": "7d9f8c6b5", "tier": "backend",
                       "app.kubernetes.io/part-of": "shop", "version": "v2"},
            "annotations": {"kubectl.kubernetes.io/restartedAt": "2025-11-02T10:15:00Z",
                            "prometheus.io/scrape": "true", "prometheus.io/port": "9090"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": format!("{app}-7d9f8c6b5"), "uid": "0c8f4d5e-1a2b-4c3d-8e9f-0a1b2c3d4e5f",
                "controller": true, "blockOwnerDeletion": true}],
            "managedFields": [
                {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                 "time": "2025-11-02T10:15:30Z", "fieldsType": "FieldsV1",
                 "fieldsV1": {"f:metadata": {"f:generateName": {}, "f:labels": {".": {}, "f:app": {},
                   "f:pod-template-hash": {}}, "f:ownerReferences": {".": {}, "k:{\"uid\":\"0c8f4d5e\"}": {}}},
                   "f:spec": {"f:containers": {"k:{\"name\":\"app\"}": {".": {}, "f:env": {}, "f:image": {},
                   "f:imagePullPolicy": {}, "f:name": {}, "f:ports": {}, "f:resources": {}}},
                   "f:dnsPolicy": {}, "f:restartPolicy": {}, "f:schedulerName": {}}}},
                {"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
                 "time": "2025-11-02T10:15:41Z", "fieldsType": "FieldsV1", "subresource": "status",
                 "fieldsV1": {"f:status": {"f:conditions": {}, "f:containerStatuses": {}, "f:hostIP": {},
                   "f:phase": {}, "f:podIP": {}, "f:podIPs": {}, "f:startTime": {}}}}
            ]
        },
        "spec": {
            "volumes": [{"name": "kube-api-access-x7k2p", "projected": {"sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}],
                "defaultMode": 420}}],
            "containers": [{
                "name": "app", "image": format!("registry.example.com/shop/{app}:v2.14.{}", i % 10),
                "ports": [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}],
                "env": [{"name": "LOG_LEVEL", "value": "info"}, {"name": "POD_NAME",
                        "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
                        {"name": "DB_URL", "value": "postgres://db.shop.svc:5432/shop"}],
                "resources": {"limits": {"cpu": "1", "memory": "512Mi"}, "requests": {"cpu": "250m", "memory": "256Mi"}},
                "volumeMounts": [{"name": "kube-api-access-x7k2p", "readOnly": true,
                                  "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                "livenessProbe": {"httpGet": {"path": "/healthz", "port": 8080, "scheme": "HTTP"},
                    "timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1, "failureThreshold": 3},
                "readinessProbe": {"httpGet": {"path": "/ready", "port": 8080, "scheme": "HTTP"},
                    "timeoutSeconds": 1, "periodSeconds": 5, "successThreshold": 1, "failureThreshold": 3},
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
                "imagePullPolicy": "IfNotPresent"}],
            "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default", "serviceAccount": "default",
            "nodeName": format!("node-{:03}", i % 211), "securityContext": {}, "schedulerName": "default-scheduler",
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
            "priority": 0, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority"
        },
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "PodReadyToStartContainers", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2025-11-02T10:15:33Z"},
                {"type": "Initialized", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2025-11-02T10:15:30Z"},
                {"type": "Ready", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2025-11-02T10:15:41Z"},
                {"type": "ContainersReady", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2025-11-02T10:15:41Z"},
                {"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": "2025-11-02T10:15:30Z"}],
            "hostIP": format!("10.0.{}.{}", i % 200, i % 250 + 1), "hostIPs": [{"ip": format!("10.0.{}.{}", i % 200, i % 250 + 1)}],
            "podIP": format!("10.244.{}.{}", i % 250, i % 253 + 1), "podIPs": [{"ip": format!("10.244.{}.{}", i % 250, i % 253 + 1)}],
            "startTime": "2025-11-02T10:15:30Z",
            "containerStatuses": [{"name": "app", "state": {"running": {"startedAt": "2025-11-02T10:15:40Z"}},
                "lastState": {}, "ready": true, "restartCount": 0,
                "image": format!("registry.example.com/shop/{app}:v2.14.{}", i % 10),
                "imageID": "registry.example.com/shop/app@sha256:3b1f4e8c2d7a9b0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c",
                "containerID": format!("containerd://{:064x}", i as u128 * 0x9e37_79b9_7f4a_7c15), "started": true,
                "volumeMounts": [{"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                                  "readOnly": true, "recursiveReadOnly": "Disabled"}]}],
            "qosClass": "Burstable"
        }
    })
}

struct Ingest {
    pod_bytes: usize,
    /// MB/s on one thread: parse_event_line (incl. CachedObject::parse).
    event_line: f64,
    /// MB/s: CachedObject::parse alone on the objects.
    object_parse: f64,
    /// MB/s: parse_list_page over 500-item pages.
    list_page: f64,
    /// MB/s: the cache's scanner skipping the same lines once (its structural limit).
    scan_skip: f64,
    /// MB/s: one serde_json pass skipping everything (the tokenizer's own limit).
    skip_only: f64,
}

/// Runs `f` over `items` repeatedly for about `secs`, bounded by `max_rounds`; MB/s.
fn rate<T>(items: &[T], bytes_of: impl Fn(&T) -> usize, secs: f64, mut f: impl FnMut(&T)) -> f64 {
    let per_round: usize = items.iter().map(&bytes_of).sum();
    let t = Instant::now();
    let mut rounds = 0u64;
    while t.elapsed().as_secs_f64() < secs && rounds < 100_000 {
        for i in items {
            f(i);
        }
        rounds += 1;
    }
    (per_round as f64 * rounds as f64) / t.elapsed().as_secs_f64() / 1e6
}

fn ingest() -> Ingest {
    use kube_cache_proxy::cache::reflector::{WatchItem, parse_event_line, parse_list_page};
    let pods = Resource::core("pods", "Pod", true);
    let objs: Vec<Bytes> = (0..2000)
        .map(|i| Bytes::from(pod(i, 1_000_000 + i as u64).to_string()))
        .collect();
    let pod_bytes = objs.iter().map(|o| o.len()).sum::<usize>() / objs.len();
    let mut stream = BytesMut::new();
    for o in &objs {
        stream.extend_from_slice(b"{\"type\":\"MODIFIED\",\"object\":");
        stream.extend_from_slice(o);
        stream.extend_from_slice(b"}\n");
    }
    let stream = stream.freeze();
    // Lines as the reflector's splitter hands them over: slices of the received buffer.
    let mut lines = Vec::new();
    let mut at = 0;
    while let Some(p) = stream[at..].iter().position(|b| *b == b'\n') {
        lines.push(stream.slice(at..at + p));
        at += p + 1;
    }
    let line_len = |l: &Bytes| l.len() + 1;
    let event_line = rate(&lines, line_len, 2.0, |l| {
        match parse_event_line(l, &pods) {
            Ok(WatchItem::Object(k, o)) => {
                black_box((k, o));
            }
            other => panic!("unexpected: {other:?}"),
        }
    });
    let object_parse = rate(
        &objs,
        |o| o.len(),
        1.5,
        |o| {
            black_box(CachedObject::parse(o.clone(), &pods).unwrap());
        },
    );
    let pages: Vec<Bytes> = objs
        .chunks(500)
        .map(|c| {
            let mut b = br#"{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"2000000","continue":"x","remainingItemCount":1},"items":["#.to_vec();
            for (i, o) in c.iter().enumerate() {
                if i > 0 {
                    b.push(b',');
                }
                b.extend_from_slice(o);
            }
            b.extend_from_slice(b"]}");
            Bytes::from(b)
        })
        .collect();
    let list_page = rate(
        &pages,
        |p| p.len(),
        1.5,
        |p| {
            black_box(parse_list_page(p, &pods).unwrap());
        },
    );
    let skip_only = rate(&lines, line_len, 1.0, |l| {
        black_box(serde_json::from_slice::<serde::de::IgnoredAny>(l).unwrap());
    });
    let scan_skip = rate(&lines, line_len, 1.0, |l| {
        let mut s = kube_cache_proxy::k8s::scan::Scanner::new(l);
        s.skip().unwrap();
        black_box(s.pos());
    });
    Ingest {
        pod_bytes,
        event_line,
        object_parse,
        list_page,
        skip_only,
        scan_skip,
    }
}

// ---------------------------------------------------------------------------------------------
// Loopback
// ---------------------------------------------------------------------------------------------

/// GB/s of `total` bytes over one 127.0.0.1 TCP connection, 1 MiB writes and reads.
async fn loopback(total: u64) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n as u64,
            }
        }
        (got, Instant::now())
    });
    let mut c = TcpStream::connect(addr).await.unwrap();
    let buf = vec![7u8; 1 << 20];
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        c.write_all(&buf).await.unwrap();
        sent += buf.len() as u64;
    }
    c.shutdown().await.unwrap();
    let (got, end) = server.await.unwrap();
    got as f64 / end.duration_since(t0).as_secs_f64() / 1e9
}

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

fn ok(pass: bool) -> &'static str {
    if pass { "yes" } else { "**no**" }
}

fn rows_for(
    level: &str,
    p: &Option<Phase>,
    lats: &[&Option<Phase>],
    n: usize,
    rows: &mut Vec<String>,
) {
    match p {
        Some(p) => {
            let r = p.per_sec();
            rows.push(format!(
                "| 1 KB event to {n} watchers, {level}: deliveries/s (burst of {} events{}) | {:.0}k/s | ≥ 250k/s | {} |",
                p.events,
                flags(p),
                r / 1e3,
                ok(r >= 250e3)
            ));
        }
        None => rows.push(format!(
            "| 1 KB event to {n} watchers, {level}: deliveries/s | not measured | ≥ 250k/s | - |"
        )),
    }
    for l in lats.iter().copied().flatten() {
        let pace = l.pace.unwrap_or_default();
        let p99 = pct_ms(&l.lat, 0.99);
        let target = if n >= 10_000 {
            "≤ 50 ms"
        } else {
            "(≤ 50 ms at 10k)"
        };
        rows.push(format!(
            "| 1 KB event to {n} watchers, {level}: delivery latency p50 / p99 / max ({} events, 1 per {} ms{}) | {:.2} / {:.2} / {:.2} ms | {target} | {} |",
            l.events,
            pace.as_millis(),
            flags(l),
            pct_ms(&l.lat, 0.5),
            p99,
            l.lat.last().map(|v| *v as f64 / 1e3).unwrap_or(f64::NAN),
            ok(p99 <= 50.0 && l.ended == 0 && !l.timed_out)
        ));
    }
}

/// Where (b)'s CPU went during a phase, and the proxy's socket writes per delivery.
fn cpu_note(n: usize, wire: Wire, what: &str, p: &Option<Phase>) -> Option<String> {
    let p = p.as_ref()?;
    let (proxy, client, writes) = p.cpu?;
    let wall = p.wall.as_secs_f64();
    Some(format!(
        "- {} {n} streams, {what}: wall {wall:.2} s; CPU proxy process {proxy:.2} s, client process {client:.2} s; proxy socket writes {writes} ({:.3} per delivery)",
        wire.label(),
        writes as f64 / p.deliveries.max(1) as f64
    ))
}

fn flags(p: &Phase) -> String {
    let mut s = String::new();
    if p.ended > 0 {
        let _ = write!(s, "; {} watchers ended early", p.ended);
    }
    if p.timed_out {
        s.push_str("; TIMED OUT");
    }
    let expected = (p.watchers * p.events) as u64;
    if p.deliveries != expected {
        let _ = write!(s, "; {} of {expected} delivered", p.deliveries);
    }
    s
}

#[tokio::main]
async fn main() {
    // Proxy and client alike, as the binary does: a subscriber at warn, so the libraries' trace spans are filtered
    // out at their call sites (without one, every span takes tracing's `log` fallback).
    kube_cache_proxy::app::cli::init_logging(
        "warn",
        kube_cache_proxy::config::LogFormat::Text,
        std::time::Duration::ZERO,
    );
    if let Ok(addr) = std::env::var("KCP_FANOUT_CLIENT") {
        return client_main(addr).await;
    }
    let started = Instant::now();
    let http = env("KCP_FANOUT_HTTP", 1) != 0;
    let http_max = env("KCP_FANOUT_HTTP_MAX", 10_000) as usize;
    let per_conn = env("KCP_FANOUT_PER_CONN", 250) as usize;
    let lat_events = env("KCP_FANOUT_LAT_EVENTS", 30) as usize;
    let pace = Duration::from_millis(100);
    let threads = tokio::runtime::Handle::current().metrics().num_workers();
    eprintln!("fanout: {threads} runtime worker threads");
    if env("KCP_FANOUT_INGEST_ONLY", 0) != 0 {
        let i = tokio::task::spawn_blocking(ingest).await.unwrap();
        println!(
            "ingest MB/s, one thread, ~{} B pod events: event line {:.0}, object {:.0}, list page {:.0}, serde skip {:.0}, scanner skip {:.0}",
            i.pod_bytes, i.event_line, i.object_parse, i.list_page, i.skip_only, i.scan_skip
        );
        return;
    }

    // Memory first, while the heap holds nothing freed that new watchers could reuse.
    let (sub_b, task_b, idle_tasks) = inproc_idle(10_000).await;
    eprintln!("fanout: in-process idle: {sub_b:.0} B/subscription, {task_b:.0} B with a task");

    let mut notes = Vec::new();
    let mut http_runs: Vec<(usize, Wire, HttpRun)> = Vec::new();
    // Which clients (b) runs, each over both sizes: the minimal one first (its run measures
    // the proxy's memory), then hyper's.
    let wires: Vec<Wire> = std::env::var("KCP_FANOUT_WIRES")
        .unwrap_or_else(|_| "raw,hyper".into())
        .split(',')
        .filter_map(|w| match w.trim() {
            "raw" => Some(Wire::Raw),
            "hyper" => Some(Wire::Hyper),
            _ => None,
        })
        .collect();
    let proxy = if http { start_proxy().await } else { None };
    if http && proxy.is_none() {
        notes
            .push("(b) skipped: the proxy did not start in front of the fake upstream".to_string());
    }
    if let Some(p) = &proxy {
        // 10k first, while the in-process idle watchers still hold their memory.
        let mut ns = vec![10_000usize, 1_000];
        ns.retain(|n| *n <= http_max);
        for n in ns {
            for &wire in &wires {
                let (burst, big) = if n >= 10_000 { (100, 0) } else { (500, 3) };
                eprintln!("fanout: (b) {n} HTTP watch streams, {} ...", wire.name());
                let r = http_run(p, wire, n, per_conn, lat_events, burst, big).await;
                if !r.note.is_empty() {
                    notes.push(format!("{}: {}", wire.label(), r.note));
                }
                eprintln!(
                    "fanout: (b) {n} done ({:.0}s total)",
                    started.elapsed().as_secs_f64()
                );
                http_runs.push((n, wire, r));
            }
        }
    }
    for t in idle_tasks {
        t.abort();
    }

    eprintln!("fanout: (a) in-process ...");
    let a_lat_1k = inproc_phase(1_000, lat_events, 1024, Some(pace)).await;
    let a_burst_1k = inproc_phase(1_000, 1_000, 1024, None).await;
    let a_lat_10k = inproc_phase(10_000, lat_events, 1024, Some(pace)).await;
    let a_burst_10k = inproc_phase(10_000, 200, 1024, None).await;
    let a_big = inproc_phase(1_000, 5, 1 << 20, None).await;

    eprintln!("fanout: ingest ...");
    let ing = tokio::task::spawn_blocking(ingest).await.unwrap();
    eprintln!("fanout: loopback ...");
    let lo = loopback(1 << 30).await;

    let mut rows = Vec::new();
    rows_for(
        "(a) in-process",
        &Some(a_burst_1k),
        &[&Some(a_lat_1k)],
        1_000,
        &mut rows,
    );
    rows_for(
        "(a) in-process",
        &Some(a_burst_10k),
        &[&Some(a_lat_10k)],
        10_000,
        &mut rows,
    );
    for (n, wire, r) in &http_runs {
        rows_for(
            wire.label(),
            &r.burst,
            &[&r.latency, &r.isolated],
            *n,
            &mut rows,
        );
        for (what, p) in [
            ("paced 1 KB", &r.latency),
            ("isolated 1 KB", &r.isolated),
            ("burst 1 KB", &r.burst),
            ("burst 1 MB", &r.big),
        ] {
            notes.extend(cpu_note(*n, *wire, what, p));
        }
    }
    let gb = a_big.gb_per_sec();
    rows.push(format!(
        "| 1 MB object to 1000 watchers, (a) in-process incl. the writer's per-watcher copy: GB/s ({} events{}) | {gb:.2} GB/s | ≥ 0.65 GB/s | {} |",
        a_big.events,
        flags(&a_big),
        ok(gb >= 0.65)
    ));
    for (n, wire, r) in &http_runs {
        if let Some(b) = &r.big {
            let gb = b.gb_per_sec();
            rows.push(format!(
                "| 1 MB object to {n} watchers, {}: GB/s read by the clients ({} events{}) | {gb:.2} GB/s | ≥ 0.65 GB/s | {} |",
                wire.label(),
                b.events,
                flags(b),
                ok(gb >= 0.65)
            ));
        }
    }
    rows.push(format!(
        "| memory per idle watcher, (a) subscription only (10,000) | {:.0} B | ≤ 4 KB | {} |",
        sub_b,
        ok(sub_b <= 4096.0)
    ));
    rows.push(format!(
        "| memory per idle watcher, (a) subscription + parked task (10,000) | {:.0} B | ≤ 4 KB | {} |",
        task_b,
        ok(task_b <= 4096.0)
    ));
    // Only the first run's: later runs reuse heap the earlier ones freed.
    for (n, wire, r) in http_runs.iter().take(1) {
        if let Some(b) = r.idle_bytes_per_watcher {
            rows.push(format!(
                "| memory per idle watcher, {} watch stream, proxy process RSS ({n} streams on {} connections, opened in {:.2} s) | {:.0} B | ≤ 4 KB | {} |",
                wire.label(),
                n.div_ceil(per_conn),
                r.open_secs,
                b,
                ok(b <= 4096.0)
            ));
        }
    }
    for (n, wire, r) in &http_runs {
        if let Some(b) = r.idle_heap_per_watcher {
            rows.push(format!(
                "| memory per idle watcher, {} watch stream, proxy heap allocated and not freed ({n} streams) | {b:.0} B | ≤ 4 KB | {} |",
                wire.label(),
                ok(b <= 4096.0)
            ));
        }
        if let Some(b) = r.open_peak_heap_per_watcher {
            rows.push(format!(
                "| reference: proxy heap at its peak while the {n} streams were opened, per stream | {b:.0} B | - | - |"
            ));
        }
    }
    rows.push(format!(
        "| ingest: parse_event_line + CachedObject::parse, ~{:.1} KB pod events, one thread | {:.0} MB/s | ≥ 1000 MB/s per core | {} |",
        ing.pod_bytes as f64 / 1e3,
        ing.event_line,
        ok(ing.event_line >= 1000.0)
    ));
    rows.push(format!(
        "| ingest: CachedObject::parse alone (object bytes) | {:.0} MB/s | - | - |",
        ing.object_parse
    ));
    rows.push(format!(
        "| ingest: parse_list_page, 500-pod pages | {:.0} MB/s | - | - |",
        ing.list_page
    ));
    rows.push(format!(
        "| reference: serde_json skipping the same lines once (IgnoredAny) | {:.0} MB/s | - | - |",
        ing.skip_only
    ));
    rows.push(format!(
        "| reference: the cache's scanner skipping the same lines once | {:.0} MB/s | - | - |",
        ing.scan_skip
    ));
    rows.push(format!(
        "| reference: loopback TCP, 1 GiB over one 127.0.0.1 connection, 1 MiB writes | {lo:.2} GB/s | - | - |"
    ));

    println!();
    println!(
        "kube-cache-proxy fan-out MICRO-BENCHMARK (in-process events, a fake upstream, plain h2c: not the real path; `loadtest` measures that, TLS and a real kube-apiserver side by side): {} CPUs, {threads} runtime threads; (b) client in a child process on the same CPUs, h2c, {per_conn} streams per connection",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0)
    );
    println!();
    println!("| measure | result | target | meets |");
    println!("|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    if !notes.is_empty() {
        println!();
    }
    for n in notes {
        println!("{n}");
    }
    println!("\ntotal {:.0} s", started.elapsed().as_secs_f64());
    if let Some(p) = proxy {
        p.running.begin_shutdown();
    }
}
