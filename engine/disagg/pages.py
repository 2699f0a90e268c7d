r"""The two step-thread verbs of moving KV between engines, and how pages are named.

A prompt's whole pages are named as the prefix cache names them (``engine.block_hash``):
page ``i`` by its chained hash ``h(i)``, which covers the namespace (the weights), the
cache salt and every token up to the end of the page. A page travels in the one page
serialization of the engine (``engine.kv_page``), named as the KV tiers name it
(``engine.tiers.manager.page_refs``, ``page_key``): its header carries that hash, the
parent's hash, the page's tokens, its scope and the format, and its digest is checked
on read.

::

    source (prefill engine)                    sink (decode engine)
    read_pages: match the prompt in its tree,  match the prompt in its own tree: pages
      copy pages first..first+n-1 out of the     0..m-1 are there; ask the source for m..
      pool (gather), between two steps           (``engine.disagg.pull``)
    encode_page (off the step thread)  ---->   decode_page against the expected key, scope,
                                                 hash, parent hash and tokens (off the step
                                                 thread); adopt_pages: allocate, scatter,
                                                 insert into the tree (between two steps)

Neither side keeps a reference past the call: the source copies its pages out (a page
evicted before the read is simply not sent) and the sink's adopted pages belong to its
tree (evictable like any cached page), so an abort at any point leaves both engines'
block accounting whole.

Both verbs are called only on the step thread (``AsyncEngine.call``), like every other
pool and tree operation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.block_hash import namespace_of
from engine.engine_core import EngineCore
from engine.kv_page import PageHeader, PageKey, gather_block, scatter_block
from engine.radix_cache import CacheScope
from engine.tiers.manager import page_key as tier_page_key
from engine.tiers.manager import page_refs

__all__ = ["adopt_pages", "page_key", "read_pages", "scope_of"]


def page_key(core: EngineCore) -> PageKey:
    """The ``PageKey`` of ``core``'s pages: its weights id, weight format, KV dtype, block
    size and KV shape (two engines exchange pages only when these agree)."""
    return tier_page_key(core.config, core.model_config, core.namespace)


def scope_of(core: EngineCore, cache_salt: str = "", shared_tokens: int = 0) -> CacheScope:
    """The cache scope a request of ``core`` with this salt runs in (as ``add_request``)."""
    return CacheScope(namespace_of(core.namespace), cache_salt, shared_tokens if cache_salt else 0)


def read_pages(core: EngineCore, token_ids: Sequence[int], scope: CacheScope, first_page: int,
               num_pages: int) -> list[tuple[PageHeader, torch.Tensor]]:
    """Copy pages ``first_page .. first_page + num_pages - 1`` of a prompt out of the pool,
    as far as the prefix cache holds them contiguously from the prompt's start. Step
    thread only; keeps no reference (the copies are the caller's).

    Returns:
        For each page held, in order: its header and its K/V
        ([num_layers, 2, block_size, num_kv_heads, head_dim], the KV dtype, the cache's
        device); fewer than ``num_pages`` (maybe none) when the tree holds fewer.
    """
    bs = core.config.block_size
    end = min(first_page + num_pages, len(token_ids) // bs)
    if end <= first_page:
        return []
    match = core.cache.match_prefix(token_ids[:end * bs], scope)
    end = min(end, len(match.blocks))
    if end <= first_page:
        return []
    key = page_key(core)
    kv = core.runner.kv
    return [(PageHeader(key, ref.scope, ref.chain_hash, ref.parent_hash, ref.token_ids),
             gather_block(kv.k_caches, kv.v_caches, match.blocks[ref.index]))
            for ref in page_refs(token_ids, scope, bs, first_page, end)]


def adopt_pages(core: EngineCore, token_ids: Sequence[int], scope: CacheScope, first_page: int,
                pages: Sequence[torch.Tensor]) -> int:
    """Put received pages ``first_page ..`` of a prompt into the pool and the prefix cache.
    Step thread only; the caller has checked each page (``engine.kv_page.decode_page``).

    Pages the tree holds already (arrived meanwhile) are skipped; when the tree no longer
    holds every page before ``first_page`` nothing is adopted (the tree keeps contiguous
    prefixes only); when the pool cannot free enough blocks (evicting unlocked cached
    pages, LRU first) only the leading pages that fit are adopted. The tree holds the
    adopted pages (evictable, like any cached page); no request holds them yet.

    Args:
        pages: one page tensor each ([num_layers, 2, block_size, num_kv_heads, head_dim],
            the KV dtype, any device).

    Returns:
        Leading pages of the prompt the tree holds now (pages).
    """
    bs = core.config.block_size
    cache, pool = core.cache, core.pool
    end = first_page + len(pages)
    match = cache.match_prefix(token_ids[:end * bs], scope)
    have = len(match.blocks)
    if have < first_page or have >= end or not cache.enabled:
        return have
    todo = pages[have - first_page:]
    blocks: list[int] = []
    cache.lock(match.node)  # the pages before ours must survive the eviction below
    try:
        short = len(todo) - pool.num_free
        if short > 0:
            cache.evict(short)
        blocks = pool.allocate(min(len(todo), pool.num_free))
        kv = core.runner.kv
        for block, page in zip(blocks, todo):
            scatter_block(kv.k_caches, kv.v_caches, block, page)
        n = have + len(blocks)
        return len(cache.insert(token_ids[:n * bs], list(match.blocks) + blocks, scope).blocks)
    finally:
        cache.unlock(match.node)
        if blocks:
            pool.decref(blocks)  # the tree holds its own reference on what it stored
