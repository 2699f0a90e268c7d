"""Terminal client: ``python -m gateway.client [--url URL] [--token T] [--session ID] [--model M] "question"``.

Opens the gateway's WebSocket, sends the question and prints the reply as it streams.
The chat id and the reply's numbers go to stderr, so ``--session`` can continue the chat.

Where: ``--url``, else the ``CHAT_URL`` environment variable, else http://127.0.0.1:8000.

Who you are: with a personal access token (``--token`` or ``CHAT_TOKEN``; create one in
the chat page's "Access tokens" dialog) the client acts as the browser user who made it,
so its chats show in that user's sidebar and a chat from the browser's URL
(``#/c/<id>``) continues here with ``--session <id>``. Without one it is an anonymous
user of its own: a cookie from ``GET /api/config``, kept in ``--cookie-file`` between runs.

A reply's reasoning (the text between the model's thinking markers,
``gateway/reasoning.py``) goes to stderr under "[thinking]" and ends with "[thought
for N s]", so stdout holds the answer alone; ``--no-reasoning`` leaves it out.

Ctrl-C stops the reply (the gateway is sent ``cancel``, the partial reply is stored)
and exits with status 130.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse, urlunparse

import httpx
import websockets
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Origin

from engine.sampling_params import param_error, range_text
from engine.text_checks import text_error
from gateway.api.auth import COOKIE_NAME
from gateway.reasoning import ReasoningSplitter

DEFAULT_URL = "http://127.0.0.1:8000"
TOKEN_ENV = "CHAT_TOKEN"
URL_ENV = "CHAT_URL"  # the gateway's address, when --url is not given
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
CANCEL_WAIT_S = 10.0  # how long to wait for the stopped reply's `done` after Ctrl-C


class UsageError(ValueError):
    """A command-line value the client cannot use (e.g. a URL it cannot parse)."""


def gateway_url(flag: str | None, environ: Mapping[str, str]) -> str:
    """The gateway's address: ``--url``, else ``$CHAT_URL`` (``URL_ENV``; blank counts as
    unset), else ``DEFAULT_URL``."""
    return (flag or environ.get(URL_ENV, "")).strip() or DEFAULT_URL


def socket_url(url: str) -> str:
    """The WebSocket URL for a gateway address given as ``http(s)://host:port`` or
    ``ws(s)://host:port``, with or without ``/ws`` (a path prefix of a reverse proxy is
    kept: ``https://h/chat`` -> ``wss://h/chat/ws``).

    Raises:
        UsageError: not an http, https, ws or wss URL with a host.
    """
    u = urlparse(url.strip() if "://" in url else f"http://{url.strip()}")
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if u.scheme not in schemes or not u.netloc:
        raise UsageError(f"--url must look like http://host:port or ws://host:port/ws, got {url!r}")
    path = u.path.rstrip("/")
    if not path.endswith("/ws"):
        path += "/ws"
    return urlunparse((schemes[u.scheme], u.netloc, path, "", u.query, ""))


def http_base(ws_url: str) -> str:
    """``ws://host:port[/prefix]/ws`` -> ``http://host:port[/prefix]`` (wss -> https)."""
    u = urlparse(ws_url)
    scheme = "https" if u.scheme == "wss" else "http"
    path = u.path[:-3] if u.path.endswith("/ws") else u.path
    return urlunparse((scheme, u.netloc, path, "", "", ""))


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


def refusal_text(status: int, body: bytes, url: str) -> str:
    """What a refused handshake means, from the gateway's JSON reason when it sent one:
    a wrong Origin, a missing/invalid cookie, a wrong path, a bad token."""
    code, message = "", ""
    with suppress(ValueError, AttributeError, TypeError):
        err = json.loads(body.decode("utf-8", "replace"))["error"]
        code, message = str(err.get("code", "")), str(err.get("message", ""))
    hints = {
        "origin_not_allowed": "the Origin was refused",
        "no_user": "the user cookie was missing or not accepted",
        "wrong_path": "wrong path",
        "invalid_token": "the access token was refused (revoked or mistyped?)",
    }
    if code in hints:
        return f"{hints[code]}: {message}"
    if status == 403:
        return (f"the gateway at {url} refused the socket (HTTP 403) without saying why: check that the "
                "path is /ws, and that the gateway is this project's")
    return f"the gateway at {url} refused the socket (HTTP {status}){': ' + message if message else ''}"


# after "no such chat" for --session without a token: the likeliest cause is a browser chat
NOT_YOURS_HINT = ("[without a token this client is its own anonymous user and cannot see the browser's chats: "
                  f"pass --token or set {TOKEN_ENV} (the chat page's Access tokens dialog)]")


def attach_refusal(name: str, reason: str) -> str:
    """Why the file ``name`` cannot be attached, naming it once: the gateway's reasons
    start with the file's name (``pic.png: this type of file cannot be attached; ...``),
    so such a reason is the whole text; another (``HTTP 502``) gets the name in front."""
    return reason if reason.startswith(name) else f"{name} cannot be attached: {reason}"


def upload_attachments(base: str, paths: list[Path], cookie: str | None, token: str | None,
                       timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Read each file into an attachment with the gateway (``POST /api/attachments``:
    its kind, text and tokens; a PDF's text extracted there), for a ``chat`` frame.

    Raises:
        UsageError: a file cannot be read here, or the gateway refused it (its reason).
        httpx.HTTPError: the gateway cannot be reached.
    """
    headers = {"X-Chat-Token": token} if token else {}
    cookies = {COOKIE_NAME: cookie} if cookie and not token else {}
    out = []
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
        r = httpx.post(f"{base}/api/attachments", params={"name": path.name}, content=data, headers=headers,
                       cookies=cookies, timeout=timeout_s)
        if r.status_code != 200:
            try:
                reason = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                reason = f"HTTP {r.status_code}"
            raise UsageError(attach_refusal(path.name, reason))
        body = r.json()
        out.append({k: body[k] for k in ("name", "kind", "text", "size", "pages") if k in body})
    return out


async def ask(url: str, cookie: str | None, question: str, session_id: str | None = None,
              params: dict[str, Any] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
              token: str | None = None, interrupted: asyncio.Event | None = None,
              attachments: list[dict[str, Any]] | None = None, show_reasoning: bool = True,
              model: str | None = None) -> int:
    """Send one question (with ``attachments``: ``upload_attachments``'s) and print the
    streamed reply (its answer to ``out``, its reasoning to ``err`` unless
    ``show_reasoning`` is False).

    Args:
        url: the gateway's WebSocket URL (``socket_url``).
        cookie: the anonymous user's cookie value (ignored with ``token``).
        token: a personal access token (sent as ``X-Chat-Token``).
        interrupted: set it (Ctrl-C) to stop the reply: ``cancel`` is sent and the
            stopped reply's end awaited (at most ``CANCEL_WAIT_S``).
        model: the model to answer (kept with the chat for its later turns); None: the
            chat's, or the gateway's default for a new chat.
    Returns:
        0, 1 on an error frame or a dropped socket, 130 when interrupted.
    Raises:
        websockets.InvalidStatus: the handshake was refused (see ``refusal_text``).
        OSError: the gateway cannot be reached.
    """
    base = http_base(url)
    interrupted = interrupted or asyncio.Event()
    frame: dict[str, Any] = {"type": "chat", "content": question, "client_msg_id": uuid.uuid4().hex}
    if session_id:
        frame["session_id"] = session_id
    if params:
        frame["params"] = params
    if attachments:
        frame["attachments"] = attachments
    if model:
        frame["model"] = model
    headers = {"X-Chat-Token": token} if token else {"Cookie": f"{COOKIE_NAME}={cookie}"}
    async with connect(url, origin=Origin(base), additional_headers=headers, max_size=None) as ws:
        await ws.send(json.dumps(frame))
        return await _follow(ws, out, err, interrupted, show_reasoning,
                             anonymous_session=bool(session_id) and not token)


class _ReplyPrinter:
    """Writes a streamed reply: the answer to ``out``, the reasoning to ``err`` (or nowhere)."""

    def __init__(self, out: TextIO, err: TextIO, show_reasoning: bool) -> None:
        self.out, self.err, self.show = out, err, show_reasoning
        self.think = ReasoningSplitter()
        self.said_thinking = False
        self.said_thought = False

    def write(self, reasoning: str, answer: str, reasoning_ms: float | None = None) -> None:
        if reasoning and self.show:
            if not self.said_thinking:
                self.err.write("[thinking]\n")
                self.said_thinking = True
            self.err.write(reasoning)
            self.err.flush()
        if self.said_thinking and not self.said_thought and (answer or reasoning_ms is not None):
            when = f" for {reasoning_ms / 1000:.1f} s" if reasoning_ms is not None else ""
            self.err.write(f"\n[thought{when}]\n")
            self.err.flush()
            self.said_thought = True
        if answer:
            self.out.write(answer)
            self.out.flush()


async def _follow(ws: ClientConnection, out: TextIO, err: TextIO, interrupted: asyncio.Event,
                  show_reasoning: bool = True, anonymous_session: bool = False) -> int:
    """Print the reply's frames until it ends; on ``interrupted`` send ``cancel`` once
    the reply is named and wait (bounded) for its end. ``anonymous_session``: a chat was
    named without a token (a refusal of it says how to pass one)."""
    printer = _ReplyPrinter(out, err, show_reasoning)
    rid: str | None = None
    cancel_sent = False
    deadline: float | None = None
    loop = asyncio.get_running_loop()
    stop_wait = asyncio.ensure_future(interrupted.wait())
    try:
        while True:
            if interrupted.is_set():
                if rid is not None and not cancel_sent:
                    await ws.send(json.dumps({"type": "cancel", "request_id": rid}))
                    cancel_sent = True
                deadline = deadline or loop.time() + CANCEL_WAIT_S
                if loop.time() >= deadline:
                    out.write("\n")
                    print("[interrupted; the gateway did not confirm the stop in time]", file=err)
                    return EXIT_INTERRUPTED
            recv = asyncio.ensure_future(ws.recv())
            waits: set[asyncio.Future[Any]] = {recv} if interrupted.is_set() else {recv, stop_wait}
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                with suppress(asyncio.CancelledError, websockets.ConnectionClosed):
                    await recv
                continue
            msg = json.loads(recv.result())
            kind = msg.get("type")
            if kind == "start":
                rid = msg.get("request_id")
                print(f"[chat {msg['session_id']}]", file=err, flush=True)
            elif kind == "delta":
                printer.write(*printer.think.feed(msg["text"]))
            elif kind == "done":
                u, t = msg.get("usage", {}), msg.get("timings", {})
                printer.write(*printer.think.finish(), reasoning_ms=msg.get("reasoning_ms"))
                out.write("\n")
                print(f"[{msg['finish_reason']}: {u.get('prompt_tokens')} prompt tokens "
                      f"({u.get('cached_tokens')} cached), {u.get('completion_tokens')} completion tokens, "
                      f"TTFT {t.get('ttft_ms', 0):.0f} ms, {t.get('tpot_ms', 0):.1f} ms/token; "
                      f"continue with --session {msg['session_id']}]", file=err, flush=True)
                if interrupted.is_set():
                    return EXIT_INTERRUPTED
                return 0 if msg["finish_reason"] != "error" else 1
            elif kind == "error":
                print(f"error ({msg.get('code')}): {msg.get('message')}", file=err, flush=True)
                if msg.get("code") == "not_found" and anonymous_session:
                    print(NOT_YOURS_HINT, file=err, flush=True)
                return EXIT_INTERRUPTED if interrupted.is_set() else 1
    except websockets.ConnectionClosed as e:
        why = f" ({e.rcvd.code}: {e.rcvd.reason})" if e.rcvd is not None and e.rcvd.reason else ""
        print(f"error: the connection closed before the reply ended{why}", file=err)
        return EXIT_INTERRUPTED if interrupted.is_set() else 1
    finally:
        stop_wait.cancel()


async def _run(url: str, cookie: str | None, token: str | None, question: str, session: str | None,
               params: dict[str, Any], attachments: list[dict[str, Any]] | None = None,
               show_reasoning: bool = True, model: str | None = None) -> int:
    """``ask`` with Ctrl-C wired to its ``interrupted`` event (a second Ctrl-C quits at once)."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    main = asyncio.current_task()

    def on_sigint() -> None:
        if interrupted.is_set() and main is not None:
            main.cancel()  # the second Ctrl-C: do not wait for the gateway
        interrupted.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):  # not on the main thread / Windows
        pass
    try:
        return await ask(url, cookie, question, session, params, token=token, interrupted=interrupted,
                         attachments=attachments, show_reasoning=show_reasoning, model=model)
    except asyncio.CancelledError:
        return EXIT_INTERRUPTED
    finally:
        with suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless it has no default or says its own."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--help`` shows every default)."""
    p = argparse.ArgumentParser(prog="python -m gateway.client", description="Ask the chat gateway a question.",
                                formatter_class=_DefaultsHelp,
                                epilog="Ctrl-C stops the reply (it is stored as partial) and exits with 130.")
    p.add_argument("question", help="what to ask (quote it)")
    p.add_argument("--url", default=None,
                   help=f"the gateway: http(s)://host:port or ws(s)://host:port[/ws] (default: ${URL_ENV}, "
                        f"else {DEFAULT_URL})")
    p.add_argument("--token", default=None,
                   help=f"personal access token from the chat page's Access tokens dialog; acts as that browser "
                        f"user (default: ${TOKEN_ENV}, else an anonymous user)")
    p.add_argument("--session", default=None,
                   help="continue this chat id (e.g. from the page's URL #/c/<id>; default: a new chat)")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature, {range_text('temperature')} (default: the chat's)")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus mass, {range_text('top_p')} (default: the chat's)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"longest reply in tokens, {range_text('max_tokens')} (default: the chat's)")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible (-1: random; default: none)")
    p.add_argument("--attach", type=Path, action="append", default=[], metavar="FILE",
                   help="attach a text, Markdown, code, CSV/JSON or PDF file to the question (repeatable)")
    p.add_argument("--model", default=None,
                   help="the model to answer, one the gateway serves (GET /v1/models); a chat keeps it for its "
                        "later turns (default: the chat's; any engine for a new chat)")
    p.add_argument("--no-reasoning", action="store_true",
                   help="do not print the model's reasoning (by default it goes to stderr)")
    p.add_argument("--cookie-file", type=Path, default=Path.home() / ".chatserve-cookie",
                   help="without a token: keeps your anonymous user between runs (so --session works)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    p = build_parser()
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
    try:
        url = socket_url(gateway_url(a.url, os.environ))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # not a parser default: --help would show it
    token = (a.token or os.environ.get(TOKEN_ENV) or "").strip() or None
    try:
        cookie = None
        if not token:
            saved = a.cookie_file.read_text().strip() if a.cookie_file.exists() else None
            cookie = get_cookie(http_base(url), saved)
            if cookie and cookie != saved:
                try:
                    a.cookie_file.write_text(cookie)
                    a.cookie_file.chmod(0o600)
                except OSError:
                    pass  # a read-only home only costs continuity
        files = upload_attachments(http_base(url), a.attach, cookie, token) if a.attach else None
        return asyncio.run(_run(url, cookie, token, a.question, a.session, params, files, not a.no_reasoning,
                                a.model))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except websockets.InvalidStatus as e:
        why = refusal_text(e.response.status_code, bytes(e.response.body or b""), url)
        print(f"error: {why}", file=sys.stderr)
        return 1
    except httpx.HTTPStatusError as e:
        print(f"error: wrong path? {e.request.url} answered HTTP {e.response.status_code}; give the gateway's "
              "address, e.g. http://host:port", file=sys.stderr)
        return 1
    except (httpx.HTTPError, OSError, websockets.WebSocketException) as e:
        print(f"error: cannot reach the gateway at {url}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
