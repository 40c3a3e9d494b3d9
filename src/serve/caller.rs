//! The caller of one request, authenticated at most once and carried with the request: the
//! impersonation gate, the cache path and the passthrough quota all read the same result, so
//! no request costs two token reviews or two JWT verifications.

use std::sync::Arc;

use http::HeaderMap;

use crate::auth::authn::{Identity, Outcome};
use crate::serve::state::{ConnInfo, State};

/// One request's caller: its memoized authentication, and what its tenant was charged.
#[derive(Default)]
pub struct Caller {
    /// `None` until a step needs it.
    outcome: Option<Outcome>,
    /// The cache path took a read-quota token before handing the request to the apiserver
    /// (the passthrough then charges none).
    pub read_charged: bool,
    /// Who [`Self::identify`] found without asking the apiserver (a passthrough request).
    identified: Option<Arc<Identity>>,
}

impl Caller {
    /// Authenticates the caller (client certificate, token file, ServiceAccount JWT,
    /// TokenReview), the first time any step asks.
    pub async fn authenticate(
        &mut self,
        state: &State,
        conn: &ConnInfo,
        headers: &HeaderMap,
    ) -> &Outcome {
        if self.outcome.is_none() {
            let o = crate::telemetry::in_span(
                "authenticate",
                state.authn.authenticate(conn.cert.as_deref(), headers),
            )
            .await;
            self.outcome = Some(o);
        }
        self.outcome.get_or_insert(Outcome::Unauthorized)
    }

    /// The identity an earlier step authenticated, if any (the access log's user).
    pub fn authenticated(&self) -> Option<&Identity> {
        match &self.outcome {
            Some(Outcome::Authenticated(id, _)) => Some(id),
            _ => None,
        }
    }

    /// Who the caller is, to charge its tenant on a passthrough request and to name it in
    /// its access-log line: the identity an earlier step authenticated, else what the proxy
    /// can verify without asking the apiserver (the apiserver authenticates a passthrough
    /// request itself; this only names the caller). `None`: not identified. Remembered: a
    /// second call costs nothing.
    pub async fn identify(
        &mut self,
        state: &State,
        conn: &ConnInfo,
        headers: &HeaderMap,
    ) -> Option<Arc<Identity>> {
        if let Some(Outcome::Authenticated(id, _)) = &self.outcome {
            return Some(id.clone());
        }
        if self.identified.is_none() {
            self.identified = state
                .authn
                .identify_offline(conn.cert.as_deref(), headers)
                .await;
        }
        self.identified.clone()
    }

    /// The access log's user: the identity an earlier step authenticated, else the one
    /// [`Self::identify`] found, unless the apiserver refused the credentials (`upstream_401`:
    /// a revoked token the proxy's offline check still accepts is not named).
    pub fn known(&self, upstream_401: bool) -> Option<&Identity> {
        self.authenticated()
            .or_else(|| self.identified.as_deref().filter(|_| !upstream_401))
    }
}
