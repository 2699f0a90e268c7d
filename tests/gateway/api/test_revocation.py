"""Revocation reaches what is already open (gateway/api/revocation.py): revoking an access
token closes the sockets and ``/v1`` streams opened with it, on every gateway replica,
with a clear reason, while the browser reply it started goes on and is stored; deleting
a user's data closes every socket of that user. (The bounds below are for a broken
gateway, not timing asserts; ``bench/hostile_probe.py`` measures the time.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from gateway.api.auth import COOKIE_NAME
from gateway.api.revocation import TOKEN_REVOKED, USER_DELETED
from tests.engine_gate import text_delta
from tests.gateway_helpers import read_reply, recv, send, wait_for

LONG = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}


def _cookie(cookie: str) -> dict[str, str]:
    return {"Cookie": f"{COOKIE_NAME}={cookie}"}


def _token(gw, cookie: str) -> dict[str, Any]:
    r = httpx.post(f"{gw.base_url}/api/tokens", json={"name": "laptop"}, headers=_cookie(cookie), timeout=30)
    assert r.status_code == 201, r.text
    return r.json()


async def _closed_with(ws, timeout: float = 10.0) -> tuple[int, str]:
    """Read until the socket closes; its close code and reason."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except ConnectionClosed as e:
        assert e.rcvd is not None, "closed without a close frame"
        return e.rcvd.code, e.rcvd.reason


async def test_revoking_a_token_closes_its_socket_and_stream_but_not_the_reply_it_started(gateway_factory,
                                                                                           engine_gate):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    other_gw = gateway_factory(engine_urls=[engine_gate.url])  # a second replica on the same Redis
    cookie = gw.new_cookie()
    tok = _token(gw, cookie)
    header = {"X-Chat-Token": tok["token"]}
    async with connect(gw.ws_url, additional_headers=header) as by_token, \
            connect(other_gw.ws_url, additional_headers=header) as elsewhere, gw.connect(cookie) as by_cookie:
        engine_gate.pause_on(text_delta())
        await send(by_token, {"type": "chat", "content": "Tell a long story about a lighthouse.", "params": LONG})
        start = await recv(by_token)
        assert start["type"] == "start"
        await engine_gate.paused()  # the reply is streaming when the token goes
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=30) as c:
            r = await c.delete(f"/api/tokens/{tok['id']}", headers=_cookie(cookie))
        assert r.status_code == 204
        assert await _closed_with(by_token) == (1008, TOKEN_REVOKED)
        assert await _closed_with(elsewhere) == (1008, TOKEN_REVOKED)  # through Redis to the other replica
        await send(by_cookie, {"type": "ping"})  # the same user's cookie socket is not the token's
        assert await recv(by_cookie) == {"type": "pong"}
        engine_gate.resume()
        # the reply goes on and is stored whole; the cookie's socket can follow it
        await send(by_cookie, {"type": "resume", "request_id": start["request_id"], "last_seq": 0})
        rest = await read_reply(by_cookie, start["request_id"])
    assert rest.done is not None and rest.done["usage"]["completion_tokens"] == 300
    async with httpx.AsyncClient(base_url=gw.base_url, cookies={COOKIE_NAME: cookie}, timeout=30) as c:
        body = (await c.get(f"/api/sessions/{start['session_id']}")).json()
    assert body["messages"][-1]["status"] == "complete" and body["messages"][-1]["content"] == rest.text
    assert gw.state.revocations.closed_total >= 1 and other_gw.state.revocations.closed_total >= 1


@pytest.mark.parametrize("stream", [True, False])
def test_revoking_a_token_ends_its_v1_request_with_invalid_token(gateway_factory, engine_gate, stream):
    gw = gateway_factory(engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    tok = _token(gw, cookie)
    body = {"messages": [{"role": "user", "content": "Tell a long story about a canal."}], "stream": stream,
            "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    engine_gate.pause_on(text_delta())
    with httpx.Client(base_url=gw.base_url, timeout=60) as c:
        def revoke_when_paused() -> None:
            engine_gate.wait_paused()
            with httpx.Client(base_url=gw.base_url, timeout=30) as other:
                assert other.delete(f"/api/tokens/{tok['id']}", headers=_cookie(cookie)).status_code == 204

        if stream:
            with c.stream("POST", "/v1/chat/completions", json=body, headers={"X-Chat-Token": tok["token"]}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert json.loads(next(lines)[6:])["choices"][0]["delta"]["role"] == "assistant"
                revoke_when_paused()
                events = [line for line in lines if line.startswith("data: ")]
            assert events, "the stream ended without a word"
            assert json.loads(events[-1][6:])["error"]["code"] == "invalid_token" and "data: [DONE]" not in events
        else:
            import threading

            t = threading.Thread(target=revoke_when_paused)
            t.start()
            r = c.post("/v1/chat/completions", json=body, headers={"X-Chat-Token": tok["token"]})
            t.join()
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_token", r.text
    engine_gate.resume()


async def test_deleting_a_users_data_closes_every_socket_of_that_user(gateway_factory):
    gw = gateway_factory()
    cookie, other = gw.new_cookie(), gw.new_cookie()
    tok = _token(gw, cookie)
    async with gw.connect(cookie) as mine, connect(gw.ws_url, additional_headers={"X-Chat-Token": tok["token"]}) \
            as by_token, gw.connect(other) as theirs:
        await send(mine, {"type": "chat", "content": "Remember my birthday is 3 May.", "params": {"max_tokens": 2}})
        assert (await read_reply(mine)).done is not None
        async with httpx.AsyncClient(base_url=gw.base_url, cookies={COOKIE_NAME: cookie}, timeout=30) as c:
            assert (await c.delete("/api/user")).status_code == 204
            assert (await _closed_with(mine)) == (1008, USER_DELETED)
            assert (await _closed_with(by_token)) == (1008, USER_DELETED)
            assert (await c.get("/api/sessions")).json()["sessions"] == []
            assert (await c.get("/api/tokens")).json()["tokens"] == []
        assert httpx.get(f"{gw.base_url}/api/identity", headers={"X-Chat-Token": tok["token"]}).status_code == 401
        await send(theirs, {"type": "ping"})  # another user is untouched
        assert await recv(theirs) == {"type": "pong"}
    await wait_for(lambda: gw.state.ws_stats.sockets_open == 0)
