"""Reference-counted allocator of KV block ids (the ids only; the K/V tensors live in
``engine/kv_cache.py``).

A block is *free* (refcount 0, on the free list) or *referenced* (refcount >= 1, one
count per holder: the radix tree, each running request that uses it). Invariant
(docs/architecture.md): free + referenced == num_blocks at all times, and a block is
handed out again only once its refcount is back to 0.

Not thread-safe: the scheduler's step loop is its only user.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from engine.errors import InvariantError


class NoFreeBlocksError(RuntimeError):
    """Fewer free blocks than asked for; nothing was allocated. The scheduler answers it
    by evicting from the radix cache or preempting a request."""


class BlockRefError(RuntimeError):
    """A reference-count bug in the caller: decref of a free block (double free) or
    incref of a block that is not allocated."""


class BlockPool:
    """Allocator of ``num_blocks`` block ids ``0 .. num_blocks-1`` with a refcount each.

    All operations are O(1) per block id they touch. Block ids are plain ``int``.
    """

    def __init__(self, num_blocks: int) -> None:
        """Create a pool whose blocks are all free.

        Raises:
            ValueError: ``num_blocks < 1``.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # A deque gives O(1) pops from the front and pushes at the back: blocks are
        # handed out roughly in the order they were freed, which is all we need.
        self._free: deque[int] = deque(range(num_blocks))

    # --- sizes -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool (free + referenced)."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0, ready for ``allocate``."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks with refcount >= 1 (counted once however many holders they have)."""
        return self._num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        """Number of holders of ``block`` (0 when free).

        Raises:
            IndexError: ``block`` is not an id of this pool.
        """
        self._check_id(block)
        return self._refcount[block]

    # --- allocation --------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks; each comes back with refcount 1 (the caller's reference).

        Raises:
            ValueError: ``n < 0``.
            NoFreeBlocksError: fewer than ``n`` blocks are free; nothing is allocated.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free of {self._num_blocks}")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refcount[b] = 1
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference to each listed block (a block listed twice gets two).

        Raises:
            IndexError: an id is outside the pool.
            BlockRefError: a block is free (refcount 0): only ``allocate`` may take a
                block off the free list. Nothing is changed when it raises.
        """
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b)
            if self._refcount[b] == 0:
                raise BlockRefError(f"incref of free block {b}")
        for b in blocks:
            self._refcount[b] += 1

    def decref(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference from each listed block (a block listed twice loses two).

        Returns:
            The blocks whose refcount reached 0, in list order; they are back on the free
            list.

        Raises:
            IndexError: an id is outside the pool.
            BlockRefError: a block would go below 0 (a double free). Nothing is changed
                when it raises.
        """
        blocks = list(blocks)
        for b, times in Counter(blocks).items():
            self._check_id(b)
            if self._refcount[b] < times:
                raise BlockRefError(
                    f"double free: decref of block {b} x{times} at refcount {self._refcount[b]}"
                )
        freed: list[int] = []
        for b in blocks:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    # --- checks ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recount everything and compare.

        Raises:
            InvariantError: a refcount is negative, the free list holds a duplicate or a
                referenced block, or free + referenced != num_blocks.
        """
        free = set(self._free)
        if not (len(free) == len(self._free)):
            raise InvariantError("free list holds a duplicate block")
        referenced = 0
        for b, rc in enumerate(self._refcount):
            if not (rc >= 0):
                raise InvariantError(f"block {b} has refcount {rc} < 0")
            if rc > 0:
                referenced += 1
                if not (b not in free):
                    raise InvariantError(f"block {b} is on the free list with refcount {rc}")
            else:
                if b not in free:
                    raise InvariantError(f"block {b} has refcount 0 but is not on the free list")
        if not (len(free) + referenced == self._num_blocks):
            raise InvariantError(f"free {len(free)} + referenced {referenced} != num_blocks {self._num_blocks}")

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self._num_blocks:
            raise IndexError(f"block id {block} outside pool of {self._num_blocks}")

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self._num_blocks}, free={self.num_free})"


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens at ``block_size`` tokens a block (ceil)."""
    return -(-num_tokens // block_size)


__all__ = ["BlockPool", "BlockRefError", "NoFreeBlocksError", "blocks_needed"]
