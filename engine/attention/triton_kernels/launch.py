"""Launch-time choices shared by the attention kernels: tile sizes, warps, precision.

Tiles are compile-time constants of each kernel. On a GPU they are sized for
Hopper-class parts (H100/H200) following the usual Triton flash-attention
settings; under ``TRITON_INTERPRET=1`` (CPU tests) they shrink to 16, the
smallest size ``tl.dot`` accepts when compiled, so the interpreted tests exercise
the same multi-tile code paths on tiny inputs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.errors import EngineError

#: dtypes the kernels take for q, k, v and the caches (accumulation is always float32).
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch settings of one attention kernel launch.

    Attributes:
        block_m: query rows per program (extend) or padded query heads per KV head (decode).
        block_n: keys per inner-loop tile (tokens).
        num_warps: warps per program (ignored by the interpreter).
        num_stages: software-pipelining depth (ignored by the interpreter).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(t: torch.Tensor) -> None:
    """Raise unless ``t`` can be handed to a Triton kernel here.

    Raises:
        EngineError: ``t`` is on the CPU and the Triton interpreter is off, or its
            dtype is not float32/bfloat16/float16.
    """
    if not t.is_cuda and not interpreting():
        raise EngineError(
            "the Triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 for CPU "
            "tests); use --attention-backend torch here"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise EngineError(f"Triton attention supports float32/bfloat16/float16, got {t.dtype}")


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: full IEEE float32 for float32 models (TF32 would cost
    ~3e-4 relative error against the torch backend); bf16/fp16 operands ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def interpreter_dot_f32(dtype: torch.dtype) -> bool:
    """Whether kernels must upcast ``tl.dot`` operands to float32: only for bfloat16
    under the interpreter, whose dot multiplies bfloat16 bit patterns as integers
    (seen with Triton 3.9.0). Compiled kernels always take the native path."""
    return dtype == torch.bfloat16 and interpreting()


def decode_tiles(head_dim: int, group: int, dtype: torch.dtype) -> TileConfig:
    """Tiles of the decode kernel: ``block_m`` query heads of one KV group (padded to
    at least 16 for ``tl.dot``), ``block_n`` keys per tile (no register spills in the
    sm_90 build, see bench/gpu/compile_check.py)."""
    block_g = max(16, next_pow2(group))
    if interpreting():
        return TileConfig(block_m=block_g, block_n=16, num_warps=1, num_stages=1)
    if dtype == torch.float32 and head_dim > 64:
        return TileConfig(block_m=block_g, block_n=32, num_warps=8, num_stages=2)
    return TileConfig(block_m=block_g, block_n=64 if head_dim <= 128 else 32, num_warps=4, num_stages=2)


def extend_tiles(head_dim: int, dtype: torch.dtype) -> TileConfig:
    """Tiles of the extend kernel: ``block_m`` new tokens of one request and head per
    program, ``block_n`` keys per tile (chosen so the sm_90 build spills no registers,
    see bench/gpu/compile_check.py)."""
    if interpreting():
        return TileConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        # IEEE float32 dots run on FMA units, not tensor cores: register-hungry, so
        # small tiles (the largest that compile without spills for sm_90).
        if head_dim <= 64:
            return TileConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
        return TileConfig(block_m=32, block_n=16, num_warps=8, num_stages=2)
    if head_dim <= 64:
        return TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
