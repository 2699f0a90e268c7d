"""The disk KV tier (engine.tiers): pages written through, restored after eviction and
after a restart, exactly; bad pages recomputed; aborts mid-restore free their blocks."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
import torch

from engine.block_hash import namespace_of
from engine.block_pool import BlockPool
from engine.kv_page import PageKey
from engine.outputs import GenerateRequest
from engine.radix_cache import CacheScope, RadixCache
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from engine.tiers.disk import DiskPageStore
from engine.tiers.manager import KVTiers, TierConfig, page_refs
from tests.engine_helpers import collect, greedy, make_engine, run_core

# the exact format, and the CPU default (int8 weights on the kernels, bfloat16 KV)
FORMATS = {"exact": dict(dtype="float32"), "cpu-default": dict(dtype="auto", quantization="auto")}


# ----- the store -----------------------------------------------------------------------

def test_store_keeps_within_its_bound_dropping_the_least_recently_used(tmp_path: Path) -> None:
    store = DiskPageStore(tmp_path, "k", max_bytes=3000)
    for h in range(4):
        store.put(h, bytes(1000))
    assert 0 not in store and all(h in store for h in (1, 2, 3))
    assert store.get(1) is not None  # 1 is now the most recently used
    store.put(4, bytes(1000))
    assert 2 not in store and 1 in store and store.num_bytes <= 3000
    assert not list(store.folder.rglob(".tmp-*"))


def test_a_second_store_on_the_same_folder_finds_every_page(tmp_path: Path) -> None:
    a = DiskPageStore(tmp_path, "k", max_bytes=1 << 20)
    a.put(7, b"seven")
    b = DiskPageStore(tmp_path, "k", max_bytes=1 << 20)  # a restart, or a second engine
    assert 7 in b and b.get(7) == b"seven"
    a.put(8, b"eight")  # written after b started: found on disk
    assert 8 in b and b.get(8) == b"eight"
    a.discard(8)
    assert b.get(8) is None  # gone: a miss, not an error


def test_a_leftover_temporary_file_is_removed_at_start(tmp_path: Path) -> None:
    a = DiskPageStore(tmp_path, "k", max_bytes=1 << 20)
    a.put(0x1234, b"x")
    leftover = a.path_of(0x1234).parent / ".tmp-1-deadbeef"
    leftover.write_bytes(b"half a page")
    DiskPageStore(tmp_path, "k", max_bytes=1 << 20)
    assert not leftover.exists()


# ----- the scheduler with a real tier, no model -------------------------------------------

KEY = PageKey("w", "float32", "float32", 4, 2, 1, 4)


def _kv(num_blocks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (num_blocks, 4, 1, 4)
    return [torch.randn(shape) for _ in range(2)], [torch.randn(shape) for _ in range(2)]


def test_abort_mid_restore_frees_its_blocks_and_drops_the_result(tmp_path: Path) -> None:
    k, v = _kv(16)
    tiers = KVTiers(KEY, TierConfig(tmp_path, 1 << 20), k, v)
    pool = BlockPool(16)
    cache = RadixCache(pool, 4)
    sched = Scheduler(SchedulerConfig(4), pool, cache, tiers)
    tokens = list(range(1, 22))  # 5 whole pages and one token
    scope = CacheScope("ns|")
    refs = page_refs(tokens, scope, 4, 0, 5)
    tiers.store_pages(refs, [0, 1, 2, 3, 4])
    assert tiers.flush()
    req = Request("r", tokens, greedy(4), namespace=scope)
    sched.add(req)
    batch = sched.schedule()
    assert not batch.items and sched.restoring == [req] and req.status is RequestStatus.RESTORING
    assert len(req.block_table) == 5
    sched.check_invariants()  # the blocks being restored into count as held
    sched.remove(req)
    assert pool.num_free == 16 and not sched.has_work()
    sched.check_invariants()
    for _ in range(200):  # the reader finishes; its result is dropped
        if not tiers.pending:
            break
        tiers.poll()
        time.sleep(0.01)
    assert pool.num_free == 16 and cache.num_cached_blocks == 0
    tiers.close()


@pytest.mark.parametrize("readers", [1, 3])
def test_readers_serve_the_pages_before_a_corrupt_one_byte_identical(tmp_path: Path, readers: int) -> None:
    k, v = _kv(32)
    tiers = KVTiers(KEY, TierConfig(tmp_path, 1 << 20, readers=readers), k, v)
    tokens = list(range(1, 42))  # 10 whole pages
    refs = page_refs(tokens, CacheScope("ns|"), 4, 0, 10)
    tiers.store_pages(refs, list(range(10)))
    assert tiers.flush()
    assert tiers.store is not None
    bad = tiers.store.path_of(refs[6].chain_hash)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the payload
    bad.write_bytes(bytes(data))
    job = tiers.load(None, refs, list(range(16, 26)))
    for _ in range(500):
        if job.done:
            break
        time.sleep(0.01)
    assert job.done and len(job.pages_kv) == 6  # pages 7.. may have been read, but only the prefix serves
    assert tiers.poll() == [job]
    tiers.scatter(job)
    for layer in range(2):
        assert torch.equal(k[layer][16:22], k[layer][0:6]) and torch.equal(v[layer][16:22], v[layer][0:6])
    assert tiers.counters.corrupt == 1 and refs[6].chain_hash not in tiers.store
    tiers.close()


def test_read_into_reuses_the_scratch_and_returns_bytes_for_a_larger_file(tmp_path: Path) -> None:
    store = DiskPageStore(tmp_path, "k", max_bytes=1 << 20)
    store.put(1, b"small page")
    store.put(2, bytes(range(200)) * 10)
    scratch = bytearray(100)
    got = store.read_into(1, scratch)
    assert isinstance(got, memoryview) and bytes(got) == b"small page" and bytes(scratch[:10]) == b"small page"
    big = store.read_into(2, scratch)
    assert isinstance(big, bytes) and big == bytes(range(200)) * 10
    assert store.read_into(3, scratch) is None


# ----- the engine ---------------------------------------------------------------------------

def _chat(seed: int, n: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(n)]


async def _turn(eng, rid: str, prompt: list[int], n: int = 12):
    out = await collect(eng, GenerateRequest(rid, prompt, params=greedy(n)))
    assert out.final is not None and out.final.finish_reason == "length"
    return out


async def _evict(eng) -> None:
    await eng.call(lambda core: core.evict_all())


async def _flush(eng) -> None:
    assert await eng.call(lambda core: core.tiers.flush())


@pytest.mark.parametrize("fmt", list(FORMATS))
async def test_a_chat_evicted_from_the_pool_restores_from_disk_token_identical(fmt: str, tiny_model_dir,
                                                                               tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), **FORMATS[fmt])
    eng.start()
    try:
        prompt = _chat(1)
        first = await _turn(eng, "a1", prompt)
        hot = await _turn(eng, "a2", prompt + first.token_ids + [11, 12])  # still in the pool
        assert hot.final.usage.cached_tokens >= 144 and hot.final.usage.cached_disk_tokens == 0
        await _flush(eng)
        await _evict(eng)
        back = await _turn(eng, "a3", prompt + first.token_ids + [11, 12])
        u = back.final.usage
        assert back.token_ids == hot.token_ids
        assert u.cached_tokens == hot.final.usage.cached_tokens
        assert u.cached_disk_tokens == u.cached_tokens  # every cached token came back from disk
        stats = await eng.stats()
        assert stats["kv_disk_pages_read_total"] * 16 >= u.cached_disk_tokens
        assert stats["kv_disk_hits_total"] == 1 and stats["cached_disk_tokens_total"] == u.cached_disk_tokens
        await eng.call(lambda core: core.check_invariants())
    finally:
        eng.shutdown()


@pytest.mark.parametrize("fmt", list(FORMATS))
async def test_a_restarted_engine_restores_the_chat_from_the_same_directory(fmt: str, tiny_model_dir,
                                                                           tmp_path: Path) -> None:
    prompt = _chat(2)
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), **FORMATS[fmt])
    eng.start()
    try:
        first = await _turn(eng, "b1", prompt)
        hot = await _turn(eng, "b2", prompt + first.token_ids + [11, 12])
    finally:
        eng.shutdown()  # writes what it has queued
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), **FORMATS[fmt])
    eng.start()
    try:
        back = await _turn(eng, "b3", prompt + first.token_ids + [11, 12])
        assert back.token_ids == hot.token_ids
        assert back.final.usage.cached_disk_tokens == back.final.usage.cached_tokens >= 144
    finally:
        eng.shutdown()
    # another format's engine on the same directory never reads these pages
    other = "cpu-default" if fmt == "exact" else "exact"
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), **FORMATS[other])
    eng.start()
    try:
        cold = await _turn(eng, "b4", prompt + first.token_ids + [11, 12])
        assert cold.final.usage.cached_tokens == 0
    finally:
        eng.shutdown()


async def test_a_corrupt_page_is_recomputed_and_the_pages_before_it_restored(tiny_model_dir, tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), dtype="float32")
    eng.start()
    try:
        prompt = _chat(3, 200)
        first = await _turn(eng, "c1", prompt)
        await _flush(eng)
        await _evict(eng)
        # flip one byte of page 5 (of 12): pages 0-4 restore, 5 on are recomputed
        core = eng.core
        scope = CacheScope(namespace_of(core.namespace))
        ref = page_refs(prompt, scope, 16, 5, 6)[0]
        assert core.tiers is not None and core.tiers.store is not None
        path = core.tiers.store.path_of(ref.chain_hash)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
        again = await _turn(eng, "c2", prompt)
        assert again.token_ids == first.token_ids
        assert again.final.usage.cached_disk_tokens == again.final.usage.cached_tokens == 5 * 16
        stats = await eng.stats()
        assert stats["kv_disk_pages_corrupt_total"] == 1
        assert not path.exists() or path.read_bytes() != bytes(data)  # deleted, or written anew
        await eng.call(lambda c: c.check_invariants())
    finally:
        eng.shutdown()


async def test_other_requests_run_while_one_restores(tiny_model_dir, tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), dtype="float32")
    eng.start()
    try:
        prompts = [_chat(10 + i, 120) for i in range(4)]
        firsts = await asyncio.gather(*(_turn(eng, f"d{i}", p) for i, p in enumerate(prompts)))
        await _flush(eng)
        await _evict(eng)
        again = await asyncio.gather(*(_turn(eng, f"e{i}", p) for i, p in enumerate(prompts)),
                                     _turn(eng, "new", _chat(99, 60)))
        for f, a in zip(firsts, again):
            assert a.token_ids == f.token_ids and a.final.usage.cached_disk_tokens == 112
        await eng.call(lambda c: c.check_invariants())
    finally:
        eng.shutdown()


def test_a_failed_write_disables_the_tier_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    k, v = _kv(8)
    tiers = KVTiers(KEY, TierConfig(tmp_path, 1 << 20), k, v)
    assert tiers.store is not None
    refs = page_refs(list(range(1, 14)), CacheScope("ns|"), 4, 0, 3)
    for r in refs:  # a file where each page's folder should be: every write fails (as a full disk would)
        tiers.store.path_of(r.chain_hash).parent.write_bytes(b"")
    with caplog.at_level("WARNING", logger="engine.tiers.manager"):
        tiers.store_pages(refs, [0, 1, 2])
        assert tiers.flush()
    assert not tiers.active and tiers.counters.pages_written == 0 and tiers.counters.dropped == 3
    assert len([r for r in caplog.records if "disabled" in r.getMessage()]) == 1
    assert tiers.probe(refs) == 0  # off: nothing is restored, the engine serves from its pool
    tiers.close()


async def test_write_back_writes_a_page_only_when_the_pool_evicts_it_and_restores_it(tiny_model_dir,
                                                                                   tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_disk_write="back")
    eng.start()
    try:
        prompt = _chat(5)
        first = await collect(eng, GenerateRequest("w1", prompt, params=greedy(12), cache_salt="user-7"))
        await _flush(eng)
        assert await eng.call(lambda core: core.tiers.store.num_pages) == 0  # nothing written on insert
        await _evict(eng)
        await _flush(eng)
        assert await eng.call(lambda core: core.tiers.store.num_pages) >= 9  # written as they left
        back = await collect(eng, GenerateRequest("w2", prompt + first.token_ids + [11, 12], params=greedy(12),
                                                  cache_salt="user-7"))
        u = back.final.usage
        assert u.cached_disk_tokens == u.cached_tokens >= 144  # the salted pages came back, named right
    finally:
        eng.shutdown()


# ----- write-idle: write-back, plus the tree's pages while idle and at a graceful stop ---------

async def _until(eng, check, timeout_s: float = 60.0) -> bool:
    """Poll ``check(core)`` on the step loop until it holds (a wait, not a timing assert)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await eng.call(check):
            return True
        await asyncio.sleep(0.02)
    return False


async def test_write_idle_puts_a_finished_chats_pages_on_disk_while_idle_without_eviction(tiny_model_dir,
                                                                                       tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_disk_write="idle")
    eng.start()
    try:
        prompt = _chat(5)
        first = await _turn(eng, "i1", prompt)
        cached = await eng.call(lambda core: core.cache.num_cached_blocks)
        assert cached >= 9
        # every page of the tree reaches disk with nothing evicted from the pool
        assert await _until(eng, lambda core: core.tiers.store.num_pages == core.cache.num_cached_blocks
                            and not core.tiers.writes_queued)
        assert await eng.call(lambda core: core.cache.num_cached_blocks) == cached
        assert await eng.call(lambda core: core.tiers.counters.pages_written) == cached
        await eng.call(lambda core: core.check_invariants())  # block accounting holds
        await _evict(eng)  # now the pool forgets it: the next turn comes from disk
        back = await _turn(eng, "i2", prompt + first.token_ids + [11, 12])
        assert back.final.usage.cached_disk_tokens == back.final.usage.cached_tokens >= 144
        await eng.call(lambda core: core.check_invariants())
    finally:
        eng.shutdown()


def test_write_idle_stops_at_the_next_page_when_a_request_arrives(tiny_model_dir, tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_disk_write="idle")
    core = eng.core
    try:
        core.add_request("a", _chat(7), greedy(4))
        run_core(core)
        tree = core.cache.num_cached_blocks
        assert tree >= 9 and core.tiers.unwritten and core.tiers.counters.pages_written == 0
        arrived = iter([False, False, True])  # a request arrives while the third page is due
        more = core.write_idle(lambda: next(arrived))
        assert more  # it stopped early: pages are left
        assert core.tiers.flush() and core.tiers.counters.pages_written == 2  # two pages, not a third
        assert core.write_idle(lambda: False) is False  # the rest (tiny pages: all fit one idle moment)
        assert core.tiers.flush() and not core.tiers.unwritten
        assert core.tiers.counters.pages_written == tree  # each page once
        core.check_invariants()
        assert core.cache.num_cached_blocks == tree  # nothing was evicted
    finally:
        core.close()


async def test_write_back_alone_writes_nothing_while_idle(tiny_model_dir, tmp_path: Path) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_disk_write="back")
    core = eng.core
    try:
        core.add_request("a", _chat(8), greedy(4))
        run_core(core)
        assert core.write_idle(lambda: False) is False
        assert core.tiers.flush() and core.tiers.counters.pages_written == 0
    finally:
        core.close()
    assert core.tiers.counters.pages_written == 0  # nor at the stop


def _run_with_restores(core, timeout_s: float = 60.0) -> dict:
    """``run_core`` for a core whose requests restore from disk: the readers are threads,
    so an idle step waits for them instead of spinning past them."""
    finals = {}
    deadline = time.monotonic() + timeout_s
    while core.has_work() and time.monotonic() < deadline:
        finals.update({o.request_id: o for o in core.step() if o.finished})
        if core.waiting_on_tiers:
            time.sleep(0.005)
    assert not core.has_work(), "engine did not drain"
    return finals


def test_write_idle_at_a_graceful_stop_writes_the_tree_and_a_new_engine_restores_it(tiny_model_dir, tmp_path: Path,
                                                                                   caplog) -> None:
    eng = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_disk_write="idle")
    core = eng.core
    prompt = _chat(9)
    core.add_request("a", prompt, greedy(12))
    first = run_core(core)["a"]
    tree = core.cache.num_cached_blocks
    assert core.tiers.counters.pages_written == 0  # never idle in the step loop: nothing written yet
    with caplog.at_level("INFO", logger="engine.engine_core"):
        core.close()
    assert core.tiers.counters.pages_written == tree
    assert any(f"wrote {tree} pages of the cache at stop, 0 left unwritten" in r.getMessage()
               for r in caplog.records)
    again = make_engine(tiny_model_dir, kv_disk_dir=str(tmp_path), kv_disk_write="idle").core  # a restart
    try:
        again.add_request("b", prompt + first.output_token_ids + [11, 12], greedy(12))
        back = _run_with_restores(again)["b"]
        assert back.usage.cached_disk_tokens == back.usage.cached_tokens >= 144
        again.check_invariants()
    finally:
        again.close()
