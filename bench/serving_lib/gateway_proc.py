"""Run the real gateway (with the OpenAI API and metrics when available) for a benchmark.

    python -m bench.serving_lib.gateway_proc --engine ws://... --redis-url redis://... \
        --key-prefix bench-x: [--port 0] [--tap]

Prints ``GATEWAY READY http://127.0.0.1:PORT`` once it serves. ``--tap`` adds two routes
for bench/gateway_load.py: ``POST /_bench/tap/install`` (wrap the engine connections with
``EngineTap``) and ``GET /_bench/tap`` (the records as JSON); with ``--profile PATH`` too,
``POST /_bench/profile/start`` and ``POST /_bench/profile/stop`` turn cProfile on and off
(its stats go to PATH at SIGTERM), so a profile can cover only the replies' run and not
the benchmark's cookie and read-back requests. The gateway is the product's
own app (``gateway.server.extensions.create_app_with_extras``, else ``gateway.server.app.create_app``),
served by uvicorn exactly as ``python -m gateway`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from bench.serving_lib.tap import EngineTap


def tap_routes(tap: EngineTap, profiler: Any = None) -> list[Route]:
    """The two ``/_bench/tap`` routes, and the two ``/_bench/profile`` routes when
    ``profiler`` (a ``cProfile.Profile``) is given (see module doc)."""
    from gateway.api.state import gateway_state

    async def install(request: Request) -> JSONResponse:
        return JSONResponse({"installed": tap.install(gateway_state(request).router)})

    async def read(request: Request) -> JSONResponse:
        return JSONResponse(tap.snapshot())

    routes = [Route("/_bench/tap/install", install, methods=["POST"]), Route("/_bench/tap", read, methods=["GET"])]
    if profiler is not None:
        async def start(request: Request) -> JSONResponse:
            profiler.enable()
            return JSONResponse({"profiling": True})

        async def stop(request: Request) -> JSONResponse:
            profiler.disable()
            return JSONResponse({"profiling": False})

        routes += [Route("/_bench/profile/start", start, methods=["POST"]),
                   Route("/_bench/profile/stop", stop, methods=["POST"])]
    return routes


def build_app(config: Any, tap: EngineTap | None, profiler: Any = None) -> Any:
    """The gateway app for ``config`` (a ``GatewayConfig``), with the OpenAI API when the
    gateway has it and the tap routes when ``tap`` is given (with the profile's routes
    when ``profiler`` is too)."""
    extra = tap_routes(tap, profiler) if tap is not None else []
    try:
        from gateway.server.extensions import default_extras

        routes, events, middleware = default_extras(config)
        from gateway.server.app import create_app

        app = create_app(config, extra_routes=[*extra, *routes], events=events)
        for m in middleware:
            app.add_middleware(m.cls, *m.args, **m.kwargs)
        return app
    except ImportError:  # a gateway without the OpenAI API still serves /ws
        from gateway.server.app import create_app

        return create_app(config, extra_routes=extra)


def _profile_until_sigterm(path: str, now: bool) -> Any:
    """A profiler of this process, on from now when ``now`` (else turned on by the
    ``/_bench/profile`` routes); on SIGTERM its stats go to ``path`` and the process exits.
    Returns the ``cProfile.Profile``."""
    import cProfile
    import os
    import signal

    prof = cProfile.Profile()

    def dump(_sig: int, _frame: object) -> None:
        prof.disable()
        prof.dump_stats(path)
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    if now:
        prof.enable()
    return prof


def main(argv: list[str] | None = None) -> int:
    """Serve until killed; returns the exit status."""
    from gateway.config import GatewayConfig
    from gateway.server.app import new_secret
    from gateway.server.serving import make_listen_socket, serve_and_announce, uvicorn_config

    p = argparse.ArgumentParser(prog="python -m bench.serving_lib.gateway_proc")
    p.add_argument("--engine", action="append", required=True)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--key-prefix", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tap", action="store_true")
    p.add_argument("--max-generations-per-user", type=int, default=4)
    p.add_argument("--routing-policy", default=None, help="routing POLICIES (default: the gateway's)")
    p.add_argument("--routing-load-tokens", type=float, default=None, help="cache_aware's load weight (tokens)")
    p.add_argument("--profile", default=None, metavar="PATH", help="cProfile the gateway; stats to PATH on SIGTERM")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop",
                   help="the event loop (python -m gateway runs uvloop's when installed)")
    a = p.parse_args(argv)
    # with the tap, the benchmark turns the profiler on and off around its replies
    profiler = _profile_until_sigterm(a.profile, now=not a.tap) if a.profile else None
    config = GatewayConfig().with_overrides(
        host="127.0.0.1", port=a.port, redis_url=a.redis_url, key_prefix=a.key_prefix,
        engine_urls=tuple(a.engine), secret_key=new_secret(),
        # every benchmark client connects from one address: its per-address caps are lifted
        limits={"max_messages_per_minute": 100_000, "max_generations_per_user": a.max_generations_per_user,
                "ws_max_sockets_per_address": 100_000, "http_max_connections_per_address": None},
        routing={k: v for k, v in (("policy", a.routing_policy), ("load_tokens", a.routing_load_tokens))
                 if v is not None} or None)
    app = build_app(config, EngineTap() if a.tap else None, profiler)
    sock = make_listen_socket(config.host, config.port, config.limits.ws_socket_sndbuf_bytes)
    server = uvicorn.Server(uvicorn_config(app, config, "warning"))
    serving = serve_and_announce(server, sock, f"GATEWAY READY http://127.0.0.1:{sock.getsockname()[1]}")
    try:
        if a.loop == "uvloop":
            import uvloop

            uvloop.run(serving)
        else:
            asyncio.run(serving)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
