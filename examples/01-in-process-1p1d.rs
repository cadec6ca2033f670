//! In-process 1P1D with the Rust API: a registry, a prefill agent and a decode agent in this
//! process (real sockets on 127.0.0.1), then one room played through the agents' handles, no
//! HTTP: the decode engine asks for it, the prefill engine says it is ready, the decode engine
//! waits for it and takes it. The synthetic engine fills the prefill pages with a pattern and
//! checks every landed byte on take.
//!
//! `cargo run --release --example 01-in-process-1p1d`

use std::time::{Duration, Instant};

use kvferry::agent::AgentOptions;
use kvferry::agent::EngineApi;
use kvferry::agent::decode::{DecodeAgent, RoomRequest};
use kvferry::agent::prefill::{PrefillAgent, ReadyRequest};
use kvferry_bootstrap::{ServerConfig, serve};
use tokio_util::sync::CancellationToken;

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
        "--bootstrap",
        &registry,
        "--model",
        "tiny",
        "--pool-pages",
        "64",
        "--synthetic",
    ];
    let config = AgentOptions::from_flags(flags)?.config()?;
    let prefill = PrefillAgent::start(config.clone(), shutdown.clone()).await?;
    let decode = DecodeAgent::start(config, shutdown.clone()).await?;
    println!(
        "prefill API {}, decode API {}",
        prefill.api_url, decode.api_url
    );

    // The engines' side, through the handles.
    let room = 42;
    decode
        .request(
            room,
            RoomRequest {
                tokens: 300,
                ..RoomRequest::default()
            },
        )
        .await?;
    prefill
        .ready(
            room,
            ReadyRequest {
                tokens: 300,
                ..ReadyRequest::default()
            },
        )
        .await?;
    // Each wait answers at the room's next change (or after 5 s); a room stops changing once
    // it is final and safe to reuse.
    let deadline = Instant::now() + Duration::from_secs(60);
    let view = loop {
        let view = decode.wait(room, Duration::from_secs(5)).await?;
        if view.state.is_final() || Instant::now() > deadline {
            break view;
        }
    };
    let taken = decode.take(room).await?;
    println!(
        "room {room}: {} with {} bytes, every byte verified: {:?}",
        view.state.name(),
        taken.room.bytes,
        taken.verified
    );
    println!("decode pool after the take: {:?}", decode.pool());

    shutdown.cancel();
    prefill.join().await;
    decode.join().await;
    served.await??;
    anyhow::ensure!(
        taken.verified == Some(true),
        "the room did not land intact: {taken:?}"
    );
    Ok(())
}
