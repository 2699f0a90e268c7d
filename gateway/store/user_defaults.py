"""Each user's defaults for new chats: a system prompt and sampling parameters, kept in
one place (``GET/PUT /api/defaults``) and copied into every chat the user creates (from
the page, the terminal client or the OpenAI API's ``session_id: "new"``) that does not
name its own. Unset fields fall back to the gateway's ``Defaults``.

Layout: ``chat:user:{uid}:defaults`` (under the key prefix), a string holding
``{"system_prompt": str, "params": {...}}`` (either may be missing).
"""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis

from gateway.store.keys import Keys
from gateway.store.sessions import dumps, redis_errors


class UserDefaultsStore:
    """Reads and writes users' defaults for new chats.

    Raises (every async method):
        GatewayError: ``store_unavailable`` when Redis cannot be reached.
    """

    def __init__(self, redis: aioredis.Redis, prefix: str = "") -> None:
        self.redis = redis
        self._key = Keys(prefix).user_defaults

    def key(self, uid: str) -> str:
        """The Redis key (a string) holding ``uid``'s defaults (read by ``parse``)."""
        return self._key(uid)

    @staticmethod
    def parse(raw: str | bytes | None) -> dict[str, Any]:
        """The defaults stored as ``raw`` (the key's value; None when missing):
        ``{"system_prompt"?: str, "params"?: dict}`` ({} when none or unreadable)."""
        if not raw:
            return {}
        try:
            d = json.loads(raw)
        except ValueError:
            return {}
        return d if isinstance(d, dict) else {}

    async def get(self, uid: str) -> dict[str, Any]:
        """The user's stored defaults: ``{"system_prompt"?: str, "params"?: dict}`` ({} when none)."""
        async with redis_errors():
            raw = await self.redis.get(self._key(uid))
        return self.parse(raw)

    async def put(self, uid: str, defaults: dict[str, Any]) -> None:
        """Replace the user's defaults (already validated by the caller)."""
        async with redis_errors():
            await self.redis.set(self._key(uid), dumps(defaults))

    async def delete(self, uid: str) -> None:
        """Forget the user's defaults.

        Raises:
            GatewayError: ``store_unavailable`` when Redis cannot be reached.
        """
        async with redis_errors():
            await self.redis.delete(self._key(uid))

    async def for_new_chat(self, uid: str, system_prompt: str) -> tuple[str, dict[str, Any]]:
        """The system prompt and params a new chat of ``uid`` starts with: the user's
        own, else ``system_prompt`` (the gateway's default) and no params."""
        return self.new_chat_fields(await self.get(uid), system_prompt)

    @staticmethod
    def new_chat_fields(d: dict[str, Any], system_prompt: str) -> tuple[str, dict[str, Any]]:
        """``for_new_chat`` from the defaults ``d`` already read (``parse``)."""
        sp = d.get("system_prompt")
        params = d.get("params")
        return (sp if isinstance(sp, str) else system_prompt), (dict(params) if isinstance(params, dict) else {})
