"""Typed Python entry points to the CPU kernels (``kernels.c``), one function per kernel.

Every function takes torch tensors, checks what the C side relies on (device, dtype,
contiguity of the innermost dimension, shapes) and raises ``ValueError`` when a
check fails, then calls the kernel through ctypes with raw pointers. Kernels use
``torch.get_num_threads()`` threads from the OpenMP pool torch itself uses.

``cpu_kernels()`` returns the loaded ``CpuKernels`` or None (no compiler, build
failed, or ``CHATSERVE_CPU_KERNELS=0``); callers then use their torch path.
"""

from __future__ import annotations

import ctypes
from ctypes import c_float, c_int, c_int64, c_void_p

import torch

from engine.cpu.build import load_kernels

_P, _I, _F, _C = c_void_p, c_int64, c_float, c_int

_SIGNATURES: dict[str, tuple[list, type | None]] = {
    "cs_simd_level": ([], c_int),
    "cs_add_rms_norm": ([_P, _P, _P, _F, _I, _I, _P, _C], None),
    "cs_silu_mul": ([_P, _I, _I, _P, _C], None),
    "cs_rope": ([_P, _I, _I, _I, _I, _P, _P, _C], None),
    "cs_linear_i8": ([_P, _I, _I, _I, _P, _P, _P, _I, _P, _I, _C], None),
    "cs_pack_i8x8": ([_P, _I, _I, _P], None),
    "cs_linear_i8_packed": ([_P, _I, _I, _I, _P, _P, _P, _I, _P, _I, _P, _P, _C], None),
    "cs_embed_i8": ([_P, _P, _P, _I, _I, _P, _C], None),
    "cs_q4_level": ([], c_int),
    "cs_pack_q4x8": ([_P, _P, _P, _I, _I, _P], None),
    "cs_linear_q4": ([_P, _I, _I, _I, _P, _C, _P, _I, _P, _I, _P, _P, _P, _C], None),
    "cs_paged_attention": ([_P, _I, _P, _I, _P, _I, _P, _I, _P, _P, _C, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _P, _C],
                           c_int),
}


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"CPU kernel argument: {what}")


def _rows(t: torch.Tensor, dtype: torch.dtype, name: str) -> int:
    """Check a 2-D tensor of ``dtype`` on the CPU whose rows are contiguous; return its row
    stride. (Messages are built only on failure: this runs a few hundred times a step.)"""
    if t.dtype != dtype or t.dim() != 2 or t.stride(1) != 1 or t.is_cuda:
        _need(False, f"{name} must be a 2-D CPU {dtype} tensor with contiguous rows, got {t.dtype} "
                     f"{tuple(t.shape)} strides {t.stride()} on {t.device}")
    return t.stride(0)


def _contig(t: torch.Tensor, dtype: torch.dtype, name: str) -> int:
    """Check a contiguous CPU tensor of ``dtype``; return its data pointer."""
    if t.dtype != dtype or not t.is_contiguous() or t.is_cuda:
        _need(False, f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} on {t.device}")
    return t.data_ptr()


class CpuKernels:
    """The loaded kernel library, with one method per kernel (see ``kernels.c``).

    Args:
        lib: the ``ctypes.CDLL`` from ``engine.cpu.build.load_kernels``.
        isa: the instruction set it was built for (``engine.cpu.build.ISAS``, or "auto").
    """

    def __init__(self, lib: ctypes.CDLL, isa: str = "auto") -> None:
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self._lib = lib
        self.lib = lib  # for callers that bind further entry points (engine.cpu.fused)
        self._buffers: dict[str, torch.Tensor] = {}
        self.simd_level = int(lib.cs_simd_level())  # 3: AVX2 + VNNI, 2: AVX2 + FMA, 0: portable C
        self.q4_level = int(lib.cs_q4_level())  # 2: VNNI byte products, 1: AVX2 maddubs, 0: portable C
        self.isa = isa

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """RMSNorm with an optional residual add: ``x += delta`` (in place, when given), then
        ``out = weight * x / sqrt(mean(x^2) + eps)``.

        Args:
            x: [T, H] float32 contiguous, the residual stream (updated in place with delta).
            delta: None or [T, H] float32 contiguous.
            weight: [H] float32.
            eps: added to the mean square.
            out: optional [T, H] float32 result buffer (not x).

        Returns:
            ``out`` (a new [T, H] tensor when not given).
        """
        t, h = x.shape
        xp = _contig(x, torch.float32, "x")
        dp = 0 if delta is None else _contig(delta, torch.float32, "delta")
        _need(delta is None or delta.shape == x.shape, "delta must have x's shape")
        _need(weight.numel() == h, "weight must have H elements")
        out = torch.empty_like(x) if out is None else out
        self._lib.cs_add_rms_norm(xp, dp or None, _contig(weight, torch.float32, "weight"), eps, t, h,
                                  _contig(out, torch.float32, "out"), torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU gating: gate_up [T, 2I] float32 (gate then up) -> [T, I] ``silu(gate) * up``."""
        t, two_i = gate_up.shape
        out = gate_up.new_empty(t, two_i // 2)
        self._lib.cs_silu_mul(_contig(gate_up, torch.float32, "gate_up"), t, two_i // 2, out.data_ptr(),
                              torch.get_num_threads())
        return out

    def rope_(self, qkv: torch.Tensor, heads: int, head_dim: int, table: torch.Tensor,
              positions: torch.Tensor) -> None:
        """Rotate, in place, the first ``heads`` heads of each row of ``qkv``.

        Args:
            qkv: [T, >= heads * head_dim] float32 with contiguous rows (fused QKV rows).
            heads: heads to rotate (the Q and K heads), each ``head_dim`` floats.
            table: [max_len, 2, 1, head_dim / 2] float32 contiguous (``rotary_table``).
            positions: [T] int64, each < max_len.
        """
        ld = _rows(qkv, torch.float32, "qkv")
        _need(qkv.shape[1] >= heads * head_dim and head_dim % 2 == 0 and head_dim <= 1024, "rope head sizes")
        _need(table.shape[-1] * 2 == head_dim, "rotary table width must be head_dim / 2")
        self._lib.cs_rope(qkv.data_ptr(), ld, qkv.shape[0], heads, head_dim, _contig(table, torch.float32, "table"),
                          _contig(positions, torch.int64, "positions"), torch.get_num_threads())

    def linear_i8(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out = (x @ qweight^T) * scale (+ bias)`` with int8 weights.

        Args:
            x: [M, K] float32 with contiguous rows.
            qweight: [N, K] int8 contiguous; scale [N] float32; bias None or [N] float32.
            out: optional [M, N] float32 with contiguous rows.

        Returns:
            [M, N] float32.
        """
        ldx = _rows(x, torch.float32, "x")
        m, k = x.shape
        n = qweight.shape[0]
        if qweight.shape[1] != k:
            _need(False, f"qweight is {tuple(qweight.shape)} for x of width {k}")
        out = x.new_empty(m, n) if out is None else out
        ldy = _rows(out, torch.float32, "out")
        bp = None if bias is None else _contig(bias, torch.float32, "bias")
        self._lib.cs_linear_i8(x.data_ptr(), ldx, m, k, _contig(qweight, torch.int8, "qweight"),
                               _contig(scale, torch.float32, "scale"), bp, n, out.data_ptr(), ldy,
                               torch.get_num_threads())
        return out

    def pack_i8x8(self, qweight: torch.Tensor) -> torch.Tensor:
        """qweight [N, K] int8 (K a multiple of 32) in ``linear_i8_packed``'s layout
        (``cs_pack_i8x8`` in kernels.c): tiles of 8 rows, one record of 256 bytes per tile and
        block of 32 along K, the 8 rows' pairs of weights interleaved; [ceil(N / 8), K / 32,
        256] int8, rows past N zero."""
        n, k = qweight.shape
        if k % 32:
            _need(False, f"K = {k} is not a multiple of 32")
        out = torch.empty((n + 7) // 8, k // 32, 256, dtype=torch.int8)
        self._lib.cs_pack_i8x8(_contig(qweight, torch.int8, "qweight"), n, k, out.data_ptr())
        return out

    def linear_i8_packed(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """``out = (x @ qweight^T) * scale (+ bias)`` over the weight packed by ``pack_i8x8``,
        with x quantized to int16 in blocks of 32 values first, so that the products run on
        integer instructions (relative error about 2e-5 against the float32 product).

        Args:
            x: [M, K] float32 with contiguous rows, K a multiple of 32.
            packed: ``pack_i8x8(qweight)``; scale [N] float32; bias None or [N] float32.
            out: optional [M, N] float32 with contiguous rows.

        Returns:
            [M, N] float32; each row computed alone (independent of M).

        Raises:
            ValueError: tensors of the wrong dtype or layout, or a weight not packed for x's width.
        """
        ldx = _rows(x, torch.float32, "x")
        m, k = x.shape
        n = scale.numel()
        if packed.dim() != 3 or packed.shape[1] * 32 != k or packed.shape[0] != (n + 7) // 8 or packed.shape[2] != 256:
            _need(False, f"packed weight {tuple(packed.shape)} does not fit x of width {k} and {n} outputs")
        out = x.new_empty(m, n) if out is None else out
        ldy = _rows(out, torch.float32, "out")
        bp = None if bias is None else _contig(bias, torch.float32, "bias")
        xq = self._scratch("xq", m * k, torch.int16)
        xd = self._scratch("xd", m * (k // 32), torch.float32)
        self._lib.cs_linear_i8_packed(x.data_ptr(), ldx, m, k, _contig(packed, torch.int8, "packed"),
                                      _contig(scale, torch.float32, "scale"), bp, n, out.data_ptr(), ldy,
                                      xq.data_ptr(), xd.data_ptr(), torch.get_num_threads())
        return out

    def pack_q4x8(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """A 4-bit weight in ``linear_q4``'s tile layout (``cs_pack_q4x8`` in kernels.c).

        Args:
            codes: [N, K] uint8, one code 0..15 a byte, K a multiple of 32.
            d: [N, K / 32] float16 group scales; m: None (symmetric, offset -8 d) or
                [N, K / 32] float16 group offsets.

        Returns:
            [ceil(N / 8), K / 32, 144 or 160] uint8 (160 with offsets); rows past N zero.
        """
        n, k = codes.shape
        if k % 32 or d.shape != (n, k // 32) or (m is not None and m.shape != d.shape):
            _need(False, f"4-bit codes {tuple(codes.shape)} need K a multiple of 32 and [N, K / 32] scales")
        out = torch.empty((n + 7) // 8, k // 32, 144 if m is None else 160, dtype=torch.uint8)
        mp = None if m is None else _contig(m, torch.float16, "m")
        self._lib.cs_pack_q4x8(_contig(codes, torch.uint8, "codes"), _contig(d, torch.float16, "d"), mp, n, k,
                               out.data_ptr())
        return out

    def linear_q4(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """``out = x @ W^T (+ bias)`` over a 4-bit weight packed by ``pack_q4x8``, with x
        quantized to int8 in blocks of 32 first and the products on integer instructions.

        Args:
            x: [M, K] float32 with contiguous rows, K a multiple of 32.
            packed: ``pack_q4x8(...)`` of an [n, K] weight; n: its output rows.
            bias: None or [n] float32; out: optional [M, n] float32 with contiguous rows.

        Returns:
            [M, n] float32; each row computed alone (independent of M).

        Raises:
            ValueError: tensors of the wrong dtype or layout, or a weight not packed for x's width.
        """
        ldx = _rows(x, torch.float32, "x")
        m, k = x.shape
        if packed.dim() != 3 or packed.shape[1] * 32 != k or packed.shape[0] != (n + 7) // 8 \
                or packed.shape[2] not in (144, 160):
            _need(False, f"packed 4-bit weight {tuple(packed.shape)} does not fit x of width {k} and {n} outputs")
        out = x.new_empty(m, n) if out is None else out
        ldy = _rows(out, torch.float32, "out")
        bp = None if bias is None else _contig(bias, torch.float32, "bias")
        xq = self._scratch("xq8", m * k, torch.int8)
        xd = self._scratch("xd", m * (k // 32), torch.float32)
        xs = self._scratch("xs", m * (k // 32), torch.float32)
        self._lib.cs_linear_q4(x.data_ptr(), ldx, m, k, _contig(packed, torch.uint8, "packed"),
                               int(packed.shape[2] == 160), bp, n, out.data_ptr(), ldy, xq.data_ptr(), xd.data_ptr(),
                               xs.data_ptr(), torch.get_num_threads())
        return out

    def _scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable buffer of at least ``numel`` elements (kernels run one at a time)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < max(1, numel):
            buf = torch.empty(max(1, numel), dtype=dtype)
            self._buffers[name] = buf
        return buf

    def embed_i8(self, qweight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] int64 of the int8 table qweight [V, K] times their scales -> [T, K] float32."""
        t, k = ids.numel(), qweight.shape[1]
        out = torch.empty(t, k, dtype=torch.float32)
        self._lib.cs_embed_i8(_contig(qweight, torch.int8, "qweight"), _contig(scale, torch.float32, "scale"),
                              _contig(ids, torch.int64, "ids"), t, k, out.data_ptr(), torch.get_num_threads())
        return out

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start: torch.Tensor, scale: float) -> torch.Tensor:
        """Store the step's K/V in the paged cache, then attend (decode and prefill rows together).

        Args:
            q: [T, H, D] float32; each token's H*D values contiguous (a view of fused QKV rows is fine).
            k, v: [T, Hkv, D] float32, same layout rule; written at ``slot_mapping`` [T] int64.
            k_cache, v_cache: [num_blocks, block_size, Hkv, D] float32 or bfloat16, contiguous.
            block_tables: [B, max_blocks] int32; seq_lens [B] int32 (keys after this step);
                query_start [B + 1] int32 (cumulative query lengths).
            scale: softmax scale.

        Returns:
            [T, H, D] float32: query token i of request b attends, causally, to keys
            0..seq_len - qlen + i; head h reads KV head h // (H // Hkv).

        Raises:
            ValueError: a tensor of the wrong dtype, layout or shape.
            MemoryError: the kernel could not allocate its scratch memory.
        """
        t, h, d = q.shape
        hkv = k.shape[1]
        _need(q.dtype == k.dtype == v.dtype == torch.float32, "q, k, v must be float32")
        for x in (q, k, v):
            _need(x.stride(2) == 1 and x.stride(1) == d, "q, k and v must hold each token's heads contiguously")
        _need(k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
              and k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous float32/bfloat16")
        _need(k_cache.shape[2:] == (hkv, d) and h % hkv == 0, "cache heads/dim must match k")
        out = torch.empty(t, h, d, dtype=torch.float32)
        rc = self._lib.cs_paged_attention(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            _contig(slot_mapping, torch.int64, "slot_mapping"), t, k_cache.data_ptr(), v_cache.data_ptr(),
            int(k_cache.dtype == torch.bfloat16), _contig(block_tables, torch.int32, "block_tables"),
            block_tables.shape[1], _contig(seq_lens, torch.int32, "seq_lens"),
            _contig(query_start, torch.int32, "query_start"), seq_lens.numel(), h, hkv, d, k_cache.shape[1],
            scale, out.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise MemoryError("paged attention could not allocate its scratch memory")
        return out


_KERNELS: dict[str, CpuKernels | None] = {}


def cpu_kernels(isa: str = "auto") -> CpuKernels | None:
    """The process's ``CpuKernels`` for ``isa`` ("auto": the best this CPU runs; or one of
    ``engine.cpu.build.ISAS``), built and loaded on first call, or None when unavailable
    (no compiler, a failed build, an isa this CPU lacks: logged)."""
    if isa not in _KERNELS:
        lib = load_kernels(isa)
        _KERNELS[isa] = CpuKernels(lib, isa) if lib is not None else None
    return _KERNELS[isa]
