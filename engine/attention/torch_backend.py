"""Paged attention with plain torch ops: gather each request's keys, then SDPA.

Runs on any device. Per step, ``prepare`` splits the requests into two groups and
builds their index tensors once; every layer's ``forward`` then costs a fixed
number of ops (two cache writes, and per group two gathers and one SDPA call).

Decode group (requests with one new token), grouped-query layout::

    q    [Bd, H, D]  ->  [Bd, Hkv, G, D]      the G query heads of a KV head act as G query rows
    K, V gathered    ->  [Bd, Hkv, S, D]      S = the group's longest context, padded
    mask [Bd, 1, 1, S]                        key j < seq_len

Prefill group (requests with several new tokens), padded layout::

    q    [Tp, H, D]  ->  [Bp, Q, H, D]  ->  [Bp, H, Q, D]     Q = longest chunk, padded
    mask [Bp, 1, Q, S]                       key j < seq_len and j <= prefix_len + i

Splitting keeps one long prefill chunk from padding every decode request to its
length. Gathers write into reusable workspaces: fresh multi-MB buffers each layer
cost page faults that, on the CPU, took longer than the attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch


@dataclass
class _Group:
    """Index tensors of one group of requests (see the module docstring).

    Attributes:
        token_idx: [Tg] int64 rows of the step's T tokens in this group, or None when
            the group is the whole step in order.
        key_slots: [Bg * S] int64 flat cache slots of keys 0..S-1 of each request
            (padding repeats the request's last key, and is masked).
        mask: [Bg, 1, Q, S] bool, True where a query may read a key.
        query_dest: [Tg] int64 row of each token in the padded [Bg * Q] query layout
            (prefill group only).
        num_seqs, max_query_len, max_seq_len: Bg, Q, S.
    """

    token_idx: torch.Tensor | None
    key_slots: torch.Tensor
    mask: torch.Tensor
    query_dest: torch.Tensor | None
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    additive_mask: torch.Tensor | None = None  # the mask as 0 / -inf in q's dtype, made on first use

    def mask_for(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask in ``dtype`` (SDPA runs faster with it than with a bool mask)."""
        if self.additive_mask is None or self.additive_mask.dtype != dtype:
            zeros = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device)
            self.additive_mask = zeros.masked_fill_(~self.mask, float("-inf"))
        return self.additive_mask


@dataclass
class TorchAttentionMetadata:
    """What ``TorchAttentionBackend.prepare`` leaves in ``batch.attn_metadata``."""

    decode: _Group | None
    prefill: _Group | None


class TorchAttentionBackend:
    """``AttentionBackend`` built from torch indexing and ``scaled_dot_product_attention``.

    Holds gather workspaces that grow to the largest step seen (K and V of the
    longest padded batch); one instance serves one step at a time (not thread-safe).
    """

    name = "torch"

    def __init__(self) -> None:
        self._workspaces: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def prepare(self, batch: ForwardBatch) -> None:
        """Build the step's gather indices, query layout and masks (``TorchAttentionMetadata``)."""
        qlens = batch.query_lens_cpu
        decode = [b for b, q in enumerate(qlens) if q == 1]
        prefill = [b for b, q in enumerate(qlens) if q > 1]
        whole = len(decode) == 0 or len(prefill) == 0  # one group covers the step in order
        batch.attn_metadata = TorchAttentionMetadata(
            decode=_build_group(batch, decode, whole) if decode else None,
            prefill=_build_group(batch, prefill, whole) if prefill else None,
        )

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
        """See ``AttentionBackend.forward``: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

        Raises:
            RuntimeError: ``prepare`` was not called for this batch.
        """
        md = batch.attn_metadata
        if not isinstance(md, TorchAttentionMetadata):
            raise RuntimeError("TorchAttentionBackend.prepare(batch) must run before forward")
        hkv, d = k_cache.shape[2], k_cache.shape[3]
        flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
        flat_k.index_copy_(0, batch.slot_mapping, k)
        flat_v.index_copy_(0, batch.slot_mapping, v)
        if md.prefill is None:
            assert md.decode is not None  # prepare() makes at least one group
            return self._decode(q, flat_k, flat_v, md.decode, scale)
        if md.decode is None:
            return self._prefill(q, flat_k, flat_v, md.prefill, scale)
        assert md.decode.token_idx is not None and md.prefill.token_idx is not None  # set when both groups exist
        out = torch.empty_like(q)
        out.index_copy_(0, md.decode.token_idx, self._decode(q[md.decode.token_idx], flat_k, flat_v, md.decode, scale))
        out.index_copy_(0, md.prefill.token_idx,
                        self._prefill(q[md.prefill.token_idx], flat_k, flat_v, md.prefill, scale))
        return out

    def _decode(self, q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, g: _Group,
                scale: float) -> torch.Tensor:
        """q: [Bd, H, D] (one token per request) -> [Bd, H, D]."""
        bsz, h, d = q.shape
        hkv = flat_k.shape[1]
        keys, values = self._gather(flat_k, flat_v, g)
        out = F.scaled_dot_product_attention(q.reshape(bsz, hkv, h // hkv, d), keys, values,
                                             attn_mask=g.mask_for(q.dtype), scale=scale)
        return out.reshape(bsz, h, d)

    def _prefill(self, q: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor, g: _Group,
                 scale: float) -> torch.Tensor:
        """q: [Tp, H, D] (several tokens per request) -> [Tp, H, D]."""
        h, d = q.shape[1], q.shape[2]
        assert g.query_dest is not None  # a prefill group always has one
        padded = q.new_zeros(g.num_seqs * g.max_query_len, h, d).index_copy_(0, g.query_dest, q)
        keys, values = self._gather(flat_k, flat_v, g)
        out = F.scaled_dot_product_attention(
            padded.view(g.num_seqs, g.max_query_len, h, d).transpose(1, 2), keys, values,
            attn_mask=g.mask_for(q.dtype), scale=scale, enable_gqa=True,
        )
        return out.transpose(1, 2).reshape(-1, h, d).index_select(0, g.query_dest)

    def _gather(self, flat_k: torch.Tensor, flat_v: torch.Tensor, g: _Group) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values 0..S-1 of each request of the group, each [Bg, Hkv, S, D] (strided views)."""
        hkv, d = flat_k.shape[1], flat_k.shape[2]
        shape = (g.num_seqs, g.max_seq_len, hkv, d)
        keys = torch.index_select(flat_k, 0, g.key_slots, out=self._workspace("k", shape, flat_k))
        values = torch.index_select(flat_v, 0, g.key_slots, out=self._workspace("v", shape, flat_v))
        return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)

    def _workspace(self, name: str, shape: tuple[int, int, int, int], like: torch.Tensor) -> torch.Tensor:
        """A reusable [Bg * S, Hkv, D] buffer, grown (never shrunk) to the largest request."""
        key = (name, like.dtype, like.device)
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        buf = self._workspaces.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._workspaces[key] = buf
        return buf[:numel].view(shape[0] * shape[1], shape[2], shape[3])


def _build_group(batch: ForwardBatch, reqs: list[int], whole: bool) -> _Group:
    """Index tensors for the requests ``reqs`` (indices into the batch) of one group."""
    dev = batch.input_ids.device
    qlens, seq_lens = batch.query_lens_cpu, batch.seq_lens_cpu
    max_q = max(qlens[b] for b in reqs)
    max_s = max(seq_lens[b] for b in reqs)
    req_idx = torch.tensor(reqs, dtype=torch.int64, device=dev)
    pos = torch.arange(max_s, dtype=torch.int64, device=dev)
    tables = batch.block_tables.index_select(0, req_idx).long()
    seq = batch.seq_lens.index_select(0, req_idx).long().view(-1, 1, 1)
    # Padding keys (past a request's seq_len) re-read its last key: masked, and never
    # memory of another request, whose contents (even an fp16 inf) must not leak in.
    key_pos = torch.minimum(pos.view(1, -1), seq.view(-1, 1) - 1)
    blocks = tables.gather(1, key_pos // batch.block_size)
    key_slots = (blocks * batch.block_size + key_pos % batch.block_size).reshape(-1)
    prefix = batch.prefix_lens.index_select(0, req_idx).long().view(-1, 1, 1)
    query_pos = torch.arange(max_q, dtype=torch.int64, device=dev).view(1, -1, 1)
    # Query i of a request sits at position prefix + i: it reads keys up to there (causal).
    mask = (pos.view(1, 1, -1) < seq) & (pos.view(1, 1, -1) <= prefix + query_pos)
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    token_idx = None if whole else torch.tensor(
        [t for b in reqs for t in range(starts[b], starts[b + 1])], dtype=torch.int64, device=dev)
    query_dest = None if max_q == 1 else torch.tensor(
        [g * max_q + i for g, b in enumerate(reqs) for i in range(qlens[b])], dtype=torch.int64, device=dev)
    return _Group(token_idx, key_slots, mask.unsqueeze(1), query_dest, len(reqs), max_q, max_s)
