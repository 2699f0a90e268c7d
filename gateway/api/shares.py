"""Share links: a read-only snapshot of a chat, taken when the link is made
(docs/protocol.md, "Share links"; the page: docs/ui.md).

* ``POST /api/sessions/{id}/shares`` ``{"expires_in_s"?: int | null}`` -> 201 the link.
  The snapshot is the chat's shown messages (role, text, attached files' names and
  kinds, whether a reply was cut) and its title: no system prompt, settings, token
  ids, other versions, ids or anything of the user. Later turns do not change it.
* ``GET /api/shares?session_id=`` -> ``{"shares": [link]}``: the user's live links
  (of one chat), newest first.
* ``DELETE /api/shares/{id}`` -> 204: the link stops working at once.
* ``GET /s/{id}`` -> the page (``web/share.html``): the snapshot alone, no sidebar, no
  call back to the API; 404 for a link revoked, expired or never made.

A link is ``{"id", "url", "session_id", "title", "created_at", "expires_at"}`` (Unix
seconds; ``expires_at`` null for none); its id is 128 random bits (22 URL-safe
characters), so links cannot be guessed. Redis: the snapshot under ``chat:share:{id}``
(its own key, expiring with the link), the user's links in the hash
``chat:user:{uid}:shares`` (id -> link JSON).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from gateway.api.http import _json_body, _sid, _uid, api, script_safe_json
from gateway.api.state import GatewayState, gateway_state
from gateway.errors import GatewayError, not_found
from gateway.reasoning import DEFAULT_MARKERS, ThinkMarkers, split_reasoning
from gateway.store.sessions import redis_errors

MIN_EXPIRY_S = 60
MAX_EXPIRY_S = 365 * 86400
MAX_SHARES_PER_USER = 200
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{22}$")


def snapshot(title: str, messages: list[dict[str, Any]], now: float,
             markers: ThinkMarkers = DEFAULT_MARKERS) -> dict[str, Any]:
    """What a share link shows: ``{"title", "shared_at", "messages": [{"role", "content",
    "reasoning"?, "reasoning_ms"?, "attachments"?: [{"name", "kind", "pages"?}], "cut"?: true}]}``.
    A reply's reasoning is apart from its answer (``content``), without its ``markers``,
    as the chat page shows it."""
    out = []
    for m in messages:
        if m.get("role") not in ("user", "assistant"):
            continue
        item: dict[str, Any] = {"role": m["role"], "content": str(m.get("content", ""))}
        if m["role"] == "assistant":
            reasoning, item["content"] = split_reasoning(item["content"], markers)
            if reasoning is not None:
                item["reasoning"] = reasoning
                if isinstance(m.get("reasoning_ms"), (int, float)):
                    item["reasoning_ms"] = m["reasoning_ms"]
        files = [{k: a[k] for k in ("name", "kind", "pages") if a.get(k)} for a in m.get("attachments") or []]
        if files:
            item["attachments"] = files
        if m["role"] == "assistant" and m.get("status") == "partial":
            item["cut"] = True
        out.append(item)
    return {"title": title or "Shared chat", "shared_at": now, "messages": out}


def _keys(state: GatewayState, uid: str) -> tuple[str, str]:
    keys = state.store.keys
    return keys.share(""), keys.user_shares(uid)


def _link(share_id: str, sid: str, title: str, now: float, expires_at: float | None) -> dict[str, Any]:
    return {"id": share_id, "url": f"/s/{share_id}", "session_id": sid, "title": title, "created_at": now,
            "expires_at": expires_at}


@api
async def create_share(request: Request) -> Response:
    """POST /api/sessions/{id}/shares: a link to a snapshot of the chat as it is now."""
    state, uid, sid = gateway_state(request), _uid(request), _sid(request)
    body = await _json_body(request, state.config)
    ttl = body.get("expires_in_s")
    if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)
                            or not MIN_EXPIRY_S <= ttl <= MAX_EXPIRY_S):
        raise GatewayError("invalid_request", f"'expires_in_s' must be null or {MIN_EXPIRY_S}-{MAX_EXPIRY_S} seconds")
    info = await state.store.get_session(uid, sid)
    messages = await state.store.messages(uid, sid)
    if info.active:  # the reply in progress is not in the list yet: share what is finished
        messages = [m for m in messages if m.get("id") != info.active.get("message_id")]
    if not messages:
        raise GatewayError("invalid_request", "the chat has no messages to share yet")
    now = time.time()
    share_id = secrets.token_urlsafe(16)
    expires_at = now + ttl if ttl else None
    link = _link(share_id, sid, info.title, now, expires_at)
    snap = json.dumps(snapshot(info.title, messages, now, state.config.think_markers), ensure_ascii=False)
    snap_prefix, index = _keys(state, uid)
    async with redis_errors():
        await _drop_expired(state, uid)
        if await state.redis.hlen(index) >= MAX_SHARES_PER_USER:
            raise GatewayError("invalid_request", f"at most {MAX_SHARES_PER_USER} share links; revoke some")
        pipe = state.redis.pipeline(transaction=True)
        pipe.set(snap_prefix + share_id, snap, ex=ttl or None)
        pipe.hset(index, share_id, json.dumps(link))
        await pipe.execute()
    return JSONResponse(link, status_code=201)


async def _drop_expired(state: GatewayState, uid: str) -> list[dict[str, Any]]:
    """The user's live links (newest first); entries of expired ones are dropped."""
    _, index = _keys(state, uid)
    raw: dict[str, str] = await state.redis.hgetall(index)  # type: ignore[assignment]  # decode_responses
    now = time.time()
    live: list[dict[str, Any]] = []
    gone: list[str] = []
    for share_id, v in raw.items():
        link = json.loads(v)
        if link.get("expires_at") and link["expires_at"] <= now:
            gone.append(share_id)
        else:
            live.append(link)
    if gone:
        await state.redis.hdel(index, *gone)
    return sorted(live, key=lambda x: -x["created_at"])


@api
async def list_shares(request: Request) -> Response:
    """GET /api/shares[?session_id=]: the user's live links."""
    state, uid = gateway_state(request), _uid(request)
    async with redis_errors():
        links = await _drop_expired(state, uid)
    sid = request.query_params.get("session_id")
    if sid:
        links = [x for x in links if x["session_id"] == sid]
    return JSONResponse({"shares": links})


@api
async def revoke_share(request: Request) -> Response:
    """DELETE /api/shares/{id}: the link stops working now."""
    state, uid = gateway_state(request), _uid(request)
    share_id = request.path_params["share_id"]
    snap_prefix, index = _keys(state, uid)
    async with redis_errors():
        if not isinstance(share_id, str) or not await state.redis.hexists(index, share_id):
            raise not_found()  # another user's link or none: the same answer
        pipe = state.redis.pipeline(transaction=True)
        pipe.delete(snap_prefix + share_id)
        pipe.hdel(index, share_id)
        await pipe.execute()
    return Response(status_code=204)


_templates: dict[str, Jinja2Templates] = {}


async def share_page(request: Request) -> Response:
    """GET /s/{id}: the shared snapshot, read-only (404 page when gone)."""
    state = gateway_state(request)
    share_id = request.path_params["share_id"]
    raw = None
    if isinstance(share_id, str) and _ID_RE.match(share_id):
        async with redis_errors():
            raw = await state.redis.get(state.store.keys.share(share_id))
    web_dir = str(state.config.web_dir)
    if web_dir not in _templates:
        _templates[web_dir] = Jinja2Templates(directory=web_dir)
    snap = json.loads(raw) if raw else None
    headers = {"cache-control": "no-store", "x-robots-tag": "noindex"}
    if not (state.config.web_dir / "share.html").exists():
        return HTMLResponse("<!doctype html><title>Shared chat</title><p>The share page is not installed.</p>",
                            status_code=200 if snap else 404, headers=headers)
    return _templates[web_dir].TemplateResponse(
        request, "share.html", {"snapshot_json": script_safe_json(snap), "title": snap["title"] if snap else "",
                                "found": snap is not None, "static_url": "/static"},
        status_code=200 if snap else 404, headers=headers)


def share_routes() -> list[Route]:
    """The share link routes (API and page)."""
    return [
        Route("/api/sessions/{sid:str}/shares", create_share, methods=["POST"]),
        Route("/api/shares", list_shares, methods=["GET"]),
        Route("/api/shares/{share_id:str}", revoke_share, methods=["DELETE"]),
        Route("/s/{share_id:str}", share_page, methods=["GET"]),
    ]
