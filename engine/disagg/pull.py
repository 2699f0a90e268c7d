"""The decode side of a KV move: fetch the pages of a prompt this engine lacks from the
engine that computed them, check each one, and adopt them before the request runs.

The exchange (protocol 8, docs/protocol.md): a fresh connection to the source engine's
internal WebSocket, one ``kv_fetch`` frame naming the prompt and the pages wanted; the
source answers one binary frame per page (``engine.kv_page``) and a ``kv_fetch_done``.
Each page is checked against what this engine expects (its digest, then its format key,
scope, chained hash, parent hash and tokens); the first page that fails ends the pull,
and the pages before it are kept. What was not received (a corrupt page, a link cut
midway, pages the source evicted before the read, a timeout) is either computed here by
the ordinary prefill (``EngineConfig.kv_pull_failure == "local"``) or ends the request
with ``kv_transfer_failed`` ("fail"). Either way the answer is never wrong: pages enter
the tree only after their check, and the engine always computes at least the prompt's
last token itself.

The same pull runs the other way for a chat's later turn: a prefill engine given a
``kv_source`` (the chat's decode engine, which computed the earlier replies) pulls the
leading pages it lacks from there, then prefills only the rest. That source is not
expected to hold the whole prompt (the new message is on neither engine yet), so a
shorter answer than asked is no failure there; a corrupt page or a cut link is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from engine.disagg.pages import adopt_pages, page_key, scope_of
from engine.errors import EngineError
from engine.kv_page import PageError, decode_page
from engine.protocol import ErrorFrame, FrameError, KvFetchDoneFrame, KvFetchFrame, decode_engine_frame, encode
from engine.radix_cache import CacheScope
from engine.server import MAX_FRAME_BYTES, SECRET_ENV, SECRET_HEADER
from engine.tiers.manager import page_refs

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

log = logging.getLogger(__name__)

__all__ = ["KvTransferError", "PullResult", "fetch_pages", "pull_prompt"]


class KvTransferError(EngineError):
    """Pulling a prompt's pages failed and the engine is set to fail the request
    (``kv_pull_failure == "fail"``); code ``kv_transfer_failed``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "kv_transfer_failed")


@dataclass
class PullResult:
    """How one pull went.

    Attributes:
        pages_held: leading pages of the prompt in this engine's tree after the pull (pages).
        pages_wanted: pages asked of the source (0: this engine held them all already).
        pages_adopted: pages received, checked and put into the tree (pages).
        bytes: bytes received (serialized pages).
        ms: wall time of the pull, connection to adoption (ms).
        error: why fewer pages than wanted were adopted ("" when all were).
    """

    pages_held: int = 0
    pages_wanted: int = 0
    pages_adopted: int = 0
    bytes: int = 0
    ms: float = 0.0
    error: str = ""


async def fetch_pages(url: str, frame: KvFetchFrame, timeout_s: float,
                      secret: str | None = None, partial_ok: bool = False) -> tuple[list[bytes], str]:
    """Ask the engine at ``url`` for pages (``KvFetchFrame``) and collect its answer.

    Args:
        url: the source engine's internal WebSocket, ``ws://host:port``.
        timeout_s: the whole exchange's limit (seconds).
        secret: the link's shared secret (default: ``ENGINE_SECRET`` of this process).
        partial_ok: the source may hold fewer pages than asked (its leading ones are sent).

    Returns:
        The binary page frames received, in order, and "" when the source said it sent
        all it holds of them, else why the answer is short (the source's error, a cut
        link, a timeout, or fewer pages than asked unless ``partial_ok``).
    """
    secret = os.environ.get(SECRET_ENV) if secret is None else secret
    headers = {SECRET_HEADER: secret} if secret else None
    pages: list[bytes] = []

    async def run() -> str:
        # no per-message deflate: pages are dense numbers, and compressing them cost more
        # than sending them (46 MB took 2.9 s on one core with it)
        async with connect(url, additional_headers=headers, max_size=MAX_FRAME_BYTES, open_timeout=timeout_s,
                           ping_interval=None, compression=None) as ws:
            await ws.recv()  # hello
            await ws.send(encode(frame))
            async for msg in ws:
                if isinstance(msg, bytes):
                    pages.append(msg)
                    continue
                reply = decode_engine_frame(msg)
                if isinstance(reply, KvFetchDoneFrame) and reply.request_id == frame.request_id:
                    if reply.error:
                        return f"the source engine: {reply.error}"
                    if reply.pages != len(pages):
                        return f"the source said {reply.pages} pages and sent {len(pages)}"
                    if len(pages) < frame.num_pages and not partial_ok:
                        return f"the source holds {len(pages)} of the {frame.num_pages} pages asked (evicted)"
                    return ""
                if isinstance(reply, ErrorFrame):
                    return f"the source engine refused: {reply.message}"
            return f"the link to {url} closed after {len(pages)} pages"

    try:
        return pages, await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        return pages, f"no answer from {url} within {timeout_s:g} s ({len(pages)} pages received)"
    except (OSError, WebSocketException, FrameError) as e:
        return pages, f"the link to {url} failed after {len(pages)} pages: {type(e).__name__}: {e}"


async def pull_prompt(engine: AsyncEngine, token_ids: list[int], url: str, cache_salt: str = "",
                      shared_tokens: int = 0) -> PullResult:
    """Bring the pages of ``token_ids`` that ``engine`` lacks from the engine at ``url``
    into its tree (module doc). Only pages before the prompt's last token are wanted:
    the engine computes that token itself to sample from it. A prefill engine takes
    what the source holds of them (a chat's decode engine: the earlier turns); any other
    role expects them all (the prefill engine that just computed the prompt).

    Raises:
        KvTransferError: fewer pages than wanted were adopted and the engine is set to
            ``kv_pull_failure == "fail"``.
    """
    start = time.monotonic()
    core = engine.core
    bs = core.config.block_size
    scope = scope_of(core, cache_salt, shared_tokens)
    wanted_end = (len(token_ids) - 1) // bs
    have = await engine.call(lambda c: len(c.cache.match_prefix(token_ids, scope, max_tokens=wanted_end * bs).blocks))
    result = PullResult(pages_held=have)
    if have >= wanted_end or not core.cache.enabled:
        return result
    result.pages_wanted = wanted_end - have
    frame = KvFetchFrame(f"pull-{id(result):x}", token_ids[:wanted_end * bs], have, wanted_end - have, cache_salt,
                         shared_tokens)
    partial_ok = core.config.role == "prefill"
    raw, error = await fetch_pages(url, frame, core.config.kv_pull_timeout_s, partial_ok=partial_ok)
    fetched = time.monotonic()
    raw = raw[:frame.num_pages]  # a source that sends more than asked gets no further
    result.bytes = sum(len(r) for r in raw)
    loop = asyncio.get_running_loop()
    kvs, check_error = await loop.run_in_executor(None, _check_pages, engine, raw, token_ids, scope, have)
    error = check_error or error
    checked = time.monotonic()
    if kvs:
        result.pages_held = await engine.call(adopt_pages, token_ids, scope, have, kvs)
        result.pages_adopted = max(0, result.pages_held - have)
    log.debug("pulled %d pages (%d bytes) from %s: fetch %.1f ms, check %.1f ms, adopt %.1f ms", len(raw),
              result.bytes, url, (fetched - start) * 1000, (checked - fetched) * 1000,
              (time.monotonic() - checked) * 1000)
    if not error and result.pages_held < have + len(raw):
        error = f"{have + len(raw) - result.pages_held} pages did not fit this engine's pool"
    result.error = error
    result.ms = (time.monotonic() - start) * 1000
    engine.count_pull(result)
    if error and core.config.kv_pull_failure == "fail":
        raise KvTransferError(f"moving the prompt's KV failed: {error}")
    return result


def _check_pages(engine: AsyncEngine, raw: list[bytes], token_ids: list[int], scope: CacheScope,
                 first: int) -> tuple[list[torch.Tensor], str]:
    """Decode and check received pages in order (any thread); stops at the first bad one.
    Returns (the page tensors before it, "" or why it stopped)."""
    core = engine.core
    bs = core.config.block_size
    key = page_key(core)
    kvs: list[torch.Tensor] = []
    for ref, data in zip(page_refs(token_ids, scope, bs, first, first + len(raw)), raw):
        try:
            page = decode_page(data, key, scope=ref.scope, chain_hash=ref.chain_hash, parent_hash=ref.parent_hash,
                               token_ids=ref.token_ids)
        except PageError as e:
            return kvs, f"page {ref.index} failed its check: {e}"
        kvs.append(page.kv)
    return kvs, ""
