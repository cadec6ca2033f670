//! The `kvferry` binary: one subcommand per role.
//!
//! Parses the command line (with the config file, `src/cli/config.rs`), sets up logging on
//! stderr (text or JSON, filtered by `RUST_LOG`, default `info`), and runs the subcommand.

use std::io::IsTerminal;

use kvferry::cli::LogFormat;
use tracing_subscriber::EnvFilter;

fn main() -> anyhow::Result<()> {
    let cli = kvferry::cli::config::parse(std::env::args_os()).unwrap_or_else(|e| e.exit());
    init_logging(cli.log_format);
    kvferry::cli::run(cli)
}

/// Logs to stderr (stdout carries the listening line and results only).
fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        // One object per line; the event's fields at the top level, the span list kept so a
        // room can be followed.
        LogFormat::Json => builder.json().flatten_event(true).with_ansi(false).init(),
    }
}
