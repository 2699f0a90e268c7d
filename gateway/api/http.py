"""The HTTP API (docs/protocol.md section 3): ``/api/config``, ``/api/sessions`` CRUD
and ``/api/engine/stats``. Every route acts for the cookie's user only; another
user's chat answers 404 like a missing one. Errors are ``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from markupsafe import Markup
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.auth import request_user
from gateway.api.socket_frames import MAX_MODEL_CHARS, is_valid_id
from gateway.api.state import GatewayState, gateway_state
from gateway.api.validation import BadJson, check_text, loads_json, printable, sampling_ranges
from gateway.attachments import ATTACHMENT_LIMITS
from gateway.config import GatewayConfig
from gateway.engines.client import EngineRouter
from gateway.errors import GatewayError, not_found
from gateway.replies.manager import merge_params

log = logging.getLogger("gateway.http")

Handler = Callable[[Request], Awaitable[Response]]


def error_response(e: GatewayError) -> JSONResponse:
    """``{"error": {"code", "message"}}`` with the code's HTTP status."""
    return JSONResponse({"error": {"code": e.code, "message": printable(e.message)}}, status_code=e.http_status)


def api(handler: Handler) -> Handler:
    """Wrap a route: ``GatewayError`` becomes its JSON error; a client that hung up while
    sending its body an unlogged 499 (nobody reads it; ``gateway/server/disconnects.py`` counts
    it); anything else a logged 500 ``internal_error`` (never a traceback to the client)."""

    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except GatewayError as e:
            return error_response(e)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(GatewayError("internal_error", "something went wrong; try again"))

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


def _uid(request: Request) -> str:
    uid = request_user(request.scope)
    if uid is None:  # UserCookieMiddleware always sets one for HTTP
        raise GatewayError("internal_error", "no user")
    return uid


def _sid(request: Request) -> str:
    sid = request.path_params["sid"]
    if not isinstance(sid, str) or not is_valid_id(sid):
        raise not_found()
    return sid


async def _json_body(request: Request, config: GatewayConfig) -> dict[str, Any]:
    limit = config.limits.max_http_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise GatewayError("frame_too_large", f"request body over {limit} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise GatewayError("frame_too_large", f"request body over {limit} bytes")
    if not body:
        return {}
    try:
        obj = loads_json(body)
    except BadJson as e:
        raise GatewayError("invalid_request", f"body is {e}" if "nests" not in str(e) else f"body {e}") from None
    if not isinstance(obj, dict):
        raise GatewayError("invalid_request", "body must be a JSON object")
    return obj


def _session_fields(body: dict[str, Any], config: GatewayConfig) -> dict[str, Any]:
    """Validated ``title``/``system_prompt``/``params``/``model`` of a POST or PATCH body."""
    out: dict[str, Any] = {}
    lim = config.limits
    for key, cap in (("title", lim.max_title_chars), ("system_prompt", lim.max_system_prompt_chars)):
        if key in body:
            v = body[key]
            if not isinstance(v, str) or len(v) > cap:
                raise GatewayError("invalid_request", f"'{key}' must be a string of at most {cap} characters")
            check_text(v, key)
            out[key] = v.strip() if key == "title" else v
    if "model" in body:
        m = body["model"]
        if m is not None and not (isinstance(m, str) and len(m) <= MAX_MODEL_CHARS):
            raise GatewayError("invalid_request", f"'model' must be a model name of at most {MAX_MODEL_CHARS} "
                               "characters, or null for the default")
        out["model"] = m or ""
    if "params" in body:
        if not isinstance(body["params"], dict):
            raise GatewayError("invalid_request", "'params' must be an object")
        merge_params(config.defaults.sampling(), body["params"])  # validates
        out["params"] = body["params"]
    return out


def config_body(config: GatewayConfig, router: EngineRouter) -> dict[str, Any]:
    """The ``GET /api/config`` body (also embedded in the chat page), from the gateway's
    settings and its engines."""
    info = router.info()
    fallback = Path(config.model).name if config.model else "SmolLM2-135M-Instruct"
    model = info.model if info and info.model else fallback
    d = config.defaults
    models, seen = [], set()
    for c in router.clients:  # every model the engines serve, the default first
        if c.info is not None and c.info.model not in seen:
            seen.add(c.info.model)
            models.append({"id": c.info.model, "max_model_len": c.info.max_model_len or None,
                           "format": c.info.format or None, "available": any(
                               o.healthy for o in router.clients if o.info and o.info.model == c.info.model)})
    models.sort(key=lambda m: m["id"] != model)
    return {"model": model, "models": models, "max_model_len": info.max_model_len if info else None,
            "format": info.format if info and info.format else None,
            "limits": {**config.limits.public(), **ATTACHMENT_LIMITS.public()}, "ranges": sampling_ranges(),
            "reasoning": {"open": config.think_markers.open, "close": config.think_markers.close},
            "defaults": {**d.sampling(), "system_prompt": d.system_prompt}}


@api
async def get_config(request: Request) -> Response:
    """GET /api/config."""
    state = gateway_state(request)
    return JSONResponse(config_body(state.config, state.router))


@api
async def list_sessions(request: Request) -> Response:
    """GET /api/sessions: the user's chats, newest first."""
    rows = await gateway_state(request).store.list_sessions(_uid(request))
    return JSONResponse({"sessions": [{"id": s.id, "title": s.title, "created_at": s.created_at,
                                       "updated_at": s.updated_at} for s in rows]})


@api
async def create_session(request: Request) -> Response:
    """POST /api/sessions -> 201 and the new chat."""
    state, uid = gateway_state(request), _uid(request)
    fields = _session_fields(await _json_body(request, state.config), state.config)
    _check_model(state, fields.get("model"))
    # what the request leaves out comes from the user's defaults for new chats (gateway.store.user_defaults)
    system_prompt, params = await state.user_defaults.for_new_chat(uid, state.config.defaults.system_prompt)
    info = await state.store.create_session(
        uid, title=fields.get("title", ""), system_prompt=fields.get("system_prompt", system_prompt),
        params=fields.get("params", params), model=fields.get("model", ""))
    return JSONResponse({**info.public(), "messages": [], "active": None}, status_code=201)


def _check_model(state: GatewayState, model: str | None) -> None:
    """Raises ``model_not_found`` for a model name no engine serves (None or "": none)."""
    if model:
        state.generations.check_model(model)


PUBLIC_MESSAGE_FIELDS = ("id", "role", "content", "attachments", "status", "finish_reason", "cut_reason", "usage",
                         "timings", "error", "created_at", "versions", "reasoning_ms", "model", "tool_calls",
                         "tool_results")


async def _session_detail(request: Request, sid: str) -> dict[str, Any]:
    state, uid = gateway_state(request), _uid(request)
    info = await state.store.get_session(uid, sid)
    stored = await state.store.messages(uid, sid)
    active = None
    if info.active:
        last = await state.streams.last(info.active["request_id"])
        if last is not None and not last.terminal:
            active = {"request_id": info.active["request_id"], "message_id": info.active["message_id"],
                      "last_seq": last.seq}
    messages = [{k: m[k] for k in PUBLIC_MESSAGE_FIELDS if m.get(k) is not None} for m in stored]
    return {**info.public(), "messages": messages, "active": active}


@api
async def get_session(request: Request) -> Response:
    """GET /api/sessions/{id}: the chat with its messages and the reply in progress."""
    return JSONResponse(await _session_detail(request, _sid(request)))


@api
async def patch_session(request: Request) -> Response:
    """PATCH /api/sessions/{id}: change title, system prompt or params."""
    state, sid = gateway_state(request), _sid(request)
    fields = _session_fields(await _json_body(request, state.config), state.config)
    _check_model(state, fields.get("model"))
    await state.store.update_session(_uid(request), sid, **fields)
    return JSONResponse(await _session_detail(request, sid))


@api
async def switch_version(request: Request) -> Response:
    """POST /api/sessions/{id}/versions ``{"message_id", "index"}``: show version
    ``index`` (0-based) of the chat from that user message on (the shown branch is kept);
    answers the chat as GET does."""
    state, sid = gateway_state(request), _sid(request)
    body = await _json_body(request, state.config)
    mid, index = body.get("message_id"), body.get("index")
    if not is_valid_id(mid) or not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise GatewayError("invalid_request", "'message_id' must be a message id and 'index' an integer >= 0")
    await state.store.switch_version(_uid(request), sid, mid, index)
    return JSONResponse(await _session_detail(request, sid))


@api
async def delete_session(request: Request) -> Response:
    """DELETE /api/sessions/{id} -> 204; a reply in progress is stopped."""
    state, uid = gateway_state(request), _uid(request)
    active = await state.store.delete_session(uid, _sid(request))
    if active:
        try:
            await state.generations.cancel(uid, active["request_id"])
        except GatewayError:
            pass  # it ended meanwhile
    return Response(status_code=204)


def _is_operator(request: Request) -> bool:
    """True when the request carries the configured API key (``Authorization: Bearer``)."""
    key = gateway_state(request).config.api_key
    if not key:
        return False
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


@api
async def engine_stats(request: Request) -> Response:
    """GET /api/engine/stats: each engine's name, health and counters (KV blocks,
    requests), for operators and tests (stop frees the engine (docs/acceptance.md#stop-frees-the-engine)
    checks that a cancel frees blocks); its ``url`` only with the API key."""
    out = []
    operator = _is_operator(request)
    for i, c in enumerate(gateway_state(request).router.clients):
        entry: dict[str, Any] = {"name": f"engine-{i + 1}", "healthy": c.healthy, "stats": None}
        if operator:  # internal addresses only for whoever holds the API key
            entry["url"] = c.url
        if c.healthy:
            try:
                entry["stats"] = await c.stats()
            except GatewayError:
                entry["healthy"] = False
        out.append(entry)
    return JSONResponse({"engines": out})


def api_routes() -> list[Route]:
    """The ``/api`` routes."""
    return [
        Route("/api/config", get_config, methods=["GET"]),
        Route("/api/sessions", list_sessions, methods=["GET"]),
        Route("/api/sessions", create_session, methods=["POST"]),
        Route("/api/sessions/{sid:str}", get_session, methods=["GET"]),
        Route("/api/sessions/{sid:str}", patch_session, methods=["PATCH"]),
        Route("/api/sessions/{sid:str}", delete_session, methods=["DELETE"]),
        Route("/api/sessions/{sid:str}/versions", switch_version, methods=["POST"]),
        Route("/api/engine/stats", engine_stats, methods=["GET"]),
    ]


def script_safe_json(obj: Any) -> Markup:
    """JSON that can sit inside a ``<script>`` element as is: ``<``, ``>`` and ``&``
    are escaped as ``\\u003c`` etc. (valid JSON, and no ``</script>`` can appear)."""
    text = json.dumps(obj).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return Markup(text)
