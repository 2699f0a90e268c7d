"""Which number formats a model is served in: weights, activations, KV cache, kernels.

``resolve_format(config)`` turns the "auto" settings of an ``EngineConfig`` into
concrete ones. The rule, from measurements in ``docs/benchmarks.md``
(``bench/decode_step.py``):

* CUDA: bfloat16 weights, activations and KV cache.
* CPU, when the engine's CPU kernels load (a C compiler is present; ``engine/cpu``)
  with vector byte products (AVX2, AVX-VNNI or AVX-512 VNNI): 4-bit weights in groups
  of 32 with a float16 scale and offset each (``DEFAULT_4BIT``, "int4"; the embedding and
  LM head int8; the symmetric "int4-sym" without offsets reads 10% fewer bytes but moved
  SmolLM2-135M's log-likelihood by 0.15 nats),
  float32 activations (quantized to int8 blocks inside the products), a bfloat16 KV
  cache. The fastest format whose mean log-likelihood shift against float32 stays under
  0.06 nats on ``bench/decode_step.py --quality`` and whose greedy answers follow
  float32's (the same top-1 token at 93% of the positions or more, mean KL under 0.02
  nats, ``--quality --agreement``); docs/cpu_kernels.md has the figures.
* CPU with the kernels but no AVX2 (portable C): int8 weights with one scale per output
  row, float32 activations, a bfloat16 KV cache (4-bit decoding costs more than it saves
  there).
* CPU without the kernels: int8 weights with bfloat16 activations where the CPU
  computes bfloat16 natively (AVX-512 BF16 or AMX: torch's int8 kernel needs
  bfloat16 activations, and is fast only there), else float32.

Naming one setting keeps the others automatic but consistent: ``--dtype float32``
alone is the exact mode (float32 weights, activations and KV; greedy output equal to
transformers token for token); ``--quantization int8`` alone picks the activations
as above. ``--quantization none`` asks for unquantized weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.errors import ConfigError

# The 4-bit format "auto" picks where the kernels multiply 4-bit weights fast, and the
# 4-bit names (engine.models.quant.QUANTIZATIONS).
DEFAULT_4BIT = "int4"
FOUR_BIT = ("int4", "int4-sym")


@dataclass(frozen=True)
class ServingFormat:
    """The concrete formats of one engine (no "auto" left).

    Attributes:
        dtype: activations (and unquantized weights): "float32", "bfloat16" or "float16".
        quantization: None, "int8" (weight-only, one scale per output row), "int4" or
            "int4-sym" (4-bit in groups of 32, a scale and an offset, or a scale only, per group).
        kv_cache_dtype: the KV cache's element type.
        cpu_kernels: the engine's own CPU kernels run the layers and attention.
    """

    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    cpu_kernels: bool

    @property
    def exact(self) -> bool:
        """float32 everywhere through torch's own ops: the transformers-parity mode."""
        return self.dtype == "float32" and self.quantization is None and self.kv_cache_dtype == "float32" \
            and not self.cpu_kernels

    def describe(self) -> str:
        """One line for logs and the UI, e.g. ``int8 weights, float32 activations, bfloat16 KV
        (CPU kernels)``."""
        weights = self.quantization or self.dtype
        text = f"{weights} weights, {self.dtype} activations, {self.kv_cache_dtype} KV"
        if self.cpu_kernels:
            text += " (CPU kernels)"
        if self.exact:
            text += " (exact)"
        return text


def cpu_has_native_bf16() -> bool:
    """True when torch's CPU backend reports AVX-512 (with BF16 in /proc/cpuinfo) or AMX."""
    from engine.cpu.build import cpu_flags

    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def kernels_available(isa: str = "auto") -> bool:
    """True when the CPU kernel library builds and loads for ``isa`` (``engine.cpu``)."""
    from engine.cpu.ops import cpu_kernels

    return cpu_kernels(isa) is not None


def kernels_4bit_fast(isa: str = "auto") -> bool:
    """True when the kernels for ``isa`` multiply 4-bit weights with vector byte products
    (AVX2's maddubs or VNNI): where they do not (portable C), int8 is the faster format."""
    from engine.cpu.ops import cpu_kernels

    k = cpu_kernels(isa)
    return k is not None and k.q4_level >= 1


def resolve_format(config: EngineConfig) -> ServingFormat:
    """The concrete serving format for ``config`` on its resolved device (see the module doc).

    Raises:
        ConfigError: a combination the engine cannot serve (int8 with float16
            activations; int8 with float32 activations on a CPU without the kernels).
    """
    device = config.resolved_device()
    dtype, quant, kv = config.dtype, config.quantization, config.kv_cache_dtype
    if quant == "none":
        quant = None
    if device.type != "cpu":
        dtype = "bfloat16" if dtype == "auto" else dtype
        quant = None if quant == "auto" else quant
        kernels = False
        if quant in FOUR_BIT:
            raise ConfigError(f"{quant} weights run on the CPU kernels only, not on {device.type}")
    else:
        kernels_ok = config.cpu_kernels and kernels_available(config.cpu_isa)
        if quant == "auto":
            if dtype == "auto" and kernels_ok and kernels_4bit_fast(config.cpu_isa):
                quant = DEFAULT_4BIT
            else:
                quant = "int8" if dtype == "auto" and (kernels_ok or cpu_has_native_bf16()) else None
        if dtype == "auto":
            dtype = "float32" if (quant is None or kernels_ok) else "bfloat16"
        if quant in FOUR_BIT and not kernels_ok and config.cpu_kernels:
            raise ConfigError(f"{quant} weights need the engine's CPU kernels, which could not be built "
                              "(is gcc installed?); use --quantization int8")
        if quant in FOUR_BIT and dtype != "float32":
            raise ConfigError(f"{quant} weights run on the CPU kernels with float32 activations, not {dtype}")
        if quant == "int8" and dtype == "float32" and not kernels_ok and config.cpu_kernels:
            # (with cpu_kernels False this is the slow torch reference path that tests compare against)
            raise ConfigError("int8 weights with float32 activations need the engine's CPU kernels, which "
                                      "could not be built (is gcc installed?); use --dtype bfloat16")
        # The kernels serve float32 activations; the exact mode keeps torch's own ops.
        kernels = kernels_ok and dtype == "float32" and quant is not None
    if quant == "int8" and dtype == "float16":
        raise ConfigError("int8 weights compute in bfloat16 or float32, not float16")
    if kv == "auto":
        kv = "bfloat16" if kernels else dtype
    if kv != dtype and not kernels and device.type == "cpu" and config.cpu_kernels:
        raise ConfigError(f"a {kv} KV cache with {dtype} activations needs the CPU kernels")
    return ServingFormat(dtype=dtype, quantization=quant, kv_cache_dtype=kv, cpu_kernels=kernels)


def resolved_config(config: EngineConfig) -> tuple[EngineConfig, ServingFormat]:
    """``config`` with its "auto" formats replaced by the resolved ones, and that format."""
    fmt = resolve_format(config)
    concrete = dataclasses.replace(config, dtype=fmt.dtype, quantization=fmt.quantization,
                                   kv_cache_dtype=fmt.kv_cache_dtype)
    return concrete, fmt


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved dtype name."""
    from engine.config import DTYPES

    return DTYPES[name]
