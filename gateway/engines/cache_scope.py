"""Per-user prefix-cache isolation: which part of a prompt's KV a request may share.

The engines' prefix cache serves any prompt that starts with pages another request
computed, and the cache hit shows (``cached_tokens`` in every usage, and a faster first
token). Without isolation, any user could confirm another user's text one page at a
time. So every request the gateway sends carries a **cache salt** derived from its
user's id:

    salt = HMAC-SHA256(gateway secret, "cache-salt" || 0x00 || user id), 32 hex characters

The secret is the one that signs the user cookie (``SECRET_KEY``, or ``DATA_DIR/secret_key``),
which every replica of a deployment shares, so a user's salt is the same on every
gateway and after restarts (their cache keeps hitting), and nobody without the secret can
compute another user's salt. The engine keeps a salted request's pages below a salt node
of its radix tree (``engine/radix_cache.py``), where no other salt finds them, and names
them by hashes seeded with the salt (``engine/block_hash.py``), so neither the KV events
nor the gateways' prefix index ever holds a page name one user's prompt shares with
another's.

What stays shared, on purpose: the **leading messages the operator declared shared**
(``shared_messages``): the gateway's default system prompt (``Defaults.system_prompt``)
and the prompts listed in ``SHARED_PROMPTS_FILE`` (``GatewayConfig.shared_prompts``), when
a chat starts with them, plus the chat template's own text around them (e.g. a model's
built-in default system prompt). The engine shares exactly the whole pages of the prompt
that render those messages and nothing past them (``PromptBuilder.shared_length``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["CacheIsolation"]


@dataclass(frozen=True)
class CacheIsolation:
    """The cache salts of users and the messages declared shared.

    Args:
        secret: the gateway secret (``GatewayConfig.resolve_secret``).
        shared_texts: message contents declared shared (the default system prompt and the
            configured shared prompts).
    """

    secret: str
    shared_texts: frozenset[str]

    @classmethod
    def of(cls, secret: str, shared_texts: Iterable[str]) -> CacheIsolation:
        """Build one; empty texts are never shared."""
        return cls(secret, frozenset(t for t in shared_texts if t))

    def salt(self, uid: str) -> str:
        """User ``uid``'s cache salt: 32 hex characters of HMAC-SHA256 under the secret."""
        return hmac.new(self.secret.encode(), b"cache-salt\0" + uid.encode(), hashlib.sha256).hexdigest()[:32]

    def shared_messages(self, messages: Iterable[dict[str, str]]) -> list[dict[str, str]]:
        """The leading messages of a chat whose text is declared shared (in order, up to
        the first one that is not), as ``{"role", "content"}``."""
        out: list[dict[str, str]] = []
        for m in messages:
            if m.get("content") not in self.shared_texts:
                break
            out.append({"role": m["role"], "content": m["content"]})
        return out
