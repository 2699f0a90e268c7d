"""How the gateway's Redis clients survive a Redis restart (one place for it).

After Redis restarts (``kill -9`` and start again), every pooled connection is stale:
its first command fails with ``ConnectionError``. ``redis.from_url`` and
``ConnectionPool.from_url`` build connections with no retry at all, so each stale
connection surfaced once as ``store_unavailable``. With these options a command that
meets a stale or broken connection is retried on a fresh one (``Retry`` on
``ConnectionError``/``TimeoutError``, exponential backoff with jitter), so requests
succeed as soon as Redis answers; a connection idle longer than the health-check
interval is PINGed before use. While Redis stays down a command still fails after
``RETRIES`` tries (about 2 s), and callers report ``store_unavailable``.

The same pools' connections pack commands in C (``PackedConnection``) and skip the
handshake commands the gateway does not use (``handshake_options``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from redis.asyncio.client import PubSub
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.maint_notifications import MaintNotificationsConfig
from redis.typing import EncodableT

# redis-py's hiredis extra (pyproject.toml): its C command packer (typed here by hand:
# hiredis' stub gives its argument as a tuple of one element)
_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    import hiredis

    _hiredis_pack = hiredis.pack_command
except ImportError:  # pragma: no cover - the gateway installs it
    _hiredis_pack = None

RETRIES = 4  # tries after the first; backoff 50 ms doubling, at most 1 s (with jitter)
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
HEALTH_CHECK_INTERVAL_S = 10  # idle connections are PINGed before use after this long


def resilience_options() -> dict[str, Any]:
    """Keyword arguments for ``redis.asyncio.from_url`` / ``ConnectionPool.from_url``:
    ``retry``, ``retry_on_error`` and ``health_check_interval`` (see module doc)."""
    return {"retry": Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES),
            "retry_on_error": [ConnectionError, TimeoutError],
            "health_check_interval": HEALTH_CHECK_INTERVAL_S}


def handshake_options() -> dict[str, Any]:
    """Keyword arguments for ``BlockingConnectionPool.from_url`` that keep a new
    connection's handshake to what the gateway uses: no ``CLIENT SETINFO`` (library name
    and version) and no ``CLIENT MAINT_NOTIFICATIONS`` (a managed-cloud feature). redis-py
    sends all three by default and ignores their errors, so on a Redis that knows none of
    them (before 7.2) each new connection cost three extra commands, each answered with an
    error (about one per reply while the pool grows under a burst of new turns)."""
    return {"driver_info": None, "maint_notifications_config": MaintNotificationsConfig(enabled=False)}


class PackedConnection(Connection):
    """A TCP connection that packs its commands with hiredis' C packer instead of
    redis-py's Python one, which costs about 8 µs per command against under 1 µs (one per
    reply stream write and every turn's scripts: docs/benchmarks.md, "Where a token's
    CPU goes"). The bytes sent are the same: a command with anything but ``str``,
    ``bytes`` and ``int`` arguments (a float, which redis-py writes with ``repr``; a
    command name with a space, which redis-py splits; a ``memoryview``), or a client with
    another encoding than strict UTF-8, is packed by redis-py as before (a long value is
    then sent as one buffer rather than in chunks: the same bytes)."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        """The command as the bytes to send (see class doc).

        Raises:
            UnicodeEncodeError: text that is not valid UTF-8 (a lone surrogate), as redis-py.
            redis.exceptions.DataError: an argument redis-py cannot encode (from its packer).
        """
        enc, name = self.encoder, args[0]
        if (_hiredis_pack is None or enc.encoding != "utf-8" or enc.encoding_errors != "strict"
                or (isinstance(name, str) and " " in name) or (isinstance(name, bytes) and b" " in name)
                or any(type(a) not in _PACKABLE for a in args)):
            return super().pack_command(*args)
        return [_hiredis_pack(args)]


_PACKABLE = (str, bytes, int)  # exactly these types (not bool, a subclass of int, nor float)


def packing_options() -> dict[str, Any]:
    """Keyword arguments for ``BlockingConnectionPool.from_url``: connections that pack
    commands in C (``PackedConnection``). A ``rediss://`` or ``unix://`` URL keeps the
    connection class it names (redis-py lets the URL's choice win)."""
    return {"connection_class": PackedConnection}


async def close_quietly(pubsub: PubSub) -> None:
    """Close a pub/sub connection that may already be gone (then there is nothing to close)."""
    try:
        await pubsub.aclose()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
    except Exception:
        pass
