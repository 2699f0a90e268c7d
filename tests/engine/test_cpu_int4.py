"""The 4-bit weight format (engine/models/quant.py's ``Int4Weight``, kernels.c's
``cs_linear_q4``): the quantizer against ggml's schemes, the kernel against a float64
reference of its own integer arithmetic on every instruction set this CPU runs (the AVX2
path forced on an AVX-512 machine), odd shapes and tails, bit-identical results across
the SIMD builds, and the engine on 4-bit weights against torch's path."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.cpu.build import ISAS, compile_flags
from engine.cpu.ops import CpuKernels, cpu_kernels
from engine.errors import ConfigError
from engine.formats import resolve_format
from engine.models.quant import Int4Weight, quantize_int4

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels did not build (no C compiler)")



def runs(isa: str) -> bool:
    """Whether this CPU runs the ``isa`` build (AVX-512 machines may lack AVX-VNNI)."""
    try:
        compile_flags(isa=isa)
    except ValueError:
        return False
    return True


# the instruction sets this CPU runs, lowest first ("portable" always)
RUNNABLE = [isa for isa in ISAS if runs(isa)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kernels_for(isa: str) -> CpuKernels:
    k = cpu_kernels(isa)
    if k is None:
        pytest.fail(f"the {isa} kernels did not build", pytrace=False)
    return k


def test_symmetric_codes_fit_each_group_at_least_as_well_as_ggml_q4_0():
    """ggml's Q4_0 scale (largest-magnitude weight / -8) is one of the candidates, so no
    group's squared error is worse than with it; codes are 0..15 and dequantize back."""
    w = torch.randn(48, 256, generator=gen(1)) * torch.rand(48, 1, generator=gen(2))
    w[3, 5] = 9.0  # an outlier
    codes, d, m = quantize_int4(w, offsets=False)
    assert m is None and codes.dtype == torch.uint8 and int(codes.max()) <= 15 and d.dtype == torch.float16
    ours = ((codes.float() - 8).view(48, 8, 32) * d.float()[:, :, None] - w.view(48, 8, 32)).pow(2).sum(2)
    g = w.view(48, 8, 32)
    big = g.gather(2, g.abs().argmax(2, keepdim=True))
    dg = (big / -8).half().float()
    qg = torch.round(g / dg).clamp(-8, 7)
    ggml = (qg * dg - g).pow(2).sum(2)
    assert (ours <= ggml * (1 + 1e-6) + 1e-12).all()
    assert (ours < ggml * 0.999).any()  # and better somewhere


def test_codes_with_offsets_fit_better_than_ggml_q4_1_min_max():
    w = torch.randn(64, 512, generator=gen(3)) + 0.3
    codes, d, m = quantize_int4(w, offsets=True)
    assert m is not None and int(codes.max()) <= 15
    ours = (codes.float().view(64, 16, 32) * d.float()[:, :, None] + m.float()[:, :, None] - w.view(64, 16, 32))
    g = w.view(64, 16, 32)
    lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
    dg, mg = ((hi - lo) / 15).half().float(), lo.half().float()
    ggml = torch.round((g - mg) / dg).clamp(0, 15) * dg + mg - g
    assert ours.pow(2).sum() < ggml.pow(2).sum()


def test_quantize_int4_refuses_widths_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.ones(4, 40), offsets=True)


def reference(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in float64: x quantized to int8 per block of 32 as the kernel
    does it (float32 scale and rounding, ties to even), then the integer products with the
    weight's codes, scales and offsets. Returns (result, sum of |terms| per output)."""
    m_, k = x.shape
    n = w.shape[0]
    xb = x.view(m_, k // 32, 32)
    e = xb.abs().amax(2) / 127  # float32, as the kernel
    ie = torch.where(e > 0, 1 / e, torch.zeros_like(e))
    a = torch.round(xb * ie[:, :, None]).double()  # [M, G, 32]
    u = w.unpacked_codes().double().view(n, k // 32, 32)
    d = w.d.double()
    off = -8 * d if w.m is None else w.m.double()
    dots = torch.einsum("mgk,ngk->mng", a, u)  # exact integers
    s = (e.double() * a.sum(2))  # [M, G]
    terms = dots * d[None] * e.double()[:, None, :] + off[None] * s[:, None, :]
    out = terms.sum(2) + (0 if bias is None else bias.double())
    return out, terms.abs().sum(2)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("offsets", [True, False])
@pytest.mark.parametrize("m,n,k", [(1, 8, 32), (2, 13, 96), (9, 37, 160), (17, 70, 576), (4, 5, 64), (8, 16, 1536)])
def test_int4_linear_equals_the_float64_sum_of_its_integer_products(isa, offsets, m, n, k):
    """Every path (VNNI, AVX2 maddubs, portable C): tails of the 8-row tiles (n % 8), of
    the row groups (m % 4 and % 8), widths of 1 to 48 groups, with and without a bias."""
    kern = kernels_for(isa)
    g = gen(m * 1000 + n + k)
    w = Int4Weight.from_float(torch.randn(n, k, generator=g) * 0.05, offsets)
    w.use_kernels(kern)
    x = torch.randn(m, k, generator=g) * 3
    x[0, :32] = 0  # an all-zero block
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        ref, mag = reference(x, w, b)
        out = kern.linear_q4(x, w.packed, n, b).double()
        assert ((out - ref).abs() <= 1e-5 * mag + 1e-5).all(), (out - ref).abs().max()
    # a row's result does not depend on the other rows of the call
    assert torch.equal(kern.linear_q4(x[-1:], w.packed, n), kern.linear_q4(x, w.packed, n)[-1:])


@pytest.mark.parametrize("offsets", [True, False])
def test_simd_builds_give_bit_identical_int4_results(offsets):
    """VNNI's vpdpbusd and AVX2's maddubs + madd make the same exact int32 block sums, and
    the float steps after them are the same: the AVX2-only machines' path (forced here)
    computes what AVX-512 computes, bit for bit."""
    simd = [isa for isa in RUNNABLE if isa != "portable"]
    if len(simd) < 2:
        pytest.skip("this CPU runs one SIMD build only")
    g = gen(9)
    w = Int4Weight.from_float(torch.randn(75, 320, generator=g), offsets)
    x = torch.randn(11, 320, generator=g)
    outs = {}
    for isa in simd:
        w.use_kernels(kernels_for(isa))
        outs[isa] = w.linear(x)
    assert kernels_for("avx2").q4_level == 1 and kernels_for(simd[-1]).q4_level == 2
    for isa in simd:
        assert torch.equal(outs[isa], outs["avx2"]), isa


def test_int4_kernel_arguments_of_the_wrong_kind_are_refused():
    k = kernels_for("auto")
    w = Int4Weight.from_float(torch.randn(8, 64), True)
    w.use_kernels(k)
    assert w.packed is not None and tuple(w.packed.shape) == (1, 2, 160)
    with pytest.raises(ValueError, match="does not fit"):
        k.linear_q4(torch.zeros(1, 32), w.packed, 8)
    with pytest.raises(ValueError, match="float32"):
        k.linear_q4(torch.zeros(1, 64, dtype=torch.float64), w.packed, 8)
    with pytest.raises(ValueError, match="multiple of 32"):
        k.pack_q4x8(torch.zeros(8, 40, dtype=torch.uint8), torch.zeros(8, 1, dtype=torch.float16), None)


def test_auto_picks_int4_where_the_kernels_have_byte_products_and_int8_on_portable_c():
    fmt = resolve_format(EngineConfig(device="cpu"))
    assert (fmt.dtype, fmt.quantization, fmt.kv_cache_dtype, fmt.cpu_kernels) == ("float32", "int4", "bfloat16", True)
    assert fmt.describe() == "int4 weights, float32 activations, bfloat16 KV (CPU kernels)"
    assert resolve_format(EngineConfig(device="cpu", cpu_isa="avx2")).quantization == "int4"
    assert resolve_format(EngineConfig(device="cpu", cpu_isa="portable")).quantization == "int8"
    with pytest.raises(ConfigError, match="float32 activations"):
        resolve_format(EngineConfig(device="cpu", dtype="bfloat16", quantization="int4"))
    with pytest.raises(ConfigError, match="CPU kernels only"):
        resolve_format(EngineConfig(device="cuda", quantization="int4"))
    with pytest.raises(ConfigError, match="cpu_isa"):
        EngineConfig(cpu_isa="sse2")
