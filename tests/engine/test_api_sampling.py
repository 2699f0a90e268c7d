"""What the OpenAI-style APIs need of the engine beyond text, on the tiny random Llama
(float32, exact): logprobs that are the model's own distribution (checked against
transformers) and name their tokens, logit_bias, n choices that share one prefill and
keep their own seed streams, prompt logprobs (echo), raw text prompts, and continuing a
final assistant message."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.server import logprob_dicts, prompt_logprob_dicts
from tests.engine_helpers import collect, make_engine, run_all, run_core


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir)


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@torch.inference_mode()
def test_logprobs_are_the_models_distribution_and_sum_to_the_replys_likelihood(engine, tiny_model_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = engine.prompts.render_ids(_chat("Tell me about the sea."))
    # sampled (temperature 1, top_k 50): the reported distribution is the raw model's, not the filtered one
    engine.core.add_request("lp", prompt, SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=9,
                                                         logprobs=20, ignore_eos=True))
    steps = []
    while engine.core.has_work():
        steps += [o for o in engine.core.step() if o.request_id == "lp"]
    out = [lp for o in steps for lp in (o.logprobs or [])]
    ids = steps[-1].output_token_ids
    assert [lp.token_id for lp in out] == ids
    ref = torch.log_softmax(hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float(), dim=-1)
    for i, lp in enumerate(out):
        assert lp.logprob == pytest.approx(float(ref[i, ids[i]]), abs=2e-3)
        assert len(lp.top) == 20 and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        top_ref = torch.topk(ref[i], 20)
        assert [v for _, v in lp.top] == pytest.approx(top_ref.values.tolist(), abs=2e-3)
        assert lp.logprob <= lp.top[0][1] + 1e-6
        if lp.token_id in dict(lp.top):
            assert dict(lp.top)[lp.token_id] == pytest.approx(lp.logprob, abs=1e-6)
    total = sum(lp.logprob for lp in out)
    assert total == pytest.approx(float(ref[torch.arange(len(ids)), torch.tensor(ids)].sum()), abs=1e-2)


def test_logprob_entries_name_tokens_with_their_text_and_bytes(engine, tok):
    engine.core.add_request("named", engine.prompts.render_ids(_chat("Héllo, 世界")),
                            SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True))
    final = run_core(engine.core)["named"]
    ids = final.output_token_ids
    engine.core.add_request("again", engine.prompts.render_ids(_chat("Héllo, 世界")),
                            SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True))
    outs = []
    while engine.core.has_work():
        outs += [o for o in engine.core.step() if o.request_id == "again"]
    wire = logprob_dicts([lp for o in outs for lp in (o.logprobs or [])], engine.core.vocab)
    assert [w["token_id"] for w in wire] == ids
    assert b"".join(bytes(w["bytes"]) for w in wire) == tok.decode(ids).encode()
    for w in wire:
        assert w["token"] == bytes(w["bytes"]).decode("utf-8", "backslashreplace")
        assert w["top"][0]["token_id"] == w["token_id"]  # greedy: the sampled token is the top one


def test_logit_bias_bans_and_forces_tokens(engine):
    prompt = engine.prompts.render_ids(_chat("Pick a word."))
    engine.core.add_request("g", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    first = run_core(engine.core)["g"].output_token_ids[0]
    engine.core.add_request("ban", prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                          logit_bias={first: -100}))
    engine.core.add_request("force", prompt, SamplingParams(max_tokens=4, temperature=0.7, seed=1, ignore_eos=True,
                                                            logit_bias={1234: 100}))
    got = run_core(engine.core)
    assert first not in got["ban"].output_token_ids
    assert got["force"].output_token_ids == [1234] * 4


async def test_n_choices_share_one_prefill_and_keep_their_own_seed_streams(tiny_model_dir, start_engine):
    eng = start_engine(tiny_model_dir)  # 256-token steps: the 400-token prompt is read in two
    text = " ".join(f"item {i} is number {i * 7 % 13};" for i in range(60))
    chat = _chat(f"{text} Summarise.")

    async def choices(tag: str, params: SamplingParams, n: int = 4):
        return await run_all(eng, [GenerateRequest(f"{tag}{i}", messages=chat, params=params.for_choice(i))
                                   for i in range(n)])

    greedy = await choices("g", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    prompt_len = greedy[0].final.usage.prompt_tokens
    assert prompt_len > 256
    assert len({tuple(c.final.output_token_ids) for c in greedy}) == 1
    computed = sum(c.final.usage.prompt_tokens - c.final.usage.cached_tokens for c in greedy)
    assert computed <= prompt_len + 3 * 16, (computed, prompt_len)  # the prompt once, plus a last page each
    seeded = await choices("s", SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True))
    assert len({tuple(c.final.output_token_ids) for c in seeded}) == 4
    again = await choices("t", SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True))
    assert [c.final.output_token_ids for c in again] == [c.final.output_token_ids for c in seeded]
    unseeded = await choices("u", SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    assert len({tuple(c.final.output_token_ids) for c in unseeded}) == 4


def test_n_choices_that_arrive_together_compute_the_prompt_once(engine):
    """In-batch prefix caching in the scheduler: choices admitted in one step wait for the
    first one's prefill to reach the tree instead of computing the same pages."""
    text = " ".join(f"row {i}: {i * i}" for i in range(90))
    prompt = engine.prompts.render_ids(_chat(text))
    for i in range(6):
        engine.core.add_request(f"n{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0).for_choice(i))
    computed = 0
    for o in run_core(engine.core).values():
        computed += o.usage.prompt_tokens - o.usage.cached_tokens
    assert len(prompt) > 256 and computed <= len(prompt) + 5 * 16, (computed, len(prompt))


def test_a_raw_text_prompt_is_tokenized_without_a_template(engine, tok):
    ids, reused = engine.prompts.build(GenerateRequest("raw", prompt="Once upon a time"))
    assert ids == tok.encode("Once upon a time") and not reused
    with pytest.raises(Exception, match="exactly one"):
        engine.prompts.build(GenerateRequest("both", prompt="x", prompt_token_ids=[1]))


def test_a_final_assistant_message_is_continued_not_answered(engine, tok):
    chat = _chat("Name a colour.") + [{"role": "assistant", "content": "My favourite colour is"}]
    cont, _ = engine.prompts.build(GenerateRequest("c", messages=chat, continue_final_message=True))
    text = tok.decode(cont)
    assert text.endswith("<|im_start|>assistant\nMy favourite colour is")
    answered = tok.decode(engine.prompts.build(GenerateRequest("a", messages=chat))[0])
    assert answered.endswith("My favourite colour is<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(Exception, match="last message"):
        engine.prompts.build(GenerateRequest("x", messages=_chat("hi"), continue_final_message=True))


async def test_continuing_a_greedy_reply_gives_the_rest_of_it(tiny_model_dir, start_engine, tok):
    """Greedy 6 tokens then 6 more continuing them equal greedy 12 at once (exact ids
    reused through prefix_token_ids, as the gateway sends them)."""
    eng = start_engine(tiny_model_dir)
    chat = _chat("Count with me.")
    whole = (await collect(eng, GenerateRequest("w", messages=chat, params=SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True)))).final
    first = (await collect(eng, GenerateRequest("f", messages=chat, params=SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True)))).final
    cont = chat + [{"role": "assistant", "content": first.output_text}]
    rest = (await collect(eng, GenerateRequest(
        "r", messages=cont, continue_final_message=True,
        prefix_token_ids=first.prompt_token_ids + first.output_token_ids,
        params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))).final
    assert rest.prefix_reused
    assert first.output_token_ids + rest.output_token_ids == whole.output_token_ids


@torch.inference_mode()
def test_prompt_logprobs_score_every_prompt_token_even_when_the_prompt_is_cached(engine, tiny_model_dir):
    """The completions API's echo with logprobs: a prompt longer than a step's budget (two
    chunks), already in the prefix cache, is computed again for its logits; each prompt
    token gets the model's own log-probability given the tokens before it."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = engine.prompts.encode_text(" ".join(f"line {i} says {i % 7}" for i in range(70)))
    assert len(prompt) > 256
    engine.core.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    run_core(engine.core)
    engine.core.add_request("echo", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=5))
    outs = []
    while engine.core.has_work():
        outs += [o for o in engine.core.step() if o.request_id == "echo"]
    got = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(got) == 1 and outs[-1].usage.cached_tokens == 0  # once; and no cache hit
    lps = got[0]
    assert [lp.token_id for lp in lps] == prompt and lps[0].top == []
    ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert [lp.logprob for lp in lps[1:]] == pytest.approx(want.tolist(), abs=2e-3)
    for i, lp in enumerate(lps[1:]):
        assert [t for t, _ in lp.top] == torch.topk(ref[i], 5).indices.tolist() or \
            [v for _, v in lp.top] == pytest.approx(torch.topk(ref[i], 5).values.tolist(), abs=2e-3)
    wire = prompt_logprob_dicts(lps, engine.core.vocab)
    assert wire[0]["logprob"] is None and wire[1]["logprob"] == lps[1].logprob
    engine.core.add_request("after", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    assert run_core(engine.core)["after"].usage.cached_tokens >= 256  # the cache still serves it
