"""Resumable chat-completion streams, llama-server's ``X-Conversation-Id`` feature
(docs/protocol.md, "Resumable streams").

A streamed ``POST /v1/chat/completions`` that carries ``X-Conversation-Id: <id>`` is
produced by a task of its own, not by the HTTP response: every SSE event it writes is
appended to a Redis reply stream (``gateway.store.reply_streams``, request id
``conv-<hash of scope and id>``) before it goes to the client, and the reply runs to its
end even when the client leaves. ``GET /v1/stream?conv_id=<id>&from=N`` replays the
events from byte ``N`` of the stream and follows the live ones until the reply ends (404
when there is none); ``DELETE /v1/stream?conv_id=<id>`` stops a reply still running on
this gateway and forgets the stream (204, also when there was none). A new request with
the same id replaces the old stream. The stream expires ``stream_ttl_s`` after its last
write, as the browser's reply streams do.

Scope: with an API key or a personal access token, a conversation id belongs to that
request's user; without them, to the cookie user when the request sends a cookie; a
request with no identity at all (no key configured, no cookie: a plain HTTP client)
shares one scope with all such clients, where the conversation id itself is the secret
(as in llama-server, whose only identity it is; pick an unguessable one).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

from gateway.errors import GatewayError
from gateway.store.reply_streams import ReplyStreams

log = logging.getLogger("gateway.openai")

CONVERSATION_HEADER = "x-conversation-id"
MAX_CONVERSATION_ID = 256  # characters
READ_BATCH = 256  # stream entries per read
FOLLOW_BLOCK_MS = 1000  # one blocking read's wait for live events (ms)

# produce(tee): writes a reply's SSE events, each through ``tee``
Producer = Callable[[Callable[[list[bytes]], Awaitable[None]]], Awaitable[None]]


def conversation_rid(scope: str, conv_id: str) -> str:
    """The reply-stream request id of conversation ``conv_id`` in ``scope`` (a user id, or
    "" for the shared scope): ``conv-`` and 32 hex characters."""
    return "conv-" + hashlib.blake2b(f"{scope}\0{conv_id}".encode("utf-8", "replace"), digest_size=16).hexdigest()


def valid_conversation_id(conv_id: str | None) -> bool:
    """A usable id: 1-256 printable characters."""
    return bool(conv_id) and len(conv_id or "") <= MAX_CONVERSATION_ID and (conv_id or "").isprintable()


class ResumableStreams:
    """The resumable replies this gateway produces (see module doc).

    Args:
        streams: the gateway's reply streams (Redis).
        stop_grace_s: how long ``stop`` waits for a cancelled reply to end (s).
    """

    def __init__(self, streams: ReplyStreams, stop_grace_s: float) -> None:
        self.streams = streams
        self.stop_grace_s = stop_grace_s
        self._live: dict[str, asyncio.Task[None]] = {}

    async def start(self, rid: str, scope: str, produce: Producer) -> asyncio.Queue[bytes | None]:
        """Replace conversation ``rid``'s stream with a new reply run by ``produce`` in a
        task of its own; returns the queue its events also go to, for the live client
        (None after the last).

        Raises:
            GatewayError: ``store_unavailable`` when the stream cannot be opened.
        """
        await self.stop(rid)
        await self.streams.open(rid, scope, "", "", "")
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        task = asyncio.create_task(self._run(rid, produce, queue), name=f"resumable {rid}")
        self._live[rid] = task
        task.add_done_callback(lambda t: self._live.pop(rid, None) if self._live.get(rid) is t else None)
        return queue

    async def _run(self, rid: str, produce: Producer, queue: asyncio.Queue[bytes | None]) -> None:
        seq = 0

        async def tee(frames: list[bytes]) -> None:
            nonlocal seq
            for f in frames:
                seq += 1
                await self.streams.delta(rid, seq, f.decode("utf-8", "replace"))
                queue.put_nowait(f)

        try:
            await produce(tee)
        except asyncio.CancelledError:
            raise  # stopped: the stream is being forgotten
        except GatewayError as e:  # Redis went away: the live client still gets the end
            log.warning("resumable stream %s: %s", rid, e.message)
        except Exception:
            log.exception("resumable stream %s failed", rid)
        else:
            try:
                await self.streams.done(rid, seq, {})
            except GatewayError as e:
                log.warning("resumable stream %s: %s", rid, e.message)
        finally:
            queue.put_nowait(None)

    async def stop(self, rid: str) -> bool:
        """Stop conversation ``rid``'s reply if it runs here (waits up to ``stop_grace_s``)
        and forget its stream. Returns whether a stream was there.

        Raises:
            GatewayError: ``store_unavailable``.
        """
        task = self._live.pop(rid, None)
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=self.stop_grace_s)
        existed = await self.streams.head(rid) is not None
        await self.streams.forget(rid)
        return existed or task is not None

    async def replay(self, rid: str, offset: int, emit: Callable[[bytes], Awaitable[None]]) -> None:
        """Send the stream's bytes from byte ``offset`` on, following live events until
        the reply ends or its stream is forgotten."""
        at, seq = 0, 0
        while True:
            entries = await self.streams.read(rid, seq, READ_BATCH, FOLLOW_BLOCK_MS)
            if not entries and await self.streams.head(rid) is None:
                return  # forgotten (stopped) or expired
            for e in entries:
                if e.terminal:
                    return
                if e.kind != "delta":
                    continue
                seq = e.seq
                data = e.fields.get("x", "").encode()
                if at + len(data) > offset:
                    await emit(data[max(0, offset - at):])
                at += len(data)

    async def close(self) -> None:
        """Cancel every reply still running (the gateway is stopping)."""
        tasks = list(self._live.values())
        self._live.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
