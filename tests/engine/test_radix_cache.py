"""RadixCache over BlockPool: prefix matching, refcounts, eviction, namespaces, and the
idle accounting identity (docs/acceptance.md, block accounting: free + evictable + held == total)."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.block_hash import chain_hashes, namespace_seed, prompt_block_hashes
from engine.block_pool import BlockPool, blocks_needed
from engine.radix_cache import CacheScope, RadixCache, RadixCacheError, RadixNode

# --- helpers: a request that follows the caller's contract --------------------------------


@dataclass
class Req:
    """A running request as the scheduler holds it."""

    ns: str | CacheScope
    tokens: tuple[int, ...]
    node: RadixNode
    locked_pages: int  # pages covered by `node`
    blocks: list[int]  # one per page (last may be partial); the request holds a ref on each


def admit(cache: RadixCache, tokens, ns: str | CacheScope = "", cap_last: bool = True) -> Req:
    """Match (leaving one token to compute), lock, incref, allocate the rest privately."""
    pool = cache.pool
    m = cache.match_prefix(tokens, ns, max_tokens=len(tokens) - 1 if cap_last else None)
    cache.lock(m.node)
    pool.incref(m.blocks)
    need = blocks_needed(len(tokens), cache.block_size) - len(m.blocks)
    private = pool.allocate(need)
    return Req(ns, tuple(tokens), m.node, len(m.blocks), list(m.blocks) + private)


def finish(cache: RadixCache, req: Req):
    """Insert the full pages, drop the request's own references, unlock."""
    n_full = len(req.tokens) // cache.block_size
    res = cache.insert(req.tokens[: n_full * cache.block_size], req.blocks[:n_full], req.ns)
    cache.pool.decref(req.blocks)
    cache.unlock(req.node)
    return res


def identity_holds(cache: RadixCache, running: list[Req]) -> bool:
    held = set().union(*(r.blocks for r in running)) if running else set()
    return cache.pool.num_free + cache.num_evictable_blocks + len(held) == cache.pool.num_blocks


def seq(*parts) -> tuple[int, ...]:
    out: list[int] = []
    for p in parts:
        out.extend(p)
    return tuple(out)


# --- plain unit tests -----------------------------------------------------------------------


def test_match_ending_mid_edge_splits_at_block_boundary():
    pool = BlockPool(16)
    cache = RadixCache(pool, block_size=2)
    r = admit(cache, range(8), cap_last=False)  # 4 pages, all private
    finish(cache, r)
    assert cache.num_cached_blocks == 4
    m = cache.match_prefix([0, 1, 2, 3, 9, 9, 9, 9])
    assert m.num_tokens == 4 and m.blocks == r.blocks[:2]
    cache.lock(m.node)
    # The split node covers exactly the matched pages: evicting everything else
    # leaves precisely them.
    assert cache.num_locked_blocks == 2
    assert cache.reset() == 2
    assert cache.match_prefix(range(8)).blocks == r.blocks[:2]
    cache.check_invariants()
    cache.unlock(m.node)
    assert cache.reset() == 2 and pool.num_free == 16


def test_insert_diverging_mid_edge_splits_and_shares_the_common_pages():
    pool = BlockPool(16)
    cache = RadixCache(pool, block_size=2)
    a = admit(cache, seq(range(6), [7, 7]), cap_last=False)
    finish(cache, a)
    b = admit(cache, seq(range(4), [5, 8], [1, 1]), cap_last=False)
    assert b.locked_pages == 2  # [0,1] [2,3] matched; [5,8] differs at its second token
    res = finish(cache, b)
    assert res.num_existing_tokens == 4 and res.num_new_tokens == 4 and res.duplicate_blocks == []
    assert cache.num_cached_blocks == 6
    assert cache.match_prefix(seq(range(4), [5, 8])).blocks == b.blocks[:3]
    assert cache.match_prefix(seq(range(6))).blocks == a.blocks[:3]
    cache.check_invariants()


def test_eviction_is_lru_older_leaf_first():
    pool = BlockPool(8)
    cache = RadixCache(pool, block_size=1)
    old = admit(cache, [1, 2], cap_last=False)
    finish(cache, old)
    new = admit(cache, [3, 4], cap_last=False)
    finish(cache, new)
    cache.match_prefix([1, 2])  # refresh: now [3, 4] is the least recently used
    assert cache.evict(1) >= 1
    assert cache.match_prefix([3, 4]).num_tokens == 0
    assert cache.match_prefix([1, 2]).num_tokens == 2
    assert pool.refcount(new.blocks[0]) == 0 and pool.refcount(old.blocks[0]) == 1
    cache.check_invariants()


def test_reinserting_a_cached_prompt_refreshes_its_lru_time():
    pool = BlockPool(12)
    cache = RadixCache(pool, block_size=2)
    a1 = admit(cache, [1, 1, 2, 2])  # computed privately, finishes first
    a2 = admit(cache, [1, 1, 2, 2])  # same prompt, also computed privately
    finish(cache, a1)
    finish(cache, admit(cache, [3, 3, 4, 4]))
    res = finish(cache, a2)  # all pages already cached: a pure refresh
    assert res.num_existing_tokens == 4 and res.duplicate_blocks == a2.blocks[:2]
    assert cache.evict(1) == 2
    assert cache.match_prefix([3, 3, 4, 4]).num_tokens == 0, "the older prompt goes first"
    assert cache.match_prefix([1, 1, 2, 2]).blocks == a1.blocks[:2]


def test_splitting_a_locked_edge_keeps_both_halves_locked():
    pool = BlockPool(12)
    cache = RadixCache(pool, block_size=2)
    finish(cache, admit(cache, [1, 1, 2, 2, 3, 3], cap_last=False))
    holder = admit(cache, [1, 1, 2, 2, 3, 3, 4])  # locks the whole 3-page edge
    assert holder.locked_pages == 3 and cache.num_locked_blocks == 3
    other = admit(cache, [1, 1, 9])  # match ends after page 1: splits the locked edge
    assert other.locked_pages == 1
    cache.check_invariants()
    assert cache.evict(100) == 0 and cache.num_locked_blocks == 3
    finish(cache, holder)
    assert cache.num_locked_blocks == 1  # only `other`'s first page
    cache.check_invariants()
    finish(cache, other)
    assert cache.num_locked_blocks == 0 and identity_holds(cache, [])
    cache.reset()
    assert pool.num_free == 12


def test_evicting_a_leaf_makes_its_parent_a_candidate_and_evict_zero_is_noop():
    pool = BlockPool(8)
    cache = RadixCache(pool, block_size=1)
    finish(cache, admit(cache, [1, 2, 3], cap_last=False))
    cache.match_prefix([1, 5])  # splits [1] | [2, 3]
    assert cache.evict(0) == 0 and cache.num_cached_blocks == 3
    assert cache.evict(3) == 3
    assert pool.num_free == 8 and cache.num_cached_blocks == 0
    cache.check_invariants()


def test_locked_leaves_are_never_evicted():
    pool = BlockPool(8)
    cache = RadixCache(pool, block_size=2)
    finish(cache, admit(cache, [1, 1, 2, 2], cap_last=False))
    finish(cache, admit(cache, [3, 3, 4, 4], cap_last=False))
    running = admit(cache, [1, 1, 2, 2, 9], cap_last=False)
    assert running.locked_pages == 2
    assert cache.evict(100) == 2  # only [3 3 4 4]
    assert cache.num_locked_blocks == 2 and cache.num_evictable_blocks == 0
    assert cache.match_prefix([1, 1, 2, 2]).num_tokens == 4
    assert identity_holds(cache, [running])
    finish(cache, running)
    assert cache.evict(100) == 2 and pool.num_free == 8


def test_duplicate_insert_reports_callers_blocks_and_refcounts_are_exact():
    pool = BlockPool(12)
    cache = RadixCache(pool, block_size=2)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    a = admit(cache, prompt)  # both arrive before either finished: nothing to match
    b = admit(cache, prompt)
    assert a.locked_pages == b.locked_pages == 0
    ra = finish(cache, a)
    assert ra.num_new_tokens == 6 and ra.duplicate_blocks == []
    rb = finish(cache, b)
    assert rb.num_existing_tokens == 6 and rb.num_new_tokens == 0
    assert rb.duplicate_blocks == b.blocks[:3]
    for blk in a.blocks[:3]:
        assert pool.refcount(blk) == 1  # the tree's reference only
    for blk in b.blocks + a.blocks[3:]:
        assert pool.refcount(blk) == 0  # duplicates and partial pages went back
    assert pool.num_free == 12 - 3 and cache.num_evictable_blocks == 3
    # A block the tree already stores cannot be inserted at another page.
    (c,) = pool.allocate(1)
    with pytest.raises(RadixCacheError):
        cache.insert([0, 0, 1, 1], [c, a.blocks[0]])
    assert cache.num_cached_blocks == 3
    pool.decref([c])
    cache.check_invariants()


def test_shared_prefix_drain_keeps_accounting_exact():
    # Block accounting (docs/acceptance.md#block-accounting) in miniature: block size 16, a long shared system
    # prompt, many sessions.
    bs, total = 16, 400
    pool = BlockPool(total)
    cache = RadixCache(pool, block_size=bs)
    system = tuple(range(1000, 1000 + 10 * bs + 5))  # not page-aligned on purpose
    prompts = [seq(system, [i] * (2 * bs + i)) for i in range(12)]
    first_wave = [admit(cache, p) for p in prompts[:6]]  # nothing cached yet
    running = list(first_wave)
    for r in first_wave[:3]:
        finish(cache, r)
        running.remove(r)
        assert identity_holds(cache, running)
    second_wave = [admit(cache, p) for p in prompts[6:]]
    assert all(r.locked_pages == 10 for r in second_wave)  # the system prompt's full pages
    running += second_wave
    assert identity_holds(cache, running), "shared locked pages must be counted once"
    # Decode a few tokens each (new private blocks), then drain everything.
    for r in running:
        r.tokens += (7,) * bs
        r.blocks += pool.allocate(blocks_needed(len(r.tokens), bs) - len(r.blocks))
        assert identity_holds(cache, running)
    for r in list(running):
        finish(cache, r)
        running.remove(r)
        cache.check_invariants()
        assert identity_holds(cache, running)
    assert cache.num_locked_blocks == 0
    assert pool.num_free + cache.num_evictable_blocks == total
    evictable = cache.num_evictable_blocks
    assert evictable == cache.num_cached_blocks > 0
    assert cache.evict(evictable) == evictable
    assert pool.num_free == total and cache.num_cached_blocks == 0
    # The engine keeps serving: a short follow-up request goes through.
    r = admit(cache, [1, 2, 3])
    finish(cache, r)
    cache.check_invariants()


def test_namespaces_never_share_blocks():
    pool = BlockPool(16)
    cache = RadixCache(pool, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    finish(cache, admit(cache, prompt, ns="weights-X"))
    y = admit(cache, prompt, ns="weights-Y")
    assert y.locked_pages == 0, "a different namespace must not match X's blocks"
    res = finish(cache, y)
    assert res.num_new_tokens == 4 and res.duplicate_blocks == []
    mx = cache.match_prefix(prompt, "weights-X")
    my = cache.match_prefix(prompt, "weights-Y")
    assert mx.num_tokens == my.num_tokens == 4 and not set(mx.blocks) & set(my.blocks)
    assert cache.match_prefix(prompt, "").num_tokens == 0
    cache.check_invariants()


def test_a_namespace_no_longer_used_ages_out_by_lru_and_its_locked_pages_stay():
    # New weights get a new namespace (their weights id); the old one is never matched
    # again, so its pages go by plain LRU eviction, and its node with its last page.
    pool = BlockPool(16)
    cache = RadixCache(pool, block_size=2)
    finish(cache, admit(cache, [1, 1, 2, 2, 3, 3], ns="old", cap_last=False))
    finish(cache, admit(cache, [8, 8, 9], ns="old", cap_last=False))
    running = admit(cache, [1, 1, 2, 2, 5, 5], ns="old")  # still running on the old weights
    assert running.locked_pages == 2
    finish(cache, admit(cache, [1, 1, 2, 2], ns="new", cap_last=False))
    # The old namespace's unlocked pages ([3 3] and [8 8]) are the least recently used.
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 1, 2, 2], "new").num_tokens == 4
    assert cache.match_prefix([8, 8], "old").num_tokens == 0
    assert cache.evict(100) == 2  # only the new namespace's pages: the locked ones stay
    assert cache.num_locked_blocks == 2 and identity_holds(cache, [running])
    cache.check_invariants()
    finish(cache, running)
    assert cache.reset() == 3  # [1 1 2 2] and the finished request's [5 5]
    assert "old" not in cache.pretty(), "an emptied namespace node is dropped with its last page"
    assert pool.num_free == 16 and cache.num_cached_blocks == 0
    cache.check_invariants()


def test_insert_returns_the_path_a_match_would_find():
    pool = BlockPool(16)
    cache = RadixCache(pool, block_size=2)
    a = admit(cache, [1, 1, 2, 2, 3, 3], cap_last=False)
    finish(cache, a)
    b = admit(cache, [1, 1, 2, 2, 4, 4, 5], cap_last=False)  # [1 1 2 2] matched, the rest private
    c = admit(cache, [1, 1, 2, 2, 4, 4, 6], cap_last=False)
    finish(cache, b)
    res = cache.insert(c.tokens[:6], c.blocks[:3])  # [4 4] is now the tree's (b's) page
    assert res.blocks == a.blocks[:2] + b.blocks[2:3]
    assert res.duplicate_blocks == c.blocks[2:3]
    m = cache.match_prefix(c.tokens[:6])
    assert (m.node, m.blocks) == (res.node, res.blocks)
    cache.pool.decref(c.blocks)
    cache.unlock(c.node)
    cache.check_invariants()


def test_max_tokens_caps_the_match_to_whole_blocks():
    pool = BlockPool(8)
    cache = RadixCache(pool, block_size=4)
    prompt = list(range(12))
    finish(cache, admit(cache, prompt, cap_last=False))
    assert cache.match_prefix(prompt).num_tokens == 12
    assert cache.match_prefix(prompt, max_tokens=11).num_tokens == 8  # len - 1, rounded down
    assert cache.match_prefix(prompt, max_tokens=4).num_tokens == 4
    assert cache.match_prefix(prompt, max_tokens=3).num_tokens == 0
    m = cache.match_prefix(prompt, max_tokens=0)
    assert m.num_tokens == 0 and m.blocks == [] and m.node is cache.root
    assert cache.match_prefix(prompt[:7]).num_tokens == 4  # a partial last page never matches
    cache.check_invariants()


def test_block_size_one_matches_token_by_token():
    pool = BlockPool(10)
    cache = RadixCache(pool, block_size=1)
    a = admit(cache, [4, 5, 6, 7], cap_last=False)
    finish(cache, a)
    m = cache.match_prefix([4, 5, 9])
    assert m.num_tokens == 2 and m.blocks == a.blocks[:2]
    b = admit(cache, [4, 5, 9])  # matches [4 5] capped at len - 1 = 2
    assert b.locked_pages == 2 and b.blocks[:2] == a.blocks[:2]
    res = finish(cache, b)
    assert res.num_existing_tokens == 2 and res.num_new_tokens == 1
    assert cache.num_cached_blocks == 5
    cache.check_invariants()
    assert cache.reset() == 5 and pool.num_free == 10


def test_disabled_cache_matches_and_stores_nothing():
    pool = BlockPool(6)
    cache = RadixCache(pool, block_size=2, enabled=False)
    r = admit(cache, [1, 2, 3, 4, 5], cap_last=False)
    res = finish(cache, r)
    assert res.num_new_tokens == 0 and res.node is cache.root
    assert pool.num_free == 6 and cache.num_cached_blocks == 0
    assert cache.match_prefix([1, 2, 3, 4]).num_tokens == 0
    assert cache.evict(3) == 0
    cache.check_invariants()


def test_contract_violations_raise():
    pool = BlockPool(6)
    cache = RadixCache(pool, block_size=2)
    with pytest.raises(ValueError):
        RadixCache(pool, block_size=0)
    r = admit(cache, [1, 2, 3, 4], cap_last=False)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], r.blocks)  # not len(blocks) * block_size tokens
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3, 4], [r.blocks[0], r.blocks[0]])
    finish(cache, r)
    m = cache.match_prefix([1, 2, 3, 4])
    with pytest.raises(RadixCacheError):
        cache.unlock(m.node)  # never locked
    (free_block,) = pool.allocate(1)
    pool.decref([free_block])
    with pytest.raises(RadixCacheError):
        cache.insert([7, 7], [free_block])  # the caller does not hold it
    cache.reset()
    with pytest.raises(RadixCacheError):
        cache.lock(m.node)  # evicted since the match
    cache.check_invariants()
    assert "RadixCache" in cache.pretty()


# --- the state machine ------------------------------------------------------------------------


def scopes_for(bs: int) -> list[str | CacheScope]:
    """Plain namespaces and salted scopes: two users of one namespace with one shared page,
    one of them again with two shared pages (a salt node elsewhere), and salts with
    nothing shared."""
    return ["a", "b", CacheScope("a", "u1", bs), CacheScope("a", "u2", bs),
            CacheScope("a", "u1", 2 * bs + bs // 2), CacheScope("b", "u1", 0), CacheScope("a", "u2", 0)]


Key = str | tuple[str, str, int]  # where a page lives: a namespace, or (namespace, salt, shared pages)


class CacheMachine(RuleBasedStateMachine):
    """Random arrivals, finishes, aborts, mid-run inserts and evictions, checked against
    a flat reference: per place a page can live (a namespace's own tree, or the subtree
    below one salt node), a dict from every cached page-aligned prefix to the block the
    tree stores for it, with a last-access stamp per prefix."""

    @initialize(bs=st.sampled_from([1, 2, 4, 16]), total=st.integers(4, 48))
    def setup(self, bs, total):
        self.bs, self.total = bs, total
        self.pool = BlockPool(total)
        self.cache = RadixCache(self.pool, bs, events=True)
        self.events_seen: set[int] = set()  # what a gateway hearing the events would hold
        self.running: list[Req] = []
        self.seen: list[tuple[int, ...]] = []
        self.scopes = scopes_for(bs)
        self.ref: dict[Key, dict[tuple[int, ...], int]] = defaultdict(dict)
        self.stamp: dict[Key, dict[tuple[int, ...], int]] = defaultdict(dict)
        self.clock = 0

    # --- reference helpers ---

    def _key(self, scope, pages: int) -> Key:
        """Where the ``pages``-th page of a prompt of ``scope`` lives."""
        if isinstance(scope, str):
            return scope
        shared = scope.shared_tokens // self.bs
        return scope.namespace if pages <= shared else (scope.namespace, scope.salt, shared)

    def _touch(self, scope, tokens, pages):
        self.clock += 1
        for i in range(1, pages + 1):
            self.stamp[self._key(scope, i)][tokens[: i * self.bs]] = self.clock

    def _expected_match(self, scope, tokens, cap):
        pages, blocks = 0, []
        while (pages + 1) * self.bs <= cap:
            blk = self.ref[self._key(scope, pages + 1)].get(tuple(tokens[: (pages + 1) * self.bs]))
            if blk is None:
                break
            blocks.append(blk)
            pages += 1
        return pages, blocks

    def _locked_prefixes(self) -> set[tuple[Key, tuple[int, ...]]]:
        return {(self._key(r.ns, i), r.tokens[: i * self.bs]) for r in self.running
                for i in range(1, r.locked_pages + 1)}

    def _has_child(self, key: Key, p: tuple[int, ...]) -> bool:
        n = len(p) + self.bs
        places = [key] + ([k for k in self.ref if isinstance(k, tuple) and k[0] == key and k[2] * self.bs == len(p)]
                          if isinstance(key, str) else [])
        return any(len(q) == n and q[: len(p)] == p for k in places for q in self.ref[k])

    def _hash(self, key: Key, p: tuple[int, ...]) -> int:
        if isinstance(key, str):
            return prompt_block_hashes(p, self.bs, key)[-1]
        return prompt_block_hashes(p, self.bs, key[0], key[1], key[2] * self.bs)[-1]

    def _check_insert(self, scope, tokens, blocks, res):
        pages = len(blocks)
        keys = [self._key(scope, i + 1) for i in range(pages)]
        present = [tokens[: (i + 1) * self.bs] in self.ref[keys[i]] for i in range(pages)]
        existing = sum(present)
        assert present == [True] * existing + [False] * (pages - existing), "reference not prefix-closed"
        assert res.num_existing_tokens == existing * self.bs
        assert res.num_new_tokens == (pages - existing) * self.bs
        dups = [b for i, b in enumerate(blocks[:existing]) if self.ref[keys[i]][tokens[: (i + 1) * self.bs]] != b]
        assert res.duplicate_blocks == dups
        for i in range(existing, pages):
            self.ref[keys[i]][tokens[: (i + 1) * self.bs]] = blocks[i]
        assert res.blocks == [self.ref[keys[i]][tokens[: (i + 1) * self.bs]] for i in range(pages)]
        self._touch(scope, tokens, pages)

    def _match(self, scope, tokens, cap):
        m = self.cache.match_prefix(tokens, scope, max_tokens=cap)
        pages, blocks = self._expected_match(scope, tokens, min(cap, len(tokens)))
        assert m.num_tokens == pages * self.bs, (m.num_tokens, pages, self.cache.pretty())
        assert m.blocks == blocks
        if pages:
            self._touch(scope, tuple(tokens), pages)
        return m

    def _evict(self, k):
        before_cached, before_locked = self.cache.num_cached_blocks, self.cache.num_locked_blocks
        before_evictable = self.cache.num_evictable_blocks
        freed = self.cache.evict(k)
        gone = {(key, p) for key, d in self.ref.items() for p, b in d.items() if self.pool.refcount(b) == 0}
        assert freed == len(gone) and freed >= min(max(k, 0), before_evictable)
        assert self.cache.num_cached_blocks == before_cached - freed
        assert self.cache.num_locked_blocks == before_locked, "a locked node was evicted"
        locked = self._locked_prefixes()
        assert not gone & locked
        for key, p in gone:
            del self.ref[key][p]
        # LRU: nothing evicted is newer than an unlocked leaf that survived.
        survivors = [self.stamp[key][p] for key, d in self.ref.items() for p in d
                     if (key, p) not in locked and not self._has_child(key, p)]
        if gone and survivors:
            assert max(self.stamp[key][p] for key, p in gone) <= min(survivors)
        for key, p in gone:
            del self.stamp[key][p]
        for key, d in self.ref.items():
            for p in d:
                parent_pages = len(p) // self.bs - 1
                if parent_pages == 0:
                    continue
                parent_key = key if isinstance(key, str) or parent_pages > key[2] else key[0]
                assert p[: -self.bs] in self.ref[parent_key], "evicted a parent before its child"
        return freed

    # --- rules ---

    @rule(data=st.data())
    def arrive(self, data):
        bs = self.bs
        prefix: tuple[int, ...] = ()
        # Mostly continue an earlier prompt (cut at a page boundary, its end, or anywhere),
        # so that prefixes collide even at block size 16.
        if self.seen and data.draw(st.integers(0, 3)) > 0:
            base = data.draw(st.sampled_from(self.seen))
            page_cuts = list(range(0, len(base) + 1, bs)) + [len(base)]
            cut = data.draw(st.one_of(st.sampled_from(page_cuts), st.integers(0, len(base))))
            prefix = base[:cut]
        # A seeded generator is far cheaper to draw than a list of 32 small integers.
        ext_len = data.draw(st.integers(0 if prefix else 1, 2 * bs))
        ext = random.Random(data.draw(st.integers(0, 2**16))).choices(range(3), k=ext_len)
        tokens = (prefix + tuple(ext))[: 5 * bs + 1]
        self.seen.append(tokens)
        ns = data.draw(st.sampled_from(self.scopes))
        cap = data.draw(st.one_of(st.just(len(tokens) - 1), st.integers(0, len(tokens))))
        m = self._match(ns, tokens, cap)
        self.cache.lock(m.node)
        self.pool.incref(m.blocks)
        need = blocks_needed(len(tokens), bs) - len(m.blocks)
        if self.pool.num_free < need:
            self._evict(need - self.pool.num_free)
        if self.pool.num_free < need:  # would be preempted/queued by the scheduler
            self.pool.decref(m.blocks)
            self.cache.unlock(m.node)
            return
        req = Req(ns, tokens, m.node, len(m.blocks), list(m.blocks) + self.pool.allocate(need))
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        n_full = len(req.tokens) // self.bs
        toks = req.tokens[: n_full * self.bs]
        res = self.cache.insert(toks, req.blocks[:n_full], req.ns)
        if n_full:
            self._check_insert(req.ns, toks, req.blocks[:n_full], res)
        else:
            assert res.num_new_tokens == res.num_existing_tokens == 0 and res.node is self.cache.root
        self.pool.decref(req.blocks)
        self.cache.unlock(req.node)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.pool.decref(req.blocks)
        self.cache.unlock(req.node)

    @precondition(lambda self: any(len(r.tokens) // self.bs > r.locked_pages for r in self.running))
    @rule(data=st.data())
    def insert_mid_run(self, data):
        """A long-running request caches what it has computed so far and adopts the tree's
        blocks for those pages (SGLang's "cache unfinished request")."""
        req = data.draw(st.sampled_from(
            [r for r in self.running if len(r.tokens) // self.bs > r.locked_pages]))
        k = data.draw(st.integers(req.locked_pages + 1, len(req.tokens) // self.bs))
        toks = req.tokens[: k * self.bs]
        res = self.cache.insert(toks, req.blocks[:k], req.ns)
        self._check_insert(req.ns, toks, req.blocks[:k], res)  # res.blocks: the tree's pages
        self.cache.lock(res.node)
        self.pool.incref(res.blocks)
        self.cache.unlock(req.node)
        self.pool.decref(req.blocks[:k])
        req.blocks[:k] = res.blocks
        req.node, req.locked_pages = res.node, k

    @precondition(lambda self: self.cache.num_evictable_blocks > 0)
    @rule(k=st.integers(-1, 12))
    def evict(self, k):
        self._evict(k)

    # --- checks ---

    @invariant()
    def accounting_is_exact(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        held = set().union(*(r.blocks for r in self.running)) if self.running else set()
        assert self.pool.num_free + self.cache.num_evictable_blocks + len(held) == self.total
        live_locked_blocks = {self.ref[ns][p] for ns, p in self._locked_prefixes()}
        in_ref = sum(len(d) for d in self.ref.values())
        assert self.cache.num_evictable_blocks == in_ref - len(live_locked_blocks)
        assert self.cache.num_cached_blocks == in_ref
        tree_blocks = {b for d in self.ref.values() for b in d.values()}
        for b in range(self.total):
            holders = sum(r.blocks.count(b) for r in self.running) + (b in tree_blocks)
            assert self.pool.refcount(b) == holders, f"block {b}: refcount {self.pool.refcount(b)} != {holders}"

    @invariant()
    def events_name_exactly_the_cached_pages(self):
        """Applied in order, the events give the set of cached pages, each named by the
        chained hash of its whole prefix (what a gateway computes from a prompt)."""
        if not hasattr(self, "cache"):
            return
        stored, removed = self.cache.take_events()
        assert not set(stored) & set(removed)
        self.events_seen.difference_update(removed)
        self.events_seen.update(stored)
        expected = {self._hash(key, p) for key, d in self.ref.items() for p in d}
        assert self.events_seen == expected
        assert sorted(self.cache.cached_hashes()) == sorted(expected)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for r in self.running:
            self.pool.decref(r.blocks)
            self.cache.unlock(r.node)
        self.running.clear()
        self.cache.check_invariants()
        assert self.cache.num_locked_blocks == 0
        assert self.pool.num_free + self.cache.num_evictable_blocks == self.total
        self.cache.evict(self.total)
        assert self.pool.num_free == self.total and self.cache.num_cached_blocks == 0


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=90, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_block_hashes_chain_over_whole_pages_and_differ_by_namespace_and_prefix():
    a = prompt_block_hashes([1, 2, 3, 4, 5], 2, "w|")
    assert len(a) == 2  # the partial last page has no name
    assert prompt_block_hashes([1, 2, 3, 4], 2, "w|") == a
    assert chain_hashes(a[0], [3, 4], 2) == a[1:]  # the chain continues from a page's hash
    assert prompt_block_hashes([1, 2, 3, 4], 2, "w|salt") != a  # another namespace
    assert prompt_block_hashes([9, 2, 3, 4], 2, "w|")[1] != a[1]  # same page, other prefix
    assert all(0 <= h < 1 << 64 for h in a) and namespace_seed("w|") not in a
    with pytest.raises(ValueError):
        prompt_block_hashes([-1, 2], 2, "w|")


def test_events_report_a_page_stored_then_evicted_in_its_last_state_only():
    pool = BlockPool(8)
    cache = RadixCache(pool, 2, events=True)
    blocks = pool.allocate(2)
    cache.insert((1, 2, 3, 4), blocks, "ns")
    pool.decref(blocks)
    stored, removed = cache.take_events()
    assert stored == prompt_block_hashes([1, 2, 3, 4], 2, "ns") and removed == []
    assert cache.take_events() == ([], [])
    cache.evict(8)
    assert cache.take_events() == ([], stored)
    blocks = pool.allocate(1)
    cache.insert((7, 7), blocks, "ns")
    pool.decref(blocks)
    cache.evict(8)
    assert cache.take_events() == ([], prompt_block_hashes([7, 7], 2, "ns"))  # never seen stored
    assert RadixCache(pool, 2).take_events() == ([], [])  # without events: nothing recorded


# --- salt nodes (per-user cache isolation) ---------------------------------------------------


def _store(cache: RadixCache, tokens, scope):
    """Insert ``tokens`` (whole pages) as a finished request of ``scope`` would."""
    blocks = cache.pool.allocate(len(tokens) // cache.block_size)
    res = cache.insert(tokens, blocks, scope)
    cache.pool.decref(blocks)
    return res


def test_salted_scopes_share_only_the_declared_pages():
    """Two users with one declared-shared page: each finds the shared page whoever stored it,
    only their own private pages, and an unsalted request never sees a salted page."""
    cache = RadixCache(BlockPool(16), 2, events=True)
    u1, u2 = CacheScope("w|", "u1", 2), CacheScope("w|", "u2", 2)
    shared, private = (5, 5), (1, 2, 3, 4)
    r1 = _store(cache, shared + private, u1)
    assert r1.num_new_tokens == 6
    assert cache.match_prefix(shared + private + (9,), u1).num_tokens == 6
    assert cache.match_prefix(shared + private + (9,), u2).num_tokens == 2  # the shared page only
    assert cache.match_prefix(shared + private + (9,), "w|").num_tokens == 2
    assert cache.match_prefix(shared + private + (9,), CacheScope("w|", "u1", 0)).num_tokens == 0
    r2 = _store(cache, shared + private, u2)  # the same tokens: a page of its own
    assert (r2.num_existing_tokens, r2.num_new_tokens) == (2, 4)
    assert r2.blocks[0] == r1.blocks[0] and not set(r2.blocks[1:]) & set(r1.blocks[1:])
    assert cache.match_prefix(shared + private, u2).blocks == r2.blocks
    cache.check_invariants()
    assert cache.num_cached_blocks == 5 and cache.pretty().count("salt") == 2


def test_a_salt_node_goes_with_its_last_page_and_its_parent_becomes_evictable():
    cache = RadixCache(BlockPool(8), 2)
    u1 = CacheScope("w|", "u1", 2)
    _store(cache, (5, 5, 1, 1, 2, 2), u1)
    req = admit(cache, (5, 5, 1, 1, 2, 2, 3), u1)  # locks the whole salted path
    assert req.locked_pages == 3
    assert cache.evict(8) == 0  # all locked, the shared page included
    finish(cache, req)
    assert cache.evict(1) == 2  # the private leaf: [1 1 2 2] is one edge
    assert "salt" not in cache.pretty(), "an emptied salt node is dropped with its last page"
    cache.check_invariants()
    assert cache.evict(1) == 1  # then the shared page, a leaf now
    assert cache.pool.num_free == 8 and cache.num_cached_blocks == 0
    cache.check_invariants()


def test_salted_pages_are_named_as_the_gateway_hashes_them_and_never_alike():
    cache = RadixCache(BlockPool(16), 2, events=True)
    tokens = (5, 5, 1, 2, 3, 4)
    _store(cache, tokens, CacheScope("w|", "u1", 2))
    stored, _ = cache.take_events()
    assert sorted(stored) == sorted(prompt_block_hashes(tokens, 2, "w|", "u1", 2))
    _store(cache, tokens, CacheScope("w|", "u2", 2))
    stored2, _ = cache.take_events()
    assert sorted(stored2) == sorted(prompt_block_hashes(tokens, 2, "w|", "u2", 2)[1:])  # the shared page is known
    assert not set(stored2) & set(stored), "one user's private pages hash like another's"
    assert prompt_block_hashes(tokens, 2, "w|", "u1", 2)[0] == prompt_block_hashes(tokens, 2, "w|")[0]
    cache.evict(16)
    _, removed = cache.take_events()
    assert sorted(removed) == sorted(set(stored) | set(stored2))
    assert cache.cached_hashes() == []


def test_a_salt_node_sits_where_its_shared_part_ends_even_inside_an_edge():
    """An unsalted request stored a long edge; a salted one whose shared part ends inside it
    splits it there and hangs its salt node at the split."""
    cache = RadixCache(BlockPool(16), 2)
    _store(cache, (5, 5, 6, 6, 7, 7), "w|")
    u1 = CacheScope("w|", "u1", 3)  # 1 page shared (3 tokens, rounded down)
    r = _store(cache, (5, 5, 6, 6, 8, 8), u1)
    assert (r.num_existing_tokens, r.num_new_tokens) == (2, 4), "only the shared page may be reused"
    assert cache.match_prefix((5, 5, 6, 6, 7, 7, 0), CacheScope("w|", "u2", 3)).num_tokens == 2
    assert cache.match_prefix((5, 5, 6, 6, 7, 7, 0), u1).num_tokens == 4  # its own page [6 6]
    assert cache.match_prefix((5, 5, 6, 6, 7, 7, 0), "w|").num_tokens == 6
    assert cache.match_prefix((5, 5, 6, 6, 8, 8, 0), u1).num_tokens == 6
    cache.check_invariants()
    assert cache.reset() == 5 and cache.num_cached_blocks == 0
    cache.check_invariants()
