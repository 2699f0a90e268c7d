"""Helpers for gateway tests: read browser-protocol frames off a ``websockets`` client;
the official OpenAI client on a running gateway."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TIMEOUT = 120.0


async def recv(ws: Any, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """The next frame as a dict (fails the test after ``timeout`` seconds)."""
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def send(ws: Any, frame: dict[str, Any]) -> None:
    """Send one frame as JSON text."""
    await ws.send(json.dumps(frame))


@dataclass
class Reply:
    """What one socket saw of one reply."""

    start: dict[str, Any] | None = None
    deltas: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    others: list[dict[str, Any]] = field(default_factory=list)  # frames of other requests / pongs

    @property
    def text(self) -> str:
        """The deltas' text joined."""
        return "".join(d["text"] for d in self.deltas)

    @property
    def seqs(self) -> list[int]:
        """The deltas' seq numbers in arrival order."""
        return [d["seq"] for d in self.deltas]

    @property
    def request_id(self) -> str | None:
        """The reply's id (from its start frame)."""
        return (self.start or {}).get("request_id")


async def read_reply(ws: Any, request_id: str | None = None, timeout: float = DEFAULT_TIMEOUT,
                     on_frame: Callable[[dict[str, Any], Reply], Awaitable[None] | None] | None = None,
                     reply: Reply | None = None) -> Reply:
    """Read frames until the reply ``request_id`` (or the first one started) ends with
    ``done`` or an ``error``; other frames are kept in ``others``."""
    r = reply or Reply()
    deadline = time.monotonic() + timeout
    while True:
        f = await recv(ws, max(0.1, deadline - time.monotonic()))
        rid = f.get("request_id")
        kind = f["type"]
        if kind == "start" and (request_id is None or rid == request_id) and r.start is None:
            r.start, request_id = f, rid
        elif kind == "delta" and rid == request_id and request_id is not None:
            r.deltas.append(f)
        elif kind == "done" and rid == request_id and request_id is not None:
            r.done = f
        elif kind == "error" and (rid is None or rid == request_id):
            r.error = f
        else:
            r.others.append(f)
        if on_frame is not None:
            res = on_frame(f, r)
            if asyncio.iscoroutine(res):
                await res
        if r.done is not None or r.error is not None:
            return r


async def chat(ws: Any, content: str, session_id: str | None = None, timeout: float = DEFAULT_TIMEOUT,
               **params: Any) -> Reply:
    """Send a ``chat`` frame (greedy unless ``temperature`` is given) and read its reply."""
    params.setdefault("temperature", 0)
    frame: dict[str, Any] = {"type": "chat", "content": content, "params": params}
    if session_id:
        frame["session_id"] = session_id
    await send(ws, frame)
    return await read_reply(ws, timeout=timeout)


async def wait_for(predicate: Callable[[], Awaitable[bool] | bool], timeout: float = 60.0,
                   interval: float = 0.05) -> None:
    """Poll until ``predicate()`` is true (fails with AssertionError after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        res = predicate()
        if asyncio.iscoroutine(res):
            res = await res
        if res:
            return
        await asyncio.sleep(interval)
    raise AssertionError("condition not reached in time")


def openai_client(gw: Any, api_key: str = "unused", **kwargs: Any) -> Any:
    """The official ``openai`` client on a ``RunningGateway`` (no retries: each test sees
    every answer), closed when the gateway stops."""
    import openai

    return gw.close_on_stop(openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=api_key, max_retries=0,
                                          timeout=120, **kwargs))


BLOCK = 16  # the engine fixture's --block-size


async def stored(gw: Any, cookie: str, sid: str) -> dict:
    """GET /api/sessions/{sid} as the cookie's user (must answer 200)."""
    async with gw.http(cookie) as c:
        r = await c.get(f"/api/sessions/{sid}")
        assert r.status_code == 200, r.text
        return r.json()


def token_messages(gw: Any, owner: str, sid: str) -> list[dict]:
    """The stored messages with their token segments, read on the gateway's own loop."""
    return gw.run(gw.state.store.messages(owner, sid, with_tokens=True))


def uid_of(gw: Any, cookie: str) -> str:
    """The user id the gateway's cookie names."""
    from gateway.api.auth import UserIds
    uid = UserIds(gw.config.secret_key).verify(cookie)
    assert uid is not None
    return uid
