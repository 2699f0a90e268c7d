r"""The two step-thread verbs of moving KV between engines, and how pages are named.

A prompt's whole pages are named as the prefix cache names them (``engine.block_hash``):
page ``i`` by its chained hash ``h(i)``, which covers the namespace (the weights), the
cache salt and every token up to the end of the page. A page travels in the one page
serialization of the engine (``engine.kv_page``), whose header carries that hash, the
parent's hash, the page's tokens and the format, and whose digest is checked on read.

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
from dataclasses import dataclass

import torch

from engine.block_hash import chain_hashes, namespace_of, namespace_seed, salt_seed
from engine.engine_core import EngineCore
from engine.kv_page import PageHeader, PageKey, gather_block, scatter_block, scope_digest
from engine.radix_cache import CacheScope

__all__ = ["PageNames", "adopt_pages", "page_key", "page_names", "read_pages", "scope_of"]


def page_key(core: EngineCore) -> PageKey:
    """The ``PageKey`` of ``core``'s pages: its weights id, weight format, KV dtype, block
    size and KV shape (two engines exchange pages only when these agree)."""
    c, mc = core.config, core.model_config
    kv_dtype = c.kv_cache_dtype if c.kv_cache_dtype != "auto" else c.dtype
    return PageKey(model_id=core.namespace, weight_format=c.quantization or c.dtype, kv_dtype=kv_dtype,
                   block_size=c.block_size, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                   head_dim=mc.head_dim)


def scope_of(core: EngineCore, cache_salt: str = "", shared_tokens: int = 0) -> CacheScope:
    """The cache scope a request of ``core`` with this salt runs in (as ``add_request``)."""
    return CacheScope(namespace_of(core.namespace), cache_salt, shared_tokens if cache_salt else 0)


@dataclass(frozen=True)
class PageNames:
    """The names of a prompt's whole pages in one scope.

    Attributes:
        hashes: chained hash of each page (unsigned 64-bit ints, ``engine.block_hash``).
        parents: the hash each page's chain continues from: the previous page's hash, the
            namespace's seed for page 0, the salt's seed for the first salted page.
        scope: ``engine.kv_page.scope_digest`` of the namespace and salt.
    """

    hashes: list[int]
    parents: list[int]
    scope: str


def page_names(token_ids: Sequence[int], block_size: int, scope: CacheScope) -> PageNames:
    """Name every whole page of ``token_ids`` in ``scope`` (the chain of
    ``engine.block_hash.prompt_block_hashes``, with each page's parent)."""
    seed = namespace_seed(scope.namespace)
    pages = len(token_ids) // block_size
    shared = pages if not scope.salt else min(max(0, scope.shared_tokens) // block_size, pages)
    hashes = chain_hashes(seed, token_ids[:shared * block_size], block_size)
    parents = [seed] + hashes[:-1] if hashes else []
    if shared < pages:
        salted = salt_seed(hashes[-1] if hashes else seed, scope.salt)
        more = chain_hashes(salted, token_ids[shared * block_size:pages * block_size], block_size)
        parents += [salted] + more[:-1]
        hashes += more
    return PageNames(hashes, parents, scope_digest(scope.namespace, scope.salt))


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
    names = page_names(token_ids[:end * bs], bs, scope)
    key = page_key(core)
    kv = core.runner.kv
    out = []
    for i in range(first_page, end):
        header = PageHeader(key, names.scope, names.hashes[i], names.parents[i],
                            tuple(token_ids[i * bs:(i + 1) * bs]))
        out.append((header, gather_block(kv.k_caches, kv.v_caches, match.blocks[i])))
    return out


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
