"""A request's prompt token ids, computed in the gateway the way the engine computes them.

Routing by prefix (``gateway/engines/routing.py``) needs the prompt's page hashes before any
engine has seen the request: a new chat that opens with a long shared document must go
to the engine that already holds that document's KV. The gateway has no model, but it
can read the model's tokenizer and chat template (the folder an engine names in its
``hello``, or ``ROUTING_TOKENIZER``; read once, off the event loop, as soon as an engine
greets) and run the engine's own prompt builder
(``engine.prompt.PromptBuilder``) on it, so the ids (hence the hashes) are the engine's.
NVIDIA Dynamo's KV router also tokenizes in the frontend for the same reason.

Used for routing only: a wrong or missing id costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from engine.outputs import GenerateRequest
from engine.prompt import PromptBuilder

__all__ = ["RoutingTokenizer"]

log = logging.getLogger("gateway.engines.prompt_ids")

# ids are checked by the engine, not here: any id a model produced is accepted
_ANY_VOCAB = 1 << 31
_INLINE_CHARS = 4096  # shorter prompts are tokenized on the event loop (well under a millisecond)


class RoutingTokenizer:
    """The engine's prompt builder over a tokenizer folder read by the gateway.

    Args:
        folder: a Hugging Face folder with the tokenizer and its chat template.

    Raises:
        OSError, ValueError: the folder has no readable tokenizer (from transformers).
    """

    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy: imported only when routing needs it

        self.folder = Path(folder)
        self.builder = PromptBuilder(AutoTokenizer.from_pretrained(self.folder, local_files_only=True), _ANY_VOCAB)

    @classmethod
    async def load(cls, folder: str | Path) -> RoutingTokenizer | None:
        """Load off the event loop; None (logged) when the folder cannot be read."""
        try:
            return await asyncio.to_thread(cls, folder)
        except Exception as e:  # routing falls back to what it knows without ids
            log.warning("cannot read the tokenizer in %s for prefix routing (%s); routing without it", folder, e)
            return None

    def prompt_ids(self, messages: list[dict[str, str]], prefix_token_ids: list[int] | None = None) -> list[int]:
        """The prompt ids an engine would build for ``messages`` (and the chat's exact
        ``prefix_token_ids``).

        Raises:
            engine.errors.InvalidRequestError: the messages do not render (the engine
                will refuse them too).
        """
        req = GenerateRequest(request_id="route", messages=messages, prefix_token_ids=prefix_token_ids or None)
        return self.builder.build(req)[0]

    async def prompt_ids_async(self, messages: list[dict[str, str]],
                               prefix_token_ids: list[int] | None = None) -> list[int]:
        """``prompt_ids``, in a worker thread when the chat is long."""
        if sum(len(m.get("content", "")) for m in messages) <= _INLINE_CHARS:
            return self.prompt_ids(messages, prefix_token_ids)
        return await asyncio.to_thread(self.prompt_ids, messages, prefix_token_ids)
