//! The `kvferry` binary: one subcommand per role.
//!
//! Parses the command line (with the config file, `src/cli/config.rs`), sets up logging on
//! stderr (text or JSON, filtered by `RUST_LOG`, default `info`), and runs the subcommand.
//! `python -m kvferry` (the Python package) runs the same three steps.

fn main() -> anyhow::Result<()> {
    let cli = kvferry::cli::config::parse(std::env::args_os()).unwrap_or_else(|e| e.exit());
    kvferry::cli::init_logging(cli.log_format);
    kvferry::cli::run(cli)
}
