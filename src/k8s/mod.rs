//! The Kubernetes model the proxy reads and writes: `Status` errors, the apiserver's
//! `RequestInfo`, resource types, label and field selectors, and the JSON scanner that reads
//! objects without decoding them. Pure data and functions: nothing here does I/O.

pub mod request_info;
pub mod resource;
pub mod scan;
pub mod selector;
pub mod status;

pub use resource::Resource;
