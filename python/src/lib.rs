//! The extension module `kvferry._kvferry` of the Python package `kvferry`: kvferry's prefill
//! and decode agents in an engine's own process, over the engine's own KV memory.
//!
//! This crate only converts: keyword options into the agent's command-line flags (parsed by the
//! same clap parser as `kvferry prefill|decode`), Python objects into engine regions
//! (`memory.rs`), requests and views between Python and the library's types (`convert.rs`),
//! and the library's errors into one exception hierarchy (`errors.rs`). Every operation is the
//! library's own, run on one tokio runtime the module owns, with the GIL released.

use std::sync::OnceLock;

use kvferry::agent::AgentConfig;
use kvferry::agent::AgentOptions;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict};

mod agents;
mod convert;
mod errors;
mod memory;

/// The runtime every agent of this process runs on, started on first use; why it could not
/// start (the OS refused its threads), for `StartError`.
fn runtime() -> Result<&'static tokio::runtime::Runtime, String> {
    static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            // The engine pinned the thread that starts the first agent to its compute cores.
            kvferry::cpus::embed_agent_threads();
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("kvferry")
                .on_thread_start(kvferry::cpus::on_agent_thread)
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start kvferry's tokio runtime: {e}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// The command-line flags of keyword options: `page_size=16` is `--page-size 16`, `True` is
/// the bare flag, `False` and `None` leave the flag out.
fn flags(options: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<String>> {
    let mut argv = Vec::new();
    for (key, value) in options.into_iter().flatten() {
        let key: String = key.extract()?;
        let flag = format!("--{}", key.replace('_', "-"));
        if value.is_none() {
            continue;
        }
        if value.is_instance_of::<PyBool>() {
            if value.extract::<bool>()? {
                argv.push(flag);
            }
            continue;
        }
        argv.push(flag);
        argv.push(value.str()?.to_string());
    }
    Ok(argv)
}

/// The command-line flags of keyword options (what `kvferry.spawn` passes to a sidecar),
/// checked by the agents' parser first so that a bad option fails here, not in the child.
#[pyfunction]
#[pyo3(signature = (**options))]
fn agent_flags(options: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<String>> {
    config_of(&parse(options)?)?;
    flags(options)
}

/// The agent flags of keyword options, parsed by the command line's parser (defaults and the
/// `KVFERRY_*` environment variables included).
fn parse(options: Option<&Bound<'_, PyDict>>) -> PyResult<AgentOptions> {
    let argv = flags(options)?;
    AgentOptions::from_flags(&argv).map_err(|e| {
        // clap's first line names the problem; the rest is usage for a terminal.
        let text = e.to_string();
        let first = text
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches("error: ");
        errors::ConfigError::new_err(first.to_owned())
    })
}

/// The agent configuration of keyword options, validated and defaulted exactly as the
/// command line is.
fn config_of(args: &AgentOptions) -> PyResult<AgentConfig> {
    args.config()
        .map_err(|e| errors::ConfigError::new_err(format!("{e:#}")))
}

/// [`config_of`] the keyword options.
pub(crate) fn agent_config(options: Option<&Bound<'_, PyDict>>) -> PyResult<AgentConfig> {
    config_of(&parse(options)?)
}

/// The memory the engine provides for an agent of these options: the number of regions of its
/// KV format, the bytes each needs, and the shape of the layout on this rank.
#[pyfunction]
#[pyo3(signature = (**options))]
fn memory_layout<'py>(
    py: Python<'py>,
    options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let args = parse(options)?;
    let cfg = config_of(&args)?;
    let l = &cfg.layout;
    let out = PyDict::new(py);
    out.set_item("kv_format", &args.kv_format)?;
    out.set_item("num_regions", l.num_regions())?;
    out.set_item(
        "region_bytes",
        l.region_bytes(cfg.pool_pages)
            .map_err(|e| errors::ConfigError::new_err(e.to_string()))?,
    )?;
    out.set_item(
        "pool_bytes",
        l.pool_bytes(cfg.pool_pages)
            .map_err(|e| errors::ConfigError::new_err(e.to_string()))?,
    )?;
    out.set_item("pool_pages", cfg.pool_pages)?;
    out.set_item("page_size", l.page_size)?;
    out.set_item("layers", (l.layers.start, l.layers.end))?;
    out.set_item("heads", (l.heads.start, l.heads.end))?;
    out.set_item("planes", l.planes())?;
    out.set_item("head_bytes", l.head_bytes())?;
    out.set_item("dtype_bytes", l.model.dtype.bytes())?;
    Ok(out)
}

/// The digest of a prompt's token ids (32 hex digits) that an engine gives with a room
/// (`PrefillAgent.ready`, `DecodeAgent.request`: `prompt_digest`), over the room's tokens:
/// a decode whose prompt differs from the prefill's is refused (`prompt_mismatch`).
#[pyfunction]
fn prompt_digest(py: Python<'_>, tokens: Vec<u32>) -> String {
    py.detach(|| kvferry::protocol::PromptDigest::of_tokens(&tokens).to_string())
}

/// Logs to stderr, as the binary does, when `RUST_LOG` is set (an embedded agent is silent
/// otherwise); a subscriber the process installed already wins. Called when an agent starts.
fn init_logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        kvferry::cli::init_logging(kvferry::cli::LogFormat::Text);
    }
}

/// `python -m kvferry ARGS` (and the wheel's `kvferry` command): the `kvferry` command line
/// (`argv[0]` is the program name) in this process, every subcommand of the binary; the
/// processes `demo` and `bench` start are this interpreter's `-m kvferry`. For sidecars started
/// from Python (`kvferry.spawn`) too. A bad command line exits with clap's message, as the
/// binary does; a role that fails raises `Error` with its chain of causes.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<String>) -> PyResult<()> {
    use kvferry::cli::{config, init_logging, run};
    let cli = config::parse(argv).unwrap_or_else(|e| e.exit());
    let python: Option<std::path::PathBuf> = py.import("sys")?.getattr("executable")?.extract()?;
    if let Some(python) = python.filter(|p| !p.as_os_str().is_empty()) {
        kvferry::cluster::run_as(python, vec!["-m".into(), "kvferry".into()]);
    }
    init_logging(cli.log_format);
    py.detach(|| run(cli))
        .map_err(|e| errors::Error::new_err(format!("{e:#}")))
}

/// The engine API's operations (`kvferry::agent::OPERATIONS`), a tuple of dicts: `name`,
/// `roles`, `http` (`(method, path)` or None) and `python` (the methods that serve it, on the
/// agents and on `Sidecar`). Tests check the classes, the stub and the sidecar against it.
fn operations(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyTuple>> {
    let ops = kvferry::agent::OPERATIONS.iter().map(|op| {
        let dict = PyDict::new(py);
        dict.set_item("name", op.name)?;
        dict.set_item("roles", pyo3::types::PyTuple::new(py, op.roles)?)?;
        dict.set_item(
            "http",
            op.http.map(|(method, path)| (method.as_str(), path)),
        )?;
        dict.set_item("python", pyo3::types::PyTuple::new(py, op.python)?)?;
        Ok(dict)
    });
    pyo3::types::PyTuple::new(py, ops.collect::<PyResult<Vec<_>>>()?)
}

/// Every room state's name (`kvferry::agent::room::RoomState`) and whether it is final, for
/// the test that checks `kvferry.RoomState` against it.
fn room_states(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let states = PyDict::new(py);
    for state in kvferry::agent::room::RoomState::ALL {
        states.set_item(state.name(), state.is_final())?;
    }
    Ok(states)
}

#[pymodule]
fn _kvferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(memory_layout, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    m.add_function(wrap_pyfunction!(agent_flags, m)?)?;
    m.add_function(wrap_pyfunction!(prompt_digest, m)?)?;
    m.add("OPERATIONS", operations(m.py())?)?;
    m.add("ROOM_STATES", room_states(m.py())?)?;
    m.add_class::<agents::PrefillAgent>()?;
    m.add_class::<agents::DecodeAgent>()?;
    errors::register(m)?;
    Ok(())
}
