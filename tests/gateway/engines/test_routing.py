"""The routing rules (gateway/engines/routing.py) as pure functions of fake snapshots: cache_aware
(matched share of the prompt against load), and sticky (home by placement or rendezvous
hashing, shedding by SGLang's imbalance test)."""

from __future__ import annotations

import pytest

from gateway.engines.routing import (
    EngineLoad,
    RoutingPolicy,
    choose,
    choose_cache_aware,
    rendezvous_rank,
    snapshot_load,
)

URLS = ["ws://a:1", "ws://b:2", "ws://c:3"]
POLICY = RoutingPolicy(abs_threshold=4, rel_threshold=1.5)


def home_of(key: str, urls: list[str] = URLS) -> str:
    return max(urls, key=lambda u: rendezvous_rank(key, u))


def loads(**by_url: int) -> list[EngineLoad]:
    return [EngineLoad(u, by_url.get(u[5], 0)) for u in URLS]


def test_idle_engines_keep_every_chat_on_its_rendezvous_home_and_spread_them():
    keys = [f"chat-{i}" for i in range(300)]
    chosen = [choose(k, loads(), POLICY) for k in keys]
    assert chosen == [home_of(k) for k in keys]
    assert all(60 < chosen.count(u) < 140 for u in URLS)


def test_a_home_loaded_beyond_both_thresholds_sheds_to_the_least_loaded_engine():
    key = next(k for k in (f"k{i}" for i in range(100)) if home_of(k) == "ws://a:1")
    # a: 10 requests, b: 2, c: 5 -> 10 - 2 > 4 and 10 > 1.5 * 2
    assert choose(key, [EngineLoad("ws://a:1", 10), EngineLoad("ws://b:2", 2), EngineLoad("ws://c:3", 5)],
                  POLICY) == "ws://b:2"


@pytest.mark.parametrize(("home_load", "least_load", "sheds"), [
    (4, 0, False),  # difference 4 is not above the absolute threshold
    (5, 0, True),
    (9, 5, False),  # difference 4
    (10, 5, True),  # 5 > 4 and 10 > 7.5
    (30, 24, False),  # 6 > 4 but 30 is not above 1.5 * 24
    (37, 24, True),
])
def test_shedding_needs_both_the_absolute_and_the_relative_gap(home_load, least_load, sheds):
    key = next(k for k in (f"k{i}" for i in range(100)) if home_of(k, URLS[:2]) == "ws://a:1")
    got = choose(key, [EngineLoad("ws://a:1", home_load), EngineLoad("ws://b:2", least_load)], POLICY)
    assert (got == "ws://b:2") == sheds


def test_a_placement_is_the_home_while_it_is_healthy_and_not_overloaded():
    key = next(k for k in (f"k{i}" for i in range(100)) if home_of(k) == "ws://a:1")
    assert choose(key, loads(), POLICY, placement="ws://c:3") == "ws://c:3"
    assert choose(key, loads(c=9), POLICY, placement="ws://c:3") != "ws://c:3"  # it sheds in turn
    gone = [EngineLoad("ws://a:1", 0), EngineLoad("ws://b:2", 0)]  # c is down: back to hashing
    assert choose(key, gone, POLICY, placement="ws://c:3") == "ws://a:1"


def test_snapshot_load_is_running_plus_waiting_unless_stale_or_below_the_local_count():
    stats = {"running": 3, "waiting": 2, "free_blocks": 100}
    assert snapshot_load(stats, 0.5, 0, max_age_s=10) == 5
    assert snapshot_load(stats, 0.5, 7, max_age_s=10) == 7  # this gateway's requests are never stale
    assert snapshot_load(stats, 11.0, 1, max_age_s=10) == 1  # a stale snapshot is not trusted
    assert snapshot_load(None, None, 2, max_age_s=10) == 2


def test_choose_refuses_an_empty_set():
    with pytest.raises(ValueError):
        choose("k", [], POLICY)


# --- cache_aware: matched share of the prompt against relative load ---------------------

def cache_loads(matched: dict[str, int], load: dict[str, int]) -> list[EngineLoad]:
    return [EngineLoad(u, load.get(u, 0), matched.get(u, 0)) for u in URLS]


def test_cache_aware_sends_a_prompt_where_most_of_it_is_cached_whatever_its_chat_hashes_to():
    for key in (f"chat-{i}" for i in range(30)):
        assert choose_cache_aware(key, cache_loads({"ws://c:3": 1600}, {}), 1700, POLICY) == "ws://c:3"
        # a little load does not outweigh most of the prompt
        assert choose_cache_aware(key, cache_loads({"ws://c:3": 1600}, {"ws://c:3": 3, "ws://a:1": 2}),
                                  1700, POLICY) == "ws://c:3"


def test_cache_aware_sends_a_prompt_nobody_holds_to_the_least_loaded_engine_ties_to_its_home():
    keys = [f"chat-{i}" for i in range(200)]
    assert [choose_cache_aware(k, cache_loads({}, {}), 50, POLICY) for k in keys] == [home_of(k) for k in keys]
    assert {choose_cache_aware(k, cache_loads({}, {"ws://a:1": 2, "ws://c:3": 1}), 50, POLICY)
            for k in keys} == {"ws://b:2"}


def test_cache_aware_weighs_uncached_tokens_against_load_in_tokens_and_still_sheds_an_overloaded_winner():
    # a holds 500 of 1000 tokens and carries 2 more requests than b
    matched, load = {"ws://a:1": 500}, {"ws://a:1": 3, "ws://b:2": 1, "ws://c:3": 1}
    assert choose_cache_aware("k", cache_loads(matched, load), 1000, RoutingPolicy(load_tokens=200)) == "ws://a:1"
    assert choose_cache_aware("k", cache_loads(matched, load), 1000, RoutingPolicy(load_tokens=300)) != "ws://a:1"
    # a chat's own history keeps it home against an idle engine that holds only the
    # shared document it opened with (the case a relative load term got wrong)
    own = {"ws://a:1": 1900, "ws://b:2": 1500, "ws://c:3": 1500}
    assert choose_cache_aware("k", cache_loads(own, {"ws://a:1": 1}), 2000, POLICY) == "ws://a:1"
    # fully cached but 10 vs 0: SGLang's imbalance test sheds it
    assert choose_cache_aware("k", cache_loads({"ws://a:1": 1000}, {"ws://a:1": 10, "ws://b:2": 1, "ws://c:3": 0}),
                              1000, RoutingPolicy(load_tokens=0)) == "ws://c:3"


def test_cache_aware_without_a_prompt_length_falls_back_to_the_sticky_rule():
    for key in (f"chat-{i}" for i in range(30)):
        assert choose_cache_aware(key, cache_loads({}, {}), 0, POLICY) == choose(key, loads(), POLICY)


def test_an_unknown_policy_or_a_negative_load_weight_is_refused():
    with pytest.raises(ValueError):
        RoutingPolicy(policy="fastest")
    with pytest.raises(ValueError):
        RoutingPolicy(load_tokens=-1)


def test_routing_settings_come_from_the_environment_and_bad_ones_name_their_variable():
    from gateway.config import ConfigError, config_from_env

    cfg = config_from_env({"ROUTING_POLICY": "hash", "ROUTING_LOAD_TOKENS": "64", "ROUTING_TOKENIZER": "/m/tok"})
    assert (cfg.routing.policy, cfg.routing.load_tokens, cfg.routing.tokenizer) == ("hash", 64.0, "/m/tok")
    assert config_from_env({}).routing.policy == "cache_aware"
    for env, var in (({"ROUTING_POLICY": "fastest"}, "ROUTING_POLICY"),
                     ({"ROUTING_LOAD_TOKENS": "-1"}, "ROUTING_LOAD_TOKENS"),
                     ({"ROUTING_LOAD_TOKENS": "lots"}, "ROUTING_LOAD_TOKENS")):
        with pytest.raises(ConfigError, match=var):
            config_from_env(env)
