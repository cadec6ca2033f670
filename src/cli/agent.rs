//! `kvferry prefill` and `kvferry decode`: the agents, configured by role and rank flags in the
//! SGLang spirit (their flags are [`AgentOptions`]). Both print one "listening" JSON line on stdout once they serve, register with
//! the registry and keep their lease, and on SIGINT/SIGTERM deregister and exit 0.

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use crate::agent::AgentOptions;
use crate::agent::api::print_listening;
use crate::agent::decode::DecodeAgent;
use crate::agent::prefill::PrefillAgent;

/// Which agent to run.
#[derive(Clone, Copy, Debug)]
pub(crate) enum AgentRole {
    Prefill,
    Decode,
}

/// A started agent of either role.
enum Running {
    Prefill(PrefillAgent),
    Decode(DecodeAgent),
}

/// Runs an agent until SIGINT or SIGTERM.
pub(crate) fn run(role: AgentRole, args: AgentOptions) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let in_clear: &[&str] = if args.tls.serves() {
        &[]
    } else {
        &["--api-host"]
    };
    crate::exposure::warn_if_insecure(&args.binds(), args.token.is_some(), in_clear);
    for url in args.bootstrap.split(',').map(str::trim) {
        let url = ("--bootstrap", url);
        if let Err(e) = crate::exposure::check_clear_url(url, args.token.is_some(), false) {
            tracing::warn!("--insecure: {e}");
        }
    }
    keep_large_allocations();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(async move {
        // SIGINT/SIGTERM: drain (no new rooms, in-flight ones finish or are aborted within
        // --drain-timeout-ms), then shut down, deregister and exit 0.
        let signalled = CancellationToken::new();
        let shutdown = CancellationToken::new();
        let signals = super::signal::on_signal(signalled.clone());
        let common = serde_json::json!({
            "event": "listening",
            "transport": cfg.transport.name(),
            "model": args.model,
        });
        let start = async {
            anyhow::Ok(match role {
                AgentRole::Prefill => Running::Prefill(
                    PrefillAgent::start(cfg, shutdown.clone())
                        .await
                        .context("starting the prefill agent")?,
                ),
                AgentRole::Decode => Running::Decode(
                    DecodeAgent::start(cfg, shutdown.clone())
                        .await
                        .context("starting the decode agent")?,
                ),
            })
        };
        // A signal while starting (e.g. while waiting out a predecessor's lease) stops at once:
        // no task runs yet (a registration caught in flight lapses with its lease).
        let agent = tokio::select! {
            started = start => started?,
            () = signalled.cancelled() => {
                tracing::info!("stopped before the agent started");
                signals.abort();
                return Ok(());
            }
        };
        let mut line = common;
        match &agent {
            Running::Prefill(a) => {
                line["role"] = "prefill".into();
                line["api"] = a.api_url.clone().into();
                line["control"] = a.control_endpoint.clone().into();
                line["instance"] = a.instance.to_string().into();
            }
            Running::Decode(a) => {
                line["role"] = "decode".into();
                line["api"] = a.api_url.clone().into();
                line["data"] = a.data_endpoint.clone().into();
                line["instance"] = a.instance.to_string().into();
            }
        }
        let metrics = match &agent {
            Running::Prefill(a) => &a.metrics_url,
            Running::Decode(a) => &a.metrics_url,
        };
        if let Some(url) = metrics {
            line["metrics"] = url.clone().into();
        }
        print_listening(&line)?;
        let lost = async {
            match &agent {
                Running::Prefill(a) => a.lease_lost().await,
                Running::Decode(a) => a.lease_lost().await,
            }
        };
        let replaced = tokio::select! {
            () = signalled.cancelled() => None,
            reason = lost => Some(reason),
        };
        if let Some(reason) = replaced {
            // Another instance serves the rank now: stop at once (no drain; the rooms' peers
            // see this instance go), and exit non-zero with the reason.
            tracing::error!(%reason, "this instance was replaced in the registry; stopping");
            shutdown.cancel();
            match agent {
                Running::Prefill(a) => a.join().await,
                Running::Decode(a) => a.join().await,
            }
            signals.abort();
            anyhow::bail!("{reason}");
        }
        match &agent {
            Running::Prefill(a) => a.drain().await,
            Running::Decode(a) => a.drain().await,
        }
        shutdown.cancel();
        match agent {
            Running::Prefill(a) => a.join().await,
            Running::Decode(a) => a.join().await,
        }
        signals.abort();
        tracing::info!("agent stopped");
        Ok(())
    })
}

/// Keeps buffers below 64 MiB in the allocator's heap once freed, for an agent process (not
/// for agents running inside an engine's process, whose allocator is the engine's).
///
/// libzmq receives each message of more than 8 KiB into a buffer it allocates for it, and the
/// decode frees it after the scatter. With glibc's defaults every 1 MiB chunk was a fresh
/// `mmap`, faulted in page by page, and an `munmap`: page faults, cgroup charges, page clearing
/// and unmapping took a large share of the decode's time, and zmq-tcp rooms ran markedly
/// slower than with the buffers kept (docs/benchmarks.md, "Figures behind design choices").
/// The same settings as the environment's
/// `GLIBC_TUNABLES=glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=268435456`,
/// which an engine that runs agents in process can set itself.
#[allow(unsafe_code)]
fn keep_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes glibc's allocator parameters; it is called before the
        // agent starts any thread of its own.
        let set = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20) == 1
        };
        if !set {
            tracing::warn!(
                "mallopt refused the allocator settings: large buffers are mapped afresh each time"
            );
        }
    }
}
