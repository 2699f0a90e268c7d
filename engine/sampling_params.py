"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from engine.errors import InvalidRequestError

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
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        def is_num(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_num(self.temperature) or not (0 <= self.temperature <= 2):
            bad(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not is_num(self.top_p) or not (0 < self.top_p <= 1):
            bad(f"top_p must be in (0, 1], got {self.top_p!r} (use temperature 0 for greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            bad(f"top_k must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        if not is_num(self.min_p) or not (0 <= self.min_p <= 1):
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_num(self.repetition_penalty) or not (0 < self.repetition_penalty <= 10):
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not (-2 <= v <= 2):
                bad(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not (-(2**63) <= self.seed < 2**64)
        ):
            bad(f"seed must be a 64-bit integer (-1 for random), got {self.seed!r}")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s or len(s) > 256 for s in self.stop):
            bad("stop must be at most 16 non-empty strings of at most 256 characters")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) or not (0 <= self.logprobs <= 20)
        ):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

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
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:  # e.g. a list where a number belongs
            raise InvalidRequestError(f"bad sampling parameters: {e}") from None
