"""TorchAttentionBackend against a dense float64 causal attention, on random paged batches.

Each run draws a fresh seed (printed in failure messages) so that repeated runs
cover more layouts: shuffled block tables, GQA ratios 1/4/8, cached prefixes of
0..several blocks, decode and prefill requests mixed in one flat batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.forward_batch import ForwardBatch

HEAD_DIM = 16
NUM_KV_HEADS = 2


@dataclass
class PagedCase:
    """One random batch: per request its full K/V, its queries, and where it lives."""

    batch: ForwardBatch
    q: torch.Tensor  # [T, H, D] the step's queries
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], prefixes written, the rest NaN
    v_cache: torch.Tensor
    full_k: list[torch.Tensor]  # per request [seq_len, Hkv, D], float64
    full_v: list[torch.Tensor]
    queries: list[torch.Tensor]  # per request [query_len, H, D], float64
    prefix_lens: list[int]


def fresh_seed() -> int:
    """A new seed each run (reported on failure) so runs cover different inputs."""
    return int.from_bytes(os.urandom(4), "little")


def make_case(gen: torch.Generator, shapes: list[tuple[int, int]], num_heads: int, block_size: int,
              dtype: torch.dtype = torch.float32) -> PagedCase:
    """Lay out requests ``shapes`` = [(prefix_len, query_len)] in a shuffled paged cache.

    Unused cache slots hold NaN, so a read outside a request's own keys poisons its output.
    """
    blocks_needed = [-(-(p + q) // block_size) for p, q in shapes]
    num_blocks = sum(blocks_needed) + 3  # a few never-used (NaN) blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in blocks_needed:
        tables.append(order[start:start + n])
        start += n
    k_cache = torch.full((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    full_k, full_v, queries = [], [], []
    q_rows, k_rows, v_rows = [], [], []
    for (prefix, qlen), table in zip(shapes, tables):
        keys = torch.randn(prefix + qlen, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
        values = torch.randn(prefix + qlen, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=torch.float64)
        query = torch.randn(qlen, num_heads, HEAD_DIM, generator=gen, dtype=torch.float64)
        for i in range(prefix):  # the cached prefix, as an earlier step would have left it
            k_cache[table[i // block_size], i % block_size] = keys[i].to(dtype)
            v_cache[table[i // block_size], i % block_size] = values[i].to(dtype)
        full_k.append(keys.to(dtype).double())
        full_v.append(values.to(dtype).double())
        queries.append(query.to(dtype).double())
        q_rows.append(query[:qlen])
        k_rows.append(keys[prefix:])
        v_rows.append(values[prefix:])
    batch = ForwardBatch.build(
        token_chunks=[[0] * q for _, q in shapes], prefix_lens=[p for p, _ in shapes], block_tables=tables,
        sample_mask=[True] * len(shapes), block_size=block_size,
    )
    return PagedCase(batch, torch.cat(q_rows).to(dtype), torch.cat(k_rows).to(dtype), torch.cat(v_rows).to(dtype),
                     k_cache, v_cache, full_k, full_v, queries, [p for p, _ in shapes])


def dense_reference(case: PagedCase, scale: float) -> torch.Tensor:
    """Plain causal grouped-query attention in float64, request by request: [T, H, D]."""
    outs = []
    for keys, values, query, prefix in zip(case.full_k, case.full_v, case.queries, case.prefix_lens):
        group = query.shape[1] // keys.shape[1]
        k = keys.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
        v = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, k) * scale
        q_pos = torch.arange(query.shape[0]).view(-1, 1) + prefix
        allowed = torch.arange(k.shape[0]).view(1, -1) <= q_pos
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def random_shapes(gen: torch.Generator, block_size: int, count: int, decode_share: float) -> list[tuple[int, int]]:
    """``count`` (prefix_len, query_len) pairs: prefixes 0..4 blocks (aligned or not),
    a ``decode_share`` of one-token queries, the rest 2..20-token chunks."""
    shapes = []
    for _ in range(count):
        prefix = int(torch.randint(0, 4 * max(block_size, 4) + 1, (1,), generator=gen))
        if torch.rand(1, generator=gen).item() < 0.3:
            prefix -= prefix % block_size  # block-aligned prefixes are the common cache-hit case
        decode = torch.rand(1, generator=gen).item() < decode_share
        qlen = 1 if decode else int(torch.randint(2, 21, (1,), generator=gen))
        shapes.append((prefix, qlen))
    return shapes


def check_against_reference(case: PagedCase, num_heads: int, seed: int, atol: float) -> None:
    """Run the backend on ``case`` and compare output and written cache slots."""
    backend = TorchAttentionBackend()
    backend.prepare(case.batch)
    scale = HEAD_DIM ** -0.5
    out = backend.forward(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, case.batch, scale)
    assert out.shape == (case.batch.num_tokens, num_heads, HEAD_DIM), f"seed {seed}"
    assert out.dtype == case.q.dtype
    assert torch.isfinite(out).all(), f"seed {seed}: output read an unwritten (NaN) slot or was not fully written"
    ref = dense_reference(case, scale)
    err = (out.double() - ref).abs().max().item()
    assert err <= atol, f"seed {seed}: max abs error {err:.2e} > {atol:.0e}"
    slots = case.batch.slot_mapping
    assert torch.equal(case.k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], case.k_new), f"seed {seed}"
    assert torch.equal(case.v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots], case.v_new), f"seed {seed}"


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("gqa_ratio", [1, 4, 8])
@pytest.mark.parametrize("decode_share", [0.0, 0.5, 1.0], ids=["prefill", "mixed", "decode"])
def test_paged_attention_matches_dense_reference(block_size: int, gqa_ratio: int, decode_share: float) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * gqa_ratio
    for count in (1, 5):
        case = make_case(gen, random_shapes(gen, block_size, count, decode_share), num_heads, block_size)
        # float32 against float64: the softmax and sums round at ~1e-7 relative per op.
        check_against_reference(case, num_heads, seed, atol=2e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_every_request_alone_equals_batched(block_size: int) -> None:
    """Batch composition does not change a request's attention output."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    shapes = [(0, 7), (block_size * 2, 1), (5, 12), (3 * block_size + 1, 1)]
    case = make_case(gen, shapes, NUM_KV_HEADS * 4, block_size)
    backend = TorchAttentionBackend()
    backend.prepare(case.batch)
    together = backend.forward(case.q, case.k_new, case.v_new, case.k_cache.clone(), case.v_cache.clone(),
                               case.batch, 0.25)
    starts = case.batch.query_start_loc.tolist()
    for b, (prefix, qlen) in enumerate(shapes):
        rows = slice(starts[b], starts[b + 1])
        table = case.batch.block_tables[b, : -(-(prefix + qlen) // block_size)].tolist()
        alone_batch = ForwardBatch.build(token_chunks=[[0] * qlen], prefix_lens=[prefix], block_tables=[table],
                                         sample_mask=[True], block_size=block_size)
        backend.prepare(alone_batch)
        alone = backend.forward(case.q[rows], case.k_new[rows], case.v_new[rows], case.k_cache.clone(),
                                case.v_cache.clone(), alone_batch, 0.25)
        torch.testing.assert_close(alone, together[rows], rtol=1e-5, atol=1e-6, msg=f"seed {seed}, request {b}")


def test_bfloat16_matches_dense_reference_loosely() -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    case = make_case(gen, [(20, 1), (0, 9), (33, 6)], NUM_KV_HEADS * 4, 16, dtype=torch.bfloat16)
    # Inputs are rounded to bfloat16 in the reference too; what is left is bfloat16
    # rounding of the probabilities and the output (8 bits of mantissa, values ~1).
    check_against_reference(case, NUM_KV_HEADS * 4, seed, atol=3e-2)


def test_workspace_reuse_does_not_leak_between_steps() -> None:
    """A big step followed by a small one: the small one reads nothing of the big one."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    backend = TorchAttentionBackend()
    big = make_case(gen, [(40, 1)] * 6, NUM_KV_HEADS * 4, 16)
    backend.prepare(big.batch)
    backend.forward(big.q, big.k_new, big.v_new, big.k_cache, big.v_cache, big.batch, 0.25)
    small = make_case(gen, [(3, 1), (0, 4)], NUM_KV_HEADS * 4, 16)
    backend.prepare(small.batch)
    out = backend.forward(small.q, small.k_new, small.v_new, small.k_cache, small.v_cache, small.batch, 0.25)
    ref = dense_reference(small, 0.25)
    assert (out.double() - ref).abs().max().item() < 2e-5, f"seed {seed}"


def test_forward_without_prepare_is_an_error() -> None:
    gen = torch.Generator().manual_seed(0)
    case = make_case(gen, [(0, 3)], NUM_KV_HEADS, 16)
    with pytest.raises(RuntimeError, match="prepare"):
        TorchAttentionBackend().forward(case.q, case.k_new, case.v_new, case.k_cache, case.v_cache, case.batch, 0.25)
