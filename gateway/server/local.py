"""The one-command local default: find or start Redis, and start a local engine.

``ensure_redis`` uses Redis at the configured URL, or, when nothing answers there and
``redis-server`` is installed, starts a private one (append-only file under the data
folder). ``LocalEngine`` runs ``python -m engine serve`` as a subprocess, learns its
address from the ``ENGINE READY ws://HOST:PORT`` line it prints once listening, and
(``supervise``) restarts it on the same port when it dies. Both children get SIGTERM
when the gateway dies, even by ``kill -9`` (``die_with_parent``).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import redis

from engine.protocol import SECRET_ENV
from gateway.retry import Backoff

READY_PREFIX = "ENGINE READY "

REDIS_HELP = (
    "No Redis answered at {url}, and redis-server is not installed to start a private one.\n"
    "Get Redis in one of these ways, then run again:\n"
    "  - Debian/Ubuntu: sudo apt-get install redis-server   (macOS: brew install redis)\n"
    "  - Docker: docker run -d -p 6379:6379 redis:7 redis-server --appendonly yes\n"
    "  - or point REDIS_URL (or --redis-url) at a Redis you have."
)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes a child get ``sig`` when this process dies, even by
    ``kill -9`` (Linux ``prctl(PR_SET_PDEATHSIG)``, through ctypes); None elsewhere.

    The signal follows the death of the *thread* that started the child, so children
    must be started by long-lived threads (the main thread, or the supervisor).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded here: no dlopen after fork
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), int(sig))

    return preexec


class LocalStartError(RuntimeError):
    """Redis or the local engine could not be found or started (message says why/how)."""


LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_redis_url(url: str) -> tuple[str, int]:
    """The host and port of a ``redis://HOST[:PORT][/DB]`` (or ``rediss://``) URL.

    Raises:
        LocalStartError: the URL is not of that shape (a one-line message naming it).
    """
    shape = "expected redis://HOST[:PORT][/DB], e.g. redis://127.0.0.1:6379/0"
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        raise LocalStartError(f"bad Redis URL {url!r}: {shape}")
    try:
        port = parsed.port or 6379
    except ValueError as e:  # e.g. a port over 65535
        raise LocalStartError(f"bad Redis URL {url!r}: {e}") from None
    db = parsed.path.strip("/")
    if db and not db.isdigit():
        raise LocalStartError(f"bad Redis URL {url!r}: the database must be a number ({shape})")
    return parsed.hostname, port


def port_in_use(host: str, port: int) -> bool:
    """True when something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


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

    process: subprocess.Popen[bytes]
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
        LocalStartError: a malformed URL; nothing answers at a host that is not this
            machine; nothing answers and ``redis-server`` is missing (the message says
            how to get Redis) or the port is taken; or the started one did not come up.
    """
    host, port = parse_redis_url(url)
    if redis_answers(url):
        return None
    if host not in LOCAL_HOSTS:
        raise LocalStartError(f"No Redis answered at {url}. {host} is not this machine, so no private Redis is "
                              f"started: check the address, and that Redis runs there and accepts connections.")
    server = shutil.which("redis-server")
    if server is None:
        raise LocalStartError(REDIS_HELP.format(url=url))
    if port_in_use(host, port):
        raise LocalStartError(f"No Redis answered at {url}, and port {port} is taken by another program, so a "
                              f"private Redis cannot start there. Point --redis-url (REDIS_URL) at another port.")
    rdir = Path(data_dir) / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [server, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(rdir), "--appendonly", "yes",
         "--save", "", "--daemonize", "no", "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LocalStartError(f"redis-server exited with code {proc.returncode} at startup (port {port}, data "
                                  f"folder {rdir}); run it by hand to see why: {server} --port {port}")
        if redis_answers(url, 0.5):
            say(f"Started a private Redis at {url} (data in {rdir}, append-only).")
            return LocalRedis(proc, url, rdir)
        time.sleep(0.1)
    _terminate(proc, 5.0)
    raise LocalStartError(f"redis-server did not answer at {url} within {wait_s:.0f} s")


def new_engine_secret() -> str:
    """A fresh secret for the engine link (256 random bits, URL-safe)."""
    return secrets.token_urlsafe(32)


class LocalEngine:
    """A ``python -m engine serve`` subprocess on 127.0.0.1 (a free port by default),
    optionally supervised: ``supervise()`` restarts it on the same port when it exits
    unexpectedly, so the gateway's ``EngineClient`` reconnects to the same URL.

    Args:
        model: model folder or file; None uses the engine's default (bundled SmolLM2).
        port: the port to listen on (0: a free one, kept for restarts once bound).
        extra_args: more ``engine serve`` options (e.g. ``["--num-blocks", "512"]``).
        env: extra environment variables (``HF_HUB_OFFLINE=1`` is always set).
        echo: where to copy the engine's other output lines (None: drop them).
        secret: the engine link's secret (``ENGINE_SECRET``): the engine then refuses any
            connection without it. It goes in the child's environment, never on its
            command line (``/proc/PID/cmdline`` is readable by every local user; the
            environment only by the same user and root). None: no secret.
    """

    def __init__(self, model: str | None = None, extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 echo: Callable[[str], None] | None = None, cwd: str | None = None, port: int = 0,
                 secret: str | None = None) -> None:
        self.model = model
        self.port = port
        self.extra_args = list(extra_args)
        self.secret = secret
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        if secret:
            self.env[SECRET_ENV] = secret  # never a command-line argument (ps shows those)
        self.echo = echo
        self.cwd = cwd
        self.process: subprocess.Popen[str] | None = None
        self.url: str | None = None
        self.output_tail: list[str] = []
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # orders stop() against a restart's Popen
        self._watcher: threading.Thread | None = None

    def command(self) -> list[str]:
        """The command line that starts the engine."""
        cmd = [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.model:
            cmd += ["--model", str(self.model)]
        return cmd + self.extra_args

    def start(self, timeout_s: float = 600.0) -> str:
        """Start the engine and wait for its READY line; returns its ``ws://`` URL.
        The port it bound is kept, so a restart listens at the same URL.

        Raises:
            LocalStartError: it exited or did not get ready in ``timeout_s`` seconds
                (the message holds its last output lines).
        """
        self._stopping.clear()
        url = self._spawn(timeout_s)
        self.port = urlparse(url).port or self.port
        return url

    def _spawn(self, timeout_s: float) -> str:
        with self._lock:
            if self._stopping.is_set():
                raise LocalStartError("the local engine is being stopped")
            self.process = proc = subprocess.Popen(
                self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                env=self.env, cwd=self.cwd, preexec_fn=die_with_parent())
        found = threading.Event()
        threading.Thread(target=self._drain, args=(proc, found), name="engine-output", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not found.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline or self._stopping.is_set():
                tail = "\n".join(self.output_tail[-20:])
                _terminate(proc, 10.0)
                raise LocalStartError(f"the local engine did not start ({' '.join(self.command())}):\n{tail}")
        assert self.url is not None
        return self.url

    def _drain(self, proc: subprocess.Popen[str], found: threading.Event) -> None:
        # Keeps reading after READY so the pipe never fills and blocks the engine.
        assert proc.stdout is not None
        with proc.stdout:  # closed at EOF (the engine exited)
            for line in proc.stdout:
                line = line.rstrip("\n")
                self.output_tail = (self.output_tail + [line])[-50:]
                if not found.is_set() and line.startswith(READY_PREFIX):
                    self.url = line[len(READY_PREFIX):].strip()
                    found.set()
                elif self.echo is not None:
                    self.echo(line)

    def supervise(self, say: Callable[[str], None] = print, backoff_s: tuple[float, float] = (1.0, 30.0),
                  start_timeout_s: float = 600.0) -> None:
        """Restart the engine whenever it exits without ``stop()`` (a crash, ``kill
        -9``), on the same port, after a backoff that doubles from ``backoff_s[0]`` to
        ``backoff_s[1]`` seconds while restarts fail (e.g. the port is still taken) and
        resets after a successful one. Runs on a daemon thread; returns at once."""
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, args=(say, backoff_s, start_timeout_s),
                                             name="engine-supervisor", daemon=True)
            self._watcher.start()

    def _watch(self, say: Callable[[str], None], backoff_s: tuple[float, float], start_timeout_s: float) -> None:
        backoff = Backoff(*backoff_s)
        while True:
            proc = self.process
            if proc is not None:
                proc.wait()
            if self._stopping.is_set():
                return
            code = proc.returncode if proc is not None else None
            say(f"The local engine exited (code {code}); restarting it on port {self.port} in {backoff.peek():.0f} s.")
            if self._stopping.wait(backoff.peek()):
                return
            try:
                url = self._spawn(start_timeout_s)
            except LocalStartError as e:
                if self._stopping.is_set():
                    return
                say(f"Restarting the local engine failed: {str(e).splitlines()[-1] if str(e) else e}")
                backoff.next_delay()  # double the next wait
                continue
            self.restarts += 1
            backoff.reset()
            say(f"The local engine is back at {url}.")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the engine (kill after ``timeout_s``) and stop supervising it."""
        with self._lock:
            self._stopping.set()
            proc = self.process
        if proc is not None:
            _terminate(proc, timeout_s)


def _terminate(proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
