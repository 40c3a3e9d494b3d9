//! Shared harness for the integration tests in `tests/`.
//!
//! Each test binary declares `mod support;` and uses only part of this harness, so items unused by
//! one binary are not dead code for the project as a whole.
#![allow(dead_code)]

pub mod differential;
pub mod e2e;
pub mod fake_apiserver;
pub mod proxy;
pub mod watch_validator;
