"""The one-command local default: find or start Redis, and start a local engine.

``ensure_redis`` uses Redis at the configured URL, or, when nothing answers there and
``redis-server`` is installed, starts a private one (append-only file under the data
folder). ``LocalEngine`` runs ``python -m engine serve`` as a subprocess and learns its
address from the ``ENGINE READY ws://HOST:PORT`` line it prints once listening.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence
from urllib.parse import urlparse

import redis

READY_PREFIX = "ENGINE READY "

REDIS_HELP = (
    "No Redis answered at {url}, and redis-server is not installed to start a private one.\n"
    "Get Redis in one of these ways, then run again:\n"
    "  - Debian/Ubuntu: sudo apt-get install redis-server   (macOS: brew install redis)\n"
    "  - Docker: docker run -d -p 6379:6379 redis:7 redis-server --appendonly yes\n"
    "  - or point REDIS_URL (or --redis-url) at a Redis you have."
)


class LocalStartError(RuntimeError):
    """Redis or the local engine could not be found or started (message says why/how)."""


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when a Redis at ``url`` answers PING within ``timeout_s`` seconds."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


@dataclass
class LocalRedis:
    """A private ``redis-server`` this process started (stop it with ``stop()``)."""

    process: subprocess.Popen
    url: str
    data_dir: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate it (Redis writes its append-only file on SIGTERM)."""
        _terminate(self.process, timeout_s)


def ensure_redis(url: str, data_dir: Path, say: Callable[[str], None] = print,
                 wait_s: float = 10.0) -> LocalRedis | None:
    """Make sure Redis answers at ``url``; start a private one if needed and possible.

    Returns:
        None when one already answered; the started ``LocalRedis`` otherwise.
    Raises:
        LocalStartError: nothing answers and ``redis-server`` is missing (the message
            says how to get Redis), or the started one did not come up.
    """
    if redis_answers(url):
        return None
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
    server = shutil.which("redis-server")
    if server is None or host not in ("127.0.0.1", "localhost", "::1"):
        raise LocalStartError(REDIS_HELP.format(url=url))
    rdir = Path(data_dir) / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(rdir), "--appendonly", "yes",
         "--save", "", "--daemonize", "no", "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalStartError(f"redis-server exited with code {proc.returncode} (is port {port} taken?)")
        if redis_answers(url, 0.5):
            say(f"Started a private Redis at {url} (data in {rdir}, append-only).")
            return LocalRedis(proc, url, rdir)
        time.sleep(0.1)
    _terminate(proc, 5.0)
    raise LocalStartError(f"redis-server did not answer at {url} within {wait_s:.0f} s")


class LocalEngine:
    """A ``python -m engine serve`` subprocess on 127.0.0.1 (a free port by default).

    Args:
        model: model folder or file; None uses the engine's default (bundled SmolLM2).
        port: the port to listen on (0: a free one).
        extra_args: more ``engine serve`` options (e.g. ``["--num-blocks", "512"]``).
        env: extra environment variables (``HF_HUB_OFFLINE=1`` is always set).
        echo: where to copy the engine's other output lines (None: drop them).
    """

    def __init__(self, model: str | None = None, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 echo: Callable[[str], None] | None = None, cwd: str | None = None, port: int = 0) -> None:
        self.model = model
        self.port = port
        self.extra_args = list(extra_args)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        self.echo = echo
        self.cwd = cwd
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self.output_tail: list[str] = []

    def command(self) -> list[str]:
        """The command line that starts the engine."""
        cmd = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.model:
            cmd += ["--model", str(self.model)]
        return cmd + self.extra_args

    def start(self, timeout_s: float = 600.0) -> str:
        """Start the engine and wait for its READY line; returns its ``ws://`` URL.

        Raises:
            LocalStartError: it exited or did not get ready in ``timeout_s`` seconds
                (the message holds its last output lines).
        """
        self.process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, bufsize=1, env=self.env, cwd=self.cwd)
        found = threading.Event()
        threading.Thread(target=self._drain, args=(found,), name="engine-output", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not found.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.output_tail[-20:])
                self.stop()
                raise LocalStartError(f"the local engine did not start ({' '.join(self.command())}):\n{tail}")
        assert self.url is not None
        return self.url

    def _drain(self, found: threading.Event) -> None:
        # Keeps reading after READY so the pipe never fills and blocks the engine.
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.output_tail = (self.output_tail + [line])[-50:]
            if not found.is_set() and line.startswith(READY_PREFIX):
                self.url = line[len(READY_PREFIX):].strip()
                found.set()
            elif self.echo is not None:
                self.echo(line)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the engine (kill after ``timeout_s``)."""
        if self.process is not None:
            _terminate(self.process, timeout_s)


def _terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
