"""A prefill and a decode agent over numpy caches (a real registry process), embedded in this
process or spawned as sidecars over shared memory (the ``pair`` fixture runs a test both
ways: the same calls, views and exceptions): the API, and every error surface with the
exception it raises and the proof that nothing outside a room's pages was written."""

import contextlib
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import kvferry
from engine import MODEL, POISON, engine_agent, fill, kv_cache, options

PAGE = MODEL["page_size"]
# The closed set of failure codes (src/reason.rs).
CODES = {
    "peer_dead": kvferry.PeerDead,
    "timeout_bootstrap": kvferry.TimeoutBootstrap,
    "timeout_ready": kvferry.TimeoutReady,
    "timeout_stall": kvferry.TimeoutStall,
    "aborted": kvferry.Aborted,
    "checksum": kvferry.Checksum,
    "incompatible_layout": kvferry.IncompatibleLayout,
    "incompatible_version": kvferry.IncompatibleVersion,
    "unreachable": kvferry.Unreachable,
    "unauthorized": kvferry.Unauthorized,
    "bad_message": kvferry.BadMessage,
    "verify_failed": kvferry.VerifyFailed,
    "unknown_room": kvferry.PeerUnknownRoom,
    "shutdown": kvferry.Shutdown,
    "prompt_mismatch": kvferry.PromptMismatch,
}


@contextlib.contextmanager
def agents(registry, memory):
    """A prefill (noise) and a decode (poison) agent, and their caches."""
    opts = options(registry)
    with engine_agent("prefill", memory, opts) as (prefill, p_kv), engine_agent("decode", memory, opts) as (decode, d_kv):
        yield prefill, decode, fill(p_kv, "noise", 7), fill(d_kv, "poison")


@pytest.fixture(params=["numpy", "sidecar"], ids=["in-process", "sidecar"])
def pair(registry, request):
    """The agents' factory, started inside the test: in this process, or as sidecars."""
    return lambda: agents(registry, request.param)


def untouched(kv: np.ndarray) -> bool:
    return bool((kv.view(np.uint16) == POISON).all())


def test_exception_hierarchy_covers_every_failure_code():
    assert kvferry.FAILURE_CODES == CODES
    for exc in CODES.values():
        assert issubclass(exc, kvferry.RoomFailed) and issubclass(exc, kvferry.Error)
        assert exc.__module__ == "kvferry"
    for exc in (kvferry.BadRequest, kvferry.UnknownRoom, kvferry.Conflict, kvferry.Exhausted,
                kvferry.Unavailable, kvferry.WaitTimeout, kvferry.ConfigError,
                kvferry.RegionError, kvferry.StartError):
        assert issubclass(exc, kvferry.Error) and not issubclass(exc, kvferry.RoomFailed)


def test_options_go_through_the_command_line_parser():
    layout = kvferry.memory_layout(**MODEL, pool_pages=10)
    # tiny: 4 layers, 4 KV heads of 32 fp16 dims; one buffer for every layer.
    assert layout == dict(
        kv_format="vllm-cpu-vec", num_regions=1, region_bytes=4 * 10 * 4 * PAGE * 2 * 32 * 2,
        pool_bytes=4 * 10 * 4 * PAGE * 2 * 32 * 2, pool_pages=10, page_size=PAGE, layers=(0, 4), heads=(0, 4), planes=2, head_bytes=64,
        dtype_bytes=2,
    )
    assert kvferry.memory_layout(**MODEL, pool_pages=10, tp_size=2, tp_rank=1)["heads"] == (2, 4)
    # vLLM's CUDA layout: one region per layer, back to back in a pool file.
    flash = kvferry.memory_layout(**(MODEL | dict(kv_format="vllm-flash-nhd")), pool_pages=10)
    assert flash["num_regions"] == 4 and flash["pool_bytes"] == 4 * flash["region_bytes"]
    with pytest.raises(kvferry.ConfigError, match="--tp-rank 2 must be < --tp-size 2"):
        kvferry.memory_layout(tp_rank=2, tp_size=2)
    with pytest.raises(kvferry.ConfigError, match="no-such-flag"):
        kvferry.memory_layout(no_such_flag=1)
    with pytest.raises(kvferry.ConfigError, match="nope"):
        kvferry.memory_layout(kv_format="nope")


ENVIRONMENT_OPTIONS = """
import json, kvferry
from engine import MODEL
print(json.dumps([kvferry.memory_layout(**MODEL)["pool_pages"], kvferry.memory_layout(**MODEL, pool_pages=10)["pool_pages"]]))
"""


def test_agents_in_an_engine_honour_the_kvferry_environment_below_their_options():
    """An engine's agents read the ``KVFERRY_*`` variables as the command line does (a
    deployment configures every rank's agent the same way, embedded or not); an option given
    in code wins over the variable."""
    env = os.environ | {"KVFERRY_POOL_PAGES": "77", "PYTHONPATH": str(pathlib.Path(__file__).parent)}
    run = subprocess.run([sys.executable, "-c", ENVIRONMENT_OPTIONS], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[77, 10]"


def test_rooms_land_in_place_and_the_views_are_the_http_json(pair):
    with pair() as (prefill, decode, p_kv, d_kv):
        # 70 tokens: two whole blocks and 6 tokens of a third, announced layer by layer.
        src, dst = [5, 9, 2], [7, 3, 11]
        view = decode.request(1, 70, pages=dst)
        assert view["room"] == 1 and view["pages"] == dst and view["page_owner"] == "engine"
        assert set(view) >= {"room", "state", "reason", "bytes", "timings", "safe_to_reuse", "expected_bytes"}
        for layer in range(4):
            prefill.ready(1, 70, pages=src, layer_range=(layer, layer + 1), last=layer == 3, aux=b"meta" if layer == 0 else None)
        done = decode.wait(1, 30)
        assert done["state"] == "success" and done["reason"] is None and done["bytes"] == done["expected_bytes"]
        assert prefill.wait(1, 30)["state"] == "success"
        assert decode.view(1)["state"] == "success"
        taken = decode.take(1)
        assert taken["aux"] == b"meta" and taken["verified"] is None
        with pytest.raises(kvferry.UnknownRoom, match="unknown room 1"):
            decode.take(1)
        # Whole (block, head) runs moved; every other block keeps its poison.
        for s, d in zip(src, dst):
            assert (d_kv[:, d].view(np.uint16) == p_kv[:, s].view(np.uint16)).all()
        # Token by token through vLLM's own view of a layer: K transposed per (block, head).
        for layer in range(4):
            k_t = d_kv[layer].reshape(-1, 4, 2 * PAGE * 32)[:, :, : PAGE * 32].reshape(-1, 4, 32, PAGE)
            v = d_kv[layer].reshape(-1, 4, 2 * PAGE * 32)[:, :, PAGE * 32 :].reshape(-1, 4, PAGE, 32)
            pk_t = p_kv[layer].reshape(-1, 4, 2 * PAGE * 32)[:, :, : PAGE * 32].reshape(-1, 4, 32, PAGE)
            pv = p_kv[layer].reshape(-1, 4, 2 * PAGE * 32)[:, :, PAGE * 32 :].reshape(-1, 4, PAGE, 32)
            for t in range(70):
                a, b, slot = src[t // PAGE], dst[t // PAGE], t % PAGE
                assert (k_t[b, :, :, slot].view(np.uint16) == pk_t[a, :, :, slot].view(np.uint16)).all()
                assert (v[b, :, slot].view(np.uint16) == pv[a, :, slot].view(np.uint16)).all()
        rest = np.delete(d_kv, dst, axis=1)
        assert untouched(rest)
        assert decode.pool() == {"free_pages": 400, "total_pages": 400}


def test_unknown_room(pair):
    with pair() as (prefill, decode, _, d_kv):
        for call in (decode.view, decode.take, decode.abort, lambda r: decode.wait(r, 1), prefill.view):
            with pytest.raises(kvferry.UnknownRoom, match="unknown room 424242"):
                call(424242)
        assert untouched(d_kv)


def test_wait_timeout_then_abort(pair):
    with pair() as (prefill, decode, _, d_kv):
        decode.request(2, 40, pages=[1, 2])
        with pytest.raises(kvferry.WaitTimeout, match="room 2 is still") as e:
            decode.wait(2, 0.3)
        assert e.value.room == 2 and e.value.view["state"] in ("bootstrapping", "waiting_for_input")
        decode.abort(2)
        with pytest.raises(kvferry.Aborted) as e:
            decode.wait(2, 30)
        assert e.value.code == "aborted" and e.value.room == 2 and e.value.view["state"] == "aborted"
        with pytest.raises(kvferry.Aborted):
            decode.take(2)
        with pytest.raises(kvferry.UnknownRoom):
            decode.view(2)
        assert untouched(d_kv)


def test_prefill_abort_fails_the_decode_room(pair):
    with pair() as (prefill, decode, _, d_kv):
        decode.request(3, 64, pages=[4, 6])
        # An announced piece of the first layer only, then the prefill engine gives up.
        prefill.ready(3, 64, pages=[8, 9], layer_range=(0, 1), last=False)
        prefill.abort(3)
        with pytest.raises(kvferry.Aborted):
            prefill.wait(3, 30)
        with pytest.raises(kvferry.Aborted) as e:
            decode.wait(3, 30)
        assert e.value.view["safe_to_reuse"] is True
        # Nothing outside the room's blocks was written.
        assert untouched(np.delete(d_kv, [4, 6], axis=1))


def test_refused_requests(pair):
    with pair() as (prefill, decode, _, d_kv):
        with pytest.raises(kvferry.BadRequest, match="400"):
            decode.request(4, 40, pages=[1, 400])
        with pytest.raises(kvferry.BadRequest):
            decode.request(4, 40, pages=[1])
        with pytest.raises(kvferry.BadRequest):
            prefill.ready(4, 40, pages=[1, 2], token_range=(5, 40))
        decode.request(4, 40, pages=[1, 2])
        with pytest.raises(kvferry.Conflict):
            decode.request(4, 40, pages=[1, 2])
        decode.abort(4)
        assert untouched(d_kv)


def test_incompatible_layouts_fail_the_room(registry):
    # A vLLM CPU prefill on the vec path and a decode on the amx path: same shape, different
    # order inside a block; Hello refuses the pair and nothing lands.
    p_opts = options(registry)
    d_opts = options(registry, kv_format="vllm-cpu-amx", dp_size=1)
    p_kv, d_kv = kv_cache(p_opts, "noise"), kv_cache(d_opts, "poison")
    with kvferry.PrefillAgent([p_kv], **p_opts) as prefill, kvferry.DecodeAgent([d_kv], **d_opts) as decode:
        decode.request(5, 32, pages=[3])
        prefill.ready(5, 32, pages=[3])
        with pytest.raises(kvferry.IncompatibleLayout) as e:
            decode.wait(5, 30)
        assert e.value.code == "incompatible_layout" and "vllm" in str(e.value)
    assert untouched(d_kv)


def test_memory_that_does_not_fit_is_refused(registry):
    opts = options(registry)
    need = kvferry.memory_layout(**opts)["region_bytes"]
    with pytest.raises(kvferry.RegionError, match=f"{need} needed"):
        kvferry.DecodeAgent([np.zeros(need - 2, dtype=np.uint8)], **opts)
    with pytest.raises(kvferry.RegionError, match="spans 1 regions, 2 were given"):
        kvferry.DecodeAgent([np.zeros(need, np.uint8), np.zeros(need, np.uint8)], **opts)
    with pytest.raises(kvferry.RegionError, match="spans 4 regions, 1 were given"):
        kvferry.DecodeAgent([np.zeros(need, np.uint8)], **(opts | dict(kv_format="vllm-flash-nhd")))
    ro = np.zeros(need, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(kvferry.RegionError, match="read-only"):
        kvferry.DecodeAgent([ro], **opts)
    with pytest.raises(kvferry.RegionError, match="contiguous"):
        kvferry.DecodeAgent([np.zeros(2 * need, np.uint8)[::2]], **opts)
    with pytest.raises(kvferry.RegionError, match="region 0: str is neither"):
        kvferry.DecodeAgent(["memory"], **opts)
    with pytest.raises(kvferry.RegionError, match="at 0x0"):
        kvferry.DecodeAgent([(0, need)], **opts)


@pytest.mark.parametrize("kind", ["array_interface", "bytearray", "address"])
def test_regions_of_every_kind_and_longer_than_needed(registry, kind):
    # Each region longer than the layout needs: the tail beyond region_bytes is never written.
    opts = options(registry)
    need = kvferry.memory_layout(**opts)["region_bytes"]
    p_kv = kv_cache(opts, "noise", 3)
    backing = np.full(need + 4096, 0xAB, np.uint8)

    class Iface:
        __array_interface__ = backing.__array_interface__

    raw = bytearray(b"\xab" * (need + 4096))
    region = {
        "array_interface": Iface(),
        "bytearray": raw,
        # A raw pair: nothing to hold, the caller vouches for the memory.
        "address": (backing.__array_interface__["data"][0], need + 4096),
    }[kind]
    with kvferry.PrefillAgent([p_kv], **opts) as prefill, kvferry.DecodeAgent([region], **opts) as decode:
        decode.request(6, 33, pages=[10, 20])
        prefill.ready(6, 33, pages=[1, 2])
        decode.wait(6, 30)
        decode.take(6)
        if kind == "bytearray":
            # While the agent holds a bytearray, it cannot be resized (it is exported).
            with pytest.raises(BufferError):
                raw.extend(b"x")
    if kind == "bytearray":
        raw.extend(b"x")  # released on close
        data = np.frombuffer(raw, np.uint8)[: need + 4096]
    else:
        data = backing
    assert (data[need:] == 0xAB).all()
    cache = data[:need].view(np.float16).reshape(p_kv.shape)
    for got, want in ((10, 1), (20, 2)):
        assert (cache[:, got].view(np.uint16) == p_kv[:, want].view(np.uint16)).all()
    assert (np.delete(cache, [10, 20], axis=1).view(np.uint16) == 0xABAB).all()


def test_closed_agent_is_unavailable(registry):
    opts = options(registry)
    decode = kvferry.DecodeAgent([kv_cache(opts, "poison")], **opts)
    decode.close()
    decode.close()
    with pytest.raises(kvferry.Unavailable, match="closed"):
        decode.request(7, 10, pages=[1])
    with pytest.raises(kvferry.Unavailable):
        decode.pool()


def test_start_error_names_the_registry():
    with pytest.raises(kvferry.StartError, match="registry"):
        kvferry.PrefillAgent(**options("http://127.0.0.1:1"), timeout_connect_ms=500)


def test_room_keys_as_hex_or_bytes(pair):
    with pair() as (prefill, decode, p_kv, d_kv):
        key = "00112233445566778899aabbccddeeff"
        prefill.ready(8, 20, pages=[30], room_key=key)
        decode.request(8, 20, pages=[31], room_key=bytes.fromhex(key))
        assert decode.wait(8, 30)["state"] == "success"
        decode.take(8)
        assert (d_kv[:, 31].view(np.uint16) == p_kv[:, 30].view(np.uint16)).all()
        with pytest.raises(kvferry.BadRequest, match="hex"):
            decode.request(9, 20, pages=[32], room_key="xyz")


def test_a_decode_whose_prompt_differs_is_refused_and_nothing_lands(pair):
    prompt = list(range(3, 23))
    other = prompt[:-1] + [999]
    ours, theirs = kvferry.prompt_digest(prompt), kvferry.prompt_digest(other)
    assert ours != theirs and ours == kvferry.prompt_digest(list(prompt)) and len(ours) == 32
    with pair() as (prefill, decode, p_kv, d_kv):
        # Announced, then asked for with another prompt; and asked for before the announcement.
        prefill.ready(10, 20, pages=[30], prompt_digest=ours)
        decode.request(10, 20, pages=[31], prompt_digest=theirs)
        decode.request(11, 20, pages=[32], prompt_digest=theirs)
        prefill.ready(11, 20, pages=[33], prompt_digest=ours)
        for room in (10, 11):
            with pytest.raises(kvferry.PromptMismatch, match=f"room {room}: the decode's prompt .* is not the one") as e:
                decode.wait(room, 30)
            assert e.value.code == "prompt_mismatch" and theirs in str(e.value) and ours in str(e.value)
        assert untouched(d_kv)
        # The same prompt lands.
        prefill.ready(12, 20, pages=[34], prompt_digest=ours)
        decode.request(12, 20, pages=[35], prompt_digest=ours)
        assert decode.wait(12, 30)["state"] == "success"
        decode.take(12)
        assert (d_kv[:, 35].view(np.uint16) == p_kv[:, 34].view(np.uint16)).all()
        assert untouched(np.delete(d_kv, [35], axis=1))
        with pytest.raises(kvferry.BadRequest, match="32 hex digits"):
            decode.request(13, 20, pages=[36], prompt_digest="xyz")


def test_pages_before_the_start_token_may_repeat_and_stay_untouched(pair):
    """A decode's pages before the one holding ``start_token`` do not move: an engine may list
    the same empty block there (vLLM does before a sliding window); from there on, none twice."""
    with pair() as (prefill, decode, p_kv, d_kv):
        prefill.ready(16, 2 * PAGE + 20, pages=[20, 21, 22])
        decode.request(16, 2 * PAGE + 20, pages=[0, 0, 5], start_token=2 * PAGE)
        assert decode.wait(16, 30)["state"] == "success"
        decode.take(16)
        assert (d_kv[:, 5].view(np.uint16) == p_kv[:, 22].view(np.uint16)).all()
        assert untouched(np.delete(d_kv, [5], axis=1))
        with pytest.raises(kvferry.BadRequest, match="page 6 is listed twice"):
            decode.request(17, 3 * PAGE, pages=[0, 6, 6], start_token=PAGE)


def test_a_held_room_is_requested_as_any_other(pair):
    """hold/unhold reach the agent in both bindings (their effect on the prefill's TTL is
    tested end to end in tests/processes/e2e_zmq.rs and through vLLM). A room let go is not
    asked for again by the same decode (the prefill is told so), so the request is another's."""
    with pair() as (prefill, decode, p_kv, d_kv):
        prefill.ready(14, 20, pages=[32])
        prefill.ready(15, 20, pages=[30])
        decode.hold(14)
        decode.unhold(14)
        decode.unhold(99)  # holding nothing is not an error
        decode.hold(15, dp_rank=0)
        decode.request(15, 20, pages=[31])
        assert decode.wait(15, 30)["state"] == "success"
        decode.take(15)
        assert (d_kv[:, 31].view(np.uint16) == p_kv[:, 30].view(np.uint16)).all()


TOKEN = "s3cret"


@pytest.fixture(params=["numpy", "sidecar"], ids=["in-process", "sidecar"])
def decode_with_token(registry, request):
    """A factory of decode agents with the token ``TOKEN`` and the real registry as
    ``--bootstrap`` (extra options as keywords), in this process or as a sidecar; each yields
    the agent and its cache."""
    return lambda **extra: engine_agent("decode", request.param, options(registry, token=TOKEN, **extra))


def test_a_room_naming_a_registry_the_decode_does_not_trust_is_refused_and_nothing_is_sent(
    decode_with_token, recording_registry, registry
):
    """A room's or a hold's ``bootstrap`` comes from a client (SGLang's and vLLM's requests
    carry it): a registry neither ``--bootstrap``'s nor in ``--allowed-registries`` is refused
    at once (Forbidden; a sidecar's API answers 403), and it and the prefill it lists see no
    connection, let alone the token."""
    fake = recording_registry
    named = re.escape(f'registry "{fake.url}" is not trusted')
    with decode_with_token() as (decode, d_kv):
        fill(d_kv, "poison")
        with pytest.raises(kvferry.Forbidden, match=named) as e:
            decode.request(40, 40, pages=[1, 2], bootstrap=fake.url)
        assert "nothing was sent" in str(e.value) and TOKEN not in str(e.value)
        with pytest.raises(kvferry.Forbidden, match=named):
            decode.request(41, 40, pages=[3, 4], bootstrap=fake.url, dp_rank=0)
        with pytest.raises(kvferry.Forbidden, match=named):
            decode.hold(42, bootstrap=fake.url)
        with pytest.raises(kvferry.Forbidden, match=named):
            decode.hold(43, bootstrap=fake.url, dp_rank=0)
        # A list of replicas is trusted only as a whole.
        with pytest.raises(kvferry.Forbidden):
            decode.request(44, 40, pages=[5, 6], bootstrap=f"{registry},{fake.url}")
        with pytest.raises(kvferry.Forbidden, match=named):
            decode.prefill_group(fake.url)
        with pytest.raises(kvferry.Forbidden, match=named):
            decode.prefill_group(fake.url, 1)
        for room in (40, 41, 44):
            with pytest.raises(kvferry.UnknownRoom):
                decode.view(room)
        # The agent serves on; and nothing was sent in the background either.
        assert decode.pool()["free_pages"] == decode.pool()["total_pages"]
        time.sleep(0.5)
        assert not fake.received(), fake.record()
        assert untouched(d_kv)


def test_a_trusted_registry_is_asked_with_the_token_and_its_prefill_hears_hello(decode_with_token, recording_registry):
    """The positive control of the instruments above: a decode that trusts the fake registry
    (``--allowed-registries 127.0.0.1:PORT``) asks it for the group with its token as bearer,
    and connects to the prefill the group lists."""
    fake = recording_registry
    with decode_with_token(allowed_registries=fake.host_port) as (decode, _):
        group = decode.prefill_group(fake.url)
        assert group["ranks"][0]["control_endpoint"] == fake.prefill.endpoint, group
        assert (group["tp_size"], group["layout"]["page_size"]) == (1, PAGE)
        decode.request(45, 40, pages=[1, 2], bootstrap=fake.url, dp_rank=0)
        fake.wait_for("the decode connects to the listed prefill", lambda: len(fake.prefill.data) > 0)
        decode.abort(45)
    assert fake.bearers() and set(fake.bearers()) == {f"Bearer {TOKEN}"}, fake.record()
    assert any(r["path"] == "/v1/groups/0" for r in fake.requests), fake.record()


def test_a_prefill_that_never_answers_hello_holds_up_only_its_own_rooms(registry, recording_registry):
    """A decode connects to one prefill at a time per prefill, not one at a time overall: while
    it waits (up to ``--timeout-connect-ms``, 60 s here) on a prefill that never answers Hello
    (the fake registry's), a room of a live prefill lands."""
    fake = recording_registry
    decode_opts = options(registry, allowed_registries=fake.host_port, timeout_connect_ms=60_000)
    with engine_agent("prefill", "numpy", options(registry)) as (prefill, p_kv), \
            engine_agent("decode", "numpy", decode_opts) as (decode, d_kv):
        fill(p_kv, "noise", 7)
        fill(d_kv, "poison")
        decode.request(50, 40, pages=[1, 2], bootstrap=fake.url, dp_rank=0)
        fake.wait_for("the decode connects to the silent prefill", lambda: len(fake.prefill.data) > 0)
        start = time.monotonic()
        src, dst = [5, 9, 2], [7, 3, 11]
        decode.request(51, 70, pages=dst)
        prefill.ready(51, 70, pages=src)
        done = decode.wait(51, 50)
        took = time.monotonic() - start
        print(f"a live prefill's room landed {took:.2f} s after the decode began to wait on a silent one")
        assert done["state"] == "success", done
        assert took < 30, took
        assert decode.view(50)["state"] not in ("success", "failed"), decode.view(50)
        for s_, d_ in zip(src, dst):
            assert (d_kv[:, d_].view(np.uint16) == p_kv[:, s_].view(np.uint16)).all()
        decode.abort(50)


def test_wait_releases_the_gil_and_close_ends_it(registry):
    import threading
    import time

    opts = options(registry)
    decode = kvferry.DecodeAgent([kv_cache(opts, "poison")], **opts)
    decode.request(10, 20, pages=[1])
    raised = []

    def waiter():
        try:
            decode.wait(10, 30)
        except kvferry.Error as e:
            raised.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the waits block with the GIL released: this thread runs meanwhile
    t0 = time.monotonic()
    closers = [threading.Thread(target=decode.close) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers + threads:
        t.join(10)
    assert time.monotonic() - t0 < 5
    assert len(raised) == 2 and all(isinstance(e, kvferry.Unavailable) for e in raised), raised


def test_poll_reports_settled_rooms_without_blocking(pair):
    with pair() as (prefill, decode, p_kv, d_kv):
        decode.request(11, 40, pages=[12, 13])
        decode.request(12, 40, pages=[14, 15])
        assert decode.poll([11, 12]) == {}
        prefill.ready(11, 40, pages=[1, 2])
        decode.abort(12)
        settled = {}
        while len(settled) < 2:  # an engine's step loop
            settled |= decode.poll([11, 12])
        assert settled[11]["state"] == "success" and settled[11]["safe_to_reuse"]
        # Any iterable of rooms; an endless wait on a settled room returns at once.
        assert set(decode.poll({11, 12})) == set(decode.poll(r for r in (11, 12))) == {11, 12}
        assert decode.wait(11, float("inf"))["state"] == "success"
        assert settled[12]["state"] == "aborted" and settled[12]["reason"]["code"] == "aborted"
        assert set(prefill.poll([11])) == {11}
        # A room the agent does not know (taken, expired, never made) polls as None.
        assert decode.poll([11, 13])[13] is None
        decode.take(11)
        with pytest.raises(kvferry.Aborted):
            decode.take(12)
        assert decode.poll([11, 12]) == {11: None, 12: None}
        assert (d_kv[:, [12, 13]].view(np.uint16) == p_kv[:, [1, 2]].view(np.uint16)).all()
        assert untouched(np.delete(d_kv, [12, 13], axis=1))


def test_memory_cannot_be_freed_under_the_agent(registry):
    # The agent holds every object it was given until it is closed: dropping the engine's last
    # reference frees nothing (and memory that can be released explicitly refuses, below).
    import gc
    import weakref

    opts = options(registry)
    p_kv = kv_cache(opts, "noise", 5)
    d_kv = kv_cache(opts, "poison")
    alive = weakref.ref(d_kv)
    with kvferry.PrefillAgent([p_kv], **opts) as prefill:
        decode = kvferry.DecodeAgent([d_kv], **opts)
        del d_kv
        gc.collect()
        assert alive() is not None, "the agent let the engine's array go"
        decode.request(20, 33, pages=[5, 6])
        prefill.ready(20, 33, pages=[7, 8])
        decode.wait(20, 30)
        decode.take(20)
        landed = alive()
        assert (landed[:, [5, 6]].view(np.uint16) == p_kv[:, [7, 8]].view(np.uint16)).all()
        assert untouched(np.delete(landed, [5, 6], axis=1))
        del landed
        decode.close()
    gc.collect()
    assert alive() is None, "the closed agent still holds the engine's array"


def test_an_mmap_under_an_agent_cannot_be_closed(registry):
    # Freeing memory explicitly while an agent may write it raises BufferError; after close
    # it works.
    import mmap

    opts = options(registry)
    mapped = mmap.mmap(-1, kvferry.memory_layout(**opts)["region_bytes"])
    with kvferry.DecodeAgent([mapped], **opts):
        with pytest.raises(BufferError):
            mapped.close()
    mapped.close()


PINNED = r"""
import os, pathlib, sys
sys.path.insert(0, sys.argv[2])
from engine import kv_cache, options
import kvferry
os.sched_setaffinity(0, {0})  # an engine's compute thread, pinned to its core
opts = options(sys.argv[1])
with kvferry.PrefillAgent([kv_cache(opts, "noise")], **opts):
    for task in pathlib.Path("/proc/self/task").iterdir():
        name = (task / "comm").read_text().strip()
        cpus = next(l.split(":")[1].strip() for l in (task / "status").read_text().splitlines()
                    if l.startswith("Cpus_allowed_list"))
        print(name, cpus)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to unpin to")
def test_an_agent_started_from_a_pinned_thread_runs_its_threads_unpinned(registry):
    # vLLM binds its worker to its OMP cores before the connector starts the agent: the agent's
    # threads must not inherit that (where engines share cores they would wait seconds to run).
    out = subprocess.run([sys.executable, "-c", PINNED, registry, str(pathlib.Path(__file__).parent)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    threads = [line.rsplit(" ", 1) for line in out.stdout.splitlines()]
    allowed = os.sched_getaffinity(0)
    ours = [(name, cpus) for name, cpus in threads if name.startswith(("kvferry", "ZMQbg"))]
    assert ours and all(cpus != "0" for _, cpus in ours), threads
    # The engine's own thread stays pinned.
    assert threads[0][1] == "0", threads
    print(f"allowed {sorted(allowed)}: {threads}")


def test_a_room_goes_to_the_prefill_dp_group_its_number_names(registry):
    """A prefill server of DP groups (SGLang's ``--dp-size``, vLLM's ``--data-parallel-size``)
    registers one kvferry group per DP rank; SGLang's decode asks group ``bootstrap_room %
    dp_size`` (its ``follow_bootstrap_room``, which kvferry's SGLang backend sets), and the
    prefill's scheduler of that DP rank computes the room. Each room lands from its own group's
    pages, byte for byte, and no other page of the decode changes."""
    opts = options(registry, dp_size=2)
    with (
        engine_agent("prefill", "numpy", opts | {"dp_rank": 0}) as (p0, kv0),
        engine_agent("prefill", "numpy", opts | {"dp_rank": 1}) as (p1, kv1),
        engine_agent("decode", "numpy", options(registry)) as (decode, d_kv),
    ):
        fill(kv0, "noise", 1)
        fill(kv1, "noise", 2)
        fill(d_kv, "poison")
        groups = [decode.prefill_group(dp_rank=g) for g in range(2)]
        assert [g["dp_size"] for g in groups] == [2, 2] and groups[0] != groups[1], groups
        prefills = [(p0, kv0), (p1, kv1)]
        rooms = [(2**62 + 7 * i, [1 + i], [20 + i]) for i in range(6)]
        for room, src, dst in rooms:
            decode.request(room, PAGE, pages=dst, dp_rank=room % 2)
        for room, src, _ in rooms:
            prefills[room % 2][0].ready(room, PAGE, pages=src)
        for room, src, dst in rooms:
            assert decode.wait(room, 30)["state"] == "success"
            decode.take(room)
            assert (d_kv[:, dst].view(np.uint16) == prefills[room % 2][1][:, src].view(np.uint16)).all(), room
        assert {room % 2 for room, _, _ in rooms} == {0, 1}
        assert untouched(np.delete(d_kv, [dst[0] for _, _, dst in rooms], axis=1))
