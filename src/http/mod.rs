//! The transport: listeners, TLS, connections (HTTP/1.1 and HTTP/2), write coalescing, a
//! connection's HTTP/2 streams in its own task, the streaming body type and drain-aware body
//! wrappers, the byte budgets of what clients have not read yet. It knows nothing of Kubernetes: the request pipeline ([`crate::serve`]) is
//! handed to it as a service.

pub mod body;
pub mod budget;
pub mod coalesce;
pub mod drain;
pub mod listener;
pub mod local_streams;
pub mod tls;
