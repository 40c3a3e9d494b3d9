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
