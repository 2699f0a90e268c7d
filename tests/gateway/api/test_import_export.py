"""Export every chat with every version, import it back identically, and import ChatGPT's
export (its message tree, branches, split files, zip) without duplicates
(gateway/chat_import.py, gateway/store/imports.py, gateway/api/chat_export.py)."""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any

import httpx

from gateway.api.auth import COOKIE_NAME
from gateway.chat_import import from_chatgpt
from tests.gateway_helpers import read_reply, send

SHORT = {"max_tokens": 3, "temperature": 0.0}


def node(nid: str, role: str | None, text: str, parent: str | None, children: list[str], **extra: Any) -> dict:
    msg = None
    if role is not None:
        msg = {"id": nid, "author": {"role": role, "name": None, "metadata": {}}, "create_time": 1700000000.0,
               "content": {"content_type": "text", "parts": [text]}, "status": "finished_successfully",
               "recipient": extra.pop("recipient", "all"), "metadata": extra.pop("metadata", {})}
    return {"id": nid, "message": msg, "parent": parent, "children": children}


def chatgpt_conversation(cid: str = "c0ffee00-0000-4000-8000-000000000001", title: str = "Jokes and poems") -> dict:
    """A conversation with an edited user message (two branches), a regenerated reply (two
    siblings), a tool call and its result (hidden), and messages without a model name."""
    n = [
        node("root", None, "", None, ["sys"]),
        node("sys", "system", "", "root", ["u1"], metadata={"is_visually_hidden_from_conversation": True}),
        node("u1", "user", "Hi", "sys", ["a1"]),
        node("a1", "assistant", "Hello!", "u1", ["u2a", "u2b"], metadata={"model_slug": "gpt-4o"}),
        node("u2a", "user", "Tell me a joke", "a1", ["a2a"]),
        node("a2a", "assistant", "Why did the chicken...", "u2a", []),
        node("u2b", "user", "Tell me a poem", "a1", ["a2b1", "a2b2"]),
        node("a2b1", "assistant", "Roses are red", "u2b", []),
        node("a2b2", "assistant", "The sea at night", "u2b", ["u3"]),
        node("u3", "user", "Run it in python", "a2b2", ["call"]),
        node("call", "assistant", "print(1)", "u3", ["result"], recipient="python"),
        node("result", "tool", "1", "call", ["a3"]),
        node("a3", "assistant", "It printed 1.", "result", []),
    ]
    return {"title": title, "create_time": 1700000000.0, "update_time": 1700000500.0, "conversation_id": cid,
            "id": cid, "current_node": "a3", "mapping": {x["id"]: x for x in n}}


def test_a_chatgpt_tree_keeps_every_shown_node_and_the_current_path():
    chat = from_chatgpt(chatgpt_conversation())
    assert [m["id"] for m in chat.messages] == ["u1", "a1", "u2b", "a2b2", "u3", "a3"]
    assert [m["content"] for m in chat.messages][-2:] == ["Run it in python", "It printed 1."]
    assert chat.versions == {
        "a1": [{"messages": [chat.versions["a1"][0]["messages"][0], chat.versions["a1"][0]["messages"][1]]},
               {"current": True}],
        "u2b": [{"messages": [chat.versions["u2b"][0]["messages"][0]]}, {"current": True}],
    }
    assert [m["id"] for m in chat.versions["a1"][0]["messages"]] == ["u2a", "a2a"]
    assert chat.versions["u2b"][0]["messages"][0]["content"] == "Roses are red"
    assert chat.source == "chatgpt:c0ffee00-0000-4000-8000-000000000001" and chat.title == "Jokes and poems"
    # a photo sent alone is kept, as a placeholder (its bytes are not in the export)
    conv = chatgpt_conversation()
    conv["mapping"]["u3"]["message"]["content"] = {"content_type": "multimodal_text", "parts": [
        {"content_type": "image_asset_pointer", "asset_pointer": "file-service://x"}]}
    assert from_chatgpt(conv).messages[4]["content"] == "[image]"


def client(gw: Any, cookie: str) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, cookies={COOKIE_NAME: cookie}, timeout=60)


def every_id(export_chat: dict) -> set[str]:
    ids = {m["id"] for m in export_chat["messages"]}
    for entries in (export_chat.get("versions") or {}).values():
        for e in entries:
            ids |= {m["id"] for m in e.get("messages", [])}
    return ids


async def test_a_chatgpt_export_imports_with_its_branches_once(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    data = json.dumps([chatgpt_conversation()]).encode()
    with client(gw, cookie) as c:
        r = c.post("/api/import", content=data)
        assert r.status_code == 200, r.text
        assert r.json()["imported"] == 1 and r.json()["skipped"] == 0
        sid = r.json()["chats"][0]["id"]
        s = c.get(f"/api/sessions/{sid}").json()
        assert s["title"] == "Jokes and poems"
        assert [m["content"] for m in s["messages"]] == ["Hi", "Hello!", "Tell me a poem", "The sea at night",
                                                         "Run it in python", "It printed 1."]
        assert s["messages"][2]["versions"] == {"index": 1, "count": 2}
        assert s["messages"][3]["versions"] == {"index": 1, "count": 2}
        exported = c.get(f"/api/sessions/{sid}/export", params={"format": "json"}).json()
        assert every_id(exported) == {"u1", "a1", "u2a", "a2a", "u2b", "a2b1", "a2b2", "u3", "a3"}
        # the other branch of the edit can be shown, as if it had been made here
        s = c.post(f"/api/sessions/{sid}/versions", json={"message_id": "u2b", "index": 0}).json()
        assert [m["content"] for m in s["messages"]] == ["Hi", "Hello!", "Tell me a joke", "Why did the chicken..."]
        # importing the same file again adds nothing
        r = c.post("/api/import", content=data)
        assert r.json() == {"imported": 0, "skipped": 1, "chats": []}
        assert len(c.get("/api/sessions").json()["sessions"]) == 1
        # the 2026 exports: conversations split into conversations-000.json, -001, ... in a zip
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("conversations-000.json", json.dumps([chatgpt_conversation()]))
            z.writestr("conversations-001.json", json.dumps([chatgpt_conversation("b2", "Second")]))
            z.writestr("chat.html", "<html></html>")
        r = c.post("/api/import", content=buf.getvalue())
        assert (r.json()["imported"], r.json()["skipped"]) == (1, 1)
        assert r.json()["chats"][0]["title"] == "Second"
        r = c.post("/api/import", content=json.dumps([chatgpt_conversation("b2", "Second")]).encode())
        assert (r.json()["imported"], r.json()["skipped"]) == (0, 1)
        # a deleted chat can be imported again
        assert c.delete(f"/api/sessions/{sid}").status_code == 204
        assert c.post("/api/import", content=data).json()["imported"] == 1
        for bad, words in [(b'{"hello": 1}', "neither"), (b"PK\x03\x04broken", "cannot be read")]:
            r = c.post("/api/import", content=bad)
            assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


async def turn(ws: Any, frame: dict) -> dict:
    await send(ws, {**frame, "params": SHORT})
    reply = await read_reply(ws)
    assert reply.done is not None, reply.error
    return reply.done


def without_ids(export: dict) -> dict:
    out = json.loads(json.dumps(export))
    out.pop("exported_at", None)
    for chat in out["chats"]:
        chat.pop("id")
    return out


async def test_our_export_of_every_chat_and_version_round_trips_identically(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    files = [{"name": "notes.md", "kind": "markdown", "text": "# Notes", "size": 7}]
    async with gw.connect(cookie) as ws:
        done = await turn(ws, {"type": "chat", "content": "First question", "attachments": files})
        sid = done["session_id"]
        await turn(ws, {"type": "chat", "session_id": sid, "content": "Second question"})
        with client(gw, cookie) as c:
            msgs = c.get(f"/api/sessions/{sid}").json()["messages"]
        await turn(ws, {"type": "edit", "session_id": sid, "message_id": msgs[2]["id"], "content": "Edited second"})
        with client(gw, cookie) as c:
            last = c.get(f"/api/sessions/{sid}").json()["messages"][-1]
        await turn(ws, {"type": "regenerate", "session_id": sid, "message_id": last["id"]})
        other = (await turn(ws, {"type": "chat", "content": "Another chat"}))["session_id"]
    with client(gw, cookie) as c:
        export = c.get("/api/export", params={"format": "json"})
        assert export.headers["content-disposition"].startswith('attachment; filename="chats-')
        doc = export.json()
        assert doc["format"] == "chatserve-export" and len(doc["chats"]) == 2
        chat = next(x for x in doc["chats"] if x["id"] == sid)
        assert len(chat["versions"]) == 2  # the edit's and the regeneration's
        assert chat["messages"][0]["attachments"] == files
        md = c.get("/api/export", params={"format": "md"}).text
        assert "## Other versions" in md and "Second question" in md and "*Attached: notes.md*" in md
        # our own export, into the same account: every chat is there already
        assert c.post("/api/import", content=export.content).json()["skipped"] == 2
    other_cookie = gw.new_cookie()
    with client(gw, other_cookie) as c:
        r = c.post("/api/import", content=export.content).json()
        assert r["imported"] == 2
        again = c.get("/api/export", params={"format": "json"}).json()
        assert without_ids(again) == without_ids(doc)
        assert c.post("/api/import", content=export.content).json() == {"imported": 0, "skipped": 2, "chats": []}
        # an imported chat goes on like any other (its first turn reads the whole chat)
        new_sid = next(x["id"] for x in r["chats"] if x["title"] != "Another chat")
    async with gw.connect(other_cookie) as ws:
        await turn(ws, {"type": "chat", "session_id": new_sid, "content": "And now?"})
    assert other  # the second chat was exported too


async def test_a_file_that_is_not_json_is_refused_saying_where_in_words(gateway_factory):
    """A CSV (or a broken export) is refused with the place it stopped being JSON, as
    request bodies are: never a Python exception's name."""
    gw = gateway_factory()
    with client(gw, gw.new_cookie()) as c:
        for bad, where in [(b"name,colour\napple,red\n", "expecting value at line 1, column 1"),
                           (b'[{"title": "x",\n  "messages": [}]', "expecting value at line 2, column 16"),
                           (b'["caf\xe9"]', "the bytes are not UTF-8 text")]:
            r = c.post("/api/import", content=bad)
            message = f"the file is not valid JSON: {where}"
            assert r.status_code == 400 and r.json()["error"] == {"code": "invalid_request", "message": message}
        assert c.get("/api/sessions").json()["sessions"] == []


async def test_an_import_that_meets_the_limit_of_chats_keeps_what_it_stored_and_says_so(gateway_factory):
    gw = gateway_factory(limits={"max_sessions_per_user": 2})
    convs = [chatgpt_conversation(f"conv-{i}", f"Chat {i}") for i in range(3)]
    with client(gw, gw.new_cookie()) as c:
        r = c.post("/api/import", content=json.dumps(convs).encode()).json()
        assert r["imported"] == 2 and r["error"]["code"] == "too_many_sessions"
        assert r["error"]["message"].startswith("1 more chat not imported: at most 2 chats")
        assert sorted(s["title"] for s in c.get("/api/sessions").json()["sessions"]) == ["Chat 0", "Chat 1"]


async def test_an_import_keeps_tool_calls_and_results_and_refuses_bad_ones(gateway_factory):
    gw = gateway_factory()
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
    messages = [{"role": "user", "id": "u1", "content": "Weather in Oslo?"},
                {"role": "assistant", "id": "a1", "content": "", "tool_calls": [call], "finish_reason": "tool_calls"},
                {"role": "user", "id": "u2", "content": "", "tool_results": [{"tool_call_id": "call_1",
                                                                             "content": "Sunny"}]},
                {"role": "assistant", "id": "a2", "content": "It is sunny."}]
    chat = {"id": "t00l5", "title": "Tools", "system_prompt": "", "params": {}, "messages": messages}
    with client(gw, gw.new_cookie()) as c:
        r = c.post("/api/import", content=json.dumps(chat).encode())
        assert r.status_code == 200, r.text
        shown = c.get(f"/api/sessions/{r.json()['chats'][0]['id']}").json()["messages"]
        assert shown[1]["tool_calls"] == [call]
        assert shown[2]["tool_results"] == [{"tool_call_id": "call_1", "content": "Sunny"}]
        for bad in ({**messages[1], "tool_calls": [{"id": "x"}]}, {**messages[1], "tool_calls": "weather"}):
            broken = {**chat, "id": "br0ken", "messages": [messages[0], bad]}
            r = c.post("/api/import", content=json.dumps(broken).encode())
            assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"], r.text
