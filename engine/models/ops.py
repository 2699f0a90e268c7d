"""The small per-layer ops of the decoder (norm, rotary, gating), in two implementations
with one interface: ``TorchOps`` (plain torch, any device: the reference, and what the
exact float32 mode runs) and ``KernelOps`` (the engine's CPU kernels, ``engine/cpu``:
one call per op, no intermediate tensors). The model picks one when it is built.

Both compute, per row of the step's flat token batch:

    residual' = residual + x            (x alone when residual is None)
    norm      = weight * residual' / sqrt(mean(residual'^2) + eps)
    q, k      = RoPE(q), RoPE(k)        (rotate-half layout)
    act       = SiLU(gate) * up

``KernelOps`` updates the residual stream in place and rotates Q and K in place inside
the fused QKV rows; ``TorchOps`` returns new tensors. Callers use the returned values
only, so both are interchangeable.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from engine.cpu.ops import CpuKernels
from engine.models.rope import apply_rotary

# Per-step rotary inputs: (cos, sin) rows for TorchOps, (table, positions) for KernelOps.
RopeInputs = tuple[torch.Tensor, torch.Tensor]


class LayerOps(Protocol):
    """What a decoder layer needs besides matmuls and attention."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then RMSNorm: x, residual [T, H] -> (normed [T, H], new residual [T, H])."""
        ...

    def rope_inputs(self, table: torch.Tensor, positions: torch.Tensor) -> RopeInputs:
        """Per-step rotary inputs from the model's table [max_len, 2, 1, D/2] and positions [T]."""
        ...

    def rope_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2 Hkv) * D] -> q [T, H, D], k [T, Hkv, D] (both rotated), v [T, Hkv, D]."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate then up) -> [T, I]."""
        ...


class TorchOps:
    """``LayerOps`` in torch; RMSNorm in float32 then cast back, as the HF Llama port does
    (Zhang & Sennrich 2019), so float32 logits match transformers."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.add_rms_norm``."""
        h = x if residual is None else residual + x
        h32 = h.float()
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h32.to(h.dtype), h

    def rope_inputs(self, table: torch.Tensor, positions: torch.Tensor) -> RopeInputs:
        """(cos, sin), each [T, 1, D/2]: gathered once per step, shared by every layer."""
        cos, sin = table[positions].unbind(1)
        return cos, sin

    def rope_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See ``LayerOps.rope_qkv``; Q and K heads are rotated together in one new tensor."""
        cos, sin = rope
        h, hkv = num_heads, num_kv_heads
        qkv = qkv.view(qkv.shape[0], h + 2 * hkv, head_dim)
        qk = apply_rotary(qkv[:, : h + hkv], cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, h + hkv:]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``LayerOps.silu_mul``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class KernelOps:
    """``LayerOps`` on the engine's CPU kernels (float32 activations, CPU tensors).

    Args:
        kernels: the loaded ``engine.cpu.ops.CpuKernels``.
    """

    def __init__(self, kernels: CpuKernels) -> None:
        self.k = kernels

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``LayerOps.add_rms_norm``; the residual stream is updated in place (the first
        layer adopts ``x`` itself as the stream)."""
        if residual is None:
            return self.k.add_rms_norm(x, None, weight, eps), x
        return self.k.add_rms_norm(residual, x, weight, eps), residual

    def rope_inputs(self, table: torch.Tensor, positions: torch.Tensor) -> RopeInputs:
        """The whole table and the positions: the kernel indexes the table itself."""
        return table, positions

    def rope_qkv(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RopeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """See ``LayerOps.rope_qkv``; rotates in place and returns views of ``qkv``."""
        table, positions = rope
        h, hkv = num_heads, num_kv_heads
        self.k.rope_(qkv, h + hkv, head_dim, table, positions)
        heads = qkv.view(qkv.shape[0], h + 2 * hkv, head_dim)
        return heads[:, :h], heads[:, h:h + hkv], heads[:, h + hkv:]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """See ``LayerOps.silu_mul``."""
        return self.k.silu_mul(gate_up)
