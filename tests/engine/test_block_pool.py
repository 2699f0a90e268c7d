"""BlockPool: allocation, reference counts and the free + referenced == total invariant."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_pool import BlockPool, BlockRefError, NoFreeBlocksError, blocks_needed


def test_allocate_all_then_one_more_raises_and_allocates_nothing():
    pool = BlockPool(5)
    got = pool.allocate(5)
    assert sorted(got) == [0, 1, 2, 3, 4]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.num_free == 0 and pool.num_used == 5
    pool.decref(got[:2])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free == 2, "a failed allocate must not take any block"
    pool.check_invariants()


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.decref([a])
    with pytest.raises(BlockRefError):
        pool.decref([b, a])
    assert pool.refcount(b) == 1, "a rejected decref must leave the other blocks alone"
    with pytest.raises(BlockRefError):
        pool.decref([b, b])  # refcount 1, two drops asked
    assert pool.refcount(b) == 1
    pool.check_invariants()


def test_incref_of_free_block_raises():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    with pytest.raises(BlockRefError):
        pool.incref([a, (a + 1) % 3])
    assert pool.refcount(a) == 1
    pool.check_invariants()


def test_block_reused_only_at_refcount_zero():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.incref([a])
    assert pool.decref([a]) == []  # still held once
    assert pool.decref([a, b]) == [a, b]
    again = pool.allocate(2)
    assert sorted(again) == sorted([a, b])
    assert all(pool.refcount(x) == 1 for x in again)


def test_bad_ids_and_sizes_are_rejected():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(IndexError):
        pool.refcount(2)
    with pytest.raises(IndexError):
        pool.decref([-1])
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.allocate(0) == []


def test_blocks_needed_rounds_up():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/incref/decref sequences against a dict of refcounts."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 12
        self.pool = BlockPool(self.total)
        self.model: dict[int, int] = {}  # block -> refcount, only referenced blocks

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        free = self.total - len(self.model)
        if n > free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        assert len(set(got)) == n
        for b in got:
            assert b not in self.model, f"block {b} handed out while referenced"
            self.model[b] = 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def incref(self, data):
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4))
        self.pool.incref(blocks)
        for b in blocks:
            self.model[b] += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def decref(self, data):
        # Draw each block at most as often as it is referenced, so this never double-frees.
        pool_of_refs = [b for b, rc in self.model.items() for _ in range(rc)]
        idx = data.draw(st.lists(st.integers(0, len(pool_of_refs) - 1), min_size=1, max_size=4, unique=True))
        blocks = [pool_of_refs[i] for i in idx]
        freed = self.pool.decref(blocks)
        expect_freed = []
        for b in blocks:
            self.model[b] -= 1
            if self.model[b] == 0:
                del self.model[b]
                expect_freed.append(b)
        assert freed == expect_freed

    @rule(block=st.integers(0, 11))
    def decref_of_free_block_raises(self, block):
        if block in self.model:
            return
        with pytest.raises(BlockRefError):
            self.pool.decref([block])

    @invariant()
    def matches_model(self):
        self.pool.check_invariants()
        assert self.pool.num_used == len(self.model)
        assert self.pool.num_free == self.total - len(self.model)
        for b in range(self.total):
            assert self.pool.refcount(b) == self.model.get(b, 0)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


def test_a_broken_invariant_raises_its_own_error_even_under_python_dash_o():
    """The checks raise InvariantError explicitly (an `assert` would vanish under -O), with
    the numbers that broke in the message."""
    import subprocess
    import sys

    code = ("from engine.block_pool import BlockPool\n"
            "from engine.errors import InvariantError\n"
            "p = BlockPool(4); p.allocate(2); p._refcount[3] = 1\n"
            "try:\n    p.check_invariants()\nexcept InvariantError as e:\n    print('raised', e.code, e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("raised invariant_failed") and "block 3" in out
