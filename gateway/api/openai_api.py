"""The OpenAI-compatible API: ``POST /v1/chat/completions`` and ``GET /v1/models``
(docs/protocol.md section 4).

A request is validated (``openai_request``), then answered from an ``EngineReply``
(stateless) or a ``SessionReply`` (linked to a stored chat by the ``X-Chat-Session``
header or the ``session_id`` field). The first event is awaited before any byte is
sent, so a refused request (context too long, bad parameters, no engine) gets a real
HTTP error status even with ``stream: true``. Streaming answers are Server-Sent Events
(``data: {chunk}`` lines, then ``data: [DONE]``).

Authentication: with an API key configured every ``/v1`` request needs
``Authorization: Bearer <key>`` (401 otherwise). Who may link which chat:

* with an API key, the key has its own user (``key_user_id``): ``"new"`` chats belong
  to it, and it reaches its own chats from any process. A request that also carries a
  valid user cookie reaches that cookie user's chats too (so a script holding the
  browser's cookie continues the UI's chats). The key user comes first: HTTP clients
  that keep cookies (the ``openai`` SDK does) pick up a fresh anonymous cookie on
  their first answer, and that must not hide the key's chats.
* a personal access token (``X-Chat-Token``, or without a key also the bearer
  ``cspat_...``; see ``gateway.api.access_tokens``) names the user: its chats come first, and
  ``"new"`` chats belong to it, so they show in that user's sidebar.
* without a key, the cookie user only: the browser's, or the anonymous one the cookie
  middleware creates for a request without a cookie (its ``Set-Cookie`` lets a client
  that keeps cookies continue the chats it created).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api import api_to_engine as a2e
from gateway.api.anthropic_api import (
    CountWriter,
    MessagesWriter,
    anthropic_error_response,
    new_message_id,
    parse_messages_request,
)
from gateway.api.auth import UserIds, cookie_value, request_user
from gateway.api.completions import CompletionRequest, CompletionWriter, parse_completion_request
from gateway.api.llama_completion import LlamaCompletionWriter, needs_tokenizer, parse_llama_completion
from gateway.api.openai_chat import ChatWriter
from gateway.api.openai_choices import ChoiceSet
from gateway.api.openai_replies import (
    ClientGone,
    Delta,
    DisconnectWatcher,
    EngineReply,
    Failed,
    ReplyEvent,
    ReplySource,
    Revoked,
    SessionReply,
)
from gateway.api.openai_request import (
    NEW_SESSION,
    ChatRequest,
    OpenAIError,
    bad,
    from_gateway_error,
    openai_error_from,
    parse_chat_request,
)
from gateway.api.openai_resume import (
    CONVERSATION_HEADER,
    ResumableStreams,
    conversation_rid,
    valid_conversation_id,
)
from gateway.api.responses_api import ResponsesWriter, new_response_id, parse_responses_request
from gateway.api.revocation import Revocations
from gateway.api.socket_frames import is_valid_id
from gateway.api.sse import SSE_HEADERS, SSEResponse, json_bytes
from gateway.api.state import gateway_state
from gateway.api.tokenize_api import detokenize_body, parse_tokenize, served_tokenizer, tokenize_body
from gateway.api.validation import BadJson, loads_json
from gateway.config import BIG_FRAME_CHARS, GatewayConfig
from gateway.engines.client import EngineRouter, engine_unavailable
from gateway.errors import GatewayError, not_found
from gateway.replies.hooks import GenerationEvents
from gateway.store.sessions import SessionInfo

log = logging.getLogger("gateway.openai")

MODEL_ALIASES = ("", "default")  # besides the served name; an omitted model is the same
SESSION_HEADER = "x-chat-session"
IDEMPOTENCY_HEADER = "idempotency-key"
_IDEMPOTENCY_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
__all__ = ["SSE_HEADERS", "SSEResponse", "json_bytes", "openai_routes"]  # re-exported for older imports


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON response built with ``json_bytes``."""
    return Response(json_bytes(obj), status_code=status, media_type="application/json", headers=headers)


def error_response(e: OpenAIError) -> Response:
    """The OpenAI error body with its status (a 401 says how to authenticate, RFC 9110)."""
    headers = {"www-authenticate": 'Bearer realm="chatserve"'} if e.status == 401 else None
    return json_response(e.body(), e.status, headers)


def key_user_id(secret: str, api_key: str) -> str:
    """The user that owns chats linked with ``api_key`` and no user cookie: 32 hex
    characters of HMAC-SHA256(gateway secret, key), the shape of a cookie user id."""
    return hmac.new(secret.encode(), b"openai-api-key\0" + api_key.encode(), hashlib.sha256).hexdigest()[:32]


def resolve_model(router: EngineRouter, requested: str | None, aliases: tuple[str, ...] = ()) -> str | None:
    """The model name a request may use: None (any engine) for an omitted name or an
    alias, else the requested name when some engine serves it. ``aliases``
    (``GatewayConfig.model_aliases``; ``*``: any name) are more names for the one model
    served, while only one is.

    Raises:
        OpenAIError: 404 ``model_not_found`` for a name no engine serves.
        GatewayError: ``engine_unavailable`` when no engine is connected.
    """
    if not router.healthy:
        raise engine_unavailable("no engine is connected")
    if requested is None or requested in MODEL_ALIASES:
        return None
    served = {c.info.model for c in router.clients if c.info is not None}
    if requested not in served and ("*" in aliases or requested in aliases) and len(served) == 1:
        return None
    if requested not in served:
        raise OpenAIError(404, f"The model `{requested}` does not exist; this server serves "
                          f"{', '.join(sorted(served)) or 'no model yet'}", "invalid_request_error", "model",
                          "model_not_found")
    return requested


def requested_model(request: Request, requested: str | None) -> str | None:
    """``resolve_model`` with the running gateway's router and model aliases (same errors)."""
    state = gateway_state(request)
    return resolve_model(state.router, requested, state.config.model_aliases)


class Writer(Protocol):
    """Builds one API's answer from a request's reply events (``openai_chat.ChatWriter``
    and the other APIs' writers): streamed events (whole SSE frames) or a whole body."""

    def start_events(self) -> list[bytes]: ...

    def stream_events(self, index: int, ev: ReplyEvent) -> list[bytes]: ...

    def end_events(self) -> list[bytes]: ...

    def error_event(self, e: OpenAIError) -> list[bytes]: ...

    def take(self, index: int, ev: ReplyEvent) -> None: ...

    def body(self) -> dict[str, Any]: ...


def resolve_any_model(router: EngineRouter, requested: str | None) -> str | None:
    """``resolve_model``, except that a name no engine serves means the one model served
    when there is only one (Anthropic's clients send their own model names, e.g.
    ``claude-sonnet-4-5``, and cannot be told another).

    Raises:
        OpenAIError: 404 ``model_not_found`` when several models are served and none is that name.
        GatewayError: ``engine_unavailable`` when no engine is connected.
    """
    try:
        return resolve_model(router, requested)
    except OpenAIError:
        if len({c.info.model for c in router.clients if c.info is not None}) == 1:
            return None
        raise


def affinity_key(messages: list[dict[str, Any]]) -> str:
    """The engine-routing key of a stateless conversation: its first two messages, which
    every later turn repeats, so all turns land on the engine that caches them."""
    return hashlib.blake2b(json_bytes(messages[:2]), digest_size=16).hexdigest()


class OpenAIApi:
    """The two routes' handlers (see module doc).

    Args:
        api_key: the key every request must present, or None for an open API.
    """

    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key or None
        self.created = int(time.time())
        self._ids: tuple[str, UserIds] | None = None
        self._resumable: ResumableStreams | None = None
        self._tasks: set[asyncio.Future[Any]] = set()

    # ---- who is asking ------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        """Check ``Authorization: Bearer`` (or Anthropic's ``x-api-key``) against the
        configured key (if any).

        Raises:
            OpenAIError: 401 ``invalid_api_key``.
        """
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if not request.headers.get("authorization") and request.headers.get("x-api-key"):
            scheme, token = "bearer", request.headers["x-api-key"]  # how Anthropic's clients send the key
        if scheme.lower() != "bearer" or not token.strip():
            raise OpenAIError(401, "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                              "invalid_request_error", None, "invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key")

    def _secret_ids(self, config: GatewayConfig) -> tuple[str, UserIds]:
        if self._ids is None:
            secret = config.resolve_secret()
            self._ids = (secret, UserIds(secret))
        return self._ids

    def owners(self, request: Request) -> list[str]:
        """The users whose chats this request may link, first choice first (module doc)."""
        state = request.scope.get("state", {})
        token_uid = request_user(request.scope) if state.get("auth") == "token" else None
        if self.api_key is not None:
            secret, ids = self._secret_ids(gateway_state(request).config)
            if token_uid is not None:  # a personal token names the user; the key only admits
                key_uid = key_user_id(secret, self.api_key)
                return [token_uid] + ([key_uid] if key_uid != token_uid else [])
            cookie_uid = ids.verify(cookie_value(request.scope))
            key_uid = key_user_id(secret, self.api_key)
            return [key_uid] + ([cookie_uid] if cookie_uid and cookie_uid != key_uid else [])
        uid = request_user(request.scope)
        if uid is None:  # UserCookieMiddleware always sets one for HTTP
            raise GatewayError("internal_error", "no user")
        return [uid]

    async def owner_of(self, request: Request, sid: str) -> tuple[str, SessionInfo | None]:
        """The first of ``owners`` that owns chat ``sid``, with the chat (the first owner
        and None for ``"new"``).

        Raises:
            GatewayError: ``not_found`` when none does.
        """
        owners = self.owners(request)
        if sid == NEW_SESSION:
            return owners[0], None
        for uid in owners:
            try:
                return uid, await gateway_state(request).store.get_session(uid, sid)
            except GatewayError as e:
                if e.code != "not_found":
                    raise
        # chats are per user: a chat made without a token is its cookie's (a one-off user
        # when the client keeps no cookies), so say what finds it, not only that it is not found
        raise GatewayError("not_found", "no such chat for this caller: a chat is found only with the access "
                                        "token, API key or cookie it was made with")

    # ---- GET /v1/models -----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the models the connected engines serve."""
        try:
            self.authorize(request)
        except OpenAIError as e:
            return error_response(e)
        seen: dict[str, Any] = {}
        for c in gateway_state(request).router.clients:
            if c.info is not None and c.info.model not in seen:
                seen[c.info.model] = {"id": c.info.model, "object": "model", "created": self.created,
                                      "owned_by": "chatserve", "max_model_len": c.info.max_model_len,
                                      "format": c.info.format or None}
        return json_response({"object": "list", "data": list(seen.values())})

    # ---- GET /slots ------------------------------------------------------------------------

    async def slots(self, request: Request) -> Response:
        """``GET /slots``: llama-server's slot list, read-only, in this server's terms: one
        entry per engine (an engine batches every request it holds; it has no fixed slots),
        ``id`` its position, ``is_processing`` whether it serves some request of this
        gateway now, ``n_processing`` how many, ``n_ctx`` its context (tokens), ``model``
        and ``healthy``. No request's text or owner is shown."""
        try:
            self.authorize(request)
        except OpenAIError as e:
            return error_response(e)
        out = [{"id": i, "model": c.info.model if c.info else None,
                "n_ctx": c.info.max_model_len if c.info else 0, "healthy": c.healthy,
                "is_processing": c.in_flight > 0, "n_processing": c.in_flight}
               for i, c in enumerate(gateway_state(request).router.clients)]
        return json_response(out)

    # ---- POST /v1/chat/completions --------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response | SSEResponse:
        """``POST /v1/chat/completions`` (see module doc)."""
        async def start() -> tuple[ChoiceSet, Writer, bool, dict[str, str]]:
            creq = parse_chat_request(await self._read_json(request))
            choices = await self._start(request, creq)
            src = choices.first
            extra = {"session_id": src.session_id} if isinstance(src, SessionReply) else {}
            headers = {"x-chat-session": src.session_id} if isinstance(src, SessionReply) else {}
            markers = gateway_state(request).config.think_markers  # reasoning_content
            return (choices, ChatWriter(creq, _completion_id(src), src.model_name, extra, markers), creq.stream,
                    headers)
        return await self.serve(request, start)

    async def chat_input_tokens(self, request: Request) -> Response | SSEResponse:
        """``POST /v1/chat/completions/input_tokens`` (llama-server's): a chat request's
        prompt tokens, ``{"input_tokens": N}``, from a one-token run as Anthropic's
        ``count_tokens`` (the engine renders the chat, tools included, as for its reply)."""
        async def start() -> tuple[ChoiceSet, Writer, bool, dict[str, str]]:
            creq = parse_chat_request(await self._read_json(request))
            model = requested_model(request, creq.model)
            params = {k: v for k, v in creq.params.items() if k not in ("logprobs", "max_tokens")}
            choices = await self.start_engine_choices(request, creq.messages, {**params, "max_tokens": 1}, 1, model,
                                                      extra=creq.extra)
            return choices, CountWriter("", choices.model_name), False, {}
        return await self.serve(request, start)

    # ---- POST /v1/completions ---------------------------------------------------------------

    async def completions(self, request: Request) -> Response | SSEResponse:
        """``POST /v1/completions``: raw prompts (``gateway/api/completions.py``)."""
        async def start() -> tuple[ChoiceSet, Writer, bool, dict[str, str]]:
            creq = parse_completion_request(await self._read_json(request))
            choices = await self._start_prompts(request, creq)
            return choices, CompletionWriter(creq, f"cmpl-{choices.request_id}", choices.model_name), creq.stream, {}
        return await self.serve(request, start)

    async def llama_completion(self, request: Request) -> Response | SSEResponse:
        """``POST /completion``: llama-server's native API (``gateway/api/llama_completion.py``)."""
        async def start() -> tuple[ChoiceSet, Writer, bool, dict[str, str]]:
            body = await self._read_json(request)
            tokenize = None
            if needs_tokenizer(body):
                tok = await served_tokenizer(gateway_state(request))
                tokenize = partial(tok.encode, add_special_tokens=False)
            creq, return_tokens = parse_llama_completion(body, tokenize)
            choices = await self._start_prompts(request, creq)
            return choices, LlamaCompletionWriter(creq, return_tokens, choices.model_name), creq.stream, {}
        return await self.serve(request, start)

    async def _start_prompts(self, request: Request, creq: CompletionRequest) -> ChoiceSet:
        """Start ``creq.n`` choices of each raw prompt (all aborted if one cannot start)."""
        model = requested_model(request, creq.model)
        sources: list[ReplySource] = []
        try:
            for p in creq.prompts:
                key = hashlib.blake2b(json_bytes(p)[:4096], digest_size=16).hexdigest()
                text = p.get("prompt")
                started = await self.start_engine_choices(
                    request, [], creq.params, creq.n, model, extra={"prompt": text} if text is not None else None,
                    prompt_token_ids=p.get("prompt_token_ids"), routing=key)
                sources += started.sources
        except BaseException:
            await ChoiceSet(sources).discard()
            raise
        return ChoiceSet(sources)

    # ---- POST /tokenize, /detokenize -------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize``: a text's token ids (``gateway/api/tokenize_api.py``)."""
        try:
            self.authorize(request)
            treq = parse_tokenize(await self._read_json(request))
            return json_response(await tokenize_body(gateway_state(request), treq))
        except OpenAIError as e:
            return error_response(e)

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize``: the text of token ids (``gateway/api/tokenize_api.py``)."""
        try:
            self.authorize(request)
            return json_response(await detokenize_body(gateway_state(request), await self._read_json(request)))
        except OpenAIError as e:
            return error_response(e)

    # ---- Anthropic Messages, Responses ----------------------------------------------------

    async def messages(self, request: Request) -> Response | SSEResponse:
        """``POST /v1/messages`` (``gateway/api/anthropic_api.py``)."""
        async def start() -> tuple[ChoiceSet, Writer, bool, dict[str, str]]:
            mreq = parse_messages_request(await self._read_json(request))
            choices = await self.start_engine_choices(request, mreq.messages, mreq.params, 1,
                                                      resolve_any_model(gateway_state(request).router, mreq.model),
                                                      extra=mreq.extra)
            return choices, MessagesWriter(new_message_id(), choices.model_name), mreq.stream, {}
        return await self.serve(request, start, anthropic_error_response)

    async def count_tokens(self, request: Request) -> Response | SSEResponse:
        """``POST /v1/messages/count_tokens``: the prompt's tokens, from a one-token run."""
        async def start() -> tuple[ChoiceSet, Writer, bool, dict[str, str]]:
            mreq = parse_messages_request(await self._read_json(request), count_only=True)
            choices = await self.start_engine_choices(request, mreq.messages, {**mreq.params, "max_tokens": 1}, 1,
                                                      resolve_any_model(gateway_state(request).router, mreq.model),
                                                      extra=mreq.extra)
            return choices, CountWriter("", choices.model_name), False, {}
        return await self.serve(request, start, anthropic_error_response)

    async def responses(self, request: Request) -> Response | SSEResponse:
        """``POST /v1/responses`` (``gateway/api/responses_api.py``)."""
        async def start() -> tuple[ChoiceSet, Writer, bool, dict[str, str]]:
            rreq = parse_responses_request(await self._read_json(request),
                                           gateway_state(request).config.defaults.stateless_sampling())
            choices = await self.start_engine_choices(request, rreq.messages, rreq.params, 1,
                                                      requested_model(request, rreq.model),
                                                      extra=rreq.extra, progress=rreq.progress)
            return choices, ResponsesWriter(rreq, new_response_id(), choices.model_name), rreq.stream, {}
        return await self.serve(request, start)

    async def serve(self, request: Request,
                    start: Callable[[], Awaitable[tuple[ChoiceSet, Writer, bool, dict[str, str]]]],
                    errors: Callable[[OpenAIError], Response] | None = None) -> Response | SSEResponse:
        """Answer one API request: authorize, ``start`` (parse the body, start its
        choices, make its writer), wait for the first events before sending anything (so
        a refused request gets a real HTTP error status even when streamed), then stream
        or collect the reply with the writer. ``errors`` shapes error answers (OpenAI's,
        ``error_response``, by default)."""
        errors = errors or error_response
        try:
            self.authorize(request)
            resumable = self._conversation(request) if request.url.path.endswith("/chat/completions") else None
            choices, writer, stream, headers = await start()
        except OpenAIError as e:
            return errors(e)
        except GatewayError as e:
            return errors(from_gateway_error(e))
        except ClientDisconnect:  # hung up while sending the body: not an error (gateway/server/disconnects.py)
            return Response(status_code=499)
        except Exception:
            log.exception("starting a completion failed")
            return errors(openai_error_from("internal_error", "something went wrong; try again"))
        watcher = DisconnectWatcher(request.receive)
        watcher.on_close = self._hold(request, watcher)
        try:
            first = await watcher.race(choices.next())
        except BaseException as e:
            await self._abandon(choices, watcher)
            if isinstance(e, Revoked):
                return errors(revoked_error(e.reason))
            if isinstance(e, ClientGone):
                return Response(status_code=499)  # nobody reads it
            raise
        headers = {"x-request-id": _completion_id(choices.first), **headers}
        refused = _refused(first)
        if refused is not None:  # refused before any output: a real error status
            await self._abandon(choices, watcher)
            src = choices.first
            if isinstance(src, SessionReply) and src.created_chat:
                await _delete_quietly(request, src.owner, src.session_id)
            return errors(openai_error_from(refused.code, refused.message, _refused_param(refused.message),
                                            refused.status))
        if stream and resumable is not None:
            return await self._resumable_stream(request, resumable, choices, watcher, first, writer, headers, errors)
        if stream:
            return SSEResponse(lambda emit: self._stream(choices, watcher, first, writer, emit), headers)
        return await self._collect(choices, watcher, first, writer, headers, errors)

    @staticmethod
    def _hold(request: Request, watcher: DisconnectWatcher | Callable[[str], None]) -> Callable[[], None]:
        """Register the request with the revocations (its token's, or its user's): a
        revocation ends it through ``watcher`` (or calls the function given with the
        reason). Returns the function that unregisters it."""
        state = request.scope.get("state", {})
        token = state.get("token") if state.get("auth") == "token" else None
        uid = request_user(request.scope) or ""
        revocations: Revocations = gateway_state(request).revocations
        close = watcher.revoke if isinstance(watcher, DisconnectWatcher) else watcher
        return revocations.hold(uid, close, token.id if token else None, token.digest if token else None)

    # ---- resumable streams (X-Conversation-Id; gateway/api/openai_resume.py) -----------------

    def _spawn(self, aw: Awaitable[Any]) -> None:
        """Run ``aw`` in a task of its own (from a synchronous callback), held until done."""
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _resumable_streams(self, request: Request) -> ResumableStreams:
        if self._resumable is None:
            state = gateway_state(request)
            self._resumable = ResumableStreams(state.streams, state.config.cancel_grace_s)
        return self._resumable

    def _stream_scope(self, request: Request) -> str:
        """Whose conversation ids a request reaches (``openai_resume`` module doc)."""
        if self.api_key is not None or request.scope.get("state", {}).get("auth") == "token":
            return self.owners(request)[0]
        return (request_user(request.scope) or "") if cookie_value(request.scope) else ""

    def _conversation(self, request: Request) -> str | None:
        """The resumable stream's request id from ``X-Conversation-Id``, or None without one.

        Raises:
            OpenAIError: 400 for an id that is empty, too long or not printable.
        """
        conv = request.headers.get(CONVERSATION_HEADER)
        if conv is None:
            return None
        if not valid_conversation_id(conv):
            raise bad("the X-Conversation-Id header must be 1-256 printable characters")
        return conversation_rid(self._stream_scope(request), conv)

    async def _resumable_stream(self, request: Request, rid: str, choices: ChoiceSet, watcher: DisconnectWatcher,
                                first: list[tuple[int, ReplyEvent]], writer: Writer, headers: dict[str, str],
                                errors: Callable[[OpenAIError], Response]) -> Response | SSEResponse:
        """Hand the reply to a task of its own that records its events (it no longer
        depends on this connection) and stream them to the client as they come."""
        watcher.close()  # the client may leave: the reply goes on (a DELETE stops it)
        resumable = self._resumable_streams(request)
        unhold: Callable[[], None] = lambda: None  # noqa: E731

        async def produce(tee: Callable[[list[bytes]], Awaitable[None]]) -> None:
            try:
                await self._produce(choices, first, writer, tee)
            finally:
                unhold()

        try:
            queue = await resumable.start(rid, self._stream_scope(request), produce)
        except GatewayError as e:
            await self._abandon(choices, watcher)
            return errors(from_gateway_error(e))
        # a revoked token (or deleted user) stops the reply and forgets its stream
        unhold = self._hold(request, lambda reason: self._spawn(resumable.stop(rid)))

        async def live(emit: Callable[[bytes], Awaitable[None]]) -> None:
            while (frame := await queue.get()) is not None:
                await emit(frame)

        return SSEResponse(live, headers)

    async def _produce(self, choices: ChoiceSet, events: list[tuple[int, ReplyEvent]], writer: Writer,
                       tee: Callable[[list[bytes]], Awaitable[None]]) -> None:
        """A resumable reply's events, as ``_stream`` writes them, through ``tee``; no
        client to watch (cancelled: the reply is aborted)."""
        try:
            await tee(writer.start_events())
            while True:
                for i, ev in events:
                    if isinstance(ev, Failed):
                        await tee(writer.error_event(openai_error_from(ev.code, ev.message, status=ev.status)))
                        await choices.abort()
                        return
                    await tee(writer.stream_events(i, ev))
                if choices.done:
                    await tee(writer.end_events())
                    return
                events = await choices.next()
        except BaseException:
            await asyncio.shield(choices.abort())
            raise
        finally:
            choices.close()

    async def stream_get(self, request: Request) -> Response | SSEResponse:
        """``GET /v1/stream?conv_id=<id>&from=<byte>``: replay a resumable reply and follow it."""
        try:
            self.authorize(request)
            rid = self._stream_rid(request)
            raw = request.query_params.get("from", "0")
            if not raw.isdigit():
                raise bad("'from' must be a byte offset (a non-negative integer)", "from")
            resumable = self._resumable_streams(request)
            if await gateway_state(request).streams.head(rid) is None:
                raise OpenAIError(404, "no stream for this conversation", "invalid_request_error", "conv_id",
                                  "not_found")
        except OpenAIError as e:
            return error_response(e)
        except GatewayError as e:
            return error_response(from_gateway_error(e))
        return SSEResponse(lambda emit: resumable.replay(rid, int(raw), emit), {})

    async def stream_delete(self, request: Request) -> Response:
        """``DELETE /v1/stream?conv_id=<id>``: stop a resumable reply and forget its stream (204)."""
        try:
            self.authorize(request)
            await self._resumable_streams(request).stop(self._stream_rid(request))
        except OpenAIError as e:
            return error_response(e)
        except GatewayError as e:
            return error_response(from_gateway_error(e))
        return Response(status_code=204)

    def _stream_rid(self, request: Request) -> str:
        conv = request.query_params.get("conv_id")
        if not valid_conversation_id(conv):
            raise bad("'conv_id' must be the conversation id (1-256 printable characters)", "conv_id")
        return conversation_rid(self._stream_scope(request), conv or "")

    async def _read_json(self, request: Request) -> Any:
        limit = gateway_state(request).config.limits.max_frame_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise openai_error_from("frame_too_large", f"request body over {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise openai_error_from("frame_too_large", f"request body over {limit} bytes")
        try:
            return await asyncio.to_thread(loads_json, bytes(body)) if len(body) > BIG_FRAME_CHARS \
                else loads_json(bytes(body))
        except BadJson as e:
            raise bad(f"the request body is {e}" if "nests" not in str(e) else f"the request body {e}") from None

    async def _start(self, request: Request, creq: ChatRequest) -> ChoiceSet:
        model = requested_model(request, creq.model)
        sid = session_link(request, creq)
        if sid is not None:
            last = creq.messages[-1]
            if last["role"] != "user" or not last["content"].strip():
                raise bad("with a session link, the last message must be a non-empty user message "
                          "(the chat's stored history is the rest of the prompt)", "messages")
            if not creq.plain:
                raise bad("with a session link, only text replies are served (no tools, response_format, "
                          "logprobs, logit_bias, n or continue_final_message)", "session_id")
            return ChoiceSet([await self._start_linked(request, creq, sid, model)])
        return await self.start_engine_choices(request, creq.messages, creq.params, creq.n, model,
                                               extra=creq.extra, progress=creq.progress)

    async def start_engine_choices(self, request: Request, messages: list[dict[str, Any]], params: dict[str, Any],
                                   n: int, model: str | None, extra: dict[str, Any] | None = None,
                                   prompt_token_ids: list[int] | None = None,
                                   routing: str | None = None, progress: bool = False) -> ChoiceSet:
        """Start ``n`` stateless choices of one prompt on one engine (the same routing
        key), choice i with its own seed (``api_to_engine.choice_params``): the engine
        computes their shared prompt once. A field ``params`` lack among ``max_tokens``,
        ``temperature`` and ``top_p`` gets the gateway's default (``Defaults.stateless_sampling``);
        without a ``seed`` they get ``GatewayConfig.api_seed`` when it is set (an
        explicit -1, random, stays). ``extra``: ``generate`` frame fields (``prompt``, ``tools``...).
        ``progress``: the choices hand back prompt-progress events (``EngineReply``).

        Raises:
            GatewayError: ``engine_unavailable`` (the started choices are closed).
        """
        state = gateway_state(request)
        events: GenerationEvents = state.generations.events
        params = {**state.config.defaults.stateless_sampling(), **params}
        if state.config.api_seed is not None and params.get("seed") is None:
            params["seed"] = state.config.api_seed  # the operator's --seed (GatewayConfig.api_seed)
        # the cache namespace of the request's first user (docs/reliability.md, cache isolation)
        isolation = state.generations.isolation
        salt = isolation.salt(self.owners(request)[0])
        shared = isolation.shared_messages(messages) if messages else None
        key = routing or affinity_key(messages)
        base_id = uuid.uuid4().hex
        sources: list[ReplySource] = []
        try:
            for i in range(n):
                source = EngineReply(state.router, events, base_id if i == 0 else f"{base_id}-{i}", messages,
                                     a2e.choice_params(params, i), key, model, state.config.cancel_grace_s,
                                     salt, shared, extra=extra, prompt_token_ids=prompt_token_ids,
                                     think_open=state.config.think_markers.open, progress=progress)
                await source.start()
                sources.append(source)
        except BaseException:
            await ChoiceSet(sources).discard()
            raise
        return ChoiceSet(sources)

    async def _start_linked(self, request: Request, creq: ChatRequest, sid: str,
                            model: str | None = None) -> SessionReply:
        """Append the request's last (user) message to chat ``sid`` and start its reply.
        ``model`` (the request's, when it names a served one) becomes the chat's model, as
        the page's model picker would make it; None keeps the chat's."""
        state = gateway_state(request)
        last = creq.messages[-1]
        if last["role"] != "user" or not last["content"].strip():
            raise bad("with a session link, the last message must be a non-empty user message "
                      "(the chat's stored history is the rest of the prompt)", "messages")
        cmid = request.headers.get(IDEMPOTENCY_HEADER)
        if cmid is not None and not _IDEMPOTENCY_RE.match(cmid):
            raise bad("the Idempotency-Key header must be 1-128 characters [A-Za-z0-9_.:-]")
        owner, chat = await self.owner_of(request, sid)
        created = sid == NEW_SESSION
        # a new chat is made by the turn's begin (two round trips in, as the page's): with
        # the request's system message, else the user's default, and the user's params
        system = [m["content"] for m in creq.messages if m["role"] == "system"] if created else []
        started = await state.generations.chat(owner, None if created else sid, last["content"], creq.params, cmid,
                                               clamp_max_tokens=False, model=model,
                                               system_prompt=system[0] if system else None)
        # the answer names the model the reply comes from: the request's, the chat's, else the default engine's
        default = state.router.info()
        named = model or (chat.model if chat is not None else "") or (default.model if default else "")
        return SessionReply(state.generations, state.streams, owner, started, named, created_chat=created)

    async def _abandon(self, choices: ChoiceSet, watcher: DisconnectWatcher) -> None:
        """The client left (or the server is stopping, or the request failed): abort the reply."""
        watcher.close()
        await choices.discard()

    async def _collect(self, choices: ChoiceSet, watcher: DisconnectWatcher, events: list[tuple[int, ReplyEvent]],
                       writer: Writer, headers: dict[str, str],
                       errors: Callable[[OpenAIError], Response]) -> Response:
        """A non-streaming answer: wait for every choice's whole reply."""
        try:
            while True:
                for i, ev in events:
                    if isinstance(ev, Failed):
                        await self._abandon(choices, watcher)
                        return errors(openai_error_from(ev.code, ev.message, status=ev.status))
                    writer.take(i, ev)
                if choices.done:
                    return json_response(writer.body(), headers=headers)
                events = await watcher.race(choices.next())
        except BaseException as e:
            await self._abandon(choices, watcher)
            if isinstance(e, Revoked):
                return errors(revoked_error(e.reason))
            if isinstance(e, ClientGone):
                return Response(status_code=499)
            raise
        finally:
            watcher.close()
            choices.close()

    async def _stream(self, choices: ChoiceSet, watcher: DisconnectWatcher, events: list[tuple[int, ReplyEvent]],
                      writer: Writer, emit: Callable[[bytes], Awaitable[None]]) -> None:
        """A streaming answer, as the writer frames it; an error after the start is sent
        as the writer's error event (OpenAI's: a ``data: {"error": ...}`` event)."""
        async def send(frames: list[bytes]) -> None:
            for f in frames:
                await emit(f)

        try:
            await send(writer.start_events())
            while True:
                for i, ev in events:
                    if isinstance(ev, Failed):
                        await send(writer.error_event(openai_error_from(ev.code, ev.message, status=ev.status)))
                        await self._abandon(choices, watcher)
                        return
                    await send(writer.stream_events(i, ev))
                if choices.done:
                    await send(writer.end_events())
                    return
                events = await watcher.race(choices.next())
        except Revoked as e:  # the client is still there: tell it why the stream ends
            try:
                await send(writer.error_event(revoked_error(e.reason)))
            finally:
                await self._abandon(choices, watcher)
        except ClientGone:
            await self._abandon(choices, watcher)
        except BaseException:
            await self._abandon(choices, watcher)  # a failed send, or the server stopping
            raise
        finally:
            watcher.close()
            choices.close()


async def _delete_quietly(request: Request, owner: str, sid: str) -> None:
    """Remove a chat this request created for a first turn that was refused (so no empty
    chat is left behind); best effort."""
    try:
        await gateway_state(request).store.delete_session(owner, sid)
    except GatewayError:
        pass


def session_link(request: Request, creq: ChatRequest) -> str | None:
    """The linked chat: the ``X-Chat-Session`` header or the ``session_id`` field (an id,
    or ``"new"`` to create one), or None.

    Raises:
        OpenAIError: 400 when both are given and differ.
        GatewayError: ``not_found`` for a malformed id.
    """
    header = request.headers.get(SESSION_HEADER) or None
    if header and creq.session_id and header != creq.session_id:
        raise bad("the X-Chat-Session header and the session_id field name different chats", "session_id")
    sid = header or creq.session_id
    if sid is None or sid == NEW_SESSION:
        return sid
    if not is_valid_id(sid):
        raise not_found()
    return sid


# the engine's refusal of a grammar it cannot compile -> the request field at fault
_GRAMMAR_REFUSALS = {"the response format cannot be used": "response_format",
                     "the tools' parameters cannot be used": "tools"}


def _refused_param(message: str) -> str | None:
    """The request field an engine refusal names (a schema the grammar library cannot
    compile), or None."""
    return next((p for prefix, p in _GRAMMAR_REFUSALS.items() if message.startswith(prefix)), None)


def revoked_error(reason: str) -> OpenAIError:
    """The answer to a request whose token was revoked (or user deleted) while it ran."""
    return OpenAIError(401, f"{reason}: this request was stopped", "invalid_request_error", None, "invalid_token")


def _completion_id(source: ReplySource) -> str:
    return f"chatcmpl-{source.request_id}"


def _refused(events: list[tuple[int, ReplyEvent]]) -> Failed | None:
    """The failure of a choice that failed before any output of its own, if one did: the
    request was refused and gets a real HTTP error status. A choice that sent text first
    (an upstream's error after some text) is a started reply, streamed with its error
    event at the end."""
    spoke: set[int] = set()
    for i, ev in events:
        if isinstance(ev, Failed) and i not in spoke:
            return ev
        if isinstance(ev, Delta):
            spoke.add(i)
    return None


def openai_routes(api_key: str | None = None) -> list[Route]:
    """The ``/v1`` routes (``chat/completions`` and its ``input_tokens``, ``completions``, Anthropic's
    ``messages`` and ``messages/count_tokens``, ``responses``, ``models``, root
    ``tokenize`` and ``detokenize``, llama-server's ``completion`` and ``slots``, and an OpenAI
    error for any other ``/v1`` path); with ``api_key`` every request must send
    ``Authorization: Bearer <api_key>``."""
    api = OpenAIApi(api_key)
    routes = [Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/chat/completions/input_tokens", api.chat_input_tokens, methods=["POST"]),
              Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/messages", api.messages, methods=["POST"]),
              Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
              Route("/v1/responses", api.responses, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"])]
    # the same routes without /v1, as llama-server also serves them (clients configured
    # with the server's root as their base URL)
    routes += [Route(r.path.removeprefix("/v1"), r.endpoint, methods=sorted(r.methods or ()))
               for r in routes if r.path in ("/v1/chat/completions", "/v1/chat/completions/input_tokens",
                                             "/v1/completions", "/v1/models", "/v1/responses")]
    # llama-server's and vLLM's token counting, at the root as both serve it
    routes += [Route("/completion", api.llama_completion, methods=["POST"]),
               Route("/tokenize", api.tokenize, methods=["POST"]),
               Route("/detokenize", api.detokenize, methods=["POST"]),
               Route("/slots", api.slots, methods=["GET"]),
               Route("/v1/stream", api.stream_get, methods=["GET"]),
               Route("/v1/stream", api.stream_delete, methods=["DELETE"])]
    known = {r.path for r in routes}

    async def unknown(request: Request) -> Response:
        path = request.url.path
        if path in known:
            return error_response(OpenAIError(405, f"{request.method} is not allowed on {path}",
                                              "invalid_request_error", None, "method_not_allowed"))
        return error_response(OpenAIError(404, f"Invalid URL ({request.method} {path}): no such route",
                                          "invalid_request_error", None, "not_found"))

    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    return routes + [Route("/v1/{path:path}", unknown, methods=methods), Route("/v1", unknown, methods=methods)]
