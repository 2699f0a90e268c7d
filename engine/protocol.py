"""The internal engine protocol (gateway <-> engine), as typed frames (docs/protocol.md section 1).

Standard library only (no torch, no numpy): the engine server and the gateway both
import it, and the gateway's image has no torch. Every frame is one JSON object with a
string ``type``; ``encode`` turns a frame into its JSON text and the ``decode_*``
functions turn JSON text back into a frame, raising ``FrameError`` (with a message
naming the field) on anything malformed.

Gateway -> engine: ``GenerateFrame``, ``AbortFrame``, ``StatsRequest``, ``PingFrame``,
``KvSubscribeFrame``; engine -> engine (prefill/decode disaggregation): ``KvFetchFrame``.
Engine -> gateway: ``HelloFrame`` (first, once), ``StepFrame`` (one per engine step per
connection, carrying that step's ``ProgressFrame``/``DeltaFrame``/``DoneFrame``/``ErrorFrame``
items of the connection's requests), ``ErrorFrame`` (alone: a refused or malformed frame),
``StatsFrame``, ``PongFrame`` and, after a ``KvSubscribeFrame``, ``KvEventsFrame``; after a
``KvFetchFrame``, one binary frame per KV page (``engine.kv_page``) and a ``KvFetchDoneFrame``.

The items of a step keep the flat layout of a frame of their own (``{"type": "delta",
"request_id", ...}``), so a reader that splits a step frame sees per-request frames.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

# 2: per-step frames, stats from the end-of-step snapshot; 3: progress items; 4: KV events;
# 5: continuing a cut reply (generate's continued_tokens, the items' trim_prior);
# 6: per-user cache salts with declared-shared messages (generate's shared_messages);
# 7: raw prompts, tools and tool calls, continue_final_message, output constraints, logit
# bias, named logprobs and prompt logprobs; 8: engine roles (hello's role), generate's
# kv_source and the kv_fetch exchange of prefill/decode disaggregation
PROTOCOL_VERSION = 8
# The engine link's shared secret: an engine whose environment sets SECRET_ENV refuses a
# connection that does not send the same value in SECRET_HEADER (HTTP 403).
SECRET_ENV = "ENGINE_SECRET"
SECRET_HEADER = "X-Engine-Secret"


class FrameError(ValueError):
    """A frame that is not valid JSON or does not match its type's layout.

    ``request_id`` is set when the frame named one (a ``generate`` with a bad field):
    the engine then answers ``invalid_request`` for that id, else ``bad_frame``.
    """

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


@dataclass
class Usage:
    """Token counts of one request (tokens)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    completion_tokens: int = 0
    cached_disk_tokens: int = 0  # of cached_tokens, those restored from the disk KV tier
    cached_host_tokens: int = 0  # of cached_tokens, those restored from the host-memory KV tier (the rest: the pool)


@dataclass
class Timings:
    """Latencies of one request, in milliseconds, and how its decode steps went.

    ttft_ms: arrival to first token; tpot_ms: mean time per output token after the
    first; e2e_ms: arrival to finish; queue_ms: arrival to first scheduled.
    draft_tokens / accepted_tokens: speculative draft tokens verified for it and kept
    (tokens; 0 when it never drafted); acceptance_rate: accepted / draft (0.0 without
    drafts); tokens_per_step: output tokens after the first per decode step (1.0
    without speculation, up to 1 + drafts a step with it).
    """

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2e_ms: float = 0.0
    queue_ms: float = 0.0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    tokens_per_step: float = 0.0


@dataclass
class EngineInfo:
    """What an engine serves (the body of its ``hello`` frame).

    Attributes:
        model: the served model's name.
        max_model_len: context limit (tokens).
        block_size: tokens per KV block; num_blocks: KV blocks in the pool.
        dtype: activations' dtype name; device: "cpu", "cuda:0", ...
        weights_id: identifies the weights (salts the prefix cache).
        eos_token_ids: token ids that end a reply.
        quantization: "int8" or None; kv_cache_dtype: the KV cache's dtype name or None.
        format: one line naming weights, activations, KV cache and kernels.
        tokenizer_dir: the folder of the model's tokenizer and chat template on the
            engine's host; a gateway that can read it there (same host or a shared
            volume) computes prompt ids as the engine does, to route by prefix.
        tool_format: how the model writes tool calls ("hermes", "llama3_json" or
            "generic"; ``engine.tools.formats``).
        role: "both", "prefill" or "decode" (``EngineConfig.role``; protocol 8).
        think_markers: the opening and closing markers of the model's reasoning, when its
            chat template declares them (``["<think>", "</think>"]``), else empty.
        think_in_prompt: the generation prompt ends with the opening marker, so each
            reply starts inside its reasoning (the marker is not part of its text).
    """

    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    dtype: str = ""
    device: str = ""
    weights_id: str = ""
    eos_token_ids: list[int] = field(default_factory=list)
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    format: str = ""
    tokenizer_dir: str = ""
    tool_format: str = ""
    role: str = "both"
    think_markers: list[str] = field(default_factory=list)
    think_in_prompt: bool = False


# ----- gateway -> engine ---------------------------------------------------------------

@dataclass
class GenerateFrame:
    """Start a generation. Exactly one of ``messages`` / ``prompt_token_ids`` / ``prompt``;
    ``params`` holds ``engine.sampling_params.SamplingParams`` keys (checked by the engine).
    ``continued_tokens`` (protocol 5): the last that many ``prompt_token_ids`` are a cut
    reply this request continues (``engine.outputs.GenerateRequest``); ``shared_messages``
    (protocol 6): with a ``cache_salt``, the leading messages declared shared.
    Protocol 7: ``prompt``, a raw text prompt (no chat template); ``tools``,
    ``tool_choice``, ``parallel_tool_calls``, OpenAI's chat-completions fields
    (``engine.tools.spec``); ``continue_final_message``, continue the final assistant
    message instead of answering it.
    Protocol 8: ``kv_source``, the URL of an engine (``ws://host:port``) that holds this
    prompt's KV pages (a prefill engine that just ran it): the engine pulls the pages it
    lacks from there before it runs the request (``engine.disagg``).
    """

    request_id: str
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    prefix_token_ids: list[int] | None = None
    params: dict[str, Any] | None = None
    cache_salt: str = ""
    clamp_max_tokens: bool = False
    continued_tokens: int = 0
    shared_messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False
    kv_source: str | None = None


@dataclass
class AbortFrame:
    """Abort a request (unknown ids are ignored)."""

    request_id: str


@dataclass
class StatsRequest:
    """Ask for a ``StatsFrame`` (answered at once from the last end-of-step snapshot)."""


@dataclass
class PingFrame:
    """Answered by ``PongFrame`` at once, whatever the engine is doing."""


@dataclass
class KvSubscribeFrame:
    """Ask for the engine's KV events on this connection: one ``KvEventsFrame`` with
    ``reset`` (every page cached now), then one per step that stored or evicted pages
    (protocol version 4 and later)."""


@dataclass
class KvFetchFrame:
    """Ask for the KV pages of a prompt (engine to engine, protocol 8): the pages
    ``first_page .. first_page + num_pages - 1`` of ``prompt_token_ids`` in the scope of
    ``cache_salt`` / ``shared_tokens`` (``engine.radix_cache.CacheScope``), as far as the
    engine's prefix cache holds them from the start of the prompt. Answered by one binary
    frame per page, in order (``engine.kv_page``, named by its chained hash), then a
    ``KvFetchDoneFrame``; one fetch at a time per connection.
    """

    request_id: str
    prompt_token_ids: list[int]
    first_page: int = 0
    num_pages: int = 0
    cache_salt: str = ""
    shared_tokens: int = 0


ClientFrame = GenerateFrame | AbortFrame | StatsRequest | PingFrame | KvSubscribeFrame | KvFetchFrame


# ----- engine -> gateway ---------------------------------------------------------------

@dataclass
class HelloFrame:
    """Sent once on connect: the protocol version and what the engine serves."""

    info: EngineInfo
    protocol_version: int = PROTOCOL_VERSION


@dataclass
class ProgressFrame:
    """How far a long prompt's chunked prefill has come: sent after each step that computed
    a chunk of the prompt without finishing it (a prompt read in one step gets none).

    Attributes:
        request_id: the request.
        prompt_tokens_done: prompt tokens whose KV is computed or came from the prefix
            cache (tokens); always below ``prompt_tokens``.
        prompt_tokens: the prompt's length (tokens).
        cached_tokens: of those done, the tokens served by the prefix cache (tokens).
    """

    request_id: str
    prompt_tokens_done: int
    prompt_tokens: int
    cached_tokens: int = 0


@dataclass
class DeltaFrame:
    """New text and tokens of one request since its previous item (at most one per step).

    ``logprobs``: per token ``{"token_id", "token", "bytes", "logprob", "top": [{"token_id",
    "token", "bytes", "logprob"}, ...]}`` when asked for (``token``: the token's text,
    ``bytes``: its UTF-8 bytes).
    ``trim_prior`` (a continuation, protocol 5): characters (code points) to take off the
    end of the continued reply's text before appending ``text``; only ever on the
    request's first item with text, or on its ``done``.
    ``tool_calls`` (protocol 7): tool-call deltas ``{"index", "id"?, "name"?, "arguments"}``
    (a call's first has its id and name; the others fragments of its arguments' JSON
    text); with tools, ``text`` is the content outside calls. ``prompt_logprobs``
    (protocol 7; once, with the first item that has tokens, when asked for): an entry
    per prompt token, the first with ``logprob`` null. ``usage`` (on the request's first
    item with tokens only; absent from older engines): the prompt's ``prompt_tokens`` and
    ``cached_tokens``, known once it is read, so that an API can state them before the
    reply ends (Anthropic's ``message_start``).
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    trim_prior: int = 0
    tool_calls: list[dict[str, Any]] | None = None
    prompt_logprobs: list[dict[str, Any]] | None = None
    usage: Usage | None = None


@dataclass
class DoneFrame:
    """The last item of a request; may carry the finishing step's text and tokens.

    ``finish_reason`` is "stop", "length", "abort", "tool_calls" (the reply made tool
    calls and ended) or "error" (the engine could not continue it: ``stop_reason`` says
    why); the concatenation of every item's ``text`` equals ``output_text``.
    ``trim_prior``: as in ``DeltaFrame``. ``output_tool_calls``: every call of the reply
    whole (``{"index", "id", "name", "arguments"}``), or None for a request without tools.
    """

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    stop_reason: str | int | None = None
    output_text: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    prefix_reused: bool = False
    usage: Usage = field(default_factory=Usage)
    timings: Timings = field(default_factory=Timings)
    trim_prior: int = 0
    tool_calls: list[dict[str, Any]] | None = None
    output_tool_calls: list[dict[str, Any]] | None = None
    prompt_logprobs: list[dict[str, Any]] | None = None


@dataclass
class ErrorFrame:
    """A refused request (nothing generated) or a malformed frame (no ``request_id``).

    Codes: invalid_request, context_length_exceeded, duplicate_request_id, bad_frame,
    engine_error (and, made up by the gateway when a link drops, engine_unavailable).
    """

    code: str
    message: str
    request_id: str | None = None


ReplyItem = ProgressFrame | DeltaFrame | DoneFrame | ErrorFrame


@dataclass
class StepFrame:
    """Everything one engine step produced for the requests of one connection."""

    items: list[ReplyItem] = field(default_factory=list)


@dataclass
class StatsFrame:
    """Engine counters from the snapshot taken at the end of the last step.

    ``stats``: KV block counts, running/waiting requests, token totals (keys in
    docs/protocol.md section 1); ``age_ms``: how old that snapshot was when sent (ms).
    """

    stats: dict[str, Any]
    age_ms: float = 0.0


@dataclass
class PongFrame:
    """The answer to ``PingFrame``."""


@dataclass
class KvEventsFrame:
    """Pages of KV the engine's prefix cache stored or evicted, by chained block hash
    (``engine.block_hash``: unsigned 64-bit ints over ``block_size``-token pages).

    Attributes:
        stored: pages now cached (since the previous frame).
        removed: pages evicted (disjoint from ``stored``).
        reset: this frame lists every cached page (``stored``); forget earlier frames.
    """

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reset: bool = False


@dataclass
class KvFetchDoneFrame:
    """The end of a ``KvFetchFrame``'s answer.

    Attributes:
        request_id: the fetch's id.
        pages: binary page frames sent (pages; fewer than asked when the cache no longer
            holds the rest).
        error: why nothing (or less) was sent, when it was not a plain cache miss ("" otherwise).
    """

    request_id: str
    pages: int = 0
    error: str = ""


EngineFrame = (HelloFrame | StepFrame | ProgressFrame | DeltaFrame | DoneFrame | ErrorFrame | StatsFrame | PongFrame
               | KvEventsFrame | KvFetchDoneFrame)
Frame = ClientFrame | EngineFrame


# ----- encoding ------------------------------------------------------------------------

def _item_dict(item: ReplyItem) -> dict[str, Any]:
    if isinstance(item, ErrorFrame):
        d: dict[str, Any] = {"type": "error", "code": item.code, "message": item.message}
        if item.request_id is not None:
            d["request_id"] = item.request_id
        return d
    if isinstance(item, ProgressFrame):
        return {"type": "progress", "request_id": item.request_id, "prompt_tokens_done": item.prompt_tokens_done,
                "prompt_tokens": item.prompt_tokens, "cached_tokens": item.cached_tokens}
    if isinstance(item, DeltaFrame):
        d = {"type": "delta", "request_id": item.request_id, "text": item.text, "token_ids": item.token_ids}
        if item.logprobs:
            d["logprobs"] = item.logprobs
        if item.trim_prior:
            d["trim_prior"] = item.trim_prior
        if item.tool_calls:
            d["tool_calls"] = item.tool_calls
        if item.prompt_logprobs:
            d["prompt_logprobs"] = item.prompt_logprobs
        if item.usage is not None:
            d["usage"] = {"prompt_tokens": item.usage.prompt_tokens, "cached_tokens": item.usage.cached_tokens}
        return d
    d = {"type": "done", "request_id": item.request_id, "text": item.text, "token_ids": item.token_ids}
    if item.logprobs:
        d["logprobs"] = item.logprobs
    if item.trim_prior:
        d["trim_prior"] = item.trim_prior
    if item.tool_calls:
        d["tool_calls"] = item.tool_calls
    d.update(finish_reason=item.finish_reason, stop_reason=item.stop_reason, output_text=item.output_text,
             output_token_ids=item.output_token_ids, prompt_token_ids=item.prompt_token_ids,
             prefix_reused=item.prefix_reused, usage=asdict(item.usage), timings=asdict(item.timings))
    if item.output_tool_calls is not None:
        d["output_tool_calls"] = item.output_tool_calls
    if item.prompt_logprobs:
        d["prompt_logprobs"] = item.prompt_logprobs
    return d


def to_dict(frame: Frame) -> dict[str, Any]:
    """The JSON object of a frame (the wire layout of docs/protocol.md section 1)."""
    if isinstance(frame, (ProgressFrame, DeltaFrame, DoneFrame, ErrorFrame)):
        return _item_dict(frame)
    if isinstance(frame, StepFrame):
        return {"type": "step", "items": [_item_dict(i) for i in frame.items]}
    if isinstance(frame, HelloFrame):
        return {"type": "hello", "protocol_version": frame.protocol_version, **asdict(frame.info)}
    if isinstance(frame, StatsFrame):
        return {"type": "stats", **frame.stats, "age_ms": frame.age_ms}
    if isinstance(frame, GenerateFrame):
        d: dict[str, Any] = {"type": "generate", "request_id": frame.request_id}
        for key in ("messages", "prompt_token_ids", "prompt", "prefix_token_ids", "params", "tools", "tool_choice",
                    "parallel_tool_calls"):
            if getattr(frame, key) is not None:
                d[key] = getattr(frame, key)
        if frame.cache_salt:
            d["cache_salt"] = frame.cache_salt
        if frame.clamp_max_tokens:
            d["clamp_max_tokens"] = True
        if frame.continued_tokens:
            d["continued_tokens"] = frame.continued_tokens
        if frame.shared_messages is not None:
            d["shared_messages"] = frame.shared_messages
        if frame.continue_final_message:
            d["continue_final_message"] = True
        if frame.kv_source is not None:
            d["kv_source"] = frame.kv_source
        return d
    if isinstance(frame, KvFetchFrame):
        return {"type": "kv_fetch", "request_id": frame.request_id, "prompt_token_ids": frame.prompt_token_ids,
                "first_page": frame.first_page, "num_pages": frame.num_pages, "cache_salt": frame.cache_salt,
                "shared_tokens": frame.shared_tokens}
    if isinstance(frame, KvFetchDoneFrame):
        d = {"type": "kv_fetch_done", "request_id": frame.request_id, "pages": frame.pages}
        if frame.error:
            d["error"] = frame.error
        return d
    if isinstance(frame, AbortFrame):
        return {"type": "abort", "request_id": frame.request_id}
    if isinstance(frame, StatsRequest):
        return {"type": "stats"}
    if isinstance(frame, PingFrame):
        return {"type": "ping"}
    if isinstance(frame, PongFrame):
        return {"type": "pong"}
    if isinstance(frame, KvEventsFrame):
        d = {"type": "kv_events", "stored": frame.stored, "removed": frame.removed}
        if frame.reset:
            d["reset"] = True
        return d
    if isinstance(frame, KvSubscribeFrame):
        return {"type": "kv_subscribe"}
    raise TypeError(f"not a protocol frame: {type(frame).__name__}")


def encode(frame: Frame) -> str:
    """The JSON text of a frame (non-ASCII characters as they are)."""
    return json.dumps(to_dict(frame), ensure_ascii=False)


# ----- decoding ------------------------------------------------------------------------

def _obj(text: str | bytes) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        raise FrameError("frame is not valid JSON (or nests too deeply)") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise FrameError("frame must be an object with a string 'type'")
    return obj


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ..., what: str = "") -> Any:
    """``d[key]`` checked against ``kind`` (None allowed when ``default`` is None)."""
    if key not in d or (d[key] is None and default is None):
        if default is ...:
            raise FrameError(f"{what or d.get('type')} frame needs '{key}'")
        return default
    v = d[key]
    # bool is an int in Python; a count given as true/false is still malformed
    if not isinstance(v, kind) or (isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise FrameError(f"'{key}' of a {what or d.get('type')} frame has the wrong type ({type(v).__name__})")
    return v


def _int_list(d: dict[str, Any], key: str, default: Any = ...) -> Any:
    v = _get(d, key, list, default)
    if v is not None and v is not default and not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise FrameError(f"'{key}' of a {d.get('type')} frame must be a list of integers")
    return v


def _rid(d: dict[str, Any]) -> str:
    rid = _get(d, "request_id", str)
    if not rid:
        raise FrameError(f"{d.get('type')} frame needs a non-empty string request_id")
    return str(rid)


_PLAIN_DELTA_KEYS = frozenset({"type", "request_id", "text", "token_ids"})


def _item(d: dict[str, Any]) -> ReplyItem:
    kind = d.get("type")
    if kind == "delta" and d.keys() <= _PLAIN_DELTA_KEYS:
        # the common item (text and token ids only): the same frame as the checked path
        # below, in a fraction of its time; anything off goes there for its error
        rid, text, ids = d.get("request_id"), d.get("text", ""), d.get("token_ids", [])
        if type(rid) is str and rid and type(text) is str and type(ids) is list and all(type(x) is int for x in ids):
            return DeltaFrame(rid, text, ids)
    if kind == "error":
        rid = _get(d, "request_id", str, None)
        return ErrorFrame(str(_get(d, "code", str)), str(_get(d, "message", str, "")), rid)
    if kind == "progress":
        done, total = int(_get(d, "prompt_tokens_done", int)), int(_get(d, "prompt_tokens", int))
        cached = int(_get(d, "cached_tokens", int, 0))
        if not 0 <= cached <= done <= total:
            raise FrameError("a progress frame needs 0 <= cached_tokens <= prompt_tokens_done <= prompt_tokens")
        return ProgressFrame(_rid(d), done, total, cached)
    if kind not in ("delta", "done"):
        raise FrameError(f"unknown reply item type {kind!r}")
    rid = _rid(d)
    text = _get(d, "text", str, "")
    ids = _int_list(d, "token_ids", [])
    logprobs = _get(d, "logprobs", list, None)
    trim = int(_get(d, "trim_prior", int, 0))
    if trim < 0:
        raise FrameError(f"'trim_prior' of a {kind} frame must be >= 0")
    tool_calls = _dict_list(d, "tool_calls")
    prompt_logprobs = _dict_list(d, "prompt_logprobs")
    usage, timings = _get(d, "usage", dict, {}), _get(d, "timings", dict, {})
    try:
        u = Usage(**{k: int(usage.get(k, 0)) for k in ("prompt_tokens", "cached_tokens", "completion_tokens",
                                                               "cached_disk_tokens", "cached_host_tokens")})
    except (TypeError, ValueError):
        raise FrameError(f"usage of a {kind} frame must hold numbers") from None
    if kind == "delta":
        return DeltaFrame(rid, text, ids, logprobs, trim, tool_calls, prompt_logprobs, u if "usage" in d else None)
    try:
        t = Timings(ttft_ms=float(timings.get("ttft_ms", 0.0)), tpot_ms=float(timings.get("tpot_ms", 0.0)),
                    e2e_ms=float(timings.get("e2e_ms", 0.0)), queue_ms=float(timings.get("queue_ms", 0.0)),
                    draft_tokens=int(timings.get("draft_tokens", 0)),
                    accepted_tokens=int(timings.get("accepted_tokens", 0)),
                    acceptance_rate=float(timings.get("acceptance_rate", 0.0)),
                    tokens_per_step=float(timings.get("tokens_per_step", 0.0)))
    except (TypeError, ValueError):
        raise FrameError("usage/timings of a done frame must hold numbers") from None
    stop_reason = d.get("stop_reason")
    if stop_reason is not None and not isinstance(stop_reason, (str, int)):
        raise FrameError("'stop_reason' of a done frame must be a string, an integer or null")
    return DoneFrame(rid, text, ids, logprobs, str(_get(d, "finish_reason", str, "stop")), stop_reason,
                     str(_get(d, "output_text", str, "")), _int_list(d, "output_token_ids", []),
                     _int_list(d, "prompt_token_ids", []), bool(_get(d, "prefix_reused", bool, False)), u, t,
                     trim, tool_calls, _dict_list(d, "output_tool_calls"), prompt_logprobs)


def _dict_list(d: dict[str, Any], key: str) -> list[dict[str, Any]] | None:
    """``d[key]`` as a list of objects, or None when absent."""
    v = _get(d, key, list, None)
    if v is None:
        return None
    if not all(isinstance(x, dict) for x in v):
        raise FrameError(f"'{key}' of a {d.get('type')} frame must be a list of objects")
    return list(v)


_INFO_KEYS = frozenset(EngineInfo.__dataclass_fields__)


def decode_engine_frame(text: str | bytes) -> EngineFrame:
    """Parse a frame the engine sent (gateway side).

    Raises:
        FrameError: not JSON, an unknown type, or a field missing or of the wrong type.
    """
    d = _obj(text)
    kind = d["type"]
    if kind == "step":
        items = _get(d, "items", list)
        out: list[ReplyItem] = []
        for it in items:
            if not isinstance(it, dict):
                raise FrameError("the items of a step frame must be objects")
            out.append(_item(it))
        return StepFrame(out)
    if kind in ("progress", "delta", "done", "error"):
        return _item(d)
    if kind == "stats":
        age = _get(d, "age_ms", (int, float), 0.0)
        return StatsFrame({k: v for k, v in d.items() if k not in ("type", "age_ms")}, float(age))
    if kind == "pong":
        return PongFrame()
    if kind == "kv_events":
        stored, removed = _int_list(d, "stored", []), _int_list(d, "removed", [])
        if not all(0 <= h < 1 << 64 for h in (*stored, *removed)):
            raise FrameError("kv_events hashes must be unsigned 64-bit integers")
        return KvEventsFrame(stored, removed, bool(_get(d, "reset", bool, False)))
    if kind == "kv_fetch_done":
        pages = int(_get(d, "pages", int, 0))
        if pages < 0:
            raise FrameError("'pages' of a kv_fetch_done frame must be >= 0")
        return KvFetchDoneFrame(_rid(d), pages, str(_get(d, "error", str, "")))
    if kind == "hello":
        info = {k: v for k, v in d.items() if k in _INFO_KEYS}
        for key in ("max_model_len", "block_size", "num_blocks"):
            _get(d, key, int)
        _get(d, "model", str)
        try:
            return HelloFrame(EngineInfo(**info), int(_get(d, "protocol_version", int, 1)))
        except TypeError as e:
            raise FrameError(f"bad hello frame: {e}") from None
    raise FrameError(f"unknown engine frame type {kind!r}")


GENERATE_FIELDS = frozenset({"type", "request_id", "messages", "prompt_token_ids", "prefix_token_ids", "params",
                             "cache_salt", "clamp_max_tokens", "continued_tokens", "shared_messages", "prompt",
                             "tools", "tool_choice", "parallel_tool_calls", "continue_final_message",
                             "kv_source"})


def decode_client_frame(text: str | bytes) -> ClientFrame:
    """Parse a frame the gateway sent (engine side). Checks the layout only; the
    engine validates ``params`` and the prompt itself.

    Raises:
        FrameError: not JSON, an unknown type or field, or a field of the wrong type.
    """
    d = _obj(text)
    kind = d["type"]
    if kind == "ping":
        return PingFrame()
    if kind == "stats":
        return StatsRequest()
    if kind == "kv_subscribe":
        return KvSubscribeFrame()
    if kind == "abort":
        return AbortFrame(_rid(d))
    if kind == "generate":
        rid = _rid(d)
        try:
            unknown = sorted(set(d) - GENERATE_FIELDS)
            if unknown:
                raise FrameError(f"unknown field(s) in generate: {', '.join(unknown)}")
            messages = _get(d, "messages", list, None)
            if messages is not None and not all(isinstance(m, dict) for m in messages):
                raise FrameError("'messages' must be a list of objects")
            shared = _get(d, "shared_messages", list, None)
            if shared is not None and not all(isinstance(m, dict) for m in shared):
                raise FrameError("'shared_messages' must be a list of objects")
            tool_choice = d.get("tool_choice")
            if tool_choice is not None and not isinstance(tool_choice, (str, dict)):
                raise FrameError("'tool_choice' must be a string or an object")
            return GenerateFrame(rid, messages, _int_list(d, "prompt_token_ids", None),
                                 _int_list(d, "prefix_token_ids", None), _get(d, "params", dict, None),
                                 str(_get(d, "cache_salt", str, "")),
                                 bool(_get(d, "clamp_max_tokens", bool, False)),
                                 int(_get(d, "continued_tokens", int, 0)), shared,
                                 _get(d, "prompt", str, None), _dict_list(d, "tools"), tool_choice,
                                 _get(d, "parallel_tool_calls", bool, None),
                                 bool(_get(d, "continue_final_message", bool, False)),
                                 _get(d, "kv_source", str, None))
        except FrameError as e:
            raise FrameError(e.message, rid) from None
    if kind == "kv_fetch":
        rid = _rid(d)
        try:
            ids = _int_list(d, "prompt_token_ids")
            first, num = int(_get(d, "first_page", int, 0)), int(_get(d, "num_pages", int, 0))
            shared = int(_get(d, "shared_tokens", int, 0))
            if first < 0 or num < 0 or shared < 0:
                raise FrameError("first_page, num_pages and shared_tokens of a kv_fetch frame must be >= 0")
            return KvFetchFrame(rid, ids, first, num, str(_get(d, "cache_salt", str, "")), shared)
        except FrameError as e:
            raise FrameError(e.message, rid) from None
    raise FrameError(f"unknown frame type {kind!r}")
