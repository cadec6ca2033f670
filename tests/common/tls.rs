//! Certificates for tests of HTTPS ports: a fresh CA and one certificate it signed, as the PEM
//! files `--tls-ca`, `--tls-cert` and `--tls-key` take (rcgen).

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

/// Writes a fresh CA and a certificate it signed for `names` (IP addresses or host names) into
/// `dir`.
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
    std::fs::create_dir_all(dir).expect("dir");
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
