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
//! waiters of that one flight share it) and the request fails closed with 503.
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

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderValue, Method, Request, header};
use http_body_util::BodyExt;
use jsonwebtoken::{Algorithm, DecodingKey, Validation, jwk};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::auth::identity::CertIdentity;
use crate::config::{AuthenticationConfig, RevocationCheck, TenantConfig};
use crate::http::body;
use crate::upstream::{As, Upstream};

/// A verified caller, as the apiserver's `user.Info`, plus the tenant it belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
    /// The tenant (config `tenants`); `""` when none matches.
    pub tenant: String,
}

impl Identity {
    /// `system:anonymous` in `system:unauthenticated`, as kube-apiserver's anonymous
    /// authenticator.
    pub fn anonymous() -> Identity {
        Identity {
            user: "system:anonymous".into(),
            uid: String::new(),
            groups: vec!["system:unauthenticated".into()],
            extra: BTreeMap::new(),
            tenant: String::new(),
        }
    }

    /// SHA-256 over a canonical, length-prefixed encoding of user, uid, sorted groups and
    /// sorted extra (not the tenant). Equal identities hash equal whatever the order their
    /// groups and extra values came in; no two different identities share an encoding.
    pub fn identity_hash(&self) -> [u8; 32] {
        fn put(h: &mut Sha256, s: &str) {
            h.update((s.len() as u64).to_be_bytes());
            h.update(s.as_bytes());
        }
        let mut h = Sha256::new();
        h.update(b"kcp-identity-v1");
        put(&mut h, &self.user);
        put(&mut h, &self.uid);
        let mut groups: Vec<&str> = self.groups.iter().map(String::as_str).collect();
        groups.sort_unstable();
        h.update((groups.len() as u64).to_be_bytes());
        for g in groups {
            put(&mut h, g);
        }
        h.update((self.extra.len() as u64).to_be_bytes());
        for (k, vs) in &self.extra {
            put(&mut h, k);
            let mut vs: Vec<&str> = vs.iter().map(String::as_str).collect();
            vs.sort_unstable();
            h.update((vs.len() as u64).to_be_bytes());
            for v in vs {
                put(&mut h, v);
            }
        }
        h.finalize().into()
    }

    /// The namespace of a ServiceAccount user (`system:serviceaccount:<ns>:<name>`).
    pub fn service_account_namespace(&self) -> Option<&str> {
        let rest = self.user.strip_prefix("system:serviceaccount:")?;
        let (ns, name) = rest.split_once(':')?;
        (!ns.is_empty() && !name.is_empty()).then_some(ns)
    }
}

/// How an identity was established (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthnMethod {
    Certificate,
    StaticToken,
    ServiceAccountJwt,
    TokenReview,
    Anonymous,
}

impl AuthnMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            AuthnMethod::Certificate => "x509",
            AuthnMethod::StaticToken => "token_file",
            AuthnMethod::ServiceAccountJwt => "serviceaccount_jwt",
            AuthnMethod::TokenReview => "token_review",
            AuthnMethod::Anonymous => "anonymous",
        }
    }
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

/// Counters for the metrics layer, by method and result.
#[derive(Debug, Default)]
pub struct AuthnStats {
    /// Successes by [`METHODS`] index.
    pub ok: [AtomicU64; 5],
    /// Refusals (401) by the method that refused: [`METHODS`] index, or the last slot
    /// ([`NO_METHOD`]) when no method applied (no or malformed credentials).
    pub unauthorized: [AtomicU64; 6],
    /// TokenReviews the apiserver could not answer (503).
    pub unavailable: AtomicU64,
    pub cache_hits: AtomicU64,
    pub jwks_fetches: AtomicU64,
    pub jwks_fetch_failures: AtomicU64,
}

/// The `unauthorized` slot and label of a refusal no method was responsible for.
pub const NO_METHOD: (usize, &str) = (5, "none");

impl AuthnStats {
    /// Refusals attributed to `m` (`None`: no credentials to judge).
    pub fn unauthorized_by(&self, m: Option<AuthnMethod>) -> u64 {
        self.unauthorized[method_slot(m)].load(Relaxed)
    }
}

fn method_slot(m: Option<AuthnMethod>) -> usize {
    m.and_then(|m| METHODS.iter().position(|x| *x == m))
        .unwrap_or(NO_METHOD.0)
}

pub const METHODS: [AuthnMethod; 5] = [
    AuthnMethod::Certificate,
    AuthnMethod::StaticToken,
    AuthnMethod::ServiceAccountJwt,
    AuthnMethod::TokenReview,
    AuthnMethod::Anonymous,
];

/// One row of the static token file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenFileRow {
    pub token: String,
    pub user: String,
    pub uid: String,
    pub groups: Vec<String>,
}

/// Parses kube-apiserver's `--token-auth-file` CSV: `token,user,uid[,"group1,group2"]`
/// (further columns ignored, as the apiserver does). Lines starting with `#` and blank
/// lines are skipped.
pub fn parse_token_file(text: &str) -> Result<Vec<TokenFileRow>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields = csv_fields(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        if fields.len() < 3 {
            return Err(format!(
                "line {}: want at least 3 columns (token,user,uid), got {}",
                i + 1,
                fields.len()
            ));
        }
        if fields[0].is_empty() || fields[1].is_empty() {
            return Err(format!("line {}: empty token or user", i + 1));
        }
        let groups = fields
            .get(3)
            .map(|g| {
                g.split(',')
                    .map(str::trim)
                    .filter(|g| !g.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        out.push(TokenFileRow {
            token: fields[0].clone(),
            user: fields[1].clone(),
            uid: fields[2].clone(),
            groups,
        });
    }
    Ok(out)
}

/// One CSV record (RFC 4180 quoting: `"a,b"`, `""` for a quote).
fn csv_fields(line: &str) -> Result<Vec<String>, &'static str> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    let mut was_quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                cur.push('"');
            }
            (true, '"') => quoted = false,
            (true, c) => cur.push(c),
            (false, '"') if cur.is_empty() && !was_quoted => {
                quoted = true;
                was_quoted = true;
            }
            (false, '"') => return Err("bare quote in an unquoted field"),
            (false, ',') => {
                fields.push(std::mem::take(&mut cur));
                was_quoted = false;
            }
            (false, c) => cur.push(c),
        }
    }
    if quoted {
        return Err("unterminated quoted field");
    }
    fields.push(cur);
    Ok(fields)
}

fn sha256(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A verification key of the issuer, with the one algorithm it may verify.
#[derive(Clone)]
struct Key {
    key: DecodingKey,
    alg: Algorithm,
}

/// The issuer's discovery document and keys, as last fetched.
#[derive(Clone)]
pub struct KeySet {
    issuer: String,
    keys: HashMap<String, Key>,
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySet")
            .field("issuer", &self.issuer)
            .field("kids", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl KeySet {
    /// Builds a key set from a JWKS document. Keys are pinned to one asymmetric algorithm:
    /// the JWK's `alg` when set, else RS256 for RSA and ES256/ES384 by curve. Symmetric
    /// (`oct`) keys, keys without `kid` and keys whose `alg` disagrees with their type are
    /// skipped: an HMAC "key" would let anyone holding the public JWKS sign tokens.
    pub fn from_jwks(issuer: &str, jwks: &[u8]) -> Result<KeySet, String> {
        let set: jwk::JwkSet =
            serde_json::from_slice(jwks).map_err(|e| format!("parsing the JWKS: {e}"))?;
        let mut keys = HashMap::new();
        for k in &set.keys {
            let Some(kid) = k.common.key_id.clone() else {
                continue;
            };
            if k.common
                .public_key_use
                .as_ref()
                .is_some_and(|u| *u != jwk::PublicKeyUse::Signature)
            {
                continue;
            }
            let by_type = match &k.algorithm {
                jwk::AlgorithmParameters::RSA(_) => Algorithm::RS256,
                jwk::AlgorithmParameters::EllipticCurve(p) => match p.curve {
                    jwk::EllipticCurve::P256 => Algorithm::ES256,
                    jwk::EllipticCurve::P384 => Algorithm::ES384,
                    _ => continue,
                },
                // Ed25519 is not used by kube-apiserver; symmetric keys are never accepted.
                _ => continue,
            };
            let alg = match k.common.key_algorithm.map(|a| a.to_string()) {
                None => by_type,
                Some(a) => match a.parse::<Algorithm>() {
                    Ok(a) if matches!(by_type, Algorithm::RS256) && is_rsa(a) => a,
                    Ok(a) if a == by_type => a,
                    _ => continue,
                },
            };
            let Ok(key) = DecodingKey::from_jwk(k) else {
                continue;
            };
            keys.insert(kid, Key { key, alg });
        }
        Ok(KeySet {
            issuer: issuer.to_string(),
            keys,
        })
    }

    pub fn issuer(&self) -> &str {
        &self.issuer
    }
}

fn is_rsa(a: Algorithm) -> bool {
    matches!(
        a,
        Algorithm::RS256
            | Algorithm::RS384
            | Algorithm::RS512
            | Algorithm::PS256
            | Algorithm::PS384
            | Algorithm::PS512
    )
}

/// Why a JWT was not verified offline.
#[derive(Debug, PartialEq, Eq)]
pub enum JwtError {
    /// Not for offline verification (another issuer, no `kid`, a `kid` not in the JWKS):
    /// TokenReview decides.
    NotOurs,
    /// Verification failed: the token is rejected.
    Invalid(String),
}

/// The private claims kube-apiserver puts in ServiceAccount tokens.
#[derive(Debug, Deserialize)]
struct SaClaims {
    sub: String,
    #[serde(default)]
    jti: Option<String>,
    #[serde(default)]
    exp: Option<u64>,
    #[serde(rename = "kubernetes.io")]
    kubernetes: KubeClaims,
}

#[derive(Debug, Deserialize)]
struct KubeClaims {
    namespace: String,
    serviceaccount: ObjRef,
    #[serde(default)]
    pod: Option<ObjRef>,
    #[serde(default)]
    secret: Option<ObjRef>,
    #[serde(default)]
    node: Option<ObjRef>,
}

#[derive(Debug, Deserialize)]
struct ObjRef {
    name: String,
    #[serde(default)]
    uid: String,
}

/// An offline-verified ServiceAccount token.
#[derive(Debug)]
pub struct VerifiedJwt {
    pub identity: Identity,
    pub exp: Option<u64>,
    /// Names a pod, secret or node whose deletion revokes it.
    pub bound: bool,
}

/// The issuer claim of a JWT, read without verification (only to pick the verifier).
fn unverified_issuer(token: &str) -> Option<String> {
    use base64::Engine;
    let mut parts = token.split('.');
    let (_, payload, _, None) = (parts.next()?, parts.next()?, parts.next()?, parts.next()) else {
        return None;
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .ok()?;
    #[derive(Deserialize)]
    struct Iss {
        iss: Option<String>,
    }
    serde_json::from_slice::<Iss>(&bytes).ok()?.iss
}

/// Verifies a ServiceAccount JWT against `keys` (see the module docs). `now` is the Unix
/// time the claims are checked at.
pub fn verify_jwt(
    token: &str,
    keys: &KeySet,
    audiences: &[String],
    leeway: Duration,
) -> Result<VerifiedJwt, JwtError> {
    if unverified_issuer(token).as_deref() != Some(keys.issuer.as_str()) {
        return Err(JwtError::NotOurs);
    }
    // The header is parsed before any key is chosen; `alg: none` does not even parse.
    let header =
        jsonwebtoken::decode_header(token).map_err(|e| JwtError::Invalid(e.to_string()))?;
    let Some(kid) = header.kid.as_deref() else {
        return Err(JwtError::NotOurs);
    };
    let Some(key) = keys.keys.get(kid) else {
        return Err(JwtError::NotOurs);
    };
    if header.alg != key.alg {
        return Err(JwtError::Invalid(format!(
            "algorithm {:?} is not the key's {:?}",
            header.alg, key.alg
        )));
    }
    let mut v = Validation::new(key.alg);
    v.leeway = leeway.as_secs();
    v.validate_exp = true;
    v.validate_nbf = true;
    v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
    v.set_issuer(&[&keys.issuer]);
    if audiences.is_empty() {
        v.set_audience(&[&keys.issuer]);
    } else {
        v.set_audience(audiences);
    }
    let data = jsonwebtoken::decode::<SaClaims>(token, &key.key, &v)
        .map_err(|e| JwtError::Invalid(e.to_string()))?;
    let c = data.claims;
    let k = &c.kubernetes;
    let user = format!(
        "system:serviceaccount:{}:{}",
        k.namespace, k.serviceaccount.name
    );
    if k.namespace.is_empty() || k.serviceaccount.name.is_empty() || c.sub != user {
        return Err(JwtError::Invalid(
            "subject does not name the serviceaccount".into(),
        ));
    }
    let mut extra = BTreeMap::new();
    if let Some(p) = &k.pod {
        extra.insert(
            "authentication.kubernetes.io/pod-name".into(),
            vec![p.name.clone()],
        );
        extra.insert(
            "authentication.kubernetes.io/pod-uid".into(),
            vec![p.uid.clone()],
        );
    }
    if let Some(n) = &k.node {
        extra.insert(
            "authentication.kubernetes.io/node-name".into(),
            vec![n.name.clone()],
        );
        extra.insert(
            "authentication.kubernetes.io/node-uid".into(),
            vec![n.uid.clone()],
        );
    }
    if let Some(jti) = c.jti.as_deref().filter(|j| !j.is_empty()) {
        extra.insert(
            "authentication.kubernetes.io/credential-id".into(),
            vec![format!("JTI={jti}")],
        );
    }
    Ok(VerifiedJwt {
        identity: Identity {
            user,
            uid: k.serviceaccount.uid.clone(),
            groups: vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{}", k.namespace),
                "system:authenticated".into(),
            ],
            extra,
            tenant: String::new(),
        },
        exp: c.exp,
        bound: k.pod.is_some() || k.secret.is_some() || k.node.is_some(),
    })
}

/// Maps identities to tenants (the first tenant with a matching rule).
#[derive(Debug, Clone, Default)]
pub struct TenantMapper {
    tenants: Vec<TenantConfig>,
}

impl TenantMapper {
    pub fn new(tenants: Vec<TenantConfig>) -> TenantMapper {
        TenantMapper { tenants }
    }

    pub fn tenant_of(&self, id: &Identity) -> String {
        let sa_ns = id.service_account_namespace();
        for t in &self.tenants {
            let m = &t.matches;
            if m.groups.iter().any(|g| id.groups.contains(g))
                || sa_ns.is_some_and(|ns| m.service_account_namespaces.iter().any(|n| n == ns))
                || m.username_patterns.iter().any(|p| glob(p, &id.user))
            {
                return t.name.clone();
            }
        }
        String::new()
    }
}

/// `*` matches any run of characters (including none); everything else literally.
pub fn glob(pattern: &str, s: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == s;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !s.starts_with(first) || s.len() < first.len() + last.len() || !s.ends_with(last) {
        return false;
    }
    let mut rest = &s[first.len()..s.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

/// A cached verdict on one token: the identity, or the method that refused it.
#[derive(Clone)]
struct Cached {
    outcome: Result<(Arc<Identity>, AuthnMethod), Option<AuthnMethod>>,
    /// Unix time after which the entry is void (the token's `exp`).
    until: Option<u64>,
}

/// How long a verdict is cached: successes `cacheTtl` but never past the token's `exp`,
/// failures `failureCacheTtl` (zero: shared by the concurrent requests of one flight only).
struct VerdictTtl {
    ok: Duration,
    failed: Duration,
}

impl moka::Expiry<[u8; 32], Cached> for VerdictTtl {
    fn expire_after_create(&self, _: &[u8; 32], v: &Cached, _: Instant) -> Option<Duration> {
        Some(match (&v.outcome, v.until) {
            (Ok(_), Some(until)) => self
                .ok
                .min(Duration::from_secs(until.saturating_sub(now_unix()))),
            (Ok(_), None) => self.ok,
            (Err(_), _) => self.failed,
        })
    }
}

/// Why the keys are being fetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// A token named a `kid` the key set lacks: only `jwksMinRefreshInterval` limits it.
    UnknownKid,
    /// On use, the keys are older than `jwksRefreshInterval`.
    Stale,
    /// The background refresher's tick.
    Periodic,
}

/// State of JWKS fetching, behind an async mutex (one fetch at a time).
struct Refresh {
    last_attempt: Option<Instant>,
}

/// The authentication chain (see the module docs).
pub struct Authenticator {
    cfg: AuthenticationConfig,
    upstream: Upstream,
    tenants: TenantMapper,
    static_tokens: HashMap<[u8; 32], TokenFileRow>,
    keys: RwLock<Option<(Arc<KeySet>, Instant)>>,
    refresh: tokio::sync::Mutex<Refresh>,
    /// Verdicts by token hash; also the single flight of concurrent identical tokens.
    verdicts: moka::future::Cache<[u8; 32], Cached>,
    /// Offline-only JWT verdicts for [`Authenticator::identify_offline`] (no revocation check,
    /// so never mixed with `verdicts`); a signature check costs ~0.3 ms.
    offline: moka::future::Cache<[u8; 32], Cached>,
    timeout: Duration,
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
    #[error("token file {path}: {message}")]
    TokenFile {
        path: std::path::PathBuf,
        message: String,
    },
}

impl Authenticator {
    pub fn new(
        cfg: AuthenticationConfig,
        tenants: TenantMapper,
        upstream: Upstream,
    ) -> Result<Authenticator, AuthnError> {
        let mut static_tokens = HashMap::new();
        if let Some(path) = &cfg.token_auth_file {
            let text =
                std::fs::read_to_string(path).map_err(|source| AuthnError::ReadTokenFile {
                    path: path.clone(),
                    source,
                })?;
            let rows = parse_token_file(&text).map_err(|message| AuthnError::TokenFile {
                path: path.clone(),
                message,
            })?;
            for mut row in rows {
                // Only the hash of a token is kept.
                let key = sha256(std::mem::take(&mut row.token).as_bytes());
                static_tokens.insert(key, row);
            }
        }
        let verdicts = || {
            moka::future::Cache::builder()
                .max_capacity(200_000)
                .expire_after(VerdictTtl {
                    ok: cfg.cache_ttl,
                    failed: cfg.failure_cache_ttl,
                })
                .build()
        };
        Ok(Authenticator {
            verdicts: verdicts(),
            offline: verdicts(),
            cfg,
            upstream,
            tenants,
            static_tokens,
            keys: RwLock::new(None),
            refresh: tokio::sync::Mutex::new(Refresh { last_attempt: None }),
            timeout: Duration::from_secs(5),
            stats: AuthnStats::default(),
        })
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
        // Set only by the call whose verification runs (the flight's leader).
        let led = std::sync::atomic::AtomicBool::new(false);
        let r = self
            .verdicts
            .try_get_with(key, async {
                led.store(true, Relaxed);
                let (outcome, until, refused_by) = self.authenticate_token(token).await;
                match outcome {
                    Outcome::Authenticated(id, m) => Ok(Cached {
                        outcome: Ok((id, m)),
                        until,
                    }),
                    Outcome::Unauthorized => Ok(Cached {
                        outcome: Err(refused_by),
                        until: None,
                    }),
                    Outcome::Unavailable(e) => Err(e),
                }
            })
            .await;
        if !led.load(Relaxed) {
            self.stats.cache_hits.fetch_add(1, Relaxed);
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
            Err(e) => (
                Outcome::Unavailable(e.to_string()),
                Some(AuthnMethod::TokenReview),
            ),
        }
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
        let keys = self.keys.read().ok().and_then(|g| g.clone())?.0;
        let c = self
            .offline
            .get_with(key, async {
                match verify_jwt(token, &keys, &self.cfg.audiences, self.cfg.leeway) {
                    Ok(v) => Cached {
                        outcome: Ok(self.finish(v.identity, AuthnMethod::ServiceAccountJwt)),
                        until: v.exp,
                    },
                    Err(_) => Cached {
                        outcome: Err(Some(AuthnMethod::ServiceAccountJwt)),
                        until: None,
                    },
                }
            })
            .await;
        c.outcome.ok().map(|(id, _)| id)
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

    /// One token through the chain: the outcome, the `exp` bounding its cache entry, and
    /// for a refusal the method that refused it (the last one that could judge the token).
    async fn authenticate_token(&self, token: &str) -> (Outcome, Option<u64>, Option<AuthnMethod>) {
        if let Some(u) = self.static_tokens.get(&sha256(token.as_bytes())) {
            let (id, m) = self.static_identity(u);
            return (Outcome::Authenticated(id, m), None, None);
        }
        let mut refused_by = (!self.static_tokens.is_empty()).then_some(AuthnMethod::StaticToken);
        if self.cfg.service_account_jwt
            && token.bytes().filter(|b| *b == b'.').count() == 2
            && let Some(keys) = self.key_set().await
        {
            refused_by = Some(AuthnMethod::ServiceAccountJwt);
            let mut r = verify_jwt(token, &keys, &self.cfg.audiences, self.cfg.leeway);
            if matches!(r, Err(JwtError::NotOurs))
                && unverified_issuer(token).as_deref() == Some(keys.issuer())
                && self.refresh_keys(Why::UnknownKid).await
                && let Some(k) = self.key_set().await
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
                    };
                    if review {
                        match self.token_review(token).await {
                            Ok(Some(_)) => {}
                            Ok(None) => {
                                return (
                                    Outcome::Unauthorized,
                                    None,
                                    Some(AuthnMethod::TokenReview),
                                );
                            }
                            Err(e) => return (Outcome::Unavailable(e), None, None),
                        }
                    }
                    let (id, m) = self.finish(v.identity, AuthnMethod::ServiceAccountJwt);
                    return (Outcome::Authenticated(id, m), v.exp, None);
                }
                Err(JwtError::Invalid(why)) => {
                    tracing::debug!(reason = %why, "serviceaccount token rejected");
                    return (Outcome::Unauthorized, None, refused_by);
                }
                Err(JwtError::NotOurs) => {}
            }
        }
        if !self.cfg.token_review {
            return (Outcome::Unauthorized, None, refused_by);
        }
        match self.token_review(token).await {
            Ok(Some(id)) => {
                let (id, m) = self.finish(id, AuthnMethod::TokenReview);
                (Outcome::Authenticated(id, m), None, None)
            }
            Ok(None) => (Outcome::Unauthorized, None, Some(AuthnMethod::TokenReview)),
            Err(e) => (Outcome::Unavailable(e), None, None),
        }
    }

    /// The current key set, fetched on first use and refreshed when older than
    /// `jwksRefreshInterval` (the background refresher normally keeps it fresh). `None` when
    /// discovery is unavailable (then TokenReview decides).
    async fn key_set(&self) -> Option<Arc<KeySet>> {
        let cur = self.keys.read().ok().and_then(|g| g.clone());
        match cur {
            Some((k, at)) if at.elapsed() < self.cfg.jwks_refresh_interval => Some(k),
            stale => {
                self.refresh_keys(Why::Stale).await;
                self.keys
                    .read()
                    .ok()
                    .and_then(|g| g.clone())
                    .map(|(k, _)| k)
                    .or(stale.map(|(k, _)| k))
            }
        }
    }

    /// Refetches discovery + JWKS. On use (`Stale`, `UnknownKid`) not within
    /// `jwksMinRefreshInterval` of the last attempt, so a flood of forged `kid`s cannot hammer
    /// the apiserver; the background tick (`Periodic`) is paced by its own interval. True when
    /// new keys were stored by this call; a failure keeps the previous keys.
    async fn refresh_keys(&self, why: Why) -> bool {
        let mut r = self.refresh.lock().await;
        if why != Why::Periodic
            && let Some(at) = r.last_attempt
            && at.elapsed() < self.cfg.jwks_min_refresh_interval
        {
            return false;
        }
        let fresh_for = match why {
            Why::UnknownKid => Duration::ZERO,
            Why::Stale => self.cfg.jwks_refresh_interval,
            // Ticks are `jwksRefreshInterval` apart: a tick meeting keys fetched since the
            // last one (on use) skips, without skipping every other tick on timer jitter.
            Why::Periodic => self.cfg.jwks_refresh_interval / 2,
        };
        if let Some((_, at)) = self.keys.read().ok().and_then(|g| g.clone())
            && at.elapsed() < fresh_for
        {
            // Another caller refreshed while this one waited for the lock.
            return false;
        }
        r.last_attempt = Some(Instant::now());
        self.stats.jwks_fetches.fetch_add(1, Relaxed);
        match self.fetch_keys().await {
            Ok(ks) => {
                if let Ok(mut g) = self.keys.write() {
                    *g = Some((Arc::new(ks), Instant::now()));
                }
                true
            }
            Err(e) => {
                self.stats.jwks_fetch_failures.fetch_add(1, Relaxed);
                let kept = self.keys.read().ok().is_some_and(|g| g.is_some());
                tracing::warn!(error = %e, kept_previous_keys = kept, ?why, "fetching the serviceaccount issuer's keys failed; tokens no key verifies go to TokenReview");
                false
            }
        }
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
                a.refresh_keys(Why::Periodic).await;
            }
        });
    }

    async fn fetch_keys(&self) -> Result<KeySet, String> {
        #[derive(Deserialize)]
        struct Discovery {
            issuer: String,
        }
        let d = self
            .get("/.well-known/openid-configuration", "application/json")
            .await?;
        let d: Discovery =
            serde_json::from_slice(&d).map_err(|e| format!("discovery document: {e}"))?;
        // The document's jwks_uri names the issuer's external URL; the same keys are served
        // by the apiserver at this path, reached through the proxy's upstream client.
        // The apiserver answers 406 to this path for `Accept: application/json` alone.
        let jwks = self
            .get(
                "/openid/v1/jwks",
                "application/jwk-set+json, application/json",
            )
            .await?;
        KeySet::from_jwks(&d.issuer, &jwks)
    }

    async fn get(&self, path: &str, accept: &'static str) -> Result<bytes::Bytes, String> {
        let mut req = Request::new(body::empty());
        *req.uri_mut() = self.upstream.uri(path);
        req.headers_mut()
            .insert(header::ACCEPT, HeaderValue::from_static(accept));
        let fut = self.upstream.send(req, As::Proxy, false);
        let resp = tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| format!("GET {path} timed out"))?
            .map_err(|e| format!("GET {path}: {e}"))?;
        let status = resp.status();
        let b = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("GET {path}: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("GET {path} returned {status}"));
        }
        Ok(b)
    }

    /// A TokenReview with the proxy's credentials: `Ok(None)` when the apiserver says the
    /// token does not authenticate, `Err` when it cannot say.
    async fn token_review(&self, token: &str) -> Result<Option<Identity>, String> {
        #[derive(Deserialize)]
        struct Review {
            status: Option<ReviewStatus>,
        }
        #[derive(Deserialize)]
        struct ReviewStatus {
            #[serde(default)]
            authenticated: bool,
            #[serde(default)]
            user: Option<ReviewUser>,
        }
        #[derive(Deserialize)]
        struct ReviewUser {
            #[serde(default)]
            username: String,
            #[serde(default)]
            uid: String,
            #[serde(default)]
            groups: Vec<String>,
            #[serde(default)]
            extra: BTreeMap<String, Vec<String>>,
        }
        let body = serde_json::json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        });
        let mut req = Request::new(body::full(body.to_string()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = self
            .upstream
            .uri("/apis/authentication.k8s.io/v1/tokenreviews");
        req.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        req.headers_mut()
            .insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        let fut = self.upstream.send(req, As::Proxy, false);
        let resp = tokio::time::timeout(self.timeout, fut)
            .await
            .map_err(|_| "token review timed out".to_string())?
            .map_err(|e| format!("token review: {e}"))?;
        let status = resp.status();
        let b = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("token review: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("token review returned {status}"));
        }
        let r: Review = serde_json::from_slice(&b).map_err(|e| format!("token review: {e}"))?;
        match r.status {
            Some(ReviewStatus {
                authenticated: true,
                user: Some(u),
            }) if !u.username.is_empty() => Ok(Some(Identity {
                user: u.username,
                uid: u.uid,
                groups: u.groups,
                extra: u.extra,
                tenant: String::new(),
            })),
            _ => Ok(None),
        }
    }
}

enum Bearer<'a> {
    None,
    Invalid,
    Token(&'a str),
}

/// The bearer token of `Authorization`, parsed as kube-apiserver's bearer-token
/// authenticator does: another scheme is "no token" (anonymous), `Bearer` with an empty or
/// unparseable token is a failed authentication.
fn bearer(headers: &HeaderMap) -> Bearer<'_> {
    let Some(v) = headers.get(header::AUTHORIZATION) else {
        return Bearer::None;
    };
    let Ok(v) = v.to_str() else {
        return Bearer::Invalid;
    };
    let v = v.trim();
    let mut parts = v.splitn(3, ' ');
    let scheme = parts.next().unwrap_or("");
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Bearer::None;
    }
    match (parts.next(), parts.next()) {
        (Some(t), None) if !t.is_empty() => Bearer::Token(t),
        _ => Bearer::Invalid,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header, encode};
    use serde_json::json;

    const ISS: &str = "https://kubernetes.default.svc.cluster.local";

    struct Signer {
        enc: EncodingKey,
        jwks: String,
        public_der: Vec<u8>,
    }

    fn signer(kid: &str) -> Signer {
        let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let enc = EncodingKey::from_ec_der(&kp.serialize_der());
        let jwk = jwk::Jwk::from_encoding_key(&enc, Algorithm::ES256).unwrap();
        let mut v = serde_json::to_value(&jwk).unwrap();
        v["kid"] = json!(kid);
        v["use"] = json!("sig");
        Signer {
            enc,
            jwks: json!({ "keys": [v] }).to_string(),
            public_der: rcgen::PublicKeyData::subject_public_key_info(&kp),
        }
    }

    fn claims(exp_in: i64) -> serde_json::Value {
        let now = now_unix() as i64;
        json!({
            "iss": ISS, "aud": [ISS], "sub": "system:serviceaccount:team-a:builder",
            "iat": now, "nbf": now, "exp": now + exp_in, "jti": "j-1",
            "kubernetes.io": {
                "namespace": "team-a",
                "serviceaccount": {"name": "builder", "uid": "sa-uid"},
                "pod": {"name": "p", "uid": "pod-uid"},
            },
        })
    }

    fn sign(s: &Signer, kid: &str, c: &serde_json::Value) -> String {
        let mut h = Header::new(Algorithm::ES256);
        h.kid = Some(kid.into());
        encode(&h, c, &s.enc).unwrap()
    }

    fn keys(s: &Signer) -> KeySet {
        KeySet::from_jwks(ISS, s.jwks.as_bytes()).unwrap()
    }

    fn verify(t: &str, ks: &KeySet) -> Result<VerifiedJwt, JwtError> {
        verify_jwt(t, ks, &[], Duration::from_secs(60))
    }

    fn b64(b: &[u8]) -> String {
        use base64::Engine;
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    }

    #[test]
    fn a_good_serviceaccount_token_gives_its_user_groups_and_extra() {
        let s = signer("k1");
        let v = verify(&sign(&s, "k1", &claims(3600)), &keys(&s)).unwrap();
        assert_eq!(v.identity.user, "system:serviceaccount:team-a:builder");
        assert_eq!(v.identity.uid, "sa-uid");
        assert_eq!(
            v.identity.groups,
            [
                "system:serviceaccounts",
                "system:serviceaccounts:team-a",
                "system:authenticated"
            ]
        );
        assert_eq!(
            v.identity.extra["authentication.kubernetes.io/pod-name"],
            ["p"]
        );
        assert_eq!(
            v.identity.extra["authentication.kubernetes.io/credential-id"],
            ["JTI=j-1"]
        );
        assert!(v.bound);
        assert_eq!(v.identity.service_account_namespace(), Some("team-a"));
    }

    #[test]
    fn a_token_signed_by_another_key_with_the_same_kid_is_rejected() {
        let real = signer("k1");
        let forger = signer("k1");
        let t = sign(&forger, "k1", &claims(3600));
        assert!(matches!(
            verify(&t, &keys(&real)),
            Err(JwtError::Invalid(_))
        ));
    }

    #[test]
    fn a_tampered_payload_is_rejected() {
        let s = signer("k1");
        let t = sign(&s, "k1", &claims(3600));
        let parts: Vec<&str> = t.split('.').collect();
        let mut c = claims(3600);
        c["kubernetes.io"]["namespace"] = json!("kube-system");
        c["sub"] = json!("system:serviceaccount:kube-system:builder");
        let forged = format!(
            "{}.{}.{}",
            parts[0],
            b64(c.to_string().as_bytes()),
            parts[2]
        );
        assert!(matches!(
            verify(&forged, &keys(&s)),
            Err(JwtError::Invalid(_))
        ));
    }

    #[test]
    fn an_expired_token_is_rejected_beyond_the_leeway() {
        let s = signer("k1");
        let t = sign(&s, "k1", &claims(-120));
        assert!(matches!(verify(&t, &keys(&s)), Err(JwtError::Invalid(_))));
        // Within the leeway it is still accepted, as by kube-apiserver.
        let t = sign(&s, "k1", &claims(-30));
        assert!(verify(&t, &keys(&s)).is_ok());
    }

    #[test]
    fn a_token_not_yet_valid_is_rejected() {
        let s = signer("k1");
        let mut c = claims(7200);
        c["nbf"] = json!(now_unix() + 3600);
        assert!(matches!(
            verify(&sign(&s, "k1", &c), &keys(&s)),
            Err(JwtError::Invalid(_))
        ));
    }

    #[test]
    fn a_wrong_issuer_is_not_verified_offline() {
        let s = signer("k1");
        let mut c = claims(3600);
        c["iss"] = json!("https://evil.example");
        // Not ours: TokenReview (the apiserver) decides, which rejects it.
        assert_eq!(
            verify(&sign(&s, "k1", &c), &keys(&s)).unwrap_err(),
            JwtError::NotOurs
        );
    }

    #[test]
    fn a_wrong_audience_is_rejected() {
        let s = signer("k1");
        let mut c = claims(3600);
        c["aud"] = json!(["vault"]);
        assert!(matches!(
            verify(&sign(&s, "k1", &c), &keys(&s)),
            Err(JwtError::Invalid(_))
        ));
        // ...unless configured.
        let v = verify_jwt(
            &sign(&s, "k1", &c),
            &keys(&s),
            &["vault".into()],
            Duration::from_secs(60),
        );
        assert!(v.is_ok());
    }

    #[test]
    fn alg_none_is_rejected() {
        let s = signer("k1");
        let header = json!({"alg": "none", "typ": "JWT", "kid": "k1"});
        let t = format!(
            "{}.{}.",
            b64(header.to_string().as_bytes()),
            b64(claims(3600).to_string().as_bytes())
        );
        assert!(matches!(verify(&t, &keys(&s)), Err(JwtError::Invalid(_))));
    }

    #[test]
    fn hs256_signed_with_the_public_key_is_rejected() {
        let s = signer("k1");
        let ks = keys(&s);
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("k1".into());
        // The classic key-confusion attack: the public key (DER, and the JWKS text) as an
        // HMAC secret.
        for secret in [s.public_der.as_slice(), s.jwks.as_bytes()] {
            let t = encode(&h, &claims(3600), &EncodingKey::from_secret(secret)).unwrap();
            assert!(matches!(verify(&t, &ks), Err(JwtError::Invalid(_))), "{t}");
        }
    }

    #[test]
    fn symmetric_keys_in_a_jwks_are_ignored() {
        let jwks =
            json!({"keys": [{"kty": "oct", "k": b64(b"secret"), "kid": "h", "alg": "HS256"}]});
        let ks = KeySet::from_jwks(ISS, jwks.to_string().as_bytes()).unwrap();
        assert!(ks.keys.is_empty());
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some("h".into());
        let t = encode(&h, &claims(3600), &EncodingKey::from_secret(b"secret")).unwrap();
        assert_eq!(verify(&t, &ks).unwrap_err(), JwtError::NotOurs);
    }

    #[test]
    fn an_unknown_kid_is_left_to_the_refresh_and_token_review() {
        let s = signer("k1");
        let t = sign(&s, "k2", &claims(3600));
        assert_eq!(verify(&t, &keys(&s)).unwrap_err(), JwtError::NotOurs);
    }

    #[test]
    fn a_subject_that_disagrees_with_the_serviceaccount_claim_is_rejected() {
        let s = signer("k1");
        let mut c = claims(3600);
        c["sub"] = json!("system:serviceaccount:kube-system:default");
        assert!(matches!(
            verify(&sign(&s, "k1", &c), &keys(&s)),
            Err(JwtError::Invalid(_))
        ));
    }

    #[test]
    fn token_file_rows_parse_like_kube_apiserver() {
        let rows = parse_token_file(
            "# comment\nt1,alice,u1,\"dev,ops\"\n\nt2,bob,u2\nt3,\"carol, c\",u3,solo\n",
        )
        .unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].token, "t1");
        assert_eq!(rows[0].groups, ["dev", "ops"]);
        assert!(rows[1].groups.is_empty());
        assert_eq!(rows[2].user, "carol, c");
        assert_eq!(rows[2].groups, ["solo"]);
        assert!(parse_token_file("t1,alice\n").is_err());
        assert!(parse_token_file("t1,\"alice,u1\n").is_err());
    }

    #[test]
    fn identity_hash_is_canonical_and_separates_fields() {
        let a = Identity {
            user: "u".into(),
            uid: "1".into(),
            groups: vec!["b".into(), "a".into()],
            extra: BTreeMap::from([("k".into(), vec!["2".into(), "1".into()])]),
            tenant: "t".into(),
        };
        let mut b = a.clone();
        b.groups.reverse();
        b.extra.insert("k".into(), vec!["1".into(), "2".into()]);
        b.tenant = "other".into();
        assert_eq!(a.identity_hash(), b.identity_hash());
        // Moving a byte between fields changes the hash (length prefixes).
        let mut c = a.clone();
        c.user = "u1".into();
        c.uid = String::new();
        assert_ne!(a.identity_hash(), c.identity_hash());
        let mut d = a.clone();
        d.groups = vec!["ab".into()];
        assert_ne!(a.identity_hash(), d.identity_hash());
    }

    #[test]
    fn bearer_parsing_follows_the_apiserver() {
        let h = |v: &str| {
            let mut m = HeaderMap::new();
            m.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            m
        };
        assert!(matches!(bearer(&h("Bearer abc")), Bearer::Token("abc")));
        assert!(matches!(bearer(&h("bearer abc")), Bearer::Token("abc")));
        assert!(matches!(bearer(&h("Bearer ")), Bearer::Invalid));
        assert!(matches!(bearer(&h("Bearer a b")), Bearer::Invalid));
        assert!(matches!(bearer(&h("Basic abc")), Bearer::None));
        assert!(matches!(bearer(&HeaderMap::new()), Bearer::None));
    }

    #[test]
    fn tenants_match_by_group_serviceaccount_namespace_and_user_pattern() {
        let t = |name: &str, m: crate::config::TenantMatch| TenantConfig {
            name: name.into(),
            matches: m,
            namespaces: vec![],
            namespace_selector: None,
            filtered_cluster_view: false,
            view_recheck_interval: Duration::from_secs(10),
            quotas: Default::default(),
        };
        let mapper = TenantMapper::new(vec![
            t(
                "a",
                crate::config::TenantMatch {
                    groups: vec!["team-a".into()],
                    ..Default::default()
                },
            ),
            t(
                "b",
                crate::config::TenantMatch {
                    service_account_namespaces: vec!["team-b".into()],
                    username_patterns: vec!["bob-*".into()],
                    ..Default::default()
                },
            ),
        ]);
        let id = |user: &str, groups: &[&str]| Identity {
            user: user.into(),
            uid: String::new(),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            extra: BTreeMap::new(),
            tenant: String::new(),
        };
        assert_eq!(mapper.tenant_of(&id("x", &["team-a"])), "a");
        assert_eq!(
            mapper.tenant_of(&id("system:serviceaccount:team-b:ci", &[])),
            "b"
        );
        assert_eq!(mapper.tenant_of(&id("bob-smith", &[])), "b");
        assert_eq!(mapper.tenant_of(&id("bobby", &[])), "");
        assert!(glob("a*b*c", "axxbyyc"));
        assert!(!glob("a*b*c", "axxc"));
        assert!(glob("*", ""));
    }

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
        *a.keys.write().unwrap() = Some((Arc::new(keys(&s)), Instant::now()));
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

    fn offline_authenticator(cfg: AuthenticationConfig) -> Authenticator {
        crate::http::tls::install_crypto_provider();
        // Never contacted: these paths need no upstream.
        let kube = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let up = Upstream::new(&kube, &crate::config::UpstreamConfig::default()).unwrap();
        Authenticator::new(cfg, TenantMapper::default(), up).unwrap()
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
