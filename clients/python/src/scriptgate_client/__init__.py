"""scriptgate-client: the engine side of the scriptgate engine protocol, version 1.

Mint run tokens (``mint_token``), describe what a run may do (``Snapshot``,
``Tool``, ``Limits``), prepare its workspace (``prepare_workspace``) and drive
scriptgated over its Unix socket (``Client``). Standard library only; the mcp
SDK's models and OpenTelemetry are used when installed.
"""

from .client import DEFAULT_SOCKET, Client, ProgressEvent, ProgressStream, connect, tool_answer
from .errors import (
    ApprovalError,
    BusyError,
    ConnectFailed,
    ConnectionClosed,
    ConnectionRefused,
    PermissionDenied,
    SocketNotFound,
    InternalError,
    InvalidParams,
    InvalidRequest,
    MethodNotFound,
    NotAdmin,
    NotFoundError,
    ParseError,
    PeerNotAllowed,
    ProtocolError,
    ScriptgateError,
    SnapshotError,
    StillRunning,
    TokenError,
    ToolsError,
    error_from_rpc,
)
from .token import load_key, mint_token
from .types import (
    ApprovalRequest,
    CallContext,
    CallProgress,
    Limits,
    PermissionMode,
    Progress,
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

__all__ = [
    "ApprovalError", "ApprovalRequest", "BusyError", "CallContext", "CallProgress", "Client", "ConnectFailed",
    "ConnectionClosed", "ConnectionRefused", "DEFAULT_SOCKET", "InternalError", "InvalidParams", "InvalidRequest",
    "Limits", "MethodNotFound", "NotAdmin", "NotFoundError", "ParseError", "PeerNotAllowed", "PermissionDenied",
    "PermissionMode", "Progress", "ProgressEvent", "ProgressStream", "PROTOCOL_VERSION", "ProtocolError",
    "ScriptResult", "ScriptStatus", "ScriptgateError", "Snapshot", "SnapshotError", "SocketNotFound", "Started",
    "StillRunning", "TokenError", "Tool", "ToolCall", "ToolClass", "ToolsError", "connect", "error_from_rpc",
    "load_key", "mint_token", "prepare_workspace", "script_identity", "tool_answer",
]
