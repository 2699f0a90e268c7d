"""Multi-turn reuse: turn N+1 finds turn N's prompt and reply in the prefix cache."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.outputs import GenerateRequest
from tests.engine_helpers import collect, greedy, make_engine

USER_TURNS = ["Hi there!", "What is 2+2?", "Tell me about lighthouses.", "Why is the sky blue?", "Thanks, bye."]


async def _chat(eng, turns, *, use_prefix_ids: bool, tag: str, system: str = "You are helpful."):
    """Run a chat the way the gateway does; returns each turn's final output."""
    messages = [{"role": "system", "content": system}]
    history_ids: list[int] = []
    finals = []
    for n, user in enumerate(turns):
        messages.append({"role": "user", "content": user})
        req = GenerateRequest(f"{tag}{n}", messages=list(messages),
                              prefix_token_ids=list(history_ids) if use_prefix_ids and history_ids else None,
                              params=greedy(12))
        out = (await collect(eng, req)).final
        finals.append(out)
        messages.append({"role": "assistant", "content": out.output_text})
        history_ids = out.prompt_token_ids + out.output_token_ids
    return finals


@pytest.mark.parametrize("block_size", [16, 1])
async def test_five_turn_chat_reuses_previous_turn_and_matches_cache_off(tiny_model_dir, block_size, start_engine):
    on = start_engine(tiny_model_dir, block_size=block_size, num_blocks=4096 // block_size)
    off = start_engine(tiny_model_dir, block_size=block_size, num_blocks=4096 // block_size, enable_prefix_cache=False)
    with_cache = await _chat(on, USER_TURNS, use_prefix_ids=True, tag="on")
    without = await _chat(off, USER_TURNS, use_prefix_ids=True, tag="off")
    for prev, cur in zip(with_cache, with_cache[1:]):
        assert cur.prefix_reused
        assert cur.usage.cached_tokens >= prev.usage.prompt_tokens + prev.usage.completion_tokens - block_size
        assert cur.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
    assert [o.output_token_ids for o in with_cache] == [o.output_token_ids for o in without]
    assert all(o.usage.cached_tokens == 0 for o in without)


async def test_first_turn_prompt_equals_chat_template_with_one_bos(tiny_model_dir, start_engine):
    """One BOS (docs/acceptance.md#one-bos): the engine's ids equal apply_chat_template(tokenize=True); no doubled
    specials."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eng = start_engine(tiny_model_dir)
    chats = [
        [{"role": "user", "content": "Hello"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}],
    ]
    for i, msgs in enumerate(chats):
        out = (await collect(eng, GenerateRequest(f"c{i}", messages=msgs, params=greedy(1)))).final
        ref = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        assert out.prompt_token_ids == list(ref)
        specials = set(tok.all_special_ids)
        ids = out.prompt_token_ids
        assert not any(a == b and a in specials for a, b in zip(ids, ids[1:]))
        if tok.bos_token_id is not None and ids[0] == tok.bos_token_id:
            assert ids[1] != tok.bos_token_id


THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}"
)


async def test_template_rendering_history_differently_still_reuses_exact_ids(tiny_model_dir, start_engine):
    """Exact multi-turn token ids: the generation prompt has an empty think block that history drops;
    replaying the stored ids keeps turn 2's cache hit."""
    eng = make_engine(tiny_model_dir)
    eng.prompts.tokenizer.chat_template = THINK_TEMPLATE
    assert eng.prompts.lint_template(), "the lint must flag this template"
    start_engine(eng)
    finals = await _chat(eng, ["Hi", "What is 2+2?"], use_prefix_ids=True, tag="t")
    t1, t2 = finals
    ids1 = t1.prompt_token_ids + t1.output_token_ids
    assert t2.prefix_reused
    assert t2.prompt_token_ids[: len(ids1)] == ids1
    assert t2.usage.cached_tokens >= len(ids1) - 16


async def test_different_cache_salt_never_shares_kv(tiny_model_dir, start_engine):
    """Cache namespaces (docs/acceptance.md#cache-namespaces): blocks made under one namespace are invisible to
    another."""
    eng = start_engine(tiny_model_dir)
    msgs = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "List three colors."}]
    x = (await collect(eng, GenerateRequest("x", messages=msgs, params=greedy(8), cache_salt="X"))).final
    y = (await collect(eng, GenerateRequest("y", messages=msgs, params=greedy(8), cache_salt="Y"))).final
    x2 = (await collect(eng, GenerateRequest("x2", messages=msgs, params=greedy(8), cache_salt="X"))).final
    assert y.usage.cached_tokens == 0
    assert x2.usage.cached_tokens > 0
    assert x.output_token_ids == y.output_token_ids == x2.output_token_ids


async def test_a_declared_shared_prefix_hits_across_salts_and_nothing_private_does(tiny_model_dir, start_engine):
    """Per-user cache isolation (docs/reliability.md): with salts, only the pages of the
    declared-shared messages (and the template's own text) hit across salts; every page
    past them hits only for the same salt, for a chat and for a continued prompt of ids;
    a declaration that does not match the chat shares no text of it."""
    eng = start_engine(tiny_model_dir)
    bs = eng.info.block_size
    system = {"role": "system", "content": "You answer in one short sentence and never use lists. " * 3}
    msgs = [system, {"role": "user", "content": "My salary is 734215; is that a lot for a lighthouse keeper?"}]

    async def run(rid, salt, shared, **kw):
        req = GenerateRequest(rid, params=greedy(6), cache_salt=salt, shared_messages=shared, **kw)
        return (await collect(eng, req)).final

    a = await run("a", "A", [system], messages=msgs)
    n_shared = eng.prompts.shared_length(a.prompt_token_ids, [system])
    assert n_shared >= 2 * bs, "the test's system prompt spans whole pages"
    assert "734215" not in eng.prompts.tokenizer.decode(a.prompt_token_ids[:n_shared])
    b = await run("b", "B", [system], messages=msgs)
    assert b.usage.cached_tokens == n_shared // bs * bs  # the shared pages, not one more
    a2 = await run("a2", "A", [system], messages=msgs)
    assert a2.usage.cached_tokens == (len(a.prompt_token_ids) - 1) // bs * bs  # its own pages all hit
    assert a.output_token_ids == b.output_token_ids == a2.output_token_ids
    # a continued reply (a prompt of ids) finds its own chat, and another salt the shared part
    ids = a.prompt_token_ids + a.output_token_ids
    cont_a = await run("ca", "A", [system], prompt_token_ids=ids)
    cont_d = await run("cd", "D", [system], prompt_token_ids=ids)
    assert cont_a.usage.cached_tokens >= len(a.prompt_token_ids) // bs * bs
    assert cont_d.usage.cached_tokens == n_shared // bs * bs
    # declaring a message the chat does not start with shares no text of the chat
    other = [{"role": "system", "content": "Something else entirely. " * 8}]
    assert eng.prompts.shared_length(a.prompt_token_ids, other) < bs
    c = await run("c", "C", other, messages=msgs)
    assert c.usage.cached_tokens == 0


async def test_the_templates_default_system_prompt_is_shared_with_nothing_declared(tiny_model_dir, start_engine):
    """A chat without a system message: the template's own default system prompt (public
    text) is the shared part, so it hits across salts with no message declared."""
    eng = start_engine(tiny_model_dir, block_size=4, num_blocks=1024)
    msgs = [{"role": "user", "content": "A private question about my neighbour's garden."}]
    a = (await collect(eng, GenerateRequest("a", messages=msgs, params=greedy(4), cache_salt="A",
                                            shared_messages=[]))).final
    n_shared = eng.prompts.shared_length(a.prompt_token_ids, [])
    assert n_shared >= 4 and "neighbour" not in eng.prompts.tokenizer.decode(a.prompt_token_ids[:n_shared])
    b = (await collect(eng, GenerateRequest("b", messages=msgs, params=greedy(4), cache_salt="B",
                                            shared_messages=[]))).final
    assert b.usage.cached_tokens == n_shared // 4 * 4
