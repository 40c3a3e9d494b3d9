//! The kinds the fake serves and their object keys.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
    Namespace,
    ConfigMap,
    Pod,
    /// apiextensions.k8s.io/v1 CustomResourceDefinitions (stored, established at once).
    Crd,
    /// example.com/v1 widgets: a custom resource, served only while the CRD
    /// [`WIDGETS_CRD`] exists.
    Widget,
}

/// The one CRD whose resource the fake serves.
pub const WIDGETS_CRD: &str = "widgets.example.com";

impl Kind {
    pub(super) const ALL: [Kind; 5] = [
        Kind::Namespace,
        Kind::ConfigMap,
        Kind::Pod,
        Kind::Crd,
        Kind::Widget,
    ];
    pub(super) const CORE: [Kind; 3] = [Kind::Namespace, Kind::ConfigMap, Kind::Pod];

    pub(super) fn resource(self) -> &'static str {
        match self {
            Kind::Namespace => "namespaces",
            Kind::ConfigMap => "configmaps",
            Kind::Pod => "pods",
            Kind::Crd => "customresourcedefinitions",
            Kind::Widget => "widgets",
        }
    }

    pub(super) fn kind(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::ConfigMap => "ConfigMap",
            Kind::Pod => "Pod",
            Kind::Crd => "CustomResourceDefinition",
            Kind::Widget => "Widget",
        }
    }

    pub(super) fn api_version(self) -> &'static str {
        match self {
            Kind::Crd => "apiextensions.k8s.io/v1",
            Kind::Widget => "example.com/v1",
            _ => "v1",
        }
    }

    /// Custom resources keep kind/apiVersion in list items.
    pub(super) fn custom(self) -> bool {
        self == Kind::Widget
    }

    pub(super) fn namespaced(self) -> bool {
        !matches!(self, Kind::Namespace | Kind::Crd)
    }

    pub(super) fn has_status(self) -> bool {
        !matches!(self, Kind::ConfigMap | Kind::Widget)
    }

    pub(super) fn index(self) -> usize {
        self as usize
    }
}

/// The object's key relative to `/registry/<resource>/`: `ns/name` or `name`. Sorting these as
/// bytes gives etcd's key order.
pub(super) fn object_key(kind: Kind, ns: Option<&str>, name: &str) -> String {
    match (kind.namespaced(), ns) {
        (true, Some(ns)) => format!("{ns}/{name}"),
        _ => name.to_string(),
    }
}
