"""Export a chat (Markdown or JSON download) and search the user's chats by title and
content (docs/protocol.md section 3).

* ``GET /api/sessions/{id}/export?format=md|json`` -> an attachment named after the chat
  (``Content-Disposition``); JSON holds the chat's public fields and messages, Markdown
  a readable transcript (system prompt, then each turn under a heading).
* ``GET /api/export?format=json|md`` -> every chat of the user, every version included
  (JSON: ``{"format": "chatserve-export", "version": 1, "exported_at", "chats": [...]}``,
  which ``POST /api/import`` reads back as it was).
* ``POST /api/import`` (body: our JSON export, ChatGPT's ``conversations.json`` or
  ``conversations-NNN.json``, or its zip) -> ``{"imported", "skipped", "chats",
  "error"?}``: each chat is stored once, keyed by its source (``gateway/chat_import.py``);
  at the user's limit of chats the import stops, keeps what it stored and says so in
  ``error``.
* ``GET /api/search?q=text`` -> ``{"results": [{"id", "title", "updated_at", "snippet",
  "in_title"}]}``: chats whose title or any message contains ``q`` (case-insensitive,
  1-200 characters), newest first, at most ``SEARCH_LIMIT``; the snippet is the text
  around the first match (``SNIPPET_CHARS`` either side). A reply's reasoning is read
  and shown as the page shows it: apart from its answer, without its markers.
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
from gateway.api.state import gateway_state
from gateway.chat_import import EXPORT_FORMAT, read_upload
from gateway.errors import GatewayError
from gateway.reasoning import DEFAULT_MARKERS, ThinkMarkers, split_reasoning, thought_for
from gateway.store.sessions import SessionInfo, redis_errors

SEARCH_LIMIT = 50
SNIPPET_CHARS = 60
MAX_QUERY_CHARS = 200


Versions = dict[str, list[dict[str, Any]]]


def public_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message's public fields (``PUBLIC_MESSAGE_FIELDS``)."""
    return {k: m[k] for k in PUBLIC_MESSAGE_FIELDS if m.get(k) is not None}


def chat_json(info: SessionInfo, messages: list[dict[str, Any]], versions: Versions | None = None
              ) -> dict[str, Any]:
    """The JSON export: the chat's public fields, its messages' public fields and every
    version (``versions``: anchor -> ``[{"messages"} | {"current": true}]``, the format
    ``gateway/chat_import.py`` reads back)."""
    out = {**info.public(), "messages": [public_message(m) for m in messages]}
    if versions:
        out["versions"] = {a: [e if e.get("current") else {"messages": [
            {k: v for k, v in public_message(m).items() if k != "versions"} for m in e["messages"]]}
            for e in entries] for a, entries in versions.items()}
    return out


def shown_parts(m: dict[str, Any], markers: ThinkMarkers = DEFAULT_MARKERS) -> tuple[str | None, str]:
    """A message's text as the page shows it: ``(reasoning, answer)``, reasoning None for a
    user message or a reply without any (``gateway.reasoning.split_reasoning``; the
    markers themselves are in neither)."""
    content = str(m.get("content", ""))
    if m.get("role") != "assistant":
        return None, content
    return split_reasoning(content, markers)


def _md_reasoning(m: dict[str, Any], reasoning: str) -> list[str]:
    """A reply's reasoning as a labelled quote ("Thought for 4.2 s", as the page's folded
    block reads), each line quoted so no text of it can end the quote."""
    ms = m.get("reasoning_ms")
    label = thought_for(float(ms) if isinstance(ms, (int, float)) else None)
    return [f"> *{label}*", ">"] + [f"> {line}" if line.strip() else ">" for line in reasoning.splitlines()] + [""]


def _md_messages(messages: list[dict[str, Any]], level: str = "##",
                 markers: ThinkMarkers = DEFAULT_MARKERS) -> list[str]:
    lines: list[str] = []
    for m in messages:
        role = "You" if m.get("role") == "user" else "Assistant"
        lines += [f"{level} {role}", ""]
        for a in m.get("attachments") or []:
            lines += [f"*Attached: {a.get('name', 'file')}*", ""]
        reasoning, text = shown_parts(m, markers)
        if reasoning:
            lines += _md_reasoning(m, reasoning)
        text = text.rstrip()
        if text:
            lines += [text, ""]
        if m.get("role") == "assistant" and m.get("status") == "partial":
            lines += ["*(reply cut before its end)*", ""]
    return lines


def chat_markdown(info: SessionInfo, messages: list[dict[str, Any]], versions: Versions | None = None,
                  markers: ThinkMarkers = DEFAULT_MARKERS) -> str:
    """The Markdown export: a title, the system prompt as a quote, then one section per
    message (``## You`` / ``## Assistant``, attached files named, a reply's reasoning as
    a quote labelled as the page labels it, without its ``markers``), a cut reply marked
    as such; then, under "Other versions", each version not shown, after the message it
    follows."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(info.created_at))
    lines = [f"# {info.title or 'Untitled chat'}", "", f"*Started {when}.*", ""]
    if info.system_prompt:
        lines += ["> **System prompt:** " + info.system_prompt.replace("\n", "\n> "), ""]
    lines += _md_messages(messages, markers=markers)
    others = [(a, i, len(entries), e) for a, entries in (versions or {}).items()
              for i, e in enumerate(entries) if not e.get("current")]
    if others:
        lines += ["---", "", "## Other versions", ""]
        def shown(m: dict[str, Any]) -> str:
            reasoning, answer = shown_parts(m, markers)
            return answer or reasoning or ""

        texts = {m["id"]: shown(m) for m in messages if m.get("id")}
        for entries in (versions or {}).values():
            for e in entries:
                for m in e.get("messages", []):
                    texts.setdefault(m.get("id", ""), shown(m))
        for anchor, i, n, e in others:
            after = "the start" if anchor == "^" else "“" + " ".join(texts.get(anchor, "").split())[:60] + "”"
            lines += [f"### Version {i + 1} of {n}, after {after}", ""]
            lines += _md_messages(e["messages"], "####", markers)
    return "\n".join(lines).rstrip() + "\n"


def _filename(info: SessionInfo, ext: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", info.title or "chat").strip("-.")[:60] or "chat"
    return f"{base}.{ext}"


@api
async def export_session(request: Request) -> Response:
    """GET /api/sessions/{id}/export?format=md|json: the chat as a download."""
    state, uid, sid = gateway_state(request), _uid(request), _sid(request)
    fmt = request.query_params.get("format", "md")
    if fmt not in ("md", "json"):
        raise GatewayError("invalid_request", "format must be md or json")
    info, messages, versions = await state.chat_transfer.whole_chat(uid, sid)
    if fmt == "json":
        body = json.dumps(chat_json(info, messages, versions), ensure_ascii=False, indent=2).encode("utf-8", "replace")
        media = "application/json"
    else:
        body = chat_markdown(info, messages, versions, state.config.think_markers).encode("utf-8", "replace")
        media = "text/markdown; charset=utf-8"
    disposition = f'attachment; filename="{_filename(info, fmt)}"'
    return Response(body, media_type=media, headers={"content-disposition": disposition,
                                                     "cache-control": "no-store"})


EXPORT_VERSION = 1
MAX_IMPORT_BYTES = 64 << 20  # an upload to POST /api/import (a ChatGPT zip of years of chats)


@api
async def export_all(request: Request) -> Response:
    """GET /api/export?format=json|md: every chat of the user, with every version."""
    state, uid = gateway_state(request), _uid(request)
    fmt = request.query_params.get("format", "json")
    if fmt not in ("md", "json"):
        raise GatewayError("invalid_request", "format must be md or json")
    transfer = state.chat_transfer
    chats = []
    for info in await state.store.list_sessions(uid):
        try:
            chats.append(await transfer.whole_chat(uid, info.id))
        except GatewayError as e:
            if e.code != "not_found":  # deleted meanwhile
                raise
    day = time.strftime("%Y-%m-%d", time.gmtime())
    if fmt == "json":
        doc = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "exported_at": time.time(),
               "chats": [chat_json(*c) for c in chats]}
        body = json.dumps(doc, ensure_ascii=False, indent=2).encode("utf-8", "replace")
        media = "application/json"
    else:
        markers = state.config.think_markers
        body = "\n---\n\n".join(chat_markdown(*c, markers) for c in chats).encode("utf-8", "replace")
        media = "text/markdown; charset=utf-8"
    return Response(body, media_type=media, headers={
        "content-disposition": f'attachment; filename="chats-{day}.{fmt}"', "cache-control": "no-store"})


@api
async def import_chats(request: Request) -> Response:
    """POST /api/import: store the chats of an export file; a chat already imported (or,
    for our own export, still held by this user) is skipped."""
    state, uid = gateway_state(request), _uid(request)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > MAX_IMPORT_BYTES:
        raise GatewayError("frame_too_large", f"the file is over the {MAX_IMPORT_BYTES >> 20} MiB import limit")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_IMPORT_BYTES:
            raise GatewayError("frame_too_large", f"the file is over the {MAX_IMPORT_BYTES >> 20} MiB import limit")
    chats = await asyncio.to_thread(read_upload, bytes(data), 4 * MAX_IMPORT_BYTES)
    transfer = state.chat_transfer
    imported: list[dict[str, str]] = []
    skipped = 0
    stopped: dict[str, str] | None = None
    for chat in chats:
        try:
            sid = await transfer.import_chat(uid, chat)
        except GatewayError as e:
            if e.code != "too_many_sessions":
                raise
            # what was stored stays; the answer says so and why the rest was not
            left = len(chats) - len(imported) - skipped
            more = f"{left} more chat{'s' if left != 1 else ''}"
            stopped = {"code": e.code, "message": f"{more} not imported: {e.message}"}
            break
        if sid is None:
            skipped += 1
        else:
            imported.append({"id": sid, "title": chat.title})
    body: dict[str, Any] = {"imported": len(imported), "skipped": skipped, "chats": imported}
    if stopped:
        body["error"] = stopped
    return JSONResponse(body)


def _snippet(text: str, at: int, length: int) -> str:
    start, end = max(0, at - SNIPPET_CHARS), min(len(text), at + length + SNIPPET_CHARS)
    s = " ".join(text[start:end].split())
    return ("…" if start > 0 else "") + s + ("…" if end < len(text) else "")


def _message_snippet(m: dict[str, Any], q: str, markers: ThinkMarkers) -> str | None:
    """The snippet of message ``m`` around casefolded ``q``, or None: the text the page
    shows is searched, the answer before the reasoning (whose snippet starts "Thoughts: "),
    never the reasoning markers."""
    reasoning, answer = shown_parts(m, markers)
    for prefix, text in (("", answer), ("Thoughts: ", reasoning or "")):
        at = text.casefold().find(q)
        if at >= 0:
            return prefix + _snippet(text, at, len(q))
    return None


def match_chats(query: str, chats: list[tuple[SessionInfo, list[str]]],
                markers: ThinkMarkers = DEFAULT_MARKERS) -> list[dict[str, Any]]:
    """The search results for ``query`` over ``(chat, raw message JSON strings)`` pairs
    (already newest first): title matches and content matches alike, one row per chat.
    A reply is searched as the page shows it (``_message_snippet``)."""
    q = query.casefold()
    out: list[dict[str, Any]] = []
    for info, raw_messages in chats:
        row = {"id": info.id, "title": info.title, "updated_at": info.updated_at, "snippet": "",
               "in_title": q in info.title.casefold()}
        found = row["in_title"]
        for raw in raw_messages:
            snippet = _message_snippet(json.loads(raw), q, markers)
            if snippet is not None:
                row["snippet"], found = snippet, True
                break
        if found:
            out.append(row)
            if len(out) >= SEARCH_LIMIT:
                break
    return out


@api
async def search(request: Request) -> Response:
    """GET /api/search?q=: the user's chats whose title or messages contain ``q``."""
    state, uid = gateway_state(request), _uid(request)
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
    results = await asyncio.to_thread(match_chats, query, rows, state.config.think_markers)
    return JSONResponse({"results": results})


def export_routes() -> list[Route]:
    """The export and search routes."""
    return [
        Route("/api/sessions/{sid:str}/export", export_session, methods=["GET"]),
        Route("/api/search", search, methods=["GET"]),
        Route("/api/export", export_all, methods=["GET"]),
        Route("/api/import", import_chats, methods=["POST"]),
    ]
