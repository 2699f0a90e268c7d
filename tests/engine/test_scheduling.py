"""Scheduler behaviour on the real model runner: accounting, aborts, fairness, limits."""

from __future__ import annotations

import random

import pytest

from engine.errors import ContextLengthError
from tests.engine_helpers import greedy, make_engine, run_core


@pytest.fixture
def core(tiny_model_dir):
    eng = make_engine(tiny_model_dir, num_blocks=512, max_num_batched_tokens=128, max_num_seqs=64)
    return eng.core


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_shared_system_prompt_drains_to_exact_accounting(core):
    """Block accounting (docs/acceptance.md#block-accounting): after a shared-prefix burst drains, free + evictable
    == total exactly,
    evicting everything frees every block, and the engine still serves."""
    rng = random.Random(3)
    system = _tokens(rng, 300)
    for i in range(32):
        core.add_request(f"q{i}", system + _tokens(rng, rng.randrange(5, 40)), greedy(8))
    finals = run_core(core)
    assert len(finals) == 32
    core.check_invariants()
    s = core.stats()
    assert s["blocks_free"] + s["blocks_evictable"] == s["num_blocks"]
    assert s["blocks_cached"] == s["blocks_evictable"]
    # The shared prefix was computed once or a few times, not 32 times.
    cached = sum(f.usage.cached_tokens for f in finals.values() if f.usage is not None)
    assert cached >= 20 * 288
    core.evict_all()
    assert core.pool.num_free == core.pool.num_blocks
    core.add_request("ok", _tokens(rng, 5), greedy(3))
    assert run_core(core)["ok"].usage.completion_tokens == 3


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_aborts_at_random_moments_leak_no_blocks(core, seed):
    """Abort before prefill, mid-prefill and mid-decode: every block comes back."""
    rng = random.Random(seed)
    shared = _tokens(rng, 64)
    live: list[str] = []
    for step in range(60):
        if step < 30 and rng.random() < 0.6:
            rid = f"r{step}"
            n = rng.choice([10, 50, 300])  # 300 > budget: chunked prefill, so mid-prefill aborts happen
            core.add_request(rid, (shared if rng.random() < 0.5 else []) + _tokens(rng, n),
                             greedy(rng.randrange(1, 20)))
            live.append(rid)
        if live and rng.random() < 0.3:
            rid = live.pop(rng.randrange(len(live)))
            core.abort(rid)
        for out in core.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        core.check_invariants()
    for rid in live:
        core.abort(rid)
    run_core(core)
    core.check_invariants()
    assert core.pool.num_free + core.cache.num_evictable_blocks == core.pool.num_blocks
    core.evict_all()
    assert core.pool.num_free == core.pool.num_blocks


def test_running_decode_gets_a_token_every_step_while_long_prompts_keep_arriving(core):
    """No decode starvation: chunked prefill never starves a running decode, and the prompts finish too."""
    rng = random.Random(5)
    core.add_request("R", _tokens(rng, 10), greedy(60))
    got_token_at: list[int] = []
    finished: set[str] = set()
    for step in range(200):
        if step < 40:
            core.add_request(f"p{step}", _tokens(rng, 400), greedy(4))
        for out in core.step():
            if out.request_id == "R" and out.token_ids:
                got_token_at.append(step)
            if out.finished:
                finished.add(out.request_id)
        if not core.has_work():
            break
    gaps = [b - a for a, b in zip(got_token_at, got_token_at[1:])]
    assert "R" in finished and len(got_token_at) >= 2
    assert max(gaps) <= 2, gaps
    assert {f"p{i}" for i in range(40)} <= finished


def test_context_boundaries_are_enforced_and_engine_keeps_serving(tiny_model_dir):
    """Context overflow is refused, never truncated: L-1 + 1 works; L + 1, and prompt + max_tokens = L + 1, are refused
    before any work; nothing is truncated."""
    eng = make_engine(tiny_model_dir, max_model_len=64, num_blocks=64)
    core = eng.core
    rng = random.Random(9)
    core.add_request("fits", _tokens(rng, 63), greedy(1))
    assert run_core(core)["fits"].usage.prompt_tokens == 63
    with pytest.raises(ContextLengthError):
        core.add_request("over", _tokens(rng, 64), greedy(1))
    with pytest.raises(ContextLengthError):
        core.add_request("sum", _tokens(rng, 60), greedy(5))
    assert not core.has_work()
    core.add_request("after", _tokens(rng, 10), greedy(2))
    assert run_core(core)["after"].usage.completion_tokens == 2


def test_request_larger_than_the_kv_pool_is_refused_at_once(tiny_model_dir):
    eng = make_engine(tiny_model_dir, num_blocks=4, block_size=16)
    with pytest.raises(ContextLengthError):
        eng.core.add_request("huge", list(range(100, 170)), greedy(1))
    eng.core.add_request("small", list(range(100, 110)), greedy(3))
    assert run_core(eng.core)["small"].usage.completion_tokens == 3


def test_long_prompt_is_prefilled_in_chunks_within_the_budget(core):
    core.add_request("long", list(range(100, 600)), greedy(2))
    steps = 0
    while core.has_work():
        sched_tokens_before = core.counters.steps_total
        core.step()
        steps += 1
        assert core.counters.steps_total == sched_tokens_before + 1
    assert steps == 4 + 1  # ceil(500 / 128) prefill steps, then one decode step


def test_longest_prefix_match_policy_admits_cache_hits_first(tiny_model_dir):
    eng = make_engine(tiny_model_dir, schedule_policy="lpm", max_num_seqs=1, num_blocks=256)
    core = eng.core
    rng = random.Random(2)
    prefix = _tokens(rng, 64)
    core.add_request("warm", prefix + _tokens(rng, 4), greedy(1))
    run_core(core)
    core.add_request("cold", _tokens(rng, 60), greedy(1))
    core.add_request("hit", prefix + _tokens(rng, 4), greedy(1))
    first = None
    while core.has_work():
        for out in core.step():
            if out.finished and first is None:
                first = out.request_id
    assert first == "hit"


async def test_clamp_max_tokens_lowers_the_reply_budget_but_never_truncates_the_prompt(tiny_model_dir, start_engine):
    from engine.outputs import GenerateRequest
    from tests.engine_helpers import collect

    eng = start_engine(tiny_model_dir, max_model_len=64, num_blocks=64)
    ids = list(range(100, 160))  # 60 tokens: room for 4
    out = await collect(eng, GenerateRequest("c", ids, params=greedy(50), clamp_max_tokens=True))
    assert out.final.finish_reason == "length" and out.final.usage.completion_tokens == 4
    assert out.final.usage.prompt_tokens == 60
    with pytest.raises(ContextLengthError):
        await collect(eng, GenerateRequest("n", ids, params=greedy(50)))
    with pytest.raises(ContextLengthError):  # a prompt of the whole context has no room at all
        await collect(eng, GenerateRequest("f", list(range(100, 164)), params=greedy(5), clamp_max_tokens=True))


def _record_batches(core) -> list[list[tuple[str, int]]]:
    """Wrap ``core.scheduler.schedule`` to record every batch as (request id, tokens)."""
    batches: list[list[tuple[str, int]]] = []
    schedule = core.scheduler.schedule

    def recording():
        batch = schedule()
        batches.append([(item.request.request_id, item.num_new) for item in batch.items])
        return batch

    core.scheduler.schedule = recording
    return batches


def test_every_step_stays_within_the_token_budget_counting_running_decodes(core):
    """No decode starvation (docs/acceptance.md#no-decode-starvation) needs steps of bounded size: a 500-token
    prompt at budget 128 is prefilled in chunks of exactly 128, 128, 128, 116; beside a
    running decode, that decode's token counts in the same budget (127-token chunks)."""
    budget = core.scheduler.config.max_num_batched_tokens
    assert budget == 128
    batches = _record_batches(core)
    core.add_request("alone", list(range(100, 600)), greedy(2))
    run_core(core)
    assert [n for b in batches for rid, n in b if rid == "alone"] == [128, 128, 128, 116, 1]

    batches.clear()
    core.add_request("decode", list(range(700, 710)), greedy(40))
    core.step()  # its 10-token prefill; from now on it decodes one token a step
    core.add_request("long", list(range(1000, 1500)), greedy(2))
    run_core(core)
    for b in batches:
        assert sum(n for _, n in b) <= budget, b
    assert [n for b in batches for rid, n in b if rid == "long"] == [127, 127, 127, 119, 1]
    with_long = [dict(b) for b in batches if "long" in dict(b)]
    assert all(b.get("decode") == 1 for b in with_long)  # the decode ran in every one of those steps


def test_a_broken_invariant_is_counted_in_stats_and_logged_once_with_the_state(core, caplog):
    import logging

    from engine.errors import InvariantError

    core.check_invariants()
    assert core.stats()["invariant_failures_total"] == 0
    victim = core.pool.allocate(1)[0]
    core.pool._free.append(victim)  # the same block both referenced and free: a bug
    with caplog.at_level(logging.ERROR, logger="engine.engine_core"):
        for _ in range(3):
            with pytest.raises(InvariantError):
                core.check_invariants()
    assert core.stats()["invariant_failures_total"] == 3
    logged = [r.getMessage() for r in caplog.records if "invariant failed" in r.getMessage()]
    assert len(logged) == 1 and "blocks_free" in logged[0], logged


def test_prompts_sharing_a_document_in_flight_wait_for_its_pages_instead_of_computing_them_again(tiny_model_dir):
    """Chats that open with one document, arriving together: the first computes it,
    the others wait until its pages are in the tree and read them from there, while a
    prompt sharing nothing is admitted at once."""
    core = make_engine(tiny_model_dir, num_blocks=512, max_num_batched_tokens=512, max_num_seqs=64).core
    rng = random.Random(11)
    doc = _tokens(rng, 200)  # 12 whole pages of 16; one step's budget holds every prompt
    prompts = {f"d{i}": doc + _tokens(rng, 10) for i in range(4)}
    prompts["other"] = _tokens(rng, 40)
    for rid, ids in prompts.items():
        core.add_request(rid, ids, greedy(4))
    finals = {o.request_id: o for o in core.step() if o.finished}
    assert {r.request_id for r in core.scheduler.running} == {"d0", "other"}  # d1..d3 wait for d0's pages
    assert {r.request_id for r in core.scheduler.waiting} == {"d1", "d2", "d3"}
    finals.update(run_core(core))
    cached = {rid: f.usage.cached_tokens for rid, f in finals.items()}
    assert cached["d0"] == 0 and cached["other"] == 0
    assert all(cached[f"d{i}"] == 12 * 16 for i in (1, 2, 3))
    assert all(f.usage.completion_tokens == 4 for f in finals.values())
    assert core.scheduler.num_deferred == 3
    core.check_invariants()
