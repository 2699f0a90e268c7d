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

from collections import deque
from dataclasses import dataclass, field

from engine.block_pool import BlockPool
from engine.kv_manager import KVManager
from engine.radix_cache import RadixCache
from engine.request import Request, RequestStatus
from engine.tiers.manager import KVTiers


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
    """Owns the waiting queue, the running set and the requests restoring pages; which
    blocks they hold is the KV manager's business (``engine.kv_manager``).

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
        # every block reference and tree lock a request takes goes through its verbs
        self.kv = KVManager(pool, cache, config.block_size, tiers)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # waiting for the tiers to load pages into the blocks they hold (``KVManager.restore``)
        self.restoring: list[Request] = []
        self.num_preemptions = 0
        self.num_deferred = 0  # admissions put off for a prefill in flight (request-steps)

    # ----- queue management -------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a validated request (its prompt fits the model and the pool)."""
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_work(self) -> bool:
        """True while any request waits, restores or runs, or a copy to or from host memory
        holds blocks (a step settles it: the idle identity holds once it lands)."""
        return bool(self.waiting or self.running or self.restoring or self.kv.in_flight)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and release all its blocks (abort or finish);
        a request mid-restore drops its restore (the reader's result is ignored)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.restoring:
            self.restoring.remove(req)
            self.kv.cancel_restore(req)
            req.status = RequestStatus.FINISHED
            return
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.release(req, cache_pages=True)
        req.status = RequestStatus.FINISHED

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks and requeue it at the head (recompute later)."""
        self.running.remove(req)
        req.spec_drafts = []
        self.kv.release(req, cache_pages=True)
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
        self.kv.settle()  # blocks whose copies to or from host memory landed
        if self.restoring:
            # restored requests first in line, in the order their restores finished
            self.waiting.extendleft(reversed(self.kv.finish_restores(self.restoring)))

        # 1. Running requests, oldest first; preempt the newest when out of blocks. A
        # decoding request's drafts (``req.spec_drafts``) ride along while the budget lasts.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            drafts = req.spec_drafts[: max(0, budget - req.num_uncomputed)] if req.num_uncomputed == 1 else []
            num_new = min(req.num_uncomputed, budget) + len(drafts)
            while not self.kv.grow(req, req.num_computed_tokens + num_new):
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
            if self.tiers is not None and not req.restore_tried and self.kv.restore(req):
                self.restoring.append(self.waiting.popleft())
                continue
            if not self.kv.admit(req, budget):
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
        cached = self.kv.cached_prefix(req)
        end = cached + bs
        if end > len(tokens) - 1:
            return False  # nothing more a page could give it
        page = tokens[cached:end]
        return any(r.namespace == req.namespace and len(r.prompt_ids) >= end
                   and r.prompt_ids[cached:end] == page and r.prompt_ids[:cached] == tokens[:cached]
                   for r in prefilling)

    def _sort_waiting_by_prefix(self) -> None:
        """Longest-prefix-match policy: longest cached prefix first, arrival order on ties."""
        scored = []
        for n, req in enumerate(self.waiting):
            # a preempted request is re-admitted with its output too
            scored.append((-self.kv.cached_prefix(req), n, req))
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
        for n, item in enumerate(batch.items):
            req = item.request
            rejected = len(item.spec) - (accepted[n] if accepted is not None else len(item.spec))
            req.num_computed_tokens += item.num_new - rejected
            if rejected:
                self.kv.trim(req, req.num_computed_tokens + 1)  # room for the next token
            if item.sample and item.num_new > 1 and not item.spec:
                self.kv.cache_pages(req)

    # ----- accounting ---------------------------------------------------------------
    def blocks_held_by_requests(self) -> int:
        """Distinct blocks referenced by running requests and by requests restoring pages
        into them (counted once)."""
        return self.kv.held_blocks([*self.running, *self.restoring])

    def check_invariants(self) -> None:
        """free + evictable + held by running and restoring requests == total (block
        accounting (docs/acceptance.md#block-accounting)); blocks that pages are being restored into count
        as held.

        Raises:
            InvariantError: with the four numbers, when the identity fails (or from the
                pool's and the tree's own checks).
        """
        self.kv.check_invariants([*self.running, *self.restoring])
