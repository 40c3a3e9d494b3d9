//! The authentication chain ([`Authenticator`]): certificates, the token file, offline
//! ServiceAccount JWTs, TokenReview, anonymous (see the folder's docs for the order and the
//! caching), its verdict cache and single flight, and offline identification of passthrough
//! callers.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use http::HeaderMap;
use sha2::{Digest, Sha256};

use super::bearer::{Bearer, bearer};
use super::identity::{Identity, TenantOf};
use super::jwks::{Jwks, Why};
use super::jwt::{JwtError, unverified_issuer, verify_jwt};
use super::liveness::{self, Live};
use super::review::{ReviewError, token_review};
use super::stats::{AuthnMethod, AuthnStats, METHODS, method_slot};
use super::token_file::{TokenFileError, TokenFileRow, parse_token_file};
use super::verdict::{Cached, REVIEW_VOUCHES, Verdicts, verdicts};
use crate::auth::identity::CertIdentity;
use crate::cache::registry::Caches;
use crate::config::{AuthenticationConfig, RevocationCheck};
use crate::upstream::Upstream;

/// One token through the chain.
struct Verification {
    outcome: Outcome,
    /// The token's `exp`, bounding its cache entry.
    until: Option<u64>,
    /// For a refusal, the method that refused it (the last one that could judge the token).
    refused_by: Option<AuthnMethod>,
    /// A TokenReview decided (or confirmed) it.
    reviewed: bool,
    /// The Secret an offline-verified token is bound to (name, uid).
    secret: Option<Arc<(String, String)>>,
    /// For [`Outcome::Unavailable`]: the apiserver gave no answer at all (see
    /// [`ReviewError::is_unreachable`]).
    unreachable: bool,
}

/// Why a token could not be judged (shared by the waiters of one flight).
#[derive(Debug)]
struct Unavailable {
    message: String,
    /// The apiserver gave no answer: a verdict it gave before may be served stale.
    unreachable: bool,
}

/// The result of authenticating one request.
#[derive(Debug, Clone)]
pub enum Outcome {
    Authenticated(Arc<Identity>, AuthnMethod),
    /// 401: no credentials (anonymous disabled) or credentials that do not verify.
    Unauthorized,
    /// The apiserver could not answer a TokenReview: 503, not the caller's fault.
    Unavailable(String),
}

fn sha256(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

/// The authentication chain (see the module docs).
pub struct Authenticator {
    cfg: AuthenticationConfig,
    upstream: Upstream,
    /// Names each established identity's tenant (tenancy's mapping, injected).
    tenants: Box<dyn TenantOf>,
    static_tokens: HashMap<[u8; 32], TokenFileRow>,
    /// The issuer's keys for offline ServiceAccount JWT verification.
    jwks: Jwks,
    /// Verdicts by token hash; also the single flight of concurrent identical tokens.
    verdicts: Verdicts,
    /// Offline-only JWT verdicts for [`Authenticator::identify_offline`] (no revocation check,
    /// so never mixed with `verdicts`); a signature check costs ~0.3 ms.
    offline: Verdicts,
    /// Successful verdicts kept `staleWhileUnreachable` past `cacheTtl` (never past the
    /// token's `exp`), served only while the apiserver cannot be reached and only for the
    /// token they were given for; a refusal of the token removes its entry. `None`: off.
    stale: Option<Verdicts>,
    /// Bounds each TokenReview (and each JWKS fetch).
    timeout: Duration,
    /// The caches the ServiceAccount lookup reads (`serviceAccountLookup`; see `liveness`).
    caches: Option<Arc<Caches>>,
    pub stats: AuthnStats,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Authenticator")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuthnError {
    #[error("reading the token file {path}: {source}")]
    ReadTokenFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("token file {path}: {source}")]
    TokenFile {
        path: std::path::PathBuf,
        #[source]
        source: TokenFileError,
    },
}

impl Authenticator {
    /// The chain of `cfg`, asking `upstream` (TokenReview, the issuer's keys) with the
    /// proxy's credentials; `tenants` names the tenant of every identity it establishes.
    pub fn new(
        cfg: AuthenticationConfig,
        tenants: impl TenantOf + 'static,
        upstream: Upstream,
    ) -> Result<Authenticator, AuthnError> {
        let mut static_tokens = HashMap::new();
        if let Some(path) = &cfg.token_auth_file {
            let text =
                std::fs::read_to_string(path).map_err(|source| AuthnError::ReadTokenFile {
                    path: path.clone(),
                    source,
                })?;
            let rows = parse_token_file(&text).map_err(|source| AuthnError::TokenFile {
                path: path.clone(),
                source,
            })?;
            for mut row in rows {
                // Only the hash of a token is kept.
                let key = sha256(std::mem::take(&mut row.token).as_bytes());
                static_tokens.insert(key, row);
            }
        }
        let timeout = Duration::from_secs(5);
        Ok(Authenticator {
            verdicts: verdicts(cfg.cache_ttl, cfg.failure_cache_ttl),
            offline: verdicts(cfg.cache_ttl, cfg.failure_cache_ttl),
            stale: (!cfg.stale_while_unreachable.is_zero()).then(|| {
                verdicts(
                    cfg.cache_ttl.saturating_add(cfg.stale_while_unreachable),
                    Duration::ZERO,
                )
            }),
            jwks: Jwks::new(
                upstream.clone(),
                cfg.jwks_refresh_interval,
                cfg.jwks_min_refresh_interval,
                timeout,
            ),
            cfg,
            upstream,
            tenants: Box::new(tenants),
            static_tokens,
            timeout,
            caches: None,
            stats: AuthnStats::default(),
        })
    }

    /// Looks ServiceAccount identities up in `caches` on every request (see `liveness`),
    /// when `serviceAccountLookup` is on.
    pub fn with_caches(mut self, caches: Arc<Caches>) -> Authenticator {
        if self.cfg.service_account_lookup {
            self.caches = Some(caches);
        }
        self
    }

    /// What the caches say of an identity established by `m`; only tokens are looked up
    /// (the token file and certificates name no ServiceAccount object).
    fn live(&self, id: &Identity, m: AuthnMethod, secret: Option<&(String, String)>) -> Live {
        match (&self.caches, m) {
            (Some(c), AuthnMethod::ServiceAccountJwt | AuthnMethod::TokenReview) => {
                liveness::check(c, id, secret)
            }
            _ => Live::Alive,
        }
    }

    fn count(&self, o: &Outcome, refused_by: Option<AuthnMethod>) {
        match o {
            Outcome::Authenticated(_, m) => {
                let i = METHODS.iter().position(|x| x == m).unwrap_or(0);
                self.stats.ok[i].fetch_add(1, Relaxed);
            }
            Outcome::Unauthorized => {
                self.stats.unauthorized[method_slot(refused_by)].fetch_add(1, Relaxed);
            }
            Outcome::Unavailable(_) => {
                self.stats.unavailable.fetch_add(1, Relaxed);
            }
        }
    }

    fn finish(&self, mut id: Identity, m: AuthnMethod) -> (Arc<Identity>, AuthnMethod) {
        if !id.groups.iter().any(|g| g == "system:authenticated") && m != AuthnMethod::Anonymous {
            // kube-apiserver's group adder: every authenticated user is in this group.
            id.groups.push("system:authenticated".into());
        }
        id.tenant = self.tenants.tenant_of(&id);
        (Arc::new(id), m)
    }

    /// Authenticates one request from its verified client certificate (if any) and headers.
    pub async fn authenticate(&self, cert: Option<&CertIdentity>, headers: &HeaderMap) -> Outcome {
        let (o, refused_by) = self.authenticate_inner(cert, headers).await;
        self.count(&o, refused_by);
        o
    }

    fn certificate_identity(&self, c: &CertIdentity) -> (Arc<Identity>, AuthnMethod) {
        self.finish(
            Identity {
                user: c.user.clone(),
                uid: c.uid.clone(),
                groups: c.groups.clone(),
                extra: c.extra.clone(),
                tenant: String::new(),
            },
            AuthnMethod::Certificate,
        )
    }

    /// The outcome, and for a refusal the method that refused (`None`: no credentials).
    async fn authenticate_inner(
        &self,
        cert: Option<&CertIdentity>,
        headers: &HeaderMap,
    ) -> (Outcome, Option<AuthnMethod>) {
        if let Some(c) = cert {
            let (id, m) = self.certificate_identity(c);
            return (Outcome::Authenticated(id, m), None);
        }
        let token = match bearer(headers) {
            Bearer::None => {
                if self.cfg.anonymous {
                    let (id, m) = self.finish(Identity::anonymous(), AuthnMethod::Anonymous);
                    return (Outcome::Authenticated(id, m), None);
                }
                return (Outcome::Unauthorized, None);
            }
            Bearer::Invalid => return (Outcome::Unauthorized, None),
            Bearer::Token(t) => t,
        };
        let key = sha256(token.as_bytes());
        // During an outage a token verified before is not reviewed again: its stale verdict
        // serves. A token never verified is reviewed, as the apiserver may be back before
        // the next probe says so (if it is not, the review fails and the caller gets 503).
        if self.upstream.reachability().is_unreachable()
            && self.verdicts.get(&key).await.is_none()
            && let Some((id, m)) = self.stale_verdict(&key).await
        {
            self.stats.stale.fetch_add(1, Relaxed);
            tracing::debug!(user = %id.user, "apiserver unreachable; verdict served stale");
            return (Outcome::Authenticated(id, m), None);
        }
        let (mut r, led) =
            crate::auth::ask_in_flight(|| self.verdict(key, token), |e| !e.unreachable).await;
        if !led {
            self.stats.cache_hits.fetch_add(1, Relaxed);
            // A remembered verdict stands only while what it stands on exists: an account
            // deleted or re-created since (or a bound pod gone) sends the token through the
            // chain again, where TokenReview decides.
            if let Ok(Cached {
                outcome: Ok((id, m)),
                reviewed,
                secret,
                ..
            }) = &r
                && let Live::Doubt(what) = self.live(id, *m, secret.as_deref())
                && reviewed.is_none_or(|t| t.elapsed() > REVIEW_VOUCHES)
            {
                tracing::debug!(user = %id.user, missing = what, "cached verdict in doubt; verifying again");
                self.verdicts.invalidate(&key).await;
                r = self.verdict(key, token).await.0;
            }
        }
        match r {
            // Never served past the token's `exp`: the entry's TTL ends there ([`VerdictTtl`]).
            Ok(Cached {
                outcome: Ok((id, m)),
                ..
            }) => (Outcome::Authenticated(id, m), None),
            Ok(Cached {
                outcome: Err(m), ..
            }) => (Outcome::Unauthorized, m),
            Err(e) => {
                if e.unreachable
                    && let Some((id, m)) = self.stale_verdict(&key).await
                {
                    self.stats.stale.fetch_add(1, Relaxed);
                    tracing::debug!(user = %id.user, "apiserver unreachable; verdict served stale");
                    return (Outcome::Authenticated(id, m), None);
                }
                (
                    Outcome::Unavailable(e.message.clone()),
                    Some(AuthnMethod::TokenReview),
                )
            }
        }
    }

    /// A success remembered for the token `key` beyond its TTL (`staleWhileUnreachable`),
    /// unless the proxy's copy of the ServiceAccounts doubts it (an account deleted or
    /// re-created since the verdict: a revocation the proxy did see).
    async fn stale_verdict(&self, key: &[u8; 32]) -> Option<(Arc<Identity>, AuthnMethod)> {
        let c = self.stale.as_ref()?.get(key).await?;
        let Ok((id, m)) = c.outcome else {
            return None;
        };
        if let Live::Doubt(what) = self.live(&id, m, c.secret.as_deref()) {
            tracing::debug!(user = %id.user, missing = what, "stale verdict in doubt; not served");
            return None;
        }
        Some((id, m))
    }

    /// The caller of a passthrough request, for tenant quotas, without asking the apiserver
    /// anything: a verified client certificate, a cached verdict of the chain, the token file,
    /// or a ServiceAccount JWT verified offline with the keys at hand (no revocation check:
    /// the apiserver authenticates the request itself and the identity only names the tenant
    /// to charge; results cached apart, for `cacheTtl` / `failureCacheTtl`). `None`: not identified (no credentials, or a token only
    /// the apiserver can judge).
    pub async fn identify_offline(
        &self,
        cert: Option<&CertIdentity>,
        headers: &HeaderMap,
    ) -> Option<Arc<Identity>> {
        if let Some(c) = cert {
            return Some(self.certificate_identity(c).0);
        }
        let Bearer::Token(token) = bearer(headers) else {
            return None;
        };
        let key = sha256(token.as_bytes());
        if let Some(c) = self.verdicts.get(&key).await {
            return c.outcome.ok().map(|(id, _)| id);
        }
        if let Some(u) = self.static_tokens.get(&key) {
            return Some(self.static_identity(u).0);
        }
        if !self.cfg.service_account_jwt || token.bytes().filter(|b| *b == b'.').count() != 2 {
            return None;
        }
        let keys = self.jwks.current()?;
        let c = self
            .offline
            .get_with(key, async {
                match verify_jwt(token, &keys, &self.cfg.audiences, self.cfg.leeway) {
                    Ok(v) => Cached {
                        outcome: Ok(self.finish(v.identity, AuthnMethod::ServiceAccountJwt)),
                        until: v.exp,
                        reviewed: None,
                        secret: None,
                    },
                    Err(_) => Cached {
                        outcome: Err(Some(AuthnMethod::ServiceAccountJwt)),
                        until: None,
                        reviewed: None,
                        secret: None,
                    },
                }
            })
            .await;
        c.outcome.ok().map(|(id, _)| id)
    }

    /// The flight leader's part of [`Self::verdict`]: the chain run on `token`, its verdict
    /// remembered for an outage (or forgotten on a refusal).
    async fn verify_and_remember(&self, key: [u8; 32], token: &str) -> Result<Cached, Unavailable> {
        let v = self.authenticate_token(token).await;
        let reviewed = v.reviewed.then(std::time::Instant::now);
        match v.outcome {
            Outcome::Authenticated(id, m) => {
                let c = Cached {
                    outcome: Ok((id, m)),
                    until: v.until,
                    reviewed,
                    secret: v.secret,
                };
                if let Some(stale) = &self.stale {
                    stale.insert(key, c.clone()).await;
                }
                Ok(c)
            }
            Outcome::Unauthorized => {
                // A refusal voids what was remembered of the token.
                if let Some(stale) = &self.stale {
                    stale.invalidate(&key).await;
                }
                Ok(Cached {
                    outcome: Err(v.refused_by),
                    until: None,
                    reviewed,
                    secret: None,
                })
            }
            Outcome::Unavailable(message) => Err(Unavailable {
                message,
                unreachable: v.unreachable,
            }),
        }
    }

    /// The verdict on `token` (hash `key`), from the cache or by running the chain; `true`
    /// when this call ran it (the flight's leader).
    async fn verdict(
        &self,
        key: [u8; 32],
        token: &str,
    ) -> (Result<Cached, Arc<Unavailable>>, bool) {
        let led = std::sync::atomic::AtomicBool::new(false);
        let r = self
            .verdicts
            .try_get_with(key, async {
                led.store(true, Relaxed);
                // Boxed, so only the flight's leader allocates it: the chain's future (a
                // TokenReview or a JWKS fetch inside) is about 20 KB, and every request
                // waiting for the verdict would otherwise carry one.
                Box::pin(self.verify_and_remember(key, token)).await
            })
            .await;
        (r, led.load(Relaxed))
    }

    fn static_identity(&self, u: &TokenFileRow) -> (Arc<Identity>, AuthnMethod) {
        self.finish(
            Identity {
                user: u.user.clone(),
                uid: u.uid.clone(),
                groups: u.groups.clone(),
                extra: BTreeMap::new(),
                tenant: String::new(),
            },
            AuthnMethod::StaticToken,
        )
    }

    /// One token through the chain (see [`Verification`]).
    async fn authenticate_token(&self, token: &str) -> Verification {
        let done = |outcome, until, refused_by, reviewed| Verification {
            outcome,
            until,
            refused_by,
            reviewed,
            secret: None,
            unreachable: false,
        };
        if let Some(u) = self.static_tokens.get(&sha256(token.as_bytes())) {
            let (id, m) = self.static_identity(u);
            return done(Outcome::Authenticated(id, m), None, None, false);
        }
        let mut refused_by = (!self.static_tokens.is_empty()).then_some(AuthnMethod::StaticToken);
        if self.cfg.service_account_jwt
            && token.bytes().filter(|b| *b == b'.').count() == 2
            && let Some(keys) = self.jwks.key_set(&self.stats).await
        {
            refused_by = Some(AuthnMethod::ServiceAccountJwt);
            let mut r = verify_jwt(token, &keys, &self.cfg.audiences, self.cfg.leeway);
            if matches!(r, Err(JwtError::NotOurs))
                && unverified_issuer(token).as_deref() == Some(keys.issuer())
                && self.jwks.refresh(Why::UnknownKid, &self.stats).await
                && let Some(k) = self.jwks.key_set(&self.stats).await
            {
                // A key id we do not know: the apiserver may have rotated its keys.
                r = verify_jwt(token, &k, &self.cfg.audiences, self.cfg.leeway);
            }
            match r {
                Ok(v) => {
                    let review = match self.cfg.revocation_check {
                        RevocationCheck::None => false,
                        RevocationCheck::BoundObjects => v.bound,
                        RevocationCheck::Always => true,
                    } || matches!(
                        self.live(
                            &v.identity,
                            AuthnMethod::ServiceAccountJwt,
                            v.secret.as_ref()
                        ),
                        Live::Doubt(_)
                    );
                    if review {
                        match self.token_review(token).await {
                            Ok(Some(_)) => {}
                            Ok(None) => {
                                return done(
                                    Outcome::Unauthorized,
                                    None,
                                    Some(AuthnMethod::TokenReview),
                                    true,
                                );
                            }
                            Err(e) => {
                                return Verification {
                                    unreachable: e.is_unreachable(),
                                    ..done(Outcome::Unavailable(e.to_string()), None, None, false)
                                };
                            }
                        }
                    }
                    let (id, m) = self.finish(v.identity, AuthnMethod::ServiceAccountJwt);
                    return Verification {
                        secret: v.secret.map(Arc::new),
                        ..done(Outcome::Authenticated(id, m), v.exp, None, review)
                    };
                }
                Err(JwtError::Invalid(why)) => {
                    tracing::debug!(reason = %why, "serviceaccount token rejected");
                    return done(Outcome::Unauthorized, None, refused_by, false);
                }
                Err(JwtError::NotOurs) => {}
            }
        }
        if !self.cfg.token_review {
            return done(Outcome::Unauthorized, None, refused_by, false);
        }
        match self.token_review(token).await {
            Ok(Some(id)) => {
                let (id, m) = self.finish(id, AuthnMethod::TokenReview);
                done(Outcome::Authenticated(id, m), None, None, true)
            }
            Ok(None) => done(
                Outcome::Unauthorized,
                None,
                Some(AuthnMethod::TokenReview),
                true,
            ),
            Err(e) => Verification {
                unreachable: e.is_unreachable(),
                ..done(Outcome::Unavailable(e.to_string()), None, None, false)
            },
        }
    }

    /// A TokenReview of `token` (see [`token_review`]).
    async fn token_review(&self, token: &str) -> Result<Option<Identity>, ReviewError> {
        token_review(&self.upstream, self.timeout, token).await
    }

    /// Refreshes the issuer's keys every `jwksRefreshInterval` until `stop` (first at once),
    /// so rotated keys are known before the first token signed with them arrives and no
    /// request waits for a fetch. Nothing to do when offline JWT verification is off.
    pub fn spawn_jwks_refresher(self: &Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        if !self.cfg.service_account_jwt {
            return;
        }
        let this = Arc::downgrade(self);
        let period = self.cfg.jwks_refresh_interval.max(Duration::from_secs(1));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let Some(a) = this.upgrade() else { return };
                a.jwks.refresh(Why::Periodic, &a.stats).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use http::{HeaderValue, header};

    #[tokio::test]
    async fn passthrough_callers_are_identified_without_asking_the_apiserver() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens.csv");
        std::fs::write(&file, "tok-1,alice,uid-1\n").unwrap();
        let a = offline_authenticator(AuthenticationConfig {
            token_auth_file: Some(file),
            ..AuthenticationConfig::default()
        });
        let s = signer("k1");
        a.jwks.set(keys(&s));
        async fn who(
            a: &Authenticator,
            h: HeaderMap,
            cert: Option<&CertIdentity>,
        ) -> Option<String> {
            a.identify_offline(cert, &h).await.map(|i| i.user.clone())
        }
        let cert = CertIdentity {
            user: "carol".into(),
            ..Default::default()
        };
        assert_eq!(
            who(&a, headers(None), Some(&cert)).await.as_deref(),
            Some("carol")
        );
        assert_eq!(
            who(&a, headers(Some("Bearer tok-1")), None)
                .await
                .as_deref(),
            Some("alice")
        );
        let token = sign(&s, "k1", &claims(3600));
        let jwt = format!("Bearer {token}");
        assert_eq!(
            who(&a, headers(Some(&jwt)), None).await.as_deref(),
            Some("system:serviceaccount:team-a:builder")
        );
        // Remembered apart from the chain's verdicts (no revocation check was made).
        assert!(a.offline.contains_key(&sha256(token.as_bytes())));
        assert!(!a.verdicts.contains_key(&sha256(token.as_bytes())));
        // Forged, unknown to any offline method, or no credentials: not identified (the
        // apiserver alone judges them; the upstream here is never contacted).
        let forged = format!("Bearer {}", sign(&signer("k1"), "k1", &claims(3600)));
        for h in [
            headers(Some(&forged)),
            headers(Some("Bearer opaque")),
            headers(None),
        ] {
            assert_eq!(who(&a, h, None).await, None);
        }
        // A verdict of the full chain (a TokenReview, say) names the caller while cached.
        let (id, m) = a.finish(
            Identity {
                user: "reviewed".into(),
                ..Identity::anonymous()
            },
            AuthnMethod::TokenReview,
        );
        a.verdicts
            .insert(
                sha256(b"opaque"),
                Cached {
                    outcome: Ok((id, m)),
                    until: None,
                    reviewed: None,
                    secret: None,
                },
            )
            .await;
        assert_eq!(
            who(&a, headers(Some("Bearer opaque")), None)
                .await
                .as_deref(),
            Some("reviewed")
        );
        // Nothing of this counts as an authentication of a cache-served request.
        assert_eq!(a.stats.ok.iter().map(|c| c.load(Relaxed)).sum::<u64>(), 0);
    }

    #[tokio::test]
    async fn verdicts_are_cached_for_cache_ttl_and_not_at_all_with_zero() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens.csv");
        std::fs::write(&file, "tok-1,alice,uid-1\n").unwrap();
        for (ttl, hits) in [(Duration::from_secs(10), 2), (Duration::ZERO, 0)] {
            let a = offline_authenticator(AuthenticationConfig {
                token_auth_file: Some(file.clone()),
                cache_ttl: ttl,
                ..AuthenticationConfig::default()
            });
            for _ in 0..3 {
                let o = a.authenticate(None, &headers(Some("Bearer tok-1"))).await;
                assert!(matches!(o, Outcome::Authenticated(..)));
            }
            assert_eq!(a.stats.cache_hits.load(Relaxed), hits, "ttl {ttl:?}");
        }
    }

    #[tokio::test]
    async fn verdicts_are_served_stale_only_for_their_token_while_unreachable() {
        crate::http::tls::install_crypto_provider();
        // An apiserver address nothing listens on: every TokenReview is refused.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let kube = kube::Config::new(format!("http://127.0.0.1:{port}").parse().unwrap());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens.csv");
        std::fs::write(&file, "tok-1,carol,uid-3\n").unwrap();
        let authenticator = |stale| {
            let up = Upstream::new(&kube, &crate::config::UpstreamConfig::default()).unwrap();
            let cfg = AuthenticationConfig {
                token_auth_file: Some(file.clone()),
                service_account_jwt: false,
                cache_ttl: Duration::ZERO,
                stale_while_unreachable: stale,
                ..AuthenticationConfig::default()
            };
            Authenticator::new(cfg, |_: &Identity| String::new(), up).unwrap()
        };
        let a = authenticator(Duration::from_secs(300));
        // As if a TokenReview had vouched for `t1` before.
        let (id, m) = a.finish(
            Identity {
                user: "alice".into(),
                ..Identity::anonymous()
            },
            AuthnMethod::TokenReview,
        );
        let vouched = Cached {
            outcome: Ok((id, m)),
            until: None,
            reviewed: None,
            secret: None,
        };
        let stale = a.stale.as_ref().unwrap();
        stale.insert(sha256(b"t1"), vouched.clone()).await;
        let Outcome::Authenticated(id, m) = a.authenticate(None, &headers(Some("Bearer t1"))).await
        else {
            panic!("not served stale");
        };
        assert_eq!((id.user.as_str(), m), ("alice", AuthnMethod::TokenReview));
        assert_eq!(a.stats.stale.load(Relaxed), 1);
        assert!(a.upstream.reachability().is_unreachable());
        // Another token: no verdict to serve, 503.
        assert!(matches!(
            a.authenticate(None, &headers(Some("Bearer t2"))).await,
            Outcome::Unavailable(_)
        ));
        // Past the token's `exp`: gone.
        stale
            .insert(
                sha256(b"t3"),
                Cached {
                    until: Some(super::super::verdict::now_unix().saturating_sub(1)),
                    ..vouched
                },
            )
            .await;
        assert!(matches!(
            a.authenticate(None, &headers(Some("Bearer t3"))).await,
            Outcome::Unavailable(_)
        ));
        assert_eq!(a.stats.stale.load(Relaxed), 1);
        // A token the proxy verifies itself keeps verifying, nothing stale about it.
        let Outcome::Authenticated(id, m) =
            a.authenticate(None, &headers(Some("Bearer tok-1"))).await
        else {
            panic!("a token-file token refused while the apiserver is unreachable");
        };
        assert_eq!((id.user.as_str(), m), ("carol", AuthnMethod::StaticToken));
        assert_eq!(a.stats.stale.load(Relaxed), 1);
        // Off with zero.
        let off = authenticator(Duration::ZERO);
        assert!(off.stale.is_none());
        assert!(matches!(
            off.authenticate(None, &headers(Some("Bearer t1"))).await,
            Outcome::Unavailable(_)
        ));
    }

    #[tokio::test]
    async fn a_request_waiting_for_a_verdict_does_not_hold_the_chain() {
        // Requests with the same token wait in one flight while its leader runs the chain
        // (a TokenReview, a JWKS fetch); the chain's future is allocated by the leader only.
        let a = offline_authenticator(AuthenticationConfig::default());
        let h = headers(Some("Bearer t1"));
        let waiting = std::mem::size_of_val(&a.authenticate(None, &h));
        // 7,880 B with the leader's part in place (this toolchain, debug).
        assert!(waiting < 4 * 1024, "authenticate: {waiting} B");
    }

    fn offline_authenticator(cfg: AuthenticationConfig) -> Authenticator {
        crate::http::tls::install_crypto_provider();
        // Never contacted: these paths need no upstream.
        let kube = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let up = Upstream::new(&kube, &crate::config::UpstreamConfig::default()).unwrap();
        // No tenants: every identity's tenant is "".
        Authenticator::new(cfg, |_: &Identity| String::new(), up).unwrap()
    }

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[tokio::test]
    async fn the_chain_without_upstream_calls_certificates_token_file_anonymous_and_401() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens.csv");
        std::fs::write(&file, "tok-1,alice,uid-1,\"dev,ops\"\n").unwrap();
        let cfg = AuthenticationConfig {
            token_auth_file: Some(file),
            service_account_jwt: false,
            token_review: false,
            ..AuthenticationConfig::default()
        };
        let a = offline_authenticator(cfg.clone());
        let Outcome::Authenticated(id, m) =
            a.authenticate(None, &headers(Some("Bearer tok-1"))).await
        else {
            panic!("static token not accepted");
        };
        assert_eq!(m, AuthnMethod::StaticToken);
        assert_eq!((id.user.as_str(), id.uid.as_str()), ("alice", "uid-1"));
        assert_eq!(id.groups, ["dev", "ops", "system:authenticated"]);
        // A certificate wins over a token.
        let cert = CertIdentity {
            user: "carol".into(),
            groups: vec!["ops".into()],
            ..Default::default()
        };
        let Outcome::Authenticated(id, m) = a
            .authenticate(Some(&cert), &headers(Some("Bearer tok-1")))
            .await
        else {
            panic!("certificate not accepted");
        };
        assert_eq!((id.user.as_str(), m), ("carol", AuthnMethod::Certificate));
        for bad in [
            Some("Bearer nope"),
            Some("Bearer "),
            None,
            Some("Basic YTpi"),
        ] {
            assert!(
                matches!(
                    a.authenticate(None, &headers(bad)).await,
                    Outcome::Unauthorized
                ),
                "{bad:?}"
            );
        }
        let anon = offline_authenticator(AuthenticationConfig {
            anonymous: true,
            ..cfg
        });
        let Outcome::Authenticated(id, m) = anon.authenticate(None, &headers(None)).await else {
            panic!("anonymous not accepted");
        };
        assert_eq!(m, AuthnMethod::Anonymous);
        assert_eq!(id.user, "system:anonymous");
        assert_eq!(id.groups, ["system:unauthenticated"]);
        // An invalid token is not anonymous, even with anonymous enabled.
        assert!(matches!(
            anon.authenticate(None, &headers(Some("Bearer nope"))).await,
            Outcome::Unauthorized
        ));
        // Refusals by the method that refused: the token file judged `nope`; the others had
        // no usable credentials.
        assert_eq!(a.stats.unauthorized_by(Some(AuthnMethod::StaticToken)), 1);
        assert_eq!(a.stats.unauthorized_by(None), 3);
        assert_eq!(a.stats.unauthorized_by(Some(AuthnMethod::TokenReview)), 0);
    }
}
