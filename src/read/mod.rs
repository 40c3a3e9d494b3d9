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
