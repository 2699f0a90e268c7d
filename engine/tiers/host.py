"""The host-memory KV tier: a bounded store of pages in host memory, least recently used out.

On a GPU this is the tier beneath the pool and above the disk (docs/kv_tiers.md): a page
that enters the radix tree is copied into a slot here on a side CUDA stream (the step
loop does not wait for it), and a returning prompt's pages are copied back into fresh
pool blocks from here, again on the side stream, before the disk is asked. On the CPU
the pool already lives in host memory, so the tier is off by default there; switched on
(tests do), every copy is a synchronous memcpy and the logic is the same.

Storage: one slab ``[capacity, num_layers, 2, block_size, num_kv_heads, head_dim]`` of the
KV dtype, allocated once, pinned (page-locked, ``torch.Tensor.pin_memory``) when CUDA is
available so device copies run asynchronously, plain otherwise. A page is keyed exactly
as the disk tier keys it: its chained block hash (``engine.block_hash``), within one
``PageKey`` (weights, engine code, formats, shape); the store belongs to one engine, so the
key is fixed for its life.

Slots can be *pinned* (a count): a copy into or out of the slot is in flight (a restore
from it, a write of it to disk). A pinned slot is never reused; evicting its page only
forgets the hash, and the slot returns to the free list when the last pin goes. Eviction
(least recently used first) hands each evicted page to ``on_evict`` before its slot can
be reused, which copies it out to demote it to disk.

Thread-safe: the index, the pins and the free list are behind one lock (the disk writer
thread unpins); the slab's bytes are written only by the step loop's copies.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.kv_page import PageKey

__all__ = ["HostPageStore", "default_host_bytes", "pool_to_slots", "slots_to_pool"]

_GIB = 1 << 30


def default_host_bytes(pool_bytes: int, available: int | None) -> int:
    """The host tier's default size: twice the pool (SGLang HiCache's default host ratio),
    but at most half the host memory ``available`` (bytes; None: unknown, then 8 GiB) and
    at most 32 GiB (page-locking a slab costs start-up time, about a second per few GiB),
    at least 256 MiB."""
    cap = available // 2 if available is not None else 8 * _GIB
    return max(256 << 20, min(2 * pool_bytes, cap, 32 * _GIB))


class HostPageStore:
    """Pages of one ``PageKey`` in one host-memory slab (see the module doc).

    Args:
        key: the page key (shape and dtype of a page).
        max_bytes: the slab's size bound; capacity = ``max_bytes // key.payload_bytes`` pages.
        pin: allocate the slab page-locked (needs CUDA); plain memory otherwise.

    Raises:
        ValueError: ``max_bytes`` holds not even one page.
        RuntimeError: the slab cannot be allocated (torch's out-of-memory error).
    """

    def __init__(self, key: PageKey, max_bytes: int, pin: bool = False) -> None:
        capacity = max_bytes // key.payload_bytes
        if capacity < 1:
            raise ValueError(f"a host tier of {max_bytes} bytes holds no {key.payload_bytes}-byte page")
        self.key = key
        self.capacity = capacity
        self.pinned = bool(pin and torch.cuda.is_available())
        # pinned memory is allocated page-locked at once (``pin_memory()`` of a plain tensor would copy it)
        self.slab = torch.empty((capacity, *key.shape), dtype=key.torch_dtype, pin_memory=self.pinned)
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # chained hash -> slot, oldest use first
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # pop() gives slot 0 first
        self._pins: dict[int, int] = {}  # slot -> in-flight copies
        self._orphans: set[int] = set()  # pinned slots whose page was evicted: free at the last unpin
        self.ready: dict[int, Any] = {}  # slot -> CUDA event of the copy filling it (GPU only)
        self.evicted = 0  # pages dropped to make room
        # (chained hash, slot) of each page evicted, called under the store's lock before the
        # slot is reused (it must not call back into the store): the demotion to disk
        self.on_evict: Callable[[int, int], None] | None = None

    # --- index ---------------------------------------------------------------------------

    def __contains__(self, chain_hash: int) -> bool:
        with self._lock:
            return chain_hash in self._index

    @property
    def num_pages(self) -> int:
        """Pages held."""
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        """Bytes of the pages held."""
        return len(self._index) * self.key.payload_bytes

    def lookup(self, chain_hash: int) -> int | None:
        """The page's slot (marked most recently used), or None."""
        with self._lock:
            slot = self._index.get(chain_hash)
            if slot is not None:
                self._index.move_to_end(chain_hash)
            return slot

    def allocate(self, hashes: Sequence[int]) -> list[int]:
        """A slot for each of ``hashes`` (pages not held yet), evicting least recently used
        pages as needed; the pages are indexed at once (the caller fills their slots
        before anything else reads them: the same thread, or a CUDA event in ``ready``).

        Returns:
            One slot per page, for the leading pages that found one: shorter than
            ``hashes`` when every other slot is pinned or holds a page of this call.
        """
        slots: list[int] = []
        added: set[int] = set()
        with self._lock:
            for h in hashes:
                # never evict a page of this call: its slot is not filled yet
                while not self._free and self._index and next(iter(self._index)) not in added:
                    old, slot = self._index.popitem(last=False)
                    self.evicted += 1
                    if self.on_evict is not None:  # before the slot can be reused
                        self.on_evict(old, slot)
                    if slot in self._pins:
                        self._orphans.add(slot)
                    else:
                        self.ready.pop(slot, None)
                        self._free.append(slot)
                if not self._free:
                    break
                slot = self._free.pop()
                self._index[h] = slot
                added.add(h)
                slots.append(slot)
        return slots

    def discard(self, chain_hash: int) -> None:
        """Forget a page (its slot is free once unpinned)."""
        with self._lock:
            slot = self._index.pop(chain_hash, None)
            if slot is None:
                return
            if slot in self._pins:
                self._orphans.add(slot)
            else:
                self.ready.pop(slot, None)
                self._free.append(slot)

    def pin(self, slots: Sequence[int]) -> None:
        """Keep ``slots`` from being reused until as many ``unpin`` calls."""
        with self._lock:
            for s in slots:
                self._pins[s] = self._pins.get(s, 0) + 1

    def unpin(self, slots: Sequence[int]) -> None:
        """Drop one pin of each slot; an evicted page's slot becomes free at its last pin."""
        with self._lock:
            for s in slots:
                left = self._pins.get(s, 0) - 1
                if left > 0:
                    self._pins[s] = left
                    continue
                self._pins.pop(s, None)
                if s in self._orphans:
                    self._orphans.discard(s)
                    self.ready.pop(s, None)
                    self._free.append(s)

    @property
    def num_pinned(self) -> int:
        """Slots with a copy in flight."""
        with self._lock:
            return len(self._pins)

    def check_invariants(self) -> None:
        """Every slot is exactly one of: holding a page, free, or pinned after its page was
        evicted.

        Raises:
            AssertionError: with the counts, when a slot is lost or counted twice.
        """
        with self._lock:
            held = set(self._index.values())
            free = set(self._free)
            assert len(free) == len(self._free), "a slot is free twice"
            assert not (held & free) and not (held & self._orphans) and not (free & self._orphans), \
                "a slot is in two states"
            total = len(held) + len(free) + len(self._orphans)
            assert total == self.capacity, f"held {len(held)} + free {len(free)} + orphans " \
                                           f"{len(self._orphans)} != capacity {self.capacity}"


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(i, j, first slot)`` for each run ``slots[i:j]`` of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    i = 0
    for j in range(1, len(slots) + 1):
        if j == len(slots) or slots[j] != slots[j - 1] + 1:
            out.append((i, j, slots[i]))
            i = j
    return out


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy uint8 (numpy has no bfloat16; a byte copy is the same copy)."""
    return t.view(torch.uint8).numpy()


def pool_to_slots(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], blocks: Sequence[int],
                  slab: torch.Tensor, slots: Sequence[int], stream: Any = None) -> Any:
    """Copy pool blocks into host slots: slot ``slots[i]`` gets block ``blocks[i]``'s K and V.

    Args:
        k_caches, v_caches: the pool, per layer [num_blocks, block_size, num_kv_heads, head_dim].
        slab: [capacity, num_layers, 2, block_size, num_kv_heads, head_dim], host memory.
        stream: on a CUDA pool, the side stream to copy on; it first waits for the work
            already queued on the current stream (the forward that wrote the blocks).

    Returns:
        On a CUDA pool: the CUDA event recorded after the copies and a device tensor the
        caller keeps alive until the event completes; on the CPU: None (the copy is done).
    """
    if not blocks:
        return None
    k0 = k_caches[0]
    if k0.device.type == "cpu":
        src_idx, dst_idx = np.asarray(blocks, dtype=np.intp), np.asarray(slots, dtype=np.intp)
        dst = _bytes_view(slab)
        for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
            dst[dst_idx, layer, 0] = _bytes_view(k)[src_idx]
            dst[dst_idx, layer, 1] = _bytes_view(v)[src_idx]
        return None
    from engine.kv_page import gather_blocks

    stream.wait_stream(torch.cuda.current_stream(k0.device))
    with torch.cuda.stream(stream):
        staged = gather_blocks(k_caches, v_caches, list(blocks))  # [n, layers, 2, ...] on the device
        for i, j, s in _runs(slots):  # one copy per run of consecutive slots
            slab[s:s + j - i].copy_(staged[i:j], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event, staged


def slots_to_pool(slab: torch.Tensor, slots: Sequence[int], k_caches: list[torch.Tensor],
                  v_caches: list[torch.Tensor], blocks: Sequence[int], stream: Any = None) -> Any:
    """Copy host slots into pool blocks: block ``blocks[i]`` gets slot ``slots[i]`` (the
    inverse of ``pool_to_slots``; same arguments and return value). On a CUDA pool the
    side stream first waits for the current stream (a forward may still read the blocks'
    old contents)."""
    if not blocks:
        return None
    k0 = k_caches[0]
    if k0.device.type == "cpu":
        src_idx, dst_idx = np.asarray(slots, dtype=np.intp), np.asarray(blocks, dtype=np.intp)
        src = _bytes_view(slab)
        for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
            _bytes_view(k)[dst_idx] = src[src_idx, layer, 0]
            _bytes_view(v)[dst_idx] = src[src_idx, layer, 1]
        return None
    from engine.kv_page import scatter_blocks

    stream.wait_stream(torch.cuda.current_stream(k0.device))
    with torch.cuda.stream(stream):
        staged = torch.empty((len(slots), *slab.shape[1:]), dtype=slab.dtype, device=k0.device)
        for i, j, s in _runs(slots):
            staged[i:j].copy_(slab[s:s + j - i], non_blocking=True)
        scatter_blocks(k_caches, v_caches, list(blocks), staged)
        event = torch.cuda.Event()
        event.record(stream)
    return event, staged
