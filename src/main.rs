//! The `kvferry` binary: one subcommand per role.

use std::io::IsTerminal;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = kvferry::cli::Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    kvferry::cli::run(cli)
}
