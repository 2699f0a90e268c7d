"""Prefill/decode disaggregation, the gateway's part: a turn goes first to a prefill
engine, which computes its prompt's KV, then to a decode engine, which pulls the pages
it lacks from there (``engine.disagg``) and streams the reply (docs/scaling.md).

Roles are the engines' own (``--role``, announced in their ``hello``): ``ENGINE_URLS``
lists every engine, each says whether it is a ``prefill``, ``decode`` or ``both``
engine. The router never sends a reply to a prefill engine; when it picks a decode
engine, ``prefill_engine`` names the prefill engine for the turn (by cache and load, as
``choose_cache_aware`` weighs them), or None when the decode engine should prefill
itself: no prefill engine is up, or the decode engine already holds all but
``RoutingPolicy.local_prefill_tokens`` of the prompt (a chat's next turn whose new
message is short; moving it would cost more than computing it).

A chat's later turn whose new part is long goes through the prefill engine too, but
the earlier turns' KV (the previous reply above all, which only the decode engine
computed) is not computed again: the prefill engine's ``generate`` names the decode
engine as its ``kv_source`` (``PrefillPlan.pull_from_decode``), so it first pulls the
pages it lacks from there and prefills only the rest; the decode engine then pulls only
the pages of the new part. Each side moves and computes only what the other lacks.

``PrefillThenDecode`` is the request handle of such a turn: it reads as one request on
the decode engine (``EngineRequest``), so the reply path, Stop, fail-over and the
browser and OpenAI APIs see no difference. Its first phase runs on the prefill engine
(its prompt-progress items pass through), its second is the decode engine's ``generate``
with ``kv_source`` set. A prefill engine that fails or drops sends the turn to the decode
engine as it is (it prefills locally); a request the prefill engine refuses (too long,
invalid) ends with that error, which the decode engine would give too.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.protocol import DoneFrame, ErrorFrame, GenerateFrame, ProgressFrame, Timings, Usage, encode
from gateway.config import BIG_FRAME_CHARS
from gateway.engines.routing import choose_cache_aware
from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.engines.client import EngineClient, EngineRouter, RoutePrompt

log = logging.getLogger("gateway.engines.disagg")

__all__ = ["PrefillPlan", "PrefillThenDecode", "prefill_engine"]

# the generate fields EngineClient.generate takes as ``extra`` (protocol 7)
EXTRA_FIELDS = ("prompt", "tools", "tool_choice", "parallel_tool_calls", "continue_final_message")
# a refusal the decode engine would give as well: the turn ends with it
REFUSALS = frozenset({"invalid_request", "context_length_exceeded"})


def _role(c: EngineClient) -> str:
    return c.info.role if c.info is not None else ""


@dataclass(frozen=True)
class PrefillPlan:
    """Where a turn's prompt is prefilled before its decode engine gets it.

    Attributes:
        engine: the prefill engine.
        pull_from_decode: the decode engine may hold pages of the prompt the prefill
            engine lacks (a chat's earlier turns and replies): the prefill engine pulls
            them from there before it prefills the rest (module doc). False when the
            router's prefix index says the decode engine holds no more of the prompt
            than the prefill engine (a new chat): no round trip is spent asking.
    """

    engine: EngineClient
    pull_from_decode: bool = False


def prefill_engine(router: EngineRouter, decode: EngineClient, key: str,
                   prompt: RoutePrompt | None) -> PrefillPlan | None:
    """The prefill engine for a turn that ``decode`` will serve, or None (module doc).

    Args:
        router: the gateway's engines (their health, loads and prefix index).
        decode: the engine the router chose for the reply.
        key: the chat id (ties between prefill engines go to its rendezvous choice).
        prompt: what the router knows of the prompt (None: a chat with history whose
            ids the gateway does not know).
    """
    info = decode.info
    if info is None or info.role != "decode":
        return None
    prefill = [c for c in router.clients if c.healthy and _role(c) == "prefill" and c.info is not None
               and c.info.weights_id == info.weights_id and c.info.block_size == info.block_size]
    if not prefill:
        return None
    num_tokens = prompt.num_tokens if prompt is not None else 0
    matched: dict[str, int] = {}
    if prompt is not None and prompt.token_ids:
        matched, _ = router.matched_tokens(prompt, [decode, *prefill])
        if num_tokens - matched.get(decode.url, 0) <= router.policy.local_prefill_tokens:
            return None
    loads = [replace(e, matched_tokens=matched.get(e.url, 0)) for e in router.loads(prefill)]
    url = choose_cache_aware(key, loads, max(1, num_tokens), router.policy)
    chosen = next(c for c in prefill if c.url == url)
    # unknown ids (None): ask; the decode engine answers with what it holds, maybe nothing
    pull = prompt is None or matched.get(decode.url, 0) > matched.get(url, 0)
    return PrefillPlan(chosen, pull)


class PrefillThenDecode:
    """Runs a turn's two phases behind one ``EngineRequest`` of the decode engine
    (``decode``'s handle ``handle``; module doc). Built by ``EngineClient.generate``."""

    def __init__(self, handle: Any, plan: PrefillPlan, frame: GenerateFrame) -> None:
        self.handle = handle
        self.prefill = plan.engine
        self.pull_from = handle.client.url if plan.pull_from_decode else None
        self.frame = frame
        self.decode_sent = False
        self.task: asyncio.Task[None] = asyncio.get_running_loop().create_task(
            self._run(), name=f"prefill {frame.request_id}")

    async def _run(self) -> None:
        f, handle = self.frame, self.handle
        source: str | None = self.prefill.url
        try:
            extra = {k: getattr(f, k) for k in EXTRA_FIELDS if getattr(f, k) not in (None, False)}
            if self.pull_from is not None:  # the earlier turns' pages come from the decode engine
                extra["kv_source"] = self.pull_from
            pre = await self.prefill.generate(
                f.request_id, f.messages, f.prefix_token_ids, dict(f.params or {}, max_tokens=1),
                prompt_token_ids=f.prompt_token_ids, cache_salt=f.cache_salt, clamp_max_tokens=f.clamp_max_tokens,
                continued_tokens=f.continued_tokens, shared_messages=f.shared_messages, extra=extra or None)
        except GatewayError as e:
            log.info("prefill engine %s unavailable (%s); %s prefills itself", self.prefill.url, e, f.request_id)
            source = None
        else:
            try:
                while True:
                    item = await pre.next()
                    if isinstance(item, ProgressFrame):
                        handle.queue.put_nowait(item)
                    elif isinstance(item, DoneFrame):
                        if item.finish_reason == "error":
                            source = None
                        break
                    elif isinstance(item, ErrorFrame):
                        if item.code in REFUSALS:
                            handle.queue.put_nowait(item)
                            return
                        log.info("prefill of %s failed on %s (%s: %s); the decode engine prefills it",
                                 f.request_id, self.prefill.url, item.code, item.message)
                        source = None
                        break
            finally:
                pre.close()
        frame = replace(f, kv_source=source)
        try:
            text = await asyncio.to_thread(encode, frame) if _big(frame) else encode(frame)
            self.decode_sent = True
            await handle.client._send_text(text)
        except GatewayError as e:
            handle.queue.put_nowait(ErrorFrame(e.code, e.message, f.request_id))

    async def abort(self) -> None:
        """Stop the turn: cancel the prefill phase (which aborts it on the prefill engine)
        and, once the decode engine has it, abort it there; a turn stopped before the
        decode engine got it ends here with finish_reason "abort"."""
        if not self.task.done():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.decode_sent:
            await self.handle.client.abort(self.frame.request_id)
        elif not self.handle.ended:
            self.handle.queue.put_nowait(DoneFrame(self.frame.request_id, finish_reason="abort", usage=Usage(),
                                                   timings=Timings()))

    def cancel(self) -> None:
        """Stop the prefill phase now (from synchronous code: the handle was closed)."""
        if not self.task.done():
            self.task.cancel()


def _big(frame: GenerateFrame) -> bool:
    """A frame worth encoding off the event loop (as ``EngineClient.generate`` does)."""
    size = sum(len(str(m.get("content", ""))) for m in frame.messages or []) + 8 * len(frame.prefix_token_ids or [])
    return size > BIG_FRAME_CHARS
