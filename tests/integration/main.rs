//! The integration tier: the proxy (and its parts) against the in-process fake apiserver of
//! `tests/support/fake_apiserver`, with fault injection. One test binary; each module is one
//! concern (run one with `cargo test --test integration -- paging::`).

#[path = "../support/mod.rs"]
mod support;

mod admin;
mod authn;
mod backfill;
mod check_config;
mod crd;
mod dev;
mod downstream_budget;
mod fake_apiserver;
mod fault_tier;
mod homing;
mod initializing;
mod lists;
mod ops;
mod otel;
mod outage;
mod paging;
mod passthrough;
mod reflector;
mod slow_consumer;
mod tenancy;
mod warm_restart;
mod watch_fields;
mod watch_validator;
