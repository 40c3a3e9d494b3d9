//! A custom resource's declared selectable fields (a CRD version's `selectableFields`), and
//! the name a cached object holds a selectable field's value under. Definitions only: which
//! selectors they admit and how their values are read are [`crate::k8s::fields`]'s.

use std::sync::Arc;

/// The name of a selectable field held with a cached object
/// ([`crate::cache::object::Meta::fields`]): a built-in kind's, or a custom resource's label,
/// shared by all its objects (an object holds a pointer, not a copy of the name).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FieldName {
    Builtin(&'static str),
    Custom(Arc<str>),
}

impl FieldName {
    pub fn as_str(&self) -> &str {
        match self {
            FieldName::Builtin(s) => s,
            FieldName::Custom(s) => s,
        }
    }
}

/// One of a custom resource's selectable fields.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CustomField {
    /// The field label: the jsonPath without its leading dot (`spec.color`), as the apiserver
    /// names it (`strings.TrimPrefix(sf.JSONPath, ".")`).
    label: Arc<str>,
}

impl CustomField {
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The name an object's value of this field is held under: the label itself, shared.
    pub fn name(&self) -> FieldName {
        FieldName::Custom(self.label.clone())
    }

    /// The names of the path, in order (`spec`, `color`).
    pub(crate) fn segments(&self) -> std::str::Split<'_, char> {
        self.label.split('.')
    }

    /// The number of segments of the path.
    pub(crate) fn depth(&self) -> usize {
        self.label.bytes().filter(|b| *b == b'.').count() + 1
    }
}

/// The field selectors a CustomResourceDefinition version accepts besides `metadata.name` and
/// (namespaced) `metadata.namespace`: its `selectableFields` (Kubernetes 1.31+, GA in 1.32,
/// KEP-4358), each a JSONPath evaluated against every object of that version.
///
/// The proxy evaluates paths of the form `.a.b.c` (names of letters, digits, `-` and `_`),
/// which is what CRD validation allows (no array notation, properties of the schema) for all
/// but exotic property names. If any declared path has another form, nothing is evaluated and
/// field selectors beyond metadata pass through to the apiserver.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CustomFields {
    fields: Arc<[CustomField]>,
    /// A declared path the proxy does not evaluate.
    opaque: bool,
}

/// The most fields the scan tracks (one bit each); CRD validation allows 8 per version.
const MAX_CUSTOM_FIELDS: usize = 64;

impl CustomFields {
    /// From a CRD version's `selectableFields[].jsonPath`, in the CRD's order.
    pub fn from_json_paths<'p>(paths: impl IntoIterator<Item = &'p str>) -> CustomFields {
        let mut fields = Vec::new();
        for p in paths {
            let simple = p.strip_prefix('.').filter(|label| {
                label.split('.').all(|seg| {
                    !seg.is_empty()
                        && seg
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                })
            });
            match simple {
                // Validation rejects duplicates; a second copy would add nothing.
                Some(label) if !fields.iter().any(|f: &CustomField| &*f.label == label) => fields
                    .push(CustomField {
                        label: label.into(),
                    }),
                Some(_) => {}
                None => {
                    return CustomFields {
                        fields: Arc::new([]),
                        opaque: true,
                    };
                }
            }
        }
        if fields.len() > MAX_CUSTOM_FIELDS {
            return CustomFields {
                fields: Arc::new([]),
                opaque: true,
            };
        }
        CustomFields {
            fields: fields.into(),
            opaque: false,
        }
    }

    /// Whether no field is declared.
    pub fn is_empty(&self) -> bool {
        self.fields.is_empty() && !self.opaque
    }

    /// Whether some declared path is one the proxy does not evaluate.
    pub fn is_opaque(&self) -> bool {
        self.opaque
    }

    /// The fields the cache evaluates (none when [`CustomFields::is_opaque`]).
    pub fn evaluated(&self) -> &[CustomField] {
        &self.fields
    }

    /// The field labels, in the CRD's order.
    pub fn labels(&self) -> impl Iterator<Item = &str> {
        self.fields.iter().map(CustomField::label)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectable_field_labels_are_the_json_paths_without_the_leading_dot() {
        let f = CustomFields::from_json_paths([".spec.color", ".spec.size", ".status.x-y_1"]);
        assert_eq!(
            f.labels().collect::<Vec<_>>(),
            ["spec.color", "spec.size", "status.x-y_1"]
        );
        assert!(!f.is_opaque() && !f.is_empty());
        assert!(CustomFields::from_json_paths([]).is_empty());
        // Paths the proxy does not evaluate exactly make every declared field opaque.
        for odd in [
            "spec.color",
            ".spec..color",
            ".spec.",
            ".spec['color']",
            ".spec.colors[0]",
            ".spec.a b",
            ".spec.*",
            ".spec.a\\.b",
        ] {
            let f = CustomFields::from_json_paths([".spec.size", odd]);
            assert!(f.is_opaque() && !f.is_empty(), "{odd}");
            assert!(f.evaluated().is_empty(), "{odd}");
        }
    }
}
