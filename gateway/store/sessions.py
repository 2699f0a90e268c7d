"""The chat store: chats, their messages and token ids in Redis (``redis.asyncio``).

Layout: the ``chat:user:{uid}:...`` and ``chat:session:{sid}:...`` keys of the key table
(``gateway.store.keys``).

Every change that touches more than one key is one Lua script (``store_scripts``),
so two tabs writing at once lose nothing and no history is ever rewritten whole.

Token segments: each message's segment holds the ids it added to the model's input
(a user message: its turn's prompt ids after the previous turn's; a reply: the sampled
ids), with the ``model`` that read or wrote them (a turn on another model reuses none).
A segment marked ``base`` holds a whole prompt (the engine could not reuse the prefix)
and supersedes everything before it. The next turn's ``prefix_token_ids`` are
the segments from the last base on, up to the first message without one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc

from gateway.attachments import prompt_content
from gateway.errors import GatewayError, not_found, store_unavailable
from gateway.store import scripts as store_scripts
from gateway.store.keys import Keys


def new_id() -> str:
    """A random id for a chat, message or request (32 hex characters)."""
    return uuid.uuid4().hex


def dumps(obj: Any) -> str:
    """Compact JSON (the layout the Lua scripts rely on: no spaces after separators)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@asynccontextmanager
async def redis_errors() -> AsyncIterator[None]:
    """Turn Redis failures into ``GatewayError``: unreachable -> ``store_unavailable``."""
    try:
        yield
    except (rexc.ConnectionError, rexc.TimeoutError, rexc.BusyLoadingError, OSError) as e:
        raise store_unavailable() from e


@dataclass
class SessionInfo:
    """A chat's metadata. Times are Unix seconds; ``active`` is the reply in progress
    (``{"request_id", "message_id", "user_message_id"}``) or None."""

    id: str
    owner: str
    title: str
    system_prompt: str
    params: dict[str, Any]
    created_at: float
    updated_at: float
    active: dict[str, str] | None = None
    model: str = ""  # the model its replies come from ("": none named, any engine)

    def public(self) -> dict[str, Any]:
        """The JSON shape of docs/protocol.md section 3 (without messages)."""
        return {"id": self.id, "title": self.title, "system_prompt": self.system_prompt,
                "params": self.params, "model": self.model or None, "created_at": self.created_at,
                "updated_at": self.updated_at}


@dataclass
class TurnBegun:
    """What ``begin_turn`` reserved. ``duplicate`` is set (and nothing was written)
    when the turn's ``client_msg_id`` had already started ``request_id``."""

    request_id: str
    message_id: str
    user_message_id: str
    user_json: str = ""
    popped_json: str = ""
    popped_tokens: str = ""
    title: str = ""
    duplicate: bool = False
    edit_undo: str = ""
    title_before: str = ""  # the title ``title`` replaced (an edit of the first message)
    # the chat as the reply's prompt reads it, when the turn opened its reply stream
    # (``begin_turn``'s ``stream_ttl_s``): its stored messages and token segments
    chat: tuple[list[dict[str, Any]], dict[str, dict[str, Any]]] | None = None


@dataclass
class History:
    """A chat as the engine needs it.

    Attributes:
        messages: ``[{"role", "content"}]`` with the system prompt first (when set).
        prefix_token_ids: exact ids of a leading part of ``messages`` (see module doc).
        split: see ``plan_prefix``.
        stored: the raw stored messages (dicts), oldest first.
        full_ids: the exact ids of the whole stored chat (``full_prefix``), or None.
    """

    messages: list[dict[str, str]]
    prefix_token_ids: list[int]
    split: int | None
    stored: list[dict[str, Any]] = field(default_factory=list)
    full_ids: list[int] | None = None

    @classmethod
    def of(cls, stored: list[dict[str, Any]], segments: dict[str, dict[str, Any]], system_prompt: str,
           model: str = "") -> History:
        """The chat as engine input from its stored messages and token segments. With
        ``model``, the token ids another model wrote (segments marked with another
        ``model``) count as none: that model's tokenizer is not this one's."""
        if model:
            segments = {k: v for k, v in segments.items() if v.get("model", model) == model}
        msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
        msgs += [e for m in stored for e in engine_messages(m)]
        prefix, split = plan_prefix(stored, segments)
        return cls(msgs, prefix, split, stored, full_prefix(stored, segments))

    def user_segment(self, prompt_token_ids: list[int], prefix_reused: bool) -> dict[str, Any]:
        """The token segment to store for the turn's user message, from the engine's
        ``done`` (``prompt_token_ids``, ``prefix_reused``)."""
        if prefix_reused and self.split is not None:
            return {"ids": prompt_token_ids[self.split:], "base": False}
        return {"ids": list(prompt_token_ids), "base": True}


def engine_messages(m: dict[str, Any]) -> list[dict[str, Any]]:
    """A stored message as the engine's messages: a user message that answers tool calls
    (``tool_results``) is one ``tool`` message per result (then its text, if any); a reply
    that called tools keeps its ``tool_calls``; attachments are rendered in."""
    out: list[dict[str, Any]] = [{"role": "tool", "content": r["content"], "tool_call_id": r["tool_call_id"]}
                                 for r in m.get("tool_results") or ()]
    if out and not (m["content"].strip() or m.get("attachments")):
        return out
    msg: dict[str, Any] = {"role": m["role"], "content": prompt_content(m["content"], m.get("attachments"))}
    if m.get("tool_calls"):
        msg["tool_calls"] = m["tool_calls"]
    return [*out, msg]


def plan_prefix(stored: list[dict[str, Any]], segments: dict[str, dict[str, Any]]) -> tuple[list[int], int | None]:
    """The ``prefix_token_ids`` for a turn that answers the chat's last user message.

    The prefix is the concatenated segments from the last ``base`` one (at or before
    that user message) up to and including the user message, stopping at the first
    message without a segment or with one marked ``reasoning`` (a reply whose reasoning
    later prompts leave out: ``gateway/reasoning.py``).

    Args:
        stored: messages oldest first (each with ``id`` and ``role``).
        segments: message id -> ``{"ids": [int], "base": bool}``.
    Returns:
        (prefix ids, split): ``split`` is how many prefix tokens come before the user
        message when the prefix reaches it and its segment is not a base; then the
        user message's new segment is ``prompt_token_ids[split:]``. None means it must
        be stored as a base (the whole prompt).
    """
    users = [i for i, m in enumerate(stored) if m["role"] == "user"]
    if not users:
        return [], None
    u = users[-1]
    start = 0
    for i in range(u + 1):
        seg = segments.get(stored[i]["id"])
        if seg and seg.get("base"):
            start = i
    ids: list[int] = []
    split: int | None = None
    for i in range(start, u + 1):
        seg = segments.get(stored[i]["id"])
        if i == u and not (seg and seg.get("base")):
            split = len(ids)
        if seg is None or seg.get("reasoning"):
            break
        ids.extend(seg["ids"])
    return ids, split


def mark_versions(stored: list[dict[str, Any]], versions: dict[str, str]) -> None:
    """Give each message that starts a branch point ``versions``: ``{"index", "count"}``
    (0-based index of the version shown among ``count``), from the ``:versions`` hash
    (anchor id -> JSON array; see ``store_scripts``). A user message has versions when it
    was edited, a reply when it was regenerated."""
    if not versions:
        return
    for i, m in enumerate(stored):
        raw = versions.get(stored[i - 1]["id"] if i else "^")
        if raw is None:
            continue
        entries = json.loads(raw)
        cur = next((j for j, e in enumerate(entries) if e.get("cur")), None)
        if cur is not None and len(entries) > 1:
            m["versions"] = {"index": cur, "count": len(entries)}


def full_prefix(stored: list[dict[str, Any]], segments: dict[str, dict[str, Any]]) -> list[int] | None:
    """The exact ids of the whole chat (segments from the last ``base`` one to the last
    message), or None when a message after that base has no segment."""
    start = 0
    for i, m in enumerate(stored):
        seg = segments.get(m["id"])
        if seg and seg.get("base"):
            start = i
    ids: list[int] = []
    for m in stored[start:]:
        seg = segments.get(m["id"])
        if seg is None:
            return None
        ids.extend(seg["ids"])
    return ids or None


def title_from(content: str, max_chars: int = 60) -> str:
    """A chat title from its first message: whitespace collapsed, cut at ``max_chars``."""
    text = " ".join(content.split())
    return text if len(text) <= max_chars else text[: max_chars - 1].rstrip() + "…"


class SessionStore:
    """Chats in Redis for many users; every method checks the owner.

    Raises (every async method):
        GatewayError: ``not_found`` (unknown chat or another user's), ``store_unavailable``
            (Redis unreachable), or a limit's code.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int | None, lock_lease_ms: int,
                 max_sessions_per_user: int, max_generations_per_user: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl = int(ttl_s or 0)
        self.lease_ms = lock_lease_ms
        self.max_sessions = max_sessions_per_user
        self.max_generations = max_generations_per_user
        self._create = redis.register_script(store_scripts.CREATE)
        self._update = redis.register_script(store_scripts.UPDATE)
        self._delete = redis.register_script(store_scripts.DELETE)
        self._begin = redis.register_script(store_scripts.BEGIN)
        self._finish = redis.register_script(store_scripts.FINISH)
        self._fail = redis.register_script(store_scripts.FAIL)
        self._lease = redis.register_script(store_scripts.LEASE)
        self._switch = redis.register_script(store_scripts.SWITCH)

    # ---- chats ---------------------------------------------------------------

    async def create_session(self, owner: str, title: str = "", system_prompt: str = "",
                             params: dict[str, Any] | None = None, model: str = "") -> SessionInfo:
        """Create a chat owned by ``owner``.

        Raises:
            GatewayError: ``too_many_sessions`` when the user has the most allowed.
        """
        sid, now = new_id(), time.time()
        async with redis_errors():
            if await self.redis.zcard(self.keys.user_sessions(owner)) >= self.max_sessions:
                await self._prune_index(owner)  # entries of expired chats do not count
            res = await self._create(keys=self.keys.script_keys(sid, owner),
                                     args=[owner, sid, title, system_prompt, dumps(params or {}), now,
                                           self.max_sessions, self.ttl, model])
        if res == "too_many_sessions":
            raise GatewayError("too_many_sessions", f"at most {self.max_sessions} chats per user; delete some")
        return SessionInfo(sid, owner, title, system_prompt, dict(params or {}), now, now, model=model)

    async def _prune_index(self, owner: str) -> None:
        """Drop index entries whose chat expired (only matters with a TTL)."""
        key = self.keys.user_sessions(owner)
        sids: list[Any] = await self.redis.zrange(key, 0, -1)
        pipe = self.redis.pipeline(transaction=False)
        for sid in sids:
            pipe.exists(self.keys.session(sid))
        gone = [sid for sid, alive in zip(sids, await pipe.execute()) if not alive]
        if gone:
            await self.redis.zrem(key, *gone)

    async def get_session(self, owner: str, sid: str) -> SessionInfo:
        """A chat's metadata; ``active`` is None when no reply holds the chat's lock."""
        k = self.keys.script_keys(sid, owner)
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=False)
            pipe.hgetall(k[0])
            pipe.get(k[5])
            data, lock = await pipe.execute()
        if not data or data.get("owner") != owner:
            raise not_found()
        return self._info(data, lock)

    @staticmethod
    def _info(data: dict[str, str], lock: str | None) -> SessionInfo:
        active = json.loads(data["active"]) if data.get("active") else None
        if active is not None and active.get("request_id") != lock:
            active = None  # the reply's gateway died: its lease ran out
        return SessionInfo(
            id=data["id"], owner=data["owner"], title=data.get("title", ""),
            system_prompt=data.get("system_prompt", ""), params=json.loads(data.get("params") or "{}"),
            created_at=float(data["created_at"]), updated_at=float(data["updated_at"]), active=active,
            model=data.get("model", ""),
        )

    async def list_sessions(self, owner: str, limit: int = 500) -> list[SessionInfo]:
        """The user's chats, most recently updated first."""
        async with redis_errors():
            sids: list[Any] = await self.redis.zrevrange(self.keys.user_sessions(owner), 0, limit - 1)
            pipe = self.redis.pipeline(transaction=False)
            for sid in sids:
                pipe.hgetall(self.keys.session(sid))
            rows = await pipe.execute() if sids else []
        out = [self._info(d, None) for d in rows if d and d.get("owner") == owner]
        return out

    async def update_session(self, owner: str, sid: str, *, title: str | None = None,
                             system_prompt: str | None = None, params: dict[str, Any] | None = None,
                             model: str | None = None) -> None:
        """Change any of a chat's title, system prompt, stored sampling params and model
        ("" for none: any engine)."""
        kv: list[Any] = []
        if model is not None:
            kv += ["model", model]
        if title is not None:
            kv += ["title", title]
        if system_prompt is not None:
            kv += ["system_prompt", system_prompt]
        if params is not None:
            kv += ["params", dumps(params)]
        async with redis_errors():
            res = await self._update(keys=self.keys.script_keys(sid, owner),
                                     args=[owner, sid, time.time(), self.ttl, *kv])
        if res == "not_found":
            raise not_found()

    async def delete_session(self, owner: str, sid: str) -> dict[str, str] | None:
        """Delete a chat and all its keys; returns the reply that was in progress (to
        cancel), or None."""
        async with redis_errors():
            res = await self._delete(keys=self.keys.script_keys(sid, owner), args=[owner, sid])
        if res[0] == "not_found":
            raise not_found()
        return json.loads(res[1]) if res[1] else None

    # ---- messages --------------------------------------------------------------

    async def messages(self, owner: str, sid: str, with_tokens: bool = False) -> list[dict[str, Any]]:
        """The chat's messages oldest first; with ``with_tokens`` each carries
        ``token_ids`` (its segment or None) and ``tokens_base``."""
        info = await self.get_session(owner, sid)
        stored, segments = await self._read_messages(info.id, owner, with_tokens, with_versions=True)
        if with_tokens:
            for m in stored:
                seg = segments.get(m["id"])
                m["token_ids"] = seg["ids"] if seg else None
                m["tokens_base"] = bool(seg and seg.get("base"))
        return stored

    async def _read_messages(self, sid: str, owner: str, with_tokens: bool, with_versions: bool = False
                             ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        k = self.keys.script_keys(sid, owner)
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=True)  # one snapshot of the keys
            pipe.lrange(k[1], 0, -1)
            if with_tokens:
                pipe.hgetall(k[2])
            if with_versions:
                pipe.hgetall(k[7])
            res = await pipe.execute()
        stored = [json.loads(s) for s in res[0]]
        segments = {mid: json.loads(v) for mid, v in res[1].items()} if with_tokens else {}
        if with_versions:
            mark_versions(stored, res[-1])
        return stored, segments

    async def history(self, owner: str, sid: str, system_prompt: str, model: str = "") -> History:
        """The chat as engine input: ``messages`` and ``prefix_token_ids``. With ``model``,
        the token ids another model wrote (segments marked with another ``model``) count
        as none: that model's tokenizer is not this one's."""
        stored, segments = await self._read_messages(sid, owner, True)
        return History.of(stored, segments, system_prompt, model)

    # ---- turns (one reply at a time per chat) ---------------------------------------

    async def begin_turn(self, owner: str, sid: str, *, mode: str, content: str = "",
                         client_msg_id: str | None = None, title_chars: int = 60,
                         replaces: str | None = None, attachments: list[dict[str, Any]] | None = None,
                         stream_ttl_s: int = 0, tool_results: list[dict[str, str]] | None = None,
                         create: SessionInfo | None = None) -> TurnBegun:
        """Atomically take the chat's lock and a generation slot, then append the user
        message (``mode="chat"``), replace the user message ``replaces`` and everything
        after it with ``content``, keeping the old branch as a version (``mode="edit"``),
        or take the last reply off the list (``mode="regenerate"``, and ``"continue"``,
        which keeps the reply's id; with ``replaces``, only when the last reply is the
        message of that id; the reply comes back in ``popped_json``). ``attachments``
        (``gateway.attachments`` dicts) are stored in the user message, as are
        ``tool_results`` (``[{"tool_call_id", "content"}]``: the message answers the
        last reply's tool calls; ``engine_messages``). With
        ``stream_ttl_s`` (> 0), the reply's stream gets its start entry (that TTL, in
        seconds) in the same step and ``chat`` carries the chat as the reply's prompt
        reads it (one round trip from the begin to the engine).

        With ``create`` (a chat not stored yet, id ``sid``, owner ``owner``: its system
        prompt, params and model are stored, its times set to the turn's), the chat is
        created in the same step, as ``create_session`` creates it, once every check has
        passed (a refused turn stores nothing). At the user's most chats, the index is
        pruned of expired chats and the turn tried once more (``create_session``'s rule).

        Raises:
            GatewayError: ``not_found``, ``busy`` (a reply is in progress),
                ``too_many_generations``, ``invalid_request`` (nothing to regenerate),
                ``conflict`` (the last reply is not ``replaces``, or no user message is;
                or the chat to create exists), ``not_found`` naming the message when
                ``replaces`` is no message of the chat at all (not in it, nor in a stored
                version), ``too_many_sessions`` (``create``).
        """
        now = time.time()
        rid = new_id()
        aid = replaces if mode == "continue" and replaces else new_id()
        uid_msg = new_id() if mode in ("chat", "edit") else ""
        user_json = ""
        if mode in ("chat", "edit"):
            user: dict[str, Any] = {"role": "user", "id": uid_msg, "content": content, "status": "complete",
                                    "created_at": now, "client_msg_id": client_msg_id}
            if attachments:
                user["attachments"] = attachments
            if tool_results:
                user["tool_results"] = tool_results
            user_json = dumps(user)
        named = content if content.strip() or not attachments else attachments[0]["name"]
        title = title_from(named, title_chars) if mode in ("chat", "edit") else ""
        created: list[Any] = []
        if create is not None:
            create.created_at = create.updated_at = now
            created = ["1", create.system_prompt, dumps(create.params), self.max_sessions, create.model]
        async with redis_errors():
            old_title = await self._first_title(sid, owner, title_chars) if mode == "edit" else ""
            keys = self.keys.script_keys(sid, owner)
            for attempt in range(2):
                res = await self._begin(
                    keys=keys + [self.keys.gen(rid)] if stream_ttl_s > 0 else keys,
                    args=[owner, sid, rid, mode, user_json, uid_msg, client_msg_id or "", aid, title, now,
                          int(now * 1000), self.lease_ms, self.max_generations, self.ttl, replaces or "",
                          old_title, str(stream_ttl_s) if stream_ttl_s > 0 else "", *created])
                if res[0] != "too_many_sessions" or attempt:
                    break
                await self._prune_index(owner)  # entries of expired chats do not count
        code = res[0]
        if code == "too_many_sessions":
            raise GatewayError("too_many_sessions", f"at most {self.max_sessions} chats per user; delete some")
        if code == "exists":
            raise GatewayError("conflict", "a chat with this id exists already; try again")
        if code == "duplicate":
            prev = json.loads(res[1])
            return TurnBegun(prev["request_id"], prev["message_id"], prev["user_message_id"], duplicate=True)
        if code == "not_found":
            raise not_found()
        if code == "busy":
            raise GatewayError("busy", "this chat already has a reply in progress")
        if code == "too_many_generations":
            raise GatewayError("too_many_generations",
                               f"at most {self.max_generations} replies in progress per user")
        if code == "conflict":
            raise GatewayError("conflict", "the chat changed in another tab or window: it is shown again "
                               "as it is now; try again")
        if code == "unknown":
            raise GatewayError("not_found", f"no message {replaces} in this chat")
        if code == "empty":
            raise GatewayError("invalid_request", "nothing to regenerate: the chat has no user message")
        chat = None
        if len(res) > 6:
            flat = res[7]
            chat = ([json.loads(m) for m in res[6]],
                    {flat[i]: json.loads(flat[i + 1]) for i in range(0, len(flat), 2)})
        return TurnBegun(rid, aid, res[1], user_json, res[2], res[3], res[4], edit_undo=res[5],
                         title_before=old_title if res[4] else "", chat=chat)

    async def _first_title(self, sid: str, owner: str, title_chars: int) -> str:
        """The title the chat's first message gives (``title_from``), or "" without one."""
        raw = await self.redis.lindex(self.keys.session_messages(sid), 0)
        first = json.loads(raw) if raw else None
        return title_from(first["content"], title_chars) if first and first.get("role") == "user" else ""

    async def finish_turn(self, owner: str, sid: str, turn: TurnBegun, assistant: dict[str, Any] | None,
                          user_tokens: dict[str, Any] | None, assistant_tokens: dict[str, Any] | None) -> str:
        """Store the reply (after its user message) with both token segments, clear the
        chat's active reply and release its lock, in one step.

        Returns:
            "ok"; "gone" (the chat was deleted meanwhile: nothing stored); "conflict"
            (the chat no longer ends with this turn's user message: nothing stored).
        """
        a_json = dumps({"role": "assistant", "id": turn.message_id, **assistant}) if assistant else ""
        async with redis_errors():
            status: str = await self._finish(
                keys=self.keys.script_keys(sid, owner),
                args=[sid, turn.request_id, a_json, turn.message_id, turn.user_message_id,
                      dumps(user_tokens) if user_tokens else "",
                      dumps(assistant_tokens) if assistant_tokens else "", time.time(), self.ttl])
        return status

    async def fail_turn(self, owner: str, sid: str, turn: TurnBegun, client_msg_id: str | None) -> None:
        """Undo a turn that produced nothing (the engine refused it): remove its user
        message (or put back the reply a regenerate dropped), take back the title it
        gave a new chat (unless renamed since) and release the lock."""
        popped_id = json.loads(turn.popped_json)["id"] if turn.popped_json else ""
        async with redis_errors():
            await self._fail(keys=self.keys.script_keys(sid, owner),
                             args=[turn.request_id, turn.user_json, client_msg_id or "", turn.popped_json,
                                   popped_id, turn.popped_tokens, self.ttl, turn.title, turn.edit_undo,
                                   turn.title_before])

    async def switch_version(self, owner: str, sid: str, message_id: str, index: int,
                             title_chars: int = 60) -> None:
        """Show version ``index`` (0-based) of the chat from the message ``message_id``
        on (a user message that was edited, or a reply that was regenerated); the branch
        shown until now is kept as a version. Switching the first message's versions
        retitles a chat whose title is still the one the shown text gave.

        Raises:
            GatewayError: ``not_found`` (no such chat, or ``message_id`` is no message of
                it at all, shown or kept as a version), ``busy`` (a reply is in progress),
                ``conflict`` (the message is only in a version not shown now),
                ``invalid_request`` (no such version).
        """
        k = self.keys.script_keys(sid, owner)
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=True)
            pipe.lindex(k[1], 0)
            pipe.hget(k[7], "^")
            first_raw, raw = await pipe.execute()
            titles = ["", ""]
            first = json.loads(first_raw) if first_raw else None
            if first and first.get("id") == message_id and raw:
                entries = json.loads(raw)
                if 0 <= index < len(entries) and not entries[index].get("cur") and entries[index].get("m"):
                    chosen = json.loads(entries[index]["m"][0])
                    titles = [title_from(first.get("content", ""), title_chars),
                              title_from(chosen.get("content", ""), title_chars)]
            res = await self._switch(keys=k, args=[owner, sid, message_id, index + 1, time.time(), self.ttl, *titles])
        if res == "not_found":
            raise not_found()
        if res == "busy":
            raise GatewayError("busy", "this chat has a reply in progress; stop it first")
        if res == "conflict":
            raise GatewayError("conflict", "the chat changed in another tab or window; try again")
        if res == "unknown":
            raise GatewayError("not_found", f"no message {message_id} in this chat")
        if res == "invalid":
            raise GatewayError("invalid_request", f"that message has no version {index + 1}")

    async def renew_lease(self, owner: str, sid: str, request_id: str) -> bool:
        """Extend the chat lock and generation slot of a reply in progress; False when
        the lock is no longer this reply's."""
        async with redis_errors():
            res = await self._lease(keys=self.keys.script_keys(sid, owner),
                                    args=[request_id, self.lease_ms, int(time.time() * 1000)])
        return bool(res)

    async def counted_session(self, owner: str, sid: str, limit_per_minute: int) -> SessionInfo:
        """``count_message`` and ``get_session`` in one round trip (the start of a turn on
        an existing chat).

        Raises:
            GatewayError: ``rate_limited`` (first), then ``not_found``.
        """
        key = self.keys.user_rate(owner, int(time.time() // 60))
        k = self.keys.script_keys(sid, owner)
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=True)
            pipe.incr(key)
            pipe.expire(key, 120)
            pipe.hgetall(k[0])
            pipe.get(k[5])
            n, _, data, lock = await pipe.execute()
        if n > limit_per_minute:
            raise GatewayError("rate_limited", f"at most {limit_per_minute} messages per minute; wait a little")
        if not data or data.get("owner") != owner:
            raise not_found()
        return self._info(data, lock)

    async def count_message(self, owner: str, limit_per_minute: int, read: str | None = None) -> str | None:
        """Count one chat/regenerate frame of ``owner`` in the current clock minute; with
        ``read`` (a full key name), also ``GET`` that string key in the same round trip
        (the user's defaults at the start of a turn that creates its chat) and return it
        (None when missing or not asked).

        Raises:
            GatewayError: ``rate_limited`` above ``limit_per_minute``.
        """
        key = self.keys.user_rate(owner, int(time.time() // 60))
        async with redis_errors():
            pipe = self.redis.pipeline(transaction=True)
            pipe.incr(key)
            pipe.expire(key, 120)
            if read is not None:
                pipe.get(read)
            n, _, *value = await pipe.execute()
        if n > limit_per_minute:
            raise GatewayError("rate_limited", f"at most {limit_per_minute} messages per minute; wait a little")
        return value[0] if value else None
