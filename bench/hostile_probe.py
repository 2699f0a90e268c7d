"""Hostile-client probes against a real gateway process: what each limit answers, and
the gateway's memory while four clients each try to send a 64 MiB header.

    python bench/hostile_probe.py [--json]

Starts ``python -m gateway`` (no engine: the probes need none; Redis at
127.0.0.1:6379) on a free port and prints one row per probe: what was sent, what came
back, and the gateway's resident memory before and at most during the big-header probe
(sampled every 20 ms from /proc).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


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


def main(argv: list[str] | None = None) -> int:
    """Run the probes; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gw = subprocess.Popen([sys.executable, "-m", "gateway", "--port", str(port), "--engine", "ws://127.0.0.1:9",
                           "--log-level", "error", "--data-dir", str(ROOT / ".data")], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(300):
            try:
                httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        before = rss_mib(gw.pid)
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_mib(gw.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample)
        sampler.start()
        answers: list[str] = []
        threads = [threading.Thread(target=big_header, args=(port, answers)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        sampler.join()
        rows.append({"probe": "4 connections each sending a 64 MiB header",
                     "answer": "; ".join(sorted(set(answers))),
                     "gateway RSS (MiB)": f"{before:.0f} before, {peak[0]:.0f} at most during"})
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
    finally:
        gw.terminate()
        gw.wait(30)
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        print("| probe | answer | memory |\n|---|---|---|")
        for row in rows:
            print(f"| {row['probe']} | {row['answer']} | {row.get('gateway RSS (MiB)', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
