"""The paged KV cache tensors, and how many blocks of them fit the memory budget.

Layout (per layer, for K and for V)::

    [num_blocks, block_size, num_kv_heads, head_dim]   KV dtype (``EngineConfig.kv_cache_dtype``), model device

Token ``i`` of a request lives in block ``block_table[i // block_size]`` at offset
``i % block_size`` (flat slot ``block * block_size + offset``). Which blocks are
free or shared is the block pool's business; this module only holds the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError

_GIB = float(1 << 30)


def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V, over all layers, for one block of ``block_size`` tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * elem


@dataclass(frozen=True)
class KVPlan:
    """The size of the KV pool: ``num_blocks`` blocks of ``block_size`` tokens.

    Attributes:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        bytes_per_block: bytes of one block over all layers, K and V.
        total_bytes: num_blocks * bytes_per_block.
        max_tokens: num_blocks * block_size, the most tokens the pool can hold.
        dtype: the cache's element type.
    """

    num_blocks: int
    block_size: int
    bytes_per_block: int
    total_bytes: int
    max_tokens: int
    dtype: torch.dtype = torch.float32

    def describe(self) -> str:
        """One line for the start-up print, e.g.
        ``KV cache: 4096 blocks x 16 tokens = 65536 tokens, 1.41 GiB float32``."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.max_tokens} tokens, "
                f"{self.total_bytes / _GIB:.2f} GiB {dtype}")


def plan_kv_blocks(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device | str) -> KVPlan:
    """Decide the number of KV blocks.

    In order: ``engine_config.num_blocks`` when set; on CPU, as many blocks as fit
    ``engine_config.kv_cache_bytes``; on CUDA, ``gpu_memory_fraction`` of the memory
    still free (``torch.cuda.mem_get_info``), so call this after the weights are loaded.

    Raises:
        ConfigError: the budget does not hold a single block.
    """
    device = torch.device(device)
    dtype = engine_config.kv_torch_dtype
    per_block = bytes_per_block(model_config, engine_config.block_size, dtype)
    if engine_config.num_blocks is not None:
        num_blocks = engine_config.num_blocks
    elif device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        num_blocks = int(free_bytes * engine_config.gpu_memory_fraction) // per_block
    else:
        num_blocks = engine_config.kv_cache_bytes // per_block
    if num_blocks < 1:
        raise ConfigError(
            f"the KV budget holds no block of {engine_config.block_size} tokens ({per_block} bytes); "
            "raise kv_cache_bytes / gpu_memory_fraction or set num_blocks"
        )
    return KVPlan(num_blocks, engine_config.block_size, per_block, num_blocks * per_block,
                  num_blocks * engine_config.block_size, dtype)


@dataclass
class KVCache:
    """Per-layer K and V caches, each [num_blocks, block_size, num_kv_heads, head_dim].

    Attributes:
        k_caches, v_caches: one tensor per layer (the KV dtype, the model device).
        num_blocks, block_size: the pool's shape (blocks, tokens per block).
    """

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(
        cls,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """Allocate zeroed caches (zeros, so a stray read of an unwritten slot is finite)."""
        shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)]
        return cls(k, v, num_blocks, block_size)

    @property
    def num_bytes(self) -> int:
        """Bytes held by all K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)
