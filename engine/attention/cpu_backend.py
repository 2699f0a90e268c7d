"""Paged attention on the engine's CPU kernels: reads the KV cache in place.

Unlike the torch backend, nothing is gathered: the kernel (``cs_paged_attention`` in
``engine/cpu/kernels.c``) walks each request's block table, converts 32 keys and
values at a time to float32 (the cache may be bfloat16), and runs an online softmax
over them for all the query heads of one KV head together (grouped-query attention:
the G = H / Hkv query heads share every key and value they read). Decode requests
split their context over several work units whose partial softmax results are merged
(flash-decoding, as the Triton decode kernel does), so that even one request keeps
every core busy; prefill chunks are split into tiles of 16 query tokens. Decode and
prefill rows of one step go through one call.
"""

from __future__ import annotations

import torch

from engine.cpu.ops import CpuKernels
from engine.forward_batch import ForwardBatch


class CpuAttentionBackend:
    """``AttentionBackend`` over the CPU kernels; float32 queries, float32 or bfloat16 cache.

    Args:
        kernels: the loaded ``engine.cpu.ops.CpuKernels``.
    """

    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    def prepare(self, batch: ForwardBatch) -> None:
        """Nothing to precompute: the kernel reads the batch's index tensors directly."""
        batch.attn_metadata = self.name

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``: q [T, H, D], k/v [T, Hkv, D] (float32) -> [T, H, D].

        Raises:
            ValueError: tensors of a dtype or layout the kernel does not take.
            MemoryError: the kernel could not allocate scratch memory.
        """
        return self.kernels.paged_attention(q, k, v, batch.slot_mapping, k_cache, v_cache, batch.block_tables,
                                            batch.seq_lens, batch.query_start_loc, scale)
