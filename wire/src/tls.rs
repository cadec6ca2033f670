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

/// Certificates kvferry's HTTP clients trust beyond the system's ([`trust`]).
fn trusted() -> &'static Mutex<Vec<reqwest::Certificate>> {
    static TRUSTED: Mutex<Vec<reqwest::Certificate>> = Mutex::new(Vec::new());
    &TRUSTED
}

/// Makes every HTTP client this process builds from now on trust the certificates in `ca`
/// (PEM; a private CA that signed the ports' certificates, or the certificates themselves).
pub fn trust(ca: &Path) -> Result<(), TlsError> {
    let certs = certificates("CA", ca)?;
    let mut trusted = trusted().lock().unwrap_or_else(|e| e.into_inner());
    for cert in certs {
        let cert = reqwest::Certificate::from_der(&cert).map_err(|e| TlsError::File {
            what: "CA",
            path: ca.display().to_string(),
            why: e.to_string(),
        })?;
        trusted.push(cert);
    }
    Ok(())
}

/// `builder` with the process's crypto installed and the certificates of [`trust`] added.
pub(crate) fn client(builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
    provider();
    let trusted = trusted().lock().unwrap_or_else(|e| e.into_inner());
    builder.tls_certs_merge(trusted.iter().cloned())
}

/// Certificates for tests: a CA and one certificate it signed.
#[cfg(any(test, feature = "test-certificates"))]
pub mod testing {
    use std::path::{Path, PathBuf};

    /// The PEM files [`certificates_in`] wrote.
    pub struct Files {
        /// The CA's certificate (what clients trust: `--tls-ca`).
        pub ca: PathBuf,
        /// A certificate the CA signed for the names given (`--tls-cert`).
        pub cert: PathBuf,
        /// Its private key (`--tls-key`).
        pub key: PathBuf,
    }

    /// Writes a fresh CA and a certificate it signed for `names` (IP addresses or host names)
    /// into `dir`.
    pub fn certificates_in(dir: &Path, names: &[&str]) -> Files {
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let ca = rcgen::CertifiedIssuer::self_signed(ca, ca_key).expect("CA");
        let key = rcgen::KeyPair::generate().expect("key");
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let cert = rcgen::CertificateParams::new(names)
            .expect("params")
            .signed_by(&key, &ca)
            .expect("certificate");
        let files = Files {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        };
        std::fs::write(&files.ca, ca.pem()).expect("write");
        std::fs::write(&files.cert, cert.pem()).expect("write");
        std::fs::write(&files.key, key.serialize_pem()).expect("write");
        files
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::{Proof, serve};
    use axum::routing::get;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::{TcpListener, TcpStream};
    use tokio_util::sync::CancellationToken;

    const TOKEN: &str = "bearer-token-on-the-path";

    /// A fresh directory, removed when dropped.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new() -> Scratch {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!("kvferry-tls-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).expect("dir");
            Scratch(dir)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn certificates_in(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
        let files = testing::certificates_in(dir, &["127.0.0.1"]);
        (files.ca, files.cert, files.key)
    }

    /// Forwards one connection from its listener to `to`, keeping what the client sent: what a
    /// reader on the path sees.
    async fn on_the_path(listener: TcpListener, to: std::net::SocketAddr) -> Vec<u8> {
        let (mut client, _) = listener.accept().await.expect("accept");
        let mut server = TcpStream::connect(to).await.expect("connect");
        let (mut client_rx, mut client_tx) = client.split();
        let (mut server_rx, mut server_tx) = server.split();
        let mut seen = Vec::new();
        let upstream = async {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = client_rx.read(&mut buf).await {
                seen.extend_from_slice(&buf[..n]);
                if server_tx.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = server_tx.shutdown().await;
        };
        let downstream = async {
            let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
            let _ = client_tx.shutdown().await;
        };
        tokio::join!(upstream, downstream);
        seen
    }

    /// A port answering `GET /x` with "answered", served with `tls` until the token is
    /// cancelled: its address.
    async fn port(tls: Option<ServerTls>, shutdown: &CancellationToken) -> std::net::SocketAddr {
        let app = axum::Router::new().route("/x", get(|| async { "answered" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let served = serve(listener, app, shutdown.clone(), "test", Proof::Request, tls);
        tokio::spawn(served);
        addr
    }

    /// What a GET with the bearer token through a reader on the path answers, and what the
    /// reader saw, against a port served with `tls`.
    async fn through_the_path(tls: Option<ServerTls>, scheme: &str) -> (String, Vec<u8>) {
        let shutdown = CancellationToken::new();
        let server_addr = port(tls, &shutdown).await;
        let path = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let path_addr = path.local_addr().expect("address");
        let reader = tokio::spawn(on_the_path(path, server_addr));
        let http = crate::http::client().build().expect("client");
        let answer = http
            .get(format!("{scheme}://{path_addr}/x"))
            .bearer_auth(TOKEN)
            .header(reqwest::header::CONNECTION, "close")
            .send()
            .await
            .expect("answer");
        let body = answer.text().await.expect("body");
        drop(http);
        let seen = tokio::time::timeout(std::time::Duration::from_secs(60), reader)
            .await
            .expect("the connection closed")
            .expect("reader");
        shutdown.cancel();
        (body, seen)
    }

    fn holds(seen: &[u8], needle: &str) -> bool {
        seen.windows(needle.len()).any(|w| w == needle.as_bytes())
    }

    #[tokio::test]
    async fn over_https_a_reader_on_the_path_never_sees_the_bearer_token() {
        let dir = Scratch::new();
        let (ca, cert, key) = certificates_in(dir.path());
        // Control: over plain HTTP the reader sees the token.
        let (body, seen) = through_the_path(None, "http").await;
        assert_eq!(body, "answered");
        assert!(holds(&seen, TOKEN), "plain HTTP carries the token in clear");
        trust(&ca).expect("trust");
        let tls = ServerTls::load(&cert, &key).expect("load");
        let (body, seen) = through_the_path(Some(tls), "https").await;
        assert_eq!(body, "answered");
        assert!(
            seen.len() > 100,
            "the request went through the path ({} bytes)",
            seen.len()
        );
        assert!(!holds(&seen, TOKEN), "the token crossed the path in clear");
        assert!(
            !holds(&seen, "Bearer"),
            "the request head crossed the path in clear"
        );
        println!(
            "over https the path saw {} bytes, none of them the token",
            seen.len()
        );
    }

    #[tokio::test]
    async fn an_https_port_answers_no_plain_request_and_an_untrusted_certificate_is_refused() {
        let dir = Scratch::new();
        let (_, cert, key) = certificates_in(dir.path());
        let shutdown = CancellationToken::new();
        let tls = ServerTls::load(&cert, &key).expect("load");
        let addr = port(Some(tls), &shutdown).await;
        // A plain request is never answered as HTTP.
        let mut plain = TcpStream::connect(addr).await.expect("connect");
        plain
            .write_all(b"GET /x HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        let mut answer = Vec::new();
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(60),
            plain.read_to_end(&mut answer),
        );
        assert!(
            read.await.is_ok(),
            "the plain connection was neither answered nor closed"
        );
        assert!(!holds(&answer, "answered"), "a plain request was served");
        // A client that trusts another CA refuses the port's certificate.
        let other = Scratch::new();
        let (other_ca, _, _) = certificates_in(other.path());
        let pem = std::fs::read(&other_ca).expect("read");
        provider();
        #[allow(clippy::disallowed_methods)] // a client that trusts only another CA
        let strict = reqwest::Client::builder()
            .no_proxy()
            .tls_certs_only(reqwest::Certificate::from_pem_bundle(&pem).expect("pem"))
            .build()
            .expect("client");
        let refused = strict.get(format!("https://{addr}/x")).send().await;
        let e = refused.expect_err("an untrusted certificate was accepted");
        println!("untrusted certificate: {e:?}");
        shutdown.cancel();
    }

    #[test]
    fn unusable_files_are_named_with_what_is_wrong() {
        let dir = Scratch::new();
        let (ca, cert, key) = certificates_in(dir.path());
        let missing = dir.path().join("missing.pem");
        let e = ServerTls::load(&missing, &key).expect_err("missing");
        assert!(e.to_string().starts_with("certificate "), "{e}");
        assert!(e.to_string().contains("missing.pem"), "{e}");
        let e = ServerTls::load(&cert, &cert).expect_err("a certificate is no key");
        assert!(e.to_string().starts_with("key "), "{e}");
        let e = trust(&key).expect_err("a key is no CA");
        assert!(e.to_string().contains("no PEM certificate"), "{e}");
        // A key that is not the certificate's.
        let other = Scratch::new();
        let (_, _, other_key) = certificates_in(other.path());
        let e = ServerTls::load(&cert, &other_key).expect_err("mismatched");
        assert!(e.to_string().contains("with key"), "{e}");
        trust(&ca).expect("a CA is trusted");
    }
}
