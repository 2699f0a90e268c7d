"""The decoder's layers as one CPU-kernel call each (``cs_decoder_layer`` in kernels.c).

Per-op kernel calls cost a few microseconds of Python and ctypes each, and a SmolLM2
step makes about 270 of them: several milliseconds beside a 6 ms memory floor. So when
every projection is packed on the kernels (int8 or 4-bit, ``use_kernels``), the model runner runs the
layers through ``FusedLayers`` (a ``LayerRunner``): each layer's weights and cache
pointers go into a C struct once, when it is built, and a step fills one struct with
its batch and scratch buffers; the forward is then one call per layer, running the same
equations as ``engine.models.llama.DecoderLayer``.

The structs hold raw pointers into tensors that ``FusedLayers`` keeps referenced (the
model's weights and caches, the step's batch tensors and scratch buffers), so nothing
they point at is freed while they are in use.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_float, c_int, c_int64, c_void_p
from typing import TYPE_CHECKING

import torch

from engine.cpu.ops import CpuKernels
from engine.forward_batch import ForwardBatch
from engine.models.quant import Int4Weight, Int8Weight, QuantWeight

if TYPE_CHECKING:
    from engine.kv_cache import KVCache
    from engine.models.llama import LlamaForCausalLM


class _Layer(Structure):
    _fields_ = [(n, c_int64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter")] + [
        ("eps", c_float), ("scale", c_float)] + [
        (n, c_void_p) for n in ("attn_norm", "mlp_norm", "qkv_w", "o_w", "gate_up_w", "down_w", "qkv_s", "o_s",
                                "gate_up_s", "down_s", "qkv_b", "k_cache", "v_cache")] + [("wfmt", c_int)]


class _Step(Structure):
    _fields_ = [(n, c_int64) for n in ("T", "B", "max_blocks", "block_size")] + [
        (n, c_int) for n in ("kv_bf16", "nt", "first")] + [
        (n, c_void_p) for n in ("rope", "positions", "slots", "block_tables", "seq_lens", "query_start", "x",
                                "residual", "normed", "qkv", "attn", "gate_up", "act", "xq", "xd", "xs")]


def weight_format(w: object) -> int | None:
    """``cs_layer.wfmt`` of a projection on the kernels: 0 packed int8, 1 packed 4-bit
    symmetric, 2 packed 4-bit with offsets; None when it is not packed on the kernels."""
    if isinstance(w, Int8Weight) and w.packed is not None and w.kernels is not None:
        return 0
    if isinstance(w, Int4Weight) and w.packed is not None and w.kernels is not None:
        return 1 if w.m is None else 2
    return None


def can_fuse(model: LlamaForCausalLM) -> bool:
    """True when, in every layer, the four projections are packed on the kernels in one format."""
    for layer in model.decoder_layers():
        fmts = {weight_format(w) for w in (layer.attn.qkv_weight, layer.attn.o_weight, layer.mlp.gate_up_weight,
                                           layer.mlp.down_weight)}
        if len(fmts) != 1 or None in fmts:
            return False
    return True


class FusedLayers:
    """Runs all decoder layers of ``model`` over ``kv`` with one kernel call per layer.

    Args:
        model: our Llama-family model, float32 activations, its projections packed
            (``can_fuse(model)``).
        kv: the paged KV cache (float32 or bfloat16).
        kernels: the loaded CPU kernels.

    Raises:
        ValueError: the model cannot be fused (see ``can_fuse``) or the cache dtype is not
            float32/bfloat16.
    """

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, kernels: CpuKernels) -> None:
        if not can_fuse(model):
            raise ValueError("every layer's projections must be packed on the CPU kernels, in one format")
        if kv.k_caches[0].dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the fused layers read float32 or bfloat16 caches, not {kv.k_caches[0].dtype}")
        fn = kernels.lib.cs_decoder_layer
        fn.argtypes, fn.restype = [POINTER(_Layer), POINTER(_Step)], c_int
        self._fn = fn
        self.kv_bf16 = int(kv.k_caches[0].dtype == torch.bfloat16)
        cfg = model.config
        self.hidden, self.heads, self.kv_heads, self.head_dim = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                                                                cfg.head_dim)
        self.inter = cfg.intermediate_size
        self.rope = model.rope
        self.layers: list[_Layer] = []
        for layer, k_cache, v_cache in zip(model.decoder_layers(), kv.k_caches, kv.v_caches):
            a, m = layer.attn, layer.mlp
            weights: dict[str, QuantWeight] = {}
            for name, w in (("qkv", a.qkv_weight), ("o", a.o_weight), ("gate_up", m.gate_up_weight),
                            ("down", m.down_weight)):
                assert isinstance(w, (Int8Weight, Int4Weight)) and w.packed is not None  # can_fuse checked it
                weights[name] = w
            wfmt = weight_format(a.qkv_weight)
            ptr = {f"{name}_w": w.packed.data_ptr() for name, w in weights.items()}  # type: ignore[union-attr]
            scales = {f"{name}_s": w.scale.data_ptr() if isinstance(w, Int8Weight) else None
                      for name, w in weights.items()}
            self.layers.append(_Layer(
                hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                inter=self.inter, eps=layer.attn_norm.eps, scale=a.scale,
                attn_norm=layer.attn_norm.weight.data_ptr(), mlp_norm=layer.mlp_norm.weight.data_ptr(),
                qkv_b=None if a.qkv_bias is None else a.qkv_bias.data_ptr(),
                k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), wfmt=wfmt, **ptr, **scales))
        self.kv = kv  # the cache the layer structs point into (the model holds the weights)
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A reusable [rows, width] scratch buffer (grown, never shrunk)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < rows * width:
            buf = torch.empty(max(1, rows * width), dtype=dtype)
            self._buffers[name] = buf
        return buf[: rows * width].view(rows, width)

    def forward(self, batch: ForwardBatch, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers over the step's embeddings ``x`` [T, hidden] float32.

        Returns:
            (the last layer's MLP output, the residual stream before it), both [T, hidden]
            float32, as ``DecoderLayer.forward`` returns them.

        Raises:
            MemoryError: attention could not allocate scratch memory.
        """
        t = x.shape[0]
        x = x.contiguous()
        residual = torch.empty_like(x)
        qkv_n = (self.heads + 2 * self.kv_heads) * self.head_dim
        widest = max(self.hidden, self.inter, self.heads * self.head_dim)
        bt = batch.block_tables
        step = _Step(
            T=t, B=batch.num_seqs, max_blocks=bt.shape[1], block_size=batch.block_size, kv_bf16=self.kv_bf16,
            nt=torch.get_num_threads(), first=1, rope=self.rope.data_ptr(), positions=batch.positions.data_ptr(),
            slots=batch.slot_mapping.data_ptr(), block_tables=bt.data_ptr(), seq_lens=batch.seq_lens.data_ptr(),
            query_start=batch.query_start_loc.data_ptr(), x=x.data_ptr(), residual=residual.data_ptr(),
            normed=self._buffer("normed", t, self.hidden).data_ptr(),
            qkv=self._buffer("qkv", t, qkv_n).data_ptr(),
            attn=self._buffer("attn", t, self.heads * self.head_dim).data_ptr(),
            gate_up=self._buffer("gate_up", t, 2 * self.inter).data_ptr(),
            act=self._buffer("act", t, self.inter).data_ptr(),
            xq=self._buffer("xq", t, widest, torch.int16).data_ptr(),
            xd=self._buffer("xd", t, max(1, widest // 32)).data_ptr(),
            xs=self._buffer("xs", t, max(1, widest // 32)).data_ptr())
        ref = ctypes.byref(step)
        for layer in self.layers:
            if self._fn(ctypes.byref(layer), ref) != 0:
                raise MemoryError("paged attention could not allocate its scratch memory")
        return x, residual
