"""The gateway's user-facing errors: a stable ``code`` (docs/protocol.md section 2)
that becomes an ``error`` frame on the WebSocket or ``{"error": {...}}`` over HTTP."""

from __future__ import annotations

# code -> HTTP status used by the /api routes
HTTP_STATUS: dict[str, int] = {
    "bad_frame": 400,
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "not_found": 404,
    "model_not_found": 404,
    "busy": 409,
    "conflict": 409,
    "frame_too_large": 413,
    "rate_limited": 429,
    "too_many_generations": 429,
    "too_many_sessions": 429,
    "engine_unavailable": 503,
    "store_unavailable": 503,
    "internal_error": 500,
}


class GatewayError(Exception):
    """An error to report to the client as ``{"code", "message"}``; never a traceback.

    Attributes:
        code: one of ``HTTP_STATUS``'s keys.
        message: a sentence for people.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        """The HTTP status for this code (500 for an unknown one)."""
        return HTTP_STATUS.get(self.code, 500)


def not_found(what: str = "chat") -> GatewayError:
    """The one answer for both "does not exist" and "belongs to someone else"."""
    return GatewayError("not_found", f"no such {what}")


def store_unavailable() -> GatewayError:
    """Redis could not be reached."""
    return GatewayError("store_unavailable", "the chat store (Redis) is unreachable; try again shortly")
