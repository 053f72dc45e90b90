/** JSON-RPC error codes of scriptgate-protocol(7). */
export const ErrorCode = {
  PARSE: -32700,
  INVALID_REQUEST: -32600,
  METHOD_NOT_FOUND: -32601,
  INVALID_PARAMS: -32602,
  INTERNAL: -32603,
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
 * An error answer from the daemon (or the same refusal found locally, e.g. by
 * {@link validateSnapshot}, which throws -32011 as the daemon would).
 * `reason`, `field` and `tool` come from the error's `data`.
 */
export class ScriptgateError extends Error {
  readonly code: number;
  readonly reason: string | undefined;
  readonly field: string | undefined;
  readonly tool: string | undefined;
  readonly data: unknown;
  /** The request method that was answered with this error, when known. */
  readonly method: string | undefined;

  constructor(code: number, message: string, data?: unknown, method?: string) {
    super(message);
    this.name = "ScriptgateError";
    this.code = code;
    this.data = data;
    this.method = method;
    const d = (data !== null && typeof data === "object" ? data : {}) as Record<string, unknown>;
    this.reason = str(d["reason"]);
    this.field = str(d["field"]);
    this.tool = str(d["tool"]);
  }

  static fromRpc(e: RpcErrorObject, method?: string): ScriptgateError {
    const code = typeof e.code === "number" ? e.code : ErrorCode.INTERNAL;
    const message = typeof e.message === "string" ? e.message : "error without a message";
    return new ScriptgateError(code, message, e.data, method);
  }
}

/** The connection to the daemon is closed (or failed); pending requests are rejected with it. */
export class ConnectionClosedError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "ConnectionClosedError";
  }
}
