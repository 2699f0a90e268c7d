"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

A decode step launches a few hundred small kernels (per layer: norms, matmuls,
rotary, KV store, two attention kernels); at small batch the GPU waits on the
CPU to launch them. Capturing the step once per batch size and replaying it
costs one launch instead (the idea of vLLM's and SGLang's CUDA-graph runners;
this one is written from PyTorch's ``torch.cuda.CUDAGraph`` documentation).

Static inputs: a graph replays fixed device addresses, so every step copies its
batch into buffers allocated once for the largest bucket, and bucket ``n`` views
their first ``n`` rows::

    input_ids, positions       [N] int64    padded rows: 0
    slot_mapping               [N] int64    padded rows: -1 (the KV store skips them)
    seq_lens, prefix_lens      [N] int32    padded rows: 0 (attention writes a zero row)
    query_start_loc            [N + 1]      0, 1, ..., N (one token per request)
    block_tables               [N, max_blocks] int32, max_blocks = ceil(max_model_len / block_size);
                                            only each live row's first ceil(seq_len / block_size)
                                            entries are read, the rest is left as it was
    logits_indices             [N] int64    0, 1, ..., N - 1
    logits (graph output)      [n, vocab]   float32, per bucket

The captured forward is ``model.forward(batch, kv, attn)`` over a ``ForwardBatch``
made of those views, with ``max_seq_len = max_model_len`` so the attention
backend sizes its grid for any length (``TritonAttentionBackend`` is capture-safe;
the torch backend is not: its shapes follow the lengths).

What the model runner calls:

1. ``CudaGraphDecodeRunner(model, kv, attn, max_batch_size=, max_model_len=,
   block_size=, device=)`` after the weights and the KV cache exist.
2. Optionally ``capture_all()`` at start-up (seconds); otherwise each bucket is
   captured the first time ``run`` needs it.
3. Each step: ``if runner.can_run(batch): logits = runner.run(batch)``; else the
   eager path (``attn.prepare(batch); model.forward(batch, kv, attn)``). ``run``
   neither needs nor calls ``attn.prepare`` on the step's batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """Batch-size buckets: 1, 2, 4, 8, ... (powers of two below ``max_batch_size``),
    then ``max_batch_size`` itself, so every size up to it has a bucket.

    Raises:
        ValueError: ``max_batch_size < 1``.
    """
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be >= 1")
    sizes = []
    n = 1
    while n < max_batch_size:
        sizes.append(n)
        n *= 2
    sizes.append(max_batch_size)
    return sizes


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket of ``sizes`` (ascending) holding ``num_seqs`` requests, or
    None when ``num_seqs`` is 0 or above the largest."""
    if num_seqs < 1:
        return None
    for s in sizes:
        if s >= num_seqs:
            return s
    return None


@dataclass
class StaticDecodeInputs:
    """The graph's input buffers for ``N`` rows (the largest bucket); see the module docstring.

    Attributes:
        input_ids, positions, slot_mapping: [N] int64.
        seq_lens, prefix_lens: [N] int32.
        query_start_loc: [N + 1] int32, constant 0..N.
        block_tables: [N, max_blocks] int32.
        logits_indices: [N] int64, constant 0..N-1.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor

    @classmethod
    def allocate(cls, max_batch_size: int, max_blocks: int, device: torch.device | str) -> StaticDecodeInputs:
        """Buffers for ``max_batch_size`` rows of ``max_blocks`` blocks, all rows padding."""
        n, dev = max_batch_size, torch.device(device)
        inputs = cls(
            input_ids=torch.zeros(n, dtype=torch.int64, device=dev),
            positions=torch.zeros(n, dtype=torch.int64, device=dev),
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            seq_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            prefix_lens=torch.zeros(n, dtype=torch.int32, device=dev),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            block_tables=torch.zeros((n, max_blocks), dtype=torch.int32, device=dev),
            logits_indices=torch.arange(n, dtype=torch.int64, device=dev),
        )
        return inputs

    @property
    def max_batch_size(self) -> int:
        """N, the rows held."""
        return int(self.input_ids.shape[0])

    def pad_rows(self, start: int, stop: int) -> None:
        """Make rows ``start .. stop-1`` padding: no KV write, zero-length context."""
        self.input_ids[start:stop].zero_()
        self.positions[start:stop].zero_()
        self.slot_mapping[start:stop].fill_(-1)
        self.seq_lens[start:stop].zero_()
        self.prefix_lens[start:stop].zero_()

    def load(self, batch: ForwardBatch, bucket: int) -> None:
        """Copy a decode batch of B <= bucket requests into rows 0..B-1 and pad rows
        B..bucket-1. Device-side copies only (no host sync).

        Raises:
            ValueError: not a decode batch, more requests than ``bucket``, a bucket
                above N, or a block table wider than ``max_blocks``.
        """
        b = batch.num_seqs
        width = batch.block_tables.shape[1]
        if not batch.is_decode or b > bucket or bucket > self.max_batch_size or width > self.block_tables.shape[1]:
            raise ValueError(
                f"cannot load a batch of {b} requests (decode={batch.is_decode}, {width} blocks) into "
                f"bucket {bucket} of {self.max_batch_size} x {self.block_tables.shape[1]} blocks"
            )
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.slot_mapping[:b].copy_(batch.slot_mapping)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.prefix_lens[:b].copy_(batch.prefix_lens)
        self.block_tables[:b, :width].copy_(batch.block_tables)
        if b < bucket:
            self.pad_rows(b, bucket)

    def batch_view(self, bucket: int, block_size: int, max_seq_len: int) -> ForwardBatch:
        """A ``ForwardBatch`` over the first ``bucket`` rows, for capture. Its host-side
        lengths are bounds (every request ``max_seq_len`` long), not the real ones: a
        forward that shapes work by them sizes it for any step of the bucket."""
        n = bucket
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            prefix_lens=self.prefix_lens[:n],
            block_tables=self.block_tables[:n],
            logits_indices=self.logits_indices[:n],
            query_lens_cpu=[1] * n,
            seq_lens_cpu=[max_seq_len] * n,
            prefix_lens_cpu=[max_seq_len - 1] * n,
            max_query_len=1,
            max_seq_len=max_seq_len,
            block_size=block_size,
            is_decode=True,
        )


@dataclass
class _Captured:
    """One bucket: its static batch, its graph (None when replaying eagerly) and output."""

    batch: ForwardBatch
    graph: Any  # torch.cuda.CUDAGraph | None
    logits: torch.Tensor | None


class CudaGraphDecodeRunner:
    """Captures and replays decode steps per batch-size bucket (see the module docstring).

    Args:
        model: the model; ``model.forward(batch, kv, attn)`` returns [len(logits_indices), vocab]
            float32 logits and must be capture-safe for decode batches.
        kv: the KV cache handed to the model (``engine.kv_cache.KVCache``).
        attn: an attention backend with ``supports_cuda_graphs`` (the Triton one).
        max_batch_size: the largest bucket (requests), usually ``max_num_seqs``.
        max_model_len: the longest context served (tokens); sizes the block tables
            and the attention grid.
        block_size: tokens per KV block.
        device: the model's device.
        use_graphs: capture CUDA graphs (default: when ``device`` is CUDA). False runs
            the same static-buffer path eagerly, which is how CPU tests check it.

    Raises:
        ValueError: a backend that is not capture-safe, graphs on a non-CUDA device,
            or sizes < 1.
    """

    def __init__(
        self,
        model: Any,
        kv: Any,
        attn: Any,
        *,
        max_batch_size: int,
        max_model_len: int,
        block_size: int,
        device: torch.device | str,
        use_graphs: bool | None = None,
    ) -> None:
        device = torch.device(device)
        if not getattr(attn, "supports_cuda_graphs", False):
            raise ValueError(f"attention backend {getattr(attn, 'name', attn)!r} cannot be captured in a CUDA graph")
        if use_graphs is None:
            use_graphs = device.type == "cuda"
        if use_graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if max_model_len < 1 or block_size < 1:
            raise ValueError("max_model_len and block_size must be >= 1")
        self.model, self.kv, self.attn = model, kv, attn
        self.device, self.use_graphs = device, use_graphs
        self.block_size, self.max_model_len = block_size, max_model_len
        self.sizes = capture_sizes(max_batch_size)
        self.max_blocks = -(-max_model_len // block_size)
        self.static = StaticDecodeInputs.allocate(self.sizes[-1], self.max_blocks, device)
        self._captured: dict[int, _Captured] = {}
        self._pool: Any = None
        self._disabled = False

    @property
    def captured_sizes(self) -> list[int]:
        """Buckets captured so far, ascending."""
        return sorted(self._captured)

    def can_run(self, batch: ForwardBatch) -> bool:
        """True when ``run`` can take this batch: a decode step of 1..max_batch_size
        requests, all sampled, within max_model_len. Host-side checks only."""
        return (
            not self._disabled
            and batch.is_decode
            and bucket_for(batch.num_seqs, self.sizes) is not None
            and batch.max_seq_len <= self.max_model_len
            and batch.block_tables.shape[1] <= self.max_blocks
            and batch.logits_indices.shape[0] == batch.num_seqs
        )

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (so smaller ones reuse its memory)."""
        for size in reversed(self.sizes):
            if size not in self._captured:
                self._capture(size)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """One decode step through the bucket's graph (captured now if need be).

        Args:
            batch: a decode batch for which ``can_run`` is True.

        Returns:
            [B, vocab] float32 logits, row b for request b (a fresh tensor). If a
            capture fails, graphs are turned off (``can_run`` is False from then on)
            and this step runs eagerly.

        Raises:
            ValueError: a batch ``can_run`` rejects.
        """
        if not self.can_run(batch):
            raise ValueError("CudaGraphDecodeRunner.run got a batch can_run rejects")
        bucket = bucket_for(batch.num_seqs, self.sizes)
        assert bucket is not None
        if bucket not in self._captured:
            try:
                self._capture(bucket)
            except Exception as e:  # an optimisation only: carry on without graphs
                log.warning("CUDA graph capture of batch size %d failed, running eagerly: %s", bucket, e)
                self._disabled = True
                self.attn.prepare(batch)
                return self.model.forward(batch, self.kv, self.attn)
        cap = self._captured[bucket]
        self.static.load(batch, bucket)
        if cap.graph is not None:
            cap.graph.replay()
            logits = cap.logits
        else:
            logits = self.model.forward(cap.batch, self.kv, self.attn)
        assert logits is not None
        # A copy: the graph's output buffer is overwritten by the next replay.
        return logits[: batch.num_seqs].clone()

    def _capture(self, bucket: int) -> None:
        """Warm up and capture bucket ``bucket`` with every row padding (so neither the
        warm-up nor the capture writes the KV cache)."""
        self.static.pad_rows(0, self.static.max_batch_size)
        batch = self.static.batch_view(bucket, self.block_size, self.max_model_len)
        self.attn.prepare(batch)
        if not self.use_graphs:
            self._captured[bucket] = _Captured(batch=batch, graph=None, logits=None)
            return
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles the Triton kernels, picks cuBLAS algorithms
                self.model.forward(batch, self.kv, self.attn)
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.forward(batch, self.kv, self.attn)
        torch.cuda.synchronize(self.device)
        self._captured[bucket] = _Captured(batch=batch, graph=graph, logits=logits)
