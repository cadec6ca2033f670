"""kvferry as SGLang's transfer backend, through a real SGLang (its CPU engine, with the
test-only stand-in for sgl-kernel's CPU ops, sglang_stub/) under SGLang's own PD router
(sglang-router): greedy outputs equal a plain SGLang server's token for token, every landed byte
equals the prefill's, corrupting the landed KV changes the output, and a peer killed with
SIGKILL fails its rooms cleanly on the other side.

The prefill runs at TP2 (a KV head a rank), the decode at TP1, both with ``--page-size 4``;
the probe plugin (sglang_stub/sglang_probe.py) dumps each room's bytes on every rank."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import random
import time
import urllib.request
import zipfile

import numpy as np
import pytest

import sglang_servers as S
from conftest import REPO
from vllm_servers import make_model, make_prompts, post

NEW_TOKENS = 8
PAGE_SIZE = 4
PREFILL_TP = 2
# The tiny model's KV (scripts/vllm/tiny_model.py): per layer a K and a V region, each page
# `[PAGE_SIZE tokens][KV_HEADS][HEAD_BYTES]`.
REGIONS, KV_HEADS, HEAD_BYTES = 2 * 2, 2, 64 * 4


@pytest.fixture(scope="module")
def sglang(tmp_path_factory):
    """The SGLang venv's python (KVFERRY_SGLANG_PYTHON, which scripts/test sets; by default
    ~/.cache/kvferry/sglang-venv), its environment with this checkout's wheel and the
    stand-in, and the tiny model."""
    python = os.environ.get("KVFERRY_SGLANG_PYTHON")
    if not python:
        python = str(pathlib.Path.home() / ".cache/kvferry/sglang-venv/bin/python")
        if not pathlib.Path(python).exists():
            pytest.skip("no SGLang venv (scripts/sglang/install)")
    wheels = sorted((REPO / "target" / "python-wheels").glob("kvferry-*.whl"))
    assert wheels, "no built wheel in target/python-wheels (scripts/python/build)"
    site = tmp_path_factory.mktemp("sglang-site")
    zipfile.ZipFile(wheels[-1]).extractall(site)
    env = S.sglang_env(str(site), dict(os.environ))
    model = make_model(python, env, tmp_path_factory.mktemp("model") / "tiny", seed=0)
    return python, env, model


@pytest.fixture(scope="module")
def prompts():
    """12 prompts of 1 to 1000 tokens, some sharing a prefix."""
    return make_prompts(11)[:12]


@pytest.fixture(scope="module")
def reference(sglang, prompts, tmp_path_factory):
    """A plain SGLang server's greedy outputs (page size 1)."""
    python, env, model = sglang
    server = S.Server(python, env, model, tmp_path_factory.mktemp("reference") / "sglang.log")
    try:
        server.wait_healthy()
        return {tuple(p): S.output_ids(server.generate(p, NEW_TOKENS)) for p in prompts}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("dumps")


@pytest.fixture(scope="module")
def pd(sglang, dumps, tmp_path_factory):
    python, env, model = sglang
    probe = {"KVFERRY_PROBE_DUMP": str(dumps)}
    pd = S.Pd(
        python, env, model, tmp_path_factory.mktemp("pd"), ("--page-size", str(PAGE_SIZE)),
        prefill_args=("--tp-size", str(PREFILL_TP)), prefill_env=probe | S.TP2, decode_env=probe,
    )
    try:
        pd.start_router()
        yield pd
    finally:
        pd.stop()


def run(pd: S.Pd, prompts: list[list[int]]) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: pd.generate(p, NEW_TOKENS), prompts))


def test_outputs_through_sglang_router_equal_a_plain_sglang_and_every_landed_byte_the_prefills(pd, prompts, reference, dumps):
    got = run(pd, prompts)
    for p, g in zip(prompts, got):
        assert "output_ids" in g, f"prompt of {len(p)} tokens: {g}"
        assert S.output_ids(g) == reference[tuple(p)], f"prompt of {len(p)} tokens"
    print(f"{len(prompts)} prompts of {sorted(len(p) for p in prompts)} tokens at concurrency 4: token-identical")
    landed = sorted(dumps.glob("decode-*-tp0.bin"))
    # The router's warm-up request is a room too.
    assert len(landed) >= len(prompts), f"{len(landed)} rooms landed for {len(prompts)} prompts"
    total = 0
    for d in landed:
        room = d.name.split("-")[1]
        sent = [dumps / f"prefill-{room}-tp{r}.bin" for r in range(PREFILL_TP)]
        assert all(f.exists() for f in sent), f"room {room} landed but not every prefill rank announced it"
        got_bytes = d.read_bytes()
        assert got_bytes == prefill_room(sent), f"room {room}: the landed bytes differ from the prefill's"
        total += len(got_bytes)
    print(f"{len(landed)} rooms, {total} bytes: equal to the prefill ranks' heads, byte for byte")


def prefill_room(ranks: list[pathlib.Path]) -> bytes:
    """The decode's view of a room from its prefill ranks' dumps: each rank holds a share of the
    heads, the decode all of them, token by token."""
    parts = [np.frombuffer(f.read_bytes(), np.uint8) for f in ranks]
    heads = KV_HEADS // len(parts)
    shaped = [p.reshape(REGIONS, -1, PAGE_SIZE, heads, HEAD_BYTES) for p in parts]
    return np.concatenate(shaped, axis=3).tobytes()


def test_corrupting_the_landed_kv_changes_the_output(pd, prompts, reference, dumps):
    flag = dumps / "corrupt"
    flag.touch()
    try:
        longest = max(prompts, key=len)
        got = pd.generate(longest, NEW_TOKENS)
    finally:
        flag.unlink()
    assert "output_ids" in got, got
    assert S.output_ids(got) != reference[tuple(longest)], "the output did not depend on the KV that landed"
    # And without the corruption, the same prompt is right again.
    assert S.output_ids(pd.generate(longest, NEW_TOKENS)) == reference[tuple(longest)]


def direct(server: S.Server, pd: S.Pd, prompt: list[int], room: int, rid: str | None = None) -> dict:
    """A PD request sent to one server as the router would, naming the prefill's bootstrap."""
    body = {
        "rid": rid or f"test-{room}",
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pd.bootstrap_port,
        "bootstrap_room": room,
    }
    return post(server.url + "/generate", body)


def failure_text(response: dict) -> str:
    return str(response)


def abort(server: S.Server, rid: str) -> None:
    """SGLang's ``POST /abort_request`` (it answers 200 with no body)."""
    req = urllib.request.Request(server.url + "/abort_request", json.dumps({"rid": rid}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def wait_for(what: str, check, timeout: float = 60) -> float:
    """Seconds until ``check()`` holds; fails after ``timeout``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"not within {timeout} s: {what}"
        time.sleep(0.2)
    return time.monotonic() - start


def test_a_request_aborted_at_the_decode_while_it_waits_for_its_kv_frees_its_pages(pd, prompts, reference):
    room, prompt = random.getrandbits(62), prompts[7]
    rid = f"abort-decode-{room}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The decode asks for a room its prefill never computes.
        waiting = pool.submit(direct, pd.decode, pd, prompt, room, rid)
        took = wait_for("the decode holds the room's pages", lambda: S.used_tokens(pd.decode) >= len(prompt))
        abort(pd.decode, rid)
        got = waiting.result(timeout=60)
    freed = wait_for("the decode frees the room's pages", lambda: S.used_tokens(pd.decode) == 0)
    print(f"decode held the pages after {took:.2f} s; aborted: {got}; freed {freed:.2f} s later")
    assert "output_ids" not in got or got["meta_info"]["finish_reason"]["type"] == "abort", got
    assert S.output_ids(pd.generate(prompt, NEW_TOKENS)) == reference[tuple(prompt)]


def test_a_request_aborted_at_the_prefill_while_its_kv_waits_for_a_decode_frees_its_pages(pd, prompts):
    room, prompt = random.getrandbits(62), prompts[8]
    rid = f"abort-prefill-{room}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The prefill computes a room no decode asks for: it keeps the KV for one (a minute).
        computed = pool.submit(direct, pd.prefill, pd, prompt, room, rid)
        took = wait_for("the prefill holds the room's pages", lambda: S.used_tokens(pd.prefill) >= len(prompt))
        abort(pd.prefill, rid)
        got = computed.result(timeout=60)
    freed = wait_for("the prefill frees the room's pages", lambda: S.used_tokens(pd.prefill) == 0, 30)
    print(f"prefill held the pages after {took:.2f} s; aborted: {got}; freed {freed:.2f} s later")
    assert "output_ids" not in got or got["meta_info"]["finish_reason"]["type"] == "abort", got


def test_a_prefill_killed_fails_the_decodes_request_with_kvferrys_reason_and_the_decode_goes_on(pd, prompts, reference):
    room = random.getrandbits(62)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The decode asks for a room its prefill never computes: it waits for it.
        waiting = pool.submit(direct, pd.decode, pd, prompts[3], room)
        time.sleep(3)
        assert not waiting.done(), waiting.result()
        pd.prefill.kill()
        killed = time.monotonic()
        got = waiting.result(timeout=120)
    took = time.monotonic() - killed
    print(f"decode's request failed {took:.2f} s after the prefill's SIGKILL: {got}")
    assert "output_ids" not in got or got.get("meta_info", {}).get("finish_reason", {}).get("type") == "abort", got
    assert "peer_dead" in failure_text(got), got
    assert took < 60
    # The decode serves on: a new prefill, the same outputs.
    pd.restart_prefill()
    p = prompts[5]
    assert S.output_ids(pd.generate(p, NEW_TOKENS)) == reference[tuple(p)]
    wait_for("the decode holds no pages", lambda: S.used_tokens(pd.decode) == 0, 30)


def test_a_decode_killed_lets_the_prefill_free_the_rooms_pages(pd, prompts):
    room = random.getrandbits(62)
    prompt = prompts[6]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The decode asks for the room, then dies before the prefill computed it.
        asked = pool.submit(direct, pd.decode, pd, prompt, room)
        time.sleep(3)
        pd.decode.kill()
        asked.exception(timeout=60)
        computed = pool.submit(direct, pd.prefill, pd, prompt, room)
        deadline = time.monotonic() + 60
        held = 0
        while time.monotonic() < deadline and not computed.done():
            held = max(held, S.used_tokens(pd.prefill))
            if held:
                break
            time.sleep(0.2)
        got = computed.result(timeout=120)
    print(f"the prefill held {held} tokens for the room; its request ended with {got}")
    assert held >= len(prompt), f"the prefill held {held} tokens for a prompt of {len(prompt)}"
    # The decode's death, not the room's TTL (a minute), ended it.
    assert "peer_dead" in failure_text(got), got
    wait_for("the prefill frees the room's pages", lambda: S.used_tokens(pd.prefill) == 0, 30)
