//! In-process 1P1D with the Rust API: a registry, a prefill agent and a decode agent in this
//! process (real sockets on 127.0.0.1), then one room played through the engines' HTTP API:
//! the decode engine asks for it, the prefill engine says it is ready, the decode engine
//! long-polls and takes it. The synthetic engine fills the prefill pages with a pattern and
//! checks every landed byte on take.
//!
//! `cargo run --release --example 01-in-process-1p1d`

use clap::Parser;
use kvferry::agent::decode::DecodeAgent;
use kvferry::agent::prefill::PrefillAgent;
use kvferry::cli::AgentArgs;
use kvferry_bootstrap::{ServerConfig, serve};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

/// Agent flags, parsed as the command line would.
#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    agent: AgentArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();

    // The registry, on a port the OS picks.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let registry = format!("http://{}", listener.local_addr()?);
    let stop = shutdown.clone();
    let served = tokio::spawn(async move { serve(listener, ServerConfig::default(), stop).await });

    // One prefill and one decode agent with the same flags: tiny model, synthetic engine.
    let flags = [
        "agent",
        "--bootstrap",
        &registry,
        "--model",
        "tiny",
        "--pool-pages",
        "64",
        "--synthetic",
    ];
    let config = Flags::try_parse_from(flags)?.agent.config()?;
    let prefill = PrefillAgent::start(config.clone(), shutdown.clone()).await?;
    let decode = DecodeAgent::start(config, shutdown.clone()).await?;
    println!(
        "prefill API {}, decode API {}",
        prefill.api_url, decode.api_url
    );

    // The engines' side, over HTTP.
    let http = reqwest::Client::builder().no_proxy().build()?;
    let room = 42;
    let body = json!({ "tokens": 300 });
    http.post(format!("{}/v1/rooms/{room}", decode.api_url))
        .json(&body)
        .send()
        .await?
        .error_for_status()?;
    http.post(format!("{}/v1/rooms/{room}/ready", prefill.api_url))
        .json(&body)
        .send()
        .await?
        .error_for_status()?;
    let view: Value = loop {
        let url = format!("{}/v1/rooms/{room}?wait_ms=5000", decode.api_url);
        let v: Value = http.get(url).send().await?.json().await?;
        if ["success", "failed", "aborted"].contains(&v["state"].as_str().unwrap_or_default()) {
            break v;
        }
    };
    let taken: Value = http
        .post(format!("{}/v1/rooms/{room}/take", decode.api_url))
        .send()
        .await?
        .json()
        .await?;
    println!(
        "room {room}: {} with {} bytes, every byte verified: {}",
        view["state"], taken["bytes"], taken["verified"]
    );

    shutdown.cancel();
    prefill.join().await;
    decode.join().await;
    served.await??;
    anyhow::ensure!(
        taken["verified"] == true,
        "the room did not land intact: {taken}"
    );
    Ok(())
}
