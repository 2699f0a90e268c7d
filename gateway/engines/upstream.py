"""Existing OpenAI-compatible servers as engines (docs/scaling.md, "Existing engines as
upstreams").

An entry of ``ENGINE_URLS`` with an ``http://`` or ``https://`` scheme names the base of
an OpenAI chat API, e.g. ``http://vllm:8000/v1``: vLLM, SGLang, llama.cpp's
``llama-server``, or another gateway of this project (its ``/v1``). ``ws://`` and
``wss://`` entries stay our own engines (``gateway.engines.client.EngineClient``);
``engine_client`` builds the right client for each url.

``UpstreamClient`` offers the interface the router and the reply path use
(``url``, ``healthy``, ``info``, ``start``/``close``, ``generate`` returning an
``EngineRequest`` that yields ``DeltaFrame``s then one ``DoneFrame`` or ``ErrorFrame``,
``abort``, ``stats``). It is an ``EngineClient`` whose transport is HTTP: it reuses the
request handles, the health flag and the failure path of the WebSocket client, and
replaces the connection loop (a health probe), ``generate``, ``abort`` and ``stats``.

* A reply is one streamed ``POST {base}/chat/completions`` (``stream: true``,
  ``stream_options.include_usage``); each Server-Sent Event with text becomes a
  ``DeltaFrame``, and the end a ``DoneFrame`` with the upstream's ``finish_reason``,
  ``usage`` (``prompt_tokens_details.cached_tokens``, else llama-server's
  ``timings.cache_n``) and timings measured here. Aborting closes the stream (vLLM,
  SGLang, llama-server and our gateway stop a request whose client went away).
* Health: ``GET {base}/models`` at start, every ``health_interval_s`` seconds, and at
  once after a request failed to reach the upstream; while it fails, retries back off
  (0.1 s doubling to ``max_backoff_s``, with jitter), as the WebSocket client reconnects.
  ``info`` comes from that answer: the first model's ``id`` (a filesystem path shown by
  its last part, ``shown_model_name``); its context from vLLM's and
  SGLang's ``max_model_len`` or llama-server's ``meta.n_ctx`` (else its ``/props``),
  else ``max_model_len`` given here (0: unknown, the page then shows no context meter).
* Reasoning the upstream sends apart (``reasoning_content``, or ``reasoning``) goes into
  the text between the reasoning markers, as our engine's replies hold it
  (``gateway/reasoning.py``), so it is shown, stored and sent on alike.
* No token ids: ``DeltaFrame``/``DoneFrame`` carry text only, so the gateway stores no
  token segments for the turn and sends the next one as the whole chat's text; a prompt
  given as token ids (Continue) is refused with ``invalid_request``.
* The API key (``UPSTREAM_API_KEY``) goes in ``Authorization: Bearer``; it is never part
  of the url (urls show in ``/metrics`` and logs).
* Errors (``upstream_error``, ``upstream_event_error``): an upstream that cannot serve
  (down, 401/403/404/408, 5xx before streaming) is ``engine_unavailable``, and the reply
  moves to another engine while nothing was produced; a refused request (another 4xx) is
  ``invalid_request`` or ``context_length_exceeded``. Anything else the upstream reports,
  a 429 before streaming or an ``error`` event in the stream (a rate limit after some
  text), is an ``UpstreamError``: the upstream's own code and message, and an HTTP
  status for the clients that need one (the upstream's 4xx, else 502).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from engine.protocol import DeltaFrame, DoneFrame, EngineInfo, ErrorFrame, ReplyItem, Timings, Usage
from gateway.config import GatewayConfig
from gateway.engines.client import UNREACHABLE_WARN_S, EngineClient, EngineRequest, engine_unavailable
from gateway.engines.disagg import PrefillPlan
from gateway.errors import GatewayError
from gateway.reasoning import DEFAULT_MARKERS, ThinkMarkers
from gateway.retry import Backoff, Outage

log = logging.getLogger("gateway.engines.upstream")

__all__ = ["UpstreamClient", "UpstreamError", "engine_client", "is_upstream_url", "shown_model_name",
           "upstream_body", "upstream_error", "upstream_event_error"]

UPSTREAM_SCHEMES = ("http://", "https://")
READ_TIMEOUT_S = 600.0  # longest silence (seconds) inside one streamed reply before it is given up
KEEPALIVE_EXPIRY_S = 2.0  # below llama-server's 5 s idle timeout: a pooled connection is never stale
# our finish reasons; any other an upstream sends (tool_calls, content_filter, ...) reads as "stop"
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
CONTEXT_RE = re.compile(r"context (length|size|window)|maximum context|exceeds? the (available )?context",
                        re.IGNORECASE)
# our sampling parameters that an OpenAI-compatible server takes under the same name;
# the rest: top_k, min_p, repetition_penalty and ignore_eos as vLLM names them (sent only
# when set to a value that does something), stop_token_ids and logprobs never (token ids
# of our tokenizer mean nothing to another server; the reply path asks no logprobs)
OPENAI_PARAMS = ("max_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty")
NEUTRAL_EXTENSIONS: dict[str, Any] = {"top_k": (0, -1), "min_p": (0, 0.0), "repetition_penalty": (1, 1.0),
                                      "ignore_eos": (False,)}
LLAMACPP_NAMES = {"repetition_penalty": "repeat_penalty"}  # llama-server's names for vLLM's
# an upstream's own error code is passed on when it looks like one (OpenAI's are snake_case)
CODE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
# what an upstream's error type or code implies about the HTTP status, when it names none
KIND_STATUS = (("rate_limit", 429), ("too_many_requests", 429), ("invalid_request", 400),
               ("authentication", 401), ("permission", 403), ("not_found", 404))


@dataclass
class UpstreamError(ErrorFrame):
    """An OpenAI-compatible upstream's own error, passed on to the client as it is.

    Attributes:
        code, message: the upstream's (``CODE_RE``), else ``upstream_error`` and ours.
        status: the HTTP status a client that needs one gets (``/v1`` without streaming):
            the upstream's 4xx (429 for a rate limit), else 502 (the upstream failed).
        retry_elsewhere: another engine may serve the request (a rate limit): the reply
            moves there while nothing was produced.
    """

    status: int = 502
    retry_elsewhere: bool = False


def is_upstream_url(url: str) -> bool:
    """True for an OpenAI-compatible upstream (an ``http(s)://`` url), False for our engine (``ws(s)://``)."""
    return url.lower().startswith(UPSTREAM_SCHEMES)


def engine_client(url: str, config: GatewayConfig) -> EngineClient:
    """The client for one ``ENGINE_URLS`` entry: an ``UpstreamClient`` for ``http(s)://``
    (with ``config.upstream_api_key`` and ``config.upstream_max_model_len``), else our
    engine's ``EngineClient`` (with ``config.engine_secret``)."""
    if is_upstream_url(url):
        return UpstreamClient(url, api_key=config.upstream_api_key, max_model_len=config.upstream_max_model_len,
                              think_markers=config.think_markers)
    return EngineClient(url, secret=config.engine_secret)


def shown_model_name(model_id: str) -> str:
    """The model name users see for an upstream's model id: a filesystem path (llama-server
    and vLLM name a model by the path it was loaded from, unless given an alias) becomes
    its last part, so no server path is shown; any other id is kept (``org/model``)."""
    return model_id.rstrip("/").rsplit("/", 1)[-1] if model_id.startswith("/") else model_id


def upstream_body(model: str, messages: list[dict[str, str]], params: dict[str, Any] | None,
                  flavor: str = "") -> dict[str, Any]:
    """The streamed ``/chat/completions`` body for our ``params`` (``SamplingParams`` keys).

    OpenAI's fields pass as they are; ``seed`` unless unset (None or -1); ``stop`` when
    not empty; ``top_k``, ``min_p``, ``repetition_penalty`` and ``ignore_eos`` (vLLM's
    names, which SGLang and our gateway take too; llama-server's ``repeat_penalty`` when
    ``flavor`` is "llamacpp") only when they change something, so a strict server (the
    OpenAI API itself) is not sent fields it refuses for a plain request;
    ``stop_token_ids`` and ``logprobs`` never.
    """
    p = params or {}
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}}
    for k in OPENAI_PARAMS:
        if p.get(k) is not None:
            body[k] = p[k]
    if p.get("seed") is not None and p["seed"] != -1:
        body["seed"] = p["seed"]
    stop = p.get("stop")
    if stop:
        body["stop"] = [stop] if isinstance(stop, str) else list(stop)
    for k, neutral in NEUTRAL_EXTENSIONS.items():
        if k in p and p[k] is not None and p[k] not in neutral:
            body[LLAMACPP_NAMES.get(k, k) if flavor == "llamacpp" else k] = p[k]
    return body


def upstream_error(status: int, raw: bytes | str, request_id: str | None = None) -> ErrorFrame:
    """Our error item for an upstream's HTTP error answer (before any event).

    ``context_length_exceeded`` when the upstream says so (its ``code``, llama-server's
    ``exceed_context_size_error`` type, or a message about the context length); other
    4xx but 401/403/404/408/429: ``invalid_request``; 401, 403, 404 (the model is gone),
    408 and 5xx: ``engine_unavailable`` (the request may go to another engine); 429: the
    upstream's own rate-limit error (``UpstreamError``, status 429, tried on another engine
    first); anything else (a redirect) an ``UpstreamError`` with status 502. The
    upstream's message is kept in ours.
    """
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    message, code, kind = text.strip()[:500], "", ""
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, str):
            message = err
        elif isinstance(err, dict):
            message = str(err.get("message") or message)
            code, kind = str(err.get("code") or ""), str(err.get("type") or "")
    where = f"the upstream answered HTTP {status}"
    if code == "context_length_exceeded" or kind == "exceed_context_size_error" or CONTEXT_RE.search(message):
        return ErrorFrame("context_length_exceeded", message or where, request_id)
    if status == 429:
        return UpstreamError(_own_code(code, kind, "rate_limit_exceeded"), message or where, request_id, 429, True)
    if status in (401, 403, 404, 408) or status >= 500:
        return ErrorFrame("engine_unavailable", f"{where}: {message}" if message else where, request_id)
    if 400 <= status < 500:
        return ErrorFrame("invalid_request", f"{where}: {message}" if message else where, request_id)
    return UpstreamError("upstream_error", f"{where}: {message}" if message else where, request_id, 502)


def upstream_event_error(body: dict[str, Any], request_id: str | None = None) -> ErrorFrame:
    """Our error item for an ``error`` event inside an upstream's streamed reply (a rate
    limit or a failure after some text): ``{"error": {"message", "type", "code"}}`` as
    OpenAI, vLLM, SGLang and llama-server send it (vLLM's and llama-server's ``code`` is
    the HTTP status), or the bare ``{"object": "error", ...}``.

    ``context_length_exceeded`` as in ``upstream_error``; anything else an
    ``UpstreamError`` with the upstream's code (its ``code`` when a snake_case word, else
    its ``type``, else ``upstream_error``), its message, and its status (a numeric
    ``code`` or ``status``; else what its type says: 429 for a rate limit; else 502).
    """
    err = body.get("error", body)
    err = err if isinstance(err, dict) else {"message": str(err)}
    message = str(err.get("message") or "the upstream reported an error")[:2000]
    code, kind = err.get("code"), str(err.get("type") or "")
    if code == "context_length_exceeded" or kind == "exceed_context_size_error" or CONTEXT_RE.search(message):
        return ErrorFrame("context_length_exceeded", message, request_id)
    status = next((int(v) for v in (code, err.get("status"), err.get("status_code"))
                   if isinstance(v, int) and not isinstance(v, bool) and 400 <= v < 600), 0)
    named = f"{code if isinstance(code, str) else ''} {kind}".lower()
    status = status or next((s for word, s in KIND_STATUS if word in named), 502)
    own = _own_code(code if isinstance(code, str) else "", kind, "upstream_error")
    return UpstreamError(own, message, request_id, status if 400 <= status < 500 else 502, status == 429)


def _own_code(code: str, kind: str, default: str) -> str:
    """The upstream's error code when it is a snake_case word, else its type, else ``default``."""
    return next((c for c in (code, kind) if c and CODE_RE.fullmatch(c)), default)


def _int(v: Any) -> int:
    """``v`` as a count, 0 when it is not a number."""
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


def _cached_tokens(usage: dict[str, Any], timings: dict[str, Any]) -> int:
    """Prompt tokens the upstream served from its cache: ``usage.prompt_tokens_details.
    cached_tokens`` (OpenAI's field: vLLM with ``--enable-prompt-tokens-details``,
    llama-server, our gateway), else llama-server's ``timings.cache_n``, else 0."""
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        return _int(details["cached_tokens"])
    return _int(timings.get("cache_n"))


class _Reply:
    """What one streamed reply has shown so far (text, chunks, usage, times)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None  # perf_counter of the first text
        self.parts: list[str] = []
        self.chunks = 0  # events with text (about one token each on vLLM and llama-server)
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}
        self.timings: dict[str, Any] = {}
        self.reasoning = False  # inside the reasoning the upstream sends as reasoning_content

    def done(self, request_id: str, finish_reason: str) -> DoneFrame:
        """The ``DoneFrame`` for this reply (times in ms, measured by the gateway; without
        usage from the upstream, the completion counts one token per text event)."""
        end = time.perf_counter()
        completion = _int(self.usage.get("completion_tokens")) if "completion_tokens" in self.usage else self.chunks
        ttft = (self.first - self.t0) * 1000 if self.first is not None else 0.0
        e2e = (end - self.t0) * 1000
        tpot = (e2e - ttft) / (completion - 1) if completion > 1 and self.first is not None else 0.0
        usage = Usage(_int(self.usage.get("prompt_tokens")), _cached_tokens(self.usage, self.timings), completion)
        return DoneFrame(request_id, finish_reason=finish_reason, output_text="".join(self.parts), usage=usage,
                         timings=Timings(ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e, tokens_per_step=1.0))


class UpstreamClient(EngineClient):
    """An OpenAI-compatible server used as an engine (see the module doc).

    ``healthy`` means the last ``GET {base}/models`` answered 200 and no request has
    failed to reach the server since. ``stats()`` answers from this gateway's own
    counts (an upstream reports no KV blocks): ``running`` is its requests in flight
    there, ``waiting`` 0.

    Args:
        url: the API base, ``http(s)://host:port/v1`` (a trailing ``/`` is ignored).
        api_key: sent as ``Authorization: Bearer`` (None: no header).
        max_model_len: the context (tokens) to show when the upstream does not report
            one; 0 means unknown.
        max_backoff_s: the longest wait between health probes while it is down (seconds).
        open_timeout_s: connect timeout of every request, and the whole probe's timeout (seconds).
        health_interval_s: how often a healthy upstream is probed (seconds).
        read_timeout_s: longest wait for the next bytes of a streamed reply (seconds).
        think_markers: the markers a reply's ``reasoning_content`` is put between in its
            text (``gateway/reasoning.py``).
    """

    takes_token_ids = False

    def __init__(self, url: str, api_key: str | None = None, max_model_len: int = 0, max_backoff_s: float = 5.0,
                 open_timeout_s: float = 10.0, health_interval_s: float = 10.0,
                 read_timeout_s: float = READ_TIMEOUT_S, think_markers: ThinkMarkers = DEFAULT_MARKERS) -> None:
        super().__init__(url, max_backoff_s=max_backoff_s, open_timeout_s=open_timeout_s)
        self.base = url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.default_max_model_len = max_model_len
        self.health_interval_s = health_interval_s
        self.read_timeout_s = read_timeout_s
        self.think_markers = think_markers
        self.model_id = ""  # the model as the upstream names it (sent in requests)
        self.flavor = ""  # the models list's ``owned_by``: "vllm", "sglang", "llamacpp", "chatserve", ...
        self._http: httpx.AsyncClient | None = None
        self._streams: dict[str, asyncio.Task[None]] = {}
        self._aborting: set[str] = set()  # replies whose stream task was cancelled
        self._probe_now = asyncio.Event()
        self.counters = {"requests_total": 0, "aborted_total": 0, "prompt_tokens_total": 0,
                         "cached_tokens_total": 0, "completion_tokens_total": 0}

    # ---- lifecycle and health ------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.read_timeout_s, connect=self.open_timeout_s),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                    keepalive_expiry=KEEPALIVE_EXPIRY_S))
        return self._http

    async def close(self) -> None:
        """Abort every streamed reply, stop probing and close the HTTP connections."""
        streams = list(self._streams.values())
        for t in streams:
            t.cancel()
        if streams:
            await asyncio.gather(*streams, return_exceptions=True)
        await super().close()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _run(self) -> None:
        """The health loop (replaces the WebSocket client's connection loop)."""
        backoff = Backoff(0.1, self.max_backoff_s, jitter=0.5)
        outage = Outage(f"upstream {self.url}", log, warn_after_s=UNREACHABLE_WARN_S,
                        log_every_s=UNREACHABLE_WARN_S, since=time.monotonic())
        while True:
            try:
                info = await asyncio.wait_for(self._probe(), self.open_timeout_s)
                if not self.healthy:
                    log.info("upstream %s is up (%s, %s)", self.url, info.model, self.flavor or "unknown server")
                self.info = info
                self._ready.set()
                backoff.reset()
                outage.up()
                wait = self.health_interval_s
            except asyncio.CancelledError:
                raise
            except Exception as e:  # any failure means "down, probe again"; logged without a traceback
                outage.down(e)
                self._ready.clear()
                wait = backoff.next_delay()
            self._probe_now.clear()
            try:
                await asyncio.wait_for(self._probe_now.wait(), wait)
            except asyncio.TimeoutError:
                pass

    def _suspect(self) -> None:
        """A request could not reach the upstream: not healthy until a probe says so."""
        self._ready.clear()
        self._probe_now.set()

    async def _probe(self) -> EngineInfo:
        """``GET {base}/models``: what the upstream serves.

        Raises:
            ConnectionError: not a 200 with a model list.
            httpx.HTTPError: the request failed.
        """
        http = self._client()
        r = await http.get(f"{self.base}/models", headers=self._auth)
        if r.status_code != 200:
            raise ConnectionError(upstream_error(r.status_code, r.content).message)
        listing = r.json()
        data = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or not data[0].get("id"):
            raise ConnectionError("GET /models listed no model")
        card = data[0]
        self.flavor = str(card.get("owned_by") or "")
        meta = card.get("meta")
        meta = meta if isinstance(meta, dict) else {}
        n_ctx = _int(card.get("max_model_len")) or _int(meta.get("n_ctx"))
        if not n_ctx and self.flavor == "llamacpp":
            n_ctx = await self._llamacpp_n_ctx()
        self.model_id = str(card["id"])
        return EngineInfo(model=shown_model_name(self.model_id), max_model_len=n_ctx or self.default_max_model_len,
                          block_size=0, num_blocks=0,
                          format=f"OpenAI-compatible upstream ({self.flavor or 'unknown server'})")

    async def _llamacpp_n_ctx(self) -> int:
        """llama-server's context per slot from ``/props`` (next to ``/v1``), or 0."""
        root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        try:
            r = await self._client().get(f"{root}/props", headers=self._auth)
            settings = r.json().get("default_generation_settings", {}) if r.status_code == 200 else {}
            return _int(settings.get("n_ctx")) if isinstance(settings, dict) else 0
        except (httpx.HTTPError, ValueError, AttributeError):
            return 0

    # ---- requests -----------------------------------------------------------------

    async def generate(self, request_id: str, messages: list[dict[str, str]] | None = None,
                       prefix_token_ids: list[int] | None = None, params: dict[str, Any] | None = None,
                       prompt_token_ids: list[int] | None = None, cache_salt: str | None = None,
                       clamp_max_tokens: bool = False, continued_tokens: int = 0,
                       shared_messages: list[dict[str, str]] | None = None,
                       extra: dict[str, Any] | None = None,
                       prefill: PrefillPlan | None = None) -> EngineRequest:
        """Start a streamed reply to ``messages``; read its items from the returned handle.
        ``prefix_token_ids``, ``cache_salt``, ``shared_messages``, ``continued_tokens``,
        ``prefill`` (an upstream has no engine role) and
        ``clamp_max_tokens`` are ignored (the upstream tokenizes the text itself and keeps its own cache, and
        refuses a too-long request instead of lowering ``max_tokens``); ``extra`` (protocol 7's
        fields) is refused.

        Raises:
            GatewayError: ``engine_unavailable`` when the upstream is down;
                ``invalid_request`` for a prompt given as token ids.
        """
        if not self.healthy:
            raise engine_unavailable("not connected")
        if prompt_token_ids is not None or messages is None:
            raise GatewayError("invalid_request", "this engine is an OpenAI-compatible upstream: it takes the "
                                                  "chat's text, not token ids")
        if extra:  # tools, raw prompts...: the protocol's own fields, not relayed
            raise GatewayError("invalid_request", "this engine is an OpenAI-compatible upstream: it serves "
                                                  f"plain chat replies here, not {', '.join(sorted(extra))}")
        assert self.info is not None  # healthy: a probe set it
        body = upstream_body(self.model_id, messages, params, self.flavor)
        req = EngineRequest(self, request_id)
        self._requests[request_id] = req
        self.counters["requests_total"] += 1
        task = asyncio.create_task(self._stream(req, body), name=f"upstream {request_id}")
        self._streams[request_id] = task
        task.add_done_callback(lambda t: self._ended(request_id, t))
        return req

    async def _stream(self, req: EngineRequest, body: dict[str, Any]) -> None:
        """Run one reply: POST, read its events into ``req``'s queue, end it with one
        ``DoneFrame`` (also when cancelled: an abort) or ``ErrorFrame``."""
        rid = req.request_id
        reply = _Reply()

        def put(item: ReplyItem) -> None:
            req.queue.put_nowait(item)

        try:
            async with self._client().stream("POST", f"{self.base}/chat/completions", json=body,
                                             headers=self._auth) as resp:
                if resp.status_code != 200:
                    err = upstream_error(resp.status_code, await resp.aread(), rid)
                    if err.code == "engine_unavailable":
                        self._suspect()
                    put(err)
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank lines, comments (": ping"), "event:" names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    failed = self._event(rid, data, reply, put)
                    if failed is not None:
                        put(failed)
                        return
            if reply.finish is None:
                put(ErrorFrame("engine_unavailable", "the upstream ended the reply before its end", rid))
                return
            put(self._count(reply.done(rid, reply.finish)))
        except asyncio.CancelledError:
            # an abort (or the gateway closing): leaving the ``async with`` closed the
            # stream, which stops the request upstream
            self.counters["aborted_total"] += 1
            put(self._count(reply.done(rid, "abort")))
        except (httpx.HTTPError, OSError) as e:
            self._suspect()
            put(ErrorFrame("engine_unavailable", f"the upstream could not be reached ({type(e).__name__})", rid))

    def _ended(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._streams.get(request_id) is task:
            del self._streams[request_id]
            self._aborting.discard(request_id)

    def _event(self, rid: str, data: str, reply: _Reply, put: Callable[[ReplyItem], None]) -> ErrorFrame | None:
        """Take one ``data:`` event: its text becomes a ``DeltaFrame``; its finish reason,
        usage and llama-server timings are kept; an ``error`` event is returned."""
        try:
            chunk = json.loads(data)
        except ValueError:
            log.warning("upstream %s sent an event that is not JSON; ignored", self.url)
            return None
        if not isinstance(chunk, dict):
            return None
        if chunk.get("error") is not None or chunk.get("object") == "error":
            return upstream_event_error(chunk, rid)
        choices = chunk.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            text = self._with_reasoning(reply, delta)
            if text:
                reply.first = reply.first if reply.first is not None else time.perf_counter()
                reply.parts.append(text)
                reply.chunks += 1
                put(DeltaFrame(rid, text))
            if choice.get("finish_reason"):
                reply.finish = FINISH_REASONS.get(str(choice["finish_reason"]), "stop")
        if isinstance(chunk.get("usage"), dict):
            reply.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            reply.timings = chunk["timings"]
        return None

    def _with_reasoning(self, reply: _Reply, delta: dict[str, Any]) -> str:
        """A delta's text, with its reasoning (``reasoning_content``, as vLLM, SGLang and
        llama-server send it, or ``reasoning``) between the reasoning markers, as our
        engine's replies hold it."""
        think = delta.get("reasoning_content")
        if not isinstance(think, str):
            think = delta.get("reasoning")
        content = delta.get("content")
        out = ""
        if isinstance(think, str) and think:
            out = think if reply.reasoning else self.think_markers.open + think
            reply.reasoning = True
        if isinstance(content, str) and content:
            if reply.reasoning:
                out += self.think_markers.close + "\n\n"
                reply.reasoning = False
            out += content
        return out

    def _count(self, done: DoneFrame) -> DoneFrame:
        """Add a finished reply's usage to ``counters``; returns it."""
        u = done.usage
        self.counters["prompt_tokens_total"] += u.prompt_tokens
        self.counters["cached_tokens_total"] += u.cached_tokens
        self.counters["completion_tokens_total"] += u.completion_tokens
        return done

    async def abort(self, request_id: str) -> None:
        """Stop a reply: its stream is closed (the upstream stops the request) and its
        handle gets a ``DoneFrame`` with finish_reason "abort". Unknown ids are ignored."""
        self.abort_soon(request_id)

    def abort_soon(self, request_id: str) -> None:
        """``abort`` from synchronous code (cancelling the stream's task needs no wait)."""
        task = self._streams.get(request_id)
        # once only: the reply task re-sends an abort until the reply ends, and a second
        # cancel landing while the first one's exit closes the HTTP stream interrupts that
        # close, leaving the upstream's request running (llama-server generated on to
        # max_tokens into a socket nobody read)
        if task is not None and request_id not in self._aborting:
            self._aborting.add(request_id)
            task.cancel()

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """This gateway's view of the upstream: ``model``, ``upstream: true``, ``running``
        (its replies streaming there now), ``waiting`` 0, and the request and token
        totals of ``counters``. Also kept as ``last_stats`` (taken now).

        Raises:
            GatewayError: ``engine_unavailable`` while the upstream is down.
        """
        if not self.healthy:
            raise engine_unavailable("not connected")
        stats: dict[str, Any] = {"model": self.info.model if self.info else "", "upstream": True,
                                 "running": len(self._streams), "waiting": 0, **self.counters}
        self.last_stats, self.stats_taken_at = stats, time.monotonic()
        return dict(stats)
