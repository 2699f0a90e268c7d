"""What a caller sends the engine and what it gets back (the engine's public types)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.protocol import Timings, Usage
from engine.sampling_params import SamplingParams
from engine.tools.spec import ToolRequest
from engine.tools.stream import ToolCall, ToolCallDelta

__all__ = ["GenerateRequest", "PromptProgress", "RequestOutput", "Timings", "TokenLogprob", "ToolCall",
           "ToolCallDelta", "Usage"]


@dataclass
class GenerateRequest:
    """One generation request.

    Exactly one of ``prompt_token_ids``, ``prompt`` or ``messages`` is given.

    Attributes:
        request_id: unique among live requests of the engine.
        prompt_token_ids: the prompt as token ids (used as is: no BOS is added).
        prompt: a raw text prompt (no chat template; tokenized with the tokenizer's own
            special-token policy, e.g. a BOS where the model's tokenizer adds one).
        messages: chat messages ``[{"role": "system"|"user"|"assistant"|"tool", "content": str}]``
            (assistant messages may carry ``tool_calls``; ``engine.prompt.validate_messages``);
            the engine applies the model's chat template with the generation prompt.
        prefix_token_ids: optional exact ids the model saw and produced for a leading
            part of ``messages`` (the chat so far, ending with an assistant reply's
            sampled ids). When the template's rendering of ``messages`` starts with the
            text of these ids, the prompt is these ids plus the tokenized rest, so
            turn N+1 shares turn N's KV exactly (docs/architecture.md, multi-turn prompts); otherwise the engine falls
            back to a full render and reports ``prefix_reused=False``.
        params: sampling and stopping parameters.
        cache_salt: namespace for the prefix cache; requests with different salts never
            share KV beyond ``shared_messages`` (docs/reliability.md, cache isolation). The
            engine also separates weights by their id.
        shared_messages: with a ``cache_salt``, the leading messages the caller declares
            shared by everyone (a default system prompt): the prompt's tokens that render
            them (``PromptBuilder.shared_length``, whole pages) stay in the unsalted cache,
            where every salt finds them. Works with ``prompt_token_ids`` too.
        clamp_max_tokens: when the prompt fits the context but prompt + max_tokens does
            not, lower max_tokens to what is left (the reply then ends with "length")
            instead of refusing. The prompt itself is never truncated.
        continued_tokens: the last ``continued_tokens`` ids of ``prompt_token_ids`` are a
            reply cut at its max tokens that this request continues (tokens; 0: none).
            They count as that reply's output already shown: its text is not sent again,
            a stop string begun in it still matches, penalties count them as output and a
            seeded request's noise goes on from their number, so a greedy or seeded reply
            continued this way equals the reply written at once (``max_tokens`` counts the
            new tokens only; docs/protocol.md, continuing a cut reply).
        tools: the functions the model may call and the tool choice (``engine.tools.spec``),
            or None.
        continue_final_message: the last message is the assistant's, and the reply
            continues it (no end of turn, no new generation prompt) instead of answering.
        kv_source: the URL of an engine holding this prompt's KV (a prefill engine that ran
            it; for a prefill engine, the chat's decode engine holding its earlier turns):
            the pages this engine lacks are pulled from there first (``engine.disagg``).
    """

    request_id: str
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    prefix_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str = ""
    clamp_max_tokens: bool = False
    continued_tokens: int = 0
    shared_messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    tools: ToolRequest | None = None
    continue_final_message: bool = False
    kv_source: str | None = None


@dataclass
class TokenLogprob:
    """Log-probability of a sampled token and its top alternatives (natural log)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class PromptProgress:
    """How much of a prompt is read (tokens): ``done`` of ``total`` prompt tokens have
    their KV (computed, or ``cached`` of them from the prefix cache); ``done < total``."""

    done: int
    total: int
    cached: int = 0


@dataclass
class RequestOutput:
    """One item yielded by ``AsyncEngine.generate``.

    A delta carries the new ``text`` and ``token_ids`` since the previous item
    (``finished`` False). The final item has ``finished`` True, may itself carry
    text and tokens decoded in the finishing step (docs/acceptance.md#the-finishing-steps-tokens-are-delivered), and
    holds
    ``finish_reason`` ("stop", "length" or "abort"), ``usage``, ``timings``, the
    full ``output_text`` and ``output_token_ids`` and the ``prompt_token_ids``
    that were run.

    A progress item (``progress`` set, no text or tokens, ``finished`` False) comes
    after each step that computed a chunk of a long prompt without finishing it
    (chunked prefill); a prompt read in one step gets none.

    A request with active tools gets its calls apart from its text: ``tool_calls`` holds
    the output's call deltas (``engine.tools.stream``: a call's first delta has its id and
    name, later ones fragments of its arguments), ``text``/``output_text`` only the
    content outside calls, and the final item ``output_tool_calls`` (every call whole)
    and finish reason "tool_calls" when the reply made calls and ended normally.
    A request with ``params.prompt_logprobs`` gets, with its first output that has
    tokens (or its final one), ``prompt_logprobs``: each prompt token scored by the model
    given the tokens before it (token 0, which nothing scores, with 0.0 and no alternatives).
    A request's first delta with tokens carries ``prompt_usage``: the prompt's length and
    its tokens served by the prefix cache (``Usage.prompt_tokens``, ``cached_tokens``).
    Finish reason "error" means the engine could not continue the reply (a grammar that
    allowed no token: ``stop_reason`` says why); its text so far is kept.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    usage: Usage | None = None
    timings: Timings | None = None
    output_text: str | None = None
    output_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prefix_reused: bool | None = None
    progress: PromptProgress | None = None
    # (a continuation) characters to take off the end of the continued reply's shown
    # text before this item's text; on the first item with text, or the final one
    trim_prior: int = 0
    tool_calls: list[ToolCallDelta] | None = None
    output_tool_calls: list[ToolCall] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_usage: Usage | None = None
