//! Who a verified caller is: [`Identity`] (the apiserver's `user.Info` plus its tenant), its
//! canonical hash, and [`TenantOf`], the mapping to tenants the chain is given (tenants are
//! tenancy's concern, not authentication's).

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

/// The extra key naming the credential a caller used (kube-apiserver's
/// `user.CredentialIDKey`: a ServiceAccount token's JTI, a client certificate's fingerprint).
pub const CREDENTIAL_ID: &str = "authentication.kubernetes.io/credential-id";

/// A verified caller, as the apiserver's `user.Info`, plus the tenant it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
    /// The tenant (config `tenants`, named by the chain's [`TenantOf`]); `""` when none
    /// matches.
    pub tenant: String,
}

impl Identity {
    /// `system:anonymous` in `system:unauthenticated`, as kube-apiserver's anonymous
    /// authenticator.
    pub fn anonymous() -> Identity {
        Identity {
            user: "system:anonymous".into(),
            uid: String::new(),
            groups: vec!["system:unauthenticated".into()],
            extra: BTreeMap::new(),
            tenant: String::new(),
        }
    }

    /// SHA-256 over a canonical, length-prefixed encoding of user, uid, sorted groups and
    /// sorted extra (not the tenant). Equal identities hash equal whatever the order their
    /// groups and extra values came in; no two different identities share an encoding.
    pub fn identity_hash(&self) -> [u8; 32] {
        self.hash_skipping(None)
    }

    /// [`Identity::identity_hash`] without the extra key [`CREDENTIAL_ID`]: one hash for
    /// every credential of one identity (each ServiceAccount token has its own id, each
    /// client certificate its fingerprint). The apiserver's built-in authorizers (the
    /// privileged group, Node, RBAC, ABAC) never read extra, so their decisions cannot
    /// differ between two credentials of one identity; the key is audit information.
    pub fn decision_hash(&self) -> [u8; 32] {
        self.hash_skipping(Some(CREDENTIAL_ID))
    }

    fn hash_skipping(&self, skip: Option<&str>) -> [u8; 32] {
        fn put(h: &mut Sha256, s: &str) {
            h.update((s.len() as u64).to_be_bytes());
            h.update(s.as_bytes());
        }
        let mut h = Sha256::new();
        h.update(b"kcp-identity-v1");
        put(&mut h, &self.user);
        put(&mut h, &self.uid);
        let mut groups: Vec<&str> = self.groups.iter().map(String::as_str).collect();
        groups.sort_unstable();
        h.update((groups.len() as u64).to_be_bytes());
        for g in groups {
            put(&mut h, g);
        }
        let skipped = skip.is_some_and(|k| self.extra.contains_key(k));
        h.update(((self.extra.len() - usize::from(skipped)) as u64).to_be_bytes());
        for (k, vs) in &self.extra {
            if Some(k.as_str()) == skip {
                continue;
            }
            put(&mut h, k);
            let mut vs: Vec<&str> = vs.iter().map(String::as_str).collect();
            vs.sort_unstable();
            h.update((vs.len() as u64).to_be_bytes());
            for v in vs {
                put(&mut h, v);
            }
        }
        h.finalize().into()
    }

    /// The namespace of a ServiceAccount user (`system:serviceaccount:<ns>:<name>`).
    pub fn service_account_namespace(&self) -> Option<&str> {
        let rest = self.user.strip_prefix("system:serviceaccount:")?;
        let (ns, name) = rest.split_once(':')?;
        (!ns.is_empty() && !name.is_empty()).then_some(ns)
    }
}

/// Names the tenant an identity belongs to (`""`: none). Implemented by tenancy's mapping
/// (config `tenants`) and injected into the chain, which stamps the name on every identity
/// it establishes (cached ones included), so authentication needs to know nothing of tenants.
/// Any `Fn(&Identity) -> String` is one too.
pub trait TenantOf: Send + Sync {
    fn tenant_of(&self, id: &Identity) -> String;
}

impl<F: Fn(&Identity) -> String + Send + Sync> TenantOf for F {
    fn tenant_of(&self, id: &Identity) -> String {
        self(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_hash_is_canonical_and_separates_fields() {
        let a = Identity {
            user: "u".into(),
            uid: "1".into(),
            groups: vec!["b".into(), "a".into()],
            extra: BTreeMap::from([("k".into(), vec!["2".into(), "1".into()])]),
            tenant: "t".into(),
        };
        let mut b = a.clone();
        b.groups.reverse();
        b.extra.insert("k".into(), vec!["1".into(), "2".into()]);
        b.tenant = "other".into();
        assert_eq!(a.identity_hash(), b.identity_hash());
        // Moving a byte between fields changes the hash (length prefixes).
        let mut c = a.clone();
        c.user = "u1".into();
        c.uid = String::new();
        assert_ne!(a.identity_hash(), c.identity_hash());
        let mut d = a.clone();
        d.groups = vec!["ab".into()];
        assert_ne!(a.identity_hash(), d.identity_hash());
    }

    #[test]
    fn decision_hash_ignores_only_the_credential_id() {
        let mut a = Identity::anonymous();
        a.extra.insert("k".into(), vec!["v".into()]);
        let mut b = a.clone();
        b.extra.insert(CREDENTIAL_ID.into(), vec!["JTI=1".into()]);
        let mut c = a.clone();
        c.extra.insert(CREDENTIAL_ID.into(), vec!["JTI=2".into()]);
        assert_eq!(a.decision_hash(), b.decision_hash());
        assert_eq!(b.decision_hash(), c.decision_hash());
        assert_ne!(b.identity_hash(), c.identity_hash());
        // Any other extra still counts.
        let mut d = b.clone();
        d.extra.insert("k".into(), vec!["w".into()]);
        assert_ne!(b.decision_hash(), d.decision_hash());
        assert_eq!(a.identity_hash(), a.decision_hash());
    }
}
