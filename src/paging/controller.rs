//! The page-size policy, pure: the factors (QPS, latency, load), the unsmoothed target size
//! within the bounds, and the controller's moving average per target. No clock, no I/O:
//! [`Controller::step`] folds one sample of [`Inputs`] into a [`Decision`].

use std::time::Duration;

use serde::Serialize;

use crate::config::PagingConfig;

pub(super) fn clamp(v: f64, lo: f64, hi: f64) -> f64 {
    // Not f64::clamp: it panics on lo > hi, which validation rules out but a hand-built
    // config in a test might not.
    v.max(lo).min(hi)
}

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

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::metrics::window::LatencyWindow;

    // Shared with the other paging files' tests.
    /// The defaults, with the opt-in downstream cap on (the tests look at both sizes).
    pub(in crate::paging) fn cfg() -> PagingConfig {
        PagingConfig {
            cap_downstream: true,
            ..PagingConfig::default()
        }
    }

    pub(in crate::paging) const MS: fn(u64) -> Duration = Duration::from_millis;

    pub(in crate::paging) fn approx(a: f64, b: f64) -> bool {
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
}
