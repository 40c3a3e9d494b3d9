//! Local RBAC: cache reads authorized in memory from the RBAC objects the proxy caches,
//! without a `SubjectAccessReview` per question (`authorization.localRbac`, default `auto`).
//!
//! Sound by construction: kube-apiserver's authorizer chain ends at the first authorizer that
//! allows or denies, and the built-in ones before RBAC (`system:masters`, the Node
//! authorizer) never deny, so an RBAC allow is an apiserver allow. Only allows are final
//! here: a question RBAC does not allow goes to `SubjectAccessReview` as before, so the Node
//! authorizer (kubelets), webhooks and anything else the apiserver runs still decide, and a
//! denial keeps the apiserver's own text. A chain with an authorizer that *denies* before
//! RBAC (a deny-capable webhook listed first in `--authorization-config`) breaks that
//! premise: set `authorization.localRbac: off` there.
//!
//! Local decisions are used only while they are safe:
//! - confirmed: once the four RBAC caches have synced, a probe asks the apiserver, by
//!   `SubjectAccessReview`, a question the local policy allows for an identity of nobody's
//!   (`system:kube-cache-proxy:rbac-probe` in `system:authenticated`, e.g. `get /version`,
//!   granted by the bootstrap ClusterRoleBinding `system:public-info-viewer`). Allowed: the
//!   apiserver enforces what these objects say, local RBAC is active (logged). Denied: it
//!   does not (no RBAC in its chain, or a denying authorizer before it): off for the
//!   process's life (logged as a warning);
//! - current: the policy was built at the caches' current resourceVersions (a change to a
//!   binding or role that the caches hold and the policy not yet goes to review: it takes
//!   effect at the next request, with no TTL);
//! - followed: every RBAC cache is synced and its upstream watch up, or down for less than
//!   [`STALE_BOUND`]; during an outage of the apiserver (no answer at all), the last policy
//!   serves as long as allowed decisions are served stale
//!   (`authentication.staleWhileUnreachable`): it is no older than the outage, a stale
//!   decision may be older.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use serde::de::DeserializeOwned;

use super::attributes::Attributes;
use super::authn::Identity;
use super::rbac::{BindingObject, Policy, PolicyObjects, RoleObject};
use crate::cache::ObjectKey;
use crate::cache::ResourceCache;
use crate::cache::store::Objects;

/// An RBAC cache whose upstream watch has been down this long no longer follows changes
/// closely enough: decisions go back to review. Short against a revocation's usual
/// propagation (the apiserver's own informers take about as long after a watch break).
pub const STALE_BOUND: Duration = Duration::from_secs(5);
/// How often the follower looks at the caches' health without a change to wake it.
const TICK: Duration = Duration::from_millis(250);
/// Retry of a probe the apiserver did not answer (client-go's reflector backoff cap is
/// 30 s; a probe is one small request).
const PROBE_RETRY: Duration = Duration::from_secs(5);

/// The probe's identity: a user no binding names, in the group every caller has.
pub const PROBE_USER: &str = "system:kube-cache-proxy:rbac-probe";

/// Not confirmed yet: every question goes to review.
const PENDING: u8 = 0;
/// Confirmed: RBAC allows are local.
const ACTIVE: u8 = 1;
/// The apiserver did not allow what its RBAC objects allow: off for good.
const REFUSED: u8 = 2;

/// Counters for the metrics layer.
#[derive(Debug, Default)]
pub struct LocalStats {
    /// Questions RBAC allowed locally (no review).
    pub allowed: AtomicU64,
    /// Questions RBAC gave no allow, sent to review.
    pub no_allow: AtomicU64,
    /// Questions asked while local RBAC could not decide (not confirmed, not current, not
    /// followed), sent to review.
    pub unavailable: AtomicU64,
    /// Policies built (one per batch of RBAC changes).
    pub builds: AtomicU64,
}

/// The policy and the caches' resourceVersions it was built at.
struct Built {
    rvs: [u64; 4],
    policy: Arc<Policy>,
}

pub struct LocalRbac {
    /// Roles, RoleBindings, ClusterRoles, ClusterRoleBindings (`authz::rbac_resources`).
    caches: [Arc<ResourceCache>; 4],
    current: RwLock<Arc<Built>>,
    state: AtomicU8,
    /// Every cache synced and followed (see the module docs); set by the follower.
    followed: AtomicBool,
    pub stats: LocalStats,
}

impl std::fmt::Debug for LocalRbac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalRbac")
            .field("mode", &self.mode())
            .finish_non_exhaustive()
    }
}

/// Parsed objects by key and resourceVersion: a rebuild parses only what changed.
#[derive(Default)]
struct Memo<T> {
    parsed: HashMap<ObjectKey, (u64, Arc<T>)>,
}

impl<T: DeserializeOwned + Default> Memo<T> {
    /// Every object of `objects`, parsed (reused when its version was parsed before). An
    /// object that does not parse counts as empty: it grants nothing, so its questions go
    /// to review.
    fn refresh(&mut self, objects: &Objects) -> Vec<(ObjectKey, Arc<T>)> {
        let mut next = HashMap::with_capacity(objects.len());
        let mut out = Vec::with_capacity(objects.len());
        for (key, o) in objects.iter() {
            let rv = o.meta.resource_version;
            let parsed = match self.parsed.get(key) {
                Some((at, p)) if *at == rv => p.clone(),
                _ => Arc::new(serde_json::from_slice(&o.body).unwrap_or_else(|e| {
                    tracing::debug!(namespace = %key.namespace, name = %key.name, error = %e, "RBAC object not understood: it grants nothing locally");
                    T::default()
                })),
            };
            next.insert(key.clone(), (rv, parsed.clone()));
            out.push((key.clone(), parsed));
        }
        self.parsed = next;
        out
    }
}

#[derive(Default)]
struct Memos {
    roles: Memo<RoleObject>,
    role_bindings: Memo<BindingObject>,
    cluster_roles: Memo<RoleObject>,
    cluster_role_bindings: Memo<BindingObject>,
}

/// The probe's questions, in order: the first the local policy allows is asked (bootstrap
/// policy: `system:public-info-viewer`, `system:discovery`, `system:basic-user`).
fn probe_questions() -> [Attributes; 3] {
    let path = |p: &str| Attributes {
        verb: "get".into(),
        path: p.into(),
        ..Default::default()
    };
    [
        path("/version"),
        path("/api"),
        Attributes {
            verb: "create".into(),
            group: "authorization.k8s.io".into(),
            version: "v1".into(),
            resource: "selfsubjectaccessreviews".into(),
            ..Default::default()
        },
    ]
}

/// The probe's identity.
pub fn probe_identity() -> Identity {
    Identity {
        user: PROBE_USER.into(),
        uid: String::new(),
        groups: vec!["system:authenticated".into()],
        extra: Default::default(),
        tenant: String::new(),
    }
}

/// What the apiserver answered the probe.
pub enum ProbeAnswer {
    Allowed,
    Denied,
    /// No answer, or an error: asked again later.
    Failed(String),
}

impl LocalRbac {
    pub fn new(caches: [Arc<ResourceCache>; 4]) -> LocalRbac {
        LocalRbac {
            caches,
            current: RwLock::new(Arc::new(Built {
                rvs: [0; 4],
                policy: Arc::new(Policy::default()),
            })),
            state: AtomicU8::new(PENDING),
            followed: AtomicBool::new(false),
            stats: LocalStats::default(),
        }
    }

    /// `pending`, `active` or `refused` (for logs and `/debug`).
    pub fn mode(&self) -> &'static str {
        match self.state.load(Relaxed) {
            ACTIVE => "active",
            REFUSED => "refused",
            _ => "pending",
        }
    }

    /// RBAC's answer to `id` doing `a`: `Some(true)` allowed (final), `Some(false)` no
    /// allow, `None` local RBAC cannot decide now. Either of the last two goes to review.
    pub fn decide(&self, id: &Identity, a: &Attributes) -> Option<bool> {
        let built = self.usable()?;
        let allowed = built.policy.allows(&id.user, &id.groups, a);
        if allowed {
            self.stats.allowed.fetch_add(1, Relaxed);
        } else {
            self.stats.no_allow.fetch_add(1, Relaxed);
        }
        Some(allowed)
    }

    /// The current policy, when it may decide.
    fn usable(&self) -> Option<Arc<Built>> {
        let unavailable = || {
            self.stats.unavailable.fetch_add(1, Relaxed);
            None
        };
        if self.state.load(Relaxed) != ACTIVE || !self.followed.load(Relaxed) {
            return unavailable();
        }
        let built = self.current.read().clone();
        // A change the caches hold and the policy not yet: review decides this one.
        if self.caches.iter().zip(built.rvs).any(|(c, at)| c.rv() > at) {
            return unavailable();
        }
        Some(built)
    }

    /// Builds the policy from the caches' current states, if they moved since the last.
    fn rebuild(&self, memos: &mut Memos) {
        let snaps = self.caches.each_ref().map(|c| c.current());
        let rvs = snaps.each_ref().map(|s| s.rv);
        if self.current.read().rvs == rvs {
            return;
        }
        let roles = memos.roles.refresh(&snaps[0].objects);
        let role_bindings = memos.role_bindings.refresh(&snaps[1].objects);
        let cluster_roles = memos.cluster_roles.refresh(&snaps[2].objects);
        let cluster_role_bindings = memos.cluster_role_bindings.refresh(&snaps[3].objects);
        let policy = Policy::new(PolicyObjects {
            roles: roles
                .iter()
                .map(|(k, r)| (&*k.namespace, &*k.name, r.clone()))
                .collect(),
            role_bindings: role_bindings
                .iter()
                .map(|(k, b)| (&*k.namespace, b.clone()))
                .collect(),
            cluster_roles: cluster_roles
                .iter()
                .map(|(k, r)| (&*k.name, r.clone()))
                .collect(),
            cluster_role_bindings: cluster_role_bindings.into_iter().map(|(_, b)| b).collect(),
        });
        *self.current.write() = Arc::new(Built {
            rvs,
            policy: Arc::new(policy),
        });
        self.stats.builds.fetch_add(1, Relaxed);
    }

    /// The question the probe asks: the first of [`probe_questions`] the current policy
    /// allows the probe identity; `None` when it allows none (the bootstrap bindings are
    /// gone, or the caches hold nothing yet).
    pub fn probe_question(&self) -> Option<Attributes> {
        let id = probe_identity();
        let built = self.current.read().clone();
        probe_questions()
            .into_iter()
            .find(|a| built.policy.allows(&id.user, &id.groups, a))
    }

    /// Follows the caches until dropped: rebuilds the policy on every change, keeps
    /// `followed` true while the caches may decide, and confirms the mode with `probe`
    /// (a `SubjectAccessReview` of the question given, not cached) once synced.
    /// `outage_grace` is how long the last policy serves while the apiserver is unreachable
    /// (`None`: the apiserver is reachable).
    pub async fn follow<P, Fut, O>(self: Arc<Self>, probe: P, outage: O)
    where
        P: Fn(Identity, Attributes) -> Fut,
        Fut: std::future::Future<Output = ProbeAnswer>,
        O: Fn() -> bool,
    {
        let mut memos = Memos::default();
        let mut down_since: [Option<Instant>; 4] = [None; 4];
        let mut next_probe = Instant::now();
        let mut warned_no_question = false;
        loop {
            // Read before the rebuild, whose snapshots are at least this new: a change in
            // between wakes the wait below at once.
            let seen = self.caches.each_ref().map(|c| c.rv());
            let synced = self.caches.iter().all(|c| c.is_ready());
            let now = Instant::now();
            let mut watching = true;
            for (c, since) in self.caches.iter().zip(down_since.iter_mut()) {
                if c.is_unhealthy() {
                    let s = *since.get_or_insert(now);
                    watching &= now.duration_since(s) < STALE_BOUND;
                } else {
                    *since = None;
                }
            }
            if synced {
                self.rebuild(&mut memos);
            }
            // During an outage the last policy serves while the caller's grace allows.
            self.followed
                .store(synced && (watching || outage()), Relaxed);
            if synced && self.state.load(Relaxed) == PENDING && now >= next_probe {
                match self.probe_question() {
                    None => {
                        if !warned_no_question {
                            warned_no_question = true;
                            tracing::warn!(
                                "local RBAC not confirmed: the cached policy grants {PROBE_USER} none of the bootstrap policy's public permissions; every cache read is authorized by SubjectAccessReview"
                            );
                        }
                        next_probe = now + PROBE_RETRY;
                    }
                    Some(q) => match probe(probe_identity(), q.clone()).await {
                        ProbeAnswer::Allowed => {
                            self.state.store(ACTIVE, Relaxed);
                            tracing::info!(probe = ?(&q.verb, &q.path, &q.resource), policy_objects = self.current.read().policy.objects(), "local RBAC active: the apiserver enforces its RBAC objects; cache reads RBAC allows are authorized in the proxy, the rest by SubjectAccessReview");
                        }
                        ProbeAnswer::Denied => {
                            self.state.store(REFUSED, Relaxed);
                            tracing::warn!(probe = ?(&q.verb, &q.path, &q.resource), "local RBAC off: the apiserver denied what its RBAC objects allow (no RBAC authorizer, or one that denies before it); every cache read is authorized by SubjectAccessReview");
                        }
                        ProbeAnswer::Failed(e) => {
                            tracing::debug!(error = %e, "local RBAC probe failed; asked again");
                            next_probe = now + PROBE_RETRY;
                        }
                    },
                }
            }
            if self.state.load(Relaxed) == REFUSED {
                self.followed.store(false, Relaxed);
                return;
            }
            let [a, b, c, d] = &self.caches;
            tokio::select! {
                _ = a.wait_for_rv(seen[0] + 1, TICK) => {}
                _ = b.wait_for_rv(seen[1] + 1, TICK) => {}
                _ = c.wait_for_rv(seen[2] + 1, TICK) => {}
                _ = d.wait_for_rv(seen[3] + 1, TICK) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::rbac::rbac_resources;
    use crate::cache::{CachedObject, EventKind, ReflectorSink, StoreConfig};
    use serde_json::json;

    fn caches() -> [Arc<ResourceCache>; 4] {
        rbac_resources()
            .into_iter()
            .map(|r| ResourceCache::new(r, StoreConfig::default()))
            .collect::<Vec<_>>()
            .try_into()
            .unwrap()
    }

    fn object(i: usize, v: serde_json::Value) -> CachedObject {
        CachedObject::parse(v.to_string().into(), &rbac_resources()[i]).unwrap()
    }

    fn public_info(rv: u64) -> [CachedObject; 2] {
        [
            object(
                2,
                json!({"metadata": {"name": "system:public-info-viewer", "uid": "1", "resourceVersion": rv.to_string()},
                    "rules": [{"verbs": ["get"], "nonResourceURLs": ["/version", "/healthz"]}]}),
            ),
            object(
                3,
                json!({"metadata": {"name": "system:public-info-viewer", "uid": "2", "resourceVersion": (rv + 1).to_string()},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:public-info-viewer"},
                    "subjects": [{"kind": "Group", "name": "system:authenticated"}]}),
            ),
        ]
    }

    fn reader_binding(rv: u64) -> CachedObject {
        object(
            1,
            json!({"metadata": {"name": "b", "namespace": "ns", "uid": "3", "resourceVersion": rv.to_string()},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "reader"},
                "subjects": [{"kind": "User", "name": "alice"}]}),
        )
    }

    fn alice() -> Identity {
        Identity {
            user: "alice".into(),
            ..probe_identity()
        }
    }

    fn list_pods() -> Attributes {
        Attributes {
            verb: "list".into(),
            version: "v1".into(),
            resource: "pods".into(),
            namespace: "ns".into(),
            ..Default::default()
        }
    }

    /// Yields (paused time: instantly) until `done`, a bounded number of times.
    async fn until(what: &str, done: impl Fn() -> bool) {
        for _ in 0..1000 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("never: {what}");
    }

    #[tokio::test(start_paused = true)]
    async fn local_decisions_start_after_the_probe_and_follow_every_change_at_once() {
        let c = caches();
        let [pi_role, pi_binding] = public_info(10);
        c[0].replace(vec![], 1);
        c[1].replace(vec![reader_binding(2)], 3);
        c[2].replace(vec![pi_role], 11);
        c[3].replace(vec![pi_binding], 12);
        let local = Arc::new(LocalRbac::new(c.clone()));
        // Nothing before the probe answered.
        assert_eq!(local.decide(&alice(), &list_pods()), None);
        let asked = Arc::new(AtomicU64::new(0));
        let probes = asked.clone();
        tokio::spawn(local.clone().follow(
            move |id, a| {
                probes.fetch_add(1, Relaxed);
                assert_eq!(
                    (id.user.as_str(), a.path.as_str()),
                    (PROBE_USER, "/version")
                );
                std::future::ready(ProbeAnswer::Allowed)
            },
            || false,
        ));
        until("the probe", || local.mode() == "active").await;
        assert_eq!(asked.load(Relaxed), 1);
        // The binding names a ClusterRole that does not exist yet: no allow.
        assert_eq!(local.decide(&alice(), &list_pods()), Some(false));
        // Created: granted from the next question the policy has caught up with; until
        // then the question goes to review (None), never to the old answer.
        c[2].apply(
            EventKind::Added,
            object(
                2,
                json!({"metadata": {"name": "reader", "uid": "4", "resourceVersion": "20"},
                    "rules": [{"verbs": ["list"], "apiGroups": [""], "resources": ["pods"]}]}),
            ),
        );
        assert_eq!(local.decide(&alice(), &list_pods()), None);
        until("the grant", || {
            local.decide(&alice(), &list_pods()) == Some(true)
        })
        .await;
        // The binding deleted: revoked at once.
        c[1].apply(EventKind::Deleted, reader_binding(21));
        assert_ne!(local.decide(&alice(), &list_pods()), Some(true));
        until("the revocation", || {
            local.decide(&alice(), &list_pods()) == Some(false)
        })
        .await;
        assert!(local.stats.builds.load(Relaxed) >= 3);
    }

    #[tokio::test(start_paused = true)]
    async fn an_apiserver_that_denies_what_rbac_allows_turns_local_rbac_off() {
        let c = caches();
        let [pi_role, pi_binding] = public_info(10);
        c[0].replace(vec![], 1);
        c[1].replace(vec![], 2);
        c[2].replace(vec![pi_role], 11);
        c[3].replace(vec![pi_binding], 12);
        let local = Arc::new(LocalRbac::new(c));
        let task = tokio::spawn(
            local
                .clone()
                .follow(|_, _| std::future::ready(ProbeAnswer::Denied), || false),
        );
        task.await.unwrap();
        assert_eq!(local.mode(), "refused");
        assert_eq!(local.decide(&alice(), &list_pods()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn without_the_bootstrap_policy_nothing_is_confirmed() {
        let c = caches();
        for (i, cache) in c.iter().enumerate() {
            cache.replace(vec![], i as u64 + 1);
        }
        let local = Arc::new(LocalRbac::new(c));
        let asked = Arc::new(AtomicU64::new(0));
        let probes = asked.clone();
        tokio::spawn(local.clone().follow(
            move |_, _| {
                probes.fetch_add(1, Relaxed);
                std::future::ready(ProbeAnswer::Allowed)
            },
            || false,
        ));
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(asked.load(Relaxed), 0, "no question to ask");
        assert_eq!(local.mode(), "pending");
        assert_eq!(local.decide(&alice(), &list_pods()), None);
    }
}
