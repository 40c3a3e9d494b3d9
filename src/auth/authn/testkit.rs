//! Test fixtures shared by the authentication tests: a signing key with its JWKS, and
//! ServiceAccount tokens signed with it.

use std::time::Duration;

use jsonwebtoken::{Algorithm, EncodingKey, Header, encode, jwk};
use serde_json::json;

use super::jwt::{JwtError, KeySet, VerifiedJwt, verify_jwt};
pub(super) use super::verdict::now_unix;

pub(super) const ISS: &str = "https://kubernetes.default.svc.cluster.local";

pub(super) struct Signer {
    pub(super) enc: EncodingKey,
    pub(super) jwks: String,
    pub(super) public_der: Vec<u8>,
}

pub(super) fn signer(kid: &str) -> Signer {
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

pub(super) fn claims(exp_in: i64) -> serde_json::Value {
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

pub(super) fn sign(s: &Signer, kid: &str, c: &serde_json::Value) -> String {
    let mut h = Header::new(Algorithm::ES256);
    h.kid = Some(kid.into());
    encode(&h, c, &s.enc).unwrap()
}

pub(super) fn keys(s: &Signer) -> KeySet {
    KeySet::from_jwks(ISS, s.jwks.as_bytes()).unwrap()
}

pub(super) fn verify(t: &str, ks: &KeySet) -> Result<VerifiedJwt, JwtError> {
    verify_jwt(t, ks, &[], Duration::from_secs(60))
}

pub(super) fn b64(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
}
