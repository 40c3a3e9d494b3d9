//! A resource type as the apiserver serves it: group/version/resource, kind, scope.

/// A cached resource type: group/version/resource plus what the wire format needs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Resource {
    /// "" for the core group.
    pub group: String,
    pub version: String,
    /// Plural resource name, e.g. `pods`.
    pub resource: String,
    /// Kind, e.g. `Pod` (list kind is `PodList`).
    pub kind: String,
    pub namespaced: bool,
    /// Served by a CustomResourceDefinition. Custom resources differ on the wire: their
    /// objects keep `apiVersion`/`kind` in list items (the store then holds them with their
    /// type meta, and watch frames and GETs write the body as it is), and the apiserver's
    /// unstructured encoder orders keys alphabetically.
    pub custom: bool,
    /// A custom resource's selectable fields at this version (its CRD's
    /// `spec.versions[].selectableFields`), extracted from every object at ingest. Part of the
    /// resource's identity: when they change, the registry replaces the cache, whose objects
    /// hold the values of the old fields.
    pub selectable: crate::k8s::selectable::CustomFields,
}

impl Resource {
    /// A core/v1 resource.
    pub fn core(resource: &str, kind: &str, namespaced: bool) -> Resource {
        Resource {
            group: String::new(),
            version: "v1".into(),
            resource: resource.into(),
            kind: kind.into(),
            namespaced,
            custom: false,
            selectable: Default::default(),
        }
    }

    /// The test suites' custom resource: `widgets.example.com/v1`, kind `Widget`, with these
    /// declared selectable fields (JSONPaths such as `.spec.color`).
    #[cfg(test)]
    pub fn test_widgets(namespaced: bool, paths: &[&str]) -> Resource {
        Resource {
            group: "example.com".into(),
            version: "v1".into(),
            resource: "widgets".into(),
            kind: "Widget".into(),
            namespaced,
            custom: true,
            selectable: crate::k8s::selectable::CustomFields::from_json_paths(
                paths.iter().copied(),
            ),
        }
    }

    /// `v1` or `apps/v1`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }

    /// The collection path, cluster-wide (`None`) or in one namespace.
    pub fn collection_path(&self, namespace: Option<&str>) -> String {
        let prefix = if self.group.is_empty() {
            format!("/api/{}", self.version)
        } else {
            format!("/apis/{}/{}", self.group, self.version)
        };
        match namespace {
            Some(ns) if self.namespaced => format!("{prefix}/namespaces/{ns}/{}", self.resource),
            _ => format!("{prefix}/{}", self.resource),
        }
    }

    /// `pods` or `deployments.apps`, for logs and metric labels.
    pub fn label(&self) -> String {
        if self.group.is_empty() {
            self.resource.clone()
        } else {
            format!("{}.{}", self.resource, self.group)
        }
    }
}
