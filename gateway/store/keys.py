"""Every Redis key and pub/sub channel the gateway uses, in one table, under one prefix.

Layout (every name under the configured key prefix):

    chat:user:{uid}:sessions          sorted set  sid -> updated_at (newest first on read)
    chat:user:{uid}:sessions:events   channel     the user's chat events (live tabs)
    chat:user:{uid}:gens              sorted set  request id -> lease expiry (ms): replies in progress
    chat:user:{uid}:rate:{minute}     counter     chat/regenerate frames in that clock minute
    chat:user:{uid}:defaults          string      the user's defaults for new chats (JSON)
    chat:user:{uid}:tokens            hash        access token id -> its public info (JSON)
    chat:user:{uid}:imports           hash        import source -> the chat imported from it
    chat:user:{uid}:shares            hash        the user's share links (share id -> link JSON)
    chat:share:{id}                   string      a share link's read-only snapshot of a chat (JSON)
    chat:token:{sha256 hex}           hash        an access token's uid, id, name, created_at
    chat:session:{sid}                hash        owner, title, system_prompt, params, model, times, active
    chat:session:{sid}:messages       list        message JSON, appended only (RPUSH)
    chat:session:{sid}:tokens         hash        message id -> token-id segment {"ids", "base"}
    chat:session:{sid}:cmids          hash        client_msg_id -> turn (idempotent resend)
    chat:session:{sid}:lock           string      request id holding the chat (SET NX PX lease)
    chat:session:{sid}:versions       hash        anchor message id -> the chat's versions after it
    chat:gen:{rid}                    stream      the reply's deltas and its end (reply streams; rid
                                                  conv-{hash}: a resumable API stream's SSE events)
    chat:route:{key}                  string      the engine a shed chat was moved to
    chat:cancel                       channel     cancels, to the replica running the reply
    chat:revocations                  channel     revoked tokens and deleted users, to every replica

The store scripts (``gateway.store.scripts``) take a chat's keys as ``script_keys`` and
name the events channel as ``KEYS[5] .. ':events'`` (``user_events``).
"""

from __future__ import annotations


class Keys:
    """Redis key names under one prefix (the table above)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    # ---- a user's -------------------------------------------------------------------

    def user_sessions(self, uid: str) -> str:
        """Sorted set of the user's chat ids by update time."""
        return f"{self.prefix}chat:user:{uid}:sessions"

    def user_events(self, uid: str) -> str:
        """Pub/sub channel of the user's chat events (``gateway.store.live_events``); the store scripts
        publish on it (``KEYS[5] .. ':events'``)."""
        return self.user_sessions(uid) + ":events"

    def user_gens(self, uid: str) -> str:
        """Sorted set of the user's replies in progress by lease expiry (ms)."""
        return f"{self.prefix}chat:user:{uid}:gens"

    def user_rate(self, uid: str, minute: int) -> str:
        """Counter of the user's chat/regenerate frames in clock minute ``minute``."""
        return f"{self.prefix}chat:user:{uid}:rate:{minute}"

    def user_defaults(self, uid: str) -> str:
        """The user's defaults for new chats (JSON string)."""
        return f"{self.prefix}chat:user:{uid}:defaults"

    def user_tokens(self, uid: str) -> str:
        """Hash of the user's access tokens: token id -> public info (JSON)."""
        return f"{self.prefix}chat:user:{uid}:tokens"

    def user_imports(self, uid: str) -> str:
        """Hash of the user's imported chats: source -> chat id (an import done twice is one chat)."""
        return f"{self.prefix}chat:user:{uid}:imports"

    def user_shares(self, uid: str) -> str:
        """Hash of the user's share links (``gateway.api.shares``)."""
        return f"{self.prefix}chat:user:{uid}:shares"

    def share(self, share_id: str) -> str:
        """A share link's snapshot (``share("")`` is the prefix the ids follow)."""
        return f"{self.prefix}chat:share:{share_id}"

    def token(self, digest: str) -> str:
        """Hash of one access token, by the SHA-256 hex digest of the token."""
        return f"{self.prefix}chat:token:{digest}"

    # ---- a chat's -------------------------------------------------------------------

    def session(self, sid: str) -> str:
        """The chat's metadata hash."""
        return f"{self.prefix}chat:session:{sid}"

    def session_messages(self, sid: str) -> str:
        """List of the chat's message JSON, oldest first."""
        return self.session(sid) + ":messages"

    def session_tokens(self, sid: str) -> str:
        """Hash of the chat's token-id segments by message id."""
        return self.session(sid) + ":tokens"

    def session_cmids(self, sid: str) -> str:
        """Hash of the chat's client message ids -> the turn each started."""
        return self.session(sid) + ":cmids"

    def session_lock(self, sid: str) -> str:
        """The request id of the chat's reply in progress (a PX lease)."""
        return self.session(sid) + ":lock"

    def session_versions(self, sid: str) -> str:
        """Hash of the chat's versions by anchor message id."""
        return self.session(sid) + ":versions"

    def script_keys(self, sid: str, uid: str) -> list[str]:
        """The KEYS list every store script takes (see ``gateway.store.scripts``)."""
        return [self.session(sid), self.session_messages(sid), self.session_tokens(sid), self.session_cmids(sid),
                self.user_sessions(uid), self.session_lock(sid), self.user_gens(uid), self.session_versions(sid)]

    # ---- replies, routing, channels -------------------------------------------------

    def gen(self, rid: str) -> str:
        """The reply's Redis Stream."""
        return f"{self.prefix}chat:gen:{rid}"

    def route(self, key: str) -> str:
        """The engine url a shed chat was moved to (``gateway.engines.routing.Placements``)."""
        return f"{self.prefix}chat:route:{key}"

    def cancel_channel(self) -> str:
        """Pub/sub channel carrying cancels to the replica that runs the reply."""
        return f"{self.prefix}chat:cancel"

    def revocations_channel(self) -> str:
        """Pub/sub channel carrying revocations to every replica (``gateway.api.revocation``)."""
        return f"{self.prefix}chat:revocations"
