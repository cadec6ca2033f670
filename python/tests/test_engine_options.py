"""The options of in-engine agents (kvferry.engine_options), no engine started: one spelling of
each option, every agent option accepted and an unknown one refused with the valid ones named,
a config file below the options given and the environment, and one rule for pinned ports
(``port + worker × agents + agent``); SGLang's ``SGLANG_DISAGGREGATION_*`` settings and
``--disaggregation-ib-device`` as kvferry's (sglang/settings.py). The adapters' use of them runs
in their engines' venvs: test_vllm_parallel.py (``kv_connector_extra_config``) and
test_sglang_fleet.py (each SGLang rank's ports, the IB devices of its GPU)."""

from __future__ import annotations

import pytest

import kvferry
from kvferry import engine_options as E
from kvferry.sglang.settings import sglang_settings, ucx_net_devices


def test_pinned_ports_are_the_base_plus_the_agents_index_in_its_server():
    given = dict(control_port=7000, data_port=7100, api_port=7200, metrics_port=7300)
    # TP 2: the two workers of a server.
    assert [E.pinned_ports(given, w, env={}) for w in (0, 1)] == [
        dict(control_port=7000, data_port=7100, api_port=7200, metrics_port=7300),
        dict(control_port=7001, data_port=7101, api_port=7201, metrics_port=7301)]
    # DP 2 x TP 2, worker dp_rank * tp_size + tp_rank = 3; kv_both: two agents a worker, the decode second.
    assert E.pinned_ports(given, 3, agents=2, agent=1, env={}) == dict(control_port=7007, data_port=7107, api_port=7207,
                                                                       metrics_port=7307)
    assert E.pinned_ports({}, 1, env={"KVFERRY_METRICS_PORT": "9100"}) == dict(metrics_port=9101)
    # 0 (and unset) picks a free port: left alone. The environment's base is offset as well.
    assert E.pinned_ports(dict(api_port=0), 1, env={"KVFERRY_DATA_PORT": "9000"}) == dict(data_port=9001)
    # An option given wins over the variable.
    assert E.pinned_ports(dict(data_port=8000), 1, env={"KVFERRY_DATA_PORT": "9000"}) == dict(data_port=8001)
    with pytest.raises(kvferry.ConfigError, match="api_port 65535"):
        E.pinned_ports(dict(api_port=65535), 1, env={})


def test_an_option_is_spelled_with_dashes_or_underscores_but_given_once():
    assert E.normalized({"api-port": 1, "room_ttl_ms": 2}, "here") == {"api_port": 1, "room_ttl_ms": 2}
    with pytest.raises(kvferry.ConfigError, match="`api_port` and `api-port` are one option"):
        E.normalized({"api_port": 1, "api-port": 2}, "here")


def test_every_agent_option_is_accepted_and_an_unknown_one_names_the_valid_ones():
    names = E.option_names("decode")
    for key in ("api_port", "data_port", "transport", "room_ttl_ms", "peer_dead_ms", "token"):
        assert key in names, names
    # Each role's help lists the port it binds (a decode has no control port, a prefill no data port).
    assert "control_port" in E.option_names("prefill") and "control_port" not in names
    assert "log_format" not in names and "config" not in names, "the command's own flags are no agent's"
    E.check_names({name.replace("_", "-"): 1 for name in names}, "decode", "here")
    with pytest.raises(kvferry.ConfigError) as e:
        E.check_names({"api-prot": 1}, "decode", "extra config")
    said = str(e.value)
    assert "extra config: unknown agent option `api-prot`" in said and "api_port" in said, said


def test_a_config_file_is_below_the_options_given_the_engines_and_the_environment(tmp_path):
    path = tmp_path / "kvferry.toml"
    path.write_text('api-port = 9000\nroom_ttl_ms = 1\nheartbeat-ms = 2\npeer-dead-ms = 3\n'
                    'allowed-registries = ["10.0.0.0/8:*", "b:1"]\n')
    derived = dict(tp_rank=1, peer_dead_ms=40)
    given = {"room-ttl-ms": 50, "config": str(path)}
    env = {"KVFERRY_HEARTBEAT_MS": "60"}
    mapped = dict(heartbeat_ms=70, timeout_ready_ms=80)
    got = E.agent_options(derived, given, role="decode", worker=1, env=env, mapped=mapped)
    # Given > derived > environment (left to the agent's parser) > file > mapped; lists joined.
    assert got == dict(tp_rank=1, room_ttl_ms=50, peer_dead_ms=40, api_port=9001, timeout_ready_ms=80,
                       allowed_registries="10.0.0.0/8:*,b:1"), got
    # KVFERRY_CONFIG names the file when the options do not.
    assert E.agent_options({}, {}, role="decode", worker=0, env={"KVFERRY_CONFIG": str(path)})["room_ttl_ms"] == 1
    assert E.setting("heartbeat_ms", str(path), env={}) == 2
    assert E.setting("heartbeat_ms", str(path), env=env) == "60"


@pytest.mark.parametrize("text,said", [
    ("bogus-key = 1\n", "config file {path}: unknown agent option `bogus_key`"),
    ('config = "x.toml"\n', "key `config` in config file {path} cannot be set"),
    ("api-port = \n", "config file {path} is not valid TOML"),
])
def test_a_bad_config_file_is_named_with_what_is_wrong(tmp_path, text, said):
    path = tmp_path / "kvferry.toml"
    path.write_text(text)
    with pytest.raises(kvferry.ConfigError) as e:
        E.agent_options({}, {"config": str(path)}, role="prefill", worker=0, env={})
    assert said.format(path=path) in str(e.value), str(e.value)


def test_sglang_settings_become_kvferrys_options():
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
           "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "3"}
    # SGLang's floor of 2 s a heartbeat: 3 missed ones are 6 s.
    assert sglang_settings(env, True) == dict(room_ttl_ms=300_000, heartbeat_ms=2000, peer_dead_ms=6000)
    assert sglang_settings(env, False) == dict(timeout_bootstrap_ms=300_000, timeout_ready_ms=120_000,
                                               heartbeat_ms=2000, peer_dead_ms=6000)
    # Unset: kvferry's own defaults; one heartbeat setting takes SGLang's default for the other (5 s).
    assert sglang_settings({}, False) == {}
    assert sglang_settings({"SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4"}, True) == dict(peer_dead_ms=20_000)
    with pytest.raises(kvferry.ConfigError, match="SGLANG_DISAGGREGATION_WAITING_TIMEOUT='soon' is not a float"):
        sglang_settings({"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "soon"}, False)
    # Below the KVFERRY_* variables, which the agent's parser reads itself.
    got = E.agent_options({}, {}, role="decode", worker=0, mapped=sglang_settings(env, False),
                          env={"KVFERRY_TIMEOUT_READY_MS": "5"})
    assert "timeout_ready_ms" not in got and got["peer_dead_ms"] == 6000, got


def test_sglang_ib_devices_are_ucxs_device_list(tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    # An RDMA device gets UCX's port suffix; a device with a port and a network interface stay.
    assert ucx_net_devices("mlx5_0, mlx5_1:2 ,eth0", str(tmp_path)) == "mlx5_0:1,mlx5_1:2,eth0"
