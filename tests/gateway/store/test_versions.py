"""Editing a user message keeps the old branch as a version (store level, real Redis):
the chat is cut after the edited message, switching brings a branch back with its token
ids, a refused edit puts everything back, and a continued reply keeps its id."""

from __future__ import annotations

import json

import pytest

from gateway.errors import GatewayError
from gateway.store.sessions import full_prefix
from tests.gateway.store.store_helpers import ALICE, finish_ok, make_store


async def two_turns(store, sid):
    t1 = await store.begin_turn(ALICE, sid, mode="chat", content="q1")
    assert await finish_ok(store, ALICE, sid, t1, "a1", [1, 2], [3], base=True) == "ok"
    t2 = await store.begin_turn(ALICE, sid, mode="chat", content="q2")
    assert await finish_ok(store, ALICE, sid, t2, "a2", [4], [5]) == "ok"
    return t1, t2


def contents(msgs):
    return [m["content"] for m in msgs]


async def test_an_edit_cuts_the_chat_after_the_message_and_keeps_the_old_branch(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    e = await store.begin_turn(ALICE, chat.id, mode="edit", content="q2 edited", replaces=t2.user_message_id)
    assert await finish_ok(store, ALICE, chat.id, e, "a2 new", [6], [7]) == "ok"
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert contents(msgs) == ["q1", "a1", "q2 edited", "a2 new"]
    assert msgs[2]["versions"] == {"index": 1, "count": 2}
    assert "versions" not in msgs[0]
    # the prefix of the next turn is the new branch's exact ids
    assert [m["token_ids"] for m in msgs] == [[1, 2], [3], [6], [7]]

    await store.switch_version(ALICE, chat.id, e.user_message_id, 0)
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert contents(msgs) == ["q1", "a1", "q2", "a2"]
    assert msgs[2]["versions"] == {"index": 0, "count": 2}
    assert [m["token_ids"] for m in msgs] == [[1, 2], [3], [4], [5]]  # token ids came back too

    await store.switch_version(ALICE, chat.id, t2.user_message_id, 1)
    assert contents(await store.messages(ALICE, chat.id)) == ["q1", "a1", "q2 edited", "a2 new"]


async def test_editing_the_first_message_and_nested_branches_lose_nothing(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    # a branch inside the first branch: edit q2, then edit q1
    e2 = await store.begin_turn(ALICE, chat.id, mode="edit", content="q2b", replaces=t2.user_message_id)
    await finish_ok(store, ALICE, chat.id, e2, "a2b", [8], [9])
    e1 = await store.begin_turn(ALICE, chat.id, mode="edit", content="q1b", replaces=t1.user_message_id)
    await finish_ok(store, ALICE, chat.id, e1, "a1b", [10], [11], base=True)
    msgs = await store.messages(ALICE, chat.id)
    assert contents(msgs) == ["q1b", "a1b"]
    assert msgs[0]["versions"] == {"index": 1, "count": 2}
    await store.switch_version(ALICE, chat.id, e1.user_message_id, 0)
    msgs = await store.messages(ALICE, chat.id)
    assert contents(msgs) == ["q1", "a1", "q2b", "a2b"]  # the inner branch shown as it was left
    assert msgs[2]["versions"] == {"index": 1, "count": 2}
    await store.switch_version(ALICE, chat.id, e2.user_message_id, 0)
    assert contents(await store.messages(ALICE, chat.id)) == ["q1", "a1", "q2", "a2"]


async def test_a_refused_edit_puts_the_old_branch_back(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    e = await store.begin_turn(ALICE, chat.id, mode="edit", content="too long", replaces=t1.user_message_id)
    await store.fail_turn(ALICE, chat.id, e, None)
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert contents(msgs) == ["q1", "a1", "q2", "a2"]
    assert [m["token_ids"] for m in msgs] == [[1, 2], [3], [4], [5]]
    assert not any("versions" in m for m in msgs)
    assert (await store.get_session(ALICE, chat.id)).active is None


async def test_edit_and_switch_refuse_what_the_chat_does_not_hold(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    with pytest.raises(GatewayError) as e:
        await store.begin_turn(ALICE, chat.id, mode="edit", content="x", replaces=t2.message_id)  # a reply
    assert e.value.code == "conflict"
    with pytest.raises(GatewayError) as e:
        await store.switch_version(ALICE, chat.id, t2.user_message_id, 1)
    assert e.value.code == "invalid_request"  # no versions there
    running = await store.begin_turn(ALICE, chat.id, mode="chat", content="q3")
    with pytest.raises(GatewayError) as e:
        await store.switch_version(ALICE, chat.id, t2.user_message_id, 0)
    assert e.value.code == "busy"
    await store.fail_turn(ALICE, chat.id, running, None)
    with pytest.raises(GatewayError) as e:
        await store.switch_version("c" * 32, chat.id, t2.user_message_id, 0)
    assert e.value.code == "not_found"


async def test_a_continue_takes_the_last_reply_off_and_keeps_its_id(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    c = await store.begin_turn(ALICE, chat.id, mode="continue", replaces=t2.message_id)
    assert c.message_id == t2.message_id
    assert json.loads(c.popped_json)["content"] == "a2"
    assert json.loads(c.popped_tokens)["ids"] == [5]
    stored, segments = await store._read_messages(chat.id, ALICE, True)
    assert full_prefix(stored, segments) == [1, 2, 3, 4]
    await store.fail_turn(ALICE, chat.id, c, None)  # refused: the reply is back
    assert contents(await store.messages(ALICE, chat.id)) == ["q1", "a1", "q2", "a2"]
    with pytest.raises(GatewayError) as e:
        await store.begin_turn(ALICE, chat.id, mode="continue", replaces=t1.message_id)  # not the last
    assert e.value.code == "conflict"


async def test_deleting_a_chat_deletes_its_versions(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    e = await store.begin_turn(ALICE, chat.id, mode="edit", content="q2b", replaces=t2.user_message_id)
    await finish_ok(store, ALICE, chat.id, e, "x", [1], [2])
    assert await rds.exists(f"{key_prefix}chat:session:{chat.id}:versions")
    await store.delete_session(ALICE, chat.id)
    assert not await rds.keys(f"{key_prefix}chat:session:{chat.id}*")


async def test_a_regenerate_keeps_the_old_reply_as_a_version_that_can_be_shown_again(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    r = await store.begin_turn(ALICE, chat.id, mode="regenerate", replaces=t2.message_id)
    assert r.user_message_id == t2.user_message_id and not r.popped_json
    assert await finish_ok(store, ALICE, chat.id, r, "a2 again", [4], [8]) == "ok"
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert contents(msgs) == ["q1", "a1", "q2", "a2 again"]
    assert msgs[3]["versions"] == {"index": 1, "count": 2}
    assert "versions" not in msgs[2]
    # a third reply: three versions; the first comes back with its token ids
    r3 = await store.begin_turn(ALICE, chat.id, mode="regenerate", replaces=r.message_id)
    await finish_ok(store, ALICE, chat.id, r3, "a2 third", [4], [9])
    assert (await store.messages(ALICE, chat.id))[3]["versions"] == {"index": 2, "count": 3}
    await store.switch_version(ALICE, chat.id, r3.message_id, 0)
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert contents(msgs) == ["q1", "a1", "q2", "a2"]
    assert msgs[3]["versions"] == {"index": 0, "count": 3}
    assert msgs[3]["token_ids"] == [5]
    # an edit above keeps the replies' versions with the branch it cuts
    e = await store.begin_turn(ALICE, chat.id, mode="edit", content="q2b", replaces=t2.user_message_id)
    await finish_ok(store, ALICE, chat.id, e, "a2b", [6], [7])
    await store.switch_version(ALICE, chat.id, e.user_message_id, 0)
    msgs = await store.messages(ALICE, chat.id)
    assert contents(msgs) == ["q1", "a1", "q2", "a2"] and msgs[3]["versions"] == {"index": 0, "count": 3}


async def test_a_refused_regenerate_puts_the_old_reply_back_without_a_version(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    r = await store.begin_turn(ALICE, chat.id, mode="regenerate", replaces=t2.message_id)
    assert contents(await store.messages(ALICE, chat.id)) == ["q1", "a1", "q2"]
    await store.fail_turn(ALICE, chat.id, r, None)
    msgs = await store.messages(ALICE, chat.id, with_tokens=True)
    assert contents(msgs) == ["q1", "a1", "q2", "a2"]
    assert [m["token_ids"] for m in msgs] == [[1, 2], [3], [4], [5]]
    assert not any("versions" in m for m in msgs)


async def test_editing_the_first_message_retitles_a_chat_whose_title_came_from_it(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    assert (await store.get_session(ALICE, chat.id)).title == "q1"
    e = await store.begin_turn(ALICE, chat.id, mode="edit", content="What is a rainbow?", replaces=t1.user_message_id)
    assert e.title == "What is a rainbow?"
    await finish_ok(store, ALICE, chat.id, e, "light", [6], [7], base=True)
    assert (await store.get_session(ALICE, chat.id)).title == "What is a rainbow?"
    # showing the old version brings its title back; a refused edit keeps the old title
    await store.switch_version(ALICE, chat.id, e.user_message_id, 0)
    assert (await store.get_session(ALICE, chat.id)).title == "q1"
    bad = await store.begin_turn(ALICE, chat.id, mode="edit", content="refused", replaces=t1.user_message_id)
    await store.fail_turn(ALICE, chat.id, bad, None)
    assert (await store.get_session(ALICE, chat.id)).title == "q1"
    # a title the user gave stays, whatever the first message becomes
    await store.update_session(ALICE, chat.id, title="Mine")
    e2 = await store.begin_turn(ALICE, chat.id, mode="edit", content="Other", replaces=t1.user_message_id)
    await finish_ok(store, ALICE, chat.id, e2, "x", [8], [9], base=True)
    assert (await store.get_session(ALICE, chat.id)).title == "Mine" and not e2.title
    await store.switch_version(ALICE, chat.id, e2.user_message_id, 0)
    assert (await store.get_session(ALICE, chat.id)).title == "Mine"


async def test_an_id_the_chat_never_held_is_not_found_while_a_stale_one_is_a_conflict(rds, key_prefix):
    store = make_store(rds, key_prefix)
    chat = await store.create_session(ALICE)
    t1, t2 = await two_turns(store, chat.id)
    for mode in ("edit", "continue", "regenerate"):
        with pytest.raises(GatewayError) as e:
            await store.begin_turn(ALICE, chat.id, mode=mode, content="x", replaces="nope")
        assert (e.value.code, e.value.message) == ("not_found", "no message nope in this chat")
    with pytest.raises(GatewayError) as e:
        await store.switch_version(ALICE, chat.id, "nope", 1)
    assert (e.value.code, e.value.message) == ("not_found", "no message nope in this chat")
    # a reply kept only as a version (another tab regenerated it) is stale, not unknown
    r = await store.begin_turn(ALICE, chat.id, mode="regenerate", replaces=t2.message_id)
    assert await finish_ok(store, ALICE, chat.id, r, "a2b", [4], [6]) == "ok"
    for mode in ("continue", "regenerate"):
        with pytest.raises(GatewayError) as e:
            await store.begin_turn(ALICE, chat.id, mode=mode, replaces=t2.message_id)
        assert e.value.code == "conflict"
    with pytest.raises(GatewayError) as e:
        await store.switch_version(ALICE, chat.id, t2.message_id, 0)
    assert e.value.code == "conflict"
    assert contents(await store.messages(ALICE, chat.id)) == ["q1", "a1", "q2", "a2b"]  # untouched
