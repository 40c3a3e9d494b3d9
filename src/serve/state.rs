//! What every request handler shares: the components built by the composition root
//! ([`crate::app::start`]), and what the listener knows about a connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::Request;

use crate::auth::identity::CertIdentity;
use crate::config::Config;
use crate::http::body;
use crate::metrics::Metrics;
use crate::serve::health::{CheckResult, Health, Unready, UpstreamNotReady};
use crate::upstream::{As, Upstream};

/// What the listener knows about the connection a request arrived on.
#[derive(Debug, Clone, Default)]
pub struct ConnInfo {
    pub peer: Option<SocketAddr>,
    /// The verified client certificate's identity (TLS listener with a client CA only).
    pub cert: Option<Arc<CertIdentity>>,
}

/// Everything a request handler needs, shared by all connections.
#[derive(Debug)]
pub struct State {
    pub config: Config,
    pub upstream: Upstream,
    pub metrics: Metrics,
    pub health: Health,
    /// Cached resources (filled in the background as they are discovered and synced).
    pub caches: Arc<crate::cache::registry::Caches>,
    pub authn: Arc<crate::auth::authn::Authenticator>,
    pub authz: Arc<crate::auth::authz::Authorizer>,
    pub tenancy: Arc<crate::tenancy::Tenancy>,
    pub watch: crate::read::watch::WatchConfig,
    pub lists: crate::read::list::ListConfig,
    /// Continue-token keys.
    pub keys: Arc<crate::read::token::Keys>,
    pub consistency: Arc<crate::read::consistency::Consistency>,
    /// The adaptive page-size controller.
    pub paging: Arc<crate::paging::Paging>,
    /// Cancelled when draining starts: long-running responses end cleanly.
    pub drain: crate::http::drain::Drain,
    /// Bytes produced for clients and not yet taken by their sockets, over all connections
    /// of both listeners (`server.downstreamBufferBytes`).
    pub downstream: Arc<crate::http::budget::Downstream>,
}

impl State {
    /// Readiness checks of the cached resources: `cache:<resource>`, failing until synced.
    /// Readiness per cached resource. Built-in resources gate readiness until their first
    /// sync (a new replica must not take traffic before it caches anything); custom
    /// resources never do (a CRD with a broken conversion webhook, or deleted, must not take
    /// every replica out of service): they are listed with their state and pass through
    /// until synced.
    pub fn cache_checks(&self) -> Vec<(String, CheckResult)> {
        let gate = |custom: bool, why: Unready| {
            if custom {
                Ok(Some(format!("{why}; requests pass through")))
            } else {
                Err(why)
            }
        };
        self.caches
            .entries()
            .iter()
            .map(|e| {
                let c = &e.cache;
                let r = match c.readiness() {
                    // Warm start: not ready until the resumed watch has caught the saved
                    // state up (about half a second), so the first clients are served, and
                    // authorized locally, from the apiserver's latest state; bounded, so an
                    // unreachable apiserver leaves the saved state serving.
                    crate::cache::Readiness::Ready
                        if c.restored_unconfirmed(crate::cache::store::WARM_CONFIRM) =>
                    {
                        gate(
                            c.resource.custom,
                            Unready::NotSynced(c.unhealthy().unwrap_or_default()),
                        )
                    }
                    crate::cache::Readiness::Ready => Ok(None),
                    crate::cache::Readiness::Pending => gate(
                        c.resource.custom,
                        Unready::NotSynced(c.unhealthy().unwrap_or_default()),
                    ),
                    crate::cache::Readiness::Stopped => gate(c.resource.custom, Unready::Stopped),
                };
                (format!("cache:{}", c.resource.label()), r)
            })
            // A configured resource not discovered yet has no cache to sync: not ready either,
            // or a new replica would report ready before it caches anything (custom resources
            // excepted, as above: their CRD may not exist yet or may have been deleted).
            .chain(self.caches.missing.iter().map(|m| {
                let custom = crate::cache::discovery::is_custom_name(m.key());
                (
                    format!("cache:{}", m.key()),
                    gate(custom, Unready::NotDiscovered(m.value().clone())),
                )
            }))
            .collect()
    }

    /// The `upstream` readiness check: while the apiserver is unreachable, degraded (passing,
    /// with a note) for `cache.maxStaleness`, then failing; otherwise the last probe's result.
    pub fn upstream_check(&self) -> CheckResult {
        match self.upstream.reachability().outage() {
            Some(o) => {
                let (unreachable, max) = (o.duration(), self.config.cache.max_staleness);
                if unreachable <= max {
                    Ok(Some(format!(
                        "degraded: the apiserver has been unreachable for {}s (cache.maxStaleness {}s)",
                        unreachable.as_secs(),
                        max.as_secs()
                    )))
                } else {
                    Err(Unready::TooStale {
                        unreachable,
                        max,
                        cause: o.cause,
                    })
                }
            }
            None => self.health.upstream.get().map(|()| None),
        }
    }

    /// Probes the upstream's `/readyz` with the proxy's own identity until draining starts.
    pub fn spawn_upstream_probe(self: &Arc<Self>) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(this.config.upstream.health_check_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = this.drain.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let r = this.probe_upstream().await;
                if let Err(e) = &r {
                    tracing::warn!(error = %e, "upstream apiserver is not ready");
                }
                this.metrics.upstream_up.set(i64::from(r.is_ok()));
                let reachability = this.upstream.reachability();
                let answered = !matches!(
                    r,
                    Err(UpstreamNotReady::TimedOut(_) | UpstreamNotReady::Send(_))
                );
                if !answered && let Err(e) = &r {
                    // No answer: an outage (the first report starts it).
                    reachability.unreachable(e);
                }
                // The check first, then the end of the outage: readiness never sees the old
                // failure without the outage that keeps it degraded.
                this.health.upstream.set(r.map_err(Unready::from));
                if answered {
                    // An answer, even "not ready": reachable (only this probe ends an
                    // outage, see `upstream::reachability`).
                    reachability.reachable();
                }
            }
        });
    }

    async fn probe_upstream(&self) -> Result<(), UpstreamNotReady> {
        let mut req = Request::new(body::empty());
        *req.uri_mut() = self.upstream.uri("/readyz");
        let timeout = self
            .config
            .upstream
            .health_check_interval
            .max(Duration::from_secs(2));
        match tokio::time::timeout(timeout, self.upstream.send(req, As::Proxy, false)).await {
            Err(_) => Err(UpstreamNotReady::TimedOut(timeout)),
            Ok(Err(e)) => Err(UpstreamNotReady::Send(e)),
            Ok(Ok(r)) if r.status().is_success() => Ok(()),
            Ok(Ok(r)) => Err(UpstreamNotReady::Status(r.status())),
        }
    }
}
