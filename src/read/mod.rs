//! Reads served from the cache: the routing and planning of a read (pure functions), GET and
//! LIST over snapshots with signed continue tokens, watches, and the consistency policy for
//! reads without a resourceVersion.

pub mod consistency;
pub mod list;
pub mod router;
pub mod token;
pub mod watch;
