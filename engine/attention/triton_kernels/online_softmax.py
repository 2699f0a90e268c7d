"""The inner step shared by the decode and extend kernels: one key tile of an online softmax.

Source: the online-softmax recurrence of Milakov and Gimelshein, "Online normalizer
calculation for softmax" (2018), as used by FlashAttention-2 (Dao, 2023): keep a
running row maximum ``m`` and sum ``l``; for each key tile rescale the
accumulator by ``2^(m_old - m_new)`` and add ``P V``. Exponentials are base 2 with
``log2(e)`` folded into the scale (one multiply fewer per score).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    n0,
    hi,
    table,
    KCache,
    VCache,
    kv_head_off_k,
    kv_head_off_v,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    offs_d,
    mask_d,
    scale_log2,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Fold keys ``n0 .. n0 + BLOCK_N - 1`` of one request into the running softmax.

    Shapes: ``q`` [R, BLOCK_D] (R query rows), ``acc`` [R, BLOCK_D] float32, ``m_i`` and
    ``l_i`` [R] float32 (running max and sum, base 2), ``q_pos`` [R] absolute query
    positions; key ``j`` of the tile is read from the cache at
    ``block = table[j // PAGE]``, ``offset = j % PAGE``. With MASKED, keys ``>= hi``
    and keys after a row's position are dropped; without it, the caller guarantees
    every key of the tile is visible to every row (the hot loop then carries no masks).
    DOT_F32 upcasts the dot operands to float32 after the same roundings (the same
    numbers as a bf16 tensor-core dot with float32 accumulation); launchers set it
    only under the interpreter, whose ``tl.dot`` mishandles bfloat16 (Triton 3.9).
    Returns the updated ``(acc, m_i, l_i)``.
    """
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < hi
        block = tl.load(table + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
    else:
        block = tl.load(table + offs_n // PAGE).to(tl.int64)
        kv_mask = mask_d[None, :]
    in_block = offs_n % PAGE
    k = tl.load(
        KCache + block[:, None] * stride_kb + in_block[:, None] * stride_ks + kv_head_off_k + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if DOT_F32:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale_log2
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        VCache + block[:, None] * stride_vb + in_block[:, None] * stride_vs + kv_head_off_v + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    if DOT_F32:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i
