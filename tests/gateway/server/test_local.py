"""The one-command local default and the terminal client, as real subprocesses:
``python -m gateway`` (with an engine URL, and starting its own engine), a private
``redis-server`` when none answers, and ``python -m gateway.client``."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from gateway.api.auth import COOKIE_NAME
from gateway.server.local import LocalStartError, ensure_redis

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_private_redis_is_started_when_none_answers(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    said: list[str] = []
    local = ensure_redis(url, tmp_path, say=said.append)
    assert local is not None
    try:
        client = redis.Redis.from_url(url)
        client.set("k", "v")
        assert client.get("k") == b"v" and client.config_get("appendonly")["appendonly"] == "yes"
        client.close()
        assert said and "private Redis" in said[0] and str(tmp_path / "redis") in said[0]
        assert ensure_redis(url, tmp_path) is None  # now one answers: nothing else is started
    finally:
        local.stop()
    assert any((tmp_path / "redis").iterdir())  # its append-only data stays in the data folder


def test_without_redis_or_redis_server_the_message_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on PATH
    with pytest.raises(LocalStartError) as e:
        ensure_redis(f"redis://127.0.0.1:{free_port()}/0", tmp_path)
    assert "apt-get install redis-server" in str(e.value) and "REDIS_URL" in str(e.value)


def start_gateway(args: list[str], env: dict[str, str],
                  timeout: float = 600) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--port", "0", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        m = re.match(r"Chat is ready at (http://127\.0\.0\.1:\d+)", line)
        if m:
            return proc, m.group(1), lines
        if time.monotonic() > deadline:
            break
    reap(proc)
    raise AssertionError("gateway did not get ready:\n" + "\n".join(lines[-30:]))


def stop_gateway(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(60)
    finally:
        reap(proc)


def reap(proc: subprocess.Popen) -> None:
    """Kill ``proc`` if it still runs, wait for it and close its output pipe."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def run_client(base: str, cookie_file: Path, *args: str) -> subprocess.CompletedProcess:
    ws = base.replace("http://", "ws://") + "/ws"
    return subprocess.run([sys.executable, "-m", "gateway.client", "--url", ws, "--cookie-file", str(cookie_file),
                           "--max-tokens", "6", "--temperature", "0", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def gateway_env(redis_url: str, key_prefix: str, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "REDIS_URL": redis_url, "KEY_PREFIX": key_prefix,
            "DATA_DIR": str(tmp_path / "data")}


def test_gateway_command_serves_the_chat_and_the_terminal_client_talks_to_it(engine_url, redis_url, key_prefix,
                                                                              tmp_path):
    proc, base, _ = start_gateway(["--engine", engine_url], gateway_env(redis_url, key_prefix, tmp_path))
    try:
        assert httpx.get(f"{base}/healthz").status_code == 200
        page = httpx.get(f"{base}/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        set_cookie = page.headers["set-cookie"]
        assert set_cookie.startswith(f"{COOKIE_NAME}=") and "HttpOnly" in set_cookie and "SameSite=Lax" in set_cookie
        cookie_file = tmp_path / "cookie"
        first = run_client(base, cookie_file, "Hello!")
        assert first.returncode == 0, first.stderr
        sid = re.search(r"--session (\w+)", first.stderr).group(1)
        second = run_client(base, cookie_file, "--session", sid, "And again?")
        assert second.returncode == 0, second.stderr
        assert sid in second.stderr
        cookie = cookie_file.read_text().strip()
        body = httpx.get(f"{base}/api/sessions/{sid}", cookies={COOKIE_NAME: cookie}).json()
        assert [m["content"] for m in body["messages"][::2]] == ["Hello!", "And again?"]
        assert body["messages"][1]["content"] == first.stdout.strip("\n")
        bad = run_client(base, cookie_file, "--session", "0" * 32, "whose?")
        assert bad.returncode == 1 and "not_found" in bad.stderr
    finally:
        assert stop_gateway(proc) == 0


def local_engine_port(lines: list[str]) -> int | None:
    """The port of the local engine, from the last ``[engine] ... ws://127.0.0.1:PORT``
    line the gateway echoed (None when there is none)."""
    ports = [int(m.group(1)) for line in lines if (m := re.search(r"\[engine\].*ws://127\.0\.0\.1:(\d+)", line))]
    return ports[-1] if ports else None


def child_pids(pid: int) -> list[int]:
    """The direct children of process ``pid`` (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


async def anonymous_engine_answer(port: int, headers: dict[str, str] | None = None) -> int:
    """The HTTP status a WebSocket handshake on the engine's port gets (101: admitted)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    try:
        async with connect(f"ws://127.0.0.1:{port}", additional_headers=headers or {}, open_timeout=10):
            return 101
    except InvalidStatus as e:
        return int(e.response.status_code)


def test_gateway_with_no_engine_url_starts_and_stops_its_own_engine(tiny_model_dir, redis_url, key_prefix, tmp_path):
    """...with the options given in --engine-args (here: int8 weights), behind a link secret
    of its own: an anonymous local client (or a wrong secret) is refused at the handshake,
    and the secret is in the engine's environment, not on its command line."""
    env = gateway_env(redis_url, key_prefix, tmp_path)
    env.pop("ENGINE_SECRET", None)
    proc, base, lines = start_gateway(["--model", str(tiny_model_dir), "--engine-args",
                                       "--dtype bfloat16 --quantization int8"], env)
    engine_port = None
    try:
        engine_port = local_engine_port(lines)
        assert engine_port is not None, lines
        assert any("quantize weights to int8" in line for line in lines), lines
        result = run_client(base, tmp_path / "cookie", "Hi from the one-command default")
        assert result.returncode == 0, result.stderr
        assert asyncio.run(anonymous_engine_answer(engine_port)) == 403
        assert asyncio.run(anonymous_engine_answer(engine_port, {"X-Engine-Secret": "guess"})) == 403
        (engine_pid,) = [c for c in child_pids(proc.pid) if b"engine" in Path(f"/proc/{c}/cmdline").read_bytes()]
        environ = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{engine_pid}/environ").read_bytes().split(b"\0")
                       if b"=" in kv)
        secret = environ[b"ENGINE_SECRET"]
        assert len(secret) >= 32 and secret not in Path(f"/proc/{engine_pid}/cmdline").read_bytes()
        assert asyncio.run(anonymous_engine_answer(engine_port, {"X-Engine-Secret": secret.decode()})) == 101
    finally:
        assert stop_gateway(proc) == 0
    with pytest.raises(OSError):  # the engine went away with the gateway
        socket.create_connection(("127.0.0.1", engine_port), timeout=2).close()


# ---- supervision, signals, clear start-up errors --------------------------------------


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_until(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


async def test_a_killed_local_engine_is_restarted_on_the_same_port_and_chats_work_again(tiny_model_dir,
                                                                                         gateway_factory):
    from gateway.server.local import LocalEngine
    from tests.engine_gate import text_delta
    from tests.fixtures_servers import gate_in_front_of
    from tests.gateway_helpers import chat, read_reply, send

    said: list[str] = []
    engine = LocalEngine(model=str(tiny_model_dir), extra_args=["--num-blocks", "256", "--threads", "1"])
    url = engine.start()
    engine.supervise(say=said.append, backoff_s=(0.2, 2.0))
    gate = gate_in_front_of(engine)  # relays to whichever engine process listens at url
    try:
        gw = gateway_factory(engine_urls=[gate.url])
        cookie = gw.new_cookie()
        async with gw.connect(cookie) as ws:
            gate.pause_on(text_delta())  # killed mid-reply, however fast it writes
            await send(ws, {"type": "chat", "content": "Go on and on.",
                            "params": {"temperature": 0, "max_tokens": 2000, "ignore_eos": True}})
            first_pid = engine.process.pid

            async def kill_on_first_delta(frame, reply):
                if frame["type"] == "delta" and engine.process.pid == first_pid and engine.process.poll() is None:
                    await gate.paused()
                    os.kill(first_pid, signal.SIGKILL)

            cut = await read_reply(ws, on_frame=kill_on_first_delta)
            # the cut reply ends as a stored partial with a reason, not a bare error
            assert cut.done is not None and cut.done["finish_reason"] == "error", cut.error
            assert cut.done["error"]["code"] == "engine_unavailable"
            assert "restart" in cut.done["error"]["message"]
            assert wait_until(lambda: engine.restarts == 1, 120), said
            assert engine.url == url and engine.process.pid != first_pid
            assert any("restarting it on port" in line for line in said), said
            assert wait_until(lambda: bool(gw.state.router.healthy), 60)  # the client reconnected
            again = await chat(ws, "Are you back?", cut.start["session_id"], max_tokens=6)
            assert again.error is None and again.done["finish_reason"] in ("stop", "length"), again.error
        async with gw.http(cookie) as c:
            msgs = (await c.get(f"/api/sessions/{cut.start['session_id']}")).json()["messages"]
        assert msgs[1]["status"] == "partial" and msgs[1]["error"]["code"] == "engine_unavailable"
        assert msgs[1]["content"] == cut.text
    finally:
        gate.close()
        engine.stop()
    assert wait_until(lambda: not port_open(int(url.rsplit(":", 1)[1])), 20)  # stop() stops supervising


def test_sigterm_stops_the_gateway_and_its_engine_and_private_redis(tiny_model_dir, key_prefix, tmp_path):
    redis_port = free_port()
    env = gateway_env(f"redis://127.0.0.1:{redis_port}/0", key_prefix, tmp_path)
    proc, base, lines = start_gateway(["--model", str(tiny_model_dir)], env)
    try:
        engine_port = local_engine_port(lines)
        assert port_open(engine_port) and port_open(redis_port)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        reap(proc)
    assert wait_until(lambda: not port_open(engine_port) and not port_open(redis_port), 20)


def test_children_die_with_a_gateway_killed_by_sigkill(tiny_model_dir, key_prefix, tmp_path):
    redis_port = free_port()
    env = gateway_env(f"redis://127.0.0.1:{redis_port}/0", key_prefix, tmp_path)
    proc, base, lines = start_gateway(["--model", str(tiny_model_dir)], env)
    try:
        engine_port = local_engine_port(lines)
        assert port_open(engine_port) and port_open(redis_port)
        proc.kill()
        proc.wait(30)
    finally:
        reap(proc)
    # PR_SET_PDEATHSIG: the kernel sends them SIGTERM when the gateway dies
    assert wait_until(lambda: not port_open(engine_port) and not port_open(redis_port), 30)


@pytest.mark.parametrize("url, expected", [
    ("redis://127.0.0.1:99999/0", "bad Redis URL 'redis://127.0.0.1:99999/0'"),
    ("notaurl", "bad Redis URL 'notaurl': expected redis://HOST"),
    ("redis://127.0.0.1:6379/x", "the database must be a number"),
    ("redis://192.0.2.1:6379/0", "192.0.2.1 is not this machine"),
])
def test_bad_or_unreachable_redis_urls_give_one_clear_line(url, expected, tmp_path):
    with pytest.raises(LocalStartError) as e:
        ensure_redis(url, tmp_path)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert "not installed" not in str(e.value) and "taken" not in str(e.value)


def test_a_redis_port_taken_by_something_else_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LocalStartError) as e:
            ensure_redis(f"redis://127.0.0.1:{port}/0", tmp_path)
    assert f"port {port} is taken by another program" in str(e.value)


def test_a_taken_gateway_port_is_reported_before_the_engine_loads(redis_url, key_prefix, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "gateway", "--port", str(port), "--model", "/nonexistent"],
                             cwd=ROOT, env=gateway_env(redis_url, key_prefix, tmp_path), capture_output=True,
                             text=True, timeout=60)
    assert res.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr and "--port 8001" in res.stderr
    assert "PORT=8001" in res.stderr and "Traceback" not in res.stderr
    assert "Starting a local engine" not in res.stdout  # refused before any model is loaded


async def test_ctrl_c_mid_reply_logs_no_warning_and_stores_the_reply_as_cut_by_the_shutdown(
        tiny_model_dir, redis_url, key_prefix, tmp_path):
    """Ctrl-C in a terminal signals the gateway and its local engine (one process group)."""
    import json

    from websockets.asyncio.client import connect

    from bench.soak import child_pids
    from gateway.store.keys import Keys

    proc, base, lines = start_gateway(["--model", str(tiny_model_dir)], gateway_env(redis_url, key_prefix, tmp_path))
    try:
        cookie = httpx.get(base + "/api/config", timeout=10).cookies[COOKIE_NAME]
        async with connect(base.replace("http://", "ws://") + "/ws", origin=base,
                           additional_headers={"Cookie": f"{COOKIE_NAME}={cookie}"}) as ws:
            await ws.send(json.dumps({"type": "chat", "content": "Tell me a long story.",
                                      "params": {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}}))
            start = json.loads(await ws.recv())
            while json.loads(await ws.recv())["type"] != "delta":
                pass
            for pid in [proc.pid, *child_pids(proc.pid)]:
                os.kill(pid, signal.SIGINT)
            try:
                async for _ in ws:
                    pass
            except Exception:
                pass  # closed by the shutdown
        assert proc.wait(60) == 0
        assert proc.stdout is not None
        after = proc.stdout.read()
    finally:
        reap(proc)
    assert "WARNING" not in after and "Traceback" not in after and "ERROR" not in after, after
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        stored = [json.loads(m) for m in client.lrange(Keys(key_prefix).session(start["session_id"]) + ":messages",
                                                      0, -1)]
    finally:
        client.close()
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[1]["status"] == "partial" and stored[1]["cut_reason"] in ("gateway_shutdown", "engine_lost")
