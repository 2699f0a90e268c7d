"""The synchronous engine: admit requests, run steps, turn samples into outputs.

``EngineCore`` is single-threaded by contract: only the step loop's thread
calls it (``AsyncEngine`` owns that thread). One ``step`` = schedule → build
the flat batch → one forward over all requests → sample → detokenize → emit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.block_hash import namespace_of
from engine.block_pool import BlockPool, blocks_needed
from engine.config import EngineConfig, ModelConfig
from engine.cpu.ops import CpuKernels
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import ContextLengthError, InvalidRequestError, InvariantError
from engine.model_runner import ModelRunner
from engine.outputs import PromptProgress, RequestOutput, Timings, TokenLogprob, Usage
from engine.radix_cache import CacheScope, RadixCache
from engine.request import Request
from engine.sampler import PenaltyState, SamplerOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.spec.ngram import TokenHistory, propose
from engine.spec.policy import SpecConfig
from engine.structured.compiler import Constraint, GrammarCompiler
from engine.structured.vocab import Vocabulary
from engine.tiers.manager import IDLE_WRITE_BYTES, STOP_FLUSH_S, tiers_for
from engine.tools.formats import ToolFormat, tool_format_for
from engine.tools.grammar import tool_grammar
from engine.tools.spec import ToolRequest
from engine.tools.stream import ToolCallStream

log = logging.getLogger(__name__)

# a prompt chunk longer than this many pages is a prefill chunk for the step counters:
# longer than a chat's next message kept on its decode engine (the gateway's
# ROUTING_LOCAL_PREFILL_TOKENS, two pages of 16 by default) and than the last page that
# a prompt moved from a prefill engine leaves to its decode engine (docs/scaling.md)
LONG_CHUNK_PAGES = 2


def _step_timings(req: Request, n_out: int) -> dict[str, Any]:
    """A finished request's speculation totals and output tokens per decode step (the
    first token comes from the prefill, so n_out - 1 tokens over ``decode_steps``)."""
    drafted, accepted = req.spec.drafted, req.spec.accepted
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "tokens_per_step": round((n_out - 1) / req.decode_steps, 3) if req.decode_steps else 0.0,
    }


@dataclass
class Decoding:
    """How a request's tokens are chosen and read beyond sampling: its grammar state
    (None: free text) and its tool-call stream (None: no tools). Built off the step
    loop by ``EngineCore.prepare_decoding``."""

    constraint: Constraint | None = None
    tool_stream: ToolCallStream | None = None


@dataclass
class EngineCounters:
    """Totals since start (tokens, requests, steps)."""

    requests_total: int = 0
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    cached_disk_tokens_total: int = 0  # of those, restored from the disk tier
    cached_host_tokens_total: int = 0  # of those, restored from the host-memory tier
    completion_tokens_total: int = 0
    steps_total: int = 0
    decode_steps_total: int = 0  # steps that decoded for at least one request
    mixed_steps_total: int = 0  # of those, steps that also computed a prompt chunk
    mixed_prompt_tokens_total: int = 0  # prompt tokens computed in those mixed steps
    # of the mixed steps, those where one prompt's chunk exceeded LONG_CHUNK_PAGES pages: a
    # prefill chunk, not a short next message or the last page of a prompt moved here
    long_chunk_steps_total: int = 0
    aborted_total: int = 0
    spec_drafted_total: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted_total: int = 0  # of those, kept
    spec_steps_total: int = 0  # request-steps that verified drafts
    invariant_failures_total: int = 0  # check_invariants calls that found a broken state
    finished_by_reason: dict[str, int] = field(default_factory=dict)


def spec_config(config: EngineConfig, device: torch.device) -> SpecConfig | None:
    """The speculation settings of ``config`` on ``device``, or None when it is off: "auto"
    turns n-gram speculation on on the CPU, where a decode step is bound by reading the
    weights and verifying a few drafts costs little (``docs/benchmarks.md``), and off
    elsewhere until measured."""
    mode = config.speculative
    if mode == "off" or (mode == "auto" and device.type != "cpu"):
        return None
    return SpecConfig(num_draft_tokens=config.num_draft_tokens, min_n=config.spec_ngram_min,
                      max_n=config.spec_ngram_max, max_batch=config.spec_max_batch)


class EngineCore:
    """Scheduler + model runner + per-request sampling and detokenization.

    Args:
        model, model_config, kv, tokenizer: from ``engine.loader.load_model`` and
            ``engine.kv_cache``.
        config: the engine settings.
        num_blocks: KV blocks in the pool (the KV cache was allocated with them).
        max_model_len: context limit in tokens.
        namespace: prefix-cache namespace of these weights (their weights id).
        device: where the model runs.
        cpu_kernels: the CPU kernels the model was set up with (``LoadedModel.cpu_kernels``), or None.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv,
        tokenizer,
        config: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        namespace: str,
        device: torch.device,
        cpu_kernels: CpuKernels | None = None,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.namespace = namespace
        self.device = device
        self.pool = BlockPool(num_blocks)
        # events: the pages it stores and evicts, named for the gateways' prefix index
        self.cache = RadixCache(self.pool, config.block_size, enabled=config.enable_prefix_cache, events=True)
        # the KV tiers beneath the pool (None: off); their pages are named like the tree's
        self.tiers = tiers_for(config, model_config, namespace, kv.k_caches, kv.v_caches)
        if self.tiers is not None and self.tiers.config.write_back:
            self.cache.on_evict = self.tiers.store_evicted
        self.scheduler = Scheduler(
            SchedulerConfig(config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
                            config.schedule_policy),
            self.pool, self.cache, self.tiers,
        )
        self.runner = ModelRunner(model, model_config, kv, config, device, cpu_kernels)
        self.spec = spec_config(config, device)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.eos_ids = set(model_config.eos_token_ids)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            self.eos_ids.add(int(tok_eos))
        # constrained decoding: the vocabulary as the grammar library sees it (built on
        # first use) and the compiler with its cache
        self.vocab = Vocabulary(tokenizer, model_config.vocab_size, self.eos_ids)
        self.grammars = GrammarCompiler(self.vocab)
        self.tool_format: ToolFormat = tool_format_for(getattr(tokenizer, "chat_template", None))

    # ----- decoding set-up (any thread) -----------------------------------------------
    def prepare_decoding(self, params: SamplingParams, tools: ToolRequest | None = None) -> Decoding:
        """Compile the request's constraint: its tool calls' grammar when it may call
        tools (with its response format as the text alternative), else its response
        format; and its tool-call stream. Thread-safe (the compiler caches by grammar).

        Raises:
            InvalidRequestError: a schema or grammar the library cannot compile (the
                message says why), or a regex/grammar response format with tools.
        """
        spec = params.structured_output
        if tools is not None and tools.active:
            if spec is not None and not spec.is_json:
                raise InvalidRequestError("a regex or grammar response format cannot be combined with tools")
            try:
                lark = tool_grammar(tools, self.tool_format, spec)
            except ValueError as e:
                raise InvalidRequestError(str(e)) from None
            from llguidance import LLMatcher

            constraint = self.grammars.compile(grammar=LLMatcher.grammar_from_lark(lark), what="tools' parameters")
            return Decoding(constraint, ToolCallStream(self.tool_format))
        if spec is not None:
            return Decoding(self.grammars.compile(spec))
        return Decoding()

    # ----- admission ------------------------------------------------------------------
    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse at once what could never run (docs/acceptance.md, context overflow): no silent truncation.

        Raises:
            ContextLengthError: prompt + max_tokens over the context, or more KV than the pool.
            InvalidRequestError: empty prompt.
        """
        if prompt_len < 1:
            raise InvalidRequestError("the prompt is empty")
        total = prompt_len + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context of {self.max_model_len} tokens"
            )
        # The last sampled token never needs KV.
        blocks = blocks_needed(total - 1, self.config.block_size)
        if blocks > self.pool.num_blocks:
            raise ContextLengthError(
                f"prompt + max_tokens needs {blocks} KV blocks but the pool has {self.pool.num_blocks}"
            )

    def continuation_detokenizer(self, prompt_ids: list[int], continued_tokens: int,
                                 params: SamplingParams) -> IncrementalDetokenizer:
        """The detokenizer of a request whose last ``continued_tokens`` prompt tokens are a
        cut reply it continues: primed with them (``IncrementalDetokenizer(prior_ids=...)``,
        O(1) decode work a token). Callable from any thread: ``AsyncEngine`` builds it with
        the prompt, off the step thread."""
        prior = prompt_ids[len(prompt_ids) - continued_tokens:] if continued_tokens else []
        return IncrementalDetokenizer(self.tokenizer, params.stop, prior_ids=prior)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    cache_salt: str = "", prefix_reused: bool = False,
                    arrival_s: float | None = None, continued_tokens: int = 0,
                    detok: IncrementalDetokenizer | None = None, shared_tokens: int = 0, *,
                    tools: ToolRequest | None = None, decoding: Decoding | None = None) -> Request:
        """Queue a request whose prompt is already built. With a ``cache_salt`` its pages
        live in its own part of the prefix cache (``CacheScope``) except its first
        ``shared_tokens`` (rounded down to whole pages), which every salt may share.

        ``continued_tokens``: the last that many prompt tokens are a cut reply this request
        continues (``GenerateRequest.continued_tokens``): they count as its output for the
        penalties, the seeded noise and the text (``detok``, from
        ``continuation_detokenizer``; built here when None).

        ``decoding``: its constraint and tool stream from ``prepare_decoding`` (called here,
        on this thread, when None: the async engine calls it off the step loop).

        ``decoding``: its constraint and tool stream from ``prepare_decoding`` (called here,
        on this thread, when None: the async engine calls it off the step loop).

        Raises:
            InvalidRequestError: duplicate live request id (code ``duplicate_request_id``);
                ``continued_tokens`` outside ``[0, len(prompt_ids) - 1]``; a logit_bias id
                outside the vocabulary; an uncompilable constraint.
            ContextLengthError: see ``check_fits``.
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running", "duplicate_request_id")
        if not 0 <= continued_tokens < len(prompt_ids):
            raise InvalidRequestError(f"continued_tokens must be in [0, {len(prompt_ids) - 1}], "
                                      f"got {continued_tokens}")
        self.check_fits(len(prompt_ids), params)
        self.check_params(params)
        if decoding is None:
            decoding = self.prepare_decoding(params, tools)
        scope = CacheScope(namespace_of(self.namespace), cache_salt, shared_tokens if cache_salt else 0)
        req = Request(request_id=request_id, prompt_ids=list(prompt_ids), params=params, namespace=scope,
                      prefix_reused=prefix_reused, prior_output=continued_tokens,
                      constraint=decoding.constraint, tool_stream=decoding.tool_stream)
        if arrival_s is not None:
            req.arrival_s = arrival_s
        if PenaltyState.needed(params):
            # a continued reply's tokens are output the penalties count, as they would be
            # had the reply been written at once (prompt ∪ output is the same set)
            prior = prompt_ids[len(prompt_ids) - continued_tokens:] if continued_tokens else ()
            req.token_counts = PenaltyState(self.model_config.vocab_size, self.device, prompt_ids, prior)
        req.detok = detok if detok is not None else self.continuation_detokenizer(prompt_ids, continued_tokens,
                                                                                  params)
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.counters.requests_total += 1
        return req

    def check_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: token ids against the vocabulary.

        Raises:
            InvalidRequestError: a ``logit_bias`` id outside ``[0, vocab_size)``.
        """
        vocab = self.model_config.vocab_size
        bad = sorted(t for t in params.logit_bias if t >= vocab)
        if bad:
            raise InvalidRequestError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, free its blocks, and return its final output (None if unknown)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.counters.aborted_total += 1
        return self._finish(req, "abort", None)

    def has_work(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_work()

    # ----- the step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs it produced (deltas and finals), at most
        one per request (a speculative step may add several tokens to one delta), and a
        progress item for each prompt this step read a chunk of without finishing it."""
        if self.spec is not None:
            self._propose_drafts(self.spec)
        sched = self.scheduler.schedule()
        if not sched.items:
            return []
        self._count_step_mix(sched)
        sampled = self.runner.execute(sched)
        accepted = self._verify(sched, sampled)
        self.scheduler.on_step_done(sched, accepted)
        self.counters.steps_total += 1
        outputs: list[RequestOutput] = []
        for item in sched.items:
            # mid-prefill of a first admission (a preempted request's recompute has output
            # and was reported already); one cheap branch per item
            if not item.sample and not item.request.output_ids:
                req = item.request
                outputs.append(RequestOutput(request_id=req.request_id, progress=PromptProgress(
                    req.num_computed_tokens, len(req.prompt_ids), max(req.num_cached_tokens, 0))))
        if sampled is None:
            return outputs
        now = time.monotonic()
        k = 0
        for item, kept in zip(sched.items, accepted):
            if not item.sample:
                continue
            req = item.request
            end = k + kept + 1  # the known token's successor, then one per kept draft
            lps = sampled.logprobs[k:end] if sampled.logprobs else [None] * (end - k)
            tokens = sampled.token_ids[k:end]
            k += item.num_samples
            if req.output_ids:
                req.decode_steps += 1
            outputs.append(self._on_tokens(req, tokens, lps, now, len(item.spec), kept))
        return outputs

    def _count_step_mix(self, sched: ScheduledBatch) -> None:
        """Count a step that decodes for some request: and whether a prompt chunk rode in it
        (every decoding request then waited for that chunk), with the chunk's tokens."""
        chunks = [i.num_new for i in sched.items if i.request.num_computed_tokens < len(i.request.prompt_ids)]
        prompt = sum(chunks)
        if prompt == sum(i.num_new for i in sched.items):
            return  # no request decodes in this step
        c = self.counters
        c.decode_steps_total += 1
        if prompt:
            c.mixed_steps_total += 1
            c.mixed_prompt_tokens_total += prompt
            if max(chunks) > LONG_CHUNK_PAGES * self.config.block_size:
                c.long_chunk_steps_total += 1

    def _count_drafts(self, req: Request, drafted: int, kept: int, used: int | None) -> None:
        """Count one verification of ``drafted`` drafts of which ``kept`` were right, in the
        request's record and the engine's counters. ``used``: when the reply ended in this
        step, how many of the step's tokens it kept (the rest came after a stop string,
        EOS or ``max_tokens``): drafts at positions past its end count as neither drafted
        nor accepted, so accepted drafts are tokens that reached the output."""
        if not drafted or self.spec is None:
            return
        if used is not None:
            drafted, kept = min(drafted, used), min(kept, used)
        req.spec.record(self.spec, drafted, kept)
        self.counters.spec_drafted_total += drafted
        self.counters.spec_accepted_total += kept
        self.counters.spec_steps_total += 1

    def _propose_drafts(self, config: SpecConfig) -> None:
        """Give each decoding request its draft tokens for this step (prompt lookup), while
        few requests decode at once (``SpecConfig.max_batch``); never past ``max_tokens``
        or the context."""
        decoding = [r for r in self.scheduler.running if r.num_uncomputed == 1 and r.output_ids]
        small = len(decoding) <= config.max_batch
        # the step's draft rows stay near max_batch * 4 (a 4-request step with 8 drafts each
        # was compute-bound and slower than without): k each for 1-2 requests, fewer for more
        share = max(1, (config.max_batch * 4) // max(1, len(decoding)))
        for req in decoding:
            req.spec_drafts = []
            if not small or not req.spec.wants_drafts(config):
                continue
            room = min(req.spec.draft_budget(config), share, req.params.max_tokens - len(req.output_ids) - 1,
                       self.max_model_len - req.num_tokens)
            if room <= 0:
                continue
            drafts = self.draft(req, room, config)
            if req.constraint is not None and drafts:
                # a draft the grammar forbids could never be kept: verify only the allowed prefix
                drafts = drafts[:req.constraint.valid_prefix(drafts)]
            req.spec_drafts = drafts

    def draft(self, req: Request, room: int, config: SpecConfig) -> list[int]:
        """At most ``room`` draft tokens for ``req`` by prompt lookup over its own tokens
        (``engine.spec.ngram``); the proposer the engine uses, one call per request per step."""
        if req.history is None:
            req.history = TokenHistory(req.all_ids())
        return propose(req.history.view(), room, config.min_n, config.max_n)

    @staticmethod
    def _verify(sched: ScheduledBatch, sampled: SamplerOutput | None) -> list[int]:
        """Per item, how many of its drafts the step keeps: the longest prefix equal to the
        tokens sampled at the positions before them. Each position is sampled exactly as
        one-by-one decoding would sample it (``ModelRunner.execute``), so keeping the drafts
        that match and then the first sampled token that differs gives the same tokens as
        decoding without drafts: for greedy rows exact argmax agreement; for sampled rows
        the draft x is kept with probability p(x) and a differing token is drawn from p
        without x, which is the rejection rule of Leviathan et al. (2023) and Chen et al.
        (2023) for a draft distribution that is a point mass on x."""
        accepted, k = [], 0
        for item in sched.items:
            kept = 0
            if item.spec and sampled is not None:
                targets = sampled.token_ids[k:k + item.num_samples]
                while kept < len(item.spec) and item.spec[kept] == targets[kept]:
                    kept += 1
            accepted.append(kept)
            k += item.num_samples
        return accepted

    def _on_tokens(self, req: Request, tokens: list[int], logprobs: list, now: float, drafted: int = 0,
                   kept: int = 0) -> RequestOutput:
        """Append a step's kept tokens one by one, checking the stop conditions after each;
        then, for a constrained request, the tokens its grammar forces (taken without
        sampling: the mask would allow only them); emit one delta for them, or the final
        output at the first that ends the request (the rest are dropped).
        ``drafted``/``kept``: the step's drafts for the request and how many were right
        (``tokens`` is the kept drafts and one sampled token)."""
        first = req.first_token_s is None
        if first:
            req.first_token_s = now
        constraint = req.constraint
        for used, (tok, logprob) in enumerate(zip(tokens, logprobs), 1):
            if constraint is not None and used - 1 in constraint.dead_rows:
                dead = constraint.dead_rows[used - 1]
                return self._end_early(req, ("error", f"grammar dead end: {dead}"), (drafted, kept, used - 1))
            ended = self._append(req, tok, logprob)
            if ended is not None:
                return self._end_early(req, ended, (drafted, kept, used))
        self._count_drafts(req, drafted, kept, None)
        # forced tokens come without logprobs, so a request that asks for them samples every token
        while constraint is not None and req.params.logprobs is None:
            forced = constraint.forced()
            if not forced:
                break
            for tok in forced:
                ended = self._append(req, tok, None)
                if ended is not None:
                    return self._end_early(req, ended, None)
        out = RequestOutput(request_id=req.request_id, text=req.pending_text, token_ids=req.pending_ids,
                            logprobs=req.pending_logprobs or None, trim_prior=req.pending_trim,
                            tool_calls=req.pending_tool_calls or None,
                            prompt_logprobs=self._prompt_logprobs_once(req),
                            prompt_usage=Usage(prompt_tokens=len(req.prompt_ids),
                                               cached_tokens=max(req.num_cached_tokens, 0)) if first else None)
        req.pending_text, req.pending_ids, req.pending_logprobs, req.pending_trim = "", [], [], 0
        req.pending_tool_calls = []
        return out

    def _append(self, req: Request, tok: int, logprob) -> tuple[str, str | int | None] | None:
        """Append one output token (advancing its grammar and text); the finish reason and
        stop reason it causes, or None."""
        p = req.params
        req.output_ids.append(tok)
        req.pending_ids.append(tok)
        if req.history is not None:
            req.history.extend((tok,))
        if req.token_counts is not None:
            req.token_counts.append(tok)
        if logprob is not None:
            req.pending_logprobs.append(logprob)
        constraint = req.constraint
        if constraint is not None and not constraint.accept(tok):
            return ("error", f"grammar refused token {tok}: {constraint.error}")
        # a constrained reply ends at its end token even with ignore_eos: its grammar is complete
        if (tok in self.eos_ids and (not p.ignore_eos or constraint is not None)) or tok in p.stop_token_ids:
            return ("stop", tok)
        self._add_text(req, req.detok.add(tok))
        req.pending_trim += req.detok.take_trim()
        if req.detok.stopped:
            return ("stop", req.detok.stop_reason)
        if req.tool_stream is not None and req.tool_stream.repeated:
            return ("stop", None)  # the model repeats a call it made: its calls are over
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return ("length", None)
        return None

    @staticmethod
    def _prompt_logprobs_once(req: Request):
        """The request's prompt logprobs, the first time they are all there (else None):
        one per prompt token, token 0 (nothing before it scores it) with 0.0."""
        if req.params.prompt_logprobs is None or req.prompt_logprobs_sent or req.wants_prompt_logprobs:
            return None
        req.prompt_logprobs_sent = True
        return [TokenLogprob(req.prompt_ids[0], 0.0)] + req.prompt_logprobs

    @staticmethod
    def _add_text(req: Request, piece: str) -> None:
        """Queue a piece of the reply's text: as it is, or split into content and tool calls."""
        if req.tool_stream is None:
            req.pending_text += piece
            return
        content, calls = req.tool_stream.feed(piece)
        req.pending_text += content
        req.pending_tool_calls.extend(calls)

    def _end_early(self, req: Request, reason: tuple[str, str | int | None],
                   drafts: tuple[int, int, int] | None) -> RequestOutput:
        """Finish inside a step's tokens: the KV of the tokens after the last one kept is
        dropped (the last token, as always, has none). ``drafts``: (drafted, kept, used)
        for ``_count_drafts`` when the step's drafts are not counted yet."""
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        if drafts is not None:
            self._count_drafts(req, *drafts)  # before the timings are taken
        return self._finish(req, *reason)

    def _finish(self, req: Request, reason: str, stop_reason) -> RequestOutput:
        """Release the request's blocks (caching its pages) and build its final output.

        A reply that truly ends ("stop") shows an unfinished character at its end as
        U+FFFD; one cut by ``max_tokens``, the context or an abort drops it (its token ids
        stay, so a continuation completes the character)."""
        req.finished_s = time.monotonic()
        self._add_text(req, req.detok.finish(complete=reason == "stop"))
        req.pending_trim += req.detok.take_trim()
        if reason == "length" and req.detok.stopped:  # a stop string completed in the flushed tail
            reason, stop_reason = "stop", req.detok.stop_reason
        output_text, calls = req.detok.text, None
        if req.tool_stream is not None:
            if reason == "length" and req.tool_stream.repeated:  # the flushed tail repeated a call
                reason, stop_reason = "stop", None
            content, held = req.tool_stream.finish(cut=reason != "stop")
            req.pending_text += content
            req.pending_tool_calls.extend(held)
            output_text, calls = req.tool_stream.content, list(req.tool_stream.calls)
            if calls and reason == "stop":
                reason = "tool_calls"
        req.finish_reason, req.stop_reason = reason, stop_reason
        self.scheduler.remove(req)  # also marks it FINISHED
        self.requests.pop(req.request_id, None)
        c = self.counters
        n_out = len(req.output_ids)
        cached = max(req.num_cached_tokens, 0)
        c.prompt_tokens_total += len(req.prompt_ids)
        c.cached_tokens_total += cached
        c.cached_disk_tokens_total += min(req.num_disk_tokens, cached)
        c.cached_host_tokens_total += min(req.num_host_tokens, cached)
        c.completion_tokens_total += n_out
        c.finished_by_reason[reason] = c.finished_by_reason.get(reason, 0) + 1
        ttft = (req.first_token_s - req.arrival_s) * 1000 if req.first_token_s else 0.0
        tpot = ((req.finished_s - req.first_token_s) * 1000 / (n_out - 1)) if (req.first_token_s and n_out > 1) else 0.0
        queue = (req.first_scheduled_s - req.arrival_s) * 1000 if req.first_scheduled_s else 0.0
        out = RequestOutput(
            request_id=req.request_id, text=req.pending_text, token_ids=req.pending_ids,
            logprobs=req.pending_logprobs or None, finished=True, finish_reason=reason,
            stop_reason=stop_reason, tool_calls=req.pending_tool_calls or None, output_tool_calls=calls,
            prompt_logprobs=self._prompt_logprobs_once(req),
            usage=Usage(prompt_tokens=len(req.prompt_ids), cached_tokens=cached, completion_tokens=n_out,
                        cached_disk_tokens=min(req.num_disk_tokens, cached),
                        cached_host_tokens=min(req.num_host_tokens, cached)),
            timings=Timings(ttft_ms=round(ttft, 3), tpot_ms=round(tpot, 3),
                            e2e_ms=round((req.finished_s - req.arrival_s) * 1000, 3), queue_ms=round(queue, 3),
                            **_step_timings(req, n_out)),
            output_text=output_text, output_token_ids=list(req.output_ids),
            prompt_token_ids=list(req.prompt_ids), prefix_reused=req.prefix_reused, trim_prior=req.pending_trim,
        )
        req.pending_text, req.pending_ids, req.pending_logprobs, req.pending_trim = "", [], [], 0
        req.pending_tool_calls = []
        return out

    # ----- introspection --------------------------------------------------------------
    def stats(self) -> dict:
        """Block and request counters (blocks are counts of KV blocks; tokens are tokens)."""
        c = self.counters
        return {
            "num_blocks": self.pool.num_blocks,
            "block_size": self.config.block_size,
            "blocks_free": self.pool.num_free,
            "blocks_used": self.pool.num_blocks - self.pool.num_free,
            "blocks_cached": self.cache.num_cached_blocks,
            "blocks_evictable": self.cache.num_evictable_blocks,
            "blocks_held_by_requests": self.scheduler.blocks_held_by_requests(),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions_total": self.scheduler.num_preemptions,
            "requests_total": c.requests_total,
            "aborted_total": c.aborted_total,
            "prompt_tokens_total": c.prompt_tokens_total,
            "cached_tokens_total": c.cached_tokens_total,
            "cached_disk_tokens_total": c.cached_disk_tokens_total,
            "cached_host_tokens_total": c.cached_host_tokens_total,
            "completion_tokens_total": c.completion_tokens_total,
            "steps_total": c.steps_total,
            "decode_steps_total": c.decode_steps_total,
            "mixed_steps_total": c.mixed_steps_total,
            "mixed_prompt_tokens_total": c.mixed_prompt_tokens_total,
            "long_chunk_steps_total": c.long_chunk_steps_total,
            "spec_drafted_total": c.spec_drafted_total,
            "spec_accepted_total": c.spec_accepted_total,
            "spec_steps_total": c.spec_steps_total,
            "invariant_failures_total": c.invariant_failures_total,
            "restoring": len(self.scheduler.restoring),
            **(self.tiers.stats() if self.tiers is not None else {}),
        }

    def check_invariants(self) -> None:
        """Block conservation and tree consistency; run when idle and in tests.

        Every failure counts in ``stats()["invariant_failures_total"]``; the first is logged
        with the engine's counters.

        Raises:
            InvariantError: an invariant does not hold (the message names the numbers).
        """
        try:
            self.scheduler.check_invariants()
            free, evictable = self.pool.num_free, self.cache.num_evictable_blocks
            if not self.has_work() and free + evictable != self.pool.num_blocks:
                total = self.pool.num_blocks
                raise InvariantError(f"idle engine: free {free} + evictable {evictable} != total {total}")
        except InvariantError as e:
            # Counted in stats (and so in /metrics); logged once with the state that broke,
            # so a broken pool does not flood the log at every idle check.
            self.counters.invariant_failures_total += 1
            if self.counters.invariant_failures_total == 1:
                log.error("engine invariant failed: %s; state: %s", e, self.stats())
            raise

    @property
    def waiting_on_tiers(self) -> bool:
        """Nothing runs and a restore is in flight: the step loop may sleep until the
        tiers wake it (``KVTiers.wake``)."""
        return bool(self.scheduler.restoring or self.scheduler.kv.in_flight) and not self.scheduler.running

    def write_idle(self, stop: Callable[[], bool]) -> bool:
        """Write-idle (``kv_disk_write="idle"``), with nothing running or waiting: queue
        up to ``IDLE_WRITE_BYTES`` of the tree's pages the disk lacks, a parent before
        its children, one page at a time until ``stop()`` (a request arrived) is True.
        Waits while the writer still has pages queued, so at most one batch is queued.

        Returns:
            True while pages may be left to write (the caller comes back soon).
        """
        tiers = self.tiers
        if tiers is None or not tiers.config.write_idle or not tiers.unwritten or not tiers.disk_active:
            return False
        if tiers.writes_queued:
            return True
        pages = max(1, IDLE_WRITE_BYTES // tiers.key.payload_bytes)
        _, done = tiers.write_unwritten(self.cache.page_nodes(), pages, stop)
        if done:
            tiers.unwritten = False
        return not done

    def close(self) -> None:
        """Stop the KV tiers' threads after writing what they have queued (a few seconds
        at most); with write-idle, first the tree's pages the disk lacks (at most
        ``STOP_FLUSH_S``, logged: pages written and left). Call once the step loop has
        stopped."""
        if self.tiers is None:
            return
        if self.tiers.config.write_idle and self.tiers.disk_active:
            written, left = self.tiers.flush_tree(self.cache.page_nodes(), STOP_FLUSH_S)
            log.info("KV disk tier: wrote %d pages of the cache at stop, %d left unwritten", written, left)
            self.tiers.close(flush_s=0.5)
        else:
            self.tiers.close()

    def evict_all(self) -> int:
        """Evict every unlocked cached page; returns blocks freed."""
        return self.cache.evict(self.pool.num_blocks)
