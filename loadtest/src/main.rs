//! Load driver: kube-cache-proxy and kube-apiserver side by side, on one machine, in one run.
//!
//! Starts a real etcd + kube-apiserver (`kube_cache_proxy::app::dev`, built from source and
//! cached), seeds ConfigMaps, and runs each scenario twice: straight against the apiserver, then
//! through the proxy (a child process, restarted per scenario, see `proxy.rs`). Writes always go
//! straight to the apiserver. Every phase records the CPU and RSS of the proxy, kube-apiserver,
//! etcd and this driver (`/proc/PID/stat`, `/proc/PID/status`), and the apiserver's own request
//! counters (`apiserver_request_total`, `apiserver_longrunning_requests` from its `/metrics`).
//!
//! ```text
//! cargo run --release -p loadtest -- --profile default   # < 10 min on 2 cores
//! cargo run --release -p loadtest -- --profile smoke     # < 1 min (the test suite runs it)
//! cargo run --release -p loadtest -- --kubeconfig direct.kubeconfig \
//!     --proxy-kubeconfig proxy.kubeconfig                 # an existing cluster and proxy
//! ```
//!
//! Results: `<out>/<profile>-<UTC time>.{json,md,svg}`, `--out` defaulting to
//! `$XDG_CACHE_HOME/kube-cache-proxy/loadtest` (`~/.cache/...`), outside the source tree.
//! `--publish` writes them to `loadtest/results/` instead and refreshes the headline block of
//! `loadtest/README.md` (the checked-in figures). Exit status 1 when a correctness check fails
//! (missed or duplicated watch events, wrong object counts, errors, or the proxy opening more
//! than one upstream LIST+WATCH in the informer storm).

/// Progress on stderr, with seconds since the driver started.
macro_rules! say {
    ($($arg:tt)*) => {
        eprintln!("loadtest [{:>5.1}s] {}", crate::STARTED.get_or_init(std::time::Instant::now).elapsed().as_secs_f64(), format!($($arg)*))
    };
}

static STARTED: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();

/// The allocator of the `kube-cache-proxy` binary (`src/main.rs`): the proxy child is this
/// binary (`serve-proxy`), and must run as the real one does. Feature `system-alloc` leaves
/// the system's malloc in place instead, for heap profilers that interpose it (heaptrack)
/// and to compare allocators (`loadtest/README.md`, idle-streams).
#[cfg(not(any(feature = "system-alloc", feature = "count-alloc")))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Feature `count-alloc`: mimalloc, with the bytes allocated counted (now, and the most since
/// last read), for the proxy child's heap over time (`alloc_trace`).
#[cfg(all(feature = "count-alloc", not(feature = "system-alloc")))]
#[global_allocator]
static ALLOCATOR: alloc_trace::Counting = alloc_trace::Counting;

#[cfg(feature = "count-alloc")]
mod alloc_trace;

/// As the binary's: mimalloc's collection of the calling thread's heap, for the proxy
/// child's idle runtime threads (`kube_cache_proxy::app::memory::runtime`).
#[cfg(not(feature = "system-alloc"))]
fn release_idle_memory() {
    // SAFETY: `mi_collect` has no preconditions: it only frees what the calling thread's
    // heap no longer uses and may be called from any thread at any time.
    unsafe { libmimalloc_sys::mi_collect(false) }
}

/// The system's malloc has no such call.
#[cfg(feature = "system-alloc")]
fn release_idle_memory() {}

/// As the binary's: mimalloc's purge delay (`kube_cache_proxy::app::memory::purge_delay_ms`).
#[cfg(not(feature = "system-alloc"))]
fn configure_allocator() {
    /// mimalloc's `mi_option_purge_delay` (`libmimalloc-sys` does not name it).
    const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    if let Some(ms) = kube_cache_proxy::app::memory::purge_delay_ms() {
        // SAFETY: setting an option has no preconditions.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, ms as _) }
    }
}

#[cfg(feature = "system-alloc")]
fn configure_allocator() {}

mod client;
mod cluster;
mod fields;
mod hostile;
mod idle;
mod ingest;
mod pb;
mod proxy;
mod report;
mod scenarios;
mod slow;
mod stats;
mod sweep;
mod table;
mod warm;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use clap::Parser;
use http::Method;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use serde::Serialize;

use crate::client::{Conn, Target, fetch};
use crate::fields::{FieldsOpts, FieldsResult};
use crate::proxy::{ProxyChild, ProxyFiles, ServedBy, served};
use crate::scenarios::{
    Churned, Encoding, FanoutOpts, FanoutResult, GetKind, GetResult, ListResult, StartMode,
    StormResult, create_configmaps, create_namespace,
};
use crate::stats::{ApiCounts, ProcUsage, Sampler};
use crate::sweep::FanoutPhase;

#[derive(Debug, Parser)]
#[command(
    name = "loadtest",
    about = "kube-cache-proxy vs kube-apiserver load driver"
)]
struct Args {
    /// `smoke` (under a minute) or `default` (under ten minutes on 2 cores).
    #[arg(long, default_value = "default")]
    profile: String,
    /// Where results go (default: $XDG_CACHE_HOME/kube-cache-proxy/loadtest, else
    /// ~/.cache/kube-cache-proxy/loadtest).
    #[arg(long, conflicts_with = "publish")]
    out: Option<PathBuf>,
    /// Publish a `default` run: results into loadtest/results/ (checked in) and the headline
    /// block of loadtest/README.md rewritten.
    #[arg(long)]
    publish: bool,
    /// Measure an existing cluster instead of a local control plane: this kubeconfig reaches
    /// kube-apiserver directly (a bearer token and a CA; the user creates and deletes
    /// namespaces `lt-*` and ConfigMaps in them)...
    #[arg(long, requires = "proxy_kubeconfig")]
    kubeconfig: Option<PathBuf>,
    /// ...and this one the kube-cache-proxy in front of it (already running; the driver does
    /// not start or stop it, so scenario b, which counts a fresh proxy's upstream LISTs, is
    /// left out).
    #[arg(long, requires = "kubeconfig")]
    proxy_kubeconfig: Option<PathBuf>,
    /// Kubeconfig context of both (default: each file's current context).
    #[arg(long, requires = "kubeconfig")]
    context: Option<String>,
    /// Run this `kube-cache-proxy` binary (`serve`) instead of this driver's own copy.
    #[arg(long)]
    proxy_bin: Option<PathBuf>,
    /// Scenarios to run, e.g. `a,b` (default: all).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Overrides: scenario a watchers, streams per HTTP/2 connection, writes per second (a
    /// list, e.g. `10,25,50`: one phase per side each, in increasing order up to the first
    /// that misses p99 ≤ 50 ms or misses an event; the highest within is the capacity).
    #[arg(long)]
    watchers: Option<usize>,
    #[arg(long)]
    streams_per_conn: Option<usize>,
    #[arg(long, value_delimiter = ',')]
    churn_rate: Vec<f64>,
    /// Override: scenario b clients.
    #[arg(long)]
    clients: Option<usize>,
    /// Override: scenario f watchers (half of them filtered in its last phase).
    #[arg(long)]
    field_watchers: Option<usize>,
    /// Override: scenario c objects.
    #[arg(long)]
    list_objects: Option<usize>,
    /// Scenario warm-restart (run alone: `--only warm-restart`): ConfigMaps seeded (1 KB).
    #[arg(long, default_value_t = 100_000)]
    warm_objects: usize,
    /// Scenario ingest (run alone: `--only ingest`): ConfigMaps seeded...
    #[arg(long, default_value_t = 20_000)]
    ingest_objects: usize,
    /// ...of this many KiB each.
    #[arg(long, default_value_t = 10)]
    ingest_kib: usize,
    /// Scenario fields-attack (run alone: `--only fields-attack`): watchers of the select
    /// phases (each with a distinct 32-path filter in the distinct phase)...
    #[arg(long, default_value_t = 6000)]
    fa_watchers: usize,
    /// ...seconds of writes per phase.
    #[arg(long, default_value_t = 20.0)]
    fa_secs: f64,
    /// Scenario hostile-streams (run alone: `--only hostile-streams`): connections...
    #[arg(long, default_value_t = 10)]
    hs_conns: usize,
    /// ...watch streams per connection (a server allowing fewer gets what it allows)...
    #[arg(long, default_value_t = 1000)]
    hs_streams: usize,
    /// ...KB of ConfigMaps in the watched namespace (5 KB objects)...
    #[arg(long, default_value_t = 250)]
    hs_kb: usize,
    /// ...seconds the streams are held (the normal client's GETs run meanwhile)...
    #[arg(long, default_value_t = 15.0)]
    hs_hold: f64,
    /// ...seconds after closing them that RSS is read...
    #[arg(long, default_value_t = 10.0)]
    hs_after: f64,
    /// ...and MB of one LIST page timed afterwards (0: none).
    #[arg(long, default_value_t = 10)]
    hs_list_mb: usize,
    /// Scenario idle-streams (run alone: `--only idle-streams`): watch streams...
    #[arg(long, default_value_t = 10_000)]
    is_streams: usize,
    /// ...per HTTP/2 connection...
    #[arg(long, default_value_t = 100)]
    is_per_conn: usize,
    /// ...seconds the target settles once all are open, before its RSS is read...
    #[arg(long, default_value_t = 10.0)]
    is_settle: f64,
    /// ...seconds after closing them that RSS is read again...
    #[arg(long, default_value_t = 10.0)]
    is_after: f64,
    /// ...and connections opening their streams at once.
    #[arg(long, default_value_t = 8)]
    is_opening: usize,
    /// Scenario slow-watcher (run alone: `--only slow-watcher`): normal watchers...
    #[arg(long, default_value_t = 100)]
    sw_watchers: usize,
    /// ...writes per second of the burst...
    #[arg(long, default_value_t = 50.0)]
    sw_rate: f64,
    /// ...its seconds...
    #[arg(long, default_value_t = 10.0)]
    sw_secs: f64,
    /// ...and each write's size in KiB; `--sw-no-slow` runs it without the slow watcher
    /// (the baseline of the normal watchers' latency).
    #[arg(long, default_value_t = 16)]
    sw_kib: usize,
    #[arg(long)]
    sw_no_slow: bool,
    /// Scenarios pb-fanout and pb-list (run alone: `--only pb-fanout`, `--only pb-list`):
    /// protobuf watchers of the fan-out...
    #[arg(long, default_value_t = 10_000)]
    pb_watchers: usize,
    /// ...streams per HTTP/2 connection...
    #[arg(long, default_value_t = 100)]
    pb_streams_per_conn: usize,
    /// ...writes per second, one phase per side each (e.g. `5,10,25,50`: the highest with
    /// p99 ≤ 50 ms is reported as the capacity)...
    #[arg(long, value_delimiter = ',', default_value = "10")]
    pb_rates: Vec<f64>,
    /// ...seconds of writes per phase...
    #[arg(long, default_value_t = 10.0)]
    pb_secs: f64,
    /// ...pods of 1 KB the list walks (one namespace)...
    #[arg(long, default_value_t = 100_000)]
    pb_pods: usize,
    /// ...and list walkers in parallel (`limit=500`).
    #[arg(long, default_value_t = 4)]
    pb_walkers: usize,
    /// Scenario table-list (run alone: `--only table-list`): pods listed by
    /// `kubectl get pods -A` (a Table)...
    #[arg(long, default_value_t = 100_000)]
    table_pods: usize,
    /// ...and timed runs per side.
    #[arg(long, default_value_t = 20)]
    table_runs: usize,
    /// Scenario cluster (run alone: `--only cluster`; both sides, each on its own control
    /// plane): the large size (2,000 nodes × 2 agents, 200 Deployments, 60,000 pods; the
    /// size flags below override its parts)...
    #[arg(long)]
    large: bool,
    /// ...simulated nodes (KWOK; default 100)...
    #[arg(long)]
    cluster_nodes: Option<usize>,
    /// ...DaemonSet-like agents per node (each with its own ServiceAccount token; default 2)...
    #[arg(long)]
    cluster_agents_per_node: Option<usize>,
    /// ...Deployments (default 20)...
    #[arg(long)]
    cluster_deployments: Option<usize>,
    /// ...pods in all (replicas per Deployment: this over the Deployments; default 1,000)...
    #[arg(long)]
    cluster_pods: Option<usize>,
    /// ...a third side: the proxy with this YAML added to its configuration too (e.g.
    /// `authorization: {localRbac: "off"}`), on a control plane of its own, in the same run...
    #[arg(long)]
    also_proxy_config: Option<String>,
    /// ...without the proxy's rolling-restart phases...
    #[arg(long)]
    cluster_no_rolling_restart: bool,
    /// ...Node annotation writes per second (the agents' latency probes)...
    #[arg(long, default_value_t = 2.0)]
    cluster_probe_rate: f64,
    /// ...seconds each phase may take to converge...
    #[arg(long, default_value_t = 300.0)]
    cluster_timeout: f64,
    /// ...and seconds the apiserver-restart phase measures from the new apiserver's
    /// readiness.
    #[arg(long, default_value_t = 60.0)]
    cluster_restart_window: f64,
    /// ...kube-controller-manager and kube-scheduler from this directory instead of
    /// `tests/e2e/build-control-plane.sh conformance`'s (which also builds e2e.test).
    #[arg(long)]
    cluster_k8s_bin: Option<PathBuf>,
    /// YAML appended to the proxy child's configuration file (e.g. `server: {...}`), to
    /// compare settings in one run.
    #[arg(long)]
    proxy_extra_config: Option<String>,
}

/// Sizes of one profile.
#[derive(Debug, Clone, Serialize)]
pub struct Profile {
    pub name: String,
    pub a: FanoutOpts,
    /// Scenario a's write rates (`a.rate` is each in turn).
    pub a_rates: Vec<f64>,
    pub b_clients: usize,
    pub b_objects: usize,
    pub c_objects: usize,
    pub c_clients: usize,
    pub c_walks: usize,
    pub c_limit: usize,
    pub d_objects: usize,
    pub d_rate: f64,
    pub d_secs: f64,
    pub e_secs: f64,
    pub e_watchers: usize,
    pub e_churn_rate: f64,
    pub e_get_rate: f64,
    pub e_list_clients: usize,
    pub e_list_limit: usize,
    pub f: FieldsOpts,
    pub loopback_bytes: u64,
}

impl Profile {
    fn named(name: &str) -> anyhow::Result<Profile> {
        let f = |watchers, streams_per_conn, rate, spec_every, duration_s| FieldsOpts {
            namespace: "lt-f".into(),
            watchers,
            streams_per_conn,
            rate,
            spec_every,
            objects: 10,
            duration_s,
        };
        let a = |watchers, streams_per_conn, rate, objects, duration_s| FanoutOpts {
            churned: Churned::ConfigMaps,
            encoding: Encoding::Json,
            namespace: "lt-a".into(),
            watchers,
            streams_per_conn,
            rate,
            objects,
            duration_s,
            pad: 0,
        };
        // Cluster-wide ConfigMaps stay under one page of the proxy's upstream list (500) until
        // scenario c creates its set, so the storm's "one upstream LIST" is one request.
        match name {
            "smoke" => Ok(Profile {
                name: name.into(),
                a: a(20, 10, 10.0, 10, 1.5),
                a_rates: vec![10.0, 20.0],
                b_clients: 10,
                b_objects: 30,
                c_objects: 1_000,
                c_clients: 2,
                c_walks: 1,
                c_limit: 500,
                d_objects: 10,
                d_rate: 50.0,
                d_secs: 1.5,
                e_secs: 3.0,
                e_watchers: 10,
                e_churn_rate: 10.0,
                e_get_rate: 25.0,
                e_list_clients: 1,
                e_list_limit: 10,
                f: f(20, 10, 20.0, 5, 2.0),
                loopback_bytes: 256 << 20,
            }),
            "default" => Ok(Profile {
                name: name.into(),
                // The issue's P1: 10,000 watchers, 100 per connection.
                a: a(10_000, 100, 5.0, 50, 10.0),
                a_rates: vec![5.0, 10.0, 25.0, 50.0, 100.0],
                b_clients: 200,
                b_objects: 300,
                c_objects: 100_000,
                c_clients: 4,
                c_walks: 1,
                c_limit: 500,
                d_objects: 50,
                d_rate: 200.0,
                d_secs: 15.0,
                e_secs: 30.0,
                e_watchers: 250,
                e_churn_rate: 25.0,
                e_get_rate: 100.0,
                e_list_clients: 2,
                e_list_limit: 100,
                // 10,000 watchers, 20 status writes and 1 spec write per second.
                f: f(10_000, 100, 21.0, 21, 10.0),
                loopback_bytes: 2 << 30,
            }),
            other => anyhow::bail!("unknown profile {other:?} (smoke, default)"),
        }
    }
}

/// CPU, memory and apiserver counters of one phase.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub wall_s: f64,
    pub procs: Vec<ProcUsage>,
    /// `apiserver_request_total{resource="configmaps"}` during the phase, by verb.
    pub configmaps_requests: BTreeMap<String, u64>,
    /// `apiserver_request_total` over all resources during the phase.
    pub all_requests: u64,
    /// Access reviews (`selfsubjectaccessreviews`, `subjectaccessreviews`) during the phase.
    pub access_reviews: u64,
}

impl Usage {
    /// The usage of process `name` (`proxy`, `kube-apiserver`, `etcd`, `driver`).
    pub fn proc(&self, name: &str) -> Option<&ProcUsage> {
        self.procs.iter().find(|p| p.name == name)
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Row<T> {
    pub side: &'static str,
    pub result: T,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize)]
pub struct StormRow {
    pub side: &'static str,
    pub mode: StartMode,
    pub result: StormResult,
    pub usage: Usage,
    /// Upstream LIST requests for configmaps (proxy side: counted from before the proxy
    /// started, so its own initial list is included).
    pub upstream_lists: u64,
    /// Upstream configmaps watches open with every client synced, minus those open before.
    pub upstream_watches_opened: i64,
}

/// One phase of scenario d.
#[derive(Debug, Clone, Serialize)]
pub struct GetRow {
    pub side: &'static str,
    /// The proxy's `lists.consistency` (`bounded`, its default, or `strict`; `as configured`
    /// for an existing cluster's proxy); `-` on the apiserver.
    pub consistency: &'static str,
    pub result: GetResult,
    pub usage: Usage,
    /// The proxy's GETs of the phase's resource, by what served them.
    pub served: ServedBy,
    /// `kube_cache_proxy_consistency_probes_total` during the phase: the upstream
    /// current-revision probes of `strict`.
    pub probes: u64,
    /// For passed-through GETs on the proxy's side: the proxy's own account of them.
    pub proxy_split: Option<ProxySplit>,
}

/// The proxy's own account of the GETs a phase passed through, from its metrics: the mean of
/// `kube_cache_proxy_request_duration_seconds{served_by="upstream"}` (its request, from
/// reading the request to the end of the response body) and of
/// `kube_cache_proxy_upstream_request_duration_seconds` (its upstream round trip, to the
/// apiserver's response head). Against the driver's own means they split the proxy's added
/// latency into the client's leg, the proxy's own work and its upstream round trip.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct ProxySplit {
    pub requests: u64,
    pub request_mean_ms: f64,
    pub upstream_mean_ms: f64,
}

impl ProxySplit {
    /// The sums and counts of both histograms for `resource`'s GETs in a `/metrics` text.
    fn read(text: &str, resource: &str) -> [f64; 4] {
        let (res, verb) = (format!("resource=\"{resource}\""), "verb=\"GET\"");
        let req = |part: &str| {
            stats::sum(
                text,
                &format!("kube_cache_proxy_request_duration_seconds_{part}"),
                &[&res, verb, "served_by=\"upstream\""],
            )
        };
        let up = |part: &str| {
            stats::sum(
                text,
                &format!("kube_cache_proxy_upstream_request_duration_seconds_{part}"),
                &[&res, verb],
            )
        };
        [req("sum"), req("count"), up("sum"), up("count")]
    }

    /// The means between two readings; `None` when nothing was passed through in between.
    fn between(before: [f64; 4], after: [f64; 4]) -> Option<ProxySplit> {
        let d: Vec<f64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        (d[1] >= 1.0 && d[3] >= 1.0).then(|| ProxySplit {
            requests: d[1] as u64,
            request_mean_ms: d[0] / d[1] * 1000.0,
            upstream_mean_ms: d[2] / d[3] * 1000.0,
        })
    }
}

impl GetRow {
    /// The row's name in reports: the kind, and on the proxy's side for unset-resourceVersion
    /// reads the consistency mode that served them.
    pub fn label(&self) -> String {
        match (self.result.kind, self.side) {
            (GetKind::Quorum, "proxy") => format!("quorum, {}", self.consistency),
            (GetKind::Passthrough, _) => {
                format!("passthrough ({})", GetKind::Passthrough.resource())
            }
            (k, _) => k.as_str().into(),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct MixedResult {
    pub watch: FanoutResult,
    pub lists: ListResult,
    pub gets: GetResult,
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub pass: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub mem_gb: f64,
    pub kernel: String,
    pub loadavg_at_start: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub date: String,
    pub commit: String,
    pub machine: Machine,
    pub profile: Profile,
    pub loopback_gbps: f64,
    /// `/proc/loadavg` (1, 5, 15 minutes) when the scenarios ended.
    pub loadavg_at_end: String,
    /// ConfigMaps created per second while seeding scenario c (straight to the apiserver).
    pub c_create_rate: Option<f64>,
    pub wall_s: f64,
    /// Scenario a's phases: per side, one per rate of its sweep.
    pub a: Vec<FanoutPhase>,
    /// The JSON size of one of scenario a's ConfigMaps as seeded (an event carries about this).
    pub a_object_bytes: Option<usize>,
    pub b: Vec<StormRow>,
    pub c: Vec<Row<ListResult>>,
    pub d: Vec<GetRow>,
    pub e: Vec<Row<MixedResult>>,
    pub f: Vec<Row<FieldsResult>>,
    pub checks: Vec<Check>,
}

/// What the scenarios run against.
#[allow(
    clippy::large_enum_variant,
    reason = "one value per run; boxing the control plane would only add indirection"
)]
enum Cluster {
    /// The driver's own control plane, and the proxy as its child process per scenario.
    Local {
        cp: ControlPlane,
        files: ProxyFiles,
        proxy_bin: Option<PathBuf>,
        token: String,
    },
    /// An existing cluster and the proxy already running in front of it.
    External { proxy: Target },
}

struct Env {
    cluster: Cluster,
    direct: Target,
    admin: Conn,
}

impl Env {
    async fn scrape(&self) -> anyhow::Result<ApiCounts> {
        self.scrape_resource("configmaps").await
    }

    /// `admin`, or a new connection to the apiserver once it has closed that one: it closes
    /// HTTP/2 connections idle for 90 s (k8s.io/apiserver `secure_serving.go`, `IdleTimeout`),
    /// as `admin` is while a large namespace is seeded over other connections.
    async fn admin_conn(&self) -> anyhow::Result<Conn> {
        if self.admin.is_closed() {
            return self.direct.connect().await;
        }
        Ok(self.admin.clone())
    }

    /// The apiserver's request counters for `resource` (plural, core group).
    async fn scrape_resource(&self, resource: &str) -> anyhow::Result<ApiCounts> {
        let b = fetch(
            &self.admin_conn().await?,
            self.direct.request(Method::GET, "/metrics", None),
        )
        .await;
        match (b, &self.cluster) {
            (Ok(b), _) => Ok(ApiCounts::parse(&String::from_utf8_lossy(&b), resource)),
            // A cluster user may not read the apiserver's /metrics (nonResourceURLs get
            // /metrics): the request counts are then left at zero.
            (Err(_), Cluster::External { .. }) => Ok(ApiCounts::default()),
            (Err(e), Cluster::Local { .. }) => Err(e),
        }
    }

    fn procs(&self, proxy: Option<&ProxyChild>) -> Vec<(String, u32)> {
        let mut v = Vec::new();
        if let Cluster::Local { cp, .. } = &self.cluster {
            let pids = cp.pids();
            v.push(("etcd".to_string(), pids[0]));
            v.push(("kube-apiserver".to_string(), pids[1]));
        }
        if let Some(pid) = proxy.and_then(|p| p.pid) {
            v.push(("proxy".to_string(), pid));
        }
        v.push(("driver".to_string(), std::process::id()));
        v
    }

    /// Starts a proxy with `yaml` added to its configuration (a variant named `name`); `None`
    /// on an existing cluster (its proxy's configuration is not the driver's).
    async fn start_proxy_variant(
        &self,
        name: &str,
        yaml: &str,
    ) -> anyhow::Result<Option<ProxyChild>> {
        match &self.cluster {
            Cluster::Local {
                files,
                proxy_bin,
                token,
                ..
            } => {
                let files = files.variant(name, yaml)?;
                Ok(Some(
                    ProxyChild::start(&files, proxy_bin.as_deref(), token).await?,
                ))
            }
            Cluster::External { .. } => Ok(None),
        }
    }

    async fn start_proxy(&self) -> anyhow::Result<ProxyChild> {
        match &self.cluster {
            Cluster::Local {
                files,
                proxy_bin,
                token,
                ..
            } => ProxyChild::start(files, proxy_bin.as_deref(), token).await,
            Cluster::External { proxy } => Ok(ProxyChild::external(proxy.clone())),
        }
    }

    /// Runs `f` as one measured phase.
    async fn measure<T, Fut>(
        &self,
        proxy: Option<&ProxyChild>,
        f: Fut,
    ) -> anyhow::Result<(T, Usage)>
    where
        Fut: std::future::Future<Output = anyhow::Result<T>>,
    {
        let before = self.scrape().await?;
        let sampler = Sampler::start(&self.procs(proxy));
        let t0 = Instant::now();
        let r = f.await?;
        let wall_s = t0.elapsed().as_secs_f64();
        let procs = sampler.finish().await;
        // WATCH requests are counted when they end; give closed streams a moment.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let after = self.scrape().await?;
        Ok((
            r,
            Usage {
                wall_s,
                procs,
                configmaps_requests: after.delta(&before),
                all_requests: after.all_requests.saturating_sub(before.all_requests),
                access_reviews: after.access_reviews.saturating_sub(before.access_reviews),
            },
        ))
    }
}

fn main() -> anyhow::Result<()> {
    configure_allocator();
    let mut argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("serve-proxy") {
        return proxy::serve_main(argv.split_off(2));
    }
    let args = Args::parse();
    // The driver's own client logs (its HTTP/2 connections), on stderr, only when asked for.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    STARTED.get_or_init(Instant::now);
    let rt = tokio::runtime::Runtime::new()?;
    let ok = rt.block_on(run(args))?;
    if !ok {
        std::process::exit(1);
    }
    Ok(())
}

fn side(proxy: bool) -> &'static str {
    if proxy { "proxy" } else { "apiserver" }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let started = Instant::now();
    let mut p = Profile::named(&args.profile)?;
    if let Some(v) = args.watchers {
        p.a.watchers = v;
    }
    if let Some(v) = args.streams_per_conn {
        p.a.streams_per_conn = v;
    }
    if !args.churn_rate.is_empty() {
        p.a_rates = args.churn_rate.clone();
    }
    if let Some(v) = args.clients {
        p.b_clients = v;
    }
    if let Some(v) = args.field_watchers {
        p.f.watchers = v;
    }
    if let Some(v) = args.list_objects {
        p.c_objects = v;
    }
    let external = args.kubeconfig.is_some();
    if external && args.only.iter().any(|o| o == "b") {
        anyhow::bail!("scenario b needs a proxy the driver starts: not with --kubeconfig");
    }
    let want = |s: &str| {
        !(external && s == "b") && (args.only.is_empty() || args.only.iter().any(|o| o == s))
    };
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = out_dir(&args, &manifest, |k| std::env::var_os(k))?;
    std::fs::create_dir_all(&out)?;
    let machine = report::machine();
    if args.only.iter().any(|o| o == "cluster") {
        anyhow::ensure!(
            args.only.len() == 1 && !external,
            "the cluster scenario runs alone, on control planes of its own"
        );
        return cluster_main(&args, &out).await;
    }

    say!("loopback TCP ...");
    let loopback_gbps = stats::loopback_gbps(p.loopback_bytes).await?;

    let work = std::env::temp_dir().join(format!("kcp-loadtest-{}", std::process::id()));
    let env = match (&args.kubeconfig, &args.proxy_kubeconfig) {
        (Some(direct), Some(proxy)) => {
            say!(
                "loopback {loopback_gbps:.2} GB/s; measuring the cluster of {}",
                direct.display()
            );
            let ctx = args.context.as_deref();
            let direct = Target::from_kubeconfig("apiserver", direct, ctx).await?;
            let proxy = Target::from_kubeconfig("proxy", proxy, ctx).await?;
            let admin = direct.connect().await?;
            Env {
                cluster: Cluster::External { proxy },
                direct,
                admin,
            }
        }
        _ => {
            say!("loopback {loopback_gbps:.2} GB/s; starting kube-apiserver + etcd ...");
            std::fs::create_dir_all(&work)?;
            let cp = ControlPlane::start(ControlPlaneOptions {
                dir: Some(work.join("cp")),
                ..ControlPlaneOptions::default()
            })
            .await
            .context("starting the control plane")?;
            let api_addr = cp
                .url
                .trim_start_matches("https://")
                .parse()
                .context("apiserver address")?;
            let token = cp.admin_token().to_string();
            let direct = Target::new("apiserver", api_addr, &cp.ca_pem, &token);
            let admin = direct.connect().await?;
            let files = ProxyFiles::write(
                &work,
                &cp.admin_kubeconfig_yaml(),
                args.proxy_extra_config.as_deref(),
            )?;
            Env {
                cluster: Cluster::Local {
                    cp,
                    files,
                    proxy_bin: args.proxy_bin.clone(),
                    token,
                },
                direct,
                admin,
            }
        }
    };
    // Scenarios that run alone, each with its own report.
    let alone = |s: &str| args.only.iter().any(|o| o == s);
    let r = if alone("warm-restart") {
        Some(warm_main(&env, &args, &out, &work).await.map(|()| true))
    } else if alone("ingest") {
        Some(ingest_main(&env, &args, &out).await.map(|()| true))
    } else if alone("fields-attack") {
        Some(fields_attack_main(&env, &args, &out).await)
    } else if alone("hostile-streams") {
        Some(hostile_main(&env, &args, &out).await.map(|()| true))
    } else if alone("idle-streams") {
        Some(idle_main(&env, &args, &out).await.map(|()| true))
    } else if alone("slow-watcher") {
        Some(slow_main(&env, &args, &out).await.map(|()| true))
    } else if alone("table-list") {
        let o = table::TableOpts {
            pods: args.table_pods,
            runs: args.table_runs,
        };
        let extra = args.proxy_extra_config.as_deref();
        Some(table::run(&env, &o, &out, &work, extra).await)
    } else if alone("pb-fanout") || alone("pb-list") {
        let o = pb::PbOpts {
            watchers: args.pb_watchers,
            streams_per_conn: args.pb_streams_per_conn,
            rates: args.pb_rates.clone(),
            secs: args.pb_secs,
            pods: args.pb_pods,
            walkers: args.pb_walkers,
            limit: 500,
        };
        let extra = args.proxy_extra_config.as_deref();
        Some(pb::run(&env, &o, alone, &out, extra).await)
    } else {
        None
    };
    if let Some(r) = r {
        if let Cluster::Local { cp, .. } = env.cluster {
            cp.stop().await;
            let _ = std::fs::remove_dir_all(&work);
        }
        return r;
    }
    let result = scenarios_all(&env, &p, &want).await;
    match env.cluster {
        Cluster::Local { cp, .. } => {
            cp.stop().await;
            let _ = std::fs::remove_dir_all(&work);
        }
        Cluster::External { .. } => {
            // What the driver created, so a cluster is left as it was.
            for ns in SEEDED {
                let path = format!("/api/v1/namespaces/{ns}");
                let req = env.direct.request(Method::DELETE, &path, None);
                if let Err(e) = fetch(&env.admin, req).await {
                    say!("deleting namespace {ns}: {e}");
                }
            }
        }
    }
    let All {
        a,
        a_object_bytes,
        b,
        c,
        d,
        e,
        f,
        c_create_rate,
    } = result?;

    let mut run = Run {
        date: report::utc_now(),
        commit: report::commit(&manifest),
        machine,
        profile: p,
        loopback_gbps,
        loadavg_at_end: report::loadavg(),
        c_create_rate,
        wall_s: started.elapsed().as_secs_f64(),
        a,
        a_object_bytes,
        b,
        c,
        d,
        e,
        f,
        checks: Vec::new(),
    };
    run.checks = report::checks(&run);
    let paths = report::write(&run, &out)?;
    if args.publish && run.profile.name == "default" {
        report::update_readme(&run, &manifest.join("README.md"), &paths)?;
    }
    eprintln!(
        "loadtest: {} in {:.0}s; report {}",
        run.profile.name,
        run.wall_s,
        paths.md.display()
    );
    let failed: Vec<&Check> = run.checks.iter().filter(|c| !c.pass).collect();
    for c in &failed {
        say!("CHECK FAILED: {}: {}", c.name, c.detail);
    }
    Ok(failed.is_empty())
}

/// Scenario cluster (`cluster/`): a simulated cluster, direct and through the proxy, each side
/// on its own control plane, with its own report. Fails (exit 1) when a check fails.
async fn cluster_main(args: &Args, out: &std::path::Path) -> anyhow::Result<bool> {
    // (nodes, agents per node, Deployments, pods) of the size.
    let preset = if args.large {
        (2000, 2, 200, 60_000)
    } else {
        (100, 2, 20, 1000)
    };
    let explicit = args.cluster_nodes.is_some()
        || args.cluster_agents_per_node.is_some()
        || args.cluster_deployments.is_some()
        || args.cluster_pods.is_some();
    let size = match (args.large, explicit) {
        (true, false) => "large",
        (true, true) => "large, scaled down",
        (false, false) => "default",
        (false, true) => "custom",
    };
    let deployments = args.cluster_deployments.unwrap_or(preset.2).max(1);
    let o = cluster::ClusterOpts {
        nodes: args.cluster_nodes.unwrap_or(preset.0).max(1),
        agents_per_node: args.cluster_agents_per_node.unwrap_or(preset.1),
        deployments,
        replicas: (args.cluster_pods.unwrap_or(preset.3) / deployments).max(1),
        probe_rate: args.cluster_probe_rate,
        converge_timeout_s: args.cluster_timeout,
        restart_window_s: args.cluster_restart_window,
        proxy_extra_config: args.proxy_extra_config.clone(),
        also_proxy_config: args.also_proxy_config.clone(),
        rolling_restart: !args.cluster_no_rolling_restart,
        size: size.into(),
    };
    let work = std::env::temp_dir().join(format!("kcp-loadtest-{}", std::process::id()));
    let r = cluster::run(&o, &work, args.cluster_k8s_bin.clone()).await;
    let r = match r {
        Ok(r) => {
            let _ = std::fs::remove_dir_all(&work);
            r
        }
        // The side's logs stay for a look.
        Err(e) => return Err(e),
    };
    cluster::write(out, &r)?;
    let failed: Vec<&Check> = r.checks.iter().filter(|c| !c.pass).collect();
    for c in &failed {
        say!("CHECK FAILED: {}: {}", c.name, c.detail);
    }
    Ok(failed.is_empty())
}

/// Scenario warm-restart (`warm.rs`): the proxy started cold, stopped, started from its
/// saved state, with its own report.
async fn warm_main(
    env: &Env,
    args: &Args,
    out: &std::path::Path,
    work: &std::path::Path,
) -> anyhow::Result<()> {
    let d = &env.direct;
    let Cluster::Local {
        files,
        proxy_bin,
        token,
        ..
    } = &env.cluster
    else {
        anyhow::bail!("warm-restart starts and stops the proxy itself: not with --kubeconfig");
    };
    say!(
        "seeding lt-w ({} ConfigMaps of 1 KB) ...",
        args.warm_objects
    );
    create_namespace(d, &env.admin, "lt-w").await?;
    let t = std::time::Instant::now();
    create_configmaps(d, "lt-w", "w", args.warm_objects, 1024, 64).await?;
    say!(
        "seeded in {:.0} s; cold start, stop, warm start",
        t.elapsed().as_secs_f64()
    );
    let upstream = std::fs::read_to_string(&files.kubeconfig)?;
    let r = warm::run(
        work,
        &upstream,
        args.proxy_extra_config.as_deref(),
        proxy_bin.as_deref(),
        token,
        d,
        args.warm_objects,
    )
    .await?;
    write_scenario_report(
        out,
        "warm-restart",
        warm::markdown(&r),
        args.proxy_extra_config.as_deref(),
        &r,
    )
}

/// Scenario ingest (`ingest.rs`): the proxy's CPU per byte taken in, initial LIST and watch
/// events, with its own report.
async fn ingest_main(env: &Env, args: &Args, out: &std::path::Path) -> anyhow::Result<()> {
    let d = &env.direct;
    let Cluster::Local { cp, .. } = &env.cluster else {
        anyhow::bail!("ingest starts the proxy itself and reads its CPU: not with --kubeconfig");
    };
    say!(
        "seeding lt-i ({} ConfigMaps of {} KiB) ...",
        args.ingest_objects,
        args.ingest_kib
    );
    create_namespace(d, &env.admin, "lt-i").await?;
    let t = std::time::Instant::now();
    create_configmaps(
        d,
        "lt-i",
        "i",
        args.ingest_objects,
        args.ingest_kib * 1024,
        64,
    )
    .await?;
    say!(
        "seeded in {:.0} s; proxy cold start, then a patch of each",
        t.elapsed().as_secs_f64()
    );
    let pids = cp.pids();
    let o = ingest::IngestOpts {
        namespace: "lt-i",
        objects: args.ingest_objects,
        object_kib: args.ingest_kib,
        idle_s: 5.0,
        settle_timeout: std::time::Duration::from_secs(120),
    };
    let r = ingest::run(d, &o, (pids[0], pids[1]), || env.start_proxy()).await?;
    write_scenario_report(
        out,
        "ingest",
        ingest::markdown(&r),
        args.proxy_extra_config.as_deref(),
        &r,
    )
}

/// Writes a run-alone scenario's report (`<name>-<time>.md` and `.json` in `out`) and prints
/// it: its table, the proxy settings the run added, the date, CPUs and commit.
fn write_scenario_report(
    out: &std::path::Path,
    name: &str,
    mut md: String,
    extra_config: Option<&str>,
    json: &impl Serialize,
) -> anyhow::Result<()> {
    if let Some(extra) = extra_config {
        md.push_str(&format!("\nProxy configuration added: `{extra}`\n"));
    }
    md.push_str(&format!(
        "\n{} on {} CPUs, commit {}.\n",
        report::utc_now(),
        report::machine().cpus,
        report::commit(&PathBuf::from(env!("CARGO_MANIFEST_DIR")))
    ));
    let stem = format!("{name}-{}", report::utc_now().replace([':', '-'], ""));
    std::fs::write(out.join(format!("{stem}.md")), &md)?;
    std::fs::write(
        out.join(format!("{stem}.json")),
        serde_json::to_string_pretty(json)?,
    )?;
    println!("{md}");
    Ok(())
}

/// Scenario fields-attack (`fields.rs`): many distinct watch field filters against one proxy,
/// every phase in the same run, with its own report. Fails when a claim does not hold.
async fn fields_attack_main(env: &Env, args: &Args, out: &std::path::Path) -> anyhow::Result<bool> {
    let d = &env.direct;
    let o = fields::AttackOpts {
        namespace: "lt-fa".into(),
        victim_namespace: "lt-fv".into(),
        select_watchers: args.fa_watchers,
        select_rate: 4.0,
        ignore_watchers: 100,
        keys: 40_000,
        ignore_rate: 1.0,
        streams_per_conn: 250,
        secs: args.fa_secs,
        victim_rate: 10.0,
    };
    say!("fields-attack: seeding lt-fa, lt-fv ...");
    fields::attack_setup(d, &env.admin, &o).await?;
    let px = env
        .start_proxy_variant("fields-attack", fields::ATTACK_CONFIG)
        .await?
        .context("fields-attack starts its own proxy: not with --kubeconfig")?;
    let pid = px.pid.context("proxy pid")?;
    let r = fields::attack(&px.target, d, &env.admin, pid, &o).await;
    px.stop().await;
    let r = r?;
    write_scenario_report(
        out,
        "fields-attack",
        fields::attack_markdown(&o, &r),
        args.proxy_extra_config.as_deref(),
        &r,
    )?;
    Ok(r.passed())
}

/// Scenario hostile-streams (`hostile.rs`), apiserver then proxy, with its own report.
async fn hostile_main(env: &Env, args: &Args, out: &std::path::Path) -> anyhow::Result<()> {
    let d = &env.direct;
    let Cluster::Local { cp, .. } = &env.cluster else {
        anyhow::bail!("hostile-streams reads the RSS of local processes: not with --kubeconfig");
    };
    let o = hostile::HostileOpts {
        namespace: "lt-h".into(),
        conns: args.hs_conns,
        streams: args.hs_streams,
        hold_s: args.hs_hold,
        after_s: args.hs_after,
        get_rate: 50.0,
        objects: (args.hs_kb / 5).max(1),
    };
    say!(
        "seeding lt-h ({} KB) and lt-l ({} MB) ...",
        args.hs_kb,
        args.hs_list_mb
    );
    create_namespace(d, &env.admin, "lt-h").await?;
    create_configmaps(d, "lt-h", "d", o.objects, 5000, 32).await?;
    let list_path =
        (args.hs_list_mb > 0).then_some("/api/v1/namespaces/lt-l/configmaps?resourceVersion=0");
    if args.hs_list_mb > 0 {
        create_namespace(d, &env.admin, "lt-l").await?;
        create_configmaps(d, "lt-l", "l", args.hs_list_mb * 100, 10_000, 64).await?;
    }
    let mut rows = Vec::new();
    say!("hostile-streams via apiserver");
    rows.push(hostile::run(d, cp.pids()[1], &o, list_path, Some(d)).await?);
    say!("hostile-streams via proxy");
    let px = env.start_proxy().await?;
    let pid = px.pid.context("proxy pid")?;
    let r = hostile::run(&px.target, pid, &o, list_path, px.admin.as_ref()).await;
    px.stop().await;
    rows.push(r?);
    write_scenario_report(
        out,
        "hostile-streams",
        hostile::markdown(&o, args.hs_kb, &rows),
        args.proxy_extra_config.as_deref(),
        &rows,
    )
}

/// Scenario idle-streams (`idle.rs`), apiserver then proxy, with its own report.
async fn idle_main(env: &Env, args: &Args, out: &std::path::Path) -> anyhow::Result<()> {
    let d = &env.direct;
    let Cluster::Local { cp, .. } = &env.cluster else {
        anyhow::bail!("idle-streams reads the RSS of local processes: not with --kubeconfig");
    };
    let o = idle::IdleOpts {
        namespace: "lt-i".into(),
        streams: args.is_streams,
        per_conn: args.is_per_conn,
        settle_s: args.is_settle,
        after_s: args.is_after,
        opening: args.is_opening,
        // Longer than any hold: no stream ends while held.
        timeout_s: 3600,
    };
    say!("seeding lt-i (20 ConfigMaps of 512 B) ...");
    create_namespace(d, &env.admin, "lt-i").await?;
    create_configmaps(d, "lt-i", "i", 20, 512, 8).await?;
    let mut rows = Vec::new();
    say!("idle-streams via apiserver");
    rows.push(idle::run(d, cp.pids()[1], &o, d).await?);
    say!("idle-streams via proxy");
    let px = env.start_proxy().await?;
    let pid = px.pid.context("proxy pid")?;
    let admin = px.admin.clone().context("proxy admin listener")?;
    let r = idle::run(&px.target, pid, &o, &admin).await;
    px.stop().await;
    rows.push(r?);
    write_scenario_report(
        out,
        "idle-streams",
        idle::markdown(&o, &rows),
        args.proxy_extra_config.as_deref(),
        &rows,
    )
}

/// Scenario slow-watcher (`slow.rs`), apiserver then proxy, with its own report.
async fn slow_main(env: &Env, args: &Args, out: &std::path::Path) -> anyhow::Result<()> {
    let d = &env.direct;
    let o = FanoutOpts {
        churned: Churned::ConfigMaps,
        encoding: Encoding::Json,
        namespace: "lt-s".into(),
        watchers: args.sw_watchers,
        streams_per_conn: 10,
        rate: args.sw_rate,
        objects: 20,
        duration_s: args.sw_secs,
        pad: args.sw_kib * 1024,
    };
    say!("seeding lt-s ({} ConfigMaps) ...", o.objects);
    create_namespace(d, &env.admin, "lt-s").await?;
    create_configmaps(d, "lt-s", "w", o.objects, 100, 8).await?;
    let mut rows = Vec::new();
    say!("slow-watcher via apiserver");
    rows.push(slow::run(d, d, &env.admin, &o, !args.sw_no_slow).await?);
    say!("slow-watcher via proxy");
    let px = env.start_proxy().await?;
    let r = slow::run(&px.target, d, &env.admin, &o, !args.sw_no_slow).await;
    px.stop().await;
    rows.push(r?);
    write_scenario_report(
        out,
        "slow-watcher",
        slow::markdown(&o, &rows),
        args.proxy_extra_config.as_deref(),
        &rows,
    )
}

/// A JSON walk of `ns`'s ConfigMaps with `limit` (scenarios c and e).
fn configmaps_walk(ns: &str, limit: usize) -> scenarios::WalkSpec {
    scenarios::WalkSpec {
        path: format!("/api/v1/namespaces/{ns}/configmaps"),
        limit,
        encoding: Encoding::Json,
    }
}

/// The namespaces the driver seeds (and, on an existing cluster, deletes at the end).
const SEEDED: [&str; 5] = ["lt-a", "lt-b", "lt-c", "lt-d", "lt-f"];

/// Where the reports go: `--out`; with `--publish` the checked-in `loadtest/results/`; else
/// `$XDG_CACHE_HOME/kube-cache-proxy/loadtest`, or `$HOME/.cache/kube-cache-proxy/loadtest`
/// (the XDG default), never the source tree. `var` reads the environment.
fn out_dir(
    args: &Args,
    manifest: &std::path::Path,
    var: impl Fn(&str) -> Option<std::ffi::OsString>,
) -> anyhow::Result<PathBuf> {
    if let Some(out) = &args.out {
        return Ok(out.clone());
    }
    if args.publish {
        return Ok(manifest.join("results"));
    }
    let cache = var("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| {
            var("HOME")
                .filter(|v| !v.is_empty())
                .map(|h| PathBuf::from(h).join(".cache"))
        })
        .context("no --out, and neither XDG_CACHE_HOME nor HOME is set")?;
    Ok(cache.join("kube-cache-proxy").join("loadtest"))
}

/// What [`scenarios_all`] measured.
#[derive(Default)]
struct All {
    a: Vec<FanoutPhase>,
    a_object_bytes: Option<usize>,
    b: Vec<StormRow>,
    c: Vec<Row<ListResult>>,
    d: Vec<GetRow>,
    e: Vec<Row<MixedResult>>,
    f: Vec<Row<FieldsResult>>,
    c_create_rate: Option<f64>,
}

async fn scenarios_all(env: &Env, p: &Profile, want: &dyn Fn(&str) -> bool) -> anyhow::Result<All> {
    let d = &env.direct;
    say!("seeding ...");
    for ns in SEEDED {
        create_namespace(d, &env.admin, ns).await?;
    }
    create_configmaps(d, "lt-a", "w", p.a.objects, 512, 64).await?;
    create_configmaps(d, "lt-b", "b", p.b_objects, 512, 64).await?;
    create_configmaps(d, "lt-d", "d", p.d_objects, 512, 64).await?;
    scenarios::create_leases(d, "lt-d", p.d_objects).await?;

    let mut all = All::default();
    let (b, c, dd, e, f) = (&mut all.b, &mut all.c, &mut all.d, &mut all.e, &mut all.f);
    if want("a") {
        let w0 = "/api/v1/namespaces/lt-a/configmaps/w-0";
        all.a_object_bytes = Some(
            fetch(&env.admin, d.request(Method::GET, w0, None))
                .await?
                .len(),
        );
        for via_proxy in [false, true] {
            say!(
                "a. watch fan-out via {}: rates {:?}/s",
                side(via_proxy),
                p.a_rates
            );
            let proxy = if via_proxy {
                Some(env.start_proxy().await?)
            } else {
                None
            };
            let r = sweep::sweep(env, proxy.as_ref(), &p.a_rates, |rate| FanoutOpts {
                rate,
                ..p.a.clone()
            })
            .await;
            if let Some(px) = proxy {
                px.stop().await;
            }
            all.a.extend(r?);
        }
    }
    if want("b") {
        for via_proxy in [false, true] {
            // For the proxy, counting starts before it starts: its own LIST+WATCH is the
            // upstream cost of every informer behind it.
            let before_start = env.scrape().await?;
            let proxy = if via_proxy {
                say!("b. informer storms via proxy (starting it)");
                Some(env.start_proxy().await?)
            } else {
                say!("b. informer storms via apiserver");
                None
            };
            let t = proxy.as_ref().map_or(d, |p| &p.target);
            // One warm-up informer of each mode first, so neither storm pays for first-request
            // costs alone (the proxy's access-review cache, connection set-up). Its upstream
            // requests count for the proxy (they must be served from its cache) and not for
            // the apiserver, whose counters are read after it.
            for mode in [StartMode::Legacy, StartMode::WatchList] {
                let (_, held) = scenarios::informer_storm(t, "lt-b", 1, mode, p.b_objects).await?;
                drop(held);
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            let mut before = if via_proxy {
                before_start
            } else {
                env.scrape().await?
            };
            for mode in [StartMode::Legacy, StartMode::WatchList] {
                let sampler = Sampler::start(&env.procs(proxy.as_ref()));
                let t0 = Instant::now();
                let (result, held) =
                    scenarios::informer_storm(t, "lt-b", p.b_clients, mode, p.b_objects).await?;
                let wall_s = t0.elapsed().as_secs_f64();
                let procs = sampler.finish().await;
                let peak = env.scrape().await?;
                drop(held);
                tokio::time::sleep(std::time::Duration::from_millis(1000)).await;
                let after = env.scrape().await?;
                let delta = after.delta(&before);
                b.push(StormRow {
                    side: side(via_proxy),
                    mode,
                    result,
                    upstream_lists: delta.get("LIST").copied().unwrap_or(0),
                    upstream_watches_opened: peak.open_watches as i64 - before.open_watches as i64,
                    usage: Usage {
                        wall_s,
                        procs,
                        configmaps_requests: delta,
                        all_requests: after.all_requests.saturating_sub(before.all_requests),
                        access_reviews: after.access_reviews.saturating_sub(before.access_reviews),
                    },
                });
                before = after;
            }
            if let Some(px) = proxy {
                px.stop().await;
            }
        }
    }
    if want("d") {
        // The apiserver; the proxy with its default consistency (`bounded`; an existing
        // cluster's proxy as it is configured); the driver's own proxy with `strict`, for
        // unset-resourceVersion GETs only.
        const ALL: &[GetKind] = &[GetKind::Quorum, GetKind::Rv0, GetKind::Passthrough];
        say!("d. GETs via apiserver");
        dd.extend(get_phases(env, None, "-", ALL, p).await?);
        let local = matches!(env.cluster, Cluster::Local { .. });
        let mode = if local { "bounded" } else { "as configured" };
        say!("d. GETs via proxy (consistency {mode})");
        let px = env.start_proxy().await?;
        let r = get_phases(env, Some(&px), mode, ALL, p).await;
        px.stop().await;
        dd.extend(r?);
        let strict = "lists:\n  consistency: strict";
        if let Some(px) = env.start_proxy_variant("strict", strict).await? {
            say!("d. GETs via proxy (consistency strict)");
            let r = get_phases(env, Some(&px), "strict", &[GetKind::Quorum], p).await;
            px.stop().await;
            dd.extend(r?);
        }
    }
    if want("e") {
        for via_proxy in [false, true] {
            say!("e. mixed via {}", side(via_proxy));
            let proxy = if via_proxy {
                Some(env.start_proxy().await?)
            } else {
                None
            };
            let t = proxy.as_ref().map_or(d, |p| &p.target);
            let fan = FanoutOpts {
                watchers: p.e_watchers,
                rate: p.e_churn_rate,
                duration_s: p.e_secs,
                ..p.a.clone()
            };
            let walk = configmaps_walk("lt-b", p.e_list_limit);
            let mixed = async {
                let until = Instant::now() + std::time::Duration::from_secs_f64(p.e_secs);
                let (watch, lists, gets) = tokio::join!(
                    scenarios::watch_fanout(t, d, &env.admin, &fan),
                    scenarios::list_storm(t, &walk, p.e_list_clients, 0, p.b_objects, Some(until)),
                    scenarios::get_rate(
                        t,
                        "lt-d",
                        p.d_objects,
                        p.e_get_rate,
                        p.e_secs,
                        GetKind::Quorum
                    ),
                );
                anyhow::Ok(MixedResult {
                    watch: watch?,
                    lists: lists?,
                    gets: gets?,
                })
            };
            let (result, usage) = env.measure(proxy.as_ref(), mixed).await?;
            e.push(Row {
                side: side(via_proxy),
                result,
                usage,
            });
            if let Some(px) = proxy {
                px.stop().await;
            }
        }
    }
    if want("f") {
        fields::create_deployments(d, &env.admin, &p.f.namespace, p.f.objects).await?;
        // The apiserver (no watcher can filter there), the proxy without filters, the proxy
        // with every second watcher filtered on `spec`.
        for (via_proxy, half) in [(false, false), (true, false), (true, true)] {
            say!(
                "f. watch-field filtering via {} ({} filtered)",
                side(via_proxy),
                if half { "half" } else { "none" }
            );
            let proxy = if via_proxy {
                Some(env.start_proxy().await?)
            } else {
                None
            };
            let t = proxy.as_ref().map_or(d, |p| &p.target);
            let (result, usage) = env
                .measure(
                    proxy.as_ref(),
                    fields::watch_fields(t, d, &env.admin, &p.f, half),
                )
                .await?;
            f.push(Row {
                side: side(via_proxy),
                result,
                usage,
            });
            if let Some(px) = proxy {
                px.stop().await;
            }
        }
    }
    if want("c") {
        say!("c. creating {} ConfigMaps ...", p.c_objects);
        let rate = create_configmaps(d, "lt-c", "c", p.c_objects, 256, 128).await?;
        say!("c. created at {rate:.0}/s");
        all.c_create_rate = Some(rate);
        for via_proxy in [false, true] {
            say!("c. paginated list storm via {}", side(via_proxy));
            let proxy = if via_proxy {
                Some(env.start_proxy().await?)
            } else {
                None
            };
            let t = proxy.as_ref().map_or(d, |p| &p.target);
            let (result, usage) = env
                .measure(
                    proxy.as_ref(),
                    scenarios::list_storm(
                        t,
                        &configmaps_walk("lt-c", p.c_limit),
                        p.c_clients,
                        p.c_walks,
                        p.c_objects,
                        None,
                    ),
                )
                .await?;
            c.push(Row {
                side: side(via_proxy),
                result,
                usage,
            });
            if let Some(px) = proxy {
                px.stop().await;
            }
        }
    }
    Ok(all)
}

/// Scenario d's phases on one side: GETs of each of `kinds`, measured, with the proxy's GETs
/// by what served them and its consistency probes.
async fn get_phases(
    env: &Env,
    px: Option<&ProxyChild>,
    consistency: &'static str,
    kinds: &[GetKind],
    p: &Profile,
) -> anyhow::Result<Vec<GetRow>> {
    let t = px.map_or(&env.direct, |p| &p.target);
    let probes = async || -> anyhow::Result<u64> {
        Ok(match px.and_then(|p| p.admin.as_ref()) {
            Some(admin) => stats::sum(
                &stats::metrics(admin).await?,
                "kube_cache_proxy_consistency_probes_total",
                &[],
            ) as u64,
            None => 0,
        })
    };
    let split = async |kind: GetKind| -> anyhow::Result<Option<[f64; 4]>> {
        Ok(match px.and_then(|p| p.admin.as_ref()) {
            Some(admin) if kind == GetKind::Passthrough => Some(ProxySplit::read(
                &stats::metrics(admin).await?,
                kind.resource(),
            )),
            _ => None,
        })
    };
    let mut rows = Vec::new();
    for &kind in kinds {
        let before = (served(px, kind.resource(), "GET").await?, probes().await?);
        let split_before = split(kind).await?;
        let (result, usage) = env
            .measure(
                px,
                scenarios::get_rate(t, "lt-d", p.d_objects, p.d_rate, p.d_secs, kind),
            )
            .await?;
        let after = (served(px, kind.resource(), "GET").await?, probes().await?);
        let proxy_split = match (split_before, split(kind).await?) {
            (Some(b), Some(a)) => ProxySplit::between(b, a),
            _ => None,
        };
        rows.push(GetRow {
            side: t.side,
            consistency,
            result,
            usage,
            served: after.0.since(before.0),
            probes: after.1.saturating_sub(before.1),
            proxy_split,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use std::ffi::OsString;
    use std::path::Path;

    use clap::Parser as _;

    use super::*;

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("loadtest").chain(argv.iter().copied()))
    }

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        }
    }

    /// The proxy's account of passed-through GETs is read from its histograms' sums and
    /// counts for the resource's GETs only, and is the mean between two readings.
    #[test]
    fn the_proxy_split_is_the_mean_of_its_histograms_between_two_readings() {
        let text = |req_sum: f64, req_n: u64, up_sum: f64, up_n: u64| {
            format!(
                "kube_cache_proxy_request_duration_seconds_sum{{verb=\"GET\",group=\"coordination.k8s.io\",version=\"v1\",resource=\"leases\",subresource=\"\",scope=\"namespace\",served_by=\"upstream\"}} {req_sum}\n\
                 kube_cache_proxy_request_duration_seconds_count{{verb=\"GET\",group=\"coordination.k8s.io\",version=\"v1\",resource=\"leases\",subresource=\"\",scope=\"namespace\",served_by=\"upstream\"}} {req_n}\n\
                 kube_cache_proxy_request_duration_seconds_sum{{verb=\"GET\",group=\"\",version=\"v1\",resource=\"configmaps\",subresource=\"\",scope=\"namespace\",served_by=\"upstream\"}} 99\n\
                 kube_cache_proxy_request_duration_seconds_count{{verb=\"GET\",group=\"\",version=\"v1\",resource=\"configmaps\",subresource=\"\",scope=\"namespace\",served_by=\"upstream\"}} 99\n\
                 kube_cache_proxy_upstream_request_duration_seconds_sum{{verb=\"GET\",resource=\"leases\"}} {up_sum}\n\
                 kube_cache_proxy_upstream_request_duration_seconds_count{{verb=\"GET\",resource=\"leases\"}} {up_n}\n\
                 kube_cache_proxy_upstream_request_duration_seconds_sum{{verb=\"LIST\",resource=\"leases\"}} 50\n"
            )
        };
        let before = ProxySplit::read(&text(1.0, 10, 0.5, 10), "leases");
        assert_eq!(before, [1.0, 10.0, 0.5, 10.0]);
        let after = ProxySplit::read(&text(1.3, 110, 0.62, 110), "leases");
        let s = ProxySplit::between(before, after).unwrap();
        assert_eq!(s.requests, 100);
        assert!((s.request_mean_ms - 3.0).abs() < 1e-9, "{s:?}");
        assert!((s.upstream_mean_ms - 1.2).abs() < 1e-9, "{s:?}");
        assert_eq!(ProxySplit::between(after, after), None);
    }

    #[test]
    fn reports_go_outside_the_source_tree_by_default() {
        let manifest = Path::new("/src/loadtest");
        let args = parse(&[]).unwrap();
        assert_eq!(
            out_dir(
                &args,
                manifest,
                env(&[("XDG_CACHE_HOME", "/x/cache"), ("HOME", "/h")])
            )
            .unwrap(),
            Path::new("/x/cache/kube-cache-proxy/loadtest")
        );
        // XDG's rules: unset, empty or relative means $HOME/.cache.
        for xdg in [
            &[][..],
            &[("XDG_CACHE_HOME", "")],
            &[("XDG_CACHE_HOME", "rel")],
        ] {
            let mut vars = xdg.to_vec();
            vars.push(("HOME", "/h"));
            assert_eq!(
                out_dir(&args, manifest, env(&vars)).unwrap(),
                Path::new("/h/.cache/kube-cache-proxy/loadtest"),
                "{xdg:?}"
            );
        }
        assert!(out_dir(&args, manifest, env(&[])).is_err());
        // --out wins; --publish is the checked-in results directory.
        let args = parse(&["--out", "/tmp/r"]).unwrap();
        assert_eq!(
            out_dir(&args, manifest, env(&[("HOME", "/h")])).unwrap(),
            Path::new("/tmp/r")
        );
        let args = parse(&["--publish"]).unwrap();
        assert_eq!(
            out_dir(&args, manifest, env(&[("HOME", "/h")])).unwrap(),
            Path::new("/src/loadtest/results")
        );
        assert!(parse(&["--publish", "--out", "/tmp/r"]).is_err());
    }

    #[test]
    fn an_existing_cluster_needs_both_kubeconfigs() {
        let a = parse(&[
            "--kubeconfig",
            "direct.kubeconfig",
            "--proxy-kubeconfig",
            "proxy.kubeconfig",
            "--context",
            "prod",
            "--only",
            "a,d",
        ])
        .unwrap();
        assert_eq!(
            a.kubeconfig.as_deref(),
            Some(Path::new("direct.kubeconfig"))
        );
        assert_eq!(
            a.proxy_kubeconfig.as_deref(),
            Some(Path::new("proxy.kubeconfig"))
        );
        assert_eq!(a.context.as_deref(), Some("prod"));
        assert_eq!(a.only, ["a", "d"]);
        for partial in [
            &["--kubeconfig", "k"][..],
            &["--proxy-kubeconfig", "k"],
            &["--context", "prod"],
        ] {
            assert!(parse(partial).is_err(), "{partial:?}");
        }
        let local = parse(&["--profile", "smoke"]).unwrap();
        assert!(local.kubeconfig.is_none() && !local.publish);
    }

    #[test]
    fn the_cli_definition_is_consistent() {
        use clap::CommandFactory as _;
        Args::command().debug_assert();
    }
}
