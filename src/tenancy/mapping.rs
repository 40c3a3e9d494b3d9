//! Which tenant an identity belongs to: the first tenant of the config whose rules match
//! (a group, a ServiceAccount's namespace, a username pattern). The authentication chain
//! is given this mapping ([`TenantOf`]) and stamps its answer on every identity it
//! establishes.

use crate::auth::authn::{Identity, TenantOf};
use crate::config::TenantConfig;

/// Maps identities to tenants (the first tenant with a matching rule).
#[derive(Debug, Clone, Default)]
pub struct TenantMapper {
    tenants: Vec<TenantConfig>,
}

impl TenantMapper {
    pub fn new(tenants: Vec<TenantConfig>) -> TenantMapper {
        TenantMapper { tenants }
    }

    pub fn tenant_of(&self, id: &Identity) -> String {
        let sa_ns = id.service_account_namespace();
        for t in &self.tenants {
            let m = &t.matches;
            if m.groups.iter().any(|g| id.groups.contains(g))
                || sa_ns.is_some_and(|ns| m.service_account_namespaces.iter().any(|n| n == ns))
                || m.username_patterns.iter().any(|p| glob(p, &id.user))
            {
                return t.name.clone();
            }
        }
        String::new()
    }
}

impl TenantOf for TenantMapper {
    fn tenant_of(&self, id: &Identity) -> String {
        TenantMapper::tenant_of(self, id)
    }
}

/// `*` matches any run of characters (including none); everything else literally.
pub fn glob(pattern: &str, s: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == s;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !s.starts_with(first) || s.len() < first.len() + last.len() || !s.ends_with(last) {
        return false;
    }
    let mut rest = &s[first.len()..s.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::time::Duration;

    #[test]
    fn tenants_match_by_group_serviceaccount_namespace_and_user_pattern() {
        let t = |name: &str, m: crate::config::TenantMatch| TenantConfig {
            name: name.into(),
            matches: m,
            namespaces: vec![],
            namespace_selector: None,
            filtered_cluster_view: false,
            view_recheck_interval: Duration::from_secs(10),
            quotas: Default::default(),
        };
        let mapper = TenantMapper::new(vec![
            t(
                "a",
                crate::config::TenantMatch {
                    groups: vec!["team-a".into()],
                    ..Default::default()
                },
            ),
            t(
                "b",
                crate::config::TenantMatch {
                    service_account_namespaces: vec!["team-b".into()],
                    username_patterns: vec!["bob-*".into()],
                    ..Default::default()
                },
            ),
        ]);
        let id = |user: &str, groups: &[&str]| Identity {
            user: user.into(),
            uid: String::new(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            extra: BTreeMap::new(),
            tenant: String::new(),
        };
        assert_eq!(mapper.tenant_of(&id("x", &["team-a"])), "a");
        assert_eq!(
            mapper.tenant_of(&id("system:serviceaccount:team-b:ci", &[])),
            "b"
        );
        assert_eq!(mapper.tenant_of(&id("bob-smith", &[])), "b");
        assert_eq!(mapper.tenant_of(&id("bobby", &[])), "");
        assert!(glob("a*b*c", "axxbyyc"));
        assert!(!glob("a*b*c", "axxc"));
        assert!(glob("*", ""));
    }
}
