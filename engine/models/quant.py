"""Weight-only quantization: int8 weights with one scale per output row, and 4-bit
weights in groups of 32 (``Int4Weight``, below).

Decode at small batch reads every weight once per step, so its time is the bytes of
weights over memory bandwidth; int8 weights read a quarter of float32's bytes and half
of bfloat16's. Activations, the KV cache and the norms stay in their own dtypes.

Scheme (symmetric, per output channel, as in gpt-fast's ``WeightOnlyInt8QuantHandler``
and LLM.int8()'s vector-wise weights; Dettmers et al., 2022)::

    scale[n] = max_k |W[n, k]| / 127              (float32, then the activation dtype)
    Q[n, k]  = round(W[n, k] / scale[n])          in [-127, 127], int8
    y        = (x @ Q^T) * scale                  (the product accumulated before scaling)

Kernels, by activation dtype and device:

* float32 activations on the CPU kernels (the CPU's default format, ``engine/formats.py``):
  ``CpuKernels.linear_i8_packed`` over a copy of ``Q`` packed in tiles of 8 rows, with x
  quantized to int16 in blocks of 32 values (``docs/cpu_kernels.md``); one kernel for
  every batch size, each row computed alone;
* bfloat16/float16 activations on the CPU, at most ``SMALL_BATCH_ROWS`` rows:
  ``torch.ops.aten._weight_int8pack_mm``, which streams the int8 weight once;
* otherwise: ``F.linear`` over ``Q`` in the activation dtype (exact: integers up to 256
  are representable in bfloat16 and float16), then the scale. With bfloat16 activations
  on the CPU that copy of ``Q`` is kept (``wide``): converting it every step cost about
  40 ms a step for SmolLM2, more than the matmul at batch 16. On CUDA only the int8 copy
  is kept and converted per step (the memory saving is the point).

All compute ``(x @ Q^T) * scale`` up to rounding, so a request decoded alone and one
decoded in a large batch agree except at near-ties (and exactly on the CPU kernels).
float16 activations are refused by ``EngineConfig``: the integer-valued matmul could
exceed float16's range before the scale brings it back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cpu.ops import CpuKernels

# Rows at or below which the CPU int8 kernel is used. bench/decode_step.py on SmolLM2, 2
# cores, ms per decode step, int8 kernel vs bfloat16 weights: batch 1 23.0 vs 33.5, 4:
# 32.4 vs 38.0, 8: 45-59 vs 45-48 (a tie within run-to-run noise), 12: 59.2 vs 52.0.
SMALL_BATCH_ROWS = 8
# "int4": 4-bit codes with a float16 scale and offset per group of 32 (as ggml's Q4_1);
# "int4-sym": a scale only (symmetric, as ggml's Q4_0). Both on the CPU kernels.
QUANTIZATIONS = ("int8", "int4", "int4-sym")
GROUP = 32  # weights per 4-bit group (one scale, and offset, each)


def quantize_int8(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantization of a [N, K] weight.

    The scale is rounded to ``scale_dtype`` before ``Q`` is computed, so ``Q`` is
    optimal for the scale actually used at inference.

    Args:
        weight: [N, K] float tensor (any float dtype).
        scale_dtype: the dtype the scale will be stored in.

    Returns:
        ``(q, scale)``: q [N, K] int8 (contiguous) and scale [N] in ``scale_dtype``, with
        ``q * scale[:, None]`` within ``scale / 2`` of ``weight`` elementwise (plus, for
        a row's largest weights, the scale's own rounding: under 2^-8 of that weight in
        bfloat16). All-zero rows get scale 1 (their q is 0).

    Raises:
        ValueError: ``weight`` is not 2-D.
    """
    if weight.dim() != 2:
        raise ValueError(f"int8 quantization needs a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


class Int8Weight(nn.Module):
    """A [N, K] weight held as int8 plus a [N] scale in the activation dtype.

    Used in place of a float weight by ``linear`` and ``embedding`` below; built from
    an already-loaded float weight by ``Int8Weight.from_float``.

    Attributes:
        qweight: [N, K] int8.
        scale: [N] in ``dtype`` (the model's activation dtype).
        wide: None, or [N, K] ``qweight`` in ``dtype`` (kept for large batches, see the
            module docstring).
        kernels: None, or the CPU kernels that serve float32 activations.
        packed: None, or ``qweight`` in the integer kernel's tile layout (``use_kernels``).
    """

    qweight: torch.Tensor  # buffers, declared for the type checker
    scale: torch.Tensor
    wide: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, keep_wide: bool = False) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("wide", qweight.to(scale.dtype) if keep_wide else None)
        # Set by ``use_kernels`` when float32 activations run on the CPU kernels.
        self.kernels: CpuKernels | None = None
        self.register_buffer("packed", None, persistent=False)  # counted in the model's weight bytes

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype, keep_wide: bool | None = None) -> Int8Weight:
        """Quantize ``weight`` [N, K] (``quantize_int8``); the scale is stored in ``dtype``.
        ``keep_wide`` None: keep the wide copy on the CPU for bfloat16/float16 activations
        only (float32 activations dequantize slices on the fly, see ``linear``)."""
        q, scale = quantize_int8(weight, dtype)
        if keep_wide is None:
            keep_wide = weight.device.type == "cpu" and dtype != torch.float32
        return cls(q.to(weight.device), scale.to(weight.device), keep_wide)

    @property
    def shape(self) -> torch.Size:
        """[N, K], as the float weight's."""
        return self.qweight.shape

    def read_bytes(self) -> int:
        """Bytes a small-batch step reads: the int8 weight and the scales."""
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    def nbytes(self) -> int:
        """Bytes held: ``read_bytes`` plus the wide or packed copy if kept."""
        extra = sum(t.numel() * t.element_size() for t in (self.wide, self.packed) if t is not None)
        return self.read_bytes() + extra

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` with W = qweight * scale.

        Args:
            x: [..., K] in the scale's dtype.
            bias: optional [N], same dtype.

        Returns:
            [..., N] in x's dtype.
        """
        rows = x.numel() // x.shape[-1]
        if self.kernels is not None and x.dtype == torch.float32:
            y = self._linear_kernels(self.kernels, x.reshape(rows, x.shape[-1]), bias)
            return y.view(*x.shape[:-1], self.qweight.shape[0])
        if (x.device.type == "cpu" and rows <= SMALL_BATCH_ROWS
                and x.dtype in (torch.bfloat16, torch.float16)):
            flat = x.reshape(rows, x.shape[-1]).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale)
            y = y.view(*x.shape[:-1], self.qweight.shape[0])  # also for 0 rows (a step that samples nothing)
        else:
            wide = self.wide if self.wide is not None and self.wide.dtype == x.dtype else self.qweight.to(x.dtype)
            y = F.linear(x, wide) * self.scale
        return y if bias is None else y + bias

    def _linear_kernels(self, kernels: CpuKernels, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] float32 -> [M, N] on the CPU kernels: integer products over the packed
        weight with x quantized to int16 blocks (``CpuKernels.linear_i8_packed``) when K is a
        multiple of 32, else the float32 int8 kernel. One kernel for every M: a row's result
        does not depend on how many rows share the call."""
        x = x if x.stride(-1) == 1 else x.contiguous()
        if self.packed is not None:
            return kernels.linear_i8_packed(x, self.packed, self.scale, bias)
        return kernels.linear_i8(x, self.qweight, self.scale, bias)

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Serve float32 activations on ``kernels`` (None: torch again); packs the weight
        for the integer kernel when K is a multiple of 32."""
        self.kernels = kernels
        k = self.qweight.shape[1]
        self.packed = kernels.pack_i8x8(self.qweight) if kernels is not None and k % 32 == 0 else None

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W: ids [T] int64 -> [T, K] in the scale's dtype."""
        if self.kernels is not None and self.scale.dtype == torch.float32:
            return self.kernels.embed_i8(self.qweight, self.scale, ids.contiguous())
        return self.qweight.index_select(0, ids).to(self.scale.dtype) * self.scale.index_select(0, ids)[:, None]


def quantize_int4(weight: torch.Tensor, offsets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """4-bit quantization of a [N, K] weight in groups of 32 along K (K a multiple of 32).

    Each group g of a row gets ``w ~= d * u + m`` with codes u in 0..15 and d, m in
    float16. Symmetric (``offsets`` False, as ggml's Q4_0): m = -8 d, and d is the best of
    17 candidate scales from the group's largest-magnitude weight / -8.5 to / -6.5 (/ -8 is ggml's),
    by squared error. With offsets (as ggml's Q4_1): d, m start from the group's range and
    are refitted three times by least squares on the chosen codes. d and m are rounded to
    float16 before the final codes are chosen, so the codes are optimal for the stored
    scales.

    Args:
        weight: [N, K] float tensor.
        offsets: fit an offset per group (else symmetric).

    Returns:
        ``(codes, d, m)``: codes [N, K] uint8 in 0..15, d [N, K / 32] float16, m
        [N, K / 32] float16 or None when symmetric.

    Raises:
        ValueError: ``weight`` is not 2-D or K is not a multiple of 32.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(f"4-bit quantization needs a 2-D weight with K a multiple of {GROUP}, "
                         f"got shape {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    if not offsets:
        big = w.gather(2, w.abs().argmax(2, keepdim=True))  # the signed value of largest magnitude
        best_d, best_err = torch.zeros_like(big), torch.full_like(big, float("inf"))
        for c in [-8.5 + 0.125 * i for i in range(17)]:  # -8 is ggml's; others may fit the rest better
            d = (big / c).half().float()
            u = torch.round(w / torch.where(d == 0, 1.0, d)).clamp_(-8, 7)
            err = (u * d - w).pow(2).sum(2, keepdim=True)
            better = err < best_err
            best_d, best_err = torch.where(better, d, best_d), torch.where(better, err, best_err)
        d = best_d
        codes = (torch.round(w / torch.where(d == 0, 1.0, d)).clamp_(-8, 7) + 8).to(torch.uint8)
        return codes.reshape(n, k).contiguous(), d.squeeze(2).half().contiguous(), None
    lo, hi = w.amin(2, keepdim=True), w.amax(2, keepdim=True)
    d, m = (hi - lo) / 15, lo
    for _ in range(3):
        d, m = d.half().float(), m.half().float()
        u = torch.round((w - m) / torch.where(d == 0, 1.0, d)).clamp_(0, 15)
        # least squares of w on (u, 1) per group: the best d, m for these codes
        su, sw, suu, suw = u.sum(2, keepdim=True), w.sum(2, keepdim=True), (u * u).sum(2, keepdim=True), \
            (u * w).sum(2, keepdim=True)
        det = GROUP * suu - su * su
        ok = det > 0
        d = torch.where(ok, (GROUP * suw - su * sw) / torch.where(ok, det, 1.0), d)
        m = torch.where(ok, (sw - d * su) / GROUP, m)
    d, m = d.half().float(), m.half().float()
    codes = torch.round((w - m) / torch.where(d == 0, 1.0, d)).clamp_(0, 15).to(torch.uint8)
    return codes.reshape(n, k).contiguous(), d.squeeze(2).half().contiguous(), m.squeeze(2).half().contiguous()


class Int4Weight(nn.Module):
    """A [N, K] weight held as 4-bit codes in groups of 32 (``quantize_int4``).

    Served by the CPU kernels (``CpuKernels.linear_q4``: the weight repacked into tiles of
    8 interleaved rows, x quantized to int8 blocks); elsewhere (the torch reference path)
    dequantized per call.

    Attributes:
        codes: [N, K / 2] uint8, two codes a byte (even k in the low nibble).
        d: [N, K / 32] float16 scales; m: [N, K / 32] float16 offsets, or None (m = -8 d).
        kernels: None, or the CPU kernels that serve float32 activations.
        packed: None, or the weight in ``CpuKernels.pack_q4x8``'s layout (``use_kernels``).
    """

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("codes", codes[:, 0::2] | (codes[:, 1::2] << 4))
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self.kernels: CpuKernels | None = None
        self.register_buffer("packed", None, persistent=False)

    @classmethod
    def from_float(cls, weight: torch.Tensor, offsets: bool) -> Int4Weight:
        """Quantize ``weight`` [N, K] (K a multiple of 32) with ``quantize_int4``."""
        codes, d, m = quantize_int4(weight, offsets)
        return cls(codes, d, m)

    @property
    def shape(self) -> torch.Size:
        """[N, K], as the float weight's."""
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * 2))

    def unpacked_codes(self) -> torch.Tensor:
        """[N, K] uint8, one code 0..15 a byte."""
        return torch.stack((self.codes & 15, self.codes >> 4), dim=2).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight the codes stand for: [N, K] float32, ``d * u + m`` per group."""
        n, k = self.shape
        u = self.unpacked_codes().float().reshape(n, k // GROUP, GROUP)
        d = self.d.float()[:, :, None]
        m = -8 * d if self.m is None else self.m.float()[:, :, None]
        return (u * d + m).reshape(n, k)

    def read_bytes(self) -> int:
        """Bytes a small-batch step reads: the codes, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m) if t is not None)

    def nbytes(self) -> int:
        """Bytes held: ``read_bytes`` plus the packed copy if kept."""
        return self.read_bytes() + (0 if self.packed is None else self.packed.numel())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T (+ bias)``: x [..., K] -> [..., N] in x's dtype."""
        n, k = self.shape
        if self.kernels is not None and self.packed is not None and x.dtype == torch.float32:
            rows = x.numel() // k
            flat = x.reshape(rows, k)
            flat = flat if flat.stride(-1) == 1 else flat.contiguous()
            return self.kernels.linear_q4(flat, self.packed, n, bias).view(*x.shape[:-1], n)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Serve float32 activations on ``kernels`` (None: torch again), repacking the
        weight into their tile layout."""
        self.kernels = kernels
        self.packed = None if kernels is None else kernels.pack_q4x8(self.unpacked_codes(), self.d, self.m)


QuantWeight = Int8Weight | Int4Weight


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a float weight, the quantized weight's own ``linear`` otherwise."""
    if isinstance(weight, (Int8Weight, Int4Weight)):
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor | Int8Weight) -> torch.Tensor:
    """``F.embedding`` for a float table, ``Int8Weight.embedding`` for a quantized one."""
    if isinstance(weight, Int8Weight):
        return weight.embedding(ids)
    return F.embedding(ids, weight)
