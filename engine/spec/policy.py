"""When to speculate, and how many draft tokens: the adaptive part of n-gram speculation.

Verifying k drafts costs a step k more rows; on the CPU at batch 1 a step is bound by
reading the weights, so a few extra rows are nearly free, but at larger batches the
step is compute-bound and rejected drafts are pure cost. So the engine speculates only
while few requests decode at once, and each request backs off when its drafts keep
being rejected (an exponential average of the accepted fraction), retrying later.

The decision for a request depends only on the step's number of decoding requests
and on the request's own history, never on its neighbours' tokens; and speculation
never changes a request's output (verification keeps exactly the tokens the sampler
would have produced: ``engine.spec.verify``), so the policy affects speed only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecConfig:
    """Settings of n-gram speculation (validated on construction).

    Attributes:
        num_draft_tokens: most drafts verified per request per step (k); a request gets k
            times its average accepted fraction (``SpecState.draft_budget``).
        min_n, max_n: n-gram sizes matched, longest first.
        max_batch: speculate only while at most this many requests decode in a step.
        min_acceptance: back off a request whose average accepted fraction falls below this.
        backoff_steps: decode steps a backed-off request waits before drafting again.
        ema: weight of the latest step in a request's average accepted fraction.

    Raises:
        ValueError: a setting out of range.
    """

    num_draft_tokens: int = 8
    min_n: int = 2
    max_n: int = 3
    max_batch: int = 4
    min_acceptance: float = 0.25
    backoff_steps: int = 16
    ema: float = 0.3

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be >= 1")
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError("n-gram sizes need 1 <= min_n <= max_n")
        if self.max_batch < 1 or self.backoff_steps < 0:
            raise ValueError("max_batch must be >= 1 and backoff_steps >= 0")
        if not 0.0 <= self.min_acceptance <= 1.0 or not 0.0 < self.ema <= 1.0:
            raise ValueError("min_acceptance must be in [0, 1] and ema in (0, 1]")


@dataclass
class SpecState:
    """One request's speculation record.

    Attributes:
        acceptance: exponential average of the accepted fraction of its drafts.
        cooldown: decode steps left before it drafts again (after a back-off).
        drafted, accepted: totals of draft tokens proposed and accepted (tokens).
        spec_steps: steps in which it verified drafts.
    """

    acceptance: float = 1.0
    cooldown: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0
    pending: list[int] = field(default_factory=list)  # this step's drafts, set by the engine

    def wants_drafts(self, config: SpecConfig) -> bool:
        """Whether to draft this step (counts down a back-off)."""
        if self.cooldown > 0:
            self.cooldown -= 1
            if self.cooldown == 0:
                self.acceptance = config.min_acceptance  # one more try, then decide again
            return False
        return True

    def draft_budget(self, config: SpecConfig) -> int:
        """How many drafts to propose: ``num_draft_tokens`` scaled by the request's average
        accepted fraction (at least 1), so a request whose drafts often fail verifies
        fewer of them (each costs a row of the step)."""
        return max(1, min(config.num_draft_tokens, math.ceil(config.num_draft_tokens * self.acceptance)))

    def record(self, config: SpecConfig, drafted: int, accepted: int) -> None:
        """Fold one verification (``accepted`` of ``drafted`` drafts kept) into the record."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.spec_steps += 1
        self.acceptance = (1 - config.ema) * self.acceptance + config.ema * (accepted / drafted)
        if self.acceptance < config.min_acceptance:
            self.cooldown = config.backoff_steps
