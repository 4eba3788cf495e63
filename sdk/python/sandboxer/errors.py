"""The one exception type of the SDK and its few refinements."""
from __future__ import annotations

from typing import Any


class SandboxerError(Exception):
    """An operation failed: `code` is the server's error code (or a client-side one such as
    `connection_closed`, `unauthorized`, `protocol`), `message` says what was wrong."""

    def __init__(self, code: str, message: str, *, op: str | None = None,
                 request_id: int | None = None, details: dict[str, Any] | None = None,
                 reply: dict[str, Any] | None = None) -> None:
        super().__init__(f"{op + ': ' if op else ''}{code}: {message}")
        self.code = code
        self.message = message
        self.op = op
        self.request_id = request_id
        self.details = details or {}
        self.reply = reply or {}
        """The whole error reply (e.g. `state` of a failed exec)."""

    @classmethod
    def from_reply(cls, reply: dict[str, Any], op: str | None = None) -> "SandboxerError":
        """Builds the error of a `{"ok": false, "error": {...}}` reply."""
        err = reply.get("error")
        if not isinstance(err, dict):
            return ProtocolError(f"error reply without an error object: {reply!r}", op=op)
        return cls(str(err.get("code", "unknown")), str(err.get("message", "")), op=op,
                   request_id=reply.get("id") if isinstance(reply.get("id"), int) else None,
                   details={k: v for k, v in err.items() if k not in ("code", "message")}, reply=reply)


class AuthError(SandboxerError):
    """The server refused the token (HTTP 401, or close code 4401 after an auth frame)."""

    def __init__(self, message: str) -> None:
        super().__init__("unauthorized", message)


class ConnectionLost(SandboxerError):
    """The connection closed while a request waited, or the event stream could not reconnect.
    `close_code` and `close_reason` are the WebSocket close frame's, when one arrived."""

    def __init__(self, message: str, *, close_code: int | None = None, close_reason: str = "") -> None:
        super().__init__("connection_closed", message)
        self.close_code = close_code
        self.close_reason = close_reason


class ProtocolError(SandboxerError):
    """The server sent something this client cannot make sense of."""

    def __init__(self, message: str, *, op: str | None = None) -> None:
        super().__init__("protocol", message, op=op)
