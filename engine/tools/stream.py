"""A reply's text split, as it streams, into content and tool calls (standard library only).

The engine feeds each piece of a tool-using reply's text (after the detokenizer: whole
characters, stop strings already cut) to ``ToolCallStream.feed``, which returns the
piece's content text and its tool-call deltas, OpenAI's streaming shape: a call's first
delta carries its ``index``, a fresh ``id`` and the function ``name`` (arguments ``""``),
the next ones fragments of its ``arguments`` JSON text, in order, so the fragments of a
call concatenate to its arguments. Text that may still become a call marker is held back
until it is known not to be one (as the detokenizer holds back a partial stop string).

The layout parsed is the format's (``engine.tools.formats``), which the reply's grammar
enforces (``engine.tools.grammar``). Parsing is nevertheless tolerant of whitespace, and
a marker followed by something that is not a call ends up as content.

A reply never carries the same call twice (same name, equal arguments): a small model
that may make several calls tends to repeat its first one until ``max_tokens``. A call
whose name an earlier call of the reply has is therefore held back (no delta) until its
arguments end; if they equal an earlier call's, the call is dropped, ``repeated`` is
set, and everything after it is ignored: the engine ends the reply there, as the end of
its calls. A call that turns out new is released whole, its deltas in order.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from engine.tools.formats import ToolFormat

MAX_HEAD_CHARS = 512  # a call's opening without its name by then is not a call


@dataclass
class ToolCallDelta:
    """A piece of one call: the first of a call has ``id`` and ``name``; ``arguments`` is a
    fragment of the arguments' JSON text (possibly empty)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, object]:
        """The wire form (``{"index", "id"?, "name"?, "arguments"}``)."""
        d: dict[str, object] = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
        if self.name is not None:
            d["name"] = self.name
        d["arguments"] = self.arguments
        return d


@dataclass
class ToolCall:
    """One whole call: its ``arguments`` JSON text (incomplete if the reply was cut)."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False

    def as_dict(self) -> dict[str, object]:
        """The wire form (``{"index", "id", "name", "arguments"}``)."""
        return {"index": self.index, "id": self.id, "name": self.name, "arguments": self.arguments}


def new_call_id() -> str:
    """A fresh call id, ``call_`` and 24 hex digits (unique in practice; OpenAI's shape)."""
    return "call_" + secrets.token_hex(12)


class _JsonEnd:
    """Finds where a JSON value ends, fed piece by piece (string-aware bracket depth)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.done = False

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the value's end; returns how many characters belong to it."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.started = True
            elif ch in "}]":
                self.depth -= 1
            if self.started and self.depth == 0 and not self.in_string:
                self.done = True
                return i + 1
        return len(text)


class ToolCallStream:
    """Splits one reply into content and calls.

    Args:
        fmt: the model's tool format.
        make_id: makes each call's id (``new_call_id`` by default).
    """

    def __init__(self, fmt: ToolFormat, make_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.make_id = make_id
        self.marker = fmt.call_start.strip() or "{"
        self._keep_marker = not fmt.call_start.strip()  # the marker is the JSON's own "{"
        self._head_re = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + re.escape(fmt.args_key)
                                + r'"\s*:\s*')
        end = fmt.call_end.strip()
        self._tail_re = re.compile(r"\s*\}" + (r"\s*" + re.escape(end) if end else ""))
        self._sep = fmt.separator.strip()
        self.state = "text"
        self.buf = ""
        self.content = ""  # all content emitted
        self.calls: list[ToolCall] = []
        self._json: _JsonEnd | None = None
        self._held: list[ToolCallDelta] | None = None  # the deltas of a call that may repeat one
        self.repeated = False  # the reply started repeating a call: its calls are over

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Take the next piece of the reply; returns its content and its call deltas."""
        self.buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        progress = True
        while progress and self.buf:
            progress = getattr(self, f"_{self.state}")(content, deltas)
        out = "".join(content)
        self.content += out
        return out, deltas

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The reply ended: held-back text that did not become a call is content; a call
        cut short keeps what it had (``complete`` False).

        Args:
            cut: the reply was cut (``max_tokens``, the context, an abort) rather than
                ended by the model. A call's opening cut before its arguments, or what
                came after a call (a separator or the next marker in part), is then
                dropped: it was the start of a call, not text, and would otherwise reach
                the client as raw call markup in the content.
        """
        content, deltas = "", list[ToolCallDelta]()
        if self._held is not None:  # cut inside a call that could still have been new: it is one
            deltas, self._held = self._held, None
        if self.state == "repeat":
            pass
        elif cut and self.state in ("head", "between"):
            pass
        elif self.state in ("text", "plain", "between") and self.buf:
            content = self.buf
        elif self.state == "head" and self.buf:
            content = ("" if self._keep_marker else self.marker) + self.buf
        self.buf = ""
        self.content += content
        return content, deltas

    # ----- states: each consumes from self.buf, returns whether it made progress -----
    def _text(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        if self.fmt.at_start_only:
            if self.content or content:
                self.state = "plain"
                return True
            stripped = self.buf.lstrip()
            if not stripped:
                return False  # only whitespace so far: wait
            if stripped.startswith(self.marker):
                self.buf = stripped
                self.state = "head"
                return True
            self.state = "plain"
            return True
        at = self.buf.find(self.marker)
        if at >= 0:
            content.append(self.buf[:at])
            self.buf = self.buf[at:] if self._keep_marker else self.buf[at + len(self.marker):]
            self.state = "head"
            return True
        hold = _partial_suffix(self.buf, self.marker)
        content.append(self.buf[: len(self.buf) - hold])
        self.buf = self.buf[len(self.buf) - hold:]
        return False

    def _plain(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        content.append(self.buf)
        self.buf = ""
        return False

    def _head(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        m = self._head_re.match(self.buf)
        if m is not None and m.end() == len(self.buf):
            m = None  # whitespace before the arguments may go on: wait for their first character
        if m is None:
            if len(self.buf) > MAX_HEAD_CHARS:  # not a call after all
                content.append(("" if self._keep_marker else self.marker) + self.buf)
                self.buf = ""
                self.state = "plain"
                return True
            return False
        call = ToolCall(index=len(self.calls), id=self.make_id(), name=m.group(1))
        if any(c.name == call.name for c in self.calls):
            self._held = []  # may repeat an earlier call: shown once its arguments say it does not
        self.calls.append(call)
        self._out(deltas).append(ToolCallDelta(call.index, "", call.id, call.name))
        self.buf = self.buf[m.end():]
        self._json = _JsonEnd()
        self.state = "args"
        return True

    def _args(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        assert self._json is not None
        n = self._json.feed(self.buf)
        piece, self.buf = self.buf[:n], self.buf[n:]
        call = self.calls[-1]
        call.arguments += piece
        if piece:
            self._out(deltas).append(ToolCallDelta(call.index, piece))
        if self._json.done:
            if self._held is not None:
                held, self._held = self._held, None
                if any(_same_call(c, call) for c in self.calls[:-1]):
                    self.calls.pop()
                    self.repeated, self.state, self.buf = True, "repeat", ""
                    return False
                deltas.extend(held)
            self.state = "tail"
            return True
        return False

    def _repeat(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        self.buf = ""  # after a repeated call: nothing more belongs to the reply
        return False

    def _out(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        """Where the current call's deltas go: held back, or out with this piece."""
        return self._held if self._held is not None else deltas

    def _tail(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        m = self._tail_re.match(self.buf)
        if m is None:
            return False
        self.calls[-1].complete = True
        self.buf = self.buf[m.end():]
        self.state = "between"
        return True

    def _between(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        rest = self.buf.lstrip()
        if self._sep and rest.startswith(self._sep):
            rest = rest[len(self._sep):].lstrip()
        if not rest:
            return False
        if rest.startswith(self.marker):
            self.buf = rest if self._keep_marker else rest[len(self.marker):]
            self.state = "head"
            return True
        if self.marker.startswith(rest) or (self._sep and self._sep.startswith(rest)):
            return False  # may still become the next call
        self.state = "plain"  # text after the calls (the grammar forbids it; kept as content)
        return True


def _same_call(a: ToolCall, b: ToolCall) -> bool:
    """Whether two calls are the same: the same name and equal arguments (as JSON values,
    so whitespace and key order do not matter; as text when either does not parse)."""
    if a.name != b.name:
        return False
    try:
        return _canonical(a.arguments) == _canonical(b.arguments)
    except (ValueError, RecursionError):
        return a.arguments.strip() == b.arguments.strip()


def _canonical(arguments: str) -> str:
    """A JSON text in one layout (sorted keys, no whitespace). Raises ValueError."""
    return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
