"""The host-memory KV tier (engine.tiers.host), switched on for the CPU engine (on a GPU it
is on by default; the logic is the same, the copies synchronous here): restores from host
memory token-identical to the pool, its evictions demoted to disk, a missing page
recomputed, aborts mid-restore free their blocks, and per-tier counts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.block_hash import namespace_of
from engine.block_pool import BlockPool
from engine.config import ConfigError, EngineConfig
from engine.kv_page import PageKey
from engine.outputs import GenerateRequest
from engine.radix_cache import CacheScope, RadixCache
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from engine.tiers.host import HostPageStore, default_host_bytes
from engine.tiers.manager import KVTiers, TierConfig, host_tier_on, page_refs
from tests.engine.test_kv_tiers import _chat, _evict, _flush, _turn
from tests.engine_helpers import collect, greedy, make_engine

KEY = PageKey("w", "float32", "float32", 4, 2, 1, 4)  # a page: 2 layers x K/V x 4 tokens x 1 head x 4 = 256 bytes
PAGE = KEY.payload_bytes


def _kv(num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (num_blocks, 4, 1, 4)
    return [torch.randn(shape) for _ in range(2)], [torch.randn(shape) for _ in range(2)]


def _wait(job, tiers: KVTiers) -> list:
    for _ in range(500):
        done = tiers.poll()
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("restore never finished")


# ----- the store -----------------------------------------------------------------------------

def test_host_store_evicts_least_recently_used_and_keeps_pinned_slots_until_unpinned() -> None:
    host = HostPageStore(KEY, 3 * PAGE)
    assert host.capacity == 3 and not host.pinned  # no CUDA here: plain memory
    a = host.allocate([1, 2, 3])
    assert sorted(a) == [0, 1, 2]
    assert host.lookup(1) == a[0]  # 1 is now the most recently used
    host.pin([a[1]])  # page 2's slot has a copy in flight
    evicted: list[int] = []
    host.on_evict = lambda h, slot: evicted.append(h)
    b = host.allocate([4])  # evicts page 2 (least recently used), whose slot is pinned, then page 3
    assert evicted == [2, 3] and b == [a[2]] and 1 in host and 4 in host
    host.check_invariants()
    host.unpin([a[1]])
    host.check_invariants()
    assert host.allocate([5]) != []


def test_a_pinned_slot_is_never_handed_out_twice() -> None:
    host = HostPageStore(KEY, 2 * PAGE)
    s = host.allocate([1, 2])
    host.pin(s)
    assert host.allocate([3]) == []  # both slots pinned: the page is not stored
    assert 1 not in host and 2 not in host  # evicted, slots still pinned
    host.unpin(s)
    assert sorted(host.allocate([3, 4])) == sorted(s)
    host.check_invariants()


def test_host_tier_defaults_on_for_cuda_pools_only() -> None:
    cfg = EngineConfig(model="m")
    assert host_tier_on(cfg, torch.device("cuda")) and not host_tier_on(cfg, torch.device("cpu"))
    assert host_tier_on(EngineConfig(model="m", kv_host="on"), torch.device("cpu"))
    assert not host_tier_on(EngineConfig(model="m", kv_host="off"), torch.device("cuda"))
    with pytest.raises(ConfigError):
        EngineConfig(model="m", kv_host="maybe")
    assert default_host_bytes(1 << 30, 64 << 30) == 2 << 30
    assert default_host_bytes(8 << 30, 4 << 30) == 2 << 30  # at most half the memory available


# ----- the tiers, no model -----------------------------------------------------------------------

def test_pages_restore_from_host_memory_byte_identical_without_a_disk() -> None:
    k, v = _kv(16)
    tiers = KVTiers(KEY, TierConfig(None, 0, host_bytes=16 * PAGE), k, v)
    assert tiers.active and not tiers.disk_active and tiers.store is None
    refs = page_refs(list(range(1, 26)), CacheScope("ns|"), 4, 0, 6)
    assert tiers.store_pages(refs, [0, 1, 2, 3, 4, 5]) == []  # the CPU copies at once: nothing pinned
    assert tiers.probe(refs) == 6
    job = tiers.load(None, refs, [10, 11, 12, 13, 14, 15])
    assert _wait(job, tiers) == [job] and job.served == 6 and job.host_served == 6
    tiers.scatter(job)
    for layer in range(2):
        assert torch.equal(k[layer][10:16], k[layer][0:6]) and torch.equal(v[layer][10:16], v[layer][0:6])
    s = tiers.stats()
    assert s["kv_host_pages_read_total"] == 6 and s["kv_host_hits_total"] == 1 and s["kv_disk_pages_read_total"] == 0
    assert s["kv_host_pages_written_total"] == 6 and not s["kv_disk_enabled"] and s["kv_host_enabled"]
    tiers.close()


def test_host_eviction_demotes_pages_to_disk_and_a_restore_reads_both_tiers(tmp_path: Path) -> None:
    k, v = _kv(32)
    tiers = KVTiers(KEY, TierConfig(tmp_path, 1 << 20, write_back=True, host_bytes=4 * PAGE), k, v)
    assert tiers.store is not None and tiers.host is not None
    refs = page_refs(list(range(1, 42)), CacheScope("ns|"), 4, 0, 10)
    # write-back: the pool evicts the pages; they go to host memory, and to disk only when it evicts them
    tiers.store_pages(refs[:6], list(range(6)), evicting=True)  # pages 0-1 do not fit: straight to disk
    tiers.store_pages(refs[6:], list(range(6, 10)), evicting=True)  # pages 2-5 demoted to make room
    assert tiers.flush()
    on_disk = [r.chain_hash in tiers.store for r in refs]
    in_host = [r.chain_hash in tiers.host for r in refs]
    assert on_disk == [True] * 6 + [False] * 4 and in_host == [False] * 6 + [True] * 4
    assert tiers.host.evicted == 4 and tiers.counters.pages_written == 6
    assert tiers.probe(refs) == 10
    job = tiers.load(None, refs, list(range(20, 30)))
    assert _wait(job, tiers) == [job] and job.served == 10 and job.host_served == 4
    tiers.scatter(job)
    for layer in range(2):
        assert torch.equal(k[layer][20:30], k[layer][0:10]) and torch.equal(v[layer][20:30], v[layer][0:10])
    assert tiers.counters.pages_read == 6 and tiers.host_counters.pages_read == 4
    assert tiers.counters.hits == 1 and tiers.host_counters.hits == 1
    tiers.host.check_invariants()
    tiers.close()


def test_write_through_puts_each_page_in_host_memory_and_on_disk_once(tmp_path: Path) -> None:
    k, v = _kv(16)
    tiers = KVTiers(KEY, TierConfig(tmp_path, 1 << 20, host_bytes=8 * PAGE), k, v)
    refs = page_refs(list(range(1, 18)), CacheScope("ns|"), 4, 0, 4)
    tiers.store_pages(refs, [0, 1, 2, 3])
    tiers.store_pages(refs, [0, 1, 2, 3])  # again: held already, nothing copied or queued
    assert tiers.flush()
    assert tiers.store is not None and tiers.host is not None
    assert all(r.chain_hash in tiers.store and r.chain_hash in tiers.host for r in refs)
    assert tiers.counters.pages_written == 4 and tiers.host_counters.pages_written == 4
    assert tiers.host.num_pinned == 0  # the writer unpinned every slot it wrote from
    tiers.close()


def test_abort_mid_restore_from_host_and_disk_frees_every_block(tmp_path: Path) -> None:
    k, v = _kv(16)
    tiers = KVTiers(KEY, TierConfig(tmp_path, 1 << 20, write_back=True, host_bytes=2 * PAGE), k, v)
    pool = BlockPool(16)
    cache = RadixCache(pool, 4)
    sched = Scheduler(SchedulerConfig(4), pool, cache, tiers)
    tokens = list(range(1, 22))  # 5 whole pages and one token
    scope = CacheScope("ns|")
    refs = page_refs(tokens, scope, 4, 0, 5)
    tiers.store_pages(refs[:3], [0, 1, 2], evicting=True)
    tiers.store_pages(refs[3:], [3, 4], evicting=True)  # pages 0-2 on disk, 3-4 in host memory
    assert tiers.flush()
    req = Request("r", tokens, greedy(4), namespace=scope)
    sched.add(req)
    assert not sched.schedule().items and sched.restoring == [req] and req.status is RequestStatus.RESTORING
    assert len(req.block_table) == 5 and len(req.restore_job.host_slots) == 2
    sched.check_invariants()
    sched.remove(req)
    sched.check_invariants()
    assert pool.num_free == 16 and not sched.has_work()
    for _ in range(200):
        if not tiers.pending:
            break
        tiers.poll()
        time.sleep(0.01)
    assert pool.num_free == 16 and cache.num_cached_blocks == 0
    assert tiers.host is not None and tiers.host.num_pinned == 0
    tiers.host.check_invariants()
    tiers.close()


# ----- the engine ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [dict(dtype="float32"), dict(dtype="auto", quantization="auto")],
                         ids=["exact", "cpu-default"])
async def test_a_chat_evicted_from_the_pool_restores_from_host_memory_token_identical(fmt: dict, tiny_model_dir,
                                                                                      tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_host="on", kv_host_bytes=64 << 20, **fmt)
    eng.start()
    try:
        prompt = _chat(21)
        first = await _turn(eng, "h1", prompt)
        hot = await _turn(eng, "h2", prompt + first.token_ids + [11, 12])  # still in the pool
        assert hot.final.usage.cached_host_tokens == 0
        await _flush(eng)
        await _evict(eng)
        back = await _turn(eng, "h3", prompt + first.token_ids + [11, 12])
        u = back.final.usage
        assert back.token_ids == hot.token_ids and u.cached_tokens == hot.final.usage.cached_tokens
        assert u.cached_host_tokens == u.cached_tokens >= 144 and u.cached_disk_tokens == 0  # memory before disk
        stats = await eng.stats()
        assert stats["kv_host_hits_total"] == 1 and stats["kv_disk_hits_total"] == 0
        assert stats["kv_host_pages_read_total"] * 16 >= u.cached_host_tokens
        assert stats["cached_host_tokens_total"] == u.cached_host_tokens
        assert stats["kv_disk_pages_written_total"] >= 9  # write-through reached the disk as well
        await eng.call(lambda core: core.check_invariants())
        assert stats["blocks_free"] + stats["blocks_evictable"] == stats["num_blocks"]
    finally:
        eng.shutdown()


async def test_a_page_missing_from_host_memory_is_read_from_disk_or_recomputed(tiny_model_dir, tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=None, kv_host="on", kv_host_bytes=64 << 20)
    eng.start()
    try:
        prompt = _chat(23, 200)
        first = await _turn(eng, "m1", prompt)
        await _evict(eng)
        core = eng.core
        ref = page_refs(prompt, CacheScope(namespace_of(core.namespace)), 16, 5, 6)[0]
        assert core.tiers is not None and core.tiers.host is not None and core.tiers.store is None
        await eng.call(lambda c: c.tiers.host.discard(ref.chain_hash))  # page 5 of 12 gone: 0-4 restore
        again = await _turn(eng, "m2", prompt)
        assert again.token_ids == first.token_ids
        assert again.final.usage.cached_host_tokens == again.final.usage.cached_tokens == 5 * 16
        await eng.call(lambda c: c.check_invariants())
    finally:
        eng.shutdown()


async def test_a_salted_chat_restores_from_host_memory_only_under_its_salt(tiny_model_dir) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=None, kv_host="on", kv_host_bytes=64 << 20)
    eng.start()
    try:
        prompt = _chat(25)
        first = await collect(eng, GenerateRequest("s1", prompt, params=greedy(12), cache_salt="user-7"))
        await _evict(eng)
        other = await collect(eng, GenerateRequest("s2", prompt, params=greedy(12), cache_salt="user-8"))
        assert other.final.usage.cached_host_tokens == 0  # another salt: not its pages
        await _evict(eng)
        back = await collect(eng, GenerateRequest("s3", prompt + first.token_ids, params=greedy(12),
                                                  cache_salt="user-7"))
        assert back.final.usage.cached_host_tokens == back.final.usage.cached_tokens >= 144
    finally:
        eng.shutdown()


async def test_write_back_through_a_small_host_tier_reaches_disk_and_restores_token_identical(tiny_model_dir,
                                                                                              tmp_path: Path) -> None:
    probe = make_engine(tiny_model_dir, kv_host="on", kv_host_bytes=64 << 20)
    assert probe.core.tiers is not None
    page = probe.core.tiers.key.payload_bytes
    probe.shutdown()
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_disk_write="back", kv_host="on",
                      kv_host_bytes=4 * page)
    eng.start()
    try:
        prompt = _chat(31)
        first = await _turn(eng, "b1", prompt)
        hot = await _turn(eng, "b2", prompt + first.token_ids + [11, 12])
        await _evict(eng)  # the pool evicts: 4 pages to host memory, the rest straight to disk
        await _turn(eng, "noise", _chat(32))
        await _evict(eng)  # the noise's pages push the chat's out of host memory: demoted to disk
        await _flush(eng)
        back = await _turn(eng, "b3", prompt + first.token_ids + [11, 12])
        u = back.final.usage
        assert back.token_ids == hot.token_ids and u.cached_tokens == hot.final.usage.cached_tokens
        assert u.cached_disk_tokens + u.cached_host_tokens == u.cached_tokens and u.cached_disk_tokens >= 144 - 4 * 16
        stats = await eng.stats()
        assert stats["kv_host_pages_evicted_total"] > 0 and stats["kv_disk_pages_written_total"] >= 5
        await eng.call(lambda core: core.check_invariants())
    finally:
        eng.shutdown()
