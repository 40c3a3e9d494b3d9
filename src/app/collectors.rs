//! Scrape-time collectors of components that live above [`crate::metrics`] (which imports
//! nothing of the crate): authentication, authorization and tenant quotas.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::emit;

/// Authentication, authorization and tenant-quota metrics, read from their counters at scrape
/// time.
#[derive(Debug)]
pub struct AuthCollector {
    pub authn: std::sync::Arc<crate::auth::authn::Authenticator>,
    pub authz: std::sync::Arc<crate::auth::authz::Authorizer>,
    pub tenancy: std::sync::Arc<crate::tenancy::Tenancy>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AuthnLabels {
    method: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabels {
    tenant: String,
    quota: String,
}

impl prometheus_client::collector::Collector for AuthCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use std::sync::atomic::Ordering::Relaxed;
        let authn = Family::<AuthnLabels, Counter>::default();
        let a = &self.authn.stats;
        for (i, m) in crate::auth::authn::METHODS.iter().enumerate() {
            authn
                .get_or_create(&AuthnLabels {
                    method: m.as_str().into(),
                    result: "success".into(),
                })
                .inc_by(a.ok[i].load(Relaxed));
        }
        // Refusals by the method that refused (`none`: no usable credentials); only
        // TokenReview can be unavailable.
        let refusers = crate::auth::authn::METHODS
            .iter()
            .map(|m| m.as_str())
            .chain([crate::auth::authn::NO_METHOD.1]);
        for (i, method) in refusers.enumerate() {
            authn
                .get_or_create(&AuthnLabels {
                    method: method.into(),
                    result: "unauthorized".into(),
                })
                .inc_by(a.unauthorized[i].load(Relaxed));
        }
        authn
            .get_or_create(&AuthnLabels {
                method: crate::auth::authn::AuthnMethod::TokenReview.as_str().into(),
                result: "unavailable".into(),
            })
            .inc_by(a.unavailable.load(Relaxed));
        emit(
            &mut enc,
            "kube_cache_proxy_authentications",
            "Authentications of cache-served requests by method and result",
            &authn,
        )?;
        let authn_cache = Family::<ResultLabels, Counter>::default();
        authn_cache
            .get_or_create(&ResultLabels {
                result: "hit".into(),
            })
            .inc_by(a.cache_hits.load(Relaxed));
        emit(
            &mut enc,
            "kube_cache_proxy_authentication_cache",
            "Token authentications answered from the proxy's token cache",
            &authn_cache,
        )?;
        let jwks = Family::<ResultLabels, Counter>::default();
        let (fetches, failures) = (
            a.jwks_fetches.load(Relaxed),
            a.jwks_fetch_failures.load(Relaxed),
        );
        for (result, n) in [
            ("success", fetches.saturating_sub(failures)),
            ("failure", failures),
        ] {
            jwks.get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc_by(n);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_jwks_fetches",
            "Fetches of the ServiceAccount issuer's discovery document and JWKS (a failure keeps the previous keys)",
            &jwks,
        )?;

        let z = &self.authz.stats;
        let decisions = Family::<ResultLabels, Counter>::default();
        for (result, n) in [
            ("allowed", z.allowed.load(Relaxed)),
            ("denied", z.denied.load(Relaxed)),
            ("error", z.errors.load(Relaxed)),
        ] {
            decisions
                .get_or_create(&ResultLabels {
                    result: result.into(),
                })
                .inc_by(n);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_authorization_decisions",
            "Authorization decisions on cache-served requests (errors fail closed)",
            &decisions,
        )?;
        let lookups = Family::<ResultLabels, Counter>::default();
        for (result, n) in [
            ("hit", z.cache_hits.load(Relaxed)),
            ("miss", z.cache_misses.load(Relaxed)),
        ] {
            lookups
                .get_or_create(&ResultLabels {
                    result: result.into(),
                })
                .inc_by(n);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_authorization_cache_lookups",
            "Authorization decision cache lookups (hit ratio = hit / (hit + miss))",
            &lookups,
        )?;
        for (name, help, n) in [
            (
                "kube_cache_proxy_authentication_stale_verdicts",
                "Token authentications served from a verdict past its TTL because the apiserver was unreachable (authentication.staleWhileUnreachable; also counted as successes)",
                a.stale.load(Relaxed),
            ),
            (
                "kube_cache_proxy_authorization_stale_decisions",
                "Allowed decisions served past their TTL because the apiserver was unreachable (authentication.staleWhileUnreachable; also counted as allowed)",
                z.stale.load(Relaxed),
            ),
        ] {
            let c = Counter::<u64>::default();
            c.inc_by(n);
            emit(&mut enc, name, help, &c)?;
        }
        use crate::auth::authz::{IdentityKind, RESULTS, Source};
        let sources = Family::<SourceLabels, Counter>::default();
        for source in Source::ALL {
            for (i, result) in RESULTS.iter().enumerate() {
                let n = z.by_source[source as usize][i].load(Relaxed);
                // Local decisions only allow: their other cells stay absent, not zero.
                if matches!(source, Source::LocalRbac | Source::LocalNode) && i > 0 {
                    continue;
                }
                sources
                    .get_or_create(&SourceLabels {
                        source: source.as_str().into(),
                        result: (*result).into(),
                    })
                    .inc_by(n);
            }
        }
        emit(
            &mut enc,
            "kube_cache_proxy_authorization_decisions_by_source",
            "Authorization decisions on cache-served requests by where they came from: local_rbac (RBAC evaluated in the proxy; allows only), local_node (the Node authorizer's graph walked in the proxy for kubelets; allows only), review_cache (a SubjectAccessReview's cached or shared answer), review (a SubjectAccessReview sent for it)",
            &sources,
        )?;
        let reviews = Family::<KindLabels, Counter>::default();
        for kind in IdentityKind::ALL {
            reviews
                .get_or_create(&KindLabels {
                    kind: kind.as_str().into(),
                })
                .inc_by(z.reviews_by_kind[kind as usize].load(Relaxed));
        }
        emit(
            &mut enc,
            "kube_cache_proxy_authorization_reviews_sent",
            "SubjectAccessReviews sent to the apiserver, by the kind of identity asked about (node, serviceaccount, anonymous, user; the local RBAC probe counts as user)",
            &reviews,
        )?;
        let mode = Family::<ModeLabels, prometheus_client::metrics::gauge::Gauge>::default();
        let current = self.authz.local_rbac().map_or("off", |l| l.mode());
        for m in ["off", "pending", "active", "refused"] {
            mode.get_or_create(&ModeLabels { mode: m.into() })
                .set(i64::from(m == current));
        }
        emit(
            &mut enc,
            "kube_cache_proxy_authorization_local_rbac_mode",
            "1 for local RBAC's current mode: off (authorization.localRbac or no RBAC caches), pending (not confirmed yet), active, refused (the apiserver denied what its RBAC objects allow)",
            &mode,
        )?;
        let invalidations = Counter::<u64>::default();
        invalidations.inc_by(z.rbac_invalidations.load(Relaxed));
        emit(
            &mut enc,
            "kube_cache_proxy_authorization_rbac_invalidations",
            "Times cached authorization decisions were voided because RBAC objects changed (per scope: the cluster or one namespace; each change counts twice, at once and once settled)",
            &invalidations,
        )?;

        let quota = Family::<QuotaLabels, Counter>::default();
        for t in self.tenancy.tenants() {
            let r = &t.rejections;
            for (q, n) in [
                ("watches", r.watches.load(Relaxed)),
                ("rate", r.rate.load(Relaxed)),
                ("list_size", r.list_size.load(Relaxed)),
            ] {
                quota
                    .get_or_create(&QuotaLabels {
                        tenant: t.config.name.clone(),
                        quota: q.into(),
                    })
                    .inc_by(n);
            }
        }
        emit(
            &mut enc,
            "kube_cache_proxy_quota_rejections",
            "Requests (cache-served, and passthrough lists/watches of identified callers) refused with 429 by tenant quota",
            &quota,
        )
    }
}

/// The apiserver's reachability as the caches see it: how long it has been unreachable, and
/// whether the proxy is serving degraded (unreachable, within `cache.maxStaleness`).
#[derive(Debug)]
pub struct UpstreamCollector {
    pub upstream: crate::upstream::Upstream,
    pub max_staleness: std::time::Duration,
}

impl prometheus_client::collector::Collector for UpstreamCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use prometheus_client::metrics::gauge::Gauge;
        let outage = self.upstream.reachability().outage();
        let unreachable = outage.as_ref().map(|o| o.duration());
        let seconds = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        seconds.set(unreachable.map_or(0.0, |d| d.as_secs_f64()));
        emit(
            &mut enc,
            "kube_cache_proxy_upstream_unreachable_seconds",
            "How long the apiserver has been unreachable (no answer to the proxy's requests), 0 while reachable: the age of what the caches serve",
            &seconds,
        )?;
        let degraded = Gauge::<i64>::default();
        degraded.set(i64::from(
            unreachable.is_some_and(|d| d <= self.max_staleness),
        ));
        emit(
            &mut enc,
            "kube_cache_proxy_degraded",
            "1 while the apiserver is unreachable and the proxy stays ready serving from its caches (for up to cache.maxStaleness), else 0",
            &degraded,
        )
    }
}

/// Backfills of cache histories from the apiserver (`cache.backfill`).
#[derive(Debug)]
pub struct BackfillCollector(pub std::sync::Arc<crate::cache::reflector::backfill::BackfillStats>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: String,
}

impl prometheus_client::collector::Collector for BackfillCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.0;
        let outcomes = Family::<OutcomeLabels, Counter>::default();
        for (name, c) in [
            ("filled", &s.filled),
            ("gone", &s.gone),
            ("failed", &s.failed),
            ("unavailable", &s.unavailable),
            ("difference", &s.differences),
        ] {
            outcomes
                .get_or_create(&OutcomeLabels {
                    outcome: name.into(),
                })
                .inc_by(c.load(Relaxed));
        }
        emit(
            &mut enc,
            "kube_cache_proxy_backfills",
            "Watches older than a cache's history: filled (the history was extended back with \
             the apiserver's events), difference (with the difference from an Exact list: the \
             apiserver's watch no longer had the events), gone (410: compacted), unavailable (the \
             apiserver could not serve it now, or the resource's backfill budget was spent: \
             the client was told to retry, 429), failed (410)",
            &outcomes,
        )?;
        let events = Counter::<u64>::default();
        events.inc_by(s.events.load(Relaxed));
        emit(
            &mut enc,
            "kube_cache_proxy_backfill_events",
            "Events added to cache histories by backfills",
            &events,
        )
    }
}
