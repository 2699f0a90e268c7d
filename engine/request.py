r"""A request's life inside the engine: its tokens, its blocks and its clocks.

Which blocks a running request holds (block_size 4, prompt of 10 tokens, the
first 8 matched in the radix tree)::

    tokens        t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 __ __
    block_table   [   b7      ,    b2       ,    b9      ]
                  \____ shared with the tree ___/ \ private /
    num_tree_blocks = 2   (pages the tree also holds; the request locks their node)
    num_computed_tokens = 8 before the first step, 10 after it

The request holds one BlockPool reference on every block in its table; the
tree holds its own on the pages it stores. Finishing (or preemption) inserts
the computed full pages into the tree and drops the request's references.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engine.radix_cache import CacheScope
from engine.sampling_params import SamplingParams
from engine.spec.ngram import TokenHistory
from engine.spec.policy import SpecState


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RESTORING = "restoring"  # waiting for the KV tiers to load pages into its blocks
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Engine-side state of one generation.

    Attributes:
        request_id: unique among live requests.
        prompt_ids: the prompt tokens, as run.
        params: sampling and stop parameters.
        namespace: where its pages live in the prefix cache (``CacheScope``: the weights'
            namespace, its cache salt and the tokens it shares across salts; a bare
            namespace string shares every page in it).
        output_ids: sampled tokens so far (including a final EOS/stop token).
        block_table: physical KV blocks covering tokens 0..num_computed_tokens-1 and
            the blocks reserved for this step.
        num_computed_tokens: tokens whose K/V are in the cache (tokens).
        num_cached_tokens: prompt tokens served by the prefix cache at first
            admission (reported as usage.cached_tokens).
        num_disk_tokens: of ``num_cached_tokens``, the tokens restored from the disk tier;
        num_host_tokens: those restored from the host-memory tier (the rest came from
            the pool).
        restore_tried: it asked the KV tiers for its pages once already.
        restore_job: its restore in flight (``engine.tiers.manager.LoadJob``), or None.
        num_tree_blocks: leading entries of block_table that the radix tree also holds.
        tree_node: the deepest radix node this request has locked (or None).
        detok: its incremental detokenizer (engine.detokenizer.IncrementalDetokenizer).
        token_counts: the PenaltyState (prompt mask, output counts) when penalties are on.
        arrival_s, first_scheduled_s, first_token_s, finished_s: time.monotonic() seconds.
        history: its tokens for draft lookup (engine.spec.ngram.TokenHistory), built when
            it first decodes with speculation on.
        spec: its speculation record (engine.spec.policy.SpecState).
        spec_drafts: draft tokens to verify in the next step (set by the engine, read by
            the scheduler).
        decode_steps: steps that sampled for it after its prefill.
        prior_output: the last ``prior_output`` prompt tokens are a cut reply this
            request continues: output already shown (tokens; 0 for a new reply).
        pending_trim: characters of that reply's shown text taken back and not reported yet.
        constraint: its grammar state (``engine.structured.compiler.Constraint``) when its
            output is constrained (a response format, or tool calls), else None.
        tool_stream: the split of its text into content and tool calls
            (``engine.tools.stream.ToolCallStream``) when it may call tools, else None.
        prompt_logprobs: with ``params.prompt_logprobs``, the log-probabilities of prompt
            tokens 1.. as its prefill computes them (``engine.outputs.TokenLogprob``);
            sent once, with its first output.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: CacheScope | str = ""
    prefix_reused: bool = False
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_disk_tokens: int = 0
    num_host_tokens: int = 0
    restore_tried: bool = False
    restore_job: Any = None
    num_tree_blocks: int = 0
    tree_node: Any = None
    detok: Any = None
    token_counts: Any = None  # engine.sampler.PenaltyState when penalties are on
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    history: TokenHistory | None = None
    spec: SpecState = field(default_factory=SpecState)
    spec_drafts: list[int] = field(default_factory=list)
    decode_steps: int = 0
    prior_output: int = 0
    pending_trim: int = 0
    constraint: Any = None
    tool_stream: Any = None
    prompt_logprobs: list[Any] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # Text, tokens and tool-call deltas produced since the last output was emitted.
    pending_text: str = ""
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[Any] = field(default_factory=list)
    pending_tool_calls: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens (tokens)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without building the whole list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def all_ids(self) -> list[int]:
        """Prompt plus output tokens as one list."""
        return self.prompt_ids + self.output_ids

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt tokens' logprobs are asked for and not all computed yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next sample (tokens)."""
        return self.num_tokens - self.num_computed_tokens
