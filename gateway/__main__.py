"""``python -m gateway``: serve the chat at http://127.0.0.1:8000 (the browser chat,
``/api``, the OpenAI API under ``/v1`` and ``/metrics``).

Options override environment variables (gateway.config.ENV_VARS), which override the
defaults. With no ``--engine`` (and no ``ENGINE_URLS``) a local engine is started on
``--model`` (default: the bundled SmolLM2) and stopped on exit; with no Redis at
``--redis-url``, a private ``redis-server`` is started when installed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import uvicorn

from gateway.config import ConfigError, GatewayConfig, config_from_env, read_shared_prompts
from gateway.server.extensions import create_app_with_extras
from gateway.server.local import LocalEngine, LocalRedis, LocalStartError, ensure_redis, new_engine_secret
from gateway.server.serving import make_listen_socket, serve_and_announce, uvicorn_config


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop's event loop when it is installed (``uvicorn[standard]``
    installs it on Linux and macOS), else on asyncio's. uvloop took 8% less of the
    gateway's CPU per token in the same quiet block (docs/benchmarks.md, "Nagle's
    algorithm and the Redis handshake")."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def parse_args(argv: list[str] | None, base: GatewayConfig) -> tuple[GatewayConfig, str]:
    """Apply command-line options on top of ``base``; returns the config and the log level.

    Raises:
        ConfigError: an option value is out of range.
    """
    # the module doc's first paragraph, without its reStructuredText ``quotes``
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--host", default=base.host, help="listen address (HOST)")
    p.add_argument("--port", type=int, default=base.port, help="listen port (PORT)")
    p.add_argument("--redis-url", default=base.redis_url, help="Redis URL (REDIS_URL)")
    p.add_argument("--engine", action="append", default=None, metavar="URL",
                   help="our engine's ws://host:port, or an OpenAI-compatible http(s)://host:port/v1 (vLLM, "
                        "SGLang, llama-server), repeatable (ENGINE_URLS); none starts a local engine")
    p.add_argument("--model", default=base.model, help="model for the local engine (MODEL)")
    p.add_argument("--engine-args", default=None, metavar="'OPTIONS'",
                   help="more options for the local engine, one quoted string (ENGINE_ARGS), e.g. "
                        "--engine-args '--dtype bfloat16 --quantization int8'")
    p.add_argument("--allowed-origins", nargs="*", default=None, metavar="ORIGIN",
                   help="extra origins allowed to open /ws (ALLOWED_ORIGINS)")
    p.add_argument("--allowed-hosts", nargs="*", default=None, metavar="HOST",
                   help="host names the gateway answers to (ALLOWED_HOSTS; default: localhost, 127.0.0.1, "
                        "[::1] and --host; '*' allows any)")
    p.add_argument("--session-ttl", type=int, default=base.session_ttl_s, metavar="SECONDS",
                   help="expire idle chats after this long (SESSION_TTL_S; default: never)")
    p.add_argument("--data-dir", type=Path, default=base.data_dir, help="data folder (DATA_DIR)")
    p.add_argument("--max-frame-bytes", type=int, default=base.limits.max_frame_bytes,
                   help="largest browser frame (LIMIT_MAX_FRAME_BYTES)")
    p.add_argument("--shared-prompts-file", type=Path, default=None, metavar="FILE",
                   help="a JSON array of prompts shared by every user's prefix cache besides the default system "
                        "prompt (SHARED_PROMPTS_FILE; docs/reliability.md, cache isolation)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="what the gateway (and a local engine) log on stderr (default: %(default)s)")
    a = p.parse_args(_glue_engine_args(sys.argv[1:] if argv is None else argv))
    try:
        shared = read_shared_prompts(a.shared_prompts_file) if a.shared_prompts_file else base.shared_prompts
    except ValueError as e:
        raise ConfigError(f"--shared-prompts-file: {e}") from None
    cfg = base.with_overrides(
        host=a.host, port=a.port, redis_url=a.redis_url, model=a.model, data_dir=a.data_dir,
        engine_urls=tuple(a.engine) if a.engine else base.engine_urls,
        engine_args=_split_args(a.engine_args) if a.engine_args is not None else base.engine_args,
        allowed_origins=tuple(a.allowed_origins) if a.allowed_origins is not None else base.allowed_origins,
        allowed_hosts=tuple(a.allowed_hosts) if a.allowed_hosts is not None else base.allowed_hosts,
        session_ttl_s=a.session_ttl if a.session_ttl and a.session_ttl > 0 else None,
        limits={"max_frame_bytes": a.max_frame_bytes}, shared_prompts=shared)
    return cfg, a.log_level


def _glue_engine_args(argv: list[str]) -> list[str]:
    """``--engine-args VALUE`` as ``--engine-args=VALUE``: argparse would take a VALUE
    that starts with "-" (``--engine-args '--no-prefix-cache'``) for an option."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--engine-args" and i + 1 < len(argv):
            out.append(f"--engine-args={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _split_args(text: str) -> tuple[str, ...]:
    """Shell-style split of ``--engine-args``.

    Raises:
        ConfigError: unbalanced quotes.
    """
    try:
        return tuple(shlex.split(text))
    except ValueError as e:
        raise ConfigError(f"--engine-args: {e}") from None


class _Terminated(Exception):
    """SIGTERM arrived: shut down like Ctrl-C (children stopped in ``main``)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run the gateway until interrupted (SIGINT or SIGTERM); returns the exit status.

    Children (the local engine, a private Redis) are stopped on the way out; they also
    get SIGTERM from the kernel if this process is killed outright (``die_with_parent``).
    """
    try:
        cfg, log_level = parse_args(argv, config_from_env())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn handles SIGTERM while serving, then re-raises it once it stopped: this
    # handler turns that (or one during start-up) into a clean exit through `finally`
    signal.signal(signal.SIGTERM, _on_sigterm)
    local_redis: LocalRedis | None = None
    engine: LocalEngine | None = None
    try:
        try:  # before the model loads: a taken port is reported at once
            sock = make_listen_socket(cfg.host, cfg.port, cfg.limits.ws_socket_sndbuf_bytes)
        except OSError as e:
            print(f"error: cannot listen on {cfg.host}:{cfg.port} ({e.strerror or e}); choose another port with "
                  f"--port 8001 (or PORT=8001; with make: make run ARGS=\"--port 8001\")", file=sys.stderr)
            return 1
        if cfg.engine_args and cfg.engine_urls:
            print("note: --engine-args / ENGINE_ARGS apply to a local engine only; ignored with --engine",
                  file=sys.stderr)
        local_redis = ensure_redis(cfg.redis_url, cfg.data_dir)
        if not cfg.engine_urls:
            print(f"Starting a local engine ({cfg.model or 'bundled SmolLM2-135M-Instruct'})...", flush=True)
            # the gateway's level first: a --log-level in --engine-args comes later and wins; the
            # engine admits only this gateway (a secret of its own unless ENGINE_SECRET names one)
            secret = cfg.engine_secret or new_engine_secret()
            engine = LocalEngine(model=cfg.model, extra_args=(f"--log-level={log_level}", *cfg.engine_args),
                                 echo=lambda line: print(f"[engine] {line}", flush=True), secret=secret)
            cfg = cfg.with_overrides(engine_urls=(engine.start(),), engine_secret=secret)
            engine.supervise(say=lambda line: print(line, flush=True))
        port = sock.getsockname()[1]
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
        server = uvicorn.Server(uvicorn_config(create_app_with_extras(cfg), cfg, log_level))
        run_loop(serve_and_announce(server, sock, f"Chat is ready at http://{host}:{port}"))
        return 0
    except LocalStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, _Terminated):
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if engine is not None:
            engine.stop()
        if local_redis is not None:
            local_redis.stop()


if __name__ == "__main__":
    sys.exit(main())
