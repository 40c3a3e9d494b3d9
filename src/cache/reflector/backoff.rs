//! The delay between failed attempts: client-go's exponential backoff with jitter, and the
//! randomness for it.

use std::time::Duration;

use tokio::time::Instant;

/// client-go's `exponentialBackoffManagerImpl` (k8s.io/apimachinery `wait/backoff.go`) with
/// the reflector's parameters: each call returns the current step jittered into
/// `[d, 2d)` (`wait.Jitter(d, 1.0)` = `d + rand[0,1) * d`), then doubles the step, capped at
/// `max` *before* jitter (so sleeps reach up to `2 * max`). If the previous backoff *started*
/// more than `reset_after` ago, the step starts again from `initial`: a watch that has been
/// healthy that long gets the short delay again.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    reset_after: Duration,
    step: Duration,
    last_start: Option<Instant>,
}

impl Backoff {
    pub fn new(initial: Duration, max: Duration, reset_after: Duration) -> Backoff {
        Backoff {
            initial,
            max,
            reset_after,
            step: initial.min(max),
            last_start: None,
        }
    }

    /// The next delay at `now`, with `unit` a random number in `[0, 1)`.
    pub fn next_delay(&mut self, now: Instant, unit: f64) -> Duration {
        if self
            .last_start
            .is_some_and(|t| now.saturating_duration_since(t) > self.reset_after)
        {
            self.step = self.initial.min(self.max);
        }
        self.last_start = Some(now);
        let d = self.step;
        self.step = self.step.saturating_mul(2).min(self.max);
        jitter(d, unit)
    }
}

/// `d + unit * d` with `unit` clamped into `[0, 1)`: client-go's `wait.Jitter(d, 1.0)`.
pub(super) fn jitter(d: Duration, unit: f64) -> Duration {
    let unit = if unit.is_finite() {
        unit.clamp(0.0, 1.0)
    } else {
        0.0
    };
    d + d.mul_f64(unit)
}

/// A random number in `[0, 1)`, for jitter (not for anything secret).
pub(super) fn random_unit() -> f64 {
    fastrand::f64()
}

/// The reflector's backoff with client-go's parameters (800 ms initial, 30 s cap, reset
/// after 2 min), shared by the tests of the reflector's files.
#[cfg(test)]
pub(super) fn test_backoff() -> Backoff {
    Backoff::new(
        Duration::from_millis(800),
        Duration::from_secs(30),
        Duration::from_secs(120),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff() -> Backoff {
        test_backoff()
    }

    #[test]
    fn backoff_doubles_from_800ms_caps_at_30s_without_jitter() {
        let mut b = backoff();
        let t = Instant::now();
        let got: Vec<u128> = (0..8)
            .map(|i| b.next_delay(t + Duration::from_secs(i), 0.0).as_millis())
            .collect();
        assert_eq!(got, [800, 1600, 3200, 6400, 12_800, 25_600, 30_000, 30_000]);
    }

    #[test]
    fn backoff_jitter_lies_in_d_to_2d() {
        let mut b = backoff();
        let t = Instant::now();
        assert_eq!(b.next_delay(t, 0.5), Duration::from_millis(1200));
        assert_eq!(
            b.next_delay(t, 0.999_999),
            Duration::from_micros(3_199_998) + Duration::from_nanos(400)
        );
        // Out-of-range randomness is clamped, never shortening or exploding the delay.
        assert_eq!(b.next_delay(t, -1.0), Duration::from_millis(3200));
        assert_eq!(b.next_delay(t, f64::NAN), Duration::from_millis(6400));
    }

    #[test]
    fn backoff_resets_when_previous_backoff_started_over_2min_ago() {
        let mut b = backoff();
        let t = Instant::now();
        b.next_delay(t, 0.0);
        b.next_delay(t, 0.0);
        assert_eq!(
            b.next_delay(t + Duration::from_secs(120), 0.0),
            Duration::from_millis(3200)
        );
        let later = t + Duration::from_secs(241);
        assert_eq!(b.next_delay(later, 0.0), Duration::from_millis(800));
    }

    #[test]
    fn random_unit_is_in_range() {
        for _ in 0..1000 {
            let u = random_unit();
            assert!((0.0..1.0).contains(&u), "{u}");
        }
    }
}
