"""Rotary position embeddings (RoPE), precomputed once per model.

Source: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding"
(2021), in the "rotate half" layout of the Hugging Face Llama port (the first and
second halves of each head are the two coordinates of a pair, not interleaved
neighbours). Llama 3 frequency scaling: Meta's Llama 3.1 reference ("llama3"
rope_type: long wavelengths divided by ``factor``, short ones kept, a smooth ramp
between ``low_freq_factor`` and ``high_freq_factor``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.errors import ModelLoadError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The per-pair angular frequencies ``theta ** (-2i / head_dim)``, i < head_dim / 2.

    Args:
        head_dim: size of one attention head (even).
        theta: the RoPE base (``rope_theta``).
        scaling: None (plain RoPE), or a transformers ``rope_scaling`` dict with
            ``rope_type`` (or ``type``) "default", "linear" or "llama3".

    Returns:
        [head_dim // 2] float32 tensor on the CPU, radians per position.

    Raises:
        ModelLoadError: an odd head_dim or a rope_type this engine does not implement.
    """
    if head_dim % 2:
        raise ModelLoadError(f"rotary embeddings need an even head_dim, got {head_dim}")
    # Same expression as the reference port, so float32 tables match it bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None  # a scaled rope_type comes from it
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])  # positions / factor, folded into the frequencies
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ModelLoadError(f"unsupported rope scaling {rope_type!r}; supported: default, linear, llama3")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: wavelengths longer than the original context's
    ``1 / low_freq_factor`` are stretched by ``factor``, those shorter than its
    ``1 / high_freq_factor`` are kept, and the band between is interpolated."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > old_len / low
    short_wave = wavelen < old_len / high
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(long_wave, inv_freq / factor, torch.where(short_wave, inv_freq, blended))


def rotary_table(
    max_len: int,
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """cos and sin of ``position * inv_freq`` for every position below ``max_len``.

    Returns:
        [max_len, 2, 1, head_dim // 2] in ``dtype`` on ``device``: ``[:, 0]`` is cos,
        ``[:, 1]`` is sin; the singleton dimension broadcasts over heads. Angles are
        computed in float32 and only then cast, as the reference port does.
    """
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv_freq)
    table = torch.stack((angles.cos(), angles.sin()), dim=1).unsqueeze(2)
    return table.to(device=device, dtype=dtype).contiguous()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's (first half, second half) pairs by the position's angle.

    Args:
        x: [T, heads, head_dim] (may be a strided view).
        cos, sin: [T, 1, head_dim // 2], the rows of ``rotary_table`` at the tokens' positions.

    Returns:
        A new contiguous [T, heads, head_dim] tensor in x's dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
