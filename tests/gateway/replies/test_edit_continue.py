"""``edit``, ``continue`` and switching versions end to end: real gateway, Redis and
engine (tiny model)."""

from __future__ import annotations

import asyncio

import pytest

from engine.detokenizer import decode_text
from tests.engine_gate import of_type, text_delta
from tests.gateway_helpers import BLOCK, chat, openai_client, read_reply, recv, send, stored, token_messages, uid_of


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
        # usage is the continuation's; continued_tokens says what the reply had before it
        assert usage["continued_tokens"] == first["completion_tokens"] and "continued_tokens" not in first
        # a finished ("stop") or stale reply is refused, and the chat is left as it was
        await send(ws, {"type": "continue", "session_id": sid, "message_id": r.start["user_message_id"]})
        bad = await read_reply(ws)
        assert bad.error is not None and bad.error["code"] == "conflict"
    body = await stored(gw, cookie, sid)
    assert [m["id"] for m in body["messages"]] == [r.start["user_message_id"], mid]
    assert body["messages"][1]["content"] == c.text
    # the stored reply says what done said: the whole length is continued + completion tokens,
    # and the timings are the continuation's own
    assert body["messages"][1]["usage"] == usage and body["messages"][1]["timings"] == c.done["timings"]
    msgs = token_messages(gw, uid_of(gw, cookie), sid)
    assert len(msgs[1]["token_ids"]) == usage["continued_tokens"] + usage["completion_tokens"]


async def test_an_edit_or_continue_of_a_message_the_chat_never_held_names_it_as_not_found(gateway_factory):
    """An id that is nowhere in the chat is not a stale tab's race: it is not told
    "changed in another tab", and the chat is left as it was."""
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        r = await chat(ws, "Hello there.", max_tokens=6)
        sid = r.start["session_id"]
        for frame in ({"type": "continue", "session_id": sid, "message_id": "nope"},
                      {"type": "edit", "session_id": sid, "message_id": "nope", "content": "Hi."}):
            await send(ws, frame)
            bad = await read_reply(ws)
            assert bad.start is None and bad.error is not None
            assert (bad.error["code"], bad.error["message"]) == ("not_found", "no message nope in this chat")
            assert "another tab" not in bad.error["message"]
    body = await stored(gw, cookie, sid)
    assert [m["id"] for m in body["messages"]] == [r.start["user_message_id"], r.start["message_id"]]


async def test_a_stopped_reply_continues_with_what_is_left_of_its_turns_max_tokens(gateway_factory, engine_gate):
    """Continue after a Stop is the reply as if never cut: the turn's own max_tokens
    (not the chat's) less what was written; a reply cut at that budget gets it again."""
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    budget = 200
    async with gw.connect(cookie) as ws:
        engine_gate.pause_on(text_delta())
        await send(ws, {"type": "chat", "content": "Tell me a long story.",
                        "params": {"temperature": 0, "max_tokens": budget, "ignore_eos": True}})
        start = await recv(ws)
        await engine_gate.paused()
        await send(ws, {"type": "cancel", "request_id": start["request_id"]})
        await engine_gate.sent(of_type("abort", start["request_id"]))
        engine_gate.resume()
        cut = await read_reply(ws, start["request_id"])
        assert cut.done is not None and cut.done["finish_reason"] == "abort"
        written = cut.done["usage"]["completion_tokens"]
        assert 1 <= written < budget
        sid, mid = start["session_id"], start["message_id"]
        await send(ws, {"type": "continue", "session_id": sid, "message_id": mid, "params": {"temperature": 0}})
        more = await read_reply(ws)
        assert more.error is None, more.error
        usage = more.done["usage"]
        assert (usage["continued_tokens"], usage["completion_tokens"]) == (written, budget - written)
        assert more.done["finish_reason"] == "length"  # where the uncut reply ends
        # cut at its budget: a Continue writes that budget again
        await send(ws, {"type": "continue", "session_id": sid, "message_id": mid, "params": {"temperature": 0}})
        again = await read_reply(ws)
        assert again.error is None, again.error
        assert (again.done["usage"]["continued_tokens"], again.done["usage"]["completion_tokens"]) == (budget, budget)
    assert len(token_messages(gw, uid_of(gw, cookie), sid)[1]["token_ids"]) == 2 * budget


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    """SmolLM2's tokenizer (the tiny model's too)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


async def test_continue_across_a_stop_string_stores_the_text_of_the_reply_written_at_once(gateway_factory, tok):
    """A reply cut after the start of a stop string shows that start (the cut ends it);
    continued, the stop completes, and the stored reply is the uncut reply's, without it."""
    gw = gateway_factory()
    cookie = gw.new_cookie()
    uid = uid_of(gw, cookie)
    q, n = "Write a long story about the sea.", 30
    async with gw.connect(cookie) as ws:
        probe = await chat(ws, q, max_tokens=n, ignore_eos=True)
        ids = token_messages(gw, uid, probe.start["session_id"])[1]["token_ids"]
        for c in range(6, n - 4):  # a stop string of 3 characters before the cut and 3 after
            shown, later = decode_text(tok, ids[:c]), decode_text(tok, ids[:c + 4])
            stop = shown[-3:] + later[len(shown):len(shown) + 3]
            if len(later) >= len(shown) + 3 and probe.text.find(stop) == len(shown) - 3:
                break
        else:
            pytest.fail(f"no stop string found in {probe.text!r}")
        uncut = await chat(ws, q, max_tokens=n, ignore_eos=True, stop=[stop])
        assert uncut.done["finish_reason"] == "stop" and uncut.text == shown[:-3]
        cut = await chat(ws, q, max_tokens=c, ignore_eos=True, stop=[stop])
        assert cut.done["finish_reason"] == "length" and cut.text == shown  # the stop's start is shown
        sid = cut.start["session_id"]
        await send(ws, {"type": "continue", "session_id": sid, "message_id": cut.start["message_id"],
                        "params": {"temperature": 0, "max_tokens": n - c, "ignore_eos": True, "stop": [stop]}})
        more = await read_reply(ws)
    assert more.error is None, more.error
    assert more.done["finish_reason"] == "stop" and more.text == uncut.text  # from seq 1: the whole reply
    reply = (await stored(gw, cookie, sid))["messages"][1]
    assert (reply["content"], reply["status"], reply["finish_reason"]) == (uncut.text, "complete", "stop")
    want = token_messages(gw, uid, uncut.start["session_id"])[1]["token_ids"]
    assert token_messages(gw, uid, sid)[1]["token_ids"] == want


@pytest.mark.slow
async def test_on_smollm2_a_reply_cut_inside_a_character_never_shows_a_replacement_and_continues_exactly(
        gateway_factory, smollm2_engine_url, tok):
    """A Chinese reply cut at max tokens inside a character: the socket, the stored
    message, the export and the OpenAI API (streamed and not) show it without the broken
    character, and Continue completes it: the continued reply is the reply written at once,
    token for token and character for character (the gateway's default frequency penalty
    counts the continued reply's earlier tokens, as it would had it been written at once)."""
    gw = gateway_factory(engine_urls=[smollm2_engine_url])
    cookie = gw.new_cookie()
    uid = uid_of(gw, cookie)
    q, n = "请用中文回答：今天天气怎么样？", 96
    async with gw.connect(cookie) as ws:
        whole = await chat(ws, q, max_tokens=n, timeout=300)
        ids = token_messages(gw, uid, whole.start["session_id"])[1]["token_ids"]
        inside = [c for c in range(8, len(ids)) if decode_text(tok, ids[:c]).endswith("\ufffd")]
        assert inside and "\ufffd" not in whole.text, whole.text
        c = 80 if 80 in inside else inside[len(inside) // 2]
        cut = await chat(ws, q, max_tokens=c, timeout=300)
        sid = cut.start["session_id"]
        assert cut.done["finish_reason"] == "length" and cut.text == decode_text(tok, ids[:c]).rstrip("\ufffd")
        assert "\ufffd" not in cut.text and whole.text.startswith(cut.text)
        body = await stored(gw, cookie, sid)
        assert body["messages"][1]["content"] == cut.text
        async with gw.http(cookie) as h:
            md = (await h.get(f"/api/sessions/{sid}/export", params={"format": "md"})).text
            js = (await h.get(f"/api/sessions/{sid}/export", params={"format": "json"})).json()
        assert cut.text in md and "\ufffd" not in md and js["messages"][1]["content"] == cut.text
        await send(ws, {"type": "continue", "session_id": sid, "message_id": cut.start["message_id"],
                        "params": {"temperature": 0, "max_tokens": n - c}})
        more = await read_reply(ws, timeout=300)
    assert more.error is None, more.error
    usage = more.done["usage"]
    assert more.text == whole.text and usage["cached_tokens"] >= usage["prompt_tokens"] - BLOCK
    assert (await stored(gw, cookie, sid))["messages"][1]["content"] == whole.text
    assert token_messages(gw, uid, sid)[1]["token_ids"] == ids
    # the OpenAI API, on the same prompt and sampling: the same cut text, streamed or not
    client = openai_client(gw)
    messages = [{"role": "system", "content": gw.config.defaults.system_prompt}, {"role": "user", "content": q}]
    params = dict(model="default", messages=messages, max_tokens=c, temperature=0,
                  frequency_penalty=gw.config.defaults.frequency_penalty)
    one = await asyncio.to_thread(lambda: client.chat.completions.create(**params))
    chunks = await asyncio.to_thread(lambda: list(client.chat.completions.create(**params, stream=True)))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert one.choices[0].finish_reason == "length" and one.choices[0].message.content == cut.text == streamed
