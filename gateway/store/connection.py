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

The same pools' connections pack commands in C (``PackedConnection``), send without a
task per write, read a round trip's answers in one go, and skip the handshake commands
the gateway does not use (``handshake_options``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
from redis.asyncio.client import PubSub
from redis.asyncio.connection import (
    AbstractConnection,
    Connection,
    async_timeout,  # asyncio.timeout, or its backport before 3.11
)
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, ResponseError, TimeoutError
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

    async def send_packed_command(self, command: bytes | str | Iterable[bytes], check_health: bool = True) -> None:
        """Send packed command(s), as redis-py does, but without its ``asyncio.wait_for``
        around the write, which on Python 3.11 runs every write as a task of its own (one
        more event-loop step and task per command or round trip). The timeout
        (``socket_timeout``) is kept for the only part that can wait: a drain while the
        socket's send buffer is full. Connecting (first use, or after a disconnect) and
        the health-check PING are redis-py's own.

        Raises:
            redis.exceptions.ConnectionError: the write failed (the connection is closed).
            redis.exceptions.TimeoutError: the send buffer stayed full for ``socket_timeout``.
        """
        if not self.is_connected or not self.socket_timeout:
            await super().send_packed_command(command, check_health)
            return
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
        try:
            if isinstance(command, str):
                command = command.encode()
            if isinstance(command, bytes):
                command = [command]
            writer = self._writer
            assert writer is not None  # connected
            writer.writelines(command)
            if writer.transport.get_write_buffer_size():  # not all sent at once: the drain may wait
                async with async_timeout(self.socket_timeout):
                    await writer.drain()
            else:
                await writer.drain()  # returns at once (or raises what a lost connection left)
        except asyncio.TimeoutError:
            await self.disconnect(nowait=True)
            raise TimeoutError("Timeout writing to socket") from None
        except OSError as e:
            await self.disconnect(nowait=True)
            err_no, errmsg = ("UNKNOWN", e.args[0]) if len(e.args) == 1 else (e.args[0], e.args[1])
            raise ConnectionError(f"Error {err_no} while writing to socket. {errmsg}.") from e
        except BaseException:
            await self.disconnect(nowait=True)  # never reused half-written
            raise

    async def read_responses(self, count: int) -> list[Any]:
        """The answers to the ``count`` commands sent last, in order: one timeout
        (``socket_timeout``) for all of them, and each answer taken from hiredis' reader
        as it is parsed, where ``read_response`` sets up a timeout and a parser call per
        answer. A command's error (``ResponseError``) is its answer, not raised (without a
        traceback: a traceback's frames would refer back to it). Without the hiredis
        parser it reads with ``read_response``, one answer at a time. A RESP3 push
        notification met on the way is handled as ``read_response`` handles it.

        Raises:
            redis.exceptions.ConnectionError: the connection broke or was closed (it is
                then disconnected: never reused out of step).
            redis.exceptions.TimeoutError: the answers took longer than ``socket_timeout``.
        """
        parser = self._parser
        if type(parser) is not _AsyncHiredisParser or not self.socket_timeout:
            return await _one_by_one(self, count)
        out: list[Any] = []
        try:
            if not parser._connected:
                raise ConnectionError("Connection closed by server.")
            reader = parser._reader
            assert reader is not None  # connected
            push = parser._hiredis_PushNotificationType
            async with async_timeout(self.socket_timeout):
                while len(out) < count:
                    answer = reader.gets()
                    if answer is NOT_ENOUGH_DATA:
                        await parser.read_from_socket()
                        continue
                    if isinstance(answer, ConnectionError):
                        raise answer
                    if push is not None and isinstance(answer, push):  # RESP3: not an answer
                        await parser.handle_push_response(answer)
                        continue
                    if isinstance(answer, list) and answer and isinstance(answer[0], ConnectionError):
                        raise answer[0]
                    out.append(answer)
        except asyncio.TimeoutError:
            await self.disconnect(nowait=True)
            raise TimeoutError(f"Timeout reading from {self._host_error()}") from None
        except OSError as e:
            await self.disconnect(nowait=True)
            raise ConnectionError(f"Error while reading from {self._host_error()} : {e.args}") from None
        except BaseException:
            await self.disconnect(nowait=True)
            raise
        if self.health_check_interval:
            self.next_health_check = asyncio.get_running_loop().time() + self.health_check_interval
        return out


async def read_answers(conn: AbstractConnection, count: int) -> list[Any]:
    """The answers to the ``count`` commands sent last on ``conn``, in order, a command's
    error (``ResponseError``) as its answer: in one go on a ``PackedConnection``
    (``read_responses``), else one ``read_response`` at a time.

    Raises:
        redis.exceptions.ConnectionError, TimeoutError: as ``read_response``.
    """
    if isinstance(conn, PackedConnection):
        return await conn.read_responses(count)
    return await _one_by_one(conn, count)


async def _one_by_one(conn: AbstractConnection, count: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(count):
        try:
            out.append(await conn.read_response())
        except ResponseError as e:
            # without its traceback: the traceback's frames refer back to it (a cycle
            # only a full garbage collection would free)
            out.append(e.with_traceback(None))
    return out


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
