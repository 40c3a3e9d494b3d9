//! The table of built-in kinds whose field label conversion the proxy models: the fields each
//! accepts, their aliases and how the apiserver rejects the others.

/// How the apiserver rejects a field label for a kind (its conversion func's `fmt.Errorf`).
#[derive(Clone, Copy)]
pub(super) enum Reject {
    /// `field label not supported: %s` (core/v1 kinds, certificates/v1).
    NotSupported,
    /// `field label %q not supported for Job` (batch/v1).
    NotSupportedForJob,
}

/// A kind whose field label conversion function was read from the Kubernetes source.
pub(super) struct KindFields {
    pub(super) group: &'static str,
    pub(super) resource: &'static str,
    /// Every label the conversion func accepts, as the apiserver stores it after conversion.
    pub(super) accepted: &'static [&'static str],
    /// Labels the conversion func renames: (sent by the client, evaluated as).
    pub(super) aliases: &'static [(&'static str, &'static str)],
    /// The selectable fields beyond `metadata.name` / `metadata.namespace`.
    pub(super) extra: &'static [&'static str],
    pub(super) reject: Reject,
}

const POD_EXTRA: &[&str] = &[
    "spec.nodeName",
    "spec.restartPolicy",
    "spec.schedulerName",
    "spec.serviceAccountName",
    "spec.hostNetwork",
    "status.phase",
    "status.podIP",
    "status.podIPs",
    "status.nominatedNodeName",
];
const EVENT_EXTRA: &[&str] = &[
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
];

/// The kinds modelled exactly. Sources: `pkg/apis/core/v1/conversion.go`
/// (`addConversionFuncs`, `AddFieldLabelConversionsFor{Event,Namespace,Secret,Service}`),
/// `pkg/apis/batch/v1/conversion.go`, `pkg/apis/certificates/v1/conversion.go`.
const KINDS: &[KindFields] = &[
    KindFields {
        group: "",
        resource: "pods",
        accepted: &[
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.podIPs",
            "status.nominatedNodeName",
        ],
        // "for backwards compatibility with old v1 clients which send spec.host"
        aliases: &[("spec.host", "spec.nodeName")],
        extra: POD_EXTRA,
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "nodes",
        // No metadata.namespace: the Node conversion func rejects it.
        accepted: &["metadata.name", "spec.unschedulable"],
        aliases: &[],
        extra: &["spec.unschedulable"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "replicationcontrollers",
        accepted: &["metadata.name", "metadata.namespace", "status.replicas"],
        aliases: &[],
        extra: &["status.replicas"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "events",
        accepted: &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
            "metadata.namespace",
            "metadata.name",
        ],
        aliases: &[],
        extra: EVENT_EXTRA,
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "namespaces",
        // No metadata.namespace: the Namespace conversion func rejects it.
        accepted: &["status.phase", "metadata.name"],
        aliases: &[],
        extra: &["status.phase"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "secrets",
        accepted: &["type", "metadata.namespace", "metadata.name"],
        aliases: &[],
        extra: &["type"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "",
        resource: "services",
        accepted: &[
            "metadata.namespace",
            "metadata.name",
            "spec.clusterIP",
            "spec.type",
        ],
        aliases: &[],
        extra: &["spec.clusterIP", "spec.type"],
        reject: Reject::NotSupported,
    },
    KindFields {
        group: "batch",
        resource: "jobs",
        accepted: &["metadata.name", "metadata.namespace", "status.successful"],
        aliases: &[],
        extra: &["status.successful"],
        reject: Reject::NotSupportedForJob,
    },
    KindFields {
        group: "certificates.k8s.io",
        resource: "certificatesigningrequests",
        accepted: &["metadata.name", "spec.signerName"],
        aliases: &[],
        extra: &["spec.signerName"],
        reject: Reject::NotSupported,
    },
];

/// Kinds with a conversion func the proxy does not model (its list or messages vary between
/// releases): any selector on them beyond the empty one goes to the apiserver.
pub(super) const UNMODELLED: &[(&str, &str)] = &[
    // Accepts regarding.*, reportingController, ... mapped onto the core Event field set in
    // recent releases; the mapping is not in every version the proxy may front.
    ("events.k8s.io", "events"),
    ("certificates.k8s.io", "clustertrustbundles"),
    ("certificates.k8s.io", "podcertificaterequests"),
    ("resource.k8s.io", "resourceslices"),
    ("resource.k8s.io", "resourceclaims"),
    ("coordination.k8s.io", "leasecandidates"),
];

/// The modelled kind of a resource, if any.
pub(super) fn kind(group: &str, resource: &str) -> Option<&'static KindFields> {
    KINDS
        .iter()
        .find(|k| k.group == group && k.resource == resource)
}

/// Which field selectors kube-apiserver supports for a resource (group, resource), beyond
/// `metadata.name` and `metadata.namespace`; empty means "only the generic two" (or, for the
/// kinds [`check_field_selector`](super::check_field_selector) passes through, "not modelled").
///
/// Note `nodes`, `namespaces` and `certificatesigningrequests` accept `metadata.name` but not
/// `metadata.namespace`, and pods also accept `spec.host` as an alias of `spec.nodeName`;
/// [`check_field_selector`](super::check_field_selector) applies both rules.
pub fn supported_fields(group: &str, resource: &str) -> &'static [&'static str] {
    kind(group, resource).map_or(&[], |k| k.extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_fields_lists_the_kind_specific_fields() {
        assert!(supported_fields("", "pods").contains(&"spec.nodeName"));
        assert!(supported_fields("", "pods").contains(&"spec.hostNetwork"));
        assert_eq!(supported_fields("", "nodes"), ["spec.unschedulable"]);
        assert_eq!(supported_fields("", "secrets"), ["type"]);
        assert_eq!(supported_fields("batch", "jobs"), ["status.successful"]);
        assert!(supported_fields("", "configmaps").is_empty());
    }
}
