"""The internal WebSocket protocol, against a real engine server on the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parents[2]


async def _recv(ws) -> dict:
    """The next frame; a ``step`` frame's items come one by one (as frames of their own)."""
    pending = getattr(ws, "_test_pending", None)
    if pending is None:
        pending = ws._test_pending = []
    while not pending:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if frame["type"] == "step":
            assert frame["items"], "an empty step frame"
            pending.extend(frame["items"])
        else:
            pending.append(frame)
    return pending.pop(0)


async def _until_done(ws, rid: str) -> tuple[list[dict], dict]:
    deltas: list[dict] = []
    while True:
        f = await _recv(ws)
        if f.get("request_id") != rid:
            continue
        if f["type"] == "done":
            return deltas, f
        assert f["type"] == "delta", f
        deltas.append(f)


async def test_hello_then_multiplexed_requests_each_end_with_done(server):
    url, _ = server
    async with connect(url) as ws:
        hello = await _recv(ws)
        assert hello["type"] == "hello" and hello["block_size"] == 16 and hello["max_model_len"] > 0
        for rid in ("a", "b", "c"):
            await ws.send(json.dumps({"type": "generate", "request_id": rid,
                                      "messages": [{"role": "user", "content": f"Hello {rid}"}],
                                      "params": {"max_tokens": 5 + ord(rid) - 97, "temperature": 0,
                                                 "ignore_eos": True}}))
        seen: dict[str, list[dict]] = {"a": [], "b": [], "c": []}
        done: dict[str, dict] = {}
        while len(done) < 3:
            f = await _recv(ws)
            (done.__setitem__(f["request_id"], f) if f["type"] == "done" else seen[f["request_id"]].append(f))
        for rid, n in (("a", 5), ("b", 6), ("c", 7)):
            d = done[rid]
            assert d["usage"]["completion_tokens"] == n == len(d["output_token_ids"])
            assert "".join(x["text"] for x in seen[rid]) + d["text"] == d["output_text"]
            assert d["prompt_token_ids"] and d["finish_reason"] == "length"
            assert set(d["timings"]) >= {"ttft_ms", "tpot_ms", "e2e_ms"}


async def test_bad_frames_get_errors_and_connection_stays_usable(server):
    url, _ = server
    async with connect(url) as ws:
        await _recv(ws)
        bad = ["not json", json.dumps([1, 2]), json.dumps({"type": "nope"}),
               json.dumps({"type": "generate", "request_id": "x", "messages": [], "params": {}}),
               json.dumps({"type": "generate", "request_id": "y", "prompt_token_ids": [1, 2], "params": {"top_p": 0}}),
               json.dumps({"type": "generate", "request_id": "z", "prompt_token_ids": [1, 2], "params": {"bogus": 1}}),
               json.dumps({"type": "generate", "request_id": "w", "prompt_token_ids": [10**9]}),
               json.dumps({"type": "generate", "request_id": "v", "prompt_token_ids": list(range(5, 3000)),
                           "params": {"max_tokens": 10}})]
        codes = []
        for b in bad:
            await ws.send(b)
            f = await _recv(ws)
            assert f["type"] == "error", f
            codes.append(f["code"])
        assert codes[:3] == ["bad_frame"] * 3
        assert codes[-1] == "context_length_exceeded"
        await ws.send(json.dumps({"type": "ping"}))
        assert (await _recv(ws))["type"] == "pong"
        await ws.send(json.dumps({"type": "generate", "request_id": "ok", "prompt_token_ids": [5, 6, 7],
                                  "params": {"max_tokens": 2, "ignore_eos": True}}))
        _, done = await _until_done(ws, "ok")
        assert done["usage"]["completion_tokens"] == 2


async def test_abort_and_closed_connection_free_the_blocks(server):
    url, eng = server
    async with connect(url) as ws:
        await _recv(ws)
        await ws.send(json.dumps({"type": "generate", "request_id": "long", "prompt_token_ids": list(range(100, 140)),
                                  "params": {"max_tokens": 1000, "ignore_eos": True}}))
        f = await _recv(ws)
        assert f["type"] == "delta"
        await ws.send(json.dumps({"type": "abort", "request_id": "long"}))
        _, done = await _until_done(ws, "long")
        assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] < 1000
        await ws.send(json.dumps({"type": "stats"}))
        s = await _recv(ws)
        assert s["type"] == "stats" and s["running"] == 0 and s["blocks_held_by_requests"] == 0
        await ws.send(json.dumps({"type": "generate", "request_id": "orphan", "prompt_token_ids": list(range(200, 230)),
                                  "params": {"max_tokens": 1000, "ignore_eos": True}}))
        await _recv(ws)
    for _ in range(100):  # the close aborts within a step or so
        s = await eng.stats()
        if s["running"] == 0 and s["waiting"] == 0:
            break
        await asyncio.sleep(0.05)
    assert s["running"] == 0 and s["blocks_held_by_requests"] == 0
    assert s["blocks_free"] + s["blocks_evictable"] == s["num_blocks"]


def test_cli_generate_json_prints_text_tokens_usage_and_timings(tiny_model_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(tiny_model_dir), "--prompt",
                        "Hello", "--chat", "--max-tokens", "4", "--json", "--num-blocks", "64"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.strip().splitlines()  # stdout holds the reply only; the engine logs on stderr
    out = json.loads(line)
    assert set(out) >= {"text", "token_ids", "usage", "timings"}
    assert 1 <= len(out["token_ids"]) <= 4 == out["usage"]["completion_tokens"] or out["finish_reason"] == "stop"
    assert " INFO engine.loader: " in r.stderr  # the default level says what it loaded


def test_cli_log_level_warning_keeps_the_loading_lines_out(tiny_model_dir):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--log-level", "warning", "--model",
                        str(tiny_model_dir), "--prompt", "Hello", "--max-tokens", "2", "--json", "--num-blocks", "64"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["usage"]["completion_tokens"] >= 1
    assert "engine.loader" not in r.stderr and " INFO " not in r.stderr


@pytest.mark.parametrize(("args", "env", "expect"), [
    (["serve", "--block-size", "0"], {}, "error (config_error): block_size must be >= 1"),
    (["generate", "--prompt", "x", "--quantization", "int8", "--dtype", "float16"], {},
     "error (config_error): int8 weights compute in bfloat16 or float32, not float16"),
    (["serve"], {"ENGINE_PORT": "ninety"}, "error (config_error): bad environment variable ENGINE_PORT"),
])
def test_cli_bad_settings_are_one_line_config_errors(args, env, expect):
    r = subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), **env), timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith(expect) and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_reports_unknown_model_path_clearly(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", str(tmp_path / "nope"),
                        "--prompt", "x"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2
    assert "error" in r.stderr and "Traceback" not in r.stderr


async def _ready_url(proc: subprocess.Popen) -> str:
    """The ``ws://`` URL a ``_serve_process`` engine prints once it listens.

    Raises:
        AssertionError: it exited first (its stderr is the message).
    """
    while True:
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line, proc.stderr.read()
        if line.startswith("ENGINE READY"):
            return line.split()[-1]


def _serve_process(model_dir, port: int) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    # one token a step (no speculation) and room for one 1500-token reply at a time: the
    # Ctrl-C test's replies run in turn, so some are still live when it interrupts them
    return subprocess.Popen([sys.executable, "-m", "engine", "serve", "--model", str(model_dir), "--port", str(port),
                             "--num-blocks", "128", "--speculative", "off"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def test_cli_serve_on_a_taken_port_says_so_without_a_traceback(tiny_model_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = _serve_process(tiny_model_dir, taken.getsockname()[1])
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "cannot serve on 127.0.0.1" in err and "Traceback" not in err
    assert "engine.loader" not in err  # said before the model loads


async def test_ctrl_c_ends_live_requests_with_abort_and_the_server_exits(tiny_model_dir):
    """``serve`` steps on the main thread: Ctrl-C there still sends every live request
    its final ``abort`` frame before the process exits."""
    with _serve_process(tiny_model_dir, 0) as proc:  # its pipes are closed on the way out
        await _ctrl_c_aborts_live_requests(proc)


async def _ctrl_c_aborts_live_requests(proc: subprocess.Popen) -> None:
    import signal

    try:
        async with connect(await _ready_url(proc)) as ws:
            json.loads(await ws.recv())  # hello
            # eight 1500-token replies: 128 blocks hold one at a time, so they run in turn
            # and some are still live long after the first delta, however fast the engine
            ids = [f"long{i}" for i in range(8)]
            for i, rid in enumerate(ids):
                await ws.send(json.dumps({"type": "generate", "request_id": rid, "prompt_token_ids": [5, 6, 7 + i],
                                          "params": {"max_tokens": 1500, "ignore_eos": True}}))
            assert (await _recv(ws))["type"] == "delta"
            # paused, the engine sends nothing more: read what it sent so far, so the test
            # knows which replies were still live when the Ctrl-C arrives
            proc.send_signal(signal.SIGSTOP)
            finished: dict[str, str] = {}
            try:
                while True:
                    f = await asyncio.wait_for(_recv(ws), 0.5)
                    if f["type"] == "done":
                        finished[f["request_id"]] = f["finish_reason"]
            except asyncio.TimeoutError:
                pass
            assert len(finished) < len(ids) - 2, "the engine ran ahead; the test cannot interrupt it"
            read_before = len(finished)
            # resumed, it meets the pending SIGINT within a step
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGCONT)
            while len(finished) < len(ids):
                f = await _recv(ws)
                if f["type"] == "done":
                    assert f["request_id"] not in finished, "two done frames for one request"
                    finished[f["request_id"]] = f["finish_reason"]
                    assert f["finish_reason"] == "abort" or f["usage"]["completion_tokens"] == 1500, f
            assert list(finished.values()).count("abort") >= 2, (read_before, finished)
        assert await asyncio.to_thread(proc.wait, 30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_kv_events_name_the_pages_a_reply_cached_for_subscribers_only(server):
    from engine.block_hash import namespace_of, prompt_block_hashes

    url, _ = server
    prompt = [7 + (i * 13) % 50 for i in range(40)]  # two whole pages of 16 tokens, then 8
    async with connect(url) as plain, connect(url) as ws:
        json.loads(await plain.recv())  # hello
        hello = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "kv_subscribe"}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert first["type"] == "kv_events" and first.get("reset") is True
        await ws.send(json.dumps({"type": "generate", "request_id": "r", "prompt_token_ids": prompt,
                                  "params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}}))
        ns = namespace_of(hello["weights_id"])
        expect = set(prompt_block_hashes(prompt, hello["block_size"], ns))
        assert len(expect) == 2
        stored: set[int] = set(first["stored"])
        done = False
        while not (done and expect <= stored):
            f = await _recv(ws)
            if f["type"] == "kv_events":
                stored.update(f["stored"])
                stored.difference_update(f["removed"])
            elif f["type"] == "done":
                done = True
        # a gateway that subscribes later gets them in its snapshot
        async with connect(url) as late:
            json.loads(await late.recv())
            await late.send(json.dumps({"type": "kv_subscribe"}))
            snapshot = json.loads(await asyncio.wait_for(late.recv(), 30))
            assert snapshot["reset"] is True and expect <= set(snapshot["stored"])
        # the connection that never subscribed heard nothing of it
        await plain.send(json.dumps({"type": "ping"}))
        assert json.loads(await asyncio.wait_for(plain.recv(), 30))["type"] == "pong"


async def test_kv_events_of_salted_requests_share_no_page_name_beyond_the_declared_part(server):
    """Per-user cache isolation: the pages a salted request caches are named as a gateway
    hashes that request's prompt (its salt and its shared part), and no other salt's
    prompt of the same tokens hashes to any of them past the shared pages."""
    from engine.block_hash import namespace_of, prompt_block_hashes

    url, eng = server
    system = {"role": "system", "content": "You answer in one short sentence and never use lists. " * 3}
    msgs = [system, {"role": "user", "content": "My salary is 734215; is that a lot for a lighthouse keeper?"}]
    async with connect(url) as ws:
        hello = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "kv_subscribe"}))
        stored = set(json.loads(await asyncio.wait_for(ws.recv(), 30))["stored"])
        await ws.send(json.dumps({"type": "generate", "request_id": "a", "messages": msgs, "cache_salt": "A",
                                  "shared_messages": [system],
                                  "params": {"max_tokens": 2, "temperature": 0, "ignore_eos": True}}))
        bs, ns = hello["block_size"], namespace_of(hello["weights_id"])
        done, mine = None, None
        while mine is None or not set(mine[: len(done["prompt_token_ids"]) // bs]) <= stored:
            f = await _recv(ws)
            if f["type"] == "kv_events":
                stored.update(f["stored"])
            elif f["type"] == "done":
                done = f
                shared = eng.prompts.shared_length(done["prompt_token_ids"], [system])
                mine = prompt_block_hashes(done["prompt_token_ids"], bs, ns, "A", shared)
        other = prompt_block_hashes(done["prompt_token_ids"], bs, ns, "B", shared)
        assert shared // bs >= 1
        assert set(other) & stored == set(mine[: shared // bs]), "another salt names a private page alike"


def test_an_engine_without_a_secret_warns_unless_only_loopback_reaches_it(caplog):
    import logging

    from engine.server import warn_without_secret

    with caplog.at_level(logging.INFO, logger="engine.server"):
        for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
            warn_without_secret(host)
        assert caplog.records and all(r.levelno == logging.INFO for r in caplog.records)
        caplog.clear()
        for host in ("0.0.0.0", "::", "10.1.2.3", "engine"):
            warn_without_secret(host)
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 4
    assert all("ENGINE_SECRET" in r.getMessage() for r in caplog.records)


async def test_an_abort_read_together_with_its_generate_stops_the_request_before_it_runs(tiny_model_dir):
    """A ``generate`` and its ``abort`` that reach the engine in one read (sent while it was
    stopped) end the request with ``abort`` and no token: the abort is not lost for
    arriving before the request was registered."""
    with _serve_process(tiny_model_dir, 0) as proc:  # its pipes are closed on the way out
        try:
            await _abort_read_with_its_generate(proc)
        finally:
            proc.kill()
            proc.wait()


async def _abort_read_with_its_generate(proc: subprocess.Popen) -> None:
    import signal

    async with connect(await _ready_url(proc)) as ws:
        json.loads(await ws.recv())  # hello
        proc.send_signal(signal.SIGSTOP)
        try:
            await ws.send(json.dumps({"type": "generate", "request_id": "r", "prompt_token_ids": [5, 6, 7],
                                      "params": {"max_tokens": 1000, "ignore_eos": True}}))
            await ws.send(json.dumps({"type": "abort", "request_id": "r"}))
            await asyncio.sleep(0.2)  # both frames wait in the stopped engine's socket
        finally:
            proc.send_signal(signal.SIGCONT)
        done = None
        while done is None:
            f = await _recv(ws)
            if f["type"] == "done":
                done = f
    assert done["finish_reason"] == "abort" and done["usage"]["completion_tokens"] == 0, done
