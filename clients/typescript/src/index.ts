/**
 * @scriptgate/client: the engine side of scriptgate-protocol(7) for Node >= 18.
 * Run tokens (HS256 via node:crypto), snapshot types and validation, and a client
 * for scriptgated's Unix socket that serves `tool.call` and `approval.request`.
 */
export { mintToken, decodeToken, readKeyFile, type RunClaims, type TokenKey } from "./token.js";
export {
  validateSnapshot,
  toolFromMcp,
  splitToolName,
  type Snapshot,
  type ToolSpec,
  type SnapshotLimits,
  type ToolClass,
  type PermissionMode,
  type JsonSchema,
  type McpTool,
  type FromMcpOptions,
} from "./snapshot.js";
export {
  ScriptgateError,
  DaemonError,
  ProtocolError,
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
  ConnectionError,
  SocketNotFoundError,
  ConnectionRefusedError,
  PermissionDeniedError,
  ConnectionClosedError,
  CallCancelledError,
  ErrorCode,
  errorClassOf,
  type RpcErrorObject,
} from "./errors.js";
export {
  ScriptgateClient,
  HandlerError,
  DEFAULT_SOCKET,
  DEFAULT_MAX_LINE_BYTES,
  checkToolAnswer,
  describeThrown,
  type ClientOptions,
  type ToolHandler,
  type ToolCallContext,
  type HandlerProgress,
  type ApprovalHandler,
  type ScriptRefOptions,
  type WaitOptions,
  type RunOptions,
  type ProgressEvent,
  type ScriptProgressEvent,
  type CallProgressEvent,
  type ScriptgateClientEvents,
} from "./client.js";
export type { OtelApi } from "./otel.js";
export { parseJson, stringifyJson } from "./json.js";
export * from "./protocol.js";
export { prepareWorkspace, scriptOwner, defaultRunAs, lookupUser, lookupUserAsync, type Owner, type WorkspaceOptions } from "./workspace.js";
