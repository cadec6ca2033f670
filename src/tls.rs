//! The TLS options every kvferry process with an HTTP port or an HTTP client takes (registry,
//! agents, proxy): the port's certificate and key, and the certificates its clients trust.
//! The serving and the trust themselves are `kvferry_wire::tls`; what needs TLS (a token
//! beyond loopback) is [`crate::exposure`].

use std::path::PathBuf;

use anyhow::Context as _;
use kvferry_wire::tls::ServerTls;

/// `--tls-cert`, `--tls-key`, `--tls-ca`: a process with an HTTP port and HTTP clients.
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsOptions {
    /// Serve this process's HTTP port over HTTPS only, with this certificate chain (PEM, the
    /// port's own certificate first, naming the address clients use). Needs --tls-key.
    #[arg(
        long,
        env = "KVFERRY_TLS_CERT",
        value_name = "PEM",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(
        long,
        env = "KVFERRY_TLS_KEY",
        value_name = "PEM",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// --tls-ca.
    #[command(flatten)]
    pub trust: TlsTrust,
}

/// `--tls-ca`: a process with HTTP clients only (`kvferry bench`).
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsTrust {
    /// Certificates this process's HTTPS clients trust beside the system's (PEM: the private
    /// CA that signed the registry's and agents' certificates).
    #[arg(long, env = "KVFERRY_TLS_CA", value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsTrust {
    /// Trusts --tls-ca for every HTTP client of the process.
    pub fn load(&self) -> anyhow::Result<()> {
        if let Some(ca) = &self.tls_ca {
            kvferry_wire::tls::trust(ca).context("--tls-ca")?;
        }
        Ok(())
    }
}

impl TlsOptions {
    /// Whether the port is served over HTTPS.
    pub fn serves(&self) -> bool {
        self.tls_cert.is_some()
    }

    /// Trusts --tls-ca for every HTTP client of the process, and loads the port's certificate
    /// and key (`None`: plain HTTP).
    pub fn load(&self) -> anyhow::Result<Option<ServerTls>> {
        self.trust.load()?;
        // Both or neither: each flag requires the other.
        let pair = self.tls_cert.as_ref().zip(self.tls_key.as_ref());
        pair.map(|(cert, key)| ServerTls::load(cert, key).context("--tls-cert and --tls-key"))
            .transpose()
    }
}
