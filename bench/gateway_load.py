"""Gateway overhead under many WebSocket clients, against a real engine.

    python bench/gateway_load.py [--quick] [--json] [--write-docs] [--connected 200] [--streaming 32]
                                 [--requests 256] [--max-tokens 64] [--engine ws://... | fake]
                                 [--fake-rate 50]

Starts an engine on the bundled SmolLM2 (unless ``--engine``; ``--engine fake`` starts
``bench/serving_lib/fake_engine.py``, which writes ``--fake-rate`` tokens/s per reply and
computes nothing, so the figures are the gateway's alone) and the real gateway in a
child process (``bench.serving_lib.gateway_proc --tap``), opens ``--connected`` browser
WebSockets (each its own user, cookie and Origin, as the page does), and keeps
``--streaming`` of them generating at once until ``--requests`` replies are done
(``ignore_eos``, greedy, ``--max-tokens`` each).

What the gateway adds per token is measured on one clock: the gateway process records
``time.monotonic_ns()`` when each engine ``delta``/``done`` frame arrives on its engine
connection (``EngineTap``, wrapped around ``EngineClient._dispatch`` without changing the
gateway), and the clients record ``time.monotonic_ns()`` when each browser ``delta``
arrives. CLOCK_MONOTONIC is shared by all processes of a machine, so the difference is
the time spent in the gateway (engine socket -> reply task -> Redis Stream -> socket
tail -> browser socket), plus the client's own scheduling delay (so it is an upper
bound; the client process freezes its start-up objects out of its garbage collector's
reach while the replies run, as the gateway does, so that its own full collections are
not counted). The gateway may coalesce engine frames that waited into one browser delta; an
engine frame is matched to the first browser delta whose cumulative text covers it.

Nothing may be lost: every reply's concatenated deltas must equal the message stored in
Redis (``GET /api/sessions/{id}``) and the engine's own text (from the tap); any
mismatch or error frame counts as an error. Prints a table last; ``--json`` prints one
JSON object instead.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from bench.serving_lib.stats import fmt, summarize  # noqa: E402

COOKIE_NAME = "chat_uid"  # gateway.api.auth.COOKIE_NAME (not imported: the clients are outside the gateway)

TOPICS = ["rivers", "bread", "trains", "the moon", "gardens", "chess", "rain", "bicycles", "music", "clocks",
          "owls", "maps", "glass", "winter", "bridges", "tea"]


@dataclass
class LoadConfig:
    """Shape of one run: sockets open (``connected``), replies generating at once
    (``streaming``), replies in all (``requests``), tokens per reply (``max_tokens``)."""

    connected: int = 200
    streaming: int = 32
    requests: int = 256
    max_tokens: int = 64
    seed: int = 0


@dataclass
class Reply:
    """What one client saw of one reply: browser deltas as ``(seq, t_ns, text)``, the
    ``done`` frame, the stored content read back from the API, and the user's cookie."""

    request_id: str = ""
    session_id: str = ""
    message_id: str = ""
    deltas: list[tuple[int, int, str]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    error: str | None = None
    stored: str | None = None
    cookie: str = field(default="", repr=False)


def gateway_added_ns(engine_frames: Sequence[Sequence[Any]], deltas: Sequence[tuple[int, int, str]]) -> list[int]:
    """Per engine frame with text, the time (ns) from its arrival at the gateway to the
    client's receipt of the browser delta that delivered it.

    Args:
        engine_frames: ``(t_ns, text, n_tokens)`` per engine ``delta``/``done`` frame, in order.
        deltas: ``(seq, t_ns, text)`` per browser delta, in order.
    Returns:
        One duration per engine frame with non-empty text that some delta covered
        (frame ``i`` ends at character ``c_i`` of the reply; it is delivered by the first
        delta whose cumulative text length reaches ``c_i``). Frames no delta covers
        (lost text) are left out; the loss check counts them.
    """
    out: list[int] = []
    ends: list[tuple[int, int]] = []  # (cumulative chars, receipt time) per browser delta
    c = 0
    for _seq, t, text in deltas:
        c += len(text)
        ends.append((c, t))
    j, c = 0, 0
    for t_engine, text, _n in engine_frames:
        if not text:
            continue  # a token that produced no text yet (held-back UTF-8 or stop prefix)
        c += len(text)
        while j < len(ends) and ends[j][0] < c:
            j += 1
        if j == len(ends):
            break
        out.append(ends[j][1] - int(t_engine))
    return out


def check_reply(r: Reply, engine_frames: Sequence[Sequence[Any]] | None) -> str | None:
    """Why a finished reply is wrong, or None: an error frame, a gap in ``seq``, deltas
    that differ from the stored message or from the engine's text."""
    if r.error:
        return r.error
    if r.done is None:
        return "no done frame"
    seqs = [s for s, _t, _x in r.deltas]
    if seqs != list(range(1, len(seqs) + 1)):
        return f"seq not 1..n without gaps: {seqs[:5]}..."
    text = "".join(x for _s, _t, x in r.deltas)
    if r.stored is None or text != r.stored:
        return "streamed text differs from the stored message"
    if engine_frames is not None and text != "".join(f[1] for f in engine_frames):
        return "streamed text differs from the engine's text"
    return None


async def _user_cookie(http: httpx.AsyncClient) -> str:
    """A fresh anonymous user's signed cookie (``GET /api/config`` without a cookie)."""
    http.cookies.clear()  # else the jar would send the previous user's cookie back
    r = await http.get("/api/config")
    r.raise_for_status()
    http.cookies.clear()
    return r.cookies[COOKIE_NAME]


def cpu_user_system_s(pid: int) -> tuple[float, float]:
    """CPU time used so far by process ``pid`` in user mode and in the kernel (seconds;
    Linux ``/proc/PID/stat`` fields 14 and 15), in ticks of the kernel's clock
    (``SC_CLK_TCK``, 10 ms here): a ``--quick`` run's gateway uses only 20-30 of them, so
    their sum is the coarse cross-check of ``thread_cpu_ns``, and their ratio says how
    much of it is system calls (socket writes and reads, ``epoll``).

    Raises:
        OSError: no such process.
    """
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, seconds, in 10 ms ticks) used so far by process ``pid``
    (``cpu_user_system_s``).

    Raises:
        OSError: no such process.
    """
    return sum(cpu_user_system_s(pid))


def schedstat_run_ns(text: str) -> int:
    """The time on the CPU (ns) in one ``/proc/.../schedstat`` line: its first field
    (then come the time waiting for a CPU and the count of time slices).

    Raises:
        ValueError: not a schedstat line.
    """
    fields = text.split()
    if len(fields) != 3:
        raise ValueError(f"not a schedstat line: {text!r}")
    return int(fields[0])


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Each live thread of process ``pid`` and its CPU time so far (ns, exact: the
    scheduler's own account in ``/proc/PID/task/TID/schedstat``, not clock ticks). A
    thread that ends between two readings takes its time with it; ``cpu_ns_between``
    counts such threads.

    Raises:
        OSError: no such process.
    """
    out: dict[int, int] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = schedstat_run_ns(f.read())
        except FileNotFoundError:
            continue  # the thread ended while the folder was read
    return out


def cpu_ns_between(before: dict[int, int], after: dict[int, int]) -> tuple[int, int]:
    """The CPU time (ns) the threads used from the reading ``before`` to ``after`` (both
    ``thread_cpu_ns``), and how many threads of ``before`` had ended by ``after`` (their
    time after ``before`` is not counted; 0 makes the figure exact). A thread that started
    in between counts whole."""
    used = sum(ns - before.get(tid, 0) for tid, ns in after.items())
    return used, sum(1 for tid in before if tid not in after)


async def run_load(base_url: str, cfg: LoadConfig,
                   fetch_tap: Callable[[], Awaitable[dict[str, list[list[Any]]]]],
                   gateway_pid: int | None = None, profile: bool = False) -> dict[str, Any]:
    """Drive the gateway at ``base_url`` (see module doc) and return the results.

    ``fetch_tap`` returns the engine-frame records by request id (``EngineTap.snapshot``
    form). The result holds counts, ``wall_s``, ``deltas_per_s``, ``tokens_per_s``,
    ``added_ms`` (summary of the gateway-added time per engine frame), ``errors`` and
    the first few error reasons; with ``gateway_pid`` (a gateway in its own process) also
    ``gateway_cpu_ms_per_token``: the gateway process's CPU time while the replies ran,
    per token, from the scheduler's nanosecond account of its threads
    (``thread_cpu_ns``; ``gateway_cpu_ns`` the total, ``gateway_threads_ended`` the threads
    whose time was lost by ending meanwhile), and ``gateway_cpu_ms_per_token_ticks``, the
    same from ``/proc/PID/stat``'s 10 ms ticks (the figure before 2026-12-02 10:00 UTC),
    with ``gateway_cpu_system_share``, the kernel's part of those ticks.

    Raises:
        httpx.HTTPError, OSError: the gateway cannot be reached at all.
    """
    ws_url = base_url.replace("http", "ws", 1) + "/ws"
    replies: list[Reply] = []
    errors: list[str] = []
    todo = list(range(cfg.requests))
    gate = asyncio.Semaphore(cfg.streaming)

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        cookies = [await _user_cookie(http) for _ in range(cfg.connected)]

        opened = asyncio.Event()  # set once every socket is open (or failed to open)
        settled = 0

        def settle() -> None:
            nonlocal settled
            settled += 1
            if settled == cfg.connected:
                opened.set()

        async def client(cookie: str) -> None:
            session_id: str | None = None
            try:
                ws = await connect(ws_url, origin=base_url, additional_headers={"Cookie": f"{COOKIE_NAME}={cookie}"},
                                   max_size=None, open_timeout=60, ping_interval=None, compression=None)
            finally:
                settle()  # opened or failed: either way the others need not wait for it
            try:
                await opened.wait()  # every socket is open before any reply starts
                while todo:
                    async with gate:
                        if not todo:
                            break
                        n = todo.pop()
                        frame: dict[str, Any] = {"type": "chat", "client_msg_id": uuid.uuid4().hex,
                                                 "content": f"Tell me about {TOPICS[n % len(TOPICS)]} ({n}).",
                                                 "params": {"max_tokens": cfg.max_tokens, "temperature": 0.0,
                                                            "ignore_eos": True}}
                        if session_id:
                            frame["session_id"] = session_id
                        r = Reply(cookie=cookie)
                        replies.append(r)
                        await ws.send(json.dumps(frame))
                        while True:
                            raw = await asyncio.wait_for(ws.recv(), 300)
                            t = time.monotonic_ns()
                            msg = json.loads(raw)
                            kind = msg.get("type")
                            if kind == "delta":
                                r.deltas.append((int(msg["seq"]), t, msg["text"]))
                            elif kind == "start":
                                r.request_id, r.session_id = msg["request_id"], msg["session_id"]
                                r.message_id = msg["message_id"]
                                session_id = msg["session_id"]
                            elif kind == "done":
                                r.done = msg
                                if msg.get("finish_reason") == "error":
                                    r.error = f"done with error: {msg.get('error')}"
                                break
                            elif kind == "error":
                                r.error = f"error frame {msg.get('code')}: {msg.get('message')}"
                                break
            finally:
                await ws.close()

        # the clients' own full collections would walk everything imported so far (tens
        # of ms, counted as the gateway's): out of the collector's reach while the replies
        # run (see module doc); done before any socket opens, so it delays no reply
        gc.collect()
        gc.freeze()
        tasks = [asyncio.create_task(client(c)) for c in cookies]
        await opened.wait()
        if profile:
            (await http.post("/_bench/profile/start")).raise_for_status()
        us0 = cpu_user_system_s(gateway_pid) if gateway_pid else (0.0, 0.0)
        threads0 = thread_cpu_ns(gateway_pid) if gateway_pid else {}
        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            gc.unfreeze()  # a caller's process (a test) collects them again
        wall = time.perf_counter() - t0
        cpu_ns, ended = cpu_ns_between(threads0, thread_cpu_ns(gateway_pid)) if gateway_pid else (None, 0)
        us1 = cpu_user_system_s(gateway_pid) if gateway_pid else (0.0, 0.0)
        cpu = (us1[0] - us0[0]) + (us1[1] - us0[1]) if gateway_pid else None
        if profile:
            (await http.post("/_bench/profile/stop")).raise_for_status()
        errors += [f"client failed: {e!r}" for e in results if isinstance(e, BaseException)]

        # read every stored reply back, as its owner (the user of the socket that sent it)
        for r in replies:
            if r.session_id:
                body = (await http.get(f"/api/sessions/{r.session_id}",
                                       headers={"Cookie": f"{COOKIE_NAME}={r.cookie}"})).json()
                r.stored = next((m.get("content") for m in body.get("messages", [])
                                 if m.get("id") == r.message_id), None)

    tap = await fetch_tap()
    added: list[float] = []
    for r in replies:
        frames = tap.get(r.request_id)
        why = check_reply(r, frames)
        if why:
            errors.append(f"{r.request_id or '?'}: {why}")
        if frames:
            added += [ns / 1e6 for ns in gateway_added_ns(frames, r.deltas)]
    n_deltas = sum(len(r.deltas) for r in replies)
    n_tokens = sum(int((r.done or {}).get("usage", {}).get("completion_tokens", 0)) for r in replies)
    n_frames = sum(len(tap.get(r.request_id, [])) for r in replies)
    return {"config": asdict(cfg), "replies": len(replies), "wall_s": wall, "browser_deltas": n_deltas,
            "engine_frames": n_frames, "tokens": n_tokens, "deltas_per_s": n_deltas / wall,
            "tokens_per_s": n_tokens / wall, "added_ms": summarize(added),
            "gateway_cpu_ms_per_token": cpu_ns / 1e6 / n_tokens if cpu_ns is not None and n_tokens else None,
            "gateway_cpu_ns": cpu_ns, "gateway_threads_ended": ended,
            "gateway_cpu_ms_per_token_ticks": cpu * 1000 / n_tokens if cpu is not None and n_tokens else None,
            "gateway_cpu_system_share": (us1[1] - us0[1]) / cpu if cpu else None,
            "errors": len(errors) + max(0, cfg.requests - len(replies)), "error_samples": errors[:5]}


def table(res: dict[str, Any]) -> str:
    """The result as a Markdown table (what is printed last and pasted into the docs)."""
    c, a = res["config"], res["added_ms"]
    rows = [("sockets connected / streaming at once", f"{c['connected']} / {c['streaming']}"),
            ("replies x max tokens", f"{res['replies']} x {c['max_tokens']}"),
            ("wall time (s)", fmt(res["wall_s"], 1)),
            ("browser deltas/s", fmt(res["deltas_per_s"], 0)),
            ("tokens/s through the gateway", fmt(res["tokens_per_s"], 0)),
            ("engine frames / browser deltas", f"{res['engine_frames']} / {res['browser_deltas']}"),
            ("gateway-added ms per token: p50", fmt(a["p50"], 2)),
            ("gateway-added ms per token: p90", fmt(a["p90"], 2)),
            ("gateway-added ms per token: p99", fmt(a["p99"], 2)),
            ("gateway-added ms per token: max", fmt(a["max"], 2)),
            ("gateway process CPU ms per token", fmt(res.get("gateway_cpu_ms_per_token"), 4)),
            ("the same from 10 ms clock ticks", fmt(res.get("gateway_cpu_ms_per_token_ticks"), 3)),
            ("errors (incl. lost or altered text)", str(res["errors"]))]
    return "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


async def _cleanup_redis(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    r = aioredis.from_url(url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{prefix}*", count=1000)]
        for i in range(0, len(keys), 500):
            await r.delete(*keys[i:i + 500])
    finally:
        await r.aclose()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 0, or 1 when any error was seen."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="50 sockets, 16 streaming, 64 replies of 32 tokens")
    p.add_argument("--json", action="store_true")
    p.add_argument("--write-docs", action="store_true", help="put the table into docs/benchmarks.md")
    p.add_argument("--connected", type=int, default=None)
    p.add_argument("--streaming", type=int, default=None)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--engine", default=None,
                   help="use this engine instead of starting one; 'fake': a fake engine that writes "
                        "--fake-rate tokens/s per reply and computes nothing, so the gateway alone is measured")
    p.add_argument("--fake-rate", type=float, default=50.0, help="tokens/s per reply of --engine fake")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop",
                   help="the gateway's event loop (python -m gateway runs uvloop's when installed)")
    p.add_argument("--model", default=None, help="model folder for the started engine (default: SmolLM2)")
    p.add_argument("--threads", type=int, default=2, help="engine torch threads")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--profile", default=None, metavar="PATH",
                   help="run the gateway under cProfile while the replies run (not the cookie and read-back "
                        "requests), write its stats to PATH and print the top functions (the profiler slows "
                        "the gateway: its figures are not the overhead's)")
    a = p.parse_args(argv)
    base = LoadConfig(50, 16, 64, 32) if a.quick else LoadConfig()
    cfg = LoadConfig(a.connected or base.connected, a.streaming or base.streaming,
                     a.requests or base.requests, a.max_tokens or base.max_tokens)

    from bench.serving_lib.procs import start_child

    load_before = os.getloadavg()

    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    prefix = f"bench-gwload-{uuid.uuid4().hex[:8]}:"
    children = []
    try:
        engine_url = a.engine
        if engine_url == "fake":
            eng = start_child([sys.executable, "-m", "bench.serving_lib.fake_engine", "--rate", str(a.fake_rate)],
                              r"ENGINE READY (ws://\S+)", 60, env, str(ROOT))
            children.append(eng)
            engine_url = eng.match.group(1)
        elif engine_url is None:
            cmd = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", "0",
                   "--threads", str(a.threads)] + (["--model", a.model] if a.model else [])
            eng = start_child(cmd, r"ENGINE READY (ws://\S+)", 600, env, str(ROOT))
            children.append(eng)
            engine_url = eng.match.group(1)
        profiler = ["--profile", a.profile] if a.profile else []
        gw = start_child([sys.executable, "-m", "bench.serving_lib.gateway_proc", *profiler, "--engine", engine_url,
                          "--redis-url", a.redis_url, "--key-prefix", prefix, "--tap", "--loop", a.loop],
                         r"GATEWAY READY (http://\S+)", 120, env, str(ROOT))
        children.append(gw)
        base_url = gw.match.group(1)
        with httpx.Client(base_url=base_url, timeout=30) as h:
            for _ in range(600):  # wait for the gateway's engine connection
                if h.get("/readyz").status_code == 200:
                    break
                time.sleep(0.1)
            h.post("/_bench/tap/install").raise_for_status()

        async def fetch_tap() -> dict[str, list[list[Any]]]:
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as h2:
                return (await h2.get("/_bench/tap")).json()

        res = asyncio.run(run_load(base_url, cfg, fetch_tap, gw.proc.pid, profile=bool(a.profile)))
    finally:
        for c in reversed(children):
            c.stop()
        asyncio.run(_cleanup_redis(a.redis_url, prefix))
    if a.write_docs:
        from bench.serving_lib.docs import replace_block

        command = "python bench/gateway_load.py " + " ".join(argv if argv is not None else sys.argv[1:])
        load = " ".join(f"{x:.1f}" for x in load_before)
        block = f"Command: `{command.strip()}` (load average before the run: {load}).\n\n{table(res)}"
        doc = ROOT / "docs" / "benchmarks.md"
        heading = "## The reply path through the gateway"
        doc.write_text(replace_block(doc.read_text(), heading, block, "gateway_load.py"))
    if a.profile:
        import pstats

        pstats.Stats(a.profile).sort_stats("tottime").print_stats(30)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        if res["error_samples"]:
            print("errors:", *res["error_samples"], sep="\n  ")
        print(table(res))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
