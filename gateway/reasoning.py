"""A reply's reasoning: the text between the model's thinking markers at its start.

Models that reason first (Qwen3, DeepSeek-R1, QwQ and their kin) write
``<think>…</think>`` before the answer. The gateway keeps a reply's text whole, markers
included (the reply stream, the stored message, the export: a reply continued after a cut
goes on from exactly that text), and splits it where it is shown or sent on:

* the browser shows the reasoning as a collapsible "Thought for N s" block
  (``static/js/reasoning.js``, the same rule as here);
* the next turn's prompt leaves it out (``without_reasoning``), as the chat templates
  of those models do, and a reply with reasoning stores token ids that later turns do not
  reuse as their prefix (``gateway.store.sessions.plan_prefix``);
* the OpenAI API returns it as ``reasoning_content`` (``ReasoningSplitter`` on the
  stream, ``split_reasoning`` on a whole reply), as vLLM and llama.cpp's server do.

A reply has reasoning when its text, after leading whitespace, starts with the opening
marker; the reasoning ends at the first closing marker (or with the reply, when it was
cut while reasoning), and the answer is what follows it, without leading whitespace.
Which markers: ``ThinkMarkers`` (``<think>``/``</think>`` by default, from the engine's
chat template when it declares them, or the ``REASONING_MARKERS`` setting). A model whose
generation prompt already opens the block (DeepSeek-R1's template) writes no opening
marker: ``gateway.engines.run.EngineRun`` puts it in front of the reply's first text, so
the stored text always says where its reasoning is.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MARKERS", "ReasoningSplitter", "ThinkMarkers", "split_reasoning", "thought_for",
           "without_reasoning"]


@dataclass(frozen=True)
class ThinkMarkers:
    """The opening and closing markers of a reply's reasoning (non-empty strings)."""

    open: str = "<think>"
    close: str = "</think>"

    @classmethod
    def parse(cls, value: str) -> ThinkMarkers:
        """Markers from a setting ``"<open> <close>"`` (two words separated by whitespace).

        Raises:
            ValueError: not exactly two words.
        """
        words = value.split()
        if len(words) != 2:
            raise ValueError(f"reasoning markers must be two words, an opening and a closing one: {value!r}")
        return cls(words[0], words[1])


DEFAULT_MARKERS = ThinkMarkers()


def split_reasoning(text: str, markers: ThinkMarkers = DEFAULT_MARKERS) -> tuple[str | None, str]:
    """A whole reply's ``(reasoning, answer)``: reasoning is None when the reply has none
    (then the answer is ``text`` as it is); a reply cut while reasoning has an empty answer.
    The reasoning is stripped of surrounding whitespace, the answer of leading whitespace."""
    body = text.lstrip()
    if not body.startswith(markers.open):
        return None, text
    body = body[len(markers.open):]
    end = body.find(markers.close)
    if end < 0:
        return body.strip(), ""
    return body[:end].strip(), body[end + len(markers.close):].lstrip()


def thought_for(ms: float | None) -> str:
    """The label of a reply's reasoning, as the page words it (``static/js/reasoning.js``
    ``thoughtFor``): "Thought for 12 s" (whole seconds from 10 s up, one decimal below,
    "a moment" under 0.1 s) for ``ms`` milliseconds of reasoning; "Thoughts" when the time
    is not known (None)."""
    if ms is None:
        return "Thoughts"
    s = ms / 1000
    if not s >= 0.1:
        return "Thought for a moment"
    return f"Thought for {int(s + 0.5) if s >= 10 else f'{s:.1f}'} s"  # JS Math.round: halves up


def without_reasoning(messages: list[dict[str, str]], markers: ThinkMarkers = DEFAULT_MARKERS
                      ) -> list[dict[str, str]]:
    """The chat with each assistant message's reasoning taken out (its answer only), for
    the next turn's prompt; other messages are kept as they are (same dicts)."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            reasoning, answer = split_reasoning(m.get("content", ""), markers)
            if reasoning is not None:
                m = {**m, "content": answer}
        out.append(m)
    return out


class ReasoningSplitter:
    """Splits a reply's text, as it streams, into reasoning and answer deltas.

    ``feed(text)`` returns ``(reasoning, answer)``: the new text of each (either may be
    ""). Text that may be the start of a marker is held back until the next ``feed`` tells
    (a marker split across deltas is found whole); ``finish()`` returns what is held. The
    concatenated outputs equal ``split_reasoning`` of the whole text, except that the
    reasoning is not stripped at its end (whitespace before the closing marker stays).
    ``in_reasoning``: the reply is inside its reasoning now; ``reasoned``: it had some.
    """

    def __init__(self, markers: ThinkMarkers = DEFAULT_MARKERS) -> None:
        self.markers = markers
        self._state = "start"  # start -> (reasoning -> after ->) answer
        self._held = ""
        self.reasoned = False

    @property
    def in_reasoning(self) -> bool:
        """True between the opening marker and the closing one."""
        return self._state == "reasoning"

    @property
    def settled(self) -> bool:
        """True once the reasoning, if any, is over: all later text is answer."""
        return self._state in ("after", "answer")

    def feed(self, text: str) -> tuple[str, str]:
        """Take the next piece of the reply; returns the new ``(reasoning, answer)`` text."""
        buf = self._held + text
        self._held = ""
        reasoning, answer = "", ""
        if self._state == "start":
            body = buf.lstrip()
            if body.startswith(self.markers.open):
                self._state, self.reasoned = "reasoning", True
                buf = body[len(self.markers.open):].lstrip()
            elif self.markers.open.startswith(body):
                self._held = buf  # "", whitespace, or a part of the opening marker
                return "", ""
            else:
                self._state = "answer"
                return "", buf
        if self._state == "reasoning":
            end = buf.find(self.markers.close)
            if end < 0:
                keep = _partial_suffix(buf, self.markers.close)
                self._held = buf[len(buf) - keep:] if keep else ""
                return buf[:len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(self.markers.close):]
            self._state = "after"
        if self._state == "after":
            buf = buf.lstrip()
            if not buf:
                return reasoning, ""
            self._state = "answer"
        return reasoning, answer + buf

    def finish(self) -> tuple[str, str]:
        """What is held back, once the reply ended: ``(reasoning, answer)``."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "start":
            return "", held
        return "", ""


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
