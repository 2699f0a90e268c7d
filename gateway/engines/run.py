"""The engine side of every reply, shared by the browser chat (``generation.py``) and the
OpenAI API (``openai_replies.py``): pick an engine, send ``generate``, merge the items
that arrived into one batch, and fail over to the next engine while nothing was produced.

``EngineRun`` reads the per-request items that ``EngineClient`` splits out of the engine's
``step`` frames; the items already waiting when the reader wakes become one ``Batch``
(one store write and one event per batch, however many steps it covers).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import DeltaFrame, DoneFrame, ErrorFrame, ProgressFrame, ReplyItem
from gateway.engines.client import EngineClient, EngineRequest, EngineRouter, RoutePrompt
from gateway.engines.disagg import prefill_engine
from gateway.engines.upstream import UpstreamError
from gateway.errors import GatewayError

log = logging.getLogger("gateway.engines.run")

# engine error codes shown to the user as they are; any other becomes internal_error
PASSTHROUGH_CODES = frozenset({"context_length_exceeded", "invalid_request", "engine_unavailable"})


def user_code(end: ErrorFrame) -> str:
    """The error code a user sees for an engine ``error`` item: ours when it is one the
    user can act on, an OpenAI-compatible upstream's own (``UpstreamError``), else
    ``internal_error``."""
    return end.code if end.code in PASSTHROUGH_CODES or isinstance(end, UpstreamError) else "internal_error"


def error_status(end: ErrorFrame) -> int:
    """The HTTP status an upstream's own error asks for (``UpstreamError.status``); 0 for
    our codes, whose status is ``gateway.errors.HTTP_STATUS``'s."""
    return end.status if isinstance(end, UpstreamError) else 0


@dataclass
class Batch:
    """What arrived for one reply since the last read: ``text`` and ``token_ids`` of its
    deltas (and of the final item), ``end``, the final item, once it came, and
    ``progress``, the newest prompt-progress item among them (transient: only the browser
    socket shows it). ``trim_prior`` (a continued reply): characters to take off the end
    of the reply's earlier text before ``text`` (docs/protocol.md, continuing a cut reply).
    ``logprobs``, ``tool_calls``, ``prompt_logprobs``: the items' entries of those
    (protocol 7; the HTTP APIs' requests that ask for them). ``prompt_usage``: the
    prompt's ``prompt_tokens`` and ``cached_tokens``, from the reply's first delta."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    end: DoneFrame | ErrorFrame | None = None
    progress: ProgressFrame | None = None
    trim_prior: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any]] | None = None
    prompt_usage: dict[str, int] | None = None


class EngineRun:
    """One reply's generation on the router's engines.

    Args:
        router: the gateway's engines.
        request_id: the engine request id (unique on this gateway).
        affinity_key: picks the engine (the chat's cache home unless overloaded: ``gateway/engines/routing.py``).
        messages, prefix_token_ids, params, clamp_max_tokens: the ``generate`` frame's fields.
        model: only engines serving this model name, or None for any.
        prompt_token_ids: the exact prompt ids instead of ``messages`` (a continued reply).
        continued_tokens: of those, the last that many are the reply being continued.
        cache_salt, shared_messages: where its KV pages live in the engines' prefix cache
            (its user's salt and the leading messages declared shared:
            ``gateway/engines/cache_scope.py``).
        extra: protocol 7's ``generate`` fields (a raw ``prompt``, ``tools``, ...; the
            HTTP APIs' requests), passed as they are.
        think_open: the opening reasoning marker, put in front of the reply's first text
            when the engine's generation prompt already opened the reasoning (its hello's
            ``think_in_prompt``), so the text says where its reasoning is
            (``gateway/reasoning.py``); not for a prompt of token ids (a continued
            reply's text already has it) or a raw ``prompt`` or a continued final message.
    """

    def __init__(self, router: EngineRouter, request_id: str, affinity_key: str, messages: list[dict[str, str]],
                 prefix_token_ids: list[int] | None = None, params: dict[str, Any] | None = None,
                 clamp_max_tokens: bool = False, model: str | None = None,
                 prompt_token_ids: list[int] | None = None, continued_tokens: int = 0, cache_salt: str = "",
                 shared_messages: list[dict[str, str]] | None = None, extra: dict[str, Any] | None = None,
                 think_open: str = "<think>") -> None:
        self.router = router
        self.extra = extra or None
        self.request_id = request_id
        self.affinity_key = affinity_key
        self.messages = messages
        self.prefix_token_ids = prefix_token_ids
        self.prompt_token_ids = prompt_token_ids
        self.continued_tokens = continued_tokens
        self.params = params
        self.clamp_max_tokens = clamp_max_tokens
        self.model = model
        self.cache_salt = cache_salt
        self.shared_messages = shared_messages
        self.think_open = think_open
        self._think_prefix = ""  # the marker still to put in front of the first text
        self.engine: EngineClient | None = None
        self.request: EngineRequest | None = None
        self.produced = False  # any text or token came (no fail-over after that)
        self.cancelled = False  # the owner aborted it (no fail-over either)
        self._tried: list[EngineClient] = []
        self._accepts: Callable[[], bool] | None = None  # ``stream_to``'s
        self._take: Callable[[Batch], None] | None = None

    def stream_to(self, accepts: Callable[[], bool], take: Callable[[Batch], None]) -> None:
        """Hand each ``delta`` item to ``take`` as a batch of its own the moment it arrives
        (in the engine connection's dispatch: no task step per item) while ``accepts()``
        says so; every other item (progress, the final one) and the deltas refused or
        arriving behind a queued item are read with ``next`` as before. ``take`` must not
        block or raise; an exception in it ends the reply with ``internal_error``."""
        self._accepts, self._take = accepts, take
        if self.request is not None:
            self.request.sink = self._sink

    def _sink(self, item: ReplyItem) -> bool:
        if type(item) is not DeltaFrame or self._take is None or self._accepts is None or not self._accepts():
            return False
        try:
            self._take(self._sealed(*self._merge([item])))
        except Exception:
            log.exception("reply %s: taking an engine delta failed", self.request_id)
            if self.request is not None:
                self.request.queue.put_nowait(ErrorFrame("internal_error", "the reply failed unexpectedly",
                                                         self.request_id))
        return True

    async def route_prompt(self) -> RoutePrompt | None:
        """What the router may know of this prompt: its exact ids (a continued reply, or
        computed by the router's tokenizer), else the chat's ids so far (a later turn),
        nothing yet (a new chat); None for a chat with history but no ids (it goes to
        its home). Its page hashes are those of its cache scope; without the engines'
        tokenizer the shared part's length is unknown, and a salted prompt is hashed as if
        it shared nothing (so it matches an engine's pages only when its chat declares
        less than a page shared)."""
        tokenizer = self.router.prompt_tokenizer()

        def routed(ids: list[int], num_tokens: int) -> RoutePrompt:
            shared = 0
            if tokenizer is not None and self.cache_salt and ids:
                try:
                    shared = tokenizer.builder.shared_length(ids, self.shared_messages)
                except Exception:  # noqa: BLE001 - routing only: the engine says what is wrong
                    shared = 0
            return RoutePrompt(ids, num_tokens, self.cache_salt, shared)

        if self.prompt_token_ids is not None:
            return routed(self.prompt_token_ids, len(self.prompt_token_ids))
        if tokenizer is not None and self.messages:
            try:
                ids = await tokenizer.prompt_ids_async(self.messages, self.prefix_token_ids)
                return routed(ids, len(ids))
            except Exception:  # noqa: BLE001 - a chat the template rejects: the engine says why
                pass
        new_chars = len(self.messages[-1].get("content") or "") if self.messages else 0
        if self.prefix_token_ids:
            return routed(self.prefix_token_ids, len(self.prefix_token_ids) + estimate_tokens(new_chars))
        if not any(m.get("role") == "assistant" for m in self.messages):
            return routed([], estimate_tokens(sum(len(m.get("content") or "") for m in self.messages)))
        return None

    def _excluded(self) -> Iterable[EngineClient]:
        # another model than asked for; and for a prompt of token ids (a continued reply),
        # an engine that takes text only (an OpenAI-compatible upstream)
        others = [c for c in self.router.clients
                  if (self.model is not None and (c.info is None or c.info.model != self.model))
                  or (self.prompt_token_ids is not None and not c.takes_token_ids)]
        return self._tried + others

    async def start(self) -> None:
        """Send ``generate`` to the best healthy engine not tried yet (the next one when
        an engine drops between the pick and the send).

        Raises:
            GatewayError: ``engine_unavailable`` when no engine is left.
        """
        prompt = await self.route_prompt() if self.router.prefix_routing else None
        while True:
            engine = await self.router.choose(self.affinity_key, exclude=self._excluded(), prompt=prompt)
            self._tried.append(engine)
            self.engine = engine
            extra = self.extra or {}
            opens = (engine.info is not None and engine.info.think_in_prompt and self.prompt_token_ids is None
                     and not extra.get("prompt") and not extra.get("continue_final_message"))
            self._think_prefix = self.think_open if opens else ""
            try:
                scope: dict[str, Any] = {"cache_salt": self.cache_salt, "shared_messages": self.shared_messages,
                                         "extra": self.extra}
                prefill = prefill_engine(self.router, engine, self.affinity_key, prompt)
                if prefill is not None:  # prefill there, then decode here (gateway/engines/disagg.py)
                    scope["prefill"] = prefill
                if self.prompt_token_ids is not None:
                    self.request = await engine.generate(self.request_id, params=self.params,
                                                         prompt_token_ids=self.prompt_token_ids,
                                                         clamp_max_tokens=self.clamp_max_tokens,
                                                         continued_tokens=self.continued_tokens, **scope)
                else:
                    self.request = await engine.generate(self.request_id, self.messages or None,
                                                         self.prefix_token_ids,
                                                         self.params, clamp_max_tokens=self.clamp_max_tokens,
                                                         **scope)
                if self._take is not None:
                    self.request.sink = self._sink
                return
            except GatewayError as e:
                if e.code != "engine_unavailable" or self.cancelled:
                    raise

    async def next(self, timeout: float | None = None) -> Batch | None:
        """The next batch (waits for at least one item); None after ``timeout`` seconds
        or a ``wake``. A link lost before anything was produced moves the request to the
        next engine (an empty batch is returned meanwhile); a link lost later, or with no
        engine left, ends the batch with its ``engine_unavailable`` error."""
        req = self.request
        assert req is not None, "start() first"
        try:
            first = await req.next(timeout)
        except asyncio.TimeoutError:
            return None
        items = req.ready()
        if first is not None:
            items.insert(0, first)
        elif not items:
            return None
        batch, any_text = self._merge(items)
        end = batch.end
        retry = isinstance(end, ErrorFrame) and (end.code == "engine_unavailable" or (
            isinstance(end, UpstreamError) and end.retry_elsewhere))
        if retry and not self.produced and not any_text and not batch.token_ids and not self.cancelled:
            req.close()
            try:
                await self.start()
                return Batch()
            except GatewayError:
                pass  # nothing left: report this engine's error
        return self._sealed(batch, any_text)

    @staticmethod
    def _merge(items: list[ReplyItem]) -> tuple[Batch, bool]:
        """The items that arrived, as one batch (up to and including the final item), and
        whether any of them was a ``delta`` or ``done`` (text, even empty, came)."""
        text: list[str] = []
        ids: list[int] = []
        trim = 0
        logprobs: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        prompt_logprobs: list[dict[str, Any]] | None = None
        prompt_usage: dict[str, int] | None = None
        end: DoneFrame | ErrorFrame | None = None
        progress: ProgressFrame | None = None
        for it in items:
            if isinstance(it, ProgressFrame):
                progress = it
                continue
            if isinstance(it, (DeltaFrame, DoneFrame)):
                if it.trim_prior:  # only ever before the reply's first text: it trims the earlier text
                    trim += it.trim_prior
                text.append(it.text)
                ids.extend(it.token_ids)
                logprobs.extend(it.logprobs or ())
                calls.extend(it.tool_calls or ())
                if it.prompt_logprobs:
                    prompt_logprobs = it.prompt_logprobs
                if isinstance(it, DeltaFrame) and it.usage is not None:
                    prompt_usage = {"prompt_tokens": it.usage.prompt_tokens, "cached_tokens": it.usage.cached_tokens}
            if isinstance(it, (DoneFrame, ErrorFrame)):
                end = it
                break
        return (Batch("".join(text), ids, end, progress, trim, logprobs, calls, prompt_logprobs, prompt_usage),
                bool(text))

    def _sealed(self, batch: Batch, any_text: bool) -> Batch:
        """``batch`` as the reply's: it counts as produced once text (even empty), a
        token or a call came, and its first text gets the opening reasoning marker when
        the prompt opened the reasoning."""
        if any_text or batch.token_ids or batch.tool_calls:
            self.produced = True
        if batch.text and self._think_prefix:
            batch.text, self._think_prefix = self._think_prefix + batch.text, ""
        return batch

    def wake(self) -> None:
        """Make a waiting ``next`` return None now."""
        if self.request is not None:
            self.request.wake()

    async def abort(self) -> None:
        """Ask the engine to stop (it answers with ``done``, finish_reason "abort")."""
        self.cancelled = True
        if self.request is not None:
            await self.request.abort()

    def close(self) -> None:
        """Release the request id (aborting it in the engine if it has not ended) and drop
        ``stream_to``'s callbacks: they refer back to the reply (its turn, its writer),
        and the request refers to this run through its sink, so left in place the whole
        reply (its text, entries and frames) would wait for a full garbage collection, a
        stall of the loop (docs/benchmarks.md, "Where the tail comes from"), instead of
        being freed when its last owner drops it."""
        if self.request is not None:
            self.request.sink = None
            self.request.close()
        self._accepts = self._take = None


def estimate_tokens(chars: int) -> int:
    """A prompt part's length in tokens from its characters, for routing only: about 4
    characters a token in English BPE vocabularies, plus a few template tokens."""
    return chars // 4 + 8
