//! Latency windows: what the adaptive page-size controller reads of the upstream's and the
//! lists' latencies, and Prometheus' `histogram_quantile` over cumulative buckets.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

fn clamp(v: f64, lo: f64, hi: f64) -> f64 {
    // Not f64::clamp: it panics on lo > hi.
    v.max(lo).min(hi)
}

/// Buckets per doubling of latency: bounds 9% apart.
const STEPS_PER_DOUBLING: i32 = 8;
/// Bounds from 150 ms · 2^-10 (0.15 ms) to 150 ms · 2^10 (154 s). 150 ms is a bound, so the
/// default threshold is decided exactly.
const STEPS_EACH_SIDE: i32 = 10 * STEPS_PER_DOUBLING;
const PIVOT_SECONDS: f64 = 0.150;
const FINITE_BUCKETS: usize = (2 * STEPS_EACH_SIDE + 1) as usize;

fn bucket_bound(i: usize) -> f64 {
    PIVOT_SECONDS * 2f64.powf(f64::from(i as i32 - STEPS_EACH_SIDE) / f64::from(STEPS_PER_DOUBLING))
}

/// Latencies observed since the last [`LatencyWindow::take`], in fixed log-spaced buckets of
/// relaxed atomics: recording is a few instructions and never blocks the request path.
#[derive(Debug)]
pub struct LatencyWindow {
    /// `counts[i]` for `i < FINITE_BUCKETS`: latencies in `(bound(i-1), bound(i)]`; the last
    /// one: above every bound.
    counts: Box<[AtomicU64]>,
}

impl Default for LatencyWindow {
    fn default() -> Self {
        LatencyWindow {
            counts: (0..=FINITE_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl LatencyWindow {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = if s <= 0.0 {
            0
        } else {
            let steps = (f64::from(STEPS_PER_DOUBLING) * (s / PIVOT_SECONDS).log2()).ceil();
            // The float log can land one step off right at a bound; fix it up against the
            // bounds themselves so `le` semantics hold exactly.
            let mut i = clamp(
                steps + f64::from(STEPS_EACH_SIDE),
                0.0,
                FINITE_BUCKETS as f64,
            ) as usize;
            while i < FINITE_BUCKETS && s > bucket_bound(i) {
                i += 1;
            }
            while i > 0 && s <= bucket_bound(i - 1) {
                i -= 1;
            }
            i
        };
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The observations since the previous call, resetting the window.
    pub fn take(&self) -> Window {
        let mut cumulative = Vec::with_capacity(self.counts.len());
        let mut total = 0u64;
        for (i, c) in self.counts.iter().enumerate() {
            total += c.swap(0, Ordering::Relaxed);
            let le = if i < FINITE_BUCKETS {
                bucket_bound(i)
            } else {
                f64::INFINITY
            };
            cumulative.push((le, total as f64));
        }
        Window { cumulative }
    }
}

/// A taken [`LatencyWindow`]: cumulative `(le, count)` buckets, the last `le` infinite.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Window {
    cumulative: Vec<(f64, f64)>,
}

impl Window {
    pub fn count(&self) -> u64 {
        self.cumulative.last().map_or(0, |(_, c)| *c as u64)
    }

    /// The `q` quantile, `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        histogram_quantile(q, &self.cumulative).map(Duration::from_secs_f64)
    }
}

/// Prometheus' `histogram_quantile` over cumulative `(le, count)` buckets sorted by `le`, the
/// last one `+Inf`: linear interpolation inside the bucket holding the rank; a rank in the
/// `+Inf` bucket gives the highest finite bound. `None` without observations.
pub fn histogram_quantile(q: f64, cumulative: &[(f64, f64)]) -> Option<f64> {
    let &(last_le, total) = cumulative.last()?;
    if total.is_nan() || total <= 0.0 || !last_le.is_infinite() || cumulative.len() < 2 {
        return None;
    }
    let rank = clamp(q, 0.0, 1.0) * total;
    let i = cumulative.iter().position(|&(_, c)| c >= rank)?;
    if i == cumulative.len() - 1 {
        return Some(cumulative[i - 1].0);
    }
    let (upper, count) = cumulative[i];
    let (lower, below) = if i == 0 {
        (0.0f64.min(upper), 0.0)
    } else {
        cumulative[i - 1]
    };
    let in_bucket = count - below;
    if in_bucket <= 0.0 {
        return Some(upper);
    }
    Some(lower + (upper - lower) * (rank - below) / in_bucket)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approx(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn histogram_quantile_interpolates_like_prometheus() {
        let b = [(0.1, 50.0), (0.2, 100.0), (f64::INFINITY, 100.0)];
        assert!(approx(histogram_quantile(0.5, &b).unwrap(), 0.1));
        assert!(approx(histogram_quantile(0.75, &b).unwrap(), 0.15));
        assert!(approx(histogram_quantile(0.25, &b).unwrap(), 0.05));
        // A rank in the +Inf bucket gives the highest finite bound.
        let inf = [(0.1, 0.0), (0.2, 1.0), (f64::INFINITY, 10.0)];
        assert_eq!(histogram_quantile(0.99, &inf), Some(0.2));
        assert_eq!(
            histogram_quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]),
            None
        );
        assert_eq!(histogram_quantile(0.5, &[]), None);
        assert_eq!(
            histogram_quantile(0.5, &[(0.1, 3.0)]),
            None,
            "no +Inf bucket"
        );
    }

    #[test]
    fn latency_window_p95_and_reset() {
        let w = LatencyWindow::default();
        assert_eq!(w.take().quantile(0.95), None);
        for _ in 0..95 {
            w.observe(Duration::from_millis(10));
        }
        for _ in 0..5 {
            w.observe(Duration::from_secs(2));
        }
        let t = w.take();
        assert_eq!(t.count(), 100);
        let p95 = t.quantile(0.95).unwrap();
        // Within the 9% bucket holding 10 ms.
        assert!(
            p95 > Duration::from_millis(9) && p95 <= Duration::from_millis(11),
            "{p95:?}"
        );
        let p99 = t.quantile(0.99).unwrap();
        assert!(
            p99 > Duration::from_millis(1800) && p99 <= Duration::from_millis(2100),
            "{p99:?}"
        );
        assert_eq!(w.take().count(), 0, "take resets the window");
    }
}
