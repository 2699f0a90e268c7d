"""Terminal client: ``python -m gateway.client [--url ws://127.0.0.1:8000/ws] [--session ID] "question"``.

Gets a user cookie over HTTP (``GET /api/config``), opens the socket with that cookie
and a matching ``Origin``, sends the question and prints the reply as it streams. The
chat id and the reply's numbers go to stderr, so ``--session`` can continue the chat.
A cookie file (``--cookie-file``) keeps the same user across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse, urlunparse

import httpx
import websockets
from websockets.asyncio.client import connect
from websockets.typing import Origin

from engine.sampling_params import param_error, range_text
from engine.text_checks import text_error
from gateway.auth import COOKIE_NAME


def http_base(ws_url: str) -> str:
    """``ws://host:port/ws`` -> ``http://host:port`` (wss -> https)."""
    u = urlparse(ws_url)
    scheme = "https" if u.scheme == "wss" else "http"
    return urlunparse((scheme, u.netloc, "", "", "", ""))


def get_cookie(base: str, saved: str | None = None, timeout_s: float = 10.0) -> str:
    """A signed user cookie value: ``saved`` when the gateway still accepts it, else a
    new one from ``GET /api/config``.

    Raises:
        httpx.HTTPError: the gateway cannot be reached.
    """
    cookies = {COOKIE_NAME: saved} if saved else {}
    r = httpx.get(f"{base}/api/config", cookies=cookies, timeout=timeout_s)
    r.raise_for_status()
    return r.cookies.get(COOKIE_NAME) or saved or ""


async def ask(url: str, cookie: str, question: str, session_id: str | None = None,
              params: dict[str, Any] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Send one question and print the streamed reply; returns 0, or 1 on an error frame."""
    base = http_base(url)
    frame: dict[str, Any] = {"type": "chat", "content": question, "client_msg_id": uuid.uuid4().hex}
    if session_id:
        frame["session_id"] = session_id
    if params:
        frame["params"] = params
    async with connect(url, origin=Origin(base), additional_headers={"Cookie": f"{COOKIE_NAME}={cookie}"},
                       max_size=None) as ws:
        await ws.send(json.dumps(frame))
        async for raw in ws:
            msg = json.loads(raw)
            kind = msg.get("type")
            if kind == "start":
                print(f"[chat {msg['session_id']}]", file=err, flush=True)
            elif kind == "delta":
                out.write(msg["text"])
                out.flush()
            elif kind == "done":
                u, t = msg.get("usage", {}), msg.get("timings", {})
                out.write("\n")
                print(f"[{msg['finish_reason']}: {u.get('prompt_tokens')} prompt tokens "
                      f"({u.get('cached_tokens')} cached), {u.get('completion_tokens')} completion tokens, "
                      f"TTFT {t.get('ttft_ms', 0):.0f} ms, {t.get('tpot_ms', 0):.1f} ms/token; "
                      f"continue with --session {msg['session_id']}]", file=err, flush=True)
                return 0 if msg["finish_reason"] != "error" else 1
            elif kind == "error":
                print(f"error ({msg.get('code')}): {msg.get('message')}", file=err, flush=True)
                return 1
    print("error: the connection closed before the reply ended", file=err)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = argparse.ArgumentParser(prog="python -m gateway.client", description="Ask the chat gateway a question.")
    p.add_argument("question")
    p.add_argument("--url", default="ws://127.0.0.1:8000/ws", help="the gateway's WebSocket URL")
    p.add_argument("--session", default=None, help="continue this chat id")
    p.add_argument("--temperature", type=float, default=None, help=f"sampling temperature, {range_text('temperature')}")
    p.add_argument("--top-p", type=float, default=None, help=f"nucleus mass, {range_text('top_p')}")
    p.add_argument("--max-tokens", type=int, default=None, help=f"reply length cap, {range_text('max_tokens')}")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (-1: random)")
    p.add_argument("--cookie-file", type=Path, default=Path.home() / ".chatserve-cookie",
                   help="keeps your anonymous user between runs (so --session works)")
    a = p.parse_args(argv)
    params = {k: v for k, v in (("temperature", a.temperature), ("top_p", a.top_p), ("max_tokens", a.max_tokens),
                                ("seed", a.seed)) if v is not None}
    bad_text = text_error(a.question, "question")  # e.g. undecodable bytes in argv
    if bad_text is not None:
        p.error(bad_text)
    for name, value in params.items():  # the engine's ranges and error text, before any connection
        message = param_error(name, value)
        if message is not None:
            p.error(message.replace(name, "--" + name.replace("_", "-"), 1))
    saved = a.cookie_file.read_text().strip() if a.cookie_file.exists() else None
    try:
        cookie = get_cookie(http_base(a.url), saved)
        if cookie and cookie != saved:
            try:
                a.cookie_file.write_text(cookie)
                a.cookie_file.chmod(0o600)
            except OSError:
                pass  # a read-only home only costs continuity
        return asyncio.run(ask(a.url, cookie, a.question, a.session, params))
    except (httpx.HTTPError, OSError, websockets.WebSocketException) as e:
        print(f"error: cannot reach the gateway at {a.url}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
