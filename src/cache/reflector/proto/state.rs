//! The protobuf side's explicit state machine: its states ([`ProtoState`]), how one watch
//! ended ([`ProtoWatchOutcome`]), and the pure transition after a watch ([`after_proto_watch`]).

use std::time::Duration;

use tokio::time::Instant;

use super::frame::FrameError;
use crate::cache::reflector::backoff::Backoff;
use crate::cache::reflector::error::{ApiStatus, ReflectorError};

/// A watch that ends cleanly this soon without any event is treated as an error (backoff), as
/// the JSON reflector and client-go's `watchHandler` do, so a server that closes every watch at
/// once cannot make the task spin.
const MIN_WATCH_LIFETIME: Duration = Duration::from_secs(1);

/// After this many consecutive "Too large resource version" answers to a resumed watch, start
/// over: the apiserver has waited for our resourceVersion each time (the JSON reflector's rule).
const TOO_LARGE_RESTART_AFTER: u32 = 3;

/// The protobuf side's state. The task runs one state and returns the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtoState {
    /// A watch with `sendInitialEvents=true`: the current state as ADDED events, the
    /// initial-events-end BOOKMARK, then changes.
    ///
    /// Entered at start, after a 410 (HTTP status or ERROR event), after repeated
    /// too-large resourceVersions, and after any end of an initial watch before its
    /// initial-events-end bookmark (its initial events cannot be resumed: they come in key
    /// order, not resourceVersion order). Left like `Resume` once the stream ends.
    Initial,
    /// A watch from `rv` (changes after it), without initial events.
    ///
    /// Entered after a synced watch ended (cleanly, stalled: at once; broken, refused: after a
    /// backoff), from the last resourceVersion seen. `too_large` counts consecutive "Too large
    /// resource version" answers.
    Resume { rv: u64, too_large: u32 },
    /// Sleeping `after` before `next`. Entered after any error; left when the time is up.
    Backoff {
        next: Box<ProtoState>,
        after: Duration,
        /// The error that led here, for logs and the stats.
        cause: String,
    },
    /// Cancelled by the shutdown token. Entered from any state; never left.
    Stopped,
}

impl ProtoState {
    pub(super) fn name(&self) -> &'static str {
        match self {
            ProtoState::Initial => "initial",
            ProtoState::Resume { .. } => "resume",
            ProtoState::Backoff { .. } => "backoff",
            ProtoState::Stopped => "stopped",
        }
    }
}

/// Why a protobuf watch failed.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    /// Sending, the apiserver's error answer, or reading the body.
    #[error(transparent)]
    Upstream(#[from] ReflectorError),
    /// The stream's bytes cannot be read as frames and events.
    #[error(transparent)]
    Frame(#[from] FrameError),
    #[error("protobuf watch: answered with content type {0:?}")]
    NotProtobuf(String),
    #[error("protobuf watch: a {got:?} object in a watch of {want:?}")]
    WrongKind { got: String, want: String },
}

impl ProtoError {
    fn status(&self) -> Option<&ApiStatus> {
        match self {
            ProtoError::Upstream(ReflectorError::Status { status, .. }) => Some(status),
            _ => None,
        }
    }

    /// The apiserver gave no answer (reported to [`crate::upstream::reachability`]).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, ProtoError::Upstream(e) if e.is_unreachable())
    }
}

/// How a watch ended.
#[derive(Debug)]
pub enum ProtoWatchEnd {
    /// The request failed before any stream: transport error or an error status.
    Refused(ProtoError),
    /// The server ended the stream cleanly (timeoutSeconds, apiserver shutdown).
    Closed,
    /// The stream broke: connection lost, a cut frame, data that cannot be decoded.
    Broken(ProtoError),
    /// An ERROR event carrying a Status.
    ErrorEvent(ApiStatus),
    /// No frame within the stall timeout.
    Stalled,
}

/// What one watch did, for [`after_proto_watch`].
#[derive(Debug)]
pub struct ProtoWatchOutcome {
    /// Whether the stream holds a complete state to resume from: a resumed watch, or an
    /// initial one whose initial-events-end bookmark arrived.
    pub synced: bool,
    /// The last resourceVersion of a synced stream (an event or a bookmark); where it started
    /// if nothing came.
    pub last_rv: u64,
    /// Frames delivered (objects and bookmarks).
    pub delivered: u64,
    /// From sending the request to the end.
    pub lived: Duration,
    pub end: ProtoWatchEnd,
}

/// The state after a watch ended. Pure.
///
/// A synced stream resumes from its last resourceVersion; an unsynced one starts over with
/// initial events. 410 starts over at once (a history gap: every moment spent backing off the
/// attached bytes fall further behind); other errors back off first.
pub fn after_proto_watch(
    out: &ProtoWatchOutcome,
    too_large: u32,
    backoff: &mut Backoff,
    now: Instant,
    unit: f64,
) -> ProtoState {
    let too_large = if out.delivered > 0 { 0 } else { too_large };
    let again = if out.synced {
        ProtoState::Resume {
            rv: out.last_rv,
            too_large: 0,
        }
    } else {
        ProtoState::Initial
    };
    let back_off =
        |next: ProtoState, cause: String, backoff: &mut Backoff, s: Option<&ApiStatus>| {
            let d = backoff.next_delay(now, unit);
            ProtoState::Backoff {
                next: Box::new(next),
                after: s.and_then(|s| s.retry_after).map_or(d, |ra| d.max(ra)),
                cause,
            }
        };
    let status = match &out.end {
        ProtoWatchEnd::Closed if out.delivered == 0 && out.lived < MIN_WATCH_LIFETIME => {
            let cause = format!(
                "very short watch: ended after {:?} with no events",
                out.lived
            );
            return back_off(again, cause, backoff, None);
        }
        ProtoWatchEnd::Closed | ProtoWatchEnd::Stalled => return again,
        ProtoWatchEnd::Broken(e) => return back_off(again, e.to_string(), backoff, None),
        ProtoWatchEnd::Refused(e) => match e.status() {
            Some(s) => s.clone(),
            None => return back_off(again, e.to_string(), backoff, None),
        },
        ProtoWatchEnd::ErrorEvent(s) => s.clone(),
    };
    let cause = format!("protobuf watch: {status}");
    if status.is_expired() {
        return match again {
            // An initial watch has no resourceVersion to expire: a 410 there is not a gap,
            // so it is not retried at once.
            ProtoState::Initial => back_off(ProtoState::Initial, cause, backoff, Some(&status)),
            _ => ProtoState::Initial,
        };
    }
    let next = match again {
        ProtoState::Resume { rv, .. } if status.is_too_large_resource_version() => {
            if too_large + 1 >= TOO_LARGE_RESTART_AFTER {
                ProtoState::Initial
            } else {
                ProtoState::Resume {
                    rv,
                    too_large: too_large + 1,
                }
            }
        }
        other => other,
    };
    back_off(next, cause, backoff, Some(&status))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::reflector::backoff::test_backoff as backoff;
    use crate::cache::reflector::error::test_status as status;

    fn outcome(end: ProtoWatchEnd, synced: bool, delivered: u64) -> ProtoWatchOutcome {
        ProtoWatchOutcome {
            synced,
            last_rv: 12,
            delivered,
            lived: Duration::from_secs(30),
            end,
        }
    }

    fn next_of(s: ProtoState) -> ProtoState {
        match s {
            ProtoState::Backoff { next, .. } => *next,
            other => panic!("no backoff: {other:?}"),
        }
    }

    #[test]
    fn a_synced_watch_resumes_from_its_last_rv_and_an_unsynced_one_starts_over() {
        let mut b = backoff();
        let now = Instant::now();
        let resume = ProtoState::Resume {
            rv: 12,
            too_large: 0,
        };
        for end in [ProtoWatchEnd::Closed, ProtoWatchEnd::Stalled] {
            assert_eq!(
                after_proto_watch(&outcome(end, true, 3), 0, &mut b, now, 0.0),
                resume
            );
        }
        let s = after_proto_watch(
            &outcome(ProtoWatchEnd::Closed, false, 3),
            0,
            &mut b,
            now,
            0.0,
        );
        assert_eq!(s, ProtoState::Initial);
        let broken = || ProtoWatchEnd::Broken(FrameError::Truncated(3).into());
        let s = after_proto_watch(&outcome(broken(), true, 3), 0, &mut b, now, 0.0);
        assert_eq!(next_of(s), resume);
        let s = after_proto_watch(&outcome(broken(), false, 3), 0, &mut b, now, 0.0);
        assert_eq!(next_of(s), ProtoState::Initial);
    }

    #[test]
    fn expired_starts_over_at_once_and_other_errors_back_off() {
        let mut b = backoff();
        let now = Instant::now();
        let gone = ProtoWatchEnd::ErrorEvent(status(410, "Expired"));
        assert_eq!(
            after_proto_watch(&outcome(gone, true, 0), 0, &mut b, now, 0.0),
            ProtoState::Initial
        );
        let refused = ProtoWatchEnd::Refused(
            ReflectorError::Status {
                what: "watch",
                status: status(410, "Gone"),
            }
            .into(),
        );
        assert_eq!(
            after_proto_watch(&outcome(refused, true, 0), 0, &mut b, now, 0.0),
            ProtoState::Initial
        );
        // 410 to an initial watch: backed off, not a tight loop.
        let gone = ProtoWatchEnd::ErrorEvent(status(410, "Expired"));
        let s = after_proto_watch(&outcome(gone, false, 0), 0, &mut b, now, 0.0);
        assert_eq!(next_of(s), ProtoState::Initial);
        let mut slow = status(429, "TooManyRequests");
        slow.retry_after = Some(Duration::from_secs(90));
        let s = after_proto_watch(
            &outcome(ProtoWatchEnd::ErrorEvent(slow), true, 0),
            0,
            &mut b,
            now,
            0.0,
        );
        let ProtoState::Backoff { after, next, .. } = s else {
            panic!("{s:?}")
        };
        assert_eq!(after, Duration::from_secs(90), "Retry-After honoured");
        assert_eq!(
            *next,
            ProtoState::Resume {
                rv: 12,
                too_large: 0
            }
        );
    }

    #[test]
    fn a_very_short_empty_watch_backs_off_and_repeated_too_large_starts_over() {
        let mut b = backoff();
        let now = Instant::now();
        let mut short = outcome(ProtoWatchEnd::Closed, true, 0);
        short.lived = Duration::from_millis(10);
        assert!(matches!(
            after_proto_watch(&short, 0, &mut b, now, 0.0),
            ProtoState::Backoff { .. }
        ));
        let mut too_large = status(504, "Timeout");
        too_large
            .causes
            .push(("ResourceVersionTooLarge".into(), String::new()));
        let end = || ProtoWatchEnd::ErrorEvent(too_large.clone());
        let s = after_proto_watch(&outcome(end(), true, 0), 0, &mut b, now, 0.0);
        assert_eq!(
            next_of(s),
            ProtoState::Resume {
                rv: 12,
                too_large: 1
            }
        );
        let s = after_proto_watch(&outcome(end(), true, 0), 2, &mut b, now, 0.0);
        assert_eq!(next_of(s), ProtoState::Initial);
    }
}
