"""Store a step's new K/V rows into the paged cache at their slots.

One program per new token copies that token's ``[num_kv_heads, head_dim]`` key and
value rows to ``block = slot // block_size``, ``offset = slot % block_size``.
A negative slot means "no slot" (the padded rows of a CUDA-graph batch) and is
skipped, so padding never overwrites a live block. Rotary embeddings are applied
by the model before this store (not fused here: one extra read of K per token,
small next to attention's reads of the whole context).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels.launch import check_device, next_pow2


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    SlotMapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SlotMapping + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # slot < 0 is padding: the mask turns every load and store of this program off
    # (the slot is broadcast to the tile first; a scalar term breaks the interpreter's mask).
    live = (tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot) >= 0
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & live
    block = slot // PAGE
    offset = slot % PAGE
    src_k = K + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = V + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = KCache + block * stride_kcb + offset * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = VCache + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(dst_k, tl.load(src_k, mask=mask), mask=mask)
    tl.store(dst_v, tl.load(src_v, mask=mask), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k[t]``/``v[t]`` into the cache slot ``slot_mapping[t]`` (skipped when < 0).

    Args:
        k, v: [T, num_kv_heads, head_dim], the caches' dtype; the last dim contiguous
            (views of a fused QKV projection are fine).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place;
            the last dim contiguous.
        slot_mapping: [T] int32/int64 flat slots ``block * block_size + offset``; a
            negative slot leaves the cache untouched.

    Raises:
        EngineError: tensors the kernels cannot take (see ``launch.check_device``).
        ValueError: mismatched shapes or dtypes.
    """
    check_device(k)
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"k and v must both be [T, num_kv_heads, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not hold rows of shape {tuple(k.shape[1:])}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError(f"k/v dtype {k.dtype} differs from the cache's {k_cache.dtype}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1],
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=4,
    )
