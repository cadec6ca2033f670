"""The Python surfaces of the engine API against its one declaration,
``kvferry._kvferry.OPERATIONS`` (src/agent/engine_api.rs): each role's agent class, its type
stub and ``kvferry.Sidecar`` have exactly the Python methods of the operations they serve, and
each ``Sidecar`` method calls its operation's HTTP route; ``kvferry.RoomState`` has the agents'
states, and every view an agent returns carries its members. No engine."""

import ast
import inspect
import urllib.parse

import pytest

import kvferry
from conftest import REPO
from engine import engine_agent, fill, options
from kvferry import _kvferry

CLASSES = {"prefill": kvferry.PrefillAgent, "decode": kvferry.DecodeAgent}
STUB = REPO / "python" / "kvferry" / "_kvferry.pyi"
# What every agent object has beside the operations: its lifecycle.
LIFECYCLE = {"close"}


def served(roles) -> set[str]:
    """The Python methods of the operations any of ``roles`` serves."""
    return {m for op in _kvferry.OPERATIONS if set(op["roles"]) & set(roles) for m in op["python"]}


def methods(cls) -> set[str]:
    """A class's public methods: its routines, not its properties or attributes."""
    return {name for name, value in inspect.getmembers(cls) if not name.startswith("_") and inspect.isroutine(value)}


def stub() -> ast.Module:
    return ast.parse(STUB.read_text())


def stub_methods(class_name: str) -> set[str]:
    """The public methods the stub declares on a class (its ``@property`` getters left out)."""
    cls = next(n for n in stub().body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {
        f.name for f in cls.body
        if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")
        and not any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)
    }


def same(have: set[str], want: set[str], where: str) -> None:
    assert have == want, f"{where}: missing {sorted(want - have)}, not an operation's {sorted(have - want)}"


@pytest.mark.parametrize("role", sorted(CLASSES))
def test_each_agent_class_and_its_stub_have_exactly_the_methods_of_their_roles_operations(role):
    want = served([role]) | LIFECYCLE
    # Not vacuous: each role serves the room operations in Python.
    assert {"view", "poll", "wait", "abort", "pool"} < want
    cls = CLASSES[role]
    same(methods(cls), want, f"kvferry.{cls.__name__}")
    same(stub_methods(cls.__name__), want, f"_kvferry.pyi {cls.__name__}")


def test_the_sidecar_has_exactly_the_methods_of_every_operation():
    same(methods(kvferry.Sidecar), served(CLASSES) | LIFECYCLE, "kvferry.Sidecar")


def test_the_stub_declares_every_public_name_of_the_extension():
    declared = set()
    for node in stub().body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    public = {name for name in dir(_kvferry) if not name.startswith("_")}
    assert {"OPERATIONS", "ROOM_STATES", "PrefillAgent", "DecodeAgent"} <= public
    assert public <= declared, sorted(public - declared)


class Recorder(kvferry.Sidecar):
    """A Sidecar without a process: records each API call and answers a settled room."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def _call(self, method, path, body=None, timeout=60.0):
        self.calls.append((method, path))
        return {"room": "3", "state": "success", "safe_to_reuse": True, "reason": None, "aux": None,
                "transfers": [], "free_pages": 1, "total_pages": 2}


# Arguments for the methods' required parameters.
ARGUMENTS = {"room": 3, "rooms": [3], "tokens": 40, "timeout": 1.0}


def test_each_sidecar_method_calls_its_operations_route():
    for op in _kvferry.OPERATIONS:
        for name in op["python"]:
            assert op["http"] is not None, f"{op['name']}: a Python method over no route cannot be a Sidecar's"
            sidecar = Recorder()
            method = getattr(sidecar, name)
            params = inspect.signature(method).parameters.values()
            method(**{p.name: ARGUMENTS[p.name] for p in params if p.default is inspect.Parameter.empty})
            route = (op["http"][0], op["http"][1].format(room=3, dp_rank=0))
            assert [(m, p.partition("?")[0]) for m, p in sidecar.calls] == [route], (op["name"], name)
    sidecar = Recorder()
    sidecar.prefill_group("http://10.0.0.1:8998/a b", dp_rank=2)
    assert sidecar.calls == [("GET", "/v1/prefill-groups/2?" + urllib.parse.urlencode({"bootstrap": "http://10.0.0.1:8998/a b"}))]


def test_room_state_has_the_agents_states():
    assert {s.value: s.is_final for s in kvferry.RoomState} == _kvferry.ROOM_STATES
    assert len(_kvferry.ROOM_STATES) == 7
    assert kvferry.RoomState("success") is kvferry.RoomState.SUCCESS
    assert kvferry.RoomState.SUCCESS == "success" and str(kvferry.RoomState.WAITING_FOR_INPUT) == "waiting_for_input"
    assert f"{kvferry.RoomState.ABORTED}" == "aborted"


def states(view: dict) -> list:
    """The states of a view: the room's and its transfers'."""
    return [view["state"], *(t["state"] for t in view.get("transfers", ()))]


def assert_room_states(view: dict) -> None:
    assert all(type(s) is kvferry.RoomState for s in states(view)), view


@pytest.mark.parametrize("memory", ["numpy", "sidecar"], ids=["in-process", "sidecar"])
def test_every_view_carries_room_states(registry, memory):
    opts = options(registry)
    with engine_agent("prefill", memory, opts) as (prefill, p_kv), engine_agent("decode", memory, opts) as (decode, _):
        fill(p_kv, "noise", 7)
        asked = decode.request(1, 40, pages=[1, 2])
        assert_room_states(asked)
        assert_room_states(prefill.ready(1, 40, pages=[3, 4]))
        assert decode.wait(1, 30)["state"] is kvferry.RoomState.SUCCESS
        sent = prefill.wait(1, 30)
        assert sent["state"] is kvferry.RoomState.SUCCESS and sent["state"].is_final
        assert len(sent["transfers"]) == 1 and sent["transfers"][0]["state"] is kvferry.RoomState.SUCCESS
        for view in (decode.view(1), prefill.view(1), *decode.poll([1]).values(), *prefill.poll([1]).values()):
            assert_room_states(view)
        taken = decode.take(1)
        assert taken["state"] is kvferry.RoomState.SUCCESS and taken["aux"] is None

        decode.request(2, 40, pages=[5, 6])
        with pytest.raises(kvferry.WaitTimeout) as timeout:
            decode.wait(2, 0.1)
        assert not timeout.value.view["state"].is_final
        assert_room_states(timeout.value.view)
        assert_room_states(decode.abort(2))
        with pytest.raises(kvferry.Aborted) as aborted:
            decode.wait(2, 30)
        assert aborted.value.view["state"] is kvferry.RoomState.ABORTED
