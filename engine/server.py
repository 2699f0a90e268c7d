"""The engine's internal WebSocket endpoint (``docs/protocol.md`` section 1).

One connection carries many requests multiplexed by ``request_id``; ids are
scoped to the connection. A closed connection aborts every request it started.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict
from http import HTTPStatus
from typing import Any

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from engine.async_engine import AsyncEngine
from engine.errors import EngineError, InvalidRequestError
from engine.outputs import GenerateRequest, RequestOutput
from engine.sampling_params import SamplingParams
from engine.text_checks import text_error

log = logging.getLogger(__name__)

# Far above any prompt the context allows; the gateway enforces the user-facing limit.
MAX_FRAME_BYTES = 64 * 1024 * 1024
SECRET_ENV = "ENGINE_SECRET"  # when set, clients must send it in SECRET_HEADER
SECRET_HEADER = "X-Engine-Secret"


def _error(code: str, message: str, request_id: str | None = None) -> str:
    frame: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        frame["request_id"] = request_id
    return json.dumps(frame)


def output_frame(request_id: str, out: RequestOutput) -> dict[str, Any]:
    """The ``delta`` or ``done`` frame for one engine output (client-side request id)."""
    frame: dict[str, Any] = {"type": "done" if out.finished else "delta", "request_id": request_id,
                             "text": out.text, "token_ids": out.token_ids}
    if out.logprobs:
        frame["logprobs"] = [asdict(lp) for lp in out.logprobs]
    if out.finished:
        assert out.usage is not None and out.timings is not None  # a finished output carries both
        frame.update(
            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
            output_text=out.output_text, output_token_ids=out.output_token_ids,
            prompt_token_ids=out.prompt_token_ids, prefix_reused=out.prefix_reused,
            usage=asdict(out.usage), timings=asdict(out.timings),
        )
    return frame


def parse_generate(frame: dict[str, Any], internal_id: str) -> GenerateRequest:
    """Validate a ``generate`` frame into a GenerateRequest.

    Raises:
        InvalidRequestError: unknown or ill-typed fields, bad params.
    """
    allowed = {"type", "request_id", "messages", "prompt_token_ids", "prefix_token_ids", "params", "cache_salt",
               "clamp_max_tokens"}
    unknown = sorted(set(frame) - allowed)
    if unknown:
        raise InvalidRequestError(f"unknown field(s) in generate: {', '.join(unknown)}")
    params = frame.get("params")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequestError("params must be an object")
    salt = frame.get("cache_salt", "")
    if not isinstance(salt, str) or text_error(salt, "cache_salt"):
        raise InvalidRequestError("cache_salt must be a string of valid Unicode")
    return GenerateRequest(
        request_id=internal_id, prompt_token_ids=frame.get("prompt_token_ids"),
        messages=frame.get("messages"), prefix_token_ids=frame.get("prefix_token_ids"),
        params=SamplingParams.from_dict(params), cache_salt=salt,
        clamp_max_tokens=bool(frame.get("clamp_max_tokens", False)),
    )


class EngineServer:
    """Serves one ``AsyncEngine`` over WebSockets."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._conn_ids = itertools.count(1)

    def hello(self) -> dict[str, Any]:
        """The frame sent on connect: what this engine serves."""
        return {"type": "hello", **asdict(self.engine.info)}

    async def handle(self, ws: ServerConnection) -> None:
        """Serve one connection until it closes; then abort its requests."""
        conn = next(self._conn_ids)
        tasks: dict[str, asyncio.Task] = {}
        try:
            await ws.send(json.dumps(self.hello()))
            async for raw in ws:
                await self._on_frame(ws, conn, raw, tasks)
        except ConnectionClosed:
            pass
        finally:
            for t in tasks.values():
                t.cancel()  # generate()'s finally aborts the engine request
            if tasks:
                await asyncio.gather(*tasks.values(), return_exceptions=True)

    async def _on_frame(self, ws: ServerConnection, conn: int, raw: Any, tasks: dict[str, asyncio.Task]) -> None:
        try:
            frame = json.loads(raw)
        except (ValueError, TypeError, RecursionError):
            await ws.send(_error("bad_frame", "frame is not valid JSON (or nests too deeply)"))
            return
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            await ws.send(_error("bad_frame", "frame must be an object with a string 'type'"))
            return
        kind = frame["type"]
        rid = frame.get("request_id")
        if kind == "ping":
            await ws.send('{"type": "pong"}')
        elif kind == "stats":
            await ws.send(json.dumps({"type": "stats", **(await self.engine.stats())}))
        elif kind == "abort":
            if isinstance(rid, str):
                self.engine.abort(f"{conn}:{rid}")
        elif kind == "generate":
            if not isinstance(rid, str) or not rid:
                await ws.send(_error("bad_frame", "generate needs a non-empty string request_id"))
                return
            if rid in tasks:
                await ws.send(_error("duplicate_request_id", f"request {rid!r} is already running", rid))
                return
            try:
                req = parse_generate(frame, f"{conn}:{rid}")
            except EngineError as e:
                await ws.send(_error(e.code, e.message, rid))
                return
            task = asyncio.create_task(self._run(ws, rid, req))
            tasks[rid] = task
            task.add_done_callback(lambda _t: tasks.pop(rid, None))
        else:
            await ws.send(_error("bad_frame", f"unknown frame type {kind!r}", rid if isinstance(rid, str) else None))

    async def _run(self, ws: ServerConnection, rid: str, req: GenerateRequest) -> None:
        try:
            async for out in self.engine.generate(req):
                await ws.send(json.dumps(output_frame(rid, out)))
        except EngineError as e:
            await _send_quietly(ws, _error(e.code, e.message, rid))
        except ConnectionClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let a bug escape as a dropped stream
            log.exception("request %s failed", rid)
            await _send_quietly(ws, _error("engine_error", f"internal error: {type(e).__name__}", rid))


async def _send_quietly(ws: ServerConnection, text: str) -> None:
    try:
        await ws.send(text)
    except ConnectionClosed:
        pass


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
    async with serve(server.handle, host, port, max_size=MAX_FRAME_BYTES, ping_interval=20, ping_timeout=60,
                     process_request=secret_check(os.environ.get(SECRET_ENV) or None)) as ws_server:
        sock = next(iter(ws_server.sockets))
        bound_port = sock.getsockname()[1]
        print(f"ENGINE READY ws://{host}:{bound_port}", flush=True)
        print(f"engine: serving {engine.info.model} on ws://{host}:{bound_port}", file=sys.stderr, flush=True)
        if ready is not None:
            ready.set()
        try:
            await (stop.wait() if stop is not None else asyncio.Future())
        finally:
            engine.shutdown()


def serve_forever(engine: AsyncEngine, host: str, port: int) -> None:
    """Serve forever: the step loop on the calling (main) thread, the WebSocket server's
    asyncio loop on a second thread (``AsyncEngine.run_step_loop`` says why that way
    round). Returns when the server thread ends. On Ctrl-C the live requests end with
    an ``abort`` done frame, the server closes, and KeyboardInterrupt is re-raised.

    Raises:
        OSError: the server could not start (e.g. the address is taken), raised here
            from the server thread.
    """
    failure: list[BaseException] = []
    started = threading.Event()
    control: dict[str, Any] = {}

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
