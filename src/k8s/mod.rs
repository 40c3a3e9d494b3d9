//! The Kubernetes model the proxy reads and writes: `Status` errors, the apiserver's
//! `RequestInfo`, resource types, label and field selectors, and the JSON scanner that reads
//! objects without decoding them. Pure data and functions: nothing here does I/O.
//!
//! - [`status`]: `Status` errors as the apiserver writes them.
//! - [`request_info`]: the apiserver's `RequestInfo` of a request path.
//! - [`resource`]: a resource type (group/version/resource, kind, scope).
//! - [`selectable`]: a custom resource's declared selectable fields, and the names a cached
//!   object holds field values under.
//! - [`selector`]: label and field selector syntax: parsing, matching, canonical strings.
//! - [`fields`]: field selectors against a resource: each kind's supported fields, the
//!   cache-or-apiserver check, and the fields' values extracted at ingest.
//! - [`scan`]: the JSON scanner that reads objects without decoding them.
//! - [`go_format`]: Go's printing of quoted strings and floats, byte for byte.
//! - [`protobuf`]: the apiserver's protobuf envelope, read for an object's resourceVersion,
//!   and the metadata the cache needs of an object held as protobuf.
//! - [`protobuf_write`]: the apiserver's protobuf list bodies and watch frames, built from
//!   objects' own protobuf bytes.
//! - [`transcode`]: a built-in object's protobuf message written from its JSON, byte for
//!   byte the apiserver's, from a schema generated from the pinned k8s.io/api.
//! - [`watch_fields`]: the opt-in field-level change filter of watches (an extension).

pub mod fields;
pub mod go_format;
pub mod protobuf;
pub mod protobuf_write;
pub mod request_info;
pub mod resource;
pub mod scan;
pub mod selectable;
pub mod selector;
pub mod status;
pub mod transcode;
pub mod watch_fields;

pub use resource::Resource;
