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
    let mut pace = Pace::new(limit);
    loop {
        let polled_at = Instant::now();
        let last = match poll().await {
            Ok(value) => return Ok(value),
            Err(observed) => observed,
        };
        if !pace.again(polled_at).await {
            return Err(last);
        }
    }
}

/// [`eventually`] with a synchronous poll. Its future holds no borrow across an await of a
/// future the poll made, so it can run in a spawned task whose other locals are borrowed by
/// the poll (an async closure borrowing them makes such a task's future not `Send`, a
/// limitation of rustc's higher-ranked `Send` inference).
pub async fn eventually_sync<T, O: Debug>(
    what: &str,
    limit: Duration,
    poll: impl FnMut() -> Result<T, O>,
) -> T {
    match poll_within_sync(limit, poll).await {
        Ok(value) => value,
        Err(last) => {
            panic!("timed out after {limit:?} waiting for {what}; last observed: {last:?}")
        }
    }
}

/// [`poll_within`] with a synchronous poll (see [`eventually_sync`]).
pub async fn poll_within_sync<T, O>(
    limit: Duration,
    mut poll: impl FnMut() -> Result<T, O>,
) -> Result<T, O> {
    let mut pace = Pace::new(limit);
    loop {
        let polled_at = Instant::now();
        let last = match poll() {
            Ok(value) => return Ok(value),
            Err(observed) => observed,
        };
        if !pace.again(polled_at).await {
            return Err(last);
        }
    }
}

/// The pauses between polls, up to a deadline.
struct Pace {
    deadline: Instant,
    pause: Duration,
}

impl Pace {
    fn new(limit: Duration) -> Pace {
        Pace {
            deadline: Instant::now() + limit,
            pause: FIRST_PAUSE,
        }
    }

    /// After a failed poll made at `polled_at`: false once that poll was at or after the
    /// deadline, else pauses and returns true.
    async fn again(&mut self, polled_at: Instant) -> bool {
        if polled_at >= self.deadline {
            return false;
        }
        tokio::time::sleep(
            self.pause
                .min(self.deadline - Instant::now().min(self.deadline)),
        )
        .await;
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        true
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
