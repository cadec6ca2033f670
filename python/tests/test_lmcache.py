"""kvferry as LMCache's transfer channel ``kvferry`` (kvferry.lmcache), in LMCache's own venv
(scripts/lmcache/install) with this checkout's wheel on its path:

- LMCache's transfer channel benchmark, its server and client processes started through
  ``python -m kvferry.lmcache benchmark``, over ZeroMQ tcp and over UCX's tcp transport: the
  client verifies every byte it read (``--verify``), and the server's prefill agent sent
  exactly the bytes the client read (its ``kvferry_kv_bytes_total``);
- bad input through the channel's API (lmcache_peer.py): remote objects outside the peer's
  arena or not page-aligned fail alone while the rest land, a reader without the token is
  refused, a reader that does not trust the peer's registry never asks it, objects past the
  agent's room limit wait and land, a peer killed mid-read fails the objects it had not sent
  and the read finishes, local objects outside the arena raise ValueError; every landed byte equals the peer's and
  every other byte of the reader's arena is unchanged."""

from __future__ import annotations

import json
import pathlib
import re
import select
import signal
import subprocess
import time

import pytest

from vllm_servers import free_port, metric

PEER = pathlib.Path(__file__).parent / "lmcache_peer.py"
TOKEN = "lmcache-test-token"
MIB = 1 << 20


def ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1."""
    chosen: list[int] = []
    while len(chosen) < n:
        port = free_port()
        if port not in chosen:
            chosen.append(port)
    return chosen


def line_matching(proc: subprocess.Popen, what: re.Pattern, log: pathlib.Path, timeout: float = 120) -> re.Match:
    """The first line of ``proc``'s stdout that ``what`` matches; fails when the process exits
    or ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            found = what.search(line)
            if found:
                return found
        elif proc.poll() is not None:
            break
    pytest.fail(f"no line matching {what.pattern!r} (exit {proc.poll()}); {log}:\n{tail(log)}")


def tail(path: pathlib.Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def interruptible() -> None:
    """In a child before it runs: SIGINT's default action, which Python turns into
    KeyboardInterrupt (a shell starts a background job, as scripts/test starts pytest, with
    SIGINT ignored, and its children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.parametrize("transport", ["zmq-tcp", "ucx"])
def test_lmcache_benchmark_reads_through_kvferry(lmcache, tmp_path, transport):
    python, env = lmcache
    env = env | {"KVFERRY_TOKEN": TOKEN, "KVFERRY_TRANSPORT": transport}
    if transport == "ucx":
        env |= {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
    url, control, listen = ports(3)
    objects, iters, warmup, object_mib = 8, 3, 1, 1
    common = ["--transfer-channel-type", "kvferry", "--url", f"127.0.0.1:{url}", "--control-url",
              f"127.0.0.1:{control}", "--page-size", "64KB", "--object-size", f"{object_mib}MB", "--num-objects", str(objects)]
    launcher = [python, "-m", "kvferry.lmcache", "benchmark"]
    server_log, client_log = tmp_path / "server.log", tmp_path / "client.log"
    server = subprocess.Popen(
        [*launcher, "--role", "server", *common, "--buffer-size", "32MB", "--num-source-objects", "16",
         "--server-timeout", "300"],
        stdout=subprocess.PIPE, stderr=open(server_log, "wb"), text=True, env=env, start_new_session=True,
        preexec_fn=interruptible,
    )
    try:
        line_matching(server, re.compile(r"\[server\] ready"), server_log)
        client = subprocess.run(
            [*launcher, "--role", "client", *common, "--listen-url", f"127.0.0.1:{listen}", "--iters", str(iters),
             "--warmup", str(warmup), "--verify"],
            stdout=subprocess.PIPE, stderr=open(client_log, "wb"), text=True, env=env, timeout=300,
        )
        print(client.stdout)
        assert client.returncode == 0, f"{client.stdout}\n{tail(client_log)}"
        assert f"verify OK: {objects} objects match" in client.stdout, client.stdout

        # The server's channel names its agents; its prefill agent served every byte read.
        found = re.search(r"prefill agent api (\S+), decode agent api \S+ \(data (\S+)\)", server_log.read_text())
        assert found, tail(server_log)
        prefill_api, data_endpoint = found.groups()
        sent = metric(prefill_api, "kvferry_kv_bytes_total", 'direction="sent"')
        assert sent == objects * object_mib * MIB * (iters + warmup)
        assert metric(prefill_api, "kvferry_rooms_total", 'state="success"') == objects * (iters + warmup)
        assert metric(prefill_api, "kvferry_room_failures_total") == 0
        assert data_endpoint.startswith("ucx" if transport == "ucx" else "tcp://"), data_endpoint

        # SIGINT ends the benchmark server's wait; it closes the channel and exits.
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0, tail(server_log)
    finally:
        stop([server])


def test_lmcache_channel_bad_input(lmcache, tmp_path):
    python, env = lmcache
    align = 4096
    good = {"seed": 1, "size": 4 * MIB}
    dying = {"seed": 2, "size": 16 * MIB}
    peers: list[subprocess.Popen] = []
    try:
        for name, peer, port in zip(("good", "dying"), (good, dying), ports(2)):
            peer["url"] = f"127.0.0.1:{port}"
            log = tmp_path / f"{name}.log"
            proc = subprocess.Popen(
                [python, str(PEER), "serve", json.dumps(peer | {"align": align})],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
                env=env | {"KVFERRY_TOKEN": TOKEN},
            )
            peers.append(proc)
            peer["log"] = log
        for peer, proc in zip((good, dying), peers):
            ready = json.loads(line_matching(proc, re.compile(r'^\{"event": "ready".*'), peer["log"]).group(0))
            peer |= ready

        reader_url, stranger_url, wary_url, narrow_url, stalled_url = ports(5)
        cfg = {
            "align": align, "size": 16 * MIB, "url": f"127.0.0.1:{reader_url}",
            "stranger_url": f"127.0.0.1:{stranger_url}", "wary_url": f"127.0.0.1:{wary_url}",
            "narrow_url": f"127.0.0.1:{narrow_url}", "stalled_url": f"127.0.0.1:{stalled_url}", "token": TOKEN,
            "good": {k: good[k] for k in ("url", "seed", "size")},
            "dying": {k: dying[k] for k in ("url", "seed", "size", "pid")},
            "dying_objects": 40, "dying_object_bytes": 256 * 1024,
        }
        reader_log = tmp_path / "reader.log"
        # The reader's token comes from the factory's argument only: its second context has none.
        reader_env = {k: v for k, v in env.items() if k != "KVFERRY_TOKEN"}
        reader = subprocess.run([python, str(PEER), "read", json.dumps(cfg)], stdout=subprocess.PIPE,
                                stderr=open(reader_log, "wb"), text=True, env=reader_env, timeout=300)
        assert reader.returncode == 0, tail(reader_log)
        out = json.loads(reader.stdout.strip().splitlines()[-1])
        print(json.dumps(out, indent=1))
        log = reader_log.read_text(errors="replace")

        # Each bad remote object failed alone, with its reason logged; the good ones landed.
        assert out["mixed"]["mask"] == [True, False, True, False, False, True]
        failed = dict(re.findall(rf"at {re.escape(cfg['url'])}: read 0 from {re.escape(good['url'])}: "
                                 r"object (\d+) failed: (\S+): ", log))
        assert sorted(failed) == ["1", "3", "4"], log
        assert failed == {"1": "bad_message", "3": "bad_message", "4": "bad_address"}, failed
        assert out["after"]["mask"] == [True, True]
        assert out["last"]["mask"] == [True]

        # Local objects outside the arena, or not whole pages: ValueError.
        assert all(out["value_errors"].values()), out["value_errors"]
        # Remote objects of another size, or past any page a read names: those objects fail.
        assert out["peer_sizes"] == [False, False], out["peer_sizes"]
        assert re.search(r"object 0 failed: bad_address: remote object of 8192 bytes is 2 pages", log), log
        assert re.search(r"object 1 failed: bad_address: remote object at page \d+ of 1 pages is beyond", log), log

        # A reader without the token gets nothing, and its arena stays as it was.
        assert out["stranger"]["mask"] == [False]
        assert out["stranger_untouched"]
        # (refused by the peer's registry, which it asks first: the lookup is refused, 401)
        assert re.search(rf"at {re.escape(cfg['stranger_url'])}: read 0 from {re.escape(good['url'])}: "
                         r"object 0 failed: unauthorized: .*unauthorized", log), log

        # A reader that does not trust the peer's registry never asks it.
        assert out["wary"] and "127.0.0.1:" in out["wary"], out["wary"]
        # Objects past the decode agent's room limit wait in the task, then land.
        assert out["narrow"]["mask"] == [True] * 6
        assert out["narrow"]["most_waiting"] > 0
        assert out["narrow"]["mismatches"] == 0

        # A read from a stopped peer, nothing else noticing it for 60 s: the 1 s read timeout
        # aborted its rooms, both objects failed, nothing landed.
        stalled = out["stalled"]
        print(f"a read from a stopped peer finished in {stalled['seconds']:.2f} s (read timeout 1 s)")
        assert stalled["mask"] == [False, False], stalled
        assert out["stalled_untouched"]
        assert stalled["seconds"] < 30, stalled
        assert re.search(rf"at {re.escape(cfg['stalled_url'])}: read 0 from {re.escape(dying['url'])} "
                         r"still moving after 1 s: its 2 rooms aborted", log), log
        assert len(re.findall(rf"at {re.escape(cfg['stalled_url'])}: read 0 from .*: object \d failed: aborted", log)) == 2, log

        # The peer killed once part of a read from it had landed: the read finished, what
        # landed is right (below), the rest failed.
        dying_read = out["dying"][-1]
        assert "after_kill_s" in dying_read, f"every read finished before the kill: {out['dying']}"
        assert dying_read["in_flight_at_kill"] > 0
        assert any(dying_read["mask"]) and not all(dying_read["mask"]), dying_read
        assert dying_read["after_kill_s"] < 30
        assert re.search(r"object \d+ failed: peer_dead: ", log), log

        # Every landed byte is the peer's, every other byte of the arena is poison.
        assert out["mismatches"] == 0, out
        # kvferry moved exactly the bytes of the objects that landed.
        from_good = sum(out[k]["bytes"] for k in ("mixed", "after", "last"))
        sent = metric(good["prefill_api"], "kvferry_kv_bytes_total", 'direction="sent"')
        assert sent == from_good + out["narrow"]["bytes"]
        # (and the parts of the dying peer's failed objects that landed before it died)
        assert out["received_bytes"] >= from_good + sum(r["bytes"] for r in out["dying"])
        assert out["clients"] == 2

        peers[0].stdin.close()
        assert peers[0].wait(timeout=60) == 0, tail(good["log"])
        assert peers[1].wait(timeout=60) == -signal.SIGKILL
    finally:
        stop(peers)
