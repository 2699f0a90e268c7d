"""Hostile-client probes against a real gateway process: what each limit answers, and the
gateway's memory under each attack.

    python bench/hostile_probe.py [--json] [--model PATH] [--only NAME ...]

Starts ``python -m gateway`` as ``make run`` does (its own local engine on the bundled
SmolLM2-135M-Instruct unless ``--model``, Redis at ``REDIS_URL`` with a fresh key prefix)
on a free port, with the open-file limit of a default shell (1,024), and prints one row
per probe: what was sent, what came back, and, for the attacks, the gateway's resident
memory (the gateway process alone, sampled every 20 ms from /proc) before and at most
during. The attacks (docs/reliability.md, "Hostile clients"):

* ``cache``: user B sends user A's private prompt, with the true secret and four wrong
  guesses: B's cached tokens and time to the first token for each;
* ``revoke``: a socket and a ``/v1`` stream opened with an access token, then the token
  revoked: how long each stays open;
* ``engine``: an anonymous local client on the local engine's port;
* ``pings``: a client sends WebSocket pings for 20 s and never reads;
* ``frames``: 24 sockets each send a 15 MiB frame;
* ``bodies``: 1,000 clients trickle a request body (one byte a second), while health
  checks come from another address;
* ``hangups``: 1,000 clients hang up in the middle of a request body;

plus the request-head probes (``heads``). ``--only`` runs some of them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.raw_ws import ZERO_MASK, client_frame, handshake  # noqa: E402

HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
PROBES = ("heads", "cache", "revoke", "engine", "pings", "frames", "bodies", "hangups")
GATEWAY_NOFILE = 1024  # a default shell's open-file limit, as in the report that found these


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Peak:
    """The most resident memory of a process while the ``with`` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = self.peak = rss_mib(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> Peak:
        self.before = self.peak = rss_mib(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def text(self) -> str:
        """``before -> peak (+growth) MiB``."""
        return f"{self.before:.0f} -> {self.peak:.0f} MiB (+{self.peak - self.before:.0f})"


def status_of(port: int, payload: bytes, trickle: bytes = b"", every_s: float = 0.5, limit_s: float = 60) -> str:
    """Send ``payload`` (then ``trickle`` every ``every_s`` until the server answers);
    returns the status line, or what happened."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        try:
            s.sendall(payload)
            s.settimeout(every_s if trickle else limit_s)
            deadline = time.monotonic() + limit_s
            while time.monotonic() < deadline:
                try:
                    data = s.recv(4096)
                    return data.split(b"\r\n", 1)[0].decode() if data else "closed without an answer"
                except TimeoutError:
                    s.sendall(trickle)
        except (BrokenPipeError, ConnectionResetError):
            return "connection reset"
    return "no answer"


def big_header(port: int, out: list[str]) -> None:
    """Try to send a 64 MiB header; record how far it got and the answer."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        try:
            s.sendall(HEAD + b"X-Big: ")
            chunk = b"b" * 65536
            while sent < 64 << 20:
                s.sendall(chunk)
                sent += len(chunk)
            s.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            line = s.recv(4096).split(b"\r\n", 1)[0].decode() or "closed"
        except (TimeoutError, ConnectionResetError):
            line = "connection reset"
    out.append(f"{line} after {sent / (1 << 20):.1f} MiB sent")


def ws_open(port: int, cookie: str, source: str = "127.0.0.1") -> socket.socket:
    """A WebSocket handshake on a plain socket from ``source`` (the probe controls
    reading; a 4 KiB receive window); 101 consumed.

    Raises:
        ConnectionError: the handshake was refused.
    """
    return handshake("127.0.0.1", port, f"chat_uid={cookie}", f"http://127.0.0.1:{port}", rcvbuf=4096,
                     source=source, timeout_s=30)


def new_user(base: str) -> str:
    """A fresh anonymous user: its cookie value."""
    return httpx.get(f"{base}/api/config", timeout=60).cookies["chat_uid"]


def metric(base: str, name: str) -> dict[str, float]:
    """The samples of one metric family of ``/metrics``, by their label text."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


# ---- the attacks -------------------------------------------------------------------------


def probe_heads(port: int, base: str, pid: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    answers: list[str] = []
    with Peak(pid) as peak:
        threads = [threading.Thread(target=big_header, args=(port, answers)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    rows.append({"probe": "4 connections each sending a 64 MiB header", "answer": "; ".join(sorted(set(answers))),
                 "memory": peak.text()})
    rows.append({"probe": "a header of 65 KiB (over the 64 KiB cap)",
                 "answer": status_of(port, HEAD + b"X-Big: " + b"b" * (65 << 10) + b"\r\n\r\n")})
    rows.append({"probe": "101 header fields", "answer": status_of(
        port, HEAD + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n")})
    t0 = time.monotonic()
    ans = status_of(port, HEAD + b"X-Slow: ", trickle=b"b" * 10, every_s=0.5)
    rows.append({"probe": "a header trickled 10 bytes every 0.5 s",
                 "answer": f"{ans} after {time.monotonic() - t0:.1f} s"})
    rows.append({"probe": "Host: evil.example (DNS rebinding)", "answer": str(httpx.get(
        base + "/healthz", headers={"Host": f"evil.example:{port}"}, timeout=10).status_code)})
    deep = "[" * 5000 + "]" * 5000
    rows.append({"probe": "5,000-deep JSON to POST /api/sessions", "answer": str(httpx.post(
        base + "/api/sessions", content=deep, timeout=10).status_code)})
    r = httpx.post(base + "/v1/chat/completions", content=json.dumps(
        {"messages": [{"role": "user", "content": "Say hi \ud83d"}]}), timeout=10)
    rows.append({"probe": "a lone surrogate in an OpenAI message",
                 "answer": f"{r.status_code} {r.json()['error']['param']}"})
    r = httpx.get(base + "/healthz", timeout=10)
    rows.append({"probe": "GET /healthz", "answer": f"{r.status_code}, Set-Cookie: {'set-cookie' in r.headers}"})
    return rows


def _ttft(base: str, cookie: str, messages: list[dict[str, str]]) -> tuple[float, int]:
    """(seconds to the first content chunk, cached tokens) of one streamed /v1 request."""
    body = {"messages": messages, "stream": True, "max_tokens": 1, "temperature": 0,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, cached = None, -1
    with httpx.Client(base_url=base, timeout=300) as c, c.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Cookie": f"chat_uid={cookie}"}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content") is not None \
                    and chunk["choices"][0]["delta"].get("role") is None:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (first if first is not None else float("nan")), cached


def probe_cache(port: int, base: str, pid: int) -> list[dict[str, Any]]:
    filler = ("The payroll office keeps the records of every keeper of the Example Point light, with their "
              "shifts, their leave and the notes their supervisors wrote about them over the years. ") * 6

    def chat(secret: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"You are Ada's assistant. Her salary is {secret}. " + filler},
                {"role": "user", "content": "Is that a fair salary? One word."}]

    a = new_user(base)
    _ttft(base, a, chat(1))  # warm-up
    _ttft(base, a, chat(734215))  # A's private prompt is in the cache now
    with Peak(pid) as peak:  # each guess by a user of its own: its earlier guesses are not in its cache
        guesses = {g: _ttft(base, new_user(base), chat(g)) for g in (734215, 734216, 734214, 100000, 999999)}
    own = _ttft(base, a, chat(734215))
    answer = ", ".join(f"{g}{' (true)' if g == 734215 else ''}: {c} cached, {1000 * t:.0f} ms"
                       for g, (t, c) in guesses.items())
    return [{"probe": "other users send user A's private ~250-token prompt (true secret and 4 wrong guesses)",
             "answer": f"{answer}; A's own repeat: {own[1]} cached, {1000 * own[0]:.0f} ms", "memory": peak.text()}]


def probe_revoke(port: int, base: str, pid: int) -> list[dict[str, Any]]:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    cookie = new_user(base)
    tok = httpx.post(f"{base}/api/tokens", json={"name": "probe"}, headers={"Cookie": f"chat_uid={cookie}"},
                     timeout=30).json()
    header = {"X-Chat-Token": tok["token"]}
    ended: dict[str, float] = {}
    sse_last: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"messages": [{"role": "user", "content": "Count to one thousand."}], "stream": True,
                "max_tokens": 2000, "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=base, timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=body,
                                                                     headers=header) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    sse_last[:] = [line]
                    started.set()
        ended["sse"] = time.perf_counter()

    close = "still open"
    with connect(f"ws://127.0.0.1:{port}/ws", additional_headers=header, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "chat", "content": "Tell a very long story about a lighthouse.",
                            "params": {"max_tokens": 2000, "temperature": 0, "ignore_eos": True}}))
        while json.loads(ws.recv(60))["type"] != "delta":
            pass  # the reply streams
        t = threading.Thread(target=stream)
        t.start()
        started.wait(60)
        t0 = time.perf_counter()
        status = httpx.delete(f"{base}/api/tokens/{tok['id']}", headers={"Cookie": f"chat_uid={cookie}"},
                              timeout=30).status_code
        try:
            while True:
                ws.recv(30)
        except ConnectionClosed as e:
            ended["ws"] = time.perf_counter()
            close = f"{e.rcvd.code} '{e.rcvd.reason}'" if e.rcvd else "no close frame"
        except TimeoutError:
            pass
    t.join(30)
    code = json.loads(sse_last[0][6:]).get("error", {}).get("code") if sse_last and sse_last[0] != "data: [DONE]" \
        else "[DONE]"
    ws_ms = f"{1000 * (ended['ws'] - t0):.0f} ms" if "ws" in ended else "never"
    sse_ms = f"{1000 * (ended['sse'] - t0):.0f} ms" if "sse" in ended else "never"
    return [{"probe": "a socket (reply streaming) and a /v1 stream opened with a token, then DELETE /api/tokens/{id}",
             "answer": f"DELETE {status}; socket closed after {ws_ms} ({close}); /v1 stream ended after {sse_ms} "
                       f"(last event: {code})"}]


def probe_engine(port: int, base: str, pid: int, engine_port: int | None) -> list[dict[str, Any]]:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    if engine_port is None:
        return [{"probe": "an anonymous local client on the local engine's port", "answer": "engine port not found"}]
    try:
        with connect(f"ws://127.0.0.1:{engine_port}", open_timeout=10):
            answer = "admitted (101)"
    except InvalidStatus as e:
        answer = f"{e.response.status_code} at the handshake"
    return [{"probe": "an anonymous local client on the local engine's port", "answer": answer}]


def probe_pings(port: int, base: str, pid: int) -> list[dict[str, Any]]:
    s = ws_open(port, new_user(base))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    chunk = client_frame(b"p" * 125, opcode=0x9, mask=ZERO_MASK) * 8000  # about 1 MiB of pings
    pushed, outcome = 0, "still open after 20 s"
    deadline = time.monotonic() + 20
    s.settimeout(1)
    with Peak(pid) as peak:
        while time.monotonic() < deadline:
            try:
                s.sendall(chunk)
                pushed += len(chunk)
            except TimeoutError:
                continue  # the gateway stopped reading: the kernel buffers are full
            except OSError as e:
                outcome = f"aborted by the gateway ({type(e).__name__})"
                break
    s.close()
    return [{"probe": "a client sending WebSocket pings for 20 s, never reading",
             "answer": f"{pushed / (1 << 20):.1f} MiB of pings taken in; {outcome}", "memory": peak.text()}]


def probe_frames(port: int, base: str, pid: int) -> list[dict[str, Any]]:
    answers: list[str] = []
    cookies = [new_user(base) for _ in range(24)]

    def one(cookie: str) -> None:
        try:
            s = ws_open(port, cookie)
        except OSError as e:
            answers.append(f"handshake failed: {e}")
            return
        s.settimeout(30)
        n, sent = 15 << 20, 0
        try:
            s.sendall(client_frame(b"", length=n, mask=ZERO_MASK))
            block = b"x" * 65536
            while sent < n:
                s.sendall(block)
                sent += len(block)
        except OSError:
            pass
        try:
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        s.close()
        close = data.find(b"\x88")
        code = int.from_bytes(data[close + 2:close + 4], "big") if close >= 0 and len(data) >= close + 4 else None
        answers.append(("frame_too_large error frame, " if b"frame_too_large" in data else "")
                       + (f"close {code}" if code else "no close frame") + f" after {sent / (1 << 20):.1f} MiB sent")

    with Peak(pid) as peak:
        threads = [threading.Thread(target=one, args=(c,)) for c in cookies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    summary = Counter(re.sub(r"after [\d.]+ MiB", "after N MiB", a) for a in answers)
    most = max(float(m) for m in re.findall(r"after ([\d.]+) MiB", " ".join(answers))) if answers else 0.0
    return [{"probe": "24 sockets each sending a 15 MiB frame",
             "answer": "; ".join(f"{n}x {a}" for a, n in summary.items()) + f" (at most {most:.1f} MiB sent)",
             "memory": peak.text()}]


def probe_bodies(port: int, base: str, pid: int) -> list[dict[str, Any]]:
    socks: list[socket.socket] = []
    answers: Counter[str] = Counter()
    health: list[str] = []
    head = (b"POST /api/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{")
    with Peak(pid) as peak:
        for _ in range(1000):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                s.sendall(head)
                s.setblocking(False)
                socks.append(s)
            except OSError as e:
                answers[f"connect failed: {type(e).__name__}"] += 1
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and socks:
            for s in list(socks):
                try:
                    data = s.recv(4096)
                    answers[data.split(b"\r\n", 1)[0].decode() if data else "closed"] += 1
                    s.close()
                    socks.remove(s)
                    continue
                except BlockingIOError:
                    pass
                except OSError:
                    answers["reset"] += 1
                    socks.remove(s)
                    continue
                try:
                    s.send(b" ")
                except OSError:
                    pass
            try:  # a health check from another address
                with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=5) as hc:
                    t0 = time.perf_counter()
                    code = hc.get(f"{base}/healthz").status_code
                    health.append(f"{code} {1000 * (time.perf_counter() - t0):.0f}")
            except httpx.HTTPError as e:
                health.append(type(e).__name__)
            time.sleep(1)
    for s in socks:
        answers["still open after 40 s"] += 1
        s.close()
    codes = Counter(h.split()[0] for h in health)
    worst = max((float(h.split()[1]) for h in health if h.split()[0] == "200"), default=float("nan"))
    return [{"probe": "1,000 clients trickling a request body (1 byte a second), health checks from another address",
             "answer": "; ".join(f"{n}x {a}" for a, n in answers.most_common())
                       + f"; health checks: {dict(codes)} (slowest {worst:.0f} ms)", "memory": peak.text()}]


def probe_hangups(port: int, base: str, pid: int, log_path: Path) -> list[dict[str, Any]]:
    before = metric(base, "gateway_client_disconnects_total")
    tracebacks_before = log_path.read_text(errors="replace").count("Traceback")

    def hang_up(path: bytes) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"messages\": [")
            time.sleep(0.01)

    with Peak(pid) as peak:
        for i in range(1000):
            hang_up(b"/v1/chat/completions" if i % 2 else b"/api/sessions")
    time.sleep(1)
    after = metric(base, "gateway_client_disconnects_total")
    counted = sum(after.values()) - sum(before.values())
    errors = sum(v for k, v in metric(base, "gateway_http_requests_total").items() if 'status="500"' in k)
    tracebacks = log_path.read_text(errors="replace").count("Traceback") - tracebacks_before
    return [{"probe": "1,000 clients hanging up mid-body (/v1/chat/completions and /api/sessions)",
             "answer": f"{counted:.0f} counted as client disconnects; HTTP 500s: {errors:.0f}; tracebacks in the "
                       f"log: {tracebacks}", "memory": peak.text()}]


def main(argv: list[str] | None = None) -> int:
    """Run the probes; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--model", default=None, help="model folder for the local engine (default: bundled SmolLM2)")
    p.add_argument("--only", nargs="*", choices=PROBES, default=list(PROBES))
    a = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))  # 1,000 clients of ours
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.TemporaryDirectory(prefix="chatserve-probe-")
    log_path = Path(tmp.name) / "gateway.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KEY_PREFIX": f"probe-{uuid.uuid4().hex[:8]}:",
           "DATA_DIR": tmp.name}
    cmd = [sys.executable, "-m", "gateway", "--port", str(port), "--log-level", "info"]
    if a.model:
        cmd += ["--model", a.model]

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (GATEWAY_NOFILE, GATEWAY_NOFILE))

    with log_path.open("w") as log:
        gw = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_files)
    rows: list[dict[str, Any]] = []
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while "Chat is ready" not in log_path.read_text(errors="replace"):
            if gw.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start:\n" + log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.2)
        m = re.findall(r"\[engine\].*ws://127\.0\.0\.1:(\d+)", log_path.read_text(errors="replace"))
        engine_port = int(m[-1]) if m else None
        idle = rss_mib(gw.pid)
        rows.append({"probe": "idle gateway (after start-up)", "answer": "", "memory": f"{idle:.0f} MiB"})
        for name in a.only:
            if name == "engine":
                rows += probe_engine(port, base, gw.pid, engine_port)
            elif name == "hangups":
                rows += probe_hangups(port, base, gw.pid, log_path)
            else:
                rows += globals()[f"probe_{name}"](port, base, gw.pid)
        rows.append({"probe": "gateway after the probes", "answer": "", "memory": f"{rss_mib(gw.pid):.0f} MiB"})
    finally:
        gw.terminate()
        gw.wait(30)
        tmp.cleanup()
    load = [round(x, 2) for x in os.getloadavg()]
    if a.json:
        print(json.dumps({"rows": rows, "load_avg": load}, indent=2))
    else:
        print("| probe | answer | gateway memory |\n|---|---|---|")
        for row in rows:
            print(f"| {row['probe']} | {row['answer']} | {row.get('memory', '')} |")
        print(f"\nload average {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
