"""PackedConnection: commands packed in C are the bytes redis-py's packer would send."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

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
