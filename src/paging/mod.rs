//! Adaptive page size: a pure controller fed every `paging.interval` with what the proxy
//! observes, driving the page size of its own upstream LISTs and a cap on downstream pages.
//!
//! # The policy ([`Controller::step`], pure)
//! For each target (upstream, downstream) separately:
//!
//! ```text
//! size   = clamp(base * qpsFactor * latencyFactor * loadFactor, min, max)
//! qpsFactor     = clamp(1 + (qps - qpsPivot) / qpsScale, minQpsFactor, maxQpsFactor)
//! latencyFactor = latencyPenalty if p95 > latencyThreshold else 1
//! loadFactor    = 1 if load < moderateLoad, moderateLoadFactor if load <= highLoad,
//!                 else highLoadFactor
//! page   = page + emaAlpha * (size - page)        (starts at clamp(base, min, max))
//! ```
//!
//! `qps` is the downstream LIST rate and `load` the apiserver/etcd load score, shared by both
//! targets. The latency is each target's own: the upstream page size looks at the p95 of the
//! proxy's own upstream requests (slow apiserver → smaller upstream pages), the downstream cap
//! at the p95 of the LISTs the proxy serves (slow proxy → smaller pages to its clients). The
//! defaults are issue 7's policy; every constant is in [`PagingConfig`].
//!
//! # Inputs and how missing ones degrade
//! - downstream LIST rate and p95: [`Paging::record_list`], called by the request path at the
//!   end of every LIST response body. No LIST in an interval: qps 0, no p95 (factor 1).
//! - upstream p95: [`LatencyWindow`] in [`crate::upstream::Upstream`], time to response
//!   headers of the proxy's own non-long-running requests. None in an interval: factor 1.
//! - load score 0..1 from the apiserver's `/metrics` (and etcd's, when configured), see
//!   [`LoadTracker`]: each signal scores `min(value / saturation, 1)`, the score is the
//!   highest present. Counters and histograms are read as the change since the previous
//!   scrape (a counter that went down, i.e. a restart, is skipped once). A signal missing
//!   from the text is left out; a failed scrape keeps the previous score for
//!   [`STALE_SAMPLES`] samples, after which the load is unknown and its factor 1.
//!
//! # Outputs
//! [`Paging::upstream_page_size`] (read by the reflector for every page it requests),
//! [`Paging::downstream_cap`] (for the list code), the `kube_cache_proxy_page_size` and
//! `kube_cache_proxy_paging_*` gauges ([`PagingCollector`]), and `GET /debug/paging`
//! ([`Paging::debug_json`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::BodyExt as _;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{LoadConfig, PagingConfig};
use crate::http::body::{self, Body};
pub use crate::metrics::window::{LatencyWindow, Window, histogram_quantile};
use crate::upstream::{As, Upstream};

/// A failed or empty scrape keeps the last load score for this many samples (30 s at the
/// default interval): an overloaded apiserver is the likeliest to time out a scrape, so one
/// failure must not read as "no load".
pub const STALE_SAMPLES: u32 = 3;

/// Largest `/metrics` body read. A big apiserver exports a few MiB.
const MAX_METRICS_BYTES: usize = 64 << 20;

fn clamp(v: f64, lo: f64, hi: f64) -> f64 {
    // Not f64::clamp: it panics on lo > hi, which validation rules out but a hand-built
    // config in a test might not.
    v.max(lo).min(hi)
}

// ---------------------------------------------------------------------------------------------
// The policy (pure)
// ---------------------------------------------------------------------------------------------

/// The QPS factor for a downstream LIST rate. Non-finite or negative rates count as 0.
pub fn qps_factor(cfg: &PagingConfig, qps: f64) -> f64 {
    let qps = if qps.is_finite() { qps.max(0.0) } else { 0.0 };
    clamp(
        1.0 + (qps - cfg.qps_pivot) / cfg.qps_scale,
        cfg.min_qps_factor,
        cfg.max_qps_factor,
    )
}

/// The latency factor: the penalty when the p95 is strictly above the threshold; 1 when it
/// is not, or unknown.
pub fn latency_factor(cfg: &PagingConfig, p95: Option<Duration>) -> f64 {
    match p95 {
        Some(p) if p > cfg.latency_threshold => cfg.latency_penalty,
        _ => 1.0,
    }
}

/// The load factor for a load score; 1 when unknown.
pub fn load_factor(cfg: &PagingConfig, load: Option<f64>) -> f64 {
    match load {
        Some(l) if l.is_finite() => {
            if l < cfg.moderate_load {
                1.0
            } else if l <= cfg.high_load {
                cfg.moderate_load_factor
            } else {
                cfg.high_load_factor
            }
        }
        _ => 1.0,
    }
}

/// The unsmoothed page size for a product of factors, within the bounds.
pub fn target_size(cfg: &PagingConfig, factors: f64) -> f64 {
    clamp(
        f64::from(cfg.base_page_size) * factors,
        f64::from(cfg.min_page_size),
        f64::from(cfg.max_page_size),
    )
}

/// What the controller sees in one sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Inputs {
    /// Downstream LISTs per second.
    pub list_qps: f64,
    /// p95 of downstream LIST latency (until the body ended); `None`: no LIST.
    pub list_p95: Option<Duration>,
    /// p95 of the proxy's own upstream request latency; `None`: no request.
    pub upstream_p95: Option<Duration>,
    /// Load score 0..1; `None`: unknown.
    pub load: Option<f64>,
}

/// The factors of one sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Factors {
    pub qps: f64,
    pub load: f64,
    pub upstream_latency: f64,
    pub downstream_latency: f64,
}

/// A value per target.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PerTarget<T> {
    pub upstream: T,
    pub downstream: T,
}

/// One step's result.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Decision {
    pub factors: Factors,
    /// Unsmoothed sizes.
    pub target: PerTarget<f64>,
    /// Smoothed sizes (the moving averages).
    pub smoothed: PerTarget<f64>,
    /// The page sizes in use: the smoothed sizes rounded, within the bounds.
    pub page_size: PerTarget<u32>,
}

/// The controller's state: one moving average per target.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Controller {
    upstream: f64,
    downstream: f64,
}

impl Controller {
    /// Starts both averages at the base size (within the bounds): the page size before the
    /// first sample, e.g. for the initial sync.
    pub fn new(cfg: &PagingConfig) -> Controller {
        let b = target_size(cfg, 1.0);
        Controller {
            upstream: b,
            downstream: b,
        }
    }

    /// The current page sizes.
    pub fn page_size(&self, cfg: &PagingConfig) -> PerTarget<u32> {
        let round = |v: f64| {
            clamp(
                v.round(),
                f64::from(cfg.min_page_size),
                f64::from(cfg.max_page_size),
            ) as u32
        };
        PerTarget {
            upstream: round(self.upstream),
            downstream: round(self.downstream),
        }
    }

    /// Folds one sample into the averages and returns the decision.
    pub fn step(&mut self, cfg: &PagingConfig, inputs: &Inputs) -> Decision {
        let factors = Factors {
            qps: qps_factor(cfg, inputs.list_qps),
            load: load_factor(cfg, inputs.load),
            upstream_latency: latency_factor(cfg, inputs.upstream_p95),
            downstream_latency: latency_factor(cfg, inputs.list_p95),
        };
        let shared = factors.qps * factors.load;
        let target = PerTarget {
            upstream: target_size(cfg, shared * factors.upstream_latency),
            downstream: target_size(cfg, shared * factors.downstream_latency),
        };
        let alpha = clamp(cfg.ema_alpha, 0.0, 1.0);
        self.upstream += alpha * (target.upstream - self.upstream);
        self.downstream += alpha * (target.downstream - self.downstream);
        Decision {
            factors,
            target,
            smoothed: PerTarget {
                upstream: self.upstream,
                downstream: self.downstream,
            },
            page_size: self.page_size(cfg),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Prometheus text format
// ---------------------------------------------------------------------------------------------

/// One sample line of the Prometheus text format (or OpenMetrics text).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The samples of `text` whose metric name `wanted` accepts. Comments, blank lines and lines
/// that do not parse are skipped; the name is checked before the labels are parsed, so the
/// many unwanted lines of a big exposition cost little.
pub fn parse_samples<'a>(text: &'a str, wanted: impl Fn(&str) -> bool) -> Vec<Sample<'a>> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim_start();
            if line.is_empty() || line.starts_with('#') {
                return None;
            }
            let end = line
                .find(|c: char| c == '{' || c.is_ascii_whitespace())
                .unwrap_or(line.len());
            let name = &line[..end];
            if name.is_empty() || !wanted(name) {
                return None;
            }
            parse_line(name, &line[end..])
        })
        .collect()
}

/// Parses `{labels} value [timestamp]` after the metric name.
fn parse_line<'a>(name: &'a str, rest: &'a str) -> Option<Sample<'a>> {
    let mut labels = Vec::new();
    let mut rest = rest.trim_start();
    if let Some(mut r) = rest.strip_prefix('{') {
        loop {
            r = r.trim_start();
            if let Some(after) = r.strip_prefix('}') {
                r = after;
                break;
            }
            let eq = r.find('=')?;
            let key = r[..eq].trim();
            if key.is_empty() {
                return None;
            }
            r = r[eq + 1..].trim_start().strip_prefix('"')?;
            let mut value = String::new();
            let mut chars = r.char_indices();
            let close = loop {
                match chars.next()? {
                    (i, '"') => break i,
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (_, c) => value.push(c),
                }
            };
            labels.push((key, value));
            r = r[close + 1..].trim_start();
            if let Some(after) = r.strip_prefix(',') {
                r = after;
            } else if !r.starts_with('}') {
                return None;
            }
        }
        rest = r;
    }
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    Some(Sample {
        name,
        labels,
        value,
    })
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// Cumulative histogram buckets `(le, count)`, sorted, summed over series.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Buckets(Vec<(f64, f64)>);

impl Buckets {
    fn add(&mut self, le: f64, count: f64) {
        match self.0.iter_mut().find(|(l, _)| *l == le) {
            Some((_, c)) => *c += count,
            None => {
                self.0.push((le, count));
                self.0.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
        }
    }

    /// The change since `prev`; `None` after a reset (a count went down) or a changed layout.
    fn since(&self, prev: &Buckets) -> Option<Buckets> {
        if self.0.len() != prev.0.len() {
            return None;
        }
        let mut out = Vec::with_capacity(self.0.len());
        for (&(le, c), &(ple, pc)) in self.0.iter().zip(&prev.0) {
            if le != ple || c < pc {
                return None;
            }
            out.push((le, c - pc));
        }
        Some(Buckets(out))
    }

    fn quantile(&self, q: f64) -> Option<f64> {
        histogram_quantile(q, &self.0)
    }
}

fn bucket_le(s: &Sample<'_>) -> Option<f64> {
    s.label("le").and_then(parse_value)
}

/// What the load score needs from one apiserver `/metrics` text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ApiserverScrape {
    /// `etcd_request_duration_seconds` buckets by operation.
    pub etcd_request: Vec<(String, Buckets)>,
    /// `apiserver_flowcontrol_current_inqueue_requests`, summed.
    pub inqueue: Option<f64>,
    /// `apiserver_flowcontrol_rejected_requests_total`, summed.
    pub rejected_total: Option<f64>,
    /// `apiserver_storage_objects` (or its successor `apiserver_resource_objects`), summed.
    pub storage_objects: Option<f64>,
}

const ETCD_REQUEST_BUCKET: &str = "etcd_request_duration_seconds_bucket";
const INQUEUE: &str = "apiserver_flowcontrol_current_inqueue_requests";
const REJECTED: &str = "apiserver_flowcontrol_rejected_requests_total";
/// `apiserver_resource_objects` replaced `apiserver_storage_objects` (deprecated in 1.34;
/// 1.36 still declares it but exports no samples). Both are refreshed about once a minute
/// (`--etcd-count-metric-poll-period`), read 0 until the first check and -1 for a resource
/// whose count failed.
const STORAGE_OBJECTS: &[&str] = &["apiserver_resource_objects", "apiserver_storage_objects"];
const ETCD_COMMIT_BUCKET: &str = "etcd_disk_backend_commit_duration_seconds_bucket";
const ETCD_PENDING: &str = "etcd_server_proposals_pending";

fn sum(acc: &mut Option<f64>, v: f64) {
    if v.is_finite() {
        *acc = Some(acc.unwrap_or(0.0) + v);
    }
}

impl ApiserverScrape {
    pub fn parse(text: &str) -> ApiserverScrape {
        let mut out = ApiserverScrape::default();
        let samples = parse_samples(text, |n| {
            n == ETCD_REQUEST_BUCKET
                || n == INQUEUE
                || n == REJECTED
                || STORAGE_OBJECTS.contains(&n)
        });
        // The first storage-objects name present wins, so an apiserver exporting both (during
        // the rename) is not counted twice.
        let storage_name = STORAGE_OBJECTS
            .iter()
            .find(|n| samples.iter().any(|s| s.name == **n));
        for s in &samples {
            match s.name {
                ETCD_REQUEST_BUCKET => {
                    let (Some(op), Some(le)) = (s.label("operation"), bucket_le(s)) else {
                        continue;
                    };
                    let i = match out.etcd_request.iter().position(|(o, _)| o == op) {
                        Some(i) => i,
                        None => {
                            out.etcd_request.push((op.to_string(), Buckets::default()));
                            out.etcd_request.len() - 1
                        }
                    };
                    out.etcd_request[i].1.add(le, s.value);
                }
                INQUEUE => sum(&mut out.inqueue, s.value),
                REJECTED => sum(&mut out.rejected_total, s.value),
                n if Some(&n) == storage_name && s.value >= 0.0 => {
                    sum(&mut out.storage_objects, s.value)
                }
                _ => {}
            }
        }
        out
    }
}

/// What the load score needs from one etcd `/metrics` text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EtcdScrape {
    pub commit: Option<Buckets>,
    pub pending: Option<f64>,
}

impl EtcdScrape {
    pub fn parse(text: &str) -> EtcdScrape {
        let mut out = EtcdScrape::default();
        for s in parse_samples(text, |n| n == ETCD_COMMIT_BUCKET || n == ETCD_PENDING) {
            match s.name {
                ETCD_COMMIT_BUCKET => {
                    if let Some(le) = bucket_le(&s) {
                        out.commit
                            .get_or_insert_with(Buckets::default)
                            .add(le, s.value);
                    }
                }
                _ => sum(&mut out.pending, s.value),
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// The load score
// ---------------------------------------------------------------------------------------------

/// One load signal of a sample.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Signal {
    /// `etcdRequestP99Seconds`, `inqueueRequests`, `rejectedPerSecond`, `storageObjects`,
    /// `etcdCommitP99Seconds`, `etcdPendingProposals`.
    pub name: &'static str,
    pub value: f64,
    /// `min(value / saturation, 1)`.
    pub score: f64,
    /// For `etcdRequestP99Seconds`: the operation with the highest p99.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub operation: Option<String>,
}

/// The load part of a sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadReport {
    /// The highest signal score, or the previous score while stale; `None`: unknown.
    pub score: Option<f64>,
    /// Samples since the score was last computed from fresh signals (0: fresh).
    pub stale_samples: u32,
    pub signals: Vec<Signal>,
    /// Scrape failures of this sample (`apiserver: ...`, `etcd: ...`).
    pub errors: Vec<String>,
}

/// Turns successive scrapes into load reports: rates and windowed quantiles need the
/// previous scrape, and a missing score falls back on the last one for a while.
#[derive(Debug, Clone, Default)]
pub struct LoadTracker {
    prev_api: Option<ApiserverScrape>,
    prev_etcd: Option<EtcdScrape>,
    last_score: Option<f64>,
    stale: u32,
}

impl LoadTracker {
    /// Folds in one round of scrapes taken `elapsed` after the previous round. `etcd` is
    /// `None` when no etcd endpoint is configured.
    pub fn update(
        &mut self,
        cfg: &LoadConfig,
        api: Result<ApiserverScrape, String>,
        etcd: Option<Result<EtcdScrape, String>>,
        elapsed: Duration,
    ) -> LoadReport {
        let mut signals = Vec::new();
        let mut errors = Vec::new();
        let secs = elapsed.as_secs_f64();
        let mut push = |name, value: f64, saturation: f64, operation| {
            if value.is_finite() && value >= 0.0 {
                signals.push(Signal {
                    name,
                    value,
                    score: clamp(value / saturation, 0.0, 1.0),
                    operation,
                });
            }
        };
        match api {
            Ok(cur) => {
                if let Some(prev) = &self.prev_api {
                    let worst = cur
                        .etcd_request
                        .iter()
                        .filter_map(|(op, b)| {
                            let (_, pb) = prev.etcd_request.iter().find(|(o, _)| o == op)?;
                            Some((op, b.since(pb)?.quantile(0.99)?))
                        })
                        .max_by(|a, b| a.1.total_cmp(&b.1));
                    if let Some((op, p99)) = worst {
                        let sat = cfg.etcd_request_p99.as_secs_f64();
                        push("etcdRequestP99Seconds", p99, sat, Some(op.clone()));
                    }
                    if let (Some(c), Some(p)) = (cur.rejected_total, prev.rejected_total)
                        && c >= p
                        && secs > 0.0
                    {
                        push(
                            "rejectedPerSecond",
                            (c - p) / secs,
                            cfg.rejected_per_second,
                            None,
                        );
                    }
                }
                if let Some(v) = cur.inqueue {
                    push("inqueueRequests", v, cfg.inqueue_requests, None);
                }
                if let Some(v) = cur.storage_objects {
                    push("storageObjects", v, cfg.storage_objects, None);
                }
                self.prev_api = Some(cur);
            }
            Err(e) => errors.push(format!("apiserver: {e}")),
        }
        match etcd {
            Some(Ok(cur)) => {
                let p99 = match (
                    &cur.commit,
                    self.prev_etcd.as_ref().and_then(|p| p.commit.as_ref()),
                ) {
                    (Some(c), Some(p)) => c.since(p).and_then(|d| d.quantile(0.99)),
                    _ => None,
                };
                if let Some(p99) = p99 {
                    let sat = cfg.etcd_commit_p99.as_secs_f64();
                    push("etcdCommitP99Seconds", p99, sat, None);
                }
                if let Some(v) = cur.pending {
                    push("etcdPendingProposals", v, cfg.etcd_pending_proposals, None);
                }
                self.prev_etcd = Some(cur);
            }
            Some(Err(e)) => errors.push(format!("etcd: {e}")),
            None => {}
        }
        let fresh = signals.iter().map(|s| s.score).reduce(f64::max);
        let score = match fresh {
            Some(s) => {
                self.last_score = Some(s);
                self.stale = 0;
                Some(s)
            }
            None => {
                self.stale = self.stale.saturating_add(1);
                if self.stale > STALE_SAMPLES {
                    self.last_score = None;
                }
                self.last_score
            }
        };
        LoadReport {
            score,
            stale_samples: if score.is_some() { self.stale } else { 0 },
            signals,
            errors,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The running controller
// ---------------------------------------------------------------------------------------------

/// A page size shared with the reflectors (read for every page they request).
#[derive(Debug, Clone, Default)]
pub struct SharedPageSize(Arc<AtomicU32>);

impl SharedPageSize {
    pub fn new(v: u32) -> SharedPageSize {
        SharedPageSize(Arc::new(AtomicU32::new(v)))
    }

    pub fn get(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, v: u32) {
        self.0.store(v, Ordering::Relaxed);
    }
}

impl PartialEq for SharedPageSize {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for SharedPageSize {}

/// The inputs of one sample as reported.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InputsReport {
    pub downstream_list_qps: f64,
    pub downstream_lists: u64,
    pub downstream_list_latency_p95_seconds: Option<f64>,
    pub upstream_requests: u64,
    pub upstream_latency_p95_seconds: Option<f64>,
    pub load: LoadReport,
}

/// One sample: inputs, factors, sizes.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// RFC 3339.
    pub time: String,
    pub interval_seconds: f64,
    pub inputs: InputsReport,
    #[serde(flatten)]
    pub decision: Decision,
}

#[derive(Debug)]
struct Inner {
    controller: Controller,
    load: LoadTracker,
    last_sample: Instant,
    history: VecDeque<Record>,
}

/// The adaptive page-size controller of one proxy: recorders, the state, the outputs.
#[derive(Debug)]
pub struct Paging {
    cfg: PagingConfig,
    /// `cache.upstreamPageSize`, used when `adaptUpstream` is off.
    static_upstream: u32,
    upstream: SharedPageSize,
    downstream: AtomicU32,
    lists: LatencyWindow,
    inner: Mutex<Inner>,
}

impl Paging {
    pub fn new(cfg: PagingConfig, static_upstream_page_size: u32) -> Arc<Paging> {
        let controller = Controller::new(&cfg);
        let sizes = controller.page_size(&cfg);
        Arc::new(Paging {
            upstream: SharedPageSize::new(sizes.upstream),
            downstream: AtomicU32::new(sizes.downstream),
            static_upstream: static_upstream_page_size,
            lists: LatencyWindow::default(),
            inner: Mutex::new(Inner {
                controller,
                load: LoadTracker::default(),
                last_sample: Instant::now(),
                history: VecDeque::new(),
            }),
            cfg,
        })
    }

    pub fn config(&self) -> &PagingConfig {
        &self.cfg
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The adaptive upstream page size for the reflectors; `None` when `adaptUpstream` is off.
    pub fn upstream_source(&self) -> Option<SharedPageSize> {
        self.cfg.adapt_upstream.then(|| self.upstream.clone())
    }

    /// The page size of the proxy's own upstream LISTs now.
    pub fn upstream_page_size(&self) -> u32 {
        if self.cfg.adapt_upstream {
            self.upstream.get()
        } else {
            self.static_upstream
        }
    }

    /// The most items a downstream LIST page may hold now, `None` when `capDownstream` is
    /// off. A request whose `limit` is above it gets this many items and a continue token;
    /// a request without `limit` is not capped (the caller asked for everything at once).
    pub fn downstream_cap(&self) -> Option<usize> {
        self.cfg
            .cap_downstream
            .then(|| self.downstream.load(Ordering::Relaxed) as usize)
    }

    /// Records one downstream LIST's latency (until its response body ended).
    pub fn record_list(&self, latency: Duration) {
        self.lists.observe(latency);
    }

    /// One sample: reads the downstream recorder, takes the upstream window and scrapes
    /// given, steps the controller, publishes the sizes and records the sample.
    pub fn sample(
        &self,
        upstream: Window,
        api: Result<ApiserverScrape, String>,
        etcd: Option<Result<EtcdScrape, String>>,
    ) -> Record {
        self.sample_at(Instant::now(), upstream, api, etcd)
    }

    /// [`Paging::sample`] at `now` (rates are per second since the previous sample).
    pub fn sample_at(
        &self,
        now: Instant,
        upstream: Window,
        api: Result<ApiserverScrape, String>,
        etcd: Option<Result<EtcdScrape, String>>,
    ) -> Record {
        let lists = self.lists.take();
        let mut inner = self.lock();
        let elapsed = now.saturating_duration_since(inner.last_sample);
        inner.last_sample = now;
        let load = inner.load.update(&self.cfg.load, api, etcd, elapsed);
        let secs = elapsed.as_secs_f64();
        let list_p95 = lists.quantile(0.95);
        let upstream_p95 = upstream.quantile(0.95);
        let inputs = Inputs {
            list_qps: if secs > 0.0 {
                lists.count() as f64 / secs
            } else {
                0.0
            },
            list_p95,
            upstream_p95,
            load: load.score,
        };
        let decision = inner.controller.step(&self.cfg, &inputs);
        self.upstream.set(decision.page_size.upstream);
        self.downstream
            .store(decision.page_size.downstream, Ordering::Relaxed);
        let record = Record {
            time: humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string(),
            interval_seconds: secs,
            inputs: InputsReport {
                downstream_list_qps: inputs.list_qps,
                downstream_lists: lists.count(),
                downstream_list_latency_p95_seconds: list_p95.map(|d| d.as_secs_f64()),
                upstream_requests: upstream.count(),
                upstream_latency_p95_seconds: upstream_p95.map(|d| d.as_secs_f64()),
                load,
            },
            decision,
        };
        if inner.history.len() >= self.cfg.history_size.max(1) {
            inner.history.pop_front();
        }
        inner.history.push_back(record.clone());
        record
    }

    /// The latest sample, if any.
    pub fn current(&self) -> Option<Record> {
        self.lock().history.back().cloned()
    }

    /// `GET /debug/paging`: configuration switches, the page sizes in use, the latest sample
    /// and the recent ones (oldest first, at most `historySize`).
    pub fn debug_json(&self) -> serde_json::Value {
        let inner = self.lock();
        serde_json::json!({
            "adaptUpstream": self.cfg.adapt_upstream,
            "capDownstream": self.cfg.cap_downstream,
            "intervalSeconds": self.cfg.interval.as_secs_f64(),
            "pageSize": {
                "upstream": self.upstream_page_size(),
                "downstream": self.downstream_cap(),
            },
            "current": inner.history.back(),
            "history": inner.history,
        })
    }

    pub fn debug_response(&self) -> Response<Body> {
        let mut r = Response::new(body::full(self.debug_json().to_string()));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }

    /// Samples every `interval` until `shutdown`: scrapes the upstream's `/metrics` (and
    /// etcd's) with the proxy's identity, then [`Paging::sample`].
    pub fn spawn(
        self: &Arc<Self>,
        upstream: Upstream,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let timeout = this
                .cfg
                .interval
                .clamp(Duration::from_secs(1), Duration::from_secs(30));
            let etcd_client = this.cfg.etcd_metrics_url.as_ref().map(|url| {
                let client = hyper_util::client::legacy::Client::builder(
                    hyper_util::rt::TokioExecutor::new(),
                )
                .build_http::<Body>();
                (format!("{}/metrics", url.trim_end_matches('/')), client)
            });
            let scrape_all = || async {
                let api = scrape_apiserver(&upstream, timeout);
                let etcd = async {
                    match &etcd_client {
                        Some((url, client)) => Some(scrape_etcd(client, url, timeout).await),
                        None => None,
                    }
                };
                tokio::join!(api, etcd)
            };
            // The first scrape is one interval after start, not at once: the reflectors' initial
            // lists use the base size meanwhile, and a proxy that is restarted in a loop does
            // not add a multi-MiB /metrics read to each start. Counters and histograms need two
            // scrapes, so those signals appear from the second sample.
            let mut tick = tokio::time::interval(this.cfg.interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            let mut last_errors = Vec::new();
            loop {
                let (api, etcd) = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => tokio::select! {
                        _ = shutdown.cancelled() => return,
                        r = scrape_all() => r,
                    },
                };
                last_errors = log_errors(&api, &etcd, &last_errors);
                let r = this.sample(upstream.latency().take(), api, etcd);
                tracing::debug!(
                    qps = r.inputs.downstream_list_qps,
                    list_p95 = ?r.inputs.downstream_list_latency_p95_seconds,
                    upstream_p95 = ?r.inputs.upstream_latency_p95_seconds,
                    load = ?r.inputs.load.score,
                    upstream = r.decision.page_size.upstream,
                    downstream = r.decision.page_size.downstream,
                    "paging sample"
                );
            }
        })
    }
}

/// Logs scrape errors when they change (not every interval); returns the current ones.
fn log_errors(
    api: &Result<ApiserverScrape, String>,
    etcd: &Option<Result<EtcdScrape, String>>,
    last: &[String],
) -> Vec<String> {
    let mut now = Vec::new();
    if let Err(e) = api {
        now.push(format!("apiserver /metrics: {e}"));
    }
    if let Some(Err(e)) = etcd {
        now.push(format!("etcd /metrics: {e}"));
    }
    if now != last {
        for e in &now {
            tracing::warn!(error = %e, "adaptive paging: load signal unavailable (counts as no load after {STALE_SAMPLES} samples)");
        }
        if now.is_empty() {
            tracing::info!("adaptive paging: load signals available again");
        }
    }
    now
}

async fn read_metrics(resp: Response<hyper::body::Incoming>) -> Result<String, String> {
    let status = resp.status();
    if !status.is_success() {
        return Err(format!("GET /metrics returned {status}"));
    }
    let b: Bytes = http_body_util::Limited::new(resp.into_body(), MAX_METRICS_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading /metrics: {e}"))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&b).into_owned())
}

fn metrics_request(uri: http::Uri) -> Request<Body> {
    let mut req = Request::new(body::empty());
    *req.uri_mut() = uri;
    req.headers_mut()
        .insert(header::ACCEPT, HeaderValue::from_static("text/plain"));
    req
}

/// Scrapes the apiserver's `/metrics` with the proxy's identity. Not counted in the upstream
/// latency: a multi-MiB exposition says little about request latency.
async fn scrape_apiserver(
    upstream: &Upstream,
    timeout: Duration,
) -> Result<ApiserverScrape, String> {
    let req = metrics_request(upstream.uri("/metrics"));
    let fetch = async {
        let resp = upstream
            .send_untimed(req, As::Proxy, false)
            .await
            .map_err(|e| format!("GET /metrics: {e}"))?;
        read_metrics(resp).await
    };
    let text = tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("GET /metrics timed out after {timeout:?}"))??;
    Ok(ApiserverScrape::parse(&text))
}

async fn scrape_etcd(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Body,
    >,
    url: &str,
    timeout: Duration,
) -> Result<EtcdScrape, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let fetch = async {
        let resp = client
            .request(metrics_request(uri))
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        read_metrics(resp).await
    };
    let text = tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("GET {url} timed out after {timeout:?}"))??;
    Ok(EtcdScrape::parse(&text))
}

// ---------------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------------

/// The `kube_cache_proxy_page_size` and `kube_cache_proxy_paging_*` gauges, read from the
/// latest sample at scrape time. An input unknown in the latest sample has no series.
#[derive(Debug)]
pub struct PagingCollector(pub Arc<Paging>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct TargetLabels {
    target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct FactorLabels {
    factor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct SignalLabels {
    signal: String,
}

type FloatGauge = prometheus_client::metrics::gauge::Gauge<f64, AtomicU64>;

impl prometheus_client::collector::Collector for PagingCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use crate::metrics::emit;
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        let p = &self.0;
        let sizes = Family::<TargetLabels, Gauge>::default();
        sizes
            .get_or_create(&TargetLabels {
                target: "upstream".into(),
            })
            .set(i64::from(p.upstream_page_size()));
        if let Some(cap) = p.downstream_cap() {
            sizes
                .get_or_create(&TargetLabels {
                    target: "downstream".into(),
                })
                .set(cap as i64);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_page_size",
            "Page size in use: of the proxy's own upstream LISTs, and the cap on downstream pages",
            &sizes,
        )?;
        let Some(r) = p.current() else {
            return Ok(());
        };
        let i = &r.inputs;
        let gauge = |v: f64| {
            let g = FloatGauge::default();
            g.set(v);
            g
        };
        emit(
            &mut enc,
            "kube_cache_proxy_paging_downstream_list_qps",
            "Downstream LISTs per second in the last paging interval",
            &gauge(i.downstream_list_qps),
        )?;
        for (name, help, v) in [
            (
                "kube_cache_proxy_paging_downstream_list_latency_p95_seconds",
                "p95 latency of downstream LISTs in the last paging interval",
                i.downstream_list_latency_p95_seconds,
            ),
            (
                "kube_cache_proxy_paging_upstream_latency_p95_seconds",
                "p95 latency (to response headers) of the proxy's own upstream requests in the last paging interval",
                i.upstream_latency_p95_seconds,
            ),
            (
                "kube_cache_proxy_paging_load_score",
                "apiserver/etcd load score (0..1) used by adaptive paging",
                i.load.score,
            ),
        ] {
            if let Some(v) = v {
                emit(&mut enc, name, help, &gauge(v))?;
            }
        }
        let values = Family::<SignalLabels, FloatGauge>::default();
        let scores = Family::<SignalLabels, FloatGauge>::default();
        for s in &i.load.signals {
            let l = SignalLabels {
                signal: s.name.into(),
            };
            values.get_or_create(&l).set(s.value);
            scores.get_or_create(&l).set(s.score);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_paging_load_signal",
            "Load signals read from the apiserver's and etcd's /metrics",
            &values,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_paging_load_signal_score",
            "Load signals normalised to 0..1 (value / saturation, at most 1)",
            &scores,
        )?;
        let factors = Family::<FactorLabels, FloatGauge>::default();
        let f = &r.decision.factors;
        for (name, v) in [
            ("qps", f.qps),
            ("load", f.load),
            ("upstream_latency", f.upstream_latency),
            ("downstream_latency", f.downstream_latency),
        ] {
            factors
                .get_or_create(&FactorLabels {
                    factor: name.into(),
                })
                .set(v);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_paging_factor",
            "Factors of the adaptive page size in the last sample",
            &factors,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PagingConfig {
        PagingConfig::default()
    }

    const MS: fn(u64) -> Duration = Duration::from_millis;

    fn approx(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn qps_factor_is_linear_around_the_pivot_and_clamped() {
        let c = cfg();
        for (qps, want) in [
            (0.0, 0.5),
            (-5.0, 0.5),
            (f64::NAN, 0.5),
            (f64::INFINITY, 0.5),
            (200.0, 0.7),
            (500.0, 1.0),
            (1000.0, 1.5),
            (1499.0, 1.999),
            (1500.0, 2.0),
            (100_000.0, 2.0),
        ] {
            assert!(
                approx(qps_factor(&c, qps), want),
                "qps {qps}: {}",
                qps_factor(&c, qps)
            );
        }
    }

    #[test]
    fn latency_penalty_applies_strictly_above_the_threshold() {
        let c = cfg();
        assert_eq!(latency_factor(&c, None), 1.0);
        assert_eq!(latency_factor(&c, Some(MS(10))), 1.0);
        assert_eq!(latency_factor(&c, Some(MS(150))), 1.0);
        assert_eq!(
            latency_factor(&c, Some(Duration::from_micros(150_001))),
            0.6
        );
        assert_eq!(latency_factor(&c, Some(Duration::from_secs(30))), 0.6);
    }

    #[test]
    fn load_factor_has_three_regimes_and_unknown_is_no_pressure() {
        let c = cfg();
        for (load, want) in [
            (None, 1.0),
            (Some(f64::NAN), 1.0),
            (Some(0.0), 1.0),
            (Some(0.6999), 1.0),
            (Some(0.7), 0.7),
            (Some(0.8), 0.7),
            (Some(0.9), 0.7),
            (Some(0.9001), 0.4),
            (Some(1.0), 0.4),
        ] {
            assert_eq!(load_factor(&c, load), want, "load {load:?}");
        }
    }

    #[test]
    fn target_size_is_base_times_factors_within_bounds() {
        let c = cfg();
        assert_eq!(target_size(&c, 1.0), 100.0);
        assert_eq!(target_size(&c, 2.0), 200.0);
        assert!(approx(target_size(&c, 0.5 * 0.7), 35.0));
        // Every penalty at once: 100 * 0.5 * 0.6 * 0.4 = 12, raised to the minimum.
        assert_eq!(target_size(&c, 0.5 * 0.6 * 0.4), 20.0);
        let big = PagingConfig {
            base_page_size: 400,
            ..cfg()
        };
        assert_eq!(target_size(&big, 2.0), 500.0, "capped at the maximum");
    }

    /// Each regime of each factor, combined: the first step from the base (100) moves 30%
    /// of the way to the target.
    #[test]
    fn every_regime_gives_the_documented_target() {
        let c = cfg();
        let slow = Some(MS(400));
        let fast = Some(MS(20));
        for (qps, p95, load, want) in [
            (500.0, fast, Some(0.1), 100.0),
            (0.0, fast, None, 50.0),
            (2000.0, fast, Some(0.5), 200.0),
            (1000.0, fast, Some(0.5), 150.0),
            (500.0, slow, Some(0.1), 60.0),
            (500.0, fast, Some(0.8), 70.0),
            (500.0, fast, Some(0.95), 40.0),
            (2000.0, slow, Some(0.95), 48.0),
            (0.0, slow, Some(0.95), 20.0),
        ] {
            let mut ctl = Controller::new(&c);
            let d = ctl.step(
                &c,
                &Inputs {
                    list_qps: qps,
                    list_p95: p95,
                    upstream_p95: p95,
                    load,
                },
            );
            assert!(
                approx(d.target.upstream, want),
                "{qps} {p95:?} {load:?}: {d:?}"
            );
            assert!(approx(d.target.downstream, want), "{d:?}");
            assert!(
                approx(d.smoothed.upstream, 100.0 + 0.3 * (want - 100.0)),
                "{d:?}"
            );
        }
    }

    #[test]
    fn each_target_is_penalised_by_its_own_latency() {
        let c = cfg();
        let mut ctl = Controller::new(&c);
        let d = ctl.step(
            &c,
            &Inputs {
                list_qps: 500.0,
                list_p95: Some(MS(10)),
                upstream_p95: Some(MS(500)),
                load: Some(0.0),
            },
        );
        assert_eq!(d.factors.upstream_latency, 0.6);
        assert_eq!(d.factors.downstream_latency, 1.0);
        assert!(approx(d.target.upstream, 60.0));
        assert!(approx(d.target.downstream, 100.0));
    }

    #[test]
    fn the_average_starts_at_the_base_and_moves_alpha_of_the_gap_per_step() {
        let c = cfg();
        let mut ctl = Controller::new(&c);
        assert_eq!(
            ctl.page_size(&c),
            PerTarget {
                upstream: 100,
                downstream: 100
            }
        );
        let worst = Inputs {
            list_qps: 0.0,
            list_p95: Some(MS(900)),
            upstream_p95: Some(MS(900)),
            load: Some(1.0),
        };
        let sizes: Vec<u32> = (0..4)
            .map(|_| ctl.step(&c, &worst).page_size.upstream)
            .collect();
        // 100 → 76 → 59.2 → 47.44 → 39.208 (target 20).
        assert_eq!(sizes, [76, 59, 47, 39]);
        for _ in 0..100 {
            ctl.step(&c, &worst);
        }
        assert_eq!(ctl.page_size(&c).upstream, 20, "converges to the minimum");
    }

    #[test]
    fn alpha_one_means_no_smoothing() {
        let c = PagingConfig {
            ema_alpha: 1.0,
            ..cfg()
        };
        let mut ctl = Controller::new(&c);
        let d = ctl.step(
            &c,
            &Inputs {
                list_qps: 2000.0,
                ..Default::default()
            },
        );
        assert_eq!(d.page_size.downstream, 200);
    }

    #[test]
    fn a_base_outside_the_bounds_starts_within_them() {
        let c = PagingConfig {
            base_page_size: 5000,
            ..cfg()
        };
        assert_eq!(Controller::new(&c).page_size(&c).upstream, 500);
    }

    proptest::proptest! {
        #[test]
        fn page_sizes_stay_within_the_bounds_for_any_inputs(
            steps in proptest::collection::vec(
                (proptest::num::f64::ANY, proptest::option::of(0u64..100_000),
                 proptest::option::of(proptest::num::f64::ANY)),
                1..50,
            ),
            min in 1u32..100,
            span in 0u32..1000,
            base in 1u32..2000,
        ) {
            let c = PagingConfig {
                min_page_size: min,
                max_page_size: min + span,
                base_page_size: base,
                ..cfg()
            };
            let mut ctl = Controller::new(&c);
            for (qps, p95, load) in steps {
                let d = ctl.step(&c, &Inputs {
                    list_qps: qps,
                    list_p95: p95.map(Duration::from_millis),
                    upstream_p95: p95.map(Duration::from_millis),
                    load,
                });
                for s in [d.page_size.upstream, d.page_size.downstream] {
                    proptest::prop_assert!((min..=min + span).contains(&s), "{s} {d:?}");
                }
            }
        }
    }

    /// Synthetic load curves: idle, a LIST QPS spike, an etcd overload (high load score,
    /// slow requests), recovery. Checks direction, bounds and smoothing at every step.
    #[test]
    fn simulation_follows_spike_overload_and_recovery_smoothly() {
        let c = cfg();
        let mut ctl = Controller::new(&c);
        struct Phase {
            name: &'static str,
            inputs: Inputs,
            target: f64,
        }
        let phases = [
            Phase {
                name: "idle",
                inputs: Inputs {
                    list_qps: 50.0,
                    list_p95: Some(MS(20)),
                    upstream_p95: Some(MS(30)),
                    load: Some(0.2),
                },
                target: 55.0,
            },
            Phase {
                name: "qps spike",
                inputs: Inputs {
                    list_qps: 2500.0,
                    list_p95: Some(MS(60)),
                    upstream_p95: Some(MS(40)),
                    load: Some(0.3),
                },
                target: 200.0,
            },
            Phase {
                name: "etcd overload",
                inputs: Inputs {
                    list_qps: 2500.0,
                    list_p95: Some(MS(300)),
                    upstream_p95: Some(MS(800)),
                    load: Some(0.97),
                },
                target: 48.0,
            },
            Phase {
                name: "recovery",
                inputs: Inputs {
                    list_qps: 300.0,
                    list_p95: Some(MS(25)),
                    upstream_p95: Some(MS(30)),
                    load: Some(0.4),
                },
                target: 80.0,
            },
        ];
        let mut prev = 100.0;
        let mut trace = Vec::new();
        for p in &phases {
            let rising = p.target > prev;
            for i in 0..30 {
                let d = ctl.step(&c, &p.inputs);
                let s = d.smoothed.upstream;
                trace.push((p.name, d.page_size.upstream));
                assert!(approx(d.target.upstream, p.target), "{}: {d:?}", p.name);
                // Bounds.
                assert!((20..=500).contains(&d.page_size.upstream));
                assert!((20..=500).contains(&d.page_size.downstream));
                // Direction: monotone towards the phase's target, never past it.
                if rising {
                    assert!(
                        s > prev && s <= p.target + 1e-9,
                        "{} step {i}: {prev} -> {s}",
                        p.name
                    );
                } else {
                    assert!(
                        s < prev && s >= p.target - 1e-9,
                        "{} step {i}: {prev} -> {s}",
                        p.name
                    );
                }
                // Smoothing: exactly alpha of the remaining gap, so no jump to the target.
                assert!(
                    (s - prev - 0.3 * (d.target.upstream - prev)).abs() < 1e-9,
                    "{} step {i}",
                    p.name
                );
                prev = s;
            }
            // After 30 intervals the average has settled (0.7^30 of the gap is left).
            assert!((prev - p.target).abs() < 0.01, "{}: {prev}", p.name);
        }
        // The first step of the spike moved 30% of the way, not all of it.
        assert_eq!(trace[30], ("qps spike", 99));
        // And of the overload: from 200 to 200 - 0.3 * 152.
        assert_eq!(trace[60], ("etcd overload", 154));
        eprintln!("simulated upstream page sizes: {trace:?}");
    }

    #[test]
    fn latency_window_decides_the_default_threshold_exactly() {
        let c = cfg();
        for (d, want) in [(MS(150), 1.0), (Duration::from_micros(150_500), 0.6)] {
            let w = LatencyWindow::default();
            for _ in 0..100 {
                w.observe(d);
            }
            assert_eq!(latency_factor(&c, w.take().quantile(0.95)), want, "{d:?}");
        }
        // Extremes land in the end buckets instead of panicking.
        let w = LatencyWindow::default();
        w.observe(Duration::ZERO);
        w.observe(Duration::from_secs(100_000));
        assert_eq!(w.take().count(), 2);
    }

    const APISERVER_TEXT: &str = r#"# HELP etcd_request_duration_seconds [ALPHA] Etcd request latency in seconds for each operation and object type.
# TYPE etcd_request_duration_seconds histogram
etcd_request_duration_seconds_bucket{operation="get",type="/registry/pods",le="0.005"} 90
etcd_request_duration_seconds_bucket{operation="get",type="/registry/pods",le="0.1"} 100
etcd_request_duration_seconds_bucket{operation="get",type="/registry/pods",le="+Inf"} 100
etcd_request_duration_seconds_bucket{operation="get",type="/registry/configmaps",le="0.005"} 10
etcd_request_duration_seconds_bucket{operation="get",type="/registry/configmaps",le="0.1"} 10
etcd_request_duration_seconds_bucket{operation="get",type="/registry/configmaps",le="+Inf"} 10
etcd_request_duration_seconds_bucket{operation="listWithCount",type="/registry/pods",le="0.005"} 0
etcd_request_duration_seconds_bucket{operation="listWithCount",type="/registry/pods",le="0.1"} 4
etcd_request_duration_seconds_bucket{operation="listWithCount",type="/registry/pods",le="+Inf"} 4
etcd_request_duration_seconds_sum{operation="get",type="/registry/pods"} 0.3
etcd_request_duration_seconds_count{operation="get",type="/registry/pods"} 100
# TYPE apiserver_flowcontrol_current_inqueue_requests gauge
apiserver_flowcontrol_current_inqueue_requests{flow_schema="a",priority_level="workload-low"} 3
apiserver_flowcontrol_current_inqueue_requests{flow_schema="b",priority_level="global-default"} 2
apiserver_flowcontrol_rejected_requests_total{flow_schema="a",priority_level="workload-low",reason="queue-full"} 7
apiserver_storage_objects{resource="pods"} 1500
apiserver_storage_objects{resource="configmaps"} 500
apiserver_resource_objects{group="",resource="pods"} 1500
apiserver_request_total{code="200",verb="GET"} 12345
"#;

    #[test]
    fn parser_reads_names_labels_escapes_and_special_values() {
        let text = "# HELP x y\n\
            a 1\n\
            a{} 2 1700000000000\n\
            a{k=\"v\",j=\"say \\\"hi\\\"\\\\\\n\",} 3\n\
            a { k = \"sp aced\" } 4\n\
            a{le=\"+Inf\"} +Inf\n\
            a NaN\n\
            a 1e3\n\
            b 9\n\
            a{k=\"unterminated} 5\n\
            a{k} 6\n\
            a\n\
            \n";
        let s = parse_samples(text, |n| n == "a");
        let values: Vec<f64> = s.iter().map(|s| s.value).collect();
        assert_eq!(values.len(), 7, "{s:?}");
        assert_eq!(&values[..5], &[1.0, 2.0, 3.0, 4.0, f64::INFINITY]);
        assert!(values[5].is_nan());
        assert_eq!(values[6], 1000.0);
        assert_eq!(s[2].label("k"), Some("v"));
        assert_eq!(s[2].label("j"), Some("say \"hi\"\\\n"));
        assert_eq!(s[3].label("k"), Some("sp aced"));
        assert_eq!(s[4].label("le"), Some("+Inf"));
    }

    #[test]
    fn apiserver_scrape_sums_series_by_operation_and_prefers_one_objects_name() {
        let s = ApiserverScrape::parse(APISERVER_TEXT);
        assert_eq!(s.inqueue, Some(5.0));
        assert_eq!(s.rejected_total, Some(7.0));
        assert_eq!(
            s.storage_objects,
            Some(1500.0),
            "apiserver_resource_objects only"
        );
        let get = &s.etcd_request.iter().find(|(o, _)| o == "get").unwrap().1;
        assert_eq!(
            get.0,
            vec![(0.005, 100.0), (0.1, 110.0), (f64::INFINITY, 110.0)]
        );
        assert_eq!(s.etcd_request.len(), 2);
        let only_old = ApiserverScrape::parse(
            "apiserver_storage_objects{resource=\"pods\"} 42\n\
             apiserver_storage_objects{resource=\"nodes\"} -1\n",
        );
        assert_eq!(only_old.storage_objects, Some(42.0), "-1 is a failed count");
        assert_eq!(ApiserverScrape::parse(""), ApiserverScrape::default());
    }

    fn etcd_text(op: &str, fast: u64, slow: u64, rejected: u64) -> String {
        format!(
            "etcd_request_duration_seconds_bucket{{operation=\"{op}\",le=\"0.01\"}} {fast}\n\
             etcd_request_duration_seconds_bucket{{operation=\"{op}\",le=\"2\"}} {}\n\
             etcd_request_duration_seconds_bucket{{operation=\"{op}\",le=\"+Inf\"}} {}\n\
             apiserver_flowcontrol_rejected_requests_total{{reason=\"queue-full\"}} {rejected}\n\
             apiserver_flowcontrol_current_inqueue_requests 10\n",
            fast + slow,
            fast + slow
        )
    }

    #[test]
    fn load_uses_deltas_between_scrapes_and_the_worst_signal() {
        let lc = LoadConfig::default();
        let mut t = LoadTracker::default();
        let s = |text: &str| Ok(ApiserverScrape::parse(text));
        let tenth = Duration::from_secs(10);
        // First scrape: only gauges (inqueue 10 / 100).
        let r = t.update(&lc, s(&etcd_text("get", 1000, 0, 0)), None, tenth);
        assert_eq!(r.signals.len(), 1, "{r:?}");
        assert!(approx(r.score.unwrap(), 0.1));
        // Then 100 requests, all slow, and 5 rejections in 10 s: the history of fast
        // requests does not hide the current slowness.
        let r = t.update(&lc, s(&etcd_text("get", 1000, 100, 5)), None, tenth);
        let p99 = r
            .signals
            .iter()
            .find(|s| s.name == "etcdRequestP99Seconds")
            .unwrap();
        assert_eq!(p99.operation.as_deref(), Some("get"));
        assert!(p99.value > 1.9 && p99.value <= 2.0, "{p99:?}");
        assert_eq!(p99.score, 1.0, "capped at 1");
        let rej = r
            .signals
            .iter()
            .find(|s| s.name == "rejectedPerSecond")
            .unwrap();
        assert!(approx(rej.value, 0.5) && approx(rej.score, 0.5));
        assert_eq!(r.score, Some(1.0));
        // Quiet interval: no etcd requests, no p99; the inqueue gauge remains.
        let r = t.update(&lc, s(&etcd_text("get", 1000, 100, 5)), None, tenth);
        assert!(approx(r.score.unwrap(), 0.1), "{r:?}");
        // A counter reset (apiserver restart) skips the rates once instead of going negative.
        let r = t.update(&lc, s(&etcd_text("get", 3, 0, 0)), None, tenth);
        assert_eq!(r.signals.len(), 1, "{r:?}");
    }

    #[test]
    fn failed_scrapes_keep_the_last_score_for_a_while_then_it_is_unknown() {
        let lc = LoadConfig::default();
        let mut t = LoadTracker::default();
        let d = Duration::from_secs(10);
        let ok = || Ok(ApiserverScrape::parse(&etcd_text("get", 1, 0, 0)));
        assert!(approx(t.update(&lc, ok(), None, d).score.unwrap(), 0.1));
        for i in 1..=STALE_SAMPLES {
            let r = t.update(&lc, Err("timed out".into()), None, d);
            assert!(approx(r.score.unwrap(), 0.1));
            assert_eq!(r.stale_samples, i);
            assert_eq!(r.errors, ["apiserver: timed out"]);
        }
        let r = t.update(&lc, Err("timed out".into()), None, d);
        assert_eq!(r.score, None);
        assert_eq!(load_factor(&cfg(), r.score), 1.0);
        // A scrape that works but has none of the metrics is the same as no signal.
        let mut t = LoadTracker::default();
        let r = t.update(&lc, Ok(ApiserverScrape::default()), None, d);
        assert_eq!(r.score, None);
        assert!(r.errors.is_empty());
    }

    #[test]
    fn etcd_signals_join_the_score() {
        let lc = LoadConfig::default();
        let mut t = LoadTracker::default();
        let etcd = |fast: u64, slow: u64, pending: u64| {
            Some(Ok(EtcdScrape::parse(&format!(
                "etcd_disk_backend_commit_duration_seconds_bucket{{le=\"0.008\"}} {fast}\n\
                 etcd_disk_backend_commit_duration_seconds_bucket{{le=\"0.256\"}} {}\n\
                 etcd_disk_backend_commit_duration_seconds_bucket{{le=\"+Inf\"}} {}\n\
                 etcd_server_proposals_pending {pending}\n",
                fast + slow,
                fast + slow
            ))))
        };
        let d = Duration::from_secs(10);
        let r = t.update(&lc, Err("403 Forbidden".into()), etcd(10, 0, 20), d);
        assert!(approx(r.score.unwrap(), 0.2), "pending 20 / 100: {r:?}");
        let r = t.update(&lc, Err("403 Forbidden".into()), etcd(10, 50, 20), d);
        let commit = r
            .signals
            .iter()
            .find(|s| s.name == "etcdCommitP99Seconds")
            .unwrap();
        assert!(commit.value > 0.2 && commit.value <= 0.256, "{commit:?}");
        assert!(r.score.unwrap() > 0.8, "{r:?}");
        let r = t.update(
            &lc,
            Ok(ApiserverScrape::default()),
            Some(Err("refused".into())),
            d,
        );
        assert_eq!(r.errors, ["etcd: refused"]);
    }

    #[test]
    fn samples_measure_qps_publish_sizes_and_keep_bounded_history() {
        let c = PagingConfig {
            history_size: 3,
            ..cfg()
        };
        let p = Paging::new(c, 500);
        assert_eq!(p.upstream_page_size(), 100, "the base before any sample");
        assert_eq!(p.downstream_cap(), Some(100));
        for _ in 0..20_000 {
            p.record_list(MS(5));
        }
        let mut now = Instant::now() + Duration::from_secs(10);
        let up = LatencyWindow::default();
        up.observe(MS(400));
        let r = p.sample_at(now, up.take(), Ok(ApiserverScrape::default()), None);
        // 20000 LISTs in the ~10 s since the controller was created.
        assert!((r.interval_seconds - 10.0).abs() < 1.0, "{r:?}");
        assert!(approx(
            r.inputs.downstream_list_qps,
            20_000.0 / r.interval_seconds
        ));
        assert_eq!(r.decision.factors.qps, 2.0);
        assert_eq!(r.decision.factors.upstream_latency, 0.6);
        assert_eq!(r.decision.factors.downstream_latency, 1.0);
        // upstream 100 + 0.3 * (120 - 100) = 106; downstream 100 + 0.3 * (200 - 100) = 130.
        assert_eq!(p.upstream_page_size(), 106);
        assert_eq!(p.downstream_cap(), Some(130));
        assert_eq!(p.upstream_source().unwrap().get(), 106);
        for _ in 0..5 {
            now += Duration::from_secs(10);
            p.sample_at(now, Window::default(), Err("down".into()), None);
        }
        let j = p.debug_json();
        assert_eq!(j["history"].as_array().unwrap().len(), 3);
        assert_eq!(j["current"]["inputs"]["downstreamListQps"], 0.0);
        assert_eq!(
            j["current"]["inputs"]["load"]["errors"][0],
            "apiserver: down"
        );
        assert_eq!(j["current"]["pageSize"]["upstream"], p.upstream_page_size());
        assert_eq!(j["pageSize"]["downstream"], p.downstream_cap().unwrap());
    }

    #[test]
    fn switched_off_targets_use_the_static_size_and_no_cap() {
        let c = PagingConfig {
            adapt_upstream: false,
            cap_downstream: false,
            ..cfg()
        };
        let p = Paging::new(c, 500);
        assert_eq!(p.upstream_source(), None);
        assert_eq!(p.upstream_page_size(), 500);
        assert_eq!(p.downstream_cap(), None);
    }

    #[test]
    fn gauges_report_sizes_inputs_and_factors() {
        let p = Paging::new(cfg(), 500);
        let m = crate::metrics::Metrics::new();
        m.register_collector(Box::new(PagingCollector(p.clone())));
        let before = m.encode();
        assert!(
            before.contains("kube_cache_proxy_page_size{target=\"upstream\"} 100"),
            "{before}"
        );
        assert!(before.contains("kube_cache_proxy_page_size{target=\"downstream\"} 100"));
        assert!(
            !before.contains("kube_cache_proxy_paging_factor"),
            "no sample yet"
        );
        let up = LatencyWindow::default();
        up.observe(MS(20));
        p.sample(up.take(), Ok(ApiserverScrape::parse(APISERVER_TEXT)), None);
        let text = m.encode();
        for want in [
            "kube_cache_proxy_paging_factor{factor=\"qps\"} 0.5",
            "kube_cache_proxy_paging_factor{factor=\"load\"} 1.0",
            "kube_cache_proxy_paging_factor{factor=\"upstream_latency\"} 1.0",
            "kube_cache_proxy_paging_load_signal{signal=\"storageObjects\"} 1500.0",
            "kube_cache_proxy_paging_load_signal_score{signal=\"inqueueRequests\"} 0.05",
            "kube_cache_proxy_paging_load_score 0.05",
            "kube_cache_proxy_paging_downstream_list_qps 0.0",
            "kube_cache_proxy_paging_upstream_latency_p95_seconds 0.0",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        assert!(
            !text.contains("kube_cache_proxy_paging_downstream_list_latency_p95_seconds "),
            "no LIST, no p95"
        );
    }
}
