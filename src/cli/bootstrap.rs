//! `kvferry bootstrap`: serves the bootstrap registry (crate `kvferry-bootstrap`) until SIGINT
//! or SIGTERM, then shuts down gracefully and exits 0.
//!
//! Once listening it prints exactly one JSON line on stdout,
//! `{"event":"listening","role":"bootstrap","url":"http://HOST:PORT","store":"memory"}` (with
//! `"metrics":"http://HOST:PORT"` when it serves a metrics port), so a script that started it
//! with `--port 0` learns the port. Logs go to stderr.
//!
//! `--store etcd://H:P[,H:P...]` keeps the registry's state in etcd: any number of these
//! processes on the same etcd cluster serve one view (docs/operations.md).

use std::io::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use kvferry_bootstrap::{ServerConfig, StoreConfig, serve};
use tokio_util::sync::CancellationToken;

/// Serve the bootstrap registry that pairs prefill and decode ranks.
#[derive(Debug, clap::Args)]
pub struct BootstrapArgs {
    /// Address to listen on. Any address but a loopback one (0.0.0.0 and :: included) needs
    /// --token, or --insecure. The listening line names a wildcard bind at loopback.
    #[arg(long, env = "KVFERRY_BOOTSTRAP_HOST", default_value = "127.0.0.1")]
    host: String,

    /// Port to listen on (0 picks a free one; the listening line on stdout tells which).
    #[arg(long, env = "KVFERRY_BOOTSTRAP_PORT", default_value_t = kvferry_bootstrap::DEFAULT_PORT)]
    port: u16,

    /// Port of the metrics port on --host: /metrics, /livez and /readyz (ready while the store
    /// answers), read-only, plain HTTP, no token; keep it reachable by the scraper and the
    /// kubelet only (0 picks a free one; the listening line tells which). Without it, none.
    #[arg(long, env = "KVFERRY_BOOTSTRAP_METRICS_PORT")]
    metrics_port: Option<u16>,

    /// Lease length in milliseconds: a rank not renewed within it disappears from lookups.
    #[arg(long, env = "KVFERRY_LEASE_TTL_MS", default_value_t = 10_000)]
    lease_ttl_ms: u64,

    /// When set, every route but /healthz (registrations, lookups, the rank list, /metrics)
    /// needs `Authorization: Bearer TOKEN`.
    #[arg(long, env = "KVFERRY_BOOTSTRAP_TOKEN", hide_env_values = true)]
    token: Option<String>,

    /// Where the registry keeps its state: `memory` (this process only) or
    /// `etcd://HOST:PORT[,HOST:PORT...]` (the client URLs of an etcd v3 cluster; every registry
    /// replica started on the same cluster serves the same registrations, and leases are etcd
    /// leases of --lease-ttl-ms rounded up to whole seconds).
    #[arg(long, env = "KVFERRY_BOOTSTRAP_STORE", default_value = "memory")]
    store: StoreConfig,

    /// Serve a non-loopback --host without --token, or with --token over plain HTTP (warns at
    /// start). Only for networks where every host that can reach the registry is trusted.
    #[arg(long, env = "KVFERRY_INSECURE", value_parser = clap::builder::BoolishValueParser::new())]
    insecure: bool,

    #[command(flatten)]
    tls: crate::tls::TlsOptions,
}

/// Why the arguments cannot be served.
#[derive(Debug, thiserror::Error)]
enum ArgsError {
    #[error("--lease-ttl-ms must be > 0")]
    ZeroLeaseTtl,
    #[error(
        "--lease-ttl-ms {0} is below 2000, the shortest lease etcd grants: with --store etcd the \
         registry would announce leases shorter than etcd keeps them"
    )]
    EtcdLeaseTooShort(u64),
    #[error("--token must not be empty (omit it to disable authentication)")]
    EmptyToken,
    #[error(transparent)]
    Exposed(#[from] crate::exposure::NotLoopback),
    #[error(transparent)]
    InClear(#[from] crate::exposure::InClear),
}

impl BootstrapArgs {
    fn validate(&self) -> Result<(), ArgsError> {
        if self.lease_ttl_ms == 0 {
            return Err(ArgsError::ZeroLeaseTtl);
        }
        if matches!(self.store, StoreConfig::Etcd { .. }) && self.lease_ttl_ms < 2000 {
            return Err(ArgsError::EtcdLeaseTooShort(self.lease_ttl_ms));
        }
        if self.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            return Err(ArgsError::EmptyToken);
        }
        crate::exposure::check(&self.binds(), self.token.is_some(), self.insecure)?;
        let (token, tls) = (self.token.is_some(), self.tls.serves());
        crate::exposure::check_clear(self.binds()[0], token, tls, self.insecure)?;
        Ok(())
    }

    fn binds(&self) -> [(&'static str, &str); 1] {
        [("--host", self.host.as_str())]
    }
}

/// Serves the registry until SIGINT or SIGTERM.
pub(crate) fn run(args: BootstrapArgs) -> anyhow::Result<()> {
    args.validate()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(serve_until_signalled(args))
}

async fn serve_until_signalled(args: BootstrapArgs) -> anyhow::Result<()> {
    // Signal handlers first: a SIGTERM right after the listening line still shuts down cleanly.
    let shutdown = CancellationToken::new();
    let signals = super::signal::on_signal(shutdown.clone());
    let addr = (args.host.as_str(), args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let local = listener
        .local_addr()
        .context("reading the listening address")?;
    let metrics = super::metrics_port(&args.host, args.metrics_port).await?;
    // A wildcard bind is named at this host's loopback, an address a client can use.
    let tls = args.tls.load()?;
    let url = crate::exposure::url_of(local, crate::exposure::loopback_of(local), tls.is_some());
    let store = args.store.to_string();
    let mut line =
        serde_json::json!({"event": "listening", "role": "bootstrap", "url": url, "store": store});
    let metrics = metrics.map(|(listener, url)| {
        line["metrics"] = url.into();
        listener
    });
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{line}").context("writing the listening line to stdout")?;
        stdout.flush().context("flushing stdout")?;
    }
    tracing::info!(%url, %store, lease_ttl_ms = args.lease_ttl_ms, auth = args.token.is_some(), "bootstrap registry listening");
    let in_clear: &[&str] = if tls.is_some() { &[] } else { &["--host"] };
    crate::exposure::warn_if_insecure(&args.binds(), args.token.is_some(), in_clear);

    let config = ServerConfig {
        lease_ttl: Duration::from_millis(args.lease_ttl_ms),
        token: args.token,
        store: args.store,
        tls,
        build: Some(super::BUILD),
        ..ServerConfig::default()
    };
    let listeners = kvferry_bootstrap::Listeners {
        api: listener,
        metrics,
    };
    let served = serve(listeners, config, shutdown.clone()).await;
    signals.abort();
    served.context("serving the registry")?;
    tracing::info!("bootstrap registry stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: BootstrapArgs,
    }

    fn parse(argv: &[&str]) -> BootstrapArgs {
        Wrapper::try_parse_from(std::iter::once("kvferry").chain(argv.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn defaults_and_validation() {
        let args = parse(&[]);
        assert_eq!((args.port, args.lease_ttl_ms), (8998, 10_000));
        assert_eq!(args.metrics_port, None);
        assert_eq!(parse(&["--metrics-port", "9102"]).metrics_port, Some(9102));
        assert_eq!(args.store, StoreConfig::Memory);
        let wrapped = Wrapper::try_parse_from(["kvferry", "--store", "etcd://nohost"]);
        let err = wrapped.unwrap_err().to_string();
        assert!(err.contains("is not HOST:PORT"), "{err}");
        assert!(args.validate().is_ok());
        let err = parse(&["--lease-ttl-ms", "0"]).validate().unwrap_err();
        assert_eq!(err.to_string(), "--lease-ttl-ms must be > 0");
        assert!(parse(&["--token", " "]).validate().is_err());
        assert!(parse(&["--token", "t"]).validate().is_ok());
        let err = parse(&["--host", "0.0.0.0"]).validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "--host 0.0.0.0 is not loopback: give --token or --insecure"
        );
        // A token beyond loopback: over HTTPS, or with --insecure.
        let err = parse(&["--host", "::", "--token", "t"])
            .validate()
            .unwrap_err();
        assert!(
            err.to_string().contains("--tls-cert and --tls-key"),
            "{err}"
        );
        let https = [
            "--host",
            "::",
            "--token",
            "t",
            "--tls-cert",
            "c",
            "--tls-key",
            "k",
        ];
        assert!(parse(&https).validate().is_ok());
        assert!(
            parse(&["--host", "::", "--token", "t", "--insecure"])
                .validate()
                .is_ok()
        );
        assert!(parse(&["--host", "::", "--insecure"]).validate().is_ok());
    }

    #[cfg(feature = "etcd")]
    #[test]
    fn etcd_store_and_its_shortest_lease() {
        let etcd = parse(&["--store", "etcd://10.0.0.1:2379,10.0.0.2:2379"]).store;
        assert_eq!(etcd.to_string(), "etcd://10.0.0.1:2379,10.0.0.2:2379");
        assert!(
            parse(&["--store", "etcd://10.0.0.1:2379", "--lease-ttl-ms", "1500"])
                .validate()
                .is_err(),
            "etcd grants no lease under 2 s"
        );
        assert!(
            parse(&["--store", "etcd://10.0.0.1:2379", "--lease-ttl-ms", "2000"])
                .validate()
                .is_ok()
        );
    }

    #[cfg(not(feature = "etcd"))]
    #[test]
    fn a_build_without_etcd_refuses_the_etcd_store_naming_the_feature() {
        let wrapped = Wrapper::try_parse_from(["kvferry", "--store", "etcd://10.0.0.1:2379"]);
        let err = wrapped.unwrap_err().to_string();
        assert!(err.contains("cargo feature `etcd`"), "{err}");
    }
}
