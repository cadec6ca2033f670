//! `kvferry proxy`: the OpenAI-compatible router in front of prefill and decode vLLM servers
//! running `KvferryConnector` (`src/proxy`, docs/vllm.md). Checks every server once, then
//! prints one JSON listening line on stdout, like every role, and serves until SIGINT or
//! SIGTERM.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::proxy::{Backends, Pairing, Proxy, ProxyMetrics, router};

/// Route OpenAI requests to prefill and decode vLLM servers that move KV through kvferry.
#[derive(Debug, clap::Args)]
pub struct ProxyArgs {
    /// Prefill servers' base URLs, comma-separated (with --bootstrap, servers found in the
    /// registry join them).
    #[arg(
        long,
        env = "KVFERRY_PROXY_PREFILL",
        value_delimiter = ',',
        required_unless_present = "bootstrap"
    )]
    prefill: Vec<String>,
    /// Decode servers' base URLs, comma-separated (with --bootstrap, servers found in the
    /// registry join them).
    #[arg(
        long,
        env = "KVFERRY_PROXY_DECODE",
        value_delimiter = ',',
        required_unless_present = "bootstrap"
    )]
    decode: Vec<String>,
    /// The registry the servers' agents register in (a URL, or replicas comma-separated): each
    /// health round adds the engine servers their registrations name (the vLLM connector
    /// registers its server's URL), drops the found ones no rank names any more, sends no new
    /// requests to a server whose agents say it drains, and pairs a prefill server only with
    /// decode servers that can take its KV (same model, KV layout and protocol versions).
    #[arg(long, env = "KVFERRY_PROXY_BOOTSTRAP")]
    bootstrap: Option<String>,
    /// The registry's token, when it has one (the agents' --token).
    #[arg(long, env = "KVFERRY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Address to listen on.
    #[arg(long, env = "KVFERRY_PROXY_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the listening line tells which).
    #[arg(long, env = "KVFERRY_PROXY_PORT", default_value_t = 8000)]
    port: u16,
    /// Port of the metrics port on --host: /metrics, /livez and /readyz (ready while a prefill
    /// and a decode server are usable), read-only, plain HTTP, no key; keep it reachable by
    /// the scraper and the kubelet only (0 picks a free one; the listening line tells which).
    /// Without it, none.
    #[arg(long, env = "KVFERRY_PROXY_METRICS_PORT")]
    metrics_port: Option<u16>,
    /// first-token: the prefill first, its first token to the client at once, the decode
    /// continuing from it; sequential: the prefill first, its kv_transfer_params into the
    /// decode request; concurrent: both requests at once, the proxy names the room.
    #[arg(long, env = "KVFERRY_PROXY_PAIRING", value_enum, default_value_t = Pairing::FirstToken)]
    pairing: Pairing,
    /// Prompts shorter than this many tokens (text: bytes) go to one decode server, which
    /// answers them alone: for short prompts disaggregation costs more than it saves. 0: none.
    /// Set it from the prompt length where your own runs stop gaining (docs/benchmarks.md).
    #[arg(long, env = "KVFERRY_PROXY_SHORT_BELOW_TOKENS", default_value_t = 384)]
    short_below_tokens: usize,
    /// Period of the servers' /health checks, in ms.
    #[arg(long, env = "KVFERRY_PROXY_HEALTH_MS", default_value_t = 1000)]
    health_ms: u64,
    /// A server that does not answer a health check within this many ms is routed around
    /// until it does.
    #[arg(long, env = "KVFERRY_PROXY_HEALTH_TIMEOUT_MS", default_value_t = 5000)]
    health_timeout_ms: u64,
    /// Key that clients must present (Authorization: Bearer KEY) on /v1/completions,
    /// /v1/chat/completions and /v1/models: any other request to them is answered 401 and
    /// reaches no server (/health and /metrics stay open). The same key goes on the proxy's own
    /// calls, made by its health rounds only (health checks, kvferry_identify), for servers
    /// started with --api-key. A client's request, and the kvferry_reason_of question asked
    /// about its room (after a failure, or after a decode's streamed answer began), carry the
    /// client's own Authorization header: the proxy never adds its key to them.
    #[arg(long, env = "KVFERRY_PROXY_API_KEY", hide_env_values = true)]
    api_key: Option<String>,

    /// Check --api-key over plain HTTP on a non-loopback --host, send it to plain http://
    /// servers beyond loopback, or send --token to a plain http:// --bootstrap beyond loopback
    /// (warns at start). Only for networks where every host on the path is trusted.
    #[arg(long, env = "KVFERRY_INSECURE", value_parser = clap::builder::BoolishValueParser::new())]
    insecure: bool,

    /// HTTPS for the proxy's port (--tls-cert, --tls-key) and the certificates of the servers
    /// and registries it calls (--tls-ca).
    #[command(flatten)]
    tls: crate::tls::TlsOptions,
}

impl ProxyArgs {
    /// Refuses a key or token that would cross the network in clear, unless `insecure`.
    fn check(&self, insecure: bool) -> Result<(), crate::exposure::InClear> {
        let key = self.api_key.is_some();
        let host = ("--host", self.host.as_str());
        crate::exposure::check_clear(host, key, self.tls.serves(), insecure)?;
        for url in self.bootstrap.iter().flat_map(|urls| urls.split(',')) {
            let url = ("--bootstrap", url.trim());
            crate::exposure::check_clear_url(url, self.token.is_some(), insecure)?;
        }
        // The key also goes on the proxy's own calls to the servers.
        for (flag, urls) in [("--prefill", &self.prefill), ("--decode", &self.decode)] {
            for url in urls {
                crate::exposure::check_clear_url((flag, url), key, insecure)?;
            }
        }
        Ok(())
    }
}

pub(crate) fn run(args: ProxyArgs) -> anyhow::Result<()> {
    args.check(args.insecure)?;
    if let Err(e) = args.check(false) {
        tracing::warn!("--insecure: {e}");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: ProxyArgs) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let signals = super::signal::on_signal(shutdown.clone());
    let tls = args.tls.load()?;
    let http = kvferry_wire::http::client()
        .build()
        .context("building the HTTP client")?;
    // In concurrent pairing a prefill server is used once it said its kvferry group.
    let concurrent = args.pairing == Pairing::Concurrent;
    let key = args.api_key.clone();
    let proxy = Arc::new(Proxy {
        prefills: Arc::new(
            Backends::new(&args.prefill, concurrent, key.clone()).in_clear_refused(!args.insecure),
        ),
        decodes: Arc::new(
            Backends::new(&args.decode, false, key.clone()).in_clear_refused(!args.insecure),
        ),
        pairing: args.pairing,
        http: http.clone(),
        metrics: ProxyMetrics::default(),
        api_key: key,
        registry: match &args.bootstrap {
            Some(urls) => Some(crate::proxy::registry_client(urls, args.token.clone())?),
            None => None,
        },
        health_timeout: Duration::from_millis(args.health_timeout_ms.max(1)),
        short_below: args.short_below_tokens,
    });
    let period = Duration::from_millis(args.health_ms.max(1));
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let metrics = super::metrics_port(&args.host, args.metrics_port).await?;
    // One round (the registry read, health checks and kvferry_identify) before the listening
    // line: a request that comes right after it finds the servers that were up.
    proxy.first_round().await;
    let watcher = tokio::spawn(proxy.clone().watch(period));
    let local = listener.local_addr()?;
    let url = crate::exposure::url_of(local, crate::exposure::loopback_of(local), tls.is_some());
    let mut line = json!({"event": "listening", "role": "proxy", "url": url});
    let metrics_port = match metrics {
        Some((listener, url)) => {
            line["metrics"] = url.into();
            let serve =
                kvferry_wire::metrics_port::serve(listener, proxy.clone(), shutdown.clone());
            Some(tokio::spawn(serve))
        }
        None => None,
    };
    {
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{line}")?;
        stdout.flush()?;
    }
    tracing::info!(%url, pairing = ?args.pairing, "proxy listening");
    let served = kvferry_wire::http::serve(
        listener,
        router(proxy),
        shutdown,
        "proxy",
        kvferry_wire::http::Proof::Request,
        tls,
    )
    .await;
    signals.abort();
    watcher.abort();
    if let Some(port) = metrics_port {
        port.await
            .context("the metrics port")?
            .context("serving the metrics port")?;
    }
    served.context("serving")
}
