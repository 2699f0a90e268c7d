"""Runs one scheduled step on the device: build the batch, forward, sample.

The step's index tensors (positions, slot mapping, block tables, lengths) are
built once here and shared by every layer through ``ForwardBatch``.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig, ModelConfig
from engine.cpu.ops import CpuKernels
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.models.llama import LayerRunner
from engine.outputs import TokenLogprob
from engine.sampler import LOGPROB_FLOOR, PenaltyState, Sampler, SamplerOutput, noise_key
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, ScheduledItem
from engine.structured.compiler import Constraint
from engine.structured.masks import MaskFiller, TokenMasks

log = logging.getLogger(__name__)


def make_attention_backend(name: str, device: torch.device, cpu_kernels: CpuKernels | None = None) -> AttentionBackend:
    """"auto" gives Triton on CUDA, the CPU kernels' backend on the CPU when ``cpu_kernels``
    is given, and torch elsewhere; "torch"/"triton"/"cpu" force one.

    Raises:
        ModelLoadError: Triton requested but not importable, or "cpu" without kernels.
    """
    from engine.errors import ModelLoadError

    if name == "auto":
        name = "triton" if device.type == "cuda" else ("cpu" if cpu_kernels is not None else "torch")
    if name == "triton":
        try:
            from engine.attention.triton_backend import TritonAttentionBackend
        except ImportError as e:  # triton missing
            raise ModelLoadError(f"attention backend 'triton' is unavailable: {e}") from None
        return TritonAttentionBackend()
    if name == "cpu":
        if cpu_kernels is None:
            raise ModelLoadError("attention backend 'cpu' needs the CPU kernels (float32 activations over "
                                 "quantized weights on the CPU, and a C compiler)")
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(cpu_kernels)
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def make_layer_runner(model: torch.nn.Module, kv: KVCache, attn: AttentionBackend,
                      cpu_kernels: CpuKernels | None) -> LayerRunner | None:
    """How the model's decoder layers run: None (the model's own loop, one op at a
    time), or, on the CPU kernels with their attention backend and every projection
    packed (``engine.cpu.fused.can_fuse``), one kernel call per layer (``FusedLayers``).
    Both compute the same logits bit for bit."""
    if cpu_kernels is None or attn.name != "cpu":
        return None
    from engine.cpu.fused import FusedLayers, can_fuse
    from engine.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or not can_fuse(model):
        return None
    return FusedLayers(model, kv, cpu_kernels)


class ModelRunner:
    """Owns the model, its KV cache, the attention backend and the sampler.

    Args:
        model: our Llama-family module (``engine.models``), already on ``device``.
        model_config: its shapes.
        kv: the paged KV cache.
        engine_config: block size, attention backend choice, CUDA graphs.
        device: where the model lives.
        cpu_kernels: the CPU kernels the model runs on (its attention backend then uses
            them too under "auto"), or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv: KVCache,
        engine_config: EngineConfig,
        device: torch.device,
        cpu_kernels: CpuKernels | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.kv = kv
        self.block_size = engine_config.block_size
        self.device = device
        self.attn = make_attention_backend(engine_config.attention_backend, device, cpu_kernels)
        self.layers = make_layer_runner(model, kv, self.attn, cpu_kernels)
        self.sampler = Sampler(model_config.vocab_size, device, seed=engine_config.seed)
        self._masks: MaskFiller | None = None  # made at the first constrained step
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="masks")
        self.graphs = None
        if device.type == "cuda" and engine_config.cuda_graphs and self.attn.name == "triton":
            try:
                from engine.cuda_graph import CudaGraphDecodeRunner

                self.graphs = CudaGraphDecodeRunner(
                    model, kv, self.attn, max_batch_size=engine_config.max_num_seqs,
                    max_model_len=engine_config.max_model_len or model_config.max_model_len,
                    block_size=self.block_size, device=device,
                )
                self.graphs.capture_all()  # capture at start-up, not on the first requests
            except Exception as e:  # graphs are an optimisation: run eagerly without them
                log.warning("CUDA graphs disabled: %s", e)
                self.graphs = None

    @staticmethod
    def prompt_rows(item: ScheduledItem) -> int:
        """Leading rows of ``item``'s chunk whose logits score prompt tokens (its request
        wants its prompt's logprobs): positions up to the one before the last prompt
        token, each predicting the prompt token after it; 0 for other items."""
        r = item.request
        if not r.wants_prompt_logprobs:
            return 0
        return max(0, min(item.num_new, len(r.prompt_ids) - 1 - r.num_computed_tokens))

    def build_batch(self, sched: ScheduledBatch) -> ForwardBatch:
        """The step's ForwardBatch: each request's next ``num_new`` tokens after its
        ``num_computed_tokens``; logits for requests that sample this step, and for the
        prompt rows of requests that want their prompt's logprobs (``prompt_rows``)."""
        chunks, prefix, tables, sample, num_logits = [], [], [], [], []
        for item in sched.items:
            r = item.request
            known = item.num_new - len(item.spec)
            chunks.append(r.token_at(r.num_computed_tokens, r.num_computed_tokens + known) + item.spec)
            prefix.append(r.num_computed_tokens)
            tables.append(r.block_table)
            sample.append(item.sample)
            num_logits.append(self.prompt_rows(item) + item.num_samples)
        return ForwardBatch.build(
            token_chunks=chunks, prefix_lens=prefix, block_tables=tables,
            sample_mask=sample, block_size=self.block_size, device=self.device, num_logits=num_logits,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [S, vocab] float32 for the batch's ``logits_indices`` rows."""
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.run(batch)
        self.attn.prepare(batch)
        return self.model(batch, self.kv, self.attn, self.layers)

    @torch.inference_mode()
    def execute(self, sched: ScheduledBatch) -> SamplerOutput | None:
        """Run one step; returns the sampled tokens of the items with ``sample`` set, in
        their order, ``item.num_samples`` each (the token after the last known one, then
        after each draft), or None when no item samples (all mid-prefill chunks).

        A seeded request's position i (its i-th output token) is drawn with the noise key
        ``noise_key(seed, i)``, and a penalised one counts the drafts before each
        position, so every position gets the token one-by-one sampling would give it. A
        constrained request's position j is masked by its grammar after its first j
        drafts (``engine.structured.masks``), computed on a worker thread while the
        forward runs.
        """
        batch = self.build_batch(sched)
        params: list[SamplingParams] = []
        keys: list[int | None] = []
        counts: list[PenaltyState | None] = []
        extra: list[list[int]] = []
        constrained: list[tuple[Constraint, int, list[int]]] = []
        for item in sched.items:
            r = item.request
            if r.constraint is not None and item.num_samples:
                constrained.append((r.constraint, len(params), item.spec))
            for j in range(item.num_samples):
                params.append(r.params)
                # a continued reply's own tokens count: position i of the reply written at once
                pos = r.prior_output + len(r.output_ids) + j
                keys.append(None if r.params.seed is None else noise_key(r.params.seed, pos))
                counts.append(r.token_counts)
                extra.append(item.spec[:j])
        # the masks are computed on another thread while the forward runs: the matchers are
        # not touched by the forward, and llguidance releases the GIL (on 2 CPU cores this
        # hid most of the masks' time: docs/benchmarks.md, "Constrained decoding")
        pending = self._mask_pool.submit(self._step_masks, constrained) if constrained else None
        logits = self._take_prompt_logprobs(sched, self.forward(batch))
        masks = pending.result() if pending is not None else None
        if not params:
            return None
        return self.sampler.sample(logits, params, keys, counts, extra, masks)

    def _take_prompt_logprobs(self, sched: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        """Give the requests that want their prompt's logprobs those of this step's prompt
        rows (``Request.prompt_logprobs``); returns the logits of the sampled rows only."""
        rows = [self.prompt_rows(item) for item in sched.items]
        if not any(rows):
            return logits
        keep: list[int] = []
        at = 0
        for item, n in zip(sched.items, rows):
            if n:
                r = item.request
                k = min(r.params.prompt_logprobs or 0, self.model_config.vocab_size)
                lp = torch.log_softmax(logits[at:at + n, : self.model_config.vocab_size].float(), dim=-1)
                lp = lp.clamp(min=LOGPROB_FLOOR)
                start = r.num_computed_tokens + 1  # row j scores prompt token start + j
                targets = torch.tensor(r.prompt_ids[start:start + n], device=lp.device)
                chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
                top = torch.topk(lp, k, dim=1) if k else None
                values = top.values.tolist() if top is not None else [[]] * n
                ids = top.indices.tolist() if top is not None else [[]] * n
                for j in range(n):
                    r.prompt_logprobs.append(TokenLogprob(int(targets[j]), chosen[j], list(zip(ids[j], values[j]))))
            keep.extend(range(at + n, at + n + item.num_samples))
            at += n + item.num_samples
        return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]

    def _step_masks(self, constrained: list[tuple[Constraint, int, list[int]]]) -> TokenMasks | None:
        """The grammar masks of the step's constrained rows (None when there are none)."""
        if not constrained:
            return None
        if self._masks is None:
            self._masks = MaskFiller(torch.get_num_threads())
        return self._masks.fill(constrained)
