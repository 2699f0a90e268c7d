"""The KV tiers beneath the pool: pages written off the step loop, restored on a match.

Algorithm: hierarchical KV caching as in SGLang's HiCache and vLLM's KV offloading
(written from their descriptions): the pool and its radix tree are the first tier; a
page that enters the tree is also written to the next tier (write-through, see
``docs/kv_tiers.md`` for the measurement that chose it); a prompt whose prefix goes on
past the tree's match into the tier gets those pages read back into fresh blocks and
inserted into the tree before its prefill.

The host-memory tier (``engine.tiers.host``) sits between the pool and the disk: pages go
into it as they enter the tree, a restore copies from it before asking the disk, and its
evictions are demoted to the disk; on a CUDA pool its copies run on a side stream, and
the blocks they read stay referenced (``store_pages`` returns them, ``settle`` gives them
back) until they land.

Threads: the step loop calls ``probe``, ``store_pages``, ``load``, ``poll`` and ``settle``; one writer thread
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.block_hash import namespace_seed, prompt_block_hashes
from engine.config import EngineConfig, ModelConfig
from engine.host_memory import available_bytes
from engine.kv_cache import populate_blocks
from engine.kv_page import (
    PageError,
    PageHeader,
    PageKey,
    decode_page,
    encode_page_parts,
    gather_blocks,
    scatter_blocks,
    scope_digest,
)
from engine.radix_cache import CacheScope
from engine.tiers.disk import DiskPageStore
from engine.tiers.host import HostPageStore, default_host_bytes, pool_to_slots, slots_to_pool

log = logging.getLogger(__name__)

WRITER_NICE = 10  # the writer thread's nice value (Linux): it yields the CPU to the forward's threads
RESTORE_YIELD_S = 2.0  # the longest the writer waits for a restore in flight before each page
IDLE_WRITE_BYTES = 4 << 20  # write-idle: pages queued per idle moment (bytes of payload, at least one page)
STOP_FLUSH_S = 8.0  # write-idle: the longest a graceful stop writes the tree (within a 10 s stop grace)

__all__ = ["LoadJob", "PageRef", "TierConfig", "TierCounters", "KVTiers", "host_tier_on", "page_key", "page_refs",
           "tiers_for"]


@dataclass(frozen=True)
class TierConfig:
    """Settings of the KV tiers.

    Attributes:
        disk_dir: the disk tier's store directory; None turns the disk tier off.
        disk_bytes: the most bytes of page files kept there.
        max_queue_bytes: the most bytes of pages waiting to be written (copied out of
            the pool); pages beyond it are dropped, not waited for.
        write_back: write a page when the pool evicts it (write-back) instead of when it
            enters the tree (write-through; docs/kv_tiers.md has the measurement).
        write_idle: with ``write_back``, also write the tree's pages while the engine is
            idle (``write_unwritten``) and at a graceful stop (``flush_tree``).
        readers: threads that read one restore's pages (page ``i`` by reader ``i %
            readers``): reading a file and its CRC-32 release the GIL, so a restore runs
            on as many cores as there are readers while the step loop waits for it.
        host_bytes: the host-memory tier's size in bytes (``engine.tiers.host``); 0 turns
            it off. Its slab is pinned when CUDA is available.
    """

    disk_dir: Path | None
    disk_bytes: int
    max_queue_bytes: int = 256 << 20
    write_back: bool = False
    write_idle: bool = False
    readers: int = field(default_factory=lambda: max(1, min(4, os.cpu_count() or 1)))
    host_bytes: int = 0


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
    """Totals since start, of one tier (``KVTiers.counters``: disk, ``host_counters``: host memory).

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

    def stats(self, tier: str) -> dict[str, int]:
        """The totals every tier counts, named ``kv_{tier}_..._total`` for engine stats."""
        return {
            f"kv_{tier}_pages_written_total": self.pages_written,
            f"kv_{tier}_bytes_written_total": self.bytes_written,
            f"kv_{tier}_pages_read_total": self.pages_read,
            f"kv_{tier}_bytes_read_total": self.bytes_read,
            f"kv_{tier}_hits_total": self.hits,
            f"kv_{tier}_misses_total": self.misses,
            f"kv_{tier}_pages_dropped_total": self.dropped,
        }


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
        host_slots: page index -> host slot, for the pages served from host memory
            (copied into their blocks by ``load``: on the CPU at once, on a CUDA pool on
            the side stream, ``host_copy``).
        disk_idx: the indexes of the pages the disk readers read.
        served: the pages restored, a contiguous prefix (set when ``done``).
        host_copy: (CUDA event, staged device tensor) of the copy from host memory in
            flight, or None.
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
    host_slots: dict[int, int] = field(default_factory=dict)
    disk_idx: list[int] = field(default_factory=list)
    served: int = 0
    host_copy: Any = None

    @property
    def host_served(self) -> int:
        """Pages of the served prefix that came from host memory."""
        return sum(1 for i in self.host_slots if i < self.served)

    def copied(self) -> bool:
        """The copy from host memory (if any) has landed in the blocks."""
        return self.host_copy is None or bool(self.host_copy[0].query())


class KVTiers:
    """The tiers beneath one engine's pool: host memory (``config.host_bytes``) and disk.

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
        self.host_counters = TierCounters()
        self.disabled = config.disk_dir is None  # the disk tier's (a failed write sets it)
        self.store: DiskPageStore | None = None
        if config.disk_dir is not None:
            self.store = DiskPageStore(config.disk_dir, key.fingerprint(), config.disk_bytes)
        self.host: HostPageStore | None = None
        device = k_caches[0].device
        # device copies to and from the host tier run on this side stream (None: the CPU, synchronous)
        self._stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None
        if config.host_bytes > 0:
            self.host = HostPageStore(key, config.host_bytes, pin=device.type == "cuda")
            self.host.on_evict = self._demote
        # copies out of the pool in flight (CUDA): (event, staged tensor, blocks the KV manager pinned)
        self._outbound: list[tuple[Any, Any, list[int]]] = []
        self._host_refs: dict[int, PageRef] = {}  # the host tier's pages, named for a demotion's header
        self._lock = threading.Lock()
        self._queued: set[int] = set()  # hashes waiting to be written
        self._queued_bytes = 0
        # a page and its K and V (a copy) or its host slot (pinned until written)
        self._writes: queue.Queue[tuple[PageRef, torch.Tensor | int] | None] = queue.Queue()
        self._loads: queue.Queue[LoadJob | None] = queue.Queue()
        self._jobs: list[LoadJob] = []  # the step loop's: queued, not yet polled
        self._no_restore = threading.Event()  # clear while the readers work: the writer waits
        self._no_restore.set()
        self._spare: torch.Tensor | None = None  # a restore buffer kept for the next one (``_take_buffer``)
        # write-idle: the tree may hold pages the disk lacks (set as pages enter the tree)
        self.unwritten = False
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
        """Some tier (host memory or disk) takes writes and serves reads."""
        return self.host is not None or self.disk_active

    @property
    def disk_active(self) -> bool:
        """The disk tier takes writes and serves reads."""
        return not self.disabled and self.store is not None

    def probe(self, pages: Sequence[PageRef]) -> int:
        """How many leading ``pages`` the tiers hold, each in host memory or on disk (a
        miss ends the run: only a contiguous prefix can be restored). Counts a miss when
        they hold none."""
        if not self.active or not pages:
            return 0
        host, store = self.host, (self.store if self.disk_active else None)
        n = 0
        for p in pages:
            if not ((host is not None and p.chain_hash in host) or (store is not None and p.chain_hash in store)):
                break
            n += 1
        if n == 0:
            self.counters.misses += 1
            if host is not None:
                self.host_counters.misses += 1
        return n

    def store_pages(self, pages: Sequence[PageRef], blocks: Sequence[int], evicting: bool = False) -> list[int]:
        """Copy pages into the tiers: pages that just entered the tree (write-through), or
        pages the pool is evicting (write-back, ``evicting``). With the host tier on, each
        page not held there gets a slot and is copied into it (on a CUDA pool
        asynchronously, on the side stream), and the disk write of a page, when the disk
        does not hold it, is queued from that slot; without it, the page's K and V are
        copied out of the pool now (``gather_blocks``) and queued for the disk writer.
        Pages the tiers already hold or have queued are skipped.

        Args:
            pages: the pages, in any order.
            blocks: their pool blocks (one per page).
            evicting: the blocks are being freed now: a CUDA copy out of them is ordered
                before any later work on the current stream instead of pinning them.

        Returns:
            Blocks the caller must keep allocated (one reference each) until ``settle``
            hands them back: their copy to host memory is in flight (CUDA only; on the
            CPU every copy is done on return, and the list is empty).
        """
        if not self.active or not pages:
            return []
        if self.host is not None:
            return self._store_host(pages, blocks, evicting)
        self._queue_disk_copies(pages, blocks)
        return []

    def _store_host(self, pages: Sequence[PageRef], blocks: Sequence[int], evicting: bool) -> list[int]:
        """``store_pages`` with the host tier on."""
        host = self.host
        assert host is not None
        new: list[tuple[PageRef, int]] = []
        for p, b in zip(pages, blocks):
            if host.lookup(p.chain_hash) is None:
                new.append((p, b))
        if not new:
            return []
        if len(new) > host.capacity:  # more than host memory holds: the first pages go straight to disk
            over, new = new[:-host.capacity], new[-host.capacity:]
            self.host_counters.dropped += len(over)
            self._queue_disk_copies([p for p, _ in over], [b for _, b in over])
        slots = host.allocate([p.chain_hash for p, _ in new])
        if len(slots) < len(new):  # the other slots are pinned by copies in flight: to disk, as above
            self.host_counters.dropped += len(new) - len(slots)
            self._queue_disk_copies([p for p, _ in new[len(slots):]], [b for _, b in new[len(slots):]])
            new = new[:len(slots)]
        if not slots:
            return []
        for p, _ in new:
            self._host_refs[p.chain_hash] = p
        src = [b for _, b in new]
        copy = pool_to_slots(self._k, self._v, src, host.slab, slots, self._stream)
        self.host_counters.pages_written += len(slots)
        self.host_counters.bytes_written += len(slots) * self.key.payload_bytes
        pinned: list[int] = []
        if copy is not None:  # CUDA: in flight on the side stream
            event, staged = copy
            for s in slots:
                host.ready[s] = event
            if evicting:  # the blocks are freed now: later work on them waits for the copy, on the device
                torch.cuda.current_stream(self._k[0].device).wait_event(event)
                self._outbound.append((event, staged, []))
            else:
                pinned = src
                self._outbound.append((event, staged, pinned))
        if self.disk_active and not self.config.write_back:  # write-back: the disk gets it on host eviction
            for (p, _), s in zip(new, slots):
                self._queue_write(p, slot=s)
        return pinned

    def settle(self) -> list[int]:
        """Blocks whose copies to host memory finished since the last call (the caller
        drops the references it took for ``store_pages``); step loop."""
        if not self._outbound:
            return []
        done: list[tuple[Any, Any, list[int]]] = []
        left: list[tuple[Any, Any, list[int]]] = []
        for item in self._outbound:
            (done if item[0].query() else left).append(item)
        self._outbound = left
        return [b for _, _, blocks in done for b in blocks]

    @property
    def copies_in_flight(self) -> int:
        """Copies out of the pool not yet settled (CUDA)."""
        return len(self._outbound)

    def _demote(self, chain_hash: int, slot: int) -> None:
        """The host tier evicts a page: queue it for the disk unless the disk holds it or has
        it queued (called under the host store's lock, before the slot is reused; the page
        is copied out of the slot now)."""
        ref = self._host_refs.pop(chain_hash, None)
        if ref is None or not self.disk_active or chain_hash in self._queued:
            return
        assert self.store is not None and self.host is not None
        if chain_hash in self.store:
            return
        event = self.host.ready.get(slot)
        if event is not None:
            event.synchronize()
        self._queue_write(ref, kv=self.host.slab[slot].clone())

    def _queue_write(self, p: PageRef, kv: torch.Tensor | None = None, slot: int | None = None) -> bool:
        """Queue one disk write: of ``kv`` (a copy the writer owns) or of host ``slot``
        (pinned until written). False when the disk holds it, has it queued, or the queue
        is full (counted as dropped)."""
        assert self.store is not None
        if p.chain_hash in self._queued or self.store.indexed(p.chain_hash):
            return False
        with self._lock:
            if self._queued_bytes + self.key.payload_bytes > self.config.max_queue_bytes:
                self.counters.dropped += 1
                return False
            self._queued_bytes += self.key.payload_bytes
            self._queued.add(p.chain_hash)
        if slot is not None:
            assert self.host is not None
            self.host.pin([slot])
            self._writes.put((p, slot))
        else:
            assert kv is not None
            self._writes.put((p, kv))
        return True

    def _queue_disk_copies(self, pages: Sequence[PageRef], blocks: Sequence[int]) -> None:
        """Queue disk writes of pool pages (the host tier off), copied out of the pool now."""
        if not self.disk_active:
            return
        assert self.store is not None
        size = self.key.payload_bytes
        todo: list[tuple[PageRef, int]] = []
        for p, b in zip(pages, blocks):
            if p.chain_hash in self._queued or self.store.indexed(p.chain_hash):
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
        self.store_pages(self._node_refs(node, parent_hash, namespace, salt), node.blocks, evicting=True)

    def _node_refs(self, node: Any, parent_hash: int, namespace: str, salt: str | None) -> list[PageRef]:
        """The ``PageRef`` of each page of a radix node (``store_evicted``'s arguments)."""
        bs = self.key.block_size
        scope = scope_digest(namespace) if salt is None else scope_digest(namespace, salt)
        hashes = node.hashes
        return [PageRef(i, h, hashes[i - 1] if i else parent_hash, tuple(node.tokens[i * bs:(i + 1) * bs]), scope)
                for i, h in enumerate(hashes)]

    def _unwritten(self, nodes: Iterable[tuple[Any, int, str, str | None]]) -> Iterator[tuple[PageRef, int]]:
        """Pages of ``nodes`` (``RadixCache.page_nodes``) the disk neither holds nor has
        queued, with their pool blocks, in the nodes' order."""
        assert self.store is not None
        for node, parent_hash, namespace, salt in nodes:
            if not node.hashes:
                continue
            for ref, block in zip(self._node_refs(node, parent_hash, namespace, salt), node.blocks):
                if ref.chain_hash not in self._queued and not self.store.indexed(ref.chain_hash):
                    yield ref, block

    def _queue_pool_page(self, p: PageRef, block: int) -> bool:
        """Copy one pool page out and queue its disk write; False (nothing counted) when
        the queue has no room for it."""
        with self._lock:
            if self._queued_bytes + self.key.payload_bytes > self.config.max_queue_bytes:
                return False
            self._queued_bytes += self.key.payload_bytes
            self._queued.add(p.chain_hash)
        self._writes.put((p, gather_blocks(self._k, self._v, [block]).to("cpu")[0]))
        return True

    def write_unwritten(self, nodes: Iterable[tuple[Any, int, str, str | None]], max_pages: int,
                        stop: Callable[[], bool]) -> tuple[int, bool]:
        """Write-idle: queue disk writes of tree pages the disk lacks, at most
        ``max_pages``, one page at a time, checking ``stop`` before each (a request
        arrived: the caller's admission waits for one page's copy at most). Step loop,
        with nothing running (the blocks are not being written).

        Args:
            nodes: ``RadixCache.page_nodes()`` (a parent before its children, so a
                prefix reaches disk before its continuations: a restore needs a prefix).
            max_pages: the most pages to queue now.
            stop: called before each page; True ends the call.

        Returns:
            ``(pages queued, done)``; ``done``: no page of the tree is left unwritten
            (the caller may stop calling until new pages enter the tree).
        """
        if not self.disk_active:
            return 0, True
        queued = 0
        for ref, block in self._unwritten(nodes):
            if queued >= max_pages or stop() or not self._queue_pool_page(ref, block):
                return queued, False
            queued += 1
        return queued, True

    def flush_tree(self, nodes: Iterable[tuple[Any, int, str, str | None]], timeout_s: float) -> tuple[int, int]:
        """Write-idle, at a graceful stop: queue every tree page the disk lacks (waiting
        for room in the queue) and wait for the writer, for ``timeout_s`` seconds at most.
        Call with the step loop stopped.

        Returns:
            ``(pages of the tree written, pages of the tree left unwritten)``.
        """
        if not self.disk_active:
            return 0, 0
        end = time.monotonic() + timeout_s
        todo = list(self._unwritten(nodes))
        for ref, block in todo:
            while not self._queue_pool_page(ref, block):
                if time.monotonic() >= end or self.disabled:
                    break
                time.sleep(0.005)
            else:
                continue
            break
        self.flush(max(0.0, end - time.monotonic()))
        assert self.store is not None
        left = sum(1 for ref, _ in todo if not self.store.indexed(ref.chain_hash))
        return len(todo) - left, left

    @property
    def writes_queued(self) -> int:
        """Pages queued for the disk and not yet written."""
        with self._lock:
            return len(self._queued)

    def load(self, request: Any, pages: list[PageRef], blocks: list[int]) -> LoadJob:
        """Start a restore of ``pages`` into ``blocks`` (reserved by the caller): the pages
        host memory holds are copied into their blocks now (on the CPU synchronously, on
        a CUDA pool on the side stream), the others are queued for the disk readers;
        ``poll`` hands the job back when both are done."""
        job = LoadJob(request, pages, blocks)
        host = self.host
        if host is not None:
            for i, p in enumerate(pages):
                slot = host.lookup(p.chain_hash)
                if slot is not None:
                    job.host_slots[i] = slot
        job.disk_idx = [i for i in range(len(pages)) if i not in job.host_slots]
        if job.host_slots:
            assert host is not None
            slots = list(job.host_slots.values())
            host.pin(slots)  # no reuse while the copy is in flight
            job.host_copy = slots_to_pool(host.slab, slots, self._k, self._v,
                                          [blocks[i] for i in job.host_slots], self._stream)
            if job.host_copy is None:
                host.unpin(slots)
            elif self.wake is not None:  # an idle step loop sleeps until the copy lands
                threading.Thread(target=_wake_after, args=(job.host_copy[0], self.wake), daemon=True).start()
            self.host_counters.pages_read += len(slots)
            self.host_counters.bytes_read += len(slots) * self.key.payload_bytes
        self._jobs.append(job)
        if job.disk_idx and self.disk_active:
            self._loads.put(job)
        else:
            job.served = job.disk_idx[0] if job.disk_idx else len(pages)
            job.done = True
            if self.wake is not None and job.host_copy is None:
                self.wake()
        return job

    def cancel(self, job: LoadJob) -> list[int]:
        """Drop a restore (abort); its result is ignored. Returns the job's blocks when a
        copy from host memory into them is still in flight (CUDA): the caller keeps them
        allocated until ``settle`` hands them back."""
        job.cancelled = True
        if job.copied():
            return []
        assert job.host_copy is not None
        self._outbound.append((job.host_copy[0], job.host_copy[1], list(job.blocks)))
        return list(job.blocks)

    def scatter(self, job: LoadJob) -> None:
        """Copy a finished job's disk pages into its blocks (step loop, between steps; the
        host pages are there already); its buffer goes back for the next restore."""
        k = job.served
        disk = [i for i in job.disk_idx if i < k]
        if disk:
            assert job.buffer is not None
            if disk == list(range(k)):
                scatter_blocks(self._k, self._v, job.blocks[:k], job.buffer[:k])
            else:
                scatter_blocks(self._k, self._v, [job.blocks[i] for i in disk], job.buffer[disk])
        if job.host_copy is not None:  # landed (``poll``): the device's later work is ordered after it
            torch.cuda.current_stream(self._k[0].device).wait_event(job.host_copy[0])
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
        done = [j for j in self._jobs if j.done and j.copied()]
        if not done:
            return []
        self._jobs = [j for j in self._jobs if j not in done]
        out = []
        now = time.monotonic()
        for j in done:
            if j.host_copy is not None and self.host is not None:
                self.host.unpin(list(j.host_slots.values()))
            if j.cancelled:
                self._give_back(j)
                continue
            self.counters.restores += 1
            self.counters.restore_ms += (now - j.started_s) * 1000
            from_host = j.host_served
            if j.served > from_host:
                self.counters.hits += 1
            if from_host:
                self.host_counters.hits += 1
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

    def close(self, flush_s: float = 5.0) -> None:
        """Write what is queued (up to ``flush_s`` seconds), then stop the threads."""
        if self.store is not None and self._threads[0].is_alive():
            self.flush(flush_s)
            self._writes.put(None)
            self._loads.put(None)
            for t in self._threads:
                t.join(timeout=5)

    def stats(self) -> dict[str, Any]:
        """Counters and sizes (pages, bytes, ms) for engine stats and /metrics."""
        c = self.counters
        store = self.store
        return {
            "kv_disk_enabled": self.disk_active,
            "kv_disk_pages": store.num_pages if store else 0,
            "kv_disk_bytes": store.num_bytes if store else 0,
            **c.stats("disk"),
            "kv_disk_pages_corrupt_total": c.corrupt,
            "kv_disk_pages_evicted_total": store.evicted if store else 0,
            "kv_disk_restores_total": c.restores,
            "kv_disk_restore_ms_total": round(c.restore_ms, 3),
            **self._host_stats(),
        }

    def _host_stats(self) -> dict[str, Any]:
        """The host tier's counters and sizes (pages, bytes)."""
        host, c = self.host, self.host_counters
        return {
            "kv_host_enabled": host is not None,
            "kv_host_pinned_memory": bool(host is not None and host.pinned),
            "kv_host_pages": host.num_pages if host else 0,
            "kv_host_bytes": host.num_bytes if host else 0,
            "kv_host_capacity_pages": host.capacity if host else 0,
            **c.stats("host"),
            "kv_host_pages_evicted_total": host.evicted if host else 0,
            "kv_host_copies_in_flight": len(self._outbound),
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
            page, src = item
            try:
                if not self.disabled:
                    if isinstance(src, int):  # a host slot, pinned until written
                        assert self.host is not None
                        event = self.host.ready.get(src)
                        if event is not None:
                            event.synchronize()
                        kv = self.host.slab[src]
                    else:
                        kv = src
                    # parts, not one bytes: the payload is written from ``kv`` itself, and the
                    # CRC and the writes release the GIL (docs/kv_tiers.md, "Writing")
                    parts = encode_page_parts(PageHeader(self.key, page.scope, page.chain_hash,
                                                         page.parent_hash, page.token_ids), kv)
                    self.store.put(page.chain_hash, parts)
                    self.counters.pages_written += 1
                    self.counters.bytes_written += sum(len(p) for p in parts)
                else:
                    self.counters.dropped += 1
            except OSError as e:
                self.counters.dropped += 1
                self._disable(f"write failed: {e}")
            except Exception:  # a bug must not kill the thread and leave pages queued forever
                self.counters.dropped += 1
                log.exception("KV tier write failed")
            finally:
                if isinstance(src, int) and self.host is not None:
                    self.host.unpin([src])
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
                # the pool's page faults, here rather than in scatter
                populate_blocks(self._k, self._v, [job.blocks[i] for i in job.disk_idx])
                n, ways = len(job.disk_idx), self.config.readers
                if helpers is None or n < 2 * ways:
                    good = self._read_stride(job, 0, 1, scratch)
                else:  # page i by reader i % ways; this thread is reader 0
                    parts = [helpers.submit(self._read_stride, job, w, ways, None) for w in range(1, ways)]
                    good = self._read_stride(job, 0, ways, scratch)
                    good = min([good] + [f.result() for f in parts])
                assert job.buffer is not None
                job.served = good
                job.pages_kv = list(job.buffer[:good].unbind(0))
            except Exception:
                job.pages_kv = []
                job.served = 0
                log.exception("KV tier read failed")
            finally:
                job.done = True
                if self._loads.empty():
                    self._no_restore.set()
                if self.wake is not None:
                    self.wake()

    def _read_stride(self, job: LoadJob, first: int, step: int, scratch: bytearray | None) -> int:
        """Read disk pages ``first, first + step, ...`` of ``job`` (positions in
        ``job.disk_idx``) into its buffer, in order, up to the first that cannot be served;
        returns that page's index (``len(job.pages)`` when all were), so the smallest over
        the strides ends the contiguous prefix served. Stops early once another stride
        failed before its next page (``job.limit``)."""
        if scratch is None:
            scratch = bytearray(self.key.payload_bytes + (64 << 10))
        assert job.buffer is not None
        for j in range(first, len(job.disk_idx), step):
            i = job.disk_idx[j]
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


def _wake_after(event: Any, wake: Callable[[], None]) -> None:
    """Wait for a CUDA event off the step loop, then wake it (a restore from host memory landed)."""
    event.synchronize()
    wake()


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
    """The tiers ``config`` asks for: the host-memory tier (``host_tier_on``) and the disk
    tier (``kv_disk_dir``). None when both are off, or the prefix cache is; a disk folder
    that cannot be used or a host slab that cannot be allocated costs that tier alone
    (one warning each), and the engine serves from what is left."""
    if not config.enable_prefix_cache:
        return None
    device = k_caches[0].device
    host_bytes = 0
    if host_tier_on(config, device):
        pool_bytes = sum(t.numel() * t.element_size() for t in (*k_caches, *v_caches))
        host_bytes = (config.kv_host_bytes if config.kv_host_bytes is not None
                      else default_host_bytes(pool_bytes, available_bytes()))
    folder = Path(config.kv_disk_dir).expanduser() if config.kv_disk_dir is not None else None
    if folder is None and host_bytes == 0:
        return None
    from engine.tiers.disk import default_disk_bytes

    size = 0
    if folder is not None:
        size = config.kv_disk_bytes if config.kv_disk_bytes is not None else default_disk_bytes(folder)
    key = page_key(config, model_config, weights_id)
    write_back = config.kv_disk_write in ("back", "idle")
    write_idle = config.kv_disk_write == "idle"
    tiers: KVTiers | None = None
    for _attempt in range(2):
        try:
            tiers = KVTiers(key, TierConfig(folder, size, write_back=write_back, write_idle=write_idle,
                                            host_bytes=host_bytes),
                            k_caches, v_caches)
            break
        except OSError as e:
            log.warning("KV disk tier off: cannot use %s (%s)", folder, e)
            folder = None
        except (RuntimeError, ValueError) as e:  # the host slab: out of memory, or too small for a page
            log.warning("KV host-memory tier off: %d bytes cannot hold its pages (%s)", host_bytes, e)
            host_bytes = 0
        if folder is None and host_bytes == 0:
            return None
    if tiers is None:
        return None
    if tiers.store is not None:
        log.info("KV disk tier: %s, %d pages (%.2f GiB) found, bound %.2f GiB", tiers.store.folder,
                 tiers.store.num_pages, tiers.store.num_bytes / 2**30, size / 2**30)
    if tiers.host is not None:
        log.info("KV host-memory tier: %d pages (%.2f GiB), %s memory", tiers.host.capacity,
                 tiers.host.capacity * key.payload_bytes / 2**30, "pinned" if tiers.host.pinned else "plain")
    return tiers


def host_tier_on(config: EngineConfig, device: torch.device) -> bool:
    """Whether the engine keeps a host-memory tier: ``config.kv_host`` "on" or "off", or
    "auto": on when the pool is on a CUDA device, off on the CPU (where the pool already
    lives in host memory)."""
    if config.kv_host == "auto":
        return device.type == "cuda"
    return config.kv_host == "on"
