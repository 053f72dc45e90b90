"""Typed errors: one class per JSON-RPC error code of the engine protocol.

Every error carries the JSON-RPC ``code`` and ``message`` and, from ``data``,
``reason``, ``field`` and ``tool`` (``None`` when the daemon did not send them).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type


class ScriptgateError(Exception):
    """An error answer from scriptgated (or a refusal made before sending)."""

    code: Optional[int] = None

    def __init__(
        self,
        message: str,
        code: Optional[int] = None,
        data: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.data: Dict[str, Any] = data if isinstance(data, dict) else {}
        self.reason: Optional[str] = _str_or_none(self.data.get("reason"))
        self.field: Optional[str] = _str_or_none(self.data.get("field"))
        self.tool: Optional[str] = _str_or_none(self.data.get("tool"))

    def __str__(self) -> str:
        extra = ", ".join(
            f"{k}={v}" for k, v in (("reason", self.reason), ("field", self.field), ("tool", self.tool)) if v
        )
        return f"{self.message} ({self.code}{'; ' + extra if extra else ''})"


def _str_or_none(v: Any) -> Optional[str]:
    return v if isinstance(v, str) else None


class ConnectionClosed(ScriptgateError):
    """The connection to the daemon ended (or was never open); no code.
    ``path`` is the socket (``None`` when never connected)."""

    def __init__(self, message: str, path: Optional[str] = None) -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:
        return self.message


class ConnectFailed(ScriptgateError, OSError):
    """The socket could not be connected to; no code. Also an ``OSError``
    (the subclasses are also the matching ``FileNotFoundError``,
    ``ConnectionRefusedError``, ``PermissionError``). ``path`` is the socket."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:
        return self.message


class SocketNotFound(ConnectFailed, FileNotFoundError):
    """No socket at the path: scriptgated (or scriptgate.socket) is not running there."""


class ConnectionRefused(ConnectFailed, ConnectionRefusedError):
    """A socket file exists but nothing listens on it (a stale socket)."""


class PermissionDenied(ConnectFailed, PermissionError):
    """The socket (or a directory above it) may not be opened by this user."""


class ProtocolError(ScriptgateError):
    """The daemon sent something that is not protocol v1 (e.g. an over-long line)."""

    def __str__(self) -> str:
        return self.message if self.code is None else super().__str__()


class ParseError(ScriptgateError):
    code = -32700


class InvalidRequest(ScriptgateError):
    code = -32600


class MethodNotFound(ScriptgateError):
    code = -32601


class InvalidParams(ScriptgateError):
    code = -32602


class InternalError(ScriptgateError):
    """-32603: e.g. the sandbox or the record directory could not be created."""

    code = -32603


class PeerNotAllowed(ScriptgateError):
    code = -32001


class TokenError(ScriptgateError):
    """-32010: reason malformed, signature, algorithm, expired, revoked, missing_claim."""

    code = -32010


class SnapshotError(ScriptgateError):
    """-32011: reason and field; also raised locally for a snapshot that cannot be sent."""

    code = -32011


class ToolsError(ScriptgateError):
    """-32012: a tool named in script.start's tools is refused; tool and reason."""

    code = -32012


class ApprovalError(ScriptgateError):
    """-32013: approval denied or not answered in time (reason denied / timeout)."""

    code = -32013


class BusyError(ScriptgateError):
    """-32015: the daemon runs max_running scripts (or max_connections)."""

    code = -32015


class NotFoundError(ScriptgateError):
    """-32016: no such script visible to this connection."""

    code = -32016


class StillRunning(ScriptgateError):
    """-32017: script.wait's timeout_s passed; the script still runs."""

    code = -32017


class NotAdmin(ScriptgateError):
    code = -32018


ERRORS_BY_CODE: Dict[int, Type[ScriptgateError]] = {
    cls.code: cls
    for cls in (
        ParseError,
        InvalidRequest,
        MethodNotFound,
        InvalidParams,
        InternalError,
        PeerNotAllowed,
        TokenError,
        SnapshotError,
        ToolsError,
        ApprovalError,
        BusyError,
        NotFoundError,
        StillRunning,
        NotAdmin,
    )
}


def error_from_rpc(err: Any) -> ScriptgateError:
    """The typed exception for a JSON-RPC error object."""
    if not isinstance(err, dict):
        return ProtocolError(f"malformed error object: {err!r:.200}")
    code = err.get("code")
    message = err.get("message")
    if not isinstance(message, str):
        message = "error without a message"
    if not isinstance(code, int) or isinstance(code, bool):
        return ProtocolError(message, None, err.get("data"))
    cls = ERRORS_BY_CODE.get(code, ScriptgateError)
    return cls(message, code, err.get("data"))
