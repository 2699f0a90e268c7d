"""Reading chat exports into chats to store (docs/protocol.md, "Import and export").

Two sources are read:

* **Our own export** (``GET /api/export`` or ``/api/sessions/{id}/export?format=json``):
  ``{"format": "chatserve-export", "version": 1, "chats": [chat]}`` or one chat object,
  each ``{"id", "title", "system_prompt", "params", "created_at", "updated_at",
  "messages", "versions"?}``; ``versions`` maps an anchor (the id of the message before a
  branch point, ``^`` for the first) to the chat's versions after it, in order, each
  ``{"messages": [...]}`` or ``{"current": true}`` for the one ``messages`` shows. An
  assistant message keeps its ``tool_calls`` and a user message its ``tool_results``
  (checked: their shapes as a ``chat`` frame gives them).
* **ChatGPT's data export**: ``conversations.json`` (a list of conversations), the 2026
  exports' ``conversations-000.json``, ``-001``, ... (the same list split), or the
  export's zip holding them. A conversation is a message tree (``mapping``: node id ->
  ``{"message", "parent", "children"}``) with ``current_node`` the last message shown.
  Every node is kept: the path to ``current_node`` becomes the chat's messages, and at
  each node with several children the others become versions (their own subtrees
  followed by their newest child, as ChatGPT shows them), so every branch can be shown.
  Hidden messages (the empty system root, tool calls and their results, thoughts) are
  left out, their children joined to their parent. Messages need no model name.

Every chat carries its ``source`` (``chatgpt:{conversation id}`` or ``chatserve:{id}``),
the key that keeps a chat imported twice from being stored twice.
"""

from __future__ import annotations

import io
import re
import time
import uuid
import zipfile
from dataclasses import dataclass, field
from typing import Any

from gateway.attachments import ATTACHMENT_LIMITS, parse_attachments
from gateway.errors import GatewayError
from gateway.json_input import BadJson, loads_json

__all__ = ["ImportedChat", "EXPORT_FORMAT", "read_upload", "from_chatgpt", "from_chatserve"]

EXPORT_FORMAT = "chatserve-export"
_ID_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
MAX_MESSAGES = 20_000  # messages of one chat, all versions together
MAX_CHARS = 4_000_000  # characters of one message
_STATUS = ("complete", "partial", "error")
MAX_TOOL_ITEMS = 128  # tool calls of one message, or results of one message
MAX_TOOL_ID_CHARS = 128  # characters of a tool call's id or function name
_KEEP = ("status", "finish_reason", "cut_reason", "usage", "timings", "error", "created_at", "attachments",
         "reasoning_ms", "model")


@dataclass
class ImportedChat:
    """A chat read from an export, ready to store.

    Attributes:
        source: where it came from (``chatgpt:{id}``, ``chatserve:{id}``): the key that
            keeps it from being imported twice.
        messages: the shown branch, oldest first: ``{"role", "id", "content", ...}``
            (``role`` first and ``id`` second, as the store's scripts read them).
        versions: anchor -> ``[{"messages": [...]} | {"current": True}]`` (module doc).
    """

    source: str
    title: str
    system_prompt: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    messages: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _new_id() -> str:
    return uuid.uuid4().hex


def _time(v: Any, default: float) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else default


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _message(raw: Any, ids: dict[str, str]) -> dict[str, Any]:
    """One of our exported messages, checked (role, text, known fields only)."""
    if not isinstance(raw, dict) or raw.get("role") not in ("user", "assistant"):
        raise GatewayError("invalid_request", "a message must have the role user or assistant")
    content = raw.get("content", "")
    if not isinstance(content, str) or len(content) > MAX_CHARS:
        raise GatewayError("invalid_request", f"a message's content must be text of at most {MAX_CHARS:,} characters")
    old = raw.get("id")
    mid = old if isinstance(old, str) and _ID_RE.match(old) and old not in ids.values() else _new_id()
    if isinstance(old, str):
        ids[old] = mid
    out: dict[str, Any] = {"role": raw["role"], "id": mid, "content": content}
    for k in _KEEP:
        if raw.get(k) is not None:
            out[k] = raw[k]
    if out.get("status") not in _STATUS:
        out["status"] = "complete"
    if not isinstance(out.get("model", ""), str) or not isinstance(out.get("reasoning_ms", 0.0), (int, float)):
        raise GatewayError("invalid_request", "a message's 'model' must be text and its 'reasoning_ms' a number")
    if "attachments" in out:
        out["attachments"] = [a.to_json() for a in parse_attachments(out["attachments"], ATTACHMENT_LIMITS)]
    if raw["role"] == "assistant" and raw.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(raw["tool_calls"])
    if raw["role"] == "user" and raw.get("tool_results") is not None:
        out["tool_results"] = _tool_results(raw["tool_results"])
    return out


def _short_text(v: Any, limit: int = MAX_TOOL_ID_CHARS) -> bool:
    return isinstance(v, str) and 0 < len(v) <= limit


def _tool_calls(raw: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as stored: ``[{"id", "type": "function",
    "function": {"name", "arguments"}}]`` (strings; at most ``MAX_TOOL_ITEMS``)."""
    bad = GatewayError("invalid_request", "a message's 'tool_calls' must be a list of {\"id\", \"type\": "
                       "\"function\", \"function\": {\"name\", \"arguments\"}}")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_TOOL_ITEMS:
        raise bad
    out = []
    for c in raw:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and _short_text(c.get("id")) and c.get("type", "function") == "function"
                and _short_text(fn.get("name")) and isinstance(fn.get("arguments"), str)
                and len(fn["arguments"]) <= MAX_CHARS):
            raise bad
        out.append({"id": c["id"], "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _tool_results(raw: Any) -> list[dict[str, str]]:
    """A user message's ``tool_results`` as stored: ``[{"tool_call_id", "content"}]``
    (strings; at most ``MAX_TOOL_ITEMS``)."""
    bad = GatewayError("invalid_request", "a message's 'tool_results' must be a list of "
                       "{\"tool_call_id\", \"content\"}")
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_TOOL_ITEMS:
        raise bad
    out = []
    for r in raw:
        if not (isinstance(r, dict) and _short_text(r.get("tool_call_id")) and isinstance(r.get("content"), str)
                and len(r["content"]) <= MAX_CHARS):
            raise bad
        out.append({"tool_call_id": r["tool_call_id"], "content": r["content"]})
    return out


def from_chatserve(chat: Any) -> ImportedChat:
    """One chat of our own JSON export.

    Raises:
        GatewayError: ``invalid_request`` naming what is wrong.
    """
    if not isinstance(chat, dict) or not isinstance(chat.get("messages"), list):
        raise GatewayError("invalid_request", "a chat must be an object with a list of messages")
    now = time.time()
    ids: dict[str, str] = {}
    messages = [_message(m, ids) for m in chat["messages"]]
    versions: dict[str, list[dict[str, Any]]] = {}
    raw_versions = chat.get("versions") or {}
    if not isinstance(raw_versions, dict):
        raise GatewayError("invalid_request", "'versions' must be an object")
    count = len(messages)
    for anchor, entries in raw_versions.items():
        if not isinstance(entries, list) or sum(1 for e in entries if isinstance(e, dict) and e.get("current")) != 1:
            raise GatewayError("invalid_request", "each entry of 'versions' must be a list with one current version")
        out: list[dict[str, Any]] = []
        for e in entries:
            if not isinstance(e, dict):
                raise GatewayError("invalid_request", "a version must be an object")
            if e.get("current"):
                out.append({"current": True})
            else:
                ms = [_message(m, ids) for m in e.get("messages") or []]
                count += len(ms)
                out.append({"messages": ms})
        versions[str(anchor)] = out
    if count > MAX_MESSAGES:
        raise GatewayError("invalid_request", f"a chat may hold at most {MAX_MESSAGES:,} messages")
    # anchors name messages by their exported ids: follow any id that had to change
    versions = {(ids.get(a, a) if a != "^" else a): v for a, v in versions.items()}
    title = _str(chat.get("title"))
    sp = _str(chat.get("system_prompt"))
    params = chat["params"] if isinstance(chat.get("params"), dict) else {}
    source = _str(chat.get("source")) or (
        f"chatserve:{chat['id']}" if isinstance(chat.get("id"), str) else f"chatserve:{_new_id()}")
    created = _time(chat.get("created_at"), now)
    return ImportedChat(source=source[:200], title=title[:200], system_prompt=sp, params=params,
                        created_at=created, updated_at=_time(chat.get("updated_at"), created),
                        messages=messages, versions=versions)


# ---- ChatGPT ----------------------------------------------------------------------------

def _part_text(part: Any) -> str:
    """A part of a ChatGPT message as text: a string as is, a voice message its
    transcript, an uploaded image or file a placeholder (their bytes are not in
    ``conversations.json``)."""
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        if part.get("content_type") == "audio_transcription":
            return str(part.get("text") or "")
        if "image" in str(part.get("content_type", "")):
            return "[image]"
        return "[attachment]"
    return ""


def _chatgpt_text(msg: dict[str, Any]) -> str | None:
    """The text a ChatGPT message shows, or None for one the UI hides."""
    author = (msg.get("author") or {}).get("role")
    if author not in ("user", "assistant"):
        return None  # system (the empty root, custom instructions), tool results
    if msg.get("recipient", "all") != "all":
        return None  # a tool call
    meta = msg.get("metadata") or {}
    if meta.get("is_visually_hidden_from_conversation") or meta.get("is_user_system_message"):
        return None
    content = msg.get("content") or {}
    ctype = content.get("content_type", "text")
    if ctype in ("text", "multimodal_text"):
        parts = [_part_text(p) for p in content.get("parts") or []]
        text = "\n".join(p for p in parts if p)
    elif ctype == "code" and author == "assistant":
        text = str(content.get("text") or "")
    else:
        return None  # thoughts, reasoning recaps, browsing results, ...
    return text if text.strip() else None


def from_chatgpt(conv: Any) -> ImportedChat:
    """One conversation of ChatGPT's export (module doc).

    Raises:
        GatewayError: ``invalid_request`` for a conversation without a message tree.
    """
    if not isinstance(conv, dict) or not isinstance(conv.get("mapping"), dict):
        raise GatewayError("invalid_request", "a ChatGPT conversation must have a 'mapping'")
    mapping: dict[str, Any] = conv["mapping"]
    now = time.time()
    created = _time(conv.get("create_time"), now)
    texts: dict[str, str | None] = {}
    for nid, node in mapping.items():
        msg = node.get("message") if isinstance(node, dict) else None
        texts[nid] = _chatgpt_text(msg) if isinstance(msg, dict) else None

    def kids(nid: str) -> list[str]:
        """The visible children of ``nid``: hidden ones are passed through to theirs."""
        out: list[str] = []
        stack = list(reversed((mapping.get(nid) or {}).get("children") or []))
        while stack:
            c = stack.pop()
            if c not in mapping:
                continue
            if texts.get(c) is not None:
                out.append(c)
            else:
                stack.extend(reversed(mapping[c].get("children") or []))
        return out

    roots = [nid for nid, n in mapping.items() if isinstance(n, dict) and not n.get("parent")]
    on_path: set[str] = set()
    cur = conv.get("current_node")
    seen: set[str] = set()
    while isinstance(cur, str) and cur in mapping and cur not in seen:
        seen.add(cur)
        on_path.add(cur)
        cur = mapping[cur].get("parent")
    ids: dict[str, str] = {}

    def mid(nid: str) -> str:
        if nid not in ids:
            ids[nid] = nid if _ID_RE.match(nid) else _new_id()
        return ids[nid]

    def message(nid: str) -> dict[str, Any]:
        msg = mapping[nid]["message"]
        role = msg["author"]["role"]
        out: dict[str, Any] = {"role": role, "id": mid(nid), "content": texts[nid], "status": "complete",
                               "created_at": _time(msg.get("create_time"), created)}
        return out

    versions: dict[str, list[dict[str, Any]]] = {}
    count = 0

    def pick(ks: list[str]) -> str:
        return next((k for k in ks if k in on_path), ks[-1])

    def branch(first: str) -> list[dict[str, Any]]:
        """Messages from ``first`` down its shown line; each fork on the way is recorded."""
        nonlocal count
        out: list[dict[str, Any]] = []
        n: str | None = first
        while n is not None:
            out.append(message(n))
            count += 1
            if count > MAX_MESSAGES:
                raise GatewayError("invalid_request", f"a chat may hold at most {MAX_MESSAGES:,} messages")
            n = fork(n, mid(n))
        return out

    def fork(parent: str, anchor: str) -> str | None:
        """The child of ``parent`` shown next; the others become versions at ``anchor``."""
        ks = kids(parent)
        if not ks:
            return None
        shown = pick(ks)
        if len(ks) > 1:
            versions[anchor] = [{"current": True} if k == shown else {"messages": branch(k)} for k in ks]
        return shown

    # the tree's root is usually an empty node; several roots (seldom) are forks at "^"
    top: list[str] = []
    for r in roots:
        top.extend([r] if texts.get(r) is not None else kids(r))
    messages: list[dict[str, Any]] = []
    if top:
        shown = pick(top)
        if len(top) > 1:
            versions["^"] = [{"current": True} if k == shown else {"messages": branch(k)} for k in top]
        messages = branch(shown)
    source_id = conv.get("conversation_id") or conv.get("id") or ""
    if not isinstance(source_id, str) or not source_id:
        raise GatewayError("invalid_request", "a ChatGPT conversation without an id")
    title = conv.get("title") if isinstance(conv.get("title"), str) else ""
    return ImportedChat(source=f"chatgpt:{source_id}"[:200], title=(title or "Imported chat")[:200],
                        created_at=created, updated_at=_time(conv.get("update_time"), created),
                        messages=messages, versions=versions)


# ---- uploads ------------------------------------------------------------------------------

def _chats_of(obj: Any) -> list[ImportedChat]:
    if isinstance(obj, dict) and obj.get("format") == EXPORT_FORMAT:
        chats = obj.get("chats")
        if not isinstance(chats, list):
            raise GatewayError("invalid_request", "the export has no list of chats")
        return [from_chatserve(c) for c in chats]
    if isinstance(obj, dict) and "mapping" in obj:
        return [from_chatgpt(obj)]
    if isinstance(obj, dict) and "messages" in obj:
        return [from_chatserve(obj)]
    if isinstance(obj, list) and all(isinstance(c, dict) and "mapping" in c for c in obj):
        return [from_chatgpt(c) for c in obj]
    raise GatewayError("invalid_request", "this is neither our chat export nor ChatGPT's conversations.json")


def read_upload(data: bytes, max_unzipped_bytes: int) -> list[ImportedChat]:
    """The chats of an uploaded export: a JSON file (ours, or ChatGPT's
    ``conversations.json`` / ``conversations-NNN.json``) or ChatGPT's zip.

    Raises:
        GatewayError: ``invalid_request`` for anything else, with the reason.
    """
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                names = sorted(n for n in z.namelist()
                               if re.fullmatch(r"(?:.*/)?conversations(?:-\d+)?\.json", n))
                if not names:
                    raise GatewayError("invalid_request", "the zip holds no conversations.json")
                if sum(z.getinfo(n).file_size for n in names) > max_unzipped_bytes:
                    raise GatewayError("frame_too_large", "the conversations in the zip are too large to import")
                chats: list[ImportedChat] = []
                for n in names:
                    chats += _chats_of(_loads(z.read(n)))
                return chats
        except zipfile.BadZipFile:
            raise GatewayError("invalid_request", "the zip file cannot be read") from None
    return _chats_of(_loads(data))


def _loads(data: bytes) -> Any:
    """The file's JSON (UTF-8, a BOM allowed).

    Raises:
        GatewayError: ``invalid_request`` saying where the file stopped being JSON, in
            words (``the file is not valid JSON: expecting value at line 1, column 1``).
    """
    try:
        return loads_json(data)
    except BadJson as e:
        raise GatewayError("invalid_request", f"the file is {e}") from None
