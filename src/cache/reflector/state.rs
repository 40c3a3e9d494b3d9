//! The reflector's explicit state machine: its states ([`State`]), what a backoff leads to
//! ([`Next`]), how a watch ended ([`WatchOutcome`]), and the pure transitions after a failed
//! list ([`after_list_error`]) and after a watch ([`after_watch`]).

use std::time::Duration;

use tokio::time::Instant;

use super::backoff::Backoff;
use super::error::{ApiStatus, ReflectorError};
use super::stats::RelistReason;

/// A watch that ends cleanly this soon without any event is treated as an error (backoff),
/// as client-go's `watchHandler` does ("very short watch"), so a server that closes every
/// watch at once cannot make the reflector spin.
const MIN_WATCH_LIFETIME: Duration = Duration::from_secs(1);

/// After this many consecutive "Too large resource version" answers to a watch, relist instead
/// of resuming: the apiserver has already waited (3 s in the cacher) for our resourceVersion
/// each time, so it is probably not coming (e.g. etcd was restored from a backup).
const TOO_LARGE_RELIST_AFTER: u32 = 3;

/// The reflector's state. `Reflector::step` runs one state and returns the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Listing the whole collection into a side buffer, then one `sink.replace`.
    ///
    /// Entered at start ([`RelistReason::Initial`]), after a backoff whose next step is a list
    /// (410 on the watch, repeated too-large resourceVersion, a failed list), and directly after
    /// a 410 on a continue page (then `paged: false`: one unpaged request cannot hit an expired
    /// snapshot, as client-go's pager falls back to a full list). Left for `Watch` from the
    /// list's resourceVersion once delivered, for `Backoff` on any error.
    List { reason: RelistReason, paged: bool },
    /// Watching from `rv` (events after `rv`).
    ///
    /// Entered after a list, after a clean stream end or a stall (from the last resourceVersion
    /// seen, no backoff), and after a backoff whose next step is a watch. Left when the stream
    /// ends: cleanly or stalled → `Watch` again; 410 → `Backoff` then `List`; anything else →
    /// `Backoff` then `Watch` from the last resourceVersion. `too_large` counts consecutive
    /// "Too large resource version" answers.
    Watch { rv: u64, too_large: u32 },
    /// Sleeping `after` before `next`. Entered after any error; left when the time is up.
    Backoff {
        next: Next,
        after: Duration,
        /// The error that led here, for status and health reports.
        cause: String,
    },
    /// Cancelled by the shutdown token. Entered from any state; never left.
    Stopped,
}

/// What a backoff leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    List { reason: RelistReason },
    Watch { rv: u64, too_large: u32 },
}

impl From<Next> for State {
    fn from(n: Next) -> State {
        match n {
            Next::List { reason } => State::List {
                reason,
                paged: true,
            },
            Next::Watch { rv, too_large } => State::Watch { rv, too_large },
        }
    }
}

impl State {
    pub(super) fn name(&self) -> &'static str {
        match self {
            State::List { .. } => "list",
            State::Watch { .. } => "watch",
            State::Backoff { .. } => "backoff",
            State::Stopped => "stopped",
        }
    }
}

/// How a watch ended.
#[derive(Debug)]
pub enum WatchEnd {
    /// The request failed before any stream: transport error or an error status.
    Refused(ReflectorError),
    /// The server ended the stream cleanly (timeoutSeconds, apiserver shutdown).
    Closed,
    /// The stream broke: connection lost, or data that cannot be decoded.
    Broken(ReflectorError),
    /// An ERROR event carrying a Status.
    ErrorEvent(ApiStatus),
    /// No event or bookmark within the stall timeout.
    Stalled,
}

/// What one watch attempt did, for [`after_watch`].
#[derive(Debug)]
pub struct WatchOutcome {
    /// The resourceVersion the watch started from.
    pub from: u64,
    /// The last resourceVersion delivered (events and bookmarks); `from` if none.
    pub last_rv: u64,
    /// Events and bookmarks delivered.
    pub delivered: u64,
    /// From sending the request to the end.
    pub lived: Duration,
    pub end: WatchEnd,
}

/// The state after a failed list attempt. Pure.
///
/// A 410 on a continue page restarts at once, unpaged; anything else backs off and lists again
/// (the list is a consistent read from scratch, nothing to resume).
pub fn after_list_error(
    err: &ReflectorError,
    on_continue: bool,
    backoff: &mut Backoff,
    now: Instant,
    unit: f64,
) -> State {
    if on_continue && err.status().is_some_and(ApiStatus::is_expired) {
        return State::List {
            reason: RelistReason::ContinueExpired,
            paged: false,
        };
    }
    let after = delay_for(err.status(), backoff, now, unit);
    State::Backoff {
        next: Next::List {
            reason: RelistReason::Retry,
        },
        after,
        cause: err.to_string(),
    }
}

/// The state after a watch ended. Pure.
pub fn after_watch(
    out: &WatchOutcome,
    too_large: u32,
    backoff: &mut Backoff,
    now: Instant,
    unit: f64,
) -> State {
    let rv = out.last_rv;
    // Progress resets the count: the apiserver did reach our resourceVersion.
    let too_large = if out.delivered > 0 { 0 } else { too_large };
    let resume = Next::Watch { rv, too_large: 0 };
    let status = match &out.end {
        WatchEnd::Closed if out.delivered == 0 && out.lived < MIN_WATCH_LIFETIME => {
            return State::Backoff {
                next: resume,
                after: backoff.next_delay(now, unit),
                cause: format!(
                    "very short watch: ended after {:?} with no events",
                    out.lived
                ),
            };
        }
        WatchEnd::Closed | WatchEnd::Stalled => return resume.into(),
        WatchEnd::Broken(e) => {
            return State::Backoff {
                next: resume,
                after: backoff.next_delay(now, unit),
                cause: e.to_string(),
            };
        }
        WatchEnd::Refused(e) => match e.status() {
            Some(s) => s.clone(),
            None => {
                return State::Backoff {
                    next: resume,
                    after: backoff.next_delay(now, unit),
                    cause: e.to_string(),
                };
            }
        },
        WatchEnd::ErrorEvent(s) => s.clone(),
    };
    if status.is_expired() {
        // 410 is not a sign of overload but of a history gap: every moment spent backing off
        // is a moment the cache serves state it knows to be behind, so relist at once (a
        // failing LIST still backs off). client-go backs off here; it is one of thousands of
        // clients, the proxy is the only one.
        return Next::List {
            reason: RelistReason::Expired,
        }
        .into();
    }
    let after = delay_for(Some(&status), backoff, now, unit);
    let cause = format!("watch from resourceVersion {rv}: {status}");
    let next = if status.is_expired() {
        Next::List {
            reason: RelistReason::Expired,
        }
    } else if status.is_too_large_resource_version() {
        if too_large + 1 >= TOO_LARGE_RELIST_AFTER {
            Next::List {
                reason: RelistReason::TooLargeResourceVersion,
            }
        } else {
            Next::Watch {
                rv,
                too_large: too_large + 1,
            }
        }
    } else {
        resume
    };
    State::Backoff { next, after, cause }
}

/// The backoff delay, at least what the server asked for with Retry-After (429, 504).
fn delay_for(
    status: Option<&ApiStatus>,
    backoff: &mut Backoff,
    now: Instant,
    unit: f64,
) -> Duration {
    let d = backoff.next_delay(now, unit);
    match status.and_then(|s| s.retry_after) {
        Some(ra) => d.max(ra),
        None => d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cache::reflector::backoff::test_backoff as backoff;
    use crate::cache::reflector::error::test_status as status;

    fn outcome(end: WatchEnd, delivered: u64) -> WatchOutcome {
        WatchOutcome {
            from: 10,
            last_rv: if delivered > 0 { 12 } else { 10 },
            delivered,
            lived: Duration::from_secs(30),
            end,
        }
    }

    fn refused(s: ApiStatus) -> WatchEnd {
        WatchEnd::Refused(ReflectorError::Status {
            what: "watch",
            status: s,
        })
    }

    #[test]
    fn clean_end_and_stall_resume_from_last_rv_without_backoff() {
        let mut b = backoff();
        let now = Instant::now();
        for end in [WatchEnd::Closed, WatchEnd::Stalled] {
            let s = after_watch(&outcome(end, 2), 0, &mut b, now, 0.0);
            assert_eq!(
                s,
                State::Watch {
                    rv: 12,
                    too_large: 0
                }
            );
        }
        // No backoff step consumed.
        assert_eq!(b.next_delay(now, 0.0), Duration::from_millis(800));
    }

    #[test]
    fn very_short_empty_watch_backs_off() {
        let mut b = backoff();
        let mut out = outcome(WatchEnd::Closed, 0);
        out.lived = Duration::from_millis(10);
        let s = after_watch(&out, 0, &mut b, Instant::now(), 0.0);
        assert!(
            matches!(
                s,
                State::Backoff {
                    next: Next::Watch { rv: 10, .. },
                    ..
                }
            ),
            "{s:?}"
        );
    }

    #[test]
    fn expired_on_watch_relists_at_once() {
        let mut b = backoff();
        for end in [
            WatchEnd::ErrorEvent(status(410, "Expired")),
            refused(status(410, "Gone")),
        ] {
            let s = after_watch(&outcome(end, 0), 0, &mut b, Instant::now(), 0.0);
            let State::List { reason, .. } = s else {
                panic!("{s:?}");
            };
            assert_eq!(reason, RelistReason::Expired);
        }
    }

    #[test]
    fn connection_errors_and_5xx_resume_from_last_rv_after_backoff() {
        let mut b = backoff();
        let now = Instant::now();
        let broken = WatchEnd::Broken(ReflectorError::TruncatedLine);
        let s = after_watch(&outcome(broken, 1), 0, &mut b, now, 0.0);
        assert_eq!(
            s,
            State::Backoff {
                next: Next::Watch {
                    rv: 12,
                    too_large: 0
                },
                after: Duration::from_millis(800),
                cause: ReflectorError::TruncatedLine.to_string(),
            }
        );
        let s = after_watch(
            &outcome(refused(status(500, "InternalError")), 0),
            0,
            &mut b,
            now,
            0.0,
        );
        assert!(
            matches!(s, State::Backoff { next: Next::Watch { rv: 10, too_large: 0 }, after, .. } if after == Duration::from_millis(1600)),
            "{s:?}"
        );
        let s = after_watch(
            &outcome(WatchEnd::ErrorEvent(status(500, "InternalError")), 0),
            0,
            &mut b,
            now,
            0.0,
        );
        assert!(
            matches!(
                s,
                State::Backoff {
                    next: Next::Watch { rv: 10, .. },
                    ..
                }
            ),
            "{s:?}"
        );
    }

    #[test]
    fn retry_after_is_a_minimum_delay() {
        let mut b = backoff();
        let mut s429 = status(429, "TooManyRequests");
        s429.retry_after = Some(Duration::from_secs(5));
        let s = after_watch(&outcome(refused(s429), 0), 0, &mut b, Instant::now(), 0.0);
        assert!(
            matches!(s, State::Backoff { after, .. } if after == Duration::from_secs(5)),
            "{s:?}"
        );
    }

    #[test]
    fn too_large_rv_retries_the_watch_then_relists_on_the_third() {
        let mut b = backoff();
        let mut tl = status(504, "Timeout");
        tl.causes
            .push(("ResourceVersionTooLarge".into(), String::new()));
        let now = Instant::now();
        let mut count = 0;
        let mut nexts = Vec::new();
        for _ in 0..3 {
            let s = after_watch(&outcome(refused(tl.clone()), 0), count, &mut b, now, 0.0);
            let State::Backoff { next, .. } = s else {
                panic!("{s:?}");
            };
            if let Next::Watch { too_large, .. } = next {
                count = too_large;
            }
            nexts.push(next);
        }
        assert_eq!(
            nexts,
            [
                Next::Watch {
                    rv: 10,
                    too_large: 1
                },
                Next::Watch {
                    rv: 10,
                    too_large: 2
                },
                Next::List {
                    reason: RelistReason::TooLargeResourceVersion
                },
            ]
        );
    }

    #[test]
    fn list_errors_back_off_except_expired_continue_restarts_unpaged() {
        let mut b = backoff();
        let now = Instant::now();
        let gone = ReflectorError::Status {
            what: "list",
            status: status(410, "Expired"),
        };
        assert_eq!(
            after_list_error(&gone, true, &mut b, now, 0.0),
            State::List {
                reason: RelistReason::ContinueExpired,
                paged: false
            }
        );
        let s = after_list_error(&gone, false, &mut b, now, 0.0);
        assert!(
            matches!(s, State::Backoff { next: Next::List { reason: RelistReason::Retry }, after, .. } if after == Duration::from_millis(800)),
            "{s:?}"
        );
    }
}
