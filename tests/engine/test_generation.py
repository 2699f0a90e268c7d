"""Engine output correctness: greedy equals transformers, whatever the batch, cache or preemption."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.errors import InvalidRequestError
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from tests.engine_helpers import collect, first_divergence_is_a_near_tie, greedy, hf_greedy, run_all

PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away, there lived a",
    "1, 2, 3, 4,",
    "def fibonacci(n):\n    ",
    "Paris is the capital of",
]


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_hf(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


async def test_greedy_matches_transformers_alone_batched_and_cache_off(tiny_model_dir, tiny_tok, tiny_hf, start_engine):
    refs = [hf_greedy(tiny_hf, _ids(tiny_tok, p), 12) for p in PROMPTS]
    for cache in (True, False):
        for bs in (16, 1):
            eng = start_engine(tiny_model_dir, enable_prefix_cache=cache, block_size=bs, num_blocks=4096 // bs)
            alone = [await collect(eng, GenerateRequest(f"a{i}", _ids(tiny_tok, p), params=greedy(12)))
                     for i, p in enumerate(PROMPTS)]
            batched = await run_all(eng, [GenerateRequest(f"b{i}", _ids(tiny_tok, p), params=greedy(12))
                                          for i, p in enumerate(PROMPTS)])
            for ref, a, b in zip(refs, alone, batched):
                assert a.final.output_token_ids == ref, (cache, bs)
                assert b.final.output_token_ids == ref, (cache, bs)
            eng.shutdown()


async def test_preemption_keeps_greedy_output_when_pool_is_too_small(tiny_model_dir, tiny_tok, start_engine):
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 60))] for _ in range(8)]
    big = start_engine(tiny_model_dir, num_blocks=512)
    refs = [(await collect(big, GenerateRequest(f"r{i}", p, params=greedy(40)))).final.output_token_ids
            for i, p in enumerate(prompts)]
    big.shutdown()
    # 8 requests x up to 100 tokens need ~48 blocks of 16; give the pool 14.
    small = start_engine(tiny_model_dir, num_blocks=14, enable_prefix_cache=False)
    outs = await run_all(small, [GenerateRequest(f"s{i}", p, params=greedy(40)) for i, p in enumerate(prompts)])
    stats = await small.stats()
    assert stats["preemptions_total"] > 0
    assert [o.final.output_token_ids for o in outs] == refs
    assert all(o.final.finish_reason == "length" for o in outs)
    await small.call(lambda core: core.check_invariants())
    assert (await small.stats())["blocks_free"] == 14


async def test_repeated_cached_runs_and_cache_off_give_identical_tokens(tiny_model_dir, tiny_tok, start_engine):
    """Exact prefix reuse (docs/acceptance.md#exact-prefix-reuse): reused KV must be exact, run to run and against
    cache-off."""
    rng = random.Random(1)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    texts = ["".join(rng.choice(alphabet) for _ in range(200)) + " Repeat the first 20 characters."
             for _ in range(8)]
    prompts = [_ids(tiny_tok, t) for t in texts]

    async def run(eng, tag: str):
        return await run_all(eng, [GenerateRequest(f"{tag}{i}", p, params=greedy(16, logprobs=2))
                                   for i, p in enumerate(prompts)])

    cached = start_engine(tiny_model_dir, num_blocks=1024)
    run1 = await run(cached, "x")
    run2 = await run(cached, "y")
    assert all(o.final.usage.cached_tokens > 0 for o in run2)
    cached.shutdown()
    off = await run(start_engine(tiny_model_dir, enable_prefix_cache=False, num_blocks=1024), "z")
    for a, b, c in zip(run1, run2, off):
        assert a.final.output_token_ids == b.final.output_token_ids
        assert a.final.output_token_ids == c.final.output_token_ids


async def test_seeded_request_is_reproducible_beside_unseeded_neighbours(tiny_model_dir, tiny_tok, start_engine):
    """Seeded requests are reproducible (docs/acceptance.md#seeded-requests-are-reproducible)."""
    eng = start_engine(tiny_model_dir)
    a_ids, b_ids = _ids(tiny_tok, "The capital of France is"), _ids(tiny_tok, "The capital of Germany is")
    a_params = SamplingParams(max_tokens=16, temperature=0.8, seed=42, ignore_eos=True)
    solo = (await collect(eng, GenerateRequest("solo", a_ids, params=a_params))).final.output_token_ids
    for run in range(3):
        neighbours = [GenerateRequest(f"b{run}{k}", b_ids, params=SamplingParams(
            max_tokens=16 + k, temperature=0.8 + 0.1 * k, ignore_eos=True, repetition_penalty=1.0 + 0.2 * k))
            for k in range(3)]
        outs = await run_all(eng, [GenerateRequest(f"a{run}", a_ids, params=a_params), *neighbours])
        assert outs[0].final.output_token_ids == solo


async def test_sampling_edge_values_never_crash_and_tiny_top_p_is_greedy(tiny_model_dir, tiny_tok, start_engine):
    """Sampling edge values (docs/acceptance.md#sampling-edge-values): valid edge values work; invalid ones are
    refused before any work."""
    eng = start_engine(tiny_model_dir)
    ids = _ids(tiny_tok, "Name a fruit.")
    ref = (await collect(eng, GenerateRequest("g", ids, params=greedy(8)))).final.output_token_ids
    for i, kw in enumerate([dict(temperature=1.0, top_p=1e-8), dict(temperature=1e-6),
                            dict(temperature=1.0, top_k=1), dict(temperature=0.0, top_p=0.5)]):
        params = SamplingParams(max_tokens=8, ignore_eos=True, **kw)
        out = await collect(eng, GenerateRequest(f"e{i}", ids, params=params))
        assert out.final.output_token_ids == ref, kw
    out = await collect(eng, GenerateRequest("p1", ids, params=SamplingParams(max_tokens=8, top_p=1.0)))
    assert out.final.finished
    bad: list[dict[str, Any]] = [dict(top_p=0.0), dict(top_p=-0.1), dict(top_p=1.5), dict(temperature=-1.0),
                                 dict(max_tokens=0), dict(top_k=-5)]
    for kw in bad:
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kw)


async def test_high_temperature_streams_never_fail_to_encode(tiny_model_dir, tiny_tok, start_engine):
    """Valid UTF-8 always: whatever bytes come out, every delta and the final text encode as UTF-8."""
    eng = start_engine(tiny_model_dir)
    ids = _ids(tiny_tok, "Explain artificial intelligence in simple words.")
    params = SamplingParams(max_tokens=40, temperature=1.5, top_k=100, repetition_penalty=1.2, ignore_eos=True)
    outs = await run_all(eng, [GenerateRequest(f"h{i}", ids, params=params) for i in range(12)])
    for o in outs:
        for d in o.deltas:
            d.text.encode("utf-8")
        assert o.text == o.final.output_text
        o.final.output_text.encode("utf-8")


async def test_max_tokens_n_streams_exactly_n_tokens_and_final_frame_keeps_them(tiny_model_dir, tiny_tok, start_engine):
    """The finishing step's tokens are delivered (docs/acceptance.md#the-finishing-steps-tokens-are-delivered):
    tokens of the finishing step are delivered."""
    eng = start_engine(tiny_model_dir)
    ids = _ids(tiny_tok, "Say hi.")
    for n in (1, 7, 20):
        o = await collect(eng, GenerateRequest(f"m{n}", ids, params=greedy(n)))
        assert len(o.token_ids) == n == o.final.usage.completion_tokens
        assert o.final.finish_reason == "length"
        assert o.text == o.final.output_text


async def test_the_first_delta_states_the_prompts_tokens_and_no_later_one_does(tiny_model_dir, tiny_tok,
                                                                                start_engine):
    eng = start_engine(tiny_model_dir)
    ids = _ids(tiny_tok, " ".join(PROMPTS * 3))  # several whole pages, which the second run finds cached
    first = await collect(eng, GenerateRequest("u1", ids, params=greedy(6)))
    again = await collect(eng, GenerateRequest("u2", ids, params=greedy(6)))  # its prompt now cached
    for o in (first, again):
        with_tokens = [d for d in o.deltas if d.token_ids and not d.finished]
        assert with_tokens[0].prompt_usage is not None
        assert with_tokens[0].prompt_usage.prompt_tokens == len(ids) == o.final.usage.prompt_tokens
        assert with_tokens[0].prompt_usage.cached_tokens == o.final.usage.cached_tokens
        assert all(d.prompt_usage is None for d in o.deltas[1:])
    assert again.final.usage.cached_tokens > 0


@pytest.mark.slow
async def test_smollm2_answers_capital_of_france_like_transformers(smollm2_dir, start_engine):
    eng = start_engine(smollm2_dir, num_blocks=512)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    o = await collect(eng, GenerateRequest("f", messages=msgs, params=SamplingParams(max_tokens=24, temperature=0)))
    assert o.final.finish_reason == "stop"
    assert "Paris" in o.final.output_text
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    prompt = o.final.prompt_token_ids
    ref = hf_greedy(hf, prompt, len(o.final.output_token_ids))
    assert o.final.output_token_ids == ref
    assert o.final.output_text == tok.decode(ref, skip_special_tokens=True)


async def test_greedy_output_does_not_depend_on_staggered_neighbours(tiny_model_dir, tiny_tok, start_engine):
    """Batch-invariant greedy output (docs/acceptance.md#batch-invariant-greedy-output): P alone N times is
    identical; P beside 7 staggered prompts of
    50-600 tokens matches per the policy (here, exactly on float32)."""
    eng = start_engine(tiny_model_dir, num_blocks=1024, max_num_batched_tokens=128)
    rng = random.Random(4)
    p_ids = _ids(tiny_tok, "Explain in three sentences why the sky appears blue.")
    async def solo(tag):
        c = await collect(eng, GenerateRequest(tag, p_ids, params=greedy(24, logprobs=2)))
        c.final.logprobs_all = [lp for d in c.deltas for lp in (d.logprobs or [])]
        return c.final

    refs = [await solo(f"s{i}") for i in range(3)]
    assert all(r.output_token_ids == refs[0].output_token_ids for r in refs)
    for run in range(3):
        async def neighbour(k, run=run):
            await asyncio.sleep(0.01 * k * (run + 1))
            ids = [rng.randrange(100, 40000) for _ in range(rng.randrange(50, 600))]
            return await collect(eng, GenerateRequest(f"n{run}.{k}", ids, params=greedy(rng.randrange(4, 30))))

        outs = await asyncio.gather(solo(f"p{run}"), *(neighbour(k) for k in range(7)))
        assert first_divergence_is_a_near_tie(refs[0], outs[0])


def test_seed_outside_the_64_bit_range_is_refused_up_front_and_minus_one_means_random():
    for seed in (-(2**63) - 1, 2**64, 2**70, True, 1.5):
        with pytest.raises(InvalidRequestError, match="seed"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-7).seed == -7 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=-1).seed is None  # OpenAI clients send -1 for "random"


def test_ranges_table_is_what_validation_enforces():
    """RANGES is the one source other layers read: each bound is accepted and just past it
    refused (open bounds at 0 for top_p and repetition_penalty)."""
    from engine.sampling_params import RANGES

    for name, (lo, hi) in RANGES.items():
        if name == "seed":
            continue
        step = 1 if isinstance(lo, int) and not isinstance(lo, bool) else 1e-3
        open_lo = name in ("top_p", "repetition_penalty")
        if lo is not None:
            if not open_lo:
                SamplingParams(**{name: lo})
            with pytest.raises(InvalidRequestError):
                SamplingParams(**{name: lo - step if not open_lo else lo})
        if hi is not None:
            SamplingParams(**{name: hi})
            with pytest.raises(InvalidRequestError):
                SamplingParams(**{name: hi + step})


async def test_abort_while_the_prompt_is_being_built_stops_the_request_before_it_runs(tiny_model_dir, start_engine):
    """Stop frees the engine, the queued case: an abort that arrives during tokenization is not lost."""
    eng = start_engine(tiny_model_dir)
    msgs = [{"role": "user", "content": "word " * 1400}]
    req = GenerateRequest("early", messages=msgs, params=SamplingParams(max_tokens=500, ignore_eos=True))
    task = asyncio.create_task(collect(eng, req))
    await asyncio.sleep(0)  # registered, prompt building in the executor
    eng.abort("early")
    out = await asyncio.wait_for(task, 60)
    assert out.final.finish_reason == "abort"
    assert out.final.usage.completion_tokens == 0
    s = await eng.stats()
    assert s["running"] == 0 and s["waiting"] == 0 and s["blocks_held_by_requests"] == 0
