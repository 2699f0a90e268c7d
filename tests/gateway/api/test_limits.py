"""Documented limits end to end: frame sizes (large messages, docs/acceptance.md#large-messages), a
huge message does not stall other sockets (the event loop is never blocked), a client
that stops reading is bounded (bounded outbound buffers), and the per-user limits
answer with their error codes."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.exceptions import ConnectionClosed

from bench.raw_ws import client_frame, handshake
from gateway.api.auth import COOKIE_NAME
from tests.engine_gate import of_type
from tests.gateway_helpers import chat, read_reply, recv, send, wait_for

MIB = 1 << 20


def text_of(n_bytes: int) -> str:
    """Plain ASCII words, ``n_bytes`` long (tokenizes like real pasted text)."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers "
    return (words * (n_bytes // len(words) + 1))[:n_bytes]


async def test_frame_sizes_follow_the_documented_limit_and_the_chat_continues(gateway_factory):
    """large messages: under the limit is accepted (here the tiny model's context refuses it
    cleanly); over it gets a ``frame_too_large`` error frame and close 1009 with a reason
    (far over it too); a reconnect continues the same chat with its history intact."""
    gw = gateway_factory()
    limit = gw.config.limits.max_frame_bytes
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        first = await chat(ws, "first", max_tokens=4)
        sid = first.start["session_id"]
        for size in (int(0.9 * MIB), int(1.5 * MIB)):
            await send(ws, {"type": "chat", "session_id": sid, "content": text_of(size)})
            r = await read_reply(ws)
            assert r.start is not None  # accepted: the turn began
            assert r.error["code"] == "context_length_exceeded"
    for size in (limit + 1000, 20 * MIB):
        async with gw.connect(cookie) as ws:
            try:
                await send(ws, {"type": "chat", "session_id": sid, "content": text_of(size)})
                err = await recv(ws, 30)
                assert (err["type"], err["code"]) == ("error", "frame_too_large") and str(limit) in err["message"]
                await recv(ws, 30)
                pytest.fail(f"a {size}-byte frame was not refused")
            except ConnectionClosed as e:
                if e.rcvd is not None:  # the close frame may be lost to a reset while we still send
                    assert e.rcvd.code == 1009 and e.rcvd.reason
    async with gw.connect(cookie) as ws:
        after = await chat(ws, "after", sid, max_tokens=4)
        assert after.done is not None
    async with gw.http(cookie) as c:
        body = (await c.get(f"/api/sessions/{sid}")).json()
    assert [m["content"] for m in body["messages"]] == ["first", first.text, "after", after.text]


async def test_a_huge_message_does_not_stall_other_sockets_pings_or_streams(gateway_factory, engine_gate):
    """the event loop is never blocked: while a ~4 MiB message is decoded, stored and tokenized, other sockets'
    pings are answered and their replies keep streaming (order of events, not times). The two
    replies reach the gateway at most one engine frame per 20 ms, so they are still streaming
    when the big message is handled, however fast the engine writes them."""
    gw = gateway_factory(limits={"max_generations_per_user": 8}, engine_urls=[engine_gate.url])
    cookie = gw.new_cookie()
    phase = {"big_sent": False, "big_done": False}
    during = {"pongs": 0, "b": 0, "c": 0}
    async with gw.connect(cookie) as a, gw.connect(cookie) as b, gw.connect(cookie) as c, \
            gw.connect(cookie) as d:
        for ws in (b, c):
            await send(ws, {"type": "chat", "content": "Tell a long story.",
                            "params": {"max_tokens": 1900, "temperature": 0, "ignore_eos": True}})
        starts = [await recv(b), await recv(c)]
        assert all(s["type"] == "start" for s in starts)
        engine_gate.throttle(0.02, [s["request_id"] for s in starts])

        async def stream(ws, name: str) -> None:
            while not phase["big_done"]:
                f = await recv(ws)
                if f["type"] == "delta" and phase["big_sent"] and not phase["big_done"]:
                    during[name] += 1
                if f["type"] != "delta":
                    return  # this reply ended (a very slow big request outlasted it)

        async def pinger() -> None:
            while not phase["big_done"]:
                await send(d, {"type": "ping"})
                assert await recv(d) == {"type": "pong"}
                if phase["big_sent"] and not phase["big_done"]:
                    during["pongs"] += 1
                await asyncio.sleep(0.01)

        async def big() -> None:
            content = text_of(gw.config.limits.max_frame_bytes - 4096)
            await send(a, {"type": "chat", "content": content})
            phase["big_sent"] = True
            r = await read_reply(a)
            phase["big_done"] = True
            assert r.error is not None and r.error["code"] == "context_length_exceeded"

        await asyncio.gather(big(), pinger(), stream(b, "b"), stream(c, "c"))
        for s in starts:
            await send(a, {"type": "cancel", "request_id": s["request_id"]})
            await engine_gate.sent(of_type("abort", s["request_id"]))
        engine_gate.resume()  # what the relay held back passes at once
        await asyncio.gather(read_reply(b, starts[0]["request_id"]), read_reply(c, starts[1]["request_id"]))
    assert during["pongs"] >= 1, during
    assert during["b"] >= 1 and during["c"] >= 1, during


async def test_a_client_that_stops_reading_is_bounded_closed_and_its_reply_still_stored(gateway_factory):
    """bounded outbound buffers: a socket that does not read (zero receive window) holds at most the outbox
    bound in the gateway, is closed once a send stalls past the timeout, and its reply
    finishes and is stored; a healthy client meanwhile streams normally."""
    pending = 16
    gw = gateway_factory(limits={"ws_send_timeout_s": 1.0, "ws_max_pending_frames": pending,
                                 "ws_socket_sndbuf_bytes": 4096})
    stats = gw.state.ws_stats
    cookie = gw.new_cookie()
    host, port = "127.0.0.1", int(gw.base_url.rsplit(":", 1)[1])
    sock = handshake(host, port, f"{COOKIE_NAME}={cookie}", gw.origin, rcvbuf=4096)
    try:
        sock.sendall(client_frame(json.dumps({"type": "chat", "content": "List 2,000 numbered words.",
                                              "params": {"max_tokens": 300, "temperature": 0,
                                                         "ignore_eos": True}}).encode()))
        ping = client_frame(b'{"type":"ping"}')
        sock.settimeout(0.5)
        sent = 0
        try:  # pongs fill the pipe quickly; the socket never reads
            for _ in range(20_000):
                sock.sendall(ping)
                sent += 1
        except (TimeoutError, OSError):
            pass
        assert sent > 100
        await wait_for(lambda: stats.stalled_closed_total >= 1, timeout=60)
        assert stats.max_outbox_frames <= pending
        assert stats.frames_sent_total < sent  # it stopped delivering: no unbounded queue behind
        async with gw.connect(cookie) as healthy:
            r = await chat(healthy, "Are you there?", max_tokens=8)
            assert r.done is not None
        async with gw.http(cookie) as c:
            async def stored_whole() -> bool:
                rows = (await c.get("/api/sessions")).json()["sessions"]
                bodies = [(await c.get(f"/api/sessions/{s['id']}")).json() for s in rows]
                stuck = [b for b in bodies if b["messages"][0]["content"].startswith("List 2,000")]
                return bool(stuck) and stuck[0]["active"] is None and len(stuck[0]["messages"]) == 2

            await wait_for(stored_whole, timeout=120, interval=0.2)
            rows = (await c.get("/api/sessions")).json()["sessions"]
            bodies = [(await c.get(f"/api/sessions/{s['id']}")).json() for s in rows]
            reply = [b for b in bodies if b["messages"][0]["content"].startswith("List 2,000")][0]["messages"][1]
            assert reply["status"] == "complete" and reply["usage"]["completion_tokens"] == 300
    finally:
        sock.close()


async def test_per_user_limits_answer_with_their_codes(gateway_factory, engine_gate):
    gw = gateway_factory(limits={"max_messages_per_minute": 4, "max_generations_per_user": 1,
                                 "max_sessions_per_user": 2}, engine_urls=[engine_gate.url])
    cookie, other = gw.new_cookie(), gw.new_cookie()
    async with gw.connect(cookie) as a, gw.connect(cookie) as b:
        engine_gate.pause()  # the first reply is still running when the second chat asks
        await send(a, {"type": "chat", "content": "long", "params": {"max_tokens": 400, "ignore_eos": True}})
        start = await recv(a)
        await send(b, {"type": "chat", "content": "second chat at once"})  # message 2
        err = await recv(b)
        assert err["code"] == "too_many_generations"
        await send(a, {"type": "cancel", "request_id": start["request_id"]})
        await engine_gate.sent(of_type("abort", start["request_id"]))
        engine_gate.resume()
        done = await read_reply(a, start["request_id"])
        assert done.done["finish_reason"] == "abort"
        r = await chat(b, "now it fits", max_tokens=2)  # message 3, chat 2
        assert r.done is not None
        await send(b, {"type": "chat", "content": "a third chat"})  # message 4
        assert (await recv(b))["code"] == "too_many_sessions"
        await send(b, {"type": "chat", "content": "over the rate", "session_id": r.start["session_id"]})
        assert (await recv(b))["code"] == "rate_limited"
    async with gw.connect(other) as ws:  # limits are per user
        assert (await chat(ws, "hello", max_tokens=2)).done is not None
    async with gw.http(cookie) as c:
        r = await c.post("/api/sessions", json={})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions"
