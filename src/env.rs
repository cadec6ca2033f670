//! The environment variables that more than one part of kvferry names: the command line reads
//! them, and whatever starts kvferry processes of its own (`cluster`) sets or clears them.

/// The environment variable that names a config file when `--config` is absent.
pub const CONFIG_ENV: &str = "KVFERRY_CONFIG";
