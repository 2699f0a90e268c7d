r"""One serialization of a KV page: every layer's K and V for one block of tokens.

The KV tiers beneath the radix cache (``engine.tiers``) store pages in this form, and
anything that moves KV between engines may send it. A page is self-describing and
checked on read, so a page written by other weights, another format, another block
size or another user's salt never loads, and a flipped or missing byte is caught.

Byte layout (little-endian)::

    offset  size  field
    0       4     magic b"CSKV"
    4       2     format version (``PAGE_VERSION``)
    6       4     header length H (bytes)
    10      H     header: UTF-8 JSON (sorted keys), see ``PageHeader``
    10+H    P     payload: K and V of the block, C-contiguous
                  [num_layers, 2, block_size, num_kv_heads, head_dim] of the KV dtype
                  (index 0 = K, 1 = V); P = ``PageKey.payload_bytes``
    10+H+P  4     CRC-32 (zlib) of bytes [0, 10+H+P)

The checksum is CRC-32 (zlib's, as gzip and PNG use it): it catches every single-bit
error and every burst up to 32 bits, and reads about 5x faster than BLAKE2b here (0.05
against 0.26 ms a SmolLM2 page), which is most of a page's decode time on a restore. It
guards against storage faults, not against someone who can write the store directory.

A page of SmolLM2-135M (30 layers, 3 KV heads of 64, block 16, bfloat16) is
2 * 30 * 16 * 3 * 64 * 2 = 368,640 payload bytes plus about 400 header bytes.

The header names the page by its chained block hash (``engine.block_hash``), which
already covers the namespace (weights), the cache salt and every token before it; it
also carries the parent page's hash and the page's own token ids, which a reader checks
too, so a 64-bit hash collision can never serve another prefix's KV.

Torch is the only dependency; the payload is copied once on encode and once on decode.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from engine.config import DTYPES

__all__ = ["DIGEST_BYTES", "MAGIC", "PAGE_VERSION", "DecodedPage", "PageError", "PageHeader", "PageKey",
           "StalePageError", "decode_page", "encode_page", "encode_page_parts", "gather_block", "gather_blocks",
           "scatter_block", "scatter_blocks", "scope_digest"]

MAGIC = b"CSKV"
PAGE_VERSION = 2  # 1: a BLAKE2b-128 digest (never read back: recomputed)
DIGEST_BYTES = 4
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length


class PageError(ValueError):
    """A page that must not be served: corrupt (bad digest, bad header), truncated, or
    of another format version. The reader recomputes the page instead."""


class StalePageError(PageError):
    """A sound page written for something else: other weights, weight format, KV dtype,
    block size, model shape, cache scope, chained hash or tokens than expected."""


def _digest(body: bytes | memoryview) -> bytes:
    """The page checksum: CRC-32 of ``body``, 4 bytes little-endian."""
    return zlib.crc32(body).to_bytes(DIGEST_BYTES, "little")


def scope_digest(namespace: str, salt: str = "") -> str:
    """A short, one-way name of a cache scope (namespace and salt) for page headers and
    directory names: 16 hex digits of BLAKE2b, so a salt is never written out in clear."""
    data = namespace.encode("utf-8", "surrogatepass") + b"\x00" + salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=8, person=b"chatserve-scope").hexdigest()


@dataclass(frozen=True)
class PageKey:
    """What a page must have been written for to be read: equal keys or no match.

    Attributes:
        model_id: the weights id (``LoadedModel.weights_id``: weights, dtype, format).
        weight_format: the weight format's name, e.g. "int8" or "bfloat16".
        kv_dtype: the KV element type's name: "float32", "bfloat16" or "float16".
        block_size: tokens per page.
        num_layers, num_kv_heads, head_dim: the model's KV shape (elements).
    """

    model_id: str
    weight_format: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be one of {list(DTYPES)}, got {self.kv_dtype!r}")
        if min(self.block_size, self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"page shape must be positive: {self}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV dtype as a torch dtype."""
        return DTYPES[self.kv_dtype]

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The payload's shape: (num_layers, 2, block_size, num_kv_heads, head_dim)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        """Bytes of one page's K and V (all layers)."""
        n = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
        return n * torch.empty((), dtype=self.torch_dtype).element_size()

    def fingerprint(self) -> str:
        """16 hex digits naming this key (a store keeps each key's pages apart by it)."""
        text = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=8).hexdigest()


@dataclass(frozen=True)
class PageHeader:
    """Everything a page says about itself besides its K and V.

    Attributes:
        key: what it was written for (``PageKey``).
        scope: ``scope_digest`` of its cache namespace and salt.
        chain_hash: its chained block hash (unsigned 64-bit, ``engine.block_hash``).
        parent_hash: the chained hash of the page before it (the scope's seed for the first).
        token_ids: the page's tokens (``block_size`` of them for a full page; fewer for a
            partial last page, whose remaining slots are undefined).
    """

    key: PageKey
    scope: str
    chain_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]

    def to_json(self) -> bytes:
        """The header's UTF-8 JSON (sorted keys)."""
        d: dict[str, Any] = {"key": asdict(self.key), "scope": self.scope, "chain_hash": self.chain_hash,
                             "parent_hash": self.parent_hash, "token_ids": list(self.token_ids),
                             "token_count": len(self.token_ids)}
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> PageHeader:
        """Parse a header.

        Raises:
            PageError: not a well-formed header.
        """
        try:
            d = json.loads(raw)
            tokens = tuple(int(t) for t in d["token_ids"])
            if d["token_count"] != len(tokens):
                raise ValueError("token_count disagrees with token_ids")
            return cls(PageKey(**d["key"]), str(d["scope"]), int(d["chain_hash"]), int(d["parent_hash"]), tokens)
        except (ValueError, KeyError, TypeError) as e:
            raise PageError(f"page header is malformed: {e}") from None


@dataclass
class DecodedPage:
    """A page read back.

    Attributes:
        header: its ``PageHeader``.
        kv: [num_layers, 2, block_size, num_kv_heads, head_dim], the key's KV dtype, CPU
            (a tensor of its own, not a view of the input bytes).
    """

    header: PageHeader
    kv: torch.Tensor


def encode_page(header: PageHeader, kv: torch.Tensor) -> bytes:
    """Serialize one page (see the module doc for the layout).

    Args:
        header: what the page is (its key fixes the payload's shape and dtype).
        kv: [num_layers, 2, block_size, num_kv_heads, head_dim] of ``header.key``'s KV
            dtype, any device (copied to the CPU).

    Returns:
        The page's bytes: about ``header.key.payload_bytes`` + 430.

    Raises:
        ValueError: ``kv``'s shape or dtype disagrees with the key, or more tokens than
            ``block_size``.
    """
    return b"".join(encode_page_parts(header, kv))


def encode_page_parts(header: PageHeader, kv: torch.Tensor) -> list[bytes | memoryview]:
    """``encode_page`` without joining: the prefix and header, the payload as a view of
    ``kv``'s own memory (no copy when ``kv`` is a contiguous CPU tensor), and the CRC-32,
    computed over the views in turn (zlib releases the GIL for it). A writer that writes
    the parts in order writes the page's bytes: the step loop's thread is not held up by
    three 370 KB copies under the GIL per page, as a joined ``bytes`` cost. ``kv`` must
    stay unchanged until the parts are written.

    Returns:
        [prefix and header bytes, payload view, 4 checksum bytes].

    Raises:
        ValueError: as ``encode_page``.
    """
    key = header.key
    if tuple(kv.shape) != key.shape or kv.dtype != key.torch_dtype:
        raise ValueError(f"page tensor is {tuple(kv.shape)} {kv.dtype}, the key says {key.shape} {key.kv_dtype}")
    if len(header.token_ids) > key.block_size:
        raise ValueError(f"{len(header.token_ids)} tokens do not fit a page of {key.block_size}")
    head = header.to_json()
    first = _PREFIX.pack(MAGIC, PAGE_VERSION, len(head)) + head
    payload = memoryview(kv.detach().to("cpu").contiguous().view(torch.uint8).numpy().reshape(-1).data)
    crc = zlib.crc32(payload, zlib.crc32(first))
    return [first, payload, crc.to_bytes(DIGEST_BYTES, "little")]


def decode_page(data: bytes | bytearray | memoryview, expect: PageKey | None = None, *,
                scope: str | None = None, chain_hash: int | None = None,
                parent_hash: int | None = None, token_ids: tuple[int, ...] | list[int] | None = None,
                out: torch.Tensor | None = None) -> DecodedPage:
    """Check and read one page written by ``encode_page``.

    The digest is checked first, then the version, then each expectation given.

    Args:
        data: the page's bytes.
        expect: the key the reader serves (None: any key, as a tool that lists pages).
        scope, chain_hash, parent_hash, token_ids: what the reader expects the page to be
            (each None: not checked).
        out: a CPU tensor of the payload's shape and dtype to read the KV into (one copy
            fewer for a reader that gathers pages in one buffer); None: a new tensor.

    Returns:
        The header and the KV tensor ([num_layers, 2, block_size, num_kv_heads,
        head_dim], the key's KV dtype, CPU; ``out`` when given).

    Raises:
        PageError: truncated, bad magic, digest mismatch (corrupt), another format
            version, or a malformed header or payload length.
        StalePageError: a sound page that is not the expected one (key, scope, hashes
            or tokens differ).
    """
    buf = memoryview(data).cast("B")
    if len(buf) < _PREFIX.size + DIGEST_BYTES:
        raise PageError(f"page truncated: {len(buf)} bytes")
    magic, version, head_len = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise PageError(f"not a KV page (magic {bytes(magic)!r})")
    body, digest = buf[:-DIGEST_BYTES], buf[-DIGEST_BYTES:]
    if _digest(body) != bytes(digest):
        raise PageError(f"page checksum mismatch ({len(buf)} bytes): corrupt or truncated")
    if version != PAGE_VERSION:
        raise PageError(f"page format version {version}, this engine reads {PAGE_VERSION}")
    start = _PREFIX.size + head_len
    if start > len(body):
        raise PageError("page header runs past the page")
    header = PageHeader.from_json(bytes(body[_PREFIX.size:start]))
    key = header.key
    if expect is not None and key != expect:
        diff = [f for f in ("model_id", "weight_format", "kv_dtype", "block_size", "num_layers", "num_kv_heads",
                            "head_dim") if getattr(key, f) != getattr(expect, f)]
        raise StalePageError(f"page written for another {', '.join(diff)}")
    for name, want, got in (("scope", scope, header.scope), ("chain hash", chain_hash, header.chain_hash),
                            ("parent hash", parent_hash, header.parent_hash)):
        if want is not None and want != got:
            raise StalePageError(f"page has another {name}")
    if token_ids is not None and tuple(token_ids) != header.token_ids:
        raise StalePageError("page holds other tokens")
    if len(body) - start != key.payload_bytes:
        raise PageError(f"page payload is {len(body) - start} bytes, its key says {key.payload_bytes}")
    if out is not None:
        if tuple(out.shape) != key.shape or out.dtype != key.torch_dtype:
            raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, the page is {key.shape} {key.kv_dtype}")
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("out must be a contiguous CPU tensor")
        out.view(torch.uint8).view(-1).numpy()[:] = np.frombuffer(body[start:], dtype=np.uint8)
        return DecodedPage(header, out)
    raw = bytearray(body[start:])  # own the memory: the caller may drop ``data``
    kv = torch.frombuffer(raw, dtype=torch.uint8).view(key.torch_dtype).reshape(key.shape)
    return DecodedPage(header, kv)


def gather_block(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block: int) -> torch.Tensor:
    """One block's K and V out of a paged cache, as a page tensor.

    Args:
        k_caches, v_caches: per layer [num_blocks, block_size, num_kv_heads, head_dim]
            (``engine.kv_cache.KVCache``).
        block: the block id.

    Returns:
        [num_layers, 2, block_size, num_kv_heads, head_dim], the caches' dtype and device
        (a copy).
    """
    return torch.stack([torch.stack((k[block], v[block])) for k, v in zip(k_caches, v_caches)])


def scatter_block(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block: int,
                  kv: torch.Tensor) -> None:
    """Write a page tensor into one block of a paged cache (the inverse of ``gather_block``).

    Args:
        kv: [num_layers, 2, block_size, num_kv_heads, head_dim] of the caches' dtype
            (any device: copied to the caches').

    Raises:
        ValueError: ``kv``'s shape or dtype disagrees with the caches.
    """
    k0 = k_caches[0]
    want = (len(k_caches), 2, *k0.shape[1:])
    if tuple(kv.shape) != want or kv.dtype != k0.dtype:
        raise ValueError(f"page tensor is {tuple(kv.shape)} {kv.dtype}, the cache wants {want} {k0.dtype}")
    kv = kv.to(k0.device, non_blocking=True)
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        k[block].copy_(kv[layer, 0])
        v[block].copy_(kv[layer, 1])


def gather_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
    """Several blocks' K and V at once.

    On the CPU one numpy fancy-index take per layer and K/V (single-threaded, a memcpy per
    block row: several times faster than ``index_select`` with torch's threads, which a
    busy 2-vCPU host makes worse); elsewhere ``index_select``.

    Returns:
        [len(blocks), num_layers, 2, block_size, num_kv_heads, head_dim], the caches'
        dtype and device (a copy); entry ``i`` is ``gather_block(..., blocks[i])``.
    """
    k0 = k_caches[0]
    if k0.device.type == "cpu":
        out = torch.empty((len(blocks), len(k_caches), 2, *k0.shape[1:]), dtype=k0.dtype)
        dst, idx = _bytes_view(out), np.asarray(blocks, dtype=np.intp)
        for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
            dst[:, layer, 0] = _bytes_view(k)[idx]
            dst[:, layer, 1] = _bytes_view(v)[idx]
        return out
    idx_t = torch.tensor(blocks, dtype=torch.long, device=k0.device)
    per_layer = [torch.stack((k.index_select(0, idx_t), v.index_select(0, idx_t)), dim=1)
                 for k, v in zip(k_caches, v_caches)]  # each [n, 2, block_size, heads, head_dim]
    return torch.stack(per_layer, dim=1)


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy uint8 array of the same shape but for its last
    dimension (in bytes): numpy has no bfloat16, and a byte copy is the same copy."""
    return t.view(torch.uint8).numpy()


def scatter_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], blocks: list[int],
                   pages: list[torch.Tensor] | torch.Tensor) -> None:
    """Write page tensors into blocks (the inverse of ``gather_blocks``: on the CPU one
    numpy fancy-index assignment per layer and K/V, elsewhere ``index_copy_``).

    Args:
        pages: one [num_layers, 2, block_size, num_kv_heads, head_dim] tensor per block, of
            the caches' dtype (any device), or all of them stacked in one tensor.

    Raises:
        ValueError: a page's shape or dtype disagrees with the caches, or the counts differ.
    """
    if len(pages) != len(blocks):
        raise ValueError(f"{len(pages)} pages for {len(blocks)} blocks")
    if len(pages) == 0:
        return
    k0 = k_caches[0]
    want = (len(k_caches), 2, *k0.shape[1:])
    for kv in pages:
        if tuple(kv.shape) != want or kv.dtype != k0.dtype:
            raise ValueError(f"page tensor is {tuple(kv.shape)} {kv.dtype}, the cache wants {want} {k0.dtype}")
    stacked = (pages if isinstance(pages, torch.Tensor) else torch.stack(pages)).to(k0.device)
    # stacked: [n, layers, 2, block_size, heads, head_dim]
    if k0.device.type == "cpu":  # numpy fancy-index assignment, as in gather_blocks
        src, at = _bytes_view(stacked.contiguous()), np.asarray(blocks, dtype=np.intp)
        for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
            _bytes_view(k)[at] = src[:, layer, 0]
            _bytes_view(v)[at] = src[:, layer, 1]
        return
    idx = torch.tensor(blocks, dtype=torch.long, device=k0.device)
    for layer, (k, v) in enumerate(zip(k_caches, v_caches)):
        k.index_copy_(0, idx, stacked[:, layer, 0])
        v.index_copy_(0, idx, stacked[:, layer, 1])
