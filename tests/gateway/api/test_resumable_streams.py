"""Resumable chat-completion streams (``X-Conversation-Id``; ``GET``/``DELETE
/v1/stream``) against a real gateway, real Redis and the tiny engine (behind an
``EngineGate`` where the reply must still be running): the replay is the stream the
client got, byte for byte and from any offset; a reply goes on when its client leaves;
a DELETE stops it in the engine and forgets it; conversation ids are scoped per user."""

from __future__ import annotations

import httpx

from tests.engine_gate import of_type, text_delta

QUESTION = [{"role": "user", "content": "Name a colour."}]
CONV = "conv-test::org/model:Q8_0"  # slashes and colons travel in the query string


def _post_stream(gw, body: dict, headers: dict[str, str]) -> bytes:
    with httpx.stream("POST", f"{gw.base_url}/v1/chat/completions", json={**body, "stream": True},
                      headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return r.read()


def _get(gw, conv: str, offset: int = 0, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(f"{gw.base_url}/v1/stream", params={"conv_id": conv, "from": offset}, headers=headers,
                     timeout=120)


def _delete(gw, conv: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.delete(f"{gw.base_url}/v1/stream", params={"conv_id": conv}, headers=headers, timeout=60)


def test_a_finished_stream_replays_byte_for_byte_from_any_offset_until_deleted(api_gateway):
    gw = api_gateway()
    body = {"messages": QUESTION, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    sent = _post_stream(gw, body, {"X-Conversation-Id": CONV})
    assert sent.endswith(b"data: [DONE]\n\n")
    replay = _get(gw, CONV)
    assert replay.status_code == 200 and replay.headers["content-type"].startswith("text/event-stream")
    assert replay.content == sent
    assert _get(gw, CONV, 10).content == sent[10:]
    assert _get(gw, CONV, len(sent) + 5).content == b""
    assert _delete(gw, CONV).status_code == 204
    assert _get(gw, CONV).status_code == 404
    assert _delete(gw, CONV).status_code == 204  # idempotent
    assert _get(gw, "never-used").status_code == 404
    assert httpx.get(f"{gw.base_url}/v1/stream", params={"conv_id": CONV, "from": "x"}).status_code == 400
    assert httpx.get(f"{gw.base_url}/v1/stream").status_code == 400
    plain = _post_stream(gw, body, {})  # without the header nothing is kept
    assert plain.endswith(b"data: [DONE]\n\n") and _get(gw, CONV).status_code == 404


def test_the_reply_goes_on_after_its_client_leaves_and_the_replay_has_all_of_it(api_gateway, engine_gate):
    gw = api_gateway(engine_urls=[engine_gate.url])
    engine_gate.pause_on(text_delta())
    body = {"messages": QUESTION, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gw.base_url}/v1/chat/completions", json=body,
                      headers={"X-Conversation-Id": CONV}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content":"' in line:
                break  # leaves mid-reply
    engine_gate.wait_paused()
    engine_gate.resume()
    replay = _get(gw, CONV).text
    assert replay.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in replay
    assert not [f for f in engine_gate.to_engine if of_type("abort")(f)]


def test_delete_stops_a_running_reply_in_the_engine(api_gateway, engine_gate):
    gw = api_gateway(engine_urls=[engine_gate.url])
    engine_gate.pause_on(text_delta())
    body = {"messages": QUESTION, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gw.base_url}/v1/chat/completions", json=body,
                      headers={"X-Conversation-Id": CONV}, timeout=120) as r:
        assert r.status_code == 200
        engine_gate.wait_paused()
        assert _delete(gw, CONV).status_code == 204
        engine_gate.wait_sent(of_type("abort"))
        engine_gate.resume()
        text = r.read().decode()
    assert "[DONE]" not in text  # stopped, not finished
    assert _get(gw, CONV).status_code == 404


def test_a_conversation_id_is_scoped_to_the_cookie_user(api_gateway):
    gw = api_gateway()
    alice, bob = gw.cookie_header(gw.new_cookie()), gw.cookie_header(gw.new_cookie())
    body = {"messages": QUESTION, "max_tokens": 3, "temperature": 0}
    sent = _post_stream(gw, body, {"X-Conversation-Id": CONV, **alice})
    assert _get(gw, CONV, headers=alice).content == sent
    assert _get(gw, CONV, headers=bob).status_code == 404
    assert _get(gw, CONV).status_code == 404  # no identity: the shared scope
    assert _delete(gw, CONV, headers=bob).status_code == 204 and _get(gw, CONV, headers=alice).status_code == 200
