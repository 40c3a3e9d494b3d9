//! Kubernetes label and field selectors: their syntax, parsed and evaluated exactly as
//! kube-apiserver does.
//!
//! The proxy answers lists and watches from memory, so a selector must select precisely the
//! objects the apiserver would select, and a malformed selector must fail with the apiserver's
//! own message (the proxy wraps it in a 400 `BadRequest` Status, as the list handler does with
//! `errors.NewBadRequest(err.Error())`).
//!
//! Sources, ported line by line where behaviour depends on it:
//!
//! - label selectors (`label.rs`, `lexer.rs`): `k8s.io/apimachinery/pkg/labels/selector.go`
//!   (lexer, parser, `NewRequirement`, `Requirement.Matches`, `Requirement.String`), key and
//!   value rules (`validation.rs`) from `k8s.io/apimachinery/pkg/api/validate/content`
//!   (`IsLabelKey`, `IsLabelValue`), error text from
//!   `k8s.io/apimachinery/pkg/util/validation/field` (`field.Invalid`, `ToAggregate`);
//! - field selectors (`field.rs`): `k8s.io/apimachinery/pkg/fields/selector.go`
//!   (`ParseSelector`, `splitTerms`, `splitTerm`, `UnescapeValue`, `EscapeValue`).
//!
//! Which fields a resource accepts and the values its objects have for them are
//! [`crate::k8s::fields`]'s.

mod field;
mod label;
mod lexer;
mod validation;

pub use field::{FieldSelector, FieldTerm, escape_field_value};
pub use label::{LabelSelector, Operator, Requirement};

/// A selector that could not be parsed, or a field the resource does not support.
///
/// `Display` is exactly the message kube-apiserver puts in its 400 `BadRequest` Status for the
/// same query, so the proxy can answer without asking upstream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// `labelSelector` is malformed, e.g. `unable to parse requirement: ...`.
    #[error("{0}")]
    Label(String),
    /// `fieldSelector` is malformed, e.g. `invalid selector: ...` or
    /// `invalid field selector: ...`.
    #[error("{0}")]
    Field(String),
    /// `fieldSelector` names a field the resource does not support, e.g.
    /// `field label not supported: spec.foo`.
    #[error("{0}")]
    UnsupportedField(String),
}
