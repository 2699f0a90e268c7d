"""Export a chat (Markdown or JSON download) and search the user's chats by title and
content (docs/protocol.md section 3).

* ``GET /api/sessions/{id}/export?format=md|json`` -> an attachment named after the chat
  (``Content-Disposition``); JSON holds the chat's public fields and messages, Markdown
  a readable transcript (system prompt, then each turn under a heading).
* ``GET /api/search?q=text`` -> ``{"results": [{"id", "title", "updated_at", "snippet",
  "in_title"}]}``: chats whose title or any message contains ``q`` (case-insensitive,
  1-200 characters), newest first, at most ``SEARCH_LIMIT``; the snippet is the text
  around the first match (``SNIPPET_CHARS`` either side).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.http import PUBLIC_MESSAGE_FIELDS, _sid, _uid, api
from gateway.errors import GatewayError
from gateway.store.sessions import SessionInfo, redis_errors

SEARCH_LIMIT = 50
SNIPPET_CHARS = 60
MAX_QUERY_CHARS = 200


def chat_json(info: SessionInfo, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON export: the chat's public fields and its messages' public fields."""
    return {**info.public(), "messages": [{k: m[k] for k in PUBLIC_MESSAGE_FIELDS if m.get(k) is not None}
                                          for m in messages]}


def chat_markdown(info: SessionInfo, messages: list[dict[str, Any]]) -> str:
    """The Markdown export: a title, the system prompt as a quote, then one section per
    message (``## You`` / ``## Assistant``), a cut reply marked as such."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(info.created_at))
    lines = [f"# {info.title or 'Untitled chat'}", "", f"*Started {when}.*", ""]
    if info.system_prompt:
        lines += ["> **System prompt:** " + info.system_prompt.replace("\n", "\n> "), ""]
    for m in messages:
        role = "You" if m.get("role") == "user" else "Assistant"
        lines += [f"## {role}", "", str(m.get("content", "")).rstrip(), ""]
        if m.get("role") == "assistant" and m.get("status") == "partial":
            lines += ["*(reply cut before its end)*", ""]
    return "\n".join(lines).rstrip() + "\n"


def _filename(info: SessionInfo, ext: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", info.title or "chat").strip("-.")[:60] or "chat"
    return f"{base}.{ext}"


@api
async def export_session(request: Request) -> Response:
    """GET /api/sessions/{id}/export?format=md|json: the chat as a download."""
    state, uid, sid = request.app.state, _uid(request), _sid(request)
    fmt = request.query_params.get("format", "md")
    if fmt not in ("md", "json"):
        raise GatewayError("invalid_request", "format must be md or json")
    info = await state.store.get_session(uid, sid)
    messages = await state.store.messages(uid, sid)
    if fmt == "json":
        body = json.dumps(chat_json(info, messages), ensure_ascii=False, indent=2).encode("utf-8", "replace")
        media = "application/json"
    else:
        body = chat_markdown(info, messages).encode("utf-8", "replace")
        media = "text/markdown; charset=utf-8"
    disposition = f'attachment; filename="{_filename(info, fmt)}"'
    return Response(body, media_type=media, headers={"content-disposition": disposition,
                                                     "cache-control": "no-store"})


def _snippet(text: str, at: int, length: int) -> str:
    start, end = max(0, at - SNIPPET_CHARS), min(len(text), at + length + SNIPPET_CHARS)
    s = " ".join(text[start:end].split())
    return ("…" if start > 0 else "") + s + ("…" if end < len(text) else "")


def match_chats(query: str, chats: list[tuple[SessionInfo, list[str]]]) -> list[dict[str, Any]]:
    """The search results for ``query`` over ``(chat, raw message JSON strings)`` pairs
    (already newest first): title matches and content matches alike, one row per chat."""
    q = query.casefold()
    out: list[dict[str, Any]] = []
    for info, raw_messages in chats:
        row = {"id": info.id, "title": info.title, "updated_at": info.updated_at, "snippet": "",
               "in_title": q in info.title.casefold()}
        found = row["in_title"]
        for raw in raw_messages:
            content = str(json.loads(raw).get("content", ""))
            at = content.casefold().find(q)
            if at >= 0:
                row["snippet"], found = _snippet(content, at, len(q)), True
                break
        if found:
            out.append(row)
            if len(out) >= SEARCH_LIMIT:
                break
    return out


@api
async def search(request: Request) -> Response:
    """GET /api/search?q=: the user's chats whose title or messages contain ``q``."""
    state, uid = request.app.state, _uid(request)
    query = request.query_params.get("q", "").strip()
    if not query or len(query) > MAX_QUERY_CHARS:
        raise GatewayError("invalid_request", f"q must be 1-{MAX_QUERY_CHARS} characters")
    chats = await state.store.list_sessions(uid)
    async with redis_errors():
        pipe = state.redis.pipeline(transaction=False)
        for info in chats:
            pipe.lrange(state.store.keys.session_messages(info.id), 0, -1)
        lists = await pipe.execute() if chats else []
    rows = list(zip(chats, lists))
    # decoding every message is CPU work: off the event loop
    results = await asyncio.to_thread(match_chats, query, rows)
    return JSONResponse({"results": results})


def export_routes() -> list[Route]:
    """The export and search routes."""
    return [
        Route("/api/sessions/{sid:str}/export", export_session, methods=["GET"]),
        Route("/api/search", search, methods=["GET"]),
    ]
