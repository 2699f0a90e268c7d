"""Names of KV blocks that engines and gateways compute alike: chained block hashes.

A cached KV block holds one full page (``block_size`` tokens) of a token prefix, and its
content depends on every token before it. So its name is a hash chain over pages, as in
vLLM's automatic prefix caching (its ``hash_block_tokens``: hash of the parent block's
hash and this block's tokens) and NVIDIA Dynamo's KV events::

    h(-1) = BLAKE2b-64(namespace)
    h(i)  = BLAKE2b-64(h(i-1) as 8 bytes || tokens of page i as little-endian uint32)

Two prefixes share the hash of page ``i`` exactly when they share pages ``0..i`` and the
namespace (the engine's prefix-cache namespace: ``"{weights_id}|"``), up to a 64-bit
collision (about 1 in 10^19 per pair; a collision costs one misrouted request, never
wrong output: the engine matches tokens, not hashes).

A salted request (a per-user ``cache_salt``, docs/reliability.md "Cache isolation")
keeps its first ``shared_tokens`` (whole pages: a prefix the operator declared shared,
such as the default system prompt) in the namespace's chain and re-seeds the chain
with its salt for the rest, as the radix tree hangs those pages below a salt node::

    s     = BLAKE2b-64[person "chatserve-salt"](h(k-1) as 8 bytes || salt as UTF-8)
    h(k)  = BLAKE2b-64(s || tokens of page k)            (k = shared pages)

so a salted page's hash cannot be computed without the salt, and one user's private
pages never hash like another's.

The engine's radix tree names each block it stores or evicts this way (``kv_events``
frames, docs/protocol.md); the gateway names a request's prompt the same way and looks
the names up in its prefix index (``gateway/engines/prefix_index.py``). Torch-free.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

__all__ = ["chain_hashes", "namespace_of", "namespace_seed", "prompt_block_hashes", "salt_seed"]

# BLAKE2b personalisation of salt seeds: a salt seed can never equal a page hash by construction
_SALT_PERSON = b"chatserve-salt"


def namespace_of(weights_id: str) -> str:
    """The engine's prefix-cache namespace for weights ``weights_id`` (what ``EngineCore``
    stores every request under; a cache salt is a level of the tree below it, see
    ``salt_seed``)."""
    return f"{weights_id}|"


def namespace_seed(namespace: str) -> int:
    """``h(-1)``: the 64-bit seed of a namespace's chains."""
    return int.from_bytes(hashlib.blake2b(namespace.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                          "little")


def chain_hashes(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes of the whole pages of ``token_ids``, chained on from ``parent``.

    Args:
        parent: the hash of the page before ``token_ids[0]`` (``namespace_seed`` at the start).
        token_ids: tokens, a multiple of ``block_size`` long (a partial last page is ignored).
        block_size: tokens per page.

    Returns:
        One unsigned 64-bit int per whole page, in order.

    Raises:
        ValueError: ``block_size < 1`` or a token id outside ``0..2**32-1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    pages = len(token_ids) // block_size
    if pages == 0:
        return []
    try:
        data = array("I", token_ids[: pages * block_size])
    except OverflowError:
        raise ValueError("token ids must be in 0..2**32-1") from None
    if sys.byteorder == "big":
        data.byteswap()
    raw = data.tobytes()
    step = 4 * block_size
    out: list[int] = []
    h = parent
    for p in range(pages):
        h = int.from_bytes(hashlib.blake2b(h.to_bytes(8, "little") + raw[p * step:(p + 1) * step],
                                           digest_size=8).digest(), "little")
        out.append(h)
    return out


def salt_seed(parent: int, salt: str) -> int:
    """The seed a salted chain continues from after the page hashed ``parent`` (the
    namespace's seed when nothing is shared): see the module doc."""
    return int.from_bytes(hashlib.blake2b(parent.to_bytes(8, "little") + salt.encode("utf-8", "surrogatepass"),
                                          digest_size=8, person=_SALT_PERSON).digest(), "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, namespace: str, salt: str = "",
                        shared_tokens: int = 0) -> list[int]:
    """The hashes of every whole page of a prompt in ``namespace`` (see the module doc),
    as the radix tree names them: with a ``salt``, the first ``shared_tokens // block_size``
    pages in the namespace's chain and the rest in the salted one.

    Raises:
        ValueError: as ``chain_hashes``.
    """
    seed = namespace_seed(namespace)
    if not salt or block_size < 1:
        return chain_hashes(seed, token_ids, block_size)
    pages = len(token_ids) // block_size
    shared = min(max(0, shared_tokens) // block_size, pages)
    head = chain_hashes(seed, token_ids[:shared * block_size], block_size)
    if shared == pages:
        return head
    return head + chain_hashes(salt_seed(head[-1] if head else seed, salt), token_ids[shared * block_size:],
                               block_size)
