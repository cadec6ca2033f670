//! TLS on kvferry's HTTP ports (rustls, with ring as its crypto): a port given a certificate
//! and its key serves HTTPS only ([`ServerTls`]), and kvferry's HTTP clients
//! ([`crate::http::client`]) trust the system's roots plus the certificates named by
//! [`trust`] (a private CA, `--tls-ca`).
//!
//! Where it matters: a bearer token (the cluster token on the registry and the agents' engine
//! APIs, the proxy's API key) is sent with every request, so over plain HTTP anyone on the path
//! reads it. On loopback nothing leaves the host and plain HTTP stays the default.

use std::path::Path;
use std::sync::{Arc, Mutex, Once};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Why a certificate, key or CA file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read or holds no PEM section of the kind needed.
    #[error("{what} {path}: {why}")]
    File {
        /// What the file was for ("certificate", "key", "CA").
        what: &'static str,
        /// The file as given.
        path: String,
        /// Why it could not be used.
        why: String,
    },
    /// rustls refused the certificate and key together (a key that is not the certificate's).
    #[error("certificate {cert} with key {key}: {why}")]
    Pair {
        /// The certificate file.
        cert: String,
        /// The key file.
        key: String,
        /// rustls' reason.
        why: String,
    },
}

/// The crypto every rustls configuration of the process uses, installed once as the process's
/// default (reqwest builds its client configurations from the default).
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // Another part of the process may have installed one first: then that one is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
    rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()))
}

fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let file = |why: String| TlsError::File {
        what,
        path: path.display().to_string(),
        why,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file(e.to_string()))?;
    match certs.is_empty() {
        true => Err(file("no PEM certificate in it".into())),
        false => Ok(certs),
    }
}

/// A port's TLS: its certificate chain and key, served to every connection.
#[derive(Clone)]
pub struct ServerTls(tokio_rustls::TlsAcceptor);

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

impl ServerTls {
    /// The certificate chain in `cert` (PEM, the port's own certificate first) and its private
    /// key in `key` (PEM: PKCS#8, PKCS#1 or SEC1).
    pub fn load(cert: &Path, key: &Path) -> Result<ServerTls, TlsError> {
        let chain = certificates("certificate", cert)?;
        let secret = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::File {
            what: "key",
            path: key.display().to_string(),
            why: e.to_string(),
        })?;
        let pair = |why: String| TlsError::Pair {
            cert: cert.display().to_string(),
            key: key.display().to_string(),
            why,
        };
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| pair(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, secret)
            .map_err(|e| pair(e.to_string()))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(ServerTls(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
    }

    pub(crate) fn acceptor(&self) -> &tokio_rustls::TlsAcceptor {
        &self.0
    }
}

/// Certificates kvferry's HTTP clients trust beyond the system's ([`trust`]), each once (by
/// its DER bytes).
fn trusted() -> &'static Mutex<Vec<(Vec<u8>, reqwest::Certificate)>> {
    static TRUSTED: Mutex<Vec<(Vec<u8>, reqwest::Certificate)>> = Mutex::new(Vec::new());
    &TRUSTED
}

/// Makes every HTTP client this process builds from now on trust the certificates in `ca`
/// (PEM; a private CA that signed the ports' certificates, or the certificates themselves).
pub fn trust(ca: &Path) -> Result<(), TlsError> {
    let certs = certificates("CA", ca)?;
    let mut trusted = trusted().lock().unwrap_or_else(|e| e.into_inner());
    for der in certs {
        if trusted.iter().any(|(known, _)| known[..] == der[..]) {
            continue;
        }
        let cert = reqwest::Certificate::from_der(&der).map_err(|e| TlsError::File {
            what: "CA",
            path: ca.display().to_string(),
            why: e.to_string(),
        })?;
        trusted.push((der.to_vec(), cert));
    }
    Ok(())
}

/// `builder` with the process's crypto installed and the certificates of [`trust`] added.
pub(crate) fn client(builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
    provider();
    let trusted = trusted().lock().unwrap_or_else(|e| e.into_inner());
    builder.tls_certs_merge(trusted.iter().map(|(_, cert)| cert.clone()))
}
