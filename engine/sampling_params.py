"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.errors import InvalidRequestError
from engine.structured.spec import StructuredOutput, parse_structured
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
    "prompt_logprobs": (0, 20),
}
# Parameters whose lower bound itself is refused: (lo, hi].
OPEN_LOW = frozenset({"top_p", "repetition_penalty"})
# Parameters that take integers only (the others take any finite number).
INTEGER_PARAMS = frozenset({"max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"})
# Parameters that may be None (meaning "unset").
NULLABLE_PARAMS = frozenset({"seed", "logprobs", "prompt_logprobs"})
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
STOP_ERROR = (f"stop must be at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} "
              "characters")
STOP_TYPE_ERROR = "stop must be a string or a list of strings"
_HINTS = {"top_p": " (use temperature 0 for greedy)", "top_k": " (0 or -1 disables)",
          "seed": " (-1 for random)"}
# logit_bias: at most this many entries, each bias in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's range).
MAX_LOGIT_BIAS_ENTRIES = 1024
LOGIT_BIAS_MAX = 100.0
MAX_CHOICES = 8  # n: choices per request at most


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
        processed_logprobs: the logprobs (and alternatives) are those of the distribution
            the token was drawn from, after logit bias, penalties, the grammar mask,
            temperature and top-k/top-p/min-p (llama.cpp's ``post_sampling_probs``; a
            greedy row's is all on its argmax), instead of the model's raw distribution.
        prompt_logprobs: None, or the number (0-20) of top alternatives to return for
            each prompt token with its own log-probability given the tokens before it (the
            completions API's ``echo`` with ``logprobs``). Such a request computes its whole
            prompt: the prefix cache holds no logits.
        logit_bias: token id -> a bias in [-100, 100] added to that token's logit before
            penalties and sampling (OpenAI semantics; -100 effectively bans a token). JSON
            object keys are the ids as strings; they become ints here. Ids are checked
            against the model's vocabulary by the engine.
        structured: what the output must be (``engine.structured.spec``): a JSON object,
            a value valid under a JSON schema, a regex or a grammar; None for free text.

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
    processed_logprobs: bool = False
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise InvalidRequestError(STOP_TYPE_ERROR)
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = _logit_bias(self.logit_bias)
        self._validate()
        if self.seed == -1:
            self.seed = None  # OpenAI clients send -1 for "random"

    @property
    def structured_output(self) -> StructuredOutput | None:
        """``structured`` checked and parsed (None for free text).

        Raises:
            InvalidRequestError: a malformed ``structured`` (checked on construction too).
        """
        return parse_structured(self.structured)

    def for_choice(self, index: int) -> SamplingParams:
        """These parameters for choice ``index`` of an ``n``-choice request: choice 0 is
        unchanged (so n=1 equals a plain request) and choice i > 0 of a seeded request
        draws from its own seed stream, ``choice_seed(seed, i)``; unseeded choices draw
        from the engine's shared generator, so they differ anyway.

        Raises:
            InvalidRequestError: ``index`` outside ``[0, MAX_CHOICES)``.
        """
        if not isinstance(index, int) or not 0 <= index < MAX_CHOICES:
            raise InvalidRequestError(f"choice index must be in [0, {MAX_CHOICES}), got {index!r}")
        if index == 0 or self.seed is None:
            return replace(self)
        return replace(self, seed=choice_seed(self.seed, index))

    def _validate(self) -> None:
        for name in RANGES:
            message = param_error(name, getattr(self, name))
            if message is not None:
                raise InvalidRequestError(message)
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(STOP_TYPE_ERROR)
        if len(self.stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequestError(STOP_ERROR)
        for i, s in enumerate(self.stop):
            message = text_error(s, f"stop[{i}]")
            if message is not None:
                raise InvalidRequestError(message)
        if not isinstance(self.processed_logprobs, bool):
            raise InvalidRequestError("processed_logprobs must be a boolean")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids must be non-negative integers")
        parse_structured(self.structured)

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


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` (> 0) of a request seeded with ``seed``: splitmix64
    (Steele et al. 2014) of the pair, a 64-bit value, so the choices' noise streams are
    unrelated to each other and to other seeds' streams."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xD1B54A32D192ED03) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def _logit_bias(value: Any) -> dict[int, float]:
    """``logit_bias`` as ``{int id: float bias}``, from ints or decimal strings as keys.

    Raises:
        InvalidRequestError: not an object, too many entries, a key that is not a
            non-negative integer, or a bias that is not a number in [-100, 100].
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError("logit_bias must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        tid = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            tid = int(key)
        if tid is None or tid < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (non-negative integers), got "
                                      f"{ascii(key)[:40]}")
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
        if not ok or abs(bias) > LOGIT_BIAS_MAX:
            raise InvalidRequestError(f"logit_bias[{tid}] must be a number in [-100, 100], got {ascii(bias)[:40]}")
        out[tid] = float(bias)
    return out
