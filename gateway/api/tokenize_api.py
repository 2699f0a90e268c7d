"""``POST /tokenize`` and ``POST /detokenize`` (docs/protocol.md section 4, "Tokenize").

Clients count a prompt's tokens, or turn ids back into text, with the served model's own
tokenizer: the one the gateway already reads from the folder an engine names in its
``hello`` (``attachments_api.TokenCounter``, shared with attachment counting). Both
llama-server's bodies and vLLM's are accepted:

* tokenize: ``{"content": text, "add_special": bool (default false), "with_pieces": bool}``
  (llama-server) or ``{"prompt": text, "add_special_tokens": bool (default true)}`` (vLLM);
  the answer is ``{"tokens": [...], "count": n, "max_model_len": m}``, each token an id, or
  with ``with_pieces`` ``{"id": id, "piece": text}``.
* detokenize: ``{"tokens": [ids]}``; the answer ``{"content": text, "prompt": text}``
  (llama-server's key and vLLM's).

``add_special`` follows the tokenizer's own policy (what the engine does with a raw
``/v1/completions`` prompt), so a count here is the count the engine will see.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from gateway.api.openai_request import OpenAIError, bad, check_body, check_text
from gateway.api.state import GatewayState

TOKENIZE_FIELDS = frozenset({"content", "prompt", "add_special", "add_special_tokens", "with_pieces", "model"})
DETOKENIZE_FIELDS = frozenset({"tokens", "model"})
_INLINE_CHARS = 4096  # shorter texts are tokenized on the event loop (well under a millisecond)


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated tokenize body.

    Attributes:
        text: the text to tokenize.
        add_special: let the tokenizer add its special tokens (BOS and the like).
        with_pieces: answer each token as ``{"id", "piece"}`` rather than a bare id.
    """

    text: str
    add_special: bool
    with_pieces: bool


def parse_tokenize(body: Any) -> TokenizeRequest:
    """Validate a decoded tokenize body.

    Raises:
        OpenAIError: 400 naming the first bad field.
    """
    head = check_body(body, TOKENIZE_FIELDS, flags=("add_special", "add_special_tokens", "with_pieces"))
    body = head.body
    if ("content" in body) == ("prompt" in body):
        raise bad("send the text as 'content' (or 'prompt'), exactly one of them", "content")
    key = "content" if "content" in body else "prompt"
    text = body[key]
    if not isinstance(text, str):
        raise bad(f"'{key}' must be a string", key)
    check_text(text, key)
    default_special = key == "prompt"  # vLLM adds special tokens unless told not to; llama-server does not
    add = body.get("add_special", body.get("add_special_tokens", default_special))
    return TokenizeRequest(text, bool(add), bool(body.get("with_pieces", False)))


def parse_detokenize(body: Any, vocab_size: int) -> list[int]:
    """Validate a decoded detokenize body: its ``tokens``, ids in ``[0, vocab_size)``.

    Raises:
        OpenAIError: 400 naming ``tokens``.
    """
    head = check_body(body, DETOKENIZE_FIELDS)
    tokens = head.body.get("tokens")
    if not isinstance(tokens, list) or any(
            not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in tokens):
        raise bad(f"'tokens' must be a list of token ids from 0 to {vocab_size - 1}", "tokens")
    return tokens


async def served_tokenizer(state: GatewayState) -> Any:
    """The served model's Hugging Face tokenizer (loaded once, shared with attachment
    counting).

    Raises:
        OpenAIError: 503 when no engine is connected or its tokenizer cannot be read
            from this host (an engine elsewhere, an upstream).
    """
    info = state.router.info()
    tok = await state.token_counter.get(info.tokenizer_dir if info else None)
    if tok is None:
        raise OpenAIError(503, "the model's tokenizer is not readable by this gateway (no engine connected, "
                               "or the engine runs on another host)", "server_error", None, "tokenizer_unavailable")
    return tok


def _tokenize(tok: Any, req: TokenizeRequest) -> list[Any]:
    ids = [int(t) for t in tok.encode(req.text, add_special_tokens=req.add_special)]
    if not req.with_pieces:
        return ids
    return [{"id": t, "piece": tok.decode([t], skip_special_tokens=False)} for t in ids]


async def tokenize_body(state: GatewayState, req: TokenizeRequest) -> dict[str, Any]:
    """The tokenize answer (see module doc).

    Raises:
        OpenAIError: 503 from ``served_tokenizer``.
    """
    tok = await served_tokenizer(state)
    tokens = _tokenize(tok, req) if len(req.text) <= _INLINE_CHARS else await asyncio.to_thread(_tokenize, tok, req)
    info = state.router.info()
    return {"tokens": tokens, "count": len(tokens), "max_model_len": info.max_model_len if info else None}


async def detokenize_body(state: GatewayState, body: Any) -> dict[str, Any]:
    """The detokenize answer (see module doc).

    Raises:
        OpenAIError: 400 for bad ids, 503 from ``served_tokenizer``.
    """
    tok = await served_tokenizer(state)
    ids = parse_detokenize(body, len(tok))
    text = await asyncio.to_thread(tok.decode, ids, skip_special_tokens=False) if len(ids) > _INLINE_CHARS \
        else tok.decode(ids, skip_special_tokens=False)
    return {"content": text, "prompt": text}
