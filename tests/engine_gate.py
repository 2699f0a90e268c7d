"""``EngineGate``: a WebSocket relay between gateways and a real engine process, which a
test can pause and resume, so that a reply is still in progress when the test acts on
it (Stop, a reload, a dropped socket, a second tab, Redis going away), however fast the
engine is.

Pausing stops the engine's process (SIGSTOP; SIGCONT resumes it): the engine really
halts mid-reply with its KV blocks held, as a stalled engine would, and nothing in the
product knows about the test. The relay sees every frame in both directions, so a test
can pause the engine the moment it sends a chosen frame (``pause_on``; the items of a
``step`` frame count as frames of their own here: ``from_engine`` and the predicates see
them one by one). The matching frame reaches the gateways and nothing after it does
until ``resume``: the relay stops reading the engine there. A busy machine can run the
engine many steps ahead of the relay before the stop lands (a test process's threads
share one interpreter), so what the engine already sent waits unrelayed in the connection's queue, and the
gateways see a halt exactly at the chosen frame however far ahead the engine got; on
``resume(pause_on=...)`` the waiting frames are read first, and the relay halts again at
the first of them that matches. The gate can also wait until the gateway has sent the engine a
frame (``sent``: the ``abort`` that a Stop causes, the ``generate`` of a turn), and pass
chosen requests' frames on one per interval (``throttle``: the gateway sees those replies
stream slowly while the engine itself runs free). Frames pass unchanged, except that a
throttled request's items leave their step frame for a step frame of their own.

An async test::

    gw = gateway_factory(engine_urls=[engine_gate.url])
    engine_gate.pause_on(text_delta())          # the engine halts after its first text
    ...send a chat; read the start and the first delta...
    await engine_gate.paused()
    ...act: Stop (a cancel frame), reload, drop the socket, kill Redis...
    await engine_gate.sent(of_type("abort", request_id))
    engine_gate.resume()                         # it takes the abort within a step or two

Sync tests (Playwright, the OpenAI SDK) call ``wait_paused`` and ``wait_sent`` instead.
The ``engine_gate`` fixture (tests/fixtures_servers.py) puts one in front of the shared
tiny engine and resumes the engine when the test ends, whatever happened.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Any

from websockets.asyncio.client import connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake

Frame = dict[str, Any]
Predicate = Callable[[Frame], bool]


def of_type(kind: str, request_id: str | None = None) -> Predicate:
    """A predicate: frames of type ``kind`` (and of ``request_id``, when given)."""
    return lambda f: f.get("type") == kind and (request_id is None or f.get("request_id") == request_id)


def text_delta(request_id: str | None = None) -> Predicate:
    """A predicate: ``delta`` frames that carry text (a step can end inside a UTF-8
    character and send none; the gateway shows clients only deltas with text)."""
    is_delta = of_type("delta", request_id)
    return lambda f: is_delta(f) and bool(f.get("text"))


class EngineGate:
    """The relay (see the module doc). ``url`` is what gateways connect to.

    Args:
        upstream: the engine's ``ws://`` URL.
        pid: returns the engine process's id now (it changes when the engine restarts).
    """

    def __init__(self, upstream: str, pid: Callable[[], int | None]) -> None:
        self.upstream = upstream
        self._pid = pid
        self.url = ""
        self.from_engine: list[Frame] = []  # every frame the engine sent, in order
        self.to_engine: list[Frame] = []  # every frame the gateways sent the engine
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._armed: Predicate | None = None
        # set while a relay holds the engine's frames after a ``pause_on`` match; ``resume``
        # sets it (on the relay's loop) and clears it here
        self._hold: asyncio.Event | None = None
        self._stopped_pid: int | None = None  # the process this gate stopped, until resumed
        self._throttle_s: float | None = None
        self._throttled: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._thread: threading.Thread | None = None

    # ---- life cycle ----------------------------------------------------------------

    def start(self) -> str:
        """Start relaying (on a thread with its own event loop); returns ``url``."""
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop

            async def listen() -> Server:
                return await serve(self._relay, "127.0.0.1", 0, max_size=None, compression=None,
                                   ping_interval=None)

            self._server = loop.run_until_complete(listen())
            port = next(iter(self._server.sockets)).getsockname()[1]
            self.url = f"ws://127.0.0.1:{port}"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="engine-gate", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the engine gate did not start")
        return self.url

    def close(self) -> None:
        """Resume the engine, then stop relaying (open connections are closed)."""
        self.resume()
        loop, server = self._loop, self._server
        if loop is None or server is None or self._thread is None:
            return

        async def shut() -> None:
            server.close()
            await server.wait_closed()

        asyncio.run_coroutine_threadsafe(shut(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(30)

    # ---- control -------------------------------------------------------------------

    def pause(self) -> None:
        """Stop the engine now (its sockets stay open; the kernel keeps what arrives)."""
        with self._lock:
            self._stop_locked()

    def pause_on(self, predicate: Predicate) -> None:
        """Stop the engine as soon as it sends a frame matching ``predicate`` (once)."""
        with self._lock:
            self._armed = predicate

    def resume(self, pause_on: Predicate | None = None) -> None:
        """Let the engine run again and end a ``throttle`` (frames held back pass at
        once); with ``pause_on``, stop it again at its next frame matching that predicate."""
        with self._lock:
            self._throttle_s = None
            self._throttled.clear()
            self._armed = pause_on
            self._continue_locked()
            hold, self._hold = self._hold, None
        if hold is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(hold.set)

    def throttle(self, interval_s: float, request_ids: Iterable[str]) -> None:
        """Until ``resume``, pass the frames of ``request_ids`` on to the gateways one per
        ``interval_s`` seconds (the rest wait in the relay, in order); other frames pass
        at once."""
        with self._lock:
            self._throttle_s = interval_s
            self._throttled.update(request_ids)

    # ---- waiting ---------------------------------------------------------------------

    def wait_paused(self, timeout: float = 60.0) -> None:
        """Block until the engine is stopped (by ``pause_on`` or ``pause``).

        Raises:
            AssertionError: not within ``timeout`` seconds.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: self._stopped_pid is not None, timeout):
                raise AssertionError(f"the engine did not pause within {timeout} s")

    async def paused(self, timeout: float = 60.0) -> None:
        """``wait_paused`` for async tests."""
        await asyncio.to_thread(self.wait_paused, timeout)

    def wait_sent(self, predicate: Predicate, timeout: float = 60.0) -> Frame:
        """Block until a gateway has sent the engine a frame matching ``predicate`` (at
        any time since the gate started); returns the first such frame.

        Raises:
            AssertionError: not within ``timeout`` seconds.
        """
        found: list[Frame] = []

        def seen() -> bool:
            found[:] = [f for f in self.to_engine if predicate(f)][:1]
            return bool(found)

        with self._changed:
            if not self._changed.wait_for(seen, timeout):
                raise AssertionError(f"no matching frame was sent to the engine within {timeout} s")
        return found[0]

    async def sent(self, predicate: Predicate, timeout: float = 60.0) -> Frame:
        """``wait_sent`` for async tests."""
        return await asyncio.to_thread(self.wait_sent, predicate, timeout)

    # ---- internals -------------------------------------------------------------------

    def _stop_locked(self) -> None:
        if self._stopped_pid is not None:
            return
        pid = self._pid()
        if pid is None:
            raise RuntimeError("the engine has no process to pause")
        os.kill(pid, signal.SIGSTOP)
        self._stopped_pid = pid
        self._changed.notify_all()

    def _continue_locked(self) -> None:
        pid, self._stopped_pid = self._stopped_pid, None
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # it was killed while stopped (a test of a dying engine)
        self._changed.notify_all()

    def _on_engine_frame(self, frame: Frame) -> asyncio.Event | None:
        """Record ``frame``; when it matches ``pause_on``, stop the engine and return the
        event to wait on (set by ``resume``) before relaying anything after it."""
        with self._lock:
            self.from_engine.append(frame)
            hold = None
            if self._armed is not None and self._armed(frame):
                self._armed = None
                self._stop_locked()
                if self._hold is None:
                    self._hold = asyncio.Event()
                hold = self._hold
            self._changed.notify_all()
            return hold

    def _on_gateway_frame(self, frame: Frame) -> None:
        with self._lock:
            self.to_engine.append(frame)
            self._changed.notify_all()

    async def _relay(self, down: ServerConnection) -> None:
        try:
            # max_queue=None: frames are read off the socket even while a halt holds them
            # here, so an engine that dies meanwhile is seen to close
            async with connect(self.upstream, max_size=None, max_queue=None, compression=None,
                               ping_interval=None, open_timeout=10) as up:
                pumps = [asyncio.create_task(self._pump_from_engine(up, down)),
                         asyncio.create_task(self._pump_to_engine(down, up))]
                _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        except (OSError, TimeoutError, InvalidHandshake, ConnectionClosed):
            pass  # the engine is down or restarting: the gateway's client reconnects later

    async def _pump_to_engine(self, down: ServerConnection, up: Any) -> None:
        try:
            async for message in down:
                self._on_gateway_frame(_parse(message))
                await up.send(message)
        except ConnectionClosed:
            pass

    async def _pump_from_engine(self, up: Any, down: ServerConnection) -> None:
        # A throttled request's frames take a lane of their own (a queue and a task that
        # sends one per interval), and keep it after the throttle ends, so they stay in order.
        lanes: dict[str, asyncio.Queue[Any]] = {}
        senders: list[asyncio.Task[None]] = []

        async def lane(queue: asyncio.Queue[Any]) -> None:
            while True:
                message = await queue.get()
                with self._lock:
                    wait = self._throttle_s
                if wait:
                    await asyncio.sleep(wait)
                await down.send(message)

        def laned(rid: Any) -> bool:
            with self._lock:
                slow = rid in self._throttled and self._throttle_s is not None
            return isinstance(rid, str) and (slow or rid in lanes)

        def to_lane(rid: str, message: Any) -> None:
            if rid not in lanes:
                lanes[rid] = asyncio.Queue()
                senders.append(asyncio.create_task(lane(lanes[rid])))
            lanes[rid].put_nowait(message)

        async def held(hold: asyncio.Event) -> None:
            # until resume, or until the engine's side closes (a test killed the stopped
            # engine): what it sent before then passes, as frames in transit would
            waits = [asyncio.ensure_future(hold.wait()), asyncio.ensure_future(up.wait_closed())]
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()

        try:
            # one frame at a time: the engine is stopped the moment its frame is read, and
            # while a halt holds, what it sent after waits unread (and is matched against
            # the next pause_on once resumed)
            async for message in up:
                frame = _parse(message)
                if frame.get("type") != "step":
                    hold = self._on_engine_frame(frame)
                    rid = frame.get("request_id")
                    if laned(rid):
                        to_lane(rid, message)
                    else:
                        await down.send(message)
                    if hold is not None:
                        await held(hold)
                    continue
                # a step frame: a laned request's items leave it for a step frame of their
                # own; at a pause_on match the items up to it pass, the rest wait for resume
                items = [i for i in frame.get("items", []) if isinstance(i, dict)]
                rest: list[Frame] = []
                whole = True
                for n, item in enumerate(items):
                    hold = self._on_engine_frame(item)
                    if laned(item.get("request_id")):
                        to_lane(item["request_id"], json.dumps({"type": "step", "items": [item]}))
                        whole = False
                    else:
                        rest.append(item)
                    if hold is None:
                        continue
                    if whole and n == len(items) - 1:
                        await down.send(message)
                    elif rest:
                        await down.send(json.dumps({"type": "step", "items": rest}))
                    rest, whole = [], False
                    await held(hold)
                if whole:
                    await down.send(message)
                elif rest:
                    await down.send(json.dumps({"type": "step", "items": rest}))
        except ConnectionClosed:
            pass
        finally:
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)


def _parse(message: Any) -> Frame:
    try:
        frame = json.loads(message)
    except ValueError:
        return {}
    return frame if isinstance(frame, dict) else {}
