"""Extend attention: the new tokens of many requests over their cached prefixes, one launch.

Source: the FlashAttention-2 forward loop (Dao, "FlashAttention-2: Faster Attention
with Better Parallelism and Work Partitioning", 2023): online softmax over key
tiles with float32 accumulators; made paged and varlen in the way of SGLang's
``extend_attention`` and vLLM's prefix-prefill kernel, written here from that
description.

Grid ``(B, ceil(max_query_len / BLOCK_M), num_heads)``. A program takes
``BLOCK_M`` consecutive new tokens of one request and one query head; new token
``i`` of request ``b`` sits at absolute position ``prefix_lens[b] + i`` and attends
to keys ``0 .. prefix_lens[b] + i`` (causal; query head ``h`` reads KV head
``h // group``). Programs past a request's last new token return at once.

Design choice: every key, the cached prefix and this step's new tokens alike, is
read from the paged cache through the block table, after ``store_kv`` has
written the new rows. One loop, one addressing scheme, and a chunked prefill
(whose earlier chunks are already cached) is the same case as a fresh one. The
cost is nil: the new rows are read once either way, from the cache instead of
from the flat ``k``/``v``. Key tiles past the diagonal of the program's last
row are never loaded; only the tiles that straddle it are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.launch import (
    TileConfig,
    check_device,
    dot_precision,
    extend_tiles,
    interpreter_dot_f32,
    next_pow2,
)
from engine.attention.triton_kernels.online_softmax import attend_tile

LOG2E = 1.4426950408889634


# The block-table stride changes with the longest request: no recompiles for it.
@triton.jit(do_not_specialize=["stride_bt"])
def _extend_kernel(
    Q,
    KCache,
    VCache,
    Out,
    BlockTables,
    QueryStart,
    PrefixLens,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    mblk = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(QueryStart + b)
    q_len = tl.load(QueryStart + b + 1) - q_start
    if mblk * BLOCK_M >= q_len:
        return
    prefix = tl.load(PrefixLens + b)
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    q_pos = prefix + offs_m  # absolute positions; rows past q_len still see key 0, so no NaN
    # Keys this program can see: up to its last live row's position (inclusive).
    hi = prefix + tl.minimum((mblk + 1) * BLOCK_M, q_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = BlockTables + b.to(tl.int64) * stride_bt
    koff = kvh * stride_kh
    voff = kvh * stride_vh
    # Keys 0 .. prefix + mblk * BLOCK_M are visible to every row of this program:
    # whole tiles of them run unmasked; the tiles that straddle the diagonal, masked.
    full_end = ((prefix + mblk * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, q_pos, n0, hi, table, KCache, VCache, koff, voff,
                                     stride_kb, stride_ks, stride_vb, stride_vs, offs_d, mask_d, scale_log2,
                                     PAGE, BLOCK_N, False, PRECISION, DOT_F32)
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, q_pos, n0, hi, table, KCache, VCache, koff, voff,
                                     stride_kb, stride_ks, stride_vb, stride_vs, offs_d, mask_d, scale_log2,
                                     PAGE, BLOCK_N, True, PRECISION, DOT_F32)

    out = acc / l_i[:, None]
    tl.store(
        Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix and themselves.

    Args:
        q: [T, num_heads, head_dim] the new tokens' queries, flat (request b owns rows
            ``query_start_loc[b] .. query_start_loc[b+1]-1``), the caches' dtype, last dim
            contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] holding every
            key of every request, this step's new ones included (``store_kv`` first).
        block_tables: [B, max_blocks] int32 physical blocks, any order.
        query_start_loc: [B + 1] int32 cumulative new-token counts.
        prefix_lens: [B] int32 tokens cached before this step.
        out: [T, num_heads, head_dim] written in full (q's dtype), last dim contiguous.
        scale: softmax scale.
        max_query_len: the largest new-token count (tokens); sizes the grid.
        tiles: tile override (benchmarks); default ``launch.extend_tiles``.

    Returns:
        ``out``.

    Raises:
        EngineError: tensors the kernels cannot take (``launch.check_device``).
        ValueError: inconsistent shapes.
    """
    check_device(q)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(
            f"q {tuple(q.shape)}, cache {tuple(k_cache.shape)} and out {tuple(out.shape)} do not fit together"
        )
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    tiles = tiles or extend_tiles(head_dim, q.dtype)
    grid = (num_seqs, triton.cdiv(max(1, max_query_len), tiles.block_m), num_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        prefix_lens,
        float(scale) * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=next_pow2(head_dim),
        PRECISION=dot_precision(q.dtype),
        DOT_F32=interpreter_dot_f32(q.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
