//! `paging.*`: the adaptive page-size controller's policy and load thresholds.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The adaptive page-size controller (`src/paging/`): every `interval` it reads the
/// downstream LIST rate and latency, the upstream request latency and the apiserver's (and
/// optionally etcd's) load, and computes
/// `clamp(basePageSize * qpsFactor * latencyFactor * loadFactor, minPageSize, maxPageSize)`,
/// smoothed by an exponential moving average. The defaults are the policy of issue 7.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct PagingConfig {
    /// The proxy's own upstream LISTs (initial sync, relists) use the adaptive page size;
    /// off: `cache.upstreamPageSize`.
    pub adapt_upstream: bool,
    /// Opt-in, NOT conformant: downstream LISTs with a `limit` above the adaptive size get a
    /// shorter page with a continue token. The apiserver returns `min(limit, remaining)`
    /// items and Kubernetes' conformance tests check that, so this stays off unless an
    /// operator accepts clients seeing shorter pages. Requests without `limit` are never
    /// capped.
    pub cap_downstream: bool,
    /// How often the inputs are sampled and the page size recomputed.
    #[serde(with = "super::duration")]
    pub interval: Duration,
    /// The page size when every factor is 1.
    pub base_page_size: u32,
    /// Bounds of the unsmoothed page size.
    pub min_page_size: u32,
    pub max_page_size: u32,
    /// QPS factor `clamp(1 + (qps - qpsPivot) / qpsScale, minQpsFactor, maxQpsFactor)`,
    /// where qps is the downstream LIST rate: busy readers get bigger pages (fewer round
    /// trips), idle ones smaller.
    pub qps_pivot: f64,
    pub qps_scale: f64,
    pub min_qps_factor: f64,
    pub max_qps_factor: f64,
    /// A p95 latency above this multiplies the page size by `latencyPenalty`.
    #[serde(with = "super::duration")]
    pub latency_threshold: Duration,
    pub latency_penalty: f64,
    /// Load factor: 1 below `moderateLoad`, `moderateLoadFactor` from `moderateLoad` to
    /// `highLoad` inclusive, `highLoadFactor` above.
    pub moderate_load: f64,
    pub high_load: f64,
    pub moderate_load_factor: f64,
    pub high_load_factor: f64,
    /// Weight of the newest sample in the moving average (1: no smoothing).
    pub ema_alpha: f64,
    /// Samples kept for `GET /debug/paging`.
    pub history_size: usize,
    /// etcd's metrics endpoint (`http://host:port`, etcd's `--listen-metrics-urls`), read for
    /// backend commit latency and pending proposals. Unset: apiserver signals only.
    pub etcd_metrics_url: Option<String>,
    pub load: LoadConfig,
}

impl Default for PagingConfig {
    fn default() -> Self {
        PagingConfig {
            adapt_upstream: true,
            cap_downstream: false,
            interval: Duration::from_secs(10),
            base_page_size: 100,
            min_page_size: 20,
            max_page_size: 500,
            qps_pivot: 500.0,
            qps_scale: 1000.0,
            min_qps_factor: 0.5,
            max_qps_factor: 2.0,
            latency_threshold: Duration::from_millis(150),
            latency_penalty: 0.6,
            moderate_load: 0.7,
            high_load: 0.9,
            moderate_load_factor: 0.7,
            high_load_factor: 0.4,
            ema_alpha: 0.3,
            history_size: 60,
            etcd_metrics_url: None,
            load: LoadConfig::default(),
        }
    }
}

impl PagingConfig {
    /// Adds a problem for each field out of its domain (see [`super::Config::validate`]).
    pub(super) fn validate_into(&self, err: &mut impl FnMut(&str, String)) {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if self.interval.is_zero() {
            err("paging.interval", "must be greater than 0".into());
        }
        if self.min_page_size == 0 {
            err("paging.minPageSize", "must be at least 1".into());
        }
        if self.min_page_size > self.max_page_size {
            err(
                "paging.maxPageSize",
                format!("must be at least minPageSize ({})", self.min_page_size),
            );
        }
        if self.base_page_size == 0 {
            err("paging.basePageSize", "must be at least 1".into());
        }
        for (path, v) in [
            ("paging.qpsScale", self.qps_scale),
            ("paging.minQpsFactor", self.min_qps_factor),
            ("paging.maxQpsFactor", self.max_qps_factor),
            ("paging.latencyPenalty", self.latency_penalty),
            ("paging.moderateLoadFactor", self.moderate_load_factor),
            ("paging.highLoadFactor", self.high_load_factor),
            ("paging.load.inqueueRequests", self.load.inqueue_requests),
            (
                "paging.load.rejectedPerSecond",
                self.load.rejected_per_second,
            ),
            ("paging.load.storageObjects", self.load.storage_objects),
            (
                "paging.load.etcdPendingProposals",
                self.load.etcd_pending_proposals,
            ),
        ] {
            if !positive(v) {
                err(path, format!("must be a number greater than 0, not {v}"));
            }
        }
        if !self.qps_pivot.is_finite() {
            err("paging.qpsPivot", "must be a finite number".into());
        }
        if self.min_qps_factor > self.max_qps_factor {
            err(
                "paging.maxQpsFactor",
                "must be at least minQpsFactor".into(),
            );
        }
        if !(self.moderate_load.is_finite()
            && self.high_load.is_finite()
            && self.moderate_load <= self.high_load)
        {
            err(
                "paging.highLoad",
                "must be a number at least moderateLoad".into(),
            );
        }
        if !(self.ema_alpha > 0.0 && self.ema_alpha <= 1.0) {
            err("paging.emaAlpha", "must be in (0, 1]".into());
        }
        if self.history_size == 0 {
            err("paging.historySize", "must be at least 1".into());
        }
        if self.load.etcd_request_p99.is_zero() {
            err(
                "paging.load.etcdRequestP99",
                "must be greater than 0".into(),
            );
        }
        if self.load.etcd_commit_p99.is_zero() {
            err("paging.load.etcdCommitP99", "must be greater than 0".into());
        }
        if let Some(url) = &self.etcd_metrics_url {
            let ok = url
                .parse::<http::Uri>()
                .is_ok_and(|u| u.scheme_str() == Some("http") && u.host().is_some());
            if !ok {
                err(
                    "paging.etcdMetricsUrl",
                    format!("{url:?} is not an http://host:port URL"),
                );
            }
        }
    }
}

/// How each load signal maps to 0..1: `min(value / saturation, 1)`; the load score is the
/// highest of the signals present (one saturated resource is overload, and a missing
/// signal cannot dilute the others).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct LoadConfig {
    /// p99 of `etcd_request_duration_seconds` (the worst operation) counted as full load.
    /// Healthy etcd answers in a few milliseconds; a second is far past any SLO.
    #[serde(with = "super::duration")]
    pub etcd_request_p99: Duration,
    /// Requests waiting in API Priority and Fairness queues
    /// (`apiserver_flowcontrol_current_inqueue_requests`, all levels) counted as full load.
    pub inqueue_requests: f64,
    /// Rate of `apiserver_flowcontrol_rejected_requests_total` (per second) counted as full
    /// load: sustained rejections are overload by definition.
    pub rejected_per_second: f64,
    /// Objects in storage (`apiserver_storage_objects`, all resources) counted as full load:
    /// big stores make every range read heavier.
    pub storage_objects: f64,
    /// p99 of etcd's `etcd_disk_backend_commit_duration_seconds` counted as full load (etcd
    /// guidance: below 25 ms).
    #[serde(with = "super::duration")]
    pub etcd_commit_p99: Duration,
    /// `etcd_server_proposals_pending` counted as full load.
    pub etcd_pending_proposals: f64,
}

impl Default for LoadConfig {
    fn default() -> Self {
        LoadConfig {
            etcd_request_p99: Duration::from_secs(1),
            inqueue_requests: 100.0,
            rejected_per_second: 1.0,
            storage_objects: 1_000_000.0,
            etcd_commit_p99: Duration::from_millis(250),
            etcd_pending_proposals: 100.0,
        }
    }
}
