"""scriptgate-client: the engine side of the scriptgate engine protocol, version 1.

Mint run tokens (``mint_token``), describe what a run may do (``Snapshot``,
``Tool``, ``Limits``), prepare its workspace (``prepare_workspace``) and drive
scriptgated over its Unix socket (``Client``). Standard library only; the mcp
SDK's models and OpenTelemetry are used when installed.
"""

from .client import DEFAULT_SOCKET, Client, ProgressEvent, ProgressStream, connect, tool_answer
from .errors import (  # noqa: A004 (ConnectionError and ConnectionRefusedError are the built-ins' subclasses)
    ApprovalError,
    BusyError,
    ConnectionClosedError,
    ConnectionError,
    ConnectionRefusedError,
    DaemonError,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
    MethodNotFoundError,
    NotAdminError,
    NotFoundError,
    ParseError,
    PeerNotAllowedError,
    PermissionDeniedError,
    ProtocolError,
    ScriptgateError,
    SnapshotError,
    SocketNotFoundError,
    StillRunningError,
    TokenError,
    ToolsError,
    error_from_rpc,
    # The names of 0.1.0, kept.
    ConnectFailed,
    ConnectionClosed,
    ConnectionRefused,
    InvalidParams,
    InvalidRequest,
    MethodNotFound,
    NotAdmin,
    PeerNotAllowed,
    PermissionDenied,
    SocketNotFound,
    StillRunning,
)
from .token import load_key, mint_token
from .types import (
    ApprovalRequest,
    ApprovalTool,
    CallContext,
    CallProgress,
    CancelResult,
    DaemonInfo,
    Limits,
    PermissionMode,
    Progress,
    RevokeResult,
    SandboxInfo,
    ScriptResult,
    ScriptStatus,
    Snapshot,
    Started,
    Tool,
    ToolCall,
    ToolClass,
)
from .workspace import prepare_workspace, script_identity

__version__ = "0.1.0"
PROTOCOL_VERSION = 1

# ConnectionError and ConnectionRefusedError are left out of `import *`: they
# would shadow the built-ins they subclass (use scriptgate_client.ConnectionError).
__all__ = [
    "ApprovalError", "ApprovalRequest", "ApprovalTool", "BusyError", "CallContext", "CallProgress", "CancelResult",
    "Client", "ConnectionClosedError", "DEFAULT_SOCKET", "DaemonError", "DaemonInfo", "InternalError",
    "InvalidParamsError", "InvalidRequestError", "Limits", "MethodNotFoundError", "NotAdminError", "NotFoundError",
    "ParseError", "PeerNotAllowedError", "PermissionDeniedError", "PermissionMode", "Progress", "ProgressEvent",
    "ProgressStream", "PROTOCOL_VERSION", "ProtocolError", "RevokeResult", "SandboxInfo", "ScriptResult",
    "ScriptStatus", "ScriptgateError", "Snapshot", "SnapshotError", "SocketNotFoundError", "Started",
    "StillRunningError", "TokenError", "Tool", "ToolCall", "ToolClass", "ToolsError", "connect", "error_from_rpc",
    "load_key", "mint_token", "prepare_workspace", "script_identity", "tool_answer",
    # The names of 0.1.0, kept.
    "ConnectFailed", "ConnectionClosed", "ConnectionRefused", "InvalidParams", "InvalidRequest", "MethodNotFound",
    "NotAdmin", "PeerNotAllowed", "PermissionDenied", "SocketNotFound", "StillRunning",
]
