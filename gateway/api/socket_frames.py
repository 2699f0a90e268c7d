"""Browser frames (docs/protocol.md section 2): parsing and validation of what the
client sends, and builders for what the server sends.

A frame that does not validate raises ``ProtocolError`` (code ``bad_frame``); the
socket answers with an error frame and stays open.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypedDict, TypeGuard, cast

from engine.text_checks import text_error
from gateway.api import api_to_engine as a2e
from gateway.api.validation import BadJson, loads_json, printable
from gateway.attachments import ATTACHMENT_LIMITS, parse_attachments
from gateway.errors import GatewayError

_ID_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_CLIENT_MSG_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")

MAX_MODEL_CHARS = 256  # a model name (a served name, or a path an upstream names its model by)
MAX_TOOL_RESULTS = 64  # results in one chat frame (one per call of the reply they answer)
MAX_TOOL_CALL_ID_CHARS = 128


class ProtocolError(GatewayError):
    """A client frame that is not JSON, has an unknown type, or a missing/ill-typed field
    (code ``bad_frame``), or a text field that is not valid Unicode (``invalid_request``).

    Attributes:
        request_id, session_id: echoed in the error frame when the bad frame named them.
    """

    def __init__(self, message: str, request_id: str | None = None, session_id: str | None = None,
                 code: str = "bad_frame") -> None:
        super().__init__(code, message)
        self.request_id = request_id
        self.session_id = session_id


@dataclass(frozen=True)
class ChatFrame:
    """``chat``: a user message; no ``session_id`` starts a new chat. ``model`` (when
    given) is the model the chat's replies come from from now on. ``tools``: the
    engine's ``generate`` tool fields for this turn (``tools``, ``tool_choice``,
    ``parallel_tool_calls``; empty for none). ``tool_results``: the message answers the
    last reply's tool calls (``[{"tool_call_id", "content"}]``) instead of saying something."""

    content: str
    session_id: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    client_msg_id: str | None = None
    model: str | None = None
    attachments: list[dict[str, Any]] = field(default_factory=list)
    tools: dict[str, Any] = field(default_factory=dict)
    tool_results: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class CancelFrame:
    """``cancel``: stop the reply ``request_id``."""

    request_id: str


@dataclass(frozen=True)
class RegenerateFrame:
    """``regenerate``: replace the chat's last assistant reply; ``message_id`` (when
    given) names the reply the client shows, and the server refuses (``conflict``) when
    the chat's last reply is another one."""

    session_id: str
    params: dict[str, Any] = field(default_factory=dict)
    message_id: str | None = None
    tools: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EditFrame:
    """``edit``: replace the user message ``message_id`` and everything after it with
    ``content`` and reply to it; the old branch is kept as a version."""

    session_id: str
    message_id: str
    content: str
    params: dict[str, Any] = field(default_factory=dict)
    client_msg_id: str | None = None
    attachments: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ContinueFrame:
    """``continue``: extend the chat's last reply ``message_id``, cut at max_tokens."""

    session_id: str
    message_id: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResumeFrame:
    """``resume``: (re)attach to a reply; deltas with ``seq > last_seq`` follow."""

    request_id: str
    last_seq: int = 0


@dataclass(frozen=True)
class EventsFrame:
    """``events``: start (``on`` true) or stop sending this socket ``event`` frames about
    changes to the user's chats (live tabs). Off by default, so clients that read replies
    frame by frame see no other frames."""

    on: bool = True


@dataclass(frozen=True)
class PingFrame:
    """``ping``: answered by ``pong``."""


ClientFrame = (ChatFrame | CancelFrame | RegenerateFrame | ResumeFrame | PingFrame | EditFrame | ContinueFrame
               | EventsFrame)


def is_valid_id(value: Any) -> TypeGuard[str]:
    """True for a session/request id: 1-64 characters of ``[A-Za-z0-9_-]``."""
    return isinstance(value, str) and bool(_ID_RE.match(value))


def _id(obj: dict[str, Any], key: str, *, required: bool, ctx: dict[str, Any]) -> str | None:
    value = obj.get(key)
    if value is None and not required:
        return None
    if not is_valid_id(value):
        raise ProtocolError(f"'{key}' must be an id string of 1-64 characters [A-Za-z0-9_-]", **ctx)
    return value


def _params(obj: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    params = obj.get("params")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError("'params' must be an object", **ctx)
    return params


def _tools(obj: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """A frame's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (OpenAI's
    chat-completions shapes) as the engine's ``generate`` fields, checked by the engine's
    own rules; ``{}`` without tools.

    Raises:
        ProtocolError: ``invalid_request`` naming the field and the engine's reason.
    """
    tools, choice = obj.get("tools"), obj.get("tool_choice")
    try:
        if not tools and choice not in (None, "none", "auto"):
            raise a2e.FieldError("tool_choice", "tool_choice needs tools")
        return a2e.tool_fields(tools, choice, obj.get("parallel_tool_calls")) if tools else {}
    except a2e.FieldError as e:
        raise ProtocolError(e.message, code="invalid_request", **ctx) from None


def _tool_results(obj: dict[str, Any], ctx: dict[str, Any]) -> list[dict[str, str]]:
    """A ``chat`` frame's ``tool_results``: 1-``MAX_TOOL_RESULTS`` of ``{"tool_call_id",
    "content"}``, ids of 1-``MAX_TOOL_CALL_ID_CHARS`` characters; ``[]`` when absent.

    Raises:
        ProtocolError: ``bad_frame`` for a bad shape, ``invalid_request`` for text that
            is not valid Unicode.
    """
    raw = obj.get("tool_results")
    if raw is None:
        return []
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_TOOL_RESULTS:
        raise ProtocolError(f"'tool_results' must be a list of 1-{MAX_TOOL_RESULTS} results", **ctx)
    out = []
    for i, r in enumerate(raw):
        call_id, content = (r.get("tool_call_id"), r.get("content")) if isinstance(r, dict) else (None, None)
        if not (isinstance(call_id, str) and 0 < len(call_id) <= MAX_TOOL_CALL_ID_CHARS and isinstance(content, str)):
            raise ProtocolError(f"tool_results[{i}] must be {{\"tool_call_id\": an id of 1-{MAX_TOOL_CALL_ID_CHARS} "
                                "characters, \"content\": a string}", **ctx)
        for text, where in ((call_id, "tool_call_id"), (content, "content")):
            bad_text = text_error(text, f"tool_results[{i}].{where}")
            if bad_text is not None:
                raise ProtocolError(bad_text, code="invalid_request", **ctx)
        out.append({"tool_call_id": call_id, "content": content})
    return out


def _context(obj: dict[str, Any]) -> dict[str, Any]:
    """The ids worth echoing in an error about this frame (only well-formed ones)."""
    ctx: dict[str, Any] = {}
    for key in ("request_id", "session_id"):
        if is_valid_id(obj.get(key)):
            ctx[key] = obj[key]
    return ctx


def decode_json(text: str) -> Any:
    """``json.loads`` (with the nesting limit of ``gateway.api.validation``) that reports
    failure as a ``ProtocolError``.

    Raises:
        ProtocolError: the text is not JSON or nests too deeply.
    """
    try:
        return loads_json(text)
    except BadJson as e:
        raise ProtocolError(f"frame is {e}" if "nests" not in str(e) else f"frame {e}") from None


def parse_client_frame(obj: Any) -> ClientFrame:
    """Validate a decoded JSON frame into one of the ``ClientFrame`` dataclasses.

    Unknown extra fields are ignored (so clients may add their own).

    Raises:
        ProtocolError: not an object, unknown ``type``, or a missing/ill-typed field.
    """
    if not isinstance(obj, dict):
        raise ProtocolError("frame must be a JSON object")
    ctx = _context(obj)
    kind = obj.get("type")
    if kind == "ping":
        return PingFrame()
    if kind == "events":
        on = obj.get("on", True)
        if not isinstance(on, bool):
            raise ProtocolError("'on' must be a boolean", **ctx)
        return EventsFrame(on=on)
    if kind in ("chat", "edit"):
        content = obj.get("content")
        try:  # checked here, so a bad file never reaches the store or the engine
            files = [a.to_json() for a in parse_attachments(obj.get("attachments"), ATTACHMENT_LIMITS)]
        except GatewayError as e:
            raise ProtocolError(e.message, code="invalid_request", **ctx) from None
        results = _tool_results(obj, ctx) if kind == "chat" else []
        if not isinstance(content, str) or not (content.strip() or files or results):
            raise ProtocolError("'content' must be a non-empty string (it may be empty with attachments or "
                                "tool_results)", **ctx)
        bad_text = text_error(content, "content")
        if bad_text is not None:
            raise ProtocolError(bad_text, code="invalid_request", **ctx)
        cmid = obj.get("client_msg_id")
        if cmid is not None and not (isinstance(cmid, str) and _CLIENT_MSG_ID_RE.match(cmid)):
            raise ProtocolError("'client_msg_id' must be 1-128 characters [A-Za-z0-9_.:-]", **ctx)
        if kind == "edit":
            return EditFrame(session_id=_id(obj, "session_id", required=True, ctx=ctx),  # type: ignore[arg-type]
                             message_id=_id(obj, "message_id", required=True, ctx=ctx),  # type: ignore[arg-type]
                             content=content, params=_params(obj, ctx), client_msg_id=cmid, attachments=files)
        model = obj.get("model")
        if model is not None and not (isinstance(model, str) and 0 < len(model) <= MAX_MODEL_CHARS):
            raise ProtocolError(f"'model' must be a model name of 1-{MAX_MODEL_CHARS} characters", **ctx)
        return ChatFrame(
            content=content,
            session_id=_id(obj, "session_id", required=False, ctx=ctx),
            params=_params(obj, ctx),
            client_msg_id=cmid,
            model=model,
            attachments=files,
            tools=_tools(obj, ctx),
            tool_results=results,
        )
    if kind == "cancel":
        return CancelFrame(request_id=_id(obj, "request_id", required=True, ctx=ctx))  # type: ignore[arg-type]
    if kind == "regenerate":
        sid = _id(obj, "session_id", required=True, ctx=ctx)
        mid = _id(obj, "message_id", required=False, ctx=ctx)
        return RegenerateFrame(session_id=sid, params=_params(obj, ctx), message_id=mid,  # type: ignore[arg-type]
                               tools=_tools(obj, ctx))
    if kind == "continue":
        return ContinueFrame(session_id=_id(obj, "session_id", required=True, ctx=ctx),  # type: ignore[arg-type]
                             message_id=_id(obj, "message_id", required=True, ctx=ctx),  # type: ignore[arg-type]
                             params=_params(obj, ctx))
    if kind == "resume":
        rid = _id(obj, "request_id", required=True, ctx=ctx)
        last_seq = obj.get("last_seq", 0)
        if not isinstance(last_seq, int) or isinstance(last_seq, bool) or last_seq < 0:
            raise ProtocolError("'last_seq' must be an integer >= 0", **ctx)
        return ResumeFrame(request_id=rid, last_seq=last_seq)  # type: ignore[arg-type]
    if not isinstance(kind, str):
        raise ProtocolError("frame needs a string 'type'", **ctx)
    raise ProtocolError(f"unknown frame type {kind[:40]!r}", **ctx)


# ---- server -> client ------------------------------------------------------
#
# Every frame the server sends has a type here; they are dicts at run time (no copy,
# one ``json.dumps`` each), typed for the checker. Fields as in docs/protocol.md section 2.


class StartOut(TypedDict):
    """``start``: a reply this socket follows begins (or is re-attached)."""

    type: Literal["start"]
    request_id: str
    session_id: str | None
    message_id: str | None
    user_message_id: str | None


class DeltaOut(TypedDict):
    """``delta``: the reply's text from delta ``seq`` (1, 2, ... without gaps)."""

    type: Literal["delta"]
    request_id: str
    seq: int
    text: str


class ProgressOut(TypedDict):
    """``progress``: how far a long prompt is read (tokens)."""

    type: Literal["progress"]
    request_id: str
    session_id: str | None
    prompt_tokens_done: int
    prompt_tokens: int
    cached_tokens: int


class _DoneHead(TypedDict):
    type: Literal["done"]
    request_id: str


class DoneOut(_DoneHead, total=False):
    """``done``: the reply ended and is stored (its fields are the reply stream's ``done``
    entry: ``gateway.replies.reply_end.ReplyEnd.done_entry``)."""

    session_id: str
    message_id: str
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, Any] | None
    error: dict[str, Any]
    title: str
    reasoning_ms: int
    tool_calls: list[dict[str, Any]]


class _ErrorHead(TypedDict):
    type: Literal["error"]
    code: str
    message: str


class ErrorOut(_ErrorHead, total=False):
    """``error``: a refused frame or a failed reply; the ids of what it concerns, when known."""

    request_id: str
    session_id: str


class PongOut(TypedDict):
    """``pong``: the answer to ``ping``."""

    type: Literal["pong"]


ServerFrame = StartOut | DeltaOut | ProgressOut | DoneOut | ErrorOut | PongOut


class WireFrame(NamedTuple):
    """A frame encoded once: its JSON ``text`` and that text's UTF-8 ``size`` (bytes)."""

    text: str
    size: int


def encode_frame(frame: ServerFrame | Mapping[str, Any]) -> WireFrame:
    """A server frame (or a live ``event`` frame, already shaped by the store) as the
    socket's JSON text; a lone surrogate echoed from input becomes U+FFFD rather than
    breaking the socket."""
    data = json.dumps(frame, ensure_ascii=False)
    try:
        size = len(data.encode())
    except UnicodeEncodeError:
        data = printable(data)
        size = len(data.encode())
    return WireFrame(data, size)


def error_frame(code: str, message: str, request_id: str | None = None,
                session_id: str | None = None) -> ErrorOut:
    """``{"type": "error", "code", "message", "request_id"?, "session_id"?}``."""
    frame: ErrorOut = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        frame["request_id"] = request_id
    if session_id is not None:
        frame["session_id"] = session_id
    return frame


def error_from(exc: GatewayError, request_id: str | None = None, session_id: str | None = None) -> ErrorOut:
    """An error frame for ``exc``, echoing the ids it or the caller knows."""
    rid = getattr(exc, "request_id", None) or request_id
    sid = getattr(exc, "session_id", None) or session_id
    return error_frame(exc.code, exc.message, rid, sid)


def done_frame(entry: dict[str, Any]) -> DoneOut:
    """The ``done`` frame of a reply stream's ``done`` payload."""
    return cast(DoneOut, {"type": "done", **entry})


PONG: PongOut = {"type": "pong"}
