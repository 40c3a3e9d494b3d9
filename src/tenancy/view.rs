//! Filtered cluster views: for a cluster-wide list/watch RBAC denies, the tenant's
//! namespaces where the caller may do the same ([`Tenancy::filtered_view`]), and the hash of
//! such a set bound into continue tokens ([`view_hash`]).

use std::collections::BTreeSet;
use std::sync::Arc;

use super::Tenancy;
use crate::auth::authn::Identity;
use crate::auth::authz::{Attributes, Authorizer, Decision};
use crate::cache::ResourceCache;

/// The SHA-256 of a filtered view's namespace set (sorted, length-prefixed), bound into the
/// continue tokens of lists served through that view.
pub fn view_hash(namespaces: &BTreeSet<String>) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"kcp-view-v1");
    h.update((namespaces.len() as u64).to_be_bytes());
    for ns in namespaces {
        h.update((ns.len() as u64).to_be_bytes());
        h.update(ns.as_bytes());
    }
    h.finalize().into()
}

impl Tenancy {
    /// For a cluster-wide list/watch of a namespaced resource that RBAC denied at cluster
    /// scope: the tenant's namespaces where `id` may do the same, when its tenant has a
    /// filtered cluster view and there is at least one. Namespaces whose review fails are
    /// left out (fail closed).
    pub async fn filtered_view(
        &self,
        authz: &Authorizer,
        namespace_cache: Option<&ResourceCache>,
        id: &Identity,
        attrs: &Attributes,
        namespaced: bool,
    ) -> Option<Arc<BTreeSet<String>>> {
        let t = self.get(&id.tenant)?;
        if !t.config.filtered_cluster_view
            || !namespaced
            || !attrs.namespace.is_empty()
            || !matches!(attrs.verb.as_str(), "list" | "watch")
        {
            return None;
        }
        let mut allowed = BTreeSet::new();
        for ns in t.namespaces(namespace_cache) {
            let a = Attributes {
                namespace: ns.clone(),
                ..attrs.clone()
            };
            if authz.authorize(id, &a).await == Decision::Allow {
                allowed.insert(ns);
            }
        }
        (!allowed.is_empty()).then(|| Arc::new(allowed))
    }
}
