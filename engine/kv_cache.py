"""The paged KV cache tensors, and how many blocks of them fit the memory budget.

Layout (per layer, for K and for V)::

    [num_blocks, block_size, num_kv_heads, head_dim]   KV dtype (``EngineConfig.kv_cache_dtype``), model device

Token ``i`` of a request lives in block ``block_table[i // block_size]`` at offset
``i % block_size`` (flat slot ``block * block_size + offset``). Which blocks are
free or shared is the block pool's business; this module only holds the memory.

The CPU pool's default size (``default_cpu_kv_bytes``): half the host memory available
once the weights are loaded, at most 8 GiB and at least 256 MiB. Why:

- at most 8 GiB: llama.cpp's server keeps its prompt cache in RAM up to 8 GiB by default
  (``--cache-ram 8192``), the peer a CPU user compares with; past that a chat's pages go
  to the disk KV tier (``engine.tiers``), which holds them across restarts too. 8 GiB is
  about 373,000 tokens of SmolLM2-135M in bfloat16 (23,040 bytes a token), or 65,000 of
  an 8B model with 8 KV heads of 128 (131,072 bytes a token);
- half of what is available: the other half stays for what a chat host also needs:
  the page cache the disk tier restores from (a page read from it is several times
  faster than from the disk), activations, the gateway, Redis, and a second engine;
- at least 256 MiB: an engine needs a pool to run at all (the old fixed budget was
  1 GiB whatever the memory);
- measured after the weights are loaded, so their memory is not counted as free.

The pool's memory is an anonymous mapping (``_zeroed_host_tensor``): the kernel hands out
zero pages as blocks are first written, so a large pool costs nothing at start (no
zero-fill: ``torch.zeros`` of 1 GiB took 1.3 s on a 2-vCPU host, and would commit all of
it at once) and a host's free memory goes down only as the cache fills. Several engines
started at once each see the same free memory: give each its own ``--kv-cache-gib``.
"""

from __future__ import annotations

import ctypes
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError

_GIB = float(1 << 30)

CPU_KV_MAX_BYTES = 8 << 30  # llama.cpp's default prompt-cache bound (--cache-ram 8192 MiB)
CPU_KV_MIN_BYTES = 256 << 20
CPU_KV_FRACTION = 0.5  # of the host memory available after the weights are loaded
CPU_KV_UNKNOWN_BYTES = 1 << 30  # when the free memory cannot be read (not Linux, no sysconf)


def default_cpu_kv_bytes(available_bytes: int | None) -> int:
    """The CPU KV pool's default budget in bytes for ``available_bytes`` of free host
    memory (``engine.host_memory.available_bytes``, read after the weights are loaded):
    half of it, at most 8 GiB, at least 256 MiB; 1 GiB when it is unknown (None). The
    reasoning is in the module doc."""
    if available_bytes is None:
        return CPU_KV_UNKNOWN_BYTES
    return max(CPU_KV_MIN_BYTES, min(CPU_KV_MAX_BYTES, int(available_bytes * CPU_KV_FRACTION)))


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
    sized_by: str = ""

    def describe(self) -> str:
        """One line for the start-up print, e.g. ``KV cache: 4096 blocks x 16 tokens =
        65536 tokens, 1.41 GiB float32 (half the 2.83 GiB of host memory available)``."""
        dtype = str(self.dtype).removeprefix("torch.")
        why = f" ({self.sized_by})" if self.sized_by else ""
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.max_tokens} tokens, "
                f"{self.total_bytes / _GIB:.2f} GiB {dtype}{why}")


def plan_kv_blocks(model_config: ModelConfig, engine_config: EngineConfig, device: torch.device | str,
                   available_bytes: int | None = None) -> KVPlan:
    """Decide the number of KV blocks.

    In order: ``engine_config.num_blocks`` when set; on CUDA, ``gpu_memory_fraction`` of
    the memory still free (``torch.cuda.mem_get_info``); on CPU, as many blocks as fit
    ``engine_config.kv_cache_bytes``, or when that is None ``default_cpu_kv_bytes`` of the
    host memory available. Call it after the weights are loaded (both free-memory rules
    read what is left).

    Args:
        available_bytes: the host memory available (CPU default only); None reads it
            (``engine.host_memory.available_bytes``).

    Raises:
        ConfigError: the budget does not hold a single block.
    """
    device = torch.device(device)
    dtype = engine_config.kv_torch_dtype
    per_block = bytes_per_block(model_config, engine_config.block_size, dtype)
    sized_by = ""
    if engine_config.num_blocks is not None:
        num_blocks = engine_config.num_blocks
    elif device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        num_blocks = int(free_bytes * engine_config.gpu_memory_fraction) // per_block
    elif engine_config.kv_cache_bytes is not None:
        num_blocks = engine_config.kv_cache_bytes // per_block
    else:
        if available_bytes is None:
            from engine.host_memory import available_bytes as read_available

            available_bytes = read_available()
        budget = default_cpu_kv_bytes(available_bytes)
        num_blocks = budget // per_block
        sized_by = ("host memory available unknown: 1 GiB" if available_bytes is None else
                    f"default: half the {available_bytes / _GIB:.2f} GiB of host memory available, "
                    "at most 8 GiB, at least 0.25 GiB; --kv-cache-gib sets it")
    if num_blocks < 1:
        raise ConfigError(
            f"the KV budget holds no block of {engine_config.block_size} tokens ({per_block} bytes); "
            "raise kv_cache_bytes / gpu_memory_fraction or set num_blocks"
        )
    return KVPlan(num_blocks, engine_config.block_size, per_block, num_blocks * per_block,
                  num_blocks * engine_config.block_size, dtype, sized_by)


def _zeroed_host_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` zeros of ``dtype`` backed by a private anonymous
    mapping: the kernel supplies zero pages on first write (POSIX guarantees anonymous
    memory reads as zeros), so nothing is filled or committed up front. The tensor keeps
    the mapping alive. No transparent huge pages: a first write of one 6 KB block row
    would fault in (and zero) 2 MB, and the kernel may compact memory to find it; a
    restore into a fresh pool took 0.4 s that way against 0.05 s with 4 KB pages.

    Raises:
        ConfigError: the mapping is refused.
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    try:
        region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot map {nbytes / _GIB:.2f} GiB for the KV cache ({e}); "
                          "lower --kv-cache-gib or --num-blocks") from e
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without changing their contents
_PAGE = mmap.PAGESIZE


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise(addr, length, advice)`` (None where there is no libc)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise_fn = _madvise()


def populate_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], blocks: list[int]) -> bool:
    """Fault in the memory of ``blocks`` of a CPU pool ahead of a write, without changing
    a byte (``MADV_POPULATE_WRITE``), so the write that follows (a restore's copy into
    the blocks, on the step loop) does not take the pool's first-touch page faults
    (about 1 ms a MB on a 2-vCPU host). Any thread may call it, even for blocks another
    request owns by now: their contents stay as they are.

    Args:
        k_caches, v_caches: the pool's per-layer caches, [num_blocks, ...] each.
        blocks: block ids.

    Returns:
        False where it does nothing: not the CPU, no libc, or a kernel without the advice.
    """
    if _madvise_fn is None or not blocks or k_caches[0].device.type != "cpu":
        return False
    spans: list[list[int]] = []
    for b in sorted(set(blocks)):  # contiguous blocks make one span
        if spans and spans[-1][1] + 1 == b:
            spans[-1][1] = b
        else:
            spans.append([b, b])
    for t in [*k_caches, *v_caches]:
        row = t.stride(0) * t.element_size()
        base = t.data_ptr()
        for first, last in spans:
            start = (base + first * row) // _PAGE * _PAGE
            end = base + (last + 1) * row
            if _madvise_fn(start, end - start, _MADV_POPULATE_WRITE) != 0:
                return False  # EINVAL on a kernel before 5.14: the write faults as before
    return True


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
        """Allocate zeroed caches (zeros, so a stray read of an unwritten slot is finite).

        On the CPU the zeros come from one anonymous mapping (``_zeroed_host_tensor``):
        no fill at start, memory committed as blocks are first written.

        Raises:
            ConfigError: the host refuses the mapping (less address space or commit
                room than the pool's size).
        """
        shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
        n = model_config.num_layers
        if torch.device(device).type == "cpu":
            flat = _zeroed_host_tensor(2 * n * math.prod(shape), dtype).view(2 * n, *shape)
            return cls(list(flat[:n].unbind(0)), list(flat[n:].unbind(0)), num_blocks, block_size)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        return cls(k, v, num_blocks, block_size)

    @property
    def num_bytes(self) -> int:
        """Bytes held by all K and V tensors."""
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)
