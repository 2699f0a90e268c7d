"""Workloads of bench/serving.py: arrivals, prompt text, chat conversations.

* ``poisson_offsets``: arrival times of a Poisson process (exponential gaps, mean
  1/rate seconds).
* ``TextMaker``: English-like filler text of about N tokens (one common word is one
  token of SmolLM2's BPE vocabulary, space included, for nearly every word used).
* ``Conversation``: one chat user's messages over turns (shared system prompt, growing
  history, the reply of each turn appended before the next).
* ``chat_users`` / ``mixed_requests`` / ``single_requests``: seeded request sets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = ("the of and to in is was for on that with as it by at from his an be this which or are had "
         "not but were all one have they their has been more also new first time would other after "
         "two city when who over into its only some then most made world years many these may such "
         "where about between people during state three like known water work part used under well "
         "house small story place while both group great long found three high year life music good "
         "land name game river school early local best team last family light court line around "
         "south north east west power field three point market color river stone garden winter "
         "summer morning evening road train bread paper window music letter simple number question").split()

SYSTEM_PROMPT = ("You are a helpful, concise assistant for a small team. Answer clearly, use plain "
                 "language, keep replies short unless asked for detail, and say so when you are unsure. "
                 "Prefer lists for steps, and never invent facts about people or places.")


class TextMaker:
    """Filler text of about ``n`` tokens, seeded (``random.Random``)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def text(self, n_tokens: int) -> str:
        """About ``n_tokens`` tokens of words, as one sentence-like string."""
        words = [self.rng.choice(WORDS) for _ in range(max(1, n_tokens))]
        return " ".join(words).capitalize() + "."


def poisson_offsets(rate: float, n: int, rng: random.Random) -> list[float]:
    """Start times (seconds from 0) of ``n`` arrivals of a Poisson process of ``rate``
    per second: cumulative sums of exponential gaps with mean ``1 / rate``.

    Raises:
        ValueError: ``rate`` is not positive.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


@dataclass
class RequestSpec:
    """One request: ``messages`` (OpenAI form), ``max_tokens`` (generated exactly, with
    ``ignore_eos``), and ``tags`` kept with its result (workload, user, turn...)."""

    messages: list[dict[str, str]]
    max_tokens: int
    tags: dict[str, Any] = field(default_factory=dict)

    def body(self, model: str) -> dict[str, Any]:
        """The request body: greedy, exactly ``max_tokens`` tokens (EOS ignored), so every
        system generates the same number of tokens."""
        return {"model": model, "messages": self.messages, "max_tokens": self.max_tokens,
                "temperature": 0.0, "ignore_eos": True}


@dataclass
class Conversation:
    """One chat user's conversation: a shared system prompt, ``turns`` user messages
    (planned up front from the seed) and the replies received so far.

    ``next_request()`` gives turn ``k+1``'s request (the whole history plus the next
    user message); ``record_reply(text)`` appends the assistant's reply to that turn.
    """

    user: int
    user_messages: list[str]
    reply_tokens: list[int]
    system_prompt: str = SYSTEM_PROMPT
    replies: list[str] = field(default_factory=list)

    @property
    def turn(self) -> int:
        """Turns completed so far (0..len(user_messages))."""
        return len(self.replies)

    @property
    def finished(self) -> bool:
        """All planned turns have a reply."""
        return self.turn >= len(self.user_messages)

    def next_request(self) -> RequestSpec:
        """The request of the next turn (1-based ``turn`` tag).

        Raises:
            IndexError: the conversation is finished.
        """
        k = self.turn
        if k >= len(self.user_messages):
            raise IndexError("conversation finished")
        msgs = [{"role": "system", "content": self.system_prompt}]
        for u, a in zip(self.user_messages, self.replies):
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": self.user_messages[k]})
        return RequestSpec(msgs, self.reply_tokens[k], {"workload": "chat", "user": self.user, "turn": k + 1})

    def record_reply(self, text: str) -> None:
        """Append the reply to the current turn.

        Raises:
            IndexError: the conversation is finished.
        """
        if self.finished:
            raise IndexError("conversation finished")
        self.replies.append(text)


def chat_users(n_users: int, turns: int, seed: int, user_tokens: tuple[int, int] = (20, 200),
               max_reply: int = 128, min_reply: int = 16) -> list[Conversation]:
    """``n_users`` conversations of ``turns`` turns: user messages of ``user_tokens``
    tokens (uniform, inclusive), replies of ``min_reply..max_reply`` tokens."""
    rng = random.Random(seed)
    tm = TextMaker(rng)
    return [Conversation(u, [tm.text(rng.randint(*user_tokens)) for _ in range(turns)],
                         [rng.randint(min_reply, max_reply) for _ in range(turns)]) for u in range(n_users)]


def mixed_requests(n: int, seed: int, prompt_tokens: tuple[int, int] = (32, 1024),
                   output_tokens: tuple[int, int] = (16, 256)) -> list[RequestSpec]:
    """``n`` independent one-message prompts of ``prompt_tokens`` tokens with outputs of
    ``output_tokens`` tokens (both uniform, inclusive)."""
    rng = random.Random(seed)
    tm = TextMaker(rng)
    return [RequestSpec([{"role": "user", "content": tm.text(rng.randint(*prompt_tokens))}],
                        rng.randint(*output_tokens), {"workload": "mixed", "i": i}) for i in range(n)]


def single_requests(n: int, seed: int, prompt_tokens: int = 64, output_tokens: int = 128) -> list[RequestSpec]:
    """``n`` requests for one user, one stream at a time (latency)."""
    rng = random.Random(seed)
    tm = TextMaker(rng)
    return [RequestSpec([{"role": "user", "content": tm.text(prompt_tokens)}], output_tokens,
                        {"workload": "single", "i": i}) for i in range(n)]
