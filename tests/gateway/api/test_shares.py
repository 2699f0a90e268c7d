"""Share links (gateway/api/shares.py): a read-only snapshot of a chat at the moment of
sharing, in Redis under its own key, revocable, with an optional expiry, showing no
other chat and nothing of the user."""

from __future__ import annotations

import json
from typing import Any

import httpx

from gateway.api.auth import COOKIE_NAME
from tests.gateway_helpers import read_reply, send

SHORT = {"max_tokens": 3, "temperature": 0.0}


def client(gw: Any, cookie: str | None) -> httpx.Client:
    return httpx.Client(base_url=gw.base_url, cookies={COOKIE_NAME: cookie} if cookie else {}, timeout=60)


async def turn(ws: Any, frame: dict) -> dict:
    await send(ws, {**frame, "params": SHORT})
    reply = await read_reply(ws)
    assert reply.done is not None, reply.error
    return reply.done


async def test_a_share_link_shows_the_chat_as_it_was_and_stops_when_revoked(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    files = [{"name": "plan.md", "kind": "markdown", "text": "SECRET FILE TEXT", "size": 16}]
    async with gw.connect(cookie) as ws:
        first = await turn(ws, {"type": "chat", "content": "Share <b>this</b> turn", "attachments": files})
        sid = first["session_id"]
        other = (await turn(ws, {"type": "chat", "content": "A private other chat"}))["session_id"]
    with client(gw, cookie) as c:
        c.patch(f"/api/sessions/{sid}", json={"system_prompt": "PRIVATE SYSTEM PROMPT"})
        r = c.post(f"/api/sessions/{sid}/shares", json={})
        assert r.status_code == 201, r.text
        link = r.json()
        assert link["url"] == f"/s/{link['id']}" and len(link["id"]) == 22 and link["expires_at"] is None
        assert [x["id"] for x in c.get("/api/shares", params={"session_id": sid}).json()["shares"]] == [link["id"]]
        assert c.get("/api/shares", params={"session_id": other}).json()["shares"] == []
    async with gw.connect(cookie) as ws:  # a later turn does not change the snapshot
        await turn(ws, {"type": "chat", "session_id": sid, "content": "Said after sharing"})
    with client(gw, None) as anyone:
        page = anyone.get(link["url"])
        assert page.status_code == 200 and page.headers["cache-control"] == "no-store"
        html = page.text
        data = json.loads(html.split('id="share-data">', 1)[1].split("</script>", 1)[0])
        assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
        assert data["messages"][0]["content"] == "Share <b>this</b> turn"
        assert data["messages"][0]["attachments"] == [{"name": "plan.md", "kind": "markdown"}]
        assert "<b>this</b>" not in html  # the snapshot's markup is escaped in the page
        for private in ("Said after sharing", "A private other chat", "PRIVATE SYSTEM PROMPT", "SECRET FILE TEXT",
                        sid, other, cookie):
            assert private not in html
        assert anyone.get("/s/" + "x" * 22).status_code == 404
    with client(gw, gw.new_cookie()) as stranger:
        assert stranger.delete(f"/api/shares/{link['id']}").status_code == 404
        assert stranger.post(f"/api/sessions/{sid}/shares", json={}).status_code == 404
    with client(gw, cookie) as c:
        assert c.delete(f"/api/shares/{link['id']}").status_code == 204
        assert c.get(link["url"]).status_code == 404
        assert c.get("/api/shares").json()["shares"] == []


async def test_a_link_with_an_expiry_lives_in_redis_under_its_own_expiring_key(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        sid = (await turn(ws, {"type": "chat", "content": "Hello"}))["session_id"]
    with client(gw, cookie) as c:
        assert c.post(f"/api/sessions/{sid}/shares", json={"expires_in_s": 5}).status_code == 400
        assert c.post(f"/api/sessions/{sid}/shares", json={"expires_in_s": "soon"}).status_code == 400
        link = c.post(f"/api/sessions/{sid}/shares", json={"expires_in_s": 3600}).json()
        assert 3590 < link["expires_at"] - link["created_at"] <= 3600
    key = f"{gw.config.key_prefix}chat:share:{link['id']}"
    redis = gw.state.redis
    ttl = gw.run(redis.ttl(key))
    assert 3590 < ttl <= 3600
    # an hour later: Redis has dropped the snapshot, and the list drops the link
    index = next(iter(gw.run(redis.keys(f"{gw.config.key_prefix}chat:user:*:shares"))))
    gw.run(redis.hset(index, link["id"], json.dumps({**link, "expires_at": link["created_at"] - 1})))
    gw.run(redis.delete(key))
    with client(gw, cookie) as c:
        assert c.get(link["url"]).status_code == 404
        assert c.get("/api/shares").json()["shares"] == []
    assert gw.run(redis.hlen(index)) == 0
