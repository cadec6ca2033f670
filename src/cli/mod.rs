//! The command line: one subcommand per role. Each subcommand's arguments and its entry point
//! live in the file named after it; this file only dispatches.

mod agent;
mod bench;
mod bootstrap;
pub mod cluster;
pub mod demo;
mod signal;

pub use agent::AgentArgs;

use clap::{Parser, Subcommand};

/// kvferry moves KV cache from prefill ranks to decode ranks in disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "kvferry", version, about, long_about = None)]
pub struct Cli {
    /// The role this process plays.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands; each appears here once it works.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the bootstrap registry that pairs prefill and decode ranks.
    Bootstrap(bootstrap::BootstrapArgs),
    /// Run the agent beside a prefill rank: push its KV pages to decode ranks.
    Prefill(AgentArgs),
    /// Run the agent beside a decode rank: land KV pages from prefill ranks in its pool.
    Decode(AgentArgs),
    /// Run a full prefill -> decode transfer on this machine and verify every byte.
    Demo(demo::DemoArgs),
    /// Measure end-to-end transfer throughput and latency over real processes on loopback.
    Bench(bench::BenchArgs),
}

/// Runs the chosen subcommand to completion.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Bootstrap(args) => bootstrap::run(args),
        Command::Prefill(args) => agent::run(agent::AgentRole::Prefill, args),
        Command::Decode(args) => agent::run(agent::AgentRole::Decode, args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench::run(args),
    }
}
