"""A turn that creates its chat (``begin_turn`` with ``create``): the chat it stores, the
events it publishes and the TTLs it sets are those of ``create_session`` followed by
``begin_turn``, in one atomic step; a refused turn stores and publishes nothing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.errors import GatewayError
from gateway.store.sessions import SessionInfo, SessionStore, TurnBegun, new_id
from tests.gateway.store.store_helpers import ALICE, finish_ok, make_store

SYSTEM, PARAMS, MODEL = "Be brief.", {"temperature": 0.5, "max_tokens": 64}, "some-model"


def unsaved_chat(owner: str = ALICE) -> SessionInfo:
    return SessionInfo(new_id(), owner, "", SYSTEM, dict(PARAMS), 0.0, 0.0, model=MODEL)


async def stored(rds: aioredis.Redis, store: SessionStore, sid: str, begun: TurnBegun) -> dict[str, Any]:
    """Every key of the chat and of its reply stream, with the ids and times that differ
    from chat to chat replaced by their role."""
    k = store.keys
    names = {sid: "sid", begun.request_id: "rid", begun.message_id: "aid", begun.user_message_id: "uid"}

    def same(text: str) -> str:
        for value, role in names.items():
            text = text.replace(value, role)
        return text

    chat = await rds.hgetall(k.session(sid))
    chat["created_at"] = chat["updated_at"] = "now"
    messages = [json.loads(m) for m in await rds.lrange(k.session_messages(sid), 0, -1)]
    for m in messages:
        m["created_at"] = "now"
    keys = sorted([same(key) async for key in rds.scan_iter(match=f"{k.session(sid)}*")])
    ttls = {same(key): await rds.ttl(key) > 0 for key in [k.session(sid), k.session_messages(sid),
                                                       k.session_cmids(sid), k.gen(begun.request_id)]}
    stream = [(i, f) for i, f in await rds.xrange(k.gen(begun.request_id))]
    assert begun.chat is not None
    prompt = ([{**m, "created_at": "now"} for m in begun.chat[0]], begun.chat[1])
    score = await rds.zscore(k.user_sessions(ALICE), sid)
    return {"keys": keys, "chat": json.loads(same(json.dumps(chat))),
            "messages": json.loads(same(json.dumps(messages))),
            "cmids": json.loads(same(json.dumps(await rds.hgetall(k.session_cmids(sid))))),
            "lock": same(await rds.get(k.session_lock(sid)) or ""),
            "indexed_at_update": score is not None and score == pytest.approx(float(await rds.hget(
                k.session(sid), "updated_at"))),
            "ttls": ttls, "stream": json.loads(same(json.dumps(stream))),
            "prompt": json.loads(same(json.dumps(prompt)))}


async def events_during(rds: aioredis.Redis, store: SessionStore, step: Any) -> tuple[Any, list[dict[str, str]]]:
    """``step()``'s result and the events published on ALICE's channel meanwhile."""
    pubsub = rds.pubsub()
    await pubsub.subscribe(store.keys.user_sessions(ALICE) + ":events")
    await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    try:
        result = await step()
    except GatewayError as e:
        result = e
    out = []
    while (msg := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)) is not None:
        out.append(json.loads(msg["data"]))
    await pubsub.aclose()
    return result, out


async def test_a_turn_creating_its_chat_stores_and_publishes_what_create_then_begin_did(rds, key_prefix):
    store = make_store(rds, key_prefix, ttl=1800)
    turn = dict(mode="chat", content="Hello  there", client_msg_id="c1", stream_ttl_s=600)

    async def before() -> tuple[str, TurnBegun]:
        info = await store.create_session(ALICE, system_prompt=SYSTEM, params=PARAMS, model=MODEL)
        return info.id, await store.begin_turn(ALICE, info.id, **turn)

    async def after() -> tuple[str, TurnBegun]:
        info = unsaved_chat()
        return info.id, await store.begin_turn(ALICE, info.id, create=info, **turn)

    (old_sid, old), old_events = await events_during(rds, store, before)
    (new_sid, new), new_events = await events_during(rds, store, after)
    assert await stored(rds, store, new_sid, new) == await stored(rds, store, old_sid, old)
    assert [e["kind"] for e in new_events] == [e["kind"] for e in old_events] == ["created", "started"]
    assert {e["session_id"] for e in new_events} == {new_sid}
    assert new.title == old.title == "Hello there"
    info = await store.get_session(ALICE, new_sid)
    assert (info.system_prompt, info.params, info.model, info.active) == (
        SYSTEM, PARAMS, MODEL, {"request_id": new.request_id, "message_id": new.message_id,
                                "user_message_id": new.user_message_id})
    assert await finish_ok(store, ALICE, new_sid, new, "Hi.", [1, 2], [3]) == "ok"
    assert [m["content"] for m in await store.messages(ALICE, new_sid)] == ["Hello  there", "Hi."]


async def test_a_refused_turn_creating_its_chat_stores_and_publishes_nothing(rds, key_prefix):
    store = make_store(rds, key_prefix, max_sessions_per_user=2, max_generations_per_user=1)
    busy = await store.create_session(ALICE)
    await store.begin_turn(ALICE, busy.id, mode="chat", content="x")  # the one reply allowed
    keys_before = sorted([k async for k in rds.scan_iter(match=key_prefix + "*")])

    async def refused(store: SessionStore) -> Any:
        info = unsaved_chat()
        return await store.begin_turn(ALICE, info.id, mode="chat", content="y", stream_ttl_s=600, create=info)

    err, events = await events_during(rds, store, lambda: refused(store))
    assert isinstance(err, GatewayError) and err.code == "too_many_generations"
    assert events == []
    full = make_store(rds, key_prefix, max_sessions_per_user=1, max_generations_per_user=4)
    err, events = await events_during(rds, full, lambda: refused(full))
    assert isinstance(err, GatewayError) and err.code == "too_many_sessions"
    assert events == []
    assert sorted([k async for k in rds.scan_iter(match=key_prefix + "*")]) == keys_before


async def test_a_turn_creating_its_chat_at_the_limit_prunes_expired_chats_first(rds, key_prefix):
    store = make_store(rds, key_prefix, ttl=1800, max_sessions_per_user=1)
    gone = await store.create_session(ALICE)
    await rds.delete(store.keys.session(gone.id))  # it expired; its index entry is left
    info = unsaved_chat()
    begun = await store.begin_turn(ALICE, info.id, mode="chat", content="y", create=info)
    assert begun.user_message_id
    assert [c.id for c in await store.list_sessions(ALICE)] == [info.id]
    assert await rds.zrange(store.keys.user_sessions(ALICE), 0, -1) == [info.id]


async def test_two_turns_creating_chats_at_once_admit_only_what_the_limit_allows(rds, key_prefix):
    store = make_store(rds, key_prefix, max_sessions_per_user=3, max_generations_per_user=10)
    chats = [unsaved_chat() for _ in range(6)]
    results = await asyncio.gather(*[store.begin_turn(ALICE, c.id, mode="chat", content="q", create=c)
                                     for c in chats], return_exceptions=True)
    ok = [r for r in results if isinstance(r, TurnBegun)]
    assert len(ok) == 3
    assert all(isinstance(r, GatewayError) and r.code == "too_many_sessions" for r in results if r not in ok)
    assert len(await store.list_sessions(ALICE)) == 3
