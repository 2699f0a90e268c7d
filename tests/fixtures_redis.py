"""Redis fixtures: the real Redis at 127.0.0.1:6379 (no mocks) and a key prefix per test.

* ``redis_url`` (session): ``redis://127.0.0.1:6379/0``; fails (does not skip) with a
  clear message when Redis is not running.
* ``key_prefix`` (function): ``test:{uuid}:``, unique per test; every key under it is
  deleted at teardown (SCAN + DEL).
"""

from __future__ import annotations

import uuid
from typing import Iterator

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
