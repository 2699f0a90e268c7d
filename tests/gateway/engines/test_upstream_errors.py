"""An OpenAI-compatible upstream's own errors (``gateway/engines/upstream.py``) reach the client
as the upstream's code and message, never ``internal_error``: a rate limit after some
text, a server error or a refused sample in the middle of the stream, an error before any
text (an ``error`` event or an HTTP 429). The upstream is a real HTTP server started here
(a small Starlette app that streams Server-Sent Events the way OpenAI, llama-server and
vLLM do, then the error); the gateway in front of it is the real one, with Redis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.config import GatewayConfig
from gateway.server.serving import ThreadedServer
from tests.gateway_helpers import chat


@dataclass(frozen=True)
class Case:
    """What the upstream sends for one prompt, and what our clients must see."""

    texts: tuple[str, ...]  # content chunks before the error
    error: dict[str, Any]  # the error event's (or HTTP answer's) body
    code: str  # the code our clients get
    status: int  # the HTTP status of a non-streaming /v1 answer
    http_status: int = 200  # the upstream's own status (not 200: it refuses before streaming)

    @property
    def message(self) -> str:
        err = self.error.get("error", self.error)
        return str(err["message"])


OPENAI_RATE_LIMIT = {"error": {"message": "Rate limit reached for fake-model in organization org-1 on tokens per "
                               "min (TPM): Limit 30000, Used 30000, Requested 90.", "type": "rate_limit_error",
                               "param": None, "code": "rate_limit_exceeded"}}
CASES = {
    "openai_rate_limit_after_text": Case(("Hello", " there, ", "fri"), OPENAI_RATE_LIMIT, "rate_limit_exceeded", 429),
    "llamacpp_server_error_after_text": Case(
        ("Once", " upon"), {"error": {"code": 500, "message": "slot 0: the decode failed", "type": "server_error"}},
        "server_error", 502),
    "vllm_bad_request_after_text": Case(
        ("Par",), {"error": {"object": "error", "message": "probability tensor contains inf or nan",
                             "type": "BadRequestError", "param": None, "code": 400}}, "upstream_error", 400),
    "rate_limit_event_before_text": Case((), OPENAI_RATE_LIMIT, "rate_limit_exceeded", 429),
    "http_429_before_streaming": Case((), OPENAI_RATE_LIMIT, "rate_limit_exceeded", 429, http_status=429),
}


def fake_upstream_app(seen: list[str]) -> Starlette:
    """An OpenAI-compatible server whose reply to a chat is the case its last message
    names; ``seen`` gets each chat's last message."""

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "fake",
                                                         "max_model_len": 4096}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        seen.append(body["messages"][-1]["content"])
        case = CASES[seen[-1]]
        if case.http_status != 200:
            return JSONResponse(case.error, status_code=case.http_status)
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": "fake-model"}

        def event(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def events() -> Any:
            yield event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "finish_reason": None}]})
            for text in case.texts:
                yield event({**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
            yield event(case.error)  # and the stream ends, without [DONE]

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", completions,
                                                                  methods=["POST"])])


@dataclass
class Upstream:
    """A running fake upstream: its API base and the chats it was sent."""

    url: str
    seen: list[str]


@pytest.fixture(scope="module")
def fake_upstream() -> Iterator[Upstream]:
    """The fake upstream (``url`` is ``http://127.0.0.1:PORT/v1``)."""
    seen: list[str] = []
    server = ThreadedServer(fake_upstream_app(seen), GatewayConfig().with_overrides(host="127.0.0.1", port=0))
    port = server.start()
    try:
        yield Upstream(f"http://127.0.0.1:{port}/v1", seen)
    finally:
        server.stop()


def sse_events(r: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of a streamed answer (JSON, or the text ``[DONE]``)."""
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("name", list(CASES))
async def test_an_upstreams_error_reaches_both_apis_with_its_code_and_the_partial_reply_is_kept(
        gateway_factory, fake_upstream, name):
    case = CASES[name]
    text = "".join(case.texts)
    gw = gateway_factory(engine_urls=[fake_upstream.url])
    cookie = gw.new_cookie()
    # the browser socket: the text, then done with the upstream's error; stored as partial
    async with gw.connect(cookie) as ws:
        r = await chat(ws, name)
    if text:
        assert r.text == text and r.done is not None, r
        assert r.done["finish_reason"] == "error"
        assert (r.done["error"]["code"], r.done["error"]["message"]) == (case.code, case.message)
        async with gw.http(cookie) as c:
            reply = (await c.get(f"/api/sessions/{r.start['session_id']}")).json()["messages"][-1]
        assert (reply["content"], reply["status"], reply["cut_reason"]) == (text, "partial", "upstream_error")
        assert (reply["error"]["code"], reply["error"]["message"]) == (case.code, case.message)
    else:  # refused before any text: the turn is undone (no chat is left)
        assert r.error is not None and (r.error["code"], r.error["message"]) == (case.code, case.message), r
        async with gw.http(cookie) as c:
            assert (await c.get("/api/sessions")).json()["sessions"] == []
    # the OpenAI API, stateless and linked, streamed and not
    async with httpx.AsyncClient(base_url=gw.base_url, cookies={"chat_uid": cookie}, timeout=30) as c:
        for link in ({}, {"session_id": "new"}):
            body = {"messages": [{"role": "user", "content": name}], **link}
            one = await c.post("/v1/chat/completions", json=body)
            assert one.status_code == case.status, one.text
            err = one.json()["error"]
            assert (err["code"], err["message"]) == (case.code, case.message)
            assert err["type"] == ("rate_limit_error" if case.status == 429 else "invalid_request_error"
                                   if case.status < 500 else "server_error")
            streamed = await c.post("/v1/chat/completions", json={**body, "stream": True})
            if not text:
                assert streamed.status_code == case.status and streamed.json()["error"]["code"] == case.code
                continue
            assert streamed.status_code == 200
            events = sse_events(streamed)
            shown = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
            assert shown == text and "[DONE]" not in events
            assert (events[-1]["error"]["code"], events[-1]["error"]["message"]) == (case.code, case.message)
        if text:  # the linked requests' partial replies are stored with their reason
            chats = (await c.get("/api/sessions")).json()["sessions"]
            assert len(chats) == 3  # the socket's and two linked ones
            for s in chats:
                reply = (await c.get(f"/api/sessions/{s['id']}")).json()["messages"][-1]
                assert (reply["content"], reply["cut_reason"], reply["error"]["code"]) == (
                    text, "upstream_error", case.code)
        metrics = (await c.get("/metrics")).text
    assert 'code="internal_error"' not in metrics and f'code="{case.code}"' in metrics


async def test_a_rate_limited_upstream_passes_the_reply_to_another_engine(gateway_factory, fake_upstream,
                                                                          engine_url):
    """A 429 before any text moves the reply to another engine (here our tiny engine), as
    an engine that is down does: every chat gets its reply, wherever it was routed first."""
    # round robin: every other chat is sent to the upstream first
    gw = gateway_factory(engine_urls=[fake_upstream.url, engine_url], routing={"policy": "round_robin"})
    before = len(fake_upstream.seen)
    name = "http_429_before_streaming"
    async with gw.connect(gw.new_cookie()) as ws:
        replies = [await chat(ws, name, max_tokens=4, ignore_eos=True) for _ in range(4)]
    assert all(r.error is None and r.done["finish_reason"] == "length" and r.text for r in replies), replies
    assert fake_upstream.seen[before:].count(name) >= 2
