//! The composition root: builds every component from the configuration, starts the
//! listeners, and the command line (`serve`, `check-config`, `dev`). Dev mode (the `dev`
//! command and [`dev`], its local control plane) is the `dev` cargo feature, on by default.

pub mod cli;
pub mod collectors;
#[cfg(feature = "dev")]
pub mod dev;
pub mod log_sink;
pub mod memory;
pub mod start;
