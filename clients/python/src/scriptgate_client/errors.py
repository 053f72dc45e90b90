"""Typed errors, with the same names and parents as the TypeScript client's
(tests/fixtures/wire/errors.json)::

    ScriptgateError
    ├── ConnectionError          (also the built-in ConnectionError; .path)
    │   ├── SocketNotFoundError      (also FileNotFoundError)
    │   ├── ConnectionRefusedError   (also the built-in ConnectionRefusedError)
    │   ├── PermissionDeniedError    (also PermissionError)
    │   └── ConnectionClosedError
    ├── ProtocolError            (the daemon broke protocol v1)
    └── DaemonError              (an error answer: one class per JSON-RPC code)
        ├── ParseError, InvalidRequestError, MethodNotFoundError, InvalidParamsError,
        │   InternalError, PeerNotAllowedError
        └── TokenError, SnapshotError, ToolsError, ApprovalError, BusyError,
            NotFoundError, StillRunningError, NotAdminError

Every error carries the JSON-RPC ``code`` and ``message`` and, from ``data``,
``reason``, ``field`` and ``tool`` (``None`` when the daemon did not send them).
The names of 0.1.0 (``ConnectFailed``, ``ConnectionClosed``, ``InvalidParams``, ...)
remain as aliases.
"""

from __future__ import annotations

import builtins
from typing import Any, Dict, Optional, Type


class ScriptgateError(Exception):
    """The base of every error this package raises about the daemon: an error
    answer (``DaemonError``), the connection (``ConnectionError``), a message that
    is not protocol v1 (``ProtocolError``)."""

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


class ConnectionError(ScriptgateError, builtins.ConnectionError):
    """The connection to the daemon could not be made, or was lost; no code.
    ``path`` is the socket (``None`` when never connected). Also the built-in
    ``ConnectionError`` (an ``OSError``); the connect failures are also the
    matching ``FileNotFoundError``, ``ConnectionRefusedError``, ``PermissionError``.
    Raised as itself for a connect failure of another errno."""

    def __init__(self, message: str, path: Optional[str] = None) -> None:
        super().__init__(message)
        self.path = path

    def __str__(self) -> str:
        return self.message


class SocketNotFoundError(ConnectionError, FileNotFoundError):
    """No socket at the path: scriptgated (or scriptgate.socket) is not running there."""


class ConnectionRefusedError(ConnectionError, builtins.ConnectionRefusedError):
    """A socket file exists but nothing listens on it (a stale socket)."""


class PermissionDeniedError(ConnectionError, PermissionError):
    """The socket (or a directory above it) may not be opened by this user."""


class ConnectionClosedError(ConnectionError):
    """The connection ended (or was never open) with requests pending, or a
    request was made after it closed."""


class ProtocolError(ScriptgateError):
    """The daemon sent something that is not protocol v1 (e.g. an over-long line,
    an answer of the wrong shape); no code."""

    def __str__(self) -> str:
        return self.message if self.code is None else super().__str__()


class DaemonError(ScriptgateError):
    """An error answer of the daemon (or the same refusal found before sending):
    ``code`` is its JSON-RPC code, one subclass per code of scriptgate-protocol(7);
    a code without one of its own is raised as ``DaemonError``."""


class ParseError(DaemonError):
    """-32700: the daemon could not parse a line (id null)."""

    code = -32700


class InvalidRequestError(DaemonError):
    """-32600: not a JSON-RPC request (a line too long or too slow, no ``jsonrpc``)."""

    code = -32600


class MethodNotFoundError(DaemonError):
    """-32601: unknown method."""

    code = -32601


class InvalidParamsError(DaemonError):
    """-32602: params of the wrong shape (e.g. a bad ``traceparent``)."""

    code = -32602


class InternalError(DaemonError):
    """-32603: e.g. the sandbox or the record directory could not be created
    (reason ``spawn``, ``no_space``, ``identity``, ``limits_not_enforced``)."""

    code = -32603


class PeerNotAllowedError(DaemonError):
    """-32001: this peer is not served (``peer_not_allowed``), or only for
    administration (``admin_only``), or named by two engine entries (``engine_ambiguous``)."""

    code = -32001


class TokenError(DaemonError):
    """-32010: reason malformed, signature, algorithm, expired, revoked, missing_claim."""

    code = -32010


class SnapshotError(DaemonError):
    """-32011: reason and field; also raised locally for a snapshot that cannot be sent."""

    code = -32011


class ToolsError(DaemonError):
    """-32012: a tool named in script.start's tools is refused; tool and reason."""

    code = -32012


class ApprovalError(DaemonError):
    """-32013: approval denied or not answered in time (reason denied / timeout)."""

    code = -32013


class BusyError(DaemonError):
    """-32015: a cap was hit (``busy``, ``approvals_pending``, ``stopping``,
    ``too_many_connections``)."""

    code = -32015


class NotFoundError(DaemonError):
    """-32016: no such script visible to this connection."""

    code = -32016


class StillRunningError(DaemonError):
    """-32017: script.wait's timeout_s passed; the script still runs."""

    code = -32017


class NotAdminError(DaemonError):
    """-32018: an ``admin.*`` method from a peer that is no administrator."""

    code = -32018


# The names of before the two clients were given one set (0.1.0): kept, so that
# code written against them goes on working. ``ConnectFailed`` is now the base of
# every connection error (it was of the connect failures only).
ConnectFailed = ConnectionError
ConnectionClosed = ConnectionClosedError
SocketNotFound = SocketNotFoundError
ConnectionRefused = ConnectionRefusedError
PermissionDenied = PermissionDeniedError
InvalidRequest = InvalidRequestError
MethodNotFound = MethodNotFoundError
InvalidParams = InvalidParamsError
PeerNotAllowed = PeerNotAllowedError
StillRunning = StillRunningError
NotAdmin = NotAdminError


ERRORS_BY_CODE: Dict[int, Type[DaemonError]] = {
    cls.code: cls
    for cls in (
        ParseError,
        InvalidRequestError,
        MethodNotFoundError,
        InvalidParamsError,
        InternalError,
        PeerNotAllowedError,
        TokenError,
        SnapshotError,
        ToolsError,
        ApprovalError,
        BusyError,
        NotFoundError,
        StillRunningError,
        NotAdminError,
    )
}


def error_from_rpc(err: Any) -> ScriptgateError:
    """The typed exception for a JSON-RPC error object: the ``DaemonError``
    subclass of its code; ``ProtocolError`` for one that is no error object."""
    if not isinstance(err, dict):
        return ProtocolError(f"malformed error object: {err!r:.200}")
    code = err.get("code")
    message = err.get("message")
    if not isinstance(message, str):
        message = "error without a message"
    if not isinstance(code, int) or isinstance(code, bool):
        return ProtocolError(message, None, err.get("data"))
    cls = ERRORS_BY_CODE.get(code, DaemonError)
    return cls(message, code, err.get("data"))
