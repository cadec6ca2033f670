"""kvferry as SGLang's transfer backend, through a real SGLang (its CPU engine, with the
test-only stand-in for sgl-kernel's CPU ops, sglang_stub/) under SGLang's own PD router
(sglang-router): greedy outputs equal the model's reference implementation's token for token
(HF transformers', which a plain SGLang server gives too), every landed byte equals the
prefill's, corrupting the landed KV changes the output, and a peer killed with SIGKILL fails
its rooms cleanly on the other side.

The prefill runs at TP2 (a KV head a rank), the decode at TP1, both with ``--page-size 4``;
the probe plugin (sglang_stub/sglang_probe.py) dumps each room's bytes on every rank."""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import random
import re
import time
import urllib.request

import numpy as np
import pytest

import sglang_servers as S
from vllm_servers import make_model, make_prompts, post
from waiting import wait_for

# The module's deployment (its fixtures start it): after the vLLM ones (conftest.ORDER).
pytestmark = pytest.mark.deployment("sglang_pd")

NEW_TOKENS = 8
PAGE_SIZE = 4
PREFILL_TP = 2
# The tiny model's KV (scripts/vllm/tiny_model.py): per layer a K and a V region, each page
# `[PAGE_SIZE tokens][KV_HEADS][HEAD_BYTES]`.
REGIONS, KV_HEADS, HEAD_BYTES = 2 * 2, 2, 64 * 4


@pytest.fixture(scope="module")
def model(sglang, tmp_path_factory) -> pathlib.Path:
    python, env = sglang
    return make_model(python, env, tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="module")
def prompts():
    """12 prompts of 1 to 1000 tokens, some sharing a prefix."""
    return make_prompts(11)[:12]


@pytest.fixture(scope="module")
def reference(sglang, model, prompts):
    """The greedy outputs of the model's reference implementation (HF transformers), which a
    plain SGLang server gives too."""
    return S.reference_outputs(*sglang, model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("dumps")


@pytest.fixture(scope="module")
def pd(sglang, model, dumps, tmp_path_factory):
    python, env = sglang
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


def test_outputs_through_sglang_router_equal_a_plain_sglang_and_every_landed_byte_the_prefills(pd, prompts, reference, dumps):
    S.check_outputs(pd, prompts, reference, NEW_TOKENS)
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


def direct(server: S.Server, pd: S.Pd, prompt: list[int], room: int, rid: str | None = None,
           bootstrap_port: int | None = None) -> dict:
    """A PD request sent to one server as the router would, naming the prefill's bootstrap (or
    ``bootstrap_port`` on the same host)."""
    body = {
        "rid": rid or f"test-{room}",
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port or pd.bootstrap_port,
        "bootstrap_room": room,
    }
    return post(server.url + "/generate", body)


def failure_text(response: dict) -> str:
    return str(response)


def test_a_request_naming_a_registry_the_decode_does_not_trust_fails_at_once_and_sends_it_nothing(
    pd, prompts, reference, recording_registry
):
    """``bootstrap_host`` and ``bootstrap_port`` come from the request body: a request sent
    straight to the decode naming another port of the prefill's host (its agent trusts only
    ``127.0.0.1:BOOTSTRAP_PORT``, KVFERRY_ALLOWED_REGISTRIES) fails at once with a message
    naming that registry, which, like the prefill it would list, receives nothing. The decode
    serves on."""
    fake = recording_registry
    assert pd.allowed_registries == f"127.0.0.1:{pd.bootstrap_port}" != fake.host_port
    room = random.getrandbits(62)
    start = time.monotonic()
    got = direct(pd.decode, pd, prompts[4], room, bootstrap_port=fake.port)
    took = time.monotonic() - start
    print(f"the decode answered in {took:.2f} s: {got}")
    assert "output_ids" not in got or got["meta_info"]["finish_reason"]["type"] == "abort", got
    assert f'registry "{fake.url}" is not trusted' in failure_text(got), got
    assert took < 30
    # A second request to the same address fails as fast (the address is refused for good).
    start = time.monotonic()
    again = direct(pd.decode, pd, prompts[4], room + 1, bootstrap_port=fake.port)
    assert "not trusted" in failure_text(again) and time.monotonic() - start < 30, again
    assert not fake.received(), fake.record()
    wait_for("the decode holds no pages", lambda: S.used_tokens(pd.decode) == 0, 30)
    p = prompts[4]
    assert S.output_ids(pd.generate(p, NEW_TOKENS)) == reference[tuple(p)]


def test_a_decode_whose_prompt_is_not_the_prefills_is_refused_prompt_mismatch(pd, prompts, reference):
    """Both sides send the digest of their request's prompt with the room: a decode asking for
    a room its prefill computed for another prompt of the same length is refused
    (``prompt_mismatch``) rather than decoding from that prompt's KV. Both sides then free the
    room's pages (the prefill's request aborted) and the decode serves on."""
    room, prompt = random.getrandbits(62), prompts[6]
    other = prompt[1:] + prompt[:1]
    assert other != prompt
    rid = f"mismatch-{room}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        computed = pool.submit(direct, pd.prefill, pd, prompt, room, rid)
        got = direct(pd.decode, pd, other, room)
        print(f"the decode asked with another prompt: {got}")
        assert "output_ids" not in got or got["meta_info"]["finish_reason"]["type"] == "abort", got
        assert "prompt_mismatch" in failure_text(got) and "is not the one this prefill computed" in failure_text(got), got
        abort(pd.prefill, rid)
        computed.result(timeout=60)
    for side in ("decode", "prefill"):
        wait_for(f"the {side} frees the room's pages", lambda: S.used_tokens(getattr(pd, side)) == 0, 30)
    assert S.output_ids(pd.generate(prompt, NEW_TOKENS)) == reference[tuple(prompt)]


def abort(server: S.Server, rid: str) -> None:
    """SGLang's ``POST /abort_request`` (it answers 200 with no body)."""
    req = urllib.request.Request(server.url + "/abort_request", json.dumps({"rid": rid}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_request_aborted_on_either_side_while_its_room_waits_for_the_other_frees_its_pages(pd, prompts, reference, side):
    """At the decode: its request waits for KV its prefill never computes. At the prefill: its
    KV waits for a decode that never asks (kvferry keeps it for a minute)."""
    room, prompt = random.getrandbits(62), prompts[7 if side == "decode" else 8]
    rid = f"abort-{side}-{room}"
    server = getattr(pd, side)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(direct, server, pd, prompt, room, rid)
        took = wait_for(f"the {side} holds the room's pages", lambda: S.used_tokens(server) >= len(prompt))
        abort(server, rid)
        got = waiting.result(timeout=60)
    freed = wait_for(f"the {side} frees the room's pages", lambda: S.used_tokens(server) == 0, 30)
    print(f"{side} held the pages after {took:.2f} s; aborted: {got}; freed {freed:.2f} s later")
    assert "output_ids" not in got or got["meta_info"]["finish_reason"]["type"] == "abort", got
    assert f"aborted by the {side} engine" in failure_text(got), got
    assert S.output_ids(pd.generate(prompt, NEW_TOKENS)) == reference[tuple(prompt)]


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
        logged = len(pd.prefill.log.read_bytes())
        computed = pool.submit(direct, pd.prefill, pd, prompt, room)
        got = computed.result(timeout=120)
    # The prefill computed the room, so its pages were held: its scheduler's batches since say
    # so (a sample of its load can fall between the allocation and the release).
    batches = pd.prefill.log.read_bytes()[logged:].decode(errors="replace")
    held = sum(int(n) for n in re.findall(r"Prefill batch, .*?#new-token: (\d+)", batches))
    print(f"the prefill computed {held} tokens for the room; its request ended with {got}")
    assert held >= len(prompt), f"the prefill computed {held} tokens for a prompt of {len(prompt)}"
    # The decode's death, not the room's TTL (a minute), ended it. SGLang answers with the
    # first TP rank's reason, which is the other rank's failure when that rank saw it first.
    said = [line for line in pd.prefill.log.read_text().splitlines() if f"room {room} failed" in line]
    assert "peer_dead" in failure_text(got) or any("peer_dead" in line for line in said), (got, said)
    wait_for("the prefill frees the room's pages", lambda: S.used_tokens(pd.prefill) == 0, 30)
