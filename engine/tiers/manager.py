"""The KV tiers beneath the pool: pages written off the step loop, restored on a match.

Algorithm: hierarchical KV caching as in SGLang's HiCache and vLLM's KV offloading
(written from their descriptions): the pool and its radix tree are the first tier; a
page that enters the tree is also written to the next tier (write-through, see
``docs/kv_tiers.md`` for the measurement that chose it); a prompt whose prefix goes on
past the tree's match into the tier gets those pages read back into fresh blocks and
inserted into the tree before its prefill.

Threads: the step loop calls ``probe``, ``store``, ``load`` and ``poll``; one writer thread
encodes and writes pages, reader threads (``TierConfig.readers``, one restore at a time,
its pages split among them) read and check them, so a restore never waits behind a queue
of writes. What crosses between them:

- a write: the page's K and V copied out of the pool on the step loop (a block can be
  handed to another request the moment it is evicted), so the writer never touches the
  pool; the queue is bounded in bytes (``TierConfig.max_queue_bytes``), and a page that
  does not fit is dropped (counted) and written the next time it enters the tree;
- a read (``LoadJob``): the reader fills ``job.pages_kv`` with the longest prefix of pages
  it could read and check; the step loop copies them into the blocks it reserved. The
  reader never touches the pool either, so aborting a request mid-restore just frees its
  blocks on the step loop and drops the job's result.

A full disk or any other I/O error on write disables the tier with one warning; the
engine keeps serving from the pool.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.block_hash import namespace_seed, prompt_block_hashes
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import populate_blocks
from engine.kv_page import (
    PageError,
    PageHeader,
    PageKey,
    decode_page,
    encode_page,
    gather_blocks,
    scatter_blocks,
    scope_digest,
)
from engine.radix_cache import CacheScope
from engine.tiers.disk import DiskPageStore

log = logging.getLogger(__name__)

WRITER_NICE = 10  # the writer thread's nice value (Linux): it yields the CPU to the forward's threads
RESTORE_YIELD_S = 2.0  # the longest the writer waits for a restore in flight before each page

__all__ = ["LoadJob", "PageRef", "TierConfig", "TierCounters", "KVTiers", "page_key", "page_refs", "tiers_for"]


@dataclass(frozen=True)
class TierConfig:
    """Settings of the KV tiers.

    Attributes:
        disk_dir: the disk tier's store directory; None turns the disk tier off.
        disk_bytes: the most bytes of page files kept there.
        max_queue_bytes: the most bytes of pages waiting to be written (copied out of
            the pool); pages beyond it are dropped, not waited for.
        write_back: write a page when the pool evicts it (write-back) instead of when it
            enters the tree (write-through, the default; docs/kv_tiers.md has the
            measurement that chose it).
        readers: threads that read one restore's pages (page ``i`` by reader ``i %
            readers``): reading a file and its CRC-32 release the GIL, so a restore runs
            on as many cores as there are readers while the step loop waits for it.
    """

    disk_dir: Path | None
    disk_bytes: int
    max_queue_bytes: int = 256 << 20
    write_back: bool = False
    readers: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))


@dataclass(frozen=True)
class PageRef:
    """One page of a request's tokens, named as the tiers name it.

    Attributes:
        index: its position in the request's tokens (page ``index`` holds tokens
            ``[index * block_size, (index + 1) * block_size)``).
        chain_hash: its chained block hash (``engine.block_hash``).
        parent_hash: the previous page's chained hash (the namespace's seed for page 0).
        token_ids: its ``block_size`` tokens.
        scope: ``scope_digest`` of where it lives in the tree (the salt only past the
            shared pages).
    """

    index: int
    chain_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    scope: str


def page_refs(tokens: Sequence[int], scope: CacheScope, block_size: int, start: int, end: int) -> list[PageRef]:
    """The ``PageRef`` of pages ``start .. end-1`` of ``tokens`` in ``scope`` (whole pages;
    ``end`` at most ``len(tokens) // block_size``)."""
    if end <= start:
        return []
    hashes = prompt_block_hashes(tokens[: end * block_size], block_size, scope.namespace, scope.salt,
                                 scope.shared_tokens)
    seed = namespace_seed(scope.namespace)
    shared = scope.shared_tokens // block_size if scope.salt else end
    salted, plain = scope_digest(scope.namespace, scope.salt), scope_digest(scope.namespace)
    return [PageRef(i, hashes[i], hashes[i - 1] if i else seed,
                    tuple(tokens[i * block_size:(i + 1) * block_size]), plain if i < shared else salted)
            for i in range(start, end)]


@dataclass
class TierCounters:
    """Totals since start, per tier (only "disk" exists on the CPU).

    Attributes:
        pages_written, bytes_written: pages (bytes) the tier stored.
        pages_read, bytes_read: pages (bytes) it read back and checked.
        hits: restores that brought back at least one page; misses: probes of a prompt
            longer than the pool's match that found nothing to restore.
        dropped: pages not written (write queue full, or the tier disabled).
        corrupt: pages refused on read (checksum, truncation, another key) and deleted.
        restore_ms: wall time of restores, from the request's wait to its pages in the tree.
    """

    pages_written: int = 0
    bytes_written: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    hits: int = 0
    misses: int = 0
    dropped: int = 0
    corrupt: int = 0
    restores: int = 0
    restore_ms: float = 0.0


@dataclass(eq=False)
class LoadJob:
    """One request's restore in flight.

    Attributes:
        request: the waiting request (the step loop's object; the reader never touches it).
        pages: the pages to read, in order.
        blocks: the pool blocks reserved for them (the step loop's; one per page).
        pages_kv: filled by the reader: one page tensor per page read and checked, the
            longest contiguous prefix of ``pages`` (views of ``buffer``).
        buffer: [len(pages), num_layers, 2, block_size, num_kv_heads, head_dim] of the KV
            dtype, CPU: where the reader decodes the pages (allocated by the reader).
        done: set by the reader when it is finished with the job.
        cancelled: set by the step loop (abort): the result is dropped.
        started_s: time.monotonic() when it was queued.
    """

    request: Any
    pages: list[PageRef]
    blocks: list[int]
    pages_kv: list[torch.Tensor] = field(default_factory=list)
    buffer: torch.Tensor | None = None
    done: bool = False
    cancelled: bool = False
    started_s: float = field(default_factory=time.monotonic)
    limit: int = 1 << 62  # the readers': the first page index that failed so far


class KVTiers:
    """The tiers beneath one engine's pool (today: the disk tier).

    Args:
        key: the page key of this engine's pages (weights, formats, shapes).
        config: the tier settings.
        k_caches, v_caches: the pool's per-layer caches (``engine.kv_cache.KVCache``).
        wake: called from the reader thread when a restore is done (the step loop may be
            idle waiting for it).

    Raises:
        OSError: the store directory cannot be created or read.
    """

    def __init__(self, key: PageKey, config: TierConfig, k_caches: list[torch.Tensor],
                 v_caches: list[torch.Tensor], wake: Callable[[], None] | None = None) -> None:
        self.key = key
        self.config = config
        self._k, self._v = k_caches, v_caches
        self.wake = wake
        self.counters = TierCounters()
        self.disabled = config.disk_dir is None
        self.store: DiskPageStore | None = None
        if config.disk_dir is not None:
            self.store = DiskPageStore(config.disk_dir, key.fingerprint(), config.disk_bytes)
        self._lock = threading.Lock()
        self._queued: set[int] = set()  # hashes waiting to be written
        self._queued_bytes = 0
        self._writes: queue.Queue[tuple[PageRef, torch.Tensor] | None] = queue.Queue()
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._jobs: list[LoadJob] = []  # the step loop's: queued, not yet polled
        self._no_restore = threading.Event()  # clear while the readers work: the writer waits
        self._no_restore.set()
        self._spare: torch.Tensor | None = None  # a restore buffer kept for the next one (``_take_buffer``)
        self._helpers = (ThreadPoolExecutor(config.readers - 1, thread_name_prefix="kv-tier-reader")
                         if config.readers > 1 and self.store is not None else None)
        self._threads = [threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True),
                         threading.Thread(target=self._read_loop, name="kv-tier-reader", daemon=True)]
        if self.store is not None:
            for t in self._threads:
                t.start()

    # --- step loop -----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """The tier takes writes and serves reads."""
        return not self.disabled and self.store is not None

    def probe(self, pages: Sequence[PageRef]) -> int:
        """How many leading ``pages`` the tier holds (a miss ends the run: only a
        contiguous prefix can be restored). Counts a miss when it holds none."""
        if not self.active or not pages:
            return 0
        assert self.store is not None
        n = 0
        for p in pages:
            if p.chain_hash not in self.store:
                break
            n += 1
        if n == 0:
            self.counters.misses += 1
        return n

    def store_pages(self, pages: Sequence[PageRef], blocks: Sequence[int]) -> None:
        """Queue pages that just entered the tree for writing (write-through); the ones the
        tier already holds or has queued are skipped. Copies each page's K and V out of
        the pool now (``gather_blocks``).

        Args:
            pages: the pages, in any order.
            blocks: their pool blocks (one per page).
        """
        if not self.active:
            return
        assert self.store is not None
        size = self.key.payload_bytes
        todo: list[tuple[PageRef, int]] = []
        for p, b in zip(pages, blocks):
            if p.chain_hash in self._queued or p.chain_hash in self.store:
                continue
            with self._lock:
                if self._queued_bytes + size > self.config.max_queue_bytes:
                    self.counters.dropped += 1
                    continue
                self._queued_bytes += size
                self._queued.add(p.chain_hash)
            todo.append((p, b))
        if not todo:
            return
        kv = gather_blocks(self._k, self._v, [b for _, b in todo]).to("cpu")  # one copy per layer
        for i, (p, _) in enumerate(todo):
            self._writes.put((p, kv[i]))

    def store_evicted(self, node: Any, parent_hash: int, namespace: str, salt: str | None) -> None:
        """Write-back: queue the pages of a radix node the pool is evicting
        (``RadixCache.on_evict``), copied out of its blocks before they are freed.

        Args:
            node: the ``engine.radix_cache.RadixNode`` (its tokens, blocks and hashes).
            parent_hash: the chained hash before its first page.
            namespace, salt: where it lives in the tree (salt None: the shared part).
        """
        if not self.active or not node.hashes:
            return
        bs = self.key.block_size
        scope = scope_digest(namespace) if salt is None else scope_digest(namespace, salt)
        hashes = node.hashes
        refs = [PageRef(i, h, hashes[i - 1] if i else parent_hash, tuple(node.tokens[i * bs:(i + 1) * bs]), scope)
                for i, h in enumerate(hashes)]
        self.store_pages(refs, node.blocks)

    def load(self, request: Any, pages: list[PageRef], blocks: list[int]) -> LoadJob:
        """Queue a restore of ``pages`` into ``blocks`` (reserved by the caller); ``poll``
        hands it back when the reader is done."""
        job = LoadJob(request, pages, blocks)
        self._jobs.append(job)
        self._loads.put(job)
        return job

    def scatter(self, job: LoadJob) -> None:
        """Copy a finished job's pages into its blocks (step loop, between steps); its
        buffer goes back for the next restore."""
        k = len(job.pages_kv)
        if k:
            assert job.buffer is not None
            scatter_blocks(self._k, self._v, job.blocks[:k], job.buffer[:k])
        self._give_back(job)

    def _take_buffer(self, pages: int) -> torch.Tensor:
        """[pages, *page shape] of the KV dtype, CPU: the kept buffer when it is large
        enough (its memory already faulted in: a fresh 55 MB buffer cost a 2,400-token
        restore about 30 ms of page faults), else a new one."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.shape[0] >= pages:
            return spare[:pages]
        return torch.empty((pages, *self.key.shape), dtype=self.key.torch_dtype)

    def _give_back(self, job: LoadJob) -> None:
        """Keep a finished job's buffer for the next restore (the larger of it and the
        one kept, up to ``TierConfig.max_queue_bytes``)."""
        buf, job.buffer, job.pages_kv = job.buffer, None, []
        if buf is None or buf.numel() * buf.element_size() > self.config.max_queue_bytes:
            return
        base = buf if buf._base is None else buf._base
        with self._lock:
            if self._spare is None or self._spare.shape[0] < base.shape[0]:
                self._spare = base

    def poll(self) -> list[LoadJob]:
        """The restores the reader finished since the last call (cancelled ones dropped),
        oldest first; each counts its restore time."""
        if not self._jobs:
            return []
        done = [j for j in self._jobs if j.done]
        if not done:
            return []
        self._jobs = [j for j in self._jobs if not j.done]
        out = []
        now = time.monotonic()
        for j in done:
            if j.cancelled:
                self._give_back(j)
                continue
            self.counters.restores += 1
            self.counters.restore_ms += (now - j.started_s) * 1000
            if j.pages_kv:
                self.counters.hits += 1
            out.append(j)
        return out

    @property
    def pending(self) -> int:
        """Restores queued and not yet polled."""
        return len(self._jobs)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not self._queued:
                    return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        """Write what is queued (up to a few seconds), then stop the threads."""
        if self.store is not None and self._threads[0].is_alive():
            self.flush(5.0)
            self._writes.put(None)
            self._loads.put(None)
            for t in self._threads:
                t.join(timeout=5)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes (pages, bytes, ms) for engine stats and /metrics."""
        c = self.counters
        store = self.store
        return {
            "kv_disk_enabled": self.active,
            "kv_disk_pages": store.num_pages if store else 0,
            "kv_disk_bytes": store.num_bytes if store else 0,
            "kv_disk_pages_written_total": c.pages_written,
            "kv_disk_bytes_written_total": c.bytes_written,
            "kv_disk_pages_read_total": c.pages_read,
            "kv_disk_bytes_read_total": c.bytes_read,
            "kv_disk_hits_total": c.hits,
            "kv_disk_misses_total": c.misses,
            "kv_disk_pages_dropped_total": c.dropped,
            "kv_disk_pages_corrupt_total": c.corrupt,
            "kv_disk_pages_evicted_total": store.evicted if store else 0,
            "kv_disk_restores_total": c.restores,
            "kv_disk_restore_ms_total": round(c.restore_ms, 3),
        }

    # --- worker threads -------------------------------------------------------------------

    def _disable(self, why: str) -> None:
        if not self.disabled:
            self.disabled = True
            log.warning("KV disk tier disabled (%s); the engine keeps serving from its pool", why)

    def _write_loop(self) -> None:
        assert self.store is not None
        try:  # writes can wait: on Linux a thread's nice value is its own; the step loop's threads go first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            item = self._writes.get()
            if item is None:
                return
            # a restore in flight goes first: a chat is waiting for it, while writes can wait
            # (encoding a page holds the GIL the readers need; at most RESTORE_YIELD_S a page)
            self._no_restore.wait(RESTORE_YIELD_S)
            page, kv = item
            try:
                if not self.disabled:
                    data = encode_page(PageHeader(self.key, page.scope, page.chain_hash, page.parent_hash,
                                                  page.token_ids), kv)
                    self.store.put(page.chain_hash, data)
                    self.counters.pages_written += 1
                    self.counters.bytes_written += len(data)
                else:
                    self.counters.dropped += 1
            except OSError as e:
                self.counters.dropped += 1
                self._disable(f"write failed: {e}")
            except Exception:  # a bug must not kill the thread and leave pages queued forever
                self.counters.dropped += 1
                log.exception("KV tier write failed")
            finally:
                with self._lock:
                    self._queued.discard(page.chain_hash)
                    self._queued_bytes -= self.key.payload_bytes

    def _read_loop(self) -> None:
        assert self.store is not None
        scratch = bytearray(self.key.payload_bytes + (64 << 10))  # one page file (payload + header), reused
        helpers = self._helpers
        while True:
            job = self._loads.get()
            if job is None:
                if helpers is not None:
                    helpers.shutdown(wait=True)
                return
            self._no_restore.clear()
            try:
                job.buffer = self._take_buffer(len(job.pages))
                populate_blocks(self._k, self._v, job.blocks)  # the pool's page faults, here rather than in scatter
                n, ways = len(job.pages), self.config.readers
                if helpers is None or n < 2 * ways:
                    good = self._read_stride(job, 0, 1, scratch)
                else:  # page i by reader i % ways; this thread is reader 0
                    parts = [helpers.submit(self._read_stride, job, w, ways, None) for w in range(1, ways)]
                    good = self._read_stride(job, 0, ways, scratch)
                    good = min([good] + [f.result() for f in parts])
                assert job.buffer is not None
                job.pages_kv = list(job.buffer[:good].unbind(0))
            except Exception:
                job.pages_kv = []
                log.exception("KV tier read failed")
            finally:
                job.done = True
                if self._loads.empty():
                    self._no_restore.set()
                if self.wake is not None:
                    self.wake()

    def _read_stride(self, job: LoadJob, first: int, step: int, scratch: bytearray | None) -> int:
        """Read pages ``first, first + step, ...`` of ``job`` into its buffer, in order, up to
        the first that cannot be served; returns that page's index (``len(job.pages)`` when
        all were), so the smallest over the strides ends the contiguous prefix served. Stops
        early once another stride failed before its next page (``job.limit``)."""
        if scratch is None:
            scratch = bytearray(self.key.payload_bytes + (64 << 10))
        assert job.buffer is not None
        for i in range(first, len(job.pages), step):
            if job.cancelled or self.disabled or i >= job.limit:
                return i
            if self._read(job.pages[i], job.buffer[i], scratch) is None:
                job.limit = min(job.limit, i)
                return i
        return len(job.pages)

    def _read(self, p: PageRef, out: torch.Tensor, scratch: bytearray) -> torch.Tensor | None:
        """One page's K and V, checked, read into ``out`` (through ``scratch``, the file's
        bytes); None (and the file deleted when it is bad) when it cannot be served."""
        assert self.store is not None
        try:
            data = self.store.read_into(p.chain_hash, scratch)
        except OSError as e:
            log.warning("KV tier read of page %016x failed: %s", p.chain_hash, e)
            return None
        if data is None:
            return None
        try:
            page = decode_page(data, self.key, scope=p.scope, chain_hash=p.chain_hash,
                               parent_hash=p.parent_hash, token_ids=p.token_ids, out=out)
        except (PageError, ValueError) as e:
            with self._lock:
                self.counters.corrupt += 1
            self.store.discard(p.chain_hash)
            log.warning("KV tier page %016x refused (%s); recomputing it", p.chain_hash, e)
            return None
        with self._lock:  # several readers
            self.counters.pages_read += 1
            self.counters.bytes_read += len(data)
        return page.kv


@functools.lru_cache(maxsize=1)
def engine_code_id() -> str:
    """16 hex digits of SHA-256 over the engine's own source files (``engine/**/*.py``
    and ``*.c``): pages written by other code (an upgrade, a changed kernel) are
    another key and are recomputed, never restored. Costs one read of the sources
    (about 1 MB) per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def page_key(config: EngineConfig, model_config: ModelConfig, weights_id: str) -> PageKey:
    """The page key of an engine serving ``weights_id`` with the resolved ``config``; the
    model id also names the engine's code (``engine_code_id``)."""
    kv = config.kv_cache_dtype if config.kv_cache_dtype != "auto" else config.dtype
    return PageKey(model_id=f"{weights_id}+{engine_code_id()}", weight_format=config.quantization or config.dtype,
                   kv_dtype=kv,
                   block_size=config.block_size, num_layers=model_config.num_layers,
                   num_kv_heads=model_config.num_kv_heads, head_dim=model_config.head_dim)


def tiers_for(config: EngineConfig, model_config: ModelConfig, weights_id: str, k_caches: list[torch.Tensor],
              v_caches: list[torch.Tensor]) -> KVTiers | None:
    """The tiers ``config`` asks for (None when the disk tier is off, or its directory
    cannot be used: then one warning, and the engine serves from its pool alone)."""
    if config.kv_disk_dir is None or not config.enable_prefix_cache:
        return None
    from engine.tiers.disk import default_disk_bytes

    folder = Path(config.kv_disk_dir).expanduser()
    size = config.kv_disk_bytes if config.kv_disk_bytes is not None else default_disk_bytes(folder)
    try:
        tiers = KVTiers(page_key(config, model_config, weights_id),
                        TierConfig(folder, size, write_back=config.kv_disk_write == "back"), k_caches, v_caches)
    except OSError as e:
        log.warning("KV disk tier off: cannot use %s (%s)", folder, e)
        return None
    assert tiers.store is not None
    log.info("KV disk tier: %s, %d pages (%.2f GiB) found, bound %.2f GiB", tiers.store.folder,
             tiers.store.num_pages, tiers.store.num_bytes / 2**30, size / 2**30)
    return tiers
