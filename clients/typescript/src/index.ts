/**
 * @scriptgate/client: the engine side of scriptgate-protocol(7) for Node >= 18.
 * Run tokens (HS256 via node:crypto), snapshot types and validation, and a client
 * for scriptgated's Unix socket that serves `tool.call` and `approval.request`.
 */
export { mintToken, decodeToken, readKeyFile, type RunClaims, type TokenKey } from "./token.js";
export {
  validateSnapshot,
  type Snapshot,
  type ToolSpec,
  type SnapshotLimits,
  type ToolClass,
  type PermissionMode,
  type JsonSchema,
} from "./snapshot.js";
export { ScriptgateError, ConnectionClosedError, ErrorCode, type RpcErrorObject } from "./errors.js";
export {
  ScriptgateClient,
  DEFAULT_SOCKET,
  DEFAULT_MAX_LINE_BYTES,
  type ClientOptions,
  type ToolHandler,
  type ToolCallContext,
  type ApprovalHandler,
  type ScriptRefOptions,
  type WaitOptions,
  type ScriptgateClientEvents,
} from "./client.js";
export * from "./protocol.js";
export { prepareWorkspace, scriptOwner, defaultRunAs, lookupUser, type Owner, type WorkspaceOptions } from "./workspace.js";
