//! ServiceAccount lookup: whether the objects a ServiceAccount identity stands on still exist,
//! judged on every request against the proxy's own caches.
//!
//! kube-apiserver checks, for every ServiceAccount token, that the account exists with the
//! token's uid and is not being deleted, and that a bound pod, secret or node exists with its
//! uid (`pkg/serviceaccount/claims.go`, `--service-account-lookup`). A token verified offline
//! or remembered in the verdict cache would otherwise keep reading the cache after its account
//! was deleted or re-created, until the token expired. The proxy follows ServiceAccounts
//! itself (a pinned cache, one upstream watch) and looks bound pods, secrets and nodes up
//! when `cache.resources` selects them (the default does); a bound object whose kind is not
//! cached is left to `revocationCheck` (TokenReview when the token is verified, remembered
//! for `authentication.cacheTtl`).
//!
//! The caches only ever raise a doubt: a copy that lags (an account created a moment ago) or
//! disagrees sends the token to TokenReview, which decides with the apiserver's own lookup.

use std::sync::Arc;

use super::identity::Identity;
use crate::cache::ResourceCache;
use crate::cache::registry::Caches;
use crate::k8s::Resource;

/// The ServiceAccounts resource, followed for the lookup.
pub fn service_accounts() -> Resource {
    Resource::core("serviceaccounts", "ServiceAccount", true)
}

/// What the caches say of an identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Live {
    /// Everything it names exists with the uid it names (or it names nothing to check).
    Alive,
    /// Something it names is missing, has another uid or is being deleted, or the copy may
    /// lag: TokenReview decides.
    Doubt(&'static str),
    /// The ServiceAccounts are not followed or not synced: nothing can be said.
    Unchecked,
}

const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";
const NODE_NAME: &str = "authentication.kubernetes.io/node-name";
const NODE_UID: &str = "authentication.kubernetes.io/node-uid";

fn first<'a>(id: &'a Identity, key: &str) -> Option<&'a str> {
    id.extra.get(key)?.first().map(String::as_str)
}

/// A synced cache of `resource` (core/v1): pinned, else served.
fn synced(caches: &Caches, resource: &str) -> Option<Arc<ResourceCache>> {
    caches
        .pinned("", "v1", resource)
        .or_else(|| caches.get("", "v1", resource))
        .filter(|c| c.is_ready())
}

/// Whether `namespace/name` exists in `cache` with `uid` (empty: any) and no deletion under way.
fn present(cache: &ResourceCache, namespace: &str, name: &str, uid: &str) -> Result<(), ()> {
    match cache.get(namespace, name).0 {
        Some(o) if (uid.is_empty() || *o.meta.uid == *uid) && !deleting(&o.body) => Ok(()),
        _ => Err(()),
    }
}

/// Whether an object's JSON carries a deletion timestamp (the apiserver refuses tokens of an
/// object deleted over a minute ago; TokenReview judges the minute).
fn deleting(body: &[u8]) -> bool {
    body.windows(b"\"deletionTimestamp\"".len())
        .any(|w| w == b"\"deletionTimestamp\"")
}

/// What `caches` say of `id` (see the module docs), and of the Secret (name, uid) its token
/// is bound to, if any. Only ServiceAccount users are checked.
pub fn check(caches: &Caches, id: &Identity, secret: Option<&(String, String)>) -> Live {
    check_with(&|r| synced(caches, r), id, secret)
}

/// [`check`] with `synced` finding the synced cache of a core/v1 resource.
fn check_with(
    synced: &dyn Fn(&str) -> Option<Arc<ResourceCache>>,
    id: &Identity,
    secret: Option<&(String, String)>,
) -> Live {
    let Some((namespace, name)) = id
        .user
        .strip_prefix("system:serviceaccount:")
        .and_then(|r| r.split_once(':'))
    else {
        return Live::Alive;
    };
    let Some(accounts) = synced("serviceaccounts") else {
        return Live::Unchecked;
    };
    if present(&accounts, namespace, name, &id.uid).is_err() {
        return Live::Doubt("serviceaccount");
    }
    if let Some((name, uid)) = secret
        && let Some(secrets) = synced("secrets")
        && present(&secrets, namespace, name, uid).is_err()
    {
        return Live::Doubt("secret");
    }
    if let Some(pod) = first(id, POD_NAME) {
        if let Some(pods) = synced("pods")
            && present(&pods, namespace, pod, first(id, POD_UID).unwrap_or("")).is_err()
        {
            return Live::Doubt("pod");
        }
    } else if let Some(node) = first(id, NODE_NAME)
        && let Some(nodes) = synced("nodes")
        && present(&nodes, "", node, first(id, NODE_UID).unwrap_or("")).is_err()
    {
        return Live::Doubt("node");
    }
    Live::Alive
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn sa(user: &str, uid: &str, extra: &[(&str, &str)]) -> Identity {
        Identity {
            user: user.into(),
            uid: uid.into(),
            groups: vec![],
            extra: extra
                .iter()
                .map(|(k, v)| (k.to_string(), vec![v.to_string()]))
                .collect::<BTreeMap<_, _>>(),
            tenant: String::new(),
        }
    }

    #[test]
    fn deletion_timestamps_are_found_in_the_body() {
        assert!(deleting(
            br#"{"metadata":{"name":"a","deletionTimestamp":"2026-01-01T00:00:00Z"}}"#
        ));
        assert!(!deleting(br#"{"metadata":{"name":"a"}}"#));
    }

    fn cache(resource: Resource, objects: &[serde_json::Value]) -> Arc<ResourceCache> {
        let c = ResourceCache::new(resource.clone(), crate::cache::StoreConfig::default());
        let items = objects
            .iter()
            .map(|o| crate::cache::CachedObject::parse(o.to_string().into(), &resource).unwrap())
            .collect();
        crate::cache::ReflectorSink::replace(&*c, items, 10);
        c
    }

    #[tokio::test]
    async fn accounts_and_bound_pods_must_exist_with_the_uids_the_token_names() {
        use serde_json::json;
        let accounts = cache(
            service_accounts(),
            &[
                json!({"metadata": {"name": "a", "namespace": "ns", "uid": "u-a", "resourceVersion": "5"}}),
                json!({"metadata": {"name": "gone", "namespace": "ns", "uid": "u-g", "resourceVersion": "6",
                                    "deletionTimestamp": "2026-01-01T00:00:00Z"}}),
            ],
        );
        let pods = cache(
            Resource::core("pods", "Pod", true),
            &[
                json!({"metadata": {"name": "p", "namespace": "ns", "uid": "u-p", "resourceVersion": "7"}}),
            ],
        );
        let with_pods = |r: &str| match r {
            "serviceaccounts" => Some(accounts.clone()),
            "pods" => Some(pods.clone()),
            _ => None,
        };
        let user = "system:serviceaccount:ns:a";
        assert_eq!(
            check_with(&with_pods, &sa(user, "u-a", &[]), None),
            Live::Alive
        );
        // Re-created (another uid), deleted, being deleted, or in another namespace.
        for (user, uid) in [
            (user, "u-old"),
            ("system:serviceaccount:ns:b", "u-b"),
            ("system:serviceaccount:ns:gone", "u-g"),
            ("system:serviceaccount:other:a", "u-a"),
        ] {
            assert_eq!(
                check_with(&with_pods, &sa(user, uid, &[]), None),
                Live::Doubt("serviceaccount"),
                "{user} {uid}"
            );
        }
        let bound = |pod: &str, uid: &str| sa(user, "u-a", &[(POD_NAME, pod), (POD_UID, uid)]);
        assert_eq!(
            check_with(&with_pods, &bound("p", "u-p"), None),
            Live::Alive
        );
        assert_eq!(
            check_with(&with_pods, &bound("p", "u-x"), None),
            Live::Doubt("pod")
        );
        assert_eq!(
            check_with(&with_pods, &bound("q", "u-q"), None),
            Live::Doubt("pod")
        );
        // Pods not cached: the bound pod is left to `revocationCheck`.
        let accounts_only = |r: &str| (r == "serviceaccounts").then(|| accounts.clone());
        assert_eq!(
            check_with(&accounts_only, &bound("q", "u-q"), None),
            Live::Alive
        );
        // A Secret-bound token: its Secret, when secrets are cached.
        let secrets = cache(
            Resource::core("secrets", "Secret", true),
            &[
                json!({"metadata": {"name": "s", "namespace": "ns", "uid": "u-s", "resourceVersion": "9"}}),
            ],
        );
        let with_secrets = |r: &str| match r {
            "serviceaccounts" => Some(accounts.clone()),
            "secrets" => Some(secrets.clone()),
            _ => None,
        };
        let plain = sa(user, "u-a", &[]);
        let s = |name: &str, uid: &str| (name.to_string(), uid.to_string());
        assert_eq!(
            check_with(&with_secrets, &plain, Some(&s("s", "u-s"))),
            Live::Alive
        );
        assert_eq!(
            check_with(&with_secrets, &plain, Some(&s("s", "u-old"))),
            Live::Doubt("secret")
        );
        assert_eq!(
            check_with(&accounts_only, &plain, Some(&s("gone", "u"))),
            Live::Alive
        );
        // A node-bound token (no pod): its node, when nodes are cached.
        let nodes = cache(
            Resource::core("nodes", "Node", false),
            &[json!({"metadata": {"name": "n1", "uid": "u-n1", "resourceVersion": "8"}})],
        );
        let with_nodes = |r: &str| match r {
            "serviceaccounts" => Some(accounts.clone()),
            "nodes" => Some(nodes.clone()),
            _ => None,
        };
        let node = |n: &str, uid: &str| sa(user, "u-a", &[(NODE_NAME, n), (NODE_UID, uid)]);
        assert_eq!(
            check_with(&with_nodes, &node("n1", "u-n1"), None),
            Live::Alive
        );
        assert_eq!(
            check_with(&with_nodes, &node("n2", "u-n2"), None),
            Live::Doubt("node")
        );
    }

    #[tokio::test]
    async fn without_followed_accounts_nothing_is_said_and_other_users_are_not_checked() {
        let caches = Caches::default();
        assert_eq!(
            check(&caches, &sa("system:serviceaccount:ns:a", "u", &[]), None),
            Live::Unchecked
        );
        assert_eq!(check(&caches, &sa("alice", "", &[]), None), Live::Alive);
        // A malformed ServiceAccount user names nothing to look up.
        assert_eq!(
            check(&caches, &sa("system:serviceaccount:only-ns", "", &[]), None),
            Live::Alive
        );
    }
}
