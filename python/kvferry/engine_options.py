"""The options of the agents an engine runs in its own processes (the vLLM connector, the SGLang
backend), from every place an operator may give them, with one spelling and one port rule.

- **Spelling.** An option is a ``kvferry prefill|decode`` flag's long name, written with ``-``
  or ``_`` alike (``api-port`` and ``api_port`` are one option; the extension turns ``_`` into
  ``-``), and read from ``KVFERRY_`` plus its name in upper case with ``_``
  (``KVFERRY_API_PORT``). Keys are normalized to ``_`` here; one option given in both spellings
  is an error.
- **Where options come from**, the first that sets one wins: the operator's options in the
  engine's own configuration (vLLM's ``kv_connector_extra_config``), what the adapter derives
  from the engine (the model's shape, this rank), the ``KVFERRY_*`` environment, the config
  file (``config`` among the options, else ``KVFERRY_CONFIG``: a TOML table keyed by the flags'
  long names, as ``kvferry prefill --config`` reads it), settings the adapter maps from the
  engine's own variables (SGLang's ``SGLANG_DISAGGREGATION_*``), kvferry's defaults. An option
  no agent has is an error that names the valid ones.
- **Pinned ports.** Every worker of a server gets the same options, so each pinned port
  (``control_port``, ``data_port``, ``api_port``, ``metrics_port``: from the options, the
  environment or the file; 0 picks a free one and is left alone) is offset per agent:
  ``port + worker × agents + agent``, where ``worker`` is the worker's index in its server
  (``dp_rank × tp_size + tp_rank``), ``agents`` the agents each worker runs (2 for vLLM's
  ``kv_both``, else 1) and ``agent`` which of them (the prefill agent 0, the decode agent 1).
  A server of W workers uses ``port`` to ``port + W × agents - 1`` of each pinned port.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from typing import Any, Mapping

from . import ConfigError, _kvferry

# The agent options that pin a listening port.
PORTS = ("control_port", "data_port", "api_port", "metrics_port")
# The variable naming the config file when the options do not.
CONFIG_ENV = "KVFERRY_CONFIG"


def key_of(name: str) -> str:
    """An option's key as this module keeps it: the flag's long name with ``_``."""
    return str(name).strip().removeprefix("--").replace("-", "_")


def env_name(key: str) -> str:
    """The ``KVFERRY_*`` variable of an option."""
    return "KVFERRY_" + key_of(key).upper()


def normalized(options: Mapping[str, Any] | None, source: str) -> dict[str, Any]:
    """``options`` with every key spelled with ``_``; ConfigError for one option given twice
    (``api_port`` and ``api-port``)."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for name, value in (options or {}).items():
        key = key_of(name)
        if key in out:
            raise ConfigError(f"{source}: `{spelled[key]}` and `{name}` are one option; give it once")
        out[key], spelled[key] = value, str(name)
    return out


def read_config(path: str) -> dict[str, Any]:
    """The options of a config file (TOML, keys are the flags' long names): lists become the
    comma-separated values list flags take. ConfigError naming the file for a file that cannot
    be read or parsed, or a key that sets no option."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ConfigError(f"config file {path}: reading TOML needs Python 3.11 or the tomli package") from None
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    out = normalized(table, f"config file {path}")
    if "config" in out:
        raise ConfigError(f"key `config` in config file {path} cannot be set in a config file")
    for key, value in out.items():
        if isinstance(value, dict):
            raise ConfigError(f"key `{key}` in config file {path}: a table sets no option")
        if isinstance(value, list):
            out[key] = ",".join(str(v) for v in value)
    return out


@functools.cache
def option_names(role: str) -> tuple[str, ...]:
    """The options of ``kvferry ROLE`` (its ``--help``), with ``_``; empty if it cannot say."""
    try:
        run = subprocess.run([sys.executable, "-m", "kvferry", role, "--help"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ()
    names = {key_of(m) for m in re.findall(r"^\s*(?:-\w, )?--([a-z0-9-]+)", run.stdout, re.M)}
    # The help lists the command's global flags too (--log-format): an agent has none of them.
    return tuple(sorted(n for n in names - {"help", "version", "config"} if is_option(n, True)))


def is_option(key: str, value: Any) -> bool:
    """Whether an agent has the option ``key``, by the agents' own parser (a bad value is
    left for the agent to report with all the options)."""
    flag = f"--{key_of(key).replace('_', '-')}"
    try:
        _kvferry.agent_flags(**{key: True if value is None or value is False else value})
    except ConfigError as e:
        return f"unexpected argument '{flag}'" not in str(e)
    return True


def check_names(options: Mapping[str, Any], role: str, source: str) -> None:
    """ConfigError for a key of ``options`` that is no option of ``kvferry ROLE``, naming the
    valid ones."""
    for key, value in options.items():
        if not is_option(key, value):
            flag = f"--{key_of(key).replace('_', '-')}"
            valid = option_names(role)
            listed = f"; valid options: {', '.join(valid)}" if valid else f"; see `kvferry {role} --help`"
            raise ConfigError(f"{source}: unknown agent option `{key}` (no {flag} flag){listed}") from None


def pinned_ports(options: Mapping[str, Any], worker: int, agents: int = 1, agent: int = 0,
                 env: Mapping[str, str] | None = None) -> dict[str, int]:
    """The pinned ports of agent ``agent`` of worker ``worker`` (``agents`` a worker), by the
    module's rule: each of PORTS set to a port other than 0 in ``options`` or else in ``env``
    (``KVFERRY_*``), plus ``worker × agents + agent``. ConfigError past port 65535."""
    env = os.environ if env is None else env
    out: dict[str, int] = {}
    for key in PORTS:
        raw = options.get(key) if options.get(key) is not None else env.get(env_name(key))
        if raw is None or str(raw).strip() in ("", "0"):
            continue
        try:
            base = int(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} {raw!r} is not a port") from None
        port = base + worker * agents + agent
        if not 0 < base or port > 65535:
            raise ConfigError(f"{key} {base} + {worker * agents + agent} (worker {worker}, agent {agent} of "
                              f"{agents}) is not a port")
        out[key] = port
    return out


def agent_options(derived: Mapping[str, Any], given: Mapping[str, Any] | None, *, role: str, worker: int,
                  agents: int = 1, agent: int = 0, source: str = "agent options", config: str | None = None,
                  mapped: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options of one agent (``role``: ``prefill`` or ``decode``): ``given`` (the
    operator's, from ``source``) over ``derived`` (the adapter's, from the engine) over the
    ``KVFERRY_*`` environment over the config file (``config`` in ``given``, else the
    ``config`` argument, else ``KVFERRY_CONFIG``) over ``mapped`` (the engine's own settings as
    kvferry's); pinned ports offset for agent ``agent`` of worker ``worker`` (module doc)."""
    env = os.environ if env is None else env
    given = normalized(given, source)
    path = given.pop("config", None) or config or env.get(CONFIG_ENV) or None
    check_names(given, role, source)
    file = read_config(str(path)) if path else {}
    if file:
        check_names(file, role, f"config file {path}")
    below = {k: v for k, v in (normalized(mapped, "mapped settings") | file).items() if env_name(k) not in env}
    opts = below | normalized(derived, "derived options") | given
    return opts | pinned_ports(opts, worker, agents, agent, env)


def setting(key: str, config: str | None = None, env: Mapping[str, str] | None = None) -> Any:
    """One option as the environment or else the config file sets it (``config``, else
    ``KVFERRY_CONFIG``), for an adapter that acts on it before its agents start (SGLang's
    registry); None when neither does."""
    env = os.environ if env is None else env
    value = env.get(env_name(key))
    if value:
        return value
    path = config or env.get(CONFIG_ENV)
    return read_config(path).get(key_of(key)) if path else None
