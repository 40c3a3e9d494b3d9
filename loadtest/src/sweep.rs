//! Rate sweeps of a watch fan-out, shared by scenario a (JSON, ConfigMaps) and pb-fanout
//! (protobuf, pods): one measured phase per write rate and side, the capacity (the highest
//! rate at which p99 from the write's timestamp stays within [`P99_TARGET_MS`] with nothing
//! missed or duplicated) and CPU per delivery.
//!
//! At one rate, deliveries/s are that rate × the watchers on both sides (every watcher gets
//! every write): only the sweep says how far a side can go.

use serde::Serialize;

use crate::proxy::{ProxyChild, ServedBy, served};
use crate::scenarios::{Encoding, FanoutOpts, FanoutResult, watch_fanout};
use crate::{Check, Env, Usage};

/// The latency target for watch delivery (write → receipt p99), the bar of the
/// capacity figure.
pub const P99_TARGET_MS: f64 = 50.0;

/// One fan-out phase: one side, one encoding, one write rate.
#[derive(Debug, Clone, Serialize)]
pub struct FanoutPhase {
    pub side: &'static str,
    pub encoding: Encoding,
    pub rate: f64,
    pub result: FanoutResult,
    pub usage: Usage,
    /// The proxy's WATCH requests for the churned resource during the phase, by what served
    /// them (the cache, or passed through to the apiserver); zero on the apiserver's side.
    pub watches: ServedBy,
}

impl FanoutPhase {
    /// CPU µs of process `name` per delivery over the phase.
    pub fn cpu_us_per_delivery(&self, name: &str) -> Option<f64> {
        let p = self.usage.proc(name)?;
        (self.result.deliveries > 0).then(|| p.cpu_s * 1e6 / self.result.deliveries as f64)
    }

    /// Within target: p99 ≤ [`P99_TARGET_MS`], nothing missed or duplicated.
    pub fn passes(&self) -> bool {
        self.result.missed == 0
            && self.result.duplicated == 0
            && self.result.watch_errors == 0
            && self.result.latency.p99_ms <= P99_TARGET_MS
    }
}

/// Runs one fan-out phase of `o` against the proxy `px` (or the apiserver without one),
/// measured, with the proxy's WATCH requests by what served them.
pub async fn fanout_phase(
    env: &Env,
    px: Option<&ProxyChild>,
    o: &FanoutOpts,
) -> anyhow::Result<FanoutPhase> {
    let t = px.map_or(&env.direct, |p| &p.target);
    say!(
        "fan-out via {} in {:?}: {} watchers on {}, {}/s for {}s",
        t.side,
        o.encoding,
        o.watchers,
        o.churned.resource(),
        o.rate,
        o.duration_s
    );
    let resource = o.churned.resource();
    let before = served(px, resource, "WATCH").await?;
    let writer = env.admin_conn().await?;
    let (result, usage) = env
        .measure(px, watch_fanout(t, &env.direct, &writer, o))
        .await?;
    let after = served(px, resource, "WATCH").await?;
    Ok(FanoutPhase {
        side: t.side,
        encoding: o.encoding,
        rate: o.rate,
        result,
        usage,
        watches: after.since(before),
    })
}

/// Phases of `opts(rate)` at each of `rates` in increasing order, until the first that misses
/// the target (the rates above it would only cost time: a phase that falls behind waits up to
/// a minute for its watchers).
pub async fn sweep(
    env: &Env,
    px: Option<&ProxyChild>,
    rates: &[f64],
    opts: impl Fn(f64) -> FanoutOpts,
) -> anyhow::Result<Vec<FanoutPhase>> {
    let mut rates = rates.to_vec();
    rates.sort_by(f64::total_cmp);
    let mut phases = Vec::new();
    for rate in rates {
        let p = fanout_phase(env, px, &opts(rate)).await?;
        let passed = p.passes();
        phases.push(p);
        if !passed {
            break;
        }
    }
    Ok(phases)
}

/// The capacity of one side in one encoding, from its phases.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Capacity {
    /// The highest rate tried within target (`None`: none was).
    pub rate: Option<f64>,
    /// `rate` × the watchers.
    pub deliveries_per_s: Option<f64>,
    /// `rate` was the highest tried: the capacity is at least this (a lower bound).
    pub at_highest_tried: bool,
    /// Rates tried.
    pub tried: usize,
}

impl Capacity {
    pub fn of(phases: &[FanoutPhase], side: &str, encoding: Encoding) -> Capacity {
        let tried: Vec<&FanoutPhase> = phases
            .iter()
            .filter(|p| p.side == side && p.encoding == encoding)
            .collect();
        let best = tried
            .iter()
            .filter(|p| p.passes())
            .max_by(|a, b| a.rate.total_cmp(&b.rate));
        let top = tried.iter().map(|p| p.rate).fold(0.0, f64::max);
        Capacity {
            rate: best.map(|p| p.rate),
            deliveries_per_s: best.map(|p| p.rate * p.result.watchers as f64),
            at_highest_tried: best.is_some_and(|p| p.rate >= top),
            tried: tried.len(),
        }
    }
}

impl std::fmt::Display for Capacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.rate, self.deliveries_per_s) {
            (Some(r), Some(d)) if self.at_highest_tried => write!(
                f,
                "≥ {r}/s ({d:.0} deliveries/s; the highest rate tried{})",
                if self.tried == 1 {
                    ", the only one: a fixed-rate measurement"
                } else {
                    ""
                }
            ),
            (Some(r), Some(d)) => write!(f, "{r}/s ({d:.0} deliveries/s)"),
            _ => f.write_str("none of the rates tried"),
        }
    }
}

/// The check that a proxy phase's watches were all served from its cache.
pub fn watches_from_cache(what: &str, w: &ServedBy) -> Check {
    Check {
        name: format!("{what}: every watch served from the cache"),
        pass: w.upstream == 0 && w.cache > 0,
        detail: format!(
            "{} from the cache, {} passed through{}",
            w.cache,
            w.upstream,
            w.reasons_text()
        ),
    }
}

/// CPU per delivery at `rate` in `encoding`: the apiserver's (its phase) over the proxy's
/// (the proxy's phase), both processes' own CPU. `None` unless both sides ran that rate and
/// delivered.
pub fn cpu_ratio(phases: &[FanoutPhase], encoding: Encoding, rate: f64) -> Option<f64> {
    let at = |side: &str, name: &str| {
        phases
            .iter()
            .find(|p| p.side == side && p.encoding == encoding && p.rate == rate)?
            .cpu_us_per_delivery(name)
    };
    let (a, p) = (at("apiserver", "kube-apiserver")?, at("proxy", "proxy")?);
    (p > 0.0).then(|| a / p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{ProcUsage, Summary};

    fn phase(side: &'static str, rate: f64, p99_ms: f64, missed: u64, cpu_s: f64) -> FanoutPhase {
        let name = if side == "proxy" {
            "proxy"
        } else {
            "kube-apiserver"
        };
        FanoutPhase {
            side,
            encoding: Encoding::Json,
            rate,
            result: FanoutResult {
                watchers: 100,
                deliveries: 1000,
                missed,
                latency: Summary {
                    p99_ms,
                    ..Summary::default()
                },
                ..FanoutResult::default()
            },
            usage: Usage {
                wall_s: 1.0,
                procs: vec![ProcUsage {
                    name: name.into(),
                    pid: 1,
                    cpu_s,
                    cpu_pct: 0.0,
                    rss_peak_mb: 0.0,
                    rss_end_mb: 0.0,
                }],
                configmaps_requests: Default::default(),
                all_requests: 0,
                access_reviews: 0,
            },
            watches: ServedBy::default(),
        }
    }

    #[test]
    fn capacity_is_the_highest_rate_within_target_with_nothing_missed() {
        let phases = [
            phase("proxy", 10.0, 5.0, 0, 0.1),
            phase("proxy", 25.0, 20.0, 0, 0.2),
            phase("proxy", 50.0, 80.0, 0, 0.4),
            phase("apiserver", 10.0, 30.0, 0, 1.0),
            phase("apiserver", 25.0, 40.0, 3, 2.0),
        ];
        let c = Capacity::of(&phases, "proxy", Encoding::Json);
        assert_eq!(
            (c.rate, c.deliveries_per_s, c.at_highest_tried),
            (Some(25.0), Some(2500.0), false)
        );
        // Missed events fail a rate whatever its latency.
        let c = Capacity::of(&phases, "apiserver", Encoding::Json);
        assert_eq!((c.rate, c.at_highest_tried), (Some(10.0), false));
        assert_eq!(
            Capacity::of(&phases, "proxy", Encoding::Protobuf).to_string(),
            "none of the rates tried"
        );
        // Passing at the highest rate tried is a lower bound.
        let c = Capacity::of(&phases[..2], "proxy", Encoding::Json);
        assert!(c.at_highest_tried && c.to_string().starts_with("≥ 25/s"));
    }

    #[test]
    fn the_cpu_ratio_compares_each_side_s_own_process_at_one_rate() {
        let phases = [
            phase("proxy", 10.0, 5.0, 0, 0.1),
            phase("apiserver", 10.0, 30.0, 0, 1.0),
            phase("apiserver", 25.0, 40.0, 0, 2.0),
        ];
        assert_eq!(cpu_ratio(&phases, Encoding::Json, 10.0), Some(10.0));
        assert_eq!(cpu_ratio(&phases, Encoding::Json, 25.0), None);
    }
}
