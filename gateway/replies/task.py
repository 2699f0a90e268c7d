"""The reply task: one ``asyncio`` task per reply, outliving the socket that asked.

Given the chat's history (read when the turn began), it sends ``generate`` to the engine (``EngineRun``, which fails
over while nothing was produced), hands the text of each batch of engine items
(everything that arrived since the last write: one entry per engine step, or fewer) to
the reply's writer, keeps the chat's lock leased meanwhile, and ends the reply
(``gateway/replies/ending.py``). A dropped socket does not stop a reply; a cancel aborts
the engine request at once and the partial reply is stored with status "partial".
"""

from __future__ import annotations

import asyncio
import logging
import time

from engine.protocol import DoneFrame, ErrorFrame
from gateway.config import GatewayConfig
from gateway.engines.cache_scope import CacheIsolation
from gateway.engines.client import EngineRouter
from gateway.engines.run import Batch, EngineRun
from gateway.errors import GatewayError
from gateway.reasoning import without_reasoning
from gateway.replies.ending import ReplyEnding
from gateway.replies.hooks import GenerationEvents
from gateway.replies.turn import Turn
from gateway.store.sessions import History, SessionStore

log = logging.getLogger("gateway.replies.task")

ABORT_RESEND_S = 0.2  # seconds between repeated aborts until the engine confirms one
NO_IDS_TO_CONTINUE = ("this reply cannot be continued: its token ids are not stored (a reply written by an "
                      "OpenAI-compatible upstream engine has none); regenerate it with a higher max tokens instead")


class ReplyTasks:
    """Runs replies as tasks (see module doc).

    Args:
        running: this gateway's running replies by request id (shared, not copied): a
            task removes its own entry when it ends.
    """

    def __init__(self, config: GatewayConfig, store: SessionStore, router: EngineRouter,
                 isolation: CacheIsolation, events: GenerationEvents, running: dict[str, Turn]) -> None:
        self.config = config
        self.store = store
        self.router = router
        self.isolation = isolation
        self.events = events
        self.running = running
        self.ending = ReplyEnding(config, store, router, events)

    def spawn(self, turn: Turn, history: History) -> None:
        """Start ``turn``'s task on the chat ``history`` (read when the turn began) and
        list it as running."""
        rid = turn.request.rid
        self.running[rid] = turn
        turn.task = asyncio.create_task(self._run(turn, history), name=f"reply {rid}")

    async def _run(self, turn: Turn, history: History) -> None:
        req = turn.request
        rid = req.rid
        self.events.on_start(rid, req.session_id, time.perf_counter())
        lease = asyncio.create_task(self._keep_lease(turn))
        try:
            # earlier replies' reasoning stays out of the prompt (their token ids are not
            # reused either: gateway.store.sessions.plan_prefix)
            history.messages = without_reasoning(history.messages, self.config.think_markers)
            end = await self._generate(turn, history)
            await self.ending.finish(turn, history, end)
        except asyncio.CancelledError:
            raise
        except GatewayError as e:
            await self.ending.end_with_error(turn, e.code, e.message)
        except Exception:
            log.exception("reply %s failed", rid)
            await self.ending.end_with_error(turn, "internal_error", "the reply failed unexpectedly")
        finally:
            lease.cancel()
            if turn.run is not None:
                turn.run.close()
            turn.writer.ended_unexpectedly()
            self.running.pop(rid, None)

    async def _keep_lease(self, turn: Turn) -> None:
        period = self.config.lock_lease_ms / 3000
        req = turn.request
        while True:
            await asyncio.sleep(period)
            try:
                if not await self.store.renew_lease(req.owner, req.session_id, req.rid):
                    log.warning("reply %s lost its chat lock", req.rid)
            except GatewayError:
                pass  # Redis is down; the reply task itself reports it

    async def _generate(self, turn: Turn, history: History) -> DoneFrame | ErrorFrame:
        """Run the reply on an engine; returns the final engine item."""
        req = turn.request
        # browser turns clamp max_tokens to the context left, so a high per-chat
        # max_tokens never makes every turn fail; the OpenAI API keeps the strict check
        prompt_ids = _continue_ids(turn, history) if req.continued is not None else None
        run = turn.run = EngineRun(self.router, req.rid, req.session_id, history.messages,
                                   history.prefix_token_ids, req.params, req.clamp_max_tokens,
                                   prompt_token_ids=prompt_ids,
                                   continued_tokens=len(req.continued.ids) if req.continued else 0,
                                   cache_salt=self.isolation.salt(req.owner),
                                   shared_messages=self.isolation.shared_messages(history.messages),
                                   think_open=self.config.think_markers.open, model=req.model,
                                   extra=req.tools or None)
        run.cancelled = turn.cancel.requested
        # the reply's deltas go to its writer straight from the engine connection's dispatch
        # while the writer streams and no cancel is under way; the rest comes through _pump
        run.stream_to(lambda: turn.cancel.deadline is None and turn.writer.streaming,
                      lambda batch: self._take_now(turn, batch))
        await run.start()  # raises engine_unavailable when no engine is left
        if turn.cancel.requested:
            await run.abort()
        return await self._pump(turn, run)

    async def _pump(self, turn: Turn, run: EngineRun) -> DoneFrame | ErrorFrame:
        """Copy engine batches to the reply's writer until the final item.

        After a cancel the abort is re-sent every ``ABORT_RESEND_S`` until the engine
        confirms it: an abort that reaches the engine while it is still preparing the
        request (tokenizing) finds no request to stop. After ``cancel_grace_s`` without
        a confirmation the reply ends here anyway (a synthetic "abort").
        """
        last_abort = time.monotonic()
        cancel, writer, rid = turn.cancel, turn.writer, turn.request.rid
        while True:
            timeout = None
            if cancel.deadline is not None:
                now = time.monotonic()
                if now >= cancel.deadline:
                    cancel.synthetic_end = True
                    return DoneFrame(rid, finish_reason="abort")
                if now - last_abort >= ABORT_RESEND_S:
                    await run.abort()
                    last_abort = now
                timeout = min(cancel.deadline - now, ABORT_RESEND_S)
            batch = await run.next(timeout)
            if batch is None:
                continue  # re-check the deadline, re-send the abort
            text = self._take(turn, batch)
            if text:
                await writer.add(text)
                self.events.on_delta(rid, len(batch.token_ids), len(text), time.perf_counter())
            if batch.end is not None:
                return batch.end

    def _take(self, turn: Turn, batch: Batch) -> str:
        """Everything of ``batch`` but writing its text, which it returns."""
        if batch.progress is not None and not turn.produced:
            p = batch.progress
            turn.writer.log.set_progress(p.prompt_tokens_done, p.prompt_tokens, p.cached_tokens)
        turn.output_ids.extend(batch.token_ids)
        if batch.trim_prior and not turn.writer.trim_prior(batch.trim_prior):
            log.error("reply %s: the engine took back %d characters of text already streamed; kept",
                      turn.request.rid, batch.trim_prior)
        if batch.text:
            turn.reasoning.feed(batch.text)
        return batch.text

    def _take_now(self, turn: Turn, batch: Batch) -> None:
        """A delta taken in the engine connection's dispatch (``EngineRun.stream_to``)."""
        text = self._take(turn, batch)
        if text:
            turn.writer.add_nowait(text)
            self.events.on_delta(turn.request.rid, len(batch.token_ids), len(text), time.perf_counter())


def _continue_ids(turn: Turn, history: History) -> list[int]:
    """A continued reply's prompt: the chat's exact ids through its user message,
    then the reply's sampled ids (docs/protocol.md, continue).

    Raises:
        GatewayError: ``invalid_request`` when an earlier message has no token ids.
    """
    ids = history.full_ids
    if ids is None:
        raise GatewayError("invalid_request", NO_IDS_TO_CONTINUE)
    assert turn.request.continued is not None
    return ids + turn.request.continued.ids
