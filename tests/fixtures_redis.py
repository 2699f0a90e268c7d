"""Redis fixtures: the real Redis at 127.0.0.1:6379 (no mocks) and a key prefix per test.

* ``redis_url`` (session): ``redis://127.0.0.1:6379/0``; fails (does not skip) with a
  clear message when Redis is not running.
* ``key_prefix`` (function): ``test:{uuid}:``, unique per test; every key under it is
  deleted at teardown (SCAN + DEL).
* ``private_redis`` (function): a ``redis-server`` of the test's own on a free port
  that the test may kill and restart (see ``PrivateRedis``).
"""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis URL; the test fails at once when nothing answers there."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
    try:
        client.ping()
    except (redis.RedisError, OSError) as e:
        pytest.fail(f"Redis is not running at {REDIS_URL} ({e}); start it (e.g. `redis-server --daemonize yes`)",
                    pytrace=False)
    finally:
        client.close()
    return REDIS_URL


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key that starts with ``prefix``; returns how many."""
    client = redis.Redis.from_url(url)
    try:
        n = 0
        batch: list[bytes] = []
        for key in client.scan_iter(match=prefix.replace("[", "\\[") + "*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                n += client.delete(*batch)
                batch.clear()
        if batch:
            n += client.delete(*batch)
        return n
    finally:
        client.close()


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A unique key prefix for this test; its keys are deleted afterwards."""
    prefix = f"test:{uuid.uuid4().hex}:"
    yield prefix
    delete_prefix(redis_url, prefix)


class PrivateRedis:
    """A ``redis-server`` of this test's own on a free port, which the test may kill
    (``kill()``: SIGKILL) and start again (``start()``) on the same port. With
    ``durable`` it keeps an append-only file fsynced on every write (what a killed
    server had acknowledged comes back); else nothing is persisted."""

    def __init__(self, data_dir: Path, durable: bool = True) -> None:
        self.data_dir = data_dir
        self.durable = durable
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it (again) and wait until it answers PING."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        persist = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else ["--appendonly", "no"]
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
             "--save", "", *persist], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
            try:
                if client.ping():
                    return
            except (redis.RedisError, OSError):
                time.sleep(0.05)
            finally:
                client.close()
        raise RuntimeError(f"private redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        """SIGKILL it (no shutdown save) and wait for it to be gone."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A started, durable ``PrivateRedis`` (never the shared one on 6379); killed at teardown."""
    r = PrivateRedis(tmp_path / "private-redis")
    r.start()
    yield r
    r.kill()
