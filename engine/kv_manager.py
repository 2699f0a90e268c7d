"""The KV side behind verbs: the block pool, the radix cache and the KV tiers.

The scheduler decides who runs; this module decides which blocks they hold. Every
reference count and tree lock a request takes or drops goes through one of its verbs,
as in nano-vllm's block manager and vLLM v1's KV cache manager (written from their
descriptions):

- ``admit(req, budget)``: match the cached prefix, lock it, reserve blocks for the first
  chunk (``restore(req)`` first when the KV tiers hold pages past the match);
- ``grow(req, num_tokens)``: more blocks as the request runs;
- ``cache_pages(req)``: its computed full pages into the tree (and the tiers);
- ``trim(req, num_tokens)``: give back blocks past ``num_tokens`` (rejected drafts);
- ``release(req, cache_pages)``: drop everything it holds (finish, abort, preemption).

- ``settle()``: each step, drop the references held on blocks whose copies to or from
  host memory have landed (CUDA: the copies run on a side stream, and a block being
  copied is never handed out again before its copy is done).

Block accounting (docs/acceptance.md#block-accounting): every block is free, in the tree,
held by a running or restoring request, or held by a copy in flight to or from host
memory; ``check_invariants`` recounts it, restores and copies in flight included. Not
thread-safe: the step loop is its only user (the tiers' threads never touch the pool's
accounting, ``engine.tiers.manager``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.block_pool import BlockPool, NoFreeBlocksError, blocks_needed
from engine.errors import InvariantError
from engine.radix_cache import RadixCache, as_scope
from engine.request import Request, RequestStatus
from engine.tiers.manager import KVTiers, page_refs

__all__ = ["KVManager"]


class KVManager:
    """Blocks, tree locks and tier restores of every request (see the module doc).

    Args:
        pool: the block allocator.
        cache: the radix tree over it.
        block_size: tokens per block.
        tiers: the KV tiers beneath the pool, or None.
    """

    def __init__(self, pool: BlockPool, cache: RadixCache, block_size: int, tiers: KVTiers | None = None) -> None:
        self.pool = pool
        self.cache = cache
        self.block_size = block_size
        self.tiers = tiers
        self.in_flight: list[int] = []  # blocks with a reference held by a host-memory copy (a block per reference)

    # ----- reading the cache ------------------------------------------------------------
    def cached_prefix(self, req: Request) -> int:
        """Tokens of ``req`` (prompt and output) the tree holds now, in whole blocks, at
        most all but its last token (no lock is taken)."""
        tokens = req.all_ids()
        return self.cache.match_prefix(tokens, req.namespace, max_tokens=len(tokens) - 1).num_tokens

    # ----- verbs ------------------------------------------------------------------------
    def admit(self, req: Request, budget: int) -> bool:
        """Match the prefix, lock it, and reserve blocks for the first chunk (at most
        ``budget`` tokens); False (nothing held) when the blocks cannot be found."""
        bs = self.block_size
        tokens = req.all_ids()
        # At least one token must be computed to get logits for the next sample; a request
        # that wants its prompt's logprobs computes the whole prompt (the tree has no logits).
        match = self.cache.match_prefix(tokens, req.namespace,
                                        max_tokens=0 if req.wants_prompt_logprobs else len(tokens) - 1)
        num_new = min(len(tokens) - match.num_tokens, budget)
        need = blocks_needed(match.num_tokens + num_new, bs) - len(match.blocks)
        self.cache.lock(match.node)  # protect the match from the eviction below
        blocks = self._allocate(need)
        if blocks is None:
            self.cache.unlock(match.node)
            return False
        self.pool.incref(match.blocks)
        req.block_table = list(match.blocks) + blocks
        req.tree_node = match.node
        req.num_tree_blocks = len(match.blocks)
        req.num_computed_tokens = match.num_tokens
        if req.num_cached_tokens < 0:  # first admission: report the cache hit (restored pages included)
            req.num_cached_tokens = match.num_tokens
            req.num_host_tokens = min(req.num_host_tokens, match.num_tokens)
            req.num_disk_tokens = min(req.num_disk_tokens, match.num_tokens - req.num_host_tokens)
        if req.first_scheduled_s is None:
            req.first_scheduled_s = time.monotonic()
        return True

    def restore(self, req: Request) -> bool:
        """Start restoring the pages past the tree's match that the tiers hold (once per
        request): reserve a block for each, lock the match, and set the request
        ``RESTORING`` with its ``restore_job``. False when there is nothing to restore or
        no blocks for it (the request is then admitted as usual and recomputes)."""
        req.restore_tried = True
        tiers = self.tiers
        if tiers is None or not tiers.active or not self.cache.enabled or req.wants_prompt_logprobs:
            return False
        bs = self.block_size
        tokens = req.all_ids()
        match = self.cache.match_prefix(tokens, req.namespace, max_tokens=len(tokens) - 1)
        have, want = len(match.blocks), (len(tokens) - 1) // bs
        if want <= have:
            return False
        refs = page_refs(tokens, as_scope(req.namespace), bs, have, want)
        n = tiers.probe(refs)
        if n == 0:
            return False
        self.cache.lock(match.node)  # protect the match from the eviction below
        blocks = self._allocate(n)
        if blocks is None:
            self.cache.unlock(match.node)
            return False
        self.pool.incref(match.blocks)
        req.block_table = list(match.blocks) + blocks
        req.tree_node = match.node
        req.num_tree_blocks = have
        req.num_computed_tokens = have * bs
        req.status = RequestStatus.RESTORING
        req.restore_job = tiers.load(req, refs[:n], blocks)
        return True

    def finish_restores(self, restoring: list[Request]) -> list[Request]:
        """Take the requests of ``restoring`` whose restores are done out of it: their pages
        go into the tree, their blocks back (pages the reader could not serve, missing or
        corrupt, and everything after them are recomputed), and they are returned, in the
        order they finished, ``WAITING`` to be admitted."""
        if self.tiers is None or not restoring:
            return []
        bs = self.block_size
        back: list[Request] = []
        for job in self.tiers.poll():
            req = job.request
            if req not in restoring or req.restore_job is not job:
                continue
            restoring.remove(req)
            req.restore_job = None
            k = job.served
            self.tiers.scatter(job)
            if k:
                req.num_computed_tokens = (req.num_tree_blocks + k) * bs
                before = req.num_tree_blocks
                self.cache_pages(req)
                if req.num_cached_tokens < 0:  # reported at its first admission
                    restored = req.num_tree_blocks - before
                    req.num_host_tokens = min(job.host_served, restored) * bs
                    req.num_disk_tokens = restored * bs - req.num_host_tokens
            self.release(req, cache_pages=False)
            req.status = RequestStatus.WAITING
            back.append(req)
        return back

    def cancel_restore(self, req: Request) -> None:
        """Drop a restore in flight (abort): its blocks go back now, except those a copy
        from host memory is still writing (CUDA), which go back when it lands
        (``settle``); the reader's result is ignored."""
        if req.restore_job is not None:
            assert self.tiers is not None
            self._hold(self.tiers.cancel(req.restore_job))
            req.restore_job = None
        self.release(req, cache_pages=False)

    def settle(self) -> None:
        """Drop the references held on blocks whose copies to or from host memory have
        landed (step loop, each step)."""
        if self.tiers is None or not self.tiers.copies_in_flight:  # copies of evicted pages hold no block
            return
        done = self.tiers.settle()
        if not done:
            return
        self.pool.decref(done)
        for b in done:
            self.in_flight.remove(b)

    def _hold(self, blocks: list[int]) -> None:
        """Take a reference on ``blocks`` for a copy in flight (dropped by ``settle``)."""
        if blocks:
            self.pool.incref(blocks)
            self.in_flight.extend(blocks)

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req.block_table`` to cover ``num_tokens`` tokens; False if out of blocks."""
        need = blocks_needed(num_tokens, self.block_size) - len(req.block_table)
        if need <= 0:
            return True
        blocks = self._allocate(need)
        if blocks is None:
            return False
        req.block_table.extend(blocks)
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past those that hold ``num_tokens`` tokens (the KV of
        rejected drafts; the tree never saw them)."""
        keep = blocks_needed(num_tokens, self.block_size)
        if len(req.block_table) > keep:
            self.pool.decref(req.block_table[keep:])
            del req.block_table[keep:]

    def cache_pages(self, req: Request) -> None:
        """Insert the request's computed full pages into the tree, lock them, and swap its
        duplicate pages for the tree's copies (freeing the duplicates); the pages new to
        the tree are written through to the KV tiers (write-idle: marked for the idle
        writer)."""
        bs = self.block_size
        n_full = req.num_computed_tokens // bs
        if not self.cache.enabled or n_full <= req.num_tree_blocks:
            return
        tokens = req.token_at(0, n_full * bs)
        inserted = self.cache.insert(tokens, req.block_table[:n_full], req.namespace)
        self.cache.lock(inserted.node)
        if req.tree_node is not None:
            self.cache.unlock(req.tree_node)
        req.tree_node = inserted.node
        for i, b in enumerate(inserted.blocks):
            if b != req.block_table[i]:
                self.pool.incref([b])
                self.pool.decref([req.block_table[i]])
                req.block_table[i] = b
        req.num_tree_blocks = len(inserted.blocks)
        if self.tiers is not None and self.tiers.config.write_idle and inserted.num_new_tokens:
            self.tiers.unwritten = True  # written when the engine is idle (``EngineCore.write_idle``)
        if (self.tiers is not None and self.tiers.active and not self.tiers.config.write_back
                and inserted.num_new_tokens):
            first = inserted.num_existing_tokens // bs
            refs = page_refs(tokens, as_scope(req.namespace), bs, first, n_full)
            self._hold(self.tiers.store_pages(refs, inserted.blocks[first:]))

    def release(self, req: Request, cache_pages: bool) -> None:
        """Drop every block reference and tree lock the request holds (caching its
        computed pages first with ``cache_pages``)."""
        if cache_pages and req.block_table:
            self.cache_pages(req)
        if req.block_table:
            self.pool.decref(req.block_table)
        if req.tree_node is not None:
            self.cache.unlock(req.tree_node)
        req.block_table = []
        req.tree_node = None
        req.num_tree_blocks = 0
        req.num_computed_tokens = 0

    # ----- accounting ---------------------------------------------------------------------
    @staticmethod
    def held_blocks(holders: Iterable[Request]) -> int:
        """Distinct blocks referenced by ``holders`` (counted once)."""
        held: set[int] = set()
        for r in holders:
            held.update(r.block_table)
        return len(held)

    def check_invariants(self, holders: Iterable[Request]) -> None:
        """free + evictable + held by ``holders`` (every running and restoring request) or
        by a copy in flight to or from host memory (outside the tree's evictable pages)
        == total (block accounting (docs/acceptance.md#block-accounting)).

        Raises:
            InvariantError: with the four numbers, when the identity fails (or from the
                pool's and the tree's own checks).
        """
        self.pool.check_invariants()
        self.cache.check_invariants()
        free = self.pool.num_free
        evictable = self.cache.num_evictable_blocks
        held_set: set[int] = set()
        for r in holders:
            held_set.update(r.block_table)
        # a block being copied is held by the copy, unless the tree still counts it as evictable
        held_set.update(b for b in self.in_flight if not self.cache.holds_block(b))
        held = len(held_set)
        # Locked tree pages are held by some running request; private blocks only by it.
        if free + evictable + held != self.pool.num_blocks:
            raise InvariantError(f"block accounting: free {free} + evictable {evictable} + held {held} "
                                 f"!= total {self.pool.num_blocks}")

    def _allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting tree pages if needed; None when even that fails."""
        if n <= 0:
            return []
        short = n - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        try:
            return self.pool.allocate(n)
        except NoFreeBlocksError:
            return None
