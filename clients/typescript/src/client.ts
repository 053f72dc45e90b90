import { EventEmitter } from "node:events";
import { connect as netConnect } from "node:net";
import type { Duplex } from "node:stream";
import { ConnectionClosedError, ErrorCode, ScriptgateError, type RpcErrorObject } from "./errors.js";
import type {
  ApprovalDecision,
  ApprovalRequest,
  CancelResult,
  DaemonInfo,
  RevokeResult,
  ScriptResult,
  ScriptState,
  StartParams,
  StartResult,
  ToolAnswer,
  ToolCall,
} from "./protocol.js";

/** The default socket of a packaged daemon (`scriptgate.socket`). */
export const DEFAULT_SOCKET = "/run/scriptgate/scriptgate.sock";

/** The daemon's default `server.max_message_bytes`. */
export const DEFAULT_MAX_LINE_BYTES = 16 * 1024 * 1024;

export interface ToolCallContext {
  /** Aborted when the script finishes or the connection closes: its answer is no longer wanted. */
  signal: AbortSignal;
}

export type ToolHandler = (call: ToolCall, context: ToolCallContext) => ToolAnswer | Promise<ToolAnswer>;
export type ApprovalHandler = (request: ApprovalRequest) => ApprovalDecision | Promise<ApprovalDecision>;

export interface ClientOptions {
  /** Serves `tool.call`. Without one, calls are answered with a JSON-RPC error. */
  onToolCall?: ToolHandler;
  /** Serves `approval.request`. Without one, every approval is denied. */
  onApproval?: ApprovalHandler;
  /**
   * Longest line accepted from the daemon, in bytes (default 16 MiB, the daemon's own
   * default). A longer one closes the connection: nothing unbounded is buffered.
   */
  maxLineBytes?: number;
}

/** Options of the methods that address a script. */
export interface ScriptRefOptions {
  /**
   * A token of the script's run, to reach a script another connection started (or
   * one started before a reconnect).
   */
  token?: string;
}

export interface WaitOptions extends ScriptRefOptions {
  /** Give up after this many seconds: error -32017 `still_running`. */
  timeoutS?: number;
}

interface Pending {
  method: string;
  resolve: (v: unknown) => void;
  reject: (e: unknown) => void;
}

type Id = number | string | null;

interface Message {
  jsonrpc?: unknown;
  id?: Id;
  method?: unknown;
  params?: unknown;
  result?: unknown;
  error?: RpcErrorObject;
}

export interface ScriptgateClientEvents {
  /** `script.progress`. */
  progress: [state: ScriptState];
  /** `script.finished`. */
  finished: [result: ScriptResult];
  /** Any notification from the daemon, `script.progress` and `script.finished` included. */
  notification: [method: string, params: unknown];
  /** An error the daemon sent with id null (e.g. -32700), or a line that could not be read. */
  protocolError: [error: ScriptgateError];
  /** The connection closed; `error` says why when it was not `close()`. */
  close: [error: Error | undefined];
}

export declare interface ScriptgateClient {
  on<E extends keyof ScriptgateClientEvents>(event: E, listener: (...args: ScriptgateClientEvents[E]) => void): this;
  once<E extends keyof ScriptgateClientEvents>(event: E, listener: (...args: ScriptgateClientEvents[E]) => void): this;
  off<E extends keyof ScriptgateClientEvents>(event: E, listener: (...args: ScriptgateClientEvents[E]) => void): this;
  emit<E extends keyof ScriptgateClientEvents>(event: E, ...args: ScriptgateClientEvents[E]): boolean;
}

function isObject(v: unknown): v is Record<string, unknown> {
  return v !== null && typeof v === "object" && !Array.isArray(v);
}

function errorMessage(e: unknown): string {
  if (e instanceof Error) return e.message || e.name;
  return String(e);
}

/**
 * An engine's connection to scriptgated: JSON-RPC 2.0, one message per line, both
 * sides sending requests. Requests from the daemon (`tool.call`,
 * `approval.request`) are served concurrently with everything else: an
 * `approval.request` arrives before the `script.start` answer it gates.
 */
export class ScriptgateClient extends EventEmitter {
  private readonly socket: Duplex;
  private readonly maxLineBytes: number;
  private readonly pending = new Map<number, Pending>();
  private nextId = 1;
  private partial: Buffer[] = [];
  private partialBytes = 0;
  private closedError: Error | undefined;
  private closed = false;
  private closing = false;
  private peerRefusal: ScriptgateError | undefined;
  private readonly aborts = new Map<string, AbortController>();
  private toolHandler: ToolHandler | undefined;
  private approvalHandler: ApprovalHandler | undefined;

  /** Wrap a connected stream; see {@link ScriptgateClient.connect}. */
  constructor(socket: Duplex, options: ClientOptions = {}) {
    super();
    this.socket = socket;
    this.maxLineBytes = options.maxLineBytes ?? DEFAULT_MAX_LINE_BYTES;
    this.toolHandler = options.onToolCall;
    this.approvalHandler = options.onApproval;
    socket.on("data", (chunk: Buffer) => this.onData(chunk));
    socket.on("error", (e: Error) => {
      this.closedError ??= e;
    });
    socket.on("close", () => this.onClose());
    socket.on("end", () => socket.end());
  }

  /** Connect to the daemon's socket (default {@link DEFAULT_SOCKET}). */
  static connect(path: string = DEFAULT_SOCKET, options: ClientOptions = {}): Promise<ScriptgateClient> {
    return new Promise((resolve, reject) => {
      const s = netConnect(path);
      const fail = (e: Error) => reject(e);
      s.once("error", fail);
      s.once("connect", () => {
        s.off("error", fail);
        resolve(new ScriptgateClient(s, options));
      });
    });
  }

  /** Set (or clear) the `tool.call` handler. */
  onToolCall(handler: ToolHandler | undefined): this {
    this.toolHandler = handler;
    return this;
  }

  /** Set (or clear) the `approval.request` handler. */
  onApproval(handler: ApprovalHandler | undefined): this {
    this.approvalHandler = handler;
    return this;
  }

  /** Whether the connection is closed. */
  get isClosed(): boolean {
    return this.closed;
  }

  // ---- methods the engine calls -------------------------------------------

  /** `script.start`: resolves once the script runs (after its approval, if one is needed). */
  start(params: StartParams): Promise<StartResult> {
    const p: StartParams = { token: params.token, code: params.code, tools: params.tools ?? [] };
    p.description = params.description ?? "";
    return this.request("script.start", p) as Promise<StartResult>;
  }

  /** `script.wait`: the result object once the script has finished. */
  wait(scriptId: string, options: WaitOptions = {}): Promise<ScriptResult> {
    const p = this.ref(scriptId, options);
    if (options.timeoutS !== undefined) p["timeout_s"] = options.timeoutS;
    return this.request("script.wait", p) as Promise<ScriptResult>;
  }

  /** `script.start`, then `script.wait`. */
  async run(params: StartParams, options: WaitOptions = {}): Promise<ScriptResult> {
    const { script_id } = await this.start(params);
    return this.wait(script_id, options);
  }

  /** `script.status`. */
  status(scriptId: string, options: ScriptRefOptions = {}): Promise<ScriptState> {
    return this.request("script.status", this.ref(scriptId, options)) as Promise<ScriptState>;
  }

  /** `script.cancel`: resolves once the script has ended. */
  cancel(scriptId: string, options: ScriptRefOptions = {}): Promise<CancelResult> {
    return this.request("script.cancel", this.ref(scriptId, options)) as Promise<CancelResult>;
  }

  /** `run.revoke`: cancels the run's scripts and refuses its further starts and calls. */
  revoke(token: string): Promise<RevokeResult> {
    return this.request("run.revoke", { token }) as Promise<RevokeResult>;
  }

  /** `run.describe`: the `run_script` tool description for the token's snapshot. */
  async describe(token: string): Promise<string> {
    const r = (await this.request("run.describe", { token })) as { text: string };
    return r.text;
  }

  /** `daemon.info`. */
  info(): Promise<DaemonInfo> {
    return this.request("daemon.info", {}) as Promise<DaemonInfo>;
  }

  /**
   * Send any request (e.g. the `admin.*` extension) and resolve with its result;
   * an error answer rejects with a {@link ScriptgateError}.
   */
  request(method: string, params: unknown = {}): Promise<unknown> {
    if (this.closed || this.closing) {
      return Promise.reject(this.closeReason(`connection closed; ${method} not sent`));
    }
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { method, resolve, reject });
      if (!this.send({ jsonrpc: "2.0", id, method, params })) {
        this.pending.delete(id);
        reject(new TypeError(`${method}: params cannot be sent as JSON`));
      }
    });
  }

  /** Close the connection; scripts this connection started are cancelled by the daemon. */
  close(): Promise<void> {
    if (this.closed) return Promise.resolve();
    this.closing = true;
    return new Promise((resolve) => {
      this.socket.once("close", () => resolve());
      this.socket.end();
      // A peer that does not close its side within a second is cut off.
      setTimeout(() => this.socket.destroy(), 1000).unref();
    });
  }

  private ref(scriptId: string, options: ScriptRefOptions): Record<string, unknown> {
    const p: Record<string, unknown> = { script_id: scriptId };
    if (options.token !== undefined) p["token"] = options.token;
    return p;
  }

  // ---- reading --------------------------------------------------------------

  private onData(chunk: Buffer): void {
    let start = 0;
    for (;;) {
      const nl = chunk.indexOf(10, start);
      if (nl === -1) break;
      const piece = chunk.subarray(start, nl);
      start = nl + 1;
      if (this.partialBytes + piece.length > this.maxLineBytes) {
        this.overflow();
        return;
      }
      const line = this.partial.length ? Buffer.concat([...this.partial, piece]) : piece;
      this.partial = [];
      this.partialBytes = 0;
      this.onLine(line);
      if (this.closed) return;
    }
    if (start < chunk.length) {
      const rest = Buffer.from(chunk.subarray(start));
      this.partialBytes += rest.length;
      if (this.partialBytes > this.maxLineBytes) {
        this.overflow();
        return;
      }
      this.partial.push(rest);
    }
  }

  private overflow(): void {
    this.partial = [];
    this.partialBytes = 0;
    this.closedError ??= new ConnectionClosedError(
      `the daemon sent a line longer than maxLineBytes (${this.maxLineBytes}); connection closed`,
    );
    this.socket.destroy();
  }

  private onLine(line: Buffer): void {
    const text = line.toString("utf8").trim();
    if (text === "") return;
    let msg: Message;
    try {
      const v: unknown = JSON.parse(text);
      if (!isObject(v)) throw new Error("not a JSON object");
      msg = v as Message;
    } catch (e) {
      this.emitSafely("protocolError", new ScriptgateError(ErrorCode.PARSE, `unreadable line from the daemon: ${errorMessage(e)}`));
      return;
    }
    if (typeof msg.method === "string") {
      if (msg.id !== undefined && msg.id !== null) this.serve(msg.id, msg.method, msg.params);
      else this.onNotification(msg.method, msg.params);
      return;
    }
    if (msg.id === undefined || msg.id === null) {
      const err = ScriptgateError.fromRpc(isObject(msg.error) ? msg.error : { code: ErrorCode.INVALID_REQUEST, message: "message without id or method" });
      if (err.code === ErrorCode.PEER) this.peerRefusal = err;
      this.emitSafely("protocolError", err);
      return;
    }
    const p = typeof msg.id === "number" ? this.pending.get(msg.id) : undefined;
    if (!p) {
      this.emitSafely("protocolError", new ScriptgateError(ErrorCode.INVALID_REQUEST, `answer to unknown request id ${JSON.stringify(msg.id)}`));
      return;
    }
    this.pending.delete(msg.id as number);
    if (msg.error !== undefined) p.reject(ScriptgateError.fromRpc(isObject(msg.error) ? msg.error : { code: ErrorCode.INTERNAL, message: "malformed error object" }, p.method));
    else p.resolve(msg.result);
  }

  private onNotification(method: string, params: unknown): void {
    if (method === "script.finished" && isObject(params) && typeof params["script_id"] === "string") {
      const id = params["script_id"];
      this.aborts.get(id)?.abort(new Error(`script ${id} finished`));
      this.aborts.delete(id);
    }
    this.emitSafely("notification", method, params);
    if (method === "script.progress") this.emitSafely("progress", params as ScriptState);
    else if (method === "script.finished") this.emitSafely("finished", params as ScriptResult);
  }

  /** A throwing listener must not stop the reader: its error is rethrown on its own tick. */
  private emitSafely<E extends keyof ScriptgateClientEvents>(event: E, ...args: ScriptgateClientEvents[E]): void {
    try {
      this.emit(event, ...args);
    } catch (e) {
      process.nextTick(() => {
        throw e;
      });
    }
  }

  // ---- serving the daemon's requests ---------------------------------------

  private serve(id: Id, method: string, params: unknown): void {
    // Never awaited here: the reader goes on with the next line at once, and a
    // synchronous handler runs after the current chunk has been dispatched.
    void Promise.resolve()
      .then(() => this.dispatch(method, params))
      .then(
        (result) => this.answer(id, { result }),
        (e: unknown) => {
          const code = e instanceof ScriptgateError ? e.code : -32000;
          this.answer(id, { error: { code, message: errorMessage(e) } });
        },
      );
  }

  private async dispatch(method: string, params: unknown): Promise<unknown> {
    switch (method) {
      case "tool.call": {
        const h = this.toolHandler;
        if (!h) throw new ScriptgateError(ErrorCode.METHOD_NOT_FOUND, "this engine serves no tool calls (no tool handler registered)");
        const call = params as ToolCall;
        const r: unknown = await h(call, { signal: this.abortFor(call.script_id) });
        if (!isObject(r)) {
          throw new ScriptgateError(ErrorCode.INTERNAL, `the tool handler for ${call.tool} returned ${r === null ? "null" : typeof r}, not a result object`);
        }
        return r;
      }
      case "approval.request": {
        const h = this.approvalHandler;
        if (!h) return { decision: "deny" };
        const d: unknown = await h(params as ApprovalRequest);
        if (d === true || d === "allow_once") return { decision: "allow_once" };
        if (d === false || d === "deny") return { decision: "deny" };
        throw new ScriptgateError(ErrorCode.INTERNAL, `the approval handler answered ${JSON.stringify(d)}; expected "allow_once", "deny" or a boolean`);
      }
      default:
        throw new ScriptgateError(ErrorCode.METHOD_NOT_FOUND, `method not found: ${method}`);
    }
  }

  private abortFor(scriptId: string): AbortSignal {
    let c = this.aborts.get(scriptId);
    if (!c) {
      c = new AbortController();
      if (this.closed) c.abort(this.closeReason("connection closed"));
      else this.aborts.set(scriptId, c);
    }
    return c.signal;
  }

  private answer(id: Id, body: { result: unknown } | { error: RpcErrorObject }): void {
    if (this.closed) return;
    if (!this.send({ jsonrpc: "2.0", id, ...body })) {
      this.send({ jsonrpc: "2.0", id, error: { code: ErrorCode.INTERNAL, message: "the handler's answer cannot be sent as JSON" } });
    }
  }

  /** Write one message; false when it cannot be serialized. */
  private send(msg: unknown): boolean {
    let line: string;
    try {
      line = JSON.stringify(msg);
    } catch {
      return false;
    }
    if (line === undefined) return false;
    if (!this.closed) this.socket.write(line + "\n");
    return true;
  }

  // ---- closing ----------------------------------------------------------------

  private closeReason(what: string): Error {
    return this.peerRefusal ?? new ConnectionClosedError(what, { cause: this.closedError });
  }

  private onClose(): void {
    if (this.closed) return;
    this.closed = true;
    const reason = this.closeReason("connection to scriptgated closed");
    for (const p of this.pending.values()) p.reject(reason);
    this.pending.clear();
    for (const c of this.aborts.values()) c.abort(reason);
    this.aborts.clear();
    this.emitSafely("close", this.closing && !this.closedError ? undefined : (this.peerRefusal ?? this.closedError ?? reason));
  }
}
