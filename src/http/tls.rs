//! Server-side TLS: rustls with ALPN h2 + http/1.1, certificate hot reload, optional mTLS.
//!
//! The serving certificate is held by [`ReloadingCert`], a `ResolvesServerCert` whose key
//! pair is swapped in place when the files change, so rotation needs no restart and no new
//! listener; connections already established keep the certificate they negotiated.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;

use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: no PEM certificate found")]
    NoCertificate { path: PathBuf },
    #[error("{path}: no usable PEM private key: {detail}")]
    BadKey { path: PathBuf, detail: String },
    #[error("certificate and key do not form a usable pair: {0}")]
    Pair(#[source] rustls::Error),
    #[error("client CA bundle {path}: {detail}")]
    ClientCa { path: PathBuf, detail: String },
}

/// Installs the aws-lc-rs crypto provider as the process default (docs/architecture.md:
/// faster AES-GCM than *ring*'s, and post-quantum key exchange). The `kube` crate and our
/// listener both build rustls configs from the default provider; with more than one provider
/// compiled in and none installed, rustls panics at the first handshake.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

fn load_certified_key(
    cert_path: &Path,
    key_path: &Path,
) -> Result<(CertifiedKey, [u8; 32]), TlsError> {
    let cert_pem = read(cert_path)?;
    let key_pem = read(key_path)?;
    let digest: [u8; 32] = Sha256::new()
        .chain_update(&cert_pem)
        .chain_update(&key_pem)
        .finalize()
        .into();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert_path.to_owned(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::BadKey {
        path: key_path.to_owned(),
        detail: e.to_string(),
    })?;
    let provider = rustls::crypto::aws_lc_rs::default_provider();
    let ck = CertifiedKey::from_der(certs, key, &provider).map_err(TlsError::Pair)?;
    Ok((ck, digest))
}

/// The serving certificate, re-read from its files when they change.
#[derive(Debug)]
pub struct ReloadingCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<(Arc<CertifiedKey>, [u8; 32])>,
}

impl ReloadingCert {
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Arc<ReloadingCert>, TlsError> {
        let (ck, digest) = load_certified_key(cert_path, key_path)?;
        Ok(Arc::new(ReloadingCert {
            cert_path: cert_path.to_owned(),
            key_path: key_path.to_owned(),
            current: RwLock::new((Arc::new(ck), digest)),
        }))
    }

    /// Re-reads the files; swaps the key pair if they changed and form a valid pair.
    /// Returns `Ok(true)` when a new certificate was installed. A broken intermediate state
    /// (certificate written, key not yet) is reported and the old pair kept.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let (ck, digest) = load_certified_key(&self.cert_path, &self.key_path)?;
        let mut cur = self.current.write();
        if cur.1 == digest {
            return Ok(false);
        }
        *cur = (Arc::new(ck), digest);
        Ok(true)
    }

    /// Polls the files every `interval` until the process ends.
    pub fn spawn_reloader(self: &Arc<Self>, interval: Duration) {
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(this) = this.upgrade() else { return };
                match this.reload() {
                    Ok(true) => {
                        tracing::info!(cert = %this.cert_path.display(), "serving certificate reloaded")
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "serving certificate not reloaded; keeping the previous one")
                    }
                }
            }
        });
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.read().0.clone())
    }
}

/// Reads a client CA bundle: at least one PEM certificate, each usable as a trust anchor.
/// The listener's check, also run by `check-config`.
pub fn client_ca_roots(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let pem = read(path)?;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem) {
        let c = c.map_err(|e| TlsError::ClientCa {
            path: path.to_owned(),
            detail: e.to_string(),
        })?;
        roots.add(c).map_err(|e| TlsError::ClientCa {
            path: path.to_owned(),
            detail: e.to_string(),
        })?;
    }
    if roots.is_empty() {
        return Err(TlsError::ClientCa {
            path: path.to_owned(),
            detail: "no certificates".into(),
        });
    }
    Ok(roots)
}

/// Builds the listener's rustls config: ALPN h2 then http/1.1, and, with a client CA,
/// optional client-certificate verification (callers without one use bearer tokens).
pub fn server_config(
    cert: Arc<ReloadingCert>,
    client_ca: Option<&Path>,
) -> Result<rustls::ServerConfig, TlsError> {
    let mut provider = rustls::crypto::aws_lc_rs::default_provider();
    // AES-128-GCM first, chosen by the server (Go's TLS, and so kube-apiserver, prefers it
    // on hardware with AES instructions): a third cheaper per byte than AES-256-GCM, which
    // rustls clients list first; large list pages are bound by encryption.
    provider.cipher_suites.sort_by_key(|s| {
        !matches!(
            s.suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
                | rustls::CipherSuite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
        )
    });
    let provider = Arc::new(provider);
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Pair)?;
    let builder = match client_ca {
        Some(path) => {
            let roots = client_ca_roots(path)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| TlsError::ClientCa {
                    path: path.to_owned(),
                    detail: e.to_string(),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut cfg = builder.with_cert_resolver(cert);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    cfg.ignore_client_order = true;
    Ok(cfg)
}

/// A fresh CA and a serving certificate it signed, for `names` (DNS names or IP literals),
/// all as PEM: `(ca_cert, cert, key)`. For `dev` mode and tests; production certificates
/// come from the operator (Secret, cert-manager).
#[cfg(any(test, feature = "dev"))]
pub fn generate_serving_pair(names: &[&str]) -> Result<(String, String, String), rcgen::Error> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "kube-cache-proxy-dev-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key)?;
    let issuer = rcgen::Issuer::new(ca, ca_key);
    let key = KeyPair::generate()?;
    let mut params =
        CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
    params
        .distinguished_name
        .push(DnType::CommonName, "kube-cache-proxy");
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer)?;
    Ok((ca_cert.pem(), cert.pem(), key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that lists AES-256-GCM first (rustls' default) still gets AES-128-GCM.
    #[test]
    fn the_server_picks_aes_128_gcm() {
        install_crypto_provider();
        let dir = tempfile::tempdir().unwrap();
        let (ca, cert, key) = generate_serving_pair(&["localhost"]).unwrap();
        std::fs::write(dir.path().join("c"), cert).unwrap();
        std::fs::write(dir.path().join("k"), key).unwrap();
        let resolver = ReloadingCert::load(&dir.path().join("c"), &dir.path().join("k")).unwrap();
        let server_cfg = Arc::new(server_config(resolver, None).unwrap());
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let client_cfg = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        assert_eq!(
            client_cfg.crypto_provider().cipher_suites[0].suite(),
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
            "the client prefers AES-256"
        );
        let mut client =
            rustls::ClientConnection::new(Arc::new(client_cfg), "localhost".try_into().unwrap())
                .unwrap();
        let mut server = rustls::ServerConnection::new(server_cfg).unwrap();
        for _ in 0..10 {
            let mut buf = Vec::new();
            client.write_tls(&mut buf).unwrap();
            server.read_tls(&mut &buf[..]).unwrap();
            server.process_new_packets().unwrap();
            let mut buf = Vec::new();
            server.write_tls(&mut buf).unwrap();
            client.read_tls(&mut &buf[..]).unwrap();
            client.process_new_packets().unwrap();
            if !client.is_handshaking() && !server.is_handshaking() {
                break;
            }
        }
        assert!(!client.is_handshaking());
        assert_eq!(
            client.negotiated_cipher_suite().unwrap().suite(),
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
        );
    }
}
