"""Which engine holds which KV page: the gateway's prefix index, fed by engines' KV events.

Each engine reports the pages its prefix cache stores and evicts, named by chained block
hashes (``engine.block_hash``; ``kv_events`` frames, docs/protocol.md). The index maps
each page hash to the set of engines holding it (a bitmask over engine slots), so
matching a prompt is one dictionary lookup per page however many engines there are:
walking the prompt's page hashes in order, an engine's match ends at the first page it
does not hold (a page's hash names its whole prefix, so holding page ``i`` without page
``i-1`` cannot happen on a live engine, and the walk would stop there anyway).

This is the event-fed global index of NVIDIA Dynamo's KV router (engines publish
"stored"/"removed" block events; the router keeps a radix index of block hashes per
worker), flattened to a hash map because chained hashes already encode the prefix.

Pages routed but not yet reported count too, for a while: when the router sends a
prompt to an engine it notes that prompt's pages there (``note_routed``) until the engine
reports them or ``routed_ttl_s`` passes, so a burst of chats opening with one document
follows the first to its engine instead of each computing the document where load sends
it (SGLang's cache-aware router likewise inserts a request's text into its tree for the
chosen worker when it routes it).

Memory is bounded: at most ``max_pages`` page hashes (least recently stored first out,
across all engines). An engine cannot report more pages than its KV pool holds, so the
bound only bites when the engines' pools together exceed it; forgetting a page then
costs a routing miss, never a wrong answer. At about 100 bytes a page (a dict entry and
two Python ints), the default 2,000,000 pages is about 200 MB.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """Page hash -> engines holding it, with a global cap.

    Args:
        max_pages: the most page hashes kept (>= 1); beyond it the oldest stored go.
            Routed-but-unreported pages are bounded by the same number, separately.
        routed_ttl_s: how long a routed page counts before its engine reports it (seconds).

    Not thread-safe: the gateway's event loop is its only user.

    Raises:
        ValueError: ``max_pages < 1``.
    """

    def __init__(self, max_pages: int = 2_000_000, routed_ttl_s: float = 30.0) -> None:
        if max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {max_pages}")
        self.max_pages = max_pages
        self.routed_ttl_s = routed_ttl_s
        # page hash -> (bitmask of engines it was routed to, monotonic expiry), oldest first
        self._routed: dict[int, tuple[int, float]] = {}
        self._owners: dict[int, int] = {}  # page hash -> bitmask of engine slots (insertion order = age)
        self._slots: dict[str, int] = {}  # engine url -> bit index
        self._counts: dict[str, int] = {}  # engine url -> pages indexed for it
        self.dropped_pages = 0  # pages forgotten because of max_pages

    def __len__(self) -> int:
        """Page hashes in the index (each counted once, however many engines hold it)."""
        return len(self._owners)

    def pages_of(self, url: str) -> int:
        """Pages indexed for engine ``url`` (0 when unknown)."""
        return self._counts.get(url, 0)

    def _slot(self, url: str) -> int:
        bit = self._slots.get(url)
        if bit is None:
            used = set(self._slots.values())
            bit = next(i for i in range(len(used) + 1) if i not in used)
            self._slots[url] = bit
            self._counts[url] = 0
        return bit

    def apply(self, url: str, stored: Iterable[int], removed: Iterable[int], reset: bool = False) -> None:
        """Record one ``kv_events`` frame of engine ``url``.

        Args:
            url: the engine.
            stored: page hashes it now holds; removed: page hashes it evicted.
            reset: ``stored`` is everything it holds (earlier pages of it are forgotten first).
        """
        if reset:
            self.forget(url)
        bit = 1 << self._slot(url)
        owners = self._owners
        count = self._counts[url]
        for h in removed:
            mask = owners.get(h)
            if mask is not None and mask & bit:
                count -= 1
                if mask == bit:
                    del owners[h]
                else:
                    owners[h] = mask & ~bit
        for h in stored:
            mask = owners.pop(h, 0)  # popped and set again: now the youngest
            if not mask & bit:
                count += 1
            owners[h] = mask | bit
        self._counts[url] = count
        if len(owners) > self.max_pages:
            self._trim()

    def _trim(self) -> None:
        owners = self._owners
        by_bit = {b: u for u, b in self._slots.items()}
        while len(owners) > self.max_pages:
            h = next(iter(owners))
            mask = owners.pop(h)
            self.dropped_pages += 1
            while mask:
                low = mask & -mask
                self._counts[by_bit[low.bit_length() - 1]] -= 1
                mask ^= low

    def note_routed(self, url: str, hashes: Sequence[int], now: float | None = None) -> None:
        """Count ``hashes`` (a prompt just sent to engine ``url``) as held there for
        ``routed_ttl_s`` seconds or until it reports them."""
        if not hashes:
            return
        now = time.monotonic() if now is None else now
        bit = 1 << self._slot(url)
        routed = self._routed
        expiry = now + self.routed_ttl_s
        for h in hashes:
            mask, _ = routed.pop(h, (0, 0.0))
            routed[h] = (mask | bit, expiry)
        while routed:  # drop what expired (oldest first) and what exceeds the bound
            h = next(iter(routed))
            if len(routed) <= self.max_pages and routed[h][1] > now:
                break
            del routed[h]

    def _held(self, h: int, now: float) -> int:
        mask = self._owners.get(h, 0)
        noted = self._routed.get(h)
        if noted is not None and noted[1] > now:
            mask |= noted[0]
        return mask

    def forget(self, url: str) -> None:
        """Drop every page of engine ``url`` (its link was lost: its cache is unknown now).
        O(pages in the index)."""
        bit_index = self._slots.pop(url, None)
        self._counts.pop(url, None)
        if bit_index is None:
            return
        bit = 1 << bit_index
        owners = self._owners
        for h in [h for h, mask in owners.items() if mask & bit]:
            mask = owners[h] & ~bit
            if mask:
                owners[h] = mask
            else:
                del owners[h]
        routed = self._routed
        for h in [h for h, (mask, _) in routed.items() if mask & bit]:
            mask, expiry = routed[h]
            if mask & ~bit:
                routed[h] = (mask & ~bit, expiry)
            else:
                del routed[h]

    def match(self, hashes: Sequence[int], urls: Iterable[str], now: float | None = None) -> dict[str, int]:
        """How many leading pages of a prompt each engine holds (or was just sent).

        Args:
            hashes: the prompt's page hashes in order (``engine.block_hash.prompt_block_hashes``).
            urls: the engines to ask about.

        Returns:
            url -> leading pages held (0 for an engine the index does not know).
        """
        out = dict.fromkeys(urls, 0)
        url_of = {self._slots[u]: u for u in out if u in self._slots}
        alive = 0
        for b in url_of:
            alive |= 1 << b
        depth = 0
        now = time.monotonic() if now is None else now
        for h in hashes:
            if not alive:
                break
            held = alive & self._held(h, now)
            gone = alive & ~held  # their match ends before this page
            while gone:
                low = gone & -gone
                out[url_of[low.bit_length() - 1]] = depth
                gone ^= low
            alive = held
            depth += 1
        while alive:  # held every page
            low = alive & -alive
            out[url_of[low.bit_length() - 1]] = depth
            alive ^= low
        return out
