//! The request pipeline: one request's path from the connection to a response, served from
//! the cache or handed to the apiserver, and the proxy's own local endpoints.

pub mod access;
pub mod admin;
pub mod caller;
pub mod health;
pub mod homing;
pub mod passthrough;
pub mod pipeline;
pub mod state;
