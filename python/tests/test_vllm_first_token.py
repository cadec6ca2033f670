"""The client's first token from the prefill (``kvferry proxy --pairing first-token``), through
real vLLM servers with ``KvferryConnector``: the fleet's first prefill and first decode.

The prefill samples the first token and the proxy sends it to the client when the prefill
answers; the decode continues from the prompt plus that token, with the prompt's KV from the
room (``kvferry_continues``: its prompt is one token longer than the room, and it computes only
that token). Checked against one engine (the reference, or the decode server answering a
request alone): greedy answers token-identical, streamed and not; ``logprobs`` and their text
offsets; ``max_tokens`` 1 (the prefill's token is the whole answer, and its room is released)
and 2; usage (the prompt's own tokens, every generated token); a repetition penalty and
``min_tokens``; with a temperature and a seed, every later token's logprob is the one one engine
gives it after the tokens the client got (the decode continued from exactly those); a UTF-8
character whose bytes are the first two tokens. Requests one engine alone answers exactly (stop
strings, presence and frequency penalties, echo, guided decoding, chat) go the sequential way:
the decode's prompt is then the client's own; ``n`` above 1 is refused, as in every pairing.

The prompts avoid lengths that are a multiple of the 128-token block but for one test: a
decode whose prefix cache holds the whole of such a prompt needs nothing of the room, and lets
it go (docs/vllm.md).
"""

from __future__ import annotations

import json
import pathlib
import time

import pytest

from vllm_servers import (
    BLOCK_SIZE,
    NEW_TOKENS,
    SEEDS,
    View,
    make_chats,
    make_prompts,
    metric,
    post,
    reset_prefix_cache,
    sse,
    run_prompts,
    set_timeouts,
    vllm_metric,
)

PAIRING = "first-token"
PROMPTS = [p for p in make_prompts(SEEDS["sequential"]) if len(p) % BLOCK_SIZE]


@pytest.fixture(scope="module")
def pair(vllm_fleet):
    reset_prefix_cache(vllm_fleet.decode)
    p = View(vllm_fleet, vllm_fleet.prefills[:1], vllm_fleet.decodes[:1])
    p.via = {PAIRING: p.proxy(PAIRING)}
    yield p
    p.stop()


def body(pair: View, prompt: list[int], **extra) -> dict:
    return {"model": str(pair.model), "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}


def stream(url: str, request: dict, kv: str = "landed") -> list[dict]:
    """A streamed answer's events (``[DONE]`` checked and left out), its KV said to have come
    from where ``kv`` says (``x-kvferry-kv``: in the stream when the decode answers part)."""
    events, said = sse(url + "/v1/completions", request)
    assert not [e for e in events if "error" in e], events
    assert said == kv, said
    return events


def sampled_by_decode(pair: View) -> float:
    return metric(pair.via[PAIRING].url, "kvferry_proxy_first_tokens_total", 'sampled_by="decode"')


def decode_prompt_tokens(pair: View) -> float:
    return vllm_metric(pair.decode, "vllm:prompt_tokens_total")


def test_greedy_answers_equal_one_engine_and_the_decode_continues_from_the_prefills_token(pair, reference):
    before = decode_prompt_tokens(pair)
    by_decode = sampled_by_decode(pair)
    run_prompts(pair, PAIRING, PROMPTS, reference)
    # Each decode prompt was the client's plus the first token, but where that token was no
    # text yet (the random model writes stray UTF-8 bytes): the decode sampled it.
    partial = sampled_by_decode(pair) - by_decode
    print(f"{partial:.0f} of {len(PROMPTS)} first tokens were no text yet")
    assert partial < len(PROMPTS) / 2
    assert decode_prompt_tokens(pair) - before == sum(len(p) + 1 for p in PROMPTS) - partial


def test_a_streamed_answer_begins_with_the_prefills_token_and_counts_as_one_engines(pair, reference):
    proxy = pair.via[PAIRING]
    for prompt in PROMPTS[:6]:
        request = body(pair, prompt, return_token_ids=True, stream_options={"include_usage": True})
        events = stream(proxy.url, request)
        want = reference[tuple(prompt)]
        first = events[0]["choices"][0]
        assert first["token_ids"] == want[:1] and first["prompt_token_ids"] == prompt, first
        ids = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
        assert ids == want, f"{len(prompt)}-token prompt"
        # Later events carry no second prompt, and one id runs through the stream.
        assert all(c.get("prompt_token_ids") is None for e in events[1:] for c in e["choices"])
        assert len({e["id"] for e in events}) == 1, {e["id"] for e in events}
        usage = events[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), NEW_TOKENS), usage
        assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_logprobs_and_their_text_offsets_equal_one_engines(pair):
    proxy = pair.via[PAIRING]
    for prompt in PROMPTS[2:5]:
        request = body(pair, prompt, logprobs=2)
        alone = post(pair.decode.url + "/v1/completions", request)["choices"][0]
        got = post(proxy.url + "/v1/completions", request)["choices"][0]
        assert got["text"] == alone["text"]
        lp, one = got["logprobs"], alone["logprobs"]
        assert lp["tokens"] == one["tokens"] and lp["text_offset"] == one["text_offset"], (lp, one)
        assert lp["token_logprobs"] == pytest.approx(one["token_logprobs"], abs=1e-3)
        assert [sorted(t) for t in lp["top_logprobs"]] == [sorted(t) for t in one["top_logprobs"]]
        # Streamed, the events' offsets run on from the first token's.
        events = stream(proxy.url, request)
        offsets = [o for e in events for c in e["choices"] if c.get("logprobs") for o in c["logprobs"]["text_offset"]]
        assert offsets == one["text_offset"]


def test_one_and_two_tokens_and_a_room_one_token_leaves_unused_is_released(pair, reference):
    proxy = pair.via[PAIRING]
    prompt = PROMPTS[6]
    want = reference[tuple(prompt)]
    before = decode_prompt_tokens(pair)
    one = post(proxy.url + "/v1/completions", body(pair, prompt, max_tokens=1, return_token_ids=True))
    assert one["choices"][0]["token_ids"] == want[:1] and one["choices"][0]["finish_reason"] == "length", one
    assert (one["usage"]["prompt_tokens"], one["usage"]["completion_tokens"]) == (len(prompt), 1)
    events = stream(proxy.url, body(pair, prompt, max_tokens=1, return_token_ids=True), "local; reason=first_token")
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == want[:1]
    assert decode_prompt_tokens(pair) == before, "a decode computed a one-token answer"
    # The rooms the prefill computed for them are released, not left to their TTL.
    deadline = time.monotonic() + 60
    while metric(pair.prefill_api, "kvferry_rooms_held", 'state="waiting_for_input"'):
        assert time.monotonic() < deadline, "a one-token answer's room is still held"
        time.sleep(0.05)
    two = post(proxy.url + "/v1/completions", body(pair, prompt, max_tokens=2, return_token_ids=True))
    assert two["choices"][0]["token_ids"] == want[:2]
    assert (two["usage"]["prompt_tokens"], two["usage"]["completion_tokens"]) == (len(prompt), 2)


def test_penalties_on_the_whole_sequence_and_min_tokens_equal_one_engine(pair):
    proxy = pair.via[PAIRING]
    for prompt in PROMPTS[3:6]:
        request = body(pair, prompt, repetition_penalty=1.3, min_tokens=4, return_token_ids=True)
        alone = post(pair.decode.url + "/v1/completions", request)["choices"][0]["token_ids"]
        assert post(proxy.url + "/v1/completions", request)["choices"][0]["token_ids"] == alone


def test_sampled_tokens_continue_from_the_token_the_client_got(pair):
    proxy = pair.via[PAIRING]
    prompt = PROMPTS[4]
    request = body(pair, prompt, temperature=1.0, seed=11, logprobs=0, return_token_ids=True, max_tokens=8)
    events = stream(proxy.url, request)
    ids = [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])]
    logprobs = [x for e in events for c in e["choices"] if c.get("logprobs") for x in c["logprobs"]["token_logprobs"]]
    assert len(ids) == len(logprobs) == 8, (ids, logprobs)
    # One engine scores the tokens the client got after the prompt: each logprob is the one the
    # answer gave it, so each token was sampled after exactly the tokens before it.
    scored = post(pair.decode.url + "/v1/completions",
                  body(pair, prompt + ids, max_tokens=1, prompt_logprobs=0))["choices"][0]["prompt_logprobs"]
    alone = [scored[len(prompt) + i][str(t)]["logprob"] for i, t in enumerate(ids)]
    assert logprobs == pytest.approx(alone, abs=1e-3), (logprobs, alone)


def test_what_one_engine_alone_answers_exactly_goes_the_sequential_way(pair, reference):
    proxy = pair.via[PAIRING]
    prompt = PROMPTS[5]
    for extra in ({"stop": ["never in this answer"]}, {"presence_penalty": 0.5}, {"echo": True},
                  {"structured_outputs": {"choice": ["prefill", "decode", "page"]}, "ignore_eos": False}):
        request = body(pair, prompt, return_token_ids=True, **extra)
        alone = post(pair.decode.url + "/v1/completions", request)
        assert "choices" in alone, (extra, alone)
        alone = alone["choices"]
        before = decode_prompt_tokens(pair)
        got = post(proxy.url + "/v1/completions", request)
        assert "choices" in got, (extra, got)
        got = got["choices"]
        assert [(c["token_ids"], c["text"]) for c in got] == [(c["token_ids"], c["text"]) for c in alone], extra
        asked = decode_prompt_tokens(pair) - before
        assert asked == len(prompt), f"{extra}: not the client's prompt at the decode ({asked})"
        if "structured_outputs" in extra:
            assert got[0]["text"] in extra["structured_outputs"]["choice"], got
    # Several choices would need a prefill each: refused in every pairing, as documented.
    refused = post(proxy.url + "/v1/completions", body(pair, prompt, n=2, temperature=1.0, seed=3))
    assert refused["http_status"] == 400 and "one request per choice" in refused["error"]["error"]["message"], refused
    for i, messages in enumerate(make_chats()):
        got = proxy.chat(messages, 16)
        assert got["choices"][0]["message"]["content"] == reference[("chat", i)]
        assert got["x-kvferry-kv"] == "landed", got
        assert proxy.stream_chat(messages, 16) == (reference[("chat", i)], "landed")


def byte_ids(model: str) -> dict[int, int]:
    """The tiny tokenizer's id of each single byte: its byte-level BPE writes byte ``b`` as
    ``chr(b)`` where that is printable and not a space, else as ``chr(256 + k)`` for the
    ``k``-th other byte, and its alphabet holds all 256."""
    vocab = json.loads((pathlib.Path(model) / "tokenizer.json").read_text())["model"]["vocab"]
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars, others = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + others)
            others += 1
    return {b: vocab[c] for b, c in chars.items()}


def test_a_character_split_across_the_first_two_tokens_reads_as_one_engines(pair):
    """A two-byte UTF-8 character whose first byte is the prefill's token and whose second is
    the decode's first: the prefill's token alone is no text yet, the decode's completes it,
    and the client reads what one engine writes. ``allowed_token_ids`` (applied by both
    servers) leaves the model one lead byte and one continuation byte to choose from; the test
    looks for a pair and prompt where greedy picks the lead, then the continuation."""
    proxy = pair.via[PAIRING]
    ids = byte_ids(pair.model)
    found = None
    for prompt in PROMPTS[1:6]:
        for lead in (0xC3, 0xC5, 0xCE, 0xD0):
            for cont in (0xA9, 0x80, 0x91, 0xB1):
                allowed = [ids[lead], ids[cont]]
                alone = post(pair.decode.url + "/v1/completions",
                             body(pair, prompt, max_tokens=2, allowed_token_ids=allowed, return_token_ids=True))
                if alone["choices"][0]["token_ids"] == allowed:
                    found = (prompt, allowed, bytes([lead, cont]).decode())
                    break
            if found:
                break
        if found:
            break
    assert found, "no prompt makes the model write a lead byte, then a continuation byte"
    prompt, allowed, char = found
    request = body(pair, prompt, max_tokens=6, allowed_token_ids=allowed, return_token_ids=True)
    alone = post(pair.decode.url + "/v1/completions", request)["choices"][0]
    assert alone["text"].startswith(char), alone
    got = post(proxy.url + "/v1/completions", request)["choices"][0]
    assert (got["token_ids"], got["text"]) == (alone["token_ids"], alone["text"]), (got, alone)
    events = stream(proxy.url, request)
    assert "".join(c["text"] for e in events for c in e["choices"]) == alone["text"], events
    assert [t for e in events for c in e["choices"] for t in (c.get("token_ids") or [])] == alone["token_ids"]
    print(f"{char!r} split across the first two tokens: {alone['text']!r} through the proxy, streamed and not")


def test_a_room_the_decode_needs_nothing_of_is_let_go_at_the_prefill(pair, reference):
    """A prompt of whole blocks that the decode's prefix cache holds entirely the second time:
    the decode loads nothing, tells the prefill it let the room go, and the room fails there
    ``--requeue-ms`` later (300 ms while the test runs), not at its TTL (60 s)."""
    prompt = next(p for p in make_prompts(SEEDS["sequential"]) if len(p) == 5 * BLOCK_SIZE)
    want = reference[tuple(prompt)]
    proxy = pair.via[PAIRING]
    reset_prefix_cache(pair.decode)
    were = set_timeouts(pair.prefill_api, requeue_ms=300)["requeue_ms"]
    try:
        got = post(proxy.url + "/v1/completions", body(pair, prompt, return_token_ids=True))
        assert got["choices"][0]["token_ids"] == want and got["kv_transfer_params"]["kvferry_tokens"] == len(prompt)
        let_go = metric(pair.prefill_api, "kvferry_room_failures_total", 'code="aborted"')
        again = post(proxy.url + "/v1/completions", body(pair, prompt, return_token_ids=True))
        assert again["choices"][0]["token_ids"] == want
        assert again["kv_transfer_params"]["kvferry_kv"] == "cached", "the decode loaded a room it held already"
        assert again["x-kvferry-kv"] == "cached", again
        start = time.monotonic()
        while metric(pair.prefill_api, "kvferry_room_failures_total", 'code="aborted"') == let_go:
            assert time.monotonic() - start < 30, "the let-go room waits at the prefill"
            time.sleep(0.05)
        print(f"the room the decode let go failed at the prefill {time.monotonic() - start:.2f} s after the answer")
    finally:
        set_timeouts(pair.prefill_api, requeue_ms=were)
