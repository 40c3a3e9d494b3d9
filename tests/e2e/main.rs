//! The end-to-end tier: the proxy in front of a real kube-apiserver + etcd (the control plane
//! built by `tests/e2e/build-control-plane.sh` and cached), with real clients (kubectl,
//! client-go, kube-rs, the Python client, kube-controller-manager and kube-scheduler) and the
//! deploy manifests. One test binary; each module
//! is one concern (run one with `cargo test --test e2e -- authz::`). The folder also holds what
//! these tests run: `go/` (the control-plane build, the client-go checker and the upstream
//! e2e test binary of the conformance tier), `python/`,
//! `differential/` (corpus and allowlist) and the build scripts.

#[path = "../support/mod.rs"]
mod support;

mod admin;
mod authz;
mod clients;
mod components;
mod conformance;
mod controlplane;
mod crd;
mod deploy;
mod differential;
mod ha;
mod kubelet_watchers;
mod lists;
mod local_node;
mod local_rbac;
mod outage;
mod paging;
mod proto_side;
mod protobuf;
mod protobuf_watch;
mod tables;
mod transcode;
mod watch_validator;
