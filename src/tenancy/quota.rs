//! One tenant ([`Tenant`]): its configuration, its namespaces, and the live state of its
//! quotas (concurrent watches, LIST/GET rate and burst, unpaginated list size), each refusal
//! a 429 with a `Retry-After`.

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use http::StatusCode;

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

/// A tenant quota refused the request. Every kind becomes a 429 `TooManyRequests` with a
/// `Retry-After`, decided in one place: `impl From<Refusal> for Status` below.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// No LIST/GET token left in the bucket; `retry_after`: seconds until the next.
    #[error("tenant {tenant:?} is over its list rate quota; retry later")]
    Rate { tenant: String, retry_after: u32 },
    #[error("tenant {tenant:?} has reached its limit of {max} concurrent watches")]
    Watches { tenant: String, max: u32 },
    #[error(
        "the list has {objects} objects, over tenant {tenant:?}'s limit of {max} for an \
         unpaginated list; use limit and continue"
    )]
    ListSize {
        tenant: String,
        objects: usize,
        max: usize,
    },
}

impl From<Refusal> for Status {
    fn from(r: Refusal) -> Status {
        let retry_after = match &r {
            Refusal::Rate { retry_after, .. } => *retry_after,
            // A watch slot frees when any of the tenant's watches ends; client-go's
            // reflector backoff starts near 1 s anyway.
            Refusal::Watches { .. } => 1,
            Refusal::ListSize { .. } => 1,
        };
        Status::failure(
            StatusCode::TOO_MANY_REQUESTS,
            Reason::TooManyRequests,
            r.to_string(),
        )
        .with_retry_after(retry_after.max(1))
    }
}

impl Tenant {
    pub(super) fn new(config: TenantConfig) -> Tenant {
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
            Refusal::Rate {
                tenant: self.config.name.clone(),
                retry_after: wait.as_secs_f64().ceil() as u32,
            }
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
            return Err(Refusal::Watches {
                tenant: self.config.name.clone(),
                max,
            });
        }
        Ok(Some(permit))
    }

    /// Refuses an unpaginated list of more than `maxListObjects` objects.
    pub fn admit_list_size(&self, objects: usize) -> Result<(), Refusal> {
        match self.config.quotas.max_list_objects {
            Some(max) if objects > max => {
                self.rejections.list_size.fetch_add(1, Ordering::Relaxed);
                Err(Refusal::ListSize {
                    tenant: self.config.name.clone(),
                    objects,
                    max,
                })
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
        let refused = Status::from(t.admit_watch().unwrap_err());
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
        let s = Status::from(t.admit_read().unwrap_err());
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
        assert_eq!(Status::from(t.admit_list_size(11).unwrap_err()).code(), 429);
        let unlimited = tenant(TenantQuotas::default());
        assert!(unlimited.admit_list_size(usize::MAX).is_ok());
        assert!(unlimited.admit_watch().unwrap().is_none());
        assert!(unlimited.admit_read().is_ok());
    }
}
