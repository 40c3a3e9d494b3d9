//! What an authorization question asks: the attributes of a request, as the apiserver's
//! authorizers and a `SubjectAccessReview` take them (shared by `authz`, `rbac` and
//! `local_rbac`).

/// What is being asked: a resource request, or, with `path` set, a non-resource URL
/// (`nonResourceAttributes`: `path` and `verb` only, e.g. `get` on `/metrics`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Attributes {
    pub verb: String,
    /// A non-resource URL's path; empty for a resource request.
    pub path: String,
    pub group: String,
    pub version: String,
    pub resource: String,
    pub subresource: String,
    pub namespace: String,
    pub name: String,
    /// A list or watch's raw field and label selectors: authorizers decide on them (the Node
    /// authorizer lets a kubelet read its own pods by `spec.nodeName`).
    pub field_selector: String,
    pub label_selector: String,
}
