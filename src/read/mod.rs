//! Reads served from the cache: the routing and planning of a read (pure functions), GET and
//! LIST over snapshots with signed continue tokens, watches, and the consistency policy for
//! reads without a resourceVersion.
//!
//! Every step of a cache read answers with [`Served`]: the response, or [`NotServed`] — hand
//! the request to the apiserver (with the reason, for the debug log), or refuse it with a
//! Kubernetes `Status` that the request pipeline writes.

pub mod consistency;
pub mod list;
pub mod plan;
pub mod router;
pub mod table;
pub mod token;
pub mod watch;

use http::Response;

use crate::http::body::Body;
use crate::k8s::status::Status;

/// Why a cache read did not produce a response.
#[derive(Debug)]
pub enum NotServed {
    /// The apiserver answers, for this reason (it also writes the exact error for anything
    /// invalid the cache does not implement).
    Delegate(&'static str),
    /// The proxy refuses with this `Status` (401, 403, 400 for a bad continue token, 410,
    /// 429, 503), written by the request pipeline. Boxed: a `Served` stays small on the
    /// hot path, where refusals are rare.
    Refuse(Box<Status>),
}

impl From<Status> for NotServed {
    fn from(s: Status) -> Self {
        NotServed::Refuse(Box::new(s))
    }
}

impl From<Box<Status>> for NotServed {
    fn from(s: Box<Status>) -> Self {
        NotServed::Refuse(s)
    }
}

impl From<crate::tenancy::Refusal> for NotServed {
    fn from(r: crate::tenancy::Refusal) -> Self {
        Status::from(r).into()
    }
}

/// The outcome of a step of a cache read.
pub type Served<T = Response<Body>> = Result<T, NotServed>;

/// Hands the request to the apiserver, for `why`.
pub fn delegate<T>(why: &'static str) -> Served<T> {
    Err(NotServed::Delegate(why))
}

/// Why a read at a resourceVersion the cache has not reached goes to the apiserver.
pub const NOT_REACHED: &str = "resourceVersion not reached";

/// Why a read of the most recent state goes to the apiserver.
pub const NOT_CONFIRMED: &str = "consistent read not confirmed";

/// Whether a read handed to the apiserver for `why` needs state newer than the cache holds:
/// while the apiserver is unreachable, only it could answer, so the read fails at once
/// (`unreachable`) instead of waiting for a connection that does not come.
pub fn needs_newer_state(why: &str) -> bool {
    why == NOT_REACHED || why == NOT_CONFIRMED
}

/// The answer to a read that needs the apiserver while it is unreachable: 503 with
/// `Retry-After`, what a client of an apiserver that cannot serve a request gets (client-go
/// retries it after the delay). A watch gets 429 instead ([`watch_unreachable`]).
pub fn unreachable(outage: &crate::upstream::reachability::Outage) -> Status {
    Status::service_unavailable(
        format!(
            "the apiserver has been unreachable for {}s: this read needs state newer than the \
             proxy's cache holds (reads with resourceVersion=0 are served from the cache)",
            outage.duration().as_secs()
        ),
        1,
    )
}

/// Waits, bounded, for the sides of `cache` a read needs (the JSON cache; with `protobuf`
/// its protobuf side; with `latest`, a watch of the most recent state, the upstream watch's
/// first confirmation) to become ready: `Ok` once they are. Otherwise, as kube-apiserver
/// answers while its watch cache initializes (`router::Unready::Wait`): 429 "storage is
/// (re)initializing" with `Retry-After` while they are still starting, so the client comes
/// back (client-go retries a watch so without relisting) and finds them ready; the
/// apiserver when they cannot become ready ([`crate::cache::store::STARTING`] has passed,
/// stopped, shed).
pub async fn initialized(
    cache: &crate::cache::ResourceCache,
    protobuf: bool,
    latest: bool,
    bound: std::time::Duration,
) -> Served<()> {
    use crate::cache::Side;
    let not_coming = || {
        delegate(if cache.is_ready() {
            "protobuf side not synced"
        } else {
            "cache not synced"
        })
    };
    match cache.side(protobuf, latest) {
        Side::Ready => return Ok(()),
        Side::Failing => return not_coming(),
        Side::Starting => {}
    }
    let deadline = tokio::time::Instant::now() + bound;
    let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
    if cache.wait_ready(bound).await {
        if latest {
            cache.wait_confirmed(left()).await;
        }
        if protobuf {
            cache.wait_protobuf_ready(left()).await;
        }
    }
    match cache.side(protobuf, latest) {
        Side::Ready => Ok(()),
        Side::Failing => not_coming(),
        Side::Starting => Err(initializing(cache.starting_for(protobuf)).into()),
    }
}

/// kube-apiserver's answer to a read its initializing watch cache refuses
/// (k8s.io/apiserver `storage/cacher`): 429 "storage is (re)initializing", its
/// `Retry-After` growing with how long the cache has been down (`downtime`).
pub fn initializing(downtime: std::time::Duration) -> Status {
    Status::failure(
        http::StatusCode::TOO_MANY_REQUESTS,
        crate::k8s::status::Reason::TooManyRequests,
        "storage is (re)initializing",
    )
    .with_retry_after(retry_after_unready(downtime))
}

/// The cacher's `calculateRetryAfterForUnreadyCache`: e^(0.06 s⁻¹ × downtime), within
/// [1, 30] seconds (1 s for the first 11 s, 6 s at 30 s).
pub fn retry_after_unready(downtime: std::time::Duration) -> u32 {
    (0.06 * downtime.as_secs_f64()).exp().clamp(1.0, 30.0) as u32
}

/// The answer to a watch that needs the apiserver while it cannot be reached: 429 with
/// `Retry-After`. Direct, such a client would get "connection refused", on which client-go's
/// reflector backs off and watches again from its resourceVersion; on 429 it does the same,
/// on a 503 it lists everything again (`isWatchErrorRetriable` in reflector.go). A 503 here
/// would turn every informer's watch during an apiserver restart into a relist.
pub fn watch_unreachable(message: impl Into<String>) -> Status {
    Status::failure(
        http::StatusCode::TOO_MANY_REQUESTS,
        crate::k8s::status::Reason::TooManyRequests,
        message,
    )
    .with_retry_after(1)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn retry_after_an_unready_cache_grows_as_the_apiservers() {
        for (secs, want) in [
            (0, 1),
            (11, 1),
            (12, 2),
            (30, 6),
            (45, 14),
            (56, 28),
            (57, 30),
            (3600, 30),
        ] {
            assert_eq!(
                super::retry_after_unready(Duration::from_secs(secs)),
                want,
                "{secs} s"
            );
        }
        let s = super::initializing(Duration::ZERO);
        assert_eq!(s.code(), 429);
        assert_eq!(s.message(), "storage is (re)initializing");
    }
}
