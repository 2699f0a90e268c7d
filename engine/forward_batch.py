"""The per-step batch handed to the model: one flat ("varlen") token batch.

Layout of one step with three requests (A: prefill chunk of 3 new tokens after
4 cached ones, B: decode, C: decode)::

    input_ids      [a4 a5 a6 | b9 | c2]           T = 5 tokens, flat
    positions      [ 4  5  6 |  9 |  2]
    query_start    [0, 3, 4, 5]                   B + 1 offsets into T
    seq_lens       [7, 10, 3]                     keys each request attends to after this step
    prefix_lens    [4, 9, 2]                      keys already in the KV cache before it
    block_tables   [[3, 8, 0], [5, 1, 9], [2, 0, 0]]   padded with 0; only the first
                                                  ceil(seq_len / block_size) entries are read
    slot_mapping   [8*bs+0, 8*bs+1, 8*bs+2, ...]  flat KV slot = block * block_size + offset
    logits_indices [2, 3, 4]                      rows of T whose logits are sampled

Built once per step by the model runner; every layer reads the same object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """Index tensors of one forward step; all on the model's device.

    Attributes:
        input_ids: [T] int64 token ids to compute.
        positions: [T] int64 absolute positions (for rotary embeddings).
        slot_mapping: [T] int64 flat KV slot where each token's K and V are written.
        query_start_loc: [B + 1] int32 cumulative query lengths.
        seq_lens: [B] int32 total context length of each request after this step.
        prefix_lens: [B] int32 context already in the KV cache before this step.
        block_tables: [B, max_blocks] int32 physical block ids, padded with 0.
        logits_indices: [S] int64 rows of T whose logits are wanted (a request's last row, or
            its last rows in a speculative step; in request order).
        query_lens_cpu, seq_lens_cpu, prefix_lens_cpu: the same lengths as Python lists.
        max_query_len, max_seq_len: maxima of the above (tokens).
        block_size: tokens per KV block.
        is_decode: True when every request contributes exactly one token.
        attn_metadata: backend-private data prepared once per step (``AttentionBackend.prepare``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    is_decode: bool
    attn_metadata: Any = field(default=None)

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens computed this step."""
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        """B, the number of requests in this step."""
        return len(self.seq_lens_cpu)

    @classmethod
    def build(
        cls,
        *,
        token_chunks: list[list[int]],
        prefix_lens: list[int],
        block_tables: list[list[int]],
        sample_mask: list[bool],
        block_size: int,
        device: torch.device | str = "cpu",
        num_logits: list[int] | None = None,
    ) -> ForwardBatch:
        """Build a batch from per-request token chunks.

        Args:
            token_chunks: per request, the new tokens to compute this step (each >= 1).
            prefix_lens: per request, tokens already in the KV cache (positions start there).
            block_tables: per request, its physical blocks covering at least
                prefix_len + len(chunk) tokens.
            sample_mask: per request, whether its last token's logits are wanted.
            block_size: tokens per block.
            device: where the tensors go.
            num_logits: per request, how many of its last tokens' logits are wanted (a
                speculative step verifies several positions); overrides ``sample_mask``.

        Raises:
            ValueError: an empty chunk, a block table too short for its tokens, or more
                logits than tokens.
        """
        if num_logits is None:
            num_logits = [1 if want else 0 for want in sample_mask]
        query_lens = [len(c) for c in token_chunks]
        if any(q < 1 for q in query_lens):
            raise ValueError("every request in a batch computes at least one token")
        seq_lens = [p + q for p, q in zip(prefix_lens, query_lens)]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts = [0]
        logits_idx: list[int] = []
        for chunk, p, table, want in zip(token_chunks, prefix_lens, block_tables, num_logits):
            if len(table) * block_size < p + len(chunk):
                raise ValueError("block table too short for the request's tokens")
            if want > len(chunk):
                raise ValueError("a request wants more logits than it computes tokens")
            ids.extend(chunk)
            for i in range(p, p + len(chunk)):
                pos.append(i)
                slots.append(table[i // block_size] * block_size + i % block_size)
            starts.append(starts[-1] + len(chunk))
            logits_idx.extend(range(starts[-1] - want, starts[-1]))
        max_blocks = max(1, max(len(t) for t in block_tables))
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        dev = torch.device(device)

        def i64(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=dev)

        def i32(x: Any) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32, device=dev)

        return cls(
            input_ids=i64(ids),
            positions=i64(pos),
            slot_mapping=i64(slots),
            query_start_loc=i32(starts),
            seq_lens=i32(seq_lens),
            prefix_lens=i32(list(prefix_lens)),
            block_tables=i32(padded),
            logits_indices=i64(logits_idx),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(prefix_lens),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=block_size,
            is_decode=all(q == 1 for q in query_lens),
        )
