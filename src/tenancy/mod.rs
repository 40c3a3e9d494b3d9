//! Tenants: namespace scope and quotas on cache-served requests.
//!
//! An identity belongs to a tenant by `authn::TenantMapper` (config `tenants`). For the
//! tenant's callers the proxy adds what the apiserver cannot:
//! - quotas: concurrent watches, LIST/GET rate and burst (a token bucket, `governor`), and the
//!   number of objects one unpaginated cache-served list may return. Over quota: 429
//!   TooManyRequests with an integer `Retry-After` (client-go waits that long and retries).
//!   Cache-served requests are charged after the full authentication chain; passthrough
//!   LISTs and WATCHes are charged too when the proxy can name the caller without asking the
//!   apiserver ([`Tenancy::admit_passthrough`], `authn::Authenticator::identify_offline`:
//!   certificates, the token file, cached verdicts, offline-verified ServiceAccount JWTs) —
//!   a LIST takes a token of the same bucket, a WATCH holds one of the same slots until its
//!   stream ends (a caller asking to impersonate is charged as itself, not as its target). Callers it cannot name (no credentials, tokens only a TokenReview could
//!   judge and not seen on a cache-served request within `cacheTtl`) are left to the
//!   apiserver's own limits; passthrough GETs and the unpaginated-list size are not
//!   charged (the size is only known after the apiserver answered);
//! - a filtered cluster view: with `filteredClusterView: true`, a cluster-wide list/watch of a
//!   namespaced resource that RBAC denies at cluster scope is served with only the objects in
//!   the tenant's namespaces (static list and label selector on cached Namespace objects)
//!   where the caller may do the same verb — from the one shared cache, with the watch's
//!   events filtered by the same namespace set ([`crate::cache::hub::Filter::namespaces`]). The set
//!   is fixed when the request starts; a watch never delivers anything from outside the set
//!   it started with. An open watch re-derives its view every `viewRecheckInterval`
//!   ([`ViewWatch`]); once it differs (a namespace joined by label or RoleBinding, or left),
//!   the watch ends with an ERROR event carrying 410 Expired and the client relists into the
//!   new view: objects of a joining namespace arrive with that list, those of a leaving one
//!   disappear from it (there are no per-object ADDED/DELETED transitions on the open
//!   stream). Until the recheck notices (at most one interval, plus the namespace cache's
//!   watch delay), events of a namespace that left may still flow on an open watch. Access
//!   changes are seen as the decision cache expires them. Left open: a view
//!   that changes between a watch's end and the client's re-watch from its resourceVersion
//!   is not noticed by that new watch. Continue tokens are bound to a hash of the set, so a
//!   page walk whose view changed between pages is refused (400, like any token of another
//!   caller or query) instead of mixing two views; the client starts a new list. Without a
//!   filtered view the caller gets the apiserver's 403.
//!
//! Tenancy never widens access: every namespace in a filtered view is authorized by a
//! SubjectAccessReview of its own, and requests inside one namespace are authorized exactly
//! as the apiserver would.

use std::collections::{BTreeSet, HashMap};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use http::StatusCode;

use crate::auth::authn::{Authenticator, Identity};
use crate::auth::authz::{Attributes, Authorizer, Decision};
use crate::cache::ResourceCache;
use crate::config::TenantConfig;
use crate::k8s::selector::LabelSelector;
use crate::k8s::status::{Reason, Status};

/// Rejections by quota, per tenant (metrics).
#[derive(Debug, Default)]
pub struct QuotaRejections {
    pub watches: AtomicU64,
    pub rate: AtomicU64,
    pub list_size: AtomicU64,
}

/// One tenant's configuration and live quota state.
pub struct Tenant {
    pub config: TenantConfig,
    selector: Option<LabelSelector>,
    watches: Arc<AtomicU32>,
    limiter: Option<DefaultDirectRateLimiter>,
    pub rejections: QuotaRejections,
}

impl std::fmt::Debug for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenant")
            .field("name", &self.config.name)
            .finish_non_exhaustive()
    }
}

/// Holds one watch slot of a tenant until dropped (with the response body).
#[derive(Debug)]
pub struct WatchPermit(Arc<AtomicU32>);

impl Drop for WatchPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A refusal (boxed: `Status` is large and most calls succeed).
pub type Refusal = Box<Status>;

fn too_many(message: String, retry_after: u32) -> Refusal {
    Box::new(
        Status::failure(
            StatusCode::TOO_MANY_REQUESTS,
            Reason::TooManyRequests,
            message,
        )
        .with_retry_after(retry_after.max(1)),
    )
}

impl Tenant {
    fn new(config: TenantConfig) -> Tenant {
        let q = &config.quotas;
        let limiter = q.list_qps.filter(|r| *r > 0.0 && r.is_finite()).map(|qps| {
            let burst = q.list_burst.unwrap_or_else(|| qps.ceil() as u32).max(1);
            let period = Duration::from_secs_f64(1.0 / qps);
            let quota = Quota::with_period(period)
                .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
                .allow_burst(NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN));
            RateLimiter::direct(quota)
        });
        Tenant {
            selector: config
                .namespace_selector
                .as_deref()
                .and_then(|s| LabelSelector::parse(s).ok()),
            config,
            watches: Arc::new(AtomicU32::new(0)),
            limiter,
            rejections: QuotaRejections::default(),
        }
    }

    /// Takes one LIST/GET token from the tenant's bucket, or 429 with the wait until the next.
    pub fn admit_read(&self) -> Result<(), Refusal> {
        let Some(l) = &self.limiter else {
            return Ok(());
        };
        l.check().map_err(|not_until| {
            self.rejections.rate.fetch_add(1, Ordering::Relaxed);
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            too_many(
                format!(
                    "tenant {:?} is over its list rate quota; retry later",
                    self.config.name
                ),
                wait.as_secs_f64().ceil() as u32,
            )
        })
    }

    /// Takes one of the tenant's watch slots, released when the permit drops.
    pub fn admit_watch(&self) -> Result<Option<WatchPermit>, Refusal> {
        let Some(max) = self.config.quotas.max_watches else {
            return Ok(None);
        };
        let prev = self.watches.fetch_add(1, Ordering::AcqRel);
        let permit = WatchPermit(self.watches.clone());
        if prev >= max {
            drop(permit);
            self.rejections.watches.fetch_add(1, Ordering::Relaxed);
            return Err(too_many(
                format!(
                    "tenant {:?} has reached its limit of {max} concurrent watches",
                    self.config.name
                ),
                // A watch slot frees when any of the tenant's watches ends; client-go's
                // reflector backoff starts near 1 s anyway.
                1,
            ));
        }
        Ok(Some(permit))
    }

    /// Refuses an unpaginated list of more than `maxListObjects` objects.
    pub fn admit_list_size(&self, objects: usize) -> Result<(), Refusal> {
        match self.config.quotas.max_list_objects {
            Some(max) if objects > max => {
                self.rejections.list_size.fetch_add(1, Ordering::Relaxed);
                Err(too_many(
                    format!(
                        "the list has {objects} objects, over tenant {:?}'s limit of {max} for an unpaginated list; use limit and continue",
                        self.config.name
                    ),
                    1,
                ))
            }
            _ => Ok(()),
        }
    }

    /// The tenant's namespaces: the static list plus cached Namespaces matching the selector.
    pub fn namespaces(&self, namespace_cache: Option<&ResourceCache>) -> BTreeSet<String> {
        let mut out: BTreeSet<String> = self.config.namespaces.iter().cloned().collect();
        if let (Some(sel), Some(cache)) = (&self.selector, namespace_cache) {
            out.extend(
                cache
                    .current()
                    .objects
                    .values()
                    .filter(|o| sel.matches(|k| o.label(k)))
                    .map(|o| o.meta.name.to_string()),
            );
        }
        out
    }
}

/// An open watch through a filtered cluster view, and what it needs to re-derive that view.
pub struct ViewWatch {
    pub tenancy: Arc<Tenancy>,
    pub authz: Arc<Authorizer>,
    pub caches: Arc<crate::cache::registry::Caches>,
    pub id: Arc<Identity>,
    pub attrs: Attributes,
    /// The namespace set the watch started with.
    pub view: Arc<BTreeSet<String>>,
}

impl ViewWatch {
    /// Resolves once the caller's view is no longer the one the watch started with.
    async fn changed(self) {
        let Some(every) = self.tenancy.get(&self.id.tenant).map(|t| {
            t.config
                .view_recheck_interval
                .max(Duration::from_millis(100))
        }) else {
            return std::future::pending().await;
        };
        loop {
            tokio::time::sleep(every).await;
            let ns = self.caches.get("", "v1", "namespaces");
            let now = self
                .tenancy
                .filtered_view(&self.authz, ns.as_deref(), &self.id, &self.attrs, true)
                .await;
            if now.as_deref() != Some(&*self.view) {
                tracing::debug!(tenant = %self.id.tenant, user = %self.id.user, resource = %self.attrs.resource, "filtered cluster view changed; ending the watch with 410");
                return;
            }
        }
    }

    /// Passes the watch body's frames (whole events) through until the view changes, then
    /// ends the stream with an ERROR event carrying 410 Expired (client-go relists on it).
    pub fn guard(self, watch: crate::http::body::Body) -> crate::http::body::Body {
        use futures_util::StreamExt;
        use http_body_util::BodyStream;
        type Changed = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
        let changed: Changed = Box::pin(self.changed());
        let s = futures_util::stream::unfold(
            Some((BodyStream::new(watch), changed)),
            |st| async move {
                let (mut inner, mut changed) = st?;
                tokio::select! {
                    biased;
                    f = inner.next() => f.map(|f| (f, Some((inner, changed)))),
                    () = &mut changed => {
                        let status = Status::failure(
                            StatusCode::GONE,
                            Reason::Expired,
                            "the namespaces of this caller's filtered cluster view changed; list again",
                        );
                        let mut frame = b"{\"type\":\"ERROR\",\"object\":".to_vec();
                        frame.extend_from_slice(&status.to_bytes());
                        frame.extend_from_slice(b"}\n");
                        Some((Ok(hyper::body::Frame::data(bytes::Bytes::from(frame))), None))
                    }
                }
            },
        );
        crate::http::body::boxed(http_body_util::StreamBody::new(s))
    }
}

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

/// All tenants, by name.
#[derive(Debug, Default)]
pub struct Tenancy {
    tenants: HashMap<String, Tenant>,
}

impl Tenancy {
    pub fn new(configs: &[TenantConfig]) -> Tenancy {
        Tenancy {
            tenants: configs
                .iter()
                .map(|c| (c.name.clone(), Tenant::new(c.clone())))
                .collect(),
        }
    }

    /// The tenant named `name`; `None` for the unnamed tenant (no quotas, no view).
    pub fn get(&self, name: &str) -> Option<&Tenant> {
        self.tenants.get(name)
    }

    pub fn tenants(&self) -> impl Iterator<Item = &Tenant> {
        self.tenants.values()
    }

    /// Tenant quotas on a passthrough request: a LIST takes a token of the caller's tenant's
    /// read bucket (unless the cache path already took one for this request:
    /// `read_charged`), a WATCH one of its watch slots, held by the returned permit until the
    /// stream ends. Everything else, unidentified callers and callers of no tenant pass
    /// untouched (see the module docs).
    pub async fn admit_passthrough(
        &self,
        authn: &Authenticator,
        cert: Option<&crate::auth::identity::CertIdentity>,
        headers: &http::HeaderMap,
        info: &crate::k8s::request_info::RequestInfo,
        read_charged: bool,
    ) -> Result<Option<WatchPermit>, Refusal> {
        let watch = info.verb == "watch";
        if self.tenants.is_empty()
            || !info.is_resource_request
            || !(watch || info.verb == "list" && !read_charged)
        {
            return Ok(None);
        }
        let Some(id) = authn.identify_offline(cert, headers).await else {
            return Ok(None);
        };
        let Some(t) = self.get(&id.tenant) else {
            return Ok(None);
        };
        if watch {
            t.admit_watch()
        } else {
            t.admit_read().map(|()| None)
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TenantQuotas;

    fn tenant(q: TenantQuotas) -> Tenant {
        Tenant::new(TenantConfig {
            name: "t".into(),
            matches: Default::default(),
            namespaces: vec!["a".into()],
            namespace_selector: None,
            filtered_cluster_view: false,
            view_recheck_interval: Duration::from_secs(10),
            quotas: q,
        })
    }

    #[test]
    fn watch_slots_are_limited_and_freed_when_a_watch_ends() {
        let t = tenant(TenantQuotas {
            max_watches: Some(2),
            ..Default::default()
        });
        let a = t.admit_watch().unwrap();
        let _b = t.admit_watch().unwrap();
        let refused = t.admit_watch().unwrap_err();
        assert_eq!(refused.code(), 429);
        drop(a);
        assert!(t.admit_watch().is_ok());
        assert_eq!(t.rejections.watches.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn the_read_rate_allows_the_burst_then_says_when_to_retry() {
        let t = tenant(TenantQuotas {
            list_qps: Some(0.5),
            list_burst: Some(3),
            ..Default::default()
        });
        for _ in 0..3 {
            t.admit_read().unwrap();
        }
        let s = t.admit_read().unwrap_err();
        assert_eq!(s.code(), 429);
        let resp = s.into_response();
        let secs: u32 = resp.headers()[http::header::RETRY_AFTER]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        // One token every 2 s.
        assert!((1..=2).contains(&secs), "{secs}");
    }

    #[test]
    fn unpaginated_lists_over_the_limit_are_refused() {
        let t = tenant(TenantQuotas {
            max_list_objects: Some(10),
            ..Default::default()
        });
        assert!(t.admit_list_size(10).is_ok());
        assert_eq!(t.admit_list_size(11).unwrap_err().code(), 429);
        let unlimited = tenant(TenantQuotas::default());
        assert!(unlimited.admit_list_size(usize::MAX).is_ok());
        assert!(unlimited.admit_watch().unwrap().is_none());
        assert!(unlimited.admit_read().is_ok());
    }
}
