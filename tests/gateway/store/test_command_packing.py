"""PackedConnection: commands packed in C are the bytes redis-py's packer would send."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import DataError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.store.connection import PackedConnection, handshake_options, packing_options, resilience_options

COMMANDS = [
    ("XADD", "p:chat:gen:r1", "MAXLEN", "~", 10_000, "3-1", "t", "delta", "x", "héllo 😀 wörld"),
    ("EXPIRE", "p:chat:gen:r1", 86_400),
    ("XADD", "p:chat:gen:r1", "MAXLEN", "~", 10_000, "4-2", "t", "done", "d", "{}"),
    ("SET", "k", ""),
    ("SET", b"\x00\xff", -5),
    ("SET", "big", 2**70),
    ("SET", "long", "x" * 20_000),  # over redis-py's chunking cutoff (6,000 bytes)
    ("EVALSHA", "0" * 40, 2, "a", "b", '{"content": "tab\\t and \\"quotes\\""}'),
    ("CLIENT SETNAME", "gw"),  # a name with a space: redis-py splits it
    (b"CLIENT SETNAME", "gw"),
    ("SET", "f", 1.25),  # a float: redis-py's packer, with its repr
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: str(c[0]) + ":" + type(c[-1]).__name__)
def test_each_command_is_packed_to_the_same_bytes_as_redis_py_packs_it(cmd):
    assert b"".join(PackedConnection().pack_command(*cmd)) == b"".join(Connection().pack_command(*cmd))


def test_a_batch_of_commands_is_packed_to_the_same_bytes_as_redis_py_packs_it():
    assert b"".join(PackedConnection().pack_commands(COMMANDS)) == b"".join(Connection().pack_commands(COMMANDS))


def test_unencodable_arguments_fail_as_they_do_with_redis_py():
    with pytest.raises(UnicodeEncodeError):
        PackedConnection().pack_command("SET", "k", "\ud800")  # a lone surrogate is not UTF-8
    with pytest.raises(DataError):
        PackedConnection().pack_command("SET", "k", True)  # redis-py refuses a bool
    with pytest.raises(DataError):
        PackedConnection().pack_command("SET", "k", None)


def test_another_encoding_is_left_to_redis_py():
    latin = PackedConnection(encoding="latin-1")
    assert b"".join(latin.pack_command("SET", "k", "é")) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n\xe9\r\n"


async def test_a_pool_of_packed_connections_talks_to_real_redis(redis_url):
    pool = aioredis.BlockingConnectionPool.from_url(redis_url, decode_responses=True, **resilience_options(),
                                                    **handshake_options(), **packing_options())
    r = aioredis.Redis(connection_pool=pool)
    key = f"test-packing-{uuid.uuid4().hex[:8]}:s"
    try:
        assert pool.connection_class is PackedConnection
        await r.xadd(key, {"t": "delta", "x": "héllo 😀"}, id="1-1", maxlen=100, approximate=True)
        await r.expire(key, 60)
        assert await r.xrange(key) == [("1-1", {"t": "delta", "x": "héllo 😀"})]
        assert await r.eval("return ARGV[1] .. KEYS[1]", 1, "k", "v") == "vk"
    finally:
        await r.delete(key)
        await r.aclose()
        await pool.disconnect()


def test_a_long_value_goes_out_as_one_buffer_from_the_c_packer():
    cmd = ("SET", "long", "x" * 20_000)
    assert len(PackedConnection().pack_command(*cmd)) == 1 < len(Connection().pack_command(*cmd))


async def _connection(redis_url: str, cls: type[Connection], timeout_s: float) -> Any:
    pool = aioredis.ConnectionPool.from_url(redis_url, decode_responses=True, socket_timeout=timeout_s,
                                            connection_class=cls, **handshake_options())
    return await pool.get_connection()


async def _answers_one_by_one(conn: Connection, count: int) -> list:
    out: list = []
    for _ in range(count):
        try:
            out.append(await conn.read_response())
        except ResponseError as e:
            out.append(e)
    return out


async def test_a_round_trips_answers_read_in_one_go_equal_those_read_one_by_one(redis_url):
    key = f"test-packing-{uuid.uuid4().hex[:8]}"
    cmds = [("XADD", f"{key}:s", "MAXLEN", "~", 100, "1-1", "t", "delta", "x", "héllo 😀"),
            ("EXPIRE", f"{key}:s", 60),
            ("XADD", f"{key}:s", "MAXLEN", "~", 100, "1-1", "t", "delta", "x", "again"),  # an error answer
            ("XRANGE", f"{key}:s", "-", "+"),
            ("SET", f"{key}:v", "x" * 70_000),  # longer than one socket read
            ("GET", f"{key}:v")]
    results = []
    for cls in (Connection, PackedConnection):
        conn = await _connection(redis_url, cls, 10)
        try:
            await conn.send_packed_command(conn.pack_commands(cmds))
            if cls is PackedConnection:
                assert type(conn._parser).__name__ == "_AsyncHiredisParser"  # the path taken in one go

                async def refused(*_a: Any, **_k: Any) -> None:
                    raise AssertionError("read one answer at a time")
                conn.read_response = refused
                results.append(await conn.read_responses(len(cmds)))
                del conn.read_response
            else:
                results.append(await _answers_one_by_one(conn, len(cmds)))
            await conn.send_packed_command(conn.pack_command("DEL", f"{key}:s", f"{key}:v"))
            assert await conn.read_response() == 2
        finally:
            await conn.disconnect()
    one_by_one, in_one_go = results
    assert [type(a) for a in in_one_go] == [type(a) for a in one_by_one]
    assert isinstance(in_one_go[2], ResponseError) and str(in_one_go[2]) == str(one_by_one[2])
    assert in_one_go[2].__traceback__ is None
    assert [a for a in in_one_go if not isinstance(a, ResponseError)] == \
        [a for a in one_by_one if not isinstance(a, ResponseError)]


async def test_answers_that_do_not_come_time_out_and_close_the_connection(redis_url):
    conn = await _connection(redis_url, PackedConnection, 0.2)
    try:
        never = f"test-packing-{uuid.uuid4().hex}"
        await conn.send_packed_command(conn.pack_commands([("PING",), ("BLPOP", never, 5)]))
        with pytest.raises(RedisTimeoutError):
            await conn.read_responses(2)
        assert not conn.is_connected  # never reused out of step
    finally:
        await conn.disconnect()


async def test_a_write_on_a_closed_connection_reconnects_as_redis_py_does(redis_url):
    conn = await _connection(redis_url, PackedConnection, 10)
    try:
        await conn.disconnect()
        await conn.send_packed_command(conn.pack_command("PING"))
        assert await conn.read_responses(1) == ["PONG"]
    finally:
        await conn.disconnect()
