//! The load score: turns successive apiserver/etcd scrapes into signals (rates and windowed
//! p99s need the previous scrape), scores each against its saturation and keeps the last
//! score for a few failed scrapes ([`STALE_SAMPLES`]).

use std::time::Duration;

use serde::Serialize;

use super::controller::clamp;
use super::fetch::ScrapeError;
use super::scrape::{ApiserverScrape, EtcdScrape};
use crate::config::LoadConfig;

/// A failed or empty scrape keeps the last load score for this many samples (30 s at the
/// default interval): an overloaded apiserver is the likeliest to time out a scrape, so one
/// failure must not read as "no load".
pub const STALE_SAMPLES: u32 = 3;

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
        api: Result<ApiserverScrape, ScrapeError>,
        etcd: Option<Result<EtcdScrape, ScrapeError>>,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paging::controller::load_factor;

    use crate::paging::controller::tests::{approx, cfg};

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
        let timed_out = || {
            Err(ScrapeError::TimedOut {
                target: "/metrics".into(),
                after: Duration::from_secs(5),
            })
        };
        for i in 1..=STALE_SAMPLES {
            let r = t.update(&lc, timed_out(), None, d);
            assert!(approx(r.score.unwrap(), 0.1));
            assert_eq!(r.stale_samples, i);
            assert_eq!(r.errors, ["apiserver: GET /metrics timed out after 5s"]);
        }
        let r = t.update(&lc, timed_out(), None, d);
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
        let r = t.update(
            &lc,
            Err(ScrapeError::Status(http::StatusCode::FORBIDDEN)),
            etcd(10, 0, 20),
            d,
        );
        assert!(approx(r.score.unwrap(), 0.2), "pending 20 / 100: {r:?}");
        let r = t.update(
            &lc,
            Err(ScrapeError::Status(http::StatusCode::FORBIDDEN)),
            etcd(10, 50, 20),
            d,
        );
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
            Some(Err(ScrapeError::Send {
                target: "http://127.0.0.1:2381/metrics".into(),
                source: "connection refused".into(),
            })),
            d,
        );
        assert_eq!(
            r.errors,
            ["etcd: GET http://127.0.0.1:2381/metrics: connection refused"]
        );
    }
}
