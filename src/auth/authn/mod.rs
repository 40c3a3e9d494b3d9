//! Authentication of callers of cache-served requests: who is asking, verified by the proxy.
//!
//! Passthrough requests are authenticated by the apiserver as they reach it. A request the
//! proxy answers from memory needs a verified identity first. The chain, first method that
//! applies wins (kube-apiserver's authenticator union has the same order):
//! 1. a client certificate rustls verified against `tls.clientCaFile`: CN = user, O = groups;
//! 2. a bearer token of the static token file (`--token-auth-file` CSV);
//! 3. a ServiceAccount JWT of the apiserver's issuer, verified offline against its OIDC
//!    discovery document and JWKS: issuer, audience, `exp`/`nbf` with an explicit leeway, the
//!    signature with the algorithm of the key named by `kid` (pinned: `none` and HMAC never
//!    verify). Unknown `kid`s refetch the JWKS (rate-limited); it is also refetched
//!    periodically. Configurably, tokens naming a pod/secret/node (or all) are also checked by
//!    TokenReview, which sees revocation (a deleted pod or ServiceAccount);
//! 4. any other token: a TokenReview with the proxy's credentials;
//! 5. no credentials: 401, unless anonymous access is enabled.
//!
//! Results are cached by SHA-256 of the token (never the token itself): successes for
//! `cacheTtl` and never past the token's `exp`, failures for `failureCacheTtl`. Concurrent
//! requests with the same token share one verification (single flight, moka's
//! `try_get_with`): a thousand watchers starting at once cost one TokenReview. An apiserver
//! that cannot answer a TokenReview is not a failure of the caller: it is not cached (the
//! waiters of that one flight share it) and the request fails closed with 503. While the
//! apiserver is unreachable (no answer at all, [`crate::upstream::reachability`]), no
//! TokenReview is sent, and a success verified before for the same token is served stale for
//! `staleWhileUnreachable` past its TTL (never past the token's `exp`, never when the
//! ServiceAccount lookup doubts it; a refusal of the token since removes it).
//!
//! Failures are counted by the method that refused the credential (`none` for a request
//! without usable credentials). The JWKS is refreshed in the background every
//! `jwksRefreshInterval` ([`Authenticator::spawn_jwks_refresher`]); a failed fetch keeps the
//! previous keys and is counted and logged.
//!
//! [`Authenticator::identify_offline`] names the caller of a passthrough request for tenant
//! quotas without any upstream request: certificates, the token file, a cached result of
//! this chain, or an offline-verified ServiceAccount JWT (no revocation check: the apiserver
//! authenticates the request itself; the identity only picks the tenant to charge).
//!
//! Which tenant an identity belongs to is not authentication's business: the chain is given
//! a [`TenantOf`] (tenancy's mapping) and stamps its answer on every identity it establishes.
//!
//! The pieces, one file each: [`Identity`] and [`TenantOf`] (`identity`), methods and
//! counters (`stats`), the static token file (`token_file`), key sets and offline JWT
//! verification (`jwt`), fetching the issuer's keys (`jwks`), TokenReview (`review`), the
//! `Authorization` header (`bearer`), the verdict cache (`verdict`) and the chain itself
//! (`chain`).

mod bearer;
mod chain;
mod identity;
mod jwks;
mod jwt;
pub mod liveness;
mod review;
mod stats;
#[cfg(test)]
mod testkit;
mod token_file;
mod verdict;

pub use chain::{Authenticator, AuthnError, Outcome};
pub use identity::{Identity, TenantOf};
pub use jwks::JwksError;
pub use jwt::{JwtError, KeySet, KeySetError, VerifiedJwt, verify_jwt};
pub use review::ReviewError;
pub use stats::{AuthnMethod, AuthnStats, METHODS, NO_METHOD};
pub use token_file::{CsvError, TokenFileError, TokenFileRow, parse_token_file};
