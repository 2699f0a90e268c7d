"""``edit``, ``continue`` and switching versions end to end: real gateway, Redis and
engine (tiny model)."""

from __future__ import annotations

import pytest

from tests.gateway.test_e2e import BLOCK, stored, token_messages, uid_of
from tests.gateway_helpers import chat, read_reply, send


async def test_an_edit_replies_to_the_new_text_and_the_old_branch_can_be_shown_again(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        r1 = await chat(ws, "Hello there.", max_tokens=8)
        sid = r1.start["session_id"]
        r2 = await chat(ws, "Tell me more.", sid, max_tokens=8)
        first_user = r1.start["user_message_id"]
        await send(ws, {"type": "edit", "session_id": sid, "message_id": first_user, "content": "Hi, who are you?",
                        "params": {"temperature": 0, "max_tokens": 8}})
        e = await read_reply(ws)
        assert e.error is None, e.error
        assert e.start["user_message_id"] not in (first_user, None)
        # an edit reuses the system prompt's cached KV like any turn
        assert e.done["usage"]["cached_tokens"] >= 0
    body = await stored(gw, cookie, sid)
    assert [m["content"] for m in body["messages"]] == ["Hi, who are you?", e.text]
    assert body["messages"][0]["versions"] == {"index": 1, "count": 2}
    async with gw.http(cookie) as c:
        res = await c.post(f"/api/sessions/{sid}/versions",
                           json={"message_id": e.start["user_message_id"], "index": 0})
        assert res.status_code == 200, res.text
        back = res.json()
        assert [m["content"] for m in back["messages"]] == ["Hello there.", r1.text, "Tell me more.", r2.text]
        assert back["messages"][0]["versions"] == {"index": 0, "count": 2}
        bad = await c.post(f"/api/sessions/{sid}/versions", json={"message_id": first_user, "index": 5})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"


async def test_continue_appends_to_a_reply_cut_at_max_tokens_from_the_cached_prefix(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        r = await chat(ws, "Write a long story about the sea.", max_tokens=20, ignore_eos=True)
        assert r.done["finish_reason"] == "length"
        sid, mid = r.start["session_id"], r.start["message_id"]
        await send(ws, {"type": "continue", "session_id": sid, "message_id": mid,
                        "params": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}})
        c = await read_reply(ws)
        assert c.error is None, c.error
        assert c.start["message_id"] == mid  # the same reply, extended
        assert c.text.startswith(r.text) and len(c.text) > len(r.text)  # the stream starts with the old text
        usage = c.done["usage"]
        first = r.done["usage"]
        assert usage["prompt_tokens"] == first["prompt_tokens"] + first["completion_tokens"]
        assert usage["cached_tokens"] >= usage["prompt_tokens"] - BLOCK  # the KV was reused
        # a finished ("stop") or stale reply is refused, and the chat is left as it was
        await send(ws, {"type": "continue", "session_id": sid, "message_id": r.start["user_message_id"]})
        bad = await read_reply(ws)
        assert bad.error is not None and bad.error["code"] == "conflict"
    body = await stored(gw, cookie, sid)
    assert [m["id"] for m in body["messages"]] == [r.start["user_message_id"], mid]
    assert body["messages"][1]["content"] == c.text
    msgs = token_messages(gw, uid_of(gw, cookie), sid)
    assert len(msgs[1]["token_ids"]) == first["completion_tokens"] + usage["completion_tokens"]


@pytest.mark.slow
async def test_on_smollm2_a_continued_greedy_reply_equals_the_reply_written_in_one_go(gateway_factory,
                                                                                      smollm2_engine_url):
    """Continue renders nothing: the prompt is the chat's exact ids through the cut reply
    (no end-of-turn token), so greedy 12 + 12 tokens are the greedy 24 written at once
    (without the default frequency penalty, which counts only a request's own output)."""
    gw = gateway_factory(engine_urls=[smollm2_engine_url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        whole = await chat(ws, "Write a short story about a cat.", max_tokens=24, frequency_penalty=0, timeout=300)
        cut = await chat(ws, "Write a short story about a cat.", max_tokens=12, frequency_penalty=0, timeout=300)
        assert cut.done["finish_reason"] == "length"
        await send(ws, {"type": "continue", "session_id": cut.start["session_id"],
                        "message_id": cut.start["message_id"],
                        "params": {"temperature": 0, "max_tokens": 12, "frequency_penalty": 0}})
        more = await read_reply(ws, timeout=300)
    assert more.error is None, more.error
    assert more.text == whole.text
    assert more.done["usage"]["cached_tokens"] >= more.done["usage"]["prompt_tokens"] - BLOCK
