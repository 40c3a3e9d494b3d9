//! Authorization of cache-served requests, decided by the apiserver's authorizers.
//!
//! Passthrough requests are authorized by the apiserver as they reach it. A request the
//! proxy answers from memory gets the same decision first: once `authn` has verified the
//! caller, a `SubjectAccessReview` with all its attributes (user, uid, groups, extra, verb,
//! group, resource, subresource, namespace, name) goes to the apiserver with the proxy's
//! credentials (the proxy needs `create` on subjectaccessreviews: ClusterRole
//! `system:auth-delegator`).
//!
//! - allowed: served from the cache;
//! - denied (or no opinion): the proxy answers the apiserver's own 403 (`forbidden`, same
//!   message and details as k8s.io/apiserver's `responsewriters.Forbidden`, with the
//!   review's reason appended as the apiserver appends its authorizer's);
//! - the apiserver cannot answer: fail closed with 503 and `Retry-After` (never served).
//!
//! First, RBAC is evaluated in the proxy (`local_rbac`, `authorization.localRbac`): an
//! allow there is final, as any allow in the apiserver's chain; then, for kubelets, the Node
//! authorizer's allows walked over the proxy's pods (`local_node`); only what neither allows
//! (the rest of the Node authorizer's, webhooks' subjects, denials) is reviewed.
//!
//! Decisions are cached per (identity hash, attributes) for kube-apiserver's webhook
//! authorizer defaults: allowed 5 minutes, denied 30 s (configurable); the identity hash
//! leaves out the credential id (`Identity::decision_hash`), so the tokens of one
//! ServiceAccount's pods and a kubelet's rotated certificates share decisions. A denial
//! answered less than [`DENY_SETTLE`] after an outage of the apiserver ended is not kept:
//! a restarted apiserver refuses requests until its authorizers' informers have synced, and
//! a client must not see that refusal longer than direct. Nor is a node's: the Node
//! authorizer's answers change with every pod bound to the node. Concurrent identical
//! questions share one review (single flight, moka's `try_get_with`): a thousand watchers
//! opening at once cost one `SubjectAccessReview`, not a thousand. If the one asking is
//! cancelled, a waiter takes over; an error is not cached, and a waiter given an error answer
//! (not an unreachable apiserver) asks once more in a flight of its own, so a request never
//! fails for a review sent before it arrived.
//!
//! While the apiserver is unreachable (no answer at all, see
//! [`crate::upstream::reachability`]), no review is sent, and an allowed decision obtained
//! before for the same identity and attributes (and the same RBAC generations) is served
//! stale for up to `authentication.staleWhileUnreachable` past its TTL; a denial obtained
//! since voids it. Anything else still fails closed with 503.
//!
//! Client-certificate callers asking to impersonate (`Impersonate-*`) are authorized here
//! too ([`Authorizer::impersonate`]), as the apiserver's impersonation filter does: the
//! proxy's own credentials carry their requests, so the apiserver cannot check them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::auth::authn::Identity;
use crate::auth::local_node::{LocalNode, NodeProbe};
use crate::auth::local_rbac::{LocalRbac, ProbeAnswer};
use crate::cache::registry::Caches;
use crate::cache::{ResourceCache, WatchError};
use crate::http::body;
use crate::k8s::status::{Reason, Status};
use crate::upstream::{As, Upstream};

pub use super::attributes::Attributes;
pub use super::rbac::rbac_resources;

/// The apiserver's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Allow,
    /// Denied or no opinion, with the authorizers' reason (often empty for RBAC).
    Deny(Arc<str>),
    /// No answer (network, timeout, non-2xx): fail closed.
    Error(String),
}

/// Why a review gave no decision (shared by the waiters of one flight, never cached).
#[derive(Debug)]
struct Failure {
    message: String,
    /// The apiserver gave no answer at all (see [`crate::upstream::reachability`]).
    unreachable: bool,
}

/// Counters for the metrics layer.
#[derive(Debug, Default)]
pub struct AuthzStats {
    pub allowed: AtomicU64,
    pub denied: AtomicU64,
    pub errors: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Allowed decisions served past their TTL because the apiserver was unreachable (also
    /// counted in `allowed`).
    pub stale: AtomicU64,
    /// Times cached decisions were forgotten because RBAC objects changed (per scope: the
    /// cluster, or one namespace).
    pub rbac_invalidations: AtomicU64,
    /// Decisions by [`Source`] and result (allowed, denied, error).
    pub by_source: [[AtomicU64; 3]; 4],
    /// SubjectAccessReviews sent, by [`IdentityKind`] of the identity asked about.
    pub reviews_by_kind: [AtomicU64; 4],
}

/// Where a decision came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// RBAC evaluated in the proxy.
    LocalRbac = 0,
    /// A review's answer cached before (or shared with a review in flight).
    ReviewCache = 1,
    /// A review sent for this question.
    Review = 2,
    /// The Node authorizer's graph walked in the proxy (`local_node`).
    LocalNode = 3,
}

impl Source {
    pub const ALL: [Source; 4] = [
        Source::LocalRbac,
        Source::LocalNode,
        Source::ReviewCache,
        Source::Review,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Source::LocalRbac => "local_rbac",
            Source::ReviewCache => "review_cache",
            Source::Review => "review",
            Source::LocalNode => "local_node",
        }
    }
}

/// Results counted in [`AuthzStats::by_source`], in order.
pub const RESULTS: [&str; 3] = ["allowed", "denied", "error"];

/// Who a review asked about, for the review rate per kind of client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityKind {
    Node = 0,
    ServiceAccount = 1,
    Anonymous = 2,
    User = 3,
}

impl IdentityKind {
    pub const ALL: [IdentityKind; 4] = [
        IdentityKind::Node,
        IdentityKind::ServiceAccount,
        IdentityKind::Anonymous,
        IdentityKind::User,
    ];

    pub fn of(id: &Identity) -> IdentityKind {
        if id.user.starts_with("system:node:") && id.groups.iter().any(|g| g == "system:nodes") {
            IdentityKind::Node
        } else if id.user.starts_with("system:serviceaccount:") {
            IdentityKind::ServiceAccount
        } else if id.user == "system:anonymous" {
            IdentityKind::Anonymous
        } else {
            IdentityKind::User
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            IdentityKind::Node => "node",
            IdentityKind::ServiceAccount => "serviceaccount",
            IdentityKind::Anonymous => "anonymous",
            IdentityKind::User => "user",
        }
    }
}

/// A denial answered this soon after an outage of the apiserver ended is not cached: the
/// apiserver may have been starting (it denies until its RBAC and Node authorizers'
/// informers synced, a few seconds), and the deny TTL would stretch that refusal.
pub const DENY_SETTLE: Duration = Duration::from_secs(60);

/// After an RBAC change is seen, the decisions it scopes are forgotten again this much later:
/// a review asked in between may have reached an apiserver whose authorizer had not seen the
/// change yet (its informer and the proxy's watch are two clients of one watch cache).
const RBAC_SETTLE: Duration = Duration::from_secs(1);

/// Generations of cached decisions, part of every decision's key: bumping one forgets every
/// decision of its scope at once (the entries age out by their TTL).
#[derive(Debug, Default)]
struct Generations {
    /// ClusterRoles and ClusterRoleBindings: every decision.
    cluster: AtomicU64,
    /// Roles and RoleBindings: the decisions in their namespace (a request at the cluster
    /// scope is decided by cluster bindings only).
    namespaces: dashmap::DashMap<String, u64>,
}

/// What an RBAC change voids.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Scope {
    Cluster,
    Namespace(String),
}

pub struct Authorizer {
    upstream: Upstream,
    /// Allow and Deny decisions, each kept for its own TTL ([`DecisionTtl`]); never errors.
    decisions: moka::future::Cache<[u8; 32], Decision>,
    /// Keys of allowed decisions, kept `staleWhileUnreachable` past the allow TTL, served
    /// only while the apiserver cannot be reached; a denial removes its key. `None`: off.
    stale: Option<moka::future::Cache<[u8; 32], ()>>,
    generations: Generations,
    timeout: Duration,
    pub stats: AuthzStats,
    allow_ttl: Duration,
    /// `authentication.staleWhileUnreachable`: also how long local RBAC decides from its
    /// last policy while the apiserver is unreachable.
    stale_grace: Duration,
    /// RBAC evaluated in the proxy, once [`Authorizer::follow_rbac`] started it.
    local: std::sync::OnceLock<Arc<LocalRbac>>,
    /// The Node authorizer's allows decided in the proxy, started with local RBAC.
    local_node: std::sync::OnceLock<Arc<LocalNode>>,
}

impl std::fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Authorizer")
    }
}

#[derive(Deserialize)]
struct Review {
    status: Option<ReviewStatus>,
}

#[derive(Deserialize)]
struct ReviewStatus {
    #[serde(default)]
    allowed: bool,
    #[serde(default)]
    reason: String,
    #[serde(default, rename = "evaluationError")]
    evaluation_error: String,
}

/// The apiserver's 403 for `id` asking `a` (k8s.io/apiserver `responsewriters.Forbidden` and
/// apimachinery `NewForbidden`).
pub fn forbidden(id: &Identity, a: &Attributes, reason: &str) -> Status {
    if !a.path.is_empty() {
        // A non-resource URL: no group/resource, so `NewForbidden` writes `forbidden: ...`
        // and empty details.
        let mut msg = format!("User {:?} cannot {} path {:?}", id.user, a.verb, a.path);
        if !reason.is_empty() {
            msg = format!("{msg}: {reason}");
        }
        return Status::failure(
            StatusCode::FORBIDDEN,
            Reason::Forbidden,
            format!("forbidden: {msg}"),
        )
        .with_details("", "", "");
    }
    let mut resource = a.resource.clone();
    if !a.subresource.is_empty() {
        resource = format!("{resource}/{}", a.subresource);
    }
    let mut msg = if a.namespace.is_empty() {
        format!(
            "User {:?} cannot {} resource {:?} in API group {:?} at the cluster scope",
            id.user, a.verb, resource, a.group
        )
    } else {
        format!(
            "User {:?} cannot {} resource {:?} in API group {:?} in the namespace {:?}",
            id.user, a.verb, resource, a.group, a.namespace
        )
    };
    if !reason.is_empty() {
        msg = format!("{msg}: {reason}");
    }
    let gr = if a.group.is_empty() {
        a.resource.clone()
    } else {
        format!("{}.{}", a.resource, a.group)
    };
    let message = if a.name.is_empty() {
        format!("{gr} is forbidden: {msg}")
    } else {
        format!("{gr} {:?} is forbidden: {msg}", a.name)
    };
    Status::failure(StatusCode::FORBIDDEN, Reason::Forbidden, message).with_details(
        &a.name,
        &a.group,
        &a.resource,
    )
}

/// The `SubjectAccessReview` asking whether `id` may do `a`.
fn review_body(id: &Identity, a: &Attributes) -> serde_json::Value {
    let mut spec = serde_json::json!({
        "user": id.user, "uid": id.uid, "groups": id.groups, "extra": id.extra,
    });
    if a.path.is_empty() {
        spec["resourceAttributes"] = serde_json::json!({
            "verb": a.verb, "group": a.group, "version": a.version,
            "resource": a.resource, "subresource": a.subresource,
            "namespace": a.namespace, "name": a.name,
        });
        if !a.field_selector.is_empty() {
            spec["resourceAttributes"]["fieldSelector"] =
                serde_json::json!({"rawSelector": a.field_selector});
        }
        if !a.label_selector.is_empty() {
            spec["resourceAttributes"]["labelSelector"] =
                serde_json::json!({"rawSelector": a.label_selector});
        }
    } else {
        spec["nonResourceAttributes"] = serde_json::json!({"path": a.path, "verb": a.verb});
    }
    serde_json::json!({
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": spec,
    })
}

/// One RBAC cache followed for [`Authorizer::follow_rbac`].
/// Confirms local Node authorization (`local_node`) once local RBAC is active: asks the
/// apiserver whether a node that does not exist may read its own Node, when the local RBAC
/// policy does not allow that (only then does an allow show the Node authorizer).
async fn probe_node(
    authz: std::sync::Weak<Authorizer>,
    local: Arc<LocalRbac>,
    node: Arc<LocalNode>,
) {
    const RETRY: Duration = Duration::from_secs(5);
    let (id, q) = LocalNode::probe();
    let mut warned = false;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        match local.mode() {
            "refused" => return,
            "active" => {}
            _ => continue,
        }
        match local.decide(&id, &q) {
            None => continue,
            Some(true) => {
                if !warned {
                    warned = true;
                    tracing::warn!(
                        "local Node authorization not confirmed: RBAC lets every node read its own Node, so the apiserver's answer cannot show the Node authorizer; kubelets' cache reads are authorized by SubjectAccessReview"
                    );
                }
                tokio::time::sleep(RETRY).await;
                continue;
            }
            Some(false) => {}
        }
        let Some(z) = authz.upgrade() else { return };
        let answer = match tokio::time::timeout(z.timeout, z.review(&id, &q)).await {
            Ok(Ok(Decision::Allow)) => NodeProbe::Allowed,
            Ok(Ok(Decision::Deny(_))) => NodeProbe::Denied,
            Ok(Ok(Decision::Error(e))) => NodeProbe::Failed(e),
            Ok(Err(f)) => NodeProbe::Failed(f.message),
            Err(_) => NodeProbe::Failed("access review timed out".into()),
        };
        drop(z);
        if node.probed(answer) {
            return;
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn follow(authz: std::sync::Weak<Authorizer>, cache: Arc<ResourceCache>) {
    /// How often an unsynced cache is looked at again (no I/O: its reflector retries).
    const UNSYNCED_POLL: Duration = Duration::from_millis(250);
    /// Unsynced this long: warn that revocations wait for the TTLs.
    const WARN_AFTER: Duration = Duration::from_secs(60);
    let label = cache.resource.label();
    let settle = |authz: &Arc<Authorizer>, scopes: Vec<Scope>| {
        for s in &scopes {
            authz.invalidate(s);
        }
        let later = Arc::downgrade(authz);
        tokio::spawn(async move {
            tokio::time::sleep(RBAC_SETTLE).await;
            if let Some(a) = later.upgrade() {
                for s in &scopes {
                    a.invalidate(s);
                }
            }
        });
    };
    let mut unsynced_since = tokio::time::Instant::now();
    let mut warned = false;
    // `None`: not following (not synced yet, or lost the thread): all decisions go when it
    // is picked up again, since changes may have been missed.
    let mut seen: Option<u64> = None;
    loop {
        let Some(a) = authz.upgrade() else { return };
        if !cache.is_ready() {
            seen = None;
            if !warned && unsynced_since.elapsed() > WARN_AFTER {
                warned = true;
                tracing::warn!(resource = %label, "RBAC objects are not synced: revoked permissions may still read the cache until cache.authorizationAllowTtl; may the proxy list and watch them?");
            }
            drop(a);
            tokio::time::sleep(UNSYNCED_POLL).await;
            continue;
        }
        let Some(at) = seen else {
            // (Re)synced: what changed meanwhile is unknown.
            seen = Some(cache.rv());
            if warned {
                tracing::info!(resource = %label, "RBAC objects synced; decisions follow their changes");
            }
            (warned, unsynced_since) = (false, tokio::time::Instant::now());
            settle(&a, vec![Scope::Cluster]);
            continue;
        };
        match cache.changes_since(at) {
            Ok((events, rv)) => {
                let mut scopes: Vec<Scope> = Vec::new();
                for e in &events {
                    let s = match &*e.object.meta.namespace {
                        "" => Scope::Cluster,
                        ns => Scope::Namespace(ns.to_string()),
                    };
                    if !scopes.contains(&s) {
                        scopes.push(s);
                    }
                }
                if scopes.contains(&Scope::Cluster) {
                    scopes = vec![Scope::Cluster];
                }
                if !scopes.is_empty() {
                    tracing::debug!(resource = %label, ?scopes, "RBAC changed; cached decisions forgotten");
                    settle(&a, scopes);
                }
                seen = Some(rv);
                drop(a);
                cache.wait_for_rv(rv + 1, UNSYNCED_POLL * 4).await;
            }
            Err(WatchError::Expired { .. } | WatchError::NotReady) => seen = None,
        }
    }
}

/// How long a cached decision lives: allowed and denied have their own TTLs.
struct DecisionTtl {
    allow: Duration,
    deny: Duration,
}

impl moka::Expiry<[u8; 32], Decision> for DecisionTtl {
    fn expire_after_create(
        &self,
        _key: &[u8; 32],
        value: &Decision,
        _created_at: std::time::Instant,
    ) -> Option<Duration> {
        Some(match value {
            Decision::Allow => self.allow,
            // Errors are never inserted (`try_get_with` does not cache an `Err`).
            Decision::Deny(_) | Decision::Error(_) => self.deny,
        })
    }
}

impl Authorizer {
    pub fn new(upstream: Upstream, allow_ttl: Duration, deny_ttl: Duration) -> Authorizer {
        Authorizer {
            upstream,
            decisions: moka::future::Cache::builder()
                .max_capacity(200_000)
                // As before the single flight: a zero TTL keeps a decision for 1 ms.
                .expire_after(DecisionTtl {
                    allow: allow_ttl.max(Duration::from_millis(1)),
                    deny: deny_ttl.max(Duration::from_millis(1)),
                })
                .build(),
            stale: None,
            generations: Generations::default(),
            timeout: Duration::from_secs(5),
            stats: AuthzStats::default(),
            allow_ttl,
            stale_grace: Duration::ZERO,
            local: std::sync::OnceLock::new(),
            local_node: std::sync::OnceLock::new(),
        }
    }

    /// Local RBAC, when started (`/debug`, metrics).
    pub fn local_rbac(&self) -> Option<&Arc<LocalRbac>> {
        self.local.get()
    }

    /// Local Node authorization, when local RBAC is on.
    pub fn local_node(&self) -> Option<&Arc<LocalNode>> {
        self.local_node.get()
    }

    /// Serves allowed decisions up to `stale` past their TTL while the apiserver is
    /// unreachable (`authentication.staleWhileUnreachable`; zero: never).
    pub fn with_stale_while_unreachable(mut self, stale: Duration) -> Authorizer {
        self.stale_grace = stale;
        self.stale = (!stale.is_zero()).then(|| {
            moka::future::Cache::builder()
                .max_capacity(200_000)
                .time_to_live(self.allow_ttl.saturating_add(stale))
                .build()
        });
        self
    }

    fn key(&self, id: &Identity, a: &Attributes) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.generations.cluster.load(Relaxed).to_be_bytes());
        let ns = match a.namespace.as_str() {
            "" => 0,
            ns => self.generations.namespaces.get(ns).map_or(0, |g| *g),
        };
        h.update(ns.to_be_bytes());
        h.update(id.decision_hash());
        for part in [
            &a.verb,
            &a.path,
            &a.group,
            &a.version,
            &a.resource,
            &a.subresource,
            &a.namespace,
            &a.name,
            &a.field_selector,
            &a.label_selector,
        ] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        h.finalize().into()
    }

    /// The apiserver's decision on `id` doing `a`, from the cache when known; concurrent
    /// identical questions wait for the one review in flight.
    pub async fn authorize(&self, id: &Identity, a: &Attributes) -> Decision {
        crate::telemetry::in_span("authorize", self.authorize_untraced(id, a)).await
    }

    /// The flight leader's part of [`Authorizer::authorize`]: the question asked (unless the
    /// apiserver is unreachable and it was answered before), its answer remembered for an
    /// outage.
    async fn review_and_remember(
        &self,
        key: [u8; 32],
        id: &Identity,
        a: &Attributes,
    ) -> Result<Decision, Failure> {
        let reachability = self.upstream.reachability();
        // During an outage a question answered before is not asked again (its
        // stale answer serves, below); a new one is asked, as the apiserver may be
        // back before the next probe says so.
        if let Some(o) = reachability.outage()
            && self.stale_allowed(&key).await
        {
            return Err(Failure {
                message: format!(
                    "access review not sent: the apiserver has been unreachable for {}s",
                    o.duration().as_secs()
                ),
                unreachable: true,
            });
        }
        let r = match tokio::time::timeout(self.timeout, self.review(id, a)).await {
            Ok(r) => r,
            Err(_) => Err(Failure {
                message: "access review timed out".to_string(),
                unreachable: true,
            }),
        };
        match &r {
            Err(f) if f.unreachable => reachability.unreachable(&f.message),
            Err(_) => {}
            Ok(d) => {
                if let Some(stale) = &self.stale {
                    if *d == Decision::Allow {
                        stale.insert(key, ()).await;
                    } else {
                        // A denial voids what was remembered of this question.
                        stale.invalidate(&key).await;
                    }
                }
            }
        }
        r
    }

    async fn authorize_untraced(&self, id: &Identity, a: &Attributes) -> Decision {
        // The apiserver's chain runs the Node authorizer before RBAC; either's allow is
        // final, so the order here is only the cheaper first.
        let local = if self
            .local
            .get()
            .is_some_and(|l| l.decide(id, a) == Some(true))
        {
            Some(Source::LocalRbac)
        } else if self.local_node.get().is_some_and(|n| n.allows(id, a)) {
            Some(Source::LocalNode)
        } else {
            None
        };
        if let Some(source) = local {
            self.stats.allowed.fetch_add(1, Relaxed);
            self.count(source, 0);
            crate::telemetry::set_current(|| {
                crate::telemetry::Attr::new("kcp.authz.decision", "allow")
            });
            crate::telemetry::set_current(|| {
                crate::telemetry::Attr::new("kcp.authz.source", source.as_str())
            });
            return Decision::Allow;
        }
        let key = self.key(id, a);
        let decide = || async {
            // Set only by the call whose review runs (the flight's leader).
            let led = std::sync::atomic::AtomicBool::new(false);
            let r = self
                .decisions
                .try_get_with(key, async {
                    led.store(true, Relaxed);
                    // Boxed, so only the flight's leader allocates it: the review's future
                    // is about 18 KB, and every request waiting for the decision would
                    // otherwise carry one (10,000 watch requests waiting for one decision
                    // held 200 MB).
                    Box::pin(self.review_and_remember(key, id, a)).await
                })
                .await;
            (r, led.load(Relaxed))
        };
        let (r, led) = crate::auth::ask_in_flight(decide, |e| !e.unreachable).await;
        let r = match r {
            Err(e) if e.unreachable && self.stale_allowed(&key).await => {
                self.stats.stale.fetch_add(1, Relaxed);
                tracing::debug!(user = %id.user, "apiserver unreachable; allowed decision served stale");
                Ok(Decision::Allow)
            }
            r => r,
        };
        let source = if led {
            self.stats.cache_misses.fetch_add(1, Relaxed);
            Source::Review
        } else {
            self.stats.cache_hits.fetch_add(1, Relaxed);
            Source::ReviewCache
        };
        if led
            && matches!(r, Ok(Decision::Deny(_)))
            && (IdentityKind::of(id) == IdentityKind::Node
                || self.upstream.reachability().recovered_within(DENY_SETTLE))
        {
            // Not kept: the refusal of an apiserver still starting, or a node's. The Node
            // authorizer allows a kubelet an object once a pod bound to its node refers to
            // it (its graph follows pods within milliseconds): a kubelet asking for a new
            // pod's Secret just before that edge exists would have been refused for the
            // whole deny TTL. Asked again next time, as the apiserver decides afresh.
            self.decisions.invalidate(&key).await;
        }
        self.count(
            source,
            match &r {
                Ok(Decision::Allow) => 0,
                Ok(_) => 1,
                Err(_) => 2,
            },
        );
        crate::telemetry::set_current(|| {
            let d = match &r {
                Ok(Decision::Allow) => "allow",
                Ok(_) => "deny",
                Err(_) => "error",
            };
            crate::telemetry::Attr::new("kcp.authz.decision", d)
        });
        crate::telemetry::set_current(|| crate::telemetry::Attr::new("kcp.authz.cached", !led));
        match r {
            Ok(Decision::Allow) => {
                self.stats.allowed.fetch_add(1, Relaxed);
                Decision::Allow
            }
            Ok(d) => {
                self.stats.denied.fetch_add(1, Relaxed);
                d
            }
            Err(e) => {
                self.stats.errors.fetch_add(1, Relaxed);
                // An outage is logged once, where it is found (`upstream::reachability`).
                if led && !e.unreachable {
                    tracing::warn!(error = %e.message, "access review failed; request refused (fail closed)");
                }
                Decision::Error(e.message.clone())
            }
        }
    }

    fn count(&self, source: Source, result: usize) {
        self.stats.by_source[source as usize][result].fetch_add(1, Relaxed);
    }

    /// Whether an allowed decision for `key` is remembered beyond its TTL.
    async fn stale_allowed(&self, key: &[u8; 32]) -> bool {
        match &self.stale {
            Some(s) => s.get(key).await.is_some(),
            None => false,
        }
    }

    /// Forgets the cached decisions of `scope`.
    fn invalidate(&self, scope: &Scope) {
        match scope {
            Scope::Cluster => {
                self.generations.cluster.fetch_add(1, Relaxed);
            }
            Scope::Namespace(ns) => {
                *self.generations.namespaces.entry(ns.clone()).or_default() += 1;
            }
        }
        self.stats.rbac_invalidations.fetch_add(1, Relaxed);
    }

    /// Follows the RBAC caches pinned in `caches` until `stop`: every change forgets the
    /// cached decisions it may alter, at once and again `RBAC_SETTLE` later, so a revoked
    /// (or granted) permission takes effect at the proxy as at the apiserver. Decisions of
    /// other authorizers (webhooks) still live for their TTLs. While a cache is not synced
    /// (e.g. the proxy may not list RBAC objects), its changes cannot be seen and the TTLs
    /// alone bound decisions; a warning says so.
    ///
    /// With `local_rbac`, also evaluates RBAC from those caches (see `local_rbac`).
    pub fn follow_rbac(
        self: &Arc<Self>,
        caches: &Arc<Caches>,
        local_rbac: bool,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut followed = Vec::new();
        for r in rbac_resources() {
            let Some(cache) = caches.pinned(&r.group, &r.version, &r.resource) else {
                continue;
            };
            followed.push(cache.clone());
            let this = Arc::downgrade(self);
            let stop = stop.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = follow(this, cache) => {}
                }
            });
        }
        if !local_rbac {
            tracing::info!(
                "local RBAC off (authorization.localRbac): every cache read is authorized by SubjectAccessReview"
            );
            return;
        }
        let Ok(four) = <[Arc<ResourceCache>; 4]>::try_from(followed) else {
            return;
        };
        let local = Arc::new(LocalRbac::new(four));
        if self.local.set(local.clone()).is_err() {
            return;
        }
        let this = Arc::downgrade(self);
        let probe = move |id: Identity, a: Attributes| {
            let this = this.clone();
            async move {
                let Some(z) = this.upgrade() else {
                    return ProbeAnswer::Failed("stopping".into());
                };
                match tokio::time::timeout(z.timeout, z.review(&id, &a)).await {
                    Ok(Ok(Decision::Allow)) => ProbeAnswer::Allowed,
                    Ok(Ok(Decision::Deny(_))) => ProbeAnswer::Denied,
                    Ok(Ok(Decision::Error(e))) => ProbeAnswer::Failed(e),
                    Ok(Err(f)) => ProbeAnswer::Failed(f.message),
                    Err(_) => ProbeAnswer::Failed("access review timed out".into()),
                }
            }
        };
        let upstream = self.upstream.clone();
        let grace = self.stale_grace;
        let outage = move || {
            upstream
                .reachability()
                .outage()
                .is_some_and(|o| o.duration() < grace)
        };
        let node = Arc::new(LocalNode::new(caches));
        if self.local_node.set(node.clone()).is_ok() {
            let stop = stop.clone();
            let this = Arc::downgrade(self);
            let local = local.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = probe_node(this, local, node) => {}
                }
            });
        }
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = local.follow(probe, outage) => {}
            }
        });
    }

    async fn review(&self, id: &Identity, a: &Attributes) -> Result<Decision, Failure> {
        // No answer at all (the apiserver may have answered before: a stale decision may do).
        let unreachable = |message| Failure {
            message,
            unreachable: true,
        };
        let failed = |message| Failure {
            message,
            unreachable: false,
        };
        self.stats.reviews_by_kind[IdentityKind::of(id) as usize].fetch_add(1, Relaxed);
        let body = review_body(id, a);
        let mut req = Request::new(body::full(body.to_string()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = self
            .upstream
            .uri("/apis/authorization.k8s.io/v1/subjectaccessreviews");
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        req.headers_mut()
            .insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        let resp = match self.upstream.send(req, As::Proxy, false).await {
            Ok(r) => r,
            Err(e) => return Err(unreachable(format!("access review: {e}"))),
        };
        let status = resp.status();
        let bytes = match resp.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return Err(unreachable(format!("access review: {e}"))),
        };
        if !status.is_success() {
            return Err(failed(format!("access review returned {status}")));
        }
        match serde_json::from_slice::<Review>(&bytes) {
            Ok(Review {
                status: Some(s), ..
            }) if s.allowed => Ok(Decision::Allow),
            Ok(Review { status: Some(s) }) => {
                if !s.evaluation_error.is_empty() {
                    tracing::debug!(error = %s.evaluation_error, "access review evaluation error");
                }
                Ok(Decision::Deny(Arc::from(s.reason)))
            }
            Ok(Review { status: None }) => Ok(Decision::Deny(Arc::from(""))),
            Err(e) => Err(failed(format!("access review: {e}"))),
        }
    }

    /// Authorizes the `Impersonate-*` headers of a caller `id` the proxy authenticated, as
    /// the apiserver's impersonation filter does. `Ok(None)`: no impersonation asked;
    /// `Ok(Some(target))`: allowed, act as `target`; `Err(status)`: the 403 (or 503, 400).
    pub async fn impersonate(
        &self,
        id: &Identity,
        headers: &HeaderMap,
    ) -> Result<Option<Identity>, Status> {
        let mut user = None;
        let mut uid = None;
        let mut groups = Vec::new();
        let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut any = false;
        for (name, value) in headers {
            let n = name.as_str();
            if !n.starts_with("impersonate-") {
                continue;
            }
            any = true;
            let v = value
                .to_str()
                .map_err(|_| Status::bad_request("invalid impersonation header value"))?
                .to_string();
            match n {
                "impersonate-user" => user = Some(v),
                "impersonate-uid" => uid = Some(v),
                "impersonate-group" => groups.push(v),
                _ => match n.strip_prefix("impersonate-extra-") {
                    Some(k) if !k.is_empty() => {
                        let k = percent_encoding::percent_decode_str(k)
                            .decode_utf8_lossy()
                            .to_string();
                        extra.entry(k).or_default().push(v);
                    }
                    _ => {}
                },
            }
        }
        if !any {
            return Ok(None);
        }
        let Some(user) = user.filter(|u| !u.is_empty()) else {
            return Err(Status::failure(
                StatusCode::INTERNAL_SERVER_ERROR,
                Reason::InternalError,
                "Internal error occurred: requested [...] without impersonating a user",
            ));
        };
        let mut checks = Vec::new();
        match user
            .strip_prefix("system:serviceaccount:")
            .and_then(|r| r.split_once(':'))
        {
            Some((ns, name)) => checks.push(Attributes {
                verb: "impersonate".into(),
                resource: "serviceaccounts".into(),
                namespace: ns.into(),
                name: name.into(),
                ..Default::default()
            }),
            None => checks.push(Attributes {
                verb: "impersonate".into(),
                resource: "users".into(),
                name: user.clone(),
                ..Default::default()
            }),
        }
        for g in &groups {
            checks.push(Attributes {
                verb: "impersonate".into(),
                resource: "groups".into(),
                name: g.clone(),
                ..Default::default()
            });
        }
        if let Some(u) = &uid {
            checks.push(Attributes {
                verb: "impersonate".into(),
                group: "authentication.k8s.io".into(),
                resource: "uids".into(),
                name: u.clone(),
                ..Default::default()
            });
        }
        for (k, vs) in &extra {
            for v in vs {
                checks.push(Attributes {
                    verb: "impersonate".into(),
                    group: "authentication.k8s.io".into(),
                    resource: "userextras".into(),
                    subresource: k.clone(),
                    name: v.clone(),
                    ..Default::default()
                });
            }
        }
        for a in &checks {
            match self.authorize(id, a).await {
                Decision::Allow => {}
                Decision::Deny(r) => return Err(forbidden(id, a, &r)),
                Decision::Error(e) => {
                    return Err(Status::service_unavailable(
                        format!("authorization is unavailable: {e}"),
                        1,
                    ));
                }
            }
        }
        let mut target = Identity {
            user: user.clone(),
            uid: uid.unwrap_or_default(),
            groups,
            extra,
            tenant: id.tenant.clone(),
        };
        if let Some((ns, _)) = user
            .strip_prefix("system:serviceaccount:")
            .and_then(|r| r.split_once(':'))
        {
            target.groups.push("system:serviceaccounts".into());
            target.groups.push(format!("system:serviceaccounts:{ns}"));
        }
        if user != "system:anonymous" && !target.groups.iter().any(|g| g == "system:authenticated")
        {
            target.groups.push("system:authenticated".into());
        }
        Ok(Some(target))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(user: &str) -> Identity {
        Identity {
            user: user.into(),
            uid: String::new(),
            groups: vec![],
            extra: BTreeMap::new(),
            tenant: String::new(),
        }
    }

    fn msg(s: &Status) -> String {
        s.message().to_string()
    }

    #[test]
    fn forbidden_messages_match_the_apiserver() {
        let list = Attributes {
            verb: "list".into(),
            resource: "pods".into(),
            namespace: "ns1".into(),
            version: "v1".into(),
            ..Default::default()
        };
        assert_eq!(
            msg(&forbidden(&id("bob"), &list, "")),
            "pods is forbidden: User \"bob\" cannot list resource \"pods\" in API group \"\" in the namespace \"ns1\""
        );
        let get = Attributes {
            verb: "get".into(),
            group: "apps".into(),
            resource: "deployments".into(),
            name: "web".into(),
            ..Default::default()
        };
        let s = forbidden(
            &id("bob"),
            &get,
            "RBAC: role.rbac.authorization.k8s.io \"x\" not found",
        );
        assert_eq!(
            msg(&s),
            "deployments.apps \"web\" is forbidden: User \"bob\" cannot get resource \"deployments\" in API group \"apps\" at the cluster scope: RBAC: role.rbac.authorization.k8s.io \"x\" not found"
        );
        let v: serde_json::Value = serde_json::from_slice(&s.to_bytes()).unwrap();
        assert_eq!(v["code"], 403);
        assert_eq!(v["reason"], "Forbidden");
        assert_eq!(
            v["details"],
            serde_json::json!({"name": "web", "group": "apps", "kind": "deployments"})
        );
    }

    #[tokio::test]
    async fn non_resource_reviews_and_denials_are_the_apiservers() {
        let a = Attributes {
            verb: "get".into(),
            path: "/metrics".into(),
            ..Default::default()
        };
        let body = review_body(&id("bob"), &a);
        assert_eq!(
            body["spec"]["nonResourceAttributes"],
            serde_json::json!({"path": "/metrics", "verb": "get"})
        );
        assert!(body["spec"].get("resourceAttributes").is_none(), "{body}");
        let v: serde_json::Value =
            serde_json::from_slice(&forbidden(&id("system:anonymous"), &a, "").to_bytes()).unwrap();
        assert_eq!(
            v["message"],
            "forbidden: User \"system:anonymous\" cannot get path \"/metrics\""
        );
        assert_eq!(v["reason"], "Forbidden");
        assert_eq!(v["code"], 403);
        assert_eq!(v["details"], serde_json::json!({}));
        let r = Attributes {
            verb: "get".into(),
            resource: "pods".into(),
            ..Default::default()
        };
        assert!(review_body(&id("bob"), &r)["spec"]["resourceAttributes"].is_object());
        let z = authorizer();
        assert_ne!(z.key(&id("u"), &a), z.key(&id("u"), &r));
    }

    #[tokio::test]
    async fn decision_cache_keys_separate_identities_and_attributes() {
        let a = Attributes {
            verb: "list".into(),
            resource: "pods".into(),
            ..Default::default()
        };
        let z = authorizer();
        let mut b = a.clone();
        b.namespace = "x".into();
        assert_ne!(z.key(&id("u"), &a), z.key(&id("u"), &b));
        assert_ne!(z.key(&id("u"), &a), z.key(&id("v"), &a));
        let mut g = id("u");
        g.groups.push("system:masters".into());
        assert_ne!(z.key(&id("u"), &a), z.key(&g, &a));
    }

    /// An apiserver address nothing listens on: bound, then closed.
    fn closed_port_upstream() -> Upstream {
        crate::http::tls::install_crypto_provider();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let kube = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        Upstream::new(&kube, &crate::config::UpstreamConfig::default()).unwrap()
    }

    #[tokio::test]
    async fn allowed_decisions_are_served_stale_only_for_their_question_while_unreachable() {
        let a = Attributes {
            verb: "list".into(),
            version: "v1".into(),
            resource: "configmaps".into(),
            ..Default::default()
        };
        let z = Authorizer::new(closed_port_upstream(), Duration::ZERO, Duration::ZERO)
            .with_stale_while_unreachable(Duration::from_secs(300));
        // As if the apiserver had allowed alice this list before.
        let key = z.key(&id("alice"), &a);
        z.stale.as_ref().unwrap().insert(key, ()).await;
        // The review gets no answer (connection refused): the outage starts, and the
        // decision obtained before is served stale.
        assert_eq!(z.authorize(&id("alice"), &a).await, Decision::Allow);
        assert!(z.upstream.reachability().is_unreachable());
        assert_eq!(z.stats.stale.load(Relaxed), 1);
        // Never for another identity or another question.
        assert!(matches!(
            z.authorize(&id("bob"), &a).await,
            Decision::Error(_)
        ));
        let mut get = a.clone();
        get.verb = "get".into();
        assert!(matches!(
            z.authorize(&id("alice"), &get).await,
            Decision::Error(_)
        ));
        // Nor after an RBAC change voided the decisions of its scope.
        z.invalidate(&Scope::Cluster);
        assert!(matches!(
            z.authorize(&id("alice"), &a).await,
            Decision::Error(_)
        ));
        assert_eq!(z.stats.stale.load(Relaxed), 1);
        // Off with zero.
        let off = Authorizer::new(closed_port_upstream(), Duration::ZERO, Duration::ZERO)
            .with_stale_while_unreachable(Duration::ZERO);
        assert!(off.stale.is_none());
        assert!(matches!(
            off.authorize(&id("alice"), &a).await,
            Decision::Error(_)
        ));
    }

    #[tokio::test]
    async fn a_request_waiting_for_an_access_review_does_not_hold_one() {
        // Every request asking the same question waits in one flight while its leader asks
        // the apiserver; the leader's future (the review, an HTTP request, and its answer
        // remembered) is allocated by the leader only. (A burst of watch requests waiting
        // for one review held it each, and 44 KB a request in all.)
        let z = authorizer();
        let a = Attributes {
            verb: "watch".into(),
            resource: "configmaps".into(),
            namespace: "x".into(),
            ..Default::default()
        };
        let alice = id("alice");
        let waiting = std::mem::size_of_val(&z.authorize(&alice, &a));
        // 19,184 B with the leader's part in place (this toolchain, debug and release).
        assert!(waiting < 8 * 1024, "authorize: {waiting} B");
    }

    fn authorizer() -> Authorizer {
        crate::http::tls::install_crypto_provider();
        // Never contacted.
        let kube = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let up = Upstream::new(&kube, &crate::config::UpstreamConfig::default()).unwrap();
        Authorizer::new(up, Duration::from_secs(300), Duration::from_secs(30))
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
    async fn rbac_changes_forget_the_decisions_of_their_scope_now_and_once_settled() {
        use crate::cache::EventKind;
        use crate::cache::{CachedObject, ReflectorSink, StoreConfig};
        let z = Arc::new(authorizer());
        let [roles, _, cluster_roles, _]: [Arc<ResourceCache>; 4] = rbac_resources()
            .into_iter()
            .map(|r| ResourceCache::new(r, StoreConfig::default()))
            .collect::<Vec<_>>()
            .try_into()
            .unwrap();
        roles.replace(vec![], 10);
        cluster_roles.replace(vec![], 10);
        tokio::spawn(follow(Arc::downgrade(&z), roles.clone()));
        tokio::spawn(follow(Arc::downgrade(&z), cluster_roles.clone()));
        let count = || z.stats.rbac_invalidations.load(Relaxed);
        // Synced: everything once at once and once settled, per cache.
        until("the initial invalidations", || count() == 4).await;
        let at = |ns: &str| Attributes {
            verb: "get".into(),
            resource: "pods".into(),
            namespace: ns.into(),
            ..Default::default()
        };
        let keys = |z: &Authorizer| ["x", "y", ""].map(|ns| z.key(&id("u"), &at(ns)));
        let before = keys(&z);
        let role = |ns: &str, rv: u64| {
            let raw = serde_json::json!({"metadata": {"name": "r", "namespace": ns,
                "uid": "u", "resourceVersion": rv.to_string()}});
            CachedObject::parse(raw.to_string().into(), &rbac_resources()[0]).unwrap()
        };
        // A Role in x: decisions in x go, the others stay.
        roles.apply(EventKind::Added, role("x", 11));
        until("a role's invalidations", || count() == 6).await;
        let after = keys(&z);
        assert_ne!(before[0], after[0]);
        assert_eq!(before[1..], after[1..]);
        // A ClusterRole: every decision goes.
        let raw =
            serde_json::json!({"metadata": {"name": "c", "uid": "c", "resourceVersion": "12"}});
        cluster_roles.apply(
            EventKind::Deleted,
            CachedObject::parse(raw.to_string().into(), &rbac_resources()[2]).unwrap(),
        );
        until("a cluster role's invalidations", || count() == 8).await;
        let last = keys(&z);
        for i in 0..3 {
            assert_ne!(after[i], last[i]);
        }
    }
}
