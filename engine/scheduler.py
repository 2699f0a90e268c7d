"""Continuous batching with chunked prefill, prefix reuse and preemption.

Each step the scheduler spends a token budget (``max_num_batched_tokens``):

1. Running requests first, oldest first: a decode costs one token; an
   unfinished prefill takes the next chunk that fits. Running work is served
   before any new prompt, so a stream of arriving prompts can delay a decode by
   at most one step of bounded size, never starve it (no decode starvation (docs/acceptance.md#no-decode-starvation)).
2. Then waiting requests (FCFS, or longest prefix match first with "lpm"):
   match the prompt in the radix tree, lock the match, allocate blocks for the
   first chunk, and admit. A waiting request whose next uncached page is being
   computed right now by a running prompt's prefill (chats opening with one
   document, arriving together) waits until those pages are in the tree, then
   reads them from it instead of computing them again; the requests behind it are
   admitted meanwhile. SGLang's scheduler does the same ("in-batch prefix caching":
   a waiting request that shares a prefix with one in the running batch is
   deprioritized so that it hits the cache a round later).
   A waiting request whose prompt goes on past the tree's match into the KV tiers
   (``engine.tiers``) first restores: it reserves blocks for the pages the tier holds
   and waits, out of the queue and holding no budget, while the tier's reader loads
   them; then its pages go into the tree and it is back at the head of the queue,
   where its admission matches them. Everyone else keeps running meanwhile.

When blocks run out the scheduler first evicts unlocked tree pages (LRU);
if that is not enough it preempts the newest running request (frees its blocks
after caching its computed pages, and puts it back at the head of the queue to
be recomputed later), and never crashes. The design follows vLLM's
recompute-style preemption (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention") and SGLang's radix-tree
scheduling (Zheng et al. 2023).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool, NoFreeBlocksError, blocks_needed
from engine.errors import InvariantError
from engine.radix_cache import RadixCache, as_scope
from engine.request import Request, RequestStatus
from engine.tiers.manager import KVTiers, page_refs


@dataclass
class SchedulerConfig:
    """Budget and policy of the scheduler.

    Attributes:
        block_size: tokens per KV block.
        max_num_batched_tokens: tokens computed in one step at most (prefill chunks + decodes).
        max_num_seqs: requests running at once at most.
        policy: "fcfs" or "lpm" (longest prefix match first).
    """

    block_size: int
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    policy: str = "fcfs"


@dataclass
class ScheduledItem:
    """One request's share of a step: ``num_new`` tokens from ``num_computed_tokens``.

    ``spec``: draft tokens verified this step (speculative decoding): they follow the
    request's known tokens in its chunk, are counted in ``num_new``, and the step samples
    every position from the last known token on (``1 + len(spec)`` tokens)."""

    request: Request
    num_new: int
    sample: bool  # the chunk reaches the last known token, so the step samples a token
    spec: list[int] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        """Positions the step samples for this request (0 mid-prefill)."""
        return (1 + len(self.spec)) if self.sample else 0


@dataclass
class ScheduledBatch:
    """What one step runs. ``items`` is empty when there is nothing to do."""

    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens computed by this step."""
        return sum(i.num_new for i in self.items)


class Scheduler:
    """Owns the waiting queue and the running set, and every block a request holds.

    Contract: callers ``add`` requests, call ``schedule`` once per step, run the
    returned batch, then call ``on_step_done`` with it (which advances
    ``num_computed_tokens``), append sampled tokens themselves, and ``finish``
    requests that end. ``abort`` and ``finish`` release blocks at once.
    """

    def __init__(self, config: SchedulerConfig, pool: BlockPool, cache: RadixCache,
                 tiers: KVTiers | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache
        self.tiers = tiers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # waiting for the tiers to load pages into the blocks they hold (``_try_restore``)
        self.restoring: list[Request] = []
        self.num_preemptions = 0
        self.num_deferred = 0  # admissions put off for a prefill in flight (request-steps)

    # ----- queue management -------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a validated request (its prompt fits the model and the pool)."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        """True while any request waits, restores or runs."""
        return bool(self.waiting or self.running or self.restoring)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and release all its blocks (abort or finish);
        a request mid-restore drops its restore (the reader's result is ignored)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.restoring:
            self.restoring.remove(req)
            if req.restore_job is not None:
                req.restore_job.cancelled = True
                req.restore_job = None
            self._release(req, cache_pages=False)
            req.status = RequestStatus.FINISHED
            return
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._release(req, cache_pages=True)
        req.status = RequestStatus.FINISHED

    # ----- block bookkeeping ------------------------------------------------------
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

    def _ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        """Grow ``req.block_table`` to cover ``num_tokens`` tokens; False if out of blocks."""
        need = blocks_needed(num_tokens, self.config.block_size) - len(req.block_table)
        if need <= 0:
            return True
        blocks = self._allocate(need)
        if blocks is None:
            return False
        req.block_table.extend(blocks)
        return True

    def cache_computed_pages(self, req: Request) -> None:
        """Insert the request's computed full pages into the tree, lock them, and
        swap its duplicate pages for the tree's copies (freeing the duplicates)."""
        bs = self.config.block_size
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
        if self.tiers is not None and self.tiers.active and inserted.num_new_tokens:
            first = inserted.num_existing_tokens // bs
            refs = page_refs(tokens, as_scope(req.namespace), bs, first, n_full)
            self.tiers.store_pages(refs, inserted.blocks[first:])

    def _release(self, req: Request, cache_pages: bool) -> None:
        """Drop every block reference and tree lock the request holds."""
        if cache_pages and req.block_table:
            self.cache_computed_pages(req)
        if req.block_table:
            self.pool.decref(req.block_table)
        if req.tree_node is not None:
            self.cache.unlock(req.tree_node)
        req.block_table = []
        req.tree_node = None
        req.num_tree_blocks = 0
        req.num_computed_tokens = 0

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and requeue it at the head (recompute later)."""
        self.running.remove(req)
        req.spec_drafts = []
        self._release(req, cache_pages=True)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ----- the step -----------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work under the token budget (see the module docstring)."""
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        if self.tiers is not None and self.restoring:
            self._finish_restores()

        # 1. Running requests, oldest first; preempt the newest when out of blocks. A
        # decoding request's drafts (``req.spec_drafts``) ride along while the budget lasts.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            drafts = req.spec_drafts[: max(0, budget - req.num_uncomputed)] if req.num_uncomputed == 1 else []
            num_new = min(req.num_uncomputed, budget) + len(drafts)
            while not self._ensure_blocks(req, req.num_computed_tokens + num_new):
                victim = self.running[-1]
                if id(victim) in scheduled:  # never take back blocks given this step
                    victim = req
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # req itself was preempted; self.running shifted
            batch.items.append(ScheduledItem(req, num_new, num_new >= req.num_uncomputed, list(drafts)))
            scheduled.add(id(req))
            budget -= num_new
            i += 1

        # 2. Admit waiting requests while budget, seats and blocks last.
        if self.config.policy == "lpm" and len(self.waiting) > 1 and not batch.preempted:
            self._sort_waiting_by_prefix()
        prefilling = [r for r in self.running if r.num_computed_tokens < len(r.prompt_ids)]
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req in batch.preempted:
                break  # preempted this step: it needs the blocks we could not find
            if prefilling and self._prefill_in_flight(req, prefilling):
                deferred.append(self.waiting.popleft())  # next step, from the tree
                continue
            if self.tiers is not None and not req.restore_tried and self._try_restore(req):
                self.waiting.popleft()
                continue
            if not self._admit(req, budget):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new = min(req.num_uncomputed, budget)
            batch.items.append(ScheduledItem(req, num_new, num_new == req.num_uncomputed))
            budget -= num_new
            prefilling.append(req)  # its pages reach the tree after this step at the earliest
        self.waiting.extendleft(reversed(deferred))  # still first in line, in their order
        self.num_deferred += len(deferred)
        return batch

    def _prefill_in_flight(self, req: Request, prefilling: list[Request]) -> bool:
        """Whether a running prompt still being prefilled shares with ``req`` at least one
        whole page beyond what the tree holds for ``req`` now (those pages will be in the
        tree once that prefill ends)."""
        if not self.cache.enabled or req.wants_prompt_logprobs:
            return False
        bs = self.config.block_size
        tokens = req.all_ids()
        cached = self.cache.match_prefix(tokens, req.namespace, max_tokens=len(tokens) - 1).num_tokens
        end = cached + bs
        if end > len(tokens) - 1:
            return False  # nothing more a page could give it
        page = tokens[cached:end]
        return any(r.namespace == req.namespace and len(r.prompt_ids) >= end
                   and r.prompt_ids[cached:end] == page and r.prompt_ids[:cached] == tokens[:cached]
                   for r in prefilling)

    def _admit(self, req: Request, budget: int) -> bool:
        """Match the prefix, lock it, and reserve blocks for the first chunk."""
        bs = self.config.block_size
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
            req.num_disk_tokens = min(req.num_disk_tokens, match.num_tokens)
        if req.first_scheduled_s is None:
            req.first_scheduled_s = time.monotonic()
        return True

    # ----- restores from the KV tiers ------------------------------------------------
    def _try_restore(self, req: Request) -> bool:
        """Start restoring the pages past the tree's match that the tiers hold (once per
        request): reserve a block for each, lock the match, and park the request in
        ``restoring``. False when there is nothing to restore or no blocks for it (the
        request is then admitted as usual and recomputes)."""
        assert self.tiers is not None
        req.restore_tried = True
        if not self.tiers.active or not self.cache.enabled or req.wants_prompt_logprobs:
            return False
        bs = self.config.block_size
        tokens = req.all_ids()
        match = self.cache.match_prefix(tokens, req.namespace, max_tokens=len(tokens) - 1)
        have, want = len(match.blocks), (len(tokens) - 1) // bs
        if want <= have:
            return False
        refs = page_refs(tokens, as_scope(req.namespace), bs, have, want)
        n = self.tiers.probe(refs)
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
        req.restore_job = self.tiers.load(req, refs[:n], blocks)
        self.restoring.append(req)
        return True

    def _finish_restores(self) -> None:
        """Put the pages of finished restores into the tree and their requests back at the
        head of the queue (in the order they finished). Pages the reader could not serve
        (missing, corrupt) and everything after them go back to the pool: recomputed."""
        assert self.tiers is not None
        bs = self.config.block_size
        back: list[Request] = []
        for job in self.tiers.poll():
            req = job.request
            if req not in self.restoring or req.restore_job is not job:
                continue
            self.restoring.remove(req)
            req.restore_job = None
            k = len(job.pages_kv)
            self.tiers.scatter(job)
            if k:
                req.num_computed_tokens = (req.num_tree_blocks + k) * bs
                before = req.num_tree_blocks
                self.cache_computed_pages(req)
                if req.num_cached_tokens < 0:  # reported at its first admission
                    req.num_disk_tokens = (req.num_tree_blocks - before) * bs
            self._release(req, cache_pages=False)
            req.status = RequestStatus.WAITING
            back.append(req)
        self.waiting.extendleft(reversed(back))

    def _sort_waiting_by_prefix(self) -> None:
        """Longest-prefix-match policy: longest cached prefix first, arrival order on ties."""
        scored = []
        for n, req in enumerate(self.waiting):
            tokens = req.all_ids()  # a preempted request is re-admitted with its output too
            m = self.cache.match_prefix(tokens, req.namespace, max_tokens=len(tokens) - 1)
            scored.append((-m.num_tokens, n, req))
        scored.sort(key=lambda t: (t[0], t[1]))
        self.waiting = deque(r for _, _, r in scored)

    def on_step_done(self, batch: ScheduledBatch, accepted: list[int] | None = None) -> None:
        """Advance each scheduled request past the tokens this step computed, and cache
        the pages of prompts whose prefill just completed (so later arrivals that
        share them, such as a common system prompt, hit the tree at once).

        ``accepted``: per item, how many of its drafts the step kept (None: all). The KV
        written for rejected drafts is dropped: the request advances past its known token
        and the kept drafts only, and gives back any block that then holds none of its
        tokens (the radix tree only ever sees pages of kept tokens).
        """
        bs = self.config.block_size
        for n, item in enumerate(batch.items):
            req = item.request
            rejected = len(item.spec) - (accepted[n] if accepted is not None else len(item.spec))
            req.num_computed_tokens += item.num_new - rejected
            if rejected:
                keep = blocks_needed(req.num_computed_tokens + 1, bs)  # room for the next token
                if len(req.block_table) > keep:
                    self.pool.decref(req.block_table[keep:])
                    del req.block_table[keep:]
            if item.sample and item.num_new > 1 and not item.spec:
                self.cache_computed_pages(req)

    # ----- accounting ---------------------------------------------------------------
    def blocks_held_by_requests(self) -> int:
        """Distinct blocks referenced by running requests and by requests restoring pages
        into them (counted once)."""
        held: set[int] = set()
        for r in self.running:
            held.update(r.block_table)
        for r in self.restoring:
            held.update(r.block_table)
        return len(held)

    def check_invariants(self) -> None:
        """free + evictable + held by running and restoring requests == total (block
        accounting (docs/acceptance.md#block-accounting)); blocks that pages are being restored into count
        as held.

        Raises:
            InvariantError: with the four numbers, when the identity fails (or from the
                pool's and the tree's own checks).
        """
        self.pool.check_invariants()
        self.cache.check_invariants()
        free = self.pool.num_free
        evictable = self.cache.num_evictable_blocks
        held = self.blocks_held_by_requests()
        # Locked tree pages are held by some running request; private blocks only by it.
        if free + evictable + held != self.pool.num_blocks:
            raise InvariantError(f"block accounting: free {free} + evictable {evictable} + held {held} "
                                 f"!= total {self.pool.num_blocks}")
