"""The engine's internal WebSocket endpoint (``docs/protocol.md`` section 1; frames
in ``engine.protocol``).

One connection carries many requests multiplexed by ``request_id``; ids are
scoped to the connection. A closed connection aborts every request it started.
Each engine step's outputs go out as one ``step`` frame per connection.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import json
import logging
import os
import signal
import threading
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from engine.async_engine import AsyncEngine
from engine.errors import EngineError, InvalidRequestError
from engine.outputs import GenerateRequest, RequestOutput, TokenLogprob
from engine.prompt import validate_messages
from engine.protocol import (
    SECRET_ENV,
    SECRET_HEADER,
    AbortFrame,
    DeltaFrame,
    DoneFrame,
    ErrorFrame,
    FrameError,
    GenerateFrame,
    HelloFrame,
    KvEventsFrame,
    KvFetchDoneFrame,
    KvFetchFrame,
    KvSubscribeFrame,
    PingFrame,
    PongFrame,
    ProgressFrame,
    ReplyItem,
    StatsFrame,
    StatsRequest,
    StepFrame,
    decode_client_frame,
    encode,
    to_dict,
)
from engine.sampling_params import SamplingParams
from engine.structured.vocab import Vocabulary, token_text
from engine.text_checks import text_error
from engine.tools.spec import parse_tools

log = logging.getLogger(__name__)

DRAIN_S = 2.0  # at shutdown, how long the final frames may take to go out (s)
# Far above any prompt the context allows; the gateway enforces the user-facing limit.
MAX_FRAME_BYTES = 64 * 1024 * 1024
FETCH_KEY = "\x00kv_fetch:"  # a kv_fetch's key among a connection's tasks (never a request id)


def logprob_dicts(logprobs: list[TokenLogprob], vocab: Vocabulary | None) -> list[dict[str, Any]]:
    """The wire form of a list of ``TokenLogprob``: each token and alternative with its
    id, text and bytes (from ``vocab``; without one, text and bytes are empty)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        data = vocab.token_bytes(token_id) if vocab is not None else b""
        return {"token_id": token_id, "token": token_text(data), "bytes": list(data), "logprob": logprob}

    return [{**entry(lp.token_id, lp.logprob), "top": [entry(t, v) for t, v in lp.top]} for lp in logprobs]


def prompt_logprob_dicts(logprobs: list[TokenLogprob], vocab: Vocabulary | None) -> list[dict[str, Any]]:
    """The wire form of a prompt's logprobs: one entry per prompt token, the first (which
    nothing before it scores) with ``logprob`` None and no alternatives."""
    out = logprob_dicts(logprobs, vocab)
    if out:
        out[0]["logprob"], out[0]["top"] = None, []
    return out


def output_item(request_id: str, out: RequestOutput, vocab: Vocabulary | None = None) -> ReplyItem:
    """The ``progress``, ``delta`` or ``done`` item of one engine output (client-side
    request id); ``vocab`` names the tokens of logprobs."""
    if out.progress is not None:
        p = out.progress
        return ProgressFrame(request_id, p.done, p.total, p.cached)
    logprobs = logprob_dicts(out.logprobs, vocab) if out.logprobs else None
    calls = [c.as_dict() for c in out.tool_calls] if out.tool_calls else None
    prompt_lps = prompt_logprob_dicts(out.prompt_logprobs, vocab) if out.prompt_logprobs else None
    if not out.finished:
        return DeltaFrame(request_id, out.text, out.token_ids, logprobs, out.trim_prior, calls, prompt_lps,
                          out.prompt_usage)
    assert out.usage is not None and out.timings is not None  # a finished output carries both
    whole = [c.as_dict() for c in out.output_tool_calls] if out.output_tool_calls is not None else None
    return DoneFrame(request_id, out.text, out.token_ids, logprobs, out.finish_reason or "stop", out.stop_reason,
                     out.output_text or "", out.output_token_ids or [], out.prompt_token_ids or [],
                     bool(out.prefix_reused), out.usage, out.timings, out.trim_prior, calls, whole, prompt_lps)


def parse_generate(frame: GenerateFrame, internal_id: str) -> GenerateRequest:
    """A ``generate`` frame as the engine's GenerateRequest.

    Raises:
        InvalidRequestError: bad params or tools.
    """
    if text_error(frame.cache_salt, "cache_salt"):
        raise InvalidRequestError("cache_salt must be a string of valid Unicode")
    if frame.shared_messages:
        try:
            validate_messages(frame.shared_messages)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"shared_messages: {e.message}") from None
    return GenerateRequest(
        request_id=internal_id, prompt_token_ids=frame.prompt_token_ids,
        messages=frame.messages, prefix_token_ids=frame.prefix_token_ids,
        params=SamplingParams.from_dict(frame.params), cache_salt=frame.cache_salt,
        clamp_max_tokens=frame.clamp_max_tokens, continued_tokens=frame.continued_tokens,
        shared_messages=frame.shared_messages, prompt=frame.prompt,
        tools=parse_tools(frame.tools, frame.tool_choice, frame.parallel_tool_calls),
        continue_final_message=frame.continue_final_message, kv_source=frame.kv_source,
    )


class _Outbox:
    """What one connection sends, written by one task: control frames (pong, stats,
    refusals) go first, then one ``step`` frame with every reply item queued meanwhile.

    Items of one engine step arrive in one event-loop iteration (``AsyncEngine``
    delivers a step per loop in one callback), and the writer yields once before
    collecting, so a step becomes one frame; while a send waits on a slow reader,
    later steps' items join the next frame. Nothing here ever blocks the reader.
    """

    def __init__(self, ws: ServerConnection) -> None:
        self.ws = ws
        self.control: list[str | bytes] = []
        self.items: list[ReplyItem] = []
        self._wake = asyncio.Event()
        self.sending = False

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being written."""
        return not (self.control or self.items or self.sending)

    def send(self, text: str | bytes) -> None:
        """Queue a control frame (JSON text, or a binary KV page of a ``kv_fetch``)."""
        self.control.append(text)
        self._wake.set()

    def item(self, item: ReplyItem) -> None:
        """Queue a reply item for the next step frame."""
        self.items.append(item)
        self._wake.set()

    async def run(self) -> None:
        """Write until the connection closes."""
        try:
            while True:
                await self._wake.wait()
                self.sending = True
                await asyncio.sleep(0)  # let the rest of this step's outputs join
                self._wake.clear()
                control, self.control = self.control, []
                items, self.items = self.items, []
                for text in control:
                    await self.ws.send(text)
                if items:
                    await self.ws.send(encode(StepFrame(items)))
                self.sending = False
        except ConnectionClosed:
            self.sending = False


class EngineServer:
    """Serves one ``AsyncEngine`` over WebSockets.

    The socket's reader never waits for the step loop: ``ping`` and ``stats`` are
    answered at once (stats from the end-of-step snapshot), ``abort`` is queued for
    the step thread, and ``generate`` starts a task; so keepalive and control survive
    a step of any length.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._conn_ids = itertools.count(1)
        # live connections: their outbox and request tasks (what ``drain`` waits for)
        self._live: dict[int, tuple[_Outbox, dict[str, asyncio.Task]]] = {}

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every request task has ended and every connection has written what
        it queued (the final ``abort`` frames of a shutdown), at most ``timeout_s``
        seconds. Returns whether it all went out in time."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while any(tasks or not out.idle for out, tasks in self._live.values()):
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def hello(self) -> dict[str, Any]:
        """The frame sent on connect: the protocol version and what this engine serves."""
        return to_dict(HelloFrame(self.engine.info))

    async def handle(self, ws: ServerConnection) -> None:
        """Serve one connection until it closes; then abort its requests."""
        conn = next(self._conn_ids)
        tasks: dict[str, asyncio.Task] = {}
        out = _Outbox(ws)
        writer = asyncio.create_task(out.run())
        unsubscribe: list[Callable[[], None]] = []
        self._live[conn] = (out, tasks)
        try:
            await ws.send(json.dumps(self.hello()))
            async for raw in ws:
                self._on_frame(out, conn, raw, tasks, unsubscribe)
        except ConnectionClosed:
            pass
        finally:
            self._live.pop(conn, None)
            for end in unsubscribe:
                end()
            for t in tasks.values():
                t.cancel()  # generate()'s finally aborts the engine request
            if tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)

    def _on_frame(self, out: _Outbox, conn: int, raw: Any, tasks: dict[str, asyncio.Task],
                  unsubscribe: list[Callable[[], None]]) -> None:
        try:
            frame = decode_client_frame(raw)
        except FrameError as e:
            code = "invalid_request" if e.request_id is not None else "bad_frame"
            out.send(encode(ErrorFrame(code, e.message, e.request_id)))
            return
        if isinstance(frame, PingFrame):
            out.send(encode(PongFrame()))
        elif isinstance(frame, StatsRequest):
            stats, age_s = self.engine.snapshot()
            out.send(encode(StatsFrame(stats, round(age_s * 1000, 3))))
        elif isinstance(frame, AbortFrame):
            # not at once: a generate read in the same batch of frames has a task that has
            # not run yet, so the engine would not know the request and the abort would be
            # lost (the gateway re-sends it 0.2 s later, hundreds of tokens on). Callbacks run
            # in the order they are scheduled, so this runs after that task's first step,
            # which registers the request with the engine.
            asyncio.get_running_loop().call_soon(self.engine.abort, f"{conn}:{frame.request_id}")
        elif isinstance(frame, KvFetchFrame):
            if any(k.startswith(FETCH_KEY) for k in tasks):
                out.send(encode(KvFetchDoneFrame(frame.request_id, 0, "one kv_fetch at a time per connection")))
                return
            key = FETCH_KEY + frame.request_id
            task = asyncio.create_task(self._fetch(out, frame))
            tasks[key] = task
            task.add_done_callback(lambda _t: tasks.pop(key, None))
        elif isinstance(frame, KvSubscribeFrame):
            if not unsubscribe:  # a second subscribe changes nothing

                def listener(stored: list[int], removed: list[int]) -> None:
                    out.send(encode(KvEventsFrame(stored, removed)))

                snapshot, end = self.engine.subscribe_kv_events(listener)
                unsubscribe.append(end)
                out.send(encode(KvEventsFrame(snapshot, [], reset=True)))  # before any listener call
        else:
            rid = frame.request_id
            if rid in tasks:
                out.send(encode(ErrorFrame("duplicate_request_id", f"request {rid!r} is already running", rid)))
                return
            try:
                req = parse_generate(frame, f"{conn}:{rid}")
            except EngineError as e:
                out.send(encode(ErrorFrame(e.code, e.message, rid)))
                return
            task = asyncio.create_task(self._run(out, rid, req))
            tasks[rid] = task
            task.add_done_callback(lambda _t: tasks.pop(rid, None))

    async def _fetch(self, out: _Outbox, frame: KvFetchFrame) -> None:
        """Answer a ``kv_fetch``: copy the pages out between two steps, serialize them off
        the event loop, and queue them in order, then the ``kv_fetch_done``."""
        from engine.disagg.pages import read_pages, scope_of
        from engine.kv_page import encode_page

        rid = frame.request_id
        try:
            scope = scope_of(self.engine.core, frame.cache_salt, frame.shared_tokens)
            pages = await self.engine.call(read_pages, frame.prompt_token_ids, scope, frame.first_page,
                                           frame.num_pages)
            loop = asyncio.get_running_loop()
            for header, kv in pages:
                out.send(await loop.run_in_executor(None, encode_page, header, kv))
            out.send(encode(KvFetchDoneFrame(rid, len(pages))))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the asker falls back or fails the request; it must hear why
            log.exception("kv_fetch %s failed", rid)
            out.send(encode(KvFetchDoneFrame(rid, 0, f"internal error: {type(e).__name__}")))

    async def _run(self, out: _Outbox, rid: str, req: GenerateRequest) -> None:
        try:
            async for o in self.engine.generate(req):
                out.item(output_item(rid, o, self.engine.core.vocab))
        except EngineError as e:
            out.item(ErrorFrame(e.code, e.message, rid))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let a bug escape as a dropped stream
            log.exception("request %s failed", rid)
            out.item(ErrorFrame("engine_error", f"internal error: {type(e).__name__}", rid))


def secret_check(secret: str | None) -> Callable[[ServerConnection, Request], Response | None] | None:
    """The handshake check of the optional shared secret of the engine link: with
    ``secret`` set (``ENGINE_SECRET``), a connection without the same
    ``X-Engine-Secret`` header gets HTTP 403 (constant-time comparison)."""
    if not secret:
        return None

    def check(connection: ServerConnection, request: Request) -> Response | None:
        sent = request.headers.get(SECRET_HEADER, "")
        if hmac.compare_digest(sent.encode(), secret.encode()):
            return None
        return connection.respond(HTTPStatus.FORBIDDEN, "engine secret required\n")

    return check


def is_loopback(host: str) -> bool:
    """True when ``host`` (a name or an address) is this machine's loopback interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_without_secret(host: str) -> None:
    """Say what an engine without ``ENGINE_SECRET`` exposes: a warning on any address but
    loopback (anyone who reaches it may run generations and read the prefix cache's page
    names), a note on loopback (any local process may). ``python -m gateway`` gives the
    engine it starts a secret of its own."""
    if is_loopback(host):
        log.info("no %s: any process on this machine can use this engine; set one (the gateway sends the "
                 "same value) to admit only the gateway", SECRET_ENV)
    else:
        log.warning("listening on %s without %s: anyone who reaches this address can run generations and read "
                    "the prefix cache's page names; set %s in the engine's and the gateways' environment",
                    host, SECRET_ENV, SECRET_ENV)


async def run_server(engine: AsyncEngine, host: str, port: int, ready: asyncio.Event | None = None,
                     stop: asyncio.Event | None = None, start_engine: bool = True) -> None:
    """Serve until ``stop`` is set (forever if None); with ``ENGINE_SECRET`` set in the
    environment, only clients sending it are served (``secret_check``). Prints ``ENGINE READY ws://HOST:PORT``
    on stdout once listening (port 0 picks a free port). ``start_engine`` False: the
    caller runs the step loop itself (``serve``); the engine is shut down on the way out
    either way.

    Raises:
        OSError: the address cannot be bound.
    """
    server = EngineServer(engine)
    if start_engine:
        engine.start()
    secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        warn_without_secret(host)
    async with serve(server.handle, host, port, max_size=MAX_FRAME_BYTES, ping_interval=20, ping_timeout=60,
                     process_request=secret_check(secret)) as ws_server:
        sock = next(iter(ws_server.sockets))
        bound_port = sock.getsockname()[1]
        print(f"ENGINE READY ws://{host}:{bound_port}", flush=True)
        log.info("serving %s on ws://%s:%d", engine.info.model, host, bound_port)
        if ready is not None:
            ready.set()
        try:
            await (stop.wait() if stop is not None else asyncio.Future())
        finally:
            engine.shutdown()  # live requests end with an abort output
            # their abort frames go out before the connections close
            if not await server.drain(DRAIN_S):
                log.warning("some final frames were not sent within %.0f s of shutting down", DRAIN_S)


def serve_forever(engine: AsyncEngine, host: str, port: int) -> None:
    """Serve forever: the step loop on the calling (main) thread, the WebSocket server's
    asyncio loop on a second thread (``AsyncEngine.run_step_loop`` says why that way
    round). Returns when the server thread ends. On Ctrl-C or SIGTERM the step loop stops
    after its current step, the live requests end with an ``abort`` done frame, the server
    closes, and then KeyboardInterrupt is raised; a second Ctrl-C interrupts at once.

    Raises:
        OSError: the server could not start (e.g. the address is taken), raised here
            from the server thread.
    """
    failure: list[BaseException] = []
    started = threading.Event()
    control: dict[str, Any] = {}
    interrupted: list[int] = []

    def stop_on_signal(signum: int, frame: Any) -> None:
        # The first Ctrl-C or SIGTERM stops the step loop between steps, so every live
        # request is aborted on a consistent scheduler; a KeyboardInterrupt raised inside
        # a step had left some requests without their final frame. A second one stops now.
        if interrupted:
            raise KeyboardInterrupt
        interrupted.append(signum)
        engine.request_stop()

    async def main() -> None:
        control["loop"], control["stop"] = asyncio.get_running_loop(), asyncio.Event()
        started.set()
        await run_server(engine, host, port, stop=control["stop"], start_engine=False)

    def server_thread() -> None:
        try:
            asyncio.run(main())
        except BaseException as e:  # hand it to the main thread, which is stepping
            failure.append(e)
        finally:
            started.set()
            engine.shutdown()  # ends run_step_loop

    if threading.current_thread() is threading.main_thread():
        # Installed even where SIGINT was ignored (a shell's background job starts so, and
        # Python then installs no handler): Ctrl-C or a supervisor's SIGINT must still end
        # the live requests with their abort frames (uvicorn, serving the gateway, does the
        # same). SIGTERM (docker stop, a supervisor) stops as Ctrl-C does, and the KV tiers
        # write what they keep at a stop (docs/kv_tiers.md).
        signal.signal(signal.SIGINT, stop_on_signal)
        signal.signal(signal.SIGTERM, stop_on_signal)
    t = threading.Thread(target=server_thread, name="engine-server", daemon=True)
    t.start()
    try:
        engine.run_step_loop()
    finally:
        engine.shutdown()
        started.wait(5)
        if "stop" in control:
            try:  # let the abort frames go out, then close the connections
                control["loop"].call_soon_threadsafe(control["stop"].set)
            except RuntimeError:  # the loop has already ended
                pass
        t.join(timeout=5)
    if failure:
        raise failure[0]
    if interrupted:
        raise KeyboardInterrupt
