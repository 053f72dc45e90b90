"""scriptgate-client: the engine side of the scriptgate engine protocol, version 1.

Mint run tokens (``mint_token``), describe what a run may do (``Snapshot``,
``Tool``, ``Limits``), prepare its workspace (``prepare_workspace``) and drive
scriptgated over its Unix socket (``Client``). Standard library only.
"""

from .client import DEFAULT_SOCKET, Client, connect
from .errors import (
    ApprovalError,
    BusyError,
    ConnectionClosed,
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
    Limits,
    PermissionMode,
    Progress,
    ScriptResult,
    ScriptStatus,
    Snapshot,
    Tool,
    ToolCall,
    ToolClass,
)
from .workspace import prepare_workspace, script_identity

__version__ = "0.1.0"
PROTOCOL_VERSION = 1

__all__ = [
    "ApprovalError", "ApprovalRequest", "BusyError", "Client", "ConnectionClosed", "DEFAULT_SOCKET",
    "InternalError", "InvalidParams", "InvalidRequest", "Limits", "MethodNotFound", "NotAdmin",
    "NotFoundError", "ParseError", "PeerNotAllowed", "PermissionMode", "Progress", "PROTOCOL_VERSION",
    "ProtocolError", "ScriptResult", "ScriptStatus", "ScriptgateError", "Snapshot", "SnapshotError",
    "StillRunning", "TokenError", "Tool", "ToolCall", "ToolClass", "ToolsError", "connect",
    "error_from_rpc", "load_key", "mint_token", "prepare_workspace", "script_identity",
]
