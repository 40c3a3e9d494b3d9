//! Continue tokens of cache-served lists: signed, bound to the caller and the query, positioned
//! by key.
//!
//! kube-apiserver's token is unsigned base64 JSON `{v, rv, start}`: anyone can craft one, and
//! the apiserver re-checks authorization on every page. The proxy serves pages from memory, so
//! its token must itself prove that this caller started this walk:
//!
//! ```text
//! k1.<key id>.<base64url(payload || HMAC-SHA256(key, "kcp-continue\0" || key id || binding || payload))>
//! payload = rv u64 | expires u64 | seen u64 | total u64 | len u16 | namespace | len u16 | name
//! (big endian; expires in unix seconds; rv 0: continue at the latest state)
//! ```
//!
//! - `binding` (never in the token, so never disclosed) is a SHA-256 over the tenant, a hash
//!   of the caller's identity, the resource, the namespace and the selectors ([`Binding`]); a
//!   token presented by another identity or tenant, or for another query, fails verification
//!   exactly like a forged one.
//! - The position is the last returned key (namespace, name), not an index, so any replica
//!   holding (or able to rebuild) the snapshot at `rv` continues the walk.
//! - Verification is constant time (`Mac::verify_slice`); a token fails as a whole — the
//!   caller learns nothing about which part was wrong.
//! - Keys come from a file (current + previous, for rotation; reloaded when it changes), so
//!   all replicas share them. Without a file the process generates a random key and warns:
//!   tokens then only work on the replica that issued them.
//!
//! Tokens that do not start with `k1.` are not the proxy's (the apiserver's are standard
//! base64, which has no `.`): those requests pass through and the apiserver judges them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use parking_lot::RwLock;
use sha2::{Digest, Sha256};

use crate::cache::ObjectKey;

type HmacSha256 = Hmac<Sha256>;

const PREFIX: &str = "k1.";
const DOMAIN: &[u8] = b"kcp-continue\0";
const MAC_LEN: usize = 32;
/// Shortest accepted secret: 256 bits, HMAC-SHA256's block-size-independent strength.
pub const MIN_SECRET_LEN: usize = 32;

/// Where a walk stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    /// The snapshot every page is served from.
    pub rv: u64,
    /// The last key returned; the next page starts after it.
    pub after: ObjectKey,
    /// Unix seconds after which the token is refused with 410.
    pub expires: u64,
    /// Candidates up to and including `after`, and in the whole scope of the snapshot: the
    /// next page's `remainingItemCount` without counting again (0 with selectors).
    pub seen: u64,
    pub total: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    /// Not in the proxy's format at all (it goes to the apiserver).
    #[error("not a proxy continue token")]
    Foreign,
    /// Malformed, forged, tampered with, signed with an unknown key, or presented by
    /// another caller or for another query: 400.
    #[error("continue key is not valid")]
    Invalid,
    /// Authentic but past its lifetime: 410.
    #[error("the provided continue parameter has expired")]
    Expired,
}

/// What a token is bound to: SHA-256 over length-prefixed parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding(pub [u8; 32]);

impl Binding {
    /// `parts`: tenant, identity hash, group, version, resource, namespace, label selector,
    /// field selector — whatever must not change between the pages of one walk.
    pub fn new(parts: &[&[u8]]) -> Binding {
        let mut h = Sha256::new();
        h.update(b"kcp-binding-v1");
        for p in parts {
            h.update((p.len() as u64).to_be_bytes());
            h.update(p);
        }
        Binding(h.finalize().into())
    }
}

/// One HMAC key.
#[derive(Clone, PartialEq, Eq)]
pub struct Key {
    pub id: String,
    secret: Vec<u8>,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Key").field("id", &self.id).finish()
    }
}

/// The one place a continue token's fault becomes an answer: a foreign token goes to the
/// apiserver, a bad one is a 400 and an expired one a 410, as the apiserver answers.
impl From<TokenError> for super::NotServed {
    fn from(e: TokenError) -> Self {
        use crate::k8s::status::{Reason, Status};
        match e {
            TokenError::Foreign => super::NotServed::Delegate("foreign continue token"),
            // One message for every cause (nothing disclosed about which part failed),
            // naming them all, including a filtered view that changed.
            TokenError::Invalid => Status::bad_request(
                "invalid continue token: continue key is not valid for this caller, query \
                 and namespace view; start a new list without the continue parameter",
            )
            .into(),
            TokenError::Expired => Status::failure(
                http::StatusCode::GONE,
                Reason::Expired,
                "The provided continue parameter is too old to display a consistent list \
                 result. You can start a new list without the continue parameter.",
            )
            .into(),
        }
    }
}

/// A key the key file cannot hold.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("key id {0:?}: 1-32 characters of [A-Za-z0-9_-] expected")]
    BadId(String),
    #[error("key {id:?}: secret of {len} bytes, at least {MIN_SECRET_LEN} expected")]
    ShortSecret { id: String, len: usize },
}

/// Why a key file's text is not a key set; `line` counts from 1.
#[derive(Debug, thiserror::Error)]
pub enum KeySetError {
    #[error("line {line}: expected `<id> <base64 secret>`")]
    Syntax { line: usize },
    #[error("line {line}: secret is not base64: {source}")]
    Base64 {
        line: usize,
        #[source]
        source: base64::DecodeError,
    },
    #[error("line {line}: {source}")]
    Key {
        line: usize,
        #[source]
        source: KeyError,
    },
    #[error("line {line}: duplicate key id {id:?}")]
    Duplicate { line: usize, id: String },
    #[error("no keys in the key file")]
    Empty,
}

/// A key file that cannot be read or parsed, named by its path.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    #[error("{}: {source}", .path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: {source}", .path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: KeySetError,
    },
}

impl Key {
    pub fn new(id: &str, secret: Vec<u8>) -> Result<Key, KeyError> {
        if id.is_empty()
            || id.len() > 32
            || !id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(KeyError::BadId(id.to_string()));
        }
        if secret.len() < MIN_SECRET_LEN {
            return Err(KeyError::ShortSecret {
                id: id.to_string(),
                len: secret.len(),
            });
        }
        Ok(Key {
            id: id.to_string(),
            secret,
        })
    }

    fn mac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length.
        HmacSha256::new_from_slice(&self.secret).expect("HMAC takes any key length")
    }
}

/// The signing key and the keys still accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySet {
    /// Signs new tokens (and verifies).
    pub current: Key,
    /// Verify only: the keys before a rotation, so walks in flight finish.
    pub previous: Vec<Key>,
}

impl KeySet {
    /// The key file: one key per line, `<id> <base64 secret>`; the first is the current key,
    /// the others are accepted for verification. `#` starts a comment. Rotation: put the new
    /// key first and keep the old one below it for at least the token lifetime.
    pub fn parse(text: &str) -> Result<KeySet, KeySetError> {
        let mut keys = Vec::new();
        for (n, text) in text.lines().enumerate() {
            let line = n + 1;
            let text = text.split('#').next().unwrap_or("").trim();
            if text.is_empty() {
                continue;
            }
            let mut parts = text.split_whitespace();
            let (Some(id), Some(secret), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(KeySetError::Syntax { line });
            };
            let secret = base64::engine::general_purpose::STANDARD
                .decode(secret)
                .map_err(|source| KeySetError::Base64 { line, source })?;
            let key = Key::new(id, secret).map_err(|source| KeySetError::Key { line, source })?;
            if keys.iter().any(|k: &Key| k.id == key.id) {
                return Err(KeySetError::Duplicate {
                    line,
                    id: id.to_string(),
                });
            }
            keys.push(key);
        }
        let mut it = keys.into_iter();
        let current = it.next().ok_or(KeySetError::Empty)?;
        Ok(KeySet {
            current,
            previous: it.collect(),
        })
    }

    /// A random key for this process only.
    pub fn generate() -> KeySet {
        let mut secret = vec![0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
            .expect("the system random source works");
        KeySet {
            current: Key {
                id: "dev".into(),
                secret,
            },
            previous: Vec::new(),
        }
    }

    /// A 32-byte key per key of the set for another use (`purpose` separates uses), the
    /// current key's first: HMAC-SHA256(secret, purpose). A key derived this way reveals
    /// nothing of the signing key.
    pub fn derive(&self, purpose: &str) -> Vec<(String, [u8; 32])> {
        std::iter::once(&self.current)
            .chain(&self.previous)
            .map(|k| {
                let mut m = k.mac();
                m.update(purpose.as_bytes());
                (k.id.clone(), m.finalize().into_bytes().into())
            })
            .collect()
    }

    fn find(&self, id: &str) -> Option<&Key> {
        std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|k| k.id == id)
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn put_str(out: &mut Vec<u8>, s: &str) -> bool {
    let Ok(len) = u16::try_from(s.len()) else {
        return false;
    };
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(s.as_bytes());
    true
}

fn signature(key: &Key, binding: &Binding, payload: &[u8]) -> HmacSha256 {
    let mut mac = key.mac();
    mac.update(DOMAIN);
    mac.update(&(key.id.len() as u64).to_be_bytes());
    mac.update(key.id.as_bytes());
    mac.update(&binding.0);
    mac.update(payload);
    mac
}

/// Signs `t` for `binding` with the current key.
pub fn encode(keys: &KeySet, binding: &Binding, t: &Token) -> String {
    let mut payload = Vec::with_capacity(24 + t.after.namespace.len() + t.after.name.len());
    payload.extend_from_slice(&t.rv.to_be_bytes());
    payload.extend_from_slice(&t.expires.to_be_bytes());
    payload.extend_from_slice(&t.seen.to_be_bytes());
    payload.extend_from_slice(&t.total.to_be_bytes());
    // Namespaces and names are at most 253 bytes; anything longer cannot be a key.
    let ok = put_str(&mut payload, &t.after.namespace) && put_str(&mut payload, &t.after.name);
    debug_assert!(ok, "object keys fit in u16 lengths");
    let mac = signature(&keys.current, binding, &payload)
        .finalize()
        .into_bytes();
    payload.extend_from_slice(&mac);
    format!(
        "{PREFIX}{}.{}",
        keys.current.id,
        URL_SAFE_NO_PAD.encode(&payload)
    )
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<&'a str> {
        let len = u16::from_be_bytes(self.take(2)?.try_into().ok()?) as usize;
        std::str::from_utf8(self.take(len)?).ok()
    }
}

/// Verifies and reads a token presented with `binding`. The signature is checked before
/// anything in the payload is trusted (expiry included).
pub fn decode(keys: &KeySet, binding: &Binding, s: &str) -> Result<Token, TokenError> {
    decode_at(keys, binding, s, now_unix())
}

fn decode_at(keys: &KeySet, binding: &Binding, s: &str, now: u64) -> Result<Token, TokenError> {
    let rest = s.strip_prefix(PREFIX).ok_or(TokenError::Foreign)?;
    let (kid, data) = rest.split_once('.').ok_or(TokenError::Invalid)?;
    let key = keys.find(kid).ok_or(TokenError::Invalid)?;
    let raw = URL_SAFE_NO_PAD
        .decode(data)
        .map_err(|_| TokenError::Invalid)?;
    if raw.len() < MAC_LEN {
        return Err(TokenError::Invalid);
    }
    let (payload, mac) = raw.split_at(raw.len() - MAC_LEN);
    signature(key, binding, payload)
        .verify_slice(mac)
        .map_err(|_| TokenError::Invalid)?;
    let mut r = Reader(payload);
    let (Some(rv), Some(expires), Some(seen), Some(total), Some(ns), Some(name)) =
        (r.u64(), r.u64(), r.u64(), r.u64(), r.str(), r.str())
    else {
        return Err(TokenError::Invalid);
    };
    if !r.0.is_empty() {
        return Err(TokenError::Invalid);
    }
    if now > expires {
        return Err(TokenError::Expired);
    }
    Ok(Token {
        rv,
        after: ObjectKey::new(ns, name),
        expires,
        seen,
        total,
    })
}

/// The key set in use, reloaded from its file when that changes.
#[derive(Debug)]
pub struct Keys {
    set: RwLock<Arc<KeySet>>,
    path: Option<PathBuf>,
    /// How long a token stays valid.
    pub ttl: Duration,
}

impl Keys {
    /// Keys from `path`, or a generated process-local key (with a warning) when `None`.
    pub fn load(path: Option<&Path>, ttl: Duration) -> Result<Arc<Keys>, KeyFileError> {
        let set = match path {
            Some(p) => read(p)?,
            None => {
                tracing::warn!(
                    "no continue-token key file configured (tokens.keyFile): using a random \
                     key; continue tokens will not work across replicas or restarts"
                );
                KeySet::generate()
            }
        };
        Ok(Arc::new(Keys {
            set: RwLock::new(Arc::new(set)),
            path: path.map(Path::to_path_buf),
            ttl,
        }))
    }

    /// A fixed key set (tests).
    pub fn fixed(set: KeySet, ttl: Duration) -> Arc<Keys> {
        Arc::new(Keys {
            set: RwLock::new(Arc::new(set)),
            path: None,
            ttl,
        })
    }

    pub fn current(&self) -> Arc<KeySet> {
        self.set.read().clone()
    }

    /// Re-reads the key file; a file that no longer parses keeps the keys in use (logged).
    pub fn reload(&self) -> bool {
        let Some(p) = &self.path else { return false };
        match read(p) {
            Ok(set) => {
                let mut cur = self.set.write();
                if **cur == set {
                    return false;
                }
                tracing::info!(current = %set.current.id, previous = set.previous.len(), "continue-token keys reloaded");
                *cur = Arc::new(set);
                true
            }
            Err(e) => {
                tracing::error!(path = %p.display(), error = %e, "continue-token key file is invalid; keeping the keys in use");
                false
            }
        }
    }

    /// Polls the key file (Secret volumes change by symlink swap; polling sees every form).
    pub fn spawn_reloader(self: &Arc<Self>, every: Duration) {
        if self.path.is_none() {
            return;
        }
        let keys = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(k) = keys.upgrade() else { return };
                k.reload();
            }
        });
    }

    pub fn sign(
        &self,
        binding: &Binding,
        rv: u64,
        after: ObjectKey,
        seen: u64,
        total: u64,
    ) -> String {
        let t = Token {
            rv,
            after,
            expires: now_unix() + self.ttl.as_secs(),
            seen,
            total,
        };
        encode(&self.current(), binding, &t)
    }

    /// How long ago a token was issued (by this configuration's lifetime).
    pub fn age(&self, t: &Token) -> Duration {
        let issued = t.expires.saturating_sub(self.ttl.as_secs());
        Duration::from_secs(now_unix().saturating_sub(issued))
    }

    pub fn verify(&self, binding: &Binding, s: &str) -> Result<Token, TokenError> {
        decode(&self.current(), binding, s)
    }
}

fn read(p: &Path) -> Result<KeySet, KeyFileError> {
    let text = std::fs::read_to_string(p).map_err(|source| KeyFileError::Read {
        path: p.to_path_buf(),
        source,
    })?;
    KeySet::parse(&text).map_err(|source| KeyFileError::Parse {
        path: p.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys() -> KeySet {
        KeySet::parse(&format!(
            "# current first\nk2 {}\nk1 {}\n",
            base64::engine::general_purpose::STANDARD.encode([7u8; 32]),
            base64::engine::general_purpose::STANDARD.encode([9u8; 40]),
        ))
        .unwrap()
    }

    fn binding(parts: &[&str]) -> Binding {
        Binding::new(&parts.iter().map(|p| p.as_bytes()).collect::<Vec<_>>())
    }

    fn token() -> Token {
        Token {
            rv: 12345,
            after: ObjectKey::new("ns-1", "cm-007"),
            expires: 2_000_000_000,
            seen: 7,
            total: 300,
        }
    }

    #[test]
    fn round_trips_and_is_url_safe() {
        let (k, b) = (
            keys(),
            binding(&["t", "id", "", "v1", "configmaps", "ns-1", "", ""]),
        );
        let s = encode(&k, &b, &token());
        assert!(s.starts_with("k1.k2."));
        assert!(
            s.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c)),
            "{s}"
        );
        assert_eq!(decode_at(&k, &b, &s, 1_000), Ok(token()));
    }

    #[test]
    fn expired_only_after_verification() {
        let (k, b) = (keys(), binding(&["a"]));
        let s = encode(&k, &b, &token());
        assert_eq!(
            decode_at(&k, &b, &s, 2_000_000_001),
            Err(TokenError::Expired)
        );
        // Another binding: invalid, not expired (expiry is not disclosed to others).
        assert_eq!(
            decode_at(&k, &binding(&["b"]), &s, 2_000_000_001),
            Err(TokenError::Invalid)
        );
    }

    #[test]
    fn apiserver_tokens_are_foreign() {
        let (k, b) = (keys(), binding(&["a"]));
        assert_eq!(
            decode_at(
                &k,
                &b,
                "eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MTIsInN0YXJ0IjoiYVx1MDAwMCJ9",
                0
            ),
            Err(TokenError::Foreign)
        );
        assert_eq!(decode_at(&k, &b, "", 0), Err(TokenError::Foreign));
        assert_eq!(decode_at(&k, &b, "k1.", 0), Err(TokenError::Invalid));
        assert_eq!(decode_at(&k, &b, "k1.k2.", 0), Err(TokenError::Invalid));
        assert_eq!(
            decode_at(&k, &b, "k1.nokey.AAAA", 0),
            Err(TokenError::Invalid)
        );
    }

    #[test]
    fn rotation_accepts_previous_keys_and_signs_with_the_current() {
        let b = binding(&["a"]);
        let old = KeySet::parse(&format!(
            "k1 {}",
            base64::engine::general_purpose::STANDARD.encode([9u8; 40])
        ))
        .unwrap();
        let s = encode(&old, &b, &token());
        // After rotation (k2 current, k1 previous) the old token still verifies.
        assert_eq!(decode_at(&keys(), &b, &s, 0), Ok(token()));
        // Once k1 is dropped it no longer does.
        let only_new = KeySet {
            current: keys().current,
            previous: vec![],
        };
        assert_eq!(decode_at(&only_new, &b, &s, 0), Err(TokenError::Invalid));
    }

    #[test]
    fn key_file_errors_are_clear() {
        assert!(
            KeySet::parse("")
                .unwrap_err()
                .to_string()
                .contains("no keys")
        );
        assert!(
            KeySet::parse("k1 c2hvcnQ=")
                .unwrap_err()
                .to_string()
                .contains("at least 32")
        );
        assert!(
            KeySet::parse("k1 !!!")
                .unwrap_err()
                .to_string()
                .contains("base64")
        );
        assert!(
            KeySet::parse("k1")
                .unwrap_err()
                .to_string()
                .contains("expected")
        );
        let s = base64::engine::general_purpose::STANDARD.encode([1u8; 32]);
        assert!(
            KeySet::parse(&format!("a {s}\na {s}"))
                .unwrap_err()
                .to_string()
                .contains("duplicate")
        );
        assert!(
            KeySet::parse(&format!("bad/id {s}"))
                .unwrap_err()
                .to_string()
                .contains("key id")
        );
    }

    #[test]
    fn key_file_reload_keeps_keys_when_the_file_breaks() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys");
        let s1 = base64::engine::general_purpose::STANDARD.encode([1u8; 32]);
        let s2 = base64::engine::general_purpose::STANDARD.encode([2u8; 32]);
        std::fs::write(&p, format!("a {s1}\n")).unwrap();
        let k = Keys::load(Some(&p), Duration::from_secs(60)).unwrap();
        assert_eq!(k.current().current.id, "a");
        std::fs::write(&p, format!("b {s2}\na {s1}\n")).unwrap();
        assert!(k.reload());
        assert_eq!(k.current().current.id, "b");
        assert_eq!(k.current().previous.len(), 1);
        std::fs::write(&p, "garbage").unwrap();
        assert!(!k.reload());
        assert_eq!(k.current().current.id, "b");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every single-bit flip of a token is rejected.
        #[test]
        fn every_bit_flip_is_rejected(
            rv in any::<u64>(),
            ns in "[a-z0-9-]{0,20}",
            name in "[a-z0-9.-]{1,40}",
        ) {
            let (k, b) = (keys(), binding(&["tenant", "identity", "configmaps"]));
            let t = Token { rv, after: ObjectKey::new(&ns, &name), expires: u64::MAX, seen: 3, total: 9 };
            let s = encode(&k, &b, &t);
            prop_assert_eq!(decode_at(&k, &b, &s, 0), Ok(t));
            let bytes = s.as_bytes();
            for i in 0..bytes.len() {
                for bit in 0..8 {
                    let mut f = bytes.to_vec();
                    f[i] ^= 1 << bit;
                    if let Ok(f) = std::str::from_utf8(&f) {
                        prop_assert!(decode_at(&k, &b, f, 0).is_err(), "flip {i}:{bit} accepted: {f}");
                    }
                }
            }
        }

        /// A token presented under any other binding (identity, tenant, resource, namespace,
        /// selectors) is rejected.
        #[test]
        fn other_bindings_are_rejected(
            parts in proptest::collection::vec("[a-z=,!]{0,6}", 6),
            which in 0usize..6,
            other in "[a-z=,!]{0,6}",
        ) {
            prop_assume!(parts[which] != other);
            let k = keys();
            let b = binding(&parts.iter().map(String::as_str).collect::<Vec<_>>());
            let mut changed = parts.clone();
            changed[which] = other;
            let b2 = binding(&changed.iter().map(String::as_str).collect::<Vec<_>>());
            let s = encode(&k, &b, &token());
            prop_assert_eq!(decode_at(&k, &b2, &s, 0), Err(TokenError::Invalid));
        }
    }

    #[test]
    fn binding_parts_are_length_prefixed() {
        // ("ab", "c") and ("a", "bc") must not collide.
        assert_ne!(binding(&["ab", "c"]), binding(&["a", "bc"]));
    }
}
