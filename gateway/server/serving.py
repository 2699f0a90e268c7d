"""Running the app under uvicorn with the gateway's socket limits.

* ``ws_max_size`` is the documented ``max_frame_bytes``: a bigger frame is refused by
  the WebSocket layer from its header, before its payload is read, and a socket that
  does not read its pongs stops being read (``gateway/server/ws_protocol.py``).
* Request heads are bounded in size, field count and time, bodies in time, connections
  per address and in total (``gateway/server/http_limits.py``): 431, 408, 429 or 503, then the
  connection is closed. The counters of both are the app's ``GatewayApp.connections``.
* The listening socket is ours, with ``SO_SNDBUF`` set (``limits.ws_socket_sndbuf_bytes``):
  Linux copies it to every accepted connection, bounding the kernel's share of a slow
  reader's outbound bytes (autotuning would allow several MiB per connection).
* Every accepted connection has ``TCP_NODELAY`` (Nagle's algorithm off). asyncio sets it
  only on sockets whose protocol number is TCP, and a socket made with
  ``socket.socket(family, SOCK_STREAM)`` has protocol 0, as have the connections it
  accepts: with Nagle on, a small frame written while the previous one is not yet
  acknowledged waited for that acknowledgement, which a client delays by up to 40 ms
  (a reply's first delta behind its ``start`` frame took 20-40 ms more;
  docs/benchmarks.md, "Nagle's algorithm and the Redis handshake"). The listening
  socket is made with ``IPPROTO_TCP`` and ``TCP_NODELAY`` (which Linux copies to the
  connections it accepts).
* A refused WebSocket handshake is answered with a JSON reason (``gateway.api.socket``, the ASGI
  denial response); uvicorn's sans-I/O protocol then logs "ASGI callable returned
  without completing handshake." at ERROR although the answer was sent. That one line
  is filtered out (``DeniedHandshakeFilter``).
* Once serving (``serve_and_announce``), everything alive after start-up (the modules,
  the app, its connections) is moved out of the garbage collector's reach
  (``freeze_startup_objects``), so a full collection no longer walks it in the middle of
  a step's replies (docs/benchmarks.md, "Where the tail comes from").
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
from typing import Any

import uvicorn
from starlette.applications import Starlette

from gateway.api.state import GatewayState
from gateway.config import GatewayConfig
from gateway.server.app import GatewayApp
from gateway.server.http_limits import ConnectionStats, bounded_http_protocol
from gateway.server.ws_protocol import bounded_ws_protocol


def make_listen_socket(host: str, port: int, sndbuf_bytes: int | None) -> socket.socket:
    """A bound, listening TCP socket; ``port`` 0 picks a free one. It listens at once:
    a socket only bound (SO_REUSEADDR) while the gateway starts its engine and Redis
    could see one of them bind and listen on the same port first (both reuse-enabled,
    neither listening yet), and then fail with "address in use". Connections that
    arrive before the app serves wait in the backlog.

    Raises:
        OSError: the address is in use or not available.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that name TCP (module doc)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sndbuf_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf_bytes)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DeniedHandshakeFilter(logging.Filter):
    """Drops uvicorn's false alarm after a WebSocket denial response (see module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False for that one message, True for every other record."""
        return record.getMessage() != "ASGI callable returned without completing handshake."


_DENIED_FILTER = DeniedHandshakeFilter()


def uvicorn_config(app: Starlette, config: GatewayConfig, log_level: str = "info") -> uvicorn.Config:
    """The uvicorn settings for ``app`` under ``config`` (see module doc); the connection
    counters go to a gateway app's ``connections`` (for ``/metrics``; any other app,
    a test's fake upstream, gets counters of its own)."""
    logging.getLogger("uvicorn.error").addFilter(_DENIED_FILTER)  # the same object: added once
    lim = config.limits
    stats = app.connections if isinstance(app, GatewayApp) else ConnectionStats()
    return uvicorn.Config(
        app, host=config.host, port=config.port, lifespan="on", log_level=log_level,
        # a socket whose writes stay paused is aborted after twice the app's stall timeout
        # (the app closes a stalled socket first, and counts it; the abort frees the rest)
        ws=bounded_ws_protocol(lim.max_frame_bytes, 2 * lim.ws_send_timeout_s, stats), ws_max_size=lim.max_frame_bytes,
        ws_per_message_deflate=config.ws_per_message_deflate,
        ws_ping_interval=20.0, ws_ping_timeout=20.0, timeout_graceful_shutdown=10,
        http=bounded_http_protocol(lim, stats),
    )


def bound_port(server: uvicorn.Server) -> int:
    """The port a started server listens on."""
    port: int = server.servers[0].sockets[0].getsockname()[1]
    return port


class ThreadedServer:
    """A uvicorn server on its own thread and event loop (tests, embedding).

    ``start()`` returns once the app's startup finished and the socket listens.
    """

    def __init__(self, app: Starlette, config: GatewayConfig, log_level: str = "warning") -> None:
        self.app = app
        self.config = config
        self.server = uvicorn.Server(uvicorn_config(app, config, log_level))
        self.sock = make_listen_socket(config.host, config.port, config.limits.ws_socket_sndbuf_bytes)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _main(self) -> None:
        try:
            self.loop = asyncio.new_event_loop()
            self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        except BaseException as e:  # reported by start()
            self.error = e
        finally:
            if self.loop is not None:
                self.loop.close()

    def start(self, timeout: float = 30.0) -> int:
        """Start serving; returns the port.

        Raises:
            RuntimeError: the server did not start within ``timeout`` seconds.
        """
        self.thread = threading.Thread(target=self._main, name="gateway-server", daemon=True)
        self.thread.start()
        pause = threading.Event()  # never set: a sleep that reads as one
        for _ in range(int(timeout * 50)):
            if self.server.started or self.error is not None or not self.thread.is_alive():
                break
            pause.wait(0.02)
        if not self.server.started:
            raise RuntimeError(f"gateway did not start: {self.error!r}")
        port: int = self.sock.getsockname()[1]
        return port

    @property
    def gateway(self) -> GatewayState:
        """The running parts of the gateway it serves (``GatewayApp.gateway``).

        Raises:
            TypeError: it serves another app.
            RuntimeError: the app's lifespan has not started.
        """
        if not isinstance(self.app, GatewayApp):
            raise TypeError(f"{type(self.app).__name__} is not a gateway app")
        return self.app.gateway

    def run_coro(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Shut down (closing sockets, stopping replies) and join the thread."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()


def freeze_startup_objects() -> None:
    """Collect the start-up garbage, then move every object alive now to the collector's
    permanent generation (``gc.freeze``): later collections, full ones included, walk
    only the objects made since. For a process that serves one app until it exits (not
    for tests, which start many): what is frozen is never collected."""
    gc.collect()
    gc.freeze()


async def serve_and_announce(server: uvicorn.Server, sock: socket.socket, ready_line: str) -> None:
    """Serve ``server`` on ``sock`` until it stops; once it accepts connections, freeze
    the start-up objects (``freeze_startup_objects``) and print ``ready_line`` (flushed),
    so a parent process or a user knows when to connect."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        freeze_startup_objects()
        print(ready_line, flush=True)
    await task
