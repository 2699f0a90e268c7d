r"""Radix-tree prefix cache over a ``BlockPool``: page-aligned token prefixes -> KV blocks.

Algorithm: RadixAttention from SGLang (Zheng et al. 2023, "Efficiently Programming
Large Language Models using SGLang"), with SGLang's page-aligned variant: only full
blocks are ever in the tree, so every edge holds ``k * block_size`` tokens and ``k``
block ids. Written from the paper's description, not from its code.

Tree layout::

    root                         (no tokens, no blocks, never evicted)
     +-- "ns-A"                  namespace node: cache salt (weights id + cache_salt);
     |    +-- [t0..t31] [b7 b3]  edge of 2 pages (block_size 16): tokens -> blocks
     |    |    +-- [t32..t47] [b12]
     |    |    +-- [u32..u63] [b5 b9]
     |    +-- ...
     +-- "ns-B"                  requests of different namespaces never share blocks
          +-- [s0..s15] [b4]      a prefix declared shared (e.g. the default system prompt)
               +-- salt "u1"      salt node: no tokens, no blocks; one user's pages below
               |    +-- [p16..p31] [b8]
               +-- salt "u2"
                    +-- [p16..p31] [b6]   the same tokens as u1's, never the same block

A request with a ``CacheScope`` that names a salt matches and stores its first
``shared_tokens`` (whole pages) in the namespace's own tree, where everyone with the
same prefix finds them, and the rest only below its salt node there: two salts never
share a page beyond the shared part, whatever the tokens (per-user cache isolation,
docs/reliability.md). A salt node's key can never equal a page of tokens, it holds no
blocks and goes when its last child is evicted; its pages' hashes re-seed the chain with
the salt (``engine.block_hash.salt_seed``).

Ownership of one request R (prompt = 2 pages matched from the tree, 1 full page and
1 partial page computed by R)::

    tokens   | page 0 | page 1 | page 2 | part |
    blocks      b7       b3       b12     b20
             \_ in the tree _/ \_ private to R _/
    refcount(b7) = 1 (tree) + 1 (R) + 1 per other running request that matched it
    refcount(b12) = 1 (R)
    lock_ref of the node covering [page 0, page 1] (and of its ancestors) counts R

    R finishes: insert(pages 0..2, [b7, b3, b12]) -> the tree increfs b12 (new page);
    R decrefs b7 b3 b12 b20 -> b20 is free, b12 stays with refcount 1 (the tree's);
    R unlocks its matched node.

Rules:
- BlockPool refcount of a block = number of holders; the tree holds exactly one
  reference on every block stored in it, and stores each block at most once.
- ``lock_ref`` of a node = running requests whose locked node is it or a descendant.
  Only nodes with lock_ref 0 are evictable, leaves first, least recently used first.
- A running request keeps locked a node whose path covers exactly the tree blocks it
  holds, and holds a reference on every block of that path. After a mid-run insert
  it adopts the tree's path: ``lock`` the result's ``node`` and ``incref`` its
  ``blocks``, then ``unlock`` its old node and ``decref`` its own blocks of those
  pages (some of them were duplicates of pages the tree already had).

Accounting identity (the engine checks it when idle; block accounting (docs/acceptance.md#block-accounting))::

    pool.num_free + cache.num_evictable_blocks + |blocks held by running requests|
        == pool.num_blocks

where the last term counts each block once, however many requests hold it, and
``num_evictable_blocks`` counts each tree block once. After ``evict`` of everything
with no running request, ``pool.num_free == pool.num_blocks``.

Not thread-safe: the scheduler's step loop is its only user.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from engine.block_hash import chain_hashes, namespace_seed, salt_seed
from engine.block_pool import BlockPool
from engine.errors import InvariantError


@dataclass(frozen=True)
class CacheScope:
    """Where a request's pages live in the tree.

    Attributes:
        namespace: the namespace node (the weights id, ``engine.block_hash.namespace_of``).
        salt: the request's cache salt; "" shares every page within the namespace.
        shared_tokens: with a salt, how many leading tokens (rounded down to whole pages
            by the tree) live in the namespace's shared part above the salt node.
    """

    namespace: str
    salt: str = ""
    shared_tokens: int = 0


@dataclass(frozen=True)
class SaltKey:
    """The key of a salt node among its parent's children (never equal to a page of
    tokens, which is a tuple of ints)."""

    salt: str


def as_scope(namespace: str | CacheScope) -> CacheScope:
    """A bare namespace string as the scope that shares every page in it."""
    return namespace if isinstance(namespace, CacheScope) else CacheScope(namespace)


class RadixCacheError(RuntimeError):
    """A caller broke the cache's contract: unlock below 0, lock of a node that was
    evicted, or insert of a block that the tree already stores."""


class RadixNode:
    """One tree node; an opaque handle for callers (pass it back to ``lock``/``unlock``).

    ``tokens`` is the edge label (a tuple, ``len(blocks) * block_size`` tokens) and
    ``blocks`` its KV block ids; namespace nodes, salt nodes (``salt`` set) and the root
    have neither.
    """

    __slots__ = ("parent", "tokens", "blocks", "hashes", "children", "lock_ref", "last_access",
                 "uid", "namespace", "removed", "salt")

    def __init__(self, parent: RadixNode | None, tokens: tuple[int, ...], blocks: list[int],
                 uid: int, last_access: int, namespace: str | None = None, salt: str | None = None) -> None:
        self.parent = parent
        self.tokens = tokens
        self.blocks = blocks
        # the chained hash of each page (engine.block_hash), when the cache reports events
        self.hashes: list[int] = []
        # Children are keyed by their first page of tokens (namespace nodes: by name).
        # Edges are page-aligned, so two children never share a first page.
        self.children: dict[object, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = last_access
        self.uid = uid
        self.namespace = namespace
        self.removed = False
        self.salt = salt

    def __repr__(self) -> str:
        what = (f"ns={self.namespace!r}" if self.namespace is not None
                else "salt" if self.salt is not None else f"pages={len(self.blocks)}")
        return f"RadixNode(uid={self.uid}, {what}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    """What ``match_prefix`` found.

    Attributes:
        blocks: block ids of the matched pages, in order (``num_tokens / block_size``).
        num_tokens: matched tokens, a multiple of block_size (0 when nothing matched).
        node: the deepest matched node (the root when nothing matched); lock it.
    """

    blocks: list[int]
    num_tokens: int
    node: RadixNode


@dataclass
class InsertResult:
    """What ``insert`` did.

    Attributes:
        num_existing_tokens: leading tokens whose pages the tree already had (it kept
            its own blocks for them).
        num_new_tokens: tokens whose pages the tree newly stored (it increfed those).
        duplicate_blocks: the caller's blocks that were not stored because the tree
            already had an equal page under a different block id (redundant copies).
        node: the deepest node of the inserted path (the root when nothing was stored
            or matched); lock it to keep the path pinned while the request runs.
        blocks: the tree's block ids of every inserted page, in order (what a
            ``match_prefix`` of the inserted tokens would return now); a caller that
            keeps running swaps its duplicates for these.
    """

    num_existing_tokens: int
    num_new_tokens: int
    duplicate_blocks: list[int]
    node: RadixNode
    blocks: list[int]


class RadixCache:
    """Prefix cache: a radix tree of page-aligned token prefixes, per namespace.

    Counters (each tree block counted once): ``num_cached_blocks`` (all blocks the tree
    holds a reference on), ``num_evictable_blocks`` (those in nodes with lock_ref 0)
    and ``num_locked_blocks`` (the rest).
    """

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool = True, events: bool = False) -> None:
        """Build an empty cache over ``pool`` with ``block_size`` tokens per block.

        When ``enabled`` is False, ``match_prefix`` matches nothing and ``insert``
        stores nothing, so the scheduler keeps one code path. With ``events``, every
        page stored or evicted is named by its chained hash (``engine.block_hash``) and
        recorded for ``take_events`` (what the engine reports to gateways for routing).

        Raises:
            ValueError: ``block_size < 1``.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self._uids = itertools.count()
        self._clock = 0  # logical time: bumped by every match and insert
        self._root = RadixNode(None, (), [], next(self._uids), 0)
        self._tree_blocks: set[int] = set()
        self._num_cached = 0
        self._num_locked = 0
        self.events = events
        # page hash -> stored (True) or evicted (False) since the last take_events; a
        # page stored and evicted in between keeps only its last state
        self._pending: dict[int, bool] = {}
        self._seeds: dict[str, int] = {}
        # called with each evicted page-holding node before its blocks are freed (the KV
        # tiers' write-back): the node, the chained hash of the page before its first page
        # (the namespace's seed for a prompt's first page, as ``engine.tiers.page_refs``), and the
        # namespace and salt (None: unsalted) it lives under; needs ``events`` (the hashes)
        self.on_evict: Callable[[RadixNode, int, str, str | None], None] | None = None

    # --- counters ----------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the tree holds a reference on."""
        return self._num_cached

    @property
    def num_locked_blocks(self) -> int:
        """Tree blocks in nodes with lock_ref > 0 (in use by running requests)."""
        return self._num_locked

    @property
    def num_evictable_blocks(self) -> int:
        """Tree blocks in nodes with lock_ref 0: what ``evict`` can give back to the pool."""
        return self._num_cached - self._num_locked

    @property
    def root(self) -> RadixNode:
        """The root node (what an empty match returns; locking it is a no-op)."""
        return self._root

    # --- match / lock ------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], namespace: str | CacheScope = "",
                     max_tokens: int | None = None) -> MatchResult:
        """Find the longest cached prefix of ``token_ids`` in ``namespace``, in whole blocks.

        ``namespace`` is a namespace name or a ``CacheScope``; a salted scope matches its
        shared pages in the namespace and the rest only below its salt node.
        At most ``max_tokens`` tokens are matched (rounded down to a block multiple);
        a caller that needs logits passes ``len(token_ids) - 1``. When the match ends
        inside an edge, that edge is split at the block boundary so that the returned
        node covers exactly the matched blocks. Refreshes the last-access time of the
        matched path. Does not lock and does not incref.

        Caller's contract: before any other cache call, ``lock(result.node)`` and
        ``pool.incref(result.blocks)``; later ``unlock`` it exactly once and decref
        the blocks. The blocks are complete (a page enters the tree only after its KV
        was written), so they can be read at once and must never be written.
        """
        bs = self.block_size
        scope = as_scope(namespace)
        limit = len(token_ids) if max_tokens is None else max(0, min(len(token_ids), max_tokens))
        num_pages = limit // bs
        ns_node = self._root.children.get(scope.namespace) if self.enabled else None
        if ns_node is None or num_pages == 0:
            return MatchResult([], 0, self._root)
        self._clock += 1
        tokens = tuple(token_ids[: num_pages * bs])
        shared = self._shared_pages(scope, num_pages)
        node, blocks = self._walk(ns_node, tokens[: shared * bs])
        if len(blocks) == shared < num_pages:  # the shared part is all there: go on below the salt
            salt_node = node.children.get(SaltKey(scope.salt))
            if salt_node is not None:
                salt_node.last_access = self._clock
                deeper, more = self._walk(salt_node, tokens[shared * bs:])
                if more:
                    node, blocks = deeper, blocks + more
        if not blocks:
            return MatchResult([], 0, self._root)
        return MatchResult(blocks, len(blocks) * bs, node)

    def _shared_pages(self, scope: CacheScope, num_pages: int) -> int:
        """Leading pages (of ``num_pages``) that ``scope`` keeps in its namespace's shared part."""
        if not scope.salt:
            return num_pages
        return min(max(0, scope.shared_tokens) // self.block_size, num_pages)

    def lock(self, node: RadixNode) -> None:
        """Pin ``node`` and its ancestors against eviction (lock_ref += 1 on the path).

        Locking the root is a no-op (it holds no blocks).

        Raises:
            RadixCacheError: the node was evicted since it was returned (lock right
                after ``match_prefix``/``insert``, before other cache calls).
        """
        if node is self._root:
            return
        if node.removed:
            raise RadixCacheError(f"lock of {node!r}, which is no longer in the cache")
        for n in self._path(node):
            if n.lock_ref == 0 and n.blocks:
                self._num_locked += len(n.blocks)
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        """Undo one ``lock(node)``: its path becomes evictable where lock_ref reaches 0.

        Raises:
            RadixCacheError: the node's lock_ref is already 0 (more unlocks than locks).
        """
        if node is self._root:
            return
        if node.removed or node.lock_ref <= 0:
            raise RadixCacheError(f"unlock of {node!r} below lock_ref 0")
        for n in self._path(node):
            n.lock_ref -= 1
            if n.lock_ref == 0 and n.blocks:
                self._num_locked -= len(n.blocks)

    # --- insert ------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int],
               namespace: str | CacheScope = "") -> InsertResult:
        """Store the pages ``token_ids`` -> ``blocks`` (full blocks only) in ``namespace``
        (a name or a ``CacheScope``: a salted scope stores its pages past the shared part
        below its salt node, creating it).

        ``len(token_ids) == len(blocks) * block_size``: the caller trims its partial
        last block, and inserts only pages whose KV is fully written (a match hands
        them to other requests at once, read-only). Pages the tree already has keep the tree's block (reported in
        ``num_existing_tokens``; the caller's block, if different, in
        ``duplicate_blocks``); new pages are stored with one new tree reference each
        (incref). So the caller afterwards decrefs *all* of its own blocks, whatever
        the result. Nothing is stored when the cache is disabled. Refreshes the
        last-access time of the path. One walk of the tree: the result carries the
        deepest node and the tree's blocks of the whole path, so a caller that keeps
        running locks and adopts them without a second ``match_prefix``.

        Raises:
            ValueError: the lengths disagree, or ``blocks`` lists a block twice.
            RadixCacheError: a block to store is already in the tree (at another page),
                or is free in the pool. Nothing is stored when it raises.
        """
        bs = self.block_size
        n = len(blocks)
        if len(token_ids) != n * bs:
            raise ValueError(f"insert needs len(token_ids) == len(blocks) * {bs}, "
                             f"got {len(token_ids)} tokens for {n} blocks")
        if len(set(blocks)) != n:
            raise ValueError("insert got the same block id twice")
        if not self.enabled or n == 0:
            return InsertResult(0, 0, [], self._root, [])
        scope = as_scope(namespace)
        tokens = tuple(token_ids)
        self._clock += 1
        shared = self._shared_pages(scope, n)
        ns_node = self._root.children.get(scope.namespace)
        node: RadixNode | None = ns_node
        salt_node: RadixNode | None = None
        tree_blocks: list[int] = []
        if ns_node is not None:
            node, tree_blocks = self._walk(ns_node, tokens[: shared * bs])
            if len(tree_blocks) == shared < n:
                salt_node = node.children.get(SaltKey(scope.salt))
                if salt_node is not None:
                    salt_node.last_access = self._clock
                    node, more = self._walk(salt_node, tokens[shared * bs:])
                    tree_blocks = tree_blocks + more
        pos = len(tree_blocks)
        duplicates = [mine for tree_block, mine in zip(tree_blocks, blocks) if tree_block != mine]
        new_blocks = list(blocks[pos:])
        for b in itertools.chain(duplicates, new_blocks):
            if b in self._tree_blocks:
                raise RadixCacheError(f"block {b} is already stored in the tree at another page")
            if self.pool.refcount(b) < 1:
                raise RadixCacheError(f"block {b} is free in the pool; the caller must hold it")
        if new_blocks:
            if node is None:
                node = ns_node = RadixNode(self._root, (), [], next(self._uids), self._clock, scope.namespace)
                self._root.children[scope.namespace] = ns_node
            if pos < shared:  # the rest of the shared part first, in the namespace itself
                node = self._add_leaf(node, tokens[pos * bs: shared * bs], blocks[pos:shared])
            if shared < n:
                if salt_node is None:
                    salt_node = node = RadixNode(node, (), [], next(self._uids), self._clock, salt=scope.salt)
                    assert salt_node.parent is not None
                    salt_node.parent.children[SaltKey(scope.salt)] = salt_node
                start = max(pos, shared)
                node = self._add_leaf(node, tokens[start * bs:], blocks[start:])
            self.pool.incref(new_blocks)
            self._tree_blocks.update(new_blocks)
            self._num_cached += len(new_blocks)
        if node is None or not node.blocks:  # nothing stored or matched (a namespace or salt node)
            node = self._root
        return InsertResult(pos * bs, (n - pos) * bs, duplicates, node, tree_blocks + new_blocks)

    def _add_leaf(self, parent: RadixNode, tokens: tuple[int, ...], blocks: Sequence[int]) -> RadixNode:
        """A new child of ``parent`` holding the pages ``tokens`` -> ``blocks`` (named by
        their chained hashes when the cache reports events); counters are the caller's."""
        leaf = RadixNode(parent, tokens, list(blocks), next(self._uids), self._clock)
        parent.children[tokens[: self.block_size]] = leaf
        if self.events:
            leaf.hashes = chain_hashes(self._tail_hash(parent), tokens, self.block_size)
            for h in leaf.hashes:
                self._pending[h] = True
        return leaf

    # --- eviction ------------------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` blocks by evicting unlocked leaves, least recently
        used first (a parent whose last child went becomes a candidate). Whole nodes are
        evicted, so it may free more; it frees less only when nothing evictable is left.

        Returns:
            Blocks that went back to the pool's free list (with correct use, every
            evicted block). Evicting 0 (or less) is a no-op that returns 0.
        """
        if num_blocks <= 0 or self._num_cached == self._num_locked:
            return 0
        heap = [(n.last_access, n.uid, n) for n in self._iter_live() if self._evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            assert parent is not None
            # a namespace or salt node goes with its last child (then its parent may be a leaf)
            while parent is not self._root and not parent.blocks and not parent.children and parent.lock_ref == 0:
                grand = parent.parent
                self._remove_leaf(parent)
                assert grand is not None
                parent = grand
            if self._evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def reset(self) -> int:
        """Evict everything that is not locked. Returns the blocks freed."""
        return self.evict(self._num_cached)

    # --- events ----------------------------------------------------------------------------

    def take_events(self) -> tuple[list[int], list[int]]:
        """The pages stored and evicted since the last call, by chained hash
        (``engine.block_hash``): ``(stored, removed)``, disjoint lists of unsigned 64-bit
        ints. A page stored and evicted in between appears once, in its last state.
        Both are empty when the cache was built without ``events``."""
        if not self._pending:
            return [], []
        pending, self._pending = self._pending, {}
        stored = [h for h, live in pending.items() if live]
        removed = [h for h, live in pending.items() if not live]
        return stored, removed

    def cached_hashes(self) -> list[int]:
        """The chained hash of every page in the tree now (empty without ``events``)."""
        return [h for n in self._iter_live() for h in n.hashes]

    def _tail_hash(self, node: RadixNode) -> int:
        """The hash of the last page on the path to ``node`` (a namespace node: its seed; a
        salt node: the salted seed after its parent's last page)."""
        if node.namespace is not None:
            seed = self._seeds.get(node.namespace)
            if seed is None:
                seed = self._seeds[node.namespace] = namespace_seed(node.namespace)
            return seed
        if node.salt is not None:
            assert node.parent is not None
            return salt_seed(self._tail_hash(node.parent), node.salt)
        return node.hashes[-1]

    # --- checks and debugging ------------------------------------------------------------

    def holds_block(self, block: int) -> bool:
        """Whether ``block`` is one of the tree's pages."""
        return block in self._tree_blocks

    def check_invariants(self) -> None:
        """Check the tree's structure and recount its counters (also checks the pool).

        Raises:
            InvariantError: an edge is not page-aligned, a parent/child link or key is
                wrong, a lock_ref is negative or smaller than its children's sum, a block
                is stored twice or is free in the pool, or a counter disagrees.
        """
        self.pool.check_invariants()
        bs = self.block_size
        root = self._root
        if not (not root.tokens and not root.blocks and root.lock_ref == 0):
            raise InvariantError("root must be empty")
        seen: set[int] = set()
        cached = locked = 0
        for top in root.children.values():
            if not (top.namespace is not None and not top.tokens and not top.blocks):
                raise InvariantError(f"namespace node {top!r} holds tokens or blocks")
            if not (not top.removed):
                raise InvariantError(f"{top!r} is marked removed")
            if not (top.parent is root and root.children[top.namespace] is top):
                raise InvariantError(f"namespace node {top!r} is not linked under the root")
            if not (top.children or top.lock_ref > 0):
                raise InvariantError(f"empty namespace node {top!r}")
            stack = [top]
            while stack:
                n = stack.pop()
                if not (n.lock_ref >= sum(c.lock_ref for c in n.children.values())):
                    raise InvariantError(f"{n!r} lock_ref below its children's sum")
                for key, c in n.children.items():
                    if not (c.parent is n and not c.removed):
                        raise InvariantError(f"bad parent link at {c!r}")
                    if c.salt is not None:
                        if c.tokens or c.blocks or c.hashes or c.namespace is not None or n.salt is not None:
                            raise InvariantError(f"salt node {c!r} holds tokens or blocks, or sits below a salt")
                        if not (key == SaltKey(c.salt) and c.children):
                            raise InvariantError(f"salt node {c!r} is mis-keyed or empty")
                        stack.append(c)
                        continue
                    if not (c.namespace is None and c.blocks):
                        raise InvariantError(f"{c!r} holds no blocks")
                    if not (len(c.tokens) == len(c.blocks) * bs):
                        raise InvariantError(f"{c!r} edge not page-aligned")
                    if self.events and len(c.hashes) != len(c.blocks):
                        raise InvariantError(f"{c!r} has {len(c.hashes)} page hashes for {len(c.blocks)} pages")
                    if not (key == c.tokens[:bs]):
                        raise InvariantError(f"{c!r} keyed by the wrong page")
                    for b in c.blocks:
                        if not (b not in seen):
                            raise InvariantError(f"block {b} stored twice in the tree")
                        seen.add(b)
                        if not (self.pool.refcount(b) >= 1):
                            raise InvariantError(f"tree block {b} is free in the pool")
                    cached += len(c.blocks)
                    locked += len(c.blocks) if c.lock_ref > 0 else 0
                    stack.append(c)
        if not (seen == self._tree_blocks):
            raise InvariantError("tree block set out of sync")
        if not (cached == self._num_cached):
            raise InvariantError(f"num_cached_blocks {self._num_cached} != recount {cached}")
        if not (locked == self._num_locked):
            raise InvariantError(f"num_locked_blocks {self._num_locked} != recount {locked}")

    def pretty(self) -> str:
        """A multi-line dump of the tree (debugging aid; token lists are abbreviated)."""
        lines = [f"RadixCache(block_size={self.block_size}, cached={self._num_cached}, "
                 f"locked={self._num_locked}, enabled={self.enabled})"]

        def walk(n: RadixNode, depth: int) -> None:
            toks = list(n.tokens[:8]) + (["..."] if len(n.tokens) > 8 else [])
            label = (f"ns {n.namespace!r}" if n.namespace is not None
                     else f"salt {n.salt[:8]!r}" if n.salt is not None else f"{toks} -> {n.blocks}")
            lines.append(f"{'  ' * depth}{label} lock={n.lock_ref} t={n.last_access}")
            for c in n.children.values():
                walk(c, depth + 1)

        for top in self._root.children.values():
            walk(top, 1)
        return "\n".join(lines)

    # --- internals -----------------------------------------------------------------------

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """``node`` and its ancestors up to (not including) the root, deepest first."""
        path = []
        n: RadixNode | None = node
        while n is not None and n is not self._root:
            path.append(n)
            n = n.parent
        return path

    def _walk(self, ns_node: RadixNode, tokens: tuple[int, ...]) -> tuple[RadixNode, list[int]]:
        """Follow ``tokens`` (whole pages) down from ``ns_node`` as far as the tree has them.

        The one walk of ``match_prefix`` and ``insert``: an edge that the tokens leave
        midway is split at that page boundary, so the returned node covers exactly the
        matched pages; every node passed gets the current clock as its last access.

        Returns:
            (the deepest matched node, or ``ns_node`` when none; the tree's block ids of
            the matched pages, in order).
        """
        bs = self.block_size
        num_pages = len(tokens) // bs
        node, pos, blocks = ns_node, 0, []
        while pos < num_pages:
            child = node.children.get(tokens[pos * bs:(pos + 1) * bs])
            if child is None:
                break
            m = _common_pages(child.tokens, tokens, pos * bs, bs)
            if m < len(child.blocks):
                child = self._split(child, m)
            blocks.extend(child.blocks)
            child.last_access = self._clock
            node, pos = child, pos + m
        return node, blocks

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        """Cut ``child``'s edge after ``m`` pages (0 < m < pages); returns the new upper node.

        Blocks, lock_ref and last-access time are shared by both halves, so no counter
        changes and a lock held on ``child`` still unlocks both.
        """
        bs = self.block_size
        parent = child.parent
        assert parent is not None and 0 < m < len(child.blocks)
        upper = RadixNode(parent, child.tokens[: m * bs], child.blocks[:m], next(self._uids),
                          child.last_access)
        upper.lock_ref = child.lock_ref
        parent.children[upper.tokens[:bs]] = upper
        child.tokens, child.blocks, child.parent = child.tokens[m * bs:], child.blocks[m:], upper
        upper.hashes, child.hashes = child.hashes[:m], child.hashes[m:]
        upper.children[child.tokens[:bs]] = child
        return upper

    def _remove_leaf(self, node: RadixNode) -> int:
        """Unlink a childless, unlocked node and decref its blocks; returns blocks freed."""
        assert not node.children and node.lock_ref == 0 and not node.removed
        parent = node.parent
        if parent is not None:
            key = node.namespace if node.namespace is not None else (
                SaltKey(node.salt) if node.salt is not None else node.tokens[:self.block_size])
            del parent.children[key]
        node.removed = True
        if not node.blocks:
            return 0
        if self.on_evict is not None and self.events and parent is not None:
            self.on_evict(node, *self._place(parent))
        for h in node.hashes:
            self._pending[h] = False
        self._tree_blocks.difference_update(node.blocks)
        self._num_cached -= len(node.blocks)
        return len(self.pool.decref(node.blocks))

    def _place(self, parent: RadixNode) -> tuple[int, str, str | None]:
        """Where a child of ``parent`` lives: the chained hash before its first page, its
        namespace and its salt (None: the shared part)."""
        namespace, salt = "", None
        up: RadixNode | None = parent
        while up is not None:  # the nearest salt node and the namespace node above
            if up.salt is not None and salt is None:
                salt = up.salt
            if up.namespace is not None:
                namespace = up.namespace
                break
            up = up.parent
        above = parent.parent if parent.salt is not None else parent  # a page's parent page skips the salt
        assert above is not None
        return self._tail_hash(above), namespace, salt

    def page_nodes(self) -> Iterator[tuple[RadixNode, int, str, str | None]]:
        """Every page-holding node of the live tree, a parent before its children, as
        ``on_evict`` names it: ``(node, hash before its first page, namespace, salt)``
        (needs ``events``). Do not change the tree while iterating."""
        for n in self._iter_live():
            if n.blocks and n.parent is not None:
                yield (n, *self._place(n.parent))

    def _evictable_leaf(self, node: RadixNode) -> bool:
        """A block-holding, childless, unlocked node."""
        return bool(node.blocks) and not node.children and node.lock_ref == 0

    def _iter_live(self) -> Iterator[RadixNode]:
        """Every node of the live tree (namespace nodes included), in no set order."""
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())


def _common_pages(edge: tuple[int, ...], query: tuple[int, ...], start: int, bs: int) -> int:
    """Whole pages that ``edge`` shares with ``query[start:]`` from their starts."""
    n = min(len(edge), len(query) - start) // bs * bs
    if query[start:start + n] == edge[:n]:
        return n // bs
    pages = 0
    while pages * bs < n and query[start + pages * bs:start + (pages + 1) * bs] == edge[pages * bs:(pages + 1) * bs]:
        pages += 1
    return pages


__all__ = ["CacheScope", "InsertResult", "MatchResult", "RadixCache", "RadixCacheError", "RadixNode",
           "SaltKey", "as_scope"]
