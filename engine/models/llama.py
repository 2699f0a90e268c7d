"""A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2) over the paged KV cache.

Source: Touvron et al., "LLaMA" (2023) and the Hugging Face ``LlamaForCausalLM``
port, whose tensor names and numerics (float32 RMSNorm, rotate-half RoPE) this
module follows; written in the gpt-fast style, one equation per line.

Per layer, for the step's flat token batch ``x`` of shape [T, hidden]::

    h   = x + W_o · Attn(RoPE(W_q·n), RoPE(W_k·n), W_v·n)     n = RMSNorm(x)
    out = h + W_down · (SiLU(W_gate·m) * (W_up·m))            m = RMSNorm(h)

Q, K and V come from one fused matmul (``qkv_weight`` rows: Q heads, then K heads,
then V heads); gate and up from another (``gate_up_weight`` rows: gate, then up).
As in vLLM, a layer hands on its sublayer output and the residual stream separately,
so that each residual add is fused into the next RMSNorm. The norms, rotary and
gating run through ``self.ops`` (``engine.models.ops``: torch, or the CPU kernels);
a step runs a fixed number of ops per layer whatever the batch size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig
from engine.cpu.ops import CpuKernels
from engine.errors import ModelLoadError
from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCache
from engine.models.ops import KernelOps, LayerOps, RopeInputs, TorchOps
from engine.models.quant import GROUP, QUANTIZATIONS, Int4Weight, Int8Weight, QuantWeight, embedding, linear
from engine.models.rope import rotary_table

# Checkpoint entries that hold no weights of ours (old Llama exports store the RoPE
# frequencies); they are skipped, not reported as unexpected.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised, frozen parameter: every one is filled by ``load_weights``."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, 2019), accumulated in float32,
    with the residual add in front of it fused in (``LayerOps.add_rms_norm``)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param((size,), dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ops: LayerOps) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, size] in the model dtype -> (normed [T, size], residual + x)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class LayerRunner(Protocol):
    """Runs all decoder layers of a step in place of the model's own loop (the model
    runner picks one, as it picks the attention backend: ``engine.cpu.fused`` on the CPU
    kernels). It computes what ``DecoderLayer`` computes, layer after layer."""

    def forward(self, batch: ForwardBatch, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers over the step's embeddings ``x`` [T, hidden]: returns (the last
        layer's MLP output, the residual stream before it), both [T, hidden]."""
        ...


@dataclass
class StepContext:
    """What every layer of one forward step shares.

    Attributes:
        batch: the step's ``ForwardBatch``.
        attn: the attention backend (already prepared for the batch).
        ops: the small-op implementation (``engine.models.ops``).
        rope: ``ops.rope_inputs`` for the batch's positions.
    """

    batch: ForwardBatch
    attn: AttentionBackend
    ops: LayerOps
    rope: RopeInputs


class Attention(nn.Module):
    """Grouped-query self-attention with a fused QKV projection (bias for Qwen2)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_weight = _param((qkv_rows, cfg.hidden_size), dtype, device)
        self.qkv_bias = _param((qkv_rows,), dtype, device) if cfg.attention_bias else None
        self.o_weight = _param((cfg.hidden_size, cfg.num_heads * cfg.head_dim), dtype, device)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Attention of the step's tokens over their cached context.

        Args:
            x: [T, hidden] normalised input, model dtype.
            k_cache, v_cache: this layer's [num_blocks, block_size, Hkv, head_dim] caches,
                written at ``step.batch.slot_mapping``.
            step: the step's batch, backend, ops and rotary inputs.

        Returns:
            [T, hidden] in the model dtype.
        """
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = step.ops.rope_qkv(qkv, h, self.num_kv_heads, d, step.rope)
        out = step.attn.forward(q, k, v, k_cache, v_cache, step.batch, self.scale)
        return linear(out.reshape(t, h * d), self.o_weight)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer, 2020): ``down(SiLU(gate(x)) * up(x))``, gate and up fused."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_up_weight = _param((2 * cfg.intermediate_size, cfg.hidden_size), dtype, device)
        self.down_weight = _param((cfg.hidden_size, cfg.intermediate_size), dtype, device)

    def forward(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return linear(ops.silu_mul(linear(x, self.gate_up_weight)), self.down_weight)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.attn = Attention(cfg, dtype, device)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, step: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output [T, hidden] (the embeddings for the first
        layer, with ``residual`` None); returns (this layer's MLP output, the residual
        stream before it), both [T, hidden]."""
        n, residual = self.attn_norm(x, residual, step.ops)
        x = self.attn(n, k_cache, v_cache, step)
        n, residual = self.mlp_norm(x, residual, step.ops)
        return self.mlp(n, step.ops), residual


class LlamaForCausalLM(nn.Module):
    """The whole decoder: embedding, ``num_layers`` blocks, final norm, LM head.

    Parameters are created uninitialised in ``dtype`` on ``device``; call
    ``load_weights`` before ``forward``. Also serves Qwen2 (``attention_bias``) and
    Mistral (no sliding window: exact only up to the window, which the loader
    enforces through ``max_model_len``).
    """

    rope: torch.Tensor  # buffer [max_model_len, 2, head_dim / 2]: cos, sin
    embed: torch.Tensor | Int8Weight
    lm_head: torch.Tensor | Int8Weight

    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        cfg, device = model_config, torch.device(device)
        if cfg.num_heads % cfg.num_kv_heads:
            raise ModelLoadError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
        self.config, self.dtype, self.device = cfg, dtype, device
        self.embed = _param((cfg.vocab_size, cfg.hidden_size), dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        # Tied models share one tensor: the LM head is the embedding matrix.
        self.lm_head = (self.embed if cfg.tie_word_embeddings
                        else _param((cfg.vocab_size, cfg.hidden_size), dtype, device))
        table = rotary_table(cfg.max_model_len, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dtype, device)
        self.register_buffer("rope", table, persistent=False)
        self.ops: LayerOps = TorchOps()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCache, attn: AttentionBackend,
                layers: LayerRunner | None = None) -> torch.Tensor:
        """Run one step and write its K/V into ``kv``.

        Args:
            batch: the step's flat token batch (``attn.prepare(batch)`` is called here
                if the runner has not done it yet).
            kv: the paged cache, one K and one V tensor per layer.
            attn: the attention backend.
            layers: None (the model's own layer loop), or a ``LayerRunner`` built over
                this model and ``kv`` that runs the same layers another way.

        Returns:
            [len(batch.logits_indices), vocab_size] float32 logits of the rows named by
            ``batch.logits_indices`` (the LM head runs on those rows only).

        Positions must be below ``model_config.max_model_len`` (the rotary table's
        length); the scheduler guarantees it.
        """
        if batch.attn_metadata is None:
            attn.prepare(batch)
        x, residual = embedding(batch.input_ids, self.embed), None
        if layers is not None:
            x, residual = layers.forward(batch, x)
        else:
            step = StepContext(batch, attn, self.ops, self.ops.rope_inputs(self.rope, batch.positions))
            for layer, k_cache, v_cache in zip(self.layers, kv.k_caches, kv.v_caches):
                x, residual = layer(x, residual, k_cache, v_cache, step)
        assert residual is not None  # a model has at least one layer
        rows = batch.logits_indices  # RMSNorm and the residual add are per row
        x, _ = self.norm(x.index_select(0, rows), residual.index_select(0, rows), self.ops)
        return linear(x, self.lm_head).float()

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        """Run the norms, rotary, gating and quantized projections on the engine's CPU
        kernels (``KernelOps``), or on torch again with None. The model must be on the CPU
        in float32. (Running each whole layer as one kernel call is the model runner's
        choice of ``LayerRunner``: ``engine.model_runner.make_layer_runner``.)"""
        self.ops = TorchOps() if kernels is None else KernelOps(kernels)
        for m in self.modules():
            if isinstance(m, (Int8Weight, Int4Weight)):
                m.use_kernels(kernels)

    @torch.no_grad()
    def quantize_(self, method: str) -> None:
        """Replace every projection weight (QKV, O, gate/up, down, embedding and LM
        head) by its quantized form (``engine.models.quant``), in place, after
        ``load_weights``. Norms, biases and the rotary table stay in the model dtype;
        a tied LM head stays the same object as the embedding.

        "int8": ``Int8Weight`` everywhere. "int4" / "int4-sym": the decoder layers'
        projections as ``Int4Weight`` (with offsets / symmetric) where K is a multiple of
        32 (else int8); the embedding and LM head stay int8 (one table serves both when
        tied, and the logits are the most sensitive product, as in llama.cpp's formats,
        which keep the output matrix at 6 or 8 bits).

        Raises:
            ValueError: an unknown ``method`` (``QUANTIZATIONS``).
        """
        if method not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {method!r}; expected one of {list(QUANTIZATIONS)}")

        def swap(owner: nn.Module, name: str, four_bit: bool) -> QuantWeight:
            w = getattr(owner, name)
            q: QuantWeight
            if four_bit and w.shape[1] % GROUP == 0:
                q = Int4Weight.from_float(w, offsets=method == "int4")
            else:
                q = Int8Weight.from_float(w, self.dtype)
            delattr(owner, name)  # a Parameter slot cannot take a Module
            setattr(owner, name, q)
            return q

        four_bit = method != "int8"
        for layer in self.decoder_layers():
            for owner, name in ((layer.attn, "qkv_weight"), (layer.attn, "o_weight"),
                                (layer.mlp, "gate_up_weight"), (layer.mlp, "down_weight")):
                swap(owner, name, four_bit)
        tied = self.lm_head is self.embed
        embed = swap(self, "embed", False)
        if tied:
            delattr(self, "lm_head")
            assert isinstance(embed, Int8Weight)  # the tables stay int8
            self.lm_head = embed
        else:
            swap(self, "lm_head", False)

    def decoder_layers(self) -> list[DecoderLayer]:
        """``self.layers`` with their type (an ``nn.ModuleList`` yields plain Modules)."""
        return cast(list[DecoderLayer], list(self.layers))

    def _weight_slots(self) -> dict[str, tuple[torch.Tensor, slice]]:
        """HF tensor name -> (our parameter, the rows of it that tensor fills)."""
        assert isinstance(self.embed, torch.Tensor) and isinstance(self.lm_head, torch.Tensor), "before quantize_"
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter, every = cfg.intermediate_size, slice(None)
        slots: dict[str, tuple[torch.Tensor, slice]] = {
            "model.embed_tokens.weight": (self.embed, every),
            "model.norm.weight": (self.norm.weight, every),
        }
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = (self.lm_head, every)
        for i, layer in enumerate(self.decoder_layers()):
            p = f"model.layers.{i}."
            a, m = layer.attn, layer.mlp
            thirds = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
            for name, rows in thirds.items():
                slots[f"{p}self_attn.{name}_proj.weight"] = (a.qkv_weight, rows)
                if a.qkv_bias is not None:
                    slots[f"{p}self_attn.{name}_proj.bias"] = (a.qkv_bias, rows)
            slots[f"{p}self_attn.o_proj.weight"] = (a.o_weight, every)
            slots[f"{p}mlp.gate_proj.weight"] = (m.gate_up_weight, slice(0, inter))
            slots[f"{p}mlp.up_proj.weight"] = (m.gate_up_weight, slice(inter, 2 * inter))
            slots[f"{p}mlp.down_proj.weight"] = (m.down_weight, every)
            slots[f"{p}input_layernorm.weight"] = (layer.attn_norm.weight, every)
            slots[f"{p}post_attention_layernorm.weight"] = (layer.mlp_norm.weight, every)
        return slots

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters, converting
        dtype and device on the way; tensors arrive one at a time (streaming).

        ``lm_head.weight`` is optional, and ignored, when the embeddings are tied.

        Raises:
            ModelLoadError: a tensor of the wrong shape, tensors the model does not
                have (unexpected), or parameters no tensor filled (missing); each names them.
        """
        slots = self._weight_slots()
        missing, unexpected = set(slots), []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            if name not in slots:
                unexpected.append(name)
                continue
            param, rows = slots[name]
            target = param[rows]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            missing.discard(name)
        if unexpected:
            raise ModelLoadError(f"unexpected weight tensors: {_names(unexpected)}")
        if missing:
            raise ModelLoadError(f"missing weight tensors: {_names(missing)}")


def _names(names: Iterable[str], limit: int = 8) -> str:
    """Up to ``limit`` sorted names, and how many more there are."""
    ordered = sorted(names)
    more = f" (and {len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more
