//! The command line: one subcommand per role. Each subcommand's arguments and its entry point
//! live in the file named after it; this file only dispatches.

mod bootstrap;

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
}

/// Runs the chosen subcommand to completion.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Bootstrap(args) => bootstrap::run(args),
    }
}
