"""Chat export (Markdown, JSON), search by title and content, and per-user defaults for
new chats over the HTTP API (gateway/api/chat_export.py, gateway/store/user_defaults.py)."""

from __future__ import annotations

import json
from typing import Any

import httpx

from gateway.api.auth import COOKIE_NAME, UserIds
from tests.fixtures_servers import RunningGateway

SHORT = {"max_tokens": 4, "temperature": 0.0}


async def turn(gw: RunningGateway, cookie: str, sid: str, text: str) -> None:
    async with gw.connect(cookie) as ws:
        await ws.send(json.dumps({"type": "chat", "session_id": sid, "content": text, "params": SHORT}))
        while (f := json.loads(await ws.recv()))["type"] != "done":
            assert f["type"] != "error", f


def client(gw: RunningGateway, cookie: str) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, cookies={COOKIE_NAME: cookie}, timeout=30)


async def test_export_as_markdown_and_json_and_only_for_the_owner(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    with client(gw, cookie) as c:
        sid = c.post("/api/sessions", json={"title": "Tides / moon?", "system_prompt": "Be brief."}).json()["id"]
    await turn(gw, cookie, sid, "Why are there two tides a day?")
    with client(gw, cookie) as c:
        md = c.get(f"/api/sessions/{sid}/export", params={"format": "md"})
        assert md.status_code == 200 and md.headers["content-type"].startswith("text/markdown")
        assert md.headers["content-disposition"] == 'attachment; filename="Tides-moon.md"'
        text = md.text
        assert text.startswith("# Tides / moon?\n") and "> **System prompt:** Be brief." in text
        assert "## You\n\nWhy are there two tides a day?\n\n## Assistant\n\n" in text
        js = c.get(f"/api/sessions/{sid}/export", params={"format": "json"})
        body = js.json()
        assert js.headers["content-disposition"].endswith('.json"')
        assert body["id"] == sid and body["system_prompt"] == "Be brief."
        assert [m["role"] for m in body["messages"]] == ["user", "assistant"]
        assert "token_ids" not in body["messages"][0]
        assert c.get(f"/api/sessions/{sid}/export", params={"format": "pdf"}).status_code == 400
    with client(gw, gw.new_cookie()) as other:
        assert other.get(f"/api/sessions/{sid}/export").status_code == 404


async def test_search_finds_chats_by_title_or_content_of_this_user_only(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    with client(gw, cookie) as c:
        a = c.post("/api/sessions", json={"title": "Garden"}).json()["id"]
        b = c.post("/api/sessions", json={"title": "Kitchen"}).json()["id"]
    await turn(gw, cookie, a, "How deep should tomato roots go?")
    await turn(gw, cookie, b, "A recipe with TOMATOES please")
    with client(gw, cookie) as c:
        rows: list[dict[str, Any]] = c.get("/api/search", params={"q": "tomato"}).json()["results"]
        assert [r["id"] for r in rows] == [b, a]  # newest first
        assert "TOMATOES" in rows[0]["snippet"] and not rows[0]["in_title"]
        rows = c.get("/api/search", params={"q": "garden"}).json()["results"]
        assert [(r["id"], r["in_title"]) for r in rows] == [(a, True)]
        assert c.get("/api/search", params={"q": "zebra"}).json()["results"] == []
        assert c.get("/api/search", params={"q": " "}).status_code == 400
        assert c.get("/api/search", params={"q": "x" * 201}).status_code == 400
    with client(gw, gw.new_cookie()) as other:
        assert other.get("/api/search", params={"q": "tomato"}).json()["results"] == []


async def test_user_defaults_apply_to_new_chats_from_the_page_and_the_socket(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    with client(gw, cookie) as c:
        d = c.get("/api/defaults").json()
        assert d["system_prompt"] == gw.config.defaults.system_prompt
        assert d["params"]["max_tokens"] == gw.config.defaults.max_tokens
        bad = c.put("/api/defaults", json={"params": {"top_k": "many"}})
        assert bad.status_code == 400
        d = c.put("/api/defaults", json={"system_prompt": "Answer in French.",
                                         "params": {"top_k": 7, "repetition_penalty": 1.1, "max_tokens": 5}}).json()
        assert d["system_prompt"] == "Answer in French." and d["params"]["top_k"] == 7
        page_chat = c.post("/api/sessions", json={}).json()
        assert page_chat["system_prompt"] == "Answer in French." and page_chat["params"]["top_k"] == 7
        own = c.post("/api/sessions", json={"params": {"temperature": 0}}).json()
        assert own["params"] == {"temperature": 0}  # a chat that names its own params keeps them
    async with gw.connect(cookie) as ws:  # a chat started by the terminal client (no session id)
        await ws.send(json.dumps({"type": "chat", "content": "Bonjour", "params": {"temperature": 0}}))
        while (f := json.loads(await ws.recv()))["type"] != "done":
            assert f["type"] != "error", f
    with client(gw, cookie) as c:
        chat = c.get(f"/api/sessions/{f['session_id']}").json()
        assert chat["system_prompt"] == "Answer in French." and chat["params"]["repetition_penalty"] == 1.1
        assert chat["messages"][-1]["usage"]["completion_tokens"] <= 5  # the default max_tokens applied
    with client(gw, gw.new_cookie()) as other:
        assert other.get("/api/defaults").json()["system_prompt"] == gw.config.defaults.system_prompt


async def test_search_and_the_markdown_export_show_a_replys_reasoning_as_the_page_does(gateway_factory):
    gw = gateway_factory(engine_urls=[], reasoning_markers="<reason> </reason>")
    cookie = gw.new_cookie()
    uid = UserIds(gw.config.secret_key).verify(cookie)
    assert uid is not None
    store = gw.state.store

    async def seed(title: str, reply: str, reasoning_ms: float | None) -> str:
        chat = await store.create_session(uid, title=title)
        begun = await store.begin_turn(uid, chat.id, mode="chat", content="How does a rainbow form?")
        fields: dict[str, Any] = {"content": reply, "status": "complete", "finish_reason": "stop",
                                  "usage": {"prompt_tokens": 9, "cached_tokens": 0, "completion_tokens": 9},
                                  "timings": {"ttft_ms": 1.0, "tpot_ms": 1.0, "e2e_ms": 9.0}, "created_at": 0.0}
        if reasoning_ms is not None:
            fields["reasoning_ms"] = reasoning_ms
        await store.finish_turn(uid, chat.id, begun, fields, None, None)
        return chat.id

    sid = gw.run(seed("Rainbows", "<reason>\nSunlight meets droplets.\n\nKeep it short.\n</reason>\n\n"
                                  "Light bends in raindrops.", 4200.0))
    cut = gw.run(seed("Cut", "  <reason>Still weighing the droplets", None))
    with client(gw, cookie) as c:
        def search(q: str) -> list[tuple[str, str]]:
            return [(r["id"], r["snippet"]) for r in c.get("/api/search", params={"q": q}).json()["results"]]

        assert search("bends") == [(sid, "Light bends in raindrops.")]
        assert search("droplets") == [(cut, "Thoughts: Still weighing the droplets"),
                                      (sid, "Thoughts: Sunlight meets droplets. Keep it short.")]
        assert search("reason") == []  # the markers are not the reply's text
        text = c.get(f"/api/sessions/{sid}/export", params={"format": "md"}).text
        assert ("## Assistant\n\n> *Thought for 4.2 s*\n>\n> Sunlight meets droplets.\n>\n> Keep it short.\n\n"
                "Light bends in raindrops.\n") in text
        every = c.get("/api/export", params={"format": "md"}).text
        assert "## Assistant\n\n> *Thoughts*\n>\n> Still weighing the droplets\n" in every
        assert "<reason>" not in every and "</reason>" not in every
        # the JSON export keeps the stored text whole: importing it gives the chat back as it was
        body = c.get(f"/api/sessions/{sid}/export", params={"format": "json"}).json()
        assert body["messages"][1]["content"].startswith("<reason>\nSunlight")
