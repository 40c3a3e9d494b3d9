//! Field selectors against a resource: which fields each kind accepts, whether the proxy
//! answers a field selector from the cache or hands it to the apiserver, and the values of
//! those fields, extracted from every object at ingest. The selector syntax is
//! [`crate::k8s::selector`]'s.
//!
//! Sources, ported line by line where behaviour depends on it:
//!
//! - which fields each kind accepts (`kinds.rs`, `check.rs`): the field label conversion
//!   functions the apiserver applies before storage sees the selector (`ListResource` →
//!   `FieldSelector.Transform` → `Scheme.ConvertFieldLabel`), in
//!   `pkg/apis/core/v1/conversion.go`, `pkg/apis/batch/v1/conversion.go`,
//!   `pkg/apis/certificates/v1/conversion.go`, and
//!   `runtime.DefaultMetaV1FieldSelectorConversion` for kinds without one; for custom
//!   resources, `crConverter.ConvertFieldLabel` (apiextensions-apiserver
//!   `pkg/apiserver/conversion/converter.go`): metadata, plus the CRD version's
//!   `selectableFields` ([`crate::k8s::selectable::CustomFields`]);
//! - the values those fields have (`extract.rs`): the registries' `GetAttrs` /
//!   `ToSelectableFields` (`pkg/registry/core/pod/strategy.go` and friends), which read the
//!   *internal* object, so v1 → internal conversion quirks (pod `status.podIP`,
//!   `spec.serviceAccount`) are applied here; for custom resources, the CR strategy's
//!   `selectableFields` (apiextensions-apiserver `pkg/registry/customresource/strategy.go`):
//!   `fmt.Sprint` of the value each JSONPath finds in the unstructured object, `""` when absent
//!   or null.
//!
//! What the proxy cannot evaluate with certainty is reported as [`FieldCheck::Passthrough`]:
//! the apiserver then answers, and the proxy never guesses.

mod check;
mod extract;
mod kinds;

pub use check::{
    FieldCheck, check_builtin_field_selector, check_custom_field_selector, check_field_selector,
};
pub use extract::{FieldScan, extract_fields};
pub use kinds::supported_fields;
