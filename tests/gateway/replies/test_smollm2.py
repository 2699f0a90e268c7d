"""One end-to-end chat on the real SmolLM2-135M-Instruct through the gateway."""

from __future__ import annotations

import pytest

from gateway.api.auth import UserIds
from tests.gateway_helpers import chat

pytestmark = pytest.mark.slow


async def test_smollm2_answers_and_reuses_the_first_turn_in_the_second(gateway_factory, smollm2_engine_url):
    gw = gateway_factory(engine_urls=[smollm2_engine_url])
    cookie = gw.new_cookie()
    async with gw.connect(cookie) as ws:
        one = await chat(ws, "What is the capital of France?", max_tokens=24, timeout=300)
        assert one.done is not None, one.error
        assert "Paris" in one.text
        sid = one.start["session_id"]
        two = await chat(ws, "And of Italy?", sid, max_tokens=24, timeout=300)
        assert two.done is not None, two.error
    u1, u2 = one.done["usage"], two.done["usage"]
    assert u2["cached_tokens"] >= u1["prompt_tokens"] + u1["completion_tokens"] - 16
    uid = UserIds(gw.config.secret_key).verify(cookie)
    msgs = gw.run(gw.state.store.messages(uid, sid, with_tokens=True))
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 2
    assert not any(m["tokens_base"] for m in msgs[1:])  # turn 2 extended turn 1's exact ids
    assert sum(len(m["token_ids"]) for m in msgs[:3]) == u2["prompt_tokens"]
