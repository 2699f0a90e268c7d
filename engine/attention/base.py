"""The contract every attention backend keeps.

KV layout (per layer): ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``, the model's dtype. Token
``i`` of a request lives in block ``block_tables[b, i // block_size]`` at offset
``i % block_size``; its flat slot is ``block * block_size + offset``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    """Writes a step's new K/V into the paged cache and attends over each request's context.

    Both backends give the same result as a dense causal attention over the
    request's tokens 0..seq_len-1 (the cached prefix and the new ones).
    """

    name: str

    def prepare(self, batch: ForwardBatch) -> None:
        """Compute per-step metadata once (stored in ``batch.attn_metadata``); every
        layer's ``forward`` then reuses it. Called once per step before the model runs."""
        ...

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
        """Store ``k``/``v`` at ``batch.slot_mapping`` and return attention output.

        Args:
            q: [T, num_heads, head_dim] queries of the step's new tokens (rotary applied).
            k, v: [T, num_kv_heads, head_dim] the new tokens' keys (rotary applied) and values.
            k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
            batch: the step's ``ForwardBatch`` (after ``prepare``).
            scale: softmax scale, usually head_dim ** -0.5.

        Returns:
            [T, num_heads, head_dim] in q's dtype. Query token j of request b attends to
            keys 0..prefix_lens[b]+j of that request (causal), grouped-query: query head h
            reads KV head h // (num_heads // num_kv_heads).
        """
        ...
