//! The transport: listeners, TLS, connections (HTTP/1.1 and HTTP/2), write coalescing, a
//! connection's HTTP/2 streams in its own task, the streaming body type and drain-aware body
//! wrappers, the byte budgets of what clients have not read yet, the `#` of an HTTP/1
//! request target that hyper drops. It knows nothing of Kubernetes: the request pipeline
//! ([`crate::serve`]) is handed to it as a service.

pub mod body;
pub mod budget;
pub mod coalesce;
pub mod drain;
pub mod listener;
pub mod local_streams;
pub mod raw_target;
pub mod tls;
