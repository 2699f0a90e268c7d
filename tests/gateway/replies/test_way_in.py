"""The way in: a turn on an existing chat reaches its engine after two Redis round trips
(the user's message count with the chat's read, then the begin that also opens the reply
stream and reads the chat for the prompt), and so does a turn that creates its chat (the
count with the user's defaults, then the begin that also creates the chat). Counted on the
real Redis connection: every packed command the gateway sends that names the chat (or, for
a new chat, its user), until the engine hears of the turn."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from gateway.store.connection import PackedConnection
from tests.gateway_helpers import chat, uid_of


def _bytes(command: Any) -> bytes:
    if isinstance(command, (bytes, bytearray, memoryview)):
        return bytes(command)
    if isinstance(command, str):
        return command.encode()
    return b"".join(bytes(c) if not isinstance(c, str) else c.encode() for c in command)


def _generates(engine_gate: Any) -> int:
    """``generate`` frames the engine has been sent so far."""
    return sum(1 for f in list(engine_gate.to_engine) if f.get("type") == "generate")


@contextmanager
def _round_trips(monkeypatch: pytest.MonkeyPatch, engine_gate: Any, marker: bytes) -> Iterator[list[bytes]]:
    """The packed commands naming ``marker`` (a chat or user id) that the gateway sends
    inside the block until the engine gets its next ``generate``."""
    before = _generates(engine_gate)
    trips: list[bytes] = []
    send = PackedConnection.send_packed_command  # the gateway's pools' connections

    async def counted(self: PackedConnection, command: Any, check_health: bool = True) -> None:
        data = _bytes(command)
        if marker in data and _generates(engine_gate) == before:
            trips.append(data)
        await send(self, command, check_health)

    monkeypatch.setattr(PackedConnection, "send_packed_command", counted)
    try:
        yield trips
    finally:
        monkeypatch.undo()


async def test_a_turn_on_an_existing_chat_reaches_the_engine_after_two_redis_round_trips(
        gateway_factory, engine_gate, monkeypatch):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        first = await chat(ws, "Hello.", max_tokens=4)
        assert first.error is None, first.error
        before = _generates(engine_gate)
        with _round_trips(monkeypatch, engine_gate, first.start["session_id"].encode()) as trips:
            second = await chat(ws, "More please.", session_id=first.start["session_id"], max_tokens=4)
    assert second.error is None, second.error
    assert _generates(engine_gate) == before + 1
    assert 1 <= len(trips) <= 2, [t[:120] for t in trips]


async def test_a_turn_that_creates_its_chat_reaches_the_engine_after_two_redis_round_trips(
        gateway_factory, engine_gate, monkeypatch):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        with _round_trips(monkeypatch, engine_gate, uid_of(gw, cookie).encode()) as trips:
            first = await chat(ws, "Hello.", max_tokens=4)
    assert first.error is None, first.error
    assert _generates(engine_gate) == 1
    assert 1 <= len(trips) <= 2, [t[:120] for t in trips]


async def test_an_api_turn_with_a_new_chat_reaches_the_engine_after_two_redis_round_trips(
        gateway_factory, engine_gate, monkeypatch):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.http(cookie) as c:
        with _round_trips(monkeypatch, engine_gate, uid_of(gw, cookie).encode()) as trips:
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}],
                "max_tokens": 4, "session_id": "new"})
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        body = (await c.get(f"/api/sessions/{sid}")).json()
    assert _generates(engine_gate) == 1
    assert 1 <= len(trips) <= 2, [t[:120] for t in trips]
    # the chat has the request's system message and its turn, as when it was made first
    assert body["system_prompt"] == "Be brief."
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"]
