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
import json
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway.api.auth import UserIds, cookie_value, request_user
from gateway.api.openai_replies import (
    ClientGone,
    Delta,
    DisconnectWatcher,
    EngineReply,
    Failed,
    Finished,
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
from gateway.api.revocation import Revocations
from gateway.api.socket_frames import is_valid_id
from gateway.api.validation import BadJson, loads_json
from gateway.config import GatewayConfig
from gateway.engines.client import EngineRouter, engine_unavailable
from gateway.errors import GatewayError, not_found
from gateway.replies.hooks import EventFanout, GenerationEvents
from gateway.replies.reasoning import DEFAULT_MARKERS, ReasoningSplitter, ThinkMarkers, split_reasoning

log = logging.getLogger("gateway.openai")

MODEL_ALIASES = ("", "default")  # besides the served name; an omitted model is the same
SESSION_HEADER = "x-chat-session"
IDEMPOTENCY_HEADER = "idempotency-key"
_IDEMPOTENCY_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
BIG_BODY_BYTES = 256 * 1024  # bodies above this are JSON-decoded off the event loop
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def json_bytes(obj: Any) -> bytes:
    """Compact UTF-8 JSON; a lone surrogate (never expected) becomes "?" instead of
    failing the whole response (valid UTF-8 always (docs/acceptance.md))."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


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


class SSEResponse:
    """An ASGI response streaming Server-Sent Events written by ``produce(emit)``;
    ``emit(data)`` sends one ``data: ...`` event (``data`` is its JSON or ``[DONE]``)."""

    def __init__(self, produce: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]],
                 headers: dict[str, str]) -> None:
        self.produce = produce
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in {**SSE_HEADERS, **headers}.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})

        async def emit(data: bytes) -> None:
            await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})

        await self.produce(emit)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def resolve_model(router: EngineRouter, requested: str | None) -> str | None:
    """The model name a request may use: None (any engine) for an omitted name or an
    alias, else the requested name when some engine serves it.

    Raises:
        OpenAIError: 404 ``model_not_found`` for a name no engine serves.
        GatewayError: ``engine_unavailable`` when no engine is connected.
    """
    if not router.healthy:
        raise engine_unavailable("no engine is connected")
    if requested is None or requested in MODEL_ALIASES:
        return None
    served = {c.info.model for c in router.clients if c.info is not None}
    if requested not in served:
        raise OpenAIError(404, f"The model `{requested}` does not exist; this server serves "
                          f"{', '.join(sorted(served)) or 'no model yet'}", "invalid_request_error", "model",
                          "model_not_found")
    return requested


def affinity_key(messages: list[dict[str, str]]) -> str:
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

    # ---- who is asking ------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        """Check ``Authorization: Bearer`` against the configured key (if any).

        Raises:
            OpenAIError: 401 ``invalid_api_key``.
        """
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
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
            secret, ids = self._secret_ids(request.app.state.config)
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

    async def owner_of(self, request: Request, sid: str) -> str:
        """The first of ``owners`` that owns chat ``sid`` (the first one for ``"new"``).

        Raises:
            GatewayError: ``not_found`` when none does.
        """
        owners = self.owners(request)
        if sid == NEW_SESSION:
            return owners[0]
        for uid in owners:
            try:
                await request.app.state.store.get_session(uid, sid)
                return uid
            except GatewayError as e:
                if e.code != "not_found":
                    raise
        raise not_found()

    # ---- GET /v1/models -----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the models the connected engines serve."""
        try:
            self.authorize(request)
        except OpenAIError as e:
            return error_response(e)
        seen: dict[str, Any] = {}
        for c in request.app.state.router.clients:
            if c.info is not None and c.info.model not in seen:
                seen[c.info.model] = {"id": c.info.model, "object": "model", "created": self.created,
                                      "owned_by": "chatserve", "max_model_len": c.info.max_model_len,
                                      "format": c.info.format or None}
        return json_response({"object": "list", "data": list(seen.values())})

    # ---- POST /v1/chat/completions --------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response | SSEResponse:
        """``POST /v1/chat/completions`` (see module doc)."""
        try:
            self.authorize(request)
            creq = parse_chat_request(await self._read_json(request))
            source = await self._start(request, creq)
        except OpenAIError as e:
            return error_response(e)
        except GatewayError as e:
            return error_response(from_gateway_error(e))
        except ClientDisconnect:  # hung up while sending the body: not an error (gateway/server/disconnects.py)
            return Response(status_code=499)
        except Exception:
            log.exception("starting a chat completion failed")
            return error_response(openai_error_from("internal_error", "something went wrong; try again"))
        watcher = DisconnectWatcher(request.receive)
        watcher.on_close = self._hold(request, watcher)
        try:
            first = await watcher.race(source.next())
        except BaseException as e:
            await self._abandon(source, watcher)
            if isinstance(e, Revoked):
                return error_response(revoked_error(e.reason))
            if isinstance(e, ClientGone):
                return Response(status_code=499)  # nobody reads it
            raise
        headers = {"x-request-id": _completion_id(source)}
        markers = request.app.state.config.think_markers  # reasoning_content (gateway/replies/reasoning.py)
        if isinstance(source, SessionReply):
            headers["x-chat-session"] = source.session_id
        if isinstance(first[0], Failed):  # refused before any output: a real error status
            watcher.close()
            source.close()
            if isinstance(source, SessionReply) and source.created_chat:
                await _delete_quietly(request, source.owner, source.session_id)
            return error_response(openai_error_from(first[0].code, first[0].message, status=first[0].status))
        if creq.stream:
            return SSEResponse(lambda emit: self._stream(source, watcher, first, creq, emit, markers), headers)
        return await self._collect(source, watcher, first, headers, markers)

    @staticmethod
    def _hold(request: Request, watcher: DisconnectWatcher) -> Callable[[], None]:
        """Register the request with the revocations (its token's, or its user's): a
        revocation ends it through ``watcher``. Returns the function that unregisters it."""
        state = request.scope.get("state", {})
        token = state.get("token") if state.get("auth") == "token" else None
        uid = request_user(request.scope) or ""
        revocations: Revocations = request.app.state.revocations
        return revocations.hold(uid, watcher.revoke, token.id if token else None, token.digest if token else None)

    async def _read_json(self, request: Request) -> Any:
        limit = request.app.state.config.limits.max_frame_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise openai_error_from("frame_too_large", f"request body over {limit} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise openai_error_from("frame_too_large", f"request body over {limit} bytes")
        try:
            return await asyncio.to_thread(loads_json, bytes(body)) if len(body) > BIG_BODY_BYTES \
                else loads_json(bytes(body))
        except BadJson as e:
            raise bad(f"the request body is {e}" if "nests" not in str(e) else f"the request body {e}") from None

    async def _start(self, request: Request, creq: ChatRequest) -> ReplySource:
        state = request.app.state
        model = resolve_model(state.router, creq.model)
        sid = session_link(request, creq)
        if sid is not None:
            return await self._start_linked(request, creq, sid)
        events: GenerationEvents = getattr(state.generations, "events", None) or EventFanout()
        params = {"max_tokens": state.config.defaults.max_tokens, **creq.params}
        # the cache namespace of the request's first user (docs/reliability.md, cache isolation)
        isolation = state.generations.isolation
        source = EngineReply(state.router, events, uuid.uuid4().hex, creq.messages, params,
                             affinity_key(creq.messages), model, state.config.cancel_grace_s,
                             isolation.salt(self.owners(request)[0]), isolation.shared_messages(creq.messages),
                             think_open=state.config.think_markers.open)
        await source.start()
        return source

    async def _start_linked(self, request: Request, creq: ChatRequest, sid: str) -> SessionReply:
        """Append the request's last (user) message to chat ``sid`` and start its reply."""
        state = request.app.state
        last = creq.messages[-1]
        if last["role"] != "user" or not last["content"].strip():
            raise bad("with a session link, the last message must be a non-empty user message "
                      "(the chat's stored history is the rest of the prompt)", "messages")
        cmid = request.headers.get(IDEMPOTENCY_HEADER)
        if cmid is not None and not _IDEMPOTENCY_RE.match(cmid):
            raise bad("the Idempotency-Key header must be 1-128 characters [A-Za-z0-9_.:-]")
        owner = await self.owner_of(request, sid)
        created = False
        if sid == NEW_SESSION:
            system = [m["content"] for m in creq.messages if m["role"] == "system"]
            default_prompt, params = await state.user_defaults.for_new_chat(
                owner, state.config.defaults.system_prompt)
            info = await state.store.create_session(
                owner, system_prompt=system[0] if system else default_prompt, params=params)
            sid, created = info.id, True
        try:
            started = await state.generations.chat(owner, sid, last["content"], creq.params, cmid,
                                                   clamp_max_tokens=False)
        except GatewayError:
            if created:
                await _delete_quietly(request, owner, sid)
            raise
        info = state.router.info()
        return SessionReply(state.generations, state.streams, owner, started, info.model if info else "",
                            created_chat=created)

    async def _abandon(self, source: ReplySource, watcher: DisconnectWatcher) -> None:
        """The client left (or the server is stopping): abort the reply."""
        watcher.close()
        try:
            await source.abort()
        finally:
            source.close()

    async def _collect(self, source: ReplySource, watcher: DisconnectWatcher, events: list[ReplyEvent],
                       headers: dict[str, str], markers: ThinkMarkers = DEFAULT_MARKERS) -> Response:
        """A non-streaming answer: wait for the whole reply (its reasoning, if any, as the
        message's ``reasoning_content``)."""
        parts: list[str] = []
        try:
            while True:
                for ev in events:
                    if isinstance(ev, Delta):
                        parts.append(ev.text)
                    elif isinstance(ev, Failed):
                        return error_response(openai_error_from(ev.code, ev.message, status=ev.status))
                    elif isinstance(ev, Finished):
                        return json_response(_completion(source, "".join(parts), ev, markers), headers=headers)
                events = await watcher.race(source.next())
        except BaseException as e:
            await self._abandon(source, watcher)
            if isinstance(e, Revoked):
                return error_response(revoked_error(e.reason))
            if isinstance(e, ClientGone):
                return Response(status_code=499)
            raise
        finally:
            watcher.close()
            source.close()

    async def _stream(self, source: ReplySource, watcher: DisconnectWatcher, events: list[ReplyEvent],
                      creq: ChatRequest, emit: Callable[[bytes], Awaitable[None]],
                      markers: ThinkMarkers = DEFAULT_MARKERS) -> None:
        """A streaming answer: role chunk, content chunks (the reply's reasoning, if any,
        as ``reasoning_content`` deltas first), finish chunk, usage chunk (with
        ``stream_options.include_usage``), ``[DONE]``; an error after the start is sent
        as a ``data: {"error": ...}`` event (as OpenAI does)."""
        think = ReasoningSplitter(markers)

        async def text(reasoning: str, content: str) -> None:
            if reasoning:
                await emit(chunk({"reasoning_content": reasoning}))
            if content:
                await emit(chunk({"content": content}))
        base = {"id": _completion_id(source), "object": "chat.completion.chunk", "created": int(time.time()),
                "model": source.model_name, "system_fingerprint": None}
        if creq.include_usage:
            base["usage"] = None

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
            return json_bytes({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                    "finish_reason": finish_reason}]})

        try:
            await emit(chunk({"role": "assistant", "content": ""}))
            while True:
                for ev in events:
                    if isinstance(ev, Delta) and ev.text:
                        await text(*think.feed(ev.text))
                    elif isinstance(ev, Failed):
                        await emit(json_bytes(openai_error_from(ev.code, ev.message, status=ev.status).body()))
                        return
                    elif isinstance(ev, Finished):
                        await text(*think.finish())
                        await emit(chunk({}, ev.finish_reason))
                        if creq.include_usage:
                            await emit(json_bytes({**base, "choices": [], "usage": _usage(ev)}))
                        await emit(b"[DONE]")
                        return
                events = await watcher.race(source.next())
        except Revoked as e:  # the client is still there: tell it why the stream ends
            try:
                await emit(json_bytes(revoked_error(e.reason).body()))
            finally:
                await self._abandon(source, watcher)
        except ClientGone:
            await self._abandon(source, watcher)
        except BaseException:
            await self._abandon(source, watcher)  # a failed send, or the server stopping
            raise
        finally:
            watcher.close()
            source.close()


async def _delete_quietly(request: Request, owner: str, sid: str) -> None:
    """Remove a chat this request created for a first turn that was refused (so no empty
    chat is left behind); best effort."""
    try:
        await request.app.state.store.delete_session(owner, sid)
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


def revoked_error(reason: str) -> OpenAIError:
    """The answer to a request whose token was revoked (or user deleted) while it ran."""
    return OpenAIError(401, f"{reason}: this request was stopped", "invalid_request_error", None, "invalid_token")


def _completion_id(source: ReplySource) -> str:
    return f"chatcmpl-{source.request_id}"


def _usage(done: Finished) -> dict[str, Any]:
    u = done.usage
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)}}


def _completion(source: ReplySource, text: str, done: Finished, markers: ThinkMarkers = DEFAULT_MARKERS
                ) -> dict[str, Any]:
    reasoning, text = split_reasoning(text, markers)
    body: dict[str, Any] = {
        "id": _completion_id(source), "object": "chat.completion", "created": int(time.time()),
        "model": source.model_name, "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": done.finish_reason}],
        "usage": _usage(done),
    }
    if reasoning is not None:
        body["choices"][0]["message"]["reasoning_content"] = reasoning
    if isinstance(source, SessionReply):
        body["session_id"] = source.session_id
    return body


def openai_routes(api_key: str | None = None) -> list[Route]:
    """``POST /v1/chat/completions`` and ``GET /v1/models``; with ``api_key`` every
    request must send ``Authorization: Bearer <api_key>``."""
    api = OpenAIApi(api_key)
    return [Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"])]
