"""bench/routing_sim.py: the simulation on a tiny fleet (4 engines, 60 users, a few
simulated minutes) keeps its books, routes with the real code, and is reproducible."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from bench.routing_sim import (
    CPU_COSTS,
    PolicySpec,
    SimConfig,
    Workload,
    interp,
    parse_policies,
    run_now,
    run_sim,
)

ROOT = Path(__file__).resolve().parents[2]

# a shared-document workload: most chats open with one of two long documents
TINY = SimConfig(engines=4, workload=Workload(users=60, doc_share=0.8, docs=2), costs=CPU_COSTS,
                 load=0.5, duration_s=240.0, warmup_s=60.0, seed=3)


def _run(policy: str, load_tokens: float = 16.0, first_turn_ids: bool = True, **changes: object):
    return run_sim(replace(TINY, spec=PolicySpec(policy, load_tokens, first_turn_ids), **changes))


@pytest.mark.parametrize("policy", ["random", "round_robin", "hash", "sticky", "cache_aware"])
def test_every_request_finishes_exactly_once_and_ratios_are_ratios(policy):
    r = _run(policy)
    assert r.requests > 50
    assert r.finished_once
    assert 0.0 <= r.hit_ratio <= r.bound_hit_ratio <= 1.0
    assert 0.0 < r.busy_share <= 1.0
    assert r.ttft_p50_s <= r.ttft_p99_s


def test_cache_aware_hits_at_least_as_much_as_hashing_on_shared_documents():
    # with the engines' tokenizer a first turn goes where its document is; without it,
    # where load says, and later turns stay with their history: close to hashing
    hashed = _run("hash").hit_ratio
    assert _run("cache_aware").hit_ratio >= hashed
    assert _run("cache_aware", first_turn_ids=False).hit_ratio >= hashed - 0.01


def test_cache_aware_without_load_weight_keeps_every_chat_where_hashing_puts_it():
    # no load weight and no first-turn ids: a new chat matches nothing and ties go to its
    # rendezvous home; a later turn matches most at that home; so the real rule
    # reproduces hashing's hits exactly
    aware, hashed = _run("cache_aware", load_tokens=0.0, first_turn_ids=False), _run("hash")
    assert aware.cached_tokens == hashed.cached_tokens and aware.prompt_tokens == hashed.prompt_tokens


def test_the_same_seed_gives_the_same_result_and_another_seed_another():
    a, b = _run("cache_aware"), _run("cache_aware")
    skip = {"route_cpu_us", "apply_cpu_us_per_frame", "sim_wall_s"}  # CPU times
    assert {k: v for k, v in vars(a).items() if k not in skip} == {k: v for k, v in vars(b).items() if k not in skip}
    assert _run("cache_aware", seed=4).cached_tokens != a.cached_tokens


def test_the_prefix_index_never_exceeds_its_bound_and_forgets_what_it_must():
    r = _run("cache_aware", max_index_pages=300)
    assert r.index_within_bound
    assert r.index_pages_peak <= 300
    assert r.index_dropped_pages > 0
    assert r.finished_once


def test_only_placement_policies_talk_to_redis_and_cache_aware_feeds_its_index():
    assert _run("hash").redis_ops_per_request == 0
    aware = _run("cache_aware")
    assert aware.redis_ops_per_request >= 1  # one GET per request at least
    assert aware.index_pages_peak > 0 and aware.kv_frames_per_s > 0


def test_a_pool_too_small_for_the_longest_chat_is_refused():
    with pytest.raises(ValueError):
        run_sim(replace(TINY, costs=replace(CPU_COSTS, kv_pages=100)))


def test_interpolation_is_linear_between_points_and_beyond_the_last():
    pts = ((1, 10.0), (3, 30.0))
    assert interp(pts, 0) == 10.0
    assert interp(pts, 2) == 20.0
    assert interp(pts, 5) == 50.0


def test_policy_names_parse_and_unknown_ones_are_refused():
    specs = parse_policies("hash,cache_aware:64,cache_aware-noids:1024")
    assert [s.label for s in specs] == ["hash", "cache_aware w=64", "cache_aware w=1024, no tokenizer"]
    with pytest.raises(ValueError):
        parse_policies("fastest")


def test_a_coroutine_that_suspends_is_refused():
    async def suspends() -> None:
        import asyncio
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError):
        run_now(suspends())


def test_the_script_runs_and_prints_its_tables():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "routing_sim.py"), "--engines", "4", "--users", "40",
                          "--duration", "60", "--warmup", "30", "--policies", "hash,cache_aware:16",
                          "--decision-engines", "8"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "| cache_aware w=16 |" in out and "| hash |" in out
    assert "decision at 8 engines" in out
