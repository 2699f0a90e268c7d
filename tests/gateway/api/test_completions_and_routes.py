"""``/v1/completions`` (string and token prompts, streaming, logprobs, echo, choices),
OpenAI error objects for unknown ``/v1`` routes, and CORS for ``/v1``: the official
``openai`` SDK and raw HTTP against a real gateway and the tiny engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_helpers import openai_client as client

PROMPT = "The lighthouse keeper said"


def complete(oa: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("prompt", PROMPT)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 8)
    return oa.completions.create(model="default", **kw)


def test_a_text_prompt_is_completed_without_a_chat_template(api_gateway):
    oa = client(api_gateway())
    r = complete(oa)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8 * (
        r.choices[0].finish_reason == "length") + r.usage.completion_tokens * (r.choices[0].finish_reason == "stop")
    chat = oa.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPT}], max_tokens=1)
    assert r.usage.prompt_tokens < chat.usage.prompt_tokens  # no template around it


def test_max_tokens_defaults_to_sixteen(api_gateway):
    r = httpx.post(f"{api_gateway().base_url}/v1/completions", json={"prompt": PROMPT, "temperature": 0,
                                                                     "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


def test_streamed_completion_equals_the_whole_one(api_gateway):
    oa = client(api_gateway())
    whole = complete(oa, max_tokens=12)
    chunks = list(complete(oa, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_token_prompts_and_text_prompts_give_the_same_completion(api_gateway):
    gw = api_gateway()
    oa = client(gw)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(gw.state.router.clients[0].info.tokenizer_dir).encode(
        PROMPT, add_special_tokens=False)
    by_text = complete(oa)
    by_ids = complete(oa, prompt=ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    both = complete(oa, prompt=[PROMPT, ids], n=2)  # each prompt its own n choices
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert {c.text for c in both.choices} == {by_text.choices[0].text}


def test_logprobs_and_echo_use_the_completions_layout(api_gateway):
    oa = client(api_gateway())
    r = complete(oa, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(max(t.values()) == pytest.approx(v, abs=1e-5) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    echoed = complete(oa, logprobs=2, echo=True)
    e = echoed.choices[0]
    assert e.text == PROMPT + r.choices[0].text
    n_prompt = echoed.usage.prompt_tokens
    assert len(e.logprobs.tokens) == n_prompt + echoed.usage.completion_tokens
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert "".join(e.logprobs.tokens[:n_prompt]) == PROMPT
    assert e.logprobs.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    streamed = "".join(c.choices[0].text for c in complete(oa, echo=True, stream=True) if c.choices)
    assert streamed == e.text


def test_bad_completion_requests_are_400(api_gateway):
    gw = api_gateway()
    for body, param in (({"prompt": ""}, "prompt"), ({"prompt": PROMPT, "suffix": "x"}, "suffix"),
                        ({"prompt": PROMPT, "logprobs": 21}, "logprobs"), ({"prompt": PROMPT, "n": 9}, "n"),
                        ({"prompt": PROMPT, "best_of": 3}, "best_of"), ({"prompt": [1.5]}, "prompt")):
        r = httpx.post(f"{gw.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- routes and CORS -----------------------------------------------------------------------


def test_unknown_v1_routes_get_an_openai_error_object(api_gateway):
    gw = api_gateway()
    r = httpx.get(f"{gw.base_url}/v1/nonexistent", timeout=30)
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "/v1/nonexistent" in err["message"]
    r = httpx.post(f"{gw.base_url}/v1/models", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError):
        client(gw).embeddings.create(model="default", input="x")


def test_cors_is_off_by_default(api_gateway):
    gw = api_gateway()
    r = httpx.options(f"{gw.base_url}/v1/chat/completions", timeout=30, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_answers_preflights_and_marks_replies_for_allowed_origins_only(api_gateway):
    gw = api_gateway(cors_origins=("https://app.example",), api_key="k")
    pre = httpx.options(f"{gw.base_url}/v1/chat/completions", timeout=30, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.get(f"{gw.base_url}/v1/models", timeout=30, headers={"Origin": "https://app.example",
                                                                   "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(f"{gw.base_url}/v1/chat/completions", timeout=30, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    page = httpx.get(f"{gw.base_url}/api/config", timeout=30, headers={"Origin": "https://app.example"})
    assert "access-control-allow-origin" not in page.headers  # only /v1 is opened
    assert json.loads(page.text)
