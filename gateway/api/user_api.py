"""The user's own settings over HTTP (docs/protocol.md section 3): who am I, personal
access tokens, and defaults for new chats.

* ``GET /api/identity`` -> ``{"user_id", "auth": "cookie"|"token", "token": {...}|null}``
* ``GET /api/tokens`` -> ``{"tokens": [{"id", "name", "created_at", "hint"}]}``
* ``POST /api/tokens`` ``{"name"}`` -> 201 ``{"id", "name", "created_at", "hint", "token"}``
  (the only time the token itself is shown)
* ``DELETE /api/tokens/{id}`` -> 204 (revoked at once: sockets and streams opened with it
  close too), 404 when the user has no such token
* ``DELETE /api/user`` -> 204: every chat, token and default of the user deleted, and every
  socket and stream of the user closed
* ``GET /api/defaults`` -> ``{"system_prompt", "params"}`` (the user's, over the gateway's)
* ``PUT /api/defaults`` ``{"system_prompt"?, "params"?}`` -> the same shape; params are
  validated as a chat's are

Every route acts for the request's user: the cookie's, or a personal token's.
"""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.http import _json_body, _session_fields, _uid, api
from gateway.api.state import gateway_state
from gateway.errors import GatewayError, not_found

_TOKEN_ID_RE = re.compile(r"^[0-9a-f]{12}$")


@api
async def identity(request: Request) -> Response:
    """GET /api/identity: the request's user and how it was recognised."""
    state = request.scope.get("state", {})
    token = state.get("token")
    return JSONResponse({"user_id": _uid(request), "auth": state.get("auth", "cookie"),
                         "token": token.public() if token is not None else None})


@api
async def list_tokens(request: Request) -> Response:
    """GET /api/tokens: the user's live tokens (never the tokens themselves)."""
    rows = await gateway_state(request).tokens.list(_uid(request))
    return JSONResponse({"tokens": [t.public() for t in rows]})


@api
async def create_token(request: Request) -> Response:
    """POST /api/tokens -> 201 with the new token, shown this once."""
    body = await _json_body(request, gateway_state(request).config)
    name = body.get("name", "")
    if not isinstance(name, str):
        raise GatewayError("invalid_request", "'name' must be a string")
    try:
        token, info = await gateway_state(request).tokens.create(_uid(request), name)
    except ValueError as e:
        raise GatewayError("invalid_request", str(e)) from None
    return JSONResponse({**info.public(), "token": token}, status_code=201)


@api
async def revoke_token(request: Request) -> Response:
    """DELETE /api/tokens/{id} -> 204; requests with that token get 401 from now on, and
    the sockets and streams opened with it close (``gateway/api/revocation.py``)."""
    tid = request.path_params["tid"]
    if not isinstance(tid, str) or not _TOKEN_ID_RE.match(tid):
        raise not_found("token")
    uid = _uid(request)
    if not await gateway_state(request).tokens.revoke(uid, tid):
        raise not_found("token")
    await gateway_state(request).revocations.revoke_token(uid, tid)
    return Response(status_code=204)


@api
async def delete_user(request: Request) -> Response:
    """DELETE /api/user -> 204: delete all of this user's data (every chat, stopping its
    reply in progress, every access token, the defaults for new chats) and close every
    socket and stream of the user, on every gateway replica."""
    state, uid = gateway_state(request), _uid(request)
    await state.tokens.revoke_all(uid)
    await state.user_defaults.delete(uid)
    seen: set[str] = set()
    while True:  # a page of chats at a time, until none is left (or only ones already tried)
        chats = [c for c in await state.store.list_sessions(uid) if c.id not in seen]
        if not chats:
            break
        for info in chats:
            seen.add(info.id)
            try:
                active = await state.store.delete_session(uid, info.id)
            except GatewayError as e:
                if e.code != "not_found":  # deleted meanwhile by another request
                    raise
                continue
            if active:
                try:
                    await state.generations.cancel(uid, active["request_id"])
                except GatewayError:
                    pass  # it ended meanwhile
    await state.revocations.revoke_user(uid)
    return Response(status_code=204)


async def _defaults_body(request: Request) -> dict[str, object]:
    state = gateway_state(request)
    system_prompt, params = await state.user_defaults.for_new_chat(_uid(request),
                                                                   state.config.defaults.system_prompt)
    return {"system_prompt": system_prompt, "params": {**state.config.defaults.sampling(), **params}}


@api
async def get_defaults(request: Request) -> Response:
    """GET /api/defaults: the system prompt and sampling a new chat of this user gets."""
    return JSONResponse(await _defaults_body(request))


@api
async def put_defaults(request: Request) -> Response:
    """PUT /api/defaults: replace the user's defaults for new chats (validated)."""
    state = gateway_state(request)
    body = await _json_body(request, state.config)
    fields = _session_fields({k: v for k, v in body.items() if k in ("system_prompt", "params")}, state.config)
    await state.user_defaults.put(_uid(request), fields)
    return JSONResponse(await _defaults_body(request))


def user_routes() -> list[Route]:
    """The identity, token and defaults routes."""
    return [
        Route("/api/identity", identity, methods=["GET"]),
        Route("/api/tokens", list_tokens, methods=["GET"]),
        Route("/api/tokens", create_token, methods=["POST"]),
        Route("/api/tokens/{tid:str}", revoke_token, methods=["DELETE"]),
        Route("/api/user", delete_user, methods=["DELETE"]),
        Route("/api/defaults", get_defaults, methods=["GET"]),
        Route("/api/defaults", put_defaults, methods=["PUT"]),
    ]
