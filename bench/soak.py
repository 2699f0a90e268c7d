"""Soak-and-fault run: many kinds of clients at once while the engine, Redis and the
gateway are killed and restarted; then check that nothing was lost or stored twice.

    python bench/soak.py [--duration 600] [--ci] [--json] [--model PATH] [--users 6] [--seed 0]

``--ci`` is the 60-second version (``--duration 60``, fewer users). Starts its own
``redis-server`` (append-only file, fsync always) on a free port and ``python -m gateway``
with its supervised local engine (the bundled SmolLM2 unless ``--model``), logging to
files under a temporary folder. Clients, all at once until the time is up:

* browser sockets (each its own user): chats with random Stop, abrupt disconnects
  followed by a reload that resumes the reply, deletes while streaming, and regenerate
  races from two tabs of the same user;
* OpenAI clients, streaming and not (``POST /v1/chat/completions``);
* the terminal client (``python -m gateway.client``);
* a ``/metrics`` scraper.

Faults, spread over the run: the engine is killed with SIGKILL (the gateway's supervisor
restarts it), Redis is killed with SIGKILL and restarted on its append-only file, and the
gateway is stopped (SIGTERM) and started again. After the run (when every reply has
ended) it checks and reports: every reply a client saw complete (``done`` with
``stop``/``length``) is stored exactly once with the same text, unless the client deleted
its chat or regenerated it; no message id is stored twice; every stored ``partial`` reply
has a ``cut_reason``; the engine's idle identity (``blocks_free + blocks_evictable ==
num_blocks``, nothing running); the memory growth of each process (RSS after warm-up vs
at the end); and that no log holds a traceback. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parent.parent
COOKIE = "chat_uid"
PROMPTS = ["Say hi.", "Name a colour.", "Count to five.", "What is 2+2?", "Tell me a short story about a cat.",
           "Give me three words that rhyme with day."]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int | None) -> float | None:
    """The resident memory of process ``pid`` in MiB (None when it is gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(p.name))
    return out


@dataclass
class Ledger:
    """What the clients saw, to check against what Redis holds afterwards."""

    requests: Counter = field(default_factory=Counter)  # attempts by kind
    served: Counter = field(default_factory=Counter)  # answered as asked, by kind
    errors: Counter = field(default_factory=Counter)  # "kind:code"
    faults: Counter = field(default_factory=Counter)
    complete: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # message id -> (cookie, sid, text)
    replaced: set[str] = field(default_factory=set)  # message ids a later regenerate replaced
    deleted: set[str] = field(default_factory=set)  # chat ids the clients deleted
    cancels: int = 0
    cookies: set[str] = field(default_factory=set)


class Cluster:
    """Redis and the gateway (with its local engine) as child processes of this run."""

    def __init__(self, work: Path, model: str | None) -> None:
        self.work = work
        self.model = model
        self.redis_port, self.port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.redis: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None
        self.gateway_starts = 0

    def start_redis(self) -> None:
        (self.work / "redis").mkdir(exist_ok=True)
        log = open(self.work / "redis.log", "a")
        self.redis = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.redis_port), "--dir", str(self.work / "redis"),
             "--appendonly", "yes", "--appendfsync", "always", "--save", ""], stdout=log, stderr=log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if subprocess.run(["redis-cli", "-p", str(self.redis_port), "ping"], capture_output=True,
                              text=True).stdout.strip() == "PONG":
                return
            time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def kill_redis(self) -> None:
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(10)

    def start_gateway(self, timeout_s: float = 600) -> None:
        self.gateway_starts += 1
        log = open(self.work / f"gateway-{self.gateway_starts}.log", "w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "LIMIT_MAX_MESSAGES_PER_MINUTE": "100000",
               "LIMIT_MAX_GENERATIONS_PER_USER": "16", "API_KEY": "soak"}
        cmd = [sys.executable, "-m", "gateway", "--port", str(self.port), "--data-dir", str(self.work / "data"),
               "--redis-url", f"redis://127.0.0.1:{self.redis_port}/0", "--log-level", "warning",
               "--engine-args", "--threads 1"]
        if self.model:
            cmd += ["--model", self.model]
        self.gateway = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited; see {log.name}")
            try:
                if httpx.get(self.base + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("the gateway did not become ready")

    def stop_gateway(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(signal.SIGTERM)
            try:
                self.gateway.wait(60)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait(10)

    def engine_pid(self) -> int | None:
        if self.gateway is None:
            return None
        kids = child_pids(self.gateway.pid)
        for k in kids:
            try:
                if b"engine" in Path(f"/proc/{k}/cmdline").read_bytes():
                    return k
            except OSError:
                pass
        return None

    def pids(self) -> dict[str, int | None]:
        return {"gateway": self.gateway.pid if self.gateway else None, "engine": self.engine_pid(),
                "redis": self.redis.pid if self.redis else None}

    def close(self) -> None:
        self.stop_gateway()
        self.kill_redis()


# ---- clients -----------------------------------------------------------------------------


async def new_cookie(base: str) -> str:
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.get(base + "/api/config")
        return r.cookies[COOKIE]


async def read_until_end(ws: Any, rid: str | None, timeout: float = 60) -> tuple[dict | None, list[dict]]:
    """Frames until the reply ends; returns (terminal frame, all frames)."""
    frames = []
    while True:
        f = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        frames.append(f)
        if f["type"] == "start" and rid is None:
            rid = f["request_id"]
        if f["type"] in ("done", "error") and (f.get("request_id") in (rid, None)):
            return f, frames


async def browser_user(cl: Cluster, led: Ledger, deadline: float, rng: random.Random) -> None:
    """One user in the browser: chats, Stop, drops, reloads, deletes and regenerate races."""
    cookie = None
    while cookie is None and time.monotonic() < deadline:
        try:
            cookie = await new_cookie(cl.base)
        except (httpx.HTTPError, KeyError):
            await asyncio.sleep(1)
    if cookie is None:
        return
    led.cookies.add(cookie)
    headers = {"Cookie": f"{COOKIE}={cookie}"}
    sid: str | None = None
    while time.monotonic() < deadline:
        action = rng.choice(["chat", "chat", "chat", "stop", "drop", "delete", "race"])
        led.requests[f"browser:{action}"] += 1
        try:
            async with connect(cl.base.replace("http", "ws") + "/ws", origin=cl.base, additional_headers=headers,
                               open_timeout=10) as ws:
                frame: dict[str, Any] = {"type": "chat", "content": rng.choice(PROMPTS),
                                         "params": {"max_tokens": rng.randint(4, 24), "temperature": 0.7}}
                if sid and rng.random() < 0.7:
                    frame["session_id"] = sid
                if action == "race" and sid:
                    await race(cl, led, ws, headers, sid)
                    continue
                await ws.send(json.dumps(frame))
                first = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if first["type"] == "error":
                    led.errors[f"browser:{first['code']}"] += 1
                    await asyncio.sleep(0.5)  # a fault is being ridden out: do not spin
                    continue
                rid, sid = first["request_id"], first["session_id"]
                if action == "stop":
                    await ws.send(json.dumps({"type": "cancel", "request_id": rid}))
                    led.cancels += 1
                    end, _ = await read_until_end(ws, rid)
                    led.served["browser:stop"] += end is not None and end["type"] == "done"
                    continue
                elif action == "drop":
                    ws.transport.abort()  # an abrupt disconnect mid-reply; the reply goes on
                    await reload_and_resume(cl, led, headers, sid)
                    led.served["browser:drop"] += 1
                    continue
                elif action == "delete":
                    async with httpx.AsyncClient(base_url=cl.base, cookies={COOKIE: cookie}, timeout=30) as c:
                        r = await c.delete(f"/api/sessions/{sid}")
                    led.deleted.add(sid)
                    led.served["browser:delete"] += r.status_code == 204
                    sid = None
                    continue
                end, frames = await read_until_end(ws, rid)
                text = "".join(f.get("text", "") for f in frames if f["type"] == "delta" and f["request_id"] == rid)
                record(led, cookie, first, end, text, f"browser:{action}")
                if end is not None and end["type"] == "error" and "session_id" not in frame:
                    sid = None  # a refused first turn takes its new chat with it (as the page drops it)
        except Exception as e:  # faults drop connections (refused, reset, closed 1012)
            led.errors[f"browser:{type(e).__name__}"] += 1
            await asyncio.sleep(0.5)


def record(led: Ledger, cookie: str, start: dict, end: dict | None, text: str | None = None,
           kind: str = "browser:chat") -> None:
    """Note a reply's end: a complete one joins the ledger (checked against Redis later)."""
    if end is None:
        return
    if end["type"] == "error":
        led.errors[f"{kind}:{end['code']}"] += 1
        return
    led.served[kind] += 1
    if end.get("finish_reason") in ("stop", "length"):
        led.complete[end["message_id"]] = (cookie, end["session_id"], text if text is not None else "")


async def reload_and_resume(cl: Cluster, led: Ledger, headers: dict[str, str], sid: str) -> None:
    """A reload: read the chat; resume its reply in progress, if any, to its end."""
    cookie = headers["Cookie"].split("=", 1)[1]
    async with httpx.AsyncClient(base_url=cl.base, cookies={COOKIE: cookie}, timeout=30) as c:
        body = (await c.get(f"/api/sessions/{sid}")).json()
    active = body.get("active")
    if not active:
        return
    async with connect(cl.base.replace("http", "ws") + "/ws", origin=cl.base, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "resume", "request_id": active["request_id"], "last_seq": 0}))
        end, frames = await read_until_end(ws, active["request_id"])
    text = "".join(f.get("text", "") for f in frames if f["type"] == "delta")
    record(led, cookie, {}, end, text, "browser:reload")


async def race(cl: Cluster, led: Ledger, ws: Any, headers: dict[str, str], sid: str) -> None:
    """Two tabs regenerate the same reply at once: one wins, the other gets busy/conflict."""
    cookie = headers["Cookie"].split("=", 1)[1]
    async with httpx.AsyncClient(base_url=cl.base, cookies={COOKIE: cookie}, timeout=30) as c:
        body = (await c.get(f"/api/sessions/{sid}")).json()
    msgs = body.get("messages", [])
    if not msgs or msgs[-1]["role"] != "assistant" or body.get("active"):
        return
    last = msgs[-1]["id"]
    async with connect(cl.base.replace("http", "ws") + "/ws", origin=cl.base, additional_headers=headers) as ws2:
        frame = json.dumps({"type": "regenerate", "session_id": sid, "message_id": last,
                            "params": {"max_tokens": 8}})
        await asyncio.gather(ws.send(frame), ws2.send(frame))
        for sock in (ws, ws2):
            first = json.loads(await asyncio.wait_for(sock.recv(), 60))
            if first["type"] == "error":
                led.errors[f"browser:race:{first['code']}"] += 1
                continue
            led.replaced.add(last)
            end, frames = await read_until_end(sock, first["request_id"])
            text = "".join(f.get("text", "") for f in frames if f["type"] == "delta")
            record(led, cookie, first, end, text, "browser:race")


async def openai_client(cl: Cluster, led: Ledger, deadline: float, rng: random.Random) -> None:
    """OpenAI requests, streaming and not."""
    async with httpx.AsyncClient(base_url=cl.base, timeout=120, headers={"Authorization": "Bearer soak"}) as c:
        while time.monotonic() < deadline:
            stream = rng.random() < 0.5
            kind = "openai:stream" if stream else "openai:plain"
            led.requests[kind] += 1
            body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": rng.randint(4, 16),
                    "stream": stream}
            try:
                r = await c.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    led.errors[f"{kind}:{r.json()['error'].get('code')}"] += 1
                    await asyncio.sleep(0.5)
                elif stream and b"data: [DONE]" not in r.content:
                    led.errors[f"{kind}:cut"] += 1
                else:
                    led.served[kind] += 1
            except (httpx.HTTPError, ValueError) as e:
                led.errors[f"{kind}:{type(e).__name__}"] += 1
                await asyncio.sleep(0.5)


async def terminal_client(cl: Cluster, led: Ledger, deadline: float) -> None:
    """The terminal client, one question at a time."""
    cookie_file = cl.work / "terminal-cookie"
    while time.monotonic() < deadline:
        led.requests["terminal"] += 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.client", "--url", cl.base.replace("http", "ws") + "/ws", "--max-tokens",
            "8", "--cookie-file", str(cookie_file), "Say hi.", cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        led.served["terminal"] += proc.returncode == 0
        if proc.returncode != 0:
            m = re.search(rb"error \((\w+)\)", err)
            led.errors[f"terminal:{m.group(1).decode() if m else 'unreachable'}"] += 1
        await asyncio.sleep(2)


async def scraper(cl: Cluster, led: Ledger, deadline: float) -> None:
    """``GET /metrics`` once a second."""
    async with httpx.AsyncClient(base_url=cl.base, timeout=10, headers={"Authorization": "Bearer soak"}) as c:
        while time.monotonic() < deadline:
            led.requests["metrics"] += 1
            try:
                r = await c.get("/metrics")
                led.served["metrics"] += r.status_code == 200
                if r.status_code != 200:
                    led.errors[f"metrics:{r.status_code}"] += 1
            except httpx.HTTPError as e:
                led.errors[f"metrics:{type(e).__name__}"] += 1
            await asyncio.sleep(1)


async def faults(cl: Cluster, led: Ledger, start: float, duration: float) -> None:
    """Engine SIGKILL, Redis SIGKILL + restart, gateway restart, in turn, spread evenly."""
    kinds = ["engine_sigkill", "redis_restart", "gateway_restart"]
    n = max(3, int(duration // 60) * 3)
    for i in range(n):
        await asyncio.sleep(max(0.0, start + duration * (i + 1) / (n + 1) - time.monotonic()))
        kind = kinds[i % 3]
        led.faults[kind] += 1
        if kind == "engine_sigkill":
            pid = cl.engine_pid()
            if pid:
                os.kill(pid, signal.SIGKILL)
        elif kind == "redis_restart":
            cl.kill_redis()
            await asyncio.sleep(2)
            await asyncio.to_thread(cl.start_redis)
        else:
            await asyncio.to_thread(cl.stop_gateway)
            await asyncio.to_thread(cl.start_gateway)


# ---- checks --------------------------------------------------------------------------------


def check_store(cl: Cluster, led: Ledger) -> dict[str, Any]:
    """Compare what the clients saw with what Redis holds (see module doc)."""
    stored: dict[str, dict] = {}
    twice = 0
    partial_without_reason = 0
    partial: Counter[str] = Counter()
    for cookie in led.cookies:
        with httpx.Client(base_url=cl.base, cookies={COOKIE: cookie}, timeout=30) as c:
            for s in c.get("/api/sessions").json()["sessions"]:
                for m in c.get(f"/api/sessions/{s['id']}").json()["messages"]:
                    if m["id"] in stored:
                        twice += 1
                    stored[m["id"]] = m
                    if m.get("status") == "partial":
                        partial[m.get("cut_reason") or "none"] += 1
                        partial_without_reason += not m.get("cut_reason")
    lost = 0
    for mid, (_, sid, text) in led.complete.items():
        if sid in led.deleted or mid in led.replaced:
            continue
        m = stored.get(mid)
        if m is None or m.get("status") != "complete" or (text and m["content"] != text):
            lost += 1
    return {"replies_seen_complete": len(led.complete), "replies_lost": lost, "stored_twice": twice,
            "partial_by_cut_reason": dict(partial), "partial_without_cut_reason": partial_without_reason}


def check_engine(cl: Cluster) -> dict[str, Any]:
    """The engine's idle identity once every reply has ended."""
    deadline = time.monotonic() + 60
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        engines = httpx.get(cl.base + "/api/engine/stats", timeout=10).json()["engines"]
        stats = engines[0].get("stats") or {}
        if stats and stats.get("running") == 0 and stats.get("waiting") == 0:
            break
        time.sleep(0.5)
    free, evictable, total = stats.get("blocks_free"), stats.get("blocks_evictable"), stats.get("num_blocks")
    return {"num_blocks": total, "blocks_free": free, "blocks_evictable": evictable,
            "leaked_blocks": None if total is None else total - (free or 0) - (evictable or 0),
            "running": stats.get("running"), "waiting": stats.get("waiting")}


def tracebacks(work: Path) -> list[str]:
    """Log files under ``work`` that hold a traceback."""
    return [p.name for p in sorted(work.glob("*.log")) if "Traceback" in p.read_text(errors="replace")]


async def cancel_storm(cl: Cluster, n: int, concurrency: int = 8) -> dict[str, Any]:
    """``n`` replies stopped right after they start (on a quiet system, after the faults):
    the KV blocks of every cancelled request must come back."""
    cookie = await new_cookie(cl.base)
    headers = {"Cookie": f"{COOKIE}={cookie}"}
    left = [n]
    outcomes: Counter[str] = Counter()

    async def worker() -> None:
        sid, turns = None, 0
        async with connect(cl.base.replace("http", "ws") + "/ws", origin=cl.base, additional_headers=headers) as ws:
            while left[0] > 0:
                left[0] -= 1
                frame: dict[str, Any] = {"type": "chat", "content": "Tell me a long story about the sea.",
                                         "params": {"max_tokens": 200, "ignore_eos": True}}
                if sid is not None and turns % 50:  # a fresh chat every 50 turns (bounded history)
                    frame["session_id"] = sid
                turns += 1
                await ws.send(json.dumps(frame))
                first = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if first["type"] == "start":
                    sid = first["session_id"]
                if first["type"] == "error":
                    outcomes[first["code"]] += 1
                    continue
                await ws.send(json.dumps({"type": "cancel", "request_id": first["request_id"]}))
                end, _ = await read_until_end(ws, first["request_id"])
                outcomes[end.get("finish_reason", end.get("code", "?")) if end else "?"] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"cancelled": n, "outcomes": dict(outcomes), **await asyncio.to_thread(check_engine, cl)}


async def run(args: argparse.Namespace, cl: Cluster) -> dict[str, Any]:
    led = Ledger()
    rng = random.Random(args.seed)
    start = time.monotonic()
    deadline = start + args.duration
    tasks = [asyncio.create_task(browser_user(cl, led, deadline, random.Random(rng.random())))
             for _ in range(args.users)]
    tasks += [asyncio.create_task(openai_client(cl, led, deadline, random.Random(rng.random()))) for _ in range(2)]
    tasks += [asyncio.create_task(terminal_client(cl, led, deadline)), asyncio.create_task(scraper(cl, led, deadline))]
    warm = asyncio.create_task(asyncio.sleep(min(10.0, args.duration / 6)))
    await warm
    rss_start = {k: rss_mib(p) for k, p in cl.pids().items()}
    fault_task = asyncio.create_task(faults(cl, led, start, args.duration))
    await asyncio.gather(*tasks, return_exceptions=True)
    await fault_task
    if cl.gateway is None or cl.gateway.poll() is not None:
        await asyncio.to_thread(cl.start_gateway)
    # quiescence: readiness, then every reply ended (the engine is idle)
    for _ in range(600):
        try:
            if httpx.get(cl.base + "/readyz", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    engine = await asyncio.to_thread(check_engine, cl)
    storm = await cancel_storm(cl, args.cancels) if args.cancels else None
    rss_end = {k: rss_mib(p) for k, p in cl.pids().items()}
    store = await asyncio.to_thread(check_store, cl, led)
    return {"duration_s": args.duration, "users": args.users, "requests": dict(led.requests),
            "served": dict(led.served),
            "faults": dict(led.faults), "errors": dict(led.errors), "cancels": led.cancels, **store,
            "engine": engine, "cancel_storm": storm, "gateway_restarts": cl.gateway_starts - 1,
            "rss_mib_after_warmup": rss_start, "rss_mib_end": rss_end,
            "logs_with_traceback": tracebacks(cl.work)}


def table(res: dict[str, Any]) -> str:
    """The markdown table of docs/reliability.md."""
    rows = [("duration", f"{res['duration_s']:.0f} s, {res['users']} browser users"),
            ("requests by kind (attempted)", ", ".join(f"{k} {v}" for k, v in sorted(res["requests"].items()))),
            ("served by kind", ", ".join(f"{k} {v}" for k, v in sorted(res["served"].items()))),
            ("faults injected", ", ".join(f"{k} {v}" for k, v in sorted(res["faults"].items()))),
            ("replies seen complete", res["replies_seen_complete"]),
            ("replies lost", res["replies_lost"]), ("completed turns stored twice", res["stored_twice"]),
            ("partial replies by cut_reason", json.dumps(res["partial_by_cut_reason"])),
            ("partial replies without a reason", res["partial_without_cut_reason"]),
            ("cancels (Stop)", res["cancels"]), ("leaked KV blocks", res["engine"]["leaked_blocks"])]
    if res["cancel_storm"]:
        st = res["cancel_storm"]
        rows.append((f"leaked KV blocks after {st['cancelled']} cancels in a row",
                     f"{st['leaked_blocks']} (finish: {json.dumps(st['outcomes'])})"))
    rows += [("errors by kind", ", ".join(f"{k} {v}" for k, v in sorted(res["errors"].items())) or "none"),
             ("logs with a traceback", ", ".join(res["logs_with_traceback"]) or "none")]
    for proc in ("gateway", "engine", "redis"):
        a, b = res["rss_mib_after_warmup"].get(proc), res["rss_mib_end"].get(proc)
        rows.append((f"RSS {proc} (MiB)", f"{a:.0f} -> {b:.0f}" if a and b else f"{a} -> {b} (restarted)"))
    return "| check | result |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 1 when a check fails."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--ci", action="store_true", help="the 60-second version")
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--cancels", type=int, default=1000, help="replies stopped at once after the run (block leaks)")
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    a = p.parse_args(argv)
    if a.ci:
        a.duration, a.users, a.cancels = 60.0, 4, 100
    if shutil.which("redis-server") is None:
        print("error: redis-server is not installed", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    cl = Cluster(work, a.model)
    try:
        cl.start_redis()
        cl.start_gateway()
        res = asyncio.run(run(a, cl))
    finally:
        cl.close()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    ok = (res["replies_lost"] == 0 and res["stored_twice"] == 0 and res["partial_without_cut_reason"] == 0
          and res["engine"]["leaked_blocks"] == 0 and not res["logs_with_traceback"]
          and (not res["cancel_storm"] or res["cancel_storm"]["leaked_blocks"] == 0))
    res["ok"] = ok
    print(json.dumps(res, indent=2) if a.json else table(res))
    if a.keep:
        print(f"logs: {work}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
