"""Paged attention through Triton kernels (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Per layer, ``forward`` makes two or three launches:

    store_kv                   new K/V rows -> their cache slots (padding slots < 0 skipped)
    decode-only step:          decode split kernel + reduce kernel   (flash-decoding)
    any other step:            extend kernel                         (decodes are 1-token extends)

``prepare`` runs once per step and decides everything the launches need from the
batch's host-side lengths (which kernel, the decode grid's split axis); the
decode workspace is one float32 buffer owned by the backend, grown on demand and
viewed per step, so CUDA-graph captures of several batch sizes share it.

The decode path is capture-safe: no host reads of device data, and a grid that
depends on ``batch.num_seqs`` and ``batch.max_seq_len`` only, which a
CUDA-graph runner fixes per captured batch size (``engine.cuda_graph``).
Kernels and their sources: ``engine/attention/triton_kernels/``; notes: docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.triton_kernels.decode import decode_attention, num_splits_for
from engine.attention.triton_kernels.extend import extend_attention
from engine.attention.triton_kernels.kv_write import store_kv
from engine.attention.triton_kernels.launch import decode_tiles
from engine.errors import InvalidRequestError
from engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class TritonBackendConfig:
    """Decode partition settings, validated on construction.

    Attributes:
        split_tokens: keys per decode split (tokens, rounded up to the kernel's key
            tile); smaller means more parallel programs for short contexts and more
            stage-2 work. 256 keeps an H200 busy from a few requests of 2k tokens up.
        max_splits: most splits of one request; longer contexts get longer splits.
            Sizes the decode workspace: 4 * B * num_heads * max_splits * (head_dim + 1) bytes.
    """

    split_tokens: int = 256
    max_splits: int = 64

    def __post_init__(self) -> None:
        if self.split_tokens < 1 or self.max_splits < 1:
            raise InvalidRequestError("split_tokens and max_splits must be >= 1")


@dataclass
class TritonAttentionMetadata:
    """What ``TritonAttentionBackend.prepare`` leaves in ``batch.attn_metadata``.

    Attributes:
        is_decode: every request has exactly one new token (decode kernel).
        num_seqs: B, requests in the step.
        max_seq_len: the longest context (tokens), or a bound of it; sizes the decode
            grid's split axis (``triton_kernels.decode.num_splits_for``).
        max_query_len: the longest new-token chunk (tokens), sizes the extend grid.
    """

    is_decode: bool
    num_seqs: int
    max_seq_len: int
    max_query_len: int


class TritonAttentionBackend:
    """``AttentionBackend`` on Triton kernels; see the module docstring.

    One instance serves one step at a time on one stream (the workspace is shared
    by every layer and every captured graph). Not thread-safe.
    """

    name = "triton"
    #: ``engine.cuda_graph`` may capture this backend's decode path.
    supports_cuda_graphs = True

    def __init__(self, config: TritonBackendConfig | None = None) -> None:
        self.config = config or TritonBackendConfig()
        self._workspace: torch.Tensor | None = None
        # Replaced workspaces stay alive: a captured CUDA graph may still point at one.
        self._retired: list[torch.Tensor] = []

    def prepare(self, batch: ForwardBatch) -> None:
        """Record which kernel this step uses and the sizes of its grid (``TritonAttentionMetadata``).

        Reads host-side fields only (``is_decode``, ``num_seqs``, ``max_seq_len``,
        ``max_query_len``): no device sync. A CUDA-graph runner hands a static batch
        whose ``max_seq_len`` is the capture bound, so the grid covers any length up to it.
        """
        batch.attn_metadata = TritonAttentionMetadata(
            is_decode=batch.is_decode,
            num_seqs=batch.num_seqs,
            max_seq_len=batch.max_seq_len,
            max_query_len=batch.max_query_len,
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
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See ``AttentionBackend.forward``: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D].

        Args:
            out: optional [T, H, D] output buffer in q's dtype (tests poison it to check
                that every element is written); a new one is allocated when None.

        Raises:
            RuntimeError: ``prepare`` was not called for this batch.
            EngineError: tensors on the CPU without the Triton interpreter, or an
                unsupported dtype.
        """
        md = batch.attn_metadata
        if not isinstance(md, TritonAttentionMetadata):
            raise RuntimeError("TritonAttentionBackend.prepare(batch) must run before forward")
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if md.is_decode:
            num_heads, head_dim = q.shape[1], q.shape[2]
            tiles = decode_tiles(head_dim, num_heads // k_cache.shape[2], q.dtype)
            splits = num_splits_for(md.max_seq_len, self.config.split_tokens, self.config.max_splits, tiles)
            mid_o, mid_lse = self._decode_workspace(md.num_seqs, num_heads, splits, head_dim, q.device)
            return decode_attention(
                q, k_cache, v_cache, batch.block_tables, batch.seq_lens, out, scale,
                num_splits=splits, split_tokens=self.config.split_tokens,
                max_splits=self.config.max_splits, mid_o=mid_o, mid_lse=mid_lse, tiles=tiles,
            )
        return extend_attention(
            q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.prefix_lens, out, scale,
            max_query_len=md.max_query_len,
        )

    def _decode_workspace(
        self, num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[B, H, S, D]`` and ``[B, H, S]`` float32 into the shared workspace,
        which grows (never shrinks) to the largest step seen. A grown buffer replaces
        the old one, which is kept (not freed): graphs captured on it still write there."""
        n_o = num_seqs * num_heads * num_splits * head_dim
        n_lse = num_seqs * num_heads * num_splits
        ws = self._workspace
        if ws is None or ws.numel() < n_o + n_lse or ws.device != device:
            if ws is not None:
                self._retired.append(ws)
            ws = torch.empty(n_o + n_lse, dtype=torch.float32, device=device)
            self._workspace = ws
        mid_o = ws[:n_o].view(num_seqs, num_heads, num_splits, head_dim)
        mid_lse = ws[n_o : n_o + n_lse].view(num_seqs, num_heads, num_splits)
        return mid_o, mid_lse

