"""Errors the engine raises to its callers.

Each carries a stable machine-readable ``code`` that travels unchanged over the
internal protocol (``docs/protocol.md``) and up to the browser and the OpenAI API.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class. ``code`` is a short snake_case string; ``message`` is for people."""

    code = "engine_error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequestError(EngineError):
    """The request is malformed or a parameter is out of range (HTTP 400)."""

    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """prompt tokens + max_tokens exceed the model's context, or the prompt can never
    fit the KV pool. Never silently truncated (docs/acceptance.md, context overflow)."""

    code = "context_length_exceeded"


class ConfigError(EngineError, ValueError):
    """A setting is invalid (the engine's ``EngineConfig``, the gateway's ``GatewayConfig``,
    a command-line option, an environment variable, a KV budget that holds no block).
    Raised at start-up, never for a request; the CLIs print its message on one line."""

    code = "config_error"


class InvariantError(EngineError, AssertionError):
    """An internal consistency check failed (block pool, radix cache, scheduler): a bug,
    never a bad request. Raised explicitly, so ``python -O`` keeps it; an
    ``AssertionError`` too, for callers that catch those. The message names the state
    that broke."""

    code = "invariant_failed"


class ModelLoadError(EngineError):
    """Unknown model path, unreadable weights, or an unsupported architecture."""

    code = "model_load_error"
