"""Paged decode attention split along the sequence (flash-decoding).

Source: Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference"
(2023); the same two-stage scheme as vLLM's paged attention v2 and SGLang's
``decode_attention`` (grouped variant), written here from the paper's description.

Stage 1, grid ``(B, num_kv_heads, num_splits)``: a program takes one request,
one KV head and one contiguous range of that request's keys, loads the
``group = num_heads // num_kv_heads`` query heads that share the KV head (so each
K/V tile is read once per group, not once per query head), and runs an online
softmax over its range through the block table. It writes its normalised partial
output and its log-sum-exp (base 2) to a float32 workspace.

Stage 2, grid ``(B, num_heads)``: combines the splits of one (request, head) as
``sum_s 2^(lse_s - max) * o_s / sum_s 2^(lse_s - max)``.

How a request's keys are split depends only on its own length (never on the
batch): ``split_len = round_up(max(split_tokens, ceil(seq_len / max_splits)), block_n)``.
The grid's split axis is ``num_splits_for(max_seq_len, ...)``; programs past a
request's last split write an empty partial (lse = -inf) that adds exactly zero.
That also makes the launch capture-safe for CUDA graphs: the grid depends on a
bound of the lengths, not on the lengths, and nothing reads back to the host.
A request with ``seq_len == 0`` (a CUDA-graph padding row) gets an all-zero output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.launch import (
    TileConfig,
    check_device,
    decode_tiles,
    dot_precision,
    interpreter_dot_f32,
    next_pow2,
)
from engine.attention.triton_kernels.online_softmax import attend_tile

LOG2E = 1.4426950408889634


# The block-table stride changes with the longest request: no recompiles for it.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    Q,
    KCache,
    VCache,
    BlockTables,
    SeqLens,
    MidO,
    MidLse,
    scale_log2,
    split_tokens,
    max_splits,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    # The partition depends on this request's length only (see the module docstring).
    split_len = tl.maximum(split_tokens, tl.cdiv(seq_len, max_splits))
    split_len = tl.cdiv(split_len, BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    table = BlockTables + b.to(tl.int64) * stride_bt
    koff = kvh * stride_kh
    voff = kvh * stride_vh
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)  # the new token sees every key
    # Whole tiles unmasked, then at most one partial tile with bounds.
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, q_pos, n0, end, table, KCache, VCache, koff, voff,
                                    stride_kb, stride_ks, stride_vb, stride_vs, offs_d, mask_d, scale_log2,
                                    PAGE, BLOCK_N, False, PRECISION, DOT_F32)
    for n0 in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, q_pos, n0, end, table, KCache, VCache, koff, voff,
                                    stride_kb, stride_ks, stride_vb, stride_vs, offs_d, mask_d, scale_log2,
                                    PAGE, BLOCK_N, True, PRECISION, DOT_F32)

    live = l_i > 0.0
    safe_l = tl.where(live, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(live, m_i + tl.log2(safe_l), float("-inf"))
    mo = MidO + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + s * stride_mos + offs_d[None, :]
    tl.store(mo, out, mask=mask_g[:, None] & mask_d[None, :])
    tl.store(MidLse + b.to(tl.int64) * stride_mlb + heads * stride_mlh + s, lse, mask=mask_g)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    MidO,
    MidLse,
    Out,
    num_splits,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(MidLse + b.to(tl.int64) * stride_mlb + h * stride_mlh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): weights all 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(
        MidO + b.to(tl.int64) * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(Out + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d)


def round_split_tokens(split_tokens: int, tiles: TileConfig) -> int:
    """``split_tokens`` rounded up to a whole number of key tiles (tokens)."""
    return -(-max(1, split_tokens) // tiles.block_n) * tiles.block_n


def num_splits_for(max_seq_len: int, split_tokens: int, max_splits: int, tiles: TileConfig) -> int:
    """Size of the decode grid's split axis for a batch whose longest context is
    ``max_seq_len`` tokens: enough splits for every request's own partition.

    A request of length L uses ``ceil(L / split_len)`` splits with
    ``split_len >= max(round_split_tokens(split_tokens), ceil(L / max_splits))``,
    which is at most both ``ceil(L / rounded split_tokens)`` and ``max_splits``.

    Raises:
        ValueError: ``max_splits < 1``.
    """
    if max_splits < 1:
        raise ValueError("max_splits must be >= 1")
    per_split = round_split_tokens(split_tokens, tiles)
    return max(1, min(max_splits, -(-max(0, max_seq_len) // per_split)))


def decode_workspace(
    num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate stage 1's outputs: partial outputs ``[B, H, S, head_dim]`` and
    log-sum-exps ``[B, H, S]``, both float32 (4 * B * H * S * (head_dim + 1) bytes)."""
    mid_o = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    mid_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=device)
    return mid_o, mid_lse


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    *,
    num_splits: int,
    split_tokens: int,
    max_splits: int,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    tiles: TileConfig | None = None,
) -> torch.Tensor:
    """Attention of one new token per request over its whole paged context.

    Args:
        q: [B, num_heads, head_dim] the requests' query rows (row b is request b), the
            caches' dtype, last dim contiguous.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]; the new
            tokens' K/V must already be stored.
        block_tables: [B, max_blocks] int32 physical blocks, any order.
        seq_lens: [B] int32 keys per request (tokens, the new one included); 0 gives a zero row.
        out: [B, num_heads, head_dim] written in full (q's dtype), last dim contiguous.
        scale: softmax scale.
        num_splits: the grid's split axis, ``>= num_splits_for(max(seq_lens), ...)``.
        split_tokens, max_splits: the partition parameters (see the module docstring).
        mid_o, mid_lse: stage-1 workspace of at least ``[B, H, num_splits, head_dim]`` and
            ``[B, H, num_splits]`` float32 (``decode_workspace``); views are fine.
        tiles: tile override (benchmarks); default ``launch.decode_tiles``.

    Returns:
        ``out``.

    Raises:
        EngineError: tensors the kernels cannot take (``launch.check_device``).
        ValueError: inconsistent shapes, or ``num_splits`` above ``max_splits``.
    """
    check_device(q)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads or k_cache.shape[3] != head_dim or out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(
            f"q {tuple(q.shape)}, cache {tuple(k_cache.shape)} and out {tuple(out.shape)} do not fit together"
        )
    if not 1 <= num_splits <= max_splits:
        raise ValueError(f"num_splits {num_splits} outside 1..max_splits={max_splits}")
    if num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    group = num_heads // num_kv_heads
    tiles = tiles or decode_tiles(head_dim, group, q.dtype)
    mid_o = mid_o[:num_seqs, :, :num_splits]
    mid_lse = mid_lse[:num_seqs, :, :num_splits]
    block_d = next_pow2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        mid_o,
        mid_lse,
        float(scale) * LOG2E,
        round_split_tokens(split_tokens, tiles),
        max_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_G=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
        DOT_F32=interpreter_dot_f32(q.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    # BLOCK_S from max_splits, not num_splits: the reduction's shape (and so its
    # summation order) is the same for every batch.
    _decode_reduce_kernel[(num_seqs, num_heads)](
        mid_o,
        mid_lse,
        out,
        num_splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=next_pow2(max_splits),
        BLOCK_D=block_d,
        num_warps=4,
    )
    return out
