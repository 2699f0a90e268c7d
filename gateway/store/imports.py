"""Storing imported chats and reading whole chats (every version) for export
(docs/protocol.md, "Import and export"; the formats: ``gateway/chat_import.py``).

An imported chat is written in one script with the keys of ``gateway/store/scripts.py``
(its messages list, its ``:versions`` hash) plus the user's import index
``chat:user:{uid}:imports`` (hash: source -> chat id), so a chat imported twice is
stored once: the second import finds its source there (while that chat exists) and
adds nothing. Imported messages carry no token ids; their first turn is tokenized
whole by the engine and later turns reuse it as usual.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis.asyncio as aioredis

from gateway.chat_import import ImportedChat
from gateway.errors import GatewayError
from gateway.store.keys import Keys
from gateway.store.sessions import SessionInfo, SessionStore, dumps, new_id, redis_errors

# KEYS: the store scripts' eight, then [9] the user's import index.
# ARGV: owner, sid, title, system_prompt, params, created_at, updated_at, max_sessions, ttl,
#       source, n_messages, message JSON x n, then (anchor, versions JSON) pairs.
IMPORT = r"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 'exists' end
if ARGV[10] ~= '' and redis.call('HEXISTS', KEYS[9], ARGV[10]) == 1 then return 'duplicate' end
if redis.call('ZCARD', KEYS[5]) >= tonumber(ARGV[8]) then return 'too_many_sessions' end
redis.call('HSET', KEYS[1], 'id', ARGV[2], 'owner', ARGV[1], 'title', ARGV[3], 'system_prompt', ARGV[4],
           'params', ARGV[5], 'created_at', ARGV[6], 'updated_at', ARGV[7], 'active', '')
local n = tonumber(ARGV[11])
for i = 1, n do redis.call('RPUSH', KEYS[2], ARGV[11 + i]) end
local i = 12 + n
while i < #ARGV do
  redis.call('HSET', KEYS[8], ARGV[i], ARGV[i + 1])
  i = i + 2
end
redis.call('ZADD', KEYS[5], ARGV[7], ARGV[2])
if ARGV[10] ~= '' then redis.call('HSET', KEYS[9], ARGV[10], ARGV[2]) end
local ttl = tonumber(ARGV[9])
if ttl > 0 then
  for k = 1, 5 do if redis.call('EXISTS', KEYS[k]) == 1 then redis.call('EXPIRE', KEYS[k], ttl) end end
  if redis.call('EXISTS', KEYS[8]) == 1 then redis.call('EXPIRE', KEYS[8], ttl) end
end
redis.call('PUBLISH', KEYS[5] .. ':events', cjson.encode({kind = 'created', session_id = ARGV[2], request_id = ''}))
return 'ok'
"""


def _stored(m: dict[str, Any]) -> str:
    """A message as the store keeps it: ``role`` first, ``id`` second, compact."""
    return dumps({"role": m["role"], "id": m["id"], **{k: v for k, v in m.items() if k not in ("role", "id")}})


class ChatTransfer:
    """Imports chats into a user's store and reads chats whole for export.

    Raises (every async method): ``GatewayError`` ``store_unavailable`` when Redis is down.
    """

    def __init__(self, redis: aioredis.Redis, store: SessionStore, keys: Keys, ttl_s: int | None,
                 max_sessions: int) -> None:
        self.redis = redis
        self.store = store
        self.keys = keys
        self.ttl = int(ttl_s or 0)
        self.max_sessions = max_sessions
        self._import = redis.register_script(IMPORT)

    def index_key(self, uid: str) -> str:
        """The user's import index (source -> chat id)."""
        return self.keys.user_imports(uid)

    async def _already_here(self, uid: str, source: str) -> bool:
        """Whether ``source`` names a chat this user has now (an index entry of a chat
        deleted since is dropped, so it can be imported again)."""
        key = self.index_key(uid)
        sid: str | None = await self.redis.hget(key, source)  # type: ignore[assignment]
        if sid is not None:
            if await self.redis.hget(self.keys.session(sid), "owner") == uid:
                return True
            await self.redis.hdel(key, source)
        if source.startswith("chatserve:"):  # our own export of a chat this user still has
            own = source.split(":", 1)[1]
            return bool(own) and await self.redis.hget(self.keys.session(own), "owner") == uid
        return False

    async def import_chat(self, uid: str, chat: ImportedChat) -> str | None:
        """Store ``chat`` for ``uid``; returns its new id, or None when it is there already.

        Raises:
            GatewayError: ``too_many_sessions`` at the user's limit of chats.
        """
        async with redis_errors():
            if await self._already_here(uid, chat.source):
                return None
            sid = new_id()
            versions: list[str] = []
            for anchor, entries in chat.versions.items():
                raw = [{"cur": True} if e.get("current") else {"m": [_stored(m) for m in e["messages"]], "t": {}}
                       for e in entries]
                versions += [anchor, json.dumps(raw, separators=(",", ":"), ensure_ascii=False)]
            res = await self._import(
                keys=[*self.keys.script_keys(sid, uid), self.index_key(uid)],
                args=[uid, sid, chat.title, chat.system_prompt, dumps(chat.params), chat.created_at,
                      chat.updated_at or chat.created_at or time.time(), self.max_sessions, self.ttl, chat.source,
                      len(chat.messages), *[_stored(m) for m in chat.messages], *versions])
        if res == "duplicate":
            return None
        if res == "too_many_sessions":
            raise GatewayError("too_many_sessions", f"at most {self.max_sessions} chats per user; delete some")
        if res != "ok":
            raise GatewayError("internal_error", f"import failed: {res}")
        return sid

    async def versions(self, uid: str, sid: str) -> dict[str, list[dict[str, Any]]]:
        """The chat's versions as exported: anchor -> ``[{"messages": [stored message
        dicts]} | {"current": True}]`` (token ids left out)."""
        async with redis_errors():
            raw: dict[str, str] = await self.redis.hgetall(self.keys.session_versions(sid))  # type: ignore[assignment]
        out: dict[str, list[dict[str, Any]]] = {}
        for anchor, entries in raw.items():
            out[anchor] = [{"current": True} if e.get("cur") else {"messages": [json.loads(m) for m in e.get("m", [])]}
                           for e in json.loads(entries)]
        return out

    async def whole_chat(self, uid: str, sid: str) -> tuple[SessionInfo, list[dict[str, Any]],
                                                           dict[str, list[dict[str, Any]]]]:
        """A chat's metadata, shown messages and every version (for export)."""
        info = await self.store.get_session(uid, sid)
        messages = await self.store.messages(uid, sid)
        return info, messages, await self.versions(uid, sid)
