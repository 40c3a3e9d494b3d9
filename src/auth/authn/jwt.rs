//! Offline verification of ServiceAccount JWTs: the issuer's key set ([`KeySet`], built from
//! its JWKS with every key pinned to one asymmetric algorithm) and [`verify_jwt`] (issuer,
//! audience, `exp`/`nbf` with a leeway, the signature with the key named by `kid`, and the
//! ServiceAccount claims kube-apiserver puts in its tokens).

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, Validation, jwk};
use serde::Deserialize;

use super::identity::Identity;

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
    pub fn from_jwks(issuer: &str, jwks: &[u8]) -> Result<KeySet, KeySetError> {
        let set: jwk::JwkSet = serde_json::from_slice(jwks).map_err(KeySetError::Parse)?;
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

/// Why a JWKS document gave no key set (single keys that cannot be used are skipped instead).
#[derive(Debug, thiserror::Error)]
pub enum KeySetError {
    #[error("parsing the JWKS: {0}")]
    Parse(#[source] serde_json::Error),
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
    #[serde(default)]
    iat: Option<u64>,
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
    /// The Secret it is bound to (name, uid): not part of the identity, looked up apart.
    pub secret: Option<(String, String)>,
}

/// The issuer claim of a JWT, read without verification (only to pick the verifier).
pub(super) fn unverified_issuer(token: &str) -> Option<String> {
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
    // go-jose's claim validation, which kube-apiserver uses, refuses a token issued in the
    // future beyond the leeway (jsonwebtoken does not look at `iat`).
    if c.iat
        .is_some_and(|iat| iat > super::verdict::now_unix() + leeway.as_secs())
    {
        return Err(JwtError::Invalid(
            "service account token is issued in the future".into(),
        ));
    }
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
        secret: k.secret.as_ref().map(|s| (s.name.clone(), s.uid.clone())),
    })
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;
    use jsonwebtoken::{EncodingKey, Header, encode};
    use serde_json::json;

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
    fn a_token_issued_in_the_future_is_rejected_beyond_the_leeway() {
        let s = signer("k1");
        let mut c = claims(7200);
        c["iat"] = json!(now_unix() + 3600);
        assert_eq!(
            verify(&sign(&s, "k1", &c), &keys(&s)).unwrap_err(),
            JwtError::Invalid("service account token is issued in the future".into())
        );
        // Within the leeway (60 s here): clock skew, accepted as by the apiserver.
        c["iat"] = json!(now_unix() + 5);
        assert!(verify(&sign(&s, "k1", &c), &keys(&s)).is_ok());
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
}
