/** JSON-RPC error codes of scriptgate-protocol(7). (There is no -32014.) */
export const ErrorCode = {
  PARSE: -32700,
  INVALID_REQUEST: -32600,
  METHOD_NOT_FOUND: -32601,
  INVALID_PARAMS: -32602,
  INTERNAL: -32603,
  /** What this client answers when a tool handler throws (the script sees ToolError `engine`). */
  HANDLER: -32000,
  PEER: -32001,
  TOKEN: -32010,
  SNAPSHOT: -32011,
  TOOLS: -32012,
  APPROVAL: -32013,
  BUSY: -32015,
  NOT_FOUND: -32016,
  STILL_RUNNING: -32017,
  NOT_ADMIN: -32018,
} as const;

/** A JSON-RPC error object as it travels on the wire. */
export interface RpcErrorObject {
  code: number;
  message: string;
  data?: unknown;
}

function str(v: unknown): string | undefined {
  return typeof v === "string" ? v : undefined;
}

/**
 * The base of every error this package throws: an error answer from the daemon
 * ({@link DaemonError}; `code` is its JSON-RPC code and the subclass names it, e.g.
 * {@link TokenError} for -32010), the same refusal found locally (e.g. by
 * {@link validateSnapshot}, which throws {@link SnapshotError} as the daemon would),
 * a connection failure ({@link ConnectionError}: `code` undefined), or a message that
 * is not protocol v1 ({@link ProtocolError}). `reason`, `field` and `tool` come from
 * the error's `data`. The names and parents are the Python client's
 * (tests/fixtures/wire/errors.json):
 *
 * ```text
 * ScriptgateError
 * ├── ConnectionError (path)
 * │   ├── SocketNotFoundError, ConnectionRefusedError, PermissionDeniedError
 * │   └── ConnectionClosedError
 * ├── ProtocolError
 * ├── DaemonError: ParseError, InvalidRequestError, MethodNotFoundError, InvalidParamsError,
 * │   InternalError, PeerNotAllowedError, TokenError, SnapshotError, ToolsError,
 * │   ApprovalError, BusyError, NotFoundError, StillRunningError, NotAdminError
 * ├── CallCancelledError (a tool call's abort reason; this client's own)
 * └── HandlerError (a handler answered what the daemon would refuse; this client's own)
 * ```
 */
export class ScriptgateError extends Error {
  readonly code: number | undefined;
  readonly reason: string | undefined;
  readonly field: string | undefined;
  readonly tool: string | undefined;
  readonly data: unknown;
  /** The request method that was answered with this error, when known. */
  readonly method: string | undefined;

  constructor(code: number | undefined, message: string, data?: unknown, method?: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
    this.code = code;
    this.data = data;
    this.method = method;
    const d = (data !== null && typeof data === "object" ? data : {}) as Record<string, unknown>;
    this.reason = str(d["reason"]);
    this.field = str(d["field"]);
    this.tool = str(d["tool"]);
  }

  /** The typed error for a JSON-RPC error object: the subclass of its code, else ScriptgateError. */
  static fromRpc(e: RpcErrorObject, method?: string): ScriptgateError {
    const code = typeof e.code === "number" ? e.code : ErrorCode.INTERNAL;
    const message = typeof e.message === "string" ? e.message : "error without a message";
    const cls = BY_CODE.get(code);
    return cls ? new cls(message, e.data, method) : new DaemonError(code, message, e.data, method);
  }
}

/**
 * An error answer of the daemon (or the same refusal found before sending): `code` is
 * its JSON-RPC code, one subclass per code of scriptgate-protocol(7); a code without
 * one of its own is a `DaemonError`.
 */
export class DaemonError extends ScriptgateError {
  declare readonly code: number;
  constructor(code: number, message: string, data?: unknown, method?: string, options?: { cause?: unknown }) {
    super(code, message, data, method, options);
  }
}

/** The daemon sent something that is not protocol v1 (an over-long line, a line that is no JSON, an answer of the wrong shape); `code` is undefined. */
export class ProtocolError extends ScriptgateError {
  constructor(message: string, data?: unknown, options?: { cause?: unknown }) {
    super(undefined, message, data, undefined, options);
  }
}

type CodedClass = new (message: string, data?: unknown, method?: string) => DaemonError;

function coded(code: number): CodedClass {
  return class extends DaemonError {
    static readonly code = code;
    constructor(message: string, data?: unknown, method?: string) {
      super(code, message, data, method);
    }
  };
}

/** -32700: the daemon could not parse a line (id null). */
export class ParseError extends coded(ErrorCode.PARSE) {}
/** -32600: not a JSON-RPC request (a line too long, too slow, no `jsonrpc`). */
export class InvalidRequestError extends coded(ErrorCode.INVALID_REQUEST) {}
/** -32601: unknown method. */
export class MethodNotFoundError extends coded(ErrorCode.METHOD_NOT_FOUND) {}
/** -32602: params of the wrong shape (e.g. a bad `traceparent`). */
export class InvalidParamsError extends coded(ErrorCode.INVALID_PARAMS) {}
/** -32603: the record directory or the sandbox could not be made (`reason` e.g. `no_space`, `limits_not_enforced`). */
export class InternalError extends coded(ErrorCode.INTERNAL) {}
/** -32001: this peer is not served (`peer_not_allowed`) or only administration (`admin_only`). */
export class PeerNotAllowedError extends coded(ErrorCode.PEER) {}
/** -32010: the token is refused (`malformed`, `signature`, `algorithm`, `expired`, `revoked`, `missing_claim`). */
export class TokenError extends coded(ErrorCode.TOKEN) {}
/** -32011: the snapshot is refused; `reason` and `field` say why and where. */
export class SnapshotError extends coded(ErrorCode.SNAPSHOT) {}
/** -32012: a tool named in `script.start`'s tools is refused; `tool` and `reason`. */
export class ToolsError extends coded(ErrorCode.TOOLS) {}
/** -32013: the approval was denied or not answered in time (`denied`, `timeout`). */
export class ApprovalError extends coded(ErrorCode.APPROVAL) {}
/** -32015: a cap was hit (`busy`, `too_many_connections`, `approvals_pending`). */
export class BusyError extends coded(ErrorCode.BUSY) {}
/** -32016: no such script visible to this connection (`not_found`). */
export class NotFoundError extends coded(ErrorCode.NOT_FOUND) {}
/** -32017: `script.wait`'s `timeout_s` passed; the script still runs. */
export class StillRunningError extends coded(ErrorCode.STILL_RUNNING) {}
/** -32018: an `admin.*` method from a peer that is no administrator. */
export class NotAdminError extends coded(ErrorCode.NOT_ADMIN) {}

const BY_CODE = new Map<number, CodedClass>([
  [ErrorCode.PARSE, ParseError],
  [ErrorCode.INVALID_REQUEST, InvalidRequestError],
  [ErrorCode.METHOD_NOT_FOUND, MethodNotFoundError],
  [ErrorCode.INVALID_PARAMS, InvalidParamsError],
  [ErrorCode.INTERNAL, InternalError],
  [ErrorCode.PEER, PeerNotAllowedError],
  [ErrorCode.TOKEN, TokenError],
  [ErrorCode.SNAPSHOT, SnapshotError],
  [ErrorCode.TOOLS, ToolsError],
  [ErrorCode.APPROVAL, ApprovalError],
  [ErrorCode.BUSY, BusyError],
  [ErrorCode.NOT_FOUND, NotFoundError],
  [ErrorCode.STILL_RUNNING, StillRunningError],
  [ErrorCode.NOT_ADMIN, NotAdminError],
]);

/** The error class of a daemon error code, if it has one of its own. */
export function errorClassOf(code: number): CodedClass | undefined {
  return BY_CODE.get(code);
}

/** A connection to the daemon could not be made or was lost; `path` is the socket. `code` is undefined. */
export class ConnectionError extends ScriptgateError {
  readonly path: string;
  constructor(path: string, message: string, options?: { cause?: unknown }) {
    super(undefined, message, undefined, undefined, options);
    this.path = path;
  }
}

/** No socket at the path (ENOENT): is scriptgated running, is the path right? */
export class SocketNotFoundError extends ConnectionError {}
/** Nothing listens on the socket (ECONNREFUSED): a stale socket file, or the daemon stopped. */
export class ConnectionRefusedError extends ConnectionError {}
/** The socket (or a directory above it) may not be opened by this process (EACCES, EPERM). */
export class PermissionDeniedError extends ConnectionError {}
/** The connection closed (or failed) with requests pending, or a request was made after it closed. */
export class ConnectionClosedError extends ConnectionError {}

/**
 * The reason a tool call's `AbortSignal` aborted (`signal.reason`). `reason` is the
 * daemon's `tool.cancelled` reason (`cancelled`, `timeout`, `oom`, `interrupted`,
 * `exited`) or the client's own: `finished` (the script finished without a
 * `tool.cancelled` for the call), `handler_timeout` (`toolTimeoutMs`),
 * `connection_closed`. `message` is the daemon's sentence when it sent one.
 */
export class CallCancelledError extends ScriptgateError {
  readonly callId: string | undefined;
  readonly scriptId: string | undefined;
  constructor(reason: string, message: string, ids: { scriptId?: string; callId?: string } = {}, options?: { cause?: unknown }) {
    super(undefined, message, { reason }, undefined, options);
    this.callId = ids.callId;
    this.scriptId = ids.scriptId;
  }
}

/** `connect()`'s error for a failed connect, typed by errno and naming the path. */
export function connectError(path: string, e: NodeJS.ErrnoException): ConnectionError {
  const why = e.message;
  switch (e.code) {
    case "ENOENT":
      return new SocketNotFoundError(path, `no scriptgated socket at ${path} (is the daemon running? set SCRIPTGATE_SOCKET or pass the path): ${why}`, { cause: e });
    case "ECONNREFUSED":
      return new ConnectionRefusedError(path, `connection refused at ${path}: nothing listens there (the daemon stopped, or a stale socket): ${why}`, { cause: e });
    case "EACCES":
    case "EPERM":
      return new PermissionDeniedError(path, `permission denied opening ${path}: this user may not use the socket (auth.allowed_groups, the socket's group): ${why}`, { cause: e });
    default:
      return new ConnectionError(path, `cannot connect to ${path}: ${why}`, { cause: e });
  }
}
