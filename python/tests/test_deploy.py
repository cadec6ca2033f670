"""The Kubernetes recipes of deploy/kubernetes (docs/deploy.md), which have never run on a
cluster: scripts/deploy/check validates them against the Kubernetes and prometheus-operator
schemas (and a copy with a field of the wrong type fails it, so the validator does run), and
these tests check what a schema cannot: every port a container listens on is exactly what its
Service and its NetworkPolicy name, the vLLM servers' pinned ports follow the per-worker offset
rule of kvferry.engine_options for the TP size each runs, the connector's JSON passes kvferry's
own check, the secrets hold the keys the Pods and the ServiceMonitor ask for, every kvferry, etcd
and vLLM flag exists, and Prometheus scrapes every /metrics port. No engine is started."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys
import urllib.parse

import pytest

import kvferry
from kvferry import engine_options

# kvferry.vllm.params (the connector's check of kv_connector_extra_config) from the installed
# package, loaded on its own: the kvferry.vllm package imports vLLM, which this venv has not.
# test_vllm_parses_the_servers_arguments runs the same check through kvferry.vllm in vLLM's venv.
_spec = importlib.util.spec_from_file_location(
    "kvferry_vllm_params", pathlib.Path(kvferry.__file__).parent / "vllm" / "params.py")
params = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(params)
ConnectorConfig = params.ConnectorConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
CHECK = REPO / "scripts" / "deploy" / "check"
HEADER = "Not run on a cluster: validated against the Kubernetes schemas in CI"
# Each vLLM manifest's kv_role and the kvferry role of its agents.
ROLES = {"vllm-prefill": ("kv_producer", "prefill"), "vllm-decode": ("kv_consumer", "decode")}
# The ports whose /metrics Prometheus scrapes, by name.
METRICS_PORT = re.compile(r"^(vllm|metrics(-tp\d+)?)$")


def check(*files: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHECK), *map(str, files)], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def deploy_python() -> str:
    """The validators' venv (scripts/deploy/install; made on first use, stamped)."""
    run = subprocess.run([str(REPO / "scripts/deploy/install")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.fixture(scope="module")
def manifests(deploy_python) -> dict[str, list[dict]]:
    """Every manifest's documents, by file name (PyYAML from the validators' venv)."""
    code = ("import json, sys, yaml, pathlib\n"
            "print(json.dumps({p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]"
            " for p in sorted(pathlib.Path(sys.argv[1]).glob('*.yaml'))}))")
    run = subprocess.run([deploy_python, "-c", code, str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def objects(manifests, kind: str) -> list[dict]:
    return [d for docs in manifests.values() for d in docs if d.get("kind") == kind]


def one(manifests, kind: str, name: str) -> dict:
    found = [d for d in objects(manifests, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads(manifests) -> list[dict]:
    return objects(manifests, "Deployment") + objects(manifests, "StatefulSet")


def container(workload: dict) -> dict:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return c


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def flags(args: list[str]) -> dict[str, str | None]:
    """``--name=value`` and ``--name value`` arguments, by name."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, i = args[i + 1], i + 1
            out[name] = value if (eq or value) else None
        i += 1
    return out


def connector(workload: dict) -> dict:
    return json.loads(flags(container(workload)["args"])["--kv-transfer-config"])


def tp_size(workload: dict) -> int:
    return int(flags(container(workload)["args"]).get("--tensor-parallel-size") or 1)


# The schema check

def test_every_manifest_passes_the_schema_validator():
    run = check()
    assert run.returncode == 0, run.stderr
    files = sorted(DEPLOY.glob("*.yaml"))
    assert f"{len(files)} files" in run.stderr, run.stderr


def test_a_field_of_the_wrong_type_fails_the_validator(tmp_path):
    # A Kubernetes kind: a port as a string. The CRD: a ServiceMonitor endpoint's port as a
    # number. Strict: an unknown field. An unchanged file beside them passes.
    registry = (DEPLOY / "registry.yaml").read_text()
    assert "containerPort: 8998\n" in registry
    bad_port = tmp_path / "bad-port.yaml"
    bad_port.write_text(registry.replace("containerPort: 8998\n", 'containerPort: "8998"\n'))
    monitor = (DEPLOY / "servicemonitor.yaml").read_text()
    assert "- port: metrics\n" in monitor
    bad_monitor = tmp_path / "bad-monitor.yaml"
    bad_monitor.write_text(monitor.replace("- port: metrics\n", "- port: 9100\n"))
    typo = tmp_path / "typo.yaml"
    typo.write_text((DEPLOY / "proxy.yaml").read_text().replace("readinessProbe:", "readynessProbe:"))
    run = check(bad_port, bad_monitor, typo, DEPLOY / "registry.yaml")
    assert run.returncode == 1, run.stderr
    assert f"{bad_port}: Deployment/kvferry-registry: spec.template.spec.containers[0].ports[0].containerPort" in run.stderr
    assert f"{bad_monitor}: ServiceMonitor/kvferry: spec.endpoints[0].port" in run.stderr
    assert f"{typo}: Deployment/kvferry-proxy: spec.template.spec.containers[0]" in run.stderr
    assert "readynessProbe" in run.stderr and str(DEPLOY / "registry.yaml") not in run.stderr, run.stderr


# What the schemas cannot see

def test_every_file_says_it_was_not_run_and_the_kustomization_lists_them_all(manifests):
    for path in DEPLOY.glob("*.yaml"):
        assert HEADER in path.read_text().split("\n\n")[0], f"{path.name}: no header saying it was never run"
    for path in DEPLOY.parent.glob("Dockerfile.*"):
        assert "Not run on a cluster, and not built in CI" in path.read_text(), path.name
    (kustomization,) = manifests["kustomization.yaml"]
    assert sorted(kustomization["resources"]) == sorted(set(manifests) - {"kustomization.yaml"})


def test_every_port_is_exactly_what_its_service_and_network_policy_name(manifests):
    services, policies = objects(manifests, "Service"), objects(manifests, "NetworkPolicy")
    for w in workloads(manifests):
        name, labels = w["metadata"]["name"], w["spec"]["template"]["metadata"]["labels"]
        listens = {p["containerPort"]: p["name"] for p in container(w)["ports"]}
        (service,) = [s for s in services if selects(s["spec"]["selector"], labels)]
        assert {p["targetPort"]: p["name"] for p in service["spec"]["ports"]} == listens, name
        (policy,) = [p for p in policies if selects(p["spec"]["podSelector"]["matchLabels"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"], name
        allowed = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
        assert sorted(allowed) == sorted(listens), f"{name}: its NetworkPolicy allows {allowed}, it listens on {listens}"
        # Probes knock on ports the container listens on.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in container(w):
                way = container(w)[probe].get("httpGet") or container(w)[probe].get("tcpSocket")
                assert way["port"] in listens, f"{name}: {probe} on {way['port']}"


def test_the_vllm_servers_pinned_ports_follow_the_per_worker_rule(manifests):
    for name, (kv_role, role) in ROLES.items():
        w = one(manifests, "Deployment", name)
        config = connector(w)
        assert config["kv_connector"] == "KvferryConnector" and config["kv_connector_module_path"] == "kvferry.vllm"
        assert config["kv_role"] == kv_role
        # kvferry's own check of kv_connector_extra_config (the vLLM connector's, at its start).
        extra = ConnectorConfig.of(config["kv_connector_extra_config"], "engine-0")
        tp = tp_size(w)
        assert container(w)["resources"]["limits"]["nvidia.com/gpu"] == tp, name
        expected = {8000: "vllm"}
        for worker in range(tp):
            opts = engine_options.agent_options({}, extra.agent, role=role, worker=worker, source=name, env={})
            pinned = engine_options.pinned_ports(extra.agent, worker, env={})
            assert {k: opts[k] for k in pinned} == pinned
            kind = "control" if role == "prefill" else "data"
            assert set(pinned) == {f"{kind}_port", "api_port", "metrics_port"}, f"{name}: pins {sorted(pinned)}"
            expected[pinned[f"{kind}_port"]] = f"{kind}-tp{worker}"
            # The engine API serves vLLM in the Pod only: declared nowhere, let in by no policy.
            expected[pinned["metrics_port"]] = f"metrics-tp{worker}"
        listens = {p["containerPort"]: p["name"] for p in container(w)["ports"]}
        assert listens == expected, f"{name} at TP {tp}"
        # The agents listen beyond the Pod, tell peers the Pod's address, serve their API over HTTPS.
        assert extra.agent["host"] == extra.agent["api_host"] == "0.0.0.0"
        env = {e["name"]: e for e in container(w)["env"]}
        assert env["KVFERRY_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["VLLM_HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert container(w)["livenessProbe"]["httpGet"]["port"] == extra.agent["metrics_port"]
        assert container(w)["livenessProbe"]["httpGet"]["path"] == "/livez"
        # The registry they name is the registry's Service.
        url = urllib.parse.urlsplit(extra.bootstrap)
        service = one(manifests, "Service", url.hostname)
        assert url.scheme == "https" and url.port in [p["port"] for p in service["spec"]["ports"]]


def test_the_secrets_hold_every_key_the_pods_and_prometheus_ask_for(manifests):
    secrets = {s["metadata"]["name"]: set(s.get("stringData", {})) | set(s.get("data", {}))
               for s in objects(manifests, "Secret")}
    wanted: set[tuple[str, str]] = set()
    token_env = {}
    for w in workloads(manifests):
        pod = w["spec"]["template"]["spec"]
        c = container(w)
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                wanted.add((ref["name"], ref["key"]))
                token_env[w["metadata"]["name"]] = e["name"]
        # Each file an argument or the connector names under a mounted secret is one of its keys.
        mounted = {}
        for v in pod.get("volumes", []):
            if "secret" in v:
                keys = [i["key"] for i in v["secret"].get("items", [])] or sorted(secrets[v["secret"]["secretName"]])
                wanted |= {(v["secret"]["secretName"], k) for k in keys}
                (mount,) = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == v["name"]]
                mounted[mount] = keys
        text = json.dumps(c.get("args", []))
        for path in re.findall(r"/etc/kvferry/[\w./-]+", text):
            folder, _, key = path.rpartition("/")
            assert key in mounted.get(folder, []), f"{w['metadata']['name']}: {path} is no key of a mounted secret"
    for monitor in objects(manifests, "ServiceMonitor"):
        for ep in monitor["spec"]["endpoints"]:
            if "authorization" in ep:
                wanted.add((ep["authorization"]["credentials"]["name"], ep["authorization"]["credentials"]["key"]))
            if "tlsConfig" in ep:
                wanted.add((ep["tlsConfig"]["ca"]["secret"]["name"], ep["tlsConfig"]["ca"]["secret"]["key"]))
    for name, key in wanted:
        assert key in secrets.get(name, ()), f"secret {name} has no key {key}"
    assert {(n, k) for n, keys in secrets.items() for k in keys} == wanted, "a secret key nobody reads"
    # One token: the registry's variable for the registry, KVFERRY_TOKEN for the agents and the proxy.
    assert token_env == {"kvferry-registry": "KVFERRY_BOOTSTRAP_TOKEN", "vllm-prefill": "KVFERRY_TOKEN",
                         "vllm-decode": "KVFERRY_TOKEN", "kvferry-proxy": "KVFERRY_TOKEN"}
    environment = (REPO / "docs/environment.md").read_text()
    assert "| `KVFERRY_BOOTSTRAP_TOKEN` | `--token` |" in environment and "| `KVFERRY_TOKEN` | `--token` |" in environment


def test_prometheus_scrapes_every_metrics_port(manifests):
    (monitor,) = objects(manifests, "ServiceMonitor")
    endpoints = {ep["port"]: ep for ep in monitor["spec"]["endpoints"]}
    selected = [s for s in objects(manifests, "Service") if selects(monitor["spec"]["selector"]["matchLabels"],
                                                                    s["metadata"]["labels"])]
    named = {p["name"] for s in selected for p in s["spec"]["ports"] if METRICS_PORT.match(p["name"])}
    assert named == set(endpoints), f"ports {sorted(named)}, scraped {sorted(endpoints)}"
    assert all(ep["path"] == "/metrics" for ep in endpoints.values())
    # Every kvferry role's metrics port: plain HTTP, no token; the probes ask it /livez and /readyz.
    assert all(ep["scheme"] == "http" and "authorization" not in ep for ep in endpoints.values())
    for name in ("kvferry-registry", "kvferry-proxy"):
        c = container(one(manifests, "Deployment", name))
        port = int(flags(c["args"])["--metrics-port"])
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == port, name
        assert (c["livenessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["port"]) == ("/livez", port)
        assert (c["readinessProbe"]["httpGet"]["path"], c["readinessProbe"]["httpGet"]["port"]) == ("/readyz", port)
    for name in ROLES:
        w = one(manifests, "Deployment", name)
        agent = connector(w)["kv_connector_extra_config"]["agent"]
        ports = {p["name"]: p["containerPort"] for p in container(w)["ports"]}
        assert all(ports[f"metrics-tp{t}"] == agent["metrics_port"] + t for t in range(tp_size(w))), name


def test_every_kvferry_flag_exists_and_the_registry_names_every_etcd_member(manifests):
    for name, command in (("kvferry-registry", "bootstrap"), ("kvferry-proxy", "proxy")):
        c = container(one(manifests, "Deployment", name))
        assert c["command"] == ["kvferry"] and c["args"][0] == command
        help_text = subprocess.run([sys.executable, "-m", "kvferry", command, "--help"], capture_output=True,
                                   text=True, timeout=60).stdout
        for flag in flags(c["args"][1:]):
            assert re.search(rf"^\s*{re.escape(flag)}\b", help_text, re.M), f"{name}: kvferry {command} has no {flag}"
    etcd = one(manifests, "StatefulSet", "etcd")
    members = [f"{etcd['metadata']['name']}-{i}.{etcd['spec']['serviceName']}:2379" for i in range(etcd["spec"]["replicas"])]
    store = flags(container(one(manifests, "Deployment", "kvferry-registry"))["args"])["--store"]
    assert store == "etcd://" + ",".join(members)
    cluster = flags(container(etcd)["args"])["--initial-cluster"]
    assert [m.split("=")[0] for m in cluster.split(",")] == [m.split(".")[0] for m in members]
    proxy = flags(container(one(manifests, "Deployment", "kvferry-proxy"))["args"])
    assert proxy["--bootstrap"] == ConnectorConfig.of(connector(one(manifests, "Deployment", "vllm-decode"))[
        "kv_connector_extra_config"], "engine-0").bootstrap


@pytest.mark.skipif(not shutil.which("etcd"), reason="no etcd here (Debian etcd-server; scripts/test installs it)")
def test_every_etcd_flag_exists(manifests):
    help_text = subprocess.run(["etcd", "--help"], capture_output=True, text=True, timeout=60)
    text = help_text.stdout + help_text.stderr
    for flag in flags(container(one(manifests, "StatefulSet", "etcd"))["args"]):
        assert re.search(rf"^\s*{re.escape(flag)}\b", text, re.M), f"etcd has no {flag}"


def test_vllm_parses_the_servers_arguments(manifests, torch_python):
    """vLLM 0.32's own parser (the CPU build's: the server's flags are the same) reads each
    manifest's arguments, its --kv-transfer-config included, and kvferry.vllm's check takes the
    kv_connector_extra_config vLLM parsed (scripts/test installs the venv; skipped without it)."""
    python, env = torch_python
    code = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from kvferry.vllm.params import ConnectorConfig
out = {}
for name, args in json.loads(sys.argv[1]).items():
    a = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
    t = a.kv_transfer_config
    c = ConnectorConfig.of(t.kv_connector_extra_config, "engine-0")
    out[name] = [a.host, a.port, a.tensor_parallel_size, a.shutdown_timeout, t.kv_connector, t.kv_role, c.bootstrap, c.agent]
print(json.dumps(out))
"""
    args = {name: container(one(manifests, "Deployment", name))["args"] for name in ROLES}
    env = {k: v for k, v in env.items() if not k.startswith("KVFERRY_")}
    run = subprocess.run([python, "-c", code, json.dumps(args)], capture_output=True, text=True, timeout=300,
                         cwd="/", env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    parsed = json.loads(run.stdout.strip().splitlines()[-1])
    for name, (kv_role, _) in ROLES.items():
        w = one(manifests, "Deployment", name)
        extra = connector(w)["kv_connector_extra_config"]
        assert parsed[name] == ["0.0.0.0", 8000, tp_size(w), 30, "KvferryConnector", kv_role, extra["bootstrap"],
                                extra["agent"]], name
