"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from engine.errors import InvalidRequestError
from engine.text_checks import text_error

# Below this temperature sampling is greedy (argmax): dividing logits by ~0 overflows.
GREEDY_EPS = 1e-5

# The one source of truth for the numeric ranges (inclusive bounds; None: unbounded).
# The engine validates with it; the gateway, the OpenAI API, the browser's settings and
# the terminal client check and show the same ranges from it.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "max_tokens": (1, None),
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),  # 0 itself is refused: (0, 1]
    "top_k": (-1, None),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 10.0),  # 0 itself is refused: (0, 10]
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "seed": (-(2**63), 2**64 - 1),  # -1 means "random" (no seed), as OpenAI clients send it
    "logprobs": (0, 20),
}
# Parameters whose lower bound itself is refused: (lo, hi].
OPEN_LOW = frozenset({"top_p", "repetition_penalty"})
# Parameters that take integers only (the others take any finite number).
INTEGER_PARAMS = frozenset({"max_tokens", "top_k", "seed", "logprobs"})
# Parameters that may be None (meaning "unset").
NULLABLE_PARAMS = frozenset({"seed", "logprobs"})
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
STOP_ERROR = (f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} "
              "characters")
_HINTS = {"top_p": " (use temperature 0 for greedy)", "top_k": " (0 or -1 disables)",
          "seed": " (-1 for random)"}


def range_text(name: str) -> str:
    """How ``RANGES[name]`` reads in an error: ``in [0, 2]``, ``in (0, 1]``, ``>= 1``."""
    lo, hi = RANGES[name]
    if name == "seed":
        return "a signed or unsigned 64-bit integer"
    kind = "an integer " if name in INTEGER_PARAMS else ""
    if hi is None:
        return f"{kind}>= {lo:g}"
    return f"{kind}in {'(' if name in OPEN_LOW else '['}{lo:g}, {hi:g}]"


def param_error(name: str, value: Any, label: str | None = None) -> str | None:
    """The one error text for a numeric sampling parameter out of ``RANGES`` (or of the
    wrong type), or None when ``value`` is acceptable. Every layer (engine, gateway,
    OpenAI API, terminal client) reports a bad value with this text.

    Args:
        name: a key of ``RANGES``.
        value: the value as decoded from JSON or the command line.
        label: the name to show (e.g. ``max_completion_tokens``); default ``name``.
    """
    if value is None and name in NULLABLE_PARAMS:
        return None
    lo, hi = RANGES[name]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and name in INTEGER_PARAMS:
        ok = isinstance(value, int)
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if ok:
        ok = (lo is None or value > lo or (value == lo and name not in OPEN_LOW)) and (hi is None or value <= hi)
    if ok:
        return None
    try:
        shown = ascii(value)[:60]  # ascii: a lone surrogate in a bad value cannot break the reply
    except ValueError:  # an integer too long to print
        shown = "a huge integer"
    return f"{label or name} must be {range_text(name)}, got {shown}{_HINTS.get(name, '')}"


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_tokens: completion tokens to generate at most (>= 1).
        temperature: in [0, 2]; values below ``GREEDY_EPS`` mean greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 disables. 0 is rejected (documented policy:
            use temperature 0 for greedy). A tiny top_p keeps the top token.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: in [0, 1]; drop tokens with prob < min_p * max prob.
        repetition_penalty: in (0, 10]; 1 disables (CTRL-style, divides positive logits of
            tokens seen in prompt or output, multiplies negative ones).
        frequency_penalty, presence_penalty: in [-2, 2] (OpenAI semantics, over output tokens).
        seed: a signed or unsigned 64-bit integer that makes the request's sampling
            reproducible whatever its batch neighbours; -1 (or None) means random.
        stop: strings that end the reply; the stop string itself is not returned.
        stop_token_ids: token ids that end the reply (not returned in the text).
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: None, or the number (0-20) of top alternatives to return per token
            besides the sampled token's own log-probability.

    Raises:
        InvalidRequestError: on any out-of-range value (from ``__post_init__``).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()
        if self.seed == -1:
            self.seed = None  # OpenAI clients send -1 for "random"

    def _validate(self) -> None:
        for name in RANGES:
            message = param_error(name, getattr(self, name))
            if message is not None:
                raise InvalidRequestError(message)
        if len(self.stop) > MAX_STOP_STRINGS or any(
                not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequestError(STOP_ERROR)
        for i, s in enumerate(self.stop):
            message = text_error(s, f"stop[{i}]")
            if message is not None:
                raise InvalidRequestError(message)
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON object; unknown keys are an error.

        Raises:
            InvalidRequestError: unknown key, wrong type or out-of-range value.
        """
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(map(ascii, unknown))}"[:300])
        try:
            return cls(**data)
        except TypeError as e:  # e.g. a list where a number belongs
            raise InvalidRequestError(f"bad sampling parameters: {e}") from None
