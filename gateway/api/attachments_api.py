"""``POST /api/attachments``: read an uploaded file into an attachment's text
(docs/protocol.md, "Attachments"; the kinds and the prompt form: ``gateway/attachments.py``).

The body is the file's bytes (any content type), its name in ``?name=``. The answer is
``{"name", "kind", "text", "size", "pages"?, "tokens", "tokens_exact"}``: ``tokens`` is
what the attachment adds to the prompt, counted with the model's tokenizer when the
gateway can read it (the folder an engine names in its ``hello``), else estimated from
above (``tokens_exact`` false). A file that alone does not fit the model's context is
refused here (``context_length_exceeded``), before anything reaches an engine.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.http import api
from gateway.api.state import gateway_state
from gateway.attachments import ATTACHMENT_LIMITS, estimate_tokens, extract, prompt_content
from gateway.errors import GatewayError

log = logging.getLogger("gateway.attachments")


class TokenCounter:
    """Counts tokens with the model's tokenizer, read once (off the event loop) from the
    folder an engine names in its ``hello``; None when it cannot be read here (an engine
    on another host, an upstream), and the caller estimates."""

    def __init__(self) -> None:
        self.tokenizer: Any = None
        self.folder = ""
        self._lock = asyncio.Lock()

    async def get(self, folder: str | None) -> Any:
        """The tokenizer of ``folder`` (loaded on first use), or None."""
        if not folder or not Path(folder).is_dir():
            return None
        async with self._lock:
            if folder != self.folder:
                self.folder = folder
                self.tokenizer = await asyncio.to_thread(self._load, folder)
        return self.tokenizer

    @staticmethod
    def _load(folder: str) -> Any:
        try:
            from transformers import AutoTokenizer  # heavy: only when a file is attached

            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as e:  # counting falls back to the estimate
            log.warning("cannot read the tokenizer in %s to count attachment tokens (%s)", folder, e)
            return None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise GatewayError("frame_too_large", f"the file is over the {limit >> 20} MiB limit for attachments")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError("frame_too_large", f"the file is over the {limit >> 20} MiB limit for attachments")
        chunks.append(chunk)
    return b"".join(chunks)


@api
async def upload_attachment(request: Request) -> Response:
    """POST /api/attachments?name=FILE: the file's text and token count (nothing stored)."""
    state = gateway_state(request)
    name = request.query_params.get("name", "")
    if not name:
        raise GatewayError("invalid_request", "name the file: ?name=report.pdf")
    data = await _read_body(request, ATTACHMENT_LIMITS.max_upload_bytes)
    att = await asyncio.to_thread(extract, name, data, ATTACHMENT_LIMITS)
    wrapped = prompt_content("", [att.to_json()])
    info = state.router.info()
    tok = await state.token_counter.get(info.tokenizer_dir if info else None)
    if tok is not None:
        tokens = len(await asyncio.to_thread(tok.encode, wrapped, add_special_tokens=False))
    else:
        tokens = estimate_tokens(wrapped)
    max_len = info.max_model_len if info else 0
    if max_len and tokens >= max_len:
        raise GatewayError("context_length_exceeded",
                           f"{att.name} takes {'' if tok is not None else 'about '}{tokens:,} tokens; the model's "
                           f"context holds {max_len:,}. Attach a shorter file or a part of it.")
    return JSONResponse({**att.to_json(), "tokens": tokens, "tokens_exact": tok is not None})


def attachment_routes() -> list[Route]:
    """The attachment upload route."""
    return [Route("/api/attachments", upload_attachment, methods=["POST"])]
