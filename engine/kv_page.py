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
    10+H+P  16    BLAKE2b-128 digest of bytes [0, 10+H+P)

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
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.config import DTYPES

__all__ = ["DIGEST_BYTES", "MAGIC", "PAGE_VERSION", "DecodedPage", "PageError", "PageHeader", "PageKey",
           "StalePageError", "decode_page", "encode_page", "gather_block", "scatter_block", "scope_digest"]

MAGIC = b"CSKV"
PAGE_VERSION = 1
DIGEST_BYTES = 16
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length


class PageError(ValueError):
    """A page that must not be served: corrupt (bad digest, bad header), truncated, or
    of another format version. The reader recomputes the page instead."""


class StalePageError(PageError):
    """A sound page written for something else: other weights, weight format, KV dtype,
    block size, model shape, cache scope, chained hash or tokens than expected."""


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
    key = header.key
    if tuple(kv.shape) != key.shape or kv.dtype != key.torch_dtype:
        raise ValueError(f"page tensor is {tuple(kv.shape)} {kv.dtype}, the key says {key.shape} {key.kv_dtype}")
    if len(header.token_ids) > key.block_size:
        raise ValueError(f"{len(header.token_ids)} tokens do not fit a page of {key.block_size}")
    head = header.to_json()
    payload = kv.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    body = _PREFIX.pack(MAGIC, PAGE_VERSION, len(head)) + head + payload
    return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def decode_page(data: bytes | bytearray | memoryview, expect: PageKey | None = None, *,
                scope: str | None = None, chain_hash: int | None = None,
                parent_hash: int | None = None, token_ids: tuple[int, ...] | list[int] | None = None) -> DecodedPage:
    """Check and read one page written by ``encode_page``.

    The digest is checked first, then the version, then each expectation given.

    Args:
        data: the page's bytes.
        expect: the key the reader serves (None: any key, as a tool that lists pages).
        scope, chain_hash, parent_hash, token_ids: what the reader expects the page to be
            (each None: not checked).

    Returns:
        The header and the KV tensor ([num_layers, 2, block_size, num_kv_heads,
        head_dim], the key's KV dtype, CPU).

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
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != bytes(digest):
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
