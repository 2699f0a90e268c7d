"""The running turn: what was asked (``TurnRequest``, fixed when the turn begins) and the
reply's state while it runs (``Turn``: its writer, reasoning clock, cancellation, the
engine's token ids, the engine run and the task)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from gateway.engines.run import EngineRun
from gateway.replies.reasoning_clock import ReasoningClock
from gateway.replies.writer import ReplyWriter
from gateway.store.sessions import TurnBegun

# why a reply was cut short, stored with it as ``cut_reason`` (status "partial"): the
# user's Stop (or a delete of the chat), the gateway shutting down, the engine going away
# (or shutting down) mid-reply, an OpenAI-compatible upstream's own error after some text
# (a rate limit: its code and message are the stored ``error``), or another failure after
# some text was shown
CUT_REASONS = ("user_stop", "gateway_shutdown", "engine_lost", "upstream_error", "error")


@dataclass
class StartedTurn:
    """A reply that began (or, with ``duplicate``, was begun earlier by the same
    ``client_msg_id``): subscribe to ``request_id`` from seq 0."""

    request_id: str
    session_id: str
    message_id: str
    user_message_id: str
    duplicate: bool = False


@dataclass(frozen=True)
class Continued:
    """The reply a "continue" turn extends: its stored message and its token ids."""

    message: dict[str, Any]
    ids: list[int]
    segment: dict[str, Any] = field(default_factory=dict)  # its stored token segment


@dataclass(frozen=True)
class TurnRequest:
    """What a turn was asked to do.

    Attributes:
        owner, session_id: the chat. ``begun``: what ``begin_turn`` reserved.
        params: the merged sampling parameters. ``system_prompt``: the chat's.
        client_msg_id: the browser's id of the user message (undone with a refused turn).
        clamp_max_tokens: the engine may lower ``max_tokens`` to the context left.
        created_chat: the chat was created for this turn (undone with it).
        continued: the reply a "continue" turn extends, else None.
        model: the chat's model: only its engines write the reply (None: any engine).
        tools: the engine's ``generate`` tool fields for this turn (``tools``,
            ``tool_choice``, ``parallel_tool_calls``; docs/protocol.md, tool calls), or empty.
        budget: a continued reply's token budget, ``(max_tokens, tokens the reply had
            when that budget began)``, stored with its token ids (``continue_budget``);
            None for a new reply, whose budget is ``params["max_tokens"]`` from 0.
    """

    owner: str
    session_id: str
    begun: TurnBegun
    params: dict[str, Any]
    system_prompt: str
    client_msg_id: str | None
    clamp_max_tokens: bool = True
    created_chat: bool = False
    continued: Continued | None = None
    model: str | None = None
    tools: dict[str, Any] = field(default_factory=dict)
    budget: tuple[int, int] | None = None

    @property
    def rid(self) -> str:
        """The reply's request id."""
        return self.begun.request_id


@dataclass
class Cancellation:
    """A Stop (or shutdown) of a running reply.

    Attributes:
        requested: a cancel came. ``reason``: the stored ``cut_reason`` (``CUT_REASONS``).
        deadline: monotonic time (s) after which the reply ends without the engine's word.
        synthetic_end: it did end that way (no engine confirmation in time).
    """

    requested: bool = False
    reason: str | None = None
    deadline: float | None = None
    synthetic_end: bool = False


@dataclass
class Turn:
    """A reply running on this gateway."""

    request: TurnRequest
    writer: ReplyWriter
    reasoning: ReasoningClock
    cancel: Cancellation = field(default_factory=Cancellation)
    output_ids: list[int] = field(default_factory=list)  # the engine's sampled ids so far
    run: EngineRun | None = None
    task: asyncio.Task[None] | None = None

    @property
    def produced(self) -> bool:
        """True once the engine produced any text or token (shown or not); the text a
        continued reply already had does not count."""
        return self.writer.added or bool(self.output_ids)
