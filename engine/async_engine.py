"""The asyncio face of the engine: the step loop runs on a thread other than the
event loop's (its own via ``start()``, or the caller's via ``run_step_loop()``).

``generate`` builds the prompt off the event loop (chat templates and
tokenization are CPU-heavy), hands the request to the step thread, and yields
``RequestOutput`` items as the thread produces them. Leaving the ``async for``
early (or cancelling the task) aborts the request, which frees its KV blocks
within one step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import Decoding, EngineCore
from engine.errors import EngineError, InvalidRequestError, InvariantError
from engine.outputs import GenerateRequest, RequestOutput, Timings, Usage
from engine.prompt import PromptBuilder
from engine.protocol import EngineInfo
from engine.sampling_params import SamplingParams
from engine.tiers.manager import STOP_FLUSH_S

log = logging.getLogger(__name__)

IDLE_WRITE_POLL_S = 0.02  # write-idle: how soon an idle step loop writes the next batch of pages (s)


@dataclasses.dataclass
class _Add:
    """Inbox: start a request whose prompt is built (``EngineCore.add_request``'s arguments)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str
    prefix_reused: bool
    arrival_s: float
    continued_tokens: int
    detok: IncrementalDetokenizer | None
    shared_tokens: int
    decoding: Decoding | None


@dataclasses.dataclass
class _Abort:
    """Inbox: abort a request."""

    request_id: str


@dataclasses.dataclass
class _Call:
    """Inbox: run ``fn(core, *args)`` between two steps and settle ``future`` with its result."""

    future: Future[Any]
    fn: Callable[..., Any]
    args: tuple[Any, ...]


_InboxItem = _Add | _Abort | _Call


class AsyncEngine:
    """Runs an ``EngineCore``'s step loop off the event loop and serves asyncio callers.

    Use ``AsyncEngine.from_config(cfg)`` to load a model, then ``start()`` (a step
    thread) or ``run_step_loop()`` (the calling thread, e.g. the main one);
    ``shutdown()`` stops the loop.
    """

    def __init__(self, core: EngineCore, info: EngineInfo, prompt_builder: PromptBuilder) -> None:
        self.core = core
        self.info = info
        self.prompts = prompt_builder
        self._inbox: queue.SimpleQueue[_InboxItem] = queue.SimpleQueue()
        self._wake = threading.Event()
        if core.tiers is not None:
            core.tiers.wake = self._wake.set  # a finished restore wakes an idle step loop
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._cancelled: set[str] = set()  # aborted while their stream is registered
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False  # the step loop has ended for good (set under _lock)
        self._prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prompt")
        self.last_error: str | None = None
        # KV pulls of prefill/decode disaggregation (engine.disagg.pull), under _lock
        self._pulls = {"kv_pulls_total": 0, "kv_pull_failures_total": 0, "kv_pull_pages_total": 0,
                       "kv_pull_bytes_total": 0, "kv_pull_ms_total": 0.0}
        # (counters, monotonic time): replaced whole by the step thread at the end of each
        # step and after each inbox drain; read by any thread without waiting for a step
        self._snapshot: tuple[dict, float] = (self._take_stats(), time.monotonic())
        # KV events: the page hashes cached now (the step thread's view after its last
        # publish) and who hears of changes; both under _kv_lock
        self._kv_lock = threading.Lock()
        self._kv_cached: set[int] = set()
        self._kv_listeners: dict[int, tuple[asyncio.AbstractEventLoop, Callable[[list[int], list[int]], None]]] = {}
        self._kv_ids = itertools.count()

    # ----- construction -------------------------------------------------------------
    @classmethod
    def from_config(cls, config: EngineConfig, verbose: bool = True) -> AsyncEngine:
        """Load the model named by ``config.model``, then ``from_loaded``.

        Raises:
            ModelLoadError: unknown path, unsupported architecture, missing tensors.
        """
        from engine.loader import load_model

        if config.threads:
            torch.set_num_threads(config.threads)
        return cls.from_loaded(load_model(config), config, verbose)

    @classmethod
    def from_loaded(cls, loaded, config: EngineConfig, verbose: bool = True) -> AsyncEngine:
        """Size and allocate the KV cache for a loaded model (``engine.loader.LoadedModel``)
        and build the engine (not started). Logs what it sized when ``verbose``."""
        from engine.formats import resolved_config
        from engine.kv_cache import KVCache, plan_kv_blocks

        config, fmt = resolved_config(config)
        device = torch.device(loaded.device)
        mc = loaded.model_config
        max_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        plan = plan_kv_blocks(mc, config, device)
        kv = KVCache.allocate(mc, plan.num_blocks, config.block_size, config.kv_torch_dtype, device)
        if verbose:
            log.info("%s; %s; max context %d tokens", fmt.describe(), plan.describe(), max_len)
        core = EngineCore(model=loaded.model, model_config=mc, kv=kv, tokenizer=loaded.tokenizer,
                          config=config, num_blocks=plan.num_blocks, max_model_len=max_len,
                          namespace=loaded.weights_id, device=device, cpu_kernels=loaded.cpu_kernels)
        info = EngineInfo(model=loaded.name, max_model_len=max_len, block_size=config.block_size,
                          num_blocks=plan.num_blocks, dtype=config.dtype, device=str(device),
                          weights_id=loaded.weights_id, eos_token_ids=sorted(core.eos_ids),
                          quantization=config.quantization, kv_cache_dtype=config.kv_cache_dtype,
                          format=fmt.describe(), tokenizer_dir=str(Path(loaded.path).resolve()),
                          tool_format=core.tool_format.name, role=config.role)
        prompts = PromptBuilder(loaded.tokenizer, mc.vocab_size)
        info.think_markers, info.think_in_prompt = prompts.thinking()
        if verbose:
            for warning in prompts.lint_template():
                log.warning("%s", warning)
        return cls(core, info, prompts)

    # ----- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the step thread (idempotent). For a process that only serves, prefer
        ``run_step_loop`` on the main thread (see there)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
            self._thread.start()

    def run_step_loop(self) -> None:
        """Run the step loop in the calling thread until ``shutdown`` (from another thread).

        Call it from the process's main thread, with the asyncio loop that calls
        ``generate`` on another thread (``engine.server.serve_forever``): measured on 2 cores
        with 2 torch threads, the same int8 SmolLM2 decode step took 20 ms on the main
        thread and 34 ms on a second thread (OpenMP regions started from a non-main
        thread ran slower there; with 1 torch thread there was no difference), which
        made a single stream's TPOT 20 ms instead of 42 ms.
        """
        self._loop()

    def request_stop(self) -> None:
        """Ask the step loop to stop after its current step (live requests then end with
        finish_reason "abort", as on ``shutdown``). Safe in a signal handler: it only sets a
        flag (no lock, no wake-up); an idle loop sees it within its idle wait (0.5 s)."""
        self._stop = True

    def shutdown(self) -> None:
        """Stop the step loop (its thread, or ``run_step_loop``'s caller returns); live
        requests end with finish_reason "abort"."""
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10 + STOP_FLUSH_S)  # write-idle writes the cache at stop
            self._thread = None
        self._prep.shutdown(wait=False, cancel_futures=True)

    # ----- public API -------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield deltas, then one final output (``finished`` True).

        Raises (before any work is queued):
            InvalidRequestError: bad messages/ids/params, duplicate request id.
            ContextLengthError: the prompt cannot fit the context or the KV pool.
        """
        loop = asyncio.get_running_loop()
        arrival = time.monotonic()
        q: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        # Registered before the prompt is built, so an abort during tokenization is not lost.
        with self._lock:
            if rid in self._streams:
                raise InvalidRequestError(f"request id {rid!r} is already running", "duplicate_request_id")
            self._streams[rid] = (loop, q)
        finished = False
        try:
            try:
                ids, reused, shared, decoding = await loop.run_in_executor(self._prep, self._build, request)
            except asyncio.CancelledError:
                if not self._stop:
                    raise
                finished = True  # the engine stopped while the prompt waited to be built
                yield _aborted_before_start(rid, [], False, arrival)
                return
            params = request.params
            room = self.core.max_model_len - len(ids)
            if request.clamp_max_tokens and 1 <= room < params.max_tokens:
                params = dataclasses.replace(params, max_tokens=room)
            if self.core.config.role == "prefill":  # computes the prompt's KV and its first token only
                params = dataclasses.replace(params, max_tokens=1)
            self.core.check_fits(len(ids), params)
            if request.kv_source:  # pages from the engine that has them (engine.disagg.pull)
                from engine.disagg.pull import pull_prompt

                await pull_prompt(self, ids, request.kv_source, request.cache_salt, shared)
            detok = None
            if request.continued_tokens:  # replay the continued reply's tokens off the step thread
                detok = await loop.run_in_executor(self._prep, self.core.continuation_detokenizer, ids,
                                                   request.continued_tokens, params)
            with self._lock:
                aborted_early = rid in self._cancelled
            if aborted_early:
                finished = True
                yield _aborted_before_start(rid, ids, reused, arrival)
                return
            with self._lock:  # against _loop's last drain: added before it, or aborted here
                closed = self._closed
                if not closed:
                    self._inbox.put(_Add(rid, ids, params, request.cache_salt, reused, arrival,
                                         request.continued_tokens, detok, shared, decoding))
            if closed:
                finished = True
                yield _aborted_before_start(rid, ids, reused, arrival)
                return
            self._wake.set()
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(rid)
            with self._lock:
                self._streams.pop(rid, None)
                self._cancelled.discard(rid)

    def _build(self, request: GenerateRequest) -> tuple[list[int], bool, int, Decoding]:
        """On a prompt thread: the prompt ids, whether ``prefix_token_ids`` were reused, how
        many leading tokens are declared shared (0 without a cache salt: everything is
        shared then), and the request's compiled constraint and tool stream (grammars
        compile here, never on the step loop)."""
        self.core.check_params(request.params)
        if request.params.logprobs is not None or request.params.prompt_logprobs is not None:
            self.core.vocab.warm()  # the server names the tokens of logprobs on its event loop
        ids, reused = self.prompts.build(request)
        shared = self.prompts.shared_length(ids, request.shared_messages) if request.cache_salt else 0
        return ids, reused, shared, self.core.prepare_decoding(request.params, request.tools)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished). A request still being
        tokenized or queued for the step thread never starts; a running one is freed
        before the next step."""
        with self._lock:
            if request_id in self._streams:
                self._cancelled.add(request_id)
        self._inbox.put(_Abort(request_id))
        self._wake.set()

    def snapshot(self) -> tuple[dict, float]:
        """The engine's counters as the step thread last saw them, and their age (seconds).

        Taken at the end of every step and after every batch of submissions and aborts,
        so reading it never waits for a step, however long (a 4,000-token prefill). A
        caller that saw a request's final output sees counters at least that new.
        """
        stats, at = self._snapshot
        return stats, max(0.0, time.monotonic() - at)

    async def stats(self) -> dict:
        """The counters of ``snapshot`` (a consistent view taken between two steps)."""
        return dict(self.snapshot()[0])

    def _take_stats(self) -> dict:
        s = self.core.stats()
        s["model"] = self.info.model
        s["role"] = self.core.config.role
        with self._lock:
            s.update(self._pulls)
        return s

    def count_pull(self, result: Any) -> None:
        """Count one pull of pages (``engine.disagg.pull.PullResult``) in the stats: pulls
        that asked for pages, those that fell short, pages adopted, bytes received, ms."""
        if not result.pages_wanted:
            return
        with self._lock:
            p = self._pulls
            p["kv_pulls_total"] += 1
            p["kv_pull_failures_total"] += 1 if result.error else 0
            p["kv_pull_pages_total"] += result.pages_adopted
            p["kv_pull_bytes_total"] += result.bytes
            p["kv_pull_ms_total"] = round(p["kv_pull_ms_total"] + result.ms, 3)

    def _publish_stats(self) -> None:
        self._snapshot = (self._take_stats(), time.monotonic())
        self._publish_kv_events()

    # ----- KV events --------------------------------------------------------------------
    def subscribe_kv_events(self, listener: Callable[[list[int], list[int]], None]
                            ) -> tuple[list[int], Callable[[], None]]:
        """Hear of the pages the prefix cache stores and evicts (``engine.block_hash``).

        Call on the event loop that should run ``listener(stored, removed)`` (once per
        step that changed the cache, in order). Returns the hashes of every page cached
        now and a function that ends the subscription. A change published just before
        the subscription may also reach the listener; applied in order after the
        returned snapshot, it leaves the same set.
        """
        loop = asyncio.get_running_loop()
        with self._kv_lock:
            key = next(self._kv_ids)
            self._kv_listeners[key] = (loop, listener)
            snapshot = list(self._kv_cached)

        def unsubscribe() -> None:
            with self._kv_lock:
                self._kv_listeners.pop(key, None)

        return snapshot, unsubscribe

    def _publish_kv_events(self) -> None:
        stored, removed = self.core.cache.take_events()
        if not stored and not removed:
            return
        with self._kv_lock:
            self._kv_cached.difference_update(removed)
            self._kv_cached.update(stored)
            listeners = list(self._kv_listeners.values())
        for loop, listener in listeners:
            try:
                loop.call_soon_threadsafe(listener, stored, removed)
            except RuntimeError:  # the listener's loop is closed
                pass

    async def call(self, fn, *args):
        """Run ``fn(core, *args)`` on the step thread between two steps (tests, admin)."""
        fut: Future = Future()
        self._inbox.put(_Call(fut, fn, args))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    # ----- the step thread ------------------------------------------------------------
    def _deliver(self, out: RequestOutput | BaseException, rid: str) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is None:
            return
        loop, q = target
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed
            pass

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand one step's outputs over with one callback per event loop, so that the
        callers of a loop all wake in the same iteration (the server then sends them
        as one frame per connection)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _drain_inbox(self) -> None:
        if self._inbox.empty():
            return
        replies: list[tuple[RequestOutput | BaseException, str]] = []
        try:
            self._drain_inbox_items(replies)
        finally:
            self._publish_stats()  # before the replies: whoever sees an abort's output sees its counters
            for out, rid in replies:
                self._deliver(out, rid)

    def _take_inbox(self) -> Iterator[_InboxItem]:
        """The inbox's items, oldest first, until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox_items(self, replies: list[tuple[RequestOutput | BaseException, str]]) -> None:
        for item in self._take_inbox():
            if isinstance(item, _Add):
                rid = item.request_id
                with self._lock:
                    alive = rid in self._streams
                    cancelled = rid in self._cancelled
                if not alive:
                    continue  # the caller left before we started it
                if cancelled:  # aborted between submission and now
                    replies.append((_aborted_before_start(rid, item.prompt_ids, item.prefix_reused,
                                                          item.arrival_s), rid))
                    continue
                try:
                    self.core.add_request(rid, item.prompt_ids, item.params, item.cache_salt, item.prefix_reused,
                                          item.arrival_s, item.continued_tokens, item.detok,
                                          shared_tokens=item.shared_tokens, decoding=item.decoding)
                except EngineError as e:
                    replies.append((e, rid))
                except Exception as e:  # a bug must reach the caller as an error, not a hang
                    log.exception("adding request %s failed", rid)
                    replies.append((EngineError(f"could not start the request: {type(e).__name__}"), rid))
            elif isinstance(item, _Abort):
                out = self.core.abort(item.request_id)
                if out is not None:
                    replies.append((out, item.request_id))
            else:
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn(self.core, *item.args))
                    except BaseException as e:  # hand it to the caller
                        item.future.set_exception(e)

    def _loop(self) -> None:
        try:
            self._steps()
        finally:  # also on KeyboardInterrupt in run_step_loop: every caller hears back
            for rid in list(self.core.requests):
                try:
                    out = self.core.abort(rid)
                except Exception:  # a step cut short mid-way (a second Ctrl-C): still answer
                    log.exception("abort at stop")
                    out = _aborted_before_start(rid, [], False, time.monotonic())
                if out is not None:
                    self._deliver(out, rid)
            with self._lock:
                self._closed = True  # generate() aborts what it would add from now on
            self._abort_inbox()
            self.core.close()  # the KV tiers write what they have queued

    def _abort_inbox(self) -> None:
        """After the last step: requests submitted but never added end with ``abort``."""
        for item in self._take_inbox():
            if isinstance(item, _Add):
                self._deliver(_aborted_before_start(item.request_id, item.prompt_ids, item.prefix_reused,
                                                    item.arrival_s), item.request_id)
            elif isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(RuntimeError("the engine has stopped"))

    def _steps(self) -> None:
        was_busy = False
        while not self._stop:
            self._drain_inbox()
            if not self.core.has_work():
                if was_busy:
                    was_busy = False
                    try:
                        self.core.check_invariants()
                    except InvariantError as e:  # counted and logged by the core; keep serving
                        self.last_error = str(e)
                # write-idle: some of the tree's pages go to disk; a request arriving
                # (the wake event) stops it at the next page
                more = self.core.write_idle(self._wake.is_set)
                if not self._wake.wait(timeout=IDLE_WRITE_POLL_S if more else 0.5):
                    self._publish_stats()  # idle: keep the snapshot's age honest
                self._wake.clear()
                continue
            was_busy = True
            try:
                outputs = self.core.step()
            except Exception as e:  # a bug in a step must not kill the engine silently
                log.exception("engine step failed")
                self.last_error = repr(e)
                self._fail_all(e)
                self._publish_stats()
                continue
            self._publish_stats()  # before delivery: whoever sees an output sees these counters
            self._deliver_step(outputs)
            if not outputs and self.core.waiting_on_tiers:  # sleep until a restore is done
                self._wake.wait(timeout=0.05)
                self._wake.clear()

    def _fail_all(self, exc: Exception) -> None:
        """After a failed step, end every live request with an engine error, freeing blocks."""
        for rid in list(self.core.requests):
            try:
                self.core.abort(rid)
            except Exception:  # keep going: every caller must hear back
                log.exception("abort after failed step")
            self._deliver(EngineError(f"engine step failed: {exc}"), rid)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _aborted_before_start(rid: str, ids: list[int], reused: bool, arrival: float) -> RequestOutput:
    """The final output of a request aborted before it reached the scheduler."""
    e2e = (time.monotonic() - arrival) * 1000
    return RequestOutput(request_id=rid, finished=True, finish_reason="abort",
                         usage=Usage(prompt_tokens=len(ids)), timings=Timings(e2e_ms=round(e2e, 3)),
                         output_text="", output_token_ids=[], prompt_token_ids=list(ids), prefix_reused=reused)
