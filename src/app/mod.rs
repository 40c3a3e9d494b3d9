//! The composition root: builds every component from the configuration, starts the
//! listeners, and the command line (`serve`, `check-config`, `dev`).

pub mod cli;
pub mod collectors;
pub mod dev;
pub mod start;
