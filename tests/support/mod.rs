//! Shared harness of the two test binaries, `tests/integration/` (the in-process fake
//! apiserver tier) and `tests/e2e/` (a real kube-apiserver).
//!
//! Each binary declares `#[path = "../support/mod.rs"] mod support;` and uses only part of this
//! harness, so items unused by one binary are not dead code for the project as a whole.
#![allow(dead_code)]

pub mod balancer;
pub mod components;
pub mod differential;
pub mod e2e;
pub mod eventually;
pub mod fake_apiserver;
pub mod otlp;
pub mod pb;
pub mod proxy;
pub mod raw_http1;
pub mod watch_validator;
