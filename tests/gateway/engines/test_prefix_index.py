"""The gateway's prefix index (gateway/engines/prefix_index.py): engines' KV events in, the
leading pages each engine holds out, within a fixed bound on pages kept."""

from __future__ import annotations

import random

import pytest

from engine.block_hash import prompt_block_hashes
from gateway.engines.prefix_index import PrefixIndex

A, B, C = "ws://a:1", "ws://b:2", "ws://c:3"


def pages(tokens: list[int]) -> list[int]:
    return prompt_block_hashes(tokens, 4, "w|")


def test_each_engine_matches_the_leading_pages_it_holds_and_no_more():
    doc = list(range(40))  # 10 pages
    ix = PrefixIndex()
    ix.apply(A, pages(doc), [])
    ix.apply(B, pages(doc[:16]), [])  # the first 4 pages
    ix.apply(C, pages([99] + doc[1:]), [])  # same tokens after a different first one
    assert ix.match(pages(doc + [1, 2, 3, 4]), [A, B, C, "ws://unknown"]) == {A: 10, B: 4, C: 0, "ws://unknown": 0}
    assert ix.match([], [A, B]) == {A: 0, B: 0}


def test_evicted_pages_and_a_lost_engine_stop_matching():
    doc = list(range(32))
    ix = PrefixIndex()
    ix.apply(A, pages(doc), [])
    ix.apply(B, pages(doc), [])
    ix.apply(A, [], pages(doc)[4:])  # A evicted the tail
    assert ix.match(pages(doc), [A, B]) == {A: 4, B: 8}
    ix.forget(B)
    assert ix.match(pages(doc), [A, B]) == {A: 4, B: 0}
    assert ix.pages_of(B) == 0 and len(ix) == 4
    ix.apply(A, pages(doc[:8]), [], reset=True)  # a reconnect's snapshot replaces what was known
    assert ix.match(pages(doc), [A]) == {A: 2} and ix.pages_of(A) == 2


def test_random_events_match_a_reference_and_never_exceed_the_bound():
    rng = random.Random(7)
    bound = 50
    ix = PrefixIndex(max_pages=bound)
    ref: dict[str, set[int]] = {A: set(), B: set(), C: set()}
    universe = [rng.getrandbits(64) for _ in range(120)]
    for _ in range(2000):
        url = rng.choice([A, B, C])
        stored = rng.sample(universe, rng.randint(0, 6))
        removed = [h for h in rng.sample(universe, rng.randint(0, 6)) if h not in stored]
        ix.apply(url, stored, removed)
        ref[url].difference_update(removed)
        ref[url].update(stored)
        assert len(ix) <= bound
        # what the index keeps is a subset of the truth (it may have dropped the oldest)
        for u in ref:
            kept = {h for h in universe if ix.match([h], [u])[u]}
            assert kept <= ref[u] and ix.pages_of(u) == len(kept)
    assert ix.dropped_pages > 0  # the bound did bite


def test_a_bound_below_one_page_is_refused():
    with pytest.raises(ValueError):
        PrefixIndex(max_pages=0)


def test_a_routed_prompt_counts_at_its_engine_until_reported_or_expired():
    doc = list(range(32))
    ix = PrefixIndex(routed_ttl_s=10.0)
    ix.note_routed(A, pages(doc), now=100.0)
    assert ix.match(pages(doc), [A, B], now=105.0) == {A: 8, B: 0}
    assert ix.match(pages(doc), [A, B], now=111.0) == {A: 0, B: 0}  # never reported: it expired
    ix.apply(A, pages(doc[:16]), [])  # reported (part of it) before expiry: that part stays
    assert ix.match(pages(doc), [A], now=111.0) == {A: 4}
    ix.note_routed(B, pages(doc), now=200.0)
    ix.forget(B)
    assert ix.match(pages(doc), [B], now=201.0) == {B: 0}
