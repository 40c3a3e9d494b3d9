//! kube-cache-proxy: a watch-aware caching proxy between Kubernetes controllers and
//! kube-apiserver.
//!
//! Controllers' kubeconfigs point at the proxy. Reads it can answer exactly come from memory;
//! everything else passes through to the apiserver with the caller's own identity. The design,
//! one request's path and one event's path are in `docs/architecture.md` in the repository.
//!
//! # Layout
//!
//! Dependencies point one way, down this list (`.ci/module-cycles.py` checks it):
//!
//! - [`app`]: the composition root (builds every component, starts the listeners), the CLI
//!   (`serve`, `check-config`, `dev`) and the local control plane of `dev` mode.
//! - [`serve`]: the request pipeline (one request's path: hygiene, local endpoints, cache or
//!   apiserver), the passthrough proxy, the proxy's health endpoints, the shared state.
//! - [`read`]: reads from the cache: routing and planning, GET/LIST over snapshots, continue
//!   tokens, watches, the consistency policy for reads without a resourceVersion.
//! - [`tenancy`]: tenants' quotas (watches, read rate, list size) and filtered cluster views.
//! - [`auth`]: identities and identity headers, authentication, authorization (SAR),
//!   impersonation checks.
//! - [`cache`]: per-resource store (objects as bytes + parsed metadata, snapshots, history),
//!   the watch fan-out hub, the upstream reflector, the registry of cached resources
//!   (named, `all`, CRDs) and discovery.
//! - [`paging`]: the adaptive page-size controller and the signals it reads.
//! - [`upstream`]: clients to kube-apiserver (kubeconfig / in-cluster), upstream latency.
//! - [`k8s`]: the Kubernetes model: `Status`, `RequestInfo`, resources, selectors, the JSON
//!   scanner. Pure.
//! - [`http`]: the transport: listeners, TLS, HTTP/1.1 + HTTP/2 connections, write
//!   coalescing, a connection's streams in its own task, bodies and drain.
//! - [`telemetry`]: OpenTelemetry spans (OTLP export, off by default) and W3C trace context
//!   in and out; the current span travels with the running future, so any module opens a
//!   child span or sends `traceparent` upstream without being handed anything.
//! - [`config`], [`metrics`]: leaves that import nothing of the crate.

#![forbid(unsafe_code)]

pub mod app;
pub mod auth;
pub mod cache;
pub mod config;
pub mod http;
pub mod k8s;
pub mod metrics;
pub mod paging;
pub mod read;
pub mod serve;
pub mod telemetry;
pub mod tenancy;
pub mod upstream;
