//! Adaptive page size: a pure controller fed every `paging.interval` with what the proxy
//! observes, driving the page size of its own upstream LISTs and (opt-in, not conformant) a cap on
//! downstream pages.
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
//! defaults are issue 7's policy; every constant is in
//! [`PagingConfig`](crate::config::PagingConfig).
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
//! `kube_cache_proxy_paging_*` gauges ([`PagingCollector`]), and `GET /debug/paging` on the
//! admin listener ([`Paging::debug_json`]).
//!
//! # Files
//! [`controller`] (the policy, pure), [`promtext`] (the Prometheus text format), [`scrape`]
//! (what one `/metrics` text says), [`load`] (the load score across scrapes), [`fetch`]
//! (reading `/metrics`), [`service`] (the running controller: sampling task, published sizes,
//! `/debug/paging`), [`collector`] (the gauges).

pub mod collector;
pub mod controller;
pub mod fetch;
pub mod load;
pub mod promtext;
pub mod scrape;
pub mod service;

pub use crate::metrics::window::{LatencyWindow, Window, histogram_quantile};
pub use collector::PagingCollector;
pub use controller::{
    Controller, Decision, Factors, Inputs, PerTarget, latency_factor, load_factor, qps_factor,
    target_size,
};
pub use load::{LoadReport, LoadTracker, STALE_SAMPLES, Signal};
pub use promtext::{Sample, parse_samples};
pub use scrape::{ApiserverScrape, Buckets, EtcdScrape};
pub use service::{InputsReport, Paging, Record, SharedPageSize};
