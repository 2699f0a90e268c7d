"""The Redis session store against the real Redis: ownership, atomic turns, token
segments, TTLs on every write (TTLs are kept (docs/acceptance.md#ttls-are-kept)) and concurrent writers (no lost
writes)."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from gateway.errors import GatewayError
from gateway.store.sessions import plan_prefix, title_from
from tests.gateway.store.store_helpers import ALICE, BOB, finish_ok, make_store


async def test_chats_are_listed_newest_first_and_renamed_and_deleted(rds, key_prefix):
    store = make_store(rds, key_prefix)
    a = await store.create_session(ALICE, title="first")
    b = await store.create_session(ALICE, title="second")
    assert [s.id for s in await store.list_sessions(ALICE)] == [b.id, a.id]
    await store.update_session(ALICE, a.id, title="renamed", params={"temperature": 0.1})
    listed = await store.list_sessions(ALICE)
    assert [s.id for s in listed] == [a.id, b.id]  # the rename bumped it
    info = await store.get_session(ALICE, a.id)
    assert (info.title, info.params) == ("renamed", {"temperature": 0.1})
    assert await store.delete_session(ALICE, a.id) is None
    assert [s.id for s in await store.list_sessions(ALICE)] == [b.id]
    assert not await rds.keys(f"{key_prefix}chat:session:{a.id}*")


async def test_another_users_chat_is_not_found_for_every_operation(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE, title="mine")
    calls = [
        store.get_session(BOB, chat.id),
        store.messages(BOB, chat.id),
        store.update_session(BOB, chat.id, title="stolen"),
        store.delete_session(BOB, chat.id),
        store.begin_turn(BOB, chat.id, mode="chat", content="hi"),
        store.begin_turn(BOB, chat.id, mode="regenerate"),
    ]
    for call in calls:
        with pytest.raises(GatewayError) as e:
            await call
        assert e.value.code == "not_found"
    assert await store.list_sessions(BOB) == []
    info = await store.get_session(ALICE, chat.id)
    assert info.title == "mine" and await store.messages(ALICE, chat.id) == []


async def test_a_turn_stores_user_message_then_reply_with_token_segments(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE, system_prompt="Be brief.")
    turn = await store.begin_turn(ALICE, chat.id, mode="chat", content="  Hello\n there  ")
    info = await store.get_session(ALICE, chat.id)
    assert info.title == "Hello there" and turn.title == "Hello there"
    assert info.active == {"request_id": turn.request_id, "message_id": turn.message_id,
                           "user_message_id": turn.user_message_id}
    assert await finish_ok(store, ALICE, chat.id, turn, "Hi!", [1, 2, 3], [7, 8, 2]) == "ok"
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert [(m["role"], m["content"], m["token_ids"]) for m in msgs] == [
        ("user", "  Hello\n there  ", [1, 2, 3]), ("assistant", "Hi!", [7, 8, 2])]
    assert msgs[1]["id"] == turn.message_id and msgs[0]["id"] == turn.user_message_id
    assert (await store.get_session(ALICE, chat.id)).active is None
    assert not await rds.exists(f"{key_prefix}chat:session:{chat.id}:lock")
    hist = await store.history(ALICE, chat.id, "Be brief.")
    assert hist.messages[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in hist.messages] == ["system", "user", "assistant"]


async def test_second_turn_on_a_busy_chat_is_refused_and_writes_nothing(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    first = await store.begin_turn(ALICE, chat.id, mode="chat", content="one")
    with pytest.raises(GatewayError) as e:
        await store.begin_turn(ALICE, chat.id, mode="chat", content="two")
    assert e.value.code == "busy"
    assert [m["content"] for m in await store.messages(ALICE, chat.id)] == ["one"]
    await finish_ok(store, ALICE, chat.id, first, "reply", [1], [2])
    await store.begin_turn(ALICE, chat.id, mode="chat", content="two")  # free again
    assert [m["content"] for m in await store.messages(ALICE, chat.id)] == ["one", "reply", "two"]


async def test_resent_client_msg_id_reattaches_instead_of_adding_a_message(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    first = await store.begin_turn(ALICE, chat.id, mode="chat", content="q", client_msg_id="m-1")
    again = await store.begin_turn(ALICE, chat.id, mode="chat", content="q", client_msg_id="m-1")
    assert again.duplicate and again.request_id == first.request_id and again.message_id == first.message_id
    await finish_ok(store, ALICE, chat.id, first, "a", [1], [2])
    late = await store.begin_turn(ALICE, chat.id, mode="chat", content="q", client_msg_id="m-1")
    assert late.duplicate and late.request_id == first.request_id
    assert [m["content"] for m in await store.messages(ALICE, chat.id)] == ["q", "a"]


async def test_failed_turn_is_undone_and_a_failed_regenerate_restores_the_old_reply(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1 = await store.begin_turn(ALICE, chat.id, mode="chat", content="q1", client_msg_id="c1")
    await finish_ok(store, ALICE, chat.id, t1, "a1", [1, 2], [3])
    t2 = await store.begin_turn(ALICE, chat.id, mode="chat", content="too long", client_msg_id="c2")
    await store.fail_turn(ALICE, chat.id, t2, "c2")
    assert [m["content"] for m in await store.messages(ALICE, chat.id)] == ["q1", "a1"]
    retry = await store.begin_turn(ALICE, chat.id, mode="chat", content="too long", client_msg_id="c2")
    assert not retry.duplicate  # the failed turn's id may be used again
    await store.fail_turn(ALICE, chat.id, retry, "c2")

    regen = await store.begin_turn(ALICE, chat.id, mode="regenerate")
    assert regen.user_message_id == t1.user_message_id
    assert [m["content"] for m in await store.messages(ALICE, chat.id)] == ["q1"]
    await store.fail_turn(ALICE, chat.id, regen, None)
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert [(m["content"], m["token_ids"]) for m in msgs] == [("q1", [1, 2]), ("a1", [3])]
    assert (await store.get_session(ALICE, chat.id)).active is None


async def test_regenerate_replaces_the_last_reply_and_refuses_an_empty_chat(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    with pytest.raises(GatewayError) as e:
        await store.begin_turn(ALICE, chat.id, mode="regenerate")
    assert e.value.code == "invalid_request"
    t1 = await store.begin_turn(ALICE, chat.id, mode="chat", content="q")
    await finish_ok(store, ALICE, chat.id, t1, "old", [1, 2], [3])
    regen = await store.begin_turn(ALICE, chat.id, mode="regenerate")
    hist = await store.history(ALICE, chat.id, "")
    assert hist.prefix_token_ids == [1, 2] and hist.split == 0  # the user turn's ids are reused
    await finish_ok(store, ALICE, chat.id, regen, "new", [1, 2], [4, 5])
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert [(m["content"], m["token_ids"]) for m in msgs] == [("q", [1, 2]), ("new", [4, 5])]


def test_prefix_plan_follows_segments_from_the_last_base_and_stops_at_a_gap():
    def m(i: str, role: str) -> dict:
        return {"id": i, "role": role}

    stored = [m("u1", "user"), m("a1", "assistant"), m("u2", "user"), m("a2", "assistant"), m("u3", "user")]
    segs = {"u1": {"ids": [1, 2]}, "a1": {"ids": [3]}, "u2": {"ids": [4]}, "a2": {"ids": [5, 6]}}
    assert plan_prefix(stored, segs) == ([1, 2, 3, 4, 5, 6], 6)
    # a full re-render at u2 supersedes what came before it
    segs_base = dict(segs, u2={"ids": [9, 9, 9, 4], "base": True})
    assert plan_prefix(stored, segs_base) == ([9, 9, 9, 4, 5, 6], 6)
    # a reply without ids (it broke mid-stream) ends the prefix; the turn must store a base
    gap = {k: v for k, v in segs.items() if k != "a1"}
    assert plan_prefix(stored, gap) == ([1, 2], None)
    # regenerating u3's reply: u3 already has ids, which are part of the prefix
    with_u3 = dict(segs, u3={"ids": [7]})
    assert plan_prefix(stored, with_u3) == ([1, 2, 3, 4, 5, 6, 7], 6)
    assert plan_prefix(stored[:1], {}) == ([], 0)


def test_title_is_the_first_message_collapsed_and_cut():
    assert title_from("a\n\n b\tc") == "a b c"
    long = title_from("word " * 40, 20)
    assert len(long) <= 20 and long.endswith("…")


async def ttls(rds: aioredis.Redis, prefix: str) -> dict[str, int]:
    keys = [k async for k in rds.scan_iter(match=prefix + "*")]
    return {k: await rds.pttl(k) for k in keys}


async def test_every_key_keeps_a_ttl_after_every_write_when_one_is_configured(rds, key_prefix):
    """TTLs are kept (docs/acceptance.md#ttls-are-kept): no write drops a key's TTL; each write slides it forward."""
    store = make_store(rds, key_prefix, ttl=1800)

    async def check(step: str) -> None:
        found = await ttls(rds, key_prefix)
        assert found, step
        bad = {k: v for k, v in found.items() if v <= 0}
        assert not bad, f"after {step}: keys without TTL {bad}"

    chat = await store.create_session(ALICE, title="t")
    await check("create")
    for i in range(5):
        turn = await store.begin_turn(ALICE, chat.id, mode="chat", content=f"m{i}", client_msg_id=f"c{i}")
        await check(f"begin {i}")
        await rds.expire(f"{key_prefix}chat:session:{chat.id}:messages", 5)  # an old TTL...
        await finish_ok(store, ALICE, chat.id, turn, f"r{i}", [i], [i + 100])
        await check(f"finish {i}")
        assert await rds.ttl(f"{key_prefix}chat:session:{chat.id}:messages") > 5  # ...slides forward
        await store.update_session(ALICE, chat.id, title=f"title {i}")
        await check(f"rename {i}")
    await store.count_message(ALICE, 100)
    regen = await store.begin_turn(ALICE, chat.id, mode="regenerate")
    await check("regenerate")
    await store.fail_turn(ALICE, chat.id, regen, None)
    await check("failed regenerate")
    names = set(await ttls(rds, key_prefix))
    base = f"{key_prefix}chat:session:{chat.id}"
    assert {base, base + ":messages", base + ":tokens", base + ":cmids"} <= names


async def test_without_a_ttl_chat_keys_persist(rds, key_prefix):
    store = make_store(rds, key_prefix, ttl=None)
    chat = await store.create_session(ALICE)
    turn = await store.begin_turn(ALICE, chat.id, mode="chat", content="x")
    await finish_ok(store, ALICE, chat.id, turn, "y", [1], [2])
    base = f"{key_prefix}chat:session:{chat.id}"
    for key in (base, base + ":messages", base + ":tokens"):
        assert await rds.ttl(key) == -1


async def test_concurrent_turns_on_one_chat_admit_exactly_one(rds, key_prefix):
    """No lost writes (docs/acceptance.md#no-lost-writes): racing writers never both append; the loser is told
    'busy'."""
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    results = await asyncio.gather(*[store.begin_turn(ALICE, chat.id, mode="chat", content=f"m{i}")
                                     for i in range(20)], return_exceptions=True)
    ok = [r for r in results if not isinstance(r, Exception)]
    assert len(ok) == 1
    assert all(isinstance(r, GatewayError) and r.code == "busy" for r in results if r not in ok)
    winner = json.loads(ok[0].user_json)["content"]
    assert [m["content"] for m in await store.messages(ALICE, chat.id)] == [winner]


async def test_rename_racing_the_reply_store_loses_neither(rds, key_prefix):
    """No lost writes (docs/acceptance.md#no-lost-writes): metadata updates and reply persistence touch disjoint
    fields atomically."""
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    for i in range(20):
        turn = await store.begin_turn(ALICE, chat.id, mode="chat", content=f"q{i}")
        await asyncio.gather(store.update_session(ALICE, chat.id, title=f"name {i}"),
                             finish_ok(store, ALICE, chat.id, turn, f"a{i}", [i], [i]))
        info = await store.get_session(ALICE, chat.id)
        assert info.title == f"name {i}" and info.active is None
    contents = [m["content"] for m in await store.messages(ALICE, chat.id)]
    assert contents == [x for i in range(20) for x in (f"q{i}", f"a{i}")]


async def test_a_reply_whose_lock_expired_is_not_stored_out_of_order(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    stale = await store.begin_turn(ALICE, chat.id, mode="chat", content="first")
    await rds.delete(f"{key_prefix}chat:session:{chat.id}:lock")  # its lease ran out
    assert not await store.renew_lease(ALICE, chat.id, stale.request_id)
    fresh = await store.begin_turn(ALICE, chat.id, mode="chat", content="second")
    assert await finish_ok(store, ALICE, chat.id, stale, "late", [1], [2]) == "conflict"
    lock = await rds.get(f"{key_prefix}chat:session:{chat.id}:lock")
    assert lock == fresh.request_id  # only its owner releases a lock
    assert await store.renew_lease(ALICE, chat.id, fresh.request_id)
    assert [m["content"] for m in await store.messages(ALICE, chat.id)] == ["first", "second"]


async def test_limits_on_chats_generations_and_message_rate(rds, key_prefix):
    store = make_store(rds, key_prefix, max_sessions_per_user=2, max_generations_per_user=1)
    a = await store.create_session(ALICE)
    b = await store.create_session(ALICE)
    with pytest.raises(GatewayError) as e:
        await store.create_session(ALICE)
    assert e.value.code == "too_many_sessions"
    await store.create_session(BOB)  # per user
    turn = await store.begin_turn(ALICE, a.id, mode="chat", content="x")
    with pytest.raises(GatewayError) as e:
        await store.begin_turn(ALICE, b.id, mode="chat", content="y")
    assert e.value.code == "too_many_generations"
    await finish_ok(store, ALICE, a.id, turn, "r", [1], [2])
    await store.begin_turn(ALICE, b.id, mode="chat", content="y")
    for _ in range(3):
        await store.count_message(ALICE, 3)
    with pytest.raises(GatewayError) as e:
        await store.count_message(ALICE, 3)
    assert e.value.code == "rate_limited"
    await store.count_message(BOB, 3)


async def test_redis_down_is_store_unavailable():
    client = aioredis.from_url("redis://127.0.0.1:1/0", decode_responses=True, socket_connect_timeout=0.5)
    store = make_store(client, "x:")
    with pytest.raises(GatewayError) as e:
        await store.list_sessions(ALICE)
    assert e.value.code == "store_unavailable"
    await client.aclose()
