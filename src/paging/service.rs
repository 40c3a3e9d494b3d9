//! The running controller of one proxy: the downstream LIST recorder, the sampling task that
//! scrapes the load signals every `paging.interval` and steps the [`Controller`], the page
//! sizes it publishes (to the reflectors through [`SharedPageSize`], to the list code as a
//! cap), the recent samples and `GET /debug/paging`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use http::{HeaderValue, Response, header};
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::controller::{Controller, Decision, Inputs};
use super::fetch::{ScrapeError, scrape_apiserver, scrape_etcd};
use super::load::{LoadReport, LoadTracker, STALE_SAMPLES};
use super::scrape::{ApiserverScrape, EtcdScrape};
use crate::config::PagingConfig;
use crate::http::body::{self, Body};
use crate::metrics::window::{LatencyWindow, Window};
use crate::upstream::Upstream;

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

    fn lock(&self) -> parking_lot::MutexGuard<'_, Inner> {
        self.inner.lock()
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
        api: Result<ApiserverScrape, ScrapeError>,
        etcd: Option<Result<EtcdScrape, ScrapeError>>,
    ) -> Record {
        self.sample_at(Instant::now(), upstream, api, etcd)
    }

    /// [`Paging::sample`] at `now` (rates are per second since the previous sample).
    pub fn sample_at(
        &self,
        now: Instant,
        upstream: Window,
        api: Result<ApiserverScrape, ScrapeError>,
        etcd: Option<Result<EtcdScrape, ScrapeError>>,
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
    api: &Result<ApiserverScrape, ScrapeError>,
    etcd: &Option<Result<EtcdScrape, ScrapeError>>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paging::scrape::ApiserverScrape;

    use crate::paging::controller::tests::{MS, approx, cfg};

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
            let down = Err(ScrapeError::Status(http::StatusCode::SERVICE_UNAVAILABLE));
            p.sample_at(now, Window::default(), down, None);
        }
        let j = p.debug_json();
        assert_eq!(j["history"].as_array().unwrap().len(), 3);
        assert_eq!(j["current"]["inputs"]["downstreamListQps"], 0.0);
        assert_eq!(
            j["current"]["inputs"]["load"]["errors"][0],
            "apiserver: GET /metrics returned 503 Service Unavailable"
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
}
