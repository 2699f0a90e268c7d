"""A reply's reasoning (``gateway/reasoning.py``): split from the answer on a whole
text and as it streams, declared by the engine from its chat template, kept whole in the
stored reply and out of the next turn's prompt, returned by the OpenAI API as
``reasoning_content``, passed through from an upstream that sends ``reasoning_content``,
and printed apart by the terminal client. The engine is a real process on a tiny random
model whose chat template thinks (``tiny_thinker_dir``: its replies are all reasoning)."""

from __future__ import annotations

import io

import httpx
import pytest

from gateway.client import ask, socket_url
from gateway.reasoning import ReasoningSplitter, ThinkMarkers, split_reasoning, without_reasoning
from gateway.store.sessions import plan_prefix
from tests.gateway_helpers import chat, openai_client

CASES = [
    ("<think>plan it</think>The answer.", ("plan it", "The answer.")),
    ("\n <think>\nstep 1\nstep 2\n</think>\n\nDone", ("step 1\nstep 2", "Done")),
    ("<think>cut while thinking", ("cut while thinking", "")),
    ("No reasoning here <think>x</think>", (None, "No reasoning here <think>x</think>")),
    ("<thin", (None, "<thin")),
    ("", (None, "")),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_a_whole_reply_splits_into_reasoning_and_answer(text, expected):
    assert split_reasoning(text) == expected


@pytest.mark.parametrize(("text", "expected"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_the_streamed_split_holds_back_markers_cut_across_deltas(text, expected, size):
    s = ReasoningSplitter()
    reasoning, answer = "", ""
    for i in range(0, len(text), size):
        r, a = s.feed(text[i:i + size])
        reasoning, answer = reasoning + r, answer + a
    r, a = s.finish()
    reasoning, answer = reasoning + r, answer + a
    want_reasoning, want_answer = expected
    assert answer == want_answer
    assert (reasoning.strip() if s.reasoned else None) == want_reasoning
    assert not s.in_reasoning or want_answer == ""


def test_other_markers_come_from_a_setting_and_past_replies_lose_their_reasoning():
    m = ThinkMarkers.parse("<|begin_of_thought|> <|end_of_thought|>")
    assert split_reasoning("<|begin_of_thought|>hm<|end_of_thought|>ok", m) == ("hm", "ok")
    with pytest.raises(ValueError):
        ThinkMarkers.parse("<think>")
    chat_ = [{"role": "user", "content": "<think>user text is kept</think>"},
             {"role": "assistant", "content": "<think>mine</think>Yes."}]
    assert without_reasoning(chat_) == [chat_[0], {"role": "assistant", "content": "Yes."}]


def test_the_next_prompt_does_not_replay_the_token_ids_of_a_reply_with_reasoning():
    stored = [{"id": "u1", "role": "user"}, {"id": "a1", "role": "assistant"}, {"id": "u2", "role": "user"}]
    plain = {"u1": {"ids": [1, 2], "base": True}, "a1": {"ids": [3]}}
    assert plan_prefix(stored, plain) == ([1, 2, 3], 3)
    thought = {"u1": {"ids": [1, 2], "base": True}, "a1": {"ids": [3], "reasoning": True}}
    assert plan_prefix(stored, thought) == ([1, 2], None)  # the next user turn is stored whole (a base)


def test_the_engine_declares_the_markers_of_a_template_that_thinks(tiny_thinker_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    from engine.prompt import PromptBuilder

    thinker = PromptBuilder(AutoTokenizer.from_pretrained(tiny_thinker_dir), 49152)
    assert thinker.thinking() == (["<think>", "</think>"], True)
    plain = PromptBuilder(AutoTokenizer.from_pretrained(tiny_model_dir), 49152)
    assert plain.thinking() == ([], False)


async def test_reasoning_is_stored_whole_timed_and_left_out_of_the_next_prompt(gateway_factory, thinker_gate):
    gw = gateway_factory(engine_urls=[thinker_gate.url])
    info = gw.state.router.info()
    assert info.think_markers == ["<think>", "</think>"] and info.think_in_prompt
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        first = await chat(ws, "Why is the sky blue?", max_tokens=10, ignore_eos=True)
        sid = first.start["session_id"]
        # the template opened the reasoning: the reply's text says so
        assert first.text.startswith("<think>") and split_reasoning(first.text)[1] == ""
        assert first.done["reasoning_ms"] >= 0
        second = await chat(ws, "And at sunset?", sid, max_tokens=4, ignore_eos=True)
    async with gw.http(cookie) as c:
        body = (await c.get(f"/api/sessions/{sid}")).json()
    assert body["messages"][1]["content"] == first.text
    assert body["messages"][1]["reasoning_ms"] == first.done["reasoning_ms"]
    sent = [f for f in thinker_gate.to_engine if f.get("type") == "generate"]
    assert len(sent) == 2
    assistant = [m for m in sent[1]["messages"] if m["role"] == "assistant"]
    assert assistant == [{"role": "assistant", "content": ""}]  # its reasoning was left out
    # and its token ids are not replayed: the prefix ends with the first turn's user message
    assert len(sent[1].get("prefix_token_ids") or []) <= first.done["usage"]["prompt_tokens"]
    assert second.done["usage"]["prompt_tokens"] < (first.done["usage"]["prompt_tokens"]
                                                    + first.done["usage"]["completion_tokens"] + 10)


def test_the_openai_api_returns_reasoning_content_streamed_and_whole(gateway_factory, thinker_engine):
    gw = gateway_factory(engine_urls=[thinker_engine.url])
    client = openai_client(gw)
    model = gw.state.router.info().model
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    message = whole.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert message.content == "" and reasoning
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    parts = [(c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in stream if c.choices]
    assert "".join(p for p in parts if p).strip() == reasoning


async def test_an_upstream_that_sends_reasoning_content_shows_it_as_reasoning(gateway_factory, thinker_gate):
    up = gateway_factory(engine_urls=[thinker_gate.url])  # our /v1 sends reasoning_content
    front = gateway_factory(engine_urls=[f"{up.base_url}/v1"])
    cookie = front.new_cookie()
    async with front.connect(cookie) as ws:
        r = await chat(ws, "Think first.", max_tokens=8, ignore_eos=True)
    assert r.error is None, r.error
    reasoning, answer = split_reasoning(r.text)
    assert r.text.startswith("<think>") and reasoning and answer == ""
    # the front's OpenAI API passes it on as reasoning_content, as the upstream's has it
    body = {"messages": [{"role": "user", "content": "Think first."}], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    got = []
    for gw in (up, front):
        async with httpx.AsyncClient(base_url=gw.base_url, timeout=60) as c:
            res = await c.post("/v1/chat/completions", json=body)
        assert res.status_code == 200, res.text
        got.append(res.json()["choices"][0]["message"])
    assert got[0]["reasoning_content"] and got[1]["reasoning_content"] == got[0]["reasoning_content"]
    assert got[1]["content"] == got[0]["content"] == ""


async def test_the_terminal_client_prints_reasoning_to_stderr_and_the_answer_to_stdout(
        gateway_factory, thinker_engine):
    gw = gateway_factory(engine_urls=[thinker_engine.url])
    out, err = io.StringIO(), io.StringIO()
    code = await ask(socket_url(gw.base_url), gw.new_cookie(), "Hello", params={"max_tokens": 6, "ignore_eos": True},
                     out=out, err=err)
    assert code == 0
    assert out.getvalue().strip() == ""  # all of this model's reply is reasoning
    assert "[thinking]" in err.getvalue() and "[thought for " in err.getvalue()
    quiet_out, quiet_err = io.StringIO(), io.StringIO()
    await ask(socket_url(gw.base_url), gw.new_cookie(), "Hello", params={"max_tokens": 6, "ignore_eos": True},
              out=quiet_out, err=quiet_err, show_reasoning=False)
    assert "[thinking]" not in quiet_err.getvalue()

