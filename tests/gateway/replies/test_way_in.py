"""The way in: a turn on an existing chat reaches its engine after two Redis round trips
(the user's message count with the chat's read, then the begin that also opens the reply
stream and reads the chat for the prompt), and so does a turn that creates its chat (the
count with the user's defaults, then the begin that also creates the chat). Counted on the
real Redis connection: every packed command the gateway sends that names the chat (or, for
a new chat, its user), until the engine hears of the turn."""

from __future__ import annotations

from typing import Any

from gateway.store.connection import PackedConnection
from tests.gateway_helpers import chat, uid_of


def _bytes(command: Any) -> bytes:
    if isinstance(command, (bytes, bytearray, memoryview)):
        return bytes(command)
    if isinstance(command, str):
        return command.encode()
    return b"".join(bytes(c) if not isinstance(c, str) else c.encode() for c in command)


async def test_a_turn_on_an_existing_chat_reaches_the_engine_after_two_redis_round_trips(
        gateway_factory, engine_gate, monkeypatch):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        first = await chat(ws, "Hello.", max_tokens=4)
        assert first.error is None, first.error
        sid = first.start["session_id"].encode()

        def generates() -> int:
            return sum(1 for f in list(engine_gate.to_engine) if f.get("type") == "generate")

        before = generates()
        trips: list[bytes] = []
        send = PackedConnection.send_packed_command  # the gateway's pools' connections

        async def counted(self: PackedConnection, command: Any, check_health: bool = True) -> None:
            data = _bytes(command)
            if sid in data and generates() == before:  # this chat's round trips until the engine hears
                trips.append(data)
            await send(self, command, check_health)

        monkeypatch.setattr(PackedConnection, "send_packed_command", counted)
        second = await chat(ws, "More please.", session_id=first.start["session_id"], max_tokens=4)
        monkeypatch.undo()
    assert second.error is None, second.error
    assert generates() == before + 1
    assert 1 <= len(trips) <= 2, [t[:120] for t in trips]


async def test_a_turn_that_creates_its_chat_reaches_the_engine_after_two_redis_round_trips(
        gateway_factory, engine_gate, monkeypatch):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    uid = uid_of(gw, cookie).encode()
    async with gw.connect(cookie) as ws:
        def generates() -> int:
            return sum(1 for f in list(engine_gate.to_engine) if f.get("type") == "generate")

        trips: list[bytes] = []
        send = PackedConnection.send_packed_command  # the gateway's pools' connections

        async def counted(self: PackedConnection, command: Any, check_health: bool = True) -> None:
            data = _bytes(command)
            if uid in data and generates() == 0:  # this user's round trips until the engine hears
                trips.append(data)
            await send(self, command, check_health)

        monkeypatch.setattr(PackedConnection, "send_packed_command", counted)
        first = await chat(ws, "Hello.", max_tokens=4)
        monkeypatch.undo()
    assert first.error is None, first.error
    assert generates() == 1
    assert 1 <= len(trips) <= 2, [t[:120] for t in trips]


async def test_an_api_turn_with_a_new_chat_reaches_the_engine_after_two_redis_round_trips(
        gateway_factory, engine_gate, monkeypatch):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    uid = uid_of(gw, cookie).encode()

    def generates() -> int:
        return sum(1 for f in list(engine_gate.to_engine) if f.get("type") == "generate")

    trips: list[bytes] = []
    send = PackedConnection.send_packed_command  # the gateway's pools' connections

    async def counted(self: PackedConnection, command: Any, check_health: bool = True) -> None:
        data = _bytes(command)
        if uid in data and generates() == 0:  # this user's round trips until the engine hears
            trips.append(data)
        await send(self, command, check_health)

    async with gw.http(cookie) as c:
        monkeypatch.setattr(PackedConnection, "send_packed_command", counted)
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello."}],
            "max_tokens": 4, "session_id": "new"})
        monkeypatch.undo()
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        body = (await c.get(f"/api/sessions/{sid}")).json()
    assert generates() == 1
    assert 1 <= len(trips) <= 2, [t[:120] for t in trips]
    # the chat has the request's system message and its turn, as when it was made first
    assert body["system_prompt"] == "Be brief."
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"]
