//! kube-cache-proxy: a watch-aware caching proxy between Kubernetes controllers and
//! kube-apiserver.
//!
//! Controllers' kubeconfigs point at the proxy. Requests it does not serve from memory pass
//! through to the apiserver with the caller's own identity; see `../shared/ARCHITECTURE.md`
//! for the whole design.
//!
//! # Layout
//!
//! - [`config`]: the typed configuration file, defaults with their reasons, validation.
//! - [`server`]: listeners (TLS with ALPN h2/http1.1, plain loopback), connection limits,
//!   the per-request entry point, graceful drain.
//! - [`coalesce`]: per-connection write coalescing (what one poll of a connection writes,
//!   HTTP/2 frames of many watch streams included, leaves in one write).
//! - [`local_streams`]: an HTTP/2 connection's streams run inside the connection's task
//!   (one wake per connection per fan-out, not one task per stream).
//! - [`tls`]: rustls server config, serving-certificate hot reload, client-CA verification.
//! - [`identity`]: who the caller is, and the identity headers sent upstream (header hygiene).
//! - [`request_info`]: path hygiene and the apiserver's `RequestInfo` (verb, resource, scope).
//! - [`upstream`]: clients to kube-apiserver from kubeconfig / in-cluster config.
//! - [`router`]: the pure cache-or-passthrough decision.
//! - [`consistency`]: when an unset-resourceVersion read may come from the cache (strict, bounded).
//! - [`authn`]: authentication of cache-served requests (client certificates, token file,
//!   offline-verified ServiceAccount JWTs, TokenReview); verified identities and tenants.
//! - [`authz`]: authorization of cache-served reads by SubjectAccessReview, the apiserver's
//!   403, impersonation checks for client-certificate callers.
//! - [`tenancy`]: tenants' quotas (watches, read rate, list size) and filtered cluster views.
//! - [`cache`]: per-resource store (objects as bytes + parsed metadata, snapshots, history),
//!   readiness, the registry of cached resources (named, or `all`; custom resources followed
//!   through their CRDs) and their metrics.
//! - [`reflector`]: the upstream LIST+WATCH state machine feeding a cache.
//! - [`hub`]: watch fan-out with bounded per-watcher queues and the slow-watcher policy.
//! - [`watch`]: downstream watches served from the cache (start points, bookmarks, timeouts).
//! - [`list`]: GET and LIST served from the cache: snapshots, pages, every resourceVersion form.
//! - [`token`]: signed continue tokens bound to the caller and the query; key rotation.
//! - [`paging`]: the adaptive page-size controller (QPS, latency and apiserver/etcd load in,
//!   upstream page size and downstream page cap out).
//! - [`selector`]: label and field selectors, parsed and evaluated as the apiserver does.
//! - [`passthrough`]: streaming proxying of requests, watches and protocol upgrades.
//! - [`drain`]: body wrappers ending watch streams cleanly at shutdown, request accounting.
//! - [`health`]: `/livez`, `/readyz`, `/healthz` in the apiserver's format.
//! - [`metrics`]: Prometheus metrics labelled like the apiserver's.
//! - [`api`]: Kubernetes wire types the proxy writes itself (`Status`).
//! - [`body`]: the streaming body type shared by all of the above.
//! - [`devcluster`]: a real local kube-apiserver + etcd for end-to-end tests and `dev` mode.
//! - [`cli`]: the `serve`, `check-config` and `dev` commands.

#![forbid(unsafe_code)]

pub mod api;
pub mod authn;
pub mod authz;
pub mod body;
pub mod cache;
pub mod cli;
pub mod coalesce;
pub mod config;
pub mod consistency;
pub mod devcluster;
pub mod drain;
pub mod health;
pub mod hub;
pub mod identity;
pub mod list;
pub mod local_streams;
pub mod metrics;
pub mod paging;
pub mod passthrough;
pub mod reflector;
pub mod request_info;
pub mod router;
pub mod selector;
pub mod server;
pub mod tenancy;
pub mod tls;
pub mod token;
pub mod upstream;
pub mod watch;
