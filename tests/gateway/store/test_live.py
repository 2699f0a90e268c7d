"""Live tabs across gateway replicas: every change to a user's chats reaches that
user's sockets on every replica as ``event`` frames, and no other user's (real Redis,
two real gateways, tiny engine)."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.api.auth import UserIds
from gateway.api.socket_frames import PONG
from tests.gateway_helpers import chat, recv, send, wait_for


async def next_event(ws: Any, kinds: set[str], timeout: float = 30.0) -> dict[str, Any]:
    """The next ``event`` frame of one of ``kinds`` (other frames are skipped)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        f = await recv(ws, max(0.1, deadline - asyncio.get_running_loop().time()))
        if f["type"] == "event" and f["kind"] in kinds:
            return f


async def frames_until_pong(ws: Any) -> list[dict[str, Any]]:
    await send(ws, {"type": "ping"})
    seen = []
    while (f := await recv(ws)) != PONG:
        seen.append(f)
    return seen


async def test_changes_in_one_tab_reach_the_users_other_tabs_on_another_replica(gateway_factory):
    secret = "s" * 43  # both replicas sign and read the same cookies
    gw1, gw2 = gateway_factory(secret_key=secret), gateway_factory(secret_key=secret)
    cookie, stranger = gw1.new_cookie(), gw2.new_cookie()
    uid = UserIds(secret).verify(cookie)
    async with gw1.connect(cookie) as a, gw2.connect(cookie) as b, gw2.connect(stranger) as c:
        for ws in (a, b, c):
            await send(ws, {"type": "events"})
        await wait_for(lambda: uid in gw2.state.live.subscribed and uid in gw1.state.live.subscribed)
        r = await chat(a, "Hello there.", max_tokens=6)
        sid = r.start["session_id"]
        started = await next_event(b, {"started"})
        assert started["session_id"] == sid and started["request_id"] == r.start["request_id"]
        finished = await next_event(b, {"finished"})
        assert finished["session_id"] == sid
        async with gw1.http(cookie) as h:
            assert (await h.patch(f"/api/sessions/{sid}", json={"title": "renamed"})).status_code == 200
            assert (await next_event(b, {"updated"}))["session_id"] == sid
            created = (await h.post("/api/sessions", json={})).json()["id"]
            assert (await next_event(b, {"created"}))["session_id"] == created
            assert (await h.delete(f"/api/sessions/{created}")).status_code == 204
            assert (await next_event(b, {"deleted"}))["session_id"] == created
        # the tab that made the changes hears them too (it ignores its own in the page)
        assert (await next_event(a, {"deleted"}))["session_id"] == created
        assert [f for f in await frames_until_pong(c) if f["type"] == "event"] == []
    await wait_for(lambda: uid not in gw2.state.live.subscribed)  # the last socket left: unsubscribed


async def test_a_socket_gets_no_event_frames_unless_it_asks(gateway_factory):
    gw = gateway_factory()
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as quiet, gw.connect(cookie) as watching:
        await send(watching, {"type": "events"})
        await wait_for(lambda: gw.state.live.subscribed)
        r = await chat(quiet, "Hello there.", max_tokens=4)
        assert r.error is None and not [f for f in r.others if f["type"] == "event"]
        assert (await next_event(watching, {"finished"}))["session_id"] == r.start["session_id"]
        await send(watching, {"type": "events", "on": False})
        await wait_for(lambda: not gw.state.live.subscribed)
        await send(watching, {"type": "events", "on": "yes"})
        assert (await recv(watching))["code"] == "bad_frame"
