"""Per-user prefix-cache isolation end to end (docs/reliability.md, cache isolation): one
user's prompt never gives another user a cache hit past the prefix the operator declared
shared, in the browser socket and in the OpenAI API, while that shared prefix still hits
for everyone. A hit shows as ``cached_tokens``; with none, the first token costs what a
fresh prompt's does."""

from __future__ import annotations

import httpx

from gateway.engines.cache_scope import CacheIsolation
from tests.gateway_helpers import chat

SHARED = ("You are the help desk of the lighthouse museum of Example Point: answer visitors' questions "
          "about opening hours, tickets and the history of the light, in one or two short sentences. ") * 2
PRIVATE = "My salary is 734215 and my landlord Ada Lovelace raises the rent in May; can I afford a season pass?"
PRIVATE_API = "Between us: my bank PIN is 4471 and I keep the spare key under the blue flowerpot by the door."
OTHER = "Is the museum open on the first Monday of the month, and may dogs come in if they are small?"


async def _browser_turn(gw, cookie: str, system_prompt: str, content: str) -> int:
    """A new chat of ``cookie``'s user with that system prompt; the reply's cached tokens."""
    async with gw.http(cookie) as c:
        sid = (await c.post("/api/sessions", json={"system_prompt": system_prompt})).json()["id"]
    async with gw.connect(cookie) as ws:
        r = await chat(ws, content, sid, max_tokens=2)
    assert r.done is not None, r.error
    return int(r.done["usage"]["cached_tokens"])


def _api_turn(gw, cookie: str, system_prompt: str, content: str) -> int:
    """A stateless OpenAI request of ``cookie``'s user; its cached tokens."""
    body = {"messages": [{"role": "system", "content": system_prompt}, {"role": "user", "content": content}],
            "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, cookies={"chat_uid": cookie}, timeout=120)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_another_users_private_prompt_hits_only_the_declared_shared_prefix_in_both_apis(gateway_factory):
    gw = gateway_factory(shared_prompts=(SHARED,))
    a, b, c = gw.new_cookie(), gw.new_cookie(), gw.new_cookie()
    # browser socket: A's private message, then B sends the very same chat
    assert await _browser_turn(gw, a, SHARED, PRIVATE) >= 0
    own = await _browser_turn(gw, a, SHARED, PRIVATE)
    shared_hit = await _browser_turn(gw, c, SHARED, OTHER)  # the same shared prompt, nothing else alike
    other_user = await _browser_turn(gw, b, SHARED, PRIVATE)
    assert shared_hit > 0, "a declared shared system prompt must hit across users"
    assert other_user == shared_hit, "B's hit on A's prompt went past the declared shared part"
    assert own > shared_hit + 16, "A's own repeat must hit its private pages"
    # the OpenAI API: the same for stateless requests, by each request's (cookie) user
    assert _api_turn(gw, a, SHARED, PRIVATE_API) >= 0
    assert _api_turn(gw, a, SHARED, PRIVATE_API) > shared_hit + 16
    assert _api_turn(gw, b, SHARED, PRIVATE_API) == shared_hit
    # a system prompt nobody declared shared: nothing of A's hits for B
    private_system = "You are Ada's personal assistant; she lives at 12 Harbour Road. " * 3
    assert _api_turn(gw, a, private_system, OTHER) >= 0
    assert _api_turn(gw, b, private_system, OTHER) == 0
    assert await _browser_turn(gw, c, private_system, OTHER) == 0


def test_cache_salts_are_per_user_stable_and_secret_bound():
    iso = CacheIsolation.of("secret-1", ["shared"])
    assert iso.salt("u1") == CacheIsolation.of("secret-1", []).salt("u1")  # every replica, every restart
    assert iso.salt("u1") != iso.salt("u2")
    assert CacheIsolation.of("secret-2", []).salt("u1") != iso.salt("u1")  # unguessable without the secret
    assert len(iso.salt("u1")) == 32 and "u1" not in iso.salt("u1")
    chat = [{"role": "system", "content": "shared"}, {"role": "user", "content": "shared"},
            {"role": "user", "content": "mine"}, {"role": "user", "content": "shared"}]
    assert iso.shared_messages(chat) == chat[:2]  # the leading declared messages only
    assert iso.shared_messages(chat[2:]) == []
    assert CacheIsolation.of("s", [""]).shared_messages([{"role": "system", "content": ""}]) == []
