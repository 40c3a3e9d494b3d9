//! Tenants: namespace scope and quotas on cache-served requests.
//!
//! An identity belongs to a tenant by [`TenantMapper`] (config `tenants`). For the
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
//!
//! The pieces, one file each: the mapping of identities to tenants (`mapping`), one
//! tenant's quotas (`quota`), filtered cluster views (`view`) and the guard that ends a
//! view's watch once the view changes (`view_watch`). [`Tenancy`], here, holds the tenants.

mod mapping;
mod quota;
mod view;
mod view_watch;

pub use mapping::{TenantMapper, glob};
pub use quota::{QuotaRejections, Refusal, Tenant, WatchPermit};
pub use view::view_hash;
pub use view_watch::ViewWatch;

use std::collections::HashMap;

use crate::auth::authn::Identity;
use crate::config::TenantConfig;

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

    /// Whether a passthrough request is subject to tenant quotas: a LIST takes a token of
    /// the caller's tenant's read bucket (unless the cache path already took one for this
    /// request: `read_charged`), a WATCH one of its watch slots. Everything else passes
    /// untouched (see the module docs), and the caller need not be identified.
    pub fn charges_passthrough(
        &self,
        info: &crate::k8s::request_info::RequestInfo,
        read_charged: bool,
    ) -> bool {
        let watch = info.verb == "watch";
        !self.tenants.is_empty()
            && info.is_resource_request
            && (watch || info.verb == "list" && !read_charged)
    }

    /// Tenant quotas on a passthrough request that [`Tenancy::charges_passthrough`] selected,
    /// for the identified caller `id`: a watch holds the returned permit until the stream
    /// ends. Callers of no tenant pass untouched.
    pub fn admit_passthrough(
        &self,
        id: &Identity,
        info: &crate::k8s::request_info::RequestInfo,
    ) -> Result<Option<WatchPermit>, Refusal> {
        let Some(t) = self.get(&id.tenant) else {
            return Ok(None);
        };
        if info.verb == "watch" {
            t.admit_watch()
        } else {
            t.admit_read().map(|()| None)
        }
    }
}
