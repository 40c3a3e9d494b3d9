//! Waiting for a condition that becomes true asynchronously: the tests' one polling loop.

use std::fmt::Debug;
use std::time::Duration;

use tokio::time::Instant;

/// The first pause between two polls; it doubles after each poll, up to [`MAX_PAUSE`]. Short:
/// some conditions (an upstream outage noticed, readiness failing during a shutdown delay) hold
/// only for a while.
const FIRST_PAUSE: Duration = Duration::from_millis(5);
const MAX_PAUSE: Duration = Duration::from_millis(50);

/// Polls `poll` until it returns `Ok(value)` and returns the value; panics naming `what` (what
/// is waited for) and the last observation (the last `Err`) once `limit` has passed without
/// success.
///
/// `limit` is a generous upper bound for a loaded machine (the tests share two cores), never the
/// thing tested: a test that measures time asserts on its own measurement. `poll` is called at
/// least once, and once at or after `limit` before giving up, so a slow poll does not cut the
/// wait short. An assertion inside `poll` fails the test at once.
///
/// ```ignore
/// eventually("a background refresh", GUARD, async || {
///     let fetches = count(&fake, "/openid/v1/jwks");
///     ok_if(fetches >= 2, fetches)
/// })
/// .await;
/// ```
pub async fn eventually<T, O: Debug>(
    what: &str,
    limit: Duration,
    poll: impl AsyncFnMut() -> Result<T, O>,
) -> T {
    match poll_within(limit, poll).await {
        Ok(value) => value,
        Err(last) => {
            panic!("timed out after {limit:?} waiting for {what}; last observed: {last:?}")
        }
    }
}

/// [`eventually`] without the panic: `Err(last observation)` once `limit` has passed, for a
/// test whose own checks afterwards say best what went wrong.
pub async fn poll_within<T, O>(
    limit: Duration,
    mut poll: impl AsyncFnMut() -> Result<T, O>,
) -> Result<T, O> {
    let deadline = Instant::now() + limit;
    let mut pause = FIRST_PAUSE;
    loop {
        let polled_at = Instant::now();
        let last = match poll().await {
            Ok(value) => return Ok(value),
            Err(observed) => observed,
        };
        if polled_at >= deadline {
            return Err(last);
        }
        tokio::time::sleep(pause.min(deadline - Instant::now().min(deadline))).await;
        pause = (pause * 2).min(MAX_PAUSE);
    }
}

/// `Ok(observed)` when `condition` holds, else `Err(observed)`: the usual result of a poll.
pub fn ok_if<O>(condition: bool, observed: O) -> Result<O, O> {
    if condition {
        Ok(observed)
    } else {
        Err(observed)
    }
}
